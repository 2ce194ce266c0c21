// Reverse-mode differentiation of a graph through the op table's gradient rules (OpDef::grad):
// the one routine the autodiff pass and the eager autograd tape share.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "funcol/graph/graph.h"

namespace funcol {

// Appends to the end of `graph` the nodes computing d loss / d v for every v of `wrt`, walking
// the nodes that lead to `loss` in reverse program order and applying each op's gradient rule
// (a value used several times sums its gradients with `add`). `loss` must be a scalar of a
// floating dtype (is_loss_type; InvalidArgument otherwise); its gradient is seeded with
// `full(1)` of its shape. Returns one
// gradient per entry of `wrt`, null where the loss does not depend on it (or it is not
// floating). Throws InvalidArgument naming the node when an op on the way has no gradient rule
// or its rule refuses (a non-sum all_reduce / reduce_scatter, broadcast), and then leaves the
// graph as it was (the nodes appended before the error are erased).
// Deterministic: program order only; maps keyed by pointer are looked up, never iterated.
// `made_by`, when given, is called once for every appended node that a gradient rule made and
// that was kept, in program order, with the forward node whose rule made it (the eager tape
// checks the values each rule reads against their versions when that node was recorded).
using MadeBy = std::function<void(const Node& forward, const Node& made)>;
std::vector<Value*> append_backward(Graph& graph, Value* loss, std::span<Value* const> wrt,
                                    const MadeBy& made_by = {});

// A loss append_backward accepts: one element (f32[] or, as PyTorch's backward accepts any
// single-element output, f32[1], f32[1, 1], ...) of a floating dtype.
bool is_loss_type(const Type& type);

// Erases every node after `last` (null: every node), last first, so that an append_backward
// that failed or whose results were consumed leaves the graph as it was. None of those nodes'
// results may be a graph output or used at or before `last` (FUNCOL_CHECK).
void erase_nodes_after(Graph& graph, Node* last);

}  // namespace funcol
