// apps/cmd_bench.cpp: placeholder registration until the subcommand lands.
#include "commands.h"

namespace pathattn::app {
void register_bench(CLI::App&, int*) {}
}  // namespace pathattn::app
