// cuda/adapter.h: what the adapter's two halves share (backend.cu: the entries, the forward's launch sequence;
// bwd_run.cu: the backward's): params filled from a validated core::Problem, the workspace every pass needs, and
// the launch sequences the planner runs over slices.
#pragma once

#include "core/problem.h"
#include "cuda/host_util.h"
#include "cuda/params.h"
#include "cuda/planner.h"

namespace pathattn::cuda {

void strides3(const TensorView& v, int64_t (&s)[3]);
inline int dtype_code(DType d) { return d == DType::f16 ? 0 : 1; }
// The kernels' code for a w / beta / g tensor's (or gradient's) dtype; absent tensors read as fp32.
inline ParamDt param_dt(const TensorView& v) {
  return v.dtype == DType::bf16 ? ParamDt::bf16 : v.dtype == DType::f16 ? ParamDt::f16 : ParamDt::f32;
}

// Fields shared by forward and backward.
void fill_inputs(KernelParams& kp, const core::Problem& pr, const TensorView& q, const TensorView& k,
                 const TensorView& v, const TensorView& w, const TensorView& beta, const TensorView& g);
// Device copies of the tables plus the forward's workspace (also recomputed by the backward). The tables go into
// `tables` (their addresses reach kp and *seq_first_dev at its commit). kt_at: memory the caller gives k~, else
// allocated here.
Status alloc_common(Workspace& ws, KernelParams& kp, const Tables& t, const core::Problem& pr, TablePack& tables,
                    int32_t** seq_first_dev, void* kt_at = nullptr);
// Two-level scan (PaTH only): the superblock table and the superblock products.
Status alloc_super(Workspace& ws, KernelParams& kp, const Tables& t, const core::Problem& pr, TablePack& tables);

// One forward / backward over the whole of p / pr (a slice of the call): allocates its workspace from ws and,
// unless ws is measuring, launches the kernels. bwd_run: msv_early, super_bwd's M_c written by super_prep's first
// launch (else by a second one after bwd_k); host_out, output memory as workspace where OutputHost allows it.
Status fwd_run(const PathFwdParams& p, const core::Problem& pr, Workspace& ws);
// Head dims 16 and 32 (pad.cu): the call at 64 on zero-padded copies, exact.
bool needs_padding(const core::Problem& pr);
Status fwd_padded(const PathFwdParams& p, const core::Problem& pr);
Status bwd_padded(const PathBwdParams& p, const core::Problem& pr);
Status bwd_run(const PathBwdParams& p, const core::Problem& pr, Workspace& ws, bool msv_early, bool host_out);

// No byte that dq, dk, dv or dw may touch is one that another tensor of the call may touch.
bool outputs_apart(const PathBwdParams& p);

}  // namespace pathattn::cuda
