// dev/cuda/chunk_prep_wg.cu: the forward chunk_prep (src/cuda/kernels/prep_chunk.cu: w16, w2h, kt, qtl, aloc, the same buffers)
// on Hopper wgmma: one warpgroup a (chunk, kv head) item, 3 (K = 128) or 4 (K = 64) items an SM (a CTA each, or all
// in one CTA), warpgroup barriers only. Checks itself against an fp64 UT transform and the library's kernel (every
// output) and times both (NOTES.md, "What the 3x-cuDNN bar at T = 4k asks of the per-token work").
// - Every product is a 16-bit wgmma with fp32 accumulation: tf32 wgmma reads operands K-major only (W2 = E diag(b) W
//   would need W^T stored), while one row-major fp16 W tile serves as a K-major and as an N-major operand.
// - A = diag(b) W W^T and W2 (split tf32 in the library) are split in fp16: x = hi + 2^-12 lo, lo = fp16((x - hi)
//   2^12), about 22 bits; the cross terms first, then that accumulator scaled by 2^-12 and hi x hi added to it.
//   The other products are plain, as the library's.
// - k, q, E diag(b) and the chained results (Z^T, U^T, X) are fp16 with each row scaled by a power of two into
//   [-1, 1) (tf32's 11 bits whatever the range; bf16 k and q exactly but for entries below 2^-17 of their row's
//   largest); the factors are undone in the fp32 epilogues.
// - A result that feeds the next product stays in registers as its A operand (Z^T = K W^T -> U^T = Z^T (E
//   diag(b))^T -> k~ = K - U^T W; per query head X = Q W^T -> X U, X W2). B operands are 128-byte-swizzled tiles:
//   W, W's residual, k; later E diag(b) hi / lo, W2, U^T over dead ones: 66 KB an item at K = 128.
// - The 64 x 64 inverse is the library's (unit_lower_inverse: scheme and arithmetic), in place, in the warpgroup.
// Build (repository root; -Xptxas -v: 167 / 126 registers at K = 128 / 64, no spills):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Isrc -Idev/cuda \
//        dev/cuda/chunk_prep_wg.cu src/cuda/kernels/prep_chunk.cu -o chunk_prep_wg
// Run: ./chunk_prep_wg [--check-only | --bench-only] [--debug] [--runs N]: small shapes (every item against fp64)
// unless --bench-only, then the bench shapes (sampled items; timing) unless --check-only; --debug compares wg1's
// A, E, Z^T, U^T, W2, X with fp64.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/device/common.cuh"
#include "cuda/device/hopper.cuh"
#include "cuda/launchers.h"
#include "tf32_nt.cuh"  // CK, median_ms, mha_params

using namespace pathattn::cuda;

namespace wgp {

constexpr int kC = kChunk;                 // 64 rows an item
constexpr float kLo = 4096.f;              // the residual operands' scale, 2^12
constexpr int kDbgSlots = 5;               // A, E, Z^T, U^T, X (first query head): 64 x 64 each; then W2 64 x K
template <int K>
constexpr int dbg_floats() { return kDbgSlots * kC * kC + kC * K; }

// One item's shared memory (bytes from a 1024-byte boundary). Tiles are 64 rows x K 16-bit elements as column
// blocks of 64 rows x 64 (128-byte rows, 128-byte swizzle), as TMA would write them:
//   oW   W in fp16 (w16)                          all along
//   oK   k, rows scaled into [-1, 1) (fp16)       all along
//   oR   W's residual 2^12 (W - fp16(W))          -> U^T (fp16, 64 x 64, rows scaled) from the U^T product on
//   oAE  A, then E in place (fp32 [64][68])       -> E diag(b) hi, lo (fp16 64 x 64 each) -> W2 (fp16 [s][d])
//   oMisc beta and the row factors of k, E diag(b), U^T (64 floats each)
template <int K>
struct Smem {
  static constexpr int kItemsPerSm = K == 128 ? 3 : 4;  // by shared memory at K = 128, by registers at K = 64
  static constexpr int kTile = kC * K * 2, kLE = kC + 4;
  static constexpr int oW = 0, oK = kTile, oR = 2 * kTile, oAE = 3 * kTile, oMisc = oAE + kC * kLE * 4;
  static constexpr int kBytes = (oMisc + 4 * kC * 4 + 1023) / 1024 * 1024;
  static_assert(kTile <= kC * kLE * 4 && 2 * kC * kC * 2 <= kC * kLE * 4, "W2, E diag(b) within A / E's space");
  static_assert(kC * kC * 2 <= kTile, "U^T within the residual's space");
};

// This thread's index in its warpgroup, read where it is called (volatile), and from it the thread's accumulator
// rows rr and column offset 2 t4 (C layout), read anew where a phase starts: the addresses derived from them are
// then recomputed there instead of held in registers across the item (which made ptxas spill).
__device__ __forceinline__ int tid_v() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t & 127;
}
#define WG_POS                               \
  const int tv_ = tid_v(), t4 = tv_ & 3; \
  const int rr[2] = {16 * (tv_ >> 5) + ((tv_ & 31) >> 2), 16 * (tv_ >> 5) + ((tv_ & 31) >> 2) + 8}

// Item `item`'s batch row, first position and first token, read from the chunk table where a phase needs them (an
// L1 hit; the barriers' memory clobbers keep the compiler from reusing an earlier read) instead of held in
// registers across the item.
struct ItemPos {
  int64_t b, pos0, tok0;
};
__device__ __forceinline__ ItemPos item_pos(const KernelParams& p, int item) {
  const ChunkDesc* c = p.chunks + item / p.H;
  const int64_t b = c->b, pos0 = c->t0 + int64_t(c->c) * kC;
  return {b, pos0, b * p.T + pos0};
}

// Phase probe (-DWG_PROBE): thread 0 of each item's warpgroup stamps clock64() at the end of each phase, for the
// first kProbeItems items; the host prints the mean cycles a phase (run_shape, bench shapes).
#ifdef WG_PROBE
constexpr int kProbeItems = 4096, kProbeSlots = 8;
__device__ long long g_wgp[kProbeItems][kProbeSlots];
#define WGP(slot)                                                                                  \
  do {                                                                                             \
    if ((threadIdx.x & 127) == 0 && item < wgp::kProbeItems) wgp::g_wgp[item][slot] = clock64(); \
  } while (0)
#else
#define WGP(slot) \
  do {            \
  } while (0)
#endif

__device__ __forceinline__ void wg_bar(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// Element (r, c) of a 64-row 16-bit tile in the swizzled layout (column blocks of 64 rows x 64).
__device__ __forceinline__ int sw_at(int r, int c) {
  const int cc = c & 63;
  return (c >> 6) * kC * 64 + r * 64 + ((((cc >> 3) ^ (r & 7)) << 3) | (cc & 7));
}
// Descriptors of a 64-row tile: K-major (the k-step's 16 columns, 32 bytes within a column block), and N-major
// (the k-step's 16 rows, column blocks of 64 n 8 KB apart), as fwd_far's k~ and v tiles.
// Each is built anew where it is used, from a base the compiler cannot see through (an empty volatile asm), plus
// the k-step's byte offset / 16 in the start-address field (no carry: shared addresses are below 2^18): left to
// itself, the compiler keeps the descriptors of every tile live across the item (which made ptxas spill).
__device__ __forceinline__ uint64_t opaque(uint64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}
__device__ __forceinline__ uint64_t kdesc(const void* tile, int kt) {
  return opaque(smem_desc_sw128(tile, 16, 1024)) + uint64_t(((kt / 4) * kC * 128 + (kt % 4) * 32) >> 4);
}
__device__ __forceinline__ uint64_t ndesc(const void* tile, int kt) {
  return opaque(smem_desc_sw128(tile, kC * 128, 1024)) + uint64_t((kt * 16 * 128) >> 4);
}

// d (64 x 32) += A B, A this warp's fp16 fragment (as wg_rs), B (16 x 32 fp16) from the descriptor db, K-major.
__device__ __forceinline__ void wg_rs32(float (&d)[4][4], const uint32_t (&a)[4], uint64_t db, int acc) {
#ifdef PA_SM90A
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
#endif
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h;
    memcpy(&h, &u, 4);
    return __half22float2(h);
  } else {
    __nv_bfloat162 h;
    memcpy(&h, &u, 4);
    return __bfloat1622float2(h);
  }
}

// 16-bit A fragments (type T; rows g: words 0, 2, rows g + 8: words 1, 3) as fp16 fragments with each row scaled by
// a power of two into [-1, 1); up gets the factors back (rows g, g + 8).
template <typename T, int KT>
__device__ __forceinline__ void half_frags_scaled(uint32_t (&dst)[KT][4], const uint32_t (&src)[KT][4],
                                                  float (&up)[2]) {
  float mx[2] = {0.f, 0.f};
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 v = unpack2<T>(src[kt][e]);
      mx[e & 1] = fmaxf(mx[e & 1], fmaxf(fabsf(v.x), fabsf(v.y)));
    }
  float down[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float m = fmaxf(mx[hr], __shfl_xor_sync(0xffffffffu, mx[hr], 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const int ex = scale_exp(m);
    down[hr] = ldexpf(1.f, -ex);
    up[hr] = ldexpf(1.f, ex);
  }
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 v = unpack2<T>(src[kt][e]);
      dst[kt][e] = Pack2<__half>::pack(v.x * down[e & 1], v.y * down[e & 1]);
    }
}

// E = (I + A)^-1 in place for a 64 x 64 strictly lower A (fp32, ld ld; zeros on and above the diagonal), by one
// warpgroup: unit_lower_inverse's scheme (src/cuda/device/inverse.cuh) and arithmetic, with warpgroup barriers. Each
// product's operands are read before its result overwrites them (A21's place holds A21 E11, then E21).
__device__ __forceinline__ void wg_inverse_inplace(float* T, int ld, int bar) {
  const int tid = threadIdx.x & 127, warp = tid >> 5;
  if (warp < 2) {
    const int c = tid, b0 = c & ~15, j = c & 15;
    float e[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) e[r] = r == j ? 1.f : 0.f;
#pragma unroll
    for (int t = 0; t < 15; ++t) {
      const float* At = T + b0 * ld + b0 + t;
#pragma unroll
      for (int r = t + 1; r < 16; ++r) e[r] = fmaf(-At[r * ld], e[t], e[r]);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 16; ++r) T[(b0 + r) * ld + c] = e[r];
    __syncwarp();
    // Level 1: warp w's diagonal block pair (2w, 2w + 1), E21 (16 x 16) as two 8-column strips.
    const int d0 = 32 * warp, r0 = d0 + 16;
    float acc[2][4] = {};
#pragma unroll
    for (int s = 0; s < 2; ++s) warp_mma_f32x3<16>(acc[s], T + r0 * ld + d0, ld, T + d0 * ld + d0 + 8 * s, ld);
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 2; ++s) warp_store_c(T + r0 * ld + d0 + 8 * s, ld, acc[s], 1.f);
    __syncwarp();
    float e21[2][4] = {};
#pragma unroll
    for (int s = 0; s < 2; ++s) warp_mma_f32x3<16>(e21[s], T + r0 * ld + r0, ld, T + r0 * ld + d0 + 8 * s, ld);
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 2; ++s) warp_store_c(T + r0 * ld + d0 + 8 * s, ld, e21[s], -1.f);
  }
  wg_bar(bar);
  // Level 2: rows 32..63, columns 0..31, one 8-column strip a warp.
  const int c0 = 8 * warp;
  float acc[2][4] = {};
#pragma unroll
  for (int m = 0; m < 2; ++m) warp_mma_f32x3<32>(acc[m], T + (32 + 16 * m) * ld, ld, T + c0, ld);
  wg_bar(bar);  // every warp has read all of A21
#pragma unroll
  for (int m = 0; m < 2; ++m) warp_store_c(T + (32 + 16 * m) * ld + c0, ld, acc[m], 1.f);
  __syncwarp();
  float e21[2][4] = {};
#pragma unroll
  for (int m = 0; m < 2; ++m) warp_mma_f32x3<32>(e21[m], T + (32 + 16 * m) * ld + 32, ld, T + 32 * ld + c0, ld);
  __syncwarp();
#pragma unroll
  for (int m = 0; m < 2; ++m) warp_store_c(T + (32 + 16 * m) * ld + c0, ld, e21[m], -1.f);
  wg_bar(bar);
}

// Stages a warp's C-layout 64 x (8 N) accumulator tile times row factors f (rows g, g + 8) into dst [64][ld].
template <int N>
__device__ __forceinline__ void dbg_tile(float* dst, int ld, const float (&x)[N][4], const float (&f)[2]) {
  const int lane = threadIdx.x & 31, r = 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2), c = 2 * (lane & 3);
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[(r + 8 * (e >> 1)) * ld + 8 * nt + c + (e & 1)] = x[nt][e] * f[e >> 1];
}

// One warpgroup an item (item = blockIdx.x NWG + warpgroup; chunk item / H, kv head item % H); NWG warpgroups a
// CTA, each on its own item and shared memory. kDbg: stage the intermediates of items < dbg_items into dbg.
// Registers: every accumulator of a wgmma batch plus its register A operand must stay below the cap (168 at
// K = 128, 128 at K = 64) with room, or ptxas serializes every wgmma of the kernel. So the split products take
// one accumulator in two batches (the 2^12-scaled cross terms, then the accumulator scaled down and hi x hi added),
// and k and q are kept as fp16 with row factors (exact for bf16 but for entries below 2^-17 of their row's
// largest), which serves both their products and the k~ / q~ epilogues.
template <typename T, int K, int NWG, bool kDbg>
__global__ void __launch_bounds__(128 * NWG, Smem<K>::kItemsPerSm / NWG)
    chunk_prep_wg(KernelParams p, float* dbg, int dbg_items) {
#ifdef PA_SM90A
  using S = Smem<K>;
  constexpr int LE = S::kLE;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const int wgi = threadIdx.x >> 7, bar = 1 + wgi;
  const int item = blockIdx.x * NWG + wgi;
  if (item >= p.nchunks * p.H) return;
  uint8_t* base = align1k(smem_raw) + wgi * S::kBytes;
  __half* Ws = reinterpret_cast<__half*>(base + S::oW);
  __half* Ks = reinterpret_cast<__half*>(base + S::oK);  // k, rows scaled by 1 / fk
  __half* Rs = reinterpret_cast<__half*>(base + S::oR);  // W's residual, then U^T
  float* AE = reinterpret_cast<float*>(base + S::oAE);   // A, E; then E diag(b) hi / lo; then W2
  __half* Ebh = reinterpret_cast<__half*>(base + S::oAE);
  __half* Ebl = Ebh + kC * kC;
  __half* W2s = Ebh;
  __half* Uts = Rs;
  float* bs = reinterpret_cast<float*>(base + S::oMisc);
  float* fk = bs + kC;  // k's row factors
  float* fe = fk + kC;  // E diag(b)'s row factors
  float* fu = fe + kC;  // U^T's row factors

  const int tid = threadIdx.x & 127, warp = tid >> 5, lane = tid & 31;
  const ChunkDesc ch = p.chunks[item / p.H];
  const int h = item % p.H, nq = min(kC, ch.len - ch.c * kC);
  const int64_t pos0 = ch.t0 + int64_t(ch.c) * kC, tok0 = ch.b * p.T + pos0;
  const T* qp = static_cast<const T*>(p.q);
  float* dbgi = kDbg && item < dbg_items ? dbg + int64_t(item) * dbg_floats<K>() : nullptr;
  WGP(0);

  // ---- The group's query tiles toward L2 (read per head at the end); k, W, beta into shared memory; w16 out.
  {
    constexpr int kLines = K * 2 / 128;  // 128-byte lines a query row
    for (int i = tid; i < p.group * kC * kLines; i += 128) {
      const int hi = i / (kC * kLines), r = (i / kLines) % kC, l = i % kLines;
      if (r < nq) prefetch_l2(qp + ch.b * p.q_s[0] + (pos0 + r) * p.q_s[1] + (h * p.group + hi) * p.q_s[2] + 64 * l);
    }
    // k: 16-byte pieces, a row's K / 8 pieces in as many consecutive lanes (its largest by shuffles).
    constexpr int kK8 = kC * K / 8 / 128, kRowLanes = K / 8;
    const T* kp = static_cast<const T*>(p.k);
    uint4 kv[kK8];
#pragma unroll
    for (int i = 0; i < kK8; ++i) {
      const int idx = tid + 128 * i, r = idx / kRowLanes, d = 8 * (idx % kRowLanes);
      kv[i] = r < nq ? *reinterpret_cast<const uint4*>(kp + ch.b * p.k_s[0] + (pos0 + r) * p.k_s[1] + h * p.k_s[2] + d)
                     : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kK8; ++i) {
      const int idx = tid + 128 * i, r = idx / kRowLanes, d = 8 * (idx % kRowLanes);
      uint32_t u[4] = {kv[i].x, kv[i].y, kv[i].z, kv[i].w};
      float mx = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 v = unpack2<T>(u[e]);
        mx = fmaxf(mx, fmaxf(fabsf(v.x), fabsf(v.y)));
      }
#pragma unroll
      for (int o = 1; o < kRowLanes; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const int ex = scale_exp(mx);
      const float down = ldexpf(1.f, -ex);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 v = unpack2<T>(u[e]);
        u[e] = Pack2<__half>::pack(v.x * down, v.y * down);
      }
      *reinterpret_cast<uint4*>(Ks + sw_at(r, d)) = make_uint4(u[0], u[1], u[2], u[3]);
      if (d == 0) fk[r] = ldexpf(1.f, ex);
    }
    constexpr int kW4 = kC * K / 4 / 128;
    float4 wv[kW4];
#pragma unroll
    for (int i = 0; i < kW4; ++i) {
      const int idx = tid + 128 * i, r = idx / (K / 4), d = 4 * (idx % (K / 4));
      wv[i] = r < nq && p.path
                  ? *reinterpret_cast<const float4*>(static_cast<const float*>(p.w) + ch.b * p.w_s[0] + (pos0 + r) * p.w_s[1] + h * p.w_s[2] + d)
                  : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (tid < kC) {
      const bool ok = tid < nq && p.path;
      bs[tid] = ok ? static_cast<const float*>(p.beta)[ch.b * p.beta_s[0] + (pos0 + tid) * p.beta_s[1] + h * p.beta_s[2]] : 0.f;
    }
#pragma unroll
    for (int i = 0; i < kW4; ++i) {
      const int idx = tid + 128 * i, r = idx / (K / 4), d = 4 * (idx % (K / 4));
      const float4 w = wv[i];
      const uint32_t h0 = Pack2<__half>::pack(w.x, w.y), h1 = Pack2<__half>::pack(w.z, w.w);
      const float2 f0 = unpack2<__half>(h0), f1 = unpack2<__half>(h1);
      const uint2 hv = make_uint2(h0, h1);
      *reinterpret_cast<uint2*>(Ws + sw_at(r, d)) = hv;
      *reinterpret_cast<uint2*>(Rs + sw_at(r, d)) =
          make_uint2(Pack2<__half>::pack((w.x - f0.x) * kLo, (w.y - f0.y) * kLo),
                     Pack2<__half>::pack((w.z - f1.x) * kLo, (w.w - f1.y) * kLo));
      if (r < nq) *reinterpret_cast<uint2*>(p.w16 + ((tok0 + r) * p.H + h) * K + d) = hv;
    }
    fence_async_smem();
    wg_bar(bar);
  }
  WGP(1);

  // ---- Z^T = strict_upper(K W^T) and A = strict_lower(diag(b) W W^T) (split: the cross terms first).
  uint32_t zf[4][4];  // Z^T (rows scaled by 1 / zc) as the U^T product's A operand
  float zc[2];
  {
    WG_POS;
    float accZ[8][4], accG[8][4];
    uint32_t kf[K / 16][4];
    frags_from_sw128<K / 16>(kf, Ks, kC, 16 * warp);
    fence_regs(kf);
    fence_regs(accZ, accG);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) wg_rs<__half, 0>(accZ, kf[kt], kdesc(Ws, kt), kt > 0);
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) {
      wg_ss<__half, 0, 0>(accG, kdesc(Ws, kt), kdesc(Rs, kt), kt > 0);
      wg_ss<__half, 0, 0>(accG, kdesc(Rs, kt), kdesc(Ws, kt), 1);
    }
    wg_commit();
    wg_wait<0>();
    fence_regs(accZ, accG);
    fence_regs(kf);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) accG[nt][e] *= 1.f / kLo;
    fence_regs(accG);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) wg_ss<__half, 0, 0>(accG, kdesc(Ws, kt), kdesc(Ws, kt), 1);
    wg_commit();
    // Z^T[c][t] = W_t . K_c for t > c, while hi x hi runs; rows scaled into [-1, 1) for its fp16 fragments.
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (8 * nt + 2 * t4 + (e & 1) <= rr[e >> 1]) accZ[nt][e] = 0.f;
    float up[2];
    row_scale_down(accZ, up);
    zc[0] = fk[rr[0]] * up[0];
    zc[1] = fk[rr[1]] * up[1];
    if (dbgi) dbg_tile(dbgi + 2 * kC * kC, kC, accZ, zc);
    pack_frags<__half, 4>(zf, accZ);
    wg_wait<0>();
    fence_regs(accG);
    // A -> AE (zeros on and above the diagonal, which the in-place inverse relies on).
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = rr[hr], c = 8 * nt + 2 * t4;
        const float v0 = c < r ? bs[r] * accG[nt][2 * hr] : 0.f, v1 = c + 1 < r ? bs[r] * accG[nt][2 * hr + 1] : 0.f;
        *reinterpret_cast<float2*>(AE + r * LE + c) = make_float2(v0, v1);
        if (dbgi) {
          dbgi[r * kC + c] = v0;
          dbgi[r * kC + c + 1] = v1;
        }
      }
  }
  wg_bar(bar);  // A in place
  WGP(2);

  // ---- E = (I + A)^-1 in place; then E diag(b) (hi, lo; rows scaled by 1 / fe) over it.
  wg_inverse_inplace(AE, LE, bar);
  if (dbgi)
    for (int i = tid; i < kC * kC; i += 128) dbgi[kC * kC + i] = AE[(i / kC) * LE + i % kC];
  {
    uint32_t eh[16], el[16];
    float f = 1.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = 16 * warp + i, c = 2 * lane;
      const float2 v = *reinterpret_cast<const float2*>(AE + r * LE + c);
      const float a = c <= r ? v.x * bs[c] : 0.f, b = c + 1 <= r ? v.y * bs[c + 1] : 0.f;
      const int ex = scale_exp(warp_max(fmaxf(fabsf(a), fabsf(b))));
      const float down = ldexpf(1.f, -ex);
      if (lane == i) f = ldexpf(1.f, ex);
      eh[i] = Pack2<__half>::pack(a * down, b * down);
      const float2 hf = unpack2<__half>(eh[i]);
      el[i] = Pack2<__half>::pack((a * down - hf.x) * kLo, (b * down - hf.y) * kLo);
    }
    wg_bar(bar);  // every warp is done reading E
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int r = 16 * warp + i;
      *reinterpret_cast<uint32_t*>(Ebh + sw_at(r, 2 * lane)) = eh[i];
      *reinterpret_cast<uint32_t*>(Ebl + sw_at(r, 2 * lane)) = el[i];
    }
    if (lane < 16) fe[16 * warp + lane] = f;
    fence_async_smem();
    wg_bar(bar);
  }
  WGP(3);

  // ---- U^T = Z^T (E diag(b))^T: A = Z^T's fragments, B = E diag(b) hi (K-major: row r, k = t).
  uint32_t uf[4][4];  // U^T (rows scaled by 1 / fuc) as the k~ product's A operand
  float fuc[2];
  {
    const int t4 = tid_v() & 3;
    float accU[8][4];
    fence_regs(zf);
    fence_regs(accU);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) wg_rs<__half, 0>(accU, zf[kt], kdesc(Ebh, kt), kt > 0);
    wg_commit();
    wg_wait<0>();
    fence_regs(accU);
    fence_regs(zf);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) accU[nt][e] *= fe[8 * nt + 2 * t4 + (e & 1)];  // column r's factor
    float up[2];
    row_scale_down(accU, up);
    fuc[0] = zc[0] * up[0];
    fuc[1] = zc[1] * up[1];
    if (dbgi) dbg_tile(dbgi + 3 * kC * kC, kC, accU, fuc);
    pack_frags<__half, 4>(uf, accU);
  }
  WGP(4);

  // ---- W2 = E diag(b) W (split: cross terms, then hi x hi), both operands from shared memory: A = E diag(b)
  // hi / lo (K-major), B = W, W's residual (N-major: row s, n = d), 64 columns an accumulator. Kept in registers
  // as fp16 (w2h's rounding) until E diag(b)'s space is free.
  uint32_t w2p[K / 64][8][2];
  {
    WG_POS;
    float acc[K / 64][8][4];
    fence_regs(acc[0]);
    if constexpr (K == 128) fence_regs(acc[1]);
    wg_fence();
#pragma unroll
    for (int j = 0; j < K / 64; ++j)
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        wg_ss<__half, 0, 1>(acc[j], kdesc(Ebh, kt), ndesc(Rs + j * kC * 64, kt), kt > 0);
        wg_ss<__half, 0, 1>(acc[j], kdesc(Ebl, kt), ndesc(Ws + j * kC * 64, kt), 1);
      }
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int j = 0; j < K / 64; ++j) {
      fence_regs(acc[j]);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][nt][e] *= 1.f / kLo;
      fence_regs(acc[j]);
    }
    wg_fence();
#pragma unroll
    for (int j = 0; j < K / 64; ++j)
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) wg_ss<__half, 0, 1>(acc[j], kdesc(Ebh, kt), ndesc(Ws + j * kC * 64, kt), 1);
    wg_commit();
    wg_wait<0>();
    const float fr[2] = {fe[rr[0]], fe[rr[1]]};
#pragma unroll
    for (int j = 0; j < K / 64; ++j) {
      fence_regs(acc[j]);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = rr[hr], d = 64 * j + 8 * nt + 2 * t4;
          const float v0 = fr[hr] * acc[j][nt][2 * hr], v1 = fr[hr] * acc[j][nt][2 * hr + 1];
          w2p[j][nt][hr] = Pack2<__half>::pack(v0, v1);
          if (r < nq)
            *reinterpret_cast<uint32_t*>(p.w2h + ((item_pos(p, item).tok0 + r) * p.H + h) * K + d) = w2p[j][nt][hr];
          if (dbgi) {
            dbgi[kDbgSlots * kC * kC + r * K + d] = v0;
            dbgi[kDbgSlots * kC * kC + r * K + d + 1] = v1;
          }
        }
    }
  }
  wg_bar(bar);  // every product is done with the residual and E diag(b)
  // W2 ([s][d], the q~ product's N-major B) over E diag(b); U^T ([c][t], the X U product's K-major B) over the
  // residual, with its row factors.
  {
    WG_POS;
#pragma unroll
    for (int j = 0; j < K / 64; ++j)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr)
          *reinterpret_cast<uint32_t*>(W2s + sw_at(rr[hr], 64 * j + 8 * nt + 2 * t4)) = w2p[j][nt][hr];
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      *reinterpret_cast<uint32_t*>(Uts + sw_at(rr[0], 16 * kt + 2 * t4)) = uf[kt][0];
      *reinterpret_cast<uint32_t*>(Uts + sw_at(rr[1], 16 * kt + 2 * t4)) = uf[kt][1];
      *reinterpret_cast<uint32_t*>(Uts + sw_at(rr[0], 16 * kt + 8 + 2 * t4)) = uf[kt][2];
      *reinterpret_cast<uint32_t*>(Uts + sw_at(rr[1], 16 * kt + 8 + 2 * t4)) = uf[kt][3];
    }
    if (t4 == 0) {
      fu[rr[0]] = fuc[0];
      fu[rr[1]] = fuc[1];
    }
  }
  fence_async_smem();
  wg_bar(bar);
  WGP(5);

  // ---- k~ = K - U^T W: A = U^T's fragments, B = W (N-major).
  {
    WG_POS;
    float acck[K / 8][4];
    fence_regs(uf);
    fence_regs(acck);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) wg_rs<__half, 1>(acck, uf[kt], ndesc(Ws, kt), kt > 0);
    wg_commit();
    wg_wait<0>();
    fence_regs(acck);
    fence_regs(uf);
    T* ktp = static_cast<T*>(p.kt);
    const int64_t tok0 = item_pos(p, item).tok0;
    const float kr[2] = {fk[rr[0]], fk[rr[1]]};
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int c = rr[hr], d = 8 * nt + 2 * t4;
        const float2 kk = unpack2<__half>(*reinterpret_cast<const uint32_t*>(Ks + sw_at(c, d)));
        if (c < nq)
          *reinterpret_cast<uint32_t*>(ktp + ((tok0 + c) * p.H + h) * K + d) = Pack2<T>::pack(
              kr[hr] * kk.x - fuc[hr] * acck[nt][2 * hr], kr[hr] * kk.y - fuc[hr] * acck[nt][2 * hr + 1]);
      }
  }

  WGP(6);
  // ---- Per query head: X = tril_incl(Q W^T), A_loc = tril_incl(Q K^T - X U), q~ = Q - X W2; q as fp16 with row
  // factors fq (the A operand of X and Q K^T, and q~'s Q).
  for (int i = 0; i < p.group; ++i) {
    const int hq = h * p.group + i;
    const ItemPos ip = item_pos(p, item);
    uint32_t qh[K / 16][4];
    float fq[2];
    {
      uint32_t qb[K / 16][4];
      load_frags<T, K / 16>(qb, qp + ip.b * p.q_s[0] + (ip.pos0 + 16 * warp) * p.q_s[1] + hq * p.q_s[2], p.q_s[1],
                            nq - 16 * warp);
      half_frags_scaled<T, K / 16>(qh, qb, fq);
    }
    float fx[2];  // X's row factors
    uint32_t xf[4][4];
    {
      WG_POS;
      float accX[8][4];
      fence_regs(qh);
      fence_regs(accX);
      wg_fence();
#pragma unroll
      for (int kt = 0; kt < K / 16; ++kt) wg_rs<__half, 0>(accX, qh[kt], kdesc(Ws, kt), kt > 0);
      wg_commit();
      wg_wait<0>();
      fence_regs(accX);
      fence_regs(qh);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (8 * nt + 2 * t4 + (e & 1) > rr[e >> 1]) accX[nt][e] = 0.f;
      float up[2];
      row_scale_down(accX, up);
      fx[0] = fq[0] * up[0];
      fx[1] = fq[1] * up[1];
      if (dbgi && i == 0) dbg_tile(dbgi + 4 * kC * kC, kC, accX, fx);
      pack_frags<__half, 4>(xf, accX);
    }
    // A_loc by 32-column halves (two 64 x 32 accumulators at a time): Q K^T (B = k, K-major: row c, k = d; factors
    // fq fk) less X U (B = U^T, K-major: row c, k = t; factors fx fu).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      WG_POS;
      float accS[4][4], accXU[4][4];
      fence_regs(qh, xf);
      fence_regs(accS, accXU);
      wg_fence();
#pragma unroll
      for (int kt = 0; kt < K / 16; ++kt) wg_rs32(accS, qh[kt], kdesc(Ks + half * 32 * 64, kt), kt > 0);
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) wg_rs32(accXU, xf[kt], kdesc(Uts + half * 32 * 64, kt), kt > 0);
      wg_commit();
      wg_wait<0>();
      fence_regs(accS, accXU);
      fence_regs(qh, xf);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = rr[hr], c = 32 * half + 8 * nt + 2 * t4;
          const float v0 = c <= r ? fq[hr] * fk[c] * accS[nt][2 * hr] - fx[hr] * fu[c] * accXU[nt][2 * hr] : 0.f;
          const float v1 =
              c + 1 <= r ? fq[hr] * fk[c + 1] * accS[nt][2 * hr + 1] - fx[hr] * fu[c + 1] * accXU[nt][2 * hr + 1] : 0.f;
          if (r < nq)
            *reinterpret_cast<float2*>(p.aloc + ((item_pos(p, item).tok0 + r) * p.HQ + hq) * kC + c) =
                make_float2(v0, v1);
        }
    }
    {  // q~: B = W2 (N-major: row s, n = d).
      WG_POS;
      float accQ[K / 8][4];
      fence_regs(xf);
      fence_regs(accQ);
      wg_fence();
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) wg_rs<__half, 1>(accQ, xf[kt], ndesc(W2s, kt), kt > 0);
      wg_commit();
      wg_wait<0>();
      fence_regs(accQ);
      fence_regs(xf);
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = rr[hr], d = 8 * nt + 2 * t4;
          const float2 q = unpack2<__half>(qh[nt / 2][(nt & 1) * 2 + hr]);
          if (r < nq)
            *reinterpret_cast<uint32_t*>(p.qtl + ((item_pos(p, item).tok0 + r) * p.HQ + hq) * K + d) =
                Pack2<__half>::pack(fq[hr] * q.x - fx[hr] * accQ[nt][2 * hr],
                                    fq[hr] * q.y - fx[hr] * accQ[nt][2 * hr + 1]);
        }
    }
  }
  WGP(7);
#endif
}

template <typename T, int K, int NWG, bool kDbg>
cudaError_t launch(const KernelParams& p, float* dbg, int dbg_items, cudaStream_t s) {
  auto kern = chunk_prep_wg<T, K, NWG, kDbg>;
  const size_t smem = size_t(NWG) * Smem<K>::kBytes + 1024;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e == cudaSuccess) e = cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  if (e != cudaSuccess) return e;
  const int items = p.nchunks * p.H;
  kern<<<(items + NWG - 1) / NWG, 128 * NWG, smem, s>>>(p, dbg, dbg_items);
  return cudaGetLastError();
}

// Registers, local memory and items an SM of one instantiation (printed with each shape).
template <typename T, int K, int NWG, bool kDbg>
void describe(const char* name) {
  auto kern = chunk_prep_wg<T, K, NWG, kDbg>;
  const size_t smem = size_t(NWG) * Smem<K>::kBytes + 1024;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  cudaFuncAttributes a;
  CK(cudaFuncGetAttributes(&a, kern));
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 128 * NWG, smem));
  std::printf("  %-10s %d warpgroup(s) a CTA: %3d registers, %zu B local, %zu B shared a CTA, %d items an SM\n", name,
              NWG, a.numRegs, size_t(a.localSizeBytes), smem, per_sm * NWG);
}

}  // namespace wgp

// ------------------------------------------------------------------------------------------------------
// Host side: inputs, the three kernels (library; wgmma with one warpgroup a CTA; with several), an fp64 UT
// transform on checked items, comparisons, timing.

struct Opts {
  bool check_only = false, bench_only = false, debug = false;
  int runs = 20;
};
struct Shape {
  int K, H, HQ, B, T;
  bool bench;  // sampled reference and timing; else every item checked, no timing
};

struct Outs {
  __half *w16, *w2h, *qtl;
  __nv_bfloat16* kt;
  float* aloc;
};

// Error of a set of values against fp64 references: relative L2 and max |error| / max |reference|.
struct Err {
  double se = 0, sr = 0, md = 0, mr = 0;
  bool bad = false;  // a non-finite value
  void add(double got, double ref) {
    if (!std::isfinite(got)) bad = true;
    const double d = got - ref;
    se += d * d, sr += ref * ref, md = std::max(md, std::fabs(d)), mr = std::max(mr, std::fabs(ref));
  }
  double l2() const { return bad ? INFINITY : std::sqrt(se / std::max(sr, 1e-300)); }
  double mx() const { return bad ? INFINITY : md / std::max(mr, 1e-300); }
};

// The fp64 UT transform of item (chunk ci, kv head h): prep.cu's formulas on rows < nq.
struct Ref {
  int nq;
  std::vector<double> A, E, Zt, Ut, W2, kt, X0;  // X of the group's first head
  std::vector<std::vector<double>> qt, al;       // per head of the group
};

template <int K>
static Ref ref_item(const std::vector<float>& w, const std::vector<__nv_bfloat16>& k,
                    const std::vector<__nv_bfloat16>& q, const std::vector<float>& beta, const ChunkDesc& ch, int h,
                    int H, int HQ, int T) {
  const int C = kChunk, group = HQ / H;
  Ref R;
  const int nq = R.nq = std::min(C, int(ch.len - ch.c * C));
  const size_t tok0 = size_t(ch.b) * T + size_t(ch.t0) + size_t(ch.c) * C;
  auto W = [&](int r, int d) { return r < nq ? double(w[((tok0 + r) * H + h) * K + d]) : 0.0; };
  auto Kv = [&](int r, int d) { return r < nq ? double(__bfloat162float(k[((tok0 + r) * H + h) * K + d])) : 0.0; };
  auto b = [&](int r) { return r < nq ? double(beta[(tok0 + r) * H + h]) : 0.0; };
  std::vector<double> Z(C * C, 0);
  R.A.assign(C * C, 0), R.E.assign(C * C, 0), R.Zt.assign(C * C, 0), R.Ut.assign(C * C, 0), R.W2.assign(C * K, 0);
  for (int r = 0; r < C; ++r)
    for (int c = 0; c < r; ++c) {
      double s = 0, z = 0;
      for (int d = 0; d < K; ++d) s += W(r, d) * W(c, d), z += W(r, d) * Kv(c, d);
      R.A[r * C + c] = b(r) * s;
      Z[r * C + c] = z;
      R.Zt[c * C + r] = z;
    }
  for (int c = 0; c < C; ++c) {  // E = (I + A)^-1, column by column
    R.E[c * C + c] = 1;
    for (int r = c + 1; r < C; ++r) {
      double s = 0;
      for (int t = c; t < r; ++t) s += R.A[r * C + t] * R.E[t * C + c];
      R.E[r * C + c] = -s;
    }
  }
  std::vector<double> U(C * C, 0);
  for (int r = 0; r < C; ++r) {
    for (int d = 0; d < K; ++d) {
      double s = 0;
      for (int t = 0; t <= r; ++t) s += R.E[r * C + t] * b(t) * W(t, d);
      R.W2[r * K + d] = s;
    }
    for (int c = 0; c < C; ++c) {
      double s = 0;
      for (int t = 0; t <= r; ++t) s += R.E[r * C + t] * b(t) * Z[t * C + c];
      U[r * C + c] = s;
      R.Ut[c * C + r] = s;
    }
  }
  R.kt.assign(C * K, 0);
  for (int r = 0; r < nq; ++r)
    for (int d = 0; d < K; ++d) {
      double s = Kv(r, d);
      for (int t = 0; t < C; ++t) s -= U[t * C + r] * W(t, d);
      R.kt[r * K + d] = s;
    }
  for (int i = 0; i < group; ++i) {
    const int hq = h * group + i;
    auto Qv = [&](int r, int d) { return r < nq ? double(__bfloat162float(q[((tok0 + r) * HQ + hq) * K + d])) : 0.0; };
    std::vector<double> X(C * C, 0), qt(C * K, 0), al(C * C, 0);
    for (int r = 0; r < C; ++r)
      for (int c = 0; c <= r; ++c) {
        double s = 0;
        for (int d = 0; d < K; ++d) s += Qv(r, d) * W(c, d);
        X[r * C + c] = s;
      }
    for (int r = 0; r < nq; ++r) {
      for (int d = 0; d < K; ++d) {
        double s = Qv(r, d);
        for (int t = 0; t < C; ++t) s -= X[r * C + t] * R.W2[t * K + d];
        qt[r * K + d] = s;
      }
      for (int c = 0; c <= r; ++c) {
        double s = 0;
        for (int d = 0; d < K; ++d) s += Qv(r, d) * Kv(c, d);
        for (int t = 0; t < C; ++t) s -= X[r * C + t] * U[t * C + c];
        al[r * C + c] = s;
      }
    }
    if (i == 0) R.X0 = X;
    R.qt.push_back(std::move(qt));
    R.al.push_back(std::move(al));
  }
  return R;
}

// A device buffer as floats (exact for fp16, bf16 and fp32 elements; half the host memory of doubles).
template <typename E>
static std::vector<float> fetch(const E* d, size_t n) {
  std::vector<E> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(E), cudaMemcpyDeviceToHost));
  std::vector<float> o(n);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<E, float>) o[i] = h[i];
    else if constexpr (std::is_same_v<E, __half>) o[i] = __half2float(h[i]);
    else o[i] = __bfloat162float(h[i]);
  }
  return o;
}

template <int K>
static int run_shape(const Shape& s, const Opts& o) {
  using namespace wgp;
  const int C = kChunk, H = s.H, HQ = s.HQ, B = s.B, T = s.T, group = HQ / H;
  constexpr int NW = Smem<K>::kItemsPerSm;  // the several-warpgroups-a-CTA variant
  const size_t NT = size_t(B) * T;
  std::printf("\nK %d, H %d, HQ %d, B %d, T %d (%s)\n", K, H, HQ, B, T, s.bench ? "bench" : "check");
  describe<__nv_bfloat16, K, 1, false>("wg1");
  describe<__nv_bfloat16, K, NW, false>("wgN");
  std::mt19937 rng(1234 + 7 * K + H + T);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.f, 2.f);
  std::vector<__nv_bfloat16> q(NT * HQ * K), k(NT * H * K);
  std::vector<float> w(NT * H * K), beta(NT * H);
  for (auto& x : q) x = __float2bfloat16(nd(rng));
  for (auto& x : k) x = __float2bfloat16(nd(rng));
  for (size_t i = 0; i < NT * H; ++i) {
    double n = 0;
    for (int d = 0; d < K; ++d) n += double(w[i * K + d] = nd(rng)) * w[i * K + d];
    for (int d = 0; d < K; ++d) w[i * K + d] = float(w[i * K + d] / std::sqrt(n));
    beta[i] = ud(rng);
  }
  // Chunk table: B sequences of T tokens (a last partial chunk where 64 does not divide T).
  std::vector<ChunkDesc> chunks;
  const int nc = (T + C - 1) / C;
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < nc; ++c) chunks.push_back({b, 0, T, c, b * nc, 0});
  const int items = int(chunks.size()) * H;
  __nv_bfloat16 *dq, *dk;
  float *dw, *dbeta;
  ChunkDesc* dch;
  CK(cudaMalloc(&dq, q.size() * 2));
  CK(cudaMalloc(&dk, k.size() * 2));
  CK(cudaMalloc(&dw, w.size() * 4));
  CK(cudaMalloc(&dbeta, beta.size() * 4));
  CK(cudaMalloc(&dch, chunks.size() * sizeof(ChunkDesc)));
  CK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dbeta, beta.data(), beta.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dch, chunks.data(), chunks.size() * sizeof(ChunkDesc), cudaMemcpyHostToDevice));
  Outs out[3];  // library, wg1, wgN
  for (Outs& x : out) {
    CK(cudaMalloc(&x.w16, NT * H * K * 2));
    CK(cudaMalloc(&x.w2h, NT * H * K * 2));
    CK(cudaMalloc(&x.kt, NT * H * K * 2));
    CK(cudaMalloc(&x.qtl, NT * HQ * K * 2));
    CK(cudaMalloc(&x.aloc, NT * HQ * C * 4));
    // Poison: every output element must be written (NaN otherwise).
    CK(cudaMemset(x.w16, 0xff, NT * H * K * 2));
    CK(cudaMemset(x.w2h, 0xff, NT * H * K * 2));
    CK(cudaMemset(x.kt, 0xff, NT * H * K * 2));
    CK(cudaMemset(x.qtl, 0xff, NT * HQ * K * 2));
    CK(cudaMemset(x.aloc, 0xff, NT * HQ * C * 4));
  }
  KernelParams kp = dev::mha_params(B, T, H, K, K, dq, dk, dk, dw, dbeta);
  kp.HQ = HQ, kp.group = group;
  kp.q_s[0] = int64_t(T) * HQ * K, kp.q_s[1] = int64_t(HQ) * K, kp.q_s[2] = K;
  kp.chunks = dch, kp.nchunks = int(chunks.size()), kp.max_chunks = nc;
  auto with = [&](const Outs& x) {
    KernelParams y = kp;
    y.w16 = x.w16, y.w2h = x.w2h, y.kt = x.kt, y.qtl = x.qtl, y.aloc = x.aloc;
    return y;
  };
  const KernelParams P[3] = {with(out[0]), with(out[1]), with(out[2])};
  const int dbg_items = o.debug ? std::min(items, 16) : 0;
  float* ddbg = nullptr;
  if (o.debug) {
    CK(cudaMalloc(&ddbg, size_t(dbg_items) * dbg_floats<K>() * 4));
    CK(cudaMemset(ddbg, 0xff, size_t(dbg_items) * dbg_floats<K>() * 4));
  }
  auto run_lib = [&] { CK(launch_chunk_prep(P[0], 1, 0)); };
  auto run_wg1 = [&] { CK((launch<__nv_bfloat16, K, 1, false>(P[1], nullptr, 0, 0))); };
  auto run_wgn = [&] { CK((launch<__nv_bfloat16, K, NW, false>(P[2], nullptr, 0, 0))); };
  run_lib();
  CK(cudaDeviceSynchronize());
  if (o.debug) CK((launch<__nv_bfloat16, K, 1, true>(P[1], ddbg, dbg_items, 0)));
  else run_wg1();
  CK(cudaDeviceSynchronize());
  run_wgn();
  CK(cudaDeviceSynchronize());

  const char* vname[3] = {"library", "wg1", "wgN"};
  std::vector<float> got[3][5];  // w16, w2h, kt, qtl, aloc
  for (int v = 0; v < 3; ++v) {
    got[v][0] = fetch(out[v].w16, NT * H * K);
    got[v][1] = fetch(out[v].w2h, NT * H * K);
    got[v][2] = fetch(out[v].kt, NT * H * K);
    got[v][3] = fetch(out[v].qtl, NT * HQ * K);
    got[v][4] = fetch(out[v].aloc, NT * HQ * C);
  }
  bool ok = true;
  // w16: fp16(W), the same bits from every kernel.
  for (int v = 1; v < 3; ++v) {
    size_t nd16 = 0;
    for (size_t i = 0; i < got[0][0].size(); ++i) nd16 += !(got[v][0][i] == got[0][0][i]);
    size_t nref = 0;
    for (size_t i = 0; i < w.size(); ++i) nref += !(got[v][0][i] == __half2float(__float2half_rn(w[i])));
    std::printf("  w16 %s: %zu elements differ from the library's, %zu from fp16(w)\n", vname[v], nd16, nref);
    ok = ok && nd16 == 0 && nref == 0;
  }
  // fp64 reference: every item (check shapes) or a sample of chunks x kv heads (bench shapes).
  std::vector<int> check_items;
  if (!s.bench) {
    for (int it = 0; it < items; ++it) check_items.push_back(it);
  } else {
    const int cs[] = {0, 1, nc - 1, nc, kp.nchunks / 2 + 3, kp.nchunks - 1};
    const int hs[] = {0, H / 2, H - 1};
    for (int ci : cs)
      for (int hh : hs) check_items.push_back(std::min(ci, kp.nchunks - 1) * H + hh);
    std::sort(check_items.begin(), check_items.end());
    check_items.erase(std::unique(check_items.begin(), check_items.end()), check_items.end());
  }
  Err err[3][4];  // w2h, kt, qtl, aloc
  std::vector<double> dbgv;
  if (o.debug) {
    std::vector<float> hd(size_t(dbg_items) * dbg_floats<K>());
    CK(cudaMemcpy(hd.data(), ddbg, hd.size() * 4, cudaMemcpyDeviceToHost));
    dbgv.assign(hd.begin(), hd.end());
  }
  Err derr[6];  // A, E, Z^T, U^T, X, W2 of the staged items
  int dfirst[6];
  std::fill(dfirst, dfirst + 6, -1);
  auto dstage = [&](int st, int it, const std::vector<double>& ref, size_t off, int n, int rows, int cols) {
    Err e;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) e.add(dbgv[size_t(it) * dbg_floats<K>() + off + r * cols + c], ref[r * cols + c]);
    derr[st].se += e.se, derr[st].sr += e.sr, derr[st].md = std::max(derr[st].md, e.md);
    derr[st].mr = std::max(derr[st].mr, e.mr), derr[st].bad = derr[st].bad || e.bad;
    if (dfirst[st] < 0 && !(e.l2() < 1e-3)) dfirst[st] = it;
    (void)n;
  };
  for (int it : check_items) {
    const ChunkDesc& ch = chunks[it / H];
    const int h = it % H;
    const Ref R = ref_item<K>(w, k, q, beta, ch, h, H, HQ, T);
    const size_t tok0 = size_t(ch.b) * T + size_t(ch.c) * C;
    for (int v = 0; v < 3; ++v)
      for (int r = 0; r < R.nq; ++r) {
        for (int d = 0; d < K; ++d) {
          const size_t oi = ((tok0 + r) * H + h) * K + d;
          err[v][0].add(got[v][1][oi], R.W2[r * K + d]);
          err[v][1].add(got[v][2][oi], R.kt[r * K + d]);
        }
        for (int i = 0; i < group; ++i) {
          const int hq = h * group + i;
          for (int d = 0; d < K; ++d) err[v][2].add(got[v][3][((tok0 + r) * HQ + hq) * K + d], R.qt[i][r * K + d]);
          for (int c = 0; c < C; ++c) err[v][3].add(got[v][4][((tok0 + r) * HQ + hq) * C + c], R.al[i][r * C + c]);
        }
      }
    if (o.debug && it < dbg_items) {
      dstage(0, it, R.A, 0, 0, C, C);
      dstage(1, it, R.E, size_t(C) * C, 0, C, C);
      dstage(2, it, R.Zt, 2 * size_t(C) * C, 0, C, C);
      dstage(3, it, R.Ut, 3 * size_t(C) * C, 0, C, C);
      dstage(4, it, R.X0, 4 * size_t(C) * C, 0, C, C);
      dstage(5, it, R.W2, kDbgSlots * size_t(C) * C, 0, C, K);
    }
  }
  if (o.debug) {
    const char* dn[6] = {"A", "E", "Z^T", "U^T", "X", "W2"};
    std::printf("  --debug: wg1's intermediates of items 0..%d vs fp64 (rel L2, max/max; first item over 1e-3):\n",
                dbg_items - 1);
    int first_bad = -1;
    for (int st = 0; st < 6; ++st) {
      std::printf("    %-4s %.2e %.2e%s", dn[st], derr[st].l2(), derr[st].mx(),
                  dfirst[st] >= 0 ? "" : "\n");
      if (dfirst[st] >= 0) std::printf("  <- item %d first\n", dfirst[st]);
      if (dfirst[st] >= 0 && first_bad < 0) first_bad = st;
    }
    if (first_bad >= 0) std::printf("  --debug: the first product that disagrees: %s\n", dn[first_bad]);
  }
  const char* names[4] = {"w2h", "kt", "qtl", "aloc"};
  // Bars (rel L2): w2h fp16 and kt bf16 outputs (their rounding: ~3e-4 / ~2e-3), qtl fp16, aloc fp32 from tf32-
  // or fp16-operand products; and no worse than twice the library (rel L2) or three times (max, noisier).
  const double bar[4] = {2e-3, 8e-3, 4e-3, 4e-3};
  std::printf("  vs fp64 on %zu items: rel L2 / max |err| / max |ref|\n", check_items.size());
  for (int i = 0; i < 4; ++i) {
    std::printf("    %-4s", names[i]);
    for (int v = 0; v < 3; ++v) std::printf("  %s %.2e / %.2e", vname[v], err[v][i].l2(), err[v][i].mx());
    bool good = err[0][i].l2() <= bar[i];
    for (int v = 1; v < 3; ++v)
      good = good && err[v][i].l2() <= bar[i] && err[v][i].l2() <= 2 * err[0][i].l2() + 1e-7 &&
             err[v][i].mx() <= 3 * err[0][i].mx() + 1e-7;
    std::printf("  %s\n", good ? "OK" : "FAIL");
    ok = ok && good;
  }
  // Every element against the library's.
  for (int v = 1; v < 3; ++v) {
    std::printf("  %s vs library, every element, max |diff| / max |library|:", vname[v]);
    for (int i = 1; i < 5; ++i) {
      double md = 0, ml = 0;
      size_t nan = 0;
      for (size_t j = 0; j < got[0][i].size(); ++j) {
        const double a = got[v][i][j], l = got[0][i][j];
        if (!std::isfinite(a) || !std::isfinite(l)) {
          ++nan;
          continue;
        }
        md = std::max(md, std::fabs(a - l)), ml = std::max(ml, std::fabs(l));
      }
      std::printf(" %s %.2e", names[i - 1], md / std::max(ml, 1e-300));
      if (nan) std::printf(" (%zu NaN)", nan);
      ok = ok && nan == 0;
    }
    std::printf("\n");
  }

  if (s.bench) {
    // Nominal flops (each product once, split or not, triangles in full) and the bytes each kernel must move.
    const double per_item = 2.0 * C * C * K * 4 + 2.0 * C * C * C + group * (2.0 * C * C * K * 3 + 2.0 * C * C * C);
    const double flops = per_item * items;
    const double bytes =
        double(NT) * H * K * (4 + 2 + 3 * 2) + double(NT) * H * 4 + double(NT) * HQ * (K * 2 * 2 + C * 4);
    const float tl = dev::median_ms(run_lib, o.runs), t1 = dev::median_ms(run_wg1, o.runs),
                tn = dev::median_ms(run_wgn, o.runs);
    const float ts[3] = {tl, t1, tn};
    for (int v = 0; v < 3; ++v)
      std::printf("  time %-7s %.3f ms  %6.1f TFLOP/s (nominal)  %6.0f GB/s  %.2fx the library\n", vname[v], ts[v],
                  flops / (1e-3 * ts[v]) / 1e12, bytes / (1e-3 * ts[v]) / 1e9, tl / ts[v]);
#ifdef WG_PROBE
    // Mean cycles a phase of wg1's first items (thread 0 of the item's warpgroup; phases end at the stamps).
    static long long tab[wgp::kProbeItems][wgp::kProbeSlots];
    run_wg1();
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpyFromSymbol(tab, wgp::g_wgp, sizeof(tab)));
    const int np = std::min(items, wgp::kProbeItems);
    const char* ph[7] = {"loads: k, W, beta; w16 out", "Z^T, A (split)", "inverse, E diag(b) hi/lo",
                         "U^T", "W2 (split), stores w2h", "k~ product, kt out", "query heads (X, A_loc, q~)"};
    double sum[7] = {}, tot = 0;
    for (int i = 0; i < np; ++i)
      for (int j = 0; j < 7; ++j) sum[j] += double(tab[i][j + 1] - tab[i][j]);
    for (int j = 0; j < 7; ++j) tot += sum[j];
    std::printf("  phase probe (wg1, %d items, mean cycles an item; %.0f in all):\n", np, tot / np);
    for (int j = 0; j < 7; ++j)
      std::printf("    %-30s %8.0f  %5.1f%%\n", ph[j], sum[j] / np, 100.0 * sum[j] / std::max(tot, 1.0));
#endif
  }
  for (Outs& x : out) {
    CK(cudaFree(x.w16));
    CK(cudaFree(x.w2h));
    CK(cudaFree(x.kt));
    CK(cudaFree(x.qtl));
    CK(cudaFree(x.aloc));
  }
  if (ddbg) CK(cudaFree(ddbg));
  CK(cudaFree(dq));
  CK(cudaFree(dk));
  CK(cudaFree(dw));
  CK(cudaFree(dbeta));
  CK(cudaFree(dch));
  std::printf("  %s\n", ok ? "checks passed" : "CHECK FAILED");
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check-only") o.check_only = true;
    else if (a == "--bench-only") o.bench_only = true;
    else if (a == "--debug") o.debug = true;
    else if (a == "--runs" && i + 1 < argc) o.runs = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "usage: %s [--check-only | --bench-only] [--debug] [--runs N]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::printf("chunk_prep_wg: SKIPPED, needs an sm_90 GPU (found sm_%d%d)\n", prop.major, prop.minor);
    return 0;
  }
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  // Small shapes first (every item against fp64): one item; GQA 2 with a partial last chunk; K = 64 with one.
  const Shape checks[] = {{128, 1, 1, 1, 64, false}, {128, 2, 4, 2, 200, false}, {64, 3, 3, 1, 130, false},
                          {64, 2, 4, 1, 100, false}};
  const Shape bench[] = {{128, 16, 16, 8, 4096, true}, {64, 32, 32, 8, 4096, true}, {128, 4, 16, 8, 4096, true}};
  int bad = 0;
  if (!o.bench_only)
    for (const Shape& s : checks) bad += s.K == 128 ? run_shape<128>(s, o) : run_shape<64>(s, o);
  if (!o.check_only)
    for (const Shape& s : bench) bad += s.K == 128 ? run_shape<128>(s, o) : run_shape<64>(s, o);
  std::printf(bad ? "\nFAILED (%d shapes)\n" : "\nall checks passed\n", bad);
  return bad ? 1 : 0;
}
