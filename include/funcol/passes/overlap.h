// Overlap scheduling: issues each collective as early and waits as late as dependencies allow.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "funcol/graph/graph.h"
#include "funcol/passes/pass.h"

namespace funcol {

// Options of the overlap pass. The budget bounds the bytes of collective results held before
// they are read: a collective's result buffer exists from its issue on, so issuing it earlier
// holds that memory over more nodes (up to and including the first node that reads the
// waited result; waits and views of it do not read it). A collective stops moving up at the
// first node where the held bytes plus its own would exceed the budget (one larger than the
// budget alone does not move). No budget (the default, as Inductor's reordering without a
// memory limit): move as far as dependencies allow. Waits move regardless of the budget: where
// a wait sits changes when the rank blocks, not how long any buffer lives. Not counted: a
// collective's input (held until it completes; a reduce-scatter's is group_size times its
// result), nor the results of the operand nodes moved up with it (a bucket's packing).
struct OverlapOptions {
  int64_t memory_budget_bytes = -1;  // < 0, or INT64_MAX: unlimited
};

// What one run did.
struct OverlapStats {
  int64_t collectives_hoisted = 0;  // collectives moved earlier
  int64_t waits_sunk = 0;           // wait_tensor nodes moved later
  int64_t budget_stops = 0;         // hoists cut short by the memory budget
  int64_t operands_hoisted = 0;     // side-effect-free nodes moved up with their collective
  int64_t unpack_sunk = 0;          // unpacking nodes moved down towards their users
  bool changed() const { return collectives_hoisted + waits_sunk + unpack_sunk > 0; }
};

// Reorders `graph` so communication overlaps compute, in two walks in program order:
//  1. every collective moves up to just after the previous collective (under a memory budget,
//     to just after the last node on the way where the held bytes plus its own would exceed
//     the budget, if that comes later), with the side-effect-free nodes that compute its
//     operands after that point (a bucket's packing), in their order; when those include a
//     wait, the collective alone moves up to just after the latest of its operands'
//     definitions and that point. The issue order of collectives never changes (backends run the collectives of
//     a group in issue order, so hoisting one above another would only delay the other, and
//     every rank must issue them in one order anyway);
//  2. every wait_tensor, and every view op that only unpacks a waited result (a bucket's view,
//     split and reshapes), moves down to just before the first node that needs it and is
//     neither (to the end when there is none); the nodes bound for one place keep their order,
//     so running the pass again moves nothing and reports no change.
// Nodes move only after their operands and before their users, so the result verifies and
// computes the same values. Deterministic (decisions depend only on the graph and
// the options); positions come from an order-statistic tree kept beside the node list, so
// the pass is O(nodes log nodes) in all (a move, an order comparison and the count of nodes
// crossed cost O(log nodes), never a walk; with a budget, a segment tree of the held bytes
// finds where each hoist stops and follows each move in O(log nodes) too). When `explain` is
// given, appends one line per move.
OverlapStats schedule_overlap(Graph& graph, const OverlapOptions& options = {},
                              std::string* explain = nullptr);

// The `overlap` pass (option memory-budget-mb: a positive number of MB, 1 MB = 2^20 bytes).
class OverlapPass : public Pass {
 public:
  explicit OverlapPass(OverlapOptions options = {}) : options_(options) {}
  std::string name() const override { return "overlap"; }
  bool run(Graph& graph) override;
  const OverlapOptions& options() const { return options_; }

 private:
  OverlapOptions options_;
};

// The pass from pipeline options; throws InvalidArgument "option memory-budget-mb of pass
// overlap must be a finite positive number, got 'x'" for a bad value.
std::unique_ptr<Pass> make_overlap_pass(const PassOptions& options);

}  // namespace funcol
