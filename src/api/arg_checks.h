// Argument checks the eager functional collectives and their recording forms (trace_hooks.cc)
// share, so that a traced call refuses what the eager call refuses, with the same message.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"

namespace funcol::api_detail {

// dim in [-n, n) with n = max(ndim, 1) (a 0-d tensor accepts 0 and -1, as torch does);
// ShapeError "<op>: <arg> 5 is out of range for a 2-d input (expected -2..1)" otherwise.
int64_t normalize_dim(int64_t dim, int64_t ndim, std::string_view op, std::string_view arg,
                      std::string_view suffix = {});

// The seed's "Tensor must be contiguous for <op><suffix>" (InvalidArgument); the native ops
// require contiguous buffers. Traced tensors of views carry their eager layout, so this holds
// for them too.
void check_contiguous(const Tensor& t, std::string_view op, std::string_view suffix = {});

// " for tensor at index 3", the suffix of a coalesced list's messages.
std::string index_suffix(size_t i);

// check_reduce_op_dtype for `t`; `suffix` names the entry of a coalesced list (index_suffix).
void check_reduce_op_for(ReduceOp op, const Tensor& t, std::string_view op_name,
                         std::string_view suffix = {});

// reduce_scatter_tensor_coalesced's scatter_dims: one per input (InvalidArgument otherwise).
void check_scatter_dims_count(size_t scatter_dims, size_t inputs);

// all_to_all_single's split sizes (`name` is "output_split_sizes" or "input_split_sizes"):
// group_size entries, none negative (InvalidArgument). Returns their sum.
int64_t check_splits(const std::vector<int64_t>& splits, int64_t group_size,
                     std::string_view name);
// all_to_all_single's input split sizes against the input's rows (ShapeError); both lists must
// have passed check_splits. Returns the output's rows, the output splits' sum.
int64_t check_all_to_all_splits(const std::vector<int64_t>& output_splits,
                                const std::vector<int64_t>& input_splits, int64_t group_size,
                                int64_t input_rows);

// A reduce_scatter input: at least 1-d, size(dim) divisible by the group size, contiguous when
// scattered along dim 0 (the seed sends only that one as is; any other scatter_dim goes through
// its chunk + cat copy first). Returns the normalized scatter dim.
int64_t check_reduce_scatter_input(const Tensor& t, int64_t scatter_dim, int64_t group_size,
                                   std::string_view op, std::string_view suffix);

// The shape permute_tensor exchanges `t` in: its own, a 0-d tensor as [1] (rows of dim 0).
Shape permute_rows(const Tensor& t);
// permute_tensor's all_to_all_single split sizes for `rank` of a group of `world` ranks, as the
// seed builds them: everything (`rows` rows) goes to src_dst[rank] and comes from the m with
// src_dst[m] == rank. InvalidArgument when src_dst is not a permutation of 0..world-1.
struct PermuteSplits {
  std::vector<int64_t> out, in;
};
PermuteSplits permute_splits(const std::vector<int>& src_dst, int world, int rank,
                             int64_t rows);

}  // namespace funcol::api_detail
