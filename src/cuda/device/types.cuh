// cuda/device/types.cuh: element types of the kernels: fp16 / bf16 packing and conversions, fp32 loads and
// stores of q/k/v-typed rows. T is the q/k/v storage type; transport operands are __half.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/params.h"

namespace pathattn::cuda {

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
// at these loads cost fwd_scan a quarter of its time (docs/cuda.md).
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

// Element i of a w / beta / g tensor (or of its gradient) in the caller's dtype dt, as fp32: the kernels read and
// write these tensors where they are, with no converted copy (the branch is uniform across the grid).
__device__ __forceinline__ float load_param(const void* x, ParamDt dt, int64_t i) {
  if (dt == ParamDt::bf16) return __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
  if (dt == ParamDt::f16) return __half2float(static_cast<const __half*>(x)[i]);
  return static_cast<const float*>(x)[i];
}
__device__ __forceinline__ void store_param(void* x, ParamDt dt, int64_t i, float v) {
  if (dt == ParamDt::bf16) static_cast<__nv_bfloat16*>(x)[i] = __float2bfloat16_rn(v);
  else if (dt == ParamDt::f16) static_cast<__half*>(x)[i] = __float2half_rn(v);
  else static_cast<float*>(x)[i] = v;
}
// Elements i, i + 1 (pair: aligned for one store, vec2_ok in dt's element type) of a gradient in dtype dt.
__device__ __forceinline__ void store_param2(void* x, ParamDt dt, int64_t i, float a, float b, bool pair) {
  if (dt == ParamDt::bf16) store2(static_cast<__nv_bfloat16*>(x) + i, a, b, pair);
  else if (dt == ParamDt::f16) store2(static_cast<__half*>(x) + i, a, b, pair);
  else store2(static_cast<float*>(x) + i, a, b, pair);
}
// vec2_ok for a w / beta / g gradient of dtype dt.
__host__ __device__ __forceinline__ bool vec2_ok_param(const void* x, ParamDt dt, int64_t s0, int64_t s1, int64_t s2) {
  const int64_t bytes = dt == ParamDt::f32 ? 8 : 4;
  return reinterpret_cast<uintptr_t>(x) % bytes == 0 && s0 % 2 == 0 && s1 % 2 == 0 && s2 % 2 == 0;
}

}  // namespace pathattn::cuda
