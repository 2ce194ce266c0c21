// The eager autograd tape and the `*_autograd` collectives: eager ops recorded as graph nodes,
// differentiated by append_backward (the op table's rules) and the backward run eagerly.
#include "funcol/api/autograd.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>

#include "arg_checks.h"
#include "dist/checks.h"
#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/dist/work.h"
#include "funcol/graph/backward.h"
#include "funcol/graph/tracer.h"
#include "graph/tape_hook.h"
#include "tape_hooks.h"

namespace funcol {

// What a tape owns: the recorded graph, the eager tensor of every recorded value, the leaves
// and their accumulated gradients.
struct GradTape::State {
  std::unique_ptr<Graph> graph = std::make_unique<Graph>("tape");
  // Looked up by value, never iterated (so pointer keys do not make anything nondeterministic).
  std::unordered_map<const Value*, Tensor> values;
  // The storage version (Storage::version) of each value's tensor when a recorded op last used
  // or produced it; backward refuses values written since, and so does a recorded use of an
  // op's result (a leaf's or constant's may move on). Looked up only.
  std::unordered_map<const Value*, uint64_t> versions;
  // The versions of each recorded node's operands when it was recorded: what its gradient rule
  // reads of them must still hold that (a value written in place and used again since has a
  // newer entry in `versions`). Looked up only.
  std::unordered_map<const Node*, std::vector<uint64_t>> operand_versions;
  std::vector<Value*> leaves;
  std::vector<Tensor> grads;  // per leaf; undefined until a backward reaches it
  // The groups the recorded collectives ran on, by name (looked up only): backward runs on
  // them, not on what the name resolves to on the calling thread, which needs a current rank
  // (a thread a rank started has none: it passes the ProcessGroup). Weak: the tape keeps no
  // group alive.
  std::map<std::string, std::weak_ptr<ProcessGroup>, std::less<>> groups;
  // Every tracked tensor by the storage it views (looked up only), so that a view of one made
  // by a Tensor method, which the tape does not record, is refused where it would silently enter
  // as a constant and lose its gradient. Guarded: a thread other than the recording one may look.
  struct View {
    Tensor tensor;
    const Value* value;
  };
  std::mutex views_mutex;
  std::unordered_map<const Storage*, std::vector<View>> views;
};

namespace {

using api_detail::normalize_dim;
using State = GradTape::State;

// What a tracked tensor's annotation holds. The tape is referenced weakly: the tape's tensors
// carry annotations too, so a strong reference would keep the tape alive forever.
struct TapeRef {
  std::weak_ptr<State> state;
  Value* value = nullptr;
};

// The deleter type marks the annotation as a tape's (std::get_deleter checks it), so tracer
// references and foreign annotations are never taken for one.
struct TapeRefDeleter {
  void operator()(TapeRef* ref) const { delete ref; }
};

struct Tracked {
  std::shared_ptr<State> state;
  Value* value = nullptr;
};

// The tape and value `t` stands for; empty when untracked (or its tape is gone).
Tracked tracked(const Tensor& t) {
  if (!t.defined() || !t.annotation() || !std::get_deleter<TapeRefDeleter>(t.annotation())) {
    return {};
  }
  const auto* ref = static_cast<const TapeRef*>(t.annotation().get());
  std::shared_ptr<State> state = ref->state.lock();
  if (!state) return {};
  if (t.dtype() != ref->value->dtype() || t.sizes() != ref->value->shape()) {
    throw InvalidArgument(fmt::format("autograd: tensor {} does not match its recorded value {} "
                                      "of type {}",
                                      type_str(t.dtype(), t.sizes()), ref->value->ref(),
                                      ref->value->type().str()));
  }
  return {std::move(state), ref->value};
}

// What the version checks' messages say counts as a write (Storage::version).
constexpr std::string_view kWritesNote =
    "copy_, fill_, an in-place collective, or data_ptr() or data<T>(), which count as writes "
    "even to read: read through const_data<T>() or to_vector";

// The live tapes made on this thread, oldest first (expired ones are dropped as tapes come):
// where a plain collective looks for the tensor its untracked input may be a view of.
thread_local std::vector<std::weak_ptr<State>> t_tapes;

// Whether `state` is a tape made on this thread.
bool made_here(const std::shared_ptr<State>& state) {
  return std::any_of(t_tapes.begin(), t_tapes.end(),
                     [&](const std::weak_ptr<State>& w) { return w.lock() == state; });
}

// Every live tape of the process (expired ones are dropped as tapes come), for the views of
// its values that another thread may use (refuse_untracked_view); g_tape_count counts them.
std::mutex g_tapes_mu;
std::vector<std::weak_ptr<State>> g_tapes;  // guarded by g_tapes_mu
std::atomic<int> g_tape_count{0};

// What a thread other than the tape's is told (a tape has no lock: recording from two threads
// corrupted it, and a tracked value taken as a constant there would lose its gradient).
constexpr std::string_view kOwnThreadRule =
    "a tape records only on the thread that made it: use it there (make the GradTape on the "
    "thread that records, such as inside the rank's function)";

// InvalidArgument for `what` (an operand of `op`), tracked by `state`, unless this thread made
// `state`.
void check_made_here(const std::shared_ptr<State>& state, std::string_view op,
                     std::string_view what) {
  if (made_here(state)) return;
  throw InvalidArgument(fmt::format(
      "{}: {} is tracked by a tape made on another thread, and {}, or pass a copy (t.clone()) "
      "to use the value as a constant",
      op, what, kOwnThreadRule));
}

// InvalidArgument for tape.`call`() on a thread other than the tape's.
void check_tape_thread(const std::shared_ptr<State>& state, std::string_view call) {
  if (made_here(state)) return;
  throw InvalidArgument(
      fmt::format("{}: the tape was made on another thread, and {}", call, kOwnThreadRule));
}

// The one tape the tracked tensors among `ts` belong to (null when none is tracked); it must
// have been made on this thread (check_made_here).
std::shared_ptr<State> tape_of(std::span<const Tensor> ts, std::string_view op) {
  std::shared_ptr<State> state;
  for (size_t i = 0; i < ts.size(); ++i) {
    Tracked tr = tracked(ts[i]);
    if (!tr.state) continue;
    if (state && state != tr.state) {
      throw InvalidArgument(fmt::format("{}: operands are tracked by different tapes", op));
    }
    if (!state) check_made_here(tr.state, op, fmt::format("operand {}", i));
    state = std::move(tr.state);
  }
  return state;
}

// A tensor sharing t's data that no tape tracks: what the tape stores as a value's eager tensor,
// and what the recording collectives run the plain ones on (which record a tracked input).
// A tracer's annotation stays: a tape op under a TraceScope is recorded in the trace too.
Tensor untracked(const Tensor& t) {
  Tensor u = t;
  if (t.annotation() && std::get_deleter<TapeRefDeleter>(t.annotation())) {
    u.set_annotation(nullptr);
  }
  return u;
}

uint64_t version_of(const Tensor& t) { return t.storage() ? t.storage()->version() : 0; }

// Stores `t` as the eager tensor of `value` and returns it annotated as tracked.
Tensor track(const std::shared_ptr<State>& state, Value* value, const Tensor& t) {
  const Tensor plain = untracked(t);
  state->values.insert_or_assign(value, plain);
  state->versions.insert_or_assign(value, version_of(plain));
  if (plain.storage() && plain.numel() > 0) {
    const std::lock_guard<std::mutex> lock(state->views_mutex);
    state->views[plain.storage().get()].push_back({plain, value});
  }
  Tensor out = plain;
  out.set_annotation(std::shared_ptr<TapeRef>(new TapeRef{state, value}, TapeRefDeleter{}));
  return out;
}

// Above zero while the tape itself runs collectives on untracked tensors (backward) or an
// in-place collective writes into a view (api_detail::UntrackedViewsAllowed).
thread_local int t_views_allowed = 0;

// The element byte range [begin, end) of `t` within its storage.
std::pair<int64_t, int64_t> byte_extent(const Tensor& t) {
  int64_t lo = t.storage_offset();
  int64_t hi = lo;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t step = (t.size(d) - 1) * t.strides()[static_cast<size_t>(d)];
    (step < 0 ? lo : hi) += step;
  }
  const auto isz = static_cast<int64_t>(t.itemsize());
  return {lo * isz, (hi + 1) * isz};
}

bool same_view(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.storage_offset() == b.storage_offset() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

// The tracked value `t` (untracked, with elements) is a view of, made outside the tape: one of
// `state`'s tracked tensors holds all of t's bytes and none is t itself. Null otherwise. (A
// tensor with exactly a tracked tensor's view, such as the one requires_grad() was given, is
// that value's alias: it enters as a constant, as documented.)
const Value* viewed_value(State& state, const Tensor& t) {
  const std::lock_guard<std::mutex> lock(state.views_mutex);
  const auto it = state.views.find(t.storage().get());
  if (it == state.views.end()) return nullptr;
  const auto [begin, end] = byte_extent(t);
  const Value* holder = nullptr;
  for (const State::View& v : it->second) {
    if (same_view(v.tensor, t)) return nullptr;
    const auto [vb, ve] = byte_extent(v.tensor);
    if (!holder && vb <= begin && end <= ve) holder = v.value;
  }
  return holder;
}

// Refuses `t` (operand `what` of `op`) when it is an untracked view of a value that `also` or
// a live tape of this thread tracks: the tape would take it for a constant and drop the
// gradient through it without a word (PyTorch's views are differentiable).
void refuse_untracked_view(const Tensor& t, std::string_view op, std::string_view what,
                           State* also) {
  if (t_views_allowed > 0 || !t.defined() || !t.storage() || t.numel() == 0) return;
  if (t.annotation() && tracked(t).state) return;
  auto check = [&](State& state) {
    const Value* v = viewed_value(state, t);
    if (!v) return;
    throw InvalidArgument(fmt::format(
        "{}: {} ({}) is a view of {} ({}), which a GradTape tracks, made by a Tensor method: the "
        "tape records only its own calls, so the gradient through it would be lost. Make the "
        "view with tape.call (view, reshape, narrow, transpose, permute, ...), or clone() it to "
        "use its values as a constant",
        op, what, type_str(t.dtype(), t.sizes()), v->ref(), v->type().str()));
  };
  if (also) check(*also);
  for (size_t i = 0; i < t_tapes.size();) {
    const std::shared_ptr<State> state = t_tapes[i].lock();
    if (!state) {
      t_tapes.erase(t_tapes.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    if (state.get() != also) check(*state);
    ++i;
  }
  // A view of another thread's tape's value, taken as a constant here, would lose its gradient
  // as well; that tape cannot record here.
  if (g_tape_count.load(std::memory_order_relaxed) <= static_cast<int>(t_tapes.size())) return;
  const std::lock_guard<std::mutex> lock(g_tapes_mu);
  for (const std::weak_ptr<State>& w : g_tapes) {
    const std::shared_ptr<State> state = w.lock();
    if (!state || state.get() == also || made_here(state)) continue;
    if (const Value* v = viewed_value(*state, t)) {
      throw InvalidArgument(fmt::format(
          "{}: {} ({}) is a view of {} ({}), which a GradTape made on another thread tracks, and "
          "{}, or clone() the view to use its values as a constant",
          op, what, type_str(t.dtype(), t.sizes()), v->ref(), v->type().str(), kOwnThreadRule));
    }
  }
}

// Node names as the tracer gives them (%ar, %ag, %w, %matmul, ...), so errors read alike.
std::string_view name_hint(const OpDef& op) {
  switch (op.collective) {
    case CollectiveKind::AllReduce: return "ar";
    case CollectiveKind::AllGather: return "ag";
    case CollectiveKind::ReduceScatter: return "rs";
    case CollectiveKind::AllToAll: return "a2a";
    case CollectiveKind::Broadcast: return "bc";
    case CollectiveKind::Wait: return "w";
    case CollectiveKind::None: break;
  }
  return op.name;
}

// Records node `op` over `operands` whose eager results are `results`; returns them tracked.
std::vector<Tensor> record(const std::shared_ptr<State>& state, std::string_view op,
                           std::span<const Tensor> operands, const NamedAttrs& attrs,
                           const std::vector<Tensor>& results) {
  Graph& g = *state->graph;
  std::vector<Value*> values;
  values.reserve(operands.size());
  for (size_t i = 0; i < operands.size(); ++i) {
    const Tensor& t = operands[i];
    Tracked tr = tracked(t);
    if (tr.state == state) {
      // A recorded op's result written in place since (the tape records no in-place writes)
      // no longer holds what the graph says it does: a use of it would send its gradient to
      // the op that made it (PyTorch records the write instead). Leaves and constants are the
      // graph's inputs: written between uses, they stand for what they hold.
      const uint64_t now = version_of(t);
      uint64_t& known = state->versions.at(tr.value);
      if (tr.value->node() != nullptr && now != known) {
        throw InvalidArgument(fmt::format(
            "{}: operand {} ({}, made by a recorded {}) was written in place after that op was "
            "recorded ({}), and the tape does not record in-place writes: use the functional "
            "form of the write (its result), or write to a copy",
            op, i, tr.value->ref(), tr.value->node()->op_name(), kWritesNote));
      }
      known = now;
      values.push_back(tr.value);
      continue;
    }
    // An untracked operand: a constant input of the recorded graph.
    Value* c = g.add_input(g.fresh_name("c"), Type(t.dtype(), t.sizes()));
    state->values.emplace(c, t);
    state->versions.emplace(c, version_of(t));
    values.push_back(c);
  }
  std::vector<uint64_t> used;
  used.reserve(operands.size());
  for (const Tensor& t : operands) used.push_back(version_of(t));
  Builder b(g);
  b.set_name_hint(name_hint(get_op(op)));
  Node* node = b.create(op, std::move(values), attrs);
  state->operand_versions.insert_or_assign(node, std::move(used));
  FUNCOL_CHECK(node->num_results() == results.size(),
               fmt::format("autograd: {} recorded with {} results for {}", op, results.size(),
                           node->num_results()));
  std::vector<Tensor> out;
  out.reserve(results.size());
  for (size_t r = 0; r < results.size(); ++r) {
    out.push_back(track(state, node->result(r), results[r]));
  }
  return out;
}

Tensor record_one(const std::shared_ptr<State>& state, std::string_view op,
                  std::span<const Tensor> operands, const NamedAttrs& attrs, const Tensor& result) {
  return record(state, op, operands, attrs, {result})[0];
}

// A collective on `group` (its name is the recorded "group" attribute, after `attrs`): its
// recorded result followed by its recorded wait_tensor (as the tracer does).
std::vector<Tensor> record_waited(const std::shared_ptr<State>& state, std::string_view op,
                                  std::span<const Tensor> operands, NamedAttrs attrs,
                                  ProcessGroup& group, const std::vector<Tensor>& results) {
  attrs.emplace_back("group", group.name());
  if (!state->groups.contains(group.name())) {
    std::shared_ptr<ProcessGroup> held = group.registry().find(group.name());
    if (held.get() != &group) held = nullptr;  // not the registry's: resolve by name later
    state->groups.emplace(group.name(), held);
  }
  std::vector<Tensor> rec = record(state, op, operands, attrs, results);
  std::vector<Tensor> out;
  out.reserve(rec.size());
  for (const Tensor& t : rec) {
    const Tensor in[] = {t};
    out.push_back(record_one(state, "wait_tensor", in, {}, t));
  }
  return out;
}

// Runs compute op `op` eagerly and records it on `state` (when non-null).
std::vector<Tensor> call_on(const std::shared_ptr<State>& state, std::string_view op,
                            std::span<const Tensor> operands, const NamedAttrs& attrs) {
  const OpDef& def = get_op(op);
  if (def.collective != CollectiveKind::None) {
    throw InvalidArgument(fmt::format("autograd: {} is a collective or wait; use the functional "
                                      "*_autograd collectives",
                                      op));
  }
  // Untracked, so that ops::call runs the kernel instead of recording here again (its tape
  // hook), which need not look at them either: they are the tape's own.
  std::vector<Tensor> plain;
  plain.reserve(operands.size());
  for (const Tensor& t : operands) plain.push_back(untracked(t));
  std::vector<Tensor> results;
  {
    const api_detail::UntrackedViewsAllowed own;
    results = ops::call(op, plain, attrs);
  }
  if (!state) return results;
  return record(state, op, operands, attrs, results);
}

// Refuses operands of `op` that are untracked views of values `tracking` (or a live tape of
// this thread) tracks.
void refuse_untracked_views(std::span<const Tensor> operands, std::string_view op,
                            State* tracking) {
  for (size_t i = 0; i < operands.size(); ++i) {
    refuse_untracked_view(operands[i], op, fmt::format("operand {}", i), tracking);
  }
}

// Refuses untracked views (refuse_untracked_views) and, beside a tracked operand, meta ones;
// then runs `op` and records it on `state` (null: runs it only).
std::vector<Tensor> checked_call(const std::shared_ptr<State>& state, State* tracking,
                                 std::string_view op, std::span<const Tensor> operands,
                                 const NamedAttrs& attrs) {
  refuse_untracked_views(operands, op, tracking);
  for (size_t i = 0; i < operands.size(); ++i) {
    if (state && operands[i].is_meta()) {
      throw InvalidArgument(fmt::format("{}: operand {} is a meta tensor (no data; a traced "
                                        "value?) beside a tracked one: the tape runs eagerly",
                                        op, i));
    }
  }
  return call_on(state, op, operands, attrs);
}

// funcol::ops::call once a tape exists (ops_detail::TapeHook): an op of a tracked
// operand is recorded on its tape, as tape.call would record it, as PyTorch records every op on
// a tensor that requires grad; an untracked view of a tracked value is refused, as tape.call
// refuses it (taken as a constant, it would lose its gradient without a word). A tape records
// only on the thread that made it (it has no lock): elsewhere a tracked operand, or an
// untracked view of a tracked value, is refused (tape_of, refuse_untracked_view). Collectives
// and waits go their own way (ops::call refuses the first, and returns a wait's operand
// itself).
std::optional<std::vector<Tensor>> record_ops_call(std::string_view op,
                                                   std::span<const Tensor> operands,
                                                   const NamedAttrs& attrs) {
  if (get_op(op).collective != CollectiveKind::None) return std::nullopt;
  std::shared_ptr<State> state = tape_of(operands, op);
  if (!state && g_tape_count.load(std::memory_order_relaxed) == 0) return std::nullopt;
  if (!state) {
    refuse_untracked_views(operands, op, nullptr);
    return std::nullopt;
  }
  return checked_call(state, state.get(), op, operands, attrs);
}

Tensor call_one_on(const std::shared_ptr<State>& state, std::string_view op,
                   std::span<const Tensor> operands, const NamedAttrs& attrs) {
  std::vector<Tensor> r = call_on(state, op, operands, attrs);
  if (r.size() != 1) {
    throw InvalidArgument(fmt::format("{} has {} results, expected 1", op, r.size()));
  }
  return r[0];
}

// Runs one backward node eagerly: collectives through the functional API (inputs made
// contiguous, as PyTorch's backward rules do) on the groups the forward used, everything else
// through its CPU kernel.
std::vector<Tensor> run_node(const State& s, const Node& n, const std::vector<Tensor>& in) {
  const OpDef& op = n.op();
  if (op.collective == CollectiveKind::None) return run_kernel(op, in, n.attr_values());
  if (op.collective == CollectiveKind::Wait) return {wait_tensor(in[0])};
  std::vector<Tensor> c;
  c.reserve(in.size());
  for (const Tensor& t : in) c.push_back(t.contiguous());
  const std::string& name = n.attr("group").as_string();
  const auto known = s.groups.find(name);
  // Held for the call; a group gone since the forward resolves by name (and fails as that does).
  const std::shared_ptr<ProcessGroup> pg =
      known != s.groups.end() ? known->second.lock() : nullptr;
  const GroupSpec group = pg ? GroupSpec(*pg) : GroupSpec(name);
  switch (op.collective) {
    case CollectiveKind::AllReduce: {
      const std::string& rop = n.attr("reduce_op").as_string();
      if (op.variadic) return all_reduce_coalesced(c, rop, group);
      return {all_reduce(c[0], rop, group)};
    }
    case CollectiveKind::AllGather:
      if (op.variadic) return all_gather_into_tensor_coalesced(c, group);
      return {all_gather_tensor(c[0], 0, group)};
    case CollectiveKind::ReduceScatter: {
      const std::string& rop = n.attr("reduce_op").as_string();
      if (op.variadic) {
        return reduce_scatter_tensor_coalesced(c, rop, std::vector<int64_t>(c.size(), 0), group);
      }
      return {reduce_scatter_tensor(c[0], rop, 0, group)};
    }
    case CollectiveKind::AllToAll:
      return {all_to_all_single(c[0], n.attr("output_split_sizes").as_ints(),
                                n.attr("input_split_sizes").as_ints(), group)};
    case CollectiveKind::Broadcast:
      return {broadcast(c[0], static_cast<int>(n.attr("src").as_int()), group)};
    default:
      break;
  }
  throw InvalidArgument(
      fmt::format("autograd: cannot run {} eagerly (node %{})", op.name, n.name()));
}

}  // namespace

// ---- GradTape ---------------------------------------------------------------------------------

GradTape::GradTape() : state_(std::make_shared<State>()) {
  std::erase_if(t_tapes, [](const std::weak_ptr<State>& w) { return w.expired(); });
  t_tapes.push_back(state_);
  {
    const std::lock_guard<std::mutex> lock(g_tapes_mu);
    std::erase_if(g_tapes, [](const std::weak_ptr<State>& w) { return w.expired(); });
    g_tapes.push_back(state_);
  }
  g_tape_count.fetch_add(1, std::memory_order_relaxed);
  ops_detail::set_tape_hook(&record_ops_call);
}

GradTape::~GradTape() { g_tape_count.fetch_sub(1, std::memory_order_relaxed); }

Tensor GradTape::requires_grad(const Tensor& t) {
  if (!t.defined()) throw InvalidArgument("requires_grad: the tensor is undefined");
  check_tape_thread(state_, "requires_grad");
  if (!is_floating(t.dtype())) {
    throw InvalidArgument(fmt::format("requires_grad: only floating tensors have gradients, got {}",
                                      type_str(t.dtype(), t.sizes())));
  }
  if (t.is_meta()) {
    throw InvalidArgument(fmt::format("requires_grad: {} is a meta tensor (no data; a traced "
                                      "value?): the tape runs eagerly; differentiate a traced "
                                      "graph with the autodiff pass (build_joint_graph)",
                                      type_str(t.dtype(), t.sizes())));
  }
  if (tracked(t).state) throw InvalidArgument("requires_grad: the tensor is tracked already");
  Graph& g = *state_->graph;
  Value* v = g.add_input(g.fresh_name("x"), Type(t.dtype(), t.sizes()));
  state_->leaves.push_back(v);
  state_->grads.emplace_back();
  return track(state_, v, t);
}

std::vector<Tensor> GradTape::call(std::string_view op, std::span<const Tensor> operands,
                                   const NamedAttrs& attrs) {
  std::shared_ptr<State> state = tape_of(operands, op);
  if (state && state != state_) {
    throw InvalidArgument(fmt::format("{}: an operand is tracked by another tape", op));
  }
  return checked_call(state, state_.get(), op, operands, attrs);
}

Tensor GradTape::call_one(std::string_view op, std::span<const Tensor> operands,
                          const NamedAttrs& attrs) {
  std::vector<Tensor> r = call(op, operands, attrs);
  if (r.size() != 1) {
    throw InvalidArgument(fmt::format("{} has {} results, expected 1", op, r.size()));
  }
  return r[0];
}

namespace {

// A recorded value as a message names it: its tape name, its type and what it stands for (the
// tape names values itself, so the name alone does not tell the user which tensor it is).
std::string describe(const State& s, const Value* v) {
  std::string what;
  if (!v->is_input()) {
    // A collective's result is its wait's, which the user never wrote.
    const Node* n = v->node();
    if (n->op_name() == "wait_tensor" && !n->operand(0)->is_input()) n = n->operand(0)->node();
    what = fmt::format("the result of {}", n->op_name());
  } else if (auto it = std::find(s.leaves.begin(), s.leaves.end(), v); it != s.leaves.end()) {
    what = fmt::format("leaf {}, counting the tape's requires_grad calls from 0",
                       it - s.leaves.begin());
  } else if (v->has_uses() && v->uses()[0].user != nullptr) {
    what = fmt::format("an untracked tensor that {} took as a constant",
                       v->uses()[0].user->op_name());
  } else {
    what = "an untracked tensor taken as a constant";
  }
  return fmt::format("{} ({}, {})", v->ref(), v->type().str(), what);
}

// As Executor::run (docs/runtime.md): a backward that fails part-way on one rank (a rank-local
// error: a value written in place, a kernel's error) issues the collectives it had not issued
// yet, from the one after `done` on, with inputs that hold an AbandonedError saying why, so
// that every rank issues each of the backward's collectives once: the peers' backward fails
// naming this rank, instead of their collectives pairing with this rank's next ones. Called
// while the backward's exception is in flight.
void give_up_backward(const State& s, const Graph& g, const Node* done) noexcept {
  try {
    const std::exception_ptr why = abandoned_error("backward");
    for (const Node* n = done ? done->next() : g.first_node(); n; n = n->next()) {
      const CollectiveKind kind = n->op().collective;
      if (kind == CollectiveKind::None || kind == CollectiveKind::Wait) continue;
      std::vector<Tensor> in;
      for (const Value* v : n->operands()) in.push_back(failed_tensor(v->shape(), v->dtype(), why));
      try {
        // Its failure (at once: its inputs hold one) is the backward's error, rethrown: seen,
        // so the end of the rank does not warn of it (UnwaitedFailures).
        for (const Tensor& t : run_node(s, *n, in)) {
          try {
            if (t.is_ready()) t.wait();
          } catch (...) {
          }
        }
      } catch (...) {
        // Its group is unusable already: nothing more to keep in step there.
      }
    }
  } catch (...) {
    // Out of memory: the peers find this rank missing at their timeout.
  }
}

}  // namespace

void GradTape::backward(const Tensor& loss) {
  check_tape_thread(state_, "backward");  // it adds nodes to the graph and erases them
  State& s = *state_;
  Tracked tr = tracked(loss);
  // Its collectives pair only with the peers' backward collectives (dist_detail::InternalStep).
  const dist_detail::InternalStep step(dist_detail::kBackwardStep);
  if (tr.state != state_) throw InvalidArgument("backward: the loss is not tracked by this tape");
  Graph& g = *s.graph;
  Node* mark = g.last_node();
  const Node* done = mark;  // the last node of the graph that ran
  try {
    if (!is_loss_type(tr.value->type())) {
      // A rank-local error, as the ones below: the collectives this loss reaches (those of its
      // sum's backward) are issued failed by the handler, so that peers whose loss is a scalar
      // fail naming this rank instead of pairing with its next collectives. When no backward
      // can be built (a rule refuses), nothing is issued, as on the peers.
      const std::string message = fmt::format(
          "backward: the loss {} must be a scalar (one element) of a floating dtype",
          describe(s, tr.value));
      if (is_floating(tr.value->dtype())) {
        try {
          append_backward(g, Builder(g).value("sum", {tr.value}), s.leaves);
        } catch (...) {
        }
      }
      throw InvalidArgument(message);
    }
    // The recorded values the gradient rules read must hold what they held when recorded
    // (PyTorch: "one of the variables needed for gradient computation has been modified by an
    // inplace operation"): an operand of the node whose rule reads it, what it held when that
    // node was recorded; any other value, when a recorded op last used or produced it.
    std::vector<std::pair<const Node*, const Node*>> reads;  // (forward node, rule's node)
    const std::vector<Value*> grads =
        append_backward(g, tr.value, s.leaves,
                        [&](const Node& forward, const Node& made) {
                          reads.emplace_back(&forward, &made);
                        });
    for (const auto& [forward, made] : reads) {
      const auto used = s.operand_versions.find(forward);
      for (const Value* v : made->operands()) {
        auto it = s.values.find(v);
        if (it == s.values.end()) continue;
        const uint64_t now = version_of(it->second);
        uint64_t then = s.versions.at(v);
        for (size_t i = 0; used != s.operand_versions.end() && i < forward->num_operands(); ++i) {
          if (forward->operand(i) == v) then = used->second[i];
        }
        if (now != then) {
          throw InvalidArgument(fmt::format(
              "backward: {}, a value the gradient needs, was written in place after it was "
              "recorded (version {}, recorded at {}; {}): record the computation again, or "
              "write to a copy",
              describe(s, v), now, then, kWritesNote));
        }
      }
    }
    // The backward's own tensors may view recorded ones (a rule reading a forward value).
    const api_detail::UntrackedViewsAllowed own_tensors;
    std::unordered_map<const Value*, Tensor> env;  // backward values; looked up only
    auto get = [&](const Value* v) -> const Tensor& {
      auto it = env.find(v);
      return it != env.end() ? it->second : s.values.at(v);
    };
    for (Node* n = mark ? mark->next() : g.first_node(); n; n = n->next()) {
      std::vector<Tensor> in;
      in.reserve(n->num_operands());
      for (const Value* v : n->operands()) in.push_back(get(v));
      std::vector<Tensor> out = run_node(s, *n, in);
      FUNCOL_CHECK(out.size() == n->num_results(), "autograd: result count");
      for (size_t r = 0; r < out.size(); ++r) env.emplace(n->result(r), std::move(out[r]));
      done = n;
    }
    // Each leaf gets a tensor of its own, as in PyTorch: leaves may receive one backward value
    // (add(a, b) hands g to both) or views of one buffer, and an in-place change to grad(a)
    // must leave grad(b) alone.
    std::unordered_set<const Storage*> handed_out;  // looked up only
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i]) continue;
      Tensor gi = get(grads[i]).contiguous();
      if (!handed_out.insert(gi.storage().get()).second) gi = gi.clone();
      s.grads[i] = s.grads[i].defined() ? add(s.grads[i], gi) : gi;
    }
  } catch (...) {
    give_up_backward(s, g, done);
    erase_nodes_after(g, mark);
    throw;
  }
  erase_nodes_after(g, mark);
}

Tensor GradTape::grad(const Tensor& leaf) const {
  Tracked tr = tracked(leaf);
  const auto& leaves = state_->leaves;
  auto it = std::find(leaves.begin(), leaves.end(), tr.value);
  if (tr.state != state_ || it == leaves.end()) {
    throw InvalidArgument("grad: the tensor is not a leaf of this tape (use requires_grad)");
  }
  const Tensor& g = state_->grads[static_cast<size_t>(it - leaves.begin())];
  return g.defined() ? g : Tensor::zeros(tr.value->shape(), tr.value->dtype());
}

void GradTape::zero_grad() {
  check_tape_thread(state_, "zero_grad");
  for (Tensor& g : state_->grads) g = Tensor();
}

bool GradTape::tracks(const Tensor& t) const { return tracked(t).state == state_; }

const Graph& GradTape::graph() const { return *state_->graph; }

bool is_tracked(const Tensor& t) { return tracked(t).state != nullptr; }

// ---- the *_autograd collectives -------------------------------------------------------------

namespace {

std::vector<Tensor> untracked(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(untracked(t));
  return out;
}

// `t` with its scatter dim's group_size chunks moved to dim 0 (split + cat, recorded), as the
// seed's reduce_scatter_tensor does before its dim-0 collective.
Tensor scatter_dim_to_front(const std::shared_ptr<State>& state, const Tensor& t, int64_t dim,
                            int64_t group_size) {
  if (dim == 0) return t;
  const Tensor in[] = {t};
  std::vector<Tensor> chunks = call_on(
      state, "split_with_sizes", in,
      {{"split_sizes", std::vector<int64_t>(static_cast<size_t>(group_size),
                                            t.size(dim) / group_size)},
       {"dim", dim}});
  return call_one_on(state, "cat", chunks, {{"dim", 0}});
}

}  // namespace

Tensor all_reduce_autograd(const Tensor& t, const std::string& reduce_op, const GroupSpec& group) {
  const Tensor in[] = {t};
  std::shared_ptr<State> state = tape_of(in, "all_reduce");
  if (!state) return all_reduce(t, reduce_op, group);
  ProcessGroup& pg = group.resolve();
  const Tensor r = all_reduce(untracked(t), reduce_op, pg);
  return record_waited(state, "all_reduce", in, {{"reduce_op", reduce_op}}, pg, {r})[0];
}

Tensor all_gather_tensor_autograd(const Tensor& t, int64_t gather_dim, const GroupSpec& group) {
  const Tensor in[] = {t};
  std::shared_ptr<State> state = tape_of(in, "all_gather_tensor");
  if (!state) return all_gather_tensor(t, gather_dim, group);
  ProcessGroup& pg = group.resolve();
  const int64_t dim = normalize_dim(gather_dim, t.dim(), "all_gather_tensor", "gather_dim");
  const Tensor r = all_gather_tensor(untracked(t), 0, pg);
  const int64_t w = pg.size();
  Tensor out = record_waited(state, "all_gather_into_tensor", in, {{"group_size", w}}, pg, {r})[0];
  if (dim == 0) return out;
  // The rank-major blocks of dim 0 moved to gather_dim: split, then cat (recorded).
  const Tensor parts[] = {out};
  std::vector<Tensor> blocks = call_on(
      state, "split_with_sizes", parts,
      {{"split_sizes", std::vector<int64_t>(static_cast<size_t>(w), t.size(0))}, {"dim", 0}});
  return call_one_on(state, "cat", blocks, {{"dim", dim}});
}

Tensor reduce_scatter_tensor_autograd(const Tensor& t, const std::string& reduce_op,
                                      int64_t scatter_dim, const GroupSpec& group) {
  const Tensor in[] = {t};
  constexpr std::string_view kOp = "reduce_scatter_tensor";
  std::shared_ptr<State> state = tape_of(in, kOp);
  if (!state) return reduce_scatter_tensor(t, reduce_op, scatter_dim, group);
  ProcessGroup& pg = group.resolve();
  // The plain call first: it checks everything (so a failure records nothing) and its result is
  // the recorded graph's.
  const Tensor r = reduce_scatter_tensor(untracked(t), reduce_op, scatter_dim, pg);
  const int64_t w = pg.size();
  const Tensor f[] = {
      scatter_dim_to_front(state, t, normalize_dim(scatter_dim, t.dim(), kOp, "scatter_dim"), w)};
  return record_waited(state, kOp, f, {{"reduce_op", reduce_op}, {"group_size", w}}, pg, {r})[0];
}

Tensor all_to_all_single_autograd(const Tensor& t,
                                  std::optional<std::vector<int64_t>> output_split_sizes,
                                  std::optional<std::vector<int64_t>> input_split_sizes,
                                  const GroupSpec& group) {
  const Tensor in[] = {t};
  std::shared_ptr<State> state = tape_of(in, "all_to_all_single");
  if (!state) return all_to_all_single(t, output_split_sizes, input_split_sizes, group);
  ProcessGroup& pg = group.resolve();
  const Tensor r = all_to_all_single(untracked(t), output_split_sizes, input_split_sizes, pg);
  // Both or neither (the call above checked): neither means an even split of dim 0.
  const auto w = static_cast<size_t>(pg.size());
  std::vector<int64_t> outs = output_split_sizes.value_or(
      std::vector<int64_t>(w, t.size(0) / static_cast<int64_t>(w)));
  std::vector<int64_t> ins = input_split_sizes.value_or(outs);
  return record_waited(state, "all_to_all_single", in,
                       {{"output_split_sizes", outs}, {"input_split_sizes", ins}}, pg, {r})[0];
}

std::vector<Tensor> all_reduce_coalesced_autograd(const std::vector<Tensor>& inputs,
                                                  const std::string& reduce_op,
                                                  const GroupSpec& group) {
  std::shared_ptr<State> state = tape_of(inputs, "all_reduce_coalesced");
  if (!state || inputs.empty()) return all_reduce_coalesced(inputs, reduce_op, group);
  ProcessGroup& pg = group.resolve();
  const std::vector<Tensor> r = all_reduce_coalesced(untracked(inputs), reduce_op, pg);
  return record_waited(state, "all_reduce_coalesced", inputs, {{"reduce_op", reduce_op}}, pg, r);
}

std::vector<Tensor> all_gather_into_tensor_coalesced_autograd(const std::vector<Tensor>& inputs,
                                                              const GroupSpec& group) {
  std::shared_ptr<State> state = tape_of(inputs, "all_gather_into_tensor_coalesced");
  if (!state || inputs.empty()) return all_gather_into_tensor_coalesced(inputs, group);
  ProcessGroup& pg = group.resolve();
  const std::vector<Tensor> r = all_gather_into_tensor_coalesced(untracked(inputs), pg);
  return record_waited(state, "all_gather_into_tensor_coalesced", inputs,
                       {{"group_size", pg.size()}}, pg, r);
}

std::vector<Tensor> reduce_scatter_tensor_coalesced_autograd(const std::vector<Tensor>& inputs,
                                                             const std::string& reduce_op,
                                                             const GroupSpec& group) {
  return api_detail::tape_reduce_scatter_coalesced(inputs, reduce_op,
                                                   std::vector<int64_t>(inputs.size(), 0), group);
}

namespace api_detail {

bool tape_input(const Tensor& t, std::string_view op) {
  if (is_tracked(t)) return true;
  refuse_untracked_view(t, op, "the input", nullptr);
  return false;
}

bool tape_inputs(std::span<const Tensor> ts, std::string_view op) {
  if (std::any_of(ts.begin(), ts.end(), [](const Tensor& t) { return is_tracked(t); })) {
    return true;  // the recording path runs the plain form on them, untracked: checked there
  }
  for (size_t i = 0; i < ts.size(); ++i) {
    refuse_untracked_view(ts[i], op, fmt::format("input {}", i), nullptr);
  }
  return false;
}

UntrackedViewsAllowed::UntrackedViewsAllowed() { ++t_views_allowed; }
UntrackedViewsAllowed::~UntrackedViewsAllowed() { --t_views_allowed; }

Tensor tape_broadcast(const Tensor& t, int src, const GroupSpec& group) {
  const Tensor in[] = {t};
  std::shared_ptr<State> state = tape_of(in, "broadcast");
  ProcessGroup& pg = group.resolve();
  const Tensor r = broadcast(untracked(t), src, pg);
  if (!state) return r;
  return record_waited(state, "broadcast", in, {{"src", src}}, pg, {r})[0];
}

Tensor tape_permute(const Tensor& t, const std::vector<int64_t>& output_split_sizes,
                    const std::vector<int64_t>& input_split_sizes, const GroupSpec& group) {
  const Tensor in[] = {t};
  std::shared_ptr<State> state = tape_of(in, "permute_tensor");
  // Contiguous rows (permute_tensor), recorded: a 0-d tensor as [1]; one that is not contiguous
  // copied (a clone, as eager's contiguous(): a reshape may give a strided view, such as a
  // column's).
  Tensor x = t;
  if (t.dim() == 0) {
    x = call_one_on(state, "reshape", in, {{"shape", permute_rows(t)}});
  } else if (!t.is_contiguous()) {
    x = call_one_on(state, "clone", in, {});
  }
  const Tensor r[] = {all_to_all_single_autograd(x, output_split_sizes, input_split_sizes, group)};
  return t.dim() == 0 ? call_one_on(state, "reshape", r, {{"shape", t.sizes()}}) : r[0];
}

std::vector<Tensor> tape_reduce_scatter_coalesced(const std::vector<Tensor>& inputs,
                                                  const std::string& reduce_op,
                                                  const std::vector<int64_t>& scatter_dims,
                                                  const GroupSpec& group) {
  constexpr std::string_view kOp = "reduce_scatter_tensor_coalesced";
  std::shared_ptr<State> state = tape_of(inputs, kOp);
  if (!state || inputs.empty()) {
    return reduce_scatter_tensor_coalesced(inputs, reduce_op, scatter_dims, group);
  }
  ProcessGroup& pg = group.resolve();
  // The plain call first: it checks everything, so a failure records nothing.
  const std::vector<Tensor> r =
      reduce_scatter_tensor_coalesced(untracked(inputs), reduce_op, scatter_dims, pg);
  const int64_t w = pg.size();
  std::vector<Tensor> fronts;
  fronts.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t dim = normalize_dim(scatter_dims[i], inputs[i].dim(), kOp, "scatter_dim");
    fronts.push_back(scatter_dim_to_front(state, inputs[i], dim, w));
  }
  return record_waited(state, kOp, fronts, {{"reduce_op", reduce_op}, {"group_size", w}}, pg, r);
}

}  // namespace api_detail

}  // namespace funcol
