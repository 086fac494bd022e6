// pathattn/w_conv_norm.h: the PaTH layer's w preparation as one op: a causal depthwise short convolution over time,
// an optional SiLU and an L2 normalisation per head (docs/spec.md, section 4), forward and backward. It replaces
// the layer's chain of elementwise passes (convolution taps, SiLU, norm) by one pass over w in each direction.
#pragma once

#include "pathattn/types.h"

namespace pathattn {

// ---------------------------------------------------------------------------------------------------
// The op, for each sequence (batch row, or varlen sequence), token t of it and channel c in [0, D):
//   z[t, c] = sum_{i=0}^{W-1} weight[c, i] * x[t - (W - 1 - i), c]  (+ bias[c])   x before the sequence's start = 0
//   a[t, c] = SiLU(z[t, c]) = z / (1 + exp(-z))   when activation, else z
//   out[t, h*hd + j] = a[t, h*hd + j] / sqrt(sum_{j'<hd} a[t, h*hd + j']^2 + eps)   for each head h of D / hd
// weight absent: no convolution (z = x; bias must be absent too), the L2 norm (and SiLU when activation) alone.
// This is flash-linear-attention's ShortConvolution (nn.Conv1d weight [D, 1, W] read as [D, W]: tap i
// multiplies x[t - (W - 1 - i)]) followed by l2_norm over heads of hd channels.
//
// Shapes (token-major, D = number of heads * hd):
//   x          [B, T, D]   bf16 | f16 | f32   (f64 on the cpu / oracle backends)
//   weight     [D, W]      any float dtype (*), optional; 1 <= W <= 64 (cuda: W <= kWConvNormMaxWidthCuda)
//   bias       [D]         any float dtype (*), optional (only with weight)
//   cu_seqlens [N + 1]     i32 | i64, host memory, optional: with it B must be 1 and the N sequences
//                          [cu[n], cu[n+1]) are independent (the convolution restarts at every start)
//   out        [B, T, D]   dtype of x
// (*) bf16, f16, f32 (f64 on CPU backends), independently of x; their gradients come back in their own dtype.
// head_dim: hd >= 1 dividing D (cpu / oracle); the cuda backend takes hd in {16, 32, 64, 128, 256}.
// Compute type: fp32 (fp64 when x is f64; the oracle backend always fp64). Strides: arbitrary, except the
// last dimension of every tensor must have stride 1. The cuda backend runs on `stream`; all views belong to
// the caller; calls are reentrant on disjoint outputs.
// ---------------------------------------------------------------------------------------------------

inline constexpr int kWConvNormMaxWidth = 64;     // cpu / oracle
inline constexpr int kWConvNormMaxWidthCuda = 4;  // the cuda kernels keep W - 1 inputs per channel in registers

struct WConvNormFwdParams {
  // Inputs.
  TensorView x;
  TensorView weight;  // optional: absent means no convolution
  TensorView bias;    // optional
  TensorView cu_seqlens;
  int64_t head_dim = 0;  // required
  bool activation = true;  // SiLU after the convolution (flash-linear-attention's activation="silu")
  double eps = 1e-6;       // inside the square root of the norm; finite, >= 0
  // Output.
  TensorView out;
  // Execution.
  Backend backend = Backend::automatic;  // automatic: cuda for CUDA tensors, else cpu
  int num_threads = 0;                   // CPU: 0 = OpenMP default; results do not depend on it (bitwise)
  void* stream = nullptr;                // cudaStream_t for the cuda backend; nullptr = default stream
};

struct WConvNormBwdParams {
  // Inputs: the forward's inputs and settings, and the output gradient (the forward's result is recomputed).
  TensorView x, weight, bias, cu_seqlens;
  int64_t head_dim = 0;
  bool activation = true;
  double eps = 1e-6;
  TensorView dout;  // [B, T, D], dtype of x
  // Outputs (overwritten, never accumulated into): dx [B, T, D] in x's dtype; dweight [D, W] and dbias [D] in
  // the dtypes of weight and bias, each optional (absent: not computed; never present without its input).
  // dweight and dbias are sums over every token, in a fixed order on every backend (bitwise reproducible).
  TensorView dx, dweight, dbias;
  Backend backend = Backend::automatic;
  int num_threads = 0;
  void* stream = nullptr;
};

// Forward: writes out. Returns a non-ok Status naming the argument, touching no output, on bad input.
Status w_conv_norm_fwd(const WConvNormFwdParams& p);
// Backward: writes dx and, when given, dweight and dbias.
Status w_conv_norm_bwd(const WConvNormBwdParams& p);

}  // namespace pathattn
