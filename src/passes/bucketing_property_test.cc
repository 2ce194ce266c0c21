// RapidCheck properties of the bucketing passes on random graphs of collectives and compute:
// after any pipeline the graph verifies, has no more collectives, is the same on every run and
// computes bit-identical outputs on 4 ranks; and every bucketing pass is idempotent.
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "bucketing_random.h"
#include "bucketing_test_util.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/bucketing.h"
#include "funcol/passes/pipeline.h"

namespace funcol {
namespace {

using testing_bucketing::chance;
using testing_bucketing::check_property;
using testing_bucketing::random_graph;
using testing_bucketing::random_pass;
using testing_bucketing::random_pipeline;

int count_collectives(const Graph& g) {
  int n = 0;
  for (const Node& node : g.nodes()) n += node.op().is_collective() ? 1 : 0;
  return n;
}

// After a random pipeline, the graph verifies, has no more collectives, is the same for the
// same input, and computes bit-identical outputs on 4 ranks.
void check_any_pipeline(bool one_key) {
  check_property([one_key] {
    const std::unique_ptr<Graph> original = random_graph(one_key);
    const std::string text = print(*original);
    const std::string pipeline_text = random_pipeline();
    RC_LOG() << pipeline_text << "\n" << text;
    const Pipeline pipeline = Pipeline::parse(pipeline_text);

    std::unique_ptr<Graph> g = parse_graph(text);
    pipeline.run(*g, nullptr, /*verify_each=*/true);
    verify(*g);
    const std::string out = print(*g);
    RC_LOG() << out;
    RC_ASSERT(count_collectives(*g) <= count_collectives(*original));

    // The same input gives the same output (decisions depend on the graph only).
    std::unique_ptr<Graph> again = parse_graph(text);
    pipeline.run(*again);
    RC_ASSERT(print(*again) == out);

    // Every rank computes bit-identical outputs.
    const auto in = testing_bucketing::random_inputs(*original, 4, 11);
    std::string why;
    RC_ASSERT(testing_bucketing::same_outputs(testing_bucketing::simulate(*original, in),
                                              testing_bucketing::simulate(*g, in), &why));
  });
}

TEST(BucketingProperty, AnyPipelineKeepsTheGraphValidDeterministicAndBitIdentical) {
  check_any_pipeline(/*one_key=*/false);
}

// Long runs of one key: many buckets are placed by reordering their region.
TEST(BucketingProperty, AnyPipelineOnOneKeyKeepsTheGraphValidDeterministicAndBitIdentical) {
  check_any_pipeline(/*one_key=*/true);
}

// Names of the collectives of `g`, in issue (graph) order.
std::vector<std::string> collective_names(const Graph& g) {
  std::vector<std::string> names;
  for (const Node& n : g.nodes()) {
    if (n.op().is_collective()) names.push_back(n.name());
  }
  return names;
}

void check_issue_order(bool one_key) {
  check_property([one_key] {
    const std::unique_ptr<Graph> original = random_graph(one_key);
    const std::string pipeline_text = random_pipeline();
    RC_LOG() << pipeline_text << "\n" << print(*original);
    std::unique_ptr<Graph> g = parse_graph(print(*original));
    Pipeline::parse(pipeline_text).run(*g);
    RC_LOG() << print(*g);
    // A collective of the input still present by name is one no pass merged; new ones (the
    // buckets) have names the input does not use.
    const std::vector<std::string> before = collective_names(*original);
    std::vector<std::string> kept;
    for (const std::string& name : collective_names(*g)) {
      if (std::find(before.begin(), before.end(), name) != before.end()) kept.push_back(name);
    }
    std::vector<std::string> expected;
    for (const std::string& name : before) {
      if (std::find(kept.begin(), kept.end(), name) != kept.end()) expected.push_back(name);
    }
    RC_ASSERT(kept == expected);
  });
}

TEST(BucketingProperty, CollectivesLeftUnmergedKeepTheirIssueOrder) {
  check_issue_order(/*one_key=*/false);
}

TEST(BucketingProperty, CollectivesLeftUnmergedKeepTheirIssueOrderOnOneKey) {
  check_issue_order(/*one_key=*/true);
}

void check_idempotent(bool one_key) {
  check_property([one_key] {
    const std::unique_ptr<Graph> original = random_graph(one_key);
    // One bucketing pass (a pipeline of several is not a fixed point in general: a
    // multidtype bucket may give a later default pass a new all-gather of some dtype), now and
    // then on a graph holding buckets a pass with other options made.
    const std::string pass = random_pass(/*allow_dce=*/false);
    const std::string before = chance(3) ? random_pass(/*allow_dce=*/false) : std::string();
    RC_LOG() << before << "\n" << pass << "\n" << print(*original);
    Pipeline pipeline = Pipeline::parse(pass);
    std::unique_ptr<Graph> g = parse_graph(print(*original));
    if (!before.empty()) Pipeline::parse(before).run(*g);
    std::ostringstream explain;
    pipeline.set_explain(&explain);
    pipeline.run(*g);
    pipeline.set_explain(nullptr);
    RC_LOG() << explain.str();
    const std::string once = print(*g);
    std::vector<PassStat> stats;
    std::ostringstream again;
    pipeline.set_explain(&again);
    pipeline.run(*g, &stats);
    RC_LOG() << again.str();
    // Every result is a fixed point. (A bucket the first run made that depends on an earlier
    // bucket through a later member is checked against the cap before its dependencies, as its
    // first member was: skipped as dependent instead, it freed room under the cap and the
    // second run merged others. Members a later bucket's collectives kept out of a bucket may
    // merge once that bucket has: the pass runs again until a round merges nothing.)
    RC_ASSERT(!stats.at(0).changed);
    RC_ASSERT(print(*g) == once);
  });
}

TEST(BucketingProperty, EveryBucketingPassIsIdempotent) { check_idempotent(/*one_key=*/false); }

TEST(BucketingProperty, EveryBucketingPassIsIdempotentOnOneKey) {
  check_idempotent(/*one_key=*/true);
}

}  // namespace
}  // namespace funcol
