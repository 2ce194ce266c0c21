// Tests of the executor's bucket lowering (ExecutorOptions::lower_buckets) and of donation: a
// collective's operand at its last use is reduced in place instead of copied.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "funcol/core/allocator.h"
#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/dist/backend.h"
#include "funcol/graph/parser.h"
#include "funcol/runtime/executor.h"
#include "funcol/runtime/profile.h"
#include "testing/forwarding_group.h"

namespace funcol {
namespace {

struct Result {
  std::vector<std::vector<Tensor>> outputs;  // [rank][output]
  size_t lowered = 0;
  size_t folded = 0;  // Executor::folded_casts
};

// Called on every rank before its Executor is made: registers groups, sets options.
using Setup = std::function<void(ProcessGroup& world, ExecutorOptions& options)>;

// Runs `text` twice per rank (the second run reuses the plan and the cached buffers) on n thread
// ranks with generated inputs; returns the second run's outputs.
Result run(int n, const std::string& text, bool lower, const Setup& setup = {}) {
  auto graph = parse_graph(text, ParseOptions{.file = "t.ir"});
  Result res;
  res.outputs.resize(static_cast<size_t>(n));
  std::vector<size_t> lowered(static_cast<size_t>(n));
  std::vector<size_t> folded(static_cast<size_t>(n));
  run_local(n, [&](ProcessGroup& world) {
    ExecutorOptions options;
    options.lower_buckets = lower;
    if (setup) setup(world, options);
    Executor ex(*graph, world, options);
    const auto r = static_cast<size_t>(world.rank());
    ex.run(make_inputs(*graph, 7, world.rank()));
    res.outputs[r] = ex.run(make_inputs(*graph, 7, world.rank()));
    EXPECT_EQ(ex.live_bytes(), 0) << "rank " << r << ": values held after the run";
    lowered[r] = ex.lowered_buckets();
    folded[r] = ex.folded_casts();
  });
  for (size_t l : lowered) EXPECT_EQ(l, lowered[0]);
  for (size_t f : folded) EXPECT_EQ(f, folded[0]);
  res.lowered = lowered[0];
  res.folded = folded[0];
  return res;
}

// Both runs' outputs agree bit for bit on every rank.
void expect_same(const Result& a, const Result& b) {
  EXPECT_EQ(a.outputs.size(), b.outputs.size());
  for (size_t r = 0; r < a.outputs.size() && r < b.outputs.size(); ++r) {
    EXPECT_EQ(a.outputs[r].size(), b.outputs[r].size());
    for (size_t i = 0; i < a.outputs[r].size() && i < b.outputs[r].size(); ++i) {
      EXPECT_TRUE(a.outputs[r][i].equal(b.outputs[r][i]))
          << "rank " << r << " output " << i << ": " << a.outputs[r][i].to_string() << " vs "
          << b.outputs[r][i].to_string();
    }
  }
}

// Lowered and node-by-node runs agree bit for bit on every rank; returns the lowered count.
size_t expect_same_either_way(int n, const std::string& text, const Setup& setup = {}) {
  const Result a = run(n, text, true, setup);
  const Result b = run(n, text, false, setup);
  EXPECT_EQ(b.lowered, 0u);
  expect_same(a, b);
  return a.lowered;
}

std::string g(int n) { return std::to_string(n); }

// The default-mode all-gather bucket of bucket-all-gather for inputs f32[3] and f32[2,2]
// (flattened), with a consumer of one member result. With `pending`, the members are the
// unwaited results of all_reduces of the graph's inputs.
std::string gather_default(int n, bool pending = false) {
  const std::string members =
      pending ? "graph @g(%p: f32[3], %q: f32[2,2]) {\n"
                "  %a = all_reduce(%p) {reduce_op = \"sum\", group = \"world\"}\n"
                "  %b = all_reduce(%q) {reduce_op = \"sum\", group = \"world\"}\n"
              : "graph @g(%a: f32[3], %b: f32[2,2]) {\n";
  return members +
         "  %bf = flatten(%b)\n"
         "  %pack = cat(%a, %bf) {dim = 0}\n"
         "  %bucket = all_gather_into_tensor(%pack) {group_size = " + g(n) +
         ", group = \"world\"}\n"
         "  %w = wait_tensor(%bucket)\n"
         "  %rows = view(%w) {shape = [" + g(n) + ", 7]}\n"
         "  %s:2 = split_with_sizes(%rows) {split_sizes = [3, 4], dim = 1}\n"
         "  %o0 = reshape(%s#0) {shape = [" + g(3 * n) + "]}\n"
         "  %o1 = reshape(%s#1) {shape = [" + g(2 * n) + ", 2]}\n"
         "  %y = neg(%o1)\n"
         "  return %o0, %y\n"
         "}\n";
}

TEST(LowerBuckets, GatherBucketOfEveryWorldSize) {
  for (int n : {1, 2, 4}) EXPECT_EQ(expect_same_either_way(n, gather_default(n)), 1u) << n;
}

// A member [1, n] gathers to [G, n], which is its split piece: bucket-all-gather leaves that
// piece without a reshape, and the chain is lowered all the same (it ran node by node), in
// every gather form, with a piece of a [1, n] member among the outputs and consumed.
TEST(LowerBuckets, GatherBucketWithAMemberThatNeedsNoReshape) {
  for (const bool packed : {false, true}) {
    SCOPED_TRACE(packed);
    const std::string bucket =
        packed ? "  %bucket = all_gather_into_tensor_packed(%a, %b, %c) {group_size = 2, "
                 "group = \"world\", dtype = f32, out_dtypes = [f32, f32, f32]}\n"
               : "  %af = flatten(%a)\n"
                 "  %cf = flatten(%c)\n"
                 "  %pack = cat(%af, %b, %cf) {dim = 0}\n"
                 "  %bucket = all_gather_into_tensor(%pack) {group_size = 2, group = \"world\"}\n";
    const std::string text = "graph @g(%a: f32[1,3], %b: f32[5], %c: f32[1,2]) {\n" + bucket +
                             "  %w = wait_tensor(%bucket)\n"
                             "  %rows = view(%w) {shape = [2, 10]}\n"
                             "  %s:3 = split_with_sizes(%rows) {split_sizes = [3, 5, 2], dim = 1}\n"
                             "  %o1 = reshape(%s#1) {shape = [10]}\n"
                             "  %n = neg(%s#2)\n"
                             "  return %s#0, %o1, %n\n"
                             "}\n";
    EXPECT_EQ(expect_same_either_way(2, text), 1u);
    // That piece unused: placed at issue, released by the split's step, which does nothing
    // else (run() checks nothing is held after the run).
    std::string unused = text;
    unused.replace(unused.find("return %s#0, "), 13, "return ");
    EXPECT_EQ(expect_same_either_way(2, unused), 1u);
  }
}

TEST(LowerBuckets, PackedGatherBucket) {
  const std::string text =
      "graph @g(%a: i32[3], %b: i32[5]) {\n"
      "  %bucket = all_gather_into_tensor_packed(%a, %b) {group_size = 4, group = \"world\", "
      "dtype = i32, out_dtypes = [i32, i32]}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %rows = view(%w) {shape = [4, 8]}\n"
      "  %s:2 = split_with_sizes(%rows) {split_sizes = [3, 5], dim = 1}\n"
      "  %o0 = reshape(%s#0) {shape = [12]}\n"
      "  %o1 = reshape(%s#1) {shape = [20]}\n"
      "  return %o0, %o1\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(4, text), 1u);
}

TEST(LowerBuckets, PackedGatherWithACastIsNotLowered) {
  const std::string text =
      "graph @g(%a: f32[4], %b: bf16[4]) {\n"
      "  %bucket = all_gather_into_tensor_packed(%a, %b) {group_size = 2, group = \"world\", "
      "dtype = bf16, out_dtypes = [bf16, bf16]}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %rows = view(%w) {shape = [2, 8]}\n"
      "  %s:2 = split_with_sizes(%rows) {split_sizes = [4, 4], dim = 1}\n"
      "  %o0 = reshape(%s#0) {shape = [8]}\n"
      "  %o1 = reshape(%s#1) {shape = [8]}\n"
      "  return %o0, %o1\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(2, text), 0u);
}

// Casts feeding only a cat are folded into it (one converting copy), with the values the cast
// and the cat give: checked against Tensor::to and Tensor::cat of the same inputs.
TEST(FoldCasts, ACatConvertsTheCastsOperands) {
  const std::string text =
      "graph @g(%a: f32[2,3], %b: f64[2,1], %c: bf16[2,2]) {\n"
      "  %ca = convert_element_type(%a) {dtype = bf16}\n"
      "  %cb = convert_element_type(%b) {dtype = bf16}\n"
      "  %cat = cat(%ca, %c, %cb) {dim = -1}\n"
      "  return %cat\n"
      "}\n";
  const Result r = run(1, text, true);
  EXPECT_EQ(r.folded, 2u);
  const auto graph = parse_graph(text, ParseOptions{.file = "t.ir"});
  const std::vector<Tensor> in = make_inputs(*graph, 7, 0);
  const Tensor expected =
      Tensor::cat({in[0].to(DType::BF16), in[2], in[1].to(DType::BF16)}, 1);
  EXPECT_TRUE(r.outputs[0][0].equal(expected)) << r.outputs[0][0].to_string() << " vs "
                                               << expected.to_string();
}

// Only the run of sole-use casts right before the cat is folded: not a cast with other steps
// between it and the cat (its larger operand would outlive its last use), nor one used twice,
// nor one reading an unwaited collective's result (a failure of the collective is reported at
// the cast). A cast whose operand is also the cat's operand is folded (the operand is then
// listed twice).
TEST(FoldCasts, OnlySoleUseCastsRightBeforeTheCatAreFolded) {
  const std::string text =
      "graph @g(%a: f32[4], %b: f32[4], %x: f32[4], %y: f32[4], %d: f16[4]) {\n"
      "  %ca = convert_element_type(%a) {dtype = f16}\n"
      "  %ar = all_reduce(%x) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %ar2 = all_reduce(%y) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %w = wait_tensor(%ar)\n"
      "  %cb = convert_element_type(%b) {dtype = f16}\n"
      "  %cp = convert_element_type(%ar2) {dtype = f16}\n"
      "  %cw = convert_element_type(%w) {dtype = f16}\n"
      "  %cd = convert_element_type(%d) {dtype = f16}\n"
      "  %cat = cat(%ca, %cb, %cp, %cw, %cd, %d) {dim = 0}\n"
      "  %twice = cat(%cat, %cb) {dim = 0}\n"
      "  %w2 = wait_tensor(%ar2)\n"
      "  return %twice, %w2\n"
      "}\n";
  const Result folded = run(2, text, true);
  EXPECT_EQ(folded.folded, 2u);  // %cw and %cd
  const auto graph = parse_graph(text, ParseOptions{.file = "t.ir"});
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<Tensor> in = make_inputs(*graph, 7, rank);
    const std::vector<Tensor> other = make_inputs(*graph, 7, 1 - rank);
    const Tensor x = add(in[2], other[2]);
    const Tensor y = add(in[3], other[3]);
    const Tensor cat =
        Tensor::cat({in[0].to(DType::F16), in[1].to(DType::F16), y.to(DType::F16),
                     x.to(DType::F16), in[4], in[4]},
                    0);
    const Tensor expected = Tensor::cat({cat, in[1].to(DType::F16)}, 0);
    EXPECT_TRUE(folded.outputs[rank][0].equal(expected)) << rank;
  }
}

// The default-mode all-gather bucket of two cast members: lowered where the group fuses
// coalesced lists (its casts feed the collective directly), else run as written with the casts
// folded into the packing cat; the same values either way.
TEST(FoldCasts, DefaultModeGatherBucketOfCasts) {
  const std::string text =
      "graph @g(%a: f32[3], %b: f32[5]) {\n"
      "  %ag_cast = convert_element_type(%a) {dtype = bf16}\n"
      "  %ag_cast.1 = convert_element_type(%b) {dtype = bf16}\n"
      "  %ag_pack = cat(%ag_cast, %ag_cast.1) {dim = 0}\n"
      "  %ag_bucket = all_gather_into_tensor(%ag_pack) {group_size = 2, group = \"world\"}\n"
      "  %ag_wait = wait_tensor(%ag_bucket)\n"
      "  %ag_rows = view(%ag_wait) {shape = [2, 8]}\n"
      "  %ag_split:2 = split_with_sizes(%ag_rows) {split_sizes = [3, 5], dim = 1}\n"
      "  %o0 = reshape(%ag_split#0) {shape = [6]}\n"
      "  %o1 = reshape(%ag_split#1) {shape = [10]}\n"
      "  return %o0, %o1\n"
      "}\n";
  const Result lowered = run(2, text, true);
  EXPECT_EQ(lowered.lowered, 1u);
  EXPECT_EQ(lowered.folded, 0u);
  const Result folded = run(2, text, false);
  EXPECT_EQ(folded.folded, 2u);
  expect_same(lowered, folded);
}

TEST(LowerBuckets, ScatterBucketDefaultAndPackedModes) {
  const std::string rows =
      "graph @g(%a: f32[8], %b: f32[4,3]) {\n"
      "  %ra = reshape(%a) {shape = [4, 2]}\n"
      "  %rb = reshape(%b) {shape = [4, 3]}\n"
      "  %c = cat(%ra, %rb) {dim = 1}\n"
      "  %pack = flatten(%c)\n"
      "  %bucket = reduce_scatter_tensor(%pack) {reduce_op = \"sum\", group_size = 4, "
      "group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:2 = split_with_sizes(%w) {split_sizes = [2, 3], dim = 0}\n"
      "  %y = neg(%s#1)\n"
      "  return %s#0, %y\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(4, rows), 1u);
  const std::string packed =
      "graph @g(%a: i64[8], %b: i64[4,3]) {\n"
      "  %pack = bucket_pack(%a, %b) {group_size = 4}\n"
      "  %bucket = reduce_scatter_tensor(%pack) {reduce_op = \"max\", group_size = 4, "
      "group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:2 = split_with_sizes(%w) {split_sizes = [2, 3], dim = 0}\n"
      "  return %s#0, %s#1\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(4, packed), 1u);
}

// The default-mode all-reduce bucket of bucket-all-reduce for f32[3] (1-D: not flattened) and
// f32[2,3], then the reshape back and a consumer; %b is also an output (read, never written).
std::string reduce_default(const std::string& op) {
  return "graph @g(%a: f32[3], %b: f32[2,3]) {\n"
         "  %bf = flatten(%b)\n"
         "  %pack = cat(%a, %bf) {dim = 0}\n"
         "  %bucket = all_reduce(%pack) {reduce_op = \"" + op + "\", group = \"world\"}\n"
         "  %w = wait_tensor(%bucket)\n"
         "  %s:2 = split_with_sizes(%w) {split_sizes = [3, 6], dim = 0}\n"
         "  %o1 = reshape(%s#1) {shape = [2, 3]}\n"
         "  %y = neg(%o1)\n"
         "  return %s#0, %y, %b\n"
         "}\n";
}

TEST(LowerBuckets, ReduceBucketOfEveryWorldSizeAndOp) {
  for (int n : {1, 2, 4}) {
    for (const char* op : {"sum", "avg", "max", "product"}) {
      EXPECT_EQ(expect_same_either_way(n, reduce_default(op)), 1u) << n << " " << op;
    }
  }
}

// A bucket's members that are still pending (results of collectives whose wait_tensor the
// graph skips) are read only once ready: the flat primitives wait for them.
TEST(LowerBuckets, PendingMembersAreWaitedBeforeTheyAreRead) {
  for (int n : {1, 2, 4}) {
    const std::string text =
        "graph @g(%x: f32[2], %y: f32[3]) {\n"
        "  %a = all_gather_into_tensor(%x) {group_size = " + g(n) + ", group = \"world\"}\n"
        "  %b = all_gather_into_tensor(%y) {group_size = " + g(n) + ", group = \"world\"}\n"
        "  %pack = cat(%a, %b) {dim = 0}\n"
        "  %bucket = all_reduce(%pack) {reduce_op = \"sum\", group = \"world\"}\n"
        "  %w = wait_tensor(%bucket)\n"
        "  %s:2 = split_with_sizes(%w) {split_sizes = [" + g(2 * n) + ", " + g(3 * n) +
        "], dim = 0}\n"
        "  return %s#0, %s#1\n"
        "}\n";
    EXPECT_EQ(expect_same_either_way(n, text), 1u) << n;
    EXPECT_EQ(expect_same_either_way(n, gather_default(n, true)), 1u) << "all_gather " << n;
    const std::string scatter =
        "graph @g(%x: f32[2], %y: f32[3]) {\n"
        "  %a = all_gather_into_tensor(%x) {group_size = " + g(n) + ", group = \"world\"}\n"
        "  %b = all_gather_into_tensor(%y) {group_size = " + g(n) + ", group = \"world\"}\n"
        "  %ra = reshape(%a) {shape = [" + g(n) + ", 2]}\n"
        "  %rb = reshape(%b) {shape = [" + g(n) + ", 3]}\n"
        "  %c = cat(%ra, %rb) {dim = 1}\n"
        "  %pack = flatten(%c)\n"
        "  %bucket = reduce_scatter_tensor(%pack) {reduce_op = \"sum\", group_size = " + g(n) +
        ", group = \"world\"}\n"
        "  %w = wait_tensor(%bucket)\n"
        "  %s:2 = split_with_sizes(%w) {split_sizes = [2, 3], dim = 0}\n"
        "  return %s#0, %s#1\n"
        "}\n";
    EXPECT_EQ(expect_same_either_way(n, scatter), 1u) << "reduce_scatter " << n;
  }
}

// The observed loop (profiler, on_node) runs lowered chains the same way: every node is still
// reported once per run, and the bucket is one communication span.
TEST(LowerBuckets, ObservedRunsLowerTheSameWay) {
  const std::string text = reduce_default("sum");
  const size_t num_nodes = parse_graph(text)->num_nodes();
  std::vector<Profiler> profs(2);
  std::vector<int> nodes_seen(2, 0);
  const Result observed = run(2, text, true, [&](ProcessGroup& world, ExecutorOptions& options) {
    const auto r = static_cast<size_t>(world.rank());
    options.profiler = &profs[r];
    options.on_node = [&nodes_seen, r](const Node&) { ++nodes_seen[r]; };
  });
  EXPECT_EQ(observed.lowered, 1u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(nodes_seen[r], 2 * static_cast<int>(num_nodes));
    int comm = 0;
    for (const Span& s : profs[r].spans()) comm += s.kind == SpanKind::Communication;
    EXPECT_EQ(comm, 2);
  }
  expect_same(observed, run(2, text, false));
}

// live_bytes() counts a lowered bucket's results between its issue and the steps that hand
// them out: at the wait, the 9-float buffer of both members lives besides the inputs.
TEST(LowerBuckets, LiveBytesCountTheBucketsResults) {
  const std::string text = reduce_default("sum");
  auto graph = parse_graph(text);
  std::vector<int64_t> at_wait(2, -1), at_wait_plain(2, -1);
  for (const bool lower : {true, false}) {
    run_local(2, [&](ProcessGroup& world) {
      ExecutorOptions options;
      options.lower_buckets = lower;
      Executor* self = nullptr;
      const auto r = static_cast<size_t>(world.rank());
      options.on_node = [&](const Node& node) {
        if (node.name() == "w") (lower ? at_wait : at_wait_plain)[r] = self->live_bytes();
      };
      Executor ex(*graph, world, options);
      self = &ex;
      ex.run(make_inputs(*graph, 7, world.rank()));
      EXPECT_EQ(ex.lowered_buckets(), lower ? 1u : 0u);
    });
  }
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_GE(at_wait[r], 9 * 4) << r;
    EXPECT_EQ(at_wait[r], at_wait_plain[r]) << r;
  }
}

TEST(LowerBuckets, PackedReduceBucketAndAMemberTwice) {
  const std::string packed =
      "graph @g(%a: i32[5], %b: i32[2,2]) {\n"
      "  %pack = bucket_pack(%a, %b, %a) {group_size = 1}\n"
      "  %bucket = all_reduce(%pack) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:3 = split_with_sizes(%w) {split_sizes = [5, 4, 5], dim = 0}\n"
      "  %o1 = reshape(%s#1) {shape = [2, 2]}\n"
      "  %z = add(%s#0, %s#2)\n"
      "  return %z, %o1, %a\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(4, packed), 1u);
  // The pack's group_size must be 1 for an all_reduce; a flatten with another user stays.
  const std::string flat_used =
      "graph @g(%a: f32[2,2], %b: f32[3]) {\n"
      "  %af = flatten(%a)\n"
      "  %pack = cat(%af, %b) {dim = 0}\n"
      "  %bucket = all_reduce(%pack) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:2 = split_with_sizes(%w) {split_sizes = [4, 3], dim = 0}\n"
      "  %n = neg(%af)\n"
      "  return %s#0, %s#1, %n\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(2, flat_used), 1u);  // %af itself becomes the member
  // A member that is a strided view (copied to contiguous for the primitive) and is read again
  // after the bucket (handed back intact).
  const std::string strided =
      "graph @g(%a: f32[2,3], %b: f32[4]) {\n"
      "  %t = transpose(%a) {dim0 = 0, dim1 = 1}\n"
      "  %tf = flatten(%t)\n"
      "  %pack = cat(%tf, %b) {dim = 0}\n"
      "  %bucket = all_reduce(%pack) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:2 = split_with_sizes(%w) {split_sizes = [6, 4], dim = 0}\n"
      "  %n = neg(%t)\n"
      "  %m = neg(%b)\n"
      "  return %s#0, %s#1, %n, %m\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(4, strided), 1u);
}

// A group that runs coalesced lists one collective per tensor, as mpi does: lowered only for
// all_gather buckets whose members average at least 64 bytes here.
class LoopingGroup final : public testing::ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  bool fuses_coalesced() const override { return false; }
  int64_t all_gather_coalesced_min_bytes() const override { return 64; }
};

TEST(LowerBuckets, WhereCoalescedListsLoopOnlyLargeGatherMembersAreLowered) {
  // f32[16] + f32[20] (72 bytes per member on average): lowered; f32[8] + f32[12]: not.
  auto gather = [](int a, int b) {
    return "graph @g(%a: f32[" + g(a) + "], %b: f32[" + g(b) + "]) {\n"
           "  %pack = cat(%a, %b) {dim = 0}\n"
           "  %bucket = all_gather_into_tensor(%pack) {group_size = 2, group = \"loop\"}\n"
           "  %w = wait_tensor(%bucket)\n"
           "  %rows = view(%w) {shape = [2, " + g(a + b) + "]}\n"
           "  %s:2 = split_with_sizes(%rows) {split_sizes = [" + g(a) + ", " + g(b) +
           "], dim = 1}\n"
           "  %o0 = reshape(%s#0) {shape = [" + g(2 * a) + "]}\n"
           "  %o1 = reshape(%s#1) {shape = [" + g(2 * b) + "]}\n"
           "  return %o0, %o1\n"
           "}\n";
  };
  const std::string scatter =
      "graph @g(%a: f32[64], %b: f32[64]) {\n"
      "  %pack = bucket_pack(%a, %b) {group_size = 2}\n"
      "  %bucket = reduce_scatter_tensor(%pack) {reduce_op = \"sum\", group_size = 2, "
      "group = \"loop\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:2 = split_with_sizes(%w) {split_sizes = [32, 32], dim = 0}\n"
      "  return %s#0, %s#1\n"
      "}\n";
  auto add_loop = [](ProcessGroup& world, ExecutorOptions&) {
    world.registry().add(std::make_shared<LoopingGroup>(world, "loop"));
  };
  EXPECT_EQ(expect_same_either_way(2, gather(16, 20), add_loop), 1u);
  EXPECT_EQ(expect_same_either_way(2, gather(8, 12), add_loop), 0u);
  EXPECT_EQ(expect_same_either_way(2, scatter, add_loop), 0u);
}

// A 2-rank gather bucket of f32[3] and f32[4] whose results are %o0 and %o1, then `tail`
// (more nodes) and `outputs`.
std::string gather_chain(const std::string& tail, const std::string& outputs) {
  return "graph @g(%a: f32[3], %b: f32[4]) {\n"
         "  %pack = cat(%a, %b) {dim = 0}\n"
         "  %bucket = all_gather_into_tensor(%pack) {group_size = 2, group = \"world\"}\n"
         "  %w = wait_tensor(%bucket)\n"
         "  %rows = view(%w) {shape = [2, 7]}\n"
         "  %s:2 = split_with_sizes(%rows) {split_sizes = [3, 4], dim = 1}\n"
         "  %o0 = reshape(%s#0) {shape = [6]}\n"
         "  %o1 = reshape(%s#1) {shape = [8]}\n" +
         tail + "  return " + outputs + "\n}\n";
}

TEST(LowerBuckets, ChainsWhoseIntermediatesAreUsedElsewhereAreNotLowered) {
  EXPECT_EQ(expect_same_either_way(2, gather_chain("", "%o0, %o1")), 1u);
  // The packed buffer is also an output: the chain must run as written.
  EXPECT_EQ(expect_same_either_way(2, gather_chain("", "%o0, %o1, %pack")), 0u);
  // A piece with two users is the member's result itself, the reshape a view of it: lowered.
  EXPECT_EQ(expect_same_either_way(2, gather_chain("  %n = neg(%s#1)\n", "%o0, %o1, %n")), 1u);
  // The waited bucket read directly.
  EXPECT_EQ(expect_same_either_way(2, gather_chain("  %n = neg(%w)\n", "%o0, %o1, %n")), 0u);
  const std::string wait_is_output =
      "graph @g(%a: f32[8], %b: f32[4]) {\n"
      "  %pack = bucket_pack(%a, %b) {group_size = 2}\n"
      "  %bucket = reduce_scatter_tensor(%pack) {reduce_op = \"sum\", group_size = 2, "
      "group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:2 = split_with_sizes(%w) {split_sizes = [4, 2], dim = 0}\n"
      "  return %s#0, %s#1, %w\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(2, wait_is_output), 0u);
}

// A reduce_scatter chain that packs an all_gather chain's results: its reshapes are the gather
// chain's last nodes and its members the gather's split pieces, which the lowered gather never
// materialises. The gather is lowered, the scatter runs node by node (it threw "reduce_scatter:
// input is undefined" before).
TEST(LowerBuckets, AChainOverlappingAnEarlierOneRunsAsWritten) {
  const std::string text =
      "graph @g(%a: f32[3], %b: f32[4]) {\n"
      "  %pack = cat(%a, %b) {dim = 0}\n"
      "  %bucket = all_gather_into_tensor(%pack) {group_size = 2, group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %rows = view(%w) {shape = [2, 7]}\n"
      "  %s:2 = split_with_sizes(%rows) {split_sizes = [3, 4], dim = 1}\n"
      "  %o0 = reshape(%s#0) {shape = [2, 3]}\n"
      "  %o1 = reshape(%s#1) {shape = [2, 4]}\n"
      "  %c = cat(%o0, %o1) {dim = 1}\n"
      "  %p = flatten(%c)\n"
      "  %rs = reduce_scatter_tensor(%p) {reduce_op = \"sum\", group_size = 2, "
      "group = \"world\"}\n"
      "  %w2 = wait_tensor(%rs)\n"
      "  %t:2 = split_with_sizes(%w2) {split_sizes = [3, 4], dim = 0}\n"
      "  return %t#0, %t#1\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(2, text), 1u);
}

TEST(LowerBuckets, SameMemberTwiceInOneBucket) {
  const std::string text =
      "graph @g(%a: f32[3]) {\n"
      "  %pack = cat(%a, %a) {dim = 0}\n"
      "  %bucket = all_gather_into_tensor(%pack) {group_size = 2, group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %rows = view(%w) {shape = [2, 6]}\n"
      "  %s:2 = split_with_sizes(%rows) {split_sizes = [3, 3], dim = 1}\n"
      "  %o0 = reshape(%s#0) {shape = [6]}\n"
      "  %o1 = reshape(%s#1) {shape = [6]}\n"
      "  %sum = add(%o0, %o1)\n"
      "  return %sum, %a\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(2, text), 1u);
  // The member dies in the bucket (run() checks nothing is held afterwards).
  const std::string dies =
      "graph @g(%a: f32[3], %b: f32[2]) {\n"
      "  %n = neg(%a)\n"
      "  %pack = cat(%n, %b, %n) {dim = 0}\n"
      "  %bucket = all_reduce(%pack) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:3 = split_with_sizes(%w) {split_sizes = [3, 2, 3], dim = 0}\n"
      "  return %s#2, %s#0\n"
      "}\n";
  EXPECT_EQ(expect_same_either_way(2, dies), 1u);
}

// Ranks that run graphs of their own (check_same_graph off) may differ in what a chain's
// values feed besides the chain: here rank 1 also returns the packed buffer, so its chain does
// not match and runs as written. Each rank lowering on its own said "rank 0 issued
// all_reduce_flat(...) but rank 1 issued all_reduce(f32[7])" for collectives both graphs write
// alike (on mpi, one gather against a list of them would not even meet): such ranks run every
// chain as written.
TEST(LowerBuckets, RanksWithGraphsOfTheirOwnRunChainsAsWritten) {
  const std::string chain =
      "graph @g(%a: f32[3], %b: f32[4]) {\n"
      "  %pack = cat(%a, %b) {dim = 0}\n"
      "  %bucket = all_reduce(%pack) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:2 = split_with_sizes(%w) {split_sizes = [3, 4], dim = 0}\n";
  const std::unique_ptr<Graph> graphs[2] = {
      parse_graph(chain + "  return %s#0, %s#1\n}\n"),
      parse_graph(chain + "  return %s#0, %s#1, %pack\n}\n")};
  std::vector<std::vector<float>> sums(2);
  std::vector<size_t> lowered(2);
  run_local(2, [&](ProcessGroup& world) {
    const auto r = static_cast<size_t>(world.rank());
    ExecutorOptions options;
    options.check_same_graph = false;
    Executor ex(*graphs[r], world, options);
    lowered[r] = ex.lowered_buckets();
    const float v = 1.0f + static_cast<float>(r);
    const auto out = ex.run({Tensor::full({3}, DType::F32, v), Tensor::full({4}, DType::F32, v)});
    sums[r] = out[1].to_vector<float>();
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(lowered[r], 0u) << r;
    EXPECT_EQ(sums[r], std::vector<float>(4, 3.0f)) << r;
  }
}

// A group whose all_reduce_flat and reduce_scatter_flat (lowered buckets' primitives) throw on
// their first call, before any rank posts.
class ThrowsOnceGroup final : public testing::ForwardingGroup {
 public:
  using ForwardingGroup::ForwardingGroup;
  bool fuses_coalesced() const override { return true; }
  std::shared_ptr<Work> all_reduce_flat(const Tensor& output,
                                        std::shared_ptr<const std::vector<Tensor>> inputs,
                                        ReduceOp op) override {
    if (calls_++ == 0) throw CommError("refused");
    return ProcessGroup::all_reduce_flat(output, std::move(inputs), op);
  }
  std::shared_ptr<Work> reduce_scatter_flat(const Tensor& output,
                                            std::shared_ptr<const std::vector<Tensor>> inputs,
                                            ReduceOp op) override {
    if (calls_++ == 0) throw CommError("refused");
    return ProcessGroup::reduce_scatter_flat(output, std::move(inputs), op);
  }

 private:
  int calls_ = 0;
};

// A bucket's primitive that throws fails that run, naming the bucket, and nothing more: the
// later runs (new inputs each time; 80 KB members, so buffers come from the allocator's cache)
// get every sum right and the members handed to the primitive intact (%n reads %a after the
// bucket; %b is an output). `pack` packs %a and %b into %pack; the bucket's results have
// `numel` elements each.
void expect_throwing_primitive_fails_only_its_run(const std::string& pack,
                                                  const std::string& collective, int64_t numel) {
  const std::string text =
      "graph @g(%a: f32[20000], %b: f32[20000]) {\n" + pack + "  %bucket = " + collective +
      "\n"
      "  %w = wait_tensor(%bucket)\n"
      "  %s:2 = split_with_sizes(%w) {split_sizes = [" + std::to_string(numel) + ", " +
      std::to_string(numel) + "], dim = 0}\n"
      "  %n = neg(%a)\n"
      "  return %s#0, %s#1, %n, %b\n"
      "}\n";
  auto graph = parse_graph(text);
  // %bucket's line: after the graph's and the packing's.
  const std::string line = std::to_string(2 + std::count(pack.begin(), pack.end(), '\n'));
  run_local(2, [&](ProcessGroup& world) {
    world.registry().add(std::make_shared<ThrowsOnceGroup>(world, "once"));
    Executor ex(*graph, world);
    EXPECT_EQ(ex.lowered_buckets(), 1u);
    auto full = [](int64_t n, double v) { return Tensor::full({n}, DType::F32, v); };
    auto inputs = [&](int it) {
      const double a = 1 + world.rank() + 4 * it;
      return std::vector<Tensor>{full(20000, a), full(20000, 2 * a)};
    };
    try {
      ex.run(inputs(0));
      ADD_FAILURE() << "the bucket's primitive did not throw";
    } catch (const CommError& e) {
      EXPECT_EQ(std::string(e.what()), "graph @g, node %bucket (line " + line + "): refused");
    }
    for (int it = 1; it < 4; ++it) {
      const auto out = ex.run(inputs(it));
      const double a = 1 + world.rank() + 4 * it;
      const double sum = 3 + 8 * it;  // %a summed over both ranks
      EXPECT_TRUE(out[0].equal(full(numel, sum))) << it;
      EXPECT_TRUE(out[1].equal(full(numel, 2 * sum))) << it;
      EXPECT_TRUE(out[2].equal(full(20000, -a))) << it;
      EXPECT_TRUE(out[3].equal(full(20000, 2 * a))) << it;
    }
  });
}

TEST(LowerBuckets, AThrowingPrimitiveFailsOnlyItsRun) {
  expect_throwing_primitive_fails_only_its_run(
      "  %pack = cat(%a, %b) {dim = 0}\n",
      "all_reduce(%pack) {reduce_op = \"sum\", group = \"once\"}", 20000);
  expect_throwing_primitive_fails_only_its_run(
      "  %ra = reshape(%a) {shape = [2, 10000]}\n"
      "  %rb = reshape(%b) {shape = [2, 10000]}\n"
      "  %c = cat(%ra, %rb) {dim = 1}\n"
      "  %pack = flatten(%c)\n",
      "reduce_scatter_tensor(%pack) {reduce_op = \"sum\", group_size = 2, group = \"once\"}",
      10000);
}

// ---- donation ----

TEST(Donation, AnIntermediateAtItsLastUseIsReducedInPlace) {
  const std::string text =
      "graph @g(%x: f32[70000]) {\n"
      "  %y = neg(%x)\n"
      "  %ar = all_reduce(%y) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %w = wait_tensor(%ar)\n"
      "  return %w\n"
      "}\n";
  auto graph = parse_graph(text);
  int64_t large_allocations = 0;
  run_local(2, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    const Tensor x = Tensor::full({70000}, DType::F32, 1.0 + world.rank());
    for (int i = 0; i < 3; ++i) {
      world.barrier();
      const AllocatorStats before = allocator_stats();
      world.barrier();
      const auto out = ex.run({x});
      world.barrier();
      const AllocatorStats after = allocator_stats();
      if (world.rank() == 0) large_allocations = after.hits + after.misses - before.hits - before.misses;
      EXPECT_EQ(out[0].to_vector<float>()[69999], -3.0f);
      EXPECT_EQ(x.to_vector<float>()[0], 1.0f + world.rank());  // the caller's input is intact
      world.barrier();
    }
  });
  // One 280 KB buffer per rank and run (neg's result, reduced in place), not two (a clone).
  EXPECT_EQ(large_allocations, 2);
}

TEST(Donation, AnOperandUsedLaterOrHeldByTheCallerIsCopied) {
  const std::string text =
      "graph @g(%x: f32[4]) {\n"
      "  %y = neg(%x)\n"
      "  %ar = all_reduce(%y) {reduce_op = \"sum\", group = \"world\"}\n"
      "  %bc = broadcast(%x) {src = 1, group = \"world\"}\n"
      "  %w = wait_tensor(%ar)\n"
      "  %w2 = wait_tensor(%bc)\n"
      "  %z = add(%y, %w)\n"
      "  return %z, %w2, %x\n"
      "}\n";
  auto graph = parse_graph(text);
  run_local(2, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    const float v = 1.0f + static_cast<float>(world.rank());
    const Tensor x = Tensor::full({4}, DType::F32, v);
    const auto out = ex.run({x});
    EXPECT_EQ(out[0].to_vector<float>()[0], -v - 3.0f);  // %y was not reduced in place
    EXPECT_EQ(out[1].to_vector<float>()[0], 2.0f);
    EXPECT_EQ(out[2].to_vector<float>()[0], v);  // %x is an output: not broadcast in place
    EXPECT_EQ(x.to_vector<float>()[0], v);
  });
}

}  // namespace
}  // namespace funcol
