// tests/cpp/test_validation.cpp: bad input (docs/spec.md, section 5) against path_attn_fwd / path_attn_bwd on the
// oracle and cpu backends. Every rejected call must return the expected code, a message that starts with
// the argument's name, and leave every tensor byte-identical (guards included). Also: legal no-ops (T = 0,
// B = 0), arbitrary strides, NaN / Inf confinement to the outputs they reach, and the validating mode.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "check/harness.h"
#include "check/oracle_chain.h"

namespace pathattn::test {
namespace {

using Code = Status::Code;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------------------------------
// Calls: a valid forward / backward with poisoned outputs, which each test then breaks in one place.
// ---------------------------------------------------------------------------------------------------

// The base case: B = 2, T = 5, HQ = 4, H = 2 (GQA), K = 16, V = 8, PaTH with a gate, f32 inputs.
CaseSpec base_spec(DType dt = DType::f32) {
  CaseSpec s;
  s.B = 2; s.T = 5; s.HQ = 4; s.H = 2; s.K = 16; s.V = 8;
  s.path = true; s.gate = true; s.dtype = dt; s.seed = 3;
  return s;
}

DType float_dtype(DType dt) { return dt == DType::f64 ? DType::f64 : DType::f32; }

// Forward: o [B, T, HQ, V] and lse [B, T, HQ], poisoned.
struct FwdCall {
  Case c;
  HostTensor o, lse;
  PathFwdParams p;
  FwdCall(const Case& c0, Backend be) : c(c0) {
    const CaseSpec& s = c.spec;
    o = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.V});
    lse = HostTensor(float_dtype(s.dtype), {s.B, s.T, s.HQ});
    o.poison();
    lse.poison();
    p = c.fwd_params(o, &lse);
    p.backend = be;
  }
  FwdCall(const CaseSpec& s, Backend be) : FwdCall(Case::make(s), be) {}
  std::vector<const HostTensor*> tensors() const {
    return {&c.q, &c.k, &c.v, &c.w, &c.beta, &c.g, &c.cu, &o, &lse};
  }
  Status run() const { return path_attn_fwd(p); }
};

// Backward: o and lse from an oracle forward, a random do, poisoned gradients of every input present.
struct BwdCall {
  Case c;
  HostTensor o, lse, dout, dq, dk, dv, dw, dbeta, dg;
  PathBwdParams p;
  BwdCall(const Case& c0, Backend be) : c(c0) {
    const CaseSpec& s = c.spec;
    const DType fdt = float_dtype(s.dtype);
    FwdOut f = run_fwd(c, Backend::oracle);
    o = f.o;
    lse = f.lse;
    dout = random_dout(c, 5);
    dq = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.K});
    dk = HostTensor(s.dtype, {s.B, s.T, s.H, s.K});
    dv = HostTensor(s.dtype, {s.B, s.T, s.H, s.V});
    p.q = c.q.view();
    p.k = c.k.view();
    p.v = c.v.view();
    if (s.path) {
      dw = HostTensor(fdt, {s.B, s.T, s.H, s.K});
      dbeta = HostTensor(fdt, {s.B, s.T, s.H});
      p.w = c.w.view();
      p.beta = c.beta.view();
      p.dw = dw.view();
      p.dbeta = dbeta.view();
    }
    if (s.gate) {
      dg = HostTensor(fdt, {s.B, s.T, s.HQ});
      p.g = c.g.view();
      p.dg = dg.view();
    }
    if (c.cu.present()) p.cu_seqlens = c.cu.view();
    p.gate_scale = s.gate_scale;
    p.o = o.view();
    p.lse = lse.view();
    p.do_ = dout.view();
    p.dq = dq.view();
    p.dk = dk.view();
    p.dv = dv.view();
    for (HostTensor* t : {&dq, &dk, &dv, &dw, &dbeta, &dg})
      if (t->present()) t->poison();
    p.backend = be;
  }
  BwdCall(const CaseSpec& s, Backend be) : BwdCall(Case::make(s), be) {}
  std::vector<const HostTensor*> tensors() const {
    return {&c.q, &c.k, &c.v, &c.w, &c.beta, &c.g, &c.cu, &o, &lse, &dout, &dq, &dk, &dv, &dw, &dbeta, &dg};
  }
  Status run() const { return path_attn_bwd(p); }
};

// The bytes of every tensor a call can reach, taken before the call and compared after it.
class Snapshot {
 public:
  explicit Snapshot(const std::vector<const HostTensor*>& ts) {
    for (const HostTensor* t : ts) {
      if (!t->present()) continue;
      const uint8_t* b = static_cast<const uint8_t*>(t->view().data);
      saved_.push_back({t, std::vector<uint8_t>(b, b + t->numel() * dtype_size(t->dtype()))});
    }
  }
  void expect_unchanged() const {
    for (const auto& [t, bytes] : saved_) {
      if (!bytes.empty()) EXPECT_EQ(std::memcmp(t->view().data, bytes.data(), bytes.size()), 0) << "a tensor was written";
      EXPECT_TRUE(t->guards_intact()) << "a guard region was written";
    }
  }

 private:
  std::vector<std::pair<const HostTensor*, std::vector<uint8_t>>> saved_;
};

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

void expect_error(const Status& st, Code code, const std::string& arg) {
  EXPECT_EQ(int(st.code()), int(code)) << st.message();
  EXPECT_TRUE(starts_with(st.message(), arg + ":")) << "message does not start with '" << arg
                                                     << ":': " << st.message();
}

// One way of breaking a call: what it does, the argument the error must name, and the code.
template <typename P>
struct Mutation {
  std::string what;
  std::function<void(P&)> apply;
  std::string arg;
  Code code = Code::invalid_argument;
};

// Applies each mutation to a copy of call.p, runs it, and checks the error and that nothing was written.
template <typename Call, typename P>
void expect_rejected(const Call& call, const std::vector<Mutation<P>>& ms) {
  for (const Mutation<P>& m : ms) {
    SCOPED_TRACE(m.what);
    Call broken = call;  // shares the buffers; only the params are edited
    m.apply(broken.p);
    Snapshot snap(call.tensors());
    expect_error(broken.run(), m.code, m.arg);
    snap.expect_unchanged();
  }
}

// ---------------------------------------------------------------------------------------------------
// Generic mutations of every tensor view: rank, shape, dtype, strides, null data.
// ---------------------------------------------------------------------------------------------------

template <typename P>
struct Field {
  const char* name;
  TensorView P::*member;
  int rank;
  DType wrong_dtype;       // a dtype the base call (f32 inputs) must reject for this tensor
  const char* dtype_arg;   // the argument that error names
};

// The argument named when dimension d of tensor n grows by one. q fixes B, T, HQ, K and k fixes H, so a
// size disagreement is reported at the first tensor checked against them; K or V = 17 / 9 are unsupported.
std::pair<std::string, Code> shape_error(const std::string& n, int d) {
  if (n == "q" && d == 2) return {"q", Code::invalid_argument};  // HQ = 5 is not a multiple of H = 2
  if (n == "q") return {"k", Code::invalid_argument};
  if (n == "k" && d == 2) return {"v", Code::invalid_argument};  // H = 3: v has 2 heads
  if (n == "v" && d == 3) return {"v", Code::unsupported};       // V = 9
  return {n, Code::invalid_argument};
}

template <typename P>
std::vector<Mutation<P>> view_mutations(const std::vector<Field<P>>& fields) {
  std::vector<Mutation<P>> ms;
  for (const Field<P>& f : fields) {
    const auto m = f.member;
    const std::string n = f.name;
    ms.push_back({n + " rank - 1", [m](P& p) { (p.*m).ndim -= 1; }, n});
    ms.push_back({n + " rank + 1", [m](P& p) {
                    TensorView& x = p.*m;
                    if (x.ndim < 4) {
                      x.shape[x.ndim] = 1;
                      x.stride[x.ndim] = 1;
                    }
                    x.ndim += 1;  // 5 for rank-4 tensors: past the end of shape[]
                  }, n});
    ms.push_back({n + " ndim -1", [m](P& p) { (p.*m).ndim = -1; }, n});
    for (int d = 0; d < f.rank; ++d) {
      const auto [arg, code] = shape_error(n, d);
      ms.push_back({n + " shape[" + std::to_string(d) + "] + 1", [m, d](P& p) { (p.*m).shape[d] += 1; }, arg,
                    code});
    }
    ms.push_back({n + " negative size", [m](P& p) { (p.*m).shape[0] = -2; }, n});
    ms.push_back({n + " dtype " + dtype_name(f.wrong_dtype), [m, dt = f.wrong_dtype](P& p) { (p.*m).dtype = dt; },
                  f.dtype_arg});
    ms.push_back({n + " last dimension not contiguous", [m, r = f.rank](P& p) { (p.*m).stride[r - 1] = 2; }, n});
    ms.push_back({n + " null data", [m](P& p) { (p.*m).data = nullptr; }, n});
  }
  return ms;
}

std::vector<Field<PathFwdParams>> fwd_fields() {
  using P = PathFwdParams;
  return {{"q", &P::q, 4, DType::i32, "q"},       {"k", &P::k, 4, DType::f16, "k"},
          {"v", &P::v, 4, DType::bf16, "v"},      {"w", &P::w, 4, DType::i32, "w"},
          {"beta", &P::beta, 3, DType::i32, "beta"}, {"g", &P::g, 3, DType::i64, "g"},
          {"o", &P::o, 4, DType::f16, "o"},       {"lse", &P::lse, 3, DType::f64, "lse"}};
}

std::vector<Field<PathBwdParams>> bwd_fields() {
  using P = PathBwdParams;
  return {{"q", &P::q, 4, DType::i32, "q"},         {"k", &P::k, 4, DType::f16, "k"},
          {"v", &P::v, 4, DType::bf16, "v"},        {"w", &P::w, 4, DType::i64, "w"},
          {"beta", &P::beta, 3, DType::i32, "beta"}, {"g", &P::g, 3, DType::i32, "g"},
          {"o", &P::o, 4, DType::f16, "o"},         {"lse", &P::lse, 3, DType::f64, "lse"},
          {"do", &P::do_, 4, DType::bf16, "do"},    {"dq", &P::dq, 4, DType::f16, "dq"},
          {"dk", &P::dk, 4, DType::f64, "dk"},      {"dv", &P::dv, 4, DType::i32, "dv"},
          {"dw", &P::dw, 4, DType::f16, "dw"},      {"dbeta", &P::dbeta, 3, DType::f64, "dbeta"},
          {"dg", &P::dg, 3, DType::i64, "dg"}};
}

// Mutations shared by forward and backward that are not about one view: options, w/beta pairing, backend.
template <typename P>
std::vector<Mutation<P>> option_mutations() {
  std::vector<Mutation<P>> ms = {
      {"q dtype float64 (k stays float32)", [](P& p) { p.q.dtype = DType::f64; }, "k"},
      {"q absent", [](P& p) { p.q = TensorView(); }, "q"},
      {"k absent", [](P& p) { p.k = TensorView(); }, "k"},
      {"v absent", [](P& p) { p.v = TensorView(); }, "v"},
      {"w without beta", [](P& p) { p.beta = TensorView(); }, "beta"},
      {"beta without w", [](P& p) { p.w = TensorView(); }, "w"},
      {"num_threads -1", [](P& p) { p.num_threads = -1; }, "num_threads"},
      {"num_threads 1025", [](P& p) { p.num_threads = 1025; }, "num_threads"},
      {"chunk_size 7", [](P& p) { p.chunk_size = 7; }, "chunk_size"},
      {"chunk_size 4", [](P& p) { p.chunk_size = 4; }, "chunk_size"},
      {"chunk_size -8", [](P& p) { p.chunk_size = -8; }, "chunk_size"},
      {"chunk_size 1032", [](P& p) { p.chunk_size = 1032; }, "chunk_size"},
      {"scale inf", [](P& p) { p.scale = kInf; }, "scale"},
      {"scale -inf", [](P& p) { p.scale = -kInf; }, "scale"},
      {"gate_scale inf", [](P& p) { p.gate_scale = kInf; }, "gate_scale"},
      {"k on the cuda device", [](P& p) { p.k.device = Device::cuda; }, "k"},
      {"g on the cuda device", [](P& p) { p.g.device = Device::cuda; }, "g"},
      {"o on the cuda device", [](P& p) { p.o.device = Device::cuda; }, "o"},
      {"H = 0 (k heads)", [](P& p) { p.k.shape[2] = 0; p.v.shape[2] = 0; }, "q"},
  };
  // cuda in a CPU-only build: unavailable, whether asked for or implied by device tensors.
  if (build_info().find("cuda") == std::string::npos) {
    ms.push_back({"backend cuda (host tensors)", [](P& p) { p.backend = Backend::cuda; }, "backend",
                  Code::unavailable});
    ms.push_back({"cuda tensors, backend automatic", [](P& p) {
                    for (TensorView* t : {&p.q, &p.k, &p.v, &p.w, &p.beta, &p.g, &p.o, &p.lse}) t->device = Device::cuda;
                    p.backend = Backend::automatic;
                  }, "backend", Code::unavailable});
  }
  return ms;
}

class Validation : public ::testing::TestWithParam<Backend> {};

TEST_P(Validation, FwdRejectsEveryBadViewAndOption) {
  const FwdCall call(base_spec(), GetParam());
  expect_rejected(call, view_mutations(fwd_fields()));
  auto ms = option_mutations<PathFwdParams>();
  ms.push_back({"o absent", [](PathFwdParams& p) { p.o = TensorView(); }, "o"});
  expect_rejected(call, ms);
}

TEST_P(Validation, BwdRejectsEveryBadViewAndOption) {
  const BwdCall call(base_spec(), GetParam());
  expect_rejected(call, view_mutations(bwd_fields()));
  using P = PathBwdParams;
  auto ms = option_mutations<P>();
  for (auto [name, member] : std::vector<std::pair<std::string, TensorView P::*>>{
           {"o", &P::o}, {"lse", &P::lse}, {"do", &P::do_}, {"dq", &P::dq}, {"dk", &P::dk}, {"dv", &P::dv},
           {"dw", &P::dw}, {"dbeta", &P::dbeta}, {"dg", &P::dg}}) {
    ms.push_back({name + " absent", [m = member](P& p) { p.*m = TensorView(); }, name});
  }
  ms.push_back({"do on the cuda device", [](P& p) { p.do_.device = Device::cuda; }, "do"});
  expect_rejected(call, ms);
}

TEST_P(Validation, BwdRejectsGradientsOfAbsentInputs) {
  CaseSpec s = base_spec();
  s.path = false;
  s.gate = false;
  const BwdCall call(s, GetParam());
  const CaseSpec& r = call.c.spec;
  const HostTensor dw(DType::f32, {r.B, r.T, r.H, r.K}), dbeta(DType::f32, {r.B, r.T, r.H}),
      dg(DType::f32, {r.B, r.T, r.HQ});
  using P = PathBwdParams;
  expect_rejected(call, std::vector<Mutation<P>>{
                            {"dw without w", [dw](P& p) { p.dw = dw.view(); }, "dw"},
                            {"dbeta without beta", [dbeta](P& p) { p.dbeta = dbeta.view(); }, "dbeta"},
                            {"dg without g", [dg](P& p) { p.dg = dg.view(); }, "dg"},
                        });
}

// q, k, v (and o, do, dq, dk, dv) share one dtype and lse is f32 (f64 with f64 q); w, beta and g take any
// float dtype each (test_param_dtypes.cpp runs those), never an integer one, and their gradients their own.
TEST_P(Validation, DtypeCombinations) {
  using P = PathFwdParams;
  {
    const FwdCall call(base_spec(DType::f64), GetParam());
    expect_rejected(call, std::vector<Mutation<P>>{
                              {"f64 q, i32 w", [](P& p) { p.w.dtype = DType::i32; }, "w"},
                              {"f64 q, i64 beta", [](P& p) { p.beta.dtype = DType::i64; }, "beta"},
                              {"f64 q, i32 g", [](P& p) { p.g.dtype = DType::i32; }, "g"},
                              {"f64 q, f32 lse", [](P& p) { p.lse.dtype = DType::f32; }, "lse"},
                              {"f64 q, i64 o", [](P& p) { p.o.dtype = DType::i64; }, "o"},
                          });
  }
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const FwdCall call(base_spec(dt), GetParam());
    const DType other = dt == DType::bf16 ? DType::f16 : DType::bf16;
    expect_rejected(call, std::vector<Mutation<P>>{
                              {"half q, i64 w", [](P& p) { p.w.dtype = DType::i64; }, "w"},
                              {"half q, i32 beta", [](P& p) { p.beta.dtype = DType::i32; }, "beta"},
                              {"half q, other half lse", [other](P& p) { p.lse.dtype = other; }, "lse"},
                              {"half q, f32 o", [](P& p) { p.o.dtype = DType::f32; }, "o"},
                              {"half q, other half v", [other](P& p) { p.v.dtype = other; }, "v"},
                          });
  }
}

// Head dims outside the CPU set are unsupported (not invalid), naming q for K and v for V; HQ must be a
// positive multiple of H. Each case is self-consistent, so nothing else can be blamed.
TEST_P(Validation, HeadDimsAndGroups) {
  struct Bad { int64_t HQ, H, K, V; const char* arg; Code code; };
  for (const Bad& b : {Bad{4, 2, 12, 8, "q", Code::unsupported}, Bad{4, 2, 16, 264, "v", Code::unsupported},
                       Bad{4, 2, 264, 8, "q", Code::unsupported}, Bad{4, 2, 16, 4, "v", Code::unsupported},
                       Bad{4, 2, 256 + 8, 256 + 8, "q", Code::unsupported},
                       Bad{3, 2, 16, 8, "q", Code::invalid_argument}, Bad{2, 4, 16, 8, "q", Code::invalid_argument},
                       Bad{0, 0, 16, 8, "q", Code::invalid_argument}}) {
    CaseSpec s = base_spec();
    s.HQ = b.HQ; s.H = b.H; s.K = b.K; s.V = b.V;
    SCOPED_TRACE(s.name());
    const FwdCall f(s, GetParam());
    Snapshot sf(f.tensors());
    expect_error(f.run(), b.code, b.arg);
    sf.expect_unchanged();
    if (b.H == 0) continue;  // the oracle forward inside BwdCall needs a valid case
    Case c = Case::make(s);
    BwdCall bw(c, GetParam());
    Snapshot sb(bw.tensors());
    expect_error(bw.run(), b.code, b.arg);
    sb.expect_unchanged();
  }
  // The extremes of the supported set are accepted.
  CaseSpec s = base_spec();
  s.K = 256; s.V = 8; s.T = 3;
  FwdCall f(s, GetParam());
  const Status st = f.run();
  if (GetParam() == Backend::cpu && st.code() == Code::unavailable) GTEST_SKIP() << st.message();
  EXPECT_TRUE(st.ok()) << st.message();
}

// cu_seqlens: B = 1, int32 / int64, host memory, at least 2 entries, starts at 0, non-decreasing, ends at T.
HostTensor make_cu(DType dt, std::vector<double> vals) {
  HostTensor cu(dt, {int64_t(vals.size())});
  for (size_t i = 0; i < vals.size(); ++i) cu.set(int64_t(i), vals[i]);
  return cu;
}

template <typename P>
std::vector<Mutation<P>> cu_mutations() {
  auto set_cu = [](HostTensor cu) { return [cu](P& p) { p.cu_seqlens = cu.view(); }; };
  HostTensor ok = make_cu(DType::i64, {0, 2, 2, 5});
  HostTensor two_d = ok.clone();
  return {
      {"cu_seqlens float32", set_cu(make_cu(DType::f32, {0, 2, 2, 5})), "cu_seqlens"},
      {"cu_seqlens float64", set_cu(make_cu(DType::f64, {0, 2, 2, 5})), "cu_seqlens"},
      {"cu_seqlens one entry", set_cu(make_cu(DType::i64, {0})), "cu_seqlens"},
      {"cu_seqlens no entries", set_cu(HostTensor(DType::i32, {0})), "cu_seqlens"},
      {"cu_seqlens first entry 1", set_cu(make_cu(DType::i32, {1, 2, 2, 5})), "cu_seqlens"},
      {"cu_seqlens first entry -1", set_cu(make_cu(DType::i64, {-1, 2, 2, 5})), "cu_seqlens"},
      {"cu_seqlens decreasing", set_cu(make_cu(DType::i64, {0, 3, 2, 5})), "cu_seqlens"},
      {"cu_seqlens decreasing at the end", set_cu(make_cu(DType::i32, {0, 2, 6, 5})), "cu_seqlens"},
      {"cu_seqlens last < T", set_cu(make_cu(DType::i64, {0, 2, 2, 4})), "cu_seqlens"},
      {"cu_seqlens last > T", set_cu(make_cu(DType::i32, {0, 2, 2, 9})), "cu_seqlens"},
      {"cu_seqlens rank 2", [ok](P& p) {
         p.cu_seqlens = ok.view();
         p.cu_seqlens.ndim = 2;
         p.cu_seqlens.shape[1] = 1;
         p.cu_seqlens.stride[1] = 1;
       }, "cu_seqlens"},
      {"cu_seqlens on the cuda device", [ok](P& p) { p.cu_seqlens = ok.view(); p.cu_seqlens.device = Device::cuda; },
       "cu_seqlens"},
      {"cu_seqlens null data", [ok](P& p) { p.cu_seqlens = ok.view(); p.cu_seqlens.data = nullptr; }, "cu_seqlens"},
  };
}

TEST_P(Validation, BadCuSeqlens) {
  CaseSpec s = base_spec();
  s.seqlens = {2, 0, 3};  // B = 1, T = 5
  {
    const FwdCall f(s, GetParam());
    expect_rejected(f, cu_mutations<PathFwdParams>());
    const BwdCall b(s, GetParam());
    expect_rejected(b, cu_mutations<PathBwdParams>());
  }
  // With B = 2 any cu_seqlens is rejected, even one that would describe one row.
  {
    const HostTensor cu = make_cu(DType::i64, {0, 5});
    const FwdCall f(base_spec(), GetParam());
    expect_rejected(f, std::vector<Mutation<PathFwdParams>>{
                           {"cu_seqlens with B = 2", [cu](PathFwdParams& p) { p.cu_seqlens = cu.view(); }, "cu_seqlens"}});
    const BwdCall b(base_spec(), GetParam());
    expect_rejected(b, std::vector<Mutation<PathBwdParams>>{
                           {"cu_seqlens with B = 2", [cu](PathBwdParams& p) { p.cu_seqlens = cu.view(); }, "cu_seqlens"}});
  }
  // int32 cu_seqlens are legal and mean the same as int64.
  FwdCall with_i64(s, GetParam()), with_i32(s, GetParam());
  const HostTensor cu32 = with_i64.c.cu.cast(DType::i32);
  with_i32.p.cu_seqlens = cu32.view();
  const Status a = with_i64.run(), b = with_i32.run();
  if (GetParam() == Backend::cpu && a.code() == Code::unavailable) GTEST_SKIP() << a.message();
  ASSERT_TRUE(a.ok() && b.ok()) << a.message() << " / " << b.message();
  EXPECT_EQ(max_rel(with_i64.o.to_f64(), with_i32.o.to_f64()), 0.0);
}

// T = 0, B = 0 and varlen batches of empty sequences are legal no-ops: ok, nothing written.
TEST_P(Validation, EmptyProblemsAreNoOps) {
  std::vector<CaseSpec> specs;
  for (int which = 0; which < 4; ++which) {
    CaseSpec s = base_spec();
    if (which == 0) s.T = 0;
    if (which == 1) s.B = 0;
    if (which == 2) s.seqlens = {0, 0, 0};
    if (which == 3) { s.T = 0; s.path = false; s.gate = false; }
    specs.push_back(s);
  }
  for (const CaseSpec& s : specs) {
    SCOPED_TRACE(s.name());
    const FwdCall f(s, GetParam());
    Snapshot sf(f.tensors());
    const Status a = f.run();
    EXPECT_TRUE(a.ok()) << a.message();
    sf.expect_unchanged();
    const BwdCall b(s, GetParam());
    Snapshot sb(b.tensors());
    const Status c = b.run();
    EXPECT_TRUE(c.ok()) << c.message();
    sb.expect_unchanged();
  }
  // With T = 0 every view may have a null data pointer (nothing is read or written).
  FwdCall f(specs[0], GetParam());
  for (TensorView* t : {&f.p.q, &f.p.k, &f.p.v, &f.p.w, &f.p.beta, &f.p.g, &f.p.o, &f.p.lse}) t->data = nullptr;
  const Status st = f.run();
  EXPECT_TRUE(st.ok()) << st.message();
  // numpy gives the dimensions of an empty array stride 0: legal for every view, inputs and outputs.
  for (int which : {0, 1}) {
    FwdCall z(specs[which], GetParam());
    BwdCall zb(specs[which], GetParam());
    for (TensorView* t : {&z.p.q, &z.p.k, &z.p.v, &z.p.w, &z.p.beta, &z.p.g, &z.p.o, &z.p.lse, &zb.p.q, &zb.p.k,
                          &zb.p.v, &zb.p.w, &zb.p.beta, &zb.p.g, &zb.p.o, &zb.p.lse, &zb.p.do_, &zb.p.dq, &zb.p.dk,
                          &zb.p.dv, &zb.p.dw, &zb.p.dbeta, &zb.p.dg})
      for (int d = 0; d < t->ndim; ++d) t->stride[d] = 0;
    const Status sz = z.run(), szb = zb.run();
    EXPECT_TRUE(sz.ok()) << sz.message();
    EXPECT_TRUE(szb.ok()) << szb.message();
  }
  // ...but T = 0 does not excuse a bad shape elsewhere.
  FwdCall g(specs[0], GetParam());
  g.p.v.shape[3] = 12;
  expect_error(g.run(), Code::unsupported, "v");
}

// path_attn_check_inputs: the forward's checks of inputs and options, before any output exists; the same
// message as the call itself.
TEST_P(Validation, CheckInputsBeforeOutputs) {
  FwdCall f(base_spec(), GetParam());
  f.p.o = TensorView{};
  f.p.lse = TensorView{};
  const Status ok = path_attn_check_inputs(f.p);
  EXPECT_TRUE(ok.ok()) << ok.message();
  f.p.k.shape[3] = 8;
  expect_error(path_attn_check_inputs(f.p), Code::invalid_argument, "k");
  FwdCall g(base_spec(), GetParam());
  g.p.beta = TensorView{};
  expect_error(path_attn_check_inputs(g.p), Code::invalid_argument, "beta");
}

// ---------------------------------------------------------------------------------------------------
// Strides: any strides with the last dimension contiguous. Head-major and padded layouts give the same
// result as the contiguous one, and a padded output's gaps are never written.
// ---------------------------------------------------------------------------------------------------

// A copy of x [B, T, N, D] stored head-major ([B, N, T, D] in memory) or padded to D + pad per row.
struct Strided {
  HostTensor buf;
  TensorView view;
};

Strided head_major(const HostTensor& x) {
  const TensorView v = x.view();
  const int64_t B = v.shape[0], T = v.shape[1], N = v.shape[2], D = v.shape[3];
  Strided s;
  s.buf = HostTensor(x.dtype(), {B, N, T, D});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d) s.buf.set(((b * N + n) * T + t) * D + d, x.get(((b * T + t) * N + n) * D + d));
  s.view = v;
  s.view.data = s.buf.view().data;
  s.view.stride[0] = N * T * D;
  s.view.stride[1] = D;
  s.view.stride[2] = T * D;
  s.view.stride[3] = 1;
  return s;
}

Strided padded(const HostTensor& x, int64_t pad, bool copy) {
  const TensorView v = x.view();
  const int64_t B = v.shape[0], T = v.shape[1], N = v.shape[2], D = v.shape[3];
  Strided s;
  s.buf = HostTensor(x.dtype(), {B, T, N, D + pad});
  s.buf.poison();
  for (int64_t r = 0; r < B * T * N; ++r)
    for (int64_t d = 0; d < D; ++d)
      if (copy) s.buf.set(r * (D + pad) + d, x.get(r * D + d));
  s.view = v;
  s.view.data = s.buf.view().data;
  s.view.stride[2] = D + pad;
  s.view.stride[1] = N * (D + pad);
  s.view.stride[0] = T * N * (D + pad);
  return s;
}

TEST_P(Validation, ArbitraryStridesGiveTheContiguousResult) {
  CaseSpec s = base_spec(DType::f64);
  s.T = 9;
  const FwdCall ref(s, GetParam());
  const Status st = ref.run();
  if (GetParam() == Backend::cpu && st.code() == Code::unavailable) GTEST_SKIP() << st.message();
  ASSERT_TRUE(st.ok()) << st.message();

  FwdCall f(ref.c, GetParam());
  const Strided q = padded(ref.c.q, 8, true), k = head_major(ref.c.k), v = head_major(ref.c.v),
                w = padded(ref.c.w, 3, true), o = padded(f.o, 5, false);
  f.p.q = q.view;
  f.p.k = k.view;
  f.p.v = v.view;
  f.p.w = w.view;
  f.p.o = o.view;
  const Status st2 = f.run();
  ASSERT_TRUE(st2.ok()) << st2.message();
  const int64_t V = s.V, rows = s.B * s.T * s.HQ;
  std::vector<double> got(rows * V);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < V + 5; ++d) {
      const double x = o.buf.get(r * (V + 5) + d);
      if (d < V) got[r * V + d] = x;
      else EXPECT_TRUE(std::isnan(x)) << "padding of o written at row " << r;  // still the poison
    }
  EXPECT_TRUE(o.buf.guards_intact());
  const double err = max_rel(got, ref.o.to_f64());
  if (GetParam() == Backend::oracle) EXPECT_EQ(err, 0.0);  // same arithmetic, only the addressing differs
  else EXPECT_LE(err, 1e-13);
}

// ---------------------------------------------------------------------------------------------------
// Non-finite inputs reach only the outputs they mathematically reach (forward and backward).
// ---------------------------------------------------------------------------------------------------

// Element-wise: where reached(i) the poisoned run is non-finite, elsewhere it equals the clean run
// bitwise (and is finite). Returns the number of mismatches (each also reported once per tensor).
int64_t check_confined(const char* name, const HostTensor& clean, const HostTensor& poisoned,
                       const std::function<int(int64_t)>& reached) {
  int64_t bad = 0;
  const auto a = clean.to_f64(), b = poisoned.to_f64();
  for (size_t i = 0; i < a.size(); ++i) {
    const int r = reached(int64_t(i));  // 1: must be non-finite, 0: must equal clean, -1: not checked
    const bool ok = r == 1 ? !std::isfinite(b[i]) : r == 0 ? (std::isfinite(b[i]) && a[i] == b[i]) : true;
    if (!ok && bad++ == 0) {
      ADD_FAILURE() << name << "[" << i << "]: clean " << a[i] << ", poisoned " << b[i]
                    << (r == 1 ? " (should be non-finite)" : " (should equal the clean run)");
    }
  }
  return bad;
}

// The oracle computes every query and key alone, so it must be exact about reach: every element the bad
// value cannot reach equals the clean run. The blockwise cpu path may share chunk-level intermediates
// (UT transforms, block products) among the positions and heads of one sequence, so for it only the
// sequence (batch row) holding the bad value is exempt; the reached elements must be non-finite for both.
class Confinement : public ::testing::TestWithParam<std::tuple<Backend, DType>> {};

TEST_P(Confinement, NanInOneVarlenSequence) {
  const auto [be, dt] = GetParam();
  CaseSpec s = base_spec(dt);
  s.seqlens = {4, 6, 5};  // sequence 1 is positions [4, 10)
  const Case clean = Case::make(s);
  Case bad = cast_case(clean, dt);  // deep copy
  const CaseSpec& r = clean.spec;
  const int64_t p = 6, hbad = 1, group = r.HQ / r.H, s0 = 4, s1 = 10;
  bad.w.set((p * r.H + hbad) * r.K + 3, kNaN);  // H_p is NaN: it reaches logit(i, j) for j < p <= i
  const bool exact = be == Backend::oracle;
  // 1: must be non-finite, 0: must equal the clean run, -1: not checked.
  auto classify = [&](int64_t t, bool is_reached) {
    if (t < s0 || t >= s1) return 0;
    return is_reached ? 1 : (exact ? 0 : -1);
  };

  const FwdOut fc = run_fwd(clean, be), fb = run_fwd(bad, be);
  if (be == Backend::cpu && fc.status.code() == Code::unavailable) GTEST_SKIP() << fc.status.message();
  ASSERT_TRUE(fc.status.ok() && fb.status.ok()) << fc.status.message() << fb.status.message();
  // o [1, T, HQ, V], lse [1, T, HQ]: reached iff p <= t < s1 and hq is in kv head hbad's group.
  auto fwd = [&](int64_t t, int64_t hq) {
    return classify(t, hq / group == hbad && t >= p);
  };
  EXPECT_EQ(check_confined("o", fc.o, fb.o, [&](int64_t i) { return fwd(i / (r.HQ * r.V), (i / r.V) % r.HQ); }), 0);
  EXPECT_EQ(check_confined("lse", fc.lse, fb.lse, [&](int64_t i) { return fwd(i / r.HQ, i % r.HQ); }), 0);

  const HostTensor dout = random_dout(clean, 17);
  const BwdOut bc = run_bwd(clean, fc, dout, be), bb = run_bwd(bad, fb, dout, be);
  ASSERT_TRUE(bc.status.ok() && bb.status.ok()) << bc.status.message() << bb.status.message();
  // Backward: inside the group the reach is wide (every key of the sequence feeds a query at or after p),
  // so only dq of the query at p is required to be non-finite there; other groups must be clean (oracle).
  auto q_side = [&](int64_t t, int64_t hq, bool check_reached) {
    if (hq / group == hbad && t >= s0 && t < s1) return check_reached && t == p ? 1 : -1;
    return classify(t, false);
  };
  auto kv_side = [&](int64_t t, int64_t h) {
    if (h == hbad && t >= s0 && t < s1) return -1;
    return classify(t, false);
  };
  EXPECT_EQ(check_confined("dq", bc.dq, bb.dq, [&](int64_t i) { return q_side(i / (r.HQ * r.K), (i / r.K) % r.HQ, true); }), 0);
  EXPECT_EQ(check_confined("dg", bc.dg, bb.dg, [&](int64_t i) { return q_side(i / r.HQ, i % r.HQ, false); }), 0);
  EXPECT_EQ(check_confined("dk", bc.dk, bb.dk, [&](int64_t i) { return kv_side(i / (r.H * r.K), (i / r.K) % r.H); }), 0);
  EXPECT_EQ(check_confined("dv", bc.dv, bb.dv, [&](int64_t i) { return kv_side(i / (r.H * r.V), (i / r.V) % r.H); }), 0);
  EXPECT_EQ(check_confined("dw", bc.dw, bb.dw, [&](int64_t i) { return kv_side(i / (r.H * r.K), (i / r.K) % r.H); }), 0);
  EXPECT_EQ(check_confined("dbeta", bc.dbeta, bb.dbeta, [&](int64_t i) { return kv_side(i / r.H, i % r.H); }), 0);
  for (const HostTensor* t : {&bb.dq, &bb.dk, &bb.dv, &bb.dw, &bb.dbeta, &bb.dg}) EXPECT_TRUE(t->guards_intact());
}

TEST_P(Confinement, InfInOneBatchRow) {
  const auto [be, dt] = GetParam();
  CaseSpec s = base_spec(dt);
  s.B = 3;
  const Case clean = Case::make(s);
  Case bad = cast_case(clean, dt);
  const CaseSpec& r = clean.spec;
  const int64_t brow = 1, tp = 2, hbad = 0, cbad = 5, group = r.HQ / r.H;
  bad.v.set(((brow * r.T + tp) * r.H + hbad) * r.V + cbad, kInf);  // one channel of one value
  const bool exact = be == Backend::oracle;

  const FwdOut fc = run_fwd(clean, be), fb = run_fwd(bad, be);
  if (be == Backend::cpu && fc.status.code() == Code::unavailable) GTEST_SKIP() << fc.status.message();
  ASSERT_TRUE(fc.status.ok() && fb.status.ok()) << fc.status.message() << fb.status.message();
  // o[b, t, hq, c] is reached iff b = 1, t >= 2, hq in kv head 0's group and c = 5; lse never (no v in it).
  EXPECT_EQ(check_confined("o", fc.o, fb.o, [&](int64_t i) {
              const int64_t c = i % r.V, hq = (i / r.V) % r.HQ, t = (i / (r.V * r.HQ)) % r.T, b = i / (r.V * r.HQ * r.T);
              if (b == brow && t >= tp && hq / group == hbad && c == cbad) return 1;
              return b == brow && !exact ? -1 : 0;
            }), 0);
  EXPECT_EQ(check_confined("lse", fc.lse, fb.lse, [&](int64_t i) { return i / (r.HQ * r.T) == brow && !exact ? -1 : 0; }), 0);

  const HostTensor dout = random_dout(clean, 23);
  const BwdOut bc = run_bwd(clean, fc, dout, be), bb = run_bwd(bad, fb, dout, be);
  ASSERT_TRUE(bc.status.ok() && bb.status.ok()) << bc.status.message() << bb.status.message();
  // Batch rows 0 and 2 are untouched; in row 1 the score gradient of query t = 2 sees the Inf.
  auto other_rows = [&](int64_t per_pos) {
    return [=](int64_t i) { return (i / per_pos) / r.T == brow ? -1 : 0; };
  };
  EXPECT_EQ(check_confined("dq", bc.dq, bb.dq, [&](int64_t i) {
              const int64_t pos = i / (r.HQ * r.K), hq = (i / r.K) % r.HQ;
              if (pos / r.T != brow) return 0;
              return pos % r.T == tp && hq / group == hbad ? 1 : -1;
            }), 0);
  EXPECT_EQ(check_confined("dk", bc.dk, bb.dk, other_rows(r.H * r.K)), 0);
  EXPECT_EQ(check_confined("dv", bc.dv, bb.dv, other_rows(r.H * r.V)), 0);
  EXPECT_EQ(check_confined("dw", bc.dw, bb.dw, other_rows(r.H * r.K)), 0);
  EXPECT_EQ(check_confined("dbeta", bc.dbeta, bb.dbeta, other_rows(r.H)), 0);
  EXPECT_EQ(check_confined("dg", bc.dg, bb.dg, other_rows(r.HQ)), 0);
}

// ---------------------------------------------------------------------------------------------------
// The validating mode: non-finite inputs, beta outside [0, 2], | ||w_t|| - 1 | > 1e-2, named with the index.
// ---------------------------------------------------------------------------------------------------

struct BadValue {
  const char* what;
  std::function<void(Case&)> apply;
  std::string prefix;  // the message must start with this
};

std::vector<BadValue> bad_values(const CaseSpec& r) {
  auto idx4 = [r](int64_t b, int64_t t, int64_t h, int64_t d, int64_t N, int64_t D) {
    (void)r;
    return ((b * r.T + t) * N + h) * D + d;
  };
  return {
      {"NaN in k", [=](Case& c) { c.k.set(idx4(1, 3, 1, 5, r.H, r.K), kNaN); }, "k: non-finite value nan at [1, 3, 1, 5]"},
      {"-Inf in q", [=](Case& c) { c.q.set(idx4(0, 0, 2, 0, r.HQ, r.K), -kInf); }, "q: non-finite value -inf at [0, 0, 2, 0]"},
      {"Inf in v", [=](Case& c) { c.v.set(idx4(0, 4, 0, 7, r.H, r.V), kInf); }, "v: non-finite value inf at [0, 4, 0, 7]"},
      {"Inf in g", [=](Case& c) { c.g.set((0 * r.T + 4) * r.HQ + 3, kInf); }, "g: non-finite value inf at [0, 4, 3]"},
      {"NaN in w", [=](Case& c) { c.w.set(idx4(1, 1, 0, 3, r.H, r.K), kNaN); }, "w: non-finite value nan at [1, 1, 0, 3]"},
      {"NaN in beta", [=](Case& c) { c.beta.set((1 * r.T + 0) * r.H + 1, kNaN); }, "beta: non-finite value nan at [1, 0, 1]"},
      {"beta 2.5", [=](Case& c) { c.beta.set((1 * r.T + 2) * r.H + 0, 2.5); }, "beta: value 2.5 at [1, 2, 0] is outside [0, 2]"},
      {"beta -0.25", [=](Case& c) { c.beta.set((0 * r.T + 1) * r.H + 1, -0.25); }, "beta: value -0.25 at [0, 1, 1] is outside [0, 2]"},
      {"||w|| 1.1", [=](Case& c) {
         for (int64_t d = 0; d < r.K; ++d) c.w.set(idx4(0, 3, 1, d, r.H, r.K), 1.1 * c.w.get(idx4(0, 3, 1, d, r.H, r.K)));
       }, "w: row [0, 3, 1] has norm 1.1"},
      {"||w|| 0.95", [=](Case& c) {
         for (int64_t d = 0; d < r.K; ++d) c.w.set(idx4(1, 4, 0, d, r.H, r.K), 0.95 * c.w.get(idx4(1, 4, 0, d, r.H, r.K)));
       }, "w: row [1, 4, 0] has norm 0.95"},
  };
}

// Values the validating mode accepts: beta exactly 0 and 2, ||w|| off by 5e-3.
void edge_values(Case& c) {
  const CaseSpec& r = c.spec;
  c.beta.set(0, 0.0);
  c.beta.set(1, 2.0);
  for (int64_t d = 0; d < r.K; ++d) c.w.set(2 * r.K + d, 1.005 * c.w.get(2 * r.K + d));
}

TEST_P(Validation, ValidatingModeNamesTheArgumentAndIndex) {
  const Backend be = GetParam();
  const CaseSpec s = base_spec();
  const CaseSpec r = Case::make(s).spec;
  for (const BadValue& bv : bad_values(r)) {
    SCOPED_TRACE(bv.what);
    Case c = cast_case(Case::make(s), s.dtype);
    bv.apply(c);
    FwdCall f(c, be);
    f.p.validate = true;
    Snapshot sf(f.tensors());
    const Status a = f.run();
    EXPECT_EQ(int(a.code()), int(Code::invalid_argument));
    EXPECT_TRUE(starts_with(a.message(), bv.prefix)) << a.message();
    sf.expect_unchanged();
    BwdCall b(c, be);
    b.p.validate = true;
    Snapshot sb(b.tensors());
    const Status e = b.run();
    EXPECT_EQ(int(e.code()), int(Code::invalid_argument));
    EXPECT_TRUE(starts_with(e.message(), bv.prefix)) << e.message();
    sb.expect_unchanged();
  }
  {  // the backward also scans its output gradient
    BwdCall b(s, be);
    b.dout.set(7, kNaN);
    b.p.validate = true;
    Snapshot sb(b.tensors());
    const Status e = b.run();
    EXPECT_TRUE(starts_with(e.message(), "do: non-finite value nan at [0, 0, 0, 7]")) << e.message();
    sb.expect_unchanged();
  }
  // Legal values pass the validating mode; out-of-range ones are legal without it.
  Case edge = cast_case(Case::make(s), s.dtype);
  edge_values(edge);
  FwdCall ok(edge, be);
  ok.p.validate = true;
  const Status st = ok.run();
  Case wide = cast_case(Case::make(s), s.dtype);
  wide.beta.set(3, 2.5);
  FwdCall unchecked(wide, be);
  const Status st2 = unchecked.run();
  if (be == Backend::cpu && st.code() == Code::unavailable) GTEST_SKIP() << st.message();
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(st2.ok()) << st2.message();
}

std::string backend_param_name(const ::testing::TestParamInfo<Backend>& info) { return backend_name(info.param); }

INSTANTIATE_TEST_SUITE_P(Backends, Validation, ::testing::Values(Backend::oracle, Backend::cpu), backend_param_name);

INSTANTIATE_TEST_SUITE_P(Backends, Confinement,
                         ::testing::Combine(::testing::Values(Backend::oracle, Backend::cpu),
                                            ::testing::Values(DType::f64, DType::f32)),
                         [](const auto& info) {
                           return std::string(backend_name(std::get<0>(info.param))) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace pathattn::test
