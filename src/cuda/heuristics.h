// cuda/heuristics.h: every tuning choice of the CUDA backend in one place: superblock sizes, the far kernels'
// use and fusion, the backward's stream count and workspace placement, keyed by the call's shape, its mode and
// the GPU. The measurements behind each row are in docs/cuda.md. Nothing here reads the environment: a dev
// build changes a choice at configure time, e.g. -DPATHATTN_CUDA_DEFINES="-DPATHATTN_CUDA_BWD_OUT_WS=1".
#pragma once

#include <cstdint>

namespace pathattn::cuda {

// ---- Dev switches (compile time; the defaults are the shipped choices). ----
// The forward's / the backward's chunks per superblock: 0 = the tables below; 4, 6 or 8 force a size (even: the
// far kernels' key tiles are chunk pairs).
#ifndef PATHATTN_CUDA_FWD_SUPER_CHUNKS
#define PATHATTN_CUDA_FWD_SUPER_CHUNKS 0
#endif
#ifndef PATHATTN_CUDA_BWD_SUPER_CHUNKS
#define PATHATTN_CUDA_BWD_SUPER_CHUNKS 0
#endif
// 0: no far kernels (the scans alone, as on every GPU but Hopper).
#ifndef PATHATTN_CUDA_FAR
#define PATHATTN_CUDA_FAR 1
#endif
// 0: the backward's far part as two kernels (bwd_q_far, bwd_k_far) also where the fused bwd_k_far could run.
#ifndef PATHATTN_CUDA_FAR_FUSE
#define PATHATTN_CUDA_FAR_FUSE 1
#endif
// 1: the backward keeps buffers in the memory of its gradient outputs until it writes them (OutputHost; the
// default: f+b -1.7% at K = 64 T = 4k, -1.1% at K = 128 T = 1k, within noise elsewhere, docs/cuda.md).
#ifndef PATHATTN_CUDA_BWD_OUT_WS
#define PATHATTN_CUDA_BWD_OUT_WS 1
#endif
// -1: the plan picks where super_bwd's M_c are written; 1 / 0: always super_prep's first / second launch.
#ifndef PATHATTN_CUDA_SUPER_MSV
#define PATHATTN_CUDA_SUPER_MSV -1
#endif
// 0: super_bwd's row block by super_bwd_rows; 32, 64 or 128 (at most K; ignored in deterministic mode).
#ifndef PATHATTN_CUDA_SUPER_BWD_ROWS
#define PATHATTN_CUDA_SUPER_BWD_ROWS 0
#endif
// 1: the gate's column sums of dS from the key side (bwd_k) instead of the query side (then no far kernels with
// the gate; dg's error about 1.5x larger).
#ifndef PATHATTN_CUDA_DG_SPLIT
#define PATHATTN_CUDA_DG_SPLIT 0
#endif

// Chunk size C of the UT transform and the query / key tile of every kernel: one mma tile of 4 warps x 16 rows,
// and the fp32 chunk kernels fit an A100's shared memory at K = 128.
inline constexpr int kChunk = 64;
// Chunks per superblock of the two-level scan (docs/algorithms.md): keys beyond the query's own superblock are
// moved to their superblock's end and the query crosses a whole superblock with one dense K x K product.
inline constexpr int kSuperChunks = 8;
inline constexpr int kSuperChunksShort = 4;
inline constexpr int kSuperChunksMid = 6;

inline constexpr bool kFarKernels = PATHATTN_CUDA_FAR != 0;
inline constexpr bool kFarFuse = PATHATTN_CUDA_FAR_FUSE != 0;
inline constexpr bool kBwdOutWs = PATHATTN_CUDA_BWD_OUT_WS != 0;
inline constexpr int kSuperMsv = PATHATTN_CUDA_SUPER_MSV;
inline constexpr bool kDgSplit = PATHATTN_CUDA_DG_SPLIT != 0;

constexpr bool valid_super_chunks(int v) { return v == kSuperChunksShort || v == kSuperChunksMid || v == kSuperChunks; }
static_assert(PATHATTN_CUDA_FWD_SUPER_CHUNKS == 0 || valid_super_chunks(PATHATTN_CUDA_FWD_SUPER_CHUNKS),
              "PATHATTN_CUDA_FWD_SUPER_CHUNKS: 4, 6 or 8");
static_assert(PATHATTN_CUDA_BWD_SUPER_CHUNKS == 0 || valid_super_chunks(PATHATTN_CUDA_BWD_SUPER_CHUNKS),
              "PATHATTN_CUDA_BWD_SUPER_CHUNKS: 4, 6 or 8");

// The forward's chunks per superblock: 512 tokens, the size it was built and measured with.
constexpr int fwd_super_chunks() {
  return PATHATTN_CUDA_FWD_SUPER_CHUNKS != 0 ? PATHATTN_CUDA_FWD_SUPER_CHUNKS : kSuperChunks;
}

// The backward's chunks per superblock, by the longest sequence, K = V, and the mode (plain: no gate, not
// deterministic). Short superblocks shorten the serial chains of bwd_q and bwd_k; long ones cost the far kernels
// fewer crossings, which grow as (T / superblock)^2. The first row that matches wins.
enum class Mode { any, plain, gate_or_det };
struct BwdSuperRow {
  int64_t max_len;  // longest sequence, tokens (inclusive)
  int kv;           // K == V == kv (0: any)
  Mode mode;
  int chunks;
};
inline constexpr int64_t kAnyLen = INT64_MAX;
inline constexpr BwdSuperRow kBwdSuperTable[] = {
    {2048, 0, Mode::any, kSuperChunksShort},
    {kAnyLen, 0, Mode::gate_or_det, kSuperChunks},  // measured with the unfused far kernels
    {8192, 128, Mode::plain, kSuperChunksMid},      // measured with the fused far kernel (K == V)
    {4096, 0, Mode::plain, kSuperChunksShort},
    {kAnyLen, 0, Mode::any, kSuperChunks},
};
constexpr int bwd_super_chunks(int64_t longest, int K, int V, bool gate, bool deterministic) {
  if (PATHATTN_CUDA_BWD_SUPER_CHUNKS != 0) return PATHATTN_CUDA_BWD_SUPER_CHUNKS;
  const bool plain = !gate && !deterministic;
  for (const BwdSuperRow& r : kBwdSuperTable) {
    if (longest > r.max_len) continue;
    if (r.kv != 0 && (K != r.kv || V != r.kv)) continue;
    if ((r.mode == Mode::plain && !plain) || (r.mode == Mode::gate_or_det && plain)) continue;
    return r.chunks;
  }
  return kSuperChunks;
}

// Whether some sequence is longer than four superblocks of kSuperChunks (2048 tokens): a deterministic backward's
// stream count turns on it.
constexpr bool longer_than_four_superblocks(int64_t longest) { return longest > int64_t(4) * kSuperChunks * kChunk; }

// The far kernels (Hopper, sm_90a builds) run only where some sequence has more than two superblocks: with at most
// one far superblock per query the split costs more than it saves.
constexpr bool far_worth_it(int nsuper, int max_chunks, int sc) { return nsuper > 0 && max_chunks > 2 * sc; }

// Streams a sliced call may use: two, but one for a deterministic backward over sequences longer than four
// superblocks (its dP sums run in a fixed order along each (sequence, kv head): one stream of larger slices is
// faster than two of half).
inline constexpr int kMaxLanes = 2;
constexpr int max_lanes(bool backward, bool deterministic, int64_t longest) {
  return backward && deterministic && longer_than_four_superblocks(longest) ? 1 : kMaxLanes;
}

// super_bwd's row block where a dev build forces one (0: super_bwd_rows decides).
constexpr int super_bwd_rows_forced(int K, bool deterministic) {
  constexpr int v = PATHATTN_CUDA_SUPER_BWD_ROWS;
  return !deterministic && (v == 32 || v == 64 || v == 128) && v <= K ? v : 0;
}

}  // namespace pathattn::cuda
