// The eager tape's side of the plain functional collectives (api-private). PyTorch registers
// the collectives' autograd rules on the base ops, so a plain collective whose input a GradTape
// tracks is recorded on that tape, as its *_autograd variant records it; the forms without a
// public *_autograd variant are here.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/api/functional.h"
#include "funcol/core/tensor.h"

namespace funcol::api_detail {

// True when a live GradTape tracks `t`: the plain collective `op` records itself then. An
// untracked view of a tracked tensor (made by a Tensor method, which no tape records) is
// refused (InvalidArgument): taken as a constant, it would lose its gradient without a word.
bool tape_input(const Tensor& t, std::string_view op);
// The same for a coalesced form's inputs: true when any is tracked.
bool tape_inputs(std::span<const Tensor> ts, std::string_view op);

// While one lives on a thread, tape_input(s) lets untracked views pass: the in-place
// collectives (they write into their tensor, and a leaf may be written between uses) and the
// tape's own backward.
class UntrackedViewsAllowed {
 public:
  UntrackedViewsAllowed();
  ~UntrackedViewsAllowed();
  UntrackedViewsAllowed(const UntrackedViewsAllowed&) = delete;
  UntrackedViewsAllowed& operator=(const UntrackedViewsAllowed&) = delete;
};

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
