// tests/cpp/test_engine_evalmem.cpp: the long-context evaluation (evaluate_trained, what `repro long-context`
// runs) needs memory linear in the length. This program replaces operator new / delete to follow the live heap;
// for each attention kind of the CPU preset, at its longest CPU evaluation length T = 8x the training length and
// at T / 4, it checks that the peak heap of the evaluation grows like the length: the peak at T exceeds 4x the
// peak at T / 4 by less than T * T bytes (a quarter of one T x T float buffer, which would add 12/16 of its
// size to that excess). A control with such a buffer shows that the measurement catches one.
#include <gtest/gtest.h>

#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/embedded.h"
#include "engine/model.h"
#include "engine/run.h"
#include "engine/tasks.h"
#include "engine_fixtures.h"

#if defined(__SANITIZE_ADDRESS__)
#define PATHATTN_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PATHATTN_TEST_SANITIZED 1
#endif
#endif

namespace {
std::atomic<int64_t> g_live{0}, g_peak{0};

void* counted_alloc(std::size_t n) {
  void* p = std::malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  const int64_t live = g_live.fetch_add(int64_t(malloc_usable_size(p))) + int64_t(malloc_usable_size(p));
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return p;
}
void counted_free(void* p) {
  if (!p) return;
  g_live.fetch_sub(int64_t(malloc_usable_size(p)));
  std::free(p);
}
}  // namespace

// The sanitizers bring their own allocator; there the test skips and the replacement stays out.
#ifndef PATHATTN_TEST_SANITIZED
void* operator new(std::size_t n) { return counted_alloc(n); }
void* operator new[](std::size_t n) { return counted_alloc(n); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
#endif

namespace pathattn::engine {
namespace {

const auto* const kSingleThreaded = ::testing::AddGlobalTestEnvironment(new test::SingleThreadedBlas);

// Peak heap growth (bytes) while `fn` runs.
int64_t peak_growth(const std::function<void()>& fn) {
  const int64_t base = g_live.load();
  g_peak.store(base);
  fn();
  return g_peak.load() - base;
}

TEST(EngineEvalMemory, LinearInTheLengthAtTheLongestCpuEvaluation) {
#ifdef PATHATTN_TEST_SANITIZED
  GTEST_SKIP() << "heap accounting needs the plain allocator";
#endif
  const RunConfig preset = parse_config_text(embedded_config("repro_long_context_cpu"), "repro_long_context_cpu");
  const int L = preset.task.seq_len;
  TaskConfig niah = mixture_component(preset.task, 0);  // niah single, the needle in the middle
  niah.depths = {0.5};
  niah.eval_sequences = 2;
  TaskConfig t2 = niah, t8 = niah;
  t2.seq_len = 2 * L;
  t8.seq_len = 8 * L;
  for (const char* kind : {"rope", "path", "fox", "path-fox"}) {
    RunResult r;
    r.config = preset;
    r.config.model.attn = parse_attn_kind(kind);
    r.config.model.vocab_size = 256;
    r.config.train.threads = 1;
    Model<float> m(r.config.model);
    m.init(1);
    r.params_f32 = m.params;
    // One sequence per forward (max_tokens = the length): the peak follows the length alone.
    const int64_t p2 = peak_growth([&] { evaluate_trained(r, {t2}, t2.seq_len); });
    const int64_t p8 = peak_growth([&] { evaluate_trained(r, {t8}, t8.seq_len); });
    const int64_t T = t8.seq_len, square = T * T;  // bytes: a quarter of a T x T float buffer
    EXPECT_GT(p2, 0) << kind << ": the heap accounting saw nothing";
    EXPECT_LT(p8 - 4 * p2, square) << kind << ": peak " << p2 << " bytes at " << t2.seq_len << ", " << p8 << " at " << T;
    // The repro's batching (8192 tokens per forward on the cpu): at equal tokens per forward only the attention's
    // working set grows with the length (the O(T) chunk factors of 2 x threads (sequence, head) units at a time,
    // about 6 MB at T = 2048 for PaTH here); a T x T float buffer per sequence would add 3x one such buffer.
    TaskConfig b2 = t2, b8 = t8;  // enough sequences to fill every forward
    b2.eval_sequences = b8.eval_sequences = int(8192 / t2.seq_len);
    const int64_t q2 = peak_growth([&] { evaluate_trained(r, {b2}, 8192); });
    const int64_t q8 = peak_growth([&] { evaluate_trained(r, {b8}, 8192); });
    std::printf("%-8s peak heap of the evaluation: %.1f MB at %d, %.1f MB at %lld (one sequence per forward); "
                "%.1f / %.1f MB with 8192 tokens per forward\n", kind, double(p2) / 1e6, t2.seq_len, double(p8) / 1e6,
                (long long)T, double(q2) / 1e6, double(q8) / 1e6);
    EXPECT_LT(q8 - q2, 4 * square) << kind << ": peak " << q2 << " bytes at " << t2.seq_len << ", " << q8 << " at " << T
                               << " with 8192 tokens per forward";
    if (std::string(kind) == "rope") {  // control: the same measurement with a T x T float buffer alongside
      auto with_square = [&](const TaskConfig& t) {
        return peak_growth([&] {
          std::vector<float> scores(size_t(t.seq_len) * size_t(t.seq_len), 1.0f);
          evaluate_trained(r, {t}, t.seq_len);
        });
      };
      const int64_t c2 = with_square(t2), c8 = with_square(t8);
      EXPECT_GT(c8 - 4 * c2, square) << "the control's T x T buffer went unseen: " << c2 << " vs " << c8;
    }
  }
}

}  // namespace
}  // namespace pathattn::engine
