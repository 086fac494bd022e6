// tests/fuzz/fuzz_paged.cpp: libFuzzer target for the paged decode cache's entry (path_attn_paged_decode) on the
// host backends: the input bytes choose the geometry (slots, heads, pages, pending rows), every metadata value
// (lengths, flush points, block-table entries, in and out of range), the dtypes and some broken shapes. Every
// buffer has exactly its view's size, so a call must be refused by name or stay in bounds (the sanitizers watch);
// with validation off, bad metadata must be skipped, never followed.
#include <cstdint>
#include <vector>

#include "fuzz_bytes.h"
#include "pathattn/pathattn.h"

using namespace pathattn;

namespace {

struct Pool {
  std::vector<std::vector<double>> bufs;  // 8-byte elements: room for any dtype
  TensorView view(std::vector<int64_t> shape, DType dt, double fill) {
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d > 0 ? d : 0;
    bufs.emplace_back(size_t(numel > 0 ? numel : 1), 0.0);
    TensorView v;
    v.data = bufs.back().data();
    v.dtype = dt;
    v.ndim = int(shape.size());
    int64_t st = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[d] = shape[size_t(d)];
      v.stride[d] = st;
      st *= shape[size_t(d)] > 0 ? shape[size_t(d)] : 1;
    }
    if (dt == DType::f32) {
      float* f = static_cast<float*>(v.data);
      for (int64_t i = 0; i < numel; ++i) f[i] = float(fill);
    } else if (dt == DType::f64) {
      for (int64_t i = 0; i < numel; ++i) bufs.back()[size_t(i)] = fill;
    }
    return v;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in{data, size};
  Pool pool;
  pool.bufs.reserve(24);
  const int64_t N = in.small(3), T = in.small(3), H = 1 + in.small(1), HQ = H * (1 + in.small(1));
  const int64_t K = 8 * (1 + in.small(1)), V = 8 * (1 + in.small(1));
  const int64_t page = 1 + in.small(7), max_pages = in.small(6), P = in.small(12);
  int64_t S = 1 + in.small(3);
  const uint8_t flags = in.next();
  const bool path = flags & 1, gate = flags & 2, validate = !(flags & 4), f16_keys = flags & 8;
  if (flags % 23 == 16) S = in.small(80);  // out of range
  const double x = double(int(in.next()) - 128) / 64;
  PathPagedDecodeParams p;
  p.q = pool.view({N, T, HQ, K}, DType::f32, x);
  p.k = pool.view({N, T, H, K}, DType::f32, -x);
  p.v = pool.view({N, T, H, V}, DType::f32, 0.5);
  if (path) {
    p.w = pool.view({N, T, H, K}, DType::f32, 0.25);
    p.beta = pool.view({N, T, H}, DType::f32, double(in.small(4)) / 2);
  }
  if (gate) p.g = pool.view({N, T, HQ}, DType::f32, -0.1);
  p.o = pool.view({N, T, HQ, V}, DType::f32, 0);
  if (flags & 16) p.lse = pool.view({N, T, HQ}, DType::f32, 0);
  PagedCache& c = p.cache;
  c.k_pages = pool.view({P, page, H, K}, f16_keys ? DType::f16 : DType::f32, 0.125);
  c.v_pages = pool.view({P, page, H, V}, DType::f32, 1);
  if (gate != bool(flags & 32)) c.g_pages = pool.view({P, page, HQ}, DType::f64, 0);  // sometimes on one side only
  c.block_table = pool.view({N, max_pages}, DType::i32, 0);
  c.lengths = pool.view({N}, DType::i32, 0);
  c.flushed = pool.view({N}, DType::i32, 0);
  c.pend_k = pool.view({N, S, H, K}, DType::f32, 0.3);
  if (path) {
    c.pend_w = pool.view({N, S, H, K}, DType::f32, 0.25);
    c.pend_beta = pool.view({N, S, H}, DType::f32, 1);
  }
  int32_t* bt = static_cast<int32_t*>(c.block_table.data);
  for (int64_t i = 0; i < N * max_pages; ++i) bt[i] = int32_t(in.small(P + 3)) - 1;  // -1 .. P + 1
  int32_t* len = static_cast<int32_t*>(c.lengths.data);
  int32_t* fl = static_cast<int32_t*>(c.flushed.data);
  for (int64_t n = 0; n < N; ++n) {
    len[n] = int32_t(in.small(44)) - 2;  // -2 .. 42: free (-1), bad (-2), in and past capacity
    fl[n] = in.next() & 1 ? len[n] - int32_t(in.small(5)) : int32_t(in.small(44)) - 2;
  }
  if (flags % 29 == 7) c.v_pages.shape[3] += 1;        // a broken shape
  if (flags % 31 == 9) c.block_table.dtype = DType::i64;  // a wrong dtype
  p.validate = validate;
  p.backend = flags & 64 ? Backend::oracle : Backend::cpu;
  p.num_threads = 1;
  path_attn_paged_decode(p);
  return 0;
}
