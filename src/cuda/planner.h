// cuda/planner.h: what a call runs on before any kernel starts: the chunk and superblock tables, the far kernels'
// tile lists and parking tables, the workspace's pieces, and the plan that splits a call over the workspace limit
// into slices on one or two streams (run_sliced). Host only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "core/slicing.h"
#include "cuda/heuristics.h"
#include "cuda/host_util.h"
#include "cuda/params.h"

namespace pathattn::cuda {

// The chunk table of a call and its orders.
struct Tables {
  std::vector<ChunkDesc> chunks;
  std::vector<int32_t> order;        // chunk indices, descending chunk index c (most scan work first)
  std::vector<int32_t> seq_first;    // each sequence's chunk 0
  std::vector<int32_t> super_first;  // first chunk of each superblock a later query reaches across
  int max_chunks = 0;
};

// The longest sequence of pr, in tokens.
int64_t longest_seq(const core::Problem& pr);

// sc: chunks per superblock (KernelParams::sc).
Tables build_tables(const core::Problem& pr, int sc);

// The host tables of one forward or backward (a call or a slice), uploaded into one workspace piece by one copy
// (one copy a table made 132 small copies in a sliced forward + backward). `add` places a table (16-byte aligned,
// at least one element) and takes what to do with its device address; `commit` allocates the piece, uploads it
// and hands out the addresses (null while measuring).
class TablePack {
 public:
  template <class E, class Set>
  void add(const std::vector<E>& v, Set set) {
    const size_t off = (bytes_.size() + 15) / 16 * 16;
    bytes_.resize(off + std::max<size_t>(v.size(), 1) * sizeof(E));
    if (!v.empty()) std::memcpy(bytes_.data() + off, v.data(), v.size() * sizeof(E));
    sets_.push_back([off, set](char* base) { set(base ? reinterpret_cast<E*>(base + off) : nullptr); });
  }
  Status commit(Workspace& ws) {
    if (bytes_.empty()) return Status::Ok();
    char* base = nullptr;
    PA_CU(ws.alloc(&base, bytes_.size()));
    PA_CU(ws.upload(base, bytes_.data(), bytes_.size()));
    for (const auto& set : sets_) set(base);
    return Status::Ok();
  }

 private:
  std::vector<uint8_t> bytes_;
  std::vector<std::function<void(char*)>> sets_;
};

// Buffers laid out in one workspace piece, each rounded as the workspace rounds its pieces; `at` places a
// buffer at an offset another buffer dead by then also uses (the piece grows to cover it).
struct Layout {
  size_t bytes = 0;
  size_t add(size_t n) {
    const size_t off = bytes;
    bytes += Workspace::rounded(n);
    return off;
  }
  size_t at(size_t off, size_t n) {
    bytes = std::max(bytes, off + Workspace::rounded(n));
    return off;
  }
};
template <typename T>
T* piece(char* base, size_t off) {
  return base ? reinterpret_cast<T*>(base + off) : nullptr;
}

// Tiles of the far kernels, most work first, the tiles of equal work of one sequence next to each other (they
// read the same far stream, which then stays in L2).
std::vector<int32_t> order_far_tiles(std::vector<int32_t> tiles, const std::vector<int>& work);
// Query tiles of the far kernels: two query chunks (an even chunk and the next) past their sequence's superblock
// 0, ordered by the superblocks they cross.
std::vector<int32_t> far_query_tiles(const Tables& t, int sc);
// Superblocks a key tile's far walk takes (bwd_k_far's work for it): its sequence's later superblocks.
int key_tile_walk(const ChunkDesc& c, int sc);
// Where each CTA of a far backward kernel parks its states (grid + 1 prefix sums, in states of 128 x K), given
// the states each tile parks (`slots`, in the kernel's tile order; items are tile x `heads`): CTA c's first item
// is item c, and the later items it takes park no more than that one.
std::vector<int32_t> far_park_first(const std::vector<int>& slots, int heads, int grid);

// The workspace limit of a call: requested > 0 itself; 0 the default (kDefaultWorkspaceFloor or the bytes of q,
// k and v, whichever is larger).
int64_t workspace_limit(int64_t requested, const TensorView& q, const TensorView& k, const TensorView& v);

// The second stream of this host thread on the current device (created on first use, kept until the thread ends).
cudaError_t thread_side_stream(cudaStream_t* out);

// The side stream for one call's slices, ordered after the caller's stream's work at open(); its work joins the
// caller's stream again on destruction (also on error returns).
class SideStream {
 public:
  explicit SideStream(cudaStream_t main) : main_(main) {}
  Status open();
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  cudaStream_t get() const { return side_; }

 private:
  cudaStream_t main_, side_ = nullptr;
  cudaEvent_t ev_ = nullptr;
};

// The slices a call runs in: `whole` (one, of the whole call: no limit, or it fits) or `lanes`.
struct CallPlan {
  bool whole = true;
  core::LanePlan lanes;
  int64_t limit = -1, whole_bytes = 0;
  // The plan keeps to the limit (a call whose smallest slice exceeds it runs over it).
  bool fits() const { return whole || lanes.block * lanes.lanes <= limit; }
};

// Plans `run` (fwd_run / bwd_run) under p's workspace limit: each slice's workspace measured by running its
// allocation sequence. by_pairs: slices of whole batch rows compete with slices of kv heads (core::plan_slices),
// for a backward that keeps workspace in the outputs of whole-row slices.
template <class P, class Run>
Status plan_call(const P& p, const core::Problem& pr, Run run, CallPlan* out, bool by_pairs = false) {
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  const int64_t limit = p.workspace_limit < 0 ? -1 : workspace_limit(p.workspace_limit, p.q, p.k, p.v);
  out->limit = limit;
  // A slice's workspace depends on its counts of batch rows and kv heads only (every batch row has the same
  // length; cu_seqlens calls slice heads only): measured once per shape, since the plans below ask often.
  Status err = Status::Ok();
  struct Measured {
    int64_t nb, nh, bytes;
  };
  std::vector<Measured> memo;
  auto cost = [&](const core::Slice& sl) -> int64_t {
    for (const Measured& x : memo)
      if (x.nb == sl.nb && x.nh == sl.nh) return x.bytes;
    Workspace m(s, true);
    const Status st = run(core::sub_params(p, pr, sl), core::sub_problem(pr, sl), m);
    if (!st.ok() && err.ok()) err = st;
    memo.push_back({sl.nb, sl.nh, int64_t(m.bytes())});
    return memo.back().bytes;
  };
  if (limit < 0) return Status::Ok();
  out->whole_bytes = cost(core::Slice{0, pr.B, 0, pr.H});
  PA_TRY(err);
  if (out->whole_bytes <= limit) return Status::Ok();
  out->whole = false;
  // Streams by core::plan_lanes (heuristics.h, max_lanes): two when the call needs several slices and the slices
  // for half the limit number at least two and at most four times one stream's; else one. The first slice of a
  // plan is its largest, so its workspace sizes the blocks.
  bool deterministic = false;
  if constexpr (std::is_same_v<P, PathBwdParams>) deterministic = p.deterministic;
  const int lanes = max_lanes(std::is_same_v<P, PathBwdParams>, deterministic, longest_seq(pr));
  const bool batch_ok = !p.cu_seqlens.present();
  out->lanes = core::plan_lanes(pr, batch_ok, limit, lanes, cost, by_pairs);
  return err;
}

// Prints a sliced call's plan to stderr where PATHATTN_CUDA_PROFILE is set (profile.h).
void report_plan(const CallPlan& cp);

// Runs `run` as `cp` says: its slices, where it has several, on two streams, the caller's and a second one,
// alternately, each slice within half the limit (small slices leave most of the GPU idle in their superblock
// kernels and scan tails; the other stream's slice fills it). Each stream's slices share one block of the largest
// slice's size, allocated once.
template <class P, class Run>
Status run_planned(const P& p, const core::Problem& pr, Run run, const CallPlan& cp) {
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  if (cp.whole) {
    Workspace ws(s);
    return run(p, pr, ws);
  }
  const std::vector<core::Slice>& slices = cp.lanes.slices;
  const int lanes = cp.lanes.lanes;
  const size_t block = size_t(cp.lanes.block);
  report_plan(cp);
  SideStream side(s);
  if (lanes > 1) PA_TRY(side.open());
  const cudaStream_t lane[2] = {s, lanes > 1 ? side.get() : s};
  Workspace blocks[2] = {Workspace(lane[0]), Workspace(lane[1])};
  uint8_t* base[2] = {};
  for (int l = 0; l < lanes; ++l) PA_CU(blocks[l].alloc(&base[l], block));
  for (size_t i = 0; i < slices.size(); ++i) {
    const int l = int(i % size_t(lanes));
    P sp = core::sub_params(p, pr, slices[i]);
    sp.stream = lane[l];
    Workspace ws(lane[l], base[l], block);
    PA_TRY(run(sp, core::sub_problem(pr, slices[i]), ws));
  }
  return Status::Ok();
}

// Runs `run` (fwd_run / bwd_run) over the slices the limit asks for.
template <class P, class Run>
Status run_sliced(const P& p, const core::Problem& pr, Run run, bool by_pairs = false) {
  CallPlan cp;
  PA_TRY(plan_call(p, pr, run, &cp, by_pairs));
  return run_planned(p, pr, run, cp);
}

}  // namespace pathattn::cuda
