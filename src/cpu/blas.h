// cpu/blas.h: row-major GEMM overloaded on float / double, over OpenBLAS's CBLAS interface.
// C[M x N] = alpha * op(A) op(B) + beta * C, op(X) = X or X^T. Called from inside our own OpenMP regions,
// where the OpenMP build of OpenBLAS runs single-threaded (no oversubscription).
#pragma once

#include <cblas.h>

#include <cstdint>

namespace pathattn::cpu {

inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(M), int(N),
              int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
                 const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(M), int(N),
              int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

}  // namespace pathattn::cpu
