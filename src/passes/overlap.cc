// Overlap scheduling: collectives move up to their operands, waits move down to their users.
#include "funcol/passes/overlap.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "funcol/core/error.h"
#include "funcol/passes/bucketing.h"

namespace funcol {

namespace {

// Held bytes are counted exactly, in __int128 (a value has at most kMaxTypeBytes = 2^62 bytes;
// any number of them fit), and shown saturated at INT64_MAX. A budget of INT64_MAX (what
// memory-budget-mb saturates to: 1e300, say) holds anything; any other is compared exactly
// (a count saturated one byte short of 2^62 refused two values of 2^61 under a budget of
// 1e300 MB).
constexpr int64_t kUnlimitedBudget = std::numeric_limits<int64_t>::max();

int64_t shown_bytes(__int128 bytes) {
  return static_cast<int64_t>(std::min<__int128>(bytes, std::numeric_limits<int64_t>::max()));
}

// Bytes of every result of `node` (a coalesced collective has several).
__int128 result_bytes(const Node& node) {
  __int128 bytes = 0;
  for (size_t i = 0; i < node.num_results(); ++i) bytes += node.result(i)->type().nbytes();
  return bytes;
}

bool is_wait(const Node& node) { return node.op().collective == CollectiveKind::Wait; }

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

// The nodes phase 2 moves down: every wait_tensor and the view ops that only unpack a wait's
// result (their operand is the wait's result or such a view: a bucket's view, split_with_sizes
// and reshapes). Neither reads the data, so where they sit changes no buffer's life. Compute
// is never sinkable: it reads the buffer where it is. Membership only, never iterated.
using Sinkable = std::unordered_set<const Node*>;

// The unpacking nodes of wait `w` (see Sinkable), in no particular order.
std::vector<Node*> unpack_chain(Node& w) {
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
    if (!u->op().is_view || u->op().has_side_effect || in.count(u)) continue;
    const auto operands = u->operands();
    const bool only_chain = std::all_of(operands.begin(), operands.end(), [&](Value* v) {
      return v->node() && in.count(v->node());
    });
    if (!only_chain) continue;  // re-checked when another of its operands joins
    in.insert(u);
    chain.push_back(u);
    push_users(*u);
  }
  return chain;
}

Sinkable sinkable_nodes(const Graph& graph) {
  Sinkable sinkable;
  for (Node* n : graph.node_list()) {
    if (!is_wait(*n)) continue;
    sinkable.insert(n);
    for (Node* c : unpack_chain(*n)) sinkable.insert(c);
  }
  return sinkable;
}

// Whether `n` passes a buffer on without reading it: a wait_tensor or a view.
bool passes_on(const Node& n) { return is_wait(n) || n.op().is_view; }

// The first node (in `order`) that reads the data of value `v`, looking through waits and
// views (see passes_on) to their users. Null when nothing does (only graph outputs, or nothing
// at all).
Node* first_reader(const Value& v, const OrderIndex& order) {
  Node* first = nullptr;
  std::vector<const Value*> work = {&v};
  std::unordered_set<const Node*> seen;  // membership only, never iterated
  while (!work.empty()) {
    const Value* value = work.back();
    work.pop_back();
    for (const Use& u : value->uses()) {
      if (!u.user) continue;
      if (passes_on(*u.user)) {
        if (seen.insert(u.user).second) {
          for (size_t i = 0; i < u.user->num_results(); ++i) work.push_back(u.user->result(i));
        }
      } else if (!first || order.before(*u.user, *first)) {
        first = u.user;
      }
    }
  }
  return first;
}

// Range add and "the last position in a range whose value exceeds x" over int128 values, in
// O(log size) each: a segment tree whose node holds the max of its range, pending adds for the
// whole range included (never pushed down).
class MaxAddTree {
 public:
  explicit MaxAddTree(const std::vector<__int128>& values) : size_(values.size()) {
    max_.assign(4 * std::max<size_t>(size_, 1), 0);
    add_.assign(max_.size(), 0);
    if (size_ > 0) build(1, 0, size_ - 1, values);
  }

  void add(int64_t lo, int64_t hi, __int128 v) {
    if (lo <= hi) add(1, 0, size_ - 1, static_cast<size_t>(lo), static_cast<size_t>(hi), v);
  }

  __int128 at(int64_t i) const {
    size_t node = 1, l = 0, r = size_ - 1;
    __int128 pending = 0;
    const auto pos = static_cast<size_t>(i);
    while (l < r) {
      pending += add_[node];
      const size_t m = (l + r) / 2;
      if (pos <= m) {
        node = 2 * node;
        r = m;
      } else {
        node = 2 * node + 1;
        l = m + 1;
      }
    }
    return pending + max_[node];
  }

  // The last position in lo..hi whose value exceeds x, or -1.
  int64_t last_above(int64_t lo, int64_t hi, __int128 x) const {
    if (lo > hi) return -1;
    return last_above(1, 0, size_ - 1, static_cast<size_t>(lo), static_cast<size_t>(hi), x);
  }

 private:
  void build(size_t node, size_t l, size_t r, const std::vector<__int128>& values) {
    if (l == r) {
      max_[node] = values[l];
      return;
    }
    const size_t m = (l + r) / 2;
    build(2 * node, l, m, values);
    build(2 * node + 1, m + 1, r, values);
    max_[node] = std::max(max_[2 * node], max_[2 * node + 1]);
  }

  void add(size_t node, size_t l, size_t r, size_t lo, size_t hi, __int128 v) {
    if (hi < l || r < lo) return;
    if (lo <= l && r <= hi) {
      max_[node] += v;
      add_[node] += v;
      return;
    }
    const size_t m = (l + r) / 2;
    add(2 * node, l, m, lo, hi, v);
    add(2 * node + 1, m + 1, r, lo, hi, v);
    max_[node] = std::max(max_[2 * node], max_[2 * node + 1]) + add_[node];
  }

  // x is relative to this node's range: the adds of its ancestors already taken off.
  int64_t last_above(size_t node, size_t l, size_t r, size_t lo, size_t hi, __int128 x) const {
    if (hi < l || r < lo || max_[node] <= x) return -1;
    if (l == r) return static_cast<int64_t>(l);
    const size_t m = (l + r) / 2;
    const int64_t right = last_above(2 * node + 1, m + 1, r, lo, hi, x - add_[node]);
    return right >= 0 ? right : last_above(2 * node, l, m, lo, hi, x - add_[node]);
  }

  size_t size_;
  std::vector<__int128> max_, add_;
};

// The bytes of collective results held before they are read, kept up to date while phase 1
// moves collectives under a budget: each result of a collective is held from the collective up
// to and including that result's first reader (first_reader: waits and views of the buffer do
// not read it) or to the end when there is none. Hoisting a collective makes it hold memory
// over more nodes, and may make it the first reader of a collective whose data it reads; where
// a wait sits changes nothing (the buffer exists from the issue on).
//
// Phase 1 under a budget moves only collectives, and never one past another, so every other
// node keeps its place relative to the others: the nodes a collective holds memory over are a
// range of their original positions. A segment tree over those positions (the positions of
// collectives and sinkable nodes never count) finds where a hoist must stop and applies a move
// in O(log nodes), where rebuilding the whole profile for each collective cost O(nodes)
// (O(nodes^2) in all: 51 s for 4,000 all_gathers). Maps are for lookups only, never iterated.
class HeldBytes {
  // A value below any budget minus any number of held bytes: a position that never counts.
  static constexpr __int128 kNever = -(static_cast<__int128>(1) << 120);

 public:
  HeldBytes(const Graph& graph, const OrderIndex& order, const Sinkable& sinkable)
      : order_(order), nodes_(graph.node_list()), tree_(initial(nodes_, sinkable)) {
    index_.reserve(nodes_.size());
    for (size_t i = 0; i < nodes_.size(); ++i) index_.emplace(nodes_[i], i);
    // Every collective's start first: a collective read by another holds up to that one's.
    for (Node* c : nodes_) {
      if (!c->op().is_collective()) continue;
      Held h{index_.at(c), {}};
      for (size_t r = 0; r < c->num_results(); ++r) {
        h.parts.push_back({c->result(r)->type().nbytes(), 0, nullptr});
      }
      held_.emplace(c, std::move(h));
    }
    for (Node* c : nodes_) {
      if (c->op().is_collective()) update_reader(*c);
    }
    // The collective result each value is, looking back through waits and views (each has one
    // operand), found once: walking back from every moved reader cost O(chain) per hoist.
    for (Node* n : nodes_) {
      if (n->op().is_collective()) {
        for (size_t r = 0; r < n->num_results(); ++r) {
          source_.emplace(n->result(r), Source{n, static_cast<uint32_t>(r)});
        }
      } else if (passes_on(*n) && n->num_operands() == 1) {
        if (auto it = source_.find(n->operand(0)); it != source_.end()) {
          const Source s = it->second;
          for (size_t r = 0; r < n->num_results(); ++r) source_.emplace(n->result(r), s);
        }
      }
    }
  }

  // Where `c` (not moved yet) must stop going up under `budget`: the last node after `anchor`
  // (null: the top) whose held bytes plus c's exceed it, or null when none does. `*held_there`
  // gets that node's held bytes (shown_bytes).
  Node* blocker(const Node& c, const Node* anchor, int64_t budget, int64_t* held_there) const {
    if (budget == kUnlimitedBudget) return nullptr;
    int64_t lo = 0;
    if (anchor) {
      // A collective anchor (the previous one) may have moved: the nodes after it start at its
      // start; any other node keeps its original position.
      lo = anchor->op().is_collective() ? held_.at(anchor).lo : index_.at(anchor) + 1;
    }
    // Hoisted, c holds all its results over the nodes it passes.
    const __int128 room = static_cast<__int128>(budget) - result_bytes(c);
    const int64_t j = tree_.last_above(lo, index_.at(&c) - 1, room);
    if (j < 0) return nullptr;
    *held_there = shown_bytes(tree_.at(j));
    return nodes_[static_cast<size_t>(j)];
  }

  // `c` has just moved up to right before `stop`, which is not a collective (the order index
  // already says so), after `cone`, side-effect-free nodes computing its operands that moved up
  // with it. Those now sit between the previous collective and c, where no later collective
  // goes: they never count again, and one that reads a collective's data ends its hold just
  // before c starts.
  void moved(Node& c, const Node& stop, const std::vector<Node*>& cone) {
    for (Node* n : cone) {
      const int64_t i = index_.at(n);
      tree_.add(i, i, kNever);
      hoisted_with_.emplace(n, &c);
    }
    Held& h = held_.at(&c);
    remove(h);
    h.lo = index_.at(&stop);
    for (Part& p : h.parts) {
      p.hi = end_of(p.reader);  // c's first readers stay: they are after c
      tree_.add(h.lo, p.hi, p.bytes);
    }
    // The collectives whose data c or its operand nodes read (through waits and views): one of
    // them may now be a result's first reader, or is and starts earlier. Nothing else moved, so
    // the result's first reader is the earlier of its old one and those (scanning every user
    // of the result again instead cost a hoist O(users): 36 s for one gathered weight read by
    // 16,000 layers). Sources by original position: the edits are the same in any order, but
    // nothing here depends on pointers.
    std::map<int64_t, std::vector<Read>> reads;  // source's original position -> its reads
    auto collect = [&](Node& reader) {
      if (passes_on(reader)) return;  // a wait or view in the cone: its users read, if any
      for (const Value* v : reader.operands()) {
        if (auto it = source_.find(v); it != source_.end()) {
          const Source& s = it->second;
          reads[index_.at(s.collective)].push_back({s.collective, s.result, &reader});
        }
      }
    };
    collect(c);
    for (Node* n : cone) collect(*n);
    for (const auto& [pos, list] : reads) {
      // Only the results these reads touch change: another result's first reader did not move
      // (it would be c or in the cone, and read here), so it holds what it held. Re-adding
      // every result cost a coalesced collective O(results) per reader hoisted: 17 s for one
      // all_gather of 8,000 weights read by 8,000 reduce_scatters.
      Held& k = held_.at(list.front().source);
      for (const Read& r : list) {
        Part& p = k.parts[r.result];
        tree_.add(k.lo, p.hi, -p.bytes);
        if (!p.reader || order_.before(*r.reader, *p.reader)) p.reader = r.reader;
        p.hi = end_of(p.reader);
        tree_.add(k.lo, p.hi, p.bytes);
      }
    }
  }

 private:
  // One result of a collective: held up to its own first reader (a coalesced collective's
  // results are read at different places, and each is released there).
  struct Part {
    int64_t bytes;
    int64_t hi;    // last original position held
    Node* reader;  // first reader, or null
  };
  struct Held {
    int64_t lo;  // first original position held (a moved collective: the node after it)
    std::vector<Part> parts;
  };
  // Result `result` of `collective`.
  struct Source {
    Node* collective;
    uint32_t result;
  };
  // A node that moved reading result `result` of collective `source`.
  struct Read {
    Node* source;
    uint32_t result;
    Node* reader;
  };

  void remove(const Held& h) {
    for (const Part& p : h.parts) tree_.add(h.lo, p.hi, -p.bytes);
  }

  // Collectives and sinkable nodes never count (a value below any budget minus any number of
  // held bytes): a collective never stops at either, as phase 2 moves the sinkable ones down
  // past it to their first fixed user, and only the order of the others says what is held.
  static std::vector<__int128> initial(const std::vector<Node*>& nodes, const Sinkable& sinkable) {
    std::vector<__int128> values(nodes.size(), 0);
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (nodes[i]->op().is_collective() || sinkable.count(nodes[i])) values[i] = kNever;
    }
    return values;
  }

  // Finds the first reader of each of c's results and adds its bytes over what it now holds.
  void update_reader(Node& c) {
    Held& h = held_.at(&c);
    for (size_t r = 0; r < h.parts.size(); ++r) {
      Part& p = h.parts[r];
      p.reader = first_reader(*c.result(r), order_);
      p.hi = end_of(p.reader);
      tree_.add(h.lo, p.hi, p.bytes);
    }
  }

  // The last original position held: the reader itself, or, when the reader is a collective or
  // moved up with one, the one before where that collective starts; the end when nothing reads.
  int64_t end_of(const Node* reader) const {
    if (!reader) return static_cast<int64_t>(nodes_.size()) - 1;
    if (reader->op().is_collective()) return held_.at(reader).lo - 1;
    if (auto it = hoisted_with_.find(reader); it != hoisted_with_.end()) {
      return held_.at(it->second).lo - 1;
    }
    return index_.at(reader);
  }

  const OrderIndex& order_;
  const std::vector<Node*> nodes_;  // the original order
  MaxAddTree tree_;
  std::unordered_map<const Node*, int64_t> index_;
  std::unordered_map<const Node*, Held> held_;
  std::unordered_map<const Node*, const Node*> hoisted_with_;  // operand node -> its collective
  std::unordered_map<const Value*, Source> source_;  // a value -> the collective result it is
};

class Scheduler {
 public:
  Scheduler(Graph& graph, const OverlapOptions& options, std::string* explain)
      : graph_(graph), options_(options), explain_(explain), order_(graph) {}

  OverlapStats run() {
    sinkable_ = sinkable_nodes(graph_);
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
  // their order; `*moved_cone` gets the nodes that moved (c moves when any does). False
  // (nothing done) when that cone is empty or holds a collective or a wait, which cannot move;
  // the caller then moves `c` alone.
  bool hoist_with_operands(Node* c, Node* previous, std::vector<Node*>* moved_cone) {
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
    for (Node* n : cone) {
      if (n == at) {
        at = at->next();
        continue;
      }
      move_before(n, at);
      moved_cone->push_back(n);
    }
    if (at != c) move_before(c, at);
    return true;
  }

  // Phase 1: each collective, in program order, goes right after the previous collective (its
  // new place) or, under a budget, right after the last node on the way where the held bytes
  // plus its own would exceed the budget, together with the side-effect-free nodes computing
  // its operands after that point; when those include a wait, the collective alone goes right
  // after the latest of its operands' definitions and that point.
  void hoist_collectives() {
    if (has_budget()) held_.emplace(graph_, order_, sinkable_);
    Node* previous = nullptr;
    for (Node* c : graph_.node_list()) {
      if (!c->op().is_collective()) continue;
      Node* after = previous;
      Node* blocker = nullptr;
      int64_t held = 0;
      if (has_budget()) {
        blocker = held_->blocker(*c, previous, options_.memory_budget_bytes, &held);
        if (blocker) after = blocker;
      }
      previous = c;
      std::vector<Node*> cone;
      Node* const next = c->next();
      if (hoist_with_operands(c, after, &cone)) {
        if (blocker) note_budget(*c, *blocker, held, shown_bytes(result_bytes(*c)));
        if (c->next() == next) continue;  // already in place
        if (held_) held_->moved(*c, *c->next(), cone);
        const auto moved = static_cast<int64_t>(cone.size());
        ++stats_.collectives_hoisted;
        stats_.operands_hoisted += moved;
        note(fmt::format("%{}: issued earlier with {} operand node{}, {}", c->name(), moved,
                         moved == 1 ? "" : "s", after ? "after %" + after->name() : "at the top"));
        continue;
      }
      Node* anchor = after;
      bool reads_blocker = false;  // then c's operands stop it there, budget or not
      for (Value* v : c->operands()) {
        Node* def = v->node();
        reads_blocker = reads_blocker || (def && def == blocker);
        if (def && (!anchor || before(*anchor, *def))) anchor = def;
      }
      if (blocker && anchor == blocker && !reads_blocker) {
        note_budget(*c, *blocker, held, shown_bytes(result_bytes(*c)));
      }
      Node* stop = anchor ? anchor->next() : graph_.first_node();  // c goes right before it
      if (stop == c) continue;
      const int64_t crossed = explain_ ? order_.rank(*c) - order_.rank(*stop) : 0;
      move_before(c, stop);
      if (held_) held_->moved(*c, *stop, {});
      ++stats_.collectives_hoisted;
      note(fmt::format("%{}: issued {} node{} earlier, {}", c->name(), crossed,
                       crossed == 1 ? "" : "s",
                       c->prev() ? "after %" + c->prev()->name() : "at the top"));
    }
  }

  // Phase 2: every sinkable node (a wait_tensor or a view that only unpacks a wait's result)
  // goes right before its first fixed user: the first node that needs it and is not sinkable,
  // looking through sinkable users (the end when there is none).
  // The nodes that go to one place keep their order there, so a second run finds each where it
  // belongs and moves nothing. The budget does not apply: a wait changes when the rank blocks,
  // not how long any buffer lives. Only the nodes that cross a fixed node count as moved.
  void sink_waits() {
    const std::vector<Node*> nodes = graph_.node_list();
    // Fixed nodes never move in this phase: the number of them before each node, and in all.
    std::unordered_map<const Node*, int64_t> fixed_before;  // lookups only, never iterated
    int64_t fixed = 0;
    for (Node* n : nodes) {
      fixed_before.emplace(n, fixed);
      if (!sinkable_.count(n)) ++fixed;
    }
    // The first fixed user of each sinkable node, users before their operands (null: the end).
    std::unordered_map<const Node*, Node*> place;  // lookups only, never iterated
    for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
      if (!sinkable_.count(*it)) continue;
      Node* first = nullptr;
      for (size_t i = 0; i < (*it)->num_results(); ++i) {
        for (const Use& u : (*it)->result(i)->uses()) {
          if (!u.user) continue;
          Node* p = sinkable_.count(u.user) ? place.at(u.user) : u.user;
          if (p && (!first || fixed_before.at(p) < fixed_before.at(first))) first = p;
        }
      }
      place.emplace(*it, first);
    }
    for (Node* n : nodes) {
      if (!sinkable_.count(n)) continue;
      Node* at = place.at(n);
      const int64_t crossed = (at ? fixed_before.at(at) : fixed) - fixed_before.at(n);
      // Moved in program order, the nodes bound for one place keep their order there.
      move_before(n, at);
      if (crossed == 0) continue;
      if (!is_wait(*n)) {
        ++stats_.unpack_sunk;
        continue;
      }
      ++stats_.waits_sunk;
      note(fmt::format("%{}: waited {} node{} later, {}", n->name(), crossed,
                       crossed == 1 ? "" : "s", at ? "before %" + at->name() : "at the end"));
    }
  }

  Graph& graph_;
  const OverlapOptions& options_;
  std::string* explain_;
  OrderIndex order_;
  Sinkable sinkable_;
  std::optional<HeldBytes> held_;  // with a budget only
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
      // Without the option the budget is unlimited; say so to one who asked for infinity.
      throw InvalidArgument(fmt::format(
          "option memory-budget-mb of pass overlap must be a finite positive number, got "
          "'{}'{}",
          *text, std::isinf(mb) && mb > 0 ? " (leave the option out for no budget)" : ""));
    }
    // MB as the bucketing passes count them (DESIGN §6); a budget of INT64_MAX bytes or more
    // saturates (no float-to-integer overflow) and holds anything, and one under a byte,
    // accepted as positive, is one byte, not no room.
    o.memory_budget_bytes = mb_to_bytes(mb, kUnlimitedBudget);
  }
  return std::make_unique<OverlapPass>(o);
}

}  // namespace funcol
