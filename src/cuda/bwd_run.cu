// cuda/bwd_run.cu: the backward's launch sequence (the adapter's second half, after backend.cu): its workspace,
// which buffers share memory, the far kernels' tiles, and the launches, as phases of one state (Bwd).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cuda/adapter.h"
#include "cuda/heuristics.h"
#include "cuda/launchers.h"
#include "cuda/profile.h"

namespace pathattn::cuda {
namespace {

// Output memory as workspace (a dev build's PATHATTN_CUDA_BWD_OUT_WS=1, heuristics.h). The gradient outputs are
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

// The outputs of p (a call or a slice of one whose outputs_apart holds) that are dense blocks.
OutputHost output_host(const PathBwdParams& p) {
  auto block = [](const TensorView& t) { return OutputHost::Block{t.data, dense_bytes(t)}; };
  return {block(p.dq), block(p.dk), block(p.dv), block(p.dw)};
}


// One backward's state, shared by its phases (bwd_run calls them in order; the workspace's allocation order is
// theirs, the same whether it measures or allocates).
struct Bwd {
  Bwd(const PathBwdParams& p_, const core::Problem& pr_, Workspace& ws_) : p(p_), pr(pr_), ws(ws_) {}
  const PathBwdParams& p;
  const core::Problem& pr;
  Workspace& ws;
  KernelParams kp{};
  Tables t;
  TablePack tables;
  OutputHost oh;
  size_t NT = 0, H = 0, HQ = 0, K = 0, V = 0;
  int32_t* seq_first = nullptr;
  int nseqs = 0, q_items = 0, gq = 0, gk = 0, sb_rows = 0, sb_grid = 0;
  // The far kernels' tiles, grids and parking tables (device copies after the tables' commit).
  std::vector<int32_t> qfar_tiles, kfar_tiles;
  int qfar_grid = 0, kfar_grid = 0;
  int32_t *qfar_dev = nullptr, *kfar_dev = nullptr, *qpark_dev = nullptr, *kpark_dev = nullptr;
  int64_t qpark_slots = 0, kpark_slots = 0;
  size_t scratch_elems = 0;
  float2* lsd = nullptr;
  bool zero_qhat = false, kfar = false;
  char* b2 = nullptr;  // piece 2 (bwd_layout)
  size_t msv_off = 0;
  int* counters = nullptr;
};

// KernelParams of the backward from p (the inputs, the forward's outputs, the gradients, the mode).
void bwd_fill(Bwd& b) {
  const PathBwdParams& p = b.p;
  const core::Problem& pr = b.pr;
  KernelParams& kp = b.kp;
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
    kp.dw = p.dw.data;
    kp.dbeta = p.dbeta.data;
    kp.dw_dt = param_dt(p.dw);
    kp.dbeta_dt = param_dt(p.dbeta);
    strides3(p.dw, kp.dw_s);
    strides3(p.dbeta, kp.dbeta_s);
  }
  if (pr.gate) {
    kp.dg = p.dg.data;
    kp.dg_dt = param_dt(p.dg);
    strides3(p.dg, kp.dg_s);
  }
  kp.deterministic = p.deterministic;
  // The gate's column sums of dS from the query side (bwd_q, bwd_q_far), beside its row sums of the same dS, so
  // that the two cancel as in exact arithmetic: atomics, or in deterministic mode adds in a fixed order behind
  // tickets (bwd_q only). kDgSplit: bwd_k's sums of its own dS^T.
  kp.dgq = pr.gate && !kDgSplit;
}

// The chains' workspace: the forward's, delta, dqt, dP, E, the gate's sums, the superblocks' buffers and
// super_bwd's grid, the deterministic mode's tickets; the persistent grids' sizes.
Status bwd_alloc_main(Bwd& b, bool msv_early) {
  const PathBwdParams& p = b.p;
  const core::Problem& pr = b.pr;
  Workspace& ws = b.ws;
  KernelParams& kp = b.kp;
  const size_t NT = b.NT, H = b.H, HQ = b.HQ, K = b.K;
  const int dt = dtype_code(p.q.dtype);
  const size_t elem = size_t(dtype_size(p.q.dtype));
  PA_TRY(alloc_common(ws, kp, b.t, pr, b.tables, &b.seq_first, b.oh.dq.fits(NT * H * K * elem)));
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
  PA_TRY(alloc_super(ws, kp, b.t, pr, b.tables));  // ks: in the shared piece (bwd_layout)
  // Superblock-backward grid: one CTA per SM, each taking blocks of sb_rows rows of an item.
  b.sb_rows = int(K);
  if (kp.nsuper > 0) {
    int sms = 0, optin = 0;
    PA_CU(device_attr(cudaDevAttrMultiProcessorCount, &sms));
    PA_CU(device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin, &optin));
    b.sb_rows = super_bwd_rows(int(K), kp.nsuper * int(H), p.deterministic, sms, optin);
    if (const int forced = super_bwd_rows_forced(int(K), p.deterministic)) b.sb_rows = forced;
    b.sb_grid = std::min(kp.nsuper * int(H) * int(K) / b.sb_rows, sms);
    kp.dks = static_cast<float*>(b.oh.dw.fits(NT * H * K * sizeof(float)));
    if (kp.dks == nullptr) PA_CU(ws.alloc(&kp.dks, NT * H * K));
    PA_CU(ws.alloc(&kp.dps, size_t(kp.nsuper) * H * K * K));
    if (msv_early) PA_CU(ws.alloc(&kp.msv, size_t(kp.nsuper) * H * kp.sc * K * K));  // super_prep -> super_bwd
  }

  // Persistent grids: scratch_slots snapshots of C x K (16-bit) per CTA.
  b.nseqs = int(b.t.seq_first.size());
  b.q_items = kp.nchunks * int(HQ);
  if (p.deterministic) {  // the fixed order of the dP / dPS sums and of the gate's column sums (bwd_q.cu)
    const size_t n = (size_t(kp.nchunks) + size_t(kp.nsuper)) * (H + (kp.dgq ? HQ : 0)) + 1;
    PA_CU(ws.alloc(&kp.tickets, n));
    PA_CU(ws.zero(kp.tickets, n * sizeof(int)));
  }
  const int k_items = kp.nchunks * int(H);
  b.gq = std::min(b.q_items, bwd_q_max_grid(kp, dt));
  if (p.deterministic && kp.dgq) {  // bwd_q's ordered gate column sums (bwd_q.cu, kDetCols)
    PA_CU(ws.alloc(&kp.dgcolf, NT * HQ));
    PA_CU(ws.zero(kp.dgcolf, NT * HQ * sizeof(float)));
    PA_CU(ws.alloc(&kp.colscr, bwd_q_colscr_elems(std::max(b.gq, 1), kp.sc)));
  }
  b.gk = std::min(k_items, bwd_k_max_grid(kp, dt));
  if (b.gq <= 0 || b.gk <= 0) return internal("cuda: the backward kernels do not fit on this device (occupancy 0)");
  return Status::Ok();
}

// The far parts on Hopper (bwd_q_far.cu, bwd_k_far.cu), where this build, the device and the call allow them,
// and whether one fused kernel takes both; their parked states take the scratch too (they run between the scans,
// one at a time). Query side: tiles as the forward's; key side: tiles of a superblock pair's two chunks whose
// sequence goes on past their superblock; work: the later superblocks.
Status bwd_plan_far(Bwd& b) {
  const core::Problem& pr = b.pr;
  KernelParams& kp = b.kp;
  const Tables& t = b.t;
  const size_t H = b.H, HQ = b.HQ, K = b.K;
  const bool far = far_worth_it(kp.nsuper, t.max_chunks, kp.sc);
  if (far && bwd_q_far_usable(kp)) {
    b.qfar_tiles = far_query_tiles(t, kp.sc);
  }
  if (far && bwd_k_far_usable(kp)) {
    std::vector<int> work;
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const int walk = key_tile_walk(t.chunks[i], kp.sc);
      if (t.chunks[i].c % 2 != 0 || walk <= 0) continue;
      b.kfar_tiles.push_back(int32_t(i));
      work.push_back(walk);
    }
    b.kfar_tiles = order_far_tiles(std::move(b.kfar_tiles), work);
  }
  // One far kernel for both sides (bwd_k_far with kfuse: dq by reductions into dqt, dPS from the key chain; with
  // the gate also the gate's sums of dS) where both far kernels would run and it can (not in deterministic mode).
  kp.kfuse = kFarFuse && !b.qfar_tiles.empty() && !b.kfar_tiles.empty() && bwd_k_far_fusable(kp);
  // bwd_q / bwd_k park the states at earlier (later) superblocks' ends only where the far kernels do not take
  // those superblocks: with both far kernels, a CTA parks its own superblock's chunks alone.
  kp.scratch_slots = !b.qfar_tiles.empty() && !b.kfar_tiles.empty()
                         ? kp.sc
                         : scratch_slot_count(kp.max_chunks, pr.path, kp.sc);
  b.scratch_elems = size_t(std::max(b.gq, b.gk)) * kp.scratch_slots * kChunk * K;
  // A far kernel's parking table (far_park_first) on the device and its states in all (at least one: the scratch
  // and its tensor map need a row even where no tile parks).
  auto park_table = [&](const std::vector<int>& slots, int heads, int grid, int32_t** dev, int64_t* total) {
    const std::vector<int32_t> first = far_park_first(slots, heads, grid);
    *total = std::max<int64_t>(first.back(), 1);
    b.tables.add(first, [dev](int32_t* d) { *dev = d; });
  };
  if (!b.qfar_tiles.empty() && !kp.kfuse) {
    b.qfar_grid = far_grid(int64_t(b.qfar_tiles.size()) * int64_t(HQ));
    if (b.qfar_grid <= 0) return internal("cuda: no SM count for the query side's far kernel");
    std::vector<int> slots;  // a query tile parks its states at each earlier superblock
    for (const int32_t i : b.qfar_tiles) slots.push_back(t.chunks[size_t(i)].c / kp.sc);
    park_table(slots, int(HQ), b.qfar_grid, &b.qpark_dev, &b.qpark_slots);
    b.scratch_elems = std::max(b.scratch_elems, bwd_q_far_park_elems(b.qpark_slots, int(K)));
    b.tables.add(b.qfar_tiles, [&b](int32_t* d) { b.qfar_dev = d; });
  }
  b.kfar = !b.kfar_tiles.empty();
  if (b.kfar) {
    b.kfar_grid = far_grid(int64_t(b.kfar_tiles.size()) * int64_t(H));
    if (b.kfar_grid <= 0) return internal("cuda: no SM count for the key side's far kernel");
    std::vector<int> slots;  // a key tile parks its states at each later superblock but the first
    for (const int32_t i : b.kfar_tiles) slots.push_back(key_tile_walk(t.chunks[size_t(i)], kp.sc) - 1);
    park_table(slots, int(H), b.kfar_grid, &b.kpark_dev, &b.kpark_slots);
    b.scratch_elems = std::max(b.scratch_elems, bwd_k_far_park_elems(b.kpark_slots, int(K)));
    b.tables.add(b.kfar_tiles, [&b](int32_t* d) { b.kfar_dev = d; });
    PA_CU(b.ws.alloc(&b.lsd, size_t(kp.nchunks) * HQ * kChunk));
    // Its query tiles (TMA) read whole chunks: past a sequence's end, rows of the next one's superblock 0,
    // which bwd_q leaves unwritten. Their P is 0, but so must their qhat be (0 x NaN is NaN).
    for (const core::Seq& sq : pr.seqs) b.zero_qhat = b.zero_qhat || sq.len % kChunk != 0;
  }
  return Status::Ok();
}

// Buffers that are never live at once share memory (kernel order: chunk_prep, super_prep, bwd_q, bwd_q_far,
// bwd_k_far, bwd_k, super_bwd, bwd_chunk; with kfuse bwd_q (qhat), bwd_k_far, bwd_q, bwd_k, ...). dkt (bwd_k
// .. bwd_chunk): over qhat and ks (super_prep / bwd_q .. bwd_k_far) where bwd_k_far ran; else (bwd_k reads
// qhat), with MHA and K = V, over dvdiag, whose layout it has (bwd_k reads a thread's dvdiag elements before it
// writes the same dkt elements). Piece 2: dvdiag, dvk and the persistent grids' scratch (bwd_q .. bwd_k), then
// (msv_early false) msv over all of them but a dvdiag that holds dkt (bwd_k .. super_bwd).
// With output memory as workspace, qhat (read by bwd_k where bwd_k_far does not run) in dv's only with kfar,
// ks in dk's; then dkt over dvdiag with kfar too. Then the item counters and the tables' upload.
Status bwd_layout(Bwd& b, bool msv_early) {
  KernelParams& kp = b.kp;
  const OutputHost& oh = b.oh;
  const bool kfar = b.kfar;
  const size_t NT = b.NT, H = b.H, HQ = b.HQ, K = b.K, V = b.V;
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
  const size_t scratch_off = l2.add(b.scratch_elems * sizeof(__half));
  b.msv_off = msv_early || kp.nsuper == 0
                  ? 0
                  : l2.at(dkt_on_dvdiag ? after_dvdiag : 0, size_t(kp.nsuper) * H * kp.sc * K * K * sizeof(__half));
  char* b1 = nullptr;
  PA_CU(b.ws.alloc(&b1, l1.bytes));
  PA_CU(b.ws.alloc(&b.b2, l2.bytes));
  if (kp.nsuper > 0) {
    kp.qhat = host_qhat ? qhat_at : piece<__half>(b1, qhat_off);
    kp.ks = host_ks ? ks_at : piece<__half>(b1, ks_off);
  }
  kp.dkt = dkt_on_dvdiag ? piece<float>(b.b2, dvdiag_off) : piece<float>(b1, dkt_off);
  kp.dvdiag = piece<float>(b.b2, dvdiag_off);
  if (kfar) kp.dvk = piece<float>(b.b2, dvk_off);  // the far part of dv, for bwd_k
  kp.scratch = piece<__half>(b.b2, scratch_off);
  // Item counters (zeroed by chunk_prep): bwd_q_far, bwd_k_far, bwd_q's qhat launch, bwd_q's last launch, bwd_k.
  PA_CU(b.ws.alloc(&b.counters, kBwdCounters));
  kp.counters = b.counters;
  PA_TRY(b.tables.commit(b.ws));
  return Status::Ok();
}

// The backward's launches on p's stream.
Status bwd_launch(Bwd& b, bool msv_early) {
  KernelParams& kp = b.kp;
  const int dt = dtype_code(b.p.q.dtype);
  cudaStream_t s = static_cast<cudaStream_t>(b.p.stream);
  int* const counters = b.counters;
  if (b.zero_qhat) PA_CU(b.ws.zero(kp.qhat, b.NT * b.HQ * b.K * 2));
  // The fused far kernel adds the far part of the gate's row sums into dgrow (bwd_q_far would write it).
  if (b.pr.gate && kp.kfuse) PA_CU(b.ws.zero(kp.dgrow, b.NT * b.HQ * sizeof(float)));

  Profile prof(s, "bwd");
  if (b.pr.gate) PA_CU(launch_gate_cumsum(kp, b.seq_first, b.nseqs, s));
  PA_CU(launch_chunk_prep(kp, dt, s));
  PA_CU(launch_bwd_delta(kp, b.lsd, dt, s));
  prof.mark("gate+chunk_prep+delta");
  PA_CU(launch_super_prep(kp, dt, s));
  prof.mark("super_prep");
  if (!b.qfar_tiles.empty()) {  // qhat, the far superblocks, then the own superblock's part
    KernelParams k1 = kp;
    k1.qfar = 1;
    PA_CU(launch_bwd_q(k1, dt, b.gq, b.q_items, counters + 2, s));
    prof.mark("bwd_q(qhat)");
    if (kp.kfuse) {
      PA_CU(launch_bwd_k_far(kp, b.kfar_dev, int(b.kfar_tiles.size()), b.lsd, b.kpark_dev, b.kpark_slots,
                             b.kfar_grid, counters + 1, dt, s));
      prof.mark("bwd_k_far(fused)");
    } else {
      PA_CU(launch_bwd_q_far(kp, b.qfar_dev, int(b.qfar_tiles.size()), b.qpark_dev, b.qpark_slots, b.qfar_grid,
                             counters, dt, s));
      prof.mark("bwd_q_far");
    }
    kp.qfar = 2;
  }
  PA_CU(launch_bwd_q(kp, dt, b.gq, b.q_items, counters + 3, s));
  prof.mark("bwd_q");
  if (!b.kfar_tiles.empty()) {  // (with kfuse it ran before bwd_q)
    if (!kp.kfuse) {
      PA_CU(launch_bwd_k_far(kp, b.kfar_dev, int(b.kfar_tiles.size()), b.lsd, b.kpark_dev, b.kpark_slots,
                             b.kfar_grid, counters + 1, dt, s));
      prof.mark("bwd_k_far");
    }
    kp.kfar = true;
  }
  PA_CU(launch_bwd_k(kp, dt, b.gk, counters + 4, s));
  prof.mark("bwd_k");
  if (!msv_early && kp.nsuper > 0) {  // M_c only, into the memory bwd_q .. bwd_k are done with
    kp.msv = piece<__half>(b.b2, b.msv_off);
    PA_CU(launch_super_prep(kp, dt, s, false));
    prof.mark("super_prep(msv)");
  }
  PA_CU(launch_super_bwd(kp, dt, b.sb_rows, b.sb_grid, s));
  prof.mark("super_bwd");
  PA_CU(launch_bwd_chunk(kp, dt, s));
  prof.mark("bwd_chunk");
  if (b.pr.gate) PA_CU(launch_bwd_dg(kp, b.seq_first, b.nseqs, s));
  return Status::Ok();
}

}  // namespace

// Asked of the whole call (bwd): its slices then hold the same for theirs.
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

Status bwd_run(const PathBwdParams& p, const core::Problem& pr, Workspace& ws, bool msv_early, bool host_out) {
  Bwd b(p, pr, ws);
  b.kp.sc = bwd_super_chunks(longest_seq(pr), int(pr.K), int(pr.V), pr.gate, p.deterministic);
  b.t = build_tables(pr, b.kp.sc);
  bwd_fill(b);
  b.NT = size_t(pr.B) * pr.T;
  b.H = pr.H;
  b.HQ = pr.HQ;
  b.K = pr.K;
  b.V = pr.V;
  b.oh = host_out ? output_host(p) : OutputHost{};
  PA_TRY(bwd_alloc_main(b, msv_early));
  PA_TRY(bwd_plan_far(b));
  PA_TRY(bwd_layout(b, msv_early));
  if (ws.measuring()) return Status::Ok();
  return bwd_launch(b, msv_early);
}

}  // namespace pathattn::cuda
