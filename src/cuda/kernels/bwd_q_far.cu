// cuda/kernels/bwd_q_far.cu: the query side's far part of the backward on Hopper (sm_90a). For a query tile (the two
// chunks of a superblock pair S >= 1, 128 rows, a warpgroup each) of a query head, the keys of every earlier
// superblock sb meet the queries moved to sb's end, qt_sb = qhat PS_{S-1} ... PS_{sb+1}, with ks. Per tile:
//   pass 1 (right to left) carries qt from qhat across the earlier superblocks (fp16 operands as bwd_q),
//          parking each state (in the input type) in this CTA's scratch;
//   pass 2 (left to right), per sb: for sb > 0 the crossing dPS_sb += qt_sb^T gbar (fp32 atomics into dps) and
//          gbar <- gbar PS_sb^T; then the far loop of dev/cuda/far_bwd.cu (64-key chunks of ks and v by TMA;
//          S = qt_sb ks^T and dP = dO v^T of chunk c issued with gbar += scale dS ks of chunk c - 1).
// gbar at the end is the gradient w.r.t. qhat (dqt), where bwd_q's last launch (p.qfar == 2) continues. With the
// gate, the row sums of dS go to dgrow and the column sums to dgcol (atomics). Not deterministic (atomics).
#include <algorithm>
#include <cstdint>

#include "cuda/device/hopper.cuh"
#include "cuda/launchers.h"
#include "cuda/tensor_map.h"

namespace pathattn::cuda {
namespace {

constexpr int kQfThreads = 256;  // two warpgroups
constexpr int kQfRows = 128;     // query rows per tile: the two chunks of a superblock pair
constexpr int kQfStages = 3;     // key chunks c - 1, c, c + 1

struct QfMaps {
  CUtensorMap ks;    // [NT][H][K]: boxes of 64 columns x 64 keys
  CUtensorMap v;     // [B][T][H][V] with v's strides: the same boxes
  CUtensorMap park;  // [rows][K] this call's parked query states (kp.scratch): 64 columns x 128 rows
  CUtensorMap ps;    // [nsuper H K][K] fp16: 64 columns x K rows
  const int32_t* tiles;  // chunk-table index of each tile's first (even) chunk, most work first
  int* next;             // items handed out past the first gridDim.x (zeroed before the launch)
  const int32_t* park_first;  // [grid + 1] each CTA's first parked state (128 x K each), from far_park_first
};

template <int K>
struct QfSmem {
  static constexpr size_t kv = size_t(kChunk) * K * 2, tile = size_t(kQfRows) * K * 2;
  // Stages of ks / v chunks, the superblock product (fp16), qt_sb and the staged gbar, a reduction, the rows'
  // (lse2, delta), barriers.
  static constexpr size_t bytes =
      1024 + kQfStages * 2 * kv + size_t(K) * K * 2 + 2 * tile + 8 * 4 + kQfRows * 8 + kQfStages * kChunk * 4 + 8 * 16;
};

// The CTA's mbarriers (thread 0): full / empty a key stage, the product pipe's, qt_full.
__device__ __forceinline__ void init_qf_barriers(uint64_t* full, PsPipe& ps) {
  constexpr int kWarps = kQfThreads / 32;
  uint64_t* empty = full + kQfStages;
  uint64_t* qt_full = empty + kQfStages + 2;
  if (threadIdx.x == 0) {
    for (int st = 0; st < kQfStages; ++st) {
      mbar_init(&full[st], 1);
      mbar_init(&empty[st], kWarps);
    }
    ps.init(kWarps);
    mbar_init(qt_full, 1);
    mbar_init_fence();
  }
}

// qt = qhat of rows rr (fp32; zero past the sequence).
template <typename T, int K>
__device__ __forceinline__ void load_qhat_rows(const KernelParams& p, int64_t tokq0, int hq, const int (&rr)[2], int nq,
                                               int t4, float (&qt)[K / 8][4]) {
  const T* qh = static_cast<const T*>(p.qhat);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const bool ok = rr[hr] < nq;
    const T* src = qh + ((tokq0 + rr[hr]) * p.HQ + hq) * K;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      qt[nt][2 * hr] = ok ? to_f(src[8 * nt + 2 * t4]) : 0.f;
      qt[nt][2 * hr + 1] = ok ? to_f(src[8 * nt + 2 * t4 + 1]) : 0.f;
    }
  }
}

// (lse2 - the row's gate term, delta) of rows rr into rv[0], rv[8] (+inf past the sequence, so that P = 0).
template <bool kGate>
__device__ __forceinline__ void put_row_terms(const KernelParams& p, const ChunkDesc& ch, int qc, int64_t tokq0, int hq,
                                              const int (&rr)[2], int nq, float gl2, float2* rv) {
  const float LOG2E = 1.4426950408889634f;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const bool ok = rr[hr] < nq;
    const int64_t pos = ch.t0 + int64_t(qc) * kChunk + rr[hr], tok = tokq0 + rr[hr];
    const float gq_r = kGate && ok ? p.G[tok * p.HQ + hq] * gl2 : 0.f;
    rv[8 * hr] =
        ok ? make_float2(p.lse[ch.b * p.lse_s[0] + pos * p.lse_s[1] + hq * p.lse_s[2]] * LOG2E - gq_r,
                         p.delta[tok * p.HQ + hq])
           : make_float2(INFINITY, 0.f);
  }
}

// s <- scale P (dP - delta) for key chunk ktok.., P = 2^(s sl2 - lse2 - the keys' gate terms Gk), rows' terms
// in rw[0], rw[8]; with the gate, row sums into rs and column sums into dgcol.
template <bool kGate>
__device__ __forceinline__ void qf_ds(const KernelParams& p, float (&s)[8][4], const float (&dp)[8][4],
                                      const float2* rw, const float* Gk, int64_t ktok, int hq, int t4, float sl2,
                                      float (&rs)[2]) {
  const float2 rv[2] = {rw[0], rw[8]};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float gk = kGate ? Gk[8 * nt + 2 * t4 + (e & 1)] : 0.f;
      const float pr = fast_exp2(s[nt][e] * sl2 - rv[e >> 1].x - gk);
      s[nt][e] = p.scale * pr * (dp[nt][e] - rv[e >> 1].y);
    }
  if constexpr (kGate) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      rs[0] += s[nt][0] + s[nt][1];
      rs[1] += s[nt][2] + s[nt][3];
    }
    warp_add_col_sums(s, p.dgcol + hq, ktok, p.HQ, -p.gate_scale / p.scale);  // dgcol takes -gate_scale dS
  }
}

// dst (dPS_sb) += qt_sb^T gbar over the tile's rows: A = qt_sb^T (Qt, M-major), B = the staged gbar (Gs,
// N-major), fp32 reductions scaled by up. K = 128: warpgroup wg takes features 64 wg .. over all rows; K = 64:
// all features over its own 64 rows, the two partials summed through shared memory over Gs first.
template <typename T, int K>
__device__ __forceinline__ void qf_add_dps(float* dst, const T* Qt, T* Gs, int warp, int wg, int lane, float up) {
  constexpr int KB = K / 64;
  const int mb = K == 128 ? wg : 0, ks0 = K == 128 ? 0 : 4 * wg, nks = K == 128 ? 8 : 4;
#pragma unroll 1
  for (int nh = 0; nh < KB; ++nh) {
    float d[8][4];
    wg_rows_outer<T>(d, Qt, mb, Gs, nh, ks0, nks);
    bool reduce = true;
    if constexpr (K == 64) {
      // Both warpgroups hold a 64 x 64 partial over their own rows: warpgroup 0 sums rows 0-31 of the two,
      // warpgroup 1 rows 32-63, through shared memory over Gs (free once both products are done), so that
      // each element takes one reduction instead of two.
      float* xch = reinterpret_cast<float*>(Gs) + (warp & 3) * 32 + lane;  // [32 values][4 warps x 32 lanes]
      reduce = ((warp & 3) < 2) == (wg == 0);
      __syncthreads();  // both warpgroups' products have read Gs
      if (!reduce)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) xch[(4 * nt + e) * 128] = d[nt][e];
      __syncthreads();
      if (reduce)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) d[nt][e] += xch[(4 * nt + e) * 128];
    }
#pragma unroll
    for (int nt = 0; nt < 8 && reduce; ++nt)
      red_add_frag_v4(dst, K, mb * 64 + 16 * (warp & 3), nh * 64 + 8 * nt, d[nt], up);
  }
}

// gbar (gq): the gradient w.r.t. qhat of rows rr into dqt; with the gate, the far part of dgrow (gate_scale
// times the row sums of dS).
template <bool kGate, int K>
__device__ __forceinline__ void store_gbar(const KernelParams& p, int64_t tokq0, int hq, const int (&rr)[2], int nq,
                                           int t4, const float (&gq)[K / 8][4], float (&rs)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    if constexpr (kGate) {
      rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 1);
      rs[hr] += __shfl_xor_sync(0xffffffffu, rs[hr], 2);
      if (t4 == 0 && rr[hr] < nq) p.dgrow[(tokq0 + rr[hr]) * p.HQ + hq] = p.gate_scale / p.scale * rs[hr];
    }
    if (rr[hr] >= nq) continue;
    float* dst = p.dqt + ((tokq0 + rr[hr]) * p.HQ + hq) * K;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
      *reinterpret_cast<float2*>(dst + 8 * nt + 2 * t4) = make_float2(gq[nt][2 * hr], gq[nt][2 * hr + 1]);
  }
}

// Thread 0: key chunk c's ks and v (with the gate, its keys' gate terms) into stage n % 3, the n-th chunk load of
// the CTA, once that stage's last readers released it.
template <typename T, int K, bool kGate>
__device__ __forceinline__ void qf_issue_chunk(const KernelParams& p, const QfMaps& mp, T* Ks, T* Vs, float* Gst,
                                               uint64_t* full, uint32_t n, const ChunkDesc& ch, int hq, int h,
                                               int64_t seq_tok0, int c) {
  constexpr int V = K, KB = K / 64;
  uint64_t* empty = full + kQfStages;
  const int st = int(n % kQfStages);
  if (n >= kQfStages) mbar_wait(&empty[st], (n / kQfStages - 1) & 1);
  mbar_expect_tx(&full[st], uint32_t(kChunk * (K + V) * 2 + (kGate ? kChunk * 4 : 0)));
  if constexpr (kGate)
    bulk_load(Gst + st * kChunk, p.gc + (int64_t(hq) * p.nchunks + ch.first + c) * kChunk, kChunk * 4, &full[st]);
#pragma unroll 1
  for (int b = 0; b < KB; ++b) {
    tma_load(Ks + st * kChunk * K + b * kChunk * 64, &mp.ks, 64 * b, h, int(seq_tok0 + int64_t(c) * kChunk),
             &full[st]);
    tma_load(Vs + st * kChunk * V + b * kChunk * 64, &mp.v, 64 * b, h, int(ch.t0 + int64_t(c) * kChunk),
             int(ch.b), &full[st]);
  }
}

// Descriptors of stage n % 3's tiles: K-major B (k-steps of 32 bytes within a 64-column block), or ks N-major
// (gq += dS ks: k-steps of 16 keys, column blocks 64 rows apart).
template <int K, typename T>
__device__ __forceinline__ uint64_t qf_kmajor(const T* base, uint32_t n, int kt) {
  const char* t = reinterpret_cast<const char*>(base + (n % kQfStages) * kChunk * K);
  return smem_desc_sw128(t + (kt / 4) * kChunk * 128 + (kt % 4) * 32, 16, 1024);
}
template <int K, typename T>
__device__ __forceinline__ uint64_t qf_nmajor(const T* Ks, uint32_t n, int kt) {
  const char* t = reinterpret_cast<const char*>(Ks + (n % kQfStages) * kChunk * K);
  return smem_desc_sw128(t + kt * 16 * 128, kChunk * 128, 1024);
}

// Key chunks c0 .. c0 + p.sc - 1 of one superblock (n_c: the CTA's chunk loads before chunk 0): S / dP of chunk c
// issued with gq += dS ks of chunk c - 1, the first chunk peeled (a wgmma under a branch makes ptxas serialize).
template <typename T, int K, typename Wait, typename Sdp, typename Gq, typename Ds, typename Release>
__device__ __forceinline__ void qf_chunks(const KernelParams& p, int c0, uint32_t n_c, float (&s)[8][4],
                                          float (&dp)[8][4], float (&gq)[K / 8][4], uint32_t (&dsa)[4][4],
                                          Wait& wait_chunk, Sdp& issue_sdp, Gq& issue_gq, Ds& ds, Release& release_c) {
  wait_chunk(c0);
  issue_sdp(n_c + uint32_t(c0));
  wg_wait<0>();
  fence_regs(s, dp);
  ds(c0);
  pack_frags<T, 4>(dsa, s);
  for (int c = c0 + 1; c < c0 + p.sc; ++c) {
    const uint32_t n = n_c + uint32_t(c);
    wait_chunk(c);
    issue_sdp(n);
    issue_gq(n - 1);
    wg_wait<1>();  // S, dP of chunk c done; gq += dS ks of chunk c - 1 may still run
    fence_regs(s, dp);
    ds(c);
    wg_wait<0>();
    release_c(n - 1);
    fence_regs(gq, dsa);
    pack_frags<T, 4>(dsa, s);
  }
  const uint32_t nl = n_c + uint32_t(c0 + p.sc - 1);
  fence_regs(gq, dsa);
  wg_fence();
  issue_gq(nl);
  wg_wait<0>();
  fence_regs(gq);
  release_c(nl);
}

template <typename T, int K, bool kGate>
__global__ void __launch_bounds__(kQfThreads, 1) bwd_q_far_kernel(const __grid_constant__ KernelParams p,
                                                                  const __grid_constant__ QfMaps mp, int nitems) {
#ifdef PA_SM90A
  constexpr int V = K, KB = K / 64;  // 64-column blocks of a row
  extern __shared__ __align__(16) uint8_t smem[];
  T* Ks = reinterpret_cast<T*>(align1k(smem));  // [stage][64 keys][K] as column blocks of 64 x 64
  T* Vs = Ks + kQfStages * kChunk * K;
  __half* PSs = reinterpret_cast<__half*>(Vs + kQfStages * kChunk * V);  // [K][K] as column blocks of K x 64
  T* Qt = reinterpret_cast<T*>(PSs + K * K);  // [128 rows][K] as column blocks of 128 x 64
  T* Gs = Qt + kQfRows * K;                   // [128 rows][K] likewise (gbar, scaled)
  float* red = reinterpret_cast<float*>(Gs + kQfRows * K);
  float2* rowv = reinterpret_cast<float2*>(red + 8);  // [128] (lse2, delta)
  float* Gst = reinterpret_cast<float*>(rowv + kQfRows);  // [stage][64 keys] gate terms (gc), with the gate
  uint64_t* full = reinterpret_cast<uint64_t*>(Gst + kQfStages * kChunk);
  uint64_t* empty = full + kQfStages;
  PsPipe ps{empty + kQfStages, empty + kQfStages + 1, PSs};
  uint64_t* qt_full = empty + kQfStages + 2;
  init_qf_barriers(full, ps);
  __syncthreads();
  const int warp = uniform_warp_id(), lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, wg = warp >> 2;
  const int rr[2] = {16 * (warp & 3) + g, 16 * (warp & 3) + g + 8};  // rows within the warpgroup's chunk
  const float LOG2E = 1.4426950408889634f, sl2 = p.scale * LOG2E, gl2 = kGate ? p.gate_scale * LOG2E : 0.f;
  const int park_row0 = mp.park_first[blockIdx.x] * kQfRows;
  T* park = static_cast<T*>(static_cast<void*>(p.scratch)) + size_t(park_row0) * K;
  // Running counts of this CTA's barrier uses (every thread counts the same; phases are their parities).
  uint32_t n_c = 0;   // key chunks loaded (stage n_c % 3)
  uint32_t n_qt = 0;  // qt_sb tile loads
  // Items are most work first; a CTA that finishes takes the earliest item not yet taken (tiles differ in work).
  __shared__ int next_item;
  for (int it = blockIdx.x; it < nitems; it = take_item(mp.next, &next_item, int(gridDim.x))) {
    const int hq = it % p.HQ, h = hq / p.group;
    const ChunkDesc ch = p.chunks[mp.tiles[it / p.HQ]];
    const int S = ch.c / p.sc, n1 = S - 1;  // earlier superblocks; crossings of each pass
    const int qc = ch.c + wg, nq = max(0, min(kChunk, ch.len - qc * kChunk));
    const int64_t seq_tok0 = ch.b * p.T + ch.t0, tokq0 = seq_tok0 + int64_t(qc) * kChunk;
    const int nfc = S * p.sc;  // far key chunks, the sequence's chunks 0 .. nfc - 1
    auto issue_ps = [&](int i) {  // thread 0: crossing i's product (pass 1: PS_{S-1-i}; pass 2: PS_{1+i-n1})
      const int a = i < n1 ? S - 1 - i : 1 + (i - n1);
      ps.load<K>(&mp.ps, int((int64_t(ch.sfirst + a) * p.H + h) * K));
    };
    auto issue_c = [&](int c) {  // thread 0: key chunk c's ks and v into stage n_c + c
      qf_issue_chunk<T, K, kGate>(p, mp, Ks, Vs, Gst, full, n_c + uint32_t(c), ch, hq, h, seq_tok0, c);
    };
    auto issue_qt = [&](int sb) {  // thread 0: the parked qt_sb into Qt
      mbar_expect_tx(qt_full, uint32_t(kQfRows * K * 2));
#pragma unroll 1
      for (int b = 0; b < KB; ++b) tma_load(Qt + b * kQfRows * 64, &mp.park, 64 * b, park_row0 + sb * kQfRows, qt_full);
    };
    auto release_c = [&](uint32_t n) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[n % kQfStages]);
    };

    __syncthreads();  // the previous tile is done with Qt, Gs and the parking
    if (threadIdx.x == 0 && n1 > 0) issue_ps(0);
    // ---- pass 1: qt (this warp's 16 rows, fp32; zero past the sequence) from qhat, parked for sb = S-1 .. 0.
    {
      float qt[K / 8][4];
      load_qhat_rows<T, K>(p, tokq0, hq, rr, nq, t4, qt);
      for (int i = 0;; ++i) {
        store_tile<T, K>(park + size_t(S - 1 - i) * kQfRows * K, K, qt);  // qt_{S-1-i}
        if (i == n1) break;
        ps.apply<K, false, false>(qt);  // qt <- qt PS_{S-1-i}
        if (threadIdx.x == 0) issue_ps(i + 1);  // i + 1 < 2 n1
      }
      // The parked states are read back by TMA (the async proxy).
      asm volatile("fence.proxy.async.global;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      issue_c(0);
      issue_qt(0);
    }

    // ---- pass 2. Per-row data of this warp's rows: dO fragments, the exponent's bias lse (base 2) and delta.
    const int wrow0 = 16 * (warp & 3);
    uint32_t da[V / 16][4], qa[K / 16][4];
    {
      const T* dop = static_cast<const T*>(p.dout) + ch.b * p.do_s[0] + (ch.t0 + int64_t(qc) * kChunk + wrow0) * p.do_s[1] +
                     hq * p.do_s[2];
      load_frags<T, V / 16>(da, dop, p.do_s[1], nq - wrow0);
    }
    // (lse2 - gate term, delta) in shared memory (registers are short here), written and read by the same warp.
    if (t4 == 0) put_row_terms<kGate>(p, ch, qc, tokq0, hq, rr, nq, gl2, rowv + 16 * warp + g);
    __syncwarp();
    float s[8][4], dp[8][4], gq[K / 8][4];
    uint32_t dsa[4][4];
    zero_acc(gq);
    auto kmaj = [&](const T* base, uint32_t n, int kt) { return qf_kmajor<K>(base, n, kt); };
    auto nmaj = [&](uint32_t n, int kt) { return qf_nmajor<K>(Ks, n, kt); };
    auto issue_sdp = [&](uint32_t n) {
#pragma unroll
      for (int kt = 0; kt < K / 16; ++kt) wg_rs<T, 0>(s, qa[kt], kmaj(Ks, n, kt), kt > 0);
#pragma unroll
      for (int kt = 0; kt < V / 16; ++kt) wg_rs<T, 0>(dp, da[kt], kmaj(Vs, n, kt), kt > 0);
      wg_commit();
    };
    auto issue_gq = [&](uint32_t n) {
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) wg_rs<T, 1>(gq, dsa[kt], nmaj(n, kt));
      wg_commit();
    };
    float rs[2] = {0.f, 0.f};  // with the gate: this thread's row sums of scale dS
    // s <- scale P (dP - delta) for key chunk c (qf_ds); with the gate, row sums into rs, column sums into dgcol.
    auto ds = [&](int c) {
      const float* Gk = Gst + ((n_c + uint32_t(c)) % kQfStages) * kChunk;  // G gl2 of the chunk's keys
      qf_ds<kGate>(p, s, dp, rowv + 16 * warp + g, Gk, seq_tok0 + int64_t(c) * kChunk, hq, t4, sl2, rs);
    };
    // dPS_sb += qt_sb^T gbar over the tile's rows (qf_add_dps).
    auto add_dps = [&](int sb, float up) {
      qf_add_dps<T, K>(p.dps + (int64_t(ch.sfirst + sb) * p.H + h) * K * K, Qt, Gs, warp, wg, lane, up);
    };

    for (int sb = 0; sb < S; ++sb) {
      if (sb > 0) {
        // gbar staged in the input type, one power of two for the tile (Gs free: the last crossing read it).
        const float up = stage_tile_scaled<T, K>(gq, Gs, red);
        mbar_wait(qt_full, n_qt & 1);
        __syncthreads();  // Gs written by every warp
        add_dps(sb, up);
      } else {
        mbar_wait(qt_full, n_qt & 1);
      }
      ++n_qt;
      frags_from_sw128<K / 16>(qa, Qt, kQfRows, 16 * warp);  // qt_sb as the scores' A operand
      __syncthreads();  // every warp is done reading Qt
      if (threadIdx.x == 0 && sb + 1 < S) issue_qt(sb + 1);
      if (sb > 0) {
        // gbar <- gbar PS_sb^T, each row scaled into fp16's range first.
        ps.apply<K, true, true>(gq);
        if (threadIdx.x == 0 && n1 + sb < 2 * n1) issue_ps(n1 + sb);
      }
      // The superblock's key chunks (qf_chunks).
      const int c0 = sb * p.sc;
      auto wait_chunk = [&](int c) {  // thread 0 issues chunk c + 1 first
        if (threadIdx.x == 0 && c + 1 < nfc) issue_c(c + 1);
        __syncwarp();
        const uint32_t n = n_c + uint32_t(c);
        mbar_wait(&full[n % kQfStages], (n / kQfStages) & 1);
        fence_regs(s, dp, gq, dsa, qa);
        wg_fence();
      };
      qf_chunks<T, K>(p, c0, n_c, s, dp, gq, dsa, wait_chunk, issue_sdp, issue_gq, ds, release_c);
    }
    n_c += uint32_t(nfc);
    store_gbar<kGate, K>(p, tokq0, hq, rr, nq, t4, gq, rs);
  }
#endif
}

template <typename T, int K>
cudaError_t far_t(const KernelParams& p, const QfMaps& mp, int nitems, int grid, cudaStream_t s) {
  if (p.gate)
    return launch_with_smem(bwd_q_far_kernel<T, K, true>, dim3(unsigned(grid)), kQfThreads, QfSmem<K>::bytes, s, p,
                            mp, nitems);
  return launch_with_smem(bwd_q_far_kernel<T, K, false>, dim3(unsigned(grid)), kQfThreads, QfSmem<K>::bytes, s, p,
                          mp, nitems);
}

}  // namespace

bool bwd_q_far_usable(const KernelParams& p) {
  if (!p.path || (p.gate && !p.dgq) || p.deterministic || p.K != p.V || (p.K != 64 && p.K != 128)) return false;
  // v by TMA; dO's fragments are read with 32-bit loads.
  if (!tma_aligned(p.v, p.v_s) || reinterpret_cast<uintptr_t>(p.dout) % 4 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (p.do_s[d] % 2 != 0) return false;
  if (int64_t(p.B) * p.T >= (int64_t(1) << 31) || int64_t(p.B) * p.T * p.HQ * p.K >= (int64_t(1) << 40)) return false;
  return far_device_ok(QfSmem<128>::bytes);
}

size_t bwd_q_far_park_elems(int64_t park_slots, int K) { return size_t(park_slots) * kQfRows * K; }

cudaError_t launch_bwd_q_far(const KernelParams& p, const int32_t* tiles, int ntiles, const int32_t* park_first,
                             int64_t park_slots, int grid, int* next, int dtype, cudaStream_t s) {
  if (ntiles == 0) return cudaSuccess;
  const CUtensorMapDataType dt = dtype == 0 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  QfMaps mp{};
  mp.tiles = tiles;
  mp.next = next;
  mp.park_first = park_first;
  if (!map_tokens(&mp.ks, dt, p.ks, p.K, p.H, int64_t(p.B) * p.T, kChunk) ||
      !map_bthd(&mp.v, dt, p.v, p.v_s, p.V, p.H, p.T, p.B, kChunk) ||
      !map_matrix(&mp.park, dt, p.scratch, p.K, park_slots * kQfRows, kQfRows) ||
      !map_matrix(&mp.ps, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, p.ps, p.K, int64_t(p.nsuper) * p.H * p.K, p.K))
    return cudaErrorInvalidValue;
  const int nitems = ntiles * p.HQ;
  if (dtype == 0) return p.K == 64 ? far_t<__half, 64>(p, mp, nitems, grid, s) : far_t<__half, 128>(p, mp, nitems, grid, s);
  return p.K == 64 ? far_t<__nv_bfloat16, 64>(p, mp, nitems, grid, s)
                   : far_t<__nv_bfloat16, 128>(p, mp, nitems, grid, s);
}

}  // namespace pathattn::cuda
