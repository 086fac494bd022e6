// engine/cuda/kernels.h: the engine's layer kernels on a CUDA device, fp32: the device twins of engine/ops.h
// (same names, shapes and overwrite / accumulate rules, so a test runs both on one input), plus what the CUDA
// model needs around them: bf16 conversion for the attention op, the fused AdamW update, the global norm.
// Raw-pointer launchers on a stream; every pointer is device memory unless its comment says host. Each
// launcher throws EngineError when the launch (or cuBLAS call) fails. No reduction uses atomics: results are
// bitwise reproducible run to run on one device.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

namespace pathattn::engine::gpu {

// Throws EngineError("cuda: <what>: <error string>") when e is not cudaSuccess.
void check(cudaError_t e, const char* what);
void check(cublasStatus_t e, const char* what);

// How a handle's GEMMs compute: fp32 (cublasSgemm under the handle's math mode: plain fp32, or TF32 where the
// mode allows it) or bf16 (cublasGemmEx, CUBLAS_COMPUTE_32F_FAST_16BF: fp32 operands rounded to bf16 inside
// cuBLAS, tensor cores, fp32 accumulation and output).
enum class GemmPrecision { fp32, bf16 };
struct Blas {
  cublasHandle_t h = nullptr;
  GemmPrecision precision = GemmPrecision::fp32;
  Blas(cublasHandle_t handle = nullptr, GemmPrecision p = GemmPrecision::fp32) : h(handle), precision(p) {}
};

// Row-major GEMM with cpu::gemm's contract, through cuBLAS on the handle's stream and math mode:
// C[M, N] = alpha op(A)[M, K] op(B)[K, N] + beta C, op(X) = X or X^T, leading dimensions in elements.
void gemm(const Blas& h, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// y[N, Out] = x[N, In] W[In, Out] + b[Out] (b may be null). The handle must run on stream s.
void linear_fwd(const Blas& h, cudaStream_t s, const float* x, const float* W, const float* b, float* y,
                int64_t N, int64_t In, int64_t Out);
// dx[N, In] (=|+=) dy W^T (dx may be null); dW[In, Out] += x^T dy; db[Out] += column sums of dy (may be null).
void linear_bwd(const Blas& h, cudaStream_t s, const float* x, const float* W, const float* dy, float* dx,
                float* dW, float* db, int64_t N, int64_t In, int64_t Out, bool accumulate);

// dst[D] += sum_n src[n, d] over src [N, D], summed in fp64 in a fixed order.
void colsum_acc(const float* src, float* dst, int64_t N, int64_t D, cudaStream_t s);

// x[N, C] = wte[tok[n], :].
void embedding_fwd(const int32_t* tok, const float* wte, float* x, int64_t N, int64_t C, cudaStream_t s);
// Rows of each token id, for a scatter-add without atomics (host arrays): start[Vc + 1] offsets into
// rows[N], the row indices of token v in ascending order at rows[start[v] .. start[v + 1]).
void token_rows(const int32_t* tok, int64_t N, int64_t Vc, std::vector<int32_t>* rows, std::vector<int32_t>* start);
// dwte[v, :] += sum of dx[n, :] over the rows n of token v, in ascending n (engine/ops.cpp's order).
// rows [N] and start [Vc + 1] are device copies of token_rows' output.
void embedding_bwd(const int32_t* rows, const int32_t* start, const float* dx, float* dwte, int64_t Vc, int64_t C,
                   cudaStream_t s);

// RMSNorm: y = x * rstd * w, rstd[n] = 1 / sqrt(mean_c x^2 + eps). x, y [N, C]; w [C]; rstd [N].
void rmsnorm_fwd(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t C, double eps,
                 cudaStream_t s);
// dx[N, C] (=|+=) rstd (dy w - xhat mean_c(dy w xhat)); dw[C] += sum_n dy xhat.
void rmsnorm_bwd(const float* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw,
                 int64_t N, int64_t C, bool accumulate, cudaStream_t s);

// SwiGLU: h [N, 2F] = [a | b], m [N, F] = silu(a) b; backward overwrites dh [N, 2F].
void swiglu_fwd(const float* h, float* m, int64_t N, int64_t F, cudaStream_t s);
void swiglu_bwd(const float* h, const float* dm, float* dh, int64_t N, int64_t F, cudaStream_t s);

// Rotary embedding in place on x [N, NH, K] (rotate-half, pos = n % T_); inverse: by the negative angle.
void rope_apply(float* x, int64_t N, int64_t T_, int64_t NH, int64_t K, double theta, bool inverse, cudaStream_t s);

// Causal depthwise conv of width 3 within each sequence, then SiLU: x, c, y [N, D]; wc [D, 3].
void conv3_silu_fwd(const float* x, const float* wc, float* c, float* y, int64_t N, int64_t T_, int64_t D,
                    cudaStream_t s);
// dx [N, D] overwritten; dwc [D, 3] +=.
void conv3_silu_bwd(const float* x, const float* wc, const float* c, const float* dy, float* dx, float* dwc,
                    int64_t N, int64_t T_, int64_t D, cudaStream_t s);

// Per-head L2 norm: w = u / sqrt(sum u^2 + eps) over rows of K; u [N, NH, K]; rinv [N, NH]. w is [N, NH, Kp]:
// Kp = 0 means K; Kp > K writes each row zero-padded to Kp (columns K..Kp-1 zero), the attention op's layout
// for a head dim the CUDA attention is not built for (engine/cuda/model_cuda.h).
void l2norm_fwd(const float* u, float* w, float* rinv, int64_t N, int64_t NH, int64_t K, double eps, cudaStream_t s,
                int64_t Kp = 0);
// du [N, NH, K] (overwritten) = rinv (dw - w (w . dw)) over the first K columns of w, dw [N, NH, Kp] (Kp = 0: K);
// the padded columns of dw are ignored.
void l2norm_bwd(const float* w, const float* rinv, const float* dw, float* du, int64_t N, int64_t NH, int64_t K,
                cudaStream_t s, int64_t Kp = 0);

// beta = 2 sigmoid(z); dz = dbeta beta (1 - beta / 2). g = logsigmoid(z); dz = dg (1 - exp(g)). In place allowed.
void beta_fwd(const float* z, float* beta, int64_t n, cudaStream_t s);
void beta_bwd(const float* beta, const float* dbeta, float* dz, int64_t n, cudaStream_t s);
void logsigmoid_fwd(const float* z, float* g, int64_t n, cudaStream_t s);
void logsigmoid_bwd(const float* g, const float* dg, float* dz, int64_t n, cudaStream_t s);

// y[i] = a[i] + b[i] (y may alias a: add_inplace of ops.h).
void add(const float* a, const float* b, float* y, int64_t n, cudaStream_t s);

// fp32 <-> bf16 (round to nearest even) for the attention op's q, k, v, o, do and dq, dk, dv.
void to_bf16(const float* x, __nv_bfloat16* y, int64_t n, cudaStream_t s);
void from_bf16(const __nv_bfloat16* x, float* y, int64_t n, cudaStream_t s);
// The same per head row, with the attention op's head dim Kp >= K: to_bf16_padded writes y [rows, Kp] from
// x [rows, K] with columns K..Kp-1 zero; from_bf16_padded writes y [rows, K] from the first K columns of
// x [rows, Kp]. With Kp == K they are to_bf16 / from_bf16 of rows * K elements (the same kernel launch).
void to_bf16_padded(const float* x, __nv_bfloat16* y, int64_t rows, int64_t K, int64_t Kp, cudaStream_t s);
void from_bf16_padded(const __nv_bfloat16* x, float* y, int64_t rows, int64_t K, int64_t Kp, cudaStream_t s);

// Softmax cross-entropy over logits [N, Vc] with targets [N] (-1: no loss). Per row: loss[n] = lse - l[tgt]
// (fp64; 0 at uncounted rows), hit[n] = (argmax == tgt), pred[n] = argmax (first maximum; pred may be null).
void cross_entropy_fwd(const float* logits, const int32_t* targets, double* loss, int32_t* hit, int32_t* pred,
                       int64_t N, int64_t Vc, cudaStream_t s);
// out[0] = sum_n loss[n], out[1] = sum_n hit[n] (fp64, fixed order, one block).
void cross_entropy_sum(const double* loss, const int32_t* hit, double* out, int64_t N, cudaStream_t s);
// dlogits [N, Vc] = (softmax - onehot) * grad_scale at counted rows, 0 elsewhere.
void cross_entropy_bwd(const float* logits, const int32_t* targets, float* dlogits, int64_t N, int64_t Vc,
                       double grad_scale, cudaStream_t s);

// Sum of squares of g[n] in fp64: writes kNormBlocks partial sums to partial[], then their sum to out[0].
// The grid is fixed (not device dependent), so the result is the same on every device.
inline constexpr int kNormBlocks = 256;
void sumsq(const float* g, int64_t n, double* partial, double* out, cudaStream_t s);

// One AdamW update of n parameters (engine/optim.h, same fp32 expressions): gi = g * gscale;
// m = b1 m + (1 - b1) gi; v = b2 v + (1 - b2) gi^2; p -= lr (m / bc1 / (sqrt(v / bc2) + eps) + wd p).
void adamw(float* p, const float* g, float* m, float* v, int64_t n, float gscale, float b1, float b2, float bc1,
           float bc2, float lr, float eps, float wd, cudaStream_t s);

}  // namespace pathattn::engine::gpu
