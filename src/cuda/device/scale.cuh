// cuda/device/scale.cuh: power-of-two row scaling and warp / block maxima for 16-bit operands of any range,
// and the transport steps (one chunk, one superblock product) on a warp's register tile.
#pragma once

#include "cuda/device/mma.cuh"

namespace pathattn::cuda {

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

}  // namespace pathattn::cuda
