// tests/cpp/test_engine_grad.cpp: every engine layer's backward against central finite differences of its
// forward, in fp64; then the whole model (each attention kind, GQA, tied and untied head) the same way.
// Loss for a layer: L = sum(out * R) with a fixed random R, so dL/dout = R.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "engine/model.h"
#include "engine/ops.h"
#include "engine/rng.h"

namespace pathattn::engine {
namespace {

std::vector<double> randn(int64_t n, uint64_t seed, double sd = 1.0) {
  Rng r(seed);
  std::vector<double> v(n);
  for (auto& x : v) x = r.normal() * sd;
  return v;
}

double dotv(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Checks analytic gradient `g` of loss(x) at x by central differences with step h on every element (or on
// `max_checks` evenly spaced ones). Tolerance: |g - fd| <= 1e-7 + 1e-6 |fd| (fd error at h = 1e-5 is ~1e-10).
void check_grad(const char* what, std::vector<double>& x, const std::vector<double>& g,
                const std::function<double()>& loss, int64_t max_checks = 400) {
  ASSERT_EQ(x.size(), g.size()) << what;
  const int64_t n = int64_t(x.size());
  const int64_t stride = std::max<int64_t>(1, n / max_checks);
  const double h = 1e-5;
  for (int64_t i = 0; i < n; i += stride) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = loss();
    x[i] = x0 - h;
    const double lm = loss();
    x[i] = x0;
    const double fd = (lp - lm) / (2 * h);
    ASSERT_LE(std::abs(g[i] - fd), 1e-7 + 1e-6 * std::abs(fd)) << what << " element " << i << ": analytic " << g[i]
                                                               << ", finite difference " << fd;
  }
}

TEST(EngineGrad, Linear) {
  const int64_t N = 7, In = 5, Out = 6;
  auto x = randn(N * In, 1), W = randn(In * Out, 2), b = randn(Out, 3), R = randn(N * Out, 4);
  std::vector<double> y(N * Out);
  auto loss = [&] {
    linear_fwd(x.data(), W.data(), b.data(), y.data(), N, In, Out);
    return dotv(y, R);
  };
  std::vector<double> dx(N * In, 0.5), dW(In * Out, 0), db(Out, 0);
  linear_bwd(x.data(), W.data(), R.data(), dx.data(), dW.data(), db.data(), N, In, Out, false);
  check_grad("linear dx", x, dx, loss);
  check_grad("linear dW", W, dW, loss);
  check_grad("linear db", b, db, loss);
  // accumulate = true adds onto dx.
  std::vector<double> dx2(N * In, 1.0);
  linear_bwd(x.data(), W.data(), R.data(), dx2.data(), (double*)nullptr, (double*)nullptr, N, In, Out, true);
  for (int64_t i = 0; i < N * In; ++i) ASSERT_NEAR(dx2[i], dx[i] + 1.0, 1e-12);
}

TEST(EngineGrad, RmsNorm) {
  const int64_t N = 5, C = 9;
  auto x = randn(N * C, 5), w = randn(C, 6), R = randn(N * C, 7);
  std::vector<double> y(N * C), rstd(N);
  auto loss = [&] {
    rmsnorm_fwd(x.data(), w.data(), y.data(), rstd.data(), N, C, 1e-5);
    return dotv(y, R);
  };
  loss();
  std::vector<double> dx(N * C), dw(C, 0);
  rmsnorm_bwd(x.data(), w.data(), rstd.data(), R.data(), dx.data(), dw.data(), N, C, false);
  check_grad("rmsnorm dx", x, dx, loss);
  check_grad("rmsnorm dw", w, dw, loss);
}

TEST(EngineGrad, Embedding) {
  const int64_t N = 6, C = 4, Vc = 5;
  std::vector<int32_t> tok = {0, 3, 3, 1, 4, 0};
  auto wte = randn(Vc * C, 8), R = randn(N * C, 9);
  std::vector<double> x(N * C);
  auto loss = [&] {
    embedding_fwd(tok.data(), wte.data(), x.data(), N, C);
    return dotv(x, R);
  };
  std::vector<double> dwte(Vc * C, 0);
  embedding_bwd(tok.data(), R.data(), dwte.data(), N, C);
  check_grad("embedding dwte", wte, dwte, loss);
}

TEST(EngineGrad, SwiGlu) {
  const int64_t N = 4, F = 6;
  auto h = randn(N * 2 * F, 10, 2.0), R = randn(N * F, 11);
  std::vector<double> m(N * F);
  auto loss = [&] {
    swiglu_fwd(h.data(), m.data(), N, F);
    return dotv(m, R);
  };
  std::vector<double> dh(N * 2 * F);
  swiglu_bwd(h.data(), R.data(), dh.data(), N, F);
  check_grad("swiglu dh", h, dh, loss);
}

TEST(EngineGrad, Rope) {
  const int64_t B = 2, T = 5, NH = 3, K = 8;
  auto x = randn(B * T * NH * K, 12), R = randn(B * T * NH * K, 13);
  auto loss = [&] {
    std::vector<double> y = x;
    rope_apply(y.data(), B * T, T, NH, K, 10000.0, false);
    return dotv(y, R);
  };
  std::vector<double> dx = R;
  rope_apply(dx.data(), B * T, T, NH, K, 10000.0, true);
  check_grad("rope dx", x, dx, loss);
  // Position 0 is the identity; the rotation preserves norms.
  std::vector<double> y = x;
  rope_apply(y.data(), B * T, T, NH, K, 10000.0, false);
  for (int64_t e = 0; e < NH * K; ++e) ASSERT_EQ(y[e], x[e]);
  ASSERT_NEAR(dotv(y, y), dotv(x, x), 1e-9);
}

TEST(EngineGrad, ConvSilu) {
  const int64_t B = 2, T = 6, D = 5;
  auto x = randn(B * T * D, 14), wc = randn(D * 3, 15), R = randn(B * T * D, 16);
  std::vector<double> c(B * T * D), y(B * T * D);
  auto loss = [&] {
    conv3_silu_fwd(x.data(), wc.data(), c.data(), y.data(), B * T, T, D);
    return dotv(y, R);
  };
  loss();
  std::vector<double> dx(B * T * D), dwc(D * 3, 0);
  conv3_silu_bwd(x.data(), wc.data(), c.data(), R.data(), dx.data(), dwc.data(), B * T, T, D);
  check_grad("conv dx", x, dx, loss);
  check_grad("conv dwc", wc, dwc, loss);
  // Causality: the output at time t of a sequence never depends on later inputs or on the previous sequence.
  loss();
  std::vector<double> y0 = y;
  x[(1 * T + 0) * D + 2] += 1.0;  // first step of sequence 1
  loss();
  for (int64_t n = 0; n < T; ++n)
    for (int64_t d = 0; d < D; ++d) ASSERT_EQ(y[n * D + d], y0[n * D + d]);
}

TEST(EngineGrad, L2Norm) {
  const int64_t N = 4, NH = 2, K = 8;
  auto u = randn(N * NH * K, 17), R = randn(N * NH * K, 18);
  std::vector<double> w(N * NH * K), rinv(N * NH);
  auto loss = [&] {
    l2norm_fwd(u.data(), w.data(), rinv.data(), N, NH, K, 1e-6);
    return dotv(w, R);
  };
  loss();
  std::vector<double> du(N * NH * K);
  l2norm_bwd(w.data(), rinv.data(), R.data(), du.data(), N, NH, K);
  check_grad("l2norm du", u, du, loss);
  for (int64_t r = 0; r < N * NH; ++r) {
    double s = 0;
    for (int64_t e = 0; e < K; ++e) s += w[r * K + e] * w[r * K + e];
    ASSERT_NEAR(s, 1.0, 1e-6);
  }
}

TEST(EngineGrad, BetaAndGate) {
  const int64_t n = 11;
  auto z = randn(n, 19, 3.0), R = randn(n, 20);
  std::vector<double> y(n);
  auto lb = [&] {
    beta_fwd(z.data(), y.data(), n);
    return dotv(y, R);
  };
  lb();
  for (double b : y) ASSERT_TRUE(b > 0 && b < 2);
  std::vector<double> dz(n);
  beta_bwd(y.data(), R.data(), dz.data(), n);
  check_grad("beta dz", z, dz, lb);
  auto lg = [&] {
    logsigmoid_fwd(z.data(), y.data(), n);
    return dotv(y, R);
  };
  lg();
  for (double g : y) ASSERT_LT(g, 0.0);
  logsigmoid_bwd(y.data(), R.data(), dz.data(), n);
  check_grad("logsigmoid dz", z, dz, lg);
}

TEST(EngineGrad, CrossEntropy) {
  const int64_t N = 5, Vc = 4;
  auto l = randn(N * Vc, 21);
  std::vector<int32_t> tgt = {1, -1, 3, 0, -1};
  std::vector<double> dl(N * Vc);
  auto loss = [&] {
    const CeStats s = cross_entropy(l.data(), tgt.data(), (double*)nullptr, (int32_t*)nullptr, N, Vc, 1.0);
    return s.loss_sum / double(s.count);
  };
  const CeStats s = cross_entropy(l.data(), tgt.data(), dl.data(), (int32_t*)nullptr, N, Vc, 1.0 / 3.0);
  ASSERT_EQ(s.count, 3);
  check_grad("cross-entropy dlogits", l, dl, loss);
}

// Whole model in fp64 on the oracle backend: every parameter tensor's gradient against finite differences.
struct ModelCase {
  AttnKind attn;
  int n_kv_head;
  bool tie;
  int w_rank;
};

class EngineModelGrad : public ::testing::TestWithParam<ModelCase> {};

TEST_P(EngineModelGrad, AllParameters) {
  const ModelCase mc = GetParam();
  ModelConfig cfg;
  cfg.attn = mc.attn;
  cfg.vocab_size = 7;
  cfg.d_model = 16;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_kv_head = mc.n_kv_head;
  cfg.head_dim = 8;
  cfg.mlp_hidden = 12;
  cfg.tie_embeddings = mc.tie;
  cfg.w_rank = mc.w_rank;
  cfg.init_std = 0.5;  // large weights: every path (conv, norms, gates) carries a visible gradient
  cfg.gate_bias_init = 1.0;
  Model<double> model(cfg);
  model.backend = Backend::oracle;
  model.init(42);
  const int64_t B = 2, T = 9;
  Rng r(7);
  std::vector<int32_t> tok(B * T), tgt(B * T);
  for (int64_t i = 0; i < B * T; ++i) {
    tok[i] = int32_t(r.below(7));
    tgt[i] = (i % 3 == 1) ? -1 : int32_t(r.below(7));
  }
  model.zero_grad();
  const StepStats st = model.forward(tok.data(), tgt.data(), B, T);
  ASSERT_EQ(st.count, 12);
  model.backward();
  const std::vector<double> g = model.grads;
  for (const ParamInfo& p : model.layout()) {
    std::vector<double> x(model.params.begin() + p.offset, model.params.begin() + p.offset + p.numel);
    std::vector<double> gp(g.begin() + p.offset, g.begin() + p.offset + p.numel);
    double gmax = 0;
    for (double v : gp) gmax = std::max(gmax, std::abs(v));
    EXPECT_GT(gmax, 1e-6) << p.name << " receives no gradient";
    auto loss = [&] {
      std::copy(x.begin(), x.end(), model.params.begin() + p.offset);
      return model.forward(tok.data(), tgt.data(), B, T).loss;
    };
    check_grad(p.name.c_str(), x, gp, loss, 40);
    std::copy(x.begin(), x.end(), model.params.begin() + p.offset);
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, EngineModelGrad,
                         ::testing::Values(ModelCase{AttnKind::path, 0, true, 4}, ModelCase{AttnKind::path, 1, false, 0},
                                           ModelCase{AttnKind::path_fox, 0, false, 4},
                                           ModelCase{AttnKind::fox, 1, true, 4}, ModelCase{AttnKind::rope, 0, true, 4},
                                           ModelCase{AttnKind::nope, 1, false, 4}),
                         [](const ::testing::TestParamInfo<ModelCase>& i) {
                           std::string n = attn_kind_name(i.param.attn);
                           for (auto& c : n)
                             if (c == '-') c = '_';
                           return n + (i.param.n_kv_head == 1 ? "_gqa" : "") + (i.param.tie ? "_tied" : "_untied") +
                                  (i.param.w_rank == 0 ? "_fullw" : "");
                         });

}  // namespace
}  // namespace pathattn::engine
