// cuda/params.h: the one plain struct that carries a call from the adapter (backend.cu) to every
// kernel: raw pointers, element strides, sizes, the chunk table and workspace pointers. Host- and
// device-visible; no framework types. Launchers take it by value plus a stream.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/heuristics.h"

namespace pathattn::cuda {

// Slots of C x K snapshots in each backward CTA's scratch. With the transport, a work item parks at most
// sc states within its own superblock (slots 0 .. sc - 1, by distance in chunks) and one per other superblock
// (slot sc + superblock index); without it, one per chunk of the sequence.
inline int scratch_slot_count(int max_chunks, bool path, int sc) {
  return path ? sc + (max_chunks + sc - 1) / sc : max_chunks;
}

// One chunk of one sequence. Token index tok = b * T + t0 + c * kChunk + r addresses the workspace.
struct ChunkDesc {
  int64_t b;    // batch row
  int64_t t0;   // first position of the sequence within row b
  int32_t len;  // sequence length
  int32_t c;    // chunk index within the sequence
  int32_t first;  // index (in the chunk table) of the sequence's chunk 0
  int32_t sfirst;  // index (in the superblock table) of the sequence's superblock 0
};

// The element type of w, beta, g and of their gradients: the kernels read and write these in the caller's dtype
// and compute in fp32 (load_param / store_param, device/types.cuh).
enum class ParamDt : uint8_t { f32 = 0, bf16 = 1, f16 = 2 };

// Item counters of the backward's persistent kernels (KernelParams::counters).
inline constexpr int kBwdCounters = 5;

struct KernelParams {
  // Sizes.
  int B, T, H, HQ, group, K, V;
  int nchunks;      // entries of the chunk table
  int max_chunks;   // most chunks of any one sequence
  int scratch_slots;  // C x K snapshots per CTA in `scratch` (scratch_slot_count)
  int sc;             // chunks per superblock: kSuperChunks in the forward, bwd_super_chunks's choice in the
                      // backward
  bool path, gate;
  float scale, gate_scale;

  // Inputs (element strides for dims b, t, h; the last dim is contiguous).
  const void *q, *k, *v;
  int64_t q_s[3], k_s[3], v_s[3];
  const void *w, *beta, *g;
  ParamDt w_dt, beta_dt, g_dt;
  int64_t w_s[3], beta_s[3], g_s[3];
  // Forward outputs / backward inputs.
  void* o;
  int64_t o_s[3];
  float* lse;  // may be null in the forward
  int64_t lse_s[3];
  const void* dout;
  int64_t do_s[3];
  // Backward outputs.
  void *dq, *dk, *dv;
  int64_t dq_s[3], dk_s[3], dv_s[3];
  void *dw, *dbeta, *dg;
  ParamDt dw_dt, dbeta_dt, dg_dt;
  int64_t dw_s[3], dbeta_s[3], dg_s[3];

  // Chunk table (device) and the order in which the scan kernels take chunks (most work first).
  const ChunkDesc* chunks;
  const int32_t* order;
  // Superblocks a later query of the same sequence reaches across (each is sc complete chunks):
  // the chunk-table index of each one's first chunk. A sequence's are consecutive, from its superblock 0.
  const int32_t* super_first;
  int nsuper;

  // Workspace, contiguous, token-major (NT = B * T tokens).
  __half* w16;      // [NT, H, K]   w in fp16 (transport operand)
  __half* w2h;      // [NT, H, K]   W2 = E diag(beta) W per chunk, fp16
  void* kt;         // [NT, H, K]   keys moved to their chunk's end, dtype of k
  __half* qtl;      // [NT, HQ, K]  queries moved to their chunk's start (fp16; in the backward, once bwd_q's last
                    //              launch has read a row, the row holds it in the dtype of q for bwd_k)
  float* aloc;      // [NT, HQ, C]  diagonal-chunk logits (unscaled); backward: scale * dS of the diagonal
  float* G;         // [NT, HQ]     inclusive gate cumsum (gate only)
  float* gc;        // [HQ, nchunks, 64] the same times gate_scale log2(e), by chunk: the far kernels' bulk
                    // copies (gate only; rows past a sequence's end unwritten)
  void* ks;         // [NT, H, K]   keys moved to the end of their superblock (full superblocks), dtype of k
  __half* ps;       // [nsuper, H, K, K] superblock products P_last ... P_first, fp16 (forward only)
  // Forward split at the own superblock's start (fwd_far.cu): set, fwd_scan leaves its state there for fwd_far.
  float* ofar;      // [NT, HQ, V]  output over the keys of the own superblock, normalized (null: no split; aloc at V = 64)
  float* lsefar;    // [NT, HQ]     its log2-sum-exp of the scaled scores (base 2)
  // Backward workspace.
  float* delta;     // [NT, HQ]     rowsum(dO * O)
  float* dqt;       // [NT, HQ, K]  gradient w.r.t. the chunk-start queries
  float* dvdiag;    // [NT, HQ, V]  diagonal-chunk P^T dO per query head (bwd_k adds it into dv)
  float* dgrow;     // [NT, HQ]     gate-gradient terms owned by query rows (+ diagonal columns); bwd_q_far writes
                    //              the far pairs' part first, bwd_q's last launch adds the rest
  float* dgcol;     // [NT, HQ]     gate-gradient terms of off-diagonal key columns (bwd_k; with dgq the query
                    //              side's atomics; deterministic with dgq: bwd_q's own superblocks' pairs)
  float* dgcolf;    // [NT, HQ]     deterministic with dgq: the far superblocks' part of dgcol (bwd_q; else null)
  float* colscr;    // [grid, 4, sc, 64] deterministic with dgq: bwd_q's per-warp column sums before their ordered add
  float* dP;        // [nchunks, H, K, K] gradient w.r.t. each chunk's dense product (zeroed by chunk_prep)
  __half* E;        // [nchunks, H, 64, 64] each chunk's E = (I + A)^-1, fp16 with a power of two a row (the
                    //              backward's chunk_prep writes it for bwd_chunk, store_e / load_e; null in the
                    //              forward)
  int32_t* bad;     // [nchunks, H] the first row of each chunk with a non-finite k, w or beta, kChunk if none
                    //              (chunk_prep and its repair launch write it; bwd_chunk reads the backward's)
  float* dkt;       // [NT, H, K]   gradient w.r.t. the chunk-end keys
  float* dvk;       // [NT, H, V]   the far superblocks' P^T dO summed over the group (bwd_k_far; else null;
                    //              dvdiag itself where dvk_merged())
  __half* scratch;  // [grid, scratch_slots, C, K] per-CTA transported states (memory-linear in T)
  // Two-level backward (full superblocks; PaTH only).
  void* qhat;       // [NT, HQ, K]  queries moved to their superblock's start, dtype of q
  float* dks;       // [NT, H, K]   gradient w.r.t. the keys moved to their superblock's end (far pairs; zeroed by
                    //              chunk_prep)
  float* dps;       // [nsuper, H, K, K] gradient w.r.t. each superblock product (zeroed by super_prep's first
                    //                   launch)
  __half* msv;      // [nsuper, H, sc, K, K] the running products M_c = P_last ... P_{c+1} of each full
                    // superblock, fp16: super_prep writes them in the backward (else null), super_bwd reads them
  bool kfar;        // bwd_k_far ran: dks and dvk hold the far superblocks' part of the key side
  int qfar;         // the query side split around bwd_q_far: 0 no split; 1 bwd_q writes qhat only; 2 bwd_q runs
                    // the own superblock only, its chain starting from dqt (bwd_q_far's gradient w.r.t. qhat)
  bool kfuse;       // bwd_k_far takes the query side's far part too (dq by reductions into dqt, which bwd_q's qhat
                    // launch zeroes; dPS from the key chain) and runs before bwd_q's last launch; no bwd_q_far
  // The removed two-size backward's fields: always zero (false) now; bwd_k_far still reads them. To go with its
  // branches in a follow-up (a kernel change, to be measured).
  bool far_adj;
  int far_half;
  void* far1_ks;
  void* far1_qhat;
  float* far1_dqt;
  float* far1_dks;
  bool deterministic;
  bool dgq;         // the gate's column sums of dS come from the query side (bwd_q, bwd_q_far: atomics into
                    // dgcol; deterministic mode: bwd_q alone, ordered adds), not bwd_k; required for the far
                    // kernels to take the gate
  int* counters;    // backward: [kBwdCounters] the persistent kernels' next items (zeroed by chunk_prep; else null)
  int* tickets;     // deterministic mode: [nchunks + nsuper, H] adds done into each dP, then each dPS, then the
                    // query side's next item, then with dgq [nchunks + nsuper, HQ] into each key chunk's dgcol and
                    // each superblock's dgcolf (zeroed)

  // dvk is dvdiag (MHA, bwd_run): bwd_k_far adds the far part of dv into it, bwd_k reads dvdiag alone.
  __host__ __device__ bool dvk_merged() const { return dvk != nullptr && dvk == dvdiag; }
};

// The w preparation op's kernels (kernels/w_conv_norm.cu): raw pointers, strides in elements, one struct for its
// three kernels. Tokens are flat indices f = b * T + t over the batch (B = 1 with cu_seqlens).
struct WConvNormKernelParams {
  const void* x = nullptr;     // [B, T, D] in the kernel's element type; out, dout, dx alike
  void* out = nullptr;
  const void* dout = nullptr;
  void* dx = nullptr;
  int64_t x_s[2] = {0, 0}, out_s[2] = {0, 0}, dout_s[2] = {0, 0}, dx_s[2] = {0, 0};  // batch and token strides
  const void* weight = nullptr;  // [D, W] (row stride weight_s), dtype weight_dt (pathattn::DType), or null
  const void* bias = nullptr;    // [D] (stride bias_s), dtype bias_dt, or null
  int64_t weight_s = 0, bias_s = 0;
  int weight_dt = 0, bias_dt = 0;
  void* dweight = nullptr;       // outputs of the reduction (each optional), dtypes of weight / bias
  void* dbias = nullptr;
  int64_t dweight_s = 0, dbias_s = 0;
  const int64_t* cu = nullptr;   // device copy of cu_seqlens [nseq + 1], or null: sequences are the batch rows
  int nseq = 0;
  int T = 0;                     // tokens per batch row
  int ntok = 0;                  // B * T
  int D = 0, W = 0;              // channels; taps (0: no convolution)
  bool activation = false;
  float eps = 0.f;
  bool vec = false;              // every row of x, out, dout, dx is aligned for the lanes' vector accesses
  int ngroups = 0, ntiles = 0;   // warps: ngroups channel groups x ntiles token tiles
  float* partial = nullptr;      // backward: [ntiles, D, W + 1] per-tile sums of dweight (W) and dbias (1)
};

}  // namespace pathattn::cuda
