// engine/repro.h: the paper's synthetic experiments as commands (docs/reproductions.md): flip-flop (Table 1), the A5 word
// problem and MQRAR-N (Figure 2), and the long-context tasks at lengths beyond training. Each trains its models
// from an embedded default config (configs/*.json), prints a table and writes table.md / results.json into its
// output directory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"

namespace pathattn::engine {

struct ReproOptions {
  std::string out_dir;              // runs go to <out_dir>/<model>_s<seed>[...]; table.md, results.json
  std::string preset;               // embedded config name; empty: the command's default
  nlohmann::json overlay = nlohmann::json::object();  // applied on top of the preset (same schema)
  std::vector<std::string> models;  // attention kinds; empty: the command's default
  std::vector<uint64_t> seeds = {1};
  std::vector<int> lengths;         // a5: word lengths (default 5 10 15 20)
  int max_layers = 4;               // a5: deepest model tried
  std::vector<int> n_backs;         // mqrar: N values (default 1 2 3 4)
  std::vector<int> scales;          // long-context: evaluation lengths as multiples of the training length
                                    // (default 1 2 4 8, and 16 when training on cuda)
  std::vector<double> depths;       // long-context: needle depths of niah single (default 0 .25 .5 .75 1)
  bool reuse = false;               // long-context: a (kind, seed) whose <run>/long_context.json holds the same
                                    // config and evaluations is read back instead of trained again
  bool progress = true;
  std::string device;               // train.device of every run ("cpu" | "cuda"); empty: the preset's
};

// Each returns the results as JSON and prints the table to stdout. Throws EngineError.
nlohmann::json repro_flipflop(const ReproOptions& o);
nlohmann::json repro_a5(const ReproOptions& o);
nlohmann::json repro_mqrar(const ReproOptions& o);
// Trains each attention kind (default rope, path, fox, path-fox; equal parameter counts through the MLP width)
// on the preset's task mixture (default repro_long_context), once per seed, then evaluates every component at
// each scale x the training length (niah single at each needle depth). Writes results.jsonl (one line per
// evaluation), results.json, table.md (exact match, mean and spread over seeds) and plot.svg.
nlohmann::json repro_long_context(const ReproOptions& o);

// Shared by the repro commands: the preset (o.preset, else `def`) with o.overlay and o.device applied; the
// paper's name of an attention kind (PaTH, PaTH-FoX, FoX, RoPE, NoPE).
RunConfig repro_preset(const ReproOptions& o, const std::string& def);
std::string attn_display_name(const std::string& kind);

class Rng;

// The next token from one row of logits: argmax at temperature <= 0, otherwise a draw from
// softmax(logits / temperature) restricted to the top_k largest (top_k <= 0: all), one rng.uniform() per call.
template <typename T>
int32_t choose_token(const T* logits, int64_t vocab, double temperature, int top_k, Rng& rng);

// Samples `n` tokens after `prompt` from a checkpoint (temperature 0: greedy; top_k 0: no cut). Returns the
// decoded continuation. The prompt is prefilled into the model's decode caches (Model::prefill) and each
// token after the first is one Model::decode_step; the length is not capped at the config's seq_len.
std::string sample_checkpoint(const std::string& path, const std::string& prompt, int n, double temperature,
                              int top_k, uint64_t seed, const std::string& backend, int threads);

}  // namespace pathattn::engine
