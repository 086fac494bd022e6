// examples/find_package/main.cpp: a tiny PaTH forward through the installed library (cpu backend).
// q, k, v [1, T, 2, 16] fp32, w = unit rows, beta = 1.5; prints ||o|| and exits non-zero on any error.
#include <cmath>
#include <cstdio>
#include <vector>

#include <pathattn/pathattn.h>

int main() {
  using namespace pathattn;
  const int64_t B = 1, T = 33, H = 2, K = 16, V = 16;
  std::vector<float> q(B * T * H * K), k(q.size()), v(B * T * H * V), w(q.size()), beta(B * T * H, 1.5f);
  std::vector<float> o(v.size()), lse(B * T * H);
  for (size_t i = 0; i < q.size(); ++i) {  // deterministic, non-trivial inputs
    q[i] = std::sin(0.37f * float(i));
    k[i] = std::cos(0.11f * float(i));
    w[i] = std::sin(1.3f * float(i) + 0.5f);
  }
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::cos(0.7f * float(i));
  for (size_t r = 0; r < w.size() / K; ++r) {  // unit-norm rows keep every H_t a contraction
    float n2 = 0;
    for (int64_t d = 0; d < K; ++d) n2 += w[r * K + d] * w[r * K + d];
    for (int64_t d = 0; d < K; ++d) w[r * K + d] /= std::sqrt(n2);
  }

  PathFwdParams p;
  p.q = make_view(q.data(), DType::f32, {B, T, H, K});
  p.k = make_view(k.data(), DType::f32, {B, T, H, K});
  p.v = make_view(v.data(), DType::f32, {B, T, H, V});
  p.w = make_view(w.data(), DType::f32, {B, T, H, K});
  p.beta = make_view(beta.data(), DType::f32, {B, T, H});
  p.o = make_view(o.data(), DType::f32, {B, T, H, V});
  p.lse = make_view(lse.data(), DType::f32, {B, T, H});
  p.backend = Backend::cpu;
  const Status s = path_attn_fwd(p);
  if (!s.ok()) {
    std::fprintf(stderr, "path_attn_fwd failed: %s\n", s.message().c_str());
    return 1;
  }
  double n2 = 0;
  for (float x : o) n2 += double(x) * x;
  std::printf("pathattn %s: ||o|| = %.6f over %zu elements\n", build_info().c_str(), std::sqrt(n2), o.size());
  return std::isfinite(n2) ? 0 : 1;
}
