// cuda/kernels/bwd_k.cu: the key-side backward pass. Per (key chunk kc, kv head h), all query heads of the group,
// two-level as the forward:
//   pass 1 (left to right) moves the chunk-end keys k~ across the later chunks of their superblock,
//          kt <- kt - (kt W2^T) W, then across whole later superblocks (kt <- kt PS_a^T), parking each state
//          (in the input type) in this CTA's scratch;
//   pass 2 (right to left) scores qhat . kt for the query chunks of later superblocks and q~ . kt for the own
//          superblock's, accumulating dv += P^T dO and the key adjoint h = sum_hq scale dS^T q + h PS_a (or
//          h P_qc); h at the own superblock's end is dks, and the chain ends with dk~; dv gets each query head's
//          diagonal part (bwd_q's dvdiag) before the store.
// With p.kfar, bwd_k_far.cu did the far superblocks: pass 1 stops at the own superblock's end and pass 2 starts
// from its h (dks) and dv. Every output row has one owner: deterministic. A warp owns 16 key rows, so h and dv
// stay in registers; about 105 KB of shared memory at K = V = 128: two CTAs an SM.
#include "cuda/device/common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

constexpr int kBwdThreads = 128;  // 4 warps x 16 key rows
static_assert(kBwdThreads == kTileThreads, "load_tile_async assumes the scan kernels' block size");

template <int K, int V>
struct BwdKSmem {
  static constexpr int LK = K + 8, LV = V + 8;
  // Ss, Qs, Ws, W2s [64][LK] (2-byte; Ws and W2s together hold a K x K superblock product, or the far
  // pipeline's second query and dO tiles); dOs, Vs
  // [64][LV]; 6 x 64 f32 (two stages of the per-query scalars).
  static constexpr size_t bytes = size_t(kChunk) * (4 * LK + 2 * LV) * 2 + 6 * kChunk * 4;
};

// This warp's rows rr of k~ (tokens tokk0.., kv head h) in the C layout, zero from row nk on.
template <typename T, int K>
__device__ __forceinline__ void load_key_rows(const T* ktp, int64_t tokk0, int H, int h, const int (&rr)[2], int nk,
                                              int t4, float (&kt)[K / 8][4]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = rr[hr];
    const T* src = ktp + ((tokk0 + r) * H + h) * K;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      const bool ok = r < nk;
      kt[nt][2 * hr] = ok ? to_f(src[8 * nt + 2 * t4]) : 0.f;
      kt[nt][2 * hr + 1] = ok ? to_f(src[8 * nt + 2 * t4 + 1]) : 0.f;
    }
  }
}

// h (from dks) and dv (from dvk unless merged into dvdiag) of rows rr: the far part bwd_k_far computed.
template <int K, int V>
__device__ __forceinline__ void load_far_part(const KernelParams& p, int64_t tokk0, int h, const int (&rr)[2], int t4,
                                              float (&hk)[K / 8][4], float (&dv)[V / 8][4]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t row = (tokk0 + rr[hr]) * p.H + h;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt) {
      const float2 x = *reinterpret_cast<const float2*>(p.dks + row * K + 8 * nt + 2 * t4);
      hk[nt][2 * hr] = x.x;
      hk[nt][2 * hr + 1] = x.y;
    }
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) {  // merged: the far part is in dvdiag, added below
      const float2 x = p.dvk_merged() ? make_float2(0.f, 0.f)
                                    : *reinterpret_cast<const float2*>(p.dvk + row * V + 8 * nt + 2 * t4);
      dv[nt][2 * hr] = x.x;
      dv[nt][2 * hr + 1] = x.y;
    }
  }
}

// dv of rows rr plus each query head's diagonal part (dvdiag), added in head order (deterministic), stored.
template <typename T, int V>
__device__ __forceinline__ void store_dv(const KernelParams& p, const ChunkDesc& ch, int64_t posk0, int64_t tokk0,
                                         int h, const int (&rr)[2], int nk, int t4, float (&dv)[V / 8][4]) {
  T* dvp = static_cast<T*>(p.dv);
  const bool dvvec = vec2_ok(dvp, p.dv_s[0], p.dv_s[1], p.dv_s[2]);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int r = rr[hr];
    if (r >= nk) continue;
    for (int hq = h * p.group; hq < (h + 1) * p.group; ++hq) {
      const float* src = p.dvdiag + ((tokk0 + r) * p.HQ + hq) * V + 2 * t4;
#pragma unroll
      for (int nt = 0; nt < V / 8; ++nt) {
        const float2 d = *reinterpret_cast<const float2*>(src + 8 * nt);
        dv[nt][2 * hr] += d.x;
        dv[nt][2 * hr + 1] += d.y;
      }
    }
    T* dst = dvp + ch.b * p.dv_s[0] + (posk0 + r) * p.dv_s[1] + h * p.dv_s[2] + 2 * t4;
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) store2(dst + 8 * nt, dv[nt][2 * hr], dv[nt][2 * hr + 1], dvvec);
  }
}

// Stores this warp's rows rr (those < nk) of a C-layout tile of 8 NT columns; token rows H * 8 NT apart.
template <int NT>
__device__ __forceinline__ void store_warp_rows(float* dst, int64_t H, const int (&rr)[2], int nk, int t4,
                                                const float (&x)[NT][4]) {
  const int64_t ld = H * 8 * NT;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    if (rr[hr] >= nk) continue;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<float2*>(dst + rr[hr] * ld + 8 * nt + 2 * t4) = make_float2(x[nt][2 * hr], x[nt][2 * hr + 1]);
  }
}

template <typename T, int K, int V>
struct BwdK {
  using S = BwdKSmem<K, V>;
  static constexpr int LK = S::LK, LV = S::LV;
  __half *Ws, *W2s;
  T *Ss, *Qs, *dOs, *Vs;
  float *Gk, *lse2, *del;  // stage 0; stage 1's three arrays follow del

  __device__ void carve(uint8_t* smem) {
    Ss = reinterpret_cast<T*>(smem);
    Qs = Ss + kChunk * LK;
    Ws = reinterpret_cast<__half*>(Qs + kChunk * LK);
    W2s = Ws + kChunk * LK;
    dOs = reinterpret_cast<T*>(W2s + kChunk * LK);
    Vs = dOs + kChunk * LV;
    Gk = reinterpret_cast<float*>(Vs + kChunk * LV);
    lse2 = Gk + kChunk;
    del = lse2 + kChunk;
  }

  // Staging buffers of one query head's chunk: queries, dO, and per query row the exponent's bias
  // lse - G_q (base 2; +inf past the sequence, so P = 2^-inf = 0 there) and delta, with the head's key gate
  // terms. Buffer 1 lies over Ws / W2s: the second stage of the far superblocks' pipeline (V <= K only, so
  // that dO fits a [64][K + 8] tile).
  struct QBuf {
    T *q, *dout;
    float *bias, *dlt, *gk;
  };
  struct RowScalars {
    float bias, dlt, gk;
  };

  // Query row threadIdx.x (< 64) of chunk qc, head hq: its scalars, in registers.
  static __device__ __forceinline__ RowScalars row_scalars(const KernelParams& p, const ChunkDesc& ch, int64_t seq_tok0,
                                                           int64_t tokk0, int nk, int qc, int hq, float gl2) {
    const float LOG2E = 1.4426950408889634f;
    RowScalars sc{INFINITY, 0.f, 0.f};
    const int r = threadIdx.x;
    if (r < kChunk) {
      const int64_t tok = seq_tok0 + int64_t(qc) * kChunk, pos = ch.t0 + int64_t(qc) * kChunk;
      const bool ok = r < min(kChunk, ch.len - qc * kChunk);
      const float gq_r = (p.gate && ok) ? p.G[(tok + r) * p.HQ + hq] * gl2 : 0.f;
      if (ok) sc.bias = p.lse[ch.b * p.lse_s[0] + (pos + r) * p.lse_s[1] + hq * p.lse_s[2]] * LOG2E - gq_r;
      sc.dlt = ok ? p.delta[(tok + r) * p.HQ + hq] : 0.f;
      sc.gk = (p.gate && r < nk) ? p.G[(tokk0 + r) * p.HQ + hq] * gl2 : 0.f;
    }
    return sc;
  }

  // Query head hq of a staged chunk (buffer b) against the key tile Kop: dv += P^T dO, h += scale dS^T q,
  // the gate's column terms.
  __device__ __forceinline__ void score(const KernelParams& p, const T* Kop, QBuf b, int hq, const int (&rr)[2], int nk,
                                        int warp, int t4, int64_t tokk0, float sl2, float gs, float (&hk)[K / 8][4],
                                        float (&dv)[V / 8][4]) {
    float st[1][8][4], dpt[1][8][4];
    zero_acc(st);
    zero_acc(dpt);
    warp_mma_ss<T, 1, 8, false, false>(st, Kop, LK, 16 * warp, b.q, LK, 0, K);
    warp_mma_ss<T, 1, 8, false, false>(dpt, Vs, LV, 16 * warp, b.dout, LV, 0, V);
    float csum[2] = {0.f, 0.f};
    const float gk[2] = {b.gk[rr[0]], b.gk[rr[1]]};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int i = 8 * nt + 2 * t4;
      const float2 qbias = *reinterpret_cast<const float2*>(b.bias + i);
      const float2 qdel = *reinterpret_cast<const float2*>(b.dlt + i);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pt = fast_exp2(st[0][nt][e] * sl2 - (gk[e >> 1] + ((e & 1) ? qbias.y : qbias.x)));
        const float ds = pt * (dpt[0][nt][e] - ((e & 1) ? qdel.y : qdel.x));
        st[0][nt][e] = pt;
        dpt[0][nt][e] = ds;
        csum[e >> 1] += ds;
      }
    }
    warp_mma_rs<T, 4, V / 8, true>(dv, st[0], 1.f, b.dout, LV, 0);
    warp_mma_rs<T, 4, K / 8, true>(hk, dpt[0], p.scale, b.q, LK, 0);
    if (p.gate && !p.dgq) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float a = csum[hr];
        a += __shfl_xor_sync(0xffffffffu, a, 1);
        a += __shfl_xor_sync(0xffffffffu, a, 2);
        if (t4 == 0 && rr[hr] < nk) p.dgcol[(tokk0 + rr[hr]) * p.HQ + hq] -= gs * a;
      }
    }
  }

  // Pass 1: kt^(qc) for qc = kc+1 .. lastl into slot qc - kc - 1; then the key at the start of each later
  // superblock a into slot p.sc + a.
  __device__ __forceinline__ void pass1(const KernelParams& p, const ChunkDesc& ch, int h, T* scratch,
                                        const int (&rr)[2], int nk, int t4, int64_t seq_tok0, int64_t tokk0, int last,
                                        int lastl, int sbk, int last_sb, bool far) {
    const int kc = ch.c;
    const T* ktp = static_cast<const T*>(p.kt);
    auto park = [&](const float (&kt)[K / 8][4], int slot) {
      store_tile<T, K>(scratch + size_t(slot) * kChunk * K, K, kt);
    };
    float kt[K / 8][4];
    load_key_rows<T, K>(ktp, tokk0, p.H, h, rr, nk, t4, kt);
    // The steps' W, W2 tiles alternate between (Ws, W2s) and (Ss, Qs), free until pass 2: the next step's
    // load by cp.async while this one's products run.
    __half* const sqh = reinterpret_cast<__half*>(Ss);
    auto issue_w = [&](int qc, int b) {
      load_chunk_w_async<K>(p, seq_tok0 + int64_t(qc) * kChunk, h, b ? sqh : Ws, b ? sqh + kChunk * LK : W2s);
    };
    // The last step's chunk: none across the sequence's last chunk; with p.kfar none across the superblock's
    // last either (that step gives the key at the superblock's end, which only the far loop below uses).
    const int qc_end = far && p.kfar ? lastl - 1 : (lastl < last - 1 ? lastl : last - 1);
    if (kc + 1 <= qc_end) issue_w(kc + 1, 0);
    for (int qc = kc + 1; qc <= lastl; ++qc) {
      park(kt, qc - kc - 1);
      if (qc > qc_end) break;
      const int b = (qc - kc - 1) & 1;
      __syncthreads();  // the step before is done with the other buffer
      if (qc + 1 <= qc_end) {
        issue_w(qc + 1, b ^ 1);
        cp_async_wait_group<1>();
      } else {
        cp_async_wait_all();
      }
      __syncthreads();
      const __half* w_s = b ? sqh : Ws;
      const __half* w2_s = b ? sqh + kChunk * LK : W2s;
      float y[8][4];
      zero_acc(y);
      warp_mma_rs<__half, K / 16, 8, false>(y, kt, 1.f, w2_s, LK, 0);
      warp_mma_rs<__half, 4, K / 8, true>(kt, y, -1.f, w_s, LK, 0);
    }
    if (far && !p.kfar) {
      for (int a = sbk + 1; a <= last_sb; ++a) {
        park(kt, p.sc + a);
        if (a == last_sb) break;
        __syncthreads();
        load_ps_tiles(p, ch, h, a);
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        float y[K / 8][4];
        zero_acc(y);
        warp_mma_rs<__half, K / 16, K / 8, false>(y, kt, 1.f, Ws, LK, 0);  // kt <- kt PS_a^T
#pragma unroll
        for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) kt[nt][e] = y[nt][e];
      }
    }
  }

  // Superblock product PS_a into Ws / W2s (cp.async, not committed).
  __device__ __forceinline__ void load_ps_tiles(const KernelParams& p, const ChunkDesc& ch, int h, int a) {
    const __half* ps = p.ps + (int64_t(ch.sfirst + a) * p.H + h) * K * K;
    for (int r0 = 0; r0 < K; r0 += kChunk) load_tile_async<K>(Ws + r0 * LK, ps + r0 * K, K, kChunk);
  }

  __device__ void run(const KernelParams& p, int ci, int h, T* scratch) {
    const ChunkDesc ch = p.chunks[ci];
    const int kc = ch.c, nk = min(kChunk, ch.len - kc * kChunk);
    const int last = (ch.len + kChunk - 1) / kChunk - 1;
    const int64_t seq_tok0 = ch.b * p.T + ch.t0, tokk0 = seq_tok0 + int64_t(kc) * kChunk;
    const int64_t posk0 = ch.t0 + int64_t(kc) * kChunk;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int rr[2] = {16 * warp + g, 16 * warp + g + 8};
    const float LOG2E = 1.4426950408889634f;
    const float sl2 = p.scale * LOG2E, gl2 = p.gate ? p.gate_scale * LOG2E : 0.f;
    const float gs = p.gate ? p.gate_scale : 0.f;
    const T* vp = static_cast<const T*>(p.v);
    const T* dop = static_cast<const T*>(p.dout);

    __syncthreads();
    load_tile_async<V>(Vs, vp + ch.b * p.v_s[0] + posk0 * p.v_s[1] + h * p.v_s[2], p.v_s[1], nk);
    cp_async_commit();
    // Two-level: query chunks of the key's own superblock are met chunk by chunk; later superblocks a meet
    // the key at their start, with qhat (queries moved to their superblock's start), one dense step each.
    const int sbk = kc / p.sc, last_sb = last / p.sc;
    const bool far = p.path && last_sb > sbk;
    const int lastl = far ? sbk * p.sc + p.sc - 1 : last;
    auto load_ps = [&](int a) { load_ps_tiles(p, ch, h, a); };
    pass1(p, ch, h, scratch, rr, nk, t4, seq_tok0, tokk0, last, lastl, sbk, last_sb, far);
    // The key adjoint h and dv: this warp's 16 key rows, C layout.
    float hk[K / 8][4], dv[V / 8][4];
    zero_acc(hk);
    zero_acc(dv);
    auto store_rows = [&](float* dst, const auto& x) { store_warp_rows(dst, int64_t(p.H), rr, nk, t4, x); };
    // Stage st's buffer (carve: Ws = Qs + 64 LK, W2s = dOs - 64 LK; the second scalars 3 x 64 floats on).
    auto qbuf = [&](int st) {
      return QBuf{Qs + st * kChunk * LK, dOs - st * kChunk * LK, lse2 + 3 * st * kChunk, del + 3 * st * kChunk,
                  Gk + 3 * st * kChunk};
    };
    const QBuf qb0 = qbuf(0);
    auto fetch_scalars = [&](int qc, int hq) { return row_scalars(p, ch, seq_tok0, tokk0, nk, qc, hq, gl2); };
    auto put_scalars = [&](const RowScalars& sc, QBuf b) {
      if (threadIdx.x < kChunk) {
        b.bias[threadIdx.x] = sc.bias;
        b.dlt[threadIdx.x] = sc.dlt;
        b.gk[threadIdx.x] = sc.gk;
      }
    };
    // The tiles of query chunk qc, head hq, into b: dO and qhat or q~ by cp.async (not committed).
    auto stage_tiles = [&](int qc, int hq, bool from_qhat, QBuf b) {
      const int64_t tok = seq_tok0 + int64_t(qc) * kChunk, pos = ch.t0 + int64_t(qc) * kChunk;
      const int nqv = min(kChunk, ch.len - qc * kChunk);
      load_tile_async<V>(b.dout, dop + ch.b * p.do_s[0] + pos * p.do_s[1] + hq * p.do_s[2], p.do_s[1], nqv);
      if (from_qhat) {
        load_tile_async<K>(b.q, static_cast<const T*>(p.qhat) + (tok * p.HQ + hq) * K, int64_t(p.HQ) * K, nqv);
      } else {  // q~ in dtype T (bwd_q left it in qtl's fp16 rows)
        load_tile_async<K>(b.q, reinterpret_cast<const T*>(p.qtl) + (tok * p.HQ + hq) * K, int64_t(p.HQ) * K, nqv);
      }
    };
    auto stage_queries = [&](int qc, int hq, bool from_qhat, QBuf b) {
      stage_tiles(qc, hq, from_qhat, b);
      put_scalars(fetch_scalars(qc, hq), b);
    };
    auto score_head = [&](const T* Kop, QBuf b, int hq) {
      score(p, Kop, b, hq, rr, nk, warp, t4, tokk0, sl2, gs, hk, dv);
    };
    // Query chunk qc (every query head of the group) against the key tile Kop through buffer 0; queries from
    // qhat (far) or q~ (own superblock). staged: the caller staged the group's first head and waited.
    auto query_chunk = [&](int qc, const T* Kop, bool from_qhat, bool staged) {
      for (int hq = h * p.group; hq < (h + 1) * p.group; ++hq) {
        if (!staged || hq > h * p.group) {
          __syncthreads();
          stage_queries(qc, hq, from_qhat, qb0);
          cp_async_commit();
          cp_async_wait_all();
          __syncthreads();
        }
        score_head(Kop, qb0, hq);
      }
    };
    // ---- pass 2: query superblocks, then query chunks, right to left.
    if (far && p.kfar) {  // the far superblocks' part from bwd_k_far: h at the own superblock's end, dv
      load_far_part<K, V>(p, tokk0, h, rr, t4, hk, dv);
    } else if (far) {
      for (int a = last_sb; a > sbk; --a) {
        __syncthreads();
        load_tile_async<K>(Ss, scratch + size_t(p.sc + a) * kChunk * K, K, kChunk);
        if (a < last_sb) load_ps(a);
        const int qend = min(last, a * p.sc + p.sc - 1);
        stage_queries(qend, h * p.group, true, qb0);  // with the superblock's loads: one wait
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        if (a < last_sb) {  // across superblock a: h <- h PS_a (own rows)
          warp_ps_step<K, true>(hk, Ws, LK);
        }
        if constexpr (V <= K) {
          // Pipelined: item n = (chunk qend - n / group, head n % group) is scored from buffer n & 1 while
          // item n + 1 loads into the other (its scalars fetched into registers, stored after the scoring).
          __syncthreads();  // every warp is done with PS_a (buffer 1's tiles)
          const int nit = (qend - a * p.sc + 1) * p.group;
          for (int n = 0; n < nit; ++n) {
            const QBuf cur = qbuf(n & 1), nxt = qbuf((n & 1) ^ 1);
            RowScalars sc{};
            if (n + 1 < nit) {
              const int qn = qend - (n + 1) / p.group, hn = h * p.group + (n + 1) % p.group;
              stage_tiles(qn, hn, true, nxt);
              cp_async_commit();
              sc = fetch_scalars(qn, hn);
            }
            score_head(Ss, cur, h * p.group + n % p.group);
            if (n + 1 < nit) put_scalars(sc, nxt);
            cp_async_wait_all();
            __syncthreads();
          }
        } else {
          for (int qc = qend; qc >= a * p.sc; --qc) query_chunk(qc, Ss, true, qc == qend);
        }
      }
      // h is now the gradient w.r.t. the key moved to its superblock's end, from the far queries.
      store_rows(p.dks + (tokk0 * p.H + h) * K, hk);
    }
    for (int qc = lastl; qc > kc; --qc) {
      const int64_t tok = seq_tok0 + int64_t(qc) * kChunk;
      __syncthreads();
      load_tile_async<K>(Ss, scratch + size_t(qc - kc - 1) * kChunk * K, K, kChunk);
      if (qc < last) {
        load_tile_async<K>(Ws, p.w16 + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk);
        load_tile_async<K>(W2s, p.w2h + (tok * p.H + h) * K, int64_t(p.H) * K, kChunk);
      }
      stage_queries(qc, h * p.group, false, qb0);  // with the chunk's loads: one wait
      cp_async_commit();
      cp_async_wait_all();
      __syncthreads();
      if (qc < last) warp_chunk_step<K>(hk, Ws, W2s, LK);  // h <- h P_qc = h - (h W^T) W2 (own rows)
      query_chunk(qc, Ss, false, true);
    }
    // ---- outputs: dv = the off-diagonal part (summed over the group) plus each query head's diagonal part
    // (dvdiag, complete: bwd_q ran before), added in head order (a fixed order: deterministic); then dk~ =
    // h_{kc+1}. dkt may lie over dvdiag (MHA with K = V, bwd_run): a thread stores dkt's elements after it
    // has read the same elements of dvdiag, and no other CTA reads these rows.
    store_dv<T, V>(p, ch, posk0, tokk0, h, rr, nk, t4, dv);
    store_rows(p.dkt + (tokk0 * p.H + h) * K, hk);
  }
};

template <typename T, int K, int V>
__global__ void __launch_bounds__(kBwdThreads, K == 64 && V == 64 ? 3 : 2) bwd_k_kernel(KernelParams p, int* next_item) {
  extern __shared__ __align__(16) uint8_t smem[];
  BwdK<T, K, V> w;
  w.carve(smem);
  T* scratch = reinterpret_cast<T*>(p.scratch) + size_t(blockIdx.x) * p.scratch_slots * kChunk * K;
  const int nitems = p.nchunks * p.H;
  // order[] lists chunks by descending index; the key side has the most work at low indices. Items are started
  // in that order from a counter as CTAs free up (as bwd_q's).
  __shared__ int next;
  for (;;) {
    const int it = take_item(next_item, &next, 0);
    if (it >= nitems) return;
    w.run(p, p.order[p.nchunks - 1 - it / p.H], it % p.H, scratch);
  }
}

template <typename T, int K, int V>
cudaError_t set_attr() {
  return cudaFuncSetAttribute(bwd_k_kernel<T, K, V>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              int(BwdKSmem<K, V>::bytes));
}

template <typename T, int K, int V>
cudaError_t run_t(const KernelParams& p, int grid, int* next, cudaStream_t s) {
  cudaError_t e = set_attr<T, K, V>();
  if (e != cudaSuccess) return e;
  bwd_k_kernel<T, K, V><<<grid, kBwdThreads, BwdKSmem<K, V>::bytes, s>>>(p, next);
  return cudaGetLastError();
}

template <typename T, int K, int V>
int grid_t() {
  if (set_attr<T, K, V>() != cudaSuccess) return 0;
  int nb = 0, sms = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, bwd_k_kernel<T, K, V>, kBwdThreads, BwdKSmem<K, V>::bytes);
  device_attr(cudaDevAttrMultiProcessorCount, &sms);
  return nb * sms;
}

#define PA_DISPATCH_KV(FN, ...)                                                   \
  (p.K == 64 ? (p.V == 64 ? FN<T, 64, 64>(__VA_ARGS__) : FN<T, 64, 128>(__VA_ARGS__)) \
             : (p.V == 64 ? FN<T, 128, 64>(__VA_ARGS__) : FN<T, 128, 128>(__VA_ARGS__)))

template <typename T>
cudaError_t dispatch(const KernelParams& p, int grid, int* next, cudaStream_t s) {
  return PA_DISPATCH_KV(run_t, p, grid, next, s);
}
template <typename T>
int grid_dispatch(const KernelParams& p) {
  return PA_DISPATCH_KV(grid_t);
}

}  // namespace

size_t smem_bwd_k(int K, int V) {
  return K == 64 ? (V == 64 ? BwdKSmem<64, 64>::bytes : BwdKSmem<64, 128>::bytes)
                 : (V == 64 ? BwdKSmem<128, 64>::bytes : BwdKSmem<128, 128>::bytes);
}

cudaError_t launch_bwd_k(const KernelParams& p, int dtype, int grid, int* next, cudaStream_t s) {
  return dtype == 0 ? dispatch<__half>(p, grid, next, s) : dispatch<__nv_bfloat16>(p, grid, next, s);
}

int bwd_k_max_grid(const KernelParams& p, int dtype) {
  return dtype == 0 ? grid_dispatch<__half>(p) : grid_dispatch<__nv_bfloat16>(p);
}

}  // namespace pathattn::cuda
