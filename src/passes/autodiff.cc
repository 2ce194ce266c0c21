// The autodiff pass: copies the forward graph and appends its backward (graph/backward.h).
#include "funcol/passes/autodiff.h"

#include <algorithm>
#include <memory>
#include <unordered_map>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "funcol/graph/backward.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/dce.h"
#include "number.h"

namespace funcol {

namespace {

// A copy of `g`: same names, inputs, nodes (in order), attributes, types and outputs.
Graph copy_graph(const Graph& g) {
  Graph out(g.name());
  out.set_source(g.source_file(), g.loc());
  std::unordered_map<const Value*, Value*> map;  // looked up only
  for (Value* in : g.inputs()) map.emplace(in, out.add_input(in->name(), in->type(), in->loc()));
  for (const Node& n : g.nodes()) {
    std::vector<Value*> operands;
    operands.reserve(n.num_operands());
    for (const Value* v : n.operands()) operands.push_back(map.at(v));
    std::vector<Type> types;
    for (size_t r = 0; r < n.num_results(); ++r) types.push_back(n.result(r)->type());
    Node* c = out.append_checked_node(n.op(), std::move(operands),
                                      std::vector<Attr>(n.attr_values().begin(),
                                                        n.attr_values().end()),
                                      std::move(types), n.name(), n.loc());
    for (size_t r = 0; r < n.num_results(); ++r) map.emplace(n.result(r), c->result(r));
  }
  std::vector<Value*> outputs;
  for (const Value* v : g.outputs()) outputs.push_back(map.at(v));
  out.set_outputs(std::move(outputs));
  return out;
}

// Throws InvalidArgument(message); for a graph parsed from text, located at `loc` (a value's
// definition, or the graph's header for the graph as a whole), so that `funcol opt` prints
// FILE:LINE:COL as for the errors about one node.
[[noreturn]] void throw_in_graph(const Graph& graph, SourceLoc loc, const std::string& message) {
  if (loc.known()) {
    const std::string& file = graph.source_file();
    throw LocatedError<InvalidArgument>(message, file.empty() ? "<input>" : file,
                                        static_cast<int>(loc.line), static_cast<int>(loc.col),
                                        message);
  }
  throw InvalidArgument(message);
}

SourceLoc definition_of(const Value& v) { return v.node() ? v.node()->loc() : v.loc(); }

}  // namespace

std::vector<int> floating_inputs(const Graph& graph) {
  std::vector<int> out;
  for (size_t i = 0; i < graph.num_inputs(); ++i) {
    if (is_floating(graph.input(i)->dtype())) out.push_back(static_cast<int>(i));
  }
  return out;
}

void make_joint_graph(Graph& graph, const std::vector<int>& wrt) {
  if (graph.outputs().empty()) {
    throw_in_graph(graph, graph.loc(),
                   fmt::format("autodiff: graph @{} has no outputs (the first output is the loss)",
                               graph.name()));
  }
  Value* loss = graph.outputs()[0];
  if (!is_loss_type(loss->type())) {
    throw_in_graph(graph, definition_of(*loss),
                   fmt::format("autodiff: the loss (first output {} of graph @{}) must be a "
                               "scalar of a floating dtype, got {}",
                               loss->ref(), graph.name(), loss->type().str()));
  }
  std::vector<Value*> values;
  std::vector<bool> listed(graph.num_inputs(), false);  // a k^2 scan took 9.7 s for 160,000
  for (size_t k = 0; k < wrt.size(); ++k) {
    const int i = wrt[k];
    if (i < 0 || static_cast<size_t>(i) >= graph.num_inputs()) {
      throw_in_graph(graph, graph.loc(),
                     fmt::format("autodiff: wrt index {} is out of range (graph @{} has {} "
                                 "inputs)",
                                 i, graph.name(), graph.num_inputs()));
    }
    if (listed[static_cast<size_t>(i)]) {
      throw_in_graph(graph, graph.loc(), fmt::format("autodiff: wrt index {} is repeated", i));
    }
    listed[static_cast<size_t>(i)] = true;
    Value* v = graph.input(static_cast<size_t>(i));
    if (!is_floating(v->dtype())) {
      throw_in_graph(graph, v->loc(),
                     fmt::format("autodiff: input {} ({}) has dtype {}; only floating inputs "
                                 "have gradients",
                                 i, v->ref(), dtype_name(v->dtype())));
    }
    values.push_back(v);
  }
  std::vector<Value*> grads = append_backward(graph, loss, values);
  Builder b(graph);
  std::vector<Value*> outputs{loss};
  for (size_t k = 0; k < grads.size(); ++k) {
    if (!grads[k]) {
      b.set_name_hint("d_" + values[k]->name());
      std::vector<int64_t> shape(values[k]->shape().begin(), values[k]->shape().end());
      grads[k] = b.value("zeros", {}, {{"shape", shape}, {"dtype", values[k]->dtype()}});
    }
    outputs.push_back(grads[k]);
  }
  graph.set_outputs(std::move(outputs));
  eliminate_dead_code(graph);
}

Graph build_joint_graph(const Graph& forward, const std::vector<int>& wrt) {
  Graph joint = copy_graph(forward);
  make_joint_graph(joint, wrt);
  verify(joint);
  return joint;
}

bool AutodiffPass::run(Graph& graph) {
  make_joint_graph(graph, all_floating_ && wrt_.empty() ? floating_inputs(graph) : wrt_);
  return true;
}

std::unique_ptr<Pass> make_autodiff_pass(const PassOptions& options) {
  const std::string* text = options.find("wrt");
  if (!text) return std::make_unique<AutodiffPass>();
  std::vector<int> wrt;
  size_t pos = 0;
  while (true) {
    const size_t end = std::min(text->find(':', pos), text->size());
    const std::string_view part = std::string_view(*text).substr(pos, end - pos);
    const auto [value, whole, ec] = parse_whole_number<int>(part);
    if (!whole || ec != std::errc() || value < 0) {
      throw InvalidArgument(fmt::format("option wrt of pass autodiff must be a colon list of "
                                        "input indices, got '{}'",
                                        *text));
    }
    wrt.push_back(value);
    if (end == text->size()) break;
    pos = end + 1;
  }
  return std::make_unique<AutodiffPass>(std::move(wrt), false);
}

}  // namespace funcol
