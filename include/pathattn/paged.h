// pathattn/paged.h: serving-side inference with PaTH attention: a paged decode cache whose keys are transported
// lazily (docs/design.md, "The paged decode cache"), batched requests of different lengths, metadata on the
// cache's device so that a decode step can be captured in a CUDA graph.
#pragma once

#include "pathattn/attention.h"

namespace pathattn {

// Most tokens a request may hold between flushes (the pending buffer's S is 1 .. this).
inline constexpr int kPagedMaxPending = 64;

// A paged cache for N request slots. Keys and values live in pages of a pool shared by the slots; slot n's
// token j sits in page block_table[n, j / page] at row j % page. Layouts follow vLLM / FlashInfer (NHD).
//   k_pages     [P, page, H, K]   f16 (or f32): slot n's token j < m = flushed[n] holds kc_j = H_{m-1} ... H_{j+1} k_j,
//                                 its key transported to the slot's flush point; rows j >= m are
//                                 not read (their keys wait in the pending buffer)
//   v_pages     [P, page, H, V]   the dtype of v: the values as given (never transported)
//   g_pages     [P, page, HQ]     f64, iff the gate: G_j, the inclusive gate cumsum of the slot's sequence
//   block_table [N, max_pages]    i32: page indices into the pool, capacity max_pages * page tokens a slot
//   lengths     [N]               i32: tokens cached in each slot; -1 marks a free slot, which a step skips
//                                 (its outputs are written as zeros, nothing of the cache is touched)
//   flushed     [N]               i32: each slot's flush point m, lengths - S <= m <= lengths
//   pend_k      [N, S, H, K]      f32: k of the slot's tokens m .. lengths-1, row j - m, as given
//   pend_w      [N, S, H, K]      f32: their w (plain attention, no w: absent, and S is taken from pend_k)
//   pend_beta   [N, S, H]         f32: their beta (absent without w)
// Every view is on one device: the CUDA backend's on the GPU (the metadata too: a step reads and writes it there,
// no host copy), the CPU backends' in host memory. Pages may be shared between slots only while no step writes
// them (a flush rewrites every key page of its slot).
// Why lazy: q_i . (H_i ... H_{j+1} k_j) = (H_m ... H_i q_i) . kc_j for j < m (every H_t is symmetric), so a
// step carries its query back across the pending factors instead of every key forward, and once S tokens are
// pending the next step first applies their S factors to the slot's keys at once (a flush: one read and write of
// the slot's keys every S steps instead of every step). Keys are rounded to the page dtype once a flush.
struct PagedCache {
  TensorView k_pages, v_pages, g_pages, block_table, lengths, flushed, pend_k, pend_w, pend_beta;
};

// Prefill: runs the forward of `fwd` and writes each sequence into a cache slot, its keys transported to its end
// (flushed = lengths = its length, nothing pending). Sequence n (batch row n, or varlen sequence n with
// fwd.cu_seqlens) goes to slot slots[n] (slots: [num_seqs] i32 in host memory; absent: slot n); other slots are
// untouched, so a prefill inserts requests into a running batch. The slot's block table must cover the length.
struct PathPagedPrefillParams {
  PathFwdParams fwd;
  PagedCache cache;
  TensorView slots;
};
Status path_attn_paged_prefill(const PathPagedPrefillParams& p);

// Decode T tokens for every slot of the cache, in order (T = 1: one step; T > 1: chunked prefill or verifying
// draft tokens, equal to T single steps):
//   q [N, T, HQ, K], k [N, T, H, K], v [N, T, H, V] (one dtype), w [N, T, H, K], beta [N, T, H], g [N, T, HQ]
//   (iff the cache has g_pages; w, beta, g in any float dtype), o [N, T, HQ, V] (dtype of v), lse [N, T, HQ]
//   (f32, optional). Token t of slot n attends to the slot's cached tokens and itself, then joins the cache.
// validate (default): the entry first reads lengths, flushed and the block table rows it will use (a copy to
// the host and a wait on the stream for the CUDA backend) and refuses, naming the argument, a page index outside
// the pool, a length beyond a slot's capacity or an inconsistent flush point; nothing is written then. With
// validate off (a step captured in a CUDA graph) nothing is read on the host: a slot whose metadata is out of
// range is skipped by the kernels (its outputs NaN, its cache untouched).
struct PathPagedDecodeParams {
  TensorView q, k, v, w, beta, g;
  double scale = kDefaultScale;
  double gate_scale = kDefaultScale;
  TensorView o, lse;
  PagedCache cache;
  bool validate = true;
  Backend backend = Backend::automatic;
  int num_threads = 0;
  void* stream = nullptr;
};
Status path_attn_paged_decode(const PathPagedDecodeParams& p);

}  // namespace pathattn
