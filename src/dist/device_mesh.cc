// DeviceMesh: an n-D, row-major arrangement of a group's ranks with one group per named dim.
#include "funcol/dist/device_mesh.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "checks.h"
#include "funcol/core/error.h"
#include "funcol/core/tensor.h"
#include "funcol/dist/work.h"

namespace funcol {

namespace {

std::string describe_dims(const std::vector<std::pair<std::string, int>>& dims) {
  std::vector<std::string> parts;
  for (const auto& [name, size] : dims) parts.push_back(fmt::format("{}={}", name, size));
  return fmt::format("{}", fmt::join(parts, " x "));
}

// The registry names of a dim's groups: the dim's name, then "tp.2", "tp.3", ...
std::string dim_group_name(const std::string& dim, int k) {
  return k == 1 ? dim : fmt::format("{}.{}", dim, k);
}

}  // namespace

DeviceMesh::DeviceMesh(ProcessGroup& parent, const std::vector<std::pair<std::string, int>>& dims)
    : dims_(dims) {
  if (dims.empty()) throw InvalidArgument("DeviceMesh: needs at least one dim");
  int64_t product = 1;
  bool overflow = false;
  for (size_t i = 0; i < dims.size(); ++i) {
    const auto& [name, size] = dims[i];
    if (name.empty()) throw InvalidArgument(fmt::format("DeviceMesh: dim {} has an empty name", i));
    if (size < 1) {
      throw InvalidArgument(fmt::format("DeviceMesh: dim '{}' has size {} (must be >= 1)", name, size));
    }
    for (size_t j = 0; j < i; ++j) {
      if (dims[j].first == name) {
        throw InvalidArgument(fmt::format("DeviceMesh: dim name '{}' is used twice", name));
      }
    }
    overflow = overflow || __builtin_mul_overflow(product, int64_t{size}, &product);
  }
  if (overflow || product != parent.size()) {
    throw InvalidArgument(fmt::format("DeviceMesh: dims {} need {} ranks but group '{}' has {}",
                                      describe_dims(dims),
                                      overflow ? "more than 2^63" : std::to_string(product),
                                      parent.name(), parent.size()));
  }
  ranks_ = parent.global_ranks();
  const int ndims = static_cast<int>(dims.size());
  // Row-major strides: the last dim varies fastest.
  std::vector<int> strides(ndims, 1);
  for (int d = ndims - 2; d >= 0; --d) strides[d] = strides[d + 1] * dims[d + 1].second;
  coordinate_.resize(ndims);
  for (int d = 0; d < ndims; ++d) coordinate_[d] = (parent.rank() / strides[d]) % dims[d].second;

  for (int d = 0; d < ndims; ++d) {
    // One list per combination of the other coordinates, in increasing linear index.
    std::vector<std::vector<int>> lists;
    std::vector<int> mine;
    for (int idx = 0; idx < parent.size(); ++idx) {
      if ((idx / strides[d]) % dims[d].second != 0) continue;
      std::vector<int> list;
      for (int k = 0; k < dims[d].second; ++k) list.push_back(ranks_[idx + k * strides[d]]);
      if (std::find(list.begin(), list.end(), ranks_[parent.rank()]) != list.end()) mine = list;
      lists.push_back(std::move(list));
    }
    // A mesh of the same shape built again reuses its groups; a dim name an earlier mesh gave
    // to groups of other ranks names the new ones "tp.2", "tp.3", ... The ranks decide
    // together: registries differ between ranks once some built meshes over subgroups, and a
    // rank reusing a group while another splits would leave the split waiting.
    // Each rank marks the k (1-62) whose group it has with exactly `mine`; the ranks reuse the
    // smallest k marked on every rank. (A name may be missing on some ranks only, "tp" made by
    // new_group over ranks 0 and 1 say, so no scan may stop at the first missing name.)
    const std::string& name = dims[d].first;
    constexpr int kReuseScan = 62;
    int64_t have = 0;
    for (int k = 1; k <= kReuseScan; ++k) {
      auto g = parent.registry().find(dim_group_name(name, k));
      if (g && g->global_ranks() == mine) have |= int64_t{1} << k;
    }
    if (const int64_t common = dist_detail::and_over_ranks(parent, have, "DeviceMesh")) {
      groups_.push_back(parent.registry().find(dim_group_name(name, __builtin_ctzll(common))));
      continue;
    }
    const std::string fresh = dist_detail::first_free_name(
        parent, [&](int k) { return dim_group_name(name, k); }, "DeviceMesh");
    // Its errors name the call the user made: DeviceMesh, not split_group.
    const dist_detail::SplitCaller caller("DeviceMesh");
    groups_.push_back(parent.split_group(lists, fresh));
  }
}

std::shared_ptr<ProcessGroup> DeviceMesh::group(const std::string& name) const {
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].first == name) return groups_[i];
  }
  std::vector<std::string> names;
  for (const auto& d : dims_) names.push_back(d.first);
  throw InvalidArgument(
      fmt::format("DeviceMesh: unknown dim '{}' (dims: {})", name, fmt::join(names, ", ")));
}

std::shared_ptr<ProcessGroup> DeviceMesh::group(int dim) const {
  // Negative dims count from the last, as PyTorch's (mesh, dim) group specs index a list.
  if (dim < -ndim() || dim >= ndim()) {
    throw InvalidArgument(fmt::format("mesh dim {} is out of range for a {}-d DeviceMesh "
                                      "(expected {} to {})",
                                      dim, ndim(), -ndim(), ndim() - 1));
  }
  return groups_[static_cast<size_t>(dim < 0 ? dim + ndim() : dim)];
}

}  // namespace funcol
