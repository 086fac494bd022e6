// engine/embedded.cpp: lookup of the configs embedded from configs/*.json (see src/engine/CMakeLists.txt).
#include "engine/embedded.h"

#include <map>

#include "engine/config.h"

namespace pathattn::engine {
namespace {
const std::map<std::string, std::string>& table() {
  static const std::map<std::string, std::string> t = {
#include "engine_configs.inc"
  };
  return t;
}
}  // namespace

const std::string& embedded_config(const std::string& stem) {
  auto it = table().find(stem);
  if (it == table().end()) throw EngineError("no embedded config named \"" + stem + "\"");
  return it->second;
}

std::vector<std::string> embedded_config_names() {
  std::vector<std::string> out;
  for (const auto& [k, v] : table()) out.push_back(k);
  return out;
}

}  // namespace pathattn::engine
