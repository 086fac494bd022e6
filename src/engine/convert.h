// engine/convert.h: `pathattn convert`: a checkpoint of one attention kind (typically RoPE) turned into a
// checkpoint of another (PaTH, PaTH-FoX, or the same kind) for continued training.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"

namespace pathattn::engine {

struct ConvertOptions {
  std::string attn;             // target model.attn: path, path-fox, fox, rope, nope
  nlohmann::json overlay;       // "--set" overrides applied to the source config (train.steps, train.seed, ...)
  double beta_bias = -3.0;      // initial b_beta of new PaTH layers: beta = 2 sigmoid(b_beta) (0.095 at -3)
  double gate_bias = 5.0;       // initial b_g of new forget gates: log f = logsigmoid(b_g) (-0.0067 at 5)
  uint64_t seed = 0;            // draws the new w projections and conv (0: the target config's train.seed)
};

struct ConvertResult {
  RunConfig config;                     // the converted checkpoint's config
  std::vector<std::string> carried;     // tensors copied from the source
  std::vector<std::string> initialised; // tensors the source lacks, set by the rule below
  std::vector<std::string> dropped;     // source tensors the target model has no place for
};

// Reads the checkpoint `in`, builds the target model (source config, model.attn = opt.attn, then
// opt.overlay), and writes `out` as a fresh engine checkpoint (step 0, zero AdamW moments) ready for
// `pathattn train --resume out`:
//  - every tensor both models have (embedding, norms, q/k/v/o, MLP, LM head) is copied unchanged; a shape
//    that differs is an error naming the tensor;
//  - new PaTH tensors: the w projections (ww1, ww2 or ww) and the conv are drawn as a fresh model's are
//    (their scale is normalised away: w is L2-normalised per head); W_beta = 0 and b_beta = beta_bias, so
//    every beta starts at 2 sigmoid(beta_bias) whatever the input;
//  - new gates: W_g = 0 and b_g = gate_bias.
// With beta_bias -> -inf (beta = 0 exactly in floating point from about -800) every Householder factor is
// the identity and the converted model computes what the source weights compute with no position encoding
// (tests/cpp/test_engine_convert.cpp). Throws EngineError naming the argument, tensor or key at fault.
ConvertResult convert_checkpoint(const std::string& in, const std::string& out, const ConvertOptions& opt);

}  // namespace pathattn::engine
