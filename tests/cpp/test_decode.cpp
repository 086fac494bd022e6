// tests/cpp/test_decode.cpp: prefill and decode (docs/spec.md, section 6) against the forward and the definition:
// prefill's cache against explicit K x K matrix products, prefill + N decode steps against one oracle forward
// over all tokens (fp64 and fp32), varlen slots, bad input, and the drift of a bf16-rounded key cache.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <numeric>

#include "core/convert.h"
#include "check/harness.h"

namespace pathattn::test {
namespace {

// ------------------------------------------------------------------------------------------------------
// Helpers.

DType float_type(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

// An owned decode cache: kc [N, H, C, K], vc [N, H, C, V], gc [N, HQ, C] (with a gate), lengths [N].
// Every tensor starts poisoned so that unwritten slots stay recognisable (NaN, lengths 0x7f7f...).
struct Cache {
  HostTensor kc, vc, gc, lengths;
  static Cache make(int64_t N, int64_t H, int64_t HQ, int64_t C, int64_t K, int64_t V, DType dt, bool gate) {
    Cache c;
    c.kc = HostTensor(dt, {N, H, C, K});
    c.vc = HostTensor(dt, {N, H, C, V});
    if (gate) c.gc = HostTensor(DType::f64, {N, HQ, C});  // always fp64 (decode.h)
    c.lengths = HostTensor(DType::i64, {N});
    c.kc.poison();
    c.vc.poison();
    if (gate) c.gc.poison();
    c.lengths.poison();
    return c;
  }
  DecodeCache view() const {
    DecodeCache d;
    d.kc = kc.view();
    d.vc = vc.view();
    if (gc.present()) d.gc = gc.view();
    d.lengths = lengths.view();
    return d;
  }
  int64_t len(int64_t n) const { return static_cast<const int64_t*>(lengths.view().data)[n]; }
  bool guards_intact() const {
    return kc.guards_intact() && vc.guards_intact() && gc.guards_intact() && lengths.guards_intact();
  }
  Cache clone() const { return Cache{kc.clone(), vc.clone(), gc.clone(), lengths.clone()}; }
};

// Bitwise equality of two tensors' bytes (NaN poison compares equal to itself).
bool same_bytes(const HostTensor& a, const HostTensor& b) {
  if (!a.present() || !b.present()) return a.present() == b.present();
  return a.numel() == b.numel() && a.dtype() == b.dtype() &&
         std::memcmp(a.view().data, b.view().data, a.numel() * dtype_size(a.dtype())) == 0;
}
bool same_cache(const Cache& a, const Cache& b) {
  return same_bytes(a.kc, b.kc) && same_bytes(a.vc, b.vc) && same_bytes(a.gc, b.gc) && same_bytes(a.lengths, b.lengths);
}
bool all_nan(const HostTensor& x) {
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isnan(x.get(i))) return false;
  return true;
}

// Outputs [B, T, HQ, V] (dtype of v) and lse [B, T, HQ], poisoned.
struct Outs {
  HostTensor o, lse;
  Outs(int64_t B, int64_t T, int64_t HQ, int64_t V, DType dt)
      : o(dt, {B, T, HQ, V}), lse(float_type(dt), {B, T, HQ}) {
    o.poison();
    lse.poison();
  }
};

Status prefill(const Case& c, const Cache& cache, const Outs& out, Backend be) {
  PathPrefillParams p;
  p.fwd = c.fwd_params(out.o, &out.lse);
  p.fwd.backend = be;
  p.cache = cache.view();
  return path_attn_prefill(p);
}

// Decode params for step t of `d` ([N, D, ...] inputs: slot n's token t is d[n, t]).
PathDecodeParams decode_params(const Case& d, int64_t t, const Cache& cache, const Outs& out, Backend be) {
  PathDecodeParams p;
  p.q = slice_t(d.q.view(), t, 1);
  p.k = slice_t(d.k.view(), t, 1);
  p.v = slice_t(d.v.view(), t, 1);
  if (d.spec.path) {
    p.w = slice_t(d.w.view(), t, 1);
    p.beta = slice_t(d.beta.view(), t, 1);
  }
  if (d.spec.gate) p.g = slice_t(d.g.view(), t, 1);
  p.gate_scale = d.spec.gate_scale;
  p.o = out.o.view();
  p.lse = out.lse.view();
  p.cache = cache.view();
  p.backend = be;
  return p;
}

// A prompt + decode scenario over N slots: slot n has a prompt of prompt[n] tokens followed by `steps`
// decoded tokens. `full` holds every token (B = 1; varlen with one sequence per slot when N > 1) and is what
// the reference forward runs on; `pre` is the prompts ([1, P] or varlen), `dec` the decode inputs [N, steps].
struct Scenario {
  Case full, pre, dec;
  std::vector<int64_t> prompt, start;  // start[n]: position of slot n's first token in `full`
  int64_t steps = 0;
};

Scenario make_scenario(CaseSpec s, std::vector<int64_t> prompt, int64_t steps) {
  Scenario sc;
  sc.prompt = prompt;
  sc.steps = steps;
  const int64_t N = int64_t(prompt.size());
  s.B = 1;
  s.seqlens.clear();
  if (N == 1) {
    s.T = prompt[0] + steps;
  } else {
    for (int64_t p : prompt) s.seqlens.push_back(p + steps);
  }
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
  const int64_t P = int64_t(pre_rows.size());
  sc.pre = sub_case(sc.full, pre_rows, 1, P, N == 1 ? std::vector<int64_t>{} : prompt);
  sc.dec = sub_case(sc.full, dec_rows, N, steps, {});
  return sc;
}

// max|a - r| / max|r| over the HQ * D values of one position (a at flat offset ia, r at ir).
double row_err(const std::vector<double>& a, int64_t ia, const std::vector<double>& r, int64_t ir, int64_t n) {
  return max_rel(std::vector<double>(a.begin() + ia, a.begin() + ia + n),
                 std::vector<double>(r.begin() + ir, r.begin() + ir + n));
}

struct RunResult {
  Status status;
  double prompt_err = 0;          // prefill o vs the reference (max over positions of max_rel)
  double o_err = 0, lse_err = 0;  // decode o / lse vs the reference (max over steps and slots)
  std::vector<double> step_err;   // per step: max over slots of the o error
  bool finite = true, guards = true;
  Cache cache;                    // the cache after the last step
};

// Prefill sc.pre, decode every step of sc.dec, compare each output row with `ref` (a forward of sc.full).
// `after_step` (optional) may modify the cache between steps (used to emulate a bf16 cache).
RunResult run_scenario(const Scenario& sc, const FwdOut& ref, Backend be,
                       const std::function<void(Cache&)>& after_step = {}) {
  const CaseSpec& s = sc.full.spec;
  const int64_t N = int64_t(sc.prompt.size()), HQ = s.HQ, V = s.V;
  const int64_t C = *std::max_element(sc.prompt.begin(), sc.prompt.end()) + sc.steps;
  RunResult r;
  r.cache = Cache::make(N, s.H, HQ, C, s.K, V, float_type(s.dtype), s.gate);
  const std::vector<double> ro = ref.o.to_f64(), rl = ref.lse.to_f64();
  Outs po(1, sc.pre.spec.T, HQ, V, s.dtype);
  r.status = prefill(sc.pre, r.cache, po, be);
  if (!r.status.ok()) return r;
  {
    const std::vector<double> o = po.o.to_f64();
    int64_t row = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t t = 0; t < sc.prompt[n]; ++t, ++row)
        r.prompt_err = std::max(r.prompt_err, row_err(o, row * HQ * V, ro, (sc.start[n] + t) * HQ * V, HQ * V));
    r.finite = r.finite && all_finite(o);
  }
  for (int64_t t = 0; t < sc.steps; ++t) {
    Outs out(N, 1, HQ, V, s.dtype);
    r.status = path_attn_decode(decode_params(sc.dec, t, r.cache, out, be));
    if (!r.status.ok()) return r;
    const std::vector<double> o = out.o.to_f64(), l = out.lse.to_f64();
    r.finite = r.finite && all_finite(o) && all_finite(l);
    r.guards = r.guards && out.o.guards_intact() && out.lse.guards_intact();
    double e_step = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t pos = sc.start[n] + sc.prompt[n] + t;
      e_step = std::max(e_step, row_err(o, n * HQ * V, ro, pos * HQ * V, HQ * V));
      r.lse_err = std::max(r.lse_err, row_err(l, n * HQ, rl, pos * HQ, HQ));
    }
    r.step_err.push_back(e_step);
    r.o_err = std::max(r.o_err, e_step);
    if (after_step) after_step(r.cache);
  }
  r.guards = r.guards && r.cache.guards_intact();
  return r;
}

CaseSpec spec(int64_t B, int64_t T, int64_t HQ, int64_t H, int64_t K, int64_t V, bool gate, uint64_t seed,
              std::vector<int64_t> seqlens = {}, BetaMode bm = BetaMode::uniform02, DType dt = DType::f64) {
  CaseSpec s;
  s.B = B; s.T = T; s.HQ = HQ; s.H = H; s.K = K; s.V = V; s.gate = gate; s.seed = seed;
  s.seqlens = std::move(seqlens);
  s.beta = bm;
  s.dtype = dt;
  return s;
}

// ------------------------------------------------------------------------------------------------------
// 1. Prefill equals the forward; its cache equals the definition (explicit K x K products, fp64).

// kc_j = H_{L-1} ... H_{j+1} k_j for sequence (b, t0, L), kv head h, by explicit K x K matrix products.
std::vector<double> explicit_keys(const Case& c, int64_t b, int64_t t0, int64_t L, int64_t h) {
  const CaseSpec& s = c.spec;
  const int64_t K = s.K;
  const auto k = c.k.to_f64();
  const auto w = s.path ? c.w.to_f64() : std::vector<double>();
  const auto be = s.path ? c.beta.to_f64() : std::vector<double>();
  std::vector<double> out(L * K, 0.0);
  for (int64_t j = 0; j < L; ++j) {
    std::vector<double> M(K * K, 0.0), Ht(K * K), P(K * K);
    for (int64_t e = 0; e < K; ++e) M[e * K + e] = 1.0;
    for (int64_t t = L - 1; t > j && s.path; --t) {  // M <- M H_t, t = L-1 .. j+1
      const int64_t r0 = (b * s.T + t0 + t) * s.H + h;
      for (int64_t x = 0; x < K; ++x)
        for (int64_t y = 0; y < K; ++y) Ht[x * K + y] = (x == y ? 1.0 : 0.0) - be[r0] * w[r0 * K + x] * w[r0 * K + y];
      for (int64_t x = 0; x < K; ++x)
        for (int64_t y = 0; y < K; ++y) {
          double acc = 0;
          for (int64_t z = 0; z < K; ++z) acc += M[x * K + z] * Ht[z * K + y];
          P[x * K + y] = acc;
        }
      M = P;
    }
    const double* kj = &k[((b * s.T + t0 + j) * s.H + h) * K];
    for (int64_t x = 0; x < K; ++x)
      for (int64_t y = 0; y < K; ++y) out[j * K + x] += M[x * K + y] * kj[y];
  }
  return out;
}

struct SeqRange { int64_t b, t0, len; };
std::vector<SeqRange> seq_ranges(const CaseSpec& s) {
  std::vector<SeqRange> r;
  if (s.seqlens.empty()) {
    for (int64_t b = 0; b < s.B; ++b) r.push_back({b, 0, s.T});
  } else {
    int64_t st = 0;
    for (int64_t l : s.seqlens) { r.push_back({0, st, l}); st += l; }
  }
  return r;
}

class PrefillDefinition : public ::testing::TestWithParam<CaseSpec> {};

TEST_P(PrefillDefinition, CacheMatchesExplicitProductsAndOutputMatchesForward) {
  const Case c = Case::make(GetParam());
  const CaseSpec& s = c.spec;
  const auto seqs = seq_ranges(s);
  const int64_t N = int64_t(seqs.size()), C = s.T + 2;
  for (Backend be : {Backend::oracle, Backend::cpu}) {
    SCOPED_TRACE(backend_name(be));
    FwdOut f = run_fwd(c, be);
    if (be == Backend::cpu && f.status.code() == Status::Code::unavailable) {
      GTEST_SKIP() << "cpu fast path not available yet: " << f.status.message();
    }
    ASSERT_TRUE(f.status.ok()) << f.status.message();
    Cache cache = Cache::make(N, s.H, s.HQ, C, s.K, s.V, DType::f64, s.gate);
    Outs out(s.B, s.T, s.HQ, s.V, s.dtype);
    Status st = prefill(c, cache, out, be);
    ASSERT_TRUE(st.ok()) << st.message();
    // Same backend, same call: bitwise equal outputs.
    EXPECT_TRUE(same_bytes(out.o, f.o)) << s.name();
    EXPECT_TRUE(same_bytes(out.lse, f.lse)) << s.name();
    EXPECT_TRUE(out.o.guards_intact() && out.lse.guards_intact() && cache.guards_intact());

    const auto kc = cache.kc.to_f64(), vc = cache.vc.to_f64();
    const auto gc = s.gate ? cache.gc.to_f64() : std::vector<double>();
    const auto v = c.v.to_f64();
    const auto g = s.gate ? c.g.to_f64() : std::vector<double>();
    for (int64_t n = 0; n < N; ++n) {
      const SeqRange& q = seqs[n];
      EXPECT_EQ(cache.len(n), q.len) << "slot " << n;
      for (int64_t h = 0; h < s.H; ++h) {
        const auto ref = explicit_keys(c, q.b, q.t0, q.len, h);
        const int64_t base = (n * s.H + h) * C;
        std::vector<double> got(kc.begin() + base * s.K, kc.begin() + (base + q.len) * s.K);
        EXPECT_LE(max_rel(got, ref), 1e-12) << "slot " << n << " head " << h << " " << s.name();
        for (int64_t j = 0; j < C; ++j) {
          for (int64_t e = 0; e < s.V; ++e) {
            const double x = vc[(base + j) * s.V + e];
            if (j < q.len) {
              ASSERT_EQ(x, v[((q.b * s.T + q.t0 + j) * s.H + h) * s.V + e]) << "vc slot " << n << " pos " << j;
            } else {
              ASSERT_TRUE(std::isnan(x)) << "vc written past the sequence: slot " << n << " pos " << j;
            }
          }
          if (j >= q.len) {
            ASSERT_TRUE(std::isnan(kc[(base + j) * s.K])) << "kc written past the sequence";
          }
        }
      }
      for (int64_t hq = 0; hq < s.HQ && s.gate; ++hq) {
        double G = 0;
        for (int64_t j = 0; j < C; ++j) {
          const double x = gc[(n * s.HQ + hq) * C + j];
          if (j < q.len) {
            G += g[(q.b * s.T + q.t0 + j) * s.HQ + hq];
            EXPECT_NEAR(x, G, 1e-12 * (1 + std::fabs(G))) << "gc slot " << n << " head " << hq << " pos " << j;
          } else {
            EXPECT_TRUE(std::isnan(x)) << "gc written past the sequence";
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Tiny, PrefillDefinition,
    ::testing::Values(spec(2, 7, 4, 2, 8, 16, true, 1), spec(1, 0, 2, 2, 8, 8, true, 2, {3, 0, 1, 6}),
                      spec(1, 9, 2, 1, 16, 8, false, 3, {}, BetaMode::two),
                      spec(1, 0, 3, 3, 8, 8, true, 4, {5, 4}, BetaMode::near2), spec(1, 1, 1, 1, 8, 8, false, 5)),
    [](const auto& info) { return "case" + std::to_string(info.index); });

// Plain attention (w and beta absent): the cache holds the raw keys.
TEST(Prefill, PlainAttentionCacheHoldsRawKeys) {
  CaseSpec s = spec(2, 5, 2, 1, 8, 8, false, 6);
  s.path = false;
  const Case c = Case::make(s);
  Cache cache = Cache::make(2, 1, 2, 5, 8, 8, DType::f64, false);
  Outs out(2, 5, 2, 8, DType::f64);
  ASSERT_TRUE(prefill(c, cache, out, Backend::oracle).ok());
  // H = 1: kc [N, 1, C, K] and k [B, T, 1, K] share one memory order when C == T.
  EXPECT_EQ(max_rel(cache.kc.to_f64(), c.k.to_f64()), 0.0);
  EXPECT_EQ(cache.len(0), 5);
}

// f32 prefill builds its suffix product in fp64 and rounds the keys once: each key is within a few fp32 ulps
// of the fp64 cache (the fp64 cache being checked against the definition above).
TEST(Prefill, Float32CacheIsRoundedFp64Cache) {
  const CaseSpec s = spec(1, 300, 4, 2, 32, 16, true, 7, {}, BetaMode::near2, DType::f32);
  const Case c = Case::make(s);
  const Case c64 = to_f64(c);
  Cache a = Cache::make(1, 2, 4, 300, 32, 16, DType::f32, true);
  Cache b = Cache::make(1, 2, 4, 300, 32, 16, DType::f64, true);
  Outs oa(1, 300, 4, 16, DType::f32), ob(1, 300, 4, 16, DType::f64);
  ASSERT_TRUE(prefill(c, a, oa, Backend::oracle).ok());
  ASSERT_TRUE(prefill(c64, b, ob, Backend::oracle).ok());
  const auto ka = a.kc.to_f64(), kb = b.kc.to_f64();
  double worst = 0;  // per element, relative to the key's largest entry
  for (int64_t r = 0; r < 2 * 300; ++r) {
    double mx = 0;
    for (int64_t e = 0; e < 32; ++e) mx = std::max(mx, std::fabs(kb[r * 32 + e]));
    for (int64_t e = 0; e < 32; ++e) worst = std::max(worst, std::fabs(ka[r * 32 + e] - kb[r * 32 + e]) / mx);
  }
  std::cout << "[ f32 prefill ] max key error vs fp64 cache (relative to the key's max entry): " << worst << "\n";
  EXPECT_LE(worst, 2 * 6e-8);  // one rounding to fp32 (u = 2^-24 = 6e-8) of an fp64-accurate value
  // gc is fp64 for every cache dtype (decode.h): the same cumsum of the same (fp32-representable) g values.
  EXPECT_LE(max_rel(a.gc.to_f64(), b.gc.to_f64()), 1e-14);
}

// ------------------------------------------------------------------------------------------------------
// 2. Decode equals forward: prefill P tokens, decode 2000 more one at a time, compare every decoded output
// with one oracle forward over all P + 2000 tokens.

struct DecodeSpec {
  CaseSpec s;
  int64_t prompt, steps;
};
void PrintTo(const DecodeSpec& d, std::ostream* os) { *os << d.s.name() << "_P" << d.prompt << "_N" << d.steps; }

class DecodeEqualsForward64 : public ::testing::TestWithParam<DecodeSpec> {};

TEST_P(DecodeEqualsForward64, Fp64) {
  const DecodeSpec d = GetParam();
  const Scenario sc = make_scenario(d.s, {d.prompt}, d.steps);
  const FwdOut ref = run_fwd(sc.full, Backend::oracle);
  ASSERT_TRUE(ref.status.ok()) << ref.status.message();
  for (Backend be : {Backend::oracle, Backend::cpu}) {
    SCOPED_TRACE(backend_name(be));
    const RunResult r = run_scenario(sc, ref, be);
    if (be == Backend::cpu && r.status.code() == Status::Code::unavailable) {
      GTEST_SKIP() << "cpu fast path (prefill forward) not available yet: " << r.status.message();
    }
    ASSERT_TRUE(r.status.ok()) << r.status.message();
    std::cout << "[ fp64 decode ] " << sc.full.spec.name() << " " << backend_name(be) << ": prompt " << r.prompt_err
              << ", decode o " << r.o_err << ", lse " << r.lse_err << "\n";
    EXPECT_TRUE(r.finite && r.guards);
    EXPECT_EQ(r.cache.len(0), d.prompt + d.steps);
    EXPECT_LE(r.prompt_err, 1e-10);
    EXPECT_LE(r.o_err, 1e-10);
    EXPECT_LE(r.lse_err, 1e-10);
  }
}

DecodeSpec dspec(int64_t K, bool gate, BetaMode bm, uint64_t seed, int64_t prompt, int64_t steps,
                 DType dt = DType::f64) {
  return {spec(1, 0, 4, 2, K, K, gate, seed, {}, bm, dt), prompt, steps};
}

INSTANTIATE_TEST_SUITE_P(Long, DecodeEqualsForward64,
                         ::testing::Values(dspec(16, true, BetaMode::uniform02, 21, 37, 2000),
                                           dspec(32, true, BetaMode::near2, 22, 5, 2000),
                                           dspec(16, false, BetaMode::two, 23, 1, 300)),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

// fp32 inputs, fp32 cache, against the fp64 oracle on the same (f32-valued) inputs.
//
// Bound. One decode step rounds every cached key once: fl(kc - beta (w . kc) w) = H kc + d with
// ||d|| <= c u ||kc||, u = 2^-24, c ~ K/16 + 4 (sixteen-lane dot product, one multiply-add per element).
// With ||H|| <= 1 old errors are never amplified, so after n steps a key is off by at most n c u ||k|| (a
// random walk gives ~ sqrt(n) c u ||k|| in practice). A logit moves by scale * q . d <= ||d|| (scale = K^-1/2,
// ||q|| ~ sqrt(K)), and the output by at most that much times the spread of v. The gate cumsum G_t grows like
// t |g| (about 0.05 t here), so the cache keeps it in fp64 (decode.h) and each G_new - G_j is rounded once.
// Worst case for n = 2000, K = 16..32: ~ 2000 * 6 * 6e-8 * 6 ~ 4e-3; the random walk is far below it.
// Measured maxima over 2000 steps (max over steps of max|o - o_ref| / max|o_ref| per row):
//   no gate: 2.4e-6 (u(0,2)), 2.9e-6 (near 2), 5.8e-6 (beta = 2);
//   gate:    5.2e-7 (u(0,2)), 6.8e-7 (beta = 0). With gc in fp32 the gated runs measured 1.2e-5 to 1.8e-5:
//            the rounding of |G| dominated, which is why gc is fp64.
// Asserted: ~10x the largest measured value.
constexpr double kF32DecodeBound = 6e-5;

class DecodeEqualsForward32 : public ::testing::TestWithParam<DecodeSpec> {};

TEST_P(DecodeEqualsForward32, Fp32Cache) {
  const DecodeSpec d = GetParam();
  const Scenario sc = make_scenario(d.s, {d.prompt}, d.steps);
  const FwdOut ref = run_fwd(to_f64(sc.full), Backend::oracle);
  ASSERT_TRUE(ref.status.ok()) << ref.status.message();
  const RunResult r = run_scenario(sc, ref, Backend::oracle);
  ASSERT_TRUE(r.status.ok()) << r.status.message();
  std::cout << "[ fp32 decode ] " << sc.full.spec.name() << ": prompt " << r.prompt_err << ", decode o " << r.o_err
            << ", lse " << r.lse_err << "; o error at step";
  for (int64_t t : {1, 10, 100, 500, 1000, 2000, 4000}) {
    if (t <= d.steps) std::cout << " " << t << ": " << r.step_err[t - 1];
  }
  std::cout << "\n";
  EXPECT_TRUE(r.finite && r.guards);
  EXPECT_LE(r.prompt_err, 1e-6);
  EXPECT_LE(r.o_err, kF32DecodeBound);
  EXPECT_LE(r.lse_err, kF32DecodeBound);
}

INSTANTIATE_TEST_SUITE_P(Long, DecodeEqualsForward32,
                         ::testing::Values(dspec(16, true, BetaMode::uniform02, 31, 37, 2000, DType::f32),
                                           dspec(16, false, BetaMode::uniform02, 31, 37, 2000, DType::f32),
                                           dspec(16, true, BetaMode::zero, 31, 37, 2000, DType::f32),
                                           dspec(32, false, BetaMode::near2, 32, 5, 2000, DType::f32),
                                           dspec(16, false, BetaMode::two, 33, 3, 2000, DType::f32)),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

// ------------------------------------------------------------------------------------------------------
// 3. Varlen prefill (empty and length-1 prompts) into N slots, then decode steps for all slots at once.

TEST(Decode, VarlenSlotsEachMatchTheirOwnForward) {
  for (bool gate : {true, false}) {
    CaseSpec s = spec(1, 0, 6, 2, 16, 8, gate, 41 + gate, {}, BetaMode::uniform02);
    const Scenario sc = make_scenario(s, {5, 0, 1, 13, 0}, 40);
    const FwdOut ref = run_fwd(sc.full, Backend::oracle);
    ASSERT_TRUE(ref.status.ok());
    const RunResult r = run_scenario(sc, ref, Backend::oracle);
    ASSERT_TRUE(r.status.ok()) << r.status.message();
    EXPECT_TRUE(r.finite && r.guards);
    EXPECT_LE(r.prompt_err, 1e-12);
    EXPECT_LE(r.o_err, 1e-12) << "gate " << gate;
    EXPECT_LE(r.lse_err, 1e-12);
    for (int64_t n = 0; n < 5; ++n) EXPECT_EQ(r.cache.len(n), sc.prompt[n] + 40);
    // The thread count changes nothing (bitwise): rerun single-threaded.
    Cache c1 = Cache::make(5, 2, 6, 53, 16, 8, DType::f64, gate), c2 = c1.clone();
    Outs p1(1, sc.pre.spec.T, 6, 8, DType::f64), p2(1, sc.pre.spec.T, 6, 8, DType::f64);
    ASSERT_TRUE(prefill(sc.pre, c1, p1, Backend::oracle).ok());
    ASSERT_TRUE(prefill(sc.pre, c2, p2, Backend::oracle).ok());
    for (int64_t t = 0; t < 5; ++t) {
      Outs o1(5, 1, 6, 8, DType::f64), o2(5, 1, 6, 8, DType::f64);
      PathDecodeParams a = decode_params(sc.dec, t, c1, o1, Backend::cpu), b = decode_params(sc.dec, t, c2, o2, Backend::oracle);
      a.num_threads = 1;
      b.num_threads = 2;
      ASSERT_TRUE(path_attn_decode(a).ok());
      ASSERT_TRUE(path_attn_decode(b).ok());
      EXPECT_TRUE(same_bytes(o1.o, o2.o) && same_bytes(o1.lse, o2.lse));
    }
    EXPECT_TRUE(same_cache(c1, c2));
  }
}

// The swap check (docs/spec.md, section 7) through decode: beta = 2 and w = (e_a - e_b)/sqrt(2) swap coordinates
// a and b exactly, so a cached one-hot key becomes the permuted one-hot vector, bit for bit.
TEST(Decode, SwapStepPermutesCachedKeysExactly) {
  const int64_t K = 8, V = 8;
  Cache cache = Cache::make(1, 1, 1, 4, K, V, DType::f32, false);
  static_cast<int64_t*>(cache.lengths.view().data)[0] = 2;
  for (int64_t j = 0; j < 2; ++j)
    for (int64_t e = 0; e < K; ++e) {
      cache.kc.set(j * K + e, e == j + 2 ? 1.0 : 0.0);  // kc_0 = e_2, kc_1 = e_3
      cache.vc.set(j * V + e, double(j));
    }
  HostTensor q(DType::f32, {1, 1, 1, K}), k(DType::f32, {1, 1, 1, K}), v(DType::f32, {1, 1, 1, V});
  HostTensor w(DType::f32, {1, 1, 1, K}), beta(DType::f32, {1, 1, 1});
  w.set(2, 1.0 / std::sqrt(2.0));
  w.set(5, -1.0 / std::sqrt(2.0));  // swaps coordinates 2 and 5
  beta.set(0, 2.0);
  Outs out(1, 1, 1, V, DType::f32);
  PathDecodeParams p;
  p.q = q.view(); p.k = k.view(); p.v = v.view(); p.w = w.view(); p.beta = beta.view();
  p.o = out.o.view(); p.lse = out.lse.view(); p.cache = cache.view();
  ASSERT_TRUE(path_attn_decode(p).ok());
  // fl(1/sqrt2)^2 * 2 is not exactly 1 in fp32, so "exact" means within one ulp of the permuted vector.
  for (int64_t e = 0; e < K; ++e) {
    EXPECT_NEAR(cache.kc.get(0 * K + e), e == 5 ? 1.0 : 0.0, 2.4e-7) << e;
    EXPECT_NEAR(cache.kc.get(1 * K + e), e == 3 ? 1.0 : 0.0, 0.0) << e;  // orthogonal to w: untouched
  }
  // q = 0: uniform softmax over 3 tokens with values 0, 1, 0 (k, v of the new token are zero).
  for (int64_t e = 0; e < V; ++e) EXPECT_NEAR(out.o.get(e), 1.0 / 3.0, 1e-7);
  EXPECT_NEAR(out.lse.get(0), std::log(3.0), 1e-6);
  EXPECT_EQ(cache.len(0), 3);
}

// ------------------------------------------------------------------------------------------------------
// 4. Bad input: each returns invalid_argument naming the argument, and writes nothing.

class DecodeBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    const CaseSpec s = spec(1, 0, 4, 2, 8, 8, true, 51);
    sc = make_scenario(s, {3, 0, 2}, 2);
    cache = Cache::make(3, 2, 4, 4, 8, 8, DType::f64, true);
    Outs po(1, 5, 4, 8, DType::f64);
    ASSERT_TRUE(prefill(sc.pre, cache, po, Backend::oracle).ok());
  }
  // Runs p (built on `c`) and checks: invalid_argument (or `code`), message naming `arg`, nothing written.
  void expect_rejected(PathDecodeParams p, Cache& c, const Outs& out, const char* arg,
                       Status::Code code = Status::Code::invalid_argument) {
    const Cache before = c.clone();
    const Status st = path_attn_decode(p);
    EXPECT_EQ(int(st.code()), int(code)) << arg << ": " << st.message();
    EXPECT_NE(st.message().find(arg), std::string::npos) << "message does not name " << arg << ": " << st.message();
    EXPECT_TRUE(same_cache(before, c)) << arg << ": the cache was modified";
    EXPECT_TRUE(all_nan(out.o) && all_nan(out.lse)) << arg << ": an output was written";
    EXPECT_TRUE(out.o.guards_intact() && out.lse.guards_intact() && c.guards_intact());
  }
  Scenario sc;
  Cache cache;
};

TEST_F(DecodeBadInput, EachArgumentNamed) {
  Outs out(3, 1, 4, 8, DType::f64);
  auto base = [&]() { return decode_params(sc.dec, 0, cache, out, Backend::oracle); };
  {  // the well-formed call succeeds (so the cases below fail for their own reason)
    Cache c = cache.clone();
    Outs o2(3, 1, 4, 8, DType::f64);
    ASSERT_TRUE(path_attn_decode(decode_params(sc.dec, 0, c, o2, Backend::oracle)).ok());
  }
  PathDecodeParams p = base();
  p.q.ndim = 3;
  expect_rejected(p, cache, out, "q:");
  p = base();
  p.k.shape[3] = 16;
  expect_rejected(p, cache, out, "k:");
  p = base();
  p.v.dtype = DType::f32;
  expect_rejected(p, cache, out, "v:");
  p = base();
  p.w = TensorView();
  expect_rejected(p, cache, out, "w");
  p = base();
  p.beta.dtype = DType::i32;  // any float dtype is legal for beta (test_param_dtypes.cpp); an integer one is not
  expect_rejected(p, cache, out, "beta:");
  p = base();  // two tokens per sequence
  p.q = slice_t(sc.dec.q.view(), 0, 2); p.k = slice_t(sc.dec.k.view(), 0, 2); p.v = slice_t(sc.dec.v.view(), 0, 2);
  p.w = slice_t(sc.dec.w.view(), 0, 2); p.beta = slice_t(sc.dec.beta.view(), 0, 2); p.g = slice_t(sc.dec.g.view(), 0, 2);
  p.o.shape[1] = 2;  // shape only: validation must reject before any write
  p.lse.shape[1] = 2;
  p.o.stride[0] *= 2; p.lse.stride[0] *= 2;
  expect_rejected(p, cache, out, "q:");
  p = base();
  p.o.dtype = DType::f32;
  expect_rejected(p, cache, out, "o:");
  p = base();
  p.lse.shape[2] = 3;
  expect_rejected(p, cache, out, "lse:");
  p = base();
  p.cache.kc.dtype = DType::bf16;
  expect_rejected(p, cache, out, "cache.kc");
  p = base();
  p.cache.vc.dtype = DType::f32;
  expect_rejected(p, cache, out, "cache.vc");
  p = base();
  p.cache.gc.shape[1] = 2;
  expect_rejected(p, cache, out, "cache.gc");
  p = base();
  p.cache.lengths.dtype = DType::i32;
  expect_rejected(p, cache, out, "cache.lengths");
  p = base();  // cache for 3 slots, inputs for 2
  p.q.shape[0] = 2; p.k.shape[0] = 2; p.v.shape[0] = 2; p.w.shape[0] = 2; p.beta.shape[0] = 2; p.g.shape[0] = 2;
  p.o.shape[0] = 2; p.lse.shape[0] = 2;
  expect_rejected(p, cache, out, "cache.kc");
  p = base();  // g given, cache without gc
  p.cache.gc = TensorView();
  expect_rejected(p, cache, out, "cache.gc");
  p = base();  // gc given, g absent
  p.g = TensorView();
  expect_rejected(p, cache, out, "cache.gc");
  p = base();
  p.num_threads = -1;
  expect_rejected(p, cache, out, "num_threads");
  p = base();
  p.scale = INFINITY;
  expect_rejected(p, cache, out, "scale");
  p = base();
  p.backend = Backend::cuda;  // host tensors / CPU-only build: validation refuses (unavailable or invalid)
  {
    const Cache before = cache.clone();
    const Status st = path_attn_decode(p);
    EXPECT_TRUE(st.code() == Status::Code::unavailable || st.code() == Status::Code::invalid_argument) << st.message();
    EXPECT_NE(st.message().find("cuda"), std::string::npos) << st.message();
    EXPECT_TRUE(same_cache(before, cache) && all_nan(out.o) && all_nan(out.lse));
  }
  {  // a full slot: lengths[2] == capacity
    Cache full = cache.clone();
    static_cast<int64_t*>(full.lengths.view().data)[2] = 4;
    expect_rejected(decode_params(sc.dec, 0, full, out, Backend::oracle), full, out, "cache.lengths");
    static_cast<int64_t*>(full.lengths.view().data)[2] = -1;
    expect_rejected(decode_params(sc.dec, 0, full, out, Backend::cpu), full, out, "cache.lengths");
  }
}

TEST(PrefillBadInput, EachArgumentNamed) {
  const Case c = Case::make(spec(1, 0, 4, 2, 8, 8, true, 52, {3, 0, 6}));
  auto check = [&](PathPrefillParams p, const Cache& cache, const Outs& out, const char* arg) {
    const Cache before = cache.clone();
    const Status st = path_attn_prefill(p);
    EXPECT_EQ(st.code(), Status::Code::invalid_argument) << arg << ": " << st.message();
    EXPECT_NE(st.message().find(arg), std::string::npos) << "message does not name " << arg << ": " << st.message();
    EXPECT_TRUE(same_cache(before, cache)) << arg << ": the cache was modified";
    EXPECT_TRUE(all_nan(out.o) && all_nan(out.lse)) << arg << ": an output was written";
    EXPECT_TRUE(cache.guards_intact() && out.o.guards_intact());
  };
  Outs out(1, 9, 4, 8, DType::f64);
  Cache good = Cache::make(3, 2, 4, 6, 8, 8, DType::f64, true);
  auto base = [&](const Cache& cache) {
    PathPrefillParams p;
    p.fwd = c.fwd_params(out.o, &out.lse);
    p.fwd.backend = Backend::oracle;
    p.cache = cache.view();
    return p;
  };
  Cache small = Cache::make(3, 2, 4, 5, 8, 8, DType::f64, true);  // sequence 2 has 6 tokens
  check(base(small), small, out, "cache.kc");
  Cache two = Cache::make(2, 2, 4, 6, 8, 8, DType::f64, true);  // 3 sequences, 2 slots
  check(base(two), two, out, "cache.kc");
  Cache nogate = Cache::make(3, 2, 4, 6, 8, 8, DType::f64, false);
  check(base(nogate), nogate, out, "cache.gc");
  Cache f32 = Cache::make(3, 2, 4, 6, 8, 8, DType::f32, true);
  check(base(f32), f32, out, "cache.kc");
  PathPrefillParams p = base(good);
  p.fwd.g = TensorView();  // gc without g
  check(p, good, out, "cache.gc");
  p = base(good);
  p.fwd.k.dtype = DType::f32;
  check(p, good, out, "k:");
  p = base(good);
  p.cache.lengths.dtype = DType::i32;
  check(p, good, out, "cache.lengths");
  // And the well-formed call succeeds.
  EXPECT_TRUE(path_attn_prefill(base(good)).ok());
  EXPECT_EQ(good.len(0), 3);
  EXPECT_EQ(good.len(1), 0);
  EXPECT_EQ(good.len(2), 6);
}

// ------------------------------------------------------------------------------------------------------
// 5. Drift: an fp32 key cache against one re-rounded to bf16 after every step (the public implementation's
// choice), beta = 2 everywhere (every H is a reflection: nothing damps old rounding errors), no gate (old
// tokens keep their weight), inputs bf16-representable. Reference: the fp64 oracle over all tokens.

TEST(DecodeDrift, Bf16CacheDriftsFp32CacheDoesNot) {
  const int64_t steps = 3000, K = 32;
  CaseSpec s = spec(1, 0, 4, 2, K, K, false, 61, {}, BetaMode::two, DType::f32);
  Scenario sc = make_scenario(s, {8}, steps);
  auto to_bf16_values = [](Case& c) {
    c.q = c.q.cast(DType::bf16).cast(DType::f32);
    c.k = c.k.cast(DType::bf16).cast(DType::f32);
    c.v = c.v.cast(DType::bf16).cast(DType::f32);
  };
  to_bf16_values(sc.full);
  to_bf16_values(sc.pre);
  to_bf16_values(sc.dec);
  const FwdOut ref = run_fwd(to_f64(sc.full), Backend::oracle);
  ASSERT_TRUE(ref.status.ok());
  const RunResult a = run_scenario(sc, ref, Backend::oracle);
  const RunResult b = run_scenario(sc, ref, Backend::oracle, [&](Cache& c) {
    float* kc = static_cast<float*>(c.kc.view().data);
    const int64_t C = c.kc.view().shape[2], L = c.len(0);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < L * K; ++i) {
        float& x = kc[h * C * K + i];
        x = core::bf16_to_f32(core::f32_to_bf16(x));
      }
  });
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  // Key drift: the final caches against an fp64 decode of the same tokens.
  Scenario sc64 = sc;
  sc64.full = to_f64(sc.full);
  sc64.pre = to_f64(sc.pre);
  sc64.dec = to_f64(sc.dec);
  const RunResult e = run_scenario(sc64, ref, Backend::oracle);
  ASSERT_TRUE(e.status.ok());
  const int64_t L = 8 + steps;
  auto key_err = [&](const Cache& c) {
    const auto x = c.kc.to_f64(), r = e.cache.kc.to_f64();
    return max_rel(std::vector<double>(x.begin(), x.begin() + 2 * L * K), std::vector<double>(r.begin(), r.begin() + 2 * L * K));
  };
  std::cout << "[ drift ] K = " << K << ", beta = 2, no gate, " << steps << " decode steps after an 8-token prompt\n";
  std::cout << "[ drift ]   step   fp32-cache o err   bf16-cache o err\n";
  for (int64_t t : {1, 10, 100, 300, 1000, 2000, 3000})
    std::cout << "[ drift ] " << std::setw(6) << t << "   " << std::setw(16) << a.step_err[t - 1] << "   "
              << std::setw(16) << b.step_err[t - 1] << "\n";
  std::cout << "[ drift ] max over steps: fp32 " << a.o_err << ", bf16 " << b.o_err << "; final key error: fp32 "
            << key_err(a.cache) << ", bf16 " << key_err(b.cache) << "\n";
  EXPECT_LE(a.o_err, kF32DecodeBound);
  EXPECT_GT(b.o_err, 100 * a.o_err);  // the reason the cache is fp32
}

// ------------------------------------------------------------------------------------------------------
// Timing of one decode step (not a test: run with --gtest_also_run_disabled_tests). f32, K = V = 128,
// H = 8 kv heads, HQ = 32 query heads, one sequence, the cache filled directly.

TEST(DecodeTiming, DISABLED_StepTimeByCacheLength) {
  const int64_t H = 8, HQ = 32, K = 128, V = 128;
  const CaseSpec s = spec(1, 1, HQ, H, K, V, true, 71, {}, BetaMode::uniform02, DType::f32);
  const Case c = Case::make(s);
  for (int64_t L : {1024, 4096, 16384, 32768}) {
    Cache cache = Cache::make(1, H, HQ, L + 1, K, V, DType::f32, true);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (HostTensor* t : {&cache.kc, &cache.vc, &cache.gc}) {
      float* x = static_cast<float*>(t->view().data);
      for (int64_t i = 0; i < t->numel(); ++i) x[i] = nd(rng);
    }
    Outs out(1, 1, HQ, V, DType::f32);
    PathDecodeParams p = decode_params(c, 0, cache, out, Backend::cpu);
    int64_t* len = static_cast<int64_t*>(cache.lengths.view().data);
    double best = 1e30;
    for (int rep = 0; rep < 7; ++rep) {
      len[0] = L - 1;
      const auto t0 = std::chrono::steady_clock::now();
      ASSERT_TRUE(path_attn_decode(p).ok());
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const double bytes = double(H) * L * (2 * K + V) * 4;  // kc read + written, vc read
    std::cout << "[ timing ] cache " << std::setw(6) << L << ": " << std::setw(9) << best * 1e3 << " ms/step, "
              << bytes / best / 1e9 << " GB/s\n";
  }
}

}  // namespace
}  // namespace pathattn::test
