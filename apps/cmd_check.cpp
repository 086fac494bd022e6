// apps/cmd_check.cpp: `pathattn check`: the oracle chain on fresh random cases. For each drawn case the fast
// cpu path runs in fp64 and fp32 against the fp64 oracle (tests/cpp/oracle_chain.h does the drawing and the
// comparing); one line per case and tensor, a final "N passed, M failed" line, exit code 1 on any failure.
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>

#include "commands.h"
#include "check/oracle_chain.h"

namespace pathattn::app {
namespace {

struct CheckArgs {
  uint64_t seed = 0;
  bool seed_given = false;
  int cases = 20;
  int threads = 0;
};

// Runs `a.cases` cases; returns the process exit code (0: every case passed).
int run_check(const CheckArgs& a) {
  using namespace pathattn::test;
  const uint64_t seed = a.seed_given ? a.seed : std::random_device{}();
  std::printf("pathattn check: %d cases, seed %llu, threads %d (%s); bounds: fp64 max_rel <= %.0e, "
              "fp32 rel_l2 <= %.0e (o, lse) / %.0e (gradients)\n",
              a.cases, (unsigned long long)seed, a.threads, build_info().c_str(), kFp64MaxRel, kFp32RelL2Fwd,
              kFp32RelL2Grad);
  std::mt19937_64 rng(seed);
  int passed = 0, failed = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int n = 1; n <= a.cases; ++n) {
    const CaseSpec spec = draw_check_spec(rng);
    const CaseCheck cc = check_case(spec, Backend::cpu, a.threads);
    std::printf("case %d/%d %s\n", n, a.cases, cc.spec.name().c_str());
    for (const TensorCheck& t : cc.tensors) {
      std::printf("  case %-3d %s %-5s %-7s %9.2e <= %.0e  %s%s%s\n", n, t.precision.c_str(), t.tensor.c_str(),
                  t.metric.c_str(), t.error, t.bound, t.pass ? "ok" : "FAIL", t.note.empty() ? "" : ": ",
                  t.note.c_str());
    }
    if (!cc.status.ok()) std::printf("  case %-3d FAIL: %s\n", n, cc.status.message().c_str());
    (cc.pass() ? passed : failed)++;
    std::fflush(stdout);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%d passed, %d failed (%.1f s; rerun with --seed %llu)\n", passed, failed, secs,
              (unsigned long long)seed);
  return failed == 0 ? 0 : 1;
}

}  // namespace

void register_check(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<CheckArgs>();
  CLI::App* c = app.add_subcommand(
      "check", "Compare the fast cpu path with the fp64 oracle (fp64 and fp32, forward and every gradient) on "
               "fresh random cases; exit code 1 on any failure");
  c->add_option("--seed", a->seed, "Seed of the case draw (default: random, printed)")
      ->check(non_negative_int())  // else "-1" would wrap to 2^64 - 1
      ->each([a](const std::string&) { a->seed_given = true; });
  c->add_option("--cases", a->cases, "Number of cases (default 20)")->check(CLI::Range(1, 1000000));
  c->add_option("--threads", a->threads, "Threads per call (default 0: OpenMP default)")->check(CLI::Range(0, 1024));
  c->callback([a, exit_code] { *exit_code = run_check(*a); });
}

}  // namespace pathattn::app
