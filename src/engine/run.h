// engine/run.h: training runs and evaluation. A run directory holds config.json, metrics.jsonl (JSON lines),
// ckpt.safetensors (latest checkpoint, replaced atomically) and plot.svg (loss and test-metric curves).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/tasks.h"

namespace pathattn::engine {

struct RunOptions {
  std::string out_dir;        // run directory (created); empty: no files at all (tests, benchmarks)
  std::string resume;         // checkpoint to continue from (its config is used; `config` is ignored)
  int64_t stop_after = -1;    // stop once this many steps are done (a checkpoint is written), as if killed
  bool progress = true;       // progress bar on stderr
  std::string label = "train";
  std::string device;         // overrides train.device (of `config` or of the resumed checkpoint); empty: keep
};

struct RunResult {
  RunConfig config;           // resolved (vocab from the task)
  int64_t start_step = 0, steps_done = 0;
  bool finished = false;      // all config.train.steps done
  double last_loss = 0;       // training loss of the last step run (bitwise comparable across resumes)
  double train_seconds = 0, steps_per_s = 0;
  nlohmann::json eval;        // final evaluation {set: {loss, accuracy, error?, count}} (when finished)
  std::vector<float> params_f32;   // final parameters (f32 runs), for determinism checks
  std::vector<double> params_f64;  // final parameters (f64 runs)
};

// Fills defaults that depend on the task (vocab_size, seq_len) and validates the config.
RunConfig resolve_config(RunConfig c, const Task& task);
Backend parse_backend(const std::string& s);
// Throws EngineError unless the config can run on its train.device in this build (CUDA compiled in, a
// device visible, f32, a head dim the CUDA attention supports).
void check_device(const RunConfig& c);

// Trains per `cfg` (or the checkpoint in opt.resume). Throws EngineError.
RunResult train_run(const RunConfig& cfg, const RunOptions& opt);

// Evaluates `model` (Model<float>, Model<double> or CudaModel) on every test set of `task`, `batch` sequences
// at a time: {"<set>": {"loss": mean CE at scored positions, "accuracy": ..., "error": 1 - accuracy (flip-flop),
// "count": n, "exact_match": fraction of sequences with every scored position right (text tasks)}}.
template <typename M>
nlohmann::json evaluate(M& model, const Task& task, int64_t batch);
// Exact match of B rows of T positions: adds to *scored the rows with a scored position (targets >= 0) and
// to *exact those whose every scored position has pred == target.
void count_exact(const int32_t* targets, const int32_t* pred, int64_t B, int64_t T, int64_t* scored, int64_t* exact);

// Evaluates the final parameters of a finished run (r.config, r.params_f32 / params_f64) on the test sets of each
// task of `tasks`, on r.config.train.device, with at most `max_tokens` tokens (sequences x length) per forward
// (at least one sequence): one evaluate() result per task. The forward is the training forward, whose memory
// is linear in the length (the blockwise attention; no T x T buffer). `done(i)` (optional) follows each task.
std::vector<nlohmann::json> evaluate_trained(const RunResult& r, const std::vector<TaskConfig>& tasks,
                                             int64_t max_tokens, const std::function<void(size_t)>& done = {});

// Evaluates a checkpoint on its own task's test sets: {"checkpoint", "step", "task", "attn", "device",
// "eval": {...}}. device: "cpu" or "cuda"; empty: the checkpoint config's train.device. backend and threads
// apply to the cpu device.
nlohmann::json evaluate_checkpoint(const std::string& path, int64_t batch, Backend backend, int threads,
                                   const std::string& device = "");

}  // namespace pathattn::engine
