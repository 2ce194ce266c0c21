// Autodiff: turns a forward graph whose first output is a scalar loss into the joint graph that
// also returns the loss's gradients (DESIGN §6; collective rules of DESIGN §4).
#pragma once

#include <string>
#include <vector>

#include "funcol/passes/pass.h"

namespace funcol {

// Builds the joint graph of `forward`: the same inputs; outputs = [loss, d loss / d input
// wrt[0], ...] where loss is forward's first output (one element of a floating dtype; else
// InvalidArgument). Inputs not reached by the loss get zeros. Deterministic: program order, no
// pointer-keyed iteration. The forward nodes come first (so its collectives are issued before
// the backward ones), then the backward, each backward collective followed by its wait_tensor;
// nodes whose results nothing uses are dropped (never collectives or waits). Throws
// InvalidArgument for an index out of range, repeated, or of a non-floating input, and for ops
// without a usable gradient rule on the way (a non-sum all_reduce or reduce_scatter: "all_reduce
// backward only supports 'sum' reduction, got 'max' (node %ar at m.ir:3:3)", the place only for
// a node parsed from IR text; broadcast).
Graph build_joint_graph(const Graph& forward, const std::vector<int>& wrt);

// build_joint_graph done on `graph` itself (the pass).
void make_joint_graph(Graph& graph, const std::vector<int>& wrt);

// The floating-point inputs of `graph`, in order (the pass's default wrt).
std::vector<int> floating_inputs(const Graph& graph);

// The `autodiff` pass: `autodiff{wrt=0:2}` (a colon list of input indices; default: every
// floating-point input) replaces the graph with its joint graph.
class AutodiffPass : public Pass {
 public:
  // Empty `wrt` with `all_floating`: every floating input of the graph it runs on.
  explicit AutodiffPass(std::vector<int> wrt = {}, bool all_floating = true)
      : wrt_(std::move(wrt)), all_floating_(all_floating) {}
  std::string name() const override { return "autodiff"; }
  bool run(Graph& graph) override;

 private:
  std::vector<int> wrt_;
  bool all_floating_;
};

// Creates the pass from pipeline options (`wrt`); throws InvalidArgument for a malformed list.
std::unique_ptr<Pass> make_autodiff_pass(const PassOptions& options);

}  // namespace funcol
