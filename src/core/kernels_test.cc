// Tests of the reduction kernels, dtype conversion and tensor math.
#include "funcol/core/kernels.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gemm.h"
#include "simd.h"

namespace funcol {
namespace {

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

constexpr ReduceOp kAllOps[] = {ReduceOp::Sum, ReduceOp::Avg,  ReduceOp::Product, ReduceOp::Min,
                                ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr,     ReduceOp::BXor};

bool op_valid(ReduceOp op, DType d) {
  if (is_floating(d)) return op != ReduceOp::BAnd && op != ReduceOp::BOr && op != ReduceOp::BXor;
  if (d == DType::Bool) return op != ReduceOp::Avg;
  return true;
}

// Exact test input: small integers (negative ones for signed dtypes; only 1 and 2 for the
// product, so 8 factors stay exact even in bf16).
int64_t input_value(DType d, ReduceOp op, int k, int64_t i) {
  if (d == DType::Bool) return (i * 7 + k * 3) % 3 == 0 ? 1 : 0;
  if (op == ReduceOp::Product) return 1 + (i + k) % 2;
  const bool is_signed = d != DType::U8;
  const int64_t v = (i * 5 + k * 3) % 7;  // 0..6
  return is_signed ? v - 3 : v;
}

// Expected value of op over nsrc sources (no overflow at these magnitudes), as a double.
double expected_value(DType d, ReduceOp op, int nsrc, int64_t i) {
  int64_t acc = input_value(d, op, 0, i);
  for (int k = 1; k < nsrc; ++k) {
    const int64_t v = input_value(d, op, k, i);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg: acc = d == DType::Bool ? (acc | v) : acc + v; break;
      case ReduceOp::Product: acc = d == DType::Bool ? (acc & v) : acc * v; break;
      case ReduceOp::Min: acc = std::min(acc, v); break;
      case ReduceOp::Max: acc = std::max(acc, v); break;
      case ReduceOp::BAnd: acc &= v; break;
      case ReduceOp::BOr: acc |= v; break;
      case ReduceOp::BXor: acc ^= v; break;
    }
  }
  if (op != ReduceOp::Avg) return static_cast<double>(acc);
  if (is_integer(d)) return static_cast<double>(acc / nsrc);  // truncating
  if (d == DType::F64) return static_cast<double>(acc) / nsrc;
  // f16 / bf16 / f32: divided in f32, rounded once to the dtype.
  const float q = static_cast<float>(acc) / static_cast<float>(nsrc);
  if (d == DType::F16) return static_cast<float>(Eigen::half(q));
  if (d == DType::BF16) return static_cast<float>(Eigen::bfloat16(q));
  return q;
}

std::string fmt_trace(DType d, ReduceOp op, int nsrc, int64_t count) {
  return std::string(dtype_name(d)) + " " + std::string(reduce_op_name(op)) +
         " nsrc=" + std::to_string(nsrc) + " count=" + std::to_string(count);
}

Tensor make_input(DType d, ReduceOp op, int k, int64_t count) {
  std::vector<double> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) v[i] = static_cast<double>(input_value(d, op, k, i));
  return Tensor::from_vector<double>(v).to(d);
}

// Every dtype and valid op, nsrc in [min_src, max_src], each count: the result into a separate
// output and into the first and the last source.
void expect_reductions(int min_src, int max_src, std::initializer_list<int64_t> counts) {
  for (DType d : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      if (!op_valid(op, d)) continue;
      for (int nsrc = min_src; nsrc <= max_src; ++nsrc) {
        for (int64_t count : counts) {
          SCOPED_TRACE(fmt_trace(d, op, nsrc, count));
          std::vector<Tensor> inputs;
          std::vector<const void*> srcs;
          for (int k = 0; k < nsrc; ++k) {
            inputs.push_back(make_input(d, op, k, count));
            srcs.push_back(inputs.back().data_ptr());
          }
          std::vector<double> want(static_cast<size_t>(count));
          for (int64_t i = 0; i < count; ++i) want[i] = expected_value(d, op, nsrc, i);
          // Separate output.
          Tensor out = Tensor::full({count}, d, 1);
          reduce_buffers(op, d, out.data_ptr(), srcs.data(), nsrc, count);
          ASSERT_EQ(out.to_vector<double>(), want);
          // The kernel resolved once, as the threads backend calls it for each piece.
          if (count > 0) {
            Tensor direct = Tensor::full({count}, d, 1);
            reduce_kernel(op, d)(direct.data_ptr(), srcs.data(), nsrc, count);
            ASSERT_EQ(direct.to_vector<double>(), want) << "reduce_kernel";
          }
          // Output aliasing the first and the last source.
          for (int alias : {0, nsrc - 1}) {
            std::vector<Tensor> copies;
            std::vector<const void*> csrcs;
            for (const Tensor& t : inputs) {
              copies.push_back(t.clone());
              csrcs.push_back(copies.back().data_ptr());
            }
            reduce_buffers(op, d, copies[alias].data_ptr(), csrcs.data(), nsrc, count);
            ASSERT_EQ(copies[alias].to_vector<double>(), want) << "aliasing source " << alias;
          }
        }
      }
    }
  }
}

TEST(ReduceBuffers, EveryDTypeOpSourceCountAndLength) { expect_reductions(1, 8, {0, 1, 7, 1000}); }

// Sends the two-source reductions to the portable loops while it lives.
struct PortableReductions {
  PortableReductions() { detail::reduce_avx2_disabled = true; }
  ~PortableReductions() { detail::reduce_avx2_disabled = false; }
};

// The loops a CPU without AVX2 runs, on this one: two sources (the only case with an AVX2
// loop), lengths around the 16-element inner loop.
TEST(ReduceBuffers, PortableLoopsWithoutAvx2) {
  PortableReductions portable;
  ASSERT_FALSE(detail::have_avx2());
  expect_reductions(2, 2, {0, 1, 15, 16, 17, 33, 1000, 1003});
}

// A floating average of finite sources is finite even where their sum overflows (NCCL's is
// too): 3e38 and 3e38 average to 3e38 in f32, not inf. It rounds as the sum and division would
// without a limit on the exponent; a source that is infinite keeps the average infinite, of
// its sign also after the others' sum overflowed (3e38, 3e38, -inf: -inf, not NaN). Every
// path: two native sources (distinct, out aliasing either), more sources, f16/bf16 via f32.
void expect_avg_past_the_range_of_the_sum() {
  struct Case {
    DType dtype;
    double big;
  };
  for (Case c : {Case{DType::F32, 3.0e38}, Case{DType::F64, 1.5e308}, Case{DType::BF16, 3.0e38},
                 Case{DType::F16, 65504.0}}) {
    for (int nsrc : {2, 3, 4, 5, 8}) {
      SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " x" + std::to_string(nsrc));
      // Element 0: every source big; 1: one big and the rest -big/2 (a finite sum); 2: big,
      // one source +inf; 3: big and one small; 4: 7 (exact); 5: big, the last source -inf.
      constexpr int64_t kCount = 4101;  // past one accumulation block
      std::vector<Tensor> inputs;
      for (int k = 0; k < nsrc; ++k) {
        Tensor t = Tensor::full({kCount}, c.dtype, c.big);
        t.narrow(0, 1, 1).fill_(k == 0 ? c.big : -c.big / 2);
        if (k == nsrc - 1) {
          t.narrow(0, 2, 1).fill_(std::numeric_limits<double>::infinity());
          t.narrow(0, 3, 1).fill_(1.0);
          t.narrow(0, 5, 1).fill_(-std::numeric_limits<double>::infinity());
        }
        t.narrow(0, 4, 1).fill_(7.0);
        inputs.push_back(t);
      }
      // Every source's value of element 0, and the largest error of a sum of nsrc rounded
      // once each step (2 ulps is plenty for eight sources of one value).
      const double all_big = Tensor::full({1}, c.dtype, c.big).item<double>();
      const int digits = c.dtype == DType::F64   ? 53
                         : c.dtype == DType::F32 ? 24
                         : c.dtype == DType::F16 ? 11
                                                 : 8;
      const double tolerance = all_big * std::ldexp(1.0, 2 - digits);
      std::vector<const void*> srcs;
      for (const Tensor& t : inputs) srcs.push_back(t.data_ptr());
      for (int alias : {-1, 0, 1}) {
        SCOPED_TRACE(alias);
        Tensor out = alias < 0 ? Tensor::zeros({kCount}, c.dtype) : inputs[alias].clone();
        std::vector<const void*> s = srcs;
        if (alias >= 0) s[alias] = out.data_ptr();
        reduce_buffers(ReduceOp::Avg, c.dtype, out.data_ptr(), s.data(), nsrc, kCount);
        const std::vector<double> v = out.to_vector<double>();
        EXPECT_NEAR(v[0], all_big, tolerance);
        EXPECT_TRUE(std::isfinite(v[1])) << v[1];
        EXPECT_NEAR(v[1], all_big / (2 * nsrc) * (3 - nsrc), tolerance);
        EXPECT_EQ(v[2], std::numeric_limits<double>::infinity());
        EXPECT_TRUE(std::isfinite(v[3])) << v[3];
        EXPECT_NEAR(v[3], all_big / nsrc * (nsrc - 1), tolerance);
        EXPECT_EQ(v[4], 7.0);
        EXPECT_EQ(v[5], -std::numeric_limits<double>::infinity());
        EXPECT_NEAR(v[kCount - 1], all_big, tolerance);  // in the last, partial block
      }
    }
  }
}

TEST(ReduceBuffers, FloatAvgPastTheRangeOfTheSum) { expect_avg_past_the_range_of_the_sum(); }

TEST(ReduceBuffers, FloatAvgPastTheRangeOfTheSumWithoutAvx2) {
  PortableReductions portable;
  expect_avg_past_the_range_of_the_sum();
}

// A two-source reduction's bits do not depend on where its output is: into the first source,
// into the second, or a buffer of its own (an in-place all_reduce and a bucket's separate
// output must agree bit for bit, NaN payloads and signs included, as must every backend). The
// sources hold NaNs of different payloads and signs on both sides, a NaN against a number,
// opposite infinities, sums past the range and signed zeros, at every position of the
// 16-element inner loops and their tails.
template <typename T, typename Bits>
void expect_two_source_bits_independent_of_the_output(DType dtype) {
  constexpr int64_t kCount = 71;
  auto nan = [](Bits payload, bool negative) {
    Bits bits;
    const T q = std::numeric_limits<T>::quiet_NaN();
    std::memcpy(&bits, &q, sizeof(T));
    bits |= payload;
    if (negative) bits |= Bits{1} << (8 * sizeof(T) - 1);
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
  };
  const T inf = std::numeric_limits<T>::infinity();
  const T big = std::numeric_limits<T>::max() / 2 * T{1.5};
  std::vector<T> a(kCount), b(kCount);
  for (int64_t i = 0; i < kCount; ++i) {
    switch (i % 8) {
      case 0: a[i] = nan(Bits(3 + i), false), b[i] = nan(Bits(41 + i), true); break;
      case 1: a[i] = nan(Bits(5 + i), true), b[i] = T(i); break;
      case 2: a[i] = T(-i), b[i] = nan(Bits(7 + i), false); break;
      case 3: a[i] = inf, b[i] = -inf; break;
      case 4: a[i] = big, b[i] = big; break;
      case 5: a[i] = T{0}, b[i] = -T{0}; break;
      case 6: a[i] = -inf, b[i] = nan(Bits(9 + i), false); break;
      default: a[i] = T(i) / T{3}, b[i] = T(-2 * i) / T{7}; break;
    }
  }
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min,
                      ReduceOp::Max}) {
    SCOPED_TRACE(std::string(reduce_op_name(op)));
    std::vector<T> distinct(kCount), into_a = a, into_b = b;
    const void* srcs[2] = {a.data(), b.data()};
    reduce_buffers(op, dtype, distinct.data(), srcs, 2, kCount);
    const void* srcs_a[2] = {into_a.data(), b.data()};
    reduce_buffers(op, dtype, into_a.data(), srcs_a, 2, kCount);
    const void* srcs_b[2] = {a.data(), into_b.data()};
    reduce_buffers(op, dtype, into_b.data(), srcs_b, 2, kCount);
    for (int64_t i = 0; i < kCount; ++i) {
      Bits d, x, y;
      std::memcpy(&d, &distinct[i], sizeof(T));
      std::memcpy(&x, &into_a[i], sizeof(T));
      std::memcpy(&y, &into_b[i], sizeof(T));
      EXPECT_EQ(x, d) << "element " << i << ", out == first source";
      EXPECT_EQ(y, d) << "element " << i << ", out == second source";
    }
  }
}

// The same for any number of sources: a result's bits depend only on its sources' values, not
// on where in the buffers the element sits (a bucket packs a member's elements at another
// offset than the member alone has) nor on whether `out` is the first source.
template <typename T, typename Bits>
void expect_bits_independent_of_position(DType dtype, int nsrc) {
  constexpr int64_t kCount = 45;
  const T inf = std::numeric_limits<T>::infinity();
  std::vector<std::vector<T>> src(nsrc, std::vector<T>(kCount + 1));
  for (int k = 0; k < nsrc; ++k) {
    for (int64_t i = 0; i <= kCount; ++i) {
      Bits bits;
      const T q = std::numeric_limits<T>::quiet_NaN();
      std::memcpy(&bits, &q, sizeof(T));
      bits |= Bits(1 + 3 * k + i);
      if ((i + k) % 2) bits |= Bits{1} << (8 * sizeof(T) - 1);
      T nan;
      std::memcpy(&nan, &bits, sizeof(T));
      const int pattern = static_cast<int>((i + k) % 5);
      src[k][i] = pattern == 0 || pattern == 3 ? nan
                  : pattern == 1                ? (k % 2 ? -inf : inf)
                                                : T(i - k);
    }
  }
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Min,
                      ReduceOp::Max}) {
    SCOPED_TRACE(std::string(reduce_op_name(op)) + ", " + std::to_string(nsrc) + " sources");
    std::vector<const void*> at0(nsrc), at1(nsrc);
    for (int k = 0; k < nsrc; ++k) {
      at0[k] = src[k].data();
      at1[k] = src[k].data() + 1;
    }
    std::vector<T> whole(kCount + 1), shifted(kCount);
    reduce_buffers(op, dtype, whole.data(), at0.data(), nsrc, kCount + 1);
    reduce_buffers(op, dtype, shifted.data(), at1.data(), nsrc, kCount);
    std::vector<T> in_place(src[0].begin() + 1, src[0].end());
    std::vector<const void*> ip = at1;
    ip[0] = in_place.data();
    reduce_buffers(op, dtype, in_place.data(), ip.data(), nsrc, kCount);
    for (int64_t i = 0; i < kCount; ++i) {
      Bits w, x, y;
      std::memcpy(&w, &whole[i + 1], sizeof(T));
      std::memcpy(&x, &shifted[i], sizeof(T));
      std::memcpy(&y, &in_place[i], sizeof(T));
      EXPECT_EQ(x, w) << "element " << i + 1 << " read from offset " << i;
      EXPECT_EQ(y, w) << "element " << i + 1 << " in place";
    }
  }
}

void expect_bits_independent_of_output_and_position() {
  expect_two_source_bits_independent_of_the_output<float, uint32_t>(DType::F32);
  expect_two_source_bits_independent_of_the_output<double, uint64_t>(DType::F64);
  for (int nsrc : {2, 3, 4}) {
    expect_bits_independent_of_position<float, uint32_t>(DType::F32, nsrc);
    expect_bits_independent_of_position<double, uint64_t>(DType::F64, nsrc);
  }
}

TEST(ReduceBuffers, FloatBitsDoNotDependOnTheOutputOrPosition) {
  expect_bits_independent_of_output_and_position();
}

TEST(ReduceBuffers, FloatBitsDoNotDependOnTheOutputOrPositionWithoutAvx2) {
  PortableReductions portable;
  expect_bits_independent_of_output_and_position();
}

// Both loops give the same bits on arbitrary values (nothing is fused or reassociated): a rank
// on a CPU without AVX2 agrees with one that has it. Out of place and into either source.
TEST(ReduceBuffers, PortableAndAvx2LoopsAgreeBitForBit) {
  constexpr int64_t kCount = 1003;
  for (DType d : kAllDTypes) {
    for (ReduceOp op : kAllOps) {
      if (!op_valid(op, d)) continue;
      SCOPED_TRACE(fmt_trace(d, op, 2, kCount));
      const Tensor a = Tensor::rand({kCount}, d, 11);
      const Tensor b = Tensor::rand({kCount}, d, 12);
      // NaN in either source (min and max propagate it).
      if (d == DType::F32) {
        a.data<float>()[5] = b.data<float>()[9] = std::numeric_limits<float>::quiet_NaN();
      } else if (d == DType::F64) {
        a.data<double>()[5] = b.data<double>()[9] = std::numeric_limits<double>::quiet_NaN();
      }
      for (int into = 0; into < 3; ++into) {  // 0: separate output, 1: into a, 2: into b
        auto run = [&] {
          Tensor x = a.clone(), y = b.clone(), out = Tensor::zeros({kCount}, d);
          const void* srcs[] = {x.data_ptr(), y.data_ptr()};
          void* dst = into == 0 ? out.data_ptr() : into == 1 ? x.data_ptr() : y.data_ptr();
          reduce_buffers(op, d, dst, srcs, 2, kCount);
          return into == 0 ? out : into == 1 ? x : y;
        };
        const Tensor fast = run();
        PortableReductions portable;
        const Tensor slow = run();
        ASSERT_TRUE(fast.view_dtype(DType::U8).equal(slow.view_dtype(DType::U8)))
            << "into " << into;
      }
    }
  }
}

TEST(ReduceBuffers, SameBufferTwice) {
  Tensor t = Tensor::from_vector<int32_t>({1, 2, 3});
  const void* srcs[] = {t.data_ptr(), t.data_ptr()};
  reduce_buffers(ReduceOp::Sum, DType::I32, t.data_ptr(), srcs, 2, 3);
  EXPECT_EQ(t.to_vector<int>(), (std::vector<int>{2, 4, 6}));
  Tensor f = Tensor::from_vector<float>({1, 2, 3});
  Tensor o = Tensor::zeros({3}, DType::F32);
  const void* fs[] = {f.data_ptr(), f.data_ptr()};
  reduce_buffers(ReduceOp::Product, DType::F32, o.data_ptr(), fs, 2, 3);
  EXPECT_EQ(o.to_vector<float>(), (std::vector<float>{1, 4, 9}));
}

TEST(ReduceBuffers, IntegersWrapWithoutUndefinedBehaviour) {
  auto reduce2 = [](ReduceOp op, Tensor a, Tensor b) {
    const void* srcs[] = {a.data_ptr(), b.data_ptr()};
    reduce_buffers(op, a.dtype(), a.data_ptr(), srcs, 2, a.numel());
    return a;
  };
  const int32_t kMax = std::numeric_limits<int32_t>::max();
  EXPECT_EQ(reduce2(ReduceOp::Sum, Tensor::from_vector<int32_t>({kMax}),
                    Tensor::from_vector<int32_t>({1}))
                .item<int64_t>(),
            std::numeric_limits<int32_t>::min());
  EXPECT_EQ(reduce2(ReduceOp::Product, Tensor::from_vector<int8_t>({16}),
                    Tensor::from_vector<int8_t>({16}))
                .item<int>(),
            0);
  EXPECT_EQ(reduce2(ReduceOp::Sum, Tensor::from_vector<uint8_t>({200}),
                    Tensor::from_vector<uint8_t>({100}))
                .item<int>(),
            44);
  EXPECT_EQ(reduce2(ReduceOp::Product, Tensor::from_vector<int16_t>({300}),
                    Tensor::from_vector<int16_t>({300}))
                .item<int16_t>(),
            static_cast<int16_t>(90000 - 65536));
  EXPECT_EQ(reduce2(ReduceOp::Product, Tensor::from_vector<int64_t>({1LL << 62}),
                    Tensor::from_vector<int64_t>({4}))
                .item<int64_t>(),
            0);
  // Avg on integers truncates toward zero.
  EXPECT_EQ(reduce2(ReduceOp::Avg, Tensor::from_vector<int32_t>({-7, 7, 3}),
                    Tensor::from_vector<int32_t>({0, 0, 0}))
                .to_vector<int>(),
            (std::vector<int>{-3, 3, 1}));
}

TEST(ReduceBuffers, BoolOpsAndNonCanonicalBytes) {
  // Bytes other than 0/1 (a u8 buffer viewed as bool) count as true.
  Tensor a = Tensor::from_vector<uint8_t>({0, 2, 0, 7}).view_dtype(DType::Bool);
  Tensor b = Tensor::from_vector<uint8_t>({0, 0, 5, 1}).view_dtype(DType::Bool);
  const void* srcs[] = {a.data_ptr(), b.data_ptr()};
  auto run = [&](ReduceOp op) {
    Tensor out = Tensor::zeros({4}, DType::Bool);
    reduce_buffers(op, DType::Bool, out.data_ptr(), srcs, 2, 4);
    return out.view_dtype(DType::U8).to_vector<int>();
  };
  EXPECT_EQ(run(ReduceOp::Sum), (std::vector<int>{0, 1, 1, 1}));
  EXPECT_EQ(run(ReduceOp::Max), (std::vector<int>{0, 1, 1, 1}));
  EXPECT_EQ(run(ReduceOp::BOr), (std::vector<int>{0, 1, 1, 1}));
  EXPECT_EQ(run(ReduceOp::Product), (std::vector<int>{0, 0, 0, 1}));
  EXPECT_EQ(run(ReduceOp::Min), (std::vector<int>{0, 0, 0, 1}));
  EXPECT_EQ(run(ReduceOp::BAnd), (std::vector<int>{0, 0, 0, 1}));
  EXPECT_EQ(run(ReduceOp::BXor), (std::vector<int>{0, 1, 1, 0}));
  // One source is copied as it is, whichever op: the bytes a one-rank collective leaves.
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Min, ReduceOp::BXor}) {
    Tensor out = Tensor::zeros({4}, DType::Bool);
    reduce_buffers(op, DType::Bool, out.data_ptr(), srcs, 1, 4);
    EXPECT_EQ(out.view_dtype(DType::U8).to_vector<int>(), (std::vector<int>{0, 2, 0, 7}))
        << reduce_op_name(op);
  }
}

TEST(ReduceBuffers, FloatMinMaxPropagateNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor a = Tensor::from_vector<float>({nan, 1, 5});
  Tensor b = Tensor::from_vector<float>({1, nan, 2});
  const void* srcs[] = {a.data_ptr(), b.data_ptr()};
  for (ReduceOp op : {ReduceOp::Min, ReduceOp::Max}) {
    Tensor out = Tensor::zeros({3}, DType::F32);
    reduce_buffers(op, DType::F32, out.data_ptr(), srcs, 2, 3);
    std::vector<float> v = out.to_vector<float>();
    EXPECT_TRUE(std::isnan(v[0]));
    EXPECT_TRUE(std::isnan(v[1]));
    EXPECT_EQ(v[2], op == ReduceOp::Min ? 2.f : 5.f);
  }
}

// Of several NaNs, min and max give the same one in any order of the sources (MPI combines the
// ranks' values in its own order): each dtype, each pair of sign and payload.
TEST(ReduceBuffers, FloatMinMaxPickTheSameNaNInAnyOrder) {
  const auto nan_bits = [](DType d, int k) -> uint64_t {
    const uint64_t sign = k & 1, payload = static_cast<uint64_t>(k);
    switch (d) {
      case DType::F16: return sign << 15 | 0x7e00 | payload;
      case DType::BF16: return sign << 15 | 0x7fc0 | payload;
      case DType::F32: return sign << 31 | 0x7fc00000 | payload;
      default: return sign << 63 | 0x7ff8000000000000 | payload;
    }
  };
  for (DType d : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
    const size_t size = itemsize(d);
    std::vector<Tensor> src;
    for (int k = 0; k < 4; ++k) {
      Tensor t = Tensor::zeros({37}, d);
      for (int64_t i = 0; i < 37; ++i) {
        const uint64_t bits = i % 3 == 0 ? nan_bits(d, k) : 0;  // NaN in some lanes, 0 in others
        std::memcpy(static_cast<char*>(t.data_ptr()) + i * size, &bits, size);
      }
      src.push_back(t);
    }
    for (ReduceOp op : {ReduceOp::Min, ReduceOp::Max}) {
      std::vector<uint8_t> first;
      for (const std::vector<int>& order : {std::vector<int>{0, 1, 2, 3}, std::vector<int>{3, 2, 1, 0},
                                            std::vector<int>{1, 3, 0, 2}, std::vector<int>{2, 0, 3, 1}}) {
        const void* srcs[4];
        for (int k = 0; k < 4; ++k) srcs[k] = src[static_cast<size_t>(order[k])].data_ptr();
        Tensor out = Tensor::zeros({37}, d);
        reduce_buffers(op, d, out.data_ptr(), srcs, 4, 37);
        // And pairwise, as MPI's user-defined operator combines them.
        Tensor acc = src[static_cast<size_t>(order[0])].clone();
        for (int k = 1; k < 4; ++k) reduce_inplace(op, d, acc.data_ptr(), srcs[k], 37);
        const std::vector<uint8_t> bytes = out.view_dtype(DType::U8).to_vector<uint8_t>();
        EXPECT_EQ(acc.view_dtype(DType::U8).to_vector<uint8_t>(), bytes)
            << dtype_name(d) << " " << reduce_op_name(op);
        if (first.empty()) first = bytes;
        EXPECT_EQ(bytes, first) << dtype_name(d) << " " << reduce_op_name(op);
      }
      uint64_t got = 0;
      std::memcpy(&got, first.data(), size);
      if (size >= 4) {
        EXPECT_EQ(got, nan_bits(d, 3)) << dtype_name(d) << " " << reduce_op_name(op);
      } else {
        // f16 and bf16 are combined as f32, whose conversion back keeps a NaN's sign only.
        EXPECT_EQ(got & 0x8000, 0x8000u) << dtype_name(d) << " " << reduce_op_name(op);
        EXPECT_TRUE(std::isnan(Tensor::from_vector<int16_t>({static_cast<int16_t>(got)})
                                   .view_dtype(d)
                                   .item<float>()));
      }
    }
  }
}

TEST(ReduceBuffers, Errors) {
  Tensor f = Tensor::zeros({4}, DType::F32);
  const void* srcs[] = {f.data_ptr(), f.data_ptr()};
  for (ReduceOp op : {ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor}) {
    for (DType d : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
      EXPECT_THROW(reduce_buffers(op, d, f.data_ptr(), srcs, 2, 1), InvalidArgument);
      EXPECT_THROW(reduce_inplace(op, d, f.data_ptr(), srcs[0], 1), InvalidArgument);
      EXPECT_THROW(reduce_kernel(op, d), InvalidArgument);
    }
  }
  EXPECT_THROW(reduce_kernel(ReduceOp::Avg, DType::Bool), InvalidArgument);
  EXPECT_THROW(reduce_buffers(ReduceOp::Avg, DType::Bool, f.data_ptr(), srcs, 2, 1),
               InvalidArgument);
  EXPECT_THROW(reduce_inplace(ReduceOp::Avg, DType::Bool, f.data_ptr(), srcs[0], 1),
               InvalidArgument);
  EXPECT_THROW(finish_avg(DType::Bool, f.data_ptr(), 1, 2), InvalidArgument);
  EXPECT_EQ(error_of<InvalidArgument>(
                [&] { reduce_buffers(ReduceOp::Sum, DType::F32, f.data_ptr(), srcs, 0, 1); }),
            "reduce_buffers: nsrc must be >= 1, got 0");
  EXPECT_THROW(reduce_buffers(ReduceOp::Sum, DType::F32, f.data_ptr(), srcs, 2, -1),
               InvalidArgument);
  EXPECT_THROW(finish_avg(DType::F32, f.data_ptr(), 4, 0), InvalidArgument);
  // Count 0 touches nothing, even through null pointers.
  EXPECT_NO_THROW(reduce_buffers(ReduceOp::Sum, DType::F32, nullptr, nullptr, 3, 0));
}

TEST(ReduceBuffers, HalfPrecisionAccumulatesInFloat) {
  // 2048 + 1 + 1 + ... rounds back to 2048 at every step in f16 (spacing 2 there) but is
  // 2055 in f32, rounded once to 2056. bf16: the same with 256 (spacing 2).
  struct Case {
    DType dtype;
    float big;
  };
  for (Case c : {Case{DType::F16, 2048.f}, Case{DType::BF16, 256.f}}) {
    SCOPED_TRACE(std::string(dtype_name(c.dtype)));
    std::vector<Tensor> inputs = {Tensor::full({5}, c.dtype, c.big)};
    for (int k = 0; k < 7; ++k) inputs.push_back(Tensor::full({5}, c.dtype, 1));
    std::vector<const void*> srcs;
    for (const Tensor& t : inputs) srcs.push_back(t.data_ptr());
    Tensor out = Tensor::zeros({5}, c.dtype);
    reduce_buffers(ReduceOp::Sum, c.dtype, out.data_ptr(), srcs.data(), 8, 5);
    const float once = Tensor::full({1}, DType::F32, c.big + 7).to(c.dtype).item<float>();
    EXPECT_EQ(out.to_vector<float>(), std::vector<float>(5, once));
    EXPECT_NE(once, c.big);
    // Step by step (what a ring algorithm's reduce_inplace chain computes) loses the ones.
    Tensor acc = inputs[0].clone();
    for (int k = 1; k < 8; ++k) {
      reduce_inplace(ReduceOp::Sum, c.dtype, acc.data_ptr(), srcs[k], 5);
    }
    EXPECT_EQ(acc.to_vector<float>(), std::vector<float>(5, c.big));
    // Avg divides the f32 sum before the single rounding.
    reduce_buffers(ReduceOp::Avg, c.dtype, out.data_ptr(), srcs.data(), 8, 5);
    const float avg = Tensor::full({1}, DType::F32, (c.big + 7) / 8).to(c.dtype).item<float>();
    EXPECT_EQ(out.to_vector<float>(), std::vector<float>(5, avg));
  }
}

TEST(ReduceInplace, ChainMatchesReduceBuffersAndFinishAvg) {
  for (DType d : {DType::I8, DType::U8, DType::I16, DType::I32, DType::I64, DType::F16, DType::BF16,
                  DType::F32, DType::F64}) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Product}) {
      SCOPED_TRACE(std::string(dtype_name(d)) + " " + std::string(reduce_op_name(op)));
      std::vector<Tensor> inputs;
      std::vector<const void*> srcs;
      for (int k = 0; k < 5; ++k) {
        inputs.push_back(make_input(d, op, k, 37));
        srcs.push_back(inputs.back().data_ptr());
      }
      Tensor acc = inputs[0].clone();
      for (int k = 1; k < 5; ++k) reduce_inplace(op, d, acc.data_ptr(), srcs[k], 37);
      Tensor out = Tensor::zeros({37}, d);
      reduce_buffers(op, d, out.data_ptr(), srcs.data(), 5, 37);
      EXPECT_TRUE(acc.equal(out));
    }
  }
  // Avg in a chain: sum, then finish_avg once.
  Tensor acc = Tensor::from_vector<int32_t>({-7, 9, 4});
  Tensor src = Tensor::from_vector<int32_t>({0, 0, 1});
  reduce_inplace(ReduceOp::Avg, DType::I32, acc.data_ptr(), src.data_ptr(), 3);
  EXPECT_EQ(acc.to_vector<int>(), (std::vector<int>{-7, 9, 5}));
  finish_avg(DType::I32, acc.data_ptr(), 3, 2);
  EXPECT_EQ(acc.to_vector<int>(), (std::vector<int>{-3, 4, 2}));
  Tensor h = Tensor::from_vector<float>({3, 5}).to(DType::F16);
  finish_avg(DType::F16, h.data_ptr(), 2, 4);
  EXPECT_EQ(h.to_vector<float>(), (std::vector<float>{0.75f, 1.25f}));
  Tensor u = Tensor::from_vector<uint8_t>({250});
  finish_avg(DType::U8, u.data_ptr(), 1, 300);
  EXPECT_EQ(u.item<int>(), 0);
}

// The branch-free f16/bf16 conversions must agree bit for bit with Eigen's: every 16-bit
// pattern to f32, and a spread of f32 patterns (plus the edges) to f16 / bf16.
TEST(ConvertBuffer, HalfConversionsMatchEigenBitForBit) {
  std::vector<int32_t> all16(65536);
  for (int32_t i = 0; i < 65536; ++i) all16[i] = static_cast<int16_t>(static_cast<uint16_t>(i));
  Tensor patterns = Tensor::from_vector<int32_t>(all16).to(DType::I16);
  for (DType d : {DType::F16, DType::BF16}) {
    std::vector<float> got = patterns.view_dtype(d).to_vector<float>();
    for (int32_t i = 0; i < 65536; ++i) {
      const auto bits = static_cast<uint16_t>(i);
      float want;
      if (d == DType::F16) {
        want = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
      } else {
        want = static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits));
      }
      ASSERT_EQ(Eigen::numext::bit_cast<uint32_t>(got[i]), Eigen::numext::bit_cast<uint32_t>(want))
          << dtype_name(d) << " bits " << i;
    }
  }
  std::vector<int32_t> floats;
  for (uint64_t b = 0; b <= 0xffffffffULL; b += 65521) floats.push_back(static_cast<int32_t>(b));
  for (uint32_t edge : {0x38800000u, 0x387fffffu, 0x477fefffu, 0x477ff000u, 0x47800000u,
                        0x7f800000u, 0x7f800001u, 0xffc00000u, 0x33000000u, 0x33000001u,
                        0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x00000001u}) {
    floats.push_back(static_cast<int32_t>(edge));
    floats.push_back(static_cast<int32_t>(edge | 0x80000000u));
  }
  Tensor f = Tensor::from_vector<int32_t>(floats).view_dtype(DType::F32);
  std::vector<float> fv = f.to_vector<float>();
  std::vector<int16_t> h = f.to(DType::F16).view_dtype(DType::I16).to_vector<int16_t>();
  std::vector<int16_t> b = f.to(DType::BF16).view_dtype(DType::I16).to_vector<int16_t>();
  for (size_t i = 0; i < fv.size(); ++i) {
    ASSERT_EQ(static_cast<uint16_t>(h[i]), Eigen::numext::bit_cast<uint16_t>(Eigen::half(fv[i])))
        << "f16 from bits " << floats[i];
    ASSERT_EQ(static_cast<uint16_t>(b[i]),
              Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(fv[i])))
        << "bf16 from bits " << floats[i];
  }
}

// The f16 (or bf16) bits nearest to `v`, ties to even, found by a search among the finite
// values (independent of the conversions under test; long double holds every f64 and i64).
uint16_t nearest_low_bits(long double v, bool bf16) {
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const long double a = std::fabs(v);
  const uint32_t top = bf16 ? 0x7f7f : 0x7bff;  // the largest finite pattern
  const long double beyond = bf16 ? std::ldexp(1.0L, 128) : 65536.0L;  // one ulp past it
  const uint16_t inf = bf16 ? 0x7f80 : 0x7c00;
  if (a >= beyond) return sign | inf;
  auto value = [&](uint32_t b) -> long double {
    if (b > top) return beyond;
    const auto bits = static_cast<uint16_t>(b);
    return bf16 ? static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits))
                : static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
  };
  uint32_t lo = 0, hi = top + 1;  // value(lo) <= a < value(hi)
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    (value(mid) <= a ? lo : hi) = mid;
  }
  const long double below = a - value(lo), above = value(hi) - a;
  const uint32_t b = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
  return b > top ? sign | inf : static_cast<uint16_t>(sign | b);
}

// f64, i64 and i32 values round once to f16 and bf16, to nearest even: through f32 they rounded
// twice (f64 1 + 2^-11 + 2^-40 became 1 in f16, not 1 + 2^-10; i64 2^25 + 2^17 + 1 became
// 2^25 in bf16). Random values, and the midpoints between neighbours with a nudge either way.
TEST(ConvertBuffer, WideValuesRoundOnceToHalfPrecision) {
  std::mt19937_64 rng(7);
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f16");
    const DType to = bf16 ? DType::BF16 : DType::F16;
    auto value = [&](uint16_t b) {
      return bf16 ? static_cast<double>(Eigen::numext::bit_cast<Eigen::bfloat16>(b))
                  : static_cast<double>(Eigen::numext::bit_cast<Eigen::half>(b));
    };
    const uint16_t top = bf16 ? 0x7f7f : 0x7bff;
    std::vector<double> doubles = {1 + 0x1p-11 + 0x1p-40, 1 + 0x1p-8 + 0x1p-40, 65519.99,
                                   65520.0, -0.0, 1e300, -1e-300,
                                   std::numeric_limits<double>::quiet_NaN()};
    std::vector<int64_t> longs = {(int64_t{1} << 25) + (int64_t{1} << 17) + 1,
                                  std::numeric_limits<int64_t>::max(),
                                  std::numeric_limits<int64_t>::min(), -1, 0, 65520, 65519};
    for (int k = 0; k < 20000; ++k) {
      const auto b = static_cast<uint16_t>(rng() % top);
      const double mid = (value(b) + value(static_cast<uint16_t>(b + 1))) / 2;  // exact
      for (const double x : {mid, std::nextafter(mid, 0.0), std::nextafter(mid, 1e300)}) {
        doubles.push_back(k % 2 ? x : -x);
      }
      const int exponent = static_cast<int>(rng() % 60) - (bf16 ? 20 : 30);
      doubles.push_back(std::ldexp(1.0 + static_cast<double>(rng() >> 12) * 0x1p-52, exponent));
      if (mid >= 1 && mid < 0x1p62 && mid == std::floor(mid)) {
        const auto m = static_cast<int64_t>(mid);
        for (const int64_t x : {m, m - 1, m + 1}) longs.push_back(k % 2 ? x : -x);
      }
      longs.push_back(static_cast<int64_t>(rng() >> (rng() % 64)));
    }
    auto check = [&](const Tensor& in, const std::vector<long double>& exact) {
      const std::vector<int16_t> got = in.to(to).view_dtype(DType::I16).to_vector<int16_t>();
      for (size_t i = 0; i < exact.size(); ++i) {
        if (std::isnan(exact[i])) {
          EXPECT_EQ(got[i] & 0x7fff, bf16 ? 0x7fc0 : 0x7e00);
          continue;
        }
        ASSERT_EQ(static_cast<uint16_t>(got[i]), nearest_low_bits(exact[i], bf16))
            << dtype_name(in.dtype()) << " " << static_cast<double>(exact[i]);
      }
    };
    check(Tensor::from_vector<double>(doubles),
          std::vector<long double>(doubles.begin(), doubles.end()));
    check(Tensor::from_vector<int64_t>(longs),
          std::vector<long double>(longs.begin(), longs.end()));
    std::vector<int32_t> ints;
    for (const int64_t x : longs) {
      if (x >= INT32_MIN && x <= INT32_MAX) ints.push_back(static_cast<int32_t>(x));
    }
    ASSERT_GT(ints.size(), 1000u);
    check(Tensor::from_vector<int32_t>(ints), std::vector<long double>(ints.begin(), ints.end()));
  }
}

TEST(ConvertBuffer, AllPairsOnExactValues) {
  const std::vector<double> values = {0, 1, 2, 3, 100, 5};
  for (DType from : kAllDTypes) {
    for (DType to : kAllDTypes) {
      SCOPED_TRACE(std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)));
      Tensor src = Tensor::from_vector<double>(values).to(from);
      Tensor dst = Tensor::zeros({6}, to);
      convert_buffer(from, src.data_ptr(), to, dst.data_ptr(), 6);
      std::vector<double> want = src.to_vector<double>();
      if (to == DType::Bool) {
        for (double& x : want) x = x != 0;
      }
      EXPECT_EQ(dst.to_vector<double>(), want);
    }
  }
  Tensor f = Tensor::from_vector<float>({2.9f, -2.9f});
  Tensor i = Tensor::zeros({2}, DType::I32);
  convert_buffer(DType::F32, f.data_ptr(), DType::I32, i.data_ptr(), 2);
  EXPECT_EQ(i.to_vector<int>(), (std::vector<int>{2, -2}));
  EXPECT_NO_THROW(convert_buffer(DType::F32, nullptr, DType::I8, nullptr, 0));
  EXPECT_THROW(convert_buffer(DType::F32, f.data_ptr(), DType::I8, i.data_ptr(), -1),
               InvalidArgument);
}

// ---- tensor math ----------------------------------------------------------------------------

// relu_backward selects as PyTorch's threshold_backward, bit for bit on every dtype: 0 (+0)
// where x <= 0 whatever the gradient (infinite and NaN ones included: grad * mask gave NaN), the
// gradient itself elsewhere, x NaN included.
TEST(Elementwise, ReluBackwardSelectsTheGradientWhereXIsNotAtMostZero) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> g{1.5, -2, inf, -inf, nan, 3, -0.0, 7, -1, 4};
  const std::vector<double> x{2, -1, -3, 0, -0.0, nan, 5, -inf, inf, 0.25};
  for (DType d : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64,
                  DType::I16, DType::I8, DType::U8, DType::Bool}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    const bool floating = is_floating(d);
    std::vector<double> gv, xv;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!floating && (!std::isfinite(g[i]) || !std::isfinite(x[i]))) continue;
      gv.push_back(g[i]);
      xv.push_back(x[i]);
    }
    const Tensor gt = Tensor::from_vector<double>(gv, {static_cast<int64_t>(gv.size())}).to(d);
    const Tensor xt = Tensor::from_vector<double>(xv, {static_cast<int64_t>(xv.size())}).to(d);
    // The selection from x as the kernel sees it (converted to d), the kept gradients as gt.
    const std::vector<double> xd = xt.to(DType::F64).to_vector<double>();
    std::vector<double> wv(gv.size());
    for (size_t i = 0; i < gv.size(); ++i) wv[i] = xd[i] <= 0 ? 0.0 : gv[i];
    const Tensor want = Tensor::from_vector<double>(wv, {static_cast<int64_t>(wv.size())}).to(d);
    const Tensor got = relu_backward(gt, xt);
    ASSERT_EQ(got.dtype(), d);
    ASSERT_EQ(got.nbytes(), want.nbytes());
    EXPECT_EQ(std::memcmp(got.data_ptr(), want.data_ptr(), got.nbytes()), 0);
  }
  EXPECT_EQ(error_of<ShapeError>([] {
              relu_backward(Tensor::zeros({2}, DType::F32), Tensor::zeros({3}, DType::F32));
            }),
            "relu_backward: shape mismatch [2] vs [3]");
}

TEST(Elementwise, ArithmeticOnFloatsAndIntegers) {
  for (DType d : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64,
                  DType::I16, DType::I8}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    Tensor a = Tensor::from_vector<double>({6, -4, 9, 0}, {2, 2}).to(d);
    Tensor b = Tensor::from_vector<double>({3, 2, -3, 5}, {2, 2}).to(d);
    EXPECT_EQ(add(a, b).to_vector<double>(), (std::vector<double>{9, -2, 6, 5}));
    EXPECT_EQ(sub(a, b).to_vector<double>(), (std::vector<double>{3, -6, 12, -5}));
    EXPECT_EQ(mul(a, b).to_vector<double>(), (std::vector<double>{18, -8, -27, 0}));
    EXPECT_EQ(div(a, b).to_vector<double>(), (std::vector<double>{2, -2, -3, 0}));
    EXPECT_EQ(neg(a).to_vector<double>(), (std::vector<double>{-6, 4, -9, 0}));
    EXPECT_EQ(relu(a).to_vector<double>(), (std::vector<double>{6, 0, 9, 0}));
    EXPECT_EQ(mul_scalar(a, 2).to_vector<double>(), (std::vector<double>{12, -8, 18, 0}));
    EXPECT_EQ(gt_zero_mask(a).to_vector<double>(), (std::vector<double>{1, 0, 1, 0}));
    EXPECT_EQ(add(a, b).dtype(), d);
    // Non-contiguous inputs.
    EXPECT_EQ(add(a.transpose(0, 1), b).to_vector<double>(), (std::vector<double>{9, 11, -7, 5}));
  }
  EXPECT_EQ(
      div(Tensor::from_vector<int>({7, -7}), Tensor::from_vector<int>({2, 2})).to_vector<int>(),
      (std::vector<int>{3, -3}));
  EXPECT_EQ(mul_scalar(Tensor::from_vector<float>({3}), 0.5).item<float>(), 1.5f);
  EXPECT_EQ(mul_scalar(Tensor::from_vector<int>({3}), 0.5).item<int>(), 1);
  EXPECT_EQ(mul_scalar(Tensor::from_vector<int64_t>({(1LL << 53) + 1}), 3).item<int64_t>(),
            3 * ((1LL << 53) + 1));
}

// relu is torch.relu's clamp_min(x, 0): -0.0 is not below 0 and stays -0.0; NaN propagates;
// bool is refused.
TEST(Elementwise, ReluKeepsNegativeZeroAndNaN) {
  for (DType dtype : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
    const Tensor x = Tensor::from_vector<double>({-0.0, -2.0, 3.0, NAN}).to(dtype);
    const std::vector<double> r = relu(x).to(DType::F64).to_vector<double>();
    EXPECT_TRUE(r[0] == 0 && std::signbit(r[0])) << dtype_name(dtype);
    EXPECT_TRUE(r[1] == 0 && !std::signbit(r[1])) << dtype_name(dtype);
    EXPECT_EQ(r[2], 3.0) << dtype_name(dtype);
    EXPECT_TRUE(std::isnan(r[3])) << dtype_name(dtype);
  }
  EXPECT_THROW(relu(Tensor::zeros({2}, DType::Bool)), InvalidArgument);
}

// Sums accumulate in f64 for every floating dtype. 2048 plus 16383 halves of f32's last step
// there (2^-13 each) is 2049.9998...: 2050 as f16. An f32 accumulator rounds each addition
// back to 2048.
TEST(Reductions, LowFloatSumsDoNotStallInAnF32Accumulator) {
  std::vector<double> v(16384, 0x1p-13);
  v[0] = 2048;
  const Tensor x = Tensor::from_vector<double>(v).to(DType::F16);
  EXPECT_EQ(sum(x, {}, false).item<float>(), 2050.0f);
}

// neg flips the sign bit of floats, as torch.neg: a zero changes sign (0 - x would not).
TEST(Elementwise, NegFlipsTheSignOfZero) {
  for (DType dtype : {DType::F16, DType::BF16, DType::F32, DType::F64}) {
    const Tensor z = neg(Tensor::zeros({2}, dtype)).to(DType::F64);
    for (double v : z.to_vector<double>()) {
      EXPECT_TRUE(v == 0 && std::signbit(v)) << dtype_name(dtype);
    }
    const Tensor back = neg(neg(Tensor::zeros({1}, dtype))).to(DType::F64);
    EXPECT_FALSE(std::signbit(back.item<double>())) << dtype_name(dtype);
  }
}

TEST(Elementwise, IntegerEdgeCases) {
  const int32_t kMin = std::numeric_limits<int32_t>::min();
  EXPECT_EQ(
      div(Tensor::from_vector<int32_t>({kMin}), Tensor::from_vector<int32_t>({-1})).item<int32_t>(),
      kMin);
  EXPECT_EQ(neg(Tensor::from_vector<int32_t>({kMin})).item<int32_t>(), kMin);
  EXPECT_EQ(add(Tensor::from_vector<int8_t>({127}), Tensor::from_vector<int8_t>({1})).item<int>(),
            -128);
  EXPECT_EQ(mul(Tensor::from_vector<uint8_t>({16}), Tensor::from_vector<uint8_t>({17})).item<int>(),
            16);
  EXPECT_EQ(error_of<InvalidArgument>(
                [] { div(Tensor::from_vector<int>({1}), Tensor::from_vector<int>({0})); }),
            "div: integer division by zero");
  EXPECT_TRUE(std::isinf(
      div(Tensor::from_vector<float>({1}), Tensor::from_vector<float>({0})).item<float>()));
  Tensor t = Tensor::from_vector<bool>({true, false, true});
  Tensor f = Tensor::from_vector<bool>({false, false, true});
  EXPECT_EQ(add(t, f).to_vector<bool>(), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(mul(t, f).to_vector<bool>(), (std::vector<bool>{false, false, true}));
  EXPECT_THROW(sub(t, f), InvalidArgument);
  EXPECT_THROW(neg(t), InvalidArgument);
  EXPECT_TRUE(std::isnan(relu(Tensor::full({1}, DType::F32, std::nan(""))).item<float>()));
}

TEST(Elementwise, Errors) {
  Tensor a = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_EQ(error_of<ShapeError>([&] {
              add(a, Tensor::zeros({3, 2}, DType::F32));
            }),
            "add: shape mismatch [2,3] vs [3,2]");
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              mul(a, Tensor::zeros({2, 3}, DType::F64));
            }),
            "mul: dtype mismatch f32 vs f64");
  EXPECT_THROW(add(a, Tensor()), InvalidArgument);
  EXPECT_EQ(add(Tensor::zeros({0, 3}, DType::F32), Tensor::zeros({0, 3}, DType::F32)).sizes(),
            (Shape{0, 3}));
}

Tensor small_ints(const Shape& shape, uint64_t seed) {
  std::vector<int> v;
  for (int x : Tensor::rand(shape, DType::I32, seed).to_vector<int>()) v.push_back(x % 4);
  return Tensor::from_vector<int>(v, shape);
}

Tensor hand_matmul(const Tensor& a, const Tensor& b) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  std::vector<double> av = a.to_vector<double>(), bv = b.to_vector<double>();
  std::vector<double> out(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t p = 0; p < k; ++p) out[i * n + j] += av[i * k + p] * bv[p * n + j];
    }
  }
  return Tensor::from_vector<double>(out, {m, n});
}

TEST(Matmul, MatchesHandLoop) {
  for (DType d : {DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64,
                  DType::I16, DType::I8, DType::U8}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    // Integer-valued inputs in [0, 4): every product sum is exact in each dtype.
    Tensor a = small_ints({5, 7}, 1).to(d);
    Tensor b = small_ints({7, 3}, 2).to(d);
    Tensor want = hand_matmul(a, b);
    Tensor got = matmul(a, b);
    EXPECT_EQ(got.dtype(), d);
    EXPECT_EQ(got.sizes(), (Shape{5, 3}));
    EXPECT_EQ(got.to_vector<double>(), want.to_vector<double>());
    // Transposed (non-contiguous) operands.
    Tensor bt = b.transpose(0, 1).contiguous().transpose(0, 1);
    EXPECT_FALSE(bt.is_contiguous());
    EXPECT_EQ(matmul(a, bt).to_vector<double>(), want.to_vector<double>());
  }
}

// matmul reads f32/f64 operands that are transposes of contiguous matrices in place (the backward
// pass's x.t() @ g and g @ w.t(); f32 through detail::gemm_f32 with AVX2, every strided operand);
// the result must be right and must not depend on the operands' layout.
void expect_layout_independent_products() {
  for (DType d : {DType::F32, DType::F64, DType::BF16, DType::I32}) {
    SCOPED_TRACE(std::string(dtype_name(d)));
    for (int64_t m : {1, 2, 5, 16, 33}) {
      for (int64_t k : {1, 4, 7, 17, 64}) {
        for (int64_t n : {1, 3, 6, 16, 65}) {
          SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n));
          const Tensor a = Tensor::rand({m, k}, d, static_cast<uint64_t>(m * 1000 + k));
          const Tensor b = Tensor::rand({k, n}, d, static_cast<uint64_t>(n));
          const Tensor want = matmul(a, b);
          if (d == DType::F32 || d == DType::F64) {
            // Against a double loop: each sum has at most 64 terms of magnitude < 1.
            const std::vector<double> got = want.to_vector<double>();
            const std::vector<double> ref = hand_matmul(a, b).to_vector<double>();
            double worst = 0;
            for (size_t i = 0; i < got.size(); ++i) {
              worst = std::max(worst, std::fabs(got[i] - ref[i]));
            }
            EXPECT_LE(worst, d == DType::F32 ? 1e-4 : 1e-12);
          }
          // The same matrices stored transposed, seen through transpose views.
          const Tensor at = a.transpose(0, 1).contiguous().transpose(0, 1);
          const Tensor bt = b.transpose(0, 1).contiguous().transpose(0, 1);
          EXPECT_TRUE(matmul(at, b).equal(want));
          EXPECT_TRUE(matmul(a, bt).equal(want));
          EXPECT_TRUE(matmul(at, bt).equal(want));
        }
      }
    }
    // A strided view that is no transpose (every other column) is copied first.
    const Tensor wide = Tensor::rand({16, 128}, d, 3);
    const Tensor cols = wide.view({16, 64, 2}).select(2, 0);
    ASSERT_FALSE(cols.is_contiguous());
    const Tensor b = Tensor::rand({64, 16}, d, 4);
    EXPECT_TRUE(matmul(cols, b).equal(matmul(cols.contiguous(), b)));
  }
}

TEST(Matmul, TransposedOperandsGiveTheContiguousResult) { expect_layout_independent_products(); }

// The same on the portable path, which CPUs without AVX2 and FMA take (f32 through Eigen).
TEST(Matmul, TransposedOperandsGiveTheContiguousResultWithoutAvx2) {
  struct Portable {
    Portable() { detail::gemm_f32_disabled = true; }
    ~Portable() { detail::gemm_f32_disabled = false; }
  } portable;
  ASSERT_FALSE(detail::have_gemm_f32());
  expect_layout_independent_products();
}

TEST(Matmul, HalfComputesInFloatAndIntegersWrap) {
  // 1 x 4096 ones times 4096 x 1 ones: 4096 in f32, then exactly representable in f16.
  Tensor a = Tensor::full({1, 4096}, DType::F16, 1);
  Tensor b = Tensor::full({4096, 1}, DType::F16, 1);
  EXPECT_EQ(matmul(a, b).item<float>(), 4096.f);
  Tensor i = Tensor::full({1, 2}, DType::I8, 100);
  EXPECT_EQ(matmul(i, Tensor::full({2, 1}, DType::I8, 2)).item<int>(),
            static_cast<int8_t>(400 - 512));
  const int64_t big = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(matmul(Tensor::full({1, 1}, DType::I64, 1), Tensor::from_vector<int64_t>({big}, {1, 1}))
                .item<int64_t>(),
            big);
}

TEST(Matmul, Errors) {
  Tensor a = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_EQ(error_of<ShapeError>([&] {
              matmul(a, Tensor::zeros({4, 5}, DType::F32));
            }),
            "matmul: shapes [2,3] and [4,5] cannot be multiplied (3 != 4)");
  EXPECT_EQ(error_of<ShapeError>([&] { matmul(a, Tensor::zeros({3}, DType::F32)); }),
            "matmul: expected 2-D tensors, got [2,3] and [3]");
  EXPECT_THROW(matmul(a, Tensor::zeros({3, 2}, DType::F64)), InvalidArgument);
  EXPECT_THROW(matmul(Tensor::zeros({1, 1}, DType::Bool), Tensor::zeros({1, 1}, DType::Bool)),
               InvalidArgument);
  EXPECT_EQ(matmul(Tensor::zeros({2, 0}, DType::F32), Tensor::zeros({0, 3}, DType::F32))
                .to_vector<float>(),
            std::vector<float>(6, 0.f));
  EXPECT_EQ(matmul(Tensor::zeros({0, 2}, DType::F32), a).sizes(), (Shape{0, 3}));
}

TEST(Reductions, SumAndMeanOverDims) {
  Tensor t = Tensor::arange(24, DType::F32).view({2, 3, 4});
  EXPECT_EQ(sum(t, {}, false).dim(), 0);
  EXPECT_EQ(sum(t, {}, false).item<float>(), 276.f);
  EXPECT_EQ(sum(t, {}, true).sizes(), (Shape{1, 1, 1}));
  Tensor s1 = sum(t, {1}, false);
  EXPECT_EQ(s1.sizes(), (Shape{2, 4}));
  EXPECT_EQ(s1.to_vector<float>(), (std::vector<float>{12, 15, 18, 21, 48, 51, 54, 57}));
  EXPECT_EQ(sum(t, {1}, true).sizes(), (Shape{2, 1, 4}));
  Tensor s02 = sum(t, {0, -1}, false);
  EXPECT_EQ(s02.to_vector<float>(), (std::vector<float>{60, 92, 124}));
  EXPECT_EQ(mean(t, {0, 2}, true).sizes(), (Shape{1, 3, 1}));
  EXPECT_EQ(mean(t, {0, 2}, true).to_vector<float>(), (std::vector<float>{7.5f, 11.5f, 15.5f}));
  EXPECT_EQ(sum(t.transpose(0, 2), {0}, false).to_vector<float>(),
            sum(t, {2}, false).transpose(0, 1).contiguous().to_vector<float>());
  EXPECT_EQ(sum(Tensor::arange(5, DType::I32), {0}, false).item<int>(), 10);
  // As torch.sum: integers and bool sum into i64 (no i8 wraparound; bool counts).
  const Tensor s8 = sum(Tensor::full({300}, DType::I8, 1), {}, false);
  EXPECT_EQ(s8.dtype(), DType::I64);
  EXPECT_EQ(s8.item<int64_t>(), 300);
  EXPECT_EQ(sum(Tensor::full({2}, DType::I32, 2147483647), {}, false).item<int64_t>(),
            int64_t{4294967294});
  const Tensor sb = sum(Tensor::from_vector<bool>({true, false, true, true}), {}, false);
  EXPECT_EQ(sb.dtype(), DType::I64);
  EXPECT_EQ(sb.item<int64_t>(), 3);
  EXPECT_TRUE(std::isnan(mean(Tensor::zeros({0}, DType::F32), {}, false).item<float>()));
  EXPECT_EQ(sum(Tensor::zeros({0, 3}, DType::F32), {0}, false).to_vector<float>(),
            std::vector<float>(3, 0.f));
  EXPECT_EQ(sum(Tensor::full({}, DType::F32, 4), {0}, false).item<float>(), 4.f);
}

TEST(Reductions, HalfSumAccumulatesInFloat) {
  EXPECT_EQ(sum(Tensor::full({4096}, DType::F16, 1), {}, false).item<float>(), 4096.f);
  EXPECT_EQ(sum(Tensor::full({1024}, DType::BF16, 1), {}, false).item<float>(), 1024.f);
  EXPECT_EQ(mean(Tensor::full({4096}, DType::F16, 1), {}, false).item<float>(), 1.f);
}

TEST(Reductions, Errors) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_EQ(error_of<InvalidArgument>([&] {
              sum(t, {1, -1}, false);
            }),
            "sum: dim 1 appears more than once in [1,-1]");
  EXPECT_EQ(error_of<ShapeError>([&] { sum(t, {2}, false); }),
            "sum: dim 2 is out of range for a tensor of rank 2");
  // A 0-d tensor takes dim 0 / -1 once, as PyTorch ("dim 0 appears multiple times").
  const Tensor scalar = Tensor::full({}, DType::F32, 3);
  EXPECT_EQ(sum(scalar, {-1}, true).item<float>(), 3.f);
  EXPECT_EQ(error_of<InvalidArgument>([&] { sum(scalar, {0, -1}, false); }),
            "sum: dim 0 appears more than once in [0,-1]");
  EXPECT_EQ(error_of<InvalidArgument>([&] { mean(scalar, {0, 0}, true); }),
            "mean: dim 0 appears more than once in [0,0]");
  EXPECT_EQ(error_of<InvalidArgument>([] { mean(Tensor::zeros({2}, DType::I32), {}, false); }),
            "mean: expected a floating dtype, got i32");
}

TEST(Loss, MseLoss) {
  Tensor a = Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2});
  Tensor b = Tensor::from_vector<float>({1, 0, 1, 4}, {2, 2});
  Tensor l = mse_loss(a, b);
  EXPECT_EQ(l.dim(), 0);
  EXPECT_EQ(l.dtype(), DType::F32);
  EXPECT_EQ(l.item<float>(), 2.f);
  EXPECT_EQ(mse_loss(a.to(DType::BF16), b.to(DType::BF16)).item<float>(), 2.f);
  EXPECT_EQ(mse_loss(a.transpose(0, 1), b.transpose(0, 1)).item<float>(), 2.f);
  EXPECT_THROW(mse_loss(a, b.view({4})), ShapeError);
  EXPECT_THROW(mse_loss(a.to(DType::I32), b.to(DType::I32)), InvalidArgument);
}

TEST(Broadcast, ExpandTo) {
  Tensor row = Tensor::from_vector<float>({1, 2, 3});
  Tensor e = expand_to(row, {2, 3});
  EXPECT_EQ(e.to_vector<float>(), (std::vector<float>{1, 2, 3, 1, 2, 3}));
  EXPECT_TRUE(e.is_contiguous());
  Tensor col = Tensor::from_vector<float>({1, 2}, {2, 1});
  EXPECT_EQ(expand_to(col, {2, 3}).to_vector<float>(), (std::vector<float>{1, 1, 1, 2, 2, 2}));
  EXPECT_EQ(expand_to(Tensor::full({}, DType::F32, 5), {2}).to_vector<float>(),
            (std::vector<float>{5, 5}));
  Tensor same = expand_to(row, {3});
  EXPECT_FALSE(same.shares_storage(row));
  EXPECT_EQ(error_of<ShapeError>([&] {
              expand_to(row, {4, 2});
            }),
            "expand_to: cannot broadcast [3] to [4,2]");
  EXPECT_THROW(expand_to(Tensor::zeros({2, 3}, DType::F32), {3}), ShapeError);
}

}  // namespace
}  // namespace funcol

// The scratch of an integer sum (an accumulator per output element) and of an integer matmul (a
// 64-bit accumulator per output element, 8 times an i8 output) is allocated as funcol::Error
// promises too: under an address-space limit just above what the output needs, both threw a
// bare std::bad_alloc. In a child process (the limit would starve the other tests).
TEST(KernelsDeathTest, ScratchOutOfMemoryIsAnError) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers reserve far more address space than the limit this test sets";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto under_limit = [](auto fn) {
    long pages = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    const rlim_t cap = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) +
                       (rlim_t{400} << 20);
    const rlimit limit{cap, cap};
    if (pages == 0 || setrlimit(RLIMIT_AS, &limit) != 0) _exit(3);
    try {
      fn();
    } catch (const funcol::Error& e) {
      std::fprintf(stderr, "%s\n", e.what());
      _exit(0);
    } catch (...) {
      _exit(1);
    }
    _exit(2);
  };
  using funcol::DType;
  using funcol::Tensor;
  // 32 MiB of i8 in, a 256 MiB i64 sum out, 256 MiB of accumulators.
  EXPECT_EXIT(under_limit([] {
                funcol::sum(Tensor::zeros({int64_t{32} << 20, 1}, DType::I8), {1}, false);
              }),
              ::testing::ExitedWithCode(0), "out of memory: cannot allocate");
  // A 64 MiB i8 product, 512 MiB of accumulators.
  EXPECT_EXIT(under_limit([] {
                funcol::matmul(Tensor::zeros({16, 1}, DType::I8),
                               Tensor::zeros({1, int64_t{4} << 20}, DType::I8));
              }),
              ::testing::ExitedWithCode(0), "out of memory: cannot allocate");
}
