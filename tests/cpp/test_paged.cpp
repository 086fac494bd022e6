// tests/cpp/test_paged.cpp: the paged decode cache (include/pathattn/paged.h) on the host backends against the
// dense decode cache (fp64, oracle): fp32 and fp16 key pages over pending sizes, page sizes, GQA, gate and beta;
// chunked decode against single steps and the forward; free slots and inserts; paging invisible in the output;
// bad input named, with nothing written. Tolerances: docs/numerics.md, "Paged decode cache".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>

#include "check/harness.h"

namespace pathattn::test {
namespace {

// ------------------------------------------------------------------------------------------------------
// Helpers: cases cut from one long sequence per slot, the dense f64 reference cache, the paged cache.

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  if (!a.present() || !b.present()) return a.present() == b.present();
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.view().data, b.view().data, size_t(a.numel() * dtype_size(a.dtype()))) == 0;
}
bool all_nan(const HostTensor& x) {
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isnan(x.get(i))) return false;
  return true;
}

// N slots: slot n has a prompt of prompt[n] tokens, then `steps` decoded tokens. `full`: every token (varlen,
// one sequence per slot), `pre`: the prompts (varlen), `dec`: the decode inputs [N, steps].
struct Scenario {
  Case full, pre, dec;
  std::vector<int64_t> prompt, start;
  int64_t steps = 0;
};

Scenario make_scenario(CaseSpec s, std::vector<int64_t> prompt, int64_t steps) {
  Scenario sc;
  sc.prompt = prompt;
  sc.steps = steps;
  const int64_t N = int64_t(prompt.size());
  s.B = 1;
  s.T = 0;
  s.seqlens.clear();
  for (int64_t p : prompt) s.seqlens.push_back(p + steps);
  sc.full = Case::make(s);
  std::vector<int64_t> pre_rows, dec_rows;
  int64_t st = 0;
  for (int64_t n = 0; n < N; ++n) {
    sc.start.push_back(st);
    for (int64_t t = 0; t < prompt[n]; ++t) pre_rows.push_back(st + t);
    st += prompt[n] + steps;
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t t = 0; t < steps; ++t) dec_rows.push_back(sc.start[n] + prompt[n] + t);
  sc.pre = sub_case(sc.full, pre_rows, 1, int64_t(pre_rows.size()), prompt);
  sc.dec = sub_case(sc.full, dec_rows, N, steps, {});
  return sc;
}

CaseSpec spec(int64_t HQ, int64_t H, int64_t K, int64_t V, bool gate, uint64_t seed, BetaMode bm = BetaMode::uniform02,
              DType dt = DType::f32, bool path = true) {
  CaseSpec s;
  s.HQ = HQ; s.H = H; s.K = K; s.V = V; s.gate = gate; s.seed = seed; s.beta = bm; s.dtype = dt; s.path = path;
  return s;
}

// Outputs [B, T, HQ, V] (dtype of v) and lse [B, T, HQ] (f32, f64 for f64 inputs), poisoned.
struct Outs {
  HostTensor o, lse;
  Outs(int64_t B, int64_t T, int64_t HQ, int64_t V, DType dt)
      : o(dt, {B, T, HQ, V}), lse(dt == DType::f64 ? DType::f64 : DType::f32, {B, T, HQ}) {
    o.poison();
    lse.poison();
  }
};

// The paged cache, owned. Pages start NaN; the block table gives slot n pages perm[n * max_pages + i] of a pool
// of N * max_pages + spare pages (perm: identity, or shuffled by `shuffle_seed`); every slot starts free.
struct Paged {
  HostTensor k_pages, v_pages, g_pages, block_table, lengths, flushed, pend_k, pend_w, pend_beta;
  int64_t page = 1, max_pages = 0;
  static Paged make(const CaseSpec& s, int64_t N, int64_t page, int64_t max_pages, int64_t S, DType kdt,
                    uint64_t shuffle_seed = 0, int64_t spare = 0) {
    Paged c;
    c.page = page;
    c.max_pages = max_pages;
    const int64_t P = N * max_pages + spare;
    c.k_pages = HostTensor(kdt, {P, page, s.H, s.K});
    c.v_pages = HostTensor(s.dtype, {P, page, s.H, s.V});
    if (s.gate) c.g_pages = HostTensor(DType::f64, {P, page, s.HQ});
    c.block_table = HostTensor(DType::i32, {N, max_pages});
    c.lengths = HostTensor(DType::i32, {N});
    c.flushed = HostTensor(DType::i32, {N});
    c.pend_k = HostTensor(DType::f32, {N, S, s.H, s.K});
    if (s.path) {
      c.pend_w = HostTensor(DType::f32, {N, S, s.H, s.K});
      c.pend_beta = HostTensor(DType::f32, {N, S, s.H});
    }
    for (HostTensor* t : {&c.k_pages, &c.v_pages, &c.g_pages, &c.pend_k, &c.pend_w, &c.pend_beta})
      if (t->present()) t->poison();
    std::vector<int64_t> perm(static_cast<size_t>(P));
    std::iota(perm.begin(), perm.end(), 0);
    if (shuffle_seed) std::shuffle(perm.begin(), perm.end(), std::mt19937_64(shuffle_seed));
    for (int64_t i = 0; i < N * max_pages; ++i) c.block_table.set(i, double(perm[size_t(i)]));
    for (int64_t n = 0; n < N; ++n) {
      c.lengths.set(n, -1);
      c.flushed.set(n, 0);
    }
    return c;
  }
  PagedCache view() const {
    PagedCache v;
    v.k_pages = k_pages.view();
    v.v_pages = v_pages.view();
    if (g_pages.present()) v.g_pages = g_pages.view();
    v.block_table = block_table.view();
    v.lengths = lengths.view();
    v.flushed = flushed.view();
    v.pend_k = pend_k.view();
    if (pend_w.present()) {
      v.pend_w = pend_w.view();
      v.pend_beta = pend_beta.view();
    }
    return v;
  }
  std::vector<const HostTensor*> all() const {
    return {&k_pages, &v_pages, &g_pages, &block_table, &lengths, &flushed, &pend_k, &pend_w, &pend_beta};
  }
  Paged clone() const {
    Paged c = *this;
    HostTensor* dst[] = {&c.k_pages, &c.v_pages, &c.g_pages, &c.block_table, &c.lengths, &c.flushed, &c.pend_k,
                         &c.pend_w, &c.pend_beta};
    const auto src = all();
    for (size_t i = 0; i < src.size(); ++i) *dst[i] = src[i]->clone();
    return c;
  }
  bool guards_intact() const {
    for (const HostTensor* t : all())
      if (!t->guards_intact()) return false;
    return true;
  }
  int len(int64_t n) const { return int(lengths.get(n)); }
  int fl(int64_t n) const { return int(flushed.get(n)); }
};

bool same_paged(const Paged& a, const Paged& b) {
  const auto x = a.all(), y = b.all();
  for (size_t i = 0; i < x.size(); ++i)
    if (!same_bytes(*x[i], *y[i])) return false;
  return true;
}

Status paged_prefill(const Case& c, const Paged& pc, const Outs& out, Backend be, const HostTensor* slots = nullptr,
                     int num_threads = 0) {
  PathPagedPrefillParams p;
  p.fwd = c.fwd_params(out.o, &out.lse);
  p.fwd.backend = be;
  p.fwd.num_threads = num_threads;
  p.cache = pc.view();
  if (slots) p.slots = slots->view();
  return path_attn_paged_prefill(p);
}

// Decode params for tokens [t0, t0 + T) of `d` ([N, steps, ...] inputs).
PathPagedDecodeParams paged_params(const Case& d, int64_t t0, int64_t T, const Paged& pc, const Outs& out, Backend be) {
  PathPagedDecodeParams p;
  p.q = slice_t(d.q.view(), t0, T);
  p.k = slice_t(d.k.view(), t0, T);
  p.v = slice_t(d.v.view(), t0, T);
  if (d.spec.path) {
    p.w = slice_t(d.w.view(), t0, T);
    p.beta = slice_t(d.beta.view(), t0, T);
  }
  if (d.spec.gate) p.g = slice_t(d.g.view(), t0, T);
  p.gate_scale = d.spec.gate_scale;
  p.o = out.o.view();
  p.lse = out.lse.view();
  p.cache = pc.view();
  p.backend = be;
  return p;
}

// The dense reference: f64 DecodeCache on the oracle, prefill then one decode call per step. Returns the prefill
// outputs and each step's [N, 1, HQ, V] / [N, 1, HQ] outputs. One thread: these cases are small, and teams of
// OpenMP threads per step only contend with the other tests that ctest runs beside them.
struct DenseRun {
  std::vector<double> pre_o, pre_lse;
  std::vector<std::vector<double>> o, lse;
};
DenseRun dense_reference(const Scenario& sc) {
  const CaseSpec& s = sc.full.spec;
  const int64_t N = int64_t(sc.prompt.size());
  const int64_t C = *std::max_element(sc.prompt.begin(), sc.prompt.end()) + sc.steps;
  const Case pre = to_f64(sc.pre), dec = to_f64(sc.dec);
  HostTensor kc(DType::f64, {N, s.H, C, s.K}), vc(DType::f64, {N, s.H, C, s.V}), len(DType::i64, {N}), gc;
  if (s.gate) gc = HostTensor(DType::f64, {N, s.HQ, C});
  DecodeCache cache;
  cache.kc = kc.view();
  cache.vc = vc.view();
  if (s.gate) cache.gc = gc.view();
  cache.lengths = len.view();
  DenseRun r;
  Outs po(1, pre.spec.T, s.HQ, s.V, DType::f64);
  PathPrefillParams pp;
  pp.fwd = pre.fwd_params(po.o, &po.lse);
  pp.fwd.backend = Backend::oracle;
  pp.fwd.num_threads = 1;
  pp.cache = cache;
  EXPECT_TRUE(path_attn_prefill(pp).ok());
  r.pre_o = po.o.to_f64();
  r.pre_lse = po.lse.to_f64();
  for (int64_t t = 0; t < sc.steps; ++t) {
    Outs out(N, 1, s.HQ, s.V, DType::f64);
    PathDecodeParams p;
    p.q = slice_t(dec.q.view(), t, 1);
    p.k = slice_t(dec.k.view(), t, 1);
    p.v = slice_t(dec.v.view(), t, 1);
    if (s.path) {
      p.w = slice_t(dec.w.view(), t, 1);
      p.beta = slice_t(dec.beta.view(), t, 1);
    }
    if (s.gate) p.g = slice_t(dec.g.view(), t, 1);
    p.gate_scale = s.gate_scale;
    p.o = out.o.view();
    p.lse = out.lse.view();
    p.cache = cache;
    p.backend = Backend::oracle;
    p.num_threads = 1;
    const Status st = path_attn_decode(p);
    EXPECT_TRUE(st.ok()) << st.message();
    r.o.push_back(out.o.to_f64());
    r.lse.push_back(out.lse.to_f64());
  }
  return r;
}

// max|a - r| / max|r| over n values at a[ia..], r[ir..].
double row_err(const std::vector<double>& a, int64_t ia, const std::vector<double>& r, int64_t ir, int64_t n) {
  return max_rel(std::vector<double>(a.begin() + ia, a.begin() + ia + n),
                 std::vector<double>(r.begin() + ir, r.begin() + ir + n));
}

// A paged run of a scenario: prefill, then the steps in calls of `chunk` tokens; errors against the dense run.
struct PagedRun {
  Status status;
  double pre_err = 0, o_err = 0, lse_err = 0;
  bool finite = true, guards = true;
  std::vector<HostTensor> o, lse;  // per call
};
PagedRun run_paged(const Scenario& sc, Paged& pc, Backend be, const DenseRun* ref, int64_t chunk = 1,
                   int num_threads = 0) {
  const CaseSpec& s = sc.full.spec;
  const int64_t N = int64_t(sc.prompt.size()), HQ = s.HQ, V = s.V;
  PagedRun r;
  Outs po(1, sc.pre.spec.T, HQ, V, s.dtype);
  r.status = paged_prefill(sc.pre, pc, po, be, nullptr, num_threads);
  if (!r.status.ok()) return r;
  if (ref) r.pre_err = max_rel(po.o.to_f64(), ref->pre_o);
  for (int64_t t0 = 0; t0 < sc.steps; t0 += chunk) {
    const int64_t T = std::min(chunk, sc.steps - t0);
    Outs out(N, T, HQ, V, s.dtype);
    PathPagedDecodeParams p = paged_params(sc.dec, t0, T, pc, out, be);
    p.num_threads = num_threads;
    r.status = path_attn_paged_decode(p);
    if (!r.status.ok()) return r;
    const std::vector<double> o = out.o.to_f64(), l = out.lse.to_f64();
    r.finite = r.finite && all_finite(o) && all_finite(l);
    r.guards = r.guards && out.o.guards_intact() && out.lse.guards_intact();
    for (int64_t t = 0; t < T && ref; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t i = (n * T + t);
        r.o_err = std::max(r.o_err, row_err(o, i * HQ * V, ref->o[size_t(t0 + t)], n * HQ * V, HQ * V));
        r.lse_err = std::max(r.lse_err, row_err(l, i * HQ, ref->lse[size_t(t0 + t)], n * HQ, HQ));
      }
    r.o.push_back(out.o);
    r.lse.push_back(out.lse);
  }
  r.guards = r.guards && pc.guards_intact();
  return r;
}

// The flush point a slot reaches after `steps` single steps from a prefill (m = L = prompt).
int64_t expected_flushed(int64_t prompt, int64_t steps, int64_t S, bool path) {
  int64_t L = prompt, m = prompt;
  for (int64_t t = 0; t < steps; ++t) {
    if (path && L - m == S) m = L;
    ++L;
    if (!path) m = L;
  }
  return m;
}

// ------------------------------------------------------------------------------------------------------
// (a), (b): paged decode equals the dense f64 decode, over pending sizes, page sizes, heads, gate, beta, K.

struct SweepSpec {
  int64_t K, HQ, H, S, page;
  bool gate, path;
  BetaMode beta;
  DType kdt;
};
void PrintTo(const SweepSpec& d, std::ostream* os) {
  *os << "K" << d.K << "_HQ" << d.HQ << "_H" << d.H << "_S" << d.S << "_page" << d.page << (d.gate ? "_gate" : "")
      << (d.path ? "" : "_plain") << (d.beta == BetaMode::two ? "_beta2" : "_betaU02") << "_" << dtype_name(d.kdt);
}

// Bounds (docs/numerics.md, "Paged decode cache"), max over steps and slots of max_rel per output row against
// the dense fp64 decode of the same (fp32-valued) inputs.
// fp32 pages. Every step is fp32 math on fp32 data: the query carried back across <= S factors (each a K-term
// dot and an axpy, ~ sqrt(K) u relative to ||q||), the flush's P = H_{L-1} ... H_m built over S factors
// (entries off by ~ sqrt(S K) u at random, S K u at worst), one rounding of every key per flush, and the softmax
// and value sums over <= 200 terms (~ sqrt(n) u). A logit moves by scale q . dk <= ||dk||, the output by that
// times the spread of v. With u = 6e-8, K, S <= 64: ~ 64 u = 4e-6 in the random walk, the same order as the
// dense fp32 decode's. Measured over the sweep (98 cases a key dtype): decode o <= 2.0e-6, lse <= 4.1e-7;
// T = 7 chunk against the forward 3.3e-7. Asserted: 2e-5, ~10x the largest.
// fp16 pages. Each flush (and the prefill) rounds every key to fp16: |dk_e| <= 2^-11 |k_e| (u16 = 4.9e-4), so a
// logit moves by ~ scale u16 sqrt(sum_e q_e^2 k_e^2) ~ u16 at random signs (u16 sqrt(K) at worst); the
// roundings of successive flushes add (<= 7 here: S = 1 over 7 steps), and o moves by the logit error times the
// spread of v over max|o| (a factor of 2 to 3): predicted 1e-3 to 4e-3. Measured o <= 1.2e-3, lse <= 8.1e-4.
// Asserted: 1e-2.
// Prefill outputs: the forward's own fp32 error (oracle or the fp32 fast path; docs/numerics.md, the fast
// path's fp32 row): measured <= 7.5e-7, asserted 1e-5.
constexpr double kPagedF32Bound = 2e-5;
constexpr double kPagedF16Bound = 1e-2;
constexpr double kPrefillBound = 1e-5;

std::vector<SweepSpec> sweep(DType kdt) {
  std::vector<SweepSpec> out;
  for (int64_t K : {16, 64})
    for (int heads : {0, 1})
      for (bool gate : {false, true})
        for (BetaMode bm : {BetaMode::uniform02, BetaMode::two})
          for (int64_t S : {1, 3, 64})
            for (int64_t page : {1, 16}) out.push_back({K, heads ? 2 : 4, 2, S, page, gate, true, bm, kdt});
  for (int64_t page : {1, 16}) out.push_back({16, 4, 2, 3, page, true, false, BetaMode::uniform02, kdt});  // plain
  return out;
}

class PagedEqualsDense : public ::testing::TestWithParam<SweepSpec> {};

TEST_P(PagedEqualsDense, EveryStep) {
  const SweepSpec d = GetParam();
  const uint64_t seed = 1000 + uint64_t(d.K * 7 + d.HQ * 3 + d.S * 11 + d.page * 13 + d.gate * 17 + int(d.beta) * 19);
  CaseSpec s = spec(d.HQ, d.H, d.K, d.K, d.gate, seed, d.beta, DType::f32, d.path);
  // Prompts of awkward lengths, one empty slot; 2S + 5 steps cross at least two flushes.
  const std::vector<int64_t> lens = {1, 7, 63, 65};
  const std::vector<int64_t> prompt = {lens[seed % 4], 0, lens[(seed + 1) % 4]};
  const int64_t steps = 2 * d.S + 5;
  const Scenario sc = make_scenario(s, prompt, steps);
  const DenseRun ref = dense_reference(sc);
  const int64_t C = *std::max_element(prompt.begin(), prompt.end()) + steps;
  Paged pc = Paged::make(s, 3, d.page, (C + d.page - 1) / d.page, d.S, d.kdt, seed, 3);
  const Backend be = seed % 2 ? Backend::cpu : Backend::oracle;
  const PagedRun r = run_paged(sc, pc, be, &ref, 1, /*num_threads=*/1);
  ASSERT_TRUE(r.status.ok()) << r.status.message();
  EXPECT_TRUE(r.finite && r.guards);
  for (int64_t n = 0; n < 3; ++n) {
    EXPECT_EQ(pc.len(n), prompt[n] + steps);
    EXPECT_EQ(pc.fl(n), expected_flushed(prompt[n], steps, d.S, d.path)) << "slot " << n;
  }
  const double bound = d.kdt == DType::f16 ? kPagedF16Bound : kPagedF32Bound;
  EXPECT_LE(r.pre_err, kPrefillBound);
  EXPECT_LE(r.o_err, bound);
  EXPECT_LE(r.lse_err, bound);
  std::cout << "[ paged ] " << ::testing::PrintToString(d) << ": prefill o " << r.pre_err << ", decode o " << r.o_err
            << ", lse " << r.lse_err << "\n";
}

INSTANTIATE_TEST_SUITE_P(F32Pages, PagedEqualsDense, ::testing::ValuesIn(sweep(DType::f32)),
                         [](const auto& info) { return "case" + std::to_string(info.index); });
INSTANTIATE_TEST_SUITE_P(F16Pages, PagedEqualsDense, ::testing::ValuesIn(sweep(DType::f16)),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

// ------------------------------------------------------------------------------------------------------
// (c) Chunked decode: T = 7 in one call equals 7 single calls bitwise, and the forward over every token.

TEST(PagedChunked, SevenTokensEqualSevenStepsAndTheForward) {
  for (bool gate : {false, true}) {
    SCOPED_TRACE(gate ? "gate" : "no gate");
    CaseSpec s = spec(4, 2, 16, 16, gate, 300 + gate, BetaMode::uniform02);
    // 2 single steps leave 2 tokens pending (S = 3), then the chunk of 7 flushes inside itself.
    const Scenario sc = make_scenario(s, {7, 1, 0, 65}, 9);
    Paged a = Paged::make(s, 4, 4, 19, 3, DType::f32, 5), b = a.clone();
    Outs pa(1, sc.pre.spec.T, 4, 16, DType::f32), pb(1, sc.pre.spec.T, 4, 16, DType::f32);
    ASSERT_TRUE(paged_prefill(sc.pre, a, pa, Backend::oracle).ok());
    ASSERT_TRUE(paged_prefill(sc.pre, b, pb, Backend::oracle).ok());
    std::vector<Outs> singles;
    for (int64_t t = 0; t < 9; ++t) {
      singles.emplace_back(4, 1, 4, 16, DType::f32);
      ASSERT_TRUE(path_attn_paged_decode(paged_params(sc.dec, t, 1, a, singles.back(), Backend::cpu)).ok());
    }
    Outs first(4, 1, 4, 16, DType::f32), chunk(4, 7, 4, 16, DType::f32);
    ASSERT_TRUE(path_attn_paged_decode(paged_params(sc.dec, 0, 1, b, first, Backend::cpu)).ok());
    {
      Outs second(4, 1, 4, 16, DType::f32);
      ASSERT_TRUE(path_attn_paged_decode(paged_params(sc.dec, 1, 1, b, second, Backend::cpu)).ok());
      EXPECT_TRUE(same_bytes(second.o, singles[1].o));
    }
    ASSERT_TRUE(path_attn_paged_decode(paged_params(sc.dec, 2, 7, b, chunk, Backend::cpu)).ok());
    EXPECT_TRUE(same_paged(a, b)) << "the cache after a chunk differs from the one after single steps";
    for (int64_t t = 0; t < 7; ++t)
      for (int64_t n = 0; n < 4; ++n)
        for (int64_t hq = 0; hq < 4; ++hq) {
          for (int64_t e = 0; e < 16; ++e)
            ASSERT_EQ(chunk.o.get(((n * 7 + t) * 4 + hq) * 16 + e), singles[size_t(2 + t)].o.get((n * 4 + hq) * 16 + e))
                << "slot " << n << " token " << t;
          ASSERT_EQ(chunk.lse.get((n * 7 + t) * 4 + hq), singles[size_t(2 + t)].lse.get(n * 4 + hq));
        }
    // Against one forward (fp64 oracle) over every token: the chunk's rows sit at positions prompt + 2 + t.
    const FwdOut ref = run_fwd(to_f64(sc.full), Backend::oracle);
    ASSERT_TRUE(ref.status.ok());
    const std::vector<double> ro = ref.o.to_f64(), o = chunk.o.to_f64();
    double err = 0;
    for (int64_t n = 0; n < 4; ++n)
      for (int64_t t = 0; t < 7; ++t) {
        const int64_t pos = sc.start[size_t(n)] + sc.prompt[size_t(n)] + 2 + t;
        err = std::max(err, row_err(o, (n * 7 + t) * 64, ro, pos * 64, 64));
      }
    std::cout << "[ paged chunk ] T = 7 against the forward: " << err << "\n";
    EXPECT_LE(err, kPagedF32Bound);
    EXPECT_EQ(b.len(3), 65 + 9);
    EXPECT_EQ(b.fl(3), expected_flushed(65, 9, 3, true));
  }
}

// ------------------------------------------------------------------------------------------------------
// (d) Insert and evict: a free slot is skipped; a prefill into one slot leaves the others bitwise unchanged.

TEST(PagedSlots, FreeSlotIsSkippedAndPrefillInsertsIntoOneSlot) {
  const CaseSpec s = spec(4, 2, 16, 8, true, 400);
  const Scenario sc = make_scenario(s, {5, 9, 1}, 8);
  Paged live = Paged::make(s, 3, 4, 5, 3, DType::f16, 11, 2);
  Outs po(1, sc.pre.spec.T, 4, 8, DType::f32);
  ASSERT_TRUE(paged_prefill(sc.pre, live, po, Backend::oracle).ok());
  for (int64_t t = 0; t < 2; ++t) {
    Outs o(3, 1, 4, 8, DType::f32);
    ASSERT_TRUE(path_attn_paged_decode(paged_params(sc.dec, t, 1, live, o, Backend::cpu)).ok());
  }
  Paged freed = live.clone();
  freed.lengths.set(1, -1);  // evict slot 1
  const Paged before = freed.clone();
  Outs ol(3, 2, 4, 8, DType::f32), of(3, 2, 4, 8, DType::f32);
  ASSERT_TRUE(path_attn_paged_decode(paged_params(sc.dec, 2, 2, live, ol, Backend::cpu)).ok());
  ASSERT_TRUE(path_attn_paged_decode(paged_params(sc.dec, 2, 2, freed, of, Backend::cpu)).ok());
  for (int64_t i = 0; i < of.o.numel(); ++i) {
    const int64_t n = i / (2 * 4 * 8);
    if (n == 1) ASSERT_EQ(of.o.get(i), 0.0) << i;
    else ASSERT_EQ(of.o.get(i), ol.o.get(i)) << "a live slot's output changed when slot 1 was freed: " << i;
  }
  for (int64_t i = 0; i < of.lse.numel(); ++i) {
    if (i / 8 == 1) ASSERT_EQ(of.lse.get(i), -INFINITY);
    else ASSERT_EQ(of.lse.get(i), ol.lse.get(i));
  }
  // Slot 1's pages (block table row 1), pending rows and metadata: untouched.
  EXPECT_EQ(freed.len(1), -1);
  EXPECT_EQ(freed.fl(1), before.fl(1));
  using Pair = std::pair<const HostTensor*, const HostTensor*>;
  auto slot_rows_equal = [&](const Paged& x, const Paged& y, int64_t n) {
    for (int64_t i = 0; i < x.max_pages; ++i) {
      const int64_t pg = int64_t(x.block_table.get(n * x.max_pages + i));
      for (const auto& [a, b] : {Pair{&x.k_pages, &y.k_pages}, Pair{&x.v_pages, &y.v_pages}, Pair{&x.g_pages, &y.g_pages}}) {
        const int64_t per = a->numel() / a->view().shape[0], bytes = per * dtype_size(a->dtype());
        if (std::memcmp(static_cast<char*>(a->view().data) + pg * bytes, static_cast<char*>(b->view().data) + pg * bytes,
                        size_t(bytes)) != 0)
          return false;
      }
    }
    for (const auto& [a, b] : {Pair{&x.pend_k, &y.pend_k}, Pair{&x.pend_w, &y.pend_w}, Pair{&x.pend_beta, &y.pend_beta}}) {
      const int64_t per = a->numel() / a->view().shape[0], bytes = per * dtype_size(a->dtype());
      if (std::memcmp(static_cast<char*>(a->view().data) + n * bytes, static_cast<char*>(b->view().data) + n * bytes,
                      size_t(bytes)) != 0)
        return false;
    }
    return x.len(n) == y.len(n) && x.fl(n) == y.fl(n);
  };
  EXPECT_TRUE(slot_rows_equal(freed, before, 1));
  EXPECT_EQ(freed.len(0), 5 + 4);
  // Insert: a new 13-token prompt into slot 1 (slots = [1]); slots 0 and 2 bitwise unchanged.
  const Scenario ins = make_scenario(spec(4, 2, 16, 8, true, 401), {13}, 4);
  const Paged pre_insert = freed.clone();
  HostTensor slots(DType::i32, {1});
  slots.set(0, 1);
  Outs oi(1, 13, 4, 8, DType::f32);
  ASSERT_TRUE(paged_prefill(ins.pre, freed, oi, Backend::cpu, &slots).ok());
  EXPECT_TRUE(slot_rows_equal(freed, pre_insert, 0));
  EXPECT_TRUE(slot_rows_equal(freed, pre_insert, 2));
  EXPECT_EQ(freed.len(1), 13);
  EXPECT_EQ(freed.fl(1), 13);
  // The inserted request decodes like the dense reference of its own sequence.
  const DenseRun ref = dense_reference(ins);
  EXPECT_LE(max_rel(oi.o.to_f64(), ref.pre_o), kPrefillBound);
  for (int64_t t = 0; t < 4; ++t) {
    // Slot 1 gets the new request's token; the other slots continue their own.
    Case step = sc.dec;
    step.q = sc.dec.q.clone(); step.k = sc.dec.k.clone(); step.v = sc.dec.v.clone();
    step.w = sc.dec.w.clone(); step.beta = sc.dec.beta.clone(); step.g = sc.dec.g.clone();
    const int64_t pos = 4 + t;
    using Mut = std::pair<HostTensor*, const HostTensor*>;
    for (auto [dst, src] : {Mut{&step.q, &ins.dec.q}, Mut{&step.k, &ins.dec.k}, Mut{&step.v, &ins.dec.v},
                            Mut{&step.w, &ins.dec.w}, Mut{&step.beta, &ins.dec.beta}, Mut{&step.g, &ins.dec.g}}) {
      const int64_t inner = dst->view().stride[1];
      for (int64_t e = 0; e < inner; ++e) dst->set((1 * sc.steps + pos) * inner + e, src->get(t * inner + e));
    }
    Outs o(3, 1, 4, 8, DType::f32);
    ASSERT_TRUE(path_attn_paged_decode(paged_params(step, pos, 1, freed, o, Backend::cpu)).ok());
    EXPECT_LE(row_err(o.o.to_f64(), 1 * 32, ref.o[size_t(t)], 0, 32), kPagedF16Bound) << "step " << t;
  }
  EXPECT_TRUE(freed.guards_intact());
}

// ------------------------------------------------------------------------------------------------------
// (e) Paging is invisible: a shuffled table of 4-row pages and a contiguous one of 64-row pages give bitwise
// equal outputs; so does any thread count.

TEST(PagedLayout, PageSizeAndOrderChangeNothing) {
  for (DType kdt : {DType::f32, DType::f16}) {
    const CaseSpec s = spec(4, 2, 64, 32, true, 500, BetaMode::two);
    const Scenario sc = make_scenario(s, {63, 7, 1}, 20);
    Paged a = Paged::make(s, 3, 4, 21, 8, kdt, 77, 9);
    Paged b = Paged::make(s, 3, 64, 2, 8, kdt, 0, 0);
    const PagedRun ra = run_paged(sc, a, Backend::cpu, nullptr, 1, 1);
    const PagedRun rb = run_paged(sc, b, Backend::oracle, nullptr, 1, 3);
    ASSERT_TRUE(ra.status.ok() && rb.status.ok()) << ra.status.message() << rb.status.message();
    ASSERT_EQ(ra.o.size(), rb.o.size());
    for (size_t i = 0; i < ra.o.size(); ++i) {
      EXPECT_TRUE(same_bytes(ra.o[i], rb.o[i])) << "step " << i;
      EXPECT_TRUE(same_bytes(ra.lse[i], rb.lse[i])) << "step " << i;
    }
    EXPECT_TRUE(ra.finite && ra.guards && rb.guards);
  }
}

// ------------------------------------------------------------------------------------------------------
// (f) Bad input: each a named invalid_argument with nothing written (outputs poisoned before, still NaN).

class PagedBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    s = spec(4, 2, 16, 8, true, 600);
    sc = make_scenario(s, {5, 0, 3}, 4);
    cache = Paged::make(s, 3, 4, 3, 2, DType::f16, 9, 2);  // capacity 12, pool of 11 pages
    Outs po(1, 8, 4, 8, DType::f32);
    ASSERT_TRUE(paged_prefill(sc.pre, cache, po, Backend::oracle).ok());
    Outs o(3, 1, 4, 8, DType::f32);
    ASSERT_TRUE(path_attn_paged_decode(paged_params(sc.dec, 0, 1, cache, o, Backend::oracle)).ok());
  }
  PathPagedDecodeParams base(const Paged& c, const Outs& out, int64_t T = 1) {
    return paged_params(sc.dec, 1, T, c, out, Backend::oracle);
  }
  void expect_rejected(const PathPagedDecodeParams& p, const Paged& c, const Outs& out, const char* arg,
                       Status::Code code = Status::Code::invalid_argument) {
    const Paged before = c.clone();
    const Status st = path_attn_paged_decode(p);
    EXPECT_EQ(int(st.code()), int(code)) << arg << ": " << st.message();
    EXPECT_NE(st.message().find(arg), std::string::npos) << "message does not name " << arg << ": " << st.message();
    EXPECT_TRUE(same_paged(before, c)) << arg << ": the cache was modified";
    EXPECT_TRUE(all_nan(out.o) && all_nan(out.lse)) << arg << ": an output was written";
    EXPECT_TRUE(out.o.guards_intact() && c.guards_intact());
  }
  CaseSpec s;
  Scenario sc;
  Paged cache;
};

TEST_F(PagedBadInput, MetadataNamed) {
  Outs out(3, 1, 4, 8, DType::f32);
  {
    Paged c = cache.clone();
    Outs o2(3, 1, 4, 8, DType::f32);
    ASSERT_TRUE(path_attn_paged_decode(base(c, o2)).ok()) << "the well-formed call must succeed";
  }
  Paged c = cache.clone();
  c.block_table.set(0 * 3 + 1, 900);  // slot 0 (6 tokens, page 4): page 1 is used
  expect_rejected(base(c, out), c, out, "cache.block_table");
  c = cache.clone();
  c.block_table.set(2 * 3 + 0, -1);
  expect_rejected(base(c, out), c, out, "cache.block_table");
  c = cache.clone();
  c.lengths.set(0, 12);  // capacity 12: no room for one more
  c.flushed.set(0, 12);
  expect_rejected(base(c, out), c, out, "cache.lengths");
  c = cache.clone();
  c.lengths.set(0, 10);  // T = 3 tokens on 10: beyond 12
  c.flushed.set(0, 10);
  Outs out3(3, 3, 4, 8, DType::f32);
  expect_rejected(base(c, out3, 3), c, out3, "cache.lengths");
  c = cache.clone();
  c.lengths.set(1, -2);
  expect_rejected(base(c, out), c, out, "cache.lengths");
  c = cache.clone();
  c.flushed.set(0, c.len(0) + 1);  // flushed > length
  expect_rejected(base(c, out), c, out, "cache.flushed");
  c = cache.clone();
  c.flushed.set(0, c.len(0) - 3);  // 3 pending, S = 2
  expect_rejected(base(c, out), c, out, "cache.flushed");
}

TEST_F(PagedBadInput, ViewsNamed) {
  Outs out(3, 1, 4, 8, DType::f32);
  Paged c = cache.clone();
  PathPagedDecodeParams p = base(c, out);
  p.cache.g_pages = TensorView();  // g given, no gate pages
  expect_rejected(p, c, out, "cache.g_pages");
  p = base(c, out);
  p.g = TensorView();  // gate pages, no g
  expect_rejected(p, c, out, "cache.g_pages");
  p = base(c, out);
  p.cache.k_pages.shape[2] = 1;  // heads
  expect_rejected(p, c, out, "cache.k_pages");
  p = base(c, out);
  p.cache.k_pages.dtype = DType::bf16;
  expect_rejected(p, c, out, "cache.k_pages");
  p = base(c, out);
  p.cache.v_pages.dtype = DType::f16;  // v is f32
  expect_rejected(p, c, out, "cache.v_pages");
  p = base(c, out);
  p.cache.v_pages.shape[3] = 16;
  expect_rejected(p, c, out, "cache.v_pages");
  p = base(c, out);
  p.cache.g_pages.dtype = DType::f32;
  expect_rejected(p, c, out, "cache.g_pages");
  p = base(c, out);
  p.cache.lengths.dtype = DType::i64;
  expect_rejected(p, c, out, "cache.lengths");
  p = base(c, out);
  p.cache.flushed.shape[0] = 2;
  expect_rejected(p, c, out, "cache.flushed");
  p = base(c, out);
  p.cache.block_table.shape[0] = 2;  // 3 slots of inputs
  expect_rejected(p, c, out, "cache.block_table");
  p = base(c, out);
  p.cache.pend_k.shape[1] = kPagedMaxPending + 1;
  expect_rejected(p, c, out, "cache.pend_k");
  p = base(c, out);
  p.cache.pend_k.shape[2] = 4;
  expect_rejected(p, c, out, "cache.pend_k");
  p = base(c, out);
  p.cache.pend_w = TensorView();
  expect_rejected(p, c, out, "cache.pend_w");
  p = base(c, out);
  p.cache.pend_beta.dtype = DType::f16;
  expect_rejected(p, c, out, "cache.pend_beta");
  p = base(c, out);
  p.w = TensorView();  // plain attention on a cache with pending factors
  p.beta = TensorView();
  expect_rejected(p, c, out, "cache.pend_w");
  p = base(c, out);
  p.k.shape[3] = 24;
  expect_rejected(p, c, out, "k:");
  p = base(c, out);
  p.o.dtype = DType::f16;
  expect_rejected(p, c, out, "o:");
  p = base(c, out);
  p.cache.k_pages.device = Device::cuda;
  expect_rejected(p, c, out, "cache.k_pages");
  // fp64 inputs: unsupported on the paged cache, naming q.
  const Case d64 = to_f64(sc.dec);
  Outs o64(3, 1, 4, 8, DType::f64);
  p = paged_params(d64, 1, 1, c, o64, Backend::oracle);
  expect_rejected(p, c, o64, "q:", Status::Code::unsupported);
}

// validate = false: a slot whose metadata is out of range is skipped (NaN outputs, nothing of it written); the
// others step as usual.
TEST_F(PagedBadInput, UnvalidatedBadSlotIsSkipped) {
  Paged good = cache.clone(), c = cache.clone();
  c.block_table.set(2 * 3 + 0, 900);  // slot 2 (3 tokens)
  Outs og(3, 1, 4, 8, DType::f32), oc(3, 1, 4, 8, DType::f32);
  ASSERT_TRUE(path_attn_paged_decode(base(good, og)).ok());
  PathPagedDecodeParams p = base(c, oc);
  p.validate = false;
  const Paged before = c.clone();
  ASSERT_TRUE(path_attn_paged_decode(p).ok());
  for (int64_t i = 0; i < oc.o.numel(); ++i) {
    if (i / 32 == 2) ASSERT_TRUE(std::isnan(oc.o.get(i)));
    else ASSERT_EQ(oc.o.get(i), og.o.get(i));
  }
  EXPECT_EQ(c.len(2), before.len(2));
  EXPECT_EQ(c.fl(2), before.fl(2));
  EXPECT_EQ(c.len(0), good.len(0));
}

TEST_F(PagedBadInput, PrefillNamed) {
  const Scenario more = make_scenario(s, {4, 13}, 0);  // sequence 1 beyond the capacity of 12
  auto check = [&](const Case& c, const Paged& pc, const HostTensor* slots, const char* arg) {
    Outs out(1, c.spec.T, 4, 8, DType::f32);
    const Paged before = pc.clone();
    const Status st = paged_prefill(c, pc, out, Backend::oracle, slots);
    EXPECT_EQ(st.code(), Status::Code::invalid_argument) << arg << ": " << st.message();
    EXPECT_NE(st.message().find(arg), std::string::npos) << "message does not name " << arg << ": " << st.message();
    EXPECT_TRUE(same_paged(before, pc)) << arg;
    EXPECT_TRUE(all_nan(out.o)) << arg << ": the forward ran";
  };
  check(more.pre, cache, nullptr, "cache.block_table");
  const Scenario two = make_scenario(s, {4, 2}, 0);
  HostTensor slots(DType::i32, {2});
  slots.set(0, 2);
  slots.set(1, 3);
  check(two.pre, cache, &slots, "slots");
  slots.set(1, 2);
  check(two.pre, cache, &slots, "slots");
  slots.set(1, 0);
  Paged c = cache.clone();
  c.block_table.set(0, 77);
  check(two.pre, c, &slots, "cache.block_table");
  const Scenario four = make_scenario(s, {1, 1, 1, 1}, 0);  // 4 sequences, 3 slots
  check(four.pre, cache, nullptr, "cache.block_table");
  // A well-formed prefill into slots 2 and 0.
  Outs out(1, 6, 4, 8, DType::f32);
  c = cache.clone();
  ASSERT_TRUE(paged_prefill(two.pre, c, out, Backend::oracle, &slots).ok());
  EXPECT_EQ(c.len(2), 4);
  EXPECT_EQ(c.len(0), 2);
  EXPECT_EQ(c.fl(0), 2);
  EXPECT_EQ(c.len(1), cache.len(1));
}

}  // namespace
}  // namespace pathattn::test
