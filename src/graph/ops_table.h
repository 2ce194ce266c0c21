// Private: builds the op table (ops_table.cc) that ops.cc serves.
#pragma once

#include <string>
#include <vector>

#include "funcol/graph/graph.h"
#include "funcol/graph/ops.h"

namespace funcol::detail {

// Every op of DESIGN §5, in the order of its table.
std::vector<OpDef> build_op_table();

// Appends the packing ops of the bucketing passes' custom_ops modes (ops_bucketing.cc).
void add_bucketing_ops(std::vector<OpDef>& table);

// Sets the gradient rule (OpDef::grad) of every differentiable op of `table` (ops_grad.cc).
void add_grad_rules(std::vector<OpDef>& table);

// "node %ar at FILE:LINE:COL" (just "node %ar" for a node not written in IR text, such as the
// eager tape's): how autodiff errors name the node they fail at (ops_grad.cc).
std::string grad_error_node(const Node& n);

// Throws the InvalidArgument `message(node)`, where node is grad_error_node(n) in what() and
// "node %ar" in the located message of a parsed node (see throw_at).
template <class MessageFn>
[[noreturn]] void throw_grad_error(const Node& n, MessageFn message) {
  throw_at<InvalidArgument>(n, message(grad_error_node(n)), message("node %" + n.name()));
}

}  // namespace funcol::detail
