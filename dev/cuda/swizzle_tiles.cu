// dev/cuda/swizzle_tiles.cu: what do the chunk kernels' shared-memory bank conflicts cost, and does a swizzled
// fp32 tile layout remove them? Self-checking, self-timing playground for HISTORY.md v3.21 ("Next").
// The chunk kernels keep fp32 tiles [rows][cols] padded to cols + 4 words. mma_tc_acc (src/cuda/device/)
// reads an A operand at (row g, col t) and a B operand at (row k = t, col n = g) of its tile: with a pitch of
// 4 mod 32 words the first pattern is conflict-free and the second 2-way (lanes t and t + 1 overlap by four
// banks); a pitch of 8 mod 32 turns that around. A tile that serves in both roles (W, R1 in chunk_prep; Wf,
// dUs in bwd_chunk; R in super_bwd) cannot be padded free of both. Layouts:
//   pad4: pitch cols + 4 (the kernels' layout);
//   pad8: pitch cols + 8;
//   swz:  pitch cols, column c of row r stored at c ^ 4 rot3(r & 7), rot3 rotating three bits left by one:
//         the XOR stays inside the row's aligned 32-word blocks (16-byte pieces stay whole), and a brute-force
//         count finds one wavefront for both fragment patterns, as stored and transposed, and for float2 C
//         stores.
// Each CTA (16 warps, as chunk_prep and bwd_chunk) stages E [64][64], T [64][K] and G [K][64] in one layout and
// repeats two products, P1 = E T (T as B, read as stored) and P2 = T G (T as A, G as B read as stored): the
// patterns of W2 = E diag(b) W and of the UT adjoint's products.
// Check: every layout gives the same bits (only addresses differ); P1, P2 within tf32 error of an fp64 host
// product. Timing: 8192 CTAs, `reps` pairs of products each, median of 7 launches; optional extra shared memory
// to hold one CTA per SM as the real kernels do.
// Build and run (from the repository root, sm_90a):
//   nvcc -std=c++17 -O3 -arch=sm_90a -Isrc -Idev/cuda dev/cuda/swizzle_tiles.cu -o swizzle_tiles && ./swizzle_tiles
#include <cuda_runtime.h>

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

enum Layout { kPad4 = 0, kPad8 = 1, kSwz = 2 };
const char* const kLayoutName[3] = {"pad4", "pad8", "swz "};

// Element (r, c) of a [rows][COLS] fp32 tile in layout L.
template <int L, int COLS>
struct Tile {
  static constexpr int ld = L == kPad4 ? COLS + 4 : L == kPad8 ? COLS + 8 : COLS;
  static_assert(L != kSwz || COLS % 32 == 0, "swizzled tiles need whole 32-word row blocks");
  __host__ __device__ static constexpr int at(int r, int c) {
    if constexpr (L == kSwz) {
      const int s = r & 7, rot = ((s << 1) | (s >> 2)) & 7;
      return r * ld + (c ^ (4 * rot));
    } else {
      return r * ld + c;
    }
  }
  __host__ __device__ static constexpr size_t floats(int rows) { return size_t(rows) * ld; }
};

template <int L, int K>
__global__ void __launch_bounds__(kTcThreads) pair_kernel(const float* E, const float* T, const float* G, float* o1,
                                                          float* o2, int reps) {
  using TE = Tile<L, kM>;
  using TT = Tile<L, K>;
  using TG = Tile<L, kM>;
  extern __shared__ float sm[];
  float* Es = sm;
  float* Ts = Es + TE::floats(kM);
  float* Gs = Ts + TT::floats(kM);
  const float* Eg = E + size_t(blockIdx.x) * kM * kM;
  const float* Tg = T + size_t(blockIdx.x) * kM * K;
  const float* Gg = G + size_t(blockIdx.x) * K * kM;
  for (int i = threadIdx.x; i < kM * kM; i += blockDim.x) Es[TE::at(i / kM, i % kM)] = Eg[i];
  for (int i = threadIdx.x; i < kM * K; i += blockDim.x) Ts[TT::at(i / K, i % K)] = Tg[i];
  for (int i = threadIdx.x; i < K * kM; i += blockDim.x) Gs[TG::at(i / kM, i % kM)] = Gg[i];
  __syncthreads();
  using C1 = TcTile<kM, K>;
  using C2 = TcTile<kM, kM>;
  typename C1::Acc a1;
  typename C2::Acc a2;
  C1::zero(a1);
  C2::zero(a2);
  for (int rep = 0; rep < reps; ++rep) {
    // P1 = E T: E [64][64] as A, T [64][K] as B read as stored ([k][n]).
    mma_tc_acc<kM, K, kM, false>(a1, [&](int r, int k) { return Es[TE::at(r, k)]; },
                                 [&](int k, int n) { return Ts[TT::at(k, n)]; });
    // P2 = T G: T [64][K] as A, G [K][64] as B read as stored.
    mma_tc_acc<kM, kM, K, false>(a2, [&](int r, int k) { return Ts[TT::at(r, k)]; },
                                 [&](int k, int n) { return Gs[TG::at(k, n)]; });
  }
  float* p1 = o1 + size_t(blockIdx.x) * kM * K;
  float* p2 = o2 + size_t(blockIdx.x) * kM * kM;
  C1::each(a1, [&](int r, int c, float& v) { p1[r * K + c] = v; });
  C2::each(a2, [&](int r, int c, float& v) { p2[r * kM + c] = v; });
}

template <int K>
void run_case(int blocks, int reps, int pad_kb) {
  std::vector<float> hE(size_t(blocks) * kM * kM), hT(size_t(blocks) * kM * K), hG(size_t(blocks) * K * kM);
  std::mt19937 rng(4321 + K);
  std::normal_distribution<float> nd;
  for (auto* v : {&hE, &hT, &hG})
    for (float& x : *v) x = nd(rng);
  float *dE, *dT, *dG, *d1[3], *d2[3];
  const size_t n1 = size_t(blocks) * kM * K, n2 = size_t(blocks) * kM * kM;
  CK(cudaMalloc(&dE, hE.size() * 4));
  CK(cudaMalloc(&dT, hT.size() * 4));
  CK(cudaMalloc(&dG, hG.size() * 4));
  for (int v = 0; v < 3; ++v) {
    CK(cudaMalloc(&d1[v], n1 * 4));
    CK(cudaMalloc(&d2[v], n2 * 4));
  }
  CK(cudaMemcpy(dE, hE.data(), hE.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dT, hT.data(), hT.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dG, hG.data(), hG.size() * 4, cudaMemcpyHostToDevice));
  using Kern = void (*)(const float*, const float*, const float*, float*, float*, int);
  const Kern kerns[3] = {pair_kernel<kPad4, K>, pair_kernel<kPad8, K>, pair_kernel<kSwz, K>};
  size_t smem[3];
  smem[0] = 4 * (Tile<kPad4, kM>::floats(kM) + Tile<kPad4, K>::floats(kM) + Tile<kPad4, kM>::floats(K));
  smem[1] = 4 * (Tile<kPad8, kM>::floats(kM) + Tile<kPad8, K>::floats(kM) + Tile<kPad8, kM>::floats(K));
  smem[2] = 4 * (Tile<kSwz, kM>::floats(kM) + Tile<kSwz, K>::floats(kM) + Tile<kSwz, kM>::floats(K));
  for (int v = 0; v < 3; ++v) {
    smem[v] += size_t(pad_kb) * 1024;
    CK(cudaFuncSetAttribute(kerns[v], cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem[v])));
  }

  // Check with one pair of products per CTA.
  std::vector<std::vector<float>> h1(3, std::vector<float>(n1)), h2(3, std::vector<float>(n2));
  for (int v = 0; v < 3; ++v) {
    kerns[v]<<<blocks, kTcThreads, smem[v]>>>(dE, dT, dG, d1[v], d2[v], 1);
    CK(cudaGetLastError());
    CK(cudaMemcpy(h1[v].data(), d1[v], n1 * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2[v].data(), d2[v], n2 * 4, cudaMemcpyDeviceToHost));
  }
  size_t differ[3] = {0, 0, 0};
  for (int v = 1; v < 3; ++v) {
    for (size_t i = 0; i < n1; ++i) differ[v] += std::memcmp(&h1[0][i], &h1[v][i], 4) != 0;
    for (size_t i = 0; i < n2; ++i) differ[v] += std::memcmp(&h2[0][i], &h2[v][i], 4) != 0;
  }
  // P1 = E T, P2 = T G on the first four CTAs (operands row-major per CTA).
  const double rel1 = dev::rel_l2_products(
      4, K, kM, [&](int b, int r, int n) { return h1[0][(size_t(b) * kM + r) * K + n]; },
      [&](int b, int r, int k) { return hE[(size_t(b) * kM + r) * kM + k]; },
      [&](int b, int k, int n) { return hT[(size_t(b) * kM + k) * K + n]; });
  const double rel2 = dev::rel_l2_products(
      4, kM, K, [&](int b, int r, int n) { return h2[0][(size_t(b) * kM + r) * kM + n]; },
      [&](int b, int r, int k) { return hT[(size_t(b) * kM + r) * K + k]; },
      [&](int b, int k, int n) { return hG[(size_t(b) * K + k) * kM + n]; });
  const double bound = 2e-3;
  const bool ok = differ[1] == 0 && differ[2] == 0 && rel1 <= bound && rel2 <= bound;

  float t[3];
  for (int v = 0; v < 3; ++v)
    t[v] = dev::median_ms([&] { kerns[v]<<<blocks, kTcThreads, smem[v]>>>(dE, dT, dG, d1[v], d2[v], reps); }, 7);
  std::printf("K %3d, smem %3zu / %3zu / %3zu KB: %s | rel L2 vs fp64 P1 %.1e P2 %.1e (bound %.0e), bitwise differ "
              "from pad4: pad8 %zu swz %zu | ms %s %.3f %s %.3f %s %.3f | pad4 / swz %.2fx\n",
              K, smem[0] / 1024, smem[1] / 1024, smem[2] / 1024, ok ? "OK" : "FAIL", rel1, rel2, bound, differ[1],
              differ[2], kLayoutName[0], t[0], kLayoutName[1], t[1], kLayoutName[2], t[2], t[0] / t[2]);
  CK(cudaFree(dE));
  CK(cudaFree(dT));
  CK(cudaFree(dG));
  for (int v = 0; v < 3; ++v) {
    CK(cudaFree(d1[v]));
    CK(cudaFree(d2[v]));
  }
  if (!ok) std::exit(2);
}

int main(int argc, char** argv) {
  const int blocks = argc > 1 ? std::atoi(argv[1]) : 8192, reps = argc > 2 ? std::atoi(argv[2]) : 8;
  std::printf("fp32 tile layouts: %d CTAs x %d threads, %d product pairs each\n", blocks, kTcThreads, reps);
  for (int pad : {0, 120}) {  // pad 120 KB: one CTA per SM, as bwd_chunk runs
    run_case<128>(blocks, reps, pad);
    run_case<64>(blocks, reps, pad);
  }
  return 0;
}
