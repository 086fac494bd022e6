// dev/cuda/phase_probe.cu: where a CTA of the chunk kernels spends its cycles. The library's chunk_prep and
// bwd_chunk, built with -DPATHATTN_PHASE_PROBE, stamp clock64() after each barrier-closed phase
// (PA_PROBE in src/cuda/device/); this program runs them through their launchers on a benchmark shape
// (docs/benchmarks.md; B * T = 32768, T = 1024, MHA, bf16; random inputs and gradients) and prints, per phase, the mean cycles
// over the first kProbeCtas CTAs and the share of a CTA's time, beside the kernel's median time.
// Build and run from the repository root:
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -Isrc -DPATHATTN_PHASE_PROBE \
//        dev/cuda/phase_probe.cu src/cuda/kernels/prep_chunk.cu src/cuda/kernels/bwd_chunk.cu -o phase_probe && ./phase_probe
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "cuda/device/common.cuh"
#include "cuda/launchers.h"
#include "tf32_nt.cuh"

#ifndef PATHATTN_PHASE_PROBE
#error "build with -DPATHATTN_PHASE_PROBE (see the header)"
#endif

namespace pathattn::cuda {
cudaError_t probe_table_prep(long long* host);
cudaError_t probe_table_bwd_chunk(long long* host);
}  // namespace pathattn::cuda

using namespace pathattn::cuda;

namespace {

__device__ float hash_uniform(size_t i, uint32_t seed) {  // in [-1, 1)
  uint32_t x = uint32_t(i) * 0x9E3779B9u ^ uint32_t(i >> 32) * 0x85EBCA6Bu ^ seed * 0xC2B2AE35u;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return float(x >> 8) * (2.f / 16777216.f) - 1.f;
}

template <typename E>
__global__ void fill(E* x, size_t n, uint32_t seed, float scale, float offset) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = from_f<E>(offset + scale * hash_uniform(i, seed));
}

__global__ void normalize_rows(float* w, size_t rows, int K) {
  const size_t r = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  float n = 0.f;
  for (int d = 0; d < K; ++d) n += w[r * K + d] * w[r * K + d];
  const float inv = rsqrtf(fmaxf(n, 1e-12f));
  for (int d = 0; d < K; ++d) w[r * K + d] *= inv;
}

template <typename E>
E* alloc_fill(size_t n, uint32_t seed, float scale, float offset = 0.f) {
  E* p = nullptr;
  CK(cudaMalloc(&p, n * sizeof(E)));
  fill<E><<<1024, 256>>>(p, n, seed, scale, offset);
  CK(cudaGetLastError());
  return p;
}

// phases: (slot, what ran since the previous slot listed) in slot order, the first the kernel's start.
void report(const char* kernel, const std::vector<std::pair<int, const char*>>& phases, int nctas,
            cudaError_t (*table)(long long*), float ms, size_t smem, int clock_khz) {
  std::vector<long long> t(size_t(kProbeCtas) * kProbeSlots);
  CK(table(t.data()));
  const int n = nctas < kProbeCtas ? nctas : kProbeCtas, np = int(phases.size());
  std::vector<double> mean(np, 0.0);
  double total = 0.0;
  for (int c = 0; c < n; ++c) {
    const long long* row = t.data() + size_t(c) * kProbeSlots;
    for (int i = 1; i < np; ++i) mean[i] += double(row[phases[i].first] - row[phases[i - 1].first]) / n;
    total += double(row[phases[np - 1].first] - row[phases[0].first]) / n;
  }
  std::printf("%s: %.3f ms, %d CTAs, %zu KB shared memory; a CTA (mean of the first %d): %.0f cycles = %.1f us\n",
              kernel, ms, nctas, smem / 1024, n, total, total / clock_khz * 1e3);
  for (int i = 1; i < np; ++i)
    std::printf("  %2d %-44s %9.0f cycles %5.1f%%\n", phases[i].first, phases[i].second, mean[i],
                100.0 * mean[i] / total);
}

template <int K>
void run(int T, int H) {
  const int B = 32768 / T, HQ = H, V = K, C = kChunk, nc = T / C;
  const size_t NT = size_t(B) * T;
  using bf = __nv_bfloat16;
  bf* q = alloc_fill<bf>(NT * HQ * K, 1, 1.f);
  bf* k = alloc_fill<bf>(NT * H * K, 2, 1.f);
  bf* v = alloc_fill<bf>(NT * H * V, 3, 1.f);
  float* w = alloc_fill<float>(NT * H * K, 4, 1.f);
  normalize_rows<<<int((NT * H + 255) / 256), 256>>>(w, NT * H, K);
  float* beta = alloc_fill<float>(NT * H, 5, 1.f, 1.f);  // U(0, 2)
  std::vector<ChunkDesc> chunks;
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < nc; ++c) chunks.push_back({b, 0, T, c, b * nc, 0});
  ChunkDesc* dch = nullptr;
  CK(cudaMalloc(&dch, chunks.size() * sizeof(ChunkDesc)));
  CK(cudaMemcpy(dch, chunks.data(), chunks.size() * sizeof(ChunkDesc), cudaMemcpyHostToDevice));

  KernelParams kp = dev::mha_params(B, T, H, K, V, q, k, v, w, beta);
  kp.chunks = dch, kp.nchunks = int(chunks.size()), kp.max_chunks = nc;
  // chunk_prep outputs; bwd_chunk's inputs (scan gradients: small random values) and outputs.
  CK(cudaMalloc(&kp.w16, NT * H * K * 2));
  CK(cudaMalloc(&kp.w2h, NT * H * K * 2));
  CK(cudaMalloc(&kp.kt, NT * H * K * 2));
  CK(cudaMalloc(&kp.qtl, NT * HQ * K * 4));
  CK(cudaMalloc(&kp.aloc, NT * HQ * C * 4));
  kp.dP = alloc_fill<float>(size_t(kp.nchunks) * H * K * K, 6, 1e-2f);
  kp.dkt = alloc_fill<float>(NT * H * K, 7, 1e-2f);
  kp.dqt = alloc_fill<float>(NT * HQ * K, 8, 1e-2f);
  kp.dvdiag = alloc_fill<float>(NT * HQ * V, 9, 1e-2f);
  kp.dvk = alloc_fill<float>(NT * H * V, 10, 1e-2f);
  CK(cudaMalloc(&kp.dq, NT * HQ * K * 2));
  CK(cudaMalloc(&kp.dk, NT * H * K * 2));
  CK(cudaMalloc(&kp.dv, NT * H * V * 2));
  CK(cudaMalloc(&kp.dw, NT * H * K * 4));
  CK(cudaMalloc(&kp.dbeta, NT * H * 4));
  CK(cudaDeviceSynchronize());

  int dev = 0, clock_khz = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  const int nctas = kp.nchunks * H;
  std::printf("K = V = %d, H = HQ = %d, T = %d, B = %d (SM clock %.0f MHz)\n", K, H, T, B, clock_khz / 1e3);
  auto prep = [&] { CK(launch_chunk_prep(kp, 1, 0)); };
  const float t_prep = dev::median_ms(prep, 9);  // the last run leaves its stamps
  CK(cudaDeviceSynchronize());
  report("chunk_prep", {{0, "start"}, {1, "load K, W, beta"}, {2, "A = diag(b) W W^T (split tf32)"},
                        {3, "E = (I + A)^-1 (and E's store)"}, {4, "W2 = E diag(b) W (split), Z = W K^T; W to fp16"},
                        {5, "U = E diag(b) Z"}, {6, "k~, w16 / w2h stores"}, {7, "Q loaded"}, {8, "X = Q W^T"},
                        {9, "q~, A_loc (thread 0's end)"}},
         nctas, probe_table_prep, t_prep, smem_chunk_prep(K), clock_khz);
  // bwd_chunk reads E from the backward's chunk_prep (the variant that stores it).
  CK(cudaMalloc(&kp.E, size_t(kp.nchunks) * H * C * C * 4));
  prep();
  // aloc now holds chunk_prep's logits; bwd_chunk reads it as scale dS: replace by small values.
  fill<float><<<1024, 256>>>(kp.aloc, NT * HQ * C, 11, 1e-2f, 0.f);
  auto bwd = [&] { CK(launch_bwd_chunk(kp, 1, 0)); };
  const float t_bwd = dev::median_ms(bwd, 9);
  CK(cudaDeviceSynchronize());
  report("bwd_chunk", {{0, "start"}, {1, "load K, W (beta)"}, {4, "Z; E, W2 loaded"}, {5, "U; dk~ (D) loaded"},
                       {6, "dW2 -= W dP; dW -= W2 dP^T + U dk~; dU"}, {7, "load Q, X, load dq~ / dA_loc"},
                       {8, "dX"}, {9, "dq; dK, dW, dW2 sums; dU"}, {10, "E back, Z (K = 128), stage dW2"},
                       {11, "dE, dZb"}, {12, "dbeta, dW, dK, dWb, M1"}, {13, "dA"}, {14, "Gram, dW, dbeta"},
                       {15, "outputs (thread 0's end)"}},
         nctas, probe_table_bwd_chunk, t_bwd, smem_bwd_chunk(K), clock_khz);
  void* bufs[] = {q, k, v, w, beta, dch, kp.E, kp.w16, kp.w2h, kp.kt, kp.qtl, kp.aloc, kp.dP, kp.dkt, kp.dqt,
                  kp.dvdiag, kp.dvk, kp.dq, kp.dk, kp.dv, kp.dw, kp.dbeta};
  for (void* b : bufs) CK(cudaFree(b));
}

}  // namespace

int main() {
  run<128>(1024, 16);
  run<64>(1024, 32);
  return 0;
}
