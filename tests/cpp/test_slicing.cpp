// tests/cpp/test_slicing.cpp: core/slicing.h, the splitting of a call into slices of kv heads and batch rows
// that the CUDA backend's workspace limit runs: the plan for a given cost and limit, the streams it runs on
// (plan_lanes), the views and sub-problems, and, on the CPU backend, that running a call's slices one by one
// into views of its outputs reproduces the whole call bitwise (forward and backward, GQA, the gate, varlen).
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/problem.h"
#include "core/slicing.h"
#include "check/harness.h"

namespace pathattn::test {
namespace {

using core::Slice;

core::Problem problem(int64_t B, int64_t H, int64_t group) {
  core::Problem pr;
  pr.B = B;
  pr.T = 10;
  pr.H = H;
  pr.HQ = H * group;
  pr.group = group;
  for (int64_t b = 0; b < B; ++b) pr.seqs.push_back({b, 0, 10});
  pr.num_seqs = B;
  return pr;
}

std::vector<int64_t> flat(const std::vector<Slice>& s) {
  std::vector<int64_t> r;
  for (const Slice& x : s) r.insert(r.end(), {x.b0, x.nb, x.h0, x.nh});
  return r;
}

TEST(Slicing, PlanFollowsTheLimit) {
  const core::Problem pr = problem(3, 5, 2);
  auto cost = [](const Slice& s) { return int64_t(100 + 10 * s.nh * s.nb); };
  // Fits: one slice.
  EXPECT_EQ(flat(core::plan_slices(pr, true, 250, cost)), (std::vector<int64_t>{0, 3, 0, 5}));
  // Two heads (all rows) fit 160: heads 0-1, 2-3, 4.
  EXPECT_EQ(flat(core::plan_slices(pr, true, 160, cost)),
            (std::vector<int64_t>{0, 3, 0, 2, 0, 3, 2, 2, 0, 3, 4, 1}));
  // One head of all rows (130) does not fit 125: two rows, then one, per head.
  std::vector<Slice> s = core::plan_slices(pr, true, 125, cost);
  ASSERT_EQ(s.size(), 10u);
  EXPECT_EQ(flat({s[0], s[4], s[5], s[9]}), (std::vector<int64_t>{0, 2, 0, 1, 0, 2, 4, 1, 2, 1, 0, 1, 2, 1, 4, 1}));
  // Rows may not be split (varlen): one head of all rows, over the limit.
  EXPECT_EQ(core::plan_slices(pr, false, 125, cost).size(), 5u);
  // Slices as even as their number allows: 6 rows of 8 fit 160, so two slices of 4 (not 6 + 2); 5 of 7 kv
  // heads fit 150: two slices, 4 + 3.
  EXPECT_EQ(flat(core::plan_slices(problem(8, 1, 1), true, 160, cost)), (std::vector<int64_t>{0, 4, 0, 1, 4, 4, 0, 1}));
  EXPECT_EQ(flat(core::plan_slices(problem(1, 7, 1), true, 150, cost)), (std::vector<int64_t>{0, 1, 0, 4, 0, 1, 4, 3}));
  // 3 of 16 heads fit 130: six slices, 3 + 3 + 3 + 3 + 2 + 2 (not five of 3 and one of 1).
  EXPECT_EQ(flat(core::plan_slices(problem(1, 16, 1), true, 130, cost)),
            (std::vector<int64_t>{0, 1, 0, 3, 0, 1, 3, 3, 0, 1, 6, 3, 0, 1, 9, 3, 0, 1, 12, 2, 0, 1, 14, 2}));
  // Nothing fits: (row, head) slices all the same.
  EXPECT_EQ(core::plan_slices(pr, true, 1, cost).size(), 15u);
  for (int64_t limit : {1, 105, 125, 160, 250}) {  // every (row, head) exactly once
    std::vector<int> seen(15, 0);
    for (const Slice& x : core::plan_slices(pr, true, limit, cost))
      for (int64_t b = x.b0; b < x.b0 + x.nb; ++b)
        for (int64_t h = x.h0; h < x.h0 + x.nh; ++h) ++seen[b * 5 + h];
    EXPECT_EQ(seen, std::vector<int>(15, 1)) << "limit " << limit;
  }
}

// by_pairs: slices of whole batch rows (every head) compete with slices of kv heads by the (row, head) pairs
// their first slice holds, for a cost that is cheaper a pair in whole-row slices (the CUDA backward keeping
// workspace in their output memory).
TEST(Slicing, ByPairsTakesWholeRowsWhereTheyHoldMore) {
  // 8 rows, 16 heads; a pair costs 20, 12 in a slice of every head; 30 of fixed cost.
  auto cost = [](const Slice& s) { return int64_t(30 + (s.nh == 16 ? 12 : 20) * s.nh * s.nb); };
  const core::Problem pr = problem(8, 16, 1);
  // 200: one head of all rows (190) fits, two heads (350) do not; a whole row (222) does not fit either:
  // kv-head slices, with or without by_pairs.
  EXPECT_EQ(flat(core::plan_slices(pr, true, 200, cost, true)), flat(core::plan_slices(pr, true, 200, cost)));
  EXPECT_EQ(core::plan_slices(pr, true, 200, cost, true).size(), 16u);
  // 230: one head of 8 rows (8 pairs) against one row of 16 heads (16 pairs, 222): whole rows, 8 slices.
  std::vector<Slice> r = core::plan_slices(pr, true, 230, cost, true);
  ASSERT_EQ(r.size(), 8u);
  EXPECT_EQ(flat({r[0], r[7]}), (std::vector<int64_t>{0, 1, 0, 16, 7, 1, 0, 16}));
  EXPECT_EQ(core::plan_slices(pr, true, 230, cost).size(), 16u);  // without it: kv heads
  // Rows may not be split (varlen): kv heads.
  EXPECT_EQ(core::plan_slices(pr, false, 230, cost, true).size(), 16u);
  // A tie in pairs keeps kv heads: 2 heads of 8 rows (350) against 1 row of 16 heads (222) at 400: 16 pairs
  // each.
  std::vector<Slice> t = core::plan_slices(pr, true, 400, cost, true);
  ASSERT_EQ(t.size(), 8u);
  EXPECT_EQ(t[0].nh, 2);
  // plan_lanes passes it on: at 460, each of two streams' shares of 230 holds a whole row (16 pairs) where
  // kv heads give 8.
  core::LanePlan l = core::plan_lanes(pr, true, 460, 2, cost, true);
  EXPECT_EQ(l.lanes, 2);
  EXPECT_EQ(l.slices.size(), 8u);
  EXPECT_EQ(l.slices[0].nh, 16);
  EXPECT_EQ(l.block, 222);
  core::LanePlan k = core::plan_lanes(pr, true, 460, 2, cost);
  EXPECT_EQ(k.slices.size(), 16u);
  EXPECT_EQ(k.slices[0].nh, 1);
}

// lanes, number of slices, block bytes of a lane plan.
std::vector<int64_t> shape(const core::LanePlan& p) {
  return {p.lanes, int64_t(p.slices.size()), p.block};
}

TEST(Slicing, LanesWhereHalvedSlicesFitAndAreNotTooMany) {
  auto cost = [](const Slice& s) { return int64_t(100 + 10 * s.nh * s.nb); };
  // Whole call fits: one stream, one slice.
  core::LanePlan a = core::plan_lanes(problem(4, 2, 1), true, 1000, 4, cost);
  EXPECT_EQ(shape(a), (std::vector<int64_t>{1, 1, 180}));
  // Half the limit (80) holds no slice: one stream.
  core::LanePlan b = core::plan_lanes(problem(3, 5, 2), true, 160, 4, cost);
  EXPECT_EQ(b.lanes, 1);
  EXPECT_EQ(flat(b.slices), flat(core::plan_slices(problem(3, 5, 2), true, 160, cost)));
  // Single-head slices whose rows another stream cannot hold: one head of all 8 rows costs 180, a row 110.
  const core::Problem p8 = problem(8, 2, 1);
  core::LanePlan c = core::plan_lanes(p8, true, 200, 4, cost);  // shares of 100, 66, 50 hold no row
  EXPECT_EQ(shape(c), (std::vector<int64_t>{1, 2, 180}));
  // 240 / 2 = 120 holds 2 rows: 8 slices, four times one stream's 2: taken.
  core::LanePlan d = core::plan_lanes(p8, true, 240, 4, cost);
  EXPECT_EQ(shape(d), (std::vector<int64_t>{2, 8, 120}));
  // 220 / 2 = 110 holds 1 row: 16 slices > 4 x 2: one stream.
  core::LanePlan e = core::plan_lanes(p8, true, 220, 4, cost);
  EXPECT_EQ(shape(e), (std::vector<int64_t>{1, 2, 180}));
  // Slices of several heads go to two streams too: 8 heads of one row (20 + 10 a head), limit 60: one stream
  // takes 4 heads a slice, two streams 1 (8 slices <= 4 x 2).
  auto big = [](const Slice& s) { return int64_t(20 + 10 * s.nh * s.nb); };
  core::LanePlan f = core::plan_lanes(problem(1, 8, 1), false, 60, 2, big);
  EXPECT_EQ(shape(f), (std::vector<int64_t>{2, 8, 30}));
  EXPECT_EQ(f.slices[1].h0, 1);
  // Many rows of one head (cost 20 + 10 a row), limit 150: 13 rows fit one stream's slices, so two slices,
  // filled evenly: 8 rows each (100).
  const core::Problem p16 = problem(16, 1, 1);
  core::LanePlan g = core::plan_lanes(p16, true, 150, 4, big);
  // Four streams (37): 1 row, 16 slices <= 8 x 2: taken (the most streams that qualify). With at most two
  // (75): 5 rows fit, 4 slices, of 4 rows (60).
  EXPECT_EQ(core::plan_slices(p16, true, 150, big).size(), 2u);
  EXPECT_EQ(shape(g), (std::vector<int64_t>{4, 16, 30}));
  EXPECT_EQ(shape(core::plan_lanes(p16, true, 150, 2, big)), (std::vector<int64_t>{2, 4, 60}));
  // Rows may not be split (varlen): the halved limit holds no slice, one stream.
  EXPECT_EQ(core::plan_lanes(p16, false, 150, 4, big).lanes, 1);
}

TEST(Slicing, ViewsAndProblems) {
  std::vector<float> buf(2 * 3 * 4 * 5);
  TensorView x = make_view(buf.data(), DType::f32, {2, 3, 4, 5});
  TensorView y = core::sub_view(x, 1, 1, 2, 2);
  EXPECT_EQ(y.data, static_cast<void*>(buf.data() + 60 + 10));
  EXPECT_EQ(y.shape[0], 1);
  EXPECT_EQ(y.shape[1], 3);
  EXPECT_EQ(y.shape[2], 2);
  EXPECT_EQ(y.stride[0], 60);
  EXPECT_EQ(y.stride[2], 5);
  TensorView none{};
  EXPECT_EQ(core::sub_view(none, 1, 1, 2, 2).data, nullptr);
  TensorView cu = make_view(buf.data(), DType::f32, {4});
  EXPECT_EQ(core::sub_view(cu, 1, 1, 2, 2).data, cu.data);

  const core::Problem pr = problem(4, 3, 2);
  const core::Problem q = core::sub_problem(pr, Slice{1, 2, 1, 2});
  EXPECT_EQ(q.B, 2);
  EXPECT_EQ(q.H, 2);
  EXPECT_EQ(q.HQ, 4);
  ASSERT_EQ(q.seqs.size(), 2u);
  EXPECT_EQ(q.seqs[0].b, 0);
  EXPECT_EQ(q.seqs[1].b, 1);
  const core::Problem h = core::sub_problem(pr, Slice{0, 4, 2, 1});  // heads only: the sequences stay
  EXPECT_EQ(h.seqs.size(), 4u);
  EXPECT_EQ(h.HQ, 2);
}

bool same(const HostTensor& a, const HostTensor& b) {
  if (a.present() != b.present()) return false;
  return !a.present() || std::memcmp(a.view().data, b.view().data, size_t(a.numel() * dtype_size(a.dtype()))) == 0;
}

// The whole call against its slices run one by one into the same (poisoned) outputs.
void check_slices_reproduce(const CaseSpec& spec, bool batch_ok) {
  Case c = Case::make(spec);
  HostTensor dout = random_dout(c, spec.seed + 1);
  FwdOut full = run_fwd(c, Backend::cpu);
  ASSERT_TRUE(full.status.ok()) << full.status.message();
  BwdOut fullb = run_bwd(c, full, dout, Backend::cpu);
  ASSERT_TRUE(fullb.status.ok()) << fullb.status.message();

  FwdOut f;
  f.o = HostTensor(full.o.dtype(), {spec.B, spec.T, spec.HQ, spec.V});
  f.lse = HostTensor(full.lse.dtype(), {spec.B, spec.T, spec.HQ});
  f.o.poison();
  f.lse.poison();
  PathFwdParams fp = c.fwd_params(f.o, &f.lse);
  fp.backend = Backend::cpu;
  core::Problem pr;
  ASSERT_TRUE(core::check_fwd(fp, &pr).ok());
  const std::vector<Slice> slices = core::plan_slices(pr, batch_ok, 1, [](const Slice& s) { return s.nh * s.nb; });
  EXPECT_EQ(int64_t(slices.size()), spec.H * (batch_ok ? spec.B : 1));
  for (const Slice& sl : slices) ASSERT_TRUE(path_attn_fwd(core::sub_params(fp, pr, sl)).ok());
  EXPECT_TRUE(same(f.o, full.o) && same(f.lse, full.lse)) << spec.name();

  BwdOut b = run_bwd(c, full, dout, Backend::cpu);  // outputs allocated as the whole call's, then poisoned again
  for (HostTensor* t : {&b.dq, &b.dk, &b.dv, &b.dw, &b.dbeta, &b.dg})
    if (t->present()) t->poison();
  PathBwdParams bp = bwd_params_for(c.fwd_params(full.o, &full.lse));
  bp.do_ = dout.view();
  bp.dq = b.dq.view(), bp.dk = b.dk.view(), bp.dv = b.dv.view();
  if (spec.path) bp.dw = b.dw.view(), bp.dbeta = b.dbeta.view();
  if (spec.gate) bp.dg = b.dg.view();
  bp.backend = Backend::cpu;
  for (const Slice& sl : slices) ASSERT_TRUE(path_attn_bwd(core::sub_params(bp, pr, sl)).ok());
  EXPECT_TRUE(same(b.dq, fullb.dq) && same(b.dk, fullb.dk) && same(b.dv, fullb.dv)) << spec.name();
  EXPECT_TRUE(same(b.dw, fullb.dw) && same(b.dbeta, fullb.dbeta) && same(b.dg, fullb.dg)) << spec.name();
}

TEST(Slicing, SlicesReproduceTheCallOnTheCpu) {
  CaseSpec s;
  s.B = 3;
  s.T = 37;
  s.HQ = 6;
  s.H = 3;
  s.K = 16;
  s.V = 8;
  s.gate = true;
  s.dtype = DType::f32;
  s.seed = 5;
  check_slices_reproduce(s, true);
  s.seqlens = {0, 20, 17};  // varlen (B = 1): head slices only
  s.B = 1;
  s.seed = 6;
  check_slices_reproduce(s, false);
}

}  // namespace
}  // namespace pathattn::test
