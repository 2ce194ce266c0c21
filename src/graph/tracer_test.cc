// Tests of the tracer: traced meta tensors, recorded nodes, ops:: both traced and eager.
#include "funcol/graph/tracer.h"

#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"

namespace funcol {
namespace {

TEST(Tracer, RecordsOpsWithInferredTypes) {
  auto g = trace("mlp", {Type(DType::F32, {8, 16}), Type(DType::F32, {16, 4})},
                 [](std::span<const Tensor> in) {
                   Tensor y = ops::matmul(in[0], in[1]);
                   EXPECT_TRUE(y.is_meta());
                   EXPECT_EQ(y.sizes(), (Shape{8, 4}));
                   Tensor z = ops::relu(ops::add(y, y));
                   return std::vector<Tensor>{z, ops::sum(z)};
                 });
  ASSERT_EQ(g->num_nodes(), 4u);
  EXPECT_EQ(g->outputs().size(), 2u);
  EXPECT_EQ(g->outputs()[0]->type(), Type(DType::F32, {8, 4}));
  EXPECT_EQ(g->outputs()[1]->type(), Type(DType::F32, {}));
  const std::string text = print(*g);
  EXPECT_NE(text.find("graph @mlp(%x: f32[8,16], %x.1: f32[16,4])"), std::string::npos) << text;
  EXPECT_NE(text.find("= matmul(%x, %x.1) : f32[8,4]"), std::string::npos) << text;
  // The printed graph parses back to the same graph.
  auto back = parse_graph(text);
  std::string why;
  EXPECT_TRUE(structurally_equal(*g, *back, &why)) << why;
}

TEST(Tracer, MultiResultOpsAndAttributes) {
  auto g = trace("split", {Type(DType::F32, {6, 4})}, [](std::span<const Tensor> in) {
    std::vector<Tensor> parts = ops::split_with_sizes(in[0], {2, 4}, 0);
    EXPECT_EQ(parts.size(), 2u);
    EXPECT_EQ(parts[1].sizes(), (Shape{4, 4}));
    Tensor t = ops::transpose(parts[0], 0, 1);
    return std::vector<Tensor>{ops::cat({t, t}, 1), ops::view(parts[1], {-1})};
  });
  EXPECT_EQ(g->outputs()[0]->type(), Type(DType::F32, {4, 4}));
  EXPECT_EQ(g->outputs()[1]->type(), Type(DType::F32, {16}));
}

TEST(Tracer, CopiesOfATracedTensorStayTraced) {
  Tracer tr("g");
  Tensor x = tr.input(Type(DType::F32, {2}));
  Tensor copy = x;
  EXPECT_TRUE(tr.owns(copy));
  EXPECT_EQ(tr.value(copy), tr.graph().input(0));
  EXPECT_EQ(tr.value(x.contiguous()), tr.graph().input(0));
}

TEST(Tracer, UntracedTensorsAreRejectedWithAClearMessage) {
  Tracer tr("g");
  Tensor x = tr.input(Type(DType::F32, {2, 2}));
  TraceScope scope(tr);
  // A Tensor method makes a plain meta tensor that stands for no value.
  try {
    ops::add(x, x.transpose(0, 1));
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("add: operand 1: tracer: tensor f32[2,2] is not a "
                                         "traced value"),
              std::string::npos)
        << e.what();
  }
  // A real tensor in a traced function: graphs take data only through inputs.
  EXPECT_THROW(ops::add(x, Tensor::zeros({2, 2}, DType::F32)), InvalidArgument);
}

TEST(Tracer, TensorsOfAnotherTraceAreRejected) {
  Tracer a("a"), b("b");
  Tensor xa = a.input(Type(DType::F32, {2}));
  TraceScope scope(b);
  try {
    ops::neg(xa);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to another trace"), std::string::npos)
        << e.what();
  }
}

TEST(Tracer, TracedTensorOutsideItsTraceIsAnError) {
  Tracer tr("g");
  Tensor x = tr.input(Type(DType::F32, {2}));
  EXPECT_EQ(current_tracer(), nullptr);
  try {
    ops::neg(x);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("outside its trace"), std::string::npos) << e.what();
  }
}

TEST(Tracer, ShapeErrorsComeFromShapeInference) {
  Tracer tr("g");
  Tensor a = tr.input(Type(DType::F32, {2, 3}));
  Tensor b = tr.input(Type(DType::F32, {4, 5}));
  TraceScope scope(tr);
  try {
    ops::matmul(a, b);
    FAIL() << "expected ShapeError";
  } catch (const ShapeError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("matmul: ", 0), 0u) << e.what();
  }
  EXPECT_EQ(tr.graph().num_nodes(), 0u);
}

TEST(Tracer, ScopesNestAndRestore) {
  Tracer outer("o"), inner("i");
  EXPECT_EQ(current_tracer(), nullptr);
  {
    TraceScope s1(outer);
    EXPECT_EQ(current_tracer(), &outer);
    {
      TraceScope s2(inner);
      EXPECT_EQ(current_tracer(), &inner);
    }
    EXPECT_EQ(current_tracer(), &outer);
  }
  EXPECT_EQ(current_tracer(), nullptr);
}

TEST(Tracer, FactoriesAreTracedUnderATracer) {
  auto g = trace("f", {}, [](std::span<const Tensor>) {
    return std::vector<Tensor>{ops::zeros({2, 3}, DType::I32)};
  });
  ASSERT_EQ(g->num_nodes(), 1u);
  EXPECT_EQ(g->first_node()->op_name(), "zeros");
  EXPECT_EQ(g->outputs()[0]->type(), Type(DType::I32, {2, 3}));
}

TEST(Tracer, GroupsAndFinish) {
  Tracer tr("g");
  EXPECT_FALSE(tr.group_size("world").has_value());
  tr.declare_group("world", 4);
  tr.declare_group("tp", 2);
  tr.declare_group("world", 8);
  EXPECT_EQ(tr.group_size("world"), 8);
  EXPECT_EQ(tr.group_size("tp"), 2);
  EXPECT_THROW(tr.declare_group("dp", 0), InvalidArgument);
  Tensor x = tr.input(Type(DType::F32, {2}));
  tr.set_outputs(std::vector<Tensor>{x});
  auto g = tr.finish();
  EXPECT_EQ(g->outputs().size(), 1u);
  EXPECT_THROW(tr.finish(), InvalidArgument);
  EXPECT_FALSE(tr.owns(x));
}

TEST(Ops, RunEagerlyOnRealTensors) {
  Tensor a = Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2});
  Tensor b = Tensor::from_vector<float>({10, 20, 30, 40}, {2, 2});
  EXPECT_EQ(ops::add(a, b).to_vector<float>(), (std::vector<float>{11, 22, 33, 44}));
  EXPECT_EQ(ops::matmul(a, b).to_vector<float>(), (std::vector<float>{70, 100, 150, 220}));
  EXPECT_EQ(ops::neg(a).to_vector<float>(), (std::vector<float>{-1, -2, -3, -4}));
  EXPECT_EQ(ops::sum(a).item<float>(), 10.0f);
  // Eager calls check shapes through shape inference too.
  EXPECT_THROW(ops::matmul(a, Tensor::zeros({3, 3}, DType::F32)), ShapeError);
  EXPECT_THROW(
      ops::call("all_reduce", std::vector<Tensor>{a}, {{"reduce_op", "sum"}, {"group", "world"}}),
      InvalidArgument);
}

TEST(Ops, PlainMetaTensorsGetInferredMetaResults) {
  Tensor a = Tensor::meta({8, 16}, DType::BF16);
  Tensor b = Tensor::meta({16, 2}, DType::BF16);
  Tensor y = ops::matmul(a, b);
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.sizes(), (Shape{8, 2}));
  EXPECT_EQ(y.dtype(), DType::BF16);
}

}  // namespace
}  // namespace funcol
