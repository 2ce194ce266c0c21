// Tests of the functional collectives on the threads backend (REFERENCE-pytorch.md §D 1-30).
#include "funcol/api/functional.h"

#include <funcol/funcol.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "testing/error_of.h"
#include "testing/poll.h"

namespace funcol {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

using testing::error_of;
using testing::poll_until_ready;

// f32 tensor whose element k (row-major) is base + k.
Tensor iota(const Shape& shape, float base = 0) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t k = 0; k < v.size(); ++k) v[k] = base + static_cast<float>(k);
  return Tensor::from_vector(v, shape);
}

std::vector<float> repeat(float value, int64_t n) {
  return std::vector<float>(static_cast<size_t>(n), value);
}

// A one-shot signal between ranks. The deadline only turns a broken wait-free path into a
// failed expectation instead of a deadlock; the test never relies on it for ordering.
class Gate {
 public:
  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  bool wait_open(std::chrono::seconds limit = std::chrono::seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// A user-defined operation attached to a storage: counts its waits.
class CountingWaitable : public Waitable {
 public:
  void wait() override { waits_.fetch_add(1); }
  bool is_completed() const override { return waits_.load() > 0; }
  int waits() const { return waits_.load(); }

 private:
  std::atomic<int> waits_{0};
};

// ---- the DESIGN §4 contract snippet ----

// clang-format off
TEST(DesignContract, SnippetRunsVerbatim) {
  // 4 ranks as threads of this process; fn runs once per rank.
  funcol::run_local(4, [](funcol::ProcessGroup& world) {
    using funcol::DType;
    funcol::Tensor x = funcol::Tensor::full({4, 8}, DType::F32, world.rank());
    funcol::Tensor s = funcol::all_reduce(x, "sum", "world");      // returns at once
    funcol::Tensor g = funcol::all_gather_tensor(x, 1, world);     // any group spec
    funcol::DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    funcol::Tensor r = funcol::reduce_scatter_tensor(g, "avg", 0, mesh.group("tp"));
    std::vector<float> v = s.to_vector<float>();                   // waits here
  });
}
// clang-format on

TEST(DesignContract, SnippetValues) {
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({4, 8}, DType::F32, world.rank());
    Tensor s = all_reduce(x, "sum", "world");
    Tensor g = all_gather_tensor(x, 1, world);
    DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    Tensor r = reduce_scatter_tensor(g, "avg", 0, mesh.group("tp"));
    EXPECT_EQ(s.to_vector<float>(), repeat(6, 32));
    ASSERT_EQ(g.sizes(), (Shape{4, 32}));
    std::vector<float> expect_g;
    for (int row = 0; row < 4; ++row) {
      for (int j = 0; j < 4; ++j) {
        for (int c = 0; c < 8; ++c) expect_g.push_back(static_cast<float>(j));
      }
    }
    EXPECT_EQ(g.to_vector<float>(), expect_g);
    // g is the same on every rank, so the tp average is g; tp index t gets rows [2t, 2t+2).
    ASSERT_EQ(r.sizes(), (Shape{2, 32}));
    const int t = mesh.coordinate()[1];
    EXPECT_TRUE(r.equal(g.narrow(0, 2 * t, 2)));
    EXPECT_TRUE(x.equal(Tensor::full({4, 8}, DType::F32, world.rank())));
  });
}

// ---- functional ops (REFERENCE §D 1-19) ----

TEST(AllReduce, AvgIsANewTensorAndLeavesTheInputAlone) {  // D.1
  run_local(2, [](ProcessGroup& world) {
    Tensor x = Tensor::full({10, 10}, DType::F32, world.rank());
    Tensor out = all_reduce(x, "avg", world);
    EXPECT_FALSE(out.shares_storage(x));
    EXPECT_EQ(wait_tensor(out).to_vector<float>(), repeat(0.5f, 100));
    EXPECT_TRUE(x.equal(Tensor::full({10, 10}, DType::F32, world.rank())));
  });
}

// The average of finite values is finite where their sum overflows (as NCCL's), on every
// world size: all_reduce and reduce_scatter of 2^127 give 2^127.
TEST(AllReduce, FloatAvgDoesNotOverflow) {
  for (int n : {2, 3}) {
    run_local(n, [](ProcessGroup& world) {
      const float big = std::ldexp(1.0f, 127);  // 1.7e38: its sum overflows, 3 / 4 of it is exact
      Tensor x = Tensor::full({static_cast<int64_t>(world.size()) * 3}, DType::F32, big);
      EXPECT_EQ(all_reduce(x, "avg", world).to_vector<float>(), repeat(big, x.numel()));
      EXPECT_EQ(reduce_scatter_tensor(x, "avg", 0, world).to_vector<float>(), repeat(big, 3));
    });
  }
}

TEST(AllReduce, EveryOpOnIntegers) {
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({5}, DType::I32, world.rank() + 1);  // 1, 2, 3, 4
    const std::vector<std::pair<std::string, int32_t>> cases = {
        {"sum", 10}, {"avg", 2},  {"product", 24}, {"min", 1},
        {"max", 4},  {"band", 0}, {"bor", 7},      {"bxor", 1 ^ 2 ^ 3 ^ 4}};
    for (const auto& [op, expect] : cases) {
      EXPECT_EQ(all_reduce(x, op, world).to_vector<int32_t>(), std::vector<int32_t>(5, expect))
          << op;
    }
    EXPECT_TRUE(x.equal(Tensor::full({5}, DType::I32, world.rank() + 1)));
  });
}

TEST(AllReduce, OpNamesAreCaseInsensitive) {  // D.13
  run_local(2, [](ProcessGroup& world) {
    Tensor x = Tensor::full({3}, DType::F32, world.rank() + 1);
    EXPECT_EQ(all_reduce(x, "SUM", world).to_vector<float>(), repeat(3, 3));
    EXPECT_EQ(all_reduce(x, "Max", world).to_vector<float>(), repeat(2, 3));
  });
}

TEST(AllReduce, BoolAndNonContiguousInput) {
  run_local(2, [](ProcessGroup& world) {
    Tensor b = Tensor::full({4}, DType::Bool, world.rank() == 0 ? 1 : 0);
    EXPECT_EQ(all_reduce(b, "bor", world).to_vector<bool>(), std::vector<bool>(4, true));
    EXPECT_EQ(all_reduce(b, "band", world).to_vector<bool>(), std::vector<bool>(4, false));
    // A transposed input is reduced in its logical order; the output is contiguous.
    Tensor x = iota({2, 3}, static_cast<float>(10 * world.rank())).transpose(0, 1);
    Tensor out = all_reduce(x, "sum", world);
    EXPECT_TRUE(out.is_contiguous());
    EXPECT_EQ(out.sizes(), (Shape{3, 2}));
    EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{10, 16, 12, 18, 14, 20}));
  });
}

TEST(AllReduce, InplaceReturnsTheSameTensor) {  // D.2
  run_local(2, [](ProcessGroup& world) {
    Tensor x = Tensor::full({10, 10}, DType::F32, world.rank());
    const Tensor& ret = all_reduce_inplace(x, "avg", world);
    EXPECT_EQ(&ret, &x);
    EXPECT_EQ(x.to_vector<float>(), repeat(0.5f, 100));
  });
}

TEST(AllReduce, CoalescedAvg) {  // D.3
  run_local(4, [](ProcessGroup& world) {
    std::vector<Tensor> inputs;
    for (int i = 0; i < 10; ++i) {
      inputs.push_back(Tensor::full({i, i}, DType::F32, world.rank() * i));
    }
    std::vector<Tensor> outs = all_reduce_coalesced(inputs, "avg", world);
    ASSERT_EQ(outs.size(), 10u);
    wait_tensors(outs);
    for (int i = 0; i < 10; ++i) {
      EXPECT_FALSE(outs[static_cast<size_t>(i)].shares_storage(inputs[static_cast<size_t>(i)]));
      EXPECT_EQ(outs[static_cast<size_t>(i)].to_vector<float>(), repeat(1.5f * i, i * i)) << i;
      EXPECT_TRUE(
          inputs[static_cast<size_t>(i)].equal(Tensor::full({i, i}, DType::F32, world.rank() * i)));
    }
    EXPECT_TRUE(all_reduce_coalesced({}, "sum", world).empty());
  });
}

TEST(AllGather, Dim0BlocksAreRankMajor) {  // D.4
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({10, 10}, DType::F32, world.rank());
    Tensor out = all_gather_tensor(x, 0, world);
    ASSERT_EQ(out.sizes(), (Shape{40, 10}));
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(out.narrow(0, 10 * j, 10).to_vector<float>(), repeat(static_cast<float>(j), 100));
    }
    EXPECT_TRUE(x.equal(Tensor::full({10, 10}, DType::F32, world.rank())));
  });
}

TEST(AllGather, InplaceWritesTheGivenBuffer) {  // D.4, _out variant
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({2, 3}, DType::I64, world.rank());
    Tensor out = Tensor::zeros({2, 12}, DType::I64);
    const Tensor& ret = all_gather_tensor_inplace(out, x, world, /*gather_dim=*/1);
    EXPECT_EQ(&ret, &out);
    EXPECT_EQ(out.to_vector<int64_t>(), (std::vector<int64_t>{0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3,
                                                              0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3}));
    Tensor wrong = Tensor::zeros({8, 4}, DType::I64);
    EXPECT_THAT(error_of([&] { all_gather_tensor_inplace(wrong, x, world); }),
                HasSubstr("output shape [8,4] does not match the result shape [8,3]"));
  });
}

TEST(AllGather, ZeroDimGathersToGroupSize) {  // D.5
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({}, DType::F32, world.rank() * 2);
    Tensor out = all_gather_tensor(x, 0, world);
    EXPECT_EQ(out.sizes(), (Shape{4}));
    EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{0, 2, 4, 6}));
    EXPECT_EQ(all_gather_tensor(x, -1, world).to_vector<float>(), (std::vector<float>{0, 2, 4, 6}));
  });
}

TEST(AllGather, Coalesced) {  // D.6
  run_local(4, [](ProcessGroup& world) {
    std::vector<Tensor> inputs;
    for (int i = 0; i < 10; ++i)
      inputs.push_back(Tensor::full({i, 2}, DType::F32, world.rank() * i));
    std::vector<Tensor> outs = all_gather_into_tensor_coalesced(inputs, world);
    ASSERT_EQ(outs.size(), 10u);
    for (int i = 0; i < 10; ++i) {
      const Tensor& out = outs[static_cast<size_t>(i)];
      ASSERT_EQ(out.sizes(), (Shape{4 * i, 2}));
      std::vector<float> expect;
      for (int j = 0; j < 4; ++j) {
        for (int k = 0; k < 2 * i; ++k) expect.push_back(static_cast<float>(j * i));
      }
      EXPECT_EQ(out.to_vector<float>(), expect) << i;
    }
  });
}

// Gathering along dims 1 and 2 of [3,3,3] with W=4 (D.18), in every dtype: the result must equal
// the concatenation of every rank's input along the dim.
TEST(AllGather, NonZeroDimsInEveryDtype) {
  run_local(4, [](ProcessGroup& world) {
    for (DType dtype : kAllDTypes) {
      auto input_of = [&](int rank) { return Tensor::rand({3, 3, 3}, dtype, 100 + rank); };
      Tensor x = input_of(world.rank());
      std::vector<Tensor> all;
      for (int j = 0; j < 4; ++j) all.push_back(input_of(j));
      for (int64_t dim : {0, 1, 2, -1, -2}) {
        Tensor out = all_gather_tensor(x, dim, world);
        Shape expect_shape{3, 3, 3};
        expect_shape[static_cast<size_t>(dim < 0 ? dim + 3 : dim)] = 12;
        EXPECT_EQ(out.sizes(), expect_shape);
        EXPECT_TRUE(out.equal(Tensor::cat(all, dim)))
            << dtype_name(dtype) << " dim " << dim << ": " << out.to_string();
      }
      EXPECT_TRUE(x.equal(input_of(world.rank())));
    }
  });
}

TEST(AllGather, LeadingOnesAndEmptyInputs) {
  run_local(2, [](ProcessGroup& world) {
    // Nothing precedes dim 1 except a size-1 dim: no rearrangement needed.
    Tensor x = iota({1, 2, 3}, static_cast<float>(100 * world.rank()));
    Tensor out = all_gather_tensor(x, 1, world);
    EXPECT_TRUE(out.equal(Tensor::cat({iota({1, 2, 3}, 0), iota({1, 2, 3}, 100)}, 1)));
    Tensor empty = Tensor::zeros({2, 0, 3}, DType::F32);
    EXPECT_EQ(all_gather_tensor(empty, 1, world).sizes(), (Shape{2, 0, 3}));
    EXPECT_EQ(all_gather_tensor(empty, 2, world).sizes(), (Shape{2, 0, 6}));
  });
}

// Zero-element inputs through every op: right shapes, nothing to move, no hang.
TEST(ZeroElements, EveryOp) {
  run_local(3, [](ProcessGroup& world) {
    const int r = world.rank();
    Tensor z = Tensor::zeros({0, 5}, DType::F32);
    EXPECT_EQ(all_reduce(z, "sum", world).sizes(), (Shape{0, 5}));
    EXPECT_EQ(all_gather_tensor(z, 1, world).sizes(), (Shape{0, 15}));
    EXPECT_EQ(reduce_scatter_tensor(z, "sum", 0, world).sizes(), (Shape{0, 5}));
    EXPECT_EQ(reduce_scatter_tensor(Tensor::zeros({0, 6}, DType::I8), "max", 1, world).sizes(),
              (Shape{0, 2}));
    EXPECT_EQ(all_to_all_single(z, std::nullopt, std::nullopt, world).sizes(), (Shape{0, 5}));
    // Rows without elements still move by their split sizes: everyone sends its 3 to rank 0.
    using Splits = std::vector<int64_t>;
    Tensor empty_rows = Tensor::zeros({3, 0}, DType::F32);
    const Splits to_zero = {3, 0, 0};
    const Splits from_all = r == 0 ? Splits{3, 3, 3} : Splits{0, 0, 0};
    EXPECT_EQ(all_to_all_single(empty_rows, from_all, to_zero, world).sizes(),
              (Shape{r == 0 ? 9 : 0, 0}));
    EXPECT_EQ(broadcast(z, 2, world).sizes(), (Shape{0, 5}));
    EXPECT_EQ(permute_tensor(z, {1, 2, 0}, world).sizes(), (Shape{0, 5}));
    std::vector<Tensor> ag = all_gather_into_tensor_coalesced(
        {z, Tensor::full({}, DType::I8, r), Tensor::zeros({2, 0}, DType::Bool)}, world);
    EXPECT_EQ(ag[0].sizes(), (Shape{0, 5}));
    EXPECT_EQ(ag[1].to_vector<int>(), (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(ag[2].sizes(), (Shape{6, 0}));
    std::vector<Tensor> rs = reduce_scatter_tensor_coalesced(
        {z, Tensor::full({3}, DType::I16, 1), Tensor::zeros({3, 0}, DType::F16)}, "sum", {0, 0, 1},
        world);
    EXPECT_EQ(rs[1].to_vector<int>(), (std::vector<int>{3}));
    EXPECT_EQ(rs[2].sizes(), (Shape{3, 0}));
    std::vector<Tensor> ar = all_reduce_coalesced(
        {z, Tensor::full({}, DType::BF16, 1), Tensor::zeros({0}, DType::U8)}, "sum", world);
    EXPECT_EQ(ar[1].item<float>(), 3.0f);
    EXPECT_EQ(ar[2].sizes(), (Shape{0}));
    std::vector<Tensor> list(3, Tensor());
    for (Tensor& t : list) t = Tensor::zeros({0, 5}, DType::F32);
    all_gather_inplace(list, z, world);
  });
}

// One coalesced call over tensors of different dtypes and sizes, for every reduce op that the
// dtypes share; each output must be what its own collective would give.
TEST(Coalesced, MixedDtypesAndSizes) {
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    const std::vector<DType> dtypes = {DType::F16, DType::I64, DType::BF16,
                                       DType::U8,  DType::F64, DType::Bool};
    const std::vector<Shape> shapes = {{2, 3}, {4}, {3, 2}, {8}, {4, 1}, {4}};
    std::vector<Tensor> in;
    for (size_t i = 0; i < dtypes.size(); ++i) {
      in.push_back(Tensor::full(shapes[i], dtypes[i], dtypes[i] == DType::Bool ? r == 2 : r + 1));
    }
    for (const char* op : {"sum", "product", "min", "max"}) {
      std::vector<Tensor> out = all_reduce_coalesced(in, op, world);
      for (size_t i = 0; i < in.size(); ++i) {
        EXPECT_TRUE(out[i].equal(all_reduce(in[i], op, world))) << op << " " << i;
      }
    }
    std::vector<Tensor> ag = all_gather_into_tensor_coalesced(in, world);
    for (size_t i = 0; i < in.size(); ++i) {
      EXPECT_TRUE(ag[i].equal(all_gather_tensor(in[i], 0, world))) << i;
    }
    // Reduce-scatter needs size(dim) % 4 == 0.
    const std::vector<int64_t> dims = {1, 0, 0, 0, 0, 0};
    std::vector<Tensor> rin = {Tensor::full({2, 4}, DType::F16, r + 1), in[1],
                               Tensor::full({8, 1}, DType::BF16, r + 1), in[3], in[4], in[5]};
    std::vector<Tensor> rs = reduce_scatter_tensor_coalesced(rin, "sum", dims, world);
    for (size_t i = 0; i < rin.size(); ++i) {
      EXPECT_TRUE(rs[i].equal(reduce_scatter_tensor(rin[i], "sum", dims[i], world))) << i;
    }
    EXPECT_EQ(rs[0].to_vector<float>(), repeat(10, 2));
  });
}

TEST(ReduceScatter, AvgOfRankVector) {  // D.7
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::arange(4, DType::F32);
    Tensor out = reduce_scatter_tensor(x, "avg", 0, world);
    EXPECT_EQ(out.sizes(), (Shape{1}));
    EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{static_cast<float>(world.rank())}));
    EXPECT_TRUE(x.equal(Tensor::arange(4, DType::F32)));
  });
}

TEST(ReduceScatter, Coalesced) {  // D.8
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    std::vector<Tensor> inputs;
    for (int i = 1; i <= 3; ++i) inputs.push_back(mul_scalar(Tensor::arange(4, DType::F32), i));
    std::vector<Tensor> outs =
        reduce_scatter_tensor_coalesced(inputs, "avg", std::vector<int64_t>(3, 0), world);
    ASSERT_EQ(outs.size(), 3u);
    for (int i = 1; i <= 3; ++i) {
      EXPECT_EQ(outs[static_cast<size_t>(i - 1)].to_vector<float>(),
                (std::vector<float>{static_cast<float>(r * i)}));
    }
    std::vector<Tensor> ints = {Tensor::full({4}, DType::I64, 1), Tensor::full({4}, DType::I64, 2)};
    std::vector<Tensor> sums = reduce_scatter_tensor_coalesced(ints, "sum", {0, 0}, world);
    wait_tensors(sums);
    EXPECT_EQ(sums[0].to_vector<int64_t>(), (std::vector<int64_t>{4}));
    EXPECT_EQ(sums[1].to_vector<int64_t>(), (std::vector<int64_t>{8}));
    // Mixed scatter dims in one call.
    std::vector<Tensor> mixed = {iota({2, 4}), iota({4, 2})};
    std::vector<Tensor> outs2 = reduce_scatter_tensor_coalesced(mixed, "sum", {1, 0}, world);
    EXPECT_EQ(outs2[0].to_vector<float>(), (std::vector<float>{4.0f * r, 4.0f * (4 + r)}));
    EXPECT_EQ(outs2[1].to_vector<float>(), (std::vector<float>{8.0f * r, 8.0f * r + 4}));
    EXPECT_TRUE(mixed[0].equal(iota({2, 4})));
  });
}

// Scattering along dims 1 and 2 (D.18): rank r's shard is the sum over ranks, sliced at r.
TEST(ReduceScatter, NonZeroDims) {
  run_local(4, [](ProcessGroup& world) {
    for (DType dtype : {DType::I32, DType::I64, DType::F32, DType::F64}) {
      for (int64_t dim : {0, 1, 2, -1}) {
        Shape shape{3, 3, 3};
        const int64_t d = dim < 0 ? dim + 3 : dim;
        shape[static_cast<size_t>(d)] = 8;
        auto input_of = [&](int rank) {
          return Tensor::rand(shape, DType::I32, 7 + rank).to(dtype);
        };
        Tensor x = input_of(world.rank());
        Tensor sum = input_of(0);
        for (int j = 1; j < 4; ++j) sum = add(sum, input_of(j));
        Tensor out = reduce_scatter_tensor(x, "sum", dim, world);
        EXPECT_TRUE(out.equal(sum.narrow(d, 2 * world.rank(), 2)))
            << dtype_name(dtype) << " dim " << dim << ": " << out.to_string();
        EXPECT_TRUE(x.equal(input_of(world.rank())));
      }
    }
    // Only ones precede the scatter dim: the input is sent as is.
    Tensor y = iota({1, 8});
    EXPECT_EQ(reduce_scatter_tensor(y, "sum", 1, world).to_vector<float>(),
              (std::vector<float>{8.0f * world.rank(), 8.0f * world.rank() + 4}));
  });
}

TEST(ReduceScatter, InplaceWritesTheGivenBuffer) {
  run_local(2, [](ProcessGroup& world) {
    Tensor x = iota({2, 4});
    Tensor out = Tensor::zeros({2, 2}, DType::F32);
    const Tensor& ret = reduce_scatter_tensor_inplace(out, x, world, "sum", /*scatter_dim=*/1);
    EXPECT_EQ(&ret, &out);
    const float base = 2.0f * world.rank();
    EXPECT_EQ(out.to_vector<float>(),
              (std::vector<float>{2 * base, 2 * base + 2, 2 * (base + 4), 2 * (base + 4) + 2}));
    Tensor dflt = Tensor::zeros({1, 4}, DType::F32);
    reduce_scatter_tensor_inplace(dflt, x, world);  // sum over dim 0
    EXPECT_EQ(
        dflt.to_vector<float>(),
        (std::vector<float>{
            static_cast<float>(8 * world.rank()), static_cast<float>(8 * world.rank() + 2),
            static_cast<float>(8 * world.rank() + 4), static_cast<float>(8 * world.rank() + 6)}));
  });
}

// D.15's other side: the seed rearranges a scatter_dim != 0 input by chunk + cat (a contiguous
// copy) before the native op checks contiguity, so only scatter_dim 0 needs a contiguous input.
TEST(ReduceScatter, NonContiguousInputAlongAnotherDim) {
  run_local(2, [](ProcessGroup& world) {
    const int r = world.rank();
    Tensor x = iota({4, 6}).transpose(0, 1);  // [6,4], strides [1,6]
    ASSERT_FALSE(x.is_contiguous());
    const Tensor sum = mul_scalar(x.contiguous(), 2);
    EXPECT_TRUE(reduce_scatter_tensor(x, "sum", 1, world).equal(sum.narrow(1, 2 * r, 2)));
    EXPECT_TRUE(reduce_scatter_tensor(x, "sum", -1, world).equal(sum.narrow(1, 2 * r, 2)));
    // -2 is dim 0, but not the literal 0 the seed sends as is: rearranged, so accepted.
    EXPECT_TRUE(reduce_scatter_tensor(x, "sum", -2, world).equal(sum.narrow(0, 3 * r, 3)));
    // Only ones precede the dim (no rearrangement, just the copy), and a 3-d input.
    Tensor y = iota({8, 2}).narrow(1, 0, 1).transpose(0, 1);  // [1,8], strides [1,2]
    ASSERT_FALSE(y.is_contiguous());
    EXPECT_TRUE(reduce_scatter_tensor(y, "max", 1, world).equal(y.narrow(1, 4 * r, 4)));
    Tensor z = iota({2, 3, 4}).permute({2, 0, 1});  // [4,2,3]
    EXPECT_TRUE(reduce_scatter_tensor(z, "sum", 1, world)
                    .equal(mul_scalar(z.contiguous(), 2).narrow(1, r, 1)));
    std::vector<Tensor> outs = reduce_scatter_tensor_coalesced({x, z}, "sum", {1, 1}, world);
    EXPECT_TRUE(outs[0].equal(sum.narrow(1, 2 * r, 2)));
    EXPECT_TRUE(outs[1].equal(mul_scalar(z.contiguous(), 2).narrow(1, r, 1)));
    Tensor into = Tensor::zeros({6, 2}, DType::F32);
    reduce_scatter_tensor_inplace(into, x, world, "sum", /*scatter_dim=*/1);
    EXPECT_TRUE(into.equal(sum.narrow(1, 2 * r, 2)));
    EXPECT_TRUE(x.equal(iota({4, 6}).transpose(0, 1)));
    // Scattering along dim 0 sends the input as is: it must be contiguous.
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor(x, "sum", 0, world); }),
                HasSubstr("Tensor must be contiguous for reduce_scatter_tensor"));
    EXPECT_THAT(error_of([&] {
                  reduce_scatter_tensor_coalesced({x, x}, "sum", {1, 0}, world);
                }),
                HasSubstr("Tensor must be contiguous for reduce_scatter_tensor_coalesced for "
                          "tensor at index 1"));
  });
}

// The rearranged input of a scatter_dim != 0 has the seed's chunk + cat shape however it was
// made, since ranks compare the collective's shape: a contiguous input on one rank and a
// non-contiguous one on another pair (they failed as a mismatch: [4,4] against [8,2]), and
// ranks that disagree on scatter_dim fail (they paired silently: wrong sums on both).
TEST(ReduceScatter, RanksMayDifferInContiguityButNotInScatterDim) {
  run_local(2, [](ProcessGroup& world) {
    const int r = world.rank();
    // A copy of `t` with transposed strides on rank 1; `t` itself on rank 0.
    auto on_rank = [&](const Tensor& t) {
      if (r == 0) return t;
      Tensor strided = Tensor::empty({t.size(1), t.size(0)}, t.dtype()).transpose(0, 1);
      strided.copy_(t);
      return strided;
    };
    const Tensor x = on_rank(iota({4, 4}));
    EXPECT_EQ(x.is_contiguous(), r == 0);
    const Tensor sum = mul_scalar(iota({4, 4}), 2);
    EXPECT_TRUE(reduce_scatter_tensor(x, "sum", 1, world).equal(sum.narrow(1, 2 * r, 2)));
    // Only ones before the dim.
    const Tensor y = on_rank(iota({1, 8}));
    const Tensor y_sum = mul_scalar(iota({1, 8}), 2);
    EXPECT_TRUE(reduce_scatter_tensor(y, "sum", 1, world).equal(y_sum.narrow(1, 4 * r, 4)));
    std::vector<Tensor> outs = reduce_scatter_tensor_coalesced({x, y}, "sum", {1, -1}, world);
    EXPECT_TRUE(outs[0].equal(sum.narrow(1, 2 * r, 2)));
    EXPECT_TRUE(outs[1].equal(y_sum.narrow(1, 4 * r, 4)));
  });
  for (const bool coalesced : {false, true}) {
    SCOPED_TRACE(coalesced);
    run_local(2, [&](ProcessGroup& world) {
      const int64_t dim = world.rank() == 0 ? 0 : 1;
      const std::string what = error_of([&] {
        if (coalesced) {
          reduce_scatter_tensor_coalesced({iota({4, 4})}, "sum", {dim}, world).front().wait();
        } else {
          reduce_scatter_tensor(iota({4, 4}), "sum", dim, world).wait();
        }
      });
      EXPECT_THAT(what, HasSubstr("mismatched collectives"));
      EXPECT_THAT(what, HasSubstr("f32[4,4]"));
      EXPECT_THAT(what, HasSubstr("f32[8,2]"));
    });
  }
}

// D.9: rank r sends S[r][j] rows to rank j; row k of rank r's input holds 1000 r + 10 k + c.
TEST(AllToAll, RandomSplitMatrix) {
  constexpr int kW = 4;
  constexpr int64_t kCols = 2;
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int64_t> dist(0, 4);
  std::vector<std::vector<int64_t>> s(kW, std::vector<int64_t>(kW));
  for (auto& row : s) {
    for (auto& v : row) v = dist(rng);
  }
  s[1][2] = 0;  // at least one empty block
  run_local(kW, [&](ProcessGroup& world) {
    const int r = world.rank();
    auto input_of = [&](int rank) {
      int64_t rows = 0;
      for (int64_t v : s[static_cast<size_t>(rank)]) rows += v;
      std::vector<float> v;
      for (int64_t k = 0; k < rows; ++k) {
        for (int64_t c = 0; c < kCols; ++c)
          v.push_back(static_cast<float>(1000 * rank + 10 * k + c));
      }
      return Tensor::from_vector(v, {rows, kCols});
    };
    std::vector<int64_t> in_splits = s[static_cast<size_t>(r)];
    std::vector<int64_t> out_splits;
    for (int j = 0; j < kW; ++j)
      out_splits.push_back(s[static_cast<size_t>(j)][static_cast<size_t>(r)]);
    Tensor x = input_of(r);
    Tensor out = all_to_all_single(x, out_splits, in_splits, world);
    std::vector<float> expect;
    for (int j = 0; j < kW; ++j) {
      int64_t offset = 0;
      for (int k = 0; k < r; ++k) offset += s[static_cast<size_t>(j)][static_cast<size_t>(k)];
      for (int64_t k = offset; k < offset + s[static_cast<size_t>(j)][static_cast<size_t>(r)];
           ++k) {
        for (int64_t c = 0; c < kCols; ++c)
          expect.push_back(static_cast<float>(1000 * j + 10 * k + c));
      }
    }
    EXPECT_EQ(out.sizes()[1], kCols);
    EXPECT_EQ(out.to_vector<float>(), expect);
    EXPECT_TRUE(x.equal(input_of(r)));

    Tensor into = Tensor::zeros(out.sizes(), DType::F32);
    const Tensor& ret = all_to_all_inplace(into, x, out_splits, in_splits, world);
    EXPECT_EQ(&ret, &into);
    EXPECT_TRUE(into.equal(out));
  });
}

TEST(AllToAll, EvenSplitWhenNoSizesGiven) {  // D.10
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({4, 4}, DType::F32, world.rank() + 1);
    Tensor out = all_to_all_single(x, std::nullopt, std::nullopt, world);
    ASSERT_EQ(out.sizes(), (Shape{4, 4}));
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(out.select(0, j).to_vector<float>(), repeat(static_cast<float>(j + 1), 4));
    }
    Tensor two_rows = iota({8, 3}, static_cast<float>(100 * world.rank()));
    Tensor out2 = all_to_all_single(two_rows, std::nullopt, std::nullopt, world);
    std::vector<float> expect;
    for (int j = 0; j < 4; ++j) {
      for (int k = 0; k < 6; ++k)
        expect.push_back(static_cast<float>(100 * j + 6 * world.rank() + k));
    }
    EXPECT_EQ(out2.to_vector<float>(), expect);
  });
}

TEST(Broadcast, FromRankOneIsANewTensor) {  // D.12
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({3, 3}, DType::F32, world.rank());
    Tensor out = broadcast(x, 1, world);
    EXPECT_FALSE(out.shares_storage(x));
    EXPECT_EQ(out.to_vector<float>(), repeat(1, 9));
    EXPECT_TRUE(x.equal(Tensor::full({3, 3}, DType::F32, world.rank())));
    EXPECT_THAT(error_of([&] { broadcast(x, 4, world); }),
                HasSubstr("broadcast: src 4 is not a rank of group 'world' of size 4"));
  });
}

TEST(PermuteTensor, RingShift) {  // D.19
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    Tensor x = iota({2, 3}, static_cast<float>(100 * r));
    Tensor out = permute_tensor(x, {1, 2, 3, 0}, world);
    EXPECT_EQ(out.sizes(), (Shape{2, 3}));
    EXPECT_TRUE(out.equal(iota({2, 3}, static_cast<float>(100 * ((r + 3) % 4)))));
    EXPECT_TRUE(x.equal(iota({2, 3}, static_cast<float>(100 * r))));
    // 0-d and non-contiguous inputs; the identity permutation.
    Tensor scalar = Tensor::full({}, DType::I32, r);
    EXPECT_EQ(permute_tensor(scalar, {3, 0, 1, 2}, world).item<int32_t>(), (r + 1) % 4);
    Tensor xt = x.transpose(0, 1);
    EXPECT_TRUE(permute_tensor(xt, {0, 1, 2, 3}, world).equal(xt));
  });
}

// Peers whose tensors differ are refused in terms of the tensors: rows of dim 0, and the row
// shape (it exchanges rows, not elements: [2,3] and [3,2] would otherwise swap data into the
// wrong shape, and rows of [3] and of [1,3], alike in size, were paired silently).
TEST(PermuteTensor, PeersWithOtherShapesAreRefusedInRows) {
  for (const Shape& other : {Shape{3, 3}, Shape{3, 2}, Shape{2, 1, 3}}) {
    std::vector<std::string> messages(2);
    run_local(2, [&](ProcessGroup& world) {
      const Shape mine = world.rank() == 0 ? Shape{2, 3} : other;
      try {
        permute_tensor(Tensor::full(mine, DType::F32, 1.0), {1, 0}, world).wait();
      } catch (const CommError& e) {
        messages[static_cast<size_t>(world.rank())] = e.what();
      }
    });
    // Whichever rank's check runs first words it, from its side or the other's.
    for (const std::string& m : messages) {
      if (other[0] == 3 && other[1] == 3) {
        EXPECT_THAT(m, AnyOf(HasSubstr("rank 1 sends 3 rows to rank 0 but rank 0 expects 2 rows"),
                             HasSubstr("rank 0 sends 2 rows to rank 1 but rank 1 expects 3 rows")));
      } else {
        const std::string theirs = other.size() == 3 ? "f32[*,1,3]" : "f32[*,2]";
        EXPECT_THAT(m, AnyOf(HasSubstr("mismatched collectives: rank 0 issued all_to_all(f32[*,3]) "
                                       "but rank 1 issued all_to_all(" + theirs + ")"),
                             HasSubstr("mismatched collectives: rank 1 issued all_to_all(" +
                                       theirs + ") but rank 0 issued all_to_all(f32[*,3])")));
      }
    }
  }
}

TEST(WorldSizeOne, EveryOpIsTheIdentity) {
  run_local(1, [](ProcessGroup& world) {
    Tensor x = iota({2, 3, 4});
    EXPECT_TRUE(all_reduce(x, "sum", world).equal(x));
    EXPECT_TRUE(all_gather_tensor(x, 2, world).equal(x));
    EXPECT_TRUE(reduce_scatter_tensor(x, "avg", 1, world).equal(x));
    EXPECT_TRUE(all_to_all_single(x, std::nullopt, std::nullopt, world).equal(x));
    EXPECT_TRUE(
        all_to_all_single(x, std::vector<int64_t>{2}, std::vector<int64_t>{2}, world).equal(x));
    EXPECT_TRUE(broadcast(x, 0, world).equal(x));
    EXPECT_TRUE(permute_tensor(x, {0}, world).equal(x));
    EXPECT_TRUE(all_gather_into_tensor_coalesced({x, x}, world)[1].equal(x));
    EXPECT_TRUE(reduce_scatter_tensor_coalesced({x}, "max", {2}, world)[0].equal(x));
    std::vector<Tensor> list = {Tensor::zeros({2, 3, 4}, DType::F32)};
    all_gather_inplace(list, x, world);
    EXPECT_TRUE(list[0].equal(x));
  });
}

// Meta inputs outside a tracer: PyTorch's meta kernels (REFERENCE A: all_reduce empty_like,
// all_gather dim times group_size with 0-d -> [group_size], reduce_scatter divided, all_to_all
// the sum of output splits, in-place forms their output). The same checks run, and nothing is
// issued: only even ranks make meta calls, and the collective after them pairs.
TEST(Meta, EagerCollectivesOnMetaTensorsGiveMetaResultsOfTheirShapes) {
  run_local(4, [](ProcessGroup& world) {
    const int rank = world.rank();
    if (rank % 2 == 0) {
      using Splits = std::vector<int64_t>;
      const Tensor m = Tensor::meta({4, 6}, DType::BF16);
      auto is_meta_of = [](const Tensor& t, const Shape& shape) {
        return t.is_meta() && t.sizes() == shape && t.dtype() == DType::BF16;
      };
      EXPECT_TRUE(is_meta_of(all_reduce(m, "avg", world), {4, 6}));
      EXPECT_TRUE(is_meta_of(all_reduce_autograd(m, "sum", world), {4, 6}));
      EXPECT_TRUE(is_meta_of(all_gather_tensor(m, 1, world), {4, 24}));
      EXPECT_TRUE(is_meta_of(all_gather_tensor(Tensor::meta({}, DType::BF16), 0, world), {4}));
      EXPECT_TRUE(is_meta_of(reduce_scatter_tensor(m, "sum", 0, world), {1, 6}));
      EXPECT_TRUE(is_meta_of(all_to_all_single(m, Splits{0, 3, 1, 2}, Splits{1, 1, 1, 1}, world),
                             {6, 6}));
      EXPECT_TRUE(is_meta_of(all_to_all_single(m, std::nullopt, std::nullopt, world), {4, 6}));
      EXPECT_TRUE(is_meta_of(broadcast(m, 3, world), {4, 6}));
      EXPECT_TRUE(is_meta_of(permute_tensor(m, {1, 2, 3, 0}, world), {4, 6}));
      const std::vector<Tensor> ms = {m, Tensor::meta({8}, DType::BF16)};
      const std::vector<Tensor> ar = all_reduce_coalesced(ms, "sum", world);
      EXPECT_TRUE(is_meta_of(ar[0], {4, 6}) && is_meta_of(ar[1], {8}));
      const std::vector<Tensor> ag = all_gather_into_tensor_coalesced(ms, world);
      EXPECT_TRUE(is_meta_of(ag[0], {16, 6}) && is_meta_of(ag[1], {32}));
      const std::vector<Tensor> rs = reduce_scatter_tensor_coalesced(ms, "sum", {0, 0}, world);
      EXPECT_TRUE(is_meta_of(rs[0], {1, 6}) && is_meta_of(rs[1], {2}));
      EXPECT_TRUE(is_meta_of(wait_tensor(ar[0]), {4, 6}));
      // In place: the output stays as it is.
      EXPECT_TRUE(is_meta_of(all_reduce_inplace(m, "sum", world), {4, 6}));
      const Tensor gathered = Tensor::meta({16, 6}, DType::BF16);
      EXPECT_TRUE(is_meta_of(all_gather_tensor_inplace(gathered, m, world), {16, 6}));
      std::vector<Tensor> list(4, Tensor::meta({4, 6}, DType::BF16));
      all_gather_inplace(list, m, world);
      EXPECT_TRUE(is_meta_of(list[3], {4, 6}));
      // The checks of the eager path, meta or not.
      EXPECT_THAT(error_of([&] { reduce_scatter_tensor(m, "sum", 1, world); }),
                  HasSubstr("input dimension 1 (6) must be a multiple of group_size 4"));
      EXPECT_THAT(error_of([&] { all_reduce(m, "bxor", world); }),
                  HasSubstr("reduce_op bxor is not supported for floating dtype bf16"));
      EXPECT_THAT(error_of([&] { all_gather_tensor(m.transpose(0, 1), 0, world); }),
                  HasSubstr("Tensor must be contiguous"));
      EXPECT_THAT(error_of([&] { all_to_all_single(m, Splits{4, 0, 0, 0}, Splits{5}, world); }),
                  HasSubstr("input_split_sizes"));
      EXPECT_THAT(error_of([&] { broadcast(m, 4, world); }), HasSubstr("src 4 is not a rank"));
      EXPECT_THAT(error_of([&] { all_reduce(m, "sum", "no_such_group"); }),
                  HasSubstr("no_such_group"));
      EXPECT_THAT(error_of([&] {
                    all_reduce_coalesced({m, Tensor::zeros({2}, DType::BF16)}, "sum", world);
                  }),
                  HasSubstr("all_reduce_coalesced: 1 of the 2 inputs are meta tensors (no data) "
                            "and the others are not"));
      EXPECT_THAT(error_of([&] {
                    all_gather_tensor_inplace(Tensor::zeros({16, 6}, DType::BF16), m, world);
                  }),
                  HasSubstr("all_gather_tensor_inplace: the input is a meta tensor (no data) and "
                            "the output is not"));
    }
    const Tensor sum = all_reduce(Tensor::full({2}, DType::I32, rank), "sum", world);
    EXPECT_EQ(sum.to_vector<int32_t>(), (std::vector<int32_t>{6, 6})) << "rank " << rank;
  });
}

TEST(AllGatherInplace, SlicesIntoTheList) {
  run_local(3, [](ProcessGroup& world) {
    Tensor x = Tensor::full({2}, DType::I32, world.rank() + 1);
    std::vector<Tensor> list;
    for (int j = 0; j < 3; ++j) list.push_back(Tensor::zeros({2}, DType::I32));
    all_gather_inplace(list, x, world);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(list[static_cast<size_t>(j)].to_vector<int32_t>(),
                (std::vector<int32_t>{j + 1, j + 1}));
    }
    // 0-d tensors are indexed, not sliced.
    std::vector<Tensor> scalars;
    for (int j = 0; j < 3; ++j) scalars.push_back(Tensor::zeros({}, DType::I32));
    all_gather_inplace(scalars, Tensor::full({}, DType::I32, 10 * world.rank()), world);
    for (int j = 0; j < 3; ++j) EXPECT_EQ(scalars[static_cast<size_t>(j)].item<int32_t>(), 10 * j);
  });
}

// Every collective leaves its inputs as they were (DESIGN §2), on every rank, src included.
TEST(Inputs, AreNeverModified) {
  run_local(4, [](ProcessGroup& world) {
    const float base = static_cast<float>(100 * world.rank());
    Tensor x = iota({4, 4}, base);
    Tensor xt = iota({4, 4}, base).transpose(0, 1);
    const Tensor x0 = x.clone();
    const Tensor xt0 = xt.clone();
    std::vector<Tensor> results = {
        all_reduce(x, "sum", world), all_reduce(xt, "max", world), all_gather_tensor(x, 0, world),
        all_gather_tensor(x, 1, world), reduce_scatter_tensor(x, "sum", 0, world),
        reduce_scatter_tensor(x, "avg", 1, world),
        all_to_all_single(x, std::nullopt, std::nullopt, world),
        // Everyone sends its 4 rows to rank 0.
        all_to_all_single(x, std::vector<int64_t>(4, world.rank() == 0 ? 4 : 0),
                          std::vector<int64_t>{4, 0, 0, 0}, world),
        broadcast(x, 2, world), permute_tensor(x, {2, 3, 0, 1}, world),
        permute_tensor(xt, {2, 3, 0, 1}, world)};
    for (const Tensor& t : all_reduce_coalesced({x, xt}, "sum", world)) results.push_back(t);
    for (const Tensor& t : all_gather_into_tensor_coalesced({x, x}, world)) results.push_back(t);
    for (const Tensor& t : reduce_scatter_tensor_coalesced({x, x}, "sum", {0, 1}, world)) {
      results.push_back(t);
    }
    wait_tensors(results);
    Tensor out = Tensor::zeros({16, 4}, DType::F32);
    all_gather_tensor_inplace(out, x, world);
    Tensor rs_out = Tensor::zeros({1, 4}, DType::F32);
    reduce_scatter_tensor_inplace(rs_out, x, world);
    Tensor a2a_out = Tensor::zeros({4, 4}, DType::F32);
    all_to_all_inplace(a2a_out, x, std::nullopt, std::nullopt, world);
    std::vector<Tensor> list(4, Tensor());
    for (auto& t : list) t = Tensor::zeros({4, 4}, DType::F32);
    all_gather_inplace(list, x, world);
    EXPECT_TRUE(x.equal(x0));
    EXPECT_TRUE(xt.equal(xt0));
    EXPECT_FALSE(xt.is_contiguous());
    EXPECT_EQ(xt.strides(), (Shape{1, 4}));
  });
}

// The in-place remaps write through strided views of a larger buffer and touch nothing else.
TEST(Inplace, IntoStridedViews) {
  run_local(2, [](ProcessGroup& world) {
    const int r = world.rank();
    Tensor m = iota({3, 4}, static_cast<float>(100 * r));
    Tensor col = m.narrow(1, 1, 1);  // [3,1], stride 4
    all_reduce_inplace(col, "sum", world);
    EXPECT_EQ(m.to_vector<float>(),
              (std::vector<float>{0.0f + 100 * r, 102, 2.0f + 100 * r, 3.0f + 100 * r,
                                  4.0f + 100 * r, 110, 6.0f + 100 * r, 7.0f + 100 * r,
                                  8.0f + 100 * r, 118, 10.0f + 100 * r, 11.0f + 100 * r}));
    // The gathered rows land in the columns of one buffer.
    Tensor buf = Tensor::zeros({2, 2}, DType::I32);
    all_gather_inplace({buf.select(1, 0), buf.select(1, 1)},
                       Tensor::from_vector<int32_t>({r + 1, 10 * (r + 1)}, {2}), world);
    EXPECT_EQ(buf.to_vector<int32_t>(), (std::vector<int32_t>{1, 2, 10, 20}));
    Tensor gathered = Tensor::zeros({3, 4}, DType::F32);
    all_gather_tensor_inplace(gathered.transpose(0, 1), iota({2, 3}, 10.0f * r), world);
    EXPECT_TRUE(gathered.transpose(0, 1).equal(Tensor::cat({iota({2, 3}, 0), iota({2, 3}, 10)})));
    Tensor exchanged = Tensor::zeros({2, 2}, DType::F32);
    all_to_all_inplace(exchanged.transpose(0, 1), iota({2, 2}, 10.0f * r), std::nullopt,
                       std::nullopt, world);
    EXPECT_TRUE(exchanged.transpose(0, 1).equal(
        Tensor::cat({iota({2, 2}, 0).narrow(0, r, 1), iota({2, 2}, 10).narrow(0, r, 1)})));
    Tensor shard = Tensor::zeros({2, 3}, DType::F32);
    reduce_scatter_tensor_inplace(shard.narrow(0, 1, 1), iota({2, 3}), world);
    EXPECT_EQ(shard.to_vector<float>(),
              (std::vector<float>{0, 0, 0, 6.0f * r, 6.0f * r + 2, 6.0f * r + 4}));
  });
}

// Views as inputs: a narrowed (contiguous, storage offset > 0) and an expanded (stride 0) one.
TEST(Inputs, NarrowedAndExpandedViews) {
  run_local(2, [](ProcessGroup& world) {
    const int r = world.rank();
    auto rows_of = [](int rank) { return iota({8, 4}, 100.0f * rank).narrow(0, 4, 4); };
    Tensor x = rows_of(r);
    ASSERT_TRUE(x.is_contiguous());
    ASSERT_EQ(x.storage_offset(), 16);
    const Tensor both = add(rows_of(0), rows_of(1));
    EXPECT_TRUE(all_reduce(x, "sum", world).equal(both));
    EXPECT_TRUE(all_gather_tensor(x, 0, world).equal(Tensor::cat({rows_of(0), rows_of(1)}, 0)));
    EXPECT_TRUE(all_gather_tensor(x, 1, world).equal(Tensor::cat({rows_of(0), rows_of(1)}, 1)));
    EXPECT_TRUE(reduce_scatter_tensor(x, "sum", 0, world).equal(both.narrow(0, 2 * r, 2)));
    EXPECT_TRUE(reduce_scatter_tensor(x, "sum", 1, world).equal(both.narrow(1, 2 * r, 2)));
    EXPECT_TRUE(broadcast(x, 1, world).equal(rows_of(1)));
    EXPECT_TRUE(all_to_all_single(x, std::nullopt, std::nullopt, world)
                    .equal(Tensor::cat({rows_of(0).narrow(0, 2 * r, 2),
                                        rows_of(1).narrow(0, 2 * r, 2)})));
    std::vector<Tensor> ag = all_gather_into_tensor_coalesced({x, x.narrow(0, 1, 1)}, world);
    EXPECT_TRUE(ag[1].equal(Tensor::cat({rows_of(0).narrow(0, 1, 1), rows_of(1).narrow(0, 1, 1)})));
    std::vector<Tensor> rs = reduce_scatter_tensor_coalesced({x, x}, "sum", {1, 0}, world);
    EXPECT_TRUE(rs[0].equal(both.narrow(1, 2 * r, 2)));
    EXPECT_TRUE(rs[1].equal(both.narrow(0, 2 * r, 2)));

    Tensor e = Tensor::full({1, 3}, DType::F32, r + 1).expand({4, 3});
    EXPECT_EQ(all_reduce(e, "sum", world).to_vector<float>(), repeat(3, 12));
    EXPECT_EQ(all_reduce_coalesced({e}, "max", world)[0].to_vector<float>(), repeat(2, 12));
    EXPECT_EQ(broadcast(e, 1, world).to_vector<float>(), repeat(2, 12));
    EXPECT_EQ(permute_tensor(e, {1, 0}, world).to_vector<float>(), repeat(2.0f - r, 12));
    Tensor e4 = Tensor::full({1, 4}, DType::F32, r + 1).expand({3, 4});
    EXPECT_TRUE(reduce_scatter_tensor(e4, "sum", 1, world)
                    .equal(Tensor::full({3, 2}, DType::F32, 3)));
    EXPECT_THAT(error_of([&] { all_gather_tensor(e, 0, world); }),
                HasSubstr("Tensor must be contiguous for all_gather_tensor"));
    // Writing the result back into an expanded view would write one element many times.
    EXPECT_THAT(error_of([&] { all_reduce_inplace(e, "sum", world); }),
                HasSubstr("refers to a single memory location"));
    EXPECT_EQ(all_reduce(x, "sum", world).to_vector<float>(), both.to_vector<float>());
  });
}

// A result still pending on its collective can feed the next collective at once: the input is
// waited before the backend reads it.
TEST(Inputs, PendingResultsFeedTheNextCollective) {
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({4, 2}, DType::F32, world.rank() + 1);
    Tensor s = all_reduce(x, "sum", world);                 // 10 everywhere
    Tensor g = all_gather_tensor(s, 1, world);              // lazy, [4, 8]
    Tensor rs = reduce_scatter_tensor(g, "sum", 1, world);  // [4, 2] of 40
    Tensor p = permute_tensor(rs, {1, 2, 3, 0}, world);
    Tensor a = all_to_all_single(p, std::nullopt, std::nullopt, world);
    Tensor b = broadcast(a, 3, world);
    std::vector<Tensor> c = all_gather_into_tensor_coalesced({b, s}, world);
    std::vector<Tensor> d = reduce_scatter_tensor_coalesced({c[0], c[1]}, "max", {0, 0}, world);
    EXPECT_EQ(d[0].to_vector<float>(), repeat(40, 8));
    EXPECT_EQ(d[1].to_vector<float>(), repeat(10, 8));
  });
}

// ---- errors (D.11, 13-17) ----

// A rank that catches a collective's error owns the object it caught. Here rank 0's result is
// a temporary, gone before its handler runs, and rank 1 drops the collective last, on its own
// thread, while rank 0 may still read what it caught. (ThreadSanitizer reported the shared
// error object as a race: exception_ptr's reference count is invisible to it.)
TEST(Errors, ACaughtErrorIsTheCatchersOwn) {
  for (int i = 0; i < 100; ++i) {
    std::vector<std::string> messages(2);
    run_local(2, [&](ProcessGroup& world) {
      Tensor x = Tensor::full({world.rank() == 0 ? 16 : 17}, DType::F32, 1.0);
      if (world.rank() == 0) {
        try {
          (void)all_gather_tensor(x, 0, world).to_vector<float>();
        } catch (const CommError& e) {
          messages[0] = e.what();
        }
      } else {
        Tensor y = all_gather_tensor(x, 0, world);
        try {
          y.wait();
        } catch (const CommError& e) {
          messages[1] = e.what();
        }
        std::this_thread::sleep_for(std::chrono::microseconds(i % 7 * 100));
        y = Tensor();  // the last reference to the collective and its error
      }
    });
    EXPECT_THAT(messages[0], HasSubstr("mismatched collectives"));
    EXPECT_EQ(messages[0], messages[1]);
  }
}

TEST(Errors, SeedMessages) {
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({4, 6}, DType::F32, 1);
    Tensor nc = x.transpose(0, 1);
    EXPECT_THAT(error_of([&] {
                  reduce_scatter_tensor(Tensor::zeros({3, 3, 3}, DType::F32), "sum", 1, world);
                }),
                HasSubstr("input dimension 1 (3) must be a multiple of group_size 4"));
    // D.15: non-contiguous inputs.
    EXPECT_THAT(error_of([&] { all_gather_tensor(nc, 0, world); }),
                HasSubstr("Tensor must be contiguous for all_gather_tensor"));
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor(nc, "sum", 0, world); }),
                HasSubstr("Tensor must be contiguous for reduce_scatter_tensor"));
    EXPECT_THAT(error_of([&] { all_to_all_single(nc, std::nullopt, std::nullopt, world); }),
                HasSubstr("Tensor must be contiguous for all_to_all_single"));
    EXPECT_THAT(error_of([&] {
                  all_gather_into_tensor_coalesced({x, nc}, world);
                }),
                HasSubstr("Tensor must be contiguous for all_gather_into_tensor_coalesced for "
                          "tensor at index 1"));
    EXPECT_THROW(all_gather_tensor(nc, 0, world), InvalidArgument);
    // D.16: non-divisible scatter dims name the dim they checked.
    Tensor six = Tensor::full({6, 4}, DType::F32, 1);
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor(six, "sum", 0, world); }),
                HasSubstr("input dimension 0 (6) must be a multiple of group_size 4"));
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor(x, "sum", 1, world); }),
                HasSubstr("input dimension 1 (6) must be a multiple of group_size 4"));
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor(x, "sum", -1, world); }),
                HasSubstr("input dimension 1 (6) must be a multiple of group_size 4"));
    EXPECT_THROW(reduce_scatter_tensor(six, "sum", 0, world), ShapeError);
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor_inplace(x, six, world); }),
                HasSubstr("input dimension 0 (6) must be a multiple of group_size 4"));
    // D.17: coalesced reduce_scatter.
    EXPECT_THAT(error_of([&] {
                  reduce_scatter_tensor_coalesced({x, x}, "sum", {0}, world);
                }),
                HasSubstr("Length of scatter_dim (1) must equal length of inputs (2)"));
    EXPECT_THAT(error_of([&] {
                  reduce_scatter_tensor_coalesced({x, six}, "sum", {0, 0}, world);
                }),
                HasSubstr("input dimension 0 (6) must be a multiple of group_size 4 for tensor at "
                          "index 1"));
    EXPECT_THAT(error_of([&] {
                  reduce_scatter_tensor_coalesced({x, x}, "sum", {0, 1}, world);
                }),
                HasSubstr("input dimension 1 (6) must be a multiple of group_size 4 for tensor at "
                          "index 1"));
    // D.11: one split list alone.
    const std::vector<int64_t> ones = {1, 1, 1, 1};
    EXPECT_THAT(error_of([&] { all_to_all_single(x, ones, std::nullopt, world); }),
                HasSubstr("output_split_sizes and input_split_sizes must either be specified "
                          "together or both set to None"));
    EXPECT_THAT(error_of([&] { all_to_all_single(x, std::nullopt, ones, world); }),
                HasSubstr("must either be specified together or both set to None"));
    // D.13: unknown reduce ops.
    EXPECT_THAT(error_of([&] { all_reduce(x, "foo", world); }),
                HasSubstr("Unrecognized reduce_op: foo"));
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor(x, "premul_sum", 0, world); }),
                HasSubstr("Unrecognized reduce_op: premul_sum"));
    EXPECT_THAT(error_of([&] { all_reduce_coalesced({x}, "unused", world); }),
                HasSubstr("Unrecognized reduce_op: unused"));
    EXPECT_THROW(all_reduce(x, "foo", world), InvalidArgument);
    // all_gather_inplace of differently sized tensors.
    std::vector<Tensor> list(4, Tensor::zeros({4, 6}, DType::F32));
    list[2] = Tensor::zeros({3, 6}, DType::F32);
    EXPECT_THAT(error_of([&] { all_gather_inplace(list, x, world); }),
                HasSubstr("Remapping variable size all_gather is not yet supported"));
    std::vector<Tensor> short_list(3, Tensor::zeros({4, 6}, DType::F32));
    EXPECT_THAT(error_of([&] { all_gather_inplace(short_list, x, world); }),
                HasSubstr("tensor_list has 3 tensors, expected group_size 4"));
    // D.26: an empty wait list.
    EXPECT_THAT(error_of([] { wait_tensors({}); }),
                HasSubstr("wait_tensors requires at least one tensor"));
  });
}

TEST(Errors, BitwiseOpsNeedIntegers) {  // D.14's counterpart: funcol has no complex dtypes
  run_local(2, [](ProcessGroup& world) {
    for (DType dtype : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
      Tensor x = Tensor::full({4}, dtype, 1);
      for (const char* op : {"band", "BOR", "bxor"}) {
        EXPECT_THROW(all_reduce(x, op, world), InvalidArgument) << op;
        EXPECT_THROW(reduce_scatter_tensor(x, op, 0, world), InvalidArgument) << op;
        EXPECT_THROW(all_reduce_coalesced({x}, op, world), InvalidArgument) << op;
        EXPECT_THROW(reduce_scatter_tensor_coalesced({x}, op, {0}, world), InvalidArgument) << op;
      }
      EXPECT_THAT(error_of([&] { all_reduce(x, "band", world); }),
                  HasSubstr(std::string(dtype_name(dtype))));
    }
    // The same ops are fine on integers.
    Tensor i = Tensor::full({4}, DType::U8, world.rank() + 1);
    EXPECT_EQ(all_reduce(i, "bxor", world).to_vector<int32_t>(), std::vector<int32_t>(4, 3));
  });
}

TEST(Errors, ShapesSplitsAndArguments) {
  run_local(4, [](ProcessGroup& world) {
    Tensor x = iota({4, 6});
    Tensor scalar = Tensor::full({}, DType::F32, 1);
    EXPECT_THAT(error_of([&] { all_gather_tensor(x, 2, world); }),
                HasSubstr("gather_dim 2 is out of range for a 2-d input"));
    EXPECT_THAT(error_of([&] { all_gather_tensor(x, -3, world); }),
                HasSubstr("gather_dim -3 is out of range"));
    EXPECT_THAT(error_of([&] { all_gather_tensor(scalar, 1, world); }),
                HasSubstr("gather_dim 1 is out of range for a 0-d input"));
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor(x, "sum", 5, world); }),
                HasSubstr("scatter_dim 5 is out of range"));
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor(scalar, "sum", 0, world); }),
                HasSubstr("reduce_scatter_tensor: input must have at least one dimension"));
    EXPECT_THAT(error_of([&] { all_to_all_single(scalar, std::nullopt, std::nullopt, world); }),
                HasSubstr("all_to_all_single: input must have at least one dimension"));
    EXPECT_THAT(error_of([&] { all_to_all_single(iota({6}), std::nullopt, std::nullopt, world); }),
                HasSubstr("input dimension 0 (6) must be a multiple of group_size 4"));
    using Splits = std::vector<int64_t>;
    EXPECT_THAT(error_of([&] {
                  all_to_all_single(x, Splits{1, 1, 1, 1}, Splits{2, -1, 2, 1}, world);
                }),
                HasSubstr("input_split_sizes[1] is negative (-1)"));
    EXPECT_THAT(error_of([&] {
                  all_to_all_single(x, Splits{1, 1, 1, -1}, Splits{1, 1, 1, 1}, world);
                }),
                HasSubstr("output_split_sizes[3] is negative (-1)"));
    EXPECT_THAT(error_of([&] {
                  all_to_all_single(x, Splits{1, 1, 1}, Splits{1, 1, 1, 1}, world);
                }),
                HasSubstr("output_split_sizes has 3 entries, expected group_size 4"));
    EXPECT_THAT(error_of([&] {
                  all_to_all_single(x, Splits{1, 1, 1, 1}, Splits{1, 1, 1, 2}, world);
                }),
                HasSubstr("input_split_sizes [1, 1, 1, 2] sum to 5 but input dimension 0 is 4"));
    const int64_t kMax = std::numeric_limits<int64_t>::max();
    EXPECT_THAT(error_of([&] {
                  all_to_all_single(x, Splits{kMax, kMax, 0, 0}, Splits{1, 1, 1, 1}, world);
                }),
                HasSubstr("output_split_sizes [9223372036854775807, 9223372036854775807, 0, 0] "
                          "sum to more than int64 holds"));
    EXPECT_THAT(error_of([&] {
                  all_to_all_single(x, Splits{1, 1, 1, 1}, Splits{kMax, 1, 0, 0}, world);
                }),
                HasSubstr("input_split_sizes [9223372036854775807, 1, 0, 0] sum to more than "
                          "int64 holds"));
    EXPECT_THAT(error_of([&] {
                  permute_tensor(x, {1, 2, 0}, world);
                }),
                HasSubstr("src_dst [1, 2, 0] has 3 entries, expected group_size 4"));
    EXPECT_THAT(error_of([&] {
                  permute_tensor(x, {1, 1, 2, 3}, world);
                }),
                HasSubstr("src_dst [1, 1, 2, 3] is not a permutation of 0..3"));
    EXPECT_THAT(error_of([&] {
                  permute_tensor(x, {1, 2, 3, 4}, world);
                }),
                HasSubstr("is not a permutation of 0..3"));
    EXPECT_THAT(error_of([&] { broadcast(x, -1, world); }), HasSubstr("src -1 is not a rank"));
    EXPECT_THAT(error_of([&] { all_reduce(Tensor(), "sum", world); }),
                HasSubstr("all_reduce: undefined input tensor"));
    EXPECT_THAT(error_of([&] { all_gather_tensor(Tensor::meta({2}, DType::F32), 5, world); }),
                HasSubstr("gather_dim 5 is out of range"));
    EXPECT_THAT(error_of([&] {
                  all_reduce_coalesced({x, Tensor()}, "sum", world);
                }),
                HasSubstr("undefined input tensor for tensor at index 1"));
    // The entry whose dtype the reduce op does not support is named as well.
    const Tensor ints = Tensor::full({4}, DType::I32, 1.0);
    const Tensor bools = Tensor::full({4}, DType::Bool, 1.0);
    EXPECT_THAT(error_of([&] { all_reduce_coalesced({ints, ints, x}, "bxor", world); }),
                HasSubstr("all_reduce_coalesced: reduce_op bxor is not supported for floating "
                          "dtype f32 (only integer and bool) for tensor at index 2"));
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor_coalesced({x, bools}, "avg", {0, 0}, world); }),
                HasSubstr("for tensor at index 1"));
    EXPECT_THAT(error_of([&] { reduce_scatter_tensor_coalesced({x, x}, "sum", {0, 2}, world); }),
                HasSubstr("reduce_scatter_tensor_coalesced: scatter_dim 2 is out of range for a "
                          "2-d input (expected -2..1) for tensor at index 1"));
    EXPECT_THROW(all_gather_tensor(x, 2, world), ShapeError);
    // Empty inputs whose gathered dim would leave int64 (every rank fails before issuing).
    const Tensor wide = Tensor::empty({0, int64_t{1} << 61}, DType::U8);
    EXPECT_THAT(error_of([&] { all_gather_tensor(wide, 1, world); }),
                HasSubstr("all_gather_tensor: dim 1 of size 2305843009213693952 gathered from 4 "
                          "ranks does not fit in int64"));
    const Tensor tall = Tensor::empty({int64_t{1} << 61, 0}, DType::U8);
    EXPECT_THAT(error_of([&] { all_gather_into_tensor_coalesced({tall}, world); }),
                HasSubstr("all_gather_into_tensor_coalesced: dim 0 of size 2305843009213693952 "
                          "gathered from 4 ranks does not fit in int64"));
  });
}

// Failing in-place calls still issue their collective, so a rank whose own output is wrong does
// not leave its peers waiting.
TEST(Errors, InplaceShapeMismatchOnOneRankDoesNotStallPeers) {
  run_local(2, [](ProcessGroup& world) {
    Tensor x = Tensor::full({2, 2}, DType::F32, world.rank() + 1);
    if (world.rank() == 0) {
      Tensor wrong = Tensor::zeros({3}, DType::F32);
      EXPECT_THAT(error_of([&] { all_gather_tensor_inplace(wrong, x, world); }),
                  HasSubstr("all_gather_tensor_inplace: output shape [3] does not match the result "
                            "shape [4,2]"));
      EXPECT_THAT(
          error_of([&] { all_to_all_inplace(wrong, x, std::nullopt, std::nullopt, world); }),
          HasSubstr("all_to_all_inplace: output shape [3] does not match the result shape "
                    "[2,2]"));
      EXPECT_TRUE(wrong.equal(Tensor::zeros({3}, DType::F32)));
    } else {
      Tensor gathered = Tensor::zeros({4, 2}, DType::F32);
      all_gather_tensor_inplace(gathered, x, world);
      EXPECT_EQ(gathered.to_vector<float>(), (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2}));
      Tensor exchanged = Tensor::zeros({2, 2}, DType::F32);
      all_to_all_inplace(exchanged, x, std::nullopt, std::nullopt, world);
      EXPECT_EQ(exchanged.to_vector<float>(), (std::vector<float>{1, 1, 2, 2}));
    }
    // The group is still in step.
    EXPECT_EQ(all_reduce(x, "sum", world).to_vector<float>(), repeat(3, 4));
  });
}

// The in-place remaps refuse an output of another dtype, as PyTorch's classic collectives do
// (they converted silently); the collective is still issued, so the peers are not left waiting.
TEST(Errors, InplaceDtypeMismatchIsRefusedWithoutStallingPeers) {
  run_local(2, [](ProcessGroup& world) {
    const Tensor x = Tensor::full({2, 2}, DType::F32, world.rank() + 1);
    if (world.rank() == 0) {
      Tensor gathered = Tensor::zeros({4, 2}, DType::F64);
      EXPECT_EQ(error_of<InvalidArgument>([&] { all_gather_tensor_inplace(gathered, x, world); }),
                "all_gather_tensor_inplace: output dtype f64 does not match the input dtype f32");
      Tensor shard = Tensor::zeros({1, 2}, DType::I32);
      EXPECT_EQ(error_of<InvalidArgument>([&] { reduce_scatter_tensor_inplace(shard, x, world); }),
                "reduce_scatter_tensor_inplace: output dtype i32 does not match the input dtype "
                "f32");
      Tensor exchanged = Tensor::zeros({2, 2}, DType::F16);
      EXPECT_EQ(error_of<InvalidArgument>([&] {
                  all_to_all_inplace(exchanged, x, std::nullopt, std::nullopt, world);
                }),
                "all_to_all_inplace: output dtype f16 does not match the input dtype f32");
      std::vector<Tensor> list = {Tensor::zeros({2, 2}, DType::F32),
                                  Tensor::zeros({2, 2}, DType::BF16)};
      EXPECT_EQ(error_of<InvalidArgument>([&] { all_gather_inplace(list, x, world); }),
                "all_gather_inplace: tensor_list[1] dtype bf16 does not match the input dtype f32");
      // Nothing was written, not even the list's first entry.
      EXPECT_TRUE(gathered.equal(Tensor::zeros({4, 2}, DType::F64)));
      EXPECT_TRUE(shard.equal(Tensor::zeros({1, 2}, DType::I32)));
      EXPECT_TRUE(exchanged.equal(Tensor::zeros({2, 2}, DType::F16)));
      EXPECT_TRUE(list[0].equal(Tensor::zeros({2, 2}, DType::F32)));
    } else {
      Tensor gathered = Tensor::zeros({4, 2}, DType::F32);
      all_gather_tensor_inplace(gathered, x, world);
      Tensor shard = Tensor::zeros({1, 2}, DType::F32);
      reduce_scatter_tensor_inplace(shard, x, world);
      EXPECT_EQ(shard.to_vector<float>(), repeat(3, 2));
      Tensor exchanged = Tensor::zeros({2, 2}, DType::F32);
      all_to_all_inplace(exchanged, x, std::nullopt, std::nullopt, world);
      std::vector<Tensor> list = {Tensor::zeros({2, 2}, DType::F32),
                                  Tensor::zeros({2, 2}, DType::F32)};
      all_gather_inplace(list, x, world);
      EXPECT_TRUE(list[1].equal(x));
    }
    // The group is still in step.
    EXPECT_EQ(all_reduce(x, "sum", world).to_vector<float>(), repeat(3, 4));
  });
}

// ---- group specs (D.20-21) ----

// How many times `err` holds the rank-list deprecation warning.
size_t rank_list_warnings(const std::string& err) {
  const std::string warning =
      "funcol: warning: passing a list of ranks as a group is deprecated; pass a ProcessGroup, a "
      "DeviceMesh or a group name\n";
  size_t count = 0;
  for (size_t pos = err.find(warning); pos != std::string::npos; pos = err.find(warning, pos + 1)) {
    ++count;
  }
  return count;
}

TEST(GroupSpecTest, RankListWarnsOnce) {
  ::testing::internal::CaptureStderr();
  run_local(4, [](ProcessGroup& world) {
    Tensor x = Tensor::full({4}, DType::F32, 1);
    EXPECT_EQ(all_reduce(x, "sum", {0, 1, 2, 3}).to_vector<float>(), repeat(4, 4));
    EXPECT_EQ(all_reduce(x, "sum", std::vector<int>{0, 1, 2, 3}).to_vector<float>(), repeat(4, 4));
    // The whole world in order is the world group.
    EXPECT_EQ(&GroupSpec({0, 1, 2, 3}).resolve(), &world);
  });
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_LE(rank_list_warnings(err), 1u) << err;
}

// Exactly once per process: counted in a process of its own (the threadsafe style runs the
// test binary anew), where no earlier test has warned yet.
TEST(GroupSpecDeathTest, RankListWarnsExactlyOncePerProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::testing::internal::CaptureStderr();
        run_local(2, [](ProcessGroup&) {
          Tensor x = Tensor::full({4}, DType::F32, 1);
          all_reduce(x, "sum", {0, 1}).wait();
          all_reduce(x, "sum", std::vector<int>{0, 1}).wait();
        });
        const size_t count = rank_list_warnings(::testing::internal::GetCapturedStderr());
        std::fprintf(stderr, "rank-list warnings: %zu\n", count);
        std::_Exit(count == 1 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "rank-list warnings: 1");
}

TEST(GroupSpecTest, Names) {
  run_local(2, [](ProcessGroup& world) {
    EXPECT_EQ(&GroupSpec("world").resolve(), &world);
    EXPECT_EQ(&GroupSpec(std::string("world")).resolve(), &world);
    EXPECT_EQ(GroupSpec("world").size(), 2);
    EXPECT_THAT(error_of([] { GroupSpec("nope").resolve(); }), HasSubstr("nope"));
    EXPECT_THAT(error_of([] { GroupSpec("").resolve(); }), HasSubstr("empty group name"));
    const char* null_name = nullptr;
    EXPECT_THAT(error_of([&] { GroupSpec(null_name).resolve(); }), HasSubstr("empty group name"));
    auto sub = new_group(world, {0, 1}, "pair");
    EXPECT_EQ(&GroupSpec("pair").resolve(), sub.get());
  });
  EXPECT_THAT(error_of([] { GroupSpec("world").resolve(); }),
              HasSubstr("no current rank: call inside run_local or after init"));
  EXPECT_THAT(error_of([] { all_reduce(Tensor::zeros({1}, DType::F32), "sum", "world"); }),
              HasSubstr("no current rank"));
  EXPECT_THAT(error_of([] { GroupSpec{0}.resolve(); }), HasSubstr("no current rank"));
  // A thread a rank starts has no rank of its own until it takes one with WorldScope.
  run_local(2, [](ProcessGroup& world) {
    std::string error;
    std::vector<float> sum;
    std::thread helper([&] {
      error = error_of([] { all_reduce(Tensor::full({2}, DType::F32, 1), "sum", "world"); });
      WorldScope scope(&world);
      sum = all_reduce(Tensor::full({2}, DType::F32, 1), "sum", "world").to_vector<float>();
    });
    helper.join();
    EXPECT_THAT(error, HasSubstr("funcol::WorldScope scope(&world)"));
    EXPECT_EQ(sum, std::vector<float>(2, 2));
  });
  // An int or nullptr is no group spec (the seed's "Unsupported group type"): compile-time here.
  static_assert(!std::is_convertible_v<int, GroupSpec>);
  static_assert(!std::is_convertible_v<std::nullptr_t, GroupSpec>);
}

TEST(GroupSpecTest, RankLists) {
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    // A strict subset must exist first (creating it is collective over the world).
    auto pair = new_group(world, {0, 1});
    if (r < 2) {
      EXPECT_EQ(&GroupSpec({0, 1}).resolve(), pair.get());
      Tensor x = Tensor::full({2}, DType::F32, r + 1);
      EXPECT_EQ(all_reduce(x, "sum", {0, 1}).to_vector<float>(), repeat(3, 2));
    } else {
      EXPECT_THAT(error_of([] {
                    GroupSpec({0, 1}).resolve();
                  }),
                  HasSubstr("rank " + std::to_string(r) + " is not in the group's ranks [0, 1]"));
    }
    // Order does not matter: any ordering of the whole world is the world group.
    EXPECT_EQ(&GroupSpec({3, 2, 1, 0}).resolve(), &world);
    Tensor y = Tensor::full({1}, DType::I32, r);
    EXPECT_EQ(all_gather_tensor(y, 0, {3, 2, 1, 0}).to_vector<int32_t>(),
              (std::vector<int32_t>{0, 1, 2, 3}));
    // A missing subset is created on first use: members resolve, the others join new_group.
    if (r == 1 || r == 3) {
      ProcessGroup& odd = GroupSpec({3, 1}).resolve();
      EXPECT_EQ(odd.global_ranks(), (std::vector<int>{1, 3}));
      EXPECT_EQ(odd.rank(), r == 1 ? 0 : 1);
      EXPECT_EQ(&GroupSpec({1, 3}).resolve(), &odd);
      EXPECT_EQ(all_gather_tensor(y, 0, {1, 3}).to_vector<int32_t>(), (std::vector<int32_t>{1, 3}));
    } else {
      EXPECT_EQ(new_group(world, {1, 3}), nullptr);
    }
    // Bad lists.
    EXPECT_THAT(error_of([] { GroupSpec(std::vector<int>{}).resolve(); }),
                HasSubstr("empty rank list"));
    EXPECT_THAT(error_of([] {
                  GroupSpec({0, 7}).resolve();
                }),
                HasSubstr("rank 7 in group [0, 7] is out of range for world size 4"));
    EXPECT_THAT(error_of([] {
                  GroupSpec({0, 1, 1}).resolve();
                }),
                HasSubstr("rank 1 appears twice in group [0, 1, 1]"));
  });
}

TEST(GroupSpecTest, ListsOfRankLists) {
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    using Lists = std::vector<std::vector<int>>;
    ProcessGroup& g = GroupSpec(Lists{{0, 1}, {2, 3}}).resolve();
    EXPECT_EQ(g.size(), 2);
    EXPECT_EQ(g.global_ranks(), r < 2 ? (std::vector<int>{0, 1}) : (std::vector<int>{2, 3}));
    EXPECT_EQ(&GroupSpec(Lists{{0, 1}, {2, 3}}).resolve(), &g);
    EXPECT_EQ(&GroupSpec(Lists{{3, 2}, {1, 0}}).resolve(), &g);  // order does not matter
    Tensor x = Tensor::full({2}, DType::F32, r);
    EXPECT_EQ(all_reduce(x, "sum", Lists{{0, 1}, {2, 3}}).to_vector<float>(),
              repeat(r < 2 ? 1 : 5, 2));
    // A different partition creates new groups; braces pick the list-of-lists form.
    EXPECT_EQ(all_reduce(x, "sum", {{0, 2}, {1, 3}}).to_vector<float>(),
              repeat(r % 2 == 0 ? 2 : 4, 2));
    EXPECT_THAT(error_of([] {
                  GroupSpec(Lists{{0}, {1, 2, 3}}).resolve();
                }),
                HasSubstr("group sizes must be identical found 1 and 3"));
    EXPECT_THAT(error_of([] {
                  GroupSpec(Lists{{0, 1}, {1, 2}}).resolve();
                }),
                HasSubstr("rank 1 appears twice"));
    EXPECT_THAT(error_of([] { GroupSpec(Lists{}).resolve(); }),
                HasSubstr("empty list of rank lists"));
    // Ranks 0 and 1 find their (existing) group; ranks 2 and 3 are in no list.
    if (r >= 2) {
      EXPECT_THAT(
          error_of([] {
            GroupSpec(Lists{{0, 1}}).resolve();
          }),
          HasSubstr("rank " + std::to_string(r) + " is not in any of the rank lists [[0, 1]]"));
    } else {
      EXPECT_EQ(&GroupSpec(Lists{{0, 1}}).resolve(), &g);
      // A group that does not exist yet cannot be created by the listed ranks alone: an error
      // at once, not a wait for ranks 2 and 3 in the world's split.
      EXPECT_THAT(error_of([] { GroupSpec(Lists{{0}, {1}}).resolve(); }),
                  HasSubstr("the rank lists [[0], [1]] leave out ranks [2, 3] of the world"));
    }
    // One-rank lists too: {0} is a list there, not the rank 0 (which would make the whole
    // argument the rank list [0, 1, 2, 3], the world).
    EXPECT_EQ(all_reduce(x, "sum", {{0}, {1}, {2}, {3}}).to_vector<float>(), repeat(r, 2));
    EXPECT_EQ(GroupSpec({{3}, {2}, {1}, {0}}).resolve().global_ranks(), std::vector<int>{r});
    const std::vector<int> mine = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    const std::vector<int> other = r < 2 ? std::vector<int>{2, 3} : std::vector<int>{0, 1};
    EXPECT_EQ(&GroupSpec({mine, other}).resolve(), &g);  // vectors as braced elements
    EXPECT_EQ(all_reduce(x, "sum", {0, 1, 2, 3}).to_vector<float>(), repeat(6, 2));  // ranks
    EXPECT_THAT(error_of([] { GroupSpec({0, {1, 2, 3}}); }),
                HasSubstr("a braced group holds ranks and rank lists both"));
    // A one-rank list after ranks too (it used to become the rank 3: the world).
    EXPECT_THAT(error_of([&] { all_reduce(x, "sum", {0, 1, 2, {3}}); }),
                HasSubstr("a braced group holds ranks and rank lists both"));
    EXPECT_THAT(error_of([] { GroupSpec({0, {1}}); }),
                HasSubstr("a braced group holds ranks and rank lists both"));
    // initializer_list objects, as the earlier constructors took them.
    const std::initializer_list<int> all = {0, 1, 2, 3};
    EXPECT_EQ(&GroupSpec(all).resolve(), &world);
    const std::initializer_list<std::vector<int>> halves = {{0, 1}, {2, 3}};
    EXPECT_EQ(&GroupSpec(halves).resolve(), &g);
  });
}

// A partition listed in a different order on each rank (its own list first) is one partition:
// creating its groups took the lists as given, so the ranks disagreed ("rank 0 passed [[0, 1],
// [2, 3]] ... but rank 2 passed [[2, 3], [0, 1]]"). Once resolved, using it again asks no other
// rank: pairs that go on alone (ranks 0 and 1 three more times, 2 and 3 once) used to fail the
// world agreement every use needed.
TEST(GroupSpecTest, ListsOfRankListsInEachRanksOrderAndUsedAgainAlone) {
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    const std::vector<int> mine = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    const std::vector<int> other = r < 2 ? std::vector<int>{2, 3} : std::vector<int>{0, 1};
    Tensor x = Tensor::full({2}, DType::F32, r);
    EXPECT_EQ(all_reduce(x, "sum", {mine, other}).to_vector<float>(),
              repeat(r < 2 ? 1 : 5, 2));
    for (int i = 0; i < (r < 2 ? 3 : 1); ++i) {
      EXPECT_EQ(all_reduce(x, "sum", {other, mine}).to_vector<float>(),
                repeat(r < 2 ? 1 : 5, 2));
    }
  });
}

// The lists of a partition whose groups a split over the world made (a DeviceMesh dim) find them
// without asking the other ranks, on first use too: pairs that go on alone, pipeline style,
// used to wait in the world agreement for ranks busy elsewhere, until the timeout.
TEST(GroupSpecTest, ListsOfRankListsFindAMeshsGroupsWithoutTheOtherRanks) {
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    const GroupSpec tp({{0, 1}, {2, 3}});
    Tensor x = Tensor::full({1}, DType::F32, 1 << r);
    if (r < 2) {
      Tensor y = all_reduce(x, "sum", tp);
      EXPECT_EQ(broadcast(y, 0, "dp").to_vector<float>(), repeat(3, 1));
    } else {
      Tensor s = wait_tensor(broadcast(x, 0, "dp"));  // ranks 0 and 1 broadcast after tp
      EXPECT_EQ(all_reduce(s, "sum", tp).to_vector<float>(), repeat(6, 1));
    }
    EXPECT_EQ(&tp.resolve(), mesh.group("tp").get());
    // The other dim's partition, in another order, is found the same way.
    Tensor z = Tensor::full({1}, DType::F32, 1);
    EXPECT_EQ(all_reduce(z, "sum", {{3, 1}, {0, 2}}).to_vector<float>(), repeat(2, 1));
    EXPECT_EQ(&GroupSpec({{1, 3}, {0, 2}}).resolve(), mesh.group("dp").get());
  });
  // Groups made one by one by new_group over the world, each rank a member of one of them.
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    auto low = new_group(world, {0, 3});
    auto high = new_group(world, {1, 2});
    const GroupSpec pairs({{0, 3}, {1, 2}});
    Tensor x = Tensor::full({1}, DType::F32, 1 << r);
    if (r == 0 || r == 3) {
      EXPECT_EQ(all_reduce(x, "sum", pairs).to_vector<float>(), repeat(9, 1));
      (void)wait_tensor(all_reduce(x, "sum", "world"));
    } else {
      (void)wait_tensor(all_reduce(x, "sum", "world"));
      EXPECT_EQ(all_reduce(x, "sum", pairs).to_vector<float>(), repeat(6, 1));
    }
    EXPECT_EQ(&pairs.resolve(), (r == 0 || r == 3 ? low : high).get());
  });
  // A split that listed a group's ranks out of order made a group the spec's sorted lists do
  // not find on its members: every rank must then take the agreement, not only those members
  // (ranks 2 and 3 alone took the shortcut, and ranks 0 and 1's agreement met the next
  // collective: a mismatch on threads, a hang until the timeout on gloo).
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    world.split_group({{1, 0}, {2, 3}}, "pairs");
    Tensor x = Tensor::full({1}, DType::F32, 1 << r);
    EXPECT_EQ(all_reduce(x, "sum", {{0, 1}, {2, 3}}).to_vector<float>(), repeat(r < 2 ? 3 : 12, 1));
    EXPECT_EQ(all_reduce(x, "sum", "world").to_vector<float>(), repeat(15, 1));
  });
}

// Each pair passing its own rank list (SPMD style) cannot create two groups: the error says
// what to pass instead, on every rank.
TEST(GroupSpecTest, ARankListPerPairSaysToPassTheListOfLists) {
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    const std::vector<int> mine = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3};
    Tensor x = Tensor::full({2}, DType::F32, r);
    try {
      all_reduce(x, "sum", GroupSpec(mine));
      ADD_FAILURE() << "no error";
    } catch (const CommError& e) {
      EXPECT_THAT(e.what(), HasSubstr("passed [[0, 1]] as 'group1' but rank 2 passed [[2, 3]]"));
      EXPECT_THAT(e.what(), HasSubstr("for a group per set of ranks pass the list of rank "
                                      "lists, e.g. {{0, 1}, {2, 3}}"));
    }
  });
}

// Ranks that pass different partitions get an error that names what they passed, not the
// split_group they never called.
TEST(GroupSpecTest, DifferentPartitionsOnDifferentRanksNameTheSpec) {
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    const GroupSpec spec = r < 2 ? GroupSpec({{0, 1}, {2, 3}}) : GroupSpec({{0, 2}, {1, 3}});
    Tensor x = Tensor::full({2}, DType::F32, r);
    const std::string message = error_of([&] { all_reduce(x, "sum", spec).to_vector<float>(); });
    EXPECT_THAT(message, HasSubstr("a group spec of rank lists on group 'world' (split 0): rank 0 "
                                   "passed [[0, 1], [2, 3]] as 'group1' but rank 2 passed [[0, "
                                   "2], [1, 3]] as 'group1' (every rank must pass the same "
                                   "partition of the world, in any order)"));
    EXPECT_THAT(message, Not(HasSubstr("split_group")));
  });
}

TEST(GroupSpecTest, ProcessGroupsAndMeshes) {  // D.20, D.21
  run_local(4, [](ProcessGroup& world) {
    const int r = world.rank();
    Tensor ones = Tensor::full({4}, DType::F32, 1);
    DeviceMesh mesh2(world, {{"dp", 2}, {"tp", 2}});
    EXPECT_THAT(error_of([&] { GroupSpec(mesh2).resolve(); }),
                HasSubstr("Only 1D mesh is supported, pass in (DeviceMesh, int) together if "
                          "mesh > 1D"));
    EXPECT_THAT(error_of([&] { all_reduce(ones, "sum", mesh2); }), HasSubstr("Only 1D mesh"));
    ProcessGroup& dim0 = GroupSpec(mesh2, 0).resolve();
    ProcessGroup& dim1 = GroupSpec({&mesh2, 1}).resolve();
    EXPECT_EQ(dim0.global_ranks(),
              r % 2 == 0 ? (std::vector<int>{0, 2}) : (std::vector<int>{1, 3}));
    EXPECT_EQ(dim1.global_ranks(), r < 2 ? (std::vector<int>{0, 1}) : (std::vector<int>{2, 3}));
    EXPECT_EQ(&dim0, mesh2.group("dp").get());
    EXPECT_EQ(&GroupSpec(std::make_pair(&mesh2, 1)).resolve(), &dim1);
    // A pair of a non-const mesh's address converts where a GroupSpec is expected.
    DeviceMesh& mutable_mesh = mesh2;
    EXPECT_EQ(all_reduce(ones, "sum", std::make_pair(&mutable_mesh, 1)).to_vector<float>(),
              repeat(2, 4));
    EXPECT_EQ(all_reduce(ones, "sum", {mesh2, 1}).to_vector<float>(), repeat(2, 4));
    EXPECT_THAT(error_of([&] { GroupSpec(mesh2, 2).resolve(); }),
                HasSubstr("mesh dim 2 is out of range for a 2-d DeviceMesh (expected -2 to 1)"));
    // Negative dims count from the last, as PyTorch's (mesh, dim) index a Python list.
    EXPECT_EQ(&GroupSpec(mesh2, -1).resolve(), &dim1);
    EXPECT_EQ(&GroupSpec(mesh2, -2).resolve(), &dim0);
    EXPECT_EQ(mesh2.group(-1).get(), &dim1);
    EXPECT_THAT(error_of([&] { GroupSpec(mesh2, -3).resolve(); }),
                HasSubstr("mesh dim -3 is out of range for a 2-d DeviceMesh (expected -2 to 1)"));
    const DeviceMesh* null_mesh = nullptr;
    EXPECT_THAT(error_of([&] {
                  GroupSpec({null_mesh, 0}).resolve();
                }),
                HasSubstr("null DeviceMesh"));

    DeviceMesh mesh1(world, {{"all", 4}});
    EXPECT_EQ(all_reduce(ones, "sum", mesh1).to_vector<float>(), repeat(4, 4));
    EXPECT_EQ(GroupSpec(mesh1).size(), 4);

    std::shared_ptr<ProcessGroup> tp = mesh2.group("tp");
    EXPECT_EQ(&GroupSpec(tp).resolve(), tp.get());
    EXPECT_EQ(&GroupSpec(*tp).resolve(), tp.get());
    EXPECT_THAT(error_of([] { GroupSpec(std::shared_ptr<ProcessGroup>()).resolve(); }),
                HasSubstr("null ProcessGroup"));
    // Group names: mesh dims are registered under their names.
    EXPECT_EQ(&GroupSpec("tp").resolve(), tp.get());
  });
}

// ---- waits and pending storage (D.22-30) ----

// D.22. Rank 1 issues only after rank 0 looked, so rank 0's result cannot be complete yet (the
// rank that completes a collective attaches nothing: its result is ready at once).
TEST(Waits, PendingCountAndIdempotentWait) {
  Gate looked;
  run_local(2, [&](ProcessGroup& world) {
    Tensor x = Tensor::full({8}, DType::F32, 1);
    if (world.rank() == 1) {
      EXPECT_TRUE(looked.wait_open());
    }
    EXPECT_EQ(x.storage()->pending_count(), 0u);
    Tensor out = all_reduce(x, "sum", world);
    Tensor lazy = all_gather_tensor(Tensor::full({2, 2}, DType::F32, 1), 1, world);
    if (world.rank() == 0) {
      EXPECT_EQ(out.storage()->pending_count(), 1u);
      EXPECT_EQ(lazy.storage()->pending_count(), 1u);
      looked.open();
    } else {
      EXPECT_LE(out.storage()->pending_count(), 1u);
      EXPECT_EQ(lazy.storage()->pending_count(), 1u);  // the rearrangement is always pending
    }
    EXPECT_EQ(&wait_tensor(out), &out);
    EXPECT_EQ(out.storage()->pending_count(), 0u);
    EXPECT_TRUE(out.is_ready());
    wait_tensor(out);
    EXPECT_EQ(out.storage()->pending_count(), 0u);
    EXPECT_EQ(out.to_vector<float>(), repeat(2, 8));
    wait_tensor(x);  // nothing pending: free
    EXPECT_EQ(x.storage()->pending_count(), 0u);
    wait_tensor(lazy);
    EXPECT_EQ(lazy.storage()->pending_count(), 0u);
    EXPECT_EQ(lazy.to_vector<float>(), repeat(1, 8));
  });
}

// D.28. A ProcessGroup primitive's output is in flight too: its Work is attached to the output's
// storage, so wait_tensor (or any data access) waits for it, and once done nothing stays
// registered, however many were issued.
TEST(Waits, APrimitivesOutputIsWaitedByWaitTensor) {
  Gate looked;
  run_local(2, [&](ProcessGroup& world) {
    if (world.rank() == 1) {
      EXPECT_TRUE(looked.wait_open());
    }
    Tensor t = Tensor::full({8}, DType::F32, world.rank() + 1);
    std::shared_ptr<Work> work = world.all_reduce(t, ReduceOp::Sum);
    if (world.rank() == 0) {
      EXPECT_EQ(t.storage()->pending_count(), 1u);  // rank 1 has not issued yet
      looked.open();
    }
    EXPECT_EQ(&wait_tensor(t), &t);
    EXPECT_EQ(t.storage()->pending_count(), 0u);
    EXPECT_TRUE(work->is_completed());
    EXPECT_EQ(t.to_vector<float>(), repeat(3, 8));
    for (int i = 0; i < 2000; ++i) {
      Tensor u = Tensor::full({4}, DType::I32, 1);
      world.all_reduce(u, ReduceOp::Sum);
      EXPECT_LE(u.storage()->pending_count(), 1u);
      if (i % 500 == 0) {
        EXPECT_EQ(u.to_vector<int32_t>(), std::vector<int32_t>(4, 2));
      }
    }
    world.barrier();
  });
}

// A write to an input waits until its collective has read it: rank 1 overwrites its input
// right after the call while rank 0 is late, so the collective runs after the write would have
// happened (it used to see the new values, or half of them).
TEST(Waits, WritingAnInputWaitsForItsCollective) {
  using Issue = std::function<std::vector<Tensor>(const Tensor& x, ProcessGroup& w)>;
  const std::vector<std::pair<std::string, Issue>> cases = {
      {"all_gather_tensor",
       [](const Tensor& x, ProcessGroup& w) { return std::vector{all_gather_tensor(x, 0, w)}; }},
      {"all_gather_tensor dim 1",
       [](const Tensor& x, ProcessGroup& w) {
         return std::vector{all_gather_tensor(x.view({2, 2}), 1, w)};
       }},
      {"reduce_scatter_tensor",
       [](const Tensor& x, ProcessGroup& w) {
         return std::vector{reduce_scatter_tensor(x, "sum", 0, w)};
       }},
      {"all_to_all_single",
       [](const Tensor& x, ProcessGroup& w) {
         return std::vector{all_to_all_single(x, std::nullopt, std::nullopt, w)};
       }},
      {"permute_tensor",
       [](const Tensor& x, ProcessGroup& w) { return std::vector{permute_tensor(x, {1, 0}, w)}; }},
      {"all_gather_into_tensor_coalesced",
       [](const Tensor& x, ProcessGroup& w) {
         return all_gather_into_tensor_coalesced({x, x.narrow(0, 0, 2)}, w);
       }},
      {"reduce_scatter_tensor_coalesced",
       [](const Tensor& x, ProcessGroup& w) {
         return reduce_scatter_tensor_coalesced({x}, "sum", {0}, w);
       }},
  };
  for (const auto& [name, issue_each] : cases) {
    SCOPED_TRACE(name);
    const auto& issue = issue_each;  // a lambda cannot capture a structured binding in clang 14
    std::vector<std::vector<double>> expected(2), got(2);
    run_local(2, [&](ProcessGroup& world) {
      const Tensor x = Tensor::full({4}, DType::F32, world.rank() + 1);
      // What the collective gives when nobody writes.
      for (const Tensor& r : issue(x.clone(), world)) {
        for (double v : r.to_vector<double>()) expected[world.rank()].push_back(v);
      }
      world.barrier();
      if (world.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::vector<Tensor> results = issue(x, world);
      if (world.rank() == 1) x.fill_(100);
      for (const Tensor& r : results) {
        for (double v : r.to_vector<double>()) got[world.rank()].push_back(v);
      }
    });
    EXPECT_EQ(got, expected);
  }
}

// Reads of an input do not wait for the collectives reading it: rank 1 issues only after
// rank 0 read its input every way and issued a second collective on it.
TEST(Waits, ReadingAnInputDoesNotWait) {
  Gate read;
  run_local(2, [&](ProcessGroup& world) {
    const Tensor x = Tensor::full({4}, DType::F32, world.rank() + 1);
    if (world.rank() == 1) {
      ASSERT_TRUE(read.wait_open()) << "rank 0 blocked reading its input";
    }
    Tensor g = all_gather_tensor(x, 0, world);
    if (world.rank() == 0) {
      EXPECT_EQ(x.to_vector<float>(), std::vector<float>(4, 1));
      EXPECT_EQ(ops::add(x, x).to_vector<float>(), std::vector<float>(4, 2));
      EXPECT_NE(x.const_data_ptr(), nullptr);
      EXPECT_EQ(x.clone().to_vector<float>(), std::vector<float>(4, 1));
      EXPECT_FALSE(g.is_ready());
      read.open();
    }
    Tensor r = reduce_scatter_tensor(x, "sum", 0, world);
    EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2}));
    EXPECT_EQ(r.to_vector<float>(), std::vector<float>(2, 3));
  });
}

// The collective's failure is its result's: the input stays readable.
TEST(Waits, InputOfAFailedCollectiveStaysReadable) {
  try {
    run_local(2, [](ProcessGroup& world) {
      if (world.rank() == 1) throw std::runtime_error("gone");
      const Tensor x = Tensor::full({4}, DType::F32, 3);
      Tensor r = all_gather_tensor(x, 0, world);
      EXPECT_THROW(r.wait(), CommError);
      EXPECT_EQ(x.to_vector<float>(), std::vector<float>(4, 3));
    });
    ADD_FAILURE() << "no rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "gone");
  }
}

// An input issued into many collectives without being touched in between does not collect
// their Works.
TEST(Waits, AnInputDoesNotCollectFinishedCollectives) {
  run_local(2, [](ProcessGroup& world) {
    const Tensor x = Tensor::full({4}, DType::F32, 1);
    for (int i = 0; i < 200; ++i) wait_tensor(all_gather_tensor(x, 0, world));
    EXPECT_LE(x.storage()->reader_count(), 16u);
  });
}

TEST(Waits, DroppedResultsNeitherCrashNorHang) {  // D.23
  run_local(2, [](ProcessGroup& world) {
    Tensor x = Tensor::full({64, 3}, DType::F32, world.rank());
    for (int i = 0; i < 20; ++i) {
      all_reduce(x, "sum", world);
      all_gather_tensor(x, 1, world);  // the lazy rearrangement is dropped too
      reduce_scatter_tensor(x, "sum", 0, world);
      all_to_all_single(x, std::nullopt, std::nullopt, world);
      all_reduce_coalesced({x, x}, "max", world);
    }
    EXPECT_EQ(all_reduce(x, "sum", world).to_vector<float>(), repeat(1, 64 * 3));
    // Left unwaited when the rank returns.
    all_gather_tensor(x, 1, world);
  });
}

TEST(Waits, UserDefinedWaitable) {  // D.24, D.25
  Tensor t = Tensor::zeros({4, 2}, DType::F32);
  auto a = std::make_shared<CountingWaitable>();
  auto b = std::make_shared<CountingWaitable>();
  t.storage()->add_pending(a);
  t.storage()->add_pending(a);  // the same operation twice: once
  EXPECT_EQ(t.storage()->pending_count(), 1u);
  t.transpose(0, 1).storage()->add_pending(b);  // through a view: same storage
  EXPECT_EQ(t.storage()->pending_count(), 2u);
  EXPECT_FALSE(t.is_ready());
  // Waiting a dtype view finds both through the shared storage.
  wait_tensor(t.view_dtype(DType::I32));
  EXPECT_EQ(a->waits(), 1);
  EXPECT_EQ(b->waits(), 1);
  EXPECT_EQ(t.storage()->pending_count(), 0u);
  wait_tensor(t);
  EXPECT_EQ(a->waits(), 1);
  // Attached again after another one: still one operation, waited once.
  Tensor u = Tensor::zeros({2}, DType::F32);
  auto c = std::make_shared<CountingWaitable>();
  auto d = std::make_shared<CountingWaitable>();
  u.storage()->add_pending(c);
  u.storage()->add_pending(d);
  u.storage()->add_pending(c);
  EXPECT_EQ(u.storage()->pending_count(), 2u);
  wait_tensor(u);
  EXPECT_EQ(c->waits(), 1);
  EXPECT_EQ(d->waits(), 1);
  EXPECT_EQ(u.storage()->pending_count(), 0u);
}

// A work that always fails, counting its waits.
class FailingWaitable : public Waitable {
 public:
  void wait() override {
    waits_.fetch_add(1);
    throw CommError("all_reduce_coalesced: rank 1 departed");
  }
  bool is_completed() const override { return true; }
  int waits() const { return waits_.load(); }

 private:
  std::atomic<int> waits_{0};
};

TEST(Waits, WaitTensorsWaitsASharedWorkOnce) {  // D.26 with a work that counts (PR #193892)
  std::vector<Tensor> outs = {Tensor::zeros({3}, DType::F32), Tensor::zeros({5}, DType::I32),
                              Tensor::zeros({1}, DType::F32)};
  auto shared = std::make_shared<CountingWaitable>();
  auto own = std::make_shared<CountingWaitable>();
  for (const Tensor& t : outs) t.storage()->add_pending(shared);
  outs[1].storage()->add_pending(own);
  wait_tensors(outs);
  EXPECT_EQ(shared->waits(), 1);
  EXPECT_EQ(own->waits(), 1);
  for (const Tensor& t : outs) EXPECT_EQ(t.storage()->pending_count(), 0u);
  wait_tensors(outs);
  EXPECT_EQ(shared->waits(), 1);

  // A shared failure: waited once, rethrown, and still attached to every output, so each
  // later access fails too; the operation waited before it is detached.
  std::vector<Tensor> failed = {Tensor::zeros({2}, DType::F32), Tensor::zeros({2}, DType::F32)};
  auto before = std::make_shared<CountingWaitable>();
  auto bad = std::make_shared<FailingWaitable>();
  failed[0].storage()->add_pending(before);
  for (const Tensor& t : failed) t.storage()->add_pending(bad);
  EXPECT_EQ(error_of<CommError>([&] { wait_tensors(failed); }),
            "all_reduce_coalesced: rank 1 departed");
  EXPECT_EQ(bad->waits(), 1);
  EXPECT_EQ(before->waits(), 1);
  EXPECT_EQ(failed[0].storage()->pending_count(), 1u);
  for (const Tensor& t : failed) {
    EXPECT_EQ(error_of<CommError>([&] { t.to_vector<float>(); }),
              "all_reduce_coalesced: rank 1 departed");
  }
}

TEST(Waits, WaitTensorsOfACoalescedOp) {  // D.26
  run_local(2, [](ProcessGroup& world) {
    std::vector<Tensor> inputs = {Tensor::full({3}, DType::F32, 1),
                                  Tensor::full({5}, DType::F32, 2),
                                  Tensor::full({1}, DType::F32, 3)};
    std::vector<Tensor> outs = all_reduce_coalesced(inputs, "sum", world);
    wait_tensors(outs);
    for (size_t i = 0; i < outs.size(); ++i) {
      EXPECT_EQ(outs[i].storage()->pending_count(), 0u);
      EXPECT_EQ(outs[i].to_vector<float>(),
                repeat(2.0f * static_cast<float>(i + 1), inputs[i].numel()));
    }
    // A tensor listed twice, and views of one storage, are waited once.
    Tensor g = all_gather_tensor(inputs[0], 0, world);
    wait_tensors({g, g, g.view({2, 3})});
    EXPECT_TRUE(g.is_ready());
  });
}

TEST(Waits, FromAnotherThread) {  // D.27
  run_local(2, [](ProcessGroup& world) {
    Tensor out = all_reduce(Tensor::full({16}, DType::F32, world.rank() + 1), "sum", world);
    Tensor lazy = all_gather_tensor(iota({2, 2}, static_cast<float>(10 * world.rank())), 1, world);
    std::vector<float> got;
    std::vector<float> got_lazy;
    std::thread waiter([&] {
      got = wait_tensor(out).to_vector<float>();
      got_lazy = lazy.to_vector<float>();
    });
    waiter.join();
    EXPECT_EQ(got, repeat(3, 16));
    EXPECT_EQ(got_lazy, (std::vector<float>{0, 1, 10, 11, 2, 3, 12, 13}));
  });
}

// The lazy all_gather rearrangement runs once even when many threads read at the same time.
TEST(Waits, ConcurrentReadersOfALazyGather) {
  run_local(2, [](ProcessGroup& world) {
    Tensor lazy = all_gather_tensor(iota({3, 4}, static_cast<float>(100 * world.rank())), 1, world);
    const Tensor expect = Tensor::cat({iota({3, 4}, 0), iota({3, 4}, 100)}, 1);
    std::vector<std::thread> readers;
    std::atomic<int> correct{0};
    for (int i = 0; i < 4; ++i) {
      readers.emplace_back([&, i] {
        Tensor v = i % 2 == 0 ? lazy : lazy.transpose(0, 1).transpose(0, 1);
        if (v.equal(expect)) correct.fetch_add(1);
      });
    }
    for (auto& t : readers) t.join();
    EXPECT_EQ(correct.load(), 4);
  });
}

// Polling is_ready() on a lazy gather eventually sees true without an explicit wait, and the
// data are then already in place.
TEST(Waits, PollingALazyGatherCompletesIt) {
  run_local(2, [](ProcessGroup& world) {
    Tensor lazy = all_gather_tensor(iota({2, 2}, static_cast<float>(10 * world.rank())), 1, world);
    poll_until_ready(lazy, std::chrono::seconds(30));
    ASSERT_TRUE(lazy.is_ready());
    EXPECT_EQ(lazy.storage()->pending_count(), 1u);  // completed but not yet detached
    EXPECT_EQ(lazy.to_vector<float>(), (std::vector<float>{0, 1, 10, 11, 2, 3, 12, 13}));
  });
}

// A lazy gather whose collective failed counts its failure seen only when a wait (or data
// access) throws it: a rank that only polled the result and dropped it is warned at its end,
// as for any dropped failed collective. Before, polling waited for the collective, which
// counted the failure seen.
TEST(Waits, ALazyGathersFailureCountsSeenWhenThrown) {
  for (const bool read : {true, false}) {
    SCOPED_TRACE(read ? "read" : "polled");
    ::testing::internal::CaptureStderr();
    run_local(2, [&](ProcessGroup& world) {
      if (world.rank() == 1) return;  // departs: rank 0's gather fails at once
      Tensor lazy = all_gather_tensor(iota({2, 2}, 0.0f), 1, world);
      poll_until_ready(lazy, std::chrono::seconds(30));
      ASSERT_TRUE(lazy.is_ready());
      if (read) {
        EXPECT_THAT(error_of<CommError>([&] { lazy.to_vector<float>(); }),
                    HasSubstr("rank 1 departed (returned) before joining"));
      }
    });
    const std::string err = ::testing::internal::GetCapturedStderr();
    if (read) {
      EXPECT_EQ(err, "");
    } else {
      EXPECT_EQ(err,
                "funcol: warning: rank 0 ended with a collective it had not waited for, which "
                "failed: all_gather on group 'world' (seq 0): rank 1 departed (returned) before "
                "joining; missing ranks [1]\n");
    }
  }
}
// D.29: results are pending right after the call; views never wait; a data access does. Rank 1
// issues its half only after rank 0 made every view, so nothing can have completed before.
TEST(Waits, ViewsDoNotWaitDataAccessDoes) {
  Gate views_made;
  run_local(2, [&](ProcessGroup& world) {
    Tensor x = iota({4, 6}, static_cast<float>(100 * world.rank()));
    if (world.rank() == 1) {
      EXPECT_TRUE(views_made.wait_open()) << "rank 0 blocked in a view";
    }
    Tensor out = all_reduce(x, "sum", world);
    Tensor lazy = all_gather_tensor(x, 1, world);  // must not wait at call time (#172214)
    Tensor rs = reduce_scatter_tensor(x, "sum", 1, world);
    if (world.rank() == 0) {
      EXPECT_FALSE(out.is_ready());
      EXPECT_FALSE(lazy.is_ready());
      EXPECT_FALSE(rs.is_ready());
      std::vector<Tensor> views = {out.view({6, 4}),
                                   out.reshape({24}),
                                   out.flatten(),
                                   out.narrow(0, 1, 2),
                                   out.transpose(0, 1),
                                   out.permute({1, 0}),
                                   out.view_dtype(DType::I32),
                                   out.unsqueeze(0),
                                   out.select(0, 2),
                                   out.unsqueeze(2).squeeze(2),
                                   lazy.narrow(1, 6, 6),
                                   lazy.transpose(0, 1),
                                   lazy.view({48}),
                                   rs.view({12}),
                                   out.select(0, 0).expand({3, 6})};
      for (const Tensor& v : out.chunk(2, 1)) views.push_back(v);
      for (const Tensor& v : out.split(3, 0)) views.push_back(v);
      for (const Tensor& v : lazy.split_with_sizes({6, 6}, 1)) views.push_back(v);
      for (const Tensor& v : views) {
        EXPECT_FALSE(v.is_ready());
        EXPECT_TRUE(v.shares_storage(out) || v.shares_storage(lazy) || v.shares_storage(rs));
      }
      views_made.open();
      // A data access through a view waits.
      EXPECT_EQ(views[3].to_vector<float>(),
                (std::vector<float>{112, 114, 116, 118, 120, 122, 124, 126, 128, 130, 132, 134}));
      EXPECT_TRUE(out.is_ready());
      EXPECT_TRUE(views[10].equal(iota({4, 6}, 100)));
      EXPECT_TRUE(lazy.is_ready());
      // A conversion reads the data: it waits (PyTorch #133421, .to() skipped the wait).
      EXPECT_EQ(rs.to(DType::BF16).to_vector<float>(),
                add(iota({4, 6}, 0), iota({4, 6}, 100)).narrow(1, 0, 3).to_vector<float>());
      EXPECT_TRUE(rs.is_ready());
    }
    EXPECT_TRUE(lazy.equal(Tensor::cat({iota({4, 6}, 0), iota({4, 6}, 100)}, 1)));
    EXPECT_TRUE(rs.equal(add(iota({4, 6}, 0), iota({4, 6}, 100)).narrow(1, 3 * world.rank(), 3)));
  });
}

// D.30: waiting a dtype view of a gather finds the work through the shared storage, every time.
TEST(Waits, PrimitiveReadsALazyGatherAfterItsRearrangement) {
  // all_gather_tensor along dim 1 rearranges its bytes only when first waited. A result passed
  // straight to a ProcessGroup primitive must be read rearranged, on every backend.
  run_local(2, [](ProcessGroup& world) {
    Tensor x = Tensor::from_vector(std::vector<float>{1.0f + world.rank(), 3.0f + world.rank()},
                                   {2, 1});
    Tensor g = all_gather_tensor(x, 1, world);  // [[1, 2], [3, 4]] once complete
    world.all_reduce(g, ReduceOp::Sum)->wait();
    EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{2, 4, 6, 8})) << "rank " << world.rank();
  });
}

TEST(Waits, DtypeViewOfAGatherFindsItsWork) {
  run_local(2, [](ProcessGroup& world) {
    Tensor x = Tensor::full({4, 4}, DType::F32, world.rank() + 1);
    for (int i = 0; i < 10; ++i) {
      for (int64_t dim : {0, 1}) {
        Tensor g = all_gather_tensor(x, dim, world);
        Tensor v = g.view_dtype(DType::I16);
        wait_tensor(v);
        EXPECT_EQ(g.storage()->pending_count(), 0u);
        EXPECT_TRUE(g.is_ready());
        EXPECT_EQ(v.sizes().back(), 2 * g.sizes().back());
      }
    }
  });
}

// A collective that fails (a peer left after it was issued) reports CommError from the lazy
// result's wait.
TEST(Waits, FailureReachesTheLazyResult) {
  Gate issued;
  std::atomic<bool> saw_comm_error{false};
  EXPECT_THROW(run_local(2,
                         [&](ProcessGroup& world) {
                           if (world.rank() == 1) {
                             EXPECT_TRUE(issued.wait_open());
                             throw std::runtime_error("rank 1 gives up");
                           }
                           Tensor lazy = all_gather_tensor(iota({2, 2}), 1, world);
                           issued.open();
                           try {
                             lazy.wait();
                           } catch (const CommError&) {
                             saw_comm_error = true;
                           }
                         }),
               std::runtime_error);
  EXPECT_TRUE(saw_comm_error.load());
}

// A collective whose input holds the failed result of an earlier one, on some ranks only: those
// ranks still take its place in the group's sequence, so it fails on every rank (naming why)
// and the group's next collective pairs up right. (A rank that threw before its sequence
// number paired its next all_reduce with its peers' current one: 103 instead of 6, silently.)
// Each shape and path: the lane (small all_reduce), the Op path (large), a gather, a scatter
// on dim 1 (transposed before the backend), a coalesced gather; the failed ranks arriving first
// and last.
TEST(Failures, AnInputHoldingAFailedResultFailsTheCollectiveOnEveryRank) {
  using Call = std::function<Tensor(const Tensor&, ProcessGroup&)>;
  struct Case {
    const char* name;
    int64_t numel;  // of the input
    Call call;
  };
  const std::vector<Case> kCases = {
      {"small all_reduce", 2,
       [](const Tensor& x, ProcessGroup& g) { return all_reduce(x, "sum", g); }},
      {"large all_reduce", 16384,
       [](const Tensor& x, ProcessGroup& g) { return all_reduce(x, "sum", g); }},
      {"all_gather_tensor", 2,
       [](const Tensor& x, ProcessGroup& g) { return all_gather_tensor(x, 0, g); }},
      {"reduce_scatter_tensor dim 1", 6,
       [](const Tensor& x, ProcessGroup& g) {
         return reduce_scatter_tensor(x.view({2, 3}), "sum", 1, g);
       }},
      {"all_gather_into_tensor_coalesced", 2,
       [](const Tensor& x, ProcessGroup& g) {
         return all_gather_into_tensor_coalesced({Tensor::full({1}, DType::F32, 1), x}, g)[1];
       }},
  };
  for (const Case& c : kCases) {
    for (const bool failed_first : {true, false}) {
      SCOPED_TRACE(std::string(c.name) + (failed_first ? ", failed ranks first" : ", last"));
      run_local(3, [&](ProcessGroup& world) {
        const int r = world.rank();
        const std::shared_ptr<ProcessGroup> pair = new_group(world, {0, 1});
        Tensor x = Tensor::full({c.numel}, DType::F32, 100);
        if (pair) {
          // Sizes that differ: both ranks' results hold the mismatch (rank 1's through a view).
          x = all_reduce(Tensor::full({c.numel + r}, DType::F32, 1), "sum", *pair);
          x = x.narrow(0, 0, c.numel);
        }
        if ((r == 2) == failed_first) std::this_thread::sleep_for(std::chrono::milliseconds(30));
        const std::string error = error_of<CommError>([&] { c.call(x, world).wait(); });
        if (r == 2) {
          EXPECT_THAT(error, HasSubstr("could not take part: its "));
          EXPECT_THAT(error, HasSubstr("holds the failed result of an earlier collective ("));
          EXPECT_THAT(error, HasSubstr("mismatched collectives"));  // the cause, named
        } else {
          EXPECT_THAT(error, HasSubstr("mismatched collectives"));  // its own input's failure
        }
        // The group's next collective is everyone's next one.
        const Tensor sum = all_reduce(Tensor::full({2}, DType::F32, r + 1), "sum", world);
        EXPECT_EQ(sum.to_vector<float>(), std::vector<float>({6, 6}));
      });
    }
  }
}

// The same on the backend's own primitive, in place: the Work fails on every rank.
TEST(Failures, APrimitiveOnAFailedTensorFailsOnEveryRank) {
  run_local(2, [](ProcessGroup& world) {
    Tensor x = all_reduce(Tensor::full({world.rank() == 0 ? 2 : 3}, DType::I32, 1), "sum", world);
    if (world.rank() == 1) x = x.narrow(0, 0, 2);
    const std::string error =
        error_of<CommError>([&] { world.all_reduce(x, ReduceOp::Sum)->wait(); });
    EXPECT_THAT(error, HasSubstr("all_reduce on group 'world' (seq 1): rank "));
    EXPECT_THAT(error, HasSubstr(" could not take part: its tensor holds the failed result"));
    Tensor ok = Tensor::full({3}, DType::I32, world.rank() + 1);
    world.all_reduce(ok, ReduceOp::Sum)->wait();
    EXPECT_EQ(ok.to_vector<int32_t>(), std::vector<int32_t>({3, 3, 3}));
  });
}

}  // namespace
}  // namespace funcol

namespace funcol {
namespace {

// DESIGN §4's tracing and the IR come with the umbrella header alone (this file includes no
// other funcol header for them): trace two all_reduces, print and re-parse. (The passes and the
// executor are in the header too; this layer's test does not link them.)
TEST(UmbrellaHeader, CoversTracingPassesAndTheIr) {
  std::unique_ptr<Graph> g = trace(
      "g", {Type(DType::F32, {4}), Type(DType::F32, {4})},
      [](std::span<const Tensor> in) {
        return std::vector<Tensor>{all_reduce(in[0], "sum", "world"),
                                   all_reduce(in[1], "sum", "world")};
      },
      {{"world", 2}});
  verify(*g);
  const std::string text = print(*g);
  EXPECT_THAT(text, HasSubstr("= all_reduce(%x.1) {reduce_op = \"sum\", group = \"world\"}"));
  EXPECT_EQ(print(*parse_graph(text)), text);
}

}  // namespace
}  // namespace funcol
