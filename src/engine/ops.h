// engine/ops.h: the layer kernels of the engine, forward and backward, templated on the scalar type
// (float for training, double for gradient checks). This header is the compute seam: the model calls only
// these functions and the attention op, so another backend (CUDA) replaces this file's definitions.
// Conventions: activations are row-major [N, C] with N = B * T rows (token-major, batch row b holds
// positions b*T .. b*T+T-1). Weights are stored [In, Out] so y = x W. Backward functions accumulate (+=)
// into parameter gradients and into dx when `accumulate` is set (residual streams); otherwise they overwrite.
#pragma once

#include <cstdint>

namespace pathattn::engine {

// y[N, Out] = x[N, In] W[In, Out] + b[Out] (b may be null). GEMM through cpu/blas.h.
template <typename T>
void linear_fwd(const T* x, const T* W, const T* b, T* y, int64_t N, int64_t In, int64_t Out);
// dx[N, In] (=|+=) dy[N, Out] W^T;  dW[In, Out] += x^T dy;  db[Out] += sum_n dy (db may be null).
// dx may be null (input needs no gradient).
template <typename T>
void linear_bwd(const T* x, const T* W, const T* dy, T* dx, T* dW, T* db, int64_t N, int64_t In, int64_t Out,
                bool accumulate);

// x[N, C] = wte[tok[n], :] for the token ids tok[N] (each in [0, vocab)).
template <typename T>
void embedding_fwd(const int32_t* tok, const T* wte, T* x, int64_t N, int64_t C);
// dwte[tok[n], :] += dx[n, :].
template <typename T>
void embedding_bwd(const int32_t* tok, const T* dx, T* dwte, int64_t N, int64_t C);

// RMSNorm over the last dim: y = x * rstd * w, rstd[n] = 1 / sqrt(mean(x[n]^2) + eps). x, y [N, C], w [C].
template <typename T>
void rmsnorm_fwd(const T* x, const T* w, T* y, T* rstd, int64_t N, int64_t C, double eps);
// dx[N, C] (=|+=) ..., dw[C] += sum_n dy * x * rstd.
template <typename T>
void rmsnorm_bwd(const T* x, const T* w, const T* rstd, const T* dy, T* dx, T* dw, int64_t N, int64_t C,
                 bool accumulate);

// SwiGLU: h [N, 2F] = [a | b]; m [N, F] = silu(a) * b.
template <typename T>
void swiglu_fwd(const T* h, T* m, int64_t N, int64_t F);
// dh [N, 2F] (overwritten) from dm [N, F].
template <typename T>
void swiglu_bwd(const T* h, const T* dm, T* dh, int64_t N, int64_t F);

// Rotary embedding in place on x [B*T, NH, K] (rotate-half pairing (i, i + K/2), angle pos * theta^(-2i/K),
// pos = row % T). `inverse` rotates by the negative angle: that is the backward (dx = R^T dy).
template <typename T>
void rope_apply(T* x, int64_t N, int64_t T_, int64_t NH, int64_t K, double theta, bool inverse);
// The same rotation with positions shifted: pos = pos0 + row % T (decode: one row at its absolute position,
// N = T = 1, pos0 = the tokens before it). rope_apply is rope_apply_at with pos0 = 0, bit for bit.
template <typename T>
void rope_apply_at(T* x, int64_t N, int64_t T_, int64_t pos0, int64_t NH, int64_t K, double theta, bool inverse);

// Causal depthwise convolution of width 3 over time within each sequence, then SiLU:
//   c[b, t, ch] = sum_{s=0..2} wc[ch, s] x[b, t - 2 + s, ch]  (zero before t = 0);  y = silu(c).
// x, c, y [B*T, D]; wc [D, 3]. c is kept for the backward.
template <typename T>
void conv3_silu_fwd(const T* x, const T* wc, T* c, T* y, int64_t N, int64_t T_, int64_t D);
// dx [B*T, D] (overwritten), dwc [D, 3] += ..., from dy.
template <typename T>
void conv3_silu_bwd(const T* x, const T* wc, const T* c, const T* dy, T* dx, T* dwc, int64_t N, int64_t T_,
                    int64_t D);

// Per-head L2 normalisation: w[n, h, :] = u / sqrt(sum u^2 + eps), u and w [N, NH, K]; rinv [N, NH].
template <typename T>
void l2norm_fwd(const T* u, T* w, T* rinv, int64_t N, int64_t NH, int64_t K, double eps);
// du (overwritten) = rinv * (dw - w (w . dw)).
template <typename T>
void l2norm_bwd(const T* w, const T* rinv, const T* dw, T* du, int64_t N, int64_t NH, int64_t K);

// beta = 2 sigmoid(z), elementwise over n values (in place allowed). Backward: dz = dbeta * beta * (1 - beta/2).
template <typename T>
void beta_fwd(const T* z, T* beta, int64_t n);
template <typename T>
void beta_bwd(const T* beta, const T* dbeta, T* dz, int64_t n);

// g = logsigmoid(z) elementwise. Backward: dz = dg * (1 - exp(g)).
template <typename T>
void logsigmoid_fwd(const T* z, T* g, int64_t n);
template <typename T>
void logsigmoid_bwd(const T* g, const T* dg, T* dz, int64_t n);

// y[i] += x[i] for i < n.
template <typename T>
void add_inplace(T* y, const T* x, int64_t n);

// Softmax cross-entropy over logits [N, Vc] with targets [N] (-1 = no loss at that row). Returns the summed
// loss over counted rows (in double); counts rows and argmax hits. When dlogits is given it receives
// (softmax - onehot) * grad_scale for counted rows and 0 elsewhere. pred[N] (optional): argmax per row.
struct CeStats {
  double loss_sum = 0;
  int64_t count = 0, correct = 0;
};
template <typename T>
CeStats cross_entropy(const T* logits, const int32_t* targets, T* dlogits, int32_t* pred, int64_t N, int64_t Vc,
                      double grad_scale);

}  // namespace pathattn::engine
