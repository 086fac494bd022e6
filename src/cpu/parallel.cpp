// cpu/parallel.cpp: the one place the CPU backends start threads (OpenMP, dynamic schedule over independent units).
#include <functional>
#include <mutex>

#include "cpu/blas.h"
#include "cpu/cpu_backend.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace pathattn::cpu {

int resolve_threads(int num_threads) {
#ifdef _OPENMP
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
  return 1;
#endif
}

namespace {
// A pthreads OpenBLAS has one thread count for the whole process: the first live SerialBlas sets it to 1,
// the last one restores it (a concurrent BLAS call elsewhere runs serial meanwhile: slower, same result).
std::mutex g_serial_mu;
int g_serial_depth = 0;
int g_serial_saved = 1;
bool blas_follows_openmp() {
  static const bool omp = blas_uses_openmp();
  return omp;
}
}  // namespace

SerialBlas::SerialBlas() {
#ifdef _OPENMP
  saved_ = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
  if (!blas_follows_openmp()) {
    std::lock_guard<std::mutex> lock(g_serial_mu);
    if (g_serial_depth++ == 0) {
      g_serial_saved = blas_threads();
      set_blas_threads(1);
    }
  }
}

SerialBlas::~SerialBlas() {
#ifdef _OPENMP
  omp_set_num_threads(saved_);
#endif
  if (!blas_follows_openmp()) {
    std::lock_guard<std::mutex> lock(g_serial_mu);
    if (--g_serial_depth == 0) set_blas_threads(g_serial_saved);
  }
}

void parallel_for(int64_t n, int num_threads, const std::function<void(int64_t)>& fn) {
#ifdef _OPENMP
  const int nt = resolve_threads(num_threads);
  if (nt > 1 && n > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
#else
  (void)num_threads;
#endif
  for (int64_t i = 0; i < n; ++i) fn(i);
}

}  // namespace pathattn::cpu
