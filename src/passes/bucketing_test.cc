// Tests of the bucketing passes: options, the shared routine's rules in both directions, the
// buffer layouts (checked by running every rank), placement, explain text and determinism.
#include "funcol/passes/bucketing.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>

#include "bucketing_test_util.h"
#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/pipeline.h"
#include "testing/error_of.h"

namespace funcol {
namespace {

using testing_bucketing::random_inputs;
using testing_bucketing::same_outputs;
using testing_bucketing::simulate;

int count_op(const Graph& g, std::string_view op) {
  int n = 0;
  for (const Node& node : g.nodes()) n += node.op_name() == op ? 1 : 0;
  return n;
}

int count_collectives(const Graph& g) {
  int n = 0;
  for (const Node& node : g.nodes()) n += node.op().is_collective() ? 1 : 0;
  return n;
}

BucketOptions opts(CollectiveKind kind, std::string_view cap = "2000",
                   BucketMode mode = BucketMode::Default) {
  BucketOptions o;
  o.kind = kind;
  o.cap_mb = parse_cap_mb(cap);
  o.mode = mode;
  return o;
}

// Parses `text`, buckets a copy, checks it verifies and computes bit-identical outputs on 4
// ranks, and returns the bucketed graph.
struct Bucketed {
  std::unique_ptr<Graph> graph;
  BucketingStats stats;
  std::string explain;
  std::string printed;
};

Bucketed bucket_checked(std::string_view text, const BucketOptions& o) {
  std::unique_ptr<Graph> before = parse_graph(text);
  Bucketed b;
  b.graph = parse_graph(text);
  b.stats = bucket_collectives(*b.graph, o, &b.explain);
  EXPECT_NO_THROW(verify(*b.graph)) << print(*b.graph);
  b.printed = print(*b.graph);
  const auto in = random_inputs(*before, 4, 7);
  std::string why;
  EXPECT_TRUE(same_outputs(simulate(*before, in), simulate(*b.graph, in), &why)) << why << "\n"
                                                                                 << b.printed;
  // Determinism: a second copy buckets to the same text; idempotence: a second run changes
  // nothing.
  std::unique_ptr<Graph> again = parse_graph(text);
  bucket_collectives(*again, o);
  EXPECT_EQ(print(*again), b.printed);
  const BucketingStats second = bucket_collectives(*again, o);
  EXPECT_FALSE(second.changed());
  EXPECT_EQ(print(*again), b.printed);
  return b;
}

// ---- options ------------------------------------------------------------------------------------

TEST(BucketOptions, DefaultCapIs2000Mb) {
  EXPECT_EQ(bucket_cap_bytes(BucketOptions{}, 0), int64_t{2000} * 1024 * 1024);
  EXPECT_EQ(bucket_cap_bytes(BucketOptions{}, 99), int64_t{2000} * 1024 * 1024);
}

TEST(BucketOptions, CapListByBucketIndexLastRepeats) {
  BucketOptions o;
  o.cap_mb = parse_cap_mb("1:25");
  ASSERT_EQ(o.cap_mb, (std::vector<double>{1, 25}));
  EXPECT_EQ(bucket_cap_bytes(o, 0), 1048576);
  EXPECT_EQ(bucket_cap_bytes(o, 1), 25 * 1048576);
  EXPECT_EQ(bucket_cap_bytes(o, 7), 25 * 1048576);
  o.cap_mb = parse_cap_mb("0.5:0.00024318695068359375");
  EXPECT_EQ(bucket_cap_bytes(o, 0), 524288);
  EXPECT_EQ(bucket_cap_bytes(o, 1), 255);
  EXPECT_EQ(format_cap_mb(o.cap_mb), "0.5:0.00024318695068359375");
  // A cap under one byte still admits one byte; a huge cap saturates at the largest value.
  o.cap_mb = {1e-12, 1e300};
  EXPECT_EQ(bucket_cap_bytes(o, 0), 1);
  EXPECT_EQ(bucket_cap_bytes(o, 1), kMaxTypeBytes);
}

TEST(BucketOptions, BadCapsAreRejected) {
  for (std::string_view bad :
       {"", ":", "1:", ":1", "abc", "0", "-1", "inf", "nan", "1e999", "1:0", "1;2", " 1"}) {
    EXPECT_THROW(parse_cap_mb(bad), InvalidArgument) << bad;
  }
  EXPECT_EQ(parse_cap_mb("+5:+0.5"), (std::vector<double>{5, 0.5}));
  EXPECT_THROW(parse_cap_mb("+"), InvalidArgument);
  EXPECT_THROW(parse_cap_mb("++5"), InvalidArgument);
  EXPECT_THROW(parse_cap_mb("+-5"), InvalidArgument);
  try {
    parse_cap_mb("1:x");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "cap-mb: 'x' is not a positive number (in '1:x')");
  }
  // An infinite cap, from text or from the API, says what merges without a limit.
  BucketOptions o;
  o.cap_mb = {1, std::numeric_limits<double>::infinity()};
  try {
    check_bucket_options(o);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(),
                 "cap-mb: 'inf' is not a finite number; a cap larger than every bucket, such as "
                 "1e6, merges without a limit");
  }
  o.cap_mb = {-std::numeric_limits<double>::infinity()};
  EXPECT_THROW(check_bucket_options(o), InvalidArgument);
}

TEST(BucketOptions, Modes) {
  for (BucketMode m : {BucketMode::Default, BucketMode::CustomOps, BucketMode::MultiDtype,
                       BucketMode::CustomOpsMultiDtype}) {
    EXPECT_EQ(parse_bucket_mode(bucket_mode_name(m)), m);
  }
  EXPECT_THROW(parse_bucket_mode("coalesced"), InvalidArgument);
  EXPECT_THROW(parse_bucket_mode("Default"), InvalidArgument);
}

TEST(BucketOptions, MultidtypeOnlyForAllGather) {
  for (BucketMode m : {BucketMode::MultiDtype, BucketMode::CustomOpsMultiDtype}) {
    EXPECT_NO_THROW(check_bucket_options(opts(CollectiveKind::AllGather, "1", m)));
    try {
      check_bucket_options(opts(CollectiveKind::ReduceScatter, "1", m));
      FAIL();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("reduce scatter bucketing does not support multidtype"),
                std::string::npos)
          << e.what();
    }
    try {
      check_bucket_options(opts(CollectiveKind::AllReduce, "1", m));
      FAIL();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("all reduce bucketing does not support multidtype"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(check_bucket_options(opts(CollectiveKind::AllToAll)), InvalidArgument);
}

TEST(BucketOptions, ANegativeRetryBudgetIsRejected) {
  BucketOptions o = opts(CollectiveKind::AllGather);
  o.retry_work = 0;
  EXPECT_NO_THROW(check_bucket_options(o));
  o.retry_work = -1;
  const std::string what = testing::error_of<InvalidArgument>([&] { check_bucket_options(o); });
  EXPECT_EQ(what, "retry_work: the budget of later tries is -1; it must be at least 0");
}

TEST(BucketOptions, FewerThanOneRoundIsRejected) {
  BucketOptions o = opts(CollectiveKind::AllGather);
  o.max_rounds = 1;
  EXPECT_NO_THROW(check_bucket_options(o));
  o.max_rounds = 0;
  const std::string what = testing::error_of<InvalidArgument>([&] { check_bucket_options(o); });
  EXPECT_EQ(what, "max_rounds: 0 rounds; at least 1 must run");
}

TEST(BucketPasses, RegisteredWithTheirOptions) {
  const PassRegistry& reg = default_pass_registry();
  for (std::string_view name :
       {"bucket-all-gather", "bucket-reduce-scatter", "bucket-all-reduce"}) {
    const PassInfo* info = reg.find(name);
    ASSERT_NE(info, nullptr) << name;
    EXPECT_EQ(info->options, (std::vector<std::string>{"cap-mb", "mode"}));
    const PassOptions po(std::vector<std::pair<std::string, std::string>>{{"cap-mb", "1:25"}});
    EXPECT_EQ(reg.create(name, po)->name(), name);
  }
  Pipeline p =
      Pipeline::parse("bucket-all-gather{cap-mb=1:25 mode=multidtype},bucket-reduce-scatter");
  ASSERT_EQ(p.size(), 2u);
  const auto* ag = dynamic_cast<const BucketPass*>(p.passes()[0].get());
  ASSERT_NE(ag, nullptr);
  EXPECT_EQ(ag->options().cap_mb, (std::vector<double>{1, 25}));
  EXPECT_EQ(ag->options().mode, BucketMode::MultiDtype);
  EXPECT_THROW(Pipeline::parse("bucket-reduce-scatter{mode=multidtype}"), InvalidArgument);
  EXPECT_THROW(Pipeline::parse("bucket-all-reduce{mode=custom_ops_multidtype}"), InvalidArgument);
  EXPECT_THROW(Pipeline::parse("bucket-all-gather{cap-mb=0}"), InvalidArgument);
  EXPECT_THROW(Pipeline::parse("bucket-all-gather{mode=fast}"), InvalidArgument);
}

// ---- merging and layouts ------------------------------------------------------------------------

constexpr std::string_view kTwoAllGathers = R"(graph @g(%a: f32[2,3], %b: f32[4]) {
  %ag0 = all_gather_into_tensor(%a) {group_size = 4, group = "world"}
  %w0 = wait_tensor(%ag0)
  %ag1 = all_gather_into_tensor(%b) {group_size = 4, group = "world"}
  %w1 = wait_tensor(%ag1)
  return %w0, %w1
})";

TEST(BucketAllGather, DefaultLayoutIsFlattenCatGatherViewSplitReshape) {
  Bucketed b = bucket_checked(kTwoAllGathers, opts(CollectiveKind::AllGather));
  EXPECT_EQ(b.stats.merged_buckets, 1);
  EXPECT_EQ(b.stats.merged_collectives, 2);
  EXPECT_EQ(b.printed, R"(graph @g(%a: f32[2,3], %b: f32[4]) {
  %ag_flat = flatten(%a) : f32[6]
  %ag_pack = cat(%ag_flat, %b) {dim = 0} : f32[10]
  %ag_bucket = all_gather_into_tensor(%ag_pack) {group_size = 4, group = "world"} : f32[40]
  %ag_wait = wait_tensor(%ag_bucket) : f32[40]
  %ag_rows = view(%ag_wait) {shape = [4, 10]} : f32[4,10]
  %ag_split:2 = split_with_sizes(%ag_rows) {split_sizes = [6, 4], dim = 1} : f32[4,6], f32[4,4]
  %ag_out = reshape(%ag_split#0) {shape = [8, 3]} : f32[8,3]
  %ag_out.1 = reshape(%ag_split#1) {shape = [16]} : f32[16]
  return %ag_out, %ag_out.1
}
)");
}

TEST(BucketAllGather, CustomOpsPacksStraightIntoTheGatheredBuffer) {
  Bucketed b = bucket_checked(kTwoAllGathers,
                              opts(CollectiveKind::AllGather, "2000", BucketMode::CustomOps));
  EXPECT_EQ(count_op(*b.graph, "all_gather_into_tensor_packed"), 1);
  EXPECT_EQ(count_op(*b.graph, "all_gather_into_tensor"), 0);
  EXPECT_EQ(count_op(*b.graph, "cat"), 0);
  EXPECT_NE(b.printed.find("all_gather_into_tensor_packed(%a, %b) {group_size = 4, group = "
                           "\"world\", dtype = f32, out_dtypes = [f32, f32]} : f32[40]"),
            std::string::npos)
      << b.printed;
}

TEST(BucketReduceScatter, LayoutRowsPerRankThenConcatenated) {
  constexpr std::string_view text = R"(graph @g(%a: f32[8,3], %b: i32[4], %c: f32[4]) {
  %rs0 = reduce_scatter_tensor(%a) {reduce_op = "sum", group_size = 4, group = "world"}
  %w0 = wait_tensor(%rs0)
  %rs1 = reduce_scatter_tensor(%c) {reduce_op = "sum", group_size = 4, group = "world"}
  %w1 = wait_tensor(%rs1)
  return %w0, %w1
})";
  for (BucketMode m : {BucketMode::Default, BucketMode::CustomOps}) {
    Bucketed b = bucket_checked(text, opts(CollectiveKind::ReduceScatter, "2000", m));
    EXPECT_EQ(count_op(*b.graph, "reduce_scatter_tensor"), 1);
    EXPECT_EQ(count_op(*b.graph, "bucket_pack"), m == BucketMode::CustomOps ? 1 : 0);
  }
  Bucketed b = bucket_checked(text, opts(CollectiveKind::ReduceScatter));
  EXPECT_NE(b.printed.find("%rs_rows = reshape(%a) {shape = [4, 6]}"), std::string::npos)
      << b.printed;
  EXPECT_NE(b.printed.find("cat(%rs_rows, %rs_rows.1) {dim = 1} : f32[4,7]"), std::string::npos)
      << b.printed;
}

TEST(BucketAllReduce, FlattenCatReduceSplitReshape) {
  constexpr std::string_view text = R"(graph @g(%a: f32[3,2], %b: f32[5], %c: f32[]) {
  %ar0 = all_reduce(%a) {reduce_op = "avg", group = "world"}
  %w0 = wait_tensor(%ar0)
  %m = neg(%a) : f32[3,2]
  %ar1 = all_reduce(%b) {reduce_op = "avg", group = "world"}
  %w1 = wait_tensor(%ar1)
  %ar2 = all_reduce(%c) {reduce_op = "avg", group = "world"}
  %w2 = wait_tensor(%ar2)
  return %w0, %w1, %w2, %m
})";
  for (BucketMode m : {BucketMode::Default, BucketMode::CustomOps}) {
    Bucketed b = bucket_checked(text, opts(CollectiveKind::AllReduce, "2000", m));
    EXPECT_EQ(count_op(*b.graph, "all_reduce"), 1);
    EXPECT_EQ(b.stats.merged_collectives, 3);
  }
}

TEST(BucketAllGather, ScalarsAndEmptyTensors) {
  constexpr std::string_view text = R"(graph @g(%a: f32[], %b: f32[0,3], %c: f32[2]) {
  %ag0 = all_gather_into_tensor(%a) {group_size = 2, group = "tp"}
  %w0 = wait_tensor(%ag0)
  %ag1 = all_gather_into_tensor(%b) {group_size = 2, group = "tp"}
  %w1 = wait_tensor(%ag1)
  %ag2 = all_gather_into_tensor(%c) {group_size = 2, group = "tp"}
  %w2 = wait_tensor(%ag2)
  return %w0, %w1, %w2
})";
  for (BucketMode m : {BucketMode::Default, BucketMode::CustomOps}) {
    Bucketed b = bucket_checked(text, opts(CollectiveKind::AllGather, "2000", m));
    EXPECT_EQ(count_collectives(*b.graph), 1) << b.printed;
  }
}

// ---- keys ---------------------------------------------------------------------------------------

TEST(BucketKeys, DifferentGroupReduceOpOrDtypeNeverMerge) {
  // Alternating keys: no two adjacent collectives share one.
  Bucketed ag = bucket_checked(R"(graph @g(%a: f32[4], %b: f32[4], %c: f32[4]) {
  %x = all_gather_into_tensor(%a) {group_size = 2, group = "tp"}
  %wx = wait_tensor(%x)
  %y = all_gather_into_tensor(%b) {group_size = 2, group = "dp"}
  %wy = wait_tensor(%y)
  %z = all_gather_into_tensor(%c) {group_size = 2, group = "tp"}
  %wz = wait_tensor(%z)
  return %wx, %wy, %wz
})",
                               opts(CollectiveKind::AllGather));
  EXPECT_FALSE(ag.stats.changed());
  EXPECT_EQ(ag.stats.buckets, 3);
  EXPECT_NE(ag.explain.find("closed: key change (next %y has group \"dp\""), std::string::npos)
      << ag.explain;

  Bucketed rs = bucket_checked(R"(graph @g(%a: f32[4], %b: f32[4]) {
  %x = reduce_scatter_tensor(%a) {reduce_op = "sum", group_size = 4, group = "world"}
  %wx = wait_tensor(%x)
  %y = reduce_scatter_tensor(%b) {reduce_op = "avg", group_size = 4, group = "world"}
  %wy = wait_tensor(%y)
  return %wx, %wy
})",
                               opts(CollectiveKind::ReduceScatter));
  EXPECT_FALSE(rs.stats.changed());

  Bucketed ar = bucket_checked(R"(graph @g(%a: f32[4], %b: bf16[4]) {
  %x = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %wx = wait_tensor(%x)
  %y = all_reduce(%b) {reduce_op = "sum", group = "world"}
  %wy = wait_tensor(%y)
  return %wx, %wy
})",
                               opts(CollectiveKind::AllReduce));
  EXPECT_FALSE(ar.stats.changed());
}

TEST(BucketKeys, OtherKindsAndComputeInBetweenDoNotBreakARun) {
  Bucketed b = bucket_checked(R"(graph @g(%a: f32[4], %b: f32[4]) {
  %x = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %wx = wait_tensor(%x)
  %r = reduce_scatter_tensor(%b) {reduce_op = "sum", group_size = 4, group = "world"}
  %wr = wait_tensor(%r)
  %n = neg(%b)
  %y = all_reduce(%n) {reduce_op = "sum", group = "world"}
  %wy = wait_tensor(%y)
  return %wx, %wy, %wr
})",
                              opts(CollectiveKind::AllReduce));
  EXPECT_EQ(b.stats.merged_buckets, 1);
  EXPECT_EQ(count_op(*b.graph, "all_reduce"), 1);
  EXPECT_EQ(count_op(*b.graph, "reduce_scatter_tensor"), 1);
}

TEST(BucketAllGather, MultidtypeMergesDtypesDefaultDoesNot) {
  constexpr std::string_view text = R"(graph @g(%a: bf16[3,5], %b: f32[3,5], %c: i8[3]) {
  %x = all_gather_into_tensor(%a) {group_size = 4, group = "world"}
  %wx = wait_tensor(%x)
  %y = all_gather_into_tensor(%b) {group_size = 4, group = "world"}
  %wy = wait_tensor(%y)
  %z = all_gather_into_tensor(%c) {group_size = 4, group = "world"}
  %wz = wait_tensor(%z)
  return %wx, %wy, %wz
})";
  EXPECT_FALSE(bucket_checked(text, opts(CollectiveKind::AllGather)).stats.changed());
  for (BucketMode m : {BucketMode::MultiDtype, BucketMode::CustomOpsMultiDtype}) {
    Bucketed b = bucket_checked(text, opts(CollectiveKind::AllGather, "2000", m));
    EXPECT_EQ(count_collectives(*b.graph), 1) << b.printed;
    EXPECT_EQ(b.stats.merged_collectives, 3);
    // Packed in the smallest itemsize (i8); 15 bf16 = 30 bytes, 15 f32 = 60, 3 i8 = 3.
    EXPECT_NE(b.printed.find(": i8[372]"), std::string::npos) << b.printed;
  }
}

TEST(BucketAllGather, MultidtypeWithinOneRankGroupAndBools) {
  // Group size 1: column blocks are contiguous views at odd byte offsets; the unpacking copies
  // them before viewing as the member dtype.
  constexpr std::string_view text = R"(graph @g(%a: bool[3], %b: f32[2], %c: f16[1]) {
  %x = all_gather_into_tensor(%a) {group_size = 1, group = "solo"}
  %wx = wait_tensor(%x)
  %y = all_gather_into_tensor(%b) {group_size = 1, group = "solo"}
  %wy = wait_tensor(%y)
  %z = all_gather_into_tensor(%c) {group_size = 1, group = "solo"}
  %wz = wait_tensor(%z)
  return %wx, %wy, %wz
})";
  for (BucketMode m : {BucketMode::MultiDtype, BucketMode::CustomOpsMultiDtype}) {
    std::unique_ptr<Graph> before = parse_graph(text);
    std::unique_ptr<Graph> g = parse_graph(text);
    const BucketingStats s = bucket_collectives(*g, opts(CollectiveKind::AllGather, "2000", m));
    EXPECT_EQ(s.merged_collectives, 3);
    verify(*g);
    // Bools pack as u8, never read as bool.
    EXPECT_NE(print(*g).find("u8[13]"), std::string::npos) << print(*g);
    auto groups = testing_bucketing::mesh_groups_4();
    groups["solo"] = {{0}, {1}, {2}, {3}};
    const auto in = random_inputs(*before, 4, 3);
    std::string why;
    EXPECT_TRUE(same_outputs(simulate(*before, in, groups), simulate(*g, in, groups), &why)) << why;
  }
}

// ---- caps ---------------------------------------------------------------------------------------

// Two all-gathers of 128 output bytes each (f32[8] over 4 ranks).
constexpr std::string_view kTwo128 = R"(graph @g(%a: f32[8], %b: f32[8]) {
  %x = all_gather_into_tensor(%a) {group_size = 4, group = "world"}
  %wx = wait_tensor(%x)
  %y = all_gather_into_tensor(%b) {group_size = 4, group = "world"}
  %wy = wait_tensor(%y)
  return %wx, %wy
})";

TEST(BucketCaps, CapMergesCapMinusOneByteDoesNot) {
  // 256 bytes = 0.000244140625 MB exactly; 255 bytes = 0.00024318695068359375 MB.
  Bucketed at_cap = bucket_checked(kTwo128, opts(CollectiveKind::AllGather, "0.000244140625"));
  EXPECT_EQ(at_cap.stats.merged_buckets, 1);
  Bucketed below =
      bucket_checked(kTwo128, opts(CollectiveKind::AllGather, "0.00024318695068359375"));
  EXPECT_EQ(below.stats.merged_buckets, 0);
  EXPECT_EQ(below.stats.buckets, 2);
  EXPECT_NE(below.explain.find("bucket 0: %x (128 B); 128 B of cap 255 B; closed: cap (adding %y "
                               "of 128 B would make 256 B); left alone (one collective)"),
            std::string::npos)
      << below.explain;
}

TEST(BucketCaps, ALargerCollectiveStartsItsOwnBucket) {
  Bucketed b = bucket_checked(kTwo128, opts(CollectiveKind::AllGather, "0.00001"));  // 10 bytes
  EXPECT_FALSE(b.stats.changed());
  EXPECT_EQ(b.stats.buckets, 2);
}

TEST(BucketCaps, IndexMovesAcrossBucketsAndRuns) {
  // cap-mb = 128 B : 1 MB. Within one run: bucket 0 = {a} (cap), bucket 1 = {b, c, d}.
  constexpr std::string_view four = R"(graph @g(%a: f32[8], %b: f32[8], %c: f32[8], %d: f32[8]) {
  %xa = all_gather_into_tensor(%a) {group_size = 4, group = "world"}
  %wa = wait_tensor(%xa)
  %xb = all_gather_into_tensor(%b) {group_size = 4, group = "world"}
  %wb = wait_tensor(%xb)
  %xc = all_gather_into_tensor(%c) {group_size = 4, group = "world"}
  %wc = wait_tensor(%xc)
  %xd = all_gather_into_tensor(%d) {group_size = 4, group = "world"}
  %wd = wait_tensor(%xd)
  return %wa, %wb, %wc, %wd
})";
  const std::string caps = "0.0001220703125:1";
  Bucketed b = bucket_checked(four, opts(CollectiveKind::AllGather, caps));
  EXPECT_EQ(b.stats.buckets, 2);
  EXPECT_EQ(b.stats.merged_collectives, 3);
  EXPECT_NE(b.explain.find("bucket 0: %xa (128 B); 128 B of cap 128 B; closed: cap"),
            std::string::npos)
      << b.explain;
  EXPECT_NE(b.explain.find("bucket 1: %xb (128 B), %xc (128 B), %xd (128 B); 384 B of cap "
                           "1048576 B; closed: end of run; merged 3 collectives"),
            std::string::npos)
      << b.explain;
  // A first run of one (group tp) closes bucket 0, so the next run already gets cap 1 MB
  // (the seed computes the cap once per run from index 0 and would merge nothing here).
  constexpr std::string_view runs = R"(graph @g(%a: f32[8], %b: f32[8], %c: f32[8]) {
  %xa = all_gather_into_tensor(%a) {group_size = 2, group = "tp"}
  %wa = wait_tensor(%xa)
  %xb = all_gather_into_tensor(%b) {group_size = 4, group = "world"}
  %wb = wait_tensor(%xb)
  %xc = all_gather_into_tensor(%c) {group_size = 4, group = "world"}
  %wc = wait_tensor(%xc)
  return %wa, %wb, %wc
})";
  Bucketed r = bucket_checked(runs, opts(CollectiveKind::AllGather, caps));
  EXPECT_EQ(r.stats.merged_collectives, 2);
  // Without the first run, the same pair meets the 128-byte cap and stays apart.
  Bucketed alone = bucket_checked(kTwo128, opts(CollectiveKind::AllGather, caps));
  EXPECT_FALSE(alone.stats.changed());
}

// ---- eligibility and dependencies ---------------------------------------------------------------

TEST(BucketEligibility, ACollectiveWithAnotherUserIsLeftAlone) {
  Bucketed b = bucket_checked(R"(graph @g(%a: f32[4], %b: f32[4], %c: f32[4]) {
  %x = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %wx = wait_tensor(%x)
  %y = all_reduce(%b) {reduce_op = "sum", group = "world"}
  %peek = neg(%y)
  %wy = wait_tensor(%y)
  %z = all_reduce(%c) {reduce_op = "sum", group = "world"}
  %wz = wait_tensor(%z)
  return %wx, %wy, %wz, %peek
})",
                              opts(CollectiveKind::AllReduce));
  EXPECT_EQ(b.stats.skipped_ineligible, 1);
  EXPECT_EQ(b.stats.merged_collectives, 2);  // x and z merge around y
  EXPECT_EQ(count_op(*b.graph, "all_reduce"), 2);
  EXPECT_NE(b.explain.find("skipped %y: ineligible: its result is also used by %peek (operand 0)"),
            std::string::npos)
      << b.explain;
  Bucketed out = bucket_checked(R"(graph @g(%a: f32[4], %b: f32[4]) {
  %x = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %wx = wait_tensor(%x)
  %y = all_reduce(%b) {reduce_op = "sum", group = "world"}
  %wy = wait_tensor(%y)
  return %wx, %wy, %y
})",
                                opts(CollectiveKind::AllReduce));
  EXPECT_FALSE(out.stats.changed());
  EXPECT_NE(out.explain.find("skipped %y: ineligible: its result is also graph output 2"),
            std::string::npos)
      << out.explain;
}

TEST(BucketDependencies, ADependentCollectiveIsSkippedAndDoesNotCloseTheBucket) {
  // c's input comes from a's wait: c is skipped; a, b and d merge.
  Bucketed b = bucket_checked(R"(graph @g(%a: f32[4], %b: f32[4], %d: f32[4]) {
  %ga = all_gather_into_tensor(%a) {group_size = 4, group = "world"}
  %wa = wait_tensor(%ga)
  %gb = all_gather_into_tensor(%b) {group_size = 4, group = "world"}
  %wb = wait_tensor(%gb)
  %s = sum(%wa) {dims = [0], keepdim = true}
  %t = reshape(%s) {shape = [1]}
  %gc = all_gather_into_tensor(%t) {group_size = 4, group = "world"}
  %wc = wait_tensor(%gc)
  %gd = all_gather_into_tensor(%d) {group_size = 4, group = "world"}
  %wd = wait_tensor(%gd)
  return %wb, %wc, %wd
})",
                              opts(CollectiveKind::AllGather));
  EXPECT_EQ(b.stats.skipped_dependent, 1);
  EXPECT_EQ(b.stats.merged_collectives, 3);
  EXPECT_EQ(b.stats.buckets, 1);
  EXPECT_EQ(count_op(*b.graph, "all_gather_into_tensor"), 2);
  EXPECT_NE(b.explain.find("skipped %gc: depends on bucket 0: %gc <- %t <- %s <- %wa <- %ga"),
            std::string::npos)
      << b.explain;
}

TEST(BucketDependencies, ChainOfDependentCollectivesNeverMerges) {
  Bucketed b = bucket_checked(R"(graph @g(%a: f32[4]) {
  %x = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %wx = wait_tensor(%x)
  %y = all_reduce(%wx) {reduce_op = "sum", group = "world"}
  %wy = wait_tensor(%y)
  %z = all_reduce(%wy) {reduce_op = "sum", group = "world"}
  %wz = wait_tensor(%z)
  return %wz
})",
                              opts(CollectiveKind::AllReduce));
  EXPECT_FALSE(b.stats.changed());
  EXPECT_EQ(b.stats.skipped_dependent, 2);
}

// ---- cast folding -------------------------------------------------------------------------------

constexpr std::string_view kCasts = R"(graph @g(%a: f32[4], %b: f32[4]) {
  %ca = convert_element_type(%a) {dtype = bf16}
  %x = all_gather_into_tensor(%ca) {group_size = 4, group = "world"}
  %wx = wait_tensor(%x)
  %cb = convert_element_type(%b) {dtype = bf16}
  %y = all_gather_into_tensor(%cb) {group_size = 4, group = "world"}
  %wy = wait_tensor(%y)
  return %wx, %wy SECOND
})";

std::string casts(bool second_user) {
  std::string s(kCasts);
  s.replace(s.find(" SECOND"), 7, second_user ? ", %cb" : "");
  return s;
}

TEST(BucketAllGather, SingleUserCastIsFoldedIntoThePacking) {
  Bucketed b =
      bucket_checked(casts(false), opts(CollectiveKind::AllGather, "2000", BucketMode::CustomOps));
  EXPECT_EQ(count_op(*b.graph, "convert_element_type"), 0) << b.printed;
  EXPECT_NE(b.printed.find("all_gather_into_tensor_packed(%a, %b) {group_size = 4, group = "
                           "\"world\", dtype = bf16, out_dtypes = [bf16, bf16]}"),
            std::string::npos)
      << b.printed;
  // Default mode moves the conversion into the packing sequence (after the flatten).
  Bucketed d = bucket_checked(casts(false), opts(CollectiveKind::AllGather));
  EXPECT_EQ(count_op(*d.graph, "convert_element_type"), 2);
  EXPECT_EQ(d.graph->find_node("ca"), nullptr);
}

TEST(BucketAllGather, CastWithTwoUsersIsNotFolded) {
  Bucketed b =
      bucket_checked(casts(true), opts(CollectiveKind::AllGather, "2000", BucketMode::CustomOps));
  EXPECT_NE(b.graph->find_node("cb"), nullptr);
  EXPECT_EQ(b.graph->find_node("ca"), nullptr);
  EXPECT_NE(b.printed.find("all_gather_into_tensor_packed(%a, %cb)"), std::string::npos)
      << b.printed;
}

// ---- placement ----------------------------------------------------------------------------------

TEST(BucketPlacement, MergedCollectiveGoesAfterTheLatestInputAndWaitBeforeFirstConsumer) {
  // a's wait is used (by %m) before b's input %nb is computed, but %m comes after %nb: the gap
  // between %nb and %m holds the bucket; nothing else moves.
  Bucketed b = bucket_checked(R"(graph @g(%a: f32[4], %b: f32[4]) {
  %x = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %nb = neg(%b)
  %wx = wait_tensor(%x)
  %m = neg(%wx)
  %y = all_reduce(%nb) {reduce_op = "sum", group = "world"}
  %wy = wait_tensor(%y)
  return %m, %wy
})",
                              opts(CollectiveKind::AllReduce));
  EXPECT_EQ(b.stats.merged_buckets, 1);
  EXPECT_EQ(b.stats.region_reorders, 0);
  const std::string& p = b.printed;
  EXPECT_LT(p.find("%nb = neg"), p.find("%ar_bucket = all_reduce"));
  EXPECT_LT(p.find("%ar_bucket = all_reduce"), p.find("%ar_wait = wait_tensor"));
  EXPECT_LT(p.find("%ar_wait = wait_tensor"), p.find("%m = neg"));
}

TEST(BucketPlacement, RegionIsReorderedWhenAWaitIsUsedBeforeALaterInputExists) {
  Bucketed b = bucket_checked(R"(graph @g(%w1: f32[4], %x: f32[4], %u: f32[2]) {
  %ag1 = all_gather_into_tensor(%w1) {group_size = 4, group = "world"}
  %wt1 = wait_tensor(%ag1)
  %y = neg(%wt1)
  %v = neg(%u)
  %z = neg(%x)
  %ag2 = all_gather_into_tensor(%z) {group_size = 4, group = "world"}
  %wt2 = wait_tensor(%ag2)
  %after = neg(%v)
  return %y, %wt2, %after
})",
                              opts(CollectiveKind::AllGather));
  EXPECT_EQ(b.stats.merged_buckets, 1);
  EXPECT_EQ(b.stats.region_reorders, 1);
  // Graph order for everything else: %v stays before %z; %y moves after the merged wait.
  const std::string& p = b.printed;
  EXPECT_LT(p.find("%v = neg"), p.find("%z = neg"));
  EXPECT_LT(p.find("%z = neg"), p.find("%ag_bucket ="));
  EXPECT_LT(p.find("%ag_wait ="), p.find("%y = neg"));
  EXPECT_LT(p.find("%y = neg"), p.find("%after = neg"));
}

TEST(BucketPlacement, AMemberThatWouldReorderUnmergedCollectivesIsDropped) {
  // Merging a1 and a2 would need s2 (feeding a2) issued before s1 (fed by a1's wait).
  Bucketed b = bucket_checked(R"(graph @g(%w1: f32[4], %x: f32[4]) {
  %a1 = all_gather_into_tensor(%w1) {group_size = 4, group = "world"}
  %wt1 = wait_tensor(%a1)
  %y = neg(%wt1)
  %s1 = all_reduce(%y) {reduce_op = "sum", group = "world"}
  %s2 = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %ws2 = wait_tensor(%s2)
  %a2 = all_gather_into_tensor(%ws2) {group_size = 4, group = "world"}
  %wt2 = wait_tensor(%a2)
  %ws1 = wait_tensor(%s1)
  return %ws1, %wt2
})",
                              opts(CollectiveKind::AllGather));
  EXPECT_FALSE(b.stats.changed());
  EXPECT_EQ(b.stats.dropped, 1);
  EXPECT_NE(b.explain.find("dropped %a2 from bucket 0"), std::string::npos) << b.explain;
}

// Two interleaved families: every %a's wait feeds an all_reduce, every %b's input comes from
// another one, issued in turn. No placement keeps the all_reduces' order for both families in
// one collective, but each family has one: two merged collectives take every member. (Kept by
// trials of ranges of members, 50 pairs left 11 all-gathers unmerged, 2000 pairs 3927.)
TEST(BucketPlacement, InterleavedFamiliesMergeAsOneCollectiveEach) {
  constexpr int kPairs = 50;
  std::string text = "graph @g(%p: f32[16], %q: f32[64]) {\n";
  std::string outs;
  for (int i = 0; i < kPairs; ++i) {
    text += fmt::format(
        "  %a{0} = all_gather_into_tensor(%p) {{group_size = 4, group = \"world\"}}\n"
        "  %wa{0} = wait_tensor(%a{0})\n"
        "  %u{0} = neg(%wa{0})\n"
        "  %r{0} = all_reduce(%u{0}) {{reduce_op = \"sum\", group = \"world\"}}\n"
        "  %wr{0} = wait_tensor(%r{0})\n"
        "  %s{0} = all_reduce(%q) {{reduce_op = \"sum\", group = \"world\"}}\n"
        "  %ws{0} = wait_tensor(%s{0})\n"
        "  %v{0} = narrow(%ws{0}) {{dim = 0, start = 0, length = 16}}\n"
        "  %b{0} = all_gather_into_tensor(%v{0}) {{group_size = 4, group = \"world\"}}\n"
        "  %wb{0} = wait_tensor(%b{0})\n",
        i);
    outs += fmt::format("{}%wr{}, %wb{}", i ? ", " : "", i, i);
  }
  text += "  return " + outs + "\n}";
  Bucketed b = bucket_checked(text, opts(CollectiveKind::AllGather));
  EXPECT_EQ(b.stats.merged_buckets, 2) << b.explain;
  EXPECT_EQ(b.stats.merged_collectives, 2 * kPairs);
  EXPECT_EQ(b.stats.dropped, 0);
  // The all_reduces keep their issue order.
  size_t at = 0;
  for (int i = 0; i < kPairs; ++i) {
    for (const std::string& name : {fmt::format("%r{} =", i), fmt::format("%s{} =", i)}) {
      const size_t next = b.printed.find(name);
      ASSERT_NE(next, std::string::npos) << name;
      EXPECT_GT(next, at) << name;
      at = next;
    }
  }
}

// %a0 feeds %b1, issued before the all-gathers that feed %a1 and %a2: round 1 cannot merge
// all five of bucket 0 without issuing %b1 after them, so it merges two pieces. Bucket 1 merges
// %b1 (with %b0) after those all-gathers; round 2 merges bucket 0's pieces, packing their
// members (not their packs); round 3 merges nothing (test/lit/bucketing/rounds.ir).
constexpr std::string_view kRoundsGraph = R"(graph @ar(%x: f32[]) {
  %a0 = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %c = convert_element_type(%x) {dtype = f32}
  %g0 = all_gather_into_tensor(%c) {group_size = 4, group = "world"}
  %g0c = clone(%g0)
  %wa0 = wait_tensor(%a0)
  %b1 = all_reduce(%wa0) {reduce_op = "sum", group = "world"}
  %g1 = all_gather_into_tensor(%x) {group_size = 4, group = "world"}
  %wg1 = wait_tensor(%g1)
  %a1 = all_reduce(%wg1) {reduce_op = "sum", group = "world"}
  %wa1 = wait_tensor(%a1)
  %g2 = all_gather_into_tensor(%x) {group_size = 4, group = "world"}
  %wg2 = wait_tensor(%g2)
  %a2 = all_reduce(%wg2) {reduce_op = "sum", group = "world"}
  %wa2 = wait_tensor(%a2)
  %a3 = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %wa3 = wait_tensor(%a3)
  %a4 = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %wa4 = wait_tensor(%a4)
  %g3 = all_gather_into_tensor(%g0c) {group_size = 4, group = "world"}
  %wg3 = wait_tensor(%g3)
  %b0 = all_reduce(%wg3) {reduce_op = "sum", group = "world"}
  %wb0 = wait_tensor(%b0)
  %wb1 = wait_tensor(%b1)
  %c4 = convert_element_type(%x) {dtype = f32}
  %g4 = all_gather_into_tensor(%c4) {group_size = 4, group = "world"}
  %wg4 = wait_tensor(%g4)
  return %wa0, %wg1, %wa1, %wg2, %wa2, %wa3, %wa4, %wg3, %wb0, %wb1, %wg4
})";

TEST(BucketPlacement, MembersALaterBucketKeptOutMergeInALaterRound) {
  Bucketed b = bucket_checked(kRoundsGraph, opts(CollectiveKind::AllReduce, "0.0001"));
  EXPECT_EQ(b.stats.merged_buckets, 3) << b.explain;  // round 1's
  EXPECT_EQ(b.stats.rounds, 3);
  EXPECT_EQ(b.stats.later_merged_buckets, 1);
  EXPECT_EQ(count_op(*b.graph, "all_reduce"), 2);
  EXPECT_EQ(b.printed.find("cat(%ar_pack"), std::string::npos) << b.printed;
  // Rounds cut short say so, and leave what a further run merges.
  for (const int max_rounds : {1, 2}) {
    BucketOptions o = opts(CollectiveKind::AllReduce, "0.0001");
    o.max_rounds = max_rounds;
    std::unique_ptr<Graph> g = parse_graph(kRoundsGraph);
    std::string explain;
    const BucketingStats stats = bucket_collectives(*g, o, &explain);
    EXPECT_EQ(stats.rounds, max_rounds);
    const std::string stopped = fmt::format("  stopped after {} round{}: another may merge more\n",
                                            max_rounds, max_rounds == 1 ? "" : "s");
    EXPECT_NE(explain.find(stopped), std::string::npos) << explain;
    EXPECT_EQ(bucket_collectives(*g, o).changed(), max_rounds == 1);
  }
}

// A bucket whose members pair off (as test/lit/bucketing/retries.ir): each member's input comes
// from an all_reduce issued after the member before it, and each odd member's wait feeds an
// all_reduce. A try merges one pair and drops the rest, so `pairs` pairs take `pairs` tries.
std::string pairing_graph(int pairs) {
  std::string text = "graph @pairs(%x: f32[4]) {\n";
  std::string outs;
  for (int i = 0; i < 2 * pairs; ++i) {
    text += fmt::format(
        "  %c{0} = all_reduce(%x) {{reduce_op = \"sum\", group = \"world\"}}\n"
        "  %wc{0} = wait_tensor(%c{0})\n"
        "  %in{0} = neg(%wc{0})\n"
        "  %m{0} = all_gather_into_tensor(%in{0}) {{group_size = 4, group = \"world\"}}\n"
        "  %w{0} = wait_tensor(%m{0})\n",
        i);
    if (i % 2 == 0) {
      outs += fmt::format("{}%w{}", i ? ", " : "", i);
      continue;
    }
    text += fmt::format(
        "  %b{0} = all_reduce(%w{0}) {{reduce_op = \"sum\", group = \"world\"}}\n"
        "  %wb{0} = wait_tensor(%b{0})\n",
        i);
    outs += fmt::format(", %wb{}", i);
  }
  return text + "  return " + outs + "\n}";
}

// The tries after the first four stop when the pass's later tries have visited retry_work
// region nodes and members: the members left are dropped, the explanation says how many, the
// result still computes what the input did, and a second run (with a budget of its own) merges
// more. With the default budget one run merges every pair.
TEST(BucketPlacement, RetriesStopAtTheirBudget) {
  constexpr int kPairs = 10;
  const std::string text = pairing_graph(kPairs);
  const std::unique_ptr<Graph> before = parse_graph(text);
  const auto in = random_inputs(*before, 4, 11);
  const std::vector<std::vector<Tensor>> expected = simulate(*before, in);
  struct Case {
    int64_t budget;
    int64_t merged;  // pairs merged by the first run
  };
  // Budget 0: the first try and four more; 1: one try after them, which spends the budget.
  for (const Case& c : {Case{0, 5}, Case{1, 6}, Case{kDefaultRetryWork, kPairs}}) {
    SCOPED_TRACE(c.budget);
    BucketOptions o = opts(CollectiveKind::AllGather);
    o.retry_work = c.budget;
    std::unique_ptr<Graph> g = parse_graph(text);
    std::string explain;
    const BucketingStats stats = bucket_collectives(*g, o, &explain);
    EXPECT_NO_THROW(verify(*g)) << print(*g);
    EXPECT_EQ(stats.merged_buckets, c.merged) << explain;
    EXPECT_EQ(stats.merged_collectives, 2 * c.merged);
    EXPECT_EQ(stats.dropped, 2 * (kPairs - c.merged)) << explain;
    // Members left untried stop the rounds; else a second round finds no two pairs merge.
    EXPECT_EQ(stats.rounds, c.merged < kPairs ? 1 : 2) << explain;
    EXPECT_EQ(stats.later_merged_buckets, 0);
    EXPECT_EQ(count_op(*g, "all_gather_into_tensor"), c.merged + 2 * (kPairs - c.merged));
    const std::string untried = fmt::format("bucket 0: {} dropped members not tried again",
                                            2 * (kPairs - c.merged));
    EXPECT_EQ(explain.find(untried) != std::string::npos, c.merged < kPairs) << explain;
    std::string why;
    EXPECT_TRUE(same_outputs(expected, simulate(*g, in), &why)) << why << "\n" << print(*g);
    // The same decisions on a second copy (every rank makes them).
    std::unique_ptr<Graph> copy = parse_graph(text);
    bucket_collectives(*copy, o);
    EXPECT_EQ(print(*copy), print(*g));
    // A second run merges what the budget left untried (one pair more, or five).
    const BucketingStats second = bucket_collectives(*g, o);
    EXPECT_EQ(second.changed(), c.merged < kPairs);
    EXPECT_NO_THROW(verify(*g));
    EXPECT_TRUE(same_outputs(expected, simulate(*g, in), &why)) << why;
  }
}

TEST(BucketExplain, HeaderBucketsAndSummary) {
  Bucketed b = bucket_checked(kTwoAllGathers, opts(CollectiveKind::AllGather, "1:25"));
  EXPECT_EQ(
      b.explain,
      "bucket-all-gather @g: 2 all_gather_into_tensor collectives (cap-mb=1:25 mode=default)\n"
      "  run of group \"world\", group_size 4, dtype f32\n"
      "  bucket 0: %ag0 (96 B), %ag1 (64 B); 160 B of cap 1048576 B; closed: end of run; "
      "merged 2 collectives\n"
      "  1 bucket, 1 merged (2 collectives); skipped 0 dependent, 0 ineligible; dropped 0\n");
}

// A group name with a quote, a backslash and control bytes is quoted as the IR prints it, so a
// run's line stays one line.
TEST(BucketExplain, GroupNamesAreQuotedAsTheIrPrintsThem) {
  std::unique_ptr<Graph> g = parse_graph(R"(graph @g(%x: f32[4], %y: f32[4]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "we\"ir\\d\n\t\x01"}
  %b = all_reduce(%y) {reduce_op = "sum", group = "we\"ir\\d\n\t\x01"}
  %wa = wait_tensor(%a)
  %wb = wait_tensor(%b)
  return %wa, %wb
})");
  std::string explain;
  bucket_collectives(*g, opts(CollectiveKind::AllReduce), &explain);
  EXPECT_NE(explain.find("  run of group \"we\\\"ir\\\\d\\n\\t\\x01\", reduce_op sum, "
                           "dtype f32\n"),
            std::string::npos)
      << explain;
}

// Two members of 2^62 bytes each: the size a cap closes on is printed exactly, not wrapped
// around int64.
TEST(BucketExplain, CapReasonPrintsSumsPastInt64) {
  std::unique_ptr<Graph> g = parse_graph(R"(graph @g(%x: i8[2305843009213693952],
                                                   %y: i8[2305843009213693952]) {
  %a = all_gather_into_tensor(%x) {group_size = 2, group = "world"}
  %b = all_gather_into_tensor(%y) {group_size = 2, group = "world"}
  %wa = wait_tensor(%a)
  %wb = wait_tensor(%b)
  return %wa, %wb
})");
  std::string explain;
  bucket_collectives(*g, opts(CollectiveKind::AllGather, "1e13"), &explain);
  EXPECT_NE(explain.find("closed: cap (adding %b of 4611686018427387904 B would make "
                           "9223372036854775808 B)"),
            std::string::npos)
      << explain;
}

TEST(BucketPasses, PassRunWritesExplainAndReportsChange) {
  std::unique_ptr<Graph> g = parse_graph(kTwoAllGathers);
  BucketPass pass(opts(CollectiveKind::AllGather));
  std::ostringstream os;
  pass.set_explain(&os);
  EXPECT_TRUE(pass.run(*g));
  EXPECT_NE(os.str().find("merged 2 collectives"), std::string::npos);
  EXPECT_FALSE(pass.run(*g));
}

}  // namespace
}  // namespace funcol
