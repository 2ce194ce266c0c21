// The IR verifier: SSA, order, schema and type invariants, checked in one linear walk.
#include "funcol/graph/verifier.h"

#include <optional>
#include <string_view>
#include <unordered_set>

#include <fmt/format.h>

#include "funcol/core/error.h"

namespace funcol {
namespace {

class Verifier {
 public:
  explicit Verifier(const Graph& g) : g_(g) {}

  void run() {
    check_inputs();
    check_nodes();
    check_outputs();
    check_use_lists();
  }

 private:
  const Graph& g_;
  size_t slots_ = 0;  // operand and output slots, to compare with the use-list entries
  std::vector<Type> in_types_;

  [[noreturn]] void fail(const std::string& message) const {
    throw InvalidArgument(fmt::format("graph @{}: {}", g_.name(), message));
  }

  // "node %x (op, FILE:LINE:COL)"; without the location in a located error's message.
  std::string where(const Node& n, bool with_location = true) const {
    const std::optional<SourceLocated> at = source_of(n, "");
    if (!at || !with_location) return fmt::format("node %{} ({})", n.name(), n.op_name());
    return fmt::format("node %{} ({}, {}:{}:{})", n.name(), n.op_name(), at->file(), at->line(),
                       at->col());
  }

  template <class E = InvalidArgument>
  [[noreturn]] void fail_at(const Node& n, const std::string& message) const {
    throw_at<E>(n, fmt::format("graph @{}: {}: {}", g_.name(), where(n), message),
                fmt::format("graph @{}: {}: {}", g_.name(), where(n, false), message));
  }

  bool is_own_input(const Value* v) const {
    return v->is_input() && v->index() < g_.num_inputs() && g_.input(v->index()) == v;
  }

  void check_inputs() const {
    for (size_t i = 0; i < g_.num_inputs(); ++i) {
      const Value* v = g_.input(i);
      if (v->index() != i) fail(fmt::format("input {} (%{}) has index {}", i, v->name(), v->index()));
      try {
        check_type(v->dtype(), v->shape(), "input %" + v->name());
      } catch (const ShapeError& e) {
        fail(e.what());
      }
    }
  }

  // Names need no check here: Graph gives out only valid, unique names and never renames.
  void check_nodes() {
    size_t count = 0;
    const Node* prev = nullptr;
    for (const Node& n : g_.nodes()) {
      ++count;
      if (n.graph() != &g_) fail_at(n, "belongs to another graph");
      if (n.prev() != prev) fail_at(n, "broken node list (prev link)");
      prev = &n;
      check_node(n);
    }
    if (count != g_.num_nodes()) {
      fail(fmt::format("node list holds {} nodes but the graph counts {}", count, g_.num_nodes()));
    }
    if (prev != g_.last_node()) fail("broken node list (last node)");
  }

  void check_operand(const Node& n, size_t i) {
    const Value* v = n.operand(i);
    if (!v) fail_at(n, fmt::format("operand {} is null", i));
    ++slots_;
    if (v->is_input()) {
      if (!is_own_input(v)) fail_at(n, fmt::format("operand {} is an input of another graph", i));
      return;
    }
    const Node* def = v->node();
    if (def->graph() != &g_) fail_at(n, fmt::format("operand {} ({}) is defined in another graph", i, v->ref()));
    if (def == &n || !def->is_before(n)) {
      fail_at(n, fmt::format("operand {} ({}) is used before its definition", i, v->ref()));
    }
  }

  void check_node(const Node& n) {
    const OpDef& op = n.op();
    try {
      op.check_operand_count(n.num_operands());
    } catch (const InvalidArgument& e) {
      fail_at(n, e.what());
    }
    for (size_t i = 0; i < n.num_operands(); ++i) check_operand(n, i);

    const auto attrs = n.attr_values();
    if (attrs.size() != op.attrs.size()) {
      fail_at(n, fmt::format("{} attribute slots for {} schema entries", attrs.size(), op.attrs.size()));
    }
    for (size_t i = 0; i < attrs.size(); ++i) {
      const AttrSpec& spec = op.attrs[i];
      if (!attrs[i].has_value()) fail_at(n, fmt::format("attribute '{}' is missing", spec.name));
      const bool kept = spec.keeps_exact && (attrs[i].kind() == AttrKind::Int ||
                                             attrs[i].kind() == AttrKind::Bool);
      if (attrs[i].kind() != spec.kind && !kept) {
        fail_at(n, fmt::format("attribute '{}' must be {}, got {}", spec.name, spec.description(),
                               attrs[i].str()));
      }
      if (spec.canonicalize) {
        Attr copy = attrs[i];
        try {
          spec.canonicalize(copy);
        } catch (const Error& e) {
          fail_at(n, fmt::format("attribute '{}': {}", spec.name, e.what()));
        }
        if (!(copy == attrs[i])) {
          fail_at(n, fmt::format("attribute '{}' is {} but should be written {}", spec.name,
                                 attrs[i].str(), copy.str()));
        }
      }
    }

    in_types_.resize(n.num_operands());  // scratch shapes keep their capacity across nodes
    for (size_t i = 0; i < n.num_operands(); ++i) {
      in_types_[i].dtype = n.operand(i)->dtype();
      in_types_[i].shape.assign(n.operand(i)->shape().begin(), n.operand(i)->shape().end());
    }
    std::vector<Type> types;
    try {
      types = infer_types(op, in_types_, attrs);
    } catch (const ShapeError& e) {
      fail_at<ShapeError>(n, e.what());
    } catch (const Error& e) {
      fail_at(n, e.what());
    }
    if (types.size() != n.num_results()) {
      fail_at(n, fmt::format("has {} results but {} produces {}", n.num_results(), op.name, types.size()));
    }
    for (size_t i = 0; i < types.size(); ++i) {
      const Value* r = n.result(i);
      if (r->node() != &n || r->index() != i) fail_at(n, fmt::format("result {} has a broken owner link", i));
      if (r->type() != types[i]) {
        fail_at(n, fmt::format("result type {} of {} does not match inferred {}", r->type().str(),
                               r->ref(), types[i].str()));
      }
    }
  }

  void check_outputs() {
    for (size_t i = 0; i < g_.outputs().size(); ++i) {
      const Value* v = g_.outputs()[i];
      ++slots_;
      if (!v) fail(fmt::format("output {} is null", i));
      if (v->is_input() ? !is_own_input(v) : v->node()->graph() != &g_) {
        fail(fmt::format("output {} ({}) is not defined in this graph", i, v->ref()));
      }
    }
  }

  // Every use-list entry names a slot holding the value, and there are as many entries as
  // slots (the Graph API keeps both in step; this catches a bug there).
  void check_value_uses(const Value& v, size_t& entries) const {
    for (const Use& u : v.uses()) {
      ++entries;
      const bool ok = u.user ? u.user->graph() == &g_ && u.index < u.user->num_operands() &&
                                   u.user->operand(u.index) == &v
                             : u.index < g_.outputs().size() && g_.outputs()[u.index] == &v;
      if (!ok) fail(fmt::format("use-list of {} names a slot that does not hold it", v.ref()));
    }
  }

  void check_use_lists() const {
    size_t entries = 0;
    for (const Value* v : g_.inputs()) check_value_uses(*v, entries);
    for (const Node& n : g_.nodes()) {
      for (size_t i = 0; i < n.num_results(); ++i) check_value_uses(*n.result(i), entries);
    }
    if (entries != slots_) {
      fail(fmt::format("use-lists hold {} entries for {} operand and output slots", entries, slots_));
    }
  }
};

}  // namespace

void verify(const Graph& graph) { Verifier(graph).run(); }

void verify(const Module& module) {
  // Graphs are found by name, and a printed module must parse back: names are unique.
  std::unordered_set<std::string_view> names;  // membership only, never iterated
  for (const auto& g : module.graphs()) {
    if (!names.insert(g->name()).second) {
      throw InvalidArgument(fmt::format("the module has more than one graph @{}",
                                        std::string_view(g->name()).substr(0, 64)));
    }
    verify(*g);
  }
}

}  // namespace funcol
