// cuda/bwd_chunk.cu: the chunk-local backward, per (chunk, kv head), fp32 on CUDA cores. It recomputes the
// UT transform of the chunk and pulls the scan gradients (dP = gradient of the chunk product, dk~, and per
// query head dq~ and dA_loc) back through
//   A = strict_lower(diag(b) W W^T), E = (I + A)^-1, W2 = E diag(b) W, Z = strict_lower(W K^T),
//   U = E diag(b) Z, k~ = K - U^T W, P = I - W^T W2, X = tril_incl(Q W^T), q~ = Q - X W2,
//   A_loc = tril_incl(Q K^T - X U)
// to dq, dk, dw, dbeta (dE -> dA = -E^T dE E^T on the strict lower triangle), and sums dv.
// Group sums run in a fixed order inside the CTA: deterministic.
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

constexpr int kThreads = 256;  // 64 x K outputs: K / 4 owned accumulators per thread

// acc[i] += f(r, d) for the outputs this thread owns: idx = tid + i * kThreads, (r, d) = (idx / K, idx % K).
template <int K, int R, class F>
__device__ __forceinline__ void owned_acc(float (&acc)[R], F f) {
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    acc[i] += f(idx / K, idx % K);
  }
}

template <typename T, int K>
__global__ void __launch_bounds__(kThreads) bwd_chunk_kernel(KernelParams p) {
  constexpr int LK = K + 1, LC = kChunk + 1, R = kChunk * K / kThreads;
  extern __shared__ float sm[];
  float* Wf = sm;
  float* Kf = Wf + kChunk * LK;
  float* W2f = Kf + kChunk * LK;
  float* Zs = W2f + kChunk * LK;
  float* Es = Zs + kChunk * LC;
  float* Us = Es + kChunk * LC;
  float* dUs = Us + kChunk * LC;
  float* Xs = dUs + kChunk * LC;
  float* dXs = Xs + kChunk * LC;  // Xs and dXs are adjacent: later reused as dW2 [64][K]
  float* bs = dXs + kChunk * LC;
  float* dbs = bs + kChunk;

  const int ci = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const ChunkDesc ch = p.chunks[ci];
  const int nq = min(kChunk, ch.len - ch.c * kChunk);
  const int64_t pos0 = ch.t0 + int64_t(ch.c) * kChunk, tok0 = ch.b * p.T + pos0;
  const T* kp = static_cast<const T*>(p.k);
  const T* qp = static_cast<const T*>(p.q);

  float dWa[R], dKa[R], dW2a[R];
#pragma unroll
  for (int i = 0; i < R; ++i) dWa[i] = dKa[i] = dW2a[i] = 0.f;

  // ---- recompute the UT transform.
  for (int idx = tid; idx < kChunk * K; idx += kThreads) {
    const int r = idx / K, d = idx % K;
    const bool ok = r < nq;
    Kf[r * LK + d] = ok ? to_f(kp[ch.b * p.k_s[0] + (pos0 + r) * p.k_s[1] + h * p.k_s[2] + d]) : 0.f;
    Wf[r * LK + d] = ok && p.path ? p.w[ch.b * p.w_s[0] + (pos0 + r) * p.w_s[1] + h * p.w_s[2] + d] : 0.f;
  }
  if (tid < kChunk) {
    bs[tid] = tid < nq && p.path ? p.beta[ch.b * p.beta_s[0] + (pos0 + tid) * p.beta_s[1] + h * p.beta_s[2]] : 0.f;
    dbs[tid] = 0.f;
  }
  __syncthreads();
  block_mm(kChunk, kChunk, [&](int r, int k) { return Wf[r * LK + k]; }, [&](int k, int c) { return Wf[c * LK + k]; },
           [&](int r, int c, int& lo, int& hi) { lo = 0; hi = c < r ? K : 0; },
           [&](int r, int c, float s) { Xs[r * LC + c] = bs[r] * s; });
  __syncthreads();
  unit_lower_inverse(Xs, LC, Es, LC);
  __syncthreads();
  block_mm(kChunk, K, [&](int r, int s) { return Es[r * LC + s] * bs[s]; }, [&](int s, int d) { return Wf[s * LK + d]; },
           [&](int r, int c, int& lo, int& hi) { lo = 0; hi = r + 1; },
           [&](int r, int d, float s) { W2f[r * LK + d] = s; });
  block_mm(kChunk, kChunk, [&](int r, int k) { return Wf[r * LK + k]; }, [&](int k, int c) { return Kf[c * LK + k]; },
           [&](int r, int c, int& lo, int& hi) { lo = 0; hi = c < r ? K : 0; },
           [&](int r, int c, float s) { Zs[r * LC + c] = s; });
  __syncthreads();
  block_mm(kChunk, kChunk, [&](int r, int t) { return Es[r * LC + t] * bs[t]; }, [&](int t, int c) { return Zs[t * LC + c]; },
           [&](int r, int c, int& lo, int& hi) { lo = c + 1; hi = r + 1; },
           [&](int r, int c, float s) {
             Us[r * LC + c] = s;
             dUs[r * LC + c] = 0.f;
           });
  __syncthreads();

  // ---- gradients of the chunk product (dP) and of the chunk-end keys (dk~).
  const float* Dm = p.dP + (int64_t(ci) * p.H + h) * K * K;
  const float* dkt = p.dkt + (tok0 * p.H + h) * K;
  const int64_t dkt_ld = int64_t(p.H) * K;
  auto dKt = [&](int j, int a) { return j < nq ? dkt[j * dkt_ld + a] : 0.f; };  // rows past the end: unwritten
  owned_acc<K>(dW2a, [&](int r, int d) {
    float s = 0.f;
    for (int a = 0; a < K; ++a) s = fmaf(Wf[r * LK + a], Dm[a * K + d], s);
    return -s;
  });
  {
    // dW += -W2 D^T: lanes run over rows r so that D[a][.] is a broadcast; staged in Xs/dXs as [a][65].
    float* T1 = Xs;
    for (int idx = tid; idx < kChunk * K; idx += kThreads) {
      const int r = idx % kChunk, a = idx / kChunk;
      float s = 0.f;
      for (int b = 0; b < K; ++b) s = fmaf(W2f[r * LK + b], Dm[a * K + b], s);
      T1[a * LC + r] = s;
    }
    // dU += -W dk~^T (strict lower), lanes over rows r: dk~[j][.] is a broadcast.
    for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
      const int r = idx % kChunk, j = idx / kChunk;
      if (j >= r) continue;
      float s = 0.f;
      for (int a = 0; a < K; ++a) s = fmaf(Wf[r * LK + a], dKt(j, a), s);
      dUs[r * LC + j] -= s;
    }
    __syncthreads();
    owned_acc<K>(dWa, [&](int r, int a) {
      float u = 0.f;
      for (int j = 0; j < r; ++j) u = fmaf(Us[r * LC + j], dKt(j, a), u);
      return -T1[a * LC + r] - u;
    });
    owned_acc<K>(dKa, [&](int r, int d) { return dKt(r, d); });
  }

  // ---- per query head: dq, and the X / A_loc terms.
  T* dqp = static_cast<T*>(p.dq);
  for (int hq = h * p.group; hq < (h + 1) * p.group; ++hq) {
    const T* qrow = qp + ch.b * p.q_s[0] + pos0 * p.q_s[1] + hq * p.q_s[2];
    auto Q = [&](int r, int d) { return r < nq ? to_f(qrow[r * p.q_s[1] + d]) : 0.f; };
    const float* dq_t = p.dqt + (tok0 * p.HQ + hq) * K;
    const int64_t dq_ld = int64_t(p.HQ) * K;
    auto dQt = [&](int r, int d) { return r < nq ? dq_t[r * dq_ld + d] : 0.f; };
    const float* dal = p.aloc + (tok0 * p.HQ + hq) * kChunk;
    const int64_t dal_ld = int64_t(p.HQ) * kChunk;
    auto dAl = [&](int r, int c) { return r < nq ? dal[r * dal_ld + c] : 0.f; };
    __syncthreads();
    block_mm(kChunk, kChunk, Q, [&](int d, int s) { return Wf[s * LK + d]; },
             [&](int r, int s, int& lo, int& hi) { lo = 0; hi = s <= r ? K : 0; },
             [&](int r, int s, float v) { Xs[r * LC + s] = v; });
    for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
      const int r = idx / kChunk, s = idx % kChunk;
      float v = 0.f;
      if (s <= r && r < nq) {
        for (int d = 0; d < K; ++d) v = fmaf(dQt(r, d), W2f[s * LK + d], v);
        for (int t = 0; t < s; ++t) v = fmaf(dAl(r, t), Us[s * LC + t], v);
        v = -v;
      }
      dXs[r * LC + s] = v;
    }
    __syncthreads();
    for (int idx = tid; idx < nq * K; idx += kThreads) {
      const int r = idx / K, d = idx % K;
      float v = dQt(r, d);
      for (int c = 0; c <= r; ++c) v = fmaf(dAl(r, c), Kf[c * LK + d], v);
      for (int s = 0; s <= r; ++s) v = fmaf(dXs[r * LC + s], Wf[s * LK + d], v);
      dqp[ch.b * p.dq_s[0] + (pos0 + r) * p.dq_s[1] + hq * p.dq_s[2] + d] = from_f<T>(v);
    }
    owned_acc<K>(dKa, [&](int c, int d) {
      float v = 0.f;
      for (int r = c; r < nq; ++r) v = fmaf(dAl(r, c), Q(r, d), v);
      return v;
    });
    owned_acc<K>(dWa, [&](int s, int d) {
      float v = 0.f;
      for (int r = s; r < nq; ++r) v = fmaf(dXs[r * LC + s], Q(r, d), v);
      return v;
    });
    owned_acc<K>(dW2a, [&](int s, int d) {
      float v = 0.f;
      for (int r = s; r < nq; ++r) v = fmaf(Xs[r * LC + s], dQt(r, d), v);
      return -v;
    });
    block_mm(kChunk, kChunk, [&](int t, int r) { return Xs[r * LC + t]; }, dAl,
             [&](int t, int c, int& lo, int& hi) { lo = t; hi = c < t ? nq : 0; },
             [&](int t, int c, float v) { dUs[t * LC + c] -= v; });
  }
  __syncthreads();

  // ---- dv = off-diagonal part + diagonal parts of every query head of the group.
  T* dvp = static_cast<T*>(p.dv);
  for (int idx = tid; idx < nq * p.V; idx += kThreads) {
    const int j = idx / p.V, e = idx % p.V;
    float v = p.dvk[((tok0 + j) * p.H + h) * p.V + e];
    for (int hq = h * p.group; hq < (h + 1) * p.group; ++hq) v += p.dvdiag[((tok0 + j) * p.HQ + hq) * p.V + e];
    dvp[ch.b * p.dv_s[0] + (pos0 + j) * p.dv_s[1] + h * p.dv_s[2] + e] = from_f<T>(v);
  }

  // ---- through the UT transform.
  float* dW2s = Xs;  // [64][K], Xs and dXs are free now
#pragma unroll
  for (int i = 0; i < R; ++i) dW2s[tid + i * kThreads] = dW2a[i];
  __syncthreads();
  // dE (lower incl.) = dU Zb^T + dW2 Wb^T  -> Us
  for (int idx = tid; idx < kChunk * kChunk; idx += kThreads) {
    const int r = idx / kChunk, s = idx % kChunk;
    float v = 0.f;
    if (s <= r) {
      for (int c = 0; c < s; ++c) v = fmaf(dUs[r * LC + c], Zs[s * LC + c], v);
      for (int d = 0; d < K; ++d) v = fmaf(dW2s[r * K + d], Wf[s * LK + d], v);
      v *= bs[s];
    }
    Us[r * LC + s] = v;
  }
  __syncthreads();
  // dZb = E^T dU in place: column c by 4 lanes, rows top-down (row t reads rows >= t only).
  {
    const int c = tid >> 2, part = tid & 3;
    for (int t = 0; t < kChunk; ++t) {
      float v = 0.f;
      if (t > c)
        for (int r = t + part; r < kChunk; r += 4) v = fmaf(Es[r * LC + t], dUs[r * LC + c], v);
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      __syncwarp();  // every lane has read row t of column c before lane 0 overwrites it
      if (part == 0) dUs[t * LC + c] = t > c ? v : 0.f;
      __syncwarp();
    }
  }
  __syncthreads();
  if (tid < kChunk) {
    const int t = tid;
    float v = 0.f;
    for (int c = 0; c < t; ++c) v = fmaf(dUs[t * LC + c], Zs[t * LC + c], v);
    dbs[t] += v;
  }
  owned_acc<K>(dWa, [&](int r, int d) {
    float v = 0.f;
    for (int c = 0; c < r; ++c) v = fmaf(dUs[r * LC + c], Kf[c * LK + d], v);
    return bs[r] * v;
  });
  owned_acc<K>(dKa, [&](int c, int d) {
    float v = 0.f;
    for (int r = c + 1; r < kChunk; ++r) v = fmaf(bs[r] * dUs[r * LC + c], Wf[r * LK + d], v);
    return v;
  });
  __syncthreads();
  // dWb = E^T dW2 -> Kf; M1 = dE E^T -> Zs.
  float* dWb = Kf;
  block_mm(kChunk, K, [&](int s, int r) { return Es[r * LC + s]; }, [&](int r, int d) { return dW2s[r * K + d]; },
           [&](int s, int d, int& lo, int& hi) { lo = s; hi = kChunk; },
           [&](int s, int d, float v) { dWb[s * LK + d] = v; });
  block_mm(kChunk, kChunk, [&](int r, int s) { return Us[r * LC + s]; }, [&](int s, int c) { return Es[c * LC + s]; },
           [&](int r, int c, int& lo, int& hi) { lo = 0; hi = min(r, c) + 1; },
           [&](int r, int c, float v) { Zs[r * LC + c] = v; });
  __syncthreads();
  owned_acc<K>(dWa, [&](int s, int d) { return bs[s] * dWb[s * LK + d]; });
  if (tid < kChunk) {
    float v = 0.f;
    for (int d = 0; d < K; ++d) v = fmaf(dWb[tid * LK + d], Wf[tid * LK + d], v);
    dbs[tid] += v;
  }
  // dA = -E^T M1 (strict lower) -> dUs.
  block_mm(kChunk, kChunk, [&](int a, int r) { return Es[r * LC + a]; }, [&](int r, int c) { return Zs[r * LC + c]; },
           [&](int a, int c, int& lo, int& hi) { lo = a; hi = c < a ? kChunk : a; },
           [&](int a, int c, float v) { dUs[a * LC + c] = c < a ? -v : 0.f; });
  __syncthreads();
  if (tid < kChunk) {
    const int a = tid;
    float v = 0.f;
    for (int c = 0; c < a; ++c) {
      float gm = 0.f;
      for (int d = 0; d < K; ++d) gm = fmaf(Wf[a * LK + d], Wf[c * LK + d], gm);
      v = fmaf(dUs[a * LC + c], gm, v);
    }
    dbs[a] += v;
  }
  owned_acc<K>(dWa, [&](int r, int d) {
    float v = 0.f;
    for (int c = 0; c < kChunk; ++c) {
      const float dg = (c < r ? bs[r] * dUs[r * LC + c] : 0.f) + (r < c ? bs[c] * dUs[c * LC + r] : 0.f);
      v = fmaf(dg, Wf[c * LK + d], v);
    }
    return v;
  });
  __syncthreads();

  // ---- outputs.
  T* dkp = static_cast<T*>(p.dk);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int idx = tid + i * kThreads, r = idx / K, d = idx % K;
    if (r >= nq) continue;
    dkp[ch.b * p.dk_s[0] + (pos0 + r) * p.dk_s[1] + h * p.dk_s[2] + d] = from_f<T>(dKa[i]);
    if (p.path) p.dw[ch.b * p.dw_s[0] + (pos0 + r) * p.dw_s[1] + h * p.dw_s[2] + d] = dWa[i];
  }
  if (p.path && tid < nq) p.dbeta[ch.b * p.dbeta_s[0] + (pos0 + tid) * p.dbeta_s[1] + h * p.dbeta_s[2]] = dbs[tid];
}

template <typename T, int K>
cudaError_t run_t(const KernelParams& p, cudaStream_t s) {
  const size_t smem = smem_bwd_chunk(K);
  auto kern = bwd_chunk_kernel<T, K>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  kern<<<dim3(p.nchunks, p.H), kThreads, smem, s>>>(p);
  return cudaGetLastError();
}

}  // namespace

size_t smem_bwd_chunk(int K) {
  return sizeof(float) * (3 * size_t(kChunk) * (K + 1) + 6 * size_t(kChunk) * (kChunk + 1) + 2 * kChunk);
}

cudaError_t launch_bwd_chunk(const KernelParams& p, int dtype, cudaStream_t s) {
  if (dtype == 0) return p.K == 64 ? run_t<__half, 64>(p, s) : run_t<__half, 128>(p, s);
  return p.K == 64 ? run_t<__nv_bfloat16, 64>(p, s) : run_t<__nv_bfloat16, 128>(p, s);
}

}  // namespace pathattn::cuda
