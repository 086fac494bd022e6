// cuda/device/finite.cuh: non-finite rows of a chunk's staged tiles. Inside a chunk the masked products multiply
// exact zeros with later rows, and 0 * NaN is NaN, so a NaN or Inf at row p would reach the chunk's earlier rows.
// The kernels zero such values in shared memory, run the chunk as for finite input (rows before p are then the
// same as with any finite value at p), and give rows >= p (and what depends on all of the chunk) NaN afterwards,
// which is what the definition gives there (docs/numerics.md, non-finite inputs).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace pathattn::cuda {

// Exponent bits of each element type: all ones means Inf or NaN.
template <typename T> struct NonFiniteBits;
template <> struct NonFiniteBits<float> { static constexpr uint32_t mask = 0x7f800000u, lanes = 1; };
template <> struct NonFiniteBits<__half> { static constexpr uint32_t mask = 0x7c007c00u, lanes = 2; };
template <> struct NonFiniteBits<__nv_bfloat16> { static constexpr uint32_t mask = 0x7f807f80u, lanes = 2; };

// Zeroes the non-finite elements of one 32-bit word of T values (one fp32, or a pair of 16-bit values).
template <typename T>
__device__ __forceinline__ uint32_t zero_nonfinite_word(uint32_t x, bool& bad) {
  constexpr uint32_t m = NonFiniteBits<T>::mask;
  if constexpr (NonFiniteBits<T>::lanes == 1) {
    const bool b = (x & m) == m;
    bad |= b;
    return b ? 0u : x;
  } else {
    const uint32_t lo = m & 0xffffu, hi = m & 0xffff0000u;
    const bool blo = (x & lo) == lo, bhi = (x & hi) == hi;
    bad |= blo || bhi;
    return (blo ? 0u : x & 0xffffu) | (bhi ? 0u : x & 0xffff0000u);
  }
}

// Scans rows [0, rows) of a [64][N] tile of T (pitch ld elements, 16-byte aligned rows) with the block's threads,
// zeroing non-finite elements in place; returns the first row of this thread's share that held one (INT32_MAX:
// none). The tile must be visible to the block before; a barrier must follow before it is read.
template <int N, typename T>
__device__ __forceinline__ int zero_nonfinite_tile(T* tile, int ld, int rows, int tid, int nthreads) {
  constexpr int kPerVec = 16 / sizeof(T), kVecs = N / kPerVec;
  static_assert(N % kPerVec == 0, "zero_nonfinite_tile: whole 16-byte vectors a row");
  int first = INT32_MAX;
  for (int i = tid; i < rows * kVecs; i += nthreads) {
    const int r = i / kVecs, c = (i % kVecs) * kPerVec;
    uint4* ptr = reinterpret_cast<uint4*>(tile + r * ld + c);
    uint4 v = *ptr;
    bool bad = false;
    v.x = zero_nonfinite_word<T>(v.x, bad);
    v.y = zero_nonfinite_word<T>(v.y, bad);
    v.z = zero_nonfinite_word<T>(v.z, bad);
    v.w = zero_nonfinite_word<T>(v.w, bad);
    if (bad) {
      *ptr = v;
      first = min(first, r);
    }
  }
  return first;
}

// The same for a vector of n floats (beta): zeroes non-finite entries, returns the first one's index or INT32_MAX.
__device__ __forceinline__ int zero_nonfinite_vec(float* x, int n, int tid, int nthreads) {
  int first = INT32_MAX;
  for (int i = tid; i < n; i += nthreads)
    if (!isfinite(x[i])) {
      x[i] = 0.f;
      first = min(first, i);
    }
  return first;
}

// The block's first non-finite row from each thread's `first` (INT32_MAX: none), as kChunk-or-more when there is
// none. Every thread of the block calls it; `slot` is one int of shared memory no one else uses meanwhile. The
// common case (no non-finite value) costs one barrier; it also makes the zeroed tiles visible to the block.
__device__ __forceinline__ int block_first_nonfinite(int first, int* slot) {
  if (!__syncthreads_or(first != INT32_MAX)) return INT32_MAX;
  if (threadIdx.x == 0) *slot = INT32_MAX;
  __syncthreads();
  if (first != INT32_MAX) atomicMin(slot, first);
  __syncthreads();
  const int r = *slot;
  __syncthreads();  // every thread has read the slot before anyone reuses it
  return r;
}

// The same for two tiles at once (a, b: each thread's firsts; slot: two ints): one barrier when both are finite.
__device__ __forceinline__ int2 block_first_nonfinite2(int a, int b, int* slot) {
  if (!__syncthreads_or(a != INT32_MAX || b != INT32_MAX)) return make_int2(INT32_MAX, INT32_MAX);
  if (threadIdx.x == 0) slot[0] = slot[1] = INT32_MAX;
  __syncthreads();
  if (a != INT32_MAX) atomicMin(slot, a);
  if (b != INT32_MAX) atomicMin(slot + 1, b);
  __syncthreads();
  const int2 r = make_int2(slot[0], slot[1]);
  __syncthreads();
  return r;
}

// Zeroes rows [r0, rows) of a [64][N] tile of T (pitch ld) with the block's threads (the rows after a non-finite
// one, so that the chunk is computed as the sequence cut at r0).
template <int N, typename T>
__device__ __forceinline__ void zero_rows_from(T* tile, int ld, int r0, int rows, int tid, int nthreads) {
  for (int i = tid; i < (rows - r0) * N; i += nthreads) tile[(r0 + i / N) * ld + i % N] = T(0.f);
}

// A quiet NaN (what poisoned fp32 rows are stored as).
__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fc00000); }

// A pair of quiet NaNs of T in one 32-bit word (what poisoned rows are stored as).
template <typename T>
__device__ __forceinline__ uint32_t nan_pair() {
  if constexpr (std::is_same_v<T, __half>) return 0x7e007e00u;
  else return 0x7fc07fc0u;
}

}  // namespace pathattn::cuda
