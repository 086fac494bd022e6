// tests/fuzz/fuzz_checkpoint.cpp: libFuzzer target for the checkpoint loader: the input is written to a file
// and read with read_checkpoint; a checkpoint that reads is restored into the model its config describes
// (when that model is small). Errors must be EngineError; nothing may read out of bounds.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "engine/checkpoint.h"
#include "engine/model.h"
#include "engine/optim.h"

using namespace pathattn::engine;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/pathattn_fuzz_checkpoint_" + std::to_string(::getpid()) + ".safetensors";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    const CheckpointInfo ck = read_checkpoint(path);
    ModelConfig m = ck.config.model;
    if (m.vocab_size == 0) m.vocab_size = 2;
    int64_t n = 0;
    for (const ParamInfo& p : param_layout(m)) n += p.numel;
    if (n > (int64_t(1) << 20)) return 0;  // a model too large to build quickly: the header checks ran
    if (ck.dtype == "f64") {
      Model<double> model(m);
      AdamW<double> opt;
      restore_checkpoint(ck, model, &opt);
    } else {
      Model<float> model(m);
      AdamW<float> opt;
      restore_checkpoint(ck, model, &opt);
    }
  } catch (const EngineError&) {
  }
  return 0;
}
