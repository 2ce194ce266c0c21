// Bucketing end to end: random graphs run through the Executor on 4 thread ranks (threads
// backend, mesh dp=2,tp=2) before and after a random pass pipeline give bit-identical outputs,
// with and without overlap scheduling after the bucketing, buckets lowered or not, runs
// observed or not, inputs kept by the caller or handed over.
#include <gtest/gtest.h>
#include <rapidcheck.h>

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

// Runs `original` and `bucketed` (the same graph after a pipeline) on `ranks` thread ranks
// (4: with the mesh dp=2,tp=2 of the random graphs) and returns the first difference in their
// outputs on each rank ("" where none). The bucketed graph runs twice: first on inputs the caller
// keeps, then on inputs handed over (which the executor may reuse for its results), with its
// buckets lowered or not and its run observed (profiler and on_node, which walk every step) or
// not.
std::vector<std::string> compare_runs(const std::string& original, const std::string& bucketed,
                                      int ranks, bool lowered, bool observed) {
  std::vector<std::string> why(static_cast<size_t>(ranks));
  run_local(ranks, [&](ProcessGroup& world) {
    std::unique_ptr<DeviceMesh> mesh;
    if (ranks == 4) mesh = std::make_unique<DeviceMesh>(
        world, std::vector<std::pair<std::string, int>>{{"dp", 2}, {"tp", 2}});
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
  });
  return why;
}

// A random graph before and after `pipeline_text`, on 4 ranks, as the case draws.
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
  int mismatches = 0;
  for (const std::string& w : compare_runs(original, bucketed, kRanks, lowered, observed)) {
    if (w.empty()) continue;
    ++mismatches;
    RC_LOG() << w << "\n";
  }
  RC_ASSERT(mismatches == 0);
}

// `text` after `pipeline_text` has `collectives` collectives left and gives every rank the
// outputs the original gives, lowered and not.
void expect_same_outputs(const std::string& text, const std::string& pipeline_text, int ranks,
                         int collectives) {
  SCOPED_TRACE(pipeline_text);
  std::unique_ptr<Graph> g = parse_graph(text);
  Pipeline::parse(pipeline_text).run(*g);
  int left = 0;
  for (const Node* n : g->node_list()) left += n->op().is_collective() ? 1 : 0;
  EXPECT_EQ(left, collectives) << print(*g);
  for (const bool lowered : {false, true}) {
    for (const std::string& w : compare_runs(text, print(*g), ranks, lowered, false)) {
      EXPECT_EQ(w, "") << "lowered " << lowered << "\n" << print(*g);
    }
  }
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

// REFERENCE D.34: reduce-scatters of bf16 casts of 384x512 and 384x256 on 2 ranks become one
// reduce_scatter whose shards are each rank's own (the [G, -1] rows, concatenated along dim 1,
// layout), also read back as f32 after the waits.
TEST(BucketingExecutor, ReduceScattersOfCastsGiveEachRankItsShards) {
  const std::string text = R"(graph @g(%a: f32[384,512], %b: f32[384,256]) {
  %ca = convert_element_type(%a) {dtype = bf16}
  %ra = reduce_scatter_tensor(%ca) {reduce_op = "sum", group_size = 2, group = "world"}
  %cb = convert_element_type(%b) {dtype = bf16}
  %rb = reduce_scatter_tensor(%cb) {reduce_op = "sum", group_size = 2, group = "world"}
  %wa = wait_tensor(%ra)
  %wb = wait_tensor(%rb)
  %fa = convert_element_type(%wa) {dtype = f32}
  %fb = convert_element_type(%wb) {dtype = f32}
  return %wa, %wb, %fa, %fb
}
)";
  expect_same_outputs(text, "bucket-reduce-scatter", 2, 1);
  expect_same_outputs(text, "bucket-reduce-scatter{mode=custom_ops}", 2, 1);
}

// REFERENCE D.35: four all-gathers on one group, AG0's input made from AG2's result and two
// inputs bf16 casts: AG0 depends on the bucket and stays alone, the other three merge (in every
// mode), and every rank's outputs are the original's.
TEST(BucketingExecutor, ADependentAllGatherStaysAloneAndTheCastsMerge) {
  const std::string text = R"(graph @g(%x1: f32[8,4], %x2: bf16[8,4], %x3: f32[8,4]) {
  %g2 = all_gather_into_tensor(%x2) {group_size = 2, group = "world"}
  %w2 = wait_tensor(%g2)
  %c1 = convert_element_type(%x1) {dtype = bf16}
  %g1 = all_gather_into_tensor(%c1) {group_size = 2, group = "world"}
  %w1 = wait_tensor(%g1)
  %n = narrow(%w2) {dim = 0, start = 4, length = 8}
  %g0 = all_gather_into_tensor(%n) {group_size = 2, group = "world"}
  %w0 = wait_tensor(%g0)
  %c3 = convert_element_type(%x3) {dtype = bf16}
  %g3 = all_gather_into_tensor(%c3) {group_size = 2, group = "world"}
  %w3 = wait_tensor(%g3)
  return %w0, %w1, %w2, %w3
}
)";
  for (const char* mode : {"default", "custom_ops", "multidtype", "custom_ops_multidtype"}) {
    expect_same_outputs(text, std::string("bucket-all-gather{mode=") + mode + "}", 2, 2);
  }
}

}  // namespace
}  // namespace funcol
