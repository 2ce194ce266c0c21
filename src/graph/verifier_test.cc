// Tests of the verifier: graphs broken through the public API are reported with node and location.
#include "funcol/graph/verifier.h"

#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "test_ir.h"

namespace funcol {
namespace {

std::string verify_error(const Graph& g) {
  try {
    verify(g);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

Module design() { return parse_module(testing_ir::kDesignExample, ParseOptions{.file = "d.ir"}); }

TEST(Verifier, AcceptsParsedGraphs) {
  EXPECT_NO_THROW(verify(design()));
  EXPECT_NO_THROW(verify(parse_module(testing_ir::kEveryOp)));
}

TEST(Verifier, UseBeforeDefinition) {
  Module m = design();
  Graph& g = *m.graphs()[0];
  Node* ag = g.first_node();
  g.move_before(ag, nullptr);  // all_gather after its wait
  EXPECT_EQ(verify_error(g),
            "graph @fsdp_layer: node %wf (wait_tensor, d.ir:4:3): operand 0 (%ag) is used before "
            "its definition");
}

TEST(Verifier, StaleResultType) {
  Module m = design();
  Graph& g = *m.graphs()[0];
  g.first_node()->result()->set_type(Type(DType::F32, {4, 16}));
  EXPECT_EQ(verify_error(g),
            "graph @fsdp_layer: node %ag (all_gather_into_tensor, d.ir:3:3): result type f32[4,16] "
            "of %ag does not match inferred f32[16,16]");
}

TEST(Verifier, ShapeInferenceFailureKeepsItsType) {
  Module m = design();
  Graph& g = *m.graphs()[0];
  g.input(0)->set_type(Type(DType::F32, {8, 15}));  // matmul's inner dims no longer agree
  try {
    verify(g);
    FAIL();
  } catch (const ShapeError& e) {
    EXPECT_STREQ(e.what(), "graph @fsdp_layer: node %y (matmul, d.ir:5:3): matmul: inner dims "
                           "differ: [8,15] x [16,16]");
  }
}

TEST(Verifier, NodesCreatedByPassesHaveNoLocation) {
  Module m = design();
  Graph& g = *m.graphs()[0];
  Builder b(g, g.first_node());
  Value* n = b.value("neg", {g.input(0)});
  n->set_type(Type(DType::F32, {1}));
  EXPECT_EQ(verify_error(g),
            "graph @fsdp_layer: node %v (neg): result type f32[1] of %v does not match inferred "
            "f32[8,16]");
}

TEST(Verifier, OperandFromAnotherGraph) {
  Module m = design();
  Module other = design();
  Graph& g = *m.graphs()[0];
  g.last_node()->set_operand(0, other.graphs()[0]->input(0));
  EXPECT_EQ(verify_error(g),
            "graph @fsdp_layer: node %p (split_with_sizes, d.ir:6:3): operand 0 is an input of "
            "another graph");
}

TEST(Verifier, OutputFromAnotherGraph) {
  Module m = design();
  Module other = design();
  Graph& g = *m.graphs()[0];
  g.set_output(0, other.graphs()[0]->first_node()->result());
  EXPECT_EQ(verify_error(g), "graph @fsdp_layer: output 0 (%ag) is not defined in this graph");
}

TEST(Verifier, ModuleChecksEveryGraph) {
  Module m = parse_module(std::string(testing_ir::kDesignExample) + "graph @b(%x: f32[2]) {\n"
                                                                   "  %y = neg(%x)\n  return %y\n}");
  m.graphs()[1]->first_node()->result()->set_type(Type(DType::F64, {2}));
  EXPECT_THROW(verify(m), InvalidArgument);
}

// Two graphs of one name would print as a module that does not parse back.
TEST(Verifier, ModuleGraphNamesAreUnique) {
  Module m = design();
  verify(m);
  m.add(std::make_unique<Graph>(m.graphs()[0]->name()));
  try {
    verify(m);
    FAIL() << "a second graph @" << m.graphs()[0]->name() << " verified";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("more than one graph @" + m.graphs()[0]->name()),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace funcol
