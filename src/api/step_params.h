// api/step_params.h: a decode call's inputs (PathDecodeParams, PathPagedDecodeParams) as the forward problem they
// are (B = slots, T tokens a slot), so that check_fwd validates them the way it validates a forward.
#pragma once

#include "pathattn/attention.h"

namespace pathattn::api {

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

}  // namespace pathattn::api
