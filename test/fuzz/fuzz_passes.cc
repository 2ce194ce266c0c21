// libFuzzer target for the passes: every graph the parser accepts goes through each pipeline
// below. A pass may refuse a graph only with a user-facing error (autodiff: a graph that has no
// scalar loss or an op without a gradient); otherwise it must leave a graph that verifies, with
// no more collectives than before, and the same output every time it runs (ranks must agree).
// Each bucketing pass alone must also be idempotent: run again on its printed result (as a
// second `funcol opt` would), it prints the same graph.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/pipeline.h"

namespace {

[[noreturn]] void fail(const std::string& what, const std::string& input) {
  std::fprintf(stderr, "funcol_fuzz_passes: %s\ninput graph:\n%s\n", what.c_str(), input.c_str());
  std::abort();
}

struct Case {
  const char* pipeline;
  bool may_refuse;  // InvalidArgument / ShapeError are answers for some valid graphs
};

constexpr Case kCases[] = {
    {"bucket-all-gather,bucket-reduce-scatter,bucket-all-reduce,dce", false},
    {"bucket-all-gather{cap-mb=0.0001:0.01},bucket-reduce-scatter{cap-mb=0.001},"
     "bucket-all-reduce{cap-mb=0.0005:1}",
     false},
    {"bucket-all-gather{mode=custom_ops},bucket-reduce-scatter{mode=custom_ops},"
     "bucket-all-reduce{mode=custom_ops},overlap",
     false},
    {"bucket-all-gather{mode=multidtype},overlap,dce", false},
    {"bucket-all-gather{mode=custom_ops_multidtype cap-mb=0.002},bucket-all-reduce,"
     "bucket-reduce-scatter{mode=custom_ops},overlap{memory-budget-mb=1}",
     false},
    {"overlap", false},
    {"overlap{memory-budget-mb=0.001}", false},
    {"autodiff,bucket-all-gather,bucket-reduce-scatter,overlap,dce", true},
};

// Single bucketing passes, each checked for idempotence (a pipeline of several is not a fixed
// point in general: a multidtype bucket may give a later default pass a new all-gather).
constexpr const char* kIdempotent[] = {
    "bucket-all-gather",
    "bucket-all-gather{mode=custom_ops cap-mb=0.0005}",
    "bucket-all-gather{mode=multidtype cap-mb=0.0001:0.001}",
    "bucket-all-gather{mode=custom_ops_multidtype cap-mb=0.002}",
    "bucket-reduce-scatter{cap-mb=0.0001:0.001}",
    "bucket-reduce-scatter{mode=custom_ops cap-mb=0.0005}",
    "bucket-all-reduce{cap-mb=0.0001:0.001}",
    "bucket-all-reduce{cap-mb=0.0001:0.001:0.0001}",
    "bucket-all-reduce{cap-mb=0.0001:0.0001:0.001}",
    "bucket-all-reduce{mode=custom_ops cap-mb=0.0005}",
};

int64_t count_collectives(const funcol::Graph& graph) {
  int64_t n = 0;
  for (const funcol::Node* node : graph.node_list()) n += node->op().is_collective() ? 1 : 0;
  return n;
}

// Runs `c` on a fresh copy of the graph; returns the printed result, or "" when refused.
std::string run_case(const std::string& printed, const Case& c) {
  funcol::Module module = funcol::parse_module(printed, funcol::ParseOptions{.file = "in.ir"});
  funcol::Graph& graph = *module.graphs().front();
  const int64_t before = count_collectives(graph);
  const funcol::Pipeline pipeline = funcol::Pipeline::parse(c.pipeline);
  try {
    pipeline.run(graph);
  } catch (const funcol::InternalError& e) {
    fail(std::string(c.pipeline) + ": internal error: " + e.what(), printed);
  } catch (const funcol::Error& e) {
    // InvalidArgument "pass 'x' produced an invalid graph" is a bug of the pass.
    if (!c.may_refuse || std::string_view(e.what()).find("produced an invalid graph") !=
                             std::string_view::npos) {
      fail(std::string(c.pipeline) + ": " + e.what(), printed);
    }
    return "";
  }
  try {
    funcol::verify(graph);
  } catch (const funcol::Error& e) {
    fail(std::string(c.pipeline) + ": result does not verify: " + e.what(), printed);
  }
  if (!c.may_refuse && count_collectives(graph) > before) {
    fail(std::string(c.pipeline) + ": more collectives than before", printed);
  }
  return funcol::print(graph);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  funcol::Module module;
  try {
    // Only valid graphs: fuzz_ir checks how malformed input fails.
    module = funcol::parse_module(std::string_view(reinterpret_cast<const char*>(data), size),
                                  funcol::ParseOptions{.file = "fuzz.ir"});
    funcol::verify(module);
  } catch (const funcol::Error&) {
    return 0;
  }
  for (const auto& graph : module.graphs()) {
    // The graph alone, parsed again by each case.
    const std::string printed = funcol::print(*graph);
    for (const Case& c : kCases) {
      const std::string once = run_case(printed, c);
      if (run_case(printed, c) != once) {
        fail(std::string(c.pipeline) + ": a second run on the same graph printed differently",
             printed);
      }
    }
    for (const char* pass : kIdempotent) {
      const Case c{pass, false};
      const std::string once = run_case(printed, c);
      if (once == printed) continue;  // a fixed point already (each run prints the same)
      const std::string twice = run_case(once, c);
      if (twice != once) {
        fail(std::string(pass) + ": not idempotent; after one run:\n" + once +
                 "\nafter two:\n" + twice,
             printed);
      }
    }
  }
  return 0;
}
