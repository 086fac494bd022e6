// dev/cuda/chain_floor.cu: what one dependent step of a chunk kernel's product chain costs, and how many chains an
// SM must run to hide it. Self-checking, self-timing playground for the per-chunk kernels' rebuild (HISTORY.md,
// "What the 3x-cuDNN bar at T = 4k asks of the per-token work"). One step is x <- x B for a 64 x K state x and a
// K x K matrix B (2 * 64 * K^2 flops), the next step's left operand being this one's result, as in the chunk
// kernels' chains (U = E diag(b) Z, the transports, the UT adjoint), taken four ways:
//   tf32_cta:  as the chunk kernels do today: a 512-thread CTA a chain, x and B^T in fp32 shared memory, the
//              product by block_mm_tc (tf32 mma.sync, operands by paired shared loads, src/cuda/device/), the
//              result stored back over x, two CTA barriers a step (the product's, and the one before the next
//              step reads x).
//   f16_warp:  x in registers, four warps a chain (16 rows each), B in fp16 shared memory through ldmatrix,
//              mma.sync m16n8k16 (warp_ps_step: rows scaled by powers of two first); no barrier at all.
//   f16_wgmma: x in registers, one warpgroup a chain, B in fp16 shared memory as column blocks of K rows x 64
//              with the 128-byte swizzle, wgmma with x as the register A operand (ps_product, rows scaled).
//   f16_wg_ss: as f16_wgmma, but x goes through shared memory each step (rows scaled, fp16, the same swizzled
//              layout) and both operands come from there, between two barriers of the warpgroup: the form a
//              product takes where the chain's state is not its left factor (a transposed or right operand).
// Chains a CTA (C) and CTAs an SM (R) set how many chains an SM holds at once. Printed per variant: ns a step
// (one chain's latency: every CTA runs `steps` steps), and TFLOP/s over the GPU (every chain's steps over the
// kernel's time).
// Check: each variant, 16 steps from a random x through B = a Householder reflection I - 2 u u^T (rounded to
// fp16, so all three see the same B), against an fp64 host chain on the same values: relative Frobenius error
// within 16 steps of 16-bit rounding (tf32 and fp16 both keep 11 significant bits).
// Build and run (from the repository root; sm_90a):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Isrc -Idev/cuda \
//        dev/cuda/chain_floor.cu -o chain_floor && ./chain_floor [steps]
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/device/common.cuh"
#include "cuda/device/hopper.cuh"
#include "tf32_nt.cuh"  // CK

using namespace pathattn::cuda;

constexpr int kRows = 64;

// A warp's 16 rows (16 (warp % 4) ..) of the row-major 64 x K fp32 matrix x0 into the C layout, and back.
template <int K>
__device__ void load_rows(float (&x)[K / 8][4], const float* x0) {
  const int lane = threadIdx.x & 31, r = 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2), c = 2 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
    x[nt][0] = x0[r * K + 8 * nt + c], x[nt][1] = x0[r * K + 8 * nt + c + 1];
    x[nt][2] = x0[(r + 8) * K + 8 * nt + c], x[nt][3] = x0[(r + 8) * K + 8 * nt + c + 1];
  }
}
template <int K>
__device__ void store_rows(float* out, const float (&x)[K / 8][4]) {
  const int lane = threadIdx.x & 31, r = 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2), c = 2 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
    out[r * K + 8 * nt + c] = x[nt][0], out[r * K + 8 * nt + c + 1] = x[nt][1];
    out[(r + 8) * K + 8 * nt + c] = x[nt][2], out[(r + 8) * K + 8 * nt + c + 1] = x[nt][3];
  }
}

// ---- tf32_cta: the chunk kernels' way. Shared memory: x [64][K + 4], B^T [K][K + 4] (fp32).
template <int K>
constexpr size_t tf32_smem() {
  return size_t(kRows + K) * (K + 4) * sizeof(float);
}
template <int K>
__global__ void __launch_bounds__(kTcThreads) tf32_cta(const float* x0, const float* B, float* out, int steps) {
  extern __shared__ float sm[];
  constexpr int ld = K + 4;
  float* xs = sm;
  float* bt = sm + kRows * ld;
  for (int i = threadIdx.x; i < kRows * K; i += blockDim.x) xs[(i / K) * ld + i % K] = x0[i];
  for (int i = threadIdx.x; i < K * K; i += blockDim.x) bt[(i % K) * ld + i / K] = B[i];  // bt[c][k] = B[k][c]
  __syncthreads();
  for (int s = 0; s < steps; ++s) {
    block_mm_tc<kRows, K, K, false, kTcUnroll(K)>(a_rows(xs, ld), b_rows(bt, ld),
                                                  [xs](int r, int c, float v) { xs[r * ld + c] = v; });
    __syncthreads();
  }
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < kRows * K; i += blockDim.x) out[i] = xs[(i / K) * ld + i % K];
}

// ---- f16_warp: C chains of four warps; B [k][n] fp16, leading dim K + 8 (ldmatrix without conflicts).
template <int K>
constexpr size_t f16_warp_smem() {
  return size_t(K) * (K + 8) * sizeof(__half);
}
template <int K>
__global__ void f16_warp(const float* x0, const float* B, float* out, int steps) {
  extern __shared__ __align__(16) uint8_t smw[];
  __half* bs = reinterpret_cast<__half*>(smw);
  for (int i = threadIdx.x; i < K * K; i += blockDim.x) bs[(i / K) * (K + 8) + i % K] = __float2half_rn(B[i]);
  __syncthreads();
  float x[K / 8][4];
  load_rows<K>(x, x0);
  for (int s = 0; s < steps; ++s) warp_ps_step<K, true>(x, bs, K + 8);
  if (blockIdx.x == 0 && threadIdx.x < 128) store_rows<K>(out, x);
}

// Element (r, c) of a tile with `rows` rows stored as column blocks of rows x 64 16-bit elements with the
// 128-byte swizzle (as TMA writes a tile and the wgmma descriptors of hopper.cuh read it).
__device__ __forceinline__ int sw128_at(int rows, int r, int c) {
  const int cc = c % 64;
  return (c / 64) * rows * 64 + r * 64 + ((((cc >> 3) ^ (r & 7)) << 3) | (cc & 7));
}
// The K x K fp32 matrix B into bs in fp16 in that layout (K rows), made visible to wgmma and to the block.
template <int K>
__device__ void stage_b_sw128(__half* bs, const float* B) {
  for (int i = threadIdx.x; i < K * K; i += blockDim.x) bs[sw128_at(K, i / K, i % K)] = __float2half_rn(B[i]);
  fence_async_smem();
  __syncthreads();
}

// ---- f16_wgmma: C chains of one warpgroup; B as column blocks of K rows x 64, 128-byte swizzle (as TMA writes
// a K x K tile and ps_product reads it), from a 1024-byte boundary.
template <int K>
constexpr size_t f16_wgmma_smem() {
  return size_t(K) * K * sizeof(__half) + 1024;
}
template <int K>
__global__ void f16_wgmma(const float* x0, const float* B, float* out, int steps) {
  extern __shared__ __align__(16) uint8_t smg[];
  __half* bs = reinterpret_cast<__half*>(align1k(smg));
  stage_b_sw128<K>(bs, B);
  float x[K / 8][4];
  load_rows<K>(x, x0);
  for (int s = 0; s < steps; ++s) ps_product<K, false, true>(x, bs);
  if (blockIdx.x == 0 && threadIdx.x < 128) store_rows<K>(out, x);
}

// ---- f16_wg_ss: per warpgroup, x's 64 x K fp16 tile (column blocks of 64 rows x 64, 128-byte swizzle) after
// B's tile, from a 1024-byte boundary.
template <int K>
constexpr size_t f16_wg_ss_smem(int chains) {
  return size_t(K) * K * sizeof(__half) + size_t(chains) * kRows * K * sizeof(__half) + 1024;
}
template <int K>
__global__ void f16_wg_ss(const float* x0, const float* B, float* out, int steps) {
  extern __shared__ __align__(16) uint8_t sms[];
  __half* bs = reinterpret_cast<__half*>(align1k(sms));
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  __half* xs = bs + K * K + wg * kRows * K;
  stage_b_sw128<K>(bs, B);
  float x[K / 8][4];
  load_rows<K>(x, x0);
  auto wg_bar = [wg]() { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory"); };
  for (int s = 0; s < steps; ++s) {
    float up[2];
    row_scale_down(x, up);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = 16 * warp + (lane >> 2) + 8 * hr;
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt) {
        *reinterpret_cast<uint32_t*>(xs + sw128_at(kRows, r, 8 * nt + 2 * (lane & 3))) =
            Pack2<__half>::pack(x[nt][2 * hr], x[nt][2 * hr + 1]);
      }
    }
    fence_async_smem();
    wg_bar();  // every warp's rows of x are in place
    const char* xa = reinterpret_cast<const char*>(xs);
    const char* bb = reinterpret_cast<const char*>(bs);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) {
      const uint64_t da = smem_desc_sw128(xa + (kt / 4) * kRows * 128 + (kt % 4) * 32, 16, 1024);
#pragma unroll
      for (int j = 0; j < K / 64; ++j)  // output columns 64 j .. 64 j + 63: B's column block j
        wg_ss<__half, 0, 1>(*reinterpret_cast<float(*)[8][4]>(&x[8 * j]),
                            da, smem_desc_sw128(bb + j * K * 128 + kt * 16 * 128, K * 128, 1024), kt > 0);
    }
    wg_commit();
    wg_wait<0>();
    fence_regs(x);
    wg_bar();  // every warp's product is done reading x's tile before the next step writes it
    row_scale_up(x, up);
  }
  if (blockIdx.x == 0 && threadIdx.x < 128) store_rows<K>(out, x);
}

struct Variant {
  const char* name;
  void (*kern)(const float*, const float*, float*, int);
  size_t smem;
  int threads;  // a CTA
  int chains;   // a CTA
};

template <int K>
std::vector<Variant> variants() {
  std::vector<Variant> v;
  v.push_back({"tf32_cta", tf32_cta<K>, tf32_smem<K>(), kTcThreads, 1});
  for (int c : {1, 2, 3, 4}) v.push_back({"f16_warp", f16_warp<K>, f16_warp_smem<K>(), 128 * c, c});
  for (int c : {1, 2, 3, 4}) v.push_back({"f16_wgmma", f16_wgmma<K>, f16_wgmma_smem<K>(), 128 * c, c});
  for (int c : {1, 2, 3, 4}) v.push_back({"f16_wg_ss", f16_wg_ss<K>, f16_wg_ss_smem<K>(c), 128 * c, c});
  return v;
}

// x <- x B, 16 steps, in fp64 on the host.
std::vector<double> host_chain(const std::vector<float>& x0, const std::vector<float>& B, int K, int steps) {
  std::vector<double> x(x0.begin(), x0.end()), y(x.size());
  for (int s = 0; s < steps; ++s) {
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < K; ++c) {
        double acc = 0;
        for (int k = 0; k < K; ++k) acc += x[r * K + k] * double(B[k * K + c]);
        y[r * K + c] = acc;
      }
    x.swap(y);
  }
  return x;
}

template <int K>
bool run(int steps, int sms) {
  std::mt19937 rng(1234 + K);
  std::normal_distribution<float> nd;
  auto h16 = [](float v) { return __half2float(__float2half_rn(v)); };  // the values every variant sees
  std::vector<float> x0(kRows * K), u(K), B(K * K);
  for (float& v : x0) v = h16(nd(rng));
  double un = 0;
  for (float& v : u) v = nd(rng), un += double(v) * v;
  for (int i = 0; i < K; ++i)
    for (int j = 0; j < K; ++j) B[i * K + j] = h16(float((i == j ? 1.0 : 0.0) - 2.0 * u[i] * u[j] / un));
  const int kCheck = 16;
  const std::vector<double> ref = host_chain(x0, B, K, kCheck);
  double rn = 0;
  for (double v : ref) rn += v * v;
  float *dx, *dB, *dout;
  CK(cudaMalloc(&dx, x0.size() * 4));
  CK(cudaMalloc(&dB, B.size() * 4));
  CK(cudaMalloc(&dout, x0.size() * 4));
  CK(cudaMemcpy(dx, x0.data(), x0.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dB, B.data(), B.size() * 4, cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  bool ok = true;
  const double step_flops = 2.0 * kRows * K * K;
  for (const Variant& v : variants<K>()) {
    CK(cudaFuncSetAttribute(v.kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(v.smem)));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, v.kern, v.threads, v.smem));
    if (per_sm == 0) {
      std::printf("K %3d %-9s C %d: does not fit an SM\n", K, v.name, v.chains);
      continue;
    }
    // Check.
    CK(cudaMemset(dout, 0xff, x0.size() * 4));
    v.kern<<<1, v.threads, v.smem>>>(dx, dB, dout, kCheck);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> got(x0.size());
    CK(cudaMemcpy(got.data(), dout, got.size() * 4, cudaMemcpyDeviceToHost));
    double en = 0;
    for (size_t i = 0; i < got.size(); ++i) en += (got[i] - ref[i]) * (got[i] - ref[i]);
    const double rel = std::sqrt(en / rn);
    const bool pass = std::isfinite(rel) && rel < 16 * std::ldexp(1.0, -11);
    ok = ok && pass;
    // Time: R = 1 .. per_sm CTAs an SM, one wave each.
    for (int R = 1; R <= std::min(per_sm, 4); ++R) {
      const int grid = sms * R;
      v.kern<<<grid, v.threads, v.smem>>>(dx, dB, dout, 64);  // warm
      CK(cudaGetLastError());
      float best = 1e30f;
      for (int rep = 0; rep < 5; ++rep) {
        CK(cudaEventRecord(e0));
        v.kern<<<grid, v.threads, v.smem>>>(dx, dB, dout, steps);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        best = std::min(best, ms);
      }
      const double chains_sm = double(v.chains) * R;
      std::printf("K %3d %-9s C %d R %d (%2.0f chains an SM): %7.1f ns a step, %6.1f TFLOP/s, check %.2e %s\n", K,
                  v.name, v.chains, R, chains_sm, 1e6 * best / steps,
                  step_flops * steps * v.chains * grid / (1e-3 * best) / 1e12, rel, pass ? "ok" : "FAIL");
    }
  }
  CK(cudaFree(dx));
  CK(cudaFree(dB));
  CK(cudaFree(dout));
  return ok;
}

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 2048;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::printf("chain_floor: needs an sm_90 GPU (found sm_%d%d)\n", prop.major, prop.minor);
    return 0;
  }
  std::printf("%s, %d SMs, %d steps a chain\n", prop.name, prop.multiProcessorCount, steps);
  const bool ok = run<64>(steps, prop.multiProcessorCount) & run<128>(steps, prop.multiProcessorCount);
  std::printf(ok ? "all checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
