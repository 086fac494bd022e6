// cuda/host_util.h: host-side helpers shared by the CUDA adapters (backend.cu, bwd_run.cu, kernels/decode.cu): Status
// shorthands, the CUDA error check, a stream-ordered workspace freed on every return path, and the check
// of the dtypes and head dims the kernels are built for.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/problem.h"
#include "cuda/cuda_backend.h"

namespace pathattn::cuda {

inline Status unsupported(const std::string& m) { return Status(Status::Code::unsupported, m); }
inline Status internal(const std::string& m) { return Status(Status::Code::internal, m); }

// A failed CUDA call as a Status. The runtime's last error is cleared with it (taken over by the Status), so a
// failure such as an allocation's does not fail the next call's launch checks.
#define PA_CU(expr)                                                                              \
  do {                                                                                           \
    cudaError_t _e = (expr);                                                                     \
    if (_e != cudaSuccess) {                                                                     \
      (void)cudaGetLastError();                                                                  \
      return ::pathattn::cuda::internal(std::string("cuda: ") + #expr + ": " + cudaGetErrorString(_e)); \
    }                                                                                            \
  } while (0)

// Stream-ordered allocations released together (also on early error returns). Three modes: the default
// allocates each buffer from the stream-ordered pool; a measuring workspace allocates nothing, adds up the
// bytes its allocations would take and hands out null pointers (copies and fills skipped), so a call's
// allocation sequence can be run to size it; an arena workspace hands out consecutive pieces of a block the
// caller owns (the same rounding as measuring, so a block of the measured size always suffices).
class Workspace {
 public:
  explicit Workspace(cudaStream_t s, bool measure = false) : s_(s), measure_(measure) {}
  Workspace(cudaStream_t s, void* arena, size_t arena_bytes)
      : s_(s), measure_(false), arena_(static_cast<char*>(arena)), arena_bytes_(arena_bytes) {}
  ~Workspace() {
    for (void* p : ptrs_) cudaFreeAsync(p, s_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  template <typename T>
  cudaError_t alloc(T** out, size_t count) {
    const size_t bytes = std::max<size_t>(count, 1) * sizeof(T), off = bytes_;
    bytes_ += rounded(bytes);
    *out = nullptr;
    if (measure_) return cudaSuccess;
    if (arena_) {
      if (bytes_ > arena_bytes_) return cudaErrorMemoryAllocation;
      *out = reinterpret_cast<T*>(arena_ + off);
      return cudaSuccess;
    }
    void* p = nullptr;
    cudaError_t e = cudaMallocAsync(&p, bytes, s_);
    if (e != cudaSuccess) return e;
    ptrs_.push_back(p);
    *out = static_cast<T*>(p);
    return cudaSuccess;
  }
  cudaError_t zero(void* p, size_t bytes) { return measure_ ? cudaSuccess : cudaMemsetAsync(p, 0, bytes, s_); }
  cudaError_t upload(void* dst, const void* src, size_t bytes) {
    return measure_ ? cudaSuccess : cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s_);
  }
  bool measuring() const { return measure_; }
  static size_t rounded(size_t bytes) { return (bytes + kRound - 1) / kRound * kRound; }  // a piece's extent
  size_t bytes() const { return bytes_; }  // handed out (or, measuring, would be) so far

 private:
  static constexpr size_t kRound = 512;  // keeps every piece of an arena 512-byte aligned
  cudaStream_t s_;
  bool measure_;
  char* arena_ = nullptr;
  size_t arena_bytes_ = 0, bytes_ = 0;
  std::vector<void*> ptrs_;
};

// The kernels take bf16 / fp16 q, k, v with K, V in {64, 128}; anything else is `unsupported`, naming q or v.
inline Status check_support(const core::Problem& pr, DType dt) {
  if (dt != DType::bf16 && dt != DType::f16) {
    return unsupported(std::string("q: dtype ") + dtype_name(dt) +
                       " is not supported by the cuda backend: expected bfloat16 or float16");
  }
  auto ok_dim = [](int64_t d) { return d == 64 || d == 128; };
  if (!ok_dim(pr.K)) {
    return unsupported("q: head dim K = " + std::to_string(pr.K) + " is not supported by the cuda backend: supported " +
                       supported_head_dims());
  }
  if (!ok_dim(pr.V)) {
    return unsupported("v: head dim V = " + std::to_string(pr.V) + " is not supported by the cuda backend: supported " +
                       supported_head_dims());
  }
  if (pr.B * pr.T > (int64_t(1) << 31) / 64 || pr.HQ > 4096) {
    return unsupported("q: B * T = " + std::to_string(pr.B * pr.T) + " tokens is more than the cuda backend's chunk table holds");
  }
  return Status::Ok();
}

// The scans copy rows of v and dO into shared memory 16 bytes at a time (cp.async): the data pointer and the
// stride of every dimension longer than one must be multiples of 16 bytes (8 elements of a 16-bit type).
// Contiguous tensors with K, V in {64, 128} always are; an offset view (x[..., 1:]) may not be.
inline Status check_row_copies(const TensorView& t, const char* name) {
  const uintptr_t off = reinterpret_cast<uintptr_t>(t.data) % 16;
  bool ok = off == 0;
  std::string strides;
  for (int i = 0; i < t.ndim; ++i) {
    strides += (i ? ", " : "") + std::to_string(t.stride[i]);
    if (i + 1 < t.ndim && t.shape[i] > 1 && (t.stride[i] * 2) % 16 != 0) ok = false;
  }
  if (ok) return Status::Ok();
  return unsupported(std::string(name) + ": the cuda backend copies its rows 16 bytes at a time, so the data pointer and the "
                     "strides of its batch, token and head dimensions must be multiples of 16 bytes (8 elements); got a "
                     "pointer " + std::to_string(off) + " bytes past a 16-byte boundary and strides (" + strides + ")");
}

}  // namespace pathattn::cuda
