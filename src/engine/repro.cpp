// engine/repro.cpp: `pathattn repro flipflop | a5 | mqrar` and `pathattn sample` (engine/repro.h).
#include "engine/repro.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "engine/checkpoint.h"
#include "engine/embedded.h"
#include "engine/report.h"
#include "engine/run.h"

namespace pathattn::engine {

using nlohmann::json;

namespace {

RunConfig preset_config(const ReproOptions& o, const std::string& def) {
  const std::string name = o.preset.empty() ? def : o.preset;
  RunConfig c = overlay_config(parse_config_text(embedded_config(name), "embedded config " + name), o.overlay);
  if (!o.device.empty()) c.train.device = o.device;
  return c;
}

std::string pct(double x, int prec = 3) {
  char b[32];
  std::snprintf(b, sizeof b, "%.*f", prec, 100.0 * x);
  return b;
}

std::string pretty(const std::string& m) {
  if (m == "path") return "PaTH";
  if (m == "path-fox") return "PaTH-FoX";
  if (m == "fox") return "FoX";
  if (m == "rope") return "RoPE";
  if (m == "nope") return "NoPE";
  return m;
}

void emit(const std::string& dir, const std::string& table, const json& results) {
  std::fputs(table.c_str(), stdout);
  std::fflush(stdout);
  write_file_atomic(dir + "/table.md", table);
  write_file_atomic(dir + "/results.json", results.dump(2) + "\n");
}

// Number of leading positions whose accuracy exceeds `thr` (how many elements a model composes reliably).
int leading_above(const json& by_position, double thr) {
  int n = 0;
  for (const json& a : by_position) {
    if (a.get<double>() <= thr) break;
    ++n;
  }
  return n;
}
}  // namespace

RunConfig repro_preset(const ReproOptions& o, const std::string& def) { return preset_config(o, def); }
std::string attn_display_name(const std::string& kind) { return pretty(kind); }

json repro_flipflop(const ReproOptions& o) {
  const RunConfig base = preset_config(o, "repro_flipflop");
  const std::vector<std::string> models = o.models.empty() ? std::vector<std::string>{"path", "rope"} : o.models;
  const std::string dir = o.out_dir.empty() ? "runs/repro_flipflop" : o.out_dir;
  // Paper, Table 1 (error %, ID / sparse / dense).
  const std::map<std::string, std::string> paper = {{"rope", "6.9 / 40.3 / 0.01"}, {"fox", "8.3 / 36.3 / 0"},
                                                     {"path", "0 / 0.0001 / 0"}};
  json results = {{"config", config_to_json(base)}, {"runs", json::array()}};
  std::ostringstream t;
  t << "Flip-flop language modelling (Table 1): error % at read positions; " << base.model.n_layer << " layer, "
    << base.model.n_head << " heads, width " << base.model.d_model << ", " << base.train.steps << " steps x "
    << base.train.batch_size << " sequences of " << base.task.seq_len << " tokens, train FFL(" << base.task.p_train
    << ")\n\n";
  t << "| model | seed | ID FFL(0.8) | sparse FFL(0.98) | dense FFL(0.1) | paper ID / sparse / dense | train time |\n";
  t << "|---|---|---|---|---|---|---|\n";
  int64_t reads[3] = {0, 0, 0};
  for (const std::string& m : models) {
    for (uint64_t seed : o.seeds) {
      RunConfig c = base;
      c.model.attn = parse_attn_kind(m);
      c.train.seed = seed;
      RunOptions ro;
      ro.out_dir = dir + "/" + m + "_s" + std::to_string(seed);
      ro.progress = o.progress;
      ro.label = pretty(m) + " s" + std::to_string(seed);
      const RunResult r = train_run(c, ro);
      const json& e = r.eval;
      reads[0] = e["id"]["count"].get<int64_t>();
      reads[1] = e["sparse"]["count"].get<int64_t>();
      reads[2] = e["dense"]["count"].get<int64_t>();
      t << "| " << pretty(m) << " | " << seed << " | " << pct(e["id"]["error"].get<double>()) << " | "
        << pct(e["sparse"]["error"].get<double>()) << " | " << pct(e["dense"]["error"].get<double>()) << " | "
        << (paper.count(m) ? paper.at(m) : "-") << " | " << format_duration(r.train_seconds) << " |\n";
      results["runs"].push_back({{"model", m}, {"seed", seed}, {"eval", e}, {"train_seconds", r.train_seconds},
                                 {"steps_per_s", r.steps_per_s}, {"dir", ro.out_dir}});
    }
  }
  t << "\nRead positions scored: ID " << reads[0] << ", sparse " << reads[1] << ", dense " << reads[2]
    << " (one wrong bit moves the error by 100/count %).\n";
  emit(dir, t.str(), results);
  return results;
}

json repro_a5(const ReproOptions& o) {
  // The loop below trains depths 1..max_layers; model.n_layer accepts [1, 256].
  if (o.max_layers < 1 || o.max_layers > 256)
    throw EngineError("max-layers: expected a depth in [1, 256], got " + std::to_string(o.max_layers));
  for (int L : o.lengths)
    if (L < 1 || L > (1 << 20)) throw EngineError("lengths: expected word lengths in [1, 1048576], got " + std::to_string(L));
  const RunConfig base = preset_config(o, "repro_a5");
  const std::vector<std::string> models =
      o.models.empty() ? std::vector<std::string>{"path", "rope", "fox"} : o.models;
  std::vector<int> lengths = o.lengths.empty() ? std::vector<int>{5, 10, 15, 20} : o.lengths;
  std::sort(lengths.begin(), lengths.end());
  const std::string dir = o.out_dir.empty() ? "runs/repro_a5" : o.out_dir;
  json results = {{"config", config_to_json(base)}, {"runs", json::array()}};
  std::ostringstream t, runs;
  t << "A5 word problem (Figure 2): fewest layers reaching > 90% test token accuracy (every position of "
    << base.task.eval_sequences << " test words), up to " << o.max_layers << " layers; width " << base.model.d_model
    << ", " << base.model.n_head << " heads, " << base.train.steps << " steps x " << base.train.batch_size
    << " words, lr " << base.train.lr << "\n"
    << "Paper (lengths 5 / 10 / 15 / 20): RoPE, FoX 1 / 2 / 3 / 4; PaTH 1 / 2 / 2 / 2.\n"
    << "A cell \">n (a%)\" means no depth up to n reached 90%; a% is the best token accuracy seen. The search for a "
       "length starts at the depth that solved the previous (shorter) length; after an unsolved length only the "
       "deepest model (" << o.max_layers << " layers) is trained.\n\n";
  t << "| model |";
  for (int L : lengths) t << " L=" << L << " |";
  t << "\n|---|";
  for (size_t i = 0; i < lengths.size(); ++i) t << "---|";
  t << "\n";
  runs << "| model | length | layers | token accuracy % | final-position accuracy % | leading positions > 90% | "
          "train time |\n"
       << "|---|---|---|---|---|---|---|\n";
  const uint64_t seed = o.seeds.empty() ? 1 : o.seeds[0];
  for (const std::string& m : models) {
    t << "| " << pretty(m) << " |";
    int start = 1;
    for (int L : lengths) {
      std::string cell;
      double best = 0;
      for (int nl = start; nl <= o.max_layers; ++nl) {
        RunConfig c = base;
        c.model.attn = parse_attn_kind(m);
        c.model.n_layer = nl;
        c.task.seq_len = L;
        c.train.seed = seed;
        RunOptions ro;
        ro.out_dir = dir + "/" + m + "_L" + std::to_string(L) + "_l" + std::to_string(nl);
        ro.progress = o.progress;
        ro.label = pretty(m) + " L" + std::to_string(L) + " " + std::to_string(nl) + "l";
        const RunResult r = train_run(c, ro);
        const double acc = r.eval["test"]["accuracy"].get<double>();
        const double last = r.eval.contains("last") ? r.eval["last"]["accuracy"].get<double>() : -1.0;
        const json by_pos = r.eval["test"].value("by_position", json::array());
        best = std::max(best, acc);
        results["runs"].push_back({{"model", m}, {"length", L}, {"layers", nl}, {"accuracy", acc},
                                   {"final_accuracy", last}, {"by_position", by_pos},
                                   {"train_seconds", r.train_seconds}, {"steps_per_s", r.steps_per_s},
                                   {"dir", ro.out_dir}});
        runs << "| " << pretty(m) << " | " << L << " | " << nl << " | " << pct(acc, 1) << " | "
             << (last >= 0 ? pct(last, 1) : "-") << " | " << leading_above(by_pos, 0.9) << " of " << L << " | "
             << format_duration(r.train_seconds) << " |\n";
        std::fputs(("  " + pretty(m) + " L=" + std::to_string(L) + " layers=" + std::to_string(nl) +
                    ": token accuracy " + pct(acc, 1) + "%\n").c_str(), stderr);
        if (acc > 0.9) {
          char b[48];
          std::snprintf(b, sizeof b, "%d (%.1f%%)", nl, 100 * acc);
          cell = b;
          start = nl;
          break;
        }
      }
      if (cell.empty()) {
        cell = ">" + std::to_string(o.max_layers) + " (" + pct(best, 1) + "%)";
        start = o.max_layers;
      }
      t << " " << cell << " |";
    }
    t << "\n";
  }
  t << "\nEvery run:\n\n" << runs.str();
  emit(dir, t.str(), results);
  return results;
}

json repro_mqrar(const ReproOptions& o) {
  const RunConfig base = preset_config(o, "repro_mqrar");
  const std::vector<std::string> models =
      o.models.empty() ? std::vector<std::string>{"path", "rope", "fox"} : o.models;
  const std::vector<int> ns = o.n_backs.empty() ? std::vector<int>{1, 2, 3, 4} : o.n_backs;
  for (int N : ns)  // the range task.n_back accepts
    if (N < 1 || N > 64) throw EngineError("n: expected N values in [1, 64], got " + std::to_string(N));
  const std::string dir = o.out_dir.empty() ? "runs/repro_mqrar" : o.out_dir;
  json results = {{"config", config_to_json(base)}, {"runs", json::array()}};
  std::ostringstream t;
  t << "MQRAR-N (Figure 2): test accuracy % on answers; " << base.model.n_layer << " layers, width "
    << base.model.d_model << ", " << base.model.n_head << " heads, " << base.task.n_keys << " keys, length "
    << base.task.seq_len << ", " << base.train.steps << " steps x " << base.train.batch_size << "\n"
    << "Paper: PaTH succeeds for N = 1, 2, 3; RoPE, FoX and Stick-Breaking struggle (no exact numbers published).\n\n";
  t << "| model |";
  for (int n : ns) t << " N=" << n << " |";
  t << "\n|---|";
  for (size_t i = 0; i < ns.size(); ++i) t << "---|";
  t << "\n";
  const uint64_t seed = o.seeds.empty() ? 1 : o.seeds[0];
  std::ostringstream times;
  times << "| model | N | answers scored | train time |\n|---|---|---|---|\n";
  for (const std::string& m : models) {
    t << "| " << pretty(m) << " |";
    for (int n : ns) {
      RunConfig c = base;
      c.model.attn = parse_attn_kind(m);
      c.task.n_back = n;
      c.train.seed = seed;
      RunOptions ro;
      ro.out_dir = dir + "/" + m + "_N" + std::to_string(n);
      ro.progress = o.progress;
      ro.label = pretty(m) + " N=" + std::to_string(n);
      const RunResult r = train_run(c, ro);
      const double acc = r.eval["test"]["accuracy"].get<double>();
      results["runs"].push_back({{"model", m}, {"n_back", n}, {"accuracy", acc}, {"train_seconds", r.train_seconds},
                                 {"steps_per_s", r.steps_per_s}, {"answers", r.eval["test"]["count"]},
                                 {"dir", ro.out_dir}});
      times << "| " << pretty(m) << " | " << n << " | " << r.eval["test"]["count"].get<int64_t>() << " | "
            << format_duration(r.train_seconds) << " |\n";
      char b[32];
      std::snprintf(b, sizeof b, "%.1f", 100 * acc);
      t << " " << b << " |";
    }
    t << "\n";
  }
  t << "\n" << times.str();
  emit(dir, t.str(), results);
  return results;
}

namespace {
template <typename T>
std::string sample_typed(const CheckpointInfo& ck, const std::string& prompt, int n, double temperature, int top_k,
                         uint64_t seed, Backend backend, int threads) {
  const auto task = make_task(ck.config.task);
  const RunConfig cfg = resolve_config(ck.config, *task);
  Model<T> model(cfg.model);
  model.backend = backend;
  model.threads = threads;
  restore_checkpoint<T>(ck, model, nullptr);
  std::vector<int32_t> ctx = task->encode(prompt);
  if (ctx.empty()) ctx.push_back(0);
  Rng rng(seed);
  std::string out;
  if (n <= 0) return out;
  const int64_t Vc = cfg.model.vocab_size;
  // The prompt's forward fills the decode caches (room for every token to come); each generated token is
  // then one decode step, O(length) instead of a full forward over the whole context.
  const T* l = model.prefill(ctx.data(), int64_t(ctx.size()), int64_t(ctx.size()) + n);
  for (int i = 0; i < n; ++i) {
    if (i > 0) l = model.decode_step(ctx.back());
    const int32_t next = choose_token(l, Vc, temperature, top_k, rng);
    ctx.push_back(next);
    out += task->token_str(next);
  }
  return out;
}
}  // namespace

template <typename T>
int32_t choose_token(const T* l, int64_t vocab, double temperature, int top_k, Rng& rng) {
  if (temperature <= 0) return int32_t(std::max_element(l, l + vocab) - l);
  std::vector<std::pair<double, int32_t>> c;
  for (int64_t v = 0; v < vocab; ++v) c.push_back({double(l[v]) / temperature, int32_t(v)});
  std::sort(c.begin(), c.end(), [](auto& a, auto& b) { return a.first > b.first; });
  if (top_k > 0 && int64_t(c.size()) > top_k) c.resize(size_t(top_k));
  double sum = 0;
  for (auto& [s, v] : c) sum += std::exp(s - c[0].first);
  double u = rng.uniform() * sum;
  for (auto& [s, v] : c) {
    u -= std::exp(s - c[0].first);
    if (u <= 0) return v;
  }
  return c.back().second;
}
template int32_t choose_token<float>(const float*, int64_t, double, int, Rng&);
template int32_t choose_token<double>(const double*, int64_t, double, int, Rng&);

std::string sample_checkpoint(const std::string& path, const std::string& prompt, int n, double temperature,
                              int top_k, uint64_t seed, const std::string& backend, int threads) {
  // The arguments before the checkpoint is read, each named as the command line names it.
  if (n < 0) throw EngineError("tokens: expected a count >= 0, got " + std::to_string(n));
  if (!std::isfinite(temperature) || temperature < 0)
    throw EngineError("temperature: expected a finite number >= 0 (0 = greedy), got " + std::to_string(temperature));
  if (top_k < 0) throw EngineError("top-k: expected a count >= 0 (0 = all tokens), got " + std::to_string(top_k));
  const CheckpointInfo ck = read_checkpoint(path);
  const Backend b = parse_backend(backend);
  return ck.dtype == "f64" ? sample_typed<double>(ck, prompt, n, temperature, top_k, seed, b, threads)
                           : sample_typed<float>(ck, prompt, n, temperature, top_k, seed, b, threads);
}

}  // namespace pathattn::engine
