// Tests of DType, Storage (pending waits) and Tensor (factories, views, copies, printing).
#include "funcol/core/tensor.h"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <thread>

#include "funcol/core/kernels.h"
#include "test_util.h"

namespace funcol {
namespace {

using testing::ManualWork;


// Runs fn and returns the message of the E it throws (fails the test if it throws nothing).
template <typename E, typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

// ---- dtype ----------------------------------------------------------------------------------

TEST(DType, NamesRoundTripAndSizes) {
  const char* names[] = {"bool", "u8", "i8", "i16", "i32", "i64", "f16", "bf16", "f32", "f64"};
  const size_t sizes[] = {1, 1, 1, 2, 4, 8, 2, 2, 4, 8};
  for (size_t i = 0; i < 10; ++i) {
    DType d = kAllDTypes[i];
    EXPECT_EQ(dtype_name(d), names[i]);
    EXPECT_EQ(parse_dtype(names[i]), d);
    EXPECT_EQ(itemsize(d), sizes[i]);
  }
  EXPECT_EQ(parse_dtype("float32"), std::nullopt);
  EXPECT_EQ(parse_dtype("F32"), std::nullopt);
  EXPECT_TRUE(is_floating(DType::BF16));
  EXPECT_FALSE(is_floating(DType::I64));
  EXPECT_TRUE(is_integer(DType::U8));
  EXPECT_FALSE(is_integer(DType::Bool));
  EXPECT_FALSE(is_integer(DType::F16));
}

TEST(DType, ReduceOps) {
  EXPECT_EQ(parse_reduce_op("SUM"), ReduceOp::Sum);
  EXPECT_EQ(parse_reduce_op("Avg"), ReduceOp::Avg);
  EXPECT_EQ(parse_reduce_op("bxor"), ReduceOp::BXor);
  EXPECT_EQ(reduce_op_name(ReduceOp::Product), "product");
  EXPECT_EQ(error_of<InvalidArgument>([] { parse_reduce_op("mean"); }),
            "Unrecognized reduce_op: mean");
  EXPECT_THROW(check_reduce_op_dtype(ReduceOp::BAnd, DType::F32, "all_reduce"), InvalidArgument);
  EXPECT_THROW(check_reduce_op_dtype(ReduceOp::Avg, DType::Bool, "all_reduce"), InvalidArgument);
  EXPECT_NO_THROW(check_reduce_op_dtype(ReduceOp::BAnd, DType::I32, "all_reduce"));
  EXPECT_NO_THROW(check_reduce_op_dtype(ReduceOp::BXor, DType::Bool, "all_reduce"));
  EXPECT_NO_THROW(check_reduce_op_dtype(ReduceOp::Sum, DType::BF16, "all_reduce"));
  std::string msg = error_of<InvalidArgument>(
      [] { check_reduce_op_dtype(ReduceOp::BOr, DType::F16, "all_reduce"); });
  EXPECT_NE(msg.find("all_reduce"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bor"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f16"), std::string::npos) << msg;
}

// A failed allocation is a funcol::Error too (DESIGN section 4), not a bare std::bad_alloc.
// A request beyond the machine's memory is refused before asking, so sanitizers' allocators
// (which abort rather than throw) see none.
TEST(Error, OutOfMemoryIsAnError) {
  const std::string msg = error_of<Error>([] { Tensor::zeros({int64_t{1} << 45}, DType::F32); });
  EXPECT_EQ(msg, "out of memory: cannot allocate 140737488355328 bytes");
}

TEST(Error, CheckThrowsInternalError) {
  EXPECT_THROW(FUNCOL_CHECK(1 + 1 == 3, "math"), InternalError);
  EXPECT_NO_THROW(FUNCOL_CHECK(true));
}

// rethrow_prefixed keeps the error's kind and where in IR text it points; an error without a
// location takes the one it is given.
TEST(Error, RethrowPrefixedKeepsKindAndLocation) {
  auto rethrown = [](auto thrower, const SourceLocated* at = nullptr) -> std::exception_ptr {
    try {
      try {
        thrower();
      } catch (...) {
        rethrow_prefixed("rank 1: ", at);
      }
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  };
  auto what_and_where = [](std::exception_ptr p) -> std::string {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      const auto* at = dynamic_cast<const SourceLocated*>(&e);
      return std::string(e.what()) + " | " + (at ? at->located() : "-");
    }
  };

  std::exception_ptr p = rethrown([] { throw ShapeError("bad shape"); });
  EXPECT_THROW(std::rethrow_exception(p), ShapeError);
  EXPECT_EQ(what_and_where(p), "rank 1: bad shape | -");

  p = rethrown([] {
    throw LocatedError<CommError>("node %a (line 2): lost", "g.ir", 2, 3, "node %a: lost");
  });
  EXPECT_THROW(std::rethrow_exception(p), CommError);
  EXPECT_EQ(what_and_where(p),
            "rank 1: node %a (line 2): lost | g.ir:2:3: error: rank 1: node %a: lost");

  p = rethrown([] { throw ParseError("g.ir", 4, 5, "unknown op 'x'"); });
  EXPECT_THROW(std::rethrow_exception(p), InvalidArgument);
  EXPECT_EQ(what_and_where(p),
            "rank 1: g.ir:4:5: error: unknown op 'x' | g.ir:4:5: error: rank 1: unknown op 'x'");

  const SourceLocated node("g.ir", 7, 1, "node %v: ");
  p = rethrown([] { throw InvalidArgument("division by zero"); }, &node);
  EXPECT_THROW(std::rethrow_exception(p), InvalidArgument);
  EXPECT_EQ(what_and_where(p),
            "rank 1: division by zero | g.ir:7:1: error: node %v: division by zero");

  // Every kind (AbandonedError became a plain Error).
  p = rethrown([] { throw AbandonedError("it gave up"); });
  EXPECT_THROW(std::rethrow_exception(p), AbandonedError);
  p = rethrown([] { throw InternalError("broken"); });
  EXPECT_THROW(std::rethrow_exception(p), InternalError);

  p = rethrown([] { throw std::bad_alloc(); }, &node);
  EXPECT_EQ(what_and_where(p), "rank 1: out of memory | g.ir:7:1: error: node %v: out of memory");
}

// ---- factories ------------------------------------------------------------------------------

TEST(Factories, EmptyZerosFullEveryDType) {
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    Tensor e = Tensor::empty({2, 3}, d);
    EXPECT_TRUE(e.defined());
    EXPECT_FALSE(e.is_meta());
    EXPECT_EQ(e.dtype(), d);
    EXPECT_EQ(e.sizes(), (Shape{2, 3}));
    EXPECT_EQ(e.strides(), (Shape{3, 1}));
    EXPECT_EQ(e.numel(), 6);
    EXPECT_EQ(e.nbytes(), 6 * itemsize(d));
    EXPECT_TRUE(e.is_contiguous());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(e.storage()->raw()) % 64, 0u);

    EXPECT_EQ(Tensor::zeros({2, 3}, d).to_vector<double>(), std::vector<double>(6, 0.0));
    const double expect_full = d == DType::Bool ? 1.0 : 3.0;
    EXPECT_EQ(Tensor::full({2, 3}, d, 3.0).to_vector<double>(),
              std::vector<double>(6, expect_full));
    EXPECT_EQ(Tensor::full({}, d, 1.0).item<int>(), 1);
    EXPECT_EQ(Tensor::full({}, d, 1.0).dim(), 0);
    EXPECT_EQ(Tensor::zeros({0, 4}, d).numel(), 0);
  }
}

TEST(Factories, ArangeEveryDType) {
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    if (d == DType::Bool) {
      // Only 0 and 1 fit: a longer range is refused (PyTorch refuses bool ranges altogether)
      // instead of saturating to [0, 1, 1, 1, 1].
      EXPECT_EQ(Tensor::arange(2, d).to_vector<int64_t>(), (std::vector<int64_t>{0, 1}));
      EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::arange(5, DType::Bool); }),
                "arange: 5 values do not fit bool (0 and 1 only)");
      continue;
    }
    Tensor t = Tensor::arange(5, d);
    EXPECT_EQ(t.sizes(), (Shape{5}));
    EXPECT_EQ(t.to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  }
  EXPECT_EQ(Tensor::arange(0, DType::F32).numel(), 0);
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::arange(-1, DType::F32); }),
            "arange: n must be non-negative, got -1");
  // Integer values never wrap: i8 holds 0..127, u8 0..255.
  EXPECT_EQ(Tensor::arange(128, DType::I8).to_vector<int>().back(), 127);
  EXPECT_EQ(Tensor::arange(256, DType::U8).to_vector<int>().back(), 255);
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::arange(300, DType::I8); }),
            "arange: value 299 cannot be converted to i8 without overflow");
  EXPECT_THROW(Tensor::arange(257, DType::U8), InvalidArgument);
}

TEST(Factories, IntegerValuesMustFit) {
  EXPECT_EQ(Tensor::full({2}, DType::I8, 127).to_vector<int>(), (std::vector<int>{127, 127}));
  EXPECT_EQ(Tensor::full({1}, DType::I8, -128).item<int>(), -128);
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::full({2}, DType::I8, 1000); }),
            "full: value 1000 cannot be converted to i8 without overflow");
  EXPECT_THROW(Tensor::full({2}, DType::I8, 128), InvalidArgument);
  // As PyTorch (c10::overflows): a negative integer down to -255 wraps into u8; -256 and a
  // negative double do not.
  EXPECT_EQ(Tensor::full({2}, DType::U8, -1).to_vector<int>(), (std::vector<int>{255, 255}));
  EXPECT_EQ(Tensor::zeros({1}, DType::U8).fill_(-255).item<int>(), 1);
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::full({2}, DType::U8, -256); }),
            "full: value -256 cannot be converted to u8 without overflow");
  EXPECT_THROW(Tensor::full({2}, DType::U8, -1.0), InvalidArgument);
  EXPECT_THROW(Tensor::full({2}, DType::I8, -129), InvalidArgument);
  EXPECT_THROW(Tensor::full({2}, DType::I32, 2147483648.0), InvalidArgument);
  EXPECT_THROW(Tensor::full({2}, DType::I64, 9.3e18), InvalidArgument);
  EXPECT_THROW(Tensor::full({2}, DType::I32, std::nan("")), InvalidArgument);
  EXPECT_EQ(Tensor::full({1}, DType::I64, -9223372036854775808.0).item<int64_t>(),
            std::numeric_limits<int64_t>::min());
  // Fractions truncate as before; bool takes any value.
  EXPECT_EQ(Tensor::full({1}, DType::I32, -2.5).item<int>(), -2);
  EXPECT_EQ(Tensor::full({1}, DType::Bool, 1000).item<int>(), 1);
}

// A finite value beyond the dtype's largest finite one is refused as an integer overflow is,
// even where it would round down to that one (PyTorch's check: "value cannot be converted to
// type at::Half without overflow"); inf and nan are kept.
TEST(Factories, FloatingValuesMustNotOverflow) {
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::full({2}, DType::F16, 1e6); }),
            "full: value 1000000 cannot be converted to f16 without overflow");
  EXPECT_THROW(Tensor::full({2}, DType::F16, -1e6), InvalidArgument);
  EXPECT_THROW(Tensor::full({2}, DType::F16, 100000), InvalidArgument);  // an integer value
  EXPECT_THROW(Tensor::full({2}, DType::BF16, 1e39), InvalidArgument);
  EXPECT_THROW(Tensor::full({2}, DType::F32, 1e39), InvalidArgument);
  EXPECT_THROW(Tensor::full({2}, DType::F32, -1e300), InvalidArgument);
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::zeros({2}, DType::BF16).fill_(-1e39); }),
            "fill_: value -1e+39 cannot be converted to bf16 without overflow");
  EXPECT_THROW(Tensor::arange(70000, DType::F16), InvalidArgument);
  // The largest finite values fit; anything beyond does not, though 65519 would round to f16's
  // 65504, 3.4028235e38 to FLT_MAX and 3.39e38 to bf16's 0x1.fep+127.
  EXPECT_EQ(Tensor::full({1}, DType::F16, 65504).item<float>(), 65504.0f);
  EXPECT_EQ(Tensor::full({1}, DType::F16, -65504).item<float>(), -65504.0f);
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::full({1}, DType::F16, 65505.0); }),
            "full: value 65505 cannot be converted to f16 without overflow");
  EXPECT_THROW(Tensor::full({1}, DType::F16, 65519.0), InvalidArgument);
  EXPECT_THROW(Tensor::full({1}, DType::F16, -65504.5), InvalidArgument);
  const double f32_max = std::numeric_limits<float>::max();
  EXPECT_EQ(Tensor::full({1}, DType::F32, f32_max).item<float>(),
            std::numeric_limits<float>::max());
  EXPECT_THROW(Tensor::full({1}, DType::F32, 3.4028235e38), InvalidArgument);
  EXPECT_EQ(Tensor::full({1}, DType::BF16, 0x1.fep+127).item<float>(), 0x1.fep+127f);
  EXPECT_THROW(Tensor::full({1}, DType::BF16, 3.39e38), InvalidArgument);
  // f64 holds every double; infinities and nan stay allowed everywhere floating.
  EXPECT_EQ(Tensor::full({1}, DType::F64, 1e300).item<double>(), 1e300);
  const double inf = std::numeric_limits<double>::infinity();
  for (DType d : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    EXPECT_TRUE(std::isinf(Tensor::full({1}, d, inf).item<float>()));
    EXPECT_LT(Tensor::full({1}, d, -inf).item<float>(), 0.0f);
    EXPECT_TRUE(std::isnan(Tensor::full({1}, d, std::nan("")).item<float>()));
    EXPECT_TRUE(std::isinf(Tensor::zeros({1}, d).fill_(-inf).item<float>()));
  }
}

// Integer values are not rounded through a double: 2^53 + 1 and INT64_MAX survive.
TEST(Factories, IntegerValuesAreExact) {
  const int64_t odd = (int64_t{1} << 53) + 1;
  EXPECT_EQ(Tensor::full({2}, DType::I64, odd).to_vector<int64_t>(),
            (std::vector<int64_t>{odd, odd}));
  EXPECT_EQ(Tensor::full({1}, DType::I64, std::numeric_limits<int64_t>::max()).item<int64_t>(),
            std::numeric_limits<int64_t>::max());
  EXPECT_EQ(Tensor::full({1}, DType::I64, std::numeric_limits<int64_t>::min()).item<int64_t>(),
            std::numeric_limits<int64_t>::min());
  Tensor t = Tensor::zeros({3}, DType::I64);
  t.narrow(0, 1, 2).fill_(odd);
  EXPECT_EQ(t.to_vector<int64_t>(), (std::vector<int64_t>{0, odd, odd}));
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::full({1}, DType::I32, int64_t{1} << 40); }),
            "full: value 1099511627776 cannot be converted to i32 without overflow");
  EXPECT_EQ(error_of<InvalidArgument>(
                [] { Tensor::full({1}, DType::U8, 1).fill_(uint64_t{1} << 63); }),
            "fill_: value 9.223372036854776e+18 cannot be converted to u8 without overflow");
  // Floating dtypes round the integer once, as a cast does.
  EXPECT_EQ(Tensor::full({1}, DType::F64, odd).item<double>(), static_cast<double>(odd));
  EXPECT_EQ(Tensor::full({1}, DType::F32, 16777217).item<float>(), 16777216.0f);
  EXPECT_EQ(Tensor::full({1}, DType::F64, std::numeric_limits<uint64_t>::max()).item<double>(),
            18446744073709551616.0);
  EXPECT_EQ(Tensor::full({1}, DType::Bool, int64_t{1} << 40).item<int>(), 1);
}


TEST(Factories, RandIsDeterministicAndInRange) {
  for (DType d : kAllDTypes) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    Tensor a = Tensor::rand({50, 20}, d, 7);
    EXPECT_TRUE(a.equal(Tensor::rand({50, 20}, d, 7)));
    EXPECT_FALSE(a.equal(Tensor::rand({50, 20}, d, 8)));
    std::vector<double> v = a.to_vector<double>();
    double lo = 1e9, hi = -1e9;
    for (double x : v) {
      lo = std::min(lo, x);
      hi = std::max(hi, x);
      if (is_integer(d)) {
        EXPECT_EQ(x, std::floor(x));
      }
    }
    if (is_floating(d)) {
      EXPECT_GE(lo, -1.0);
      EXPECT_LT(hi, 1.0);
      EXPECT_LT(lo, -0.5);  // 1000 draws cover the range
      EXPECT_GT(hi, 0.5);
    } else if (is_integer(d)) {
      EXPECT_GE(lo, 0.0);
      EXPECT_LT(hi, 100.0);
      EXPECT_LT(lo, 10.0);
      EXPECT_GT(hi, 90.0);
    } else {
      EXPECT_EQ(lo, 0.0);
      EXPECT_EQ(hi, 1.0);
    }
  }
}

TEST(Factories, RandGoldenValues) {
  // Pins the generator (splitmix64, one draw per element in row-major order): graph inputs of
  // `funcol run` must be identical on every machine.
  EXPECT_EQ(Tensor::rand({6}, DType::I64, 42).to_vector<int64_t>(),
            (std::vector<int64_t>{13, 91, 58, 64, 50, 62}));
  EXPECT_EQ(Tensor::rand({3}, DType::F64, 42).to_vector<double>(),
            (std::vector<double>{0.48312975754364662, -0.68017921424615979, -0.44279773948972267}));
}

TEST(Factories, FromVectorAndToVector) {
  Tensor t = Tensor::from_vector<float>({1.5f, -2.75f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  EXPECT_EQ(t.dtype(), DType::F32);
  EXPECT_EQ(t.sizes(), (Shape{2, 3}));
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1.5f, -2.75f, 3.f, 4.f, 5.f, 6.f}));
  EXPECT_EQ(t.to_vector<int32_t>(), (std::vector<int32_t>{1, -2, 3, 4, 5, 6}));
  EXPECT_EQ(t.to_vector<bool>(), (std::vector<bool>{true, true, true, true, true, true}));
  EXPECT_EQ(Tensor::from_vector<int64_t>({1, 2, 3}).sizes(), (Shape{3}));
  EXPECT_EQ(Tensor::from_vector<bool>({true, false}).dtype(), DType::Bool);
  EXPECT_EQ(Tensor::from_vector<bool>({true, false}).to_vector<float>(),
            (std::vector<float>{1.f, 0.f}));
  EXPECT_EQ(Tensor::from_vector<uint8_t>({255, 0}).to_vector<int>(), (std::vector<int>{255, 0}));
  EXPECT_EQ(Tensor::from_vector<int8_t>({-128, 127}).to_vector<int64_t>(),
            (std::vector<int64_t>{-128, 127}));
  EXPECT_EQ(Tensor::from_vector<int16_t>({-300}).item<int16_t>(), -300);
  EXPECT_EQ(Tensor::from_vector<double>({0.1}).item<double>(), 0.1);
  EXPECT_EQ(Tensor::from_vector<long long>({1LL << 40}).dtype(), DType::I64);
  EXPECT_EQ(Tensor::from_vector<long long>({1LL << 40}).item<long long>(), 1LL << 40);
  Tensor h = Tensor::from_vector<Eigen::half>({Eigen::half(0.5f), Eigen::half(-2.f)});
  EXPECT_EQ(h.dtype(), DType::F16);
  EXPECT_EQ(h.to_vector<float>(), (std::vector<float>{0.5f, -2.f}));
  Tensor b = Tensor::from_vector<Eigen::bfloat16>({Eigen::bfloat16(3.f)});
  EXPECT_EQ(b.dtype(), DType::BF16);
  EXPECT_EQ(b.item<int>(), 3);
  EXPECT_EQ(b.to_vector<Eigen::half>()[0], Eigen::half(3.f));
  EXPECT_EQ(error_of<ShapeError>([] {
              Tensor::from_vector<float>({1, 2, 3}, {2, 2});
            }),
            "from_vector: 3 values do not fit shape [2,2] (4 elements)");
  // An explicit empty shape is a scalar, as in full({}, ...); no shape at all is 1-D.
  Tensor scalar = Tensor::from_vector<float>({5.f}, {});
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.item<float>(), 5.f);
  EXPECT_EQ(Tensor::from_vector<float>({5.f}).sizes(), (Shape{1}));
  EXPECT_EQ(error_of<ShapeError>([] {
              Tensor::from_vector<float>({1, 2}, {});
            }),
            "from_vector: 2 values do not fit shape [] (1 elements)");
  EXPECT_EQ(Tensor::from_vector<float>({}).sizes(), (Shape{0}));
  EXPECT_THROW(Tensor::empty({2, -1}, DType::F32), ShapeError);
}

TEST(Factories, ConversionsAreDefined) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor f = Tensor::from_vector<float>({nan, 300.f, -1.f, 1e30f, -1e30f, -0.f});
  EXPECT_EQ(f.to_vector<uint8_t>(), (std::vector<uint8_t>{0, 44, 255, 255, 0, 0}));
  EXPECT_EQ(f.to_vector<int64_t>(),
            (std::vector<int64_t>{0, 300, -1, std::numeric_limits<int64_t>::max(),
                                  std::numeric_limits<int64_t>::min(), 0}));
  EXPECT_EQ(f.to_vector<bool>(), (std::vector<bool>{true, true, true, true, true, false}));
  EXPECT_EQ(Tensor::from_vector<int32_t>({70000}).to_vector<int16_t>()[0],
            static_cast<int16_t>(70000 - 65536));
  EXPECT_TRUE(std::isinf(Tensor::from_vector<float>({1e6f}).to(DType::F16).item<float>()));
}

TEST(Factories, ItemAndDataChecks) {
  EXPECT_EQ(Tensor::full({1, 1}, DType::I32, 9).item<int>(), 9);
  EXPECT_EQ(error_of<ShapeError>([] {
              Tensor::zeros({2, 3}, DType::F32).item<float>();
            }),
            "item: expected a tensor with exactly one element, got f32[2,3] (6 elements)");
  EXPECT_THROW(Tensor::zeros({0}, DType::F32).item<float>(), ShapeError);
  Tensor t = Tensor::zeros({2}, DType::I64);
  EXPECT_EQ(t.data<int64_t>(), t.data_ptr());
  EXPECT_EQ(error_of<InvalidArgument>([&] { t.data<float>(); }),
            "data: requested f32 but the tensor is i64");
  EXPECT_THROW(Tensor().data_ptr(), InvalidArgument);
  EXPECT_FALSE(Tensor().defined());
  EXPECT_EQ(Tensor().numel(), 0);
}

TEST(Factories, MetaTensors) {
  Tensor m = Tensor::meta({4, 6}, DType::BF16);
  EXPECT_TRUE(m.is_meta());
  EXPECT_TRUE(m.is_ready());
  EXPECT_EQ(m.nbytes(), 48u);
  EXPECT_EQ(m.narrow(1, 2, 3).sizes(), (Shape{4, 3}));
  EXPECT_EQ(m.view({-1}).sizes(), (Shape{24}));
  EXPECT_EQ(m.transpose(0, 1).reshape({24}).sizes(), (Shape{24}));
  EXPECT_EQ(m.view_dtype(DType::U8).sizes(), (Shape{4, 12}));
  EXPECT_EQ(m.chunk(2, 1).size(), 2u);
  EXPECT_TRUE(m.transpose(0, 1).contiguous().is_meta());
  EXPECT_TRUE(m.to(DType::F32).is_meta());
  EXPECT_EQ(m.to(DType::F32).dtype(), DType::F32);
  EXPECT_TRUE(Tensor::cat({m, Tensor::zeros({1, 6}, DType::BF16)}).is_meta());
  EXPECT_EQ(Tensor::cat({m, Tensor::zeros({1, 6}, DType::BF16)}).sizes(), (Shape{5, 6}));
  EXPECT_EQ(m.to_string(), "tensor(bf16[4,6], meta)");
  std::string msg = error_of<InvalidArgument>([&] { m.data_ptr(); });
  EXPECT_NE(msg.find("on a meta tensor"), std::string::npos) << msg;
  EXPECT_THROW(m.to_vector<float>(), InvalidArgument);
  EXPECT_THROW(m.item<float>(), InvalidArgument);
  EXPECT_THROW(m.fill_(1), InvalidArgument);
  EXPECT_THROW(m.copy_(m), InvalidArgument);
  EXPECT_THROW(m.equal(m), InvalidArgument);
  EXPECT_THROW(add(m, m), InvalidArgument);
}

// A moved-from Tensor is undefined, as a default-constructed one is: not a meta tensor, and
// its data cannot be reached.
TEST(Factories, MovedFromTensorsAreUndefined) {
  Tensor a = Tensor::full({3}, DType::F32, 2);
  Tensor b = std::move(a);
  EXPECT_FALSE(a.defined());  // NOLINT(bugprone-use-after-move): the state under test
  EXPECT_FALSE(a.is_meta());
  EXPECT_EQ(a.numel(), 0);
  EXPECT_EQ(a.to_string(), "tensor(undefined)");
  EXPECT_THROW(a.data_ptr(), InvalidArgument);
  EXPECT_EQ(b.to_vector<float>(), std::vector<float>(3, 2.0f));
  Tensor m = Tensor::meta({2}, DType::F32);
  Tensor n;
  n = std::move(m);
  EXPECT_FALSE(m.defined());  // NOLINT(bugprone-use-after-move)
  EXPECT_TRUE(n.is_meta());
}

TEST(Factories, FromStorage) {
  auto storage = std::make_shared<Storage>(64);
  Tensor a = Tensor::from_storage(storage, {4}, DType::F32);
  Tensor b = Tensor::from_storage(storage, {2}, DType::F32, 2);
  a.copy_(Tensor::from_vector<float>({1, 2, 3, 4}));
  EXPECT_TRUE(a.shares_storage(b));
  EXPECT_EQ(b.storage_offset(), 2);
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{3, 4}));
  EXPECT_EQ(error_of<ShapeError>([&] {
              Tensor::from_storage(storage, {4, 4}, DType::F32, 2);
            }),
            "from_storage: f32[4,4] at offset 2 needs 72 bytes but the storage has 64");
  EXPECT_THROW(Tensor::from_storage(nullptr, {1}, DType::F32), InvalidArgument);
  EXPECT_THROW(Tensor::from_storage(storage, {1}, DType::F32, -1), InvalidArgument);
}

TEST(Factories, Placed) {
  auto storage = std::make_shared<Storage>(64);
  Tensor like = Tensor::meta({2, 2}, DType::F32);
  Tensor a = Tensor::placed(like, storage, 0);
  Tensor b = Tensor::placed(like, storage, 4);
  EXPECT_TRUE(a.shares_storage(b));
  EXPECT_EQ(b.sizes(), (Shape{2, 2}));
  EXPECT_EQ(b.dtype(), DType::F32);
  EXPECT_EQ(b.storage_offset(), 4);
  EXPECT_EQ(a.sizes().data(), like.sizes().data());  // the layout is shared, not rebuilt
  Tensor::from_storage(storage, {16}, DType::F32).copy_(Tensor::arange(16, DType::F32));
  EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{4, 5, 6, 7}));
  // A strided `like` (sizes [2, 2], strides [1, 4]) reaches its last element at 1 + 4 past
  // the offset.
  Tensor t = Tensor::meta({2, 4}, DType::F32).transpose(0, 1).narrow(0, 0, 2);
  EXPECT_EQ(Tensor::placed(t, storage, 10).to_vector<float>(),
            (std::vector<float>{10, 14, 11, 15}));
  EXPECT_EQ(error_of<ShapeError>([&] { Tensor::placed(t, storage, 11); }),
            "placed: f32[2,2] at offset 11 needs 68 bytes but the storage has 64");
  EXPECT_EQ(error_of<ShapeError>([&] { Tensor::placed(like, storage, 13); }),
            "placed: f32[2,2] at offset 13 needs 68 bytes but the storage has 64");
  EXPECT_EQ(error_of<ShapeError>([&] { Tensor::placed(like, storage, INT64_MAX - 1); }),
            "placed: f32[2,2] at offset 9223372036854775806 lies past the end of the storage "
            "(64 bytes)");
  // Nothing to hold: any offset inside or past the end, as from_storage.
  EXPECT_EQ(Tensor::placed(Tensor::meta({0}, DType::F32), storage, 100).numel(), 0);
  EXPECT_THROW(Tensor::placed(like, storage, -1), InvalidArgument);
  EXPECT_THROW(Tensor::placed(like, nullptr, 0), InvalidArgument);
  EXPECT_THROW(Tensor::placed(Tensor(), storage, 0), InvalidArgument);
}

TEST(Factories, PlacedRun) {
  auto storage = std::make_shared<Storage>(64);
  Tensor::from_storage(storage, {16}, DType::F32).copy_(Tensor::arange(16, DType::F32));
  Tensor like = Tensor::meta({3}, DType::F32);
  // The run replaces what the tensors held (here views of another storage).
  Tensor other = Tensor::zeros({8}, DType::F32);
  std::vector<Tensor> out = {other, other.narrow(0, 2, 2), Tensor(), other};
  Tensor::placed_run(like, storage, 2, std::span<Tensor>(out).subspan(0, 3));
  EXPECT_EQ(out[0].to_vector<float>(), (std::vector<float>{2, 3, 4}));
  EXPECT_EQ(out[1].to_vector<float>(), (std::vector<float>{5, 6, 7}));
  EXPECT_EQ(out[2].to_vector<float>(), (std::vector<float>{8, 9, 10}));
  EXPECT_EQ(out[2].storage_offset(), 8);
  EXPECT_EQ(out[1].sizes().data(), like.sizes().data());  // the layout is shared
  EXPECT_TRUE(out[0].shares_storage(out[2]));
  EXPECT_TRUE(out[3].shares_storage(other));  // outside the span: untouched
  EXPECT_EQ(storage.use_count(), 4);
  // The last tensor must fit: 5 x 3 from 1 ends at element 16 (fits), from 2 at 17 (not),
  // and a refused run writes nothing.
  std::vector<Tensor> five(5);
  Tensor::placed_run(like, storage, 1, five);
  EXPECT_EQ(five[4].to_vector<float>(), (std::vector<float>{13, 14, 15}));
  std::vector<Tensor> kept = {other, other, other, other, other};
  EXPECT_EQ(error_of<ShapeError>([&] { Tensor::placed_run(like, storage, 2, kept); }),
            "placed: f32[3] at offset 14 needs 68 bytes but the storage has 64");
  for (const Tensor& t : kept) EXPECT_TRUE(t.shares_storage(other));
  EXPECT_EQ(error_of<ShapeError>([&] {
              std::vector<Tensor> many(3);
              Tensor::placed_run(like, storage, INT64_MAX - 4, many);
            }),
            "placed: f32[3] at offset 9223372036854775803 lies past the end of the storage "
            "(64 bytes)");
  // Empty tensors fit anywhere; an empty run checks nothing.
  std::vector<Tensor> empties(1000);
  Tensor::placed_run(Tensor::meta({0}, DType::F32), storage, 100, empties);
  EXPECT_EQ(empties[999].numel(), 0);
  Tensor::placed_run(Tensor(), nullptr, -1, {});
  EXPECT_THROW(Tensor::placed_run(like, storage, -1, five), InvalidArgument);
  EXPECT_THROW(Tensor::placed_run(like, nullptr, 0, five), InvalidArgument);
}

// ---- views ----------------------------------------------------------------------------------

Tensor iota(const Shape& shape, DType dtype = DType::I64) {
  return Tensor::arange(shape_numel(shape), dtype).view(shape);
}

TEST(Views, ShareStorageAndSeeWrites) {
  Tensor t = iota({3, 4});
  Tensor row = t.select(0, 1);
  Tensor col = t.select(1, -1);
  Tensor nar = t.narrow(1, 1, 2);
  Tensor tr = t.transpose(0, 1);
  for (const Tensor& v : {row, col, nar, tr, t.view({12}), t.unsqueeze(0), t.flatten()}) {
    EXPECT_TRUE(v.shares_storage(t));
  }
  EXPECT_EQ(row.to_vector<int>(), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(col.to_vector<int>(), (std::vector<int>{3, 7, 11}));
  EXPECT_EQ(nar.to_vector<int>(), (std::vector<int>{1, 2, 5, 6, 9, 10}));
  EXPECT_FALSE(nar.is_contiguous());
  EXPECT_EQ(tr.sizes(), (Shape{4, 3}));
  EXPECT_EQ(tr.to_vector<int>(), (std::vector<int>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  nar.fill_(-1);
  EXPECT_EQ(t.to_vector<int>(), (std::vector<int>{0, -1, -1, 3, 4, -1, -1, 7, 8, -1, -1, 11}));
  EXPECT_EQ(row.storage_offset(), 4);
}

TEST(Views, LayoutsAreSharedAndImmutable) {
  // A copy shares the layout (no vectors copied); a view gets its own and leaves the original.
  Tensor a = Tensor::arange(12, DType::F32).view({3, 4});
  Tensor b = a;
  EXPECT_EQ(a.sizes().data(), b.sizes().data());
  a = a.transpose(0, 1);
  EXPECT_EQ(b.sizes(), (Shape{3, 4}));
  EXPECT_EQ(b.strides(), (Shape{4, 1}));
  EXPECT_TRUE(b.is_contiguous());
  EXPECT_EQ(a.sizes(), (Shape{4, 3}));
  EXPECT_FALSE(a.is_contiguous());
  EXPECT_EQ(a.numel(), 12);
  // Tensors of a recently used shape share its contiguous layout, on every path that makes one.
  Tensor c = Tensor::empty({3, 4}, DType::I64);
  Tensor d = Tensor::from_storage(c.storage(), {3, 4}, DType::I32, 2);
  EXPECT_EQ(c.sizes().data(), d.sizes().data());
  EXPECT_EQ(d.strides(), (Shape{4, 1}));
  // Undefined tensors have no dims; an empty tensor is contiguous whatever its strides.
  EXPECT_EQ(Tensor().dim(), 0);
  EXPECT_EQ(Tensor().numel(), 0);
  EXPECT_TRUE(Tensor::empty({0, 5}, DType::F32).transpose(0, 1).is_contiguous());
  EXPECT_TRUE(Tensor::empty({0, 4, 3}, DType::F32).transpose(1, 2).is_contiguous());
}

TEST(Views, ContiguousLayoutsAreSharedAcrossThreads) {
  // Interned: a shape's contiguous layout is one object for every thread (a thread's own cache
  // alone would give each thread its own).
  const Tensor here = Tensor::empty({7, 3, 5}, DType::F32);
  const Tensor there = std::async(std::launch::async, [] {
                         return Tensor::zeros({7, 3, 5}, DType::I8).view({7, 15}).view({7, 3, 5});
                       }).get();
  EXPECT_EQ(here.sizes().data(), there.sizes().data());
  EXPECT_EQ(there.strides(), (Shape{15, 5, 1}));
}

TEST(Views, TensorsMadeAfterTheThreadsLayoutCacheIsGone) {
  // A thread_local constructed before the thread's layout cache is destroyed after it: its
  // destructor's tensors must not touch the destroyed cache (a use after free before).
  std::thread([] {
    struct Late {
      ~Late() {
        Tensor t = Tensor::zeros({4}, DType::F32);
        Tensor v = t.view({2, 2}).narrow(0, 1, 1);
        EXPECT_EQ(v.sizes(), (Shape{1, 2}));
        EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 0.0f));
      }
    };
    thread_local Late late;
    (void)&late;
    EXPECT_EQ(Tensor::zeros({4}, DType::F32).view({2, 2}).numel(), 4);  // fills the cache
  }).join();
}

// Views start without the annotation (tensor.h), those that change nothing too: a squeeze of a
// dim that is not 1, and a scalar's squeeze and transpose kept it (a review's finding).
TEST(Views, StartWithoutTheAnnotation) {
  const auto mark = std::make_shared<int>(7);
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  Tensor s = Tensor::zeros({}, DType::F32);
  t.set_annotation(mark);
  s.set_annotation(mark);
  EXPECT_EQ(Tensor(t).annotation(), mark);  // a copy of the Tensor shares it
  for (const Tensor& v : {t.squeeze(0), t.squeeze(1), t.transpose(0, 1), t.narrow(0, 0, 2),
                          t.view({6}), s.squeeze(0), s.squeeze(-1), s.transpose(0, -1)}) {
    EXPECT_EQ(v.annotation(), nullptr) << v.to_string();
    EXPECT_EQ(v.storage(), v.dim() == 0 ? s.storage() : t.storage());
  }
}

TEST(Views, PermuteUnsqueezeSqueeze) {
  Tensor t = iota({2, 3, 4});
  Tensor p = t.permute({2, 0, 1});
  EXPECT_EQ(p.sizes(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.strides(), (Shape{1, 12, 4}));
  EXPECT_EQ(p.select(0, 1).to_vector<int>(), (std::vector<int>{1, 5, 9, 13, 17, 21}));
  EXPECT_THROW(t.permute({0, 0, 1}), InvalidArgument);
  EXPECT_THROW(t.permute({0, 1}), ShapeError);
  EXPECT_EQ(t.unsqueeze(1).sizes(), (Shape{2, 1, 3, 4}));
  EXPECT_EQ(t.unsqueeze(-1).sizes(), (Shape{2, 3, 4, 1}));
  EXPECT_EQ(t.unsqueeze(3).strides(), (Shape{12, 4, 1, 1}));
  EXPECT_TRUE(t.unsqueeze(1).is_contiguous());
  EXPECT_EQ(t.unsqueeze(0).squeeze(0).sizes(), t.sizes());
  EXPECT_EQ(t.squeeze(1).sizes(), t.sizes());  // not size 1: no-op
  EXPECT_EQ(error_of<ShapeError>([&] { t.unsqueeze(4); }),
            "unsqueeze: dim 4 is out of range for a tensor of rank 3 (expected -4 to 3)");
  EXPECT_EQ(error_of<ShapeError>([&] { t.unsqueeze(-5); }),
            "unsqueeze: dim -5 is out of range for a tensor of rank 3 (expected -4 to 3)");
  EXPECT_EQ(error_of<ShapeError>([&] { t.size(3); }),
            "size: dim 3 is out of range for a tensor of rank 3");
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(error_of<ShapeError>([&] { t.select(1, 3); }),
            "select: index 3 is out of range for size 3 of dim 1");
}

// A scalar takes dims 0 and -1, as the op table's shape inference says (and PyTorch does).
TEST(Views, TransposeOfScalar) {
  const Tensor s = Tensor::full({}, DType::F32, 3.0);
  const Tensor t = s.transpose(0, -1);
  EXPECT_EQ(t.sizes(), Shape{});
  EXPECT_TRUE(t.shares_storage(s));
  EXPECT_EQ(t.item<float>(), 3.0f);
  EXPECT_EQ(error_of<ShapeError>([&] { s.transpose(1, 0); }),
            "transpose: dim 1 is out of range for a scalar (0 or -1)");
  // squeeze too (torch.tensor(3.).squeeze(0) is the scalar itself).
  for (const int64_t d : {0, -1}) {
    const Tensor q = s.squeeze(d);
    EXPECT_EQ(q.sizes(), Shape{});
    EXPECT_TRUE(q.shares_storage(s));
  }
  EXPECT_EQ(error_of<ShapeError>([&] { s.squeeze(1); }),
            "squeeze: dim 1 is out of range for a tensor of rank 0");
}

TEST(Views, ViewAndReshape) {
  Tensor t = iota({2, 3, 4});
  EXPECT_EQ(t.view({6, -1}).sizes(), (Shape{6, 4}));
  EXPECT_EQ(t.view({-1}).sizes(), (Shape{24}));
  EXPECT_EQ(t.view({2, 3, 2, 2}).strides(), (Shape{12, 4, 2, 1}));
  EXPECT_EQ(error_of<ShapeError>([&] {
              t.view({5, -1});
            }),
            "view: shape [5,-1] is invalid for a tensor of 24 elements");
  EXPECT_EQ(error_of<ShapeError>([&] { t.view({7}); }),
            "view: shape [7] is invalid for a tensor of 24 elements");
  EXPECT_THROW(t.view({-1, -1}), ShapeError);
  EXPECT_THROW(Tensor::zeros({0, 3}, DType::F32).view({0, -1}), ShapeError);
  // A transposed tensor can be split along a dim but not flattened.
  Tensor tr = t.transpose(1, 2);  // [2,4,3] strides [12,1,4]
  EXPECT_EQ(tr.view({2, 2, 2, 3}).strides(), (Shape{12, 2, 1, 4}));
  std::string msg = error_of<InvalidArgument>([&] { tr.view({24}); });
  EXPECT_EQ(msg,
            "view: cannot view i64[2,4,3] with strides [12,1,4] as shape [24] without a copy (use "
            "reshape)");
  Tensor r = tr.reshape({24});
  EXPECT_FALSE(r.shares_storage(t));
  EXPECT_EQ(r.to_vector<int>(), tr.to_vector<int>());
  Tensor r2 = t.reshape({4, 6});
  EXPECT_TRUE(r2.shares_storage(t));
  EXPECT_EQ(tr.flatten().to_vector<int>(), tr.to_vector<int>());
  EXPECT_EQ(Tensor::full({}, DType::F32, 2).flatten().sizes(), (Shape{1}));
  EXPECT_EQ(Tensor::full({}, DType::F32, 2).view({1, 1}).sizes(), (Shape{1, 1}));
  EXPECT_EQ(Tensor::full({1}, DType::F32, 2).view({}).dim(), 0);
  // Size-1 dims with odd strides still view.
  Tensor col = iota({4, 3}).narrow(1, 1, 1);  // [4,1] strides [3,1]
  EXPECT_EQ(col.view({2, 2}).to_vector<int>(), (std::vector<int>{1, 4, 7, 10}));
}

TEST(Views, NarrowErrors) {
  Tensor t = iota({6});
  EXPECT_EQ(error_of<ShapeError>([&] { t.narrow(0, 5, 3); }),
            "narrow: start (5) + length (3) exceeds size 6 of dim 0");
  EXPECT_EQ(error_of<ShapeError>([&] { t.narrow(0, 1, -1); }),
            "narrow: length (-1) must be non-negative");
  EXPECT_THROW(t.narrow(1, 0, 1), ShapeError);
  EXPECT_EQ(t.narrow(0, -2, 2).to_vector<int>(), (std::vector<int>{4, 5}));
  EXPECT_EQ(t.narrow(0, 6, 0).numel(), 0);
}

std::vector<Shape> sizes_of(const std::vector<Tensor>& ts) {
  std::vector<Shape> out;
  for (const Tensor& t : ts) out.push_back(t.sizes());
  return out;
}

TEST(Views, SplitAndChunk) {
  Tensor t = iota({6, 2});
  auto s = t.split(4);
  EXPECT_EQ(sizes_of(s), (std::vector<Shape>{{4, 2}, {2, 2}}));
  EXPECT_EQ(s[1].to_vector<int>(), (std::vector<int>{8, 9, 10, 11}));
  EXPECT_EQ(sizes_of(t.split(6)), (std::vector<Shape>{{6, 2}}));
  EXPECT_EQ(sizes_of(t.split(1, 1)), (std::vector<Shape>{{6, 1}, {6, 1}}));
  EXPECT_EQ(sizes_of(Tensor::zeros({0, 2}, DType::F32).split(3)), (std::vector<Shape>{{0, 2}}));
  EXPECT_THROW(t.split(0), InvalidArgument);
  EXPECT_THROW(t.split(-2), InvalidArgument);

  auto w = t.split_with_sizes({1, 0, 5});
  EXPECT_EQ(sizes_of(w), (std::vector<Shape>{{1, 2}, {0, 2}, {5, 2}}));
  EXPECT_EQ(w[2].storage_offset(), 2);
  EXPECT_EQ(error_of<ShapeError>([&] {
              t.split_with_sizes({2, 3});
            }),
            "split_with_sizes: sizes [2,3] sum to 5 but dim 0 has size 6");
  EXPECT_THROW(t.split_with_sizes({7, -1}), ShapeError);

  // torch.chunk: pieces of ceil(size / chunks), fewer pieces when the size runs out.
  EXPECT_EQ(sizes_of(t.chunk(4)), (std::vector<Shape>{{2, 2}, {2, 2}, {2, 2}}));
  EXPECT_EQ(sizes_of(iota({5}).chunk(3)), (std::vector<Shape>{{2}, {2}, {1}}));
  EXPECT_EQ(sizes_of(iota({5}).chunk(5)), (std::vector<Shape>{{1}, {1}, {1}, {1}, {1}}));
  EXPECT_EQ(sizes_of(iota({2}).chunk(5)), (std::vector<Shape>{{1}, {1}}));
  EXPECT_EQ(iota({24}).chunk(std::numeric_limits<int64_t>::max()).size(), 24u);  // no overflow
  EXPECT_EQ(sizes_of(Tensor::zeros({0}, DType::F32).chunk(3)), (std::vector<Shape>{{0}, {0}, {0}}));
  EXPECT_EQ(sizes_of(t.chunk(2, -1)), (std::vector<Shape>{{6, 1}, {6, 1}}));
  EXPECT_EQ(t.chunk(2, 1)[1].to_vector<int>(), (std::vector<int>{1, 3, 5, 7, 9, 11}));
  EXPECT_EQ(error_of<InvalidArgument>([&] { t.chunk(0); }),
            "chunk: chunks must be positive, got 0");
}

TEST(Views, ViewDType) {
  Tensor f = Tensor::from_vector<float>({1.f, -2.f, 0.5f, 4.f}, {2, 2});
  Tensor i = f.view_dtype(DType::I32);
  EXPECT_TRUE(i.shares_storage(f));
  EXPECT_EQ(i.sizes(), (Shape{2, 2}));
  EXPECT_EQ(i.to_vector<int32_t>()[0], 0x3f800000);
  Tensor bytes = f.view_dtype(DType::U8);
  EXPECT_EQ(bytes.sizes(), (Shape{2, 8}));
  EXPECT_EQ(bytes.strides(), (Shape{8, 1}));
  EXPECT_TRUE(bytes.view_dtype(DType::F32).equal(f));
  Tensor wide = bytes.view_dtype(DType::I64);
  EXPECT_EQ(wide.sizes(), (Shape{2, 1}));
  EXPECT_TRUE(wide.view_dtype(DType::F32).equal(f));
  // A narrowed row keeps its offset, scaled.
  Tensor row = bytes.select(0, 1).view_dtype(DType::F32);
  EXPECT_EQ(row.storage_offset(), 2);
  EXPECT_EQ(row.to_vector<float>(), (std::vector<float>{0.5f, 4.f}));
  // Round trips through every dtype of the same byte count.
  for (DType d : kAllDTypes) {
    if (8 % itemsize(d) != 0) continue;
    EXPECT_TRUE(f.view_dtype(d).view_dtype(DType::F32).equal(f)) << dtype_name(d);
  }
  Tensor h = Tensor::from_vector<int16_t>({0x3c00}).view_dtype(DType::F16);
  EXPECT_EQ(h.item<float>(), 1.f);

  EXPECT_EQ(error_of<InvalidArgument>([] {
              Tensor::zeros({2, 3}, DType::U8).view_dtype(DType::I16);
            }),
            "view_dtype: cannot view u8[2,3] as i16: the last dim (3) is not a multiple of 2");
  EXPECT_THROW(Tensor::zeros({}, DType::F32).view_dtype(DType::U8), InvalidArgument);
  EXPECT_THROW(f.transpose(0, 1).view_dtype(DType::U8), InvalidArgument);
  EXPECT_THROW(Tensor::zeros({8}, DType::U8).narrow(0, 1, 4).view_dtype(DType::I32),
               InvalidArgument);
  EXPECT_EQ(Tensor::zeros({}, DType::F32).view_dtype(DType::I32).dtype(), DType::I32);
  // An empty tensor widens whatever the strides of its other dims, as the IR's types say.
  for (const Shape& shape : {Shape{3, 0}, Shape{0, 8}, Shape{2, 0, 0}}) {
    const Tensor e = Tensor::zeros(shape, DType::I8).view_dtype(DType::F64);
    Shape wide = shape;
    wide.back() /= 8;
    EXPECT_EQ(e.sizes(), wide);
    EXPECT_EQ(e.dtype(), DType::F64);
    EXPECT_EQ(e.numel(), 0);
  }
  EXPECT_THROW(Tensor::zeros({0, 3}, DType::U8).view_dtype(DType::I16), InvalidArgument);
  // An empty narrow keeps its place, rescaled, and an offset in no whole new element is refused
  // (as PyTorch's view(dtype)).
  EXPECT_EQ(Tensor::zeros({4, 2}, DType::F32).narrow(0, 4, 0).view_dtype(DType::F64)
                .storage_offset(),
            4);
  EXPECT_EQ(error_of<InvalidArgument>([] {
              Tensor::zeros({3}, DType::F32).narrow(0, 1, 0).view_dtype(DType::F64);
            }),
            "view_dtype: cannot view f32[0] as f64: the storage offset (1) is not a multiple of 2");
}

TEST(Views, Expand) {
  Tensor t = Tensor::from_vector<int>({1, 2, 3}, {3});
  Tensor e = t.expand({2, 3});
  EXPECT_EQ(e.strides(), (Shape{0, 1}));
  EXPECT_EQ(e.to_vector<int>(), (std::vector<int>{1, 2, 3, 1, 2, 3}));
  Tensor c = Tensor::from_vector<int>({1, 2}, {2, 1}).expand({-1, 3});
  EXPECT_EQ(c.to_vector<int>(), (std::vector<int>{1, 1, 1, 2, 2, 2}));
  EXPECT_THROW(t.expand({2, 4}), ShapeError);
  EXPECT_THROW(t.expand({}), ShapeError);
  // Writing through aliased elements is refused (as PyTorch does); reading is fine.
  EXPECT_EQ(error_of<InvalidArgument>([&] { e.copy_(Tensor::zeros({2, 3}, DType::I32)); }),
            "copy_: more than one element of the written-to tensor (i32[2,3], strides [0,1]) "
            "refers to a single memory location (dim 0 has stride 0); clone() it first");
  EXPECT_THROW(e.fill_(0), InvalidArgument);
  EXPECT_EQ(t.to_vector<int>(), (std::vector<int>{1, 2, 3}));
  t.expand({1, 3}).fill_(7);  // a stride-0 dim of size 1 aliases nothing
  EXPECT_EQ(t.to_vector<int>(), (std::vector<int>{7, 7, 7}));
  // Nor does any dim of an empty tensor (PyTorch's: an empty tensor is dense).
  Tensor empty = Tensor::zeros({0, 1}, DType::I32).expand({0, 3});
  empty.fill_(1);
  empty.copy_(Tensor::zeros({0, 3}, DType::I32));
  EXPECT_EQ(empty.numel(), 0);
}

// Sizes whose sums or products leave int64 are refused, not wrapped into a view that reaches
// past its storage (PyTorch checks these products too).
TEST(Views, HugeSizesAreRefusedNotWrapped) {
  constexpr int64_t kBig = int64_t{1} << 62;
  Tensor t = iota({6});
  EXPECT_EQ(error_of<ShapeError>([&] { t.narrow(0, 1, INT64_MAX); }),
            "narrow: start (1) + length (9223372036854775807) exceeds size 6 of dim 0");
  EXPECT_EQ(error_of<ShapeError>([&] { t.split_with_sizes({INT64_MAX, INT64_MAX, 8}); }),
            "split_with_sizes: sizes [9223372036854775807,9223372036854775807,8] sum to more "
            "than int64 holds but dim 0 has size 6");
  Tensor empty = Tensor::zeros({0}, DType::F32);
  EXPECT_EQ(error_of<ShapeError>([&] { empty.view({kBig, 4}); }),
            "view: shape [4611686018427387904,4] is invalid for a tensor of 0 elements");
  EXPECT_THROW(empty.reshape({kBig, 8, 0}), ShapeError);
  EXPECT_THROW(t.view({kBig, 4, -1}), ShapeError);
  EXPECT_EQ(error_of<InvalidArgument>([&] { t.narrow(0, 0, 1).expand({kBig, 4}); }),
            "expand: shape [4611686018427387904,4] is too large");
  auto storage = std::make_shared<Storage>(64);
  EXPECT_THROW(Tensor::from_storage(storage, {4}, DType::F32, INT64_MAX - 1), ShapeError);
}

// A zero dim empties a tensor, but its other dims must still multiply to an int64 byte count:
// its strides and the counts of reductions over some of its dims are such products (the IR's
// types follow the same rule, found by fuzzing: a view's type took the product of
// [..., 8777777773777777777, ..., 0] dim by dim and overflowed).
TEST(Views, EmptyTensorsWithHugeDims) {
  constexpr int64_t kHuge = int64_t{1} << 40;
  EXPECT_EQ(shape_numel({kHuge, kHuge, 0}), 0);
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(error_of<ShapeError>([&] { shape_numel({kHuge, kHuge}); }),
            "shape [1099511627776,1099511627776] has more elements than an int64 holds");
  EXPECT_EQ(error_of<InvalidArgument>([&] { Tensor::empty({0, kHuge, kHuge}, DType::F32); }),
            "empty: shape [0,1099511627776,1099511627776] is too large");
  EXPECT_THROW(Tensor::zeros({kHuge, kHuge, 0}, DType::F32), InvalidArgument);
  EXPECT_EQ(error_of<ShapeError>([&] {
              Tensor::zeros({0}, DType::F32).view({0, int64_t{1} << 62, 4});
            }),
            "view: shape [0,4611686018427387904,4] is invalid for a tensor of 0 elements");
  // Large dims whose product fits are fine, and so are reductions over them.
  const Tensor e = Tensor::zeros({0, 1 << 20, 1 << 20}, DType::F32);
  EXPECT_EQ(e.strides(), (Shape{int64_t{1} << 40, 1 << 20, 1}));
  EXPECT_EQ(sum(e, {1, 2}, false).sizes(), (Shape{0}));
  EXPECT_EQ(sum(e, {0, 2}, true).sizes(), (Shape{1, 1 << 20, 1}));
  // Empty tensors concatenated past int64 along a dim.
  const Tensor wide = Tensor::zeros({0, int64_t{1} << 60}, DType::F32);
  const std::vector<Tensor> eight(8, wide);
  EXPECT_EQ(error_of<ShapeError>([&] { Tensor::cat(eight, 1); }),
            "cat: the tensors' sizes at dim 1 sum to more than int64 holds");
  EXPECT_THROW(Tensor::cat({wide, wide}, 1), InvalidArgument);  // fits in int64, not in bytes
  // A meta tensor's strides may be so large that the strides a view would need leave int64
  // (UBSan: signed overflow): no view then.
  const Tensor big = Tensor::meta({3, kHuge, 1}, DType::F64).unsqueeze(0).transpose(1, 3);
  EXPECT_EQ(error_of<Error>([&] { big.view({1, -1}); }),
            "view: cannot view f64[1,1,1099511627776,3] with strides "
            "[3298534883328,1,1,1099511627776] as shape [1,-1] without a copy (use reshape)");
  // Lists too long to allocate fail with funcol::Error, as storage does.
  EXPECT_EQ(error_of<Error>([] {
              Tensor::zeros({1}, DType::F32).expand({int64_t{1} << 60}).to_vector<float>();
            }),
            "out of memory: cannot allocate 1152921504606846976 elements of 4 bytes");
  EXPECT_EQ(error_of<Error>([] { Tensor::zeros({0}, DType::F32).chunk(int64_t{1} << 62); }),
            "out of memory: cannot allocate 4611686018427387904 elements of 8 bytes");
  // A piece per element of a dim of 2^50 (an expanded one): a list of views that cannot fit.
  const std::string pieces = error_of<Error>(
      [] { Tensor::zeros({1}, DType::Bool).expand({int64_t{1} << 50}).split(1); });
  EXPECT_EQ(pieces.rfind("out of memory: cannot allocate 1125899906842624 elements of ", 0), 0u)
      << pieces;
  // A storage size that rounding up to whole pages would wrap to a tiny block.
  EXPECT_EQ(error_of<Error>([] { Storage s(SIZE_MAX - 100); }),
            "out of memory: cannot allocate " + std::to_string(SIZE_MAX - 100) + " bytes");
}

// from_vector, data, to_vector and item take the element types of the ten dtypes (and long
// long) only: another type is a compile error, not a link error.
template <typename T>
concept Readable = requires(const Tensor& t) {
  t.template item<T>();
  t.template to_vector<T>();
  t.template data<T>();
  Tensor::from_vector<T>({});
};
static_assert(Readable<float> && Readable<long long> && Readable<Eigen::bfloat16>);
static_assert(!Readable<unsigned> && !Readable<size_t> && !Readable<char>);

// Bool, u8 and i8 dims may come near INT64_MAX: splitting one steps the start by the split
// size, which must not step past int64 after the last piece (UBSan: signed overflow).
TEST(Views, SplitOfADimNearInt64Max) {
  constexpr int64_t kBig = int64_t{1} << 62;
  const Tensor t = Tensor::meta({INT64_MAX}, DType::Bool);
  EXPECT_EQ(sizes_of(t.chunk(2)), (std::vector<Shape>{{kBig}, {kBig - 1}}));
  EXPECT_EQ(sizes_of(t.split(kBig)), (std::vector<Shape>{{kBig}, {kBig - 1}}));
  EXPECT_EQ(sizes_of(t.split(INT64_MAX - 1)), (std::vector<Shape>{{INT64_MAX - 1}, {1}}));
  EXPECT_EQ(t.chunk(2)[1].storage_offset(), kBig);
}

// The storage offset of a view of an empty tensor is not bounded by its storage: narrowing to
// the end of one dim and then of another adds products of sizes and strides whose sum leaves
// int64 (and first_element() scales it by the itemsize). Refused, as from_storage and placed
// refuse an offset whose bytes leave int64.
TEST(Views, StorageOffsetsThatLeaveInt64AreRefused) {
  // Nonzero dims that multiply to 2^63 - 2, the most that fits.
  const int64_t half = INT64_MAX / 2;  // 2^62 - 1
  const Tensor e = Tensor::zeros({half, 2, 0}, DType::Bool);
  const Tensor end0 = e.narrow(0, half, 0);
  EXPECT_EQ(end0.storage_offset(), INT64_MAX - 1);
  EXPECT_EQ(error_of<ShapeError>([&] { end0.narrow(1, 2, 0); }),
            "narrow: storage offset 9223372036854775806 + 2 * stride 1 does not fit in int64 "
            "(as bytes of bool)");
  EXPECT_EQ(end0.narrow(1, 1, 0).storage_offset(), INT64_MAX);  // fits: kept
  const int64_t third = INT64_MAX / 3;  // 3 * third = 2^63 - 2
  const Tensor t = Tensor::zeros({third, 3, 0}, DType::U8).narrow(0, third, 0);
  EXPECT_EQ(error_of<ShapeError>([&] { t.select(1, 2); }),
            "select: storage offset 9223372036854775806 + 2 * stride 1 does not fit in int64 "
            "(as bytes of u8)");
  // In bytes: an f64 element offset of 2^60 is 2^63 bytes.
  const int64_t f64_max = (int64_t{1} << 59) - 1;
  const Tensor f = Tensor::zeros({f64_max, 2, 0}, DType::F64).narrow(0, f64_max, 0);
  EXPECT_EQ(f.storage_offset(), (int64_t{1} << 60) - 2);
  EXPECT_EQ(error_of<ShapeError>([&] { f.narrow(1, 2, 0); }),
            "narrow: storage offset 1152921504606846974 + 2 * stride 1 does not fit in int64 "
            "(as bytes of f64)");

  auto storage = std::make_shared<Storage>(64);
  EXPECT_EQ(error_of<ShapeError>([&] {
              Tensor::from_storage(storage, {0}, DType::F64, INT64_MAX / 4);
            }),
            "from_storage: f64[0] at offset 2305843009213693951 lies past the end of the storage "
            "(64 bytes)");
  EXPECT_EQ(error_of<ShapeError>([&] {
              Tensor::placed(Tensor::meta({0}, DType::F32), storage, INT64_MAX);
            }),
            "placed: f32[0] at offset 9223372036854775807 lies past the end of the storage "
            "(64 bytes)");
  // Offsets whose bytes fit stay accepted for empty tensors, past the end of the storage too;
  // their data pointer is the storage's first byte, not one outside it (UBSan checks pointer
  // arithmetic), and copying them copies nothing.
  const Tensor past = Tensor::from_storage(storage, {0}, DType::F64, INT64_MAX / 8);
  EXPECT_EQ(past.numel(), 0);
  EXPECT_EQ(past.data_ptr(), storage->raw());
  EXPECT_EQ(past.clone().numel(), 0);
  EXPECT_EQ(Tensor::placed(Tensor::meta({0}, DType::F32), storage, INT64_MAX / 4).numel(), 0);
  const Tensor four = Tensor::zeros({4}, DType::F32);
  EXPECT_EQ(four.narrow(0, 4, 0).const_data_ptr(), four.storage()->raw());
  EXPECT_EQ(four.narrow(0, 3, 1).const_data_ptr(), four.data<float>() + 3);
}

// view and reshape of an empty tensor may name nonzero dims that multiply within int64 but not
// within int64 bytes: the factories refuse such a shape (check_shape), and view_dtype to a
// smaller itemsize would scale its last dim and strides past int64.
TEST(Views, ViewsOfEmptyTensorsMustFitInBytes) {
  constexpr int64_t kBig = int64_t{1} << 62;
  const Tensor e = Tensor::zeros({0}, DType::F32);
  EXPECT_EQ(error_of<InvalidArgument>([&] { e.view({0, kBig}); }),
            "view: shape [0,4611686018427387904] is too large");
  EXPECT_EQ(error_of<InvalidArgument>([&] { e.reshape({kBig, 0}); }),
            "reshape: shape [4611686018427387904,0] is too large");
  EXPECT_EQ(e.view({0, kBig / 4}).view_dtype(DType::U8).sizes(), (Shape{0, kBig}));
  EXPECT_EQ(Tensor::zeros({0}, DType::U8).view({0, kBig}).sizes(), (Shape{0, kBig}));
}

// ---- copies ---------------------------------------------------------------------------------

TEST(Copies, ContiguousCloneTo) {
  Tensor t = iota({3, 4}, DType::F32);
  EXPECT_TRUE(t.contiguous().shares_storage(t));
  Tensor tr = t.transpose(0, 1);
  Tensor c = tr.contiguous();
  EXPECT_FALSE(c.shares_storage(t));
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_TRUE(c.equal(tr));
  Tensor k = t.clone();
  k.fill_(5);
  EXPECT_EQ(t.to_vector<int>()[0], 0);
  for (DType d : kAllDTypes) {
    Tensor conv = tr.to(d);
    EXPECT_EQ(conv.dtype(), d);
    EXPECT_TRUE(conv.is_contiguous());
    std::vector<double> want = tr.to_vector<double>();
    if (d == DType::Bool) {
      for (double& x : want) x = x != 0;
    }
    EXPECT_EQ(conv.to_vector<double>(), want) << dtype_name(d);
  }
}

// Floating to integer: truncation toward zero; i32 and i64 saturate, u8/i8/i16 wrap modulo
// 2^bits as PyTorch's CPU conversions do (through int64); infinities and magnitudes past int64
// saturate everywhere; NaN gives 0. (+inf used to give -1 in i32.)
TEST(Copies, FloatToIntegerConversions) {
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor x = Tensor::from_vector<double>({std::nan(""), inf, -inf, 3e9, -3e9, 1e20, 300.7,
                                                -1.9, 2.5});
  EXPECT_EQ(x.to(DType::I32).to_vector<int32_t>(),
            (std::vector<int32_t>{0, INT32_MAX, INT32_MIN, INT32_MAX, INT32_MIN, INT32_MAX, 300,
                                  -1, 2}));
  EXPECT_EQ(x.to(DType::I64).to_vector<int64_t>(),
            (std::vector<int64_t>{0, INT64_MAX, INT64_MIN, 3000000000, -3000000000, INT64_MAX,
                                  300, -1, 2}));
  // 3e9 = 0xb2d05e00: its low byte 0 and low 16 bits 0x5e00; 300 = 0x12c.
  EXPECT_EQ(x.to(DType::I8).to_vector<int>(),
            (std::vector<int>{0, 127, -128, 0, 0, 127, 44, -1, 2}));
  EXPECT_EQ(x.to(DType::U8).to_vector<int>(),
            (std::vector<int>{0, 255, 0, 0, 0, 255, 44, 255, 2}));
  EXPECT_EQ(x.to(DType::I16).to_vector<int>(),
            (std::vector<int>{0, 32767, -32768, 0x5e00, -0x5e00, 32767, 300, -1, 2}));
  // A value past the type's range is refused by the factories, as PyTorch's overflow check
  // does, though it would truncate into range.
  EXPECT_EQ(error_of<InvalidArgument>([] { Tensor::full({1}, DType::U8, 255.5); }),
            "full: value 255.5 cannot be converted to u8 without overflow");
  EXPECT_THROW(Tensor::full({1}, DType::I8, -128.5), InvalidArgument);
  EXPECT_EQ(Tensor::full({1}, DType::U8, 255.0).item<int>(), 255);
  EXPECT_EQ(Tensor::full({1}, DType::I8, -128.0).item<int>(), -128);
  EXPECT_EQ(Tensor::full({1}, DType::I8, 127.9 - 0.9).item<int>(), 127);
}

// item<T>() refuses a value T cannot hold, as PyTorch's (Scalar::to's checked_convert), where
// element conversions wrap or saturate: it used to give -1294967296, 44, inf and INT32_MAX here.
TEST(Copies, ItemRefusesAValueItsTypeCannotHold) {
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(error_of<InvalidArgument>(
                [] { (void)Tensor::full({}, DType::I64, int64_t{3000000000}).item<int32_t>(); }),
            "item: value 3000000000 cannot be converted to i32 without overflow");
  EXPECT_THROW((void)Tensor::full({}, DType::I32, 300).item<uint8_t>(), InvalidArgument);
  // A negative integer wraps into an unsigned T down to minus its largest value, as there (c10's
  // overflows lets -1 through as 255), not a negative float.
  EXPECT_EQ(Tensor::full({}, DType::I32, -1).item<uint8_t>(), 255);
  EXPECT_EQ(Tensor::full({}, DType::I64, -255).item<uint8_t>(), 1);
  EXPECT_EQ(error_of<InvalidArgument>(
                [] { (void)Tensor::full({}, DType::I16, -256).item<uint8_t>(); }),
            "item: value -256 cannot be converted to u8 without overflow");
  EXPECT_THROW((void)Tensor::full({}, DType::F32, -1).item<uint8_t>(), InvalidArgument);
  EXPECT_THROW((void)Tensor::full({}, DType::F64, 1e300).item<float>(), InvalidArgument);
  EXPECT_THROW((void)Tensor::full({}, DType::F64, 1e10).item<int32_t>(), InvalidArgument);
  EXPECT_THROW((void)Tensor::full({}, DType::F32, inf).item<int>(), InvalidArgument);
  EXPECT_THROW((void)Tensor::full({}, DType::F32, std::nan("")).item<int64_t>(), InvalidArgument);
  EXPECT_THROW((void)Tensor::full({}, DType::F32, 70000.0).item<Eigen::half>(), InvalidArgument);
  // What fits converts as before: truncation toward zero, bool from anything, infinities and
  // NaN between floating types, the largest values exactly.
  EXPECT_EQ(Tensor::full({}, DType::F64, -2.9).item<int8_t>(), -2);
  EXPECT_EQ(Tensor::full({}, DType::I32, 7).item<bool>(), true);
  EXPECT_EQ(Tensor::full({}, DType::F64, inf).item<float>(),
            std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Tensor::full({}, DType::F64, std::nan("")).item<float>()));
  EXPECT_EQ(Tensor::full({}, DType::I64, int64_t{INT32_MAX}).item<int32_t>(), INT32_MAX);
  EXPECT_EQ(Tensor::full({}, DType::U8, 255).item<uint8_t>(), 255);
  EXPECT_EQ(Tensor::full({}, DType::I64, INT64_MIN).item<int64_t>(), INT64_MIN);
}

TEST(Copies, CopyConvertsAndChecksShape) {
  Tensor dst = Tensor::zeros({2, 3}, DType::I32);
  dst.copy_(Tensor::from_vector<double>({1.9, -1.9, 2, 3, 4, 5}, {2, 3}));
  EXPECT_EQ(dst.to_vector<int>(), (std::vector<int>{1, -1, 2, 3, 4, 5}));
  dst.narrow(1, 0, 1).copy_(Tensor::from_vector<int>({7, 8}, {2, 1}));
  EXPECT_EQ(dst.to_vector<int>(), (std::vector<int>{7, -1, 2, 8, 4, 5}));
  EXPECT_EQ(error_of<ShapeError>([&] {
              dst.copy_(Tensor::zeros({3, 2}, DType::I32));
            }),
            "copy_: source shape [3,2] does not match destination shape [2,3]");
  // Overlapping source and destination behave as if the source were copied first.
  Tensor sq = iota({3, 3});
  sq.copy_(sq.transpose(0, 1));
  EXPECT_EQ(sq.to_vector<int>(), (std::vector<int>{0, 3, 6, 1, 4, 7, 2, 5, 8}));
}

TEST(Copies, CatEdgeCases) {
  Tensor a = iota({2, 2});
  Tensor b = Tensor::full({1, 2}, DType::I64, 9);
  EXPECT_EQ(Tensor::cat({a, b}).to_vector<int>(), (std::vector<int>{0, 1, 2, 3, 9, 9}));
  EXPECT_EQ(Tensor::cat({a, a.transpose(0, 1)}, 1).to_vector<int>(),
            (std::vector<int>{0, 1, 0, 2, 2, 3, 1, 3}));
  Tensor empty = Tensor::zeros({0, 2}, DType::I64);
  EXPECT_EQ(Tensor::cat({empty, a, empty}).to_vector<int>(), a.to_vector<int>());
  EXPECT_EQ(Tensor::cat({empty}).sizes(), (Shape{0, 2}));
  Tensor c = Tensor::cat({a});
  EXPECT_FALSE(c.shares_storage(a));
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              Tensor::cat({a, a.to(DType::F32)});
            }),
            "cat: tensor 1 has dtype f32 but tensor 0 has i64");
  EXPECT_EQ(error_of<ShapeError>([&] {
              Tensor::cat({a, iota({2, 3})});
            }),
            "cat: tensor 1 has shape [2,3] but tensor 0 has [2,2] (all dims but 0 must match)");
  EXPECT_THROW(Tensor::cat({}), InvalidArgument);
  EXPECT_THROW(Tensor::cat({a, iota({4})}), ShapeError);
  EXPECT_THROW(Tensor::cat({a}, 2), ShapeError);
}

// As PyTorch: a 1-D tensor of no elements joins any concatenation, whatever the others' rank
// and the dim, and takes no part in the shape checks (a list built up from an empty start).
TEST(Copies, CatSkipsLegacyEmptyTensors) {
  Tensor a = iota({2, 2});
  Tensor none = Tensor::empty({0}, DType::I64);
  EXPECT_EQ(Tensor::cat({none, a}, 1).sizes(), (Shape{2, 2}));
  EXPECT_EQ(Tensor::cat({none, a}, 1).to_vector<int>(), a.to_vector<int>());
  Tensor ab = Tensor::cat({a, none, a, none}, -1);
  EXPECT_EQ(ab.sizes(), (Shape{2, 4}));
  EXPECT_EQ(ab.to_vector<int>(), (std::vector<int>{0, 1, 0, 1, 2, 3, 2, 3}));
  EXPECT_EQ(Tensor::cat({none, none}).sizes(), (Shape{0}));
  // All skipped: empty, whatever the dim (PyTorch checks none then).
  EXPECT_EQ(Tensor::cat({none, none}, 1).sizes(), (Shape{0}));
  EXPECT_EQ(Tensor::cat({none}, -3).sizes(), (Shape{0}));
  // A 1-D concatenation is the ordinary one; [0, 2] is not skipped.
  EXPECT_EQ(Tensor::cat({none, iota({3})}).to_vector<int>(), (std::vector<int>{0, 1, 2}));
  EXPECT_THROW(Tensor::cat({Tensor::zeros({0, 2}, DType::I64), iota({3})}), ShapeError);
  // The dim is that of the first tensor not skipped; dtypes must still agree, and the message
  // names that tensor.
  EXPECT_THROW(Tensor::cat({none, a}, 2), ShapeError);
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              Tensor::cat({none.to(DType::F32), a});
            }),
            "cat: tensor 0 has dtype f32 but tensor 1 has i64");
  EXPECT_EQ(error_of<ShapeError>([&] {
              Tensor::cat({none, a, iota({2, 3})});
            }),
            "cat: tensor 2 has shape [2,3] but tensor 1 has [2,2] (all dims but 0 must match)");
  EXPECT_EQ(error_of<ShapeError>([&] {
              Tensor::cat({none, Tensor::full({}, DType::I64, 1.0)});
            }),
            "cat: zero-dimensional tensor 1 cannot be concatenated");
}

TEST(Copies, EqualAndFill) {
  Tensor a = iota({2, 3}, DType::F32);
  EXPECT_TRUE(a.equal(a.clone()));
  EXPECT_TRUE(a.transpose(0, 1).equal(a.transpose(0, 1).contiguous()));
  EXPECT_FALSE(a.equal(a.view({3, 2})));
  EXPECT_FALSE(a.equal(a.to(DType::F64)));
  Tensor b = a.clone();
  b.select(1, 2).fill_(-1);
  EXPECT_FALSE(a.equal(b));
  EXPECT_EQ(b.to_vector<int>(), (std::vector<int>{0, 1, -1, 3, 4, -1}));
  Tensor n1 = Tensor::full({2}, DType::F32, std::nan(""));
  EXPECT_TRUE(n1.equal(n1.clone()));  // bitwise
  EXPECT_TRUE(Tensor().equal(Tensor()));
  EXPECT_FALSE(a.equal(Tensor()));
  Tensor bools = Tensor::zeros({3}, DType::Bool);
  bools.fill_(0.25);
  EXPECT_EQ(bools.to_vector<uint8_t>(), (std::vector<uint8_t>{1, 1, 1}));
}

TEST(Print, ToString) {
  EXPECT_EQ(iota({2, 2}, DType::F32).to_string(), "tensor(f32[2,2], [[0, 1], [2, 3]])");
  EXPECT_EQ(Tensor::full({}, DType::F64, 0.5).to_string(), "tensor(f64[], 0.5)");
  EXPECT_EQ(Tensor::zeros({0}, DType::I8).to_string(), "tensor(i8[0], [])");
  EXPECT_EQ(Tensor::from_vector<bool>({true, false}).to_string(), "tensor(bool[2], [true, false])");
  EXPECT_EQ(Tensor::from_vector<uint8_t>({200}).to_string(), "tensor(u8[1], [200])");
  EXPECT_EQ(Tensor::full({1}, DType::BF16, -1.5).to_string(), "tensor(bf16[1], [-1.5])");
  EXPECT_EQ(iota({2, 3}).transpose(0, 1).to_string(), "tensor(i64[3,2], [[0, 3], [1, 4], [2, 5]])");
  EXPECT_EQ(Tensor::arange(2000, DType::I32).to_string(),
            "tensor(i32[2000], [0, 1, 2, ..., 1997, 1998, 1999])");
  EXPECT_EQ(Tensor().to_string(), "tensor(undefined)");
  // No elements: one "[]" whatever the shape, at once (it printed one per row).
  EXPECT_EQ(Tensor::zeros({2, 0}, DType::F32).to_string(), "tensor(f32[2,0], [])");
  EXPECT_EQ(Tensor::zeros({int64_t{1} << 40, 0}, DType::F32).to_string(),
            "tensor(f32[1099511627776,0], [])");
  // A NaN prints as nan whatever its sign bit (0/0 gives a negative one on x86), as PyTorch.
  for (DType d : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
    const Tensor nans = Tensor::from_vector<double>({-std::nan(""), std::nan(""), -0.0}).to(d);
    EXPECT_EQ(nans.to_string(), "tensor(" + std::string(dtype_name(d)) + "[3], [nan, nan, -0])");
  }
}

// ---- pending storage ------------------------------------------------------------------------

struct Pending {
  Tensor t;
  std::shared_ptr<ManualWork> work = std::make_shared<ManualWork>();
  explicit Pending(Tensor tensor) : t(std::move(tensor)) { t.storage()->add_pending(work); }
};

TEST(Pending, ViewsNeverWait) {
  Pending p(iota({4, 6}, DType::F32));
  const Tensor& t = p.t;
  EXPECT_FALSE(t.is_ready());
  std::vector<Tensor> views = {t.view({24}),
                               t.reshape({6, 4}),
                               t.flatten(),
                               t.narrow(1, 1, 2),
                               t.transpose(0, 1),
                               t.permute({1, 0}),
                               t.view_dtype(DType::U8),
                               t.unsqueeze(0),
                               t.unsqueeze(0).squeeze(0),
                               t.select(0, 2),
                               t.expand({2, 4, 6}),
                               t.contiguous(),
                               t.split(2)[1],
                               t.chunk(3, 1)[2],
                               t.split_with_sizes({1, 3})[1],
                               Tensor::from_storage(t.storage(), {3}, DType::F32)};
  EXPECT_EQ(p.work->wait_calls(), 0);
  EXPECT_EQ(t.storage()->pending_count(), 1u);
  EXPECT_NE(t.raw_data_ptr(), nullptr);  // raw access never waits
  for (const Tensor& v : views) {
    EXPECT_TRUE(v.shares_storage(t));
    EXPECT_FALSE(v.is_ready());
  }
  p.work->release();
  EXPECT_TRUE(t.is_ready());
  EXPECT_EQ(p.work->wait_calls(), 0);
  // A view of the result finds the work: reading it waits (and detaches for everyone).
  EXPECT_EQ(views[6].to_vector<uint8_t>().size(), 96u);
  EXPECT_EQ(p.work->wait_calls(), 1);
  EXPECT_EQ(t.storage()->pending_count(), 0u);
}

TEST(Pending, EveryDataAccessWaits) {
  using Access = std::function<void(const Tensor&)>;
  const Tensor other = iota({2, 3}, DType::F32);
  std::vector<std::pair<const char*, Access>> accesses = {
      {"data_ptr", [](const Tensor& t) { t.data_ptr(); }},
      {"data", [](const Tensor& t) { t.data<float>(); }},
      {"wait", [](const Tensor& t) { t.wait(); }},
      {"to_vector", [](const Tensor& t) { t.to_vector<float>(); }},
      {"item", [](const Tensor& t) { t.select(0, 0).select(0, 0).item<float>(); }},
      {"to_string", [](const Tensor& t) { t.to_string(); }},
      {"clone", [](const Tensor& t) { t.clone(); }},
      {"to", [](const Tensor& t) { t.to(DType::F64); }},
      {"contiguous copy", [](const Tensor& t) { t.transpose(0, 1).contiguous(); }},
      {"reshape copy", [](const Tensor& t) { t.transpose(0, 1).reshape({6}); }},
      {"copy_ src",
       [&](const Tensor& t) {
         Tensor::zeros({2, 3}, DType::F32).copy_(t);
       }},
      {"copy_ dst", [&](const Tensor& t) { t.copy_(other); }},
      {"fill_", [](const Tensor& t) { t.fill_(1); }},
      {"cat",
       [&](const Tensor& t) {
         Tensor::cat({other, t});
       }},
      {"equal", [&](const Tensor& t) { other.equal(t); }},
      {"add", [&](const Tensor& t) { add(other, t); }},
      {"matmul", [&](const Tensor& t) { matmul(t, other.transpose(0, 1)); }},
      {"sum", [](const Tensor& t) { sum(t, {}, false); }},
  };
  for (const auto& [name, access] : accesses) {
    SCOPED_TRACE(name);
    Pending p(iota({2, 3}, DType::F32));
    p.work->release();
    access(p.t);
    EXPECT_EQ(p.work->wait_calls(), 1);
    EXPECT_EQ(p.t.storage()->pending_count(), 0u);
    EXPECT_TRUE(p.t.is_ready());
  }
}

// Bytes written by many in-place collectives and never read in between: the completed ones
// are detached as more come (the list stayed whole, and each attach scanned it: 50,000 took
// 0.38 s), while a failed one and an unfinished one stay attached.
TEST(Pending, ManyCompletedWritersDoNotAccumulate) {
  Tensor t = Tensor::zeros({4}, DType::F32);
  auto failed = std::make_shared<ManualWork>();
  failed->fail(std::make_exception_ptr(std::runtime_error("writer failed")));
  auto running = std::make_shared<ManualWork>();
  t.storage()->add_pending(failed);
  t.storage()->add_pending(running);
  for (int i = 0; i < 1000; ++i) {
    auto done = std::make_shared<ManualWork>();
    done->release();
    t.storage()->add_pending(done);
    EXPECT_LE(t.storage()->pending_count(), 34u) << i;
  }
  EXPECT_FALSE(t.is_ready());
  running->release();
  EXPECT_THROW(t.wait(), std::runtime_error);
  EXPECT_EQ(t.storage()->pending_count(), 1u);  // the failure stays: the bytes are undefined
  EXPECT_THROW(t.to_vector<float>(), std::runtime_error);
}

TEST(Pending, WaitTwiceIsFreeAndDuplicatesAttachOnce) {
  Pending p(Tensor::zeros({4}, DType::I32));
  p.t.storage()->add_pending(p.work);
  EXPECT_EQ(p.t.storage()->pending_count(), 1u);
  auto second = std::make_shared<ManualWork>();
  p.t.storage()->add_pending(second);
  EXPECT_EQ(p.t.storage()->pending_count(), 2u);
  p.work->release();
  EXPECT_FALSE(p.t.is_ready());
  second->release();
  EXPECT_TRUE(p.t.is_ready());
  p.t.wait();
  p.t.wait();
  p.t.to_vector<int>();
  EXPECT_EQ(p.work->wait_calls(), 1);
  EXPECT_EQ(second->wait_calls(), 1);
  EXPECT_EQ(p.t.storage()->pending_count(), 0u);
}

TEST(Pending, FailureIsRethrownFromDataAccess) {
  Pending p(Tensor::zeros({4}, DType::I32));
  auto ok = std::make_shared<ManualWork>();
  p.t.storage()->add_pending(ok);
  p.work->fail(std::make_exception_ptr(CommError("all_reduce: peer 1 timed out")));
  ok->release();
  EXPECT_EQ(error_of<CommError>([&] {
              p.t.view({2, 2}).to_vector<int>();
            }),
            "all_reduce: peer 1 timed out");
  // Every attached work was waited; the succeeded one is detached, the failed one stays: the
  // bytes were never produced, so a second access (or a write) throws again.
  EXPECT_EQ(ok->wait_calls(), 1);
  EXPECT_EQ(p.t.storage()->pending_count(), 1u);
  EXPECT_TRUE(p.t.is_ready());
  EXPECT_EQ(error_of<CommError>([&] { p.t.narrow(0, 1, 1).item<int>(); }),
            "all_reduce: peer 1 timed out");
  EXPECT_EQ(error_of<CommError>([&] { p.t.fill_(1); }), "all_reduce: peer 1 timed out");
  EXPECT_EQ(ok->wait_calls(), 1);
}

TEST(Pending, FailureAloneStaysAttached) {
  // The one-work fast path too.
  Pending p(Tensor::zeros({4}, DType::F32));
  p.work->fail(std::make_exception_ptr(CommError("all_gather: rank 2 departed")));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(error_of<CommError>([&] { p.t.to_vector<float>(); }), "all_gather: rank 2 departed");
    EXPECT_EQ(p.t.storage()->pending_count(), 1u);
  }
}

// A work that completed with a failure and whose first wait() stalls until the test says so:
// a second reader arriving while the first is inside wait() must get the failure too, not the
// bytes the operation never produced.
class StallingFailedWork : public Waitable {
 public:
  void wait() override {
    if (calls_.fetch_add(1) == 0) {
      entered_.store(true);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!go_on_.load() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
    }
    throw CommError("all_reduce: rank 1 timed out");
  }
  bool is_completed() const override { return true; }
  std::atomic<bool> entered_{false};
  std::atomic<bool> go_on_{false};
  std::atomic<int> calls_{0};
};

TEST(Pending, FailureSeenByEveryConcurrentReader) {
  Tensor t = Tensor::zeros({4}, DType::F32);
  auto work = std::make_shared<StallingFailedWork>();
  t.storage()->add_pending(work);
  std::string first_error;
  std::thread first([&] {
    first_error = error_of<CommError>([&] { t.to_vector<float>(); });
  });
  while (!work->entered_.load()) std::this_thread::yield();
  // The first reader is inside the failed work's wait(); this one must not slip past it.
  const std::string second_error = error_of<CommError>([&] { t.to_vector<float>(); });
  work->go_on_.store(true);
  first.join();
  EXPECT_EQ(first_error, "all_reduce: rank 1 timed out");
  EXPECT_EQ(second_error, "all_reduce: rank 1 timed out");
  EXPECT_EQ(t.storage()->pending_count(), 1u);
}

TEST(Pending, ReadFromAnotherThreadBlocksUntilReleased) {
  Pending p(Tensor::zeros({3}, DType::I64));
  std::atomic<bool> done{false};
  std::vector<int64_t> seen;
  std::thread reader([&] {
    seen = p.t.to_vector<int64_t>();
    done.store(true);
  });
  while (p.work->wait_calls() == 0) std::this_thread::yield();
  EXPECT_FALSE(done.load());  // blocked in wait(): the work is not released yet
  // The producer writes the result through the raw pointer, then completes.
  auto* raw = static_cast<int64_t*>(p.t.raw_data_ptr());
  raw[0] = 10;
  raw[1] = 20;
  raw[2] = 30;
  p.work->release();
  reader.join();
  EXPECT_TRUE(done.load());
  EXPECT_EQ(seen, (std::vector<int64_t>{10, 20, 30}));
}

TEST(Pending, ConcurrentWaitersAllReturn) {
  Pending p(Tensor::full({8}, DType::F32, 2));
  std::vector<std::thread> threads;
  std::atomic<int> total{0};
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] { total += static_cast<int>(sum(p.t, {}, false).item<float>()); });
  }
  p.work->release();
  for (auto& th : threads) th.join();
  EXPECT_EQ(total.load(), 4 * 16);
  EXPECT_GE(p.work->wait_calls(), 1);
  EXPECT_EQ(p.t.storage()->pending_count(), 0u);
}

}  // namespace
}  // namespace funcol
