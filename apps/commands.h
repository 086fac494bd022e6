// apps/commands.h: each subcommand of the `pathattn` program registers itself from its own file.
#pragma once

#include <CLI/CLI.hpp>

namespace pathattn::app {

// Each register_* adds one or more subcommands to `app`; the subcommand's callback sets `*exit_code`.
void register_check(CLI::App& app, int* exit_code);   // apps/cmd_check.cpp
void register_bench(CLI::App& app, int* exit_code);   // apps/cmd_bench.cpp
void register_engine(CLI::App& app, int* exit_code);  // apps/cmd_engine.cpp: train, eval, sample, repro

}  // namespace pathattn::app
