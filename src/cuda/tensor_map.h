// cuda/tensor_map.h: host side of the TMA tiles of the Hopper far kernels (fwd_far.cu, bwd_k_far.cu): tensor
// maps encoded through the driver's cuTensorMapEncodeTiled, which the runtime looks up (no link against the
// driver library), and the per-device check that this build and device run those kernels.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pathattn::cuda {

// cuTensorMapEncodeTiled from the driver the runtime loaded; null when the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult qr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &qr) != cudaSuccess ||
        qr != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// Bytes of an element of the tensor maps' types here (fp32, else 16-bit).
inline int elem_bytes(CUtensorMapDataType dt) { return dt == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ? 4 : 2; }

// A tensor map over a 16-bit or fp32 tensor: dims / strides (bytes, dims 1..n-1) innermost first, boxes `box`
// (128 bytes innermost, 128-byte swizzle).
inline bool encode_box(CUtensorMap* map, CUtensorMapDataType dt, const void* base, int rank, const cuuint64_t* dims,
                       const cuuint64_t* strides, const cuuint32_t* box) {
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  return tensor_map_encoder()(map, dt, cuuint32_t(rank), const_cast<void*>(base), dims, strides, box, estr,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
// The same with boxes of 128 bytes (64 or 32 elements) by box_rows along dimension `row_dim` (1 elsewhere).
inline bool encode_tiles(CUtensorMap* map, CUtensorMapDataType dt, const void* base, int rank, const cuuint64_t* dims,
                         const cuuint64_t* strides, int row_dim, int box_rows) {
  cuuint32_t box[4] = {cuuint32_t(128 / elem_bytes(dt)), 1, 1, 1};
  box[row_dim] = cuuint32_t(box_rows);
  return encode_box(map, dt, base, rank, dims, strides, box);
}

// The tensors the far kernels tile, each by boxes of 64 columns x box_rows rows:
// a row-major [rows][D] matrix (the parked states, the superblock products);
inline bool map_matrix(CUtensorMap* map, CUtensorMapDataType dt, const void* base, int64_t D, int64_t rows,
                       int box_rows) {
  const cuuint64_t dims[2] = {cuuint64_t(D), cuuint64_t(rows)}, strides[1] = {cuuint64_t(D) * elem_bytes(dt)};
  return encode_tiles(map, dt, base, 2, dims, strides, 1, box_rows);
}
// a token-major workspace tensor [NT][heads][D] (boxes of one head; 16-bit or fp32);
inline bool map_tokens(CUtensorMap* map, CUtensorMapDataType dt, const void* base, int64_t D, int64_t heads, int64_t NT,
                       int box_rows) {
  const cuuint64_t dims[3] = {cuuint64_t(D), cuuint64_t(heads), cuuint64_t(NT)}, eb = cuuint64_t(elem_bytes(dt));
  const cuuint64_t strides[2] = {cuuint64_t(D) * eb, cuuint64_t(heads * D) * eb};
  return encode_tiles(map, dt, base, 3, dims, strides, 2, box_rows);
}
// dq's fp32 reduction target [NT][heads][D] seen as 4-d, 32 columns x (2 x 32) rows a box: dimension 2 steps 32
// tokens, dimension 3 one, so a box's shared-memory row i holds token row + 32 (i & 1) + i / 2 and the 128-byte
// swizzle phase of token row + r is 2 (r & 3) + r / 32 (bwd_k_far's add_dq: its fragment stores conflict-free).
// Dimension 3 stops at NT: a box's second half reaches up to kDqtPadRows (launchers.h) rows past it, which the
// target must hold.
inline bool map_tokens_paired(CUtensorMap* map, const float* base, int64_t D, int64_t heads, int64_t NT) {
  const cuuint64_t row = cuuint64_t(heads * D) * 4;
  const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(heads), 2, cuuint64_t(NT)};
  const cuuint64_t strides[3] = {cuuint64_t(D) * 4, 32 * row, row};
  const cuuint32_t box[4] = {32, 1, 2, 32};
  return encode_box(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, base, 4, dims, strides, box);
}
// a caller's [B][T][heads][D] tensor with element strides s (b, t, head; the last dim contiguous).
inline bool map_bthd(CUtensorMap* map, CUtensorMapDataType dt, const void* base, const int64_t (&s)[3], int64_t D,
                     int64_t heads, int64_t T, int64_t B, int box_rows) {
  const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(heads), cuuint64_t(T), cuuint64_t(B)};
  const cuuint64_t strides[3] = {cuuint64_t(s[2]) * 2, cuuint64_t(s[1]) * 2, cuuint64_t(s[0]) * 2};
  return encode_tiles(map, dt, base, 4, dims, strides, 2, box_rows);
}
// TMA's alignment rules for such a caller's tensor: a 16-byte aligned base and positive strides of 16 bytes' multiples.
inline bool tma_aligned(const void* base, const int64_t (&s)[3]) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (s[d] <= 0 || (s[d] * 2) % 16 != 0) return false;
  return true;
}

// This build has sm_90a device code, the current device is a Hopper part with `smem` bytes of shared memory a
// block, and the driver encodes tensor maps (cached per device; PATHATTN_CUDA_FAR=0 in the environment says
// no). Defined in fwd_far.cu.
bool far_device_ok(size_t smem);

}  // namespace pathattn::cuda
