// api/w_conv_norm.cpp: the public entries of the w preparation op. Each validates its params into a
// core::WConvNormProblem, then runs the backend it names (oracle and cpu share the host code; the oracle in fp64).
#include "core/w_conv_norm.h"
#include "cpu/cpu_backend.h"
#ifdef PATHATTN_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace pathattn {

Status w_conv_norm_fwd(const WConvNormFwdParams& p) {
  core::WConvNormProblem pr;
  PA_TRY(core::check_w_conv_norm_fwd(p, &pr));
  if (pr.seqs.empty() || pr.D == 0) return Status::Ok();  // no token: nothing to write
  switch (pr.backend) {
    case Backend::oracle:
    case Backend::cpu: return cpu::w_conv_norm_fwd(p, pr);
#ifdef PATHATTN_WITH_CUDA
    case Backend::cuda: return cuda::w_conv_norm_fwd(p, pr);
#endif
    default: break;
  }
  return Status(Status::Code::internal, "backend: unhandled backend");
}

Status w_conv_norm_bwd(const WConvNormBwdParams& p) {
  core::WConvNormProblem pr;
  PA_TRY(core::check_w_conv_norm_bwd(p, &pr));
  if (pr.D == 0) return Status::Ok();
  switch (pr.backend) {  // no early return without tokens: dweight and dbias are then zeros, still written
    case Backend::oracle:
    case Backend::cpu: return cpu::w_conv_norm_bwd(p, pr);
#ifdef PATHATTN_WITH_CUDA
    case Backend::cuda: return cuda::w_conv_norm_bwd(p, pr);
#endif
    default: break;
  }
  return Status(Status::Code::internal, "backend: unhandled backend");
}

}  // namespace pathattn
