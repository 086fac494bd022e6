// engine/checkpoint.h: checkpoints in the safetensors format, written by our own code: an 8-byte little-endian
// header length, a JSON header (tensor dtype / shape / data_offsets, plus string metadata), then the raw
// little-endian tensor bytes. Writes are atomic (temp file + fsync + rename); reads reject truncated,
// corrupt (checksum) and foreign files with a message that says which.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"
#include "engine/model.h"
#include "engine/optim.h"

namespace pathattn::engine {

// One tensor to write: raw bytes of a contiguous row-major array.
struct StTensor {
  std::string name;
  std::string dtype;  // "F32" | "F64" | "I64"
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t nbytes = 0;
};

// Writes a safetensors file atomically: path + ".tmp", fsync, rename over path, fsync of the directory.
// `metadata` values must be strings (safetensors rule). The data checksum (FNV-1a 64 of all tensor bytes)
// is added as metadata "data_fnv1a64". Throws EngineError on I/O failure (the old file is left intact).
void write_safetensors(const std::string& path, const std::vector<StTensor>& tensors,
                       const std::map<std::string, std::string>& metadata);

// A safetensors file read into memory and validated (bounds, dtypes, shapes, overlap, checksum).
struct StFile {
  std::map<std::string, std::string> metadata;
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // byte offsets into data
  };
  std::map<std::string, Entry> tensors;
  std::vector<uint8_t> data;
};
// Throws EngineError naming the file and the defect ("truncated", "corrupt", "not a safetensors file").
// Dtypes F32, F64, I64, BF16 and F16 are read. require_checksum = false takes files written by other tools
// (no "data_fnv1a64"; a checksum that is present is still checked).
StFile read_safetensors(const std::string& path, bool require_checksum = true);

// The engine's checkpoint: metadata format = "pathattn-engine", version = "1", config (full JSON), step
// (completed optimizer steps, in [0, train.steps]), dtype, adam_t (= step); tensors: every parameter by its
// layout name, and "optim.m.<name>" / "optim.v.<name>" for AdamW's moments, nothing else. `extra` adds
// string metadata (the training loop's log state).
inline constexpr const char* kCheckpointFormat = "pathattn-engine";

template <typename T>
void save_checkpoint(const std::string& path, const RunConfig& cfg, const Model<T>& model, const AdamW<T>& opt,
                     int64_t step, const std::map<std::string, std::string>& extra = {});

struct CheckpointInfo {
  RunConfig config;
  int64_t step = 0;
  std::string dtype;
  StFile file;
};
// Reads and checks a checkpoint (safetensors validity with the data checksum required, then that it is a
// pathattn-engine checkpoint with a parseable config and counters in range). Throws EngineError.
CheckpointInfo read_checkpoint(const std::string& path);
// Copies parameters (and AdamW state when opt is given) into a model built from info.config, checking every
// name, dtype and shape, and that the file holds no tensor the model lacks. Throws EngineError on any mismatch.
template <typename T>
void restore_checkpoint(const CheckpointInfo& info, Model<T>& model, AdamW<T>* opt);

}  // namespace pathattn::engine
