// cuda/kernels/paged_common.cuh: what the paged cache's kernels share (include/pathattn/paged.h): the arguments,
// the per-slot metadata check every CTA makes the same way, the page addressing, and the host side's filling of
// the arguments from the cache's views. The algorithm and its rounding points: docs/design.md, "The paged decode
// cache" (the same as cpu/paged.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/adapter.h"
#include "cuda/cuda_backend.h"
#include "cuda/device/common.cuh"
#include "cuda/host_util.h"

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
}  // namespace pathattn::cuda
