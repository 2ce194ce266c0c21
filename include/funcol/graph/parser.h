// Parser of the IR text format (DESIGN §5): errors are ParseError "FILE:LINE:COL: error: ...".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "funcol/core/error.h"
#include "funcol/graph/graph.h"

namespace funcol {

struct ParseOptions {
  // Shown in error messages and kept as Graph::source_file().
  std::string file = "<input>";
  // Line number of the text's first line (a case cut from a larger file keeps its lines).
  uint32_t first_line = 1;
};

// Deepest nesting of attribute lists the parser accepts (deeper input is an error, so no input
// can exhaust the stack anywhere: parsing, printing, comparing or destroying attributes).
inline constexpr int kMaxAttrListDepth = 32;

// Parses every graph of `text`. Infers every node's result types and checks them against the
// types written after ':' (optional). Throws ParseError for every malformed input: syntax,
// unknown op or attribute, missing or ill-typed attribute, undefined, redefined or
// used-before-defined value, operand count, result count or type mismatch, bad dtype, integer
// out of range, unterminated string, nesting deeper than kMaxAttrListDepth. An empty text is
// a module of zero graphs.
Module parse_module(std::string_view text, const ParseOptions& options = {});

// Parses a text that must hold exactly one graph.
std::unique_ptr<Graph> parse_graph(std::string_view text, const ParseOptions& options = {});

// "FILE:LINE:1: error: expected a graph (...): the input holds none": for a command given a
// text of no graph (comments only, or nothing).
ParseError no_graph_error(const std::string& file, size_t line = 1);

// Reads and parses `path` ("-": standard input). Throws InvalidArgument when it cannot be read.
Module parse_file(const std::string& path);

// The most read_text_file reads by default: 256 MiB (bench/gen_hoisted.sh's graph of 50,000
// all_gathers per input, 100,000 collectives and their waits, takes 14 MB).
inline constexpr size_t kMaxTextFileBytes = size_t{256} << 20;

// Reads `path` ("-": standard input) into a string; throws InvalidArgument
// "cannot read FILE: reason", also when it holds more than `max_bytes` (so an endless stream
// such as /dev/zero ends with an error).
std::string read_text_file(const std::string& path, size_t max_bytes = kMaxTextFileBytes);

}  // namespace funcol
