// apps/main.cpp: the `pathattn` command-line program. Subcommands live in apps/cmd_*.cpp.
#include <cstdio>

#include "commands.h"
#include "pathattn/attention.h"

int main(int argc, char** argv) {
  CLI::App app{"pathattn: PaTH attention (accumulating Householder position encoding) in C++"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("pathattn 0.1.0 (") + pathattn::build_info() + ")");
  int exit_code = 0;
  pathattn::app::register_check(app, &exit_code);
  pathattn::app::register_bench(app, &exit_code);
  pathattn::app::register_engine(app, &exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}
