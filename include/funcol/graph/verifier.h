// The IR verifier: checks the invariants every pass must keep.
#pragma once

#include "funcol/graph/graph.h"

namespace funcol {

// Checks that `graph` is well formed: unique valid names, SSA with every operand defined
// before its use in this graph, operand counts, every attribute present and of its schema's
// kind, result types equal to shape inference, outputs defined, use-lists consistent with
// operands and outputs. Throws InvalidArgument (ShapeError when shape inference itself
// fails) naming the graph, the node and, when known, its source location:
// "graph @g: node %y (matmul, f.ir:4:3): result type f32[8,8] does not match inferred f32[8,16]".
void verify(const Graph& graph);
void verify(const Module& module);

}  // namespace funcol
