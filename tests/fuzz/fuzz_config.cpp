// tests/fuzz/fuzz_config.cpp: libFuzzer target for the config parser (engine/config.h). Any input must
// either parse or throw EngineError; a parsed config must survive config_to_json -> parse_config unchanged.
#include <cstdint>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/config.h"

using namespace pathattn::engine;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  RunConfig c;
  try {
    c = parse_config_text(text, "fuzz");
  } catch (const EngineError&) {
    return 0;
  }
  try {
    validate_config(c);
  } catch (const EngineError&) {
  }
  const nlohmann::json j = config_to_json(c);
  if (config_to_json(parse_config(j)) != j) std::abort();  // the written form reads back to itself
  return 0;
}
