// engine/embedded.h: the default configs of configs/*.json, embedded into the library at build time so the
// `pathattn repro` commands run without the source tree.
#pragma once

#include <string>
#include <vector>

namespace pathattn::engine {

// The text of configs/<stem>.json; throws EngineError if no such config was embedded.
const std::string& embedded_config(const std::string& stem);
std::vector<std::string> embedded_config_names();

}  // namespace pathattn::engine
