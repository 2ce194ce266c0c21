// The eager tape's side of the plain functional collectives (api-private). PyTorch registers
// the collectives' autograd rules on the base ops, so a plain collective whose input a GradTape
// tracks is recorded on that tape, as its *_autograd variant records it; the forms without a
// public *_autograd variant are here.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "funcol/api/functional.h"
#include "funcol/core/tensor.h"

namespace funcol::api_detail {

// True when a live GradTape tracks any of `ts`.
bool any_tracked(std::span<const Tensor> ts);

// broadcast of a tracked input: runs it and records it, so a backward that reaches it fails
// with broadcast's error (PyTorch defines no gradient for it) instead of dropping the path.
Tensor tape_broadcast(const Tensor& t, int src, const GroupSpec& group);
// permute_tensor of a tracked input, as the seed computes it: the flattened input through
// all_to_all_single with these split sizes (recorded), viewed back to t's shape.
Tensor tape_permute(const Tensor& t, const std::vector<int64_t>& output_split_sizes,
                    const std::vector<int64_t>& input_split_sizes, const GroupSpec& group);
// reduce_scatter_tensor_coalesced of tracked inputs along any scatter dims: each input's
// scatter dim moved to the front (split + cat, recorded) as reduce_scatter_tensor_autograd
// does, then the coalesced collective and its waits.
std::vector<Tensor> tape_reduce_scatter_coalesced(const std::vector<Tensor>& inputs,
                                                  const std::string& reduce_op,
                                                  const std::vector<int64_t>& scatter_dims,
                                                  const GroupSpec& group);

}  // namespace funcol::api_detail
