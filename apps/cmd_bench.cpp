// apps/cmd_bench.cpp: `pathattn bench`: the CPU speed ratios of issue 2 from one run (docs/benchmarks.md, "CPU").
// fp32, B = 1, HQ = H = heads, K = V: the fp64 oracle forward, the fast PaTH forward and forward+backward,
// the library's plain causal attention (same op, w and beta absent) forward and forward+backward, and a
// large sgemm on the same BLAS and thread count. Prints medians, effective GFLOP/s and the ratios.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "check/harness.h"
#include "cpu/blas.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace pathattn::app {
namespace {

using pathattn::test::Case;
using pathattn::test::CaseSpec;
using pathattn::test::HostTensor;

struct BenchArgs {
  int threads = 2;
  int64_t T = 4096, K = 64, heads = 4, gemm_n = 2048;
  int reps = 5, oracle_reps = 1;
  bool json = false;
};

// One timed row: the median of `reps` runs (after one untimed warm-up run unless warmup = false).
struct Row {
  Row(std::string n, double g) : name(std::move(n)), gflop(g) {}
  std::string name;
  double gflop = 0;  // work per run, effective (FlashAttention formula for attention rows)
  int reps = 0;
  double ms = NAN;
  std::string error;  // the Status message when a run failed
  double gflops() const { return std::isfinite(ms) ? gflop / (ms * 1e-3) : NAN; }
};

// Times fn (which returns a Status) `reps` times; the row keeps the median or the first error.
void time_row(Row* row, int reps, bool warmup, const std::function<Status()>& fn) {
  row->reps = reps;
  if (warmup) {
    const Status s = fn();
    if (!s.ok()) {
      row->error = s.message();
      return;
    }
  }
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = fn();
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) {
      row->error = s.message();
      return;
    }
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  row->ms = ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
}

// Buffers and params of one attention configuration: PaTH (with w, beta) or plain (without).
struct AttnRun {
  HostTensor o, lse, dout, dq, dk, dv, dw, dbeta;
  PathFwdParams f;
  PathBwdParams b;
  AttnRun(const Case& c, bool path, Backend be, int threads) {
    const CaseSpec& s = c.spec;
    o = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.V});
    lse = HostTensor(DType::f32, {s.B, s.T, s.HQ});
    dout = test::random_dout(c, 11);
    dq = HostTensor(s.dtype, {s.B, s.T, s.HQ, s.K});
    dk = HostTensor(s.dtype, {s.B, s.T, s.H, s.K});
    dv = HostTensor(s.dtype, {s.B, s.T, s.H, s.V});
    f = c.fwd_params(o, &lse);
    if (!path) f.w = f.beta = TensorView();
    f.backend = be;
    f.num_threads = threads;
    b = bwd_params_for(f);
    b.do_ = dout.view();
    b.dq = dq.view();
    b.dk = dk.view();
    b.dv = dv.view();
    if (path) {
      dw = HostTensor(DType::f32, {s.B, s.T, s.H, s.K});
      dbeta = HostTensor(DType::f32, {s.B, s.T, s.H});
      b.dw = dw.view();
      b.dbeta = dbeta.view();
    }
  }
  Status fwd() const { return path_attn_fwd(f); }
  Status fwd_bwd() const {
    const Status s = path_attn_fwd(f);
    return s.ok() ? path_attn_bwd(b) : s;
  }
};

struct Ratio {
  std::string name;
  double value;
  bool at_least;  // the bar is value >= bar (else value <= bar)
  double bar;
  bool met() const { return std::isfinite(value) && (at_least ? value >= bar : value <= bar); }
};

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown";
}

int run_bench(const BenchArgs& a) {
  CaseSpec s;
  s.B = 1;
  s.T = a.T;
  s.HQ = s.H = a.heads;
  s.K = s.V = a.K;
  s.path = true;
  s.gate = false;
  s.dtype = DType::f32;
  s.beta = test::BetaMode::uniform02;
  s.seed = 1;
  const Case c = Case::make(s);  // q, k, v ~ N(0, 1), w = L2-normalised N(0, 1), beta ~ U(0, 2)
  const double attn_gflop = 4.0 * double(s.HQ) * double(s.T) * double(s.T) * double(s.K) / 2 * 1e-9;

  std::vector<Row> rows = {{"oracle PaTH fwd (fp64)", attn_gflop},
                           {"fast PaTH fwd", attn_gflop},
                           {"fast PaTH fwd+bwd", 3.5 * attn_gflop},
                           {"plain attention fwd", attn_gflop},
                           {"plain attention fwd+bwd", 3.5 * attn_gflop},
                           {"sgemm " + std::to_string(a.gemm_n) + "^3", 2.0 * std::pow(double(a.gemm_n), 3) * 1e-9}};
  {
    const AttnRun oracle(c, true, Backend::oracle, a.threads);
    time_row(&rows[0], a.oracle_reps, false, [&] { return oracle.fwd(); });
  }
  {
    const AttnRun fast(c, true, Backend::cpu, a.threads);
    time_row(&rows[1], a.reps, true, [&] { return fast.fwd(); });
    time_row(&rows[2], a.reps, true, [&] { return fast.fwd_bwd(); });
  }
  {
    const AttnRun plain(c, false, Backend::cpu, a.threads);
    time_row(&rows[3], a.reps, true, [&] { return plain.fwd(); });
    time_row(&rows[4], a.reps, true, [&] { return plain.fwd_bwd(); });
  }
  {
    // The same OpenBLAS on the same number of threads (the OpenMP build follows both settings).
    const int64_t n = a.gemm_n;
    std::vector<float> A(n * n), B(n * n), C(n * n);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    for (auto& x : A) x = nd(rng);
    for (auto& x : B) x = nd(rng);
#ifdef _OPENMP
    const int omp_before = omp_get_max_threads();
    omp_set_num_threads(a.threads);
#endif
    cpu::set_blas_threads(a.threads);
    time_row(&rows[5], a.reps, true, [&] {
      cpu::gemm(false, false, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
      return Status::Ok();
    });
#ifdef _OPENMP
    omp_set_num_threads(omp_before);
#endif
  }

  const std::vector<Ratio> ratios = {
      {"oracle fwd / fast fwd", rows[0].ms / rows[1].ms, true, 50},
      {"fast fwd / plain fwd", rows[1].ms / rows[3].ms, false, 3},
      {"fast fwd+bwd / plain fwd+bwd", rows[2].ms / rows[4].ms, false, 4},
      {"plain fwd GFLOP/s / sgemm GFLOP/s", rows[3].gflops() / rows[5].gflops(), true, 0.30},
  };
  const bool all_ran = std::all_of(rows.begin(), rows.end(), [](const Row& r) { return r.error.empty(); });

  if (a.json) {
    nlohmann::json j;
    j["config"] = {{"threads", a.threads}, {"T", a.T}, {"K", a.K}, {"V", a.K}, {"heads", a.heads}, {"B", 1},
                   {"dtype", "float32"}, {"reps", a.reps}, {"oracle_reps", a.oracle_reps}, {"gemm_n", a.gemm_n},
                   {"build", build_info()}, {"cpu", cpu_model()}, {"openblas", cpu::blas_config()}};
    auto num = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
    for (const Row& r : rows) {
      j["rows"].push_back({{"name", r.name}, {"median_ms", num(r.ms)}, {"gflops", num(r.gflops())},
                           {"reps", r.reps}, {"error", r.error.empty() ? nlohmann::json(nullptr) : nlohmann::json(r.error)}});
    }
    for (const Ratio& r : ratios) {
      j["ratios"].push_back({{"name", r.name}, {"value", num(r.value)}, {"op", r.at_least ? ">=" : "<="},
                             {"bar", r.bar}, {"met", r.met()}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return all_ran ? 0 : 1;
  }

  std::printf("pathattn bench: fp32, B = 1, T = %lld, HQ = H = %lld, K = V = %lld, %d threads, median of %d "
              "(oracle: %d)\n", (long long)a.T, (long long)a.heads, (long long)a.K, a.threads, a.reps, a.oracle_reps);
  std::printf("cpu: %s; backends: %s; BLAS: %s (kernel %s)\n", cpu_model().c_str(), build_info().c_str(), cpu::blas_config(),
              cpu::blas_corename());
  std::printf("effective FLOPs: attention forward 4*HQ*T^2*K/2 = %.2f GFLOP, forward+backward 3.5x that\n\n",
              attn_gflop);
  std::printf("%-32s %12s %10s\n", "", "median ms", "GFLOP/s");
  for (const Row& r : rows) {
    if (r.error.empty()) std::printf("%-32s %12.2f %10.2f\n", r.name.c_str(), r.ms, r.gflops());
    else std::printf("%-32s %12s %10s  error: %s\n", r.name.c_str(), "-", "-", r.error.c_str());
  }
  std::printf("\n%-36s %10s %8s  %s\n", "ratio", "value", "bar", "");
  for (const Ratio& r : ratios) {
    std::printf("%-36s %10.3g %s %5.3g  %s\n", r.name.c_str(), r.value, r.at_least ? ">=" : "<=", r.bar,
                std::isfinite(r.value) ? (r.met() ? "met" : "NOT met") : "n/a");
  }
  return all_ran ? 0 : 1;
}

}  // namespace

void register_bench(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* c = app.add_subcommand(
      "bench", "Time the oracle, the fast PaTH path, plain attention and sgemm in one run; print the ratios "
               "(exit code 1 only if a row could not run; the bars never set it)");
  c->add_option("--threads", a->threads, "Threads for every row (default 2)")->check(CLI::Range(1, 1024));
  c->add_option("--T", a->T, "Sequence length (default 4096)")->check(CLI::Range(int64_t(1), int64_t(1) << 24));
  c->add_option("--K", a->K, "Head dim, K = V (default 64)")->check(CLI::Range(int64_t(8), int64_t(256)));
  c->add_option("--heads", a->heads, "HQ = H (default 4)")->check(CLI::Range(int64_t(1), int64_t(1024)));
  c->add_option("--reps", a->reps, "Timed runs per row after one warm-up; the median is reported (default 5)")
      ->check(CLI::Range(1, 100000));
  c->add_option("--oracle-reps", a->oracle_reps, "Timed runs of the oracle, no warm-up (default 1)")
      ->check(CLI::Range(1, 100000));
  c->add_option("--gemm-n", a->gemm_n, "Size of the sgemm (default 2048)")->check(CLI::Range(int64_t(1), int64_t(16384)));
  c->add_flag("--json", a->json, "Print the same as JSON");
  c->callback([a, exit_code] { *exit_code = run_bench(*a); });
}

}  // namespace pathattn::app
