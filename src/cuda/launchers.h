// cuda/launchers.h: raw launchers of the PaTH kernels (middle layer: KernelParams + stream in, launch,
// cudaError_t out). The adapter in backend.cu fills KernelParams from a validated core::Problem.
#pragma once

#include <cuda_runtime.h>

#include "cuda/params.h"

namespace pathattn::cuda {

// Attribute `a` of the current device into *v (the launchers' shared-memory and SM-count checks).
inline cudaError_t device_attr(cudaDeviceAttr a, int* v) {
  int dev = 0;
  const cudaError_t e = cudaGetDevice(&dev);
  return e != cudaSuccess ? e : cudaDeviceGetAttribute(v, a, dev);
}

// dtype code of q/k/v: 0 = fp16, 1 = bf16.
// Per (chunk, kv head): UT transform in fp32; writes w16, w2h, kt and per query head qtl, aloc.
cudaError_t launch_chunk_prep(const KernelParams& p, int dtype, cudaStream_t s);
// Per (full superblock, kv head): keys moved to the superblock's end (ks) and the superblock product (ps); where
// p.msv is set, also the running products M_c; with `ks` false those only.
cudaError_t launch_super_prep(const KernelParams& p, int dtype, cudaStream_t s, bool ks = true);
// Rows of the K x K superblock products per CTA for `items` (superblock, kv head) items: K when `whole`, else
// halved (down to 32) while the items' row blocks leave some of the device's `sms` SMs idle.
int super_rows(int K, int items, bool whole, int sms);
// super_bwd's rows: super_rows, then (unless `whole`) halved while a row block's two tile sets would exceed the
// device's shared memory per block (`optin`): the prefetching kernel over smaller blocks is the faster.
int super_bwd_rows(int K, int items, bool whole, int sms, int optin);
// Backward of the superblock products: dPS and dks into the chunk products' dP, in blocks of `rows` rows of the
// products (super_rows: all K in deterministic mode; smaller blocks add into dP with atomics). Persistent grid
// of `grid` CTAs; the running products M_c from super_prep (p.msv).
cudaError_t launch_super_bwd(const KernelParams& p, int dtype, int rows, int grid, cudaStream_t s);
// Per (sequence, query head): G = inclusive cumsum of g.
cudaError_t launch_gate_cumsum(const KernelParams& p, const int32_t* seq_first, int nseqs, cudaStream_t s);
// Forward scan: per (query chunk, query head), keys right to left; writes o and lse. At the head dims where
// fwd_scan_chunks_per_cta(K) is 2, a CTA takes an even chunk and the next: `pairs` holds the even chunks' table
// indices (most work first); elsewhere it takes p.order's chunks and `pairs` is not read.
constexpr int fwd_scan_chunks_per_cta(int K) { return K == 128 ? 2 : 1; }
cudaError_t launch_fwd_scan(const KernelParams& p, const int32_t* pairs, int npairs, int dtype, cudaStream_t s);
// Forward far part on sm_90a (fwd_far.cu), after fwd_scan with p.ofar set: per (tile of two query chunks past
// their sequence's superblock 0, query head); `tiles` holds each tile's first (even) chunk's table index.
// fwd_far_usable: this build and device run it and p's shapes and strides suit its TMA tiles.
bool fwd_far_usable(const KernelParams& p);
cudaError_t launch_fwd_far(const KernelParams& p, const int32_t* tiles, int ntiles, int dtype, cudaStream_t s);
// Backward: delta = rowsum(dO * O) for the rows of p's chunk table, and with lsd (launch_bwd_k_far's, or null)
// its per-row scalars too.
cudaError_t launch_bwd_delta(const KernelParams& p, float2* lsd, int dtype, cudaStream_t s);
// Query-side pass (dqt, dP, diagonal terms); grid = persistent CTA count (scratch slots); `next`: the launch's
// item counter (zeroed; unused in deterministic mode, which counts after p.tickets).
cudaError_t launch_bwd_q(const KernelParams& p, int dtype, int grid, int nitems, int* next, cudaStream_t s);
// Query side's far part on sm_90a (bwd_q_far.cu), between bwd_q with p.qfar = 1 (qhat) and with p.qfar = 2:
// per (tile of two query chunks past their sequence's superblock 0, query head; `tiles` as launch_fwd_far's),
// adds the far superblocks' dPS (atomics) and writes gbar at the own superblock's start into dqt. Parked query
// states in p.scratch (bwd_q_far_park_elems 16-bit elements for park_slots >= 1 states in all), CTA c's from state
// park_first[c] on (as bwd_k_far's); grid from far_grid; `next`: a zeroed int (its item counter).
// bwd_q_far_usable: as bwd_k_far_usable, and not in deterministic mode.
bool bwd_q_far_usable(const KernelParams& p);
size_t bwd_q_far_park_elems(int64_t park_slots, int K);
cudaError_t launch_bwd_q_far(const KernelParams& p, const int32_t* tiles, int ntiles, const int32_t* park_first,
                             int64_t park_slots, int grid, int* next, int dtype, cudaStream_t s);
// Key side's far part on sm_90a (bwd_k_far.cu), after bwd_q (qhat): per (tile of the two chunks of a superblock
// pair with later superblocks in their sequence, kv head), writes dks and the far part of dv (into dvk, or added
// into dvdiag where p.dvk_merged()); bwd_k then runs with p.kfar set. `tiles`: each tile's first (even) chunk's
// table index, most work first; lsd: [HQ][nchunks][64] float2 (filled by launch_bwd_delta); the parked key
// states go to p.scratch (bwd_k_far_park_elems 16-bit elements for park_slots >= 1 states in all), CTA c's from
// state park_first[c] on (a device copy of far_park_first's table); grid from far_grid; `next` a zeroed int (its
// item counter).
// bwd_k_far_usable: this build and device run it and p's shapes and strides suit its tiles
// (no gate). bwd_k_far_fusable: also with p.kfuse (the query side's far part too: no gate, not deterministic,
// and the device's shared memory holds the dS^T buffers).
bool bwd_k_far_usable(const KernelParams& p);
bool bwd_k_far_fusable(const KernelParams& p);
// One CTA per SM for `items` items of the persistent far kernels (0 without a device).
int far_grid(int64_t items);
size_t bwd_k_far_park_elems(int64_t park_slots, int K);
// Rows of dqt past the last token: the fused kernel's paired reduction boxes (map_tokens_paired) reach that far.
inline constexpr int kDqtPadRows = 32;
cudaError_t launch_bwd_k_far(const KernelParams& p, const int32_t* tiles, int ntiles, float2* lsd,
                             const int32_t* park_first, int64_t park_slots, int grid, int* next, int dtype,
                             cudaStream_t s);
// Key-side pass (dkt, dvk, dgcol); with p.kfar, the far superblocks' part is bwd_k_far's (dks, dvk); `next`: the
// launch's item counter (zeroed).
cudaError_t launch_bwd_k(const KernelParams& p, int dtype, int grid, int* next, cudaStream_t s);
// Chunk-local backward through the UT transform: dq, dk, dv, dw, dbeta.
cudaError_t launch_bwd_chunk(const KernelParams& p, int dtype, cudaStream_t s);
// dg = reverse cumsum of (dgrow + dgcol) per (sequence, query head).
cudaError_t launch_bwd_dg(const KernelParams& p, const int32_t* seq_first, int nseqs, cudaStream_t s);

// Persistent-grid sizes: how many CTAs of the backward passes fit on the device at once.
int bwd_q_max_grid(const KernelParams& p, int dtype);
// Floats of p.colscr (the deterministic mode's gate column sums before their ordered add) for a grid of `grid`.
size_t bwd_q_colscr_elems(int grid, int sc);
int bwd_k_max_grid(const KernelParams& p, int dtype);
// Dynamic shared memory each kernel asks for (for the "device too small" check).
size_t smem_fwd_scan(int K, int V);
size_t smem_chunk_prep(int K);
size_t smem_super_prep(int K);  // the largest row block's
size_t smem_super_bwd(int K);  // the largest row block's
size_t smem_bwd_q(int K, int V);
size_t smem_bwd_k(int K, int V);
size_t smem_bwd_chunk(int K);

// The w preparation op (kernels/w_conv_norm.cu); dtype: pathattn::DType of x (bf16, f16, f32), hd: head dim (16, 32,
// 64, 128 or 256; other values return cudaErrorInvalidValue). One warp per (tile of w_conv_norm_tile() tokens,
// channel group of max(32, hd) channels): p.ntiles and p.ngroups. The backward writes the tiles' weight / bias
// sums into p.partial (when not null); the reduce kernel adds them in tile order into p.dweight / p.dbias.
int w_conv_norm_tile();
cudaError_t launch_w_conv_norm_fwd(const WConvNormKernelParams& p, int dtype, int hd, cudaStream_t s);
cudaError_t launch_w_conv_norm_bwd(const WConvNormKernelParams& p, int dtype, int hd, cudaStream_t s);
cudaError_t launch_w_conv_norm_reduce(const WConvNormKernelParams& p, cudaStream_t s);

}  // namespace pathattn::cuda
