// cuda/planner.cu: the chunk tables, the far kernels' tile lists and parking tables, the workspace limit and the
// side streams of sliced calls (planner.h).
#include "cuda/planner.h"

#include <cstdio>

#include "cuda/profile.h"

namespace pathattn::cuda {

int64_t longest_seq(const core::Problem& pr) {
  int64_t n = 0;
  for (const core::Seq& s : pr.seqs) n = std::max(n, s.len);
  return n;
}

Tables build_tables(const core::Problem& pr, int sc) {
  Tables t;
  for (const core::Seq& s : pr.seqs) {
    const int nc = int((s.len + kChunk - 1) / kChunk);
    const int first = int(t.chunks.size()), sfirst = int(t.super_first.size());
    t.seq_first.push_back(first);
    t.max_chunks = std::max(t.max_chunks, nc);
    for (int c = 0; c < nc; ++c) t.chunks.push_back({s.b, s.t0, int32_t(s.len), c, first, sfirst});
    // Superblocks that some later query reaches across (sb ends before the sequence does): a query in
    // superblock a uses the keys and products of superblocks sb < a only, so the last one never counts.
    const int64_t super_len = int64_t(sc) * kChunk;
    for (int sb = 0; (sb + 1) * super_len < s.len; ++sb) t.super_first.push_back(first + sb * sc);
  }
  t.order.resize(t.chunks.size());
  for (size_t i = 0; i < t.order.size(); ++i) t.order[i] = int32_t(i);
  std::stable_sort(t.order.begin(), t.order.end(),
                   [&](int32_t a, int32_t b) { return t.chunks[a].c > t.chunks[b].c; });
  return t;
}

// Chunk-table order among tiles of equal work: the four tiles of a superblock read the same far key (query)
// stream, so their CTAs, launched together, share it in L2 (docs/cuda.md).
std::vector<int32_t> order_far_tiles(std::vector<int32_t> tiles, const std::vector<int>& work) {
  std::vector<int32_t> idx(tiles.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int32_t(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return work[size_t(a)] > work[size_t(b)]; });
  std::vector<int32_t> out(tiles.size());
  for (size_t i = 0; i < idx.size(); ++i) out[i] = tiles[size_t(idx[i])];
  return out;
}

std::vector<int32_t> far_query_tiles(const Tables& t, int sc) {
  std::vector<int32_t> tiles;
  std::vector<int> work;
  for (size_t i = 0; i < t.chunks.size(); ++i)
    if (t.chunks[i].c >= sc && t.chunks[i].c % 2 == 0) {
      tiles.push_back(int32_t(i));
      work.push_back(t.chunks[i].c / sc);
    }
  return order_far_tiles(std::move(tiles), work);
}

int key_tile_walk(const ChunkDesc& c, int sc) { return ((c.len + kChunk - 1) / kChunk - 1) / sc - c.c / sc; }

std::vector<int32_t> far_park_first(const std::vector<int>& slots, int heads, int grid) {
  std::vector<int32_t> first(size_t(grid) + 1, 0);
  for (int c = 0; c < grid; ++c) first[size_t(c) + 1] = first[size_t(c)] + slots[size_t(c / heads)];
  return first;
}

int64_t workspace_limit(int64_t requested, const TensorView& q, const TensorView& k, const TensorView& v) {
  if (requested > 0) return requested;
  const int64_t inputs = (q.numel() + k.numel() + v.numel()) * dtype_size(q.dtype);
  return std::max<int64_t>(kDefaultWorkspaceFloor, inputs);
}

namespace {

// The side streams of one host thread, one per device. Per thread, so that calls from several threads (or a
// graph capture on one of them) never share one; kept, because a new stream a call cost 0.4 .. 0.9 ms.
class SideStreams {
 public:
  ~SideStreams() {
    for (cudaStream_t s : streams_)
      if (s) cudaStreamDestroy(s);  // errors ignored: at process exit the runtime may be gone already
  }
  cudaError_t get(cudaStream_t* out) {
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (streams_.size() <= size_t(dev)) streams_.resize(size_t(dev) + 1, nullptr);
    if (streams_[size_t(dev)] == nullptr) {
      e = cudaStreamCreateWithFlags(&streams_[size_t(dev)], cudaStreamNonBlocking);
      if (e != cudaSuccess) return e;
    }
    *out = streams_[size_t(dev)];
    return cudaSuccess;
  }

 private:
  std::vector<cudaStream_t> streams_;
};

}  // namespace

cudaError_t thread_side_stream(cudaStream_t* out) {
  static thread_local SideStreams streams;
  return streams.get(out);
}

Status SideStream::open() {
  PA_CU(thread_side_stream(&side_));
  PA_CU(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
  PA_CU(cudaEventRecord(ev_, main_));
  PA_CU(cudaStreamWaitEvent(side_, ev_, 0));
  return Status::Ok();
}

SideStream::~SideStream() {
  if (side_ && ev_ && cudaEventRecord(ev_, side_) == cudaSuccess) cudaStreamWaitEvent(main_, ev_, 0);
  if (ev_) cudaEventDestroy(ev_);
}

void report_plan(const CallPlan& cp) {
  if (!profile_enabled()) return;
  const core::Slice& sl = cp.lanes.slices[0];
  std::fprintf(stderr,
               "[slices] %zu of %lld rows x %lld kv heads, %d stream(s), block %.1f MiB (limit %.1f, one slice "
               "%.1f)\n",
               cp.lanes.slices.size(), static_cast<long long>(sl.nb), static_cast<long long>(sl.nh), cp.lanes.lanes,
               double(cp.lanes.block) / (1 << 20), double(cp.limit) / (1 << 20), double(cp.whole_bytes) / (1 << 20));
}

}  // namespace pathattn::cuda
