// engine/cuda/kernels.cu: the CUDA layer kernels of the engine (engine/cuda/kernels.h). Each kernel computes
// the expression of its engine/ops.cpp twin in the same order (fp64 where ops.cpp sums in fp64); this file is
// built with --fmad=false so products and sums round as on the host, and the row reductions and column
// sums run in a fixed order without atomics. The kernels are small and memory bound: one thread per element,
// one warp per row for row reductions (rows are at most a few hundred wide here), 256-thread blocks.
#include "engine/cuda/kernels.h"

#include <string>

#include "engine/config.h"

namespace pathattn::engine::gpu {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw EngineError(std::string("cuda: ") + what + ": " + cudaGetErrorString(e));
}

void check(cublasStatus_t e, const char* what) {
  if (e != CUBLAS_STATUS_SUCCESS)
    throw EngineError(std::string("cublas: ") + what + ": " + cublasGetStatusString(e));
}

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

// Rows of a warp-per-row kernel: 8 warps (256 threads) per block.
constexpr int kRowsPerBlock = kThreads / 32;
int row_blocks(int64_t rows) { return int((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

#define PA_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__device__ __forceinline__ float sigmoidf_(float z) {
  return z >= 0 ? 1.0f / (1.0f + expf(-z)) : expf(z) / (1.0f + expf(z));
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- column sums: dst[d] += sum_n f(n, d), fp64, fixed order --------------------------------------------
// Block (32, 16): 32 consecutive columns (coalesced reads of a row-major source), 16 row residues; the 16
// partial sums of a column are added in index order.
constexpr int kColX = 32, kColY = 16;

template <class F>
__global__ void colsum_kernel(F f, float* dst, int64_t N, int64_t D) {
  __shared__ double part[kColY][kColX + 1];
  const int64_t d = int64_t(blockIdx.x) * kColX + threadIdx.x;
  double acc = 0;
  if (d < D)
    for (int64_t n = threadIdx.y; n < N; n += kColY) acc += double(f(n, d));
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && d < D) {
    double t = 0;
    for (int i = 0; i < kColY; ++i) t += part[i][threadIdx.x];
    dst[d] = float(double(dst[d]) + t);
  }
}

template <class F>
void colsum(F f, float* dst, int64_t N, int64_t D, cudaStream_t s, const char* what) {
  if (D <= 0) return;
  colsum_kernel<<<int((D + kColX - 1) / kColX), dim3(kColX, kColY), 0, s>>>(f, dst, N, D);
  check(cudaGetLastError(), what);
}

struct RowMajor {
  const float* a;
  int64_t D;
  __device__ float operator()(int64_t n, int64_t d) const { return a[n * D + d]; }
};

// ---- linear ------------------------------------------------------------------------------------------------
__global__ void broadcast_rows_kernel(const float* b, float* y, int64_t N, int64_t Out) {
  PA_GRID_STRIDE(i, N * Out) y[i] = b[i % Out];
}

// ---- embedding ---------------------------------------------------------------------------------------------
__global__ void embedding_fwd_kernel(const int32_t* tok, const float* wte, float* x, int64_t N, int64_t C) {
  PA_GRID_STRIDE(i, N * C) x[i] = wte[int64_t(tok[i / C]) * C + i % C];
}

// Grid (Vc, ceil(C / 256)): one thread per (token id, channel) walks that id's rows in ascending order.
__global__ void embedding_bwd_kernel(const int32_t* rows, const int32_t* start, const float* dx, float* dwte,
                                     int64_t C) {
  const int64_t v = blockIdx.x, c = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float acc = dwte[v * C + c];
  for (int32_t i = start[v]; i < start[v + 1]; ++i) acc += dx[int64_t(rows[i]) * C + c];
  dwte[v * C + c] = acc;
}

// ---- RMSNorm (one warp per row) ---------------------------------------------------------------------------
__global__ void rmsnorm_fwd_kernel(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t C,
                                   double eps) {
  const int64_t n = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const float* xr = x + n * C;
  double ss = 0;
  for (int64_t c = lane; c < C; c += 32) ss += double(xr[c]) * xr[c];
  ss = warp_sum(ss);
  const float r = float(1.0 / sqrt(ss / double(C) + eps));
  if (lane == 0) rstd[n] = r;
  for (int64_t c = lane; c < C; c += 32) y[n * C + c] = xr[c] * r * w[c];
}

__global__ void rmsnorm_bwd_kernel(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                                   int64_t N, int64_t C, bool accumulate) {
  const int64_t n = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const float* xr = x + n * C;
  const float* dyr = dy + n * C;
  const float r = rstd[n];
  double dot = 0;
  for (int64_t c = lane; c < C; c += 32) {
    const float xhat = xr[c] * r;
    dot += double(dyr[c]) * w[c] * xhat;
  }
  dot = warp_sum(dot);
  const float m = float(dot / double(C));
  for (int64_t c = lane; c < C; c += 32) {
    const float v = r * (dyr[c] * w[c] - xr[c] * r * m);
    dx[n * C + c] = accumulate ? dx[n * C + c] + v : v;
  }
}

struct RmsDw {
  const float *x, *rstd, *dy;
  int64_t C;
  __device__ float operator()(int64_t n, int64_t c) const { return dy[n * C + c] * (x[n * C + c] * rstd[n]); }
};

// ---- SwiGLU -----------------------------------------------------------------------------------------------
__global__ void swiglu_fwd_kernel(const float* h, float* m, int64_t N, int64_t F) {
  PA_GRID_STRIDE(i, N * F) {
    const int64_t n = i / F, f = i % F;
    const float a = h[n * 2 * F + f], b = h[n * 2 * F + F + f];
    m[i] = a * sigmoidf_(a) * b;
  }
}

__global__ void swiglu_bwd_kernel(const float* h, const float* dm, float* dh, int64_t N, int64_t F) {
  PA_GRID_STRIDE(i, N * F) {
    const int64_t n = i / F, f = i % F;
    const float a = h[n * 2 * F + f], b = h[n * 2 * F + F + f], d = dm[i];
    const float s = sigmoidf_(a);
    dh[n * 2 * F + f] = d * b * s * (1.0f + a * (1.0f - s));
    dh[n * 2 * F + F + f] = d * a * s;
  }
}

// ---- rotary: one thread per (row, pair index), the angle in fp64 as in ops.cpp ----------------------------
__global__ void rope_kernel(float* x, int64_t N, int64_t T_, int64_t NH, int64_t K, double theta, bool inverse) {
  const int64_t half = K / 2;
  PA_GRID_STRIDE(j, N * half) {
    const int64_t n = j / half, i = j % half;
    const double ang = double(n % T_) * pow(theta, -2.0 * double(i) / double(K));
    const float c = float(cos(ang)), s = float(inverse ? -sin(ang) : sin(ang));
    for (int64_t h = 0; h < NH; ++h) {
      float* r = x + (n * NH + h) * K;
      const float x1 = r[i], x2 = r[i + half];
      r[i] = x1 * c - x2 * s;
      r[i + half] = x1 * s + x2 * c;
    }
  }
}

// ---- causal depthwise conv 3 + SiLU --------------------------------------------------------------------------
__global__ void conv3_silu_fwd_kernel(const float* x, const float* wc, float* c, float* y, int64_t N, int64_t T_,
                                      int64_t D) {
  PA_GRID_STRIDE(i, N * D) {
    const int64_t n = i / D, d = i % D, t = n % T_;
    float acc = 0;
    for (int64_t s = 0; s < 3; ++s) {
      const int64_t dt = 2 - s;  // tap s reads x[t - 2 + s]
      if (t - dt >= 0) acc += wc[d * 3 + s] * x[(n - dt) * D + d];
    }
    c[i] = acc;
    y[i] = acc * sigmoidf_(acc);
  }
}

__device__ __forceinline__ float conv_dc(const float* c, const float* dy, int64_t i) {
  const float a = c[i], s = sigmoidf_(a);
  return dy[i] * s * (1.0f + a * (1.0f - s));
}

// dx[m] gathers the taps that read x[m]: rows m + dt of the same sequence, in ops.cpp's scatter order
// (ascending source row).
__global__ void conv3_silu_bwd_dx_kernel(const float* wc, const float* c, const float* dy, float* dx, int64_t N,
                                         int64_t T_, int64_t D) {
  PA_GRID_STRIDE(i, N * D) {
    const int64_t m = i / D, d = i % D, t = m % T_;
    float acc = 0;
    for (int64_t dt = 0; dt < 3; ++dt)
      if (t + dt < T_) acc += wc[d * 3 + (2 - dt)] * conv_dc(c, dy, (m + dt) * D + d);
    dx[i] = acc;
  }
}

struct ConvDw {  // column j = d * 3 + k of dwc [D, 3]
  const float *x, *c, *dy;
  int64_t T_, D;
  __device__ float operator()(int64_t n, int64_t j) const {
    const int64_t d = j / 3, dt = 2 - j % 3;
    if (n % T_ < dt) return 0.0f;
    return conv_dc(c, dy, n * D + d) * x[(n - dt) * D + d];
  }
};

// ---- per-head L2 norm (one warp per row of K; w and dw rows Kp >= K apart, the pad of w zeroed) ----------
__global__ void l2norm_fwd_kernel(const float* u, float* w, float* rinv, int64_t R, int64_t K, int64_t Kp,
                                  double eps) {
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= R) return;
  double ss = 0;
  for (int64_t e = lane; e < K; e += 32) ss += double(u[r * K + e]) * u[r * K + e];
  ss = warp_sum(ss);
  const float ri = float(1.0 / sqrt(ss + eps));
  if (lane == 0) rinv[r] = ri;
  for (int64_t e = lane; e < Kp; e += 32) w[r * Kp + e] = e < K ? u[r * K + e] * ri : 0.0f;
}

__global__ void l2norm_bwd_kernel(const float* w, const float* rinv, const float* dw, float* du, int64_t R,
                                  int64_t K, int64_t Kp) {
  const int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= R) return;
  double dot = 0;
  for (int64_t e = lane; e < K; e += 32) dot += double(w[r * Kp + e]) * dw[r * Kp + e];
  dot = warp_sum(dot);
  const float fd = float(dot);
  for (int64_t e = lane; e < K; e += 32) du[r * K + e] = rinv[r] * (dw[r * Kp + e] - w[r * Kp + e] * fd);
}

// ---- elementwise -----------------------------------------------------------------------------------------
__global__ void beta_fwd_kernel(const float* z, float* beta, int64_t n) {
  PA_GRID_STRIDE(i, n) beta[i] = 2.0f * sigmoidf_(z[i]);
}
__global__ void beta_bwd_kernel(const float* beta, const float* dbeta, float* dz, int64_t n) {
  PA_GRID_STRIDE(i, n) dz[i] = dbeta[i] * beta[i] * (1.0f - beta[i] / 2.0f);
}
__global__ void logsigmoid_fwd_kernel(const float* z, float* g, int64_t n) {
  PA_GRID_STRIDE(i, n) g[i] = fminf(z[i], 0.0f) - log1pf(expf(-fabsf(z[i])));
}
__global__ void logsigmoid_bwd_kernel(const float* g, const float* dg, float* dz, int64_t n) {
  PA_GRID_STRIDE(i, n) dz[i] = dg[i] * (1.0f - expf(g[i]));
}
__global__ void add_kernel(const float* a, const float* b, float* y, int64_t n) {
  PA_GRID_STRIDE(i, n) y[i] = a[i] + b[i];
}
__global__ void to_bf16_kernel(const float* x, __nv_bfloat16* y, int64_t n) {
  PA_GRID_STRIDE(i, n) y[i] = __float2bfloat16_rn(x[i]);
}
__global__ void from_bf16_kernel(const __nv_bfloat16* x, float* y, int64_t n) {
  PA_GRID_STRIDE(i, n) y[i] = __bfloat162float(x[i]);
}
// A head row zero-padded from K to Kp columns and back: one thread per element of the output.
__global__ void to_bf16_padded_kernel(const float* x, __nv_bfloat16* y, int64_t rows, int64_t K, int64_t Kp) {
  PA_GRID_STRIDE(i, rows * Kp) {
    const int64_t r = i / Kp, e = i % Kp;
    y[i] = e < K ? __float2bfloat16_rn(x[r * K + e]) : __float2bfloat16_rn(0.0f);
  }
}
__global__ void from_bf16_padded_kernel(const __nv_bfloat16* x, float* y, int64_t rows, int64_t K, int64_t Kp) {
  PA_GRID_STRIDE(i, rows * K) y[i] = __bfloat162float(x[(i / K) * Kp + i % K]);
}

// ---- cross-entropy: one 256-thread block per row (vocabularies here are 2 .. a few hundred) ---------------
struct MaxIdx {
  float v;
  int64_t i;
};
__device__ __forceinline__ MaxIdx better(MaxIdx a, MaxIdx b) {  // the larger value; the first index on ties
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

// Row maximum (first argmax) and lse = max + log sum exp(l - max) in fp64, as ops.cpp computes them.
__device__ void row_softmax_stats(const float* l, int64_t Vc, int64_t* am_out, double* lse_out) {
  __shared__ MaxIdx best[kThreads];
  __shared__ double sums[kThreads];
  MaxIdx b{l[0], 0};
  for (int64_t v = threadIdx.x; v < Vc; v += blockDim.x) b = better(b, MaxIdx{l[v], v});
  best[threadIdx.x] = b;
  __syncthreads();
  for (int st = kThreads / 2; st > 0; st >>= 1) {
    if (int(threadIdx.x) < st) best[threadIdx.x] = better(best[threadIdx.x], best[threadIdx.x + st]);
    __syncthreads();
  }
  const int64_t am = best[0].i;
  const double mx = double(l[am]);
  double s = 0;
  for (int64_t v = threadIdx.x; v < Vc; v += blockDim.x) s += exp(double(l[v]) - mx);
  sums[threadIdx.x] = s;
  __syncthreads();
  for (int st = kThreads / 2; st > 0; st >>= 1) {
    if (int(threadIdx.x) < st) sums[threadIdx.x] += sums[threadIdx.x + st];
    __syncthreads();
  }
  *am_out = am;
  *lse_out = mx + log(sums[0]);
  __syncthreads();  // the shared arrays are reused by the caller's next row
}

__global__ void cross_entropy_fwd_kernel(const float* logits, const int32_t* targets, double* loss, int32_t* hit,
                                         int32_t* pred, int64_t Vc) {
  const int64_t n = blockIdx.x;
  const float* l = logits + n * Vc;
  int64_t am;
  double lse;
  row_softmax_stats(l, Vc, &am, &lse);
  if (threadIdx.x != 0) return;
  const int32_t tgt = targets[n];
  if (pred) pred[n] = int32_t(am);
  loss[n] = tgt < 0 ? 0.0 : lse - double(l[tgt]);
  hit[n] = (tgt >= 0 && am == tgt) ? 1 : 0;
}

__global__ void cross_entropy_bwd_kernel(const float* logits, const int32_t* targets, float* dlogits, int64_t Vc,
                                         double grad_scale) {
  const int64_t n = blockIdx.x;
  const float* l = logits + n * Vc;
  float* d = dlogits + n * Vc;
  const int32_t tgt = targets[n];
  if (tgt < 0) {
    for (int64_t v = threadIdx.x; v < Vc; v += blockDim.x) d[v] = 0.0f;
    return;
  }
  int64_t am;
  double lse;
  row_softmax_stats(l, Vc, &am, &lse);
  for (int64_t v = threadIdx.x; v < Vc; v += blockDim.x) {
    const double p = exp(double(l[v]) - lse);
    d[v] = float((p - (v == tgt ? 1.0 : 0.0)) * grad_scale);
  }
}

// One block: strided partial sums, then a fixed tree.
__global__ void cross_entropy_sum_kernel(const double* loss, const int32_t* hit, double* out, int64_t N) {
  __shared__ double sl[kThreads], sh[kThreads];
  double a = 0, b = 0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    a += loss[n];
    b += double(hit[n]);
  }
  sl[threadIdx.x] = a;
  sh[threadIdx.x] = b;
  __syncthreads();
  for (int st = kThreads / 2; st > 0; st >>= 1) {
    if (int(threadIdx.x) < st) {
      sl[threadIdx.x] += sl[threadIdx.x + st];
      sh[threadIdx.x] += sh[threadIdx.x + st];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[0] = sl[0];
    out[1] = sh[0];
  }
}

// ---- global norm and AdamW -------------------------------------------------------------------------------
__device__ void block_sum_to(double v, double* dst) {
  __shared__ double sm[kThreads];
  sm[threadIdx.x] = v;
  __syncthreads();
  for (int st = kThreads / 2; st > 0; st >>= 1) {
    if (int(threadIdx.x) < st) sm[threadIdx.x] += sm[threadIdx.x + st];
    __syncthreads();
  }
  if (threadIdx.x == 0) *dst = sm[0];
}

__global__ void sumsq_partial_kernel(const float* g, int64_t n, double* partial) {
  double acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(kNormBlocks) * kThreads)
    acc += double(g[i]) * double(g[i]);
  block_sum_to(acc, partial + blockIdx.x);
}

__global__ void sumsq_final_kernel(const double* partial, double* out) {
  double acc = 0;
  for (int i = threadIdx.x; i < kNormBlocks; i += kThreads) acc += partial[i];
  block_sum_to(acc, out);
}

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n, float gscale, float b1,
                             float b2, float bc1, float bc2, float lr, float eps, float wd) {
  PA_GRID_STRIDE(i, n) {
    const float gi = g[i] * gscale;
    m[i] = b1 * m[i] + (1.0f - b1) * gi;
    v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
    const float mh = m[i] / bc1, vh = v[i] / bc2;
    p[i] -= lr * (mh / (sqrtf(vh) + eps) + wd * p[i]);
  }
}

}  // namespace

// ---- launchers -------------------------------------------------------------------------------------------

void gemm(const Blas& h, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands, keep the flags.
  const cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (h.precision == GemmPrecision::bf16) {
    check(cublasGemmEx(h.h, opb, opa, int(N), int(M), int(K), &alpha, B, CUDA_R_32F, int(ldb), A, CUDA_R_32F, int(lda),
                       &beta, C, CUDA_R_32F, int(ldc), CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT),
          "gemm (bf16)");
    return;
  }
  check(cublasSgemm(h.h, opb, opa, int(N), int(M), int(K), &alpha, B, int(ldb), A, int(lda), &beta, C, int(ldc)), "sgemm");
}

void linear_fwd(const Blas& h, cudaStream_t s, const float* x, const float* W, const float* b, float* y,
                int64_t N, int64_t In, int64_t Out) {
  if (b) {
    broadcast_rows_kernel<<<blocks_for(N * Out), kThreads, 0, s>>>(b, y, N, Out);
    check(cudaGetLastError(), "linear_fwd bias");
  }
  gemm(h, false, false, N, Out, In, 1.0f, x, In, W, Out, b ? 1.0f : 0.0f, y, Out);
}

void linear_bwd(const Blas& h, cudaStream_t s, const float* x, const float* W, const float* dy, float* dx,
                float* dW, float* db, int64_t N, int64_t In, int64_t Out, bool accumulate) {
  if (dx) gemm(h, false, true, N, In, Out, 1.0f, dy, Out, W, Out, accumulate ? 1.0f : 0.0f, dx, In);
  if (dW) gemm(h, true, false, In, Out, N, 1.0f, x, In, dy, Out, 1.0f, dW, Out);
  if (db) colsum(RowMajor{dy, Out}, db, N, Out, s, "linear_bwd bias");
}

void colsum_acc(const float* src, float* dst, int64_t N, int64_t D, cudaStream_t s) {
  colsum(RowMajor{src, D}, dst, N, D, s, "colsum_acc");
}

void embedding_fwd(const int32_t* tok, const float* wte, float* x, int64_t N, int64_t C, cudaStream_t s) {
  embedding_fwd_kernel<<<blocks_for(N * C), kThreads, 0, s>>>(tok, wte, x, N, C);
  check(cudaGetLastError(), "embedding_fwd");
}

void token_rows(const int32_t* tok, int64_t N, int64_t Vc, std::vector<int32_t>* rows, std::vector<int32_t>* start) {
  start->assign(size_t(Vc + 1), 0);
  for (int64_t n = 0; n < N; ++n) (*start)[size_t(tok[n]) + 1] += 1;
  for (int64_t v = 0; v < Vc; ++v) (*start)[size_t(v) + 1] += (*start)[size_t(v)];
  rows->assign(size_t(N), 0);
  std::vector<int32_t> fill(start->begin(), start->end() - 1);
  for (int64_t n = 0; n < N; ++n) (*rows)[size_t(fill[size_t(tok[n])]++)] = int32_t(n);
}

void embedding_bwd(const int32_t* rows, const int32_t* start, const float* dx, float* dwte, int64_t Vc, int64_t C,
                   cudaStream_t s) {
  if (Vc <= 0 || C <= 0) return;
  embedding_bwd_kernel<<<dim3(unsigned(Vc), unsigned((C + kThreads - 1) / kThreads)), kThreads, 0, s>>>(rows, start,
                                                                                                     dx, dwte, C);
  check(cudaGetLastError(), "embedding_bwd");
}

void rmsnorm_fwd(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t C, double eps,
                 cudaStream_t s) {
  if (N <= 0) return;
  rmsnorm_fwd_kernel<<<row_blocks(N), kThreads, 0, s>>>(x, w, y, rstd, N, C, eps);
  check(cudaGetLastError(), "rmsnorm_fwd");
}

void rmsnorm_bwd(const float* x, const float* w, const float* rstd, const float* dy, float* dx, float* dw,
                 int64_t N, int64_t C, bool accumulate, cudaStream_t s) {
  if (N <= 0) return;
  rmsnorm_bwd_kernel<<<row_blocks(N), kThreads, 0, s>>>(x, w, rstd, dy, dx, N, C, accumulate);
  check(cudaGetLastError(), "rmsnorm_bwd");
  colsum(RmsDw{x, rstd, dy, C}, dw, N, C, s, "rmsnorm_bwd dw");
}

void swiglu_fwd(const float* h, float* m, int64_t N, int64_t F, cudaStream_t s) {
  swiglu_fwd_kernel<<<blocks_for(N * F), kThreads, 0, s>>>(h, m, N, F);
  check(cudaGetLastError(), "swiglu_fwd");
}

void swiglu_bwd(const float* h, const float* dm, float* dh, int64_t N, int64_t F, cudaStream_t s) {
  swiglu_bwd_kernel<<<blocks_for(N * F), kThreads, 0, s>>>(h, dm, dh, N, F);
  check(cudaGetLastError(), "swiglu_bwd");
}

void rope_apply(float* x, int64_t N, int64_t T_, int64_t NH, int64_t K, double theta, bool inverse, cudaStream_t s) {
  rope_kernel<<<blocks_for(N * (K / 2)), kThreads, 0, s>>>(x, N, T_, NH, K, theta, inverse);
  check(cudaGetLastError(), "rope_apply");
}

void conv3_silu_fwd(const float* x, const float* wc, float* c, float* y, int64_t N, int64_t T_, int64_t D,
                    cudaStream_t s) {
  conv3_silu_fwd_kernel<<<blocks_for(N * D), kThreads, 0, s>>>(x, wc, c, y, N, T_, D);
  check(cudaGetLastError(), "conv3_silu_fwd");
}

void conv3_silu_bwd(const float* x, const float* wc, const float* c, const float* dy, float* dx, float* dwc,
                    int64_t N, int64_t T_, int64_t D, cudaStream_t s) {
  conv3_silu_bwd_dx_kernel<<<blocks_for(N * D), kThreads, 0, s>>>(wc, c, dy, dx, N, T_, D);
  check(cudaGetLastError(), "conv3_silu_bwd");
  colsum(ConvDw{x, c, dy, T_, D}, dwc, N, 3 * D, s, "conv3_silu_bwd dwc");
}

// The row stride of a padded head array: Kp (0 means K), which must be >= K.
static int64_t padded_stride(int64_t K, int64_t Kp, const char* what) {
  Kp = Kp > 0 ? Kp : K;
  if (Kp < K)
    throw EngineError(std::string(what) + ": row stride " + std::to_string(Kp) + " < K = " + std::to_string(K));
  return Kp;
}

void l2norm_fwd(const float* u, float* w, float* rinv, int64_t N, int64_t NH, int64_t K, double eps, cudaStream_t s,
                int64_t Kp) {
  if (N * NH <= 0) return;
  Kp = padded_stride(K, Kp, "l2norm_fwd");
  l2norm_fwd_kernel<<<row_blocks(N * NH), kThreads, 0, s>>>(u, w, rinv, N * NH, K, Kp, eps);
  check(cudaGetLastError(), "l2norm_fwd");
}

void l2norm_bwd(const float* w, const float* rinv, const float* dw, float* du, int64_t N, int64_t NH, int64_t K,
                cudaStream_t s, int64_t Kp) {
  if (N * NH <= 0) return;
  Kp = padded_stride(K, Kp, "l2norm_bwd");
  l2norm_bwd_kernel<<<row_blocks(N * NH), kThreads, 0, s>>>(w, rinv, dw, du, N * NH, K, Kp);
  check(cudaGetLastError(), "l2norm_bwd");
}

void beta_fwd(const float* z, float* beta, int64_t n, cudaStream_t s) {
  beta_fwd_kernel<<<blocks_for(n), kThreads, 0, s>>>(z, beta, n);
  check(cudaGetLastError(), "beta_fwd");
}
void beta_bwd(const float* beta, const float* dbeta, float* dz, int64_t n, cudaStream_t s) {
  beta_bwd_kernel<<<blocks_for(n), kThreads, 0, s>>>(beta, dbeta, dz, n);
  check(cudaGetLastError(), "beta_bwd");
}
void logsigmoid_fwd(const float* z, float* g, int64_t n, cudaStream_t s) {
  logsigmoid_fwd_kernel<<<blocks_for(n), kThreads, 0, s>>>(z, g, n);
  check(cudaGetLastError(), "logsigmoid_fwd");
}
void logsigmoid_bwd(const float* g, const float* dg, float* dz, int64_t n, cudaStream_t s) {
  logsigmoid_bwd_kernel<<<blocks_for(n), kThreads, 0, s>>>(g, dg, dz, n);
  check(cudaGetLastError(), "logsigmoid_bwd");
}
void add(const float* a, const float* b, float* y, int64_t n, cudaStream_t s) {
  add_kernel<<<blocks_for(n), kThreads, 0, s>>>(a, b, y, n);
  check(cudaGetLastError(), "add");
}
void to_bf16(const float* x, __nv_bfloat16* y, int64_t n, cudaStream_t s) {
  to_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
  check(cudaGetLastError(), "to_bf16");
}
void from_bf16(const __nv_bfloat16* x, float* y, int64_t n, cudaStream_t s) {
  from_bf16_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, y, n);
  check(cudaGetLastError(), "from_bf16");
}
void to_bf16_padded(const float* x, __nv_bfloat16* y, int64_t rows, int64_t K, int64_t Kp, cudaStream_t s) {
  if (padded_stride(K, Kp, "to_bf16_padded") == K) return to_bf16(x, y, rows * K, s);
  to_bf16_padded_kernel<<<blocks_for(rows * Kp), kThreads, 0, s>>>(x, y, rows, K, Kp);
  check(cudaGetLastError(), "to_bf16_padded");
}
void from_bf16_padded(const __nv_bfloat16* x, float* y, int64_t rows, int64_t K, int64_t Kp, cudaStream_t s) {
  if (padded_stride(K, Kp, "from_bf16_padded") == K) return from_bf16(x, y, rows * K, s);
  from_bf16_padded_kernel<<<blocks_for(rows * K), kThreads, 0, s>>>(x, y, rows, K, Kp);
  check(cudaGetLastError(), "from_bf16_padded");
}

void cross_entropy_fwd(const float* logits, const int32_t* targets, double* loss, int32_t* hit, int32_t* pred,
                       int64_t N, int64_t Vc, cudaStream_t s) {
  if (N <= 0) return;
  cross_entropy_fwd_kernel<<<unsigned(N), kThreads, 0, s>>>(logits, targets, loss, hit, pred, Vc);
  check(cudaGetLastError(), "cross_entropy_fwd");
}

void cross_entropy_sum(const double* loss, const int32_t* hit, double* out, int64_t N, cudaStream_t s) {
  cross_entropy_sum_kernel<<<1, kThreads, 0, s>>>(loss, hit, out, N);
  check(cudaGetLastError(), "cross_entropy_sum");
}

void cross_entropy_bwd(const float* logits, const int32_t* targets, float* dlogits, int64_t N, int64_t Vc,
                       double grad_scale, cudaStream_t s) {
  if (N <= 0) return;
  cross_entropy_bwd_kernel<<<unsigned(N), kThreads, 0, s>>>(logits, targets, dlogits, Vc, grad_scale);
  check(cudaGetLastError(), "cross_entropy_bwd");
}

void sumsq(const float* g, int64_t n, double* partial, double* out, cudaStream_t s) {
  sumsq_partial_kernel<<<kNormBlocks, kThreads, 0, s>>>(g, n, partial);
  check(cudaGetLastError(), "sumsq");
  sumsq_final_kernel<<<1, kThreads, 0, s>>>(partial, out);
  check(cudaGetLastError(), "sumsq final");
}

void adamw(float* p, const float* g, float* m, float* v, int64_t n, float gscale, float b1, float b2, float bc1,
           float bc2, float lr, float eps, float wd, cudaStream_t s) {
  if (n <= 0) return;
  adamw_kernel<<<blocks_for(n), kThreads, 0, s>>>(p, g, m, v, n, gscale, b1, b2, bc1, bc2, lr, eps, wd);
  check(cudaGetLastError(), "adamw");
}

}  // namespace pathattn::engine::gpu
