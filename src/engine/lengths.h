// engine/lengths.h: evaluation of a checkpoint at sequence lengths other than the one it was trained at
// (length extrapolation), with the loss of every position bucket: `pathattn eval CKPT --seq-len N,...`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/model.h"
#include "engine/tasks.h"

namespace pathattn::engine {

// Loss of a model over a task's first test set, position by position: the whole windows' mean cross-entropy
// and accuracy, and the mean cross-entropy of each bucket of `bucket` consecutive input positions ([0,
// bucket), [bucket, 2 bucket), ...; the last may be shorter). One ordinary forward per `batch` windows of
// task.model_len() positions: memory is linear in the length (the attention op keeps no T x T matrix).
// Returns {"loss", "accuracy", "count", "sequences", "bucket", "loss_by_bucket": [...], "count_by_bucket"}.
template <typename T>
nlohmann::json evaluate_by_position(Model<T>& model, const Task& task, int64_t batch, int64_t bucket);

struct LengthEvalOptions {
  std::vector<int64_t> seq_lens;  // task.seq_len values to evaluate at (bytes per window, as in training)
  int64_t sequences = 0;          // windows per length; 0: the checkpoint's task.eval_sequences
  int64_t tokens = 0;             // instead: windows per length = ceil(tokens / positions per window), so
                                  // every length scores about the same number of positions
  int64_t bucket = 0;             // positions per bucket; 0: the checkpoint's task.seq_len
  int64_t batch = 0;              // windows per forward; 0: max(1, tokens_per_forward / length)
  int64_t tokens_per_forward = 32768;
  Backend backend = Backend::cpu;
  int threads = 0;
};

// Evaluates a checkpoint (CPU) at each length of opt.seq_lens on its own task with task.seq_len replaced:
// {"checkpoint", "step", "task", "attn", "train_seq_len", "params", "lengths": [{"seq_len", "val": {...}}]}.
// Throws EngineError on a bad checkpoint, a length the task cannot serve, or bad options (naming them).
nlohmann::json evaluate_lengths(const std::string& path, const LengthEvalOptions& opt);

}  // namespace pathattn::engine
