// cpu/oracle.cpp: the fp64 brute-force oracle, forward and backward, straight from docs/spec.md.
// For each query i the transported query a_j = q_i H_i ... H_{j+1} is built one Householder step at a time
// (a_{j-1} = a_j - beta_j (a_j . w_j) w_j), so every logit is exact up to fp64 rounding. O(T^2 K) time.
// The backward is reverse-mode through exactly these steps (it keeps the a_j of one query: O(T K) scratch).
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "core/convert.h"
#include "cpu/cpu_backend.h"

namespace pathattn::cpu {
namespace {

using core::load_col;
using core::load_rows;
using core::Problem;
using core::Seq;
using core::store_col;
using core::store_rows;

// fp64 copies of one sequence's inputs for one kv head h and its query heads.
struct SeqData {
  int64_t L = 0;
  std::vector<double> k, v, w, beta;  // [L, K], [L, V], [L, K], [L]
};

void load_kv(const TensorView& k, const TensorView& v, const TensorView& w, const TensorView& beta,
             const Problem& pr, const Seq& s, int64_t h, SeqData* d) {
  d->L = s.len;
  d->k.resize(s.len * pr.K);
  d->v.resize(s.len * pr.V);
  load_rows(k, s.b, s.t0, s.len, h, pr.K, d->k.data(), pr.K);
  load_rows(v, s.b, s.t0, s.len, h, pr.V, d->v.data(), pr.V);
  if (pr.path) {
    d->w.resize(s.len * pr.K);
    d->beta.resize(s.len);
    load_rows(w, s.b, s.t0, s.len, h, pr.K, d->w.data(), pr.K);
    load_col(beta, s.b, s.t0, s.len, h, d->beta.data());
  }
}

// Inclusive cumsum of g over the sequence for query head hq (zeros without a gate).
std::vector<double> gate_cumsum(const TensorView& g, const Problem& pr, const Seq& s, int64_t hq) {
  std::vector<double> G(s.len, 0.0);
  if (!pr.gate) return G;
  load_col(g, s.b, s.t0, s.len, hq, G.data());
  for (int64_t t = 1; t < s.len; ++t) G[t] += G[t - 1];
  return G;
}

inline double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Scores s(i, j) for j = 0..i of query i (row q), written to s[0..i]; the transported queries a_j are
// written to a[j * K] when a != nullptr.
void scores_row(const Problem& pr, const SeqData& d, const std::vector<double>& G, const double* q, int64_t i,
                double* s, double* a) {
  const int64_t K = pr.K;
  std::vector<double> qt(q, q + K);
  for (int64_t j = i; j >= 0; --j) {
    if (a) std::copy(qt.begin(), qt.end(), a + j * K);
    s[j] = pr.scale * dot(qt.data(), &d.k[j * K], K) + pr.gate_scale * (G[i] - G[j]);
    if (pr.path && j > 0) {  // move qt across H_j (needed for keys j' < j only)
      const double* wj = &d.w[j * K];
      double c = d.beta[j] * dot(qt.data(), wj, K);
      for (int64_t e = 0; e < K; ++e) qt[e] -= c * wj[e];
    }
  }
}

}  // namespace

Status oracle_fwd(const PathFwdParams& p, const Problem& pr) {
  const int64_t nunits = int64_t(pr.seqs.size()) * pr.H;
  parallel_for(nunits, p.num_threads, [&](int64_t u) {
    const Seq& s = pr.seqs[u / pr.H];
    const int64_t h = u % pr.H, K = pr.K, V = pr.V, L = s.len;
    SeqData d;
    load_kv(p.k, p.v, p.w, p.beta, pr, s, h, &d);
    std::vector<double> q(L * K), o(L * V), lse(L), sc(L);
    for (int64_t hq = h * pr.group; hq < (h + 1) * pr.group; ++hq) {
      load_rows(p.q, s.b, s.t0, L, hq, K, q.data(), K);
      std::vector<double> G = gate_cumsum(p.g, pr, s, hq);
      for (int64_t i = 0; i < L; ++i) {
        scores_row(pr, d, G, &q[i * K], i, sc.data(), nullptr);
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) m = std::max(m, sc[j]);
        double l = 0;
        double* oi = &o[i * V];
        std::fill(oi, oi + V, 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          double e = std::exp(sc[j] - m);
          l += e;
          for (int64_t c = 0; c < V; ++c) oi[c] += e * d.v[j * V + c];
        }
        for (int64_t c = 0; c < V; ++c) oi[c] /= l;
        lse[i] = m + std::log(l);
      }
      store_rows(p.o, s.b, s.t0, L, hq, V, o.data(), V);
      if (p.lse.present()) store_col(p.lse, s.b, s.t0, L, hq, lse.data());
    }
  });
  return Status::Ok();
}

Status oracle_bwd(const PathBwdParams& p, const Problem& pr) {
  // Work unit: (sequence, kv head); its query heads run inside the unit, so every gradient element has one
  // writer and the result is bitwise independent of the thread count.
  const int64_t nunits = int64_t(pr.seqs.size()) * pr.H;
  parallel_for(nunits, p.num_threads, [&](int64_t u) {
    const Seq& s = pr.seqs[u / pr.H];
    const int64_t h = u % pr.H, K = pr.K, V = pr.V, L = s.len;
    SeqData d;
    load_kv(p.k, p.v, p.w, p.beta, pr, s, h, &d);
    std::vector<double> dk(L * K, 0.0), dv(L * V, 0.0), dw(pr.path ? L * K : 0, 0.0), dbeta(L, 0.0);
    std::vector<double> q(L * K), o(L * V), dout(L * V), lse(L), dq(L * K), dG(L), sc(L), a(L * K);
    std::vector<double> abar(K), prev(K);
    for (int64_t hq = h * pr.group; hq < (h + 1) * pr.group; ++hq) {
      load_rows(p.q, s.b, s.t0, L, hq, K, q.data(), K);
      load_rows(p.o, s.b, s.t0, L, hq, V, o.data(), V);
      load_rows(p.do_, s.b, s.t0, L, hq, V, dout.data(), V);
      load_col(p.lse, s.b, s.t0, L, hq, lse.data());
      std::vector<double> G = gate_cumsum(p.g, pr, s, hq);
      std::fill(dG.begin(), dG.end(), 0.0);
      for (int64_t i = 0; i < L; ++i) {
        scores_row(pr, d, G, &q[i * K], i, sc.data(), a.data());
        const double* doi = &dout[i * V];
        const double delta = dot(doi, &o[i * V], V);
        // Walk j = 0..i: the reverse of the forward's transport order. prev holds abar_{j-1}.
        std::fill(prev.begin(), prev.end(), 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          const double P = std::exp(sc[j] - lse[i]);
          const double dS = P * (dot(doi, &d.v[j * V], V) - delta);
          for (int64_t c = 0; c < V; ++c) dv[j * V + c] += P * doi[c];
          dG[i] += pr.gate_scale * dS;
          dG[j] -= pr.gate_scale * dS;
          const double dl = pr.scale * dS;
          const double* aj = &a[j * K];
          for (int64_t e = 0; e < K; ++e) dk[j * K + e] += dl * aj[e];
          // abar_j = dl k_j + H_j abar_{j-1}  (a_{j-1} = a_j H_j exists only for j > 0)
          if (pr.path && j > 0) {
            const double* wj = &d.w[j * K];
            const double pw = dot(prev.data(), wj, K), aw = dot(aj, wj, K);
            dbeta[j] -= aw * pw;
            for (int64_t e = 0; e < K; ++e) {
              dw[j * K + e] -= d.beta[j] * (pw * aj[e] + aw * prev[e]);
              abar[e] = prev[e] - d.beta[j] * pw * wj[e];
            }
          } else {
            std::copy(prev.begin(), prev.end(), abar.begin());
          }
          for (int64_t e = 0; e < K; ++e) abar[e] += dl * d.k[j * K + e];
          std::swap(prev, abar);
        }
        std::copy(prev.begin(), prev.end(), &dq[i * K]);
      }
      store_rows(p.dq, s.b, s.t0, L, hq, K, dq.data(), K);
      if (pr.gate) {  // dg_u = sum_{t >= u} dG_t (G is the inclusive cumsum of g)
        for (int64_t t = L - 2; t >= 0; --t) dG[t] += dG[t + 1];
        store_col(p.dg, s.b, s.t0, L, hq, dG.data());
      }
    }
    store_rows(p.dk, s.b, s.t0, L, h, K, dk.data(), K);
    store_rows(p.dv, s.b, s.t0, L, h, V, dv.data(), V);
    if (pr.path) {
      store_rows(p.dw, s.b, s.t0, L, h, K, dw.data(), K);
      store_col(p.dbeta, s.b, s.t0, L, h, dbeta.data());
    }
  });
  return Status::Ok();
}

}  // namespace pathattn::cpu
