// apps/cmd_engine.cpp: placeholder registration until the subcommand lands.
#include "commands.h"

namespace pathattn::app {
void register_engine(CLI::App&, int*) {}
}  // namespace pathattn::app
