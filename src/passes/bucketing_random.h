// Private test helpers of the bucketing passes: RapidCheck generators of random graphs of
// collectives and compute, of random pass pipelines (used inside rc properties only), and the
// gtest wrapper that runs a property.
#pragma once

#include <gtest/gtest.h>
#include <rapidcheck.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "funcol/graph/graph.h"
#include "funcol/graph/verifier.h"

namespace funcol::testing_bucketing {

// CI runs at least this many cases per property (RC_PARAMS may ask for more).
constexpr int kMinCases = 1000;

// Runs a RapidCheck property inside a gtest with at least `min_cases` successes.
template <typename Testable>
void check_property(Testable&& testable, int min_cases = kMinCases) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  rc::detail::TestMetadata metadata;
  metadata.id = std::string(info->test_suite_name()) + "/" + info->name();
  metadata.description = info->name();
  rc::detail::TestParams params = rc::detail::configuration().testParams;
  params.maxSuccess = std::max(params.maxSuccess, min_cases);
  const auto result = rc::detail::checkTestable(std::forward<Testable>(testable), metadata, params);
  if (!result.template is<rc::detail::SuccessResult>()) {
    std::ostringstream ss;
    rc::detail::printResultMessage(result, ss);
    FAIL() << ss.str();
  }
}

template <typename T>
const T& pick(const std::vector<T>& v) {
  return v[static_cast<size_t>(*rc::gen::inRange<size_t>(0, v.size()))];
}

inline bool chance(int one_in) { return *rc::gen::inRange(0, one_in) == 0; }

// A random graph: inputs of assorted dtypes and shapes; all-gathers (some fed by casts, some
// casts with a second user), reduce-scatters and all-reduces on three groups with assorted
// reduce ops; waits issued at once or later in random order (so wait order differs from issue
// order and consumers of early waits precede later inputs); collectives whose result has a
// second user; compute (neg, add, flatten, casts) on any value, so later collectives depend
// on earlier ones; pairs of all-gathers that cannot merge without swapping two collectives
// that stay unmerged (see the motif); a user's fused collective over a cat whose wait a split
// reads, as a bucket's (FSDP's flat parameter, DDP's fused all-reduce). Every value nobody
// uses is an output, but for some waits' results. With `one_key`, every value is f32 and every
// collective is on the world group with reduce op sum, so that runs are long and buckets have
// many members: the case where no place fits a bucket between its inputs and its consumers (a
// region to reorder) comes up often instead of rarely.
inline std::unique_ptr<Graph> random_graph(bool one_key = false) {
  static const std::vector<DType> kAllDtypes = {DType::F32, DType::BF16, DType::F16, DType::I32,
                                                DType::I64, DType::U8,   DType::I8,  DType::Bool};
  static const std::vector<Shape> kShapes = {{4}, {8}, {4, 2}, {8, 3}, {}, {0, 2}, {4, 1, 3}, {12}};
  static const std::vector<std::string> kAllGroups = {"world", "tp", "dp"};
  static const std::vector<std::string> kAllOps = {"sum", "avg", "max", "min", "product"};
  static const std::vector<DType> kF32 = {DType::F32};
  static const std::vector<std::string> kWorld = {"world"};
  static const std::vector<std::string> kSum = {"sum"};
  const std::vector<DType>& kDtypes = one_key ? kF32 : kAllDtypes;
  const std::vector<std::string>& kGroups = one_key ? kWorld : kAllGroups;
  const std::vector<std::string>& kOps = one_key ? kSum : kAllOps;
  // The ranks of each group on the 4 the properties simulate.
  auto group_size = [](const std::string& group) -> int64_t { return group == "world" ? 4 : 2; };
  auto g = std::make_unique<Graph>("rand");
  Builder b(*g);
  std::vector<Value*> pool;
  const int inputs = *rc::gen::inRange(1, 5);
  for (int i = 0; i < inputs; ++i) {
    pool.push_back(g->add_input("in" + std::to_string(i), Type(pick(kDtypes), pick(kShapes))));
  }
  std::vector<Node*> pending;
  const int steps = *rc::gen::inRange(1, one_key ? 50 : 30);
  for (int s = 0; s < steps; ++s) {
    const int what = *rc::gen::inRange(0, 12);
    if (what == 11) {
      // A user's fused collective: flat parts of one dtype concatenated, gathered or reduced,
      // and split back (through the [G, n] view for an all-gather), the shape of a bucket.
      const DType dtype = pick(pool)->dtype();
      std::vector<Value*> parts;
      std::vector<int64_t> sizes;
      const int k = *rc::gen::inRange(1, 4);
      for (int i = 0; i < k; ++i) {
        Value* v = pick(pool);
        if (v->type().rank() == 0) continue;
        if (v->dtype() != dtype) v = b.value("convert_element_type", {v}, {{"dtype", dtype}});
        if (v->type().rank() != 1) v = b.value("flatten", {v});
        parts.push_back(v);
        sizes.push_back(v->type().numel());
      }
      if (parts.empty()) continue;
      const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
      Value* packed = b.value("cat", parts, {{"dim", 0}});
      const std::string& group = pick(kGroups);
      const int64_t gs = group_size(group);
      const bool gather = dtype == DType::Bool || chance(2);
      Node* coll = gather ? b.create("all_gather_into_tensor", {packed},
                                     {{"group_size", gs}, {"group", group}})
                          : b.create("all_reduce", {packed},
                                     {{"reduce_op", pick(kOps)}, {"group", group}});
      Value* w = b.value("wait_tensor", {coll->result(0)});
      if (gather) w = b.value("view", {w}, {{"shape", std::vector<int64_t>{gs, total}}});
      Node* split = b.create("split_with_sizes", {w},
                             {{"split_sizes", sizes}, {"dim", int64_t{gather ? 1 : 0}}});
      for (size_t i = 0; i < split->num_results(); ++i) pool.push_back(split->result(i));
    } else if (what == 10) {
      // The issue-order motif: all-gathers whose waits each feed another collective at once,
      // then collectives issued after those that feed as many all-gathers of the same key.
      // Merging an all-gather of the first kind with one of the second would swap two
      // collectives between them, which stay unmerged, so a bucket holding both kinds drops
      // some (and tries the dropped ones again: they merge among themselves).
      Value* v = pick(pool);
      const std::string& group = pick(kGroups);
      const int64_t gs = group_size(group);
      auto other = [&](Value* in) {  // a collective of another kind where the dtype allows
        if (in->dtype() == DType::Bool) {
          return b.create("all_gather_into_tensor", {in}, {{"group_size", gs}, {"group", group}});
        }
        return b.create("all_reduce", {in}, {{"reduce_op", pick(kOps)}, {"group", group}});
      };
      const int pairs = *rc::gen::inRange(1, 4);
      for (int i = 0; i < pairs; ++i) {
        Node* first =
            b.create("all_gather_into_tensor", {v}, {{"group_size", gs}, {"group", group}});
        Node* use = other(b.value("wait_tensor", {first->result(0)}));
        pool.push_back(b.value("wait_tensor", {use->result(0)}));
      }
      for (int i = 0; i < pairs; ++i) {
        Value* fed = b.value("wait_tensor", {other(v)->result(0)});
        pending.push_back(
            b.create("all_gather_into_tensor", {fed}, {{"group_size", gs}, {"group", group}}));
      }
    } else if (what < 5) {
      Value* v = pick(pool);
      const std::string& group = pick(kGroups);
      const int64_t gs = group_size(group);
      int kind = *rc::gen::inRange(0, 3);  // 0 all-gather, 1 reduce-scatter, 2 all-reduce
      const bool is_bool = v->dtype() == DType::Bool;
      if (kind == 1 && (v->type().rank() == 0 || v->shape()[0] % gs != 0)) kind = 2;
      if (is_bool) kind = 0;
      Node* coll;
      if (kind == 0) {
        if (chance(3)) {
          v = b.value("convert_element_type", {v}, {{"dtype", pick(kDtypes)}});
          if (chance(4)) pool.push_back(v);  // a second user: the cast is not folded
        }
        coll = b.create("all_gather_into_tensor", {v}, {{"group_size", gs}, {"group", group}});
      } else if (kind == 1) {
        coll = b.create("reduce_scatter_tensor", {v},
                        {{"reduce_op", pick(kOps)}, {"group_size", gs}, {"group", group}});
      } else {
        coll = b.create("all_reduce", {v}, {{"reduce_op", pick(kOps)}, {"group", group}});
      }
      if (chance(8)) pool.push_back(b.value("clone", {coll->result(0)}));  // ineligible
      if (chance(3)) {
        pool.push_back(b.value("wait_tensor", {coll->result(0)}));
      } else {
        pending.push_back(coll);
      }
    } else if (what < 7 && !pending.empty()) {
      const auto i = *rc::gen::inRange<size_t>(0, pending.size());
      pool.push_back(b.value("wait_tensor", {pending[i]->result(0)}));
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      Value* v = pick(pool);
      const int op = *rc::gen::inRange(0, 4);
      if (v->dtype() == DType::Bool || op == 0) {
        pool.push_back(b.value("clone", {v}));
      } else if (op == 1) {
        pool.push_back(b.value("add", {v, v}));
      } else if (op == 2 && v->type().rank() >= 1) {
        pool.push_back(b.value("flatten", {v}));
      } else {
        pool.push_back(b.value("convert_element_type", {v}, {{"dtype", pick(kDtypes)}}));
      }
    }
  }
  while (!pending.empty()) {
    const auto i = *rc::gen::inRange<size_t>(0, pending.size());
    pool.push_back(b.value("wait_tensor", {pending[i]->result(0)}));
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
  }
  // Now and then a wait's result that nobody uses is left out of the outputs too (a bucket's
  // piece nobody reads), as long as something is returned.
  for (size_t i = 0; i < pool.size(); ++i) {
    Value* v = pool[i];
    if (v->has_uses()) continue;
    const bool last = i + 1 == pool.size();
    if (!last && v->node() != nullptr && v->node()->op_name() == "wait_tensor" && chance(4)) {
      continue;
    }
    g->add_output(v);
  }
  verify(*g);
  return g;
}

// One pass of a pipeline: a bucketing pass with random options, or (when allowed) dce. Without
// allow_packed, all-gathers are never packed by all_gather_into_tensor_packed (custom_ops
// modes), for executors that cannot run it.
inline std::string random_pass(bool allow_dce, bool allow_packed = true) {
  static const std::vector<std::string> kCaps = {
      "0.0001", "0.0005", "0.0001:0.001", "2000", "0.00005:0.0002:2000", "0.000244140625"};
  static const std::vector<std::string> kAgModes = {"default", "custom_ops", "multidtype",
                                                    "custom_ops_multidtype"};
  static const std::vector<std::string> kModes = {"default", "custom_ops"};
  static const std::vector<std::string> kUnpackedAgModes = {"default", "multidtype"};
  switch (*rc::gen::inRange(0, allow_dce ? 4 : 3)) {
    case 0:
      return "bucket-all-gather{cap-mb=" + pick(kCaps) +
             " mode=" + pick(allow_packed ? kAgModes : kUnpackedAgModes) + "}";
    case 1: return "bucket-reduce-scatter{cap-mb=" + pick(kCaps) + " mode=" + pick(kModes) + "}";
    case 2: return "bucket-all-reduce{cap-mb=" + pick(kCaps) + " mode=" + pick(kModes) + "}";
    default: return "dce";
  }
}

inline std::string random_pipeline(bool allow_packed = true) {
  const int n = *rc::gen::inRange(1, 5);
  std::string p;
  for (int i = 0; i < n; ++i) p += (i ? "," : "") + random_pass(/*allow_dce=*/true, allow_packed);
  return p;
}

}  // namespace funcol::testing_bucketing
