// tests/cpp/test_engine_convert.cpp: `pathattn convert` (engine/convert.h) and the evaluation at other lengths
// (engine/lengths.h). Conversion: names, shapes, carried bytes, the init rule, fresh optimizer state, a
// converted checkpoint resumes training; with beta = 0 (and no forgetting) a converted PaTH / PaTH-FoX model
// computes exactly what the same weights compute with no position encoding. Lengths: the bucketed loss
// against the ordinary evaluation of the same windows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "engine/checkpoint.h"
#include "engine/convert.h"
#include "engine/lengths.h"
#include "engine/model.h"
#include "engine/optim.h"
#include "engine/rng.h"
#include "engine/run.h"
#include "engine/tasks.h"
#include "engine_fixtures.h"

namespace pathattn::engine {
namespace {

namespace fs = std::filesystem;

const auto* const kSingleThreaded = ::testing::AddGlobalTestEnvironment(new test::SingleThreadedBlas);
using test::temp_dir;

// A RoPE source config: flip-flop vocab, two blocks, GQA when n_kv_head = 1.
RunConfig rope_config(int n_kv_head, const std::string& dtype) {
  RunConfig c = test::tiny_flipflop(AttnKind::rope);
  c.model.vocab_size = 5;
  c.model.d_model = 16;
  c.model.n_layer = 2;
  c.model.n_head = 2;
  c.model.n_kv_head = n_kv_head;
  c.model.head_dim = 8;
  c.model.w_rank = 4;
  c.model.init_std = 0.5;  // large weights: attention patterns far from uniform, so differences show
  c.train.dtype = dtype;
  c.train.steps = 10;
  return c;
}

// Writes a source checkpoint at step 3 (AdamW moments nonzero, adam_t = 3) with random weights.
template <typename T>
void write_source(const std::string& path, const RunConfig& c, uint64_t seed) {
  Model<T> m(c.model);
  m.init(seed);
  AdamW<T> adam;
  adam.init(int64_t(m.params.size()));
  for (size_t i = 0; i < adam.m.size(); ++i) adam.m[i] = adam.v[i] = T(0.25);
  adam.t = 3;
  save_checkpoint(path, c, m, adam, 3);
}

// The logits of a checkpoint's model over tokens [B, T].
template <typename T>
std::vector<T> logits_of(const std::string& path, const std::vector<int32_t>& tok, int64_t B, int64_t T_,
                         Backend backend) {
  const CheckpointInfo ck = read_checkpoint(path);
  Model<T> m(ck.config.model);
  m.backend = backend;
  m.threads = 1;
  restore_checkpoint<T>(ck, m, nullptr);
  std::vector<int32_t> tgt(tok.size(), -1);
  m.forward(tok.data(), tgt.data(), B, T_);
  return m.logits();
}

TEST(EngineConvert, NamesShapesCarriedBytesAndInitRule) {
  const std::string d = temp_dir("convert_names");
  for (const char* target : {"path", "path-fox"}) {
    const RunConfig src = rope_config(0, "f32");
    write_source<float>(d + "/rope.safetensors", src, 7);
    ConvertOptions o;
    o.attn = target;
    o.overlay = overlay_from_sets({"train.steps=4", "train.seed=9"});
    o.beta_bias = -2.5;
    o.gate_bias = 4.0;
    const ConvertResult r = convert_checkpoint(d + "/rope.safetensors", d + "/out.safetensors", o);
    const CheckpointInfo in = read_checkpoint(d + "/rope.safetensors");
    const CheckpointInfo ck = read_checkpoint(d + "/out.safetensors");
    EXPECT_EQ(std::string(attn_kind_name(ck.config.model.attn)), target);
    EXPECT_EQ(ck.step, 0);
    EXPECT_EQ(ck.config.train.steps, 4);
    EXPECT_EQ(ck.config.train.seed, 9u);
    EXPECT_EQ(ck.file.metadata.at("adam_t"), "0");
    EXPECT_NE(ck.file.metadata.at("converted_from").find("\"attn\":\"rope\""), std::string::npos);
    // Exactly the target layout's tensors and moments, with the layout's shapes.
    const auto layout = param_layout(ck.config.model);
    std::set<std::string> want;
    for (const ParamInfo& p : layout)
      for (const char* pre : {"", "optim.m.", "optim.v."}) want.insert(pre + p.name);
    std::set<std::string> got;
    for (const auto& [name, e] : ck.file.tensors) got.insert(name);
    EXPECT_EQ(got, want);
    EXPECT_EQ(r.carried.size() + r.initialised.size(), layout.size());
    EXPECT_TRUE(r.dropped.empty());
    const bool gate = std::string(target) == "path-fox";
    EXPECT_EQ(r.initialised.size(), size_t(src.model.n_layer) * (gate ? 7 : 5));  // ww1 ww2 wconv wb bb (wg bg)
    for (const ParamInfo& p : layout) {
      const auto& e = ck.file.tensors.at(p.name);
      EXPECT_EQ(e.shape, p.shape) << p.name;
      const float* x = reinterpret_cast<const float*>(ck.file.data.data() + e.begin);
      auto src_it = in.file.tensors.find(p.name);
      if (src_it != in.file.tensors.end()) {  // carried byte for byte
        ASSERT_EQ(e.end - e.begin, src_it->second.end - src_it->second.begin) << p.name;
        EXPECT_EQ(std::memcmp(x, in.file.data.data() + src_it->second.begin, size_t(e.end - e.begin)), 0) << p.name;
      }
      auto all = [&](float v) {
        for (int64_t i = 0; i < p.numel; ++i)
          if (x[i] != v) return false;
        return true;
      };
      const std::string& n = p.name;
      auto ends = [&](const char* s) { return n.size() >= std::strlen(s) && n.compare(n.size() - std::strlen(s), std::string::npos, s) == 0; };
      if (ends("attn.wb") || ends("attn.wg")) EXPECT_TRUE(all(0.0f)) << n;
      if (ends("attn.bb")) EXPECT_TRUE(all(-2.5f)) << n;
      if (ends("attn.bg")) EXPECT_TRUE(all(4.0f)) << n;
      if (ends("attn.ww1") || ends("attn.ww2")) EXPECT_FALSE(all(0.0f)) << n;  // drawn, not zero
      const auto& m = ck.file.tensors.at("optim.m." + n);
      const float* mv = reinterpret_cast<const float*>(ck.file.data.data() + m.begin);
      for (int64_t i = 0; i < p.numel; ++i) ASSERT_EQ(mv[i], 0.0f) << n;  // fresh AdamW state
    }
    // Loads into the target model with its optimizer.
    Model<float> model(ck.config.model);
    AdamW<float> adam;
    EXPECT_NO_THROW(restore_checkpoint(ck, model, &adam));
  }
  fs::remove_all(d);
}

// beta = 2 sigmoid(-1000) and logsigmoid(1000) are exactly 0 in fp32 and fp64: every Householder factor is
// I - 0 w w^T = I and the gate adds 0 to every logit, so PaTH and PaTH-FoX must compute the same numbers as
// the plain op over the same q, k, v: the nope model with the same weights. Compared at 0 difference.
TEST(EngineConvert, BetaZeroIsNoPositionEncodingExactly) {
  const std::string d = temp_dir("convert_beta0");
  Rng rng(11);
  const int64_t B = 2, T_ = 37;
  std::vector<int32_t> tok(size_t(B * T_));
  for (auto& t : tok) t = int32_t(rng.below(5));
  for (int kv : {0, 1})
    for (const char* dtype : {"f64", "f32"})
      for (const Backend be : {Backend::oracle, Backend::cpu}) {
        const RunConfig src = rope_config(kv, dtype);
        const bool f64 = std::string(dtype) == "f64";
        if (f64) write_source<double>(d + "/rope.safetensors", src, 3);
        else write_source<float>(d + "/rope.safetensors", src, 3);
        ConvertOptions o;
        o.beta_bias = -1000;
        o.gate_bias = 1000;
        o.attn = "nope";
        convert_checkpoint(d + "/rope.safetensors", d + "/nope.safetensors", o);
        for (const char* target : {"path", "path-fox"}) {
          o.attn = target;
          convert_checkpoint(d + "/rope.safetensors", d + "/conv.safetensors", o);
          const std::string what = std::string(target) + " " + dtype + " kv " + std::to_string(kv) +
                                   (be == Backend::cpu ? " cpu" : " oracle");
          double diff = 0, ref = 0;
          if (f64) {
            const auto a = logits_of<double>(d + "/conv.safetensors", tok, B, T_, be);
            const auto b = logits_of<double>(d + "/nope.safetensors", tok, B, T_, be);
            for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, std::abs(a[i] - b[i]));
            for (double x : b) ref = std::max(ref, std::abs(x));
          } else {
            const auto a = logits_of<float>(d + "/conv.safetensors", tok, B, T_, be);
            const auto b = logits_of<float>(d + "/nope.safetensors", tok, B, T_, be);
            for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, double(std::abs(a[i] - b[i])));
            for (float x : b) ref = std::max(ref, double(std::abs(x)));
          }
          EXPECT_GT(ref, 0.1) << what;  // the logits are not trivially small
          EXPECT_EQ(diff, 0.0) << what;
          // And the rope model itself differs: position information is really gone.
          if (f64 && be == Backend::oracle) {
            const auto r = logits_of<double>(d + "/rope.safetensors", tok, B, T_, be);
            const auto b = logits_of<double>(d + "/nope.safetensors", tok, B, T_, be);
            double rd = 0;
            for (size_t i = 0; i < r.size(); ++i) rd = std::max(rd, std::abs(r[i] - b[i]));
            EXPECT_GT(rd, 1e-3) << what;
          }
        }
      }
  fs::remove_all(d);
}

TEST(EngineConvert, ConvertedCheckpointResumesTraining) {
  const std::string d = temp_dir("convert_resume");
  RunConfig src = rope_config(0, "f32");
  src.model.init_std = 0.02;
  write_source<float>(d + "/rope.safetensors", src, 5);
  ConvertOptions o;
  o.attn = "path-fox";
  o.overlay = overlay_from_sets({"train.steps=3", "train.log_every=1"});
  convert_checkpoint(d + "/rope.safetensors", d + "/run/ckpt.safetensors", o);
  RunOptions ro;
  ro.resume = d + "/run/ckpt.safetensors";
  ro.out_dir = d + "/run";
  ro.progress = false;
  const RunResult r = train_run(RunConfig(), ro);
  EXPECT_TRUE(r.finished);
  EXPECT_EQ(r.start_step, 0);
  EXPECT_EQ(r.steps_done, 3);
  EXPECT_TRUE(std::isfinite(r.last_loss));
  EXPECT_EQ(read_checkpoint(d + "/run/ckpt.safetensors").step, 3);
  fs::remove_all(d);
}

void expect_error_with(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const EngineError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

TEST(EngineConvert, BadArgumentsNameTheirCause) {
  const std::string d = temp_dir("convert_errors");
  write_source<float>(d + "/rope.safetensors", rope_config(0, "f32"), 1);
  ConvertOptions o;
  o.attn = "stick";
  expect_error_with([&] { convert_checkpoint(d + "/rope.safetensors", d + "/o.safetensors", o); }, {"--attn", "stick"});
  o.attn = "path";
  expect_error_with([&] { convert_checkpoint(d + "/rope.safetensors", d + "/rope.safetensors", o); }, {"--out"});
  expect_error_with([&] { convert_checkpoint(d + "/rope.safetensors", "", o); }, {"--out"});
  expect_error_with([&] { convert_checkpoint(d + "/missing.safetensors", d + "/o.safetensors", o); }, {"missing"});
  o.beta_bias = std::nan("");
  expect_error_with([&] { convert_checkpoint(d + "/rope.safetensors", d + "/o.safetensors", o); }, {"--beta-bias"});
  o.beta_bias = -3;
  o.overlay = overlay_from_sets({"model.mlp_hidden=40"});
  expect_error_with([&] { convert_checkpoint(d + "/rope.safetensors", d + "/o.safetensors", o); },
                    {"mlp.wfc", "shape"});
  EXPECT_FALSE(fs::exists(d + "/o.safetensors"));
  fs::remove_all(d);
}

// evaluate_by_position over the windows of evaluate(): the same mean loss; the buckets' count-weighted mean is
// the whole loss; a window of 2L bytes has two buckets of L positions (the second one short by one).
TEST(EngineLengths, BucketsAgreeWithTheOrdinaryEvaluation) {
  const std::string d = temp_dir("lengths");
  {
    std::ofstream f(d + "/a.txt", std::ios::binary);
    Rng rng(3);
    for (int i = 0; i < 20000; ++i) f << char('a' + rng.below(7)) << (i % 13 == 0 ? "\n" : "");
  }
  {
    std::ofstream f(d + "/b.txt", std::ios::binary);
    for (int i = 0; i < 3000; ++i) f << "int x = " << i % 10 << ";\n";
  }
  RunConfig c = rope_config(0, "f64");
  c.model.vocab_size = 256;
  c.model.init_std = 0.2;
  c.task.name = "bytes";
  c.task.files = {d + "/a.txt"};
  c.task.val_files = {d + "/b.txt"};
  c.task.seq_len = 40;
  c.task.eval_sequences = 5;
  const auto task = make_task(c.task);
  Model<double> m(c.model);
  m.init(4);
  m.backend = Backend::oracle;
  const nlohmann::json ref = evaluate(m, *task, 2);
  const nlohmann::json got = evaluate_by_position(m, *task, 3, 10);
  EXPECT_NEAR(got["loss"].get<double>(), ref["val"]["loss"].get<double>(), 1e-12);
  EXPECT_EQ(got["count"].get<int64_t>(), 5 * 39);
  ASSERT_EQ(got["loss_by_bucket"].size(), 4u);
  double s = 0;
  int64_t n = 0;
  for (size_t k = 0; k < 4; ++k) {
    s += got["loss_by_bucket"][k].get<double>() * double(got["count_by_bucket"][k].get<int64_t>());
    n += got["count_by_bucket"][k].get<int64_t>();
  }
  EXPECT_EQ(n, 5 * 39);
  EXPECT_NEAR(s / double(n), got["loss"].get<double>(), 1e-12);
  EXPECT_EQ(got["count_by_bucket"][3].get<int64_t>(), 5 * 9);
  // Through a checkpoint at two lengths, with its own seq_len as the bucket.
  AdamW<double> adam;
  adam.init(int64_t(m.params.size()));
  save_checkpoint(d + "/ck.safetensors", c, m, adam, 0);
  LengthEvalOptions lo;
  lo.seq_lens = {40, 80};
  lo.sequences = 3;
  const nlohmann::json r = evaluate_lengths(d + "/ck.safetensors", lo);
  ASSERT_EQ(r["lengths"].size(), 2u);
  EXPECT_EQ(r["lengths"][0]["val"]["loss_by_bucket"].size(), 1u);
  EXPECT_EQ(r["lengths"][1]["val"]["loss_by_bucket"].size(), 2u);
  EXPECT_EQ(r["lengths"][1]["val"]["count"].get<int64_t>(), 3 * 79);
  // The same windows as the ordinary evaluation of the task with its training files.
  c.task.eval_sequences = 3;
  EXPECT_NEAR(r["lengths"][0]["val"]["loss"].get<double>(), evaluate(m, *make_task(c.task), 3)["val"]["loss"].get<double>(),
              1e-12);
  lo.sequences = 0;
  lo.tokens = 200;  // ceil(200 / 39) = 6 windows of 40, ceil(200 / 79) = 3 of 80
  const nlohmann::json rt = evaluate_lengths(d + "/ck.safetensors", lo);
  EXPECT_EQ(rt["lengths"][0]["val"]["sequences"].get<int64_t>(), 6);
  EXPECT_EQ(rt["lengths"][1]["val"]["sequences"].get<int64_t>(), 3);
  lo.seq_lens = {1};
  expect_error_with([&] { evaluate_lengths(d + "/ck.safetensors", lo); }, {"--seq-len"});
  lo.seq_lens = {100000};  // longer than the validation split
  expect_error_with([&] { evaluate_lengths(d + "/ck.safetensors", lo); }, {"validation split"});
  fs::remove_all(d);
}

}  // namespace
}  // namespace pathattn::engine
