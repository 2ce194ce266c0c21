// Finite-difference checks of every gradient rule, collectives included: the joint graph of
// build_joint_graph runs in the executor on 2 and 4 thread ranks and its gradients must match
// central differences of the summed loss of all ranks (f64 inputs): every element on 2 ranks,
// random directions on 4.
#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "funcol/api/autograd.h"
#include "funcol/api/functional.h"
#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/dist/backend.h"
#include "funcol/graph/parser.h"
#include "funcol/passes/autodiff.h"
#include "funcol/runtime/executor.h"

namespace funcol {
namespace {

// $W: world size; $2W: twice it; $S1: a list of W ones; $S2: a list of W twos.
std::string instantiate(std::string ir, int w) {
  auto replace = [&](std::string_view key, const std::string& value) {
    for (size_t p = ir.find(key); p != std::string::npos; p = ir.find(key, p + value.size())) {
      ir.replace(p, key.size(), value);
    }
  };
  auto list = [&](int v) {
    std::vector<int> xs(static_cast<size_t>(w), v);
    return fmt::format("[{}]", fmt::join(xs, ", "));
  };
  replace("$2W", std::to_string(2 * w));
  replace("$W", std::to_string(w));
  replace("$S1", list(1));
  replace("$S2", list(2));
  return ir;
}

struct Mismatch {
  int rank;
  int input;
  int64_t element;
  double analytic;
  double numeric;
};

// Random directions checked per run on more than 2 ranks (see gradcheck).
constexpr int kDirections = 4;

// Checks d(sum over ranks of loss)/d(input) on every rank against central differences. On 2
// ranks every element of every input of every rank is perturbed on its own; on more ranks
// (where each evaluation is a round of collectives over more threads) the check is along
// kDirections random directions of all inputs of all ranks at once: d/dh L(x + h v) against
// the sum over ranks of <grad, v>. Returns the number of comparisons made.
int64_t gradcheck(const std::string& ir, int world_size, double tol = 1e-6) {
  std::unique_ptr<Graph> fwd = parse_graph(ir);
  const std::vector<int> wrt = floating_inputs(*fwd);
  const Graph joint = build_joint_graph(*fwd, wrt);
  std::vector<std::vector<Mismatch>> bad(static_cast<size_t>(world_size));
  std::vector<int64_t> checked(static_cast<size_t>(world_size), 0);
  constexpr double kStep = 1e-6;
  const bool per_element = world_size <= 2;
  run_local(world_size, [&](ProcessGroup& world) {
    const int rank = world.rank();
    const std::vector<Tensor> inputs = make_inputs(*fwd, /*seed=*/11, rank);
    Executor joint_exec(joint, world);
    const std::vector<Tensor> out = joint_exec.run(inputs);
    Executor fwd_exec(*fwd, world);
    auto total_loss = [&](const std::vector<Tensor>& in) {
      const Tensor loss = fwd_exec.run(in)[0];
      return all_reduce(loss, "sum", "world").item<double>();
    };
    auto compare = [&](int input, int64_t element, double a, double numeric) {
      ++checked[rank];
      if (std::abs(a - numeric) > tol * std::max(1.0, std::abs(numeric))) {
        bad[rank].push_back({rank, input, element, a, numeric});
      }
    };
    // The loss of the joint graph is the forward's loss.
    const double l0 = out[0].item<double>();
    const double f0 = fwd_exec.run(inputs)[0].item<double>();
    if (l0 != f0) bad[rank].push_back({rank, -1, 0, l0, f0});
    if (!per_element) {
      for (int d = 0; d < kDirections; ++d) {
        std::vector<Tensor> plus = inputs, minus = inputs;
        double local = 0;
        for (size_t k = 0; k < wrt.size(); ++k) {
          const auto i = static_cast<size_t>(wrt[k]);
          const Tensor v = Tensor::rand(inputs[i].sizes(), DType::F64,
                                        static_cast<uint64_t>(1000 * rank + 10 * d) + i);
          const std::vector<double> vv = v.to_vector<double>();
          const std::vector<double> g = out[1 + k].to_vector<double>();
          for (size_t e = 0; e < vv.size(); ++e) local += g[e] * vv[e];
          const Tensor hv = mul_scalar(v, kStep);
          plus[i] = add(inputs[i], hv);
          minus[i] = sub(inputs[i], hv);
        }
        const double numeric = (total_loss(plus) - total_loss(minus)) / (2 * kStep);
        const double a =
            all_reduce(Tensor::full({}, DType::F64, local), "sum", "world").item<double>();
        if (rank == 0) compare(-1, d, a, numeric);
      }
      return;
    }
    for (size_t k = 0; k < wrt.size(); ++k) {
      const auto i = static_cast<size_t>(wrt[k]);
      const std::vector<double> analytic = out[1 + k].to_vector<double>();
      const int64_t n = inputs[i].numel();
      for (int src = 0; src < world_size; ++src) {
        for (int64_t e = 0; e < n; ++e) {
          double sides[2];
          for (int side = 0; side < 2; ++side) {
            std::vector<Tensor> in = inputs;
            if (rank == src) {
              in[i] = inputs[i].clone();
              static_cast<double*>(in[i].data_ptr())[e] += side == 0 ? kStep : -kStep;
            }
            sides[side] = total_loss(in);
          }
          if (rank != src) continue;
          compare(wrt[k], e, analytic[static_cast<size_t>(e)],
                  (sides[0] - sides[1]) / (2 * kStep));
        }
      }
    }
  });
  int64_t total = 0;
  for (int r = 0; r < world_size; ++r) {
    total += checked[r];
    for (const Mismatch& m : bad[r]) {
      ADD_FAILURE() << fmt::format("rank {} input {} element {} (input -1: direction): analytic "
                                   "{} numeric {}",
                                   m.rank, m.input, m.element, m.analytic, m.numeric);
    }
  }
  return total;
}

class GradCheck : public ::testing::TestWithParam<int> {
 protected:
  int64_t check(std::string_view ir) {
    return gradcheck(instantiate(std::string(ir), GetParam()), GetParam());
  }
  // What check() compares for inputs of `elements` elements per rank in all.
  int64_t expected(int64_t elements) const {
    return GetParam() <= 2 ? elements * GetParam() : kDirections;
  }
};

TEST_P(GradCheck, Elementwise) {
  EXPECT_EQ(check(R"(graph @g(%a: f64[2,3], %b: f64[2,3], %t: f64[2,3]) {
    %two = full() {shape = [2, 3], dtype = f64, value = 2.0}
    %den = add(%b, %two)
    %q = div(%a, %den)
    %m = mul(%q, %b)
    %s = sub(%m, %a)
    %n = neg(%s)
    %r = relu(%n)
    %c = clone(%r)
    %u = add(%c, %q)
    %l = mse_loss(%u, %t)
    return %l
  })"),
            expected(3 * 6));
}

TEST_P(GradCheck, ViewsAndCopies) {
  EXPECT_EQ(check(R"(graph @g(%a: f64[2,6], %b: f64[3,4]) {
    %v = view(%a) {shape = [3, 4]}
    %r = reshape(%b) {shape = [4, -1]}
    %t = transpose(%r) {dim0 = 0, dim1 = 1}
    %p = permute(%v) {dims = [1, 0]}
    %pt = transpose(%p) {dim0 = -1, dim1 = 0}
    %c = cat(%t, %pt) {dim = 1}
    %s:2 = split_with_sizes(%c) {split_sizes = [3, 5], dim = -1}
    %n = narrow(%s#1) {dim = 1, start = -4, length = 3}
    %m = mul(%n, %s#0)
    %f = flatten(%m)
    %ce = convert_element_type(%f) {dtype = f64}
    %e = mul(%ce, %ce)
    %l = sum(%e)
    return %l
  })"),
            expected(2 * 12));
}

// An input of type [0] joins a concatenation of any rank (PyTorch's legacy rule) and gets an
// empty gradient; the others get theirs.
TEST_P(GradCheck, CatSkipsLegacyEmptyInputs) {
  EXPECT_EQ(check(R"(graph @g(%e: f64[0], %a: f64[2,3], %b: f64[2,1]) {
    %c = cat(%e, %a, %e, %b) {dim = 1}
    %m = mul(%c, %c)
    %l = sum(%m)
    return %l
  })"),
            expected(8));
}

// A split result nobody uses gets zeros in the concatenated gradient; narrow pads both sides.
TEST_P(GradCheck, UnusedSplitAndNarrowPadding) {
  EXPECT_EQ(check(R"(graph @g(%a: f64[5,2]) {
    %s:3 = split_with_sizes(%a) {split_sizes = [1, 3, 1]}
    %n = narrow(%s#1) {dim = 0, start = 1, length = 1}
    %m = mul(%n, %n)
    %l = sum(%m)
    return %l
  })"),
            expected(10));
}

TEST_P(GradCheck, ReductionsMatmulAndExpand) {
  EXPECT_EQ(check(R"(graph @g(%a: f64[2,3,4], %w: f64[4,2], %z: f64[]) {
    %s1 = sum(%a) {dims = [2], keepdim = true}
    %m1 = mean(%a) {dims = [0, -1]}
    %e = expand(%s1) {shape = [2, 3, 4]}
    %x = mul(%e, %a)
    %f = reshape(%x) {shape = [6, 4]}
    %mm = matmul(%f, %w)
    %rb = relu_backward(%mm, %mm)
    %l1 = mean(%rb)
    %l2 = sum(%m1)
    %ez = expand(%z) {shape = [3]}
    %zm = mul(%ez, %m1)
    %l3 = sum(%zm) {dims = [0], keepdim = true}
    %l3s = reshape(%l3) {shape = []}
    %l12 = add(%l1, %l2)
    %l = add(%l12, %l3s)
    return %l
  })"),
            expected(24 + 8 + 1));
}

TEST_P(GradCheck, Collectives) {
  EXPECT_EQ(check(R"(graph @g(%x: f64[2,3], %w: f64[4,3], %y: f64[$2W,2], %c: f64[2,3]) {
    %ag = all_gather_into_tensor(%x) {group_size = $W, group = "world"}
    %agw = wait_tensor(%ag)
    %rs = reduce_scatter_tensor(%agw) {reduce_op = "sum", group_size = $W, group = "world"}
    %rsw = wait_tensor(%rs)
    %ar = all_reduce(%w) {reduce_op = "sum", group = "world"}
    %arw = wait_tensor(%ar)
    %a2a = all_to_all_single(%y) {output_split_sizes = $S2, input_split_sizes = $S2, group = "world"}
    %a2aw = wait_tensor(%a2a)
    %rc = mul(%rsw, %c)
    %p = mul(%rsw, %rc)
    %l1 = sum(%p)
    %q = mul(%arw, %w)
    %l2 = mean(%q)
    %y2 = mul(%a2aw, %a2aw)
    %y3 = mul(%y2, %a2aw)
    %l3 = sum(%y3)
    %l12 = add(%l1, %l2)
    %l = add(%l12, %l3)
    return %l
  })"),
            expected(6 + 12 + 4 * GetParam() + 6));
}

// Coalesced collectives; %c only reaches a result nobody uses, so its gradient is zeros.
TEST_P(GradCheck, CoalescedCollectives) {
  EXPECT_EQ(check(R"(graph @g(%x: f64[2,3], %w: f64[4,2], %c: f64[2,3]) {
    %arc:2 = all_reduce_coalesced(%x, %w) {reduce_op = "sum", group = "world"}
    %a0 = wait_tensor(%arc#0)
    %a1 = wait_tensor(%arc#1)
    %agc:2 = all_gather_into_tensor_coalesced(%a0, %c) {group_size = $W, group = "world"}
    %g0 = wait_tensor(%agc#0)
    %g1 = wait_tensor(%agc#1)
    %rsc:2 = reduce_scatter_tensor_coalesced(%g0, %g1) {reduce_op = "sum", group_size = $W, group = "world"}
    %r0 = wait_tensor(%rsc#0)
    %r1 = wait_tensor(%rsc#1)
    %p = mul(%r0, %r0)
    %pp = mul(%p, %x)
    %l1 = sum(%pp)
    %q = mul(%a1, %a1)
    %l2 = mean(%q)
    %l = add(%l1, %l2)
    return %l
  })"),
            expected(6 + 8 + 6));
}

// The FSDP pattern of `funcol train`: sharded weights gathered for a two-layer MLP, in `dtype`
// ($W and $2W still to instantiate).
std::string sharded_mlp(const std::string& dtype) {
  return fmt::format(R"(graph @g(%x: {0}[4,$2W], %w1: {0}[2,3], %w2: {0}[1,3], %t: {0}[4,$W]) {{
    %ag1 = all_gather_into_tensor(%w1) {{group_size = $W, group = "world"}}
    %w1f = wait_tensor(%ag1)
    %h = matmul(%x, %w1f)
    %a = relu(%h)
    %ag2 = all_gather_into_tensor(%w2) {{group_size = $W, group = "world"}}
    %w2f = wait_tensor(%ag2)
    %w2t = transpose(%w2f) {{dim0 = 0, dim1 = 1}}
    %y = matmul(%a, %w2t)
    %l = mse_loss(%y, %t)
    return %l
  }})",
                     dtype);
}

// Gradients of the weight shards through their gathers.
TEST_P(GradCheck, ShardedMlp) {
  EXPECT_EQ(check(sharded_mlp("f64")),
            expected(8 * GetParam() + 6 + 3 + 4 * GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Ranks, GradCheck, ::testing::Values(2, 4),
                         [](const auto& info) { return fmt::format("ranks{}", info.param); });

// A non-sum reduce op: the forward builds and runs; autodiff through it fails naming op, reduce
// op and node, as PyTorch fails at backward time.
TEST(AutodiffNonSum, ForwardRunsBackwardFails) {
  const char* ir = R"(graph @g(%x: f64[4], %y: f64[4]) {
    %ar = all_reduce(%x) {reduce_op = "max", group = "world"}
    %w = wait_tensor(%ar)
    %m = mul(%w, %y)
    %l = sum(%m)
    return %l
  })";
  std::unique_ptr<Graph> fwd = parse_graph(ir);
  run_local(2, [&](ProcessGroup& world) {
    Executor exec(*fwd, world);
    EXPECT_EQ(exec.run(make_inputs(*fwd, 1, world.rank())).size(), 1u);
  });
  // Only %y differentiated: the max all_reduce is not on the way, so no error.
  const Graph joint = build_joint_graph(*fwd, {1});
  EXPECT_EQ(joint.outputs().size(), 2u);
  try {
    (void)build_joint_graph(*fwd, {0});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "all_reduce backward only supports 'sum' reduction, got 'max' (node "
                           "%ar at <input>:2:5)");
  }
}

// The eager tape and the autodiff pass apply the same rules: the same MLP step differentiated
// both ways gives bit-identical gradients on every rank.
TEST(AutodiffEagerAgreement, TapeMatchesJointGraphBitForBit) {
  constexpr int kRanks = 4;
  const std::string ir = instantiate(sharded_mlp("f32"), kRanks);
  std::unique_ptr<Graph> fwd = parse_graph(ir);
  const Graph joint = build_joint_graph(*fwd, {1, 2});
  std::vector<int> compared(kRanks, 0);
  run_local(kRanks, [&](ProcessGroup& world) {
    const std::vector<Tensor> in = make_inputs(*fwd, /*seed=*/5, world.rank());
    Executor exec(joint, world);
    const std::vector<Tensor> out = exec.run(in);

    GradTape tape;
    const Tensor w1 = tape.requires_grad(in[1]);
    const Tensor w2 = tape.requires_grad(in[2]);
    auto one = [&](std::string_view op, std::vector<Tensor> xs, const NamedAttrs& attrs = {}) {
      return tape.call_one(op, xs, attrs);
    };
    const Tensor w1f = all_gather_tensor_autograd(w1, 0, "world");
    const Tensor a = one("relu", {one("matmul", {in[0], w1f})});
    const Tensor w2f = all_gather_tensor_autograd(w2, 0, "world");
    const Tensor y = one("matmul", {a, one("transpose", {w2f}, {{"dim0", 0}, {"dim1", 1}})});
    const Tensor loss = one("mse_loss", {y, in[3]});
    tape.backward(loss);
    if (loss.to_vector<float>() == out[0].to_vector<float>() &&
        tape.grad(w1).to_vector<float>() == out[1].to_vector<float>() &&
        tape.grad(w2).to_vector<float>() == out[2].to_vector<float>()) {
      compared[world.rank()] = 1;
    }
  });
  EXPECT_EQ(compared, std::vector<int>(kRanks, 1));
}

}  // namespace
}  // namespace funcol
