// The executor: plan once (slots, last uses, groups), then run with little work per node.
#include "funcol/runtime/executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <new>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "funcol/core/error.h"
#include "funcol/dist/work.h"
#include "funcol/graph/ops.h"
#include "funcol/runtime/profile.h"

namespace funcol {

namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

// "graph @g, node %ag (line 3)": how every executor error names its node; without the line in
// the message of a located error (see throw_at).
std::string node_context(const Graph& graph, const Node& node, bool with_line = true) {
  if (with_line && node.loc().known()) {
    return fmt::format("graph @{}, node %{} (line {})", graph.name(), node.name(), node.loc().line);
  }
  return fmt::format("graph @{}, node %{}", graph.name(), node.name());
}

// Throws the InvalidArgument "<node context>: message", located at the node when parsed.
[[noreturn]] void fail_at(const Graph& graph, const Node& node, const std::string& message) {
  throw_at<InvalidArgument>(node, node_context(graph, node) + ": " + message,
                            node_context(graph, node, false) + ": " + message);
}

// Rethrows the exception in flight with the node's context in front, keeping its type, and
// located at the node when it was parsed.
[[noreturn]] void rethrow_at(const Graph& graph, const Node& node) {
  const std::optional<SourceLocated> at = source_of(node, node_context(graph, node, false) + ": ");
  rethrow_prefixed(node_context(graph, node) + ": ", at ? &*at : nullptr);
}

// Checks one collective's attributes against the size of the group it names. `same_graph`:
// every rank runs this very graph, so its all_to_all split sizes are every rank's.
void check_collective(const Graph& graph, const Node& node, const std::string& group_name,
                      int size, bool same_graph) {
  const OpDef& op = node.op();
  auto fail = [&](const std::string& message) {
    fail_at(graph, node, message);
  };
  if (op.attr_index("group_size") >= 0) {
    const int64_t group_size = node.attr("group_size").as_int();
    if (group_size != size) {
      fail(fmt::format("group_size {} does not match group '{}' of size {}", group_size, group_name,
                       size));
    }
  }
  if (op.collective == CollectiveKind::Broadcast) {
    const int64_t src = node.attr("src").as_int();
    if (src < 0 || src >= size) {
      fail(fmt::format("src {} is out of range for group '{}' of size {}", src, group_name, size));
    }
  }
  if (op.collective == CollectiveKind::AllToAll) {
    for (std::string_view name : {"output_split_sizes", "input_split_sizes"}) {
      const size_t n = node.attr(name).as_ints().size();
      if (n != static_cast<size_t>(size)) {
        fail(fmt::format("{} has {} entries but group '{}' has {} ranks", name, n, group_name,
                         size));
      }
    }
    // Rank r sends input_split_sizes[j] rows to rank j, which expects output_split_sizes[r]
    // from it: with one list for every rank, only equal entries can match. (Gloo would abort
    // the rank that receives more than it expects; the threads backend fails at the wait.)
    if (same_graph) {
      const std::vector<int64_t>& in = node.attr("input_split_sizes").as_ints();
      const std::vector<int64_t>& out = node.attr("output_split_sizes").as_ints();
      size_t r = 0;
      size_t j = 0;
      while (j < in.size() && in[j] == out[r]) ++j;
      if (j == in.size()) {  // every in[j] is out[0]: look for an out[r] that is not
        j = 0;
        while (r < out.size() && out[r] == in[j]) ++r;
      }
      if (r < out.size() && j < in.size()) {
        auto rows = [](int64_t k) { return fmt::format("{} row{}", k, k == 1 ? "" : "s"); };
        fail(fmt::format("mismatched split sizes (every rank runs this graph): rank {} sends {} "
                         "to rank {} (input_split_sizes[{}]) but rank {} expects {} from rank {} "
                         "(output_split_sizes[{}]); split sizes the same on every rank must all "
                         "be equal",
                         r, rows(in[j]), j, j, j, rows(out[r]), r, r));
      }
    }
  }
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) {
    if (!out.empty()) out += ", ";
    out += printable(n);
  }
  return out;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

void validate_groups(const Graph& graph,
                     const std::function<std::optional<int>(const std::string&)>& group_size,
                     const std::vector<std::string>& known) {
  for (const Node& node : graph.nodes()) {
    if (!node.op().is_collective()) continue;
    const std::string& name = node.attr("group").as_string();
    std::optional<int> size = group_size(name);
    if (!size) {
      fail_at(graph, node, fmt::format("unknown group '{}' (known groups: {})", printable(name),
                                       join_names(known)));
    }
    check_collective(graph, node, name, *size, /*same_graph=*/true);
  }
}

uint64_t input_seed(uint64_t seed, uint64_t index, int rank) {
  return splitmix64(splitmix64(splitmix64(seed) ^ index) ^ static_cast<uint64_t>(rank));
}

std::vector<Tensor> make_inputs(const Graph& graph, uint64_t seed, int rank) {
  std::vector<Tensor> inputs;
  inputs.reserve(graph.num_inputs());
  for (size_t i = 0; i < graph.num_inputs(); ++i) {
    const Type& type = graph.input(i)->type();
    inputs.push_back(Tensor::rand(type.shape, type.dtype, input_seed(seed, i, rank)));
  }
  return inputs;
}

// ---- the plan ---------------------------------------------------------------------------------

namespace {

// Skip and Take only appear in lowered bucket chains (see lower_buckets) and folded casts (see
// fold_casts): Skip does nothing, and so does Take, whose results the bucket's collective
// placed in its result slots at issue. CatCasts is a cat that converts the operands of casts
// folded into it.
enum class StepKind : uint8_t { Kernel, Collective, Wait, Skip, Take, CatCasts };

// One node, with everything run() needs precomputed.
struct Step {
  const Node* node = nullptr;
  const OpDef* op = nullptr;
  KernelFn kernel = nullptr;
  StepKind kind = StepKind::Kernel;
  // An operand appears twice: copy operands into the scratch list instead of moving them.
  bool copy_operands = false;
  uint32_t operands_begin = 0;  // into operand_slots / operand_release
  uint32_t num_operands = 0;
  uint32_t results_begin = 0;  // result slots are consecutive
  uint32_t num_results = 0;
  uint32_t release_begin = 0;  // into release_slots: slots dead after this step
  uint32_t num_release = 0;
  // The node's attributes and result types, so the hot loop never touches the Node.
  const Attr* attrs = nullptr;
  uint32_t num_attrs = 0;
  uint32_t types_begin = 0;  // into result_types
  // Collectives: the group, the decoded attributes, the Inflight index. Wait: the Inflight
  // index of the collective it waits (through views), or kNone.
  ProcessGroup* group = nullptr;
  ReduceOp reduce_op = ReduceOp::Sum;
  int src = 0;
  uint32_t inflight = kNone;
  // Lowered bucket chains: the LoweredBucket a collective step runs.
  uint32_t bucket = kNone;
};

// A bucketing chain run as one flat primitive on its members (ExecutorOptions::
// lower_buckets). The collective step allocates the members' results and issues the primitive
// on them; they reach the chain's last nodes' slots at once.
struct LoweredBucket {
  // Consecutive members whose results have one type and consecutive slots, and lie back to
  // back in the buffer (usually the whole bucket: a split's pieces of one shape).
  struct Run {
    // The members' result type as a meta tensor: its layout is shared by every run's results
    // (a bucket's thousand results are placed without building or looking up a layout each).
    Tensor type;
    uint32_t first_slot = 0;  // member k of the run has result slot first_slot + k
    uint32_t count = 0;
  };
  // The members' results, in member order. They are placed in their slots at issue (nothing
  // reads a slot before its value's Take step, and each value has a slot of its own), so Take
  // has nothing to do: a bucket of a thousand members saves a pass over a thousand Tensors, on
  // lines its data swept out of the cache. (A bucket of 1000 x 4 KiB reduce_scatters took
  // 0.41-0.43 ms through a coalesced list and Take steps, 0.34-0.35 ms so: fusion_bench, 2
  // ranks.) Runs rather than a type, slot and offset per member: placing reads nothing per
  // member but the run.
  std::vector<Run> runs;  // never empty
  // One buffer holds every member's result, back to back: one allocation per run and one
  // storage for the backend to track, as the chain's split pieces share the bucket's buffer
  // (all_reduce, reduce_scatter). An all_gather chain's reshapes copy each member out, but its
  // members share one buffer here too, as FSDP's gathered parameters do: a thousand 8 KiB
  // allocations per run made a bucket of 1000 x 4 KiB all_gathers 5-20% slower. The price: the
  // buffer lives while any member does, and a member is never donated to a later in-place
  // collective (its storage is shared), so such a use copies it.
  int64_t numel = 0;
  // The chain's members, handed to ProcessGroup::all_reduce_flat, all_gather_flat or
  // reduce_scatter_flat as one list: held from issue until the collective is closed, so that
  // the members are released here, on this thread, rather than by whichever thread finished it.
  std::shared_ptr<std::vector<Tensor>> held;
};

// Each view's result to the value at the start of its chain of views (lookups only).
using ViewBases = std::unordered_map<const Value*, const Value*>;

// The base of `v`'s chain of views: `v` itself when it is no view's result.
const Value* view_base_of(const ViewBases& bases, const Value* v) {
  auto it = bases.find(v);
  return it == bases.end() ? v : it->second;
}

// One collective of the current run between its issue and its completion.
struct Inflight {
  std::shared_ptr<Work> work;
  uint32_t step = 0;
  int64_t issue_ns = 0;
  int64_t done_ns = -1;  // when first seen complete (profiling only)
  bool open = false;
  int run = -1;  // the run (Impl::runs) that issued it last
};

// A CatCasts step's result (see Executor::Impl::fold_casts): `in`, the cat's operands with the
// folded casts' operands in their places, converted into one tensor of the cat's type.
std::vector<Tensor> cat_casts(const Node& cat, std::span<const Tensor> in) {
  const Type& type = cat.result(0)->type();
  int64_t dim = cat.attr("dim").as_int();
  if (dim < 0) dim += static_cast<int64_t>(type.rank());
  Tensor out = Tensor::empty(type.shape, type.dtype);
  int64_t at = 0;
  for (const Tensor& t : in) {
    // An operand of no elements is passed over: it adds nothing along `dim`, or it shares a dim
    // of size 0 with the output, which then has nothing to copy. (One that cat skips, type [0],
    // PyTorch's legacy rule, may have no dim `dim` at all.)
    if (t.numel() == 0) continue;
    const int64_t n = t.size(dim);
    out.narrow(dim, at, n).copy_(t);
    at += n;
  }
  return {std::move(out)};
}

}  // namespace

struct Executor::Impl {
  const Graph& graph;
  ProcessGroup& world;
  std::atomic<bool> running{false};  // a run() in progress (Executor::run refuses a second)
  ExecutorOptions options;
  Profiler* prof = nullptr;
  bool observe = false;

  std::vector<Step> steps;
  std::vector<uint32_t> operand_slots;
  std::vector<uint8_t> operand_release;  // 1: this step is the operand's last use
  std::vector<uint32_t> release_slots;
  std::vector<uint32_t> initial_release;  // graph inputs nobody uses
  // The steps a run walks, in order: all of them when observed (the profiler and on_node see
  // every node), else all but those with nothing to do (the Skip and Take steps of lowered
  // chains, unless they release a result the bucket placed: a bucket of a thousand members
  // would walk two thousand such steps a run, 1.5 cache lines each).
  std::vector<uint32_t> run_order;
  // The slots that may still hold a value once a run handed out its outputs: written by some
  // step and never released by one, nor moved out as an output. Empty for most graphs; a run
  // clears these instead of every slot (3,000 of them in a bucket of 1000 members).
  std::vector<uint32_t> end_clear;
  // The layout of each input whose sizes the last run checked: an input of that very layout
  // (held here, so its address names no other) has those sizes. Checking 1000 inputs' sizes
  // took 7.5 us a step (fusion_bench's 1000 x 4 KiB graphs), each a miss on a cold layout.
  std::vector<std::shared_ptr<const detail::Layout>> checked_layouts;
  // Each input's dtype, read every run without touching the graph's Values.
  std::vector<DType> input_dtypes;
  std::vector<uint32_t> output_slots;
  // 1 where output i is its slot's last listing: run() moves it out instead of copying it
  // (a copy costs reference counts; the slot is cleared after the run anyway).
  std::vector<uint8_t> output_moves;
  // Expected result types of kernel steps, packed: (dtype, rank, dims...) per result.
  std::vector<int64_t> result_types;
  std::vector<std::shared_ptr<ProcessGroup>> groups;  // keeps resolved groups alive
  size_t num_slots = 0;

  // Run state.
  std::vector<Tensor> slots;
  std::vector<Tensor> scratch;
  std::vector<Inflight> inflight;
  // Indices into inflight, issue order, of the collectives issued and not closed, plus closed
  // ones not yet compacted away (their Inflight::open is false): closing one is O(1) (finding
  // and erasing it took a run with 160,000 in flight seconds), and issue() compacts the list
  // once the closed outnumber the open.
  std::vector<uint32_t> open;
  size_t num_open = 0;
  // Profiling: the entries of `open` whose completion poll() has not seen yet, from
  // unseen_head on (recorded or closed ones before it are skipped once and for all).
  std::vector<uint32_t> unseen;
  size_t unseen_head = 0;
  std::vector<LoweredBucket> buckets;
  size_t folded_casts = 0;
  int runs = 0;

  Impl(const Graph& g, ProcessGroup& w, ExecutorOptions o)
      : graph(g), world(w), options(std::move(o)) {
    prof = options.profiler;
    observe = prof != nullptr || static_cast<bool>(options.on_node);
  }

  void plan();
  // run_order and end_clear, once the steps and their releases are final.
  void plan_walk();
  void lower_buckets(const std::unordered_map<const Value*, uint32_t>& slot_of,
                     const std::unordered_map<const Node*, uint32_t>& step_of);
  void fold_casts(const std::unordered_map<const Node*, uint32_t>& step_of,
                  const ViewBases& view_base);
  std::vector<Tensor> run(std::vector<Tensor> inputs);
  template <bool kObserve>
  void run_steps(size_t& cur);
  void issue(const Step& st, std::span<Tensor> in, const uint8_t* release,
             uint32_t step_index);
  // A lowered bucket's collective step: reads its members from their slots (a thousand of
  // them are not staged in the scratch list and back) and releases those that die here.
  void issue_bucket(const Step& st, uint32_t step_index);
  // Records `work` as the in-flight collective of step `step_index`, issued at `issue_ns`.
  void track(const Step& st, std::shared_ptr<Work> work, uint32_t step_index, int64_t issue_ns);
  // `in` is the step's scratch operand; `last_use`: it may be moved into the result.
  void wait(const Step& st, Tensor& in, bool last_use);
  void close(uint32_t index, int64_t now);
  void poll();
  void finish(size_t& cur);
  // After a failure at node `at`: issues, in run order, every collective of the run not issued
  // yet, with inputs that hold the failure (see give_up's definition).
  void give_up(const Node& at) noexcept;
  // Posts the lowered bucket `st` (all_reduce_flat, all_gather_flat or reduce_scatter_flat of
  // `list` into `flat`).
  std::shared_ptr<Work> post_flat(const Step& st, const Tensor& flat,
                                  std::shared_ptr<std::vector<Tensor>> list);
  void abort() noexcept;
};

void Executor::Impl::plan() {
  const GroupRegistry& registry = world.registry();
  std::unordered_map<const Value*, uint32_t> slot_of;
  std::unordered_map<const Node*, uint32_t> collective_index;
  std::unordered_map<const Node*, uint32_t> step_of;  // lookups only, never iterated
  // The base of each view's result: the value at the start of its chain of views, found as the
  // views come (a walk back per wait or cast would be quadratic in a chain's length).
  ViewBases view_base;
  auto base_of = [&](const Value* v) { return view_base_of(view_base, v); };
  uint32_t next_slot = 0;
  for (const Value* in : graph.inputs()) {
    slot_of.emplace(in, next_slot++);
    input_dtypes.push_back(in->dtype());
  }

  size_t max_operands = 0;
  std::vector<uint32_t> seen;
  for (const Node& node : graph.nodes()) {
    const OpDef& op = node.op();
    Step st;
    st.node = &node;
    st.op = &op;
    st.operands_begin = static_cast<uint32_t>(operand_slots.size());
    st.num_operands = static_cast<uint32_t>(node.num_operands());
    max_operands = std::max<size_t>(max_operands, node.num_operands());
    for (const Value* v : node.operands()) {
      auto it = slot_of.find(v);
      if (it == slot_of.end()) {
        fail_at(graph, node, fmt::format("operand {} is used before it is defined",
                                         v ? v->ref() : std::string("<null>")));
      }
      // seen[slot] == step + 1: the slot is already an operand of this step.
      if (seen.size() <= it->second) seen.resize(it->second + 1, 0);
      if (seen[it->second] == steps.size() + 1) st.copy_operands = true;
      seen[it->second] = static_cast<uint32_t>(steps.size() + 1);
      operand_slots.push_back(it->second);
    }
    try {
      op.check_operand_count(node.num_operands());
    } catch (...) {
      rethrow_at(graph, node);
    }
    if (op.is_collective()) {
      st.kind = StepKind::Collective;
      const std::string& name = node.attr("group").as_string();
      std::shared_ptr<ProcessGroup> group = registry.find(name);
      if (!group) {
        // A group is registered on its members only: the name may be right.
        fail_at(graph, node,
                fmt::format("unknown group '{}' (known groups: {}; a group is known on its "
                            "members only, and rank {} may not be one)",
                            printable(name), join_names(registry.names()), world.rank()));
      }
      check_collective(graph, node, name, group->size(), options.check_same_graph);
      st.group = group.get();
      groups.push_back(std::move(group));
      if (op.attr_index("reduce_op") >= 0) {
        try {
          st.reduce_op = parse_reduce_op(node.attr("reduce_op").as_string());
        } catch (...) {
          rethrow_at(graph, node);
        }
      }
      if (op.collective == CollectiveKind::Broadcast) {
        st.src = static_cast<int>(node.attr("src").as_int());
      }
      st.attrs = node.attr_values().data();  // the pack function of packing collectives reads them
      st.num_attrs = static_cast<uint32_t>(node.attr_values().size());
      st.inflight = static_cast<uint32_t>(inflight.size());
      collective_index.emplace(&node, st.inflight);
      inflight.emplace_back();
      inflight.back().step = static_cast<uint32_t>(steps.size());
    } else if (op.collective == CollectiveKind::Wait) {
      st.kind = StepKind::Wait;
      // The collective this wait completes: the base of its operand's views.
      const Value* v = node.num_operands() == 1 ? base_of(node.operand(0)) : nullptr;
      if (v && v->node()) {
        auto it = collective_index.find(v->node());
        if (it != collective_index.end()) st.inflight = it->second;
      }
    } else {
      if (!op.kernel) {
        fail_at(graph, node, fmt::format("op {} has no CPU kernel", op.name));
      }
      st.kernel = value_kernel(op);
      st.attrs = node.attr_values().data();
      st.num_attrs = static_cast<uint32_t>(node.attr_values().size());
      st.types_begin = static_cast<uint32_t>(result_types.size());
      for (size_t r = 0; r < node.num_results(); ++r) {
        const Type& t = node.result(r)->type();
        result_types.push_back(static_cast<int64_t>(t.dtype));
        result_types.push_back(t.rank());
        result_types.insert(result_types.end(), t.shape.begin(), t.shape.end());
      }
    }
    if (op.is_view && node.num_operands() > 0) {
      const Value* base = base_of(node.operand(0));
      for (size_t r = 0; r < node.num_results(); ++r) view_base.emplace(node.result(r), base);
    }
    st.results_begin = next_slot;
    st.num_results = static_cast<uint32_t>(node.num_results());
    for (size_t r = 0; r < node.num_results(); ++r) slot_of.emplace(node.result(r), next_slot++);
    step_of.emplace(&node, static_cast<uint32_t>(steps.size()));
    steps.push_back(st);
  }
  num_slots = next_slot;
  // Lowering turns a chain's collective into a flat primitive, a different collective for the
  // backend, and decides it from what the chain's values feed on this rank only: ranks that run
  // graphs of their own could decide differently for the same collective (a mismatch on
  // threads; on mpi a list of gathers against one). Only equal graphs lower alike.
  if (options.lower_buckets && options.check_same_graph) {
    lower_buckets(slot_of, step_of);
    for (const Step& st : steps) max_operands = std::max<size_t>(max_operands, st.num_operands);
  }
  fold_casts(step_of, view_base);

  // Last uses. Graph outputs are never released; a value nobody uses dies with its step.
  std::vector<uint32_t> last_use(num_slots, kNone);
  std::vector<uint8_t> keep(num_slots, 0);
  for (uint32_t s = 0; s < steps.size(); ++s) {
    const Step& st = steps[s];
    for (uint32_t i = 0; i < st.num_operands; ++i)
      last_use[operand_slots[st.operands_begin + i]] = s;
  }
  for (const Value* out : graph.outputs()) {
    auto it = slot_of.find(out);
    if (it == slot_of.end()) {
      throw InvalidArgument(fmt::format("graph @{}: output {} is not defined in the graph",
                                        graph.name(), out ? out->ref() : std::string("<null>")));
    }
    keep[it->second] = 1;
    output_slots.push_back(it->second);
  }
  output_moves.assign(output_slots.size(), 0);
  {
    std::vector<uint8_t> seen(num_slots, 0);
    for (size_t i = output_slots.size(); i-- > 0;) {
      if (!seen[output_slots[i]]) output_moves[i] = 1;
      seen[output_slots[i]] = 1;
    }
  }
  operand_release.assign(operand_slots.size(), 0);
  std::vector<uint32_t> released_at(num_slots, 0);
  for (uint32_t s = 0; s < steps.size(); ++s) {
    Step& st = steps[s];
    // The last occurrence of a dying operand releases it (walking backwards, the first seen).
    for (uint32_t i = st.num_operands; i-- > 0;) {
      const uint32_t slot = operand_slots[st.operands_begin + i];
      if (keep[slot] || last_use[slot] != s) continue;
      if (released_at[slot] == s + 1) continue;
      released_at[slot] = s + 1;
      operand_release[st.operands_begin + i] = 1;
    }
    st.release_begin = static_cast<uint32_t>(release_slots.size());
    for (uint32_t r = 0; r < st.num_results; ++r) {
      const uint32_t slot = st.results_begin + r;
      if (!keep[slot] && last_use[slot] == kNone) release_slots.push_back(slot);
    }
    st.num_release = static_cast<uint32_t>(release_slots.size()) - st.release_begin;
  }
  for (uint32_t i = 0; i < graph.num_inputs(); ++i) {
    if (!keep[i] && last_use[i] == kNone) initial_release.push_back(i);
  }
  plan_walk();
  slots.resize(num_slots);
  scratch.resize(max_operands);
  open.reserve(inflight.size());
}

void Executor::Impl::plan_walk() {
  // state[slot]: 1 once some step writes the slot, 2 once a step, the start or the outputs
  // empty it again (each slot is written by one step, before any of its releases: its own,
  // or for a bucket's results, the bucket's collective step).
  std::vector<uint8_t> state(num_slots, 0);
  for (uint32_t i = 0; i < graph.num_inputs(); ++i) state[i] = 1;
  for (uint32_t slot : initial_release) state[slot] = 2;
  for (uint32_t s = 0; s < steps.size(); ++s) {
    const Step& st = steps[s];
    const uint32_t* released = release_slots.data() + st.release_begin;
    if (st.kind == StepKind::Skip || st.kind == StepKind::Take) {
      // Nothing to run but releases, of results a bucket placed at its issue (a Take's, or the
      // pieces a gather chain's skipped split hands out as they are) or of results never
      // written (the rest of a Skip's).
      const bool releases = std::any_of(released, released + st.num_release,
                                        [&](uint32_t x) { return state[x] == 1; });
      if (observe || releases) run_order.push_back(s);
      for (uint32_t i = 0; i < st.num_release; ++i) state[released[i]] = 2;
      continue;
    }
    run_order.push_back(s);
    for (uint32_t r = 0; r < st.num_results; ++r) state[st.results_begin + r] = 1;
    if (st.bucket != kNone) {
      for (const LoweredBucket::Run& run : buckets[st.bucket].runs) {
        std::fill_n(state.begin() + run.first_slot, run.count, 1);
      }
    }
    for (uint32_t i = 0; i < st.num_operands; ++i) {
      if (operand_release[st.operands_begin + i]) state[operand_slots[st.operands_begin + i]] = 2;
    }
    for (uint32_t i = 0; i < st.num_release; ++i) state[released[i]] = 2;
  }
  for (size_t i = 0; i < output_slots.size(); ++i) {
    if (output_moves[i]) state[output_slots[i]] = 2;
  }
  for (uint32_t slot = 0; slot < num_slots; ++slot) {
    if (state[slot] == 1) end_clear.push_back(slot);
  }
}

void Executor::Impl::issue(const Step& st, std::span<Tensor> in, const uint8_t* release,
                           uint32_t step_index) {
  ProcessGroup& g = *st.group;
  const Node& node = *st.node;
  Tensor* out = &slots[st.results_begin];
  const int64_t t0 = prof ? prof->now_ns() : 0;
  // Packing collectives are variadic with one result: not coalesced (see PackFn).
  const bool coalesced = st.op->variadic && st.op->pack == nullptr;
  auto empty_result = [&](size_t r) {
    const Type& t = node.result(r)->type();
    return Tensor::empty(t.shape, t.dtype);
  };
  // The backend reads input bytes directly: an input still produced by an earlier collective
  // (a graph that skips its wait_tensor) is waited first. (issue_bucket does not: a pass over a
  // bucket's thousand storages, and the flat primitives wait for their inputs themselves.) An
  // input that holds a failure (that collective's, or give_up's) goes to the backend as it is,
  // as a contiguous stand-in: the backend takes the collective's place in the group's sequence
  // and fails it on every rank, where a throw here would leave this rank one collective behind.
  std::vector<uint8_t> failed;  // failed[i]: input i holds a failure (sized on the first)
  std::exception_ptr failure;
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::optional<Tensor> stand_in = failed_stand_in(in[i], &failure)) {
      in[i] = std::move(*stand_in);
      failed.resize(in.size());
      failed[i] = 1;
    }
  }
  // Out of place as the functional ops: the result is a copy reduced (or overwritten) in place,
  // unless this is the operand's last use and nothing else holds its storage: then the operand
  // itself is donated, as a bucket's packed buffer always is.
  auto own_copy = [&](size_t i) {
    const Tensor& t = in[i];
    if (!failed.empty() && failed[i]) return t;
    if (release[i] && !st.copy_operands && t.is_contiguous() && t.storage().use_count() == 1) {
      return t;
    }
    return t.clone();
  };
  std::shared_ptr<Work> work;
  switch (st.op->collective) {
    case CollectiveKind::AllReduce:
      if (!coalesced) {
        out[0] = own_copy(0);
        work = g.all_reduce(out[0], st.reduce_op);
      } else {
        std::vector<Tensor> outs;
        outs.reserve(in.size());
        for (size_t i = 0; i < in.size(); ++i) outs.push_back(own_copy(i));
        work = g.all_reduce_coalesced(outs, st.reduce_op);
        for (size_t r = 0; r < outs.size(); ++r) out[r] = std::move(outs[r]);
      }
      break;
    case CollectiveKind::AllGather:
    case CollectiveKind::ReduceScatter: {
      const bool gather = st.op->collective == CollectiveKind::AllGather;
      if (st.op->pack != nullptr) {
        // Pack the operands straight into this rank's slot of the result, then gather in
        // place: the slot is the send buffer, so no packed input buffer exists.
        Tensor o = empty_result(0);
        const int64_t per_rank = o.numel() / g.size();
        Tensor slot = o.flatten().narrow(0, g.rank() * per_rank, per_rank);
        if (failure) {
          work = g.all_gather(o, failed_tensor(slot.sizes(), slot.dtype(), failure));
        } else {
          st.op->pack(in, AttrList(*st.op, std::span<const Attr>(st.attrs, st.num_attrs)), slot);
          work = g.all_gather(o, slot);
        }
        out[0] = std::move(o);
      } else if (!coalesced) {
        Tensor o = empty_result(0);
        work = gather ? g.all_gather(o, in[0].contiguous())
                      : g.reduce_scatter(o, in[0].contiguous(), st.reduce_op);
        out[0] = std::move(o);
      } else {
        std::vector<Tensor> outs, ins;
        outs.reserve(in.size());
        ins.reserve(in.size());
        for (size_t r = 0; r < in.size(); ++r) {
          outs.push_back(empty_result(r));
          ins.push_back(in[r].contiguous());
        }
        work = gather ? g.all_gather_coalesced(outs, ins)
                      : g.reduce_scatter_coalesced(outs, ins, st.reduce_op);
        for (size_t r = 0; r < outs.size(); ++r) out[r] = std::move(outs[r]);
      }
      break;
    }
    case CollectiveKind::AllToAll: {
      Tensor o = empty_result(0);
      work = g.all_to_all(o, in[0].contiguous(), node.attr("output_split_sizes").as_ints(),
                          node.attr("input_split_sizes").as_ints());
      out[0] = std::move(o);
      break;
    }
    case CollectiveKind::Broadcast:
      out[0] = own_copy(0);
      work = g.broadcast(out[0], st.src);
      break;
    case CollectiveKind::None:
    case CollectiveKind::Wait:
      FUNCOL_CHECK(false, "issue() of a non-collective step");
  }
  track(st, std::move(work), step_index, t0);
}

void Executor::Impl::issue_bucket(const Step& st, uint32_t step_index) {
  const int64_t t0 = prof ? prof->now_ns() : 0;
  const uint32_t* ops = operand_slots.data() + st.operands_begin;
  const uint8_t* release = operand_release.data() + st.operands_begin;
  // The members go straight to one primitive, whose results are views of one buffer.
  LoweredBucket& b = buckets[st.bucket];
  const Tensor flat = Tensor::empty({b.numel}, b.runs.front().type.dtype());
  int64_t offset = 0;
  for (const LoweredBucket::Run& run : b.runs) {
    Tensor::placed_run(run.type, flat.storage(), offset,
                       std::span<Tensor>(&slots[run.first_slot], run.count));
    offset += run.type.numel() * run.count;
  }
  // What the wait_tensor of the chain waits on: the first member's result.
  slots[st.results_begin] = slots[b.runs.front().first_slot];
  // The members are read where they are into the buffer. The list owns them (one reference
  // for the backend to hold): a member's last use moves it in, unless the step lists its
  // value twice (then each listing is a copy and the slot is released after them all).
  auto list = std::make_shared<std::vector<Tensor>>();
  list->reserve(st.num_operands);
  for (uint32_t i = 0; i < st.num_operands; ++i) {
    Tensor& t = slots[ops[i]];
    const bool dies = release[i] && !st.copy_operands;
    if (!t.is_contiguous()) {
      list->push_back(t.contiguous());
      if (dies) t = Tensor();
    } else if (dies) {
      list->push_back(std::move(t));
    } else {
      list->push_back(t);
    }
  }
  if (st.copy_operands) {
    for (uint32_t i = 0; i < st.num_operands; ++i) {
      if (release[i]) slots[ops[i]] = Tensor();
    }
  }
  b.held = list;
  track(st, post_flat(st, flat, std::move(list)), step_index, t0);
}

std::shared_ptr<Work> Executor::Impl::post_flat(const Step& st, const Tensor& flat,
                                                std::shared_ptr<std::vector<Tensor>> list) {
  ProcessGroup& g = *st.group;
  switch (st.op->collective) {
    case CollectiveKind::AllReduce: return g.all_reduce_flat(flat, std::move(list), st.reduce_op);
    case CollectiveKind::AllGather: return g.all_gather_flat(flat, std::move(list));
    case CollectiveKind::ReduceScatter:
      return g.reduce_scatter_flat(flat, std::move(list), st.reduce_op);
    default: FUNCOL_CHECK(false, "lowered bucket of an unexpected collective");
  }
  return nullptr;
}

void Executor::Impl::track(const Step& st, std::shared_ptr<Work> work, uint32_t step_index,
                           int64_t issue_ns) {
  FUNCOL_CHECK(work != nullptr, fmt::format("{} returned no Work", st.op->name));
  Inflight& f = inflight[st.inflight];
  f.work = std::move(work);
  f.step = step_index;
  f.issue_ns = issue_ns;
  f.done_ns = -1;
  f.open = true;
  f.run = runs;
  if (open.size() >= 2 * num_open + 32) {
    std::erase_if(open, [&](uint32_t i) { return !inflight[i].open; });
  }
  open.push_back(st.inflight);
  ++num_open;
  if (prof) unseen.push_back(st.inflight);
}

void Executor::Impl::close(uint32_t index, int64_t now) {
  Inflight& f = inflight[index];
  if (!f.open) return;
  if (prof) {
    prof->add(Span{.kind = SpanKind::Communication,
                   .iteration = runs,
                   .node = steps[f.step].node,
                   .begin_ns = f.issue_ns,
                   .end_ns = f.done_ns >= 0 ? f.done_ns : now});
  }
  f.open = false;
  --num_open;
  f.work.reset();
  if (steps[f.step].bucket != kNone) buckets[steps[f.step].bucket].held.reset();
}

void Executor::Impl::wait(const Step& st, Tensor& in, bool last_use) {
  const int64_t t0 = prof ? prof->now_ns() : 0;
  if (prof && st.inflight != kNone) {
    Inflight& f = inflight[st.inflight];
    if (f.open && f.done_ns < 0 && f.work->is_completed()) f.done_ns = t0;
  }
  in.wait();
  if (st.inflight != kNone && inflight[st.inflight].open) {
    inflight[st.inflight].work->wait();
    close(st.inflight, prof ? prof->now_ns() : 0);
  }
  if (last_use) {
    slots[st.results_begin] = std::move(in);
  } else {
    slots[st.results_begin] = in;
  }
  if (prof) {
    prof->add(Span{.kind = SpanKind::Wait,
                   .iteration = runs,
                   .node = st.node,
                   .begin_ns = t0,
                   .end_ns = prof->now_ns()});
  }
}

// Records when in-flight collectives are first seen complete. Looks at most kPollDepth
// incomplete ones, oldest first (a group completes its collectives in issue order, so later
// ones of one group are rarely done before them; another group's may be, and a trace then
// shows one done behind kPollDepth unfinished ones at its wait): a step costs O(1) however
// many are in flight, and a collective completing behind them is seen when they are, or at
// its wait.
void Executor::Impl::poll() {
  constexpr int kPollDepth = 8;
  const int64_t now = prof->now_ns();
  auto seen = [&](uint32_t index) {
    const Inflight& f = inflight[index];
    return !f.open || f.done_ns >= 0;
  };
  int incomplete = 0;
  for (size_t i = unseen_head; i < unseen.size() && incomplete < kPollDepth; ++i) {
    Inflight& f = inflight[unseen[i]];
    if (seen(unseen[i])) continue;
    if (f.work->is_completed()) {
      f.done_ns = now;
    } else {
      ++incomplete;
    }
  }
  while (unseen_head < unseen.size() && seen(unseen[unseen_head])) ++unseen_head;
  if (unseen_head == unseen.size()) {
    unseen.clear();
    unseen_head = 0;
  }
}

template <bool kObserve>
void Executor::Impl::run_steps(size_t& cur) {
  Tensor* sc = scratch.data();
  for (const uint32_t s : run_order) {
    cur = s;
    const Step& st = steps[s];
    const uint32_t* ops = operand_slots.data() + st.operands_begin;
    const uint8_t* rel = operand_release.data() + st.operands_begin;
    // A lowered bucket reads its members from their slots itself.
    const uint32_t staged = st.bucket == kNone ? st.num_operands : 0;
    if (st.copy_operands) {
      for (uint32_t i = 0; i < staged; ++i) sc[i] = slots[ops[i]];
    } else {
      for (uint32_t i = 0; i < staged; ++i) sc[i] = std::move(slots[ops[i]]);
    }
    const std::span<const Tensor> in(sc, staged);
    switch (st.kind) {
      case StepKind::Kernel:
      case StepKind::CatCasts: {
        int64_t t0 = 0;
        if constexpr (kObserve) {
          if (prof) t0 = prof->now_ns();
        }
        std::vector<Tensor> out =
            st.kind == StepKind::Kernel
                ? st.kernel(in, AttrList(*st.op, std::span<const Attr>(st.attrs, st.num_attrs)))
                : cat_casts(*st.node, in);
        if (out.size() != st.num_results) {
          throw InternalError(fmt::format("kernel of {} returned {} results, expected {}",
                                          st.op->name, out.size(), st.num_results));
        }
        const int64_t* type = result_types.data() + st.types_begin;
        for (uint32_t r = 0; r < st.num_results; ++r) {
          // A kernel that disagrees with shape inference is an op-table bug.
          const Shape& sizes = out[r].sizes();
          const auto rank = static_cast<size_t>(type[1]);
          if (static_cast<int64_t>(out[r].dtype()) != type[0] || sizes.size() != rank ||
              !std::equal(sizes.begin(), sizes.end(), type + 2)) {
            throw InternalError(fmt::format("kernel of {} returned {} for result {} of type {}",
                                            st.op->name, type_str(out[r].dtype(), sizes), r,
                                            st.node->result(r)->type().str()));
          }
          type += 2 + rank;
          slots[st.results_begin + r] = std::move(out[r]);
        }
        if constexpr (kObserve) {
          if (prof) {
            prof->add(Span{.kind = SpanKind::Compute,
                           .iteration = runs,
                           .node = st.node,
                           .begin_ns = t0,
                           .end_ns = prof->now_ns()});
          }
        }
        break;
      }
      case StepKind::Collective:
        if (st.bucket != kNone) {
          issue_bucket(st, s);
        } else {
          issue(st, std::span<Tensor>(sc, st.num_operands), rel, s);
        }
        break;
      case StepKind::Wait:
        wait(st, sc[0], rel[0] && !st.copy_operands);
        break;
      case StepKind::Skip:
        break;
      case StepKind::Take:
        break;  // placed at issue
    }
    if (st.copy_operands) {
      for (uint32_t i = 0; i < staged; ++i) {
        sc[i] = Tensor();
        if (rel[i]) slots[ops[i]] = Tensor();
      }
    } else {
      for (uint32_t i = 0; i < staged; ++i) {
        if (rel[i]) {
          sc[i] = Tensor();
        } else {
          slots[ops[i]] = std::move(sc[i]);
        }
      }
    }
    for (uint32_t i = 0; i < st.num_release; ++i)
      slots[release_slots[st.release_begin + i]] = Tensor();
    if constexpr (kObserve) {
      if (prof) poll();
      if (options.on_node) options.on_node(*st.node);
    }
  }
}

// Waits the collectives the graph never waited, so a run ends with nothing in flight.
void Executor::Impl::finish(size_t& cur) {
  for (const uint32_t index : open) {  // close() leaves `open` as it is
    if (!inflight[index].open) continue;
    cur = inflight[index].step;
    inflight[index].work->wait();
    close(index, prof ? prof->now_ns() : 0);
  }
  open.clear();
  unseen.clear();
  unseen_head = 0;
}

// A run that fails part-way (a kernel's error, a collective that failed at its wait) stops
// there, while its peers go on issuing the run's collectives: had this rank left them out, its
// next run would pair its collectives with their current ones, silently so where the shapes
// agree. So every collective of the run it has not issued yet is issued now, in run order (the
// same on every rank), with inputs that hold an AbandonedError naming where and why it failed:
// each fails on every rank ("rank R could not take part: it gave up on the rest of its run
// after an error at graph @g, node %q: ..."), and every rank issues each collective once per
// run. On threads the groups stay usable; on mpi and gloo a group with such a collective is
// unusable afterwards, as after a timeout. A collective whose issue throws (its group already
// unusable) is passed over. Called while the run's exception is in flight.
void Executor::Impl::give_up(const Node& at) noexcept {
  try {
    const std::exception_ptr why = abandoned_error("run", " at " + node_context(graph, at));
    for (const uint32_t s : run_order) {
      const Step& st = steps[s];
      if (st.kind != StepKind::Collective || inflight[st.inflight].run == runs) continue;
      try {
        if (st.bucket == kNone) {
          std::vector<Tensor> in;
          for (const Value* v : st.node->operands()) {
            in.push_back(failed_tensor(v->shape(), v->dtype(), why));
          }
          const std::vector<uint8_t> kept(in.size(), 0);
          issue(st, in, kept.data(), s);
          continue;
        }
        // A lowered bucket: its members as the flat primitive takes them, from its results.
        ProcessGroup& g = *st.group;
        const LoweredBucket& b = buckets[st.bucket];
        const DType dtype = b.runs.front().type.dtype();
        auto list = std::make_shared<std::vector<Tensor>>();
        for (const LoweredBucket::Run& run : b.runs) {
          const int64_t out = run.type.numel();
          const int64_t numel = st.op->collective == CollectiveKind::AllGather ? out / g.size()
                                : st.op->collective == CollectiveKind::ReduceScatter
                                    ? out * g.size()
                                    : out;
          for (uint32_t k = 0; k < run.count; ++k) {
            list->push_back(failed_tensor({numel}, dtype, why));
          }
        }
        // Not tracked: its failure is the run's error, rethrown (see abort).
        post_flat(st, Tensor::empty({b.numel}, dtype), std::move(list))->set_failure_seen();
      } catch (...) {
      }
    }
  } catch (...) {
    // Out of memory building the reason: the peers find this rank missing at their timeout.
  }
}

void Executor::Impl::abort() noexcept {
  for (Tensor& t : slots) t = Tensor();
  for (Tensor& t : scratch) t = Tensor();
  for (LoweredBucket& b : buckets) {
    b.held.reset();  // the backend holds its own reference while it still reads the members
  }
  for (Inflight& f : inflight) {
    // The run's error, rethrown, explains a failure of the collectives it drops: the end of
    // the rank does not warn of them (UnwaitedFailures).
    if (f.open && f.work) f.work->set_failure_seen();
    f.work.reset();
    f.open = false;
  }
  open.clear();
  num_open = 0;
  unseen.clear();
  unseen_head = 0;
}

namespace {

// The only node that uses `v` as an operand, when `v` has exactly one use and is no output.
const Node* sole_user(const Value* v, std::string_view op) {
  if (v == nullptr || v->num_uses() != 1) return nullptr;
  const Node* user = v->uses()[0].user;
  return user != nullptr && user->op_name() == op ? user : nullptr;
}

// The members of a bucket chain and the nodes that become Skip or Take steps.
struct Chain {
  std::vector<const Value*> members;
  std::vector<const Node*> skip;
  std::vector<const Node*> take;  // each takes its node's results, members in order
  // Member i's result: result `second` of node `first` (a Take node's, or, in an all_gather
  // chain, a skipped split's piece that needs no reshape).
  std::vector<std::pair<const Node*, uint32_t>> results;
  std::vector<const Type*> out_types;
};

// all_gather bucket: cat(x_1..x_k){dim 0} -> all_gather_into_tensor, or
// all_gather_into_tensor_packed(x_1..x_k) with no dtype change; then wait_tensor, view [G, n],
// split_with_sizes{dim 1} into numel(x_i), and one reshape of each piece (the member's result),
// or none where the piece is already the result's shape (a member [1, n] gathers to [G, n]).
bool match_gather_chain(const Node& bucket, int64_t group_size, Chain& c) {
  if (bucket.op_name() == "all_gather_into_tensor") {
    const Node* cat = bucket.operand(0)->node();
    if (cat == nullptr || cat->op_name() != "cat" || cat->attr("dim").as_int() != 0 ||
        sole_user(cat->result(0), "all_gather_into_tensor") != &bucket) {
      return false;
    }
    for (const Value* x : cat->operands()) {
      if (x->shape().size() != 1) return false;
      c.members.push_back(x);
    }
    c.skip.push_back(cat);
  } else if (bucket.op_name() == "all_gather_into_tensor_packed") {
    const DType dtype = bucket.attr("dtype").as_dtype();
    const auto& outs = bucket.attr("out_dtypes").as_list();
    for (size_t i = 0; i < bucket.num_operands(); ++i) {
      if (bucket.operand(i)->dtype() != dtype || outs[i].as_dtype() != dtype) return false;
      c.members.push_back(bucket.operand(i));
    }
  } else {
    return false;
  }
  const Node* wait = sole_user(bucket.result(0), "wait_tensor");
  const Node* rows = wait ? sole_user(wait->result(0), "view") : nullptr;
  const Node* split = rows ? sole_user(rows->result(0), "split_with_sizes") : nullptr;
  if (split == nullptr || rows->result(0)->shape().size() != 2 ||
      rows->result(0)->shape()[0] != group_size || split->attr("dim").as_int() != 1 ||
      split->num_results() != c.members.size()) {
    return false;
  }
  c.skip.push_back(rows);
  c.skip.push_back(split);
  for (size_t i = 0; i < c.members.size(); ++i) {
    const Value* piece = split->result(i);
    if (piece->shape()[1] != c.members[i]->type().numel()) return false;
    // The piece is [G, numel(x_i)], the member's gathered rows back to back: the result
    // itself, or what its reshape views.
    const Node* out = sole_user(piece, "reshape");
    if (out == nullptr) {
      c.results.emplace_back(split, static_cast<uint32_t>(i));
      c.out_types.push_back(&piece->type());
      continue;
    }
    if (out->result(0)->type().numel() != group_size * c.members[i]->type().numel()) {
      return false;
    }
    c.take.push_back(out);
    c.results.emplace_back(out, 0);
    c.out_types.push_back(&out->result(0)->type());
  }
  return true;
}

// The tail of reduce_scatter and all_reduce buckets: wait_tensor, then split_with_sizes{dim 0}
// whose piece i (the member's result) has numel(x_i) / `divisor` elements of x_i's dtype.
bool match_split_tail(const Node& bucket, int64_t divisor, Chain& c) {
  const Node* wait = sole_user(bucket.result(0), "wait_tensor");
  const Node* split = wait ? sole_user(wait->result(0), "split_with_sizes") : nullptr;
  if (split == nullptr || split->attr("dim").as_int() != 0 ||
      split->num_results() != c.members.size()) {
    return false;
  }
  for (size_t i = 0; i < c.members.size(); ++i) {
    const Type& t = split->result(i)->type();
    if (t.numel() * divisor != c.members[i]->type().numel() || t.dtype != c.members[i]->dtype()) {
      return false;
    }
    c.out_types.push_back(&t);
    c.results.emplace_back(split, static_cast<uint32_t>(i));
  }
  c.take.push_back(split);
  return true;
}

// reduce_scatter bucket: bucket_pack(x_1..x_k){group_size G}, or reshape(x_i) to [G, m_i],
// cat{dim 1} and flatten; then reduce_scatter_tensor, wait_tensor and split_with_sizes{dim 0}
// into m_i (the members' results).
bool match_scatter_chain(const Node& bucket, int64_t group_size, Chain& c) {
  if (bucket.op_name() != "reduce_scatter_tensor") return false;
  const Node* pack = bucket.operand(0)->node();
  if (pack == nullptr || sole_user(pack->result(0), "reduce_scatter_tensor") != &bucket) {
    return false;
  }
  if (pack->op_name() == "bucket_pack") {
    if (pack->attr("group_size").as_int() != group_size) return false;
    for (const Value* x : pack->operands()) c.members.push_back(x);
    c.skip.push_back(pack);
  } else if (pack->op_name() == "flatten") {
    const Node* cat = pack->operand(0)->node();
    if (cat == nullptr || cat->op_name() != "cat" || cat->attr("dim").as_int() != 1 ||
        sole_user(cat->result(0), "flatten") != pack) {
      return false;
    }
    for (const Value* row : cat->operands()) {
      const Node* reshape = row->node();
      if (reshape == nullptr || reshape->op_name() != "reshape" ||
          sole_user(row, "cat") != cat || row->shape().size() != 2 ||
          row->shape()[0] != group_size) {
        return false;
      }
      c.members.push_back(reshape->operand(0));
      c.skip.push_back(reshape);
    }
    c.skip.push_back(cat);
    c.skip.push_back(pack);
  } else {
    return false;
  }
  return match_split_tail(bucket, group_size, c);
}

// all_reduce bucket: bucket_pack(x_1..x_k){group_size 1}, or cat{dim 0} of the members, each
// flattened unless 1-D; then wait_tensor and split_with_sizes{dim 0} into numel(x_i) (which the
// chain's reshapes view, as they view any tensor).
bool match_reduce_chain(const Node& bucket, Chain& c) {
  if (bucket.op_name() != "all_reduce") return false;
  const Node* pack = bucket.operand(0)->node();
  if (pack == nullptr || sole_user(pack->result(0), "all_reduce") != &bucket) return false;
  if (pack->op_name() == "bucket_pack") {
    if (pack->attr("group_size").as_int() != 1) return false;
    for (const Value* x : pack->operands()) c.members.push_back(x);
  } else if (pack->op_name() == "cat" && pack->attr("dim").as_int() == 0) {
    for (const Value* x : pack->operands()) {
      const Node* flat = x->node();
      if (flat != nullptr && flat->op_name() == "flatten" && sole_user(x, "cat") == pack) {
        c.members.push_back(flat->operand(0));
        c.skip.push_back(flat);
      } else if (x->shape().size() == 1) {
        c.members.push_back(x);
      } else {
        return false;
      }
    }
  } else {
    return false;
  }
  c.skip.push_back(pack);
  return match_split_tail(bucket, 1, c);
}

// Whether `group` runs the chain's members as a coalesced list for less than the chain costs:
// always where coalesced lists fuse; where the backend loops over the list (one collective per
// member), only all_gather buckets of members large enough that a collective costs less than
// the chain's pack and unpack copies (ProcessGroup::all_gather_coalesced_min_bytes).
bool worth_lowering(const ProcessGroup& group, CollectiveKind kind, const Chain& c) {
  if (group.fuses_coalesced()) return true;
  if (kind != CollectiveKind::AllGather || c.members.empty()) return false;
  int64_t bytes = 0;
  for (const Value* m : c.members) {
    bytes += m->type().numel() * static_cast<int64_t>(itemsize(m->dtype()));
  }
  return bytes / static_cast<int64_t>(c.members.size()) >= group.all_gather_coalesced_min_bytes();
}

}  // namespace

// Rewrites the steps of every bucket chain that matches (see ExecutorOptions::lower_buckets):
// the collective's operands become the members, the packing and unpacking nodes Skip steps, the
// nodes that produce the members' results Take steps. Runs before last uses are computed, so
// members live until the collective and the skipped values are never materialised.
void Executor::Impl::lower_buckets(const std::unordered_map<const Value*, uint32_t>& slot_of,
                                   const std::unordered_map<const Node*, uint32_t>& step_of) {
  // marked[slot] == s + 1: the slot is already a member of step s (a member listed twice).
  std::vector<uint32_t> marked(num_slots, 0);
  for (uint32_t s = 0; s < steps.size(); ++s) {
    Step& st = steps[s];
    if (st.kind != StepKind::Collective || st.op->variadic != (st.op->pack != nullptr)) continue;
    const int64_t g = st.group->size();
    Chain c;
    bool matched = false;
    switch (st.op->collective) {
      case CollectiveKind::AllGather: matched = match_gather_chain(*st.node, g, c); break;
      case CollectiveKind::ReduceScatter: matched = match_scatter_chain(*st.node, g, c); break;
      case CollectiveKind::AllReduce: matched = match_reduce_chain(*st.node, c); break;
      default: break;
    }
    if (!matched || !worth_lowering(*st.group, st.op->collective, c)) continue;
    // A chain that overlaps an earlier lowered one runs node by node: its skipped or taken
    // nodes already belong to that chain (a reduce_scatter chain packing an all_gather chain's
    // result reshapes), or its members are values that chain never materialises (the pieces of
    // its skipped split).
    auto claimed = [&](const Node* n) {
      const StepKind kind = steps[step_of.at(n)].kind;
      return kind == StepKind::Skip || kind == StepKind::Take;
    };
    if (std::any_of(c.skip.begin(), c.skip.end(), claimed) ||
        std::any_of(c.take.begin(), c.take.end(), claimed) ||
        std::any_of(c.members.begin(), c.members.end(), [&](const Value* m) {
          return m->node() != nullptr && steps[step_of.at(m->node())].kind == StepKind::Skip;
        })) {
      continue;
    }
    // Every chain form keeps one dtype (casts are not lowered).
    if (std::any_of(c.out_types.begin(), c.out_types.end(),
                    [&](const Type* t) { return t->dtype != c.out_types.front()->dtype; })) {
      continue;
    }
    const auto index = static_cast<uint32_t>(buckets.size());
    LoweredBucket lb;
    FUNCOL_CHECK(!c.out_types.empty() && c.results.size() == c.out_types.size(),
                 "a lowered bucket's results and types");
    for (size_t i = 0; i < c.out_types.size(); ++i) {
      const Type& t = *c.out_types[i];
      const auto& [n, r] = c.results[i];
      const uint32_t slot = steps[step_of.at(n)].results_begin + static_cast<uint32_t>(r);
      lb.numel += t.numel();
      if (!lb.runs.empty()) {
        LoweredBucket::Run& last = lb.runs.back();
        if (last.first_slot + last.count == slot && last.type.sizes() == t.shape) {
          ++last.count;
          continue;
        }
      }
      lb.runs.push_back({Tensor::meta(t.shape, t.dtype), slot, 1});
    }
    buckets.push_back(std::move(lb));
    st.bucket = index;
    st.operands_begin = static_cast<uint32_t>(operand_slots.size());
    st.num_operands = static_cast<uint32_t>(c.members.size());
    st.copy_operands = false;
    for (const Value* m : c.members) {
      const uint32_t slot = slot_of.at(m);
      if (marked[slot] == s + 1) st.copy_operands = true;
      marked[slot] = s + 1;
      operand_slots.push_back(slot);
    }
    for (const Node* n : c.skip) {
      Step& skipped = steps[step_of.at(n)];
      skipped.kind = StepKind::Skip;
      skipped.num_operands = 0;
    }
    for (const Node* n : c.take) {
      Step& take = steps[step_of.at(n)];
      take.kind = StepKind::Take;
      take.num_operands = 0;
    }
  }
}

// The casts (convert_element_type) that directly precede a cat and are used by nothing else,
// in the cat's dim and rank, are folded into it: the cat reads their operands and converts
// them as it writes its result, one copy per operand instead of two. The bucketing passes'
// default mode packs cast members so (DESIGN 6, step 4: the cast is folded into the packing
// copy; Inductor fuses PyTorch's traced cat of casts likewise), where the chain is not
// lowered. The value is the same: both convert with the same routine. Only the run of such
// casts right before the cat is folded, so no operand outlives its last use past other steps,
// and not a cast of a collective's result, whose failure is reported at the cast.
void Executor::Impl::fold_casts(const std::unordered_map<const Node*, uint32_t>& step_of,
                                const ViewBases& view_base) {
  std::vector<uint32_t> seen(num_slots, 0);
  for (uint32_t s = 0; s < steps.size(); ++s) {
    Step& st = steps[s];
    if (st.kind != StepKind::Kernel || st.op->name != "cat") continue;
    const int64_t rank = st.node->result(0)->type().rank();
    // The steps from `first` to s - 1 are casts that only this cat uses.
    uint32_t first = s;
    auto foldable = [&](const Step& cs) {
      if (cs.kind != StepKind::Kernel || cs.node->op_name() != "convert_element_type") {
        return false;
      }
      const Value* v = cs.node->result(0);
      const Value* from = view_base_of(view_base, cs.node->operand(0));
      return sole_user(v, "cat") == st.node && v->type().rank() == rank &&
             (from->node() == nullptr || !from->node()->op().is_collective());
    };
    while (first > 0 && foldable(steps[first - 1])) --first;
    if (first == s) continue;
    for (uint32_t i = 0; i < st.num_operands; ++i) {
      const Node* cast = st.node->operand(i)->node();
      if (cast == nullptr) continue;
      const uint32_t c = step_of.at(cast);
      if (c < first || c >= s) continue;
      Step& cs = steps[c];
      operand_slots[st.operands_begin + i] = operand_slots[cs.operands_begin];
      cs.kind = StepKind::Skip;
      cs.num_operands = 0;
      ++folded_casts;
    }
    st.kind = StepKind::CatCasts;
    // A cast's operand may now be listed twice (cat(convert(x), x)).
    for (uint32_t i = 0; i < st.num_operands; ++i) {
      const uint32_t slot = operand_slots[st.operands_begin + i];
      if (seen[slot] == s + 1) st.copy_operands = true;
      seen[slot] = s + 1;
    }
  }
}

std::vector<Tensor> Executor::Impl::run(std::vector<Tensor> inputs) {
  if (inputs.size() != graph.num_inputs()) {
    throw InvalidArgument(fmt::format("graph @{} takes {} inputs, got {}", graph.name(),
                                      graph.num_inputs(), inputs.size()));
  }
  checked_layouts.resize(inputs.size());
  // Each input is checked and moved into its slot in one pass over the list; a bad one
  // leaves none of those before it in their slots.
  size_t taken = 0;
  try {
    for (; taken < inputs.size(); ++taken) {
      const size_t i = taken;
      Tensor& t = inputs[i];
      if (!t.defined() || t.is_meta()) {
        throw InvalidArgument(fmt::format(
            "graph @{}: input {} must be a tensor with data, got {}", graph.name(),
            graph.input(i)->ref(), t.defined() ? "a meta tensor" : "an undefined tensor"));
      }
      if (t.dtype() != input_dtypes[i] || t.layout() != checked_layouts[i]) {
        const Value* v = graph.input(i);
        if (t.dtype() != v->dtype() || t.sizes() != v->shape()) {
          throw InvalidArgument(fmt::format("graph @{}: input {} expects {}, got {}",
                                            graph.name(), v->ref(), v->type().str(),
                                            type_str(t.dtype(), t.sizes())));
        }
        checked_layouts[i] = t.layout();
      }
      slots[i] = std::move(t);
    }
  } catch (...) {
    for (size_t k = 0; k < taken; ++k) slots[k] = Tensor();
    throw;
  }
  inputs.clear();
  for (uint32_t slot : initial_release) slots[slot] = Tensor();

  size_t cur = 0;
  try {
    if (observe) {
      run_steps<true>(cur);
    } else {
      run_steps<false>(cur);
    }
    finish(cur);
  } catch (...) {
    // A wait fails for its collective (a peer's mismatch, death or timeout): point at that.
    const Step& failed = steps[cur];
    const bool waited = failed.kind == StepKind::Wait && failed.inflight != kNone;
    const Node& at = waited ? *steps[inflight[failed.inflight].step].node : *failed.node;
    give_up(at);
    abort();
    ++runs;
    rethrow_at(graph, at);
  }
  std::vector<Tensor> outputs;
  outputs.reserve(output_slots.size());
  for (size_t i = 0; i < output_slots.size(); ++i) {
    Tensor& t = slots[output_slots[i]];
    outputs.push_back(output_moves[i] ? std::move(t) : t);
  }
  for (const uint32_t slot : end_clear) slots[slot] = Tensor();
#ifndef NDEBUG
  // Debug builds (the sanitizer runs of every test) check end_clear missed nothing.
  for (size_t slot = 0; slot < slots.size(); ++slot) {
    if (slots[slot].defined()) {
      this->abort();  // Impl::abort: the run's state cleared, as a failed run's
      ++runs;
      throw InternalError(fmt::format("graph @{}: slot {} still holds a value after the run",
                                      graph.name(), slot));
    }
  }
#endif
  ++runs;
  return outputs;
}

// ---- Executor ---------------------------------------------------------------------------------

Executor::Executor(const Graph& graph, ProcessGroup& world, ExecutorOptions options)
    : impl_(std::make_unique<Impl>(graph, world, std::move(options))) {
  if (impl_->options.check_same_graph) check_same_graph(graph, world);
  impl_->plan();
}

Executor::~Executor() = default;

std::vector<Tensor> Executor::run(std::vector<Tensor> inputs) {
  // Its slots and plan are one run's: a second thread in run() corrupted them (a double free).
  if (impl_->running.exchange(true, std::memory_order_acquire)) {
    throw InvalidArgument(
        "Executor::run: this Executor is running already (on another thread, or run() was "
        "called from inside a run); one Executor belongs to one rank's thread (make one per "
        "thread)");
  }
  struct Done {
    std::atomic<bool>& running;
    ~Done() { running.store(false, std::memory_order_release); }
  } done{impl_->running};
  return impl_->run(std::move(inputs));
}

const Graph& Executor::graph() const { return impl_->graph; }
int Executor::rank() const { return impl_->world.rank(); }
int Executor::runs() const { return impl_->runs; }

size_t Executor::pending_collectives() const {
  size_t n = 0;
  for (uint32_t index : impl_->open) {
    const Inflight& f = impl_->inflight[index];
    if (f.open && !f.work->is_completed()) ++n;
  }
  return n;
}

size_t Executor::lowered_buckets() const { return impl_->buckets.size(); }

size_t Executor::folded_casts() const { return impl_->folded_casts; }

int64_t Executor::live_bytes() const {
  std::unordered_set<const Storage*> seen;
  int64_t bytes = 0;
  auto count = [&](const Tensor& t) {
    if (t.storage() && seen.insert(t.storage().get()).second) {
      bytes += static_cast<int64_t>(t.storage()->nbytes());
    }
  };
  for (const Tensor& t : impl_->slots) count(t);
  for (const Tensor& t : impl_->scratch) count(t);
  return bytes;
}

}  // namespace funcol
