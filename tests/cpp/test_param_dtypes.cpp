// tests/cpp/test_param_dtypes.cpp: w, beta and g in any float dtype (bf16, f16, f32, f64), each on its own, on
// the oracle and cpu backends: forward, backward, prefill and decode. The backends read the narrow values exactly
// into their compute type, so every result must equal, bit for bit, that of the same values held in the compute
// dtype, and dw / dbeta / dg must be that run's gradients rounded to the dtype of their input.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "check/harness.h"

namespace pathattn::test {
namespace {

// A gradient of an input given in dtype dt against the compute-dtype run's: that gradient rounded to dt, bit
// for bit, when dt is no wider than the compute dtype; an f64 input under fp32 compute may keep digits the fp32
// gradient rounded off (the oracle, and sums the fast path does in fp64), so there: equal to fp32 rounding.
::testing::AssertionResult grad_matches(const HostTensor& got, const HostTensor& ref_wide, DType compute);

bool same_bits(const HostTensor& a, const HostTensor& b) {
  if (a.present() != b.present()) return false;
  if (!a.present()) return true;
  return a.dtype() == b.dtype() && a.numel() == b.numel() &&
         std::memcmp(a.view().data, b.view().data, size_t(a.numel() * dtype_size(a.dtype()))) == 0;
}

::testing::AssertionResult grad_matches(const HostTensor& got, const HostTensor& ref_wide, DType compute) {
  const DType dt = got.dtype();
  if (dtype_size(dt) <= dtype_size(compute)) {
    if (same_bits(got, ref_wide.cast(dt))) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "not the compute-dtype gradient rounded to " << dtype_name(dt);
  }
  const double e = rel_l2(got.to_f64(), ref_wide.to_f64());
  if (e <= 1e-6) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "rel L2 " << e << " against the compute-dtype gradient";
}

HostTensor cast_or_none(const HostTensor& h, DType dt) { return h.present() ? h.cast(dt) : HostTensor(); }

struct ParamDtypes {
  DType w, beta, g;
};

std::string name_of(const ParamDtypes& d) {
  return std::string("w ") + dtype_name(d.w) + ", beta " + dtype_name(d.beta) + ", g " + dtype_name(d.g);
}

// The case with w, beta, g stored in `d` (narrow) and the same values in the compute dtype (wide).
struct Pair {
  Case narrow, wide;
};

Pair make_pair(const CaseSpec& s, const ParamDtypes& d) {
  const Case c = Case::make(s);
  const DType compute = s.dtype == DType::f64 ? DType::f64 : DType::f32;
  Pair p{c, c};
  p.narrow.w = cast_or_none(c.w, d.w);
  p.narrow.beta = cast_or_none(c.beta, d.beta);
  p.narrow.g = cast_or_none(c.g, d.g);
  p.wide.w = cast_or_none(p.narrow.w, compute);  // the rounded values, exactly
  p.wide.beta = cast_or_none(p.narrow.beta, compute);
  p.wide.g = cast_or_none(p.narrow.g, compute);
  return p;
}

using Param = std::tuple<Backend, DType>;  // backend, dtype of q / k / v
class ParamDtypesTest : public ::testing::TestWithParam<Param> {};

CaseSpec spec_for(DType qdt, bool gate, uint64_t seed) {
  CaseSpec s;
  s.B = 2;
  s.T = 37;  // several chunks at chunk_size 8, a ragged last one
  s.HQ = 4;
  s.H = 2;
  s.K = 16;
  s.V = 8;
  s.gate = gate;
  s.dtype = qdt;
  s.seed = seed;
  return s;
}

std::vector<ParamDtypes> combos() {
  const DType bf = DType::bf16, h = DType::f16, f = DType::f32, d = DType::f64;
  return {{bf, bf, bf}, {h, h, h}, {bf, f, f}, {f, bf, h}, {h, bf, f}, {d, bf, f}, {bf, d, d}};
}

TEST_P(ParamDtypesTest, ForwardAndBackwardEqualTheComputeDtypeRun) {
  const auto [be, qdt] = GetParam();
  uint64_t seed = 100;
  for (bool gate : {false, true}) {
    for (const ParamDtypes& d : combos()) {
      SCOPED_TRACE(name_of(d) + (gate ? ", gate" : ""));
      const CaseSpec s = spec_for(qdt, gate, ++seed);
      const Pair p = make_pair(s, d);
      const int chunk = be == Backend::cpu ? 8 : 0;  // several chunks and superblocks on the fast path
      FwdOut fn = run_fwd(p.narrow, be, 0, chunk), fw = run_fwd(p.wide, be, 0, chunk);
      ASSERT_TRUE(fn.status.ok()) << fn.status.message();
      ASSERT_TRUE(fw.status.ok()) << fw.status.message();
      EXPECT_TRUE(same_bits(fn.o, fw.o));
      EXPECT_TRUE(same_bits(fn.lse, fw.lse));
      EXPECT_TRUE(fn.o.guards_intact() && fn.lse.guards_intact());
      const HostTensor dout = random_dout(p.narrow, seed + 7);
      BwdOut bn = run_bwd(p.narrow, fn, dout, be, 0, chunk), bw = run_bwd(p.wide, fw, dout, be, 0, chunk);
      ASSERT_TRUE(bn.status.ok()) << bn.status.message();
      ASSERT_TRUE(bw.status.ok()) << bw.status.message();
      EXPECT_TRUE(same_bits(bn.dq, bw.dq) && same_bits(bn.dk, bw.dk) && same_bits(bn.dv, bw.dv));
      EXPECT_EQ(bn.dw.dtype(), d.w);
      EXPECT_EQ(bn.dbeta.dtype(), d.beta);
      const DType compute = qdt == DType::f64 ? DType::f64 : DType::f32;
      EXPECT_TRUE(grad_matches(bn.dw, bw.dw, compute)) << "dw";
      EXPECT_TRUE(grad_matches(bn.dbeta, bw.dbeta, compute)) << "dbeta";
      if (gate) {
        EXPECT_EQ(bn.dg.dtype(), d.g);
        EXPECT_TRUE(grad_matches(bn.dg, bw.dg, compute)) << "dg";
      }
      for (const HostTensor* t : {&bn.dq, &bn.dk, &bn.dv, &bn.dw, &bn.dbeta, &bn.dg})
        if (t->present()) {
          EXPECT_TRUE(t->guards_intact());
        }
      EXPECT_TRUE(all_finite(bn.dw.to_f64()) && all_finite(bn.dbeta.to_f64()));
    }
  }
}

// Varlen with an empty sequence and a one-token one: the narrow gradients of every sequence.
TEST_P(ParamDtypesTest, Varlen) {
  const auto [be, qdt] = GetParam();
  CaseSpec s = spec_for(qdt, true, 7);
  s.seqlens = {13, 0, 1, 22};
  const ParamDtypes d{DType::bf16, DType::f16, DType::bf16};
  const Pair p = make_pair(s, d);
  FwdOut fn = run_fwd(p.narrow, be), fw = run_fwd(p.wide, be);
  ASSERT_TRUE(fn.status.ok() && fw.status.ok()) << fn.status.message() << fw.status.message();
  EXPECT_TRUE(same_bits(fn.o, fw.o));
  const HostTensor dout = random_dout(p.narrow, 8);
  BwdOut bn = run_bwd(p.narrow, fn, dout, be), bw = run_bwd(p.wide, fw, dout, be);
  ASSERT_TRUE(bn.status.ok() && bw.status.ok()) << bn.status.message() << bw.status.message();
  EXPECT_TRUE(same_bits(bn.dw, bw.dw.cast(d.w)));
  EXPECT_TRUE(same_bits(bn.dbeta, bw.dbeta.cast(d.beta)));
  EXPECT_TRUE(same_bits(bn.dg, bw.dg.cast(d.g)));
}

// dw, dbeta, dg must have the dtype of w, beta, g (not the compute dtype), and integer w / beta / g are refused
// naming the argument; nothing is written.
TEST_P(ParamDtypesTest, GradientDtypesFollowTheInputs) {
  const auto [be, qdt] = GetParam();
  const Pair p = make_pair(spec_for(qdt, true, 9), {DType::bf16, DType::f16, DType::bf16});
  FwdOut f = run_fwd(p.narrow, be);
  ASSERT_TRUE(f.status.ok()) << f.status.message();
  const HostTensor dout = random_dout(p.narrow, 10);
  // The gradients of the wide run (compute dtype) for the narrow inputs: refused, naming dw first.
  Case mixed = p.narrow;
  BwdOut ok = run_bwd(mixed, f, dout, be);
  ASSERT_TRUE(ok.status.ok());
  const CaseSpec& s = mixed.spec;
  const DType compute = qdt == DType::f64 ? DType::f64 : DType::f32;
  HostTensor dq(s.dtype, {s.B, s.T, s.HQ, s.K}), dk(s.dtype, {s.B, s.T, s.H, s.K}), dv(s.dtype, {s.B, s.T, s.H, s.V});
  HostTensor dw(compute, {s.B, s.T, s.H, s.K}), dbeta(DType::f16, {s.B, s.T, s.H}), dg(DType::bf16, {s.B, s.T, s.HQ});
  dw.poison();
  PathBwdParams b = bwd_params_for(mixed.fwd_params(f.o, &f.lse));
  b.backend = be;
  b.do_ = dout.view();
  b.dq = dq.view(), b.dk = dk.view(), b.dv = dv.view(), b.dw = dw.view(), b.dbeta = dbeta.view(), b.dg = dg.view();
  Status st = path_attn_bwd(b);
  EXPECT_EQ(st.code(), Status::Code::invalid_argument);
  EXPECT_EQ(st.message().rfind(std::string("dw: expected dtype bfloat16, got ") + dtype_name(compute), 0), 0u)
      << st.message();
  EXPECT_FALSE(all_finite(dw.to_f64()));  // still poisoned
  for (DType bad : {DType::i32, DType::i64}) {
    for (const char* arg : {"w", "beta", "g"}) {
      PathFwdParams fp = mixed.fwd_params(f.o, &f.lse);
      fp.backend = be;
      TensorView& x = std::string(arg) == "w" ? fp.w : std::string(arg) == "beta" ? fp.beta : fp.g;
      x.dtype = bad;
      st = path_attn_fwd(fp);
      EXPECT_EQ(st.code(), Status::Code::invalid_argument);
      EXPECT_EQ(st.message().rfind(std::string(arg) + ": expected dtype bfloat16, float16, float32 or float64, got " +
                                       dtype_name(bad), 0),
                0u)
          << st.message();
    }
  }
}

// Prefill and decode steps with bf16 w / beta and an f16 g: the cache, outputs and lengths equal those of the
// compute-dtype values.
TEST_P(ParamDtypesTest, PrefillAndDecode) {
  const auto [be, qdt] = GetParam();
  CaseSpec s = spec_for(qdt, true, 11);
  s.T = 12;
  const Pair p = make_pair(s, {DType::bf16, DType::bf16, DType::f16});
  const int64_t P = 8, N = s.B, C = s.T;
  const DType compute = qdt == DType::f64 ? DType::f64 : DType::f32;
  struct Run {
    HostTensor kc, vc, gc, len, o;
  };
  auto slice = [](TensorView x, int64_t t0, int64_t n) {
    x.data = static_cast<char*>(x.data) + t0 * x.stride[1] * dtype_size(x.dtype);
    x.shape[1] = n;
    return x;
  };
  auto run = [&](const Case& c) {
    Run r{HostTensor(compute, {N, s.H, C, s.K}), HostTensor(compute, {N, s.H, C, s.V}),
          HostTensor(DType::f64, {N, s.HQ, C}), HostTensor(DType::i64, {N}), HostTensor(s.dtype, {N, C, s.HQ, s.V})};
    for (HostTensor* t : {&r.kc, &r.vc, &r.gc}) t->fill_f64(std::vector<double>(size_t(t->numel()), 0.0));
    r.o.poison();
    PathPrefillParams pp;
    pp.fwd = c.fwd_params(r.o, nullptr);
    pp.fwd.backend = be;
    for (TensorView* x : {&pp.fwd.q, &pp.fwd.k, &pp.fwd.v, &pp.fwd.w, &pp.fwd.beta, &pp.fwd.g, &pp.fwd.o})
      *x = slice(*x, 0, P);
    pp.cache = {r.kc.view(), r.vc.view(), r.gc.view(), r.len.view()};
    Status st = path_attn_prefill(pp);
    EXPECT_TRUE(st.ok()) << st.message();
    for (int64_t t = P; t < C; ++t) {
      PathDecodeParams d;
      d.q = slice(c.q.view(), t, 1), d.k = slice(c.k.view(), t, 1), d.v = slice(c.v.view(), t, 1);
      d.w = slice(c.w.view(), t, 1), d.beta = slice(c.beta.view(), t, 1), d.g = slice(c.g.view(), t, 1);
      d.o = slice(r.o.view(), t, 1);
      d.cache = pp.cache;
      d.backend = be;
      st = path_attn_decode(d);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    return r;
  };
  const Run n = run(p.narrow), w = run(p.wide);
  EXPECT_TRUE(same_bits(n.kc, w.kc));
  EXPECT_TRUE(same_bits(n.vc, w.vc));
  EXPECT_TRUE(same_bits(n.gc, w.gc));
  EXPECT_TRUE(same_bits(n.len, w.len));
  EXPECT_TRUE(same_bits(n.o, w.o));
  EXPECT_TRUE(all_finite(n.o.to_f64()));
}

INSTANTIATE_TEST_SUITE_P(Backends, ParamDtypesTest,
                         ::testing::Combine(::testing::Values(Backend::oracle, Backend::cpu),
                                            ::testing::Values(DType::f32, DType::bf16, DType::f16, DType::f64)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return std::string(backend_name(std::get<0>(info.param))) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace pathattn::test
