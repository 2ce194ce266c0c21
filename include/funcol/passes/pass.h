// Pass infrastructure: the Pass interface, pass options and the pass registry (DESIGN §6).
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "funcol/graph/graph.h"

namespace funcol {

// A graph transformation. name() is the kebab-case string used in pipelines and logs; run()
// returns whether it changed the graph (XLA's HloPassInterface). Passes must be deterministic:
// decisions depend only on the graph and the options, never on pointer values.
class Pass {
 public:
  virtual ~Pass() = default;
  virtual std::string name() const = 0;
  virtual bool run(Graph& graph) = 0;

  // Where `funcol opt --explain` text goes (null: nowhere). Passes with decisions worth
  // explaining (bucketing) write to it; the others ignore it.
  void set_explain(std::ostream* out) { explain_ = out; }

 protected:
  std::ostream* explain_ = nullptr;
};

// The `key=value` options of one pass in a pipeline, in the order written.
class PassOptions {
 public:
  PassOptions() = default;
  explicit PassOptions(std::vector<std::pair<std::string, std::string>> entries)
      : entries_(std::move(entries)) {}

  const std::vector<std::pair<std::string, std::string>>& entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }
  // The value of `key`, or null when absent.
  const std::string* find(std::string_view key) const;
  std::string get(std::string_view key, std::string_view default_value) const;
  // Numeric values; throw InvalidArgument "option cap-mb of pass P must be a number, got 'x'".
  double get_double(std::string_view pass, std::string_view key, double default_value) const;
  int64_t get_int(std::string_view pass, std::string_view key, int64_t default_value) const;
  // `a:b:c` split on ':' ("cap-mb=1:25"); each part a number.
  std::vector<double> get_double_list(std::string_view pass, std::string_view key,
                                      std::vector<double> default_value) const;

 private:
  std::vector<std::pair<std::string, std::string>> entries_;
};

// What the registry knows about a pass: its name, a one-line description, the option names it
// accepts, and a factory.
struct PassInfo {
  std::string name;
  std::string description;
  std::vector<std::string> options;
  std::function<std::unique_ptr<Pass>(const PassOptions&)> create;
};

// The passes by name, sorted, so listings and error messages are deterministic.
class PassRegistry {
 public:
  // Throws InvalidArgument when a pass of that name exists.
  void add(PassInfo info);
  // The pass called `name`, or null.
  const PassInfo* find(std::string_view name) const;
  const std::vector<PassInfo>& passes() const { return passes_; }
  // "dce, overlap, ..." (for messages).
  std::string names() const;
  // Creates pass `name` with `options`; throws InvalidArgument "unknown pass 'x' (available:
  // ...)" or "unknown option 'k' for pass p (options: ...)".
  std::unique_ptr<Pass> create(std::string_view name, const PassOptions& options) const;

 private:
  std::vector<PassInfo> passes_;
};

// Registers every pass funcol has (src/passes/register.cc: one sorted list, one line per pass).
void register_all_passes(PassRegistry& registry);
// A registry holding every pass, built on first use.
const PassRegistry& default_pass_registry();

}  // namespace funcol
