// Graph, Node and Value: node order, use-lists, names and the edits passes make.
#include "funcol/graph/graph.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

#include <algorithm>
#include <charconv>
#include <limits>
#include <optional>
#include <unordered_map>
#include <utility>

#include <fmt/format.h>

#include "funcol/core/error.h"

namespace funcol {
namespace {

// Order keys are spaced this far apart when renumbered, so ~32 insertions at one place fit
// before the next renumbering.
constexpr int64_t kOrderStep = int64_t{1} << 32;

}  // namespace

// ---- NameTable ------------------------------------------------------------------------------

// Names live in one of two places. Names fresh_name makes from the graph's counter
// ("ag_flat.17": its number is unique to it) and that then name a node go into `numbered_`,
// indexed by that number: new nodes get consecutive numbers, so creating and erasing them
// touches memory in order instead of one random hash slot each. Every other name goes into
// the hash table: linear probing over a power-of-two array of {hash, key, definition}, at
// most half full; deletion shifts later entries back, so there are no tombstones. A lookup
// usually touches one slot plus the key's bytes.
class Graph::NameTable {
 public:
  NameTable() : slots_(16) {}

  Definition find(std::string_view key) const {
    if (Node* n = numbered(key)) return Definition{n, nullptr};
    return hashed_find(key);
  }

  bool contains(std::string_view key) const {
    const Definition d = find(key);
    return d.node || d.input;
  }

  // False (and no change) when `key` is present.
  bool insert(std::string_view key, Definition def) {
    if (pending_ != 0 && def.node && key == pending_name_) {
      // The name fresh() made last: its number is no other numbered name's, and no hashed
      // name is equal to it when its number is past every hashed one's.
      const uint64_t n = std::exchange(pending_, 0);
      const Definition same = n > suffix_floor_ ? Definition{} : hashed_find(key);
      if (!same.node && !same.input) {
        if (numbered_.size() <= n) {
          numbered_.resize(std::max(static_cast<size_t>(n) + 1, 2 * numbered_.size()));
        }
        numbered_[n] = def.node;
        return true;
      }
    }
    if (numbered(key)) return false;
    if (2 * (size_ + 1) > slots_.size()) grow();
    const uint32_t h = hash(key);
    size_t i = h & mask();
    for (; slots_[i].hash != 0; i = (i + 1) & mask()) {
      if (slots_[i].hash == h && slots_[i].key() == key) return false;
    }
    slots_[i] = Slot(key, h, def);
    ++size_;
    note_suffix(key);
    return true;
  }

  void erase(std::string_view key) {
    if (const auto n = numbered_index(key)) {
      numbered_[*n] = nullptr;
      return;
    }
    const uint32_t h = hash(key);
    size_t i = h & mask();
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].hash == 0) return;
      if (slots_[i].hash == h && slots_[i].key() == key) break;
    }
    // Backward-shift deletion: move later entries of the cluster into the hole when their home
    // slot is not after the hole (cyclically).
    size_t hole = i;
    for (size_t j = (i + 1) & mask(); slots_[j].hash != 0; j = (j + 1) & mask()) {
      const size_t home = slots_[j].hash & mask();
      if (((j - home) & mask()) >= ((j - hole) & mask())) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
  }

  // Graph::fresh_name, with the graph's counter.
  std::string fresh(std::string_view hint, uint64_t& counter) {
    const std::string_view base = is_valid_name(hint) ? hint : std::string_view("v");
    if (!contains(base)) return std::string(base);
    // Candidates are written into one buffer ("base." once, then only the digits), and a
    // string is made only for the one returned.
    constexpr size_t kDigits = std::numeric_limits<uint64_t>::digits10 + 1;
    std::vector<char> heap;
    char local[64];
    char* buf = local;
    if (base.size() + 1 + kDigits > sizeof(local)) {
      heap.resize(base.size() + 1 + kDigits);
      buf = heap.data();
    }
    std::copy(base.begin(), base.end(), buf);
    buf[base.size()] = '.';
    char* const digits = buf + base.size() + 1;
    for (;;) {
      const auto r = std::to_chars(digits, digits + kDigits, ++counter);
      const std::string_view candidate(buf, static_cast<size_t>(r.ptr - buf));
      // A number past every hashed name's is free without a lookup (the counter only grows,
      // so the numbered names made before have smaller numbers).
      if (counter > suffix_floor_ || !contains(candidate)) {
        pending_name_.assign(candidate);
        pending_ = counter;
        return pending_name_;
      }
    }
  }

 private:
  // 24 bytes: the key's bytes (owned by the node or input), a 32-bit hash (0: empty) and the
  // definition as a pointer whose low bit says "input".
  struct Slot {
    const char* data = nullptr;
    uint32_t size = 0;
    uint32_t hash = 0;
    uintptr_t def = 0;

    Slot() = default;
    Slot(std::string_view key, uint32_t h, Definition d)
        : data(key.data()),
          size(static_cast<uint32_t>(key.size())),
          hash(h),
          def(d.input ? reinterpret_cast<uintptr_t>(d.input) | 1 : reinterpret_cast<uintptr_t>(d.node)) {}
    std::string_view key() const { return std::string_view(data, size); }
    Definition definition() const {
      if (def & 1) return Definition{nullptr, reinterpret_cast<Value*>(def & ~uintptr_t{1})};
      return Definition{reinterpret_cast<Node*>(def), nullptr};
    }
  };
  static_assert(alignof(Value) >= 2 && alignof(Node) >= 2);
  std::vector<Slot> slots_;
  size_t size_ = 0;
  // No hashed name ends in '.' and a number larger than this.
  uint64_t suffix_floor_ = 0;
  // Numbered names: the node named with counter value n is numbered_[n] (null: none).
  std::vector<Node*> numbered_;
  // The name fresh() returned last and its number (0: none, or already inserted): inserting
  // exactly that name for a node numbers it.
  std::string pending_name_;
  uint64_t pending_ = 0;

  // The number after the last '.' of `key` (saturating at the largest uint64_t), or
  // nothing when `key` does not end in '.' and digits.
  static std::optional<uint64_t> suffix(std::string_view key) {
    const size_t dot = key.rfind('.');
    if (dot == std::string_view::npos || dot + 1 == key.size()) return std::nullopt;
    uint64_t n = 0;
    for (size_t i = dot + 1; i < key.size(); ++i) {
      const char c = key[i];
      if (c < '0' || c > '9') return std::nullopt;
      const auto d = static_cast<uint64_t>(c - '0');
      n = n > (std::numeric_limits<uint64_t>::max() - d) / 10 ? std::numeric_limits<uint64_t>::max()
                                                               : n * 10 + d;
    }
    return n;
  }

  void note_suffix(std::string_view key) {
    if (const auto n = suffix(key)) suffix_floor_ = std::max(suffix_floor_, *n);
  }

  // Where in numbered_ the node named `key` is, or nothing when `key` is not numbered.
  std::optional<size_t> numbered_index(std::string_view key) const {
    if (numbered_.empty()) return std::nullopt;
    const auto n = suffix(key);
    if (!n || *n >= numbered_.size()) return std::nullopt;
    const Node* node = numbered_[*n];
    if (!node || node->name() != key) return std::nullopt;
    return static_cast<size_t>(*n);
  }
  // The node whose numbered name is `key`, or null.
  Node* numbered(std::string_view key) const {
    const auto n = numbered_index(key);
    return n ? numbered_[*n] : nullptr;
  }

  Definition hashed_find(std::string_view key) const {
    const uint32_t h = hash(key);
    for (size_t i = h & mask(); slots_[i].hash != 0; i = (i + 1) & mask()) {
      if (slots_[i].hash == h && slots_[i].key() == key) return slots_[i].definition();
    }
    return Definition{};
  }

  size_t mask() const { return slots_.size() - 1; }
  static uint32_t hash(std::string_view key) {
    const auto h = static_cast<uint32_t>(std::hash<std::string_view>{}(key));
    return h == 0 ? 1 : h;
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.size() * 2, Slot{});
    for (const Slot& s : old) {
      if (s.hash == 0) continue;
      size_t i = s.hash & mask();
      while (slots_[i].hash != 0) i = (i + 1) & mask();
      slots_[i] = s;
    }
  }
};

// ---- node storage ---------------------------------------------------------------------------

// Raw storage for one Node; while free, it holds the next free slot instead.
struct Graph::NodeSlot {
  alignas(Node) unsigned char bytes[sizeof(Node)];
};

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kPoolNodes = false;  // one allocation per node, so ASan sees use after erase
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kPoolNodes = false;
#else
constexpr bool kPoolNodes = true;
#endif
#else
constexpr bool kPoolNodes = true;
#endif

// Blocks start small (most graphs are small) and double up to this many slots; after that
// (a graph of over 8,000 nodes), each block is kBigBlockBytes mapped on its own.
constexpr size_t kMinBlockSlots = 16;
constexpr size_t kMaxBlockSlots = 4096;
#ifdef __linux__
// A big block is 2 MiB aligned and advised to the kernel as huge-page memory: a graph of
// 100,000 collectives has about 75 MB of nodes, and one fault for every 4 KiB page of it took
// about a fifth of bucket_collectives' time on a VM host whose page faults cost 1.5-2 us
// (RESULTS.md, session 49). Where the kernel gives no huge page, it is plain memory.
constexpr size_t kHugePageBytes = size_t{2} << 20;
constexpr size_t kBigBlockBytes = 2 * kHugePageBytes;

// kBigBlockBytes, kHugePageBytes aligned, or nullptr.
void* map_big_block() {
  // Map one huge page more than needed and unmap the ends, leaving an aligned range.
  const size_t span = kBigBlockBytes + kHugePageBytes;
  void* p = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (start + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  if (aligned > start) munmap(p, aligned - start);
  const uintptr_t end = aligned + kBigBlockBytes;
  if (start + span > end) munmap(reinterpret_cast<void*>(end), start + span - end);
  madvise(reinterpret_cast<void*>(aligned), kBigBlockBytes, MADV_HUGEPAGE);  // a hint
  return reinterpret_cast<void*>(aligned);
}
#endif

}  // namespace

void Graph::FreeNodeBlock::operator()(NodeSlot* block) const {
#ifdef __linux__
  if (bytes != 0) {
    munmap(block, bytes);
    return;
  }
#endif
  delete[] block;
}

void* Graph::allocate_node() {
  if constexpr (!kPoolNodes) return ::operator new(sizeof(Node));
  if (free_slots_) {
    NodeSlot* slot = free_slots_;
    free_slots_ = *reinterpret_cast<NodeSlot**>(slot->bytes);
    return slot->bytes;
  }
  if (block_used_ == block_size_) {
    // The counts change only once the block is listed (a failed push_back leaves them be).
    std::unique_ptr<NodeSlot[], FreeNodeBlock> block;
    size_t slots = 0;
#ifdef __linux__
    if (block_size_ >= kMaxBlockSlots) {
      if (void* p = map_big_block()) {
        block = std::unique_ptr<NodeSlot[], FreeNodeBlock>(static_cast<NodeSlot*>(p),
                                                           FreeNodeBlock{kBigBlockBytes});
        slots = kBigBlockBytes / sizeof(NodeSlot);
      }
    }
#endif
    if (!block) {
      slots = block_size_ == 0 ? kMinBlockSlots : std::min(2 * block_size_, kMaxBlockSlots);
      block.reset(new NodeSlot[slots]);
    }
    node_blocks_.push_back(std::move(block));
    block_size_ = slots;
    block_used_ = 0;
  }
  return node_blocks_.back()[block_used_++].bytes;
}

void Graph::release_node(void* slot) {
  if constexpr (!kPoolNodes) {
    ::operator delete(slot);
    return;
  }
  auto* s = static_cast<NodeSlot*>(slot);
  *reinterpret_cast<NodeSlot**>(s->bytes) = free_slots_;
  free_slots_ = s;
}

void Graph::destroy_node(Node* node) {
  node->~Node();
  release_node(node);
}

// ---- Value ----------------------------------------------------------------------------------

std::string Value::name() const {
  if (!node_) return *input_name_;
  if (!node_->op().multi_result()) return node_->name();
  return node_->name() + "#" + std::to_string(index_);
}

// ---- Node -----------------------------------------------------------------------------------

void Node::set_operand(size_t i, Value* value) {
  FUNCOL_CHECK(i < operands_.size(), "operand index out of range");
  FUNCOL_CHECK(value != nullptr, "null operand");
  Value*& slot = operands_[i];
  if (slot == value) return;
  const Use use{this, static_cast<uint32_t>(i)};
  graph_->remove_use(slot, use);
  slot = value;
  graph_->add_use(value, use);
}

bool Node::has_uses() const {
  for (size_t i = 0; i < num_results_; ++i) {
    if (result(i)->has_uses()) return true;
  }
  return false;
}

void Node::set_attr(std::string_view name, Attr value) {
  const int i = op_->attr_index(name);
  if (i < 0) throw InvalidArgument(fmt::format("unknown attribute '{}' for op {}", name, op_->name));
  coerce_attr(*op_, op_->attrs[static_cast<size_t>(i)], value);
  attrs_[static_cast<size_t>(i)] = std::move(value);
}

bool Node::is_before(const Node& other) const {
  FUNCOL_CHECK(graph_ == other.graph_, "is_before on nodes of different graphs");
  if (!graph_->order_valid_) graph_->renumber();
  return order_ < other.order_;
}

// ---- Graph ----------------------------------------------------------------------------------

Graph::Graph(std::string name) : name_(std::move(name)), names_(std::make_unique<NameTable>()) {
  if (!is_valid_name(name_) || name_.size() > (size_t{1} << 20)) {
    throw InvalidArgument(fmt::format("invalid graph name '{}' (1 to 2^20 letters, digits, '_', '.')",
                                      name_.substr(0, 64)));
  }
}

Graph::Graph(Graph&& other) noexcept
    : name_(std::move(other.name_)),
      source_file_(std::move(other.source_file_)),
      loc_(other.loc_),
      input_storage_(std::move(other.input_storage_)),
      inputs_(std::move(other.inputs_)),
      outputs_(std::move(other.outputs_)),
      output_use_pos_(std::move(other.output_use_pos_)),
      first_(other.first_),
      last_(other.last_),
      num_nodes_(other.num_nodes_),
      order_valid_(other.order_valid_),
      fresh_counter_(other.fresh_counter_),
      names_(std::move(other.names_)),
      node_blocks_(std::move(other.node_blocks_)),
      block_used_(other.block_used_),
      block_size_(other.block_size_),
      free_slots_(other.free_slots_) {
  other.first_ = other.last_ = nullptr;
  other.num_nodes_ = 0;
  other.node_blocks_.clear();
  other.block_used_ = other.block_size_ = 0;
  other.free_slots_ = nullptr;
  for (Node* n = first_; n; n = n->next_) n->graph_ = this;
}

Graph::~Graph() {
  Node* n = first_;
  while (n) {
    Node* next = n->next_;
    destroy_node(n);
    n = next;
  }
}

void Graph::set_source(std::string file, SourceLoc loc) {
  source_file_ = std::move(file);
  loc_ = loc;
}

bool Graph::is_valid_name(std::string_view name) {
  if (name.empty()) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.';
  });
}

void Graph::claim_name(std::string_view name, Definition entry) {
  if (!is_valid_name(name) || name.size() > (size_t{1} << 20)) {
    throw InvalidArgument(fmt::format("invalid value name '{}' (1 to 2^20 letters, digits, '_', '.')",
                                      name.substr(0, 64)));
  }
  if (!names_->insert(name, entry)) {
    throw InvalidArgument(fmt::format("value name %{} is already defined in graph @{}", name, name_));
  }
}

Value* Graph::add_input(std::string name, Type type, SourceLoc loc) {
  auto in = std::make_unique<InputStorage>();
  in->name = std::move(name);
  Value* v = &in->value;
  v->type_ = std::move(type);
  v->index_ = static_cast<uint32_t>(inputs_.size());
  v->loc_ = loc;
  v->input_name_ = &in->name;
  claim_name(in->name, Definition{nullptr, v});
  inputs_.push_back(v);
  input_storage_.push_back(std::move(in));
  return v;
}

void Graph::add_use(Value* value, Use use) {
  use_pos(use) = static_cast<uint32_t>(value->uses_.size());
  value->uses_.push_back(use);
}

void Graph::remove_use(Value* value, Use use) {
  const uint32_t pos = use_pos(use);
  FUNCOL_CHECK(pos < value->uses_.size() && value->uses_[pos] == use,
               "use-list of " + value->ref() + " lacks a use");
  const Use last = value->uses_.back();
  value->uses_[pos] = last;
  use_pos(last) = pos;
  value->uses_.pop_back();
}

void Graph::add_output(Value* value) {
  FUNCOL_CHECK(value != nullptr, "null output");
  outputs_.push_back(value);
  output_use_pos_.push_back(0);
  add_use(value, Use{nullptr, static_cast<uint32_t>(outputs_.size() - 1)});
}

void Graph::set_output(size_t i, Value* value) {
  FUNCOL_CHECK(i < outputs_.size() && value != nullptr, "bad output index or value");
  const Use use{nullptr, static_cast<uint32_t>(i)};
  if (outputs_[i] == value) return;
  remove_use(outputs_[i], use);
  outputs_[i] = value;
  add_use(value, use);
}

void Graph::set_outputs(std::vector<Value*> values) {
  for (size_t i = 0; i < outputs_.size(); ++i) {
    remove_use(outputs_[i], Use{nullptr, static_cast<uint32_t>(i)});
  }
  outputs_.clear();
  output_use_pos_.clear();
  for (Value* v : values) add_output(v);
}

void Graph::link_before(Node* node, Node* before) {
  node->graph_ = this;
  if (!before) {
    node->prev_ = last_;
    node->next_ = nullptr;
    if (last_) {
      last_->next_ = node;
    } else {
      first_ = node;
    }
    // Appending keeps keys increasing without renumbering (overflow is out of reach: 2^31
    // appends of kOrderStep).
    if (order_valid_) node->order_ = node->prev_ ? node->prev_->order_ + kOrderStep : 0;
    last_ = node;
  } else {
    FUNCOL_CHECK(before->graph_ == this, "insertion point is in another graph");
    node->next_ = before;
    node->prev_ = before->prev_;
    if (before->prev_) {
      before->prev_->next_ = node;
    } else {
      first_ = node;
    }
    before->prev_ = node;
    if (order_valid_) {
      const int64_t lo = node->prev_ ? node->prev_->order_ : before->order_ - 2 * kOrderStep;
      const int64_t hi = before->order_;
      if (hi - lo >= 2) {
        node->order_ = lo + (hi - lo) / 2;
      } else {
        order_valid_ = false;
      }
    }
  }
  ++num_nodes_;
}

void Graph::unlink(Node* node) {
  if (node->prev_) {
    node->prev_->next_ = node->next_;
  } else {
    first_ = node->next_;
  }
  if (node->next_) {
    node->next_->prev_ = node->prev_;
  } else {
    last_ = node->prev_;
  }
  node->prev_ = node->next_ = nullptr;
  --num_nodes_;
}

void Graph::renumber() const {
  int64_t k = 0;
  for (Node* n = first_; n; n = n->next_) {
    n->order_ = k;
    k += kOrderStep;
  }
  order_valid_ = true;
}

Node* Graph::new_node(const OpDef& op, std::vector<Value*> operands, std::vector<Attr> attrs,
                      std::vector<Type> types, std::string name, SourceLoc loc) {
  // The slot goes back to the pool when anything below throws.
  struct Owner {
    Graph* graph;
    Node* node;
    ~Owner() {
      if (node) graph->destroy_node(node);
    }
    Node* get() const { return node; }
    Node* operator->() const { return node; }
    Node* release() { return std::exchange(node, nullptr); }
  };
  Owner node{this, new (allocate_node()) Node()};
  node->op_ = &op;
  node->graph_ = this;
  node->loc_ = loc;
  node->name_ = std::move(name);
  node->operands_.assign(operands);
  if (node->operands_.size() > 2) node->use_pos_more_.resize(node->operands_.size() - 2);
  node->attrs_ = std::move(attrs);
  FUNCOL_CHECK(!types.empty(), fmt::format("{} inferred no result", op.name));
  node->num_results_ = static_cast<uint32_t>(types.size());
  node->more_results_.resize(types.size() - 1);
  for (size_t i = 0; i < types.size(); ++i) {
    Value& v = *node->result(i);
    v.type_ = std::move(types[i]);
    v.node_ = node.get();
    v.index_ = static_cast<uint32_t>(i);
  }
  claim_name(node->name_, Definition{node.get(), nullptr});
  for (size_t i = 0; i < node->operands_.size(); ++i) {
    add_use(node->operands_[i], Use{node.get(), static_cast<uint32_t>(i)});
  }
  return node.release();
}

Node* Graph::create_node(const OpDef& op, std::vector<Value*> operands, std::vector<Attr> attrs,
                         Node* before, std::string name, std::string_view name_hint) {
  // The operand types go into a vector kept by the graph: assigning a Type over an old one
  // reuses its shape's storage, so most nodes allocate nothing here.
  const size_t n = operands.size();
  if (infer_scratch_.size() < n) infer_scratch_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Value* v = operands[i];
    FUNCOL_CHECK(v != nullptr, fmt::format("null operand for {}", op.name));
    FUNCOL_CHECK(v->is_input() ? v->index() < inputs_.size() && inputs_[v->index()] == v
                               : v->node()->graph_ == this,
                 fmt::format("operand {} of {} is from another graph", v->ref(), op.name));
    infer_scratch_[i] = v->type();
  }
  // A node of very many operands does not leave its types behind.
  constexpr size_t kKeptTypes = 64;
  std::vector<Type> types =
      infer_types(op, std::span<const Type>(infer_scratch_.data(), n), attrs);
  if (infer_scratch_.size() > kKeptTypes) infer_scratch_.resize(kKeptTypes);
  if (name.empty()) name = fresh_name(name_hint.empty() ? std::string_view("v") : name_hint);
  Node* node = new_node(op, std::move(operands), std::move(attrs), std::move(types),
                        std::move(name), SourceLoc{});
  link_before(node, before);
  return node;
}

Node* Graph::append_checked_node(const OpDef& op, std::vector<Value*> operands,
                                 std::vector<Attr> attrs, std::vector<Type> types,
                                 std::string name, SourceLoc loc) {
  Node* node = new_node(op, std::move(operands), std::move(attrs), std::move(types),
                        std::move(name), loc);
  link_before(node, nullptr);
  return node;
}

void Graph::erase(Node* node) {
  FUNCOL_CHECK(node && node->graph_ == this, "erase of a node of another graph");
  for (size_t i = 0; i < node->num_results(); ++i) {
    const Value& v = *node->result(i);
    FUNCOL_CHECK(!v.has_uses(), fmt::format("erase of %{} ({}) whose result {} still has {} use(s)",
                                            node->name_, node->op_->name, v.ref(), v.num_uses()));
  }
  for (size_t i = 0; i < node->operands_.size(); ++i) {
    remove_use(node->operands_[i], Use{node, static_cast<uint32_t>(i)});
  }
  names_->erase(node->name_);
  unlink(node);
  destroy_node(node);
}

void Graph::move_before(Node* node, Node* before) {
  FUNCOL_CHECK(node && node->graph_ == this, "move of a node of another graph");
  if (node == before) return;
  unlink(node);
  link_before(node, before);
}

void Graph::replace_all_uses(Value* from, Value* to) {
  FUNCOL_CHECK(from && to, "null value in replace_all_uses");
  if (from == to) return;
  if (to->uses_.empty()) {
    // The common case: `to` is new. The list moves over whole and every use keeps its
    // position, so only the operands (and outputs) need re-pointing.
    to->uses_ = std::move(from->uses_);
    for (const Use& u : to->uses_) {
      if (u.user) {
        u.user->operands_[u.index] = to;
      } else {
        outputs_[u.index] = to;
      }
    }
    return;
  }
  auto uses = std::move(from->uses_);
  for (const Use& u : uses) {
    if (u.user) {
      u.user->operands_[u.index] = to;
    } else {
      outputs_[u.index] = to;
    }
    add_use(to, u);
  }
}

void Graph::reinfer(Node* node) {
  std::vector<Type> in;
  in.reserve(node->operands_.size());
  for (Value* v : node->operands_) in.push_back(v->type());
  std::vector<Type> types = infer_types(*node->op_, in, node->attrs_);
  FUNCOL_CHECK(types.size() == node->num_results(),
               fmt::format("reinfer of %{} changes its result count from {} to {}", node->name_,
                           node->num_results(), types.size()));
  for (size_t i = 0; i < types.size(); ++i) node->result(i)->type_ = std::move(types[i]);
}

std::vector<Node*> Graph::node_list() const {
  std::vector<Node*> out;
  out.reserve(num_nodes_);
  for (Node* n = first_; n; n = n->next_) out.push_back(n);
  return out;
}

Graph::Definition Graph::find_definition(std::string_view name) const { return names_->find(name); }

Node* Graph::find_node(std::string_view name) const { return find_definition(name).node; }

Value* Graph::find_input(std::string_view name) const { return find_definition(name).input; }

Value* Graph::find_value(std::string_view ref) const {
  if (!ref.empty() && ref[0] == '%') ref.remove_prefix(1);
  const size_t hash = ref.find('#');
  const Definition def = find_definition(ref.substr(0, hash));
  if (def.input) return hash == std::string_view::npos ? def.input : nullptr;
  Node* n = def.node;
  if (!n) return nullptr;
  if (hash == std::string_view::npos) {
    return n->op().multi_result() ? nullptr : n->result(0);
  }
  if (!n->op().multi_result()) return nullptr;
  uint64_t index = 0;
  std::string_view digits = ref.substr(hash + 1);
  if (digits.empty() || digits.size() > 9) return nullptr;
  for (char c : digits) {
    if (c < '0' || c > '9') return nullptr;
    index = index * 10 + static_cast<uint64_t>(c - '0');
  }
  return index < n->num_results() ? n->result(index) : nullptr;
}

std::string Graph::fresh_name(std::string_view hint) {
  return names_->fresh(hint, fresh_counter_);
}

// ---- Module ---------------------------------------------------------------------------------

Graph* Module::find(std::string_view name) const {
  for (const auto& g : graphs_) {
    if (g->name() == name) return g.get();
  }
  return nullptr;
}

Graph& Module::add(std::unique_ptr<Graph> graph) {
  graphs_.push_back(std::move(graph));
  return *graphs_.back();
}

// ---- Builder --------------------------------------------------------------------------------

Node* Builder::create(std::string_view op, std::vector<Value*> operands, const NamedAttrs& attrs) {
  const OpDef& def = get_op(op);
  return graph_->create_node(def, std::move(operands), make_attrs(def, attrs), before_, {},
                             hint_);
}

Value* Builder::value(std::string_view op, std::vector<Value*> operands, const NamedAttrs& attrs) {
  Node* n = create(op, std::move(operands), attrs);
  FUNCOL_CHECK(n->num_results() == 1, fmt::format("{} does not have exactly one result", op));
  return n->result(0);
}

// ---- structural equality --------------------------------------------------------------------

namespace {

// Position of a value in its graph: input index, or (node position, result index).
struct ValuePos {
  bool input = false;
  size_t node = 0;
  uint32_t index = 0;
  friend bool operator==(const ValuePos&, const ValuePos&) = default;
};

class Comparer {
 public:
  Comparer(const Graph& a, const Graph& b, std::string* why) : a_(a), b_(b), why_(why) {}

  bool run() {
    if (a_.name() != b_.name()) return fail(fmt::format("graph names @{} and @{} differ", a_.name(), b_.name()));
    if (a_.num_inputs() != b_.num_inputs()) {
      return fail(fmt::format("graph @{}: {} vs {} inputs", a_.name(), a_.num_inputs(), b_.num_inputs()));
    }
    for (size_t i = 0; i < a_.num_inputs(); ++i) {
      const Value* x = a_.input(i);
      const Value* y = b_.input(i);
      if (x->name() != y->name() || x->type() != y->type()) {
        return fail(fmt::format("graph @{}: input {} is %{}: {} vs %{}: {}", a_.name(), i,
                                x->name(), x->type().str(), y->name(), y->type().str()));
      }
    }
    if (a_.num_nodes() != b_.num_nodes()) {
      return fail(fmt::format("graph @{}: {} vs {} nodes", a_.name(), a_.num_nodes(), b_.num_nodes()));
    }
    index(a_, pos_a_);
    index(b_, pos_b_);
    size_t k = 0;
    for (const Node *x = a_.first_node(), *y = b_.first_node(); x; x = x->next(), y = y->next(), ++k) {
      if (!same_node(*x, *y, k)) return false;
    }
    if (a_.outputs().size() != b_.outputs().size()) {
      return fail(fmt::format("graph @{}: {} vs {} outputs", a_.name(), a_.outputs().size(),
                              b_.outputs().size()));
    }
    for (size_t i = 0; i < a_.outputs().size(); ++i) {
      if (!(pos(a_.outputs()[i], pos_a_) == pos(b_.outputs()[i], pos_b_))) {
        return fail(fmt::format("graph @{}: output {} is {} vs {}", a_.name(), i,
                                a_.outputs()[i]->ref(), b_.outputs()[i]->ref()));
      }
    }
    return true;
  }

 private:
  const Graph& a_;
  const Graph& b_;
  std::string* why_;
  std::unordered_map<const Node*, size_t> pos_a_, pos_b_;

  bool fail(std::string msg) {
    if (why_) *why_ = std::move(msg);
    return false;
  }

  static void index(const Graph& g, std::unordered_map<const Node*, size_t>& m) {
    m.reserve(g.num_nodes());
    size_t k = 0;
    for (const Node& n : g.nodes()) m.emplace(&n, k++);
  }

  static ValuePos pos(const Value* v, const std::unordered_map<const Node*, size_t>& m) {
    if (v->is_input()) return ValuePos{true, 0, v->index()};
    auto it = m.find(v->node());
    return ValuePos{false, it == m.end() ? SIZE_MAX : it->second, v->index()};
  }

  bool same_node(const Node& x, const Node& y, size_t k) {
    const auto where = [&] { return fmt::format("graph @{}: node {} (%{})", a_.name(), k, x.name()); };
    if (&x.op() != &y.op()) return fail(fmt::format("{}: op {} vs {}", where(), x.op_name(), y.op_name()));
    if (x.name() != y.name()) return fail(fmt::format("{}: name %{} vs %{}", where(), x.name(), y.name()));
    if (x.num_operands() != y.num_operands()) {
      return fail(fmt::format("{}: {} vs {} operands", where(), x.num_operands(), y.num_operands()));
    }
    for (size_t i = 0; i < x.num_operands(); ++i) {
      if (!(pos(x.operand(i), pos_a_) == pos(y.operand(i), pos_b_))) {
        return fail(fmt::format("{}: operand {} is {} vs {}", where(), i, x.operand(i)->ref(),
                                y.operand(i)->ref()));
      }
    }
    for (size_t i = 0; i < x.attr_values().size(); ++i) {
      if (!(x.attr_values()[i] == y.attr_values()[i])) {
        return fail(fmt::format("{}: attribute '{}' is {} vs {}", where(), x.op().attrs[i].name,
                                x.attr_values()[i].str(), y.attr_values()[i].str()));
      }
    }
    if (x.num_results() != y.num_results()) {
      return fail(fmt::format("{}: {} vs {} results", where(), x.num_results(), y.num_results()));
    }
    for (size_t i = 0; i < x.num_results(); ++i) {
      if (x.result(i)->type() != y.result(i)->type()) {
        return fail(fmt::format("{}: result {} has type {} vs {}", where(), i,
                                x.result(i)->type().str(), y.result(i)->type().str()));
      }
    }
    return true;
  }
};

}  // namespace

bool structurally_equal(const Graph& a, const Graph& b, std::string* why) {
  return Comparer(a, b, why).run();
}

bool structurally_equal(const Module& a, const Module& b, std::string* why) {
  if (a.graphs().size() != b.graphs().size()) {
    if (why) *why = fmt::format("{} vs {} graphs", a.graphs().size(), b.graphs().size());
    return false;
  }
  for (size_t i = 0; i < a.graphs().size(); ++i) {
    if (!structurally_equal(*a.graphs()[i], *b.graphs()[i], why)) return false;
  }
  return true;
}

std::optional<SourceLocated> source_of(const Node& node, std::string message) {
  const SourceLoc loc = node.loc();
  if (!loc.known()) return std::nullopt;
  const std::string& file = node.graph()->source_file();
  return SourceLocated(file.empty() ? "<input>" : file, static_cast<int>(loc.line),
                       static_cast<int>(loc.col), std::move(message));
}

}  // namespace funcol
