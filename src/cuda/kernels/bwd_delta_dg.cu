// cuda/kernels/bwd_delta_dg.cu: the backward's row sums around the scans: delta = rowsum(dO * O) (with the
// far key kernel's per-row scalars) before them, and the gate gradient's reverse cumsum after them.
#include <type_traits>

#include "cuda/device/common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

// One warp per (sequence, query head): dg_u = sum_{t >= u} (dgrow_t + dgcol_t (+ dgcolf_t)).
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
      x = p.dgrow[i] + p.dgcol[i] + (p.dgcolf != nullptr ? p.dgcolf[i] : 0.f);
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    x += carry;
    if (t < ch.len) store_param(p.dg, p.dg_dt, ch.b * p.dg_s[0] + (ch.t0 + t) * p.dg_s[1] + hq * p.dg_s[2], x);
    carry = __shfl_sync(0xffffffffu, x, 31);
  }
}

// delta = sum_v dO * O (fp32) per (token, query head), over the rows of the chunk table (chunk ci's row r, query
// head hq); where lsd is given (the backward's far key kernel runs), also lsd[hq][ci][r] = ((lse - gate_scale G)
// log2(e), delta), and (+inf, 0) past the sequence, so that P = 0 there. kVec: V / 8 lanes
// a row, one 16-byte load of each tensor a lane (8 elements), the row's lanes reduced by shuffles (two or four
// rows a warp, every load independent); else one warp a row with 2-byte loads (rows or strides not 16-byte
// aligned).
template <typename T, bool kVec>
__global__ void bwd_delta_kernel(KernelParams p, float2* lsd) {
  const int64_t nrows = int64_t(p.nchunks) * p.HQ * kChunk;
  const int lpr = kVec ? p.V / 8 : 32;  // lanes a row: 8 or 16 with kVec (V in {64, 128})
  const int64_t gid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, row = gid / lpr;
  const int part = int(gid % lpr);
  // row = (ci 64 + r) HQ + hq: a chunk row's heads side by side, as o, dO and delta hold them.
  const int hq = int(row % p.HQ), cr = int(row / p.HQ), r = cr % kChunk, ci = cr / kChunk;
  float s = 0.f;
  bool in = false;
  int64_t tok = 0, pos = 0, b = 0;
  if (row < nrows) {
    const ChunkDesc ch = p.chunks[ci];
    in = ch.c * kChunk + r < ch.len;
    b = ch.b;
    pos = ch.t0 + int64_t(ch.c) * kChunk + r;
    tok = b * p.T + pos;
  }
  if (in) {
    const T* o = static_cast<const T*>(p.o) + b * p.o_s[0] + pos * p.o_s[1] + hq * p.o_s[2];
    const T* d = static_cast<const T*>(p.dout) + b * p.do_s[0] + pos * p.do_s[1] + hq * p.do_s[2];
    if constexpr (kVec) {
      const uint4 ov = __ldg(reinterpret_cast<const uint4*>(o) + part);
      const uint4 dv = __ldg(reinterpret_cast<const uint4*>(d) + part);
      const T* oe = reinterpret_cast<const T*>(&ov);
      const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) s += to_f(oe[e]) * to_f(de[e]);
    } else {
      for (int e = part; e < p.V; e += 32) s += to_f(o[e]) * to_f(d[e]);
    }
  }
  for (int off = lpr / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (part != 0 || row >= nrows) return;
  if (in) p.delta[tok * p.HQ + hq] = s;
  if (lsd != nullptr) {
    float2 v = make_float2(INFINITY, 0.f);
    if (in)
      v = make_float2((p.lse[b * p.lse_s[0] + pos * p.lse_s[1] + hq * p.lse_s[2]] -
                       (p.gate ? p.gate_scale * p.G[tok * p.HQ + hq] : 0.f)) * 1.4426950408889634f,
                      s);
    lsd[(int64_t(hq) * p.nchunks + ci) * kChunk + r] = v;
  }
}

}  // namespace

cudaError_t launch_bwd_dg(const KernelParams& p, const int32_t* seq_first, int nseqs, cudaStream_t s) {
  const int warps = nseqs * p.HQ, threads = 256;
  bwd_dg_kernel<<<(warps * 32 + threads - 1) / threads, threads, 0, s>>>(p, seq_first, nseqs);
  return cudaGetLastError();
}

cudaError_t launch_bwd_delta(const KernelParams& p, float2* lsd, int dtype, cudaStream_t s) {
  const int64_t rows = int64_t(p.nchunks) * p.HQ * kChunk;
  if (rows == 0) return cudaSuccess;
  bool vec = (p.V == 64 || p.V == 128) && reinterpret_cast<uintptr_t>(p.o) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(p.dout) % 16 == 0;
  for (int d = 0; d < 3; ++d) vec = vec && p.o_s[d] % 8 == 0 && p.do_s[d] % 8 == 0;
  const int threads = 256;
  const int64_t blocks = (rows * (vec ? p.V / 8 : 32) + threads - 1) / threads;
  if (dtype == 0) {
    if (vec) bwd_delta_kernel<__half, true><<<unsigned(blocks), threads, 0, s>>>(p, lsd);
    else bwd_delta_kernel<__half, false><<<unsigned(blocks), threads, 0, s>>>(p, lsd);
  } else {
    if (vec) bwd_delta_kernel<__nv_bfloat16, true><<<unsigned(blocks), threads, 0, s>>>(p, lsd);
    else bwd_delta_kernel<__nv_bfloat16, false><<<unsigned(blocks), threads, 0, s>>>(p, lsd);
  }
  return cudaGetLastError();
}

}  // namespace pathattn::cuda
