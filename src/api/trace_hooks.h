// Recording forms of the functional collectives, used while a tracer is current (api-private).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/api/functional.h"
#include "funcol/graph/tracer.h"

namespace funcol::api_detail {

// Each records the collective's node(s) and a wait_tensor per result into `tr` (PyTorch's
// funcol waits at once under tracing, so graphs hold explicit collective -> wait pairs) and
// returns the waited traced tensors. Arguments are checked as the eager functions check them;
// group names resolve through the tracer's declared groups, then the calling rank's registry.
Tensor trace_all_reduce(Tracer& tr, const Tensor& t, const std::string& reduce_op,
                        const GroupSpec& group);
Tensor trace_all_gather_tensor(Tracer& tr, const Tensor& t, int64_t gather_dim,
                               const GroupSpec& group);
Tensor trace_reduce_scatter_tensor(Tracer& tr, const Tensor& t, const std::string& reduce_op,
                                   int64_t scatter_dim, const GroupSpec& group);
Tensor trace_all_to_all_single(Tracer& tr, const Tensor& t,
                               const std::optional<std::vector<int64_t>>& output_split_sizes,
                               const std::optional<std::vector<int64_t>>& input_split_sizes,
                               const GroupSpec& group);
Tensor trace_broadcast(Tracer& tr, const Tensor& t, int src, const GroupSpec& group);
std::vector<Tensor> trace_all_reduce_coalesced(Tracer& tr, const std::vector<Tensor>& inputs,
                                               const std::string& reduce_op,
                                               const GroupSpec& group);
std::vector<Tensor> trace_all_gather_into_tensor_coalesced(Tracer& tr,
                                                           const std::vector<Tensor>& inputs,
                                                           const GroupSpec& group);
std::vector<Tensor> trace_reduce_scatter_tensor_coalesced(Tracer& tr,
                                                          const std::vector<Tensor>& inputs,
                                                          const std::string& reduce_op,
                                                          const std::vector<int64_t>& scatter_dims,
                                                          const GroupSpec& group);
// The size of the group `group` names while tracing (declared, or the calling rank's).
int traced_group_size(Tracer& tr, const GroupSpec& group, std::string_view op);

// permute_tensor's split sizes depend on the calling rank: it records this rank's
// all_to_all_single (a graph of this rank, as PyTorch traces it). InvalidArgument when traced
// outside a rank of the group (a group only declared to the tracer).
Tensor trace_permute_tensor(Tracer& tr, const Tensor& t, const std::vector<int>& src_dst,
                            const GroupSpec& group);

}  // namespace funcol::api_detail
