// apps/cmd_engine.cpp: the engine's subcommands: `pathattn train | eval | sample |
// repro {flipflop,a5,mqrar,long-context} | tasks show | convert | export-hf | import-hf`.
// Thin wrappers over src/engine (run.h, repro.h); every engine error is printed as "error: <message>" with
// exit code 1.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "engine/config.h"
#include "engine/convert.h"
#include "engine/embedded.h"
#include "engine/hf.h"
#include "engine/lengths.h"
#include "engine/longctx.h"
#include "engine/repro.h"
#include "engine/run.h"

namespace pathattn::app {
namespace {

using nlohmann::json;
using namespace pathattn::engine;

// Training runs many short OpenMP regions (BLAS calls, the attention op). libgomp's default lets idle
// threads spin between regions, which on a machine shared with other work steals the cores the busy thread
// needs: measured on two loaded cores, a flip-flop step took 0.72 s with the default and 0.21 s passive.
// libgomp reads OMP_WAIT_POLICY only at start-up, so the engine commands re-execute themselves once with
// OMP_WAIT_POLICY=passive unless the user chose a policy.
void ensure_passive_wait_policy() {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t i = 0; i < all.size();) {
    const size_t j = all.find('\0', i);
    args.push_back(all.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  if (args.empty()) return;
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::setenv("OMP_WAIT_POLICY", "passive", 1);
  ::execv("/proc/self/exe", argv.data());  // returns only on failure: then continue in this process
}

template <typename F>
void guarded(int* exit_code, F&& f) {
  ensure_passive_wait_policy();
  try {
    f();
    *exit_code = 0;
  } catch (const EngineError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    *exit_code = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    *exit_code = 1;
  }
}

struct TrainArgs {
  std::string config, preset, out, resume, device;
  std::vector<std::string> sets;
  int64_t stop_after = -1;
  bool no_progress = false;
};

struct EvalArgs {
  std::string checkpoint, backend = "cpu", device;
  int batch = 32, threads = 0;
  std::vector<int64_t> seq_lens;
  int64_t sequences = 0, bucket = 0, tokens = 0;
};

struct SampleArgs {
  std::string checkpoint, prompt, backend = "cpu";
  int tokens = 200, top_k = 0, threads = 0;
  double temperature = 1.0;
  uint64_t seed = 1;
};

struct HfArgs {
  std::string checkpoint, dir, config, preset;
  std::vector<std::string> sets;
};

struct ConvertArgs {
  std::string checkpoint, out, attn;
  std::vector<std::string> sets;
  double beta_bias = -3.0, gate_bias = 5.0;
  uint64_t seed = 0;
};

struct ShowArgs {
  std::string name;
  std::vector<std::string> sets;
  int64_t index = 0, step = -1, row = 0;
  bool json = false;
};

struct ReproArgs {
  std::string out, preset, device;
  std::vector<std::string> sets, models;
  std::vector<uint64_t> seeds;
  std::vector<int> lengths, n_backs, scales;
  std::vector<double> depths;
  int max_layers = 4;
  bool small = false, no_progress = false, reuse = false;
};

void add_repro(CLI::App& repro, const std::string& name, const std::string& help, std::shared_ptr<ReproArgs> a,
               int* exit_code) {
  CLI::App* c = repro.add_subcommand(name, help);
  std::string stem = "repro_" + name;  // configs/<stem>.json; long-context -> repro_long_context
  std::replace(stem.begin(), stem.end(), '-', '_');
  c->add_option("--out", a->out, "Output directory (default runs/" + stem + ")");
  c->add_option("--preset", a->preset, "Embedded config to start from (default " + stem + ")");
  c->add_option("--set", a->sets, "Override a config key: section.key=value (repeatable)");
  c->add_option("--models", a->models, "Attention kinds to train (path, path-fox, fox, rope, nope)")->delimiter(',');
  c->add_option("--seeds", a->seeds, "Training seeds (flipflop: each model is trained once per seed)")
      ->delimiter(',')
      ->check(non_negative_int());  // else "-1" would wrap to 2^64 - 1
  c->add_option("--device", a->device, "Train on cpu or cuda (overrides train.device)");
  c->add_flag("--no-progress", a->no_progress, "No progress bar");
  if (name == "a5") {
    c->add_option("--lengths", a->lengths, "Word lengths (default 5,10,15,20)")->delimiter(',');
    c->add_option("--max-layers", a->max_layers, "Deepest model tried (default 4)")->check(CLI::Range(1, 256));
  }
  if (name == "mqrar") c->add_option("--n", a->n_backs, "N values (default 1,2,3,4)")->delimiter(',');
  if (name == "long-context") {
    c->add_option("--scales", a->scales, "Evaluation lengths as multiples of the training length (default 1,2,4,8; "
                                         "1,2,4,8,16 when training on cuda)")->delimiter(',');
    c->add_option("--depths", a->depths, "Needle depths of niah single (default 0,0.25,0.5,0.75,1)")->delimiter(',');
    c->add_flag("--reuse", a->reuse, "Read back finished runs of the same config in --out instead of training them "
                                     "again (to run the command in pieces, e.g. one --models at a time)");
  }
  if (name != "flipflop") c->add_flag("--small", a->small, "Use the small CPU preset (" + stem + "_small)");
  c->callback([a, name, stem, exit_code] {
    guarded(exit_code, [&] {
      if (a->small && !a->preset.empty()) throw EngineError("give --small or --preset, not both");
      ReproOptions o;
      o.out_dir = a->out;
      o.preset = a->preset.empty() && a->small ? stem + "_small" : a->preset;
      o.overlay = overlay_from_sets(a->sets);
      o.models = a->models;
      if (!a->seeds.empty()) o.seeds = a->seeds;
      else if (name == "long-context" && !a->small) o.seeds = {1, 2, 3};
      o.lengths = a->lengths;
      o.max_layers = a->max_layers;
      o.n_backs = a->n_backs;
      o.scales = a->scales;
      o.depths = a->depths;
      o.reuse = a->reuse;
      o.progress = !a->no_progress;
      o.device = a->device;
      if (name == "flipflop") repro_flipflop(o);
      else if (name == "a5") repro_a5(o);
      else if (name == "mqrar") repro_mqrar(o);
      else repro_long_context(o);
    });
  });
}

}  // namespace

void register_engine(CLI::App& app, int* exit_code) {
  // train
  auto ta = std::make_shared<TrainArgs>();
  CLI::App* train = app.add_subcommand("train", "Train a model from a JSON config (docs/engine.md lists every key)");
  train->add_option("--config", ta->config, "Config file (JSON)");
  train->add_option("--preset", ta->preset, "Embedded config to start from (e.g. repro_flipflop)");
  train->add_option("--set", ta->sets, "Override a config key: section.key=value (repeatable)");
  train->add_option("--out", ta->out, "Run directory (default runs/<task>_<attn>)");
  train->add_option("--resume", ta->resume, "Continue from this checkpoint (its config is used; same directory)");
  train->add_option("--stop-after", ta->stop_after, "Stop after this many steps (writes a checkpoint)");
  train->add_option("--device", ta->device,
                    "Train on cpu or cuda (overrides train.device, also a resumed checkpoint's)");
  train->add_flag("--no-progress", ta->no_progress, "No progress bar");
  train->callback([ta, exit_code] {
    guarded(exit_code, [&] {
      RunOptions ro;
      ro.stop_after = ta->stop_after;
      ro.progress = !ta->no_progress;
      ro.device = ta->device;
      RunConfig cfg;
      if (!ta->resume.empty()) {
        if (!ta->config.empty() || !ta->preset.empty() || !ta->sets.empty())
          throw EngineError("--resume continues with the checkpoint's own config; drop --config/--preset/--set");
        ro.resume = ta->resume;
        const auto slash = ta->resume.find_last_of('/');
        ro.out_dir = ta->out.empty() ? (slash == std::string::npos ? "." : ta->resume.substr(0, slash)) : ta->out;
      } else {
        if (!ta->config.empty() && !ta->preset.empty()) throw EngineError("give --config or --preset, not both");
        if (!ta->config.empty()) cfg = load_config_file(ta->config);
        else if (!ta->preset.empty())
          cfg = parse_config_text(embedded_config(ta->preset), "embedded config " + ta->preset);
        cfg = overlay_config(cfg, overlay_from_sets(ta->sets));
        ro.out_dir = ta->out.empty() ? "runs/" + cfg.task.name + "_" + attn_kind_name(cfg.model.attn) : ta->out;
      }
      const RunResult r = train_run(cfg, ro);
      json summary = {{"dir", ro.out_dir}, {"steps_done", r.steps_done}, {"finished", r.finished},
                      {"last_loss", r.last_loss}, {"steps_per_s", r.steps_per_s}, {"train_seconds", r.train_seconds}};
      if (r.finished) summary["eval"] = r.eval;
      std::printf("%s\n", summary.dump().c_str());
    });
  });

  // eval
  auto ea = std::make_shared<EvalArgs>();
  CLI::App* eval = app.add_subcommand("eval", "Evaluate a checkpoint on its task's test sets (prints JSON)");
  eval->add_option("checkpoint", ea->checkpoint, "Checkpoint (.safetensors)")->required();
  eval->add_option("--batch", ea->batch, "Sequences per forward (default 32)")->check(CLI::Range(1, 1 << 20));
  eval->add_option("--backend", ea->backend, "Attention backend: cpu or oracle");
  eval->add_option("--threads", ea->threads, "Attention threads (0: default)")->check(CLI::Range(0, 1024));
  eval->add_option("--device", ea->device, "Evaluate on cpu or cuda (default: the checkpoint's train.device, or cpu where no GPU is usable)");
  eval->add_option("--seq-len", ea->seq_lens,
                   "Evaluate at these task.seq_len values instead (comma-separated; loss per position bucket)")
      ->delimiter(',');
  eval->add_option("--sequences", ea->sequences, "With --seq-len: windows per length (default task.eval_sequences)")
      ->check(non_negative_int());
  eval->add_option("--tokens", ea->tokens,
                   "With --seq-len: scored positions per length (windows = ceil(tokens / positions per window))")
      ->check(non_negative_int());
  eval->add_option("--bucket", ea->bucket, "With --seq-len: positions per loss bucket (default the training seq_len)")
      ->check(non_negative_int());
  eval->callback([ea, eval, exit_code] {
    guarded(exit_code, [&] {
      if (!ea->seq_lens.empty()) {
        if (!ea->device.empty() && ea->device != "cpu")
          throw EngineError("--seq-len evaluates on the cpu device; drop --device " + ea->device);
        LengthEvalOptions o;
        o.seq_lens = ea->seq_lens;
        o.sequences = ea->sequences;
        o.tokens = ea->tokens;
        o.bucket = ea->bucket;
        if (eval->count("--batch") > 0) o.batch = ea->batch;
        o.backend = parse_backend(ea->backend);
        o.threads = ea->threads;
        std::printf("%s\n", evaluate_lengths(ea->checkpoint, o).dump(2).c_str());
        return;
      }
      if (ea->sequences > 0 || ea->bucket > 0 || ea->tokens > 0)
        throw EngineError("--sequences, --tokens and --bucket go with --seq-len");
      const json r = evaluate_checkpoint(ea->checkpoint, ea->batch, parse_backend(ea->backend), ea->threads,
                                         ea->device);
      std::printf("%s\n", r.dump(2).c_str());
    });
  });

  // sample
  auto sa = std::make_shared<SampleArgs>();
  CLI::App* sample = app.add_subcommand("sample", "Sample a continuation from a checkpoint");
  sample->add_option("checkpoint", sa->checkpoint, "Checkpoint (.safetensors)")->required();
  sample->add_option("--prompt", sa->prompt, "Prompt (bytes task: text; others: space-separated tokens)");
  sample->add_option("--tokens", sa->tokens, "Tokens to generate (default 200)")->check(non_negative_int());
  sample->add_option("--temperature", sa->temperature, "Softmax temperature; 0 = greedy (default 1)");
  sample->add_option("--top-k", sa->top_k, "Sample among the k most likely tokens; 0 = all (default 0)")
      ->check(non_negative_int());
  sample->add_option("--seed", sa->seed, "Sampling seed (default 1)")->check(non_negative_int());
  sample->add_option("--backend", sa->backend, "Attention backend: cpu or oracle");
  sample->add_option("--threads", sa->threads, "Attention threads (0: default)")->check(CLI::Range(0, 1024));
  sample->callback([sa, exit_code] {
    guarded(exit_code, [&] {
      const std::string s = sample_checkpoint(sa->checkpoint, sa->prompt, sa->tokens, sa->temperature, sa->top_k,
                                              sa->seed, sa->backend, sa->threads);
      std::printf("%s%s\n", sa->prompt.c_str(), s.c_str());
    });
  });

  // export-hf / import-hf (engine/hf.h)
  auto ex = std::make_shared<HfArgs>();
  CLI::App* exp = app.add_subcommand("export-hf", "Write a checkpoint as a Hugging Face PaTH model directory "
                                     "(config.json + model.safetensors, loadable by pathattn.models and fla)");
  exp->add_option("checkpoint", ex->checkpoint, "Engine checkpoint (.safetensors)")->required();
  exp->add_option("dir", ex->dir, "Output directory")->required();
  exp->callback([ex, exit_code] {
    guarded(exit_code, [&] {
      export_hf(ex->checkpoint, ex->dir);
      std::printf("%s\n", json({{"checkpoint", ex->checkpoint}, {"dir", ex->dir}}).dump().c_str());
    });
  });
  auto im = std::make_shared<HfArgs>();
  CLI::App* imp = app.add_subcommand("import-hf", "Make an engine checkpoint (step 0) from a Hugging Face PaTH "
                                     "model directory; task and train sections from --config / --preset / --set");
  imp->add_option("dir", im->dir, "Hugging Face model directory (config.json + model.safetensors)")->required();
  imp->add_option("checkpoint", im->checkpoint, "Engine checkpoint to write (.safetensors)")->required();
  imp->add_option("--config", im->config, "Config file (JSON) for the task and train sections");
  imp->add_option("--preset", im->preset, "Embedded config for the task and train sections");
  imp->add_option("--set", im->sets, "Override a task / train key: section.key=value (repeatable)");
  imp->callback([im, exit_code] {
    guarded(exit_code, [&] {
      if (!im->config.empty() && !im->preset.empty()) throw EngineError("give --config or --preset, not both");
      RunConfig base;
      if (!im->config.empty()) base = load_config_file(im->config);
      else if (!im->preset.empty())
        base = parse_config_text(embedded_config(im->preset), "embedded config " + im->preset);
      base = overlay_config(base, overlay_from_sets(im->sets));
      import_hf(im->dir, im->checkpoint, base);
      std::printf("%s\n", json({{"dir", im->dir}, {"checkpoint", im->checkpoint}}).dump().c_str());
    });
  });

  // convert
  auto ca = std::make_shared<ConvertArgs>();
  CLI::App* convert = app.add_subcommand(
      "convert", "Turn a checkpoint into one of another attention kind for continued training (docs/engine.md)");
  convert->add_option("checkpoint", ca->checkpoint, "Source checkpoint (.safetensors), e.g. a rope model")->required();
  convert->add_option("--attn", ca->attn, "Target attention kind: path, path-fox, fox, rope, nope")->required();
  convert->add_option("--out", ca->out, "Converted checkpoint to write")->required();
  convert->add_option("--set", ca->sets, "Override a config key of the target: section.key=value (repeatable)");
  convert->add_option("--beta-bias", ca->beta_bias, "Initial b_beta of new PaTH layers, W_beta = 0 (default -3)");
  convert->add_option("--gate-bias", ca->gate_bias, "Initial b_g of new forget gates, W_g = 0 (default 5)");
  convert->add_option("--seed", ca->seed, "Seed of the new w projections and conv (default train.seed)")
      ->check(non_negative_int());
  convert->callback([ca, exit_code] {
    guarded(exit_code, [&] {
      ConvertOptions o;
      o.attn = ca->attn;
      o.overlay = overlay_from_sets(ca->sets);
      o.beta_bias = ca->beta_bias;
      o.gate_bias = ca->gate_bias;
      o.seed = ca->seed;
      const ConvertResult r = convert_checkpoint(ca->checkpoint, ca->out, o);
      const json j = {{"out", ca->out}, {"attn", attn_kind_name(r.config.model.attn)}, {"carried", r.carried.size()},
                      {"initialised", r.initialised}, {"dropped", r.dropped}, {"steps", r.config.train.steps},
                      {"seed", r.config.train.seed}};
      std::printf("%s\n", j.dump().c_str());
    });
  });

  // tasks show
  auto sh = std::make_shared<ShowArgs>();
  CLI::App* tasks = app.add_subcommand("tasks", "Inspect the task generators (docs/tasks.md)");
  tasks->require_subcommand(1);
  CLI::App* show = tasks->add_subcommand("show", "Print one example of a long-context text task (niah, vartrack, "
                                                 "phonebook, babi)");
  show->add_option("name", sh->name, "Task name")->required();
  show->add_option("--set", sh->sets, "Override a task key: task.key=value (repeatable)");
  show->add_option("--index", sh->index, "Test example to print (default 0)")->check(non_negative_int());
  show->add_option("--step", sh->step, "Print the training example of this step instead")->check(non_negative_int());
  show->add_option("--row", sh->row, "Batch row of the training example (default 0)")->check(non_negative_int());
  show->add_flag("--json", sh->json, "Print the example as JSON (prompt, answer, padding, inserted records)");
  show->callback([sh, exit_code] {
    guarded(exit_code, [&] {
      json ov = overlay_from_sets(sh->sets);
      ov["task"]["name"] = sh->name;
      const RunConfig cfg = overlay_config(RunConfig(), ov);
      if (!is_text_task(cfg.task.name))
        throw EngineError("tasks show: \"" + sh->name + "\" is not one of niah, vartrack, phonebook, babi");
      const bool train = sh->step >= 0;
      const uint64_t seed = train ? cfg.train.seed : cfg.task.data_seed;
      const uint64_t a = train ? uint64_t(sh->step) : 500, b = uint64_t(train ? sh->row : sh->index);
      const TextExample ex = text_example(cfg.task, seed, a, b);
      const int64_t L = int64_t(ex.prompt.size() + ex.answer.size()) + ex.pad;
      if (sh->json) {
        json items = json::array();
        for (const Inserted& it : ex.items) items.push_back({it.offset, it.length, it.slot});
        const json j = {{"task", cfg.task.name}, {"seed", seed}, {"a", a}, {"b", b}, {"prompt", ex.prompt},
                        {"answer", ex.answer}, {"pad", ex.pad}, {"context_len", ex.context_len},
                        {"n_sentences", ex.n_sentences}, {"items", items}};
        std::printf("%s\n", j.dump().c_str());
        return;
      }
      std::printf("# %s: %s example %lld (seed %llu), task.seq_len %lld\n", cfg.task.name.c_str(),
                  train ? "training" : "test", (long long)(train ? sh->step : sh->index), (unsigned long long)seed,
                  (long long)L);
      std::printf("%s%s", ex.prompt.c_str(), ex.answer.c_str());
      std::string shown;
      for (char ch : ex.answer) shown += ch == '\n' ? std::string("\\n") : std::string(1, ch);
      std::printf("# answer span: bytes [%zu, %zu), \"%s\"; %lld padding bytes follow; %lld haystack sentences, "
                  "%zu inserted records\n", ex.prompt.size(), ex.prompt.size() + ex.answer.size(), shown.c_str(),
                  (long long)ex.pad, (long long)ex.n_sentences, ex.items.size());
    });
  });

  // repro
  CLI::App* repro = app.add_subcommand("repro", "Reproduce the paper's synthetic results (docs/reproductions.md)");
  repro->require_subcommand(1);
  add_repro(*repro, "flipflop", "Flip-flop LM, Table 1: PaTH vs RoPE at 1 layer, 2 heads, width 64",
            std::make_shared<ReproArgs>(), exit_code);
  add_repro(*repro, "a5", "A5 word problem, Figure 2: fewest layers solving each length",
            std::make_shared<ReproArgs>(), exit_code);
  add_repro(*repro, "mqrar", "MQRAR-N, Figure 2: accuracy per N", std::make_shared<ReproArgs>(), exit_code);
  add_repro(*repro, "long-context",
            "RoPE, PaTH, FoX, PaTH-FoX trained on a mixture of the long-context tasks, evaluated at 1x to 8x (16x) "
            "the training length", std::make_shared<ReproArgs>(), exit_code);
}

}  // namespace pathattn::app
