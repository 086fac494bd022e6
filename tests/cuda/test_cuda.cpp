// tests/cuda/test_cuda.cpp: the CUDA backend against the fp64 oracle on fresh random inputs (forward and
// backward), bitwise repeatability (100 runs), error paths, and a long sequence checked on sampled rows.
// Every test skips (exit code 0, with a message) when no CUDA device is present, so CPU-only CI passes.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/device/kspan.h"
#include "cuda/heuristics.h"
#include "check/harness.h"
#include "gpu_skip.h"

namespace pathattn::test {
namespace {

// A device copy of a host tensor (same dtype and shape, contiguous), poisoned (all bits set: NaN) when
// made as an output.
struct DevTensor {
  void* ptr = nullptr;
  TensorView view{};
  size_t bytes = 0;
  DevTensor() = default;
  explicit DevTensor(const HostTensor& h, bool copy = true) {
    view = h.view();
    bytes = size_t(h.numel() * dtype_size(h.dtype()));
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(bytes, 1)), cudaSuccess);
    if (copy) EXPECT_EQ(cudaMemcpy(ptr, h.view().data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    else poison();
    view.data = ptr;
    view.device = Device::cuda;
  }
  DevTensor(const DevTensor&) = delete;
  DevTensor& operator=(const DevTensor&) = delete;
  DevTensor(DevTensor&& o) noexcept { *this = std::move(o); }
  DevTensor& operator=(DevTensor&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(view, o.view);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DevTensor() {
    if (ptr) cudaFree(ptr);
  }
  void poison() { EXPECT_EQ(cudaMemset(ptr, 0xFF, bytes), cudaSuccess); }
  void to_host(HostTensor& h) const {
    EXPECT_EQ(cudaMemcpy(h.mutable_view().data, ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  std::vector<uint8_t> raw() const {
    std::vector<uint8_t> r(bytes);
    EXPECT_EQ(cudaMemcpy(r.data(), ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return r;
  }
};

DevTensor dev_in(const HostTensor& h) { return h.present() ? DevTensor(h, true) : DevTensor(); }
TensorView vw(const DevTensor& d) { return d.ptr ? d.view : TensorView{}; }

struct GpuRun {
  HostTensor o, lse, dq, dk, dv, dw, dbeta, dg;
  Status fs, bs;
};

// Device inputs of a case, kept for repeated runs.
struct GpuCase {
  const Case* c;
  DevTensor q, k, v, w, beta, g, dout;
  explicit GpuCase(const Case& cs, const HostTensor* dout_h = nullptr) : c(&cs) {
    q = dev_in(cs.q);
    k = dev_in(cs.k);
    v = dev_in(cs.v);
    w = dev_in(cs.w);
    beta = dev_in(cs.beta);
    g = dev_in(cs.g);
    if (dout_h) dout = dev_in(*dout_h);
  }
  PathFwdParams fwd_params(const DevTensor& o, const DevTensor& lse) const {
    PathFwdParams p;
    p.q = vw(q);
    p.k = vw(k);
    p.v = vw(v);
    p.w = vw(w);
    p.beta = vw(beta);
    p.g = vw(g);
    if (c->cu.present()) p.cu_seqlens = c->cu.view();
    p.scale = kDefaultScale;
    p.gate_scale = c->spec.gate_scale;
    p.o = vw(o);
    p.lse = vw(lse);
    p.backend = Backend::cuda;
    return p;
  }
};

// Runs forward (and backward when dout is given) on the GPU into poisoned outputs.
// ws_limit: the params' workspace_limit (0: the default).
GpuRun run_gpu(const GpuCase& gc, bool backward, bool deterministic, int64_t ws_limit = 0) {
  const CaseSpec& s = gc.c->spec;
  GpuRun r;
  r.o = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.V});
  r.lse = HostTensor(DType::f32, {s.B, s.T, s.HQ});
  DevTensor o(r.o, false), lse(r.lse, false);
  PathFwdParams fp = gc.fwd_params(o, lse);
  fp.workspace_limit = ws_limit;
  r.fs = path_attn_fwd(fp);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o.to_host(r.o);
  lse.to_host(r.lse);
  if (!backward || !r.fs.ok()) return r;
  r.dq = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.K});
  r.dk = HostTensor(s.dtype, {s.B, s.T, s.H, s.K});
  r.dv = HostTensor(s.dtype, {s.B, s.T, s.H, s.V});
  DevTensor dq(r.dq, false), dk(r.dk, false), dv(r.dv, false), dw, dbeta, dg;
  PathBwdParams p = bwd_params_for(fp);
  p.do_ = vw(gc.dout);
  p.dq = vw(dq);
  p.dk = vw(dk);
  p.dv = vw(dv);
  if (s.path) {
    r.dw = HostTensor(gc.c->w.dtype(), {s.B, s.T, s.H, s.K});  // gradients in the dtype of their input
    r.dbeta = HostTensor(gc.c->beta.dtype(), {s.B, s.T, s.H});
    dw = DevTensor(r.dw, false);
    dbeta = DevTensor(r.dbeta, false);
    p.dw = vw(dw);
    p.dbeta = vw(dbeta);
  }
  if (s.gate) {
    r.dg = HostTensor(gc.c->g.dtype(), {s.B, s.T, s.HQ});
    dg = DevTensor(r.dg, false);
    p.dg = vw(dg);
  }
  p.deterministic = deterministic;
  r.bs = path_attn_bwd(p);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dq.to_host(r.dq);
  dk.to_host(r.dk);
  dv.to_host(r.dv);
  if (s.path) {
    dw.to_host(r.dw);
    dbeta.to_host(r.dbeta);
  }
  if (s.gate) dg.to_host(r.dg);
  return r;
}

// Relative L2 error over the rows that belong to some sequence (varlen gaps do not exist: cu ends at T).
double err(const HostTensor& got, const HostTensor& ref) { return rel_l2(got.to_f64(), ref.to_f64()); }

struct Tol {
  double o = 4e-3, lse = 1e-3, dqkv = 1e-2, dwbg = 2e-2;
};

void check_case(const CaseSpec& spec, bool backward, Tol tol = {}, bool print = false) {
  Case c = Case::make(spec);
  Case c64 = to_f64(c);
  HostTensor dout = random_dout(c, spec.seed + 7);
  HostTensor dout64 = dout.cast(DType::f64);
  FwdOut ref = run_fwd(c64, Backend::oracle);
  ASSERT_TRUE(ref.status.ok()) << ref.status.message();
  GpuCase gc(c, &dout);
  GpuRun g = run_gpu(gc, backward, false);
  ASSERT_TRUE(g.fs.ok()) << g.fs.message();
  ASSERT_TRUE(all_finite(g.o.to_f64())) << "o has NaN/Inf (unwritten or overflow) " << spec.name();
  ASSERT_TRUE(all_finite(g.lse.to_f64())) << "lse has NaN/Inf " << spec.name();
  const double eo = err(g.o, ref.o), el = err(g.lse, ref.lse);
  EXPECT_LE(eo, tol.o) << spec.name();
  EXPECT_LE(el, tol.lse) << spec.name();
  if (!backward) {
    if (print) std::printf("[acc] %-60s o %.2e lse %.2e\n", spec.name().c_str(), eo, el);
    return;
  }
  BwdOut rb = run_bwd(c64, ref, dout64, Backend::oracle);
  ASSERT_TRUE(rb.status.ok()) << rb.status.message();
  ASSERT_TRUE(g.bs.ok()) << g.bs.message();
  for (const HostTensor* t : {&g.dq, &g.dk, &g.dv, &g.dw, &g.dbeta, &g.dg})
    if (t->present()) {
      ASSERT_TRUE(all_finite(t->to_f64())) << "a gradient has NaN/Inf " << spec.name();
    }
  const double edq = err(g.dq, rb.dq), edk = err(g.dk, rb.dk), edv = err(g.dv, rb.dv);
  EXPECT_LE(edq, tol.dqkv) << "dq " << spec.name();
  EXPECT_LE(edk, tol.dqkv) << "dk " << spec.name();
  EXPECT_LE(edv, tol.dqkv) << "dv " << spec.name();
  double edw = 0, edb = 0, edg = 0;
  if (spec.path) {
    edw = err(g.dw, rb.dw);
    edb = err(g.dbeta, rb.dbeta);
    EXPECT_LE(edw, tol.dwbg) << "dw " << spec.name();
    EXPECT_LE(edb, tol.dwbg) << "dbeta " << spec.name();
  }
  if (spec.gate) {
    edg = err(g.dg, rb.dg);
    EXPECT_LE(edg, tol.dwbg) << "dg " << spec.name();
  }
  if (print)
    std::printf("[acc] %-60s o %.2e lse %.2e dq %.2e dk %.2e dv %.2e dw %.2e dbeta %.2e dg %.2e\n",
                spec.name().c_str(), eo, el, edq, edk, edv, edw, edb, edg);
}

CaseSpec mk(int64_t T, int64_t HQ, int64_t H, int64_t K, int64_t V, bool gate, BetaMode bm, DType dt, uint64_t seed) {
  CaseSpec s;
  s.B = 2;
  s.T = T;
  s.HQ = HQ;
  s.H = H;
  s.K = K;
  s.V = V;
  s.gate = gate;
  s.beta = bm;
  s.dtype = dt;
  s.seed = seed;
  return s;
}

// The chunk kernels skip the k steps a warp's tile cannot use (KSpan). Host-only, so it runs without a GPU too:
// for every combination of triangle bounds (none, -1, 0, 1 on each of the five) and every warp tile of the
// kernels' product shapes (64 rows; 64 columns in n-groups of 16 or 128 in groups of 32; inner 64 or 128),
// each output (r, c) the mask keeps gives the interval of k its bounds allow; the range must hold all of
// them, in whole steps of 8 within [0, KD), and where the bounds are consistent and no mask applies, be the
// smallest such range.
TEST(KSpan, RangeHoldsEveryUsableTermAndNoMore) {
  using pathattn::cuda::KSpan;
  const int kNo = KSpan::kNone, vals[4] = {kNo, -1, 0, 1};
  const int shapes[3][3] = {{64, 16, 64}, {64, 16, 128}, {128, 32, 64}};  // N, n-group width, KD
  int checked = 0;
  for (int i = 0; i < 4 * 4 * 4 * 4 * 4; ++i) {
    const int kmin_r = vals[i % 4], kmax_r = vals[i / 4 % 4], kmin_c = vals[i / 16 % 4], kmax_c = vals[i / 64 % 4],
              out = vals[i / 256];
    KSpan sp;
    if (kmin_r != kNo) sp = sp.kmin_r(kmin_r);
    if (kmax_r != kNo) sp = sp.kmax_r(kmax_r);
    if (kmin_c != kNo) sp = sp.kmin_c(kmin_c);
    if (kmax_c != kNo) sp = sp.kmax_c(kmax_c);
    if (out != kNo) sp = sp.out_lower(out);
    const bool consistent = (kmin_r == kNo || kmax_r == kNo || kmin_r <= kmax_r) &&
                            (kmin_c == kNo || kmax_c == kNo || kmin_c <= kmax_c);
    for (const auto& sh : shapes) {
      const int N = sh[0], w = sh[1], KD = sh[2];
      for (int r0 = 0; r0 < 64; r0 += 16)
        for (int c0 = 0; c0 < N; c0 += w) {
          const int r1 = r0 + 16, c1 = c0 + w;
          int lo = -1, hi = -1;
          sp.range(r0, r1, c0, c1, KD, lo, hi);
          const std::string where = "span " + std::to_string(i) + ", rows " + std::to_string(r0) + ", columns " +
                                    std::to_string(c0) + "+" + std::to_string(w) + ", KD " + std::to_string(KD) +
                                    ": [" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
          ASSERT_TRUE(lo >= 0 && lo <= hi && hi <= KD && lo % 8 == 0 && hi % 8 == 0) << where;
          int need_lo = KD, need_hi = 0;  // the union of the outputs' usable k: [need_lo, need_hi)
          for (int r = r0; r < r1; ++r)
            for (int c = c0; c < c1; ++c) {
              if (out != kNo && c > r + out) continue;
              int a = 0, b = KD - 1;  // this output's usable k: [a, b]
              if (kmin_r != kNo) a = std::max(a, r + kmin_r);
              if (kmin_c != kNo) a = std::max(a, c + kmin_c);
              if (kmax_r != kNo) b = std::min(b, r + kmax_r);
              if (kmax_c != kNo) b = std::min(b, c + kmax_c);
              if (a > b) continue;
              ASSERT_TRUE(a >= lo && b < hi) << where << " misses k " << a << ".." << b << " of (" << r << ", " << c
                                             << ")";
              need_lo = std::min(need_lo, a);
              need_hi = std::max(need_hi, b + 1);
            }
          if (out == kNo && consistent) {
            const bool none = need_hi <= need_lo;
            EXPECT_EQ(lo, none ? 0 : need_lo / 8 * 8) << where;
            EXPECT_EQ(hi, none ? 0 : (need_hi + 7) / 8 * 8) << where;
          }
          ++checked;
        }
    }
  }
  EXPECT_EQ(checked, 1024 * 48);
}

TEST(CudaBackend, ForwardBackwardSmallSizes) {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (int64_t T : {1, 17, 64, 65, 200})
    for (auto kv : {std::pair<int, int>{64, 64}, {128, 128}, {64, 128}, {128, 64}})
      for (bool gqa : {false, true}) {
        const bool gate = (seed % 2) == 0;
        const BetaMode bm = (seed % 3) == 0 ? BetaMode::two : BetaMode::uniform02;
        const DType dt = (seed % 4) < 2 ? DType::bf16 : DType::f16;
        check_case(mk(T, gqa ? 4 : 2, 2, kv.first, kv.second, gate, bm, dt, seed++), true, {}, true);
      }
}

// Head dims 16 and 32 run at 64 on zero-padded copies (pad.cu): against the oracle as every other shape, with
// GQA, the gate, beta = 2 and varlen (empty sequences, more than two superblocks).
TEST(CudaBackend, HeadDims16And32Padded) {
  REQUIRE_GPU();
  uint64_t seed = 700;
  for (auto kv : {std::pair<int, int>{16, 16}, {32, 32}, {16, 64}, {32, 128}, {64, 32}})
    for (int64_t T : {1, 65, 200}) {
      const bool gate = (seed % 2) == 0;
      check_case(mk(T, 4, 2, kv.first, kv.second, gate, (seed % 3) == 0 ? BetaMode::two : BetaMode::uniform02,
                    (seed % 4) < 2 ? DType::bf16 : DType::f16, seed), true, {}, true);
      ++seed;
    }
  CaseSpec s = mk(0, 4, 2, 32, 32, true, BetaMode::uniform02, DType::bf16, 720);
  s.seqlens = {0, 1100, 17, 0, 600};
  check_case(s, true, {}, true);
}

TEST(CudaBackend, Varlen) {
  REQUIRE_GPU();
  for (bool gate : {false, true}) {
    CaseSpec s = mk(0, 4, 2, 64, 64, gate, BetaMode::uniform02, DType::bf16, gate ? 11 : 12);
    s.seqlens = {0, 17, 0, 130, 64, 1, 0, 65};
    check_case(s, true, {}, true);
    s.K = s.V = 128;
    s.seqlens = {70, 0, 3};
    check_case(s, true, {}, true);
  }
  // Sequences long enough for the two-level scans (superblocks of 512 keys), one of them ending exactly on
  // a superblock boundary, with GQA, the gate and beta = 2 everywhere.
  CaseSpec s = mk(0, 4, 2, 64, 64, true, BetaMode::two, DType::bf16, 13);
  s.seqlens = {1100, 0, 1536, 7, 600};
  check_case(s, true, {}, true);
  s = mk(0, 2, 1, 128, 128, false, BetaMode::uniform02, DType::f16, 14);
  s.seqlens = {2049, 1024};
  check_case(s, true, {}, true);
}

TEST(CudaBackend, PlainAttentionWithoutW) {
  REQUIRE_GPU();
  CaseSpec s = mk(150, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 21);
  s.path = false;
  check_case(s, true, {}, true);
  // q entries far beyond fp16's 65504 (bf16 holds them): plain attention reads q itself, not an fp16 copy. The
  // softmax is one-hot at these scores, so the forward is checked (the gradients through it are exact zeros).
  s = mk(150, 4, 2, 128, 128, false, BetaMode::uniform02, DType::bf16, 22);
  s.path = false;
  s.q_scale = 3e5;
  check_case(s, false, {}, true);
}

// Gradients far below and far above fp16's range (dO ~ N(0, 1e-18) and N(0, 1e14), bf16): the transport adjoints
// take fp16 operands after scaling each row, and the dP / dPS sums after scaling each tile, by a power of two
// (docs/cuda.md, "Precision choices"); without the scales the first flushes to zero and the second overflows.
TEST(CudaBackend, GradientRange) {
  REQUIRE_GPU();
  CaseSpec s = mk(1100, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 41);
  s.do_scale = 1e-9;
  check_case(s, true, {}, true);
  s = mk(1100, 2, 2, 128, 128, false, BetaMode::two, DType::bf16, 42);
  s.do_scale = 1e7;
  check_case(s, true, {}, true);
}

TEST(CudaBackend, LongerSequences) {
  REQUIRE_GPU();
  CaseSpec s = mk(1000, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 31);
  check_case(s, true, {}, true);
  s = mk(1000, 2, 2, 128, 128, false, BetaMode::two, DType::f16, 32);
  check_case(s, true, {}, true);
  s = mk(4097, 2, 1, 64, 64, true, BetaMode::uniform02, DType::bf16, 33);
  s.B = 1;
  check_case(s, true, {}, true);
  s = mk(4097, 1, 1, 128, 128, false, BetaMode::two, DType::bf16, 34);
  s.B = 1;
  check_case(s, false, {}, true);
}

// The paths a build runs: the far kernels on sm_90a builds and Hopper devices (fwd_far; bwd_k_far fused where the
// gate is off and the mode is not deterministic, else bwd_q_far and bwd_k_far), the scans alone on every other
// device, on a compute_80 build (scripts/gpu_suite.sh --sm80) and in a dev build with -DPATHATTN_CUDA_FAR=0, the
// two unfused far kernels without the gate in a dev build with -DPATHATTN_CUDA_FAR_FUSE=0 (heuristics.h).
// The forward past two superblocks against the oracle: MHA and GQA, gate on and off, an odd number of chunks (the
// last far tile's second chunk absent).
TEST(CudaBackend, ForwardFarPath) {
  REQUIRE_GPU();
  CaseSpec s = mk(1600, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 91);
  check_case(s, false, {}, true);
  s = mk(1100, 2, 2, 128, 128, false, BetaMode::two, DType::f16, 92);
  check_case(s, false, {}, true);
  s = mk(2500, 2, 1, 128, 128, true, BetaMode::near2, DType::bf16, 93);
  s.B = 1;
  check_case(s, false, {}, true);
}

// The forward on the build's superblock size (8 chunks; 4 or 6 in a dev build with
// -DPATHATTN_CUDA_FWD_SUPER_CHUNKS) against the oracle: fwd_far's 128-key tiles, its crossings and their product
// loads; an odd chunk count, GQA with the gate, varlen with an empty sequence, beta = 2.
TEST(CudaBackend, ForwardSuperblockSize) {
  REQUIRE_GPU();
  std::printf("[superblock] forward: %d chunks a superblock\n", cuda::fwd_super_chunks());
  CaseSpec s = mk(2500, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 141);
  s.B = 1;
  check_case(s, false, {}, true);
  check_case(mk(1100, 2, 2, 128, 128, false, BetaMode::two, DType::f16, 142), false, {}, true);
  s = mk(0, 2, 1, 128, 128, false, BetaMode::near2, DType::bf16, 143);
  s.B = 1;
  s.seqlens = {0, 1900, 0, 777};
  check_case(s, false, {}, true);
}

// The backward's far parts (bwd_k_far alone or with bwd_q_far on Hopper, else the scans alone) against the
// oracle, all three ways: GQA, rows past a sequence's end in its last chunk (T % 64 != 0: the next batch row's
// or sequence's rows in the tiles), a tile's second chunk past the end, varlen with an empty sequence, one to
// nine superblocks crossed (each superblock size: 256, 384 and 512 tokens), beta = 2 and near 2, the gate (the
// far kernels take it where a sequence is longer than 2048 tokens; the far query kernel, or the fused far kernel,
// takes the gate's row and column sums of dS).
TEST(CudaBackend, BackwardFarAndWhole) {
  REQUIRE_GPU();
  {
    check_case(mk(1600, 4, 2, 64, 64, false, BetaMode::uniform02, DType::bf16, 94), true, {}, true);
    check_case(mk(1100, 2, 2, 128, 128, false, BetaMode::two, DType::f16, 95), true, {}, true);
    CaseSpec s = mk(0, 2, 1, 128, 128, false, BetaMode::near2, DType::bf16, 96);
    s.B = 1;
    s.seqlens = {0, 700, 1363, 37};
    check_case(s, true, {}, true);
    s = mk(0, 4, 2, 128, 128, true, BetaMode::uniform02, DType::bf16, 98);
    s.B = 1;
    s.seqlens = {0, 2200, 301};
    check_case(s, true, {}, true);
    s = mk(2500, 2, 2, 64, 64, false, BetaMode::near2, DType::bf16, 97);
    s.B = 1;
    check_case(s, true, {}, true);
    s.gate = true;
    s.seed = 99;
    check_case(s, true, {}, true);
    // K = 128 past 2048 tokens without the gate: superblocks of 6 chunks (384 tokens, six crossed), GQA.
    s = mk(2500, 4, 2, 128, 128, false, BetaMode::uniform02, DType::bf16, 100);
    s.B = 1;
    check_case(s, true, {}, true);
    // K = 64 past 4096 tokens without the gate: the superblocks of 512 tokens (eight crossed).
    s = mk(4200, 2, 1, 64, 64, false, BetaMode::near2, DType::bf16, 101);
    s.B = 1;
    check_case(s, true, {}, true);
    // The gate in the fused far kernel (its sums of dS into dgrow / dgcol) with GQA, two batch rows (the next
    // row's queries in the last tiles) and a last chunk part past the end.
    check_case(mk(2150, 4, 2, 64, 64, true, BetaMode::near2, DType::bf16, 102), true, {}, true);
  }
}

// The accuracy bar of the CUDA issue: bf16, T in 512..2048, K in {64, 128}, beta ~ U(0, 2), gate on/off.
TEST(CudaBackend, AccuracyBar) {
  REQUIRE_GPU();
  uint64_t seed = 500;
  for (int64_t T : {512, 2048})
    for (int64_t K : {64, 128})
      for (bool gate : {false, true}) {
        CaseSpec s = mk(T, 2, 2, K, K, gate, BetaMode::uniform02, DType::bf16, seed++);
        s.B = 1;
        check_case(s, true, {}, true);
      }
}

bool same_bits(const HostTensor& a, const HostTensor& b) {
  if (a.present() != b.present()) return false;
  return !a.present() || std::memcmp(a.view().data, b.view().data, size_t(a.numel() * dtype_size(a.dtype()))) == 0;
}

TEST(CudaBackend, RepeatableBitwise) {
  REQUIRE_GPU();
  CaseSpec s = mk(1700, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 41);  // crosses superblocks
  Case c = Case::make(s);
  HostTensor dout = random_dout(c, 42);
  GpuCase gc(c, &dout);
  GpuRun first = run_gpu(gc, true, true);
  ASSERT_TRUE(first.fs.ok() && first.bs.ok());
  const auto same = same_bits;
  int diff_fwd = 0, diff_bwd = 0;
  for (int run = 0; run < 100; ++run) {
    GpuRun r = run_gpu(gc, true, true);
    ASSERT_TRUE(r.fs.ok() && r.bs.ok());
    if (!same(r.o, first.o) || !same(r.lse, first.lse)) ++diff_fwd;
    if (!same(r.dq, first.dq) || !same(r.dk, first.dk) || !same(r.dv, first.dv) || !same(r.dw, first.dw) ||
        !same(r.dbeta, first.dbeta) || !same(r.dg, first.dg))
      ++diff_bwd;
  }
  EXPECT_EQ(diff_fwd, 0) << "forward outputs differ bitwise between runs";
  EXPECT_EQ(diff_bwd, 0) << "deterministic backward gradients differ bitwise between runs";
  std::printf("[race] 100 runs: forward differing %d, deterministic backward differing %d\n", diff_fwd, diff_bwd);
}

// A workspace limit below what a call needs runs it in slices of kv heads, then of batch rows; the slices are
// independent, so outputs and (deterministic) gradients equal the unsliced call's bitwise. GQA, the gate,
// superblocks crossed, and varlen (head slices only).
TEST(CudaBackend, WorkspaceLimitSlicesBitwise) {
  REQUIRE_GPU();
  // Cases: batched; varlen; batched with enough superblock items (8 rows x 2 x 9 kv heads = 144) that the whole
  // call's super_prep takes unsplit row blocks where its slices (2 items each) split them (super_rows).
  for (int cs = 0; cs < 3; ++cs) {
    const bool varlen = cs == 1;
    CaseSpec s = mk(1200, cs == 2 ? 9 : 6, cs == 2 ? 9 : 3, 64, 64, true, BetaMode::uniform02, DType::bf16, 71 + cs);
    s.B = cs == 2 ? 8 : 3;
    if (varlen) s.seqlens = {0, 500, 700};  // B = 1: an empty sequence, then two
    Case c = Case::make(s);
    HostTensor dout = random_dout(c, 73);
    GpuCase gc(c, &dout);
    GpuRun full = run_gpu(gc, true, true, -1);
    ASSERT_TRUE(full.fs.ok() && full.bs.ok()) << full.fs.message() << full.bs.message();
    // 1 byte: one (batch row, kv head) per slice; 24 MiB: some kv heads per slice, all batch rows.
    for (int64_t limit : {int64_t(1), int64_t(24) << 20}) {
      GpuRun r = run_gpu(gc, true, true, limit);
      ASSERT_TRUE(r.fs.ok() && r.bs.ok()) << r.fs.message() << r.bs.message();
      const std::string what = std::string(varlen ? "varlen" : "batched") + (cs == 2 ? " (8 rows)" : "") +
                               ", limit " + std::to_string(limit);
      EXPECT_TRUE(same_bits(r.o, full.o) && same_bits(r.lse, full.lse)) << "forward differs, " << what;
      EXPECT_TRUE(same_bits(r.dq, full.dq) && same_bits(r.dk, full.dk) && same_bits(r.dv, full.dv))
          << "dq / dk / dv differ, " << what;
      EXPECT_TRUE(same_bits(r.dw, full.dw) && same_bits(r.dbeta, full.dbeta) && same_bits(r.dg, full.dg))
          << "dw / dbeta / dg differ, " << what;
    }
  }
}

// The device's default memory pool's high-water mark of used bytes (the workspace's stream-ordered
// allocations) since the last reset; reset: start a new one.
double pool_high_water_mib(bool reset) {
  int dev = 0;
  cudaMemPool_t pool;
  EXPECT_EQ(cudaGetDevice(&dev), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetDefaultMemPool(&pool, dev), cudaSuccess);
  unsigned long long v = 0;
  if (reset) {
    EXPECT_EQ(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &v), cudaSuccess);
  }
  EXPECT_EQ(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &v), cudaSuccess);
  return double(v) / double(1 << 20);
}

// Output memory as workspace (the default; a dev build with -DPATHATTN_CUDA_BWD_OUT_WS=0 skips it): the backward
// keeps k~, ks, qhat and dks in the memory of the gradient outputs (dq, dk, dv, dw) until it writes them, where those are
// dense blocks (whole calls; with one kv head, every slice). Deterministic mode: whole and sliced bitwise equal,
// with qhat hosted (MHA, K = V, the far kernels) and not (GQA with qhat larger than dv; K != V), the gate on and
// off. Default mode with the fused far kernel: within the oracle tolerances. The workspace high-water is printed
// for comparison with a build without it.
TEST(CudaBackend, OutputsAsWorkspace) {
  REQUIRE_GPU();
  if (!cuda::kBwdOutWs) GTEST_SKIP() << "outputs as workspace: off in this build (-DPATHATTN_CUDA_BWD_OUT_WS=0)";
  struct Sp {
    int64_t T, HQ, H, K, V, B;
    bool gate;
  };
  for (const Sp& x : {Sp{1200, 1, 1, 128, 128, 3, false}, Sp{1200, 2, 1, 64, 64, 3, true},
                      Sp{700, 1, 1, 128, 64, 2, false}}) {
    CaseSpec s = mk(x.T, x.HQ, x.H, x.K, x.V, x.gate, BetaMode::uniform02, DType::bf16, 131 + x.T + x.K + x.V);
    s.B = x.B;
    Case c = Case::make(s);
    HostTensor dout = random_dout(c, 132);
    GpuCase gc(c, &dout);
    pool_high_water_mib(true);
    GpuRun whole = run_gpu(gc, true, true, -1);
    const double hw_whole = pool_high_water_mib(false);
    ASSERT_TRUE(whole.fs.ok() && whole.bs.ok()) << whole.fs.message() << whole.bs.message();
    GpuRun sliced = run_gpu(gc, true, true, 1);  // a slice a batch row (one kv head: dense outputs)
    ASSERT_TRUE(sliced.fs.ok() && sliced.bs.ok()) << sliced.fs.message() << sliced.bs.message();
    const std::string what = s.name() + ", sliced against whole";
    EXPECT_TRUE(same_bits(sliced.dq, whole.dq) && same_bits(sliced.dk, whole.dk) && same_bits(sliced.dv, whole.dv))
        << "dq / dk / dv differ, " << what;
    EXPECT_TRUE(same_bits(sliced.dw, whole.dw) && same_bits(sliced.dbeta, whole.dbeta) &&
                same_bits(sliced.dg, whole.dg))
        << "dw / dbeta / dg differ, " << what;
    std::printf("[out ws] %-60s workspace high-water %.2f MiB\n", s.name().c_str(), hw_whole);
  }
  check_case(mk(1500, 2, 2, 128, 128, false, BetaMode::uniform02, DType::bf16, 133), true, {}, true);
  check_case(mk(1300, 4, 4, 64, 64, false, BetaMode::two, DType::f16, 134), true, {}, true);
}

// The default limit holds: a backward whose workspace would be about 1 GiB in one slice (B = 1, T = 16384,
// 24 heads, K = 64; q, k, v far below the floor) keeps the stream-ordered pool's high-water mark under the
// default floor, and its outputs finite.
TEST(CudaBackend, WorkspaceLimitDefaultHolds) {
  REQUIRE_GPU();
  CaseSpec s = mk(16384, 24, 24, 64, 64, false, BetaMode::uniform02, DType::bf16, 81);
  s.B = 1;
  Case c = Case::make(s);
  HostTensor dout = random_dout(c, 82);
  GpuCase gc(c, &dout);
  pool_high_water_mib(true);
  GpuRun unlimited = run_gpu(gc, true, false, -1);
  ASSERT_TRUE(unlimited.fs.ok() && unlimited.bs.ok());
  const double mib_unlimited = pool_high_water_mib(false);
  pool_high_water_mib(true);
  GpuRun r = run_gpu(gc, true, false);
  ASSERT_TRUE(r.fs.ok() && r.bs.ok()) << r.fs.message() << r.bs.message();
  const double mib = pool_high_water_mib(false);
  for (const HostTensor* t : {&r.o, &r.dq, &r.dk, &r.dv, &r.dw, &r.dbeta})
    ASSERT_TRUE(all_finite(t->to_f64()));
  const double floor_mib = double(kDefaultWorkspaceFloor) / double(1 << 20);
  EXPECT_GT(mib_unlimited, floor_mib) << "the case no longer needs slicing: make it larger";
  EXPECT_LE(mib, floor_mib);
  EXPECT_LE(err(r.o, unlimited.o), 0.0);  // the forward has no atomics: bitwise
  // The default backward sums dP with fp32 atomics in no fixed order (as any two default-mode runs differ);
  // measured 1.2e-4 here.
  EXPECT_LE(err(r.dw, unlimited.dw), 1e-3);
  EXPECT_LE(err(r.dq, unlimited.dq), 1e-2);
  std::printf("[workspace] B 1, T 16384, 24 heads, K 64: pool high-water %.1f MiB unlimited, %.1f MiB default limit\n",
              mib_unlimited, mib);
}

TEST(CudaBackend, DeterministicMatchesDefault) {
  REQUIRE_GPU();
  CaseSpec s = mk(1300, 4, 2, 128, 64, true, BetaMode::uniform02, DType::bf16, 51);
  Case c = Case::make(s);
  HostTensor dout = random_dout(c, 52);
  GpuCase gc(c, &dout);
  GpuRun a = run_gpu(gc, true, false), b = run_gpu(gc, true, true);
  ASSERT_TRUE(a.bs.ok() && b.bs.ok());
  // The two modes differ in the order of the fp32 sums into dP (the chunk backward then reads dP rounded to 11
  // significant bits, so an order difference can flip a rounding, 2^-11 relative, in a few elements) and in the
  // superblock backward's fp16 copy of its chain state R: one power-of-two scale per row block, and the blocks
  // differ (all K rows in deterministic mode, 64 by default), so an entry's rounding (2^-11 of its block's
  // largest) can differ. Measured 1.2e-4; the bf16 K = 128 cases of the oracle tests put dw at 2.6e-3 .. 2.9e-3
  // against fp64 (T = 512 .. 2500, beta U(0, 2)).
  EXPECT_LE(err(a.dw, b.dw), 4e-4);
  EXPECT_LE(err(a.dq, b.dq), 1e-2);
}

// The deterministic mode with the gate takes the gate's column sums of dS on the query side, beside its row sums of
// the same scores, in a fixed order: dg as accurate as the default mode's (both within the bar against the fp64
// oracle, and within a few percent of each other), bitwise repeatable. A sequence past four superblocks (the key
// side's far kernel runs in this mode) and a short one, GQA.
TEST(CudaBackend, DeterministicGate) {
  REQUIRE_GPU();
  CaseSpec s = mk(0, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 131);
  s.B = 1;
  s.seqlens = {0, 2300, 700};
  Case c = Case::make(s);
  Case c64 = to_f64(c);
  HostTensor dout = random_dout(c, 132);
  FwdOut ref = run_fwd(c64, Backend::oracle);
  ASSERT_TRUE(ref.status.ok()) << ref.status.message();
  BwdOut rb = run_bwd(c64, ref, dout.cast(DType::f64), Backend::oracle);
  ASSERT_TRUE(rb.status.ok()) << rb.status.message();
  GpuCase gc(c, &dout);
  GpuRun a = run_gpu(gc, true, false), d1 = run_gpu(gc, true, true), d2 = run_gpu(gc, true, true);
  for (const GpuRun* r : {&a, &d1, &d2}) ASSERT_TRUE(r->fs.ok() && r->bs.ok()) << r->bs.message();
  EXPECT_TRUE(same_bits(d1.dq, d2.dq) && same_bits(d1.dk, d2.dk) && same_bits(d1.dv, d2.dv) &&
              same_bits(d1.dw, d2.dw) && same_bits(d1.dbeta, d2.dbeta) && same_bits(d1.dg, d2.dg))
      << "deterministic gradients differ bitwise between runs";
  const double eg_def = err(a.dg, rb.dg), eg_det = err(d1.dg, rb.dg);
  EXPECT_LE(eg_det, 2e-2);
  EXPECT_LE(eg_det, 1.1 * eg_def + 1e-4) << "the deterministic dg is less accurate than the default's";
  EXPECT_LE(err(d1.dq, rb.dq), 1e-2);
  EXPECT_LE(err(d1.dk, rb.dk), 1e-2);
  EXPECT_LE(err(d1.dw, rb.dw), 2e-2);
  std::printf("[det-gate] dg rel L2 against fp64: default %.2e, deterministic %.2e\n", eg_def, eg_det);
}

TEST(CudaBackend, RejectsUnsupported) {
  REQUIRE_GPU();
  CaseSpec s = mk(10, 2, 2, 48, 64, false, BetaMode::uniform02, DType::bf16, 61);
  Case c = Case::make(s);
  GpuCase gc(c);
  GpuRun r = run_gpu(gc, false, false);
  EXPECT_EQ(r.fs.code(), Status::Code::unsupported);
  EXPECT_NE(r.fs.message().find("q: head dim K = 48"), std::string::npos) << r.fs.message();
  EXPECT_NE(r.fs.message().find("{64, 128}"), std::string::npos) << r.fs.message();
  s = mk(10, 2, 2, 64, 96, false, BetaMode::uniform02, DType::f16, 62);
  Case c2 = Case::make(s);
  GpuCase gc2(c2);
  r = run_gpu(gc2, false, false);
  EXPECT_EQ(r.fs.code(), Status::Code::unsupported);
  EXPECT_NE(r.fs.message().find("v: head dim V = 96"), std::string::npos) << r.fs.message();
  s = mk(10, 2, 2, 64, 64, false, BetaMode::uniform02, DType::f32, 63);
  Case c3 = Case::make(s);
  GpuCase gc3(c3);
  r = run_gpu(gc3, false, false);
  EXPECT_EQ(r.fs.code(), Status::Code::unsupported) << r.fs.message();
  // v one element past a 16-byte boundary (an offset view): rejected before any kernel reads it.
  s = mk(70, 2, 2, 64, 64, false, BetaMode::uniform02, DType::bf16, 64);
  Case c4 = Case::make(s);
  GpuCase gc4(c4);
  HostTensor oh(s.dtype, {s.B, s.T, s.HQ, s.V}), lh(DType::f32, {s.B, s.T, s.HQ});
  DevTensor o(oh, false), lse(lh, false);
  PathFwdParams f = gc4.fwd_params(o, lse);
  f.v.data = static_cast<char*>(f.v.data) + 2;
  const Status st = path_attn_fwd(f);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(st.code(), Status::Code::unsupported) << st.message();
  EXPECT_NE(st.message().find("v: the cuda backend copies its rows 16 bytes at a time"), std::string::npos) << st.message();
}

// One row of the forward in fp64 straight from the definition (for long sequences, where the full oracle
// is too slow): returns o_i and lse_i of query head hq, batch row b.
void ref_row(const Case& c, int64_t b, int64_t hq, int64_t i, std::vector<double>& o, double& lse) {
  const CaseSpec& s = c.spec;
  const int64_t K = s.K, V = s.V, h = hq / (s.HQ / s.H);
  auto at4 = [&](const HostTensor& x, int64_t t, int64_t hh, int64_t d, int64_t heads, int64_t D) {
    return x.get(((b * s.T + t) * heads + hh) * D + d);
  };
  auto at3 = [&](const HostTensor& x, int64_t t, int64_t hh, int64_t heads) { return x.get((b * s.T + t) * heads + hh); };
  const double scale = 1.0 / std::sqrt(double(K));
  std::vector<double> qt(K), sc(i + 1);
  for (int64_t d = 0; d < K; ++d) qt[d] = at4(c.q, i, hq, d, s.HQ, K);
  double G = 0;
  std::vector<double> Gc(i + 1, 0.0);
  if (s.gate)
    for (int64_t t = 0; t <= i; ++t) Gc[t] = (G += at3(c.g, t, hq, s.HQ));
  for (int64_t j = i; j >= 0; --j) {
    double dotk = 0;
    for (int64_t d = 0; d < K; ++d) dotk += qt[d] * at4(c.k, j, h, d, s.H, K);
    sc[j] = scale * dotk + scale * (Gc[i] - Gc[j]);
    if (s.path && j > 0) {
      double dw = 0;
      for (int64_t d = 0; d < K; ++d) dw += qt[d] * at4(c.w, j, h, d, s.H, K);
      const double bt = at3(c.beta, j, h, s.H);
      for (int64_t d = 0; d < K; ++d) qt[d] -= bt * dw * at4(c.w, j, h, d, s.H, K);
    }
  }
  double m = -std::numeric_limits<double>::infinity(), l = 0;
  for (int64_t j = 0; j <= i; ++j) m = std::max(m, sc[j]);
  o.assign(V, 0.0);
  for (int64_t j = 0; j <= i; ++j) {
    const double e = std::exp(sc[j] - m);
    l += e;
    for (int64_t d = 0; d < V; ++d) o[d] += e * at4(c.v, j, h, d, s.H, V);
  }
  for (auto& x : o) x /= l;
  lse = m + std::log(l);
}

TEST(CudaBackend, LongSequenceSampledRows) {
  REQUIRE_GPU();
  CaseSpec s = mk(65536, 2, 1, 64, 64, true, BetaMode::uniform02, DType::bf16, 71);
  s.B = 1;
  Case c = Case::make(s);
  HostTensor dout = random_dout(c, 72);
  GpuCase gc(c, &dout);
  GpuRun r = run_gpu(gc, true, false);
  ASSERT_TRUE(r.fs.ok()) << r.fs.message();
  ASSERT_TRUE(r.bs.ok()) << r.bs.message();
  EXPECT_TRUE(all_finite(r.o.to_f64()));
  EXPECT_TRUE(all_finite(r.lse.to_f64()));
  for (const HostTensor* t : {&r.dq, &r.dk, &r.dv, &r.dw, &r.dbeta, &r.dg}) EXPECT_TRUE(all_finite(t->to_f64()));
  double num = 0, den = 0, lmax = 0;
  for (int64_t i : {int64_t(0), int64_t(63), int64_t(64), int64_t(4097), int64_t(33333), int64_t(65535)})
    for (int64_t hq = 0; hq < s.HQ; ++hq) {
      std::vector<double> o;
      double lse;
      ref_row(c, 0, hq, i, o, lse);
      for (int64_t d = 0; d < s.V; ++d) {
        const double x = r.o.get((i * s.HQ + hq) * s.V + d);
        num += (x - o[d]) * (x - o[d]);
        den += o[d] * o[d];
      }
      lmax = std::max(lmax, std::fabs(r.lse.get(i * s.HQ + hq) - lse) / std::max(1.0, std::fabs(lse)));
    }
  const double e = std::sqrt(num / den);
  std::printf("[long] T = 65536: sampled rows o rel L2 %.2e, lse max rel %.2e\n", e, lmax);
  EXPECT_LE(e, 4e-3);
  EXPECT_LE(lmax, 1e-3);
}

// ------------------------------------------------------------------------------------------------------
// Prefill and decode on a device cache (docs/spec.md, section 6): the cache against the CPU prefill on the same
// inputs, prefill + 200 decode steps against one fp64 oracle forward over all tokens, varlen slots with an
// empty sequence against the CPU prefill + decode, and bad input.

// A decode cache: kc [N, H, C, K], vc [N, H, C, V] fp32, gc [N, HQ, C] fp64 (with a gate), lengths [N]
// int64 in host memory. On the device (dev = true: the float tensors are poisoned device copies, the host
// tensors their mirrors for to_host) or on the host (poisoned host tensors).
struct TestCache {
  HostTensor kc, vc, gc, lengths;
  DevTensor dkc, dvc, dgc;
  bool dev = false;
  TestCache(int64_t N, int64_t H, int64_t HQ, int64_t C, int64_t K, int64_t V, bool gate, bool on_device)
      : dev(on_device) {
    kc = HostTensor(DType::f32, {N, H, C, K});
    vc = HostTensor(DType::f32, {N, H, C, V});
    if (gate) gc = HostTensor(DType::f64, {N, HQ, C});
    lengths = HostTensor(DType::i64, {N});
    kc.poison();
    vc.poison();
    if (gate) gc.poison();
    for (int64_t n = 0; n < N; ++n) static_cast<int64_t*>(lengths.mutable_view().data)[n] = 0;
    if (dev) {
      dkc = DevTensor(kc, false);
      dvc = DevTensor(vc, false);
      if (gate) dgc = DevTensor(gc, false);
    }
  }
  DecodeCache view() const {
    DecodeCache d;
    d.kc = dev ? dkc.view : kc.view();
    d.vc = dev ? dvc.view : vc.view();
    if (gc.present()) d.gc = dev ? dgc.view : gc.view();
    d.lengths = lengths.view();
    return d;
  }
  void to_host() {  // device cache -> the host mirrors
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dkc.to_host(kc);
    dvc.to_host(vc);
    if (gc.present()) dgc.to_host(gc);
  }
  int64_t len(int64_t n) const { return static_cast<const int64_t*>(lengths.view().data)[n]; }
};

// Relative L2 error over the cached rows (j < lengths[n]) of two caches [N, heads, C, D] or [N, heads, C].
double cache_err(const HostTensor& got, const HostTensor& ref, const TestCache& lens) {
  const TensorView v = ref.view();
  const int64_t N = v.shape[0], Hx = v.shape[1], C = v.shape[2], D = v.ndim == 4 ? v.shape[3] : 1;
  std::vector<double> a, b;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < Hx; ++h)
      for (int64_t j = 0; j < lens.len(n); ++j)
        for (int64_t e = 0; e < D; ++e) {
          const int64_t i = ((n * Hx + h) * C + j) * D + e;
          a.push_back(got.get(i));
          b.push_back(ref.get(i));
        }
  if (a.empty()) return 0.0;
  if (!all_finite(a)) return std::numeric_limits<double>::infinity();
  return rel_l2(a, b);
}

int64_t num_slots(const Case& c) { return c.spec.seqlens.empty() ? c.spec.B : int64_t(c.spec.seqlens.size()); }
int64_t longest(const Case& c) {
  if (c.spec.seqlens.empty()) return c.spec.T;
  return *std::max_element(c.spec.seqlens.begin(), c.spec.seqlens.end());
}

// Prefill of `c` on the GPU and on the CPU (Backend::cpu, host copies of the same inputs): the device cache
// must hold the CPU's keys to fp32 rounding, the same values and gate cumsums, the same lengths.
void check_prefill(const CaseSpec& spec) {
  Case c = Case::make(spec);
  const CaseSpec& s = c.spec;
  const int64_t N = num_slots(c), C = longest(c) + 3;
  // GPU.
  GpuCase gc(c);
  HostTensor go(s.dtype, {s.B, s.T, s.HQ, s.V}), glse(DType::f32, {s.B, s.T, s.HQ});
  DevTensor dgo(go, false), dglse(glse, false);
  TestCache gcache(N, s.H, s.HQ, C, s.K, s.V, s.gate, true);
  PathPrefillParams p;
  p.fwd = gc.fwd_params(dgo, dglse);
  p.cache = gcache.view();
  Status st = path_attn_prefill(p);
  ASSERT_TRUE(st.ok()) << st.message();
  gcache.to_host();
  dgo.to_host(go);
  dglse.to_host(glse);
  // CPU.
  HostTensor co(s.dtype, {s.B, s.T, s.HQ, s.V}), clse(DType::f32, {s.B, s.T, s.HQ});
  TestCache ccache(N, s.H, s.HQ, C, s.K, s.V, s.gate, false);
  PathPrefillParams pc;
  pc.fwd = c.fwd_params(co, &clse);
  pc.fwd.backend = Backend::cpu;
  pc.cache = ccache.view();
  st = path_attn_prefill(pc);
  ASSERT_TRUE(st.ok()) << st.message();

  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(gcache.len(n), ccache.len(n)) << "slot " << n << " " << s.name();
  const double ek = cache_err(gcache.kc, ccache.kc, ccache), ev = cache_err(gcache.vc, ccache.vc, ccache);
  const double eg = s.gate ? cache_err(gcache.gc, ccache.gc, ccache) : 0.0;
  EXPECT_LE(ek, 1e-6) << "kc " << s.name();
  EXPECT_EQ(ev, 0.0) << "vc " << s.name();
  EXPECT_LE(eg, 1e-12) << "gc " << s.name();
  double eo = 0, el = 0;
  if (s.T > 0) {
    eo = err(go, co);
    el = err(glse, clse);
    EXPECT_LE(eo, 4e-3) << "o " << s.name();
    EXPECT_LE(el, 1e-3) << "lse " << s.name();
  }
  std::printf("[prefill] %-60s kc %.2e vc %.2e gc %.2e o %.2e lse %.2e\n", s.name().c_str(), ek, ev, eg, eo, el);
}

TEST(CudaDecode, PrefillCacheMatchesCpu) {
  REQUIRE_GPU();
  check_prefill(mk(200, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 801));
  check_prefill(mk(130, 2, 2, 128, 128, false, BetaMode::two, DType::f16, 802));
  CaseSpec s = mk(77, 8, 1, 128, 64, true, BetaMode::uniform02, DType::bf16, 803);
  s.path = false;  // plain attention: kc = k
  check_prefill(s);
}

TEST(CudaDecode, PrefillVarlenWithEmptySequence) {
  REQUIRE_GPU();
  CaseSpec s = mk(0, 4, 2, 64, 128, true, BetaMode::uniform02, DType::bf16, 804);
  s.seqlens = {17, 0, 70, 1};
  check_prefill(s);
  s = mk(0, 2, 2, 128, 128, false, BetaMode::two, DType::f16, 805);
  s.seqlens = {0, 65};
  check_prefill(s);
}

// Prefill of positions [0, P) of every batch row, then `steps` decode steps for positions P, P + 1, ...;
// every output against one fp64 oracle forward over all P + steps tokens (bf16 / f16 inputs).
void check_decode(CaseSpec s, int64_t P, int64_t steps) {
  s.T = P + steps;
  Case full = Case::make(s);
  FwdOut ref = run_fwd(to_f64(full), Backend::oracle);
  ASSERT_TRUE(ref.status.ok()) << ref.status.message();
  GpuCase gc(full);
  const int64_t N = s.B, T = s.T, HQ = s.HQ, V = s.V;
  TestCache cache(N, s.H, HQ, T, s.K, V, s.gate, true);

  HostTensor po(s.dtype, {N, P, HQ, V}), plse(DType::f32, {N, P, HQ});
  DevTensor dpo(po, false), dplse(plse, false);
  PathPrefillParams pp;
  DevTensor none;
  pp.fwd = gc.fwd_params(none, none);
  for (TensorView* x : {&pp.fwd.q, &pp.fwd.k, &pp.fwd.v, &pp.fwd.w, &pp.fwd.beta, &pp.fwd.g}) *x = slice_t(*x, 0, P);
  pp.fwd.o = vw(dpo);
  pp.fwd.lse = vw(dplse);
  pp.cache = cache.view();
  Status st = path_attn_prefill(pp);
  ASSERT_TRUE(st.ok()) << st.message();
  for (int64_t n = 0; n < N; ++n) ASSERT_EQ(cache.len(n), P);

  std::vector<double> got_o, ref_o, got_l, ref_l;
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dpo.to_host(po);
  dplse.to_host(plse);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t t = 0; t < P; ++t)
      for (int64_t hq = 0; hq < HQ; ++hq) {
        got_l.push_back(plse.get((n * P + t) * HQ + hq));
        ref_l.push_back(ref.lse.get((n * T + t) * HQ + hq));
        for (int64_t e = 0; e < V; ++e) {
          got_o.push_back(po.get(((n * P + t) * HQ + hq) * V + e));
          ref_o.push_back(ref.o.get(((n * T + t) * HQ + hq) * V + e));
        }
      }
  const double epo = got_o.empty() ? 0.0 : rel_l2(got_o, ref_o);
  got_o.clear();
  ref_o.clear();

  HostTensor so(s.dtype, {N, 1, HQ, V}), slse(DType::f32, {N, 1, HQ});
  DevTensor dso(so, false), dslse(slse, false);
  for (int64_t t = 0; t < steps; ++t) {
    dso.poison();
    dslse.poison();
    PathDecodeParams d;
    d.q = slice_t(vw(gc.q), P + t, 1);
    d.k = slice_t(vw(gc.k), P + t, 1);
    d.v = slice_t(vw(gc.v), P + t, 1);
    d.w = slice_t(vw(gc.w), P + t, 1);
    d.beta = slice_t(vw(gc.beta), P + t, 1);
    d.g = slice_t(vw(gc.g), P + t, 1);
    d.gate_scale = s.gate_scale;
    d.o = vw(dso);
    d.lse = vw(dslse);
    d.cache = cache.view();
    d.backend = Backend::cuda;
    st = path_attn_decode(d);
    ASSERT_TRUE(st.ok()) << "step " << t << ": " << st.message();
    for (int64_t n = 0; n < N; ++n) ASSERT_EQ(cache.len(n), P + t + 1);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dso.to_host(so);
    dslse.to_host(slse);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t hq = 0; hq < HQ; ++hq) {
        got_l.push_back(slse.get(n * HQ + hq));
        ref_l.push_back(ref.lse.get((n * T + P + t) * HQ + hq));
        for (int64_t e = 0; e < V; ++e) {
          got_o.push_back(so.get((n * HQ + hq) * V + e));
          ref_o.push_back(ref.o.get(((n * T + P + t) * HQ + hq) * V + e));
        }
      }
  }
  ASSERT_TRUE(all_finite(got_o)) << "decode o has NaN/Inf (unwritten?) " << s.name();
  ASSERT_TRUE(all_finite(got_l)) << "decode lse has NaN/Inf " << s.name();
  const double eo = rel_l2(got_o, ref_o), el = rel_l2(got_l, ref_l);
  EXPECT_LE(epo, 4e-3) << "prefill o " << s.name();
  EXPECT_LE(eo, 4e-3) << "decode o " << s.name();
  EXPECT_LE(el, 1e-3) << "lse (prefill and decode) " << s.name();
  std::printf("[decode] %-60s P %lld + %lld steps: prefill o %.2e, decode o %.2e, lse %.2e\n", s.name().c_str(),
              (long long)P, (long long)steps, epo, eo, el);
}

TEST(CudaDecode, DecodeMatchesOracleForward) {
  REQUIRE_GPU();
  // GQA group of 8 (two passes of query heads), the cache crossing a 512-row split during the steps.
  check_decode(mk(0, 8, 1, 128, 128, true, BetaMode::uniform02, DType::bf16, 811), 400, 200);
  check_decode(mk(0, 4, 2, 64, 64, false, BetaMode::two, DType::f16, 812), 37, 200);
  CaseSpec s = mk(0, 6, 2, 128, 64, true, BetaMode::near2, DType::bf16, 813);  // group of 3
  check_decode(s, 1, 200);
  s = mk(0, 2, 2, 64, 128, true, BetaMode::uniform02, DType::bf16, 814);
  s.B = 1;
  s.path = false;  // plain attention with a gate
  check_decode(s, 5, 200);
}

// Varlen prefill (an empty sequence among them), then decode steps on slots of different lengths, the empty
// slot starting from nothing: outputs and caches against the same calls on the CPU backend.
TEST(CudaDecode, VarlenPrefillThenDecodeMatchesCpu) {
  REQUIRE_GPU();
  CaseSpec s = mk(0, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 821);
  s.seqlens = {17, 0, 530, 3};
  Case pre = Case::make(s);
  const int64_t N = 4, steps = 20, C = 530 + steps;
  CaseSpec ds = mk(steps, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 822);
  ds.B = N;  // the decode inputs [N, steps, ...]: step t of slot n is row n, position t
  Case dec = Case::make(ds);

  GpuCase gpre(pre), gdec(dec);
  TestCache gcache(N, s.H, s.HQ, C, s.K, s.V, true, true), ccache(N, s.H, s.HQ, C, s.K, s.V, true, false);
  HostTensor po(s.dtype, {1, pre.spec.T, s.HQ, s.V});
  DevTensor dpo(po, false), none;
  PathPrefillParams p;
  p.fwd = gpre.fwd_params(dpo, none);
  p.cache = gcache.view();
  Status st = path_attn_prefill(p);
  ASSERT_TRUE(st.ok()) << st.message();
  PathPrefillParams pc;
  HostTensor co(s.dtype, {1, pre.spec.T, s.HQ, s.V});
  pc.fwd = pre.fwd_params(co, nullptr);
  pc.fwd.backend = Backend::cpu;
  pc.cache = ccache.view();
  st = path_attn_prefill(pc);
  ASSERT_TRUE(st.ok()) << st.message();

  HostTensor go(s.dtype, {N, 1, s.HQ, s.V}), hco(s.dtype, {N, 1, s.HQ, s.V});
  DevTensor dgo(go, false);
  std::vector<double> a, b;
  for (int64_t t = 0; t < steps; ++t) {
    dgo.poison();
    PathDecodeParams d;
    d.q = slice_t(vw(gdec.q), t, 1);
    d.k = slice_t(vw(gdec.k), t, 1);
    d.v = slice_t(vw(gdec.v), t, 1);
    d.w = slice_t(vw(gdec.w), t, 1);
    d.beta = slice_t(vw(gdec.beta), t, 1);
    d.g = slice_t(vw(gdec.g), t, 1);
    d.o = vw(dgo);
    d.cache = gcache.view();
    st = path_attn_decode(d);  // automatic: cuda for device tensors
    ASSERT_TRUE(st.ok()) << "step " << t << ": " << st.message();
    PathDecodeParams h = d;
    h.q = slice_t(dec.q.view(), t, 1);
    h.k = slice_t(dec.k.view(), t, 1);
    h.v = slice_t(dec.v.view(), t, 1);
    h.w = slice_t(dec.w.view(), t, 1);
    h.beta = slice_t(dec.beta.view(), t, 1);
    h.g = slice_t(dec.g.view(), t, 1);
    h.o = hco.view();
    h.cache = ccache.view();
    h.backend = Backend::cpu;
    st = path_attn_decode(h);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dgo.to_host(go);
    for (int64_t i = 0; i < go.numel(); ++i) {
      a.push_back(go.get(i));
      b.push_back(hco.get(i));
    }
  }
  const int64_t want[4] = {17 + steps, steps, 530 + steps, 3 + steps};
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_EQ(gcache.len(n), want[n]);
    EXPECT_EQ(ccache.len(n), want[n]);
  }
  gcache.to_host();
  ASSERT_TRUE(all_finite(a));
  const double eo = rel_l2(a, b), ek = cache_err(gcache.kc, ccache.kc, ccache);
  const double ev = cache_err(gcache.vc, ccache.vc, ccache), eg = cache_err(gcache.gc, ccache.gc, ccache);
  EXPECT_LE(eo, 4e-3);
  EXPECT_LE(ek, 1e-5);
  EXPECT_EQ(ev, 0.0);
  EXPECT_LE(eg, 1e-12);
  std::printf("[varlen decode] o vs cpu %.2e, kc %.2e, vc %.2e, gc %.2e\n", eo, ek, ev, eg);
}

// ---- w, beta, g in bf16 / fp16 (param_dtypes.cu: fp32 copies at entry, dw / dbeta / dg converted back at exit).

// c with w, beta, g stored in the given dtypes (values rounded to them).
Case with_param_dtypes(const Case& c, DType w, DType beta, DType g) {
  Case r = c;
  if (c.w.present()) r.w = c.w.cast(w);
  if (c.beta.present()) r.beta = c.beta.cast(beta);
  if (c.g.present()) r.g = c.g.cast(g);
  return r;
}

// Outputs and deterministic gradients with 16-bit w, beta, g equal, bit for bit, those of the same values given
// in fp32, and dw / dbeta / dg come back in the dtype of their input: that fp32 run's gradients rounded.
// flash-linear-attention's conventions: bf16 q, k, v, w, beta with beta in (1.5, 2) and an fp32 g; fp16 varlen.
TEST(CudaBackend, NarrowParamsEqualFp32Params) {
  REQUIRE_GPU();
  struct Item {
    CaseSpec s;
    DType w, beta, g;
  };
  CaseSpec var = mk(0, 4, 2, 128, 128, true, BetaMode::uniform02, DType::f16, 95);
  var.seqlens = {15, 318, 1715};
  CaseSpec mha = mk(300, 2, 2, 64, 64, true, BetaMode::two, DType::bf16, 96);
  const std::vector<Item> items = {
      {mk(512, 8, 2, 128, 128, true, BetaMode::near2, DType::bf16, 91), DType::bf16, DType::bf16, DType::f32},
      {mk(1300, 4, 1, 64, 64, true, BetaMode::uniform02, DType::bf16, 92), DType::bf16, DType::bf16, DType::bf16},
      {mk(700, 4, 2, 64, 128, false, BetaMode::uniform02, DType::f16, 93), DType::f16, DType::f16, DType::f32},
      {var, DType::f16, DType::f16, DType::f16},
      {mha, DType::f32, DType::bf16, DType::f16},  // mixed: only beta and g converted
  };
  for (const Item& it : items) {
    const Case narrow = with_param_dtypes(Case::make(it.s), it.w, it.beta, it.g);
    const Case wide = with_param_dtypes(narrow, DType::f32, DType::f32, DType::f32);
    const std::string name = it.s.name() + " w " + dtype_name(it.w) + " beta " + dtype_name(it.beta) + " g " +
                             dtype_name(it.g);
    HostTensor dout = random_dout(narrow, it.s.seed + 5);
    GpuCase gn(narrow, &dout), gw(wide, &dout);
    GpuRun rn = run_gpu(gn, true, true), rw = run_gpu(gw, true, true);
    ASSERT_TRUE(rn.fs.ok() && rn.bs.ok()) << rn.fs.message() << rn.bs.message() << " " << name;
    ASSERT_TRUE(rw.fs.ok() && rw.bs.ok()) << rw.fs.message() << rw.bs.message() << " " << name;
    ASSERT_TRUE(all_finite(rw.o.to_f64()) && all_finite(rw.dw.to_f64())) << name;
    EXPECT_TRUE(same_bits(rn.o, rw.o) && same_bits(rn.lse, rw.lse)) << "forward " << name;
    EXPECT_TRUE(same_bits(rn.dq, rw.dq) && same_bits(rn.dk, rw.dk) && same_bits(rn.dv, rw.dv)) << "dq dk dv " << name;
    EXPECT_EQ(rn.dw.dtype(), it.w) << name;
    EXPECT_EQ(rn.dbeta.dtype(), it.beta) << name;
    EXPECT_TRUE(same_bits(rn.dw, rw.dw.cast(it.w))) << "dw " << name;
    EXPECT_TRUE(same_bits(rn.dbeta, rw.dbeta.cast(it.beta))) << "dbeta " << name;
    if (it.s.gate) {
      EXPECT_EQ(rn.dg.dtype(), it.g) << name;
      EXPECT_TRUE(same_bits(rn.dg, rw.dg.cast(it.g))) << "dg " << name;
    }
    std::printf("[narrow] %-70s bitwise equal to fp32 w/beta/g: o %d dq %d dw %d dbeta %d dg %d\n", name.c_str(),
                int(same_bits(rn.o, rw.o)), int(same_bits(rn.dq, rw.dq)), int(same_bits(rn.dw, rw.dw.cast(it.w))),
                int(same_bits(rn.dbeta, rw.dbeta.cast(it.beta))),
                int(!it.s.gate || same_bits(rn.dg, rw.dg.cast(it.g))));
  }
}

// Strided 16-bit w and beta (views into wider buffers) convert like dense ones; fp64 w is refused on cuda,
// naming w.
TEST(CudaBackend, NarrowParamsStridedAndRefused) {
  REQUIRE_GPU();
  const CaseSpec s = mk(200, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 97);
  const Case narrow = with_param_dtypes(Case::make(s), DType::bf16, DType::bf16, DType::bf16);
  const Case wide = with_param_dtypes(narrow, DType::f32, DType::f32, DType::f32);
  // w in a [B, T, H, 2K] buffer (first half), beta in a [B, 2T, H] one (even tokens): strided views.
  HostTensor wbuf(DType::bf16, {s.B, s.T, s.H, 2 * s.K}), bbuf(DType::bf16, {s.B, 2 * s.T, s.H});
  for (int64_t r = 0; r < s.B * s.T * s.H; ++r) {
    for (int64_t e = 0; e < s.K; ++e) {
      wbuf.set(r * 2 * s.K + e, narrow.w.get(r * s.K + e));
      wbuf.set(r * 2 * s.K + s.K + e, 1e4);  // must not be read
    }
  }
  for (int64_t bt = 0; bt < s.B * s.T; ++bt)
    for (int64_t h = 0; h < s.H; ++h) {
      bbuf.set((2 * bt) * s.H + h, narrow.beta.get(bt * s.H + h));
      bbuf.set((2 * bt + 1) * s.H + h, 1e4);
    }
  DevTensor dwbuf(wbuf), dbbuf(bbuf);
  GpuCase gn(narrow), gw(wide);
  HostTensor oh(s.dtype, {s.B, s.T, s.HQ, s.V}), lh(DType::f32, {s.B, s.T, s.HQ});
  DevTensor on(oh, false), ln(lh, false), ow(oh, false), lw(lh, false);
  PathFwdParams fn = gn.fwd_params(on, ln), fw = gw.fwd_params(ow, lw);
  fn.w = vw(dwbuf);
  fn.w.ndim = 4;
  fn.w.shape[3] = s.K;  // strides stay those of the [.., 2K] buffer
  fn.beta = vw(dbbuf);
  fn.beta.shape[1] = s.T;  // every other token of the [B, 2T, H] buffer
  fn.beta.stride[1] *= 2;
  ASSERT_TRUE(path_attn_fwd(fn).ok());
  ASSERT_TRUE(path_attn_fwd(fw).ok());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  HostTensor got = oh.clone(), ref = oh.clone();
  on.to_host(got);
  ow.to_host(ref);
  EXPECT_TRUE(all_finite(got.to_f64()));
  EXPECT_TRUE(same_bits(got, ref)) << "strided bf16 w / beta";
  // fp64 w on the cuda backend: invalid_argument naming w (fp64 is for the CPU backends).
  PathFwdParams f64w = gw.fwd_params(ow, lw);
  f64w.w.dtype = DType::f64;
  const Status st = path_attn_fwd(f64w);
  EXPECT_EQ(st.code(), Status::Code::invalid_argument) << st.message();
  EXPECT_EQ(st.message().rfind("w: expected dtype bfloat16, float16 or float32 on the cuda backend", 0), 0u)
      << st.message();
}

// Prefill and decode steps with bf16 w, beta, g: the device cache, outputs and lengths equal those of the fp32
// values.
TEST(CudaDecode, NarrowParamsEqualFp32Params) {
  REQUIRE_GPU();
  const CaseSpec s = mk(260, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 98);
  const Case narrow = with_param_dtypes(Case::make(s), DType::bf16, DType::bf16, DType::bf16);
  const Case wide = with_param_dtypes(narrow, DType::f32, DType::f32, DType::f32);
  const int64_t P = 250, N = s.B, C = s.T;
  struct Out {
    HostTensor o;
    TestCache cache;
  };
  auto run = [&](const Case& c) {
    Out r{HostTensor(s.dtype, {N, C, s.HQ, s.V}), TestCache(N, s.H, s.HQ, C, s.K, s.V, s.gate, true)};
    GpuCase g(c);
    DevTensor o(r.o, false), none;
    PathPrefillParams pp;
    pp.fwd = g.fwd_params(none, none);
    for (TensorView* x : {&pp.fwd.q, &pp.fwd.k, &pp.fwd.v, &pp.fwd.w, &pp.fwd.beta, &pp.fwd.g}) *x = slice_t(*x, 0, P);
    pp.fwd.o = slice_t(vw(o), 0, P);
    pp.cache = r.cache.view();
    Status st = path_attn_prefill(pp);
    EXPECT_TRUE(st.ok()) << st.message();
    for (int64_t t = P; t < C; ++t) {
      PathDecodeParams d;
      d.q = slice_t(vw(g.q), t, 1), d.k = slice_t(vw(g.k), t, 1), d.v = slice_t(vw(g.v), t, 1);
      d.w = slice_t(vw(g.w), t, 1), d.beta = slice_t(vw(g.beta), t, 1), d.g = slice_t(vw(g.g), t, 1);
      d.o = slice_t(vw(o), t, 1);
      d.cache = r.cache.view();
      d.backend = Backend::cuda;
      st = path_attn_decode(d);
      EXPECT_TRUE(st.ok()) << st.message();
    }
    r.cache.to_host();
    o.to_host(r.o);
    return r;
  };
  Out n = run(narrow), w = run(wide);
  EXPECT_TRUE(all_finite(w.o.to_f64()));
  EXPECT_TRUE(same_bits(n.o, w.o)) << "prefill + decode outputs";
  EXPECT_TRUE(same_bits(n.cache.kc, w.cache.kc) && same_bits(n.cache.vc, w.cache.vc) &&
              same_bits(n.cache.gc, w.cache.gc)) << "caches";
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(n.cache.len(i), C);
}

TEST(CudaDecode, BadInput) {
  REQUIRE_GPU();
  CaseSpec s = mk(10, 2, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 831);
  s.B = 1;
  Case c = Case::make(s);
  GpuCase gc(c);
  HostTensor o(s.dtype, {1, 10, 2, 64});
  DevTensor dout(o, false), none;
  // A cache that the prefill fills to capacity: the next decode step has no room.
  TestCache full(1, 2, 2, 10, 64, 64, true, true);
  PathPrefillParams p;
  p.fwd = gc.fwd_params(dout, none);
  p.cache = full.view();
  Status st = path_attn_prefill(p);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(full.len(0), 10);
  HostTensor so(s.dtype, {1, 1, 2, 64});
  DevTensor dso(so, false);
  PathDecodeParams d;
  d.q = slice_t(vw(gc.q), 0, 1);
  d.k = slice_t(vw(gc.k), 0, 1);
  d.v = slice_t(vw(gc.v), 0, 1);
  d.w = slice_t(vw(gc.w), 0, 1);
  d.beta = slice_t(vw(gc.beta), 0, 1);
  d.g = slice_t(vw(gc.g), 0, 1);
  d.o = vw(dso);
  d.cache = full.view();
  d.backend = Backend::cuda;
  st = path_attn_decode(d);
  EXPECT_EQ(st.code(), Status::Code::invalid_argument) << st.message();
  EXPECT_NE(st.message().find("cache.lengths"), std::string::npos) << st.message();
  EXPECT_EQ(full.len(0), 10);

  // A host cache with device inputs.
  TestCache host(1, 2, 2, 20, 64, 64, true, false);
  d.cache = host.view();
  st = path_attn_decode(d);
  EXPECT_EQ(st.code(), Status::Code::invalid_argument) << st.message();
  EXPECT_NE(st.message().find("cache.kc"), std::string::npos) << st.message();
  p.cache = host.view();
  st = path_attn_prefill(p);
  EXPECT_EQ(st.code(), Status::Code::invalid_argument) << st.message();
  EXPECT_NE(st.message().find("cache.kc"), std::string::npos) << st.message();

  // A head dim the cuda backend does not build: unsupported, naming q, for prefill and decode.
  CaseSpec s32 = mk(10, 2, 2, 32, 64, false, BetaMode::uniform02, DType::bf16, 832);
  s32.B = 1;
  Case c32 = Case::make(s32);
  GpuCase g32(c32);
  TestCache cache32(1, 2, 2, 20, 32, 64, false, true);
  p = PathPrefillParams();
  p.fwd = g32.fwd_params(dout, none);
  p.cache = cache32.view();
  st = path_attn_prefill(p);
  EXPECT_EQ(st.code(), Status::Code::unsupported) << st.message();
  EXPECT_NE(st.message().find("q: head dim K = 32"), std::string::npos) << st.message();
  d = PathDecodeParams();
  d.q = slice_t(vw(g32.q), 0, 1);
  d.k = slice_t(vw(g32.k), 0, 1);
  d.v = slice_t(vw(g32.v), 0, 1);
  d.w = slice_t(vw(g32.w), 0, 1);
  d.beta = slice_t(vw(g32.beta), 0, 1);
  d.o = vw(dso);
  d.cache = cache32.view();
  st = path_attn_decode(d);
  EXPECT_EQ(st.code(), Status::Code::unsupported) << st.message();
  EXPECT_NE(st.message().find("q: head dim K = 32"), std::string::npos) << st.message();
  EXPECT_EQ(cache32.len(0), 0);
}


// ------------------------------------------------------------------------------------------------------
// Non-finite inputs: a NaN or Inf in q, k, v, w, beta or g at position p of one sequence may change outputs at
// positions >= p of that sequence only. o, lse and dq at earlier positions and every output and gradient of
// the other sequences must match the finite input's (finite where it is, within 1e-5 of the tensor's largest
// magnitude: the default backward's reductions need not repeat bitwise). Varlen (a tile may span two
// sequences) and batch rows; positions mid-chunk and past the first 512-token superblock; every far path.

// got must match ref outside the rows [t0 + p, t0 + len) of batch row b (or outside the whole sequence).
void expect_confined_gpu(const char* name, const HostTensor& got, const HostTensor& ref, int64_t b, int64_t t0,
                         int64_t len, int64_t p, bool whole_seq, const std::string& what) {
  if (!got.present()) return;
  const TensorView v = got.view();
  const int64_t B = v.shape[0], T = v.shape[1], heads = v.shape[2], D = v.ndim == 4 ? v.shape[3] : 1;
  double mag = 0;
  for (int64_t i = 0; i < ref.numel(); ++i)
    if (std::isfinite(ref.get(i))) mag = std::max(mag, std::fabs(ref.get(i)));
  int64_t bad = 0;
  std::string first;
  for (int64_t bb = 0; bb < B; ++bb)
    for (int64_t t = 0; t < T; ++t) {
      const bool in_seq = bb == b && t >= t0 && t < t0 + len;
      if (in_seq && (whole_seq || t >= t0 + p)) continue;
      for (int64_t i = ((bb * T + t) * heads) * D; i < ((bb * T + t + 1) * heads) * D; ++i) {
        const double x = got.get(i), r = ref.get(i);
        const bool ok = std::isfinite(r) ? (std::isfinite(x) && std::fabs(x - r) <= 1e-5 * mag) : x == r;
        if (!ok && bad++ == 0) first = "t " + std::to_string(t) + ": " + std::to_string(x) + " vs " + std::to_string(r);
      }
    }
  EXPECT_EQ(bad, 0) << name << " " << what << ": " << bad << " elements changed outside the poisoned suffix; first at "
                    << first;
}

TEST(CudaBackend, NonFiniteInputsStayConfined) {
  REQUIRE_GPU();
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (bool varlen : {true, false}) {
    CaseSpec s = mk(0, 4, 2, 64, 64, true, BetaMode::uniform02, DType::bf16, 91);
    if (varlen) {
      s.B = 1;
      s.seqlens = {70, 700, 90};
      s.T = 860;
    } else {
      s.B = 3;
      s.T = 700;
    }
    const int64_t b = varlen ? 0 : 1, t0 = varlen ? 70 : 0, len = 700;
    const Case clean = Case::make(s);
    const HostTensor dout = random_dout(clean, 92);
    for (const char* field : {"v", "w", "beta", "k", "q", "g"})
      for (int64_t p : {int64_t(100), int64_t(550)})
        for (double val : {nan, inf}) {
          Case bad = clean;
          HostTensor& f = std::string(field) == "q" ? bad.q : std::string(field) == "k" ? bad.k
                        : std::string(field) == "v" ? bad.v : std::string(field) == "w" ? bad.w
                        : std::string(field) == "beta" ? bad.beta : bad.g;
          f = f.clone();
          const TensorView fv = f.view();
          const int64_t heads = fv.shape[2], D = fv.ndim == 4 ? fv.shape[3] : 1;
          f.set(((b * s.T + t0 + p) * heads + 1) * D + (D > 1 ? 3 : 0), val);
          {
            const std::string what = std::string(field) + (std::isnan(val) ? " nan" : " inf") + " at " +
                                     std::to_string(p) + (varlen ? " varlen" : " batch");
            GpuCase g0(clean, &dout), g1(bad, &dout);
            const GpuRun r0 = run_gpu(g0, true, true), r1 = run_gpu(g1, true, true);
            ASSERT_TRUE(r0.fs.ok() && r1.fs.ok() && r0.bs.ok() && r1.bs.ok()) << r1.fs.message() << r1.bs.message();
            expect_confined_gpu("o", r1.o, r0.o, b, t0, len, p, false, what);
            expect_confined_gpu("lse", r1.lse, r0.lse, b, t0, len, p, false, what);
            expect_confined_gpu("dq", r1.dq, r0.dq, b, t0, len, p, false, what);
            expect_confined_gpu("dk", r1.dk, r0.dk, b, t0, len, p, true, what);
            expect_confined_gpu("dv", r1.dv, r0.dv, b, t0, len, p, true, what);
            expect_confined_gpu("dw", r1.dw, r0.dw, b, t0, len, p, true, what);
            expect_confined_gpu("dbeta", r1.dbeta, r0.dbeta, b, t0, len, p, true, what);
            expect_confined_gpu("dg", r1.dg, r0.dg, b, t0, len, p, true, what);
          }
        }
  }
}

// Out of memory: with all but a little of the device's memory taken, a forward and a backward whose workspace
// cannot be had return a named error (or, had they fit, the same results), leave no fault behind and change no
// input; once the memory is back the same calls give the results of a run without the squeeze.
TEST(CudaBackend, OutOfMemoryFailsCleanly) {
  REQUIRE_GPU();
  CaseSpec s = mk(4096, 16, 16, 128, 128, true, BetaMode::uniform02, DType::bf16, 96);
  s.B = 4;
  const Case c = Case::make(s);
  const HostTensor dout = random_dout(c, 97);
  GpuCase g(c, &dout);
  const GpuRun ref = run_gpu(g, true, false);
  ASSERT_TRUE(ref.fs.ok() && ref.bs.ok()) << ref.fs.message() << ref.bs.message();
  // Outputs allocated before the squeeze, so that only the library's own workspace can fail.
  GpuRun r;
  r.o = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.V});
  r.lse = HostTensor(DType::f32, {s.B, s.T, s.HQ});
  r.dq = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.K});
  r.dk = HostTensor(s.dtype, {s.B, s.T, s.H, s.K});
  r.dv = HostTensor(s.dtype, {s.B, s.T, s.H, s.V});
  r.dw = HostTensor(c.w.dtype(), {s.B, s.T, s.H, s.K});
  r.dbeta = HostTensor(c.beta.dtype(), {s.B, s.T, s.H});
  r.dg = HostTensor(c.g.dtype(), {s.B, s.T, s.HQ});
  DevTensor o(r.o, false), lse(r.lse, false), dq(r.dq, false), dk(r.dk, false), dv(r.dv, false), dw(r.dw, false),
      dbeta(r.dbeta, false), dg(r.dg, false);
  const PathFwdParams fp = g.fwd_params(o, lse);
  PathBwdParams bp = bwd_params_for(fp);
  bp.do_ = vw(g.dout);
  bp.dq = vw(dq);
  bp.dk = vw(dk);
  bp.dv = vw(dv);
  bp.dw = vw(dw);
  bp.dbeta = vw(dbeta);
  bp.dg = vw(dg);
  const std::vector<const DevTensor*> inputs = {&g.q, &g.k, &g.v, &g.w, &g.beta, &g.g, &g.dout};
  std::vector<std::vector<uint8_t>> before;
  for (const DevTensor* t : inputs) before.push_back(t->raw());
  ASSERT_TRUE(path_attn_fwd(fp).ok());  // o and lse for the squeezed backward
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The squeeze: the stream-ordered pool's cached blocks released, then all but 16 MiB taken.
  cudaMemPool_t pool;
  ASSERT_EQ(cudaDeviceGetDefaultMemPool(&pool, 0), cudaSuccess);
  ASSERT_EQ(cudaMemPoolTrimTo(pool, 0), cudaSuccess);
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  void* hog = nullptr;
  size_t take = free_b > (16u << 20) ? free_b - (16u << 20) : 0;
  while (take > 0 && cudaMalloc(&hog, take) != cudaSuccess) {
    (void)cudaGetLastError();
    take = take > (64u << 20) ? take - (64u << 20) : 0;
  }
  const Status fs = path_attn_fwd(fp);
  const cudaError_t fsync = cudaDeviceSynchronize();
  const Status bs = path_attn_bwd(bp);
  const cudaError_t bsync = cudaDeviceSynchronize();
  if (hog) cudaFree(hog);
  EXPECT_EQ(fsync, cudaSuccess);
  EXPECT_EQ(bsync, cudaSuccess);
  for (const Status* st : {&fs, &bs})
    if (!st->ok()) {
      EXPECT_EQ(st->code(), Status::Code::internal);
      EXPECT_NE(st->message().find("out of memory"), std::string::npos) << st->message();
    }
  std::printf("[oom] forward: %s | backward: %s\n", fs.ok() ? "ran" : fs.message().c_str(),
              bs.ok() ? "ran" : bs.message().c_str());
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_TRUE(inputs[i]->raw() == before[i]) << "input " << i << " changed";
  // Memory back: the same calls again, against the run without the squeeze (the same plan: bitwise in the
  // forward; the backward's atomics make it equal to rounding only).
  ASSERT_TRUE(path_attn_fwd(fp).ok());
  ASSERT_TRUE(path_attn_bwd(bp).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o.to_host(r.o);
  lse.to_host(r.lse);
  dq.to_host(r.dq);
  EXPECT_TRUE(o.raw() == DevTensor(ref.o).raw());
  EXPECT_LT(err(r.dq, ref.dq), 1e-3);
}

// Decode soak: one prompt token, then 32768 decode steps on the device cache. The outputs of sampled steps
// against the definition in fp64 (ref_row), and the drift printed: the relative L2 error over each window of
// samples, to see whether the fp32 cache's error grows with the length.
TEST(CudaDecode, Soak32kSteps) {
  REQUIRE_GPU();
  const int64_t steps = 32768, P = 1;
  CaseSpec s = mk(0, 2, 1, 64, 64, true, BetaMode::uniform02, DType::bf16, 93);
  s.B = 1;
  s.T = P + steps;
  const Case c = Case::make(s);
  GpuCase gc(c);
  TestCache cache(1, s.H, s.HQ, s.T, s.K, s.V, s.gate, true);
  HostTensor po(s.dtype, {1, P, s.HQ, s.V}), plse(DType::f32, {1, P, s.HQ});
  DevTensor dpo(po, false), dplse(plse, false), none;
  PathPrefillParams pp;
  pp.fwd = gc.fwd_params(none, none);
  for (TensorView* x : {&pp.fwd.q, &pp.fwd.k, &pp.fwd.v, &pp.fwd.w, &pp.fwd.beta, &pp.fwd.g}) *x = slice_t(*x, 0, P);
  pp.fwd.o = vw(dpo);
  pp.fwd.lse = vw(dplse);
  pp.cache = cache.view();
  ASSERT_TRUE(path_attn_prefill(pp).ok());
  HostTensor so(s.dtype, {1, 1, s.HQ, s.V});
  DevTensor dso(so, false);
  double num = 0, den = 0, worst = 0;
  for (int64_t t = 0; t < steps; ++t) {
    PathDecodeParams d;
    d.q = slice_t(vw(gc.q), P + t, 1);
    d.k = slice_t(vw(gc.k), P + t, 1);
    d.v = slice_t(vw(gc.v), P + t, 1);
    d.w = slice_t(vw(gc.w), P + t, 1);
    d.beta = slice_t(vw(gc.beta), P + t, 1);
    d.g = slice_t(vw(gc.g), P + t, 1);
    d.o = vw(dso);
    d.cache = cache.view();
    d.backend = Backend::cuda;
    const Status st = path_attn_decode(d);
    ASSERT_TRUE(st.ok()) << "step " << t << ": " << st.message();
    const int64_t i = P + t;
    if (t % 1024 != 1023 && t != 0) continue;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dso.to_host(so);
    for (int64_t hq = 0; hq < s.HQ; ++hq) {
      std::vector<double> o;
      double lse;
      ref_row(c, 0, hq, i, o, lse);
      for (int64_t e = 0; e < s.V; ++e) {
        const double x = so.get(hq * s.V + e);
        ASSERT_TRUE(std::isfinite(x)) << "step " << t;
        num += (x - o[e]) * (x - o[e]);
        den += o[e] * o[e];
      }
    }
    if (t % 8192 == 8191) {
      const double e = std::sqrt(num / den);
      worst = std::max(worst, e);
      std::printf("[soak] steps %6lld: o rel L2 over the last window %.2e\n", (long long)(t + 1), e);
      num = den = 0;
    }
  }
  EXPECT_EQ(cache.len(0), P + steps);
  EXPECT_LE(worst, 4e-3);  // the decode bar of check_decode, at every window
}

// -- the w preparation op (w_conv_norm.h): the cuda backend against the cpu backend on the same inputs ---------------

struct WcnCase {
  int64_t B, T, D, hd, W;
  bool bias;
  std::vector<int64_t> cu;  // non-empty: varlen (B = 1)
};

struct WcnOut {
  HostTensor out, dx, dweight, dbias;
};

// Runs forward and backward of `c` on `be` (outputs poisoned first; device copies for cuda). x, dout in dt.
WcnOut wcn_run(const WcnCase& c, const HostTensor& x, const HostTensor& weight, const HostTensor& bias,
               const HostTensor& cu, const HostTensor& dout, Backend be) {
  WcnOut r{HostTensor(x.dtype(), {c.B, c.T, c.D}), HostTensor(x.dtype(), {c.B, c.T, c.D}),
           weight.present() ? HostTensor(weight.dtype(), {c.D, c.W}) : HostTensor(),
           bias.present() ? HostTensor(bias.dtype(), {c.D}) : HostTensor()};
  const bool dev = be == Backend::cuda;
  DevTensor dx_, dw_, db_, do_, dx2_, dwt_, dbi_, dout_;
  auto in = [&](const HostTensor& h, DevTensor& d) { if (!dev || !h.present()) return h.view(); d = DevTensor(h, true); return vw(d); };
  auto outv = [&](HostTensor& h, DevTensor& d) {
    if (!h.present()) return TensorView{};
    h.poison();
    if (!dev) return h.view();
    d = DevTensor(h, false);
    return vw(d);
  };
  WConvNormFwdParams f;
  f.x = in(x, dx_), f.weight = in(weight, dwt_), f.bias = in(bias, dbi_), f.cu_seqlens = cu.view();
  f.head_dim = c.hd, f.activation = c.W > 0, f.backend = be;
  f.out = outv(r.out, do_);
  const Status sf = w_conv_norm_fwd(f);
  EXPECT_TRUE(sf.ok()) << sf.message();
  WConvNormBwdParams b;
  b.x = f.x, b.weight = f.weight, b.bias = f.bias, b.cu_seqlens = f.cu_seqlens, b.head_dim = f.head_dim;
  b.activation = f.activation, b.backend = be;
  b.dout = in(dout, dout_);
  b.dx = outv(r.dx, dx2_);
  b.dweight = outv(r.dweight, dw_);
  b.dbias = outv(r.dbias, db_);
  const Status sb = w_conv_norm_bwd(b);
  EXPECT_TRUE(sb.ok()) << sb.message();
  if (dev) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    do_.to_host(r.out);
    dx2_.to_host(r.dx);
    if (r.dweight.present()) dw_.to_host(r.dweight);
    if (r.dbias.present()) db_.to_host(r.dbias);
  }
  return r;
}

// max |a - r| / (|r| + atol) over the elements: every element within rtol of the reference (no averaging).
double wcn_worst(const std::vector<double>& a, const std::vector<double>& r, double atol) {
  double w = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    w = std::max(w, std::fabs(a[i] - r[i]) / (std::fabs(r[i]) + atol));
  }
  return w;
}

// max |a - r| over max |r|: an error against the tensor's scale. fp32 elements need it: a convolution output near
// zero is a difference of terms of unit size, so both backends' few roundings are tiny against the terms but not
// against that element.
double wcn_worst_scaled(const std::vector<double>& a, const std::vector<double>& r) {
  double e = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    e = std::max(e, std::fabs(a[i] - r[i]));
    m = std::max(m, std::fabs(r[i]));
  }
  return m > 0 ? e / m : e;
}

// Both backends compute in fp32 from the same values; they differ by fma contraction, rsqrt and the order of sums
// (a few fp32 roundings). bf16 outputs, per element: at most one flipped rounding (2^-8 relative); fp32 outputs
// against their scale: 1e-5. dweight / dbias sum every token of the batch in another order: rel L2 1e-4 (4e-3 in
// bf16).
TEST(CudaWConvNorm, MatchesCpuBackend) {
  REQUIRE_GPU();
  const std::vector<WcnCase> cases = {
      {2, 333, 2048, 128, 3, false, {}},
      {1, 700, 512, 64, 4, true, {0, 0, 1, 64, 65, 65, 400, 700}},
      {1, 129, 256, 256, 2, true, {0, 100, 129}},
      {3, 65, 96, 32, 3, false, {}},
      {1, 90, 48, 16, 4, true, {0, 30, 31, 90}},
      {2, 77, 256, 64, 0, false, {}},
      {1, 1, 128, 128, 3, true, {}},
  };
  uint64_t seed = 1;
  for (const WcnCase& c : cases) {
    for (DType dt : {DType::bf16, DType::f32}) {
      SCOPED_TRACE("B " + std::to_string(c.B) + " T " + std::to_string(c.T) + " D " + std::to_string(c.D) + " hd " +
                   std::to_string(c.hd) + " W " + std::to_string(c.W) + " " + dtype_name(dt));
      std::mt19937_64 rng(seed++);
      std::normal_distribution<double> n01(0, 1);
      HostTensor x(dt, {c.B, c.T, c.D}), dout(dt, {c.B, c.T, c.D}), weight, bias, cu;
      for (int64_t i = 0; i < x.numel(); ++i) x.set(i, n01(rng)), dout.set(i, n01(rng));
      if (c.W) {
        weight = HostTensor(dt, {c.D, c.W});
        for (int64_t i = 0; i < weight.numel(); ++i) weight.set(i, 0.6 * n01(rng));
        if (c.bias) {
          bias = HostTensor(DType::f32, {c.D});
          for (int64_t i = 0; i < c.D; ++i) bias.set(i, 0.3 * n01(rng));
        }
      }
      if (!c.cu.empty()) {
        cu = HostTensor(DType::i64, {int64_t(c.cu.size())});
        for (size_t i = 0; i < c.cu.size(); ++i) static_cast<int64_t*>(cu.view().data)[i] = c.cu[i];
      }
      const WcnOut ref = wcn_run(c, x, weight, bias, cu, dout, Backend::cpu);
      const WcnOut got = wcn_run(c, x, weight, bias, cu, dout, Backend::cuda);
      const double tol = dt == DType::bf16 ? 1.0 / 128 : 1e-5;
      const bool bf = dt == DType::bf16;
      const double e_out = bf ? wcn_worst(got.out.to_f64(), ref.out.to_f64(), 1e-3)
                              : wcn_worst_scaled(got.out.to_f64(), ref.out.to_f64());
      const double e_dx = bf ? wcn_worst(got.dx.to_f64(), ref.dx.to_f64(), 1e-3)
                             : wcn_worst_scaled(got.dx.to_f64(), ref.dx.to_f64());
      std::printf("[acc] w_conv_norm %s T %lld D %lld hd %lld W %lld: out %.2e dx %.2e", dtype_name(dt),
                  (long long)c.T, (long long)c.D, (long long)c.hd, (long long)c.W, e_out, e_dx);
      EXPECT_LE(e_out, tol);
      EXPECT_LE(e_dx, tol);
      const double gtol = dt == DType::bf16 ? 4e-3 : 1e-4;
      if (c.W) {
        const double e = rel_l2(got.dweight.to_f64(), ref.dweight.to_f64());
        std::printf(" dweight %.2e", e);
        EXPECT_LE(e, gtol);
      }
      if (c.bias) {
        const double e = rel_l2(got.dbias.to_f64(), ref.dbias.to_f64());
        std::printf(" dbias %.2e", e);
        EXPECT_LE(e, 1e-4);  // fp32 bias
      }
      std::printf("\n");
    }
  }
}

// Outputs have one writer each and dweight / dbias are summed in tile order: two runs are bitwise equal.
TEST(CudaWConvNorm, BackwardIsBitwiseRepeatable) {
  REQUIRE_GPU();
  const WcnCase c{1, 4097, 1024, 128, 4, true, {0, 1000, 1000, 4097}};
  std::mt19937_64 rng(7);
  std::normal_distribution<double> n01(0, 1);
  HostTensor x(DType::bf16, {1, c.T, c.D}), dout(DType::bf16, {1, c.T, c.D}), weight(DType::f32, {c.D, c.W}),
      bias(DType::f32, {c.D}), cu(DType::i64, {4});
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, n01(rng)), dout.set(i, n01(rng));
  for (int64_t i = 0; i < weight.numel(); ++i) weight.set(i, 0.6 * n01(rng));
  for (int64_t i = 0; i < c.D; ++i) bias.set(i, 0.3 * n01(rng));
  for (int i = 0; i < 4; ++i) static_cast<int64_t*>(cu.view().data)[i] = c.cu[size_t(i)];
  const WcnOut a = wcn_run(c, x, weight, bias, cu, dout, Backend::cuda);
  const WcnOut b = wcn_run(c, x, weight, bias, cu, dout, Backend::cuda);
  EXPECT_EQ(a.out.to_f64(), b.out.to_f64());
  EXPECT_EQ(a.dx.to_f64(), b.dx.to_f64());
  EXPECT_EQ(a.dweight.to_f64(), b.dweight.to_f64());
  EXPECT_EQ(a.dbias.to_f64(), b.dbias.to_f64());
}

// What the kernels do not take is `unsupported`, naming the argument.
TEST(CudaWConvNorm, UnsupportedShapesNameTheArgument) {
  REQUIRE_GPU();
  HostTensor x(DType::bf16, {1, 8, 96}), w5(DType::f32, {96, 5});
  DevTensor dx(x, true), dout(x, false), dw(w5, true);
  WConvNormFwdParams f;
  f.x = vw(dx), f.out = vw(dout), f.head_dim = 48, f.backend = Backend::cuda;
  Status s = w_conv_norm_fwd(f);
  EXPECT_EQ(int(s.code()), int(Status::Code::unsupported));
  EXPECT_EQ(s.message().rfind("head_dim:", 0), 0u) << s.message();
  f.head_dim = 32, f.weight = vw(dw);
  s = w_conv_norm_fwd(f);
  EXPECT_EQ(int(s.code()), int(Status::Code::unsupported));
  EXPECT_EQ(s.message().rfind("weight:", 0), 0u) << s.message();
}

}  // namespace
}  // namespace pathattn::test
