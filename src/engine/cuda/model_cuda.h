// engine/cuda/model_cuda.h: the engine's model and its AdamW state on one CUDA device (train.device = "cuda").
// Same parameter layout table, init and layer math as Model<float> (engine/model.h); parameters, gradients,
// AdamW moments and activations live in device memory (fp32). GEMMs go through cuBLAS, the layers through
// engine/cuda/kernels.h, attention through the library's public op (path_attn_fwd / path_attn_bwd, Backend::cuda)
// with q, k, v, o, do and dq, dk, dv converted to bf16 at the call (a head dim other than 64 or 128 zero-padded
// to the next of them, see cuda_attn_head_dim). This header needs no CUDA headers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/optim.h"

namespace pathattn::engine {

// The library's CUDA attention is built for head dims 64 and 128 only (K = V). The engine runs every head dim
// K <= kCudaMaxHeadDim on it by zero-padding each head of q, k, v, w to Kp = cuda_attn_head_dim(K) for the
// attention call and dropping the padded columns of o, dq, dk, dv, dw after it (exact: model_cuda.cpp says
// why). K = 64 and 128 run unpadded. Larger K is refused when a CudaModel is made, before a run starts.
inline constexpr int kCudaMaxHeadDim = 128;
constexpr int cuda_attn_head_dim(int K) { return K <= 64 ? 64 : 128; }

// Throws EngineError unless a CUDA device is visible and `cfg` runs on it (1 <= head dim <= kCudaMaxHeadDim).
void check_cuda_model(const ModelConfig& cfg);

class CudaModel {
 public:
  // Allocates parameters, gradients and AdamW moments (zero) on the current device. matmul (TrainConfig::matmul):
  // "fp32" pins cuBLAS to CUBLAS_DEFAULT_MATH; "tf32" lets it use TF32 tensor cores (CUBLAS_TF32_TENSOR_OP_MATH);
  // "bf16" runs the GEMMs with bf16 inputs on tensor cores (CUBLAS_COMPUTE_32F_FAST_16BF), fp32 accumulation.
  CudaModel(const ModelConfig& cfg, const std::string& matmul);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  // Model<T>::forward / backward / zero_grad on the device (tokens, targets, pred are host arrays [B, T]).
  StepStats forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T_, int32_t* pred = nullptr);
  void backward();
  void zero_grad();

  // AdamW<float>::step on the device: clip to c.grad_clip by the global norm (fp64, fixed-order reduction),
  // then the fused update. Returns the norm before clipping.
  double adam_step(const TrainConfig& c, double lr);

  // Host <-> device copies of the state, in the layout of param_layout: parameters, and (when opt is given)
  // both AdamW moments and the update count. Checkpoints go through the host Model / AdamW, so they are the
  // CPU engine's files bit for bit and load on either device.
  void upload(const Model<float>& host, const AdamW<float>* opt);
  void download(Model<float>& host, AdamW<float>* opt) const;

  // Host copies for tests: the gradients of the last backward, the logits [B, T, vocab] of the last forward.
  std::vector<float> grads() const;
  std::vector<float> logits() const;

  const ModelConfig& config() const;
  // The device's name (cudaDeviceProp::name), for reports.
  std::string device_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pathattn::engine
