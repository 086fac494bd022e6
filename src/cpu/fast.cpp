// cpu/fast.cpp: the blockwise CPU fast path of PaTH / PaTH-FoX / plain causal attention, forward and
// backward, templated on the compute type (double for the oracle chain, float in production). Chunk-level
// UT transform + dense K x K transport of query tiles (docs/algorithms.md); all block products go
// through BLAS. Memory is linear in T: per (sequence, kv head) chunk factors, plus per-thread scratch of at
// most one sequence's transported query tiles in the backward. Math and data flow: docs/design.md.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/convert.h"
#include "cpu/blas.h"
#include "cpu/cpu_backend.h"
#include "cpu/fast_rows.h"

namespace pathattn::cpu {

// Chunk size C. Transport costs 2 C K^2 per (query chunk, key chunk) pair against 4 C^2 K for QK^T + PV,
// so a larger C makes transport relatively cheaper (ratio K / 2C) while the O(T C K) intra-chunk work and
// BLAS call overheads grow. 64 measured best at K = 64 and K = 128 on 2 threads (docs/design.md).
int default_chunk_size(int64_t K) { return K <= 64 ? 64 : 64; }

namespace {

using core::Problem;
using core::Seq;

// The element-wise helpers (row kernels, masks, the small inverse): cpu/fast_rows.h.
using namespace fast_rows;

// Per (sequence, kv head) state: raw inputs in the compute type, and the chunk factors of the UT transform.
// For chunk c with rows R = [c C, c C + cl):
//   E_c  = (I + strict_lower(diag(b) W W^T))^{-1}         [cl x cl], stored [C x C]
//   W2_c = E_c diag(b) W                                  [cl x K]
//   P_c  = I - W^T W2_c = H_last ... H_first              [K x K]
//   U_c  = E_c diag(b) strict_lower(W K^T)                [cl x cl]
//   kt_c = K - U_c^T W   (each key moved to its chunk's end)
template <typename T>
struct KvState {
  int64_t L = 0, nc = 0;
  std::vector<T> k, v, w, beta;       // [L, K], [L, V], [L, K], [L]
  std::vector<T> E, U, P, W2, kt;     // [nc, C, C], [nc, C, C], [nc, K, K], [L, K], [L, K]
  std::vector<T> ks, PS;              // forward only: keys moved to their superblock's end [L, K], and the
                                      // superblock products P_last ... P_first [nsb, K, K] (full superblocks)
  std::vector<std::vector<double>> G; // per query head of the group: inclusive gate cumsum [L], fp64 (|G|
                                      // grows with t; see add_gate) (empty: no gate)
  int64_t bad = -1;                   // first row with a non-finite k, v, w or beta (-1: none)
};

// Non-finite inputs. Inside a chunk the block products multiply masked (exactly zero) entries with later
// rows, and 0 * NaN is NaN, so a NaN or Inf in k, v, w or beta at row p would reach the chunk's earlier
// rows. A (sequence, kv head) with such a row gets a second, sanitised state whose rows >= p are zero: the
// earlier rows of p's chunk are computed from it (the zero rows meet only the same exact zeros as finite
// rows would, so those rows are bitwise those of a finite input), and rows >= p from the real state.

// The forward crosses keys beyond the query's own superblock one superblock at a time (keys moved to their
// superblock's end, one K x K transport and one C x 512 block product each; docs/algorithms.md, two-level
// transport); within it, and in the whole backward, the chunk-level scan.
constexpr int64_t kSuperblock = 512;

template <typename T, bool kPath>
class FastPath {
 public:
  FastPath(const Problem& pr, int chunk_size, int num_threads)
      : pr_(pr), K_(pr.K), V_(pr.V), C_(chunk_size > 0 ? chunk_size : default_chunk_size(pr.K)),
        nt_(resolve_threads(num_threads)), m_(std::max<int64_t>(1, kSuperblock / C_)) {}

  Status forward(const PathFwdParams& p);
  Status backward(const PathBwdParams& p);
  // Recomputes query chunks qcs of query head hq of (sq, kv head h) (the fp32 forward's overflow fallback).
  void forward_chunks(const PathFwdParams& p, const Seq& sq, int64_t h, int64_t hq,
                      const std::vector<int64_t>& qcs) const;

 private:
  int64_t chunk_len(const KvState<T>& s, int64_t c) const { return std::min(C_, s.L - c * C_); }

  void prepare(const TensorView& k, const TensorView& v, const TensorView& w, const TensorView& beta,
               const TensorView& g, const Seq& sq, int64_t h, bool superblocks, KvState<T>* s,
               int64_t zero_from = -1) const;
  // Computes query chunk qc and stores its rows [lo, hi) (hi < 0: to the chunk's end). Returns true when a
  // stored row came out non-finite although its query, gate and the whole unit's k, v, w, beta are finite
  // (scores beyond the compute type's range).
  bool forward_chunk(const PathFwdParams& p, const Seq& sq, int64_t hq, const KvState<T>& s, int64_t qc,
                     int64_t lo = 0, int64_t hi = -1) const;

  // Backward accumulators of one work unit (one slice of the query chunks of one (sequence, kv head)).
  struct Grads {
    std::vector<T> dkt, dk, dv, dw, dw2, dU, dP;  // [L,K] [L,K] [L,V] [L,K] [L,K] [nc,C,C] [nc,K,K]
    std::vector<T> dG;                            // [group, L]
  };
  // Stores the dq rows [lo, hi) of query chunk qc (hi < 0: to the chunk's end).
  void backward_chunk(const PathBwdParams& p, const Seq& sq, int64_t hq, const KvState<T>& s, int64_t qc,
                      Grads* gr, std::vector<T>* snap, int64_t lo = 0, int64_t hi = -1) const;
  void init_grads(const KvState<T>& s, Grads* g) const;
  void backward_kv_chunk(const KvState<T>& s, int64_t c, Grads* gr, T* dbeta) const;

  // Row-wise online-softmax update with a score block S [n x m] (ld m): m_, l_, acc [n x V].
  void softmax_update(T* S, int64_t n, int64_t m, T* mx, T* l, T* acc, const T* vblk) const;

  const Problem& pr_;
  const int64_t K_, V_, C_;
  const int nt_;
  const int64_t m_;  // chunks per superblock of the forward's far-key scan
};

// Preparation: load one (sequence, kv head), compute the chunk factors and the gate cumsums.
template <typename T, bool kPath>
void FastPath<T, kPath>::prepare(const TensorView& k, const TensorView& v, const TensorView& w,
                                 const TensorView& beta, const TensorView& g, const Seq& sq, int64_t h,
                                 bool superblocks, KvState<T>* s, int64_t zero_from) const {
  const int64_t L = sq.len, K = K_, C = C_;
  s->L = L;
  s->nc = (L + C - 1) / C;
  s->k.resize(L * K);
  s->v.resize(L * V_);
  core::load_rows(k, sq.b, sq.t0, L, h, K, s->k.data(), K);
  core::load_rows(v, sq.b, sq.t0, L, h, V_, s->v.data(), V_);
  s->G.assign(pr_.group, {});
  if (pr_.gate) {
    for (int64_t j = 0; j < pr_.group; ++j) {
      auto& G = s->G[j];
      G.resize(L);
      core::load_col(g, sq.b, sq.t0, L, h * pr_.group + j, G.data());
      for (int64_t t = 1; t < L; ++t) G[t] += G[t - 1];
    }
  }
  if (kPath) {
    s->w.resize(L * K);
    s->beta.resize(L);
    core::load_rows(w, sq.b, sq.t0, L, h, K, s->w.data(), K);
    core::load_col(beta, sq.b, sq.t0, L, h, s->beta.data());
  }
  s->bad = -1;
  for (int64_t t = 0; t < L && s->bad < 0; ++t) {
    const bool ok = all_finite(&s->k[t * K], K) && all_finite(&s->v[t * V_], V_) &&
                    (!kPath || (all_finite(&s->w[t * K], K) && std::isfinite(s->beta[t])));
    if (!ok) s->bad = t;
  }
  if (zero_from >= 0) {  // the sanitised state (see KvState::bad)
    std::fill(s->k.begin() + zero_from * K, s->k.end(), T(0));
    std::fill(s->v.begin() + zero_from * V_, s->v.end(), T(0));
    if (kPath) {
      std::fill(s->w.begin() + zero_from * K, s->w.end(), T(0));
      std::fill(s->beta.begin() + zero_from, s->beta.end(), T(0));
    }
  }
  if (!kPath) return;
  s->E.assign(s->nc * C * C, T(0));
  s->U.assign(s->nc * C * C, T(0));
  s->P.resize(s->nc * K * K);
  s->W2.resize(L * K);
  s->kt.resize(L * K);
  std::vector<T> tmp(C * std::max(C, K));
  for (int64_t c = 0; c < s->nc; ++c) {
    const int64_t r0 = c * C, cl = chunk_len(*s, c);
    const T* W = &s->w[r0 * K];
    const T* Kc = &s->k[r0 * K];
    const T* b = &s->beta[r0];
    T* E = &s->E[c * C * C];
    T* U = &s->U[c * C * C];
    T* P = &s->P[c * K * K];
    T* W2 = &s->W2[r0 * K];
    // E := strict_lower(diag(b) W W^T), then inverted in place.
    gemm(false, true, cl, cl, K, T(1), W, K, W, K, T(0), E, C);
    mask_lower(E, cl, C, false);
    scale_rows(b, E, E, cl, cl, C);
    unit_lower_inverse(E, cl, C, tmp.data());
    // W2 = E diag(b) W.
    scale_rows(b, W, tmp.data(), cl, K, K);
    gemm(false, false, cl, K, cl, T(1), E, C, tmp.data(), K, T(0), W2, K);
    // P = I - W^T W2.
    gemm(true, false, K, K, cl, T(-1), W, K, W2, K, T(0), P, K);
    for (int64_t e = 0; e < K; ++e) P[e * K + e] += T(1);
    // U = E diag(b) strict_lower(W K^T);  kt = K - U^T W.
    gemm(false, true, cl, cl, K, T(1), W, K, Kc, K, T(0), tmp.data(), C);
    mask_lower(tmp.data(), cl, C, false);
    scale_rows(b, tmp.data(), tmp.data(), cl, cl, C);
    gemm(false, false, cl, cl, cl, T(1), E, C, tmp.data(), C, T(0), U, C);
    std::copy(Kc, Kc + cl * K, &s->kt[r0 * K]);
    gemm(true, false, cl, K, cl, T(-1), U, C, W, K, T(1), &s->kt[r0 * K], K);
  }
  if (!superblocks) return;
  // Full superblocks sb (m_ complete chunks): ks_kc = kt_kc M_kc^T with M_kc = P_last ... P_{kc+1}, walked
  // from the superblock's last chunk down; PS_sb = P_last ... P_first.
  const int64_t nsb = (L / C) / m_;
  s->ks.resize(nsb * m_ * C * K);
  s->PS.resize(nsb * K * K);
  std::vector<T> M(K * K), M2(K * K);
  for (int64_t sb = 0; sb < nsb; ++sb) {
    fill_zero(M.data(), K * K);
    for (int64_t e = 0; e < K; ++e) M[e * K + e] = T(1);
    for (int64_t kc = (sb + 1) * m_ - 1; kc >= sb * m_; --kc) {
      gemm(false, true, C, K, K, T(1), &s->kt[kc * C * K], K, M.data(), K, T(0), &s->ks[kc * C * K], K);
      gemm(false, false, K, K, K, T(1), M.data(), K, &s->P[kc * K * K], K, T(0), M2.data(), K);
      std::swap(M, M2);
    }
    std::copy(M.begin(), M.end(), &s->PS[sb * K * K]);
  }
}

template <typename T, bool kPath>
void FastPath<T, kPath>::softmax_update(T* S, int64_t n, int64_t m, T* mx, T* l, T* acc, const T* vblk) const {
  for (int64_t r = 0; r < n; ++r) {
    T* sr = S + r * m;
    const T rm = row_max(sr, m, mx[r]);
    const T alpha = rm == -std::numeric_limits<T>::infinity() ? T(1) : exp_fast(mx[r] - rm);
    const T sum = row_exp(sr, m, rm);
    l[r] = l[r] * alpha + sum;
    mx[r] = rm;
    if (alpha != T(1)) {
      T* ar = acc + r * V_;
      for (int64_t c = 0; c < V_; ++c) ar[c] *= alpha;
    }
  }
  gemm(false, false, n, V_, m, T(1), S, m, vblk, V_, T(1), acc, V_);
}

// Forward of one query chunk qc of query head hq: diagonal chunk by the masked UT form, then key chunks
// right to left with the query tile transported through each chunk's dense product.
template <typename T, bool kPath>
bool FastPath<T, kPath>::forward_chunk(const PathFwdParams& p, const Seq& sq, int64_t hq, const KvState<T>& s,
                                       int64_t qc, int64_t lo, int64_t hi) const {
  const int64_t K = K_, V = V_, C = C_, r0 = qc * C, cl = chunk_len(s, qc);
  if (hi < 0) hi = cl;
  const int64_t gi = hq % pr_.group;
  const T scale = T(pr_.scale);
  const double* Gq = pr_.gate ? s.G[gi].data() : nullptr;
  std::vector<T> Q(cl * K), qt(cl * K), tmp(cl * K), S(cl * C), X(kPath ? cl * C : 0), acc(cl * V, T(0));
  std::vector<T> mx(cl, -std::numeric_limits<T>::infinity()), l(cl, T(0));
  core::load_rows(p.q, sq.b, sq.t0 + r0, cl, hq, K, Q.data(), K);
  // Diagonal block: S = Q K^T - X U (PaTH), X = tril_incl(Q W^T); qt = Q - X W2.
  gemm(false, true, cl, cl, K, T(1), Q.data(), K, &s.k[r0 * K], K, T(0), S.data(), cl);
  if (kPath) {
    gemm(false, true, cl, cl, K, T(1), Q.data(), K, &s.w[r0 * K], K, T(0), X.data(), cl);
    mask_lower(X.data(), cl, cl, true);
    gemm(false, false, cl, cl, cl, T(-1), X.data(), cl, &s.U[qc * C * C], C, T(1), S.data(), cl);
    qt = Q;
    gemm(false, false, cl, K, cl, T(-1), X.data(), cl, &s.W2[r0 * K], K, T(1), qt.data(), K);
  } else {
    qt = Q;
  }
  for (int64_t i = 0; i < cl * cl; ++i) S[i] *= scale;
  if (Gq) add_gate(Gq, r0, cl, r0, cl, pr_.gate_scale, S.data(), cl);
  for (int64_t r = 0; r < cl; ++r)
    for (int64_t j = r + 1; j < cl; ++j) S[r * cl + j] = -std::numeric_limits<T>::infinity();
  softmax_update(S.data(), cl, cl, mx.data(), l.data(), acc.data(), &s.v[r0 * V]);
  // Key chunks of the query's own superblock, right to left, with chunk-level transport.
  const T* keys = kPath ? s.kt.data() : s.k.data();
  const int64_t sbq = qc / m_, first = sbq * m_;
  for (int64_t kc = qc - 1; kc >= first; --kc) {
    if (kPath && kc < qc - 1) {  // move the query tile across chunk kc + 1: qt <- qt P_{kc+1}
      gemm(false, false, cl, K, K, T(1), qt.data(), K, &s.P[(kc + 1) * K * K], K, T(0), tmp.data(), K);
      std::swap(qt, tmp);
    }
    const int64_t k0 = kc * C;  // key chunk kc is always full (only the last chunk is partial)
    gemm(false, true, cl, C, K, scale, qt.data(), K, &keys[k0 * K], K, T(0), S.data(), C);
    if (Gq) add_gate(Gq, r0, cl, k0, C, pr_.gate_scale, S.data(), C);
    softmax_update(S.data(), cl, C, mx.data(), l.data(), acc.data(), &s.v[k0 * V]);
  }
  if (sbq > 0) {
    // Earlier superblocks, right to left: qt moved to the end of superblock sb meets keys moved there.
    const int64_t W = m_ * C;
    const T* skeys = kPath ? s.ks.data() : s.k.data();
    if (kPath && qc > first) {  // from the end of chunk `first` to the end of superblock sbq - 1
      gemm(false, false, cl, K, K, T(1), qt.data(), K, &s.P[first * K * K], K, T(0), tmp.data(), K);
      std::swap(qt, tmp);
    }
    S.resize(cl * W);
    for (int64_t sb = sbq - 1; sb >= 0; --sb) {
      if (kPath && sb < sbq - 1) {  // across superblock sb + 1
        gemm(false, false, cl, K, K, T(1), qt.data(), K, &s.PS[(sb + 1) * K * K], K, T(0), tmp.data(), K);
        std::swap(qt, tmp);
      }
      const int64_t k0 = sb * W;
      gemm(false, true, cl, W, K, scale, qt.data(), K, &skeys[k0 * K], K, T(0), S.data(), W);
      if (Gq) add_gate(Gq, r0, cl, k0, W, pr_.gate_scale, S.data(), W);
      softmax_update(S.data(), cl, W, mx.data(), l.data(), acc.data(), &s.v[k0 * V]);
    }
  }
  std::vector<T> lse(cl);
  bool overflow = false;
  for (int64_t r = lo; r < hi; ++r) {
    const T inv = T(1) / l[r];
    for (int64_t c = 0; c < V; ++c) acc[r * V + c] *= inv;
    lse[r] = mx[r] + std::log(l[r]);
    if (s.bad < 0 && !(std::isfinite(lse[r]) && all_finite(&acc[r * V], V)) && all_finite(&Q[r * K], K) &&
        (!Gq || std::isfinite(Gq[r0 + r])))
      overflow = true;
  }
  core::store_rows(p.o, sq.b, sq.t0 + r0 + lo, hi - lo, hq, V, &acc[lo * V], V);
  if (p.lse.present()) core::store_col(p.lse, sq.b, sq.t0 + r0 + lo, hi - lo, hq, &lse[lo]);
  return overflow;
}

template <typename T, bool kPath>
void FastPath<T, kPath>::forward_chunks(const PathFwdParams& p, const Seq& sq, int64_t h, int64_t hq,
                                        const std::vector<int64_t>& qcs) const {
  KvState<T> s;
  prepare(p.k, p.v, p.w, p.beta, p.g, sq, h, /*superblocks=*/true, &s);
  parallel_for(int64_t(qcs.size()), nt_, [&](int64_t i) { forward_chunk(p, sq, hq, s, qcs[i]); });
}

// The (sequence, kv head) units are processed in waves of 2 x threads units, so the chunk factors held at
// once are bounded by the wave, not by B x H (forward units are independent: waves never change results).
template <typename T, bool kPath>
Status FastPath<T, kPath>::forward(const PathFwdParams& p) {
  const int64_t H = pr_.H, nkv = int64_t(pr_.seqs.size()) * H;
  const int64_t wave = std::min<int64_t>(nkv, 2 * int64_t(nt_));
  std::vector<KvState<T>> states(wave), clean(wave);
  struct Unit { int64_t kv, slot, hq, qc; };
  std::vector<Unit> units;
  std::vector<char> overflow;
  for (int64_t w0 = 0; w0 < nkv; w0 += wave) {
    const int64_t nw = std::min(wave, nkv - w0);
    parallel_for(nw, nt_, [&](int64_t i) {
      const Seq& sq = pr_.seqs[(w0 + i) / H];
      prepare(p.k, p.v, p.w, p.beta, p.g, sq, (w0 + i) % H, /*superblocks=*/true, &states[i]);
      if (states[i].bad >= 0)
        prepare(p.k, p.v, p.w, p.beta, p.g, sq, (w0 + i) % H, true, &clean[i], states[i].bad);
    });
    // Work units (kv unit, query head, query chunk), costliest (latest chunks) first for load balance.
    units.clear();
    for (int64_t i = 0; i < nw; ++i) {
      const int64_t h = (w0 + i) % H;
      for (int64_t hq = h * pr_.group; hq < (h + 1) * pr_.group; ++hq)
        for (int64_t qc = 0; qc < states[i].nc; ++qc) units.push_back({w0 + i, i, hq, qc});
    }
    std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.qc > b.qc; });
    overflow.assign(units.size(), 0);
    parallel_for(int64_t(units.size()), nt_, [&](int64_t u) {
      const Unit& x = units[u];
      const Seq& sq = pr_.seqs[x.kv / H];
      const KvState<T>& s = states[x.slot];
      const int64_t split = s.bad - x.qc * C_;  // rows before the first non-finite row, in this chunk
      if (s.bad >= 0 && split >= 0 && split < C_) {
        if (split > 0) forward_chunk(p, sq, x.hq, clean[x.slot], x.qc, 0, split);
        forward_chunk(p, sq, x.hq, s, x.qc, split, -1);
      } else {
        overflow[u] = forward_chunk(p, sq, x.hq, s, x.qc);
      }
    });
    // Scores beyond fp32's range (finite inputs, non-finite rows): those chunks again in fp64, as the oracle.
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t i = 0; i < nw; ++i) {
        for (int64_t hq = 0; hq < pr_.HQ; ++hq) {
          std::vector<int64_t> qcs;
          for (size_t u = 0; u < units.size(); ++u)
            if (overflow[u] && units[u].slot == i && units[u].hq == hq) qcs.push_back(units[u].qc);
          if (qcs.empty()) continue;
          FastPath<double, kPath>(pr_, int(C_), nt_).forward_chunks(p, pr_.seqs[(w0 + i) / H], (w0 + i) % H, hq,
                                                                    qcs);
        }
      }
    }
  }
  return Status::Ok();
}

// Backward of one query chunk: recompute the forward's tiles, then gradients. The transported query tiles
// qt_kc are kept in `snap` (at most L x K per thread) because the adjoint of the transport runs in the
// opposite order (kc ascending): gbar <- gbar P_kc^T + scale dS_kc kt_kc,  dP_kc += qt_kc^T gbar_{kc-1}.
template <typename T, bool kPath>
void FastPath<T, kPath>::backward_chunk(const PathBwdParams& p, const Seq& sq, int64_t hq, const KvState<T>& s,
                                        int64_t qc, Grads* gr, std::vector<T>* snap, int64_t lo, int64_t hi) const {
  const int64_t K = K_, V = V_, C = C_, r0 = qc * C, cl = chunk_len(s, qc);
  if (hi < 0) hi = cl;
  const int64_t gi = hq % pr_.group;
  const T scale = T(pr_.scale), gs = T(pr_.gate_scale);
  const double* Gq = pr_.gate ? s.G[gi].data() : nullptr;
  T* dG = pr_.gate ? &gr->dG[gi * s.L] : nullptr;
  std::vector<T> Q(cl * K), qt(cl * K), O(cl * V), dO(cl * V), lse(cl), delta(cl, T(0));
  std::vector<T> S(cl * C), dP(cl * C), X(kPath ? cl * C : 0), dX(kPath ? cl * C : 0);
  std::vector<T> dQ(cl * K, T(0)), gbar(cl * K, T(0)), tmp(cl * K);
  core::load_rows(p.q, sq.b, sq.t0 + r0, cl, hq, K, Q.data(), K);
  core::load_rows(p.o, sq.b, sq.t0 + r0, cl, hq, V, O.data(), V);
  core::load_rows(p.do_, sq.b, sq.t0 + r0, cl, hq, V, dO.data(), V);
  core::load_col(p.lse, sq.b, sq.t0 + r0, cl, hq, lse.data());
  for (int64_t r = 0; r < cl; ++r)
    for (int64_t c = 0; c < V; ++c) delta[r] += dO[r * V + c] * O[r * V + c];

  // Probabilities P = exp(S - lse) of a score block (in place in S) and dS = P o (dO V^T - delta) (in dP);
  // accumulates dv and the gate gradients. Scores must already hold scale * logits + gate.
  auto grad_block = [&](int64_t m, int64_t k0, bool diag) {
    gemm(false, true, cl, m, V, T(1), dO.data(), V, &s.v[k0 * V], V, T(0), dP.data(), m);
    for (int64_t r = 0; r < cl; ++r) {
      const T rs = row_grad(&S[r * m], &dP[r * m], m, diag ? r + 1 : m, lse[r], delta[r]);
      if (dG) {
        dG[r0 + r] += gs * rs;
        for (int64_t j = 0; j < m; ++j) dG[k0 + j] -= gs * dP[r * m + j];
      }
    }
    gemm(true, false, m, V, cl, T(1), S.data(), m, dO.data(), V, T(1), &gr->dv[k0 * V], V);
  };

  // Diagonal chunk.
  gemm(false, true, cl, cl, K, T(1), Q.data(), K, &s.k[r0 * K], K, T(0), S.data(), cl);
  qt = Q;
  if (kPath) {
    gemm(false, true, cl, cl, K, T(1), Q.data(), K, &s.w[r0 * K], K, T(0), X.data(), cl);
    mask_lower(X.data(), cl, cl, true);
    gemm(false, false, cl, cl, cl, T(-1), X.data(), cl, &s.U[qc * C * C], C, T(1), S.data(), cl);
    gemm(false, false, cl, K, cl, T(-1), X.data(), cl, &s.W2[r0 * K], K, T(1), qt.data(), K);
  }
  for (int64_t i = 0; i < cl * cl; ++i) S[i] *= scale;
  if (Gq) add_gate(Gq, r0, cl, r0, cl, pr_.gate_scale, S.data(), cl);
  grad_block(cl, r0, true);
  // dAloc = scale dS (lower incl.): dQ += dA K; dK_direct += dA^T Q; dX = -dA U^T; dU += -X^T dA.
  gemm(false, false, cl, K, cl, scale, dP.data(), cl, &s.k[r0 * K], K, T(1), dQ.data(), K);
  gemm(true, false, cl, K, cl, scale, dP.data(), cl, Q.data(), K, T(1), &gr->dk[r0 * K], K);
  if (kPath) {
    gemm(false, true, cl, cl, cl, -scale, dP.data(), cl, &s.U[qc * C * C], C, T(0), dX.data(), cl);
    gemm(true, false, cl, cl, cl, -scale, X.data(), cl, dP.data(), cl, T(1), &gr->dU[qc * C * C], C);
  }

  // Off-diagonal chunks. Descending pass records qt_kc (PaTH only); ascending pass does the gradients.
  const T* keys = kPath ? s.kt.data() : s.k.data();
  T* dkeys = kPath ? gr->dkt.data() : gr->dk.data();
  if (kPath && qc > 0) {
    snap->resize(qc * cl * K);
    std::copy(qt.begin(), qt.end(), snap->begin() + (qc - 1) * cl * K);
    for (int64_t kc = qc - 2; kc >= 0; --kc)
      gemm(false, false, cl, K, K, T(1), &(*snap)[(kc + 1) * cl * K], K, &s.P[(kc + 1) * K * K], K, T(0),
           &(*snap)[kc * cl * K], K);
  }
  for (int64_t kc = 0; kc < qc; ++kc) {
    const T* qk = kPath ? &(*snap)[kc * cl * K] : Q.data();
    const int64_t k0 = kc * C;
    if (kPath && kc > 0) {  // qt_{kc-1} = qt_kc P_kc: dP_kc += qt_kc^T gbar; gbar <- gbar P_kc^T
      gemm(true, false, K, K, cl, T(1), qk, K, gbar.data(), K, T(1), &gr->dP[kc * K * K], K);
      gemm(false, true, cl, K, K, T(1), gbar.data(), K, &s.P[kc * K * K], K, T(0), tmp.data(), K);
      std::swap(gbar, tmp);
    }
    gemm(false, true, cl, C, K, scale, qk, K, &keys[k0 * K], K, T(0), S.data(), C);
    if (Gq) add_gate(Gq, r0, cl, k0, C, pr_.gate_scale, S.data(), C);
    grad_block(C, k0, false);
    gemm(false, false, cl, K, C, scale, dP.data(), C, &keys[k0 * K], K, T(1), gbar.data(), K);
    gemm(true, false, C, K, cl, scale, dP.data(), C, qk, K, T(1), &dkeys[k0 * K], K);
  }
  // gbar is now the gradient of the transported-to-chunk-start query qt = Q - X W2 (PaTH) or of Q.
  for (int64_t i = 0; i < cl * K; ++i) dQ[i] += gbar[i];
  if (kPath) {
    // qt = Q - X W2: dX -= gbar W2^T; dW2 -= X^T gbar.  X = tril_incl(Q W^T): dQ += dX W; dW += dX^T Q.
    gemm(false, true, cl, cl, K, T(-1), gbar.data(), K, &s.W2[r0 * K], K, T(1), dX.data(), cl);
    gemm(true, false, cl, K, cl, T(-1), X.data(), cl, gbar.data(), K, T(1), &gr->dw2[r0 * K], K);
    mask_lower(dX.data(), cl, cl, true);
    gemm(false, false, cl, K, cl, T(1), dX.data(), cl, &s.w[r0 * K], K, T(1), dQ.data(), K);
    gemm(true, false, cl, K, cl, T(1), dX.data(), cl, Q.data(), K, T(1), &gr->dw[r0 * K], K);
  }
  core::store_rows(p.dq, sq.b, sq.t0 + r0 + lo, hi - lo, hq, K, &dQ[lo * K], K);
}

template <typename T, bool kPath>
void FastPath<T, kPath>::init_grads(const KvState<T>& s, Grads* g) const {
  const int64_t L = s.L, K = K_, V = V_, C = C_;
  g->dk.assign(L * K, T(0));
  g->dv.assign(L * V, T(0));
  if (kPath) {
    g->dkt.assign(L * K, T(0));
    g->dw.assign(L * K, T(0));
    g->dw2.assign(L * K, T(0));
    g->dU.assign(s.nc * C * C, T(0));
    g->dP.assign(s.nc * K * K, T(0));
  }
  if (pr_.gate) g->dG.assign(pr_.group * L, T(0));
}

// Backward through the chunk factors of chunk c (see KvState): from the accumulated dkt, dP, dU, dW2 (and
// the partial dk, dw of the query side) to the chunk rows' final dk and dw (in gr) and dbeta [cl].
template <typename T, bool kPath>
void FastPath<T, kPath>::backward_kv_chunk(const KvState<T>& s, int64_t c, Grads* gr, T* dbeta) const {
  const int64_t K = K_, C = C_, r0 = c * C, cl = chunk_len(s, c);
  const T* W = &s.w[r0 * K];
  const T* Kc = &s.k[r0 * K];
  const T* b = &s.beta[r0];
  const T* E = &s.E[c * C * C];
  const T* U = &s.U[c * C * C];
  const T* W2 = &s.W2[r0 * K];
  T* dkt = &gr->dkt[r0 * K];
  T* dk = &gr->dk[r0 * K];
  T* dw = &gr->dw[r0 * K];
  T* dw2 = &gr->dw2[r0 * K];
  T* dU = &gr->dU[c * C * C];
  const T* dPc = &gr->dP[c * K * K];
  std::vector<T> Z(cl * cl), dE(cl * cl, T(0)), EtdU(cl * cl), EtdW2(cl * K), tmpc(cl * cl), tmpk(cl * K);
  std::fill(dbeta, dbeta + cl, T(0));
  // kt = K - U^T W: dk += dkt; dU += -W dkt^T; dw += -U dkt.
  for (int64_t i = 0; i < cl * K; ++i) dk[i] += dkt[i];
  gemm(false, true, cl, cl, K, T(-1), W, K, dkt, K, T(1), dU, C);
  gemm(false, false, cl, K, cl, T(-1), U, C, dkt, K, T(1), dw, K);
  // P = I - W^T W2: dw += -W2 dP^T; dw2 += -W dP.
  gemm(false, true, cl, K, K, T(-1), W2, K, dPc, K, T(1), dw, K);
  gemm(false, false, cl, K, K, T(-1), W, K, dPc, K, T(1), dw2, K);
  // Z = strict_lower(W K^T) (recomputed). U = E diag(b) Z: dE += dU Z^T diag(b); dZ = diag(b) E^T dU;
  // dbeta_s += sum_j (E^T dU)[s, j] Z[s, j].
  gemm(false, true, cl, cl, K, T(1), W, K, Kc, K, T(0), Z.data(), cl);
  mask_lower(Z.data(), cl, cl, false);
  gemm(false, true, cl, cl, cl, T(1), dU, C, Z.data(), cl, T(0), dE.data(), cl);
  for (int64_t r = 0; r < cl; ++r)
    for (int64_t q = 0; q < cl; ++q) dE[r * cl + q] *= b[q];
  gemm(true, false, cl, cl, cl, T(1), E, C, dU, C, T(0), EtdU.data(), cl);
  for (int64_t r = 0; r < cl; ++r) {
    T acc = 0;
    for (int64_t j = 0; j < cl; ++j) acc += EtdU[r * cl + j] * Z[r * cl + j];
    dbeta[r] += acc;
  }
  // dZ (strict lower) = diag(b) E^T dU: dw += dZ K; dk += dZ^T W.
  scale_rows(b, EtdU.data(), tmpc.data(), cl, cl, cl);
  mask_lower(tmpc.data(), cl, cl, false);
  gemm(false, false, cl, K, cl, T(1), tmpc.data(), cl, Kc, K, T(1), dw, K);
  gemm(true, false, cl, K, cl, T(1), tmpc.data(), cl, W, K, T(1), dk, K);
  // W2 = E diag(b) W: dE += dW2 W^T diag(b); dbeta_s += sum_k (E^T dW2)[s, k] W[s, k]; dw += diag(b) E^T dW2.
  gemm(false, true, cl, cl, K, T(1), dw2, K, W, K, T(0), tmpc.data(), cl);
  for (int64_t r = 0; r < cl; ++r)
    for (int64_t q = 0; q < cl; ++q) dE[r * cl + q] += tmpc[r * cl + q] * b[q];
  gemm(true, false, cl, K, cl, T(1), E, C, dw2, K, T(0), EtdW2.data(), K);
  for (int64_t r = 0; r < cl; ++r) {
    T acc = 0;
    for (int64_t e = 0; e < K; ++e) {
      acc += EtdW2[r * K + e] * W[r * K + e];
      dw[r * K + e] += b[r] * EtdW2[r * K + e];
    }
    dbeta[r] += acc;
  }
  // E = (I + A)^{-1}: dA = -E^T dE E^T (strict lower). A = strict_lower(diag(b) W W^T):
  // dbeta_r += sum_s dA[r, s] (W W^T)[r, s]; dw += diag(b) dA W + dA^T diag(b) W.
  gemm(true, false, cl, cl, cl, T(1), E, C, dE.data(), cl, T(0), tmpc.data(), cl);
  gemm(false, true, cl, cl, cl, T(-1), tmpc.data(), cl, E, C, T(0), dE.data(), cl);  // dE := dA
  mask_lower(dE.data(), cl, cl, false);
  gemm(false, true, cl, cl, K, T(1), W, K, W, K, T(0), tmpc.data(), cl);  // W W^T
  for (int64_t r = 0; r < cl; ++r) {
    T acc = 0;
    for (int64_t q = 0; q < r; ++q) acc += dE[r * cl + q] * tmpc[r * cl + q];
    dbeta[r] += acc;
  }
  scale_rows(b, dE.data(), tmpc.data(), cl, cl, cl);  // diag(b) dA
  gemm(false, false, cl, K, cl, T(1), tmpc.data(), cl, W, K, T(1), dw, K);
  scale_rows(b, W, tmpk.data(), cl, K, K);  // diag(b) W
  gemm(true, false, cl, K, cl, T(1), dE.data(), cl, tmpk.data(), K, T(1), dw, K);
}

template <typename T, bool kPath>
Status FastPath<T, kPath>::backward(const PathBwdParams& p) {
  const int64_t H = pr_.H, K = K_, V = V_, C = C_, nkv = int64_t(pr_.seqs.size()) * H;
  // Work units: (sequence, kv head, slice). A slice takes the query chunks qc with qc % nslice == slice of
  // every query head of the group and owns private accumulators, reduced in slice order afterwards. nslice
  // depends on the problem only, never on the thread count, so results are bitwise thread-count invariant.
  int64_t max_nc = 0;
  for (const Seq& sq : pr_.seqs) max_nc = std::max(max_nc, (sq.len + C - 1) / C);
  const int64_t nslice = std::max<int64_t>(1, std::min<int64_t>(max_nc, (16 + nkv - 1) / nkv));
  const int64_t wave = std::min<int64_t>(nkv, std::max<int64_t>(1, 2 * int64_t(nt_) / nslice));
  std::vector<KvState<T>> states(wave), clean(wave);
  std::vector<Grads> grads(wave * nslice);
  for (int64_t w0 = 0; w0 < nkv; w0 += wave) {
    const int64_t nw = std::min(wave, nkv - w0);
    parallel_for(nw, nt_, [&](int64_t i) {
      const Seq& sq = pr_.seqs[(w0 + i) / H];
      prepare(p.k, p.v, p.w, p.beta, p.g, sq, (w0 + i) % H, /*superblocks=*/false, &states[i]);
      if (states[i].bad >= 0)
        prepare(p.k, p.v, p.w, p.beta, p.g, sq, (w0 + i) % H, false, &clean[i], states[i].bad);
    });
    parallel_for(nw * nslice, nt_, [&](int64_t u) {
      const int64_t i = u / nslice, sl = u % nslice, kv = w0 + i;
      const KvState<T>& s = states[i];
      Grads& g = grads[u];
      init_grads(s, &g);
      std::vector<T> snap;
      const int64_t h = kv % H;
      const Seq& sq = pr_.seqs[kv / H];
      for (int64_t hq = h * pr_.group; hq < (h + 1) * pr_.group; ++hq)
        for (int64_t qc = sl; qc < s.nc; qc += nslice) {
          const int64_t split = s.bad - qc * C;  // see KvState::bad
          if (s.bad >= 0 && split > 0 && split < C) {
            Grads scratch;  // the sanitised pass gives dq of the rows before split; its accumulations are dropped
            init_grads(s, &scratch);
            backward_chunk(p, sq, hq, clean[i], qc, &scratch, &snap, 0, split);
            backward_chunk(p, sq, hq, s, qc, &g, &snap, split, -1);
          } else {
            backward_chunk(p, sq, hq, s, qc, &g, &snap);
          }
        }
    });
    // Reduce slices into slice 0 (fixed order), then the chunk-factor backward and the stores.
    parallel_for(nw, nt_, [&](int64_t i) {
      Grads& g0 = grads[i * nslice];
      auto add = [](std::vector<T>& a, const std::vector<T>& b) {
        for (size_t j = 0; j < a.size(); ++j) a[j] += b[j];
      };
      for (int64_t sl = 1; sl < nslice; ++sl) {
        const Grads& gs = grads[i * nslice + sl];
        add(g0.dk, gs.dk);
        add(g0.dv, gs.dv);
        add(g0.dkt, gs.dkt);
        add(g0.dw, gs.dw);
        add(g0.dw2, gs.dw2);
        add(g0.dU, gs.dU);
        add(g0.dP, gs.dP);
        add(g0.dG, gs.dG);
      }
      const KvState<T>& s = states[i];
      const Seq& sq = pr_.seqs[(w0 + i) / H];
      const int64_t h = (w0 + i) % H, L = s.L;
      if (kPath) {
        std::vector<T> dbeta(L);
        for (int64_t c = 0; c < s.nc; ++c) backward_kv_chunk(s, c, &g0, &dbeta[c * C]);
        core::store_rows(p.dw, sq.b, sq.t0, L, h, K, g0.dw.data(), K);
        core::store_col(p.dbeta, sq.b, sq.t0, L, h, dbeta.data());
      }
      core::store_rows(p.dk, sq.b, sq.t0, L, h, K, g0.dk.data(), K);
      core::store_rows(p.dv, sq.b, sq.t0, L, h, V, g0.dv.data(), V);
      if (pr_.gate) {
        for (int64_t j = 0; j < pr_.group; ++j) {
          // dg_u = sum_{t >= u} dG_t, accumulated in fp64.
          std::vector<double> dg(L);
          double acc = 0;
          for (int64_t t = L - 1; t >= 0; --t) dg[t] = acc += double(g0.dG[j * L + t]);
          core::store_col(p.dg, sq.b, sq.t0, L, h * pr_.group + j, dg.data());
        }
      }
    });
  }
  return Status::Ok();
}

template <typename T>
Status run_fwd(const PathFwdParams& p, const Problem& pr) {
  const int nt = resolve_threads(p.num_threads);  // before SerialBlas sets this thread's default to 1
  SerialBlas serial;
  if (pr.path) return FastPath<T, true>(pr, p.chunk_size, nt).forward(p);
  return FastPath<T, false>(pr, p.chunk_size, nt).forward(p);
}

template <typename T>
Status run_bwd(const PathBwdParams& p, const Problem& pr) {
  const int nt = resolve_threads(p.num_threads);  // before SerialBlas sets this thread's default to 1
  SerialBlas serial;
  if (pr.path) return FastPath<T, true>(pr, p.chunk_size, nt).backward(p);
  return FastPath<T, false>(pr, p.chunk_size, nt).backward(p);
}

}  // namespace

Status fast_fwd(const PathFwdParams& p, const Problem& pr) {
  return pr.f64 ? run_fwd<double>(p, pr) : run_fwd<float>(p, pr);
}

Status fast_bwd(const PathBwdParams& p, const Problem& pr) {
  return pr.f64 ? run_bwd<double>(p, pr) : run_bwd<float>(p, pr);
}

}  // namespace pathattn::cpu
