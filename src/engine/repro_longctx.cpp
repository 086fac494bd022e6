// engine/repro_longctx.cpp: `pathattn repro long-context` (engine/repro.h): the attention kinds trained at one
// length on a mixture of the long-context text tasks, then every task evaluated at multiples of that length.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "engine/longctx.h"
#include "engine/model.h"
#include "engine/repro.h"
#include "engine/report.h"
#include "engine/run.h"
#include "engine/tasks.h"

namespace pathattn::engine {

using nlohmann::json;

namespace {

constexpr int64_t kMaxLen = int64_t(1) << 20;  // task.seq_len's ceiling

// One evaluation of a trained model: mixture component `component` at `scale` x the training length; niah
// single at needle depth `depth` (-1: the component's own needle placement).
struct EvalSpec {
  std::string family;  // the component's test-set name: one table block and one plot panel
  int scale = 1;
  double depth = -1;
  TaskConfig task;
};

int64_t param_count(const ModelConfig& m) {
  const auto L = param_layout(m);
  return L.empty() ? 0 : L.back().offset + L.back().numel;
}

// Equal parameter counts: the kind with the most parameters at the configured MLP width keeps that width; each
// other kind gets the SwiGLU width whose total comes closest (the kinds differ by PaTH's w, beta and conv
// projections and FoX's gate).
std::map<std::string, ModelConfig> matched_models(const ModelConfig& base, const std::vector<std::string>& kinds) {
  int64_t target = 0;
  for (const std::string& k : kinds) {
    ModelConfig m = base;
    m.attn = parse_attn_kind(k);
    target = std::max(target, param_count(m));
  }
  std::map<std::string, ModelConfig> out;
  for (const std::string& k : kinds) {
    ModelConfig m = base;
    m.attn = parse_attn_kind(k);
    const int f0 = base.F();
    int best = f0;
    int64_t best_d = std::llabs(param_count(m) - target);
    for (int f = 1; f <= 2 * f0 + 64; ++f) {
      m.mlp_hidden = f;
      const int64_t d = std::llabs(param_count(m) - target);
      if (d < best_d) best_d = d, best = f;
    }
    m.mlp_hidden = best;
    out[k] = m;
  }
  return out;
}

// Every evaluation, checked up front (a length too short or too long fails before any training).
std::vector<EvalSpec> eval_specs(const TaskConfig& mix, const std::vector<int>& scales,
                                 const std::vector<double>& depths) {
  std::vector<EvalSpec> out;
  for (size_t i = 0; i < mix.mixture.size(); ++i) {
    const TaskConfig c = mixture_component(mix, i);
    const std::string where = "task.mixture[" + std::to_string(i) + "]";
    const bool sweep = c.name == "niah" && c.niah_variant == "single";
    for (int s : scales) {
      const int64_t len = int64_t(s) * c.seq_len;
      if (len > kMaxLen)
        throw EngineError("scales: " + std::to_string(s) + " x " + where + ".seq_len " + std::to_string(c.seq_len) +
                          " exceeds the longest task length " + std::to_string(kMaxLen));
      EvalSpec e{mixture_label(mix, i), s, -1, c};
      e.task.seq_len = int(len);
      for (size_t j = 0; j < (sweep ? depths.size() : 1); ++j) {
        if (sweep) e.depth = depths[j], e.task.depths = {depths[j]};
        try {
          (void)make_task(e.task);
        } catch (const EngineError& err) {
          throw EngineError("evaluation of " + e.family + " at " + std::to_string(s) + "x (" + std::to_string(len) +
                            " bytes): " + err.what());
        }
        out.push_back(e);
      }
    }
  }
  return out;
}

struct Stat {
  double mean = 0, sd = 0;
  size_t n = 0;
};
Stat stat(const std::vector<double>& v) {
  Stat s;
  s.n = v.size();
  if (v.empty()) return s;
  for (double x : v) s.mean += x;
  s.mean /= double(v.size());
  if (v.size() > 1) {
    double q = 0;
    for (double x : v) q += (x - s.mean) * (x - s.mean);
    s.sd = std::sqrt(q / double(v.size() - 1));
  }
  return s;
}
std::string cell(const Stat& s) {
  char b[48];
  if (s.n == 0) return "-";
  if (s.n == 1) std::snprintf(b, sizeof b, "%.1f", 100 * s.mean);
  else std::snprintf(b, sizeof b, "%.1f ± %.1f", 100 * s.mean, 100 * s.sd);
  return b;
}

// The measurements of one metric, grouped for the tables: per seed of (family, model, scale), niah single's the
// mean over its depths; and per seed of (model, depth, scale) for the depth table.
struct Collected {
  std::map<std::string, std::map<std::string, std::map<int, std::vector<double>>>> by_family;
  std::map<std::string, std::map<double, std::map<int, std::vector<double>>>> by_depth;
  std::vector<std::string> families;
  std::string depth_family;
};

void collect_run(const std::vector<EvalSpec>& specs, const std::vector<json>& evs, const std::string& model,
                 const char* metric, Collected* c) {
  std::map<std::pair<std::string, int>, std::vector<double>> per_seed;  // (family, scale) -> over depths
  for (size_t i = 0; i < specs.size(); ++i) {
    const double v = evs[i]["test"][metric].get<double>();
    per_seed[{specs[i].family, specs[i].scale}].push_back(v);
    if (specs[i].depth >= 0) {
      c->by_depth[model][specs[i].depth][specs[i].scale].push_back(v);
      c->depth_family = specs[i].family;
    }
    if (std::find(c->families.begin(), c->families.end(), specs[i].family) == c->families.end())
      c->families.push_back(specs[i].family);
  }
  for (const auto& [k, v] : per_seed) c->by_family[k.first][model][k.second].push_back(stat(v).mean);
}

std::string length_header(const std::vector<int>& scales, int L) {
  std::ostringstream t;
  for (int s : scales) t << " " << int64_t(s) * L << " (" << s << "x) |";
  t << "\n";
  return t.str();
}

// The kinds of each family from best to worst at `scale` x the training length: "A 12.0 > B 3.0 = C 3.0".
std::string order_lines(const Collected& c, const std::vector<std::string>& models, int scale) {
  std::ostringstream t;
  for (const std::string& f : c.families) {
    std::vector<std::pair<double, std::string>> r;
    for (const std::string& m : models) r.push_back({stat(c.by_family.at(f).at(m).at(scale)).mean, m});
    std::stable_sort(r.begin(), r.end(), [](auto& a, auto& b) { return a.first > b.first; });
    t << "- " << f << ": ";
    for (size_t i = 0; i < r.size(); ++i) {
      char b[64];
      std::snprintf(b, sizeof b, "%.1f", 100 * r[i].first);
      if (i) t << (std::string(b) == cell(stat({r[i - 1].first})) ? " = " : " > ");
      t << attn_display_name(r[i].second) << " " << b;
    }
    t << "\n";
  }
  return t.str();
}

std::string tables(const Collected& c, const std::vector<std::string>& models, const std::vector<int>& scales,
                   int L, const std::string& what) {
  std::ostringstream t;
  t << what << ", mean ± sd over seeds:\n\n";
  t << "| task | model |" << length_header(scales, L) << "|---|---|";
  for (size_t i = 0; i < scales.size(); ++i) t << "---|";
  t << "\n";
  for (const std::string& f : c.families)
    for (const std::string& m : models) {
      t << "| " << f << " | " << attn_display_name(m) << " |";
      for (int s : scales) t << " " << cell(stat(c.by_family.at(f).at(m).at(s))) << " |";
      t << "\n";
    }
  if (!c.by_depth.empty()) {
    t << "\n" << what << ", " << c.depth_family << " by needle depth (0: the start of the context, 1: its end):\n\n";
    t << "| model | depth |" << length_header(scales, L) << "|---|---|";
    for (size_t i = 0; i < scales.size(); ++i) t << "---|";
    t << "\n";
    for (const std::string& m : models)
      for (const auto& [d, per_scale] : c.by_depth.at(m)) {
        t << "| " << attn_display_name(m) << " | " << d << " |";
        for (int s : scales) t << " " << cell(stat(per_scale.at(s))) << " |";
        t << "\n";
      }
  }
  // The order of the kinds where the claims are made, past the training length: at the shortest and the
  // longest evaluation length beyond it.
  std::vector<int> at;
  for (int s : scales)
    if (s > 1 && (at.empty() || s == scales.back())) at.push_back(s);
  for (int s : at)
    t << "\n" << what << ", order at " << s << "x (" << int64_t(s) * L << " bytes):\n\n" << order_lines(c, models, s);
  return t.str();
}

void write_plot(const std::string& path, const Collected& c, const std::vector<std::string>& models,
                const std::vector<int>& scales, int L, const std::string& metric) {
  std::vector<PlotPanel> panels;
  for (const std::string& f : c.families) {
    PlotPanel p;
    p.title = f;
    for (const std::string& m : models) {
      std::vector<std::pair<double, double>> pts;
      for (int s : scales) pts.push_back({double(int64_t(s) * L), stat(c.by_family.at(f).at(m).at(s)).mean});
      p.series.push_back({attn_display_name(m), pts});
    }
    panels.push_back(p);
  }
  write_grid_svg(path, "Long-context tasks: " + metric + " against evaluation length (trained at " +
                 std::to_string(L) + " bytes)", panels, "length (bytes)", metric + ", mean over seeds", 4);
}

void check_options(const ReproOptions& o, const std::vector<std::string>& models, const std::vector<int>& scales,
                   const std::vector<double>& depths) {
  if (o.seeds.empty()) throw EngineError("seeds: expected at least one training seed");
  for (size_t i = 0; i < o.seeds.size(); ++i)
    if (std::count(o.seeds.begin(), o.seeds.begin() + int64_t(i), o.seeds[i]))
      throw EngineError("seeds: " + std::to_string(o.seeds[i]) + " is given twice");
  for (size_t i = 0; i < models.size(); ++i)
    if (std::count(models.begin(), models.begin() + int64_t(i), models[i]))
      throw EngineError("models: \"" + models[i] + "\" is given twice");
  for (const std::string& m : models) {
    try {
      (void)parse_attn_kind(m);
    } catch (const EngineError&) {
      throw EngineError("models: expected attention kinds among path, path-fox, fox, rope, nope; got \"" + m + "\"");
    }
  }
  if (scales.empty()) throw EngineError("scales: expected at least one multiple of the training length");
  for (int s : scales)
    if (s < 1 || s > 1024) throw EngineError("scales: expected multiples of the training length in [1, 1024], got " + std::to_string(s));
  for (double d : depths)
    if (!(d >= 0 && d <= 1)) {
      std::ostringstream m;
      m << "depths: expected needle depths in [0, 1], got " << d;
      throw EngineError(m.str());
    }
}

// One trained and evaluated (kind, seed): the evaluations in spec order and their JSON lines.
struct RunRecord {
  std::vector<json> evs, lines;
  double train_seconds = 0, eval_seconds = 0, steps_per_s = 0, last_loss = 0;
  bool reused = false;
};

// A finished run of the same config and evaluations, read back from <run>/long_context.json (--reuse).
bool load_run(const std::string& path, const json& config, const std::vector<EvalSpec>& specs, RunRecord* rec) {
  std::ifstream f(path);
  if (!f) return false;
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception&) {
    return false;
  }
  if (!j.is_object() || j.value("config", json()) != config || !j.contains("evaluations") ||
      !j["evaluations"].is_array() || j["evaluations"].size() != specs.size())
    return false;
  for (size_t i = 0; i < specs.size(); ++i) {
    const json& e = j["evaluations"][i];
    if (e.value("task", "") != specs[i].family || e.value("length", -1) != specs[i].task.seq_len ||
        e.value("depth", -1.0) != specs[i].depth || !e.contains("exact_match") || !e.contains("accuracy"))
      return false;
    rec->evs.push_back({{"test", {{"exact_match", e["exact_match"]}, {"accuracy", e["accuracy"]}}}});
    rec->lines.push_back(e);
  }
  rec->train_seconds = j.value("train_seconds", 0.0);
  rec->eval_seconds = j.value("eval_seconds", 0.0);
  rec->steps_per_s = j.value("steps_per_s", 0.0);
  rec->last_loss = j.value("last_loss", 0.0);
  rec->reused = true;
  return true;
}

RunRecord run_one(const RunConfig& c, const RunOptions& ro, const std::vector<EvalSpec>& specs,
                  const std::vector<TaskConfig>& tasks, int64_t max_tokens, bool reuse, const Task& mix) {
  const std::string record = ro.out_dir + "/long_context.json";
  const json config = config_to_json(resolve_config(c, mix));
  RunRecord rec;
  if (reuse && load_run(record, config, specs, &rec)) {
    std::fprintf(stderr, "%s: reusing %s\n", ro.label.c_str(), record.c_str());
    return rec;
  }
  rec = RunRecord();
  const RunResult r = train_run(c, ro);
  Progress bar(ro.label + " eval", int64_t(specs.size()), 0, ro.progress);
  rec.evs = evaluate_trained(r, tasks, max_tokens, [&](size_t i) { bar.update(int64_t(i) + 1); });
  bar.finish();
  rec.train_seconds = r.train_seconds;
  rec.eval_seconds = bar.elapsed_s();
  rec.steps_per_s = r.steps_per_s;
  rec.last_loss = r.last_loss;
  for (size_t i = 0; i < specs.size(); ++i) {
    const json& t = rec.evs[i]["test"];
    json line = {{"model", attn_kind_name(c.model.attn)}, {"seed", c.train.seed}, {"task", specs[i].family},
                 {"scale", specs[i].scale}, {"length", specs[i].task.seq_len}, {"exact_match", t["exact_match"]},
                 {"accuracy", t["accuracy"]}, {"loss", t["loss"]}, {"sequences", t["sequences"]}};
    if (specs[i].depth >= 0) line["depth"] = specs[i].depth;
    rec.lines.push_back(line);
  }
  write_file_atomic(record, json({{"config", config}, {"train_seconds", rec.train_seconds},
                                  {"eval_seconds", rec.eval_seconds}, {"steps_per_s", rec.steps_per_s},
                                  {"last_loss", rec.last_loss}, {"evaluations", rec.lines}}).dump(1) + "\n");
  return rec;
}

}  // namespace

json repro_long_context(const ReproOptions& o) {
  RunConfig base = repro_preset(o, "repro_long_context");
  const std::vector<std::string> models =
      o.models.empty() ? std::vector<std::string>{"rope", "path", "fox", "path-fox"} : o.models;
  std::vector<int> scales = o.scales;
  if (scales.empty()) scales = base.train.device == "cuda" ? std::vector<int>{1, 2, 4, 8, 16} : std::vector<int>{1, 2, 4, 8};
  const std::vector<double> depths = o.depths.empty() ? std::vector<double>{0, 0.25, 0.5, 0.75, 1} : o.depths;
  check_options(o, models, scales, depths);
  std::sort(scales.begin(), scales.end());
  scales.erase(std::unique(scales.begin(), scales.end()), scales.end());
  if (base.task.name != "mixture")
    throw EngineError("task.name: repro long-context trains on a mixture of tasks (\"mixture\"), got \"" +
                      base.task.name + "\"");
  for (size_t i = 0; i < base.task.mixture.size(); ++i) {
    const std::string name = mixture_component(base.task, i).name;
    if (!is_text_task(name))
      throw EngineError("task.mixture[" + std::to_string(i) + "].name: repro long-context evaluates the long-context "
                        "text tasks (niah, vartrack, phonebook, babi), got \"" + name + "\"");
  }
  const auto mix_task = make_task(base.task);  // checks the mixture (components, one shared length)
  base = resolve_config(base, *mix_task);
  check_device(base);  // a cuda preset on a build or machine without a GPU fails here, before any work
  const int L = base.task.seq_len;
  const std::vector<EvalSpec> specs = eval_specs(base.task, scales, depths);
  const auto matched = matched_models(base.model, models);
  std::vector<TaskConfig> tasks;
  for (const EvalSpec& e : specs) tasks.push_back(e.task);
  const std::string dir = o.out_dir.empty() ? "runs/repro_long_context" : o.out_dir;
  const int64_t max_tokens = base.train.device == "cuda" ? int64_t(1) << 17 : int64_t(1) << 13;

  json results = {{"config", config_to_json(base)}, {"scales", scales}, {"depths", depths}, {"seeds", o.seeds},
                  {"models", json::array()}, {"runs", json::array()}};
  for (const std::string& m : models)
    results["models"].push_back({{"model", m}, {"mlp_hidden", matched.at(m).mlp_hidden},
                                 {"params", param_count(matched.at(m))}});
  std::string lines;
  Collected col, col_acc;
  std::map<std::string, std::vector<double>> train_s, eval_s, loss, sps;
  for (const std::string& m : models) {
    for (uint64_t seed : o.seeds) {
      RunConfig c = base;
      c.model = matched.at(m);
      c.train.seed = seed;
      RunOptions ro;
      ro.out_dir = dir + "/" + m + "_s" + std::to_string(seed);
      ro.progress = o.progress;
      ro.label = attn_display_name(m) + " s" + std::to_string(seed);
      const RunRecord rec = run_one(c, ro, specs, tasks, max_tokens, o.reuse, *mix_task);
      const auto& evs = rec.evs;
      std::string run_lines;
      for (const json& line : rec.lines) run_lines += line.dump() + "\n";
      write_file_atomic(ro.out_dir + "/long_context.jsonl", run_lines);
      lines += run_lines;
      write_file_atomic(dir + "/results.jsonl", lines);  // kept current, so a stopped run leaves what it measured
      collect_run(specs, evs, m, "exact_match", &col);
      collect_run(specs, evs, m, "accuracy", &col_acc);
      train_s[m].push_back(rec.train_seconds);
      eval_s[m].push_back(rec.eval_seconds);
      loss[m].push_back(rec.last_loss);
      sps[m].push_back(rec.steps_per_s);
      results["runs"].push_back({{"model", m}, {"seed", seed}, {"dir", ro.out_dir}, {"train_seconds", rec.train_seconds},
                                 {"eval_seconds", rec.eval_seconds}, {"steps_per_s", rec.steps_per_s},
                                 {"last_loss", rec.last_loss}, {"reused", rec.reused}});
    }
  }

  std::ostringstream t, mixdesc;
  for (size_t i = 0; i < base.task.mixture.size(); ++i)
    mixdesc << (i ? ", " : "") << mixture_label(base.task, i) << " (" << base.task.mixture[i].weight << ")";
  t << "Long-context tasks at multiples of the training length " << L << " bytes, " << o.seeds.size()
    << " seed(s) per kind. " << base.model.n_layer << " layers, width "
    << base.model.d_model << ", " << base.model.n_head << " heads; " << base.train.steps << " steps x "
    << base.train.batch_size << " sequences on the mixture " << mixdesc.str() << "; " << base.task.eval_sequences
    << " test examples per cell and seed (niah_single: the mean over needle depths).\n\n";
  t << tables(col, models, scales, L, "Exact match % (every byte of the answer right)") << "\n"
    << tables(col_acc, models, scales, L, "Answer-byte accuracy %");
  t << "\nModels (equal parameter counts through the MLP width):\n\n"
    << "| model | MLP width | parameters | final training loss | train time | steps/s | evaluation time |\n"
    << "|---|---|---|---|---|---|---|\n";
  for (const std::string& m : models) {
    char b[64];
    std::snprintf(b, sizeof b, "%.4f", stat(loss[m]).mean);
    t << "| " << attn_display_name(m) << " | " << matched.at(m).mlp_hidden << " | " << param_count(matched.at(m))
      << " | " << b << " | " << format_duration(stat(train_s[m]).mean) << " | ";
    std::snprintf(b, sizeof b, "%.2f", stat(sps[m]).mean);
    t << b << " | " << format_duration(stat(eval_s[m]).mean) << " |\n";
  }
  t << "\n(times are means per run)\n";
  std::fputs(t.str().c_str(), stdout);
  std::fflush(stdout);
  json summary = json::object();  // {metric: {task: {model: {scale: {mean, sd, n}}}}}
  for (const auto& [name, cc] : {std::pair<const char*, const Collected*>{"exact_match", &col}, {"accuracy", &col_acc}})
    for (const auto& [f, per_model] : cc->by_family)
      for (const auto& [m, per_scale] : per_model)
        for (const auto& [sc, v] : per_scale) {
          const Stat st = stat(v);
          summary[name][f][m][std::to_string(sc)] = {{"mean", st.mean}, {"sd", st.sd}, {"n", st.n}};
        }
  results["summary"] = summary;
  write_file_atomic(dir + "/table.md", t.str());
  write_file_atomic(dir + "/results.json", results.dump(2) + "\n");
  write_plot(dir + "/plot.svg", col, models, scales, L, "exact match");
  write_plot(dir + "/plot_accuracy.svg", col_acc, models, scales, L, "answer-byte accuracy");
  return results;
}

}  // namespace pathattn::engine
