// core/w_conv_norm.h: the validated description of one w_conv_norm call (include/pathattn/w_conv_norm.h), which the
// cpu and cuda backends read instead of the params.
#pragma once

#include <cstdint>
#include <vector>

#include "core/problem.h"
#include "pathattn/w_conv_norm.h"

namespace pathattn::core {

struct WConvNormProblem {
  int64_t B = 0, T = 0, D = 0;
  int64_t W = 0;          // taps; 0 = no convolution
  int64_t head_dim = 0, H = 0;  // H = D / head_dim
  bool bias = false, activation = false;
  double eps = 0;
  bool f64 = false;       // compute in fp64 (x is f64, or the oracle backend)
  Backend backend = Backend::cpu;  // resolved: cpu, oracle or cuda
  std::vector<int64_t> cu;         // varlen: the N + 1 entries of cu_seqlens; empty otherwise
  std::vector<Seq> seqs;           // non-empty sequences
};

Status check_w_conv_norm_fwd(const WConvNormFwdParams& p, WConvNormProblem* out);
Status check_w_conv_norm_bwd(const WConvNormBwdParams& p, WConvNormProblem* out);

}  // namespace pathattn::core
