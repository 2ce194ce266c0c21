// Tests of collective signatures: encoding round trips and cross-rank mismatch messages.
#include "dist/multiprocess/op_signature.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "dist/checks.h"

namespace funcol::process {
namespace {

OpSignature all_reduce(DType dtype, int64_t numel, ReduceOp op) {
  OpSignature s;
  s.kind = OpKind::AllReduce;
  s.reduce_op = op;
  s.slots = {{dtype, numel}};
  return s;
}

OpSignature round_trip(const OpSignature& s, int group_size) {
  EXPECT_EQ(encode_signature(s, group_size).size(), signature_bytes(group_size));
  return as_received(s, group_size);
}

TEST(OpSignature, RoundTripKeepsEveryField) {
  OpSignature s;
  s.kind = OpKind::Broadcast;
  s.root = 3;
  s.slots = {{DType::BF16, 7}};
  OpSignature back = round_trip(s, 4);
  EXPECT_TRUE(back.same_call(s));
  EXPECT_EQ(back.summary(), "broadcast(bf16 numel 7, src 3)");

  OpSignature a2a;
  a2a.kind = OpKind::AllToAll;
  a2a.slots = {{DType::I64, 5}};
  a2a.input_splits = {1, 0, 2};
  a2a.output_splits = {4, 4, 0};
  OpSignature a2a_back = round_trip(a2a, 3);
  EXPECT_EQ(a2a_back.input_splits, a2a.input_splits);
  EXPECT_EQ(a2a_back.output_splits, a2a.output_splits);
  EXPECT_EQ(a2a_back.summary(), "all_to_all(i64 row 5)");

  // funcol's own step: kept, printed, and never the same call as a user's collective.
  OpSignature step = all_reduce(DType::I64, 2, ReduceOp::Max);
  step.step = "new_group";
  OpSignature step_back = round_trip(step, 2);
  EXPECT_TRUE(step_back.same_call(step));
  EXPECT_FALSE(step_back.same_call(all_reduce(DType::I64, 2, ReduceOp::Max)));
  EXPECT_EQ(step_back.summary(),
            "all_reduce(i64 numel 2, op max) [funcol's agreement step for new_group]");
}

TEST(OpSignature, SummaryMatchesTheThreadsBackend) {
  EXPECT_EQ(all_reduce(DType::F32, 16, ReduceOp::Sum).summary(),
            "all_reduce(f32 numel 16, op sum)");
  OpSignature b;
  b.kind = OpKind::Barrier;
  EXPECT_EQ(b.summary(), "barrier()");
  OpSignature c;
  c.kind = OpKind::AllGatherCoalesced;
  c.slots = {{DType::F32, 2}, {DType::I8, 3}};
  EXPECT_EQ(c.summary(), "all_gather_coalesced(2 tensors: f32 numel 2, i8 numel 3)");
}

OpSignature all_reduce_shaped(const Shape& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  OpSignature s = all_reduce(DType::F32, numel, ReduceOp::Sum);
  s.slots[0].ndim = dist_detail::pack_shape(shape, s.slots[0].dims);
  return s;
}

// Shapes travel and are compared, also past the dims a signature holds in full and in the
// tensors of a list known only by the hash.
TEST(OpSignature, ShapesAreCompared) {
  const OpSignature a = round_trip(all_reduce_shaped({2, 3}), 2);
  const OpSignature b = round_trip(all_reduce_shaped({3, 2}), 2);
  EXPECT_EQ(a.summary(), "all_reduce(f32[2,3], op sum)");
  auto msg = check_signatures({a, b}, {0, 1}, "all_reduce on group 'world' (seq 0)");
  ASSERT_TRUE(msg);
  EXPECT_EQ(*msg,
            "all_reduce on group 'world' (seq 0): mismatched collectives: rank 0 issued "
            "all_reduce(f32[2,3], op sum) but rank 1 issued all_reduce(f32[3,2], op sum)");
  const OpSignature long_a = round_trip(all_reduce_shaped({1, 1, 1, 1, 1, 2, 3}), 2);
  const OpSignature long_b = round_trip(all_reduce_shaped({1, 1, 1, 1, 1, 3, 2}), 2);
  EXPECT_FALSE(check_signatures({long_a, long_a}, {0, 1}, "x"));
  ASSERT_TRUE(check_signatures({long_a, long_b}, {0, 1}, "x"));
  EXPECT_NE(long_a.summary(), long_b.summary());
  EXPECT_EQ(long_a.summary().rfind("all_reduce(f32[1,1,1,1,1,...: 7 dims, #", 0), 0u)
      << long_a.summary();
  // An all_to_all compares a row's shape and counts the tensor's dims in its summary.
  for (const Shape& shape : {Shape{4, 3, 2}, Shape{4, 1, 1, 1, 1, 1, 2, 3}}) {
    OpSignature a2a;
    a2a.kind = OpKind::AllToAll;
    a2a.slots = {{DType::I64, 6}};
    a2a.slots[0].ndim = dist_detail::pack_compared_shape(shape, /*rows=*/true, a2a.slots[0].dims);
    a2a.input_splits = a2a.output_splits = {2, 2};
    const std::string summary = round_trip(a2a, 2).summary();
    EXPECT_EQ(summary.rfind(shape.size() == 3 ? "all_to_all(i64[*,3,2])"
                                              : "all_to_all(i64[*,1,1,1,1,1,...: 8 dims, #",
                            0),
              0u)
        << summary;
  }
  // The tenth tensor of a coalesced list differs in shape only.
  OpSignature list_a, list_b;
  list_a.kind = list_b.kind = OpKind::AllReduceCoalesced;
  for (int i = 0; i < 10; ++i) {
    list_a.slots.push_back(all_reduce_shaped({2, 3}).slots[0]);
    list_b.slots.push_back(all_reduce_shaped(i == 9 ? Shape{3, 2} : Shape{2, 3}).slots[0]);
  }
  EXPECT_FALSE(check_signatures({round_trip(list_a, 2), round_trip(list_a, 2)}, {0, 1}, "x"));
  EXPECT_TRUE(check_signatures({round_trip(list_a, 2), round_trip(list_b, 2)}, {0, 1}, "x"));
}

TEST(OpSignature, AgreeingRanksPass) {
  auto s = round_trip(all_reduce(DType::F32, 8, ReduceOp::Max), 2);
  EXPECT_FALSE(check_signatures({s, s}, {0, 1}, "all_reduce on group 'world' (seq 0)"));
}

TEST(OpSignature, DifferentOpsNameBothSides) {
  OpSignature gather;
  gather.kind = OpKind::AllGather;
  gather.slots = {{DType::F32, 8}};
  auto msg = check_signatures({all_reduce(DType::F32, 8, ReduceOp::Sum), gather}, {0, 1},
                              "all_reduce on group 'world' (seq 4)");
  ASSERT_TRUE(msg);
  EXPECT_EQ(*msg,
            "all_reduce on group 'world' (seq 4): mismatched collectives: rank 0 issued "
            "all_reduce(f32 numel 8, op sum) but rank 1 issued all_gather(f32 numel 8)");
}

TEST(OpSignature, DtypeCountAndReduceOpMatter) {
  const auto base = all_reduce(DType::F32, 8, ReduceOp::Sum);
  EXPECT_TRUE(check_signatures({base, all_reduce(DType::F64, 8, ReduceOp::Sum)}, {0, 1}, "x"));
  EXPECT_TRUE(check_signatures({base, all_reduce(DType::F32, 9, ReduceOp::Sum)}, {0, 1}, "x"));
  EXPECT_TRUE(check_signatures({base, all_reduce(DType::F32, 8, ReduceOp::Avg)}, {0, 1}, "x"));
  // Subgroups name ranks by their global rank.
  auto msg =
      check_signatures({base, base, all_reduce(DType::F32, 8, ReduceOp::Min)}, {1, 3, 5}, "x");
  ASSERT_TRUE(msg);
  EXPECT_NE(msg->find("rank 1 issued all_reduce(f32 numel 8, op sum) but rank 5 issued "
                      "all_reduce(f32 numel 8, op min)"),
            std::string::npos)
      << *msg;
}

TEST(OpSignature, AllToAllSplitsAreCheckedPairwise) {
  OpSignature r0, r1;
  r0.kind = r1.kind = OpKind::AllToAll;
  r0.slots = r1.slots = {{DType::F32, 2}};
  r0.input_splits = {1, 3};
  r0.output_splits = {1, 2};
  r1.input_splits = {2, 5};
  r1.output_splits = {3, 5};
  EXPECT_FALSE(check_signatures({r0, r1}, {0, 1}, "a2a"));
  r1.output_splits = {4, 5};
  auto msg = check_signatures({r0, r1}, {0, 1}, "a2a");
  ASSERT_TRUE(msg);
  EXPECT_EQ(*msg,
            "a2a: mismatched split sizes: rank 0 sends 3 rows to rank 1 but rank 1 expects 4 rows "
            "from rank 0");
}

// A timeout compares what the ranks that answered issued: some of the group, named by their
// group ranks; the absent ones' rows are not judged.
TEST(OpSignature, TheRanksThatAnsweredAreCompared) {
  OpSignature r0, r2;
  r0.kind = r2.kind = OpKind::AllToAll;
  r0.slots = r2.slots = {{DType::F32, 2}};
  r0.input_splits = {1, 7, 3};
  r0.output_splits = {1, 9, 2};
  r2.input_splits = {2, 8, 4};
  r2.output_splits = {3, 6, 4};
  const std::vector<int> global = {4, 5, 6};
  EXPECT_FALSE(find_difference({{0, &r0}, {2, &r2}}, global));
  r2.output_splits[0] = 2;
  auto splits = find_difference({{0, &r0}, {2, &r2}}, global);
  ASSERT_TRUE(splits);
  EXPECT_TRUE(splits->splits);
  EXPECT_EQ(splits->what,
            "mismatched split sizes: rank 4 sends 3 rows to rank 6 but rank 6 expects 2 rows "
            "from rank 4");
  // One rank alone is judged against itself: the rows it sends itself.
  r0.output_splits[0] = 2;
  splits = find_difference({{0, &r0}}, global);
  ASSERT_TRUE(splits);
  EXPECT_EQ(splits->what,
            "mismatched split sizes: rank 4 sends 1 row to rank 4 but rank 4 expects 2 rows "
            "from rank 4");
  OpSignature other = r2;
  other.kind = OpKind::AllGather;
  auto calls = find_difference({{0, &r0}, {2, &other}}, global);
  ASSERT_TRUE(calls);
  EXPECT_FALSE(calls->splits);
  EXPECT_EQ(calls->what.rfind("rank 4 issued all_to_all(", 0), 0u) << calls->what;
  EXPECT_NE(calls->what.find(" but rank 6 issued all_gather("), std::string::npos) << calls->what;
}

TEST(OpSignature, LongCoalescedListsCompareBeyondTheFirstEight) {
  OpSignature a;
  a.kind = OpKind::AllReduceCoalesced;
  for (int i = 0; i < 12; ++i) a.slots.push_back({DType::F32, i});
  OpSignature b = a;
  b.slots[10].count = 99;
  auto da = round_trip(a, 2);
  auto db = round_trip(b, 2);
  EXPECT_TRUE(da.same_call(round_trip(a, 2)));
  EXPECT_FALSE(da.same_call(db));
  EXPECT_NE(da.summary().find("12 tensors"), std::string::npos);
  // The summaries show the first eight only, so the message says the difference lies beyond.
  const auto message = check_signatures({da, db}, {0, 1}, "arc");
  ASSERT_TRUE(message.has_value());
  EXPECT_EQ(*message, "arc: mismatched collectives: rank 0 issued " + da.summary() +
                          " but rank 1 issued " + db.summary() +
                          "; they differ in a tensor after the first 8 (not shown)");
  EXPECT_EQ(da.summary(), db.summary());
}

// A timeout compares its own signature with the peers' answers (encoded): a list of 9 or more
// equal tensors is the same call (the tensors past the 8th travel as a hash, so the raw
// signature differs from a decoded one), and a difference past the 8th is seen.
TEST(OpSignature, ATimeoutComparesItsOwnWithThePeersAnswers) {
  for (int tensors : {1, 8, 9, 12}) {
    SCOPED_TRACE(tensors);
    OpSignature mine;
    mine.kind = OpKind::AllReduceCoalesced;
    for (int i = 0; i < tensors; ++i) mine.slots.push_back({DType::F32, 4});
    auto answer = [&](const OpSignature& s) {
      const std::vector<char> bytes = encode_signature(s, 3);
      return std::string(bytes.begin(), bytes.end());
    };
    EXPECT_FALSE(compare_answers(mine, 1, {answer(mine), answer(mine)}, {0, 1, 2}));
    EXPECT_FALSE(compare_answers(mine, 1, {"", answer(mine)}, {0, 1, 2}));  // rank 0 left
    OpSignature other = mine;
    other.slots.back().count = 5;
    auto difference = compare_answers(mine, 1, {answer(mine), answer(other)}, {0, 1, 2});
    ASSERT_TRUE(difference);
    EXPECT_FALSE(difference->splits);
    EXPECT_EQ(difference->what.find("; they differ in a tensor after the first 8") !=
                  std::string::npos,
              tensors > 8)
        << difference->what;
  }
  // all_to_all split sizes, from rank 2 (group rank 1 of [0, 2, 5]) with rank 0 gone: its
  // own rows against rank 5's answer.
  OpSignature a2a;
  a2a.kind = OpKind::AllToAll;
  a2a.slots = {{DType::F32, 2}};
  a2a.input_splits = {1, 2, 3};
  a2a.output_splits = {4, 2, 6};
  OpSignature peer = a2a;
  peer.input_splits = {0, 6, 0};
  peer.output_splits = {0, 2, 0};
  const std::vector<char> bytes = encode_signature(peer, 3);
  auto difference = compare_answers(a2a, 1, {"", std::string(bytes.begin(), bytes.end())},
                                    {0, 2, 5});
  ASSERT_TRUE(difference);
  EXPECT_TRUE(difference->splits);
  EXPECT_EQ(difference->what,
            "mismatched split sizes: rank 2 sends 3 rows to rank 5 but rank 5 expects 2 rows "
            "from rank 2");
}

}  // namespace
}  // namespace funcol::process

// Rank lists in errors: short ones in full (as every message quotes them), long ones as runs
// and at most 16 items, so that a rendezvous of 100,000 ranks gives one readable line.
TEST(FormatRanks, ShortListsInFullLongOnesAsRunsAndATruncatedList) {
  using funcol::dist_detail::format_ranks;
  EXPECT_EQ(format_ranks({}), "[]");
  EXPECT_EQ(format_ranks({2}), "[2]");
  EXPECT_EQ(format_ranks({0, 1, 2, 3}), "[0, 1, 2, 3]");
  std::vector<int> all(99999);
  std::iota(all.begin(), all.end(), 1);
  EXPECT_EQ(format_ranks(all), "[1-99999]");
  all.erase(all.begin() + 4095);  // 4096 is there no more
  all.push_back(100001);
  EXPECT_EQ(format_ranks(all), "[1-4095, 4097-99999, 100001]");
  std::vector<int> even;
  for (int r = 0; r < 5000; r += 2) even.push_back(r);
  EXPECT_EQ(format_ranks(even),
            "[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, ... (2500 ranks in all)]");
  std::vector<int> pairs;  // runs of two stay two items
  for (int r = 0; r < 40; r += 3) pairs.insert(pairs.end(), {r, r + 1});
  EXPECT_EQ(format_ranks(pairs), "[0, 1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, 21, 22, ... "
                                 "(28 ranks in all)]");
}
