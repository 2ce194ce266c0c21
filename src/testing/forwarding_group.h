// A ProcessGroup that forwards the primitives to another group and keeps the base class's
// coalesced defaults, for tests of those defaults and of what callers decide from a group's
// properties (subclass it to override fuses_coalesced() and friends).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "funcol/dist/process_group.h"

namespace funcol::testing {

class ForwardingGroup : public ProcessGroup {
 public:
  explicit ForwardingGroup(ProcessGroup& inner, std::string name = {})
      : ProcessGroup(inner.rank(), inner.global_ranks(), name.empty() ? inner.name() : name,
                     &inner.registry()),
        inner_(inner) {}
  std::string backend() const override { return "forwarding"; }
  std::shared_ptr<Work> all_reduce(const Tensor& t, ReduceOp op) override {
    return inner_.all_reduce(t, op);
  }
  std::shared_ptr<Work> all_gather(const Tensor& o, const Tensor& i) override {
    return inner_.all_gather(o, i);
  }
  std::shared_ptr<Work> reduce_scatter(const Tensor& o, const Tensor& i, ReduceOp op) override {
    return inner_.reduce_scatter(o, i, op);
  }
  std::shared_ptr<Work> all_to_all(const Tensor& o, const Tensor& i,
                                   const std::vector<int64_t>& os,
                                   const std::vector<int64_t>& is) override {
    return inner_.all_to_all(o, i, os, is);
  }
  std::shared_ptr<Work> broadcast(const Tensor& t, int src) override {
    return inner_.broadcast(t, src);
  }
  std::shared_ptr<Work> barrier_async() override { return inner_.barrier_async(); }
  std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& lists,
                                            const std::string& name) override {
    return inner_.split_group(lists, name);
  }

 private:
  ProcessGroup& inner_;
};

}  // namespace funcol::testing
