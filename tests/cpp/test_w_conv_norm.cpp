// tests/cpp/test_w_conv_norm.cpp: the w preparation op (include/pathattn/w_conv_norm.h) on the cpu and oracle
// backends against a plain fp64 reference written here from the definition (the backward by scattering each tap's
// gradient, where the backend gathers), the reference's gradients against central finite differences, varlen
// with empty sequences, thread-count invariance, sentinels around every output, and the argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "check/harness.h"

namespace pathattn::test {
namespace {

struct Spec {
  int64_t B = 1, T = 9, D = 16, hd = 16, W = 3;
  bool conv = true, bias = false, act = true;
  std::vector<int64_t> seqlens;  // non-empty: varlen (B = 1, T = their sum)
  uint64_t seed = 1;
  std::string name() const {
    std::string s = "B" + std::to_string(B) + " T" + std::to_string(T) + " D" + std::to_string(D) + " hd" +
                    std::to_string(hd) + (conv ? " W" + std::to_string(W) : " noconv") + (bias ? " bias" : "") +
                    (act ? " silu" : "");
    if (!seqlens.empty()) {
      s += " varlen{";
      for (size_t i = 0; i < seqlens.size(); ++i) s += (i ? "," : "") + std::to_string(seqlens[i]);
      s += "}";
    }
    return s;
  }
};
void PrintTo(const Spec& s, std::ostream* os) { *os << s.name(); }

struct Inputs {
  Spec s;
  HostTensor x, weight, bias, cu;
};

Inputs make(Spec s, DType dt) {
  if (!s.seqlens.empty()) {
    s.B = 1;
    s.T = 0;
    for (int64_t l : s.seqlens) s.T += l;
  }
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<double> n01(0, 1);
  Inputs in{s, HostTensor(dt, {s.B, s.T, s.D}), {}, {}, {}};
  for (int64_t i = 0; i < in.x.numel(); ++i) in.x.set(i, n01(rng));
  if (s.conv) {
    in.weight = HostTensor(dt == DType::f64 ? DType::f64 : DType::f32, {s.D, s.W});
    for (int64_t i = 0; i < in.weight.numel(); ++i) in.weight.set(i, 0.6 * n01(rng));
    if (s.bias) {
      in.bias = HostTensor(in.weight.dtype(), {s.D});
      for (int64_t i = 0; i < s.D; ++i) in.bias.set(i, 0.3 * n01(rng));
    }
  }
  if (!s.seqlens.empty()) {
    in.cu = HostTensor(DType::i64, {int64_t(s.seqlens.size()) + 1});
    int64_t* cu = static_cast<int64_t*>(in.cu.view().data);
    cu[0] = 0;
    for (size_t i = 0; i < s.seqlens.size(); ++i) cu[i + 1] = cu[i] + s.seqlens[i];
  }
  return in;
}

// The start of the sequence holding flat token f of batch row b.
int64_t seq_start(const Inputs& in, int64_t t) {
  if (in.s.seqlens.empty()) return 0;
  int64_t a = 0;
  for (int64_t l : in.s.seqlens) {
    if (t < a + l) return a;
    a += l;
  }
  return a;
}

// The fp64 reference: out [B, T, D] and, with dout given, dx, dweight, dbias.
struct Ref {
  std::vector<double> out, dx, dweight, dbias;
};

Ref reference(const Inputs& in, const std::vector<double>* dout) {
  const Spec& s = in.s;
  const int64_t W = s.conv ? s.W : 0, N = s.B * s.T * s.D;
  const std::vector<double> x = in.x.to_f64();
  const std::vector<double> w = s.conv ? in.weight.to_f64() : std::vector<double>();
  const std::vector<double> bias = s.bias ? in.bias.to_f64() : std::vector<double>(size_t(s.D), 0.0);
  auto at = [&](int64_t b, int64_t t, int64_t c) { return (b * s.T + t) * s.D + c; };
  std::vector<double> z(static_cast<size_t>(N)), a(static_cast<size_t>(N));
  Ref r;
  r.out.assign(size_t(N), 0);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t c = 0; c < s.D; ++c) {
        double v = x[size_t(at(b, t, c))];
        if (W) {
          v = bias[size_t(c)];
          for (int64_t i = 0; i < W; ++i) {
            const int64_t u = t - (W - 1 - i);
            if (u >= seq_start(in, t)) v += w[size_t(c * W + i)] * x[size_t(at(b, u, c))];
          }
        }
        z[size_t(at(b, t, c))] = v;
        a[size_t(at(b, t, c))] = s.act ? v / (1 + std::exp(-v)) : v;
      }
  std::vector<double> rn(static_cast<size_t>(s.B * s.T * (s.D / s.hd)));
  for (int64_t row = 0; row < s.B * s.T; ++row)
    for (int64_t h = 0; h < s.D / s.hd; ++h) {
      double ss = 0;
      for (int64_t j = 0; j < s.hd; ++j) ss += a[size_t(row * s.D + h * s.hd + j)] * a[size_t(row * s.D + h * s.hd + j)];
      rn[size_t(row * (s.D / s.hd) + h)] = 1 / std::sqrt(ss + 1e-6);
      for (int64_t j = 0; j < s.hd; ++j) {
        const size_t i = size_t(row * s.D + h * s.hd + j);
        r.out[i] = a[i] * rn[size_t(row * (s.D / s.hd) + h)];
      }
    }
  if (!dout) return r;
  // da = r (g - o (g . o)); dz = da SiLU'(z); each tap scatters dz into dx, dweight; dz into dbias.
  std::vector<double> dz(static_cast<size_t>(N));
  for (int64_t row = 0; row < s.B * s.T; ++row)
    for (int64_t h = 0; h < s.D / s.hd; ++h) {
      const double rr = rn[size_t(row * (s.D / s.hd) + h)];
      double dot = 0;
      for (int64_t j = 0; j < s.hd; ++j) dot += (*dout)[size_t(row * s.D + h * s.hd + j)] * r.out[size_t(row * s.D + h * s.hd + j)];
      for (int64_t j = 0; j < s.hd; ++j) {
        const size_t i = size_t(row * s.D + h * s.hd + j);
        const double sg = 1 / (1 + std::exp(-z[i]));
        dz[i] = rr * ((*dout)[i] - r.out[i] * dot) * (s.act ? sg * (1 + z[i] * (1 - sg)) : 1.0);
      }
    }
  r.dx.assign(size_t(N), 0);
  r.dweight.assign(size_t(s.D * W), 0);
  r.dbias.assign(size_t(s.D), 0);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t c = 0; c < s.D; ++c) {
        const double g = dz[size_t(at(b, t, c))];
        if (!W) {
          r.dx[size_t(at(b, t, c))] = g;
          continue;
        }
        r.dbias[size_t(c)] += g;
        for (int64_t i = 0; i < W; ++i) {
          const int64_t u = t - (W - 1 - i);
          if (u < seq_start(in, t)) continue;
          r.dx[size_t(at(b, u, c))] += w[size_t(c * W + i)] * g;
          r.dweight[size_t(c * W + i)] += x[size_t(at(b, u, c))] * g;
        }
      }
  return r;
}

struct Result {
  HostTensor out, dx, dweight, dbias;
  Status fwd, bwd;
};

Result run(const Inputs& in, const HostTensor& dout, Backend be, int threads = 0) {
  Result r;
  r.out = HostTensor(in.x.dtype(), {in.s.B, in.s.T, in.s.D});
  r.out.poison();
  WConvNormFwdParams f;
  f.x = in.x.view();
  f.weight = in.weight.view();
  f.bias = in.bias.view();
  f.cu_seqlens = in.cu.view();
  f.head_dim = in.s.hd;
  f.activation = in.s.act;
  f.out = r.out.view();
  f.backend = be;
  f.num_threads = threads;
  r.fwd = w_conv_norm_fwd(f);
  r.dx = HostTensor(in.x.dtype(), {in.s.B, in.s.T, in.s.D});
  r.dx.poison();
  WConvNormBwdParams b;
  b.x = f.x, b.weight = f.weight, b.bias = f.bias, b.cu_seqlens = f.cu_seqlens, b.head_dim = f.head_dim;
  b.activation = f.activation, b.backend = be, b.num_threads = threads;
  b.dout = dout.view();
  b.dx = r.dx.view();
  if (in.weight.present()) {
    r.dweight = HostTensor(in.weight.dtype(), {in.s.D, in.s.W});
    r.dweight.poison();
    b.dweight = r.dweight.view();
  }
  if (in.bias.present()) {
    r.dbias = HostTensor(in.bias.dtype(), {in.s.D});
    r.dbias.poison();
    b.dbias = r.dbias.view();
  }
  r.bwd = w_conv_norm_bwd(b);
  return r;
}

HostTensor random_like(const HostTensor& x, uint64_t seed) {
  HostTensor d(x.dtype(), {x.view().shape[0], x.view().shape[1], x.view().shape[2]});
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0, 1);
  for (int64_t i = 0; i < d.numel(); ++i) d.set(i, n01(rng));
  return d;
}

std::vector<Spec> sweep() {
  std::vector<Spec> v;
  uint64_t seed = 100;
  for (int64_t W : {2, 3, 4})
    for (bool bias : {false, true})
      for (bool act : {true, false}) {
        Spec s;
        s.W = W, s.bias = bias, s.act = act, s.seed = seed++;
        s.B = 2, s.T = 13, s.D = 128, s.hd = 64;
        v.push_back(s);
        s.B = 1, s.T = 0, s.D = 256, s.hd = 128, s.seqlens = {0, 5, 1, 0, 9, 2, 0}, s.seed = seed++;
        v.push_back(s);
      }
  Spec s;
  s.conv = false, s.act = false, s.B = 3, s.T = 7, s.D = 64, s.hd = 16, s.seed = seed++;
  v.push_back(s);
  s.act = true, s.seqlens = {4, 0, 3}, s.seed = seed++;
  v.push_back(s);
  s = Spec();
  s.W = 1, s.bias = true, s.T = 65, s.D = 48, s.hd = 48, s.seed = seed++;  // one tap; a head dim that is not a power of two
  v.push_back(s);
  s = Spec();
  s.W = 7, s.T = 1000, s.D = 32, s.hd = 32, s.seqlens = {1, 63, 936}, s.seed = seed++;
  v.push_back(s);
  return v;
}

class WConvNormSweep : public ::testing::TestWithParam<Spec> {};

// fp64 inputs on the cpu and oracle backends: the reference to 1e-13 (same arithmetic, other association: the
// reference scatters the taps' gradients where the backend gathers them). fp32 inputs: the fp64 reference on the
// fp32 values; per element a few roundings of u = 6e-8 in z, the norm and SiLU, amplified by at most the condition
// of a / ||a|| (1 for o, larger where ||a|| is small): 1e-5 on out and dx; dweight and dbias sum T terms in fp32.
TEST_P(WConvNormSweep, MatchesReference) {
  for (DType dt : {DType::f64, DType::f32}) {
    const Inputs in = make(GetParam(), dt);
    const HostTensor dout = random_like(in.x, in.s.seed + 7);
    const std::vector<double> g = dout.to_f64();
    const Ref ref = reference(in, &g);
    for (Backend be : {Backend::cpu, Backend::oracle}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + backend_name(be));
      const Result r = run(in, dout, be);
      ASSERT_TRUE(r.fwd.ok()) << r.fwd.message();
      ASSERT_TRUE(r.bwd.ok()) << r.bwd.message();
      // The oracle computes in fp64 whatever the dtype: with fp32 outputs, one rounding (u) of each element.
      const double fwd_tol = dt == DType::f64 ? 1e-13 : (be == Backend::oracle ? 1.2e-7 : 1e-5);
      const double bwd_tol = dt == DType::f64 ? 1e-13 : (be == Backend::oracle ? 1.2e-7 : 2e-5);
      if (std::getenv("PATHATTN_TEST_VERBOSE")) {
        std::printf("[w_conv_norm] %s %s %s: out %.2e dx %.2e dweight %.2e\n", in.s.name().c_str(), dtype_name(dt),
                    backend_name(be), max_rel(r.out.to_f64(), ref.out), max_rel(r.dx.to_f64(), ref.dx),
                    in.s.conv ? max_rel(r.dweight.to_f64(), ref.dweight) : 0.0);
      }
      EXPECT_LE(max_rel(r.out.to_f64(), ref.out), fwd_tol) << "out";
      EXPECT_LE(max_rel(r.dx.to_f64(), ref.dx), bwd_tol) << "dx";
      if (in.s.conv) {
        EXPECT_LE(max_rel(r.dweight.to_f64(), ref.dweight), bwd_tol) << "dweight";
        EXPECT_TRUE(r.dweight.guards_intact());
      }
      if (in.s.bias) {
        EXPECT_LE(max_rel(r.dbias.to_f64(), ref.dbias), bwd_tol) << "dbias";
        EXPECT_TRUE(r.dbias.guards_intact());
      }
      EXPECT_TRUE(r.out.guards_intact() && r.dx.guards_intact());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, WConvNormSweep, ::testing::ValuesIn(sweep()));

// The reference's gradients against central differences of its own forward (loss = sum(out * dout)), so the
// reference is not the only witness of the backward's formula.
TEST(WConvNorm, ReferenceGradientsMatchFiniteDifferences) {
  Spec s;
  s.W = 3, s.bias = true, s.T = 0, s.D = 8, s.hd = 4, s.seqlens = {3, 0, 5};
  Inputs in = make(s, DType::f64);
  const HostTensor dout = random_like(in.x, 5);
  const std::vector<double> g = dout.to_f64();
  const Ref ref = reference(in, &g);
  auto loss = [&]() {
    const Ref r = reference(in, nullptr);
    double l = 0;
    for (size_t i = 0; i < g.size(); ++i) l += r.out[i] * g[i];
    return l;
  };
  const double h = 1e-6;
  auto check = [&](HostTensor& t, const std::vector<double>& grad, const char* name) {
    std::vector<double> fd(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double v = t.get(i);
      t.set(i, v + h);
      const double lp = loss();
      t.set(i, v - h);
      const double lm = loss();
      t.set(i, v);
      fd[size_t(i)] = (lp - lm) / (2 * h);
    }
    EXPECT_LE(max_rel(grad, fd), 1e-7) << name;
  };
  check(in.x, ref.dx, "dx");
  check(in.weight, ref.dweight, "dweight");
  check(in.bias, ref.dbias, "dbias");
}

// Every output element has one writer and the backward's sums run in a fixed order: bitwise equal for any thread
// count.
TEST(WConvNorm, ThreadCountInvarianceBitwise) {
  Spec s;
  s.W = 4, s.bias = true, s.T = 0, s.D = 256, s.hd = 64, s.seqlens = {17, 0, 40, 3};
  const Inputs in = make(s, DType::f32);
  const HostTensor dout = random_like(in.x, 9);
  const Result a = run(in, dout, Backend::cpu, 1), b = run(in, dout, Backend::cpu, 3);
  ASSERT_TRUE(a.fwd.ok() && a.bwd.ok() && b.fwd.ok() && b.bwd.ok());
  EXPECT_EQ(a.out.to_f64(), b.out.to_f64());
  EXPECT_EQ(a.dx.to_f64(), b.dx.to_f64());
  EXPECT_EQ(a.dweight.to_f64(), b.dweight.to_f64());
  EXPECT_EQ(a.dbias.to_f64(), b.dbias.to_f64());
}

// bf16 x: computed in fp32 from the bf16 values, rounded once to bf16 on output (u = 2^-9).
TEST(WConvNorm, Bf16InputsRoundOnce) {
  Spec s;
  s.W = 3, s.T = 0, s.D = 128, s.hd = 64, s.seqlens = {20, 0, 11};
  const Inputs in = make(s, DType::bf16);
  const HostTensor dout = random_like(in.x, 3);
  const std::vector<double> g = dout.to_f64();
  const Ref ref = reference(in, &g);
  const Result r = run(in, dout, Backend::cpu);
  ASSERT_TRUE(r.fwd.ok() && r.bwd.ok()) << r.fwd.message() << r.bwd.message();
  EXPECT_LE(max_rel(r.out.to_f64(), ref.out), 4e-3);
  EXPECT_LE(rel_l2(r.dx.to_f64(), ref.dx), 4e-3);
  EXPECT_LE(max_rel(r.dweight.to_f64(), ref.dweight), 1e-5);  // fp32 weight gradient of the bf16 values
}

// No token at all: the forward writes nothing, the backward writes zero dweight / dbias.
TEST(WConvNorm, EmptyInputGivesZeroWeightGradients) {
  Spec s;
  s.bias = true, s.T = 0, s.D = 32, s.hd = 16, s.seqlens = {0, 0};
  const Inputs in = make(s, DType::f32);
  const HostTensor dout = random_like(in.x, 1);
  const Result r = run(in, dout, Backend::cpu);
  ASSERT_TRUE(r.fwd.ok() && r.bwd.ok());
  for (double v : r.dweight.to_f64()) EXPECT_EQ(v, 0.0);
  for (double v : r.dbias.to_f64()) EXPECT_EQ(v, 0.0);
}

void expect_error(const Status& st, Status::Code code, const std::string& arg) {
  EXPECT_EQ(int(st.code()), int(code)) << st.message();
  EXPECT_EQ(st.message().rfind(arg + ":", 0), 0u) << "message does not start with '" << arg << ":': " << st.message();
}

TEST(WConvNorm, BadArgumentsNameTheArgument) {
  using C = Status::Code;
  Spec s;
  s.bias = true, s.D = 32, s.hd = 16;
  const Inputs in = make(s, DType::f32);
  HostTensor out(DType::f32, {1, s.T, s.D}), out16(DType::bf16, {1, s.T, s.D}), x2(DType::f32, {s.T, s.D});
  HostTensor w5(DType::f32, {s.D + 1, 3}), wwide(DType::f32, {s.D, 65}), xi(DType::i32, {1, s.T, s.D});
  HostTensor cu(DType::i64, {3});
  int64_t* cup = static_cast<int64_t*>(cu.view().data);
  cup[0] = 0, cup[1] = 5, cup[2] = s.T - 1;
  auto base = [&]() {
    WConvNormFwdParams p;
    p.x = in.x.view(), p.weight = in.weight.view(), p.bias = in.bias.view(), p.head_dim = s.hd;
    p.out = out.view(), p.backend = Backend::cpu;
    return p;
  };
  WConvNormFwdParams p = base();
  ASSERT_TRUE(w_conv_norm_fwd(p).ok());
  p.x = x2.view();
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "x");
  p = base(), p.x = xi.view();
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "x");
  p = base(), p.head_dim = 12;
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "head_dim");
  p = base(), p.head_dim = 0;
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "head_dim");
  p = base(), p.weight = w5.view();
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "weight");
  p = base(), p.weight = wwide.view(), p.bias = TensorView{};
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "weight");
  p = base(), p.weight = TensorView{};
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "bias");
  p = base(), p.eps = -1;
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "eps");
  p = base(), p.cu_seqlens = cu.view();
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "cu_seqlens");
  p = base(), p.out = out16.view();
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "out");
  p = base(), p.out = TensorView{};
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "out");
  p = base(), p.num_threads = -1;
  expect_error(w_conv_norm_fwd(p), C::invalid_argument, "num_threads");
#ifndef PATHATTN_WITH_CUDA
  p = base(), p.backend = Backend::cuda;
  expect_error(w_conv_norm_fwd(p), C::unavailable, "backend");
#endif

  HostTensor dx(DType::f32, {1, s.T, s.D}), dw(DType::f32, {s.D, s.W}), dwb(DType::bf16, {s.D, s.W});
  WConvNormBwdParams b;
  b.x = in.x.view(), b.weight = in.weight.view(), b.bias = in.bias.view(), b.head_dim = s.hd;
  b.dout = out.view(), b.dx = dx.view(), b.backend = Backend::cpu;
  ASSERT_TRUE(w_conv_norm_bwd(b).ok());
  WConvNormBwdParams c = b;
  c.dout = out16.view();
  expect_error(w_conv_norm_bwd(c), C::invalid_argument, "dout");
  c = b, c.dx = TensorView{};
  expect_error(w_conv_norm_bwd(c), C::invalid_argument, "dx");
  c = b, c.dweight = dwb.view();
  expect_error(w_conv_norm_bwd(c), C::invalid_argument, "dweight");
  c = b, c.weight = TensorView{}, c.bias = TensorView{}, c.dweight = dw.view();
  expect_error(w_conv_norm_bwd(c), C::invalid_argument, "dweight");
}

}  // namespace
}  // namespace pathattn::test
