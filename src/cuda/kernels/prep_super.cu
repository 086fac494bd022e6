// cuda/kernels/prep_super.cu: the superblock products of the two-level scan (keys moved to their
// superblock's end, the product P_last ... P_first, and in the backward the running products M_c).
#include <type_traits>

#include "cuda/device/common.cuh"
#include "cuda/launchers.h"
#include "cuda/kernels/superblock.cuh"

namespace pathattn::cuda {
namespace {

// Per (full superblock, kv head, block of RB rows of M): walks the superblock's chunks from the last
// down with the running product M = P_last ... P_{c+1}: ks_c = k~_c M^T, then M <- M P_c = M - (M W_c^T) W2_c
// with the fp16 W, W2 of the chunk (the same operands the scans transport with, fp32 accumulation). Rows of M
// evolve apart (right products) and row n of M gives column n of ks_c, so each warp owns 16 rows of M in
// registers (C layout, fp32), steps them on fp16 mma with M and y = M W^T rounded to fp16 as operands (as
// fwd_scan steps its queries: their entries are bounded by 1 for unit w and beta in [0, 2], and fp16 keeps tf32's
// 10-bit mantissa), and computes its 16 columns of ks_c as M_rows k~_c^T on 16-bit mma in the input type (k~'s):
// M in fp16 with fp16 inputs, split into a bf16 head and tail with bf16 inputs (warp_mma_rs with kSplit: about 16
// significant bits of M, where tf32 kept 11): no CTA
// barrier inside a chunk step, one per
// step for the chunk tiles (two sets, the next chunk's loading by cp.async while this chunk's products run).
// An item may run as K / RB CTAs of RB / 16 warps (super_rows): the chain is serial (8 chunk steps an item),
// and a call with few items (one kv head of a sliced call: 32 items at T = 1k) would leave most SMs idle,
// while with items enough to fill the device the split only repeats the tile loads. At the end
// M = P_last ... P_first is stored in fp16 (entries bounded by 1 for unit w and beta in [0, 2]); in the backward
// (p.msv set) also each step's M, which super_bwd's dP products take. kKs false: the backward's second launch,
// where msv had no room beside the buffers live from here to super_bwd (bwd_run.cu): the same steps of M
// (the same instructions for M, so the same bits) without ks, ps or k~'s tiles, storing M only.


// Two sets of a chunk's k~, W and W2 tiles ([64][K + 8] 16-bit each); with the column split, each warp's
// exchange slot for its two 16 x 64 partial products (64 floats a lane).
template <int K, int kXWarps = 0>
struct SuperSmem {
  static constexpr int LT = K + 8;
  static constexpr size_t tiles = 3 * 2 * size_t(kChunk) * LT;  // one set
  static constexpr size_t xch = size_t(kXWarps) * 64 * 32 * sizeof(float);
  static constexpr size_t bytes = 2 * tiles + xch;
};

// kSplit = 2 (few items): a pair of warps shares each 16-row block, each holding half of M's columns; their
// partial products (ks_c and y, sums over the columns) are exchanged through shared memory at a pair barrier,
// which halves a warp's products on the serial chain. Without the split a warp sums the same two halves the
// same way (each half's products in one accumulation, then first half + second half), so that ks and PS have
// the same bits whichever the row block: a call's slices (fewer items, so smaller blocks) give the whole
// call's results.
template <typename T, int K, int RB, int kSplit, bool kKs>
__global__ void __launch_bounds__(2 * RB * kSplit) super_prep_kernel(KernelParams p) {
  constexpr int kWarps = RB / 16 * kSplit, kThreads = 32 * kWarps, KH = K / kSplit;  // KH: M's columns a warp holds
  using S = SuperSmem<K, kSplit == 2 ? kWarps : 0>;
  constexpr int LT = S::LT, NB = K / RB;
  extern __shared__ __align__(16) uint8_t sets[];  // per set: k~, W, W2; then the exchange slots
  float* xch = reinterpret_cast<float*>(sets + 2 * S::tiles);

  // Row blocks fastest: the CTAs of one item run side by side and share their tiles through L2.
  const int j0 = int(blockIdx.x % NB) * RB, item = int(blockIdx.x / NB);
  const int sbi = item / p.H, h = item % p.H, tid = threadIdx.x, warp = tid >> 5;
  const int rg = warp / kSplit, hf = warp % kSplit, c0k = hf * KH;  // row group, column half
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3, row0 = j0 + 16 * rg + g;  // rows row0, row0 + 8
  const int c0 = p.super_first[sbi];
  const ChunkDesc ch = p.chunks[c0];
  const int64_t tok0 = ch.b * p.T + ch.t0 + int64_t(ch.c) * kChunk;  // first token of the superblock
  // The backward's first launch: this block's rows of dPS, summed into by later kernels.
  if (kKs && p.dps != nullptr) zero_f32(p.dps + ((int64_t(sbi) * p.H + h) * K + j0) * K, RB * K, tid, kThreads);
  const T* ktp = static_cast<const T*>(p.kt);
  T* ksp = static_cast<T*>(p.ks);
  // Chunk c's three tiles into set `set` by cp.async, 16 bytes a copy (every chunk of a full superblock has
  // kChunk rows).
  auto issue = [&](int c, int set) {
    constexpr int kPerRow = K / 8, kPerTile = kChunk * kPerRow;
    const int64_t row = ((tok0 + int64_t(c) * kChunk) * p.H + h) * K, stride = int64_t(p.H) * K;
    uint8_t* base = sets + set * S::tiles;
    for (int i = kKs ? tid : kPerTile + tid; i < 3 * kPerTile; i += kThreads) {
      const int tile = i / kPerTile, r = (i % kPerTile) / kPerRow, c8 = 8 * (i % kPerRow);
      const void* src = tile == 0 ? static_cast<const void*>(ktp + row + r * stride + c8)
                                  : static_cast<const void*>((tile == 1 ? p.w16 : p.w2h) + row + r * stride + c8);
      cp_async16(base + (size_t(tile) * kChunk * LT + size_t(r) * LT + c8) * 2, src, true);
    }
    cp_async_commit();
  };
  // With the split: adds the pair partner's partials of ks and y (the same C layout) to this warp's.
  auto exchange = [&](float (&ks)[kChunk / 8][4], float (&y)[kChunk / 8][4]) {
    float* mine = xch + size_t(warp) * 64 * 32 + lane;
    const float* theirs = xch + size_t(warp ^ 1) * 64 * 32 + lane;
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mine[(4 * nt + e) * 32] = ks[nt][e];
        mine[(32 + 4 * nt + e) * 32] = y[nt][e];
      }
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + rg) : "memory");  // the pair's slots written
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ks[nt][e] += theirs[(4 * nt + e) * 32];
        y[nt][e] += theirs[(32 + 4 * nt + e) * 32];
      }
  };
  float M[KH / 8][4];  // rows row0, row0 + 8 of M, columns c0k .. c0k + KH - 1: C layout
#pragma unroll
  for (int nt = 0; nt < KH / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) M[nt][e] = row0 + 8 * (e >> 1) == c0k + 8 * nt + 2 * t4 + (e & 1) ? 1.f : 0.f;
  issue(p.sc - 1, 0);
  for (int c = p.sc - 1; c >= 0; --c) {
    const int64_t t0 = tok0 + int64_t(c) * kChunk;
    const int set = (p.sc - 1 - c) & 1;
    const T* Kt = reinterpret_cast<const T*>(sets + set * S::tiles);
    const __half* Ws = reinterpret_cast<const __half*>(Kt + kChunk * LT);
    const __half* W2s = Ws + kChunk * LT;
    if (p.msv != nullptr) {  // the backward: M_c (this step's M) for super_bwd, fp16 as M's operand here
      __half* mo = p.msv + ((int64_t(sbi) * p.H + h) * p.sc + c) * K * K;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr)
#pragma unroll
        for (int nt = 0; nt < KH / 8; ++nt)
          *reinterpret_cast<uint32_t*>(mo + int64_t(row0 + 8 * hr) * K + c0k + 8 * nt + 2 * t4) =
              Pack2<__half>::pack(M[nt][2 * hr], M[nt][2 * hr + 1]);
    }
    __syncthreads();  // every warp is done with the other set (the previous chunk's products) and the slots
    if (c > 0) {
      issue(c - 1, set ^ 1);
      cp_async_wait_group<1>();
    } else {
      cp_async_wait_all();
    }
    __syncthreads();  // this chunk's tiles, every thread's copies
    // ks_c[r, row] = (M_rows k~_c^T)[row, r] and y = M_rows W^T (over this warp's columns, then the pair's sum);
    // then M <- M - y W2.
    float ks[kChunk / 8][4], y[kChunk / 8][4];
    zero_acc(ks);
    zero_acc(y);
    // ks's product over KT2 steps of 16 of M's columns: M in fp16 with fp16 k~ (M's entries are at most 1:
    // fp16's significand is tf32's), split into a bf16 head and tail with bf16 k~.
    auto ks_product = [&](float(&acc)[kChunk / 8][4], const auto& src, const T* B) {
      constexpr int KT2 = int(sizeof(src) / sizeof(src[0])) / 2;
      if constexpr (std::is_same_v<T, __half>) warp_mma_rs<__half, KT2, kChunk / 8, false>(acc, src, 1.f, B, LT, 0);
      else warp_mma_rs<T, KT2, kChunk / 8, false, true>(acc, src, 1.f, B, LT, 0);
    };
    if constexpr (kSplit == 2) {
      if constexpr (kKs) ks_product(ks, M, Kt + c0k);
      warp_mma_rs<__half, KH / 16, kChunk / 8, false>(y, M, 1.f, Ws + c0k, LT, 0);
      exchange(ks, y);
    } else {  // the split's arithmetic: the column halves apart, then their sum
      using Half = const float(&)[K / 16][4];
      Half lo = *reinterpret_cast<const float(*)[K / 16][4]>(&M[0][0]);
      Half hi = *reinterpret_cast<const float(*)[K / 16][4]>(&M[K / 16][0]);
      float part[kChunk / 8][4];
      if constexpr (kKs) {
        ks_product(ks, lo, Kt);
        zero_acc(part);
        ks_product(part, hi, Kt + K / 2);
        add_acc(ks, part);
      }
      warp_mma_rs<__half, K / 32, kChunk / 8, false>(y, lo, 1.f, Ws, LT, 0);
      zero_acc(part);
      warp_mma_rs<__half, K / 32, kChunk / 8, false>(part, hi, 1.f, Ws + K / 2, LT, 0);
      add_acc(y, part);
    }
#pragma unroll
    for (int nt = 0; nt < kChunk / 8; ++nt) {
      // With the split, each warp of a pair stores half the keys.
      if (kKs && (kSplit == 1 || nt / (kChunk / 16) == hf)) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 8 * nt + 2 * t4 + (e & 1), j = row0 + 8 * (e >> 1);
          ksp[((t0 + r) * p.H + h) * K + j] = from_f<T>(ks[nt][e]);
        }
      }
    }
    warp_mma_rs<__half, kChunk / 16, KH / 8, true>(M, y, -1.f, W2s + c0k, LT, 0);
  }
  if constexpr (!kKs) return;
  __half* out = p.ps + (int64_t(sbi) * p.H + h) * K * K;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr)
#pragma unroll
    for (int nt = 0; nt < KH / 8; ++nt)
      *reinterpret_cast<uint32_t*>(out + int64_t(row0 + 8 * hr) * K + c0k + 8 * nt + 2 * t4) =
          Pack2<__half>::pack(M[nt][2 * hr], M[nt][2 * hr + 1]);
}

}  // namespace

int super_rows(int K, int items, bool whole, int sms) {
  if (whole) return K;
  int rows = K;
  while (rows > kSuperRows && int64_t(items) * (K / rows) < sms) rows /= 2;
  return rows;
}

size_t smem_super_prep(int K) { return K == 64 ? SuperSmem<64>::bytes : SuperSmem<128>::bytes; }

template <typename T, int K, bool kKs>
static cudaError_t super_t(const KernelParams& p, int rows, cudaStream_t s) {
  return with_rows<K>(rows, [&](auto rb) {
    constexpr int RB = decltype(rb)::value;
    const dim3 grid = item_head_grid(p.nsuper, p.H * (K / RB));
    if constexpr (RB == kSuperRows) {  // few items: the column split (a warp pair per 16 rows)
      constexpr int kXWarps = RB / 16 * 2;
      return launch_with_smem(super_prep_kernel<T, K, RB, 2, kKs>, grid, 32 * kXWarps, SuperSmem<K, kXWarps>::bytes,
                              s, p);
    } else {
      return launch_with_smem(super_prep_kernel<T, K, RB, 1, kKs>, grid, 2 * RB, SuperSmem<K>::bytes, s, p);
    }
  });
}

template <bool kKs>
static cudaError_t super_prep_dispatch(const KernelParams& p, int dtype, int rows, cudaStream_t s) {
  if (dtype == 0) return p.K == 64 ? super_t<__half, 64, kKs>(p, rows, s) : super_t<__half, 128, kKs>(p, rows, s);
  return p.K == 64 ? super_t<__nv_bfloat16, 64, kKs>(p, rows, s) : super_t<__nv_bfloat16, 128, kKs>(p, rows, s);
}

cudaError_t launch_super_prep(const KernelParams& p, int dtype, cudaStream_t s, bool ks) {
  if (p.nsuper == 0) return cudaSuccess;
  int sms = 0;
  const cudaError_t e = device_attr(cudaDevAttrMultiProcessorCount, &sms);
  if (e != cudaSuccess) return e;
  const int rows = super_rows(p.K, p.nsuper * p.H, false, sms);
  return ks ? super_prep_dispatch<true>(p, dtype, rows, s) : super_prep_dispatch<false>(p, dtype, rows, s);
}

}  // namespace pathattn::cuda
