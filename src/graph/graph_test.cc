// Tests of the graph data structure: building, use-lists, edits, order, names and equality.
#include "funcol/graph/graph.h"

#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "test_ir.h"

namespace funcol {
namespace {

// x -> neg -> relu -> (output), x also used by add(x, neg).
struct Small {
  std::unique_ptr<Graph> g = std::make_unique<Graph>("small");
  Value* x = nullptr;
  Value* n = nullptr;
  Value* r = nullptr;
  Value* a = nullptr;
  Small() {
    x = g->add_input("x", Type(DType::F32, {4}));
    Builder b(*g);
    b.set_name_hint("n");
    n = b.value("neg", {x});
    b.set_name_hint("r");
    r = b.value("relu", {n});
    b.set_name_hint("a");
    a = b.value("add", {x, n});
    g->add_output(r);
    g->add_output(a);
  }
};

// An element of the vector itself may be pushed or assigned back, also when the push moves
// the elements to a bigger buffer (it read the freed one: an ASan use-after-free).
TEST(SmallVec, PushAndAssignOwnElements) {
  detail::SmallVec<int64_t, 2> v;
  for (int64_t i = 0; i < 4; ++i) v.push_back(i);  // on the heap, full (capacity 4)
  v.push_back(v[1]);
  ASSERT_EQ(v.size(), 5u);
  EXPECT_EQ(v[4], 1);
  for (int64_t i = 0; i < 3; ++i) v.push_back(v[0] + 10);  // full again: 8
  v.push_back(v[7]);
  EXPECT_EQ(v[8], 10);
  v.assign(std::span<const int64_t>(v.data() + 1, 4));  // overlapping ranges
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ((std::vector<int64_t>(v.begin(), v.end())), (std::vector<int64_t>{1, 2, 3, 1}));
}

TEST(Graph, BuilderInfersTypesAndTracksUses) {
  Small s;
  verify(*s.g);
  EXPECT_EQ(s.g->num_nodes(), 3u);
  EXPECT_EQ(s.a->type(), Type(DType::F32, {4}));
  ASSERT_EQ(s.x->num_uses(), 2u);
  EXPECT_EQ(s.x->uses()[0], (Use{s.n->node(), 0}));
  EXPECT_EQ(s.x->uses()[1], (Use{s.a->node(), 0}));
  ASSERT_EQ(s.n->num_uses(), 2u);
  ASSERT_EQ(s.r->num_uses(), 1u);
  EXPECT_EQ(s.r->uses()[0], (Use{nullptr, 0}));
  EXPECT_EQ(print(*s.g), R"(graph @small(%x: f32[4]) {
  %n = neg(%x) : f32[4]
  %r = relu(%n) : f32[4]
  %a = add(%x, %n) : f32[4]
  return %r, %a
}
)");
}

TEST(Graph, BuilderErrors) {
  Small s;
  Builder b(*s.g);
  EXPECT_THROW(b.create("nope", {s.x}), InvalidArgument);
  EXPECT_THROW(b.create("neg", {s.x, s.x}), InvalidArgument);
  EXPECT_THROW(b.create("all_reduce", {s.x}, {{"reduce_op", "sum"}}), InvalidArgument);
  EXPECT_THROW(b.create("all_reduce", {s.x}, {{"reduce_op", "sum"}, {"group", 3}}), InvalidArgument);
  EXPECT_THROW(b.create("all_reduce", {s.x}, {{"reduce_op", "sum"}, {"group", "w"}, {"bogus", 1}}),
               InvalidArgument);
  EXPECT_THROW(b.create("reduce_scatter_tensor", {s.x},
                        {{"reduce_op", "sum"}, {"group_size", 3}, {"group", "w"}}),
               ShapeError);
  // Nothing was added by the failed attempts.
  EXPECT_EQ(s.g->num_nodes(), 3u);
  verify(*s.g);
}

TEST(Graph, ReplaceAllUsesAndErase) {
  Small s;
  // Replace neg by a clone of x: every use of %n (relu, add) moves.
  Builder b(*s.g, s.n->node());
  b.set_name_hint("c");
  Value* c = b.value("clone", {s.x});
  s.g->replace_all_uses(s.n, c);
  EXPECT_FALSE(s.n->has_uses());
  EXPECT_EQ(c->num_uses(), 2u);
  EXPECT_EQ(s.r->node()->operand(0), c);
  EXPECT_EQ(s.a->node()->operand(1), c);
  s.g->erase(s.n->node());
  EXPECT_EQ(s.g->find_node("n"), nullptr);
  EXPECT_EQ(s.g->num_nodes(), 3u);
  verify(*s.g);
  EXPECT_EQ(print(*s.g), R"(graph @small(%x: f32[4]) {
  %c = clone(%x) : f32[4]
  %r = relu(%c) : f32[4]
  %a = add(%x, %c) : f32[4]
  return %r, %a
}
)");
  // Outputs are uses too.
  s.g->replace_all_uses(s.r, s.x);
  EXPECT_EQ(s.g->outputs()[0], s.x);
  s.g->erase(s.r->node());
  verify(*s.g);
}

TEST(Graph, EraseWithUsesIsABug) {
  Small s;
  EXPECT_THROW(s.g->erase(s.n->node()), InternalError);
  EXPECT_EQ(s.g->num_nodes(), 3u);
}

TEST(Graph, SetOperandAndOutputs) {
  Small s;
  s.a->node()->set_operand(1, s.x);
  EXPECT_EQ(s.n->num_uses(), 1u);
  EXPECT_EQ(s.x->num_uses(), 3u);
  s.g->set_output(0, s.n);
  EXPECT_FALSE(s.r->has_uses());
  s.g->set_outputs({s.a});
  EXPECT_EQ(s.n->num_uses(), 1u);  // relu only
  EXPECT_FALSE(s.r->has_uses());
  EXPECT_EQ(s.a->uses()[0], (Use{nullptr, 0}));
  verify(*s.g);
}

TEST(Graph, OrderInsertMoveAndIsBefore) {
  Small s;
  Node* n = s.n->node();
  Node* r = s.r->node();
  Node* a = s.a->node();
  EXPECT_TRUE(n->is_before(*r));
  EXPECT_TRUE(r->is_before(*a));
  EXPECT_FALSE(a->is_before(*n));
  // Many insertions at one place exhaust the gap between keys and force a renumbering.
  Builder b(*s.g, r);
  std::vector<Node*> inserted;
  for (int i = 0; i < 100; ++i) inserted.push_back(b.create("neg", {s.x}));
  for (int i = 0; i + 1 < 100; ++i) EXPECT_TRUE(inserted[i]->is_before(*inserted[i + 1])) << i;
  EXPECT_TRUE(n->is_before(*inserted.front()));
  EXPECT_TRUE(inserted.back()->is_before(*r));
  // Insert at the front.
  Builder front(*s.g, s.g->first_node());
  Node* f = front.create("neg", {s.x});
  EXPECT_EQ(s.g->first_node(), f);
  EXPECT_TRUE(f->is_before(*n));
  // Move relu to the end, then add before relu.
  s.g->move_before(r, nullptr);
  EXPECT_EQ(s.g->last_node(), r);
  EXPECT_TRUE(a->is_before(*r));
  s.g->move_before(a, r);
  EXPECT_EQ(s.g->last_node()->prev(), a);
  verify(*s.g);
  std::vector<Node*> list = s.g->node_list();
  EXPECT_EQ(list.size(), s.g->num_nodes());
  for (size_t i = 0; i + 1 < list.size(); ++i) EXPECT_EQ(list[i]->next(), list[i + 1]);
}

TEST(Graph, FreshNamesAndLookup) {
  Small s;
  EXPECT_EQ(s.g->fresh_name("q"), "q");
  EXPECT_EQ(s.g->fresh_name("n"), "n.1");
  EXPECT_EQ(s.g->fresh_name("n"), "n.2");  // the counter moves on even when unused
  EXPECT_EQ(s.g->fresh_name("bad name!"), "v");
  EXPECT_EQ(s.g->find_value("%x"), s.x);
  EXPECT_EQ(s.g->find_value("n"), s.n);
  EXPECT_EQ(s.g->find_value("%n#0"), nullptr);
  EXPECT_EQ(s.g->find_value("%zz"), nullptr);
  EXPECT_THROW(s.g->add_input("n", Type(DType::F32, {})), InvalidArgument);
  EXPECT_THROW(s.g->add_input("a b", Type(DType::F32, {})), InvalidArgument);
  Module m = parse_module(testing_ir::kDesignExample);
  const Graph& g = *m.graphs()[0];
  EXPECT_EQ(g.find_value("%p#1"), g.last_node()->result(1));
  EXPECT_EQ(g.find_value("%p#2"), nullptr);
  EXPECT_EQ(g.find_value("%p"), nullptr);
  EXPECT_TRUE(Graph::is_valid_name("a.b_0"));
  EXPECT_FALSE(Graph::is_valid_name(""));
  EXPECT_FALSE(Graph::is_valid_name("p#1"));
}

// Counter names ("n.3") and explicit names that look like them share one namespace, in any
// order of creation; erased names become free again.
TEST(Graph, CounterNamesAndExplicitNumberedNamesNeverClash) {
  Small s;
  Builder b(*s.g);
  b.set_name_hint("n.2");  // explicit, before the counter gets there
  Value* taken = b.value("neg", {s.x});
  EXPECT_EQ(taken->name(), "n.2");
  EXPECT_EQ(s.g->fresh_name("n"), "n.1");
  EXPECT_EQ(s.g->fresh_name("n"), "n.3");  // n.2 is taken: skipped
  b.set_name_hint("n");
  Value* counted = b.value("neg", {s.x});
  EXPECT_EQ(counted->name(), "n.4");
  // An explicit name equal to a counter name in use is rejected, and taken once free.
  EXPECT_THROW(s.g->add_input("n.4", Type(DType::F32, {})), InvalidArgument);
  s.g->erase(counted->node());
  EXPECT_EQ(s.g->find_node("n.4"), nullptr);
  EXPECT_EQ(s.g->add_input("n.4", Type(DType::F32, {}))->name(), "n.4");
  s.g->erase(taken->node());
  b.set_name_hint("n.2");
  EXPECT_EQ(b.value("neg", {s.x})->name(), "n.2");
  // Far-ahead explicit numbers are skipped by the counter too.
  b.set_name_hint("v.9");
  b.value("neg", {s.x});
  for (int i = 0; i < 12; ++i) EXPECT_NE(s.g->fresh_name("v"), "v.9");
  verify(*s.g);
}

// Nodes created and erased in bulk (the node pool reuses erased slots) keep every list and
// lookup right; long operand and use lists spill past their inline storage.
TEST(Graph, ManyNodesErasedAndRecreatedAndLongOperandLists) {
  Small s;
  Builder b(*s.g);
  for (int round = 0; round < 3; ++round) {
    std::vector<Value*> made;
    for (int i = 0; i < 500; ++i) made.push_back(b.value("neg", {s.x}));
    EXPECT_EQ(s.x->num_uses(), 502u);
    for (Value* v : made) s.g->erase(v->node());
    EXPECT_EQ(s.x->num_uses(), 2u);
    EXPECT_EQ(s.g->num_nodes(), 3u);
  }
  std::vector<Value*> parts(40, s.x);
  Value* c = b.value("cat", parts, {{"dim", 0}});
  EXPECT_EQ(c->shape(), (Shape{160}));
  EXPECT_EQ(c->node()->num_operands(), 40u);
  EXPECT_EQ(s.x->num_uses(), 42u);
  for (size_t i = 0; i < 40; ++i) EXPECT_EQ(c->node()->operand(i), s.x);
  // Moving every use (operands past the inline ones included) to a value with none.
  Value* y = s.g->add_input("y", Type(DType::F32, {4}));
  s.g->replace_all_uses(s.x, y);
  EXPECT_FALSE(s.x->has_uses());
  EXPECT_EQ(y->num_uses(), 42u);
  for (size_t i = 0; i < 40; ++i) EXPECT_EQ(c->node()->operand(i), y);
  for (const Use& u : y->uses()) {
    ASSERT_NE(u.user, nullptr);
    EXPECT_EQ(u.user->operand(u.index), y);
  }
  s.g->add_output(c);
  verify(*s.g);
}

// A graph past the small node blocks (over 8,176 nodes) takes its nodes from big mapped blocks
// too: nodes there are created, erased, reused and carried along when the graph moves.
TEST(Graph, NodesPastTheSmallBlocksLiveInBigOnes) {
  Small s;
  Builder b(*s.g);
  std::vector<Value*> chain{s.x};
  for (int i = 0; i < 40000; ++i) chain.push_back(b.value(i % 2 ? "neg" : "relu", {chain.back()}));
  // Erase the second half, then grow again into the freed slots and past them.
  for (size_t i = chain.size() - 1; i > 20000; --i) s.g->erase(chain[i]->node());
  chain.resize(20001);
  for (int i = 0; i < 30000; ++i) chain.push_back(b.value("neg", {chain.back()}));
  s.g->add_output(chain.back());
  EXPECT_EQ(s.g->num_nodes(), 3u + 50000u);
  Graph moved(std::move(*s.g));
  verify(moved);
  EXPECT_EQ(moved.num_nodes(), 3u + 50000u);
  size_t links = 0;
  for (size_t i = 1; i < chain.size(); ++i) {
    ASSERT_EQ(chain[i]->node()->operand(0), chain[i - 1]) << i;
    ASSERT_EQ(chain[i]->node()->graph(), &moved) << i;
    links++;
  }
  EXPECT_EQ(links, 50000u);
}

TEST(Graph, SetAttrAndReinfer) {
  Module m = parse_module(testing_ir::kDesignExample);
  Graph& g = *m.graphs()[0];
  Node* ag = g.first_node();
  EXPECT_THROW(ag->set_attr("group_size", Attr("x")), InvalidArgument);
  EXPECT_THROW(ag->set_attr("nope", Attr(1)), InvalidArgument);
  ag->set_attr("group_size", 2);
  EXPECT_THROW(verify(g), InvalidArgument);  // result type is stale
  g.reinfer(ag);
  EXPECT_EQ(ag->result()->type(), Type(DType::F32, {8, 16}));
}

TEST(Graph, StructuralEqualityReportsTheFirstDifference) {
  Module a = parse_module(testing_ir::kDesignExample);
  Module b = parse_module(testing_ir::kDesignExample);
  std::string why;
  EXPECT_TRUE(structurally_equal(a, b, &why));
  b.graphs()[0]->first_node()->set_attr("group", "tp");
  EXPECT_FALSE(structurally_equal(a, b, &why));
  EXPECT_EQ(why, "graph @fsdp_layer: node 0 (%ag): attribute 'group' is \"world\" vs \"tp\"");
  Module c = parse_module(std::string(testing_ir::kDesignExample) + "graph @extra() { return }");
  EXPECT_FALSE(structurally_equal(a, c, &why));
  EXPECT_EQ(why, "1 vs 2 graphs");
  Module d = parse_module(R"(graph @fsdp_layer(%x: f32[8,16], %w: f32[4,16]) {
  %ag = all_gather_into_tensor(%w) {group_size = 4, group = "world"}
  %wf = wait_tensor(%ag)
  %y = matmul(%x, %wf)
  %p:2 = split_with_sizes(%y) {split_sizes = [4, 4], dim = 0}
  return %y, %p#0
})");
  EXPECT_FALSE(structurally_equal(a, d, &why));
  EXPECT_EQ(why, "graph @fsdp_layer: output 1 is %p#1 vs %p#0");
}

TEST(Graph, GraphInputsOfAnotherGraphAreRejected) {
  Small s;
  Graph other("other");
  Builder b(other);
  EXPECT_THROW(b.create("neg", {s.x}), InternalError);
}

}  // namespace
}  // namespace funcol
