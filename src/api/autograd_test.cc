// The eager autograd tape and the *_autograd collectives: gradients against central
// differences on 2 and 4 thread ranks, the non-sum backward error, and the tape's contract.
#include "funcol/api/autograd.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/dist/backend.h"
#include "funcol/graph/tracer.h"
#include "testing/error_of.h"

namespace funcol {
namespace {

using testing::error_of;

// loss = fn(tape, leaves) on every rank; the gradient is of the sum of all ranks' losses.
using LossFn = std::function<Tensor(GradTape& tape, const std::vector<Tensor>& leaves, int rank)>;

// Leaf i of `rank`: uniform in [-1, 1), deterministic.
std::vector<Tensor> make_leaves(const std::vector<Shape>& shapes, int rank) {
  std::vector<Tensor> out;
  for (size_t i = 0; i < shapes.size(); ++i) {
    out.push_back(Tensor::rand(shapes[i], DType::F64, 1000 * static_cast<uint64_t>(rank) + i + 1));
  }
  return out;
}

// Random directions checked on more than 2 ranks.
constexpr int kDirections = 4;

// Compares tape gradients with central differences: every element on 2 ranks, kDirections
// random directions on more. Returns the number of comparisons.
int64_t eager_gradcheck(int world_size, const std::vector<Shape>& shapes, const LossFn& fn) {
  std::vector<std::vector<std::string>> bad(static_cast<size_t>(world_size));
  std::vector<int64_t> checked(static_cast<size_t>(world_size), 0);
  constexpr double kStep = 1e-6;
  run_local(world_size, [&](ProcessGroup& world) {
    const int rank = world.rank();
    const std::vector<Tensor> base = make_leaves(shapes, rank);
    std::vector<Tensor> analytic;
    {
      GradTape tape;
      std::vector<Tensor> leaves;
      for (const Tensor& t : base) leaves.push_back(tape.requires_grad(t));
      tape.backward(fn(tape, leaves, rank));
      for (const Tensor& l : leaves) analytic.push_back(tape.grad(l));
    }
    auto total = [&](const std::vector<Tensor>& in) {
      GradTape tape;
      std::vector<Tensor> leaves;
      for (const Tensor& t : in) leaves.push_back(tape.requires_grad(t));
      return all_reduce(fn(tape, leaves, rank), "sum", world).item<double>();
    };
    if (world_size > 2) {
      // More ranks: along random directions of every leaf of every rank at once (each
      // evaluation is a round of collectives, so per-element checks stay on 2 ranks).
      for (int d = 0; d < kDirections; ++d) {
        std::vector<Tensor> plus = base, minus = base;
        double local = 0;
        for (size_t i = 0; i < shapes.size(); ++i) {
          const Tensor v = Tensor::rand(shapes[i], DType::F64,
                                        static_cast<uint64_t>(7000 + 100 * rank + 10 * d) + i);
          const std::vector<double> vv = v.to_vector<double>();
          const std::vector<double> g = analytic[i].to_vector<double>();
          for (size_t e = 0; e < vv.size(); ++e) local += g[e] * vv[e];
          plus[i] = add(base[i], mul_scalar(v, kStep));
          minus[i] = sub(base[i], mul_scalar(v, kStep));
        }
        const double numeric = (total(plus) - total(minus)) / (2 * kStep);
        const double got =
            all_reduce(Tensor::full({}, DType::F64, local), "sum", world).item<double>();
        if (rank != 0) continue;
        ++checked[rank];
        if (std::abs(got - numeric) > 1e-6 * std::max(1.0, std::abs(numeric))) {
          bad[rank].push_back(
              fmt::format("direction {}: analytic {} numeric {}", d, got, numeric));
        }
      }
      return;
    }
    for (size_t i = 0; i < shapes.size(); ++i) {
      const std::vector<double> a = analytic[i].to_vector<double>();
      for (int src = 0; src < world_size; ++src) {
        for (int64_t e = 0; e < base[i].numel(); ++e) {
          double sides[2];
          for (int side = 0; side < 2; ++side) {
            std::vector<Tensor> in = base;
            if (rank == src) {
              in[i] = base[i].clone();
              static_cast<double*>(in[i].data_ptr())[e] += side == 0 ? kStep : -kStep;
            }
            sides[side] = total(in);
          }
          if (rank != src) continue;
          const double numeric = (sides[0] - sides[1]) / (2 * kStep);
          ++checked[rank];
          const double got = a[static_cast<size_t>(e)];
          if (std::abs(got - numeric) > 1e-6 * std::max(1.0, std::abs(numeric))) {
            bad[rank].push_back(fmt::format("rank {} leaf {} element {}: analytic {} numeric {}",
                                            rank, i, e, got, numeric));
          }
        }
      }
    }
  });
  int64_t n = 0;
  for (int r = 0; r < world_size; ++r) {
    n += checked[r];
    for (const std::string& b : bad[r]) ADD_FAILURE() << b;
  }
  return n;
}

Tensor sum_of_cubes(GradTape& tape, const Tensor& t) {
  const Tensor sq = tape.call_one("mul", std::vector<Tensor>{t, t});
  const Tensor cube = tape.call_one("mul", std::vector<Tensor>{sq, t});
  return tape.call_one("sum", std::vector<Tensor>{cube});
}

class EagerGradCheck : public ::testing::TestWithParam<int> {
 protected:
  // What eager_gradcheck compares for leaves of `elements` elements per rank in all.
  int64_t expected(int64_t elements) const {
    return GetParam() <= 2 ? elements * GetParam() : kDirections;
  }
};

TEST_P(EagerGradCheck, AllReduceAllGatherReduceScatter) {
  const int w = GetParam();
  const int64_t n = eager_gradcheck(w, {{2, 3}, {4, 2}}, [](GradTape& tape, const auto& x, int) {
    const Tensor ar = all_reduce_autograd(x[0], "sum", "world");
    // gather_dim 1 and scatter_dim 1 go through recorded split + cat.
    const Tensor ag = all_gather_tensor_autograd(x[1], 1, "world");
    const Tensor rs = reduce_scatter_tensor_autograd(ag, "sum", 1, "world");
    const Tensor a = sum_of_cubes(tape, ar);
    const Tensor b = sum_of_cubes(tape, rs);
    return tape.call_one("add", std::vector<Tensor>{a, b});
  });
  EXPECT_EQ(n, expected(6 + 8));
}

TEST_P(EagerGradCheck, AllToAllWithUnevenSplitsPerRank) {
  const int w = GetParam();
  const int64_t n = eager_gradcheck(w, {{2 * w, 2}}, [w](GradTape& tape, const auto& x, int rank) {
    // Even ranks send 3 rows to rank 0 and 1 to rank 1, odd ranks 2 to everyone; every rank
    // receives what its peers send, so the split lists differ between ranks.
    std::vector<int64_t> in(static_cast<size_t>(w), 2);
    std::vector<int64_t> out(static_cast<size_t>(w), 2);
    if (rank % 2 == 0) {
      in[0] = 3, in[1] = 1;
    }
    for (int src = 0; src < w; ++src) {
      if (src % 2 == 0 && rank <= 1) out[static_cast<size_t>(src)] = rank == 0 ? 3 : 1;
    }
    const Tensor y = all_to_all_single_autograd(x[0], out, in, "world");
    return sum_of_cubes(tape, y);
  });
  EXPECT_EQ(n, expected(4 * w));
}

TEST_P(EagerGradCheck, Coalesced) {
  const int w = GetParam();
  const int64_t n = eager_gradcheck(w, {{2, 3}, {4, 2}}, [](GradTape& tape, const auto& x, int) {
    const std::vector<Tensor> ar = all_reduce_coalesced_autograd({x[0], x[1]}, "sum", "world");
    const std::vector<Tensor> ag = all_gather_into_tensor_coalesced_autograd(ar, "world");
    const std::vector<Tensor> rs = reduce_scatter_tensor_coalesced_autograd(ag, "sum", "world");
    // Only the first reduce-scatter result is used.
    const Tensor a = sum_of_cubes(tape, rs[0]);
    const Tensor b = sum_of_cubes(tape, ar[1]);
    return tape.call_one("add", std::vector<Tensor>{a, b});
  });
  EXPECT_EQ(n, expected(6 + 8));
}

// Ranks use different results of one coalesced call: every rank's backward collective still
// lists every result (zeros where its own loss uses none), as PyTorch's does; listing only the
// used ones gave the ranks mismatched collectives.
TEST_P(EagerGradCheck, CoalescedResultsUsedOnSomeRanksOnly) {
  const int w = GetParam();
  const int64_t n =
      eager_gradcheck(w, {{2, 3}, {4, 2}}, [](GradTape& tape, const auto& x, int rank) {
        const std::vector<Tensor> ar = all_reduce_coalesced_autograd({x[0], x[1]}, "sum", "world");
        const std::vector<Tensor> ag = all_gather_into_tensor_coalesced_autograd(ar, "world");
        const std::vector<Tensor> rs = reduce_scatter_tensor_coalesced_autograd(ag, "sum", "world");
        if (rank % 2 == 1) return sum_of_cubes(tape, rs[1]);
        const Tensor a = sum_of_cubes(tape, rs[0]);
        return tape.call_one("add", std::vector<Tensor>{a, sum_of_cubes(tape, ar[1])});
      });
  EXPECT_EQ(n, expected(6 + 8));
}

// One coalesced call over a leaf and an untracked constant, where odd ranks' losses use only the
// constant's result: those ranks still run the backward collective (PyTorch's coalesced op is
// one autograd node) and get the gradient their leaf has through the other ranks' losses. They
// used to skip it (zero gradient; the even ranks' backward collective then had no partner).
TEST_P(EagerGradCheck, CoalescedLossThroughAConstantsResultOnSomeRanks) {
  const int w = GetParam();
  const int64_t n = eager_gradcheck(w, {{3}}, [](GradTape& tape, const auto& x, int rank) {
    const Tensor c = Tensor::full({2}, DType::F64, 0.5);
    const std::vector<Tensor> ar = all_reduce_coalesced_autograd({x[0], c}, "sum", "world");
    return sum_of_cubes(tape, ar[rank % 2 == 1 ? 1 : 0]);
  });
  EXPECT_EQ(n, expected(3));
}

// A 0-d input gathers to [group_size]; its gradient (a reduce_scatter, [1]) must come back 0-d.
TEST_P(EagerGradCheck, ZeroDimAllGather) {
  const int w = GetParam();
  const int64_t n = eager_gradcheck(w, {{}, {2}}, [](GradTape& tape, const auto& x, int) {
    const Tensor g = all_gather_tensor_autograd(x[0], -1, "world");
    const std::vector<Tensor> c = all_gather_into_tensor_coalesced_autograd({x[0], x[1]}, "world");
    const Tensor a = sum_of_cubes(tape, g);
    const Tensor b = sum_of_cubes(tape, tape.call_one("mul", std::vector<Tensor>{c[0], c[0]}));
    const Tensor ab = tape.call_one("add", std::vector<Tensor>{a, b});
    return tape.call_one("add", std::vector<Tensor>{ab, sum_of_cubes(tape, c[1])});
  });
  EXPECT_EQ(n, expected(1 + 2));
}

// PyTorch registers the rules on the base ops: the plain functional collectives record a
// tracked input on its tape too, so their gradients are those of the *_autograd variants.
TEST_P(EagerGradCheck, PlainCollectivesAreDifferentiable) {
  const int w = GetParam();
  const int64_t n =
      eager_gradcheck(w, {{2, 3}, {4, 2}, {3, 2}}, [w](GradTape& tape, const auto& x, int rank) {
        const Tensor ar = all_reduce(x[0], "sum", "world");
        const Tensor ag = all_gather_tensor(x[1], 1, "world");
        const Tensor rs = reduce_scatter_tensor(ag, "sum", 1, "world");
        // Every rank sends its tensor to the next.
        std::vector<int> next(static_cast<size_t>(w));
        for (int r = 0; r < w; ++r) next[static_cast<size_t>(r)] = (r + 1) % w;
        const Tensor p = permute_tensor(x[2], next, "world");
        // A column: not contiguous, and a reshape of it is a strided view, not a copy (the
        // tape's permute_tensor refused it: "Tensor must be contiguous").
        const Tensor column = tape.call_one("narrow", std::vector<Tensor>{x[2]},
                                            {{"dim", 1}, {"start", 1}, {"length", 1}});
        const Tensor pc = permute_tensor(column, next, "world");
        const Tensor a2a = all_to_all_single(ag, std::nullopt, std::nullopt, "world");
        const std::vector<Tensor> c = all_reduce_coalesced({ar, p}, "sum", "world");
        const std::vector<Tensor> cg = all_gather_into_tensor_coalesced({rs}, "world");
        const std::vector<Tensor> crs =
            reduce_scatter_tensor_coalesced({a2a, ag}, "sum", {1, -1}, "world");
        // Rank-dependent weights, so a wrong route (a gradient sent to the wrong rank) shows.
        const Tensor scale = Tensor::full({}, DType::F64, 1.0 + rank);
        Tensor loss = tape.call_one("mul", std::vector<Tensor>{sum_of_cubes(tape, c[1]), scale});
        for (const Tensor& t : {cg[0], crs[0], crs[1], wait_tensor(c[0]), pc}) {
          loss = tape.call_one("add", std::vector<Tensor>{loss, sum_of_cubes(tape, t)});
        }
        return loss;
      });
  EXPECT_EQ(n, expected(6 + 8 + 6));
}

INSTANTIATE_TEST_SUITE_P(Ranks, EagerGradCheck, ::testing::Values(2, 4),
                         [](const auto& info) { return fmt::format("ranks{}", info.param); });

// funcol::ops on a tracked tensor are recorded on its tape, as PyTorch records every op on a
// tensor that requires grad: their results were untracked constants, so the gradient through
// them was lost without a word (d/dx sum(neg(x) * x) came out -x instead of -2x). Views made by
// ops::view and ops::narrow are tracked too, so they enter tape.call; ops::call of wait_tensor
// still returns its operand itself.
TEST(EagerAutograd, FuncolOpsOnTrackedTensorsAreRecorded) {
  GradTape tape;
  const Tensor x = tape.requires_grad(Tensor::from_vector<float>({1, 2, 3, 4}, {4}));
  const std::vector<std::pair<std::string, std::function<Tensor()>>> cases = {
      {"neg", [&] { return ops::neg(x); }},
      {"view/reshape", [&] { return ops::reshape(ops::view(x, {2, 2}), {4}); }},
      {"clone", [&] { return ops::clone(x); }},
      {"cat of narrows",
       [&] { return ops::cat({ops::narrow(x, 0, 0, 2), ops::narrow(x, 0, 2, 2)}); }},
      {"call", [&] { return ops::call_one("mul", std::vector<Tensor>{x, x}); }},
  };
  for (const auto& [name, make] : cases) {
    tape.zero_grad();
    const Tensor y = make();
    EXPECT_TRUE(is_tracked(y)) << name;
    tape.backward(ops::sum(ops::mul(y, x)));
    const std::vector<float> v = {1, 2, 3, 4};
    std::vector<float> want(4);
    for (size_t i = 0; i < 4; ++i) {
      // d/dx sum(f(x) * x) = f'(x) * x + f(x).
      want[i] = name == "neg" ? -2 * v[i] : name == "call" ? 3 * v[i] * v[i] : 2 * v[i];
    }
    EXPECT_EQ(tape.grad(x).to_vector<float>(), want) << name;
  }
  EXPECT_EQ(ops::call_one("wait_tensor", std::vector<Tensor>{x}).data_ptr(), x.data_ptr());
}

// What funcol::ops does not record: an untracked view of a tracked value made by a Tensor
// method is refused, as tape.call refuses it (recorded around it, it lost its gradient: -x
// instead of -2x); and a tape op under a tracer is recorded in the trace too (its operands lost
// the tracer's annotation with the tape's). On another thread, see the next test.
TEST(EagerAutograd, FuncolOpsRecordOnlyWhatTheTapeCanKeep) {
  GradTape tape;
  const Tensor x = tape.requires_grad(Tensor::from_vector<float>({1, 2, 3, 4}, {4}));
  try {
    (void)ops::neg(x.view({2, 2}));
    ADD_FAILURE() << "a Tensor method's view of a tracked tensor went through funcol::ops";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("made by a Tensor method"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)ops::add(x, Tensor::meta({4}, DType::F32)), InvalidArgument);
  Tracer tracer("t");
  const Tensor in = tracer.input(Type(DType::F32, {4}));
  {
    TraceScope scope(tracer);
    const Tensor n = tape.call_one("neg", std::vector<Tensor>{in});
    EXPECT_TRUE(tracer.owns(n));
    EXPECT_NO_THROW((void)ops::add(in, n));
  }
}

// A tape records only on the thread that made it (it has no lock: funcol::ops and a collective
// recording from two threads at once corrupted it, and so did a backward there). On another
// thread a tracked operand, or a Tensor method's view of one, is refused by ops, tape.call, the
// plain and the *_autograd collectives alike (funcol::ops took it as a constant, silently
// losing its gradient: -x + 2 instead of -2x + 2, while the collective was recorded), and so
// are requires_grad, backward and zero_grad; a copy (clone) enters as a constant.
TEST(EagerAutograd, ATapeRecordsOnlyOnItsOwnThread) {
  run_local(1, [](ProcessGroup& world) {
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::from_vector<float>({1, 2, 3, 4}, {4}));
    const Tensor loss = ops::sum(x);
    std::vector<std::string> errors;
    std::thread([&] {
      auto expect_refused = [&](const std::function<void()>& fn) {
        errors.push_back(error_of(fn));
      };
      expect_refused([&] { (void)ops::neg(x); });
      expect_refused([&] { (void)tape.call_one("neg", std::vector<Tensor>{x}); });
      expect_refused([&] { (void)all_reduce(x, "sum", world); });
      expect_refused([&] { (void)all_gather_tensor_autograd(x, 0, world); });
      expect_refused([&] { (void)all_reduce_coalesced({x}, "sum", world); });
      expect_refused([&] { (void)tape.requires_grad(Tensor::zeros({2}, DType::F32)); });
      expect_refused([&] { (void)ops::neg(x.view({2, 2})); });
      expect_refused([&] { (void)all_reduce(x.view({2, 2}), "sum", world); });
      expect_refused([&] { tape.backward(loss); });
      expect_refused([&] { tape.zero_grad(); });
      const Tensor y = ops::neg(x.clone());
      EXPECT_FALSE(is_tracked(y));
      EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{-1, -2, -3, -4}));
    }).join();
    const std::string rule = "a tape records only on the thread that made it";
    const std::vector<std::string> expected = {
        "neg: operand 0 is tracked by a tape made on another thread",
        "neg: operand 0 is tracked by a tape made on another thread",
        "all_reduce: operand 0 is tracked by a tape made on another thread",
        "all_gather_tensor: operand 0 is tracked by a tape made on another thread",
        "all_reduce_coalesced: operand 0 is tracked by a tape made on another thread",
        "requires_grad: the tape was made on another thread",
        "neg: operand 0 (f32[2,2]) is a view of %x (f32[4]), which a GradTape made on another "
        "thread tracks",
        "all_reduce: the input (f32[2,2]) is a view of %x (f32[4]), which a GradTape made on "
        "another thread tracks",
        "backward: the tape was made on another thread",
        "zero_grad: the tape was made on another thread",
    };
    ASSERT_EQ(errors.size(), expected.size());
    for (size_t i = 0; i < errors.size(); ++i) {
      EXPECT_EQ(errors[i].rfind(expected[i], 0), 0u) << i << ": " << errors[i];
      EXPECT_NE(errors[i].find(rule), std::string::npos) << i << ": " << errors[i];
    }
    // Nothing of the other thread's reached the tape: the gradient of sum(neg(x) * x) is -2x.
    const Tensor n = ops::neg(x);
    tape.backward(ops::sum(ops::mul(n, x)));
    EXPECT_EQ(tape.grad(x).to_vector<float>(), (std::vector<float>{-2, -4, -6, -8}));
  });
}

// Reading a recorded value through const_data<T>() is a read; data<T>() and data_ptr() count as
// writes (funcol cannot tell), which the version check names with what to use instead.
TEST(EagerAutograd, ReadsThroughConstDataAreNotWrites) {
  GradTape tape;
  const Tensor x = tape.requires_grad(Tensor::from_vector<float>({1, 2}, {2}));
  const Tensor y = ops::mul(x, x);
  EXPECT_EQ(y.const_data<float>()[1], 4.0f);
  EXPECT_THROW((void)y.const_data<double>(), InvalidArgument);
  tape.backward(ops::sum(y));
  EXPECT_EQ(tape.grad(x).to_vector<float>(), (std::vector<float>{2, 4}));
  const Tensor z = ops::mul(x, x);
  (void)z.data<float>();
  const std::string error = error_of([&] { (void)ops::sum(z); });
  EXPECT_NE(error.find("data_ptr() or data<T>(), which count as writes even to read: read "
                       "through const_data<T>() or to_vector"),
            std::string::npos)
      << error;
}

TEST(EagerAutograd, AllReduceBackwardIsAllReduceOfTheGradient) {
  run_local(4, [](ProcessGroup& world) {
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({3}, DType::F32, 1.0));
    const Tensor c = Tensor::full({3}, DType::F32, world.rank() + 1);  // a constant
    const Tensor y = all_reduce_autograd(x, "sum", "world");
    EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{4, 4, 4}));
    const Tensor m = tape.call_one("mul", std::vector<Tensor>{y, c});
    tape.backward(tape.call_one("sum", std::vector<Tensor>{m}));
    // d/dx of sum over ranks r of sum((sum_s x_s) * (r + 1)) = 1 + 2 + 3 + 4.
    EXPECT_EQ(tape.grad(x).to_vector<float>(), (std::vector<float>{10, 10, 10}));
    // Backward nodes are gone again; a second backward accumulates.
    tape.backward(tape.call_one("sum", std::vector<Tensor>{m}));
    EXPECT_EQ(tape.grad(x).to_vector<float>(), (std::vector<float>{20, 20, 20}));
    tape.zero_grad();
    EXPECT_EQ(tape.grad(x).to_vector<float>(), (std::vector<float>{0, 0, 0}));
  });
}

// On a thread a rank started (no current rank there), collectives take the ProcessGroup itself;
// backward then runs on the groups the forward used, as the recorded names alone would not
// resolve there.
TEST(EagerAutograd, BackwardOnAThreadWithoutACurrentRankUsesTheForwardsGroups) {
  std::vector<std::vector<float>> grads(4), sub_grads(4);
  run_local(4, [&](ProcessGroup& world) {
    std::shared_ptr<ProcessGroup> pair = new_group(world, {0, 1}, "pair");
    std::shared_ptr<ProcessGroup> other = new_group(world, {2, 3}, "other");
    ProcessGroup& mine = world.rank() < 2 ? *pair : *other;
    std::thread helper([&] {
      GradTape tape;
      const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F32, 1.0));
      const Tensor y = all_reduce_autograd(x, "sum", world);
      const Tensor g = all_gather_tensor_autograd(y, 0, mine);  // then 2 ranks: [4]
      tape.backward(tape.call_one("sum", std::vector<Tensor>{g}));
      grads[world.rank()] = tape.grad(x).to_vector<float>();
      // Plain collectives on a tracked tensor are recorded the same way.
      GradTape tape2;
      const Tensor z = tape2.requires_grad(Tensor::full({2}, DType::F32, 1.0));
      const Tensor h = reduce_scatter_tensor(all_gather_tensor(z, 0, mine), "sum", 0, mine);
      tape2.backward(tape2.call_one("sum", std::vector<Tensor>{h}));
      sub_grads[world.rank()] = tape2.grad(z).to_vector<float>();
    });
    helper.join();
  });
  for (int r = 0; r < 4; ++r) {
    // d/dx_r of sum over the pair's gathers of the world sum: each of the 4 ranks' loss holds
    // both ranks of its pair's y, each y = sum of all x: 2 * 4 = 8.
    EXPECT_EQ(grads[r], (std::vector<float>{8, 8})) << r;
    // reduce_scatter(all_gather(z)) over 2 ranks: each element 2 * z, so the gradient is 2.
    EXPECT_EQ(sub_grads[r], (std::vector<float>{2, 2})) << r;
  }
}

TEST(EagerAutograd, NonSumFailsOnlyWhenBackwardRuns) {
  run_local(2, [](ProcessGroup& world) {
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F64, world.rank()));
    const Tensor y = all_reduce_autograd(x, "MAX", "world");
    EXPECT_EQ(y.to_vector<double>(), (std::vector<double>{1, 1}));
    const Tensor l = tape.call_one("sum", std::vector<Tensor>{y});
    const size_t nodes = tape.graph().num_nodes();
    try {
      tape.backward(l);
      ADD_FAILURE() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_STREQ(e.what(),
                   "all_reduce backward only supports 'sum' reduction, got 'max' (node %ar)");
    }
    EXPECT_EQ(tape.graph().num_nodes(), nodes);

    GradTape tape2;
    const Tensor z = tape2.requires_grad(Tensor::full({4}, DType::F64, 1.0));
    const Tensor r = reduce_scatter_tensor_autograd(z, "avg", 0, "world");
    EXPECT_EQ(r.to_vector<double>(), (std::vector<double>{1, 1}));
    EXPECT_THROW(tape2.backward(tape2.call_one("sum", std::vector<Tensor>{r})), InvalidArgument);
  });
}

// Every rank's loss must reach the same collectives (autograd.h): where rank 1's loss leaves
// an all_reduce's result unused, the documented remedy, the result added with a zero weight,
// runs its backward collective there too. Exact values: rank 1's leaf gets rank 0's term, and
// the collectives after backward pair as issued.
TEST(EagerAutograd, AZeroWeightedUnusedResultKeepsTheRanksInStep) {
  run_local(2, [](ProcessGroup& world) {
    const int rank = world.rank();
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F64, rank == 0 ? 1.0 : 2.0));
    const Tensor y = all_reduce_autograd(x, "sum", "world");  // 3 on both ranks
    auto sum_of_squares = [&](const Tensor& t) {
      const Tensor sq = tape.call_one("mul", std::vector<Tensor>{t, t});
      return tape.call_one("sum", std::vector<Tensor>{sq});
    };
    Tensor loss = sum_of_squares(y);
    if (rank == 1) {
      const Tensor sum_y = tape.call_one("sum", std::vector<Tensor>{y});
      const Tensor zero_weighted =
          tape.call_one("mul", std::vector<Tensor>{sum_y, Tensor::zeros({}, DType::F64)});
      loss = tape.call_one("add", std::vector<Tensor>{sum_of_squares(x), zero_weighted});
    }
    tape.backward(loss);
    // d(sum y^2)/dy = 2y = 6 on rank 0, 0 on rank 1; the all_reduce backward sums them: each x
    // gets 6, and rank 1 adds 2x = 4 of its own loss.
    const std::vector<double> want = rank == 0 ? std::vector<double>{6, 6}
                                               : std::vector<double>{10, 10};
    EXPECT_EQ(tape.grad(x).to_vector<double>(), want) << "rank " << rank;
    const Tensor synced = all_reduce(tape.grad(x), "sum", "world");
    EXPECT_EQ(synced.to_vector<double>(), (std::vector<double>{16, 16})) << "rank " << rank;
  });
}

// Against that contract, rank 1's loss leaves the all_reduce's result unused. A backward's
// collectives are labelled (dist_detail::InternalStep), so rank 0's backward all_reduce no
// longer pairs with rank 1's next all_reduce of the same shape, a user's own (which summed rank
// 0's gradient into rank 1's gradient sync, silently): both fail at once, and the message says
// which side the backward issued.
TEST(EagerAutograd, ALossMissingACollectiveOnOneRankFailsInsteadOfMispairing) {
  std::string errors[2];
  run_local(2, [&](ProcessGroup& world) {
    const int rank = world.rank();
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F64, rank + 1.0));
    const Tensor y = all_reduce_autograd(x, "sum", "world");
    const Tensor xy = tape.call_one("mul", std::vector<Tensor>{rank == 0 ? y : x, x});
    try {
      tape.backward(tape.call_one("sum", std::vector<Tensor>{xy}));
      const Tensor synced = all_reduce(tape.grad(x), "sum", "world");
      ADD_FAILURE() << "rank " << rank << " summed " << synced.to_vector<double>()[0];
    } catch (const CommError& e) {
      errors[rank] = e.what();
    }
    // Both skipped the mismatched pair: the group still works.
    EXPECT_EQ(all_reduce(Tensor::full({1}, DType::F64, 1), "sum", "world").item<double>(), 2);
  });
  EXPECT_EQ(errors[0], errors[1]);
  EXPECT_NE(errors[0].find("mismatched collectives: rank 0 issued all_reduce(f64[2], op sum) "
                           "[issued by GradTape::backward] but rank 1 issued all_reduce(f64[2], "
                           "op sum)"),
            std::string::npos)
      << errors[0];
}

// The label is the same for every backward call: ranks may call backward different numbers of
// times as long as each group sees the same collectives. Rank 0 belongs to groups A = {0, 1}
// and B = {0, 2} and calls backward once per group's loss, after one on a loss of its own that
// reaches no collective; ranks 1 and 2 call it once. Exact gradients: d(sum(y * x))/dx = y +
// the sum of the group's x (the all_reduce's backward).
TEST(EagerAutograd, RanksMayCallBackwardDifferentNumbersOfTimes) {
  run_local(3, [](ProcessGroup& world) {
    const int rank = world.rank();
    const std::shared_ptr<ProcessGroup> a = new_group(world, {0, 1}, "A");
    const std::shared_ptr<ProcessGroup> b = new_group(world, {0, 2}, "B");
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F64, rank + 1.0));
    auto loss_of = [&](const Tensor& t) {
      const Tensor tx = tape.call_one("mul", std::vector<Tensor>{t, x});
      return tape.call_one("sum", std::vector<Tensor>{tx});
    };
    if (rank == 0) {
      const Tensor ya = all_reduce_autograd(x, "sum", *a);
      const Tensor yb = all_reduce_autograd(x, "sum", *b);
      tape.backward(loss_of(x));  // 2x = 2
      tape.backward(loss_of(ya));  // 2 * (1 + 2) = 6
      tape.backward(loss_of(yb));  // 2 * (1 + 3) = 8
    } else {
      tape.backward(loss_of(all_reduce_autograd(x, "sum", rank == 1 ? *a : *b)));
    }
    const double want[3] = {16, 6, 8};
    EXPECT_EQ(tape.grad(x).to_vector<double>(), std::vector<double>(2, want[rank]))
        << "rank " << rank;
  });
}

// relu's gradient selects as PyTorch's threshold_backward does (0 where relu's result is <= 0,
// the gradient elsewhere, NaN included), never grad * 0: an inf gradient at an inactive unit
// gave NaN.
TEST(EagerAutograd, ReluGradientSelectsLikePyTorch) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  GradTape tape;
  const Tensor x = tape.requires_grad(Tensor::from_vector<double>({-1, kNaN, 2, 0}, {4}));
  const Tensor c = Tensor::from_vector<double>({kInf, 3, 4, -kInf}, {4});
  const Tensor y = tape.call_one("relu", std::vector<Tensor>{x});
  const Tensor m = tape.call_one("mul", std::vector<Tensor>{y, c});
  tape.backward(tape.call_one("sum", std::vector<Tensor>{m}));
  EXPECT_EQ(tape.grad(x).to_vector<double>(), (std::vector<double>{0, 3, 4, 0}));
}

// A backward that fails on one rank only (here a value its gradient needs written in place on
// rank 1) still issues its collectives, failed: the peers' backward fails naming rank 1 and
// why, instead of their all_reduce pairing with rank 1's next collective (which summed the
// gradient with the next step's tensors, silently), and the next collective pairs up right.
TEST(EagerAutograd, ABackwardFailingOnOneRankStillIssuesItsCollectives) {
  std::string errors[3];
  ::testing::internal::CaptureStderr();
  run_local(3, [&](ProcessGroup& world) {
    const int r = world.rank();
    GradTape tape;
    const Tensor w = tape.requires_grad(Tensor::full({2}, DType::F64, r + 1));
    const Tensor y = all_reduce_autograd(w, "sum", "world");
    const Tensor l = tape.call_one("sum", std::vector<Tensor>{
                                              tape.call_one("mul", std::vector<Tensor>{y, w})});
    if (r == 1) w.fill_(7.0);
    try {
      tape.backward(l);
      ADD_FAILURE() << "rank " << r << ": the backward did not fail";
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    const Tensor sum = all_reduce(Tensor::full({2}, DType::F32, r + 1), "sum", world);
    EXPECT_EQ(sum.to_vector<float>(), std::vector<float>({6, 6})) << "rank " << r;
  });
  // The backward's error explains the failures of the collectives it issued failed: no rank
  // warns of them when it ends.
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(errors[1].rfind("backward: %x (f64[2], leaf 0, counting the tape's requires_grad "
                            "calls from 0), a value the gradient needs, was written",
                            0),
            0u)
      << errors[1];
  for (const int r : {0, 2}) {
    EXPECT_NE(errors[r].find("all_reduce on group 'world' (seq 1): rank 1 could not take part: "
                             "it gave up on the rest of its backward after an error: backward: "
                             "%x (f64[2], leaf 0, counting the tape's requires_grad calls from "
                             "0), a value the gradient needs, was written"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// A value the gradient needs, written in place between forward and backward, fails the backward
// (PyTorch's version check) instead of giving a gradient of the new values; writes to values the
// gradient does not read, and a leaf updated between two recorded steps, are fine.
TEST(EagerAutograd, InPlaceWriteToAValueBackwardNeedsFails) {
  {
    GradTape tape;
    const Tensor w = tape.requires_grad(Tensor::from_vector<double>({1, 2, 3}, {3}));
    const Tensor y = tape.call_one("mul", std::vector<Tensor>{w, w});
    const Tensor l = tape.call_one("sum", std::vector<Tensor>{y});
    w.copy_(Tensor::from_vector<double>({10, 20, 30}, {3}));
    EXPECT_EQ(error_of([&] { tape.backward(l); }),
              "backward: %x (f64[3], leaf 0, counting the tape's requires_grad calls from 0), a "
              "value the gradient needs, was written in place after it was recorded (version 1, "
              "recorded at 0; copy_, fill_, an in-place collective, or data_ptr() or data<T>(), "
              "which count as writes even to read: read through const_data<T>() or "
              "to_vector): record the computation again, or write to a copy");
  }
  {
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::from_vector<double>({-1, 2}, {2}));
    const Tensor r = tape.call_one("relu", std::vector<Tensor>{x});
    const Tensor l = tape.call_one("sum", std::vector<Tensor>{r});
    r.fill_(0.0);  // relu's gradient reads its output
    EXPECT_NE(error_of([&] { tape.backward(l); })
                  .find("(f64[2], the result of relu), a value the gradient needs, was written"),
              std::string::npos);
  }
  {
    // A constant the tape named itself: the message says which op took it.
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::from_vector<double>({1, 2}, {2}));
    const Tensor c = Tensor::from_vector<double>({3, 4}, {2});
    const Tensor l = tape.call_one(
        "sum", std::vector<Tensor>{tape.call_one("mul", std::vector<Tensor>{x, c})});
    c.fill_(0.0);
    EXPECT_NE(error_of([&] { tape.backward(l); })
                  .find("(f64[2], an untracked tensor that mul took as a constant), a value the "
                        "gradient needs, was written in place"),
              std::string::npos);
  }
  {
    // Written in place after mul used it, then used again by a recorded op: mul's gradient
    // still reads the old values (the check kept only the newest use's version, and gave a
    // gradient of the new ones).
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F64, 1.0));
    const Tensor w = tape.requires_grad(Tensor::full({2}, DType::F64, 2.0));
    const Tensor z = tape.call_one("mul", std::vector<Tensor>{x, w});
    w.fill_(5.0);
    const Tensor q = tape.call_one("add", std::vector<Tensor>{w, x});
    const Tensor l = tape.call_one(
        "add", std::vector<Tensor>{tape.call_one("sum", std::vector<Tensor>{z}),
                                   tape.call_one("sum", std::vector<Tensor>{q})});
    EXPECT_EQ(error_of([&] { tape.backward(l); }),
              "backward: %x.1 (f64[2], leaf 1, counting the tape's requires_grad calls from 0), "
              "a value the gradient needs, was written in place after it was recorded (version 2, "
              "recorded at 1; copy_, fill_, an in-place collective, or data_ptr() or data<T>(), "
              "which count as writes even to read: read through const_data<T>() or "
              "to_vector): record the computation again, or write to a copy");
  }
  {
    GradTape tape;  // the same write, but the loss reads only uses made after it: fine
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F64, 1.0));
    const Tensor w = tape.requires_grad(Tensor::full({2}, DType::F64, 2.0));
    const Tensor z = tape.call_one("mul", std::vector<Tensor>{x, w});
    w.fill_(5.0);
    const Tensor q = tape.call_one("mul", std::vector<Tensor>{w, x});
    tape.backward(tape.call_one("sum", std::vector<Tensor>{q}));
    EXPECT_EQ(tape.grad(x).to_vector<double>(), (std::vector<double>{5, 5}));
    EXPECT_EQ(tape.grad(w).to_vector<double>(), (std::vector<double>{1, 1}));
  }
  {
    GradTape tape;  // add's gradient reads neither operand
    const Tensor x = tape.requires_grad(Tensor::from_vector<double>({1, 2}, {2}));
    const Tensor c = Tensor::from_vector<double>({5, 5}, {2});
    const Tensor y = tape.call_one("add", std::vector<Tensor>{x, c});
    const Tensor l = tape.call_one("sum", std::vector<Tensor>{y});
    c.fill_(7.0);
    tape.backward(l);
    EXPECT_EQ(tape.grad(x).to_vector<double>(), (std::vector<double>{1, 1}));
  }
  {
    GradTape tape;  // one tape over two steps, the leaf updated in place in between
    const Tensor w = tape.requires_grad(Tensor::from_vector<double>({1, 2}, {2}));
    auto step = [&] {
      const Tensor y = tape.call_one("mul", std::vector<Tensor>{w, w});
      const Tensor l = tape.call_one("sum", std::vector<Tensor>{y});
      tape.zero_grad();
      tape.backward(l);
      return tape.grad(w).to_vector<double>();
    };
    EXPECT_EQ(step(), (std::vector<double>{2, 4}));
    w.copy_(Tensor::from_vector<double>({3, 4}, {2}));
    EXPECT_EQ(step(), (std::vector<double>{6, 8}));
  }
  {
    // A recorded op's result written in place, then used: the graph would send the use's
    // gradient to the op that made it (grad a = 10, grad b = 0 where PyTorch gives 0 and 10).
    GradTape tape;
    const Tensor a = tape.requires_grad(Tensor::full({2}, DType::F64, 3.0));
    const Tensor b = tape.requires_grad(Tensor::full({2}, DType::F64, 5.0));
    Tensor y = tape.call_one("mul", std::vector<Tensor>{a, Tensor::full({2}, DType::F64, 1.0)});
    y.copy_(b);
    EXPECT_EQ(error_of([&] { tape.call_one("mul", std::vector<Tensor>{y, y}); }),
              "mul: operand 0 (%mul, made by a recorded mul) was written in place after that op "
              "was recorded (copy_, fill_, an in-place collective, or data_ptr() or data<T>(), "
              "which count as writes even to read: read through const_data<T>() or to_vector), "
              "and the tape does not record in-place writes: use the functional form of the "
              "write (its result), or write to a copy");
  }
  {
    GradTape tape;  // div's gradient reads its result: a wrong -5 for b, no error, before
    const Tensor a = tape.requires_grad(Tensor::full({2}, DType::F64, 3.0));
    const Tensor b = tape.requires_grad(Tensor::full({2}, DType::F64, 2.0));
    Tensor y = tape.call_one("div", std::vector<Tensor>{a, b});
    y.fill_(10.0);
    EXPECT_NE(error_of([&] { tape.call_one("sum", std::vector<Tensor>{y}); })
                  .find("operand 0 (%div, made by a recorded div) was written in place"),
              std::string::npos);
  }
}

// A leaf that reaches the loss only through an integer cast gets no gradient (zeros), while the
// others get theirs, as PyTorch's backward (it threw, and no leaf got a gradient).
TEST(EagerAutograd, ALeafBehindAnIntegerCastGetsZerosAndTheOthersTheirs) {
  GradTape tape;
  const Tensor a = tape.requires_grad(Tensor::from_vector<double>({1, 2, 3}, {3}));
  const Tensor b = tape.requires_grad(Tensor::from_vector<double>({1.5, -2.5, 4.25}, {3}));
  const Tensor i = tape.call_one("convert_element_type", std::vector<Tensor>{b},
                                 {{"dtype", DType::I32}});
  const Tensor f = tape.call_one("convert_element_type", std::vector<Tensor>{i},
                                 {{"dtype", DType::F64}});
  const Tensor l =
      tape.call_one("sum", std::vector<Tensor>{tape.call_one("mul", std::vector<Tensor>{a, f})});
  tape.backward(l);
  EXPECT_EQ(tape.grad(a).to_vector<double>(), (std::vector<double>{1, -2, 4}));
  EXPECT_EQ(tape.grad(b).to_vector<double>(), (std::vector<double>{0, 0, 0}));
}

// div's gradient for the divisor is PyTorch's -grad * ((a / b) / b): the old -(grad * out) / b
// overflowed f16 where PyTorch's order does not (300 * 300 > 65504).
TEST(EagerAutograd, DivisorGradientInPyTorchsOrder) {
  GradTape tape;
  const Tensor a = tape.requires_grad(Tensor::full({2}, DType::F16, 3000.0));
  const Tensor b = tape.requires_grad(Tensor::full({2}, DType::F16, 10.0));
  const Tensor q = tape.call_one("div", std::vector<Tensor>{a, b});
  const Tensor m = tape.call_one("mul", std::vector<Tensor>{q, Tensor::full({2}, DType::F16, 300)});
  tape.backward(tape.call_one("sum", std::vector<Tensor>{m}));
  EXPECT_EQ(tape.grad(a).to_vector<float>(), (std::vector<float>{30, 30}));
  EXPECT_EQ(tape.grad(b).to_vector<float>(), (std::vector<float>{-9000, -9000}));
}

// mse_loss's gradient is PyTorch's (2 / N) * (a - b) * grad, in that order: with a scaled loss
// (f16 loss scaling) grad * (a - b) first overflowed (1024 * 100 > 65504; PyTorch gives 3200).
TEST(EagerAutograd, MseLossGradientInPyTorchsOrder) {
  GradTape tape;
  const Tensor a = tape.requires_grad(Tensor::full({64}, DType::F16, 101.0));
  const Tensor b = tape.requires_grad(Tensor::full({64}, DType::F16, 1.0));
  const Tensor l = tape.call_one("mse_loss", std::vector<Tensor>{a, b});
  const Tensor scale = Tensor::full({}, DType::F16, 1024.0);
  tape.backward(tape.call_one("mul", std::vector<Tensor>{l, scale}));
  EXPECT_EQ(tape.grad(a).to_vector<float>(), std::vector<float>(64, 3200));
  EXPECT_EQ(tape.grad(b).to_vector<float>(), std::vector<float>(64, -3200));
}

// In f16 and bf16 mse_loss scales by 2/N in f32 and rounds once: 2/N in f16 (PyTorch's CPU
// kernel) is 2.026e-6 at N = 10^6, 1.3% off, and 0 from N = 2^26 on.
TEST(EagerAutograd, ReducedPrecisionMseLossScalesInF32) {
  for (const DType dtype : {DType::F16, DType::BF16}) {
    GradTape tape;
    const Tensor a = tape.requires_grad(Tensor::full({1000, 1000}, dtype, 1001.0));
    const Tensor b = tape.requires_grad(Tensor::full({1000, 1000}, dtype, 1.0));
    tape.backward(tape.call_one("mse_loss", std::vector<Tensor>{a, b}));
    const float want = Tensor::full({}, dtype, 2e-3).item<float>();
    const float in_dtype = Tensor::full({}, dtype, 2e-6).item<float>() * 1000;
    if (dtype == DType::F16) {
      EXPECT_NE(Tensor::full({}, dtype, in_dtype).item<float>(), want);
    }
    const std::vector<float> ga = tape.grad(a).to_vector<float>();
    const std::vector<float> gb = tape.grad(b).to_vector<float>();
    ASSERT_EQ(ga.size(), 1000000u);
    EXPECT_EQ(ga.front(), want) << dtype_name(dtype);
    EXPECT_EQ(ga, std::vector<float>(ga.size(), want)) << dtype_name(dtype);
    EXPECT_EQ(gb, std::vector<float>(gb.size(), -want)) << dtype_name(dtype);
  }
}

// mean's gradient is grad / N computed as PyTorch does for f16 and bf16 (in f32, then rounded):
// N = 65536 is inf in f16 (the gradient came out 0) and 257 is 256 in bf16.
TEST(EagerAutograd, ReducedPrecisionMeanDividesByTheExactCount) {
  GradTape tape;
  const Tensor h = tape.requires_grad(Tensor::full({256, 256}, DType::F16, 1.0));
  tape.backward(tape.call_one("mean", std::vector<Tensor>{h}));
  EXPECT_EQ(tape.grad(h).to_vector<float>(), std::vector<float>(65536, std::ldexp(1.0f, -16)));

  const Tensor b = tape.requires_grad(Tensor::full({257, 2}, DType::BF16, 1.0));
  const Tensor m = tape.call_one("mean", std::vector<Tensor>{b},
                                 {{"dims", std::vector<int64_t>{0}}, {"keepdim", false}});
  tape.backward(tape.call_one("sum", std::vector<Tensor>{m}));
  const float want = Tensor::full({}, DType::BF16, 1.0f / 257).item<float>();
  EXPECT_NE(want, 1.0f / 256);
  EXPECT_EQ(tape.grad(b).to_vector<float>(), std::vector<float>(514, want));
}

// The tape runs eagerly: a meta tensor (a traced value, say) is refused when it would become a
// leaf, not accepted and then failing in a backward kernel ("relu_backward on a meta tensor"),
// and a traced tensor keeps standing for its graph value.
TEST(EagerAutograd, MetaAndTracedTensorsCannotBeLeaves) {
  GradTape tape;
  try {
    (void)tape.requires_grad(Tensor::meta({2}, DType::F32));
    ADD_FAILURE() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "requires_grad: f32[2] is a meta tensor (no data; a traced value?): the "
                           "tape runs eagerly; differentiate a traced graph with the autodiff "
                           "pass (build_joint_graph)");
  }
  Tracer tracer("t");
  TraceScope scope(tracer);
  const Tensor x = tracer.input(Type(DType::F32, {2}));
  EXPECT_THROW(tape.requires_grad(x), InvalidArgument);
  EXPECT_TRUE(tracer.owns(x));
  EXPECT_EQ(tape.graph().num_inputs(), 0u);
}

// A *_autograd call that fails records nothing: the reduce_scatter along dim 1 recorded its
// split and cat before the reduce op was checked.
TEST(EagerAutograd, FailedCollectiveRecordsNothing) {
  run_local(2, [](ProcessGroup&) {
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2, 4}, DType::F32, 1.0));
    const size_t nodes = tape.graph().num_nodes();
    EXPECT_THROW(reduce_scatter_tensor_autograd(x, "band", 1, "world"), InvalidArgument);
    EXPECT_THROW(reduce_scatter_tensor_autograd(x, "foo", 1, "world"), InvalidArgument);
    EXPECT_EQ(tape.graph().num_nodes(), nodes);
  });
}

// Every leaf's gradient is a tensor of its own, as in PyTorch: add(a, b) hands one backward value
// to both leaves, and scaling or zeroing grad(a) in place (clipping, say) changed grad(b).
TEST(EagerAutograd, LeavesDoNotShareGradientTensors) {
  GradTape tape;
  const Tensor a = tape.requires_grad(Tensor::full({3}, DType::F32, 1.0));
  const Tensor b = tape.requires_grad(Tensor::full({3}, DType::F32, 2.0));
  const Tensor c = Tensor::full({3}, DType::F32, 4.0);
  const Tensor ab = tape.call_one("add", std::vector<Tensor>{a, b});
  const Tensor m = tape.call_one("mul", std::vector<Tensor>{ab, c});
  tape.backward(tape.call_one("sum", std::vector<Tensor>{m}));
  tape.grad(a).fill_(0.0);
  EXPECT_EQ(tape.grad(b).to_vector<float>(), (std::vector<float>{4, 4, 4}));

  const Tensor x = tape.requires_grad(Tensor::full({}, DType::F32, 1.0));
  const Tensor y = tape.requires_grad(Tensor::full({}, DType::F32, 2.0));
  tape.backward(tape.call_one("add", std::vector<Tensor>{x, y}));
  tape.grad(x).fill_(5.0);
  EXPECT_EQ(tape.grad(y).item<float>(), 1.0f);
}

// PyTorch's broadcast has no gradient: a tracked input is recorded, so a backward through it
// fails with broadcast's error instead of silently leaving that path out; a backward that does
// not reach it is unaffected.
TEST(EagerAutograd, PlainBroadcastOfATrackedTensorFailsOnlyWhenBackwardReachesIt) {
  run_local(2, [](ProcessGroup& world) {
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F32, 1.0 + world.rank()));
    const Tensor b = broadcast(x, 1, "world");
    EXPECT_TRUE(is_tracked(b));
    EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{2, 2}));
    tape.backward(tape.call_one("sum", std::vector<Tensor>{x}));
    EXPECT_EQ(tape.grad(x).to_vector<float>(), (std::vector<float>{1, 1}));
    try {
      tape.backward(tape.call_one("sum", std::vector<Tensor>{b}));
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("broadcast has no gradient rule"), std::string::npos)
          << e.what();
    }
  });
}

// The tape records values: an in-place collective would overwrite a tracked tensor behind its
// back (PyTorch refuses in-place changes autograd cannot follow). A tracked input into an
// untracked output is refused too: a tape op reading the output would take it for a constant,
// losing the gradient (it gave grad 0 where PyTorch's copy_ gives the collective's); a clone
// of the input passes as a constant. Each is refused after the collective was issued, so the
// peers complete.
TEST(EagerAutograd, InPlaceCollectivesRefuseATrackedOutput) {
  run_local(2, [](ProcessGroup& world) {
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F32, 1.0));
    try {
      all_reduce_inplace(x, "sum", "world");
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("all_reduce_inplace: the output is tracked by a "
                                           "GradTape"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{1, 1}));  // left as it was
    Tensor out = Tensor::zeros({4}, DType::F32);
    all_gather_tensor_inplace(out, x.clone(), "world");
    EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{1, 1, 1, 1}));
    const Tensor tracked_out = tape.requires_grad(Tensor::zeros({4}, DType::F32));
    EXPECT_THROW(all_gather_tensor_inplace(tracked_out, x, "world"), InvalidArgument);
    const std::string lost =
        "the input is tracked by a GradTape and the output is not, so the gradient through the "
        "in-place collective would be lost";
    auto refused = [&](const std::function<void()>& fn, const std::string& op) {
      try {
        fn();
        ADD_FAILURE() << "no error for " << op;
      } catch (const InvalidArgument& e) {
        EXPECT_EQ(std::string(e.what()).rfind(op + ": " + lost, 0), 0u) << e.what();
      }
    };
    refused([&] { all_gather_tensor_inplace(out, x, "world"); }, "all_gather_tensor_inplace");
    std::vector<Tensor> list = {Tensor::zeros({2}, DType::F32), Tensor::zeros({2}, DType::F32)};
    refused([&] { all_gather_inplace(list, x, "world"); }, "all_gather_inplace");
    const Tensor one = Tensor::zeros({1}, DType::F32);
    refused([&] { reduce_scatter_tensor_inplace(one, x, "world"); },
            "reduce_scatter_tensor_inplace");
    const Tensor two = Tensor::zeros({2}, DType::F32);
    refused([&] { all_to_all_inplace(two, x, std::nullopt, std::nullopt, "world"); },
            "all_to_all_inplace");
    // The group is still in step on every rank: the refusals came after the collectives.
    EXPECT_EQ(all_reduce(x.clone(), "sum", "world").to_vector<float>(),
              (std::vector<float>{2, 2}));
    (void)world;
  });
}

// A Tensor method's view of a tracked tensor is not recorded (the tape sees only its own calls):
// taken as a constant it would lose its gradient silently (loss = sum(x) + sum(all_reduce(
// x.view)) gave 1 where PyTorch gives 3), so it is refused where it enters a collective or a
// tape call. Recorded views, exact aliases, clones, tensors larger than the tracked one and
// in-place writes pass.
TEST(EagerAutograd, TensorMethodViewsOfTrackedTensorsAreRefused) {
  run_local(2, [](ProcessGroup& world) {
    GradTape tape;
    const Tensor src = Tensor::full({2, 2}, DType::F32, 1.0);
    const Tensor x = tape.requires_grad(src);
    auto refused = [](const std::function<void()>& fn, const std::string& what) {
      try {
        fn();
        ADD_FAILURE() << "no error for " << what;
      } catch (const InvalidArgument& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(what), std::string::npos) << msg;
        EXPECT_NE(msg.find("which a GradTape tracks, made by a Tensor method"), std::string::npos)
            << msg;
        EXPECT_NE(msg.find("tape.call"), std::string::npos) << msg;
      }
    };
    refused([&] { all_reduce(x.view({4}), "sum", "world"); },
            "all_reduce: the input (f32[4]) is a view of %x");
    refused([&] { all_reduce_autograd(x.view({4}), "sum", "world"); }, "all_reduce: the input");
    refused([&] { all_gather_tensor(x.transpose(0, 1), 0, "world"); },
            "all_gather_tensor: the input (f32[2,2])");
    refused([&] { all_reduce_coalesced({x, x.narrow(0, 1, 1)}, "sum", "world"); },
            "all_reduce_coalesced: input 1 (f32[1,2])");
    refused([&] { tape.call_one("sum", std::vector<Tensor>{x.narrow(1, 0, 1)}); },
            "sum: operand 0 (f32[2,1])");
    const Tensor y = tape.call_one("relu", std::vector<Tensor>{x});
    refused([&] { tape.call_one("add", std::vector<Tensor>{y, y.view({2, 2}).transpose(0, 1)}); },
            "add: operand 1 (f32[2,2]) is a view of %relu");
    EXPECT_EQ(tape.graph().num_nodes(), 1u);  // the relu; nothing refused was recorded

    // Passing: the view recorded (its gradient flows), the tensor requires_grad() was given
    // (x's alias: a constant), a clone, a tensor that holds x, an in-place write into x's bytes.
    const Tensor v = tape.call_one("view", std::vector<Tensor>{x}, {{"shape", Shape{4}}});
    const Tensor ar = all_reduce(v, "sum", "world");
    EXPECT_TRUE(is_tracked(ar));
    EXPECT_FALSE(is_tracked(all_reduce(src, "sum", "world")));
    EXPECT_FALSE(is_tracked(all_reduce(x.view({4}).clone(), "sum", "world")));
    const Tensor big = Tensor::full({4, 2}, DType::F32, 1.0);
    const Tensor part = tape.requires_grad(big.narrow(0, 0, 2));
    EXPECT_EQ(all_reduce(big, "sum", "world").to_vector<float>(), std::vector<float>(8, 2));
    all_reduce_inplace(src.narrow(0, 0, 1), "max", "world");
    const Tensor a = tape.call_one("sum", std::vector<Tensor>{x});
    const Tensor b = tape.call_one("sum", std::vector<Tensor>{ar});
    tape.backward(tape.call_one("add", std::vector<Tensor>{a, b}));
    EXPECT_EQ(tape.grad(x).to_vector<float>(), std::vector<float>(4, 1.0f + world.size()));
    (void)part;
  });
}

// As PyTorch's backward(): a loss of one element of any rank, seeded with ones of its shape.
// A loss that is not a scalar on one rank only: that rank's backward fails before it builds
// its gradient graph, and still issues (failed) the collectives its loss reaches, so the peer's
// backward fails naming it at once and the next collectives pair.
TEST(EagerAutograd, ANonScalarLossOnOneRankFailsItsPeersBackwardToo) {
  std::vector<std::string> errors(2);
  ::testing::internal::CaptureStderr();
  run_local(2, [&](ProcessGroup& world) {
    const int rank = world.rank();
    GradTape tape;
    const Tensor x = tape.requires_grad(Tensor::full({2}, DType::F64, 1.0 + rank));
    const Tensor y = all_reduce_autograd(x, "sum", "world");
    const Tensor loss = rank == 0 ? y : tape.call_one("sum", std::vector<Tensor>{y});
    errors[static_cast<size_t>(rank)] = error_of([&] { tape.backward(loss); });
    const Tensor sum = all_reduce(Tensor::full({2}, DType::F32, rank + 1), "sum", world);
    EXPECT_EQ(sum.to_vector<float>(), std::vector<float>({3, 3})) << "rank " << rank;
  });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");  // as above
  EXPECT_EQ(errors[0],
            "backward: the loss %w (f64[2], the result of all_reduce) must be a scalar "
            "(one element) of a floating dtype");
  EXPECT_NE(errors[1].find("rank 0 could not take part: it gave up on the rest of its backward "
                           "after an error: backward: the loss %w"),
            std::string::npos)
      << errors[1];
}

TEST(EagerAutograd, SingleElementLossOfAnyRank) {
  GradTape tape;
  const Tensor x = tape.requires_grad(Tensor::from_vector(std::vector<float>{1, 2, 3}, {1, 3}));
  const Tensor sq = tape.call_one("mul", std::vector<Tensor>{x, x});
  tape.backward(tape.call_one("sum", std::vector<Tensor>{sq}, {{"dims", std::vector<int64_t>{1}},
                                                               {"keepdim", true}}));
  EXPECT_EQ(tape.grad(x).to_vector<float>(), (std::vector<float>{2, 4, 6}));
  EXPECT_EQ(error_of([&] { tape.backward(sq); }),  // three elements
            "backward: the loss %mul (f32[1,3], the result of mul) must be a scalar (one "
            "element) of a floating dtype");
  // A collective's result is named by its collective, not by the wait the tape recorded.
  run_local(1, [](ProcessGroup&) {
    GradTape t;
    const Tensor y = all_reduce_autograd(t.requires_grad(Tensor::full({2}, DType::F32, 1.0)),
                                         "sum", "world");
    EXPECT_NE(error_of([&] { t.backward(y); }).find("(f32[2], the result of all_reduce) must be"),
              std::string::npos);
  });
}

TEST(EagerAutograd, TapeContract) {
  run_local(2, [](ProcessGroup& world) {
    GradTape tape;
    const Tensor plain = Tensor::full({2}, DType::F32, 2.0);
    EXPECT_FALSE(is_tracked(plain));
    // Untracked inputs: the plain collective, nothing recorded.
    const Tensor s = all_reduce_autograd(plain, "sum", "world");
    EXPECT_FALSE(is_tracked(s));
    EXPECT_EQ(tape.graph().num_nodes(), 0u);
    EXPECT_EQ(s.to_vector<float>(), (std::vector<float>{4, 4}));

    const Tensor x = tape.requires_grad(plain);
    const Tensor unused = tape.requires_grad(Tensor::full({3}, DType::F64, 1.0));
    EXPECT_TRUE(tape.tracks(x));
    EXPECT_THROW(tape.requires_grad(x), InvalidArgument);
    EXPECT_THROW(tape.requires_grad(Tensor::zeros({2}, DType::I32)), InvalidArgument);
    const Tensor y = tape.call_one("relu", std::vector<Tensor>{x});
    EXPECT_TRUE(is_tracked(y));
    EXPECT_THROW(tape.grad(y), InvalidArgument);               // not a leaf
    EXPECT_THROW(tape.backward(y), InvalidArgument);           // not a scalar
    EXPECT_THROW(tape.backward(Tensor::full({}, DType::F32, 1)), InvalidArgument);  // untracked
    EXPECT_THROW(tape.call("all_reduce", std::vector<Tensor>{x}, {}), InvalidArgument);
    {
      GradTape other;
      const Tensor o = other.requires_grad(Tensor::full({2}, DType::F32, 1.0));
      EXPECT_THROW(tape.call_one("add", std::vector<Tensor>{x, o}), InvalidArgument);
    }
    const Tensor l = tape.call_one("mean", std::vector<Tensor>{y});
    tape.backward(l);
    EXPECT_EQ(tape.grad(x).to_vector<float>(), (std::vector<float>{0.5f, 0.5f}));
    // A leaf the loss does not reach: zeros of its type.
    EXPECT_EQ(tape.grad(unused).to_vector<double>(), (std::vector<double>{0, 0, 0}));
    // A tensor of a destroyed tape counts as untracked.
    Tensor orphan;
    {
      GradTape gone;
      orphan = gone.requires_grad(Tensor::full({1}, DType::F32, 1.0));
    }
    EXPECT_FALSE(is_tracked(orphan));
    (void)world;
  });
}

}  // namespace
}  // namespace funcol
