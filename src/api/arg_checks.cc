// Argument checks shared by the eager and the recording functional collectives.
#include "arg_checks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "funcol/core/error.h"

namespace funcol::api_detail {

int64_t normalize_dim(int64_t dim, int64_t ndim, std::string_view op, std::string_view arg,
                      std::string_view suffix) {
  const int64_t n = std::max<int64_t>(ndim, 1);
  if (dim < -n || dim >= n) {
    throw ShapeError(fmt::format("{}: {} {} is out of range for a {}-d input (expected {}..{}){}",
                                 op, arg, dim, ndim, -n, n - 1, suffix));
  }
  return dim < 0 ? dim + n : dim;
}

void check_contiguous(const Tensor& t, std::string_view op, std::string_view suffix) {
  if (!t.is_contiguous()) {
    throw InvalidArgument(fmt::format("Tensor must be contiguous for {}{}", op, suffix));
  }
}

std::string index_suffix(size_t i) { return fmt::format(" for tensor at index {}", i); }

void check_scatter_dims_count(size_t scatter_dims, size_t inputs) {
  if (scatter_dims != inputs) {
    throw InvalidArgument(fmt::format("Length of scatter_dim ({}) must equal length of inputs ({})",
                                      scatter_dims, inputs));
  }
}

void check_reduce_op_for(ReduceOp op, const Tensor& t, std::string_view op_name,
                         std::string_view suffix) {
  try {
    check_reduce_op_dtype(op, t.dtype(), op_name);
  } catch (const InvalidArgument& e) {
    if (suffix.empty()) throw;
    throw InvalidArgument(e.what() + std::string(suffix));
  }
}

int64_t check_splits(const std::vector<int64_t>& splits, int64_t group_size,
                     std::string_view name) {
  if (static_cast<int64_t>(splits.size()) != group_size) {
    throw InvalidArgument(
        fmt::format("all_to_all_single: {} has {} entries, expected group_size {}", name,
                    splits.size(), group_size));
  }
  int64_t total = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    if (splits[i] < 0) {
      throw InvalidArgument(
          fmt::format("all_to_all_single: {}[{}] is negative ({})", name, i, splits[i]));
    }
    if (__builtin_add_overflow(total, splits[i], &total)) {
      throw InvalidArgument(fmt::format("all_to_all_single: {} {} sum to more than int64 holds",
                                        name, splits));
    }
  }
  return total;
}

int64_t check_all_to_all_splits(const std::vector<int64_t>& output_splits,
                                const std::vector<int64_t>& input_splits, int64_t group_size,
                                int64_t input_rows) {
  const int64_t out_rows = check_splits(output_splits, group_size, "output_split_sizes");
  const int64_t total = check_splits(input_splits, group_size, "input_split_sizes");
  if (total != input_rows) {
    throw ShapeError(fmt::format(
        "all_to_all_single: input_split_sizes {} sum to {} but input dimension 0 is {}",
        input_splits, total, input_rows));
  }
  return out_rows;
}

int64_t check_reduce_scatter_input(const Tensor& t, int64_t scatter_dim, int64_t group_size,
                                   std::string_view op, std::string_view suffix) {
  if (scatter_dim == 0) check_contiguous(t, op, suffix);
  if (t.dim() == 0) {
    throw ShapeError(fmt::format("{}: input must have at least one dimension{}", op, suffix));
  }
  const int64_t dim = normalize_dim(scatter_dim, t.dim(), op, "scatter_dim", suffix);
  if (t.size(dim) % group_size != 0) {
    throw ShapeError(
        fmt::format("{}: input dimension {} ({}) must be a multiple of group_size {}{}", op, dim,
                    t.size(dim), group_size, suffix));
  }
  return dim;
}

Shape permute_rows(const Tensor& t) { return t.dim() == 0 ? Shape{1} : t.sizes(); }

PermuteSplits permute_splits(const std::vector<int>& src_dst, int world, int rank,
                             int64_t rows) {
  if (static_cast<int>(src_dst.size()) != world) {
    throw InvalidArgument(fmt::format("permute_tensor: src_dst {} has {} entries, expected "
                                      "group_size {}",
                                      src_dst, src_dst.size(), world));
  }
  std::vector<bool> hit(static_cast<size_t>(world), false);
  for (int dst : src_dst) {
    if (dst < 0 || dst >= world || hit[static_cast<size_t>(dst)]) {
      throw InvalidArgument(fmt::format("permute_tensor: src_dst {} is not a permutation of 0..{}",
                                        src_dst, world - 1));
    }
    hit[static_cast<size_t>(dst)] = true;
  }
  PermuteSplits splits{std::vector<int64_t>(static_cast<size_t>(world), 0),
                       std::vector<int64_t>(static_cast<size_t>(world), 0)};
  for (int m = 0; m < world; ++m) {
    const int dst = src_dst[static_cast<size_t>(m)];
    if (m == rank) splits.in[static_cast<size_t>(dst)] = rows;
    if (dst == rank) splits.out[static_cast<size_t>(m)] = rows;
  }
  return splits;
}

}  // namespace funcol::api_detail
