// core/convert.h: scalar conversions between the storage dtypes (bf16, f16, f32, f64) and the compute
// types (float, double), and strided row loads/stores used by every CPU backend. Round-to-nearest-even.
#pragma once

#include <cstdint>
#include <cstring>

#include "pathattn/types.h"

namespace pathattn::core {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return uint16_t((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400u));
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u, aexp = (u >> 23) & 0xffu, man = u & 0x7fffffu;
  if (aexp == 0xff) return uint16_t(sign | 0x7c00u | (man ? 0x200u : 0u));
  int e = int(aexp) - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7c00u);  // overflow -> inf
  if (e <= 0) {                                  // subnormal or zero
    if (e < -10) return uint16_t(sign);
    man |= 0x800000u;
    int shift = 14 - e;
    uint32_t half = 1u << (shift - 1), rest = man & ((1u << shift) - 1), r = man >> shift;
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = uint32_t(e) << 10 | man >> 13, rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;  // may carry into the exponent: correct
  return uint16_t(sign | r);
}

// Reads element i of a buffer of dtype dt as Tc.
template <typename Tc>
inline Tc load_elem(const void* base, DType dt, int64_t i) {
  switch (dt) {
    case DType::f32: return Tc(static_cast<const float*>(base)[i]);
    case DType::f64: return Tc(static_cast<const double*>(base)[i]);
    case DType::bf16: return Tc(bf16_to_f32(static_cast<const uint16_t*>(base)[i]));
    case DType::f16: return Tc(f16_to_f32(static_cast<const uint16_t*>(base)[i]));
    case DType::i32: return Tc(static_cast<const int32_t*>(base)[i]);
    case DType::i64: return Tc(static_cast<const int64_t*>(base)[i]);
  }
  return Tc(0);
}

template <typename Tc>
inline void store_elem(void* base, DType dt, int64_t i, Tc x) {
  switch (dt) {
    case DType::f32: static_cast<float*>(base)[i] = float(x); break;
    case DType::f64: static_cast<double*>(base)[i] = double(x); break;
    case DType::bf16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(float(x)); break;
    case DType::f16: static_cast<uint16_t*>(base)[i] = f32_to_f16(float(x)); break;
    default: break;  // integer outputs do not exist
  }
}

// Offset (in elements) of x[b, t, h] (the start of the last dimension for rank-4 views; the element for
// rank-3 views).
inline int64_t offset3(const TensorView& x, int64_t b, int64_t t, int64_t h) {
  return b * x.stride[0] + t * x.stride[1] + h * x.stride[2];
}

// dst[i * ld + d] = x[b, t0 + i, h, d] for i < len, d < D (rank-4 view, last dim contiguous).
template <typename Tc>
inline void load_rows(const TensorView& x, int64_t b, int64_t t0, int64_t len, int64_t h, int64_t D,
                      Tc* dst, int64_t ld) {
  for (int64_t i = 0; i < len; ++i) {
    int64_t off = offset3(x, b, t0 + i, h);
    Tc* out = dst + i * ld;
    if (x.dtype == DType::f32) {
      const float* src = static_cast<const float*>(x.data) + off;
      for (int64_t d = 0; d < D; ++d) out[d] = Tc(src[d]);
    } else if (x.dtype == DType::f64) {
      const double* src = static_cast<const double*>(x.data) + off;
      for (int64_t d = 0; d < D; ++d) out[d] = Tc(src[d]);
    } else {
      for (int64_t d = 0; d < D; ++d) out[d] = load_elem<Tc>(x.data, x.dtype, off + d);
    }
  }
}

template <typename Tc>
inline void store_rows(const TensorView& x, int64_t b, int64_t t0, int64_t len, int64_t h, int64_t D,
                       const Tc* src, int64_t ld) {
  for (int64_t i = 0; i < len; ++i) {
    int64_t off = offset3(x, b, t0 + i, h);
    for (int64_t d = 0; d < D; ++d) store_elem<Tc>(x.data, x.dtype, off + d, src[i * ld + d]);
  }
}

// dst[i] = x[b, t0 + i, h] for a rank-3 view.
template <typename Tc>
inline void load_col(const TensorView& x, int64_t b, int64_t t0, int64_t len, int64_t h, Tc* dst) {
  for (int64_t i = 0; i < len; ++i) dst[i] = load_elem<Tc>(x.data, x.dtype, offset3(x, b, t0 + i, h));
}

template <typename Tc>
inline void store_col(const TensorView& x, int64_t b, int64_t t0, int64_t len, int64_t h, const Tc* src) {
  for (int64_t i = 0; i < len; ++i) store_elem<Tc>(x.data, x.dtype, offset3(x, b, t0 + i, h), src[i]);
}

}  // namespace pathattn::core
