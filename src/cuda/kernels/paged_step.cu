// cuda/kernels/paged_step.cu: a decode step of the paged cache (include/pathattn/paged.h). Three launches, all
// reading the slots' metadata on the device (so a step can be captured in a CUDA graph):
//   paged_flush_kernel   slots with S tokens pending apply their S factors to their keys (most CTAs exit at once);
//   paged_decode_kernel  split over the cached rows (FlashDecoding): each CTA carries the query back across the
//                        pending factors, scores its rows and leaves a partial softmax state; split 0 also takes
//                        the pending tokens and the new one, and appends the new token;
//   paged_combine_kernel merges the partial states into o and lse and advances lengths / flushed.
#include <algorithm>
#include <string>
#include <vector>

#include "cuda/kernels/paged_common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

// ------------------------------------------------------------------------------------------------------
// The flush: grid (N * H, flush_ctas). For a slot with S tokens pending, every CTA of (n, h) builds
// P = H_{L-1} ... H_m (K x K, fp32, in shared memory, stored transposed so that a thread's output columns are
// consecutive words), then applies it to its share of the rows [0, m); CTA 0 also carries the pending keys to L
// and writes them into rows [m, L). Keys are rounded to the page dtype once here.
template <typename KT, int K>
__global__ void __launch_bounds__(kThreads) paged_flush_kernel(PagedArgs a) {
  const int n = blockIdx.x / a.H, h = blockIdx.x % a.H, x = blockIdx.y;
  const SlotState st = slot_state(a, n);
  if (st.status != 0 || !a.path || st.L - st.m != a.S) return;
  const int m = st.m, S = a.S, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  extern __shared__ float fsm[];
  float* PT = fsm;              // [K][K]: PT[c][r] = P[r][c]
  float* W = PT + K * K;        // [S][K]
  float* bs = W + S * K;        // [S]
  float* rv = bs + kPagedMaxPending;  // [K]
  float* X = rv + K;            // [kTileRows][K]: the pending keys (CTA 0), then the row tiles
  for (int i = tid; i < S * K; i += kThreads) {
    const int r = i / K, e = i % K;
    W[i] = a.pw[n * a.pw_s[0] + r * a.pw_s[1] + h * a.pw_s[2] + e];
  }
  for (int r = tid; r < S; r += kThreads) bs[r] = a.pb[n * a.pb_s[0] + r * a.pb_s[1] + h];
  for (int i = tid; i < K * K; i += kThreads) PT[i] = (i / K == i % K) ? 1.f : 0.f;
  __syncthreads();
  // P <- H_t P = P - beta_t w_t (w_t^T P), t = m .. L-1 in order; rv = w_t^T P (rv[c] = sum_r w[r] P[r][c]).
  for (int t = 0; t < S; ++t) {
    const float* wt = W + t * K;
    for (int c = warp; c < K; c += kWarps) {  // a warp a column: PT's row c is contiguous
      float acc = 0.f;
      for (int r = lane; r < K; r += 32) acc += wt[r] * PT[c * K + r];
      acc = warp_sum(acc);
      if (lane == 0) rv[c] = acc;
    }
    __syncthreads();
    for (int i = tid; i < K * K; i += kThreads) {
      const int c = i / K, r = i % K;  // PT[c][r] = P[r][c]
      PT[i] -= bs[t] * wt[r] * rv[c];
    }
    __syncthreads();
  }
  if (x == 0) {
    // Pending keys: x_j = k_j, then for t = m+1 .. L-1: x_j <- x_j - beta_t (w_t . x_j) w_t for pending j < t.
    for (int i = tid; i < S * K; i += kThreads) {
      const int r = i / K, e = i % K;
      X[i] = a.pk[n * a.pk_s[0] + r * a.pk_s[1] + h * a.pk_s[2] + e];
    }
    __syncthreads();
    for (int t = 1; t < S; ++t) {
      const float* wt = W + t * K;
      for (int j = warp; j < t; j += kWarps) {
        float* xj = X + j * K;
        float d = 0.f;
        for (int e = lane; e < K; e += 32) d += wt[e] * xj[e];
        const float c = bs[t] * warp_sum(d);
        for (int e = lane; e < K; e += 32) xj[e] -= c * wt[e];
      }
      __syncthreads();
    }
    for (int i = tid; i < S * K; i += kThreads) {
      const int r = i / K, e = i % K;
      key_row<KT>(a, n, h, m + r)[e] = from_f<KT>(X[i]);
    }
    __syncthreads();
  }
  // Rows [m * x / X, m * (x + 1) / X) of the flushed keys, kTileRows at a time: thread (cg, rg) computes output
  // columns 4 cg .. 4 cg + 3 of rows rg * RPG .. + RPG - 1 of the tile.
  constexpr int CG = K / 4, RG = kThreads / CG, RPG = kTileRows / RG;
  const int cg = tid % CG, rg = tid / CG;
  const int64_t r0 = int64_t(m) * x / a.flush_ctas, r1 = int64_t(m) * (x + 1) / a.flush_ctas;
  for (int64_t base = r0; base < r1; base += kTileRows) {
    const int rows = int(r1 - base < kTileRows ? r1 - base : kTileRows);
    for (int i = tid; i < rows * K; i += kThreads) {
      const int r = i / K, e = i % K;
      X[i] = to_f(key_row<KT>(a, n, h, base + r)[e]);
    }
    __syncthreads();
    float acc[RPG][4] = {};
    for (int c = 0; c < K; ++c) {
      const float4 p = *reinterpret_cast<const float4*>(PT + c * K + 4 * cg);
#pragma unroll
      for (int rr = 0; rr < RPG; ++rr) {
        const float xv = X[(rg * RPG + rr) * K + c];
        acc[rr][0] += p.x * xv;
        acc[rr][1] += p.y * xv;
        acc[rr][2] += p.z * xv;
        acc[rr][3] += p.w * xv;
      }
    }
#pragma unroll
    for (int rr = 0; rr < RPG; ++rr) {
      const int r = rg * RPG + rr;
      if (r < rows) {
        KT* dst = key_row<KT>(a, n, h, base + r) + 4 * cg;
#pragma unroll
        for (int i = 0; i < 4; ++i) dst[i] = from_f<KT>(acc[rr][i]);
      }
    }
    __syncthreads();
  }
}

// ------------------------------------------------------------------------------------------------------
// The step: grid (N * H, nsplit), kThreads threads. CTA (n, h, sp) scores rows [m' sp / ns, m' (sp + 1) / ns)
// of the flushed keys (m' the flush point after this step's flush), kHeadsPerPass query heads of the group at a
// time; split 0 also scores the pending tokens and the new one (their scores come out of the sweep) and appends.

template <int K, int V>
struct StepSmem {
  static constexpr int CG = V / 8, RG = kThreads / CG, RPG = kTileRows / RG;  // the value phase's thread grid
  float uq[kHeadsPerPass][K];         // the queries carried back to the flush point
  float sw[kHeadsPerPass][kMaxSweep];  // the sweep's raw scores, row j - m
  float sc[kHeadsPerPass][kTileRows];  // a tile's logits, then its probabilities
  float alpha[kHeadsPerPass], mrun[kHeadsPerPass], lrun[kHeadsPerPass];
  double gi[kHeadsPerPass];            // G_i, the new token's gate cumsum
  float red[RG][V];                    // the row groups' accumulators, merged in a fixed order
};

// Where a step's token t comes from: q, k, v, w, beta, g of slot n (heads h / hq) in the call's inputs.
template <typename VT>
__device__ __forceinline__ const VT* in_row(const void* x, const int64_t (&s)[3], int n, int t, int head) {
  return static_cast<const VT*>(x) + n * s[0] + int64_t(t) * s[1] + head * s[2];
}

// The sweep, one warp a query head of the pass: u = q; for j = L down to m: s_j = u . k_j (into sw), then
// u <- u - beta_j (w_j . u) w_j; u ends in uq. Also G_i and the running softmax state of each head.
template <typename VT, int K, int V>
__device__ void sweep(const PagedArgs& a, StepSmem<K, V>& sm, int n, int h, int g0, int gn, int L, int m) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pc = L - m;
  if (warp >= gn) return;
  const int hq = h * a.G + g0 + warp;
  constexpr int KP = K / 32;
  const VT* q = in_row<VT>(a.q, a.q_s, n, a.t, hq);
  float u[KP];
#pragma unroll
  for (int i = 0; i < KP; ++i) u[i] = to_f(q[lane + 32 * i]);
  // Row r of the sweep (r = j - m): the new token from the step's inputs (r == pc), else a pending row.
  auto load_row = [&](int r, float (&kv)[KP], float (&wv)[KP], float& b) {
    b = 0.f;
    if (r == pc) {
      const VT* kr = in_row<VT>(a.k, a.k_s, n, a.t, h);
#pragma unroll
      for (int i = 0; i < KP; ++i) kv[i] = to_f(kr[lane + 32 * i]);
      if (a.path) {
        const int64_t wo = n * a.w_s[0] + int64_t(a.t) * a.w_s[1] + h * a.w_s[2];
#pragma unroll
        for (int i = 0; i < KP; ++i) wv[i] = load_param(a.w, a.w_dt, wo + lane + 32 * i);
        b = load_param(a.beta, a.beta_dt, n * a.beta_s[0] + int64_t(a.t) * a.beta_s[1] + h * a.beta_s[2]);
      }
    } else {
      const float* kr = a.pk + n * a.pk_s[0] + r * a.pk_s[1] + h * a.pk_s[2];
      const float* wr = a.pw + n * a.pw_s[0] + r * a.pw_s[1] + h * a.pw_s[2];
#pragma unroll
      for (int i = 0; i < KP; ++i) {
        kv[i] = kr[lane + 32 * i];
        wv[i] = wr[lane + 32 * i];
      }
      b = a.pb[n * a.pb_s[0] + r * a.pb_s[1] + h];
    }
  };
  float kv[KP], wv[KP], b;
  load_row(pc, kv, wv, b);
  for (int j = L; j >= m; --j) {
    const int r = j - m;
    // The next row's loads go out before this row's reductions, which hide their latency (the sweep is serial).
    float kn[KP], wn[KP], bn = 0.f;
    if (r > 0) load_row(r - 1, kn, wn, bn);
    float dk = 0.f, dw = 0.f;
#pragma unroll
    for (int i = 0; i < KP; ++i) {
      dk += u[i] * kv[i];
      if (a.path) dw += u[i] * wv[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      dk += __shfl_xor_sync(0xffffffffu, dk, o);
      dw += __shfl_xor_sync(0xffffffffu, dw, o);
    }
    if (lane == 0) sm.sw[warp][r] = dk;
    if (a.path) {
      const float c = b * dw;
#pragma unroll
      for (int i = 0; i < KP; ++i) u[i] -= c * wv[i];
    }
    if (r > 0) {
#pragma unroll
      for (int i = 0; i < KP; ++i) {
        kv[i] = kn[i];
        wv[i] = wn[i];
      }
      b = bn;
    }
  }
#pragma unroll
  for (int i = 0; i < KP; ++i) sm.uq[warp][lane + 32 * i] = u[i];
  if (lane == 0) {
    double gsum = 0.0;
    if (a.gate) {
      gsum = L > 0 ? *gate_cell(a, n, hq, L - 1) : 0.0;
      gsum += double(load_param(a.g, a.g_dt, n * a.g_s[0] + int64_t(a.t) * a.g_s[1] + hq * a.g_s[2]));
    }
    sm.gi[warp] = gsum;
    sm.mrun[warp] = -INFINITY;
    sm.lrun[warp] = 0.f;
  }
}

// Online softmax over one tile of `rows` logits in sm.sc (one warp a head), then acc += p v with thread (cg, rg)
// owning value columns 8 cg .. 8 cg + 7 of rows rg * RPG .. + RPG - 1; value_of(r) is tile row r's value row.
template <typename VT, int K, int V, typename ValueOf>
__device__ void fold_tile(StepSmem<K, V>& sm, float (&acc)[kHeadsPerPass][8], int rows, int gn, ValueOf value_of) {
  using S = StepSmem<K, V>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, cg = tid % S::CG, rg = tid / S::CG;
  __syncthreads();  // sc is complete
  if (warp < gn) {
    const float z0 = lane < rows ? sm.sc[warp][lane] : -INFINITY;
    const float z1 = lane + 32 < rows ? sm.sc[warp][lane + 32] : -INFINITY;
    float mx = fmaxf(z0, z1);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float mold = sm.mrun[warp], mnew = fmaxf(mold, mx);
    const float shift = mnew == -INFINITY ? 0.f : mnew;  // nothing finite yet: exp gives 0, not NaN
    const float p0 = expf(z0 - shift), p1 = expf(z1 - shift);
    if (lane < rows) sm.sc[warp][lane] = p0;
    if (lane + 32 < rows) sm.sc[warp][lane + 32] = p1;
    const float ps = warp_sum(p0 + p1);
    if (lane == 0) {
      const float al = expf(mold - shift);
      sm.alpha[warp] = al;
      sm.lrun[warp] = sm.lrun[warp] * al + ps;
      sm.mrun[warp] = mnew;
    }
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kHeadsPerPass; ++g) {
    if (g < gn) {
      const float al = sm.alpha[g];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= al;
    }
  }
#pragma unroll
  for (int rr = 0; rr < S::RPG; ++rr) {
    const int r = rg * S::RPG + rr;
    if (r < rows) {
      float vv[8];
      load_vec<VT, 8>(value_of(r) + 8 * cg, vv);
#pragma unroll
      for (int g = 0; g < kHeadsPerPass; ++g) {
        if (g < gn) {
          const float p = sm.sc[g][r];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] += p * vv[e];
        }
      }
    }
  }
  __syncthreads();  // sc may be overwritten
}

// The logits of flushed rows base .. base + rows - 1 into sm.sc: kSegThreads threads a key row, KE elements each.
template <typename KT, int K, int V>
__device__ void score_tile(const PagedArgs& a, StepSmem<K, V>& sm, int n, int h, int g0, int gn, int64_t base, int rows) {
  constexpr int KE = K / kSegThreads, RPP = kThreads / kSegThreads;
  const int tid = threadIdx.x, seg = tid % kSegThreads;
#pragma unroll
  for (int pass = 0; pass < kTileRows / RPP; ++pass) {
    const int r = pass * RPP + tid / kSegThreads;
    float kv[KE];
    const bool ok = r < rows;
    if (ok) load_vec<KT, KE>(key_row<KT>(a, n, h, base + r) + seg * KE, kv);
#pragma unroll
    for (int g = 0; g < kHeadsPerPass; ++g) {
      if (g < gn) {
        float d = 0.f;
        if (ok) {
#pragma unroll
          for (int e = 0; e < KE; ++e) d += sm.uq[g][seg * KE + e] * kv[e];
        }
        d += __shfl_xor_sync(0xffffffffu, d, 1);
        d += __shfl_xor_sync(0xffffffffu, d, 2);
        d += __shfl_xor_sync(0xffffffffu, d, 4);
        if (ok && seg == 0) {
          float z = a.scale * d;
          if (a.gate) z += float(a.gate_scale * (sm.gi[g] - *gate_cell(a, n, h * a.G + g0 + g, base + r)));
          sm.sc[g][r] = z;
        }
      }
    }
  }
}

// The row groups' accumulators merged in a fixed order: this split's partial state of each head of the pass.
template <int K, int V>
__device__ void write_partials(const PagedArgs& a, StepSmem<K, V>& sm, const float (&acc)[kHeadsPerPass][8], int n,
                               int h, int sp, int g0, int gn) {
  using S = StepSmem<K, V>;
  const int tid = threadIdx.x, cg = tid % S::CG, rg = tid / S::CG;
  for (int g = 0; g < gn; ++g) {
#pragma unroll
    for (int e = 0; e < 8; ++e) sm.red[rg][8 * cg + e] = acc[g][e];
    __syncthreads();
    if (tid < V) {
      float s = 0.f;
      for (int r = 0; r < S::RG; ++r) s += sm.red[r][tid];
      const int hq = h * a.G + g0 + g;
      float* part = a.part + ((int64_t(n) * a.HQ + hq) * a.nsplit + sp) * (V + 2);
      part[2 + tid] = s;
      if (tid == 0) {
        part[0] = sm.mrun[g];
        part[1] = sm.lrun[g];
      }
    }
    __syncthreads();
  }
}

// Split 0 appends the new token: its k, w, beta to pending row pc (without w its key straight into the pages),
// its value, and G_L for the group's query heads.
template <typename KT, typename VT, int K, int V>
__device__ void append_token(const PagedArgs& a, int n, int h, int L, int pc) {
  const int tid = threadIdx.x;
  const VT* kr = in_row<VT>(a.k, a.k_s, n, a.t, h);
  if (a.path) {
    const int64_t po = n * a.pk_s[0] + int64_t(pc) * a.pk_s[1] + h * a.pk_s[2];
    const int64_t wo = n * a.w_s[0] + int64_t(a.t) * a.w_s[1] + h * a.w_s[2];
    for (int e = tid; e < K; e += kThreads) {
      a.pk[po + e] = to_f(kr[e]);
      a.pw[n * a.pw_s[0] + int64_t(pc) * a.pw_s[1] + h * a.pw_s[2] + e] = load_param(a.w, a.w_dt, wo + e);
    }
    if (tid == 0) {
      a.pb[n * a.pb_s[0] + int64_t(pc) * a.pb_s[1] + h] =
          load_param(a.beta, a.beta_dt, n * a.beta_s[0] + int64_t(a.t) * a.beta_s[1] + h * a.beta_s[2]);
    }
  } else {
    KT* dst = key_row<KT>(a, n, h, L);
    for (int e = tid; e < K; e += kThreads) dst[e] = from_f<KT>(to_f(kr[e]));
  }
  const VT* vin = in_row<VT>(a.v, a.v_s, n, a.t, h);
  VT* vdst = value_row<VT>(a, n, h, L);
  for (int e = tid; e < V; e += kThreads) vdst[e] = vin[e];
  if (a.gate) {
    for (int g = tid; g < a.G; g += kThreads) {
      const int hq = h * a.G + g;
      double gsum = L > 0 ? *gate_cell(a, n, hq, L - 1) : 0.0;
      gsum += double(load_param(a.g, a.g_dt, n * a.g_s[0] + int64_t(a.t) * a.g_s[1] + hq * a.g_s[2]));
      *gate_cell(a, n, hq, L) = gsum;
    }
  }
}

template <typename KT, typename VT, int K, int V>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(PagedArgs a) {
  const int n = blockIdx.x / a.H, h = blockIdx.x % a.H, sp = blockIdx.y;
  const SlotState st = slot_state(a, n);
  const int L = st.L;
  const int m = (st.status == 0 && a.path && L - st.m == a.S) ? L : st.m;  // the flush kernel just ran
  if (h == 0 && sp == 0 && threadIdx.x == 0) a.info[n] = make_int4(L, m, st.status, 0);
  if (st.status != 0) return;
  const int pc = L - m;  // pending tokens before the new one
  __shared__ StepSmem<K, V> sm;
  const VT* vin = in_row<VT>(a.v, a.v_s, n, a.t, h);
  const int64_t r0 = int64_t(m) * sp / a.nsplit, r1 = int64_t(m) * (sp + 1) / a.nsplit;
  for (int g0 = 0; g0 < a.G; g0 += kHeadsPerPass) {
    const int gn = min(kHeadsPerPass, a.G - g0);
    sweep<VT>(a, sm, n, h, g0, gn, L, m);
    __syncthreads();
    float acc[kHeadsPerPass][8] = {};
    if (sp == 0) {  // the pending tokens and the new one: logits from the sweep
      const int rows = pc + 1;
      for (int i = threadIdx.x; i < kHeadsPerPass * rows; i += kThreads) {
        const int g = i / rows, r = i % rows;
        if (g < gn) {
          float z = a.scale * sm.sw[g][r];
          if (a.gate && r < pc) z += float(a.gate_scale * (sm.gi[g] - *gate_cell(a, n, h * a.G + g0 + g, m + r)));
          sm.sc[g][r] = z;
        }
      }
      fold_tile<VT>(sm, acc, rows, gn, [&](int r) -> const VT* { return r == pc ? vin : value_row<VT>(a, n, h, m + r); });
    }
    for (int64_t base = r0; base < r1; base += kTileRows) {
      const int rows = int(r1 - base < kTileRows ? r1 - base : kTileRows);
      score_tile<KT>(a, sm, n, h, g0, gn, base, rows);
      fold_tile<VT>(sm, acc, rows, gn, [&](int r) -> const VT* { return value_row<VT>(a, n, h, base + r); });
    }
    write_partials(a, sm, acc, n, h, sp, g0, gn);
  }
  if (sp == 0) append_token<KT, VT, K, V>(a, n, h, L, pc);
}

// Grid N * HQ, V threads: the partial states of (slot, query head) merged in split order; o = acc / sum,
// lse = max + log(sum). A free slot gets zeros (lse -inf), a bad one NaN; only a good slot advances.
template <typename VT>
__global__ void paged_combine_kernel(PagedArgs a) {
  const int n = blockIdx.x / a.HQ, hq = blockIdx.x % a.HQ, e = threadIdx.x;
  const int4 inf = a.info[n];
  VT* o = static_cast<VT*>(a.o) + n * a.o_s[0] + int64_t(a.t) * a.o_s[1] + hq * a.o_s[2];
  float* lse = a.lse ? a.lse + n * a.lse_s[0] + int64_t(a.t) * a.lse_s[1] + hq * a.lse_s[2] : nullptr;
  if (inf.z != 0) {
    const float fill = inf.z == 1 ? 0.f : NAN;
    if (e < a.V) o[e] = from_f<VT>(fill);
    if (lse && e == 0) *lse = inf.z == 1 ? -INFINITY : NAN;
    return;
  }
  const float* part = a.part + (int64_t(n) * a.HQ + hq) * a.nsplit * (a.V + 2);
  float mx = -INFINITY;
  for (int s = 0; s < a.nsplit; ++s) mx = fmaxf(mx, part[s * (a.V + 2)]);
  const float shift = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f, av = 0.f;
  for (int s = 0; s < a.nsplit; ++s) {
    const float* ps = part + s * (a.V + 2);
    const float f = expf(ps[0] - shift);
    sum += ps[1] * f;
    if (e < a.V) av += ps[2 + e] * f;
  }
  if (e < a.V) o[e] = from_f<VT>(av / sum);
  if (lse && e == 0) *lse = mx + logf(sum);
  if (hq == 0 && e == 0) {
    a.len[n] = inf.x + 1;
    a.fl[n] = a.path ? inf.y : inf.x + 1;
  }
}

size_t flush_smem(int K) {
  return (size_t(K) * K + size_t(kPagedMaxPending) * K + kPagedMaxPending + K + size_t(kTileRows) * K) * sizeof(float);
}

// The call's T tokens, each a step of three launches; the flush kernel's shared-memory limit is raised once.
template <typename KT, typename VT, int K, int V>
Status launch_steps(PagedArgs a, int T, cudaStream_t s) {
  const size_t smem = flush_smem(K);
  if (a.path) {
    PA_CU(cudaFuncSetAttribute(paged_flush_kernel<KT, K>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  for (a.t = 0; a.t < T; ++a.t) {
    if (a.path) {
      paged_flush_kernel<KT, K><<<dim3(unsigned(a.N * a.H), unsigned(a.flush_ctas)), kThreads, smem, s>>>(a);
      PA_CU(cudaGetLastError());
    }
    paged_decode_kernel<KT, VT, K, V><<<dim3(unsigned(a.N * a.H), unsigned(a.nsplit)), kThreads, 0, s>>>(a);
    PA_CU(cudaGetLastError());
    paged_combine_kernel<VT><<<unsigned(a.N * a.HQ), unsigned(std::max(V, 32)), 0, s>>>(a);
    PA_CU(cudaGetLastError());
  }
  return Status::Ok();
}

template <typename KT, typename VT>
Status launch_steps_dims(const PagedArgs& a, int T, cudaStream_t s) {
  if (a.K == 128 && a.V == 128) return launch_steps<KT, VT, 128, 128>(a, T, s);
  if (a.K == 64 && a.V == 64) return launch_steps<KT, VT, 64, 64>(a, T, s);
  if (a.K == 128 && a.V == 64) return launch_steps<KT, VT, 128, 64>(a, T, s);
  return launch_steps<KT, VT, 64, 128>(a, T, s);
}

}  // namespace

Status paged_decode(const PathPagedDecodeParams& p, const core::Problem& pr) {
  PA_TRY(check_paged_support(pr, p.q, p.cache));
  PA_TRY(check_row_copies(p.v, "v"));
  const int64_t N = pr.B;
  if (N == 0 || pr.T == 0) return Status::Ok();
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  int sms = 0;
  PA_CU(device_attr(cudaDevAttrMultiProcessorCount, &sms));
  PagedArgs a{};
  fill_cache_args(p.cache, pr, &a);
  a.N = int(N);
  // Splits of the cached rows and flush CTAs a slot and kv head. A step's grid cannot depend on lengths that live
  // on the device, so it is sized by the capacity: splits of at least kMinSplitRows rows, and the fewest splits
  // from kSplitWaves waves of resident CTAs (two an SM) up whose last wave is at least 90% full.
  const int64_t cap = int64_t(a.max_pages) * a.page, units = N * pr.H, slots = 2 * int64_t(sms);
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>((cap + kMinSplitRows - 1) / kMinSplitRows, 1024));
  int64_t ns = std::min<int64_t>(most, std::max<int64_t>(1, (kSplitWaves * slots + units - 1) / units));
  for (int64_t c = ns; c <= std::min(most, 2 * ns); ++c) {
    const int64_t ctas = units * c, waves = (ctas + slots - 1) / slots;
    if (ctas * 10 >= waves * slots * 9) {
      ns = c;
      break;
    }
  }
  a.nsplit = int(ns);
  a.flush_ctas = int(std::max<int64_t>(1, std::min<int64_t>((slots + units - 1) / units, 32)));
  a.q = p.q.data;
  a.k = p.k.data;
  a.v = p.v.data;
  strides3(p.q, a.q_s);
  strides3(p.k, a.k_s);
  strides3(p.v, a.v_s);
  if (pr.path) {
    a.w = p.w.data;
    a.beta = p.beta.data;
    a.w_dt = param_dt(p.w);
    a.beta_dt = param_dt(p.beta);
    strides3(p.w, a.w_s);
    strides3(p.beta, a.beta_s);
  }
  if (pr.gate) {
    a.g = p.g.data;
    a.g_dt = param_dt(p.g);
    strides3(p.g, a.g_s);
  }
  a.o = p.o.data;
  strides3(p.o, a.o_s);
  a.lse = p.lse.present() ? static_cast<float*>(p.lse.data) : nullptr;
  if (a.lse) strides3(p.lse, a.lse_s);
  Workspace ws(s);
  PA_CU(ws.alloc(&a.part, size_t(N) * pr.HQ * a.nsplit * (pr.V + 2)));
  PA_CU(ws.alloc(&a.info, size_t(N)));
  const bool f16 = p.cache.k_pages.dtype == DType::f16, vh = p.v.dtype == DType::f16;
  const int T = int(pr.T);
  if (f16) return vh ? launch_steps_dims<__half, __half>(a, T, s) : launch_steps_dims<__half, __nv_bfloat16>(a, T, s);
  return vh ? launch_steps_dims<float, __half>(a, T, s) : launch_steps_dims<float, __nv_bfloat16>(a, T, s);
}

}  // namespace pathattn::cuda
