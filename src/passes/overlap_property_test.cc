// RapidCheck properties of the overlap pass (after random bucketing pipelines, with and without
// a memory budget) and of dce on random graphs: the result verifies, is the same on every run,
// issues the same collectives in the same order, keeps every wait, computes bit-identical
// outputs on 4 ranks, and running overlap again changes nothing.
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bucketing_random.h"
#include "bucketing_test_util.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/bucketing.h"
#include "funcol/passes/dce.h"
#include "funcol/passes/pipeline.h"

namespace funcol {
namespace {

using testing_bucketing::check_property;
using testing_bucketing::pick;
using testing_bucketing::random_graph;
using testing_bucketing::random_pass;

// The collectives of `g` as "name op", in issue (graph) order, and the number of waits.
std::vector<std::string> issue_order(const Graph& g) {
  std::vector<std::string> order;
  for (const Node& n : g.nodes()) {
    if (n.op().is_collective()) order.push_back(n.name() + " " + std::string(n.op_name()));
  }
  return order;
}

int count_waits(const Graph& g) {
  int n = 0;
  for (const Node& node : g.nodes()) n += node.op().collective == CollectiveKind::Wait ? 1 : 0;
  return n;
}

// The most bytes of collective results issued and not yet read, over the nodes that are neither
// collectives, waits nor views (only these read data): a collective's buffer counts from its
// issue up to its first reader, found through waits and views (up to, not at, a collective
// reader; to the end when nothing reads it). Quadratic, as a reference should be.
int64_t peak_held_bytes(const Graph& g) {
  const std::vector<Node*> nodes = g.node_list();
  auto passive = [](const Node& n) {
    return n.op().collective == CollectiveKind::Wait || n.op().is_view;
  };
  std::vector<int64_t> held(nodes.size(), 0);
  for (size_t k = 0; k < nodes.size(); ++k) {
    if (!nodes[k]->op().is_collective()) continue;
    size_t end = nodes.size();  // the first position not held
    std::vector<const Node*> work = {nodes[k]};
    while (!work.empty()) {
      const Node* m = work.back();
      work.pop_back();
      for (size_t i = 0; i < m->num_results(); ++i) {
        for (const Use& u : m->result(i)->uses()) {
          if (!u.user) continue;
          if (passive(*u.user)) {
            work.push_back(u.user);
            continue;
          }
          const auto at = static_cast<size_t>(
              std::find(nodes.begin(), nodes.end(), u.user) - nodes.begin());
          end = std::min(end, u.user->op().is_collective() ? at : at + 1);
        }
      }
    }
    int64_t bytes = 0;
    for (size_t i = 0; i < nodes[k]->num_results(); ++i) {
      bytes += nodes[k]->result(i)->type().nbytes();
    }
    for (size_t j = k + 1; j < end; ++j) held[j] += bytes;
  }
  int64_t peak = 0;
  for (size_t j = 0; j < nodes.size(); ++j) {
    if (!nodes[j]->op().is_collective() && !passive(*nodes[j])) peak = std::max(peak, held[j]);
  }
  return peak;
}

// A budget for overlap (empty: none), from far below one value (one byte, as the pass takes a
// positive budget under a byte: nothing moves but values of at most one byte) to 1 MB, above
// anything a random graph holds.
std::string random_budget_mb() {
  static const std::vector<std::string> kBudgets = {"",       "1e-12",  "0.00001",
                                                    "0.0001", "0.0005", "1"};
  return pick(kBudgets);
}

TEST(OverlapProperty, KeepsIssueOrderWaitsAndOutputsAndIsIdempotent) {
  check_property([] {
    const std::unique_ptr<Graph> original = random_graph();
    std::string prefix;
    for (int i = *rc::gen::inRange(0, 3); i > 0; --i) {
      prefix += random_pass(/*allow_dce=*/true) + ",";
    }
    const std::string mb = random_budget_mb();
    const std::string overlap = mb.empty() ? "overlap" : "overlap{memory-budget-mb=" + mb + "}";
    RC_LOG() << prefix << overlap << "\n" << print(*original);

    std::unique_ptr<Graph> g = parse_graph(print(*original));
    if (!prefix.empty()) Pipeline::parse(prefix.substr(0, prefix.size() - 1)).run(*g);
    const std::vector<std::string> order = issue_order(*g);
    const int waits = count_waits(*g);
    const std::string before = print(*g);
    const int64_t peak = peak_held_bytes(*g);

    const Pipeline pass = Pipeline::parse(overlap);
    pass.run(*g, nullptr, /*verify_each=*/true);
    const std::string once = print(*g);
    RC_LOG() << once;
    RC_ASSERT(issue_order(*g) == order);
    RC_ASSERT(count_waits(*g) == waits);
    // A budget is never the reason for holding more than it (or than the input already did).
    if (!mb.empty()) {
      // Bytes as the pass counts them: int(MB * 2^20), and at least one.
      const int64_t budget = mb_to_bytes(std::stod(mb), std::numeric_limits<int64_t>::max());
      RC_ASSERT(peak_held_bytes(*g) <= std::max(budget, peak));
      // A budget above everything the graph could hold changes nothing.
      if (budget >= 1 << 20) {
        std::unique_ptr<Graph> unlimited = parse_graph(before);
        Pipeline::parse("overlap").run(*unlimited);
        RC_ASSERT(print(*unlimited) == once);
      }
    }

    // Decisions depend on the graph and the options only.
    std::unique_ptr<Graph> again = parse_graph(before);
    pass.run(*again);
    RC_ASSERT(print(*again) == once);

    // A second run finds nothing to move.
    std::vector<PassStat> stats;
    pass.run(*g, &stats);
    RC_ASSERT(print(*g) == once);
    RC_ASSERT(!stats.at(0).changed);

    // dce afterwards keeps every collective and wait (they are side effects).
    eliminate_dead_code(*g);
    verify(*g);
    RC_ASSERT(issue_order(*g) == order);
    RC_ASSERT(count_waits(*g) == waits);

    const auto in = testing_bucketing::random_inputs(*original, 4, 7);
    std::string why;
    RC_ASSERT(testing_bucketing::same_outputs(testing_bucketing::simulate(*original, in),
                                              testing_bucketing::simulate(*g, in), &why));
  });
}

}  // namespace
}  // namespace funcol
