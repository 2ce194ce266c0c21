// `funcol run` internals: options, mesh flag parsing, output formatting and the command itself.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "funcol/core/tensor.h"
#include "funcol/dist/backend.h"

namespace funcol::tools {

// The flags of `funcol run` (DESIGN §7).
struct RunOptions {
  std::string file;                 // IR file; "-" reads standard input
  int ranks = 0;                    // --ranks (>= 1; the CLI defaults it to --world-size)
  std::string backend = "threads";  // --backend threads|mpi|gloo
  std::string mesh;                 // --mesh dp=2,tp=2 (empty: no mesh)
  uint64_t seed = 0;                // --seed
  std::string outputs;              // --outputs json (empty: a short human summary)
  int iters = 1;                    // --iters
  std::string trace;                // --trace OUT.json (empty: no trace)
  std::string graph;                // --graph NAME (empty: the file's only graph)
  InitOptions join;                 // --rank, --world-size, --store: gloo joins that job
};

// Parses a --mesh value "dp=2,tp=2" into (name, size) pairs. Names are IR-style identifiers,
// unique, not "world"; sizes >= 1. Throws InvalidArgument naming the offending part.
std::vector<std::pair<std::string, int>> parse_mesh(std::string_view text);

// One rank's line of --outputs json: {"rank": r, "outputs": [{"dtype": "f32", "shape": [2],
// "digest": "<16 hex>", "data": [..]}]}. `data` only for tensors of at most 4096 elements;
// floats round-trip exactly (%.9g for f32, f16 and bf16, %.17g for f64); NaN and infinities are
// the strings "nan", "inf", "-inf"; bools are true/false.
std::string outputs_json_line(int rank, const std::vector<Tensor>& outputs);

// Runs the command: parses and checks everything before any rank starts, runs the graph on
// every rank (threads: in this process; mpi/gloo: as this process's rank inside a job, from the
// environment or options.join, or by starting the job when not inside one), prints results to `out`
// and errors to `err` as "funcol: error: ..." (parse errors as "FILE:LINE:COL: error: ..."), once.
// Returns the exit status: 0 on success, 1 on any error, 128 + N when a launcher was stopped by
// signal N.
int run_command(const RunOptions& options, std::FILE* out, std::FILE* err);

}  // namespace funcol::tools
