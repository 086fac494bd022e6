// engine/ops.cpp: CPU definitions of the engine's layer kernels (engine/ops.h), explicit instantiations for
// float and double. GEMMs go through cpu/blas.h (OpenBLAS); elementwise loops are serial and in a fixed
// order, so every result is bitwise reproducible for a fixed BLAS thread count.
#include "engine/ops.h"

#include <algorithm>
#include <cmath>

#include "cpu/blas.h"

namespace pathattn::engine {

template <typename T>
void linear_fwd(const T* x, const T* W, const T* b, T* y, int64_t N, int64_t In, int64_t Out) {
  if (b) {
    for (int64_t n = 0; n < N; ++n) std::copy(b, b + Out, y + n * Out);
  }
  cpu::gemm(false, false, N, Out, In, T(1), x, In, W, Out, b ? T(1) : T(0), y, Out);
}

template <typename T>
void linear_bwd(const T* x, const T* W, const T* dy, T* dx, T* dW, T* db, int64_t N, int64_t In, int64_t Out,
                bool accumulate) {
  if (dx) cpu::gemm(false, true, N, In, Out, T(1), dy, Out, W, Out, accumulate ? T(1) : T(0), dx, In);
  if (dW) cpu::gemm(true, false, In, Out, N, T(1), x, In, dy, Out, T(1), dW, Out);
  if (db) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < Out; ++o) db[o] += dy[n * Out + o];
  }
}

template <typename T>
void embedding_fwd(const int32_t* tok, const T* wte, T* x, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) std::copy(wte + int64_t(tok[n]) * C, wte + int64_t(tok[n] + 1) * C, x + n * C);
}

template <typename T>
void embedding_bwd(const int32_t* tok, const T* dx, T* dwte, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    T* d = dwte + int64_t(tok[n]) * C;
    for (int64_t c = 0; c < C; ++c) d[c] += dx[n * C + c];
  }
}

template <typename T>
void rmsnorm_fwd(const T* x, const T* w, T* y, T* rstd, int64_t N, int64_t C, double eps) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += double(xr[c]) * xr[c];
    const T r = T(1.0 / std::sqrt(ss / double(C) + eps));
    rstd[n] = r;
    for (int64_t c = 0; c < C; ++c) y[n * C + c] = xr[c] * r * w[c];
  }
}

template <typename T>
void rmsnorm_bwd(const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw, int64_t N, int64_t C,
                 bool accumulate) {
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    const T* dyr = dy + n * C;
    const T r = rstd[n];
    double dot = 0;  // sum_c (dy w)_c xhat_c
    for (int64_t c = 0; c < C; ++c) {
      const T xhat = xr[c] * r;
      dot += double(dyr[c]) * w[c] * xhat;
      dw[c] += dyr[c] * xhat;
    }
    const T m = T(dot / double(C));
    for (int64_t c = 0; c < C; ++c) {
      const T v = r * (dyr[c] * w[c] - xr[c] * r * m);
      dx[n * C + c] = accumulate ? dx[n * C + c] + v : v;
    }
  }
}

template <typename T>
inline T sigmoid(T z) {
  return z >= 0 ? T(1) / (T(1) + std::exp(-z)) : std::exp(z) / (T(1) + std::exp(z));
}

template <typename T>
void swiglu_fwd(const T* h, T* m, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const T a = h[n * 2 * F + f], b = h[n * 2 * F + F + f];
      m[n * F + f] = a * sigmoid(a) * b;
    }
}

template <typename T>
void swiglu_bwd(const T* h, const T* dm, T* dh, int64_t N, int64_t F) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t f = 0; f < F; ++f) {
      const T a = h[n * 2 * F + f], b = h[n * 2 * F + F + f], d = dm[n * F + f];
      const T s = sigmoid(a);
      dh[n * 2 * F + f] = d * b * s * (T(1) + a * (T(1) - s));
      dh[n * 2 * F + F + f] = d * a * s;
    }
}

template <typename T>
void rope_apply_at(T* x, int64_t N, int64_t T_, int64_t pos0, int64_t NH, int64_t K, double theta, bool inverse) {
  const int64_t half = K / 2;
  for (int64_t n = 0; n < N; ++n) {
    const double pos = double(pos0 + n % T_);
    for (int64_t i = 0; i < half; ++i) {
      const double ang = pos * std::pow(theta, -2.0 * double(i) / double(K));
      const T c = T(std::cos(ang)), s = T(inverse ? -std::sin(ang) : std::sin(ang));
      for (int64_t h = 0; h < NH; ++h) {
        T* r = x + (n * NH + h) * K;
        const T x1 = r[i], x2 = r[i + half];
        r[i] = x1 * c - x2 * s;
        r[i + half] = x1 * s + x2 * c;
      }
    }
  }
}

template <typename T>
void rope_apply(T* x, int64_t N, int64_t T_, int64_t NH, int64_t K, double theta, bool inverse) {
  rope_apply_at(x, N, T_, 0, NH, K, theta, inverse);
}

template <typename T>
void conv3_silu_fwd(const T* x, const T* wc, T* c, T* y, int64_t N, int64_t T_, int64_t D) {
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = n % T_;
    for (int64_t d = 0; d < D; ++d) {
      T acc = 0;
      for (int64_t s = 0; s < 3; ++s) {
        const int64_t dt = 2 - s;  // tap s reads x[t - 2 + s]
        if (t - dt >= 0) acc += wc[d * 3 + s] * x[(n - dt) * D + d];
      }
      c[n * D + d] = acc;
      y[n * D + d] = acc * sigmoid(acc);
    }
  }
}

template <typename T>
void conv3_silu_bwd(const T* x, const T* wc, const T* c, const T* dy, T* dx, T* dwc, int64_t N, int64_t T_,
                    int64_t D) {
  std::fill(dx, dx + N * D, T(0));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = n % T_;
    for (int64_t d = 0; d < D; ++d) {
      const T a = c[n * D + d], s = sigmoid(a);
      const T dc = dy[n * D + d] * s * (T(1) + a * (T(1) - s));
      for (int64_t k = 0; k < 3; ++k) {
        const int64_t dt = 2 - k;
        if (t - dt >= 0) {
          dx[(n - dt) * D + d] += wc[d * 3 + k] * dc;
          dwc[d * 3 + k] += dc * x[(n - dt) * D + d];
        }
      }
    }
  }
}

template <typename T>
void l2norm_fwd(const T* u, T* w, T* rinv, int64_t N, int64_t NH, int64_t K, double eps) {
  for (int64_t r = 0; r < N * NH; ++r) {
    double ss = 0;
    for (int64_t e = 0; e < K; ++e) ss += double(u[r * K + e]) * u[r * K + e];
    const T ri = T(1.0 / std::sqrt(ss + eps));
    rinv[r] = ri;
    for (int64_t e = 0; e < K; ++e) w[r * K + e] = u[r * K + e] * ri;
  }
}

template <typename T>
void l2norm_bwd(const T* w, const T* rinv, const T* dw, T* du, int64_t N, int64_t NH, int64_t K) {
  for (int64_t r = 0; r < N * NH; ++r) {
    double dot = 0;
    for (int64_t e = 0; e < K; ++e) dot += double(w[r * K + e]) * dw[r * K + e];
    for (int64_t e = 0; e < K; ++e) du[r * K + e] = rinv[r] * (dw[r * K + e] - w[r * K + e] * T(dot));
  }
}

template <typename T>
void beta_fwd(const T* z, T* beta, int64_t n) {
  for (int64_t i = 0; i < n; ++i) beta[i] = T(2) * sigmoid(z[i]);
}
template <typename T>
void beta_bwd(const T* beta, const T* dbeta, T* dz, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dz[i] = dbeta[i] * beta[i] * (T(1) - beta[i] / T(2));
}

template <typename T>
void logsigmoid_fwd(const T* z, T* g, int64_t n) {
  // logsigmoid(z) = min(z, 0) - log1p(exp(-|z|)), stable for both signs.
  for (int64_t i = 0; i < n; ++i) g[i] = std::min(z[i], T(0)) - std::log1p(std::exp(-std::abs(z[i])));
}
template <typename T>
void logsigmoid_bwd(const T* g, const T* dg, T* dz, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dz[i] = dg[i] * (T(1) - std::exp(g[i]));
}

template <typename T>
void add_inplace(T* y, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

template <typename T>
CeStats cross_entropy(const T* logits, const int32_t* targets, T* dlogits, int32_t* pred, int64_t N, int64_t Vc,
                      double grad_scale) {
  CeStats st;
  for (int64_t n = 0; n < N; ++n) {
    const T* l = logits + n * Vc;
    const int32_t tgt = targets ? targets[n] : -1;
    int64_t am = 0;
    for (int64_t v = 1; v < Vc; ++v)
      if (l[v] > l[am]) am = v;
    if (pred) pred[n] = int32_t(am);
    if (tgt < 0) {
      if (dlogits) std::fill(dlogits + n * Vc, dlogits + (n + 1) * Vc, T(0));
      continue;
    }
    const double mx = double(l[am]);
    double sum = 0;
    for (int64_t v = 0; v < Vc; ++v) sum += std::exp(double(l[v]) - mx);
    const double lse = mx + std::log(sum);
    st.loss_sum += lse - double(l[tgt]);
    st.count += 1;
    st.correct += (am == tgt) ? 1 : 0;
    if (dlogits) {
      for (int64_t v = 0; v < Vc; ++v) {
        const double p = std::exp(double(l[v]) - lse);
        dlogits[n * Vc + v] = T((p - (v == tgt ? 1.0 : 0.0)) * grad_scale);
      }
    }
  }
  return st;
}

#define PA_ENGINE_INSTANTIATE(T)                                                                              \
  template void linear_fwd<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);                    \
  template void linear_bwd<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, int64_t, bool);      \
  template void embedding_fwd<T>(const int32_t*, const T*, T*, int64_t, int64_t);                              \
  template void embedding_bwd<T>(const int32_t*, const T*, T*, int64_t, int64_t);                              \
  template void rmsnorm_fwd<T>(const T*, const T*, T*, T*, int64_t, int64_t, double);                          \
  template void rmsnorm_bwd<T>(const T*, const T*, const T*, const T*, T*, T*, int64_t, int64_t, bool);        \
  template void swiglu_fwd<T>(const T*, T*, int64_t, int64_t);                                                 \
  template void swiglu_bwd<T>(const T*, const T*, T*, int64_t, int64_t);                                       \
  template void rope_apply<T>(T*, int64_t, int64_t, int64_t, int64_t, double, bool);                           \
  template void rope_apply_at<T>(T*, int64_t, int64_t, int64_t, int64_t, int64_t, double, bool);              \
  template void conv3_silu_fwd<T>(const T*, const T*, T*, T*, int64_t, int64_t, int64_t);                      \
  template void conv3_silu_bwd<T>(const T*, const T*, const T*, const T*, T*, T*, int64_t, int64_t, int64_t);  \
  template void l2norm_fwd<T>(const T*, T*, T*, int64_t, int64_t, int64_t, double);                            \
  template void l2norm_bwd<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);                    \
  template void beta_fwd<T>(const T*, T*, int64_t);                                                            \
  template void beta_bwd<T>(const T*, const T*, T*, int64_t);                                                  \
  template void logsigmoid_fwd<T>(const T*, T*, int64_t);                                                      \
  template void logsigmoid_bwd<T>(const T*, const T*, T*, int64_t);                                            \
  template void add_inplace<T>(T*, const T*, int64_t);                                                         \
  template CeStats cross_entropy<T>(const T*, const int32_t*, T*, int32_t*, int64_t, int64_t, double);

PA_ENGINE_INSTANTIATE(float)
PA_ENGINE_INSTANTIATE(double)

}  // namespace pathattn::engine
