// cuda/prep.cu: the O(T C K) kernels around the scans: the per-chunk UT transform (tf32 tensor cores,
// ALGORITHMS.md section 2), the superblock products of the forward's two-level scan, the gate cumsum, the
// backward's delta and the final dg reverse cumsum.
// Shapes follow kernel_params.h; C = kChunk = 64.
#include <type_traits>

#include "cuda/common.cuh"
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
// q and k stay in their 16-bit type in shared memory (exact in tf32). Leading dims K + 4 (fp32) and
// 68 keep the [row][k] fragment loads (A operands, B operands read transposed) free of bank conflicts; fp32
// [k][col] reads (B operands as stored) are 2-way (measured: ~20% of the chunk kernels' shared wavefronts are
// conflicts, dev/cuda/NOTES.md v3.21); the 16-bit tiles (K + 8) are free in both patterns.
// Shared memory fits two CTAs per SM at K = 128 (these kernels are latency-bound: a second item hides one's
// barriers and loads): W2 is kept in fp16 (the w2h the scans use; the products that read it round it to tf32,
// the same 10-bit mantissa), and W's fp32 tile, needed in fp32 only by the split-tf32 products A and W2, becomes
// an fp16 tile once they are done, sharing its space with the query tile of the per-head products. At K = 64,
// where two CTAs an SM are bounded by registers, not by shared memory, a second query tile (Qx) lets the query
// heads' tiles load by cp.async while the CTA works: the first head's from the start, each next head's while
// the current one's products run (the two tiles alternate).
// Layout: the item's inputs (region 0 with W fp32 [64][LW], later W fp16 and Q [64][LT] each; Ks [64][LT]; beta
// [64]: PrepSet), then W2 fp16 [64][LT], R1 and R2 fp32 [64][LC], and with kQx the second query tile.
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

// The item's inputs in shared memory (PrepSmem): region 0, the k tile, beta. They are staged (stage_prep_set)
// apart from the item's work (chunk_prep_item), each side deriving the item's chunk and head itself, so that the
// staging's addresses die at the barrier between them: ptxas spills at K = 128 76 / 128 -> 52 / 84 bytes,
// chunk_prep -3% (dev/cuda/NOTES.md v3.28).
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

// Item `item` (chunk item / H, kv head item % H)'s k and w tiles and beta into a set.
template <typename T, int K>
__device__ __forceinline__ void stage_prep_set(const KernelParams& p, int item, const PrepSet<T, K>& st) {
  const ChunkDesc ch = p.chunks[item / p.H];
  const int h = item % p.H, nq = chunk_rows(ch);
  const int64_t pos0 = ch.t0 + int64_t(ch.c) * kChunk;
  stage_chunk_kw<K>(p, ch.b, pos0, h, nq, st.Ks, PrepSmem<K>::LT, st.Wf, PrepSmem<K>::LW);
  if (threadIdx.x < kChunk) {
    const int r = threadIdx.x;
    const bool ok = r < nq && p.path;
    st.bs[r] = ok ? p.beta[ch.b * p.beta_s[0] + (pos0 + r) * p.beta_s[1] + h * p.beta_s[2]] : 0.f;
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
  // W's fp32 tile -> its fp16 tile in region 0 (every thread's reads before the barrier, its writes after): the
  // split products that need fp32 W are done, and the rest round it to tf32's 10-bit mantissa anyway. That frees
  // the query tile's half of region 0, where the first query head's tile then loads by cp.async (K = 128; at
  // K = 64 it is loading into Qx since the start) while U and k~ run.
  {
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
  // k~ = K - U^T W, staged in R2 (E is not read any more; X takes R2 only after the heads' first barrier), then
  // stored with the fp16 copies of W and W2: 8-byte row-contiguous stores, where the product's epilogue would
  // store element pairs through 64-bit addresses of their own (v3.31 in dev/cuda/NOTES.md).
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
    // q~ = Q - X W2. Plain attention's readers take q itself (load_qstate), so there the store is unread; skipping
    // the product for it cost chunk_prep<T, 128> 8 / 12 bytes of spills on the transport's path (ptxas, sm_90a).
    block_mm_tc_pairs<kChunk, K, kChunk, false, kU>(a_rows(static_cast<const float*>(R2), LC),
        [&](int s, int d) { return __half2float(W2h[s * LT + d]); },
        [&](int r, int d, float v, float u) {
          if (r < nq)
            *reinterpret_cast<uint32_t*>(p.qtl + ((tok0 + r) * p.HQ + hq) * K + d) =
                Pack2<__half>::pack(to_f(Qc[r * LT + d]) - v, to_f(Qc[r * LT + d + 1]) - u);
        },
        kFull.kmax_r(0));
    // A_loc = tril_incl(Q K^T - X U): two passes into one accumulator, Q K^T on 16-bit mma (q and k are exact in
    // T), X U in tf32; staged in R2 (X is not read once every warp is past the barrier), then stored as 16-byte
    // rows.
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
  PA_PROBE(9);
}

// Zeroes n floats at dst (16-byte aligned, n a multiple of 4) with the threads [0, nthreads) of a block.
__device__ __forceinline__ void zero_f32(float* dst, int n, int tid, int nthreads) {
  for (int i = 4 * tid; i < n; i += 4 * nthreads) *reinterpret_cast<float4*>(dst + i) = make_float4(0.f, 0.f, 0.f, 0.f);
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
  stage_prep_set<T, K>(p, int(blockIdx.x), set0);
  __syncthreads();
  PA_PROBE(1);
  chunk_prep_item<T, K>(p, int(blockIdx.x), set0, prep_smem + S::set);
}

// Per (full superblock, kv head, block of RB rows of M): walks the superblock's chunks from the last
// down with the running product M = P_last ... P_{c+1}: ks_c = k~_c M^T, then M <- M P_c = M - (M W_c^T) W2_c
// with the fp16 W, W2 of the chunk (the same operands the scans transport with, fp32 accumulation). Rows of M
// evolve apart (right products) and row n of M gives column n of ks_c, so each warp owns 16 rows of M in
// registers (C layout, fp32), steps them on fp16 mma with M and y = M W^T rounded to fp16 as operands (as
// fwd_scan steps its queries: their entries are bounded by 1 for unit w and beta in [0, 2], and fp16 keeps tf32's
// 10-bit mantissa), and computes its 16 columns of ks_c as M_rows k~_c^T on 16-bit mma in the input type (k~'s):
// M in fp16 with fp16 inputs, split into a bf16 head and tail with bf16 inputs (warp_mma_rs with kSplit: about 16
// significant bits of M, where tf32 kept 11; until v3.67 tf32 with k~'s elements through scalar loads): no CTA
// barrier inside a chunk step, one per
// step for the chunk tiles (two sets, the next chunk's loading by cp.async while this chunk's products run).
// An item may run as K / RB CTAs of RB / 16 warps (super_rows): the chain is serial (8 chunk steps an item),
// and a call with few items (one kv head of a sliced call: 32 items at T = 1k) would leave most SMs idle,
// while with items enough to fill the device the split only repeats the tile loads. At the end
// M = P_last ... P_first is stored in fp16 (entries bounded by 1 for unit w and beta in [0, 2]); in the backward
// (p.msv set) also each step's M, which super_bwd's dP products take. kKs false: the backward's second launch,
// where msv had no room beside the buffers live from here to super_bwd (backend.cu, bwd): the same steps of M
// (the same instructions for M, so the same bits) without ks, ps or k~'s tiles, storing M only.
constexpr int kSuperRows = 32;  // the smallest row block

// Two sets of a chunk's k~, W and W2 tiles ([64][K + 8] 16-bit each); with the column split, each warp's
// exchange slot for its two 16 x 64 partial products (64 floats a lane).
template <int K, int kXWarps = 0>
struct SuperSmem {
  static constexpr int LT = K + 8;
  static constexpr size_t tiles = 3 * 2 * size_t(kChunk) * LT;  // one set
  static constexpr size_t xch = size_t(kXWarps) * 64 * 32 * sizeof(float);
  static constexpr size_t bytes = 2 * tiles + xch;
};

// kSplit = 2 (few items): a pair of warps shares each 16-row block, each holding half of M's columns; their
// partial products (ks_c and y, sums over the columns) are exchanged through shared memory at a pair barrier,
// which halves a warp's products on the serial chain. Without the split a warp sums the same two halves the
// same way (each half's products in one accumulation, then first half + second half), so that ks and PS have
// the same bits whichever the row block: a call's slices (fewer items, so smaller blocks) give the whole
// call's results.
template <typename T, int K, int RB, int kSplit, bool kKs>
__global__ void __launch_bounds__(2 * RB * kSplit) super_prep_kernel(KernelParams p) {
  constexpr int kWarps = RB / 16 * kSplit, kThreads = 32 * kWarps, KH = K / kSplit;  // KH: M's columns a warp holds
  using S = SuperSmem<K, kSplit == 2 ? kWarps : 0>;
  constexpr int LT = S::LT, NB = K / RB;
  extern __shared__ __align__(16) uint8_t sets[];  // per set: k~, W, W2; then the exchange slots
  float* xch = reinterpret_cast<float*>(sets + 2 * S::tiles);

  // Row blocks fastest: the CTAs of one item run side by side and share their tiles through L2.
  const int j0 = int(blockIdx.x % NB) * RB, item = int(blockIdx.x / NB);
  const int sbi = item / p.H, h = item % p.H, tid = threadIdx.x, warp = tid >> 5;
  const int rg = warp / kSplit, hf = warp % kSplit, c0k = hf * KH;  // row group, column half
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3, row0 = j0 + 16 * rg + g;  // rows row0, row0 + 8
  const int c0 = p.super_first[sbi];
  const ChunkDesc ch = p.chunks[c0];
  const int64_t tok0 = ch.b * p.T + ch.t0 + int64_t(ch.c) * kChunk;  // first token of the superblock
  // The backward's first launch: this block's rows of dPS, summed into by later kernels.
  if (kKs && p.dps != nullptr) zero_f32(p.dps + ((int64_t(sbi) * p.H + h) * K + j0) * K, RB * K, tid, kThreads);
  const T* ktp = static_cast<const T*>(p.kt);
  T* ksp = static_cast<T*>(p.ks);
  // Chunk c's three tiles into set `set` by cp.async, 16 bytes a copy (every chunk of a full superblock has
  // kChunk rows).
  auto issue = [&](int c, int set) {
    constexpr int kPerRow = K / 8, kPerTile = kChunk * kPerRow;
    const int64_t row = ((tok0 + int64_t(c) * kChunk) * p.H + h) * K, stride = int64_t(p.H) * K;
    uint8_t* base = sets + set * S::tiles;
    for (int i = kKs ? tid : kPerTile + tid; i < 3 * kPerTile; i += kThreads) {
      const int tile = i / kPerTile, r = (i % kPerTile) / kPerRow, c8 = 8 * (i % kPerRow);
      const void* src = tile == 0 ? static_cast<const void*>(ktp + row + r * stride + c8)
                                  : static_cast<const void*>((tile == 1 ? p.w16 : p.w2h) + row + r * stride + c8);
      cp_async16(base + (size_t(tile) * kChunk * LT + size_t(r) * LT + c8) * 2, src, true);
    }
    cp_async_commit();
  };
  // With the split: adds the pair partner's partials of ks and y (the same C layout) to this warp's.
  auto exchange = [&](float (&ks)[kChunk / 8][4], float (&y)[kChunk / 8][4]) {
    float* mine = xch + size_t(warp) * 64 * 32 + lane;
    const float* theirs = xch + size_t(warp ^ 1) * 64 * 32 + lane;
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mine[(4 * nt + e) * 32] = ks[nt][e];
        mine[(32 + 4 * nt + e) * 32] = y[nt][e];
      }
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + rg) : "memory");  // the pair's slots written
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ks[nt][e] += theirs[(4 * nt + e) * 32];
        y[nt][e] += theirs[(32 + 4 * nt + e) * 32];
      }
  };
  float M[KH / 8][4];  // rows row0, row0 + 8 of M, columns c0k .. c0k + KH - 1: C layout
#pragma unroll
  for (int nt = 0; nt < KH / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) M[nt][e] = row0 + 8 * (e >> 1) == c0k + 8 * nt + 2 * t4 + (e & 1) ? 1.f : 0.f;
  issue(p.sc - 1, 0);
  for (int c = p.sc - 1; c >= 0; --c) {
    const int64_t t0 = tok0 + int64_t(c) * kChunk;
    const int set = (p.sc - 1 - c) & 1;
    const T* Kt = reinterpret_cast<const T*>(sets + set * S::tiles);
    const __half* Ws = reinterpret_cast<const __half*>(Kt + kChunk * LT);
    const __half* W2s = Ws + kChunk * LT;
    if (p.msv != nullptr) {  // the backward: M_c (this step's M) for super_bwd, fp16 as M's operand here
      __half* mo = p.msv + ((int64_t(sbi) * p.H + h) * p.sc + c) * K * K;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int nt = 0; nt < KH / 8; ++nt)
          *reinterpret_cast<uint32_t*>(mo + int64_t(row0 + 8 * hr) * K + c0k + 8 * nt + 2 * t4) =
              Pack2<__half>::pack(M[nt][2 * hr], M[nt][2 * hr + 1]);
    }
    __syncthreads();  // every warp is done with the other set (the previous chunk's products) and the slots
    if (c > 0) {
      issue(c - 1, set ^ 1);
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();  // this chunk's tiles, every thread's copies
    // ks_c[r, row] = (M_rows k~_c^T)[row, r] and y = M_rows W^T (over this warp's columns, then the pair's sum);
    // then M <- M - y W2.
    float ks[kChunk / 8][4], y[kChunk / 8][4];
    zero_acc(ks);
    zero_acc(y);
    // ks's product over KT2 steps of 16 of M's columns: M in fp16 with fp16 k~ (M's entries are at most 1:
    // fp16's significand is tf32's), split into a bf16 head and tail with bf16 k~.
    auto ks_product = [&](float(&acc)[kChunk / 8][4], const auto& src, const T* B) {
      constexpr int KT2 = int(sizeof(src) / sizeof(src[0])) / 2;
      if constexpr (std::is_same_v<T, __half>) warp_mma_rs<__half, KT2, kChunk / 8, false>(acc, src, 1.f, B, LT, 0);
      else warp_mma_rs<T, KT2, kChunk / 8, false, true>(acc, src, 1.f, B, LT, 0);
    };
    if constexpr (kSplit == 2) {
      if constexpr (kKs) ks_product(ks, M, Kt + c0k);
      warp_mma_rs<__half, KH / 16, kChunk / 8, false>(y, M, 1.f, Ws + c0k, LT, 0);
      exchange(ks, y);
    } else {  // the split's arithmetic: the column halves apart, then their sum
      using Half = const float(&)[K / 16][4];
      Half lo = *reinterpret_cast<const float(*)[K / 16][4]>(&M[0][0]);
      Half hi = *reinterpret_cast<const float(*)[K / 16][4]>(&M[K / 16][0]);
      float part[kChunk / 8][4];
      if constexpr (kKs) {
        ks_product(ks, lo, Kt);
        zero_acc(part);
        ks_product(part, hi, Kt + K / 2);
        add_acc(ks, part);
      }
      warp_mma_rs<__half, K / 32, kChunk / 8, false>(y, lo, 1.f, Ws, LT, 0);
      zero_acc(part);
      warp_mma_rs<__half, K / 32, kChunk / 8, false>(part, hi, 1.f, Ws + K / 2, LT, 0);
      add_acc(y, part);
    }
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt) {
      // With the split, each warp of a pair stores half the keys.
      if (kKs && (kSplit == 1 || nt / (kChunk / 16) == hf)) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 8 * nt + 2 * t4 + (e & 1), j = row0 + 8 * (e >> 1);
          ksp[((t0 + r) * p.H + h) * K + j] = from_f<T>(ks[nt][e]);
        }
      }
    }
    warp_mma_rs<__half, kChunk / 16, KH / 8, true>(M, y, -1.f, W2s + c0k, LT, 0);
  }
  if constexpr (!kKs) return;
  __half* out = p.ps + (int64_t(sbi) * p.H + h) * K * K;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int nt = 0; nt < KH / 8; ++nt)
      *reinterpret_cast<uint32_t*>(out + int64_t(row0 + 8 * hr) * K + c0k + 8 * nt + 2 * t4) =
          Pack2<__half>::pack(M[nt][2 * hr], M[nt][2 * hr + 1]);
}

// Backward of the superblock products, per (full superblock, kv head) and block of MR rows (super_rows; all
// K rows in deterministic mode); persistent grid. With M_c = P_last ... P_{c+1} (M_last = I), PS = M_0 P_0 and
// the far keys ks_c = k~_c M_c^T, the gradients dPS (query side) and dks (key side) reach the chunk products as
//   dP_c += M_c^T R_c,   R_0 = dPS,   R_{c+1} = R_c P_c^T + dks_c^T k~_c
// (added to dP, which the query side filled for the pairs inside a superblock). The key-side chain already
// carried the far gradient into dk~. Both chains are right products, so a block of rows of M and R runs on
// its own; dP_c is then the sum over the blocks of M_c[J, :]^T R_c[J, :], added with fp32 atomics. With
// MR = K (deterministic mode) there is one block and a fixed order. tf32 mma, fp32 accumulation. The M_c are
// the ones super_prep stepped through for ks (p.msv, fp16, which holds the tf32 operand's 11 significant bits
// for entries of 6.1e-5 .. 65504; a product of factors of norm <= 1 has entries <= 1): so the dP product reads
// them instead of running the chain again (dev/cuda/NOTES.md v3.54).
// kMode >= 1: two sets of a chunk's tiles, the next chunk's loading by cp.async while this chunk's products run
// (where the device's shared memory holds them: not at MR = K = 128 on Hopper), else one, staged when needed.
// kMode == 2 (where that fits too): also M_c staged from p.msv (Ms, by cp.async during the step
// before), so that the dP product reads its A operand from shared memory rather than from L2 inside its k loop.
// Its products take the plain warp index (kUW false, as bwd_chunk's): the shuffled one saved registers here but
// ran 1 .. 2% slower (dev/cuda/NOTES.md v3.47).
// kF16 (kStageM with row blocks of 64 rows or more): R stays in registers (fp32, TcTile<MR, K>'s layout) and
// reaches shared memory as an fp16 copy R16 scaled by one power of two for the block (its largest entry into
// [0.5, 1), as bwd_q stages dP / dPS), so that the dP and Y products (and Y's into R, on Y16 = Y in that scale)
// run on m16n8k16 with ldmatrix fragments: M_c, W and W2 are fp16 already. dks^T k~ stays tf32 (k~ is in the
// input type).
template <int K, int MR, int kMode>
struct SuperBwdSmem {
  static constexpr int LM = K + 4, LY = kChunk + 4, LT = K + 8;
  static constexpr size_t set = 3 * 2 * size_t(kChunk) * LT;  // a chunk's k~, W and W2 tiles
  static constexpr bool kPrefetch = kMode >= 1, kStageM = kMode == 2, kF16 = kStageM && MR >= 64;
  static constexpr int LR = K + 8, LY16 = kChunk + 8;  // R16's and Y16's pitches (halves)
  // Rf [MR][LM], Yf [MR][LY] (kF16: R16 [MR][LR], Y16 [MR][LY16] fp16), dKs [64][LM].
  static constexpr size_t base =
      kF16 ? sizeof(float) * size_t(kChunk) * LM + sizeof(__half) * (size_t(MR) * LR + size_t(MR) * LY16)
           : sizeof(float) * (size_t(MR) * LM + size_t(MR) * LY + size_t(kChunk) * LM);
  static constexpr int LMS = K + 8;  // Ms's pitch (halves): a fragment's (row, k) reads fall in 16 words
  static constexpr size_t ms = kStageM ? sizeof(__half) * size_t(MR) * LMS : 0;
  static constexpr size_t bytes = base + (kPrefetch ? 2 : 1) * set + ms;
};

template <typename T, int K, int MR, int kMode>
__global__ void __launch_bounds__(kPrepThreads, 1) super_bwd_kernel(KernelParams p, int nitems) {
  using S = SuperBwdSmem<K, MR, kMode>;
  constexpr int LM = S::LM, LY = S::LY, LT = S::LT, LR = S::LR, LY16 = S::LY16, NB = K / MR;
  constexpr bool kF16 = S::kF16;
  extern __shared__ float sm[];
  float* Rf = sm;                 // rows j0 .. j0 + MR - 1 of R (not kF16)
  float* Yf = Rf + MR * LM;       // (not kF16)
  float* dKs = kF16 ? sm : Yf + MR * LY;  // [64][LM] dks of one chunk
  __half* R16 = reinterpret_cast<__half*>(dKs + kChunk * LM);  // kF16: [MR][LR]
  __half* Y16 = R16 + MR * LR;                                 // kF16: [MR][LY16]
  uint8_t* sets = kF16 ? reinterpret_cast<uint8_t*>(Y16 + MR * LY16)
                       : reinterpret_cast<uint8_t*>(dKs + kChunk * LM);  // per set: k~, W, W2 ([64][LT] each)
  __half* Ms = reinterpret_cast<__half*>(sets + (S::kPrefetch ? 2 : 1) * S::set);  // [MR][LMS] M_c (kStageM)
  auto kt_of = [&](int st) { return reinterpret_cast<T*>(sets + st * S::set); };
  auto w_of = [&](int st) { return reinterpret_cast<__half*>(kt_of(st) + kChunk * LT); };  // W2 follows W
  const T* ktp = static_cast<const T*>(p.kt);
  const int tid = threadIdx.x;
  // An item's chunk tiles in the order they are used, load i = chunk i (W, W2, k~) for i = 0 .. p.sc - 2; load i
  // in set i & 1 with the prefetch, else in set 0.
  const int loads = p.sc - 1;
  auto set_of = [](int i) { return S::kPrefetch ? (i & 1) : 0; };
  static_assert(kPrepThreads >= 3 * kTileThreads, "super_bwd: one thread group per tile");
  // kF16: this thread's entries of R (fp32), and R16 = R 2^-e for the block's e (every thread's part written;
  // the block's maximum through one barrier); returns 2^e.
  using TR = TcTile<MR, K>;
  __shared__ float rmax[kTcWarps];
  auto publish_r = [&](typename TR::Acc& rv) {
    float mx = 0.f;
#pragma unroll
    for (int mi = 0; mi < TR::MPW; ++mi) mx = fmaxf(mx, lane_abs_max(rv[mi]));
    const int e = scale_exp(block_max<kTcWarps>(mx, rmax));
    const float down = ldexpf(1.f, -e);
    TR::each_pair(rv, [&](int r, int n, float& v, float& w) {
      *reinterpret_cast<__half2*>(R16 + r * LR + n) = __floats2half2_rn(v * down, w * down);
    });
    return ldexpf(1.f, e);
  };

  for (int it = blockIdx.x; it < nitems * NB; it += gridDim.x) {
    const int j0 = (it % NB) * MR, item = it / NB;
    const int sbi = item / p.H, h = item % p.H;
    const int c0 = p.super_first[sbi];
    const ChunkDesc ch = p.chunks[c0];
    const int64_t tok0 = ch.b * p.T + ch.t0 + int64_t(ch.c) * kChunk, stride = int64_t(p.H) * K;
    const __half* Mit = p.msv + (int64_t(sbi) * p.H + h) * p.sc * K * K + int64_t(j0) * K;  // rows j0.. of M_c
    auto row_of = [&](int c) { return ((tok0 + int64_t(c) * kChunk) * p.H + h) * K; };
    auto issue = [&](int i) {  // prefetch: load i by cp.async, one thread group a tile, committed
      const int64_t row = row_of(i);
      __half* w = w_of(set_of(i));
      const int grp = tid / kTileThreads, gt = tid % kTileThreads;
      if (grp == 0) load_tile_async<K>(w, p.w16 + row, stride, kChunk, gt);
      else if (grp == 1) load_tile_async<K>(w + kChunk * LT, p.w2h + row, stride, kChunk, gt);
      else if (grp == 2) load_tile_async<K>(kt_of(set_of(i)), ktp + row, stride, kChunk, gt);
      cp_async_commit();
    };
    auto issue_m = [&](int c) {  // prefetch: M_c's rows of this block (from super_prep) into Ms, committed
      const __half* src = Mit + size_t(c) * K * K;
      for (int idx = tid; idx < MR * K / 8; idx += blockDim.x) {
        const int r = idx / (K / 8), col = 8 * (idx % (K / 8));
        cp_async16(Ms + r * S::LMS + col, src + r * K + col, true);
      }
      cp_async_commit();
    };
    auto issue_dks = [&](int c) {  // prefetch: chunk c's dks rows (fp32) by cp.async, committed
      const float* src = p.dks + row_of(c);
      for (int idx = tid; idx < kChunk * K / 4; idx += blockDim.x) {
        const int r = idx / (K / 4), col = 4 * (idx % (K / 4));
        cp_async16(dKs + r * LM + col, src + r * stride + col, true);
      }
      cp_async_commit();
    };
    // Load i's tiles (and dks) in place for this thread; callers sync before reading them. With the prefetch the
    // copies were issued a step earlier, and the next load is in flight.
    auto wait_load = [&](int i) {
      if constexpr (S::kPrefetch) {
        if (i + 1 < loads) cp_async_wait_group<1>();
        else cp_async_wait_all();
      } else {
        const int64_t t0 = tok0 + int64_t(i) * kChunk;
        stage_tiles4<K>(ws_src<K>(p.w16, p.H), 0, h, w_of(0), LT, ws_src<K>(p.w2h, p.H), 0, h, w_of(0) + kChunk * LT,
                        LT, t0, kChunk);
        stage_tiles4<K>(ws_src<K>(ktp, p.H), 0, h, kt_of(0), LT, ws_src<K>(p.dks, p.H), 0, h, dKs, LM, t0, kChunk);
      }
    };
    // ---- R_0 = dPS; dP_c += M_c^T R_c; R_{c+1} = R_c - (R_c W2_c^T) W_c + dks_c^T k~_c.
    __syncthreads();  // the previous item is done with the shared tiles
    if constexpr (S::kPrefetch) {
      if (loads > 0) issue(0);
    }
    const float* dps = p.dps + (int64_t(sbi) * p.H + h) * K * K + int64_t(j0) * K;
    typename TR::Acc rv;  // kF16: this thread's entries of R
    float up = 1.f;       // kF16: R = R16 up
    if constexpr (kF16) {
      TR::each_pair(rv, [&](int r, int n, float& v, float& w) {
        const float2 x = *reinterpret_cast<const float2*>(dps + r * K + n);
        v = x.x;
        w = x.y;
      });
      up = publish_r(rv);
    } else {
      for (int idx = tid; idx < MR * K; idx += blockDim.x) Rf[(idx / K) * LM + idx % K] = dps[idx];
    }
    if constexpr (S::kStageM) issue_m(0);
    for (int c = 0; c < p.sc; ++c) {
      __syncthreads();
      const int i = c;
      if constexpr (S::kPrefetch) {
        if (c < p.sc - 1) {
          issue_dks(c);
          if (i + 1 < loads) issue(i + 1);
        }
      }
      if constexpr (S::kStageM) {  // M_c, issued a step earlier (this step's dks and next tiles may stay in flight)
        if (c < p.sc - 1 && i + 1 < loads) cp_async_wait_group<2>();
        else if (c < p.sc - 1) cp_async_wait_group<1>();
        else cp_async_wait_all();
        __syncthreads();
      }
      // The dP product's A operand, M_c^T: staged (kStageM) or from p.msv.
      auto mct = [&](int r, int k) {
        if constexpr (S::kStageM) return __half2float(Ms[k * S::LMS + r]);
        else return __half2float(Mit[size_t(c) * K * K + size_t(k) * K + r]);
      };
      float* dP = p.dP + (int64_t(c0 + c) * p.H + h) * K * K;
      if constexpr (kF16) {  // dP_c += (M_c^T R16) up
        typename TcTile<K, K>::Acc acc;
        TcTile<K, K>::zero(acc);
        mma_tc_acc16<K, K, MR, __half, true, true>(acc, Ms, S::LMS, R16, LR);
        if constexpr (NB == 1) TcTile<K, K>::each(acc, [&](int r, int n, float& v) { dP[r * K + n] += v * up; });
        else red_add_tile<K, K>(dP, K, acc, up);
      } else if constexpr (NB == 1) {
        block_mm_tc<K, K, MR, false, 4, false>(mct, [&](int k, int n) { return Rf[k * LM + n]; },
                                               [&](int r, int n, float v) { dP[r * K + n] += v; });
      } else {  // the row blocks' partials: vector reductions (no barrier needed: the operands stay as they are)
        typename TcTile<K, K>::Acc acc;
        TcTile<K, K>::zero(acc);
        mma_tc_acc<K, K, MR, false, 4, false>(acc, mct, [&](int k, int n) { return Rf[k * LM + n]; });
        red_add_tile<K, K>(dP, K, acc);
      }
      if (c == p.sc - 1) break;
      wait_load(i);
      __syncthreads();  // (also: every warp is done with Ms)
      if constexpr (S::kStageM) issue_m(c + 1);
      const T* Kt = kt_of(set_of(i));
      const __half* Ws = w_of(set_of(i));
      const __half* W2s = Ws + kChunk * LT;
      if constexpr (kF16) {
        // Y16 = R16 W2^T (R's scale); R += -(Y16 W) up + dks^T k~; R16 again.
        {
          typename TcTile<MR, kChunk>::Acc y;
          TcTile<MR, kChunk>::zero(y);
          mma_tc_acc16<MR, kChunk, K, __half>(y, R16, LR, W2s, LT);
          TcTile<MR, kChunk>::each_pair(y, [&](int r, int n, float& v, float& w) {
            *reinterpret_cast<__half2*>(Y16 + r * LY16 + n) = __floats2half2_rn(v, w);
          });
        }
        __syncthreads();
        typename TR::Acc acc;
        TR::zero(acc);
        mma_tc_acc16<MR, K, kChunk, __half, false, true>(acc, Y16, LY16, Ws, LT);
        TR::each(acc, [&](int, int, float& v) { v *= -up; });
        mma_tc_acc<MR, K, kChunk, false, 4, false>(acc, [&](int r, int k) { return dKs[k * LM + j0 + r]; },
                                                   [&](int k, int n) { return to_f(Kt[k * LT + n]); });
#pragma unroll
        for (int mi = 0; mi < TR::MPW; ++mi) add_acc(rv[mi], acc[mi]);
        up = publish_r(rv);
      } else {
      block_mm_tc<MR, kChunk, K, false, 4, false>(a_rows(static_cast<const float*>(Rf), LM), b_rows(W2s, LT),
                                                  [&](int r, int n, float v) { Yf[r * LY + n] = v; });
      __syncthreads();
      block_mm_tc2<MR, K, kChunk, kChunk, false, 4, false>(
          a_rows<true>(static_cast<const float*>(Yf), LY), [&](int k, int n) { return __half2float(Ws[k * LT + n]); },
          [&](int r, int k) { return dKs[k * LM + j0 + r]; }, [&](int k, int n) { return to_f(Kt[k * LT + n]); },
          [&](int r, int n, float v) { Rf[r * LM + n] += v; });
      }
    }
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
    float x = t < ch.len ? p.g[ch.b * p.g_s[0] + (ch.t0 + t) * p.g_s[1] + hq * p.g_s[2]] : 0.f;
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
    if (t < ch.len) p.dg[ch.b * p.dg_s[0] + (ch.t0 + t) * p.dg_s[1] + hq * p.dg_s[2]] = x;
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

size_t smem_chunk_prep(int K) { return K == 64 ? PrepSmem<64>::bytes : PrepSmem<128>::bytes; }
int super_rows(int K, int items, bool whole, int sms) {
  if (whole) return K;
  int rows = K;
  while (rows > kSuperRows && int64_t(items) * (K / rows) < sms) rows /= 2;
  return rows;
}

// Calls a functor with the row block as a compile-time constant (rows in {32, 64, K}).
template <int K, class F>
static auto with_rows(int rows, F f) {
  if constexpr (K == 128) {
    if (rows == 128) return f(std::integral_constant<int, 128>{});
  }
  if (rows == 64) return f(std::integral_constant<int, 64>{});
  return f(std::integral_constant<int, kSuperRows>{});
}

template <int K>
static size_t super_bwd_two_sets(int rows) {
  return with_rows<K>(rows, [](auto mr) { return SuperBwdSmem<K, decltype(mr)::value, 1>::bytes; });
}
int super_bwd_rows(int K, int items, bool whole, int sms, int optin) {
  int rows = super_rows(K, items, whole, sms);
  if (whole) return rows;
  while (rows > kSuperRows && (K == 64 ? super_bwd_two_sets<64>(rows) : super_bwd_two_sets<128>(rows)) > size_t(optin))
    rows /= 2;
  return rows;
}

// The least shared memory the superblock kernels run with (one set of tiles).
size_t smem_super_prep(int K) { return K == 64 ? SuperSmem<64>::bytes : SuperSmem<128>::bytes; }
size_t smem_super_bwd(int K) { return K == 64 ? SuperBwdSmem<64, 64, 0>::bytes : SuperBwdSmem<128, 128, 0>::bytes; }

template <typename T, int K, bool kKs>
static cudaError_t super_t(const KernelParams& p, int rows, cudaStream_t s) {
  return with_rows<K>(rows, [&](auto rb) {
    constexpr int RB = decltype(rb)::value;
    const dim3 grid = item_head_grid(p.nsuper, p.H * (K / RB));
    if constexpr (RB == kSuperRows) {  // few items: the column split (a warp pair per 16 rows)
      constexpr int kXWarps = RB / 16 * 2;
      return launch_with_smem(super_prep_kernel<T, K, RB, 2, kKs>, grid, 32 * kXWarps, SuperSmem<K, kXWarps>::bytes,
                              s, p);
    } else {
      return launch_with_smem(super_prep_kernel<T, K, RB, 1, kKs>, grid, 2 * RB, SuperSmem<K>::bytes, s, p);
    }
  });
}

template <typename T, int K>
static cudaError_t super_bwd_t(const KernelParams& p, int rows, int grid, int optin, cudaStream_t s) {
  return with_rows<K>(rows, [&](auto mr) {
    constexpr int MR = decltype(mr)::value;
    if (SuperBwdSmem<K, MR, 2>::bytes <= size_t(optin))
      return launch_with_smem(super_bwd_kernel<T, K, MR, 2>, dim3(grid), kPrepThreads, SuperBwdSmem<K, MR, 2>::bytes,
                              s, p, p.nsuper * p.H);
    if (SuperBwdSmem<K, MR, 1>::bytes <= size_t(optin))
      return launch_with_smem(super_bwd_kernel<T, K, MR, 1>, dim3(grid), kPrepThreads, SuperBwdSmem<K, MR, 1>::bytes,
                              s, p, p.nsuper * p.H);
    return launch_with_smem(super_bwd_kernel<T, K, MR, 0>, dim3(grid), kPrepThreads, SuperBwdSmem<K, MR, 0>::bytes,
                            s, p, p.nsuper * p.H);
  });
}

cudaError_t launch_super_bwd(const KernelParams& p, int dtype, int rows, int grid, cudaStream_t s) {
  if (p.nsuper == 0) return cudaSuccess;
  int optin = 0;
  const cudaError_t e = device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &optin);
  if (e != cudaSuccess) return e;
  if (dtype == 0)
    return p.K == 64 ? super_bwd_t<__half, 64>(p, rows, grid, optin, s) : super_bwd_t<__half, 128>(p, rows, grid, optin, s);
  return p.K == 64 ? super_bwd_t<__nv_bfloat16, 64>(p, rows, grid, optin, s)
                   : super_bwd_t<__nv_bfloat16, 128>(p, rows, grid, optin, s);
}

template <bool kKs>
static cudaError_t super_prep_dispatch(const KernelParams& p, int dtype, int rows, cudaStream_t s) {
  if (dtype == 0) return p.K == 64 ? super_t<__half, 64, kKs>(p, rows, s) : super_t<__half, 128, kKs>(p, rows, s);
  return p.K == 64 ? super_t<__nv_bfloat16, 64, kKs>(p, rows, s) : super_t<__nv_bfloat16, 128, kKs>(p, rows, s);
}

cudaError_t launch_super_prep(const KernelParams& p, int dtype, cudaStream_t s, bool ks) {
  if (p.nsuper == 0) return cudaSuccess;
  int sms = 0;
  const cudaError_t e = device_attr(cudaDevAttrMultiProcessorCount, &sms);
  if (e != cudaSuccess) return e;
  const int rows = super_rows(p.K, p.nsuper * p.H, false, sms);
  return ks ? super_prep_dispatch<true>(p, dtype, rows, s) : super_prep_dispatch<false>(p, dtype, rows, s);
}

template <typename T, int K>
static cudaError_t prep_t(const KernelParams& p, cudaStream_t s) {
  return launch_with_smem(chunk_prep_kernel<T, K>, item_head_grid(p.nchunks, p.H), kPrepThreads, smem_chunk_prep(K), s, p);
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
