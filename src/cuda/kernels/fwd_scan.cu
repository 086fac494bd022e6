// cuda/kernels/fwd_scan.cu: the forward scan. One warpgroup per (query chunk, query head), one or two a CTA (below): the
// diagonal chunk from the precomputed A_loc, then key chunks right to left with an online softmax. Two-level
// transport (docs/algorithms.md): within the query's own superblock the query tile (fp32 in registers) is
// moved across each chunk, qt <- qt - (qt W^T) W2; beyond it the keys come pre-moved to the end of their
// superblock (ks) and the query crosses a whole superblock at once, qt <- qt PS (fp16 operands, fp32 accum).
#include "cuda/device/common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

// 4 warps x 16 query rows = one 64-row chunk; registers hold qt, O, S and X. Two shared-memory stages of
// (k~, v) tiles (the next chunk loads while this one computes) and one transport region (w16 and w2h of a
// chunk, or a superblock product PS). NP query chunks a CTA (fwd_scan_chunks_per_cta): at K = 128 an even chunk
// c and c + 1 share each key tile below c, halving its L2 traffic (docs/cuda.md); at K = 64 one, for 3 CTAs an SM.
constexpr int kFwdThreads = 128;
static_assert(kFwdThreads == kTileThreads, "load_tile_async assumes the scan kernels' block size");

template <typename T, int K, int V>
struct FwdSmem {
  static constexpr int LK = K + 8, LV = V + 8;
  static constexpr size_t bytes = 2 * (size_t(kChunk) * LK * sizeof(T) + size_t(kChunk) * LV * sizeof(T) +
                                       size_t(kChunk) * LK * sizeof(__half) + kChunk * sizeof(float));
};

// Query rows rr of chunk qc into qt (fp32, zero past the sequence) and their gate times log2(e) into Gq.
template <typename T, int K, bool kPlain>
__device__ __forceinline__ void load_query_rows(const KernelParams& p, const ChunkDesc& ch, int qc, int hq,
                                                int64_t tokq0, const int (&rr)[2], int nq, int t4, float gl2,
                                                float (&qt)[K / 8][4], float (&Gq)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = rr[hr];
    const __half* src = p.qtl + ((tokq0 + r) * p.HQ + hq) * K;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      float2 v2 = r < nq ? load_qstate<T, kPlain>(p, src, ch.b, ch.t0 + int64_t(qc) * kChunk + r, hq, 8 * nt + 2 * t4)
                         : make_float2(0.f, 0.f);
      qt[nt][2 * hr] = v2.x;
      qt[nt][2 * hr + 1] = v2.y;
    }
    Gq[hr] = (p.gate && r < nq) ? p.G[(tokq0 + r) * p.HQ + hq] * gl2 : 0.f;
  }
}

// Scores of the diagonal chunk from A_loc (pitch LA): causal, scaled by log2(e), with the gate terms.
template <int LA>
__device__ __forceinline__ void diag_scores(float (&s)[8][4], const float* As, const float* Gks, const int (&rr)[2],
                                            int nq, int t4, float sl2, float gl2, const float (&Gq)[2]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = rr[e >> 1], c = 8 * nt + 2 * t4 + (e & 1);
      float val;
      if (r < nq) {
        val = c <= r ? As[r * LA + c] * sl2 + Gq[e >> 1] - Gks[c] * gl2 : -INFINITY;
      } else {
        val = c == 0 ? 0.f : -INFINITY;  // padding rows: finite, never stored
      }
      s[nt][e] = val;
    }
}

// Split: the state fwd_far starts from (queries at the superblock's start, output so far, its lse).
template <int K, int V>
__device__ __forceinline__ void store_far_state(const KernelParams& p, int64_t tokq0, int hq, const int (&rr)[2],
                                                int nq, int t4, const float (&qt)[K / 8][4],
                                                const float (&o)[V / 8][4], const float (&m)[2],
                                                const float (&l)[2]) {
  for_fwd_rows(rr, nq, l, [&](int hr, int r, float lt) {
    const float inv = 1.f / lt;
    const int64_t row = (tokq0 + r) * p.HQ + hq;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
      *reinterpret_cast<uint32_t*>(p.qtl + row * K + 8 * nt + 2 * t4) =
          Pack2<__half>::pack(qt[nt][2 * hr], qt[nt][2 * hr + 1]);
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt)
      *reinterpret_cast<float2*>(p.ofar + row * V + 8 * nt + 2 * t4) =
          make_float2(o[nt][2 * hr] * inv, o[nt][2 * hr + 1] * inv);
    if (t4 == 0) p.lsefar[row] = m[hr] + log2f(lt);
  });
}

// A non-finite v in the CTA's diagonal chunks (finite.cuh): zeroed in the staged tiles (stage 0 the top chunk,
// stage 1 with two chunks a CTA the lower one, which is also the upper chunk's first key chunk). Returns the row of
// warpgroup wg's chunk (its diagonal in stage st) from which its outputs are NaN (INT32_MAX: none). Every thread
// of the CTA calls it after the tiles are visible; ends with them visible again.
template <typename T, int V, int NP>
__device__ __forceinline__ int diag_nonfinite_cut(T* Vs, int n_top, int n_low, int st, int wg) {
  constexpr int LV = FwdSmem<T, V, V>::LV;
  __shared__ int slot[2];
  const int2 bad = block_first_nonfinite2(
      zero_nonfinite_tile<V>(Vs, LV, n_top, threadIdx.x, blockDim.x),
      NP == 2 ? zero_nonfinite_tile<V>(Vs + kChunk * LV, LV, n_low, threadIdx.x, blockDim.x) : INT32_MAX, slot);
  return min(st == 0 ? bad.x : bad.y, NP == 2 && wg == 1 && bad.y != INT32_MAX ? 0 : INT32_MAX);
}

// This thread's rows rr of o from row `cut` on set to NaN.
template <int N>
__device__ __forceinline__ void nan_rows_from(float (&o)[N][4], const int (&rr)[2], int cut) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
    if (rr[hr] >= cut)
#pragma unroll
      for (int nt = 0; nt < N; ++nt) o[nt][2 * hr] = o[nt][2 * hr + 1] = nan_f32();
}

template <typename T, int K, int V, int NP, bool kPlain>
__global__ void __launch_bounds__(kFwdThreads * NP, K == 64 && V == 64 ? 3 : 1)
    fwd_scan_kernel(KernelParams p, const int32_t* items) {
  using S = FwdSmem<T, K, V>;
  constexpr int LK = S::LK, LV = S::LV;
  extern __shared__ __align__(16) uint8_t smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + 2 * kChunk * LK;
  __half* Ws = reinterpret_cast<__half*>(Vs + 2 * kChunk * LV);  // transport region: Ws, W2s or PS
  __half* W2s = Ws + kChunk * LK;
  float* Gk = reinterpret_cast<float*>(W2s + kChunk * LK);

  const int item = blockIdx.x;
  const ChunkDesc ch = p.chunks[items[item / p.HQ]];  // the CTA's first query chunk
  const int hq = item % p.HQ, h = hq / p.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int wg = warp >> 2, wtid = threadIdx.x & (kFwdThreads - 1);  // warpgroup, thread within it
  const int top = ch.c + NP - 1;                                      // the CTA's last query chunk
  const int qc = ch.c + wg, nq = max(0, min(kChunk, ch.len - qc * kChunk));
  const int64_t seq_tok0 = ch.b * p.T + ch.t0;
  const int64_t tokq0 = seq_tok0 + int64_t(qc) * kChunk;
  const int rr[2] = {16 * (warp & 3) + g, 16 * (warp & 3) + g + 8};
  const float LOG2E = 1.4426950408889634f;
  const float sl2 = p.scale * LOG2E, gl2 = p.gate ? p.gate_scale * LOG2E : 0.f;
  const T *vp = static_cast<const T*>(p.v), *ktp = static_cast<const T*>(p.kt), *ksp = static_cast<const T*>(p.ks);
  // With two warpgroups each loads half of every pair of tiles (the first warpgroup the first tile).
  const bool load_a = NP == 1 || wg == 0, load_b = NP == 1 || wg == 1;

  // Chunks [first, qc) are crossed one by one, those below `first` read as ks and crossed a superblock at a time
  // (PaTH only). The CTA's chunks share a superblock (p.sc is even).
  const int sc = p.sc, first = p.path ? (ch.c / sc) * sc : 0;
  // Split (p.ofar set): this kernel stops at the own superblock's start and fwd_far goes on from there.
  const bool split = p.ofar != nullptr && first > 0;
  const int stop = split ? first : 0;
  // Key chunk kc into stage st: k~ (or ks) unless only its values are needed (a diagonal), v, the gate.
  auto load_chunk = [&](int kc, int st, int nvalid, bool keys) {
    const int64_t tok = seq_tok0 + int64_t(kc) * kChunk;
    const int64_t pos = ch.t0 + int64_t(kc) * kChunk;
    const bool far = kc < first;
    if (keys && load_a)
      load_tile_async<K>(Ks + st * kChunk * LK, (far ? ksp : ktp) + (tok * p.H + h) * K, int64_t(p.H) * K, nvalid,
                         wtid);
    if (load_b)
      load_tile_async<V>(Vs + st * kChunk * LV, vp + ch.b * p.v_s[0] + pos * p.v_s[1] + h * p.v_s[2], p.v_s[1],
                         nvalid, wtid);
    cp_async_commit();
    for (int j = threadIdx.x; j < kChunk; j += blockDim.x)
      Gk[st * kChunk + j] = (p.gate && j < nvalid) ? p.G[(tok + j) * p.HQ + hq] : 0.f;
  };

  // Query state: chunk-start queries q~ (stored in fp16, held in fp32), rows past the sequence are zero.
  float qt[K / 8][4];
  float Gq[2];
  load_query_rows<T, K, kPlain>(p, ch, qc, hq, tokq0, rr, nq, t4, gl2, qt, Gq);
  float o[V / 8][4];
  zero_acc(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];

  // Diagonal chunks: each warpgroup's A_loc rows (pitch 68 floats) staged in the transport region (free until the
  // loop's first barrier) with the CTA's chunks' values (chunk kc in stage (top - kc) % 2; chunk c's keys too).
  constexpr int LA = kChunk + 4;
  static_assert(NP * size_t(kChunk) * LA * 4 <= 2 * size_t(kChunk) * LK * sizeof(__half), "A_loc over Ws, W2s");
  const float* As = reinterpret_cast<const float*>(Ws) + wg * kChunk * LA;
  load_tile_async<2 * kChunk>(Ws + wg * kChunk * 2 * LA,
                              reinterpret_cast<const __half*>(p.aloc + (tokq0 * p.HQ + hq) * kChunk),
                              int64_t(p.HQ) * kChunk * 2, nq, wtid);
  const int n_top = max(0, min(kChunk, ch.len - top * kChunk)), n_low = max(0, min(kChunk, ch.len - ch.c * kChunk));
  load_chunk(top, 0, n_top, false);
  if (NP == 2) load_chunk(ch.c, 1, n_low, true);
  cp_async_wait_all();
  __syncthreads();
  if (NP == 1 && qc > stop) load_chunk(qc - 1, 1, kChunk, true);  // stage 1: the scan below reads stage 0 only
  const int cut = diag_nonfinite_cut<T, V, NP>(Vs, n_top, n_low, (top - qc) & 1, wg);  // rows of o from it on: NaN
  {
    const int st = (top - qc) & 1;
    const T* Vst = Vs + st * kChunk * LV;
    const float* Gks = Gk + st * kChunk;
    float s[8][4];
    diag_scores<LA>(s, As, Gks, rr, nq, t4, sl2, gl2, Gq);
    softmax_step(s, m, l, alpha);
    warp_mma_rs<T, 4, V / 8, true>(o, s, 1.f, Vst, LV, 0);
    nan_rows_from(o, rr, cut);
  }
  // Key chunks right to left; a warpgroup takes part in those below its own chunk.
  for (int kc = top - 1; kc >= stop; --kc) {
    const int st = (top - kc) & 1;
    const bool active = kc < qc;
    cp_async_wait_all();
    __syncthreads();
    // The transport region is free: a chunk crossed here fetches its w16 / w2h now (waited for after the scores);
    // entering far superblock sb > 0 fetches its product, used after the superblock's last chunk.
    const bool far = kc < first;
    const bool cross_chunk = p.path && kc > 0 && !far;
    if (cross_chunk) {
      const int64_t tok = seq_tok0 + int64_t(kc) * kChunk;
      if (load_a) load_tile_async<K>(Ws, p.w16 + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk, wtid);
      if (load_b) load_tile_async<K>(W2s, p.w2h + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk, wtid);
      cp_async_commit();
    }
    if (far && kc % sc == sc - 1 && kc >= sc) {
      const __half* src = p.ps + (int64_t(ch.sfirst + kc / sc) * p.H + h) * K * K;
      for (int r0 = (NP == 1 ? 0 : wg * kChunk); r0 < K; r0 += NP * kChunk)
        load_tile_async<K>(Ws + r0 * LK, src + r0 * K, K, kChunk, wtid);
      cp_async_commit();
    }
    if (kc > stop) load_chunk(kc - 1, st ^ 1, kChunk, true);
    const T* Kst = Ks + st * kChunk * LK;
    const T* Vst = Vs + st * kChunk * LV;
    const float* Gks = Gk + st * kChunk;
    if (active) {
      float s[8][4];
      zero_acc(s);
      warp_mma_rs<T, K / 16, 8, false>(s, qt, 1.f, Kst, LK, 0);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = s[nt][e] * sl2 + Gq[e >> 1] - Gks[8 * nt + 2 * t4 + (e & 1)] * gl2;
      softmax_step(s, m, l, alpha);
      scale_rows(o, alpha);
      warp_mma_rs<T, 4, V / 8, true>(o, s, 1.f, Vst, LV, 0);
    }
    if (cross_chunk) {  // move the queries across chunk kc: qt <- qt (I - W^T W2)
      // w16 / w2h of chunk kc landed (the next k~, v, committed after them, may still be in flight; at a split
      // scan's last chunk nothing was committed after them)
      if (kc > stop) cp_async_wait_group<1>();
      else cp_async_wait_all();
      __syncthreads();
      if (active) {
        float x[8][4];
        zero_acc(x);
        warp_mma_rs<__half, K / 16, 8, false>(x, qt, 1.f, Ws, LK, 0);
        warp_mma_rs<__half, 4, K / 8, true>(qt, x, -1.f, W2s, LK, 0);
      }
    } else if (far && kc > 0 && kc % sc == 0) {  // across superblock kc / sc: qt <- qt PS
      float y[K / 8][4];
      zero_acc(y);
      warp_mma_rs<__half, K / 16, K / 8, true>(y, qt, 1.f, Ws, LK, 0);
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) qt[nt][e] = y[nt][e];
    }
  }
  if (!split) {
    store_fwd_rows<T, V>(p, ch, qc, hq, rr, nq, o, m, l);
    return;
  }
  store_far_state<K, V>(p, tokq0, hq, rr, nq, t4, qt, o, m, l);
}

template <typename T, int K, int V>
cudaError_t fwd_t(const KernelParams& p, const int32_t* pairs, int npairs, cudaStream_t s) {
  constexpr int NP = fwd_scan_chunks_per_cta(K);
  const int32_t* items = NP == 1 ? p.order : pairs;
  const int64_t n = NP == 1 ? p.nchunks : npairs;
  // Plain attention: the instantiation that takes the query state from q itself (load_qstate).
  const auto kern = p.path ? fwd_scan_kernel<T, K, V, NP, false> : fwd_scan_kernel<T, K, V, NP, true>;
  return launch_with_smem(kern, dim3(unsigned(n * p.HQ)), kFwdThreads * NP, FwdSmem<T, K, V>::bytes, s, p, items);
}

template <typename T>
cudaError_t fwd_dispatch(const KernelParams& p, const int32_t* pairs, int npairs, cudaStream_t s) {
  if (p.K == 64 && p.V == 64) return fwd_t<T, 64, 64>(p, pairs, npairs, s);
  if (p.K == 64 && p.V == 128) return fwd_t<T, 64, 128>(p, pairs, npairs, s);
  if (p.K == 128 && p.V == 64) return fwd_t<T, 128, 64>(p, pairs, npairs, s);
  return fwd_t<T, 128, 128>(p, pairs, npairs, s);
}

}  // namespace

size_t smem_fwd_scan(int K, int V) {
  // Same formula as FwdSmem (the element type of k~ and v is 2 bytes for both fp16 and bf16).
  return 2 * (size_t(kChunk) * (K + 8) * 2 + size_t(kChunk) * (V + 8) * 2 + size_t(kChunk) * (K + 8) * 2 +
              kChunk * sizeof(float));
}

cudaError_t launch_fwd_scan(const KernelParams& p, const int32_t* pairs, int npairs, int dtype, cudaStream_t s) {
  return dtype == 0 ? fwd_dispatch<__half>(p, pairs, npairs, s) : fwd_dispatch<__nv_bfloat16>(p, pairs, npairs, s);
}

}  // namespace pathattn::cuda
