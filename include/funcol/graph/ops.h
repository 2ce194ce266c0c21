// The op table: every IR op's schema, shape inference, CPU kernel, gradient slot and traits.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "funcol/core/tensor.h"
#include "funcol/graph/types.h"

namespace funcol {

class Builder;
class Node;
class Value;
struct OpDef;

// What a collective does; the bucketing passes and the executor dispatch on it.
enum class CollectiveKind : uint8_t {
  None,
  AllReduce,
  AllGather,
  ReduceScatter,
  AllToAll,
  Broadcast,
  Wait,  // wait_tensor: not a collective itself, but waits on one
};
// "all_reduce", "all_gather", ..., "wait", "none".
std::string_view collective_kind_name(CollectiveKind kind);

// One attribute of an op's schema. `required` attributes must be written; the others take
// `default_value` when absent, so every node holds every attribute of its op.
struct AttrSpec {
  std::string_view name{};
  AttrKind kind = AttrKind::Int;
  bool required = true;
  Attr default_value{};
  // Validates and normalizes a value after its kind was checked, e.g. reduce_op lower-cases
  // and rejects unknown names. Throws InvalidArgument. Null: any value of the kind is fine.
  void (*canonicalize)(Attr& value) = nullptr;
  // A Float attribute that keeps an integer value as it is (AttrKind::Int) instead of
  // converting it to a double, which would round integers above 2^53, and takes true/false
  // too, kept as written (AttrKind::Bool; full's `value`, as torch.full's fill value).
  bool keeps_exact = false;

  // What a value must be, for errors: "an integer", "a number or true/false", ...
  std::string_view description() const {
    return keeps_exact ? "a number or true/false" : attr_kind_description(kind);
  }
};

// How many results a node of an op has.
enum class ResultArity : uint8_t {
  One,             // exactly one
  PerOperand,      // one per operand (coalesced collectives)
  PerListElement,  // one per element of the integer-list attribute `OpDef::list_attr`
};

// A node's attribute values seen through its op's schema: values()[i] belongs to
// op().attrs[i]. Every slot holds a value (defaults are filled in when a node is created).
class AttrList {
 public:
  AttrList(const OpDef& op, std::span<const Attr> values) : op_(&op), values_(values) {}

  const OpDef& op() const { return *op_; }
  std::span<const Attr> values() const { return values_; }
  // The value of attribute `name`; FUNCOL_CHECK when the op has no such attribute (a bug).
  const Attr& get(std::string_view name) const;
  int64_t get_int(std::string_view name) const { return get(name).as_int(); }
  double get_float(std::string_view name) const { return get(name).as_float(); }
  const std::string& get_string(std::string_view name) const { return get(name).as_string(); }
  bool get_bool(std::string_view name) const { return get(name).as_bool(); }
  DType get_dtype(std::string_view name) const { return get(name).as_dtype(); }
  const std::vector<int64_t>& get_ints(std::string_view name) const { return get(name).as_ints(); }

 private:
  const OpDef* op_;
  std::span<const Attr> values_;
};

// Meta kernel: result types from operand types and attributes. Throws ShapeError (shapes that
// do not fit) or InvalidArgument (bad dtype or attribute value); the message does not repeat
// the op name (infer_types adds it).
using InferFn = std::vector<Type> (*)(std::span<const Type> inputs, const AttrList& attrs);
// CPU kernel over core tensors (null for collectives: the executor runs them through dist).
using KernelFn = std::vector<Tensor> (*)(std::span<const Tensor> inputs, const AttrList& attrs);
// Gradient rule: given the forward node and the gradients of its results (null where a result
// has no gradient), emits backward nodes through `b` and returns one gradient per operand
// (null where an operand gets none); it may throw InvalidArgument (a non-sum reduce op). Set in
// src/graph/ops_grad.cc and applied by append_backward (graph/backward.h); null means "no
// gradient rule" (an error when autodiff reaches the op).
using GradFn =
    std::function<std::vector<Value*>(Builder& b, const Node& node, std::span<Value* const> grads)>;
// Packing collectives only (all_gather_into_tensor_packed, which the bucketing passes' custom_ops
// modes create): writes the node's operands into `dst`, the contiguous slot of this rank in
// the result (result numel / group_size elements of the result dtype, starting at element
// rank * that), converting dtypes as the op's attributes say. The executor allocates the
// result, calls this on the rank's slot and then all-gathers the result in place (the slot is
// the send buffer), so the packed operands never exist as a separate buffer.
using PackFn = void (*)(std::span<const Tensor> inputs, const AttrList& attrs, const Tensor& dst);

// One op: everything the parser, printer, verifier, executor and passes know about it.
struct OpDef {
  std::string_view name{};
  // Operands: exactly `num_operands`, or at least `num_operands` when `variadic`.
  int num_operands = 1;
  bool variadic = false;
  ResultArity results = ResultArity::One;
  // For ResultArity::PerListElement: index into `attrs` of the list that sets the count.
  int list_attr = -1;
  // The schema, in the fixed order in which the printer writes attributes.
  std::vector<AttrSpec> attrs{};
  InferFn infer = nullptr;
  KernelFn kernel = nullptr;
  GradFn grad{};
  // The result aliases operand 0's storage (view, reshape, narrow, split, ...): it never waits
  // and shares the operand's pending state and lifetime (when a graph runs, a view or
  // view_dtype the operand's layout cannot express copies instead: see value_kernel).
  bool is_view = false;
  // Never removed by DCE even when unused: collectives and wait_tensor.
  bool has_side_effect = false;
  CollectiveKind collective = CollectiveKind::None;
  // Non-null for packing collectives (see PackFn): a variadic op with ONE result, not a
  // coalesced one.
  PackFn pack = nullptr;

  // True for the communicating ops (not wait_tensor).
  bool is_collective() const {
    return collective != CollectiveKind::None && collective != CollectiveKind::Wait;
  }
  // Index of attribute `name` in `attrs`, or -1.
  int attr_index(std::string_view attr_name) const;
  // True when nodes of this op are written `%name:k` and their results `%name#i`.
  bool multi_result() const { return results != ResultArity::One; }
  // "1 operand", "at least 1 operand", "2 operands" (for messages).
  std::string operand_count_str() const;
  // Throws InvalidArgument "all_reduce expects 1 operand, got 2" when n does not fit.
  void check_operand_count(size_t n) const;
};

// Every op, in table order (the order of DESIGN §5).
std::span<const OpDef> all_ops();
// The op called `name`, or null.
const OpDef* find_op(std::string_view name);
// The op called `name`; throws InvalidArgument "unknown op 'name'".
const OpDef& get_op(std::string_view name);

// The kernel that computes a node's value when a graph runs: op.kernel, except for `view` and
// `view_dtype`. Eagerly (ops::call) they need a layout the view can reinterpret, as PyTorch's
// do; an IR value has no layout (a view of a transposed value is a value like any other, and
// the verifier accepts it), so when the operand's strides do not allow the view these copy it
// first, as Inductor lowers a view of a non-contiguous buffer.
KernelFn value_kernel(const OpDef& op);

// Checks `value` against `spec` and converts it in place where the text form is ambiguous
// (an integer where a float is expected, an empty or all-integer list where a list of integers
// is expected), then runs spec.canonicalize. Throws InvalidArgument
// "attribute 'dim' of narrow must be an integer, got \"x\"".
void coerce_attr(const OpDef& op, const AttrSpec& spec, Attr& value);

// Attribute values by name, as passes and tests write them: {{"dim", 0}, {"group", "world"}}.
using NamedAttrs = std::vector<std::pair<std::string_view, Attr>>;
// The full attribute vector of a node of `op`: named values checked with coerce_attr, absent
// optional ones set to their defaults. Throws InvalidArgument on an unknown, duplicate or
// missing attribute.
std::vector<Attr> make_attrs(const OpDef& op, const NamedAttrs& named);

// Runs `op`'s shape inference after checking the operand count; errors are rethrown with the
// op name in front ("reduce_scatter_tensor: input dim 0 (6) is not a multiple of group_size 4")
// and keep their type (ShapeError or InvalidArgument).
std::vector<Type> infer_types(const OpDef& op, std::span<const Type> inputs,
                              std::span<const Attr> attrs);

// Runs `op`'s CPU kernel; throws InvalidArgument when the op has none (collectives).
std::vector<Tensor> run_kernel(const OpDef& op, std::span<const Tensor> inputs,
                               std::span<const Attr> attrs);

// Reduce-op names accepted in `reduce_op` attributes: sum avg product min max band bor bxor.
inline constexpr std::string_view kReduceOpNames[] = {"sum", "avg",  "product", "min",
                                                      "max", "band", "bor",     "bxor"};

}  // namespace funcol
