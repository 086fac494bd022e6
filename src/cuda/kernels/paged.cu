// cuda/kernels/paged.cu: the paged decode cache on the device (include/pathattn/paged.h; the algorithm and its
// rounding points are docs/design.md's "The paged decode cache", the same as cpu/paged.cpp). A step is three
// launches, all reading the slots' metadata on the device (so a step can be captured in a CUDA graph):
//   paged_flush_kernel   slots with S tokens pending apply their S factors to their keys (most CTAs exit at once);
//   paged_decode_kernel  split over the cached rows (FlashDecoding): each CTA carries the query back across the
//                        pending factors, scores its rows and leaves a partial softmax state; split 0 also takes
//                        the pending tokens and the new one, and appends the new token;
//   paged_combine_kernel merges the partial states into o and lse and advances lengths / flushed.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cuda/adapter.h"
#include "cuda/cuda_backend.h"
#include "cuda/device/common.cuh"
#include "cuda/host_util.h"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 64;       // cached rows a CTA scores per tile
constexpr int kHeadsPerPass = 4;    // query heads of a GQA group whose accumulators live in registers together
constexpr int kSegThreads = 8;      // threads that share one key row in the score phase
constexpr int kMaxSweep = kPagedMaxPending + 1;  // rows of a sweep: the pending tokens and the new one
constexpr int kMinSplitRows = 256;  // a split's rows amortise its sweep (the query carried back, ~S K-vector steps)
constexpr int kSplitWaves = 2;      // waves of resident CTAs a step's splits aim at

struct PagedArgs {
  // The step's inputs at token t of the call (q, k, v, o over [N, T, heads, dim]; w, beta, g in their dtypes).
  const void *q, *k, *v, *w, *beta, *g;
  ParamDt w_dt, beta_dt, g_dt;
  int64_t q_s[3], k_s[3], v_s[3], w_s[3], beta_s[3], g_s[3];
  void* o;
  float* lse;
  int64_t o_s[3], lse_s[3];
  int t;
  // The cache.
  void* kp;  // [P, page, H, K] f16 / f32
  void* vp;  // [P, page, H, V] dtype of v
  double* gp;  // [P, page, HQ]
  int64_t kp_s[3], vp_s[3], gp_s[2];
  const int32_t* bt;
  int64_t bt_s;
  int max_pages, num_pages, page;
  int32_t *len, *fl;
  float *pk, *pw, *pb;  // [N, S, H, K], [N, S, H, K], [N, S, H]
  int64_t pk_s[3], pw_s[3], pb_s[2];
  int S;
  // Workspace.
  float* part;  // [N, HQ, nsplit, V + 2]: max, sum, accumulator
  int4* info;   // [N]: length before the step, flush point for the step, status (0 ok, 1 free, 2 bad)
  int N, H, HQ, G, K, V, nsplit, flush_ctas;
  bool path, gate;
  float scale;
  double gate_scale;
};

template <typename F>
__device__ __forceinline__ F warp_sum(F x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Slot n's metadata for this step: L (length before it), m (flush point before it), and whether it is valid:
// -1 <= L, L + 1 <= capacity, a flush point the format allows, every page of rows [0, L] inside the pool.
// Every CTA of a slot evaluates it the same way, so they agree without talking.
struct SlotState {
  int L, m, status;  // status 0 ok, 1 free, 2 bad
};
__device__ SlotState slot_state(const PagedArgs& a, int n) {
  SlotState s{a.len[n], a.fl[n], 0};
  if (s.L == -1) {
    s.status = 1;
    return s;
  }
  const int64_t cap = int64_t(a.max_pages) * a.page;
  bool bad = s.L < 0 || int64_t(s.L) + 1 > cap || s.m > s.L || s.m < 0;
  if (a.path) bad = bad || s.L - s.m > a.S;
  else bad = bad || s.m != s.L;
  int bad_page = 0;
  if (!bad) {
    const int pages = s.L / a.page + 1;
    for (int i = threadIdx.x; i < pages; i += blockDim.x) {
      const int pg = a.bt[n * a.bt_s + i];
      if (pg < 0 || pg >= a.num_pages) bad_page = 1;
    }
  }
  bad = __syncthreads_or(bad_page) || bad;
  if (bad) s.status = 2;
  return s;
}

__device__ __forceinline__ int64_t page_row(const PagedArgs& a, int n, int64_t j) {
  return int64_t(a.bt[n * a.bt_s + j / a.page]) * a.page + j % a.page;  // the pool row: page * page_size + offset
}

template <typename KT>
__device__ __forceinline__ KT* key_row(const PagedArgs& a, int n, int h, int64_t j) {
  const int64_t r = page_row(a, n, j);
  return static_cast<KT*>(a.kp) + (r / a.page) * a.kp_s[0] + (r % a.page) * a.kp_s[1] + h * a.kp_s[2];
}
template <typename VT>
__device__ __forceinline__ VT* value_row(const PagedArgs& a, int n, int h, int64_t j) {
  const int64_t r = page_row(a, n, j);
  return static_cast<VT*>(a.vp) + (r / a.page) * a.vp_s[0] + (r % a.page) * a.vp_s[1] + h * a.vp_s[2];
}
__device__ __forceinline__ double* gate_cell(const PagedArgs& a, int n, int hq, int64_t j) {
  const int64_t r = page_row(a, n, j);
  return a.gp + (r / a.page) * a.gp_s[0] + (r % a.page) * a.gp_s[1] + hq;
}

// E consecutive elements of a row as fp32, loaded 16 bytes at a time (E * sizeof(T) a multiple of 16).
template <typename T, int E>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[E]) {
  constexpr int per = 16 / sizeof(T);
#pragma unroll
  for (int c = 0; c < E / per; ++c) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + c * per);
    const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < per; ++i) out[c * per + i] = to_f(x[i]);
  }
}

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
template <typename KT, typename VT, int K, int V>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(PagedArgs a) {
  const int n = blockIdx.x / a.H, h = blockIdx.x % a.H, sp = blockIdx.y;
  const SlotState st = slot_state(a, n);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int L = st.L;
  const int m = (st.status == 0 && a.path && L - st.m == a.S) ? L : st.m;  // the flush kernel just ran
  if (h == 0 && sp == 0 && tid == 0) a.info[n] = make_int4(L, m, st.status, 0);
  if (st.status != 0) return;
  const int pc = L - m;  // pending tokens before the new one
  const int G = a.G;

  __shared__ float uq[kHeadsPerPass][K];         // the queries carried back to the flush point
  __shared__ float sw[kHeadsPerPass][kMaxSweep];  // the sweep's raw scores, row j - m
  __shared__ float sc[kHeadsPerPass][kTileRows];  // a tile's logits, then its probabilities
  __shared__ float alpha_s[kHeadsPerPass], mrun[kHeadsPerPass], lrun[kHeadsPerPass];
  __shared__ double gi_s[kHeadsPerPass];
  constexpr int CG = V / 8, RG = kThreads / CG, RPG = kTileRows / RG;
  __shared__ float red[RG][V];

  const VT* vin = static_cast<const VT*>(a.v) + n * a.v_s[0] + int64_t(a.t) * a.v_s[1] + h * a.v_s[2];
  const int64_t r0 = int64_t(m) * sp / a.nsplit, r1 = int64_t(m) * (sp + 1) / a.nsplit;

  for (int g0 = 0; g0 < G; g0 += kHeadsPerPass) {
    const int gn = min(kHeadsPerPass, G - g0);
    // The sweep, one warp a query head: u = q; for j = L down to m: s_j = u . k_j, u <- u - beta_j (w_j . u) w_j.
    if (warp < gn) {
      const int hq = h * G + g0 + warp;
      const auto* q = static_cast<const VT*>(a.q) + n * a.q_s[0] + int64_t(a.t) * a.q_s[1] + hq * a.q_s[2];
      constexpr int KP = K / 32;
      float u[KP];
#pragma unroll
      for (int i = 0; i < KP; ++i) u[i] = to_f(q[lane + 32 * i]);
      for (int j = L; j >= m; --j) {
        const int r = j - m;
        float kv[KP], wv[KP], b = 0.f;
        if (r == pc) {
          const auto* kr = static_cast<const VT*>(a.k) + n * a.k_s[0] + int64_t(a.t) * a.k_s[1] + h * a.k_s[2];
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
        if (lane == 0) sw[warp][r] = dk;
        if (a.path) {
          const float c = b * dw;
#pragma unroll
          for (int i = 0; i < KP; ++i) u[i] -= c * wv[i];
        }
      }
#pragma unroll
      for (int i = 0; i < KP; ++i) uq[warp][lane + 32 * i] = u[i];
      if (lane == 0) {
        double gsum = 0.0;
        if (a.gate) {
          gsum = L > 0 ? *gate_cell(a, n, hq, L - 1) : 0.0;
          gsum += double(load_param(a.g, a.g_dt, n * a.g_s[0] + int64_t(a.t) * a.g_s[1] + hq * a.g_s[2]));
        }
        gi_s[warp] = gsum;
        mrun[warp] = -INFINITY;
        lrun[warp] = 0.f;
      }
    }
    __syncthreads();

    float acc[kHeadsPerPass][8] = {};
    const int cg = tid % CG, rg = tid / CG;
    // Online softmax over one tile of `rows` logits in sc (phase B), then acc += p v (phase C); value_of(r)
    // gives the value row of tile row r.
    auto fold_tile = [&](int rows, auto value_of) {
      __syncthreads();  // sc is complete
      if (warp < gn) {
        const float z0 = lane < rows ? sc[warp][lane] : -INFINITY;
        const float z1 = lane + 32 < rows ? sc[warp][lane + 32] : -INFINITY;
        float mx = fmaxf(z0, z1);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float mold = mrun[warp], mnew = fmaxf(mold, mx);
        const float shift = mnew == -INFINITY ? 0.f : mnew;
        const float p0 = expf(z0 - shift), p1 = expf(z1 - shift);
        if (lane < rows) sc[warp][lane] = p0;
        if (lane + 32 < rows) sc[warp][lane + 32] = p1;
        const float ps = warp_sum(p0 + p1);
        if (lane == 0) {
          const float al = expf(mold - shift);
          alpha_s[warp] = al;
          lrun[warp] = lrun[warp] * al + ps;
          mrun[warp] = mnew;
        }
      }
      __syncthreads();
#pragma unroll
      for (int g = 0; g < kHeadsPerPass; ++g) {
        if (g < gn) {
          const float al = alpha_s[g];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] *= al;
        }
      }
#pragma unroll
      for (int rr = 0; rr < RPG; ++rr) {
        const int r = rg * RPG + rr;
        if (r < rows) {
          float vv[8];
          load_vec<VT, 8>(value_of(r) + 8 * cg, vv);
#pragma unroll
          for (int g = 0; g < kHeadsPerPass; ++g) {
            if (g < gn) {
              const float p = sc[g][r];
#pragma unroll
              for (int e = 0; e < 8; ++e) acc[g][e] += p * vv[e];
            }
          }
        }
      }
      __syncthreads();  // sc may be overwritten
    };

    if (sp == 0) {  // the pending tokens and the new one: logits from the sweep
      const int rows = pc + 1;
      for (int i = tid; i < kHeadsPerPass * rows; i += kThreads) {
        const int g = i / rows, r = i % rows;
        if (g < gn) {
          float z = a.scale * sw[g][r];
          if (a.gate && r < pc) z += float(a.gate_scale * (gi_s[g] - *gate_cell(a, n, h * G + g0 + g, m + r)));
          sc[g][r] = z;
        }
      }
      fold_tile(rows, [&](int r) -> const VT* { return r == pc ? vin : value_row<VT>(a, n, h, m + r); });
    }
    for (int64_t base = r0; base < r1; base += kTileRows) {
      const int rows = int(r1 - base < kTileRows ? r1 - base : kTileRows);
      // Phase A: kSegThreads threads a row, KE elements each.
      constexpr int KE = K / kSegThreads, RPP = kThreads / kSegThreads;
      const int seg = tid % kSegThreads;
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
              for (int e = 0; e < KE; ++e) d += uq[g][seg * KE + e] * kv[e];
            }
            d += __shfl_xor_sync(0xffffffffu, d, 1);
            d += __shfl_xor_sync(0xffffffffu, d, 2);
            d += __shfl_xor_sync(0xffffffffu, d, 4);
            if (ok && seg == 0) {
              float z = a.scale * d;
              if (a.gate) z += float(a.gate_scale * (gi_s[g] - *gate_cell(a, n, h * G + g0 + g, base + r)));
              sc[g][r] = z;
            }
          }
        }
      }
      fold_tile(rows, [&](int r) -> const VT* { return value_row<VT>(a, n, h, base + r); });
    }

    // Merge the row groups' accumulators in a fixed order and leave this split's partial state.
    for (int g = 0; g < gn; ++g) {
#pragma unroll
      for (int e = 0; e < 8; ++e) red[rg][8 * cg + e] = acc[g][e];
      __syncthreads();
      if (tid < V) {
        float s = 0.f;
        for (int r = 0; r < RG; ++r) s += red[r][tid];
        const int hq = h * G + g0 + g;
        float* part = a.part + ((int64_t(n) * a.HQ + hq) * a.nsplit + sp) * (V + 2);
        part[2 + tid] = s;
        if (tid == 0) {
          part[0] = mrun[g];
          part[1] = lrun[g];
        }
      }
      __syncthreads();
    }
  }

  if (sp == 0) {  // append the new token
    if (a.path) {
      const int64_t po = n * a.pk_s[0] + int64_t(pc) * a.pk_s[1] + h * a.pk_s[2];
      const auto* kr = static_cast<const VT*>(a.k) + n * a.k_s[0] + int64_t(a.t) * a.k_s[1] + h * a.k_s[2];
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
      const auto* kr = static_cast<const VT*>(a.k) + n * a.k_s[0] + int64_t(a.t) * a.k_s[1] + h * a.k_s[2];
      KT* dst = key_row<KT>(a, n, h, L);
      for (int e = tid; e < K; e += kThreads) dst[e] = from_f<KT>(to_f(kr[e]));
    }
    VT* vdst = value_row<VT>(a, n, h, L);
    for (int e = tid; e < V; e += kThreads) vdst[e] = vin[e];
    if (a.gate) {
      for (int g = tid; g < G; g += kThreads) {
        const int hq = h * G + g;
        double gsum = L > 0 ? *gate_cell(a, n, hq, L - 1) : 0.0;
        gsum += double(load_param(a.g, a.g_dt, n * a.g_s[0] + int64_t(a.t) * a.g_s[1] + hq * a.g_s[2]));
        *gate_cell(a, n, hq, L) = gsum;
      }
    }
  }
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

// ------------------------------------------------------------------------------------------------------
// Prefill's scatter: grid (num_seqs * H), the dense fp32 prefill's rows of sequence i into slot slots[i]'s pages.
struct ScatterArgs {
  const float *kc, *vc;
  const double* gc;
  int64_t kc_s[3], vc_s[3], gc_s[3];
  const int2* seqs;  // (slot, length)
};

template <typename KT, typename VT>
__global__ void paged_scatter_kernel(PagedArgs a, ScatterArgs s) {
  const int i = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int n = s.seqs[i].x, len = s.seqs[i].y;
  for (int64_t x = threadIdx.x; x < int64_t(len) * a.K; x += blockDim.x) {
    const int64_t j = x / a.K, e = x % a.K;
    key_row<KT>(a, n, h, j)[e] = from_f<KT>(s.kc[i * s.kc_s[0] + h * s.kc_s[1] + j * s.kc_s[2] + e]);
  }
  for (int64_t x = threadIdx.x; x < int64_t(len) * a.V; x += blockDim.x) {
    const int64_t j = x / a.V, e = x % a.V;
    value_row<VT>(a, n, h, j)[e] = from_f<VT>(s.vc[i * s.vc_s[0] + h * s.vc_s[1] + j * s.vc_s[2] + e]);
  }
  if (a.gate) {
    for (int64_t x = threadIdx.x; x < int64_t(len) * a.G; x += blockDim.x) {
      const int64_t j = x / a.G;
      const int hq = h * a.G + int(x % a.G);
      *gate_cell(a, n, hq, j) = s.gc[i * s.gc_s[0] + hq * s.gc_s[1] + j * s.gc_s[2]];
    }
  }
  if (h == 0 && threadIdx.x == 0) {
    a.len[n] = len;
    a.fl[n] = len;
  }
}

// The cache's views into the kernels' arguments.
void fill_cache_args(const PagedCache& c, const core::Problem& pr, PagedArgs* a) {
  a->kp = c.k_pages.data;
  a->vp = c.v_pages.data;
  strides3(c.k_pages, a->kp_s);
  strides3(c.v_pages, a->vp_s);
  if (pr.gate) {
    a->gp = static_cast<double*>(c.g_pages.data);
    a->gp_s[0] = c.g_pages.stride[0];
    a->gp_s[1] = c.g_pages.stride[1];
  }
  a->bt = static_cast<const int32_t*>(c.block_table.data);
  a->bt_s = c.block_table.stride[0];
  a->max_pages = int(c.block_table.shape[1]);
  a->num_pages = int(c.k_pages.shape[0]);
  a->page = int(c.k_pages.shape[1]);
  a->len = static_cast<int32_t*>(c.lengths.data);
  a->fl = static_cast<int32_t*>(c.flushed.data);
  a->pk = static_cast<float*>(c.pend_k.data);
  strides3(c.pend_k, a->pk_s);
  a->S = int(c.pend_k.shape[1]);
  if (pr.path) {
    a->pw = static_cast<float*>(c.pend_w.data);
    strides3(c.pend_w, a->pw_s);
    a->pb = static_cast<float*>(c.pend_beta.data);
    a->pb_s[0] = c.pend_beta.stride[0];
    a->pb_s[1] = c.pend_beta.stride[1];
  }
  a->H = int(pr.H);
  a->HQ = int(pr.HQ);
  a->G = int(pr.group);
  a->K = int(pr.K);
  a->V = int(pr.V);
  a->path = pr.path;
  a->gate = pr.gate;
  a->scale = float(pr.scale);
  a->gate_scale = pr.gate_scale;
}

size_t flush_smem(int K) {
  return (size_t(K) * K + size_t(kPagedMaxPending) * K + kPagedMaxPending + K + size_t(kTileRows) * K) * sizeof(float);
}

template <typename KT, typename VT, int K, int V>
Status launch_step(const PagedArgs& a, cudaStream_t s) {
  if (a.path) {
    const size_t smem = flush_smem(K);
    PA_CU(cudaFuncSetAttribute(paged_flush_kernel<KT, K>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    paged_flush_kernel<KT, K><<<dim3(unsigned(a.N * a.H), unsigned(a.flush_ctas)), kThreads, smem, s>>>(a);
    PA_CU(cudaGetLastError());
  }
  paged_decode_kernel<KT, VT, K, V><<<dim3(unsigned(a.N * a.H), unsigned(a.nsplit)), kThreads, 0, s>>>(a);
  PA_CU(cudaGetLastError());
  paged_combine_kernel<VT><<<unsigned(a.N * a.HQ), unsigned(std::max(V, 32)), 0, s>>>(a);
  PA_CU(cudaGetLastError());
  return Status::Ok();
}

template <typename KT, typename VT>
Status launch_step_dims(const PagedArgs& a, cudaStream_t s) {
  if (a.K == 128 && a.V == 128) return launch_step<KT, VT, 128, 128>(a, s);
  if (a.K == 64 && a.V == 64) return launch_step<KT, VT, 64, 64>(a, s);
  if (a.K == 128 && a.V == 64) return launch_step<KT, VT, 128, 64>(a, s);
  return launch_step<KT, VT, 64, 128>(a, s);
}

Status check_paged_support(const core::Problem& pr, const TensorView& q, const PagedCache& c) {
  PA_TRY(check_support(pr, q.dtype));
  if (c.k_pages.dtype != DType::f16 && c.k_pages.dtype != DType::f32) {
    return unsupported(std::string("cache.k_pages: dtype ") + dtype_name(c.k_pages.dtype) +
                       " is not supported by the cuda backend: expected float16 or float32");
  }
  if (c.pend_k.shape[1] > kPagedMaxPending) return unsupported("cache.pend_k: more pending rows than kPagedMaxPending");
  const int64_t heads = std::max(pr.H, pr.HQ);
  if (c.block_table.shape[0] * heads > (int64_t(1) << 30) || c.k_pages.shape[0] * c.k_pages.shape[1] > (int64_t(1) << 31) - 1) {
    return unsupported("cache.k_pages: more slots x heads or pool rows than the cuda paged kernels index");
  }
  for (const TensorView* t : {&c.k_pages, &c.v_pages}) {
    if (reinterpret_cast<uintptr_t>(t->data) % 16 != 0 || (t->stride[0] * dtype_size(t->dtype)) % 16 != 0 ||
        (t->stride[1] * dtype_size(t->dtype)) % 16 != 0 || (t->stride[2] * dtype_size(t->dtype)) % 16 != 0) {
      return unsupported(std::string(t == &c.k_pages ? "cache.k_pages" : "cache.v_pages") +
                         ": the cuda paged kernels read rows 16 bytes at a time: the pointer and strides must be "
                         "multiples of 16 bytes");
    }
  }
  return Status::Ok();
}

}  // namespace

Status copy_to_host(void* dst, const void* src, size_t bytes, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  PA_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  PA_CU(cudaStreamSynchronize(s));
  return Status::Ok();
}

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
  for (int t = 0; t < int(pr.T); ++t) {
    a.t = t;
    Status st;
    if (f16) st = vh ? launch_step_dims<__half, __half>(a, s) : launch_step_dims<__half, __nv_bfloat16>(a, s);
    else st = vh ? launch_step_dims<float, __half>(a, s) : launch_step_dims<float, __nv_bfloat16>(a, s);
    PA_TRY(st);
  }
  return Status::Ok();
}

Status paged_prefill(const PathPagedPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& seqs,
                     const std::vector<int32_t>& slots) {
  PA_TRY(check_paged_support(pr, p.fwd.q, p.cache));
  cudaStream_t s = static_cast<cudaStream_t>(p.fwd.stream);
  const int64_t ns = int64_t(seqs.size());
  int64_t longest = 1;
  for (const core::Seq& q : seqs) longest = std::max(longest, q.len);
  // The dense fp32 prefill (kernels/decode.cu) into temporaries, then a scatter into the pages.
  Workspace ws(s);
  float *kc = nullptr, *vc = nullptr;
  double* gc = nullptr;
  PA_CU(ws.alloc(&kc, size_t(std::max<int64_t>(ns, 1)) * pr.H * longest * pr.K));
  PA_CU(ws.alloc(&vc, size_t(std::max<int64_t>(ns, 1)) * pr.H * longest * pr.V));
  if (pr.gate) PA_CU(ws.alloc(&gc, size_t(std::max<int64_t>(ns, 1)) * pr.HQ * longest));
  std::vector<int64_t> host_len(size_t(std::max<int64_t>(ns, 1)), 0);
  PathPrefillParams d;
  d.fwd = p.fwd;
  d.cache.kc = make_view(kc, DType::f32, {ns, pr.H, longest, pr.K}, Device::cuda);
  d.cache.vc = make_view(vc, DType::f32, {ns, pr.H, longest, pr.V}, Device::cuda);
  if (pr.gate) d.cache.gc = make_view(gc, DType::f64, {ns, pr.HQ, longest}, Device::cuda);
  d.cache.lengths = make_view(host_len.data(), DType::i64, {ns});
  PA_TRY(prefill(d, pr, seqs));
  if (ns == 0) return Status::Ok();
  PagedArgs a{};
  fill_cache_args(p.cache, pr, &a);
  ScatterArgs sa{};
  sa.kc = kc;
  sa.vc = vc;
  sa.gc = gc;
  strides3(d.cache.kc, sa.kc_s);
  strides3(d.cache.vc, sa.vc_s);
  if (pr.gate) strides3(d.cache.gc, sa.gc_s);
  std::vector<int2> table(static_cast<size_t>(ns));
  for (int64_t i = 0; i < ns; ++i) table[size_t(i)] = make_int2(slots[size_t(i)], int(seqs[size_t(i)].len));
  int2* dseqs = nullptr;
  PA_CU(ws.alloc(&dseqs, table.size()));
  PA_CU(ws.upload(dseqs, table.data(), table.size() * sizeof(int2)));
  sa.seqs = dseqs;
  const unsigned grid = unsigned(ns * pr.H);
  const bool f16 = p.cache.k_pages.dtype == DType::f16, vh = p.fwd.v.dtype == DType::f16;
  if (f16 && vh) paged_scatter_kernel<__half, __half><<<grid, 256, 0, s>>>(a, sa);
  else if (f16) paged_scatter_kernel<__half, __nv_bfloat16><<<grid, 256, 0, s>>>(a, sa);
  else if (vh) paged_scatter_kernel<float, __half><<<grid, 256, 0, s>>>(a, sa);
  else paged_scatter_kernel<float, __nv_bfloat16><<<grid, 256, 0, s>>>(a, sa);
  PA_CU(cudaGetLastError());
  // The host copy of the (slot, length) table must outlive the upload: wait for it.
  PA_CU(cudaStreamSynchronize(s));
  return Status::Ok();
}

}  // namespace pathattn::cuda
