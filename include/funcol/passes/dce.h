// Dead code elimination: removes every node whose results are unused, except side effects.
#pragma once

#include <string>

#include "funcol/passes/pass.h"

namespace funcol {

// Erases every node without a side effect (collectives and wait_tensor have one) whose results
// reach neither another node nor the graph's outputs, in one backward sweep. Graph inputs stay
// (they are the signature). Returns whether anything was erased.
bool eliminate_dead_code(Graph& graph);

// The `dce` pass (no options).
class DcePass : public Pass {
 public:
  std::string name() const override { return "dce"; }
  bool run(Graph& graph) override { return eliminate_dead_code(graph); }
};

}  // namespace funcol
