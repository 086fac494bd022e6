// engine/run.cpp: the training loop (seeded, deterministic, resumable bit for bit), evaluation, and the run
// directory's files (engine/run.h).
#include "engine/run.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <filesystem>

#include "engine/checkpoint.h"
#include "engine/optim.h"
#include "engine/report.h"
#ifdef PATHATTN_ENGINE_CUDA
#include "engine/cuda/model_cuda.h"
#endif

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

void check_device(const RunConfig& c) {
  if (c.train.device == "cpu") return;
  if (c.train.device != "cuda")
    throw EngineError("train.device: expected cpu or cuda, got \"" + c.train.device + "\"");
#ifndef PATHATTN_ENGINE_CUDA
  throw EngineError("train.device = \"cuda\": this build has no CUDA support (configure with -DPATHATTN_CUDA=ON, "
                    "or use --device cpu)");
#else
  if (c.train.dtype != "f32")
    throw EngineError("train.dtype = \"" + c.train.dtype + "\": train.device = \"cuda\" trains in f32 only");
  check_cuda_model(c.model);
#endif
}

void count_exact(const int32_t* targets, const int32_t* pred, int64_t B, int64_t T, int64_t* scored, int64_t* exact) {
  for (int64_t r = 0; r < B; ++r) {
    bool any = false, all = true;
    for (int64_t t = r * T; t < (r + 1) * T; ++t) {
      if (targets[t] < 0) continue;
      any = true;
      all = all && pred[t] == targets[t];
    }
    *scored += any;
    *exact += any && all;
  }
}

template <typename M>
json evaluate(M& model, const Task& task, int64_t batch) {
  if (batch < 1) throw EngineError("batch: expected at least 1 sequence per forward, got " + std::to_string(batch));
  json out = json::object();
  const auto sets = task.eval_sets();
  Batch b;
  for (int s = 0; s < int(sets.size()); ++s) {
    if (sets[s].size <= 0) continue;
    double loss_sum = 0;
    int64_t count = 0, correct = 0;
    const bool by_pos = task.reports_by_position(s), exact = task.reports_exact_match();
    std::vector<int64_t> pos_count, pos_correct;  // per position t of the model's input
    int64_t seq_scored = 0, seq_exact = 0;        // sequences with scored positions; those all right
    std::vector<int32_t> pred;
    for (int64_t first = 0; first < sets[s].size; first += batch) {
      const int64_t n = std::min(batch, sets[s].size - first);
      task.eval_batch(s, first, n, &b);
      const bool want_pred = by_pos || exact;
      if (want_pred) pred.assign(size_t(b.B * b.T), -1);
      const StepStats st = model.forward(b.tokens.data(), b.targets.data(), b.B, b.T, want_pred ? pred.data() : nullptr);
      if (exact) count_exact(b.targets.data(), pred.data(), b.B, b.T, &seq_scored, &seq_exact);
      loss_sum += st.loss * double(st.count);
      count += st.count;
      correct += st.correct;
      if (by_pos) {
        pos_count.resize(size_t(b.T), 0);
        pos_correct.resize(size_t(b.T), 0);
        for (int64_t i = 0; i < b.B * b.T; ++i) {
          if (b.targets[i] < 0) continue;
          ++pos_count[i % b.T];
          pos_correct[i % b.T] += pred[i] == b.targets[i];
        }
      }
    }
    const double acc = count > 0 ? double(correct) / double(count) : 0.0;
    json r = {{"loss", count > 0 ? loss_sum / double(count) : 0.0}, {"accuracy", acc}, {"count", count},
              {"sequences", sets[s].size}};
    if (task.reports_error()) r["error"] = 1.0 - acc;
    if (exact) r["exact_match"] = seq_scored > 0 ? double(seq_exact) / double(seq_scored) : 0.0;
    if (by_pos) {
      json bp = json::array();
      for (size_t t = 0; t < pos_count.size(); ++t)
        bp.push_back(pos_count[t] > 0 ? double(pos_correct[t]) / double(pos_count[t]) : 0.0);
      r["by_position"] = bp;
    }
    out[sets[s].name] = r;
  }
  return out;
}

namespace {

// The training loop's state between log lines, carried in checkpoints (metadata "log_state") so that a resumed
// run logs exactly what the uninterrupted run would: the sums over the steps since the last log line, and the
// last step's loss. Doubles in %.17g round-trip exactly.
struct LogState {
  double loss_sum = 0, acc_sum = 0, last_loss = 0;
  int64_t n = 0;
  std::string to_string() const {
    char buf[128];
    std::snprintf(buf, sizeof buf, "%.17g %.17g %lld %.17g", loss_sum, acc_sum, (long long)n, last_loss);
    return buf;
  }
  // Checkpoints written before the field existed start from zero sums (the old behaviour).
  static LogState from(const CheckpointInfo& ck) {
    LogState s;
    auto it = ck.file.metadata.find("log_state");
    if (it == ck.file.metadata.end()) return s;
    long long n = 0;
    if (std::sscanf(it->second.c_str(), "%lf %lf %lld %lf", &s.loss_sum, &s.acc_sum, &n, &s.last_loss) != 4 || n < 0 ||
        n > ck.step)
      throw EngineError("checkpoint: metadata \"log_state\" is malformed: \"" + it->second + "\"");
    s.n = n;
    return s;
  }
};

// The model and its optimizer on the host (Model<T>, AdamW<T>).
template <typename T>
struct HostTrainer {
  Model<T> model;
  AdamW<T> adam;
  explicit HostTrainer(const RunConfig& cfg) : model(cfg.model) {
    model.backend = parse_backend(cfg.train.backend);
    model.threads = cfg.train.threads;
    adam.init(int64_t(model.params.size()));
  }
  void init(uint64_t seed) { model.init(seed); }
  void restore(const CheckpointInfo& ck) { restore_checkpoint(ck, model, &adam); }
  void save(const std::string& path, const RunConfig& cfg, int64_t step, const std::map<std::string, std::string>& extra) {
    save_checkpoint(path, cfg, model, adam, step, extra);
  }
  StepStats forward(const Batch& b) { return model.forward(b.tokens.data(), b.targets.data(), b.B, b.T); }
  void zero_grad() { model.zero_grad(); }
  void backward() { model.backward(); }
  double step(const TrainConfig& tc, double lr) { return adam.step(model, tc, lr); }
  Model<T>& eval_model() { return model; }
  double peak_flops() const { return 0.0; }  // no MFU on the CPU
  void final_params(RunResult* r) {
    if constexpr (std::is_same_v<T, float>) r->params_f32 = model.params;
    else r->params_f64 = model.params;
  }
};

#ifdef PATHATTN_ENGINE_CUDA
// The model and its optimizer on the CUDA device. A host Model<float> / AdamW<float> is the staging copy
// for init (the CPU engine's init, drawn on the host) and for checkpoints (the CPU engine's format).
struct CudaTrainer {
  Model<float> host;
  AdamW<float> host_adam;
  CudaModel dev;
  explicit CudaTrainer(const RunConfig& cfg) : host(cfg.model), dev(cfg.model, cfg.train.matmul) {
    host_adam.init(int64_t(host.params.size()));
  }
  void init(uint64_t seed) {
    host.init(seed);
    dev.upload(host, &host_adam);
  }
  void restore(const CheckpointInfo& ck) {
    restore_checkpoint(ck, host, &host_adam);
    dev.upload(host, &host_adam);
  }
  void save(const std::string& path, const RunConfig& cfg, int64_t step, const std::map<std::string, std::string>& extra) {
    dev.download(host, &host_adam);
    save_checkpoint(path, cfg, host, host_adam, step, extra);
  }
  StepStats forward(const Batch& b) { return dev.forward(b.tokens.data(), b.targets.data(), b.B, b.T); }
  void zero_grad() { dev.zero_grad(); }
  void backward() { dev.backward(); }
  double step(const TrainConfig& tc, double lr) { return dev.adam_step(tc, lr); }
  CudaModel& eval_model() { return dev; }
  double peak_flops() const { return bf16_peak_flops(dev.device_name()); }
  void final_params(RunResult* r) {
    dev.download(host, nullptr);
    r->params_f32 = host.params;
  }
};
#endif

template <typename Trainer>
RunResult train_typed(RunConfig cfg, const RunOptions& opt, const CheckpointInfo* ck) {
  const auto task = make_task(cfg.task);
  cfg = resolve_config(cfg, *task);
  check_device(cfg);
  const TrainConfig& tc = cfg.train;
  Trainer tr(cfg);
  int64_t step = 0;
  LogState ls;
  if (ck) {
    tr.restore(*ck);
    step = ck->step;
    ls = LogState::from(*ck);
  } else {
    tr.init(tc.seed);
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
    if (files) tr.save(ckpt_path, cfg, s, {{"log_state", ls.to_string()}});
  };
  auto do_eval = [&](int64_t s) {
    json ev = evaluate(tr.eval_model(), *task, std::min<int64_t>(std::max(tc.batch_size, 8), 64));
    if (files) {
      log.append({{"step", s}, {"eval", ev}});
      write_plot_svg(dir + "/plot.svg", log.read(), title, metric);
    }
    return ev;
  };

  RunResult res;
  res.start_step = step;
  res.last_loss = ls.last_loss;
  const int64_t end = opt.stop_after >= 0 ? std::min<int64_t>(tc.steps, opt.stop_after) : tc.steps;
  Progress bar(opt.label, tc.steps, step, opt.progress);
  Batch b;
  const auto t0 = std::chrono::steady_clock::now();
  // Throughput over each metrics line's window (tokens: every position of the batch; sequences: its rows, which
  // are the words of the word problems) and since the loop started (the progress bar); MFU where the device's
  // peak is known (train_flops_per_token over bf16_peak_flops).
  const double peak = tr.peak_flops();
  int64_t win_tokens = 0, win_seqs = 0, run_tokens = 0, flops_T = -1;
  double win_start = 0, win_flops = 0, flops_tok = 0;
  double& loss_acc = ls.loss_sum;
  double& acc_acc = ls.acc_sum;
  int64_t& n_acc = ls.n;
  for (; step < end; ++step) {
    task->train_batch(tc.seed, step, tc.batch_size, &b);
    tr.zero_grad();
    const StepStats st = tr.forward(b);
    tr.backward();
    const double lr = lr_at(tc, step);
    const double gnorm = tr.step(tc, lr);
    res.last_loss = ls.last_loss = st.loss;
    loss_acc += st.loss;
    acc_acc += st.count > 0 ? double(st.correct) / double(st.count) : 0.0;
    n_acc += 1;
    win_tokens += b.B * b.T;
    win_seqs += b.B;
    run_tokens += b.B * b.T;
    if (b.T != flops_T) flops_tok = train_flops_per_token(cfg.model, b.T), flops_T = b.T;
    win_flops += double(b.B * b.T) * flops_tok;
    const int64_t done = step + 1;
    const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (done % tc.log_every == 0 || done == tc.steps) {
      if (files) {
        const double dt = el - win_start;
        json line = {{"step", done}, {"loss", loss_acc / double(n_acc)}, {"accuracy", acc_acc / double(n_acc)},
                     {"lr", lr}, {"grad_norm", gnorm}, {"elapsed_s", el}};
        if (dt > 0) {
          line["tokens_per_s"] = double(win_tokens) / dt;
          line["sequences_per_s"] = double(win_seqs) / dt;
          if (peak > 0) line["mfu"] = win_flops / dt / peak;
        }
        log.append(line);
      }
      loss_acc = acc_acc = 0;
      n_acc = 0;
      win_tokens = win_seqs = 0;
      win_flops = 0;
      win_start = el;
    }
    char extra[64];
    std::snprintf(extra, sizeof extra, "loss %.4f, %.0f tok/s", st.loss, el > 0 ? double(run_tokens) / el : 0.0);
    bar.update(done, extra);
    if (tc.eval_every > 0 && done % tc.eval_every == 0 && done != tc.steps) do_eval(done);
    if (tc.checkpoint_every > 0 && done % tc.checkpoint_every == 0 && done != tc.steps) save(done);
  }
  res.train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.steps_done = step;
  res.steps_per_s = res.train_seconds > 0 ? double(step - res.start_step) / res.train_seconds : 0.0;
  res.finished = step >= tc.steps;
  char extra[64];
  std::snprintf(extra, sizeof extra, "loss %.4f, %.0f tok/s", res.last_loss,
                res.train_seconds > 0 ? double(run_tokens) / res.train_seconds : 0.0);
  if (opt.progress) bar.finish(extra);
  const bool resumed_done = ck && step == res.start_step;  // nothing was run: the checkpoint is already this
  if (!resumed_done) save(step);
  if (res.finished) {
    // A finished run resumed again: its final evaluation is in the log already (unless the run was stopped
    // between the last checkpoint and that line); report it instead of appending a duplicate.
    bool found = false;
    if (resumed_done && files)
      for (const json& j : log.read())
        if (j.contains("eval") && j.value("step", int64_t(-1)) == step) res.eval = j["eval"], found = true;
    if (!found) res.eval = do_eval(step);
  }
  if (files) write_plot_svg(dir + "/plot.svg", log.read(), title, metric);
  res.config = cfg;
  tr.final_params(&res);
  return res;
}

RunResult train_on_device(const RunConfig& cfg, const RunOptions& opt, const CheckpointInfo* ck) {
  if (cfg.train.device == "cuda") {
#ifdef PATHATTN_ENGINE_CUDA
    if (cfg.train.dtype == "f32") return train_typed<CudaTrainer>(cfg, opt, ck);
#endif
    check_device(cfg);  // throws: why this build or config cannot train on cuda
  }
  if (cfg.train.dtype == "f64") return train_typed<HostTrainer<double>>(cfg, opt, ck);
  return train_typed<HostTrainer<float>>(cfg, opt, ck);
}

}  // namespace

RunResult train_run(const RunConfig& cfg_in, const RunOptions& opt) {
  if (!opt.resume.empty()) {
    const CheckpointInfo ck = read_checkpoint(opt.resume);
    RunConfig cfg = ck.config;
    cfg.train.dtype = ck.dtype;  // the tensors decide
    if (!opt.device.empty()) cfg.train.device = opt.device;
    return train_on_device(cfg, opt, &ck);
  }
  RunConfig cfg = cfg_in;
  if (!opt.device.empty()) cfg.train.device = opt.device;
  return train_on_device(cfg, opt, nullptr);
}

namespace {
template <typename T>
json eval_ck(const CheckpointInfo& ck, const RunConfig& cfg, const Task& task, int64_t batch, Backend backend,
             int threads) {
  Model<T> model(cfg.model);
  model.backend = backend;
  model.threads = threads;
  restore_checkpoint<T>(ck, model, nullptr);
  return evaluate(model, task, batch);
}
}  // namespace

json evaluate_checkpoint(const std::string& path, int64_t batch, Backend backend, int threads,
                         const std::string& device) {
  if (batch < 1) throw EngineError("batch: expected at least 1 sequence per forward, got " + std::to_string(batch));
  const CheckpointInfo ck = read_checkpoint(path);
  json out = {{"checkpoint", path}, {"step", ck.step}, {"task", ck.config.task.name},
              {"attn", attn_kind_name(ck.config.model.attn)}};
  const auto task = make_task(ck.config.task);
  RunConfig cfg = resolve_config(ck.config, *task);
  if (!device.empty()) cfg.train.device = device;
  cfg.train.dtype = ck.dtype;
  try {
    check_device(cfg);
  } catch (const EngineError&) {
    // Not asked for a device: a checkpoint trained on a GPU is evaluated on the CPU where this build or
    // machine has none (checkpoints are device-independent). An explicit --device still fails clearly.
    if (!device.empty() || cfg.train.device != "cuda") throw;
    cfg.train.device = "cpu";
    check_device(cfg);
  }
  out["device"] = cfg.train.device;
#ifdef PATHATTN_ENGINE_CUDA
  if (cfg.train.device == "cuda") {
    CudaTrainer tr(cfg);
    restore_checkpoint<float>(ck, tr.host, nullptr);
    tr.dev.upload(tr.host, nullptr);
    out["eval"] = evaluate(tr.dev, *task, batch);
    return out;
  }
#endif
  out["eval"] = ck.dtype == "f64" ? eval_ck<double>(ck, cfg, *task, batch, backend, threads)
                                  : eval_ck<float>(ck, cfg, *task, batch, backend, threads);
  return out;
}

namespace {
template <typename M>
std::vector<json> evaluate_all(M& model, const std::vector<TaskConfig>& tasks, int64_t max_tokens,
                               const std::function<void(size_t)>& done) {
  std::vector<json> out;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const auto task = make_task(tasks[i]);
    out.push_back(evaluate(model, *task, std::max<int64_t>(1, max_tokens / task->model_len())));
    if (done) done(i);
  }
  return out;
}
}  // namespace

std::vector<json> evaluate_trained(const RunResult& r, const std::vector<TaskConfig>& tasks, int64_t max_tokens,
                                   const std::function<void(size_t)>& done) {
  if (max_tokens < 1) throw EngineError("max_tokens: expected at least 1, got " + std::to_string(max_tokens));
  const RunConfig& cfg = r.config;
  if (cfg.train.dtype == "f64") {
    Model<double> m(cfg.model);
    m.backend = parse_backend(cfg.train.backend);
    m.threads = cfg.train.threads;
    if (r.params_f64.size() != m.params.size()) throw EngineError("evaluate_trained: the run has no f64 parameters");
    m.params = r.params_f64;
    return evaluate_all(m, tasks, max_tokens, done);
  }
  Model<float> m(cfg.model);
  m.backend = parse_backend(cfg.train.backend);
  m.threads = cfg.train.threads;
  if (r.params_f32.size() != m.params.size()) throw EngineError("evaluate_trained: the run has no f32 parameters");
  m.params = r.params_f32;
#ifdef PATHATTN_ENGINE_CUDA
  if (cfg.train.device == "cuda") {
    CudaModel dev(cfg.model, cfg.train.matmul);
    dev.upload(m, nullptr);
    return evaluate_all(dev, tasks, max_tokens, done);
  }
#endif
  return evaluate_all(m, tasks, max_tokens, done);
}

template json evaluate<Model<float>>(Model<float>&, const Task&, int64_t);
template json evaluate<Model<double>>(Model<double>&, const Task&, int64_t);
#ifdef PATHATTN_ENGINE_CUDA
template json evaluate<CudaModel>(CudaModel&, const Task&, int64_t);
#endif

}  // namespace pathattn::engine
