// cpu/fast_rows.h: the fast path's element-wise helpers (vectorised row kernels of the softmax and its
// gradient, the gate's bias, masks, the small triangular inverse). Internal to src/cpu/fast.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace pathattn::cpu::fast_rows {


// exp for float, branch-free so loops over it vectorise: Cody-Waite range reduction x = n ln2 + r,
// |r| <= ln2 / 2 (n rounded with the 1.5 * 2^23 trick, which SSE2 can vectorise, unlike nearbyint), then a
// degree-6 polynomial for e^r (max rel. error ~2e-7, i.e. ~1-2 ulp), times 2^n built in the exponent bits.
// Inputs below -87 give exactly 0 (so -inf, the masked score, gives 0).
inline float exp_fast(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += int32_t(n) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return x < -87.0f ? 0.0f : out;
}
inline double exp_fast(double x) { return std::exp(x); }

// Row kernels of the softmax, the hot scalar loops of both directions. The float versions are compiled
// for AVX-512, AVX2 and baseline x86-64 and picked at run time (portable binaries, wide vectors where the
// CPU has them); the reductions use OpenMP simd so they vectorise without -ffast-math.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PA_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define PA_VECTOR_CLONES
#endif

// max_j s[j], j < m.
PA_VECTOR_CLONES float row_max(const float* s, int64_t m, float init) {
  float r = init;
#pragma omp simd reduction(max : r)
  for (int64_t j = 0; j < m; ++j) r = std::max(r, s[j]);
  return r;
}
double row_max(const double* s, int64_t m, double init) {
  double r = init;
  for (int64_t j = 0; j < m; ++j) r = std::max(r, s[j]);
  return r;
}

// s[j] := exp(s[j] - shift); returns the sum.
PA_VECTOR_CLONES float row_exp(float* s, int64_t m, float shift) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < m; ++j) {
    const float e = exp_fast(s[j] - shift);
    s[j] = e;
    sum += e;
  }
  return sum;
}
double row_exp(double* s, int64_t m, double shift) {
  double sum = 0;
  for (int64_t j = 0; j < m; ++j) {
    s[j] = std::exp(s[j] - shift);
    sum += s[j];
  }
  return sum;
}

// Backward row: p[j] := exp(s[j] - lse) for j < keep (0 beyond), dp[j] := p[j] (dp[j] - delta); returns
// sum_j dp[j] (the row's gate gradient). Masked entries (j >= keep) are set to 0, not multiplied by 0: a
// later key's non-finite value in dp must not reach this row.
PA_VECTOR_CLONES float row_grad(float* s, float* dp, int64_t m, int64_t keep, float lse, float delta) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < m; ++j) {
    const float p = j < keep ? exp_fast(s[j] - lse) : 0.0f;
    s[j] = p;
    const float d = j < keep ? p * (dp[j] - delta) : 0.0f;
    dp[j] = d;
    sum += d;
  }
  return sum;
}
double row_grad(double* s, double* dp, int64_t m, int64_t keep, double lse, double delta) {
  double sum = 0;
  for (int64_t j = 0; j < m; ++j) {
    const double p = j < keep ? std::exp(s[j] - lse) : 0.0;
    s[j] = p;
    dp[j] = j < keep ? p * (dp[j] - delta) : 0.0;
    sum += dp[j];
  }
  return sum;
}

template <typename T>
bool all_finite(const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

// S[r * ld + j] += gs (G[r0 + r] - G[k0 + j]) for r < n, j < m. G is the fp64 cumsum; both terms are taken
// relative to G[r0] before rounding to T, so the rounding error scales with the gate difference itself and
// not with |G|, which grows linearly along the sequence.
template <typename T>
void add_gate(const double* G, int64_t r0, int64_t n, int64_t k0, int64_t m, double gs, T* S, int64_t ld) {
  T gq[1024], gk[1024];  // n <= chunk size <= 1024; m <= max(chunk size, kSuperblock) <= 1024
  for (int64_t r = 0; r < n; ++r) gq[r] = T(gs * (G[r0 + r] - G[r0]));
  for (int64_t j = 0; j < m; ++j) gk[j] = T(gs * (G[k0 + j] - G[r0]));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < m; ++j) S[r * ld + j] += gq[r] - gk[j];
}

template <typename T>
void fill_zero(T* x, int64_t n) {
  std::fill(x, x + n, T(0));
}

// Keeps the lower triangle including the diagonal (incl) or strictly below it of an n x n block (ld).
template <typename T>
void mask_lower(T* M, int64_t n, int64_t ld, bool incl) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = r + (incl ? 1 : 0); c < n; ++c) M[r * ld + c] = T(0);
}

// dst[r * ld + c] = b[r] * src[r * ld + c] (row scaling), r < n, c < m.
template <typename T>
void scale_rows(const T* b, const T* src, T* dst, int64_t n, int64_t m, int64_t ld) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < m; ++c) dst[r * ld + c] = b[r] * src[r * ld + c];
}

// Inverse of the unit lower triangular I + A (A strictly lower, n x n, ld): forward substitution in place.
// On entry E holds A's strict lower part; on exit E = (I + A)^{-1}.
template <typename T>
void unit_lower_inverse(T* E, int64_t n, int64_t ld, T* tmp) {
  // tmp := A (strict lower); E := I, then E[r, :] = e_r - sum_{s<r} A[r, s] E[s, :].
  std::copy(E, E + n * ld, tmp);
  for (int64_t r = 0; r < n; ++r) {
    T* er = E + r * ld;
    fill_zero(er, n);
    er[r] = T(1);
    for (int64_t s = 0; s < r; ++s) {
      const T a = tmp[r * ld + s];
      if (a == T(0)) continue;
      const T* es = E + s * ld;
      for (int64_t c = 0; c <= s; ++c) er[c] -= a * es[c];
    }
  }
}

}  // namespace pathattn::cpu::fast_rows
