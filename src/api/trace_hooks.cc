// Recording forms of the functional collectives: collective node + wait_tensor, like PyTorch's
// funcol under tracing, with the eager functions' argument checks.
#include "trace_hooks.h"

#include <fmt/format.h>

#include "arg_checks.h"
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"

namespace funcol::api_detail {

namespace {

struct TracedGroup {
  std::string name;
  int size = 0;
};

// The group a spec names, without communicating when it is a declared name.
TracedGroup traced_group(Tracer& tr, const GroupSpec& spec, std::string_view op) {
  if (const std::string* name = spec.name_if_string()) {
    if (std::optional<int> size = tr.group_size(*name)) return {*name, *size};
    if (ProcessGroup* world = current_world()) {
      if (auto g = world->registry().find(*name)) return {*name, g->size()};
    }
    throw InvalidArgument(fmt::format(
        "{}: unknown group '{}' while tracing (declare its size with Tracer::declare_group, or "
        "trace inside a rank that has it)",
        op, *name));
  }
  ProcessGroup& g = spec.resolve();
  return {g.name(), g.size()};
}

Tensor waited(Tracer& tr, const Tensor& t) {
  const Tensor in[] = {t};
  return tr.record_one("wait_tensor", in);
}

std::vector<Tensor> waited(Tracer& tr, const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  out.reserve(ts.size());
  for (const Tensor& t : ts) out.push_back(waited(tr, t));
  return out;
}

// Moves scatter_dim's group_size chunks to dim 0 (chunk + cat), as the seed does before a
// reduce_scatter along another dim. Checks divisibility with the eager message.
Tensor scatter_dim_to_front(Tracer& tr, const Tensor& t, int64_t scatter_dim, int size,
                            std::string_view op, std::string_view suffix) {
  const int64_t dim = check_reduce_scatter_input(t, scatter_dim, size, op, suffix);
  if (dim == 0) return t;
  const Tensor in[] = {t};
  std::vector<Tensor> chunks = tr.record(
      "split_with_sizes", in,
      {{"split_sizes", std::vector<int64_t>(static_cast<size_t>(size), t.size(dim) / size)},
       {"dim", dim}});
  return tr.record_one("cat", chunks, {{"dim", 0}});
}

}  // namespace

Tensor trace_all_reduce(Tracer& tr, const Tensor& t, const std::string& reduce_op,
                        const GroupSpec& group) {
  check_reduce_op_for(parse_reduce_op(reduce_op), t, "all_reduce");
  const TracedGroup g = traced_group(tr, group, "all_reduce");
  const Tensor in[] = {t};
  return waited(tr, tr.record_one("all_reduce", in, {{"reduce_op", reduce_op}, {"group", g.name}}));
}

Tensor trace_all_gather_tensor(Tracer& tr, const Tensor& t, int64_t gather_dim,
                               const GroupSpec& group) {
  constexpr std::string_view kOp = "all_gather_tensor";
  check_contiguous(t, kOp);
  const int64_t dim = normalize_dim(gather_dim, t.dim(), kOp, "gather_dim");
  const TracedGroup g = traced_group(tr, group, kOp);
  const Tensor in[] = {t};
  Tensor r = waited(
      tr, tr.record_one("all_gather_into_tensor", in, {{"group_size", g.size}, {"group", g.name}}));
  if (dim == 0 || t.dim() == 0) return r;
  // Rank-major blocks along dim 0 become blocks along gather_dim (the seed's chunk + cat).
  const Tensor gathered[] = {r};
  std::vector<Tensor> blocks = tr.record(
      "split_with_sizes", gathered,
      {{"split_sizes", std::vector<int64_t>(static_cast<size_t>(g.size), t.size(0))}, {"dim", 0}});
  return tr.record_one("cat", blocks, {{"dim", dim}});
}

Tensor trace_reduce_scatter_tensor(Tracer& tr, const Tensor& t, const std::string& reduce_op,
                                   int64_t scatter_dim, const GroupSpec& group) {
  constexpr std::string_view kOp = "reduce_scatter_tensor";
  check_reduce_op_for(parse_reduce_op(reduce_op), t, kOp);
  const TracedGroup g = traced_group(tr, group, kOp);
  const Tensor in[] = {scatter_dim_to_front(tr, t, scatter_dim, g.size, kOp, {})};
  return waited(
      tr, tr.record_one("reduce_scatter_tensor", in,
                        {{"reduce_op", reduce_op}, {"group_size", g.size}, {"group", g.name}}));
}

Tensor trace_all_to_all_single(Tracer& tr, const Tensor& t,
                               const std::optional<std::vector<int64_t>>& output_split_sizes,
                               const std::optional<std::vector<int64_t>>& input_split_sizes,
                               const GroupSpec& group) {
  if (output_split_sizes.has_value() != input_split_sizes.has_value()) {
    throw InvalidArgument(
        "output_split_sizes and input_split_sizes must either be specified together or both set "
        "to None");
  }
  check_contiguous(t, "all_to_all_single");
  if (t.dim() == 0) throw ShapeError("all_to_all_single: input must have at least one dimension");
  const TracedGroup g = traced_group(tr, group, "all_to_all_single");
  std::vector<int64_t> out_splits, in_splits;
  if (input_split_sizes) {
    out_splits = *output_split_sizes;
    in_splits = *input_split_sizes;
    check_all_to_all_splits(out_splits, in_splits, g.size, t.size(0));
  } else {
    if (t.size(0) % g.size != 0) {
      throw ShapeError(fmt::format(
          "all_to_all_single: input dimension 0 ({}) must be a multiple of group_size {} when no "
          "split sizes are given",
          t.size(0), g.size));
    }
    out_splits.assign(static_cast<size_t>(g.size), t.size(0) / g.size);
    in_splits = out_splits;
  }
  const Tensor in[] = {t};
  return waited(tr, tr.record_one("all_to_all_single", in,
                                  {{"output_split_sizes", out_splits},
                                   {"input_split_sizes", in_splits},
                                   {"group", g.name}}));
}

Tensor trace_broadcast(Tracer& tr, const Tensor& t, int src, const GroupSpec& group) {
  const TracedGroup g = traced_group(tr, group, "broadcast");
  if (src < 0 || src >= g.size) {
    throw InvalidArgument(fmt::format("broadcast: src {} is not a rank of group '{}' of size {}",
                                      src, g.name, g.size));
  }
  const Tensor in[] = {t};
  return waited(tr, tr.record_one("broadcast", in, {{"src", src}, {"group", g.name}}));
}

std::vector<Tensor> trace_all_reduce_coalesced(Tracer& tr, const std::vector<Tensor>& inputs,
                                               const std::string& reduce_op,
                                               const GroupSpec& group) {
  constexpr std::string_view kOp = "all_reduce_coalesced";
  // An empty list is checked as the eager call checks it.
  const ReduceOp op = parse_reduce_op(reduce_op);
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_reduce_op_for(op, inputs[i], kOp, index_suffix(i));
  }
  const TracedGroup g = traced_group(tr, group, kOp);
  if (inputs.empty()) return {};
  return waited(
      tr, tr.record("all_reduce_coalesced", inputs, {{"reduce_op", reduce_op}, {"group", g.name}}));
}

std::vector<Tensor> trace_all_gather_into_tensor_coalesced(Tracer& tr,
                                                           const std::vector<Tensor>& inputs,
                                                           const GroupSpec& group) {
  constexpr std::string_view kOp = "all_gather_into_tensor_coalesced";
  for (size_t i = 0; i < inputs.size(); ++i) check_contiguous(inputs[i], kOp, index_suffix(i));
  const TracedGroup g = traced_group(tr, group, kOp);
  if (inputs.empty()) return {};
  return waited(tr, tr.record("all_gather_into_tensor_coalesced", inputs,
                              {{"group_size", g.size}, {"group", g.name}}));
}

std::vector<Tensor> trace_reduce_scatter_tensor_coalesced(Tracer& tr,
                                                          const std::vector<Tensor>& inputs,
                                                          const std::string& reduce_op,
                                                          const std::vector<int64_t>& scatter_dims,
                                                          const GroupSpec& group) {
  constexpr std::string_view kOp = "reduce_scatter_tensor_coalesced";
  const ReduceOp op = parse_reduce_op(reduce_op);
  check_scatter_dims_count(scatter_dims.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_reduce_op_for(op, inputs[i], kOp, index_suffix(i));
  }
  const TracedGroup g = traced_group(tr, group, kOp);
  if (inputs.empty()) return {};
  std::vector<Tensor> fronted;
  fronted.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    fronted.push_back(scatter_dim_to_front(tr, inputs[i], scatter_dims[i], g.size, kOp,
                                           index_suffix(i)));
  }
  return waited(tr,
                tr.record("reduce_scatter_tensor_coalesced", fronted,
                          {{"reduce_op", reduce_op}, {"group_size", g.size}, {"group", g.name}}));
}

int traced_group_size(Tracer& tr, const GroupSpec& group, std::string_view op) {
  return traced_group(tr, group, op).size;
}

Tensor trace_permute_tensor(Tracer& tr, const Tensor& t, const std::vector<int>& src_dst,
                            const GroupSpec& group) {
  constexpr std::string_view kOp = "permute_tensor";
  const TracedGroup g = traced_group(tr, group, kOp);
  // The split sizes depend on the calling rank's number, so the graph is this rank's, as
  // PyTorch's is under tracing: it needs a rank of the group.
  std::shared_ptr<ProcessGroup> found;
  ProcessGroup* pg = nullptr;
  if (const std::string* name = group.name_if_string()) {
    if (ProcessGroup* world = current_world()) found = world->registry().find(*name);
    pg = found.get();
  } else {
    pg = &group.resolve();
  }
  if (!pg || pg->size() != g.size) {
    throw InvalidArgument(fmt::format(
        "{}: tracing it needs the calling rank's number in group '{}' (its split sizes depend "
        "on it): trace inside a rank that has the group, or use all_to_all_single with that "
        "rank's split sizes",
        kOp, g.name));
  }
  const Shape rows = permute_rows(t);
  const PermuteSplits splits = permute_splits(src_dst, g.size, pg->rank(), rows[0]);
  // Contiguous rows: a 0-d tensor as [1]; one that is not contiguous copied (a clone, as
  // eager's contiguous(): a reshape may give a strided view, such as a column's).
  Tensor x = t;
  if (t.dim() == 0) {
    x = ops::reshape(t, {1});
  } else if (!t.is_contiguous()) {
    x = ops::view(ops::clone(t), std::vector<int64_t>(rows.begin(), rows.end()));
  }
  const Tensor r = trace_all_to_all_single(tr, x, splits.out, splits.in, group);
  return t.dim() == 0 ? ops::view(r, {}) : r;
}

}  // namespace funcol::api_detail
