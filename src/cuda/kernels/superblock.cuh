// cuda/kernels/superblock.cuh: the row blocks of the superblock kernels (prep_super.cu, bwd_super.cu).
#pragma once

#include <type_traits>

namespace pathattn::cuda {

// The smallest row block of the superblock kernels.
inline constexpr int kSuperRows = 32;

// Calls a functor with the row block as a compile-time constant (rows in {32, 64, K}).
template <int K, class F>
inline auto with_rows(int rows, F f) {
  if constexpr (K == 128) {
    if (rows == 128) return f(std::integral_constant<int, 128>{});
  }
  if (rows == 64) return f(std::integral_constant<int, 64>{});
  return f(std::integral_constant<int, kSuperRows>{});
}

}  // namespace pathattn::cuda
