// tests/cpp/test_fast.cpp: the blockwise CPU fast path against the fp64 oracle, forward and every gradient,
// in fp64 (max relative error <= 1e-10) and fp32 (relative L2 <= 1e-5 on o, 1e-4 on gradients); plus chunk
// size and thread-count invariance. Tolerances and their reasons: docs/numerics.md.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "harness.h"

namespace pathattn::test {
namespace {

struct Named {
  const char* name;
  const HostTensor* a;
  const HostTensor* ref;
};

std::vector<Named> grads_of(const CaseSpec& s, const BwdOut& a, const BwdOut& r) {
  std::vector<Named> v = {{"dq", &a.dq, &r.dq}, {"dk", &a.dk, &r.dk}, {"dv", &a.dv, &r.dv}};
  if (s.path) {
    v.push_back({"dw", &a.dw, &r.dw});
    v.push_back({"dbeta", &a.dbeta, &r.dbeta});
  }
  if (s.gate) v.push_back({"dg", &a.dg, &r.dg});
  return v;
}

// Runs oracle and fast path on one case; checks errors with the metric and bounds of the case's dtype.
void check_against_oracle(const CaseSpec& spec, int chunk = 0) {
  const Case c64 = Case::make(spec);  // fp64 inputs: the oracle's and the fp64 fast path's
  const bool f64 = spec.dtype == DType::f64;
  const HostTensor dout = random_dout(c64, spec.seed + 7);
  const FwdOut fo = run_fwd(c64, Backend::oracle);
  ASSERT_TRUE(fo.status.ok()) << fo.status.message();
  const BwdOut bo = run_bwd(c64, fo, dout, Backend::oracle);
  ASSERT_TRUE(bo.status.ok()) << bo.status.message();

  CaseSpec s32 = spec;
  Case c = c64;
  HostTensor d = dout;
  if (!f64) {  // the same values rounded to fp32 (the oracle saw the unrounded fp64 values)
    c.q = c64.q.cast(DType::f32);
    c.k = c64.k.cast(DType::f32);
    c.v = c64.v.cast(DType::f32);
    if (spec.path) { c.w = c64.w.cast(DType::f32); c.beta = c64.beta.cast(DType::f32); }
    if (spec.gate) c.g = c64.g.cast(DType::f32);
    c.spec.dtype = DType::f32;
    d = dout.cast(DType::f32);
  }
  const FwdOut ff = run_fwd(c, Backend::cpu, 0, chunk);
  ASSERT_TRUE(ff.status.ok()) << ff.status.message();
  const BwdOut bf = run_bwd(c, ff, d, Backend::cpu, 0, chunk);
  ASSERT_TRUE(bf.status.ok()) << bf.status.message();
  auto err = [&](const HostTensor& a, const HostTensor& r) {
    return f64 ? max_rel(a.to_f64(), r.to_f64()) : rel_l2(a.to_f64(), r.to_f64());
  };
  const double tol_o = f64 ? 1e-10 : 1e-5, tol_g = f64 ? 1e-10 : 1e-4;
  if (std::getenv("PATHATTN_TEST_VERBOSE")) {
    std::printf("%s\n  o %.3e lse %.3e", spec.name().c_str(), err(ff.o, fo.o), err(ff.lse, fo.lse));
    for (const Named& g : grads_of(spec, bf, bo)) std::printf(" %s %.3e", g.name, err(*g.a, *g.ref));
    std::printf("\n");
  }
  EXPECT_LE(err(ff.o, fo.o), tol_o) << "o " << spec.name();
  EXPECT_LE(err(ff.lse, fo.lse), tol_o) << "lse " << spec.name();
  EXPECT_TRUE(ff.o.guards_intact() && ff.lse.guards_intact());
  for (const Named& g : grads_of(spec, bf, bo)) {
    EXPECT_LE(err(*g.a, *g.ref), tol_g) << g.name << " " << spec.name();
    EXPECT_TRUE(g.a->guards_intact()) << g.name;
  }
}

CaseSpec mk(int64_t T, int64_t HQ, int64_t H, int64_t K, int64_t V, bool path, bool gate, DType dt, uint64_t seed,
            BetaMode bm = BetaMode::uniform02, std::vector<int64_t> seqlens = {}, int64_t B = 1) {
  CaseSpec s;
  s.B = B; s.T = T; s.HQ = HQ; s.H = H; s.K = K; s.V = V; s.path = path; s.gate = gate; s.dtype = dt;
  s.seed = seed; s.beta = bm; s.seqlens = std::move(seqlens);
  return s;
}

TEST(FastPath, SmokeF64) {
  check_against_oracle(mk(200, 2, 1, 16, 24, true, true, DType::f64, 3), 16);
  check_against_oracle(mk(200, 4, 2, 32, 16, true, true, DType::f64, 4, BetaMode::two), 32);
  check_against_oracle(mk(130, 2, 2, 16, 16, false, true, DType::f64, 5), 16);
  check_against_oracle(mk(0, 2, 1, 16, 16, true, true, DType::f64, 6, BetaMode::uniform02, {0, 1, 70, 0, 33}), 16);
}
TEST(FastPath, SmokeF32) {
  check_against_oracle(mk(300, 2, 1, 64, 64, true, true, DType::f32, 3));
  check_against_oracle(mk(300, 2, 1, 64, 64, false, false, DType::f32, 3));
}

}  // namespace
}  // namespace pathattn::test
