// engine/run.cpp: the training loop (seeded, deterministic, resumable bit for bit), evaluation, and the run
// directory's files (engine/run.h).
#include "engine/run.h"

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "engine/checkpoint.h"
#include "engine/optim.h"
#include "engine/report.h"

namespace pathattn::engine {

using nlohmann::json;

Backend parse_backend(const std::string& s) {
  if (s == "cpu") return Backend::cpu;
  if (s == "oracle") return Backend::oracle;
  throw EngineError("train.backend: expected cpu or oracle, got \"" + s + "\"");
}

RunConfig resolve_config(RunConfig c, const Task& task) {
  if (c.model.vocab_size == 0) c.model.vocab_size = task.vocab_size();
  if (c.model.vocab_size < task.vocab_size())
    throw EngineError("model.vocab_size: " + std::to_string(c.model.vocab_size) + " is smaller than the " +
                      task.name() + " task's vocab of " + std::to_string(task.vocab_size()));
  if (c.task.seq_len == 0) c.task.seq_len = default_seq_len(c.task.name);
  validate_config(c);
  return c;
}

template <typename T>
json evaluate(Model<T>& model, const Task& task, int64_t batch) {
  json out = json::object();
  const auto sets = task.eval_sets();
  Batch b;
  for (int s = 0; s < int(sets.size()); ++s) {
    if (sets[s].size <= 0) continue;
    double loss_sum = 0;
    int64_t count = 0, correct = 0;
    for (int64_t first = 0; first < sets[s].size; first += batch) {
      const int64_t n = std::min(batch, sets[s].size - first);
      task.eval_batch(s, first, n, &b);
      const StepStats st = model.forward(b.tokens.data(), b.targets.data(), b.B, b.T);
      loss_sum += st.loss * double(st.count);
      count += st.count;
      correct += st.correct;
    }
    const double acc = count > 0 ? double(correct) / double(count) : 0.0;
    json r = {{"loss", count > 0 ? loss_sum / double(count) : 0.0}, {"accuracy", acc}, {"count", count},
              {"sequences", sets[s].size}};
    if (task.reports_error()) r["error"] = 1.0 - acc;
    out[sets[s].name] = r;
  }
  return out;
}

namespace {

template <typename T>
RunResult train_typed(RunConfig cfg, const RunOptions& opt, const CheckpointInfo* ck) {
  const auto task = make_task(cfg.task);
  cfg = resolve_config(cfg, *task);
  const TrainConfig& tc = cfg.train;
  Model<T> model(cfg.model);
  model.backend = parse_backend(tc.backend);
  model.threads = tc.threads;
  AdamW<T> adam;
  adam.init(int64_t(model.params.size()));
  int64_t step = 0;
  if (ck) {
    restore_checkpoint(*ck, model, &adam);
    step = ck->step;
  } else {
    model.init(tc.seed);
  }

  const bool files = !opt.out_dir.empty();
  const std::string dir = opt.out_dir;
  const std::string ckpt_path = dir + "/ckpt.safetensors";
  MetricsLog log(dir + "/metrics.jsonl");
  const std::string metric = task->reports_error() ? "error" : "accuracy";
  const std::string title = task->name() + " / " + attn_kind_name(cfg.model.attn);
  if (files) {
    std::filesystem::create_directories(dir);
    write_file_atomic(dir + "/config.json", config_to_json(cfg).dump(2) + "\n");
    if (ck) log.truncate_after(step);
    else write_file_atomic(log.path(), "");
  }
  auto save = [&](int64_t s) {
    if (files) save_checkpoint(ckpt_path, cfg, model, adam, s);
  };
  auto do_eval = [&](int64_t s) {
    json ev = evaluate(model, *task, std::min<int64_t>(std::max(tc.batch_size, 8), 64));
    if (files) {
      log.append({{"step", s}, {"eval", ev}});
      write_plot_svg(dir + "/plot.svg", log.read(), title, metric);
    }
    return ev;
  };

  RunResult res;
  res.start_step = step;
  const int64_t end = opt.stop_after >= 0 ? std::min<int64_t>(tc.steps, opt.stop_after) : tc.steps;
  Progress bar(opt.label, tc.steps, step, opt.progress);
  Batch b;
  const auto t0 = std::chrono::steady_clock::now();
  double loss_acc = 0, acc_acc = 0;
  int64_t n_acc = 0;
  for (; step < end; ++step) {
    task->train_batch(tc.seed, step, tc.batch_size, &b);
    model.zero_grad();
    const StepStats st = model.forward(b.tokens.data(), b.targets.data(), b.B, b.T);
    model.backward();
    const double lr = lr_at(tc, step);
    const double gnorm = adam.step(model, tc, lr);
    res.last_loss = st.loss;
    loss_acc += st.loss;
    acc_acc += st.count > 0 ? double(st.correct) / double(st.count) : 0.0;
    n_acc += 1;
    const int64_t done = step + 1;
    if (done % tc.log_every == 0 || done == tc.steps) {
      const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (files)
        log.append({{"step", done}, {"loss", loss_acc / double(n_acc)}, {"accuracy", acc_acc / double(n_acc)},
                    {"lr", lr}, {"grad_norm", gnorm}, {"elapsed_s", el}});
      loss_acc = acc_acc = 0;
      n_acc = 0;
    }
    char extra[64];
    std::snprintf(extra, sizeof extra, "loss %.4f", st.loss);
    bar.update(done, extra);
    if (tc.eval_every > 0 && done % tc.eval_every == 0 && done != tc.steps) do_eval(done);
    if (tc.checkpoint_every > 0 && done % tc.checkpoint_every == 0 && done != tc.steps) save(done);
  }
  res.train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.steps_done = step;
  res.steps_per_s = res.train_seconds > 0 ? double(step - res.start_step) / res.train_seconds : 0.0;
  res.finished = step >= tc.steps;
  char extra[64];
  std::snprintf(extra, sizeof extra, "loss %.4f", res.last_loss);
  if (opt.progress) bar.finish(extra);
  save(step);
  if (res.finished) res.eval = do_eval(step);
  if (files) write_plot_svg(dir + "/plot.svg", log.read(), title, metric);
  res.config = cfg;
  if constexpr (std::is_same_v<T, float>) res.params_f32 = model.params;
  else res.params_f64 = model.params;
  return res;
}

}  // namespace

RunResult train_run(const RunConfig& cfg_in, const RunOptions& opt) {
  if (!opt.resume.empty()) {
    const CheckpointInfo ck = read_checkpoint(opt.resume);
    if (ck.dtype == "f64") return train_typed<double>(ck.config, opt, &ck);
    return train_typed<float>(ck.config, opt, &ck);
  }
  if (cfg_in.train.dtype == "f64") return train_typed<double>(cfg_in, opt, nullptr);
  return train_typed<float>(cfg_in, opt, nullptr);
}

namespace {
template <typename T>
json eval_ck(const CheckpointInfo& ck, int64_t batch, Backend backend, int threads) {
  const auto task = make_task(ck.config.task);
  const RunConfig cfg = resolve_config(ck.config, *task);
  Model<T> model(cfg.model);
  model.backend = backend;
  model.threads = threads;
  restore_checkpoint<T>(ck, model, nullptr);
  return evaluate(model, *task, batch);
}
}  // namespace

json evaluate_checkpoint(const std::string& path, int64_t batch, Backend backend, int threads) {
  const CheckpointInfo ck = read_checkpoint(path);
  json out = {{"checkpoint", path}, {"step", ck.step}, {"task", ck.config.task.name},
              {"attn", attn_kind_name(ck.config.model.attn)}};
  out["eval"] = ck.dtype == "f64" ? eval_ck<double>(ck, batch, backend, threads)
                                  : eval_ck<float>(ck, batch, backend, threads);
  return out;
}

template json evaluate<float>(Model<float>&, const Task&, int64_t);
template json evaluate<double>(Model<double>&, const Task&, int64_t);

}  // namespace pathattn::engine
