// cuda/backend.cu: the adapter of the CUDA backend: the entries fwd() and bwd() check what the kernels support,
// fill KernelParams from the validated core::Problem and run the launch sequence (the forward's here, the
// backward's in bwd_run.cu) over the planner's slices on the caller's stream. Workspace is allocated
// stream-ordered (cudaMallocAsync): every buffer is O(T), none O(T^2).
#include <algorithm>
#include <string>
#include <vector>

#include "cuda/adapter.h"
#include "cuda/cuda_backend.h"
#include "cuda/heuristics.h"
#include "cuda/launchers.h"
#include "cuda/profile.h"

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

}  // namespace

void strides3(const TensorView& v, int64_t (&s)[3]) {
  for (int i = 0; i < 3; ++i) s[i] = v.ndim > i ? v.stride[i] : 0;
}

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
  kp.w = pr.path ? w.data : nullptr;
  kp.beta = pr.path ? beta.data : nullptr;
  kp.g = pr.gate ? g.data : nullptr;
  kp.w_dt = param_dt(w);
  kp.beta_dt = param_dt(beta);
  kp.g_dt = param_dt(g);
  if (pr.path) {
    strides3(w, kp.w_s);
    strides3(beta, kp.beta_s);
  }
  if (pr.gate) strides3(g, kp.g_s);
}

Status alloc_common(Workspace& ws, KernelParams& kp, const Tables& t, const core::Problem& pr, TablePack& tables,
                    int32_t** seq_first_dev, void* kt_at) {
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
  PA_CU(ws.alloc(&kp.bad, size_t(kp.nchunks) * H));  // chunk_prep -> its repair launch (and bwd_chunk)
  if (pr.gate) {
    PA_CU(ws.alloc(&kp.G, NT * HQ));
    PA_CU(ws.alloc(&kp.gc, size_t(kp.nchunks) * HQ * kChunk));
  }
  return Status::Ok();
}

// The keys moved to their superblock's end (kp.ks, [NT, H, K]) are the caller's to place.
Status alloc_super(Workspace& ws, KernelParams& kp, const Tables& t, const core::Problem& pr, TablePack& tables) {
  kp.nsuper = pr.path ? int(t.super_first.size()) : 0;
  if (kp.nsuper == 0) return Status::Ok();
  tables.add(t.super_first, [&kp](const int32_t* d) { kp.super_first = d; });
  PA_CU(ws.alloc(&kp.ps, size_t(kp.nsuper) * pr.H * pr.K * pr.K));
  return Status::Ok();
}

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
  if (far_worth_it(kp.nsuper, t.max_chunks, kp.sc) && fwd_far_usable(kp)) far_tiles = far_query_tiles(t, kp.sc);
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

const char* supported_head_dims() { return "K, V in {64, 128} (the forward and backward also 16 and 32, padded)"; }

// Entry points with fp32 w, beta, g (and dw, dbeta, dg); param_dtypes.cu converts other dtypes.
Status fwd(const PathFwdParams& p, const core::Problem& pr) {
  if (needs_padding(pr)) return fwd_padded(p, pr);
  PA_TRY(check_support(pr, p.q.dtype));
  PA_TRY(check_row_copies(p.v, "v"));
  PA_TRY(check_smem(smem_chunk_prep(int(pr.K)), "chunk"));
  PA_TRY(check_smem(smem_super_prep(int(pr.K)), "superblock"));
  PA_TRY(check_smem(smem_fwd_scan(int(pr.K), int(pr.V)), "forward"));
  return run_sliced(p, pr, fwd_run);
}

Status bwd(const PathBwdParams& p, const core::Problem& pr) {
  if (needs_padding(pr)) return bwd_padded(p, pr);
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
  // super_prep launch where the call fits whole with them kept from there, or its plan with them splits batch rows
  // no further than with a second launch after bwd_k (and keeps to the limit); else from that second launch. Both
  // are the same steps of M: the results do not depend on the choice (docs/cuda.md).
  const bool host_out = kBwdOutWs && outputs_apart(p);
  const auto early = [host_out](const PathBwdParams& sp, const core::Problem& spr, Workspace& ws) {
    return bwd_run(sp, spr, ws, true, host_out);
  };
  const auto late = [host_out](const PathBwdParams& sp, const core::Problem& spr, Workspace& ws) {
    return bwd_run(sp, spr, ws, false, host_out);
  };
  if constexpr (kSuperMsv == 0 || kSuperMsv == 1)
    return kSuperMsv == 1 ? run_sliced(p, pr, early, host_out) : run_sliced(p, pr, late, host_out);
  CallPlan a, b;
  PA_TRY(plan_call(p, pr, early, &a, host_out));
  if (a.whole) return run_planned(p, pr, early, a);
  PA_TRY(plan_call(p, pr, late, &b, host_out));
  if (!b.whole && a.fits()) {
    const core::Slice &sa = a.lanes.slices[0], &sb = b.lanes.slices[0];
    if (host_out ? sa.nb * sa.nh >= sb.nb * sb.nh : sa.nb >= sb.nb) return run_planned(p, pr, early, a);
  }
  return run_planned(p, pr, late, b);
}

}  // namespace pathattn::cuda
