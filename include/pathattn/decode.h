// pathattn/decode.h: inference with PaTH attention (docs/spec.md, section 6): prefill a prompt into a cache of
// keys transported to the prompt's end, then decode one token at a time with the in-place rank-one update.
#pragma once

#include "pathattn/attention.h"

namespace pathattn {

// A decode cache for N independent sequences, every view owned by the caller. Capacity C tokens each.
//   kc      [N, H,  C, K]  f32 (f64 with f64 inputs): kc_j = H_t ... H_{j+1} k_j for the cached j <= t
//   vc      [N, H,  C, V]  f32 (f64 with f64 inputs): the values, as given
//   gc      [N, HQ, C]     f64 always: G_j, the inclusive gate cumsum; required iff a gate is used (then
//                          every prefill/decode call on this cache must pass g). fp64 because |G_j| grows
//                          linearly with j: in fp32 its rounding dominated the decode error (1.2e-5 after
//                          3000 steps, against 2e-6 without a gate).
//   lengths [N]            i64, host memory: tokens cached per sequence (0 for an empty slot)
// The cache is kept in fp32 rather than in the model's dtype: re-rounding transported keys to bf16 at
// every step drifts (docs/numerics.md has the measurement).
struct DecodeCache {
  TensorView kc, vc, gc, lengths;
};

// Prefill: runs the forward of `fwd` (any backend) and fills the cache: sequence n of the batch (batch row
// n, or varlen sequence n when fwd.cu_seqlens is given) goes to cache slot n, which must have capacity for
// it; lengths[n] is set to its length. The cache's N must equal the number of sequences.
struct PathPrefillParams {
  PathFwdParams fwd;
  DecodeCache cache;
};
Status path_attn_prefill(const PathPrefillParams& p);

// One decode step for all N sequences at once, token t+1 of each:
//   q [N, 1, HQ, K], k [N, 1, H, K], v [N, 1, H, V] (one dtype), w [N, 1, H, K], beta [N, 1, H],
//   g [N, 1, HQ] (iff the cache has a gate; w, beta, g in any float dtype, as in the forward), o [N, 1, HQ, V] (dtype of v), lse [N, 1, HQ] optional.
// For each sequence: kc_j <- kc_j - beta (w . kc_j) w for every cached j (in place); append k, v, G; then
// o = softmax_j(scale q.kc_j + gate_scale (G_{t+1} - G_j)) v. Every slot must have room for one more
// token (lengths[n] < C), else invalid_argument naming `cache.lengths`. lengths is incremented.
struct PathDecodeParams {
  TensorView q, k, v, w, beta, g;
  double scale = kDefaultScale;
  double gate_scale = kDefaultScale;
  TensorView o, lse;
  DecodeCache cache;
  Backend backend = Backend::automatic;
  int num_threads = 0;
  void* stream = nullptr;
};
Status path_attn_decode(const PathDecodeParams& p);

}  // namespace pathattn
