// cuda/kernels/bwd_q_item.cuh: the per-item body of the query-side backward (BwdQ, one (query chunk, query
// head) item of a persistent CTA) and its shared memory; bwd_q.cu holds the kernel and its launchers.
#pragma once

#include "cuda/device/common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

constexpr int kBwdThreads = 128;  // 4 warps x 16 rows, as in the forward
// Floats of a CTA's colscr: the deterministic mode's gate column sums, 64 a warp and key chunk of a superblock.
__host__ __device__ constexpr size_t colscr_per_cta(int sc) { return size_t(kBwdThreads / 32) * sc * kChunk; }
static_assert(kBwdThreads == kTileThreads, "load_tile_async assumes the scan kernels' block size");

// Deterministic mode's tickets: `ticket` counts the adds done into one sum; the CTA's item is the rank-th.
__device__ __forceinline__ void ticket_wait(const int* ticket, int rank) {
  if (threadIdx.x == 0) {
    for (uint32_t spins = 0;; ++spins) {
      int v;
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ticket) : "memory");
      if (v == rank) break;
      if (spins > (1u << 26)) __trap();  // a miscounted ticket: an error, not a hang
      __nanosleep(100);
    }
  }
  __syncthreads();
}
__device__ __forceinline__ void ticket_pass(int* ticket, int rank) {
  __syncthreads();  // every thread's adds are issued
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(ticket), "r"(rank + 1) : "memory");
  }
}

template <int K, int V>
struct BwdQSmem {
  static constexpr int LK = K + 8, LV = V + 8, LX = kChunk + 4;
  // Qh [64][LK] (fp16, converted in place to the input type for the scores); the key / value region, Ks
  // [64][LK] and Vs [64][LV], or gb [64][LK] fp16; Ws, W2s [64][LK] fp16 (a K x K superblock product; the
  // diagonal's dXs [64][LX] f32; for V <= K, far key chunks' second Ks / Vs buffer); dOs [64][LV]; 5 x 64 f32
  // and the 4 warps' maxima of gbar.
  static constexpr size_t kv_bytes = size_t(kChunk) * (LK + LV) * 2, gb_bytes = size_t(kChunk) * LK * 2;
  static constexpr size_t region = kv_bytes > gb_bytes ? kv_bytes : gb_bytes;
  static constexpr size_t base = size_t(kChunk) * (3 * LK + LV) * 2 + region + 5 * kChunk * 4 + 4 * 4;
  // With pf, two more [64][LK] tiles in front of Qh: Qn, where pass 2's own superblock loads the next step's query
  // snapshot, and Qc, its score operand (BwdQ::run). Only where K = 64's three CTAs an SM still fit: 228 KB an SM,
  // 1 KB of it reserved a CTA, leaves 75 KB a CTA, less the kernel's static bytes (74 KB leaves room). K = V = 64
  // takes 55.25 + 18 = 73.25 KB; K = 64, V = 128 would take 71.25 + 18 and keeps the single snapshot.
  static constexpr size_t pf_bytes = size_t(kChunk) * 2 * LK * 2;
  static constexpr bool pf = K == 64 && base + pf_bytes <= size_t(74) * 1024;
  static constexpr size_t bytes = base + (pf ? pf_bytes : 0);
  static_assert(size_t(kChunk) * LX * 4 <= size_t(kChunk) * 2 * LK * 2, "dXs must fit over Ws, W2s");
  static_assert(gb_bytes <= size_t(kChunk) * 2 * LK * 2, "gb must fit over two [64][LK] tiles");
};

// kDetCols: the deterministic mode's gate column sums (ordered adds; a variant of its own, so that the default
// mode's register allocation is not touched). kPlain: plain attention (p.path false), which reads q itself for
// its query state (load_qstate).
template <typename T, int K, int V, bool kDetCols, bool kPlain>
struct BwdQ {
  using S = BwdQSmem<K, V>;
  static constexpr int LK = S::LK, LV = S::LV, LX = S::LX;
  __half *Qh, *Ws, *W2s, *Qn, *Qc, *gb;
  T *Ks, *Vs, *dOs;
  float *dXs, *Gk, *Gk2, *lse2, *del, *dga, *gmx;

  __device__ void carve(uint8_t* smem) {
    if constexpr (S::pf) {
      Qn = reinterpret_cast<__half*>(smem);
      Qc = Qn + kChunk * LK;
      smem += S::pf_bytes;
    }
    Qh = reinterpret_cast<__half*>(smem);
    uint8_t* kv = smem + size_t(kChunk) * LK * 2;
    Ks = reinterpret_cast<T*>(kv);
    Vs = Ks + kChunk * LK;
    gb = reinterpret_cast<__half*>(kv);
    Ws = reinterpret_cast<__half*>(kv + S::region);
    W2s = Ws + kChunk * LK;
    dXs = reinterpret_cast<float*>(Ws);
    dOs = reinterpret_cast<T*>(W2s + kChunk * LK);
    Gk = reinterpret_cast<float*>(dOs + kChunk * LV);
    Gk2 = Gk + kChunk;
    lse2 = Gk2 + kChunk;
    del = lse2 + kChunk;
    dga = del + kChunk;
    gmx = dga + kChunk;
  }

  // One (chunk ci, query head hq) item: BwdQItem's phases in order.
  __device__ void run(const KernelParams& p, int ci, int hq, __half* scratch);
};

// One item of BwdQ: its coordinates and its phases as member functions. The tiles are BwdQ's pointers, by
// reference (read where used, as before the split); the arrays are BwdQ::run's.
template <typename T, int K, int V, bool kDetCols, bool kPlain>
struct BwdQItem {
  using S = BwdQSmem<K, V>;
  static constexpr int LK = S::LK, LV = S::LV, LX = S::LX;
  static constexpr float LOG2E = 1.4426950408889634f;
  // Pass 1's W, W2 tiles: with kPf1 (the key / value region holds two such tiles, free until the diagonal chunk)
  // they alternate between (Ws, W2s) and that region, the next step's loading while this one runs.
  static constexpr bool kPf1 = S::region >= 2 * size_t(kChunk) * LK * 2;
  const KernelParams& p;
  __half* const scratch;  // this CTA's parked query states
  __half *const &Qh, *const &Ws, *const &W2s, *const &Qn, *const &Qc, *const &gb;
  T *const &Ks, *const &Vs, *const &dOs;
  float *const &dXs, *const &Gk, *const &Gk2, *const &lse2, *const &del, *const &dga, *const &gmx;
  // The item (begin), pass 1's chain bounds (run), pass 2's sums and tickets (begin_pass2).
  ChunkDesc ch;
  int hq, h, qc, nq, warp, lane, g, t4, sbq, first, nc, hr_in_group;
  int64_t seq_tok0, tokq0, posq0;
  float sl2, gl2, gs;
  const T *vp, *ktp, *dop;
  float *dPbase, *colscr;
  int *tk_p, *tk_ps, *tk_cols;
  // Arrays in run's frame (a struct holding them with the scalars kept those in memory longer: other code):
  // this thread's rows, the gate row sums of dS (its entries), gbar (this warp's rows).
  int (&rr)[2];
  float (&rs)[2], (&gq)[K / 8][4];

  __device__ __forceinline__ BwdQItem(const BwdQ<T, K, V, kDetCols, kPlain>& t, const KernelParams& kp,
                                      __half* scratch_cta, int (&rows)[2], float (&rsum)[2], float (&gbar)[K / 8][4])
      : p(kp), scratch(scratch_cta), Qh(t.Qh), Ws(t.Ws), W2s(t.W2s), Qn(t.Qn), Qc(t.Qc), gb(t.gb), Ks(t.Ks),
        Vs(t.Vs), dOs(t.dOs), dXs(t.dXs), Gk(t.Gk), Gk2(t.Gk2), lse2(t.lse2), del(t.del), dga(t.dga), gmx(t.gmx),
        rr(rows), rs(rsum), gq(gbar) {}

  // The item's coordinates: chunk ci of the table, query head item_hq (and its kv head h), this thread's rows.
  __device__ __forceinline__ void begin(int ci, int item_hq) {
    ch = p.chunks[ci];
    hq = item_hq;
    h = hq / p.group, qc = ch.c, nq = min(kChunk, ch.len - qc * kChunk);
    seq_tok0 = ch.b * p.T + ch.t0, tokq0 = seq_tok0 + int64_t(qc) * kChunk;
    posq0 = ch.t0 + int64_t(qc) * kChunk;
    warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    rr[0] = 16 * warp + g;
    rr[1] = 16 * warp + g + 8;
    sl2 = p.scale * LOG2E, gl2 = p.gate ? p.gate_scale * LOG2E : 0.f;
    gs = p.gate ? p.gate_scale : 0.f;
    vp = static_cast<const T*>(p.v);
    ktp = static_cast<const T*>(p.kt);
    dop = static_cast<const T*>(p.dout);
  }

  // Pass 1 in the own superblock: this warp's rows of q~ into qt (and, last reader, q~ back into qtl in type T),
  // then the chunk steps right to left down to chunk `first`, each state parked.
  __device__ __forceinline__ void pass1_own(float (&qt)[K / 8][4]) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int r = rr[hr];
      const __half* src = p.qtl + ((tokq0 + r) * p.HQ + hq) * K;
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt) {
        float2 v2 =
            r < nq ? load_qstate<T, kPlain>(p, src, ch.b, posq0 + r, hq, 8 * nt + 2 * t4) : make_float2(0.f, 0.f);
        qt[nt][2 * hr] = v2.x;
        qt[nt][2 * hr + 1] = v2.y;
      }
    }
    if (p.qfar != 1) {  // the last reader of these rows: q~ in dtype T into their first halves, for bwd_k
      __syncwarp();     // (a row's four lanes have read it)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        if (rr[hr] >= nq) continue;
        T* dst = reinterpret_cast<T*>(p.qtl + ((tokq0 + rr[hr]) * p.HQ + hq) * K);
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt)
          *reinterpret_cast<uint32_t*>(dst + 8 * nt + 2 * t4) = Pack2<T>::pack(qt[nt][2 * hr], qt[nt][2 * hr + 1]);
      }
    }
    __half* const kvh = reinterpret_cast<__half*>(Ks);
    // The last step's chunk: none past chunk 0; with p.qfar == 2 none across chunk `first` either (that step
    // gives qhat, which the qfar == 1 launch wrote and this launch does not use).
    const int kc_end = p.qfar == 2 ? first + 1 : (first > 1 ? first : 1);
    if (kPf1 && qc - 1 >= kc_end) issue_w(qc - 1, 0);
    for (int kc = qc - 1; kc >= first; --kc) {
      if (p.qfar != 1) park(qt, kc - first);
      if (kc < kc_end) break;
      const int b = kPf1 ? (qc - 1 - kc) & 1 : 0;
      __syncthreads();  // the step before is done with the other buffer (or, without kPf1, this one)
      if (!kPf1) issue_w(kc, 0);
      if (kPf1 && kc - 1 >= kc_end) {
        issue_w(kc - 1, b ^ 1);
        cp_async_wait_group<1>();
      } else {
        cp_async_wait_all();
      }
      __syncthreads();
      const __half* w_s = b ? kvh : Ws;
      const __half* w2_s = b ? kvh + kChunk * LK : W2s;
      float x[8][4];
      zero_acc(x);
      warp_mma_rs<__half, K / 16, 8, false>(x, qt, 1.f, w_s, LK, 0);
      warp_mma_rs<__half, 4, K / 8, true>(qt, x, -1.f, w2_s, LK, 0);
    }
  }
  __device__ __forceinline__ void park(const float (&qt)[K / 8][4], int slot) {  // qt into parking slot `slot`
    store_tile<__half, K>(scratch + size_t(slot) * kChunk * K, K, qt);
  }
  // Chunk kc's W, W2 tiles into (Ws, W2s) (b = 0) or the key / value region (b = 1; kPf1), committed.
  __device__ __forceinline__ void issue_w(int kc, int b) {
    __half* const kvh = reinterpret_cast<__half*>(Ks);
    load_chunk_w_async<K>(p, seq_tok0 + int64_t(kc) * kChunk, h, b ? kvh : Ws, b ? kvh + kChunk * LK : W2s);
  }

  // Pass 1 across the earlier superblocks: qhat (with p.kfuse dqt's rows zeroed), then qt_sb parked for each
  // superblock sb = sbq - 1 .. 0 (only with p.qfar == 0: bwd_q_far takes them otherwise).
  __device__ __forceinline__ void pass1_far(float (&qt)[K / 8][4]) {
    T* qh = static_cast<T*>(p.qhat);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      if (rr[hr] >= nq) continue;
      T* dst = qh + ((tokq0 + rr[hr]) * p.HQ + hq) * K;
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt)
        *reinterpret_cast<uint32_t*>(dst + 8 * nt + 2 * t4) = Pack2<T>::pack(qt[nt][2 * hr], qt[nt][2 * hr + 1]);
      if (p.kfuse) {  // dqt's rows start at zero: bwd_k_far adds the far pairs' dS kt into them
        float* dz = p.dqt + ((tokq0 + rr[hr]) * p.HQ + hq) * K;
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt) *reinterpret_cast<float2*>(dz + 8 * nt + 2 * t4) = make_float2(0.f, 0.f);
      }
    }
    for (int sb = sbq - 1; sb >= 0 && p.qfar == 0; --sb) {
      park(qt, p.sc + sb);
      if (sb == 0) break;
      __syncthreads();
      const __half* ps = p.ps + (int64_t(ch.sfirst + sb) * p.H + h) * K * K;
      for (int r0 = 0; r0 < K; r0 += kChunk) load_tile_async<K>(Ws + r0 * LK, ps + r0 * K, K, kChunk);
      cp_async_commit();
      cp_async_wait_all();
      __syncthreads();
      float y[K / 8][4];
      zero_acc(y);
      warp_mma_rs<__half, K / 16, K / 8, true>(y, qt, 1.f, Ws, LK, 0);  // qt <- qt PS_sb
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) qt[nt][e] = y[nt][e];
    }
  }

  // The diagonal's inputs: dO and v tiles, A_loc's rows, and per row the exponent's bias, delta and gate term.
  __device__ __forceinline__ void diagonal_rows() {
    __syncthreads();
    load_tile_async<V>(dOs, dop + ch.b * p.do_s[0] + posq0 * p.do_s[1] + hq * p.do_s[2], p.do_s[1], nq);
    load_tile_async<V>(Vs, vp + ch.b * p.v_s[0] + posq0 * p.v_s[1] + h * p.v_s[2], p.v_s[1], nq);
    // A_loc's rows (64 fp32 = 128 2-byte words; dXs' row pitch LX = 68 floats is that tile's K + 8 words),
    // staged where dS will be written: each thread reads and then overwrites its own entries.
    load_tile_async<2 * kChunk>(reinterpret_cast<__half*>(dXs),
                                reinterpret_cast<const __half*>(p.aloc + (tokq0 * p.HQ + hq) * kChunk),
                                int64_t(p.HQ) * kChunk * 2, nq);
    cp_async_commit();
    for (int r = threadIdx.x; r < kChunk; r += blockDim.x) {
      const bool ok = r < nq;
      const int64_t pos = posq0 + r;
      // Row bias of the exponent, lse - G_q (base 2); +inf past the sequence: P = 2^-inf = 0 there.
      const float gq_r = (p.gate && ok) ? p.G[(tokq0 + r) * p.HQ + hq] * gl2 : 0.f;
      lse2[r] = ok ? p.lse[ch.b * p.lse_s[0] + pos * p.lse_s[1] + hq * p.lse_s[2]] * LOG2E - gq_r : INFINITY;
      del[r] = ok ? p.delta[(tokq0 + r) * p.HQ + hq] : 0.f;
      Gk[r] = gq_r;
    }
    cp_async_wait_all();
    __syncthreads();
  }

  // The diagonal chunk: P from A_loc, dA_loc = scale dS (over A_loc), dv_diag = P^T dO, the gate's diagonal terms.
  __device__ __forceinline__ void diagonal() {
    float pr[8][4], dp[1][8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = rr[e >> 1], c = 8 * nt + 2 * t4 + (e & 1);
        float v = 0.f;
        if (r < nq && c <= r) v = fast_exp2(dXs[r * LX + c] * sl2 - Gk[c] - lse2[r]);
        pr[nt][e] = v;
      }
    zero_acc(dp);
    warp_mma_ss<T, 1, 8, false, false>(dp, dOs, LV, 16 * warp, Vs, LV, 0, V);
    T* Ps = Ks;  // [64][64 + 8] staging of P for dv_diag (Ks is free until pass 2)
    constexpr int LP = kChunk + 8;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {  // column pairs c, c + 1: one store each
        const int r = rr[hr], c = 8 * nt + 2 * t4;
        // Masked by selection, not by P's zeros: a non-finite v at a later row makes dP NaN in its column.
        const float ds0 = c <= r ? pr[nt][2 * hr] * (dp[0][nt][2 * hr] - del[r]) : 0.f;
        const float ds1 = c + 1 <= r ? pr[nt][2 * hr + 1] * (dp[0][nt][2 * hr + 1] - del[r]) : 0.f;
        *reinterpret_cast<float2*>(dXs + r * LX + c) = make_float2(ds0, ds1);
        *reinterpret_cast<uint32_t*>(Ps + r * LP + c) = Pack2<T>::pack(pr[nt][2 * hr], pr[nt][2 * hr + 1]);
        if (r < nq)
          *reinterpret_cast<float2*>(p.aloc + ((tokq0 + r) * p.HQ + hq) * kChunk + c) =
              make_float2(p.scale * ds0, p.scale * ds1);
      }
    __syncthreads();
    // dv_diag = P^T dO: warp w takes keys 16w..16w+15. With kfuse and MHA, bwd_k_far ran first and stored the
    // far part of dv into these rows where the sequence goes on past their superblock: added to it.
    const bool dv_on_far = p.kfuse && p.dvk_merged() && ((ch.len + kChunk - 1) / kChunk - 1) / p.sc > qc / p.sc;
    float dv[1][V / 8][4];
    zero_acc(dv);
    warp_mma_ss<T, 1, V / 8, true, true>(dv, Ps, LP, 16 * warp, dOs, LV, 0, kChunk);
    // Added by 16-byte reductions (no load whose latency the item would wait for; a lane pair's four columns of
    // one row an operation): nearly as fast as plain stores, clearly faster than 8-byte reductions.
    if (dv_on_far) {
#pragma unroll
      for (int nt = 0; nt < V / 8; ++nt)
        red_add_frag_v4<true>(p.dvdiag + (tokq0 * p.HQ + hq) * V, p.HQ * V, 16 * warp, 8 * nt, dv[0][nt], 1.f, nq);
    } else {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int j = rr[hr];
        if (j >= nq) continue;
        float* dst = p.dvdiag + ((tokq0 + j) * p.HQ + hq) * V;
#pragma unroll
        for (int nt = 0; nt < V / 8; ++nt)
          *reinterpret_cast<float2*>(dst + 8 * nt + 2 * t4) = make_float2(dv[0][nt][2 * hr], dv[0][nt][2 * hr + 1]);
      }
    }
    // Gate terms of the diagonal: + row sums, - column sums (fixed order: deterministic). Read with the gate only.
    if (p.gate && threadIdx.x < kChunk) {
      const int r = threadIdx.x;
      float a = 0.f, b = 0.f;
      for (int c = 0; c < kChunk; ++c) {
        a += dXs[r * LX + c];
        b += dXs[c * LX + r];
      }
      dga[r] = gs * (a - b);
    }
  }

  // Pass 2's sums and tickets, gbar zeroed. Deterministic order: the items adding into one sum are the later
  // chunks of the sequence that reach it, each with the group's query heads, taken in the item order (chunks
  // descending, heads ascending).
  __device__ __forceinline__ void begin_pass2() {
    dPbase = p.dP + (int64_t(ch.first) * p.H + h) * K * K;
    nc = (ch.len + kChunk - 1) / kChunk, hr_in_group = hq - h * p.group;
    tk_p = p.tickets ? p.tickets + int64_t(ch.first) * p.H + h : nullptr;
    tk_ps = p.tickets ? p.tickets + int64_t(p.nchunks + ch.sfirst) * p.H + h : nullptr;
    zero_acc(gq);
    // kDetCols (deterministic mode with p.dgq): the gate column sums go into dgcol (the own superblock's key
    // chunks) and dgcolf (far superblocks, whose chunks the later superblocks' items score) in a fixed order
    // (scores, flush_cols).
    colscr = kDetCols ? p.colscr + blockIdx.x * colscr_per_cta(p.sc) : nullptr;
    tk_cols = kDetCols ? p.tickets + int64_t(p.nchunks + p.nsuper) * p.H + 1 : nullptr;
  }
  __device__ __forceinline__ int rank_after(int last) const { return (last - qc) * p.group + hr_in_group; }

  // gbar is staged for the outer products in fp16 with one power of two for the 64-row tile (its largest entry
  // into [0.5, 1)), as bwd_q_far stages it: rows far below the tile's largest lose relative precision, but their
  // terms' errors stay below the largest rows' rounding. gbar_max (before the barrier that precedes stage_gbar,
  // once gq is final) leaves this warp's largest |entry| in gmx; stage_gbar writes gq (own rows) into Gs
  // ([64][LK] fp16) and returns the factor that undoes the scale; callers sync before other warps read Gs.
  __device__ __forceinline__ void gbar_max() {
    const float mx = warp_abs_max(gq);
    if (lane == 0) gmx[warp] = mx;
  }
  __device__ __forceinline__ float stage_gbar(__half* Gs) {
    const float mx = fmaxf(fmaxf(gmx[0], gmx[1]), fmaxf(gmx[2], gmx[3]));
    const int ex = scale_exp(mx);
    const float down = ldexpf(1.f, -ex);
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
        *reinterpret_cast<uint32_t*>(Gs + rr[hr] * LK + 8 * nt + 2 * t4) =
            Pack2<__half>::pack(gq[nt][2 * hr] * down, gq[nt][2 * hr + 1] * down);
    return ldexpf(1.f, ex);
  }
  // dst += Qs^T Gs (query snapshot, staged gbar; K x K; warp w owns rows [w K/4, (w+1) K/4)): vector reductions
  // (sm_90; scalar atomics elsewhere), or, in deterministic mode, plain adds (through L2) once `ticket` says the
  // rank earlier items have added theirs.
  __device__ __forceinline__ void add_outer(const __half* Qs, const __half* Gs, float up, float* dst_base,
                                            int* ticket, int rank) {
    constexpr int MT = K / 64;
    if (p.deterministic) ticket_wait(ticket, rank);
#pragma unroll
    for (int n0 = 0; n0 < K; n0 += 64) {
      float d[MT][8][4];
      zero_acc(d);
      warp_mma_ss<__half, MT, 8, true, true>(d, Qs, LK, warp * 16 * MT, Gs, LK, n0, kChunk);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int a0 = warp * 16 * MT + 16 * mt, b0 = n0 + 8 * nt;
          if (p.deterministic) {
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
              float* dst = dst_base + (a0 + g + 8 * (e >> 1)) * K + b0 + 2 * t4;
              const float2 o = __ldcg(reinterpret_cast<const float2*>(dst));
              __stcg(reinterpret_cast<float2*>(dst), make_float2(o.x + d[mt][nt][e] * up, o.y + d[mt][nt][e + 1] * up));
            }
          } else {
            red_add_frag_v4(dst_base, K, a0, b0, d[mt][nt], up);  // (sm_90: four columns of one row per lane)
          }
        }
    }
    if (p.deterministic) ticket_pass(ticket, rank);
  }
  // Qs (fp16 snapshot) as the score operand in the input type at Qd: in place (Qd = Qs: nothing to do for fp16
  // input) or into another tile (each thread its own elements). Callers sync before (the outer product has read
  // Qs) and after (before the scores).
  __device__ __forceinline__ const T* score_operand(const __half* Qs, __half* Qd) {
    if (!IsHalf<T>::value || Qd != Qs) {
      for (int idx = threadIdx.x; idx < kChunk * (K / 8); idx += blockDim.x) {  // 8 elements (16 bytes) a step
        const int r = idx / (K / 8), d = 8 * (idx % (K / 8));
        uint4 u = *reinterpret_cast<const uint4*>(Qs + r * LK + d);
        if constexpr (!IsHalf<T>::value) {
          uint32_t* w = reinterpret_cast<uint32_t*>(&u);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
            w[i] = Pack2<T>::pack(f.x, f.y);
          }
        }
        *reinterpret_cast<uint4*>(Qd + r * LK + d) = u;
      }
    }
    return reinterpret_cast<const T*>(Qd);
  }
  // kDetCols: scores() leaves each warp's column sums of a key chunk kc (its 16 rows, by shuffles) in this CTA's
  // colscr, slot kc % sc; flush_cols adds `n` slots' sums, the warps' in order, to the key tokens from ktok0 on once
  // the earlier items of this sequence and query head (the later query chunks, which all score these keys) have
  // added theirs: a ticket per (key chunk, query head) for dgcol, per (superblock, query head) for dgcolf.
  __device__ __forceinline__ void flush_cols(float* dst, int64_t ktok0, int slot0, int n, int* ticket, int rank) {
    ticket_wait(ticket, rank);  // (a block barrier: every warp's sums are in colscr)
    for (int c = threadIdx.x; c < n * kChunk; c += kBwdThreads) {
      float v = 0.f;
      for (int w = 0; w < kBwdThreads / 32; ++w) v += colscr[(w * p.sc + slot0) * kChunk + c];
      float* d = dst + (ktok0 + c) * p.HQ + hq;
      __stcg(d, __ldcg(d) - gs * v);
    }
    ticket_pass(ticket, rank);
  }
  // One key chunk (tiles Kb, Vb, gate column terms Gb) against the query tile Qop: ds = P * (dP - delta),
  // gate row sums and, with p.dgq, the gate column sums of key tokens ktok.. (atomics into dgcol, or with
  // kDetCols into colscr, for flush_cols).
  __device__ __forceinline__ void scores(const T* Qop, const T* Kb, const T* Vb, const float* Gb, float (&ds)[8][4],
                                         int64_t ktok) {
    float s[1][8][4], dp[1][8][4];
    zero_acc(s);
    zero_acc(dp);
    warp_mma_ss<T, 1, 8, false, false>(s, Qop, LK, 16 * warp, Kb, LK, 0, K);
    warp_mma_ss<T, 1, 8, false, false>(dp, dOs, LV, 16 * warp, Vb, LV, 0, V);
    const float rb[2] = {lse2[rr[0]], lse2[rr[1]]}, dl[2] = {del[rr[0]], del[rr[1]]};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * nt + 2 * t4 + (e & 1);
        const float x = s[0][nt][e] * sl2 - rb[e >> 1];
        const float pr = fast_exp2(p.gate ? x - Gb[c] : x);  // rows past the sequence: rb = inf, pr = 0
        ds[nt][e] = pr * (dp[0][nt][e] - dl[e >> 1]);
        rs[e >> 1] += ds[nt][e];
      }
    if constexpr (kDetCols) {
      float cs[8][2];
      warp_col_sums(ds, cs);
      const int slot = int((ktok - seq_tok0) / kChunk) % p.sc;
      if (lane < 4)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) colscr[(warp * p.sc + slot) * kChunk + 8 * nt + 2 * t4 + j] = cs[nt][j];
    } else {
      if (p.dgq) warp_add_col_sums(ds, p.dgcol + hq, ktok, p.HQ, -gs);
    }
  }
  __device__ __forceinline__ void add_local(const float (&ds)[8][4], const T* Kb) {  // gbar += scale dS keys
    warp_mma_rs<T, 4, K / 8, true>(gq, ds, p.scale, Kb, LK, 0);
  }
  // The query snapshot of the own superblock's chunk kc (pass 1's slot kc - first) into dst (cp.async, uncommitted).
  __device__ __forceinline__ void load_qt(int kc, __half* dst) {
    load_tile_async<K>(dst, scratch + size_t(kc - first) * kChunk * K, K, kChunk);
  }
  // Key chunk kc's key / value tiles into Kb, Vb (cp.async, not committed).
  __device__ __forceinline__ void load_kv(const T* keys, int kc, T* Kb, T* Vb) {
    const int64_t tok = seq_tok0 + int64_t(kc) * kChunk, pos = ch.t0 + int64_t(kc) * kChunk;
    load_tile_async<K>(Kb, keys + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk);
    load_tile_async<V>(Vb, vp + ch.b * p.v_s[0] + pos * p.v_s[1] + h * p.v_s[2], p.v_s[1], kChunk);
  }
  // Key chunk kc's tiles (cp.async, not committed) and gate column terms into Kb, Vb, Gb.
  __device__ __forceinline__ void load_keys(const T* keys, int kc, T* Kb, T* Vb, float* Gb) {
    const int64_t tok = seq_tok0 + int64_t(kc) * kChunk;
    load_kv(keys, kc, Kb, Vb);
    for (int j = threadIdx.x; j < kChunk; j += blockDim.x) Gb[j] = p.gate ? p.G[(tok + j) * p.HQ + hq] * gl2 : 0.f;
  }

  // The far superblocks' part from bwd_q_far (p.qfar == 2): gbar at the own superblock's start, from dqt.
  __device__ __forceinline__ void far_from_dqt() {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float* src = p.dqt + ((tokq0 + rr[hr]) * p.HQ + hq) * K;
#pragma unroll
      for (int nt = 0; nt < K / 8; ++nt) {
        const float2 x = rr[hr] < nq ? *reinterpret_cast<const float2*>(src + 8 * nt + 2 * t4) : make_float2(0.f, 0.f);
        gq[nt][2 * hr] = x.x;
        gq[nt][2 * hr + 1] = x.y;
      }
    }
  }

  // Pass 2 over the far superblocks sb = 0 .. sbq - 1: across each (sb > 0) dPS_sb and gbar's dense step, then
  // the superblock's key chunks (keys moved to its end) scored against qt_sb.
  __device__ __forceinline__ void far_superblocks() {
    const T* ksp = static_cast<const T*>(p.ks);
    float* dPSbase = p.dps + (int64_t(ch.sfirst) * p.H + h) * K * K;
    for (int sb = 0; sb < sbq; ++sb) {
      gbar_max();
      __syncthreads();
      const float up = sb > 0 ? stage_gbar(gb) : 1.f;
      load_tile_async<K>(Qh, scratch + size_t(p.sc + sb) * kChunk * K, K, kChunk);
      if (sb > 0) {
        const __half* ps = p.ps + (int64_t(ch.sfirst + sb) * p.H + h) * K * K;
        for (int r0 = 0; r0 < K; r0 += kChunk) load_tile_async<K>(Ws + r0 * LK, ps + r0 * K, K, kChunk);
      }
      cp_async_commit();
      cp_async_wait_all();
      __syncthreads();
      if (sb > 0) {
        // Across superblock sb (qt_{sb-1} = qt_sb PS_sb): dPS_sb += qt_sb^T gbar, gbar <- gbar PS_sb^T.
        add_outer(Qh, gb, up, dPSbase + int64_t(sb) * p.H * K * K, tk_ps ? tk_ps + int64_t(sb) * p.H : nullptr,
                  rank_after(nc - 1));
        warp_ps_step<K, false>(gq, Ws, LK);
        __syncthreads();  // gb (under Ks / Vs) and Qh read by every warp
      }
      const T* Qop = score_operand(Qh, Qh);
      if constexpr (V <= K) {
        // Double-buffered: chunk j + 1 loads (into Ks / Vs or over Ws / W2s, free after the superblock
        // step) while chunk j is scored.
        // Buffer st: Ks / Vs / Gk (0) or Ws / W2s / Gk2 (1), selected by value (no indexed local arrays).
        auto kbuf = [&](int st) { return st ? reinterpret_cast<T*>(Ws) : Ks; };
        auto vbuf = [&](int st) { return st ? reinterpret_cast<T*>(W2s) : Vs; };
        auto gbuf = [&](int st) { return st ? Gk2 : Gk; };
        __syncthreads();
        load_keys(ksp, sb * p.sc, Ks, Vs, Gk);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        for (int j = 0; j < p.sc; ++j) {
          const int cur = j & 1;
          if (j + 1 < p.sc) {
            load_keys(ksp, sb * p.sc + j + 1, kbuf(cur ^ 1), vbuf(cur ^ 1), gbuf(cur ^ 1));
            cp_async_commit();
          }
          float ds[8][4];
          scores(Qop, kbuf(cur), vbuf(cur), gbuf(cur), ds, seq_tok0 + int64_t(sb * p.sc + j) * kChunk);
          add_local(ds, kbuf(cur));
          cp_async_wait_all();
          __syncthreads();
        }
      } else {
        for (int j = 0; j < p.sc; ++j) {
          __syncthreads();
          load_keys(ksp, sb * p.sc + j, Ks, Vs, Gk);
          cp_async_commit();
          cp_async_wait_all();
          __syncthreads();
          float ds[8][4];
          scores(Qop, Ks, Vs, Gk, ds, seq_tok0 + int64_t(sb * p.sc + j) * kChunk);
          add_local(ds, Ks);
        }
      }
      if constexpr (kDetCols)  // adders: every later superblock's items
        flush_cols(p.dgcolf, seq_tok0 + int64_t(sb) * p.sc * kChunk, 0, p.sc,
                   tk_cols + int64_t(p.nchunks + ch.sfirst + sb) * p.HQ + hq, nc - 1 - qc);
    }
  }

  // The own superblock's chunks. Without S::pf each step loads its tiles when their buffers free up and waits for
  // them at once, twice a step. With S::pf the query snapshot comes into Qn, which the outer product and the
  // conversion (into Qc) are done with at the barrier before the scores: the next step's snapshot loads from
  // there on, under the scores, the chain step and the local add. gbar is staged over Qc (Qh is unused
  // here), so the keys, values, W and W2 (single buffers: the step before reads them to its end) load from the
  // step's start on, under the outer product and the conversion; the gate terms come through a register. Every
  // tile keeps a fixed address and the first snapshot loads at its step's start: at 168 registers, alternating
  // buffers or loading that snapshot under the diagonal made ptxas spill.
  __device__ __forceinline__ void own_chunks() {
    for (int kc = first; kc < qc; ++kc) {
      const int64_t tok = seq_tok0 + int64_t(kc) * kChunk;
      __half* const Qs = S::pf ? Qn : Qh;
      __half* const Gs = S::pf ? Qc : gb;
      gbar_max();
      __syncthreads();
      float g_raw = 0.f;  // with S::pf, this thread's gate term of chunk kc, stored once the outer product is done
      if constexpr (S::pf) {
        if (kc == first) {  // the later steps' snapshots load during the step before
          load_qt(kc, Qn);
          cp_async_commit();
        }
        load_kv(ktp, kc, Ks, Vs);
        commit_with_w(kc, tok);  // one group with the keys and values
        if (p.gate && threadIdx.x < kChunk) g_raw = p.G[(tok + threadIdx.x) * p.HQ + hq];
      }
      const float up = kc > 0 ? stage_gbar(Gs) : 1.f;
      if constexpr (S::pf) {
        cp_async_wait_group<1>();  // the snapshot; the keys, values, W, W2 may be in flight
      } else {
        load_qt(kc, Qh);
        commit_with_w(kc, tok);
        cp_async_wait_all();
      }
      __syncthreads();
      // Across chunk kc: dP_kc += qt_kc^T gbar (before gbar's step below).
      if (kc > 0)
        add_outer(Qs, Gs, up, dPbase + int64_t(kc) * p.H * K * K, tk_p ? tk_p + int64_t(kc) * p.H : nullptr,
                  rank_after(p.path ? min(kc / p.sc * p.sc + p.sc - 1, nc - 1) : nc - 1));
      __syncthreads();  // Gs (gb under Ks / Vs, or over Qc, Qh) and Qs read by every warp
      if constexpr (!S::pf) {
        load_keys(ktp, kc, Ks, Vs, Gk);
        cp_async_commit();
      }
      const T* Qop = score_operand(Qs, S::pf ? Qc : Qs);
      if constexpr (S::pf) {
        if (threadIdx.x < kChunk) Gk[threadIdx.x] = p.gate ? g_raw * gl2 : 0.f;  // as load_keys
      }
      cp_async_wait_all();
      __syncthreads();
      if constexpr (S::pf) {
        if (kc + 1 < qc) {
          load_qt(kc + 1, Qn);
          cp_async_commit();
        }
      }
      float ds[8][4];
      scores(Qop, Ks, Vs, Gk, ds, tok);
      if (kc > 0) {
        warp_chunk_step<K>(gq, W2s, Ws, LK);  // gbar <- gbar P_kc^T = gbar - (gbar W2^T) W
      }
      add_local(ds, Ks);
      if constexpr (kDetCols)  // adders: the later chunks of the own superblock (of the sequence without PaTH)
        flush_cols(p.dgcol, tok, kc % p.sc, 1, tk_cols + int64_t(ch.first + kc) * p.HQ + hq,
                   (p.path ? min(first + p.sc - 1, nc - 1) : nc - 1) - qc);
    }
  }
  // Commits the loads in flight together with chunk kc's W and W2 tiles (none for chunk 0: nothing to cross).
  __device__ __forceinline__ void commit_with_w(int kc, int64_t tok) {
    if (kc > 0) load_chunk_w_async<K>(p, tok, h, Ws, W2s);
    else cp_async_commit();
  }

  // ---- outputs: dq~ = gbar, gate row terms (dga rows were written by other warps).
  __device__ __forceinline__ void store_outputs() {
    __syncthreads();
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float a = rs[hr];
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      a += __shfl_xor_sync(0xffffffffu, a, 2);
      const int r = rr[hr];
      if (r < nq) {
        float* dst = p.dqt + ((tokq0 + r) * p.HQ + hq) * K;
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt)
          *reinterpret_cast<float2*>(dst + 8 * nt + 2 * t4) = make_float2(gq[nt][2 * hr], gq[nt][2 * hr + 1]);
        if (t4 == 0 && p.gate) {  // after bwd_q_far (qfar = 2), which wrote the far part of the row
          float* dst_g = p.dgrow + (tokq0 + r) * p.HQ + hq;
          *dst_g = (first > 0 && p.qfar == 2 ? *dst_g : 0.f) + dga[r] + gs * a;
        }
      }
    }
  }
};

template <typename T, int K, int V, bool kDetCols, bool kPlain>
__device__ void BwdQ<T, K, V, kDetCols, kPlain>::run(const KernelParams& p, int ci, int hq, __half* scratch) {
  int rr[2];
  float qt[K / 8][4];  // pass 1's query state (this warp's rows)
  float rs[2], gq[K / 8][4];
  BwdQItem<T, K, V, kDetCols, kPlain> it(*this, p, scratch, rr, rs, gq);
  it.begin(ci, hq);
  __syncthreads();  // the previous item is done with shared memory
  // ---- pass 1: qt_kc for kc = qc-1 .. first into slot kc - first (fp16, [64][K]); then (two-level) qhat,
  // the queries at their superblock's start, and qt_sb at the end of each earlier superblock sb into
  // slot p.sc + sb (scratch_slot_count).
  it.sbq = it.qc / p.sc;
  it.first = p.path ? it.sbq * p.sc : 0;
  if (p.qfar == 1 && it.first == 0) return;  // qhat only: none here
  it.pass1_own(qt);
  if (it.first > 0 && p.qfar != 2) it.pass1_far(qt);
  if (p.qfar == 1) return;  // qhat written
  // ---- per-row data and the diagonal chunk.
  it.diagonal_rows();
  rs[0] = rs[1] = 0.f;
  it.diagonal();
  // ---- pass 2: key chunks left to right, transport adjoint. Far superblocks first (keys moved to their
  // superblock's end, one dense adjoint step per superblock), then the chunks of the query's own
  // superblock (one low-rank adjoint step per chunk).
  it.begin_pass2();
  if (it.first > 0 && p.qfar == 2) it.far_from_dqt();
  else if (it.first > 0) it.far_superblocks();
  it.own_chunks();
  it.store_outputs();
}

}  // namespace
}  // namespace pathattn::cuda
