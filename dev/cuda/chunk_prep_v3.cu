// dev/cuda/chunk_prep_v3.cu: playground for the v3 chunk_prep (HISTORY.md, "v3 chunk_prep with staged operands").
// Every tf32 product takes both operands through ldmatrix from shared memory in the [row][k] / [col][k] form,
// staged once per phase: rounded to tf32 when staged (plain products, no conversion in the loop), or fp32 and
// split by a mask in the loop (split-tf32 products). Transposed operands are written transposed by the
// epilogue of the product that makes them. Same outputs as the library's chunk_prep (w16, w2h, kt, qtl,
// aloc); U and k~ are computed in split-tf32 here (plain in the library).
// Self-checking: the library's chunk_prep (src/cuda/kernels/prep_chunk.cu, through its launcher) and v3 against an fp64
// host UT transform on sampled chunks, and v3 against the library on every output. Self-timing: both kernels
// on a benchmark shape (B * T = 32768 tokens).
// Build and run from the repository root:
//   nvcc -std=c++17 -O3 -arch=sm_90a -Isrc dev/cuda/chunk_prep_v3.cu src/cuda/kernels/prep_chunk.cu -o chunk_prep_v3
//   ./chunk_prep_v3            # K = 128 (H = 16) and K = 64 (H = 32), T = 1024
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda/device/common.cuh"
#include "cuda/launchers.h"
#include "tf32_nt.cuh"

using namespace pathattn::cuda;

namespace v3 {

__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(tf32_exact(x)); }

// One product into a fresh accumulator, then (after every warp has read its operands) out(r, c, v).
template <int N, int KD, bool kSplit, class FO>
__device__ __forceinline__ void product(const float* A, int lda, const float* B, int ldb, FO out) {
  using TT = TcTile<64, N>;
  typename TT::Acc acc;
  TT::zero(acc);
  dev::mma_nt<N, KD, kSplit, true>(acc, A, lda, B, ldb);
  __syncthreads();
  TT::each(acc, [&](int r, int c, float& v) { out(r, c, v); });
}

// Shared memory (floats), C = 64, LW = K + 4, LC = C + 4:
//   WQ  [C][LW]  W fp32 (product A = W W^T), later Q fp32 per query head
//   WT  [K][LC]  W^T fp32 (B of W2 = Eb W and of k~ = K - U^T W)
//   Wr  [C][LW]  W rounded (A of Z = W K^T, B of X = Q W^T)
//   Kf  [C][LW]  K as fp32 (exact)
//   R1  [C][LC]  A, then Z^T, then -U^T rounded
//   R2  [C][LC]  E, Eb = tril(E) diag(b), then X rounded
//   R3  [C][LC]  U^T fp32
//   W2T [K][LC]  W2^T rounded
//   bs  [C]
template <int K>
struct Smem {
  static constexpr int LW = K + 4, LC = kChunk + 4;
  static constexpr size_t floats = 3 * size_t(kChunk) * LW + 2 * size_t(K) * LC + 3 * size_t(kChunk) * LC + kChunk;
  static constexpr size_t bytes = floats * sizeof(float);
};

template <typename T, int K>
__global__ void __launch_bounds__(kTcThreads) chunk_prep_v3(KernelParams p) {
  using S = Smem<K>;
  constexpr int LW = S::LW, LC = S::LC, C = kChunk;
  extern __shared__ float sm[];
  float* WQ = sm;
  float* WT = WQ + C * LW;
  float* Wr = WT + K * LC;
  float* Kf = Wr + C * LW;
  float* R1 = Kf + C * LW;
  float* R2 = R1 + C * LC;
  float* R3 = R2 + C * LC;
  float* W2T = R3 + C * LC;
  float* bs = W2T + K * LC;

  const ChunkDesc ch = p.chunks[blockIdx.x];
  const int h = blockIdx.y, nq = min(C, ch.len - ch.c * C), tid = threadIdx.x;
  const int64_t pos0 = ch.t0 + int64_t(ch.c) * C, tok0 = ch.b * p.T + pos0;
  const T* kp = static_cast<const T*>(p.k);
  const T* qp = static_cast<const T*>(p.q);
  T* ktp = static_cast<T*>(p.kt);

  // ---- load: W (fp32, W^T, rounded), K as fp32, beta; w16 straight from the fp32 W.
  for (int idx = tid; idx < C * K; idx += blockDim.x) {
    const int r = idx / K, d = idx % K;
    const bool ok = r < nq;
    const float w = ok ? static_cast<const float*>(p.w)[ch.b * p.w_s[0] + (pos0 + r) * p.w_s[1] + h * p.w_s[2] + d] : 0.f;
    WQ[r * LW + d] = w;
    WT[d * LC + r] = w;
    Wr[r * LW + d] = round_tf32(w);
    Kf[r * LW + d] = ok ? to_f(kp[ch.b * p.k_s[0] + (pos0 + r) * p.k_s[1] + h * p.k_s[2] + d]) : 0.f;
    if (ok) p.w16[((tok0 + r) * p.H + h) * K + d] = __float2half_rn(w);
  }
  if (tid < C) bs[tid] = tid < nq ? static_cast<const float*>(p.beta)[ch.b * p.beta_s[0] + (pos0 + tid) * p.beta_s[1] + h * p.beta_s[2]] : 0.f;
  __syncthreads();
  // A = strict_lower(diag(b) W W^T) -> R1 (split).
  product<C, K, true>(WQ, LW, WQ, LW, [&](int r, int c, float v) { R1[r * LC + c] = c < r ? bs[r] * v : 0.f; });
  __syncthreads();
  // E = (I + A)^-1 -> R2, then Eb = tril(E) diag(b) in place.
  unit_lower_inverse(R1, LC, R2, LC);
  __syncthreads();
  for (int idx = tid; idx < C * C; idx += blockDim.x) {
    const int r = idx / C, s = idx % C;
    R2[r * LC + s] = s <= r ? R2[r * LC + s] * bs[s] : 0.f;
  }
  __syncthreads();
  // W2 = Eb W (split): w2h (fp16) and W2^T rounded.
  product<K, C, true>(R2, LC, WT, LC, [&](int r, int d, float v) {
    if (r < nq) p.w2h[((tok0 + r) * p.H + h) * K + d] = __float2half_rn(v);
    W2T[d * LC + r] = round_tf32(v);
  });
  // Z = strict_lower(W K^T) (plain) -> R1 as Z^T (fp32).
  product<C, K, false>(Wr, LW, Kf, LW, [&](int r, int c, float v) { R1[c * LC + r] = c < r ? v : 0.f; });
  __syncthreads();
  // U = Eb Z (split; B(t, c) = Z[t][c] = Z^T[c][t]) -> R3 = U^T (fp32), R1 = -U^T rounded.
  product<C, C, true>(R2, LC, R1, LC, [&](int r, int c, float v) {
    R3[c * LC + r] = v;
    R1[c * LC + r] = -round_tf32(v);
  });
  __syncthreads();
  // k~ = K - U^T W (split; A(r, s) = U[s][r] = U^T[r][s], B(s, d) = W[s][d] = W^T[d][s]).
  product<K, C, true>(R3, LC, WT, LC, [&](int r, int d, float v) {
    if (r < nq) ktp[((tok0 + r) * p.H + h) * K + d] = from_f<T>(Kf[r * LW + d] - v);
  });
  // Per query head of the group.
  for (int hq = h * p.group; hq < (h + 1) * p.group; ++hq) {
    __syncthreads();
    for (int idx = tid; idx < C * K; idx += blockDim.x) {
      const int r = idx / K, d = idx % K;
      WQ[r * LW + d] = r < nq ? to_f(qp[ch.b * p.q_s[0] + (pos0 + r) * p.q_s[1] + hq * p.q_s[2] + d]) : 0.f;
    }
    __syncthreads();
    // X = tril_incl(Q W^T) -> R2 rounded.
    product<C, K, false>(WQ, LW, Wr, LW, [&](int r, int c, float v) { R2[r * LC + c] = c <= r ? round_tf32(v) : 0.f; });
    __syncthreads();
    // q~ = Q - X W2 (B(s, d) = W2[s][d] = W2^T[d][s]).
    {
      using TT = TcTile<64, K>;
      typename TT::Acc acc;
      TT::zero(acc);
      dev::mma_nt<K, C, false, true>(acc, R2, LC, W2T, LC);
      TT::each(acc, [&](int r, int d, float& v) {
        if (r < nq) p.qtl[((tok0 + r) * p.HQ + hq) * K + d] = __float2half(WQ[r * LW + d] - v);
      });
    }
    // A_loc = tril_incl(Q K^T - X U) = tril_incl(Q K^T + X (-U^T)^T).
    {
      using TT = TcTile<64, C>;
      typename TT::Acc acc;
      TT::zero(acc);
      dev::mma_nt<C, K, false, true>(acc, WQ, LW, Kf, LW);
      dev::mma_nt<C, C, false, true>(acc, R2, LC, R1, LC);
      TT::each(acc, [&](int r, int c, float& v) {
        if (r < nq) p.aloc[((tok0 + r) * p.HQ + hq) * kChunk + c] = c <= r ? v : 0.f;
      });
    }
  }
}

}  // namespace v3

// ------------------------------------------------------------------------------------------------------
// Host side: inputs, both kernels, fp64 reference of the UT transform on sampled chunks, comparisons, timing.

struct Outputs {
  __half *w16, *w2h;
  __nv_bfloat16* kt;
  __half* qtl;  // fp16, as the library stores it
  float* aloc;
};

static float bf16_to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <int K>
int run(int T, int H) {
  const int B = 32768 / T, HQ = H, C = kChunk;
  const size_t NT = size_t(B) * T;
  std::mt19937 rng(7 + K);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.f, 2.f);
  std::vector<__nv_bfloat16> q(NT * HQ * K), k(NT * H * K);
  std::vector<float> w(NT * H * K), beta(NT * H);
  for (auto& x : q) x = __float2bfloat16(nd(rng));
  for (auto& x : k) x = __float2bfloat16(nd(rng));
  for (size_t i = 0; i < NT * H; ++i) {
    double n = 0;
    for (int d = 0; d < K; ++d) n += double(w[i * K + d] = nd(rng)) * w[i * K + d];
    for (int d = 0; d < K; ++d) w[i * K + d] = float(w[i * K + d] / std::sqrt(n));
    beta[i] = ud(rng);
  }
  // Chunk table: B sequences of T tokens.
  std::vector<ChunkDesc> chunks;
  const int nc = T / C;
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < nc; ++c) chunks.push_back({b, 0, T, c, b * nc, 0});
  __nv_bfloat16 *dq, *dk;
  float *dw, *dbeta;
  ChunkDesc* dch;
  CK(cudaMalloc(&dq, q.size() * 2));
  CK(cudaMalloc(&dk, k.size() * 2));
  CK(cudaMalloc(&dw, w.size() * 4));
  CK(cudaMalloc(&dbeta, beta.size() * 4));
  CK(cudaMalloc(&dch, chunks.size() * sizeof(ChunkDesc)));
  CK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dbeta, beta.data(), beta.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dch, chunks.data(), chunks.size() * sizeof(ChunkDesc), cudaMemcpyHostToDevice));
  Outputs out[2];
  for (Outputs& o : out) {
    CK(cudaMalloc(&o.w16, NT * H * K * 2));
    CK(cudaMalloc(&o.w2h, NT * H * K * 2));
    CK(cudaMalloc(&o.kt, NT * H * K * 2));
    CK(cudaMalloc(&o.qtl, NT * HQ * K * 2));
    CK(cudaMalloc(&o.aloc, NT * HQ * C * 4));
  }
  KernelParams kp = dev::mha_params(B, T, H, K, K, dq, dk, dk, dw, dbeta);
  kp.chunks = dch, kp.nchunks = int(chunks.size()), kp.max_chunks = nc;
  auto with = [&](const Outputs& o) {
    KernelParams x = kp;
    x.w16 = o.w16, x.w2h = o.w2h, x.kt = o.kt, x.qtl = o.qtl, x.aloc = o.aloc;
    return x;
  };
  const KernelParams p0 = with(out[0]), p1 = with(out[1]);
  auto lib = [&] { CK(launch_chunk_prep(p0, 1, 0)); };
  auto kern = v3::chunk_prep_v3<__nv_bfloat16, K>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(v3::Smem<K>::bytes)));
  auto mine = [&] {
    kern<<<dim3(kp.nchunks, H), kTcThreads, v3::Smem<K>::bytes>>>(p1);
    CK(cudaGetLastError());
  };
  lib();
  mine();
  CK(cudaDeviceSynchronize());

  // Copy back and compare.
  auto fetch_h = [&](const __half* d, size_t n) {
    std::vector<__half> h(n);
    CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<double> o(n);
    for (size_t i = 0; i < n; ++i) o[i] = __half2float(h[i]);
    return o;
  };
  auto fetch_b = [&](const __nv_bfloat16* d, size_t n) {
    std::vector<__nv_bfloat16> h(n);
    CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    std::vector<double> o(n);
    for (size_t i = 0; i < n; ++i) o[i] = bf16_to_f(h[i]);
    return o;
  };
  auto fetch_f = [&](const float* d, size_t n) {
    std::vector<float> h(n);
    CK(cudaMemcpy(h.data(), d, n * 4, cudaMemcpyDeviceToHost));
    return std::vector<double>(h.begin(), h.end());
  };
  struct Got {
    std::vector<double> w16, w2h, kt, qtl, aloc;
  } got[2];
  for (int v = 0; v < 2; ++v) {
    got[v].w16 = fetch_h(out[v].w16, NT * H * K);
    got[v].w2h = fetch_h(out[v].w2h, NT * H * K);
    got[v].kt = fetch_b(out[v].kt, NT * H * K);
    got[v].qtl = fetch_h(out[v].qtl, NT * HQ * K);
    got[v].aloc = fetch_f(out[v].aloc, NT * HQ * C);
  }
  auto rel = [](const std::vector<double>& a, const std::vector<double>& b) {
    double n = 0, d = 0;
    for (size_t i = 0; i < a.size(); ++i) n += (a[i] - b[i]) * (a[i] - b[i]), d += b[i] * b[i];
    return std::sqrt(n / std::max(d, 1e-300));
  };
  // fp64 reference on sampled (chunk, head) pairs: the formulas of prep.cu's comment.
  std::vector<double> ref_w2, ref_kt, ref_qt, ref_al, sel[2][4];
  for (int ci = 0; ci < kp.nchunks; ci += std::max(1, kp.nchunks / 6)) {
    for (int h = 0; h < H; h += std::max(1, H / 3)) {
      const ChunkDesc& ch = chunks[ci];
      const size_t tok0 = size_t(ch.b) * T + size_t(ch.c) * C;
      auto W = [&](int r, int d) { return double(w[((tok0 + r) * H + h) * K + d]); };
      auto Kv = [&](int r, int d) { return double(bf16_to_f(k[((tok0 + r) * H + h) * K + d])); };
      auto Qv = [&](int r, int d) { return double(bf16_to_f(q[((tok0 + r) * HQ + h) * K + d])); };
      auto b = [&](int r) { return double(beta[(tok0 + r) * H + h]); };
      std::vector<double> A(C * C, 0), E(C * C, 0), W2(C * K, 0), Z(C * C, 0), U(C * C, 0), X(C * C, 0);
      for (int r = 0; r < C; ++r)
        for (int c = 0; c < r; ++c) {
          double s = 0, z = 0;
          for (int d = 0; d < K; ++d) s += W(r, d) * W(c, d), z += W(r, d) * Kv(c, d);
          A[r * C + c] = b(r) * s;
          Z[r * C + c] = z;
        }
      for (int c = 0; c < C; ++c) {  // E = (I + A)^-1, unit lower triangular, column by column
        E[c * C + c] = 1;
        for (int r = c + 1; r < C; ++r) {
          double s = 0;
          for (int t = c; t < r; ++t) s += A[r * C + t] * E[t * C + c];
          E[r * C + c] = -s;
        }
      }
      for (int r = 0; r < C; ++r) {
        for (int d = 0; d < K; ++d) {
          double s = 0;
          for (int t = 0; t <= r; ++t) s += E[r * C + t] * b(t) * W(t, d);
          W2[r * K + d] = s;
        }
        for (int c = 0; c < C; ++c) {
          double s = 0;
          for (int t = 0; t <= r; ++t) s += E[r * C + t] * b(t) * Z[t * C + c];
          U[r * C + c] = s;
        }
      }
      for (int r = 0; r < C; ++r)
        for (int c = 0; c <= r; ++c) {
          double s = 0;
          for (int d = 0; d < K; ++d) s += Qv(r, d) * W(c, d);
          X[r * C + c] = s;
        }
      for (int r = 0; r < C; ++r) {
        for (int d = 0; d < K; ++d) {
          const size_t o = ((tok0 + r) * H + h) * K + d, oq = ((tok0 + r) * HQ + h) * K + d;
          double kt = Kv(r, d), qt = Qv(r, d);
          for (int s = 0; s < C; ++s) kt -= U[s * C + r] * W(s, d), qt -= X[r * C + s] * W2[s * K + d];
          ref_w2.push_back(W2[r * K + d]);
          ref_kt.push_back(kt);
          ref_qt.push_back(qt);
          for (int v = 0; v < 2; ++v) {
            sel[v][0].push_back(got[v].w2h[o]);
            sel[v][1].push_back(got[v].kt[o]);
            sel[v][2].push_back(got[v].qtl[oq]);
          }
        }
        for (int c = 0; c < C; ++c) {
          double s = 0;
          if (c <= r) {
            for (int d = 0; d < K; ++d) s += Qv(r, d) * Kv(c, d);
            for (int t = 0; t < C; ++t) s -= X[r * C + t] * U[t * C + c];
          }
          ref_al.push_back(s);
          for (int v = 0; v < 2; ++v) sel[v][3].push_back(got[v].aloc[((tok0 + r) * HQ + h) * C + c]);
        }
      }
    }
  }
  const std::vector<double>* refs[4] = {&ref_w2, &ref_kt, &ref_qt, &ref_al};
  const char* names[4] = {"w2h", "kt", "qtl", "aloc"};
  // Bars: w2h, qtl / kt are stored in fp16 / bf16 (their rounding: 5e-4 / 4e-3); aloc fp32 from tf32 products.
  const double bar[4] = {2e-3, 8e-3, 4e-3, 4e-3};
  bool ok = rel(got[1].w16, got[0].w16) == 0;
  std::printf("K %d, H %d, T %d, B %d: w16 v3 vs library %s\n", K, H, T, B, ok ? "bitwise equal" : "DIFFER");
  for (int i = 0; i < 4; ++i) {
    const double e0 = rel(sel[0][i], *refs[i]), e1 = rel(sel[1][i], *refs[i]);
    const bool good = e1 <= bar[i] && e1 <= 2 * e0 + 1e-7;
    ok = ok && good;
    std::printf("  %-4s rel L2 vs fp64 (sampled): library %.2e, v3 %.2e (bar %.0e, and <= 2x library) %s\n", names[i],
                e0, e1, bar[i], good ? "OK" : "FAIL");
  }
  std::printf("  v3 vs library, all outputs: w2h %.2e kt %.2e qtl %.2e aloc %.2e\n", rel(got[1].w2h, got[0].w2h),
              rel(got[1].kt, got[0].kt), rel(got[1].qtl, got[0].qtl), rel(got[1].aloc, got[0].aloc));

  // Timing: median of 9 after a warm-up.
  const float tl = dev::median_ms(lib, 9), tv = dev::median_ms(mine, 9);
  std::printf("  time: library %.3f ms (%zu KB smem), v3 %.3f ms (%zu KB smem): %.2fx\n", tl, smem_chunk_prep(K) / 1024,
              tv, v3::Smem<K>::bytes / 1024, tl / tv);
  for (Outputs& o : out) {
    CK(cudaFree(o.w16));
    CK(cudaFree(o.w2h));
    CK(cudaFree(o.kt));
    CK(cudaFree(o.qtl));
    CK(cudaFree(o.aloc));
  }
  CK(cudaFree(dq));
  CK(cudaFree(dk));
  CK(cudaFree(dw));
  CK(cudaFree(dbeta));
  CK(cudaFree(dch));
  return ok ? 0 : 1;
}

int main() {
  int bad = run<128>(1024, 16);
  bad += run<64>(1024, 32);
  std::printf(bad ? "FAILED\n" : "all checks passed\n");
  return bad ? 1 : 0;
}
