// cpu/paged.cpp: the paged, lazily transported decode cache on the host (include/pathattn/paged.h), for the
// oracle and cpu backends alike. Prefill runs the dense prefill (cpu/decode.cpp) into fp32 temporaries and
// scatters them into pages; a decode step carries its query back across the pending factors and flushes them
// into the slot's keys every S tokens, step by step as the CUDA kernels do: fp32 math (gate cumsums fp64), keys
// rounded to the page dtype at each flush. One work unit per (slot, kv head): results never depend on threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/convert.h"
#include "core/problem.h"
#include "cpu/cpu_backend.h"

namespace pathattn::cpu {
namespace {

using core::PagedGeometry;
using core::Problem;

// a . b over n floats (n a multiple of 8): eight partial sums in a fixed order.
float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {};
  for (int64_t i = 0; i < n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// x <- x - beta (w . x) w: one factor H = I - beta w w^T applied to a K-vector.
void reflect(float* x, const float* w, float beta, int64_t K) {
  const float c = beta * dot(w, x, K);
  for (int64_t e = 0; e < K; ++e) x[e] -= c * w[e];
}

// D elements at offset `off` of a float view (f32, f16, bf16) to / from fp32; stores round to the view's dtype.
void load_f32(const TensorView& x, int64_t off, int64_t D, float* dst) {
  if (x.dtype == DType::f32) {
    std::memcpy(dst, static_cast<const float*>(x.data) + off, size_t(D) * sizeof(float));
    return;
  }
  for (int64_t d = 0; d < D; ++d) dst[d] = core::load_elem<float>(x.data, x.dtype, off + d);
}
void store_f32(const TensorView& x, int64_t off, int64_t D, const float* src) {
  if (x.dtype == DType::f32) {
    std::memcpy(static_cast<float*>(x.data) + off, src, size_t(D) * sizeof(float));
    return;
  }
  for (int64_t d = 0; d < D; ++d) core::store_elem<float>(x.data, x.dtype, off + d, src[d]);
}

// Slot token j of a page tensor [P, page, H(Q), ...]: block_table row `row` of the slot.
struct SlotPages {
  const int32_t* row;
  int64_t page;
  int64_t at(const TensorView& x, int64_t j, int64_t h) const {
    return row[j / page] * x.stride[0] + (j % page) * x.stride[1] + h * x.stride[2];
  }
};

// The slot's metadata at the call's start, read once on the host.
struct SlotMeta {
  int64_t len = -1, flushed = 0;
  bool ok = false;  // not free, and its metadata allows the call (else its outputs are NaN)
  const int32_t* row = nullptr;
};

// Per-thread scratch of a (slot, kv head) unit, reused across calls.
struct Scratch {
  std::vector<float> u, k, w, x, v, P, r, s, acc, xs;
  std::vector<double> gnew;
};
Scratch& scratch() {
  thread_local Scratch sc;
  return sc;
}

// The flush of slot pages sp, kv head h, flush point m and L tokens (L - m == S pending, path only):
//   P = H_{L-1} ... H_m (fp32, built left to right: P <- P - beta_t w_t (w_t^T P), t = m .. L-1);
//   kc_j <- P kc_j for j < m (the page row converted to fp32, rounded back);
//   pending x_j = k_j, j in [m, L): x_j <- H_t x_j for t = m+1 .. L-1 (pending j < t), then page row j <- x_j.
void flush(const PagedCache& c, const Problem& pr, const SlotPages& sp, int64_t n, int64_t h, int64_t L, int64_t m,
           Scratch& sc) {
  const int64_t K = pr.K;
  const TensorView &pk = c.pend_k, &pw = c.pend_w, &pb = c.pend_beta;
  auto prow = [&](const TensorView& x, int64_t i) { return static_cast<const float*>(x.data) + core::offset3(x, n, i, h); };
  auto pbeta = [&](int64_t i) { return static_cast<const float*>(pb.data)[core::offset3(pb, n, i, h)]; };
  float* P = sc.P.data();
  float* r = sc.r.data();
  float* x = sc.x.data();
  std::fill(P, P + K * K, 0.f);
  for (int64_t e = 0; e < K; ++e) P[e * K + e] = 1.f;
  for (int64_t t = m; t < L; ++t) {
    const float* w = prow(pw, t - m);
    const float b = pbeta(t - m);
    std::fill(r, r + K, 0.f);
    for (int64_t e = 0; e < K; ++e)  // r = w^T P, each entry summed over e in order
      for (int64_t col = 0; col < K; ++col) r[col] += w[e] * P[e * K + col];
    for (int64_t e = 0; e < K; ++e) {
      const float bw = b * w[e];
      for (int64_t col = 0; col < K; ++col) P[e * K + col] -= bw * r[col];
    }
  }
  for (int64_t j = 0; j < m; ++j) {
    const int64_t off = sp.at(c.k_pages, j, h);
    load_f32(c.k_pages, off, K, x);
    for (int64_t e = 0; e < K; ++e) r[e] = dot(P + e * K, x, K);
    store_f32(c.k_pages, off, K, r);
  }
  const int64_t np = L - m;
  float* xs = sc.xs.data();  // [np, K] the pending keys
  for (int64_t i = 0; i < np; ++i) std::memcpy(xs + i * K, prow(pk, i), size_t(K) * sizeof(float));
  for (int64_t t = m + 1; t < L; ++t)
    for (int64_t j = m; j < t; ++j) reflect(xs + (j - m) * K, prow(pw, t - m), pbeta(t - m), K);
  for (int64_t j = m; j < L; ++j) store_f32(c.k_pages, sp.at(c.k_pages, j, h), K, xs + (j - m) * K);
}

// Outputs of token t of slot n for the group of kv head h: o = x, lse = l (a free slot's zeros and -inf, or a
// bad slot's NaN).
void fill_outputs(const PathPagedDecodeParams& p, const Problem& pr, int64_t n, int64_t h, float x, float l) {
  for (int64_t t = 0; t < pr.T; ++t)
    for (int64_t hq = h * pr.group; hq < (h + 1) * pr.group; ++hq) {
      const int64_t off = core::offset3(p.o, n, t, hq);
      for (int64_t e = 0; e < pr.V; ++e) core::store_elem<float>(p.o.data, p.o.dtype, off + e, x);
      if (p.lse.present()) core::store_elem<float>(p.lse.data, p.lse.dtype, core::offset3(p.lse, n, t, hq), l);
    }
}

// One step of slot n, kv head h: token i = L (row t of the step's inputs), flush point m (after any flush).
// Scores, softmax and outputs for the group's query heads, then the token joins the cache (pending rows with
// w, the key pages without). The caller advances L and m.
void step(const PathPagedDecodeParams& p, const Problem& pr, const SlotPages& sp, int64_t n, int64_t h, int64_t t,
          int64_t L, int64_t m, Scratch& sc) {
  const PagedCache& c = p.cache;
  const int64_t K = pr.K, V = pr.V, G = pr.group, NJ = L + 1;
  float *k = sc.k.data(), *w = sc.w.data(), *x = sc.x.data(), *v = sc.v.data();
  core::load_rows(p.k, n, t, 1, h, K, k, K);
  core::load_rows(p.v, n, t, 1, h, V, v, V);
  float beta = 0;
  if (pr.path) {
    core::load_rows(p.w, n, t, 1, h, K, w, K);
    beta = core::load_elem<float>(p.beta.data, p.beta.dtype, core::offset3(p.beta, n, t, h));
  }
  auto prow = [&](const TensorView& y, int64_t j) { return static_cast<const float*>(y.data) + core::offset3(y, n, j - m, h); };
  auto pbeta = [&](int64_t j) { return static_cast<const float*>(c.pend_beta.data)[core::offset3(c.pend_beta, n, j - m, h)]; };
  float* s = sc.s.data();  // [G, NJ] raw scores q . (H_i ... H_{j+1} k_j)
  for (int64_t gi = 0; gi < G; ++gi) {
    float* u = sc.u.data() + gi * K;
    core::load_rows(p.q, n, t, 1, h * G + gi, K, u, K);
    for (int64_t j = L; j >= m; --j) {  // the sweep: the new token, then the pending ones, descending
      const float* kj = j == L ? k : prow(c.pend_k, j);
      s[gi * NJ + j] = dot(u, kj, K);
      if (pr.path) reflect(u, j == L ? w : prow(c.pend_w, j), j == L ? beta : pbeta(j), K);
    }
  }
  for (int64_t j = 0; j < m; ++j) {  // flushed keys against u = H_m ... H_i q_i
    load_f32(c.k_pages, sp.at(c.k_pages, j, h), K, x);
    for (int64_t gi = 0; gi < G; ++gi) s[gi * NJ + j] = dot(sc.u.data() + gi * K, x, K);
  }
  const float scale = float(pr.scale);
  float* acc = sc.acc.data();
  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t hq = h * G + gi;
    float* z = s + gi * NJ;
    if (pr.gate) {
      const double gl = L > 0 ? static_cast<const double*>(c.g_pages.data)[sp.at(c.g_pages, L - 1, hq)] : 0.0;
      sc.gnew[gi] = gl + core::load_elem<double>(p.g.data, p.g.dtype, core::offset3(p.g, n, t, hq));
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < NJ; ++j) {
      z[j] = scale * z[j];
      if (pr.gate) {
        const double Gj = j == L ? sc.gnew[gi] : static_cast<const double*>(c.g_pages.data)[sp.at(c.g_pages, j, hq)];
        z[j] += float(pr.gate_scale * (sc.gnew[gi] - Gj));  // the difference in fp64, rounded once
      }
      mx = std::max(mx, z[j]);
    }
    const float shift = mx == -std::numeric_limits<float>::infinity() ? 0.f : mx;  // a closed gate: no NaN
    float den = 0;
    for (int64_t j = 0; j < NJ; ++j) {
      z[j] = std::exp(z[j] - shift);
      den += z[j];
    }
    float* a = acc + gi * V;
    std::fill(a, a + V, 0.f);
    for (int64_t j = 0; j < NJ; ++j) {
      const float* vj = v;
      if (j < L) {
        load_f32(c.v_pages, sp.at(c.v_pages, j, h), V, x);  // x has room: V <= 256 as K
        vj = x;
      }
      for (int64_t e = 0; e < V; ++e) a[e] += z[j] * vj[e];
    }
    const int64_t off = core::offset3(p.o, n, t, hq);
    for (int64_t e = 0; e < V; ++e) core::store_elem<float>(p.o.data, p.o.dtype, off + e, a[e] / den);
    if (p.lse.present()) {
      core::store_elem<float>(p.lse.data, p.lse.dtype, core::offset3(p.lse, n, t, hq), mx + std::log(den));
    }
  }
  // Append token i: values and gate cumsums to the pages; the key to the pending rows (path) or its page.
  store_f32(c.v_pages, sp.at(c.v_pages, L, h), V, v);
  for (int64_t gi = 0; gi < G && pr.gate; ++gi)
    static_cast<double*>(c.g_pages.data)[sp.at(c.g_pages, L, h * G + gi)] = sc.gnew[gi];
  if (pr.path) {
    const int64_t r = core::offset3(c.pend_k, n, L - m, h);
    std::memcpy(static_cast<float*>(c.pend_k.data) + r, k, size_t(K) * sizeof(float));
    std::memcpy(static_cast<float*>(c.pend_w.data) + core::offset3(c.pend_w, n, L - m, h), w, size_t(K) * sizeof(float));
    static_cast<float*>(c.pend_beta.data)[core::offset3(c.pend_beta, n, L - m, h)] = beta;
  } else {
    store_f32(c.k_pages, sp.at(c.k_pages, L, h), K, k);
  }
}

// The T steps of slot n, kv head h, in order; flush before a step that finds S tokens pending.
void decode_unit(const PathPagedDecodeParams& p, const Problem& pr, const PagedGeometry& g, int64_t n, int64_t h,
                 const SlotMeta& sm) {
  if (!sm.ok) {
    if (sm.len == -1) fill_outputs(p, pr, n, h, 0.f, -std::numeric_limits<float>::infinity());
    else fill_outputs(p, pr, n, h, std::nanf(""), std::nanf(""));
    return;
  }
  const int64_t K = pr.K, G = pr.group, NJ = sm.len + pr.T;
  Scratch& sc = scratch();
  for (std::vector<float>* b : {&sc.k, &sc.w, &sc.x, &sc.v, &sc.r}) b->resize(size_t(std::max(K, pr.V)));
  sc.u.resize(size_t(G * K));
  sc.P.resize(size_t(K * K));
  sc.xs.resize(size_t(g.S * K));
  sc.s.resize(size_t(G * NJ));
  sc.acc.resize(size_t(G * pr.V));
  sc.gnew.resize(size_t(G));
  const SlotPages sp{sm.row, g.page};
  int64_t L = sm.len, m = sm.flushed;
  for (int64_t t = 0; t < pr.T; ++t) {
    if (pr.path && L - m == g.S) {
      flush(p.cache, pr, sp, n, h, L, m, sc);
      m = L;
    }
    step(p, pr, sp, n, h, t, L, m, sc);
    ++L;
    if (!pr.path) m = L;
  }
}

}  // namespace

Status paged_decode(const PathPagedDecodeParams& p, const core::Problem& pr) {
  const PagedCache& c = p.cache;
  PagedGeometry g;
  g.N = pr.B;
  g.P = c.k_pages.shape[0];
  g.page = c.k_pages.shape[1];
  g.max_pages = c.block_table.shape[1];
  g.S = c.pend_k.shape[1];
  // The metadata, read once: a slot whose values are out of range is skipped with NaN outputs (the entry has
  // refused them already when validating).
  std::vector<SlotMeta> meta(size_t(g.N));
  const int32_t* lp = static_cast<const int32_t*>(c.lengths.data);
  const int32_t* fp = static_cast<const int32_t*>(c.flushed.data);
  for (int64_t n = 0; n < g.N; ++n) {
    SlotMeta& sm = meta[size_t(n)];
    sm.len = lp[n * c.lengths.stride[0]];
    sm.flushed = fp[n * c.flushed.stride[0]];
    sm.row = static_cast<const int32_t*>(c.block_table.data) + n * c.block_table.stride[0];
    sm.ok = sm.len != -1 && core::paged_slot_error(g, pr.path, pr.T, n, sm.len, sm.flushed, sm.row).empty();
  }
  parallel_for(g.N * pr.H, p.num_threads, [&](int64_t u) {
    decode_unit(p, pr, g, u / pr.H, u % pr.H, meta[size_t(u / pr.H)]);
  });
  int32_t* lw = static_cast<int32_t*>(c.lengths.data);
  int32_t* fw = static_cast<int32_t*>(c.flushed.data);
  for (int64_t n = 0; n < g.N; ++n) {
    const SlotMeta& sm = meta[size_t(n)];
    if (!sm.ok) continue;
    int64_t L = sm.len, m = sm.flushed;  // the units' walk of the flush point
    for (int64_t t = 0; t < pr.T; ++t) {
      if (pr.path && L - m == g.S) m = L;
      ++L;
      if (!pr.path) m = L;
    }
    lw[n * c.lengths.stride[0]] = int32_t(L);
    fw[n * c.flushed.stride[0]] = int32_t(m);
  }
  return Status::Ok();
}

// Sequences go through the dense prefill in groups whose fp32 temporaries stay under this many bytes (at least
// one sequence a group).
constexpr int64_t kPrefillTempBytes = int64_t(256) << 20;

Status paged_prefill(const PathPagedPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& seqs,
                     const std::vector<int32_t>& slots) {
  const PagedCache& c = p.cache;
  const int64_t H = pr.H, HQ = pr.HQ, K = pr.K, V = pr.V, page = c.k_pages.shape[1];
  const int64_t per_row = H * (K + V) * 4 + (pr.gate ? HQ * 8 : 0);  // temporary bytes per token
  for (size_t a = 0; a < seqs.size();) {
    size_t b = a;
    int64_t C = 0;
    while (b < seqs.size() && (b == a || int64_t(b + 1 - a) * std::max(C, seqs[b].len) * per_row <= kPrefillTempBytes)) {
      C = std::max(C, seqs[b].len);
      ++b;
    }
    const int64_t ns = int64_t(b - a);
    std::vector<float> kc(size_t(ns * H * C * K)), vc(size_t(ns * H * C * V));
    std::vector<double> gc(pr.gate ? size_t(ns * HQ * C) : 0);
    PathPrefillParams dp;
    dp.fwd = p.fwd;
    dp.cache.kc = make_view(kc.data(), DType::f32, {ns, H, C, K});
    dp.cache.vc = make_view(vc.data(), DType::f32, {ns, H, C, V});
    if (pr.gate) dp.cache.gc = make_view(gc.data(), DType::f64, {ns, HQ, C});
    const std::vector<core::Seq> group(seqs.begin() + a, seqs.begin() + b);
    PA_TRY(prefill(dp, pr, group));
    parallel_for(ns * H, p.fwd.num_threads, [&](int64_t u) {  // scatter (sequence, kv head) u into its slot's pages
      const int64_t i = u / H, h = u % H, len = group[size_t(i)].len, n = slots[a + size_t(i)];
      const SlotPages sp{static_cast<const int32_t*>(c.block_table.data) + n * c.block_table.stride[0], page};
      for (int64_t j = 0; j < len; ++j) {
        store_f32(c.k_pages, sp.at(c.k_pages, j, h), K, &kc[size_t(((i * H + h) * C + j) * K)]);
        store_f32(c.v_pages, sp.at(c.v_pages, j, h), V, &vc[size_t(((i * H + h) * C + j) * V)]);
        for (int64_t hq = h * pr.group; hq < (h + 1) * pr.group && pr.gate; ++hq)
          static_cast<double*>(c.g_pages.data)[sp.at(c.g_pages, j, hq)] = gc[size_t((i * HQ + hq) * C + j)];
      }
    });
    a = b;
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    static_cast<int32_t*>(c.lengths.data)[slots[i] * c.lengths.stride[0]] = int32_t(seqs[i].len);
    static_cast<int32_t*>(c.flushed.data)[slots[i] * c.flushed.stride[0]] = int32_t(seqs[i].len);
  }
  return Status::Ok();
}

}  // namespace pathattn::cpu
