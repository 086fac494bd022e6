// api/paged.cpp: the public entries of the paged decode cache (include/pathattn/paged.h). Each validates the
// step as a forward problem, then the cache's views and (prefill always, decode when asked) its metadata on
// host copies, then runs cpu/paged.cpp (oracle and cpu backends) or cuda/kernels/paged_step.cu and paged_prefill.cu.
#include <algorithm>
#include <string>
#include <vector>

#include "api/inference.h"
#include "core/problem.h"
#include "cpu/cpu_backend.h"
#ifdef PATHATTN_WITH_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace pathattn {
namespace {

Status bad(const std::string& m) { return Status(Status::Code::invalid_argument, m); }

#ifndef PATHATTN_WITH_CUDA
Status no_cuda() {
  return Status(Status::Code::unavailable, "backend: cuda was requested but this build of pathattn has no CUDA backend");
}
#endif

// The paged cache's pages hold fp32 or fp16 keys: fp64 inputs have no place in them.
Status refuse_f64(const core::Problem& pr) {
  if (!pr.f64) return Status::Ok();
  return Status(Status::Code::unsupported,
                "q: float64 inputs are not supported by the paged cache (its key pages are float16 or float32); "
                "use the dense DecodeCache (decode.h) for fp64");
}

// Host copies of the metadata: lengths and flushed [N], the block table [N, max_pages] with dense rows. CPU
// views are read in place; CUDA views are copied after the stream's earlier work (a wait on the stream).
struct HostMeta {
  std::vector<int32_t> len, flushed, table;
};

Status read_i32(const TensorView& x, int64_t rows, int64_t cols, void* stream, std::vector<int32_t>* out) {
  out->assign(size_t(rows * cols), 0);
  if (rows == 0 || cols == 0) return Status::Ok();
  const int64_t rs = x.ndim == 2 ? x.stride[0] : cols;  // 1-D views are contiguous (checked)
  std::vector<int32_t> buf;
  const int32_t* src = static_cast<const int32_t*>(x.data);
  if (x.device == Device::cuda) {
#ifdef PATHATTN_WITH_CUDA
    const int64_t span = (rows - 1) * rs + cols;  // elements from the first to the last one read
    buf.resize(size_t(span));
    PA_TRY(cuda::copy_to_host(buf.data(), x.data, size_t(span) * sizeof(int32_t), stream));
    src = buf.data();
#else
    return no_cuda();
#endif
  }
  for (int64_t r = 0; r < rows; ++r) std::copy(src + r * rs, src + r * rs + cols, out->begin() + r * cols);
  return Status::Ok();
}

Status read_meta(const PagedCache& c, const core::PagedGeometry& g, void* stream, bool table_only, HostMeta* m) {
  PA_TRY(read_i32(c.block_table, g.N, g.max_pages, stream, &m->table));
  if (table_only) return Status::Ok();
  PA_TRY(read_i32(c.lengths, 1, g.N, stream, &m->len));
  return read_i32(c.flushed, 1, g.N, stream, &m->flushed);
}

// The slot of each sequence: `slots` ([num_seqs] i32, host memory; distinct, in [0, N)) or sequence n -> slot n.
Status resolve_slots(const TensorView& s, int64_t num_seqs, int64_t N, std::vector<int32_t>* out) {
  out->clear();
  if (!s.present()) {
    if (num_seqs > N) {
      return bad("cache.block_table: the cache has " + std::to_string(N) + " slots (block_table.shape[0]) but the "
                 "forward has " + std::to_string(num_seqs) + " sequences (pass slots to choose them)");
    }
    for (int64_t n = 0; n < num_seqs; ++n) out->push_back(int32_t(n));
    return Status::Ok();
  }
  int64_t shape[1] = {num_seqs};
  PA_TRY(core::tensor_check("slots", s, 1, shape, "[num_seqs]"));
  PA_TRY(core::dtype_check("slots", s, DType::i32));
  if (s.device != Device::cpu) return bad("slots: must be in host memory");
  std::vector<bool> used(size_t(N), false);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int32_t v = static_cast<const int32_t*>(s.data)[i * s.stride[0]];
    if (v < 0 || v >= N) {
      return bad("slots: entry " + std::to_string(i) + " is " + std::to_string(v) + ", outside the cache's " +
                 std::to_string(N) + " slots");
    }
    if (used[size_t(v)]) return bad("slots: slot " + std::to_string(v) + " is given twice");
    used[size_t(v)] = true;
    out->push_back(v);
  }
  return Status::Ok();
}

}  // namespace

// Prefill: the forward's checks, the cache's views, the slots, and each sequence's rows against its slot's
// capacity and block table (read on the host: prefill is never captured in a graph); then the forward and the
// scatter into pages.
Status path_attn_paged_prefill(const PathPagedPrefillParams& p) {
  core::Problem pr;
  PA_TRY(core::check_fwd(p.fwd, &pr));
  PA_TRY(refuse_f64(pr));
  core::PagedGeometry g;
  PA_TRY(core::check_paged_cache(p.cache, pr, p.fwd.v.dtype, -1, &g));
  std::vector<int32_t> slots;
  PA_TRY(resolve_slots(p.slots, pr.num_seqs, g.N, &slots));
  const std::vector<core::Seq> seqs = api::all_seqs(p.fwd, pr);
  HostMeta meta;
  PA_TRY(read_meta(p.cache, g, p.fwd.stream, /*table_only=*/true, &meta));
  for (size_t i = 0; i < seqs.size(); ++i) {
    const std::string e = core::paged_rows_error(g, slots[i], seqs[i].len, meta.table.data() + slots[i] * g.max_pages);
    if (!e.empty()) return bad(e + " (sequence " + std::to_string(i) + ")");
  }
  if (pr.backend == Backend::cuda) {
#ifdef PATHATTN_WITH_CUDA
    return cuda::paged_prefill(p, pr, seqs, slots);  // the forward, the pages and the metadata
#else
    return no_cuda();
#endif
  }
  PA_TRY(path_attn_fwd(p.fwd));
  return cpu::paged_prefill(p, pr, seqs, slots);
}

// Decode: the step's inputs are a forward problem with B = N slots of T tokens, so check_fwd validates them;
// then the cache's views with N = B, and with p.validate its metadata, before anything is written.
Status path_attn_paged_decode(const PathPagedDecodeParams& p) {
  const PathFwdParams f = api::step_as_fwd(p);
  core::Problem pr;
  PA_TRY(core::check_fwd(f, &pr));
  PA_TRY(refuse_f64(pr));
  core::PagedGeometry g;
  PA_TRY(core::check_paged_cache(p.cache, pr, p.v.dtype, pr.B, &g));
  if (p.validate) {
    HostMeta meta;
    PA_TRY(read_meta(p.cache, g, p.stream, /*table_only=*/false, &meta));
    for (int64_t n = 0; n < g.N; ++n) {
      const std::string e = core::paged_slot_error(g, pr.path, pr.T, n, meta.len[n], meta.flushed[n],
                                                   meta.table.data() + n * g.max_pages);
      if (!e.empty()) return bad(e);
    }
  }
  if (pr.backend == Backend::cuda) {
#ifdef PATHATTN_WITH_CUDA
    return cuda::paged_decode(p, pr);
#else
    return no_cuda();
#endif
  }
  return cpu::paged_decode(p, pr);
}

}  // namespace pathattn
