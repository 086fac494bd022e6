// cuda/device/softmax.cuh: the scans' online softmax over a warp's 16 rows and the forward's output rows.
#pragma once

#include "cuda/device/mma.cuh"

namespace pathattn::cuda {

// The scans' online-softmax step for a warp's 16 rows over NT n-tiles of 8 keys (the scans' chunks: NT = 8);
// s in log2 units, overwritten with exp2(s - m_new).
template <int NT>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * hr], s[nt][2 * hr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m[hr], mx);
    alpha[hr] = fast_exp2(m[hr] - mn);
    m[hr] = mn;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][2 * hr] = fast_exp2(s[nt][2 * hr] - mn);
      s[nt][2 * hr + 1] = fast_exp2(s[nt][2 * hr + 1] - mn);
      sum += s[nt][2 * hr] + s[nt][2 * hr + 1];
    }
    l[hr] = l[hr] * alpha[hr] + sum;
  }
}

// Rescales a warp's 16-row accumulator tile (C layout, NT n-tiles) by the softmax step's per-row factors.
template <int NT>
__device__ __forceinline__ void scale_rows(float (&o)[NT][4], const float (&alpha)[2]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    o[nt][0] *= alpha[0];
    o[nt][1] *= alpha[0];
    o[nt][2] *= alpha[1];
    o[nt][3] *= alpha[1];
  }
}

// A row's softmax sum from the partial sums of the quad of lanes that hold it (C layout).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The forward's epilogues: f(hr, r, lt) for each of a warp's two rows rr[hr] below nq, lt the row's softmax sum
// (its quad's partial sums l added; every lane takes part in that).
template <class F>
__device__ __forceinline__ void for_fwd_rows(const int (&rr)[2], int nq, const float (&l)[2], F f) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float lt = quad_sum(l[hr]);
    if (rr[hr] < nq) f(hr, rr[hr], lt);
  }
}

// o / l of a warp's 16 rows (rr) of query chunk qc into p.o (type T), rows at and past nq skipped, and lse =
// (m + log2 l) ln 2 into p.lse when present.
template <typename T, int V>
__device__ __forceinline__ void store_fwd_rows(const KernelParams& p, const ChunkDesc& ch, int qc, int hq,
                                               const int (&rr)[2], int nq, const float (&o)[V / 8][4],
                                               const float (&m)[2], const float (&l)[2]) {
  const int t4 = threadIdx.x & 3;
  const bool pair = vec2_ok(static_cast<T*>(p.o), p.o_s[0], p.o_s[1], p.o_s[2]);
  for_fwd_rows(rr, nq, l, [&](int hr, int r, float lt) {
    const float inv = 1.f / lt;
    const int64_t pos = ch.t0 + int64_t(qc) * kChunk + r;
    T* orow = static_cast<T*>(p.o) + ch.b * p.o_s[0] + pos * p.o_s[1] + hq * p.o_s[2];
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) store2(orow + 8 * nt + 2 * t4, o[nt][2 * hr] * inv, o[nt][2 * hr + 1] * inv, pair);
    if (p.lse && t4 == 0)
      p.lse[ch.b * p.lse_s[0] + pos * p.lse_s[1] + hq * p.lse_s[2]] = (m[hr] + log2f(lt)) * 0.6931471805599453f;
  });
}

}  // namespace pathattn::cuda
