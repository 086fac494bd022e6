// core/slicing.h: one call as independent slices of kv heads (with their query heads) and batch rows: the
// views, sub-problems and plan the CUDA backend's workspace limit runs a call in. Host-only and
// backend-neutral (tested on the CPU backend: a call's slices reproduce the whole call).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/problem.h"

namespace pathattn::core {

struct Slice {
  int64_t b0, nb, h0, nh;  // batch rows [b0, b0 + nb), kv heads [h0, h0 + nh)
};

// x restricted to batch rows [b0, b0 + nb) (dimension 0) and heads [h0, h0 + nh) (dimension 2); absent views
// (and views of fewer than 3 dimensions, e.g. cu_seqlens) are returned unchanged.
TensorView sub_view(const TensorView& x, int64_t b0, int64_t nb, int64_t h0, int64_t nh);

// The problem of one slice: H = nh, HQ = nh x group; with fewer batch rows, the rows' sequences renumbered.
Problem sub_problem(const Problem& pr, const Slice& sl);

// The params of one slice: every tensor viewed at the slice (query-head tensors at the kv heads' query heads).
PathFwdParams sub_params(const PathFwdParams& p, const Problem& pr, const Slice& sl);
PathBwdParams sub_params(const PathBwdParams& p, const Problem& pr, const Slice& sl);

// The slices of a call: all of it when cost(all) <= limit; else as few slices of kv heads as fit; when one
// kv head does not fit and batch_ok (rows of separate sequences: no cu_seqlens), as few slices of batch rows
// of one head as fit; a (row, head) slice that does not fit runs anyway. Slices are as even as their number
// allows, the larger ones first (their sizes differ by one at most: 8 rows in two slices of at most 6 are 4 + 4,
// not 6 + 2; 16 heads in slices of at most 3 are 3 + 3 + 3 + 3 + 2 + 2, not five of 3 and a short one, which
// one stream would run alone at the end).
// cost(Slice) must grow with both counts.
// by_pairs: where kv-head slices are needed and batch_ok, slices of batch rows with every head are planned too,
// and the plan whose first slice holds more (row, head) pairs is taken (kv heads on a tie). A backend whose
// whole-head slices cost less a pair (the CUDA backward keeping workspace in their output memory) asks for it.
template <class Cost>
std::vector<Slice> plan_slices(const Problem& pr, bool batch_ok, int64_t limit, Cost cost, bool by_pairs = false) {
  auto largest = [](int64_t n, auto fits) {  // the largest m in [1, n] with fits(m), or 1
    int64_t lo = 1, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (fits(mid)) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  };
  // n split into parts of at most m: as few parts as that allows, sizes differing by one at most, larger first.
  auto parts = [](int64_t n, int64_t m) {
    const int64_t count = (n + m - 1) / m, q = n / count, r = n % count;
    std::vector<int64_t> out(size_t(count), q);
    for (int64_t i = 0; i < r; ++i) ++out[size_t(i)];
    return out;
  };
  std::vector<int64_t> heads{pr.H}, rows{pr.B};
  if (cost(Slice{0, pr.B, 0, pr.H}) > limit) {
    heads = parts(pr.H, largest(pr.H, [&](int64_t m) { return cost(Slice{0, pr.B, 0, m}) <= limit; }));
    if (heads[0] == 1 && batch_ok && cost(Slice{0, pr.B, 0, 1}) > limit)
      rows = parts(pr.B, largest(pr.B, [&](int64_t m) { return cost(Slice{0, m, 0, 1}) <= limit; }));
    if (by_pairs && batch_ok && pr.B > 1 && cost(Slice{0, 1, 0, pr.H}) <= limit) {
      const std::vector<int64_t> whole_rows =
          parts(pr.B, largest(pr.B, [&](int64_t m) { return cost(Slice{0, m, 0, pr.H}) <= limit; }));
      if (whole_rows[0] * pr.H > rows[0] * heads[0]) {
        rows = whole_rows;
        heads = {pr.H};
      }
    }
  }
  std::vector<Slice> out;
  int64_t b0 = 0;
  for (const int64_t nb : rows) {
    int64_t h0 = 0;
    for (const int64_t nh : heads) {
      out.push_back({b0, nb, h0, nh});
      h0 += nh;
    }
    b0 += nb;
  }
  return out;
}

// A plan with the streams that run it: slices taken by the streams in turn, each stream's slices sharing one
// block of `block` bytes (the first slice's cost: plan_slices puts the largest first).
struct LanePlan {
  std::vector<Slice> slices;
  int lanes = 1;
  int64_t block = 0;
};

// plan_slices on one stream, unless it needs several slices: then the most streams n in [2, max_lanes] whose
// plan for limit / n fits that share and has at least n and at most 2 n times as many slices (small slices
// leave the GPU idle in their superblock kernels and scan tails, which another stream's slice fills; a plan
// much finer than one stream's loses more to those tails than the overlap wins).
// by_pairs: as plan_slices takes it.
template <class Cost>
LanePlan plan_lanes(const Problem& pr, bool batch_ok, int64_t limit, int max_lanes, Cost cost, bool by_pairs = false) {
  LanePlan out;
  out.slices = plan_slices(pr, batch_ok, limit, cost, by_pairs);
  out.block = cost(out.slices[0]);
  if (out.slices.size() == 1) return out;
  for (int n = max_lanes; n >= 2; --n) {
    std::vector<Slice> more = plan_slices(pr, batch_ok, limit / n, cost, by_pairs);
    const int64_t bn = cost(more[0]);
    if (bn <= limit / n && more.size() >= size_t(n) && more.size() <= size_t(2 * n) * out.slices.size()) {
      out.slices = std::move(more);
      out.lanes = n;
      out.block = bn;
      break;
    }
  }
  return out;
}

}  // namespace pathattn::core
