// The tracer: runs a C++ function over meta tensors and records the ops it calls into a Graph.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "funcol/core/tensor.h"
#include "funcol/graph/graph.h"

namespace funcol {

namespace tracer_detail {
struct Ref;  // what a traced tensor's annotation holds (tracer.cc)
}  // namespace tracer_detail

// Records a graph. Each traced tensor is a meta tensor (sizes and dtype, no data) whose
// annotation names the graph value it stands for; ops recorded on traced tensors append nodes
// (with shape inference) and return new traced tensors. A view's traced tensor has the layout
// (strides, offset) the view would have eagerly, so that what eagerly refuses a layout (a view
// that needs a copy, a collective's non-contiguous input) refuses it while tracing too. The
// functional collectives of <funcol/api/functional.h> record `collective` + `wait_tensor` pairs
// while a tracer is current on the calling thread (see TraceScope), as PyTorch's funcol does
// under tracing.
class Tracer {
 public:
  explicit Tracer(std::string graph_name);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Adds a graph input of `type` named `name` (empty: "x", "x.1", ...) and returns the traced
  // meta tensor standing for it. Throws InvalidArgument for a bad or taken name.
  Tensor input(const Type& type, std::string name = {});

  // Appends a node of op `op` over traced `operands` and returns its results as traced
  // tensors. Throws InvalidArgument for an unknown op, an untraced operand, bad attributes,
  // and ShapeError / InvalidArgument from shape inference ("matmul: ...") or, for a view, from
  // the view eagerly ("view: cannot view ... without a copy"). The node is named
  // from `name_hint` (empty: a short name derived from the op).
  std::vector<Tensor> record(std::string_view op, std::span<const Tensor> operands,
                             const NamedAttrs& attrs = {}, std::string_view name_hint = {});
  // record() of a single-result op.
  Tensor record_one(std::string_view op, std::span<const Tensor> operands,
                    const NamedAttrs& attrs = {}, std::string_view name_hint = {});

  // True when `t` is a tensor traced by this tracer.
  bool owns(const Tensor& t) const;
  // The graph value `t` stands for. Throws InvalidArgument when `t` was not produced by this
  // tracer (a real tensor, an untraced op's result such as t.view(...) instead of
  // ops::view, or a tensor of another trace).
  Value* value(const Tensor& t) const;
  // Makes `t`, and every copy of it (copies share the annotation), stand for `value`'s graph
  // value from now on: an in-place op traced functionally, as PyTorch functionalizes
  // `t.copy_(r)`. When `t` is a view (narrow, split_with_sizes, transpose, permute, view,
  // view_dtype) of another traced tensor, that base stands for its value with the view's
  // elements replaced, as eagerly (and so on up a chain of views). Other views of the base,
  // made before or after, see the write from then on, as eager views do; a reshape or flatten
  // of it made before the write and used after is an InvalidArgument (eagerly it may be a
  // copy). Throws InvalidArgument when either tensor is not traced by this tracer, their types
  // differ, or `t` is a view that cannot be written through (reshape and flatten, which eagerly
  // copy some layouts; expand); then nothing changes, as an eager write that fails writes
  // nothing.
  void assign(const Tensor& t, const Tensor& value);

  // Group sizes for collectives recorded without a live process group (tracing outside any
  // rank): declare_group("world", 4). Inside a rank, names resolve in the rank's registry.
  void declare_group(const std::string& name, int size);
  std::optional<int> group_size(const std::string& name) const;

  // Sets the graph outputs (traced tensors, in order).
  void set_outputs(std::span<const Tensor> outputs);
  // The graph so far.
  const Graph& graph() const { return *graph_; }
  // Verifies and returns the graph; the tracer records nothing more afterwards. Throws
  // InvalidArgument when an input was written in place (an in-place collective into it or a
  // view of it) and its new value is not an output: a graph cannot write its inputs, so the
  // write would be lost where it happened eagerly.
  std::unique_ptr<Graph> finish();

 private:
  // The traced tensor for `value`: `layout` (a view's eager layout) or a contiguous one.
  Tensor wrap(Value* value, Tensor layout = {}) const;
  // Whether a write into result `result` of `view` can be written through into its base.
  static bool writes_through(const Node& view, size_t result);
  // The error for a write into a view that does not write through.
  static InvalidArgument not_written_through(const Node& view);
  // The base's value after `written` was written into result `result` of `view`.
  Value* write_through(const Node& view, size_t result, Value* base, Value* written);
  // Brings a view (and its bases) up to date with the in-place writes into its bases.
  void refresh(tracer_detail::Ref& ref) const;
  Value* view_again(const Node& view, size_t result, Value* base) const;

  uint64_t id_;
  std::unique_ptr<Graph> graph_;
  // The traced tensors of the inputs, in order: their annotation follows in-place writes.
  std::vector<Tensor> inputs_;
  std::vector<std::pair<std::string, int>> groups_;
  // In-place writes so far (assign), from 1: see refresh.
  uint64_t writes_ = 1;
};

// The tracer current on the calling thread, or null.
Tracer* current_tracer();

// Whether `t` is a traced tensor (one a Tracer made, its trace finished or not).
bool is_traced(const Tensor& t);

// Makes `tracer` current on the calling thread until the scope ends (scopes nest).
class TraceScope {
 public:
  explicit TraceScope(Tracer& tracer);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Tracer* previous_;
};

// Traces `fn`: creates one input per entry of `inputs` (named "x", "x.1", ...), calls fn with
// their traced tensors under a TraceScope, makes its results the graph outputs and returns
// the verified graph. `groups` declares group sizes (see Tracer::declare_group).
std::unique_ptr<Graph> trace(
    std::string graph_name, const std::vector<Type>& inputs,
    const std::function<std::vector<Tensor>(std::span<const Tensor> inputs)>& fn,
    const std::vector<std::pair<std::string, int>>& groups = {});

// Tensor ops that work both ways: on traced tensors they record a node in the current tracer;
// on real tensors they run the op table's CPU kernel (so one function body runs eagerly and
// traces). Mixing traced and real tensors is an InvalidArgument.
namespace ops {

// Any op of the table by name: ops::call("narrow", {x}, {{"dim", 0}, {"start", 1}, ...}).
std::vector<Tensor> call(std::string_view op, std::span<const Tensor> operands,
                         const NamedAttrs& attrs = {});
Tensor call_one(std::string_view op, std::span<const Tensor> operands,
                const NamedAttrs& attrs = {});

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor neg(const Tensor& a);
Tensor relu(const Tensor& a);
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mse_loss(const Tensor& a, const Tensor& b);
Tensor view(const Tensor& a, const std::vector<int64_t>& shape);
Tensor reshape(const Tensor& a, const std::vector<int64_t>& shape);
Tensor flatten(const Tensor& a);
Tensor clone(const Tensor& a);
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
std::vector<Tensor> split_with_sizes(const Tensor& a, const std::vector<int64_t>& sizes,
                                     int64_t dim = 0);
Tensor narrow(const Tensor& a, int64_t dim, int64_t start, int64_t length);
Tensor transpose(const Tensor& a, int64_t dim0, int64_t dim1);
Tensor permute(const Tensor& a, const std::vector<int64_t>& dims);
Tensor convert_element_type(const Tensor& a, DType dtype);
Tensor view_dtype(const Tensor& a, DType dtype);
// Factories: traced when a tracer is current, real otherwise.
Tensor zeros(const std::vector<int64_t>& shape, DType dtype);
Tensor empty(const std::vector<int64_t>& shape, DType dtype);

}  // namespace ops

}  // namespace funcol
