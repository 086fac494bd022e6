// dev/cuda/far_tiling.cu: how fast can the scans' far-chunk loop run with mma.sync, and does the tiling bound it?
// Self-checking, self-timing playground for the question HISTORY.md (v3.10's table) leaves: the far loop of
// fwd_scan (and of bwd_q / bwd_k) holds 16 query rows per warp, so each k~ / v fragment a warp reads from
// shared memory (ldmatrix) feeds one m-tile; FlashAttention-2 holds 32 rows per warp and halves those reads per
// FLOP. The loop here is the far part alone (keys already transported: S = Q K^T, online softmax in base 2,
// O += P V over 64-key chunks, bf16 operands, fp32 accumulation, no mask, no transport), in these versions:
//   v16:  4 warps x 16 rows (64-row tile), the query tile as fp32 in registers and packed to bf16 for every key
//         chunk (warp_mma_rs), as fwd_scan does;
//   v16p: the same with the query fragments packed to bf16 once (registers), as a far loop could keep them
//         between superblock steps;
//   v32:  4 warps x 32 rows (128-row tile), the queries in shared memory and their fragments loaded per k-step
//         (ldmatrix), each k / v fragment used for both m-tiles;
//   v16x2: v16 with 8 warps sharing the k / v tiles (a 128-row tile): whether sharing tiles between more
//         rows helps without the 32-row register tiling;
//   vw:   one warpgroup, wgmma (sm_90a): S = Q K^T as m64n64k16 and O += P V as two m64n64k16 per 16 keys, the
//         query and P fragments from registers, k~ and v read by the tensor cores from shared memory once per
//         warpgroup (no ldmatrix). Tiles in the no-swizzle core-matrix layout (8 rows x 16 bytes contiguous);
//         the descriptor's leading offset is the one along K, its stride offset along M / N (CUTLASS's
//         reading; the other one faults);
//   vw2:  vw with two warpgroups (128 query rows) sharing the tiles;
//   vw3:  vw2 with the scores of a chunk and P V of the previous one issued together, the softmax running
//         while P V finishes, and P V as one m64n128 product per 16 keys (three tile stages);
//   vw4:  vw3 with its tiles loaded by TMA (one thread issues them) and mbarriers instead of the CTA barrier;
//   vw5:  vw3 on 128-key chunks in 128-byte swizzled tiles (S as m64n128 products too);
//   vw6:  vw5 with its tiles loaded by TMA in four swizzled boxes per chunk;
//   vw7:  vw6 with a producer warpgroup and two consumer warpgroups, registers moved by setmaxnreg.
// v16 .. vw2 double-buffer the k / v tiles with cp.async (load_tile_async, load_core_async) as fwd_scan does;
// vw3 .. vw7 keep three stages, copied by cp.async (vw3, vw5) or loaded by TMA (vw4, vw6, vw7).
// Check: head 0's first 128 rows of each version against a host softmax (double) over the same bf16 inputs
// (relative L2 <= 1e-2: P is rounded to bf16 before P V). Timing: the benchmark T = 16k, K = 128 shape's far
// work, H = 32 heads x 16384 query rows x 8192 keys (2.2 TFLOP, the attention forward's count at that shape),
// median of 5 timed runs after a warm-up, with TFLOP/s.
// Build and run (from the repository root):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Isrc -Idev/cuda dev/cuda/far_tiling.cu -o far_tiling
//   ./far_tiling            (or ./far_tiling v16: only the versions whose name starts with that)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "far_common.cuh"

using namespace pathattn::cuda;
using namespace pathattn::cuda::dev::far;

namespace {

constexpr int kThreads = 128;  // 4 warps, as the scans

struct Args {
  const T* q;  // [H][kRows][K]
  const T* k;  // [H][kKeys][K]
  const T* v;  // [H][kKeys][V]
  float* o;    // [H][kRows][V]
  float sl2;   // scale * log2(e)
  CUtensorMap tk, tv;  // k and v as 2-D [H kKeys][K] tensors for TMA, boxes of 64 rows x 8 columns (vw4)
  CUtensorMap tk6, tv6;  // the same, boxes of 128 rows x 64 columns, 128-byte swizzle (vw6)
};

// o (16 rows of a warp) / l to global, fp32.
__device__ __forceinline__ void store_rows(float* orow0, const float (&o)[V / 8][4], const float (&l)[2]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float lt = l[hr];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const float inv = 1.f / lt;
    float* orow = orow0 + size_t(g + 8 * hr) * V;
#pragma unroll
    for (int nt = 0; nt < V / 8; ++nt) {
      orow[8 * nt + 2 * t] = o[nt][2 * hr] * inv;
      orow[8 * nt + 2 * t + 1] = o[nt][2 * hr + 1] * inv;
    }
  }
}

// acc[MT] += A[MT] B with A from packed 16-bit registers (a[MT][KT][4], the m16n8k16 A layout) and B in shared
// memory (TB as in warp_mma_ss): each B fragment is loaded once and used for every m-tile.
template <int MT, int KT, int NT, bool TB>
__device__ __forceinline__ void warp_mma_pr(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][KT][4], const T* B,
                                            int ldb) {
  const int lane = threadIdx.x & 31, mat = lane >> 3, i = lane & 7;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    const int k0 = 16 * kt;
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t b[4];
      if (!TB) ldsm_x4(b, B + (8 * nt + i + (mat >> 1) * 8) * ldb + k0 + (mat & 1) * 8);
      else ldsm_x4_t(b, B + (k0 + i + (mat & 1) * 8) * ldb + 8 * nt + (mat >> 1) * 8);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816<T>(acc[mt][nt], a[mt][kt], b[0], b[1]);
        mma16816<T>(acc[mt][nt + 1], a[mt][kt], b[2], b[3]);
      }
    }
  }
}

// This warp's 16 query rows (row0 = the tile's first row in global memory) in the C layout, fp32.
__device__ __forceinline__ void load_query_rows(float (&qt)[K / 8][4], const T* row0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) qt[nt][e] = to_f(row0[size_t(g + 8 * (e >> 1)) * K + 8 * nt + 2 * t + (e & 1)]);
}

// The same rows packed once as bf16 A fragments (K / 16 k-steps).
__device__ __forceinline__ void load_query_frags(uint32_t (&qa)[K / 16][4], const T* row0) {
  float qt[K / 8][4];
  load_query_rows(qt, row0);
  pack_frags<T, K / 16>(qa, qt);
}

constexpr size_t kTileBytes = 2 * (size_t(kChunk) * LK + size_t(kChunk) * LV) * sizeof(T);

template <int VER>  // 0: v16, 1: v16p, 2: v16x2 (v16 with 8 warps sharing the k / v tiles: a 128-row tile)
__global__ void __launch_bounds__(VER == 2 ? 2 * kThreads : kThreads) far16_kernel(Args a) {
  constexpr int kTile = VER == 2 ? 2 * kChunk : kChunk;
  extern __shared__ __align__(16) uint8_t smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + 2 * kChunk * LK;
  const int head = blockIdx.x / (kRows / kTile), tile = blockIdx.x % (kRows / kTile);
  const int warp = threadIdx.x >> 5;
  const T* kp = a.k + size_t(head) * kKeys * K;
  const T* vp = a.v + size_t(head) * kKeys * V;
  const T* qrow = a.q + (size_t(head) * kRows + tile * kTile + 16 * warp) * K;
  auto load = [&](int c, int st) {
    if (VER != 2 || warp < 4)
      load_tile_async<K>(Ks + st * kChunk * LK, kp + size_t(c) * kChunk * K, K, kChunk, threadIdx.x & 127);
    if (VER != 2 || warp >= 4)
      load_tile_async<V>(Vs + st * kChunk * LV, vp + size_t(c) * kChunk * V, V, kChunk, threadIdx.x & 127);
    cp_async_commit();
  };
  load(0, 0);
  // The query tile: fp32 (v16, as fwd_scan's q~ state) or packed once (v16p).
  float qt[K / 8][4];
  uint32_t qa[1][K / 16][4];
  load_query_rows(qt, qrow);
  if (VER == 1) pack_frags<T, K / 16>(qa[0], qt);
  float o[V / 8][4];
  zero_acc(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];
  for (int c = 0; c < kNK; ++c) {
    const int st = c & 1;
    cp_async_wait_all();
    __syncthreads();
    if (c + 1 < kNK) load(c + 1, st ^ 1);
    const T* Kst = Ks + st * kChunk * LK;
    const T* Vst = Vs + st * kChunk * LV;
    float s[8][4];
    zero_acc(s);
    if (VER != 1) {
      warp_mma_rs<T, K / 16, 8, false>(s, qt, 1.f, Kst, LK, 0);
    } else {
      float s1[1][8][4];
      zero_acc(s1);
      warp_mma_pr<1, K / 16, 8, false>(s1, qa, Kst, LK);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = s1[0][nt][e];
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= a.sl2;
    softmax_step(s, m, l, alpha);
    scale_rows(o, alpha);
    warp_mma_rs<T, 4, V / 8, true>(o, s, 1.f, Vst, LV, 0);
  }
  store_rows(a.o + (size_t(head) * kRows + tile * kTile + 16 * warp) * V, o, l);
}

// ---- wgmma (sm_90a): descriptors, fences and products from cuda/hopper.cuh (bf16 here).
// A 64 x D tile (row stride `stride` in global) into the no-swizzle core-matrix layout: row r's 16-byte segment
// j (elements 8j .. 8j + 7) at byte ((r / 8) (D / 8) + j) 128 + (r % 8) 16. Core matrices along the row (the
// D direction) are 128 bytes apart, along the rows (D / 8) 128 bytes apart. Copy i of the NT threads goes to
// byte 16 i: a warp writes 512 contiguous bytes (four core matrices) and reads 8 rows x 64 bytes. (Copies
// taken row by row, 16 consecutive segments of one row per half warp, scatter a warp's destinations over 16
// core matrices; L1 then fetched every sector from L2 twice: measured, HISTORY.md v3.12.)
template <int D, int NT>
__device__ __forceinline__ void load_core_async(T* dst, const T* src, int64_t stride) {
  char* d = reinterpret_cast<char*>(dst);
#pragma unroll
  for (int i = threadIdx.x; i < kChunk * (D / 8); i += NT) {
    const int cm = i >> 3, r = (cm / (D / 8)) * 8 + (i & 7), j = cm % (D / 8);
    cp_async16(d + 16 * i, src + r * stride + 8 * j, true);
  }
}

// WG warpgroups, each its own 64 query rows (a 64 WG-row tile), sharing the k~ / v tiles.
template <int WG>
__global__ void __launch_bounds__(128 * WG) farw_kernel(Args a) {
  constexpr int NT = 128 * WG, kTile = 64 * WG;
  extern __shared__ __align__(16) uint8_t smem[];
  T* Kc = reinterpret_cast<T*>(smem);  // [2][64 * K], core-matrix layout
  T* Vc = Kc + 2 * kChunk * K;         // [2][64 * V]
  const int head = blockIdx.x / (kRows / kTile), tile = blockIdx.x % (kRows / kTile);
  const int warp = threadIdx.x >> 5;
  const T* kp = a.k + size_t(head) * kKeys * K;
  const T* vp = a.v + size_t(head) * kKeys * V;
  const T* qrow = a.q + (size_t(head) * kRows + tile * kTile + 16 * warp) * K;
  auto load = [&](int c, int st) {
    load_core_async<K, NT>(Kc + st * kChunk * K, kp + size_t(c) * kChunk * K, K);
    load_core_async<V, NT>(Vc + st * kChunk * V, vp + size_t(c) * kChunk * V, V);
    cp_async_commit();
  };
  load(0, 0);
  // Byte offsets between core matrices: k~ is K-major (K along the row), v is N-major (V along the row). The
  // descriptor's leading offset is the one along K (the inner dimension), its stride offset along M / N, as
  // CUTLASS documents them (the other reading faults: HISTORY.md v3.12).
  constexpr uint32_t kAlongRow = 128, kKRows = (K / 8) * 128, kVRows = (V / 8) * 128;
  constexpr uint32_t k_lbo = kAlongRow, k_sbo = kKRows, v_lbo = kVRows, v_sbo = kAlongRow;
  uint32_t qa[K / 16][4];
  load_query_frags(qa, qrow);
  float o[V / 8][4];
  zero_acc(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];
  for (int c = 0; c < kNK; ++c) {
    const int st = c & 1;
    cp_async_wait_all();
    fence_async_smem();
    __syncthreads();
    if (c + 1 < kNK) load(c + 1, st ^ 1);
    float s[8][4];
    zero_acc(s);
    const uint64_t dk = smem_desc(Kc + st * kChunk * K, k_lbo, k_sbo);
    const uint64_t dv = smem_desc(Vc + st * kChunk * V, v_lbo, v_sbo);
    fence_regs(s);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) wg_rs<T, 0>(s, qa[kt], dk + ((2 * kt * kAlongRow) >> 4));
    wg_commit();
    wg_wait<0>();
    fence_regs(s);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= a.sl2;
    softmax_step(s, m, l, alpha);
    scale_rows(o, alpha);
    uint32_t pa[4][4];
    pack_frags<T, 4>(pa, s);
    float(&o_lo)[8][4] = *reinterpret_cast<float(*)[8][4]>(&o[0][0]);
    float(&o_hi)[8][4] = *reinterpret_cast<float(*)[8][4]>(&o[8][0]);
    fence_regs(o);
    wg_fence();
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {  // 16 keys = two core-matrix rows of v; the halves of V 8 core matrices apart
      wg_rs<T, 1>(o_lo, pa[kt], dv + ((2 * kt * kVRows) >> 4));
      wg_rs<T, 1>(o_hi, pa[kt], dv + ((2 * kt * kVRows + 8 * kAlongRow) >> 4));
    }
    wg_commit();
    wg_wait<0>();
    fence_regs(o);
  }
  store_rows(a.o + (size_t(head) * kRows + tile * kTile + 16 * warp) * V, o, l);
}

// vw3: vw2 with the products overlapped with the softmax, FlashAttention-3's order within a warpgroup: per
// chunk c the scores S_c and P V of chunk c - 1 (one m64n128 product per 16 keys) are issued together; the
// softmax of S_c runs while P V finishes; the accumulator is rescaled after that product's wait. Nothing is
// in flight across the loop's back edge (products in flight there make ptxas serialize every wgmma: it
// reported so for a version that carried the next chunk's scores over it). Three tile stages: chunk c - 1
// (its v multiplied), chunk c (scored), chunk c + 1 (loading).
//
// The consumer side, shared with vw4 .. vw6: this warp's 16 query rows at qrow, output row at orow; chunks of NK
// keys (64 or 128); kdesc(c, kt) and vdesc(c, kt) are the descriptors of chunk c's k~ tile at the k-step kt of
// the scores (16 of the K columns) and of its v tile at the k-step kt of P V (16 of the NK keys); ready(c)
// makes chunk c's tiles visible (and may start later loads), release(c) says this warp is done with them.
template <int NK, class KDesc, class VDesc, class Ready, class Release>
__device__ __forceinline__ void overlap_consumer(const Args& a, const T* qrow, float* orow, KDesc kdesc, VDesc vdesc,
                                                 Ready ready, Release release) {
  constexpr int kChunks = kKeys / NK, NS = NK / 8, PK = NK / 16;
  uint32_t qa[K / 16][4];
  load_query_frags(qa, qrow);
  float o[V / 8][4];
  zero_acc(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];
  float s[NS][4];
  uint32_t pa[PK][4];
  auto issue_scores = [&](int c) {
#pragma unroll
    for (int kt = 0; kt < K / 16; ++kt) wg_rs<T, 0>(s, qa[kt], kdesc(c, kt), kt > 0);
    wg_commit();
  };
  auto issue_pv = [&](int c) {
#pragma unroll
    for (int kt = 0; kt < PK; ++kt) wg_rs<T, 1>(o, pa[kt], vdesc(c, kt));
    wg_commit();
  };
  auto softmax = [&]() {  // P left in s; alpha for the rescale of o
#pragma unroll
    for (int nt = 0; nt < NS; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= a.sl2;
    softmax_step(s, m, l, alpha);
  };
  ready(0);
  fence_regs(s);
  wg_fence();
  issue_scores(0);
  wg_wait<0>();
  fence_regs(s);
  softmax();
  pack_frags<T, PK>(pa, s);
  for (int c = 1; c < kChunks; ++c) {
    ready(c);
    fence_regs(s);
    fence_regs(o);
    fence_regs(pa);
    wg_fence();
    issue_scores(c);
    issue_pv(c - 1);
    wg_wait<1>();  // S_c done; P V of chunk c - 1 may still run
    fence_regs(s);
    softmax();
    wg_wait<0>();  // P V done: o and pa are ours again
    release(c - 1);
    fence_regs(o);
    fence_regs(pa);
    scale_rows(o, alpha);
    pack_frags<T, PK>(pa, s);
  }
  fence_regs(o);
  fence_regs(pa);
  wg_fence();
  issue_pv(kChunks - 1);
  wg_wait<0>();
  fence_regs(o);
  store_rows(orow, o, l);
}

// Descriptors of the no-swizzle core-matrix tiles of vw3 / vw4 (64-key chunks, kStages stages at Kc / Vc): core
// matrices lbo apart along the product's inner dimension and sbo apart along the other (k~: K-major; v:
// N-major).
template <int kStages>
struct CoreTiles {
  const T* Kc;
  const T* Vc;
  uint32_t k_lbo, k_sbo, v_lbo, v_sbo;
  __device__ uint64_t kdesc(int c, int kt) const {
    return smem_desc(Kc + (c % kStages) * kChunk * K, k_lbo, k_sbo) + ((2 * kt * k_lbo) >> 4);
  }
  __device__ uint64_t vdesc(int c, int kt) const {
    return smem_desc(Vc + (c % kStages) * kChunk * V, v_lbo, v_sbo) + ((2 * kt * v_lbo) >> 4);
  }
};

constexpr int kStagesW = 3;  // tile stages of vw3 .. vw7: chunk c - 1 (its v multiplied), c (scored), c + 1 (loading)

// ---- vw5 / vw6: 128-key chunks in 128-byte swizzled tiles, the layout FlashAttention-3 and CUTLASS give wgmma.
// A tile of kN5 rows x D columns is stored as D / 64 column blocks of 64 columns (128 bytes a row), block cb at
// cb * kN5 * 128 bytes; row r of a block at r * 128, its 16-byte segment j at ((j ^ (r % 8)) * 16): the 128-byte
// swizzle, a function of the address bits, so every tile starts 1024-byte aligned. This is what TMA writes for
// a box of 64 columns with CU_TENSOR_MAP_SWIZZLE_128B (vw6), and what the descriptors' swizzle mode 1 reads:
// k~ K-major (the scores' B): leading offset unused (16 bytes), stride offset 1024 bytes (8 rows), a k-step of
// 16 columns 32 bytes further within a block, the next block for columns 64 ..; v N-major (P V's B): leading
// offset = the column blocks' distance (kN5 * 128 bytes), stride offset 1024 bytes (8 keys), a k-step of 16
// keys 2 KB further. S is one m64n128 product per k-step (K / 16 of them), P V one m64n128 per 16 keys.
// Prediction (written before any run): the swizzled layout alone (vw5, copies still by the consumers) 1.2-1.4x
// vw3 (273 -> 330-380 TFLOP/s: half the loop iterations, softmax and waits per key, wider products); TMA in
// four boxes per chunk (vw6) +10-20% over vw5.
constexpr int kN5 = 128;

// Chunk c's tiles at stage c % kStages of the k~ tiles at Ks and the v tiles at Vs.
template <int kStages>
struct SwTiles {
  const T* Ks;
  const T* Vs;
  __device__ uint64_t kdesc(int c, int kt) const {
    const char* t = reinterpret_cast<const char*>(Ks + (c % kStages) * kN5 * K);
    return smem_desc_sw128(t + (kt / 4) * kN5 * 128 + (kt % 4) * 32, 16, 1024);
  }
  __device__ uint64_t vdesc(int c, int kt) const {
    const char* t = reinterpret_cast<const char*>(Vs + (c % kStages) * kN5 * V);
    return smem_desc_sw128(t + kt * 16 * 128, kN5 * 128, 1024);
  }
};

// kN5 rows of D columns (row stride `stride` in global) into the swizzled layout, by NT threads: copy i takes
// row i / (D / 8), segment i % (D / 8) (a warp reads two whole rows).
template <int D, int NT>
__device__ __forceinline__ void load_sw128_async(T* dst, const T* src, int64_t stride) {
  char* d = reinterpret_cast<char*>(dst);
  constexpr int kSeg = D / 8;
#pragma unroll 4
  for (int i = threadIdx.x; i < kN5 * kSeg; i += NT) {
    const int r = i / kSeg, j = i % kSeg;
    cp_async16(d + (j / 8) * kN5 * 128 + r * 128 + (((j % 8) ^ (r % 8)) << 4), src + r * stride + 8 * j, true);
  }
}

// Tiles of the versions that copy with cp.async (vw3: 64-key chunks, core-matrix layout; vw5: 128-key chunks,
// swizzled): the chunk size, the copy of chunk c into its stage, and the descriptors.
template <bool SW>
struct AsyncTiles {
  static constexpr int NK = SW ? kN5 : kChunk;
  static constexpr size_t smem = size_t(kStagesW) * NK * (K + V) * sizeof(T) + 1024;  // + alignment slack
  T* Ks;
  T* Vs;
  template <int NT>
  __device__ void load(const T* kp, const T* vp, int c) const {
    const int st = c % kStagesW;
    if constexpr (SW) {
      load_sw128_async<K, NT>(Ks + st * NK * K, kp + size_t(c) * NK * K, K);
      load_sw128_async<V, NT>(Vs + st * NK * V, vp + size_t(c) * NK * V, V);
    } else {
      load_core_async<K, NT>(Ks + st * NK * K, kp + size_t(c) * NK * K, K);
      load_core_async<V, NT>(Vs + st * NK * V, vp + size_t(c) * NK * V, V);
    }
    cp_async_commit();
  }
  __device__ uint64_t kdesc(int c, int kt) const {
    if constexpr (SW) return SwTiles<kStagesW>{Ks, Vs}.kdesc(c, kt);
    else return CoreTiles<kStagesW>{Ks, Vs, 128, (K / 8) * 128, (V / 8) * 128, 128}.kdesc(c, kt);
  }
  __device__ uint64_t vdesc(int c, int kt) const {
    if constexpr (SW) return SwTiles<kStagesW>{Ks, Vs}.vdesc(c, kt);
    else return CoreTiles<kStagesW>{Ks, Vs, 128, (K / 8) * 128, (V / 8) * 128, 128}.vdesc(c, kt);
  }
};

// vw3 (SW = false) and vw5 (SW = true): two warpgroups (128 query rows) copying their tiles with cp.async,
// three stages, one CTA barrier per chunk.
template <bool SW>
__global__ void __launch_bounds__(2 * kThreads, 1) farw_async_kernel(Args a) {
  using TL = AsyncTiles<SW>;
  constexpr int NT = 2 * kThreads, kTile = 2 * kChunk, kChunks = kKeys / TL::NK;
  extern __shared__ __align__(16) uint8_t smem[];
  T* Ks = reinterpret_cast<T*>(align1k(smem));
  const TL tl{Ks, Ks + kStagesW * TL::NK * K};
  const int head = blockIdx.x / (kRows / kTile), tile = blockIdx.x % (kRows / kTile);
  const int warp = threadIdx.x >> 5;
  const T* kp = a.k + size_t(head) * kKeys * K;
  const T* vp = a.v + size_t(head) * kKeys * V;
  tl.template load<NT>(kp, vp, 0);
  tl.template load<NT>(kp, vp, 1);
  auto ready = [&](int c) {  // chunk c landed; every warpgroup is past P V of chunk c - 2 (its stage is free)
    if (c == 0) cp_async_wait_group<1>();
    else cp_async_wait_group<0>();
    fence_async_smem();
    __syncthreads();
    if (c > 0 && c + 1 < kChunks) tl.template load<NT>(kp, vp, c + 1);
  };
  const size_t row0 = size_t(head) * kRows + tile * kTile + 16 * warp;
  overlap_consumer<TL::NK>(a, a.q + row0 * K, a.o + row0 * V, [&](int c, int kt) { return tl.kdesc(c, kt); },
                           [&](int c, int kt) { return tl.vdesc(c, kt); }, ready, [](int) {});
}

// ---- vw4: vw3 with its tiles loaded by TMA (no copy instructions in the warps that multiply): one thread
// issues each chunk's k / v tiles as 16 + 16 boxes of 64 rows x 8 columns (1 KB each, no swizzle: box j at
// j KB holds column segment j of all 64 rows, 16 bytes a row, so core matrices are 128 bytes apart along the
// rows and 1 KB apart along the columns) into one of three stages, signalling the stage's full barrier with
// the transaction bytes; each warp releases a stage on its empty barrier once P V of that chunk is done, and
// the issuing thread waits for all eight releases before reusing it. No CTA barrier in the loop. (A separate
// producer warp, 288 threads, caps the registers at 168 per thread, since one of the four schedulers then
// holds three warps; ptxas then serialized the wgmmas for lack of registers.) A wait that never completes
// gives up after about 2^26 polls and counts itself in g_wait_timeouts, which the host reports as a failure:
// an error, not a hang. (Not __trap: a trap in the consumers' branch makes ptxas ignore setmaxnreg there and
// compile it within the kernel's entry registers, spilling and serializing the wgmmas: vw7 at 168 registers.)
__device__ unsigned int g_wait_timeouts;
__device__ __forceinline__ void mbar_wait_counted(uint64_t* bar, uint32_t parity) {
  mbar_wait(bar, parity, [] { atomicAdd(&g_wait_timeouts, 1u); });
}

// Tiles of the versions that load by TMA (vw4: 64-key chunks as boxes of 8 columns, no swizzle, so core
// matrices are 128 bytes apart along the keys and 1 KB apart along the columns; vw6 / vw7: 128-key chunks as
// boxes of 64 columns, swizzled), with full / empty mbarriers per stage after the tiles.
template <bool SW>
struct TmaTiles {
  static constexpr int NK = SW ? kN5 : kChunk, BC = SW ? 64 : 8;
  static constexpr size_t smem = size_t(kStagesW) * NK * (K + V) * sizeof(T) + 1024 + 2 * kStagesW * sizeof(uint64_t);
  T* Ks;
  T* Vs;
  uint64_t* full;
  uint64_t* empty;
  __device__ static TmaTiles at(uint8_t* smem) {
    T* k = reinterpret_cast<T*>(align1k(smem));
    T* v = k + kStagesW * NK * K;
    uint64_t* f = reinterpret_cast<uint64_t*>(v + kStagesW * NK * V);
    return {k, v, f, f + kStagesW};
  }
  // The tiles at the start of the dynamic shared memory, their barriers initialized (by thread 0, then a CTA
  // barrier): eight consumer warps release each stage.
  __device__ static TmaTiles setup(uint8_t* smem) {
    const TmaTiles t = at(smem);
    if (threadIdx.x == 0) {
      for (int st = 0; st < kStagesW; ++st) {
        mbar_init(&t.full[st], 1);
        mbar_init(&t.empty[st], 8);
      }
      mbar_init_fence();
    }
    __syncthreads();
    return t;
  }
  // Chunk c's tiles into its stage (one thread); the stage's previous chunk must be released first.
  __device__ void issue(const Args& a, int head, int c) const {
    const int st = c % kStagesW;
    if (c >= kStagesW) mbar_wait_counted(&empty[st], uint32_t(c / kStagesW - 1) & 1);
    mbar_expect_tx(&full[st], uint32_t(NK * (K + V) * sizeof(T)));
    const int row = head * kKeys + c * NK;
    const CUtensorMap* mk = SW ? &a.tk6 : &a.tk;
    const CUtensorMap* mv = SW ? &a.tv6 : &a.tv;
#pragma unroll 1
    for (int j = 0; j < K / BC; ++j) tma_load(Ks + st * NK * K + j * NK * BC, mk, BC * j, row, &full[st]);
#pragma unroll 1
    for (int j = 0; j < V / BC; ++j) tma_load(Vs + st * NK * V + j * NK * BC, mv, BC * j, row, &full[st]);
  }
  __device__ void wait_full(int c) const { mbar_wait_counted(&full[c % kStagesW], uint32_t(c / kStagesW) & 1); }
  __device__ void release(int c) const {  // this warp is done with chunk c's stage
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(&empty[c % kStagesW]);
  }
  __device__ uint64_t kdesc(int c, int kt) const {
    if constexpr (SW) return SwTiles<kStagesW>{Ks, Vs}.kdesc(c, kt);
    else return CoreTiles<kStagesW>{Ks, Vs, 1024, 128, 128, 1024}.kdesc(c, kt);
  }
  __device__ uint64_t vdesc(int c, int kt) const {
    if constexpr (SW) return SwTiles<kStagesW>{Ks, Vs}.vdesc(c, kt);
    else return CoreTiles<kStagesW>{Ks, Vs, 1024, 128, 128, 1024}.vdesc(c, kt);
  }
};

// vw4 (SW = false) and vw6 (SW = true): thread 0 issues the loads of chunk c + 1 at chunk c; no CTA barrier in
// the loop.
template <bool SW>
__global__ void __launch_bounds__(2 * kThreads, 1) farw_tma_kernel(const __grid_constant__ Args a) {
  using TL = TmaTiles<SW>;
  constexpr int kTile = 2 * kChunk, kChunks = kKeys / TL::NK;
  extern __shared__ __align__(16) uint8_t smem[];
  const TL tl = TL::setup(smem);
  const int head = blockIdx.x / (kRows / kTile), tile = blockIdx.x % (kRows / kTile);
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    tl.issue(a, head, 0);
    tl.issue(a, head, 1);
  }
  auto ready = [&](int c) {
    if (c > 0 && threadIdx.x == 0 && c + 1 < kChunks) tl.issue(a, head, c + 1);
    __syncwarp();  // warp 0 converged again before its warpgroup's wgmma
    tl.wait_full(c);
  };
  const size_t row0 = size_t(head) * kRows + tile * kTile + 16 * warp;
  overlap_consumer<TL::NK>(a, a.q + row0 * K, a.o + row0 * V, [&](int c, int kt) { return tl.kdesc(c, kt); },
                           [&](int c, int kt) { return tl.vdesc(c, kt); }, ready, [&](int c) { tl.release(c); });
}

// vw7: vw6 with FlashAttention-3's warp roles: a producer warpgroup (one thread issues the TMA boxes) and two
// consumer warpgroups. The producer gives back registers (setmaxnreg.dec to 24) so the consumers may take 240
// (setmaxnreg.inc): 128 x 24 + 256 x 240 = 64512 of the SM's 65536. (vw4's producer warp without setmaxnreg
// capped every thread at 168 registers and ptxas serialized the wgmmas.) Prediction: +5-15% over vw6 (the
// issuing thread no longer shares a warp with a consumer's products). ptxas allocates the consumers' branch
// at 240 registers only without a trap in it (mbar_wait's timeout counts instead of trapping): with __trap it
// compiled the branch within the entry's 168 registers (336 bytes of spills, C7512: wgmmas serialized).
__global__ void __launch_bounds__(3 * kThreads, 1) farw7_kernel(const __grid_constant__ Args a) {
  using TL = TmaTiles<true>;
  constexpr int kTile = 2 * kChunk, kChunks = kKeys / TL::NK;
  extern __shared__ __align__(16) uint8_t smem[];
  const TL tl = TL::setup(smem);
  const int head = blockIdx.x / (kRows / kTile), tile = blockIdx.x % (kRows / kTile);
  // The warpgroup index made warp-uniform (a shuffle from lane 0), so that the branch is too.
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x) / kThreads, 0);
  if (wg == 0) {  // producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x == 0)
      for (int c = 0; c < kChunks; ++c) tl.issue(a, head, c);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
    const int warp = (threadIdx.x - kThreads) >> 5;
    const size_t row0 = size_t(head) * kRows + tile * kTile + 16 * warp;
    overlap_consumer<TL::NK>(a, a.q + row0 * K, a.o + row0 * V, [&](int c, int kt) { return tl.kdesc(c, kt); },
                             [&](int c, int kt) { return tl.vdesc(c, kt); }, [&](int c) { tl.wait_full(c); },
                             [&](int c) { tl.release(c); });
  }
}

// v32: a 128-row query tile, 32 rows per warp; the queries staged in shared memory once.
__global__ void __launch_bounds__(kThreads) far32_kernel(Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + 2 * kChunk * LK;
  T* Qs = Vs + 2 * kChunk * LV;  // [128][LK]
  constexpr int kTile = 2 * kChunk;
  const int head = blockIdx.x / (kRows / kTile), tile = blockIdx.x % (kRows / kTile);
  const int warp = threadIdx.x >> 5;
  const T* kp = a.k + size_t(head) * kKeys * K;
  const T* vp = a.v + size_t(head) * kKeys * V;
  const T* qp = a.q + (size_t(head) * kRows + tile * kTile) * K;
  load_tile_async<K>(Qs, qp, K, kChunk);
  load_tile_async<K>(Qs + kChunk * LK, qp + size_t(kChunk) * K, K, kChunk);
  auto load = [&](int c, int st) {
    load_tile_async<K>(Ks + st * kChunk * LK, kp + size_t(c) * kChunk * K, K, kChunk);
    load_tile_async<V>(Vs + st * kChunk * LV, vp + size_t(c) * kChunk * V, V, kChunk);
    cp_async_commit();
  };
  load(0, 0);
  float o[2][V / 8][4];
  zero_acc(o[0]);
  zero_acc(o[1]);
  float m[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}}, l[2][2] = {{0.f, 0.f}, {0.f, 0.f}}, alpha[2][2];
  for (int c = 0; c < kNK; ++c) {
    const int st = c & 1;
    cp_async_wait_all();
    __syncthreads();
    if (c + 1 < kNK) load(c + 1, st ^ 1);
    const T* Kst = Ks + st * kChunk * LK;
    const T* Vst = Vs + st * kChunk * LV;
    float s[2][8][4];
    zero_acc(s);
    warp_mma_ss<T, 2, 8, false, false>(s, Qs, LK, 32 * warp, Kst, LK, 0, K);
    uint32_t pa[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] *= a.sl2;
      softmax_step(s[mt], m[mt], l[mt], alpha[mt]);
      scale_rows(o[mt], alpha[mt]);
      pack_frags<T, 4>(pa[mt], s[mt]);
    }
    warp_mma_pr<2, 4, V / 8, true>(o, pa, Vst, LV);
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
    store_rows(a.o + (size_t(head) * kRows + tile * kTile + 32 * warp + 16 * mt) * V, o[mt], l[mt]);
}

// Relative L2 of head 0's first 128 output rows against a host softmax over the same bf16 inputs.
double check(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
             const std::vector<float>& o, float scale) {
  double num = 0, den = 0;
  std::vector<double> sc(kKeys), acc(V);
  for (int r = 0; r < 2 * kChunk; ++r) {
    double mx = -1e300;
    for (int j = 0; j < kKeys; ++j) {
      double d = 0;
      for (int x = 0; x < K; ++x) d += double(q[size_t(r) * K + x]) * k[size_t(j) * K + x];
      sc[j] = d * scale;
      mx = std::max(mx, sc[j]);
    }
    double sum = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < kKeys; ++j) {
      const double p = std::exp(sc[j] - mx);
      sum += p;
      for (int x = 0; x < V; ++x) acc[x] += p * v[size_t(j) * V + x];
    }
    for (int x = 0; x < V; ++x) {
      const double ref = acc[x] / sum, got = o[size_t(r) * V + x];
      num += (got - ref) * (got - ref);
      den += ref * ref;
    }
  }
  return std::sqrt(num / den);
}

}  // namespace

int main(int argc, char** argv) {
  const char* only = argc > 1 ? argv[1] : nullptr;  // run only the versions whose name starts with this
  const size_t nq = size_t(H) * kRows * K, nk = size_t(H) * kKeys * K, nv = size_t(H) * kKeys * V,
               no = size_t(H) * kRows * V;
  uint64_t st = 0x9E3779B97F4A7C15ull;
  const std::vector<T> hq = uniform_bf16(nq, 2.f, st), hk = uniform_bf16(nk, 2.f, st), hv = uniform_bf16(nv, 1.f, st);
  const std::vector<float> fq = to_float(hq, size_t(2 * kChunk) * K), fk = to_float(hk, size_t(kKeys) * K),
                           fv = to_float(hv, size_t(kKeys) * V);
  T *dq = upload(hq), *dk = upload(hk), *dv = upload(hv);
  float* dout;
  CK(cudaMalloc(&dout, no * sizeof(float)));
  const float scale = 1.f / std::sqrt(float(K));
  Args args{dq, dk, dv, dout, scale * 1.4426950408889634f, {}, {}, {}, {}};
  // TMA descriptors of k and v: boxes of 64 rows x 8 columns, no swizzle (vw4); 128 rows x 64 columns, 128-byte
  // swizzle (vw6, vw7).
  make_map(&args.tk, dk, K, kKeys, 8, kChunk, CU_TENSOR_MAP_SWIZZLE_NONE);
  make_map(&args.tv, dv, V, kKeys, 8, kChunk, CU_TENSOR_MAP_SWIZZLE_NONE);
  make_map(&args.tk6, dk, K, kKeys, 64, kN5, CU_TENSOR_MAP_SWIZZLE_128B);
  make_map(&args.tv6, dv, V, kKeys, 64, kN5, CU_TENSOR_MAP_SWIZZLE_128B);
  const double flop = 4.0 * H * double(kRows) * kKeys * K;
  std::printf("far loop: H %d x %d query rows x %d keys, K = V = %d, bf16 (%.2f TFLOP per run)\n", H, kRows, kKeys,
              K, flop * 1e-12);

  struct Ver {
    const char* name;
    void (*kern)(Args);
    int rows;  // per CTA
    size_t smem;
    int threads = kThreads;
  };
  const Ver vers[] = {
      {"v16  (16 rows / warp, q fp32 in registers, packed per chunk)", far16_kernel<0>, kChunk, kTileBytes},
      {"v16p (16 rows / warp, q packed once)", far16_kernel<1>, kChunk, kTileBytes},
      {"v16x2 (v16 with 8 warps, 128-row tile)", far16_kernel<2>, 2 * kChunk, kTileBytes, 2 * kThreads},
      {"v32  (32 rows / warp, q in shared memory)", far32_kernel, 2 * kChunk,
       kTileBytes + size_t(2 * kChunk) * LK * sizeof(T)},
      {"vw   (wgmma, one warpgroup, 64-row tile)", farw_kernel<1>, kChunk, 2 * size_t(kChunk) * (K + V) * sizeof(T)},
      {"vw2  (wgmma, two warpgroups, 128-row tile)", farw_kernel<2>, 2 * kChunk,
       2 * size_t(kChunk) * (K + V) * sizeof(T), 2 * kThreads},
      {"vw3  (vw2, S and P V overlapped with the softmax, m64n128 P V)", farw_async_kernel<false>, 2 * kChunk,
       AsyncTiles<false>::smem, 2 * kThreads},
      {"vw4  (vw3 with its tiles loaded by TMA, mbarriers)", farw_tma_kernel<false>, 2 * kChunk, TmaTiles<false>::smem,
       2 * kThreads},
      {"vw5  (vw3 on 128-key chunks, 128-byte swizzled tiles)", farw_async_kernel<true>, 2 * kChunk,
       AsyncTiles<true>::smem, 2 * kThreads},
      {"vw6  (vw5 with its tiles loaded by TMA, four boxes a chunk)", farw_tma_kernel<true>, 2 * kChunk,
       TmaTiles<true>::smem, 2 * kThreads},
      {"vw7  (vw6 with a producer warpgroup, setmaxnreg)", farw7_kernel, 2 * kChunk, TmaTiles<true>::smem,
       3 * kThreads},
  };
  bool ok = true;
  std::vector<float> ho(size_t(2 * kChunk) * V);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Ver& ver : vers) {
    if (only && std::strncmp(ver.name, only, std::strlen(only)) != 0) continue;
    CK(cudaFuncSetAttribute(ver.kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(ver.smem)));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ver.kern, ver.threads, ver.smem));
    const unsigned grid = unsigned(size_t(H) * kRows / ver.rows);
    CK(cudaMemset(dout, 0xff, no * sizeof(float)));  // NaN: every output must be written
    const unsigned int zero = 0;
    CK(cudaMemcpyToSymbol(g_wait_timeouts, &zero, sizeof zero));
    ver.kern<<<grid, ver.threads, ver.smem>>>(args);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(ho.data(), dout, ho.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const double err = check(fq, fk, fv, ho, scale);
    unsigned int timeouts = 0;
    CK(cudaMemcpyFromSymbol(&timeouts, g_wait_timeouts, sizeof timeouts));
    if (timeouts) std::printf("%s: %u barrier waits timed out\n", ver.name, timeouts);
    const bool pass = std::isfinite(err) && err <= 1e-2 && timeouts == 0;
    ok = ok && pass;
    std::vector<float> ms;
    for (int rep = 0; rep < 6; ++rep) {
      CK(cudaEventRecord(e0));
      ver.kern<<<grid, ver.threads, ver.smem>>>(args);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float t = 0.f;
      CK(cudaEventElapsedTime(&t, e0, e1));
      if (rep > 0) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const float med = ms[ms.size() / 2];
    std::printf("%-62s %3d KB smem, %d CTAs / SM: %7.3f ms, %6.1f TFLOP/s, o rel L2 %.2e %s\n", ver.name,
                int(ver.smem / 1024), per_sm, med, flop / (med * 1e-3) * 1e-12, err, pass ? "ok" : "FAIL");
  }
  std::printf(ok ? "all checks passed\n" : "CHECK FAILED\n");
  return ok ? 0 : 1;
}
