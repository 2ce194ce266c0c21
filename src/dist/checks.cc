// Synchronous argument checks shared by every backend's ProcessGroup primitives.
#include "checks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "funcol/core/error.h"

namespace funcol::dist_detail {

namespace {
int64_t product_from(const Shape& sizes, size_t first) {
  int64_t n = 1;
  for (size_t i = first; i < sizes.size(); ++i) n *= sizes[i];
  return n;
}
}  // namespace

void check_buffer(std::string_view op, const Tensor& t, std::string_view what) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{}: {} is undefined", op, what));
  if (t.is_meta()) {
    throw InvalidArgument(fmt::format("{}: {} is a meta tensor ({}) without data", op, what,
                                      type_str(t.dtype(), t.sizes())));
  }
  if (!t.is_contiguous()) {
    throw InvalidArgument(fmt::format("{}: {} must be contiguous (sizes {}, strides {})", op,
                                      what, shape_str(t.sizes()), shape_str(t.strides())));
  }
}

void check_same_dtype(std::string_view op, const Tensor& a, std::string_view a_name,
                      const Tensor& b, std::string_view b_name) {
  if (a.dtype() != b.dtype()) {
    throw InvalidArgument(fmt::format("{}: {} dtype {} does not match {} dtype {}", op, a_name,
                                      dtype_name(a.dtype()), b_name, dtype_name(b.dtype())));
  }
}

void check_reduce(std::string_view op, ReduceOp reduce_op, DType dtype) {
  if (static_cast<int>(reduce_op) > static_cast<int>(ReduceOp::BXor)) {
    throw InvalidArgument(fmt::format("{}: invalid reduce op {}", op, static_cast<int>(reduce_op)));
  }
  bool bitwise = reduce_op == ReduceOp::BAnd || reduce_op == ReduceOp::BOr ||
                 reduce_op == ReduceOp::BXor;
  if (bitwise && is_floating(dtype)) {
    throw InvalidArgument(fmt::format("{}: reduce_op {} needs an integer or bool tensor, got {}",
                                      op, reduce_op_name(reduce_op), dtype_name(dtype)));
  }
  if (reduce_op == ReduceOp::Avg && dtype == DType::Bool) {
    throw InvalidArgument(fmt::format("{}: reduce_op avg is not supported on bool tensors", op));
  }
}

void check_all_reduce(const Tensor& tensor, ReduceOp reduce_op) {
  check_buffer("all_reduce", tensor, "tensor");
  check_reduce("all_reduce", reduce_op, tensor.dtype());
}

void check_all_gather(const Tensor& output, const Tensor& input, int group_size) {
  check_buffer("all_gather", input, "input");
  check_buffer("all_gather", output, "output");
  check_same_dtype("all_gather", output, "output", input, "input");
  if (output.numel() != group_size * input.numel()) {
    throw ShapeError(fmt::format(
        "all_gather: output numel ({}) must be group size ({}) * input numel ({})",
        output.numel(), group_size, input.numel()));
  }
}

void check_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp reduce_op,
                          int group_size) {
  check_buffer("reduce_scatter", input, "input");
  check_buffer("reduce_scatter", output, "output");
  check_same_dtype("reduce_scatter", output, "output", input, "input");
  check_reduce("reduce_scatter", reduce_op, input.dtype());
  if (input.numel() != group_size * output.numel()) {
    throw ShapeError(fmt::format(
        "reduce_scatter: input numel ({}) must be group size ({}) * output numel ({})",
        input.numel(), group_size, output.numel()));
  }
}

void check_broadcast(const Tensor& tensor, int src, int group_size) {
  check_buffer("broadcast", tensor, "tensor");
  if (src < 0 || src >= group_size) {
    throw InvalidArgument(
        fmt::format("broadcast: src {} is out of range for group size {}", src, group_size));
  }
}

AllToAllLayout check_all_to_all(const Tensor& output, const Tensor& input,
                                const std::vector<int64_t>& output_splits,
                                const std::vector<int64_t>& input_splits, int group_size) {
  check_buffer("all_to_all", input, "input");
  check_buffer("all_to_all", output, "output");
  check_same_dtype("all_to_all", output, "output", input, "input");
  if (input.dim() == 0 || output.dim() == 0) {
    throw ShapeError(fmt::format("all_to_all: input ({}) and output ({}) need at least one dim",
                                 shape_str(input.sizes()), shape_str(output.sizes())));
  }
  AllToAllLayout layout;
  layout.row_elems = product_from(input.sizes(), 1);
  int64_t out_row = product_from(output.sizes(), 1);
  if (out_row != layout.row_elems) {
    throw ShapeError(fmt::format(
        "all_to_all: output rows ({} elements, sizes {}) differ from input rows ({} elements, "
        "sizes {})",
        out_row, shape_str(output.sizes()), layout.row_elems, shape_str(input.sizes())));
  }
  if (output_splits.empty() != input_splits.empty()) {
    throw InvalidArgument(
        "all_to_all: output_split_sizes and input_split_sizes must either be specified "
        "together or both set to None");
  }
  if (input_splits.empty()) {
    for (const Tensor* t : {&input, &output}) {
      if (t->size(0) % group_size != 0) {
        throw ShapeError(fmt::format(
            "all_to_all: {} dim 0 ({}) is not a multiple of group size {} (no split sizes given)",
            t == &input ? "input" : "output", t->size(0), group_size));
      }
    }
    layout.input_splits.assign(group_size, input.size(0) / group_size);
    layout.output_splits.assign(group_size, output.size(0) / group_size);
    return layout;
  }
  auto check_splits = [&](const std::vector<int64_t>& splits, const Tensor& t,
                          std::string_view name) {
    if (static_cast<int>(splits.size()) != group_size) {
      throw InvalidArgument(fmt::format("all_to_all: {} has {} entries but group size is {}",
                                        name, splits.size(), group_size));
    }
    int64_t total = 0;
    for (size_t j = 0; j < splits.size(); ++j) {
      if (splits[j] < 0) {
        throw InvalidArgument(
            fmt::format("all_to_all: {}[{}] is negative ({})", name, j, splits[j]));
      }
      total += splits[j];
    }
    if (total != t.size(0)) {
      throw ShapeError(fmt::format("all_to_all: {} sum to {} but {} dim 0 is {}", name, total,
                                   &t == &input ? "input" : "output",
                                   t.size(0)));
    }
  };
  check_splits(input_splits, input, "input_split_sizes");
  check_splits(output_splits, output, "output_split_sizes");
  layout.input_splits = input_splits;
  layout.output_splits = output_splits;
  return layout;
}

void check_coalesced_lists(std::string_view op, size_t outputs, size_t inputs) {
  if (outputs != inputs) {
    throw InvalidArgument(
        fmt::format("{}: {} outputs but {} inputs (the lists must pair up)", op, outputs, inputs));
  }
}

std::string format_ranks(const std::vector<int>& ranks) {
  return fmt::format("[{}]", fmt::join(ranks, ", "));
}

}  // namespace funcol::dist_detail
