// dev/cuda/far_common.cuh: what the far-loop playgrounds (far_tiling.cu, far_bwd.cu) share: the problem (the
// benchmark T = 16k shape's far work at K = V = 128, bf16), their random inputs, and 2-D TMA tensor maps over
// [H rows][cols] bf16 tensors. Host code; the device helpers are the library's (src/cuda/common.cuh, hopper.cuh).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda/device/hopper.cuh"
#include "tf32_nt.cuh"  // CK, median_ms

#if defined(__CUDA_ARCH__) && !defined(PA_SM90A)
#error "the far-loop playgrounds build for sm_90a only (wgmma): -gencode=arch=compute_90a,code=sm_90a"
#endif

namespace pathattn::cuda::dev::far {

using T = __nv_bfloat16;
constexpr int K = 128, V = 128, LK = K + 8, LV = V + 8;
constexpr int H = 32, kRows = 16384, kKeys = 8192, kNK = kKeys / kChunk;

// n bf16 values amp * U[-1, 1) from a xorshift stream (the playgrounds' inputs; `state` carries on).
inline std::vector<T> uniform_bf16(size_t n, float amp, uint64_t& state) {
  std::vector<T> x(n);
  for (auto& e : x) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    e = __float2bfloat16_rn(amp * float((state >> 40) * (2.0 / 16777216.0) - 1.0));
  }
  return x;
}

// The first n values as floats.
inline std::vector<float> to_float(const std::vector<T>& x, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(x[i]);
  return f;
}

// A 2-D tensor map over a row-major [H rows][cols] bf16 tensor at base: boxes of box_cols x box_rows.
inline void make_map(CUtensorMap* map, const T* base, int cols, int rows, int box_cols, int box_rows,
                     CUtensorMapSwizzle sw) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult qr;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &qr));
    if (qr != cudaDriverEntryPointSuccess || !fn) {
      std::fprintf(stderr, "cuTensorMapEncodeTiled not available\n");
      std::exit(1);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(H) * rows};
  const cuuint64_t strides[1] = {cuuint64_t(cols) * sizeof(T)};
  const cuuint32_t box[2] = {cuuint32_t(box_cols), cuuint32_t(box_rows)}, estr[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<T*>(base), dims, strides, box, estr,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d)\n", int(r));
    std::exit(1);
  }
}

// A device copy of a host vector.
template <typename E>
E* upload(const std::vector<E>& h) {
  E* d = nullptr;
  CK(cudaMalloc(&d, h.size() * sizeof(E)));
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(E), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace pathattn::cuda::dev::far
