// tests/cpp/engine_fixtures.h: what the engine test programs share: a fresh temporary directory, the tiny
// flip-flop run configuration, single-threaded BLAS for the tiny models, and expect_error.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <initializer_list>
#include <string>

#include <unistd.h>

#include "cpu/blas.h"
#include "engine/config.h"

namespace pathattn::engine::test {

// Expects `fn` to throw EngineError whose message contains every fragment.
template <typename F>
void expect_error(F&& fn, std::initializer_list<const char*> fragments) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected one mentioning \"" << *fragments.begin() << "\"";
  } catch (const EngineError& e) {
    const std::string m = e.what();
    for (const char* f : fragments) EXPECT_NE(m.find(f), std::string::npos) << "message: " << m << "\nlacks: " << f;
  }
}

// A fresh, empty directory under the system temp dir, unique to this process: <tmp>/pathattn_engine_<name>_<pid>.
inline std::string temp_dir(const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path p = fs::temp_directory_path() / ("pathattn_engine_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

// A small flip-flop setup: 64-token sequences, width 32, one layer, 150 steps. Cheap enough for CI on two
// cores; tests change the fields they need.
inline RunConfig tiny_flipflop(AttnKind attn) {
  RunConfig c;
  c.model.attn = attn;
  c.model.d_model = 32;
  c.model.n_head = 2;
  c.model.n_layer = 1;
  c.task.name = "flipflop";
  c.task.seq_len = 64;
  c.task.eval_id = 64;
  c.task.eval_sparse = 64;
  c.task.eval_dense = 16;
  c.train.steps = 150;
  c.train.batch_size = 16;
  c.train.lr = 1e-2;
  c.train.warmup_steps = 10;
  c.train.log_every = 10;
  c.train.threads = 1;
  return c;
}

// The tiny models gain nothing from threads, and idle OpenMP threads spinning between the many short
// parallel regions slow a shared CI machine several-fold: a test program registers this environment to run
// BLAS single-threaded (the attention op gets train.threads = 1 from the configs).
class SingleThreadedBlas : public ::testing::Environment {
 public:
  void SetUp() override { cpu::set_blas_threads(1); }
};

}  // namespace pathattn::engine::test
