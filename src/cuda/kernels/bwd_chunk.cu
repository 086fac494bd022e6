// cuda/kernels/bwd_chunk.cu: the chunk-local backward, per (chunk, kv head), on tensor cores (tf32 mma, fp32
// accumulation; where dP is staged, its two products on fp16 mma under one power-of-two scale). It takes E from
// the backward's chunk_prep (p.E) and W2 from w2h (every product here rounds them to tf32 anyway), rebuilds Z and
// U, and pulls the scan gradients (dP, dk~, and per query head dq~ and dA_loc) back through
//   A = strict_lower(diag(b) W W^T), E = (I + A)^-1, W2 = E diag(b) W, Z = strict_lower(W K^T),
//   U = E diag(b) Z, k~ = K - U^T W, P = I - W^T W2, X = tril_incl(Q W^T), q~ = Q - X W2,
//   A_loc = tril_incl(Q K^T - X U)
// to dq, dk, dw, dbeta (dE -> dA = -E^T dE E^T on the strict lower triangle; dv is bwd_k's). dW, dK, dW2 accumulate
// in registers (TcTile); sums run in a fixed order inside the CTA: deterministic.
#include "cuda/device/common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

constexpr int kThreads = kTcThreads;

// kStageDA: a query head's dA_loc is staged in shared memory (dAs) rather than read from global memory inside
// the products; kStageDQ (with kStageDA): its dq~ too (dQs). Chosen at launch where the device allows the larger
// block (kStageDA: not on sm_80 at K = 64; kStageDQ: on sm_90). At K = 64 dQs has its own region; at K = 128
// it lies over Zs and Es (as D's first rows do before the loop), which the query heads' loop does not read: E
// is read from p.E again and Z recomputed after it.
template <int K, bool kStageDA, bool kStageDQ = false>
struct BwdChunkSmem {
  static_assert(kStageDA || !kStageDQ, "dq~ is staged only with dA_loc");
  static constexpr int LW = K + 4, LT = K + 8, LC = kChunk + 4;
  // Wf, W2f [64][LW] f32 (W2f: W2 in fp16, [64][LT], until the query heads' loop ends, then dW2 in fp32);
  // Zs, Es, Us, dUs, Xs, dXs [64][LC] f32 (Xs, dXs adjacent: they also hold a
  // [64][LW] f32 matrix); bs, dbs; Ks, Qs [64][LT] 16-bit; with kStageDA, dAs [64][LC] f32; with kStageDQ
  // and K = 64, dQs [64][LW] f32 (at K = 128 over Zs, Es).
  static constexpr size_t bytes =
      sizeof(float) * (2 * size_t(kChunk) * LW + 6 * size_t(kChunk) * LC + 2 * kChunk) + 2 * 2 * size_t(kChunk) * LT +
      (kStageDA ? sizeof(float) * size_t(kChunk) * LC : 0) +
      (kStageDQ && K == kChunk ? sizeof(float) * size_t(kChunk) * LW : 0);
  static_assert(2 * kChunk * LC >= kChunk * LW, "Xs + dXs (and Zs + Es) must hold a [64][K + 4] matrix");
};

// One (chunk, kv head) item: the shared-memory carve-up, the item's coordinates and its phases, in the order
// the kernel runs them. The gradients dW, dK, dW2 stay in the kernel's registers (TcTile accumulators).
template <typename T, int K, bool kStageDA, bool kStageDQ>
struct BwdChunk {
  using S = BwdChunkSmem<K, kStageDA, kStageDQ>;
  using TK = TcTile<kChunk, K>;
  using Acc = typename TK::Acc;
  static constexpr int LW = S::LW, LT = S::LT, LC = S::LC, LE = kChunk + 8;  // LE: E's fp16 tile
  static constexpr int kU = kTcUnroll(K);  // products below: kUW false (the shuffled warp index costs spills here)
  // At K = 128 with D staged, D's rows 0..63 and then (kStageDQ) dq~ lie over Zs and Es, which are free from U's
  // product to the query heads' loop's end: E is read again and Z recomputed after it.
  static constexpr bool kOverZE = K > kChunk && kStageDA;
  static constexpr bool kStageD = K == kChunk || kStageDA;
  // kD16 (D staged where Big is free after dk~): D in fp16 over Big, W in fp16 over D's fp32 rows 0..63 (K = 128)
  // or after D16 (K = 64), the warps' maxima past W2's fp16 rows.
  static constexpr bool kD16 = kStageDA, kEarlyQ = kD16 && K > kChunk;
  static constexpr bool kPreQ = K == kChunk && kStageDA;  // the first head's Q and dq~ staged at the start

  const KernelParams& p;
  float *Wf, *W2f, *Zs, *Es, *Us, *dUs, *Xs, *dXs, *bs, *dbs, *dAs, *dQs, *Big;
  __half* W2h;  // W2 as fp16 [64][LT] (w2h) over W2f until the heads' loop ends
  T *Ks, *Qs;
  int ci, h, tid, nq;
  int r0;  // the first row with a non-finite k, w or beta (those rows on zeroed in shared memory), kChunk if none
  ChunkDesc ch;
  int64_t pos0, tok0;
  // Set in recompute_ut where the staging first needs them (set in the constructor, ptxas spilled differently).
  // D rows 0..63: K = 64 over dAs (free until the query heads' loop; LC = LW there) or, without dAs, over Xs / dXs
  // once dk~ is read; K = 128 over Zs / Es; rows 64..127 (K = 128) over Qs / dAs.
  const float* Dm;
  float *D0, *D1, *rmax;
  __half *D16, *W16;
  bool q16, qvec;
  const T* qp;
  TileSrc<__half> e_src;
  TileSrc<T> q_src;
  TileSrc<float> dq_src, da_src;

  __device__ __forceinline__ BwdChunk(const KernelParams& kp, float* sm) : p(kp) {
    Wf = sm;
    W2f = Wf + kChunk * LW;
    W2h = reinterpret_cast<__half*>(W2f);
    Zs = W2f + kChunk * LW;
    Es = Zs + kChunk * LC;
    Us = Es + kChunk * LC;
    dUs = Us + kChunk * LC;
    Xs = dUs + kChunk * LC;
    dXs = Xs + kChunk * LC;
    bs = dXs + kChunk * LC;
    dbs = bs + kChunk;
    Ks = reinterpret_cast<T*>(dbs + kChunk);
    Qs = Ks + kChunk * LT;
    dAs = reinterpret_cast<float*>(Qs + kChunk * LT);  // kStageDA only
    dQs = K > kChunk ? Zs : dAs + kChunk * LC;         // kStageDQ only
    Big = Xs;  // [64][LW] over Xs and dXs: dk~ first, dW E^T-product later
    const int2 ih = item_and_head(p.H);
    ci = ih.x;
    h = ih.y;
    tid = threadIdx.x;
    ch = p.chunks[ci];
    nq = min(kChunk, ch.len - ch.c * kChunk);
    pos0 = ch.t0 + int64_t(ch.c) * kChunk;
    tok0 = ch.b * p.T + pos0;
    qp = static_cast<const T*>(p.q);
    qvec = vec4_ok(qp, p.q_s[0], p.q_s[1], p.q_s[2]);
  }

  // A chunk with a non-finite k, w or beta (finite.cuh; r0 from the backward's chunk_prep): the staged k, w, beta
  // zeroed from row r0 on, as chunk_prep computed E and W2 (every value from those rows is replaced, so it does
  // not matter that the tiles were staged unchecked). Ends with the tiles visible to the block.
  __device__ __forceinline__ void zero_nonfinite_rows() {
    zero_rows_from<K>(Ks, LT, r0, nq, tid, kThreads);
    zero_rows_from<K>(Wf, LW, r0, nq, tid, kThreads);
    if (tid >= r0 && tid < nq) bs[tid] = 0.f;
    __syncthreads();
  }

  // Z = strict_lower(W K^T) -> Zs (before the heads' loop, and after it where dQs lay over Zs).
  __device__ __forceinline__ void compute_z() {
    const auto wA = a_rows(static_cast<const float*>(Wf), LW);
    block_mm_tc<kChunk, kChunk, K, false, kU, false>(wA, b_rows(static_cast<const T*>(Ks), LT),
                                              [&](int r, int c, float v) { Zs[r * LC + c] = c < r ? v : 0.f; },
                                              kFull.out_lower(-1));
  }

  // Stages the inputs and recomputes the UT transform's Z and U (E comes from the forward's chunk_prep).
  __device__ __forceinline__ void recompute_ut() {
    // ---- recompute the UT transform. Every tile below is a plain copy, staged by cp.async in groups committed
    // in the order they are needed, each as early as its space is free, so that their loads overlap the products
    // before their first use (one CTA an SM: nothing else hides them): G0 k, w (then beta, synchronously); G1 E and
    // W2 (fp16, converted where read); G2 dk~ (over Xs / dXs); G3 D = dP (K = 64: over dAs; K = 128: rows 64..127
    // over Qs / dAs); at K = 64 G4 the first query head's Q and dq~; at K = 128 D's rows 0..63 (over Zs / Es) once
    // U is done. Sources that cp.async cannot take (rows not 16-byte aligned) are staged at once instead.
    PA_PROBE(0);
    stage_chunk_kw<K>(p, ch.b, pos0, h, nq, Ks, LT, Wf, LW, true);
    cp_async_commit();
    // E (store_e's fp16 tile) lands over dUs (free until dU's product) before the heads' loop and over Us (free
    // from the loop's end to dE's product) after it, and becomes fp32 in Es (load_e) once its group is in.
    static_assert(sizeof(__half) * kChunk * LE <= sizeof(float) * kChunk * LC, "E16 over dUs / Us");
    e_src = TileSrc<__half>{p.E + (int64_t(ci) * p.H + h) * kChunk * kChunk, 0, kChunk, 0, true};
    stage_tile_async<kChunk>(e_src, 0, 0, reinterpret_cast<__half*>(dUs), LE, 0, kChunk, true);
    stage_tile_async<K>(ws_src<K>(p.w2h, p.H), 0, h, W2h, LT, tok0, nq, true);
    cp_async_commit();
    stage_tile_async<K>(ws_src<K>(p.dkt, p.H), 0, h, Big, LW, tok0, nq, true);
    cp_async_commit();
    Dm = p.dP + (int64_t(ci) * p.H + h) * K * K;
    D0 = K == kChunk ? (kStageDA ? dAs : Big) : Zs;
    D1 = reinterpret_cast<float*>(Qs);
    D16 = reinterpret_cast<__half*>(Big);
    W16 = K > kChunk ? reinterpret_cast<__half*>(Zs) : D16 + K * LT;
    rmax = W2f + kChunk * LT / 2;
    static_assert(2 * kChunk * LC * sizeof(float) >= (K * LT + (K > kChunk ? 0 : kChunk * LT)) * sizeof(__half),
                  "D16 (and W16 at K = 64) over Big");
    static_assert(kChunk * LW >= kChunk * LT / 2 + kTcWarps, "rmax past W2's fp16 rows");
    if constexpr (kStageD) {
      static_assert(K > kChunk || LC == LW, "D over dAs at K = 64");
      static_assert(K == kChunk || kChunk * LT * sizeof(T) + kChunk * LC * sizeof(float) >= kChunk * LW * sizeof(float),
                    "D rows 64..127 over Qs / dAs");
      if constexpr (K == kChunk && kStageDA)
        stage_tile_async<K>(TileSrc<float>{Dm, 0, K, 0, true}, 0, 0, D0, LW, 0, kChunk, true);
      if constexpr (K > kChunk)
        stage_tile_async<K>(TileSrc<float>{Dm + kChunk * K, 0, K, 0, true}, 0, 0, D1, LW, 0, kChunk, true);
    }
    cp_async_commit();
    // The first query head's Q and dq~ (K = 64, where their tiles are free from the start).
    q16 = vec16_ok(qp, p.q_s[0], p.q_s[1], p.q_s[2]);
    q_src = TileSrc<T>{qp, p.q_s[0], p.q_s[1], p.q_s[2], qvec};
    dq_src = TileSrc<float>{p.dqt, 0, int64_t(p.HQ) * K, K, true};
    da_src = TileSrc<float>{p.aloc, 0, int64_t(p.HQ) * kChunk, kChunk, true};
    if constexpr (kPreQ) {
      stage_tile_async<K>(q_src, ch.b, h * p.group, Qs, LT, pos0, nq, q16);
      if constexpr (kStageDQ) stage_tile_async<K>(dq_src, 0, h * p.group, dQs, LW, tok0, nq, true);
    }
    cp_async_commit();
    r0 = p.bad[ci * p.H + h];  // issued here, used after the first wait
    if (tid < kChunk) {
      bs[tid] = tid < nq && p.path
                    ? load_param(p.beta, p.beta_dt, ch.b * p.beta_s[0] + (pos0 + tid) * p.beta_s[1] + h * p.beta_s[2])
                    : 0.f;
      dbs[tid] = 0.f;
    }
    cp_async_wait_group<4>();  // G0
    __syncthreads();
    if (r0 < nq) zero_nonfinite_rows();
    PA_PROBE(1);
    compute_z();
    cp_async_wait_group<3>();  // G1: E, W2
    __syncthreads();
    load_e(Es, LC, reinterpret_cast<const __half*>(dUs), LE, tid, kThreads);
    if (r0 < nq) zero_rows_from<K>(W2h, LT, r0, nq, tid, kThreads);  // as chunk_prep computed E and W2
    __syncthreads();
    PA_PROBE(4);
    block_mm_tc<kChunk, kChunk, kChunk, false, kU, false>(
        [&](int r, int t) { return t <= r ? Es[r * LC + t] * bs[t] : 0.f; },
        [&](int t, int c) { return Zs[t * LC + c]; },
        [&](int r, int c, float v) { Us[r * LC + c] = v; },
        kFull.kmax_r(0).kmin_c(1));
    if constexpr (kOverZE) {  // D rows 0..63 over Zs / Es, free from here, while the dk~ products run
      __syncthreads();
      stage_tile_async<K>(TileSrc<float>{Dm, 0, K, 0, true}, 0, 0, D0, LW, 0, kChunk, true);
      cp_async_commit();
    }
    cp_async_wait_group<1>();  // G2 (dk~), G3 (D; not K = 64's G4 or K = 128's D rows 0..63)
    __syncthreads();
    PA_PROBE(5);
  }

  // Gradients of the chunk-end keys (dk~) and of the chunk product (D = dP).
  __device__ __forceinline__ void key_grads(Acc& dWa, Acc& dKa, Acc& dW2a) {
    auto w_rk = [&](int r, int k) { return Wf[r * LW + k]; };
    const auto wA = a_rows(static_cast<const float*>(Wf), LW);
    const auto w2A = a_rows(static_cast<const __half*>(W2h), LT);
    auto dKt = [&](int j, int a) { return Big[j * LW + a]; };
    // dW -= U dk~;  dU = -W dk~^T (strict lower);  dK += dk~.
    mma_tc_acc<kChunk, K, kChunk, false, kU, false>(dWa, a_rows(Us, LC), [&](int k, int a) { return -dKt(k, a); },
                                                     kFull.kmax_r(-1));
    block_mm_tc<kChunk, kChunk, K, false, kU, false>(wA, b_rows(Big, LW),
                                              [&](int r, int j, float v) { dUs[r * LC + j] = j < r ? -v : 0.f; },
                                              kFull.out_lower(-1));
    TK::each(dKa, [&](int r, int d, float& v) { v += dKt(r, d); });
    // dW2 -= W D;  dW -= W2 D^T.
    if constexpr (kD16) {
      // On 16-bit mma: D as fp16 under one power-of-two scale for the whole [K][K] tile (its largest entry into
      // [2^14, 2^15): fp16 keeps tf32's 11 bits for every entry down to 2^-29 of it) and negated, over Big (dk~ is
      // read: the barrier below); W rounded to fp16 (tf32's significand) from Wf. Each thread holds its D entries
      // across the barrier that publishes the warps' maxima, after which D's fp32 rows are free (W16 over them at
      // K = 128).
      if constexpr (kOverZE) cp_async_wait_all();
      __syncthreads();
      // This thread's i-th group of 4 consecutive columns of a tile with K columns: (row, column).
      auto at4 = [&](int i) {
        const int idx = tid + i * kThreads;
        return make_int2(idx / (K / 4), 4 * (idx % (K / 4)));
      };
      float4 dv[K * K / 4 / kThreads];
      float mx = 0.f;
#pragma unroll
      for (int i = 0; i < K * K / 4 / kThreads; ++i) {
        const int2 q = at4(i);
        dv[i] = *reinterpret_cast<const float4*>(K == kChunk || q.x < kChunk ? D0 + q.x * LW + q.y
                                                                             : D1 + (q.x - kChunk) * LW + q.y);
        mx = fmaxf(mx, fmaxf(fmaxf(fabsf(dv[i].x), fabsf(dv[i].y)), fmaxf(fabsf(dv[i].z), fabsf(dv[i].w))));
      }
      const int sh = min(15 - scale_exp(block_max<kTcWarps>(mx, rmax)), 126);
      const float down = -ldexpf(1.f, sh), up = ldexpf(1.f, -sh);  // D16 = -D 2^sh: up undoes the scale
#pragma unroll
      for (int i = 0; i < K * K / 4 / kThreads; ++i) {
        const int2 q = at4(i);
        store4(D16 + q.x * LT + q.y, make_float4(down * dv[i].x, down * dv[i].y, down * dv[i].z, down * dv[i].w));
      }
#pragma unroll
      for (int i = 0; i < kChunk * K / 4 / kThreads; ++i) {
        const int2 q = at4(i);
        store4(W16 + q.x * LT + q.y, *reinterpret_cast<const float4*>(Wf + q.x * LW + q.y));
      }
      if constexpr (kEarlyQ) {  // D's rows 64..127 (over Qs / dAs) were read before block_max's barrier: the first
        // head's Q and dA_loc there, loading under the products below
        stage_tile_async<K>(q_src, ch.b, h * p.group, Qs, LT, pos0, nq, q16);
        stage_tile_async<kChunk>(da_src, 0, h * p.group, dAs, LC, tok0, nq, true);
        cp_async_commit();
      }
      __syncthreads();
      // dW -= W2 D^T through dW2a (zero here) as the product's accumulator; then dW2 -= W D into it.
      mma_tc_acc16<kChunk, K, K, __half, false, false>(dW2a, W2h, LT, D16, LT);
      fma_acc(dWa, dW2a, up);
      TK::zero(dW2a);
      mma_tc_acc16<kChunk, K, K, __half, false, true>(dW2a, W16, LT, D16, LT);
      TK::each(dW2a, [&](int, int, float& v) { v *= up; });
    } else if constexpr (kStageD) {  // K = 64 without dAs: D over dk~, read above
      static_assert(K == kChunk && 2 * kChunk * LC >= kChunk * LW, "D over Xs / dXs");
      __syncthreads();
      stage_tile_async<K>(TileSrc<float>{Dm, 0, K, 0, true}, 0, 0, D0, LW, 0, kChunk, true);
      cp_async_commit();
      cp_async_wait_all();
      __syncthreads();
      mma_tc_acc<kChunk, K, kChunk, false, kU, false>(dW2a, wA, [&](int a, int d) { return -D0[a * LW + d]; });
      mma_tc_acc<kChunk, K, K, false, kU, false>(dWa, w2A, b_rows<true>(D0, LW));
    } else {
      mma_tc_acc<kChunk, K, K, false, kU, false>(dW2a, w_rk, [&](int a, int d) { return -Dm[a * K + d]; });
      mma_tc_acc<kChunk, K, K, false, kU, false>(dWa, w2A, b_rows<true>(Dm, K));
    }
  }

  // Query head hq: dq, and the X / A_loc terms.
  __device__ __forceinline__ void query_head(int hq, T* dqp, bool dq_pair, Acc& dWa, Acc& dKa, Acc& dW2a) {
    auto w_rk = [&](int r, int k) { return Wf[r * LW + k]; };
    auto k_rk = [&](int r, int d) { return to_f(Ks[r * LT + d]); };
    const auto wB = b_rows(static_cast<const float*>(Wf), LW);
    const auto w2B = b_rows(static_cast<const __half*>(W2h), LT);
    const bool first = hq == h * p.group;
    __syncthreads();  // D (over Zs / Es, dAs, Xs / dXs or Qs) and the previous head's tiles are no longer read
    PA_PROBE(6);
    // Q (one group: X needs it first), then dA_loc (kStageDA) and dq~ (kStageDQ); rows past the end: zero.
    if (!((kPreQ || kEarlyQ) && first)) stage_tile_async<K>(q_src, ch.b, hq, Qs, LT, pos0, nq, q16);
    cp_async_commit();
    if constexpr (kStageDA)
      if (!(kEarlyQ && first)) stage_tile_async<kChunk>(da_src, 0, hq, dAs, LC, tok0, nq, true);
    if constexpr (kStageDQ)
      if (!(kPreQ && first)) stage_tile_async<K>(dq_src, 0, hq, dQs, LW, tok0, nq, true);
    cp_async_commit();
    const float* dal = p.aloc + (tok0 * p.HQ + hq) * kChunk;
    const int64_t dal_ld = int64_t(p.HQ) * kChunk;
    const float* dq_t = p.dqt + (tok0 * p.HQ + hq) * K;
    const int64_t dq_ld = int64_t(p.HQ) * K;
    auto dQt = [&](int r, int d) {
      if constexpr (kStageDQ) return dQs[r * LW + d];
      else return r < nq ? dq_t[r * dq_ld + d] : 0.f;
    };
    auto dAl = [&](int r, int c) {
      if constexpr (kStageDA) return dAs[r * LC + c];
      else return r < nq ? dal[r * dal_ld + c] : 0.f;
    };
    auto q_rk = [&](int r, int d) { return to_f(Qs[r * LT + d]); };
    // dq~ and dA_loc as A operands: paired loads from their staged tiles (KRows), else the accessors above.
    const auto dQa = [&] {
      if constexpr (kStageDQ) return a_rows(static_cast<const float*>(dQs), LW);
      else return dQt;
    }();
    const auto dAa = [&] {
      if constexpr (kStageDA) return a_rows(static_cast<const float*>(dAs), LC);
      else return dAl;
    }();
    cp_async_wait_group<1>();  // Q
    __syncthreads();
    // X = tril_incl(Q W^T) -> Xs.
    block_mm_tc<kChunk, kChunk, K, false, kU, false>(
        a_rows(static_cast<const T*>(Qs), LT), wB, [&](int r, int s, float v) { Xs[r * LC + s] = s <= r ? v : 0.f; },
        kFull.out_lower(0));
    cp_async_wait_all();  // dA_loc, dq~
    __syncthreads();
    PA_PROBE(7);
    // dX = -(dq~ W2^T + dA_loc U^T) on the lower triangle -> dXs.
    block_mm_tc2<kChunk, kChunk, K, kChunk, false, kU>(
        dQa, w2B, dAa, b_rows(Us, LC),
        [&](int r, int s, float v) { dXs[r * LC + s] = s <= r && r < nq ? -v : 0.f; }, kFull.out_lower(0),
        kFull.out_lower(0).kmax_r(0).kmax_c(-1));
    __syncthreads();
    PA_PROBE(8);
    // dq = dq~ + dA_loc K + dX W.
    block_mm_tc2_pairs<kChunk, K, kChunk, kChunk, false, kU>(
        dAa, k_rk, a_rows(dXs, LC), w_rk,
        [&](int r, int d, float v, float u) {
          if (r < nq)  // rows from a non-finite one on: NaN, as the definition gives
            store2(dqp + ch.b * p.dq_s[0] + (pos0 + r) * p.dq_s[1] + hq * p.dq_s[2] + d,
                   r < r0 ? dQt(r, d) + v : nan_f32(), r < r0 ? dQt(r, d + 1) + u : nan_f32(), dq_pair);
        },
        kFull.kmax_r(0), kFull.kmax_r(0));
    // dK += dA_loc^T Q;  dW += dX^T Q;  dW2 -= X^T dq~.
    mma_tc_acc<kChunk, K, kChunk, false, kU, false>(dKa, [&](int c, int r) { return dAl(r, c); },
        q_rk, kFull.kmin_r(0));
    mma_tc_acc<kChunk, K, kChunk, false, kU, false>(dWa, [&](int s, int r) { return dXs[r * LC + s]; },
        q_rk, kFull.kmin_r(0));
    mma_tc_acc<kChunk, K, kChunk, false, kU, false>(dW2a, [&](int s, int r) { return -Xs[r * LC + s]; },
        dQt, kFull.kmin_r(0));
    // dU -= X^T dA_loc (strict lower).
    block_mm_tc<kChunk, kChunk, kChunk, false, kU, false>([&](int t, int r) { return Xs[r * LC + t]; }, dAl,
                                                   [&](int t, int c, float v) {
                                                 if (c < t) dUs[t * LC + c] -= v;
                                                   },
                                                   kFull.kmin_r(0).kmin_c(0).out_lower(-1));
  }

  // Back through the UT transform: dE, dZ, dA into dW, dK and dbeta.
  __device__ __forceinline__ void through_ut(Acc& dWa, Acc& dKa, Acc& dW2a) {
    auto k_rk = [&](int r, int d) { return to_f(Ks[r * LT + d]); };
    const auto wA = a_rows(static_cast<const float*>(Wf), LW);
    const auto wB = b_rows(static_cast<const float*>(Wf), LW);
    __syncthreads();
    PA_PROBE(9);
    if constexpr (kOverZE) {  // E again (its copy overlapping Z's recompute), Z (synchronised before dE below)
      stage_tile_async<kChunk>(e_src, 0, 0, reinterpret_cast<__half*>(Us), LE, 0, kChunk, true);
      cp_async_commit();
      compute_z();
      cp_async_wait_all();
      __syncthreads();
      load_e(Es, LC, reinterpret_cast<const __half*>(Us), LE, tid, kThreads);
    }

    // ---- through the UT transform.
    float* dW2s = W2f;  // W2 is not read any more
    TK::each(dW2a, [&](int r, int d, float& v) { dW2s[r * LW + d] = v; });
    __syncthreads();
    PA_PROBE(10);
    // dE (lower incl.) = (dU Zb^T + dW2 Wb^T) -> Us.
    block_mm_tc2<kChunk, kChunk, kChunk, K, false, kU>(
        a_rows(dUs, LC), b_rows(Zs, LC), a_rows(dW2s, LW), wB,
        [&](int r, int s, float v) { Us[r * LC + s] = s <= r ? v * bs[s] : 0.f; },
        kFull.out_lower(0).kmax_r(-1).kmax_c(-1), kFull.out_lower(0));
    // dZb = E^T dU, in place (strict lower).
    block_mm_tc<kChunk, kChunk, kChunk, false, kU, false>([&](int t, int r) { return Es[r * LC + t]; },
                                                   [&](int r, int c) { return dUs[r * LC + c]; },
                                                   [&](int t, int c, float v) { dUs[t * LC + c] = t > c ? v : 0.f; },
                                                   kFull.kmin_r(0).kmin_c(1).out_lower(-1));
    __syncthreads();
    PA_PROBE(11);
    if (tid < kChunk) {
      const int t = tid;
      float v = 0.f;
      for (int c = 0; c < t; ++c) v = fmaf(dUs[t * LC + c], Zs[t * LC + c], v);
      dbs[t] += v;
    }
    // dW += diag(b) dZb K;  dK += dZb^T diag(b) W.
    mma_tc_acc<kChunk, K, kChunk, false, kU, false>(dWa, [&](int r, int c) { return bs[r] * dUs[r * LC + c]; }, k_rk,
                                             kFull.kmax_r(-1));
    mma_tc_acc<kChunk, K, kChunk, false, kU, false>(dKa, [&](int c, int r) { return bs[r] * dUs[r * LC + c]; },
                                             [&](int r, int d) { return Wf[r * LW + d]; }, kFull.kmin_r(1));
    // dWb = E^T dW2 -> Big;  M1 = dE E^T -> Zs (Z is not read any more once dbs above is done).
    block_mm_tc<kChunk, K, kChunk, false, kU, false>([&](int s, int r) { return Es[r * LC + s]; },
                                              [&](int r, int d) { return dW2s[r * LW + d]; },
                                              [&](int s, int d, float v) { Big[s * LW + d] = v; }, kFull.kmin_r(0));
    block_mm_tc<kChunk, kChunk, kChunk, false, kU, false>(a_rows(Us, LC), b_rows(Es, LC),
                                                   [&](int r, int c, float v) { Zs[r * LC + c] = v; },
                                                   kFull.kmax_r(0).kmax_c(0));
    __syncthreads();
    PA_PROBE(12);
    TK::each(dWa, [&](int s, int d, float& v) { v += bs[s] * Big[s * LW + d]; });
    if (tid < kChunk) {
      float v = 0.f;
      for (int d = 0; d < K; ++d) v = fmaf(Big[tid * LW + d], Wf[tid * LW + d], v);
      dbs[tid] += v;
    }
    // dA = -E^T M1 (strict lower) -> dUs.
    block_mm_tc<kChunk, kChunk, kChunk, false, kU, false>([&](int a, int r) { return Es[r * LC + a]; },
                                                   [&](int r, int c) { return Zs[r * LC + c]; },
                                                   [&](int a, int c, float v) { dUs[a * LC + c] = c < a ? -v : 0.f; },
                                                   kFull.kmin_r(0).out_lower(-1));
    __syncthreads();
    PA_PROBE(13);
    // dbeta_a += sum_c dA[a][c] (w_a . w_c): the Gram products into Zs, then fixed-order row sums.
    block_mm_tc<kChunk, kChunk, K, false, kU, false>(
        wA, wB, [&](int a, int c, float v) { Zs[a * LC + c] = dUs[a * LC + c] * v; }, kFull.out_lower(-1));
    // dW += (diag(b) dA + dA^T diag(b)) W.
    mma_tc_acc<kChunk, K, kChunk, false, kU, false>(
        dWa,
        [&](int r, int c) {
          return (c < r ? bs[r] * dUs[r * LC + c] : 0.f) + (r < c ? bs[c] * dUs[c * LC + r] : 0.f);
        },
        [&](int c, int d) { return Wf[c * LW + d]; });
    __syncthreads();
    if (tid < kChunk) {
      float v = 0.f;
      for (int c = 0; c < tid; ++c) v += Zs[tid * LC + c];
      dbs[tid] += v;
    }
    __syncthreads();
    PA_PROBE(14);
  }

  // Outputs (column pairs by one store each where the tensors' alignment allows).
  __device__ __forceinline__ void store_outputs(Acc& dWa, Acc& dKa) {
    if (r0 < nq) {  // a non-finite row: every key's gradient reaches through it (computed here from zeros)
      TK::each_pair(dWa, [&](int, int, float& v, float& u) { v = u = nan_f32(); });
      TK::each_pair(dKa, [&](int, int, float& v, float& u) { v = u = nan_f32(); });
      if (tid < kChunk) dbs[tid] = nan_f32();
    }
    T* dkp = static_cast<T*>(p.dk);
    const bool dk_pair = vec2_ok(dkp, p.dk_s[0], p.dk_s[1], p.dk_s[2]);
    TK::each_pair(dKa, [&](int r, int d, float& v, float& u) {
      if (r < nq) store2(dkp + ch.b * p.dk_s[0] + (pos0 + r) * p.dk_s[1] + h * p.dk_s[2] + d, v, u, dk_pair);
    });
    if (p.path) {
      const bool dw_pair = vec2_ok_param(p.dw, p.dw_dt, p.dw_s[0], p.dw_s[1], p.dw_s[2]);
      TK::each_pair(dWa, [&](int r, int d, float& v, float& u) {
        if (r < nq)
          store_param2(p.dw, p.dw_dt, ch.b * p.dw_s[0] + (pos0 + r) * p.dw_s[1] + h * p.dw_s[2] + d, v, u, dw_pair);
      });
      if (tid < nq)
        store_param(p.dbeta, p.dbeta_dt, ch.b * p.dbeta_s[0] + (pos0 + tid) * p.dbeta_s[1] + h * p.dbeta_s[2], dbs[tid]);
    }
    PA_PROBE(15);
  }
};

template <typename T, int K, bool kStageDA, bool kStageDQ>
__global__ void __launch_bounds__(kThreads) bwd_chunk_kernel(KernelParams p) {
  using TK = TcTile<kChunk, K>;
  extern __shared__ __align__(16) float sm[];
  BwdChunk<T, K, kStageDA, kStageDQ> w(p, sm);
  typename TK::Acc dWa, dKa, dW2a;
  TK::zero(dWa);
  TK::zero(dKa);
  TK::zero(dW2a);
  w.recompute_ut();
  w.key_grads(dWa, dKa, dW2a);
  T* dqp = static_cast<T*>(p.dq);
  const bool dq_pair = vec2_ok(dqp, p.dq_s[0], p.dq_s[1], p.dq_s[2]);
  for (int hq = w.h * p.group; hq < (w.h + 1) * p.group; ++hq) w.query_head(hq, dqp, dq_pair, dWa, dKa, dW2a);
  w.through_ut(dWa, dKa, dW2a);
  w.store_outputs(dWa, dKa);
}

template <typename T, int K>
cudaError_t run_t(const KernelParams& p, cudaStream_t s) {
  int optin = 0;
  const cudaError_t e = device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &optin);
  if (e != cudaSuccess) return e;
  const dim3 grid = item_head_grid(p.nchunks, p.H);
  if (BwdChunkSmem<K, true, true>::bytes <= size_t(optin))
    return launch_with_smem(bwd_chunk_kernel<T, K, true, true>, grid, kThreads, BwdChunkSmem<K, true, true>::bytes, s, p);
  if (BwdChunkSmem<K, true>::bytes <= size_t(optin))
    return launch_with_smem(bwd_chunk_kernel<T, K, true, false>, grid, kThreads, BwdChunkSmem<K, true>::bytes, s, p);
  return launch_with_smem(bwd_chunk_kernel<T, K, false, false>, grid, kThreads, BwdChunkSmem<K, false>::bytes, s, p);
}

}  // namespace

// The smaller of the two variants: what the device must allow at all.
size_t smem_bwd_chunk(int K) { return K == 64 ? BwdChunkSmem<64, false>::bytes : BwdChunkSmem<128, false>::bytes; }

PA_PROBE_TABLE(bwd_chunk)

cudaError_t launch_bwd_chunk(const KernelParams& p, int dtype, cudaStream_t s) {
  if (dtype == 0) return p.K == 64 ? run_t<__half, 64>(p, s) : run_t<__half, 128>(p, s);
  return p.K == 64 ? run_t<__nv_bfloat16, 64>(p, s) : run_t<__nv_bfloat16, 128>(p, s);
}

}  // namespace pathattn::cuda
