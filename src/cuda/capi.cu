// cuda/capi.cu: a small C ABI over the CUDA backend for benchmarks and tools that hold device pointers
// (e.g. Python through ctypes with torch tensors' data_ptr()). Contiguous tensors only; validation is the
// library's own (core::check_fwd / check_bwd). Returns 0 on success, else the Status code, with the
// message copied into err[0 .. errlen).
#include <cuda_runtime.h>

#include <cstring>
#include <string>

#include "core/problem.h"
#include "cuda/cuda_backend.h"

using namespace pathattn;

namespace {

// The `dtype` argument of the calls below: q, k, v (o, do, dq, dk, dv) in bits 0-1, 0 = fp16, 1 = bf16; w, beta
// and g (dw, dbeta, dg) two bits each at bits 2, 4 and 6: 0 = fp32, 1 = bf16, 2 = fp16. Callers passing 0 / 1
// get fp32 w, beta, g. Example: bf16 q, k, v, w, beta with an fp32 g: 1 | 1 << 2 | 1 << 4.
struct CallDtypes {
  DType q = DType::bf16, w = DType::f32, beta = DType::f32, g = DType::f32;
};

Status call_dtypes(int dtype, CallDtypes* out) {
  const int qc = dtype & 3;
  if (dtype < 0 || dtype >= 1 << 8 || qc > 1) {
    return Status(Status::Code::invalid_argument, "dtype: expected bits 0-1 = 0 (fp16) or 1 (bf16) and bits 2-7 the "
                  "codes of w, beta, g (0 fp32, 1 bf16, 2 fp16), got " + std::to_string(dtype));
  }
  auto param = [](int c) { return c == 0 ? DType::f32 : c == 1 ? DType::bf16 : c == 2 ? DType::f16 : DType::i32; };
  out->q = qc == 0 ? DType::f16 : DType::bf16;
  out->w = param((dtype >> 2) & 3);
  out->beta = param((dtype >> 4) & 3);
  out->g = param((dtype >> 6) & 3);
  if (out->w == DType::i32 || out->beta == DType::i32 || out->g == DType::i32) {
    return Status(Status::Code::invalid_argument, "dtype: code 3 of w, beta or g is not a dtype (0 fp32, 1 bf16, 2 fp16), got " +
                  std::to_string(dtype));
  }
  return Status::Ok();
}

TensorView dev(const void* p, DType dt, std::initializer_list<int64_t> shape) {
  if (!p) return TensorView{};
  return make_view(const_cast<void*>(p), dt, shape, Device::cuda);
}

// The workspace limit of every call through this ABI (PathFwdParams::workspace_limit; 0 = the default).
int64_t g_workspace_limit = 0;
int finish(const Status& s, char* err, int errlen) {
  if (err && errlen > 0) {
    std::strncpy(err, s.message().c_str(), size_t(errlen - 1));
    err[errlen - 1] = 0;
  }
  return int(s.code());
}

}  // namespace

extern "C" {

// q [B,T,HQ,K], k [B,T,H,K], v [B,T,H,V]; w [B,T,H,K], beta [B,T,H] or both null; g [B,T,HQ] or null (dtypes: the
// `dtype` code above); o [B,T,HQ,V]; lse [B,T,HQ] fp32 or null. cu_seqlens: host int64 [n_cu] or null.
// scale / gate_scale: NaN for the defaults.
int pathattn_cuda_fwd(const void* q, const void* k, const void* v, const void* w, const void* beta, const void* g,
                      void* o, float* lse, int64_t B, int64_t T, int64_t HQ, int64_t H, int64_t K, int64_t V,
                      int dtype, double scale, double gate_scale, const int64_t* cu_seqlens, int64_t n_cu,
                      void* stream, char* err, int errlen) {
  CallDtypes d;
  if (Status s = call_dtypes(dtype, &d); !s.ok()) return finish(s, err, errlen);
  PathFwdParams p;
  const DType dt = d.q;
  p.q = dev(q, dt, {B, T, HQ, K});
  p.k = dev(k, dt, {B, T, H, K});
  p.v = dev(v, dt, {B, T, H, V});
  p.w = dev(w, d.w, {B, T, H, K});
  p.beta = dev(beta, d.beta, {B, T, H});
  p.g = dev(g, d.g, {B, T, HQ});
  p.o = dev(o, dt, {B, T, HQ, V});
  p.lse = dev(lse, DType::f32, {B, T, HQ});
  if (cu_seqlens) p.cu_seqlens = make_view(const_cast<int64_t*>(cu_seqlens), DType::i64, {n_cu});
  p.scale = scale;
  p.gate_scale = gate_scale;
  p.backend = Backend::cuda;
  p.stream = stream;
  p.workspace_limit = g_workspace_limit;
  core::Problem pr;
  Status s = core::check_fwd(p, &pr);
  if (s.ok() && !pr.seqs.empty()) s = cuda::fwd(p, pr);
  return finish(s, err, errlen);
}

// As above plus o, lse (inputs), dout [B,T,HQ,V] and the gradients (dw/dbeta null without w; dg null
// without g), dw / dbeta / dg in the dtype of w / beta / g.
int pathattn_cuda_bwd(const void* q, const void* k, const void* v, const void* w, const void* beta, const void* g,
                      const void* o, const float* lse, const void* dout, void* dq, void* dk, void* dv, void* dw,
                      void* dbeta, void* dg, int64_t B, int64_t T, int64_t HQ, int64_t H, int64_t K, int64_t V,
                      int dtype, double scale, double gate_scale, const int64_t* cu_seqlens, int64_t n_cu,
                      int deterministic, void* stream, char* err, int errlen) {
  CallDtypes d;
  if (Status s = call_dtypes(dtype, &d); !s.ok()) return finish(s, err, errlen);
  PathBwdParams p;
  const DType dt = d.q;
  p.q = dev(q, dt, {B, T, HQ, K});
  p.k = dev(k, dt, {B, T, H, K});
  p.v = dev(v, dt, {B, T, H, V});
  p.w = dev(w, d.w, {B, T, H, K});
  p.beta = dev(beta, d.beta, {B, T, H});
  p.g = dev(g, d.g, {B, T, HQ});
  p.o = dev(o, dt, {B, T, HQ, V});
  p.lse = dev(lse, DType::f32, {B, T, HQ});
  p.do_ = dev(dout, dt, {B, T, HQ, V});
  p.dq = dev(dq, dt, {B, T, HQ, K});
  p.dk = dev(dk, dt, {B, T, H, K});
  p.dv = dev(dv, dt, {B, T, H, V});
  p.dw = dev(dw, d.w, {B, T, H, K});
  p.dbeta = dev(dbeta, d.beta, {B, T, H});
  p.dg = dev(dg, d.g, {B, T, HQ});
  if (cu_seqlens) p.cu_seqlens = make_view(const_cast<int64_t*>(cu_seqlens), DType::i64, {n_cu});
  p.scale = scale;
  p.gate_scale = gate_scale;
  p.backend = Backend::cuda;
  p.deterministic = deterministic != 0;
  p.workspace_limit = g_workspace_limit;
  p.stream = stream;
  core::Problem pr;
  Status s = core::check_bwd(p, &pr);
  if (s.ok() && !pr.seqs.empty()) s = cuda::bwd(p, pr);
  return finish(s, err, errlen);
}

// High-water mark in bytes of the default stream-ordered memory pool (where the backend's workspace lives);
// reset != 0 clears it first. Returns -1 on error.
// Sets the workspace limit (bytes; 0 = the default, < 0 = none) of the calls above that follow.
void pathattn_cuda_set_workspace_limit(int64_t bytes) { g_workspace_limit = bytes; }

int64_t pathattn_cuda_pool_high_water(int reset) {
  int dev = 0;
  cudaMemPool_t pool;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetDefaultMemPool(&pool, dev) != cudaSuccess) return -1;
  unsigned long long v = 0;
  if (reset && cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &v) != cudaSuccess) return -1;
  if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &v) != cudaSuccess) return -1;
  return int64_t(v);
}

}  // extern "C"
