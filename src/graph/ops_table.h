// Private: builds the op table (ops_table.cc) that ops.cc serves.
#pragma once

#include <vector>

#include "funcol/graph/ops.h"

namespace funcol::detail {

// Every op of DESIGN §5, in the order of its table.
std::vector<OpDef> build_op_table();

// Appends the packing ops of the bucketing passes' custom_ops modes (ops_bucketing.cc).
void add_bucketing_ops(std::vector<OpDef>& table);

// Sets the gradient rule (OpDef::grad) of every differentiable op of `table` (ops_grad.cc).
void add_grad_rules(std::vector<OpDef>& table);

}  // namespace funcol::detail
