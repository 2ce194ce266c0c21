// The graph IR: SSA graphs of op nodes over typed values, with use-lists for passes (DESIGN §5).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "funcol/core/error.h"
#include "funcol/graph/ops.h"
#include "funcol/graph/types.h"

namespace funcol {

class Graph;
class Node;

namespace detail {

// A vector of trivially copyable T that keeps up to N elements in the object itself and moves
// to the heap beyond that: operand and use lists, most of which are short, then cost no
// allocation. Only what the graph needs.
template <typename T, uint32_t N>
class SmallVec {
  static_assert(std::is_trivially_copyable_v<T> && N > 0);

 public:
  SmallVec() = default;
  SmallVec(const SmallVec&) = delete;
  SmallVec& operator=(const SmallVec&) = delete;
  SmallVec(SmallVec&& other) noexcept { take(other); }
  SmallVec& operator=(SmallVec&& other) noexcept {
    if (this != &other) {
      free_heap();
      take(other);
    }
    return *this;
  }
  ~SmallVec() { free_heap(); }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return heap_ ? heap_ : inline_; }
  const T* data() const { return heap_ ? heap_ : inline_; }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }
  T& back() { return data()[size_ - 1]; }
  operator std::span<const T>() const { return {data(), size_}; }

  void push_back(const T& value) {
    const T copy = value;  // `value` may be an element, which grow() frees
    if (size_ == cap_) grow(size_t{cap_} + 1);
    data()[size_++] = copy;
  }
  void pop_back() { --size_; }
  // Keeps the storage.
  void clear() { size_ = 0; }
  // Replaces the contents with `values`.
  void assign(std::span<const T> values) {
    if (values.size() > cap_) grow(values.size());
    // memmove: `values` may be part of this vector (it cannot be when it grows: it is longer).
    if (!values.empty()) std::memmove(data(), values.data(), values.size() * sizeof(T));
    size_ = static_cast<uint32_t>(values.size());
  }

 private:
  T* heap_ = nullptr;  // null: the elements are in inline_
  uint32_t size_ = 0;
  uint32_t cap_ = N;
  T inline_[N];

  // Out of line: the cold path, and inlined into a caller with known sizes it made GCC 12
  // report a false -Wstringop-overflow on the copy.
  [[gnu::noinline]] void grow(size_t want) {
    const size_t cap = std::max<size_t>(want, 2 * size_t{cap_});
    T* fresh = std::allocator<T>().allocate(cap);
    if (size_) std::memcpy(fresh, data(), size_ * sizeof(T));
    free_heap();
    heap_ = fresh;
    cap_ = static_cast<uint32_t>(cap);
  }
  void free_heap() {
    if (heap_) std::allocator<T>().deallocate(heap_, cap_);
    heap_ = nullptr;
    cap_ = N;
  }
  void take(SmallVec& other) {
    size_ = other.size_;
    if (other.heap_) {
      heap_ = other.heap_;
      cap_ = other.cap_;
    } else if (size_) {
      std::memcpy(inline_, other.inline_, size_ * sizeof(T));
    }
    other.heap_ = nullptr;
    other.cap_ = N;
    other.size_ = 0;
  }
};

}  // namespace detail

// One use of a value: operand `index` of `user`, or (user == nullptr) graph output `index`.
struct Use {
  Node* user = nullptr;
  uint32_t index = 0;
  friend bool operator==(const Use&, const Use&) = default;
};

// An SSA value: a graph input or one result of a node. Values never move in memory, so
// `Value*` is a stable handle for as long as its node (or graph) lives.
class Value {
 public:
  const Type& type() const { return type_; }
  DType dtype() const { return type_.dtype; }
  const Shape& shape() const { return type_.shape; }
  // Changes the type; the verifier checks it against shape inference of every user later.
  void set_type(Type type) { type_ = std::move(type); }

  // The defining node, or null for a graph input.
  Node* node() const { return node_; }
  bool is_input() const { return node_ == nullptr; }
  // Result index within the node, or input index within the graph.
  uint32_t index() const { return index_; }

  // Operand and output uses, in the order they were added (deterministic for a given
  // sequence of edits; a removal moves the last use into the freed slot, in O(1)).
  std::span<const Use> uses() const { return uses_; }
  bool has_uses() const { return !uses_.empty(); }
  size_t num_uses() const { return uses_.size(); }

  // The name as written in IR text without '%': "x", "p#1".
  std::string name() const;
  // "%x", "%p#1".
  std::string ref() const { return "%" + name(); }
  // Where an input was declared (inputs only; results use their node's loc()).
  SourceLoc loc() const { return loc_; }

 private:
  friend class Graph;
  friend class Node;
  Type type_;
  Node* node_ = nullptr;
  uint32_t index_ = 0;
  SourceLoc loc_;
  detail::SmallVec<Use, 1> uses_;  // one use (the commonest case) without an allocation
  const std::string* input_name_ = nullptr;  // graph inputs only (owned by the graph)
};

// One operation in a graph. Nodes live in their graph's order list (an intrusive doubly linked
// list, so inserting and erasing are O(1)) and are owned by the graph.
class Node {
 public:
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  const OpDef& op() const { return *op_; }
  std::string_view op_name() const { return op_->name; }
  // The node's name without '%' (unique in its graph).
  const std::string& name() const { return name_; }
  Graph* graph() const { return graph_; }
  SourceLoc loc() const { return loc_; }
  // A pass's new node takes the location of what it stands for (a bucket's nodes: its first
  // member's), so that later errors about it still name a place in the source.
  void set_loc(SourceLoc loc) { loc_ = loc; }

  // ---- operands ----
  std::span<Value* const> operands() const { return {operands_.data(), operands_.size()}; }
  size_t num_operands() const { return operands_.size(); }
  Value* operand(size_t i) const { return operands_[i]; }
  // Replaces operand i (keeps use-lists right). The caller keeps types consistent.
  void set_operand(size_t i, Value* value);

  // ---- results ----
  size_t num_results() const { return num_results_; }
  Value* result(size_t i = 0) { return i == 0 ? &result0_ : &more_results_[i - 1]; }
  const Value* result(size_t i = 0) const { return i == 0 ? &result0_ : &more_results_[i - 1]; }
  // True when any result has a use.
  bool has_uses() const;

  // ---- attributes (one slot per entry of op().attrs, in schema order) ----
  std::span<const Attr> attr_values() const { return attrs_; }
  AttrList attrs() const { return AttrList(*op_, attrs_); }
  // FUNCOL_CHECK when the op has no attribute `name`.
  const Attr& attr(std::string_view name) const { return attrs().get(name); }
  // Sets attribute `name` after coerce_attr; throws InvalidArgument on an unknown attribute or
  // a value of the wrong kind. Result types are not re-inferred (see Graph::reinfer).
  void set_attr(std::string_view name, Attr value);

  // ---- order ----
  Node* next() const { return next_; }
  Node* prev() const { return prev_; }
  // True when this node comes before `other` in their graph's order. Amortized O(1).
  bool is_before(const Node& other) const;

  // ---- pass scratch ----
  // One word a pass may use as it likes while it runs (the bucketing passes keep a dense node
  // id here instead of hashing Node*); the graph never reads it and its value when a pass
  // starts is unspecified, so a pass must set it on every node it later reads it from.
  uint32_t scratch() const { return scratch_; }
  void set_scratch(uint32_t value) const { scratch_ = value; }

 private:
  friend class Graph;
  Node() = default;

  const OpDef* op_ = nullptr;
  Graph* graph_ = nullptr;
  Node* prev_ = nullptr;
  Node* next_ = nullptr;
  mutable int64_t order_ = 0;
  SourceLoc loc_;
  std::string name_;
  detail::SmallVec<Value*, 2> operands_;  // up to two without an allocation
  // Where operand i's Use sits in its value's use-list (O(1) removal): inline for the first
  // two operands (most nodes), then in use_pos_more_[i - 2].
  uint32_t use_pos_inline_[2] = {0, 0};
  std::vector<uint32_t> use_pos_more_;
  // Result 0 lives in the node (every op has one); the others, for multi-result ops, in a
  // vector never resized after creation. Either way Value* stays valid.
  uint32_t num_results_ = 0;
  mutable uint32_t scratch_ = 0;
  Value result0_;
  std::vector<Value> more_results_;

  uint32_t& use_pos(uint32_t i) { return i < 2 ? use_pos_inline_[i] : use_pos_more_[i - 2]; }
  std::vector<Attr> attrs_;
};

// A forward range over a graph's nodes in order. Erasing the current node while iterating
// invalidates the iterator; use `Graph::node_list()` (a snapshot) for such loops.
class NodeRange {
 public:
  class iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = Node;
    using difference_type = std::ptrdiff_t;
    using pointer = Node*;
    using reference = Node&;
    iterator() = default;
    explicit iterator(Node* n) : n_(n) {}
    Node& operator*() const { return *n_; }
    Node* operator->() const { return n_; }
    iterator& operator++() {
      n_ = n_->next();
      return *this;
    }
    iterator operator++(int) {
      iterator old = *this;
      n_ = n_->next();
      return old;
    }
    friend bool operator==(const iterator&, const iterator&) = default;

   private:
    Node* n_ = nullptr;
  };
  explicit NodeRange(Node* first) : first_(first) {}
  iterator begin() const { return iterator(first_); }
  iterator end() const { return iterator(); }

 private:
  Node* first_;
};

// A named SSA graph: typed inputs, nodes in a valid topological order (also the order in
// which collectives are issued), and outputs. Owns its nodes; not copyable. Move construction
// (for functions that return a Graph, such as build_joint_graph) hands the nodes over, so Node*
// and Value* handles stay valid; no assignment (hold long-lived graphs by unique_ptr).
class Graph {
 public:
  // Throws InvalidArgument unless `name` is a valid name (letters, digits, '_', '.').
  explicit Graph(std::string name);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  // Takes over other's inputs, nodes and outputs; `other` is left empty (destroy it only).
  Graph(Graph&& other) noexcept;
  Graph& operator=(Graph&&) = delete;

  const std::string& name() const { return name_; }
  // File the graph was parsed from ("" when built in code) and the location of `graph @name`.
  const std::string& source_file() const { return source_file_; }
  SourceLoc loc() const { return loc_; }
  void set_source(std::string file, SourceLoc loc);

  // ---- inputs and outputs ----
  // Adds an input; throws InvalidArgument when `name` is not a valid value name or is taken.
  Value* add_input(std::string name, Type type, SourceLoc loc = {});
  std::span<Value* const> inputs() const { return inputs_; }
  Value* input(size_t i) const { return inputs_[i]; }
  size_t num_inputs() const { return inputs_.size(); }

  const std::vector<Value*>& outputs() const { return outputs_; }
  void add_output(Value* value);
  void set_output(size_t i, Value* value);
  void set_outputs(std::vector<Value*> values);

  // ---- nodes ----
  // Creates a node of `op` before `before` (null: at the end), infers its result types and
  // names it `name` (empty: a fresh name from `name_hint`, default "v"). Throws
  // InvalidArgument / ShapeError when operands or attributes do not fit the op, or when
  // `name` is invalid or taken. `attrs` must be a full vector (see make_attrs).
  Node* create_node(const OpDef& op, std::vector<Value*> operands, std::vector<Attr> attrs,
                    Node* before = nullptr, std::string name = {},
                    std::string_view name_hint = {});
  // Appends a node whose attributes and result types the caller already checked (the parser,
  // which has just run shape inference). `name` must be valid and free.
  Node* append_checked_node(const OpDef& op, std::vector<Value*> operands,
                            std::vector<Attr> attrs, std::vector<Type> types, std::string name,
                            SourceLoc loc);
  // Erases `node`; FUNCOL_CHECK that none of its results has a use.
  void erase(Node* node);
  // Moves `node` before `before` (null: to the end). Keeping the order valid is the caller's job.
  void move_before(Node* node, Node* before);
  // Points every use of `from` (operands and graph outputs) at `to`.
  void replace_all_uses(Value* from, Value* to);
  // Re-runs shape inference of `node` and updates its result types (after set_attr or
  // set_operand); throws like create_node.
  void reinfer(Node* node);

  Node* first_node() const { return first_; }
  Node* last_node() const { return last_; }
  size_t num_nodes() const { return num_nodes_; }
  NodeRange nodes() const { return NodeRange(first_); }
  // The nodes in order, as a snapshot that stays valid while nodes are erased or inserted.
  std::vector<Node*> node_list() const;

  // ---- names ----
  // The node called `name` (without '%'), or null.
  Node* find_node(std::string_view name) const;
  // The input called `name`, or null.
  Value* find_input(std::string_view name) const;
  // What a name defines: a node or a graph input (both null: nothing). One hash lookup.
  struct Definition {
    Node* node = nullptr;
    Value* input = nullptr;
  };
  Definition find_definition(std::string_view name) const;
  // The value written `ref` in IR text ("%x", "%p#1", or the same without '%'), or null.
  Value* find_value(std::string_view ref) const;
  // `hint` when free, else `hint.N` for the smallest free N counting up from a per-graph
  // counter: deterministic for a given sequence of edits.
  std::string fresh_name(std::string_view hint);
  // Letters, digits, '_' and '.', not empty.
  static bool is_valid_name(std::string_view name);

  // ---- order ----
  // Renumbers order keys; done lazily by Node::is_before when needed.
  void renumber() const;

 private:
  friend class Node;
  std::string name_;
  std::string source_file_;
  SourceLoc loc_;
  struct InputStorage {
    Value value;
    std::string name;
  };
  std::vector<std::unique_ptr<InputStorage>> input_storage_;
  std::vector<Value*> inputs_;
  std::vector<Value*> outputs_;
  std::vector<uint32_t> output_use_pos_;  // as Node::use_pos_, for outputs
  Node* first_ = nullptr;
  Node* last_ = nullptr;
  size_t num_nodes_ = 0;
  mutable bool order_valid_ = true;
  uint64_t fresh_counter_ = 0;
  // Operand types handed to shape inference by create_node, kept so that their shapes'
  // storage is reused from node to node.
  std::vector<Type> infer_scratch_;
  // Name -> definition; keys view the names held by nodes and inputs (which never move). An
  // open-addressing table: one flat array, no allocation per name (graph.cc).
  class NameTable;
  std::unique_ptr<NameTable> names_;
  // Storage of the nodes: blocks of node-sized slots, and the slots of erased nodes on a free
  // list, so creating and erasing nodes (which passes do by the hundred thousand) seldom calls
  // malloc. Sanitizer builds allocate each node on its own instead (graph.cc).
  struct NodeSlot;
  // Frees a block: `bytes` 0 for one from new[], else the size of a mapped one (graph.cc).
  struct FreeNodeBlock {
    size_t bytes = 0;
    void operator()(NodeSlot* block) const;
  };
  std::vector<std::unique_ptr<NodeSlot[], FreeNodeBlock>> node_blocks_;
  size_t block_used_ = 0;  // slots handed out from the last block
  size_t block_size_ = 0;  // slots in the last block
  NodeSlot* free_slots_ = nullptr;

  void add_use(Value* value, Use use);
  void remove_use(Value* value, Use use);
  uint32_t& use_pos(Use use) {
    return use.user ? use.user->use_pos(use.index) : output_use_pos_[use.index];
  }
  void link_before(Node* node, Node* before);
  void unlink(Node* node);
  void claim_name(std::string_view name, Definition entry);
  void* allocate_node();
  void release_node(void* slot);
  void destroy_node(Node* node);
  Node* new_node(const OpDef& op, std::vector<Value*> operands, std::vector<Attr> attrs,
                 std::vector<Type> types, std::string name, SourceLoc loc);
};

// The graphs of one IR file, in file order.
class Module {
 public:
  std::vector<std::unique_ptr<Graph>>& graphs() { return graphs_; }
  const std::vector<std::unique_ptr<Graph>>& graphs() const { return graphs_; }
  // The graph called `name` (without '@'), or null.
  Graph* find(std::string_view name) const;
  Graph& add(std::unique_ptr<Graph> graph);

 private:
  std::vector<std::unique_ptr<Graph>> graphs_;
};

// Creates nodes at an insertion point with shape inference, for passes, autodiff and tests.
class Builder {
 public:
  // Inserts before `before`, or at the end of `graph` when null.
  explicit Builder(Graph& graph, Node* before = nullptr) : graph_(&graph), before_(before) {}
  Graph& graph() const { return *graph_; }
  void set_insertion_point(Node* before) { before_ = before; }
  Node* insertion_point() const { return before_; }
  // Nodes get names from `hint` (see Graph::fresh_name); empty hint means "v".
  void set_name_hint(std::string_view hint) { hint_ = hint; }

  // A node of op `op` with named attributes (defaults filled in); throws like create_node.
  Node* create(std::string_view op, std::vector<Value*> operands, const NamedAttrs& attrs = {});
  // The single result of a new single-result node.
  Value* value(std::string_view op, std::vector<Value*> operands, const NamedAttrs& attrs = {});

 private:
  Graph* graph_;
  Node* before_;
  std::string hint_;
};

// Structural equality: same names, input types, node ops, operands, attributes, result types
// and outputs, in the same order (source locations are ignored). On inequality, `why` (when
// given) receives a one-line description of the first difference.
bool structurally_equal(const Graph& a, const Graph& b, std::string* why = nullptr);
bool structurally_equal(const Module& a, const Module& b, std::string* why = nullptr);

// Where `node` was written in the IR text its graph was parsed from, with `message` (the error
// message without that location); nullopt for a node built in code.
std::optional<SourceLocated> source_of(const Node& node, std::string message);

// Throws E (an Error type) about `node`: what() is `what`, which names the node and its place
// in its own words; for a parsed node the error is a LocatedError<E> at the node's
// FILE:LINE:COL with message `bare` (no location), so a tool prints "FILE:LINE:COL: error: bare".
template <class E>
[[noreturn]] void throw_at(const Node& node, const std::string& what, std::string bare) {
  if (auto at = source_of(node, std::move(bare))) {
    throw LocatedError<E>(what, at->file(), at->line(), at->col(), at->message());
  }
  throw E(what);
}

}  // namespace funcol
