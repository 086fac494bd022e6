// tests/cpp/test_fast.cpp: the blockwise CPU fast path against the fp64 oracle, forward and every gradient,
// in fp64 (max relative error <= 1e-10) and fp32 (relative L2 <= 1e-5 on o, 1e-4 on gradients); plus chunk
// size and thread-count invariance, and SerialBlas's hold on the BLAS thread count. Tolerances and their
// reasons: docs/numerics.md.
#include <gtest/gtest.h>

#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <random>

#include <omp.h>

#include "check/harness.h"
#include "check/oracle_chain.h"
#include "cpu/blas.h"
#include "cpu/cpu_backend.h"

namespace pathattn::test {
namespace {

struct Named {
  const char* name;
  const HostTensor* a;
  const HostTensor* ref;
};

std::vector<Named> grads_of(const CaseSpec& s, const BwdOut& a, const BwdOut& r) {
  std::vector<Named> v = {{"dq", &a.dq, &r.dq}, {"dk", &a.dk, &r.dk}, {"dv", &a.dv, &r.dv}};
  if (s.path) {
    v.push_back({"dw", &a.dw, &r.dw});
    v.push_back({"dbeta", &a.dbeta, &r.dbeta});
  }
  if (s.gate) v.push_back({"dg", &a.dg, &r.dg});
  return v;
}

// The oracle chain (tests/cpp/oracle_chain.h) on one case: the fast path in fp64 and in fp32 against the
// fp64 oracle, forward and every gradient, guards checked. PATHATTN_TEST_VERBOSE=1 prints every error.
void check_against_oracle(const CaseSpec& spec, int chunk = 0) {
  const CaseCheck cc = check_case(spec, Backend::cpu, 0, chunk);
  ASSERT_TRUE(cc.status.ok()) << cc.status.message() << " " << spec.name();
  if (std::getenv("PATHATTN_TEST_VERBOSE")) {
    std::printf("%s\n ", cc.spec.name().c_str());
    for (const TensorCheck& t : cc.tensors) std::printf(" %s:%s %.3e", t.precision.c_str(), t.tensor.c_str(), t.error);
    std::printf("\n");
  }
  for (const TensorCheck& t : cc.tensors)
    EXPECT_TRUE(t.pass) << t.precision << " " << t.tensor << " " << t.metric << " " << t.error << " > " << t.bound
                        << " " << t.note << " " << spec.name();
}

CaseSpec mk(int64_t T, int64_t HQ, int64_t H, int64_t K, int64_t V, bool path, bool gate, DType dt, uint64_t seed,
            BetaMode bm = BetaMode::uniform02, std::vector<int64_t> seqlens = {}, int64_t B = 1) {
  CaseSpec s;
  s.B = B; s.T = T; s.HQ = HQ; s.H = H; s.K = K; s.V = V; s.path = path; s.gate = gate; s.dtype = dt;
  s.seed = seed; s.beta = bm; s.seqlens = std::move(seqlens);
  return s;
}

// The sweep of issue sizes: T in {1, 2, 7, 63, 64, 65, 200, 1000}, K and V in {8, 32, 64, 128, 256}
// (including K != V), MHA and GQA, gate on and off, beta ~ U(0, 2) and beta = 2, varlen with empty and
// length-1 sequences. The chain runs each case in fp64 and fp32. Small enough for the O(T^2 K) oracle.
std::vector<CaseSpec> sweep() {
  std::vector<CaseSpec> v;
  const int64_t Ts[] = {1, 2, 7, 63, 64, 65, 200, 1000};
  const int64_t KV[][2] = {{8, 8}, {32, 64}, {64, 64}, {128, 32}, {256, 256}, {64, 128}, {8, 256}, {256, 8}};
  uint64_t seed = 100;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 2; ++j) {
      const int64_t T = Ts[i];
      const auto& kv = KV[(i + 3 * j) % 8];
      const bool gqa = (i + j) % 2 == 1;
      const int64_t big = T * T * kv[0];  // keep the oracle cheap at the largest sizes
      const int64_t H = big > 20'000'000 ? 1 : 2, HQ = gqa ? 2 * H : H;
      const BetaMode bm = j == 0 ? BetaMode::uniform02 : BetaMode::two;
      v.push_back(mk(T, HQ, H, kv[0], kv[1], true, (i + j) % 3 != 0, DType::f64, seed++, bm, {}, T < 100 ? 2 : 1));
    }
  }
  // Every head dim on both sides at an awkward T.
  const int64_t dims[] = {8, 32, 64, 128, 256};
  for (int a = 0; a < 5; ++a) v.push_back(mk(65, 2, 1, dims[a], dims[(a + 2) % 5], true, a % 2 == 0, DType::f64, seed++));
  // Varlen with empty and length-1 sequences; plain attention and FoX.
  const DType dt = DType::f64;
  v.push_back(mk(0, 4, 2, 32, 32, true, true, dt, seed++, BetaMode::uniform02, {0, 1, 64, 0, 65, 7}));
  v.push_back(mk(0, 2, 2, 16, 24, true, false, dt, seed++, BetaMode::two, {1}));
  v.push_back(mk(0, 2, 1, 64, 64, true, true, dt, seed++, BetaMode::near2, {0, 0, 3, 200, 1}));
  v.push_back(mk(130, 4, 1, 64, 32, false, true, dt, seed++));
  v.push_back(mk(0, 2, 2, 32, 32, false, false, dt, seed++, BetaMode::uniform02, {5, 0, 70}));
  return v;
}

class FastVsOracle : public ::testing::TestWithParam<CaseSpec> {};
TEST_P(FastVsOracle, ForwardAndGradients) { check_against_oracle(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Sweep, FastVsOracle, ::testing::ValuesIn(sweep()),
                         [](const auto& info) { return "case" + std::to_string(info.index); });

// The fp32 bar at long T: relative L2 <= 1e-5 on o and 1e-4 on every gradient up to T = 4096, beta ~ U(0, 2).
TEST(FastPath, LongF32) {
  check_against_oracle(mk(4096, 1, 1, 64, 64, true, true, DType::f32, 7));
  check_against_oracle(mk(2048, 2, 1, 128, 64, true, false, DType::f32, 8, BetaMode::two));
}

// The forward's two-level scan (superblocks of 512 tokens: several superblock transports, a partial last
// superblock, varlen, GQA, gate, K != V) in fp64, for two chunk sizes.
TEST(FastPath, SuperblockScanF64) {
  for (int chunk : {64, 128})
    check_against_oracle(mk(0, 4, 2, 32, 16, true, true, DType::f64, 81, BetaMode::uniform02, {1700, 3, 530}),
                         chunk);
  check_against_oracle(mk(1100, 2, 1, 16, 24, true, false, DType::f64, 82, BetaMode::two), 64);
}

// Chunk-size invariance (fp64): every chunk size gives the oracle's answer, so they agree with each other.
TEST(FastPath, ChunkSizeInvariance) {
  for (int chunk : {8, 16, 24, 64, 128, 256})
    check_against_oracle(mk(300, 2, 1, 32, 16, true, true, DType::f64, 21, BetaMode::uniform02), chunk);
}

// Thread-count invariance: bitwise-equal outputs and gradients for 1, 2 and 3 threads (fp32).
TEST(FastPath, ThreadCountInvarianceBitwise) {
  const Case c = Case::make(mk(0, 4, 2, 32, 32, true, true, DType::f32, 31, BetaMode::uniform02, {150, 0, 97, 260}));
  const HostTensor d = random_dout(c, 5);
  const FwdOut f1 = run_fwd(c, Backend::cpu, 1);
  const BwdOut b1 = run_bwd(c, f1, d, Backend::cpu, 1);
  for (int nt : {2, 3}) {
    const FwdOut f = run_fwd(c, Backend::cpu, nt);
    const BwdOut b = run_bwd(c, f, d, Backend::cpu, nt);
    EXPECT_EQ(f.o.to_f64(), f1.o.to_f64()) << nt;
    EXPECT_EQ(f.lse.to_f64(), f1.lse.to_f64()) << nt;
    for (const Named& g : grads_of(c.spec, b, b1)) EXPECT_EQ(g.a->to_f64(), g.ref->to_f64()) << g.name << " " << nt;
  }
}

// SerialBlas (nested, as concurrent calls nest) makes BLAS single-threaded while one lives and restores the
// setting after the last: the calling thread's OpenMP count for an OpenMP OpenBLAS, the process-wide BLAS
// count for a pthreads one (scipy-openblas32, the Python wheels' build).
TEST(FastPath, SerialBlasHoldsBlasSingleThreaded) {
  const int blas0 = cpu::blas_threads();
  cpu::set_blas_threads(2);
  const bool omp = cpu::blas_uses_openmp();
  auto current = [&] { return omp ? omp_get_max_threads() : cpu::blas_threads(); };
  ASSERT_EQ(current(), 2) << (omp ? "OpenMP" : "pthreads") << " OpenBLAS: " << cpu::blas_config();
  {
    cpu::SerialBlas outer;
    EXPECT_EQ(current(), 1);
    {
      cpu::SerialBlas inner;
      EXPECT_EQ(current(), 1);
    }
    EXPECT_EQ(current(), 1) << "the inner SerialBlas restored the count while the outer one lives";
  }
  EXPECT_EQ(current(), 2);
  cpu::set_blas_threads(blas0);
}

// Splitting invariance: a varlen batch equals each of its sequences computed alone (fp64, to rounding).
TEST(FastPath, VarlenEqualsSeparateSequences) {
  const std::vector<int64_t> lens = {37, 0, 130, 1, 66};
  const Case all = Case::make(mk(0, 2, 1, 16, 16, true, true, DType::f64, 41, BetaMode::uniform02, lens));
  const FwdOut fa = run_fwd(all, Backend::cpu);
  ASSERT_TRUE(fa.status.ok());
  const auto oa = fa.o.to_f64();
  int64_t t0 = 0;
  for (int64_t L : lens) {
    if (L == 0) continue;
    Case one = Case::make(mk(L, 2, 1, 16, 16, true, true, DType::f64, 1));
    auto slice = [&](const HostTensor& src, HostTensor& dst) {  // rows [t0, t0 + L) of a [1, T, ...] tensor
      const int64_t row = src.numel() / all.spec.T;
      for (int64_t i = 0; i < L * row; ++i) dst.set(i, src.get(t0 * row + i));
    };
    slice(all.q, one.q); slice(all.k, one.k); slice(all.v, one.v);
    slice(all.w, one.w); slice(all.beta, one.beta); slice(all.g, one.g);
    const FwdOut fo = run_fwd(one, Backend::cpu);
    ASSERT_TRUE(fo.status.ok());
    const auto oo = fo.o.to_f64();
    const int64_t row = oo.size() / L;
    std::vector<double> ref(oa.begin() + t0 * row, oa.begin() + (t0 + L) * row);
    EXPECT_LE(max_rel(oo, ref), 1e-13) << "sequence at " << t0;
    t0 += L;
  }
}

// beta = 0 is plain causal attention (FoX with a gate): the PaTH path equals the no-transport path.
TEST(FastPath, BetaZeroIsPlainAttention) {
  for (bool gate : {false, true}) {
    Case c = Case::make(mk(150, 4, 2, 32, 32, true, gate, DType::f64, 51, BetaMode::zero));
    const FwdOut fp = run_fwd(c, Backend::cpu);
    Case plain = c;
    plain.spec.path = false;
    const FwdOut fq = run_fwd(plain, Backend::cpu);
    ASSERT_TRUE(fp.status.ok() && fq.status.ok());
    EXPECT_LE(max_rel(fp.o.to_f64(), fq.o.to_f64()), 1e-14);
    EXPECT_LE(max_rel(fp.lse.to_f64(), fq.lse.to_f64()), 1e-14);
  }
}

// T = 1: o = v (one key, weight 1), whatever q, w, beta and g are.
TEST(FastPath, SingleTokenOutputIsValue) {
  for (Backend be : {Backend::oracle, Backend::cpu}) {
    const Case c = Case::make(mk(1, 4, 2, 16, 8, true, true, DType::f64, 61));
    const FwdOut f = run_fwd(c, be);
    ASSERT_TRUE(f.status.ok());
    for (int64_t b = 0; b < c.spec.B; ++b)
      for (int64_t hq = 0; hq < 4; ++hq)
        for (int64_t d = 0; d < 8; ++d)
          EXPECT_EQ(f.o.get((b * 4 + hq) * 8 + d), c.v.get((b * 2 + hq / 2) * 8 + d));
  }
}

// Swap check (docs/spec.md, section 7): beta_t = 2 and w_t = (e_a - e_b) / sqrt(2) make H_t the permutation
// swapping coordinates a and b. With one-hot queries and keys every logit is 0 or 1 and is predicted by
// tracking where the key's 1 moves, with no matrix arithmetic. The log-weights of o recover the logits.
TEST(FastPath, SwapCheck) {
  const int64_t T = 144, K = 8;  // V = T: a multiple of 8
  for (Backend be : {Backend::oracle, Backend::cpu}) {
    CaseSpec s = mk(T, 1, 1, K, T, true, false, DType::f64, 71, BetaMode::two);
    Case c = Case::make(s);
    std::mt19937_64 rng(71);
    std::vector<int64_t> qa(T), ka(T), sa(T), sb(T);
    for (int64_t t = 0; t < T; ++t) {
      qa[t] = rng() % K;
      ka[t] = rng() % K;
      sa[t] = rng() % K;
      sb[t] = (sa[t] + 1 + rng() % (K - 1)) % K;
      for (int64_t e = 0; e < K; ++e) {
        c.q.set(t * K + e, e == qa[t] ? 1.0 : 0.0);
        c.k.set(t * K + e, e == ka[t] ? 1.0 : 0.0);
        c.w.set(t * K + e, e == sa[t] ? std::sqrt(0.5) : e == sb[t] ? -std::sqrt(0.5) : 0.0);
      }
      for (int64_t e = 0; e < T; ++e) c.v.set(t * T + e, e == t ? 1.0 : 0.0);  // v_t = e_t: o_i = weights
    }
    const FwdOut f = run_fwd(c, be);
    ASSERT_TRUE(f.status.ok());
    const double scale = 1.0 / std::sqrt(double(K));
    for (int64_t i = 0; i < T; ++i)
      for (int64_t j = 0; j <= i; ++j) {
        int64_t pos = ka[j];  // H_i ... H_{j+1} k_j: apply swaps j+1 .. i in order
        for (int64_t t = j + 1; t <= i; ++t) pos = pos == sa[t] ? sb[t] : pos == sb[t] ? sa[t] : pos;
        const double logit = pos == qa[i] ? 1.0 : 0.0;
        const double got = std::log(f.o.get(i * T + j)) + f.lse.get(i);  // = s(i, j)
        ASSERT_NEAR(got, scale * logit, 1e-12) << backend_name(be) << " i=" << i << " j=" << j;
      }
  }
}

}  // namespace
}  // namespace pathattn::test
