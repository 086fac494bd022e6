// cuda/backend.cu: the adapter layer of the CUDA backend. Checks what the kernels support, builds the
// chunk table (host) and copies it to the device, fills KernelParams from the validated core::Problem,
// allocates the workspace stream-ordered (cudaMallocAsync: every buffer is O(T), none O(T^2)), and runs
// the launch sequence on the caller's stream.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/slicing.h"
#include "cuda/cuda_backend.h"
#include "cuda/host_util.h"
#include "cuda/launchers.h"

namespace pathattn::cuda {
namespace {

Status check_smem(size_t need, const char* what) {
  int optin = 0;
  PA_CU(device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &optin));
  if (need > size_t(optin)) {
    return unsupported(std::string("device: the cuda ") + what + " kernel needs " + std::to_string(need) +
                       " bytes of shared memory per block at this head dim; this device allows " + std::to_string(optin));
  }
  return Status::Ok();
}

struct Tables {
  std::vector<ChunkDesc> chunks;
  std::vector<int32_t> order;      // chunk indices, descending chunk index c (most scan work first)
  std::vector<int32_t> seq_first;  // each sequence's chunk 0
  std::vector<int32_t> super_first;  // first chunk of each superblock a later query reaches across
  int max_chunks = 0;
};

// The longest sequence of pr, in tokens.
int64_t longest_seq(const core::Problem& pr) {
  int64_t n = 0;
  for (const core::Seq& s : pr.seqs) n = std::max(n, s.len);
  return n;
}

// Whether some sequence of pr is longer than four superblocks of kSuperChunks (2048 tokens): the backward's
// superblock size with the gate (bwd_super_chunks), its far kernels with the gate (bwd_run) and a deterministic
// backward's stream count (plan_call) turn on it.
bool longer_than_four_superblocks(const core::Problem& pr) {
  return longest_seq(pr) > int64_t(4) * kSuperChunks * kChunk;
}

// sc: chunks per superblock (KernelParams::sc).
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

// The host tables of one forward or backward (a call or a slice), copied into one workspace piece by one copy
// (a copy a table made 132 small copies in a sliced forward + backward at K = 128, T = 8k, each a step in its
// stream's order). `add` places a table (16-byte aligned, at least one element) and takes what to do with its
// device address; `commit` allocates the piece, uploads it and hands out the addresses (null while measuring).
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

void strides3(const TensorView& v, int64_t (&s)[3]) {
  for (int i = 0; i < 3; ++i) s[i] = v.ndim > i ? v.stride[i] : 0;
}

// Fields shared by forward and backward.
void fill_inputs(KernelParams& kp, const core::Problem& pr, const TensorView& q, const TensorView& k,
                 const TensorView& v, const TensorView& w, const TensorView& beta, const TensorView& g) {
  kp.B = int(pr.B);
  kp.T = int(pr.T);
  kp.H = int(pr.H);
  kp.HQ = int(pr.HQ);
  kp.group = int(pr.group);
  kp.K = int(pr.K);
  kp.V = int(pr.V);
  kp.path = pr.path;
  kp.gate = pr.gate;
  kp.scale = float(pr.scale);
  kp.gate_scale = float(pr.gate_scale);
  kp.q = q.data;
  kp.k = k.data;
  kp.v = v.data;
  strides3(q, kp.q_s);
  strides3(k, kp.k_s);
  strides3(v, kp.v_s);
  kp.w = pr.path ? static_cast<const float*>(w.data) : nullptr;
  kp.beta = pr.path ? static_cast<const float*>(beta.data) : nullptr;
  kp.g = pr.gate ? static_cast<const float*>(g.data) : nullptr;
  if (pr.path) {
    strides3(w, kp.w_s);
    strides3(beta, kp.beta_s);
  }
  if (pr.gate) strides3(g, kp.g_s);
}

// Device copies of the tables plus the forward's workspace (also recomputed by the backward).
// The tables go into `tables` (their addresses reach kp and *seq_first_dev at its commit). kt_at: memory the
// caller gives k~ (the backward's output memory, OutputHost), else allocated here.
Status alloc_common(Workspace& ws, KernelParams& kp, const Tables& t, const core::Problem& pr, TablePack& tables,
                    int32_t** seq_first_dev, void* kt_at = nullptr) {
  const size_t NT = size_t(pr.B) * pr.T, H = pr.H, HQ = pr.HQ, K = pr.K;
  tables.add(t.chunks, [&kp](const ChunkDesc* d) { kp.chunks = d; });
  tables.add(t.order, [&kp](const int32_t* d) { kp.order = d; });
  tables.add(t.seq_first, [seq_first_dev](int32_t* d) { *seq_first_dev = d; });
  kp.nchunks = int(t.chunks.size());
  kp.max_chunks = t.max_chunks;
  PA_CU(ws.alloc(&kp.w16, NT * H * K));
  PA_CU(ws.alloc(&kp.w2h, NT * H * K));
  __half* kt = static_cast<__half*>(kt_at);
  if (kt == nullptr) PA_CU(ws.alloc(&kt, NT * H * K));
  kp.kt = kt;
  PA_CU(ws.alloc(&kp.qtl, NT * HQ * K));
  PA_CU(ws.alloc(&kp.aloc, NT * HQ * kChunk));
  if (pr.gate) {
    PA_CU(ws.alloc(&kp.G, NT * HQ));
    PA_CU(ws.alloc(&kp.gc, size_t(kp.nchunks) * HQ * kChunk));
  }
  return Status::Ok();
}

// Two-level scan (PaTH only): the superblock table and the superblock products. The keys moved to their
// superblock's end (kp.ks, [NT, H, K]) are the caller's to place (the backward shares their memory).
Status alloc_super(Workspace& ws, KernelParams& kp, const Tables& t, const core::Problem& pr, TablePack& tables) {
  kp.nsuper = pr.path ? int(t.super_first.size()) : 0;
  if (kp.nsuper == 0) return Status::Ok();
  tables.add(t.super_first, [&kp](const int32_t* d) { kp.super_first = d; });
  PA_CU(ws.alloc(&kp.ps, size_t(kp.nsuper) * pr.H * pr.K * pr.K));
  return Status::Ok();
}

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

int dtype_code(DType d) { return d == DType::f16 ? 0 : 1; }

// The far kernels (fwd_far.cu, bwd_q_far.cu, bwd_k_far.cu) run only when some sequence has more than two
// superblocks: with at most one far superblock per query the split costs more than it saves (BENCH.md shapes at
// T = 1k, K = 128: forward 3.86 -> 4.28 ms; forward+backward at the default limit 22.24 -> 22.71 ms with the
// key side's: its extra launches per one-head slice).
bool far_worth_it(const KernelParams& kp, const Tables& t) { return kp.nsuper > 0 && t.max_chunks > 2 * kp.sc; }

// Tiles of the far kernels, most work first, and the tiles of equal work of one sequence next to each other
// (chunk-table order among equals): the four tiles of a superblock read the same far key (query) stream, so
// their CTAs, launched together, share it in L2. Sorted by chunk alone, a wave held one tile of each sequence
// and each sequence's next tile a wave later, when L2 no longer held the stream: fwd_far at K = 128, T = 4k read
// about 4.6 GB from DRAM for 3.8 GB of tiles (dev/cuda/NOTES.md v3.30).
std::vector<int32_t> order_far_tiles(std::vector<int32_t> tiles, const std::vector<int>& work) {
  std::vector<int32_t> idx(tiles.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = int32_t(i);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return work[size_t(a)] > work[size_t(b)]; });
  std::vector<int32_t> out(tiles.size());
  for (size_t i = 0; i < idx.size(); ++i) out[i] = tiles[size_t(idx[i])];
  return out;
}

// Query tiles of the far kernels: two query chunks (an even chunk and the next) past their sequence's superblock
// 0; work: the superblocks they cross.
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

// Superblocks a key tile's far walk takes (bwd_k_far's work for it): its sequence's later superblocks.
int key_tile_walk(const ChunkDesc& c, int sc) { return ((c.len + kChunk - 1) / kChunk - 1) / sc - c.c / sc; }

// Where each CTA of a far backward kernel parks its states (grid + 1 prefix sums, in states of 128 x K), given
// the states each tile parks (`slots`, in the kernel's most-work-first tile order; items are tile x `heads`):
// CTA c's first item is item c (tile c / heads), and the items it takes after it come later in that order, so
// none of them parks more than the first one. Sized by the most any tile needs on every CTA instead, a one-head
// slice of bwd_k_far at K = 128, T = 16k took 116 MiB of parking for ~58 in use.
std::vector<int32_t> far_park_first(const std::vector<int>& slots, int heads, int grid) {
  std::vector<int32_t> first(size_t(grid) + 1, 0);
  for (int c = 0; c < grid; ++c) first[size_t(c) + 1] = first[size_t(c)] + slots[size_t(c / heads)];
  return first;
}

// Per-kernel timing for kernel work (PATHATTN_CUDA_PROFILE=1 in the environment): events between launches,
// printed to stderr after a synchronize. Off by default: no events, no synchronization.
class Profile {
 public:
  Profile(cudaStream_t s, const char* what) : s_(s), what_(what), on_(std::getenv("PATHATTN_CUDA_PROFILE") != nullptr) {
    mark("start");
  }
  void mark(const char* name) {
    if (!on_) return;
    cudaEvent_t e;
    cudaEventCreate(&e);
    cudaEventRecord(e, s_);
    ev_.push_back({name, e});
  }
  ~Profile() {
    if (!on_ || ev_.size() < 2) return;
    cudaEventSynchronize(ev_.back().second);
    std::fprintf(stderr, "[profile] %s:", what_);
    for (size_t i = 1; i < ev_.size(); ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, ev_[i - 1].second, ev_[i].second);
      std::fprintf(stderr, " %s %.3f ms;", ev_[i].first, ms);
    }
    std::fprintf(stderr, "\n");
    for (auto& e : ev_) cudaEventDestroy(e.second);
  }

 private:
  cudaStream_t s_;
  const char* what_;
  bool on_;
  std::vector<std::pair<const char*, cudaEvent_t>> ev_;
};

}  // namespace

const char* supported_head_dims() { return "K, V in {64, 128}"; }

namespace {

// A superblock size (kSuperChunksShort, kSuperChunksMid or kSuperChunks) from the environment variable `name`,
// else 0.
int env_super_chunks(const char* name) {
  const char* e = std::getenv(name);
  const int v = e != nullptr ? std::atoi(e) : 0;
  return v == kSuperChunksShort || v == kSuperChunksMid || v == kSuperChunks ? v : 0;
}

// The backward's chunks per superblock, by the longest sequence (without the gate, outside deterministic mode):
// up to 2048 tokens kSuperChunksShort; up to 8192 at K = V = 128 kSuperChunksMid; else kSuperChunksShort up
// to 4096 and kSuperChunks beyond; kSuperChunks past 8192. Short superblocks shorten the own superblock's
// chains of bwd_q and bwd_k (serial in chunks) and cost the far kernels crossings, which grow as (T /
// superblock)^2. Measured (f+b ms at the default limit, palindromic A/Bs; dev/cuda/NOTES.md v3.63, v3.64):
// K = 128 T = 4k 8 / 4 / 6: 17.03 / 16.28 / 16.24 (4 against 6 in one run 16.38 / 16.24); T = 8k 8 / 6:
// 22.40 / 21.89, 16k 33.40 / 34.90; K = 64 T = 4k 4 / 6 17.11 / 17.13, 8k 8 / 6 23.52 / 23.85. With the gate
// and in deterministic mode the far kernels are the two unfused ones, measured with 4 up to 2048 tokens only:
// 4 there, else 8. The backward recomputes the forward's workspace, so its superblocks need not be the
// forward's. PATHATTN_CUDA_BWD_SUPER_CHUNKS (4, 6 or 8) overrides the choice, for kernel work and tests (the far
// kernels' key tiles are chunk pairs, so the size must be even).
int bwd_super_chunks(const core::Problem& pr, bool deterministic) {
  if (const int v = env_super_chunks("PATHATTN_CUDA_BWD_SUPER_CHUNKS")) return v;
  const int64_t n = longest_seq(pr);
  if (n <= 2048) return kSuperChunksShort;
  if (pr.gate || deterministic || n > 8192) return kSuperChunks;
  if (pr.K == 128 && pr.V == 128) return kSuperChunksMid;  // measured with the fused far kernel (K == V)
  return n > 4096 ? kSuperChunks : kSuperChunksShort;
}

// The forward's chunks per superblock: kSuperChunks (512 tokens, the size the forward was built and measured
// with). PATHATTN_CUDA_FWD_SUPER_CHUNKS (4, 6 or 8) overrides it, for kernel work and tests: the forward's
// superblocks have not been swept as the backward's were (bwd_super_chunks), and shorter ones shorten
// fwd_scan's own-superblock chains (serial in chunks) while adding crossings to fwd_far (dev/cuda/NOTES.md
// v3.76). fwd_far's key tiles are chunk pairs and fwd_scan's CTAs at K = 128 take two query chunks of one
// superblock, so the size must be even.
int fwd_super_chunks() {
  const int v = env_super_chunks("PATHATTN_CUDA_FWD_SUPER_CHUNKS");
  return v != 0 ? v : kSuperChunks;
}

// One forward over the whole of p / pr (a slice of the call): allocates its workspace from ws and, unless
// ws is measuring, launches the kernels.
Status fwd_run(const PathFwdParams& p, const core::Problem& pr, Workspace& ws) {
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  const int dt = dtype_code(p.q.dtype);
  KernelParams kp{};
  kp.sc = fwd_super_chunks();
  const Tables t = build_tables(pr, kp.sc);
  fill_inputs(kp, pr, p.q, p.k, p.v, p.w, p.beta, p.g);
  kp.o = p.o.data;
  strides3(p.o, kp.o_s);
  kp.lse = p.lse.present() ? static_cast<float*>(p.lse.data) : nullptr;
  if (kp.lse) strides3(p.lse, kp.lse_s);
  int32_t* seq_first = nullptr;
  TablePack tables;
  PA_TRY(alloc_common(ws, kp, t, pr, tables, &seq_first));
  PA_TRY(alloc_super(ws, kp, t, pr, tables));
  if (kp.nsuper > 0) {
    __half* ks = nullptr;
    PA_CU(ws.alloc(&ks, size_t(pr.B) * pr.T * pr.H * pr.K));
    kp.ks = ks;
  }
  // The far part on Hopper (fwd_far.cu), where this build, the device and the call's shapes allow it.
  std::vector<int32_t> far_tiles;
  if (far_worth_it(kp, t) && fwd_far_usable(kp)) far_tiles = far_query_tiles(t, kp.sc);
  int32_t* far_dev = nullptr;
  if (!far_tiles.empty()) {
    const size_t NT = size_t(pr.B) * pr.T;
    // At V = 64 the output so far takes the place of A_loc ([NT, HQ, 64] floats): fwd_scan reads a row's A_loc
    // (the diagonal) and writes its output so far from the same thread, element for element.
    if (pr.V == kChunk) kp.ofar = kp.aloc;
    else PA_CU(ws.alloc(&kp.ofar, NT * pr.HQ * pr.V));
    PA_CU(ws.alloc(&kp.lsefar, NT * pr.HQ));
    tables.add(far_tiles, [&far_dev](int32_t* d) { far_dev = d; });
  }
  // fwd_scan's CTAs of two query chunks (at K = 128): each even chunk, in the scans' order.
  std::vector<int32_t> pairs;
  int32_t* pairs_dev = nullptr;
  if (fwd_scan_chunks_per_cta(int(pr.K)) == 2) {
    for (const int32_t i : t.order)
      if (t.chunks[size_t(i)].c % 2 == 0) pairs.push_back(i);
    tables.add(pairs, [&pairs_dev](int32_t* d) { pairs_dev = d; });
  }
  PA_TRY(tables.commit(ws));
  if (ws.measuring()) return Status::Ok();
  Profile prof(s, "fwd");
  if (pr.gate) PA_CU(launch_gate_cumsum(kp, seq_first, int(t.seq_first.size()), s));
  PA_CU(launch_chunk_prep(kp, dt, s));
  prof.mark("gate+chunk_prep");
  PA_CU(launch_super_prep(kp, dt, s));
  prof.mark("super_prep");
  PA_CU(launch_fwd_scan(kp, pairs_dev, int(pairs.size()), dt, s));
  prof.mark("fwd_scan");
  if (!far_tiles.empty()) {
    PA_CU(launch_fwd_far(kp, far_dev, int(far_tiles.size()), dt, s));
    prof.mark("fwd_far");
  }
  return Status::Ok();
}

// Output memory as workspace (PATHATTN_CUDA_BWD_OUT_WS=1; dev/cuda/NOTES.md v3.74). The gradient outputs are
// written by the backward's last kernels (dv by bwd_k; dq, dk, dw by bwd_chunk), so buffers that every kernel
// is done with before then may live in them: k~ (last read by super_bwd) in dq, the keys moved to their
// superblock's end (ks, last read by bwd_k_far / bwd_q) in dk, the moved queries (qhat, last read by bwd_k_far
// where it runs) in dv, the key-chain gradient dks (last read by super_bwd) in dw; with qhat and ks gone from
// piece 1, dkt lies over dvdiag (MHA, K = V; bwd_k reads a thread's dvdiag elements before it writes the same
// dkt elements). Only outputs that are each one dense block (whole calls and slices of whole batch rows; a
// slice of kv heads is strided) and overlap no other tensor of the call take part; the rest stay empty here.
struct OutputHost {
  struct Block {
    void* at = nullptr;
    size_t bytes = 0;
    // The block where it holds `need` bytes (need > 0), else null.
    void* fits(size_t need) const { return need > 0 && bytes >= need ? at : nullptr; }
  };
  Block dq, dk, dv, dw;
};

// [lo, hi) of the bytes a view may touch (positive strides), empty for an absent or empty view.
std::pair<uintptr_t, uintptr_t> view_span(const TensorView& t) {
  if (!t.present() || t.data == nullptr || t.numel() == 0) return {0, 0};
  int64_t last = 0;
  for (int i = 0; i < t.ndim; ++i) last += (t.shape[i] - 1) * t.stride[i];
  const uintptr_t lo = reinterpret_cast<uintptr_t>(t.data);
  return {lo, lo + uintptr_t(last + 1) * uintptr_t(dtype_size(t.dtype))};
}

// The bytes of a view whose elements fill one block of memory in row-major order (its strides those of its
// shape) from a 16-byte boundary (the TMA tensor maps' and vector accesses' need), else 0. The same for every
// slice of whole batch rows of one call (their offsets are multiples of T x heads x K elements, 128 bytes at
// least), whose workspace the plan measures on the first.
size_t dense_bytes(const TensorView& t) {
  if (!t.present() || t.data == nullptr || reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return 0;
  int64_t want = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] > 1 && t.stride[i] != want) return 0;
    want *= t.shape[i];
  }
  return size_t(want) * size_t(dtype_size(t.dtype));
}

// No byte that dq, dk, dv or dw may touch is one that another tensor of the call may touch. Asked of the whole
// call (bwd): its slices then hold the same for theirs.
bool outputs_apart(const PathBwdParams& p) {
  const TensorView* outs[4] = {&p.dq, &p.dk, &p.dv, &p.dw};
  const TensorView* all[] = {&p.q, &p.k, &p.v, &p.w, &p.beta, &p.g, &p.o, &p.lse, &p.do_, &p.cu_seqlens,
                             &p.dq, &p.dk, &p.dv, &p.dw, &p.dbeta, &p.dg};
  for (const TensorView* x : outs) {
    const std::pair<uintptr_t, uintptr_t> a = view_span(*x);
    if (a.first == a.second) continue;
    for (const TensorView* o : all) {
      if (o == x) continue;
      const std::pair<uintptr_t, uintptr_t> b = view_span(*o);
      if (b.first < b.second && a.first < b.second && b.first < a.second) return false;
    }
  }
  return true;
}

// The outputs of p (a call or a slice of one whose outputs_apart holds) that are dense blocks.
OutputHost output_host(const PathBwdParams& p) {
  auto block = [](const TensorView& t) { return OutputHost::Block{t.data, dense_bytes(t)}; };
  return {block(p.dq), block(p.dk), block(p.dv), block(p.dw)};
}

// One backward over the whole of p / pr, as fwd_run.
// msv_early: super_bwd's M_c (msv) written by the first super_prep launch and kept until super_bwd; else by a
// second launch after bwd_k, over piece 2's buffers that are dead by then. host_out: output memory as workspace
// where OutputHost allows it.
Status bwd_run(const PathBwdParams& p, const core::Problem& pr, Workspace& ws, bool msv_early, bool host_out) {
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  const int dt = dtype_code(p.q.dtype);
  KernelParams kp{};
  kp.sc = bwd_super_chunks(pr, p.deterministic);
  // The two-size backward (far_glue.cu): the chains on superblocks of kSuperChunksShort chunks, the fused far
  // kernel on double blocks and on each even superblock's neighbour. PATHATTN_CUDA_BWD_TWO_SIZE=1 asks for it
  // (K = V = 128, no gate, not deterministic; it runs where the fused far kernel and the glue do).
  const char* two_env = std::getenv("PATHATTN_CUDA_BWD_TWO_SIZE");
  bool two_size = two_env != nullptr && std::strcmp(two_env, "1") == 0 && pr.path && !pr.gate &&
                  !p.deterministic && pr.K == 128 && pr.V == 128;
  if (two_size) kp.sc = kSuperChunksShort;
  const Tables t = build_tables(pr, kp.sc);
  fill_inputs(kp, pr, p.q, p.k, p.v, p.w, p.beta, p.g);
  kp.o = const_cast<void*>(p.o.data);
  strides3(p.o, kp.o_s);
  kp.lse = static_cast<float*>(p.lse.data);
  strides3(p.lse, kp.lse_s);
  kp.dout = p.do_.data;
  strides3(p.do_, kp.do_s);
  kp.dq = p.dq.data;
  kp.dk = p.dk.data;
  kp.dv = p.dv.data;
  strides3(p.dq, kp.dq_s);
  strides3(p.dk, kp.dk_s);
  strides3(p.dv, kp.dv_s);
  if (pr.path) {
    kp.dw = static_cast<float*>(p.dw.data);
    kp.dbeta = static_cast<float*>(p.dbeta.data);
    strides3(p.dw, kp.dw_s);
    strides3(p.dbeta, kp.dbeta_s);
  }
  if (pr.gate) {
    kp.dg = static_cast<float*>(p.dg.data);
    strides3(p.dg, kp.dg_s);
  }
  kp.deterministic = p.deterministic;
  // The gate's column sums of dS: from the query side (bwd_q, bwd_q_far), beside its row sums of the same dS, so
  // that the two cancel as in exact arithmetic (dev/cuda/NOTES.md v3.34): atomics, or in deterministic mode adds
  // in a fixed order behind tickets (bwd_q only; v3.38). PATHATTN_CUDA_DG_SPLIT=1 forces bwd_k's sums of its own
  // dS^T (dg's error about 1.5x larger; and so no far kernels with the gate), for kernel work.
  kp.dgq = pr.gate && std::getenv("PATHATTN_CUDA_DG_SPLIT") == nullptr;

  int32_t* seq_first = nullptr;
  TablePack tables;
  const size_t NT = size_t(pr.B) * pr.T, H = pr.H, HQ = pr.HQ, K = pr.K, V = pr.V;
  const OutputHost oh = host_out && !two_size ? output_host(p) : OutputHost{};
  const size_t elem = size_t(dtype_size(p.q.dtype));
  PA_TRY(alloc_common(ws, kp, t, pr, tables, &seq_first, oh.dq.fits(NT * H * K * elem)));
  PA_CU(ws.alloc(&kp.delta, NT * HQ));
  PA_CU(ws.alloc(&kp.dqt, (NT + kDqtPadRows) * HQ * K));
  // dP, and below dks and dps, are zeroed by the kernels that first run on their items (chunk_prep, super_prep's
  // first launch), not by memsets: three fewer launches a call or slice.
  PA_CU(ws.alloc(&kp.dP, size_t(kp.nchunks) * H * K * K));
  PA_CU(ws.alloc(&kp.E, size_t(kp.nchunks) * H * kChunk * kChunk));  // chunk_prep -> bwd_chunk
  if (pr.gate) {
    PA_CU(ws.alloc(&kp.dgrow, NT * HQ));
    PA_CU(ws.alloc(&kp.dgcol, NT * HQ));
    PA_CU(ws.zero(kp.dgcol, NT * HQ * sizeof(float)));
  }
  PA_TRY(alloc_super(ws, kp, t, pr, tables));  // ks: in the shared piece below
  // Superblock-backward grid: one CTA per SM, each taking blocks of sb_rows rows of an item.
  int sb_grid = 0, sb_rows = int(K);
  if (kp.nsuper > 0) {
    int sms = 0, optin = 0;
    PA_CU(device_attr(cudaDevAttrMultiProcessorCount, &sms));
    PA_CU(device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &optin));
    sb_rows = super_bwd_rows(int(K), kp.nsuper * int(H), p.deterministic, sms, optin);
    // PATHATTN_CUDA_SUPER_BWD_ROWS=32|64|128 (at most K; not in deterministic mode, whose fixed order needs all K
    // rows in one block): the row block for kernel work (dev/cuda/NOTES.md v3.67: 128 at K = 128 measured slower).
    if (const char* rows_env = std::getenv("PATHATTN_CUDA_SUPER_BWD_ROWS"); rows_env != nullptr && !p.deterministic) {
      const int v = std::atoi(rows_env);
      if ((v == 32 || v == 64 || v == 128) && v <= int(K)) sb_rows = v;
    }
    sb_grid = std::min(kp.nsuper * int(H) * int(K) / sb_rows, sms);
    kp.dks = static_cast<float*>(oh.dw.fits(NT * H * K * sizeof(float)));
    if (kp.dks == nullptr) PA_CU(ws.alloc(&kp.dks, NT * H * K));
    PA_CU(ws.alloc(&kp.dps, size_t(kp.nsuper) * H * K * K));
    if (msv_early) PA_CU(ws.alloc(&kp.msv, size_t(kp.nsuper) * H * kp.sc * K * K));  // super_prep -> super_bwd
  }

  // Persistent grids: scratch_slots snapshots of C x K (16-bit) per CTA.
  const int nseqs = int(t.seq_first.size());
  const int q_items = kp.nchunks * int(HQ);
  if (p.deterministic) {  // the fixed order of the dP / dPS sums and of the gate's column sums (bwd_q.cu)
    const size_t n = (size_t(kp.nchunks) + size_t(kp.nsuper)) * (H + (kp.dgq ? HQ : 0)) + 1;
    PA_CU(ws.alloc(&kp.tickets, n));
    PA_CU(ws.zero(kp.tickets, n * sizeof(int)));
  }
  const int k_items = kp.nchunks * int(H);
  const int gq = std::min(q_items, bwd_q_max_grid(kp, dt));
  if (p.deterministic && kp.dgq) {  // bwd_q's ordered gate column sums (bwd_q.cu, kDetCols)
    PA_CU(ws.alloc(&kp.dgcolf, NT * HQ));
    PA_CU(ws.zero(kp.dgcolf, NT * HQ * sizeof(float)));
    PA_CU(ws.alloc(&kp.colscr, bwd_q_colscr_elems(std::max(gq, 1), kp.sc)));
  }
  const int gk = std::min(k_items, bwd_k_max_grid(kp, dt));
  if (gq <= 0 || gk <= 0) return internal("cuda: the backward kernels do not fit on this device (occupancy 0)");
  // The far parts on Hopper (bwd_q_far.cu, bwd_k_far.cu), where this build, the device and the call allow them.
  // Their parked states take the scratch too (they run between the scans, one at a time). Query side: tiles as
  // the forward's; key side: tiles of a superblock pair's two chunks whose sequence goes on past their
  // superblock; work: the later superblocks.
  std::vector<int32_t> qfar_tiles, kfar_tiles;
  int qfar_grid = 0, kfar_grid = 0;
  // With the gate, only where some sequence is longer than four superblocks (2048 tokens): measured (f+b with
  // the gate, ms, far kernels / bwd_q and bwd_k alone) K = 64 T = 1k 13.73 / 13.37, 4k 24.17 / 24.08, 16k 60.5 /
  // 66.9; K = 128 T = 1k 13.87 / 13.81, 4k 23.27 / 25.01, 16k 57.8 / 69.2 (dev/cuda/NOTES.md v3.35).
  const bool far = far_worth_it(kp, t) && (!pr.gate || longer_than_four_superblocks(pr));
  if (far && bwd_q_far_usable(kp)) {
    qfar_tiles = far_query_tiles(t, kp.sc);
  }
  if (far && bwd_k_far_usable(kp)) {
    std::vector<int> work;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const int walk = key_tile_walk(t.chunks[i], kp.sc);
      if (t.chunks[i].c % 2 != 0 || walk <= 0) continue;
      kfar_tiles.push_back(int32_t(i));
      work.push_back(walk);
    }
    kfar_tiles = order_far_tiles(std::move(kfar_tiles), work);
  }
  // One far kernel for both sides (bwd_k_far with kfuse: dq by reductions into dqt, dPS from the key chain;
  // dev/cuda/NOTES.md v3.39) where both far kernels would run and it can (not with the gate, whose dS sums are
  // the query side's, nor in deterministic mode). PATHATTN_CUDA_FAR_FUSE=0 keeps the two kernels.
  const char* fuse_env = std::getenv("PATHATTN_CUDA_FAR_FUSE");
  kp.kfuse = !qfar_tiles.empty() && !kfar_tiles.empty() && bwd_k_far_fusable(kp) &&
             !(fuse_env != nullptr && std::strcmp(fuse_env, "0") == 0);
  // bwd_q / bwd_k park the states at earlier (later) superblocks' ends only where the far kernels do not take
  // those superblocks: with both far kernels, a CTA parks its own superblock's chunks alone.
  kp.scratch_slots =
      !qfar_tiles.empty() && !kfar_tiles.empty() ? kp.sc : scratch_slot_count(kp.max_chunks, pr.path, kp.sc);
  size_t scratch_elems = size_t(std::max(gq, gk)) * kp.scratch_slots * kChunk * K;
  // Two sizes: the first far launch takes the key tiles of even superblocks with their neighbour (kfar_tiles
  // from here on), the second the double blocks' tiles (tiles2, on t2); the glue's items are the double blocks
  // of sequences with more than one.
  two_size = two_size && kp.kfuse && far_glue_usable(kp);
  Tables t2;
  std::vector<int32_t> tiles2, glue_items;
  if (two_size) {
    t2 = build_tables(pr, 2 * kp.sc);
    std::vector<int32_t> adj;
    std::vector<int> work2;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const ChunkDesc& c = t.chunks[i];
      if (c.c % (2 * kp.sc) == 0 && (c.len + kChunk - 1) / kChunk > 2 * kp.sc) glue_items.push_back(int32_t(i));
      if (c.c % 2 != 0) continue;
      if ((c.c / kp.sc) % 2 == 0 && key_tile_walk(c, kp.sc) >= 1) adj.push_back(int32_t(i));
      const int walk2 = key_tile_walk(c, 2 * kp.sc);
      if (walk2 >= 1) {
        tiles2.push_back(int32_t(i));
        work2.push_back(walk2);
      }
    }
    tiles2 = order_far_tiles(std::move(tiles2), work2);
    two_size = !tiles2.empty() && !adj.empty();
    if (two_size) kfar_tiles = std::move(adj);
  }
  int32_t *qfar_dev = nullptr, *kfar_dev = nullptr, *qpark_dev = nullptr, *kpark_dev = nullptr;
  int64_t qpark_slots = 0, kpark_slots = 0;
  // A far kernel's parking table (far_park_first) on the device and its states in all (at least one: the scratch
  // and its tensor map need a row even where no tile parks).
  auto park_table = [&](const std::vector<int>& slots, int heads, int grid, int32_t** dev, int64_t* total) {
    const std::vector<int32_t> first = far_park_first(slots, heads, grid);
    *total = std::max<int64_t>(first.back(), 1);
    tables.add(first, [dev](int32_t* d) { *dev = d; });
  };
  if (!qfar_tiles.empty() && !kp.kfuse) {
    qfar_grid = far_grid(int64_t(qfar_tiles.size()) * int64_t(HQ));
    if (qfar_grid <= 0) return internal("cuda: no SM count for the query side's far kernel");
    std::vector<int> slots;  // a query tile parks its states at each earlier superblock
    for (const int32_t i : qfar_tiles) slots.push_back(t.chunks[size_t(i)].c / kp.sc);
    park_table(slots, int(HQ), qfar_grid, &qpark_dev, &qpark_slots);
    scratch_elems = std::max(scratch_elems, bwd_q_far_park_elems(qpark_slots, int(K)));
    tables.add(qfar_tiles, [&qfar_dev](int32_t* d) { qfar_dev = d; });
  }
  float2* lsd = nullptr;
  bool zero_qhat = false;
  const bool kfar = !kfar_tiles.empty();
  if (kfar) {
    kfar_grid = far_grid(int64_t(kfar_tiles.size()) * int64_t(H));
    if (kfar_grid <= 0) return internal("cuda: no SM count for the key side's far kernel");
    std::vector<int> slots;  // a key tile parks its states at each later superblock but the first
    for (const int32_t i : kfar_tiles)
      slots.push_back(two_size ? 0 : key_tile_walk(t.chunks[size_t(i)], kp.sc) - 1);
    park_table(slots, int(H), kfar_grid, &kpark_dev, &kpark_slots);
    scratch_elems = std::max(scratch_elems, bwd_k_far_park_elems(kpark_slots, int(K)));
    tables.add(kfar_tiles, [&kfar_dev](int32_t* d) { kfar_dev = d; });
    PA_CU(ws.alloc(&lsd, size_t(kp.nchunks) * HQ * kChunk));
    // Its query tiles (TMA) read whole chunks: past a sequence's end, rows of the next one's superblock 0,
    // which bwd_q leaves unwritten. Their P is 0, but so must their qhat be (0 x NaN is NaN).
    for (const core::Seq& sq : pr.seqs) zero_qhat = zero_qhat || sq.len % kChunk != 0;
  }
  // The two-size backward's second far launch and glue: their tables and buffers (PS2, ks2, qhat2 and the
  // gradients w.r.t. them; ks2 / dks2 rows of even halves, qhat2 / dqt2 rows of odd halves used), apart from the
  // pieces below (live from the glue's first launch to its second).
  int32_t *tiles2_dev = nullptr, *park2_dev = nullptr, *glue_dev = nullptr;
  const ChunkDesc* chunks2_dev = nullptr;
  int64_t park2_slots = 0;
  int grid2 = 0;
  __half *ps2 = nullptr, *ks2 = nullptr, *qhat2 = nullptr;
  float *dps2 = nullptr, *dqt2 = nullptr, *dks2 = nullptr;
  if (two_size) {
    grid2 = far_grid(int64_t(tiles2.size()) * int64_t(H));
    if (grid2 <= 0) return internal("cuda: no SM count for the key side's far kernel");
    std::vector<int> slots;
    for (const int32_t i : tiles2) slots.push_back(key_tile_walk(t2.chunks[size_t(i)], 2 * kp.sc) - 1);
    park_table(slots, int(H), grid2, &park2_dev, &park2_slots);
    scratch_elems = std::max(scratch_elems, bwd_k_far_park_elems(park2_slots, int(K)));
    tables.add(tiles2, [&tiles2_dev](int32_t* d) { tiles2_dev = d; });
    tables.add(glue_items, [&glue_dev](int32_t* d) { glue_dev = d; });
    tables.add(t2.chunks, [&chunks2_dev](ChunkDesc* d) { chunks2_dev = d; });
    const size_t nsuper2 = t2.super_first.size();
    PA_CU(ws.alloc(&ps2, nsuper2 * H * K * K));
    PA_CU(ws.alloc(&dps2, nsuper2 * H * K * K));
    PA_CU(ws.alloc(&ks2, NT * H * K));
    PA_CU(ws.alloc(&qhat2, NT * HQ * K));
    PA_CU(ws.alloc(&dqt2, (NT + kDqtPadRows) * HQ * K));
    PA_CU(ws.alloc(&dks2, NT * H * K));
  }
  // Buffers that are never live at once share memory (kernel order: chunk_prep, super_prep, bwd_q, bwd_q_far,
  // bwd_k_far, bwd_k, super_bwd, bwd_chunk; with kfuse bwd_q (qhat), bwd_k_far, bwd_q, bwd_k, ...). dkt (bwd_k
  // .. bwd_chunk): over qhat and ks (super_prep / bwd_q .. bwd_k_far) where bwd_k_far ran; else (bwd_k reads
  // qhat), with MHA and K = V, over dvdiag, whose layout it has (bwd_k reads a thread's dvdiag elements before it
  // writes the same dkt elements). Piece 2: dvdiag, dvk and the persistent grids' scratch (bwd_q .. bwd_k), then
  // (msv_early false) msv over all of them but a dvdiag that holds dkt (bwd_k .. super_bwd).
  // With output memory as workspace, qhat (read by bwd_k where bwd_k_far does not run) in dv's only with kfar,
  // ks in dk's; then dkt over dvdiag with kfar too.
  const size_t qhat_bytes = NT * HQ * K * sizeof(__half), ks_bytes = NT * H * K * sizeof(__half);
  __half* const qhat_at = kfar && kp.nsuper > 0 ? static_cast<__half*>(oh.dv.fits(qhat_bytes)) : nullptr;
  __half* const ks_at = kp.nsuper > 0 ? static_cast<__half*>(oh.dk.fits(ks_bytes)) : nullptr;
  const bool host_qhat = qhat_at != nullptr, host_ks = ks_at != nullptr;
  const bool dkt_on_dvdiag = (!kfar || (host_qhat && host_ks)) && HQ == H && K == V;
  Layout l1, l2;
  size_t qhat_off = 0, ks_off = 0, dkt_off = 0;
  if (kp.nsuper > 0) {
    if (!host_qhat) qhat_off = l1.add(qhat_bytes);
    if (!host_ks) ks_off = l1.add(ks_bytes);
  }
  if (!dkt_on_dvdiag) dkt_off = kfar ? l1.at(0, NT * H * K * sizeof(float)) : l1.add(NT * H * K * sizeof(float));
  // With MHA, bwd_k_far adds the far part of dv into dvdiag (dvk is dvdiag: kp.dvk_merged()) rather than into
  // a dvk of its own.
  const size_t dvdiag_off = l2.add(NT * HQ * V * sizeof(float)), after_dvdiag = l2.bytes;
  const size_t dvk_off = kfar && HQ != H ? l2.add(NT * H * V * sizeof(float)) : dvdiag_off;
  const size_t scratch_off = l2.add(scratch_elems * sizeof(__half));
  const size_t msv_off = msv_early || kp.nsuper == 0
                             ? 0
                             : l2.at(dkt_on_dvdiag ? after_dvdiag : 0,
                                     size_t(kp.nsuper) * H * kp.sc * K * K * sizeof(__half));
  char *b1 = nullptr, *b2 = nullptr;
  PA_CU(ws.alloc(&b1, l1.bytes));
  PA_CU(ws.alloc(&b2, l2.bytes));
  if (kp.nsuper > 0) {
    kp.qhat = host_qhat ? qhat_at : piece<__half>(b1, qhat_off);
    kp.ks = host_ks ? ks_at : piece<__half>(b1, ks_off);
  }
  kp.dkt = dkt_on_dvdiag ? piece<float>(b2, dvdiag_off) : piece<float>(b1, dkt_off);
  kp.dvdiag = piece<float>(b2, dvdiag_off);
  if (kfar) kp.dvk = piece<float>(b2, dvk_off);  // the far part of dv, for bwd_k
  kp.scratch = piece<__half>(b2, scratch_off);
  // Item counters (zeroed by chunk_prep): bwd_q_far, bwd_k_far, bwd_q's qhat launch, bwd_q's last launch, bwd_k.
  int* counters = nullptr;
  PA_CU(ws.alloc(&counters, kBwdCounters));
  kp.counters = counters;
  PA_TRY(tables.commit(ws));
  if (ws.measuring()) return Status::Ok();
  if (zero_qhat) PA_CU(ws.zero(kp.qhat, NT * HQ * K * 2));
  if (zero_qhat && two_size) PA_CU(ws.zero(qhat2, NT * HQ * K * 2));

  Profile prof(s, "bwd");
  if (pr.gate) PA_CU(launch_gate_cumsum(kp, seq_first, nseqs, s));
  PA_CU(launch_chunk_prep(kp, dt, s));
  PA_CU(launch_bwd_delta(kp, lsd, dt, s));
  prof.mark("gate+chunk_prep+delta");
  PA_CU(launch_super_prep(kp, dt, s));
  prof.mark("super_prep");
  if (!qfar_tiles.empty()) {  // qhat, the far superblocks, then the own superblock's part
    KernelParams k1 = kp;
    k1.qfar = 1;
    PA_CU(launch_bwd_q(k1, dt, gq, q_items, counters + 2, s));
    prof.mark("bwd_q(qhat)");
    if (kp.kfuse && two_size) {
      // The double blocks' parameters: kp's but for the superblock size, the table (its sfirst) and the
      // buffers of the double blocks.
      KernelParams k2 = kp;
      k2.sc = 2 * kp.sc;
      k2.chunks = chunks2_dev;
      k2.nsuper = int(t2.super_first.size());
      k2.ps = ps2;
      k2.dps = dps2;
      k2.ks = ks2;
      k2.qhat = qhat2;
      k2.dqt = dqt2;
      k2.dks = dks2;
      k2.far_half = kp.sc;
      k2.far1_ks = kp.ks;
      k2.far1_qhat = kp.qhat;
      k2.far1_dqt = kp.dqt;
      k2.far1_dks = kp.dks;
      PA_CU(launch_far_glue(false, kp, k2, glue_dev, int(glue_items.size()), dt, s));
      prof.mark("far_glue(fwd)");
      KernelParams ka = kp;
      ka.far_adj = true;
      PA_CU(launch_bwd_k_far(ka, kfar_dev, int(kfar_tiles.size()), lsd, kpark_dev, kpark_slots, kfar_grid,
                             counters + 1, dt, s));
      prof.mark("bwd_k_far(adjacent)");
      // (counters + 0 is bwd_q_far's, which does not run with kfuse.)
      PA_CU(launch_bwd_k_far(k2, tiles2_dev, int(tiles2.size()), lsd, park2_dev, park2_slots, grid2, counters, dt,
                             s));
      prof.mark("bwd_k_far(double)");
      PA_CU(launch_far_glue(true, kp, k2, glue_dev, int(glue_items.size()), dt, s));
      prof.mark("far_glue(bwd)");
    } else if (kp.kfuse) {
      PA_CU(launch_bwd_k_far(kp, kfar_dev, int(kfar_tiles.size()), lsd, kpark_dev, kpark_slots, kfar_grid,
                             counters + 1, dt, s));
      prof.mark("bwd_k_far(fused)");
    } else {
      PA_CU(launch_bwd_q_far(kp, qfar_dev, int(qfar_tiles.size()), qpark_dev, qpark_slots, qfar_grid, counters,
                             dt, s));
      prof.mark("bwd_q_far");
    }
    kp.qfar = 2;
  }
  PA_CU(launch_bwd_q(kp, dt, gq, q_items, counters + 3, s));
  prof.mark("bwd_q");
  if (!kfar_tiles.empty()) {  // (with kfuse it ran before bwd_q)
    if (!kp.kfuse) {
      PA_CU(launch_bwd_k_far(kp, kfar_dev, int(kfar_tiles.size()), lsd, kpark_dev, kpark_slots, kfar_grid,
                             counters + 1, dt, s));
      prof.mark("bwd_k_far");
    }
    kp.kfar = true;
  }
  PA_CU(launch_bwd_k(kp, dt, gk, counters + 4, s));
  prof.mark("bwd_k");
  if (!msv_early && kp.nsuper > 0) {  // M_c only, into the memory bwd_q .. bwd_k are done with
    kp.msv = piece<__half>(b2, msv_off);
    PA_CU(launch_super_prep(kp, dt, s, false));
    prof.mark("super_prep(msv)");
  }
  PA_CU(launch_super_bwd(kp, dt, sb_rows, sb_grid, s));
  prof.mark("super_bwd");
  PA_CU(launch_bwd_chunk(kp, dt, s));
  prof.mark("bwd_chunk");
  if (pr.gate) PA_CU(launch_bwd_dg(kp, seq_first, nseqs, s));
  return Status::Ok();
}

// ---- The workspace limit: a call whose workspace would exceed it runs in slices of kv heads (with their
// query heads), then of batch rows, each a complete forward / backward on views of the tensors (run_sliced
// says on which streams and in which memory). Slices are independent (every kernel works within one kv head
// and one sequence), so the results are those of one call, bitwise.

// requested > 0: itself; 0: the default.
int64_t workspace_limit(int64_t requested, const TensorView& q, const TensorView& k, const TensorView& v) {
  if (requested > 0) return requested;
  const int64_t inputs = (q.numel() + k.numel() + v.numel()) * dtype_size(q.dtype);
  return std::max<int64_t>(kDefaultWorkspaceFloor, inputs);
}

using core::Slice;
using core::sub_params;
using core::sub_problem;

// The second stream of sliced calls: one per host thread and device, created on first use and kept until the
// thread ends (a new stream each call cost 0.4 .. 0.9 ms a forward+backward at K = 128, T = 1k .. 8k; the
// stream-ordered pool passing the side blocks between streams is the likely cause). Per thread, so that calls
// from several threads (or a graph capture on one of them) never share it.
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

cudaError_t thread_side_stream(cudaStream_t* out) {
  static thread_local SideStreams streams;
  return streams.get(out);
}

// The side stream for one call's slices, ordered after the caller's stream's work at open(); its work joins
// the caller's stream again on destruction (also on error returns).
class SideStream {
 public:
  explicit SideStream(cudaStream_t main) : main_(main) {}
  Status open() {
    PA_CU(thread_side_stream(&side_));
    PA_CU(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
    PA_CU(cudaEventRecord(ev_, main_));
    PA_CU(cudaStreamWaitEvent(side_, ev_, 0));
    return Status::Ok();
  }
  ~SideStream() {
    if (side_ && ev_ && cudaEventRecord(ev_, side_) == cudaSuccess) cudaStreamWaitEvent(main_, ev_, 0);
    if (ev_) cudaEventDestroy(ev_);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  cudaStream_t get() const { return side_; }

 private:
  cudaStream_t main_, side_ = nullptr;
  cudaEvent_t ev_ = nullptr;
};

constexpr int kMaxLanes = 2;  // streams a sliced call may use (the lane array below holds two)

// The slices a call runs in: `whole` (one, of the whole call: no limit, or it fits) or `lanes`.
struct CallPlan {
  bool whole = true;
  core::LanePlan lanes;
  int64_t limit = -1, whole_bytes = 0;
  // The plan keeps to the limit (a call whose smallest slice exceeds it runs over it).
  bool fits() const { return whole || lanes.block * lanes.lanes <= limit; }
};

// by_pairs: slices of whole batch rows compete with slices of kv heads (core::plan_slices), for a backward that
// keeps workspace in the outputs of whole-row slices.
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
  auto cost = [&](const Slice& sl) -> int64_t {
    for (const Measured& x : memo)
      if (x.nb == sl.nb && x.nh == sl.nh) return x.bytes;
    Workspace m(s, true);
    const Status st = run(sub_params(p, pr, sl), sub_problem(pr, sl), m);
    if (!st.ok() && err.ok()) err = st;
    memo.push_back({sl.nb, sl.nh, int64_t(m.bytes())});
    return memo.back().bytes;
  };
  if (limit < 0) return Status::Ok();
  out->whole_bytes = cost(Slice{0, pr.B, 0, pr.H});
  PA_TRY(err);
  if (out->whole_bytes <= limit) return Status::Ok();
  out->whole = false;
  // Streams by core::plan_lanes with at most kMaxLanes = 2: two when the call needs several slices and the
  // slices for half the limit number at least two and at most four times one stream's; else one. Measured
  // (forward + backward, ms, with bwd_run's workspace sharing): two streams for single-head slices only ->
  // for any: K = 128, T = 2k 22.15 -> 19.72, 4k 25.39 -> 23.16 (backward: 8 slices of two heads on one stream
  // -> 16 of one head on two); at most twice as many slices -> four times: K = 64, T = 2k 20.05 -> 19.52, 4k
  // 24.75 -> 23.61, 8k 32.39 -> 31.17 (backward: 7 slices of five heads on one stream -> 16 of two heads on
  // two), K = 128, T = 1k 17.57 -> 16.88, 8k 31.43 -> 30.89 (8 slices of two heads -> 32 of one head and half
  // the rows). The first slice of a plan is its largest (plan_slices puts the larger parts first), so its workspace
  // sizes the blocks.
  // A deterministic backward over sequences longer than four superblocks runs one stream: its dP sums go in a
  // fixed order along each (sequence, kv head), so a slice's parallelism is its count of those chains, and one
  // stream of slices twice as large beats two of half. Measured (forward + backward, ms, two streams -> one):
  // K = 128 T = 2k 23.5 -> 23.9, 4k 32.8 -> 30.8, 8k 73.9 -> 45.6, 16k 136.2 -> 75.9; K = 64 2k 19.6 -> 20.1,
  // 4k 25.8 -> 25.7, 8k 37.5 -> 35.8, 16k 74.5 -> 57.0 (T = 1k: 18.7 -> 19.5, 16.4 -> 16.8).
  int max_lanes = kMaxLanes;
  if constexpr (std::is_same_v<P, PathBwdParams>) {
    if (p.deterministic && longer_than_four_superblocks(pr)) max_lanes = 1;
  }
  const bool batch_ok = !p.cu_seqlens.present();
  out->lanes = core::plan_lanes(pr, batch_ok, limit, max_lanes, cost, by_pairs);
  return err;
}

// Runs `run` (fwd_run / bwd_run) as `cp` says: its slices, where it has several, on two streams, the caller's
// and a second one, alternately, each slice within half the limit: small slices leave most of the GPU idle in
// their superblock kernels and scan tails, and the other stream's slice fills it. Each stream's slices share
// one block of the largest slice's size (allocated once: slices freeing and allocating through the pool on two
// streams would make the pool order them).
template <class P, class Run>
Status run_planned(const P& p, const core::Problem& pr, Run run, const CallPlan& cp) {
  cudaStream_t s = static_cast<cudaStream_t>(p.stream);
  if (cp.whole) {
    Workspace ws(s);
    return run(p, pr, ws);
  }
  const std::vector<Slice>& slices = cp.lanes.slices;
  const int lanes = cp.lanes.lanes;
  const size_t block = size_t(cp.lanes.block);
  if (std::getenv("PATHATTN_CUDA_PROFILE") != nullptr)
    std::fprintf(stderr,
                 "[slices] %zu of %lld rows x %lld kv heads, %d stream(s), block %.1f MiB (limit %.1f, one slice "
                 "%.1f)\n",
                 slices.size(), static_cast<long long>(slices[0].nb), static_cast<long long>(slices[0].nh), lanes,
                 double(block) / (1 << 20), double(cp.limit) / (1 << 20), double(cp.whole_bytes) / (1 << 20));
  SideStream side(s);
  if (lanes > 1) PA_TRY(side.open());
  const cudaStream_t lane[2] = {s, lanes > 1 ? side.get() : s};
  Workspace blocks[2] = {Workspace(lane[0]), Workspace(lane[1])};
  uint8_t* base[2] = {};
  for (int l = 0; l < lanes; ++l) PA_CU(blocks[l].alloc(&base[l], block));
  for (size_t i = 0; i < slices.size(); ++i) {
    const int l = int(i % size_t(lanes));
    P sp = sub_params(p, pr, slices[i]);
    sp.stream = lane[l];
    Workspace ws(lane[l], base[l], block);
    PA_TRY(run(sp, sub_problem(pr, slices[i]), ws));
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

}  // namespace

// Entry points with fp32 w, beta, g (and dw, dbeta, dg); param_dtypes.cu converts other dtypes.
Status fwd_f32(const PathFwdParams& p, const core::Problem& pr) {
  PA_TRY(check_support(pr, p.q.dtype));
  PA_TRY(check_row_copies(p.v, "v"));
  PA_TRY(check_smem(smem_chunk_prep(int(pr.K)), "chunk"));
  PA_TRY(check_smem(smem_super_prep(int(pr.K)), "superblock"));
  PA_TRY(check_smem(smem_fwd_scan(int(pr.K), int(pr.V)), "forward"));
  return run_sliced(p, pr, fwd_run);
}

Status bwd_f32(const PathBwdParams& p, const core::Problem& pr) {
  PA_TRY(check_support(pr, p.q.dtype));
  PA_TRY(check_row_copies(p.v, "v"));
  PA_TRY(check_row_copies(p.do_, "do"));
  PA_TRY(check_smem(smem_chunk_prep(int(pr.K)), "chunk"));
  PA_TRY(check_smem(smem_bwd_q(int(pr.K), int(pr.V)), "backward (query side)"));
  PA_TRY(check_smem(smem_bwd_k(int(pr.K), int(pr.V)), "backward (key side)"));
  PA_TRY(check_smem(smem_bwd_chunk(int(pr.K)), "backward (chunk)"));
  PA_TRY(check_smem(smem_super_prep(int(pr.K)), "superblock"));
  PA_TRY(check_smem(smem_super_bwd(int(pr.K)), "superblock backward"));
  // super_bwd's M_c (msv: nsuper x H x sc x K x K halves, 1.75x the bytes of ks at K = 128) from the first
  // super_prep launch where the call fits whole with them kept from there, or its plan with them splits batch
  // rows no further than with a second launch after bwd_k (and keeps to the limit); else from that second
  // launch. Both are the same steps of M: the results do not depend on the choice. Measured against
  // super_bwd running the chain itself (f+b ms at the default limit, dev/cuda/NOTES.md v3.55): K = 128 T = 4k
  // 18.38 -> 17.95, K = 64 T = 4k 18.22 -> 18.07, K = 128 T = 8k 23.69 -> 23.22 (first launch), K = 128 T = 16k
  // 34.26 -> 34.40 (second launch; with the first, 35.49: its slices take 1 batch row instead of 2, v3.54).
  // Output memory as workspace (OutputHost), the plans of whole-row slices beside those of kv heads, and the M_c
  // launch whose plan holds more (row, head) pairs a slice: kBwdOutWsDefault (off until measured:
  // dev/cuda/NOTES.md v3.74); PATHATTN_CUDA_BWD_OUT_WS=1 / 0 forces it on / off.
  constexpr bool kBwdOutWsDefault = false;
  const char* ow_env = std::getenv("PATHATTN_CUDA_BWD_OUT_WS");
  const bool ow_set = ow_env != nullptr && (std::strcmp(ow_env, "1") == 0 || std::strcmp(ow_env, "0") == 0);
  const bool host_out = (ow_set ? ow_env[0] == '1' : kBwdOutWsDefault) && outputs_apart(p);
  const auto early = [host_out](const PathBwdParams& sp, const core::Problem& spr, Workspace& ws) {
    return bwd_run(sp, spr, ws, true, host_out);
  };
  const auto late = [host_out](const PathBwdParams& sp, const core::Problem& spr, Workspace& ws) {
    return bwd_run(sp, spr, ws, false, host_out);
  };
  // PATHATTN_CUDA_SUPER_MSV=1 / 0 forces the first / the second launch (kernel work and tests).
  const char* msv_env = std::getenv("PATHATTN_CUDA_SUPER_MSV");
  if (msv_env != nullptr && (std::strcmp(msv_env, "0") == 0 || std::strcmp(msv_env, "1") == 0))
    return msv_env[0] == '1' ? run_sliced(p, pr, early, host_out) : run_sliced(p, pr, late, host_out);
  CallPlan a, b;
  PA_TRY(plan_call(p, pr, early, &a, host_out));
  if (a.whole) return run_planned(p, pr, early, a);
  PA_TRY(plan_call(p, pr, late, &b, host_out));
  if (!b.whole && a.fits()) {
    const Slice &sa = a.lanes.slices[0], &sb = b.lanes.slices[0];
    if (host_out ? sa.nb * sa.nh >= sb.nb * sb.nh : sa.nb >= sb.nb) return run_planned(p, pr, early, a);
  }
  return run_planned(p, pr, late, b);
}

}  // namespace pathattn::cuda
