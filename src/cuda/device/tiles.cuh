// cuda/device/tiles.cuh: block-level products of the chunk (UT transform) kernels: plain fp32 and tensor-core
// (TcTile, mma_tc_acc, block_mm_tc*) with triangular inner ranges (KSpan), column sums, reductions.
#pragma once

#include "cuda/device/copies.cuh"
#include "cuda/device/kspan.h"
#include "cuda/device/mma.cuh"

namespace pathattn::cuda {

// Block-level fp32 product for the chunk (UT transform) kernels: out(r, c, sum_k a(r, k) b(k, c)) for
// r < M, c < N, with k running over [klo(r, c), khi(r, c)) so triangular products skip their zeros.
// Each thread owns outputs idx = tid + i * blockDim.x, so a caller may accumulate into its own outputs.
template <class FA, class FB, class FK, class FO>
__device__ __forceinline__ void block_mm(int M, int N, FA a, FB b, FK krange, FO out) {
  for (int idx = threadIdx.x; idx < M * N; idx += blockDim.x) {
    const int r = idx / N, c = idx % N;
    int lo, hi;
    krange(r, c, lo, hi);
    float s = 0.f;
    for (int k = lo; k < hi; ++k) s = fmaf(a(r, k), b(k, c), s);
    out(r, c, s);
  }
}

// Block-level tf32 tensor-core products for the chunk kernels (blockDim.x == 32 kTcWarps), M x N outputs
// (M, N multiples of 16), inner dimension KD (multiple of 8). Operands come from accessor functions a(r, k)
// and b(k, c) (shared or global memory, masks folded in, so triangular products pass zeros through the
// accessors, and say where those zeros lie by a KSpan, so that the warps skip them). kX3 splits every operand
// into a tf32 head and a tf32 tail and sums three products (head*head + head*tail + tail*head): about fp32
// accuracy at three times the work, for the products that feed the triangular inverse. Warp tiling (TcTile):
// M / 16 m-tiles over min(M / 16, kTcWarps) warps; the remaining warp factor splits N. 16 warps: these kernels
// are latency-bound at one CTA per SM. A thread owns the same outputs in every product of the same M x N, so
// several products can accumulate into one register fragment (mma_tc_acc).

template <int M, int N>
struct TcTile {
  static constexpr int MTILES = M / 16, WM = MTILES < kTcWarps ? MTILES : kTcWarps, WN = kTcWarps / WM,
                       MPW = MTILES / WM;
  static constexpr int NTW = N / (8 * WN);
  static_assert(MTILES % WM == 0 && N % (8 * WN) == 0, "TcTile: unsupported tile shape");
  using Acc = float[MPW][NTW][4];
  // The warp's m-tile wm and n-group wn. In a 4 x 4 warp grid (64-row products) the warps of one scheduler
  // (warp % 4) get one m-tile each (wm = warp / 4) and n-groups that are a Latin square over the schedulers,
  // so that the triangular products' unequal warps (row blocks of the k spans, tiles the output mask clears:
  // KSpan) spread evenly: each scheduler holds 2 or 3 of the 10 lower tiles, and one warp of each row block.
  // Which warp owns an output never changes a sum's order: results are the same bits under any mapping.
  __device__ static __forceinline__ void coords(int warp, int& wm, int& wn) {
    if constexpr (WM == 4 && WN == 4) {
      wm = warp >> 2;
      wn = (0x1b4ee1b4u >> (2 * (4 * (warp & 3) + wm))) & 3;
    } else {
      wm = warp % WM;
      wn = warp / WM;
    }
  }
  // f(r, c, value&, value&) for every pair of outputs (columns c, c + 1; c even) this thread owns.
  template <class F>
  __device__ static __forceinline__ void each_pair(Acc& acc, F f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int wm, wn;
    coords(warp, wm, wn);
#pragma unroll
    for (int mi = 0; mi < MPW; ++mi)
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        const int r = 16 * (wm + WM * mi) + g, c = 8 * (wn * NTW + nt) + 2 * t;
        f(r, c, acc[mi][nt][0], acc[mi][nt][1]);
        f(r + 8, c, acc[mi][nt][2], acc[mi][nt][3]);
      }
  }
  // f(r, c, value&) for every output this thread owns (each_pair, one element at a time).
  template <class F>
  __device__ static __forceinline__ void each(Acc& acc, F f) {
    each_pair(acc, [&](int r, int c, float& v, float& w) {
      f(r, c, v);
      f(r, c + 1, w);
    });
  }
  __device__ static __forceinline__ void zero(Acc& acc) {
    each(acc, [](int, int, float& v) { v = 0.f; });
  }
};

// Column sums over a warp's 16 rows of a 16 x 64 tile x in the accumulator layout (rows g and g + 8, columns
// 8 nt + 2t and + 1): three shuffles over the rows; lane t < 4 then holds columns 8 nt + 2t + j in cs[nt][j].
// Every lane of the warp calls it.
__device__ __forceinline__ void warp_col_sums(const float (&x)[8][4], float (&cs)[8][2]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) cs[nt][j] = x[nt][j] + x[nt][2 + j];
#pragma unroll
  for (int o = 4; o < 32; o <<= 1)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) cs[nt][j] += __shfl_xor_sync(0xffffffffu, cs[nt][j], o);
}

// warp_col_sums, times w, added to dst[(tok0 + column) * stride] with fp32 atomics by lanes 0-3. Every lane of
// the warp calls it.
__device__ __forceinline__ void warp_add_col_sums(const float (&x)[8][4], float* dst, int64_t tok0, int stride,
                                                  float w) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  float cs[8][2];
  warp_col_sums(x, cs);
  if (lane < 4)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) atomicAdd(dst + (tok0 + 8 * nt + 2 * t + j) * stride, w * cs[nt][j]);
}

// One m16n8 accumulator fragment (rows r0 + g and r0 + g + 8, columns c0 + 2t and c0 + 2t + 1 of an 8-column
// group), times `scale`, added to dst[r * ld + c] (fp32 global, rows 16-byte aligned, ld a multiple of 4). On
// sm_90 by vector reductions: lanes t and t ^ 1 trade half their pairs, so that each adds four consecutive
// columns of one row (the even lane row r0 + g, the odd lane row r0 + g + 8) with one red.global.add.v4.f32, a
// quarter of the scalar atomics' operations; elsewhere by scalar atomics. kRowBound: rows from row_end on are
// left alone. Every lane of the warp calls it (shuffles).
template <bool kRowBound = false>
__device__ __forceinline__ void red_add_frag_v4(float* dst, int ld, int r0, int c0, const float (&a)[4], float scale,
                                                int row_end = 0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool odd = t & 1;
  const float s0 = odd ? a[0] : a[2], s1 = odd ? a[1] : a[3];
  const float x0 = __shfl_xor_sync(0xffffffffu, s0, 1), x1 = __shfl_xor_sync(0xffffffffu, s1, 1);
  const int r = r0 + g + (odd ? 8 : 0);
  float* row = dst + r * ld + c0 + 4 * (t >> 1);
  if (!kRowBound || r < row_end)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(row), "f"((odd ? x0 : a[0]) * scale),
                 "f"((odd ? x1 : a[1]) * scale), "f"((odd ? a[2] : x0) * scale), "f"((odd ? a[3] : x1) * scale)
                 : "memory");
#else
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int r = r0 + g + 8 * (e >> 1);
    if (!kRowBound || r < row_end) atomicAdd(dst + r * ld + c0 + 2 * t + (e & 1), a[e] * scale);
  }
#endif
}

// dst[r * ld + c] += scale x every output of an M x N accumulator (fp32 global, rows 16-byte aligned, ld a multiple of
// 4), a fragment at a time by red_add_frag_v4 (on sm_90 vector reductions, which bound the superblock
// backward's dP adds as scalar atomics).
template <int M, int N>
__device__ __forceinline__ void red_add_tile(float* dst, int ld, typename TcTile<M, N>::Acc& acc, float scale = 1.f) {
  using TT = TcTile<M, N>;
  int wm, wn;
  TT::coords(threadIdx.x >> 5, wm, wn);
#pragma unroll
  for (int mi = 0; mi < TT::MPW; ++mi)
#pragma unroll
    for (int nt = 0; nt < TT::NTW; ++nt)
      red_add_frag_v4(dst, ld, 16 * (wm + TT::WM * mi), 8 * (wn * TT::NTW + nt), acc[mi][nt], scale);
}

// The chunk kernels' k-loop unroll (mma_tc_acc's kU): 4 at K = 64; 2 at K = 128, where 4 made bwd_chunk spill
// and run slower (docs/cuda.md).
constexpr int kTcUnroll(int K) { return K == 64 ? 4 : 2; }

// A value the same across the warp, through a shuffle from lane 0: ptxas then knows it warp-uniform and keeps what
// derives from it (wgmma descriptors, tile bounds and offsets) in uniform registers (docs/cuda.md).
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }
__device__ __forceinline__ int uniform_warp_id() { return warp_uniform(int(threadIdx.x >> 5)); }

// Operand accessors for mma_tc_acc whose inner index k runs along a row in memory: row(i) gives the row's first
// element (type E: fp32 or 16-bit, rows 8-byte aligned for fp32, 4-byte for 16-bit), i the operand's other index
// (A: the output row, kB: the output column). mma_tc_acc takes each lane's two k of a step (2t, 2t + 1) from such
// an accessor by one paired load (pair) instead of two scalar ones; kNeg negates. Any callable (a(r, k) /
// b(k, c)) still serves where the operand is not so stored.
template <typename E, bool kB, bool kNeg, class F>
struct KRows {
  F row;
  __device__ __forceinline__ float operator()(int i, int j) const {
    const float v = to_f(row(kB ? j : i)[kB ? i : j]);
    return kNeg ? -v : v;
  }
  __device__ __forceinline__ float2 pair(int i, int k) const {
    const E* x = row(i) + k;
    float2 v;
    if constexpr (sizeof(E) == 4) v = *reinterpret_cast<const float2*>(x);
    else v = pair_f(x);
    if constexpr (kNeg) v = make_float2(-v.x, -v.y);
    return v;
  }
};
template <typename E, bool kNeg = false, class F>
__device__ __forceinline__ KRows<E, false, kNeg, F> a_rows(F row) { return {row}; }
template <typename E, bool kNeg = false, class F>
__device__ __forceinline__ KRows<E, true, kNeg, F> b_rows(F row) { return {row}; }
// A row-major matrix (leading dim ld) as either operand: a(r, k) = x[r ld + k], b(k, c) = x[c ld + k].
template <bool kNeg = false, typename E>
__device__ __forceinline__ auto a_rows(const E* x, int ld) {
  return a_rows<E, kNeg>([x, ld](int i) { return x + i * ld; });
}
template <bool kNeg = false, typename E>
__device__ __forceinline__ auto b_rows(const E* x, int ld) {
  return b_rows<E, kNeg>([x, ld](int i) { return x + i * ld; });
}
// Whether F is a KRows accessor, and for which operand (kB): mma_tc_acc's paired loads read pair(i, k) as the
// role says, so an accessor of the other role would be summed wrongly; the roles are checked at compile time.
template <class F> struct IsKRows { static constexpr bool value = false, kB = false; };
template <typename E, bool kB_, bool kNeg, class F> struct IsKRows<KRows<E, kB_, kNeg, F>> {
  static constexpr bool value = true, kB = kB_;
};

// acc += A B over this thread's outputs (no synchronisation), k over the warp's part of `span`. kU: the k loop's
// unroll (its trip count is the warp's span): the kernel's choice, by its register budget (kTcUnroll). kUW: the
// warp index through a shuffle, which ptxas then knows warp-uniform (the tiling's bounds and offsets in uniform
// registers: chunk_prep's spills go, super_bwd needs ~11 registers fewer); bwd_chunk spills more with it. Within
// each step of 8 the inner index runs permuted in both operands (lane t's fragment slots t and t + 4 take k = 2t
// and 2t + 1: the same sum), so that a KRows operand gives a lane's two k by one load.
template <int M, int N, int KD, bool kX3, int kU = 4, bool kUW = true, class FA, class FB>
__device__ __forceinline__ void mma_tc_acc(typename TcTile<M, N>::Acc& acc, FA a, FB b, KSpan span = kFull) {
  static_assert(!IsKRows<FA>::value || !IsKRows<FA>::kB, "mma_tc_acc: a b_rows accessor as the A operand");
  static_assert(!IsKRows<FB>::value || IsKRows<FB>::kB, "mma_tc_acc: an a_rows accessor as the B operand");
  using TT = TcTile<M, N>;
  constexpr int MPW = TT::MPW, NTW = TT::NTW, WM = TT::WM;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int wm, wn;
  TT::coords(kUW ? uniform_warp_id() : int(threadIdx.x >> 5), wm, wn);
  int klo, khi;
  span.range(16 * wm, 16 * (wm + WM * (MPW - 1)) + 16, 8 * wn * NTW, 8 * (wn + 1) * NTW, KD, klo, khi);
#pragma unroll(kU)
  for (int k0 = klo; k0 < khi; k0 += 8) {
    uint32_t ah[MPW][4], al[MPW][4];
#pragma unroll
    for (int mi = 0; mi < MPW; ++mi) {
      const int m = 16 * (wm + WM * mi) + g;
      float av[4];
      if constexpr (IsKRows<FA>::value) {
        const float2 x = a.pair(m, k0 + 2 * t), y = a.pair(m + 8, k0 + 2 * t);
        av[0] = x.x, av[1] = y.x, av[2] = x.y, av[3] = y.y;
      } else {
        av[0] = a(m, k0 + 2 * t), av[1] = a(m + 8, k0 + 2 * t), av[2] = a(m, k0 + 2 * t + 1);
        av[3] = a(m + 8, k0 + 2 * t + 1);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (kX3) split_tf32(av[e], ah[mi][e], al[mi][e]);
        else ah[mi][e] = to_tf32(av[e]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int n = 8 * (wn * NTW + nt) + g;
      float b0, b1;
      if constexpr (IsKRows<FB>::value) {
        const float2 x = b.pair(n, k0 + 2 * t);
        b0 = x.x, b1 = x.y;
      } else {
        b0 = b(k0 + 2 * t, n), b1 = b(k0 + 2 * t + 1, n);
      }
      uint32_t bh0, bh1, bl0 = 0, bl1 = 0;
      if (kX3) {
        split_tf32(b0, bh0, bl0);
        split_tf32(b1, bh1, bl1);
      } else {
        bh0 = to_tf32(b0);
        bh1 = to_tf32(b1);
      }
#pragma unroll
      for (int mi = 0; mi < MPW; ++mi) {
        if (kX3) {
          mma1688_tf32(acc[mi][nt], al[mi], bh0, bh1);
          mma1688_tf32(acc[mi][nt], ah[mi], bl0, bl1);
        }
        mma1688_tf32(acc[mi][nt], ah[mi], bh0, bh1);
      }
    }
  }
}

// acc += A B over this thread's outputs (TcTile's layout, no synchronisation) for 16-bit operands in shared memory
// (type E): A stored [m][k] (leading dim lda; TA: [k][m]), B stored [n][k] (ldb; TB: [k][n]), 16-byte aligned
// rows. m16n8k16 mma with ldmatrix fragments (.trans for the stored-transposed operands), k over the warp's part
// of `span` in steps of 16: for products whose operands are the inputs themselves (exact in E), or fp16 copies
// scaled into its range, where the tf32 path would load, convert and multiply them element by element.
template <int M, int N, int KD, typename E, bool TA = false, bool TB = false>
__device__ __forceinline__ void mma_tc_acc16(typename TcTile<M, N>::Acc& acc, const E* A, int lda, const E* B,
                                             int ldb, KSpan span = kFull) {
  using TT = TcTile<M, N>;
  constexpr int MPW = TT::MPW, NTW = TT::NTW, WM = TT::WM;
  static_assert(NTW % 2 == 0 && KD % 16 == 0, "mma_tc_acc16: n-tiles in pairs, k in steps of 16");
  int wm, wn;
  TT::coords(threadIdx.x >> 5, wm, wn);
  int klo, khi;
  span.range(16 * wm, 16 * (wm + WM * (MPW - 1)) + 16, 8 * wn * NTW, 8 * (wn + 1) * NTW, KD, klo, khi);
  klo &= ~15;
  khi = (khi + 15) & ~15;
  if (khi <= klo) return;
  const E* const a0 = A + (TA ? klo * lda : klo);
  const E* const b0 = B + (TB ? klo * ldb : klo);
#pragma unroll
  for (int mi = 0; mi < MPW; ++mi)
    warp_mma_ss<E, 1, NTW, TA, TB>(*reinterpret_cast<float(*)[1][NTW][4]>(&acc[mi]), a0, lda, 16 * (wm + WM * mi), b0,
                                   ldb, 8 * wn * NTW, khi - klo);
}

// out2(r, c, v, w) with v, w the sums sum_k a1(r, k) b1(k, c') + sum_k a2(r, k) b2(k, c') at c' = c and c + 1 (c
// even), for every pair of outputs: a product over a stacked inner dimension [A1 | A2] [B1 ; B2] as two passes
// into one accumulator (no per-element select between the halves); pairs of columns, so that an epilogue can
// store both with one instruction. span1, span2: where each pass's terms can be non-zero (KSpan). Every warp
// finishes reading before any `out2` runs (one __syncthreads in between), so `out2` may overwrite the
// operands. Callers sync before the next read.
template <int M, int N, int KD1, int KD2, bool kX3, int kU = 4, bool kUW = true, class FA1, class FB1, class FA2,
          class FB2, class FO2>
__device__ __forceinline__ void block_mm_tc2_pairs(FA1 a1, FB1 b1, FA2 a2, FB2 b2, FO2 out2, KSpan span1 = kFull,
                                                   KSpan span2 = kFull) {
  using TT = TcTile<M, N>;
  typename TT::Acc acc;
  TT::zero(acc);
  mma_tc_acc<M, N, KD1, kX3, kU, kUW>(acc, a1, b1, span1);
  if constexpr (KD2 > 0) mma_tc_acc<M, N, KD2, kX3, kU, kUW>(acc, a2, b2, span2);
  __syncthreads();
  TT::each_pair(acc, [&](int r, int c, float& v, float& w) { out2(r, c, v, w); });
}
// out(r, c, sum_k a1(r, k) b1(k, c) + sum_k a2(r, k) b2(k, c)) for every output (block_mm_tc2_pairs, one
// element at a time).
template <int M, int N, int KD1, int KD2, bool kX3, int kU = 4, bool kUW = true, class FA1, class FB1, class FA2,
          class FB2, class FO>
__device__ __forceinline__ void block_mm_tc2(FA1 a1, FB1 b1, FA2 a2, FB2 b2, FO out, KSpan span1 = kFull,
                                             KSpan span2 = kFull) {
  block_mm_tc2_pairs<M, N, KD1, KD2, kX3, kU, kUW>(
      a1, b1, a2, b2,
      [&](int r, int c, float v, float w) {
        out(r, c, v);
        out(r, c + 1, w);
      },
      span1, span2);
}
// out(r, c, sum_k a(r, k) b(k, c)): the same with one inner dimension.
template <int M, int N, int KD, bool kX3, int kU = 4, bool kUW = true, class FA, class FB, class FO>
__device__ __forceinline__ void block_mm_tc(FA a, FB b, FO out, KSpan span = kFull) {
  block_mm_tc2<M, N, KD, 0, kX3, kU, kUW>(a, b, a, b, out, span);
}
template <int M, int N, int KD, bool kX3, int kU = 4, bool kUW = true, class FA, class FB, class FO2>
__device__ __forceinline__ void block_mm_tc_pairs(FA a, FB b, FO2 out2, KSpan span = kFull) {
  block_mm_tc2_pairs<M, N, KD, 0, kX3, kU, kUW>(a, b, a, b, out2, span);
}

}  // namespace pathattn::cuda
