// cuda/cuda_backend.h: entry points of the CUDA backend, called by the dispatcher (api/dispatch.cpp) after
// validation. Supported here: q/k/v in bfloat16 or float16, w, beta, g in bfloat16, float16 or float32, K and
// V in {64, 128}, causal, GQA, varlen, gate; anything else returns Status::Code::unsupported naming the argument.
#pragma once

#include "core/problem.h"
#include "core/w_conv_norm.h"
#include "pathattn/paged.h"

namespace pathattn::cuda {

// fwd and bwd (backend.cu) take w, beta, g (and dw, dbeta, dg) in any of those dtypes: the kernels that read or
// write them do so in the tensor's own dtype (KernelParams::w_dt and the rest), computing in fp32. prefill and
// decode (param_dtypes.cu) convert 16-bit ones to fp32 copies at entry, then the *_f32 entry points run.
Status fwd(const PathFwdParams& p, const core::Problem& pr);
Status bwd(const PathBwdParams& p, const core::Problem& pr);

// Prefill and decode on a device cache (kernels/decode.cu), called by the entries in api/decode.cpp after
// their validation. Same dtypes and head dims as the forward.
// prefill: runs the forward, then fills cache slot n from slots[n] (every sequence, empty ones included,
//   in slot order) for n < slots.size(); the caller sets lengths.
// decode: lengths[n] is slot n's length before the step (host copy); the caller increments lengths.
Status prefill(const PathPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& slots);
Status decode(const PathDecodeParams& p, const core::Problem& pr, const std::vector<int64_t>& lengths);
Status prefill_f32(const PathPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& slots);
Status decode_f32(const PathDecodeParams& p, const core::Problem& pr, const std::vector<int64_t>& lengths);

// The paged cache (kernels/paged_step.cu, paged_prefill.cu; include/pathattn/paged.h), after api/paged.cpp's validation. q, k, v in
// bf16 / f16, K = V in {64, 128}, key pages f16 or f32, S <= kPagedMaxPending.
// paged_prefill: runs the forward, then writes sequence i (seqs[i], in sequence order, empty ones included) into
//   slot slots[i]: keys transported to its end, values, gate cumsums; lengths and flushed set on the device.
// paged_decode: pr is the step's problem (B = N slots, T tokens each); every metadata read happens on the device.
Status paged_prefill(const PathPagedPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& seqs,
                     const std::vector<int32_t>& slots);
Status paged_decode(const PathPagedDecodeParams& p, const core::Problem& pr);
// Copies `bytes` from device memory to the host after the stream's earlier work (the validating mode's read of
// the paged cache's metadata).
Status copy_to_host(void* dst, const void* src, size_t bytes, void* stream);

// The w preparation op (kernels/w_conv_norm.cu): x, weight, bias in bf16, fp16 or fp32, head_dim in
// {16, 32, 64, 128, 256}, W <= kWConvNormMaxWidthCuda; anything else is unsupported, naming the argument.
Status w_conv_norm_fwd(const WConvNormFwdParams& p, const core::WConvNormProblem& pr);
Status w_conv_norm_bwd(const WConvNormBwdParams& p, const core::WConvNormProblem& pr);

// The head dims this build compiles, for messages and build_info(): "{64, 128}".
const char* supported_head_dims();

}  // namespace pathattn::cuda
