// cuda/cuda_backend.h: entry points of the CUDA backend, called by the dispatcher (core/api.cpp) after
// validation. Supported here: q/k/v in bfloat16 or float16 (fp32 w, beta, g), K and V in {64, 128},
// causal, GQA, varlen, gate; anything else returns Status::Code::unsupported naming the argument.
#pragma once

#include "core/problem.h"

namespace pathattn::cuda {

Status fwd(const PathFwdParams& p, const core::Problem& pr);
Status bwd(const PathBwdParams& p, const core::Problem& pr);

// The head dims this build compiles, for messages and build_info(): "{64, 128}".
const char* supported_head_dims();

}  // namespace pathattn::cuda
