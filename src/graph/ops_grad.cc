// The gradient rule of every differentiable op (OpDef::grad), emitted as graph nodes through a
// Builder; autodiff (src/passes) and the eager tape (src/api) both apply these rules.
#include <algorithm>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "funcol/graph/graph.h"
#include "ops_table.h"

namespace funcol::detail {
namespace {

using Grads = std::vector<Value*>;
using GIn = std::span<Value* const>;

std::vector<int64_t> ints(const Shape& s) { return std::vector<int64_t>(s.begin(), s.end()); }

int64_t wrap(int64_t dim, int64_t rank) {
  const int64_t r = std::max<int64_t>(rank, 1);
  return dim < 0 ? dim + r : dim;
}

// `v` reshaped to `shape` (no node when it already has it). reshape, not view: gradients may be
// broadcast views (expand) that a view cannot reinterpret.
Value* reshape_to(Builder& b, Value* v, const Shape& shape) {
  if (v->shape() == shape) return v;
  return b.value("reshape", {v}, {{"shape", ints(shape)}});
}

Value* full(Builder& b, const Type& type, double value) {
  return b.value("full", {},
                 {{"shape", ints(type.shape)}, {"dtype", type.dtype}, {"value", value}});
}

Value* zeros(Builder& b, const Type& type) {
  return b.value("zeros", {}, {{"shape", ints(type.shape)}, {"dtype", type.dtype}});
}

// The gradient of a reduction over `dims` (empty: all) of an input of `in_shape`: the result's
// gradient with the reduced dims put back as 1, broadcast to the input shape.
Value* unreduce(Builder& b, Value* g, const Shape& in_shape, const std::vector<int64_t>& dims,
                bool keepdim) {
  const auto rank = static_cast<int64_t>(in_shape.size());
  Shape kept = in_shape;
  for (int64_t k = 0; k < rank; ++k) {
    const bool reduced =
        dims.empty() || std::any_of(dims.begin(), dims.end(),
                                    [&](int64_t d) { return wrap(d, rank) == k; });
    if (reduced) kept[static_cast<size_t>(k)] = 1;
  }
  Value* r = keepdim ? g : reshape_to(b, g, kept);
  if (r->shape() == in_shape) return r;
  return b.value("expand", {r}, {{"shape", ints(in_shape)}});
}

// Number of elements a reduction over `dims` folds into one.
int64_t reduced_count(const Shape& in_shape, const std::vector<int64_t>& dims) {
  const auto rank = static_cast<int64_t>(in_shape.size());
  if (dims.empty()) {
    int64_t n = 1;
    for (int64_t d : in_shape) n *= d;
    return n;
  }
  int64_t n = 1;
  for (int64_t d : dims) {
    if (rank > 0) n *= in_shape[static_cast<size_t>(wrap(d, rank))];
  }
  return n;
}

// A collective's result followed by its own wait_tensor, as the tracer records them.
Value* waited(Builder& b, Value* v) { return b.value("wait_tensor", {v}); }

// Sum-only collectives: PyTorch checks the reduce op when backward runs, not in forward.
void require_sum(const Node& node) {
  const std::string& op = node.attr("reduce_op").as_string();
  if (op != "sum") {
    throw_grad_error(node, [&](const std::string& where) {
      return fmt::format("{} backward only supports 'sum' reduction, got '{}' ({})",
                         node.op_name(), op, where);
    });
  }
}

// ---- views and copies -------------------------------------------------------------------------

Grads grad_reshape(Builder& b, const Node& n, GIn g) {
  return {reshape_to(b, g[0], n.operand(0)->shape())};
}

Grads grad_identity(Builder&, const Node&, GIn g) { return {g[0]}; }

Grads grad_none(Builder&, const Node& n, GIn) { return Grads(n.num_operands(), nullptr); }

Grads grad_cat(Builder& b, const Node& n, GIn g) {
  if (n.num_operands() == 1) return {g[0]};
  const size_t ref = cat_reference(n.num_operands(), [&](size_t i) -> const Shape& {
    return n.operand(i)->shape();
  });
  // Every operand skipped: none has elements, nor a gradient.
  if (cat_skips(n.operand(ref)->shape())) return Grads(n.num_operands(), nullptr);
  const int64_t rank = n.operand(ref)->type().rank();
  const int64_t dim = wrap(n.attr("dim").as_int(), rank);
  // The operands cat skipped (type [0], of another rank) get no gradient: they have no elements.
  std::vector<size_t> parts;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < n.num_operands(); ++i) {
    const Shape& s = n.operand(i)->shape();
    if (i != ref && cat_skips(s) && rank != 1) continue;
    parts.push_back(i);
    sizes.push_back(s[static_cast<size_t>(dim)]);
  }
  Grads out(n.num_operands(), nullptr);
  if (parts.size() == 1) {
    out[parts[0]] = g[0];
    return out;
  }
  Node* split = b.create("split_with_sizes", {g[0]}, {{"split_sizes", sizes}, {"dim", dim}});
  for (size_t k = 0; k < parts.size(); ++k) out[parts[k]] = split->result(k);
  return out;
}

Grads grad_split(Builder& b, const Node& n, GIn g) {
  const int64_t dim = wrap(n.attr("dim").as_int(), n.operand(0)->type().rank());
  std::vector<Value*> pieces;
  for (size_t i = 0; i < g.size(); ++i) {
    pieces.push_back(g[i] ? g[i] : zeros(b, n.result(i)->type()));
  }
  if (pieces.size() == 1) return {pieces[0]};
  return {b.value("cat", pieces, {{"dim", dim}})};
}

Grads grad_narrow(Builder& b, const Node& n, GIn g) {
  const Type& in = n.operand(0)->type();
  const int64_t dim = wrap(n.attr("dim").as_int(), in.rank());
  const int64_t size = in.shape[static_cast<size_t>(dim)];
  int64_t start = n.attr("start").as_int();
  if (start < 0) start += size;
  const int64_t length = n.attr("length").as_int();
  std::vector<Value*> pieces;
  auto pad = [&](int64_t len) {
    if (len == 0) return;
    Type t = in;
    t.shape[static_cast<size_t>(dim)] = len;
    pieces.push_back(zeros(b, t));
  };
  pad(start);
  pieces.push_back(g[0]);
  pad(size - start - length);
  if (pieces.size() == 1) return {g[0]};
  return {b.value("cat", pieces, {{"dim", dim}})};
}

Grads grad_transpose(Builder& b, const Node& n, GIn g) {
  return {b.value("transpose", {g[0]},
                  {{"dim0", n.attr("dim0").as_int()}, {"dim1", n.attr("dim1").as_int()}})};
}

Grads grad_permute(Builder& b, const Node& n, GIn g) {
  const auto& dims = n.attr("dims").as_ints();
  const auto rank = static_cast<int64_t>(dims.size());
  std::vector<int64_t> inverse(dims.size());
  for (int64_t i = 0; i < rank; ++i) inverse[static_cast<size_t>(wrap(dims[i], rank))] = i;
  return {b.value("permute", {g[0]}, {{"dims", inverse}})};
}

Grads grad_convert(Builder& b, const Node& n, GIn g) {
  const DType from = n.operand(0)->dtype();
  if (!is_floating(from)) return {nullptr};
  return {b.value("convert_element_type", {g[0]}, {{"dtype", from}})};
}

Grads grad_expand(Builder& b, const Node& n, GIn g) {
  const Shape& in = n.operand(0)->shape();
  const Shape& out = n.result(0)->shape();
  const size_t lead = out.size() - in.size();
  std::vector<int64_t> dims;
  for (size_t i = 0; i < out.size(); ++i) {
    if (i < lead || in[i - lead] != out[i]) dims.push_back(static_cast<int64_t>(i));
  }
  if (dims.empty()) return {g[0]};
  Value* s = b.value("sum", {g[0]}, {{"dims", dims}, {"keepdim", false}});
  return {reshape_to(b, s, in)};
}

// ---- math -------------------------------------------------------------------------------------

Grads grad_add(Builder&, const Node&, GIn g) { return {g[0], g[0]}; }

Grads grad_sub(Builder& b, const Node&, GIn g) { return {g[0], b.value("neg", {g[0]})}; }

Grads grad_mul(Builder& b, const Node& n, GIn g) {
  return {b.value("mul", {g[0], n.operand(1)}), b.value("mul", {g[0], n.operand(0)})};
}

// d(a/b)/da = 1/b; d(a/b)/db = -(a/b)/b, in PyTorch's order -(g * ((a/b) / b)): (g * out) / b
// rounds differently and overflows f16 where PyTorch does not.
Grads grad_div(Builder& b, const Node& n, GIn g) {
  Value* y = const_cast<Value*>(n.result(0));
  Value* gb = b.value("neg", {b.value("mul", {g[0], b.value("div", {y, n.operand(1)})})});
  return {b.value("div", {g[0], n.operand(1)}), gb};
}

Grads grad_relu(Builder& b, const Node& n, GIn g) {
  return {b.value("relu_backward", {g[0], const_cast<Value*>(n.result(0))})};
}

// relu_backward is linear in its gradient operand; the mask's gradient is zero (a.e.), as
// PyTorch's threshold_backward gives (zeros, not none: a path through it is differentiable).
Grads grad_relu_backward(Builder& b, const Node& n, GIn g) {
  return {b.value("relu_backward", {g[0], n.operand(1)}), zeros(b, n.operand(1)->type())};
}

Grads grad_neg(Builder& b, const Node&, GIn g) { return {b.value("neg", {g[0]})}; }

Grads grad_matmul(Builder& b, const Node& n, GIn g) {
  Value* at = b.value("transpose", {n.operand(0)}, {{"dim0", 0}, {"dim1", 1}});
  Value* bt = b.value("transpose", {n.operand(1)}, {{"dim0", 0}, {"dim1", 1}});
  return {b.value("matmul", {g[0], bt}), b.value("matmul", {at, g[0]})};
}

Grads grad_sum(Builder& b, const Node& n, GIn g) {
  return {unreduce(b, g[0], n.operand(0)->shape(), n.attr("dims").as_ints(),
                   n.attr("keepdim").as_bool())};
}

// `v / count`, as PyTorch's `grad / numel` computes it: f16 and bf16 in f32 (their opmath type),
// rounded back once. A count in the tensor's own dtype would be wrong: 65536 is inf in f16 (the
// gradient came out 0) and bf16 rounds 257 to 256.
Value* div_by_count(Builder& b, Value* v, int64_t count) {
  const DType dtype = v->dtype();
  const bool reduced = dtype == DType::F16 || dtype == DType::BF16;
  Value* x = reduced ? b.value("convert_element_type", {v}, {{"dtype", DType::F32}}) : v;
  Value* q = b.value("div", {x, full(b, x->type(), static_cast<double>(count))});
  return reduced ? b.value("convert_element_type", {q}, {{"dtype", dtype}}) : q;
}

Grads grad_mean(Builder& b, const Node& n, GIn g) {
  const Type& in = n.operand(0)->type();
  const auto& dims = n.attr("dims").as_ints();
  Value* e = unreduce(b, g[0], in.shape, dims, n.attr("keepdim").as_bool());
  return {div_by_count(b, e, reduced_count(in.shape, dims))};
}

// mse_loss = mean((a - b)^2): d/da = ((a - b) * 2/N) * g, d/db = -d/da, in PyTorch's order
// (mse_backward: norm * (a - b) * grad): g * (a - b) first overflows f16 with a scaled loss where
// PyTorch does not. For f16 and bf16 the scaling runs in f32 (their opmath type) and rounds once:
// PyTorch's CPU kernel rounds 2/N to the input's dtype, which is 1.3% off in f16 at N = 10^6 and
// zero (no gradient at all) from N = 2^26 on.
Grads grad_mse_loss(Builder& b, const Node& n, GIn g) {
  const Type& in = n.operand(0)->type();
  const int64_t count = in.numel();
  if (count == 0) return {zeros(b, in), zeros(b, in)};
  const DType dtype = in.dtype;
  const bool reduced = dtype == DType::F16 || dtype == DType::BF16;
  auto opmath = [&](Value* v) {
    return reduced ? b.value("convert_element_type", {v}, {{"dtype", DType::F32}}) : v;
  };
  Value* diff = opmath(b.value("sub", {n.operand(0), n.operand(1)}));
  Value* scale = full(b, diff->type(), 2.0 / static_cast<double>(count));
  Value* e = opmath(unreduce(b, g[0], in.shape, {}, false));
  Value* scaled = b.value("mul", {b.value("mul", {diff, scale}), e});
  if (reduced) scaled = b.value("convert_element_type", {scaled}, {{"dtype", dtype}});
  return {scaled, b.value("neg", {scaled})};
}

// ---- collectives (DESIGN §4; each backward collective is followed by its wait_tensor) --------

Grads grad_all_reduce(Builder& b, const Node& n, GIn g) {
  require_sum(n);
  return {waited(b, b.value("all_reduce", {g[0]},
                            {{"reduce_op", "sum"}, {"group", n.attr("group")}}))};
}

// A 0-d input gathers to [group_size], whose reduce-scatter is [1]: reshaped back to the
// input's shape (as PyTorch's engine sums a gradient to its input's shape).
Grads grad_all_gather(Builder& b, const Node& n, GIn g) {
  Value* rs = waited(b, b.value("reduce_scatter_tensor", {g[0]},
                                {{"reduce_op", "sum"},
                                 {"group_size", n.attr("group_size")},
                                 {"group", n.attr("group")}}));
  return {reshape_to(b, rs, n.operand(0)->shape())};
}

Grads grad_reduce_scatter(Builder& b, const Node& n, GIn g) {
  require_sum(n);
  return {waited(b, b.value("all_gather_into_tensor", {g[0]},
                            {{"group_size", n.attr("group_size")}, {"group", n.attr("group")}}))};
}

Grads grad_all_to_all(Builder& b, const Node& n, GIn g) {
  return {waited(b, b.value("all_to_all_single", {g[0]},
                            {{"output_split_sizes", n.attr("input_split_sizes")},
                             {"input_split_sizes", n.attr("output_split_sizes")},
                             {"group", n.attr("group")}}))};
}

// Coalesced: one backward collective over every floating result, a result without a gradient
// taking zeros (as PyTorch materialises them), each result waited. Which results reach a loss
// can differ between ranks (an eager tape's loss is the rank's own), but every rank's backward
// collective must list the same tensors; and a result unused here may carry a peer's gradient
// into its operand.
Grads coalesced(Builder& b, const Node& n, GIn g, std::string_view op, const NamedAttrs& attrs) {
  Grads out(n.num_operands(), nullptr);
  if (std::none_of(g.begin(), g.end(), [](Value* v) { return v != nullptr; })) return out;
  std::vector<Value*> grads;
  std::vector<size_t> which;
  for (size_t i = 0; i < g.size(); ++i) {
    if (!g[i] && !is_floating(n.result(i)->dtype())) continue;
    grads.push_back(g[i] ? g[i] : zeros(b, n.result(i)->type()));
    which.push_back(i);
  }
  Node* c = b.create(op, grads, attrs);
  for (size_t k = 0; k < which.size(); ++k) out[which[k]] = waited(b, c->result(k));
  return out;
}

Grads grad_all_reduce_coalesced(Builder& b, const Node& n, GIn g) {
  require_sum(n);
  return coalesced(b, n, g, "all_reduce_coalesced",
                   {{"reduce_op", "sum"}, {"group", n.attr("group")}});
}

Grads grad_all_gather_coalesced(Builder& b, const Node& n, GIn g) {
  Grads out = coalesced(b, n, g, "reduce_scatter_tensor_coalesced",
                        {{"reduce_op", "sum"},
                         {"group_size", n.attr("group_size")},
                         {"group", n.attr("group")}});
  // 0-d inputs, as grad_all_gather.
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i]) out[i] = reshape_to(b, out[i], n.operand(i)->shape());
  }
  return out;
}

Grads grad_reduce_scatter_coalesced(Builder& b, const Node& n, GIn g) {
  require_sum(n);
  return coalesced(b, n, g, "all_gather_into_tensor_coalesced",
                   {{"group_size", n.attr("group_size")}, {"group", n.attr("group")}});
}

// PyTorch's functional broadcast has no autograd rule. The right one (sum every rank's
// gradient onto src, zero elsewhere) needs rank-dependent split sizes that one graph for all
// ranks cannot express, so this is an error rather than a silently wrong gradient.
Grads grad_broadcast(Builder&, const Node& n, GIn) {
  throw_grad_error(n, [](const std::string& where) {
    return fmt::format(
        "broadcast has no gradient rule ({}; PyTorch defines none): make its input a "
        "non-differentiated value or use all_reduce",
        where);
  });
}

}  // namespace

std::string grad_error_node(const Node& n) {
  const std::optional<SourceLocated> at = source_of(n, "");
  if (!at) return fmt::format("node %{}", n.name());
  return fmt::format("node %{} at {}:{}:{}", n.name(), at->file(), at->line(), at->col());
}

void add_grad_rules(std::vector<OpDef>& table) {
  const std::pair<std::string_view, GradFn> rules[] = {
      {"all_reduce", grad_all_reduce},
      {"all_reduce_coalesced", grad_all_reduce_coalesced},
      {"all_gather_into_tensor", grad_all_gather},
      {"all_gather_into_tensor_coalesced", grad_all_gather_coalesced},
      {"reduce_scatter_tensor", grad_reduce_scatter},
      {"reduce_scatter_tensor_coalesced", grad_reduce_scatter_coalesced},
      {"all_to_all_single", grad_all_to_all},
      {"broadcast", grad_broadcast},
      {"wait_tensor", grad_identity},
      {"view", grad_reshape},
      {"reshape", grad_reshape},
      {"flatten", grad_reshape},
      {"clone", grad_identity},
      {"cat", grad_cat},
      {"split_with_sizes", grad_split},
      {"narrow", grad_narrow},
      {"transpose", grad_transpose},
      {"permute", grad_permute},
      {"convert_element_type", grad_convert},
      {"view_dtype", grad_none},
      {"empty", grad_none},
      {"zeros", grad_none},
      {"full", grad_none},
      {"expand", grad_expand},
      {"add", grad_add},
      {"sub", grad_sub},
      {"mul", grad_mul},
      {"div", grad_div},
      {"relu", grad_relu},
      {"relu_backward", grad_relu_backward},
      {"neg", grad_neg},
      {"matmul", grad_matmul},
      {"sum", grad_sum},
      {"mean", grad_mean},
      {"mse_loss", grad_mse_loss},
  };
  for (const auto& rule : rules) {
    const std::string_view name = rule.first;  // not a structured binding: clang 14 cannot
                                               // capture those in the lambda below
    auto it = std::find_if(table.begin(), table.end(),
                           [&](const OpDef& op) { return op.name == name; });
    FUNCOL_CHECK(it != table.end(), fmt::format("gradient rule for unknown op {}", name));
    it->grad = rule.second;
  }
}

}  // namespace funcol::detail
