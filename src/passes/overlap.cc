// Overlap scheduling: collectives move up to their operands, waits move down to their users.
#include "funcol/passes/overlap.h"

#include <fmt/format.h>

#include <cmath>
#include <optional>
#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "funcol/core/error.h"

namespace funcol {

namespace {

// Bytes of every result of `node` (a coalesced collective has several).
int64_t result_bytes(const Node& node) {
  int64_t bytes = 0;
  for (size_t i = 0; i < node.num_results(); ++i) bytes += node.result(i)->type().nbytes();
  return bytes;
}

bool is_wait(const Node& node) { return node.op().collective == CollectiveKind::Wait; }

// The first node (in order) that reads data `collective` produced: a user of one of its waits'
// results, or a direct user of a result that is not a wait. Null when nothing reads it (only
// graph outputs, or nothing at all).
Node* first_reader(Node& collective) {
  Node* first = nullptr;
  auto consider = [&](Node* user) {
    if (user && (!first || user->is_before(*first))) first = user;
  };
  for (size_t i = 0; i < collective.num_results(); ++i) {
    for (const Use& u : collective.result(i)->uses()) {
      if (!u.user) continue;
      if (!is_wait(*u.user)) {
        consider(u.user);
        continue;
      }
      for (const Use& w : u.user->result()->uses()) consider(w.user);
    }
  }
  return first;
}

// The bytes of collective results held before they are read, at every node: a collective
// holds its result bytes from itself up to and including the first node that reads them (to
// the end when nothing does). Hoisting a collective makes it hold memory over more nodes; where
// its wait sits changes nothing (the buffer exists from the issue on). Lookups only, never
// iterated; rebuilt before each budgeted move.
class HeldProfile {
 public:
  explicit HeldProfile(const Graph& graph) {
    std::vector<Node*> order = graph.node_list();
    const size_t n = order.size();
    pos_.reserve(n);
    for (size_t i = 0; i < n; ++i) pos_.emplace(order[i], i);
    std::vector<int64_t> diff(n + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      Node& node = *order[i];
      if (!node.op().is_collective()) continue;
      const Node* reader = first_reader(node);
      const size_t end = reader ? pos_.at(reader) : n - 1;
      const int64_t bytes = result_bytes(node);
      diff[i] += bytes;
      diff[end + 1] -= bytes;
    }
    bytes_.resize(n);
    int64_t running = 0;
    for (size_t i = 0; i < n; ++i) {
      running += diff[i];
      bytes_[i] = running;
    }
  }
  int64_t at(const Node* node) const { return bytes_[pos_.at(node)]; }

 private:
  std::unordered_map<const Node*, size_t> pos_;
  std::vector<int64_t> bytes_;
};

class Scheduler {
 public:
  Scheduler(Graph& graph, const OverlapOptions& options, std::string* explain)
      : graph_(graph), options_(options), explain_(explain) {}

  OverlapStats run() {
    hoist_collectives();
    sink_waits();
    return stats_;
  }

 private:
  bool has_budget() const { return options_.memory_budget_bytes >= 0; }

  void note(const std::string& line) {
    if (!explain_) return;
    explain_->append("  ");
    explain_->append(line);
    explain_->push_back('\n');
  }

  void note_budget(const Node& moved, const Node& at, int64_t inflight, int64_t bytes) {
    ++stats_.budget_stops;
    note(fmt::format("%{}: stopped at %{} by the memory budget ({} bytes held + {} > {})",
                     moved.name(), at.name(), inflight, bytes, options_.memory_budget_bytes));
  }

  // The earliest node among the users of any result of `n`, or null (graph outputs only).
  static Node* first_user(Node& n) {
    Node* first = nullptr;
    for (size_t i = 0; i < n.num_results(); ++i) {
      for (const Use& u : n.result(i)->uses()) {
        if (u.user && (!first || u.user->is_before(*first))) first = u.user;
      }
    }
    return first;
  }

  static void sort_in_order(std::vector<Node*>& nodes) {
    std::sort(nodes.begin(), nodes.end(), [](Node* a, Node* b) { return a->is_before(*b); });
  }

  // Moves `c` together with the side-effect-free nodes it depends on that come after
  // `previous` (the packing of a bucket: flatten, cat, ...) to right after `previous`, keeping
  // their order. False (nothing done) when that cone is empty or holds a collective or a wait,
  // which cannot move; the caller then moves `c` alone.
  bool hoist_with_operands(Node* c, Node* previous) {
    auto after_previous = [&](const Node* n) { return !previous || previous->is_before(*n); };
    std::vector<Node*> cone;
    std::vector<Node*> stack;
    std::unordered_set<const Node*> seen;  // membership only, never iterated
    auto push_operands = [&](const Node& n) {
      for (Value* v : n.operands()) {
        Node* def = v->node();
        if (def && after_previous(def) && seen.insert(def).second) stack.push_back(def);
      }
    };
    push_operands(*c);
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      if (n->op().has_side_effect) return false;
      cone.push_back(n);
      push_operands(*n);
    }
    if (cone.empty()) return false;
    sort_in_order(cone);
    Node* at = previous ? previous->next() : graph_.first_node();
    int64_t moved = 0;
    for (Node* n : cone) {
      if (n == at) {
        at = at->next();
        continue;
      }
      graph_.move_before(n, at);
      ++moved;
    }
    if (moved == 0 && at == c) return true;
    if (at != c) graph_.move_before(c, at);
    ++stats_.collectives_hoisted;
    stats_.operands_hoisted += moved;
    note(fmt::format("%{}: issued earlier with {} operand node{}, {}", c->name(), moved,
                     moved == 1 ? "" : "s",
                     c->prev() ? "after %" + c->prev()->name() : "at the top"));
    return true;
  }

  // Phase 1: each collective, in program order, goes right after the previous collective (its
  // new place), together with the side-effect-free nodes computing its operands after that
  // point; when that is not possible (a wait among them, or a memory budget), the collective
  // alone goes right after the latest of its operands' definitions and the previous collective.
  void hoist_collectives() {
    Node* previous = nullptr;
    for (Node* c : graph_.node_list()) {
      if (!c->op().is_collective()) continue;
      if (!has_budget() && hoist_with_operands(c, previous)) {
        previous = c;
        continue;
      }
      Node* anchor = previous;
      for (Value* v : c->operands()) {
        Node* def = v->node();
        if (def && (!anchor || anchor->is_before(*def))) anchor = def;
      }
      previous = c;
      Node* stop = c;  // c goes right before `stop`
      std::optional<HeldProfile> profile;
      if (has_budget()) profile.emplace(graph_);
      const int64_t bytes = result_bytes(*c);
      int64_t crossed = 0;
      for (Node* n = c->prev(); n && n != anchor; n = n->prev()) {
        if (profile && profile->at(n) + bytes > options_.memory_budget_bytes) {
          note_budget(*c, *n, profile->at(n), bytes);
          break;
        }
        stop = n;
        ++crossed;
      }
      if (stop == c) continue;
      graph_.move_before(c, stop);
      ++stats_.collectives_hoisted;
      note(fmt::format("%{}: issued {} node{} earlier, {}", c->name(), crossed,
                       crossed == 1 ? "" : "s",
                       c->prev() ? "after %" + c->prev()->name() : "at the top"));
    }
  }

  // The side-effect-free nodes that only unpack `w`'s result: every operand is w's result or
  // a result of such a node (a bucket's view, split_with_sizes and reshapes), in order.
  static std::vector<Node*> unpack_chain(Node& w) {
    std::unordered_set<const Node*> in = {&w};  // membership only, never iterated
    std::vector<Node*> chain;
    std::vector<Node*> work;
    auto push_users = [&](Node& n) {
      for (size_t i = 0; i < n.num_results(); ++i) {
        for (const Use& u : n.result(i)->uses()) {
          if (u.user) work.push_back(u.user);
        }
      }
    };
    push_users(w);
    while (!work.empty()) {
      Node* u = work.back();
      work.pop_back();
      if (u->op().has_side_effect || in.count(u)) continue;
      const auto operands = u->operands();
      const bool only_chain = std::all_of(operands.begin(), operands.end(), [&](Value* v) {
        return v->node() && in.count(v->node());
      });
      if (!only_chain) continue;  // re-checked when another of its operands joins
      in.insert(u);
      chain.push_back(u);
      push_users(*u);
    }
    sort_in_order(chain);
    return chain;
  }

  // Phase 2: each wait_tensor, in program order, goes right before its first user, after its
  // unpacking chain moved down to its own users (latest first). The budget does not apply: a
  // wait changes when the rank blocks, not how long any buffer lives.
  void sink_waits() {
    for (Node* w : graph_.node_list()) {
      if (!is_wait(*w)) continue;
      const std::vector<Node*> chain = unpack_chain(*w);
      for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
        Node* user = first_user(**it);
        if (!user || (*it)->next() == user) continue;
        graph_.move_before(*it, user);
        ++stats_.unpack_sunk;
      }
      Node* first = first_user(*w);
      Node* stop = w->next();  // w goes right before `stop` (null: the end)
      int64_t crossed = 0;
      for (Node* n = w->next(); n != first; n = n->next()) {
        stop = n->next();
        ++crossed;
      }
      if (crossed == 0) continue;
      graph_.move_before(w, stop);
      ++stats_.waits_sunk;
      note(fmt::format("%{}: waited {} node{} later, {}", w->name(), crossed,
                       crossed == 1 ? "" : "s", stop ? "before %" + stop->name() : "at the end"));
    }
  }

  Graph& graph_;
  const OverlapOptions& options_;
  std::string* explain_;
  OverlapStats stats_;
};

}  // namespace

OverlapStats schedule_overlap(Graph& graph, const OverlapOptions& options, std::string* explain) {
  return Scheduler(graph, options, explain).run();
}

bool OverlapPass::run(Graph& graph) {
  if (!explain_) return schedule_overlap(graph, options_).changed();
  std::string text;
  const OverlapStats stats = schedule_overlap(graph, options_, &text);
  auto count = [](int64_t n, const char* what) {
    return fmt::format("{} {}{}", n, what, n == 1 ? "" : "s");
  };
  *explain_ << "overlap @" << graph.name() << ": " << count(stats.collectives_hoisted, "collective")
            << " issued earlier, " << count(stats.waits_sunk, "wait") << " later\n"
            << text;
  return stats.changed();
}

std::unique_ptr<Pass> make_overlap_pass(const PassOptions& options) {
  OverlapOptions o;
  if (const std::string* text = options.find("memory-budget-mb")) {
    const double mb = options.get_double("overlap", "memory-budget-mb", 0);
    if (!(mb > 0) || !std::isfinite(mb)) {
      throw InvalidArgument(fmt::format(
          "option memory-budget-mb of pass overlap must be a positive number, got '{}'", *text));
    }
    // MB as the bucketing passes count them (DESIGN §6: int(MB * 1024 * 1024) bytes).
    o.memory_budget_bytes = static_cast<int64_t>(mb * 1024.0 * 1024.0);
  }
  return std::make_unique<OverlapPass>(o);
}

}  // namespace funcol
