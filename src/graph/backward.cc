// Reverse-mode differentiation over the op table's gradient rules (see backward.h).
#include "funcol/graph/backward.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "ops_table.h"

namespace funcol {

bool is_loss_type(const Type& type) { return type.numel() == 1 && is_floating(type.dtype); }

namespace {

std::string unreached_message(const Value* v) {
  return fmt::format(
      "autodiff: {} reaches the loss only through ops with no gradient, so its gradient would "
      "be zero",
      v->ref());
}

// Throws when a path from a floating `wrt` value to the loss stops at a view_dtype of a floating
// value, whether or not the value has a gradient through another path: a bit reinterpretation is
// how a pass packs buffers (bucket-all-gather's multidtype mode), not a user's way to stop a
// gradient, so the gradient lost there (all of it, or the part that path carries) would be
// silently wrong. Also throws, as PyTorch's backward does (the loss "does not require grad"),
// when no `wrt` value got a gradient although the loss depends on a floating one, naming the
// first op on its path where the gradient stops: a result with a gradient over an operand
// without one, or a floating operand cast to a non-floating result. Otherwise the values whose
// paths all stop at such casts get none (zeros), as PyTorch leaves their .grad None.
// `order[0, end)` are the nodes up to the loss's; `grads` holds every gradient built.
void check_reached_differentiably(const std::vector<Node*>& order, size_t end, const Value* loss,
                                  std::span<Value* const> wrt, const std::vector<Value*>& out,
                                  const std::unordered_map<const Value*, Value*>& grads) {
  bool any_with = false;
  bool any_without = false;  // a floating input without a gradient
  for (size_t i = 0; i < wrt.size(); ++i) {
    if (out[i]) {
      any_with = true;
    } else {
      any_without |= is_floating(wrt[i]->dtype()) && wrt[i] != loss;
    }
  }
  const auto reinterprets = [](const Node* n) {
    return n->op_name() == "view_dtype" && is_floating(n->operand(0)->dtype());
  };
  if (any_with ? std::none_of(order.begin(), order.begin() + static_cast<ptrdiff_t>(end),
                              reinterprets)
               : !any_without) {
    return;
  }
  // What the loss depends on, any dtype (a coalesced op's result i depends on operand i alone).
  std::unordered_set<const Value*> ancestors{loss};
  for (size_t k = end; k-- > 0;) {
    const Node* n = order[k];
    const bool per_operand = n->op().results == ResultArity::PerOperand;
    for (size_t r = 0; r < n->num_results(); ++r) {
      if (!ancestors.count(n->result(r))) continue;
      if (per_operand) {
        ancestors.insert(n->operand(r));
      } else {
        for (const Value* v : n->operands()) ancestors.insert(v);
      }
    }
  }
  // The floating inputs that the loss depends on (an input with no elements has no gradient to
  // lose): with no gradient anywhere, the first one, whose path says where the gradient stops;
  // else all of them, whose paths are followed to any view_dtype.
  std::vector<const Value*> seeds;
  std::unordered_set<const Value*> with_gradient;  // the seeds that got one; looked up only
  for (size_t i = 0; i < wrt.size(); ++i) {
    const Value* v = wrt[i];
    if (!is_floating(v->dtype()) || !ancestors.count(v) || v == loss) continue;
    if (v->type().numel() == 0) continue;
    seeds.push_back(v);
    if (out[i]) with_gradient.insert(v);
    if (!any_with) break;
  }
  // Follows the seeds' paths forward in one pass (a pass per input was quadratic: 16,000
  // inputs that reach the loss through casts to i32 took 18.5 s), each reached value
  // remembering the seed it came from. With no gradient anywhere, the paths are those without
  // gradients and every stop is an error; else the paths through floating values (those a
  // gradient can take), and only a floating view_dtype is.
  std::unordered_map<const Value*, const Value*> reached;  // value -> its seed; looked up only
  for (const Value* v : seeds) reached.emplace(v, v);
  for (size_t k = 0; k < end && !seeds.empty(); ++k) {
    const Node* n = order[k];
    const bool per_operand = n->op().results == ResultArity::PerOperand;
    for (size_t j = 0; j < n->num_results(); ++j) {
      const Value* from = nullptr;  // a reached operand of result j
      for (size_t o = 0; o < n->num_operands(); ++o) {
        const Value* x = n->operand(o);
        if ((per_operand && o != j) || !reached.count(x) ||
            (any_with ? !is_floating(x->dtype()) : grads.count(x) != 0)) {
          continue;
        }
        if (!from || is_floating(x->dtype())) from = x;
      }
      if (!from) continue;
      const Value* r = n->result(j);
      const Value* seed = reached.at(from);
      reached.emplace(r, seed);
      const bool stops = grads.count(r) != 0 || (is_floating(from->dtype()) &&
                                                 !is_floating(r->dtype()) && ancestors.count(r));
      if (!stops) continue;
      const bool reinterpreted = n->op_name() == "view_dtype" && is_floating(from->dtype());
      if (any_with && !reinterpreted) continue;  // zeros, as PyTorch
      detail::throw_grad_error(*n, [&](const std::string& where) {
        const std::string stop = fmt::format("{} of {} to {} ({})", n->op_name(),
                                             dtype_name(from->dtype()), dtype_name(r->dtype()),
                                             where);
        const std::string packing =
            reinterpreted ? "; bucket-all-gather{mode=multidtype} packs bytes this way: run "
                            "autodiff before it"
                          : "";
        if (with_gradient.count(seed)) {
          return fmt::format("autodiff: a path from {} to the loss stops at {}, so the part of "
                             "its gradient that path carries would be lost{}",
                             seed->ref(), stop, packing);
        }
        return fmt::format("{}: it stops at {}{}", unreached_message(seed), stop, packing);
      });
    }
  }
  if (!any_with && !seeds.empty()) throw InvalidArgument(unreached_message(seeds[0]));
}

// append_backward without the clean-up on failure.
std::vector<Value*> append_backward_nodes(Graph& graph, Value* loss, std::span<Value* const> wrt,
                                          const MadeBy& made_by) {
  FUNCOL_CHECK(loss != nullptr, "append_backward: null loss");
  if (!is_loss_type(loss->type())) {
    throw InvalidArgument(fmt::format("autodiff: the loss {} must be a scalar of a floating "
                                      "dtype, got {}",
                                      loss->ref(), loss->type().str()));
  }
  // Values that depend on some `wrt` value through floating values: only they need gradients.
  std::unordered_set<const Value*> needs;
  for (Value* v : wrt) {
    if (is_floating(v->dtype())) needs.insert(v);
  }
  const std::vector<Node*> order = graph.node_list();
  for (Node* n : order) {
    // Every floating result of a node with an operand that needs one, coalesced collectives
    // included (as PyTorch's one autograd node for them): their backward is one collective
    // over every result, which each rank must issue whichever result its own loss uses (an
    // eager tape's loss is the rank's own), and a result whose operand needs no gradient
    // still carries the peers' gradients into the other operands.
    bool any = false;
    for (const Value* v : n->operands()) any |= needs.count(v) != 0;
    if (!any) continue;
    for (size_t r = 0; r < n->num_results(); ++r) {
      if (is_floating(n->result(r)->dtype())) needs.insert(n->result(r));
    }
  }

  Builder b(graph);
  std::unordered_map<const Value*, Value*> grads;
  std::unordered_map<const Node*, const Node*> made_by_node;  // looked up only
  auto accumulate = [&](Value* v, Value* g) {
    FUNCOL_CHECK(g->type() == v->type(),
                 fmt::format("autodiff: gradient of {} has type {}, expected {}", v->ref(),
                             g->type().str(), v->type().str()));
    auto [it, fresh] = grads.emplace(v, g);
    if (!fresh) it->second = b.value("add", {it->second, g});
  };
  b.set_name_hint("d_" + (loss->node() ? loss->node()->name() : loss->name()));
  if (needs.count(loss)) {
    accumulate(loss, b.value("full", {}, {{"shape", loss->shape()},
                                         {"dtype", loss->dtype()},
                                         {"value", 1.0}}));
  }

  // Walk back from the loss's node: nothing after it reaches the loss.
  size_t end = order.size();
  if (!loss->is_input()) {
    while (end > 0 && order[end - 1] != loss->node()) --end;
  } else {
    end = 0;
  }
  for (size_t k = end; k-- > 0;) {
    Node* n = order[k];
    const OpDef& op = n->op();
    std::vector<Value*> result_grads(n->num_results(), nullptr);
    bool any_result = false;
    for (size_t r = 0; r < n->num_results(); ++r) {
      auto it = grads.find(n->result(r));
      if (it == grads.end()) continue;
      result_grads[r] = it->second;
      any_result = true;
    }
    if (!any_result) continue;
    bool any_operand = false;
    for (const Value* v : n->operands()) any_operand |= needs.count(v) != 0;
    if (!any_operand) continue;
    if (!op.grad) {
      detail::throw_grad_error(*n, [&](const std::string& where) {
        // The packed ops exist only in bucketed graphs, which PyTorch never differentiates
        // either (Inductor buckets after autograd).
        const bool packed = op.name == "bucket_pack" || op.name == "all_gather_into_tensor_packed";
        return fmt::format("autodiff: op {} has no gradient rule ({}){}", op.name, where,
                           packed ? ": run autodiff before the bucketing passes" : "");
      });
    }
    b.set_name_hint("d_" + n->name());
    Node* before = graph.last_node();
    const std::vector<Value*> operand_grads = op.grad(b, *n, result_grads);
    if (made_by) {
      for (Node* m = before ? before->next() : graph.first_node(); m; m = m->next()) {
        made_by_node.emplace(m, n);
      }
    }
    FUNCOL_CHECK(operand_grads.size() == n->num_operands(),
                 fmt::format("autodiff: gradient rule of {} returned {} gradients for {} operands",
                             op.name, operand_grads.size(), n->num_operands()));
    for (size_t i = 0; i < operand_grads.size(); ++i) {
      Value* v = n->operand(i);
      if (operand_grads[i] && needs.count(v)) accumulate(v, operand_grads[i]);
    }
  }

  std::vector<Value*> out;
  out.reserve(wrt.size());
  for (Value* v : wrt) {
    auto it = grads.find(v);
    out.push_back(it == grads.end() ? nullptr : it->second);
  }
  check_reached_differentiably(order, end, loss, wrt, out, grads);
  // Rules emit gradients for every operand; drop the appended nodes nothing uses (gradients of
  // operands that need none), never collectives or waits, nor the returned gradients.
  const Node* forward_last = order.empty() ? nullptr : order.back();
  std::unordered_set<const Node*> kept;
  for (const Value* v : out) {
    if (v && v->node()) kept.insert(v->node());
  }
  for (Node* n = graph.last_node(); n && n != forward_last;) {
    Node* prev = n->prev();
    if (!n->op().has_side_effect && !n->has_uses() && !kept.count(n)) graph.erase(n);
    n = prev;
  }
  if (made_by) {
    for (const Node* m = forward_last ? forward_last->next() : graph.first_node(); m;
         m = m->next()) {
      auto it = made_by_node.find(m);
      if (it != made_by_node.end()) made_by(*it->second, *m);
    }
  }
  return out;
}

}  // namespace

std::vector<Value*> append_backward(Graph& graph, Value* loss, std::span<Value* const> wrt,
                                    const MadeBy& made_by) {
  Node* last = graph.last_node();
  try {
    return append_backward_nodes(graph, loss, wrt, made_by);
  } catch (...) {
    erase_nodes_after(graph, last);
    throw;
  }
}

void erase_nodes_after(Graph& graph, Node* last) {
  while (graph.last_node() && graph.last_node() != last) graph.erase(graph.last_node());
}

}  // namespace funcol
