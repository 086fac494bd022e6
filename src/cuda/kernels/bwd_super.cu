// cuda/kernels/bwd_super.cu: the backward of the superblock products (dPS and dks into the chunk
// products' dP), a persistent grid over blocks of rows.
#include <type_traits>

#include "cuda/device/common.cuh"
#include "cuda/launchers.h"
#include "cuda/kernels/superblock.cuh"

namespace pathattn::cuda {
namespace {

constexpr int kPrepThreads = kTcThreads;

// Backward of the superblock products, per (full superblock, kv head) and block of MR rows (super_rows; all
// K rows in deterministic mode, one block in a fixed order); persistent grid. With M_c = P_last ... P_{c+1}:
//   dP_c += M_c^T R_c,   R_0 = dPS,   R_{c+1} = R_c P_c^T + dks_c^T k~_c
// Both chains are right products, so each block of rows runs on its own and adds its part of dP_c with fp32
// atomics. The M_c are super_prep's (p.msv, fp16: entries <= 1 keep tf32's 11 bits), not recomputed.
// kMode >= 1: two sets of a chunk's tiles, the next loading by cp.async during this chunk (where shared memory
// holds them); kMode == 2: M_c staged too, so the dP product reads it from shared memory. Products take the
// plain warp index (kUW false): the shuffled one saved registers here but ran slower.
// kF16 (kStageM, rows >= 64): R in fp32 registers, published as fp16 R16 under one power-of-two scale for the
// block so that the dP and Y products run on m16n8k16; dks^T k~ stays tf32.
template <int K, int MR, int kMode>
struct SuperBwdSmem {
  static constexpr int LM = K + 4, LY = kChunk + 4, LT = K + 8;
  static constexpr size_t set = 3 * 2 * size_t(kChunk) * LT;  // a chunk's k~, W and W2 tiles
  static constexpr bool kPrefetch = kMode >= 1, kStageM = kMode == 2, kF16 = kStageM && MR >= 64;
  static constexpr int LR = K + 8, LY16 = kChunk + 8;  // R16's and Y16's pitches (halves)
  // Rf [MR][LM], Yf [MR][LY] (kF16: R16 [MR][LR], Y16 [MR][LY16] fp16), dKs [64][LM].
  static constexpr size_t base =
      kF16 ? sizeof(float) * size_t(kChunk) * LM + sizeof(__half) * (size_t(MR) * LR + size_t(MR) * LY16)
           : sizeof(float) * (size_t(MR) * LM + size_t(MR) * LY + size_t(kChunk) * LM);
  static constexpr int LMS = K + 8;  // Ms's pitch (halves): a fragment's (row, k) reads fall in 16 words
  static constexpr size_t ms = kStageM ? sizeof(__half) * size_t(MR) * LMS : 0;
  static constexpr size_t bytes = base + (kPrefetch ? 2 : 1) * set + ms;
};

// dP_c += M_c^T R for this block's rows of R (R16 up with kF16; fp32 atomics where several blocks add).
template <typename S, int K, int MR, int NB, typename MCt>
__device__ __forceinline__ void add_dp(float* dP, MCt& mct, const __half* Ms, const __half* R16, const float* Rf,
                                       float up) {
  constexpr int LM = S::LM, LR = S::LR;
  constexpr bool kF16 = S::kF16;
  if constexpr (kF16) {  // dP_c += (M_c^T R16) up
    typename TcTile<K, K>::Acc acc;
    TcTile<K, K>::zero(acc);
    mma_tc_acc16<K, K, MR, __half, true, true>(acc, Ms, S::LMS, R16, LR);
    if constexpr (NB == 1) TcTile<K, K>::each(acc, [&](int r, int n, float& v) { dP[r * K + n] += v * up; });
    else red_add_tile<K, K>(dP, K, acc, up);
  } else if constexpr (NB == 1) {
    block_mm_tc<K, K, MR, false, 4, false>(mct, [&](int k, int n) { return Rf[k * LM + n]; },
                                           [&](int r, int n, float v) { dP[r * K + n] += v; });
  } else {  // the row blocks' partials: vector reductions (no barrier needed: the operands stay as they are)
    typename TcTile<K, K>::Acc acc;
    TcTile<K, K>::zero(acc);
    mma_tc_acc<K, K, MR, false, 4, false>(acc, mct, [&](int k, int n) { return Rf[k * LM + n]; });
    red_add_tile<K, K>(dP, K, acc);
  }
}

// R <- R - (R W2^T) W + dks^T k~ for this block's rows j0.. of R (kF16: in registers, R16 published again).
template <typename S, typename T, int K, int MR, typename Acc, typename Publish>
__device__ __forceinline__ void step_r(float* Rf, float* Yf, const __half* R16, __half* Y16, const float* dKs,
                                       const T* Kt, const __half* Ws, const __half* W2s, int j0, Acc& rv, float& up,
                                       Publish& publish_r) {
  constexpr int LM = S::LM, LY = S::LY, LT = S::LT, LR = S::LR, LY16 = S::LY16;
  constexpr bool kF16 = S::kF16;
  using TR = TcTile<MR, K>;
  if constexpr (kF16) {
    // Y16 = R16 W2^T (R's scale); R += -(Y16 W) up + dks^T k~; R16 again.
    {
      typename TcTile<MR, kChunk>::Acc y;
      TcTile<MR, kChunk>::zero(y);
      mma_tc_acc16<MR, kChunk, K, __half>(y, R16, LR, W2s, LT);
      TcTile<MR, kChunk>::each_pair(y, [&](int r, int n, float& v, float& w) {
        *reinterpret_cast<__half2*>(Y16 + r * LY16 + n) = __floats2half2_rn(v, w);
      });
    }
    __syncthreads();
    typename TR::Acc acc;
    TR::zero(acc);
    mma_tc_acc16<MR, K, kChunk, __half, false, true>(acc, Y16, LY16, Ws, LT);
    TR::each(acc, [&](int, int, float& v) { v *= -up; });
    mma_tc_acc<MR, K, kChunk, false, 4, false>(acc, [&](int r, int k) { return dKs[k * LM + j0 + r]; },
                                               [&](int k, int n) { return to_f(Kt[k * LT + n]); });
#pragma unroll
    for (int mi = 0; mi < TR::MPW; ++mi) add_acc(rv[mi], acc[mi]);
    up = publish_r(rv);
  } else {
    block_mm_tc<MR, kChunk, K, false, 4, false>(a_rows(static_cast<const float*>(Rf), LM), b_rows(W2s, LT),
                                                [&](int r, int n, float v) { Yf[r * LY + n] = v; });
    __syncthreads();
    block_mm_tc2<MR, K, kChunk, kChunk, false, 4, false>(
        a_rows<true>(static_cast<const float*>(Yf), LY), [&](int k, int n) { return __half2float(Ws[k * LT + n]); },
        [&](int r, int k) { return dKs[k * LM + j0 + r]; }, [&](int k, int n) { return to_f(Kt[k * LT + n]); },
        [&](int r, int n, float v) { Rf[r * LM + n] += v; });
  }
}

template <typename T, int K, int MR, int kMode>
__global__ void __launch_bounds__(kPrepThreads, 1) super_bwd_kernel(KernelParams p, int nitems) {
  using S = SuperBwdSmem<K, MR, kMode>;
  constexpr int LM = S::LM, LY = S::LY, LT = S::LT, LR = S::LR, LY16 = S::LY16, NB = K / MR;
  constexpr bool kF16 = S::kF16;
  extern __shared__ float sm[];
  float* Rf = sm;                 // rows j0 .. j0 + MR - 1 of R (not kF16)
  float* Yf = Rf + MR * LM;       // (not kF16)
  float* dKs = kF16 ? sm : Yf + MR * LY;  // [64][LM] dks of one chunk
  __half* R16 = reinterpret_cast<__half*>(dKs + kChunk * LM);  // kF16: [MR][LR]
  __half* Y16 = R16 + MR * LR;                                 // kF16: [MR][LY16]
  uint8_t* sets = kF16 ? reinterpret_cast<uint8_t*>(Y16 + MR * LY16)
                       : reinterpret_cast<uint8_t*>(dKs + kChunk * LM);  // per set: k~, W, W2 ([64][LT] each)
  __half* Ms = reinterpret_cast<__half*>(sets + (S::kPrefetch ? 2 : 1) * S::set);  // [MR][LMS] M_c (kStageM)
  auto kt_of = [&](int st) { return reinterpret_cast<T*>(sets + st * S::set); };
  auto w_of = [&](int st) { return reinterpret_cast<__half*>(kt_of(st) + kChunk * LT); };  // W2 follows W
  const T* ktp = static_cast<const T*>(p.kt);
  const int tid = threadIdx.x;
  // An item's chunk tiles in the order they are used, load i = chunk i (W, W2, k~) for i = 0 .. p.sc - 2; load i
  // in set i & 1 with the prefetch, else in set 0.
  const int loads = p.sc - 1;
  auto set_of = [](int i) { return S::kPrefetch ? (i & 1) : 0; };
  static_assert(kPrepThreads >= 3 * kTileThreads, "super_bwd: one thread group per tile");
  // kF16: this thread's entries of R (fp32), and R16 = R 2^-e for the block's e (every thread's part written;
  // the block's maximum through one barrier); returns 2^e.
  using TR = TcTile<MR, K>;
  __shared__ float rmax[kTcWarps];
  auto publish_r = [&](typename TR::Acc& rv) {
    float mx = 0.f;
#pragma unroll
    for (int mi = 0; mi < TR::MPW; ++mi) mx = fmaxf(mx, lane_abs_max(rv[mi]));
    const int e = scale_exp(block_max<kTcWarps>(mx, rmax));
    const float down = ldexpf(1.f, -e);
    TR::each_pair(rv, [&](int r, int n, float& v, float& w) {
      *reinterpret_cast<__half2*>(R16 + r * LR + n) = __floats2half2_rn(v * down, w * down);
    });
    return ldexpf(1.f, e);
  };

  for (int it = blockIdx.x; it < nitems * NB; it += gridDim.x) {
    const int j0 = (it % NB) * MR, item = it / NB;
    const int sbi = item / p.H, h = item % p.H;
    const int c0 = p.super_first[sbi];
    const ChunkDesc ch = p.chunks[c0];
    const int64_t tok0 = ch.b * p.T + ch.t0 + int64_t(ch.c) * kChunk, stride = int64_t(p.H) * K;
    const __half* Mit = p.msv + (int64_t(sbi) * p.H + h) * p.sc * K * K + int64_t(j0) * K;  // rows j0.. of M_c
    auto row_of = [&](int c) { return ((tok0 + int64_t(c) * kChunk) * p.H + h) * K; };
    auto issue = [&](int i) {  // prefetch: load i by cp.async, one thread group a tile, committed
      const int64_t row = row_of(i);
      __half* w = w_of(set_of(i));
      const int grp = tid / kTileThreads, gt = tid % kTileThreads;
      if (grp == 0) load_tile_async<K>(w, p.w16 + row, stride, kChunk, gt);
      else if (grp == 1) load_tile_async<K>(w + kChunk * LT, p.w2h + row, stride, kChunk, gt);
      else if (grp == 2) load_tile_async<K>(kt_of(set_of(i)), ktp + row, stride, kChunk, gt);
      cp_async_commit();
    };
    auto issue_m = [&](int c) {  // prefetch: M_c's rows of this block (from super_prep) into Ms, committed
      const __half* src = Mit + size_t(c) * K * K;
      for (int idx = tid; idx < MR * K / 8; idx += blockDim.x) {
        const int r = idx / (K / 8), col = 8 * (idx % (K / 8));
        cp_async16(Ms + r * S::LMS + col, src + r * K + col, true);
      }
      cp_async_commit();
    };
    auto issue_dks = [&](int c) {  // prefetch: chunk c's dks rows (fp32) by cp.async, committed
      const float* src = p.dks + row_of(c);
      for (int idx = tid; idx < kChunk * K / 4; idx += blockDim.x) {
        const int r = idx / (K / 4), col = 4 * (idx % (K / 4));
        cp_async16(dKs + r * LM + col, src + r * stride + col, true);
      }
      cp_async_commit();
    };
    // Load i's tiles (and dks) in place for this thread; callers sync before reading them. With the prefetch the
    // copies were issued a step earlier, and the next load is in flight.
    auto wait_load = [&](int i) {
      if constexpr (S::kPrefetch) {
        if (i + 1 < loads) cp_async_wait_group<1>();
        else cp_async_wait_all();
      } else {
        const int64_t t0 = tok0 + int64_t(i) * kChunk;
        stage_tiles4<K>(ws_src<K>(p.w16, p.H), 0, h, w_of(0), LT, ws_src<K>(p.w2h, p.H), 0, h, w_of(0) + kChunk * LT,
                        LT, t0, kChunk);
        stage_tiles4<K>(ws_src<K>(ktp, p.H), 0, h, kt_of(0), LT, ws_src<K>(p.dks, p.H), 0, h, dKs, LM, t0, kChunk);
      }
    };
    // ---- R_0 = dPS; dP_c += M_c^T R_c; R_{c+1} = R_c - (R_c W2_c^T) W_c + dks_c^T k~_c.
    __syncthreads();  // the previous item is done with the shared tiles
    if constexpr (S::kPrefetch) {
      if (loads > 0) issue(0);
    }
    const float* dps = p.dps + (int64_t(sbi) * p.H + h) * K * K + int64_t(j0) * K;
    typename TR::Acc rv;  // kF16: this thread's entries of R
    float up = 1.f;       // kF16: R = R16 up
    if constexpr (kF16) {
      TR::each_pair(rv, [&](int r, int n, float& v, float& w) {
        const float2 x = *reinterpret_cast<const float2*>(dps + r * K + n);
        v = x.x;
        w = x.y;
      });
      up = publish_r(rv);
    } else {
      for (int idx = tid; idx < MR * K; idx += blockDim.x) Rf[(idx / K) * LM + idx % K] = dps[idx];
    }
    if constexpr (S::kStageM) issue_m(0);
    for (int c = 0; c < p.sc; ++c) {
      __syncthreads();
      const int i = c;
      if constexpr (S::kPrefetch) {
        if (c < p.sc - 1) {
          issue_dks(c);
          if (i + 1 < loads) issue(i + 1);
        }
      }
      if constexpr (S::kStageM) {  // M_c, issued a step earlier (this step's dks and next tiles may stay in flight)
        if (c < p.sc - 1 && i + 1 < loads) cp_async_wait_group<2>();
        else if (c < p.sc - 1) cp_async_wait_group<1>();
        else cp_async_wait_all();
        __syncthreads();
      }
      // The dP product's A operand, M_c^T: staged (kStageM) or from p.msv.
      auto mct = [&](int r, int k) {
        if constexpr (S::kStageM) return __half2float(Ms[k * S::LMS + r]);
        else return __half2float(Mit[size_t(c) * K * K + size_t(k) * K + r]);
      };
      add_dp<S, K, MR, NB>(p.dP + (int64_t(c0 + c) * p.H + h) * K * K, mct, Ms, R16, Rf, up);
      if (c == p.sc - 1) break;
      wait_load(i);
      __syncthreads();  // (also: every warp is done with Ms)
      if constexpr (S::kStageM) issue_m(c + 1);
      const T* Kt = kt_of(set_of(i));
      const __half* Ws = w_of(set_of(i));
      const __half* W2s = Ws + kChunk * LT;
      step_r<S, T, K, MR>(Rf, Yf, R16, Y16, dKs, Kt, Ws, W2s, j0, rv, up, publish_r);
    }
  }
}

}  // namespace

template <int K>
static size_t super_bwd_two_sets(int rows) {
  return with_rows<K>(rows, [](auto mr) { return SuperBwdSmem<K, decltype(mr)::value, 1>::bytes; });
}
int super_bwd_rows(int K, int items, bool whole, int sms, int optin) {
  int rows = super_rows(K, items, whole, sms);
  if (whole) return rows;
  while (rows > kSuperRows && (K == 64 ? super_bwd_two_sets<64>(rows) : super_bwd_two_sets<128>(rows)) > size_t(optin))
    rows /= 2;
  return rows;
}

size_t smem_super_bwd(int K) { return K == 64 ? SuperBwdSmem<64, 64, 0>::bytes : SuperBwdSmem<128, 128, 0>::bytes; }

template <typename T, int K>
static cudaError_t super_bwd_t(const KernelParams& p, int rows, int grid, int optin, cudaStream_t s) {
  return with_rows<K>(rows, [&](auto mr) {
    constexpr int MR = decltype(mr)::value;
    if (SuperBwdSmem<K, MR, 2>::bytes <= size_t(optin))
      return launch_with_smem(super_bwd_kernel<T, K, MR, 2>, dim3(grid), kPrepThreads, SuperBwdSmem<K, MR, 2>::bytes,
                              s, p, p.nsuper * p.H);
    if (SuperBwdSmem<K, MR, 1>::bytes <= size_t(optin))
      return launch_with_smem(super_bwd_kernel<T, K, MR, 1>, dim3(grid), kPrepThreads, SuperBwdSmem<K, MR, 1>::bytes,
                              s, p, p.nsuper * p.H);
    return launch_with_smem(super_bwd_kernel<T, K, MR, 0>, dim3(grid), kPrepThreads, SuperBwdSmem<K, MR, 0>::bytes,
                            s, p, p.nsuper * p.H);
  });
}

cudaError_t launch_super_bwd(const KernelParams& p, int dtype, int rows, int grid, cudaStream_t s) {
  if (p.nsuper == 0) return cudaSuccess;
  int optin = 0;
  const cudaError_t e = device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &optin);
  if (e != cudaSuccess) return e;
  if (dtype == 0)
    return p.K == 64 ? super_bwd_t<__half, 64>(p, rows, grid, optin, s) : super_bwd_t<__half, 128>(p, rows, grid, optin, s);
  return p.K == 64 ? super_bwd_t<__nv_bfloat16, 64>(p, rows, grid, optin, s)
                   : super_bwd_t<__nv_bfloat16, 128>(p, rows, grid, optin, s);
}

}  // namespace pathattn::cuda
