// Pass pipelines: the text form `name{key=value ...},name,...` (DESIGN §6) and running them.
#pragma once

#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/passes/pass.h"

namespace funcol {

// One element of a pipeline as written: `bucket-all-gather{cap-mb=1:25 mode=multidtype}`.
struct PassSpec {
  std::string name;
  PassOptions options;
};

// Parses a pipeline. Names are letters, digits, '-' and '_'; options are space-separated
// `key=value` pairs whose values hold no space, ',', '{', '}' or '='. An empty (or blank) text
// is the empty pipeline. Throws InvalidArgument naming the column of the first error:
// "invalid pass pipeline 'dce{': expected an option or '}' at column 5".
std::vector<PassSpec> parse_pipeline(std::string_view text);

// Timing of one pass run.
struct PassStat {
  std::string name;
  double ms = 0;
  bool changed = false;
};

// A sequence of created passes.
class Pipeline {
 public:
  Pipeline() = default;
  // Parses `text` and creates every pass from `registry` (unknown pass or option: InvalidArgument).
  static Pipeline parse(std::string_view text,
                        const PassRegistry& registry = default_pass_registry());

  void add(std::unique_ptr<Pass> pass) { passes_.push_back(std::move(pass)); }
  const std::vector<std::unique_ptr<Pass>>& passes() const { return passes_; }
  size_t size() const { return passes_.size(); }
  void set_explain(std::ostream* out);

  // Runs every pass on `graph` in order; with `verify_each`, verifies after every pass and names
  // the pass that broke the graph (InvalidArgument "pass 'x' produced an invalid graph: ...").
  // Appends one PassStat per pass to `stats` when given. Returns whether any pass changed it.
  bool run(Graph& graph, std::vector<PassStat>* stats = nullptr, bool verify_each = true) const;

 private:
  std::vector<std::unique_ptr<Pass>> passes_;
};

}  // namespace funcol
