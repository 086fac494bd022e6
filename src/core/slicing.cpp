// core/slicing.cpp: see slicing.h.
#include "core/slicing.h"

namespace pathattn::core {

TensorView sub_view(const TensorView& x, int64_t b0, int64_t nb, int64_t h0, int64_t nh) {
  if (x.data == nullptr || x.ndim < 3) return x;
  TensorView y = x;
  y.data = static_cast<char*>(x.data) + (b0 * x.stride[0] + h0 * x.stride[2]) * dtype_size(x.dtype);
  y.shape[0] = nb;
  y.shape[2] = nh;
  return y;
}

Problem sub_problem(const Problem& pr, const Slice& sl) {
  Problem q = pr;
  q.H = sl.nh;
  q.HQ = sl.nh * pr.group;
  if (sl.nb != pr.B) {
    q.B = sl.nb;
    q.num_seqs = sl.nb;
    q.seqs.clear();
    for (const Seq& sq : pr.seqs)
      if (sq.b >= sl.b0 && sq.b < sl.b0 + sl.nb) q.seqs.push_back({sq.b - sl.b0, sq.t0, sq.len});
  }
  return q;
}

namespace {

// Views of one slice: kv-head tensors take heads [h0, h0 + nh), query-head tensors the group's query heads.
struct SliceViews {
  Slice sl;
  int64_t group;
  TensorView kv(const TensorView& x) const { return sub_view(x, sl.b0, sl.nb, sl.h0, sl.nh); }
  TensorView qh(const TensorView& x) const { return sub_view(x, sl.b0, sl.nb, sl.h0 * group, sl.nh * group); }
  template <class P>
  void inputs(P& r, const P& p) const {
    r.q = qh(p.q), r.k = kv(p.k), r.v = kv(p.v), r.w = kv(p.w), r.beta = kv(p.beta), r.g = qh(p.g);
    r.o = qh(p.o), r.lse = qh(p.lse);
  }
};

}  // namespace

PathFwdParams sub_params(const PathFwdParams& p, const Problem& pr, const Slice& sl) {
  PathFwdParams r = p;
  SliceViews{sl, pr.group}.inputs(r, p);
  return r;
}

PathBwdParams sub_params(const PathBwdParams& p, const Problem& pr, const Slice& sl) {
  PathBwdParams r = p;
  const SliceViews sv{sl, pr.group};
  sv.inputs(r, p);
  r.do_ = sv.qh(p.do_);
  r.dq = sv.qh(p.dq), r.dk = sv.kv(p.dk), r.dv = sv.kv(p.dv), r.dw = sv.kv(p.dw), r.dbeta = sv.kv(p.dbeta);
  r.dg = sv.qh(p.dg);
  return r;
}

}  // namespace pathattn::core
