// Bucketing end to end: random graphs run through the Executor on 4 thread ranks (threads
// backend, mesh dp=2,tp=2) before and after a random pass pipeline give bit-identical outputs,
// with and without overlap scheduling after the bucketing, buckets lowered or not, runs
// observed or not, inputs kept by the caller or handed over.
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
#include "funcol/runtime/profile.h"

namespace funcol {
namespace {

using testing_bucketing::check_property;
constexpr int kRanks = 4;

// Runs a random graph before and after `pipeline_text` on every rank and checks the outputs.
// The bucketed graph runs twice: first on inputs the caller keeps, then on inputs handed over
// (which the executor may reuse for its results), with its buckets lowered or not and its run
// observed (profiler and on_node, which walk every step) or not, as the case draws.
void check_bit_identical(const std::string& pipeline_text) {
  const std::string original = print(*testing_bucketing::random_graph());
  RC_LOG() << pipeline_text << "\n" << original;
  std::unique_ptr<Graph> g = parse_graph(original);
  Pipeline::parse(pipeline_text).run(*g);
  const std::string bucketed = print(*g);
  RC_LOG() << bucketed;
  const bool lowered = *rc::gen::arbitrary<bool>();
  const bool observed = *rc::gen::arbitrary<bool>();
  RC_LOG() << "lowered " << lowered << ", observed " << observed << "\n";

  std::atomic<int> mismatches{0};
  std::vector<std::string> why(kRanks);
  run_local(kRanks, [&](ProcessGroup& world) {
    DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    // Every rank holds its own graphs.
    const auto before = parse_graph(original);
    const auto after = parse_graph(bucketed);
    Profiler profiler;
    ExecutorOptions options;
    options.lower_buckets = lowered;
    if (observed) {
      options.profiler = &profiler;
      options.on_node = [](const Node&) {};
    }
    Executor run_before(*before, world);
    Executor run_after(*after, world, options);
    const std::vector<Tensor> inputs = make_inputs(*before, 5, world.rank());
    const std::vector<Tensor> a = run_before.run(inputs);
    std::string& mine = why[static_cast<size_t>(world.rank())];
    for (int run = 0; run < 2 && mine.empty(); ++run) {
      const std::vector<Tensor> b =
          run_after.run(run == 0 ? inputs : make_inputs(*after, 5, world.rank()));
      // Nothing is held between runs (the executor clears only the slots its plan says may
      // still hold a value).
      if (run_before.live_bytes() != 0 || run_after.live_bytes() != 0) {
        mine = "the executor holds values after run " + std::to_string(run);
        break;
      }
      for (size_t i = 0; i < a.size(); ++i) {
        if (!a[i].equal(b[i])) {
          mine = "run " + std::to_string(run) + ", output " + std::to_string(i) + ": " +
                 a[i].to_string() + " vs " + b[i].to_string();
          break;
        }
      }
    }
    if (!mine.empty()) ++mismatches;
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
