// Deterministic printer of the IR text format, and a Graphviz (dot) export.
#pragma once

#include <string>

#include "funcol/graph/graph.h"

namespace funcol {

// The IR text of a graph: `graph @name(%x: f32[8]) {`, one node per line as
// `  %name = op(args) {attrs} : types` with attributes in the op table's order, then
// `  return ...` and `}`. parse(print(g)) is structurally equal to g.
std::string print(const Graph& graph);
// Every graph of the module, separated by one blank line.
std::string print(const Module& module);
// Appends the text of `graph` to `out` (no allocation per node beyond `out`'s growth).
void print_to(const Graph& graph, std::string& out);

// "f32[8,16]".
void print_type(const Type& type, std::string& out);
// `4`, `1.5`, `"world"` (escaped), `true`, `bf16`, `[4, 4]`.
void print_attr(const Attr& attr, std::string& out);
// A string literal with '"', '\\' and non-printable bytes escaped (\n \t \xHH).
void print_string_literal(std::string_view text, std::string& out);

// Graphviz: one `digraph` per graph; inputs are ellipses, collectives are highlighted boxes,
// edges go from each value's producer to its users and to the `return` node.
std::string to_dot(const Graph& graph);
std::string to_dot(const Module& module);

}  // namespace funcol
