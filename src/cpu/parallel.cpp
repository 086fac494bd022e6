// cpu/parallel.cpp: the one place the CPU backends start threads (OpenMP, dynamic schedule over independent units).
#include <functional>

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

SerialBlas::SerialBlas() {
#ifdef _OPENMP
  saved_ = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
}

SerialBlas::~SerialBlas() {
#ifdef _OPENMP
  omp_set_num_threads(saved_);
#endif
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
