// api/inference.h: what the dense and the paged cache's entries (api/decode.cpp, api/paged.cpp) share: a decode
// call's inputs as the forward problem they are, and a prefill's sequences in slot order.
#pragma once

#include <vector>

#include "core/convert.h"
#include "core/problem.h"
#include "pathattn/attention.h"

namespace pathattn::api {

// A decode call's inputs (PathDecodeParams, PathPagedDecodeParams) as a forward with B = slots, T tokens a slot,
// so that check_fwd validates them the way it validates a forward.

template <class P>
PathFwdParams step_as_fwd(const P& p) {
  PathFwdParams f;
  f.q = p.q;
  f.k = p.k;
  f.v = p.v;
  f.w = p.w;
  f.beta = p.beta;
  f.g = p.g;
  f.scale = p.scale;
  f.gate_scale = p.gate_scale;
  f.o = p.o;
  f.lse = p.lse;
  f.backend = p.backend;
  f.num_threads = p.num_threads;
  f.stream = p.stream;
  return f;
}

// Every sequence of a validated forward, empty ones included, in order: batch row n, or varlen sequence n.
inline std::vector<core::Seq> all_seqs(const PathFwdParams& p, const core::Problem& pr) {
  std::vector<core::Seq> out;
  if (p.cu_seqlens.present()) {
    const TensorView& cu = p.cu_seqlens;
    for (int64_t n = 0; n < pr.num_seqs; ++n) {
      const int64_t a = core::load_elem<int64_t>(cu.data, cu.dtype, n * cu.stride[0]);
      const int64_t b = core::load_elem<int64_t>(cu.data, cu.dtype, (n + 1) * cu.stride[0]);
      out.push_back({0, a, b - a});
    }
  } else {
    for (int64_t b = 0; b < pr.B; ++b) out.push_back({b, 0, pr.T});
  }
  return out;
}

}  // namespace pathattn::api
