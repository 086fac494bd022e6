// tests/cpp/test_engine_train.cpp: end-to-end engine tests: a tiny training run must reach a loss threshold,
// the optimizer / schedule behave as documented, checkpoints round-trip, a run stopped mid-way and resumed
// ends bitwise equal to an uninterrupted one, and the task generators produce the documented formats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <memory>

#include <unistd.h>
#include <utility>

#include "engine/checkpoint.h"
#include "engine/optim.h"
#include "engine/report.h"
#include "engine/run.h"
#include "engine/tasks.h"
#include "engine_fixtures.h"

namespace pathattn::engine {
namespace {

namespace fs = std::filesystem;

const auto* const kSingleThreaded = ::testing::AddGlobalTestEnvironment(new test::SingleThreadedBlas);
using test::temp_dir;
using test::tiny_flipflop;

TEST(EngineTrain, TinyFlipFlopLearns) {
  // Guessing a bit gives loss ln 2 = 0.693 and 50% error; the trained model must be far below both
  // (measured: loss 5e-4, error 0 after 150 steps).
  RunOptions ro;
  ro.progress = false;
  const RunResult r = train_run(tiny_flipflop(AttnKind::path), ro);
  ASSERT_TRUE(r.finished);
  std::printf("tiny flip-flop after %lld steps: %s\n", (long long)r.steps_done, r.eval.dump().c_str());
  EXPECT_LT(r.eval["id"]["loss"].get<double>(), 0.05) << r.eval.dump();
  EXPECT_LT(r.eval["id"]["error"].get<double>(), 0.02) << r.eval.dump();
}

TEST(EngineTrain, ScheduleWarmupAndCosine) {
  TrainConfig c;
  c.steps = 100;
  c.warmup_steps = 10;
  c.lr = 1.0;
  c.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(lr_at(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(c, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_at(c, 10), 1.0);
  EXPECT_NEAR(lr_at(c, 99), 0.1, 1e-12);
  for (int s = 11; s < 100; ++s) EXPECT_LE(lr_at(c, s), lr_at(c, s - 1));
}

TEST(EngineTrain, AdamWStepAndClip) {
  // One parameter tensor: after one step with bias correction the update is lr * sign(g) (+ decay).
  ModelConfig mc;
  mc.attn = AttnKind::nope;
  mc.vocab_size = 5;
  mc.d_model = 16;
  mc.head_dim = 8;
  Model<double> m(mc);
  m.init(3);
  const std::vector<double> p0 = m.params;
  for (size_t i = 0; i < m.grads.size(); ++i) m.grads[i] = (i % 2 ? 3.0 : -2.0);
  TrainConfig tc;
  tc.weight_decay = 0.5;
  tc.grad_clip = 1.0;
  AdamW<double> opt;
  opt.init(int64_t(m.params.size()));
  const double norm = opt.step(m, tc, 0.01);
  EXPECT_GT(norm, 1.0);
  for (const ParamInfo& p : m.layout())
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      const double sign = (i % 2 ? 1.0 : -1.0);
      const double expect = p0[i] - 0.01 * (sign + (p.decay ? 0.5 * p0[i] : 0.0));
      ASSERT_NEAR(m.params[i], expect, 1e-7) << p.name;
    }
}

// A quiet tiny flip-flop run of `steps` steps into `dir`, its final checkpoint restored into m and opt.
RunResult tiny_run_restored(const std::string& dir, AttnKind attn, int steps, CheckpointInfo* ck,
                            std::unique_ptr<Model<float>>* m, AdamW<float>* opt) {
  RunConfig c = tiny_flipflop(attn);
  c.train.steps = steps;
  RunOptions ro;
  ro.out_dir = dir;
  ro.progress = false;
  RunResult r = train_run(c, ro);
  *ck = read_checkpoint(dir + "/ckpt.safetensors");
  *m = std::make_unique<Model<float>>(r.config.model);
  restore_checkpoint(*ck, **m, opt);
  return r;
}

TEST(EngineTrain, CheckpointRoundTrip) {
  const std::string dir = temp_dir("roundtrip");
  CheckpointInfo ck;
  std::unique_ptr<Model<float>> mp;
  AdamW<float> opt;
  const RunResult r = tiny_run_restored(dir, AttnKind::path_fox, 3, &ck, &mp, &opt);
  const Model<float>& m = *mp;
  EXPECT_EQ(ck.step, 3);
  EXPECT_EQ(ck.dtype, "f32");
  EXPECT_EQ(ck.config.model.attn, AttnKind::path_fox);
  EXPECT_EQ(m.params, r.params_f32);
  EXPECT_EQ(opt.t, 3);
  // The run directory has its files.
  EXPECT_TRUE(fs::exists(dir + "/metrics.jsonl"));
  EXPECT_TRUE(fs::exists(dir + "/plot.svg"));
  EXPECT_TRUE(fs::exists(dir + "/config.json"));
  EXPECT_FALSE(fs::exists(dir + "/ckpt.safetensors.tmp"));
  fs::remove_all(dir);
}

// A checkpoint that records train.device = "cuda" evaluates on the CPU when no device is asked for and this
// build or machine has no usable GPU; asking for cuda explicitly there is an error naming the setting.
TEST(EngineTrain, EvalOfAGpuCheckpointWithoutAGpu) {
  const std::string dir = temp_dir("gpuckpt");
  CheckpointInfo ck;
  std::unique_ptr<Model<float>> m;
  AdamW<float> opt;
  tiny_run_restored(dir, AttnKind::path, 2, &ck, &m, &opt);
  RunConfig gpu = ck.config;
  gpu.train.device = "cuda";
  save_checkpoint(dir + "/gpu.safetensors", gpu, *m, opt, ck.step);
  RunConfig probe = gpu;
  bool has_gpu = true;
  try {
    check_device(probe);
  } catch (const EngineError&) {
    has_gpu = false;
  }
  if (has_gpu) GTEST_SKIP() << "a GPU is usable here: the checkpoint evaluates on it";
  const nlohmann::json cpu = evaluate_checkpoint(dir + "/ckpt.safetensors", 16, Backend::cpu, 1, "");
  const nlohmann::json fallback = evaluate_checkpoint(dir + "/gpu.safetensors", 16, Backend::cpu, 1, "");
  EXPECT_EQ(fallback["device"], "cpu");
  EXPECT_EQ(fallback["eval"], cpu["eval"]);  // same parameters, same evaluation
  try {
    evaluate_checkpoint(dir + "/gpu.safetensors", 16, Backend::cpu, 1, "cuda");
    ADD_FAILURE() << "an explicit --device cuda without a GPU must fail";
  } catch (const EngineError& e) {
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// The metrics of a run stopped between two log lines and resumed are those of the uninterrupted run (the
// first line after the resume averages the same steps); resuming the finished run again reports its last
// loss and adds no second final evaluation.
TEST(EngineTrain, ResumedMetricsMatchTheUninterruptedRun) {
  const std::string a = temp_dir("log_full"), b = temp_dir("log_split");
  RunConfig c = tiny_flipflop(AttnKind::path);
  c.train.steps = 30;
  c.train.log_every = 10;
  RunOptions ro;
  ro.progress = false;
  ro.out_dir = a;
  const RunResult full = train_run(c, ro);
  ro.out_dir = b;
  ro.stop_after = 15;
  train_run(c, ro);
  RunOptions rr;
  rr.progress = false;
  rr.out_dir = b;
  rr.resume = b + "/ckpt.safetensors";
  train_run(RunConfig(), rr);
  auto losses = [](const std::string& dir) {
    std::vector<std::pair<int64_t, double>> out;
    for (const auto& j : MetricsLog(dir + "/metrics.jsonl").read())
      if (j.contains("loss")) out.push_back({j["step"].get<int64_t>(), j["loss"].get<double>()});
    return out;
  };
  EXPECT_EQ(losses(b), losses(a));
  const RunResult again = train_run(RunConfig(), rr);
  EXPECT_TRUE(again.finished);
  EXPECT_EQ(again.last_loss, full.last_loss);
  EXPECT_EQ(again.eval.dump(), full.eval.dump());
  int evals = 0;
  for (const auto& j : MetricsLog(b + "/metrics.jsonl").read()) evals += j.contains("eval");
  EXPECT_EQ(evals, 1);
  fs::remove_all(a);
  fs::remove_all(b);
}

// Every metrics line carries its window's throughput: tokens (every position of the batch) and sequences a
// second; MFU only where the device's peak is known, so never on the CPU.
TEST(EngineTrain, MetricsCarryThroughput) {
  const std::string dir = temp_dir("log_rate");
  RunConfig c = tiny_flipflop(AttnKind::path);
  c.train.steps = 20;
  c.train.log_every = 5;
  RunOptions ro;
  ro.progress = false;
  ro.out_dir = dir;
  train_run(c, ro);
  const double T = double(make_task(c.task)->model_len());
  int lines = 0;
  for (const auto& j : MetricsLog(dir + "/metrics.jsonl").read()) {
    if (!j.contains("loss")) continue;
    ++lines;
    ASSERT_TRUE(j.contains("tokens_per_s") && j.contains("sequences_per_s")) << j.dump();
    const double tok = j["tokens_per_s"].get<double>(), seq = j["sequences_per_s"].get<double>();
    EXPECT_GT(tok, 0.0);
    EXPECT_NEAR(tok / seq, T, 1e-9 * T);  // B T tokens and B sequences a step
    EXPECT_FALSE(j.contains("mfu")) << j.dump();
  }
  EXPECT_EQ(lines, 4);
  fs::remove_all(dir);
}

// MFU's numerator, counted here from the shapes (not from the parameter table the engine sums): 6 per weight of
// every matrix product, a tied embedding once as the head, the w convolution not at all, and 6 K T per query head
// and layer for attention.
TEST(EngineTrain, TrainFlopsPerToken) {
  for (const AttnKind attn : {AttnKind::rope, AttnKind::path, AttnKind::path_fox}) {
    for (const bool tied : {true, false}) {
      ModelConfig m;
      m.attn = attn;
      m.vocab_size = 11;
      m.d_model = 48;
      m.n_layer = 3;
      m.n_head = 4;
      m.n_kv_head = 2;
      m.w_rank = 8;
      m.tie_embeddings = tied;
      const double C = 48, HQ = 4, H = 2, K = 12, F = m.F(), V = 11, R = 8, L = 3, T = 37;
      double per_layer = C * HQ * K + 2 * C * H * K + HQ * K * C + C * 2 * F + F * C;
      if (attn != AttnKind::rope) per_layer += C * R + R * H * K + C * H;  // w (low rank) and beta
      if (attn == AttnKind::path_fox) per_layer += C * HQ;                 // the gate
      const double weights = V * C + L * per_layer;  // the head (tied: the embedding; else lm_head)
      EXPECT_DOUBLE_EQ(train_flops_per_token(m, 37), 6 * weights + 6 * L * HQ * K * T)
          << attn_kind_name(attn) << " tied " << tied;
    }
  }
}

TEST(EngineTrain, PeakFlopsByDeviceName) {
  EXPECT_EQ(bf16_peak_flops("NVIDIA H100 80GB HBM3"), 989.4e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA H100 PCIe"), 756.0e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA H100 NVL"), 835.0e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA H200"), 989.4e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA GH200 480GB"), 989.4e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA A100-SXM4-80GB"), 312.0e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA GeForce RTX 4090"), 0.0);
}

// Stop after 40 of 80 steps (a checkpoint every 20, as a killed run leaves), resume, compare with one run.
TEST(EngineTrain, ResumeIsBitwiseIdentical) {
  for (AttnKind attn : {AttnKind::path, AttnKind::rope}) {
    const std::string a = temp_dir("full"), b = temp_dir("split");
    RunConfig c = tiny_flipflop(attn);
    c.train.steps = 80;
    c.train.checkpoint_every = 20;
    c.train.eval_every = 40;
    RunOptions ro;
    ro.progress = false;
    ro.out_dir = a;
    const RunResult full = train_run(c, ro);
    ro.out_dir = b;
    ro.stop_after = 40;
    const RunResult first = train_run(c, ro);
    ASSERT_FALSE(first.finished);
    ASSERT_EQ(first.steps_done, 40);
    ASSERT_NE(first.params_f32, full.params_f32);
    RunOptions rr;
    rr.progress = false;
    rr.out_dir = b;
    rr.resume = b + "/ckpt.safetensors";
    const RunResult second = train_run(RunConfig(), rr);
    ASSERT_TRUE(second.finished);
    EXPECT_EQ(second.start_step, 40);
    // Bitwise: the final loss and every parameter.
    EXPECT_EQ(std::memcmp(&second.last_loss, &full.last_loss, sizeof(double)), 0)
        << second.last_loss << " vs " << full.last_loss;
    EXPECT_EQ(second.params_f32, full.params_f32);
    EXPECT_EQ(second.eval.dump(), full.eval.dump());
    fs::remove_all(a);
    fs::remove_all(b);
  }
}

TEST(EngineTasks, FlipFlopFormat) {
  TaskConfig tc;
  tc.seq_len = 512;
  auto t = make_task(tc);
  ASSERT_EQ(t->model_len(), 511);
  Batch b;
  t->train_batch(1, 0, 8, &b);
  for (int64_t s = 0; s < 8; ++s) {
    const int32_t* x = &b.tokens[s * 511];
    const int32_t* y = &b.targets[s * 511];
    EXPECT_EQ(x[0], 0);    // starts with w
    EXPECT_EQ(x[510], 1);  // last instruction is r
    int32_t mem = -1;
    for (int64_t i = 0; i < 511; ++i) {
      if (i % 2 == 0) {
        ASSERT_TRUE(x[i] >= 0 && x[i] <= 2);
        if (x[i] == 1) {
          ASSERT_EQ(y[i], mem);  // scored: the last written bit
        } else {
          ASSERT_EQ(y[i], -1);  // read-only loss by default
        }
      } else {
        ASSERT_TRUE(x[i] == 3 || x[i] == 4);
        ASSERT_EQ(y[i], -1);
        if (x[i - 1] == 0) mem = x[i];
        if (x[i - 1] == 1) ASSERT_EQ(x[i], mem);
      }
    }
  }
  // Instruction frequencies of the test sets follow p(i) = 0.8, 0.98, 0.1.
  const double p[] = {0.8, 0.98, 0.1};
  for (int set = 0; set < 3; ++set) {
    int64_t n_i = 0, n = 0;
    t->eval_batch(set, 0, 40, &b);
    for (int64_t s = 0; s < 40; ++s)
      for (int64_t i = 2; i < 509; i += 2) {
        n_i += b.tokens[s * 511 + i] == 2;
        n += 1;
      }
    EXPECT_NEAR(double(n_i) / double(n), p[set], 0.03) << set;
  }
}

// An a5 task config of words of `len` elements.
TaskConfig a5_config(int len) {
  TaskConfig tc;
  tc.name = "a5";
  tc.seq_len = len;
  return tc;
}

TEST(EngineTasks, A5GroupAndLabels) {
  A5Group g;
  ASSERT_EQ(g.perms.size(), 60u);
  // Identity at index 0, closure, and associativity.
  for (int a = 0; a < 60; ++a) {
    EXPECT_EQ(g.mul[a * 60 + 0], a);
    EXPECT_EQ(g.mul[0 * 60 + a], a);
    for (int b = 0; b < 60; ++b) ASSERT_GE(g.mul[a * 60 + b], 0);
  }
  for (int a = 0; a < 60; a += 7)
    for (int b = 0; b < 60; b += 5)
      for (int c = 0; c < 60; c += 3)
        ASSERT_EQ(g.mul[g.mul[a * 60 + b] * 60 + c], g.mul[a * 60 + g.mul[b * 60 + c]]);
  auto t = make_task(a5_config(12));
  Batch b;
  t->train_batch(3, 5, 4, &b);
  for (int64_t s = 0; s < 4; ++s) {
    int p = 0;
    for (int64_t i = 0; i < 12; ++i) {
      p = g.mul[p * 60 + b.tokens[s * 12 + i]];
      ASSERT_EQ(b.targets[s * 12 + i], p);
    }
  }
}

TEST(EngineTasks, A5TestSetsScoreEveryPositionAndTheFinalProduct) {
  A5Group g;
  TaskConfig tc = a5_config(7);
  tc.eval_sequences = 5;
  auto t = make_task(tc);
  const auto sets = t->eval_sets();
  ASSERT_EQ(sets.size(), 2u);
  EXPECT_EQ(sets[0].name, "test");
  EXPECT_EQ(sets[1].name, "last");
  Batch all, last;
  t->eval_batch(0, 0, 5, &all);
  t->eval_batch(1, 0, 5, &last);
  EXPECT_EQ(all.tokens, last.tokens);  // the same words
  for (int64_t s = 0; s < 5; ++s) {
    int p = 0;
    for (int64_t i = 0; i < 7; ++i) {
      p = g.mul[p * 60 + all.tokens[s * 7 + i]];
      ASSERT_EQ(all.targets[s * 7 + i], p);
      ASSERT_EQ(last.targets[s * 7 + i], i == 6 ? p : -1);
    }
  }
}

// Mixed lengths and the length curriculum: each training word's scored prefix is a full running product
// whose length lies in [min_len, longest(step)], and every length in that range occurs.
TEST(EngineTasks, A5MixedLengthsAndCurriculum) {
  A5Group g;
  TaskConfig tc = a5_config(10);
  tc.min_len = 2;
  tc.curriculum_steps = 100;
  auto t = make_task(tc);
  auto scored_lengths = [&](int64_t step) {
    Batch b;
    t->train_batch(9, step, 400, &b);
    std::vector<int> seen(11, 0);
    for (int64_t s = 0; s < 400; ++s) {
      int p = 0, len = 0;
      for (int64_t i = 0; i < 10; ++i) {
        p = g.mul[p * 60 + b.tokens[s * 10 + i]];
        const int32_t y = b.targets[s * 10 + i];
        if (y >= 0) {
          EXPECT_EQ(y, p);
          EXPECT_EQ(len, i) << "scored positions must be a prefix";
          len = int(i) + 1;
        }
      }
      ++seen[len];
    }
    return seen;
  };
  auto range_of = [](const std::vector<int>& seen) {
    int lo = 99, hi = -1;
    for (int l = 0; l <= 10; ++l) {
      if (seen[l] > 0) lo = std::min(lo, l), hi = std::max(hi, l);
    }
    return std::pair<int, int>(lo, hi);
  };
  EXPECT_EQ(range_of(scored_lengths(0)), std::make_pair(2, 2));
  EXPECT_EQ(range_of(scored_lengths(50)), std::make_pair(2, 6));
  EXPECT_EQ(range_of(scored_lengths(100)), std::make_pair(2, 10));
  EXPECT_EQ(range_of(scored_lengths(5000)), std::make_pair(2, 10));

  tc.min_len = 11;
  EXPECT_THROW(make_task(tc), EngineError);
  tc.min_len = 0;
  EXPECT_THROW(make_task(tc), EngineError);  // a curriculum needs its starting length
  tc.curriculum_steps = 0;
  EXPECT_NO_THROW(make_task(tc));
}

// The a5 evaluation reports accuracy per position on "test" (every position scored) and not on "last";
// the per-position accuracies weighted by their counts give the overall accuracy.
TEST(EngineTasks, A5EvaluationByPosition) {
  TaskConfig tc = a5_config(6);
  tc.eval_sequences = 37;  // not a multiple of the evaluation batch
  auto task = make_task(tc);
  ModelConfig mc;
  mc.attn = AttnKind::path;
  mc.vocab_size = task->vocab_size();
  mc.d_model = 16;
  mc.n_head = 2;
  Model<double> m(mc);
  m.init(5);
  const nlohmann::json ev = evaluate(m, *task, 8);
  ASSERT_TRUE(ev["test"].contains("by_position"));
  EXPECT_FALSE(ev["last"].contains("by_position"));
  const auto& bp = ev["test"]["by_position"];
  ASSERT_EQ(bp.size(), 6u);
  double sum = 0;
  for (const auto& a : bp) {
    EXPECT_GE(a.get<double>(), 0.0);
    EXPECT_LE(a.get<double>(), 1.0);
    sum += a.get<double>() * 37;  // every position is scored once per word
  }
  EXPECT_NEAR(sum / (6 * 37), ev["test"]["accuracy"].get<double>(), 1e-12);
}

TEST(EngineTasks, MqrarAnswersAreNthMostRecent) {
  TaskConfig tc;
  tc.name = "mqrar";
  tc.seq_len = 300;
  tc.n_keys = 6;
  tc.n_values = 10;
  for (int N : {1, 3}) {
    tc.n_back = N;
    auto t = make_task(tc);
    ASSERT_EQ(t->vocab_size(), 17);
    Batch b;
    t->train_batch(9, 0, 4, &b);
    int64_t answers = 0;
    for (int64_t s = 0; s < 4; ++s) {
      const int32_t* x = &b.tokens[s * 299];
      const int32_t* y = &b.targets[s * 299];
      std::vector<std::vector<int32_t>> hist(6);
      for (int64_t i = 0; i < 299; ++i) {
        if (x[i] == 16) {  // "? k a"
          ASSERT_LT(i + 1, 299);
          const int32_t k = x[i + 1];
          ASSERT_LT(k, 6);
          ASSERT_GE(int(hist[k].size()), N);
          ASSERT_EQ(y[i + 1], hist[k][hist[k].size() - N]);
          if (i + 2 < 299) ASSERT_EQ(x[i + 2], y[i + 1]);
          ++answers;
          i += 2;
        } else {
          ASSERT_LT(x[i], 6);  // assignment "k v"
          ASSERT_EQ(y[i], -1);
          if (i + 1 < 299) {
            ASSERT_GE(x[i + 1], 6);
            hist[x[i]].push_back(x[i + 1]);
          }
          i += 1;
        }
      }
    }
    EXPECT_GT(answers, 20);
  }
}

TEST(EngineTasks, DeterministicBySeedAndStep) {
  TaskConfig tc;
  auto t = make_task(tc);
  Batch a, b, c;
  t->train_batch(1, 7, 4, &a);
  t->train_batch(1, 7, 4, &b);
  t->train_batch(1, 8, 4, &c);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_NE(a.tokens, c.tokens);
}

}  // namespace
}  // namespace pathattn::engine
