// tests/cpp/test_engine_mixture.cpp: the mixture task (engine/tasks.cpp) and `repro long-context`
// (engine/repro_longctx.cpp). Rows come from the components in proportion to the weights, each one exactly the
// component's example from the row's own stream; test sets are the components'; components inherit the
// mixture's keys; bad settings name the key; the repro command checks its arguments before any work and, on a
// tiny preset, writes one JSON line per evaluation, the tables and the plots, with equal parameter counts.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/embedded.h"
#include "engine/repro.h"
#include "engine/rng.h"
#include "engine/run.h"
#include "engine/tasks.h"
#include "engine_fixtures.h"

namespace pathattn::engine {
namespace {

using test::expect_error;

using nlohmann::json;

const auto* const kSingleThreaded = ::testing::AddGlobalTestEnvironment(new test::SingleThreadedBlas);

TaskConfig task_of(const std::string& json_text) {
  return parse_config_text(json_text, "test config").task;
}

// niah single (weight 3), phonebook (1) and babi qa1 (0) at 300 bytes.
const char* const kMix = R"({"task": {"name": "mixture", "seq_len": 300, "eval_sequences": 5, "mixture": [
    {"name": "niah", "weight": 3}, {"name": "phonebook", "weight": 1, "eval_sequences": 7},
    {"name": "babi", "weight": 0, "n_facts": 3}]}})";

std::string row_text(const Batch& b, int64_t r) {
  std::string s;
  for (int64_t t = 0; t < b.T; ++t) s += char(b.tokens[size_t(r * b.T + t)]);
  return s;
}

TEST(EngineMixture, RowsComeFromTheComponentsByWeight) {
  const TaskConfig c = task_of(kMix);
  const auto task = make_task(c);
  Batch b;
  task->train_batch(7, 3, 400, &b);
  int niah = 0, phone = 0;
  for (int64_t r = 0; r < b.B; ++r) {
    const std::string s = row_text(b, r);
    const bool is_niah = s.find("special magic number") != std::string::npos;
    const bool is_phone = s.find("What is the number of") != std::string::npos;
    EXPECT_NE(is_niah, is_phone) << "row " << r << ": " << s;
    EXPECT_EQ(s.find("Where is"), std::string::npos) << "a component of weight 0 was drawn, row " << r;
    niah += is_niah;
    phone += is_phone;
  }
  EXPECT_EQ(niah + phone, 400);
  // Expected 300 of 400 niah rows (binomial sd 8.7): a window of about 3.5 sd.
  EXPECT_GT(niah, 270);
  EXPECT_LT(niah, 330);
}

// The documented draw order: the row's stream gives u first (the component), then the component draws its row.
TEST(EngineMixture, EachRowIsTheComponentsExampleFromTheRowsStream) {
  const TaskConfig c = task_of(kMix);
  const auto task = make_task(c);
  std::vector<std::unique_ptr<Task>> parts;
  for (size_t i = 0; i < c.mixture.size(); ++i) parts.push_back(make_task(mixture_component(c, i)));
  const uint64_t seed = 11;
  const int64_t step = 5, B = 12, T = task->model_len();
  Batch b, b_small;
  task->train_batch(seed, step, B, &b);
  task->train_batch(seed, step, 4, &b_small);
  for (int64_t r = 0; r < B; ++r) {
    Rng rng(mix_seed(seed, uint64_t(step), uint64_t(r)));
    const double u = rng.uniform() * 4.0;  // total weight 3 + 1 + 0
    const size_t k = u < 3.0 ? 0 : 1;
    std::vector<int32_t> tok(size_t(T), 0), tgt(size_t(T), -1);
    parts[k]->train_example(rng, step, tok.data(), tgt.data());
    EXPECT_TRUE(std::equal(tok.begin(), tok.end(), b.tokens.begin() + r * T)) << "row " << r;
    EXPECT_TRUE(std::equal(tgt.begin(), tgt.end(), b.targets.begin() + r * T)) << "row " << r;
    if (r < 4) {  // a row does not depend on the batch size
      EXPECT_TRUE(std::equal(b_small.tokens.begin() + r * T, b_small.tokens.begin() + (r + 1) * T, b.tokens.begin() + r * T));
    }
  }
}

TEST(EngineMixture, TestSetsAreTheComponentsOwn) {
  const TaskConfig c = task_of(kMix);
  const auto task = make_task(c);
  const auto sets = task->eval_sets();
  ASSERT_EQ(sets.size(), 3u);
  EXPECT_EQ(sets[0].name, "niah_single");
  EXPECT_EQ(sets[1].name, "phonebook");
  EXPECT_EQ(sets[2].name, "babi_qa1");
  EXPECT_EQ(sets[0].size, 5);  // inherited from the mixture
  EXPECT_EQ(sets[1].size, 7);  // the component's own
  EXPECT_TRUE(task->reports_exact_match());
  EXPECT_EQ(task->vocab_size(), 256);
  const size_t n = size_t(task->model_len());
  for (int s = 0; s < 3; ++s) {
    const auto part = make_task(mixture_component(c, size_t(s)));
    for (int64_t i = 0; i < 3; ++i) {
      std::vector<int32_t> a(n, 0), at(n, 0), p(n, 0), pt(n, 0);
      task->eval_example(s, i, a.data(), at.data());
      part->eval_example(0, i, p.data(), pt.data());
      EXPECT_EQ(a, p) << sets[size_t(s)].name << " example " << i;
      EXPECT_EQ(at, pt) << sets[size_t(s)].name << " example " << i;
    }
  }
}

// Components take the mixture's keys at the time the task is built, so an override of the mixture's length
// reaches every component that does not set its own; the config round-trips through its JSON form.
TEST(EngineMixture, ComponentsInheritTheMixturesKeys) {
  RunConfig rc = parse_config_text(kMix, "mix");
  rc = overlay_config(rc, json::parse(R"({"task": {"seq_len": 500, "haystack": "text"}})"));
  const TaskConfig c0 = mixture_component(rc.task, 0), c2 = mixture_component(rc.task, 2);
  EXPECT_EQ(c0.seq_len, 500);
  EXPECT_EQ(c0.haystack, "text");
  EXPECT_EQ(c0.name, "niah");
  EXPECT_EQ(c2.n_facts, 3);
  EXPECT_TRUE(c0.mixture.empty());
  EXPECT_EQ(make_task(rc.task)->model_len(), 499);
  const json j = config_to_json(rc);
  const RunConfig back = parse_config(j);
  EXPECT_EQ(config_to_json(back), j);
  ASSERT_EQ(back.task.mixture.size(), 3u);
  EXPECT_EQ(back.task.mixture[0].weight, 3.0);
  EXPECT_EQ(back.task.mixture[2].weight, 0.0);
  // A label names the test set.
  RunConfig lab = overlay_config(rc, json::parse(R"({"task": {"mixture": [{"name": "niah", "label": "needle"}]}})"));
  EXPECT_EQ(make_task(lab.task)->eval_sets()[0].name, "needle");
}

TEST(EngineMixture, BadSettingsNameTheKey) {
  auto mix = [](const std::string& components, const std::string& extra = "\"seq_len\": 300") {
    return "{\"task\": {\"name\": \"mixture\", " + extra + ", \"mixture\": [" + components + "]}}";
  };
  auto build = [](const std::string& text) { return [text] { make_task(parse_config_text(text, "cfg").task); }; };
  expect_error(build(mix(R"({"name": "niah", "bogus": 1})")), {"task.mixture[0].bogus: unknown key"});
  expect_error(build(mix(R"({"niah_variant": "single"})")), {"task.mixture[0].name"});
  expect_error(build(mix(R"({"name": "niah"}, {"name": "mixture"})")), {"task.mixture[1].name"});
  expect_error(build(mix(R"({"name": "niah", "weight": -1})")), {"task.mixture[0].weight"});
  expect_error(build(mix(R"({"name": "niah", "weight": 0})")), {"task.mixture", "weights sum to 0"});
  expect_error(build(mix("")), {"task.mixture", "at least one component"});
  expect_error(build(mix(R"(3)")), {"task.mixture[0]", "JSON object"});
  expect_error(build("{\"task\": {\"name\": \"mixture\", \"seq_len\": 300, \"mixture\": 5}}"), {"task.mixture"});
  expect_error(build(mix(R"({"name": "niah"})", "\"seq_len\": 0")), {"task.seq_len", "explicit length"});
  expect_error(build(mix(R"({"name": "niah"}, {"name": "phonebook", "seq_len": 400})")),
               {"task.mixture[1].seq_len", "share one length"});
  expect_error(build(mix(R"({"name": "niah"}, {"name": "niah"})")), {"task.mixture[1].label", "niah_single"});
  expect_error(build(mix(R"({"name": "niah"}, {"name": "babi", "n_facts": 40})")),
               {"task.mixture[1] (babi_qa1)", "task.seq_len"});
}

// A run on a mixture trains and reports one test set per component.
TEST(EngineMixture, TrainsAndEvaluatesPerComponent) {
  RunConfig c = parse_config_text(kMix, "mix");
  c.model.d_model = 16;
  c.model.head_dim = 8;
  c.train.steps = 3;
  c.train.batch_size = 4;
  c.train.threads = 1;
  RunOptions ro;
  ro.progress = false;
  const RunResult r = train_run(c, ro);
  ASSERT_TRUE(r.finished);
  for (const char* s : {"niah_single", "phonebook", "babi_qa1"}) {
    ASSERT_TRUE(r.eval.contains(s)) << r.eval.dump();
    EXPECT_TRUE(r.eval[s].contains("exact_match"));
  }
  EXPECT_EQ(r.eval["phonebook"]["sequences"].get<int64_t>(), 7);
}

// ---------------------------------------------------------------------------------------------------
// repro long-context

ReproOptions tiny_repro(const std::string& dir) {
  ReproOptions o;
  o.out_dir = dir;
  o.preset = "repro_long_context_small";
  o.progress = false;
  o.overlay = json::parse(R"({"model": {"d_model": 16, "head_dim": 8, "n_layer": 1},
                              "task": {"eval_sequences": 2}, "train": {"steps": 2, "batch_size": 2, "threads": 1}})");
  return o;
}

TEST(EngineReproLongContext, ArgumentsCheckedBeforeAnyWork) {
  const std::string dir = test::temp_dir("lc_args");
  ReproOptions o = tiny_repro(dir + "/out");
  auto with = [&](auto change) {
    ReproOptions x = o;
    change(x);
    return [x] { repro_long_context(x); };
  };
  expect_error(with([](ReproOptions& x) { x.scales = {1, 0}; }), {"scales", "got 0"});
  expect_error(with([](ReproOptions& x) { x.scales = {4096}; }), {"scales", "got 4096"});
  expect_error(with([](ReproOptions& x) {
                 x.scales = {1000};
                 x.overlay["task"]["seq_len"] = 2048;
               }),
               {"scales", "exceeds the longest task length"});
  expect_error(with([](ReproOptions& x) { x.depths = {0.5, 1.5}; }), {"depths", "1.5"});
  expect_error(with([](ReproOptions& x) { x.models = {"path", "bogus"}; }), {"models", "bogus"});
  expect_error(with([](ReproOptions& x) { x.seeds.clear(); }), {"seeds"});
  expect_error(with([](ReproOptions& x) { x.seeds = {1, 2, 1}; }), {"seeds", "1 is given twice"});
  expect_error(with([](ReproOptions& x) { x.models = {"path", "rope", "path"}; }), {"models", "\"path\" is given twice"});
  expect_error(with([](ReproOptions& x) { x.overlay["task"]["name"] = "niah"; }), {"task.name", "mixture"});
  expect_error(with([](ReproOptions& x) {
                 x.overlay["task"]["mixture"] = json::parse(R"([{"name": "niah"}, {"name": "a5", "seq_len": 256}])");
               }),
               {"task.mixture[1].name", "a5"});
  expect_error(with([](ReproOptions& x) { x.overlay["task"]["seq_len"] = 150; }), {"task.seq_len"});
  expect_error(with([](ReproOptions& x) { x.preset = "no_such_preset"; }), {"no_such_preset"});
  EXPECT_FALSE(std::filesystem::exists(dir + "/out")) << "a run started before the arguments were checked";
}

TEST(EngineReproLongContext, WritesEveryEvaluationTablesAndPlots) {
  const std::string dir = test::temp_dir("lc_run");
  ReproOptions o = tiny_repro(dir);
  o.models = {"rope", "path-fox"};
  o.seeds = {1, 2};
  o.scales = {2, 1};
  o.depths = {0, 1};
  const json res = repro_long_context(o);
  // 9 components; niah single at 2 depths: 10 evaluations per scale, 2 scales, 2 models x 2 seeds.
  std::ifstream f(dir + "/results.jsonl");
  std::map<std::string, int> per_task;
  int lines = 0;
  for (std::string line; std::getline(f, line);) {
    const json j = json::parse(line);
    ++lines;
    per_task[j["task"].get<std::string>()]++;
    EXPECT_EQ(j["length"].get<int>(), 256 * j["scale"].get<int>());
    EXPECT_GE(j["exact_match"].get<double>(), 0.0);
    EXPECT_LE(j["exact_match"].get<double>(), j["accuracy"].get<double>() + 1e-12);
    EXPECT_EQ(j["sequences"].get<int>(), 2);
  }
  EXPECT_EQ(lines, 2 * 2 * 2 * 10);
  EXPECT_EQ(per_task["niah_single"], 2 * 2 * 2 * 2);
  EXPECT_EQ(per_task["babi_qa3"], 2 * 2 * 2);
  for (const char* run : {"rope_s1", "rope_s2", "path-fox_s1", "path-fox_s2"})
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + std::string(run) + "/long_context.jsonl")) << run;
  for (const char* file : {"table.md", "results.json", "plot.svg", "plot_accuracy.svg"})
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + file)) << file;
  std::ifstream tf(dir + "/table.md");
  std::stringstream table;
  table << tf.rdbuf();
  EXPECT_NE(table.str().find("| vartrack | PaTH-FoX |"), std::string::npos) << table.str();
  EXPECT_NE(table.str().find("512 (2x)"), std::string::npos);
  EXPECT_NE(table.str().find(" ± "), std::string::npos) << "two seeds give a spread";
  // Equal parameter counts: within half a step of the MLP width (3 d_model parameters per unit per layer).
  ASSERT_EQ(res["models"].size(), 2u);
  const int64_t a = res["models"][0]["params"].get<int64_t>(), b = res["models"][1]["params"].get<int64_t>();
  EXPECT_LE(std::llabs(a - b), 3 * 16 / 2) << a << " vs " << b;
  EXPECT_NE(res["models"][0]["mlp_hidden"], res["models"][1]["mlp_hidden"]);
  EXPECT_EQ(res["summary"]["exact_match"]["vartrack"]["rope"]["2"]["n"].get<int>(), 2);
}

// --reuse reads finished runs of the same config back; another config trains again.
TEST(EngineReproLongContext, ReuseReadsBackFinishedRunsOfTheSameConfig) {
  const std::string dir = test::temp_dir("lc_reuse");
  ReproOptions o = tiny_repro(dir);
  o.models = {"fox"};
  o.scales = {1, 2};
  o.depths = {0.5};
  o.reuse = true;
  const json first = repro_long_context(o);
  auto read = [&](const std::string& f) {
    std::ifstream in(dir + "/" + f);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  const std::string lines = read("results.jsonl"), table = read("table.md");
  EXPECT_FALSE(first["runs"][0]["reused"].get<bool>());
  const json second = repro_long_context(o);
  EXPECT_TRUE(second["runs"][0]["reused"].get<bool>());
  EXPECT_EQ(read("results.jsonl"), lines);
  EXPECT_EQ(read("table.md"), table);
  EXPECT_EQ(second["summary"], first["summary"]);
  o.overlay["train"]["steps"] = 3;
  const json third = repro_long_context(o);
  EXPECT_FALSE(third["runs"][0]["reused"].get<bool>());
}

// The three presets parse, build their mixture and fit every evaluation length.
TEST(EngineReproLongContext, PresetsAreValid) {
  for (const char* name : {"repro_long_context", "repro_long_context_cpu", "repro_long_context_small"}) {
    const RunConfig c = parse_config_text(embedded_config(name), name);
    ASSERT_EQ(c.task.name, "mixture") << name;
    const auto task = make_task(c.task);
    EXPECT_EQ(task->eval_sets().size(), 9u) << name;
    for (int s : {1, 16}) {
      for (size_t i = 0; i < c.task.mixture.size(); ++i) {
        TaskConfig e = mixture_component(c.task, i);
        e.seq_len *= s;
        EXPECT_NO_THROW(make_task(e)) << name << " component " << i << " at " << s << "x";
      }
    }
  }
}

}  // namespace
}  // namespace pathattn::engine
