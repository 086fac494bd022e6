// tests/cpp/test_oracle.cpp: the fp64 oracle against the definition itself (explicit K x K matrix products
// H_i ... H_{j+1} on tiny cases) and its gradients against central finite differences of its forward.
#include <gtest/gtest.h>

#include <cmath>

#include "check/harness.h"

namespace pathattn::test {
namespace {

// The op by explicit K x K matrices: M = H_i H_{i-1} ... H_{j+1}, logit = q_i^T M k_j. fp64, O(T^2 K^3).
std::vector<double> definition_fwd(const Case& c, std::vector<double>* lse_out) {
  const CaseSpec& s = c.spec;
  const auto q = c.q.to_f64(), k = c.k.to_f64(), v = c.v.to_f64();
  const auto w = s.path ? c.w.to_f64() : std::vector<double>(), be = s.path ? c.beta.to_f64() : std::vector<double>();
  const auto g = s.gate ? c.g.to_f64() : std::vector<double>();
  const int64_t K = s.K, V = s.V, G = s.HQ / s.H;
  const double scale = 1.0 / std::sqrt(double(K));
  const double gs = std::isnan(s.gate_scale) ? scale : s.gate_scale;
  std::vector<double> o(s.B * s.T * s.HQ * V), lse(s.B * s.T * s.HQ);
  std::vector<int64_t> starts;  // sequence start of each position
  for (int64_t t = 0, st = 0, n = 0; t < s.T; ++t) {
    if (!s.seqlens.empty()) {
      while (t >= st + s.seqlens[n]) st += s.seqlens[n++];
    }
    starts.push_back(s.seqlens.empty() ? 0 : st);
  }
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t hq = 0; hq < s.HQ; ++hq) {
      const int64_t h = hq / G;
      for (int64_t i = 0; i < s.T; ++i) {
        std::vector<double> M(K * K, 0.0), sc;
        for (int64_t e = 0; e < K; ++e) M[e * K + e] = 1.0;
        double Gi = 0;
        for (int64_t t = starts[i]; t <= i; ++t) Gi += s.gate ? g[(b * s.T + t) * s.HQ + hq] : 0.0;
        double Gj = Gi;
        std::vector<int64_t> js;
        for (int64_t j = i; j >= starts[i]; --j) {
          // logit = q^T M k_j with M = H_i ... H_{j+1}
          double lg = 0;
          const double* qi = &q[((b * s.T + i) * s.HQ + hq) * K];
          const double* kj = &k[((b * s.T + j) * s.H + h) * K];
          for (int64_t r = 0; r < K; ++r)
            for (int64_t cc = 0; cc < K; ++cc) lg += qi[r] * M[r * K + cc] * kj[cc];
          sc.push_back(scale * lg + gs * (Gi - Gj));
          js.push_back(j);
          if (s.gate) Gj -= g[(b * s.T + j) * s.HQ + hq];
          if (s.path) {  // M <- M H_j
            const double* wj = &w[((b * s.T + j) * s.H + h) * K];
            const double bj = be[(b * s.T + j) * s.H + h];
            std::vector<double> Mw(K, 0.0);
            for (int64_t r = 0; r < K; ++r)
              for (int64_t cc = 0; cc < K; ++cc) Mw[r] += M[r * K + cc] * wj[cc];
            for (int64_t r = 0; r < K; ++r)
              for (int64_t cc = 0; cc < K; ++cc) M[r * K + cc] -= bj * Mw[r] * wj[cc];
          }
        }
        double m = -INFINITY, l = 0;
        for (double x : sc) m = std::max(m, x);
        for (double x : sc) l += std::exp(x - m);
        double* oi = &o[((b * s.T + i) * s.HQ + hq) * V];
        for (size_t n = 0; n < sc.size(); ++n) {
          const double pr = std::exp(sc[n] - m) / l;
          for (int64_t cc = 0; cc < V; ++cc) oi[cc] += pr * v[((b * s.T + js[n]) * s.H + h) * V + cc];
        }
        lse[(b * s.T + i) * s.HQ + hq] = m + std::log(l);
      }
    }
  if (lse_out) *lse_out = lse;
  return o;
}

class OracleDefinition : public ::testing::TestWithParam<CaseSpec> {};

TEST_P(OracleDefinition, MatchesExplicitMatrixProducts) {
  const Case c = Case::make(GetParam());
  std::vector<double> lse_ref;
  const std::vector<double> o_ref = definition_fwd(c, &lse_ref);
  FwdOut f = run_fwd(c, Backend::oracle);
  ASSERT_TRUE(f.status.ok()) << f.status.message();
  EXPECT_LE(max_rel(f.o.to_f64(), o_ref), 1e-12) << c.spec.name();
  EXPECT_LE(max_rel(f.lse.to_f64(), lse_ref), 1e-12) << c.spec.name();
  EXPECT_TRUE(f.o.guards_intact() && f.lse.guards_intact());
}

CaseSpec spec(int64_t B, int64_t T, int64_t HQ, int64_t H, int64_t K, int64_t V, bool gate, uint64_t seed,
              std::vector<int64_t> seqlens = {}, BetaMode bm = BetaMode::uniform02) {
  CaseSpec s;
  s.B = B; s.T = T; s.HQ = HQ; s.H = H; s.K = K; s.V = V; s.gate = gate; s.seed = seed;
  s.seqlens = std::move(seqlens);
  s.beta = bm;
  return s;
}

INSTANTIATE_TEST_SUITE_P(
    Tiny, OracleDefinition,
    ::testing::Values(spec(1, 1, 1, 1, 8, 8, false, 1), spec(2, 7, 2, 1, 8, 16, true, 2),
                      spec(1, 0, 2, 2, 8, 8, false, 3, {3, 0, 1, 5}), spec(1, 9, 4, 2, 16, 8, true, 4, {}, BetaMode::two),
                      spec(1, 12, 2, 2, 8, 8, true, 5, {5, 7}, BetaMode::near2)),
    [](const auto& info) { return "case" + std::to_string(info.index); });

// Central finite differences of the oracle's forward, against the oracle's backward, for every input.
// Loss = sum(o * dout). Step 1e-6 in fp64: truncation O(h^2) ~ 1e-12, rounding O(eps / h) ~ 1e-10.
class OracleGrad : public ::testing::TestWithParam<CaseSpec> {};

TEST_P(OracleGrad, MatchesFiniteDifferences) {
  Case c = Case::make(GetParam());
  const HostTensor dout = random_dout(c, 99);
  const auto dov = dout.to_f64();
  FwdOut f = run_fwd(c, Backend::oracle);
  ASSERT_TRUE(f.status.ok());
  BwdOut b = run_bwd(c, f, dout, Backend::oracle);
  ASSERT_TRUE(b.status.ok()) << b.status.message();
  auto loss = [&]() {
    FwdOut ff = run_fwd(c, Backend::oracle);
    const auto o = ff.o.to_f64();
    double L = 0;
    for (size_t i = 0; i < o.size(); ++i) L += o[i] * dov[i];
    return L;
  };
  struct Item { const char* name; HostTensor* x; const HostTensor* grad; };
  std::vector<Item> items = {{"q", &c.q, &b.dq}, {"k", &c.k, &b.dk}, {"v", &c.v, &b.dv}};
  if (c.spec.path) { items.push_back({"w", &c.w, &b.dw}); items.push_back({"beta", &c.beta, &b.dbeta}); }
  if (c.spec.gate) items.push_back({"g", &c.g, &b.dg});
  const double h = 1e-6;
  for (auto& it : items) {
    std::vector<double> fd(it.x->numel()), an = it.grad->to_f64();
    for (int64_t i = 0; i < it.x->numel(); ++i) {
      const double x0 = it.x->get(i);
      it.x->set(i, x0 + h);
      const double lp = loss();
      it.x->set(i, x0 - h);
      const double lm = loss();
      it.x->set(i, x0);
      fd[i] = (lp - lm) / (2 * h);
    }
    EXPECT_LE(max_rel(an, fd), 1e-7) << it.name << " " << c.spec.name();
    EXPECT_TRUE(it.grad->guards_intact()) << it.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Tiny, OracleGrad,
                         ::testing::Values(spec(1, 6, 2, 1, 8, 8, true, 11), spec(1, 0, 2, 2, 8, 16, true, 12, {3, 0, 4}),
                                           spec(2, 5, 1, 1, 8, 8, false, 13, {}, BetaMode::two)),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

}  // namespace
}  // namespace pathattn::test
