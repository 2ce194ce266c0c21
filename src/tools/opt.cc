// `funcol opt`: parse and verify IR, run a pass pipeline, print IR or Graphviz (DESIGN §7).
#include "tools/opt.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <new>
#include <sstream>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/pipeline.h"
#include "tools/commands.h"
#include "tools/json_line.h"
#include "tools/launch.h"

namespace funcol::tools {
namespace {

constexpr std::string_view kSplitMarker = "// -----";

// One case of the input: its text and the line it starts on.
struct Chunk {
  std::string_view text;
  uint32_t first_line = 1;
};

std::vector<Chunk> split_cases(std::string_view text, bool split) {
  if (!split) return {Chunk{text, 1}};
  std::vector<Chunk> chunks;
  size_t start = 0;
  uint32_t start_line = 1;
  uint32_t line = 1;
  size_t pos = 0;
  while (pos <= text.size()) {
    // Lines end as the parser's do: "\n", "\r\n" or a lone "\r".
    const size_t eol = std::min(text.find_first_of("\r\n", pos), text.size());
    const size_t next =
        eol == text.size() ? eol : eol + (text.substr(eol, 2) == "\r\n" ? 2 : 1);
    if (text.substr(pos, kSplitMarker.size()) == kSplitMarker) {
      chunks.push_back(Chunk{text.substr(start, pos - start), start_line});
      start = next;
      start_line = line + 1;
    }
    if (eol == text.size()) break;
    pos = next;
    ++line;
  }
  // A separator that ends the file (blank lines at most after it) opens no case, as in
  // mlir-opt.
  const std::string_view rest = text.substr(std::min(start, text.size()));
  if (chunks.empty() || rest.find_first_not_of(" \t\r\n") != std::string_view::npos) {
    chunks.push_back(Chunk{rest, start_line});
  }
  return chunks;
}

// Per-pass totals over every graph and case, in pipeline order.
struct StatsCollector {
  std::vector<PassStat> passes;
  size_t nodes = 0;
  std::map<std::string, size_t> ops;  // sorted: deterministic JSON

  void add_passes(const std::vector<PassStat>& run) {
    if (passes.empty()) {
      passes = run;
      return;
    }
    for (size_t i = 0; i < run.size() && i < passes.size(); ++i) {
      passes[i].ms += run[i].ms;
      passes[i].changed = passes[i].changed || run[i].changed;
    }
  }

  void add_graph(const Graph& g) {
    nodes += g.num_nodes();
    for (const Node& n : g.nodes()) ++ops[std::string(n.op_name())];
  }

  std::string json() const {
    nlohmann::ordered_json j;
    j["nodes"] = nodes;
    j["ops"] = nlohmann::ordered_json::object();
    for (const auto& [op, count] : ops) j["ops"][op] = count;
    j["passes"] = nlohmann::ordered_json::array();
    for (const PassStat& p : passes) {
      j["passes"].push_back({{"name", p.name}, {"ms", p.ms}, {"changed", p.changed}});
    }
    return json_line(j);
  }
};

class OptRun {
 public:
  OptRun(const OptOptions& options, std::ostream& err) : options_(options), err_(err) {}

  int run(std::ostream& out) {
    if (options_.emit != "ir" && options_.emit != "dot") {
      return fail("--emit must be ir or dot, got '" + options_.emit + "'");
    }
    Pipeline pipeline;
    try {
      pipeline = Pipeline::parse(options_.pipeline);
    } catch (const Error& e) {
      return fail(e.what());
    }
    if (options_.explain) pipeline.set_explain(&err_);

    std::string text;
    try {
      text = read_text_file(options_.file);
    } catch (const Error& e) {
      return fail(e.what());
    }
    const std::string file = options_.file == "-" ? "<stdin>" : options_.file;

    std::string result;
    bool ok = true;
    const std::vector<Chunk> chunks = split_cases(text, options_.split_input_file);
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (i) result += std::string(kSplitMarker) + "\n";
      ok = run_case(chunks[i], file, pipeline, result) && ok;
    }
    // Stats describe output graphs: none when the only case failed.
    if (options_.stats && (ok || options_.split_input_file)) err_ << stats_.json() << "\n";
    // --stats and --explain are outputs too (on stderr): one that could not be written fails
    // the command, as an unwritable -o does, though there is nowhere left to say so.
    if ((options_.stats || options_.explain) && !err_.flush()) return 1;
    if (!ok && !options_.split_input_file) return 1;
    if (const int rc = write(out, result); rc != 0) return rc;
    return ok ? 0 : 1;
  }

 private:
  const OptOptions& options_;
  std::ostream& err_;
  StatsCollector stats_;

  int fail(const std::string& message) {
    err_ << "funcol opt: error: " << message << "\n";
    return 1;
  }

  // Parses, verifies, transforms and prints one case into `result`; reports its error.
  bool run_case(const Chunk& chunk, const std::string& file, const Pipeline& pipeline,
                std::string& result) {
    Module module;
    try {
      module = parse_module(chunk.text, ParseOptions{.file = file, .first_line = chunk.first_line});
    } catch (const ParseError& e) {
      err_ << e.what() << "\n";
      return false;
    }
    if (module.graphs().empty()) {
      err_ << no_graph_error(file, chunk.first_line).what() << "\n";
      return false;
    }
    // Counted once every graph of the case passed: a failed case prints none of its graphs, so
    // --stats, which describes the output, counts none either (it counted those before the
    // failing one).
    std::vector<std::vector<PassStat>> stats(module.graphs().size());
    try {
      for (size_t i = 0; i < module.graphs().size(); ++i) {
        verify(*module.graphs()[i]);
        pipeline.run(*module.graphs()[i], &stats[i]);
      }
    } catch (const Error& e) {
      // A pass's error about one node starts with the node's FILE:LINE:COL (DESIGN section 5).
      if (const auto* at = dynamic_cast<const SourceLocated*>(&e)) {
        err_ << at->located() << "\n";
      } else {
        err_ << file << ": error: " << e.what() << "\n";
      }
      return false;
    }
    for (size_t i = 0; i < module.graphs().size(); ++i) {
      stats_.add_passes(stats[i]);
      stats_.add_graph(*module.graphs()[i]);
    }
    result += options_.emit == "dot" ? to_dot(module) : print(module);
    return true;
  }

  int write(std::ostream& out, const std::string& result) {
    // The reason (a directory, a full disk, a closed stdout), as the other tools say it.
    auto reason = [] { return std::string(errno != 0 ? std::strerror(errno) : "write error"); };
    errno = 0;
    if (options_.output.empty() || options_.output == "-") {
      out.write(result.data(), static_cast<std::streamsize>(result.size()));
      out.flush();
      return out ? 0 : fail("cannot write the output: " + reason());
    }
    std::ofstream f(options_.output, std::ios::binary);
    f.write(result.data(), static_cast<std::streamsize>(result.size()));
    f.close();
    return f ? 0 : fail("cannot write " + options_.output + ": " + reason());
  }
};

}  // namespace

int run_opt(const OptOptions& options, std::ostream& out, std::ostream& err) {
  try {
    return OptRun(options, err).run(out);
  } catch (const std::bad_alloc&) {
    err << "funcol opt: error: out of memory\n";
  } catch (const std::exception& e) {
    err << "funcol opt: internal error: " << e.what() << "\n";
  }
  return 1;
}

void add_opt_command(CLI::App& app) {
  auto options = std::make_shared<OptOptions>();
  CLI::App* sub = app.add_subcommand(
      "opt", "parse and verify IR, run a pass pipeline, print the result (IR or Graphviz)");
  sub->add_option("file", options->file, "IR file ('-': standard input)")->required();
  sub->add_option("-p,--pipeline", options->pipeline,
                  "passes to run, e.g. 'bucket-all-gather{cap-mb=25},dce'");
  sub->add_option("-o,--output", options->output, "write the result here instead of stdout")
      ->check(given("a file name ('-': standard output)"));
  sub->add_flag("--stats", options->stats,
                "write {\"nodes\", \"ops\", \"passes\"} as one JSON line to stderr (with "
                "--split-input-file: totals over the cases)");
  sub->add_flag("--explain", options->explain,
                "write the bucketing passes' buckets and skips, and overlap's moves, to stderr");
  sub->add_option("--emit", options->emit, "output format: ir or dot")
      ->check(CLI::IsMember({"ir", "dot"}));
  sub->add_flag("--split-input-file", options->split_input_file,
                "handle each '// -----'-separated case of FILE on its own");
  sub->callback([options] {
    const int rc = run_opt(*options, std::cout, std::cerr);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace funcol::tools
