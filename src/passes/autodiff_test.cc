// Unit tests of the autodiff pass: joint graph structure, options, errors and determinism.
#include <algorithm>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/graph/backward.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/autodiff.h"
#include "funcol/passes/pipeline.h"
#include "testing/error_of.h"

namespace funcol {
namespace {

constexpr std::string_view kFsdp = R"(graph @fsdp(%x: f32[8,16], %w: f32[4,16], %t: f32[8,16], %i: i32[3]) {
  %ag = all_gather_into_tensor(%w) {group_size = 4, group = "world"}
  %wf = wait_tensor(%ag)
  %y = matmul(%x, %wf)
  %r = relu(%y)
  %l = mse_loss(%r, %t)
  return %l, %i
})";

std::vector<std::string> op_names(const Graph& g) {
  std::vector<std::string> out;
  for (const Node& n : g.nodes()) out.emplace_back(n.op_name());
  return out;
}

TEST(Autodiff, JointGraphOutputsLossAndGradients) {
  std::unique_ptr<Graph> fwd = parse_graph(kFsdp);
  const Graph joint = build_joint_graph(*fwd, {1, 0});
  ASSERT_EQ(joint.outputs().size(), 3u);
  EXPECT_EQ(joint.outputs()[0]->name(), "l");
  EXPECT_EQ(joint.outputs()[1]->type(), fwd->input(1)->type());
  EXPECT_EQ(joint.outputs()[2]->type(), fwd->input(0)->type());
  EXPECT_EQ(joint.num_inputs(), fwd->num_inputs());
  EXPECT_NO_THROW(verify(joint));
  // The forward graph is left as it was.
  EXPECT_EQ(fwd->outputs().size(), 2u);
  EXPECT_EQ(fwd->num_nodes(), 5u);
}

TEST(Autodiff, AllGatherBecomesWaitedReduceScatterAfterTheForward) {
  std::unique_ptr<Graph> fwd = parse_graph(kFsdp);
  const Graph joint = build_joint_graph(*fwd, {1});
  std::vector<const Node*> collectives;
  for (const Node& n : joint.nodes()) {
    if (n.op().is_collective()) collectives.push_back(&n);
  }
  ASSERT_EQ(collectives.size(), 2u);
  EXPECT_EQ(collectives[0]->op_name(), "all_gather_into_tensor");
  const Node& rs = *collectives[1];
  EXPECT_EQ(rs.op_name(), "reduce_scatter_tensor");
  EXPECT_EQ(rs.attr("reduce_op").as_string(), "sum");
  EXPECT_EQ(rs.attr("group_size").as_int(), 4);
  EXPECT_EQ(rs.attr("group").as_string(), "world");
  // Its only user is its own wait_tensor, which is the gradient of %w.
  ASSERT_EQ(rs.result(0)->num_uses(), 1u);
  const Node* wait = rs.result(0)->uses()[0].user;
  ASSERT_NE(wait, nullptr);
  EXPECT_EQ(wait->op_name(), "wait_tensor");
  EXPECT_EQ(joint.outputs()[1], wait->result(0));
  // The backward comes after every forward node.
  EXPECT_TRUE(joint.find_node("l")->is_before(rs));
}

TEST(Autodiff, EveryBackwardCollectiveHasItsOwnWait) {
  std::unique_ptr<Graph> fwd = parse_graph(R"(graph @g(%x: f32[4,2], %w: f32[4,2]) {
    %arc:2 = all_reduce_coalesced(%x, %w) {reduce_op = "sum", group = "world"}
    %a = wait_tensor(%arc#0)
    %b = wait_tensor(%arc#1)
    %rs = reduce_scatter_tensor(%a) {reduce_op = "sum", group_size = 2, group = "world"}
    %rw = wait_tensor(%rs)
    %a2a = all_to_all_single(%b) {output_split_sizes = [1, 3], input_split_sizes = [2, 2], group = "world"}
    %aw = wait_tensor(%a2a)
    %s1 = sum(%rw)
    %s2 = sum(%aw)
    %l = add(%s1, %s2)
    return %l
  })");
  const Graph joint = build_joint_graph(*fwd, {0, 1});
  int backward_collectives = 0;
  for (const Node& n : joint.nodes()) {
    if (!n.op().is_collective() || n.loc().known()) continue;
    ++backward_collectives;
    for (size_t r = 0; r < n.num_results(); ++r) {
      ASSERT_EQ(n.result(r)->num_uses(), 1u) << n.name();
      EXPECT_EQ(n.result(r)->uses()[0].user->op_name(), "wait_tensor");
    }
    if (n.op_name() == "all_to_all_single") {
      EXPECT_EQ(n.attr("output_split_sizes").as_ints(), (std::vector<int64_t>{2, 2}));
      EXPECT_EQ(n.attr("input_split_sizes").as_ints(), (std::vector<int64_t>{1, 3}));
    }
  }
  // all_to_all, all_gather (for the reduce_scatter) and one all_reduce_coalesced.
  EXPECT_EQ(backward_collectives, 3);
  const std::vector<std::string> ops = op_names(joint);
  EXPECT_EQ(std::count(ops.begin(), ops.end(), "all_reduce_coalesced"), 2);
}

// A 0-d input gathers to [group_size]; the backward reduce_scatter gives [1], which must go
// back to the input's shape (PyTorch's engine sums a gradient to its input's shape).
TEST(Autodiff, ZeroDimAllGatherGradientHasTheInputShape) {
  std::unique_ptr<Graph> fwd = parse_graph(R"(graph @g(%s: f32[], %c: f32[2]) {
    %ag = all_gather_into_tensor(%s) {group_size = 2, group = "world"}
    %w = wait_tensor(%ag)
    %agc:2 = all_gather_into_tensor_coalesced(%s, %c) {group_size = 2, group = "world"}
    %w0 = wait_tensor(%agc#0)
    %w1 = wait_tensor(%agc#1)
    %m = mul(%w, %w0)
    %s1 = sum(%m)
    %s2 = sum(%w1)
    %l = add(%s1, %s2)
    return %l
  })");
  const Graph joint = build_joint_graph(*fwd, {0, 1});
  EXPECT_NO_THROW(verify(joint));
  ASSERT_EQ(joint.outputs().size(), 3u);
  EXPECT_EQ(joint.outputs()[1]->type(), fwd->input(0)->type());
  EXPECT_EQ(joint.outputs()[2]->type(), fwd->input(1)->type());
}

TEST(Autodiff, ValueUsedTwiceAccumulatesWithAdd) {
  std::unique_ptr<Graph> fwd = parse_graph(R"(graph @g(%x: f32[3]) {
    %m = mul(%x, %x)
    %l = sum(%m)
    return %l
  })");
  const Graph joint = build_joint_graph(*fwd, {0});
  const Value* g = joint.outputs()[1];
  ASSERT_FALSE(g->is_input());
  EXPECT_EQ(g->node()->op_name(), "add");
}

TEST(Autodiff, UnreachedInputGetsZeros) {
  std::unique_ptr<Graph> fwd = parse_graph(R"(graph @g(%x: f32[3], %u: f64[2,2]) {
    %l = sum(%x)
    return %l
  })");
  const Graph joint = build_joint_graph(*fwd, {1});
  const Node* z = joint.outputs()[1]->node();
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->op_name(), "zeros");
  EXPECT_EQ(joint.outputs()[1]->type(), fwd->input(1)->type());
}

TEST(Autodiff, LossThatIsAnInputHasGradientOne) {
  std::unique_ptr<Graph> fwd = parse_graph("graph @g(%l: f32[]) { return %l }");
  const Graph joint = build_joint_graph(*fwd, {0});
  EXPECT_EQ(joint.outputs()[1]->node()->op_name(), "full");
  EXPECT_EQ(joint.outputs()[1]->node()->attr("value").as_float(), 1.0);
}

// PyTorch's backward() accepts any single-element output as the loss: seeded with ones of its
// shape. Zero elements is no loss.
TEST(Autodiff, SingleElementLossOfAnyRank) {
  std::unique_ptr<Graph> fwd = parse_graph(R"(graph @g(%x: f32[1, 3]) {
  %s = sum(%x) {dims = [1], keepdim = true}
  return %s
})");
  const Graph joint = build_joint_graph(*fwd, {0});
  verify(joint);
  EXPECT_EQ(joint.outputs()[0]->type().str(), "f32[1,1]");
  EXPECT_EQ(joint.outputs()[1]->type().str(), "f32[1,3]");
  EXPECT_THROW(build_joint_graph(*parse_graph("graph @g(%x: f32[0]) { return %x }"), {0}),
               InvalidArgument);
}

TEST(Autodiff, ConvertElementTypeGradientGoesBackToTheInputDtype) {
  std::unique_ptr<Graph> fwd = parse_graph(R"(graph @g(%x: f32[3], %i: i32[3]) {
    %h = convert_element_type(%x) {dtype = bf16}
    %c = convert_element_type(%i) {dtype = bf16}
    %m = mul(%h, %c)
    %s = sum(%m)
    %l = convert_element_type(%s) {dtype = f32}
    return %l
  })");
  const Graph joint = build_joint_graph(*fwd, {0});
  EXPECT_EQ(joint.outputs()[1]->type(), fwd->input(0)->type());
  EXPECT_EQ(joint.outputs()[1]->node()->op_name(), "convert_element_type");
}

// view_dtype has no gradient. An input that reaches the loss only through one would get a
// silently wrong zero gradient: that is an error naming where the gradient stops (PyTorch: the
// loss "does not require grad"). So is one that reaches it through one and around it: the part
// of its gradient that path carries would be lost as silently (it used to get only the other
// path's).
TEST(Autodiff, ViewDtypeStopsTheGradient) {
  std::unique_ptr<Graph> only = parse_graph(R"(graph @g(%x: f32[4]) {
    %v = view_dtype(%x) {dtype = i32}
    %f = view_dtype(%v) {dtype = f32}
    %l = sum(%f)
    return %l
  })");
  EXPECT_EQ(testing::error_of<InvalidArgument>([&] { (void)build_joint_graph(*only, {0}); }),
            "autodiff: %x reaches the loss only through ops with no gradient, so its gradient "
            "would be zero: it stops at view_dtype of f32 to i32 (node %v at <input>:2:5); "
            "bucket-all-gather{mode=multidtype} packs bytes this way: run autodiff before it");
  // f64 -> f32 keeps a floating dtype, and the gradient still stops there.
  std::unique_ptr<Graph> floats = parse_graph(R"(graph @g(%x: f64[2]) {
    %f = view_dtype(%x) {dtype = f32}
    %l = sum(%f)
    return %l
  })");
  EXPECT_THROW((void)build_joint_graph(*floats, {0}), InvalidArgument);

  std::unique_ptr<Graph> around = parse_graph(R"(graph @g(%x: f32[4]) {
    %v = view_dtype(%x) {dtype = i32}
    %f = view_dtype(%v) {dtype = f32}
    %s = add(%f, %x)
    %l = sum(%s)
    return %l
  })");
  EXPECT_EQ(testing::error_of<InvalidArgument>([&] { (void)build_joint_graph(*around, {0}); }),
            "autodiff: a path from %x to the loss stops at view_dtype of f32 to i32 (node %v at "
            "<input>:2:5), so the part of its gradient that path carries would be lost; "
            "bucket-all-gather{mode=multidtype} packs bytes this way: run autodiff before it");
  // A path that carries no gradient before its view_dtype (through a cast to an integer) loses
  // nothing: %x gets its direct path's gradient.
  std::unique_ptr<Graph> compared = parse_graph(R"(graph @g(%x: f32[4]) {
    %b = convert_element_type(%x) {dtype = i32}
    %bf = convert_element_type(%b) {dtype = f32}
    %v = view_dtype(%bf) {dtype = i32}
    %f = view_dtype(%v) {dtype = f32}
    %s = add(%f, %x)
    %l = sum(%s)
    return %l
  })");
  const Graph joint = build_joint_graph(*compared, {0});
  EXPECT_EQ(joint.outputs()[1]->type().str(), "f32[4]");
  EXPECT_NE(joint.outputs()[1]->node()->op_name(), "zeros");

  // Another input with a gradient path: as PyTorch's backward, the stopped one gets none (zeros
  // here) rather than failing the whole backward.
  std::unique_ptr<Graph> mixed = parse_graph(R"(graph @g(%x: f64[3], %y: f64[3]) {
    %c = convert_element_type(%y) {dtype = i32}
    %cf = convert_element_type(%c) {dtype = f64}
    %m = mul(%x, %cf)
    %l = sum(%m)
    return %l
  })");
  const Graph both = build_joint_graph(*mixed, {0, 1});
  ASSERT_EQ(both.outputs().size(), 3u);
  EXPECT_NE(both.outputs()[1]->node()->op_name(), "zeros");  // x: cf
  EXPECT_EQ(both.outputs()[2]->node()->op_name(), "zeros");
  EXPECT_THROW((void)build_joint_graph(*mixed, {1}), InvalidArgument);  // y alone: no path

  // But a bit reinterpretation of a floating value fails even then: that is how a pass packs
  // buffers (multidtype bucketing run before autodiff), and %x's zeros would be silently wrong.
  std::unique_ptr<Graph> packed = parse_graph(R"(graph @g(%x: f32[2], %y: bf16[4]) {
    %p = view_dtype(%x) {dtype = bf16}
    %c = cat(%p, %y) {dim = 0}
    %s = sum(%c)
    %l = convert_element_type(%s) {dtype = f32}
    return %l
  })");
  try {
    (void)build_joint_graph(*packed, {0, 1});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("autodiff: %x reaches the loss only through ops with "
                                          "no gradient, so its gradient would be zero: it stops "
                                          "at view_dtype of f32 to bf16 (node %p at <input>:2:5)",
                                          0),
              0u)
        << e.what();
  }
  EXPECT_NO_THROW((void)build_joint_graph(*packed, {1}));  // %y alone: its own path
}

// The joint graph of `ir` differentiated with respect to input 1 alone gives it `zeros` of
// type `type` (no error).
void expect_zeros_for_input_1(std::string_view ir, std::string_view type) {
  std::unique_ptr<Graph> fwd = parse_graph(ir);
  const Graph joint = build_joint_graph(*fwd, {1});
  ASSERT_EQ(joint.outputs().size(), 2u);
  EXPECT_EQ(joint.outputs()[1]->type().str(), type);
  EXPECT_EQ(joint.outputs()[1]->node()->op_name(), "zeros");
}

// A [0] operand that cat passes over (PyTorch's legacy rule) has no elements, so no gradient
// to lose: it gets zeros of [0] when it is the only input differentiated too, as PyTorch's
// cat backward gives, not the "stops" error (which named cat, a differentiable op).
TEST(Autodiff, AnEmptyInputCatSkipsGetsAnEmptyGradient) {
  expect_zeros_for_input_1(R"(graph @g(%a: f64[2,3], %e: f64[0]) {
    %c = cat(%a, %e) {dim = 1}
    %m = mul(%c, %c)
    %l = sum(%m)
    return %l
  })",
                           "f64[0]");
}

// Many inputs that reach the loss only through integer casts, beside one with a gradient: they
// get zeros, found in one pass over the graph (a pass per input took 18.5 s at 16,000 inputs).
// The result is checked here; the time is bench's business.
TEST(Autodiff, ManyInputsStoppedByCastsGetZeros) {
  constexpr int kInputs = 200;
  std::string text = "graph @g(%y: f64[2]";
  for (int i = 0; i < kInputs; ++i) text += fmt::format(", %x{}: f64[2]", i);
  text += ") {\n  %acc0 = sum(%y)\n";
  for (int i = 0; i < kInputs; ++i) {
    text += fmt::format(
        "  %c{0} = convert_element_type(%x{0}) {{dtype = i32}}\n"
        "  %f{0} = convert_element_type(%c{0}) {{dtype = f64}}\n"
        "  %s{0} = sum(%f{0})\n"
        "  %acc{1} = add(%acc{0}, %s{0})\n",
        i, i + 1);
  }
  text += fmt::format("  return %acc{}\n}}", kInputs);
  std::unique_ptr<Graph> fwd = parse_graph(text);
  std::vector<int> wrt(kInputs + 1);
  for (int i = 0; i <= kInputs; ++i) wrt[static_cast<size_t>(i)] = i;
  const Graph joint = build_joint_graph(*fwd, wrt);
  ASSERT_EQ(joint.outputs().size(), static_cast<size_t>(kInputs + 2));
  EXPECT_NE(joint.outputs()[1]->node()->op_name(), "zeros");  // %y
  for (int i = 0; i < kInputs; ++i) {
    EXPECT_EQ(joint.outputs()[static_cast<size_t>(i + 2)]->node()->op_name(), "zeros") << i;
  }
  // Alone, the first of them is named with where its gradient stops.
  try {
    (void)build_joint_graph(*fwd, {1, 2});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("autodiff: %x0 reaches the loss only through ops with "
                                          "no gradient, so its gradient would be zero: it stops "
                                          "at convert_element_type of f64 to i32 (node %c0",
                                          0),
              0u)
        << e.what();
  }
}

// relu_backward's mask operand has a zero gradient, as PyTorch's threshold_backward: a
// double-backward graph differentiated through it alone gets zeros, not the "stops" error.
TEST(Autodiff, ReluBackwardsMaskHasAZeroGradient) {
  expect_zeros_for_input_1(R"(graph @g(%g: f64[3], %x: f64[3]) {
    %r = relu_backward(%g, %x)
    %l = sum(%r)
    return %l
  })",
                           "f64[3]");
}

TEST(Autodiff, Errors) {
  // The InvalidArgument's message, or with `located` its FILE:LINE:COL form.
  auto joint_error = [](std::string_view ir, std::vector<int> wrt,
                        bool located = false) -> std::string {
    std::unique_ptr<Graph> fwd = parse_graph(ir);
    try {
      (void)build_joint_graph(*fwd, wrt);
    } catch (const InvalidArgument& e) {
      if (!located) return e.what();
      const auto* at = dynamic_cast<const SourceLocated*>(&e);
      return at ? at->located() : "no location: " + std::string(e.what());
    }
    return "no error";
  };
  EXPECT_EQ(joint_error("graph @g(%x: f32[2]) { return %x }", {0}),
            "autodiff: the loss (first output %x of graph @g) must be a scalar of a floating "
            "dtype, got f32[2]");
  EXPECT_EQ(joint_error("graph @g(%x: i32[]) { return %x }", {}),
            "autodiff: the loss (first output %x of graph @g) must be a scalar of a floating "
            "dtype, got i32[]");
  EXPECT_EQ(joint_error("graph @g(%x: f32[]) { return }", {}),
            "autodiff: graph @g has no outputs (the first output is the loss)");
  EXPECT_EQ(joint_error("graph @g(%x: f32[]) { return %x }", {1}),
            "autodiff: wrt index 1 is out of range (graph @g has 1 inputs)");
  EXPECT_EQ(joint_error("graph @g(%x: f32[]) { return %x }", {0, 0}),
            "autodiff: wrt index 0 is repeated");
  EXPECT_EQ(joint_error("graph @g(%x: f32[], %i: i64[]) { return %x }", {1}),
            "autodiff: input 1 (%i) has dtype i64; only floating inputs have gradients");
  // Errors about the graph as a whole are located where a tool can point: the loss's
  // definition, the offending input, or the graph's header.
  EXPECT_EQ(joint_error("graph @g(%x: f32[2]) {\n  %y = neg(%x)\n  return %y\n}", {0}, true),
            "<input>:2:3: error: autodiff: the loss (first output %y of graph @g) must be a "
            "scalar of a floating dtype, got f32[2]");
  EXPECT_EQ(joint_error("graph @g(%x: f32[],\n         %i: i64[]) { return %x }", {1}, true),
            "<input>:2:10: error: autodiff: input 1 (%i) has dtype i64; only floating inputs "
            "have gradients");
  EXPECT_EQ(joint_error("\ngraph @g(%x: f32[]) { return %x }", {3}, true),
            "<input>:2:1: error: autodiff: wrt index 3 is out of range (graph @g has 1 inputs)");
  EXPECT_EQ(joint_error(R"(graph @g(%x: f32[4]) {
    %rs = reduce_scatter_tensor(%x) {reduce_op = "avg", group_size = 2, group = "world"}
    %w = wait_tensor(%rs)
    %l = sum(%w)
    return %l })",
                        {0}),
            "reduce_scatter_tensor backward only supports 'sum' reduction, got 'avg' (node %rs at "
            "<input>:2:5)");
  EXPECT_EQ(joint_error(R"(graph @g(%x: f32[4], %y: f32[4]) {
    %c:2 = all_reduce_coalesced(%x, %y) {reduce_op = "min", group = "world"}
    %w = wait_tensor(%c#1)
    %l = sum(%w)
    return %l })",
                        {0, 1}),
            "all_reduce_coalesced backward only supports 'sum' reduction, got 'min' (node %c at "
            "<input>:2:5)");
  EXPECT_EQ(joint_error(R"(graph @g(%x: f32[4]) {
    %b = broadcast(%x) {src = 0, group = "world"}
    %w = wait_tensor(%b)
    %l = sum(%w)
    return %l })",
                        {0}),
            "broadcast has no gradient rule (node %b at <input>:2:5; PyTorch defines none): make "
            "its input a non-differentiated value or use all_reduce");
  EXPECT_EQ(joint_error(R"(graph @g(%x: f32[4], %w: f32[4]) {
    %p = bucket_pack(%x, %w) {group_size = 2}
    %l = sum(%p)
    return %l })",
                        {0}),
            "autodiff: op bucket_pack has no gradient rule (node %p at <input>:2:5): run autodiff "
            "before the bucketing passes");
}

// An autodiff error about a parsed node carries the node's location, so funcol opt prints it as
// FILE:LINE:COL: error: message (DESIGN section 5).
TEST(Autodiff, ErrorsAreLocatedAtTheirNode) {
  std::unique_ptr<Graph> fwd = parse_graph(R"(graph @g(%x: f32[4]) {
    %ar = all_reduce(%x) {reduce_op = "max", group = "world"}
    %w = wait_tensor(%ar)
    %l = sum(%w)
    return %l })",
                                           ParseOptions{.file = "m.ir"});
  try {
    (void)build_joint_graph(*fwd, {0});
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    const auto* at = dynamic_cast<const SourceLocated*>(&e);
    ASSERT_NE(at, nullptr) << e.what();
    EXPECT_EQ(at->located(),
              "m.ir:2:5: error: all_reduce backward only supports 'sum' reduction, got 'max' "
              "(node %ar)");
  }
}

// A failed backward leaves the graph as it was, through append_backward and through the pass
// (the nodes appended before the failing rule used to stay behind, dangling, for a caller that
// catches the error and goes on).
TEST(Autodiff, FailedBackwardLeavesTheGraphAsItWas) {
  constexpr const char* kMaxAllReduce = R"(graph @g(%x: f32[4]) {
    %ar = all_reduce(%x) {reduce_op = "max", group = "world"}
    %w = wait_tensor(%ar)
    %m = mul(%w, %w)
    %l = sum(%m)
    return %l
  })";
  std::unique_ptr<Graph> g = parse_graph(kMaxAllReduce);
  const std::string before = print(*g);
  Value* wrt[] = {g->input(0)};
  EXPECT_THROW(append_backward(*g, g->outputs()[0], wrt), InvalidArgument);
  EXPECT_EQ(print(*g), before);
  EXPECT_THROW(Pipeline::parse("autodiff").run(*g), InvalidArgument);
  EXPECT_EQ(print(*g), before);
}

TEST(AutodiffPass, PipelineOptionsAndDefault) {
  const std::string ir(kFsdp);
  {
    std::unique_ptr<Graph> g = parse_graph(ir);
    Pipeline::parse("autodiff").run(*g);
    // Default: every floating input (%x, %w, %t), not %i.
    EXPECT_EQ(g->outputs().size(), 4u);
  }
  {
    std::unique_ptr<Graph> g = parse_graph(ir);
    Pipeline::parse("autodiff{wrt=1}").run(*g);
    ASSERT_EQ(g->outputs().size(), 2u);
    EXPECT_EQ(g->outputs()[1]->type(), g->input(1)->type());
  }
  // A '+' as every numeric pass option takes it.
  for (const char* wrt : {"autodiff{wrt=2:0}", "autodiff{wrt=+2:+0}"}) {
    std::unique_ptr<Graph> g = parse_graph(ir);
    Pipeline::parse(wrt).run(*g);
    ASSERT_EQ(g->outputs().size(), 3u) << wrt;
    EXPECT_EQ(g->outputs()[1]->type(), g->input(2)->type()) << wrt;
  }
  for (const char* bad :
       {"autodiff{wrt=a}", "autodiff{wrt=1:}", "autodiff{wrt=-1}", "autodiff{wrt=+-1}"}) {
    EXPECT_THROW(Pipeline::parse(bad), InvalidArgument) << bad;
  }
  EXPECT_THROW(Pipeline::parse("autodiff{cap-mb=1}"), InvalidArgument);
}

TEST(AutodiffPass, DeterministicAndRoundTrips) {
  std::unique_ptr<Graph> a = parse_graph(kFsdp);
  std::unique_ptr<Graph> b = parse_graph(kFsdp);
  Pipeline::parse("autodiff").run(*a);
  Pipeline::parse("autodiff").run(*b);
  const std::string printed = print(*a);
  EXPECT_EQ(printed, print(*b));
  std::unique_ptr<Graph> again = parse_graph(printed);
  std::string why;
  EXPECT_TRUE(structurally_equal(*a, *again, &why)) << why;
  EXPECT_EQ(print(*again), printed);
  // And build_joint_graph gives the same graph as the pass.
  std::unique_ptr<Graph> fwd = parse_graph(kFsdp);
  EXPECT_EQ(print(build_joint_graph(*fwd, floating_inputs(*fwd))), printed);
}

}  // namespace
}  // namespace funcol
