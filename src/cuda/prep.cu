// cuda/prep.cu: the O(T C K) kernels around the scans: the per-chunk UT transform (fp32 on CUDA cores,
// ALGORITHMS.md section 2), the gate cumsum, the backward's delta and the final dg reverse cumsum.
// Shapes follow kernel_params.h; C = kChunk = 64.
#include "cuda/common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

constexpr int kPrepThreads = 256;  // 64 x 64 products: 16 outputs per thread

__device__ __forceinline__ int chunk_rows(const ChunkDesc& ch) {
  return min(kChunk, ch.len - ch.c * kChunk);
}

// Per (chunk, kv head h), fp32 in shared memory:
//   A = strict_lower(diag(b) W W^T); E = (I + A)^-1; W2 = E diag(b) W; Z = strict_lower(W K^T);
//   U = E diag(b) Z; k~ = K - U^T W.  Per query head: X = tril_incl(Q W^T); q~ = Q - X W2;
//   A_loc = tril_incl(Q K^T - X U).
// Writes w16, w2h (fp16), kt (dtype T) rows of the chunk, and qtl (fp32), aloc (fp32) per query head.
// smem: Wf, Kf, W2f, Qf [64][K+1] and R1, R2 [64][65] fp32 (165 KB at K = 128, fits sm_80's 163 KiB).
template <typename T, int K>
__global__ void __launch_bounds__(kPrepThreads) chunk_prep_kernel(KernelParams p) {
  extern __shared__ float sm[];
  constexpr int LK = K + 1, LC = kChunk + 1;
  float* Wf = sm;
  float* Kf = Wf + kChunk * LK;
  float* W2f = Kf + kChunk * LK;
  float* Qf = W2f + kChunk * LK;
  float* R1 = Qf + kChunk * LK;
  float* R2 = R1 + kChunk * LC;
  float* bs = R2 + kChunk * LC;

  const ChunkDesc ch = p.chunks[blockIdx.x];
  const int h = blockIdx.y, nq = chunk_rows(ch), tid = threadIdx.x;
  const int64_t pos0 = ch.t0 + int64_t(ch.c) * kChunk, tok0 = ch.b * p.T + pos0;
  const T* kp = static_cast<const T*>(p.k);
  const T* qp = static_cast<const T*>(p.q);

  for (int idx = tid; idx < kChunk * K; idx += blockDim.x) {
    const int r = idx / K, d = idx % K;
    const bool ok = r < nq;
    Kf[r * LK + d] = ok ? to_f(kp[ch.b * p.k_s[0] + (pos0 + r) * p.k_s[1] + h * p.k_s[2] + d]) : 0.f;
    Wf[r * LK + d] = ok && p.path ? p.w[ch.b * p.w_s[0] + (pos0 + r) * p.w_s[1] + h * p.w_s[2] + d] : 0.f;
  }
  if (tid < kChunk) {
    const int r = tid;
    bs[r] = r < nq && p.path ? p.beta[ch.b * p.beta_s[0] + (pos0 + r) * p.beta_s[1] + h * p.beta_s[2]] : 0.f;
  }
  __syncthreads();
  // A -> R1 (strict lower).
  block_mm(kChunk, kChunk, [&](int r, int k) { return Wf[r * LK + k]; }, [&](int k, int c) { return Wf[c * LK + k]; },
           [&](int r, int c, int& lo, int& hi) { lo = 0; hi = c < r ? K : 0; },
           [&](int r, int c, float s) { R1[r * LC + c] = bs[r] * s; });
  __syncthreads();
  // E = (I + A)^-1 -> R2.
  unit_lower_inverse(R1, LC, R2, LC);
  __syncthreads();
  // W2 = E diag(b) W; Z = strict_lower(W K^T) -> R1.
  block_mm(kChunk, K, [&](int r, int s) { return R2[r * LC + s] * bs[s]; }, [&](int s, int d) { return Wf[s * LK + d]; },
           [&](int r, int c, int& lo, int& hi) { lo = 0; hi = r + 1; },
           [&](int r, int d, float s) { W2f[r * LK + d] = s; });
  block_mm(kChunk, kChunk, [&](int r, int k) { return Wf[r * LK + k]; }, [&](int k, int c) { return Kf[c * LK + k]; },
           [&](int r, int c, int& lo, int& hi) { lo = 0; hi = c < r ? K : 0; },
           [&](int r, int c, float s) { R1[r * LC + c] = s; });
  __syncthreads();
  // U = E diag(b) Z in place: column c by 4 lanes, rows bottom-up (row r reads Z rows <= r only).
  {
    const int c = tid >> 2, part = tid & 3;
    for (int r = kChunk - 1; r >= 1; --r) {
      float s = 0.f;
      if (r > c)
        for (int t = c + 1 + part; t <= r; t += 4) s = fmaf(R2[r * LC + t] * bs[t], R1[t * LC + c], s);
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      __syncwarp();  // every lane has read row r of column c before lane 0 overwrites it
      if (r > c && part == 0) R1[r * LC + c] = s;
      __syncwarp();
    }
  }
  __syncthreads();
  // k~ = K - U^T W, and the fp16 copies of W and W2.
  T* ktp = static_cast<T*>(p.kt);
  block_mm(kChunk, K, [&](int r, int s) { return R1[s * LC + r]; }, [&](int s, int d) { return Wf[s * LK + d]; },
           [&](int r, int c, int& lo, int& hi) { lo = r + 1; hi = kChunk; },
           [&](int r, int d, float s) {
             if (r < nq) ktp[((tok0 + r) * p.H + h) * K + d] = from_f<T>(Kf[r * LK + d] - s);
           });
  for (int idx = tid; idx < nq * K; idx += blockDim.x) {
    const int r = idx / K, d = idx % K;
    const int64_t o = ((tok0 + r) * p.H + h) * K + d;
    p.w16[o] = __float2half_rn(Wf[r * LK + d]);
    p.w2h[o] = __float2half_rn(W2f[r * LK + d]);
  }
  // Per query head of the group.
  for (int hq = h * p.group; hq < (h + 1) * p.group; ++hq) {
    __syncthreads();
    for (int idx = tid; idx < kChunk * K; idx += blockDim.x) {
      const int r = idx / K, d = idx % K;
      Qf[r * LK + d] = r < nq ? to_f(qp[ch.b * p.q_s[0] + (pos0 + r) * p.q_s[1] + hq * p.q_s[2] + d]) : 0.f;
    }
    __syncthreads();
    block_mm(kChunk, kChunk, [&](int r, int k) { return Qf[r * LK + k]; }, [&](int k, int c) { return Wf[c * LK + k]; },
             [&](int r, int c, int& lo, int& hi) { lo = 0; hi = c <= r ? K : 0; },
             [&](int r, int c, float s) { R2[r * LC + c] = s; });
    __syncthreads();
    block_mm(kChunk, K, [&](int r, int s) { return R2[r * LC + s]; }, [&](int s, int d) { return W2f[s * LK + d]; },
             [&](int r, int c, int& lo, int& hi) { lo = 0; hi = r + 1; },
             [&](int r, int d, float s) {
               if (r < nq) p.qtl[((tok0 + r) * p.HQ + hq) * K + d] = Qf[r * LK + d] - s;
             });
    for (int idx = tid; idx < nq * kChunk; idx += blockDim.x) {
      const int r = idx / kChunk, c = idx % kChunk;
      float s = 0.f;
      if (c <= r) {
        for (int d = 0; d < K; ++d) s = fmaf(Qf[r * LK + d], Kf[c * LK + d], s);
        float u = 0.f;
        for (int t = c + 1; t <= r; ++t) u = fmaf(R2[r * LC + t], R1[t * LC + c], u);
        s -= u;
      }
      p.aloc[((tok0 + r) * p.HQ + hq) * kChunk + c] = s;
    }
  }
}

// One warp per (sequence, query head): inclusive cumsum of g in fp32, 32 positions per step.
__global__ void gate_cumsum_kernel(KernelParams p, const int32_t* seq_first, int nseqs) {
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= nseqs * p.HQ) return;
  const ChunkDesc ch = p.chunks[seq_first[wid / p.HQ]];
  const int hq = wid % p.HQ;
  float carry = 0.f;
  for (int base = 0; base < ch.len; base += 32) {
    const int t = base + lane;
    float x = t < ch.len ? p.g[ch.b * p.g_s[0] + (ch.t0 + t) * p.g_s[1] + hq * p.g_s[2]] : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    x += carry;
    if (t < ch.len) p.G[(ch.b * p.T + ch.t0 + t) * p.HQ + hq] = x;
    carry = __shfl_sync(0xffffffffu, x, 31);
  }
}

// One warp per (sequence, query head): dg_u = sum_{t >= u} (dgrow_t + dgcol_t).
__global__ void bwd_dg_kernel(KernelParams p, const int32_t* seq_first, int nseqs) {
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= nseqs * p.HQ) return;
  const ChunkDesc ch = p.chunks[seq_first[wid / p.HQ]];
  const int hq = wid % p.HQ;
  float carry = 0.f;
  const int nblk = (ch.len + 31) / 32;
  for (int blk = nblk - 1; blk >= 0; --blk) {
    const int t = blk * 32 + (31 - lane);  // lane 0 takes the latest position of the block
    float x = 0.f;
    if (t < ch.len) {
      const int64_t i = (ch.b * p.T + ch.t0 + t) * p.HQ + hq;
      x = p.dgrow[i] + p.dgcol[i];
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    x += carry;
    if (t < ch.len) p.dg[ch.b * p.dg_s[0] + (ch.t0 + t) * p.dg_s[1] + hq * p.dg_s[2]] = x;
    carry = __shfl_sync(0xffffffffu, x, 31);
  }
}

// One warp per (token, query head): delta = sum_v dO * O (fp32).
template <typename T>
__global__ void bwd_delta_kernel(KernelParams p) {
  const int64_t wid = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t nrows = int64_t(p.B) * p.T * p.HQ;
  if (wid >= nrows) return;
  const int hq = int(wid % p.HQ);
  const int64_t tok = wid / p.HQ, b = tok / p.T, t = tok % p.T;
  const T* o = static_cast<const T*>(p.o) + b * p.o_s[0] + t * p.o_s[1] + hq * p.o_s[2];
  const T* d = static_cast<const T*>(p.dout) + b * p.do_s[0] + t * p.do_s[1] + hq * p.do_s[2];
  float s = 0.f;
  for (int e = lane; e < p.V; e += 32) s += to_f(o[e]) * to_f(d[e]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) p.delta[wid] = s;
}

}  // namespace

size_t smem_chunk_prep(int K) {
  return sizeof(float) * (4 * size_t(kChunk) * (K + 1) + 2 * size_t(kChunk) * (kChunk + 1) + kChunk);
}

template <typename T, int K>
static cudaError_t prep_t(const KernelParams& p, cudaStream_t s) {
  const size_t smem = smem_chunk_prep(K);
  auto kern = chunk_prep_kernel<T, K>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  kern<<<dim3(p.nchunks, p.H), kPrepThreads, smem, s>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_chunk_prep(const KernelParams& p, int dtype, cudaStream_t s) {
  if (dtype == 0) return p.K == 64 ? prep_t<__half, 64>(p, s) : prep_t<__half, 128>(p, s);
  return p.K == 64 ? prep_t<__nv_bfloat16, 64>(p, s) : prep_t<__nv_bfloat16, 128>(p, s);
}

cudaError_t launch_gate_cumsum(const KernelParams& p, const int32_t* seq_first, int nseqs, cudaStream_t s) {
  const int warps = nseqs * p.HQ, threads = 256;
  gate_cumsum_kernel<<<(warps * 32 + threads - 1) / threads, threads, 0, s>>>(p, seq_first, nseqs);
  return cudaGetLastError();
}

cudaError_t launch_bwd_dg(const KernelParams& p, const int32_t* seq_first, int nseqs, cudaStream_t s) {
  const int warps = nseqs * p.HQ, threads = 256;
  bwd_dg_kernel<<<(warps * 32 + threads - 1) / threads, threads, 0, s>>>(p, seq_first, nseqs);
  return cudaGetLastError();
}

cudaError_t launch_bwd_delta(const KernelParams& p, int dtype, cudaStream_t s) {
  const int64_t rows = int64_t(p.B) * p.T * p.HQ;
  const int threads = 256;
  const int64_t blocks = (rows * 32 + threads - 1) / threads;
  if (dtype == 0) bwd_delta_kernel<__half><<<unsigned(blocks), threads, 0, s>>>(p);
  else bwd_delta_kernel<__nv_bfloat16><<<unsigned(blocks), threads, 0, s>>>(p);
  return cudaGetLastError();
}

}  // namespace pathattn::cuda
