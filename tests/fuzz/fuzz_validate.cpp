// tests/fuzz/fuzz_validate.cpp: libFuzzer target for argument validation (shapes, strides, dtypes, ranks,
// cu_seqlens, options) of path_attn_fwd / path_attn_bwd. The input bytes choose every field of the params
// structs. Views with the contiguous layout of their shape point at buffers of that size, so a call the
// validation accepts is run (oracle or cpu backend) and must stay in bounds; a view with other strides is
// only validated (path_attn_check_inputs), since its memory is the caller's promise.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_bytes.h"
#include "pathattn/pathattn.h"

using namespace pathattn;

namespace {

struct Buf {
  std::vector<double> mem;  // 8-byte elements: room for any dtype
};

// A view of one of the op's tensors: mostly the right rank and a small shape; sometimes a broken field.
TensorView make(Bytes& in, std::vector<Buf>& bufs, const std::vector<int64_t>& shape, DType dt, bool* contiguous) {
  TensorView v;
  const uint8_t mode = in.next();
  if (mode % 16 == 0) return v;  // absent
  v.dtype = mode % 23 == 1 ? DType(in.small(5)) : dt;
  v.ndim = mode % 29 == 2 ? int(in.next() % 7) - 1 : int(shape.size());
  const int nd = v.ndim < 0 ? 0 : (v.ndim > 4 ? 4 : v.ndim);
  for (int d = 0; d < nd; ++d) {
    const int64_t s = d < int(shape.size()) ? shape[d] : 1;
    v.shape[d] = mode % 31 == 3 && d == nd - 1 ? s + int64_t(in.next() % 3) - 1 : s;
  }
  int64_t st = 1;
  for (int d = nd - 1; d >= 0; --d) {
    v.stride[d] = st;
    st *= v.shape[d] > 0 ? v.shape[d] : 1;
  }
  if (mode % 37 == 4) {  // odd strides: validation only
    for (int d = 0; d < nd; ++d) v.stride[d] = int64_t(int8_t(in.next()));
    *contiguous = false;
  }
  int64_t numel = 1;
  for (int d = 0; d < nd; ++d) numel *= v.shape[d] > 0 ? v.shape[d] : 0;
  bufs.push_back({});
  bufs.back().mem.assign(size_t(numel > 0 ? numel : 1), 0.0);
  for (size_t i = 0; i < bufs.back().mem.size(); ++i) bufs.back().mem[i] = double(int(in.next()) - 128) / 64;
  v.data = bufs.back().mem.data();
  // Float payloads: valid values of the view's dtype (the doubles above, narrowed in place).
  if (v.dtype == DType::f32) {
    float* f = static_cast<float*>(v.data);
    for (int64_t i = 0; i < numel; ++i) f[i] = float(bufs.back().mem[size_t(i)]);
  } else if (v.dtype == DType::i32 || v.dtype == DType::i64 || v.dtype == DType::bf16 || v.dtype == DType::f16) {
    std::memset(v.data, 0, size_t(numel > 0 ? numel : 1) * 8);
  }
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in{data, size};
  std::vector<Buf> bufs;
  bufs.reserve(32);
  const int64_t B = in.small(2), T = in.small(40), H = 1 + in.small(1), HQ = H * (1 + in.small(1));
  const int64_t K = 8 * (1 + in.small(1)), V = 8 * (1 + in.small(1));
  const bool f64 = in.next() & 1;
  const DType dt = f64 ? DType::f64 : DType::f32;
  bool contiguous = true;
  PathFwdParams p;
  p.q = make(in, bufs, {B, T, HQ, K}, dt, &contiguous);
  p.k = make(in, bufs, {B, T, H, K}, dt, &contiguous);
  p.v = make(in, bufs, {B, T, H, V}, dt, &contiguous);
  if (in.next() & 1) {
    p.w = make(in, bufs, {B, T, H, K}, dt, &contiguous);
    p.beta = make(in, bufs, {B, T, H}, dt, &contiguous);
  }
  if (in.next() & 1) p.g = make(in, bufs, {B, T, HQ}, dt, &contiguous);
  p.o = make(in, bufs, {B, T, HQ, V}, dt, &contiguous);
  if (in.next() & 1) p.lse = make(in, bufs, {B, T, HQ}, dt, &contiguous);
  // cu_seqlens: n + 1 entries from the input (i32 or i64), in a buffer of exactly that size.
  std::vector<int64_t> cu64;
  std::vector<int32_t> cu32;
  if (in.next() % 3 == 0) {
    const int64_t n1 = in.small(8);
    const bool i32 = in.next() & 1;
    int64_t acc = 0;
    for (int64_t i = 0; i < n1; ++i) {
      const uint8_t c = in.next();
      acc = c == 255 ? -1 : (c == 254 ? int64_t(1) << 40 : acc + c % 24);
      cu64.push_back(i == 0 && c < 200 ? 0 : acc);
      cu32.push_back(int32_t(cu64.back()));
    }
    TensorView& cu = p.cu_seqlens;
    cu.dtype = i32 ? DType::i32 : DType::i64;
    cu.ndim = 1;
    cu.shape[0] = n1;
    cu.stride[0] = 1;
    cu.data = n1 == 0 ? nullptr : (i32 ? static_cast<void*>(cu32.data()) : static_cast<void*>(cu64.data()));
    if (cu.data == nullptr) cu.ndim = 1, cu.data = cu64.data();  // present with 0 entries: a valid pointer
  }
  const uint8_t opt = in.next();
  p.backend = opt & 1 ? Backend::oracle : Backend::cpu;
  if (opt % 11 == 3) p.backend = Backend(in.small(5));
  p.num_threads = opt % 13 == 5 ? int(int8_t(in.next())) * 16 : 1;
  p.chunk_size = opt % 7 == 2 ? int(in.next()) : 0;
  p.scale = opt % 17 == 6 ? std::nan("") : (opt % 19 == 7 ? INFINITY : kDefaultScale);
  p.validate = opt & 2;

  const Status ci = path_attn_check_inputs(p);
  if (!contiguous || p.num_threads > 4) return 0;  // (a team of hundreds of threads per input: too slow)
  const Status fs = path_attn_fwd(p);
  if (!ci.ok() && fs.ok()) __builtin_trap();  // the forward accepted what its own input check refused
  if (!fs.ok() || !p.lse.present()) return 0;
  // Backward of the accepted forward: gradients as new contiguous buffers.
  PathBwdParams b = bwd_params_for(p);
  b.do_ = p.o;
  auto grad = [&](const TensorView& like) {
    if (!like.present()) return TensorView{};
    TensorView g = like;
    bufs.push_back({});
    bufs.back().mem.assign(size_t(like.numel() > 0 ? like.numel() : 1), 0.0);
    g.data = bufs.back().mem.data();
    return g;
  };
  b.dq = grad(p.q);
  b.dk = grad(p.k);
  b.dv = grad(p.v);
  b.dw = grad(p.w);
  b.dbeta = grad(p.beta);
  b.dg = grad(p.g);
  b.dq.dtype = b.dk.dtype = b.dv.dtype = p.q.dtype;
  path_attn_bwd(b);
  return 0;
}
