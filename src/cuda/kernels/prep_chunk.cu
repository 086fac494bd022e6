// cuda/kernels/prep_chunk.cu: the per-chunk UT transform of the forward and the backward (tf32 tensor
// cores; docs/algorithms.md) and the gate cumsum. Shapes follow params.h; C = kChunk = 64.
#include <algorithm>
#include <type_traits>

#include "cuda/device/common.cuh"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

constexpr int kPrepThreads = kTcThreads;

__device__ __forceinline__ int chunk_rows(const ChunkDesc& ch) {
  return min(kChunk, ch.len - ch.c * kChunk);
}

// Per (chunk, kv head h), on tensor cores (tf32 mma, fp32 accumulation; A and W2 in split tf32, i.e. about
// fp32 accuracy, because they feed the triangular inverse; the inverse's 16 x 16 diagonal blocks in fp32 on
// CUDA cores, the blocks below them in split tf32):
//   A = strict_lower(diag(b) W W^T); E = (I + A)^-1; W2 = E diag(b) W; Z = strict_lower(W K^T);
//   U = E diag(b) Z; k~ = K - U^T W.  Per query head: X = tril_incl(Q W^T); q~ = Q - X W2;
//   A_loc = tril_incl(Q K^T - X U).
// Writes w16, w2h (fp16), kt (dtype T) rows of the chunk, qtl (fp16), aloc (fp32) per query head, and in the
// backward (p.E set) E (fp16 with a power of two a row: store_e).
// q and k stay 16-bit in shared memory (exact in tf32); pitches K + 4 (fp32), 68 and K + 8 (16-bit) keep the
// fragment loads free of bank conflicts (fp32 B operands read as stored are 2-way).
// Shared memory fits two CTAs an SM at K = 128 (latency-bound: a second item hides one's barriers): W2 is kept in
// fp16, and W's fp32 tile becomes fp16 once the split-tf32 products are done, sharing region 0 with the query tile.
// At K = 64 (two CTAs bound by registers) a second query tile Qx lets the next head's queries load during a head.
// Layout: PrepSet (region 0: W fp32 [64][LW], later W fp16 and Q [64][LT]; Ks [64][LT]; beta [64]), then W2 fp16
// [64][LT], R1 and R2 fp32 [64][LC], and with kQx the second query tile.
template <int K>
struct PrepSmem {
  static constexpr int LW = K + 4, LT = K + 8, LC = kChunk + 4;
  static constexpr bool kQx = K == kChunk;
  static constexpr size_t wf = sizeof(float) * kChunk * LW, wh_q = 2 * 2 * size_t(kChunk) * LT;
  static constexpr size_t region0 = wf > wh_q ? wf : wh_q;  // W fp32, then W fp16 and Q
  static constexpr size_t set = region0 + 2 * size_t(kChunk) * LT + sizeof(float) * kChunk;
  static constexpr size_t bytes = set + 2 * size_t(kChunk) * LT + sizeof(float) * 2 * size_t(kChunk) * LC +
                                  (kQx ? 2 * size_t(kChunk) * LT : 0);
  static_assert(region0 % 16 == 0 && set % 16 == 0 && (2 * kChunk * LT) % 16 == 0, "chunk_prep: 16-byte tiles");
};

// Two CTAs per SM where the shared memory holds them (sm_90: 228 KB a SM; sm_80: 164 KB, so one at K = 128).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int prep_min_blocks(int K) { return K == 64 ? 2 : 1; }
#else
constexpr int prep_min_blocks(int) { return 2; }
#endif

// The item's inputs in shared memory (PrepSmem): region 0, the k tile, beta. Staged (stage_prep_set) apart from
// the item's work, each side deriving the item itself, so that the staging's addresses die at the barrier (fewer
// spills at K = 128).
template <typename T, int K>
struct PrepSet {
  float* Wf;  // region 0 until Z
  T* Ks;
  float* bs;
  __device__ PrepSet(uint8_t* base) {
    using S = PrepSmem<K>;
    Wf = reinterpret_cast<float*>(base);
    Ks = reinterpret_cast<T*>(base + S::region0);
    bs = reinterpret_cast<float*>(Ks + kChunk * S::LT);
  }
};

// Item `item` (chunk item / H, kv head item % H)'s k and w tiles and beta into a set. Returns whether this thread
// loaded a non-finite value.
template <typename T, int K>
__device__ __forceinline__ bool stage_prep_set(const KernelParams& p, int item, const PrepSet<T, K>& st) {
  const ChunkDesc ch = p.chunks[item / p.H];
  const int h = item % p.H, nq = chunk_rows(ch);
  const int64_t pos0 = ch.t0 + int64_t(ch.c) * kChunk;
  bool bad = stage_chunk_kw<K>(p, ch.b, pos0, h, nq, st.Ks, PrepSmem<K>::LT, st.Wf, PrepSmem<K>::LW);
  if (threadIdx.x < kChunk) {
    const int r = threadIdx.x;
    const bool ok = r < nq && p.path;
    const float b =
        ok ? load_param(p.beta, p.beta_dt, ch.b * p.beta_s[0] + (pos0 + r) * p.beta_s[1] + h * p.beta_s[2]) : 0.f;
    st.bs[r] = b;
    bad |= !isfinite(b);
  }
  return bad;
}

// A set with a non-finite k, w or beta (rare: the staging saw one): its first row into *bad (kChunk if none), the
// set's rows from there on zeroed (finite.cuh). Ends with the set visible to the block.
template <typename T, int K>
__device__ __forceinline__ void zero_nonfinite_rows(const KernelParams& p, int item, T* Ks, float* Wf, float* bs,
                                                 int* bad) {
  const int nq = chunk_rows(p.chunks[item / p.H]), tid = threadIdx.x;
  int first = zero_nonfinite_tile<K>(Ks, PrepSmem<K>::LT, nq, tid, kPrepThreads);
  first = min(first, zero_nonfinite_tile<K>(Wf, PrepSmem<K>::LW, nq, tid, kPrepThreads));
  first = min(first, zero_nonfinite_vec(bs, nq, tid, kPrepThreads));
  const int r0 = min(block_first_nonfinite(first, bad), kChunk);
  if (r0 < nq) {
    zero_rows_from<K>(Ks, PrepSmem<K>::LT, r0, nq, tid, kPrepThreads);
    zero_rows_from<K>(Wf, PrepSmem<K>::LW, r0, nq, tid, kPrepThreads);
    if (tid >= r0 && tid < nq) bs[tid] = 0.f;
  }
  __syncthreads();
  if (tid == 0) *bad = r0 < nq ? r0 : kChunk;  // read after the item's next barrier
}

// After an item whose row r0 was non-finite (computed with the rows from r0 on zeroed): every k~ (moved across
// that row) and w16 from r0 on become NaN, so that later queries crossing the chunk see it, and A_loc's rows from r0
// on. W2 (and the backward's E) stay as computed: bwd_chunk reads them with the same rows zeroed.
template <typename T, int K>
__device__ __forceinline__ void store_nonfinite_rows(const KernelParams& p, int item, int r0) {
  const ChunkDesc ch = p.chunks[item / p.H];
  const int h = item % p.H, nq = chunk_rows(ch);
  const int64_t tok0 = ch.b * p.T + ch.t0 + int64_t(ch.c) * kChunk;
  T* ktp = static_cast<T*>(p.kt);
  const uint2 nan_t = make_uint2(nan_pair<T>(), nan_pair<T>());
  const uint2 nan_h = make_uint2(nan_pair<__half>(), nan_pair<__half>());
  for (int idx = threadIdx.x; idx < nq * (K / 4); idx += blockDim.x) {
    const int r = idx / (K / 4), d = 4 * (idx % (K / 4));
    const int64_t o = ((tok0 + r) * p.H + h) * K + d;
    *reinterpret_cast<uint2*>(ktp + o) = nan_t;
    if (r >= r0) *reinterpret_cast<uint2*>(p.w16 + o) = nan_h;
  }
  for (int hq = h * p.group; hq < (h + 1) * p.group; ++hq)
    for (int idx = threadIdx.x; idx < (nq - r0) * kChunk; idx += blockDim.x)
      p.aloc[((tok0 + r0 + idx / kChunk) * p.HQ + hq) * kChunk + idx % kChunk] = nan_f32();
}

// W's fp32 tile -> its fp16 tile over the same region (every thread's reads before the barrier, its writes after).
template <int K>
__device__ __forceinline__ void w_to_half(const float* Wf, __half* Wh, int tid) {
  constexpr int LW = PrepSmem<K>::LW, LT = PrepSmem<K>::LT;
  constexpr int kPer = kChunk * K / 4 / kPrepThreads;
  static_assert(kChunk * K / 4 % kPrepThreads == 0, "chunk_prep: W's conversion in whole steps");
  float4 w[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = tid + i * kPrepThreads;
    w[i] = *reinterpret_cast<const float4*>(Wf + (idx / (K / 4)) * LW + 4 * (idx % (K / 4)));
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = tid + i * kPrepThreads;
    *reinterpret_cast<uint2*>(Wh + (idx / (K / 4)) * LT + 4 * (idx % (K / 4))) =
        make_uint2(Pack2<__half>::pack(w[i].x, w[i].y), Pack2<__half>::pack(w[i].z, w[i].w));
  }
}

// A_loc = tril_incl(Q K^T - X U) (X in R2, U in R1) for query head hq: two passes into one accumulator, Q K^T
// on 16-bit mma (q and k are exact in T), X U in tf32; staged in R2 once every warp is past X, stored as 16-byte rows.
template <typename T, int K>
__device__ __forceinline__ void store_aloc(const KernelParams& p, const T* Qc, const T* Ks, const float* R1,
                                           float* R2, int64_t tok0, int hq, int nq, int tid) {
  constexpr int LT = PrepSmem<K>::LT, LC = PrepSmem<K>::LC;
  constexpr int kU = kTcUnroll(K);
  {
    using TA = TcTile<kChunk, kChunk>;
    typename TA::Acc acc;
    TA::zero(acc);
    mma_tc_acc16<kChunk, kChunk, K>(acc, Qc, LT, Ks, LT, kFull.out_lower(0));
    mma_tc_acc<kChunk, kChunk, kChunk, false, kU>(acc, a_rows(static_cast<const float*>(R2), LC),
                                                  [&](int k, int c) { return -R1[k * LC + c]; },
                                                  kFull.out_lower(0).kmax_r(0).kmin_c(1));
    __syncthreads();
    TA::each_pair(acc, [&](int r, int c, float& v, float& u) {
      *reinterpret_cast<float2*>(R2 + r * LC + c) = make_float2(c <= r ? v : 0.f, c + 1 <= r ? u : 0.f);
    });
  }
  __syncthreads();
  for (int idx = tid; idx < nq * (kChunk / 4); idx += blockDim.x) {
    const int r = idx / (kChunk / 4), c = 4 * (idx % (kChunk / 4));
    *reinterpret_cast<float4*>(p.aloc + ((tok0 + r) * p.HQ + hq) * kChunk + c) =
        *reinterpret_cast<const float4*>(R2 + r * LC + c);
  }
}

// One (chunk, kv head) item, from its inputs st (staged and visible to the block); `shared` holds W2h, R1, R2
// and Qx (kQx).
template <typename T, int K>
__device__ __forceinline__ void chunk_prep_item(const KernelParams& p, int item, const PrepSet<T, K>& st,
                                                uint8_t* shared) {
  using S = PrepSmem<K>;
  constexpr int kU = kTcUnroll(K);
  constexpr int LW = S::LW, LT = S::LT, LC = S::LC;
  float* const Wf = st.Wf;
  __half* Wh = reinterpret_cast<__half*>(Wf);  // region 0 after Z: W (fp16), then Q
  T* Qs = reinterpret_cast<T*>(Wh + kChunk * LT);
  T* const Ks = st.Ks;
  float* const bs = st.bs;
  __half* W2h = reinterpret_cast<__half*>(shared);
  float* R1 = reinterpret_cast<float*>(W2h + kChunk * LT);
  float* R2 = R1 + kChunk * LC;
  T* Qx = reinterpret_cast<T*>(R2 + kChunk * LC);  // kQx only

  const ChunkDesc ch = p.chunks[item / p.H];
  const int h = item % p.H, nq = chunk_rows(ch), tid = threadIdx.x;
  const int64_t pos0 = ch.t0 + int64_t(ch.c) * kChunk, tok0 = ch.b * p.T + pos0;
  const T* qp = static_cast<const T*>(p.q);
  const bool qvec = vec4_ok(qp, p.q_s[0], p.q_s[1], p.q_s[2]);

  const TileSrc<T> q_src{qp, p.q_s[0], p.q_s[1], p.q_s[2], qvec};
  const bool q16 = vec16_ok(qp, p.q_s[0], p.q_s[1], p.q_s[2]);
  if constexpr (S::kQx) {  // the first query head's tile, by cp.async (waited for in the heads' loop)
    stage_tile_async<K>(q_src, ch.b, h * p.group, Qx, LT, pos0, nq, q16);
    cp_async_commit();
  }
  // W as the left operand (a(r, k) = W[r][k]) and W^T as the right one (b(k, c) = W[c][k]): paired loads (KRows).
  const auto w_rk = a_rows(static_cast<const float*>(Wf), LW);
  const auto w_kc = b_rows(static_cast<const float*>(Wf), LW);
  // A -> R1 (strict lower), split tf32.
  block_mm_tc<kChunk, kChunk, K, true, kU>(
      w_rk, w_kc, [&](int r, int c, float v) { R1[r * LC + c] = c < r ? bs[r] * v : 0.f; }, kFull.out_lower(-1));
  __syncthreads();
  PA_PROBE(2);
  // E = (I + A)^-1 -> R2 (fp32).
  unit_lower_inverse(R1, LC, R2, LC);
  __syncthreads();
  if (p.E != nullptr)  // the backward: E for bwd_chunk, which would otherwise rebuild A and invert it again
    store_e(p.E + int64_t(item) * kChunk * kChunk, R2, LC, tid >> 5, tid & 31, kPrepThreads / 32);
  PA_PROBE(3);
  // W2 = E diag(b) W (split tf32); Z = strict_lower(W K^T) -> R1.
  block_mm_tc_pairs<kChunk, K, kChunk, true, kU>([&](int r, int s) { return s <= r ? R2[r * LC + s] * bs[s] : 0.f; },
      [&](int s, int d) { return Wf[s * LW + d]; },
      [&](int r, int d, float v, float u) { *reinterpret_cast<uint32_t*>(W2h + r * LT + d) = Pack2<__half>::pack(v, u); },
      kFull.kmax_r(0));
  block_mm_tc<kChunk, kChunk, K, false, kU>(
      w_rk, b_rows(static_cast<const T*>(Ks), LT),
      [&](int r, int c, float v) { R1[r * LC + c] = c < r ? v : 0.f; }, kFull.out_lower(-1));
  // W to fp16 (the remaining products round it to tf32 anyway), freeing region 0's query half for the first head's
  // tile (K = 128; at K = 64 it is loading into Qx) while U and k~ run.
  w_to_half<K>(Wf, Wh, tid);
  if constexpr (!S::kQx) {
    stage_tile_async<K>(q_src, ch.b, h * p.group, Qs, LT, pos0, nq, q16);
    cp_async_commit();
  }
  PA_PROBE(4);
  // U = E diag(b) Z, in place in R1 (strict lower).
  block_mm_tc<kChunk, kChunk, kChunk, false, kU>([&](int r, int t) { return t <= r ? R2[r * LC + t] * bs[t] : 0.f; },
      [&](int t, int c) { return R1[t * LC + c]; }, [&](int r, int c, float v) { R1[r * LC + c] = v; },
      kFull.kmax_r(0).kmin_c(1));
  __syncthreads();
  PA_PROBE(5);
  // k~ = K - U^T W, staged in R2 (E is dead; X takes R2 only after the heads' first barrier), then stored with
  // W and W2 in fp16 as 8-byte row-contiguous stores.
  static_assert(sizeof(T) * kChunk * LT <= sizeof(float) * kChunk * LC, "chunk_prep: k~ staged in R2");
  T* Kst = reinterpret_cast<T*>(R2);
  block_mm_tc_pairs<kChunk, K, kChunk, false, kU>(
      [&](int r, int s) { return R1[s * LC + r]; }, [&](int s, int d) { return __half2float(Wh[s * LT + d]); },
      [&](int r, int d, float v, float u) {
        *reinterpret_cast<uint32_t*>(Kst + r * LT + d) =
            Pack2<T>::pack(to_f(Ks[r * LT + d]) - v, to_f(Ks[r * LT + d + 1]) - u);
      },
      kFull.kmin_r(1));
  __syncthreads();
  T* ktp = static_cast<T*>(p.kt);
  for (int idx = tid; idx < nq * (K / 4); idx += blockDim.x) {  // 4 elements a step (8-byte stores)
    const int r = idx / (K / 4), d = 4 * (idx % (K / 4));
    const int64_t o = ((tok0 + r) * p.H + h) * K + d;
    *reinterpret_cast<uint2*>(ktp + o) = *reinterpret_cast<const uint2*>(Kst + r * LT + d);
    *reinterpret_cast<uint2*>(p.w16 + o) = *reinterpret_cast<const uint2*>(Wh + r * LT + d);
    *reinterpret_cast<uint2*>(p.w2h + o) = *reinterpret_cast<const uint2*>(W2h + r * LT + d);
  }
  // Per query head of the group.
  for (int hq = h * p.group; hq < (h + 1) * p.group; ++hq) {
    __syncthreads();  // the previous head's products are done with their tiles
    PA_PROBE(6);
    T* Qc = Qs;  // this head's query tile
    if constexpr (S::kQx) {
      const int i = hq - h * p.group;
      Qc = i & 1 ? Qs : Qx;
      if (hq + 1 < (h + 1) * p.group) {  // the next head's tile into the other one, while this head's products run
        stage_tile_async<K>(q_src, ch.b, hq + 1, i & 1 ? Qx : Qs, LT, pos0, nq, q16);
        cp_async_commit();
        cp_async_wait_group<1>();
      } else {
        cp_async_wait_all();
      }
    } else {
      if (hq > h * p.group) {
        stage_tile_async<K>(q_src, ch.b, hq, Qs, LT, pos0, nq, q16);
        cp_async_commit();
      }
      cp_async_wait_all();
    }
    __syncthreads();
    PA_PROBE(7);
    // X = tril_incl(Q W^T) -> R2.
    block_mm_tc<kChunk, kChunk, K, false, kU>(a_rows(static_cast<const T*>(Qc), LT),
                                              b_rows(static_cast<const __half*>(Wh), LT),
                                              [&](int r, int c, float v) { R2[r * LC + c] = c <= r ? v : 0.f; },
                                              kFull.out_lower(0));
    __syncthreads();
    PA_PROBE(8);
    // q~ = Q - X W2 (unread by plain attention, but skipping it there spilled on the transport's path).
    block_mm_tc_pairs<kChunk, K, kChunk, false, kU>(a_rows(static_cast<const float*>(R2), LC),
        [&](int s, int d) { return __half2float(W2h[s * LT + d]); },
        [&](int r, int d, float v, float u) {
          if (r < nq)
            *reinterpret_cast<uint32_t*>(p.qtl + ((tok0 + r) * p.HQ + hq) * K + d) =
                Pack2<__half>::pack(to_f(Qc[r * LT + d]) - v, to_f(Qc[r * LT + d + 1]) - u);
        },
        kFull.kmax_r(0));
    store_aloc<T, K>(p, Qc, Ks, R1, R2, tok0, hq, nq, tid);
  }
  PA_PROBE(9);
}

template <typename T, int K>
__global__ void __launch_bounds__(kPrepThreads, prep_min_blocks(K)) chunk_prep_kernel(KernelParams p) {
  using S = PrepSmem<K>;
  extern __shared__ __align__(16) uint8_t prep_smem[];
  const PrepSet<T, K> set0(prep_smem);
  PA_PROBE(0);
  if (p.dP != nullptr) {  // the backward: the item's dP block and rows of dks, summed into by later kernels
    const int ci = int(blockIdx.x) / p.H, h = int(blockIdx.x) % p.H;
    if (blockIdx.x == 0 && threadIdx.x < kBwdCounters && p.counters != nullptr) p.counters[threadIdx.x] = 0;
    zero_f32(p.dP + (int64_t(ci) * p.H + h) * K * K, K * K, threadIdx.x, kPrepThreads);
    if (p.dks != nullptr) {
      const ChunkDesc ch = p.chunks[ci];
      const int64_t tok0 = ch.b * p.T + ch.t0 + int64_t(ch.c) * kChunk;
      for (int i = threadIdx.x; i < chunk_rows(ch) * (K / 4); i += kPrepThreads)
        *reinterpret_cast<float4*>(p.dks + ((tok0 + i / (K / 4)) * p.H + h) * K + 4 * (i % (K / 4))) =
            make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  // A non-finite value seen while staging marks the item for chunk_prep_repair_kernel (0; kChunk: none).
  const bool bad = __syncthreads_or(stage_prep_set<T, K>(p, int(blockIdx.x), set0));
  if (threadIdx.x == 0 && p.bad != nullptr) p.bad[blockIdx.x] = bad ? 0 : kChunk;
  PA_PROBE(1);
  chunk_prep_item<T, K>(p, int(blockIdx.x), set0, prep_smem + S::set);
}

// The items chunk_prep_kernel marked, again (finite.cuh): the staged rows from the first non-finite one (r0) on
// zeroed, the item recomputed over its outputs, then the outputs r0 reaches made NaN, and r0 into p.bad for
// bwd_chunk (kChunk where the mark was an overflow of the check's sums, not a non-finite input). Apart from the
// kernel above so that its rare path costs that kernel no registers; one wave of CTAs walks the items (most
// calls have no marked item, and a launch of one CTA an item would cost several waves of early exits).
template <typename T, int K>
__global__ void __launch_bounds__(kPrepThreads, prep_min_blocks(K)) chunk_prep_repair_kernel(KernelParams p) {
  using S = PrepSmem<K>;
  extern __shared__ __align__(16) uint8_t prep_smem[];
  if (p.bad == nullptr) return;
  // The CTA's items (blockIdx.x + i gridDim.x) checked one per thread first: one load's latency for the common
  // call with none marked.
  const int n = p.nchunks * p.H;
  bool any = false;
  for (int i = blockIdx.x + threadIdx.x * gridDim.x; i < n; i += gridDim.x * blockDim.x) any |= p.bad[i] != kChunk;
  if (!__syncthreads_or(any)) return;
  const PrepSet<T, K> set0(prep_smem);
  __shared__ int bad;
  for (int item = blockIdx.x; item < n; item += gridDim.x) {
    if (p.bad[item] == kChunk) continue;  // (uniform)
    __syncthreads();  // the previous repaired item is done with shared memory
    stage_prep_set<T, K>(p, item, set0);
    __syncthreads();
    zero_nonfinite_rows<T, K>(p, item, set0.Ks, set0.Wf, set0.bs, &bad);
    chunk_prep_item<T, K>(p, item, set0, prep_smem + S::set);
    __syncthreads();
    const int r0 = bad;
    if (threadIdx.x == 0) p.bad[item] = r0;
    if (r0 < kChunk) store_nonfinite_rows<T, K>(p, item, r0);
  }
}


// One warp per (sequence, query head): inclusive cumsum of g in fp32, 32 positions per step, into G and (scaled
// by gate_scale log2(e), by chunk) gc.
__global__ void gate_cumsum_kernel(KernelParams p, const int32_t* seq_first, int nseqs) {
  const int wid = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
  if (wid >= nseqs * p.HQ) return;
  const ChunkDesc ch = p.chunks[seq_first[wid / p.HQ]];
  const int hq = wid % p.HQ;
  const float gl2 = p.gate_scale * 1.4426950408889634f;  // as the kernels scale G
  float carry = 0.f;
  for (int base = 0; base < ch.len; base += 32) {
    const int t = base + lane;
    float x = t < ch.len ? load_param(p.g, p.g_dt, ch.b * p.g_s[0] + (ch.t0 + t) * p.g_s[1] + hq * p.g_s[2]) : 0.f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    x += carry;
    if (t < ch.len) {
      p.G[(ch.b * p.T + ch.t0 + t) * p.HQ + hq] = x;
      p.gc[(int64_t(hq) * p.nchunks + ch.first + t / kChunk) * kChunk + t % kChunk] = x * gl2;
    }
    carry = __shfl_sync(0xffffffffu, x, 31);
  }
}

}  // namespace

size_t smem_chunk_prep(int K) { return K == 64 ? PrepSmem<64>::bytes : PrepSmem<128>::bytes; }

template <typename T, int K>
static cudaError_t prep_t(const KernelParams& p, cudaStream_t s) {
  const dim3 grid = item_head_grid(p.nchunks, p.H);
  cudaError_t e = launch_with_smem(chunk_prep_kernel<T, K>, grid, kPrepThreads, smem_chunk_prep(K), s, p);
  int sms = 0;
  if (e == cudaSuccess) e = device_attr(cudaDevAttrMultiProcessorCount, &sms);
  if (e != cudaSuccess) return e;
  const dim3 wave(unsigned(std::min<int64_t>(int64_t(p.nchunks) * p.H, 2 * int64_t(sms))));
  return launch_with_smem(chunk_prep_repair_kernel<T, K>, wave, kPrepThreads, smem_chunk_prep(K), s, p);
}

PA_PROBE_TABLE(prep)

cudaError_t launch_chunk_prep(const KernelParams& p, int dtype, cudaStream_t s) {
  if (dtype == 0) return p.K == 64 ? prep_t<__half, 64>(p, s) : prep_t<__half, 128>(p, s);
  return p.K == 64 ? prep_t<__nv_bfloat16, 64>(p, s) : prep_t<__nv_bfloat16, 128>(p, s);
}

cudaError_t launch_gate_cumsum(const KernelParams& p, const int32_t* seq_first, int nseqs, cudaStream_t s) {
  const int warps = nseqs * p.HQ, threads = 256;
  gate_cumsum_kernel<<<(warps * 32 + threads - 1) / threads, threads, 0, s>>>(p, seq_first, nseqs);
  return cudaGetLastError();
}

}  // namespace pathattn::cuda
