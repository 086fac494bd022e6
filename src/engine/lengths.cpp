// engine/lengths.cpp: a checkpoint's loss at other sequence lengths, by position bucket (engine/lengths.h).
#include "engine/lengths.h"

#include <algorithm>
#include <cmath>

#include "engine/checkpoint.h"
#include "engine/run.h"

namespace pathattn::engine {

using nlohmann::json;

template <typename T>
json evaluate_by_position(Model<T>& model, const Task& task, int64_t batch, int64_t bucket) {
  if (batch < 1) throw EngineError("batch: expected at least 1 sequence per forward, got " + std::to_string(batch));
  if (bucket < 1) throw EngineError("bucket: expected at least 1 position, got " + std::to_string(bucket));
  const auto sets = task.eval_sets();
  if (sets.empty() || sets[0].size <= 0) throw EngineError("task " + task.name() + " has no test sequences");
  const int64_t Tm = task.model_len(), Vc = model.config().vocab_size;
  const int64_t nb = (Tm + bucket - 1) / bucket;
  std::vector<double> bsum(size_t(nb), 0.0);
  std::vector<int64_t> bcount(size_t(nb), 0);
  double loss_sum = 0;
  int64_t count = 0, correct = 0;
  Batch b;
  for (int64_t first = 0; first < sets[0].size; first += batch) {
    const int64_t n = std::min(batch, sets[0].size - first);
    task.eval_batch(0, first, n, &b);
    const StepStats st = model.forward(b.tokens.data(), b.targets.data(), b.B, b.T);
    correct += st.correct;
    // Cross-entropy of each scored row from the kept logits [B*T, V], in fp64.
    const std::vector<T>& lg = model.logits();
    for (int64_t r = 0; r < b.B * b.T; ++r) {
      const int32_t y = b.targets[size_t(r)];
      if (y < 0) continue;
      const T* row = lg.data() + r * Vc;
      double mx = double(row[0]);
      for (int64_t v = 1; v < Vc; ++v) mx = std::max(mx, double(row[v]));
      double se = 0;
      for (int64_t v = 0; v < Vc; ++v) se += std::exp(double(row[v]) - mx);
      const double ce = mx + std::log(se) - double(row[y]);
      const int64_t k = (r % b.T) / bucket;
      bsum[size_t(k)] += ce;
      ++bcount[size_t(k)];
      loss_sum += ce;
      ++count;
    }
  }
  json by = json::array(), cnt = json::array();
  for (int64_t k = 0; k < nb; ++k) {
    by.push_back(bcount[size_t(k)] > 0 ? bsum[size_t(k)] / double(bcount[size_t(k)]) : 0.0);
    cnt.push_back(bcount[size_t(k)]);
  }
  return {{"loss", count > 0 ? loss_sum / double(count) : 0.0},
          {"accuracy", count > 0 ? double(correct) / double(count) : 0.0},
          {"count", count},
          {"sequences", sets[0].size},
          {"bucket", bucket},
          {"loss_by_bucket", by},
          {"count_by_bucket", cnt}};
}

template json evaluate_by_position<float>(Model<float>&, const Task&, int64_t, int64_t);
template json evaluate_by_position<double>(Model<double>&, const Task&, int64_t, int64_t);

namespace {
template <typename T>
json eval_lengths_typed(const CheckpointInfo& ck, const LengthEvalOptions& opt, json out) {
  RunConfig base = ck.config;
  Model<T> model(base.model);
  model.backend = opt.backend;
  model.threads = opt.threads;
  restore_checkpoint<T>(ck, model, nullptr);
  const int64_t bucket = opt.bucket > 0 ? opt.bucket : base.task.seq_len;
  json rows = json::array();
  for (const int64_t L : opt.seq_lens) {
    TaskConfig tc = base.task;
    tc.seq_len = int(L);
    if (opt.sequences > 0) tc.eval_sequences = int(opt.sequences);
    if (opt.tokens > 0) tc.eval_sequences = int((opt.tokens + (L - 1) - 1) / (L - 1));
    // Test windows are drawn from the validation split alone (at offsets past the training split): with
    // separate val_files the training split can be any text at least a window long, so the validation
    // files stand in for it and a gigabyte of training text is not read for nothing. Same windows.
    if (tc.name == "bytes" && !tc.val_files.empty()) tc.files = tc.val_files;
    const auto task = make_task(tc);
    const int64_t batch =
        opt.batch > 0 ? opt.batch : std::max<int64_t>(1, opt.tokens_per_forward / std::max<int64_t>(1, task->model_len()));
    rows.push_back({{"seq_len", L}, {"val", evaluate_by_position(model, *task, batch, bucket)}});
  }
  out["lengths"] = rows;
  return out;
}
}  // namespace

json evaluate_lengths(const std::string& path, const LengthEvalOptions& opt) {
  if (opt.seq_lens.empty()) throw EngineError("--seq-len: give at least one length");
  for (const int64_t L : opt.seq_lens)
    if (L < 2 || L > (int64_t(1) << 24))
      throw EngineError("--seq-len: expected lengths in [2, 16777216], got " + std::to_string(L));
  if (opt.sequences < 0 || opt.sequences > (1 << 24))
    throw EngineError("--sequences: expected a count in [0, 16777216], got " + std::to_string(opt.sequences));
  if (opt.tokens < 0 || opt.tokens > (int64_t(1) << 36))
    throw EngineError("--tokens: expected a count in [0, 2^36], got " + std::to_string(opt.tokens));
  if (opt.tokens > 0 && opt.sequences > 0) throw EngineError("--tokens: give --tokens or --sequences, not both");
  if (opt.bucket < 0) throw EngineError("--bucket: expected a count >= 0, got " + std::to_string(opt.bucket));
  if (opt.batch < 0) throw EngineError("--batch: expected a count >= 0, got " + std::to_string(opt.batch));
  if (opt.tokens_per_forward < 1)
    throw EngineError("tokens per forward: expected at least 1, got " + std::to_string(opt.tokens_per_forward));
  const CheckpointInfo ck = read_checkpoint(path);
  int64_t params = 0;
  for (const ParamInfo& p : param_layout(ck.config.model)) params += p.numel;
  json out = {{"checkpoint", path}, {"step", ck.step}, {"task", ck.config.task.name},
              {"attn", attn_kind_name(ck.config.model.attn)}, {"train_seq_len", ck.config.task.seq_len},
              {"params", params}, {"device", "cpu"}};
  return ck.dtype == "f64" ? eval_lengths_typed<double>(ck, opt, out) : eval_lengths_typed<float>(ck, opt, out);
}

}  // namespace pathattn::engine
