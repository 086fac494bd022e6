// cpu/decode.cpp: prefill and single-token decode with a cache of transported keys (docs/spec.md,
// docs/algorithms.md). Host code shared by Backend::oracle and Backend::cpu (decode is the same math);
// fp64 throughout for f64 inputs, fp32 storage and accumulation otherwise.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/convert.h"
#include "core/problem.h"
#include "cpu/cpu_backend.h"

namespace pathattn::cpu {
namespace {

using core::Problem;
using core::Seq;

#if defined(__GNUC__)
#define PA_INLINE inline __attribute__((always_inline))
#else
#define PA_INLINE inline
#endif
// The float decode kernels are compiled for AVX-512, AVX2 + FMA and baseline x86-64 and picked at run time
// (portable binaries, wide vectors where the CPU has them). Measured with the DecodeTiming test (f32,
// K = V = 128, H = 8, HQ = 32, one thread, 16-core Xeon host): the one-pass blocked kernel below takes
// 1.1 / 6.1 / 25 / 50 ms per step at 1k / 4k / 16k / 32k cached tokens against 2.1 / 7.3 / 32 / 65 ms for
// a first two-pass version with baseline SSE2 code; a software prefetch of the next block gained nothing.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PA_DECODE_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define PA_DECODE_CLONES
#endif

// Dot product of two length-n rows, n a multiple of 8 (K and V always are). Sixteen independent partial
// sums so the compiler vectorises it without reassociation flags and several vector adds are in flight.
// The summation order is fixed, so results never depend on the thread count; the ISA clones may contract
// a * b + c into FMAs, so the last bits can differ between CPUs (not between runs on one CPU).
template <typename T>
PA_INLINE T dot16(const T* __restrict a, const T* __restrict b, int64_t n) {
  T acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  if (i < n)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; l < 8; ++l) acc[l] += acc[l + 8];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// y[0..n) += alpha * x[0..n).
template <typename T>
PA_INLINE void axpy(T* __restrict y, T alpha, const T* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Pointer to row j of cache tensor x [N, H(Q), C, D] (or element j of a rank-3 gate cache [N, HQ, C]).
template <typename T>
inline T* cache_row(const TensorView& x, int64_t n, int64_t h, int64_t j) {
  return static_cast<T*>(x.data) + n * x.stride[0] + h * x.stride[1] + j * x.stride[2];
}

// One step of the prefill walk over a K x K row-major suffix product M (fp64): for every row r,
//   out[r] = M_r . k_j,   then (when update)  M_r <- M_r - beta_j (M_r . w_j) w_j   (M <- M H_j).
// One pass over M per step; compiled per ISA like the decode kernels.
template <typename Tc>
PA_INLINE void prefill_step_t(double* M, int64_t K, const double* kj, const double* wj, double bj, bool update,
                              Tc* out) {
  for (int64_t r = 0; r < K; ++r) {
    double* Mr = M + r * K;
    out[r] = Tc(dot16(Mr, kj, K));
    if (update) axpy(Mr, -bj * dot16(Mr, wj, K), wj, K);
  }
}
PA_DECODE_CLONES void prefill_step(double* M, int64_t K, const double* kj, const double* wj, double bj,
                                   bool update, float* out) {
  prefill_step_t(M, K, kj, wj, bj, update, out);
}
PA_DECODE_CLONES void prefill_step(double* M, int64_t K, const double* kj, const double* wj, double bj,
                                   bool update, double* out) {
  prefill_step_t(M, K, kj, wj, bj, update, out);
}

// Fills cache slot n, kv head h (and its query heads' gate cumsums) from sequence s (length L):
//   kc[n, h, j, :] = H_{L-1} ... H_{j+1} k_j   (j < L),   vc[n, h, j, :] = v_j,   gc[n, hq, j] = G_j.
// Tc is the cache type (float | double). The running K x K suffix product M = H_{L-1} ... H_{j+1} is kept
// in fp64 whatever Tc, walked from j = L-1 down to 0: kc_j = M k_j, then M <- M H_j = M - beta_j (M w_j) w_j^T.
// O(L K^2) time, O(K^2) memory. fp64 M, measured (f32 inputs, L = 4096, K = 64 and 128, beta near 2): keys
// within one fp32 rounding of the fp64 cache (5.9e-8 of the key's largest entry) against 3.5e-6 to 4.1e-6
// with an fp32 M; the walk stays a small part of prefill next to the O(L^2 K) forward.
template <typename Tc>
void prefill_unit(const PathPrefillParams& p, const Problem& pr, const Seq& s, int64_t n, int64_t h) {
  const PathFwdParams& f = p.fwd;
  const DecodeCache& c = p.cache;
  const int64_t K = pr.K, V = pr.V, L = s.len;
  std::vector<double> M(K * K, 0.0), kj(K), wj(K);
  for (int64_t e = 0; e < K; ++e) M[e * K + e] = 1.0;
  for (int64_t j = L - 1; j >= 0; --j) {
    core::load_rows(f.k, s.b, s.t0 + j, 1, h, K, kj.data(), K);
    Tc* out = cache_row<Tc>(c.kc, n, h, j);
    if (!pr.path) {
      for (int64_t e = 0; e < K; ++e) out[e] = Tc(kj[e]);
      continue;
    }
    core::load_rows(f.w, s.b, s.t0 + j, 1, h, K, wj.data(), K);
    const double bj = core::load_elem<double>(f.beta.data, f.beta.dtype, core::offset3(f.beta, s.b, s.t0 + j, h));
    prefill_step(M.data(), K, kj.data(), wj.data(), bj, /*update=*/j > 0, out);
  }
  for (int64_t j = 0; j < L; ++j) core::load_rows(f.v, s.b, s.t0 + j, 1, h, V, cache_row<Tc>(c.vc, n, h, j), V);
  if (pr.gate) {
    for (int64_t hq = h * pr.group; hq < (h + 1) * pr.group; ++hq) {
      double G = 0;  // gc is fp64 whatever the cache type: |G| grows linearly along the sequence
      double* gc = cache_row<double>(c.gc, n, hq, 0);
      for (int64_t j = 0; j < L; ++j) {
        G += core::load_elem<double>(f.g.data, f.g.dtype, core::offset3(f.g, s.b, s.t0 + j, hq));
        gc[j * c.gc.stride[2]] = G;
      }
    }
  }
}

// Decode kernel 1, a block of rows of one kv head: transport the first nt cached keys across H_{t+1} in
// place, then score all ns >= nt rows against each query head of the group (the row is in L1 for the dots).
//   kc [ns rows, row stride ks, K]:  kc_j <- kc_j - beta (w . kc_j) w   (j < nt, when path)
//   q [G, K], sc [G, ld]:            sc[gi, j] = scale * q_gi . kc_j     (j < ns)
template <typename T>
PA_INLINE void transport_score_t(T* kc, int64_t ks, int64_t nt, int64_t ns, int64_t K, const T* w, T beta,
                                 bool path, const T* q, int64_t G, T scale, T* sc, int64_t ld) {
  for (int64_t j = 0; j < ns; ++j) {
    T* row = kc + j * ks;
    if (path && j < nt) axpy(row, -beta * dot16(w, row, K), w, K);
    for (int64_t gi = 0; gi < G; ++gi) sc[gi * ld + j] = scale * dot16(q + gi * K, row, K);
  }
}

// acc[gi, 0..W) += sum_{j < nr} p[gi, j] vc[j, 0..W) for GN heads: GN x W accumulators that stay in
// registers while the rows stream by (vc already offset to the column tile). Summed in order j = 0, 1, ...
template <typename T, int GN, int W>
PA_INLINE void value_tile(const T* vc, int64_t vs, int64_t nr, const T* p, int64_t ld, T* acc, int64_t V) {
  T a[GN][W];
  for (int gi = 0; gi < GN; ++gi)
    for (int l = 0; l < W; ++l) a[gi][l] = acc[gi * V + l];
  for (int64_t j = 0; j < nr; ++j) {
    const T* vj = vc + j * vs;
    for (int gi = 0; gi < GN; ++gi) {
      const T pj = p[gi * ld + j];
#pragma omp simd  // vectorise over the columns (not across rows j, which GCC otherwise picks)
      for (int l = 0; l < W; ++l) a[gi][l] += pj * vj[l];
    }
  }
  for (int gi = 0; gi < GN; ++gi)
    for (int l = 0; l < W; ++l) acc[gi * V + l] = a[gi][l];
}

template <typename T, int GN>
PA_INLINE void value_heads(const T* vc, int64_t vs, int64_t nr, int64_t V, const T* p, int64_t ld, T* acc) {
  int64_t e = 0;
  for (; e + 16 <= V; e += 16) value_tile<T, GN, 16>(vc + e, vs, nr, p, ld, acc + e, V);
  if (e < V) value_tile<T, GN, 8>(vc + e, vs, nr, p, ld, acc + e, V);  // V % 16 == 8
}

// Decode kernel 2, a block of rows of one kv head: acc[gi, :] += sum_{j < nr} p[gi, j] vc_j for the G query
// heads of the group, four heads at a time.   vc [nr rows, row stride vs, V], p [G, ld], acc [G, V].
template <typename T>
PA_INLINE void weighted_values_t(const T* vc, int64_t vs, int64_t nr, int64_t V, const T* p, int64_t ld,
                                 int64_t G, T* acc) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const T* pg = p + g0 * ld;
    T* ag = acc + g0 * V;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: value_heads<T, 1>(vc, vs, nr, V, pg, ld, ag); break;
      case 2: value_heads<T, 2>(vc, vs, nr, V, pg, ld, ag); break;
      case 3: value_heads<T, 3>(vc, vs, nr, V, pg, ld, ag); break;
      default: value_heads<T, 4>(vc, vs, nr, V, pg, ld, ag); break;
    }
  }
}

PA_DECODE_CLONES void transport_score(float* kc, int64_t ks, int64_t nt, int64_t ns, int64_t K, const float* w,
                                      float beta, bool path, const float* q, int64_t G, float scale, float* sc,
                                      int64_t ld) {
  transport_score_t(kc, ks, nt, ns, K, w, beta, path, q, G, scale, sc, ld);
}
void transport_score(double* kc, int64_t ks, int64_t nt, int64_t ns, int64_t K, const double* w, double beta,
                     bool path, const double* q, int64_t G, double scale, double* sc, int64_t ld) {
  transport_score_t(kc, ks, nt, ns, K, w, beta, path, q, G, scale, sc, ld);
}
PA_DECODE_CLONES void weighted_values(const float* vc, int64_t vs, int64_t nr, int64_t V, const float* p,
                                      int64_t ld, int64_t G, float* acc) {
  weighted_values_t(vc, vs, nr, V, p, ld, G, acc);
}
void weighted_values(const double* vc, int64_t vs, int64_t nr, int64_t V, const double* p, int64_t ld,
                     int64_t G, double* acc) {
  weighted_values_t(vc, vs, nr, V, p, ld, G, acc);
}

// Rows per block of the one-pass decode: 32 rows of kc and vc (16 KB each at K = V = 128) stay in L1
// between the transport, the scores and the value sum.
constexpr int64_t kDecodeRows = 32;

// Per-thread scratch of a decode step ([G, K] queries, [G, kDecodeRows] scores, [G, V] accumulators...),
// reused across calls: nothing in a step is proportional to the cache length.
template <typename Tc>
std::vector<Tc>& decode_scratch() {
  thread_local std::vector<Tc> buf;
  return buf;
}

// One decode step of slot n, kv head h, whose cache holds L tokens; the inputs are row n of the
// [N, 1, ...] tensors of p. One pass over the cache in blocks of kDecodeRows rows (FlashDecoding-style
// online softmax): transport the block's keys in place, score them, fold them into running max / sum /
// accumulator per query head. kc is read and written once, vc read once.
//   s[gi, j] = scale q_gi . kc_j + gate_scale (G_new - G_j),   j = 0..L (row L is the new token)
//   o[n, 0, hq, :] = softmax_j(s[gi, .]) vc,   lse[n, 0, hq] = log sum_j exp s[gi, j]
template <typename Tc>
void decode_unit(const PathDecodeParams& p, const Problem& pr, int64_t n, int64_t h, int64_t L) {
  const DecodeCache& c = p.cache;
  const int64_t K = pr.K, V = pr.V, G = pr.group, S = L + 1, B = kDecodeRows;
  std::vector<Tc>& buf = decode_scratch<Tc>();
  const size_t need = size_t(G * K + K + 2 * G + G * B + G * V);
  if (buf.size() < need) buf.resize(need);
  thread_local std::vector<double> gnew_buf;
  gnew_buf.resize(G);
  double* gnew = gnew_buf.data();  // [G] G_new per query head (fp64, like gc)
  Tc* q = buf.data();    // [G, K]
  Tc* w = q + G * K;     // [K]
  Tc* mx = w + K;        // [G] running max
  Tc* den = mx + G;      // [G] running sum of exp(s - mx)
  Tc* sc = den + G;      // [G, B] scores of one block
  Tc* acc = sc + G * B;  // [G, V]

  for (int64_t gi = 0; gi < G; ++gi) core::load_rows(p.q, n, 0, 1, h * G + gi, K, q + gi * K, K);
  Tc beta = 0;
  if (pr.path) {
    core::load_rows(p.w, n, 0, 1, h, K, w, K);
    beta = core::load_elem<Tc>(p.beta.data, p.beta.dtype, core::offset3(p.beta, n, 0, h));
  }
  const Tc scale = Tc(pr.scale);

  // Append the new token first (its key needs no transport: the empty product), so row L joins the pass.
  const int64_t ks = c.kc.stride[2], vs = c.vc.stride[2], gs = pr.gate ? c.gc.stride[2] : 0;
  Tc* kc = cache_row<Tc>(c.kc, n, h, 0);
  const Tc* vc = cache_row<Tc>(c.vc, n, h, 0);
  core::load_rows(p.k, n, 0, 1, h, K, kc + L * ks, K);
  core::load_rows(p.v, n, 0, 1, h, V, cache_row<Tc>(c.vc, n, h, L), V);
  for (int64_t gi = 0; gi < G && pr.gate; ++gi) {
    const int64_t hq = h * G + gi;
    double* gc = cache_row<double>(c.gc, n, hq, 0);
    const double g = core::load_elem<double>(p.g.data, p.g.dtype, core::offset3(p.g, n, 0, hq));
    gnew[gi] = (L > 0 ? gc[(L - 1) * gs] : 0.0) + g;
    gc[L * gs] = gnew[gi];
  }
  std::fill(mx, mx + G, -std::numeric_limits<Tc>::infinity());
  std::fill(den, den + G, Tc(0));
  std::fill(acc, acc + G * V, Tc(0));

  for (int64_t j0 = 0; j0 < S; j0 += B) {
    const int64_t nb = std::min(B, S - j0), nt = std::max<int64_t>(0, std::min(nb, L - j0));
    transport_score(kc + j0 * ks, ks, nt, nb, K, w, beta, pr.path, q, G, scale, sc, B);
    for (int64_t gi = 0; gi < G; ++gi) {
      Tc* s = sc + gi * B;
      if (pr.gate) {
        // The difference is taken in fp64, then rounded once: its error scales with G_new - G_j, not |G|.
        const double* gc = cache_row<double>(c.gc, n, h * G + gi, j0);
        for (int64_t j = 0; j < nb; ++j) s[j] += Tc(pr.gate_scale * (gnew[gi] - gc[j * gs]));
      }
      Tc m = mx[gi];
      for (int64_t j = 0; j < nb; ++j) m = std::max(m, s[j]);
      // All scores -inf so far (a closed gate): shift by 0 so exp gives 0 rather than NaN.
      const Tc shift = m == -std::numeric_limits<Tc>::infinity() ? Tc(0) : m;
      if (m != mx[gi]) {  // rescale what was accumulated under the old max
        const Tc alpha = std::exp(mx[gi] - shift);
        den[gi] *= alpha;
        for (int64_t e = 0; e < V; ++e) acc[gi * V + e] *= alpha;
        mx[gi] = m;
      }
      Tc l = 0;
      for (int64_t j = 0; j < nb; ++j) {
        s[j] = std::exp(s[j] - shift);
        l += s[j];
      }
      den[gi] += l;
    }
    weighted_values(vc + j0 * vs, vs, nb, V, sc, B, G, acc);
  }

  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t hq = h * G + gi;
    const Tc inv = Tc(1) / den[gi];
    const int64_t off = core::offset3(p.o, n, 0, hq);
    for (int64_t e = 0; e < V; ++e) core::store_elem<Tc>(p.o.data, p.o.dtype, off + e, acc[gi * V + e] * inv);
    if (p.lse.present()) {
      core::store_elem<Tc>(p.lse.data, p.lse.dtype, core::offset3(p.lse, n, 0, hq), mx[gi] + std::log(den[gi]));
    }
  }
}

}  // namespace

Status prefill(const PathPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& seqs) {
  const int64_t nunits = int64_t(seqs.size()) * pr.H;
  parallel_for(nunits, p.fwd.num_threads, [&](int64_t u) {
    const int64_t n = u / pr.H, h = u % pr.H;
    if (pr.f64) prefill_unit<double>(p, pr, seqs[n], n, h);
    else prefill_unit<float>(p, pr, seqs[n], n, h);
  });
  return Status::Ok();
}

Status decode(const PathDecodeParams& p, const core::Problem& pr, const std::vector<int64_t>& lengths) {
  parallel_for(pr.B * pr.H, p.num_threads, [&](int64_t u) {
    const int64_t n = u / pr.H, h = u % pr.H;
    if (pr.f64) decode_unit<double>(p, pr, n, h, lengths[n]);
    else decode_unit<float>(p, pr, n, h, lengths[n]);
  });
  return Status::Ok();
}

}  // namespace pathattn::cpu
