// cpu/cpu_backend.h: entry points of the CPU backends, called by the dispatcher after validation.
//   oracle_*: fp64 brute force from the definition (docs/algorithms.md).
//   fast_*:   blockwise UT-transform path (docs/algorithms.md), fp64 or fp32.
#pragma once

#include <functional>
#include <vector>

#include "core/problem.h"
#include "core/w_conv_norm.h"
#include "pathattn/paged.h"

namespace pathattn::cpu {

Status oracle_fwd(const PathFwdParams& p, const core::Problem& pr);
Status oracle_bwd(const PathBwdParams& p, const core::Problem& pr);

Status fast_fwd(const PathFwdParams& p, const core::Problem& pr);
Status fast_bwd(const PathBwdParams& p, const core::Problem& pr);

// Prefill and decode on a host cache (decode.cpp), called by the entries in api/decode.cpp after their
// validation. prefill: fills cache slot n from seqs[n] (the forward has run); decode: lengths[n] is slot n's
// length before the step. The caller sets the lengths.
Status prefill(const PathPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& seqs);
Status decode(const PathDecodeParams& p, const core::Problem& pr, const std::vector<int64_t>& lengths);

// The paged cache on the host (paged.cpp; include/pathattn/paged.h), after api/paged.cpp's validation; the
// same algorithm and rounding points as the CUDA kernels, in fp32. Arguments as cuda::paged_prefill / decode.
Status paged_prefill(const PathPagedPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& seqs,
                     const std::vector<int32_t>& slots);
Status paged_decode(const PathPagedDecodeParams& p, const core::Problem& pr);

// The w preparation op (w_conv_norm.cpp), in fp64 when pr.f64, else fp32.
Status w_conv_norm_fwd(const WConvNormFwdParams& p, const core::WConvNormProblem& pr);
Status w_conv_norm_bwd(const WConvNormBwdParams& p, const core::WConvNormProblem& pr);

// Default chunk size of the fast path for a head dim (the value chunk_size = 0 selects).
int default_chunk_size(int64_t K);

// The number of threads a call with `num_threads` uses (0 = the OpenMP default).
int resolve_threads(int num_threads);

// Keeps every BLAS call of the current thread single-threaded while it lives (our own threads parallelise
// over work units; a block product of a few hundred KFLOP must not open an OpenMP team of its own, which
// costs far more than the product, ruinously so on a loaded machine). The OpenMP build of OpenBLAS sizes
// its team from the calling thread's nthreads ICV, which this sets to 1 and restores; ICVs are per thread,
// so concurrent calls from other user threads are unaffected. A pthreads OpenBLAS (scipy-openblas32) has
// one process-wide count: set to 1 while any SerialBlas lives. Resolve the thread count before creating it.
class SerialBlas {
 public:
  SerialBlas();
  ~SerialBlas();
  SerialBlas(const SerialBlas&) = delete;
  SerialBlas& operator=(const SerialBlas&) = delete;

 private:
  int saved_ = 1;
};

// Runs fn(i) for i in [0, n) on `num_threads` OpenMP threads (0 = default) with dynamic scheduling (units write disjoint outputs, so the result never depends on the schedule).
void parallel_for(int64_t n, int num_threads, const std::function<void(int64_t)>& fn);

}  // namespace pathattn::cpu
