// cuda/w_conv_norm.cu: adapter of the w preparation op on the device: what the kernels support, their params from
// the validated core::WConvNormProblem, and the launch sequence on the caller's stream (forward: one kernel;
// backward: the per-tile kernel, then the fixed-order sum of dweight / dbias when either is asked for).
#include <string>

#include "cuda/cuda_backend.h"
#include "cuda/host_util.h"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

Status check(const core::WConvNormProblem& pr, DType dt) {
  if (dt != DType::bf16 && dt != DType::f16 && dt != DType::f32) {
    return unsupported(std::string("x: dtype ") + dtype_name(dt) +
                       " is not supported by the cuda backend: expected bfloat16, float16 or float32");
  }
  const int64_t hd = pr.head_dim;
  if (hd != 16 && hd != 32 && hd != 64 && hd != 128 && hd != 256) {
    return unsupported("head_dim: " + std::to_string(hd) +
                       " is not supported by the cuda backend: expected 16, 32, 64, 128 or 256");
  }
  if (pr.W > kWConvNormMaxWidthCuda) {
    return unsupported("weight: width W = " + std::to_string(pr.W) + " is not supported by the cuda backend: at most " +
                       std::to_string(kWConvNormMaxWidthCuda));
  }
  if (pr.B * pr.T >= (int64_t(1) << 31) - 2 * w_conv_norm_tile() || pr.D >= (int64_t(1) << 24)) {
    return unsupported("x: " + std::to_string(pr.B * pr.T) + " tokens of " + std::to_string(pr.D) +
                       " channels is more than the cuda kernels index (2^31 tokens, 2^24 channels)");
  }
  return Status::Ok();
}

// The lanes' vector accesses need every row start aligned to min(16 bytes, the C elements a lane owns).
bool rows_aligned(const TensorView& t, int64_t align_bytes) {
  const int64_t es = dtype_size(t.dtype);
  if (reinterpret_cast<uintptr_t>(t.data) % uintptr_t(align_bytes) != 0) return false;
  for (int i = 0; i < 2; ++i) {
    if (t.shape[i] > 1 && (t.stride[i] * es) % align_bytes != 0) return false;
  }
  return true;
}

WConvNormKernelParams params(const core::WConvNormProblem& pr, const TensorView& x, const TensorView& weight,
                             const TensorView& bias) {
  WConvNormKernelParams k;
  k.x = x.data;
  k.x_s[0] = x.stride[0], k.x_s[1] = x.stride[1];
  k.weight = weight.present() ? weight.data : nullptr;
  k.weight_s = weight.present() ? weight.stride[0] : 0;
  k.weight_dt = int(weight.dtype);
  k.bias = pr.bias ? bias.data : nullptr;
  k.bias_s = pr.bias ? bias.stride[0] : 0;
  k.bias_dt = int(bias.dtype);
  k.T = int(pr.T);
  k.ntok = int(pr.B * pr.T);
  k.D = int(pr.D);
  k.W = int(pr.W);
  k.activation = pr.activation;
  k.eps = float(pr.eps);
  const int64_t C = pr.head_dim >= 32 ? pr.head_dim / 32 : 1;
  k.ngroups = int((pr.D + 32 * C - 1) / (32 * C));
  k.ntiles = int((int64_t(k.ntok) + w_conv_norm_tile() - 1) / w_conv_norm_tile());
  return k;
}

int64_t align_of(const core::WConvNormProblem& pr, DType dt) {
  const int64_t C = pr.head_dim >= 32 ? pr.head_dim / 32 : 1, bytes = C * dtype_size(dt);
  return bytes < 16 ? bytes : 16;
}

// The sequence table on the device (varlen only).
Status upload_cu(const core::WConvNormProblem& pr, Workspace& ws, WConvNormKernelParams& k) {
  if (pr.cu.empty()) return Status::Ok();
  int64_t* cu = nullptr;
  PA_CU(ws.alloc(&cu, pr.cu.size()));
  PA_CU(ws.upload(cu, pr.cu.data(), pr.cu.size() * sizeof(int64_t)));
  k.cu = cu;
  k.nseq = int(pr.cu.size()) - 1;
  return Status::Ok();
}

}  // namespace

Status w_conv_norm_fwd(const WConvNormFwdParams& p, const core::WConvNormProblem& pr) {
  PA_TRY(check(pr, p.x.dtype));
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  Workspace ws(s);
  WConvNormKernelParams k = params(pr, p.x, p.weight, p.bias);
  k.out = p.out.data;
  k.out_s[0] = p.out.stride[0], k.out_s[1] = p.out.stride[1];
  const int64_t al = align_of(pr, p.x.dtype);
  k.vec = rows_aligned(p.x, al) && rows_aligned(p.out, al);
  PA_TRY(upload_cu(pr, ws, k));
  PA_CU(launch_w_conv_norm_fwd(k, int(p.x.dtype), int(pr.head_dim), s));
  return Status::Ok();
}

Status w_conv_norm_bwd(const WConvNormBwdParams& p, const core::WConvNormProblem& pr) {
  PA_TRY(check(pr, p.x.dtype));
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  Workspace ws(s);
  WConvNormKernelParams k = params(pr, p.x, p.weight, p.bias);
  k.dout = p.dout.data;
  k.dout_s[0] = p.dout.stride[0], k.dout_s[1] = p.dout.stride[1];
  k.dx = p.dx.data;
  k.dx_s[0] = p.dx.stride[0], k.dx_s[1] = p.dx.stride[1];
  k.dweight = p.dweight.present() ? p.dweight.data : nullptr;
  k.dweight_s = p.dweight.present() ? p.dweight.stride[0] : 0;
  k.dbias = p.dbias.present() ? p.dbias.data : nullptr;
  k.dbias_s = p.dbias.present() ? p.dbias.stride[0] : 0;
  const int64_t al = align_of(pr, p.x.dtype);
  k.vec = rows_aligned(p.x, al) && rows_aligned(p.dout, al) && rows_aligned(p.dx, al);
  PA_TRY(upload_cu(pr, ws, k));
  const bool sums = pr.W > 0 && (k.dweight != nullptr || k.dbias != nullptr);
  if (sums) {
    // ntiles x D x (W + 1) floats: at 32k tokens, D = 2048, W = 3, 16 MiB (an eighth of a bf16 x).
    PA_CU(ws.alloc(&k.partial, size_t(k.ntiles) * size_t(pr.D) * size_t(pr.W + 1)));
  }
  if (k.ntok > 0) PA_CU(launch_w_conv_norm_bwd(k, int(p.x.dtype), int(pr.head_dim), s));
  if (sums) PA_CU(launch_w_conv_norm_reduce(k, s));  // with no token: zeros (an empty sum)
  return Status::Ok();
}

}  // namespace pathattn::cuda
