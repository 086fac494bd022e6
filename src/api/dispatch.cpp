// api/dispatch.cpp: the public forward and backward entries. Each validates its params into a core::Problem, then dispatches to
// the backend the Problem names. Backends never see unvalidated params.
#include <cstring>
#include <string>

#include "core/problem.h"
#include "cpu/cpu_backend.h"
#ifdef PATHATTN_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace pathattn {

Status path_attn_fwd(const PathFwdParams& p) {
  core::Problem pr;
  PA_TRY(core::check_fwd(p, &pr));
  if (pr.seqs.empty()) return Status::Ok();  // T == 0, B == 0 or only empty sequences: nothing to write
  switch (pr.backend) {
    case Backend::oracle: return cpu::oracle_fwd(p, pr);
    case Backend::cpu: return cpu::fast_fwd(p, pr);
#ifdef PATHATTN_WITH_CUDA
    case Backend::cuda: return cuda::fwd(p, pr);
#endif
    default: break;
  }
  return Status(Status::Code::internal, "backend: unhandled backend");
}

Status path_attn_check_inputs(const PathFwdParams& p) {
  core::Problem pr;
  return core::check_fwd_inputs(p, &pr);
}

Status path_attn_bwd(const PathBwdParams& p) {
  core::Problem pr;
  PA_TRY(core::check_bwd(p, &pr));
  if (pr.seqs.empty()) return Status::Ok();
  switch (pr.backend) {
    case Backend::oracle: return cpu::oracle_bwd(p, pr);
    case Backend::cpu: return cpu::fast_bwd(p, pr);
#ifdef PATHATTN_WITH_CUDA
    case Backend::cuda: return cuda::bwd(p, pr);
#endif
    default: break;
  }
  return Status(Status::Code::internal, "backend: unhandled backend");
}

std::string build_info() {
  std::string s = "oracle cpu";
#ifdef PATHATTN_WITH_CUDA
  s += " cuda";
#endif
  return s;
}

}  // namespace pathattn
