// pathattn/types.h: the framework-free vocabulary of the public API.
// Tensor views (non-owning pointer + shape + strides + dtype + device), the status type every entry
// point returns, and the backend selector. No Python, torch or CUDA headers are ever included here.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace pathattn {

// Element types. Float tensors of the op use f32/bf16/f16 (docs/spec.md, section 2); the CPU backends additionally accept f64 (q, k, v
// f64 together: how the fp64 oracle chain is tested). w, beta and g take any of these float types, each on
// its own (attention.h). Integer types appear only in cu_seqlens (i32 or i64) and the decode cache lengths (i64).
enum class DType : int { f32 = 0, f64 = 1, bf16 = 2, f16 = 3, i32 = 4, i64 = 5 };

enum class Device : int { cpu = 0, cuda = 1 };

// Which implementation runs the op.
//   automatic: cuda for CUDA tensors, cpu for host tensors.
//   oracle:    fp64 brute force from the definition (docs/spec.md, section 1); O(T^2 K) time, O(K) extra memory
//              per query; host tensors only. Computes in fp64 whatever the input dtypes.
//   cpu:       the fast blockwise (UT transform) path; computes in fp64 when the inputs are f64, in fp32
//              otherwise (bf16/f16 converted on load, fp32 accumulation).
//   cuda:      the CUDA kernels (only in builds with PATHATTN_CUDA=ON).
enum class Backend : int { automatic = 0, oracle = 1, cpu = 2, cuda = 3 };

const char* dtype_name(DType dt);
const char* backend_name(Backend b);
int64_t dtype_size(DType dt);

// A non-owning view of a strided tensor of rank <= 4. Strides are in elements (not bytes), like torch.
// The last dimension must be contiguous (stride 1) for every tensor the op reads or writes.
// A view with data == nullptr and ndim == 0 means "absent" (used for optional tensors such as g).
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};

  bool present() const { return data != nullptr || ndim != 0; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
};

// Builds a view of a contiguous (row-major) tensor.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = Device::cpu);

// Every entry point returns a Status. ok() is true on success; otherwise message() names the argument and
// the expected value, e.g. "q: expected 4 dimensions [B, T, HQ, K], got 3". No entry point throws, aborts
// or exits on bad input.
class Status {
 public:
  enum class Code : int {
    ok = 0,
    invalid_argument = 1,  // a shape, dtype, stride, value or combination the contract rejects
    unsupported = 2,       // legal per docs/spec.md but not built into this backend (e.g. a head dim on CUDA)
    unavailable = 3,       // the backend is not compiled in (e.g. cuda in a CPU-only build)
    internal = 4,          // a bug in pathattn or a failed allocation / CUDA call
  };
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == Code::ok; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Code code_ = Code::ok;
  std::string message_;
};

}  // namespace pathattn
