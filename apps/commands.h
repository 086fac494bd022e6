// apps/commands.h: each subcommand of the `pathattn` program registers itself from its own file.
#pragma once

#include <CLI/CLI.hpp>

namespace pathattn::app {

// Counts and seeds: a decimal integer >= 0. CLI11 converts "-1" to an unsigned option by wrapping it to
// 2^64 - 1, and its NonNegativeNumber prints DBL_MAX as the bound; this says what is wrong.
inline CLI::Validator non_negative_int() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos)
          return "expected an integer >= 0, got " + s;
        return "";
      },
      "INT>=0");
}

// Each register_* adds one or more subcommands to `app`; the subcommand's callback sets `*exit_code`.
void register_check(CLI::App& app, int* exit_code);   // apps/cmd_check.cpp
void register_bench(CLI::App& app, int* exit_code);   // apps/cmd_bench.cpp
void register_engine(CLI::App& app, int* exit_code);  // apps/cmd_engine.cpp: train, eval, sample, repro, *-hf

}  // namespace pathattn::app
