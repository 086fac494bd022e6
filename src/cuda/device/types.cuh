// cuda/common.cuh: device helpers shared by the PaTH kernels: element types, tensor-core MMA through
// inline PTX (mma.sync m16n8k16 for fp16/bf16, m16n8k8 for tf32; sm_80 and up), ldmatrix-based warp
// tiles over shared memory, cp.async copies, and the plain block-level fp32 matrix product used by the
// O(T C K) chunk kernels. No torch or framework headers: kernels see raw pointers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/kernel_params.h"
#include "cuda/kspan.h"

namespace pathattn::cuda {

// ----------------------------------------------------------------------------------------------------
// Element types. T is the q/k/v storage type (__half or __nv_bfloat16); transport operands are __half.
template <typename T> struct Pack2;
template <> struct Pack2<__half> {
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <> struct Pack2<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
// (a, b) rounded to T (head, the packed pair returned) and what that rounding left (tail, packed in T too): head +
// tail holds about twice T's significand, with T's range.
template <typename T>
__device__ __forceinline__ uint32_t pack2_split(float a, float b, uint32_t& tail) {
  const uint32_t head = Pack2<T>::pack(a, b);
  float2 h;
  if constexpr (std::is_same_v<T, __half>) h = __half22float2(*reinterpret_cast<const __half2*>(&head));
  else h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&head));
  tail = Pack2<T>::pack(a - h.x, b - h.y);
  return head;
}

template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };

// 2^x on the special-function unit (ex2.approx.ftz: about 2 ulp; subnormal results flush to zero and
// 2^-inf = 0), without the subnormal-range fix-up exp2f adds around the same instruction. It feeds softmax
// probabilities, where a result below 2^-126 is as good as 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
// Two adjacent 16-bit elements (4-byte aligned) as floats.
__device__ __forceinline__ float2 pair_f(const __half* x) { return __half22float2(*reinterpret_cast<const __half2*>(x)); }
__device__ __forceinline__ float2 pair_f(const __nv_bfloat16* x) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x));
}
// Two elements (columns d, d + 1; d even) of the query state of query row `pos` of batch row b, head hq: with
// the transport from its fp16 copy at `qtl_row` (qtl: the transport's products take it as an fp16 operand
// anyway); in plain attention (kPlain: p.path false) q~ is q, read from q itself in its own type, so that no
// fp16 range limit applies (a bf16 entry above 65504 would overflow the fp16 copy). A compile-time choice: the
// kernels that read the state (fwd_scan, bwd_q) have a plain-attention instantiation, since a branch on p.path
// at these loads cost fwd_scan a quarter of its time (dev/cuda/NOTES.md v3.54).
template <typename T, bool kPlain>
__device__ __forceinline__ float2 load_qstate(const KernelParams& p, const __half* qtl_row, int64_t b, int64_t pos,
                                              int hq, int d) {
  if constexpr (!kPlain) {
    return pair_f(qtl_row + d);
  } else {
    const T* q = static_cast<const T*>(p.q) + b * p.q_s[0] + pos * p.q_s[1] + hq * p.q_s[2] + d;
    return make_float2(to_f(q[0]), to_f(q[1]));
  }
}
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Whether every element pair (2 i, 2 i + 1) of rows base + i s0 + j s1 + k s2 is aligned for one 2-element store.
template <typename E>
__host__ __device__ __forceinline__ bool vec2_ok(const E* base, int64_t s0, int64_t s1, int64_t s2) {
  constexpr int64_t kBytes = 2 * sizeof(E);
  return reinterpret_cast<uintptr_t>(base) % kBytes == 0 && s0 % 2 == 0 && s1 % 2 == 0 && s2 % 2 == 0;
}
// Two values stored at dst as E (one 4-byte store for 16-bit types, 8-byte for fp32) when pair, else one by one.
template <typename E>
__device__ __forceinline__ void store2(E* dst, float a, float b, bool pair) {
  if (pair) {
    *reinterpret_cast<uint32_t*>(dst) = Pack2<E>::pack(a, b);
  } else {
    dst[0] = from_f<E>(a);
    dst[1] = from_f<E>(b);
  }
}
__device__ __forceinline__ void store2(float* dst, float a, float b, bool pair) {
  if (pair) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else {
    dst[0] = a;
    dst[1] = b;
  }
}

// ----------------------------------------------------------------------------------------------------
// MMA primitives. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4, t = lane % 4:
//   A 16x16: a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..)
//   B 16x8:  b0 (k 2t..2t+1, n g) b1 (k 2t+8.., n g)
//   C 16x8:  c0,c1 (g, 2t..2t+1) c2,c3 (g+8, 2t..2t+1)
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// tf32 m16n8k8: A a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4); B b0 (k t, n g) b1 (k t+4, n g).
__device__ __forceinline__ void mma1688_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// fp32 -> tf32 operand, rounded to nearest (ties away from zero, as cvt.rna): half a tf32 ulp is added to the
// bits and the tensor core drops the 13 low bits of every tf32 operand (it truncates). One integer add per
// element where cvt.rna.tf32.f32 costs three instructions; the same value for every finite input.
__device__ __forceinline__ uint32_t to_tf32(float x) { return __float_as_uint(x) + 0x1000u; }
// x rounded to tf32 the same way, low bits cleared: the exact tf32 value as fp32 bits.
__device__ __forceinline__ uint32_t tf32_exact(float x) { return (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u; }
// Split tf32: head = x rounded to tf32 (exact, so x - head is exact in fp32), tail = the rest, rounded.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_exact(x);
  lo = to_tf32(x - __uint_as_float(hi));
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// ----------------------------------------------------------------------------------------------------
// Warp tiles over shared memory, 16-bit operands (type E), fp32 accumulators.
// acc[MT][NT][4] += A(16MT x kdim) * B(kdim x 8NT) for the tile at rows m0, cols n0.
//   TA = false: A stored [m][k] (leading dim lda); TA = true: A stored [k][m].
//   TB = false: B stored [n][k] (rows of B^T, e.g. keys); TB = true: B stored [k][n].
// Leading dims are padded by 8 elements (16 bytes) by the callers, which keeps ldmatrix conflict-free.
template <typename E, int MT, int NT, bool TA, bool TB>
__device__ __forceinline__ void warp_mma_ss(float (&acc)[MT][NT][4], const E* A, int lda, int m0, const E* B,
                                            int ldb, int n0, int kdim) {
  static_assert(NT % 2 == 0, "NT must be even");
  const int lane = threadIdx.x & 31, mat = lane >> 3, i = lane & 7;
  for (int k0 = 0; k0 < kdim; k0 += 16) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int mb = m0 + 16 * mt;
      if (!TA) ldsm_x4(a[mt], A + (mb + i + (mat & 1) * 8) * lda + k0 + (mat >> 1) * 8);
      else ldsm_x4_t(a[mt], A + (k0 + i + (mat >> 1) * 8) * lda + mb + (mat & 1) * 8);
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      const int nb = n0 + 8 * nt;
      uint32_t b[4];
      if (!TB) ldsm_x4(b, B + (nb + i + (mat >> 1) * 8) * ldb + k0 + (mat & 1) * 8);
      else ldsm_x4_t(b, B + (k0 + i + (mat & 1) * 8) * ldb + nb + (mat >> 1) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816<E>(acc[mt][nt], a[mt], b[0], b[1]);
        mma16816<E>(acc[mt][nt + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Same with A taken from registers: a warp's 16 x (16 KT) accumulator tile `src` (C layout, NT2 = 2 KT
// n-tiles) is rounded to E and used as the A operand (the C layout of two n-tiles is the A layout). kSplit: A
// also as what that rounding left, rounded to E (pack2_split), in a second product after the first at each step:
// about twice E's significand from A (an fp32 tile against 16-bit B, where tf32 would keep 11 bits).
template <typename E, int KT, int NT, bool TB, bool kSplit = false>
__device__ __forceinline__ void warp_mma_rs(float (&acc)[NT][4], const float (&src)[2 * KT][4], float src_scale,
                                            const E* B, int ldb, int n0) {
  static_assert(NT % 2 == 0, "NT must be even");
  const int lane = threadIdx.x & 31, mat = lane >> 3, i = lane & 7;
  auto pack = [&](float x, float y, uint32_t& tail) {
    if constexpr (kSplit) return pack2_split<E>(x * src_scale, y * src_scale, tail);
    else return Pack2<E>::pack(x * src_scale, y * src_scale);
  };
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    uint32_t a[4], al[4];
    a[0] = pack(src[2 * kt][0], src[2 * kt][1], al[0]);
    a[1] = pack(src[2 * kt][2], src[2 * kt][3], al[1]);
    a[2] = pack(src[2 * kt + 1][0], src[2 * kt + 1][1], al[2]);
    a[3] = pack(src[2 * kt + 1][2], src[2 * kt + 1][3], al[3]);
    const int k0 = 16 * kt;
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      const int nb = n0 + 8 * nt;
      uint32_t b[4];
      if (!TB) ldsm_x4(b, B + (nb + i + (mat >> 1) * 8) * ldb + k0 + (mat & 1) * 8);
      else ldsm_x4_t(b, B + (k0 + i + (mat & 1) * 8) * ldb + nb + (mat >> 1) * 8);
      mma16816<E>(acc[nt], a, b[0], b[1]);
      mma16816<E>(acc[nt + 1], a, b[2], b[3]);
      if constexpr (kSplit) {
        mma16816<E>(acc[nt], al, b[0], b[1]);
        mma16816<E>(acc[nt + 1], al, b[2], b[3]);
      }
    }
  }
}

template <int MT, int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[MT][NT][4]) {
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
}
template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[NT][4]) {
#pragma unroll
  for (int b = 0; b < NT; ++b)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[b][c] = 0.f;
}
// acc += x, elementwise (C layout tiles).
template <int NT>
__device__ __forceinline__ void add_acc(float (&acc)[NT][4], const float (&x)[NT][4]) {
#pragma unroll
  for (int b = 0; b < NT; ++b)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[b][c] += x[b][c];
}

// acc += s x, elementwise (TcTile accumulators).
template <int MT, int NT>
__device__ __forceinline__ void fma_acc(float (&acc)[MT][NT][4], const float (&x)[MT][NT][4], float s) {
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = fmaf(s, x[a][b][c], acc[a][b][c]);
}

// The smallest power of two a row (or tile) scaled into [-1, 1) is divided by (2^120 and 2^-120 are normal
// floats). Rows of entries below 2^-126 (the gate's far pairs have weights down to e^-hundreds) would make 2^-e
// overflow to inf and the scaled row NaN; scaled by 2^120 they stay below 1 and lose fp16's relative precision
// only under 2^-134, where fp32 itself is subnormal.
inline constexpr int kMinScaleExp = -120;

// The exponent e of the power of two 2^-e that scales entries of largest magnitude mx into [-1, 1): mx = f 2^e,
// f in [0.5, 1) (e = 0 for mx = 0), at least kMinScaleExp.
__device__ __forceinline__ int scale_exp(float mx) {
  int e = 0;
  frexpf(mx, &e);
  return max(e, kMinScaleExp);
}

// The largest |entry| of this lane's part of a C-layout tile x (N n-tiles).
template <int N>
__device__ __forceinline__ float lane_abs_max(const float (&x)[N][4]) {
  float mx = 0.f;
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx = fmaxf(mx, fabsf(x[nt][e]));
  return mx;
}
// The largest of the warp's lanes' v, in every lane.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The largest |entry| of a warp's C-layout tile x (N n-tiles), in every lane.
template <int N>
__device__ __forceinline__ float warp_abs_max(const float (&x)[N][4]) {
  return warp_max(lane_abs_max(x));
}
// The largest of the threads' v (>= 0) over a block of kWarps warps (every thread calls it), in every thread: each
// warp's through shuffles into slot[warp], one barrier, then the slots. slot: kWarps floats of shared memory that
// no thread reads or writes again before the next barrier.
template <int kWarps>
__device__ __forceinline__ float block_max(float v, float* slot) {
  v = warp_max(v);
  if ((threadIdx.x & 31) == 0) slot[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) v = fmaxf(v, slot[w]);
  return v;
}

// A chunk's E = (I + A)^-1 (64 x 64, unit lower triangular) as the backward keeps it from chunk_prep to bwd_chunk:
// each row's strict lower part in fp16 times 2^s_r, s_r putting the row's largest |entry| into [2^14, 2^15), with
// s_r itself (int16) on the diagonal, whose ones need no storing. bwd_chunk reads E only as a tf32 operand, and fp16
// holds tf32's 11 significant bits for every entry down to 2^-28 of its row's largest: the products see the bits
// they saw in fp32 (but for ties, which fp16 rounds to even), at half the bytes.
// store_e: E (fp32 rows of leading dim ld in shared memory) to dst (rows of 64), a warp a row at a time; every
// lane of the block's nwarps warps calls it.
__device__ __forceinline__ void store_e(__half* dst, const float* E, int ld, int warp, int lane, int nwarps) {
  const int c = 2 * lane;
  for (int r = warp; r < kChunk; r += nwarps) {
    const float a = c < r ? E[r * ld + c] : 0.f, b = c + 1 < r ? E[r * ld + c + 1] : 0.f;
    const int s = min(15 - scale_exp(warp_max(fmaxf(fabsf(a), fabsf(b)))), 126);
    const float down = ldexpf(1.f, s);
    __half2 v = __floats2half2_rn(a * down, b * down);
    if (c == r) v.x = __short_as_half(static_cast<short>(s));
    if (c + 1 == r) v.y = __short_as_half(static_cast<short>(s));
    *reinterpret_cast<__half2*>(dst + r * kChunk + c) = v;
  }
}
// load_e: E from store_e's tile src (rows of leading dim lds in shared memory) into fp32 rows of leading dim ld:
// each row's strict lower part scaled back (exact), ones on the diagonal, zeros above.
__device__ __forceinline__ void load_e(float* E, int ld, const __half* src, int lds, int tid, int nthreads) {
  for (int i = tid; i < kChunk * kChunk / 2; i += nthreads) {
    const int r = i / (kChunk / 2), c = 2 * (i % (kChunk / 2));
    const float up = ldexpf(1.f, -static_cast<int>(__half_as_short(src[r * lds + r])));
    const float2 v = __half22float2(*reinterpret_cast<const __half2*>(src + r * lds + c));
    E[r * ld + c] = c < r ? v.x * up : (c == r ? 1.f : 0.f);
    E[r * ld + c + 1] = c + 1 < r ? v.y * up : (c + 1 == r ? 1.f : 0.f);
  }
}

// Scales each row of a warp's 16-row C-layout tile x (rows g and g + 8, N n-tiles) by a power of two into
// [-1, 1) (exact), and returns the factors that undo it in up: fp16 operands from such rows keep fp16's relative
// precision (tf32's) whatever the rows' range, as the gradient transport chains need.
template <int N>
__device__ __forceinline__ void row_scale_down(float (&x)[N][4], float (&up)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = 0.f;
#pragma unroll
    for (int nt = 0; nt < N; ++nt) mx = fmaxf(mx, fmaxf(fabsf(x[nt][2 * hr]), fabsf(x[nt][2 * hr + 1])));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const int e = scale_exp(mx);
    const float down = ldexpf(1.f, -e);
    up[hr] = ldexpf(1.f, e);
#pragma unroll
    for (int nt = 0; nt < N; ++nt) {
      x[nt][2 * hr] *= down;
      x[nt][2 * hr + 1] *= down;
    }
  }
}
template <int N>
__device__ __forceinline__ void row_scale_up(float (&x)[N][4], const float (&up)[2]) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[nt][e] *= up[e >> 1];
}

// One chunk's transport step on a warp's 16-row register tile h (C layout, K / 8 n-tiles):
// h <- h - (h A^T) B, with the chunk's [64][K] fp16 tiles A, B in shared memory (leading dim ld). fp16 operands
// (h's rows scaled by powers of two first, so they are tf32's 11 bits for any range), fp32 accumulation, h the A
// operand from registers and B through ldmatrix. A = W, B = W2 is h P_c (P_c = I - W^T W2); A = W2, B = W is
// h P_c^T. (h A^T) of a scaled row is at most sqrt(K) times A's row norm: in fp16's range for the chunks' W, W2.
template <int K>
__device__ __forceinline__ void warp_chunk_step(float (&h)[K / 8][4], const __half* A, const __half* B, int ld) {
  float up[2];
  row_scale_down(h, up);
  float y[8][4];
  zero_acc(y);
  warp_mma_rs<__half, K / 16, 8, false>(y, h, 1.f, A, ld, 0);
  warp_mma_rs<__half, 4, K / 8, true>(h, y, -1.f, B, ld, 0);
  row_scale_up(h, up);
}

// x <- x PS (kTB: PS stored [k][n]) or x PS^T (PS stored [n][k]) for a warp's 16-row register tile x (C layout,
// K / 8 n-tiles) and a K x K fp16 superblock product PS in shared memory (leading dim ld), rows scaled as in
// warp_chunk_step.
template <int K, bool kTB>
__device__ __forceinline__ void warp_ps_step(float (&x)[K / 8][4], const __half* PS, int ld) {
  float up[2];
  row_scale_down(x, up);
  float y[K / 8][4];
  zero_acc(y);
  warp_mma_rs<__half, K / 16, K / 8, kTB>(y, x, 1.f, PS, ld, 0);
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[nt][e] = y[nt][e] * up[e >> 1];
}

// Stores a warp's 16-row register tile (C layout of KN / 8 n-tiles, rows 16 warp + g and + 8) to a row-major
// 16-bit (E) matrix with leading dimension ld: the per-CTA scratch snapshots of transported query / key tiles.
template <typename E, int KN>
__device__ __forceinline__ void store_tile(E* dst, int ld, const float (&x)[KN / 8][4]) {
  const int lane = threadIdx.x & 31, row = 16 * (threadIdx.x >> 5) + (lane >> 2), t4 = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int nt = 0; nt < KN / 8; ++nt)
      *reinterpret_cast<uint32_t*>(dst + (row + 8 * hr) * ld + 8 * nt + 2 * t4) =
          Pack2<E>::pack(x[nt][2 * hr], x[nt][2 * hr + 1]);
}

// Host side: opts the kernel in to `smem` bytes of dynamic shared memory, launches it, and returns the first
// error (the attribute call's or the launch's).
template <class... P, class... A>
inline cudaError_t launch_with_smem(void (*kern)(P...), dim3 grid, int threads, size_t smem, cudaStream_t s,
                                    A... args) {
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  kern<<<grid, threads, smem, s>>>(args...);
  return cudaGetLastError();
}

// Grids of (chunk or superblock, kv head) items are one-dimensional with the kv head fastest: the CTAs that run
// side by side then read and write the same tokens' [token][head][...] rows, contiguous in memory, instead of
// one head's rows a whole head row apart. Returns {item, kv head}.
__device__ __forceinline__ int2 item_and_head(int H) { return make_int2(int(blockIdx.x / H), int(blockIdx.x % H)); }

// The next item of a persistent grid whose items are taken in order from a counter (zeroed before the launch):
// offset + the counter's next value. Every thread of the CTA calls it; `slot` is a __shared__ int.
__device__ __forceinline__ int take_item(int* counter, int* slot, int offset) {
  __syncthreads();  // every thread has read the previous item from the slot
  if (threadIdx.x == 0) *slot = offset + atomicAdd(counter, 1);
  __syncthreads();
  return *slot;
}
inline dim3 item_head_grid(int items, int H) { return dim3(unsigned(int64_t(items) * H)); }

// ----------------------------------------------------------------------------------------------------
// The scans' online-softmax step for a warp's 16 rows over NT n-tiles of 8 keys (the scans' chunks: NT = 8);
// s in log2 units, overwritten with exp2(s - m_new).
template <int NT>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hr], s[nt][2 * hr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m[hr], mx);
    alpha[hr] = fast_exp2(m[hr] - mn);
    m[hr] = mn;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * hr] = fast_exp2(s[nt][2 * hr] - mn);
      s[nt][2 * hr + 1] = fast_exp2(s[nt][2 * hr + 1] - mn);
      sum += s[nt][2 * hr] + s[nt][2 * hr + 1];
    }
    l[hr] = l[hr] * alpha[hr] + sum;
  }
}

// Rescales a warp's 16-row accumulator tile (C layout, NT n-tiles) by the softmax step's per-row factors.
template <int NT>
__device__ __forceinline__ void scale_rows(float (&o)[NT][4], const float (&alpha)[2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    o[nt][0] *= alpha[0];
    o[nt][1] *= alpha[0];
    o[nt][2] *= alpha[1];
    o[nt][3] *= alpha[1];
  }
}

// A row's softmax sum from the partial sums of the quad of lanes that hold it (C layout).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The forward's epilogues: f(hr, r, lt) for each of a warp's two rows rr[hr] below nq, lt the row's softmax sum
// (its quad's partial sums l added; every lane takes part in that).
template <class F>
__device__ __forceinline__ void for_fwd_rows(const int (&rr)[2], int nq, const float (&l)[2], F f) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float lt = quad_sum(l[hr]);
    if (rr[hr] < nq) f(hr, rr[hr], lt);
  }
}

// o / l of a warp's 16 rows (rr) of query chunk qc into p.o (type T), rows at and past nq skipped, and lse =
// (m + log2 l) ln 2 into p.lse when present.
template <typename T, int V>
__device__ __forceinline__ void store_fwd_rows(const KernelParams& p, const ChunkDesc& ch, int qc, int hq,
                                               const int (&rr)[2], int nq, const float (&o)[V / 8][4],
                                               const float (&m)[2], const float (&l)[2]) {
  const int t4 = threadIdx.x & 3;
  const bool pair = vec2_ok(static_cast<T*>(p.o), p.o_s[0], p.o_s[1], p.o_s[2]);
  for_fwd_rows(rr, nq, l, [&](int hr, int r, float lt) {
    const float inv = 1.f / lt;
    const int64_t pos = ch.t0 + int64_t(qc) * kChunk + r;
    T* orow = static_cast<T*>(p.o) + ch.b * p.o_s[0] + pos * p.o_s[1] + hq * p.o_s[2];
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) store2(orow + 8 * nt + 2 * t4, o[nt][2 * hr] * inv, o[nt][2 * hr + 1] * inv, pair);
    if (p.lse && t4 == 0)
      p.lse[ch.b * p.lse_s[0] + pos * p.lse_s[1] + hq * p.lse_s[2]] = (m[hr] + log2f(lt)) * 0.6931471805599453f;
  });
}

// ----------------------------------------------------------------------------------------------------
// cp.async: 16-byte global -> shared copies; src_bytes = 0 zero-fills (rows past a sequence's end).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// Waits until at most N of this thread's most recent commit groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Copies 64 x D elements (2-byte type) of a row-strided global tile into shared memory [64][D + 8] with
// 16-byte cp.async (not committed); rows >= nvalid are zero-filled. `stride` is the global row stride in
// elements. For the 128-thread scan kernels: each thread keeps one 16-byte column and steps 128 / (D / 8)
// rows at a time, so the addresses are a few adds (no divisions or 64-bit multiplies per element). `tid` (0 ..
// 127) is the copying thread's index: a larger block may split its tiles between groups of 128 threads.
inline constexpr int kTileThreads = 128;
template <int D, typename E>
__device__ __forceinline__ void load_tile_async(E* dst, const E* src, int64_t stride, int nvalid,
                                                int tid = threadIdx.x) {
  constexpr int kVec = 8, kPerRow = D / kVec, kRowStep = kTileThreads / kPerRow;
  static_assert(kTileThreads % kPerRow == 0 && 64 % kRowStep == 0, "load_tile_async: tile shape");
  const int r0 = tid / kPerRow, c = (tid % kPerRow) * kVec;
  const E* s = src + r0 * stride + c;
  E* d = dst + r0 * (D + 8) + c;
  const int64_t sstep = kRowStep * stride;
#pragma unroll
  for (int i = 0; i < 64 / kRowStep; ++i) {
    const bool ok = r0 + i * kRowStep < nvalid;
    cp_async16(d + i * kRowStep * (D + 8), ok ? s : src, ok);
    s += sstep;
  }
}

// A chunk's fp16 W and W2 tiles (the w16 and w2h rows of kv head h from token tok) into two [64][K + 8] tiles by
// cp.async (the scan kernels' 128 threads), committed as one group.
template <int K, class P>
__device__ __forceinline__ void load_chunk_w_async(const P& p, int64_t tok, int h, __half* Wd, __half* W2d) {
  load_tile_async<K>(Wd, p.w16 + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk);
  load_tile_async<K>(W2d, p.w2h + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk);
  cp_async_commit();
}

// ----------------------------------------------------------------------------------------------------
// Block-level fp32 product for the chunk (UT transform) kernels: out(r, c, sum_k a(r, k) b(k, c)) for
// r < M, c < N, with k running over [klo(r, c), khi(r, c)) so triangular products skip their zeros.
// Each thread owns outputs idx = tid + i * blockDim.x, so a caller may accumulate into its own outputs.
template <class FA, class FB, class FK, class FO>
__device__ __forceinline__ void block_mm(int M, int N, FA a, FB b, FK krange, FO out) {
  for (int idx = threadIdx.x; idx < M * N; idx += blockDim.x) {
    const int r = idx / N, c = idx % N;
    int lo, hi;
    krange(r, c, lo, hi);
    float s = 0.f;
    for (int k = lo; k < hi; ++k) s = fmaf(a(r, k), b(k, c), s);
    out(r, c, s);
  }
}

// Block-level tf32 tensor-core products for the chunk kernels (blockDim.x == 32 kTcWarps), M x N outputs
// (M, N multiples of 16), inner dimension KD (multiple of 8). Operands come from accessor functions a(r, k)
// and b(k, c) (shared or global memory, masks folded in, so triangular products pass zeros through the
// accessors, and say where those zeros lie by a KSpan, so that the warps skip them). kX3 splits every operand
// into a tf32 head and a tf32 tail and sums three products (head*head + head*tail + tail*head): about fp32
// accuracy at three times the work, for the products that feed the triangular inverse. Warp tiling (TcTile):
// M / 16 m-tiles over min(M / 16, kTcWarps) warps; the remaining warp factor splits N. 16 warps: these kernels
// are latency-bound at one CTA per SM. A thread owns the same outputs in every product of the same M x N, so
// several products can accumulate into one register fragment (mma_tc_acc).
inline constexpr int kTcWarps = 16;
inline constexpr int kTcThreads = 32 * kTcWarps;

template <int M, int N>
struct TcTile {
  static constexpr int MTILES = M / 16, WM = MTILES < kTcWarps ? MTILES : kTcWarps, WN = kTcWarps / WM,
                       MPW = MTILES / WM;
  static constexpr int NTW = N / (8 * WN);
  static_assert(MTILES % WM == 0 && N % (8 * WN) == 0, "TcTile: unsupported tile shape");
  using Acc = float[MPW][NTW][4];
  // The warp's m-tile wm and n-group wn. In a 4 x 4 warp grid (64-row products) the warps of one scheduler
  // (warp % 4) get one m-tile each (wm = warp / 4) and n-groups that are a Latin square over the schedulers,
  // so that the triangular products' unequal warps (row blocks of the k spans, tiles the output mask clears:
  // KSpan) spread evenly: each scheduler holds 2 or 3 of the 10 lower tiles, and one warp of each row block.
  // Which warp owns an output never changes a sum's order: results are the same bits under any mapping.
  __device__ static __forceinline__ void coords(int warp, int& wm, int& wn) {
    if constexpr (WM == 4 && WN == 4) {
      wm = warp >> 2;
      wn = (0x1b4ee1b4u >> (2 * (4 * (warp & 3) + wm))) & 3;
    } else {
      wm = warp % WM;
      wn = warp / WM;
    }
  }
  // f(r, c, value&, value&) for every pair of outputs (columns c, c + 1; c even) this thread owns.
  template <class F>
  __device__ static __forceinline__ void each_pair(Acc& acc, F f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int wm, wn;
    coords(warp, wm, wn);
#pragma unroll
    for (int mi = 0; mi < MPW; ++mi)
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        const int r = 16 * (wm + WM * mi) + g, c = 8 * (wn * NTW + nt) + 2 * t;
        f(r, c, acc[mi][nt][0], acc[mi][nt][1]);
        f(r + 8, c, acc[mi][nt][2], acc[mi][nt][3]);
      }
  }
  // f(r, c, value&) for every output this thread owns (each_pair, one element at a time).
  template <class F>
  __device__ static __forceinline__ void each(Acc& acc, F f) {
    each_pair(acc, [&](int r, int c, float& v, float& w) {
      f(r, c, v);
      f(r, c + 1, w);
    });
  }
  __device__ static __forceinline__ void zero(Acc& acc) {
    each(acc, [](int, int, float& v) { v = 0.f; });
  }
};

// Column sums over a warp's 16 rows of a 16 x 64 tile x in the accumulator layout (rows g and g + 8, columns
// 8 nt + 2t and + 1): three shuffles over the rows; lane t < 4 then holds columns 8 nt + 2t + j in cs[nt][j].
// Every lane of the warp calls it.
__device__ __forceinline__ void warp_col_sums(const float (&x)[8][4], float (&cs)[8][2]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) cs[nt][j] = x[nt][j] + x[nt][2 + j];
#pragma unroll
  for (int o = 4; o < 32; o <<= 1)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) cs[nt][j] += __shfl_xor_sync(0xffffffffu, cs[nt][j], o);
}

// warp_col_sums, times w, added to dst[(tok0 + column) * stride] with fp32 atomics by lanes 0-3. Every lane of
// the warp calls it.
__device__ __forceinline__ void warp_add_col_sums(const float (&x)[8][4], float* dst, int64_t tok0, int stride,
                                                  float w) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  float cs[8][2];
  warp_col_sums(x, cs);
  if (lane < 4)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) atomicAdd(dst + (tok0 + 8 * nt + 2 * t + j) * stride, w * cs[nt][j]);
}

// One m16n8 accumulator fragment (rows r0 + g and r0 + g + 8, columns c0 + 2t and c0 + 2t + 1 of an 8-column
// group), times `scale`, added to dst[r * ld + c] (fp32 global, rows 16-byte aligned, ld a multiple of 4). On
// sm_90 by vector reductions: lanes t and t ^ 1 trade half their pairs, so that each adds four consecutive
// columns of one row (the even lane row r0 + g, the odd lane row r0 + g + 8) with one red.global.add.v4.f32, a
// quarter of the scalar atomics' operations; elsewhere by scalar atomics. kRowBound: rows from row_end on are
// left alone. Every lane of the warp calls it (shuffles).
template <bool kRowBound = false>
__device__ __forceinline__ void red_add_frag_v4(float* dst, int ld, int r0, int c0, const float (&a)[4], float scale,
                                                int row_end = 0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool odd = t & 1;
  const float s0 = odd ? a[0] : a[2], s1 = odd ? a[1] : a[3];
  const float x0 = __shfl_xor_sync(0xffffffffu, s0, 1), x1 = __shfl_xor_sync(0xffffffffu, s1, 1);
  const int r = r0 + g + (odd ? 8 : 0);
  float* row = dst + r * ld + c0 + 4 * (t >> 1);
  if (!kRowBound || r < row_end)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(row), "f"((odd ? x0 : a[0]) * scale),
                 "f"((odd ? x1 : a[1]) * scale), "f"((odd ? a[2] : x0) * scale), "f"((odd ? a[3] : x1) * scale)
                 : "memory");
#else
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int r = r0 + g + 8 * (e >> 1);
    if (!kRowBound || r < row_end) atomicAdd(dst + r * ld + c0 + 2 * t + (e & 1), a[e] * scale);
  }
#endif
}

// dst[r * ld + c] += scale x every output of an M x N accumulator (fp32 global, rows 16-byte aligned, ld a multiple of
// 4), a fragment at a time by red_add_frag_v4 (on sm_90 vector reductions, which bound the superblock
// backward's dP adds as scalar atomics).
template <int M, int N>
__device__ __forceinline__ void red_add_tile(float* dst, int ld, typename TcTile<M, N>::Acc& acc, float scale = 1.f) {
  using TT = TcTile<M, N>;
  int wm, wn;
  TT::coords(threadIdx.x >> 5, wm, wn);
#pragma unroll
  for (int mi = 0; mi < TT::MPW; ++mi)
#pragma unroll
    for (int nt = 0; nt < TT::NTW; ++nt)
      red_add_frag_v4(dst, ld, 16 * (wm + TT::WM * mi), 8 * (wn * TT::NTW + nt), acc[mi][nt], scale);
}

// The chunk kernels' k-loop unroll (mma_tc_acc's kU): 4 at K = 64; 2 at K = 128, where 4 raised bwd_chunk's
// spills (24 -> 96 bytes) and its time (3.52 -> 4.27 ms at T = 4k), while 2 at K = 64 cost 0.03 .. 0.12 ms a
// kernel (dev/cuda/NOTES.md v3.26).
constexpr int kTcUnroll(int K) { return K == 64 ? 4 : 2; }

// A value the same across the warp, through a shuffle from lane 0: ptxas then knows it warp-uniform and keeps what
// derives from it (wgmma descriptors, tile bounds and offsets) in uniform registers (dev/cuda/NOTES.md v3.46).
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }
__device__ __forceinline__ int uniform_warp_id() { return warp_uniform(int(threadIdx.x >> 5)); }

// Operand accessors for mma_tc_acc whose inner index k runs along a row in memory: row(i) gives the row's first
// element (type E: fp32 or 16-bit, rows 8-byte aligned for fp32, 4-byte for 16-bit), i the operand's other index
// (A: the output row, kB: the output column). mma_tc_acc takes each lane's two k of a step (2t, 2t + 1) from such
// an accessor by one paired load (pair) instead of two scalar ones; kNeg negates. Any callable (a(r, k) /
// b(k, c)) still serves where the operand is not so stored.
template <typename E, bool kB, bool kNeg, class F>
struct KRows {
  F row;
  __device__ __forceinline__ float operator()(int i, int j) const {
    const float v = to_f(row(kB ? j : i)[kB ? i : j]);
    return kNeg ? -v : v;
  }
  __device__ __forceinline__ float2 pair(int i, int k) const {
    const E* x = row(i) + k;
    float2 v;
    if constexpr (sizeof(E) == 4) v = *reinterpret_cast<const float2*>(x);
    else v = pair_f(x);
    if constexpr (kNeg) v = make_float2(-v.x, -v.y);
    return v;
  }
};
template <typename E, bool kNeg = false, class F>
__device__ __forceinline__ KRows<E, false, kNeg, F> a_rows(F row) { return {row}; }
template <typename E, bool kNeg = false, class F>
__device__ __forceinline__ KRows<E, true, kNeg, F> b_rows(F row) { return {row}; }
// A row-major matrix (leading dim ld) as either operand: a(r, k) = x[r ld + k], b(k, c) = x[c ld + k].
template <bool kNeg = false, typename E>
__device__ __forceinline__ auto a_rows(const E* x, int ld) {
  return a_rows<E, kNeg>([x, ld](int i) { return x + i * ld; });
}
template <bool kNeg = false, typename E>
__device__ __forceinline__ auto b_rows(const E* x, int ld) {
  return b_rows<E, kNeg>([x, ld](int i) { return x + i * ld; });
}
// Whether F is a KRows accessor, and for which operand (kB): mma_tc_acc's paired loads read pair(i, k) as the
// role says, so an accessor of the other role would be summed wrongly; the roles are checked at compile time.
template <class F> struct IsKRows { static constexpr bool value = false, kB = false; };
template <typename E, bool kB_, bool kNeg, class F> struct IsKRows<KRows<E, kB_, kNeg, F>> {
  static constexpr bool value = true, kB = kB_;
};

// acc += A B over this thread's outputs (no synchronisation), k over the warp's part of `span`. kU: the k loop's
// unroll (its trip count is the warp's span): the kernel's choice, by its register budget (kTcUnroll). kUW: the
// warp index through a shuffle, which ptxas then knows warp-uniform (the tiling's bounds and offsets in uniform
// registers: chunk_prep's spills go, super_bwd needs ~11 registers fewer); bwd_chunk spills more with it. Within
// each step of 8 the inner index runs permuted in both operands (lane t's fragment slots t and t + 4 take k = 2t
// and 2t + 1: the same sum), so that a KRows operand gives a lane's two k by one load.
template <int M, int N, int KD, bool kX3, int kU = 4, bool kUW = true, class FA, class FB>
__device__ __forceinline__ void mma_tc_acc(typename TcTile<M, N>::Acc& acc, FA a, FB b, KSpan span = kFull) {
  static_assert(!IsKRows<FA>::value || !IsKRows<FA>::kB, "mma_tc_acc: a b_rows accessor as the A operand");
  static_assert(!IsKRows<FB>::value || IsKRows<FB>::kB, "mma_tc_acc: an a_rows accessor as the B operand");
  using TT = TcTile<M, N>;
  constexpr int MPW = TT::MPW, NTW = TT::NTW, WM = TT::WM;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int wm, wn;
  TT::coords(kUW ? uniform_warp_id() : int(threadIdx.x >> 5), wm, wn);
  int klo, khi;
  span.range(16 * wm, 16 * (wm + WM * (MPW - 1)) + 16, 8 * wn * NTW, 8 * (wn + 1) * NTW, KD, klo, khi);
#pragma unroll(kU)
  for (int k0 = klo; k0 < khi; k0 += 8) {
    uint32_t ah[MPW][4], al[MPW][4];
#pragma unroll
    for (int mi = 0; mi < MPW; ++mi) {
      const int m = 16 * (wm + WM * mi) + g;
      float av[4];
      if constexpr (IsKRows<FA>::value) {
        const float2 x = a.pair(m, k0 + 2 * t), y = a.pair(m + 8, k0 + 2 * t);
        av[0] = x.x, av[1] = y.x, av[2] = x.y, av[3] = y.y;
      } else {
        av[0] = a(m, k0 + 2 * t), av[1] = a(m + 8, k0 + 2 * t), av[2] = a(m, k0 + 2 * t + 1);
        av[3] = a(m + 8, k0 + 2 * t + 1);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (kX3) split_tf32(av[e], ah[mi][e], al[mi][e]);
        else ah[mi][e] = to_tf32(av[e]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int n = 8 * (wn * NTW + nt) + g;
      float b0, b1;
      if constexpr (IsKRows<FB>::value) {
        const float2 x = b.pair(n, k0 + 2 * t);
        b0 = x.x, b1 = x.y;
      } else {
        b0 = b(k0 + 2 * t, n), b1 = b(k0 + 2 * t + 1, n);
      }
      uint32_t bh0, bh1, bl0 = 0, bl1 = 0;
      if (kX3) {
        split_tf32(b0, bh0, bl0);
        split_tf32(b1, bh1, bl1);
      } else {
        bh0 = to_tf32(b0);
        bh1 = to_tf32(b1);
      }
#pragma unroll
      for (int mi = 0; mi < MPW; ++mi) {
        if (kX3) {
          mma1688_tf32(acc[mi][nt], al[mi], bh0, bh1);
          mma1688_tf32(acc[mi][nt], ah[mi], bl0, bl1);
        }
        mma1688_tf32(acc[mi][nt], ah[mi], bh0, bh1);
      }
    }
  }
}

// acc += A B over this thread's outputs (TcTile's layout, no synchronisation) for 16-bit operands in shared memory
// (type E): A stored [m][k] (leading dim lda; TA: [k][m]), B stored [n][k] (ldb; TB: [k][n]), 16-byte aligned
// rows. m16n8k16 mma with ldmatrix fragments (.trans for the stored-transposed operands), k over the warp's part
// of `span` in steps of 16: for products whose operands are the inputs themselves (exact in E), or fp16 copies
// scaled into its range, where the tf32 path would load, convert and multiply them element by element.
template <int M, int N, int KD, typename E, bool TA = false, bool TB = false>
__device__ __forceinline__ void mma_tc_acc16(typename TcTile<M, N>::Acc& acc, const E* A, int lda, const E* B,
                                             int ldb, KSpan span = kFull) {
  using TT = TcTile<M, N>;
  constexpr int MPW = TT::MPW, NTW = TT::NTW, WM = TT::WM;
  static_assert(NTW % 2 == 0 && KD % 16 == 0, "mma_tc_acc16: n-tiles in pairs, k in steps of 16");
  int wm, wn;
  TT::coords(threadIdx.x >> 5, wm, wn);
  int klo, khi;
  span.range(16 * wm, 16 * (wm + WM * (MPW - 1)) + 16, 8 * wn * NTW, 8 * (wn + 1) * NTW, KD, klo, khi);
  klo &= ~15;
  khi = (khi + 15) & ~15;
  if (khi <= klo) return;
  const E* const a0 = A + (TA ? klo * lda : klo);
  const E* const b0 = B + (TB ? klo * ldb : klo);
#pragma unroll
  for (int mi = 0; mi < MPW; ++mi)
    warp_mma_ss<E, 1, NTW, TA, TB>(*reinterpret_cast<float(*)[1][NTW][4]>(&acc[mi]), a0, lda, 16 * (wm + WM * mi), b0,
                                   ldb, 8 * wn * NTW, khi - klo);
}

// out2(r, c, v, w) with v, w the sums sum_k a1(r, k) b1(k, c') + sum_k a2(r, k) b2(k, c') at c' = c and c + 1 (c
// even), for every pair of outputs: a product over a stacked inner dimension [A1 | A2] [B1 ; B2] as two passes
// into one accumulator (no per-element select between the halves); pairs of columns, so that an epilogue can
// store both with one instruction. span1, span2: where each pass's terms can be non-zero (KSpan). Every warp
// finishes reading before any `out2` runs (one __syncthreads in between), so `out2` may overwrite the
// operands. Callers sync before the next read.
template <int M, int N, int KD1, int KD2, bool kX3, int kU = 4, bool kUW = true, class FA1, class FB1, class FA2,
          class FB2, class FO2>
__device__ __forceinline__ void block_mm_tc2_pairs(FA1 a1, FB1 b1, FA2 a2, FB2 b2, FO2 out2, KSpan span1 = kFull,
                                                   KSpan span2 = kFull) {
  using TT = TcTile<M, N>;
  typename TT::Acc acc;
  TT::zero(acc);
  mma_tc_acc<M, N, KD1, kX3, kU, kUW>(acc, a1, b1, span1);
  if constexpr (KD2 > 0) mma_tc_acc<M, N, KD2, kX3, kU, kUW>(acc, a2, b2, span2);
  __syncthreads();
  TT::each_pair(acc, [&](int r, int c, float& v, float& w) { out2(r, c, v, w); });
}
// out(r, c, sum_k a1(r, k) b1(k, c) + sum_k a2(r, k) b2(k, c)) for every output (block_mm_tc2_pairs, one
// element at a time).
template <int M, int N, int KD1, int KD2, bool kX3, int kU = 4, bool kUW = true, class FA1, class FB1, class FA2,
          class FB2, class FO>
__device__ __forceinline__ void block_mm_tc2(FA1 a1, FB1 b1, FA2 a2, FB2 b2, FO out, KSpan span1 = kFull,
                                             KSpan span2 = kFull) {
  block_mm_tc2_pairs<M, N, KD1, KD2, kX3, kU, kUW>(
      a1, b1, a2, b2,
      [&](int r, int c, float v, float w) {
        out(r, c, v);
        out(r, c + 1, w);
      },
      span1, span2);
}
// out(r, c, sum_k a(r, k) b(k, c)): the same with one inner dimension.
template <int M, int N, int KD, bool kX3, int kU = 4, bool kUW = true, class FA, class FB, class FO>
__device__ __forceinline__ void block_mm_tc(FA a, FB b, FO out, KSpan span = kFull) {
  block_mm_tc2<M, N, KD, 0, kX3, kU, kUW>(a, b, a, b, out, span);
}
template <int M, int N, int KD, bool kX3, int kU = 4, bool kUW = true, class FA, class FB, class FO2>
__device__ __forceinline__ void block_mm_tc_pairs(FA a, FB b, FO2 out2, KSpan span = kFull) {
  block_mm_tc2_pairs<M, N, KD, 0, kX3, kU, kUW>(a, b, a, b, out2, span);
}

// Four consecutive elements at p as floats: one 8-byte (16-bit types) or 16-byte (fp32) load when vec (p
// aligned to that), else four scalar loads.
__device__ __forceinline__ float4 load4(const float* p, bool vec) {
  return vec ? *reinterpret_cast<const float4*>(p) : make_float4(p[0], p[1], p[2], p[3]);
}
template <typename E>
__device__ __forceinline__ float4 load4(const E* p, bool vec) {
  if (vec) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const E* e = reinterpret_cast<const E*>(&u);
    return make_float4(to_f(e[0]), to_f(e[1]), to_f(e[2]), to_f(e[3]));
  }
  return make_float4(to_f(p[0]), to_f(p[1]), to_f(p[2]), to_f(p[3]));
}
// Whether every 4-element group of rows base + i s0 + j s1 + k s2 (+ 4 m) is aligned for load4's vector load.
template <typename E>
__host__ __device__ __forceinline__ bool vec4_ok(const E* base, int64_t s0, int64_t s1, int64_t s2) {
  constexpr int64_t kBytes = 4 * sizeof(E);
  return reinterpret_cast<uintptr_t>(base) % kBytes == 0 && (s0 * int64_t(sizeof(E))) % kBytes == 0 &&
         (s1 * int64_t(sizeof(E))) % kBytes == 0 && (s2 * int64_t(sizeof(E))) % kBytes == 0;
}
// 4 floats into shared memory: as 4 values of E (two packed 32-bit stores; dst 8-byte aligned) or fp32
// (one 16-byte store; dst 16-byte aligned).
template <typename E>
__device__ __forceinline__ void store4(E* dst, float4 v) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(Pack2<E>::pack(v.x, v.y), Pack2<E>::pack(v.z, v.w));
}
__device__ __forceinline__ void store4(float* dst, float4 v) { *reinterpret_cast<float4*>(dst) = v; }

// Stages 64 x D tiles of one or two row-strided global sources into shared memory, 4 elements per step, every
// load of a thread issued before its first store (so their latencies overlap). Row r of source i starts at
// src_i + off_i(r) (D contiguous elements); rows >= nvalid (and all of a null source) are zero; dst_i has
// leading dim ld_i (a multiple of 4).
template <typename E>
struct TileSrc {
  const E* src;  // null: zeros
  int64_t s0, s1, s2;  // the row's offset is i0 s0 + i1 s1 + i2 s2 (elements)
  bool vec;
};
template <int D, typename E1, typename D1, typename E2, typename D2>
__device__ __forceinline__ void stage_tiles4(const TileSrc<E1>& a, int64_t a0, int64_t a2, D1* da, int lda,
                                             const TileSrc<E2>& b, int64_t b0, int64_t b2, D2* db, int ldb,
                                             int64_t row0, int nvalid) {
  constexpr int kG = 64 * D / 4 / kTcThreads;
  static_assert(kG >= 1 && (64 * D / 4) % kTcThreads == 0, "stage_tiles4: tile shape");
  float4 va[kG], vb[kG];
  const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    const int idx = threadIdx.x + i * kTcThreads, r = idx / (D / 4), d = 4 * (idx % (D / 4));
    const bool ok = r < nvalid;
    va[i] = ok && a.src ? load4(a.src + a0 * a.s0 + (row0 + r) * a.s1 + a2 * a.s2 + d, a.vec) : z;
    vb[i] = ok && b.src ? load4(b.src + b0 * b.s0 + (row0 + r) * b.s1 + b2 * b.s2 + d, b.vec) : z;
  }
#pragma unroll
  for (int i = 0; i < kG; ++i) {
    const int idx = threadIdx.x + i * kTcThreads, r = idx / (D / 4), d = 4 * (idx % (D / 4));
    store4(da + r * lda + d, va[i]);
    if (db) store4(db + r * ldb + d, vb[i]);
  }
}
// A workspace tensor [token][H][D] (contiguous, 16-byte aligned rows) as a TileSrc: rows are tokens, i2 the head.
template <int D, typename E>
__device__ __forceinline__ TileSrc<E> ws_src(const E* base, int H) {
  return TileSrc<E>{base, 0, int64_t(H) * D, D, true};
}
template <int D, typename E1, typename D1>
__device__ __forceinline__ void stage_tile4(const TileSrc<E1>& a, int64_t a0, int64_t a2, D1* da, int lda,
                                            int64_t row0, int nvalid) {
  stage_tiles4<D>(a, a0, a2, da, lda, TileSrc<float>{nullptr, 0, 0, 0, false}, 0, 0, static_cast<float*>(nullptr), 0,
                  row0, nvalid);
}
// Whether rows base + i s0 + j s1 + k s2 start 16-byte aligned (cp.async's 16-byte copies).
template <typename E>
__host__ __device__ __forceinline__ bool vec16_ok(const E* base, int64_t s0, int64_t s1, int64_t s2) {
  const int64_t e = sizeof(E);
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (s0 * e) % 16 == 0 && (s1 * e) % 16 == 0 &&
         (s2 * e) % 16 == 0;
}
// The same 64 x D tile as stage_tile4, without conversion (dst of the source's type, leading dim ld with 16-byte
// rows), by 16-byte cp.async (not committed: the caller commits and waits) where `async` (the source's rows
// 16-byte aligned, vec16_ok, and the source not null); otherwise by stage_tile4 at once. Either way the copy
// is visible to the block after the caller's wait and barrier. Rows >= nvalid are zero.
template <int D, typename E>
__device__ __forceinline__ void stage_tile_async(const TileSrc<E>& a, int64_t a0, int64_t a2, E* dst, int ld,
                                                 int64_t row0, int nvalid, bool async) {
  if (!async || a.src == nullptr) {
    stage_tile4<D>(a, a0, a2, dst, ld, row0, nvalid);
    return;
  }
  constexpr int kV = 16 / int(sizeof(E)), kPerRow = D / kV, kN = 64 * kPerRow / kTcThreads;
  static_assert(kN >= 1 && (64 * kPerRow) % kTcThreads == 0, "stage_tile_async: tile shape");
  const E* base = a.src + a0 * a.s0 + row0 * a.s1 + a2 * a.s2;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const int idx = threadIdx.x + i * kTcThreads, r = idx / kPerRow, d = kV * (idx % kPerRow);
    const bool ok = r < nvalid;
    cp_async16(dst + r * ld + d, ok ? base + r * a.s1 + d : base, ok);
  }
}

// A chunk's k rows (16-bit type T, into Ks, leading dim lt) and w rows (fp32, into Wf, leading dim lw) of kv
// head h, rows from position pos0 of batch row b; rows >= nq and (without the transport) w are zero. With
// `async`, by stage_tile_async (not committed), each tile whose rows allow it.
template <int K, class P, typename T>
__device__ __forceinline__ void stage_chunk_kw(const P& p, int64_t b, int64_t pos0, int h, int nq, T* Ks, int lt,
                                               float* Wf, int lw, bool async = false) {
  const T* kp = static_cast<const T*>(p.k);
  const TileSrc<T> ks{kp, p.k_s[0], p.k_s[1], p.k_s[2], vec4_ok(kp, p.k_s[0], p.k_s[1], p.k_s[2])};
  const TileSrc<float> ws{p.path ? p.w : nullptr, p.w_s[0], p.w_s[1], p.w_s[2],
                             vec4_ok(p.w, p.w_s[0], p.w_s[1], p.w_s[2])};
  if (async) {
    stage_tile_async<K>(ks, b, h, Ks, lt, pos0, nq, vec16_ok(kp, p.k_s[0], p.k_s[1], p.k_s[2]));
    stage_tile_async<K>(ws, b, h, Wf, lw, pos0, nq, vec16_ok(p.w, p.w_s[0], p.w_s[1], p.w_s[2]));
  } else {
    stage_tiles4<K>(ks, b, h, Ks, lt, ws, b, h, Wf, lw, pos0, nq);
  }
}

// One warp: acc (a 16 x 8 C fragment) += A B over an inner dimension KD, both operands fp32 in shared memory
// (A row-major from its tile's top-left, ld lda; B row-major [k][n] from its tile's top-left, ld ldb), in
// split tf32 (head * head + head * tail + tail * head): about fp32 accuracy.
template <int KD>
__device__ __forceinline__ void warp_mma_f32x3(float (&acc)[4], const float* A, int lda, const float* B, int ldb) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int k0 = 0; k0 < KD; k0 += 8) {
    uint32_t ah[4], al[4], bh0, bl0, bh1, bl1;
    split_tf32(A[g * lda + k0 + t], ah[0], al[0]);
    split_tf32(A[(g + 8) * lda + k0 + t], ah[1], al[1]);
    split_tf32(A[g * lda + k0 + t + 4], ah[2], al[2]);
    split_tf32(A[(g + 8) * lda + k0 + t + 4], ah[3], al[3]);
    split_tf32(B[(k0 + t) * ldb + g], bh0, bl0);
    split_tf32(B[(k0 + t + 4) * ldb + g], bh1, bl1);
    mma1688_tf32(acc, al, bh0, bh1);
    mma1688_tf32(acc, ah, bl0, bl1);
    mma1688_tf32(acc, ah, bh0, bh1);
  }
}

// Stores a warp's 16 x 8 C fragment, times `scale`, into a row-major fp32 tile (top-left dst, ld ld).
__device__ __forceinline__ void warp_store_c(float* dst, int ld, const float (&acc)[4], float scale) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  dst[g * ld + 2 * t] = scale * acc[0];
  dst[g * ld + 2 * t + 1] = scale * acc[1];
  dst[(g + 8) * ld + 2 * t] = scale * acc[2];
  dst[(g + 8) * ld + 2 * t + 1] = scale * acc[3];
}

// The last doubling level of unit_lower_inverse (rows 32..63, columns 0..31: E21 = -E22 (A21 E11)) on four warps,
// one 8-column strip each (two 16-row C fragments), given E11 and E22 in place; every thread of the block calls
// it after a barrier, and it ends with one.
__device__ __forceinline__ void inverse_level2(const float* A, int lda, float* E, int lde) {
  const int warp = threadIdx.x >> 5;
  if (warp < 4) {
    const int c0 = 8 * warp;
    float acc[2][4] = {};
#pragma unroll
    for (int m = 0; m < 2; ++m) warp_mma_f32x3<32>(acc[m], A + (32 + 16 * m) * lda, lda, E + c0, lde);
#pragma unroll
    for (int m = 0; m < 2; ++m) warp_store_c(E + (32 + 16 * m) * lde + c0, lde, acc[m], 1.f);
    __syncwarp();
    float e21[2][4] = {};
#pragma unroll
    for (int m = 0; m < 2; ++m) warp_mma_f32x3<32>(e21[m], E + (32 + 16 * m) * lde + 32, lde, E + 32 * lde + c0, lde);
    __syncwarp();
#pragma unroll
    for (int m = 0; m < 2; ++m) warp_store_c(E + (32 + 16 * m) * lde + c0, lde, e21[m], -1.f);
  }
  __syncthreads();
}

// E = (I + A)^-1 for a 64 x 64 strictly lower A (ld lda), written to E (ld lde); every thread of a kTcThreads
// block calls it, and it ends with a barrier. The four 16 x 16 diagonal blocks in registers, one thread a
// column (threads 0..63: right-looking substitution, 120 fmas on a 15-step critical path, no shuffles), while
// the other warps zero the blocks above the diagonal. Then two doubling levels, each
//   [E11 0; E21 E22] with E21 = -E22 (A21 E11)
// in split tf32 warp products: level 1 (16 -> 32) in the same two warps (blocks 0 and 1 are warp 0's columns,
// blocks 2 and 3 warp 1's: a syncwarp, no CTA barrier), level 2 (rows 32..63, columns 0..31) on four warps,
// one 8-column strip each (the strip of A21 E11 it needs is its own, parked in E21's place). Two barriers.
__device__ __forceinline__ void unit_lower_inverse(const float* A, int lda, float* E, int lde) {
  const int tid = threadIdx.x, warp = tid >> 5;
  if (tid < 64) {
    const int c = tid, b0 = c & ~15, j = c & 15;
    float e[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) e[r] = r == j ? 1.f : 0.f;
    // Column j of the block's inverse: e[r] -= A[r][t] e[t] for t < r, t ascending (e[t] = 0 for t < j).
#pragma unroll
    for (int t = 0; t < 15; ++t) {
      const float* At = A + b0 * lda + b0 + t;
#pragma unroll
      for (int r = t + 1; r < 16; ++r) e[r] = fmaf(-At[r * lda], e[t], e[r]);
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) E[(b0 + r) * lde + c] = e[r];
    __syncwarp();
    // Level 1: warp w's block pair (2w, 2w + 1): E21 (16 x 16) as two 8-column strips.
    const int d0 = 32 * warp, r0 = d0 + 16;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int c0 = d0 + 8 * s;
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      warp_mma_f32x3<16>(acc, A + r0 * lda + d0, lda, E + d0 * lde + c0, lde);
      warp_store_c(E + r0 * lde + c0, lde, acc, 1.f);
    }
    __syncwarp();
    float e21[2][4] = {};
#pragma unroll
    for (int s = 0; s < 2; ++s) warp_mma_f32x3<16>(e21[s], E + r0 * lde + r0, lde, E + r0 * lde + d0 + 8 * s, lde);
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 2; ++s) warp_store_c(E + r0 * lde + d0 + 8 * s, lde, e21[s], -1.f);
  } else {
    // Zeros above the diagonal blocks: rows of block rb, columns of the blocks right of it.
    for (int idx = tid - 64; idx < 6 * 256; idx += kTcThreads - 64) {
      const int blk = idx >> 8, rb = blk < 3 ? 0 : blk < 5 ? 1 : 2, cb = blk < 3 ? blk + 1 : blk < 5 ? blk - 1 : 3;
      const int r = 16 * rb + ((idx >> 4) & 15), c = 16 * cb + (idx & 15);
      E[r * lde + c] = 0.f;
    }
  }
  __syncthreads();
  inverse_level2(A, lda, E, lde);
}

// ----------------------------------------------------------------------------------------------------
// Phase probes (dev/cuda/phase_probe.cu), compiled in only with -DPATHATTN_PHASE_PROBE: thread 0 of each of
// the first kProbeCtas CTAs (blockIdx.x fastest) stamps clock64() at PA_PROBE(slot), into a table per
// translation unit that PA_PROBE_TABLE(name) exposes to the host as probe_table_name(). Callers place probes
// after a __syncthreads, so a stamp marks the end of a phase for the whole CTA.
#ifdef PATHATTN_PHASE_PROBE
inline constexpr int kProbeCtas = 2048, kProbeSlots = 24;
static __device__ long long g_probe[kProbeCtas][kProbeSlots];
#define PA_PROBE(slot)                                                                   \
  do {                                                                                   \
    const int cta_ = blockIdx.x + gridDim.x * blockIdx.y;                                \
    if (threadIdx.x == 0 && cta_ < kProbeCtas) g_probe[cta_][slot] = clock64();          \
  } while (0)
#define PA_PROBE_TABLE(name) \
  cudaError_t probe_table_##name(long long* host) { return cudaMemcpyFromSymbol(host, g_probe, sizeof(g_probe)); }
#else
#define PA_PROBE(slot) \
  do {                 \
  } while (0)
#define PA_PROBE_TABLE(name)
#endif

}  // namespace pathattn::cuda
