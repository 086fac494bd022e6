// dev/cuda/tf32_nt.cuh: what the dev/cuda playgrounds (tf32_fragments.cu, chunk_prep_v3.cu) share: the CK
// error check and median_ms timing on the host, and the ldmatrix-fed tf32 block product mma_nt: acc += A B^T over this thread's TcTile<64, N> outputs, A [64][KD] at A[r * lda + k] and
// B [N][KD] at B[n * ldb + k] in shared memory with 16-byte rows (lda, ldb multiples of 4; KD a multiple of 16).
// Fragments by ldmatrix: an 8 x 4 tile of 32-bit words is one 8 x 8 b16 matrix, the m16n8k8 A fragment (rows
// g / g + 8, columns t / t + 4) four of them, the B fragment of two k-steps four more. Same tiling and mma order
// as mma_tc_acc (src/cuda/common.cuh).
//   kPre = false: operands are fp32 and converted in the loop as mma_tc_acc does (to_tf32; split: head and
//                 tail both rounded), so the products equal mma_tc_acc's bit for bit.
//   kPre = true:  plain operands are already tf32 values (rounded where staged) and go to the mma unconverted;
//                 split operands are fp32, split by a mask (head = top 19 bits, tail = x - head passed as is).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/device/common.cuh"
#include "cuda/params.h"

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace pathattn::cuda::dev {

// KernelParams of an MHA call on contiguous [B, T, heads, D] tensors (HQ = H, transport on, no gate), with
// the strides of every input and gradient set; the chunk table and the workspace are the caller's.
inline KernelParams mha_params(int B, int T, int H, int K, int V, const void* q, const void* k, const void* v,
                               const float* w, const float* beta) {
  KernelParams kp{};
  kp.B = B, kp.T = T, kp.H = H, kp.HQ = H, kp.group = 1, kp.K = K, kp.V = V;
  kp.path = true, kp.gate = false, kp.scale = 1.f / std::sqrt(float(K)), kp.gate_scale = kp.scale;
  kp.q = q, kp.k = k, kp.v = v, kp.w = w, kp.beta = beta;
  const int64_t sk[3] = {int64_t(T) * H * K, int64_t(H) * K, K}, sv[3] = {int64_t(T) * H * V, int64_t(H) * V, V},
                sb[3] = {int64_t(T) * H, H, 1};
  for (int i = 0; i < 3; ++i) {
    kp.q_s[i] = kp.dq_s[i] = kp.k_s[i] = kp.dk_s[i] = kp.w_s[i] = kp.dw_s[i] = sk[i];
    kp.v_s[i] = kp.dv_s[i] = sv[i];
    kp.beta_s[i] = kp.dbeta_s[i] = sb[i];
  }
  return kp;
}

// Median of `runs` timings (CUDA events on the default stream) of f(), after one warm-up call.
template <class F>
float median_ms(F f, int runs) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int it = 0; it <= runs; ++it) {
    CK(cudaEventRecord(e0));
    f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float x = 0;
    CK(cudaEventElapsedTime(&x, e0, e1));
    if (it > 0) ms.push_back(x);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Relative L2 error of the first `ctas` CTAs' 64 x N products against fp64 sums over KD: got(b, r, n) the
// product's entry, a(b, r, k) and bm(b, k, n) the operands' (b: the CTA).
template <class G, class A, class B>
double rel_l2_products(int ctas, int N, int KD, G got, A a, B bm) {
  double num = 0, den = 0;
  for (int b = 0; b < ctas; ++b)
    for (int r = 0; r < 64; ++r)
      for (int n = 0; n < N; ++n) {
        double s = 0;
        for (int k = 0; k < KD; ++k) s += double(a(b, r, k)) * double(bm(b, k, n));
        const double d = double(got(b, r, n)) - s;
        num += d * d;
        den += s * s;
      }
  return std::sqrt(num / den);
}

template <int N, int KD, bool kSplit, bool kPre>
__device__ __forceinline__ void mma_nt(typename TcTile<64, N>::Acc& acc, const float* A, int lda, const float* B,
                                       int ldb) {
  using TT = TcTile<64, N>;
  constexpr int MPW = TT::MPW, NTW = TT::NTW, WM = TT::WM;
  static_assert(KD % 16 == 0, "k in steps of 16");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp % WM, wn = warp / WM, li = lane & 7, lj = lane >> 3;  // lane addresses row li of matrix lj
  auto split = [](uint32_t x, uint32_t& hi, uint32_t& lo) {
    const float f = __uint_as_float(x);
    if (kPre) {
      hi = x & 0xffffe000u;
      lo = __float_as_uint(f - __uint_as_float(hi));
    } else {
      split_tf32(f, hi, lo);
    }
  };
  auto conv = [](uint32_t x) { return kPre ? x : to_tf32(__uint_as_float(x)); };
#pragma unroll 2
  for (int k0 = 0; k0 < KD; k0 += 16) {
    uint32_t ah[2][MPW][4], al[2][MPW][4];
#pragma unroll
    for (int mi = 0; mi < MPW; ++mi) {
      const int m0 = 16 * (wm + WM * mi);
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        uint32_t r[4];
        ldsm_x4(r, A + (m0 + (lj & 1) * 8 + li) * lda + k0 + 8 * kh + (lj >> 1) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (kSplit) split(r[e], ah[kh][mi][e], al[kh][mi][e]);
          else ah[kh][mi][e] = conv(r[e]);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      uint32_t r[4];
      ldsm_x4(r, B + (8 * (wn * NTW + nt) + li) * ldb + k0 + 4 * lj);
#pragma unroll
      for (int kh = 0; kh < 2; ++kh) {
        uint32_t bh0, bh1, bl0 = 0, bl1 = 0;
        if (kSplit) {
          split(r[2 * kh], bh0, bl0);
          split(r[2 * kh + 1], bh1, bl1);
        } else {
          bh0 = conv(r[2 * kh]);
          bh1 = conv(r[2 * kh + 1]);
        }
#pragma unroll
        for (int mi = 0; mi < MPW; ++mi) {
          if (kSplit) {
            mma1688_tf32(acc[mi][nt], al[kh][mi], bh0, bh1);
            mma1688_tf32(acc[mi][nt], ah[kh][mi], bl0, bl1);
          }
          mma1688_tf32(acc[mi][nt], ah[kh][mi], bh0, bh1);
        }
      }
    }
  }
}

}  // namespace pathattn::cuda::dev
