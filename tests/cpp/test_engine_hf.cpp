// tests/cpp/test_engine_hf.cpp: engine checkpoints <-> the Hugging Face PaTH layout (engine/hf.h): export then
// import gives back every parameter bitwise (f32 and f64, MHA / GQA, low-rank / full w, tied / untied, gate on
// and off), the exported tensors carry fla's names, shapes and transposes, bf16 and f16 files import, and bad
// models or files are refused naming the key. The committed fixture tests/data/hf_interop (a tiny exported
// model and the engine's logits on fixed tokens) is checked here against the engine and, in
// python/tests/test_engine_interop.py, against pathattn.models; PATHATTN_REGEN_HF_FIXTURE=1 rewrites it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/hf.h"
#include "engine/model.h"
#include "engine/optim.h"
#include "engine/rng.h"
#include "engine_fixtures.h"

namespace pathattn::engine {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const auto* const kSingleThreaded = ::testing::AddGlobalTestEnvironment(new test::SingleThreadedBlas);

RunConfig small(AttnKind attn, int n_kv_head, int w_rank, bool tied, int n_layer = 2) {
  RunConfig c = test::tiny_flipflop(attn);
  c.model.d_model = 32;
  c.model.n_head = 4;
  c.model.n_kv_head = n_kv_head;
  c.model.w_rank = w_rank;
  c.model.tie_embeddings = tied;
  c.model.n_layer = n_layer;
  c.model.mlp_hidden = 40;
  c.model.vocab_size = 11;
  return c;
}

// A model with random weights everywhere (norms and biases too), saved as a step-0 checkpoint.
template <typename T>
Model<T> random_checkpoint(const RunConfig& c, const std::string& path, uint64_t seed) {
  Model<T> m(c.model);
  Rng rng(seed);
  for (T& p : m.params) p = T(rng.normal() * 0.3);
  AdamW<T> opt;
  opt.init(int64_t(m.params.size()));
  save_checkpoint(path, c, m, opt, 0);
  return m;
}

template <typename T>
std::vector<T> read_tensor(const StFile& f, const std::string& name) {
  const StFile::Entry& e = f.tensors.at(name);
  std::vector<T> v(size_t(e.end - e.begin) / sizeof(T));
  std::memcpy(v.data(), f.data.data() + e.begin, size_t(e.end - e.begin));
  return v;
}

template <typename T>
void round_trip(const RunConfig& c, const std::string& tag) {
  const std::string dir = test::temp_dir("hf_" + tag);
  RunConfig cc = c;
  cc.train.dtype = std::is_same_v<T, double> ? "f64" : "f32";
  const Model<T> orig = random_checkpoint<T>(cc, dir + "/a.safetensors", 7);
  export_hf(dir + "/a.safetensors", dir + "/hf");
  import_hf(dir + "/hf", dir + "/b.safetensors", cc);
  const CheckpointInfo ck = read_checkpoint(dir + "/b.safetensors");
  EXPECT_EQ(ck.step, 0);
  EXPECT_EQ(ck.dtype, cc.train.dtype);
  Model<T> back(ck.config.model);
  restore_checkpoint<T>(ck, back, nullptr);
  ASSERT_EQ(back.params.size(), orig.params.size());
  for (size_t i = 0; i < orig.params.size(); ++i) ASSERT_EQ(back.params[i], orig.params[i]) << tag << " element " << i;
  const json a = config_to_json(cc)["model"], b = config_to_json(ck.config)["model"];
  for (const char* k : {"attn", "d_model", "n_layer", "n_head", "tie_embeddings", "w_rank", "vocab_size"})
    EXPECT_EQ(a[k], b[k]) << tag << " model." << k;
  EXPECT_EQ(ck.config.model.H(), c.model.H());
  EXPECT_EQ(ck.config.model.F(), c.model.F());
  EXPECT_EQ(ck.config.model.norm_eps, c.model.norm_eps);
}

TEST(EngineHf, RoundTripIsExact) {
  round_trip<float>(small(AttnKind::path, 0, 32, true), "path_mha_lowrank_tied");
  round_trip<float>(small(AttnKind::path_fox, 2, 0, false), "fox_gqa_full_untied");
  round_trip<double>(small(AttnKind::path_fox, 1, 32, false, 1), "fox_mqa_f64");
}

TEST(EngineHf, ExportedTensorsAreFlasLayout) {
  const std::string dir = test::temp_dir("hf_layout");
  const RunConfig c = small(AttnKind::path_fox, 2, 32, false);
  Model<float> m = random_checkpoint<float>(c, dir + "/a.safetensors", 3);
  export_hf(dir + "/a.safetensors", dir + "/hf");
  const StFile f = read_safetensors(dir + "/hf/model.safetensors");
  EXPECT_EQ(f.metadata.at("format"), "pt");
  const int64_t C = 32, HQK = 32, HK = 16, F = 40;
  const std::map<std::string, std::vector<int64_t>> want1 = {
      {"attn_norm.weight", {C}}, {"attn.q_proj.weight", {HQK, C}}, {"attn.k_proj.weight", {HK, C}},
      {"attn.v_proj.weight", {HK, C}}, {"attn.w_proj.0.weight", {32, C}}, {"attn.w_proj.1.weight", {HK, 32}},
      {"attn.w_conv1d.weight", {HK, 1, 3}}, {"attn.bt_proj.weight", {2, C}}, {"attn.bt_proj.bias", {2}},
      {"attn.g_proj.weight", {4, C}}, {"attn.g_proj.bias", {4}}, {"attn.o_proj.weight", {C, HQK}},
      {"mlp_norm.weight", {C}}, {"mlp.gate_proj.weight", {F, C}}, {"mlp.up_proj.weight", {F, C}},
      {"mlp.down_proj.weight", {C, F}}};
  std::map<std::string, std::vector<int64_t>> want = {
      {"model.embeddings.weight", {11, C}}, {"model.norm.weight", {C}}, {"lm_head.weight", {11, C}}};
  for (int l = 0; l < 2; ++l)
    for (const auto& [k, s] : want1) want["model.layers." + std::to_string(l) + "." + k] = s;
  ASSERT_EQ(f.tensors.size(), want.size());
  for (const auto& [k, s] : want) {
    ASSERT_TRUE(f.tensors.count(k)) << k;
    EXPECT_EQ(f.tensors.at(k).shape, s) << k;
  }
  // torch's Linear weight is [Out, In]: q_proj.weight[o][i] = wq[i][o]; gate / up are wfc's two halves.
  const auto q = read_tensor<float>(f, "model.layers.1.attn.q_proj.weight");
  const auto up = read_tensor<float>(f, "model.layers.1.mlp.up_proj.weight");
  const auto gate = read_tensor<float>(f, "model.layers.1.mlp.gate_proj.weight");
  const float* wq = m.param("blocks.1.attn.wq");
  const float* wfc = m.param("blocks.1.mlp.wfc");
  for (int64_t o = 0; o < HQK; ++o)
    for (int64_t i = 0; i < C; ++i) ASSERT_EQ(q[o * C + i], wq[i * HQK + o]);
  for (int64_t o = 0; o < F; ++o)
    for (int64_t i = 0; i < C; ++i) {
      ASSERT_EQ(gate[o * C + i], wfc[i * 2 * F + o]);
      ASSERT_EQ(up[o * C + i], wfc[i * 2 * F + F + o]);
    }
  std::ifstream cf(dir + "/hf/config.json");
  const json hc = json::parse(cf);
  EXPECT_EQ(hc["model_type"], "path_attn");
  EXPECT_EQ(hc["num_kv_heads"], 2);
  EXPECT_EQ(hc["intermediate_size"], 40);
  EXPECT_EQ(hc["use_forget_gate"], true);
  EXPECT_EQ(hc["use_low_rank_w"], true);
  EXPECT_EQ(hc["tie_word_embeddings"], false);
}

// Rewrites dir/model.safetensors with every tensor converted by `conv` (dtype name, bytes per element).
void rewrite_as(const std::string& dir, const std::string& dtype, uint16_t (*conv)(float)) {
  const StFile f = read_safetensors(dir + "/model.safetensors");
  std::vector<std::vector<uint16_t>> bufs;
  std::vector<StTensor> ts;
  for (const auto& [name, e] : f.tensors) {
    const auto v = read_tensor<float>(f, name);
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = conv(v[i]);
    bufs.push_back(std::move(b));
    ts.push_back({name, dtype, e.shape, nullptr, int64_t(bufs.back().size() * 2)});
  }
  for (size_t i = 0; i < ts.size(); ++i) ts[i].data = bufs[i].data();
  write_safetensors(dir + "/model.safetensors", ts, {{"format", "pt"}});
}

uint16_t to_bf16(float x) {  // truncation: the test's values are bf16 already
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t(u >> 16);
}
uint16_t to_f16(float x) {  // values k / 64 with |k| < 64 only
  const int k = int(std::lround(x * 64));
  if (k == 0) return 0;
  const int s = k < 0, a = std::abs(k);
  int e = 0;
  while ((a >> e) > 1) ++e;                       // a = 2^e + r
  const int mant = ((a << 10) >> e) & 1023;      // exact for a < 2^11
  return uint16_t((s << 15) | ((e - 6 + 15) << 10) | mant);
}

TEST(EngineHf, ImportsBf16AndF16) {
  for (const char* dt : {"BF16", "F16"}) {
    const std::string dir = test::temp_dir(std::string("hf_") + dt);
    const RunConfig c = small(AttnKind::path, 0, 32, true, 1);
    Model<float> m(c.model);
    Rng rng(5);
    for (float& p : m.params) p = float(int(rng.uniform() * 126) - 63) / 64.0f;  // exact in bf16 and f16
    AdamW<float> opt;
    opt.init(int64_t(m.params.size()));
    save_checkpoint(dir + "/a.safetensors", c, m, opt, 0);
    export_hf(dir + "/a.safetensors", dir + "/hf");
    rewrite_as(dir + "/hf", dt, std::string(dt) == "BF16" ? to_bf16 : to_f16);
    import_hf(dir + "/hf", dir + "/b.safetensors", c);
    const CheckpointInfo ck = read_checkpoint(dir + "/b.safetensors");
    Model<float> back(ck.config.model);
    restore_checkpoint<float>(ck, back, nullptr);
    for (size_t i = 0; i < m.params.size(); ++i) ASSERT_EQ(back.params[i], m.params[i]) << dt << " element " << i;
  }
}

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << part;
  } catch (const EngineError& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(EngineHf, RefusesWhatTheLayoutCannotHold) {
  const std::string dir = test::temp_dir("hf_errors");
  RunConfig rope = small(AttnKind::rope, 0, 32, true, 1);
  random_checkpoint<float>(rope, dir + "/rope.safetensors", 1);
  expect_error([&] { export_hf(dir + "/rope.safetensors", dir + "/x"); }, "model.attn");
  RunConfig wide = small(AttnKind::path, 0, 32, true, 1);
  wide.model.head_dim = 16;  // 4 heads of 16 in a width of 32
  random_checkpoint<float>(wide, dir + "/wide.safetensors", 1);
  expect_error([&] { export_hf(dir + "/wide.safetensors", dir + "/x"); }, "model.head_dim");
  RunConfig r16 = small(AttnKind::path, 0, 16, true, 1);
  random_checkpoint<float>(r16, dir + "/r16.safetensors", 1);
  expect_error([&] { export_hf(dir + "/r16.safetensors", dir + "/x"); }, "model.w_rank");

  const RunConfig c = small(AttnKind::path_fox, 0, 32, false, 1);
  random_checkpoint<float>(c, dir + "/ok.safetensors", 1);
  export_hf(dir + "/ok.safetensors", dir + "/hf");
  auto edit_config = [&](const std::function<void(json&)>& f) {
    std::ifstream in(dir + "/hf/config.json");
    json j = json::parse(in);
    f(j);
    fs::create_directories(dir + "/hf2");
    std::ofstream(dir + "/hf2/config.json") << j.dump();
    fs::copy_file(dir + "/hf/model.safetensors", dir + "/hf2/model.safetensors", fs::copy_options::overwrite_existing);
  };
  edit_config([](json& j) { j["use_w_shortconv"] = false; });
  expect_error([&] { import_hf(dir + "/hf2", dir + "/b.safetensors", c); }, "use_w_shortconv");
  edit_config([](json& j) { j["model_type"] = "llama"; });
  expect_error([&] { import_hf(dir + "/hf2", dir + "/b.safetensors", c); }, "model_type");
  edit_config([](json& j) { j["use_forget_gate"] = false; });  // the file's g_proj tensors have no place
  expect_error([&] { import_hf(dir + "/hf2", dir + "/b.safetensors", c); }, "attn.g_proj");
  edit_config([](json& j) { j["intermediate_size"] = 48; });
  expect_error([&] { import_hf(dir + "/hf2", dir + "/b.safetensors", c); }, "has shape");
  edit_config([](json& j) { j["num_hidden_layers"] = 2; });
  expect_error([&] { import_hf(dir + "/hf2", dir + "/b.safetensors", c); }, "is missing");
  expect_error([&] { import_hf(dir + "/nowhere", dir + "/b.safetensors", c); }, "config.json");
}

// The fixture the Python side checks pathattn.models against: PaTH-FoX, GQA, low-rank w, untied, 2 layers,
// width 16 (K = 8), MLP 24, vocab 16; the engine's fp32 logits of 12 fixed tokens.
const char* const kTokens = "3 1 4 1 5 9 2 6 5 3 5 8";

TEST(EngineHf, CommittedFixtureMatchesTheEngine) {
  const fs::path fix = fs::path(PATHATTN_SOURCE_DIR) / "tests" / "data" / "hf_interop";
  RunConfig c = test::tiny_flipflop(AttnKind::path_fox);
  c.model.d_model = 16;
  c.model.n_head = 2;
  c.model.n_kv_head = 1;
  c.model.n_layer = 2;
  c.model.mlp_hidden = 24;
  c.model.vocab_size = 16;
  c.model.tie_embeddings = false;
  std::vector<int32_t> tokens;
  {
    std::istringstream is(kTokens);
    int t;
    while (is >> t) tokens.push_back(t);
  }
  const std::string dir = test::temp_dir("hf_fixture");
  if (std::getenv("PATHATTN_REGEN_HF_FIXTURE")) {
    random_checkpoint<float>(c, dir + "/a.safetensors", 2024);
    export_hf(dir + "/a.safetensors", fix.string());
  }
  import_hf(fix.string(), dir + "/b.safetensors", c);
  const CheckpointInfo ck = read_checkpoint(dir + "/b.safetensors");
  Model<float> m(ck.config.model);
  restore_checkpoint<float>(ck, m, nullptr);
  m.threads = 1;
  m.forward(tokens.data(), nullptr, 1, int64_t(tokens.size()));
  const std::vector<float>& lg = m.logits();
  if (std::getenv("PATHATTN_REGEN_HF_FIXTURE")) {
    std::ofstream(fix / "logits.json") << json({{"tokens", tokens}, {"logits", lg}}).dump() << "\n";
  }
  std::ifstream in(fix / "logits.json");
  ASSERT_TRUE(in) << "missing " << (fix / "logits.json").string();
  const json j = json::parse(in);
  ASSERT_EQ(j["tokens"].get<std::vector<int32_t>>(), tokens);
  const auto want = j["logits"].get<std::vector<float>>();
  ASSERT_EQ(want.size(), lg.size());
  // Same weights, same code, one thread: the engine reproduces its committed logits to fp32 rounding.
  double num = 0, den = 0;
  for (size_t i = 0; i < lg.size(); ++i) {
    num += (double(lg[i]) - want[i]) * (double(lg[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  EXPECT_LE(std::sqrt(num / den), 1e-6);
}

}  // namespace
}  // namespace pathattn::engine
