// Bucketing of all-gathers, reduce-scatters and all-reduces: one routine, a key and a merge
// function per kind (DESIGN §6; the seed's greedy_bucket_collective_by_mb).
#include "funcol/passes/bucketing.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <iterator>
#include <limits>
#include <numeric>
#include <optional>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "funcol/graph/printer.h"
#include "number.h"

namespace funcol {
namespace {

constexpr int64_t kMinKey = std::numeric_limits<int64_t>::min();
constexpr int64_t kMaxKey = std::numeric_limits<int64_t>::max();
constexpr uint32_t kNoId = std::numeric_limits<uint32_t>::max();

// Bytes of `numel` elements of `dtype`, saturated at kMaxTypeBytes.
int64_t saturating_bytes(int64_t numel, DType dtype) {
  const auto size = static_cast<int64_t>(itemsize(dtype));
  return numel > kMaxTypeBytes / size ? kMaxTypeBytes : numel * size;
}

// ---- per-kind traits ----------------------------------------------------------------------------

// What differs between the three passes besides the merge function.
struct KindSpec {
  CollectiveKind kind;
  std::string_view pass;    // bucket-all-gather
  std::string_view op;      // the op bucketed: all_gather_into_tensor
  std::string_view noun;    // "all gather" (error messages, as the seed words them)
  std::string_view prefix;  // name hint of new nodes: "ag"
};

constexpr KindSpec kKinds[] = {
    {CollectiveKind::AllGather, "bucket-all-gather", "all_gather_into_tensor", "all gather", "ag"},
    {CollectiveKind::ReduceScatter, "bucket-reduce-scatter", "reduce_scatter_tensor",
     "reduce scatter", "rs"},
    {CollectiveKind::AllReduce, "bucket-all-reduce", "all_reduce", "all reduce", "ar"},
};

const KindSpec* find_kind(CollectiveKind kind) {
  for (const KindSpec& k : kKinds) {
    if (k.kind == kind) return &k;
  }
  return nullptr;
}

const KindSpec& kind_spec(CollectiveKind kind) {
  const KindSpec* k = find_kind(kind);
  if (!k) {
    throw InvalidArgument(
        fmt::format("collectives of kind {} are not bucketed (all_gather, "
                    "reduce_scatter and all_reduce are)",
                    collective_kind_name(kind)));
  }
  return *k;
}

// Shortest text that reads back as `v` ("0.0001", "25", "1e-12").
std::string fmt_double(double v) { return fmt::format("{}", v); }

// ---- order keys ---------------------------------------------------------------------------------

// Integer positions of the graph's nodes, kept up to date as the pass inserts, erases and moves
// nodes, so "is a before b" and "the latest of these" are O(1) lookups. New nodes get keys
// spread evenly inside the gap of their neighbours; only when a gap is exhausted is the whole
// graph renumbered (the graph's own order keys renumber globally once 32 nodes land in one
// gap, which a bucket of many members would trigger on every bucket). Each node also gets a
// dense id for the per-node scratch arrays of the pass.
class OrderIndex {
 public:
  static constexpr int64_t kStep = int64_t{1} << 32;

  // Numbers the nodes in graph order, calling visit(node) on each (one walk for both).
  template <typename Visit>
  OrderIndex(Graph& graph, Visit&& visit) : graph_(&graph) {
    slots_.reserve(graph.num_nodes() + graph.num_nodes() / 4 + 16);
    int64_t k = 0;
    for (Node& n : graph.nodes()) {
      enter(&n, k);
      k += kStep;
      visit(n);
    }
  }

  struct Pos {
    uint32_t id;
    int64_t key;
  };
  Pos pos(const Node* n) const {
    const uint32_t id = n->scratch();
    FUNCOL_CHECK(registered(n), "bucketing: node without an order key");
    return {id, slots_[id].key};
  }
  uint32_t id(const Node* n) const { return pos(n).id; }
  int64_t key(const Node* n) const { return pos(n).key; }
  // Key of the node defining `v`; graph inputs come before every node.
  int64_t def_key(const Value* v) const { return v->node() ? key(v->node()) : kMinKey; }
  // One more than the largest id handed out (sizes the scratch arrays).
  size_t id_bound() const { return slots_.size(); }

  // Makes room for `more` nodes to be added without moving the table.
  void reserve_more(size_t more) {
    const size_t want = slots_.size() + more;
    if (want > slots_.capacity()) slots_.reserve(std::max(want, 2 * slots_.capacity()));
  }
  uint32_t add(const Node* n) {
    FUNCOL_CHECK(!registered(n), "bucketing: node registered twice");
    return enter(n, kMinKey);
  }
  // Forgets `n` (about to be erased); its id is never handed out again.
  void remove(const Node* n) {
    FUNCOL_CHECK(registered(n), "bucketing: node without an order key");
    slots_[n->scratch()].node = nullptr;
  }

  // Keys the consecutive nodes first..last (count of them) evenly between their neighbours.
  void rekey(Node* first, Node* last, size_t count) {
    const Node* prev = first->prev();
    const Node* next = last->next();
    const int64_t lo = prev ? key(prev) : kMinKey / 2;
    const int64_t hi = next ? key(next) : kMaxKey / 2;
    // Need count distinct keys strictly inside (lo, hi).
    const auto room = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo);
    if (room <= count + 1) {
      relabel();
      return;
    }
    const uint64_t step = room / (count + 1);
    uint64_t k = static_cast<uint64_t>(lo);
    for (Node* n = first;; n = n->next()) {
      k += step;
      slot(n).key = static_cast<int64_t>(k);
      if (n == last) break;
    }
  }

  // Renumbers every node kStep apart, in graph order.
  void relabel() {
    int64_t k = 0;
    for (const Node& n : graph_->nodes()) {
      slot(&n).key = k;
      k += kStep;
    }
  }

 private:
  // Indexed by id; the id of a node lives in its scratch word (Node::scratch), so a lookup is
  // two loads and no hashing. `node` confirms the id (a node the index never entered holds
  // whatever an earlier pass left there) and is null once the node is removed.
  struct Slot {
    const Node* node;
    int64_t key;
  };
  Graph* graph_;
  std::vector<Slot> slots_;

  bool registered(const Node* n) const {
    const uint32_t id = n->scratch();
    return id < slots_.size() && slots_[id].node == n;
  }
  uint32_t enter(const Node* n, int64_t key) {
    FUNCOL_CHECK(slots_.size() < kNoId, "bucketing: too many nodes");
    const auto id = static_cast<uint32_t>(slots_.size());
    n->set_scratch(id);
    slots_.push_back({n, key});
    return id;
  }
  Slot& slot(const Node* n) {
    FUNCOL_CHECK(registered(n), "bucketing: node without an order key");
    return slots_[n->scratch()];
  }
};

// ---- bucket keys --------------------------------------------------------------------------------

// Collectives merge only within a run of equal keys. The kind is implicit (one pass, one op).
struct BucketKey {
  std::string group;
  int64_t group_size = 0;  // all-gather and reduce-scatter
  std::string reduce_op;   // reduce-scatter and all-reduce
  bool has_dtype = true;   // false for multidtype all-gather
  DType dtype = DType::F32;
  friend bool operator==(const BucketKey&, const BucketKey&) = default;

  std::string str() const {
    // Quoted as the IR prints it: a name with a quote or a newline keeps the line readable.
    std::string s = "group ";
    print_string_literal(group, s);
    if (group_size) s += fmt::format(", group_size {}", group_size);
    if (!reduce_op.empty()) s += fmt::format(", reduce_op {}", reduce_op);
    if (has_dtype) s += fmt::format(", dtype {}", dtype_name(dtype));
    return s;
  }
};

// One collective met in wait order.
struct Entry {
  Node* coll = nullptr;
  Node* wait = nullptr;
  bool eligible = false;
  std::string ineligible_why;
  Node* cast = nullptr;          // folded convert_element_type (all-gather), or null
  bool packed = false;           // an all_gather_into_tensor_packed: a bucket already
  // A bucket an earlier pass made (packed, or over a packing cat / bucket_pack): checked
  // against the cap before its dependencies (Bucketer::run).
  bool made_bucket = false;
  bool pack_taken = false;  // a later round's bucket packs what its pack did (pack_parts)
  DType out_dtype = DType::F32;  // the collective's dtype (a folded cast converts into it)
  int64_t bytes = 0;             // max(input bytes, output bytes)
  BucketKey key;
  int32_t index = 0;             // position in wait order (among all entries)

  // What gets packed: the cast's input, else the collective's input. Read when needed, never
  // cached: merging an earlier bucket re-points operands at its unpacked values.
  Value* source() const { return cast ? cast->operand(0) : coll->operand(0); }
};

std::string bytes_str(int64_t b) { return fmt::format("{} B", b); }
// a + b bytes, exact where int64 cannot hold the sum (each is at most kMaxTypeBytes = 2^62).
std::string sum_bytes_str(int64_t a, int64_t b) {
  return fmt::format("{} B", static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}

// ---- node emission ------------------------------------------------------------------------------

// The ops made once per member, looked up once (not by name per node).
struct MemberOps {
  const OpDef& clone = get_op("clone");
  const OpDef& convert = get_op("convert_element_type");
  const OpDef& flatten = get_op("flatten");
  const OpDef& reshape = get_op("reshape");
  const OpDef& view_dtype = get_op("view_dtype");
};

const MemberOps& member_ops() {
  static const MemberOps ops;
  return ops;
}

// The attribute vector of an op with one attribute, `value` moved in.
std::vector<Attr> attrs1(Attr value) {
  std::vector<Attr> attrs;
  attrs.reserve(1);
  attrs.push_back(std::move(value));
  return attrs;
}

// Creates nodes through a Builder and remembers them, in order.
class Emitter {
 public:
  Emitter(Graph& g, Node* before) : b_(g, before) {}
  // A node of `op` whose full attribute vector (schema order) the caller built: no op lookup
  // by name and no copies of the values, for the nodes made once per member. What make_attrs
  // would do is checked instead: one value per schema entry, each of its entry's kind, and no
  // entry that canonicalizes its value.
  Value* value(const OpDef& op, std::vector<Value*> operands, std::vector<Attr> attrs,
               const std::string& hint) {
    FUNCOL_CHECK(attrs.size() == op.attrs.size(), "bucketing: incomplete attributes");
    for (size_t i = 0; i < attrs.size(); ++i) {
      FUNCOL_CHECK(attrs[i].kind() == op.attrs[i].kind && !op.attrs[i].canonicalize,
                   "bucketing: attribute of the wrong kind");
    }
    Node* n = b_.graph().create_node(op, std::move(operands), std::move(attrs),
                                     b_.insertion_point(), {}, hint);
    created_.push_back(n);
    return n->result(0);
  }
  Node* node(std::string_view op, std::vector<Value*> operands, const NamedAttrs& attrs,
             std::string_view hint) {
    b_.set_name_hint(hint);
    Node* n = b_.create(op, std::move(operands), attrs);
    created_.push_back(n);
    return n;
  }
  Value* value(std::string_view op, std::vector<Value*> operands, const NamedAttrs& attrs,
               std::string_view hint) {
    return node(op, std::move(operands), attrs, hint)->result(0);
  }
  const std::vector<Node*>& created() const { return created_; }
  void reserve(size_t n) { created_.reserve(n); }

 private:
  Builder b_;
  std::vector<Node*> created_;
};

// ---- the routine --------------------------------------------------------------------------------

// Packed buffers made by a bucket_collectives call's rounds (looked up, never iterated).
using RoundPacks = std::unordered_set<const Node*>;

class Bucketer {
 public:
  // `round` counts the runs of the walk over `graph` (bucket_collectives); `retry_work` is what
  // the earlier rounds' later tries spent of the pass's budget.
  Bucketer(Graph& graph, const BucketOptions& options, std::string* explain, int round = 1,
           int64_t retry_work = 0, RoundPacks* round_packs = nullptr)
      : graph_(graph),
        opt_(options),
        spec_(kind_spec(options.kind)),
        explain_(explain),
        order_(graph,
               [this](Node& n) {
                 if (n.op().collective == CollectiveKind::Wait) {
                   waits_.push_back(&n);
                 } else if (takes_part(n)) {
                   colls_.push_back(&n);
                 }
               }),
        hints_(spec_.prefix),
        round_(round),
        retry_work_(retry_work),
        round_packs_(round_packs) {}

  BucketingStats run();
  // Whether a bucket's first try dropped members (they may merge once later buckets have).
  bool dropped_on_first_try() const { return dropped_on_first_try_; }
  // Whether the budget of later tries left members untried.
  bool budget_spent() const { return budget_spent_; }
  int64_t retry_work() const { return retry_work_; }

 private:
  // Dependency-search states of a node within the current bucket's epoch.
  enum : uint8_t { kClean = 0, kDirty = 1, kOpen = 2 };

  Graph& graph_;
  const BucketOptions& opt_;
  const KindSpec& spec_;
  std::string* explain_;
  std::vector<Node*> waits_;  // every wait_tensor, in graph order (filled by order_'s walk)
  std::vector<Node*> colls_;  // every collective takes_part admits, in graph order (likewise)
  std::vector<Node*> unwaited_;  // those of colls_ that no wait_tensor reads (filled by collect)
  OrderIndex order_;
  BucketingStats stats_;
  // Name hints of new nodes ("ag_pack", ...), built once rather than per node.
  struct Hints {
    explicit Hints(std::string_view prefix)
        : bucket(make(prefix, "bucket")),
          bytes(make(prefix, "bytes")),
          cast(make(prefix, "cast")),
          cat(make(prefix, "cat")),
          copy(make(prefix, "copy")),
          flat(make(prefix, "flat")),
          out(make(prefix, "out")),
          pack(make(prefix, "pack")),
          rows(make(prefix, "rows")),
          split(make(prefix, "split")),
          view(make(prefix, "view")),
          wait(make(prefix, "wait")) {}
    static std::string make(std::string_view prefix, std::string_view suffix) {
      return fmt::format("{}_{}", prefix, suffix);
    }
    std::string bucket, bytes, cast, cat, copy, flat, out, pack, rows, split, view, wait;
  } hints_;

  // Current bucket.
  std::vector<Entry*> bucket_;
  int64_t bucket_bytes_ = 0;
  int64_t first_key_ = kMaxKey;  // smallest key of a member collective
  int32_t first_index_ = 0;      // Entry::index of the first member
  int64_t bucket_index_ = 0;

  // Per-node scratch, indexed by OrderIndex id; a slot is valid when its epoch is current.
  uint32_t epoch_ = 0;
  std::vector<uint32_t> mark_epoch_;
  std::vector<uint8_t> state_;
  std::vector<uint32_t> witness_;  // the dirty operand's id that made a node dirty
  std::vector<uint32_t> item_;     // region sort: item index of a node
  uint32_t item_epoch_ = 0;
  std::vector<uint32_t> item_mark_;
  // Per node id: at least the largest Entry::index of an eligible collective that is the node
  // or one of its ancestors (-1: none). A node below the bucket's first member's index cannot
  // depend on the bucket (its members come later in wait order), so the dependency search
  // stops there instead of walking compute chains that lead back to earlier collectives only.
  // Set for the whole graph once, and for each bucket's new nodes as they are made.
  std::vector<int32_t> latest_;
  // The explanation's dependency paths: a node's distance (in nodes) to the member its witness
  // chain ends at, valid when hops_epoch_ is the current epoch.
  std::vector<uint32_t> hops_;
  std::vector<uint32_t> hops_epoch_;
  std::vector<std::pair<uint32_t, size_t>> walked_;
  // depends_on_bucket's search stack, kept between calls.
  struct Frame {
    const Node* node;
    uint32_t id;
    uint32_t next_operand;
  };
  std::vector<Frame> stack_;
  std::vector<std::pair<int64_t, int64_t>> member_keys_;  // place_normally's scratch
  bool no_pair_fits_ = false;  // set by merge(): no two of its members have one placement
  // Set by merge() when it merged the largest group of best_gap_members's cover: the cover's
  // other groups, in its order (each in wait order). Empty otherwise.
  std::vector<std::vector<Entry*>> cover_rest_;
  int64_t region_work_ = 0;  // nodes collect_region collected, over the whole pass
  int round_;
  // What close_bucket's later tries cost, over the whole pass (every round): the region nodes
  // they collected and their members.
  int64_t retry_work_;
  bool dropped_on_first_try_ = false;
  bool budget_spent_ = false;
  // The packed buffers the earlier rounds of bucket_collectives made, and this round's (null:
  // not kept). A bucket of a later round takes over such a member's packing: it packs what the
  // member's pack packed, not the pack (which would copy its bytes once more).
  RoundPacks* round_packs_;
  // Nodes the merge in progress left unused (taken-over packs, members whose unpacking it took
  // over, with what read them), erased once the bucket is placed: a placement may still walk
  // past them.
  std::vector<Node*> dead_;

  void grow_scratch() {
    const size_t n = order_.id_bound();
    if (mark_epoch_.size() >= n) return;
    const size_t cap = std::max(n, mark_epoch_.size() * 2);
    mark_epoch_.resize(cap, 0);
    state_.resize(cap, kClean);
    witness_.resize(cap, kNoId);
    item_.resize(cap, 0);
    item_mark_.resize(cap, 0);
    latest_.resize(cap, std::numeric_limits<int32_t>::max());
    hops_.resize(cap, 0);
    hops_epoch_.resize(cap, 0);
  }

  // "%a (64 B), %b (128 B)": the explain form of a bucket's members.
  static std::string members_str(const std::vector<Entry*>& entries) {
    std::vector<std::string> parts;
    parts.reserve(entries.size());
    for (const Entry* e : entries) {
      parts.push_back(fmt::format("%{} ({})", e->coll->name(), bytes_str(e->bytes)));
    }
    return fmt::format("{}", fmt::join(parts, ", "));
  }
  void say(std::string_view line) {
    if (!explain_) return;
    explain_->append("  ");
    explain_->append(line);
    explain_->push_back('\n');
  }

  // The pass's op, or a packed collective of its kind (an earlier custom_ops bucket).
  bool takes_part(const Node& n) const {
    return n.op_name() == spec_.op || (n.op().pack != nullptr && n.op().collective == opt_.kind);
  }
  std::vector<Entry> collect();
  struct Bounds {
    int64_t lo = kMinKey;
    Node* lo_node = nullptr;
    int64_t hi = kMaxKey;
    Node* hi_node = nullptr;
  };
  Bounds bounds(const std::vector<Entry*>& members) const;
  void find_latest(const std::vector<Entry>& entries);
  void note_new_nodes(const std::vector<Entry*>& members, const std::vector<Node*>& nodes);
  BucketKey key_of(const Node& coll, DType dtype) const;
  bool depends_on_bucket(const Entry& e, std::string* path);
  void add_to_bucket(Entry* e);
  void close_bucket(std::string_view reason);
  bool merge(std::vector<Entry*>& members);
  bool place_normally(const std::vector<Entry*>& members);
  // The nodes plan_region orders, and their neighbours that survive the merge (null: the
  // graph's start or end).
  struct Region {
    std::vector<Node*> nodes;
    Node* before = nullptr;
    Node* anchor = nullptr;
  };
  void collect_region(const std::vector<Entry*>& members, const Bounds& b, Region& region);
  std::optional<std::vector<uint32_t>> plan_region(const std::vector<Entry*>& members,
                                                   Region& region);
  std::vector<Entry*> best_gap_members(const std::vector<Entry*>& members, const Region& region);
  std::vector<Entry*> kept_by_ranges(const std::vector<Entry*>& members, Region& region);
  void emit_region(const std::vector<Entry*>& members, const Region& region,
                   const std::vector<uint32_t>& order);
  DType bucket_dtype(const std::vector<Entry*>& members) const;
  Node* emit_pack(Emitter& x, const std::vector<Entry*>& members, DType bucket);
  Node* emit_pack_nodes(Emitter& x, const std::vector<Entry*>& members, DType bucket);
  // What `m` packs: its source, or the parts of an earlier round's pack it is fed by (the pack
  // goes to dead_, m.pack_taken is set), when the bucket's packing lays them out as that pack
  // did. Only for the bucket being emitted (its placement chosen): the pack is erased after.
  std::vector<Value*> pack_parts(Entry& m, DType bucket);
  void erase_dead();
  std::vector<Value*> emit_unpack(Emitter& y, Node* coll, const std::vector<Entry*>& members,
                                  DType bucket);
  // Replaces the members' waits by `replacements` (null: emit_unpack took the member's over),
  // erases the members (or leaves them to erase_dead()) and gives the new nodes
  // (x's and y's) the first member's location.
  void finish(const std::vector<Entry*>& members, const std::vector<Value*>& replacements,
              const Emitter& x, const Emitter& y);
  void key_new_nodes(const std::vector<Node*>& first, const std::vector<Node*>& second);
};

BucketKey Bucketer::key_of(const Node& coll, DType dtype) const {
  BucketKey k;
  const AttrList a = coll.attrs();
  k.group = a.get_string("group");
  if (opt_.kind != CollectiveKind::AllReduce) k.group_size = a.get_int("group_size");
  if (opt_.kind != CollectiveKind::AllGather) k.reduce_op = a.get_string("reduce_op");
  k.has_dtype = !(opt_.kind == CollectiveKind::AllGather && is_multidtype(opt_.mode));
  if (k.has_dtype) k.dtype = dtype;
  return k;
}

// The only user of `v`, or null.
const Node* only_user(const Value* v) {
  const auto uses = v->uses();
  return uses.size() == 1 ? uses[0].user : nullptr;
}

// Whether `name` is one the pass gives a bucket's collective: its name hint `base`
// ("ar_bucket"), or "<base>.N" where that was taken (Graph::fresh_name).
bool bucket_name(std::string_view name, std::string_view base) {
  if (!name.starts_with(base)) return false;
  name.remove_prefix(base.size());
  return name.empty() || (name.size() > 1 && name[0] == '.' &&
                          std::all_of(name.begin() + 1, name.end(),
                                      [](char c) { return c >= '0' && c <= '9'; }));
}

// Whether `coll`, read by `wait`, is a bucket as emit_pack and emit_unpack write one: over a
// bucket_pack, or, named as the pass names its buckets (`bucket_hint`), over the pass's cat
// (flat parts along dim 0; for reduce-scatter the [G, n] rows of each part along dim 1,
// flattened) with its wait read by the unpacking split alone (through the [G, n] view for
// all-gather).
// A user's collective of a cat is none, also where only a split reads it (FSDP's flat
// parameter, DDP's fused all-reduce): taken for one, it closed the bucket by its cap before
// its dependency on the bucket was looked at (DESIGN §6 point 3: skipped, and the bucket stays
// open), which left it and later collectives out of merges. The shape alone cannot tell them
// apart (a lookalike may be just what the pass would make with other caps), so the name does:
// the pass's own buckets keep it through the IR text, and a second run finds them.
bool made_by_bucketing(const Node& coll, const Node& wait, std::string_view bucket_hint) {
  const Node* in = coll.operand(0)->node();
  const bool flattened = in && in->op_name() == "flatten";
  if (flattened) in = in->operand(0)->node();
  if (!in || (in->op_name() != "cat" && in->op_name() != "bucket_pack")) return false;
  if (in->op_name() == "bucket_pack") return true;
  if (!bucket_name(coll.name(), bucket_hint)) return false;
  const int64_t rank = flattened ? 2 : 1;
  int64_t dim = in->attr("dim").as_int();
  if (dim < 0) dim += rank;
  if (dim != rank - 1) return false;
  for (const Value* part : in->operands()) {
    if (part->type().rank() != rank) return false;
  }
  const Node* user = only_user(wait.result(0));
  if (user && user->op_name() == "view") user = only_user(user->result(0));
  return user && user->op_name() == "split_with_sizes";
}

// The collectives of the pass's op in wait order, each with its eligibility, key and size.
std::vector<Entry> Bucketer::collect() {
  std::vector<Entry> entries;
  entries.reserve(waits_.size());
  std::vector<bool> seen(order_.id_bound(), false);
  for (Node* w : waits_) {
    Node& wait = *w;
    Value* in = wait.operand(0);
    Node* coll = in->node();
    if (!coll) continue;
    // A packed all-gather (an earlier custom_ops bucket) takes part in runs, caps and
    // dependencies like the bucket it came from, so that bucketing its output again finds the
    // same buckets; it is never merged again.
    if (!takes_part(*coll)) continue;
    const bool packed = coll->op().pack != nullptr;
    const uint32_t cid = order_.id(coll);
    if (seen[cid]) continue;  // a second wait of one collective: reported with the first
    seen[cid] = true;
    Entry e;
    e.coll = coll;
    e.wait = &wait;
    const auto uses = in->uses();
    e.eligible = uses.size() == 1 && uses[0].user == &wait;
    if (!e.eligible) {
      for (const Use& u : uses) {
        if (u.user == &wait) continue;
        e.ineligible_why = u.user ? fmt::format("its result is also used by %{} (operand {})",
                                                u.user->name(), u.index)
                                  : fmt::format("its result is also graph output {}", u.index);
        break;
      }
    }
    e.packed = packed;
    Value* coll_in = coll->operand(0);
    e.made_bucket = packed || made_by_bucketing(*coll, wait, hints_.bucket);
    // A packed all-gather's inputs count as the dtypes they pack to (out_dtypes), as its
    // members counted their folded casts' results: counted before the cast (an f64 packed as
    // f16), the bucket it came from no longer fit its cap when bucketed again, and later buckets
    // took other cap indices. (The verifier keeps their sum within kMaxTypeBytes; saturated
    // there all the same, as caps are.)
    int64_t in_bytes = 0;
    const std::vector<Attr>* out_dtypes = packed ? &coll->attr("out_dtypes").as_list() : nullptr;
    for (size_t i = 0; i < coll->num_operands(); ++i) {
      const Type& t = coll->operand(i)->type();
      const int64_t b =
          out_dtypes ? saturating_bytes(t.numel(), (*out_dtypes)[i].as_dtype()) : t.nbytes();
      in_bytes = b > kMaxTypeBytes - in_bytes ? kMaxTypeBytes : in_bytes + b;
    }
    e.out_dtype = packed ? coll->result(0)->dtype() : coll_in->dtype();
    // A single-user cast feeding an all-gather is folded into the packing copy.
    if (!packed && opt_.kind == CollectiveKind::AllGather && coll_in->node() &&
        coll_in->node()->op_name() == "convert_element_type" && coll_in->num_uses() == 1) {
      e.cast = coll_in->node();
    }
    e.bytes = std::max(in_bytes, coll->result(0)->type().nbytes());
    e.key = key_of(*coll, e.out_dtype);
    e.index = static_cast<int32_t>(entries.size());
    entries.push_back(std::move(e));
  }
  for (Node* c : colls_) {
    if (!seen[order_.id(c)]) unwaited_.push_back(c);
  }
  return entries;
}

void Bucketer::find_latest(const std::vector<Entry>& entries) {
  grow_scratch();
  std::fill(latest_.begin(), latest_.end(), -1);
  // Only an eligible collective can be a member. (An ineligible one can also be read without
  // its wait, so it can be an ancestor of a collective waited before it: seeded, it would
  // disable the cutoff below everything it reaches.)
  for (const Entry& e : entries) {
    if (e.eligible) latest_[order_.id(e.coll)] = e.index;
  }
  for (const Node& n : graph_.nodes()) {
    int32_t& mine = latest_[order_.id(&n)];
    for (const Value* v : n.operands()) {
      if (v->node()) mine = std::max(mine, latest_[order_.id(v->node())]);
    }
  }
}

// A bucket's new nodes (its packing, collective and unpacking) get the index of its last
// member: no eligible ancestor of theirs comes later in wait order (a member's input can depend
// on an eligible collective only through its wait, which comes before the member's).
void Bucketer::note_new_nodes(const std::vector<Entry*>& members,
                              const std::vector<Node*>& nodes) {
  grow_scratch();
  int32_t last = -1;
  for (const Entry* m : members) last = std::max(last, m->index);
  for (const Node* n : nodes) latest_[order_.id(n)] = last;
}

// Does `e`'s collective depend on a member of the current bucket? A backward search from it
// over nodes at or after the bucket's first member (nothing earlier can descend from a member),
// memoised for the whole bucket: a node found clean stays clean while the bucket grows, since a
// later member cannot be an ancestor of an earlier candidate (waits come in order). So each
// node is visited at most once per bucket. On true, `path` gets the chain of nodes.
bool Bucketer::depends_on_bucket(const Entry& e, std::string* path) {
  if (order_.key(e.coll) < first_key_) return false;
  grow_scratch();
  std::vector<Frame>& stack = stack_;
  stack.clear();
  const uint32_t root = order_.id(e.coll);
  bool dirty = false;
  if (mark_epoch_[root] == epoch_) {
    FUNCOL_CHECK(state_[root] != kOpen, "bucketing: open node outside a search");
    dirty = state_[root] == kDirty;
  } else {
    mark_epoch_[root] = epoch_;
    state_[root] = kOpen;
    stack.push_back({e.coll, root, 0});
  }
  while (!stack.empty()) {
    Frame& f = stack.back();
    if (dirty) {
      // Everything on the stack depends on what was found dirty.
      state_[f.id] = kDirty;
      stack.pop_back();
      if (!stack.empty()) witness_[stack.back().id] = f.id;
      continue;
    }
    if (f.next_operand == f.node->num_operands()) {
      state_[f.id] = kClean;
      stack.pop_back();
      continue;
    }
    const Node* d = f.node->operand(f.next_operand++)->node();
    if (!d) continue;
    const OrderIndex::Pos dp = order_.pos(d);
    if (dp.key < first_key_) continue;
    const uint32_t did = dp.id;
    if (latest_[did] < first_index_) continue;  // no member among its ancestors
    if (mark_epoch_[did] == epoch_) {
      FUNCOL_CHECK(state_[did] != kOpen, "bucketing: cycle in the graph");
      if (state_[did] == kDirty) {
        witness_[f.id] = did;
        dirty = true;
      }
      continue;
    }
    mark_epoch_[did] = epoch_;
    state_[did] = kOpen;
    stack.push_back({d, did, 0});
  }
  if (!dirty || !path) return dirty;
  // Follow the witnesses from the candidate to the member collective. Past the names shown,
  // only the count is wanted: the chain's nodes learn their distance to the member, so that
  // candidates that meet the same chain (a long one, say) do not walk it again each.
  std::vector<std::string> names;
  const Node* n = e.coll;
  uint32_t id = root;
  constexpr size_t kMaxShown = 12;
  size_t hops = 0;
  std::vector<std::pair<uint32_t, size_t>>& walked = walked_;  // (id, hops before it)
  walked.clear();
  while (true) {
    if (hops < kMaxShown) {
      names.push_back("%" + n->name());
    } else if (hops_epoch_[id] == epoch_) {
      hops += hops_[id];
      break;
    } else {
      walked.emplace_back(id, hops);
    }
    ++hops;
    const uint32_t w = witness_[id];
    if (w == kNoId) break;
    id = w;
    // Walk the operands to find the node with that id (ids are not reversible by design).
    const Node* next = nullptr;
    for (const Value* v : n->operands()) {
      if (v->node() && order_.id(v->node()) == w) {
        next = v->node();
        break;
      }
    }
    FUNCOL_CHECK(next != nullptr, "bucketing: broken dependency witness");
    n = next;
  }
  for (const auto& [walked_id, before] : walked) {
    hops_epoch_[walked_id] = epoch_;
    hops_[walked_id] = static_cast<uint32_t>(hops - before);
  }
  *path = fmt::format("{}", fmt::join(names, " <- "));
  if (hops > kMaxShown) *path += fmt::format(" <- ... ({} nodes in all)", hops);
  return true;
}

void Bucketer::add_to_bucket(Entry* e) {
  grow_scratch();
  const uint32_t id = order_.id(e->coll);
  mark_epoch_[id] = epoch_;
  state_[id] = kDirty;
  witness_[id] = kNoId;
  first_key_ = std::min(first_key_, order_.key(e->coll));
  if (bucket_.empty()) first_index_ = e->index;
  bucket_.push_back(e);
  bucket_bytes_ += e->bytes;
}

void Bucketer::close_bucket(std::string_view reason) {
  if (bucket_.empty()) return;
  const int64_t cap = bucket_cap_bytes(opt_, bucket_index_);
  const std::string members = explain_ ? members_str(bucket_) : std::string();
  std::string outcome;
  std::vector<std::string> retried;  // explain lines of the tries after the first
  // A packed all-gather (a bucket already) never merges again; the other members still do
  // (they were all left alone with it).
  std::vector<Entry*> plain;
  for (Entry* e : bucket_) {
    if (!e->packed) plain.push_back(e);
  }
  const auto packed =
      std::find_if(bucket_.begin(), bucket_.end(), [](const Entry* e) { return e->packed; });
  const std::string packed_note =
      packed != bucket_.end() && explain_
          ? fmt::format(" (%{} is packed already: left alone)", (*packed)->coll->name())
          : std::string();
  if (bucket_.size() == 1) {
    outcome = "left alone (one collective)";
  } else if (plain.size() < 2) {
    outcome = fmt::format("left alone (%{} is packed already)", (*packed)->coll->name());
  } else {
    // The members a merge drops are tried again, until no two of them merge. When the merge
    // split the bucket into the fewest groups that each have a placement (best_gap_members),
    // each other group is tried on its own, in the order of the cover (a try costs a pass over
    // its members' region, which a group's is a part of); the members no group of two or more
    // took, and those such a try drops, are then tried together as a bucket of their own, in
    // wait order, and so on. After kRetries tries, a bucket tries again only while the later
    // tries of the whole pass have collected fewer than opt_.retry_work region nodes and members
    // (a bound on the pass's time, the same on every rank); the members left are dropped. The
    // budget is the pass's, not a bucket's, so that it bounds the pass whatever the number of
    // buckets: a bucket that spends it leaves later buckets their first kRetries tries only.
    constexpr int kRetries = 4;
    // Every try takes at least one member out (it merges two or more, or leaves its first
    // alone), so the tries end.
    auto wait_order = [](const Entry* a, const Entry* b) { return a->index < b->index; };
    std::deque<std::vector<Entry*>> tries = {plain};
    std::vector<Entry*> leftover;  // for the next try of them together
    for (int attempt = 0;; ++attempt) {
      if (tries.empty()) {
        if (leftover.size() < 2) break;
        std::sort(leftover.begin(), leftover.end(), wait_order);
        tries.push_back(std::move(leftover));
        leftover.clear();
      }
      std::vector<Entry*> todo = std::move(tries.front());
      tries.pop_front();
      const bool later = attempt > kRetries;
      if (later && retry_work_ >= opt_.retry_work) {
        budget_spent_ = true;
        size_t untried = todo.size() + leftover.size();
        for (const auto& t : tries) untried += t.size();
        if (explain_) {
          retried.push_back(fmt::format(
              "bucket {}: {} dropped members not tried again (the pass's retries visited {} "
              "region nodes and members, their budget)",
              bucket_index_, untried, retry_work_));
        }
        break;
      }
      const int64_t work_before = region_work_;
      const std::string tried = explain_ && attempt > 0 ? members_str(todo) : std::string();
      // merge() counts what it drops; a retry's members are counted again by it.
      if (attempt > 0) stats_.dropped -= static_cast<int64_t>(todo.size());
      std::vector<Entry*> merged = todo;
      const int64_t reorders = stats_.region_reorders;
      const bool ok = merge(merged);
      // `merged` is a subsequence of `todo`; when nothing merged, its first member (counted
      // as kept by merge()) stays alone and the others are tried again.
      std::vector<Entry*> rest;
      size_t k = 0;
      if (attempt == 0 && merged.size() < todo.size()) dropped_on_first_try_ = true;
      for (Entry* e : todo) {
        if (k < merged.size() && merged[k] == e) {
          ++k;
          continue;
        }
        rest.push_back(e);
        if (!explain_) continue;
        const std::string line = fmt::format(
            "dropped %{} from bucket {}{}: merging it would change the issue order of "
            "collectives that stay unmerged",
            e->coll->name(), bucket_index_, attempt > 0 ? " again" : "");
        if (attempt > 0) {
          retried.push_back(line);
        } else {
          say(line);
        }
      }
      std::string result;
      if (ok) {
        result = fmt::format("merged {} collectives{}{}", merged.size(),
                             rest.empty() ? "" : fmt::format(" ({} dropped)", rest.size()),
                             stats_.region_reorders > reorders ? " (region reordered)" : "");
        ++stats_.merged_buckets;
        stats_.merged_collectives += static_cast<int64_t>(merged.size());
      } else {
        result = fmt::format("left alone ({} dropped)", rest.size());
        if (attempt > 0) ++stats_.dropped;  // the first member stays dropped
      }
      if (attempt == 0) {
        outcome = std::move(result) + packed_note;
      } else {
        retried.push_back(fmt::format("bucket {} again, with what was dropped: {}; {}",
                                      bucket_index_, tried, result));
      }
      if (later) {
        retry_work_ += region_work_ - work_before + static_cast<int64_t>(todo.size());
      }
      // No two members had a placement together: no subset has one either.
      if (!ok && no_pair_fits_) continue;
      // The other groups of the cover (their members are in `rest`, each group in wait
      // order) are tried first; the rest of `rest` waits for the next try together.
      std::vector<Entry*> grouped;
      for (std::vector<Entry*>& group : cover_rest_) {
        if (group.size() < 2) continue;
        grouped.insert(grouped.end(), group.begin(), group.end());
        tries.push_back(std::move(group));
      }
      std::sort(grouped.begin(), grouped.end(), wait_order);
      std::set_difference(rest.begin(), rest.end(), grouped.begin(), grouped.end(),
                          std::back_inserter(leftover), wait_order);
    }
  }
  if (explain_) {
    say(fmt::format("bucket {}: {}; {} of cap {}; closed: {}; {}", bucket_index_, members,
                    bytes_str(bucket_bytes_), bytes_str(cap), reason, outcome));
    for (const std::string& line : retried) say(line);
  }
  ++bucket_index_;
  ++stats_.buckets;
  bucket_.clear();
  bucket_bytes_ = 0;
  first_key_ = kMaxKey;
  ++epoch_;
}

BucketingStats Bucketer::run() {
  std::vector<Entry> entries = collect();
  find_latest(entries);
  stats_.collectives = static_cast<int64_t>(entries.size() + unwaited_.size());
  if (explain_) {
    std::string round;
    if (round_ == 2) {
      round = ", round 2 (round 1 dropped members that may merge now)";
    } else if (round_ > 2) {
      round = fmt::format(", round {} (round {} merged)", round_, round_ - 1);
    }
    explain_->append(fmt::format("{} @{}{}: {} {} collective{} (cap-mb={} mode={})\n",
                                 spec_.pass, graph_.name(), round, stats_.collectives, spec_.op,
                                 stats_.collectives == 1 ? "" : "s", format_cap_mb(opt_.cap_mb),
                                 bucket_mode_name(opt_.mode)));
  }
  // Not in the walk (DESIGN §6 point 1 walks the waits), so they end no run; still reported.
  for (const Node* c : unwaited_) {
    ++stats_.skipped_ineligible;
    if (!explain_) continue;
    const auto uses = c->result(0)->uses();
    std::string why = "it is never used";
    if (!uses.empty()) {
      why = uses[0].user ? fmt::format("it is used by %{} (operand {})", uses[0].user->name(),
                                       uses[0].index)
                         : fmt::format("it is graph output {}", uses[0].index);
    }
    say(fmt::format("skipped %{}: ineligible: no wait_tensor reads its result ({})", c->name(),
                    why));
  }
  epoch_ = 1;
  item_epoch_ = 0;
  // Closes the bucket when `e` does not fit under its cap.
  auto close_if_full = [&](const Entry& e) {
    if (bucket_.empty() || e.bytes <= bucket_cap_bytes(opt_, bucket_index_) - bucket_bytes_) {
      return;
    }
    close_bucket(explain_ ? fmt::format("cap (adding %{} of {} would make {})", e.coll->name(),
                                        bytes_str(e.bytes), sum_bytes_str(bucket_bytes_, e.bytes))
                          : std::string());
  };
  const BucketKey* run_key = nullptr;  // key of the current run
  for (Entry& e : entries) {
    // Every collective of the pass's op is part of the walk, an ineligible one included: a
    // different key ends the run, so nothing merges across it (DESIGN §6 point 1).
    if (!run_key || !(e.key == *run_key)) {
      close_bucket(explain_
                       ? fmt::format("key change (next %{} has {})", e.coll->name(), e.key.str())
                       : std::string());
      run_key = &e.key;
      say(fmt::format("run of {}", e.key.str()));
    }
    if (!e.eligible) {
      ++stats_.skipped_ineligible;
      if (explain_) {
        say(fmt::format("skipped %{}: ineligible: {}", e.coll->name(), e.ineligible_why));
      }
      continue;
    }
    // A bucket an earlier pass made that the cap keeps out closes the bucket before its
    // dependencies are looked at, as its first member did in the pass that made it: its later
    // members' dependencies on that earlier bucket did not count then. (Skipped as dependent
    // instead, it left the earlier bucket open to later collectives and the cap indices
    // shifted: a second run of the same pass changed the graph.)
    if (e.made_bucket) close_if_full(e);
    std::string path;
    if (!bucket_.empty() && depends_on_bucket(e, explain_ ? &path : nullptr)) {
      ++stats_.skipped_dependent;
      if (explain_) {
        say(fmt::format("skipped %{}: depends on bucket {}: {}", e.coll->name(), bucket_index_,
                        path));
      }
      continue;
    }
    close_if_full(e);
    add_to_bucket(&e);
  }
  close_bucket("end of run");
  if (explain_) {
    say(
        fmt::format("{} bucket{}, {} merged ({} collectives); skipped {} dependent, {} "
                    "ineligible; dropped {}",
                    stats_.buckets, stats_.buckets == 1 ? "" : "s", stats_.merged_buckets,
                    stats_.merged_collectives,
                    stats_.skipped_dependent, stats_.skipped_ineligible, stats_.dropped));
  }
  return stats_;
}

// ---- merging ------------------------------------------------------------------------------------

// Multidtype all-gather: the members' common dtype, or the dtype of the smallest itemsize
// (the first such member's; bool packs as u8 so that no byte is ever read as a bool).
DType Bucketer::bucket_dtype(const std::vector<Entry*>& members) const {
  DType best = members[0]->out_dtype;
  for (const Entry* m : members) {
    if (itemsize(m->out_dtype) < itemsize(best)) best = m->out_dtype;
  }
  if (best == DType::Bool) {
    const bool all_bool = std::all_of(members.begin(), members.end(),
                                      [](const Entry* m) { return m->out_dtype == DType::Bool; });
    if (!all_bool) best = DType::U8;
  }
  return best;
}

// True when `v` is contiguous at run time whatever the inputs hold: results of kernels and
// collectives are fresh contiguous tensors, graph inputs are taken to be contiguous, and the
// views that keep a contiguous tensor contiguous (view, reshape, flatten, view_dtype, and
// narrow or split along dim 0) keep it. Anything else may be strided.
bool known_contiguous(const Value* v) {
  for (int depth = 0; depth < 64; ++depth) {
    const Node* n = v->node();
    if (!n) return true;
    const OpDef& op = n->op();
    if (op.collective == CollectiveKind::Wait) {
      v = n->operand(0);
      continue;
    }
    if (!op.is_view) return true;
    const std::string_view name = op.name;
    if (name == "view" || name == "reshape" || name == "flatten" || name == "view_dtype") {
      v = n->operand(0);
      continue;
    }
    if ((name == "narrow" || name == "split_with_sizes") && n->attr("dim").as_int() == 0) {
      v = n->operand(0);
      continue;
    }
    return false;
  }
  return false;
}

std::vector<Value*> Bucketer::pack_parts(Entry& m, DType bucket) {
  Value* src = m.source();
  Node* pack = src->node();
  if (!round_packs_ || m.packed || m.cast || !pack || src->num_uses() != 1 ||
      round_packs_->count(pack) == 0) {
    return {src};
  }
  // A multidtype all-gather bucket packs in another dtype than the member's did.
  if (src->dtype() != bucket) return {src};
  // Reduce-scatter's default packing is flatten(cat of [G, n / G] rows along dim 1).
  Node* inner = pack->op_name() == "flatten" ? pack->operand(0)->node() : pack;
  std::vector<Value*> parts;
  parts.reserve(inner->num_operands());
  for (size_t i = 0; i < inner->num_operands(); ++i) parts.push_back(inner->operand(i));
  dead_.push_back(pack);
  if (inner != pack) dead_.push_back(inner);
  m.pack_taken = true;
  return parts;
}

void Bucketer::erase_dead() {
  // Each pass erases the nodes nothing reads any more (a reader comes before what it reads).
  while (!dead_.empty()) {
    const size_t before = dead_.size();
    std::erase_if(dead_, [&](Node* n) {
      for (size_t i = 0; i < n->num_results(); ++i) {
        if (!n->result(i)->uses().empty()) return false;
      }
      if (round_packs_) round_packs_->erase(n);
      order_.remove(n);
      graph_.erase(n);
      return true;
    });
    FUNCOL_CHECK(dead_.size() < before, "bucketing: a node left unused is still read");
  }
}

// The packing nodes and the merged collective (DESIGN §6 point 4; REFERENCE B.4).
Node* Bucketer::emit_pack(Emitter& x, const std::vector<Entry*>& members, DType bucket) {
  Node* coll = emit_pack_nodes(x, members, bucket);
  // The packed buffer, for a later round to take over (a packed all-gather has none).
  Node* pack = coll->operand(0)->node();
  if (round_packs_ && coll->op().pack == nullptr) round_packs_->insert(pack);
  return coll;
}

Node* Bucketer::emit_pack_nodes(Emitter& x, const std::vector<Entry*>& members,
                                DType bucket) {
  const Node& first = *members[0]->coll;
  const MemberOps& ops = member_ops();
  const std::string& group = first.attr("group").as_string();
  // Every member's parts in order (bucket_pack lays out each part as it would the member).
  auto all_parts = [&] {
    std::vector<Value*> parts;
    parts.reserve(members.size());
    for (Entry* m : members) {
      for (Value* v : pack_parts(*m, bucket)) parts.push_back(v);
    }
    return parts;
  };
  auto flat = [&](Value* v) {
    return v->type().rank() == 1 ? v : x.value(ops.flatten, {v}, {}, hints_.flat);
  };
  switch (opt_.kind) {
    case CollectiveKind::AllGather: {
      const int64_t g = first.attr("group_size").as_int();
      if (is_custom_ops(opt_.mode)) {
        // One operand per member (never an earlier round's bucket: packed ones never merge).
        std::vector<Value*> sources;
        std::vector<Attr> outs;
        sources.reserve(members.size());
        for (const Entry* m : members) {
          sources.push_back(m->source());
          outs.emplace_back(m->out_dtype);
        }
        return x.node("all_gather_into_tensor_packed", sources,
                      {{"group_size", g},
                       {"group", group},
                       {"dtype", bucket},
                       {"out_dtypes", Attr::list(std::move(outs))}},
                      hints_.bucket);
      }
      std::vector<Value*> parts;
      parts.reserve(members.size());
      for (Entry* m : members) {
        // A taken-over pack's parts are flat, in the bucket's dtype.
        for (Value* part : pack_parts(*m, bucket)) {
          Value* v = flat(part);
          if (v->dtype() != m->out_dtype) {
            v = x.value(ops.convert, {v}, attrs1(m->out_dtype), hints_.cast);
          }
          if (m->out_dtype != bucket) {
            // Reading the bytes as another dtype needs a unit-stride tensor.
            if (!known_contiguous(v)) v = x.value(ops.clone, {v}, {}, hints_.copy);
            v = x.value(ops.view_dtype, {v}, attrs1(bucket), hints_.bytes);
          }
          parts.push_back(v);
        }
      }
      Value* packed = x.value("cat", parts, {{"dim", 0}}, hints_.pack);
      return x.node(spec_.op, {packed}, {{"group_size", g}, {"group", group}}, hints_.bucket);
    }
    case CollectiveKind::ReduceScatter: {
      const int64_t g = first.attr("group_size").as_int();
      const std::string& rop = first.attr("reduce_op").as_string();
      Value* packed;
      if (is_custom_ops(opt_.mode)) {
        packed = x.value("bucket_pack", all_parts(), {{"group_size", g}}, hints_.pack);
      } else {
        // Row j of [G, n_i / G] is the chunk rank j receives; concatenating rows keeps every
        // rank's chunks together (a plain concatenation would mix them).
        std::vector<Value*> rows;
        rows.reserve(members.size());
        for (Entry* m : members) {
          std::vector<Value*> parts = pack_parts(*m, bucket);
          if (m->pack_taken) {  // a taken-over pack's parts are rows already
            rows.insert(rows.end(), parts.begin(), parts.end());
            continue;
          }
          const int64_t n = m->source()->type().numel();
          rows.push_back(x.value(ops.reshape, {m->source()},
                                 attrs1(std::vector<int64_t>{g, n / g}), hints_.rows));
        }
        Value* cat = x.value("cat", rows, {{"dim", 1}}, hints_.cat);
        packed = x.value("flatten", {cat}, {}, hints_.pack);
      }
      return x.node(spec_.op, {packed}, {{"reduce_op", rop}, {"group_size", g}, {"group", group}},
                    hints_.bucket);
    }
    case CollectiveKind::AllReduce: {
      const std::string& rop = first.attr("reduce_op").as_string();
      Value* packed;
      if (is_custom_ops(opt_.mode)) {
        packed = x.value("bucket_pack", all_parts(), {{"group_size", 1}}, hints_.pack);
      } else {
        std::vector<Value*> parts = all_parts();
        for (Value*& v : parts) v = flat(v);
        packed = x.value("cat", parts, {{"dim", 0}}, hints_.pack);
      }
      return x.node(spec_.op, {packed}, {{"reduce_op", rop}, {"group", group}}, hints_.bucket);
    }
    default: FUNCOL_CHECK(false, "bucketing: unexpected kind");
  }
  return nullptr;
}

// The merged wait and the unpacking: one value per member, of exactly its wait's type.
std::vector<Value*> Bucketer::emit_unpack(Emitter& y, Node* coll,
                                          const std::vector<Entry*>& members, DType bucket) {
  const MemberOps& ops = member_ops();
  Value* w = y.value("wait_tensor", {coll->result(0)}, {}, hints_.wait);
  std::vector<int64_t> sizes;
  sizes.reserve(members.size());
  std::vector<Value*> out;
  out.reserve(members.size());
  auto finish_block = [&](Value* v, const Entry* m) {
    const Type& want = m->wait->result(0)->type();
    if (v->type().shape != want.shape) {
      v = y.value(ops.reshape, {v}, attrs1(std::vector<int64_t>(want.shape)), hints_.out);
    }
    out.push_back(v);
  };
  if (opt_.kind == CollectiveKind::AllGather) {
    const int64_t g = coll->attr("group_size").as_int();
    const int64_t n = coll->result(0)->type().numel() / g;
    const auto bsize = static_cast<int64_t>(itemsize(bucket));
    for (const Entry* m : members) {
      sizes.push_back(m->coll->operand(0)->type().numel() *
                      static_cast<int64_t>(itemsize(m->out_dtype)) / bsize);
    }
    // Row r of [G, N] is rank r's slot; column block i across the rows is member i's gather.
    Value* rows = y.value("view", {w}, {{"shape", std::vector<int64_t>{g, n}}}, hints_.rows);
    Node* split =
        y.node("split_with_sizes", {rows}, {{"split_sizes", sizes}, {"dim", 1}}, hints_.split);
    for (size_t i = 0; i < members.size(); ++i) {
      const Entry* m = members[i];
      Value* v = split->result(i);
      if (m->pack_taken) {
        // A bucket of an earlier round, whose wait only its unpacking's [G, n] view reads: the
        // view becomes the block (copied back to the member's layout, the block would be
        // viewed as [G, n] again). finish() leaves the member to erase_dead().
        const auto uses = m->wait->result(0)->uses();
        Node* rows_view = uses.size() == 1 ? uses[0].user : nullptr;
        if (rows_view && rows_view->op_name() == "view" &&
            rows_view->result(0)->type() == v->type()) {
          graph_.replace_all_uses(rows_view->result(0), v);
          out.push_back(nullptr);
          continue;
        }
      }
      if (m->out_dtype != bucket && sizes[i] == 0) {
        // An empty block: flattened first, since no stride of an empty 2-D block is meaningful
        // to view_dtype (the data dependency on the wait is kept all the same).
        v = y.value(ops.reshape, {v}, attrs1(std::vector<int64_t>{0}), hints_.flat);
        v = y.value(ops.clone, {v}, {}, hints_.copy);
        v = y.value(ops.view_dtype, {v}, attrs1(m->out_dtype), hints_.view);
      } else if (m->out_dtype != bucket) {
        // A column block is strided; copy it so the bytes can be read as the member's dtype.
        v = y.value(ops.clone, {v}, {}, hints_.copy);
        v = y.value(ops.view_dtype, {v}, attrs1(m->out_dtype), hints_.view);
      }
      finish_block(v, m);
    }
    return out;
  }
  const int64_t g =
      opt_.kind == CollectiveKind::ReduceScatter ? coll->attr("group_size").as_int() : 1;
  for (const Entry* m : members) sizes.push_back(m->source()->type().numel() / g);
  Node* split = y.node("split_with_sizes", {w}, {{"split_sizes", sizes}, {"dim", 0}}, hints_.split);
  for (size_t i = 0; i < members.size(); ++i) finish_block(split->result(i), members[i]);
  return out;
}

// Points the members' consumers at the replacements and erases the members.
void Bucketer::finish(const std::vector<Entry*>& members, const std::vector<Value*>& replacements,
                      const Emitter& x, const Emitter& y) {
  // The bucket's nodes stand for its members: later errors about them (autodiff, the
  // executor, the verifier) name the first member's place in the source.
  const SourceLoc loc = members.front()->coll->loc();
  for (const Emitter* e : {&x, &y}) {
    for (Node* n : e->created()) n->set_loc(loc);
  }
  for (size_t i = 0; i < members.size(); ++i) {
    Entry* m = members[i];
    if (replacements[i]) {
      graph_.replace_all_uses(m->wait->result(0), replacements[i]);
      for (Node* n : {m->wait, m->coll, m->cast}) {
        if (!n) continue;
        order_.remove(n);
        graph_.erase(n);
      }
    } else {  // emit_unpack took over its unpacking: its view and the member wait for that
      dead_.push_back(m->wait->result(0)->uses()[0].user);
      dead_.push_back(m->wait);
      dead_.push_back(m->coll);
    }
    m->wait = m->coll = m->cast = nullptr;
  }
}

// Registers the new nodes (first's, then second's) and keys each maximal run of them between
// keyed neighbours.
void Bucketer::key_new_nodes(const std::vector<Node*>& first_nodes,
                             const std::vector<Node*>& second_nodes) {
  const uint32_t base = static_cast<uint32_t>(order_.id_bound());
  for (Node* n : first_nodes) order_.add(n);
  for (Node* n : second_nodes) order_.add(n);
  auto is_new = [&](const Node* n) { return n && order_.id(n) >= base; };
  // A new node's key is kMinKey until it is keyed (rekey and relabel never hand that key out).
  for (const std::vector<Node*>* nodes : {&first_nodes, &second_nodes}) {
    for (Node* n : *nodes) {
      if (order_.key(n) != kMinKey) continue;
      size_t count = 1;
      Node* first = n;
      while (is_new(first->prev())) {
        first = first->prev();
        ++count;
      }
      Node* last = n;
      while (is_new(last->next())) {
        last = last->next();
        ++count;
      }
      order_.rekey(first, last, count);
    }
  }
}

// The latest definition of a member's input (lo) and the earliest consumer of a member's
// wait (hi); a gap exists when lo < hi.
Bucketer::Bounds Bucketer::bounds(const std::vector<Entry*>& members) const {
  Bounds b;
  for (const Entry* m : members) {
    const int64_t k = order_.def_key(m->source());
    if (k > b.lo) {
      b.lo = k;
      b.lo_node = m->source()->node();
    }
    for (const Use& u : m->wait->result(0)->uses()) {
      if (!u.user) continue;
      const int64_t uk = order_.key(u.user);
      if (uk < b.hi) {
        b.hi = uk;
        b.hi_node = u.user;
      }
    }
  }
  return b;
}

// The gap case: some place after every input and before every consumer exists. The merged
// collective goes after the latest member issued before the first consumer (or after the
// latest input, when that is later), the merged wait before the first member wait after it
// (or before the first consumer): nothing else moves.
bool Bucketer::place_normally(const std::vector<Entry*>& members) {
  const auto [lo, lo_node, hi, hi_node] = bounds(members);
  if (lo >= hi) return false;
  // The members' collective and wait keys, read once here for the two scans below.
  std::vector<std::pair<int64_t, int64_t>>& keys = member_keys_;
  keys.clear();
  keys.reserve(members.size());
  for (const Entry* m : members) keys.emplace_back(order_.key(m->coll), order_.key(m->wait));
  int64_t c_key = kMinKey;
  Node* c_node = nullptr;
  for (size_t i = 0; i < members.size(); ++i) {
    const int64_t k = keys[i].first;
    if (k < hi && k > c_key) {
      c_key = k;
      c_node = members[i]->coll;
    }
  }
  FUNCOL_CHECK(c_node != nullptr, "bucketing: no member before the first consumer");
  if (lo > c_key) {
    c_key = lo;
    c_node = lo_node;
  }
  int64_t w_key = hi;
  Node* w_node = hi_node;
  for (size_t i = 0; i < members.size(); ++i) {
    const int64_t k = keys[i].second;
    if (k > c_key && k < w_key) {
      w_key = k;
      w_node = members[i]->wait;
    }
  }
  Node* x_anchor = c_node->next();
  Node* y_anchor = w_node ? w_node : x_anchor;
  const DType bucket = bucket_dtype(members);
  // At most four new nodes per member on either side (flatten, convert, clone, view_dtype;
  // reshape, clone, view_dtype, reshape) plus a few per bucket: room for all of them is made
  // before any is created.
  order_.reserve_more(8 * members.size() + 8);
  Emitter x(graph_, x_anchor);
  x.reserve(2 * members.size() + 4);
  Node* coll = emit_pack(x, members, bucket);
  Emitter y(graph_, y_anchor);
  y.reserve(2 * members.size() + 4);
  std::vector<Value*> repl = emit_unpack(y, coll, members, bucket);
  finish(members, repl, x, y);
  key_new_nodes(x.created(), y.created());
  note_new_nodes(members, x.created());
  note_new_nodes(members, y.created());
  erase_dead();
  return true;
}

// The no-gap case (a member's wait is used before another member's input exists): a stable
// topological order of the window from the first consumer of a member's wait to the latest
// member input, with the merged collective X after the inputs and the merged wait Y before
// the consumers, everything else in graph order as far as the edges allow, and the
// collectives that stay unmerged kept in their issue order. Nothing outside the window needs
// to move: nothing before the first consumer descends from a member's wait, nothing after the
// latest input is an ancestor of one, and every path from a consumer to an input stays
// inside. (The window lies between the first and the last member; reordering all of that
// span cost every bucket the graph's size when members are issued far ahead of their waits.)
// collect_region gathers that window (members excluded, marked with the item index kNoId,
// the others with their index in region.nodes); plan_region orders it. plan_region returns the
// order as item indices (region nodes, then X, then Y), or nothing when no such order exists (a
// member would force two unmerged collectives to swap); an empty order when the members leave
// a gap (nothing to reorder).
void Bucketer::collect_region(const std::vector<Entry*>& members, const Bounds& b,
                              Region& region) {
  region.nodes.clear();
  grow_scratch();
  ++item_epoch_;
  // Members are marked with the item index kNoId.
  for (const Entry* m : members) {
    for (Node* n : {m->cast, m->coll, m->wait}) {
      if (!n) continue;
      const uint32_t id = order_.id(n);
      item_mark_[id] = item_epoch_;
      item_[id] = kNoId;
    }
  }
  auto is_member = [&](const Node* n) {
    const uint32_t id = order_.id(n);
    return item_mark_[id] == item_epoch_ && item_[id] == kNoId;
  };
  for (Node* n = b.hi_node;; n = n->next()) {
    const uint32_t id = order_.id(n);
    if (item_mark_[id] != item_epoch_) {
      item_mark_[id] = item_epoch_;
      item_[id] = static_cast<uint32_t>(region.nodes.size());
      region.nodes.push_back(n);
    }
    if (n == b.lo_node) break;
  }
  region_work_ += static_cast<int64_t>(region.nodes.size());
  // The window's neighbours that survive the merge (members are erased).
  region.before = b.hi_node->prev();
  while (region.before && is_member(region.before)) region.before = region.before->prev();
  region.anchor = b.lo_node->next();
  while (region.anchor && is_member(region.anchor)) region.anchor = region.anchor->next();
}

// Which members to merge when not all of them have one placement: in the window, the
// unmerged collectives c_0 .. c_{K-1} keep their order, and the merged one goes into a gap g
// (after g of them). Member m's input may descend from some c_j (then g > j) and its wait may
// lead to some c_k (then g <= k): it fits the gaps [lo_m, hi_m], and the members that share one
// gap can merge. Members cannot lead to one another (dependency skipping keeps those out), so
// these are all the constraints. The fewest merged collectives that take every member are the
// fewest gaps that every interval holds one of: in order of the intervals' ends, each interval
// no gap holds yet puts one at its end, which takes every interval that holds it. Of those
// groups, the largest (the first such) is merged now, and the others (cover_rest_) are tried
// next, each on its own (close_bucket). Its members in wait order; fewer than two when no gap
// holds two. `region` is the members' window as plan_region collected it (its marks still
// current).
std::vector<Entry*> Bucketer::best_gap_members(const std::vector<Entry*>& members,
                                               const Region& region) {
  const std::vector<Node*>& nodes = region.nodes;
  auto index_of = [&](const Node* n) -> std::optional<uint32_t> {
    if (!n) return std::nullopt;
    const uint32_t id = order_.id(n);
    if (item_mark_[id] != item_epoch_ || item_[id] == kNoId) return std::nullopt;
    return item_[id];
  };
  // The collectives' chain positions; after[i]: the least gap that node i's dependents need
  // (one past the latest collective it descends from); before[i]: the greatest gap allowed when
  // node i descends from the merged collective (the earliest collective it leads to).
  uint32_t num_colls = 0;
  std::vector<uint32_t> after(nodes.size(), 0), chain(nodes.size(), kNoId);
  for (uint32_t i = 0; i < nodes.size(); ++i) {
    for (const Value* v : nodes[i]->operands()) {
      if (auto d = index_of(v->node())) after[i] = std::max(after[i], after[*d]);
    }
    if (nodes[i]->op().is_collective()) {
      chain[i] = num_colls++;
      after[i] = num_colls;
    }
  }
  std::vector<uint32_t> before(nodes.size(), num_colls);
  for (uint32_t i = static_cast<uint32_t>(nodes.size()); i-- > 0;) {
    if (chain[i] != kNoId) before[i] = chain[i];
    for (size_t r = 0; r < nodes[i]->num_results(); ++r) {
      for (const Use& u : nodes[i]->result(r)->uses()) {
        if (auto d = index_of(u.user)) before[i] = std::min(before[i], before[*d]);
      }
    }
  }
  std::vector<std::pair<uint32_t, uint32_t>> fits;  // [lo, hi] per member
  fits.reserve(members.size());
  for (const Entry* m : members) {
    const auto src = index_of(m->source()->node());
    uint32_t hi = num_colls;
    for (const Use& u : m->wait->result(0)->uses()) {
      if (auto d = index_of(u.user)) hi = std::min(hi, before[*d]);
    }
    fits.emplace_back(src ? after[*src] : 0, hi);
  }
  std::vector<uint32_t> by_end(members.size());
  std::iota(by_end.begin(), by_end.end(), 0u);
  std::stable_sort(by_end.begin(), by_end.end(),
                   [&](uint32_t a, uint32_t b) { return fits[a].second < fits[b].second; });
  std::vector<uint32_t> by_start(by_end);
  std::stable_sort(by_start.begin(), by_start.end(),
                   [&](uint32_t a, uint32_t b) { return fits[a].first < fits[b].first; });
  // A gap at interval i's end takes every interval not taken yet that starts at or before it:
  // those all end at or after it (one that ended before would have put a gap there first).
  std::vector<uint32_t> group(members.size(), kNoId);
  std::vector<uint32_t> sizes;
  size_t next = 0;  // in by_start
  for (uint32_t i : by_end) {
    if (group[i] != kNoId) continue;
    const uint32_t gap = fits[i].second;
    const auto g = static_cast<uint32_t>(sizes.size());
    sizes.push_back(0);
    for (; next < by_start.size() && fits[by_start[next]].first <= gap; ++next) {
      if (group[by_start[next]] != kNoId) continue;
      group[by_start[next]] = g;
      ++sizes[g];
    }
    if (group[i] == kNoId) {  // no gap fits it (not expected): alone
      group[i] = g;
      ++sizes[g];
    }
  }
  const auto largest =
      static_cast<uint32_t>(std::max_element(sizes.begin(), sizes.end()) - sizes.begin());
  std::vector<std::vector<Entry*>> groups(sizes.size());
  for (size_t i = 0; i < members.size(); ++i) groups[group[i]].push_back(members[i]);
  std::vector<Entry*> out = std::move(groups[largest]);
  cover_rest_.clear();
  for (uint32_t g = 0; g < groups.size(); ++g) {
    if (g != largest) cover_rest_.push_back(std::move(groups[g]));
  }
  return out;
}

std::optional<std::vector<uint32_t>> Bucketer::plan_region(const std::vector<Entry*>& members,
                                                           Region& region) {
  region.nodes.clear();
  const Bounds b = bounds(members);
  if (b.lo < b.hi) return std::vector<uint32_t>{};
  int64_t x_prio = kMinKey, y_prio = kMaxKey;
  for (const Entry* m : members) {
    x_prio = std::max(x_prio, order_.key(m->coll));
    y_prio = std::min(y_prio, order_.key(m->wait));
  }
  collect_region(members, b, region);
  const std::vector<Node*>& nodes = region.nodes;
  const auto num_items = static_cast<uint32_t>(nodes.size() + 2);
  const uint32_t x_item = num_items - 2, y_item = num_items - 1;
  auto item_of = [&](const Node* n) -> std::optional<uint32_t> {
    if (!n) return std::nullopt;
    const uint32_t id = order_.id(n);
    if (item_mark_[id] != item_epoch_) return std::nullopt;
    return item_[id];  // kNoId for members
  };
  std::vector<std::pair<uint32_t, uint32_t>> edges;
  uint32_t prev_coll = kNoId;
  for (uint32_t i = 0; i < nodes.size(); ++i) {
    const Node* n = nodes[i];
    for (const Value* v : n->operands()) {
      auto d = item_of(v->node());
      if (!d) continue;
      if (*d == kNoId) {
        // Only a member's wait can feed a non-member (collectives and casts have one user).
        edges.emplace_back(y_item, i);
      } else {
        edges.emplace_back(*d, i);
      }
    }
    if (n->op().is_collective()) {
      if (prev_coll != kNoId) edges.emplace_back(prev_coll, i);
      prev_coll = i;
    }
  }
  for (const Entry* m : members) {
    auto d = item_of(m->source()->node());
    if (d && *d != kNoId) edges.emplace_back(*d, x_item);
  }
  edges.emplace_back(x_item, y_item);
  // Kahn's algorithm, always taking the ready item that came first in graph order.
  std::vector<uint32_t> indeg(num_items, 0), start(num_items + 1, 0), adj(edges.size());
  for (const auto& [a, b] : edges) {
    ++start[a + 1];
    ++indeg[b];
  }
  for (uint32_t i = 0; i < num_items; ++i) start[i + 1] += start[i];
  {
    std::vector<uint32_t> fill(start.begin(), start.end() - 1);
    for (const auto& [a, b] : edges) adj[fill[a]++] = b;
  }
  auto prio = [&](uint32_t i) {
    if (i == x_item) return x_prio;
    if (i == y_item) return y_prio;
    return order_.key(nodes[i]);
  };
  using QItem = std::pair<int64_t, uint32_t>;
  std::priority_queue<QItem, std::vector<QItem>, std::greater<>> ready;
  for (uint32_t i = 0; i < num_items; ++i) {
    if (indeg[i] == 0) ready.emplace(prio(i), i);
  }
  std::vector<uint32_t> order;
  order.reserve(num_items);
  while (!ready.empty()) {
    const uint32_t i = ready.top().second;
    ready.pop();
    order.push_back(i);
    for (uint32_t k = start[i]; k < start[i + 1]; ++k) {
      if (--indeg[adj[k]] == 0) ready.emplace(prio(adj[k]), adj[k]);
    }
  }
  if (order.size() != num_items) return std::nullopt;
  return order;
}

void Bucketer::emit_region(const std::vector<Entry*>& members, const Region& region,
                           const std::vector<uint32_t>& order) {
  FUNCOL_CHECK(!region.nodes.empty(), "bucketing: a region to reorder without nodes");
  Node* before_region = region.before;
  Node* anchor = region.anchor;
  const DType bucket = bucket_dtype(members);
  Emitter x(graph_, anchor);
  Node* coll = emit_pack(x, members, bucket);
  Emitter y(graph_, anchor);
  std::vector<Value*> repl = emit_unpack(y, coll, members, bucket);
  finish(members, repl, x, y);
  const auto x_item = static_cast<uint32_t>(region.nodes.size());
  for (uint32_t i : order) {
    if (i < x_item) {
      graph_.move_before(region.nodes[i], anchor);
    } else {
      for (Node* n : (i == x_item ? x : y).created()) graph_.move_before(n, anchor);
    }
  }
  for (Node* n : x.created()) order_.add(n);
  for (Node* n : y.created()) order_.add(n);
  note_new_nodes(members, x.created());
  note_new_nodes(members, y.created());
  Node* first_new = before_region ? before_region->next() : graph_.first_node();
  Node* last_new = anchor ? anchor->prev() : graph_.last_node();
  size_t count = 0;
  for (Node* n = first_new;; n = n->next()) {
    ++count;
    if (n == last_new) break;
  }
  order_.rekey(first_new, last_new, count);
  erase_dead();
}

// Merges `members` (two or more, in wait order). When no valid placement keeps the issue
// order of the collectives left unmerged, keeps the members that still leave one and drops
// the others: `members` becomes the merged ones. False when fewer than two remain.
bool Bucketer::merge(std::vector<Entry*>& members) {
  no_pair_fits_ = false;
  cover_rest_.clear();
  if (members.size() < 2) return false;
  if (place_normally(members)) return true;
  Region region;
  std::optional<std::vector<uint32_t>> order = plan_region(members, region);
  if (order) {
    emit_region(members, region, *order);
    ++stats_.region_reorders;
    return true;
  }
  // Not all of them have one placement: the largest group of the fewest that each have one
  // (read from the window plan_region just collected). Should that group have none after all,
  // a constraint the gaps missed, ranges are tried instead.
  std::vector<Entry*> kept = best_gap_members(members, region);
  // Fewest groups = members: the placement ranges are disjoint, so no two members merge.
  no_pair_fits_ = kept.size() < 2;
  if (kept.size() >= 2) {
    order = plan_region(kept, region);
    if (!order) {
      kept = kept_by_ranges(members, region);
      cover_rest_.clear();  // the cover missed a constraint: its groups are not tried
    }
  }
  // Nothing merges: the bucket stays as it was, its first member counted as kept.
  if (kept.size() < 2) kept = {members[0]};
  stats_.dropped += static_cast<int64_t>(members.size() - kept.size());
  members = std::move(kept);
  if (members.size() < 2) return false;
  if (place_normally(members)) return true;
  // The best group's order is at hand; the ranges' last trial need not be the kept set's.
  if (!order) order = plan_region(members, region);
  FUNCOL_CHECK(order.has_value(), "bucketing: a bucket's kept members have no placement");
  emit_region(members, region, *order);
  ++stats_.region_reorders;
  return true;
}

// One member can block the rest (its input comes after another member's consumer), and
// dropping from the end would drop the good ones behind it too. So, in wait order from the
// first member, add the others a range at a time: a range that leaves a placement is kept
// whole, one that does not is halved, down to single members, which are dropped. The first
// member may itself be the one that blocks the others, so the same is done from the second
// member, and the larger set is kept. Each trial costs the region's size, so failed trials are
// limited (the members left when the limit is reached are dropped): with at most two kept
// ranges per failed one, a bucket costs at most about 2 x 3 x kMaxFailedTrials trials,
// whatever its size.
std::vector<Entry*> Bucketer::kept_by_ranges(const std::vector<Entry*>& members,
                                             Region& region) {
  constexpr int kMaxFailedTrials = 32;
  std::vector<Entry*> kept;
  std::vector<Entry*> best;
  std::vector<std::pair<size_t, size_t>> ranges;  // to try, the next one last
  auto push_halves = [&](size_t begin, size_t end) {
    const size_t mid = begin + (end - begin) / 2;
    ranges.emplace_back(mid, end);
    ranges.emplace_back(begin, mid);
  };
  for (size_t first = 0; first < 2 && first + 2 <= members.size(); ++first) {
    int failed = 0;
    ranges.clear();
    if (first == 0) {
      // With the first member, the whole bucket failed already.
      failed = 1;
      if (members.size() > 2) push_halves(1, members.size());
    } else {
      best = std::move(kept);
      if (best.size() + 1 >= members.size()) break;  // the second start cannot do better
      ranges.emplace_back(first + 1, members.size());
    }
    kept = {members[first]};
    while (!ranges.empty() && failed < kMaxFailedTrials) {
      const auto [begin, end] = ranges.back();
      ranges.pop_back();
      if (begin == end) continue;
      const size_t before = kept.size();
      kept.insert(kept.end(), members.begin() + begin, members.begin() + end);
      if (plan_region(kept, region)) continue;
      kept.resize(before);
      ++failed;
      if (end - begin > 1) push_halves(begin, end);
    }
  }
  if (best.size() >= kept.size()) kept = std::move(best);
  return kept;
}

}  // namespace

// ---- options ------------------------------------------------------------------------------------

std::string_view bucket_mode_name(BucketMode mode) {
  switch (mode) {
    case BucketMode::Default: return "default";
    case BucketMode::CustomOps: return "custom_ops";
    case BucketMode::MultiDtype: return "multidtype";
    case BucketMode::CustomOpsMultiDtype: return "custom_ops_multidtype";
  }
  return "?";
}

BucketMode parse_bucket_mode(std::string_view text) {
  for (BucketMode m : {BucketMode::Default, BucketMode::CustomOps, BucketMode::MultiDtype,
                       BucketMode::CustomOpsMultiDtype}) {
    if (bucket_mode_name(m) == text) return m;
  }
  throw InvalidArgument(
      fmt::format("unknown bucket mode '{}' (expected default, custom_ops, "
                  "multidtype or custom_ops_multidtype)",
                  text));
}

// What an infinite or too-large cap gets told: caps beyond any buffer saturate already.
constexpr std::string_view kNoLimitHint =
    "a cap larger than every bucket, such as 1e6, merges without a limit";

std::vector<double> parse_cap_mb(std::string_view text) {
  std::vector<double> caps;
  size_t pos = 0;
  while (true) {
    const size_t colon = text.find(':', pos);
    const std::string_view part =
        text.substr(pos, colon == std::string_view::npos ? std::string_view::npos : colon - pos);
    const auto [v, whole, ec] = parse_whole_number<double>(part);
    if (whole && ec == std::errc::result_out_of_range) {
      // Too large (not too small): say what merges without a limit.
      const bool huge = std::fabs(std::strtod(std::string(part).c_str(), nullptr)) > 1;
      throw InvalidArgument(fmt::format("cap-mb: '{}' is out of range{}{} (in '{}')", part,
                                        huge ? "; " : "", huge ? kNoLimitHint : "", text));
    }
    if (whole && ec == std::errc() && std::isinf(v) && v > 0) {
      throw InvalidArgument(
          fmt::format("cap-mb: '{}' is not a finite number; {} (in '{}')", part, kNoLimitHint,
                      text));
    }
    if (!whole || ec != std::errc() || !std::isfinite(v) || v <= 0) {
      throw InvalidArgument(
          fmt::format("cap-mb: '{}' is not a positive number (in '{}')", part, text));
    }
    caps.push_back(v);
    if (colon == std::string_view::npos) break;
    pos = colon + 1;
  }
  return caps;
}

std::string format_cap_mb(const std::vector<double>& cap_mb) {
  std::vector<std::string> parts;
  for (double v : cap_mb) parts.push_back(fmt_double(v));
  return fmt::format("{}", fmt::join(parts, ":"));
}

int64_t bucket_cap_bytes(const BucketOptions& options, int64_t index) {
  FUNCOL_CHECK(!options.cap_mb.empty(), "bucketing: empty cap list");
  const auto i =
      std::min<size_t>(static_cast<size_t>(std::max<int64_t>(index, 0)), options.cap_mb.size() - 1);
  // Caps beyond any value's size saturate at kMaxTypeBytes, so a bucket's packed buffer is
  // never too large to be a value.
  return mb_to_bytes(options.cap_mb[i], kMaxTypeBytes);
}

void check_bucket_options(const BucketOptions& options) {
  const KindSpec& spec = kind_spec(options.kind);
  if (options.cap_mb.empty()) throw InvalidArgument("cap-mb: the cap list is empty");
  for (double v : options.cap_mb) {
    if (std::isinf(v) && v > 0) {
      throw InvalidArgument(fmt::format("cap-mb: 'inf' is not a finite number; {}", kNoLimitHint));
    }
    if (!std::isfinite(v) || v <= 0) {
      throw InvalidArgument(fmt::format("cap-mb: '{}' is not a positive number", fmt_double(v)));
    }
  }
  if (is_multidtype(options.mode) && options.kind != CollectiveKind::AllGather) {
    throw InvalidArgument(fmt::format("{} bucketing does not support multidtype (mode {})",
                                      spec.noun, bucket_mode_name(options.mode)));
  }
  if (options.retry_work < 0) {
    throw InvalidArgument(
        fmt::format("retry_work: the budget of later tries is {}; it must be at least 0",
                    options.retry_work));
  }
  if (options.max_rounds < 1) {
    throw InvalidArgument(
        fmt::format("max_rounds: {} rounds; at least 1 must run", options.max_rounds));
  }
}

std::string_view bucket_pass_name(CollectiveKind kind) { return kind_spec(kind).pass; }

BucketPass::BucketPass(BucketOptions options) : options_(std::move(options)) {
  check_bucket_options(options_);
}

std::string BucketPass::name() const { return std::string(bucket_pass_name(options_.kind)); }

bool BucketPass::run(Graph& graph) {
  if (!explain_) return bucket_collectives(graph, options_).changed();
  std::string text;
  const BucketingStats stats = bucket_collectives(graph, options_, &text);
  *explain_ << text;
  return stats.changed();
}

std::unique_ptr<Pass> make_bucket_pass(CollectiveKind kind, const PassOptions& options) {
  BucketOptions o;
  o.kind = kind;
  // A pipeline may hold all three passes, each with a cap-mb: errors say which pass is wrong.
  try {
    if (const std::string* cap = options.find("cap-mb")) o.cap_mb = parse_cap_mb(*cap);
    if (const std::string* mode = options.find("mode")) o.mode = parse_bucket_mode(*mode);
    return std::make_unique<BucketPass>(std::move(o));
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("pass {}: {}", bucket_pass_name(kind), e.what()));
  }
}

BucketingStats bucket_collectives(Graph& graph, const BucketOptions& options,
                                  std::string* explain) {
  check_bucket_options(options);
  BucketingStats stats;
  int64_t retry_work = 0;
  bool dropped = false;  // whether a round dropped members on a first try
  RoundPacks packs;
  for (int round = 1;; ++round) {
    Bucketer b(graph, options, explain, round, retry_work, &packs);
    const BucketingStats s = b.run();
    retry_work = b.retry_work();
    if (round == 1) {
      stats = s;
    } else {
      ++stats.rounds;
      stats.later_merged_buckets += s.merged_buckets;
    }
    dropped = dropped || b.dropped_on_first_try();
    // Run again after a round that merged and dropped members (or followed such a round),
    // until one merges nothing: that round's graph is a fixed point. Members the budget left
    // untried stop the rounds (more runs would spend more than the budget).
    if (!s.changed() || !dropped || b.budget_spent()) break;
    if (round == options.max_rounds) {
      if (explain) {
        explain->append(fmt::format("  stopped after {} round{}: another may merge more\n",
                                    round, round == 1 ? "" : "s"));
      }
      break;
    }
  }
  return stats;
}

}  // namespace funcol
