// cpu/decode.cpp: prefill and single-token decode with a cache of transported keys (SPEC.md section 6,
// ALGORITHMS.md section 5). Host code shared by Backend::oracle and Backend::cpu (decode is the same math);
// fp64 throughout for f64 inputs, fp32 storage and accumulation otherwise.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/convert.h"
#include "core/problem.h"
#include "cpu/cpu_backend.h"

namespace pathattn {
namespace cpu {
namespace {

using core::Problem;
using core::Seq;

Status bad(const std::string& m) { return Status(Status::Code::invalid_argument, m); }

// Dot product of two length-n rows, n a multiple of 8 (K and V always are). Eight independent partial
// sums so the compiler vectorises it without reassociation flags; the summation order is fixed, so
// results do not depend on the thread count.
template <typename T>
inline T dot8(const T* __restrict a, const T* __restrict b, int64_t n) {
  T acc[8] = {};
  for (int64_t i = 0; i < n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// y[0..n) += alpha * x[0..n).
template <typename T>
inline void axpy(T* __restrict y, T alpha, const T* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Pointer to row j of cache tensor x [N, H(Q), C, D] (or element j of a rank-3 gate cache [N, HQ, C]).
template <typename T>
inline T* cache_row(const TensorView& x, int64_t n, int64_t h, int64_t j) {
  return static_cast<T*>(x.data) + n * x.stride[0] + h * x.stride[1] + j * x.stride[2];
}

// Every sequence of a validated forward, empty ones included, in cache-slot order: slot n is batch row n,
// or varlen sequence n.
std::vector<Seq> all_seqs(const PathFwdParams& p, const Problem& pr) {
  std::vector<Seq> out;
  if (p.cu_seqlens.present()) {
    const TensorView& cu = p.cu_seqlens;
    for (int64_t n = 0; n < pr.num_seqs; ++n) {
      const int64_t a = core::load_elem<int64_t>(cu.data, cu.dtype, n * cu.stride[0]);
      const int64_t b = core::load_elem<int64_t>(cu.data, cu.dtype, (n + 1) * cu.stride[0]);
      out.push_back({0, a, b - a});
    }
  } else {
    for (int64_t b = 0; b < pr.B; ++b) out.push_back({b, 0, pr.T});
  }
  return out;
}

// Fills cache slot n, kv head h (and its query heads' gate cumsums) from sequence s (length L):
//   kc[n, h, j, :] = H_{L-1} ... H_{j+1} k_j   (j < L),   vc[n, h, j, :] = v_j,   gc[n, hq, j] = G_j.
// Tc is the cache type (float | double); Tm the type of the running K x K suffix product
// M = H_{L-1} ... H_{j+1}, walked from j = L-1 down to 0 with one fused pass over M per step:
//   kc_j = M k_j,  then  M <- M H_j = M - beta_j (M w_j) w_j^T.       O(L K^2) time, O(K^2) memory.
template <typename Tc, typename Tm>
void prefill_unit(const PathPrefillParams& p, const Problem& pr, const Seq& s, int64_t n, int64_t h) {
  const PathFwdParams& f = p.fwd;
  const DecodeCache& c = p.cache;
  const int64_t K = pr.K, V = pr.V, L = s.len;
  std::vector<Tm> M(K * K, Tm(0)), kj(K), wj(K);
  std::vector<Tc> vrow(V);
  for (int64_t e = 0; e < K; ++e) M[e * K + e] = Tm(1);
  for (int64_t j = L - 1; j >= 0; --j) {
    core::load_rows(f.k, s.b, s.t0 + j, 1, h, K, kj.data(), K);
    Tc* out = cache_row<Tc>(c.kc, n, h, j);
    if (!pr.path) {
      for (int64_t e = 0; e < K; ++e) out[e] = Tc(kj[e]);
      continue;
    }
    core::load_rows(f.w, s.b, s.t0 + j, 1, h, K, wj.data(), K);
    const Tm bj = core::load_elem<Tm>(f.beta.data, f.beta.dtype, core::offset3(f.beta, s.b, s.t0 + j, h));
    for (int64_t r = 0; r < K; ++r) {
      Tm* Mr = &M[r * K];
      out[r] = Tc(dot8(Mr, kj.data(), K));
      if (j > 0) axpy(Mr, -bj * dot8(Mr, wj.data(), K), wj.data(), K);
    }
  }
  for (int64_t j = 0; j < L; ++j) {
    core::load_rows(f.v, s.b, s.t0 + j, 1, h, V, vrow.data(), V);
    std::copy(vrow.begin(), vrow.end(), cache_row<Tc>(c.vc, n, h, j));
  }
  if (pr.gate) {
    for (int64_t hq = h * pr.group; hq < (h + 1) * pr.group; ++hq) {
      double G = 0;  // the cumsum itself in fp64 whatever the cache type (L scalars: free)
      Tc* gc = cache_row<Tc>(c.gc, n, hq, 0);
      for (int64_t j = 0; j < L; ++j) {
        G += core::load_elem<double>(f.g.data, f.g.dtype, core::offset3(f.g, s.b, s.t0 + j, hq));
        gc[j * c.gc.stride[2]] = Tc(G);
      }
    }
  }
}

// Per-thread scratch of a decode step, reused across calls: grows to the largest cache seen, so a
// step allocates nothing once warm.
template <typename Tc>
std::vector<Tc>& decode_scratch() {
  thread_local std::vector<Tc> buf;
  return buf;
}

// One decode step of slot n, kv head h, whose cache holds L tokens; the inputs are row n of the
// [N, 1, ...] tensors of p. Fuses the in-place transport kc_j <- H kc_j with the scores of the group's
// query heads (kc is read and written once), then a second pass over vc for the outputs.
//   scores  sc[gi, j] = scale q_gi . kc_j + gate_scale (G_new - G_j),   j = 0..L (L is the new token)
//   o[n, 0, hq, :]   = softmax_j(sc[gi, .]) vc,   lse[n, 0, hq] = log sum_j exp sc[gi, j]
template <typename Tc>
void decode_unit(const PathDecodeParams& p, const Problem& pr, int64_t n, int64_t h, int64_t L) {
  const DecodeCache& c = p.cache;
  const int64_t K = pr.K, V = pr.V, G = pr.group, S = L + 1;
  std::vector<Tc>& buf = decode_scratch<Tc>();
  const size_t need = size_t(G * K + 2 * K + V + G + G * S + G * V);
  if (buf.size() < need) buf.resize(need);
  Tc* q = buf.data();    // [G, K]
  Tc* w = q + G * K;     // [K]
  Tc* k = w + K;         // [K]
  Tc* v = k + K;         // [V]
  Tc* gnew = v + V;      // [G]
  Tc* sc = gnew + G;     // [G, S]
  Tc* acc = sc + G * S;  // [G, V]

  for (int64_t gi = 0; gi < G; ++gi) core::load_rows(p.q, n, 0, 1, h * G + gi, K, q + gi * K, K);
  core::load_rows(p.k, n, 0, 1, h, K, k, K);
  core::load_rows(p.v, n, 0, 1, h, V, v, V);
  Tc beta = 0;
  if (pr.path) {
    core::load_rows(p.w, n, 0, 1, h, K, w, K);
    beta = core::load_elem<Tc>(p.beta.data, p.beta.dtype, core::offset3(p.beta, n, 0, h));
  }
  const Tc scale = Tc(pr.scale), gscale = Tc(pr.gate_scale);

  // 1 + 3a: transport every cached key across H_{t+1} in place and score it against each query head.
  const int64_t ks = c.kc.stride[2];
  Tc* kc = cache_row<Tc>(c.kc, n, h, 0);
  for (int64_t j = 0; j < L; ++j) {
    Tc* row = kc + j * ks;
    if (pr.path) axpy(row, -beta * dot8(w, row, K), w, K);
    for (int64_t gi = 0; gi < G; ++gi) sc[gi * S + j] = scale * dot8(q + gi * K, row, K);
  }
  // 2: append the new token.
  std::copy(k, k + K, kc + L * ks);
  std::copy(v, v + V, cache_row<Tc>(c.vc, n, h, L));
  for (int64_t gi = 0; gi < G; ++gi) sc[gi * S + L] = scale * dot8(q + gi * K, k, K);
  if (pr.gate) {
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t hq = h * G + gi;
      Tc* gc = cache_row<Tc>(c.gc, n, hq, 0);
      const int64_t gs = c.gc.stride[2];
      const Tc g = core::load_elem<Tc>(p.g.data, p.g.dtype, core::offset3(p.g, n, 0, hq));
      gnew[gi] = (L > 0 ? gc[(L - 1) * gs] : Tc(0)) + g;
      gc[L * gs] = gnew[gi];
      Tc* s = sc + gi * S;
      for (int64_t j = 0; j < L; ++j) s[j] += gscale * (gnew[gi] - gc[j * gs]);
    }
  }

  // 3b: softmax over j = 0..L and the weighted sum of the cached values (vc read once for all heads).
  Tc mx[64], den[64];  // G = HQ / H; bounded below by the chunking into groups of 64
  for (int64_t g0 = 0; g0 < G; g0 += 64) {
    const int64_t g1 = std::min(G, g0 + 64);
    for (int64_t gi = g0; gi < g1; ++gi) {
      Tc m = -std::numeric_limits<Tc>::infinity();
      const Tc* s = sc + gi * S;
      for (int64_t j = 0; j < S; ++j) m = std::max(m, s[j]);
      mx[gi - g0] = m;
      Tc l = 0;
      Tc* se = sc + gi * S;
      for (int64_t j = 0; j < S; ++j) {
        se[j] = std::exp(s[j] - m);
        l += se[j];
      }
      den[gi - g0] = l;
      std::fill(acc + gi * V, acc + (gi + 1) * V, Tc(0));
    }
    for (int64_t j = 0; j < S; ++j) {
      const Tc* vj = cache_row<Tc>(c.vc, n, h, j);
      for (int64_t gi = g0; gi < g1; ++gi) axpy(acc + gi * V, sc[gi * S + j], vj, V);
    }
    for (int64_t gi = g0; gi < g1; ++gi) {
      const int64_t hq = h * G + gi;
      const Tc inv = Tc(1) / den[gi - g0];
      const int64_t off = core::offset3(p.o, n, 0, hq);
      for (int64_t e = 0; e < V; ++e) core::store_elem<Tc>(p.o.data, p.o.dtype, off + e, acc[gi * V + e] * inv);
      if (p.lse.present()) {
        core::store_elem<Tc>(p.lse.data, p.lse.dtype, core::offset3(p.lse, n, 0, hq),
                             mx[gi - g0] + std::log(den[gi - g0]));
      }
    }
  }
}

}  // namespace
}  // namespace cpu

// Prefill: validate the forward and the cache, run the forward on its backend, then build the cache on the
// host, one work unit per (sequence, kv head).
Status path_attn_prefill(const PathPrefillParams& p) {
  core::Problem pr;
  PA_TRY(core::check_fwd(p.fwd, &pr));
  PA_TRY(core::check_cache(p.cache, pr, pr.num_seqs, /*need_room=*/false));
  const std::vector<core::Seq> seqs = cpu::all_seqs(p.fwd, pr);
  const int64_t cap = p.cache.kc.shape[2];
  for (size_t n = 0; n < seqs.size(); ++n) {
    if (seqs[n].len > cap) {
      return cpu::bad("cache.kc: capacity C = " + std::to_string(cap) + " (kc.shape[2]) is smaller than sequence " +
                      std::to_string(n) + "'s length " + std::to_string(seqs[n].len));
    }
  }
  if (pr.backend == Backend::cuda) {
    return Status(Status::Code::unsupported, "backend: prefill fills a host cache; the cuda backend has no prefill yet");
  }
  PA_TRY(path_attn_fwd(p.fwd));
  const int64_t nunits = int64_t(seqs.size()) * pr.H;
  cpu::parallel_for(nunits, p.fwd.num_threads, [&](int64_t u) {
    const int64_t n = u / pr.H, h = u % pr.H;
    if (pr.f64) cpu::prefill_unit<double, double>(p, pr, seqs[n], n, h);
    else cpu::prefill_unit<float, double>(p, pr, seqs[n], n, h);
  });
  int64_t* len = static_cast<int64_t*>(p.cache.lengths.data);
  for (size_t n = 0; n < seqs.size(); ++n) len[int64_t(n) * p.cache.lengths.stride[0]] = seqs[n].len;
  return Status::Ok();
}

// Decode: the step's inputs are a forward problem with B = N and T = 1, so check_fwd validates them all;
// then the cache, with room for one more token in every slot.
Status path_attn_decode(const PathDecodeParams& p) {
  PathFwdParams f;
  f.q = p.q;
  f.k = p.k;
  f.v = p.v;
  f.w = p.w;
  f.beta = p.beta;
  f.g = p.g;
  f.scale = p.scale;
  f.gate_scale = p.gate_scale;
  f.o = p.o;
  f.lse = p.lse;
  f.backend = p.backend;
  f.num_threads = p.num_threads;
  f.stream = p.stream;
  core::Problem pr;
  PA_TRY(core::check_fwd(f, &pr));
  if (pr.T != 1) {
    return cpu::bad("q: expected shape [N, 1, HQ, K] (one token per sequence), got " + core::shape_str(p.q));
  }
  PA_TRY(core::check_cache(p.cache, pr, pr.B, /*need_room=*/true));
  if (pr.backend == Backend::cuda) {
    return Status(Status::Code::unsupported, "backend: decode runs on host caches; the cuda backend has no decode yet");
  }
  const int64_t N = pr.B;
  std::vector<int64_t> len(N);  // read once: every kv head of a slot sees the length before this step
  int64_t* lp = static_cast<int64_t*>(p.cache.lengths.data);
  for (int64_t n = 0; n < N; ++n) len[n] = lp[n * p.cache.lengths.stride[0]];
  cpu::parallel_for(N * pr.H, p.num_threads, [&](int64_t u) {
    const int64_t n = u / pr.H, h = u % pr.H;
    if (pr.f64) cpu::decode_unit<double>(p, pr, n, h, len[n]);
    else cpu::decode_unit<float>(p, pr, n, h, len[n]);
  });
  for (int64_t n = 0; n < N; ++n) lp[n * p.cache.lengths.stride[0]] = len[n] + 1;
  return Status::Ok();
}

}  // namespace pathattn
