// cuda/kspan.h: KSpan, where a block product's terms can be non-zero (the triangles of the chunk kernels'
// operands and output masks), and the inner range a warp's part of the product needs. Host and device: the
// chunk kernels narrow their k loops with it (device/tiles.cuh, mma_tc_acc), tests/cuda checks it on the CPU.
#pragma once

#if defined(__CUDACC__)
#define PATHATTN_HD __host__ __device__
#else
#define PATHATTN_HD
#endif

namespace pathattn::cuda {

// Bounds on the inner index k relative to the output row r and column c, and on the output itself, from the
// operands' and the output mask's triangles. mma_tc_acc narrows each warp's k loop to the indices its rows
// [r0, r1) and columns [c0, c1) can use (an empty range where the mask clears the warp's whole output tile).
// The terms skipped are exact zeros (the accessors return 0 there), so the sums are bitwise those of the full
// loop. The chunk kernels' products are triangular almost everywhere (A, Z, U, X, A_loc, their adjoints):
// chunk_prep's full loops issued 1.7x the tensor work its products need.
struct KSpan {
  static constexpr int kNone = 1 << 20;
  int k_min_r = -kNone, k_max_r = kNone, k_min_c = -kNone, k_max_c = kNone, out_c_max_r = kNone;
  // k >= r + d (an A operand that is zero left of the diagonal shifted by d, e.g. L^T with L lower: d = 0)
  PATHATTN_HD constexpr KSpan kmin_r(int d) const { KSpan s = *this; s.k_min_r = d; return s; }
  // k <= r + d (an A operand lower triangular: d = 0 inclusive, -1 strict)
  PATHATTN_HD constexpr KSpan kmax_r(int d) const { KSpan s = *this; s.k_max_r = d; return s; }
  // k >= c + d (a B operand lower triangular in (k, c))
  PATHATTN_HD constexpr KSpan kmin_c(int d) const { KSpan s = *this; s.k_min_c = d; return s; }
  // k <= c + d (a B operand upper triangular in (k, c))
  PATHATTN_HD constexpr KSpan kmax_c(int d) const { KSpan s = *this; s.k_max_c = d; return s; }
  // the output kept only where c <= r + d (lower: d = 0 inclusive, -1 strict)
  PATHATTN_HD constexpr KSpan out_lower(int d) const { KSpan s = *this; s.out_c_max_r = d; return s; }
  // [lo, hi) for rows [r0, r1), columns [c0, c1), inner dimension KD (a multiple of 8): the smallest range in
  // whole steps of 8 that holds every k with a possibly non-zero term at a kept output of the tile; [0, 0)
  // where there is none.
  PATHATTN_HD constexpr void range(int r0, int r1, int c0, int c1, int KD, int& lo, int& hi) const {
    lo = r0 + k_min_r > c0 + k_min_c ? r0 + k_min_r : c0 + k_min_c;
    if (lo < 0) lo = 0;
    hi = r1 + k_max_r < c1 + k_max_c ? r1 + k_max_r : c1 + k_max_c;  // one past the largest k
    if (hi > KD) hi = KD;
    if (c0 > r1 - 1 + out_c_max_r || hi <= lo) {
      lo = hi = 0;
      return;
    }
    lo &= ~7;
    hi = (hi + 7) & ~7;
  }
};
inline constexpr KSpan kFull{};

}  // namespace pathattn::cuda
