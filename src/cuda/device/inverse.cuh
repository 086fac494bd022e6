// cuda/device/inverse.cuh: the chunk inverse E = (I + A)^-1 (unit lower triangular, split-tf32 warp products)
// and its compact fp16 form kept from chunk_prep to bwd_chunk.
#pragma once

#include "cuda/device/mma.cuh"
#include "cuda/device/scale.cuh"

namespace pathattn::cuda {

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

}  // namespace pathattn::cuda
