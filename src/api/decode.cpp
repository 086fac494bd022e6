// api/decode.cpp: the public prefill and decode entries. Each validates the forward and the cache, then runs
// the backend the Problem names: the host code in cpu/decode.cpp for oracle and cpu, cuda/kernels/decode.cu on
// the device.
#include <string>
#include <vector>

#include "api/inference.h"
#include "core/problem.h"
#include "cpu/cpu_backend.h"
#ifdef PATHATTN_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace pathattn {
namespace {

Status bad(const std::string& m) { return Status(Status::Code::invalid_argument, m); }

}  // namespace

// Prefill: validate the forward and the cache, run the forward on its backend, then build the cache, one
// work unit per (sequence, kv head): on the host, or on the device for the cuda backend (cuda/kernels/decode.cu).
Status path_attn_prefill(const PathPrefillParams& p) {
  core::Problem pr;
  PA_TRY(core::check_fwd(p.fwd, &pr));
  PA_TRY(core::check_cache(p.cache, pr, pr.num_seqs, /*need_room=*/false));
  const std::vector<core::Seq> seqs = api::all_seqs(p.fwd, pr);
  const int64_t cap = p.cache.kc.shape[2];
  for (size_t n = 0; n < seqs.size(); ++n) {
    if (seqs[n].len > cap) {
      return bad("cache.kc: capacity C = " + std::to_string(cap) + " (kc.shape[2]) is smaller than sequence " +
           std::to_string(n) + "'s length " + std::to_string(seqs[n].len));
    }
  }
  if (pr.backend == Backend::cuda) {
#ifdef PATHATTN_WITH_CUDA
    PA_TRY(cuda::prefill(p, pr, seqs));  // the forward and the device cache; lengths are set below
#else
    return Status(Status::Code::unavailable, "backend: cuda was requested but this build of pathattn has no CUDA backend");
#endif
  } else {
    PA_TRY(path_attn_fwd(p.fwd));
    PA_TRY(cpu::prefill(p, pr, seqs));
  }
  int64_t* len = static_cast<int64_t*>(p.cache.lengths.data);
  for (size_t n = 0; n < seqs.size(); ++n) len[int64_t(n) * p.cache.lengths.stride[0]] = seqs[n].len;
  return Status::Ok();
}

// Decode: the step's inputs are a forward problem with B = N and T = 1, so check_fwd validates them all;
// then the cache, with room for one more token in every slot.
Status path_attn_decode(const PathDecodeParams& p) {
  const PathFwdParams f = api::step_as_fwd(p);
  core::Problem pr;
  PA_TRY(core::check_fwd(f, &pr));
  if (pr.T != 1) {
    return bad("q: expected shape [N, 1, HQ, K] (one token per sequence), got " + core::shape_str(p.q));
  }
  PA_TRY(core::check_cache(p.cache, pr, pr.B, /*need_room=*/true));
  const int64_t N = pr.B;
  std::vector<int64_t> len(N);  // read once: every kv head of a slot sees the length before this step
  int64_t* lp = static_cast<int64_t*>(p.cache.lengths.data);
  for (int64_t n = 0; n < N; ++n) len[n] = lp[n * p.cache.lengths.stride[0]];
  if (pr.backend == Backend::cuda) {
#ifdef PATHATTN_WITH_CUDA
    PA_TRY(cuda::decode(p, pr, len));  // lengths stay in host memory: updated below
#else
    return Status(Status::Code::unavailable, "backend: cuda was requested but this build of pathattn has no CUDA backend");
#endif
  } else {
    PA_TRY(cpu::decode(p, pr, len));
  }
  for (int64_t n = 0; n < N; ++n) lp[n * p.cache.lengths.stride[0]] = len[n] + 1;
  return Status::Ok();
}

}  // namespace pathattn
