// check/harness.cpp: implementation of the shared test machinery (see harness.h).
#include "check/harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>

#include "core/convert.h"

namespace pathattn::test {

namespace {
constexpr uint8_t kSentinel = 0xA5;
}

HostTensor::HostTensor(DType dt, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  const int64_t bytes = n * dtype_size(dt);
  buf_ = std::make_shared<std::vector<uint8_t>>(bytes + 2 * kGuard, kSentinel);
  std::memset(buf_->data() + kGuard, 0, bytes);
  view_.data = buf_->data() + kGuard;
  view_.dtype = dt;
  view_.ndim = int(shape.size());
  int64_t st = 1;
  for (int d = view_.ndim - 1; d >= 0; --d) {
    view_.shape[d] = shape[d];
    view_.stride[d] = st;
    st *= shape[d];
  }
}

double HostTensor::get(int64_t i) const { return core::load_elem<double>(view_.data, view_.dtype, i); }

void HostTensor::set(int64_t i, double x) {
  if (view_.dtype == DType::i32) static_cast<int32_t*>(view_.data)[i] = int32_t(x);
  else if (view_.dtype == DType::i64) static_cast<int64_t*>(view_.data)[i] = int64_t(x);
  else core::store_elem<double>(view_.data, view_.dtype, i, x);
}

std::vector<double> HostTensor::to_f64() const {
  std::vector<double> r(numel());
  for (int64_t i = 0; i < numel(); ++i) r[i] = get(i);
  return r;
}

void HostTensor::fill_f64(const std::vector<double>& x) {
  for (int64_t i = 0; i < numel(); ++i) set(i, x[i]);
}

void HostTensor::poison() {
  const int64_t n = numel();
  if (view_.dtype == DType::i32 || view_.dtype == DType::i64) {
    std::memset(view_.data, 0x7f, n * dtype_size(view_.dtype));
    return;
  }
  for (int64_t i = 0; i < n; ++i) set(i, std::nan(""));
}

bool HostTensor::guards_intact() const {
  if (!buf_) return true;
  const int64_t bytes = numel() * dtype_size(view_.dtype);
  for (int64_t i = 0; i < kGuard; ++i) {
    if ((*buf_)[i] != kSentinel || (*buf_)[kGuard + bytes + i] != kSentinel) return false;
  }
  return true;
}

HostTensor HostTensor::clone() const {
  HostTensor t;
  if (!buf_) return t;
  t.buf_ = std::make_shared<std::vector<uint8_t>>(*buf_);
  t.view_ = view_;
  t.view_.data = t.buf_->data() + kGuard;
  return t;
}

HostTensor HostTensor::cast(DType dt) const {
  std::vector<int64_t> shape(view_.shape, view_.shape + view_.ndim);
  HostTensor t(dt, shape);
  t.fill_f64(to_f64());
  return t;
}

std::string CaseSpec::name() const {
  std::ostringstream s;
  s << "B" << B << "_T" << T << "_HQ" << HQ << "_H" << H << "_K" << K << "_V" << V << (path ? "_path" : "_plain")
    << (gate ? "_gate" : "") << "_" << dtype_name(dtype);
  if (!seqlens.empty()) {
    s << "_varlen";
    for (int64_t l : seqlens) s << "-" << l;
  }
  static const char* bm[] = {"beta_u02", "beta_2", "beta_0", "beta_near2"};
  s << "_" << bm[int(beta)] << "_seed" << seed;
  if (q_scale != 1) s << "_qx" << q_scale;
  if (do_scale != 1) s << "_dox" << do_scale;
  return s.str();
}

Case Case::make(const CaseSpec& s0) {
  Case c;
  c.spec = s0;
  CaseSpec& s = c.spec;
  if (!s.seqlens.empty()) {
    s.B = 1;
    s.T = std::accumulate(s.seqlens.begin(), s.seqlens.end(), int64_t(0));
  }
  std::mt19937_64 rng(s.seed * 0x9E3779B97F4A7C15ull + 12345);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  const DType fdt = s.dtype == DType::f64 ? DType::f64 : DType::f32;
  auto randn = [&](HostTensor& t, double scale = 1) {
    for (int64_t i = 0; i < t.numel(); ++i) t.set(i, scale * nd(rng));
  };
  c.q = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.K});
  c.k = HostTensor(s.dtype, {s.B, s.T, s.H, s.K});
  c.v = HostTensor(s.dtype, {s.B, s.T, s.H, s.V});
  randn(c.q, s.q_scale);
  randn(c.k);
  randn(c.v);
  if (s.path) {
    c.w = HostTensor(fdt, {s.B, s.T, s.H, s.K});
    c.beta = HostTensor(fdt, {s.B, s.T, s.H});
    std::vector<double> row(s.K);
    for (int64_t r = 0; r < s.B * s.T * s.H; ++r) {
      double n2 = 0;
      for (auto& x : row) { x = nd(rng); n2 += x * x; }
      for (int64_t d = 0; d < s.K; ++d) c.w.set(r * s.K + d, row[d] / std::sqrt(n2));
    }
    for (int64_t i = 0; i < c.beta.numel(); ++i) {
      double b = 0;
      switch (s.beta) {
        case BetaMode::uniform02: b = 2.0 * ud(rng); break;
        case BetaMode::two: b = 2.0; break;
        case BetaMode::zero: b = 0.0; break;
        case BetaMode::near2: b = 2.0 - 0.02 * ud(rng); break;
      }
      c.beta.set(i, b);
    }
  }
  if (s.gate) {
    c.g = HostTensor(fdt, {s.B, s.T, s.HQ});
    for (int64_t i = 0; i < c.g.numel(); ++i) {
      double x = nd(rng) + 3.0;
      c.g.set(i, -std::log1p(std::exp(-x)));  // logsigmoid
    }
  }
  if (!s.seqlens.empty()) {
    c.cu = HostTensor(DType::i64, {int64_t(s.seqlens.size()) + 1});
    int64_t acc = 0;
    c.cu.set(0, 0);
    for (size_t i = 0; i < s.seqlens.size(); ++i) {
      acc += s.seqlens[i];
      c.cu.set(int64_t(i) + 1, double(acc));
    }
  }
  return c;
}

PathFwdParams Case::fwd_params(const HostTensor& o, const HostTensor* lse) const {
  PathFwdParams p;
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  if (spec.path) {
    p.w = w.view();
    p.beta = beta.view();
  }
  if (spec.gate) p.g = g.view();
  if (cu.present()) p.cu_seqlens = cu.view();
  p.gate_scale = spec.gate_scale;
  p.o = o.view();
  if (lse) p.lse = lse->view();
  return p;
}

FwdOut run_fwd(const Case& c, Backend backend, int num_threads, int chunk_size) {
  const CaseSpec& s = c.spec;
  FwdOut f;
  f.o = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.V});
  f.lse = HostTensor(s.dtype == DType::f64 ? DType::f64 : DType::f32, {s.B, s.T, s.HQ});
  f.o.poison();
  f.lse.poison();
  PathFwdParams p = c.fwd_params(f.o, &f.lse);
  p.backend = backend;
  p.num_threads = num_threads;
  p.chunk_size = chunk_size;
  f.status = path_attn_fwd(p);
  return f;
}

HostTensor random_dout(const Case& c, uint64_t seed) {
  const CaseSpec& s = c.spec;
  HostTensor d(s.dtype, {s.B, s.T, s.HQ, s.V});
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int64_t i = 0; i < d.numel(); ++i) d.set(i, s.do_scale * nd(rng));
  return d;
}

HostTensor gather_t(const HostTensor& x, const std::vector<int64_t>& rows, int64_t B, int64_t Tn) {
  const TensorView v = x.view();
  std::vector<int64_t> shape(v.shape, v.shape + v.ndim);
  shape[0] = B;
  shape[1] = Tn;
  HostTensor out(x.dtype(), shape);
  const int64_t inner = v.stride[1];
  for (size_t r = 0; r < rows.size(); ++r)
    for (int64_t e = 0; e < inner; ++e) out.set(int64_t(r) * inner + e, x.get(rows[r] * inner + e));
  return out;
}

Case sub_case(const Case& full, const std::vector<int64_t>& rows, int64_t B, int64_t Tn, std::vector<int64_t> seqlens) {
  Case c;
  c.spec = full.spec;
  c.spec.B = B;
  c.spec.T = Tn;
  c.spec.seqlens = seqlens;
  c.q = gather_t(full.q, rows, B, Tn);
  c.k = gather_t(full.k, rows, B, Tn);
  c.v = gather_t(full.v, rows, B, Tn);
  if (full.spec.path) {
    c.w = gather_t(full.w, rows, B, Tn);
    c.beta = gather_t(full.beta, rows, B, Tn);
  }
  if (full.spec.gate) c.g = gather_t(full.g, rows, B, Tn);
  if (!seqlens.empty()) {
    c.cu = HostTensor(DType::i64, {int64_t(seqlens.size()) + 1});
    int64_t acc = 0;
    c.cu.set(0, 0);
    for (size_t n = 0; n < seqlens.size(); ++n) c.cu.set(int64_t(n) + 1, double(acc += seqlens[n]));
  }
  return c;
}

Case to_f64(const Case& c) {
  Case d = c;
  d.spec.dtype = DType::f64;
  auto cv = [](const HostTensor& h) { return h.present() ? h.cast(DType::f64) : HostTensor(); };
  d.q = cv(c.q);
  d.k = cv(c.k);
  d.v = cv(c.v);
  d.w = cv(c.w);
  d.beta = cv(c.beta);
  d.g = cv(c.g);
  return d;
}

TensorView slice_t(const TensorView& x, int64_t t0, int64_t len) {
  TensorView s = x;
  if (!x.present()) return s;
  s.data = static_cast<char*>(x.data) + t0 * x.stride[1] * dtype_size(x.dtype);
  s.shape[1] = len;
  return s;
}

BwdOut run_bwd(const Case& c, const FwdOut& f, const HostTensor& dout, Backend backend, int num_threads,
               int chunk_size) {
  const CaseSpec& s = c.spec;
  BwdOut b;
  b.dq = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.K});
  b.dk = HostTensor(s.dtype, {s.B, s.T, s.H, s.K});
  b.dv = HostTensor(s.dtype, {s.B, s.T, s.H, s.V});
  PathBwdParams p = bwd_params_for(c.fwd_params(f.o, &f.lse));
  if (s.path) {
    b.dw = HostTensor(c.w.dtype(), {s.B, s.T, s.H, s.K});  // gradients in the dtype of their input
    b.dbeta = HostTensor(c.beta.dtype(), {s.B, s.T, s.H});
    b.dw.poison();
    b.dbeta.poison();
    p.dw = b.dw.view();
    p.dbeta = b.dbeta.view();
  }
  if (s.gate) {
    b.dg = HostTensor(c.g.dtype(), {s.B, s.T, s.HQ});
    b.dg.poison();
    p.dg = b.dg.view();
  }
  p.do_ = dout.view();
  b.dq.poison();
  b.dk.poison();
  b.dv.poison();
  p.dq = b.dq.view();
  p.dk = b.dk.view();
  p.dv = b.dv.view();
  p.backend = backend;
  p.num_threads = num_threads;
  p.chunk_size = chunk_size;
  b.status = path_attn_bwd(p);
  return b;
}

double rel_l2(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (!std::isfinite(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double max_rel(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double e = std::fabs(a[i] - ref[i]);
    if (std::isnan(e)) return INFINITY;  // a later finite element must not hide a NaN
    num = std::max(num, e);
    den = std::max(den, std::fabs(ref[i]));
  }
  if (!std::isfinite(num)) return INFINITY;
  return den > 0 ? num / den : num;
}

bool all_finite(const std::vector<double>& a) {
  return std::all_of(a.begin(), a.end(), [](double x) { return std::isfinite(x); });
}

}  // namespace pathattn::test
