// Tests of the overlap pass: collectives move up, waits move down, order and budget respected.
#include "funcol/passes/overlap.h"

#include <gtest/gtest.h>

#include <limits>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/pipeline.h"

namespace funcol {
namespace {

std::string run_overlap(std::string_view text, const OverlapOptions& options = {},
                        OverlapStats* stats = nullptr) {
  Module m = parse_module(text);
  OverlapStats s;
  for (auto& g : m.graphs()) {
    const OverlapStats one = schedule_overlap(*g, options);
    s.collectives_hoisted += one.collectives_hoisted;
    s.waits_sunk += one.waits_sunk;
    s.budget_stops += one.budget_stops;
    s.operands_hoisted += one.operands_hoisted;
    s.unpack_sunk += one.unpack_sunk;
  }
  verify(m);
  if (stats) *stats = s;
  return print(m);
}

// Two layers of FSDP forward: each weight gathered right before its matmul.
constexpr std::string_view kFsdp = R"(graph @g(%x: f32[8,16], %w0: f32[4,16], %w1: f32[4,16]) {
  %ag0 = all_gather_into_tensor(%w0) {group_size = 4, group = "world"}
  %f0 = wait_tensor(%ag0)
  %m0 = matmul(%x, %f0)
  %r0 = relu(%m0)
  %ag1 = all_gather_into_tensor(%w1) {group_size = 4, group = "world"}
  %f1 = wait_tensor(%ag1)
  %m1 = matmul(%r0, %f1)
  return %m1
})";

TEST(Overlap, IssuesEarlyWaitsLate) {
  OverlapStats stats;
  const std::string out = run_overlap(kFsdp, {}, &stats);
  EXPECT_EQ(out, R"(graph @g(%x: f32[8,16], %w0: f32[4,16], %w1: f32[4,16]) {
  %ag0 = all_gather_into_tensor(%w0) {group_size = 4, group = "world"} : f32[16,16]
  %ag1 = all_gather_into_tensor(%w1) {group_size = 4, group = "world"} : f32[16,16]
  %f0 = wait_tensor(%ag0) : f32[16,16]
  %m0 = matmul(%x, %f0) : f32[8,16]
  %r0 = relu(%m0) : f32[8,16]
  %f1 = wait_tensor(%ag1) : f32[16,16]
  %m1 = matmul(%r0, %f1) : f32[8,16]
  return %m1
}
)");
  EXPECT_EQ(stats.collectives_hoisted, 1);
  EXPECT_EQ(stats.waits_sunk, 0);  // each wait already sits right before its user
  EXPECT_EQ(stats.budget_stops, 0);
}

TEST(Overlap, RunningTwiceChangesNothingAndIsDeterministic) {
  const std::string once = run_overlap(kFsdp);
  EXPECT_EQ(run_overlap(kFsdp), once);
  OverlapStats stats;
  EXPECT_EQ(run_overlap(once, {}, &stats), once);
  EXPECT_FALSE(stats.changed());
}

TEST(Overlap, CollectiveStaysAfterItsOperandsAndThePreviousCollective) {
  const std::string out = run_overlap(R"(graph @g(%x: f32[8], %y: f32[8]) {
  %a = neg(%x)
  %ar = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %b = relu(%y)
  %c = neg(%b)
  %ar2 = all_reduce(%y) {reduce_op = "sum", group = "world"}
  %d = clone(%c)
  %ar3 = all_reduce(%d) {reduce_op = "sum", group = "world"}
  %w = wait_tensor(%ar)
  %w2 = wait_tensor(%ar2)
  %w3 = wait_tensor(%ar3)
  %s = add(%w, %w2)
  return %s, %w3
})");
  // %ar2 depends only on %y but may not pass %ar (issue order); %ar3 waits for %d. %w3 has
  // only an output use: it sinks to the end.
  EXPECT_EQ(out, R"(graph @g(%x: f32[8], %y: f32[8]) {
  %a = neg(%x) : f32[8]
  %ar = all_reduce(%a) {reduce_op = "sum", group = "world"} : f32[8]
  %ar2 = all_reduce(%y) {reduce_op = "sum", group = "world"} : f32[8]
  %b = relu(%y) : f32[8]
  %c = neg(%b) : f32[8]
  %d = clone(%c) : f32[8]
  %ar3 = all_reduce(%d) {reduce_op = "sum", group = "world"} : f32[8]
  %w = wait_tensor(%ar) : f32[8]
  %w2 = wait_tensor(%ar2) : f32[8]
  %s = add(%w, %w2) : f32[8]
  %w3 = wait_tensor(%ar3) : f32[8]
  return %s, %w3
}
)");
}

TEST(Overlap, CoalescedWaitsSinkSeparately) {
  const std::string out = run_overlap(R"(graph @g(%x: f32[8], %y: f32[4]) {
  %c:2 = all_reduce_coalesced(%x, %y) {reduce_op = "sum", group = "world"}
  %wx = wait_tensor(%c#0)
  %wy = wait_tensor(%c#1)
  %n = neg(%x)
  %a = add(%wx, %n)
  %m = relu(%y)
  %b = add(%wy, %m)
  return %a, %b
})");
  EXPECT_EQ(out, R"(graph @g(%x: f32[8], %y: f32[4]) {
  %c:2 = all_reduce_coalesced(%x, %y) {reduce_op = "sum", group = "world"} : f32[8], f32[4]
  %n = neg(%x) : f32[8]
  %wx = wait_tensor(%c#0) : f32[8]
  %a = add(%wx, %n) : f32[8]
  %m = relu(%y) : f32[4]
  %wy = wait_tensor(%c#1) : f32[4]
  %b = add(%wy, %m) : f32[4]
  return %a, %b
}
)");
}

// Each gathered weight is 16*16*4 = 1024 bytes.
TEST(Overlap, MemoryBudgetLimitsHowFarCollectivesMove) {
  // Budget of one gathered weight: %ag0's result is held until %m0 reads it, so %ag1 may not
  // be issued before %m0 has run; it stops right after %m0.
  OverlapStats stats;
  const std::string out = run_overlap(kFsdp, {.memory_budget_bytes = 1024}, &stats);
  EXPECT_EQ(out, R"(graph @g(%x: f32[8,16], %w0: f32[4,16], %w1: f32[4,16]) {
  %ag0 = all_gather_into_tensor(%w0) {group_size = 4, group = "world"} : f32[16,16]
  %f0 = wait_tensor(%ag0) : f32[16,16]
  %m0 = matmul(%x, %f0) : f32[8,16]
  %ag1 = all_gather_into_tensor(%w1) {group_size = 4, group = "world"} : f32[16,16]
  %r0 = relu(%m0) : f32[8,16]
  %f1 = wait_tensor(%ag1) : f32[16,16]
  %m1 = matmul(%r0, %f1) : f32[8,16]
  return %m1
}
)");
  EXPECT_EQ(stats.budget_stops, 1);
  // One byte short of a single gather: nothing may move; two gathers: everything moves as
  // without a budget.
  EXPECT_EQ(run_overlap(kFsdp, {.memory_budget_bytes = 1023}), print(parse_module(kFsdp)));
  EXPECT_EQ(run_overlap(kFsdp, {.memory_budget_bytes = 2048}), run_overlap(kFsdp));
}

// A hoisted collective that reads another's result becomes that one's first reader: %a's
// buffer is then held only up to %b, not up to %m, so %c (1024 bytes on top of %b's 1024)
// fits a budget of 2048 all the way up. Had %a's reader stayed %m, %c would stop after %m.
TEST(Overlap, MemoryBudgetFollowsAHoistedReader) {
  constexpr std::string_view kReaders = R"(graph @g(%x: f32[16,16], %y: f32[16,16]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %wa = wait_tensor(%a)
  %n1 = neg(%x)
  %m = neg(%wa)
  %b = all_reduce(%wa) {reduce_op = "sum", group = "world"}
  %wb = wait_tensor(%b)
  %n2 = neg(%n1)
  %c = all_reduce(%y) {reduce_op = "sum", group = "world"}
  %wc = wait_tensor(%c)
  return %m, %wb, %n2, %wc
})";
  OverlapStats stats;
  EXPECT_EQ(run_overlap(kReaders, {.memory_budget_bytes = 2048}, &stats),
            R"(graph @g(%x: f32[16,16], %y: f32[16,16]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[16,16]
  %wa = wait_tensor(%a) : f32[16,16]
  %b = all_reduce(%wa) {reduce_op = "sum", group = "world"} : f32[16,16]
  %c = all_reduce(%y) {reduce_op = "sum", group = "world"} : f32[16,16]
  %n1 = neg(%x) : f32[16,16]
  %m = neg(%wa) : f32[16,16]
  %n2 = neg(%n1) : f32[16,16]
  %wb = wait_tensor(%b) : f32[16,16]
  %wc = wait_tensor(%c) : f32[16,16]
  return %m, %wb, %n2, %wc
}
)");
  EXPECT_EQ(stats.collectives_hoisted, 2);
  EXPECT_EQ(stats.budget_stops, 0);
  // One byte less: %b may not cross %m (which still reads %a), and %c may not cross %n2
  // (%b's buffer is held to the end).
  EXPECT_EQ(run_overlap(kReaders, {.memory_budget_bytes = 2047}, &stats),
            R"(graph @g(%x: f32[16,16], %y: f32[16,16]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[16,16]
  %n1 = neg(%x) : f32[16,16]
  %wa = wait_tensor(%a) : f32[16,16]
  %m = neg(%wa) : f32[16,16]
  %b = all_reduce(%wa) {reduce_op = "sum", group = "world"} : f32[16,16]
  %n2 = neg(%n1) : f32[16,16]
  %c = all_reduce(%y) {reduce_op = "sum", group = "world"} : f32[16,16]
  %wb = wait_tensor(%b) : f32[16,16]
  %wc = wait_tensor(%c) : f32[16,16]
  return %m, %wb, %n2, %wc
}
)");
  EXPECT_EQ(stats.collectives_hoisted, 0);
  EXPECT_EQ(stats.budget_stops, 2);
}

// Counts of held bytes do not overflow with values near the 2^62-byte limit: %y would hold
// 2^62 bytes on top of %x's 2^62, more than a budget of 2^62, so it stays where it is.
TEST(Overlap, MemoryBudgetWithHugeValues) {
  constexpr std::string_view kHuge = R"(graph @g(%a: f32[1152921504606846976], %b: f32[1152921504606846976]) {
  %x = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %wx = wait_tensor(%x)
  %n = neg(%wx)
  %y = all_reduce(%b) {reduce_op = "sum", group = "world"}
  %wy = wait_tensor(%y)
  return %n, %wy
})";
  OverlapStats stats;
  EXPECT_EQ(run_overlap(kHuge, {.memory_budget_bytes = kMaxTypeBytes}, &stats),
            print(parse_module(kHuge)));
  EXPECT_EQ(stats.budget_stops, 1);
}

TEST(Overlap, PipelineOptionAndErrors) {
  const Pipeline ok = Pipeline::parse("overlap{memory-budget-mb=0.5}");
  ASSERT_EQ(ok.size(), 1u);
  const auto* pass = dynamic_cast<const OverlapPass*>(ok.passes()[0].get());
  ASSERT_NE(pass, nullptr);
  EXPECT_EQ(pass->options().memory_budget_bytes, 512 * 1024);
  // A budget beyond any count of bytes saturates (no float-to-integer overflow) and holds
  // anything (lit overlap-huge-budget.ir).
  EXPECT_EQ(dynamic_cast<const OverlapPass*>(
                Pipeline::parse("overlap{memory-budget-mb=1e300}").passes()[0].get())
                ->options()
                .memory_budget_bytes,
            std::numeric_limits<int64_t>::max());
  EXPECT_EQ(pass->name(), "overlap");
  EXPECT_EQ(dynamic_cast<const OverlapPass*>(Pipeline::parse("overlap").passes()[0].get())
                ->options()
                .memory_budget_bytes,
            -1);
  for (const char* bad : {"overlap{memory-budget-mb=0}", "overlap{memory-budget-mb=-1}",
                          "overlap{memory-budget-mb=x}"}) {
    EXPECT_THROW(Pipeline::parse(bad), InvalidArgument) << bad;
  }
  try {
    Pipeline::parse("overlap{memory-budget-mb=0}");
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "option memory-budget-mb of pass overlap must be a finite positive number, got '0'");
  }
  try {
    Pipeline::parse("overlap{memory-budget-mb=inf}");
    ADD_FAILURE() << "inf accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "option memory-budget-mb of pass overlap must be a finite positive number, got "
              "'inf' (leave the option out for no budget)");
  }
  EXPECT_THROW(Pipeline::parse("overlap{cap-mb=1}"), InvalidArgument);
}

// Two buckets as the bucketing passes leave them (packing, collective, wait, unpacking).
constexpr std::string_view kTwoBuckets = R"(graph @g(%x: f32[2,4], %a: f32[1,4], %b: f32[1,4]) {
  %fa = flatten(%a)
  %ag0 = all_gather_into_tensor(%fa) {group_size = 2, group = "world"}
  %w0 = wait_tensor(%ag0)
  %v0 = view(%w0) {shape = [2, 4]}
  %n = neg(%x)
  %s0 = add(%n, %v0)
  %r = relu(%s0)
  %fb = flatten(%b)
  %ag1 = all_gather_into_tensor(%fb) {group_size = 2, group = "world"}
  %w1 = wait_tensor(%ag1)
  %v1 = view(%w1) {shape = [2, 4]}
  %s1 = add(%r, %v1)
  return %s1
})";

// The second bucket's packing (flatten) moves up with its all-gather, and the first bucket's
// unpacking (view) moves down with its wait.
TEST(Overlap, PackingMovesUpWithItsCollectiveUnpackingDownWithItsWait) {
  OverlapStats stats;
  const std::string out = run_overlap(kTwoBuckets, {}, &stats);
  EXPECT_EQ(out, R"(graph @g(%x: f32[2,4], %a: f32[1,4], %b: f32[1,4]) {
  %fa = flatten(%a) : f32[4]
  %ag0 = all_gather_into_tensor(%fa) {group_size = 2, group = "world"} : f32[8]
  %fb = flatten(%b) : f32[4]
  %ag1 = all_gather_into_tensor(%fb) {group_size = 2, group = "world"} : f32[8]
  %n = neg(%x) : f32[2,4]
  %w0 = wait_tensor(%ag0) : f32[8]
  %v0 = view(%w0) {shape = [2, 4]} : f32[2,4]
  %s0 = add(%n, %v0) : f32[2,4]
  %r = relu(%s0) : f32[2,4]
  %w1 = wait_tensor(%ag1) : f32[8]
  %v1 = view(%w1) {shape = [2, 4]} : f32[2,4]
  %s1 = add(%r, %v1) : f32[2,4]
  return %s1
}
)");
  EXPECT_EQ(stats.collectives_hoisted, 1);
  EXPECT_EQ(stats.operands_hoisted, 1);
  EXPECT_EQ(stats.unpack_sunk, 1);
  EXPECT_EQ(stats.waits_sunk, 1);
  EXPECT_EQ(run_overlap(out), out);
}

// Under a budget the packing moves up with its collective too, as far as the budget allows: a
// budget nothing reaches changes nothing, and a budget of one bucket stops the second bucket
// (and its packing) after the first one's reader. Without the packing the second bucket could
// not move at all under any budget.
TEST(Overlap, MemoryBudgetMovesThePackingWithItsCollective) {
  OverlapStats stats;
  EXPECT_EQ(run_overlap(kTwoBuckets, {.memory_budget_bytes = 1 << 20}, &stats),
            run_overlap(kTwoBuckets));
  EXPECT_EQ(stats.operands_hoisted, 1);
  EXPECT_EQ(stats.budget_stops, 0);
  EXPECT_EQ(run_overlap(kTwoBuckets, {.memory_budget_bytes = 32}, &stats),
            R"(graph @g(%x: f32[2,4], %a: f32[1,4], %b: f32[1,4]) {
  %fa = flatten(%a) : f32[4]
  %ag0 = all_gather_into_tensor(%fa) {group_size = 2, group = "world"} : f32[8]
  %n = neg(%x) : f32[2,4]
  %w0 = wait_tensor(%ag0) : f32[8]
  %v0 = view(%w0) {shape = [2, 4]} : f32[2,4]
  %s0 = add(%n, %v0) : f32[2,4]
  %fb = flatten(%b) : f32[4]
  %ag1 = all_gather_into_tensor(%fb) {group_size = 2, group = "world"} : f32[8]
  %r = relu(%s0) : f32[2,4]
  %w1 = wait_tensor(%ag1) : f32[8]
  %v1 = view(%w1) {shape = [2, 4]} : f32[2,4]
  %s1 = add(%r, %v1) : f32[2,4]
  return %s1
}
)");
  EXPECT_EQ(stats.operands_hoisted, 1);
  EXPECT_EQ(stats.budget_stops, 1);
}

// A collective whose operands are computed from a wait cannot take that computation along: it
// moves alone, after its operand.
TEST(Overlap, OperandComputedFromAWaitStaysPut) {
  const std::string out = run_overlap(R"(graph @g(%x: f32[4], %y: f32[4]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %w = wait_tensor(%ar)
  %n = neg(%y)
  %m = neg(%w)
  %ar2 = all_reduce(%m) {reduce_op = "sum", group = "world"}
  %w2 = wait_tensor(%ar2)
  return %w2, %n
})");
  EXPECT_EQ(out, R"(graph @g(%x: f32[4], %y: f32[4]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[4]
  %n = neg(%y) : f32[4]
  %w = wait_tensor(%ar) : f32[4]
  %m = neg(%w) : f32[4]
  %ar2 = all_reduce(%m) {reduce_op = "sum", group = "world"} : f32[4]
  %w2 = wait_tensor(%ar2) : f32[4]
  return %w2, %n
}
)");
}

// Waits and unpacking nodes that end up in one place (the end, or before one user) keep their
// order there, and a second run moves nothing and says so: it used to "move" every wait that
// only graph outputs read to the end again, and to swap unpacking nodes sharing a user.
TEST(Overlap, SecondRunMovesNothing) {
  constexpr std::string_view kShared = R"(graph @g(%x: f32[4], %y: f32[4]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %w = wait_tensor(%ar)
  %a = view(%w) {shape = [2, 2]}
  %b = view(%w) {shape = [2, 2]}
  %n = neg(%y)
  %m = view(%n) {shape = [2, 2]}
  %u = add(%a, %b)
  %v = add(%u, %m)
  %ar2 = all_reduce(%y) {reduce_op = "sum", group = "world"}
  %ar3 = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %w2 = wait_tensor(%ar2)
  %w3 = wait_tensor(%ar3)
  return %v, %w2, %w3
})";
  const std::string once = run_overlap(kShared);
  EXPECT_EQ(once, R"(graph @g(%x: f32[4], %y: f32[4]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[4]
  %ar2 = all_reduce(%y) {reduce_op = "sum", group = "world"} : f32[4]
  %ar3 = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[4]
  %n = neg(%y) : f32[4]
  %m = view(%n) {shape = [2, 2]} : f32[2,2]
  %w = wait_tensor(%ar) : f32[4]
  %a = view(%w) {shape = [2, 2]} : f32[2,2]
  %b = view(%w) {shape = [2, 2]} : f32[2,2]
  %u = add(%a, %b) : f32[2,2]
  %v = add(%u, %m) : f32[2,2]
  %w2 = wait_tensor(%ar2) : f32[4]
  %w3 = wait_tensor(%ar3) : f32[4]
  return %v, %w2, %w3
}
)");
  OverlapStats stats;
  EXPECT_EQ(run_overlap(once, {}, &stats), once);
  EXPECT_FALSE(stats.changed());
  EXPECT_EQ(stats.waits_sunk, 0);
  EXPECT_EQ(stats.unpack_sunk, 0);
}

// A view of a waited result does not read it: the buffer stays held up to the first node that
// does (%u), which %b must not be issued before under a budget of one buffer. Counting the view
// as the reader let %b go up right after it, and the view then sank below %b with its wait.
TEST(Overlap, MemoryBudgetHoldsBuffersUpToTheirRealReader) {
  constexpr std::string_view kView = R"(graph @g(%x: f32[16,16], %y: f32[16,16]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %wa = wait_tensor(%a)
  %va = view(%wa) {shape = [256]}
  %n = neg(%y)
  %u = neg(%va)
  %b = all_reduce(%y) {reduce_op = "sum", group = "world"}
  %wb = wait_tensor(%b)
  return %u, %wb, %n
})";
  OverlapStats stats;
  EXPECT_EQ(run_overlap(kView, {.memory_budget_bytes = 1024}, &stats),
            R"(graph @g(%x: f32[16,16], %y: f32[16,16]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[16,16]
  %n = neg(%y) : f32[16,16]
  %wa = wait_tensor(%a) : f32[16,16]
  %va = view(%wa) {shape = [256]} : f32[256]
  %u = neg(%va) : f32[256]
  %b = all_reduce(%y) {reduce_op = "sum", group = "world"} : f32[16,16]
  %wb = wait_tensor(%b) : f32[16,16]
  return %u, %wb, %n
}
)");
  EXPECT_EQ(stats.collectives_hoisted, 0);
  // Two buffers fit: %b goes up to %a.
  EXPECT_EQ(run_overlap(kView, {.memory_budget_bytes = 2048}), run_overlap(kView));
}

// The same for a view of a result not yet waited on: %a is read at %u, through the view and
// its wait, so %b stays after %u under a budget of one buffer.
TEST(Overlap, MemoryBudgetLooksThroughAViewOfAPendingResult) {
  constexpr std::string_view kPendingView = R"(graph @g(%x: f32[16,16], %y: f32[16,16]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %va = view(%a) {shape = [256]}
  %n = neg(%y)
  %wa = wait_tensor(%va)
  %u = neg(%wa)
  %b = all_reduce(%y) {reduce_op = "sum", group = "world"}
  %wb = wait_tensor(%b)
  return %u, %wb, %n
})";
  OverlapStats stats;
  EXPECT_EQ(run_overlap(kPendingView, {.memory_budget_bytes = 1024}, &stats),
            print(parse_module(kPendingView)));
  EXPECT_EQ(stats.collectives_hoisted, 0);
  EXPECT_EQ(run_overlap(kPendingView, {.memory_budget_bytes = 2048}), run_overlap(kPendingView));
}

TEST(Overlap, NoCollectivesNoChange) {
  OverlapStats stats;
  const std::string text = R"(graph @g(%x: f32[8]) {
  %a = neg(%x) : f32[8]
  return %a
}
)";
  EXPECT_EQ(run_overlap(text, {}, &stats), text);
  EXPECT_FALSE(stats.changed());
}

}  // namespace
}  // namespace funcol
