// cuda/device/mma.cuh: tensor-core MMA through inline PTX (mma.sync m16n8k16 fp16 / bf16, m16n8k8 tf32;
// sm_80 and up), ldmatrix, and warp tiles over shared memory with fp32 accumulators.
#pragma once

#include "cuda/device/types.cuh"

namespace pathattn::cuda {

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

// Threads of the chunk kernels' CTAs (the tensor-core tiles of tiles.cuh, the copies of copies.cuh): 16 warps.
inline constexpr int kTcWarps = 16;
inline constexpr int kTcThreads = 32 * kTcWarps;

}  // namespace pathattn::cuda
