// apps/cmd_check.cpp: placeholder registration until the subcommand lands.
#include "commands.h"

namespace pathattn::app {
void register_check(CLI::App&, int*) {}
}  // namespace pathattn::app
