// core/validate_w_conv_norm.cpp: argument validation of the w_conv_norm op (include/pathattn/w_conv_norm.h). Each
// failure returns invalid_argument (or unavailable) with a message naming the argument and what was expected.
#include <cmath>
#include <string>

#include "core/convert.h"
#include "core/w_conv_norm.h"

namespace pathattn::core {
namespace {

Status bad(const std::string& m) { return Status(Status::Code::invalid_argument, m); }

constexpr int kMaxThreads = 1024;  // as the attention op's limit

bool is_float(DType d) { return d == DType::f32 || d == DType::f64 || d == DType::bf16 || d == DType::f16; }

Status float_dtype(const char* name, const TensorView& x) {
  if (is_float(x.dtype)) return Status::Ok();
  return bad(std::string(name) + ": expected dtype bfloat16, float16, float32 or float64, got " + dtype_name(x.dtype));
}

Status output(const char* name, const TensorView& x, int ndim, const int64_t* shape, const char* doc, DType dt,
              Device dev) {
  if (!x.present()) return bad(std::string(name) + ": required output " + doc + " is absent");
  PA_TRY(tensor_check(name, x, ndim, shape, doc));
  PA_TRY(dtype_check(name, x, dt));
  if (x.device != dev) return bad(std::string(name) + ": output is on the wrong device for this backend");
  return Status::Ok();
}

// What forward and backward share: x, weight, bias, head_dim, eps, backend and devices, threads, sequences.
Status check_inputs(const TensorView& x, const TensorView& weight, const TensorView& bias, const TensorView& cu,
                    int64_t head_dim, bool activation, double eps, Backend backend, int num_threads,
                    WConvNormProblem* pr) {
  if (!x.present()) return bad("x: required but absent");
  if (x.ndim != 3) return bad("x: expected 3 dimensions [B, T, D], got " + std::to_string(x.ndim) + " " + shape_str(x));
  int64_t xs[3] = {-1, -1, -1};
  PA_TRY(tensor_check("x", x, 3, xs, "[B, T, D]"));
  PA_TRY(float_dtype("x", x));
  pr->B = x.shape[0];
  pr->T = x.shape[1];
  pr->D = x.shape[2];
  if (head_dim < 1 || pr->D % head_dim != 0) {
    return bad("head_dim: expected a positive divisor of D = " + std::to_string(pr->D) + " (x.shape[2]), got " +
               std::to_string(head_dim));
  }
  pr->head_dim = head_dim;
  pr->H = pr->D / head_dim;
  pr->W = 0;
  if (weight.present()) {
    if (weight.ndim != 2) {
      return bad("weight: expected 2 dimensions [D, W], got " + std::to_string(weight.ndim) + " " + shape_str(weight));
    }
    int64_t ws[2] = {pr->D, -1};
    PA_TRY(tensor_check("weight", weight, 2, ws, "[D, W]"));
    PA_TRY(float_dtype("weight", weight));
    pr->W = weight.shape[1];
    if (pr->W < 1 || pr->W > kWConvNormMaxWidth) {
      return bad("weight: expected a width W (weight.shape[1]) in [1, " + std::to_string(kWConvNormMaxWidth) +
                 "], got " + std::to_string(pr->W));
    }
  }
  pr->bias = bias.present();
  if (pr->bias) {
    if (!weight.present()) return bad("bias: given without weight (a bias belongs to the convolution)");
    int64_t bs[1] = {pr->D};
    PA_TRY(tensor_check("bias", bias, 1, bs, "[D]"));
    PA_TRY(float_dtype("bias", bias));
  }
  pr->activation = activation;
  if (!std::isfinite(eps) || eps < 0) return bad("eps: expected a finite number >= 0, got " + std::to_string(eps));
  pr->eps = eps;

  Backend be = backend;
  if (be == Backend::automatic) be = x.device == Device::cuda ? Backend::cuda : Backend::cpu;
#ifndef PATHATTN_WITH_CUDA
  if (be == Backend::cuda) {
    return Status(Status::Code::unavailable, "backend: cuda was requested but this build of pathattn has no CUDA "
                  "backend (configure with -DPATHATTN_CUDA=ON)");
  }
#endif
  pr->backend = be;
  const Device dev = be == Backend::cuda ? Device::cuda : Device::cpu;
  const TensorView* all[] = {&x, &weight, &bias};
  const char* names[] = {"x", "weight", "bias"};
  for (int i = 0; i < 3; ++i) {
    if (!all[i]->present()) continue;
    if (all[i]->device != dev) {
      return bad(std::string(names[i]) + ": tensor is on the " + (all[i]->device == Device::cuda ? "cuda" : "cpu") +
                 " device but backend " + backend_name(be) + " needs " + (dev == Device::cuda ? "cuda" : "cpu") +
                 " tensors");
    }
    if (be == Backend::cuda && all[i]->dtype == DType::f64) {
      return bad(std::string(names[i]) + ": expected dtype bfloat16, float16 or float32 on the cuda backend, got "
                 "float64 (float64 is for the oracle and cpu backends)");
    }
  }
  pr->f64 = x.dtype == DType::f64 || be == Backend::oracle;
  if (num_threads < 0 || num_threads > kMaxThreads) {
    return bad("num_threads: expected 0 (default) to " + std::to_string(kMaxThreads) + ", got " +
               std::to_string(num_threads));
  }
  int64_t num_seqs = 0;
  PA_TRY(check_seqs(cu, pr->B, pr->T, &pr->seqs, &num_seqs));
  pr->cu.clear();
  if (cu.present()) {
    for (int64_t i = 0; i < cu.shape[0]; ++i) pr->cu.push_back(load_elem<int64_t>(cu.data, cu.dtype, i * cu.stride[0]));
  }
  return Status::Ok();
}

}  // namespace

Status check_w_conv_norm_fwd(const WConvNormFwdParams& p, WConvNormProblem* pr) {
  PA_TRY(check_inputs(p.x, p.weight, p.bias, p.cu_seqlens, p.head_dim, p.activation, p.eps, p.backend,
                      p.num_threads, pr));
  const Device dev = pr->backend == Backend::cuda ? Device::cuda : Device::cpu;
  int64_t xs[3] = {pr->B, pr->T, pr->D};
  return output("out", p.out, 3, xs, "[B, T, D]", p.x.dtype, dev);
}

Status check_w_conv_norm_bwd(const WConvNormBwdParams& p, WConvNormProblem* pr) {
  PA_TRY(check_inputs(p.x, p.weight, p.bias, p.cu_seqlens, p.head_dim, p.activation, p.eps, p.backend,
                      p.num_threads, pr));
  const Device dev = pr->backend == Backend::cuda ? Device::cuda : Device::cpu;
  int64_t xs[3] = {pr->B, pr->T, pr->D};
  if (!p.dout.present()) return bad("dout: required but absent");
  PA_TRY(tensor_check("dout", p.dout, 3, xs, "[B, T, D]"));
  PA_TRY(dtype_check("dout", p.dout, p.x.dtype));
  if (p.dout.device != dev) return bad("dout: tensor is on the wrong device for this backend");
  PA_TRY(output("dx", p.dx, 3, xs, "[B, T, D]", p.x.dtype, dev));
  if (p.dweight.present()) {
    if (!p.weight.present()) return bad("dweight: given, but weight is absent (no convolution, no such gradient)");
    int64_t ws[2] = {pr->D, pr->W};
    PA_TRY(output("dweight", p.dweight, 2, ws, "[D, W]", p.weight.dtype, dev));
  }
  if (p.dbias.present()) {
    if (!p.bias.present()) return bad("dbias: given, but bias is absent");
    int64_t bs[1] = {pr->D};
    PA_TRY(output("dbias", p.dbias, 1, bs, "[D]", p.bias.dtype, dev));
  }
  return Status::Ok();
}

}  // namespace pathattn::core
