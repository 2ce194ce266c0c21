// Tests of dead code elimination: what goes, what always stays, determinism.
#include "funcol/passes/dce.h"

#include <gtest/gtest.h>

#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"

namespace funcol {
namespace {

std::string run_dce(std::string_view text, bool* changed = nullptr) {
  Module m = parse_module(text);
  bool c = false;
  for (auto& g : m.graphs()) c = eliminate_dead_code(*g) || c;
  verify(m);
  if (changed) *changed = c;
  return print(m);
}

TEST(Dce, RemovesDeadChainsKeepsCollectivesAndWaits) {
  bool changed = false;
  const std::string out = run_dce(R"(graph @g(%x: f32[8], %unused: f32[2]) {
  %a = neg(%x)
  %b = relu(%a)
  %c = add(%b, %b)
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %dead_view = view(%ar) {shape = [2, 4]}
  %w = wait_tensor(%ar)
  %ag = all_gather_into_tensor(%x) {group_size = 2, group = "world"}
  %p:2 = split_with_sizes(%x) {split_sizes = [4, 4]}
  %q = neg(%p#1)
  %live = mul(%x, %x)
  return %live, %q
})", &changed);
  EXPECT_TRUE(changed);
  EXPECT_EQ(out, R"(graph @g(%x: f32[8], %unused: f32[2]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[8]
  %w = wait_tensor(%ar) : f32[8]
  %ag = all_gather_into_tensor(%x) {group_size = 2, group = "world"} : f32[16]
  %p:2 = split_with_sizes(%x) {split_sizes = [4, 4], dim = 0} : f32[4], f32[4]
  %q = neg(%p#1) : f32[4]
  %live = mul(%x, %x) : f32[8]
  return %live, %q
}
)");
}

TEST(Dce, NothingToRemoveIsNoChange) {
  const std::string text = R"(graph @g(%x: f32[8]) {
  %a = neg(%x) : f32[8]
  return %a
}
)";
  bool changed = true;
  EXPECT_EQ(run_dce(text, &changed), text);
  EXPECT_FALSE(changed);
}

TEST(Dce, EverythingUnusedGoesWhenNothingIsReturned) {
  bool changed = false;
  EXPECT_EQ(run_dce("graph @g(%x: f32[8]) {\n  %a = neg(%x)\n  %b = zeros() {shape = [2], dtype = i8}\n"
                    "  return\n}",
                    &changed),
            "graph @g(%x: f32[8]) {\n  return\n}\n");
  EXPECT_TRUE(changed);
}

TEST(Dce, IsDeterministicAndIdempotent) {
  const std::string text = R"(graph @g(%x: f32[8]) {
  %a = neg(%x)
  %b = all_reduce(%a) {reduce_op = "max", group = "tp"}
  %c = relu(%a)
  %d = wait_tensor(%b)
  return %d
})";
  const std::string once = run_dce(text);
  EXPECT_EQ(run_dce(text), once);
  EXPECT_EQ(run_dce(once), once);
  EXPECT_EQ(once.find("relu"), std::string::npos);
}

TEST(Dce, LargeFanOutIsLinear) {
  // 200,000 dead users of one input: each erase is O(1) on the use-list.
  std::string text = "graph @g(%x: f32[2]) {\n";
  for (int i = 0; i < 200000; ++i) text += "  %n" + std::to_string(i) + " = neg(%x)\n";
  text += "  return %x\n}\n";
  Module m = parse_module(text);
  Graph& g = *m.graphs()[0];
  EXPECT_TRUE(eliminate_dead_code(g));
  EXPECT_EQ(g.num_nodes(), 0u);
  EXPECT_EQ(g.input(0)->num_uses(), 1u);
}

}  // namespace
}  // namespace funcol
