// check/oracle_chain.cpp: the oracle chain (see oracle_chain.h): awkward random cases and the
// candidate-vs-oracle comparison in fp64 and fp32, used by the ctest suite and `pathattn check`.
#include "check/oracle_chain.h"

#include <algorithm>
#include <cmath>

namespace pathattn::test {

namespace {

template <typename T>
T pick(std::mt19937_64& rng, std::initializer_list<T> xs) {
  return *(xs.begin() + std::uniform_int_distribution<size_t>(0, xs.size() - 1)(rng));
}

// Sequence lengths summing to T with at least one empty and one length-1 sequence, in random order.
std::vector<int64_t> draw_seqlens(std::mt19937_64& rng, int64_t T) {
  std::vector<int64_t> lens = {0, 1};
  const int64_t rest = T - 1, parts = 1 + int64_t(rng() % 3);
  std::vector<int64_t> cuts = {0, rest};
  for (int64_t i = 1; i < parts; ++i) cuts.push_back(std::uniform_int_distribution<int64_t>(0, rest)(rng));
  std::sort(cuts.begin(), cuts.end());
  for (size_t i = 1; i < cuts.size(); ++i) lens.push_back(cuts[i] - cuts[i - 1]);
  std::shuffle(lens.begin(), lens.end(), rng);
  return lens;
}

// Outputs of one backend on one case: forward and backward.
struct Run {
  FwdOut f;
  BwdOut b;
  Status status;
};

Run run_both(const Case& c, const HostTensor& dout, Backend be, int num_threads, int chunk_size = 0) {
  Run r;
  r.f = run_fwd(c, be, num_threads, chunk_size);
  if (!r.f.status.ok()) {
    r.status = r.f.status;
    return r;
  }
  r.b = run_bwd(c, r.f, dout, be, num_threads, chunk_size);
  r.status = r.b.status;
  return r;
}

// Appends the comparisons of every tensor the case has.
void compare_runs(const CaseSpec& s, const std::string& precision, bool l2, const Run& got, const Run& ref,
                  std::vector<TensorCheck>* out) {
  const double fwd_bound = l2 ? kFp32RelL2Fwd : kFp64MaxRel, grad_bound = l2 ? kFp32RelL2Grad : kFp64MaxRel;
  struct Item { const char* name; const HostTensor* a; const HostTensor* r; double bound; };
  std::vector<Item> items = {{"o", &got.f.o, &ref.f.o, fwd_bound}, {"lse", &got.f.lse, &ref.f.lse, fwd_bound},
                             {"dq", &got.b.dq, &ref.b.dq, grad_bound}, {"dk", &got.b.dk, &ref.b.dk, grad_bound},
                             {"dv", &got.b.dv, &ref.b.dv, grad_bound}};
  if (s.path) {
    items.push_back({"dw", &got.b.dw, &ref.b.dw, grad_bound});
    items.push_back({"dbeta", &got.b.dbeta, &ref.b.dbeta, grad_bound});
  }
  if (s.gate) items.push_back({"dg", &got.b.dg, &ref.b.dg, grad_bound});
  for (const Item& it : items) {
    TensorCheck t = compare_tensor(precision, it.name, l2, it.a->to_f64(), it.r->to_f64(), it.bound);
    if (!it.a->guards_intact()) {  // an out-of-bounds write fails the tensor whatever its values
      t.pass = false;
      t.note = "guard region overwritten";
    }
    out->push_back(t);
  }
}

}  // namespace

CaseSpec draw_check_spec(std::mt19937_64& rng) {
  CaseSpec s;
  s.T = pick<int64_t>(rng, {1, 7, 63, 64, 65, 200});
  s.K = pick<int64_t>(rng, {8, 16, 24, 32, 40, 64, 128, 256});
  s.V = rng() % 2 ? s.K : pick<int64_t>(rng, {8, 16, 32, 48, 64, 128, 256});
  s.H = pick<int64_t>(rng, {1, 2});
  s.HQ = s.H * pick<int64_t>(rng, {1, 2, 4});
  if (rng() % 3 == 0) {
    s.seqlens = draw_seqlens(rng, s.T);
    s.B = 1;
  } else {
    s.B = pick<int64_t>(rng, {1, 2});
  }
  s.path = true;
  s.gate = rng() % 2;
  s.beta = pick<BetaMode>(rng, {BetaMode::uniform02, BetaMode::uniform02, BetaMode::two, BetaMode::near2});
  s.gate_scale = rng() % 4 == 0 ? 1.0 : kDefaultScale;
  s.dtype = DType::f64;
  s.seed = rng() >> 16;
  return s;
}

bool CaseCheck::pass() const {
  if (!status.ok() || tensors.empty()) return false;
  return std::all_of(tensors.begin(), tensors.end(), [](const TensorCheck& t) { return t.pass; });
}

TensorCheck compare_tensor(const std::string& precision, const std::string& tensor, bool l2,
                           const std::vector<double>& got, const std::vector<double>& ref, double bound) {
  TensorCheck t;
  t.precision = precision;
  t.tensor = tensor;
  t.metric = l2 ? "rel_l2" : "max_rel";
  t.bound = bound;
  const bool comparable = got.size() == ref.size() && all_finite(got);
  t.error = comparable ? (l2 ? rel_l2(got, ref) : max_rel(got, ref)) : INFINITY;
  t.pass = std::isfinite(t.error) && t.error <= bound;
  return t;
}

Case cast_case(const Case& c, DType dt) {
  Case r = c;
  const DType fdt = dt == DType::f64 ? DType::f64 : DType::f32;
  r.spec.dtype = dt;
  r.q = c.q.cast(dt);
  r.k = c.k.cast(dt);
  r.v = c.v.cast(dt);
  if (c.spec.path) {
    r.w = c.w.cast(fdt);
    r.beta = c.beta.cast(fdt);
  }
  if (c.spec.gate) r.g = c.g.cast(fdt);
  return r;
}

CaseCheck check_case(const CaseSpec& spec, Backend candidate, int num_threads, int chunk_size) {
  CaseCheck cc;
  CaseSpec s = spec;
  s.dtype = DType::f64;
  const Case c64 = Case::make(s);
  cc.spec = c64.spec;
  const HostTensor dout64 = random_dout(c64, s.seed + 7);

  // fp64: the same inputs through both.
  const Run ref64 = run_both(c64, dout64, Backend::oracle, num_threads);
  if (!ref64.status.ok()) {
    cc.status = Status(ref64.status.code(), "oracle: " + ref64.status.message());
    return cc;
  }
  const Run got64 = run_both(c64, dout64, candidate, num_threads, chunk_size);
  if (!got64.status.ok()) {
    cc.status = got64.status;
    return cc;
  }
  compare_runs(cc.spec, "fp64", false, got64, ref64, &cc.tensors);

  // fp32: the candidate on f32 inputs, the oracle on exactly those values held in f64.
  const Case c32 = cast_case(c64, DType::f32);
  const Case c32_in_f64 = cast_case(c32, DType::f64);
  const HostTensor dout32 = dout64.cast(DType::f32);
  const Run ref32 = run_both(c32_in_f64, dout32.cast(DType::f64), Backend::oracle, num_threads);
  if (!ref32.status.ok()) {
    cc.status = Status(ref32.status.code(), "oracle: " + ref32.status.message());
    return cc;
  }
  const Run got32 = run_both(c32, dout32, candidate, num_threads, chunk_size);
  if (!got32.status.ok()) {
    cc.status = got32.status;
    return cc;
  }
  compare_runs(cc.spec, "fp32", true, got32, ref32, &cc.tensors);
  return cc;
}

}  // namespace pathattn::test
