// Tests of the IR printer: exact format, round trips of every op, attribute values, dot export.
#include "funcol/graph/printer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "funcol/graph/parser.h"
#include "funcol/graph/verifier.h"
#include "test_ir.h"

namespace funcol {
namespace {

// The design example without its leading comment line: exactly what the printer writes.
std::string design_example_printed() {
  std::string_view text = testing_ir::kDesignExample;
  return std::string(text.substr(text.find('\n') + 1));
}

TEST(Printer, DesignExampleExactly) {
  Module m = parse_module(testing_ir::kDesignExample);
  EXPECT_EQ(print(m), design_example_printed());
  EXPECT_EQ(print(*m.graphs()[0]), design_example_printed());
}

TEST(Printer, EveryOpRoundTripsByteForByte) {
  Module m = parse_module(testing_ir::kEveryOp);
  // The table order covers every op exactly once in kEveryOp (except the extra wait).
  std::vector<std::string_view> seen;
  for (const Node& n : m.graphs()[0]->nodes()) seen.push_back(n.op_name());
  for (const OpDef& op : all_ops()) {
    EXPECT_NE(std::find(seen.begin(), seen.end(), op.name), seen.end()) << op.name;
  }
  const std::string printed = print(m);
  EXPECT_EQ(printed, testing_ir::kEveryOp);
  Module again = parse_module(printed);
  std::string why;
  EXPECT_TRUE(structurally_equal(m, again, &why)) << why;
  EXPECT_EQ(print(again), printed);
}

TEST(Printer, NormalizesWhitespaceOptionalTypesAndDefaults) {
  Module m = parse_module(R"(graph @g( %x : f32[ 8 , 2 ] ) {
      %s = sum( %x )
      %r = all_reduce(%s) {group = "world", reduce_op = "AVG"}
      return %r })");
  EXPECT_EQ(print(m), R"(graph @g(%x: f32[8,2]) {
  %s = sum(%x) {dims = [], keepdim = false} : f32[]
  %r = all_reduce(%s) {reduce_op = "avg", group = "world"} : f32[]
  return %r
}
)");
}

TEST(Printer, MultipleGraphsAreSeparatedByABlankLine) {
  Module m = parse_module("graph @a() { return }\ngraph @b(%x: bool[]) { return %x }");
  EXPECT_EQ(print(m), "graph @a() {\n  return\n}\n\ngraph @b(%x: bool[]) {\n  return %x\n}\n");
}

TEST(Printer, AttributeValues) {
  const auto str = [](const Attr& a) { return a.str(); };
  EXPECT_EQ(str(Attr(-7)), "-7");
  EXPECT_EQ(str(Attr(INT64_MIN)), "-9223372036854775808");
  EXPECT_EQ(str(Attr(1.0)), "1.0");
  EXPECT_EQ(str(Attr(0.1)), "0.1");
  EXPECT_EQ(str(Attr(-2.5e-300)), "-2.5e-300");
  EXPECT_EQ(str(Attr(1e300)), "1e+300");
  EXPECT_EQ(str(Attr(std::numeric_limits<double>::infinity())), "inf");
  EXPECT_EQ(str(Attr(-std::numeric_limits<double>::infinity())), "-inf");
  EXPECT_EQ(str(Attr(std::nan(""))), "nan");
  EXPECT_EQ(str(Attr(-std::nan(""))), "-nan");  // 0.0 / 0.0 on x86
  EXPECT_EQ(str(Attr(true)), "true");
  EXPECT_EQ(str(Attr(DType::BF16)), "bf16");
  EXPECT_EQ(str(Attr("a\"b\\c\n\t\x01\xff")), "\"a\\\"b\\\\c\\n\\t\\x01\\xff\"");
  EXPECT_EQ(str(Attr(std::vector<int64_t>{})), "[]");
  EXPECT_EQ(str(Attr({1, -2, 3})), "[1, -2, 3]");
  EXPECT_EQ(str(Attr::list({Attr(1), Attr("x"), Attr::list({Attr(false)})})), "[1, \"x\", [false]]");
}

// Infinities and NaNs read back with their sign: the printer wrote every NaN as "nan" and the
// parser refused "-nan", so a NaN with its sign bit set (x86's 0.0 / 0.0) changed on the way.
TEST(Printer, NonFiniteValuesRoundTripWithTheirSign) {
  const double inf = std::numeric_limits<double>::infinity();
  for (const double v : {inf, -inf, std::nan(""), -std::nan("")}) {
    auto g = std::make_unique<Graph>("g");
    Builder b(*g);
    g->add_output(b.value("full", {}, {{"shape", std::vector<int64_t>{2}}, {"dtype", DType::F32},
                                        {"value", v}}));
    Module m;
    m.add(std::move(g));
    const std::string text = print(m);
    Module back = parse_module(text);
    const double got = back.graphs()[0]->first_node()->attr("value").as_float();
    EXPECT_EQ(std::signbit(got), std::signbit(v)) << text;
    EXPECT_EQ(std::isnan(got), std::isnan(v)) << text;
    EXPECT_EQ(print(back), text);
  }
}

TEST(Printer, EscapedStringsRoundTrip) {
  const std::string group = std::string("a\"b\\c\n\t\x01\xff") + '\0' + "z";
  auto g = std::make_unique<Graph>("g");
  Value* x = g->add_input("x", Type(DType::F32, {2}));
  Builder b(*g);
  Value* r = b.value("all_reduce", {x}, {{"reduce_op", "sum"}, {"group", group}});
  g->add_output(r);
  Module m;
  m.add(std::move(g));
  Module again = parse_module(print(m));
  EXPECT_EQ(again.graphs()[0]->first_node()->attr("group").as_string(), group);
  std::string why;
  EXPECT_TRUE(structurally_equal(m, again, &why)) << why;
}

TEST(Printer, BuilderNodesGetFreshNamesThatRoundTrip) {
  Module m = parse_module(testing_ir::kDesignExample);
  Graph& g = *m.graphs()[0];
  Builder b(g, g.first_node()->next());  // before %wf
  b.set_name_hint("ag");                 // %ag is taken: gets a suffix
  Value* extra = b.value("all_gather_into_tensor", {g.input(1)}, {{"group_size", 2}, {"group", "tp"}});
  b.set_name_hint("");
  Value* n = b.value("neg", {extra});
  g.add_output(n);
  verify(g);
  EXPECT_EQ(extra->name(), "ag.1");
  EXPECT_EQ(n->name(), "v");
  const std::string printed = print(m);
  EXPECT_NE(printed.find("  %ag.1 = all_gather_into_tensor(%w) {group_size = 2, group = \"tp\"} : "
                         "f32[8,16]\n  %v = neg(%ag.1) : f32[8,16]\n  %wf = wait_tensor"),
            std::string::npos)
      << printed;
  Module again = parse_module(printed);
  std::string why;
  EXPECT_TRUE(structurally_equal(m, again, &why)) << why;
}

TEST(Printer, IsDeterministic) {
  Module a = parse_module(testing_ir::kEveryOp);
  Module b = parse_module(testing_ir::kEveryOp);
  EXPECT_EQ(print(a), print(b));
  EXPECT_EQ(to_dot(a), to_dot(b));
}

TEST(Printer, Dot) {
  Module m = parse_module(testing_ir::kDesignExample);
  const std::string dot = to_dot(m);
  EXPECT_EQ(dot.rfind("digraph \"fsdp_layer\" {\n", 0), 0u) << dot;
  EXPECT_NE(dot.find("  in1 [shape=ellipse, label=\"%w: f32[4,16]\"];\n"), std::string::npos) << dot;
  EXPECT_NE(dot.find("  n0 [shape=box, style=filled, fillcolor=\"lightblue\", label=\"%ag = "
                     "all_gather_into_tensor\\nf32[16,16]\"];\n"),
            std::string::npos)
      << dot;
  EXPECT_NE(dot.find("  in1 -> n0;\n"), std::string::npos) << dot;
  EXPECT_NE(dot.find("  n3 -> ret [label=\"#1\"];\n"), std::string::npos) << dot;
  EXPECT_NE(dot.find("  n2 -> ret;\n"), std::string::npos) << dot;
  EXPECT_EQ(dot.substr(dot.size() - 2), "}\n");
}

// Graphviz refuses a quoted string longer than 16 KiB: a bucket's split of 2,000 members and a
// name of 20,000 bytes get short labels.
TEST(Printer, DotLabelsStayShort) {
  const std::string name(20000, 'v');
  std::string sizes, types;
  for (int i = 0; i < 2000; ++i) {
    sizes += i ? ", 2" : "2";
    types += i ? ", f32[2]" : "f32[2]";
  }
  Module m = parse_module("graph @" + name + "(%" + name + ": f32[4000]) {\n  %" + name +
                          "x:2000 = split_with_sizes(%" + name + ") {split_sizes = [" + sizes +
                          "]}\n  return %" + name + "x#1999\n}\n");
  const std::string dot = to_dot(m);
  size_t longest = 0;
  for (size_t at = dot.find('"'); at != std::string::npos;) {
    size_t end = at + 1;
    while (dot[end] != '"') end += dot[end] == '\\' ? 2 : 1;
    longest = std::max(longest, end - at - 1);
    at = dot.find('"', end + 1);
  }
  EXPECT_LT(longest, 1000u) << dot.substr(0, 2000);
  const std::string shown(64, 'v');
  EXPECT_EQ(dot.rfind("digraph \"" + shown + "...\" {\n", 0), 0u) << dot.substr(0, 200);
  EXPECT_NE(dot.find("label=\"%" + shown + "...: f32[4000]\"]"), std::string::npos);
  EXPECT_NE(dot.find("label=\"%" + shown + "... = split_with_sizes\\nf32[2], f32[2], f32[2], "
                     "f32[2], f32[2], f32[2], f32[2], f32[2], ... (2000 results)\"]"),
            std::string::npos)
      << dot.substr(0, 2000);
}

}  // namespace
}  // namespace funcol
