// The funcol command's subcommands; each file adds one to the CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace funcol::tools {

// `funcol bench`: nccl-tests style collective micro-benchmarks (bench.cc).
void add_bench_command(CLI::App& app);

}  // namespace funcol::tools
