// `funcol opt` as a library function, so tests can run it in-process.
#pragma once

#include <ostream>
#include <string>

namespace funcol::tools {

// The flags of `funcol opt FILE [-p PIPELINE] [-o OUT] [--stats] [--explain] [--emit=ir|dot]
// [--split-input-file]` (DESIGN §7).
struct OptOptions {
  std::string file;      // "-": standard input
  std::string pipeline;  // empty: no passes
  std::string output;    // empty: `out`
  bool stats = false;
  bool explain = false;
  std::string emit = "ir";  // "ir" or "dot"
  // Cuts the input at lines starting with "// -----" and handles each case on its own (lit
  // tests, as mlir-opt): an error in one case is reported and the others still run; the
  // outputs are joined by "// -----" lines. Locations stay those of the whole file.
  bool split_input_file = false;
};

// Parses, verifies, runs the pipeline on every graph and writes the result. Errors go to `err`
// as one line each ("FILE:LINE:COL: error: ..." for malformed IR); --stats and --explain write
// to `err` too. Returns the exit code: 0, or 1 after any error. Never throws.
int run_opt(const OptOptions& options, std::ostream& out, std::ostream& err);

}  // namespace funcol::tools
