// tests/cpp/test_oracle_chain.cpp: the machinery behind `pathattn check` (tests/cpp/oracle_chain.h): the
// drawn cases are valid and cover the awkward sizes, the comparison passes exact agreement and fails
// errors past its bounds, and a failing candidate backend fails the case.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "check/oracle_chain.h"

namespace pathattn::test {
namespace {

TEST(OracleChain, DrawnSpecsAreValidAndCoverTheAwkwardCases) {
  std::mt19937_64 rng(2024);
  std::set<int64_t> Ts;
  bool k_ne_v = false, gqa = false, mha = false, varlen_empty_and_one = false, gate_on = false,
       gate_off = false, beta_two = false, batch2 = false;
  for (int n = 0; n < 300; ++n) {
    const CaseSpec s = draw_check_spec(rng);
    const Case c = Case::make(s);  // fills B, T from seqlens
    const CaseSpec& r = c.spec;
    ASSERT_EQ(r.K % 8, 0);
    ASSERT_EQ(r.V % 8, 0);
    ASSERT_LE(r.K, 256);
    ASSERT_LE(r.V, 256);
    ASSERT_EQ(r.HQ % r.H, 0);
    Ts.insert(r.T);
    k_ne_v |= r.K != r.V;
    gqa |= r.HQ > r.H;
    mha |= r.HQ == r.H;
    gate_on |= r.gate;
    gate_off |= !r.gate;
    beta_two |= r.beta == BetaMode::two;
    batch2 |= r.B == 2;
    if (!r.seqlens.empty()) {
      ASSERT_EQ(r.B, 1);
      int64_t sum = 0;
      bool has0 = false, has1 = false;
      for (int64_t l : r.seqlens) {
        ASSERT_GE(l, 0);
        sum += l;
        has0 |= l == 0;
        has1 |= l == 1;
      }
      ASSERT_EQ(sum, r.T);
      varlen_empty_and_one |= has0 && has1;
    }
    if (n < 20) {  // every drawn case passes validation: the oracle accepts it
      FwdOut f = run_fwd(c, Backend::oracle);
      ASSERT_TRUE(f.status.ok()) << r.name() << ": " << f.status.message();
    }
  }
  EXPECT_EQ(Ts, (std::set<int64_t>{1, 7, 63, 64, 65, 200}));
  EXPECT_TRUE(k_ne_v && gqa && mha && varlen_empty_and_one && gate_on && gate_off && beta_two && batch2);
}

TEST(OracleChain, CompareTensorHonoursItsBounds) {
  const std::vector<double> ref = {1.0, -2.0, 0.5, 4.0};
  std::vector<double> got = ref;
  EXPECT_TRUE(compare_tensor("fp64", "o", false, got, ref, kFp64MaxRel).pass);
  EXPECT_EQ(compare_tensor("fp64", "o", false, got, ref, kFp64MaxRel).error, 0.0);
  got[2] += 4.0 * 0.5e-10;  // max_rel = 2e-10 / 4 = 5e-11: inside
  EXPECT_TRUE(compare_tensor("fp64", "o", false, got, ref, kFp64MaxRel).pass);
  got[2] += 4.0 * 1e-10;  // max_rel = 1.5e-10: outside
  const TensorCheck t = compare_tensor("fp64", "o", false, got, ref, kFp64MaxRel);
  EXPECT_FALSE(t.pass);
  EXPECT_NEAR(t.error, 1.5e-10, 1e-16);
  // rel_l2: ||(0, 0, 0, 2e-4 * 4.6)|| / ||ref|| = 9.2e-4 / 4.61 ~ 2e-4 > 1e-4
  std::vector<double> g2 = ref;
  g2[3] += 9.2e-4;
  EXPECT_FALSE(compare_tensor("fp32", "dq", true, g2, ref, kFp32RelL2Grad).pass);
  g2[3] = ref[3] + 2e-4;
  EXPECT_TRUE(compare_tensor("fp32", "dq", true, g2, ref, kFp32RelL2Grad).pass);
  // Non-finite values never pass, nor do size mismatches.
  std::vector<double> bad = ref;
  bad[0] = std::nan("");
  EXPECT_FALSE(compare_tensor("fp32", "o", true, bad, ref, 1e30).pass);
  EXPECT_FALSE(compare_tensor("fp64", "o", false, bad, ref, 1e30).pass);
  EXPECT_FALSE(compare_tensor("fp64", "o", false, {1.0}, ref, 1e30).pass);
}

TEST(OracleChain, OracleAgainstItselfPassesEveryTensor) {
  std::mt19937_64 rng(7);
  for (int n = 0; n < 4; ++n) {
    CaseSpec s = draw_check_spec(rng);
    s.T = std::min<int64_t>(s.T, 65);  // keep the oracle-vs-oracle run short
    if (!s.seqlens.empty()) s.seqlens = {3, 0, 1, s.T - 4 > 0 ? s.T - 4 : 0};
    const CaseCheck cc = check_case(s, Backend::oracle);
    ASSERT_TRUE(cc.status.ok()) << cc.status.message();
    EXPECT_TRUE(cc.pass()) << cc.spec.name();
    // o, lse, dq, dk, dv (+ dw, dbeta) (+ dg), in fp64 and fp32.
    const size_t per = 5 + (cc.spec.path ? 2 : 0) + (cc.spec.gate ? 1 : 0);
    EXPECT_EQ(cc.tensors.size(), 2 * per);
    for (const TensorCheck& t : cc.tensors) {
      if (t.precision == "fp64") EXPECT_EQ(t.error, 0.0) << t.tensor;  // same code, same inputs: bitwise
      // f32 storage of o, lse and the gradients (6e-8 each); the backward reads the stored o and lse, and
      // exp(s - lse) turns lse's absolute rounding (|lse| * 6e-8, |lse| up to ~6 here) into P's error.
      else EXPECT_LE(t.error, 2e-6) << t.tensor;
    }
  }
}

TEST(OracleChain, AFailingCandidateFailsTheCase) {
  CaseSpec s;
  s.T = 7;
  // cuda is either absent (unavailable) or rejects host tensors (invalid_argument): never ok here.
  const CaseCheck cc = check_case(s, Backend::cuda);
  EXPECT_FALSE(cc.status.ok());
  EXPECT_FALSE(cc.pass());
  EXPECT_TRUE(cc.tensors.empty());
}

}  // namespace
}  // namespace pathattn::test
