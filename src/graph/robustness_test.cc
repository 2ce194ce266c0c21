// Bad and huge inputs: truncated files, binary garbage, huge integers, deep nesting, 1M nodes.
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "test_ir.h"

namespace funcol {
namespace {

using testing_ir::parse_error;

// Parses `text`; on success the graph must verify, print and parse back equal. On failure the
// error must be a ParseError whose location lies inside the text (line and column >= 1).
void check_parses_or_fails_cleanly(std::string_view text) {
  Module m;
  try {
    m = parse_module(text, ParseOptions{.file = "t.ir"});
  } catch (const ParseError& e) {
    EXPECT_GE(e.line(), 1);
    EXPECT_GE(e.col(), 1);
    EXPECT_EQ(std::string(e.what()).rfind("t.ir:", 0), 0u);
    return;
  }
  verify(m);
  const std::string printed = print(m);
  Module again = parse_module(printed);
  std::string why;
  ASSERT_TRUE(structurally_equal(m, again, &why)) << why << "\n" << text;
  EXPECT_EQ(print(again), printed);
}

TEST(Robustness, EveryPrefixOfAValidFile) {
  const std::string text(testing_ir::kEveryOp);
  for (size_t n = 0; n <= text.size(); ++n) check_parses_or_fails_cleanly(text.substr(0, n));
}

TEST(Robustness, RandomBinaryGarbage) {
  std::mt19937_64 rng(1234);
  for (int i = 0; i < 3000; ++i) {
    std::string text(rng() % 300, '\0');
    for (char& c : text) c = static_cast<char>(rng());
    check_parses_or_fails_cleanly(text);
  }
}

TEST(Robustness, MutatedValidFiles) {
  // Byte flips, insertions and deletions of IR-ish characters in a valid file: most mutants
  // still lex, so this reaches deep into the parser and shape inference.
  const std::string base(testing_ir::kEveryOp);
  const std::string alphabet = "%@#:=(){}[],\"\\-0123456789.e xfi_\n/";
  std::mt19937_64 rng(99);
  for (int i = 0; i < 3000; ++i) {
    std::string text = base;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits && !text.empty(); ++k) {
      const size_t pos = rng() % text.size();
      const char c = alphabet[rng() % alphabet.size()];
      switch (rng() % 3) {
        case 0: text[pos] = c; break;
        case 1: text.insert(text.begin() + static_cast<std::ptrdiff_t>(pos), c); break;
        default: text.erase(pos, 1 + rng() % 8); break;
      }
    }
    check_parses_or_fails_cleanly(text);
  }
}

TEST(Robustness, HugeIntegers) {
  const std::string two_to_70 = "1180591620717411303424";
  EXPECT_EQ(parse_error("graph @g(%x: f32[" + two_to_70 + "]) { return }"),
            "t.ir:1:18: error: integer literal 1180591620717411303424 does not fit in 64 bits");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %y = view(%x) {shape = [-" + two_to_70 + "]}\n}"),
            "t.ir:2:27: error: integer literal -1180591620717411303424 does not fit in 64 bits");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %y:" + two_to_70 + " = neg(%x)\n}"),
            "t.ir:2:6: error: integer literal 1180591620717411303424 does not fit in 64 bits");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  return %x#" + two_to_70 + "\n}"),
            "t.ir:2:12: error: result index 1180591620717411303424 is out of range");
  // A megabyte of digits is one clear error, with the literal abbreviated.
  const std::string digits(1 << 20, '7');
  EXPECT_EQ(parse_error("graph @g(%x: f32[" + digits + "]) { return }"),
            "t.ir:1:18: error: integer literal " + std::string(40, '7') + "... does not fit in 64 bits");
  // Dims that fit in 64 bits but make a value larger than 2^62 bytes.
  EXPECT_EQ(parse_error("graph @g(%x: f64[4611686018427387903]) { return }"),
            "t.ir:1:14: error: value of type f64[4611686018427387903] is larger than 2^62 bytes");
  // Shape inference never overflows either.
  EXPECT_EQ(parse_error("graph @g(%x: u8[4611686018427387903]) {\n  %y = all_gather_into_tensor(%x) "
                        "{group_size = 2, group = \"w\"}\n  return %y\n}"),
            "t.ir:2:8: error: %y: all_gather_into_tensor: gathered dim 0 overflows: "
            "4611686018427387903 * 2 is more than 2^62");
}

// Names longer than 2^20 bytes are refused where they stand; messages show 64 bytes of one.
TEST(Robustness, LongNames) {
  const std::string longest((size_t{1} << 20), 'a');
  EXPECT_EQ(parse_error("graph @" + longest + "b(%x: f32[4]) {\n  return %x\n}"),
            "t.ir:1:7: error: graph names are at most 2^20 bytes long");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %" + longest + "b = neg(%x)\n  return %x\n}"),
            "t.ir:2:3: error: value names are at most 2^20 bytes long");
  EXPECT_EQ(parse_error("graph @" + longest + "(%x: f32[4]) {\n  return %x %x\n}"),
            "t.ir:2:13: error: expected '}' to close graph @" + std::string(64, 'a') +
                "..., found '%x'");
  EXPECT_THROW(Graph(longest + "b"), InvalidArgument);
}

TEST(Robustness, DeepNesting) {
  const std::string prefix = "graph @g(%x: f32[8]) {\n  %y = sum(%x) {dims = ";
  EXPECT_EQ(parse_error(prefix + std::string(100000, '[') + std::string(100000, ']') + "}\n}"),
            "t.ir:2:56: error: attribute lists nest deeper than 32 levels");
  // 32 levels are fine syntactically (the schema then rejects a nested list for `dims`).
  EXPECT_EQ(parse_error(prefix + std::string(32, '[') + std::string(32, ']') + "}\n}"),
            "t.ir:2:24: error: attribute 'dims' of sum must be a list of integers, got " +
                std::string(32, '[') + "]]]]]...");
  // Other brackets never nest in the grammar: the first unexpected one is the error.
  EXPECT_EQ(parse_error("graph @g" + std::string(100000, '(')),
            "t.ir:1:10: error: expected an input '%name: type', found '('");
  EXPECT_EQ(parse_error("graph @g() " + std::string(100000, '{')),
            "t.ir:1:13: error: expected a node ('%name = op(...)') or 'return', found '{'");
  EXPECT_EQ(parse_error("graph @g(%x: f32[4]) {\n  %y = neg(" + std::string(100000, '(')),
            "t.ir:2:12: error: expected a value '%name', found '('");
}

// A file of `n` nodes: chains of compute with an all_reduce + wait_tensor every 8 nodes.
std::string generate(size_t n) {
  std::string text = "graph @big(%x: f32[4,4], %w: f32[4,4]) {\n";
  text.reserve(n * 64);
  const auto line = [&](size_t i, std::string_view op, std::string_view rest) {
    text += "  %v";
    text += std::to_string(i);
    text += " = ";
    text += op;
    text += "(%";
    if (i == 0) {
      text += "x";
    } else {
      text += "v";
      text += std::to_string(i - 1);
    }
    text += rest;
    text += '\n';
  };
  for (size_t i = 0; i < n; ++i) {
    switch (i % 8) {
      case 0: line(i, "matmul", ", %w) : f32[4,4]"); break;
      case 1: line(i, "all_reduce", ") {reduce_op = \"sum\", group = \"world\"} : f32[4,4]"); break;
      case 2: line(i, "wait_tensor", ") : f32[4,4]"); break;
      case 3: line(i, "relu", ")"); break;
      case 4: line(i, "add", ", %x) : f32[4,4]"); break;
      case 5: line(i, "view", ") {shape = [16]} : f32[16]"); break;
      case 6: line(i, "reshape", ") {shape = [4, -1]} : f32[4,4]"); break;
      default: line(i, "neg", ") : f32[4,4]"); break;
    }
  }
  text += "  return %v" + std::to_string(n - 1) + "\n}\n";
  return text;
}

// Parses in seconds (bench/ir_bench measures speed; verify and print at scale are covered
// there). Under sanitizers this is the slowest unit test, hence its own binary and timeout.
TEST(Robustness, OneMillionNodes) {
  const size_t n = 1'000'000;
  std::string text = generate(n);
  {
    Module m = parse_module(text, ParseOptions{.file = "big.ir"});
    ASSERT_EQ(m.graphs().size(), 1u);
    const Graph& g = *m.graphs()[0];
    EXPECT_EQ(g.num_nodes(), n);
    EXPECT_EQ(g.last_node()->name(), "v999999");
    EXPECT_EQ(g.outputs()[0], g.last_node()->result());
    EXPECT_EQ(g.input(0)->num_uses(), n / 8 + 1);
  }
  // An error at the very end of a huge file is found and located.
  text.insert(text.rfind("  return"), "  %oops = neg(%nope)\n");
  EXPECT_EQ(parse_error(text), "t.ir:" + std::to_string(n + 2) + ":15: error: use of undefined value %nope");
}

}  // namespace
}  // namespace funcol
