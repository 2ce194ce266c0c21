// Overlap scheduling: collectives move up to their operands, waits move down to their users.
#include "funcol/passes/overlap.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "funcol/core/error.h"

namespace funcol {

namespace {

// Counts of held bytes saturate here: a value has at most kMaxTypeBytes = 2^62 bytes, so a
// saturated count plus one value's bytes still fits in int64, and no budget is larger.
constexpr int64_t kMaxHeldBytes = std::numeric_limits<int64_t>::max() / 2;

// Bytes of every result of `node` (a coalesced collective has several), saturated.
int64_t result_bytes(const Node& node) {
  int64_t bytes = 0;
  for (size_t i = 0; i < node.num_results(); ++i) {
    bytes = std::min(kMaxHeldBytes, bytes + node.result(i)->type().nbytes());
  }
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
    // Exact sums (many collectives of up to 2^62 bytes each), saturated when stored.
    std::vector<__int128> diff(n + 1, 0);
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
    __int128 running = 0;
    for (size_t i = 0; i < n; ++i) {
      running += diff[i];
      bytes_[i] = static_cast<int64_t>(std::min<__int128>(running, kMaxHeldBytes));
    }
  }
  int64_t at(const Node* node) const { return bytes_[pos_.at(node)]; }

 private:
  std::unordered_map<const Node*, size_t> pos_;
  std::vector<int64_t> bytes_;
};

// The positions of a graph's nodes while the pass moves them: a treap over the node list,
// ordered as the list (heap-ordered by fixed pseudo-random priorities, so the same graph always
// gives the same tree), with subtree sizes and parent links. Rank, order comparison and a move
// cost O(log nodes) expected, where Node::is_before would renumber the whole graph once ~32
// moves land in one gap (as hoisted collectives do, each right after the previous one), and
// counting the nodes a move crosses would walk them. Mirrors the graph only as long as every
// move goes through move_before here too. The node map is for lookups only, never iterated.
class OrderIndex {
 public:
  explicit OrderIndex(const Graph& graph) {
    const std::vector<Node*> order = graph.node_list();
    const size_t n = order.size();
    left_.assign(n + 1, 0);
    right_.assign(n + 1, 0);
    parent_.assign(n + 1, 0);
    size_.assign(n + 1, 0);
    priority_.assign(n + 1, 0);
    id_.reserve(n);
    std::mt19937_64 random(0x9e3779b97f4a7c15ULL);  // the standard fixes its sequence
    for (size_t i = 0; i < n; ++i) {
      const int32_t x = static_cast<int32_t>(i + 1);
      id_.emplace(order[i], x);
      priority_[x] = random();
      size_[x] = 1;
    }
    // Cartesian tree of the list in one pass: the right spine on a stack.
    std::vector<int32_t> spine;
    for (int32_t x = 1; x <= static_cast<int32_t>(n); ++x) {
      int32_t last = 0;
      while (!spine.empty() && priority_[spine.back()] < priority_[x]) {
        last = spine.back();
        spine.pop_back();
      }
      left_[x] = last;
      if (!spine.empty()) right_[spine.back()] = x;
      spine.push_back(x);
    }
    root_ = spine.empty() ? 0 : spine.front();
    // Sizes and parents, children before parents (post-order without recursion).
    std::vector<int32_t> stack;
    std::vector<int32_t> post;
    post.reserve(n);
    if (root_) stack.push_back(root_);
    while (!stack.empty()) {
      const int32_t x = stack.back();
      stack.pop_back();
      post.push_back(x);
      if (left_[x]) stack.push_back(left_[x]);
      if (right_[x]) stack.push_back(right_[x]);
    }
    for (auto it = post.rbegin(); it != post.rend(); ++it) pull(*it);
  }

  // 0-based position of `node` in the list.
  int64_t rank(const Node& node) const { return rank_of(id(node)); }
  int64_t size() const { return size_[root_]; }
  bool before(const Node& a, const Node& b) const { return rank(a) < rank(b); }

  // Mirrors Graph::move_before(node, before) (null `before`: the end).
  void move_before(const Node& node, const Node* before) {
    if (&node == before) return;
    const int32_t x = id(node);
    int32_t a = 0, b = 0, mid = 0, c = 0;
    split(root_, rank_of(x), a, b);
    split(b, 1, mid, c);
    root_ = merge(a, c);
    parent_[root_] = 0;
    const int64_t at = before ? rank(*before) : size_[root_];
    split(root_, at, a, b);
    parent_[a] = parent_[b] = parent_[x] = 0;
    root_ = merge(merge(a, x), b);
    parent_[root_] = 0;
  }

 private:
  int32_t id(const Node& node) const { return id_.at(&node); }

  int64_t rank_of(int32_t x) const {
    int64_t k = size_[left_[x]];
    for (int32_t p = parent_[x]; p; x = p, p = parent_[p]) {
      if (right_[p] == x) k += size_[left_[p]] + 1;
    }
    return k;
  }

  void pull(int32_t x) {
    size_[x] = 1 + size_[left_[x]] + size_[right_[x]];
    if (left_[x]) parent_[left_[x]] = x;
    if (right_[x]) parent_[right_[x]] = x;
  }

  // Splits tree `t` into its first `k` nodes (`a`) and the rest (`b`).
  void split(int32_t t, int64_t k, int32_t& a, int32_t& b) {
    if (!t) {
      a = b = 0;
      return;
    }
    if (size_[left_[t]] < k) {
      int32_t rest = 0;
      split(right_[t], k - size_[left_[t]] - 1, rest, b);
      right_[t] = rest;
      a = t;
    } else {
      int32_t first = 0;
      split(left_[t], k, a, first);
      left_[t] = first;
      b = t;
    }
    pull(t);
  }

  int32_t merge(int32_t a, int32_t b) {
    if (!a || !b) return a ? a : b;
    if (priority_[a] > priority_[b]) {
      right_[a] = merge(right_[a], b);
      pull(a);
      return a;
    }
    left_[b] = merge(a, left_[b]);
    pull(b);
    return b;
  }

  std::unordered_map<const Node*, int32_t> id_;  // index 0 is the empty tree
  std::vector<int32_t> left_, right_, parent_;
  std::vector<int64_t> size_;
  std::vector<uint64_t> priority_;
  int32_t root_ = 0;
};

class Scheduler {
 public:
  Scheduler(Graph& graph, const OverlapOptions& options, std::string* explain)
      : graph_(graph), options_(options), explain_(explain), order_(graph) {}

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

  // Order and moves go through order_ (never Node::is_before, see OrderIndex).
  bool before(const Node& a, const Node& b) const { return order_.before(a, b); }

  void move_before(Node* node, Node* at) {
    graph_.move_before(node, at);
    order_.move_before(*node, at);
  }

  // The number of nodes strictly between `from` and `to` (null: the end), `from` first; only
  // for the explanation.
  int64_t between(const Node& from, const Node* to) const {
    return (to ? order_.rank(*to) : order_.size()) - order_.rank(from) - 1;
  }

  // The earliest node among the users of any result of `n`, or null (graph outputs only).
  Node* first_user(Node& n) const {
    Node* first = nullptr;
    for (size_t i = 0; i < n.num_results(); ++i) {
      for (const Use& u : n.result(i)->uses()) {
        if (u.user && (!first || before(*u.user, *first))) first = u.user;
      }
    }
    return first;
  }

  // Sorts by position, each looked up once.
  void sort_in_order(std::vector<Node*>& nodes) const {
    std::vector<std::pair<int64_t, Node*>> keyed;
    keyed.reserve(nodes.size());
    for (Node* n : nodes) keyed.emplace_back(order_.rank(*n), n);
    std::sort(keyed.begin(), keyed.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < keyed.size(); ++i) nodes[i] = keyed[i].second;
  }

  // Moves `c` together with the side-effect-free nodes it depends on that come after
  // `previous` (the packing of a bucket: flatten, cat, ...) to right after `previous`, keeping
  // their order. False (nothing done) when that cone is empty or holds a collective or a wait,
  // which cannot move; the caller then moves `c` alone.
  bool hoist_with_operands(Node* c, Node* previous) {
    auto after_previous = [&](const Node* n) { return !previous || before(*previous, *n); };
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
      move_before(n, at);
      ++moved;
    }
    if (moved == 0 && at == c) return true;
    if (at != c) move_before(c, at);
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
        if (def && (!anchor || before(*anchor, *def))) anchor = def;
      }
      previous = c;
      Node* stop = c;  // c goes right before `stop`
      int64_t crossed = 0;
      if (!has_budget()) {
        // Straight to just after the anchor: the nodes in between are only counted.
        stop = anchor ? anchor->next() : graph_.first_node();
        if (explain_ && stop != c) crossed = anchor ? between(*anchor, c) : order_.rank(*c);
      } else {
        // Up node by node while the budget allows; the profile costs O(nodes) anyway.
        const HeldProfile profile(graph_);
        const int64_t bytes = result_bytes(*c);
        for (Node* n = c->prev(); n && n != anchor; n = n->prev()) {
          if (profile.at(n) + bytes > options_.memory_budget_bytes) {
            note_budget(*c, *n, profile.at(n), bytes);
            break;
          }
          stop = n;
          ++crossed;
        }
      }
      if (stop == c) continue;
      move_before(c, stop);
      ++stats_.collectives_hoisted;
      note(fmt::format("%{}: issued {} node{} earlier, {}", c->name(), crossed,
                       crossed == 1 ? "" : "s",
                       c->prev() ? "after %" + c->prev()->name() : "at the top"));
    }
  }

  // The side-effect-free nodes that only unpack `w`'s result: every operand is w's result or
  // a result of such a node (a bucket's view, split_with_sizes and reshapes), in order.
  std::vector<Node*> unpack_chain(Node& w) const {
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
        move_before(*it, user);
        ++stats_.unpack_sunk;
      }
      Node* first = first_user(*w);  // w goes right before it (null: the end)
      if (w->next() == first) continue;
      const int64_t crossed = explain_ ? between(*w, first) : 0;
      move_before(w, first);
      ++stats_.waits_sunk;
      note(fmt::format("%{}: waited {} node{} later, {}", w->name(), crossed,
                       crossed == 1 ? "" : "s", first ? "before %" + first->name() : "at the end"));
    }
  }

  Graph& graph_;
  const OverlapOptions& options_;
  std::string* explain_;
  OrderIndex order_;
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
    // MB as the bucketing passes count them (DESIGN §6: int(MB * 1024 * 1024) bytes); a budget
    // beyond any count of held bytes saturates.
    const double bytes = mb * 1024.0 * 1024.0;
    o.memory_budget_bytes = bytes >= static_cast<double>(kMaxHeldBytes)
                                ? kMaxHeldBytes
                                : static_cast<int64_t>(bytes);
  }
  return std::make_unique<OverlapPass>(o);
}

}  // namespace funcol
