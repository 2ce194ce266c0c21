// Synchronous argument checks shared by every backend's ProcessGroup primitives.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"

namespace funcol::dist_detail {

// A defined, non-meta, contiguous tensor; InvalidArgument naming `op` and `what` otherwise.
void check_buffer(std::string_view op, const Tensor& t, std::string_view what);
// InvalidArgument unless both dtypes are equal.
void check_same_dtype(std::string_view op, const Tensor& a, std::string_view a_name,
                      const Tensor& b, std::string_view b_name);
// Bitwise ops need integer or bool; avg is rejected on bool (as PyTorch's NCCL backend does:
// "cannot use avg with boolean inputs"); integer avg truncates toward zero.
void check_reduce(std::string_view op, ReduceOp reduce_op, DType dtype);

void check_all_reduce(const Tensor& tensor, ReduceOp reduce_op);
// output.numel() == group_size * input.numel(), equal dtypes.
void check_all_gather(const Tensor& output, const Tensor& input, int group_size);
// input.numel() == group_size * output.numel(), equal dtypes.
void check_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp reduce_op,
                          int group_size);
void check_broadcast(const Tensor& tensor, int src, int group_size);

// The all_to_all layout in rows of dim 0 (a row holds numel / dim0 elements).
struct AllToAllLayout {
  std::vector<int64_t> output_splits;  // rows from each rank
  std::vector<int64_t> input_splits;   // rows to each rank
  int64_t row_elems = 0;               // elements per row (product of dims 1..)
};
// Checks the tensors and splits and fills in an even split when both lists are empty.
AllToAllLayout check_all_to_all(const Tensor& output, const Tensor& input,
                                const std::vector<int64_t>& output_splits,
                                const std::vector<int64_t>& input_splits, int group_size);

// Coalesced forms: equal list lengths, each pair checked as the single-tensor form.
void check_coalesced_lists(std::string_view op, size_t outputs, size_t inputs);
// all_reduce_coalesced_into: equal list lengths; every tensor contiguous, each output with its
// input's dtype and numel; no output overlaps another output or an input other than its own
// (identical bytes: in place).
void check_all_reduce_into(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                           ReduceOp reduce_op);

// "[0, 2, 3]".
std::string format_ranks(const std::vector<int>& ranks);

}  // namespace funcol::dist_detail
