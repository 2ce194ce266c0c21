// DeviceMesh: an n-D, row-major arrangement of ranks with named dimensions.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "funcol/dist/process_group.h"

namespace funcol {

// An n-D mesh over a parent group's ranks, row-major: for dp=2,tp=2 over 4 ranks, rank
// r = dp_index * 2 + tp_index. Constructing it is collective over the parent: it creates one
// group per dim (this rank's slice along that dim) and registers it under the dim's name, or
// "tp.2", "tp.3", ... when an earlier mesh gave that name to groups of other ranks (group(name)
// takes the dim's name either way). A mesh of the same shape built again reuses its groups.
class DeviceMesh {
 public:
  // dims: (name, size) pairs; the product must equal parent.size(); names must be unique.
  DeviceMesh(ProcessGroup& parent, const std::vector<std::pair<std::string, int>>& dims);

  int ndim() const { return static_cast<int>(dims_.size()); }
  const std::vector<std::pair<std::string, int>>& dims() const { return dims_; }
  // This rank's group along a dim, by name or index (a negative index counts from the last
  // dim, as in Python). Throws InvalidArgument when unknown.
  std::shared_ptr<ProcessGroup> group(const std::string& name) const;
  std::shared_ptr<ProcessGroup> group(int dim) const;
  // This rank's coordinate along each dim.
  const std::vector<int>& coordinate() const { return coordinate_; }
  // Global ranks of the whole mesh in row-major order.
  const std::vector<int>& ranks() const { return ranks_; }

 private:
  std::vector<std::pair<std::string, int>> dims_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
  std::vector<int> coordinate_;
  std::vector<int> ranks_;
};

}  // namespace funcol
