// core/validate_paged.cpp: validation of the paged decode cache (include/pathattn/paged.h): its views against
// the step's problem, and the metadata (lengths, flush points, block tables) on host copies. Each failure is
// invalid_argument naming the argument.
#include <string>

#include "core/problem.h"

namespace pathattn::core {
namespace {

Status bad(const std::string& m) { return Status(Status::Code::invalid_argument, m); }

// A cache view: shape (entries < 0: any), dtype and the backend's device.
Status view_check(const char* name, const TensorView& x, int ndim, const int64_t* shape, const char* doc, DType dt,
                  Device dev) {
  PA_TRY(tensor_check(name, x, ndim, shape, doc));
  PA_TRY(dtype_check(name, x, dt));
  if (x.device != dev) {
    return bad(std::string(name) + ": tensor is on the " + (x.device == Device::cuda ? "cuda" : "cpu") +
               " device but the backend needs " + (dev == Device::cuda ? "cuda" : "cpu") + " tensors");
  }
  return Status::Ok();
}

}  // namespace

Status check_paged_cache(const PagedCache& c, const Problem& pr, DType v_dtype, int64_t num_slots, PagedGeometry* g) {
  const Device dev = pr.backend == Backend::cuda ? Device::cuda : Device::cpu;
  if (!c.k_pages.present()) return bad("cache.k_pages: required [P, page, H, K] but absent");
  if (c.k_pages.dtype != DType::f16 && c.k_pages.dtype != DType::f32) {
    return bad(std::string("cache.k_pages: expected dtype float16 or float32, got ") + dtype_name(c.k_pages.dtype));
  }
  int64_t ks[4] = {-1, -1, pr.H, pr.K};
  PA_TRY(view_check("cache.k_pages", c.k_pages, 4, ks, "[P, page, H, K]", c.k_pages.dtype, dev));
  g->P = c.k_pages.shape[0];
  g->page = c.k_pages.shape[1];
  if (g->page < 1) return bad("cache.k_pages: the page size (shape[1]) must be at least 1, got " + shape_str(c.k_pages));
  int64_t vs[4] = {g->P, g->page, pr.H, pr.V};
  PA_TRY(view_check("cache.v_pages", c.v_pages, 4, vs, "[P, page, H, V]", v_dtype, dev));  // the dtype of v
  if (pr.gate) {
    if (!c.g_pages.present()) return bad("cache.g_pages: g is given but the cache has no gate pages [P, page, HQ]");
    int64_t gs[3] = {g->P, g->page, pr.HQ};
    PA_TRY(view_check("cache.g_pages", c.g_pages, 3, gs, "[P, page, HQ]", DType::f64, dev));
  } else if (c.g_pages.present()) {
    return bad("cache.g_pages: the cache has gate pages but g is absent (pass g, or build the cache without g_pages)");
  }
  if (!c.block_table.present()) return bad("cache.block_table: required [N, max_pages] but absent");
  int64_t bs[2] = {num_slots, -1};
  PA_TRY(view_check("cache.block_table", c.block_table, 2, bs, "[N, max_pages]", DType::i32, dev));
  g->N = c.block_table.shape[0];
  g->max_pages = c.block_table.shape[1];
  int64_t ls[1] = {g->N};
  PA_TRY(view_check("cache.lengths", c.lengths, 1, ls, "[N]", DType::i32, dev));
  PA_TRY(view_check("cache.flushed", c.flushed, 1, ls, "[N]", DType::i32, dev));
  if (!c.pend_k.present()) return bad("cache.pend_k: required [N, S, H, K] but absent");
  int64_t pk[4] = {g->N, -1, pr.H, pr.K};
  PA_TRY(view_check("cache.pend_k", c.pend_k, 4, pk, "[N, S, H, K]", DType::f32, dev));
  g->S = c.pend_k.shape[1];
  if (g->S < 1 || g->S > kPagedMaxPending) {
    return bad("cache.pend_k: the pending capacity S = " + std::to_string(g->S) + " (shape[1]) must be in [1, " +
               std::to_string(kPagedMaxPending) + "]");
  }
  if (pr.path) {
    if (!c.pend_w.present() || !c.pend_beta.present()) {
      return bad(std::string(c.pend_w.present() ? "cache.pend_beta" : "cache.pend_w") +
                 ": w and beta are given, so the cache needs pend_w [N, S, H, K] and pend_beta [N, S, H]");
    }
    int64_t pw[4] = {g->N, g->S, pr.H, pr.K};
    int64_t pb[3] = {g->N, g->S, pr.H};
    PA_TRY(view_check("cache.pend_w", c.pend_w, 4, pw, "[N, S, H, K]", DType::f32, dev));
    PA_TRY(view_check("cache.pend_beta", c.pend_beta, 3, pb, "[N, S, H]", DType::f32, dev));
  } else if (c.pend_w.present() || c.pend_beta.present()) {
    return bad(std::string(c.pend_w.present() ? "cache.pend_w" : "cache.pend_beta") +
               ": given, but w and beta are absent (plain attention keeps no pending factors)");
  }
  return Status::Ok();
}

std::string paged_rows_error(const PagedGeometry& g, int64_t n, int64_t rows, const int32_t* row) {
  const std::string slot = "slot " + std::to_string(n);
  if (rows > g.capacity()) {
    return "cache.block_table: " + slot + " needs " + std::to_string(rows) + " rows, more than its capacity of " +
           std::to_string(g.capacity()) + " (max_pages " + std::to_string(g.max_pages) + " x page " +
           std::to_string(g.page) + ")";
  }
  const int64_t pages = (rows + g.page - 1) / g.page;
  for (int64_t i = 0; i < pages; ++i) {
    if (row[i] < 0 || row[i] >= g.P) {
      return "cache.block_table: " + slot + " page " + std::to_string(i) + " is " + std::to_string(row[i]) +
             ", outside the pool of " + std::to_string(g.P) + " pages";
    }
  }
  return "";
}

std::string paged_slot_error(const PagedGeometry& g, bool path, int64_t T, int64_t n, int64_t len, int64_t m,
                             const int32_t* row) {
  const std::string slot = "slot " + std::to_string(n);
  if (len == -1) return "";  // free: a step skips it
  if (len < -1) return "cache.lengths: " + slot + " has length " + std::to_string(len) + "; expected -1 (free) or >= 0";
  if (len + T > g.capacity()) {
    return "cache.lengths: " + slot + " holds " + std::to_string(len) + " tokens and the call adds " +
           std::to_string(T) + ", beyond its capacity of " + std::to_string(g.capacity()) + " (max_pages " +
           std::to_string(g.max_pages) + " x page " + std::to_string(g.page) + ")";
  }
  if (m > len || m < 0) {
    return "cache.flushed: " + slot + "'s flush point " + std::to_string(m) + " is outside [0, length " +
           std::to_string(len) + "]";
  }
  if (len - m > (path ? g.S : 0)) {
    if (!path) {
      return "cache.flushed: " + slot + "'s flush point " + std::to_string(m) + " differs from its length " +
             std::to_string(len) + ", but plain attention (no w) keeps no pending tokens";
    }
    return "cache.flushed: " + slot + " has " + std::to_string(len - m) + " pending tokens (length " +
           std::to_string(len) + " - flushed " + std::to_string(m) + "), more than S = " + std::to_string(g.S) +
           " (pend_k.shape[1])";
  }
  return paged_rows_error(g, n, len + T, row);
}

}  // namespace pathattn::core
