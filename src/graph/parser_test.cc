// Tests of the IR parser: accepted syntax and one case per error kind with its exact location.
#include "funcol/graph/parser.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/graph/printer.h"
#include "test_ir.h"

namespace funcol {
namespace {

using testing_ir::parse_error;

TEST(Parser, DesignExample) {
  Module m = parse_module(testing_ir::kDesignExample);
  ASSERT_EQ(m.graphs().size(), 1u);
  const Graph& g = *m.graphs()[0];
  EXPECT_EQ(g.name(), "fsdp_layer");
  ASSERT_EQ(g.num_inputs(), 2u);
  EXPECT_EQ(g.input(0)->name(), "x");
  EXPECT_EQ(g.input(1)->type(), Type(DType::F32, {4, 16}));
  ASSERT_EQ(g.num_nodes(), 4u);
  const Node* ag = g.first_node();
  EXPECT_EQ(ag->op_name(), "all_gather_into_tensor");
  EXPECT_EQ(ag->attr("group_size").as_int(), 4);
  EXPECT_EQ(ag->attr("group").as_string(), "world");
  EXPECT_EQ(ag->operand(0), g.input(1));
  EXPECT_EQ(ag->loc(), (SourceLoc{3, 3}));
  const Node* split = g.last_node();
  EXPECT_EQ(split->num_results(), 2u);
  ASSERT_EQ(g.outputs().size(), 2u);
  EXPECT_EQ(g.outputs()[1], split->result(1));
  EXPECT_EQ(g.outputs()[0]->ref(), "%y");
  EXPECT_EQ(g.outputs()[1]->ref(), "%p#1");
  EXPECT_EQ(g.loc(), (SourceLoc{2, 1}));
}

TEST(Parser, ResultTypesAreOptionalAndInferred) {
  Module m = parse_module(R"(graph @g(%x: f32[6,2]) {
    %a = all_gather_into_tensor(%x) {group_size = 3, group = "world"}
    %s = split_with_sizes(%a) {split_sizes = [10, 8]}
    return %s#0
  })");
  const Graph& g = *m.graphs()[0];
  EXPECT_EQ(g.first_node()->result()->type(), Type(DType::F32, {18, 2}));
  EXPECT_EQ(g.last_node()->num_results(), 2u);
  EXPECT_EQ(g.last_node()->result(1)->type(), Type(DType::F32, {8, 2}));
  // The default of an optional attribute is filled in.
  EXPECT_EQ(g.last_node()->attr("dim").as_int(), 0);
}

TEST(Parser, MultipleGraphsCommentsAndEmptyFile) {
  EXPECT_TRUE(parse_module("").graphs().empty());
  EXPECT_TRUE(parse_module("  // only a comment\n\n").graphs().empty());
  Module m = parse_module(R"(// a
graph @a() { return } // trailing
graph @b(%x: i64[]) {
  // inside
  %y = neg(%x) // after a node
  return %y, %x
}
)");
  ASSERT_EQ(m.graphs().size(), 2u);
  EXPECT_EQ(m.graphs()[0]->num_nodes(), 0u);
  EXPECT_TRUE(m.graphs()[0]->outputs().empty());
  EXPECT_EQ(m.find("b")->num_nodes(), 1u);
  EXPECT_EQ(m.find("b")->outputs()[1], m.find("b")->input(0));
  EXPECT_EQ(m.find("c"), nullptr);
}

TEST(Parser, ByteOrderMarkIsSkipped) {
  Module m = parse_module("\xEF\xBB\xBFgraph @a(%x: f32[2]) {\n  return %x\n}\n");
  ASSERT_EQ(m.graphs().size(), 1u);
  // Columns count from the first character after the mark.
  EXPECT_EQ(parse_error("\xEF\xBB\xBFgraph @a() { %y = neg(%z) }"),
            "t.ir:1:23: error: use of undefined value %z");
  // Only at the start of the file.
  EXPECT_EQ(parse_error("graph @a() { return }\n\xEF\xBB\xBF"), "t.ir:2:1: error: unexpected byte 0xef");
}

// A name running into non-ASCII bytes is one bad word, not an ASCII name and a stray byte.
TEST(ParserErrors, NonAsciiInNames) {
  EXPECT_EQ(parse_error("graph @a(%x: f32[2]) {\n  %y = n\xc3\xa9g(%x)\n  return %y\n}\n"),
            "t.ir:2:9: error: unexpected byte 0xc3 in 'n\\xc3\\xa9g' (names are ASCII letters, "
            "digits, '_' and '.')");
  EXPECT_EQ(parse_error("graph @a(%x\xc3\xa9: f32[2]) {\n  return %x\n}\n"),
            "t.ir:1:12: error: unexpected byte 0xc3 in '%x\\xc3\\xa9' (names are ASCII letters, "
            "digits, '_' and '.')");
}

// Lines end at \n, \r\n or a lone \r (classic Mac files): error columns and lines count alike.
TEST(Parser, LineEndings) {
  for (const char* eol : {"\n", "\r\n", "\r"}) {
    SCOPED_TRACE(testing::PrintToString(std::string(eol)));
    auto text = [&](std::initializer_list<const char*> lines) {
      std::string t;
      for (const char* l : lines) t += std::string(l) + eol;
      return t;
    };
    EXPECT_EQ(parse_error(text({"// a comment", "graph @a(%x: f32[2]) {", "  %y = neg(%z)",
                                "  return %y", "}"})),
              "t.ir:3:12: error: use of undefined value %z");
    EXPECT_EQ(parse_error(text({"graph @a(%x: f32[2]) {", "  %s = all_reduce(%x) {reduce_op = \"sum", "}"})),
              "t.ir:2:36: error: unterminated string");
    Module m = parse_module(text({"graph @a(%x: f32[2]) { // c", "  return %x", "}"}));
    EXPECT_EQ(m.graphs().size(), 1u);
  }
}

TEST(Parser, AttributeValueKinds) {
  Module m = parse_module(R"(graph @g(%x: f32[4]) {
    %a = all_reduce(%x) {group = "w\"q\\ \x41\n", reduce_op = "SUM"}
    %e = empty() {dtype = bf16, shape = []}
    %s = sum(%x) {keepdim = true}
    %p = permute(%x) {dims = [-1]}
    return %a
  })");
  const Graph& g = *m.graphs()[0];
  const Node* ar = g.first_node();
  EXPECT_EQ(ar->attr("group").as_string(), "w\"q\\ A\n");
  // reduce_op is case-insensitive in text and canonicalized to lower case.
  EXPECT_EQ(ar->attr("reduce_op").as_string(), "sum");
  EXPECT_EQ(ar->next()->attr("dtype").as_dtype(), DType::BF16);
  EXPECT_TRUE(ar->next()->attr("shape").as_ints().empty());
  EXPECT_EQ(ar->next()->next()->result()->type(), Type(DType::F32, {1}));
  EXPECT_EQ(g.last_node()->attr("dims").as_ints(), std::vector<int64_t>{-1});
}

TEST(Parser, IntegerLimits) {
  Module m = parse_module(R"(graph @g(%x: f32[4]) {
    %b = broadcast(%x) {src = 9223372036854775807, group = "w"}
    return %b
  })");
  EXPECT_EQ(m.graphs()[0]->first_node()->attr("src").as_int(), INT64_MAX);
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %n = narrow(%x) {dim = 0, start = "
                        "-9223372036854775808, length = 0}\n  return %n\n}"),
            "t.ir:2:8: error: %n: narrow: start (-9223372036854775808) is out of range for size 4 "
            "of dim 0");
}

constexpr const char* kTooMany =
    "error: the text holds more than 16777216 elements (values and attribute list elements 1 "
    "each, operands 1 + rank/4, graphs 64); larger graphs are not read";

// Values and attribute list elements are counted as they are read, and a text with more than
// 2^24 of them is refused before their memory is taken: a split_with_sizes into empty pieces
// defines a value per 2 bytes of text ("0,", about 100 bytes of memory each), so a 256 MiB file
// of them asked for 13 GB. Here 33 MB of text.
TEST(Parser, RefusesTextsWithTooManyValuesAndListElements) {
  const auto split = [](int pieces) {
    std::string text = "graph @g(%x: f32[0]) {\n  %p = split_with_sizes(%x) {split_sizes = [";
    text.reserve(text.size() + 2 * static_cast<size_t>(pieces) + 32);
    for (int i = 0; i + 1 < pieces; ++i) text += "0,";
    return text + "0]}\n  return %x\n}\n";
  };
  const std::string message = parse_error(split((1 << 24) + 1));
  EXPECT_EQ(message.rfind("t.ir:2:", 0), 0u) << message.substr(0, 200);
  EXPECT_NE(message.find(kTooMany), std::string::npos) << message.substr(0, 200);
  // A bucket's split of 131,072 members reads.
  EXPECT_EQ(parse_graph(split(1 << 17))->first_node()->num_results(), size_t{1} << 17);
}

// Operands count 1 + rank / 4 (each takes about 100 bytes and 8 per dim while its node is
// read: a cat of 4 M rank-64 operands, 12 MB of text, took 2.35 GB) and graphs 64 (an empty
// one takes about 1 KB: a million of them, 22 MB of text, took 973 MB).
TEST(Parser, OperandsAndGraphsCountTowardTheLimit) {
  // 2^20 operands of rank 60 count 16 each: 2^24, and the graph and its input make it too many.
  const auto cat = [](int operands) {
    std::string dims = "1";
    for (int d = 1; d < 60; ++d) dims += ",1";
    std::string text = "graph @g(%x: f32[" + dims + "]) {\n  %c = cat(%x";
    for (int i = 1; i < operands; ++i) text += ",%x";
    return text + ") {dim = 0}\n  return %c\n}\n";
  };
  std::string message = parse_error(cat(1 << 20));
  EXPECT_EQ(message.rfind("t.ir:2:", 0), 0u) << message.substr(0, 200);
  EXPECT_NE(message.find(kTooMany), std::string::npos) << message.substr(0, 200);
  // The graph (64), its input, 2^20 - 8 operands, the result and its return: 2^24 - 46.
  EXPECT_EQ(parse_graph(cat((1 << 20) - 8))->first_node()->num_operands(), (size_t{1} << 20) - 8);
  // 2^18 empty graphs count 2^24, and their returns nothing.
  const auto graphs = [](int count) {
    std::string text;
    for (int i = 0; i < count; ++i) text += fmt::format("graph @g{}() {{ return }}\n", i);
    return text;
  };
  message = parse_error(graphs((1 << 18) + 1));
  EXPECT_EQ(message.rfind(fmt::format("t.ir:{}:1:", (1 << 18) + 1), 0), 0u)
      << message.substr(0, 200);
  EXPECT_NE(message.find(kTooMany), std::string::npos) << message.substr(0, 200);
  EXPECT_EQ(parse_module(graphs(1 << 18)).graphs().size(), size_t{1} << 18);
}

// A float literal too small for a double reads as the nearest one (a subnormal or a signed
// zero), as strtod and Python's float() read it; only one too large is an error.
TEST(Parser, FloatLiteralsBelowTheRangeRound) {
  Module m = parse_module(R"(graph @g() {
    %a = full() {shape = [], dtype = f64, value = 1e-400}
    %b = full() {shape = [], dtype = f64, value = -1e-400}
    %c = full() {shape = [], dtype = f64, value = 3e-324}
    %d = full() {shape = [], dtype = f64, value = 2.5e-308}
    return %a, %b, %c, %d
  })");
  const Node* a = m.graphs()[0]->first_node();
  EXPECT_EQ(a->attr("value").as_float(), 0.0);
  EXPECT_FALSE(std::signbit(a->attr("value").as_float()));
  EXPECT_EQ(a->next()->attr("value").as_float(), 0.0);
  EXPECT_TRUE(std::signbit(a->next()->attr("value").as_float()));
  EXPECT_EQ(a->next()->next()->attr("value").as_float(), std::numeric_limits<double>::denorm_min());
  EXPECT_EQ(a->next()->next()->next()->attr("value").as_float(), 2.5e-308);
  EXPECT_EQ(parse_error("graph @g() {\n  %a = full() {shape = [], dtype = f64, value = -1e999}\n}"),
            "t.ir:2:49: error: float literal -1e999 is out of range");
}

TEST(Parser, ParseGraphWantsExactlyOne) {
  EXPECT_EQ(parse_graph("graph @a() { return }")->name(), "a");
  EXPECT_THROW(parse_graph(""), ParseError);
  EXPECT_THROW(parse_graph("graph @a() { return } graph @b() { return }"), ParseError);
}

TEST(Parser, FirstLineOffsetsLocations) {
  try {
    parse_module("graph @g() {\n  return %x\n}", ParseOptions{.file = "f.ir", .first_line = 10});
    FAIL();
  } catch (const ParseError& e) {
    EXPECT_EQ(e.file(), "f.ir");
    EXPECT_EQ(e.line(), 11);
    EXPECT_EQ(e.col(), 10);
    EXPECT_EQ(e.message(), "use of undefined value %x");
  }
}

// ---- one case per error kind, with its exact location ----------------------------------------

TEST(ParserErrors, Syntax) {
  EXPECT_EQ(parse_error("grph @g() { return }"), "t.ir:1:1: error: expected 'graph', found 'grph'");
  EXPECT_EQ(parse_error("graph g() { return }"),
            "t.ir:1:7: error: expected a graph name '@name', found 'g'");
  EXPECT_EQ(parse_error("graph @g(%x f32[2]) { return }"),
            "t.ir:1:13: error: expected ':' and the input's type, found 'f32'");
  EXPECT_EQ(parse_error("graph @g() {\n  %y = neg(%x\n}"),
            "t.ir:2:12: error: use of undefined value %x");
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = neg(%x\n}"),
            "t.ir:3:1: error: expected ')' or ',', found '}'");
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y neg(%x)\n}"),
            "t.ir:2:6: error: expected '=', found 'neg'");
  EXPECT_EQ(parse_error("graph @g() {\n  foo\n}"),
            "t.ir:2:3: error: expected a node ('%name = op(...)') or 'return', found 'foo'");
  EXPECT_EQ(parse_error("graph @g() { return } }"), "t.ir:1:23: error: expected 'graph', found '}'");
  EXPECT_EQ(parse_error("graph @g() { return ) }"),
            "t.ir:1:21: error: expected '}' to close graph @g, found ')'");
  EXPECT_EQ(parse_error("graph @g() { return $ }"), "t.ir:1:21: error: unexpected character '$'");
  EXPECT_EQ(parse_error("graph @g() {\x01}"), "t.ir:1:13: error: unexpected byte 0x01");
  EXPECT_EQ(parse_error("graph @g() { % }"), "t.ir:1:14: error: expected a value name after '%'");
  EXPECT_EQ(parse_error("graph @g() { / }"), "t.ir:1:14: error: unexpected character '/'");
}

TEST(ParserErrors, TruncatedFile) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = neg(%x)"),
            "t.ir:2:15: error: expected a node ('%name = op(...)') or 'return', found end of file");
  EXPECT_EQ(parse_error("graph @g(%x: f32[2"), "t.ir:1:19: error: expected ']' or ',', found end of file");
  EXPECT_EQ(parse_error("graph"), "t.ir:1:6: error: expected a graph name '@name', found end of file");
}

TEST(ParserErrors, UnknownOp) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = frobnicate(%x)\n  return %y\n}"),
            "t.ir:2:8: error: unknown op 'frobnicate'");
}

TEST(ParserErrors, UnknownAttribute) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = all_reduce(%x) {reduce_op = \"sum\", grop = "
                        "\"world\"}\n  return %y\n}"),
            "t.ir:2:43: error: unknown attribute 'grop' for all_reduce (expected: reduce_op, group)");
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = neg(%x) {dim = 0}\n  return %y\n}"),
            "t.ir:2:17: error: unknown attribute 'dim' for neg (it has no attributes)");
}

TEST(ParserErrors, MissingAttribute) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = all_reduce(%x) {reduce_op = \"sum\"}\n"
                        "  return %y\n}"),
            "t.ir:2:8: error: missing attribute 'group' for all_reduce");
}

TEST(ParserErrors, DuplicateAttribute) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = broadcast(%x) {src = 0, src = 1, group = "
                        "\"w\"}\n  return %y\n}"),
            "t.ir:2:32: error: duplicate attribute 'src'");
}

TEST(ParserErrors, IllTypedAttribute) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = all_gather_into_tensor(%x) {group_size = "
                        "\"4\", group = \"w\"}\n  return %y\n}"),
            "t.ir:2:49: error: attribute 'group_size' of all_gather_into_tensor must be an "
            "integer, got \"4\"");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = view(%x) {shape = [2, \"a\"]}\n  return %y\n}"),
            "t.ir:2:26: error: attribute 'shape' of view must be a list of integers, got [2, \"a\"]");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = sum(%x) {keepdim = 1}\n  return %y\n}"),
            "t.ir:2:27: error: attribute 'keepdim' of sum must be a boolean, got 1");
}

TEST(ParserErrors, BadAttributeValue) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = all_reduce(%x) {reduce_op = \"mean\", "
                        "group = \"w\"}\n  return %y\n}"),
            "t.ir:2:36: error: Unrecognized reduce_op: mean");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = all_gather_into_tensor(%x) {group_size = 0, "
                        "group = \"w\"}\n  return %y\n}"),
            "t.ir:2:49: error: group_size must be positive, got 0");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = sum(%x) {keepdim = maybe}\n  return %y\n}"),
            "t.ir:2:27: error: unexpected 'maybe' in the value of attribute 'keepdim'");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = sum(%x) {keepdim = }\n  return %y\n}"),
            "t.ir:2:27: error: expected a value for attribute 'keepdim', found '}'");
}

TEST(ParserErrors, BadDtype) {
  EXPECT_EQ(parse_error("graph @g(%x: f33[8]) { return }"), "t.ir:1:14: error: unknown dtype 'f33'");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = convert_element_type(%x) {dtype = float}\n"
                        "  return %y\n}"),
            "t.ir:2:42: error: unknown dtype 'float'");
  // A ':' with no type after it, at the end of its line.
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = neg(%x) :\n  return %y\n}"),
            "t.ir:3:3: error: expected a type such as f32[8,16], found 'return'");
}

TEST(ParserErrors, BadType) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[-1]) { return }"), "t.ir:1:18: error: negative dim -1 in type");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4611686018427387904, 4]) { return }"),
            "t.ir:1:14: error: value of type f32[4611686018427387904,4] is larger than 2^62 bytes");
  // A zero dim empties the value, but its other dims must still fit (else a stride or a
  // reduction's count, a product of some of them, would overflow).
  EXPECT_EQ(parse_error("graph @g(%x: f32[0, 4611686018427387904, 4]) { return }"),
            "t.ir:1:14: error: value of type f32[0,4611686018427387904,4] has nonzero dims that "
            "span more than 2^62 bytes");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4611686018427387904, 4, 0]) { return }"),
            "t.ir:1:14: error: value of type f32[4611686018427387904,4,0] has nonzero dims that "
            "span more than 2^62 bytes");
  EXPECT_EQ(parse_error("graph @g(%x: f32[0]) {\n  %v = view(%x) {shape = [0, "
                        "4611686018427387904, 4]}\n  return %v\n}"),
            "t.ir:2:8: error: %v: view: shape [0,4611686018427387904,4] is invalid for input of "
            "size 0");
  EXPECT_EQ(parse_error("graph @g(%x: f32) { return }"),
            "t.ir:1:17: error: expected '[' after the dtype, found ')'");
}

TEST(ParserErrors, UndefinedValue) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = add(%x, %z)\n  return %y\n}"),
            "t.ir:2:16: error: use of undefined value %z");
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  return %q\n}"), "t.ir:2:10: error: use of undefined value %q");
}

TEST(ParserErrors, UseBeforeDefinition) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = neg(%z)\n  %z = neg(%x)\n  return %y\n}"),
            "t.ir:2:12: error: use of value %z before its definition at 3:3");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %y = neg(%p#0)\n  %p:2 = split_with_sizes(%x) "
                        "{split_sizes = [2, 2]}\n  return %y\n}"),
            "t.ir:2:12: error: use of value %p before its definition at 3:3");
  // A value of the same name in a later graph is not a later definition.
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = neg(%z)\n  return %y\n}\n"
                        "graph @h(%x: f32[2]) {\n  %z = neg(%x)\n  return %z\n}"),
            "t.ir:2:12: error: use of undefined value %z");
}

TEST(ParserErrors, Redefinition) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %x = neg(%x)\n  return %x\n}"),
            "t.ir:2:3: error: redefinition of value %x (first defined at 1:10)");
  EXPECT_EQ(parse_error("graph @g(%x: f32[2], %x: f32[2]) { return }"),
            "t.ir:1:22: error: redefinition of value %x (first defined at 1:10)");
  EXPECT_EQ(parse_error("graph @g() { return }\ngraph @g() { return }"),
            "t.ir:2:7: error: redefinition of graph @g (first defined at 1:1)");
}

TEST(ParserErrors, ResultReferences) {
  const std::string split = "graph @g(%x: f32[4]) {\n  %p:2 = split_with_sizes(%x) {split_sizes = [2, 2]}\n";
  EXPECT_EQ(parse_error(split + "  return %p\n}"),
            "t.ir:3:10: error: %p has 2 result(s); refer to one as %p#0 to %p#1");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %p:1 = split_with_sizes(%x) {split_sizes = [4]}\n"
                        "  return %p\n}"),
            "t.ir:3:10: error: %p has 1 result; refer to it as %p#0");
  EXPECT_EQ(parse_error(split + "  return %p#2\n}"),
            "t.ir:3:10: error: %p#2 does not exist: %p has 2 result(s)");
  EXPECT_EQ(parse_error(split + "  %q = neg(%x)\n  return %q#0\n}"),
            "t.ir:4:10: error: %q has a single result; refer to it as %q");
  EXPECT_EQ(parse_error(split + "  return %x#0\n}"),
            "t.ir:3:10: error: %x is a graph input; it has no results to index");
  EXPECT_EQ(parse_error(split + "  %q#1 = neg(%x)\n  return\n}"),
            "t.ir:3:3: error: a definition cannot name a result ('%q#1'); write '%q' or '%q:k'");
  EXPECT_EQ(parse_error(split + "  return %p#99999999999\n}"), "t.ir:3:12: error: result index 99999999999 is out of range");
  EXPECT_EQ(parse_error(split + "  return %p#\n}"), "t.ir:3:12: error: expected a result index after '#'");
}

TEST(ParserErrors, ResultCount) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %p:3 = split_with_sizes(%x) {split_sizes = [2, 2]}\n"
                        "  return\n}"),
            "t.ir:2:6: error: %p declares 3 result(s) but split_with_sizes produces 2");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %p:1 = neg(%x)\n  return\n}"),
            "t.ir:2:6: error: neg has a single result; write %p without ':1'");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %p:0 = neg(%x)\n  return\n}"),
            "t.ir:2:6: error: result count must be positive, got 0");
}

TEST(ParserErrors, OperandCount) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[2]) {\n  %y = add(%x)\n  return %y\n}"),
            "t.ir:2:8: error: add expects 2 operands, got 1");
  EXPECT_EQ(parse_error("graph @g() {\n  %y = cat() {dim = 0}\n  return %y\n}"),
            "t.ir:2:8: error: cat expects at least 1 operand, got 0");
}

TEST(ParserErrors, TypeMismatch) {
  EXPECT_EQ(parse_error("graph @g(%w: f32[4,16]) {\n  %ag = all_gather_into_tensor(%w) {group_size = 4, "
                        "group = \"world\"} : f32[4,16]\n  return %ag\n}"),
            "t.ir:2:72: error: type f32[4,16] of %ag does not match its inferred type f32[16,16]");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %p:2 = split_with_sizes(%x) {split_sizes = [1, 3]} : "
                        "f32[1], f32[1]\n  return\n}"),
            "t.ir:2:64: error: type f32[1] of %p#1 does not match its inferred type f32[3]");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %p:2 = split_with_sizes(%x) {split_sizes = [1, 3]} : "
                        "f32[1]\n  return\n}"),
            "t.ir:2:56: error: expected 2 result types, found 1");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %y = neg(%x) : f32[4], f32[4]\n  return\n}"),
            "t.ir:2:26: error: too many result types: neg produces 1 result(s)");
}

TEST(ParserErrors, ShapeInference) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[6]) {\n  %y = reduce_scatter_tensor(%x) {reduce_op = \"sum\", "
                        "group_size = 4, group = \"w\"}\n  return %y\n}"),
            "t.ir:2:8: error: %y: reduce_scatter_tensor: input dim 0 (6) is not a multiple of "
            "group_size 4");
  EXPECT_EQ(parse_error("graph @g(%x: f32[6], %y: f32[5]) {\n  %z = add(%x, %y)\n  return %z\n}"),
            "t.ir:2:8: error: %z: add: operand shapes differ: [6] and [5]");
}

TEST(ParserErrors, IntegerOverflow) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = broadcast(%x) {src = 1180591620717411303424, "
                        "group = \"w\"}\n  return %y\n}"),
            "t.ir:2:29: error: integer literal 1180591620717411303424 does not fit in 64 bits");
  EXPECT_EQ(parse_error("graph @g(%x: f32[9223372036854775808]) { return }"),
            "t.ir:1:18: error: integer literal 9223372036854775808 does not fit in 64 bits");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = broadcast(%x) {src = 1e999, group = \"w\"}\n}"),
            "t.ir:2:29: error: float literal 1e999 is out of range");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = broadcast(%x) {src = 12ab, group = \"w\"}\n}"),
            "t.ir:2:29: error: invalid number '12ab'");
}

TEST(ParserErrors, UnterminatedString) {
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = broadcast(%x) {src = 0, group = \"world}\n}"),
            "t.ir:2:40: error: unterminated string");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = broadcast(%x) {src = 0, group = \"wo"),
            "t.ir:2:40: error: unterminated string");
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = broadcast(%x) {src = 0, group = \"a\\q\"}\n}"),
            "t.ir:2:42: error: invalid escape '\\q' in string");
}

TEST(ParserErrors, NestingTooDeep) {
  std::string deep(40, '[');
  EXPECT_EQ(parse_error("graph @g(%x: f32[8]) {\n  %y = sum(%x) {dims = " + deep),
            "t.ir:2:56: error: attribute lists nest deeper than 32 levels");
}

// The whole file, to the byte, up to the limit; one byte more (or an endless stream) is an
// error, never a silently cut prefix.
TEST(ReadTextFile, ReadsUpToTheLimitAndNoFurther) {
  const std::string path = ::testing::TempDir() + "read_text_file_test.ir";
  std::string bytes(3 << 20, 'x');  // more than one read block
  bytes[0] = '\0';
  bytes.back() = 'y';
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), f), bytes.size());
    std::fclose(f);
  }
  EXPECT_EQ(read_text_file(path), bytes);
  EXPECT_EQ(read_text_file(path, bytes.size()), bytes);
  try {
    read_text_file(path, bytes.size() - 1);
    ADD_FAILURE() << "a file over the limit was read";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot read " + path + ": it holds more than " + std::to_string(bytes.size() - 1) +
                  " bytes");
  }
  std::remove(path.c_str());
  EXPECT_THROW(
      {
        try {
          read_text_file("/dev/zero", 5 << 20);
        } catch (const InvalidArgument& e) {
          EXPECT_STREQ(e.what(), "cannot read /dev/zero: it holds more than 5242880 bytes");
          throw;
        }
      },
      InvalidArgument);
}

}  // namespace
}  // namespace funcol
