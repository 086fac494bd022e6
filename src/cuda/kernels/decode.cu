// cuda/kernels/decode.cu: prefill and single-token decode on a device cache (docs/spec.md; the same math as
// cpu/decode.cpp). The cache lives on the device: kc, vc fp32 [N, H, C, K / V], gc fp64 [N, HQ, C]; lengths
// stay in host memory and are read and written by the caller (api/decode.cpp's entry points) around these
// launches. Everything runs on the caller's stream; the small workspaces are stream-ordered allocations.
// The kernels favour plain, obviously correct code over speed: one warp per row, fp32 (fp64 where the CPU
// path uses fp64) arithmetic, no tensor cores.
#include <algorithm>
#include <string>
#include <vector>

#include "cuda/device/common.cuh"
#include "cuda/cuda_backend.h"
#include "cuda/host_util.h"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

void strides3(const TensorView& v, int64_t (&s)[3]) {
  for (int i = 0; i < 3; ++i) s[i] = v.ndim > i ? v.stride[i] : 0;
}

// ------------------------------------------------------------------------------------------------------
// Device helpers.

// Sum over the 32 lanes; the xor butterfly leaves the same value in every lane (each level adds the same
// two operands in every lane of a pair, and addition is commutative).
template <typename F>
__device__ __forceinline__ F warp_sum(F x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

constexpr int kMaxPerLane = 4;  // head dims up to 128 = 4 elements per lane

// ------------------------------------------------------------------------------------------------------
// Prefill.

struct SlotDesc {
  int64_t b, t0, len;  // batch row, first position, length of the sequence of this cache slot
};

struct PrefillArgs {
  const void *k, *v;
  const float *w, *beta, *g;
  int64_t k_s[3], v_s[3], w_s[3], beta_s[3], g_s[3];
  float *kc, *vc;
  double* gc;
  int64_t kc_s[3], vc_s[3], gc_s[3];
  const SlotDesc* slots;
  int H, group, K, V;
  bool path, gate;
};

constexpr int kWalkThreads = 512;

// Dynamic shared memory of the walk: the K x K suffix product M and the step's k_j, w_j, all fp64.
size_t walk_smem(int K) { return (size_t(K) * K + 2 * size_t(K)) * sizeof(double); }

// One CTA per (cache slot n, kv head h): the suffix-product walk of cpu::prefill_unit. M = H_{L-1} ... H_{j+1}
// is kept in fp64 in shared memory (128 KB at K = 128, which the opt-in shared memory of sm_80 and sm_90
// holds), as on the CPU, whose comment in cpu/decode.cpp gives the measured fp32-versus-fp64 difference.
// For j = L-1 down to 0:  kc_j = M k_j;  M <- M - beta_j (M w_j) w_j^T  (j > 0).  One warp per row of M.
template <typename T>
__global__ void __launch_bounds__(kWalkThreads) prefill_walk_kernel(PrefillArgs a) {
  const int n = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const SlotDesc s = a.slots[n];
  const int K = a.K, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const T* kin = static_cast<const T*>(a.k) + s.b * a.k_s[0] + h * a.k_s[2];
  float* kc = a.kc + n * a.kc_s[0] + h * a.kc_s[1];
  if (!a.path) {  // plain attention: the keys as given
    for (int64_t i = tid; i < s.len * K; i += blockDim.x) {
      const int64_t j = i / K, e = i % K;
      kc[j * a.kc_s[2] + e] = to_f(kin[(s.t0 + j) * a.k_s[1] + e]);
    }
    return;
  }
  extern __shared__ double walk_sm[];
  double* M = walk_sm;      // [K, K] row-major
  double* kj = M + K * K;   // [K]
  double* wj = kj + K;      // [K]
  const float* win = a.w + s.b * a.w_s[0] + h * a.w_s[2];
  for (int i = tid; i < K * K; i += blockDim.x) M[i] = (i / K == i % K) ? 1.0 : 0.0;
  for (int64_t j = s.len - 1; j >= 0; --j) {
    __syncthreads();  // M's initialisation is visible; the previous step is done with kj, wj
    if (tid < K) {
      kj[tid] = double(to_f(kin[(s.t0 + j) * a.k_s[1] + tid]));
      wj[tid] = double(win[(s.t0 + j) * a.w_s[1] + tid]);
    }
    __syncthreads();
    const double bj = double(a.beta[s.b * a.beta_s[0] + (s.t0 + j) * a.beta_s[1] + h * a.beta_s[2]]);
    float* out = kc + j * a.kc_s[2];
    for (int r = warp; r < K; r += nw) {  // warp-uniform: every lane takes part in the reductions
      double* Mr = M + r * K;
      double dk = 0.0, dw = 0.0;
      for (int e = lane; e < K; e += 32) {
        dk += Mr[e] * kj[e];
        dw += Mr[e] * wj[e];
      }
      dk = warp_sum(dk);
      dw = warp_sum(dw);
      if (lane == 0) out[r] = float(dk);
      if (j > 0) {
        const double c = bj * dw;
        for (int e = lane; e < K; e += 32) Mr[e] -= c * wj[e];
      }
    }
  }
}

// One CTA per (cache slot n, kv head h): vc_j = v_j (as fp32) for j < L, and for each query head of the
// group the inclusive gate cumsum G_j in fp64 (one warp per query head, a warp scan over blocks of 32).
template <typename T>
__global__ void prefill_copy_kernel(PrefillArgs a) {
  const int n = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const SlotDesc s = a.slots[n];
  const int V = a.V, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const T* vin = static_cast<const T*>(a.v) + s.b * a.v_s[0] + h * a.v_s[2];
  float* vc = a.vc + n * a.vc_s[0] + h * a.vc_s[1];
  for (int64_t i = tid; i < s.len * V; i += blockDim.x) {
    const int64_t j = i / V, e = i % V;
    vc[j * a.vc_s[2] + e] = to_f(vin[(s.t0 + j) * a.v_s[1] + e]);
  }
  if (!a.gate) return;
  for (int gi = warp; gi < a.group; gi += nw) {
    const int hq = h * a.group + gi;
    const float* gin = a.g + s.b * a.g_s[0] + hq * a.g_s[2];
    double* gc = a.gc + n * a.gc_s[0] + hq * a.gc_s[1];
    double carry = 0.0;
    for (int64_t base = 0; base < s.len; base += 32) {
      const int64_t t = base + lane;
      double x = t < s.len ? double(gin[(s.t0 + t) * a.g_s[1]]) : 0.0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
      }
      x += carry;
      if (t < s.len) gc[t * a.gc_s[2]] = x;
      carry = __shfl_sync(0xffffffffu, x, 31);
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// Decode.

// Rows of the cache one CTA takes (the cache of a slot is split across CTAs in blocks of this many rows;
// a second kernel merges the partial softmax states).
constexpr int kSplitRows = 512;
constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / 32;
// Query heads of a GQA group handled per pass over the CTA's rows (their accumulators live in registers).
constexpr int kHeadsPerPass = 4;

struct DecodeArgs {
  const void *q, *k, *v;
  const float *w, *beta, *g;
  int64_t q_s[3], k_s[3], v_s[3], w_s[3], beta_s[3], g_s[3];
  void* o;
  float* lse;  // may be null
  int64_t o_s[3], lse_s[3];
  float *kc, *vc;
  double* gc;
  int64_t kc_s[3], vc_s[3], gc_s[3];
  const int64_t* len;  // [N] tokens cached per slot before this step (device copy)
  float* part;         // [N, HQ, nsplit, V + 2] partial states: max m, sum d, accumulator acc[V]
  int H, HQ, group, K, V, nsplit;
  bool path, gate;
  float scale;
  double gate_scale;
};

// Grid (N * H, nsplit). CTA (n, h, sp) owns rows [sp * kSplitRows, min(L + 1, (sp + 1) * kSplitRows)) of
// slot n, kv head h, where L = len[n] and row L is the new token:
//   1. the CTA owning row L appends k, v (fp32) and G_L = G_{L-1} + g (fp64) for the group's query heads;
//   2. one warp per row: kc_j <- kc_j - beta (w . kc_j) w in place (j < L; the first pass only), then for
//      each query head s_j = scale q . kc_j + float(gate_scale (G_L - G_j)) (difference in fp64), folded
//      into the warp's online-softmax state (max m, sum d, accumulator of the vc rows);
//   3. the warps' states are merged through shared memory into one partial state per query head.
// Query heads go kHeadsPerPass at a time; later passes read the rows this warp transported in pass 0.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads) decode_rows_kernel(DecodeArgs a) {
  const int n = blockIdx.x / a.H, h = blockIdx.x % a.H, sp = blockIdx.y;
  const int64_t L = a.len[n], S = L + 1;
  const int64_t r0 = int64_t(sp) * kSplitRows;
  if (r0 >= S) return;  // this slot's cache is shorter than the longest: nothing for this CTA
  const int64_t r1 = S < r0 + kSplitRows ? S : r0 + kSplitRows;
  const bool owns_new = r1 == S;
  const int K = a.K, V = a.V, G = a.group, kp = K / 32, vp = V / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  __shared__ float w_sm[128];
  __shared__ float q_sm[kHeadsPerPass][128];
  __shared__ double gnew_sm[kHeadsPerPass];
  __shared__ float m_sm[kDecodeWarps][kHeadsPerPass], d_sm[kDecodeWarps][kHeadsPerPass];
  __shared__ float acc_sm[kDecodeWarps][kHeadsPerPass][128];

  float* kc = a.kc + n * a.kc_s[0] + h * a.kc_s[1];
  float* vc = a.vc + n * a.vc_s[0] + h * a.vc_s[1];
  float beta = 0.f;
  if (a.path) {
    const float* wrow = a.w + n * a.w_s[0] + h * a.w_s[2];
    for (int e = tid; e < K; e += blockDim.x) w_sm[e] = wrow[e];
    beta = a.beta[n * a.beta_s[0] + h * a.beta_s[2]];
  }
  if (owns_new) {  // append the new token (its key needs no transport)
    const T* krow = static_cast<const T*>(a.k) + n * a.k_s[0] + h * a.k_s[2];
    const T* vrow = static_cast<const T*>(a.v) + n * a.v_s[0] + h * a.v_s[2];
    for (int e = tid; e < K; e += blockDim.x) kc[L * a.kc_s[2] + e] = to_f(krow[e]);
    for (int e = tid; e < V; e += blockDim.x) vc[L * a.vc_s[2] + e] = to_f(vrow[e]);
    if (a.gate) {
      for (int gi = tid; gi < G; gi += blockDim.x) {
        const int hq = h * G + gi;
        double* gc = a.gc + n * a.gc_s[0] + hq * a.gc_s[1];
        const double g = double(a.g[n * a.g_s[0] + hq * a.g_s[2]]);
        gc[L * a.gc_s[2]] = (L > 0 ? gc[(L - 1) * a.gc_s[2]] : 0.0) + g;
      }
    }
  }

  for (int g0 = 0; g0 < G; g0 += kHeadsPerPass) {
    const int gn = min(kHeadsPerPass, G - g0);
    __syncthreads();  // the append, w_sm, and the previous pass's use of the shared arrays are done
    for (int i = tid; i < kHeadsPerPass * K; i += blockDim.x) {
      const int gi = i / K, e = i % K;
      float x = 0.f;
      if (gi < gn) x = to_f(static_cast<const T*>(a.q)[n * a.q_s[0] + (h * G + g0 + gi) * a.q_s[2] + e]);
      q_sm[gi][e] = x;
    }
    if (a.gate && tid < gn) {
      const int hq = h * G + g0 + tid;
      const double* gc = a.gc + n * a.gc_s[0] + hq * a.gc_s[1];
      const double g = double(a.g[n * a.g_s[0] + hq * a.g_s[2]]);
      gnew_sm[tid] = (L > 0 ? gc[(L - 1) * a.gc_s[2]] : 0.0) + g;  // G_L, as appended above
    }
    __syncthreads();

    float m[kHeadsPerPass], d[kHeadsPerPass], acc[kHeadsPerPass][kMaxPerLane];
#pragma unroll
    for (int gi = 0; gi < kHeadsPerPass; ++gi) {
      m[gi] = -INFINITY;
      d[gi] = 0.f;
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) acc[gi][i] = 0.f;
    }

    for (int64_t j = r0 + warp; j < r1; j += kDecodeWarps) {  // warp-uniform
      float* krow = kc + j * a.kc_s[2];
      float kr[kMaxPerLane], vr[kMaxPerLane];
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) kr[i] = i < kp ? krow[lane + 32 * i] : 0.f;
      if (a.path && g0 == 0 && j < L) {
        float dw = 0.f;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i)
          if (i < kp) dw += w_sm[lane + 32 * i] * kr[i];
        const float c = -beta * warp_sum(dw);
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i)
          if (i < kp) {
            kr[i] += c * w_sm[lane + 32 * i];
            krow[lane + 32 * i] = kr[i];
          }
      }
      const float* vrow = vc + j * a.vc_s[2];
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) vr[i] = i < vp ? vrow[lane + 32 * i] : 0.f;
#pragma unroll
      for (int gi = 0; gi < kHeadsPerPass; ++gi) {
        if (gi >= gn) break;
        float qk = 0.f;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i)
          if (i < kp) qk += q_sm[gi][lane + 32 * i] * kr[i];
        float s = a.scale * warp_sum(qk);
        if (a.gate) {
          const int hq = h * G + g0 + gi;
          const double gj = a.gc[n * a.gc_s[0] + hq * a.gc_s[1] + j * a.gc_s[2]];
          s += float(a.gate_scale * (gnew_sm[gi] - gj));
        }
        const float mn = fmaxf(m[gi], s);
        const float shift = mn == -INFINITY ? 0.f : mn;  // all -inf so far: exp gives 0, not NaN
        const float alpha = expf(m[gi] - shift), p = expf(s - shift);
        d[gi] = d[gi] * alpha + p;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) acc[gi][i] = acc[gi][i] * alpha + p * vr[i];
        m[gi] = mn;
      }
    }

    // Merge the warps' states into one partial state per query head of the pass.
#pragma unroll
    for (int gi = 0; gi < kHeadsPerPass; ++gi) {
      if (lane == 0) {
        m_sm[warp][gi] = m[gi];
        d_sm[warp][gi] = d[gi];
      }
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i)
        if (i < vp) acc_sm[warp][gi][lane + 32 * i] = acc[gi][i];
    }
    __syncthreads();
    for (int i = tid; i < gn * V; i += blockDim.x) {
      const int gi = i / V, e = i % V;
      float mx = -INFINITY;
      for (int wi = 0; wi < kDecodeWarps; ++wi) mx = fmaxf(mx, m_sm[wi][gi]);
      const float shift = mx == -INFINITY ? 0.f : mx;
      float sum = 0.f, av = 0.f;
      for (int wi = 0; wi < kDecodeWarps; ++wi) {
        const float f = expf(m_sm[wi][gi] - shift);
        sum += d_sm[wi][gi] * f;
        av += acc_sm[wi][gi][e] * f;
      }
      const int hq = h * G + g0 + gi;
      float* part = a.part + ((int64_t(n) * a.HQ + hq) * a.nsplit + sp) * (V + 2);
      part[2 + e] = av;
      if (e == 0) {
        part[0] = mx;
        part[1] = sum;
      }
    }
  }
}

// Grid N * HQ, V threads: merges the partial states of a (slot, query head) over the CTAs that had rows,
// then o = acc / d (dtype of v) and lse = m + log d.
template <typename T>
__global__ void decode_merge_kernel(DecodeArgs a) {
  const int n = blockIdx.x / a.HQ, hq = blockIdx.x % a.HQ, e = threadIdx.x;
  if (e >= a.V) return;
  const int64_t S = a.len[n] + 1;
  const int ns = int((S + kSplitRows - 1) / kSplitRows);
  const float* part = a.part + (int64_t(n) * a.HQ + hq) * a.nsplit * (a.V + 2);
  float mx = -INFINITY;
  for (int sp = 0; sp < ns; ++sp) mx = fmaxf(mx, part[sp * (a.V + 2)]);
  const float shift = mx == -INFINITY ? 0.f : mx;
  float sum = 0.f, av = 0.f;
  for (int sp = 0; sp < ns; ++sp) {
    const float* ps = part + sp * (a.V + 2);
    const float f = expf(ps[0] - shift);
    sum += ps[1] * f;
    av += ps[2 + e] * f;
  }
  T* o = static_cast<T*>(a.o) + n * a.o_s[0] + hq * a.o_s[2];
  o[e] = from_f<T>(av * (1.f / sum));
  if (a.lse && e == 0) a.lse[n * a.lse_s[0] + hq * a.lse_s[2]] = mx + logf(sum);
}

}  // namespace

// ------------------------------------------------------------------------------------------------------
// Host entry points (after api/decode.cpp's validation; fp32 w, beta, g: param_dtypes.cu converts others).

Status prefill_f32(const PathPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& slots) {
  PA_TRY(check_support(pr, p.fwd.q.dtype));
  int optin = 0;
  PA_CU(device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &optin));
  const size_t smem = pr.path ? walk_smem(int(pr.K)) : 0;
  if (smem > size_t(optin)) {
    return unsupported("device: the cuda prefill kernel needs " + std::to_string(smem) +
                       " bytes of shared memory per block at this head dim; this device allows " + std::to_string(optin));
  }
  const int64_t N = int64_t(slots.size());
  if (N * pr.H > int64_t(1) << 30) return unsupported("cache.kc: too many (slot, kv head) pairs for the cuda prefill");
  if (!pr.seqs.empty()) PA_TRY(fwd(p.fwd, pr));  // o and lse
  if (N == 0) return Status::Ok();

  cudaStream_t s = static_cast<cudaStream_t>(p.fwd.stream);
  const PathFwdParams& f = p.fwd;
  const DecodeCache& c = p.cache;
  std::vector<SlotDesc> host(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) host[i] = {slots[i].b, slots[i].t0, slots[i].len};
  Workspace ws(s);
  SlotDesc* dslots = nullptr;
  PA_CU(ws.alloc(&dslots, host.size()));
  PA_CU(cudaMemcpyAsync(dslots, host.data(), host.size() * sizeof(SlotDesc), cudaMemcpyHostToDevice, s));

  PrefillArgs a{};
  a.k = f.k.data;
  a.v = f.v.data;
  strides3(f.k, a.k_s);
  strides3(f.v, a.v_s);
  if (pr.path) {
    a.w = static_cast<const float*>(f.w.data);
    a.beta = static_cast<const float*>(f.beta.data);
    strides3(f.w, a.w_s);
    strides3(f.beta, a.beta_s);
  }
  if (pr.gate) {
    a.g = static_cast<const float*>(f.g.data);
    strides3(f.g, a.g_s);
    a.gc = static_cast<double*>(c.gc.data);
    strides3(c.gc, a.gc_s);
  }
  a.kc = static_cast<float*>(c.kc.data);
  a.vc = static_cast<float*>(c.vc.data);
  strides3(c.kc, a.kc_s);
  strides3(c.vc, a.vc_s);
  a.slots = dslots;
  a.H = int(pr.H);
  a.group = int(pr.group);
  a.K = int(pr.K);
  a.V = int(pr.V);
  a.path = pr.path;
  a.gate = pr.gate;

  const unsigned grid = unsigned(N * pr.H);
  if (f.q.dtype == DType::f16) {
    PA_CU(cudaFuncSetAttribute(prefill_walk_kernel<__half>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    prefill_walk_kernel<__half><<<grid, kWalkThreads, smem, s>>>(a);
    PA_CU(cudaGetLastError());
    prefill_copy_kernel<__half><<<grid, 256, 0, s>>>(a);
  } else {
    PA_CU(cudaFuncSetAttribute(prefill_walk_kernel<__nv_bfloat16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(smem)));
    prefill_walk_kernel<__nv_bfloat16><<<grid, kWalkThreads, smem, s>>>(a);
    PA_CU(cudaGetLastError());
    prefill_copy_kernel<__nv_bfloat16><<<grid, 256, 0, s>>>(a);
  }
  PA_CU(cudaGetLastError());
  return Status::Ok();
}

Status decode_f32(const PathDecodeParams& p, const core::Problem& pr, const std::vector<int64_t>& lengths) {
  PA_TRY(check_support(pr, p.q.dtype));
  const int64_t N = pr.B;
  if (N == 0) return Status::Ok();
  int64_t longest = 0;
  for (int64_t l : lengths) longest = std::max(longest, l);
  const int64_t nsplit = (longest + 1 + kSplitRows - 1) / kSplitRows;
  if (nsplit > 65535) return unsupported("cache.kc: the cuda decode handles at most 65535 * 512 cached tokens per slot");
  if (N * pr.H > int64_t(1) << 30 || N * pr.HQ > int64_t(1) << 30) {
    return unsupported("q: too many sequences x heads for the cuda decode");
  }
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  const DecodeCache& c = p.cache;
  Workspace ws(s);
  int64_t* dlen = nullptr;
  float* part = nullptr;
  PA_CU(ws.alloc(&dlen, size_t(N)));
  PA_CU(ws.alloc(&part, size_t(N) * pr.HQ * nsplit * (pr.V + 2)));
  PA_CU(cudaMemcpyAsync(dlen, lengths.data(), size_t(N) * sizeof(int64_t), cudaMemcpyHostToDevice, s));

  DecodeArgs a{};
  a.q = p.q.data;
  a.k = p.k.data;
  a.v = p.v.data;
  strides3(p.q, a.q_s);
  strides3(p.k, a.k_s);
  strides3(p.v, a.v_s);
  if (pr.path) {
    a.w = static_cast<const float*>(p.w.data);
    a.beta = static_cast<const float*>(p.beta.data);
    strides3(p.w, a.w_s);
    strides3(p.beta, a.beta_s);
  }
  if (pr.gate) {
    a.g = static_cast<const float*>(p.g.data);
    strides3(p.g, a.g_s);
    a.gc = static_cast<double*>(c.gc.data);
    strides3(c.gc, a.gc_s);
  }
  a.o = p.o.data;
  strides3(p.o, a.o_s);
  a.lse = p.lse.present() ? static_cast<float*>(p.lse.data) : nullptr;
  if (a.lse) strides3(p.lse, a.lse_s);
  a.kc = static_cast<float*>(c.kc.data);
  a.vc = static_cast<float*>(c.vc.data);
  strides3(c.kc, a.kc_s);
  strides3(c.vc, a.vc_s);
  a.len = dlen;
  a.part = part;
  a.H = int(pr.H);
  a.HQ = int(pr.HQ);
  a.group = int(pr.group);
  a.K = int(pr.K);
  a.V = int(pr.V);
  a.nsplit = int(nsplit);
  a.path = pr.path;
  a.gate = pr.gate;
  a.scale = float(pr.scale);
  a.gate_scale = pr.gate_scale;

  const dim3 grid(unsigned(N * pr.H), unsigned(nsplit));
  const unsigned mgrid = unsigned(N * pr.HQ);
  if (p.q.dtype == DType::f16) {
    decode_rows_kernel<__half><<<grid, kDecodeThreads, 0, s>>>(a);
    PA_CU(cudaGetLastError());
    decode_merge_kernel<__half><<<mgrid, unsigned(pr.V), 0, s>>>(a);
  } else {
    decode_rows_kernel<__nv_bfloat16><<<grid, kDecodeThreads, 0, s>>>(a);
    PA_CU(cudaGetLastError());
    decode_merge_kernel<__nv_bfloat16><<<mgrid, unsigned(pr.V), 0, s>>>(a);
  }
  PA_CU(cudaGetLastError());
  return Status::Ok();
}

}  // namespace pathattn::cuda
