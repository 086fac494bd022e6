// cpu/blas.h: the one seam to BLAS. Row-major GEMM overloaded on float / double, the BLAS thread count and
// the build string, over either OpenBLAS the build links (CMake option PATHATTN_BLAS): the system's (plain
// CBLAS names, the OpenMP build on Debian) or scipy-openblas32's (every symbol prefixed scipy_, pthreads).
#pragma once

#include <cblas.h>

#include <cstdint>

#ifdef PATHATTN_BLAS_SCIPY_OPENBLAS
#define PATHATTN_BLAS_FN(name) scipy_##name
#else
#define PATHATTN_BLAS_FN(name) name
#endif

namespace pathattn::cpu {

// C[M x N] = alpha * op(A) op(B) + beta * C, op(X) = X or X^T; A, B, C row-major with leading dims lda, ldb, ldc.
inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  PATHATTN_BLAS_FN(cblas_sgemm)(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                                int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

inline void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
                 const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  PATHATTN_BLAS_FN(cblas_dgemm)(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                                int(M), int(N), int(K), alpha, A, int(lda), B, int(ldb), beta, C, int(ldc));
}

// The BLAS thread count. The OpenMP build also sets the calling thread's OpenMP default (its team follows
// that); the pthreads build keeps one count for the whole process.
inline void set_blas_threads(int n) { PATHATTN_BLAS_FN(openblas_set_num_threads)(n); }
inline int blas_threads() { return PATHATTN_BLAS_FN(openblas_get_num_threads)(); }

// True when OpenBLAS runs its threads through OpenMP (then a call inside an OpenMP region is serial).
inline bool blas_uses_openmp() { return PATHATTN_BLAS_FN(openblas_get_parallel)() == 2; }

// OpenBLAS's build options and the kernel it picked for this CPU (for benchmark headers).
inline const char* blas_config() { return PATHATTN_BLAS_FN(openblas_get_config)(); }
inline const char* blas_corename() { return PATHATTN_BLAS_FN(openblas_get_corename)(); }

}  // namespace pathattn::cpu
