// tests/cpp/test_engine_errors.cpp: malformed configs, checkpoints and data files are rejected with messages
// that say what is wrong (the key, the defect); nothing is half-loaded, and a failed write leaves the old file.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/config.h"
#include "engine/repro.h"
#include "engine/embedded.h"
#include "engine/run.h"
#include "engine/tasks.h"
#include "engine_fixtures.h"

namespace pathattn::engine {
namespace {

namespace fs = std::filesystem;

using test::expect_error;
using test::temp_dir;

void write(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}


TEST(EngineErrors, MalformedConfigs) {
  expect_error([] { parse_config_text("{\"model\": {\"d_model\": 64,}", "c.json"); }, {"c.json", "not valid JSON"});
  expect_error([] { parse_config_text("[1, 2]", "c.json"); }, {"top level"});
  expect_error([] { parse_config_text("{\"modle\": {}}", "c.json"); }, {"config.modle", "unknown section"});
  expect_error([] { parse_config_text("{\"model\": {\"dmodel\": 64}}", "c.json"); }, {"model.dmodel", "unknown key"});
  expect_error([] { parse_config_text("{\"train\": {\"lr\": \"fast\"}}", "c.json"); }, {"train.lr", "a number"});
  expect_error([] { parse_config_text("{\"train\": {\"lr\": -1}}", "c.json"); }, {"train.lr", "(0, 10]"});
  expect_error([] { parse_config_text("{\"train\": {\"steps\": 1.5}}", "c.json"); }, {"train.steps", "integer"});
  expect_error([] { parse_config_text("{\"model\": {\"attn\": \"alibi\"}}", "c.json"); }, {"model.attn", "rope"});
  expect_error([] { parse_config_text("{\"task\": {\"name\": \"copy\"}}", "c.json"); }, {"task.name", "flipflop"});
  expect_error([] { parse_config_text("{\"model\": []}", "c.json"); }, {"model", "JSON object"});
  expect_error([] { parse_config_text("{\"train\": {\"matmul\": \"fp16\"}}", "c.json"); }, {"train.matmul", "bf16"});
  // The key train.matmul replaced: a checkpoint's config with train.tf32 still loads.
  EXPECT_EQ(parse_config_text("{\"train\": {\"tf32\": true}}", "c.json").train.matmul, "tf32");
  EXPECT_EQ(parse_config_text("{\"train\": {\"matmul\": \"bf16\"}}", "c.json").train.matmul, "bf16");
  expect_error([] { load_config_file("/nonexistent/dir/cfg.json"); }, {"cannot open config file"});
  // Cross-field checks once the task is known.
  RunConfig c;
  c.model.d_model = 60;  // head dim 30: not a multiple of 8
  expect_error([&] { resolve_config(c, *make_task(c.task)); }, {"model.head_dim", "multiple of 8"});
  c = RunConfig();
  c.model.n_head = 4;
  c.model.n_kv_head = 3;
  c.model.head_dim = 16;
  expect_error([&] { resolve_config(c, *make_task(c.task)); }, {"model.n_kv_head", "divide"});
  c = RunConfig();
  c.model.vocab_size = 3;
  expect_error([&] { resolve_config(c, *make_task(c.task)); }, {"model.vocab_size", "smaller"});
  // Every embedded config parses and resolves.
  for (const std::string& n : embedded_config_names()) {
    if (n.rfind("bytes", 0) == 0) continue;  // needs a data file
    const RunConfig rc = parse_config_text(embedded_config(n), n);
    EXPECT_NO_THROW(resolve_config(rc, *make_task(rc.task))) << n;
  }
}

TEST(EngineErrors, MalformedDataFiles) {
  const std::string d = temp_dir("data");
  TaskConfig t;
  t.name = "bytes";
  expect_error([&] { make_task(t); }, {"task.files", "at least one"});
  t.files = {d + "/missing.txt"};
  expect_error([&] { make_task(t); }, {"task.files", "cannot open", "missing.txt"});
  write(d + "/empty.txt", "");
  t.files = {d + "/empty.txt"};
  expect_error([&] { make_task(t); }, {"empty.txt", "is empty"});
  write(d + "/short.txt", std::string(300, 'a'));
  t.files = {d + "/short.txt"};
  t.seq_len = 64;
  expect_error([&] { make_task(t); }, {"validation split", "task.seq_len"});
  write(d + "/ok.txt", std::string(5000, 'b'));
  t.files = {d + "/ok.txt"};
  auto task = make_task(t);
  EXPECT_EQ(task->vocab_size(), 256);
  fs::remove_all(d);
}

class EngineCheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = temp_dir("ckpt");
    RunConfig c;
    c.model.d_model = 16;
    c.model.head_dim = 8;
    c.task.seq_len = 16;
    c.task.eval_id = c.task.eval_sparse = c.task.eval_dense = 2;
    c.train.steps = 2;
    c.train.batch_size = 2;
    RunOptions ro;
    ro.out_dir = dir;
    ro.progress = false;
    train_run(c, ro);
    good = read(dir + "/ckpt.safetensors");
    ASSERT_GT(good.size(), 64u);
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string dir, good;
};

TEST_F(EngineCheckpointErrors, RejectsBadFiles) {
  const std::string p = dir + "/bad.safetensors";
  expect_error([&] { read_checkpoint(dir + "/nope.safetensors"); }, {"cannot open"});
  write(p, "");
  expect_error([&] { read_checkpoint(p); }, {"not a valid safetensors file", "truncated"});
  write(p, good.substr(0, good.size() / 2));  // truncated mid-data
  expect_error([&] { read_checkpoint(p); }, {"not a valid safetensors file"});
  write(p, good.substr(0, 100));  // truncated mid-header
  expect_error([&] { read_checkpoint(p); }, {"header length"});
  std::string flipped = good;
  flipped[flipped.size() - 5] ^= 0x40;  // one bit of tensor data
  write(p, flipped);
  expect_error([&] { read_checkpoint(p); }, {"corrupt", "checksum"});
  std::string garbage_header = good;
  garbage_header[8] = '#';  // the header's opening brace
  write(p, garbage_header);
  expect_error([&] { read_checkpoint(p); }, {"not valid JSON"});
  write(p, "PK\x03\x04 this is a zip file, not a checkpoint at all........");
  expect_error([&] { read_checkpoint(p); }, {"header length"});
  // A valid safetensors file from elsewhere: no pathattn-engine metadata.
  const float x[4] = {1, 2, 3, 4};
  write_safetensors(p, {{"weight", "F32", {2, 2}, x, 16}}, {{"format", "pt"}});
  expect_error([&] { read_checkpoint(p); }, {"not a pathattn-engine checkpoint", "\"pt\""});
  // Offsets past the data section.
  {
    std::string hdr = "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}";
    std::string f(8, '\0');
    for (int i = 0; i < 8; ++i) f[i] = char((hdr.size() >> (8 * i)) & 0xff);
    write(p, f + hdr + std::string(8, '\0'));
    expect_error([&] { read_checkpoint(p); }, {"outside the 8-byte data section"});
  }
  // Shape / dtype disagreement.
  {
    std::string hdr = "{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,16]}}";
    std::string f(8, '\0');
    for (int i = 0; i < 8; ++i) f[i] = char((hdr.size() >> (8 * i)) & 0xff);
    write(p, f + hdr + std::string(16, '\0'));
    expect_error([&] { read_checkpoint(p); }, {"needs 12"});
    hdr = "{\"w\":{\"dtype\":\"Q4\",\"shape\":[4],\"data_offsets\":[0,16]}}";
    for (int i = 0; i < 8; ++i) f[i] = char((hdr.size() >> (8 * i)) & 0xff);
    write(p, f + hdr + std::string(16, '\0'));
    expect_error([&] { read_checkpoint(p); }, {"unsupported dtype Q4"});
  }
  // A good checkpoint of another model shape: restore names the tensor and both shapes.
  const CheckpointInfo ck = read_checkpoint(dir + "/ckpt.safetensors");
  ModelConfig other = ck.config.model;
  other.vocab_size = 5;
  other.d_model = 24;
  Model<float> m(other);
  expect_error([&] { restore_checkpoint(ck, m, (AdamW<float>*)nullptr); }, {"wte", "shape", "[5, 24]"});
  Model<double> md(ck.config.model.vocab_size ? ck.config.model : other);
  expect_error([&] { restore_checkpoint(ck, md, (AdamW<double>*)nullptr); }, {"F32", "expected F64"});
}

// A checkpoint rewritten by hand: fn edits the header (metadata included) and may append tensor data; the
// data checksum is recomputed (unless `checksum` is false, which drops it), so only the checks after the
// checksum can catch the edit.
std::string rewrite(const std::string& good, const std::function<void(nlohmann::json&, std::string&)>& fn,
                    bool checksum = true) {
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t(uint8_t(good[i])) << (8 * i);
  nlohmann::json h = nlohmann::json::parse(good.substr(8, hlen));
  std::string data = good.substr(8 + hlen);
  fn(h, data);
  uint64_t sum = 0xcbf29ce484222325ull;
  for (unsigned char ch : data) sum = (sum ^ ch) * 0x100000001b3ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)sum);
  if (checksum) h["__metadata__"]["data_fnv1a64"] = hex;
  else h["__metadata__"].erase("data_fnv1a64");
  std::string hdr = h.dump();
  std::string f(8, '\0');
  for (int i = 0; i < 8; ++i) f[i] = char((hdr.size() >> (8 * i)) & 0xff);
  return f + hdr + data;
}

TEST_F(EngineCheckpointErrors, SemanticsCheckedAfterTheChecksum) {
  const std::string p = dir + "/edited.safetensors";
  auto meta = [&](const char* key, const char* value) {
    write(p, rewrite(good, [&](nlohmann::json& h, std::string&) { h["__metadata__"][key] = value; }));
  };
  // Resuming and evaluating load through read_checkpoint + restore_checkpoint.
  auto load = [&] {
    const CheckpointInfo ck = read_checkpoint(p);
    Model<float> m(ck.config.model);
    AdamW<float> opt;
    restore_checkpoint(ck, m, &opt);
  };
  write(p, rewrite(good, [](nlohmann::json&, std::string&) {}));
  EXPECT_NO_THROW(load());  // the rewrite itself keeps a good file good
  meta("adam_t", "-1");
  expect_error(load, {"adam_t", "-1"});
  meta("adam_t", "1");
  expect_error(load, {"adam_t", "differs from \"step\" = 2"});
  meta("step", "-3");
  expect_error(load, {"\"step\" = -3", "outside [0, train.steps = 2]"});
  meta("step", "3");
  expect_error(load, {"\"step\" = 3", "outside"});
  meta("step", "2abc");
  expect_error(load, {"\"step\" is not an integer"});
  // An extra tensor (with its bytes; the checksum recomputed).
  write(p, rewrite(good, [](nlohmann::json& h, std::string& data) {
    const int64_t off = int64_t(data.size());
    h["extra.weight"] = {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {off, off + 8}}};
    data += std::string(8, '\0');
  }));
  expect_error(load, {"\"extra.weight\" is not part of the model"});
  // The integrity field removed.
  write(p, rewrite(good, [](nlohmann::json&, std::string&) {}, /*checksum=*/false));
  expect_error([&] { read_checkpoint(p); }, {"data_fnv1a64"});
  // A PaTH checkpoint relabelled rope: its w projections are not part of a rope model.
  write(p, rewrite(good, [](nlohmann::json& h, std::string&) {
    nlohmann::json cfg = nlohmann::json::parse(h["__metadata__"]["config"].get<std::string>());
    cfg["model"]["attn"] = "rope";
    h["__metadata__"]["config"] = cfg.dump();
  }));
  expect_error(load, {"is not part of the model", "model.attn = rope"});
  // A key given twice in the header.
  {
    std::string hdr = "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                      "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    std::string f(8, '\0');
    for (int i = 0; i < 8; ++i) f[i] = char((hdr.size() >> (8 * i)) & 0xff);
    write(p, f + hdr + std::string(4, '\0'));
    expect_error([&] { read_checkpoint(p); }, {"duplicate key \"w\""});
  }
}

// Arguments of evaluation, sampling and the repro commands are checked before any work (and any loop over
// them) starts.
TEST_F(EngineCheckpointErrors, CommandArgumentsChecked) {
  const std::string ck = dir + "/ckpt.safetensors";
  expect_error([&] { evaluate_checkpoint(ck, 0, Backend::cpu, 0); }, {"batch", "got 0"});
  expect_error([&] { evaluate_checkpoint(ck, -1, Backend::cpu, 0); }, {"batch", "got -1"});
  expect_error([&] { sample_checkpoint(ck, "", 5, -1.0, 0, 1, "cpu", 0); }, {"temperature"});
  expect_error([&] { sample_checkpoint(ck, "", 5, std::nan(""), 0, 1, "cpu", 0); }, {"temperature", "nan"});
  expect_error([&] { sample_checkpoint(ck, "", -1, 1.0, 0, 1, "cpu", 0); }, {"tokens"});
  expect_error([&] { sample_checkpoint(ck, "", 5, 1.0, -4, 1, "cpu", 0); }, {"top-k"});
  ReproOptions o;
  o.out_dir = dir + "/repro";
  o.progress = false;
  o.max_layers = 0;
  expect_error([&] { repro_a5(o); }, {"max-layers", "got 0"});
  o.max_layers = 1;
  o.lengths = {0};
  expect_error([&] { repro_a5(o); }, {"lengths", "got 0"});
  o.n_backs = {0};
  expect_error([&] { repro_mqrar(o); }, {"n:", "got 0"});
  expect_error([&] { parse_config_text("{\"model\": {\"n_layer\": 1, \"n_layer\": 2}}", "cfg"); },
               {"cfg: duplicate key \"model.n_layer\""});
}

// Inputs the fuzzers (tests/fuzz) found: each must give an EngineError, not an exception of the JSON library
// escaping the engine (or terminating a caller that catches EngineError only).
TEST(EngineErrors, FuzzerFindings) {
  // A number beyond double's range: nlohmann-json throws out_of_range, not parse_error.
  expect_error([] { parse_config_text("3e444batch_si28, \x0fmOy", "cfg"); }, {"cfg: not valid JSON"});
  expect_error([] { parse_config_text("{\"train\": {\"lr\": 1e999}}", "cfg"); }, {"cfg: not valid JSON"});
  expect_error([] { overlay_config(RunConfig(), overlay_from_sets({"train.lr=1e999"})); },
               {"train.lr: expected a number", "1e999"});
  // A --set value that is not UTF-8: refused by name, and the error message itself must not fail on it.
  const std::string bytes = "train.steps=tr2n" + std::string(20, '\xff') + "=rope";
  expect_error([&] { overlay_config(RunConfig(), overlay_from_sets({bytes})); }, {"--set train.steps", "UTF-8"});
}

TEST_F(EngineCheckpointErrors, FailedWriteKeepsOldFile) {
  // Writing into a path whose temp file cannot be created fails and leaves the existing checkpoint intact.
  const std::string p = dir + "/ckpt.safetensors";
  fs::create_directories(p + ".tmp");  // a directory where the temp file would go
  const float x[1] = {1};
  expect_error([&] { write_safetensors(p, {{"w", "F32", {1}, x, 4}}, {}); }, {"cannot create"});
  EXPECT_EQ(read(p), good);
  EXPECT_NO_THROW(read_checkpoint(p));
}

}  // namespace
}  // namespace pathattn::engine
