// core/problem.h: the validated, backend-neutral description of one call. Every entry point validates its
// params into a Problem before any backend touches memory (docs/spec.md); backends read only this.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pathattn/attention.h"
#include "pathattn/decode.h"
#include "pathattn/paged.h"

// Returns early from the enclosing function when a Status-valued expression fails.
#define PA_TRY(expr)            \
  do {                          \
    ::pathattn::Status _pa_s = (expr); \
    if (!_pa_s.ok()) return _pa_s;    \
  } while (0)

namespace pathattn::core {

// One independent sequence: batch row b, positions [t0, t0 + len) of that row.
struct Seq {
  int64_t b = 0, t0 = 0, len = 0;
};

struct Problem {
  int64_t B = 0, T = 0, HQ = 0, H = 0, K = 0, V = 0;
  int64_t group = 1;  // HQ / H
  bool path = false;  // w and beta present (PaTH); false: plain causal softmax attention
  bool gate = false;  // g present (FoX / PaTH-FoX)
  bool f64 = false;   // q, k, v are f64: compute, lse and the cache in fp64 (CPU backends only)
  double scale = 0, gate_scale = 0;
  Backend backend = Backend::cpu;  // resolved: never automatic
  std::vector<Seq> seqs;           // non-empty work items (empty varlen sequences are dropped)
  int64_t num_seqs = 0;            // number of sequences including empty ones (B, or N for varlen)
};

// Validate and describe a forward / backward call. On error the returned Status names the argument.
Status check_fwd(const PathFwdParams& p, Problem* out);
Status check_bwd(const PathBwdParams& p, Problem* out);
// The part of check_fwd before the outputs: inputs, options and sequences (no value scan).
Status check_fwd_inputs(const PathFwdParams& p, Problem* out);

// Shared by the decode entry points: validates the cache views against a problem's H, HQ, K, V, dtype.
// `num_seqs` is the number of cache slots expected; `need_room` requires lengths[n] < capacity.
Status check_cache(const DecodeCache& c, const Problem& pr, int64_t num_seqs, bool need_room);

// The paged cache's sizes, from its validated views (include/pathattn/paged.h): N slots, a pool of P pages of
// `page` rows, max_pages block-table entries per slot, S pending rows per slot.
struct PagedGeometry {
  int64_t N = 0, P = 0, page = 1, max_pages = 0, S = 1;
  int64_t capacity() const { return max_pages * page; }
};

// Validates the paged cache's views against a problem's H, HQ, K, V, gate and path and v's dtype: shapes,
// dtypes, devices (the backend's), contiguous last dims, 1 <= S <= kPagedMaxPending. `num_slots` is the N
// expected (-1: any, taken from block_table). Reads the views' headers only (validate_paged.cpp).
Status check_paged_cache(const PagedCache& c, const Problem& pr, DType v_dtype, int64_t num_slots, PagedGeometry* g);

// The paged cache's metadata checks, on host copies. paged_slot_error: slot n (length len, flush point m,
// block-table row `row` of g.max_pages entries) before a decode call of T tokens each; "" when the slot is free
// (len == -1) or can take them, else the reason naming the argument. `path`: the pending buffer is used (without
// it m must equal len). paged_rows_error: slot n's rows [0, rows) fit its capacity and lie in pages of the pool.
std::string paged_slot_error(const PagedGeometry& g, bool path, int64_t T, int64_t n, int64_t len, int64_t m,
                             const int32_t* row);
std::string paged_rows_error(const PagedGeometry& g, int64_t n, int64_t rows, const int32_t* row);

// Opt-in validating mode: non-finite values, beta outside [0, 2], | ||w_t|| - 1 | > 1e-2.
Status check_values(const Problem& pr, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& w, const TensorView& beta, const TensorView& g);

// cu_seqlens (optional) against a batch of B rows of T tokens: the non-empty sequences into *seqs and the count,
// empty ones included, into *num_seqs. The messages name cu_seqlens.
Status check_seqs(const TensorView& cu, int64_t B, int64_t T, std::vector<Seq>* seqs, int64_t* num_seqs);

// Helpers for error messages and shape checks, also used by the other entry points.
std::string shape_str(const TensorView& x);
Status tensor_check(const char* name, const TensorView& x, int ndim, const int64_t* shape,
                    const char* dims_doc);
Status dtype_check(const char* name, const TensorView& x, DType expected);

}  // namespace pathattn::core
