// dev/cuda/tf32_fragments.cu: how much of a chunk-kernel product is fragment assembly? Self-checking,
// self-timing playground for the v3 plan (HISTORY.md, "Profile of v2.1"): the 64 x N x KD tf32 products of the
// chunk kernels with one operand stored [row][k] and the other [col][k] in shared memory (A = W W^T,
// Z = W K^T, X = Q W^T), computed
//   v0: with the library's accessor-fed fragments (mma_tc_acc from src/cuda/device/, as the kernels do);
//   v1: with ldmatrix-fed fragments: an 8 x 4 tile of 32-bit words is one ldmatrix 8 x 8 b16 matrix, and the
//       m16n8k8 tf32 A fragment (rows g / g + 8, columns t / t + 4) is four of them (one ldmatrix.x4); the B
//       fragment of two k-steps is one more. Same tiling, same conversions (to_tf32), same mma order.
//   v2: v1 without conversions in the loop: plain tf32 operands are rounded once when staged (tf32_exact, so the
//       products equal v0's bit for bit); split-tf32 operands stay fp32 and split by a mask (head = the top 19
//       bits, tail = x - head, exact in fp32, passed as is: its own truncation is 2^-21 of x).
// Check: v1 (and plain v2) equal v0 bit for bit; every variant matches an fp64 host product within the tf32
// (or split-tf32) bound.
// Timing: a grid of chunk-kernel size (8192 CTAs of 16 warps), each CTA repeating the product; optional
// extra shared memory to hold one CTA per SM as the real kernels do.
// Build and run (from the repository root; sm_90a, or sm_80 for an A100):
//   nvcc -std=c++17 -O3 -arch=sm_90a -Isrc dev/cuda/tf32_fragments.cu -o tf32_fragments && ./tf32_fragments
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/device/common.cuh"
#include "tf32_nt.cuh"

using namespace pathattn::cuda;

constexpr int kM = 64;

// Each CTA loads its A [64][KD] and B [N][KD] (row-major in global) into shared memory (leading dim
// KD + 4: conflict-free for both fragment patterns), runs `reps` products into one accumulator, writes it.
template <int V, int N, int KD, bool kX3>
__global__ void __launch_bounds__(kTcThreads) product_kernel(const float* A, const float* B, float* out, int reps) {
  constexpr int LD = KD + 4;
  extern __shared__ float sm[];
  float* As = sm;
  float* Bs = sm + kM * LD;
  const float* Ag = A + size_t(blockIdx.x) * kM * KD;
  const float* Bg = B + size_t(blockIdx.x) * N * KD;
  for (int i = threadIdx.x; i < kM * KD; i += blockDim.x) As[(i / KD) * LD + i % KD] = Ag[i];
  for (int i = threadIdx.x; i < N * KD; i += blockDim.x) Bs[(i / KD) * LD + i % KD] = Bg[i];
  __syncthreads();
  if (V == 2 && !kX3) {  // round once where the operands are staged
    for (int i = threadIdx.x; i < (kM + N) * LD; i += blockDim.x) sm[i] = __uint_as_float(tf32_exact(sm[i]));
    __syncthreads();
  }
  using TT = TcTile<kM, N>;
  typename TT::Acc acc;
  TT::zero(acc);
  for (int rep = 0; rep < reps; ++rep) {
    if (V == 0) {
      mma_tc_acc<kM, N, KD, kX3>(acc, [&](int r, int k) { return As[r * LD + k]; },
                                 [&](int k, int n) { return Bs[n * LD + k]; });
    } else {
      dev::mma_nt<N, KD, kX3, V == 2>(acc, As, LD, Bs, LD);
    }
  }
  float* o = out + size_t(blockIdx.x) * kM * N;
  TT::each(acc, [&](int r, int c, float& v) { o[r * N + c] = v; });
}

template <int N, int KD, bool kX3>
void run_case(int blocks, int reps, int pad_kb) {
  constexpr int LD = KD + 4;
  const size_t smem = sizeof(float) * size_t(kM + N) * LD + size_t(pad_kb) * 1024;
  std::vector<float> hA(size_t(blocks) * kM * KD), hB(size_t(blocks) * N * KD);
  std::mt19937 rng(1234 + N + KD + kX3);
  std::normal_distribution<float> nd;
  for (float& x : hA) x = nd(rng);
  for (float& x : hB) x = nd(rng);
  float *dA, *dB, *dO[3];
  const size_t nout = size_t(blocks) * kM * N;
  CK(cudaMalloc(&dA, hA.size() * 4));
  CK(cudaMalloc(&dB, hB.size() * 4));
  for (float*& o : dO) CK(cudaMalloc(&o, nout * 4));
  CK(cudaMemcpy(dA, hA.data(), hA.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dB, hB.data(), hB.size() * 4, cudaMemcpyHostToDevice));
  using Kern = void (*)(const float*, const float*, float*, int);
  const Kern kerns[3] = {product_kernel<0, N, KD, kX3>, product_kernel<1, N, KD, kX3>, product_kernel<2, N, KD, kX3>};
  for (Kern k : kerns) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));

  // Check with one product per CTA.
  std::vector<std::vector<float>> h(3, std::vector<float>(nout));
  for (int v = 0; v < 3; ++v) {
    kerns[v]<<<blocks, kTcThreads, smem>>>(dA, dB, dO[v], 1);
    CK(cudaGetLastError());
    CK(cudaMemcpy(h[v].data(), dO[v], nout * 4, cudaMemcpyDeviceToHost));
  }
  size_t differ[3] = {0, 0, 0};
  double rel[3];
  for (int v = 0; v < 3; ++v) {
    for (size_t i = 0; i < nout; ++i) differ[v] += std::memcmp(&h[0][i], &h[v][i], 4) != 0;
    rel[v] = dev::rel_l2_products(
        4, N, KD, [&](int b, int r, int n) { return h[v][(size_t(b) * kM + r) * N + n]; },
        [&](int b, int r, int k) { return hA[(size_t(b) * kM + r) * KD + k]; },
        [&](int b, int k, int n) { return hB[(size_t(b) * N + n) * KD + k]; });
  }
  const double bound = kX3 ? 1e-5 : 2e-3;
  const bool ok = differ[1] == 0 && (kX3 || differ[2] == 0) && rel[0] <= bound && rel[1] <= bound && rel[2] <= bound;

  // Timing: `reps` products per CTA, median of 7 launches after a warm-up.
  float t[3];
  for (int v = 0; v < 3; ++v)
    t[v] = dev::median_ms([&] { kerns[v]<<<blocks, kTcThreads, smem>>>(dA, dB, dO[v], reps); }, 7);
  std::printf("64 x %3d x %3d %s smem %3zu KB: %s | rel L2 vs fp64 v0 %.1e v1 %.1e v2 %.1e (bound %.0e), bitwise "
              "differ from v0: v1 %zu v2 %zu | ms v0 %.3f v1 %.3f v2 %.3f | speedup v1 %.2fx v2 %.2fx\n",
              N, KD, kX3 ? "split-tf32" : "tf32      ", smem / 1024, ok ? "OK" : "FAIL", rel[0], rel[1], rel[2],
              bound, differ[1], differ[2], t[0], t[1], t[2], t[0] / t[1], t[0] / t[2]);
  CK(cudaFree(dA));
  CK(cudaFree(dB));
  for (float* o : dO) CK(cudaFree(o));
  if (!ok) std::exit(2);
}

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 8192, reps = argc > 2 ? std::atoi(argv[2]) : 8;
  std::printf("tf32 fragment assembly: %d CTAs x %d threads, %d products each\n", blocks, kTcThreads, reps);
  for (int pad : {0, 100}) {  // pad 100 KB: one CTA per SM, as chunk_prep / bwd_chunk run
    run_case<64, 128, false>(blocks, reps, pad);
    run_case<64, 128, true>(blocks, reps, pad);
    run_case<64, 64, false>(blocks, reps, pad);
    run_case<128, 64, false>(blocks, reps, pad);
  }
  return 0;
}
