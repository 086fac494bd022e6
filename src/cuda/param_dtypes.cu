// cuda/param_dtypes.cu: w, beta and g in bfloat16 / float16 at prefill and decode on a device cache. The cache
// kernels read fp32 w, beta, g; a 16-bit one is converted once into a dense fp32 copy on the call's stream. fp32
// tensors pass through untouched: no copy, no extra launch. (The forward and backward read and write these
// tensors in their own dtype: KernelParams::w_dt and the rest.)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/cuda_backend.h"
#include "cuda/host_util.h"

namespace pathattn::cuda {
namespace {

// A view of rank <= 4 as [n0, n1, n2, n3] (missing leading dims of size 1), strides in elements.
struct Strided {
  void* data = nullptr;
  int dtype = 0;  // pathattn::DType: f32, bf16 or f16 here
  int64_t n[4] = {1, 1, 1, 1};
  int64_t s[4] = {0, 0, 0, 0};
  bool dense = true;  // row-major without gaps: element i lives at data + i
};

__device__ __forceinline__ float load_f32(const void* p, int dt, int64_t i) {
  if (dt == int(DType::bf16)) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (dt == int(DType::f16)) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_f32(void* p, int dt, int64_t i, float x) {
  if (dt == int(DType::bf16)) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  else if (dt == int(DType::f16)) static_cast<__half*>(p)[i] = __float2half_rn(x);
  else static_cast<float*>(p)[i] = x;
}

__device__ __forceinline__ int64_t offset_of(const Strided& v, int64_t i) {
  const int64_t i3 = i % v.n[3], r = i / v.n[3];
  const int64_t i2 = r % v.n[2], r2 = r / v.n[2];
  const int64_t i1 = r2 % v.n[1], i0 = r2 / v.n[1];
  return i0 * v.s[0] + i1 * v.s[1] + i2 * v.s[2] + i3 * v.s[3];
}

// dst = src element for element (same shape), converting the dtype; a grid-stride loop, one element a thread.
// Dense views (the usual case) index linearly; others decompose the index by their shape.
__global__ void convert_kernel(Strided src, Strided dst, int64_t total) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t si = src.dense ? i : offset_of(src, i);
    const int64_t di = dst.dense ? i : offset_of(dst, i);
    store_f32(dst.data, dst.dtype, di, load_f32(src.data, src.dtype, si));
  }
}

Strided strided(const TensorView& v) {
  Strided x;
  x.data = v.data;
  x.dtype = int(v.dtype);
  const int off = 4 - v.ndim;
  int64_t want = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    x.n[off + d] = v.shape[d];
    x.s[off + d] = v.stride[d];
    if (v.shape[d] > 1 && v.stride[d] != want) x.dense = false;
    want *= v.shape[d];
  }
  return x;
}

Status convert(const TensorView& src, const TensorView& dst, cudaStream_t s) {
  const int64_t total = src.numel();
  if (total == 0) return Status::Ok();
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t(1) << 16);
  convert_kernel<<<unsigned(blocks), kThreads, 0, s>>>(strided(src), strided(dst), total);
  PA_CU(cudaGetLastError());
  return Status::Ok();
}

// A dense fp32 buffer of x's shape in ws, as a view.
Status f32_buffer(const TensorView& x, Workspace& ws, TensorView* out) {
  float* d = nullptr;
  PA_CU(ws.alloc(&d, size_t(x.numel())));
  TensorView v = x;
  v.data = d;
  v.dtype = DType::f32;
  int64_t st = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.stride[i] = st;
    st *= v.shape[i];
  }
  *out = v;
  return Status::Ok();
}

// The fp32 view the kernels read for input x: x itself when it is fp32 or absent, else a converted copy in ws.
Status f32_input(const TensorView& x, Workspace& ws, cudaStream_t s, TensorView* out) {
  *out = x;
  if (!x.present() || x.dtype == DType::f32) return Status::Ok();
  PA_TRY(f32_buffer(x, ws, out));
  return convert(x, *out, s);
}

bool is_f32(const TensorView& x) { return !x.present() || x.dtype == DType::f32; }

}  // namespace

Status prefill(const PathPrefillParams& p, const core::Problem& pr, const std::vector<core::Seq>& slots) {
  const PathFwdParams& f = p.fwd;
  if (is_f32(f.w) && is_f32(f.beta) && is_f32(f.g)) return prefill_f32(p, pr, slots);
  PA_TRY(check_support(pr, f.q.dtype));
  cudaStream_t s = static_cast<cudaStream_t>(f.stream);
  Workspace ws(s);
  PathPrefillParams c = p;
  PA_TRY(f32_input(f.w, ws, s, &c.fwd.w));
  PA_TRY(f32_input(f.beta, ws, s, &c.fwd.beta));
  PA_TRY(f32_input(f.g, ws, s, &c.fwd.g));
  return prefill_f32(c, pr, slots);
}

Status decode(const PathDecodeParams& p, const core::Problem& pr, const std::vector<int64_t>& lengths) {
  if (is_f32(p.w) && is_f32(p.beta) && is_f32(p.g)) return decode_f32(p, pr, lengths);
  PA_TRY(check_support(pr, p.q.dtype));
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  Workspace ws(s);
  PathDecodeParams c = p;
  PA_TRY(f32_input(p.w, ws, s, &c.w));
  PA_TRY(f32_input(p.beta, ws, s, &c.beta));
  PA_TRY(f32_input(p.g, ws, s, &c.g));
  return decode_f32(c, pr, lengths);
}

}  // namespace pathattn::cuda
