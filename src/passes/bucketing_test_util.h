// Private test helpers of the bucketing passes: a lockstep reference interpreter of every rank,
// so that pass tests can compare outputs bit for bit without a process group.
#pragma once

#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/core/tensor.h"
#include "funcol/graph/graph.h"
#include "funcol/graph/ops.h"

namespace funcol::testing_bucketing {

// The groups of a 4-rank world laid out as the mesh dp=2,tp=2: "world" = {0,1,2,3},
// "tp" = {0,1},{2,3}, "dp" = {0,2},{1,3}. Each group name maps to its partition of the ranks.
inline std::map<std::string, std::vector<std::vector<int>>> mesh_groups_4() {
  return {{"world", {{0, 1, 2, 3}}}, {"tp", {{0, 1}, {2, 3}}}, {"dp", {{0, 2}, {1, 3}}}};
}

// The reduction every backend performs: sources combined in rank order (reduce_buffers).
inline Tensor reduce_ranks(const std::vector<Tensor>& ins, ReduceOp op) {
  std::vector<Tensor> c;
  std::vector<const void*> srcs;
  for (const Tensor& t : ins) {
    c.push_back(t.contiguous());
    srcs.push_back(c.back().data_ptr());
  }
  Tensor out = Tensor::empty(ins[0].sizes(), ins[0].dtype());
  reduce_buffers(op, out.dtype(), out.data_ptr(), srcs.data(), static_cast<int>(srcs.size()),
                 out.numel());
  return out;
}

// Runs `graph` on every rank of `groups`' world in one thread, node by node: compute through
// the op table's CPU kernels (value_kernel's, as the Executor runs them), collectives by combining the ranks' operands (all_reduce,
// all_gather_into_tensor[_packed], reduce_scatter_tensor; others throw). inputs[r] are rank r's
// graph inputs; returns outputs[r]. Every result is checked against its node's type.
inline std::vector<std::vector<Tensor>> simulate(
    const Graph& graph, const std::vector<std::vector<Tensor>>& inputs,
    const std::map<std::string, std::vector<std::vector<int>>>& groups = mesh_groups_4()) {
  const size_t world = inputs.size();
  std::unordered_map<const Value*, std::vector<Tensor>> vals;
  for (size_t i = 0; i < graph.num_inputs(); ++i) {
    std::vector<Tensor>& v = vals[graph.input(i)];
    for (size_t r = 0; r < world; ++r) v.push_back(inputs[r].at(i));
  }
  auto get = [&](const Value* v) -> const std::vector<Tensor>& { return vals.at(v); };
  for (const Node& n : graph.nodes()) {
    const OpDef& op = n.op();
    std::vector<std::vector<Tensor>> res(n.num_results(), std::vector<Tensor>(world));
    if (op.is_collective()) {
      const auto& parts = groups.at(n.attr("group").as_string());
      for (const auto& part : parts) {
        const auto g = static_cast<int64_t>(part.size());
        if (op.attr_index("group_size") >= 0 && n.attr("group_size").as_int() != g) {
          throw InvalidArgument("simulate: group_size mismatch");
        }
        std::vector<Tensor> ins;
        if (op.pack) {
          const Type& t = n.result(0)->type();
          for (int r : part) {
            std::vector<Tensor> ops;
            for (const Value* v : n.operands()) ops.push_back(get(v)[static_cast<size_t>(r)]);
            Tensor slot = Tensor::empty({t.numel() / g}, t.dtype);
            op.pack(ops, n.attrs(), slot);
            ins.push_back(slot);
          }
        } else {
          FUNCOL_CHECK(n.num_operands() == 1, "simulate: coalesced collectives unsupported");
          for (int r : part) ins.push_back(get(n.operand(0))[static_cast<size_t>(r)]);
        }
        const Shape& shape = n.result(0)->shape();
        switch (op.collective) {
          case CollectiveKind::AllReduce: {
            const Tensor out = reduce_ranks(ins, parse_reduce_op(n.attr("reduce_op").as_string()));
            for (int r : part) res[0][static_cast<size_t>(r)] = out.clone();
            break;
          }
          case CollectiveKind::AllGather: {
            std::vector<Tensor> flat;
            for (const Tensor& t : ins) flat.push_back(t.reshape({t.numel()}));
            const Tensor out = Tensor::cat(flat, 0).reshape(shape);
            for (int r : part) res[0][static_cast<size_t>(r)] = out.clone();
            break;
          }
          case CollectiveKind::ReduceScatter: {
            const Tensor full = reduce_ranks(ins, parse_reduce_op(n.attr("reduce_op").as_string()));
            for (size_t j = 0; j < part.size(); ++j) {
              res[0][static_cast<size_t>(part[j])] =
                  full.narrow(0, static_cast<int64_t>(j) * shape[0], shape[0]).clone();
            }
            break;
          }
          default: throw InvalidArgument(fmt::format("simulate: {} unsupported", op.name));
        }
      }
    } else {
      for (size_t r = 0; r < world; ++r) {
        std::vector<Tensor> ins;
        for (const Value* v : n.operands()) ins.push_back(get(v)[r]);
        // As a graph runs (the Executor): a view the operand's layout cannot express copies.
        const KernelFn kernel = value_kernel(op);
        FUNCOL_CHECK(kernel != nullptr, "simulate: an op without a kernel");
        std::vector<Tensor> out = kernel(ins, AttrList(op, n.attr_values()));
        FUNCOL_CHECK(out.size() == n.num_results(), "simulate: result count");
        for (size_t k = 0; k < out.size(); ++k) res[k][r] = out[k];
      }
    }
    for (size_t k = 0; k < n.num_results(); ++k) {
      const Type& t = n.result(k)->type();
      for (size_t r = 0; r < world; ++r) {
        const Tensor& x = res[k][r];
        if (x.dtype() != t.dtype || x.sizes() != t.shape) {
          throw InvalidArgument(fmt::format("simulate: %{} produced {} for type {}", n.name(),
                                            type_str(x.dtype(), x.sizes()), t.str()));
        }
      }
      vals[n.result(k)] = std::move(res[k]);
    }
  }
  std::vector<std::vector<Tensor>> outs(world);
  for (const Value* v : graph.outputs()) {
    for (size_t r = 0; r < world; ++r) outs[r].push_back(get(v)[r]);
  }
  return outs;
}

// Deterministic random inputs for every rank (Tensor::rand: floats in [-1, 1), integers in
// [0, 100)), different per rank and input.
inline std::vector<std::vector<Tensor>> random_inputs(const Graph& graph, size_t world,
                                                      uint64_t seed) {
  std::vector<std::vector<Tensor>> in(world);
  for (size_t r = 0; r < world; ++r) {
    for (size_t i = 0; i < graph.num_inputs(); ++i) {
      const Type& t = graph.input(i)->type();
      in[r].push_back(Tensor::rand(t.shape, t.dtype, seed * 1000003 + r * 1009 + i));
    }
  }
  return in;
}

// True when every output of every rank is bitwise equal; `why` names the first difference.
inline bool same_outputs(const std::vector<std::vector<Tensor>>& a,
                         const std::vector<std::vector<Tensor>>& b, std::string* why) {
  if (a.size() != b.size()) return false;
  for (size_t r = 0; r < a.size(); ++r) {
    if (a[r].size() != b[r].size()) {
      *why = "output counts differ";
      return false;
    }
    for (size_t i = 0; i < a[r].size(); ++i) {
      if (!a[r][i].equal(b[r][i])) {
        *why = fmt::format("rank {} output {}: {} vs {}", r, i, a[r][i].to_string(),
                           b[r][i].to_string());
        return false;
      }
    }
  }
  return true;
}

}  // namespace funcol::testing_bucketing
