// dev/cuda/inverse.cu: the chunk kernels' triangular inverse E = (I + A)^-1 (A strictly lower, 64 x 64), alone.
// Self-checking, self-timing playground for HISTORY.md v3.22. The phase probe puts the inverse at 16k cycles of an
// 84k-cycle chunk_prep CTA at K = 128 (19%; 29% at K = 64) and 10k of bwd_chunk's 155k. Versions:
//   v1: the library's before v3.22 (kept here as it was): the whole tile zero-filled above the diagonal and a
//       barrier; the four 16 x 16 diagonal blocks by forward substitution, 4 lanes a column, 15 dependent
//       steps of (loads, 2 shuffles, store, syncwarp); a barrier; doubling level 1 (16 -> 32) on four warps; a
//       barrier; level 2 (32 -> 64) on four warps; a barrier.
//   v2: the diagonal blocks in registers, one thread a column (right-looking: 120 fmas, a 15-step critical
//       path, no shuffles), while the other warps zero the blocks above the diagonal; level 1 in the same two
//       warps (block pairs (0, 1) and (2, 3) are each one warp's columns: a syncwarp, no CTA barrier); a
//       barrier; level 2 on four warps; a barrier. Two barriers against four.
// A per CTA: strict_lower(diag(b) W W^T) of unit rows w (K = 64 random directions; or 4 directions, the
// stress case of docs/algorithms.md), b ~ U(0, 2) or b = 2. Check: both versions against an fp64 forward
// substitution (max relative error over the entries of E, relative to max |E| of the tile). Timing: 8192 CTAs
// of 512 threads, `reps` inverses each, median of 7 launches, at one or two CTAs per SM (bwd_chunk runs one,
// chunk_prep two, at 64 registers).
// Build and run (from the repository root, sm_90a):
//   nvcc -std=c++17 -O3 -arch=sm_90a -Isrc -Idev/cuda dev/cuda/inverse.cu -o inverse && ./inverse
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/device/common.cuh"
#include "tf32_nt.cuh"

using namespace pathattn::cuda;

namespace {

constexpr int kN = 64, kLd = kN + 4;

// v1 (the library's unit_lower_inverse before v3.22).
__device__ __forceinline__ void inverse_v1(const float* A, int lda, float* E, int lde) {
  const int tid = threadIdx.x, warp = tid >> 5;
  for (int idx = tid; idx < 64 * 64; idx += kTcThreads) {
    const int r = idx >> 6, c = idx & 63;
    if (r <= c) E[r * lde + c] = r == c ? 1.f : 0.f;
  }
  __syncthreads();
  if (tid < 256) {
    const int c = tid >> 2, part = tid & 3, b0 = c & ~15;
    for (int r = b0 + 1; r < b0 + 16; ++r) {
      float s = 0.f;
      if (r > c)
        for (int t = c + part; t < r; t += 4) s = fmaf(A[r * lda + t], E[t * lde + c], s);
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (r > c && part == 0) E[r * lde + c] = -s;
      __syncwarp();
    }
  }
  __syncthreads();
  if (warp < 4) {
    const int d0 = 32 * (warp >> 1), r0 = d0 + 16, c0 = d0 + 8 * (warp & 1);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    warp_mma_f32x3<16>(acc, A + r0 * lda + d0, lda, E + d0 * lde + c0, lde);
    warp_store_c(E + r0 * lde + c0, lde, acc, 1.f);
    __syncwarp();
    float e21[4] = {0.f, 0.f, 0.f, 0.f};
    warp_mma_f32x3<16>(e21, E + r0 * lde + r0, lde, E + r0 * lde + c0, lde);
    __syncwarp();
    warp_store_c(E + r0 * lde + c0, lde, e21, -1.f);
  }
  __syncthreads();
  inverse_level2(A, lda, E, lde);  // the library's level 2, unchanged since v1
}

template <int V, int kMinBlocks>
__global__ void __launch_bounds__(kTcThreads, kMinBlocks) inverse_kernel(const float* A, float* E, int reps) {
  extern __shared__ float sm[];
  float* As = sm;
  float* Es = As + kN * kLd;
  const float* Ag = A + size_t(blockIdx.x) * kN * kN;
  for (int i = threadIdx.x; i < kN * kN; i += blockDim.x) As[(i / kN) * kLd + i % kN] = Ag[i];
  __syncthreads();
  for (int rep = 0; rep < reps; ++rep) {
    if constexpr (V == 1) inverse_v1(As, kLd, Es, kLd);
    else unit_lower_inverse(As, kLd, Es, kLd);
  }
  float* Eg = E + size_t(blockIdx.x) * kN * kN;
  for (int i = threadIdx.x; i < kN * kN; i += blockDim.x) Eg[i] = Es[(i / kN) * kLd + i % kN];
}

// fp64 E = (I + A)^-1 by forward substitution, column by column.
void inverse_ref(const float* A, std::vector<double>& E) {
  E.assign(kN * kN, 0.0);
  for (int c = 0; c < kN; ++c) {
    E[c * kN + c] = 1.0;
    for (int r = c + 1; r < kN; ++r) {
      double s = 0.0;
      for (int t = c; t < r; ++t) s += double(A[r * kN + t]) * E[t * kN + c];
      E[r * kN + c] = -s;
    }
  }
}

void run_case(int blocks, int reps, bool two_per_sm, int dirs, bool beta2) {
  const int pad_kb = two_per_sm ? 60 : 150;  // two CTAs per SM (chunk_prep, at 64 registers), one (bwd_chunk)
  std::vector<float> hA(size_t(blocks) * kN * kN, 0.f);
  std::mt19937 rng(777 + dirs + beta2);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.f, 2.f);
  constexpr int K = 64;
  std::vector<float> basis(size_t(dirs) * K), w(size_t(kN) * K), b(kN);
  constexpr int kDistinct = 64;  // distinct tiles, repeated over the grid
  for (int blk = 0; blk < std::min(blocks, kDistinct); ++blk) {
    for (float& x : basis) x = nd(rng);
    for (int r = 0; r < kN; ++r) {
      double n2 = 0;
      for (int d = 0; d < K; ++d) {
        float x = 0.f;
        for (int j = 0; j < dirs; ++j) x += nd(rng) * basis[size_t(j) * K + d];
        w[size_t(r) * K + d] = x;
        n2 += double(x) * x;
      }
      for (int d = 0; d < K; ++d) w[size_t(r) * K + d] = float(w[size_t(r) * K + d] / std::sqrt(n2));
      b[r] = beta2 ? 2.f : ud(rng);
    }
    float* Ab = hA.data() + size_t(blk) * kN * kN;
    for (int r = 0; r < kN; ++r)
      for (int c = 0; c < r; ++c) {
        double s = 0;
        for (int d = 0; d < K; ++d) s += double(w[size_t(r) * K + d]) * w[size_t(c) * K + d];
        Ab[r * kN + c] = float(b[r] * s);
      }
  }
  for (int blk = kDistinct; blk < blocks; ++blk)
    std::copy_n(hA.data() + size_t(blk % kDistinct) * kN * kN, kN * kN, hA.data() + size_t(blk) * kN * kN);
  float *dA, *dE[2];
  CK(cudaMalloc(&dA, hA.size() * 4));
  for (auto& p : dE) CK(cudaMalloc(&p, hA.size() * 4));
  CK(cudaMemcpy(dA, hA.data(), hA.size() * 4, cudaMemcpyHostToDevice));
  using Kern = void (*)(const float*, float*, int);
  Kern kerns[2] = {inverse_kernel<1, 1>, inverse_kernel<2, 1>};
  if (two_per_sm) kerns[0] = inverse_kernel<1, 2>, kerns[1] = inverse_kernel<2, 2>;
  const size_t smem = 2 * sizeof(float) * kN * kLd + size_t(pad_kb) * 1024;
  for (const Kern k : kerns) CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  double err[2] = {0, 0};
  std::vector<float> hE(hA.size());
  std::vector<double> ref;
  for (int v = 0; v < 2; ++v) {
    kerns[v]<<<blocks, kTcThreads, smem>>>(dA, dE[v], 1);
    CK(cudaGetLastError());
    CK(cudaMemcpy(hE.data(), dE[v], hE.size() * 4, cudaMemcpyDeviceToHost));
    for (int blk = 0; blk < 16; ++blk) {
      inverse_ref(hA.data() + size_t(blk) * kN * kN, ref);
      double mx = 0, e = 0;
      for (double x : ref) mx = std::max(mx, std::fabs(x));
      for (int i = 0; i < kN * kN; ++i) e = std::max(e, std::fabs(double(hE[size_t(blk) * kN * kN + i]) - ref[i]));
      err[v] = std::max(err[v], e / mx);
    }
  }
  const double bound = 1e-5;  // fp32 and split-tf32 work on O(1) entries (docs/algorithms.md: fp32-class accuracy)
  const bool ok = err[0] <= bound && err[1] <= bound;
  float t[2];
  for (int v = 0; v < 2; ++v)
    t[v] = dev::median_ms([&] { kerns[v]<<<blocks, kTcThreads, smem>>>(dA, dE[v], reps); }, 7);
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kerns[1], kTcThreads, smem));
  std::printf("w in %2d directions, beta %s, %d CTA(s) per SM: %s | max err / max|E| v1 %.1e v2 %.1e (bound %.0e) | "
              "ms v1 %.3f v2 %.3f (%.2fx)\n",
              dirs, beta2 ? "= 2      " : "~ U(0, 2)", per_sm, ok ? "OK" : "FAIL", err[0], err[1], bound, t[0], t[1],
              t[0] / t[1]);
  CK(cudaFree(dA));
  for (auto& p : dE) CK(cudaFree(p));
  if (!ok) std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 8192, reps = argc > 2 ? std::atoi(argv[2]) : 8;
  std::printf("triangular inverse: %d CTAs x %d threads, %d inverses each (v2 = src/cuda/device/)\n", blocks,
              kTcThreads, reps);
  for (const bool two : {true, false}) {
    run_case(blocks, reps, two, 64, false);
    run_case(blocks, reps, two, 4, true);
  }
  return 0;
}
