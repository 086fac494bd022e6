// tests/cpp/test_nonfinite.cpp: causality of non-finite inputs on the CPU backends. A NaN or Inf in q, k, v,
// w, beta or g at position p of one sequence may change outputs at positions >= p of that sequence only:
// outputs (o, lse) and dq at earlier positions, and every output and gradient of the other sequences, must
// equal those of the finite input. Also: scores beyond fp32's range give the oracle's finite o, not NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "check/harness.h"

namespace pathattn::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct NfCase {
  std::string field;  // q, k, v, w, beta, g
  double value;
  DType dtype;
  bool varlen;
  int chunk;  // fast path chunk size (0: default)
  int64_t local_p;  // position inside the poisoned sequence (sequence 1)
};

std::string nf_str(const NfCase& c) {
  return c.field + (std::isnan(c.value) ? "_nan" : "_inf") + (c.dtype == DType::f64 ? "_f64" : "_f32") +
         (c.varlen ? "_varlen" : "_batch") + "_c" + std::to_string(c.chunk) + "_p" + std::to_string(c.local_p);
}
std::string nf_name(const testing::TestParamInfo<NfCase>& i) { return nf_str(i.param); }
void PrintTo(const NfCase& c, std::ostream* os) { *os << nf_str(c); }

// Sequence 1 starts at t0 (batch row 1 at 0, or packed after sequence 0) and has `len` tokens.
struct Layout {
  int64_t seq_b, seq_t0, len;
};

CaseSpec spec_of(const NfCase& c) {
  CaseSpec s;
  s.HQ = 4;
  s.H = 2;
  s.K = 32;
  s.V = 16;
  s.path = true;
  s.gate = true;
  s.dtype = c.dtype;
  s.seed = 7;
  if (c.varlen) {
    s.B = 1;
    s.seqlens = {70, c.local_p > 200 ? 700 : 150, 60};
    s.T = 70 + s.seqlens[1] + 60;
  } else {
    s.B = 3;
    s.T = c.local_p > 200 ? 700 : 150;
  }
  return s;
}

Layout layout_of(const CaseSpec& s) {
  if (!s.seqlens.empty()) return {0, s.seqlens[0], s.seqlens[1]};
  return {1, 0, s.T};
}

HostTensor& field_of(Case& c, const std::string& f) {
  if (f == "q") return c.q;
  if (f == "k") return c.k;
  if (f == "v") return c.v;
  if (f == "w") return c.w;
  if (f == "beta") return c.beta;
  return c.g;
}

// Element (b, t, h, d) of a contiguous [B, T, heads, D] (or [B, T, heads] with D = 1) tensor.
int64_t at(const HostTensor& x, int64_t b, int64_t t, int64_t h, int64_t d) {
  const TensorView v = x.view();
  const int64_t heads = v.shape[2], D = v.ndim == 4 ? v.shape[3] : 1;
  return ((b * v.shape[1] + t) * heads + h) * D + d;
}

// Every element of `got` outside sequence 1's positions >= p must equal `ref` (both are [B, T, heads(, D)]).
// With `whole_seq`, the whole of sequence 1 is exempt (gradients of k, v, w, beta, g: later queries reach
// earlier keys), and only the other sequences are compared.
void expect_confined(const char* name, const HostTensor& got, const HostTensor& ref, const Layout& L, int64_t p,
                     bool whole_seq) {
  const TensorView v = got.view();
  const int64_t B = v.shape[0], T = v.shape[1], heads = v.shape[2], D = v.ndim == 4 ? v.shape[3] : 1;
  int64_t bad = 0;
  std::string first;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const bool in_seq = b == L.seq_b && t >= L.seq_t0 && t < L.seq_t0 + L.len;
      if (in_seq && (whole_seq || t >= L.seq_t0 + p)) continue;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t i = ((b * T + t) * heads + h) * D + d;
          if (!(got.get(i) == ref.get(i))) {  // == : bitwise up to the sign of zero; NaN never equal
            if (bad++ == 0)
              first = "[" + std::to_string(b) + ", " + std::to_string(t) + ", " + std::to_string(h) + ", " +
                      std::to_string(d) + "] = " + std::to_string(got.get(i)) + " vs " + std::to_string(ref.get(i));
          }
        }
    }
  EXPECT_EQ(bad, 0) << name << ": " << bad << " elements changed outside the poisoned suffix; first " << first;
}

class NonFinite : public testing::TestWithParam<NfCase> {};

TEST_P(NonFinite, ConfinedToLaterPositionsOfItsSequence) {
  const NfCase& nc = GetParam();
  const CaseSpec s = spec_of(nc);
  const Layout L = layout_of(s);
  const Case clean = Case::make(s);
  Case bad = clean;
  HostTensor& f = field_of(bad, nc.field);
  f = f.clone();
  const int64_t t = L.seq_t0 + nc.local_p;
  // Head 1 (kv head 0 for the group of 2 query heads) and one element of its row.
  const int64_t head = 1, d = f.view().ndim == 4 ? 3 : 0;
  f.set(at(f, L.seq_b, t, head, d), nc.value);

  for (Backend be : {Backend::cpu, Backend::oracle}) {
    if (be == Backend::oracle && nc.local_p > 200) continue;  // the long case runs the fast path only
    SCOPED_TRACE(be == Backend::cpu ? "cpu" : "oracle");
    const FwdOut f0 = run_fwd(clean, be, 0, be == Backend::cpu ? nc.chunk : 0);
    const FwdOut f1 = run_fwd(bad, be, 0, be == Backend::cpu ? nc.chunk : 0);
    ASSERT_TRUE(f0.status.ok() && f1.status.ok()) << f1.status.message();
    expect_confined("o", f1.o, f0.o, L, nc.local_p, false);
    expect_confined("lse", f1.lse, f0.lse, L, nc.local_p, false);
    const HostTensor dout = random_dout(clean, 11);
    const BwdOut b0 = run_bwd(clean, f0, dout, be, 0, be == Backend::cpu ? nc.chunk : 0);
    const BwdOut b1 = run_bwd(bad, f1, dout, be, 0, be == Backend::cpu ? nc.chunk : 0);
    ASSERT_TRUE(b0.status.ok() && b1.status.ok()) << b1.status.message();
    expect_confined("dq", b1.dq, b0.dq, L, nc.local_p, false);
    expect_confined("dk", b1.dk, b0.dk, L, nc.local_p, true);
    expect_confined("dv", b1.dv, b0.dv, L, nc.local_p, true);
    expect_confined("dw", b1.dw, b0.dw, L, nc.local_p, true);
    expect_confined("dbeta", b1.dbeta, b0.dbeta, L, nc.local_p, true);
    expect_confined("dg", b1.dg, b0.dg, L, nc.local_p, true);
  }
}

std::vector<NfCase> nf_cases() {
  std::vector<NfCase> v;
  for (const char* f : {"v", "w", "beta", "k", "q", "g"})
    for (double val : {kNaN, kInf})
      for (DType dt : {DType::f32, DType::f64}) {
        if (std::isinf(val) && dt == DType::f64) continue;
        v.push_back({f, val, dt, true, 0, 100});    // mid-chunk of sequence 1 (chunk 64)
        v.push_back({f, val, dt, false, 16, 37});   // batch rows, chunk 16
      }
  // Beyond the first 512-token superblock (the forward's two-level scan), and the chunk's first row.
  for (const char* f : {"v", "w", "beta"}) {
    v.push_back({f, kNaN, DType::f32, true, 0, 600});
    v.push_back({f, kNaN, DType::f32, false, 0, 64});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cpu, NonFinite, testing::ValuesIn(nf_cases()), nf_name);

// Scores far beyond fp32's range (|q|, |k| ~ 1e20): the fp64 oracle's o is finite; the fast fp32 path must
// give that o (it recomputes such chunks in fp64), not NaN.
TEST(NonFinite, ScoresBeyondFp32Range) {
  for (bool path : {true, false}) {
    CaseSpec s;
    s.B = 2;
    s.T = 150;
    s.HQ = 2;
    s.H = 1;
    s.K = 32;
    s.V = 16;
    s.path = path;
    s.gate = true;
    s.dtype = DType::f32;
    s.seed = 3;
    Case c = Case::make(s);
    c.q = c.q.clone();
    c.k = c.k.clone();
    for (int64_t i = 0; i < c.q.numel(); ++i) c.q.set(i, c.q.get(i) * 1e20);
    for (int64_t i = 0; i < c.k.numel(); ++i) c.k.set(i, c.k.get(i) * 1e20);
    const FwdOut ref = run_fwd(c, Backend::oracle);
    const FwdOut got = run_fwd(c, Backend::cpu);
    ASSERT_TRUE(ref.status.ok() && got.status.ok());
    const std::vector<double> r = ref.o.to_f64(), g = got.o.to_f64();
    ASSERT_TRUE(all_finite(r));
    EXPECT_TRUE(all_finite(g)) << (path ? "path" : "plain");
    EXPECT_LE(rel_l2(g, r), 1e-5) << (path ? "path" : "plain");
  }
}

}  // namespace
}  // namespace pathattn::test
