// tests/fuzz/fuzz_set.cpp: libFuzzer target for the command line's --set overrides (overlay_from_sets, then
// overlay_config and validate_config): one override per input line. Errors must be EngineError.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/config.h"

using namespace pathattn::engine;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> sets;
  std::string cur;
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') {
      sets.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(char(data[i]));
    }
  }
  sets.push_back(cur);
  try {
    const RunConfig c = overlay_config(RunConfig(), overlay_from_sets(sets));
    validate_config(c);
  } catch (const EngineError&) {
  }
  return 0;
}
