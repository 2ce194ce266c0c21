// The tracer: traced meta tensors carry a reference to their graph value; ops append nodes.
#include "funcol/graph/tracer.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <optional>

#include "funcol/core/error.h"
#include "funcol/graph/ops.h"
#include "funcol/graph/verifier.h"
#include "tape_hook.h"

namespace funcol {

namespace {

thread_local Tracer* t_current_tracer = nullptr;
std::atomic<uint64_t> g_next_tracer_id{1};
std::atomic<ops_detail::TapeHook> g_tape_hook{nullptr};

// A short node name for each kind of op, as people write them by hand.
std::string_view default_hint(const OpDef& op) {
  switch (op.collective) {
    case CollectiveKind::AllReduce:
      return "ar";
    case CollectiveKind::AllGather:
      return "ag";
    case CollectiveKind::ReduceScatter:
      return "rs";
    case CollectiveKind::AllToAll:
      return "a2a";
    case CollectiveKind::Broadcast:
      return "bc";
    case CollectiveKind::Wait:
      return "w";
    case CollectiveKind::None:
      break;
  }
  return op.name;
}

}  // namespace

namespace tracer_detail {

// What a traced tensor's annotation holds. A view (narrow, transpose, ...) also keeps the
// tensor it views and the node that made it, so that an in-place write into the view reaches
// that base, as it does eagerly.
struct Ref {
  uint64_t tracer_id = 0;
  Value* value = nullptr;
  // A view's base, the node that made it and which of its results it is (split_with_sizes).
  std::shared_ptr<Ref> base;
  const Node* view = nullptr;
  size_t result = 0;
  // Bumped whenever `value` is rebound (an in-place write into it, its view or its base), and
  // the base's generation `value` was derived from: a view whose base moved on since is derived
  // again from the base's value when next used, as the eager view sees the base's writes.
  uint64_t generation = 0;
  uint64_t base_generation = 0;
  // The tracer's write count when this chain was last found current (Tracer::refresh): no
  // write since means nothing to derive again.
  uint64_t checked = 0;
};

}  // namespace tracer_detail

namespace {

using tracer_detail::Ref;

// The deleter type identifies the tracer's annotations (std::get_deleter is type-checked), so a
// tensor annotated by anything else is never mistaken for a traced one.
struct RefDeleter {
  void operator()(Ref* ref) const { delete ref; }
};

// The tracer reference of `t`, or null when it has none.
Ref* ref_of(const Tensor& t) {
  if (!t.annotation() || !std::get_deleter<RefDeleter>(t.annotation())) return nullptr;
  return static_cast<Ref*>(t.annotation().get());
}

// The stretch of its base that result `result` of a narrow or split_with_sizes node covers
// (dim and start wrapped as the ops wrap them), or nullopt for other views.
struct Piece {
  int64_t dim, start, length;
};
std::optional<Piece> piece_of(const Node& view, size_t result) {
  const std::string_view op = view.op_name();
  if (op != "narrow" && op != "split_with_sizes") return std::nullopt;
  const Shape& base = view.operand(0)->shape();
  int64_t dim = view.attr("dim").as_int();
  if (dim < 0) dim += static_cast<int64_t>(base.size());
  int64_t start = 0;
  if (op == "narrow") {
    start = view.attr("start").as_int();
    if (start < 0) start += base[static_cast<size_t>(dim)];
  } else {
    const std::vector<int64_t>& sizes = view.attr("split_sizes").as_ints();
    for (size_t i = 0; i < result; ++i) start += sizes[i];
  }
  return Piece{dim, start, view.result(result)->shape()[static_cast<size_t>(dim)]};
}

}  // namespace

Tracer::Tracer(std::string graph_name)
    : id_(g_next_tracer_id.fetch_add(1, std::memory_order_relaxed)),
      graph_(std::make_unique<Graph>(std::move(graph_name))) {}

Tracer::~Tracer() = default;

Tensor Tracer::wrap(Value* value, Tensor layout) const {
  Tensor t = layout.defined() ? std::move(layout) : Tensor::meta(value->shape(), value->dtype());
  auto ref = std::shared_ptr<Ref>(new Ref, RefDeleter{});
  ref->tracer_id = id_;
  ref->value = value;
  t.set_annotation(std::move(ref));
  return t;
}

Tensor Tracer::input(const Type& type, std::string name) {
  if (!graph_) throw InvalidArgument("tracer: input() after finish()");
  check_type(type.dtype, type.shape, "traced input");
  if (name.empty()) name = graph_->fresh_name("x");
  inputs_.push_back(wrap(graph_->add_input(std::move(name), type)));
  return inputs_.back();
}

bool is_traced(const Tensor& t) { return ref_of(t) != nullptr; }

bool Tracer::owns(const Tensor& t) const {
  const Ref* ref = ref_of(t);
  return ref && ref->tracer_id == id_ && graph_;
}

Value* Tracer::value(const Tensor& t) const {
  if (!t.defined()) throw InvalidArgument("tracer: an undefined tensor is not a traced value");
  Ref* ref = ref_of(t);
  if (!ref) {
    throw InvalidArgument(fmt::format(
        "tracer: tensor {} is not a traced value (graphs take data only through their inputs; "
        "use funcol::ops and the functional collectives on traced tensors, not Tensor methods)",
        type_str(t.dtype(), t.sizes())));
  }
  if (ref->tracer_id != id_ || !graph_) {
    throw InvalidArgument(
        fmt::format("tracer: tensor {} belongs to another trace", type_str(t.dtype(), t.sizes())));
  }
  refresh(*ref);
  if (t.dtype() != ref->value->dtype() || t.sizes() != ref->value->shape()) {
    throw InvalidArgument(
        fmt::format("tracer: tensor {} does not match its traced value {} of "
                    "type {}",
                    type_str(t.dtype(), t.sizes()), ref->value->ref(), ref->value->type().str()));
  }
  return ref->value;
}

void Tracer::assign(const Tensor& t, const Tensor& value) {
  Value* target = this->value(t);  // brings t and its bases up to date
  Value* source = this->value(value);
  if (target->type() != source->type()) {
    throw InvalidArgument(fmt::format("tracer: cannot assign a value of type {} to {} of type {}",
                                      source->type().str(), target->ref(), target->type().str()));
  }
  // ref_of's Ref is shared by every copy of `t`: rebinding it rebinds them all. A chain that
  // cannot be written through is refused before anything changes.
  Ref* ref = static_cast<Ref*>(t.annotation().get());
  for (const Ref* r = ref; r->base; r = r->base.get()) {
    if (!writes_through(*r->view, r->result)) throw not_written_through(*r->view);
  }
  ref->value = source;
  ++ref->generation;
  // A view: its base takes the written elements too, and its base's base, and so on. The views
  // of the chain stay current; every other view of those bases is derived again when used.
  for (; ref->base; ref = ref->base.get()) {
    Ref& base = *ref->base;
    base.value = write_through(*ref->view, ref->result, base.value, ref->value);
    ++base.generation;
    ref->base_generation = base.generation;
  }
  ++writes_;  // every other view may be behind now
}

void Tracer::refresh(Ref& ref) const {
  // Only a write can put a view behind its base, so a chain found current since the last write
  // still is: the walk stops at the first such base, which keeps tracing linear in the number
  // of views however deep they nest (each view is derived again at most once per write). A
  // loop, not recursion: chains may be many thousands deep.
  std::vector<Ref*> chain;
  for (Ref* r = &ref; r->base && r->checked != writes_; r = r->base.get()) chain.push_back(r);
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    Ref& view = **it;
    const Ref& base = *view.base;
    if (view.base_generation != base.generation) {
      view.value = view_again(*view.view, view.result, base.value);
      view.base_generation = base.generation;
      ++view.generation;
    }
    view.checked = writes_;
  }
}

// The view `view` made (its result `result`), made again from its base's current value.
Value* Tracer::view_again(const Node& view, size_t result, Value* base) const {
  Builder b(*graph_);
  b.set_name_hint(view.result(result)->name());
  const std::string_view op = view.op_name();
  const Value& old = *view.result(result);
  if (const std::optional<Piece> p = piece_of(view, result)) {
    return b.value("narrow", {base}, {{"dim", p->dim}, {"start", p->start}, {"length", p->length}});
  }
  if (op == "transpose") {
    return b.value("transpose", {base},
                   {{"dim0", view.attr("dim0").as_int()}, {"dim1", view.attr("dim1").as_int()}});
  }
  if (op == "permute") return b.value("permute", {base}, {{"dims", view.attr("dims").as_ints()}});
  if (op == "view") return b.value("view", {base}, {{"shape", std::vector<int64_t>(old.shape())}});
  if (op == "view_dtype") return b.value("view_dtype", {base}, {{"dtype", old.dtype()}});
  if (op == "expand") {
    return b.value("expand", {base}, {{"shape", std::vector<int64_t>(old.shape())}});
  }
  throw InvalidArgument(fmt::format(
      "tracer: {} (a {} of {}) is used after an in-place write into {}: eagerly a {} may or may "
      "not share memory with its base, so it may or may not see the write; take it after the "
      "write, or clone it before",
      old.ref(), op, view.operand(0)->ref(), view.operand(0)->ref(), op));
}

bool Tracer::writes_through(const Node& view, size_t result) {
  const std::string_view op = view.op_name();
  return piece_of(view, result) || op == "transpose" || op == "permute" || op == "view" ||
         op == "view_dtype";
}

// The value of a view's base after `written` was written into the view that `view` made: the
// base rebuilt around it (narrow), or the written value viewed back (transpose, permute, view,
// view_dtype). Views that eagerly are sometimes copies (reshape, flatten) or that repeat
// elements (expand) cannot be written through: an error, rather than a graph that differs
// from eager execution.
Value* Tracer::write_through(const Node& view, size_t result, Value* base, Value* written) {
  Builder b(*graph_);
  b.set_name_hint("inplace");
  const std::string_view op = view.op_name();
  if (const std::optional<Piece> p = piece_of(view, result)) {
    // Plain names, not a structured binding: the lambda below captures dim, which clang before
    // 16 refuses for a binding (the libFuzzer build of test/fuzz uses clang 14).
    const int64_t dim = p->dim, start = p->start, length = p->length;
    const int64_t size = base->shape()[static_cast<size_t>(dim)];
    std::vector<Value*> parts;
    auto piece = [&](int64_t from, int64_t len) {
      if (len > 0) {
        parts.push_back(
            b.value("narrow", {base}, {{"dim", dim}, {"start", from}, {"length", len}}));
      }
    };
    piece(0, start);
    parts.push_back(written);
    piece(start + length, size - start - length);
    return parts.size() == 1 ? written : b.value("cat", parts, {{"dim", dim}});
  }
  if (op == "transpose") {
    return b.value("transpose", {written},
                   {{"dim0", view.attr("dim0").as_int()}, {"dim1", view.attr("dim1").as_int()}});
  }
  if (op == "permute") {
    const std::vector<int64_t>& dims = view.attr("dims").as_ints();
    std::vector<int64_t> inverse(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) {
      const int64_t d = dims[i] < 0 ? dims[i] + static_cast<int64_t>(dims.size()) : dims[i];
      inverse[static_cast<size_t>(d)] = static_cast<int64_t>(i);
    }
    return b.value("permute", {written}, {{"dims", inverse}});
  }
  if (op == "view") {
    return b.value("view", {written}, {{"shape", std::vector<int64_t>(base->shape())}});
  }
  if (op == "view_dtype") return b.value("view_dtype", {written}, {{"dtype", base->dtype()}});
  throw not_written_through(view);
}

InvalidArgument Tracer::not_written_through(const Node& view) {
  const std::string_view op = view.op_name();
  return InvalidArgument(fmt::format(
      "tracer: an in-place write into {} (a {} of {}) cannot be traced: eagerly it {} its base; "
      "write into the base, or use the functional form and its result",
      view.result(0)->ref(), op, view.operand(0)->ref(),
      op == "expand" ? "would repeat elements of" : "may or may not share memory with"));
}

std::vector<Tensor> Tracer::record(std::string_view op_name, std::span<const Tensor> operands,
                                   const NamedAttrs& attrs, std::string_view name_hint) {
  if (!graph_) throw InvalidArgument(fmt::format("tracer: {} recorded after finish()", op_name));
  const OpDef& op = get_op(op_name);
  std::vector<Value*> values;
  values.reserve(operands.size());
  for (size_t i = 0; i < operands.size(); ++i) {
    try {
      values.push_back(value(operands[i]));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("{}: operand {}: {}", op.name, i, e.what()));
    }
  }
  // A view gets the layout it has eagerly, from the view itself on its operand's layout; the
  // view's own errors ("cannot view ... without a copy") come from there, as eagerly. Shape
  // inference first: the kernel may assume what it accepts.
  std::vector<Tensor> layouts;
  if (op.is_view && operands.size() == 1) {
    const std::vector<Attr> attr_values = make_attrs(op, attrs);
    const Type in(operands[0].dtype(), operands[0].sizes());
    infer_types(op, std::span<const Type>(&in, 1), attr_values);
    layouts = run_kernel(op, operands, attr_values);
  }
  Builder b(*graph_);
  b.set_name_hint(name_hint.empty() ? default_hint(op) : name_hint);
  Node* node = b.create(op.name, std::move(values), attrs);
  std::vector<Tensor> results;
  results.reserve(node->num_results());
  for (size_t r = 0; r < node->num_results(); ++r) {
    results.push_back(wrap(node->result(r), r < layouts.size() ? layouts[r] : Tensor()));
  }
  if (op.is_view && operands.size() == 1) {
    // Each view remembers its base (see assign and refresh).
    auto base = std::static_pointer_cast<Ref>(operands[0].annotation());
    for (size_t r = 0; r < results.size(); ++r) {
      auto* ref = static_cast<Ref*>(results[r].annotation().get());
      ref->base = base;
      ref->view = node;
      ref->result = r;
      ref->base_generation = base->generation;
      ref->checked = writes_;  // value() just brought the base up to date
    }
  }
  return results;
}

Tensor Tracer::record_one(std::string_view op, std::span<const Tensor> operands,
                          const NamedAttrs& attrs, std::string_view name_hint) {
  std::vector<Tensor> r = record(op, operands, attrs, name_hint);
  if (r.size() != 1) {
    throw InvalidArgument(fmt::format("tracer: {} has {} results, expected 1", op, r.size()));
  }
  return std::move(r[0]);
}

void Tracer::declare_group(const std::string& name, int size) {
  if (name.empty()) throw InvalidArgument("tracer: group name must not be empty");
  if (size < 1) {
    throw InvalidArgument(
        fmt::format("tracer: group '{}' must have a positive size, got {}", name, size));
  }
  for (auto& [n, s] : groups_) {
    if (n == name) {
      s = size;
      return;
    }
  }
  groups_.emplace_back(name, size);
}

std::optional<int> Tracer::group_size(const std::string& name) const {
  for (const auto& [n, s] : groups_) {
    if (n == name) return s;
  }
  return std::nullopt;
}

void Tracer::set_outputs(std::span<const Tensor> outputs) {
  if (!graph_) throw InvalidArgument("tracer: set_outputs() after finish()");
  std::vector<Value*> values;
  values.reserve(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    try {
      values.push_back(value(outputs[i]));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(fmt::format("output {}: {}", i, e.what()));
    }
  }
  graph_->set_outputs(std::move(values));
}

std::unique_ptr<Graph> Tracer::finish() {
  if (!graph_) throw InvalidArgument("tracer: finish() called twice");
  // An in-place write rebinds the input's tensor to the written value; eagerly the caller's
  // tensor holds it afterwards, so a graph that neither returns it nor can write its input
  // would drop the write without a word.
  const std::vector<Value*>& outputs = graph_->outputs();
  for (size_t i = 0; i < inputs_.size(); ++i) {
    const Value* now = value(inputs_[i]);
    const Value* input = graph_->inputs()[i];
    if (now != input && std::find(outputs.begin(), outputs.end(), now) == outputs.end()) {
      throw InvalidArgument(fmt::format(
          "tracer: input {} was written in place (an in-place collective into it or a view of "
          "it), but its new value {} is not an output: a graph cannot write its inputs, so "
          "return the written tensor to keep the write",
          input->ref(), now->ref()));
    }
  }
  verify(*graph_);
  return std::move(graph_);
}

Tracer* current_tracer() { return t_current_tracer; }

TraceScope::TraceScope(Tracer& tracer) : previous_(t_current_tracer) { t_current_tracer = &tracer; }

TraceScope::~TraceScope() { t_current_tracer = previous_; }

std::unique_ptr<Graph> trace(
    std::string graph_name, const std::vector<Type>& inputs,
    const std::function<std::vector<Tensor>(std::span<const Tensor> inputs)>& fn,
    const std::vector<std::pair<std::string, int>>& groups) {
  if (!fn) throw InvalidArgument("trace: the function is empty");
  Tracer tracer(std::move(graph_name));
  for (const auto& [name, size] : groups) tracer.declare_group(name, size);
  std::vector<Tensor> traced_inputs;
  traced_inputs.reserve(inputs.size());
  for (const Type& t : inputs) traced_inputs.push_back(tracer.input(t));
  std::vector<Tensor> outputs;
  {
    TraceScope scope(tracer);
    outputs = fn(traced_inputs);
  }
  tracer.set_outputs(outputs);
  return tracer.finish();
}

void ops_detail::set_tape_hook(TapeHook hook) { g_tape_hook.store(hook, std::memory_order_release); }

// ---- ops ----------------------------------------------------------------------------------

namespace ops {

std::vector<Tensor> call(std::string_view op_name, std::span<const Tensor> operands,
                         const NamedAttrs& attrs) {
  const OpDef& op = get_op(op_name);
  bool traced = false;
  bool meta = false;
  for (const Tensor& t : operands) {
    traced |= is_traced(t);
    meta |= t.is_meta();
  }
  if (op.collective != CollectiveKind::None && op.collective != CollectiveKind::Wait) {
    throw InvalidArgument(
        fmt::format("{}: collectives run through the functional API (funcol::{}), not ops::call",
                    op.name, op.name));
  }
  Tracer* tracer = current_tracer();
  if (traced || (operands.empty() && tracer)) {
    if (!tracer) {
      throw InvalidArgument(fmt::format(
          "{}: a traced tensor is used outside its trace (no tracer is current)", op.name));
    }
    // Eagerly wait_tensor returns its operand itself (writes into one show in the other); the
    // functional collectives recorded their wait already.
    if (op.collective == CollectiveKind::Wait && operands.size() == 1) {
      tracer->value(operands[0]);  // a traced tensor of this trace
      return {operands[0]};
    }
    return tracer->record(op.name, operands, attrs);
  }
  if (const ops_detail::TapeHook hook = g_tape_hook.load(std::memory_order_acquire)) {
    if (std::optional<std::vector<Tensor>> recorded = hook(op.name, operands, attrs)) {
      return std::move(*recorded);
    }
  }
  const std::vector<Attr> values = make_attrs(op, attrs);
  std::vector<Type> types;
  types.reserve(operands.size());
  for (size_t i = 0; i < operands.size(); ++i) {
    if (!operands[i].defined()) {
      throw InvalidArgument(fmt::format("{}: operand {} is an undefined tensor", op.name, i));
    }
    types.emplace_back(operands[i].dtype(), operands[i].sizes());
  }
  // Shape inference first: kernels may assume inputs it accepted, and meta operands (with no
  // tracer) get meta results of the inferred types.
  std::vector<Type> out_types = infer_types(op, types, values);
  if (meta) {
    std::vector<Tensor> out;
    out.reserve(out_types.size());
    for (const Type& t : out_types) out.push_back(Tensor::meta(t.shape, t.dtype));
    return out;
  }
  return run_kernel(op, operands, values);
}

Tensor call_one(std::string_view op, std::span<const Tensor> operands, const NamedAttrs& attrs) {
  std::vector<Tensor> r = call(op, operands, attrs);
  if (r.size() != 1) {
    throw InvalidArgument(fmt::format("{} has {} results, expected 1", op, r.size()));
  }
  return std::move(r[0]);
}

namespace {
Tensor unary(std::string_view op, const Tensor& a, const NamedAttrs& attrs = {}) {
  const Tensor in[] = {a};
  return call_one(op, in, attrs);
}
Tensor binary(std::string_view op, const Tensor& a, const Tensor& b) {
  const Tensor in[] = {a, b};
  return call_one(op, in);
}
}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary("add", a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary("sub", a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary("mul", a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary("div", a, b); }
Tensor neg(const Tensor& a) { return unary("neg", a); }
Tensor relu(const Tensor& a) { return unary("relu", a); }
Tensor matmul(const Tensor& a, const Tensor& b) { return binary("matmul", a, b); }
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  return unary("sum", a, {{"dims", dims}, {"keepdim", keepdim}});
}
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  return unary("mean", a, {{"dims", dims}, {"keepdim", keepdim}});
}
Tensor mse_loss(const Tensor& a, const Tensor& b) { return binary("mse_loss", a, b); }
Tensor view(const Tensor& a, const std::vector<int64_t>& shape) {
  return unary("view", a, {{"shape", shape}});
}
Tensor reshape(const Tensor& a, const std::vector<int64_t>& shape) {
  return unary("reshape", a, {{"shape", shape}});
}
Tensor flatten(const Tensor& a) { return unary("flatten", a); }
Tensor clone(const Tensor& a) { return unary("clone", a); }
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  return call_one("cat", tensors, {{"dim", dim}});
}
std::vector<Tensor> split_with_sizes(const Tensor& a, const std::vector<int64_t>& sizes,
                                     int64_t dim) {
  const Tensor in[] = {a};
  return call("split_with_sizes", in, {{"split_sizes", sizes}, {"dim", dim}});
}
Tensor narrow(const Tensor& a, int64_t dim, int64_t start, int64_t length) {
  return unary("narrow", a, {{"dim", dim}, {"start", start}, {"length", length}});
}
Tensor transpose(const Tensor& a, int64_t dim0, int64_t dim1) {
  return unary("transpose", a, {{"dim0", dim0}, {"dim1", dim1}});
}
Tensor permute(const Tensor& a, const std::vector<int64_t>& dims) {
  return unary("permute", a, {{"dims", dims}});
}
Tensor convert_element_type(const Tensor& a, DType dtype) {
  return unary("convert_element_type", a, {{"dtype", dtype}});
}
Tensor view_dtype(const Tensor& a, DType dtype) {
  return unary("view_dtype", a, {{"dtype", dtype}});
}
Tensor zeros(const std::vector<int64_t>& shape, DType dtype) {
  return call_one("zeros", {}, {{"shape", shape}, {"dtype", dtype}});
}
Tensor empty(const std::vector<int64_t>& shape, DType dtype) {
  return call_one("empty", {}, {{"shape", shape}, {"dtype", dtype}});
}

}  // namespace ops

}  // namespace funcol
