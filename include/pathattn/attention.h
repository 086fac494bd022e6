// pathattn/attention.h: the PaTH / PaTH-FoX attention op (forward and backward) and its params structs.
// One params struct per direction feeds every backend (oracle, cpu, cuda): fill it once, set `backend`,
// call path_attn_fwd / path_attn_bwd. Semantics are exactly those of docs/spec.md; this header restates them.
#pragma once

#include <cmath>
#include <limits>

#include "pathattn/types.h"

namespace pathattn {

// ---------------------------------------------------------------------------------------------------
// The op, for one sequence and one query head h (kv head h / (HQ/H)), positions t = 0..T-1:
//   H_t        = I - beta_t w_t w_t^T
//   logit(i,j) = q_i^T (H_i H_{i-1} ... H_{j+1}) k_j      (j <= i; the empty product at j == i)
//   s(i,j)     = scale * logit(i,j) + gate_scale * (G_i - G_j),   G_t = sum_{u<=t} g_u
//   o_i        = sum_{j<=i} softmax_j(s(i,.)) v_j,   lse_i = log sum_{j<=i} exp(s(i,j))   (natural log)
// With w and beta absent the op is plain causal softmax attention (FoX attention when g is given): the
// same params struct serves as the library's plain attention, the floor PaTH is measured against.
//
// Shapes (FlashAttention / flash-linear-attention layout, token-major):
//   q    [B, T, HQ, K]   bf16 | f16 | f32  (f64 on CPU backends)
//   k    [B, T, H,  K]   dtype of q
//   v    [B, T, H,  V]   dtype of q
//   w    [B, T, H,  K]   any float dtype (*)       optional together with beta (absent: plain attention)
//   beta [B, T, H]       any float dtype (*)
//   g    [B, T, HQ]      any float dtype (*)       optional: raw per-step log gate; the op does the cumsum
//   o    [B, T, HQ, V]   dtype of v                output
//   lse  [B, T, HQ]      f32 (f64 when q is f64)   output, optional in the forward
// (*) w, beta and g each take bf16, f16 or f32 (f64 on CPU backends) whatever q's dtype (flash-linear-attention
// passes them in the model's dtype or in fp32). Every backend computes with them in its compute type (fp32, or
// fp64 for f64 q on CPU; the oracle always fp64), reading the narrow types directly (CPU) or converting them
// once at entry (CUDA: an fp32 copy in workspace, none when they are f32). Their gradients come back in
// their own dtype (dw in w's, dbeta in beta's, dg in g's).
//   cu_seqlens [N + 1]   i32 | i64, host memory for CPU backends; optional. With it B must be 1 and the
//                        N sequences [cu[n], cu[n+1]) are independent (products and cumsums restart).
// HQ must be a multiple of H (GQA/MQA: query head h uses kv head h / (HQ / H)). K and V: CPU backends
// accept every multiple of 8 up to 256; the CUDA backend reports the set it was built for.
// Strides: arbitrary, except the last dimension of every tensor must have stride 1.
//
// Ownership and threading: the library never keeps a pointer past the call and never allocates output
// memory; all views belong to the caller. Calls are reentrant: concurrent calls on disjoint outputs are
// safe. The CPU backends use OpenMP internally (num_threads below); the CUDA backend runs on `stream`.
// ---------------------------------------------------------------------------------------------------

// Sentinel meaning "use the default" for scale (K^-1/2) and gate_scale (= scale, the flash-linear-attention
// convention; set gate_scale = 1 for the FoX paper's convention).
inline constexpr double kDefaultScale = std::numeric_limits<double>::quiet_NaN();
// The CUDA backend's default workspace limit is the larger of this and the bytes of q, k and v.
inline constexpr int64_t kDefaultWorkspaceFloor = int64_t(512) << 20;

struct PathFwdParams {
  // Inputs.
  TensorView q, k, v;
  TensorView w, beta;  // both present (PaTH) or both absent (plain attention)
  TensorView g;        // optional forget gate (PaTH-FoX / FoX)
  TensorView cu_seqlens;
  double scale = kDefaultScale;
  double gate_scale = kDefaultScale;
  // Outputs.
  TensorView o;
  TensorView lse;  // optional
  // Execution.
  Backend backend = Backend::automatic;
  int num_threads = 0;   // CPU: 0 = OpenMP default; results do not depend on it (bitwise)
  int chunk_size = 0;    // CPU fast path: 0 = tuned default; must be a multiple of 8 otherwise
  bool validate = false; // also reject non-finite inputs, beta outside [0, 2], | ||w|| - 1 | > 1e-2
  void* stream = nullptr;  // cudaStream_t for the CUDA backend; nullptr = default stream
  // CUDA: bytes of workspace the call may hold at once. The CUDA backend keeps per-token intermediates (the
  // backward about 2.4 KB per token and head at K = 64, 5 KB at K = 128); when they would exceed the limit it
  // runs the call in slices of kv heads (then of batch rows), each with its own workspace; results are those
  // of one call. 0 = default, the larger of kDefaultWorkspaceFloor (512 MiB) and the bytes of q, k and v;
  // < 0 = no limit (one slice; results/bench/gpu_h200*.md give what slicing costs; a limit whose plan runs two
  // streams of slices of two or more kv heads can be faster than one slice: docs/cuda.md, "Workspace
  // planning"). A single (batch row, kv head) slice is never split further, so a call may exceed a limit
  // below that slice's need.
  int64_t workspace_limit = 0;
};

struct PathBwdParams {
  // Inputs: the forward's inputs, its outputs o and lse (lse is required here), and the output gradient.
  TensorView q, k, v;
  TensorView w, beta;
  TensorView g;
  TensorView cu_seqlens;
  double scale = kDefaultScale;
  double gate_scale = kDefaultScale;
  TensorView o, lse;
  TensorView do_;  // [B, T, HQ, V], dtype of v
  // Outputs (each overwritten, never accumulated into):
  //   dq [B,T,HQ,K], dk [B,T,H,K], dv [B,T,H,V] in the dtype of q (accumulated in fp32 / fp64);
  //   dw [B,T,H,K], dbeta [B,T,H] (required when w is present), dg [B,T,HQ] (required when g is present),
  //   in the dtype of w / beta / g. GQA: kv-head gradients are summed over the query heads of a group.
  //   dg is the gradient with respect to the raw g (not its cumsum).
  TensorView dq, dk, dv, dw, dbeta, dg;
  Backend backend = Backend::automatic;
  int num_threads = 0;
  int chunk_size = 0;
  bool deterministic = false;  // CPU backends are always deterministic; CUDA: bitwise-reproducible mode
  bool validate = false;
  void* stream = nullptr;
  int64_t workspace_limit = 0;  // as in PathFwdParams
};

// The backward's parameters for the forward call f: its inputs, scales, outputs o / lse and execution settings
// (backend, threads, chunk size, validation, stream). The caller adds do_ and the gradient views.
inline PathBwdParams bwd_params_for(const PathFwdParams& f) {
  PathBwdParams b;
  b.q = f.q, b.k = f.k, b.v = f.v, b.w = f.w, b.beta = f.beta, b.g = f.g, b.cu_seqlens = f.cu_seqlens;
  b.scale = f.scale, b.gate_scale = f.gate_scale;
  b.o = f.o, b.lse = f.lse;
  b.backend = f.backend, b.num_threads = f.num_threads, b.chunk_size = f.chunk_size, b.validate = f.validate;
  b.stream = f.stream, b.workspace_limit = f.workspace_limit;
  return b;
}

// Forward: writes o (and lse when given). Returns a non-ok Status, touching no output, on bad input.
Status path_attn_fwd(const PathFwdParams& p);

// Every check path_attn_fwd makes of the inputs and options (not of o / lse, and no value scan), in the same
// order and with the same messages: lets a caller allocate outputs only once the arguments are known good.
// Reads nothing but the views' headers and cu_seqlens.
Status path_attn_check_inputs(const PathFwdParams& p);

// Backward: writes every gradient view given. Returns a non-ok Status on bad input.
Status path_attn_bwd(const PathBwdParams& p);

// Backends compiled into this build, e.g. "oracle cpu" or "oracle cpu cuda(sm_90a,sm_80)".
std::string build_info();

}  // namespace pathattn
