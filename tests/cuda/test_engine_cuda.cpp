// tests/cuda/test_engine_cuda.cpp: the engine's CUDA device (train.device = "cuda") against its CPU oracle:
// every layer kernel of engine/cuda/kernels.h against its engine/ops.h twin on fresh random inputs, CPU vs
// CUDA training of the same model from the same seed (head dims the CUDA attention is built for, and smaller
// ones it runs zero-padded), checkpoints moving between the devices, and the errors a model the CUDA device
// cannot run gets. Every test skips when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "cpu/blas.h"
#include "engine/checkpoint.h"
#include "engine/cuda/kernels.h"
#include "engine/embedded.h"
#include "engine/cuda/model_cuda.h"
#include "engine/ops.h"
#include "engine/optim.h"
#include "engine/rng.h"
#include "engine/run.h"
#include "engine/tasks.h"
#include "pathattn/attention.h"

namespace pathattn::engine {
namespace {

namespace fs = std::filesystem;

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define REQUIRE_GPU()                                                                  \
  do {                                                                                 \
    if (!have_gpu()) { GTEST_SKIP() << "no CUDA device: engine CUDA tests skipped"; } \
  } while (0)

// The CPU side of these tests is small: single-threaded BLAS keeps it quick and deterministic.
class SingleThreaded : public ::testing::Environment {
 public:
  void SetUp() override { cpu::set_blas_threads(1); }
};
const auto* const kSingleThreaded = ::testing::AddGlobalTestEnvironment(new SingleThreaded);

constexpr double kEps32 = 0x1.0p-24;  // unit roundoff of fp32
uint64_t g_seed = 0;  // the kernel tests' input seed, named in failure messages (rerun: --gtest_random_seed)

// A device copy of a host vector; host() reads it back.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit Dev(size_t count) : Dev(std::vector<T>(count, T(0))) {
    // Poisoned: every byte 0xff (NaN for floats), so an unwritten output shows.
    EXPECT_EQ(cudaMemset(p, 0xff, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> host() const {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
  operator T*() const { return p; }
};

std::vector<float> randn(Rng& r, size_t n, double sd = 1.0) {
  std::vector<float> v(n);
  for (auto& x : v) x = float(r.normal() * sd);
  return v;
}

// Every element within |got - want| <= rtol |want| + atol[i] (atol per element, or one for all); reports the
// worst element and how many fail.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rtol,
                  const std::vector<double>& atol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = rtol * std::fabs(double(want[i])) + atol[atol.size() == 1 ? 0 : i];
    const double d = std::fabs(double(got[i]) - double(want[i]));
    const double ratio = tol > 0 ? d / tol : (d > 0 ? 1e30 : 0);
    if (!(d <= tol)) ++bad;  // NaN counts as a failure
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << got.size() << " elements out of tolerance; worst at " << worst
                     << ": got " << got[worst] << ", want " << want[worst] << " (" << worst_ratio << " x tolerance; inputs seed "
                     << g_seed << ")";
}
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol,
                  const std::string& what) {
  expect_close(got, want, rtol, std::vector<double>{atol}, what);
}

// Row-major |op(A)| |op(B)| [M, N] in fp64: a GEMM's rounding error is at most K u (|A||B|)_ij (Higham,
// Accuracy and Stability, eq. 3.13) in any summation order, so two GEMMs differ by at most 2 K u (|A||B|)_ij.
std::vector<double> gemm_abs(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                             const float* B, int64_t ldb) {
  std::vector<double> c(size_t(M * N), 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = ta ? A[k * lda + i] : A[i * lda + k];
        const double b = tb ? B[j * ldb + k] : B[k * ldb + j];
        s += std::fabs(a * b);
      }
      c[size_t(i * N + j)] = s;
    }
  return c;
}
std::vector<double> gemm_tol(std::vector<double> absprod, int64_t K, const std::vector<float>& prior) {
  for (size_t i = 0; i < absprod.size(); ++i)
    absprod[i] = 2.0 * double(K + 1) * kEps32 * (absprod[i] + (prior.empty() ? 0.0 : std::fabs(prior[i])));
  return absprod;
}

// Shapes of the kernel tests: awkward sizes (3 sequences of 7 rows, widths not multiples of 32).
constexpr int64_t kB = 3, kT = 7, kN = kB * kT, kC = 40, kNH = 3, kK = 24, kF = 36, kVc = 37;

class EngineCudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device: engine CUDA tests skipped";
    ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
    ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(h, s), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), CUBLAS_STATUS_SUCCESS);
    g_seed = 1000 + uint64_t(::testing::UnitTest::GetInstance()->random_seed());
    rng = Rng(g_seed);
  }
  void TearDown() override {
    if (h) cublasDestroy(h);
    if (s) cudaStreamDestroy(s);
  }
  cudaStream_t s = nullptr;
  cublasHandle_t h = nullptr;
  Rng rng{1};
};

// Elementwise kernels with exp / log1p: CUDA's expf and log1pf are within 2 ulp (CUDA C Programming Guide,
// mathematical functions), glibc's within 1; the formulas here chain up to four such results, so 8 ulp
// relative. Where a formula subtracts a transcendental result from a constant (1 - s, 1 - exp(g),
// 1 - beta / 2, 1 + a (1 - s)) the difference can cancel to near zero while keeping the absolute error of
// its operands: those outputs get an absolute term of kCancel ulp times the magnitude of the factor that
// multiplies the cancelling difference (trans_atol below).
constexpr double kTransRtol = 8 * 2 * kEps32, kTransAtol = 1e-7, kCancel = 16 * kEps32;
std::vector<double> trans_atol(const std::vector<double>& scale) {
  std::vector<double> a(scale.size());
  for (size_t i = 0; i < a.size(); ++i) a[i] = kTransAtol + kCancel * scale[i];
  return a;
}
// Row reductions: both sides sum in fp64 (orders differ) and round once to fp32: 2 ulp. Column sums (dw,
// db, dwc): the CPU sums fp32 values in fp32 over N = 21 rows, the GPU in fp64: N u of the sum of |terms|,
// which for these O(1) inputs is below 21 * 6e-8 * 21 < 3e-5 absolute.
constexpr double kRowRtol = 4 * kEps32, kColAtol = 3e-5;

TEST_F(EngineCudaKernels, LinearForwardBackward) {
  const int64_t In = kC, Out = 52;
  const auto x = randn(rng, kN * In), W = randn(rng, In * Out), b = randn(rng, Out), dy = randn(rng, kN * Out);
  for (bool bias : {false, true}) {
    std::vector<float> y(kN * Out);
    linear_fwd(x.data(), W.data(), bias ? b.data() : nullptr, y.data(), kN, In, Out);
    Dev<float> dx_(x), dW(W), db(b), dyv{size_t(kN * Out)};
    gpu::linear_fwd(h, s, dx_, dW, bias ? db.p : nullptr, dyv, kN, In, Out);
    std::vector<float> prior;  // the bias rows the GEMM adds to
    if (bias)
      for (int64_t i = 0; i < kN * Out; ++i) prior.push_back(b[size_t(i % Out)]);
    expect_close(dyv.host(), y, 0, gemm_tol(gemm_abs(false, false, kN, Out, In, x.data(), In, W.data(), Out), In, prior),
                 "linear_fwd y");
  }
  for (bool acc : {false, true}) {
    const auto dx0 = randn(rng, kN * In), dW0 = randn(rng, In * Out), db0 = randn(rng, Out);
    std::vector<float> dx = dx0, dWh = dW0, dbh = db0;
    linear_bwd(x.data(), W.data(), dy.data(), dx.data(), dWh.data(), dbh.data(), kN, In, Out, acc);
    Dev<float> gx(x), gW(W), gdy(dy), gdx(dx0), gdW(dW0), gdb(db0);
    gpu::linear_bwd(h, s, gx, gW, gdy, gdx, gdW, gdb, kN, In, Out, acc);
    expect_close(gdx.host(), dx, 0,
                 gemm_tol(gemm_abs(false, true, kN, In, Out, dy.data(), Out, W.data(), Out), Out,
                          acc ? dx0 : std::vector<float>{}),
                 "linear_bwd dx");
    expect_close(gdW.host(), dWh, 0,
                 gemm_tol(gemm_abs(true, false, In, Out, kN, x.data(), In, dy.data(), Out), kN, dW0), "linear_bwd dW");
    expect_close(gdb.host(), dbh, 0, kColAtol, "linear_bwd db");
  }
}

TEST_F(EngineCudaKernels, TiedHeadGemmShapes) {
  // The tied LM head's three products (logits = lnf wte^T and its two gradients) through gpu::gemm.
  const auto lnf = randn(rng, kN * kC), wte = randn(rng, kVc * kC), dl = randn(rng, kN * kVc);
  std::vector<float> logits(kN * kVc), dlnf(kN * kC), dwte = randn(rng, kVc * kC);
  const std::vector<float> dwte0 = dwte;
  cpu::gemm(false, true, kN, kVc, kC, 1.0f, lnf.data(), kC, wte.data(), kC, 0.0f, logits.data(), kVc);
  cpu::gemm(false, false, kN, kC, kVc, 1.0f, dl.data(), kVc, wte.data(), kC, 0.0f, dlnf.data(), kC);
  cpu::gemm(true, false, kVc, kC, kN, 1.0f, dl.data(), kVc, lnf.data(), kC, 1.0f, dwte.data(), kC);
  Dev<float> g_lnf(lnf), g_wte(wte), g_dl(dl), g_logits{size_t(kN * kVc)}, g_dlnf{size_t(kN * kC)}, g_dwte(dwte0);
  gpu::gemm(h, false, true, kN, kVc, kC, 1.0f, g_lnf, kC, g_wte, kC, 0.0f, g_logits, kVc);
  gpu::gemm(h, false, false, kN, kC, kVc, 1.0f, g_dl, kVc, g_wte, kC, 0.0f, g_dlnf, kC);
  gpu::gemm(h, true, false, kVc, kC, kN, 1.0f, g_dl, kVc, g_lnf, kC, 1.0f, g_dwte, kC);
  expect_close(g_logits.host(), logits, 0,
               gemm_tol(gemm_abs(false, true, kN, kVc, kC, lnf.data(), kC, wte.data(), kC), kC, {}), "logits");
  expect_close(g_dlnf.host(), dlnf, 0,
               gemm_tol(gemm_abs(false, false, kN, kC, kVc, dl.data(), kVc, wte.data(), kC), kVc, {}), "dlnf");
  expect_close(g_dwte.host(), dwte, 0,
               gemm_tol(gemm_abs(true, false, kVc, kC, kN, dl.data(), kVc, lnf.data(), kC), kN, dwte0), "dwte");
}

TEST_F(EngineCudaKernels, Embedding) {
  std::vector<int32_t> tok(kN);
  for (auto& t : tok) t = int32_t(rng.next() % 5);  // few ids: many repeats in the scatter-add
  tok[3] = kVc - 1;
  const auto wte = randn(rng, kVc * kC), dx = randn(rng, kN * kC), dwte0 = randn(rng, kVc * kC);
  std::vector<float> x(kN * kC), dwte = dwte0;
  embedding_fwd(tok.data(), wte.data(), x.data(), kN, kC);
  embedding_bwd(tok.data(), dx.data(), dwte.data(), kN, kC);
  std::vector<int32_t> rows, start;
  gpu::token_rows(tok.data(), kN, kVc, &rows, &start);
  Dev<int32_t> g_tok(tok), g_rows(rows), g_start(start);
  Dev<float> g_wte(wte), g_x{size_t(kN * kC)}, g_dx(dx), g_dwte(dwte0);
  gpu::embedding_fwd(g_tok, g_wte, g_x, kN, kC, s);
  gpu::embedding_bwd(g_rows, g_start, g_dx, g_dwte, kVc, kC, s);
  // Copies, and sums in ops.cpp's order: bitwise equal.
  expect_close(g_x.host(), x, 0, 0, "embedding_fwd");
  expect_close(g_dwte.host(), dwte, 0, 0, "embedding_bwd");
}

TEST_F(EngineCudaKernels, RmsNorm) {
  const auto x = randn(rng, kN * kC, 2.0), w = randn(rng, kC), dy = randn(rng, kN * kC);
  std::vector<float> y(kN * kC), rstd(kN);
  rmsnorm_fwd(x.data(), w.data(), y.data(), rstd.data(), kN, kC, 1e-5);
  Dev<float> gx(x), gw(w), gy{size_t(kN * kC)}, grstd{size_t(kN)}, gdy(dy);
  gpu::rmsnorm_fwd(gx, gw, gy, grstd, kN, kC, 1e-5, s);
  expect_close(grstd.host(), rstd, kRowRtol, 0, "rmsnorm_fwd rstd");
  expect_close(gy.host(), y, kRowRtol, 0, "rmsnorm_fwd y");
  for (bool acc : {false, true}) {
    const auto dx0 = randn(rng, kN * kC), dw0 = randn(rng, kC);
    std::vector<float> dx = dx0, dw = dw0;
    rmsnorm_bwd(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), kN, kC, acc);
    Dev<float> gdx(dx0), gdw(dw0);
    gpu::rmsnorm_bwd(gx, gw, grstd, gdy, gdx, gdw, kN, kC, acc, s);
    // dx: the row dot product (fp64 both sides, orders differ) enters through a difference that can cancel:
    // absolute 1e-6 on these O(1) values.
    expect_close(gdx.host(), dx, kRowRtol, 1e-6, "rmsnorm_bwd dx");
    expect_close(gdw.host(), dw, 0, kColAtol, "rmsnorm_bwd dw");
  }
}

TEST_F(EngineCudaKernels, SwiGlu) {
  const auto hh = randn(rng, kN * 2 * kF, 3.0), dm = randn(rng, kN * kF);
  std::vector<float> m(kN * kF), dh(kN * 2 * kF);
  swiglu_fwd(hh.data(), m.data(), kN, kF);
  swiglu_bwd(hh.data(), dm.data(), dh.data(), kN, kF);
  Dev<float> gh(hh), gm{size_t(kN * kF)}, gdm(dm), gdh{size_t(kN * 2 * kF)};
  gpu::swiglu_fwd(gh, gm, kN, kF, s);
  gpu::swiglu_bwd(gh, gdm, gdh, kN, kF, s);
  expect_close(gm.host(), m, kTransRtol, kTransAtol, "swiglu_fwd");
  std::vector<double> scale(static_cast<size_t>(kN * 2 * kF));  // |d b| (1 + |a|) and |d a|
  for (int64_t n = 0; n < kN; ++n)
    for (int64_t f = 0; f < kF; ++f) {
      const double a = hh[n * 2 * kF + f], b = hh[n * 2 * kF + kF + f], d = dm[n * kF + f];
      scale[size_t(n * 2 * kF + f)] = std::fabs(d * b) * (1 + std::fabs(a));
      scale[size_t(n * 2 * kF + kF + f)] = std::fabs(d * a);
    }
  expect_close(gdh.host(), dh, kTransRtol, trans_atol(scale), "swiglu_bwd");
}

TEST_F(EngineCudaKernels, Rope) {
  for (bool inverse : {false, true}) {
    const auto x0 = randn(rng, kN * kNH * kK);
    std::vector<float> x = x0;
    rope_apply(x.data(), kN, kT, kNH, kK, 10000.0, inverse);
    Dev<float> gx(x0);
    gpu::rope_apply(gx, kN, kT, kNH, kK, 10000.0, inverse, s);
    // cos / sin in fp64 then rounded to fp32 (equal but for a rounding-boundary case), then two products
    // and a sum: 4 ulp of the largest term.
    expect_close(gx.host(), x, 4 * kEps32, 4 * kEps32 * 4, inverse ? "rope inverse" : "rope");
  }
}

TEST_F(EngineCudaKernels, Conv3Silu) {
  const int64_t D = kNH * kK;
  const auto x = randn(rng, kN * D), wc = randn(rng, D * 3, 0.6), dy = randn(rng, kN * D), dwc0 = randn(rng, D * 3);
  std::vector<float> c(kN * D), y(kN * D), dx(kN * D), dwc = dwc0;
  conv3_silu_fwd(x.data(), wc.data(), c.data(), y.data(), kN, kT, D);
  conv3_silu_bwd(x.data(), wc.data(), c.data(), dy.data(), dx.data(), dwc.data(), kN, kT, D);
  Dev<float> gx(x), gwc(wc), gc{size_t(kN * D)}, gy{size_t(kN * D)}, gdy(dy), gdx{size_t(kN * D)}, gdwc(dwc0);
  gpu::conv3_silu_fwd(gx, gwc, gc, gy, kN, kT, D, s);
  gpu::conv3_silu_bwd(gx, gwc, gc, gdy, gdx, gdwc, kN, kT, D, s);
  expect_close(gc.host(), c, 0, 0, "conv3 pre-activation (same fp32 sum order)");
  expect_close(gy.host(), y, kTransRtol, kTransAtol, "conv3_silu_fwd");
  // dx sums three taps wc dc, dc = dy s (1 + a (1 - s)): each tap's error scales with |wc dy| (1 + |a|).
  std::vector<double> scale(size_t(kN * D), 0.0);
  for (int64_t m = 0; m < kN; ++m)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t dt = 0; dt < 3; ++dt)
        if (m % kT + dt < kT) {
          const int64_t i = (m + dt) * D + d;
          scale[size_t(m * D + d)] += std::fabs(double(wc[d * 3 + 2 - dt]) * dy[i]) * (1 + std::fabs(double(c[i])));
        }
  expect_close(gdx.host(), dx, kTransRtol, trans_atol(scale), "conv3_silu_bwd dx");
  expect_close(gdwc.host(), dwc, 0, kColAtol, "conv3_silu_bwd dwc");
}

TEST_F(EngineCudaKernels, L2Norm) {
  const auto u = randn(rng, kN * kNH * kK), dw = randn(rng, kN * kNH * kK);
  std::vector<float> w(u.size()), rinv(kN * kNH), du(u.size());
  l2norm_fwd(u.data(), w.data(), rinv.data(), kN, kNH, kK, 1e-6);
  l2norm_bwd(w.data(), rinv.data(), dw.data(), du.data(), kN, kNH, kK);
  Dev<float> gu(u), gw{size_t(u.size())}, grinv{size_t(kN * kNH)}, gdw(dw), gdu{size_t(u.size())};
  gpu::l2norm_fwd(gu, gw, grinv, kN, kNH, kK, 1e-6, s);
  gpu::l2norm_bwd(gw, grinv, gdw, gdu, kN, kNH, kK, s);
  expect_close(grinv.host(), rinv, kRowRtol, 0, "l2norm_fwd rinv");
  expect_close(gw.host(), w, kRowRtol, 0, "l2norm_fwd w");
  // du = rinv (dw - w (w . dw)): the difference may cancel, so absolute error relative to rinv |dw| ~ 0.3.
  expect_close(gdu.host(), du, kRowRtol, 1e-6, "l2norm_bwd");
}

TEST_F(EngineCudaKernels, BetaAndLogSigmoid) {
  const int64_t n = kN * kNH;
  auto z = randn(rng, n, 4.0);
  z[0] = 30.0f;  // saturated sigmoid: beta ~ 2
  z[1] = -30.0f;
  const auto dgrad = randn(rng, n);
  std::vector<float> beta(n), dzb(n), g(n), dzg(n);
  beta_fwd(z.data(), beta.data(), n);
  beta_bwd(beta.data(), dgrad.data(), dzb.data(), n);
  logsigmoid_fwd(z.data(), g.data(), n);
  logsigmoid_bwd(g.data(), dgrad.data(), dzg.data(), n);
  Dev<float> gz(z), gbeta{size_t(n)}, gd(dgrad), gdzb{size_t(n)}, gg{size_t(n)}, gdzg{size_t(n)};
  gpu::beta_fwd(gz, gbeta, n, s);
  gpu::beta_bwd(gbeta, gd, gdzb, n, s);
  gpu::logsigmoid_fwd(gz, gg, n, s);
  gpu::logsigmoid_bwd(gg, gd, gdzg, n, s);
  expect_close(gbeta.host(), beta, kTransRtol, kTransAtol, "beta_fwd");
  std::vector<double> scale(static_cast<size_t>(n));  // |dbeta| beta, beta <= 2; |dg| for 1 - exp(g)
  for (int64_t i = 0; i < n; ++i) scale[size_t(i)] = 2 * std::fabs(double(dgrad[i]));
  expect_close(gdzb.host(), dzb, kTransRtol, trans_atol(scale), "beta_bwd");
  expect_close(gg.host(), g, kTransRtol, kTransAtol, "logsigmoid_fwd");
  expect_close(gdzg.host(), dzg, kTransRtol, trans_atol(scale), "logsigmoid_bwd");
}

TEST_F(EngineCudaKernels, AddAndBf16) {
  const int64_t n = kN * kC;
  const auto a = randn(rng, n), b = randn(rng, n);
  std::vector<float> y = a;
  add_inplace(y.data(), b.data(), n);
  Dev<float> ga(a), gb(b), gy{size_t(n)};
  gpu::add(ga, gb, gy, n, s);
  gpu::add(ga, gb, ga, n, s);  // in place, as add_inplace
  expect_close(gy.host(), y, 0, 0, "add");
  expect_close(ga.host(), y, 0, 0, "add in place");
  // bf16 round trip: 8 significant bits, round to nearest even: relative error <= u = 2^-8.
  Dev<__nv_bfloat16> gbf{std::vector<__nv_bfloat16>(size_t(n))};
  Dev<float> back{size_t(n)};
  gpu::to_bf16(gb, gbf, n, s);
  gpu::from_bf16(gbf, back, n, s);
  expect_close(back.host(), b, 0x1.0p-8, 0, "bf16 round trip");
}

// A device bf16 output of n elements, poisoned (every bit set: NaN), and the bits of a device bf16 array.
struct DevBf16 : Dev<__nv_bfloat16> {
  explicit DevBf16(size_t count) : Dev<__nv_bfloat16>(std::vector<__nv_bfloat16>(count)) {
    EXPECT_EQ(cudaMemset(p, 0xff, std::max<size_t>(n, 1) * sizeof(uint16_t)), cudaSuccess);
  }
};
std::vector<uint16_t> bits(const Dev<__nv_bfloat16>& d) {
  const std::vector<__nv_bfloat16> h = d.host();
  std::vector<uint16_t> b(h.size());
  std::memcpy(b.data(), h.data(), h.size() * sizeof(uint16_t));
  return b;
}

TEST_F(EngineCudaKernels, PaddedHeads) {
  // The conversions that zero-pad a head of K = kK to the attention op's Kp = 64 (CudaModel, head dims other
  // than 64 and 128): the first K columns of every row are the unpadded call's bit for bit, the pad is zero
  // (over a poisoned output), reading back drops the pad, and Kp == K is the unpadded call.
  const int64_t rows = kN * kNH, Kp = 64;
  const auto x = randn(rng, rows * kK);
  Dev<float> gx(x);
  DevBf16 flat{size_t(rows * kK)}, pad{size_t(rows * Kp)}, same{size_t(rows * kK)};
  gpu::to_bf16(gx, flat, rows * kK, s);
  gpu::to_bf16_padded(gx, pad, rows, kK, Kp, s);
  gpu::to_bf16_padded(gx, same, rows, kK, kK, s);
  const auto bf = bits(flat), bp = bits(pad);
  EXPECT_TRUE(bits(same) == bf) << "to_bf16_padded with Kp == K";
  size_t bad_row = 0, bad_pad = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < Kp; ++e) {
      const uint16_t got = bp[size_t(r * Kp + e)];
      if (e < kK && got != bf[size_t(r * kK + e)]) ++bad_row;
      if (e >= kK && got != 0) ++bad_pad;
    }
  EXPECT_EQ(bad_row, 0u) << "to_bf16_padded: head elements differ from to_bf16";
  EXPECT_EQ(bad_pad, 0u) << "to_bf16_padded: pad elements not +0";
  Dev<float> back_flat{size_t(rows * kK)}, back_pad{size_t(rows * kK)}, back_same{size_t(rows * kK)};
  gpu::from_bf16(flat, back_flat, rows * kK, s);
  gpu::from_bf16_padded(pad, back_pad, rows, kK, Kp, s);
  gpu::from_bf16_padded(flat, back_same, rows, kK, kK, s);
  const auto want = back_flat.host();
  expect_close(back_pad.host(), want, 0, 0, "from_bf16_padded");
  expect_close(back_same.host(), want, 0, 0, "from_bf16_padded with Kp == K");

  // The per-head L2 norm writing w with rows of Kp (pad zero) and reading dw with rows of Kp (pad ignored:
  // filled with large values here): equal to the unpadded calls bit for bit.
  const auto u = randn(rng, rows * kK), dw = randn(rng, rows * kK);
  std::vector<float> dw_pad(size_t(rows * Kp), 1e3f);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(dw.begin() + r * kK, kK, dw_pad.begin() + r * Kp);
  Dev<float> gu(u), gw{size_t(rows * kK)}, grinv{size_t(rows)}, gdw(dw), gdu{size_t(rows * kK)};
  Dev<float> gwp{size_t(rows * Kp)}, grinvp{size_t(rows)}, gdwp(dw_pad), gdup{size_t(rows * kK)};
  gpu::l2norm_fwd(gu, gw, grinv, kN, kNH, kK, 1e-6, s);
  gpu::l2norm_bwd(gw, grinv, gdw, gdu, kN, kNH, kK, s);
  gpu::l2norm_fwd(gu, gwp, grinvp, kN, kNH, kK, 1e-6, s, Kp);
  gpu::l2norm_bwd(gwp, grinvp, gdwp, gdup, kN, kNH, kK, s, Kp);
  const auto w = gw.host(), wp = gwp.host();
  std::vector<float> wp_head(size_t(rows * kK)), wp_pad;
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(wp.begin() + r * Kp, kK, wp_head.begin() + r * kK);
    wp_pad.insert(wp_pad.end(), wp.begin() + r * Kp + kK, wp.begin() + (r + 1) * Kp);
  }
  expect_close(wp_head, w, 0, 0, "l2norm_fwd padded: head columns");
  expect_close(wp_pad, std::vector<float>(wp_pad.size(), 0.0f), 0, 0, "l2norm_fwd padded: pad columns");
  expect_close(grinvp.host(), grinv.host(), 0, 0, "l2norm_fwd padded: rinv");
  expect_close(gdup.host(), gdu.host(), 0, 0, "l2norm_bwd padded");
}

// rel_l2 of two whole arrays (fp64 sums).
double rel_l2_all(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

std::vector<float> bf16_rounded(std::vector<float> v) {
  for (float& x : v) x = __bfloat162float(__float2bfloat16_rn(x));
  return v;
}

// The attention call of CudaModel for head dims the CUDA attention is not built for, on its own: q, k, v, do
// fp32 [B, T, heads, K] go to bf16 [.., Kp] through to_bf16_padded, w through l2norm_fwd with rows of Kp, the op
// gets scale = gate_scale = 1 / sqrt(K) explicitly, and o, dq, dk, dv come back through from_bf16_padded, dw's
// first K columns through l2norm_bwd's stride. Reference: the CPU backend in fp32 on the unpadded heads with
// the same bf16-rounded q, k, v, do and the op's default scales (those of the CPU engine). What differs is the
// CUDA attention's own bf16 / fp16 / tf32 arithmetic, so the bars are those of its fp64-oracle tests
// (docs/numerics.md, CUDA backend): rel_l2 4e-3 on o, 1e-3 on lse, 1e-2 on dq, dk, dv
// and 2e-2 on dw, dbeta, dg. The pad columns of o are exactly zero (v's pad is zero). PaTH-FoX (w and gate),
// GQA (4 query heads on 2 kv heads), T = 200 (several chunks, a partial last one).
TEST_F(EngineCudaKernels, AttentionOnPaddedHeads) {
  const int64_t B = 2, T = 200, HQ = 4, H = 2, N = B * T;
  for (int64_t K : {24, 32, 48, 80}) {
    const int64_t Kp = cuda_attn_head_dim(int(K));
    SCOPED_TRACE("K = " + std::to_string(K) + ", Kp = " + std::to_string(Kp));
    const auto q = bf16_rounded(randn(rng, N * HQ * K)), k = bf16_rounded(randn(rng, N * H * K)),
               v = bf16_rounded(randn(rng, N * H * K)), dO = bf16_rounded(randn(rng, N * HQ * K));
    const auto u = randn(rng, N * H * K);
    std::vector<float> beta(size_t(N * H)), g(size_t(N * HQ)), w(u.size()), rinv(size_t(N * H));
    for (auto& b : beta) b = float(2.0 * rng.uniform());
    for (auto& x : g) x = float(-std::log1p(std::exp(-(rng.normal() + 3.0))));  // logsigmoid, as the oracle tests
    l2norm_fwd(u.data(), w.data(), rinv.data(), N, H, K, 1e-6);

    // CPU reference.
    std::vector<float> o(size_t(N * HQ * K)), lse(size_t(N * HQ)), dq(q.size()), dk(k.size()), dv(v.size()),
        dw(w.size()), dbeta(beta.size()), dg(g.size());
    auto hv = [](const std::vector<float>& x, std::initializer_list<int64_t> shape) {
      return make_view(const_cast<float*>(x.data()), DType::f32, shape);
    };
    PathFwdParams cf;
    cf.q = hv(q, {B, T, HQ, K});
    cf.k = hv(k, {B, T, H, K});
    cf.v = hv(v, {B, T, H, K});
    cf.w = hv(w, {B, T, H, K});
    cf.beta = hv(beta, {B, T, H});
    cf.g = hv(g, {B, T, HQ});
    cf.o = hv(o, {B, T, HQ, K});
    cf.lse = hv(lse, {B, T, HQ});
    cf.backend = Backend::cpu;
    ASSERT_TRUE(path_attn_fwd(cf).ok());
    PathBwdParams cb = bwd_params_for(cf);
    cb.do_ = hv(dO, {B, T, HQ, K});
    cb.dq = hv(dq, {B, T, HQ, K});
    cb.dk = hv(dk, {B, T, H, K});
    cb.dv = hv(dv, {B, T, H, K});
    cb.dw = hv(dw, {B, T, H, K});
    cb.dbeta = hv(dbeta, {B, T, H});
    cb.dg = hv(dg, {B, T, HQ});
    ASSERT_TRUE(path_attn_bwd(cb).ok());

    // CUDA, padded as CudaModel pads.
    Dev<float> gq(q), gk(k), gv(v), gdO(dO), gu(u), gbeta(beta), gg(g);
    DevBf16 qb{size_t(N * HQ * Kp)}, kb{size_t(N * H * Kp)}, vb{size_t(N * H * Kp)}, ob{size_t(N * HQ * Kp)},
        dOb{size_t(N * HQ * Kp)}, dqb{size_t(N * HQ * Kp)}, dkb{size_t(N * H * Kp)}, dvb{size_t(N * H * Kp)};
    Dev<float> gw{size_t(N * H * Kp)}, grinv{size_t(N * H)}, glse{size_t(N * HQ)}, gdw{size_t(N * H * Kp)},
        gdbeta{size_t(N * H)}, gdg{size_t(N * HQ)};
    Dev<float> go{size_t(N * HQ * K)}, gdq{size_t(N * HQ * K)}, gdk{size_t(N * H * K)}, gdv{size_t(N * H * K)};
    gpu::to_bf16_padded(gq, qb, N * HQ, K, Kp, s);
    gpu::to_bf16_padded(gk, kb, N * H, K, Kp, s);
    gpu::to_bf16_padded(gv, vb, N * H, K, Kp, s);
    gpu::to_bf16_padded(gdO, dOb, N * HQ, K, Kp, s);
    gpu::l2norm_fwd(gu, gw, grinv, N, H, K, 1e-6, s, Kp);
    auto cv = [](void* p, DType dt, std::initializer_list<int64_t> shape) {
      return make_view(p, dt, shape, Device::cuda);
    };
    PathFwdParams f;
    f.q = cv(qb, DType::bf16, {B, T, HQ, Kp});
    f.k = cv(kb, DType::bf16, {B, T, H, Kp});
    f.v = cv(vb, DType::bf16, {B, T, H, Kp});
    f.w = cv(gw, DType::f32, {B, T, H, Kp});
    f.beta = cv(gbeta, DType::f32, {B, T, H});
    f.g = cv(gg, DType::f32, {B, T, HQ});
    f.o = cv(ob, DType::bf16, {B, T, HQ, Kp});
    f.lse = cv(glse, DType::f32, {B, T, HQ});
    f.scale = 1.0 / std::sqrt(double(K));
    f.gate_scale = f.scale;
    f.backend = Backend::cuda;
    f.stream = s;
    const Status sf = path_attn_fwd(f);
    ASSERT_TRUE(sf.ok()) << sf.message();
    PathBwdParams b = bwd_params_for(f);
    b.do_ = cv(dOb, DType::bf16, {B, T, HQ, Kp});
    b.dq = cv(dqb, DType::bf16, {B, T, HQ, Kp});
    b.dk = cv(dkb, DType::bf16, {B, T, H, Kp});
    b.dv = cv(dvb, DType::bf16, {B, T, H, Kp});
    b.dw = cv(gdw, DType::f32, {B, T, H, Kp});
    b.dbeta = cv(gdbeta, DType::f32, {B, T, H});
    b.dg = cv(gdg, DType::f32, {B, T, HQ});
    b.deterministic = true;
    const Status sb = path_attn_bwd(b);
    ASSERT_TRUE(sb.ok()) << sb.message();
    gpu::from_bf16_padded(ob, go, N * HQ, K, Kp, s);
    gpu::from_bf16_padded(dqb, gdq, N * HQ, K, Kp, s);
    gpu::from_bf16_padded(dkb, gdk, N * H, K, Kp, s);
    gpu::from_bf16_padded(dvb, gdv, N * H, K, Kp, s);

    const auto ob_bits = bits(ob);
    size_t pad_nonzero = 0;
    for (int64_t r = 0; r < N * HQ; ++r)
      for (int64_t e = K; e < Kp; ++e) pad_nonzero += (ob_bits[size_t(r * Kp + e)] & 0x7fff) != 0 ? 1 : 0;
    EXPECT_EQ(pad_nonzero, 0u) << "o: padded columns not zero";
    const auto glse_h = glse.host();
    // lse: rel_l2 as the oracle tests bar it; the largest error relative to max(1, |lse|) is printed too (a
    // maximum over 1600 rows of fresh random inputs: it reached 1.2e-3 at K = 24 in one run).
    const double lse_rel = rel_l2_all(glse_h, lse);
    double lse_max = 0;
    for (size_t i = 0; i < lse.size(); ++i)
      lse_max = std::max(lse_max, std::fabs(double(glse_h[i]) - lse[i]) / std::max(1.0, std::fabs(double(lse[i]))));
    const auto gdw_h = gdw.host();
    std::vector<float> dw_head(dw.size());
    for (int64_t r = 0; r < N * H; ++r) std::copy_n(gdw_h.begin() + r * Kp, K, dw_head.begin() + r * K);
    const double eo = rel_l2_all(go.host(), o), edq = rel_l2_all(gdq.host(), dq), edk = rel_l2_all(gdk.host(), dk),
                 edv = rel_l2_all(gdv.host(), dv), edw = rel_l2_all(dw_head, dw),
                 edb = rel_l2_all(gdbeta.host(), dbeta), edg = rel_l2_all(gdg.host(), dg);
    std::printf("  K %lld (Kp %lld): o %.2e lse %.2e (max %.2e) dq %.2e dk %.2e dv %.2e dw %.2e dbeta %.2e dg %.2e\n",
                (long long)K, (long long)Kp, eo, lse_rel, lse_max, edq, edk, edv, edw, edb, edg);
    EXPECT_LE(eo, 4e-3) << "o";
    EXPECT_LE(lse_rel, 1e-3) << "lse";
    EXPECT_LE(edq, 1e-2) << "dq";
    EXPECT_LE(edk, 1e-2) << "dk";
    EXPECT_LE(edv, 1e-2) << "dv";
    EXPECT_LE(edw, 2e-2) << "dw";
    EXPECT_LE(edb, 2e-2) << "dbeta";
    EXPECT_LE(edg, 2e-2) << "dg";
  }
}

TEST_F(EngineCudaKernels, CrossEntropy) {
  auto logits = randn(rng, kN * kVc, 3.0);
  std::vector<int32_t> tgt(kN);
  for (int64_t n = 0; n < kN; ++n) tgt[n] = (n % 4 == 3) ? -1 : int32_t(rng.next() % kVc);
  // A tie for the maximum: the first index wins, as in ops.cpp.
  logits[2 * kVc + 5] = logits[2 * kVc + 9] = 50.0f;
  tgt[2] = 9;
  std::vector<float> dl(kN * kVc);
  std::vector<int32_t> pred(kN);
  const CeStats st = cross_entropy(logits.data(), tgt.data(), dl.data(), pred.data(), kN, kVc, 0.37);
  Dev<float> gl(logits), gdl{size_t(kN * kVc)};
  Dev<int32_t> gt(tgt), ghit{size_t(kN)}, gpred{size_t(kN)};
  Dev<double> gloss{size_t(kN)}, gsum{size_t(2)};
  gpu::cross_entropy_fwd(gl, gt, gloss, ghit, gpred, kN, kVc, s);
  gpu::cross_entropy_sum(gloss, ghit, gsum, kN, s);
  gpu::cross_entropy_bwd(gl, gt, gdl, kN, kVc, 0.37, s);
  const auto sum = gsum.host();
  EXPECT_EQ(gpred.host(), pred);
  EXPECT_EQ(int64_t(sum[1]), st.correct);
  // Loss: fp64 on both sides (exp / log of double); only the summation order differs.
  EXPECT_NEAR(sum[0], st.loss_sum, 1e-12 * std::max(1.0, st.loss_sum));
  // dlogits: (p - onehot) * scale computed in fp64, rounded once to fp32.
  expect_close(gdl.host(), dl, 2 * kEps32, 1e-12, "cross_entropy dlogits");
}

TEST_F(EngineCudaKernels, GradNormAndAdamW) {
  // A small model's layout; AdamW<float>::step on the host vs sumsq + adamw per tensor on the device, with
  // the scalars formed as CudaModel::adam_step forms them (and as optim.cpp does).
  ModelConfig mc;
  mc.attn = AttnKind::path;
  mc.vocab_size = 11;
  mc.d_model = 24;
  mc.n_head = 3;
  Model<float> model(mc);
  model.init(3);
  model.grads = randn(rng, model.grads.size(), 0.5);
  AdamW<float> opt;
  opt.init(int64_t(model.params.size()));
  opt.m = randn(rng, opt.m.size(), 0.1);
  for (auto& v : opt.v) v = float(rng.uniform() * 0.01);
  opt.t = 4;
  TrainConfig tc;
  tc.grad_clip = 0.5;  // below the norm: the clip is active
  Dev<float> gp(model.params), gg(model.grads), gm(opt.m), gv(opt.v);
  Dev<double> partial{size_t(gpu::kNormBlocks)}, out{size_t(1)};
  const double norm = opt.step(model, tc, 2e-3);
  gpu::sumsq(gg, int64_t(model.grads.size()), partial, out, s);
  const double gnorm = std::sqrt(out.host()[0]);
  EXPECT_NEAR(gnorm, norm, 1e-12 * norm);  // fp64 sums of the same squares
  ASSERT_GT(norm, tc.grad_clip);
  const float gscale = float(tc.grad_clip / norm);
  const int64_t t = 5;
  for (const ParamInfo& pi : model.layout())
    gpu::adamw(gp.p + pi.offset, gg.p + pi.offset, gm.p + pi.offset, gv.p + pi.offset, pi.numel, gscale,
               float(tc.beta1), float(tc.beta2), float(1.0 - std::pow(tc.beta1, double(t))),
               float(1.0 - std::pow(tc.beta2, double(t))), float(2e-3), float(tc.adam_eps),
               pi.decay ? float(tc.weight_decay) : 0.0f, s);
  // Same fp32 expression, no contraction on either side (--fmad=false; a -march=native host build may
  // fuse): 4 ulp.
  expect_close(gp.host(), model.params, 4 * kEps32, 0, "adamw params");
  expect_close(gm.host(), opt.m, 4 * kEps32, 1e-12, "adamw m");
  expect_close(gv.host(), opt.v, 4 * kEps32, 1e-15, "adamw v");
}

// ---- whole models --------------------------------------------------------------------------------------

// The A5 model of the parity tests: width 128, 2 heads (head dim 64), 2 layers, words of 20.
RunConfig a5_config(AttnKind attn) {
  RunConfig c;
  c.model.attn = attn;
  c.model.d_model = 128;
  c.model.n_head = 2;
  c.model.n_layer = 2;
  c.task.name = "a5";
  c.task.seq_len = 20;
  c.task.eval_sequences = 64;
  c.train.steps = 8;
  c.train.batch_size = 16;
  c.train.lr = 3e-3;
  c.train.warmup_steps = 2;
  c.train.threads = 1;
  c.train.log_every = 1;
  return c;
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b, int64_t off, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = off; i < off + n; ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double l2_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return std::sqrt(s);
}

// CPU (fp32, attention on the cpu backend in fp32) and CUDA (fp32 layers, attention in bf16) train the same
// model from the same init on the same batches.
//
// Tolerances. The only deliberate difference is the bf16 rounding of q, k, v, o, do (and dq, dk, dv) at
// the attention call: relative u = 2^-8 per element. Step 0 (identical parameters): the loss moves by the
// attention output's rounding passed through Wo, whose init scale (0.02 / sqrt(4)) keeps the attention
// branch small against the residual stream: bound 2e-4 of the loss (measured on an H200: 1e-5 for path and
// rope). Gradients at step 0: the attention parameters see the rounding of a few bf16 operands directly
// (a few u): each tensor within 3% relative L2 (measured: at most 0.5%). Later steps: Adam divides by
// sqrt(v), so a gradient element near zero can take the other sign and move its parameter by up to lr in
// either run; the loss drifts by 1e-3 of the loss at most over 8 steps (measured: 8e-5), and the final
// parameters' distance stays below 5% of the distance the CPU run moved them (measured: 1.7% path, 1.9%
// rope).
//
// The same bounds hold for the flip-flop cases below (head dim 32 or 48, zero-padded to 64 at the attention
// call; one layer, so Wo's init scale is 0.02 / sqrt(2)): the padding is exact (engine/cuda/model_cuda.cpp),
// so the only difference is again the bf16 rounding of the same K-element rows.
// With train.matmul = "bf16" every GEMM rounds its operands to bf16 (u = 2^-9 against fp32's 2^-24, fp32 sums):
// the attention op's own bf16 operands already set the bounds above, and rounding every matrix product's
// operands too moves the loss and gradients by a few more u each, so the bounds are ten times looser (`loose`).
void parity(RunConfig cfg, const std::string& label, double loose = 1.0) {
  const char* const name = label.c_str();
  const auto task = make_task(cfg.task);
  cfg = resolve_config(cfg, *task);
  Model<float> cpu(cfg.model);
  cpu.backend = Backend::cpu;
  cpu.threads = 1;
  cpu.init(cfg.train.seed);
  const std::vector<float> init = cpu.params;
  AdamW<float> opt;
  opt.init(int64_t(cpu.params.size()));
  CudaModel dev(cfg.model, cfg.train.matmul);
  dev.upload(cpu, &opt);
  Batch b;
  for (int64_t step = 0; step < cfg.train.steps; ++step) {
    task->train_batch(cfg.train.seed, step, cfg.train.batch_size, &b);
    cpu.zero_grad();
    dev.zero_grad();
    const StepStats sc = cpu.forward(b.tokens.data(), b.targets.data(), b.B, b.T);
    const StepStats sd = dev.forward(b.tokens.data(), b.targets.data(), b.B, b.T);
    EXPECT_EQ(sc.count, sd.count);
    const double tol = (step == 0 ? 2e-4 : 1e-3) * loose * sc.loss;
    EXPECT_NEAR(sd.loss, sc.loss, tol) << name << " step " << step;
    std::printf("  %s step %lld: loss cpu %.6f cuda %.6f (diff %.2e)\n", name, (long long)step, sc.loss, sd.loss,
                sd.loss - sc.loss);
    cpu.backward();
    dev.backward();
    if (step == 0) {
      const std::vector<float> gd = dev.grads();
      double worst = 0;
      for (const ParamInfo& p : cpu.layout()) {
        const double e = rel_l2(gd, cpu.grads, p.offset, p.numel);
        worst = std::max(worst, e);
        EXPECT_LT(e, 3e-2 * loose) << name << " gradient of " << p.name;
      }
      std::printf("  %s step 0: worst per-tensor relative L2 gradient difference %.2e\n", name, worst);
    }
    const double lr = lr_at(cfg.train, step);
    const double nc = opt.step(cpu, cfg.train, lr);
    const double nd = dev.adam_step(cfg.train, lr);
    if (step == 0) {
      EXPECT_NEAR(nd, nc, 3e-2 * loose * nc) << "grad norm";
    }
  }
  Model<float> back(cfg.model);
  AdamW<float> back_opt;
  dev.download(back, &back_opt);
  EXPECT_EQ(back_opt.t, opt.t);
  const double moved = l2_diff(cpu.params, init), apart = l2_diff(back.params, cpu.params);
  std::printf("  %s: parameters moved %.4f (cpu), cpu vs cuda %.4f\n", name, moved, apart);
  EXPECT_GT(moved, 0.0);
  EXPECT_LT(apart, 0.05 * loose * moved) << name;
}

void parity(AttnKind attn) { parity(a5_config(attn), attn_kind_name(attn)); }

// The paper-size flip-flop model (configs/repro_flipflop.json, embedded: width 64, 2 heads, so head dim 32,
// one layer, 16 sequences of 512), 8 steps as above; width_override > 0 changes the width (96: head dim 48).
RunConfig flipflop_config(AttnKind attn, int width_override = 0) {
  RunConfig c = parse_config_text(embedded_config("repro_flipflop"), "embedded config repro_flipflop");
  c.model.attn = attn;
  if (width_override > 0) c.model.d_model = width_override;
  c.train.steps = 8;
  c.train.warmup_steps = 2;
  c.train.threads = 1;
  c.train.log_every = 1;
  return c;
}

TEST(EngineCudaParity, PathA5) {
  REQUIRE_GPU();
  parity(AttnKind::path);
}

TEST(EngineCudaParity, RopeA5) {
  REQUIRE_GPU();
  parity(AttnKind::rope);
}

TEST(EngineCudaParity, PathA5Bf16Matmul) {
  REQUIRE_GPU();
  RunConfig cfg = a5_config(AttnKind::path);
  cfg.train.matmul = "bf16";
  parity(cfg, "path bf16 matmul", 10.0);
}

// Head dims below 64: the attention runs on heads zero-padded to 64. PaTH (w padded), PaTH-FoX (the gate,
// whose gate_scale must stay the CPU engine's 1 / sqrt(K)), RoPE (rotation over the true K only), and an
// odd head dim (48).
TEST(EngineCudaParity, PathFlipFlopHeadDim32) {
  REQUIRE_GPU();
  parity(flipflop_config(AttnKind::path), "path flip-flop K 32");
}

TEST(EngineCudaParity, PathFoxFlipFlopHeadDim32) {
  REQUIRE_GPU();
  parity(flipflop_config(AttnKind::path_fox), "path-fox flip-flop K 32");
}

TEST(EngineCudaParity, RopeFlipFlopHeadDim32) {
  REQUIRE_GPU();
  parity(flipflop_config(AttnKind::rope), "rope flip-flop K 32");
}

TEST(EngineCudaParity, PathFoxFlipFlopHeadDim48) {
  REQUIRE_GPU();
  parity(flipflop_config(AttnKind::path_fox, 96), "path-fox flip-flop K 48");
}

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("pathattn_engcuda_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

RunResult run(const RunConfig& cfg, const std::string& dir, const std::string& device, int64_t stop_after,
              const std::string& resume = "") {
  RunOptions ro;
  ro.out_dir = dir;
  ro.progress = false;
  ro.device = device;
  ro.stop_after = stop_after;
  ro.resume = resume;
  return train_run(cfg, ro);
}

// The tensor bytes of a checkpoint, by name.
std::map<std::string, std::vector<uint8_t>> tensors_of(const std::string& path) {
  const StFile f = read_safetensors(path);
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& [name, e] : f.tensors) out[name].assign(f.data.begin() + e.begin, f.data.begin() + e.end);
  return out;
}

TEST(EngineCudaCheckpoint, MovesBetweenDevices) {
  REQUIRE_GPU();
  RunConfig cfg = a5_config(AttnKind::path);
  cfg.train.steps = 6;
  const std::string root = temp_dir("ckpt");
  // Uninterrupted 6-step runs on each device.
  const RunResult cpu6 = run(cfg, root + "/cpu6", "cpu", -1);
  const RunResult cuda6 = run(cfg, root + "/cuda6", "cuda", -1);
  ASSERT_TRUE(cpu6.finished && cuda6.finished);
  // The two devices' runs differ by the bf16 attention (see parity above); a run that switches device half
  // way differs from either by no more than twice that gap.
  const double gap = l2_diff(cpu6.params_f32, cuda6.params_f32);
  EXPECT_GT(gap, 0.0);

  for (const std::string first : {"cuda", "cpu"}) {
    const std::string other = first == "cuda" ? "cpu" : "cuda";
    const std::string d = root + "/" + first + "3";
    run(cfg, d, first, 3);
    const std::string ck = d + "/ckpt.safetensors";
    fs::copy_file(ck, root + "/" + first + "3.safetensors");
    const auto saved = tensors_of(root + "/" + first + "3.safetensors");
    // Loading on the other device and saving again at once (no step) gives the same tensors, bit for bit:
    // parameters and both AdamW moments cross host <-> device unchanged.
    const std::string d0 = root + "/" + first + "3_" + other + "0";
    fs::create_directories(d0);
    fs::copy_file(ck, d0 + "/ckpt.safetensors");
    const RunResult r0 = run(cfg, d0, other, 3, d0 + "/ckpt.safetensors");
    EXPECT_EQ(r0.start_step, 3);
    EXPECT_EQ(r0.steps_done, 3);
    EXPECT_TRUE(tensors_of(d0 + "/ckpt.safetensors") == saved) << first << " -> " << other << ": tensors changed";
    EXPECT_EQ(read_checkpoint(d0 + "/ckpt.safetensors").config.train.device, other);
    // Continuing on the other device to the end lands near the uninterrupted runs (parity tolerance above).
    const RunResult r = run(cfg, d, other, -1, ck);
    EXPECT_EQ(r.start_step, 3);
    ASSERT_TRUE(r.finished);
    const double to_cpu = l2_diff(r.params_f32, cpu6.params_f32), to_cuda = l2_diff(r.params_f32, cuda6.params_f32);
    std::printf("  %s 3 steps + %s 3 steps: distance to the cpu run %.4f, to the cuda run %.4f (gap %.4f)\n",
                first.c_str(), other.c_str(), to_cpu, to_cuda, gap);
    EXPECT_LT(to_cpu, 2 * gap);
    EXPECT_LT(to_cuda, 2 * gap);
  }

  // On the CUDA device alone a stopped and resumed run ends bitwise equal to the uninterrupted one (the
  // kernels have no atomics; the attention backward runs in its deterministic mode).
  const std::string dc = root + "/cuda_resume";
  run(cfg, dc, "cuda", 3);
  const RunResult rc = run(cfg, dc, "", -1, dc + "/ckpt.safetensors");
  ASSERT_TRUE(rc.finished);
  EXPECT_TRUE(rc.params_f32 == cuda6.params_f32) << "CUDA resume is not bitwise";
  EXPECT_EQ(rc.last_loss, cuda6.last_loss);
  fs::remove_all(root);
}

TEST(EngineCudaErrors, HeadDimAndDtype) {
  REQUIRE_GPU();
  RunConfig c = a5_config(AttnKind::path);
  c.model.head_dim = 136;  // above the largest head dim the CUDA attention is built for
  try {
    run(c, "", "cuda", -1);
    ADD_FAILURE() << "head dim 136 trained on cuda";
  } catch (const EngineError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model.head_dim"), std::string::npos) << m;
    EXPECT_NE(m.find("1..128"), std::string::npos) << m;
    EXPECT_NE(m.find("136"), std::string::npos) << m;
  }
  c = a5_config(AttnKind::path);
  c.train.dtype = "f64";
  try {
    run(c, "", "cuda", -1);
    ADD_FAILURE() << "f64 trained on cuda";
  } catch (const EngineError& e) {
    EXPECT_NE(std::string(e.what()).find("train.dtype"), std::string::npos) << e.what();
  }
  // Every head dim up to 128 is accepted: MQRAR's 128, A5's 64, the flip-flop preset's 32 (zero-padded).
  for (int K : {8, 32, 48, 64, 72, 128}) {
    RunConfig m;
    m.model.d_model = 2 * K;
    m.model.n_head = 2;
    EXPECT_NO_THROW(check_cuda_model(m.model)) << "head dim " << K;
    EXPECT_EQ(cuda_attn_head_dim(K), K <= 64 ? 64 : 128);
  }
}

}  // namespace
}  // namespace pathattn::engine
