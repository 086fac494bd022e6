// cuda/pad.cu: head dims 16 and 32 on the CUDA backend's forward and backward. The kernels are built for 64 and
// 128, so the call runs at 64 on zero-padded copies of q, k, w (K) and v, o, dO (V), and the outputs' first K or V
// columns are copied out. This is exact: the padded coordinates of q, k and w are zero, so q.k and w.w are
// unchanged and every factor I - beta w w^T is block diagonal (the unpadded factor, the identity on the padding);
// the padded columns of v are zero, so are those of o and dO, and the padded gradients are not read.
#include <string>

#include "cuda/adapter.h"
#include "cuda/cuda_backend.h"

namespace pathattn::cuda {
namespace {

constexpr int64_t kPadDim = 64;  // the smallest head dim the kernels are built for
constexpr int kPadThreads = 256;

// A [n0, n1, n2, D] view's rows (row (i0, i1, i2) at i0 s0 + i1 s1 + i2 s2, D contiguous elements of E's size)
// to and from a contiguous [n0, n1, n2, Dp] buffer, element bits copied (the padding: zero bits, i.e. +0).
struct RowMap {
  int64_t n1, n2, s0, s1, s2;
  int D, Dp;
};

template <typename E>
__global__ void pad_rows_kernel(const E* src, E* dst, RowMap m, int64_t total) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const int64_t r = i / m.Dp;
  const int d = int(i % m.Dp);
  const int64_t i2 = r % m.n2, i1 = (r / m.n2) % m.n1, i0 = r / (m.n2 * m.n1);
  dst[i] = d < m.D ? src[i0 * m.s0 + i1 * m.s1 + i2 * m.s2 + d] : E(0);
}

template <typename E>
__global__ void unpad_rows_kernel(const E* src, E* dst, RowMap m, int64_t total) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const int64_t r = i / m.D;
  const int d = int(i % m.D);
  const int64_t i2 = r % m.n2, i1 = (r / m.n2) % m.n1, i0 = r / (m.n2 * m.n1);
  dst[i0 * m.s0 + i1 * m.s1 + i2 * m.s2 + d] = src[r * m.Dp + d];
}

RowMap row_map(const TensorView& v, int64_t Dp) {
  return RowMap{v.shape[1], v.shape[2], v.stride[0], v.stride[1], v.stride[2], int(v.shape[3]), int(Dp)};
}

// A contiguous [shape0, shape1, shape2, Dp] buffer of v's dtype from the workspace, as a view (v itself where
// its last dimension is Dp already).
Status alloc_padded(const TensorView& v, int64_t Dp, Workspace& ws, TensorView* out) {
  *out = v;
  if (v.shape[3] == Dp) return Status::Ok();
  out->shape[3] = Dp;
  out->stride[3] = 1;
  out->stride[2] = Dp;
  out->stride[1] = v.shape[2] * Dp;
  out->stride[0] = v.shape[1] * v.shape[2] * Dp;
  const size_t n = size_t(v.shape[0] * v.shape[1] * v.shape[2] * Dp);
  if (dtype_size(v.dtype) == 2) {
    uint16_t* p = nullptr;
    PA_CU(ws.alloc(&p, n));
    out->data = p;
  } else {
    uint32_t* p = nullptr;
    PA_CU(ws.alloc(&p, n));
    out->data = p;
  }
  return Status::Ok();
}

// v's rows into a new zero-padded buffer (absent views, and views of width Dp already, stay as they are).
Status pad_copy(const TensorView& v, int64_t Dp, Workspace& ws, cudaStream_t s, TensorView* out) {
  if (!v.present() || v.shape[3] == Dp) {
    *out = v;
    return Status::Ok();
  }
  PA_TRY(alloc_padded(v, Dp, ws, out));
  const int64_t total = v.shape[0] * v.shape[1] * v.shape[2] * Dp;
  if (total == 0) return Status::Ok();
  const unsigned blocks = unsigned((total + kPadThreads - 1) / kPadThreads);
  if (dtype_size(v.dtype) == 2)
    pad_rows_kernel<<<blocks, kPadThreads, 0, s>>>(static_cast<const uint16_t*>(v.data),
                                                   static_cast<uint16_t*>(out->data), row_map(v, Dp), total);
  else
    pad_rows_kernel<<<blocks, kPadThreads, 0, s>>>(static_cast<const uint32_t*>(v.data),
                                                   static_cast<uint32_t*>(out->data), row_map(v, Dp), total);
  PA_CU(cudaGetLastError());
  return Status::Ok();
}

// The first D columns of a padded buffer into the caller's view dst (absent views, and dst itself, are skipped).
Status unpad_copy(const TensorView& padded, const TensorView& dst, cudaStream_t s) {
  if (!dst.present() || padded.data == dst.data) return Status::Ok();
  const int64_t total = dst.shape[0] * dst.shape[1] * dst.shape[2] * dst.shape[3];
  if (total == 0) return Status::Ok();
  const unsigned blocks = unsigned((total + kPadThreads - 1) / kPadThreads);
  if (dtype_size(dst.dtype) == 2)
    unpad_rows_kernel<<<blocks, kPadThreads, 0, s>>>(static_cast<const uint16_t*>(padded.data),
                                                     static_cast<uint16_t*>(dst.data), row_map(dst, padded.shape[3]),
                                                     total);
  else
    unpad_rows_kernel<<<blocks, kPadThreads, 0, s>>>(static_cast<const uint32_t*>(padded.data),
                                                     static_cast<uint32_t*>(dst.data), row_map(dst, padded.shape[3]),
                                                     total);
  PA_CU(cudaGetLastError());
  return Status::Ok();
}

bool padded_dim(int64_t d) { return d == 16 || d == 32; }

// The problem at the kernels' head dims (scales stay the caller's, resolved at the unpadded K).
core::Problem padded_problem(const core::Problem& pr) {
  core::Problem pp = pr;
  if (padded_dim(pr.K)) pp.K = kPadDim;
  if (padded_dim(pr.V)) pp.V = kPadDim;
  return pp;
}

// The inputs both directions share: q, k, w to pp.K, v to pp.V (P: PathFwdParams or PathBwdParams).
template <class P>
Status pad_inputs(const P& p, const core::Problem& pp, Workspace& ws, cudaStream_t s, P* q) {
  PA_TRY(pad_copy(p.q, pp.K, ws, s, &q->q));
  PA_TRY(pad_copy(p.k, pp.K, ws, s, &q->k));
  PA_TRY(pad_copy(p.w, pp.K, ws, s, &q->w));
  return pad_copy(p.v, pp.V, ws, s, &q->v);
}

}  // namespace

bool needs_padding(const core::Problem& pr) { return padded_dim(pr.K) || padded_dim(pr.V); }

Status fwd_padded(const PathFwdParams& p, const core::Problem& pr) {
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  const core::Problem pp = padded_problem(pr);
  Workspace ws(s);
  PathFwdParams q = p;
  PA_TRY(pad_inputs(p, pp, ws, s, &q));
  PA_TRY(alloc_padded(p.o, pp.V, ws, &q.o));
  PA_TRY(fwd(q, pp));
  return unpad_copy(q.o, p.o, s);
}

Status bwd_padded(const PathBwdParams& p, const core::Problem& pr) {
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  const core::Problem pp = padded_problem(pr);
  Workspace ws(s);
  PathBwdParams q = p;
  PA_TRY(pad_inputs(p, pp, ws, s, &q));
  PA_TRY(pad_copy(p.o, pp.V, ws, s, &q.o));
  PA_TRY(pad_copy(p.do_, pp.V, ws, s, &q.do_));
  PA_TRY(alloc_padded(p.dq, pp.K, ws, &q.dq));
  PA_TRY(alloc_padded(p.dk, pp.K, ws, &q.dk));
  if (p.dw.present()) PA_TRY(alloc_padded(p.dw, pp.K, ws, &q.dw));
  PA_TRY(alloc_padded(p.dv, pp.V, ws, &q.dv));
  PA_TRY(bwd(q, pp));
  PA_TRY(unpad_copy(q.dq, p.dq, s));
  PA_TRY(unpad_copy(q.dk, p.dk, s));
  PA_TRY(unpad_copy(q.dw, p.dw, s));
  return unpad_copy(q.dv, p.dv, s);
}

}  // namespace pathattn::cuda
