// Bucketing end to end: random graphs run through the Executor on 4 thread ranks (threads
// backend, mesh dp=2,tp=2) before and after a random pass pipeline give bit-identical outputs,
// with and without overlap scheduling after the bucketing.
#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <atomic>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bucketing_random.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/device_mesh.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/passes/pipeline.h"
#include "funcol/runtime/executor.h"

namespace funcol {
namespace {

using testing_bucketing::check_property;
constexpr int kRanks = 4;

// Runs a random graph before and after `pipeline_text` on every rank and checks the outputs.
void check_bit_identical(const std::string& pipeline_text) {
  const std::string original = print(*testing_bucketing::random_graph());
  RC_LOG() << pipeline_text << "\n" << original;
  std::unique_ptr<Graph> g = parse_graph(original);
  Pipeline::parse(pipeline_text).run(*g);
  const std::string bucketed = print(*g);
  RC_LOG() << bucketed;

  std::atomic<int> mismatches{0};
  std::vector<std::string> why(kRanks);
  run_local(kRanks, [&](ProcessGroup& world) {
    DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    // Every rank holds its own graphs.
    const auto before = parse_graph(original);
    const auto after = parse_graph(bucketed);
    Executor run_before(*before, world);
    Executor run_after(*after, world);
    const std::vector<Tensor> inputs = make_inputs(*before, 5, world.rank());
    const std::vector<Tensor> a = run_before.run(inputs);
    const std::vector<Tensor> b = run_after.run(inputs);
    // Nothing is held between runs (the executor clears only the slots its plan says may
    // still hold a value).
    if (run_before.live_bytes() != 0 || run_after.live_bytes() != 0) {
      why[static_cast<size_t>(world.rank())] = "the executor holds values after a run";
      ++mismatches;
      return;
    }
    for (size_t i = 0; i < a.size(); ++i) {
      if (!a[i].equal(b[i])) {
        why[static_cast<size_t>(world.rank())] =
            "output " + std::to_string(i) + ": " + a[i].to_string() + " vs " + b[i].to_string();
        ++mismatches;
        break;
      }
    }
  });
  for (const std::string& w : why) {
    if (!w.empty()) RC_LOG() << w << "\n";
  }
  RC_ASSERT(mismatches.load() == 0);
}

TEST(BucketingExecutor, RandomPipelinesGiveBitIdenticalOutputsOnFourRanks) {
  // Every mode, the custom_ops all-gathers (all_gather_into_tensor_packed) included.
  check_property([] { check_bit_identical(testing_bucketing::random_pipeline()); });
}

// The overlap pass reorders what the executor lowers as one bucket (packing up, unpacking and
// waits down): the outputs stay the same, with and without a memory budget.
TEST(BucketingExecutor, OverlapAfterRandomPipelinesGivesBitIdenticalOutputs) {
  check_property([] {
    static const std::vector<std::string> kOverlap = {
        "overlap", "overlap{memory-budget-mb=0.0001}", "overlap{memory-budget-mb=0.0005},dce"};
    check_bit_identical(testing_bucketing::random_pipeline() + "," +
                        testing_bucketing::pick(kOverlap));
  });
}

}  // namespace
}  // namespace funcol
