// The shared conformance suite: exact checks of every collective over a launcher's ranks.
#include "testing/conformance.h"

#include <gtest/gtest.h>

#include <Eigen/Core>
#include <fmt/format.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "funcol/core/dtype.h"
#include "funcol/core/error.h"
#include "funcol/core/tensor.h"
#include "funcol/dist/device_mesh.h"
#include "funcol/dist/process_group.h"
#include "funcol/dist/work.h"

namespace funcol::testing {

namespace {

#ifdef FUNCOL_SANITIZED
// Sanitized builds: still many chunks per collective (512 KiB of f32), a fifth of the work.
constexpr int64_t kLarge = int64_t{1} << 17;
#else
constexpr int64_t kLarge = int64_t{1} << 20;
#endif
const std::vector<int64_t> kSmallCounts = {0, 1, 7, 1000};
// Every input pattern below is periodic in the element index with a period dividing this
// (lcm of 1..9 and 16), so expected values are computed once per period.
constexpr int64_t kPeriod = 5040;

constexpr ReduceOp kAllOps[] = {ReduceOp::Sum, ReduceOp::Avg,  ReduceOp::Product, ReduceOp::Min,
                                ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr,     ReduceOp::BXor};

bool bitwise(ReduceOp op) {
  return op == ReduceOp::BAnd || op == ReduceOp::BOr || op == ReduceOp::BXor;
}

// Valid reduce ops of a dtype: bitwise ops need integer or bool; avg is not defined on bool.
std::vector<ReduceOp> valid_ops(DType dtype) {
  std::vector<ReduceOp> ops;
  for (ReduceOp op : kAllOps) {
    if (bitwise(op) && is_floating(dtype)) continue;
    if (op == ReduceOp::Avg && dtype == DType::Bool) continue;
    ops.push_back(op);
  }
  return ops;
}

// Rank r's input element at (global) index i for a reduction, chosen so the result is exact in
// every dtype: |sums| <= 40 (exact in bf16, fits i8), products in {1, 2, 4} up to sign, avg
// inputs whose sum is a multiple of the world size.
double reduce_input(DType dtype, ReduceOp op, int n, int r, int64_t i) {
  const bool is_bool = dtype == DType::Bool;
  const bool is_unsigned = dtype == DType::U8;
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Min:
    case ReduceOp::Max:
      if (is_bool) return (i + r) % 3 == 0;
      if (is_unsigned) return static_cast<double>((i * 7 + r * 3) % 9);
      return static_cast<double>((i * 7 + r * 3) % 9 - 4);
    case ReduceOp::Product:
      if (is_bool) return (i + r) % 5 != 0;
      if ((i + r) % 4 == 0) return 2;  // at most two ranks of eight: |product| <= 4
      if (!is_unsigned && (i + 2 * r) % 3 == 0) return -1;
      return 1;
    case ReduceOp::Avg:
      // Sums to n * (i % 5 + 1): the average is exact in every dtype, integers included.
      return static_cast<double>(i % 5 + ((r + i) % n == 0 ? n : 0));
    case ReduceOp::BAnd:
    case ReduceOp::BOr:
    case ReduceOp::BXor:
      if (is_bool) return (i * 3 + r) % 2 == 0 || (i + r) % 5 == 0;
      if (is_unsigned) return static_cast<double>((i * 5 + r * 11) % 16);
      return static_cast<double>((i * 5 + r * 11) % 16 - 8);
  }
  return 0;
}

// The reduction of every rank's reduce_input at index i, as the collective must compute it.
double reduce_expected(DType dtype, ReduceOp op, int n, int64_t i) {
  const bool is_bool = dtype == DType::Bool;
  double acc = reduce_input(dtype, op, n, 0, i);
  auto bits = static_cast<int64_t>(acc);
  for (int k = 1; k < n; ++k) {
    double v = reduce_input(dtype, op, n, k, i);
    auto b = static_cast<int64_t>(v);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg: acc += v; break;
      case ReduceOp::Product: acc *= v; break;
      case ReduceOp::Min: acc = std::min(acc, v); break;
      case ReduceOp::Max: acc = std::max(acc, v); break;
      case ReduceOp::BAnd: bits &= b; break;
      case ReduceOp::BOr: bits |= b; break;
      case ReduceOp::BXor: bits ^= b; break;
    }
  }
  if (bitwise(op)) return static_cast<double>(bits);
  if (op == ReduceOp::Avg) return std::trunc(acc / n);  // exact by construction
  if (is_bool) return acc != 0;  // sum = logical or, product = logical and
  return acc;
}

// Period table of reduce_expected.
std::vector<double> expected_table(DType dtype, ReduceOp op, int n) {
  std::vector<double> table(kPeriod);
  for (int64_t i = 0; i < kPeriod; ++i) table[i] = reduce_expected(dtype, op, n, i);
  return table;
}

// Period table of rank r's reduce_input.
std::vector<double> input_table(DType dtype, ReduceOp op, int n, int r) {
  std::vector<double> table(kPeriod);
  for (int64_t i = 0; i < kPeriod; ++i) table[i] = reduce_input(dtype, op, n, r, i);
  return table;
}

// count values of a periodic table starting at global index `start`.
std::vector<double> periodic(const std::vector<double>& table, int64_t start, int64_t count) {
  std::vector<double> out(count);
  int64_t j = start % kPeriod;
  for (int64_t i = 0; i < count; ++i) {
    out[i] = table[j];
    if (++j == kPeriod) j = 0;
  }
  return out;
}

// A value in [0, 50) (exact in every dtype; bool: parity) identifying a position.
double tag(DType dtype, int64_t v) {
  if (dtype == DType::Bool) return v % 2;
  return static_cast<double>(v % 50);
}

Tensor make(const std::vector<double>& values, const Shape& shape, DType dtype) {
  return Tensor::from_vector<double>(values, shape).to(dtype);
}

template <typename T>
double as_double(const void* p, int64_t i) {
  return static_cast<double>(static_cast<const T*>(p)[i]);
}

double element(DType dtype, const void* p, int64_t i) {
  switch (dtype) {
    case DType::Bool: return static_cast<const bool*>(p)[i] ? 1.0 : 0.0;
    case DType::U8: return as_double<uint8_t>(p, i);
    case DType::I8: return as_double<int8_t>(p, i);
    case DType::I16: return as_double<int16_t>(p, i);
    case DType::I32: return as_double<int32_t>(p, i);
    case DType::I64: return as_double<int64_t>(p, i);
    case DType::F16: return static_cast<double>(static_cast<float>(static_cast<const Eigen::half*>(p)[i]));
    case DType::BF16:
      return static_cast<double>(static_cast<float>(static_cast<const Eigen::bfloat16*>(p)[i]));
    case DType::F32: return as_double<float>(p, i);
    case DType::F64: return as_double<double>(p, i);
  }
  return 0;
}

// What a rank is running, for failure messages.
struct Ctx {
  ProcessGroup& pg;
  int n;
  int r;
  std::string where(const std::string& what) const {
    std::ostringstream s;
    s << what << " [world size " << n << ", rank " << r << "]";
    return s.str();
  }
};

[[noreturn]] void fail(const std::string& message) { throw std::runtime_error(message); }

void expect_true(bool cond, const std::string& message) {
  if (!cond) fail(message);
}

std::string case_name(const char* op, DType dtype, const char* extra, int64_t count) {
  std::ostringstream s;
  s << op << "(" << dtype_name(dtype);
  if (extra && *extra) s << ", " << extra;
  s << ", count " << count << ")";
  return s.str();
}

// Large counts (1<<20) for f32: every collective with sum up to 4 ranks (all_reduce at every
// size); every reduce op for all_reduce on 2 and 3 ranks and for reduce_scatter on 2. Reduced:
// sum on the first two world sizes above 1. Full (not reduced) adds every dtype and reduce op on
// every world size, reduce_scatter and all_gather with 1<<20 elements in their larger buffer
// (as nccl-tests sizes them): n x 1<<20 would take minutes at 8 ranks on two cores.
struct LargePolicy {
  bool reduced = false;
  std::vector<int> sizes;
  bool full = false;
  enum Family { kAllReduce, kReduceScatter, kOther };
  bool every() const { return full && !reduced; }
  // Whether to run count 1<<20 of `dtype` with reduce op `op` (Sum for non-reducing ones).
  bool runs(DType dtype, int n, Family family, ReduceOp op = ReduceOp::Sum) const {
    return every() || f32_runs(dtype, n, family, op);
  }
  // Whether the f32 case of count 1<<20 runs (every policy's; reduce_scatter and all_gather
  // run it at n x 1<<20 beside the full policy's 1<<20 in all, which at one rank is the same
  // case and runs once).
  bool f32_runs(DType dtype, int n, Family family, ReduceOp op = ReduceOp::Sum) const {
    return dtype == DType::F32 && allows(n, family, op) && !(every() && n == 1);
  }

 private:
  bool allows(int n, Family family, ReduceOp op) const {
    if (reduced) {
      std::vector<int> above;
      for (int s : sizes) {
        if (s > 1) above.push_back(s);
      }
      bool size_ok = (above.size() > 0 && above[0] == n) || (above.size() > 1 && above[1] == n);
      return size_ok && op == ReduceOp::Sum;
    }
    switch (family) {
      case kAllReduce: return op == ReduceOp::Sum || n == 2 || n == 3;
      case kReduceScatter: return n <= 4 && (op == ReduceOp::Sum || n == 2);
      case kOther: return n <= 4;
    }
    return false;
  }
};

// ---- all_reduce ----

// Integer sums and products wrap around (two's complement, as PyTorch's and funcol's kernels),
// never saturate: Open MPI 4.1's AVX operators saturate i8/u8/i16 sums of 16 bytes or more.
// Avg is the wrapped sum divided once, truncated. 64 elements take the vectorized paths.
void integer_wraparound(Ctx& c) {
  constexpr int64_t kCount = 64;
  struct Case {
    DType dtype;
    int bits;
    bool is_signed;
    int64_t value;  // every rank's value; the sum and product of n ranks overflow
  };
  const Case cases[] = {{DType::I8, 8, true, 100},     {DType::U8, 8, false, 200},
                        {DType::I16, 16, true, 20000}, {DType::I32, 32, true, 2000000000},
                        {DType::I64, 64, true, int64_t{1} << 62}};
  auto wrap = [](uint64_t v, int bits, bool is_signed) -> double {
    if (bits < 64) v &= (uint64_t{1} << bits) - 1;
    if (is_signed && bits < 64 && (v >> (bits - 1)) != 0) {
      return static_cast<double>(static_cast<int64_t>(v) - (int64_t{1} << bits));
    }
    if (is_signed) return static_cast<double>(static_cast<int64_t>(v));
    return static_cast<double>(v);
  };
  for (const Case& k : cases) {
    uint64_t sum = 0, product = 1;
    for (int i = 0; i < c.n; ++i) {
      sum += static_cast<uint64_t>(k.value);
      product *= static_cast<uint64_t>(k.value);
    }
    const double wrapped_sum = wrap(sum, k.bits, k.is_signed);
    const std::pair<ReduceOp, double> expected[] = {
        {ReduceOp::Sum, wrapped_sum},
        {ReduceOp::Product, wrap(product, k.bits, k.is_signed)},
        {ReduceOp::Avg, std::trunc(wrapped_sum / c.n)}};
    for (const auto& [op, value] : expected) {
      if (k.dtype == DType::I64 && op == ReduceOp::Avg) continue;  // not exact in a double
      Tensor t = Tensor::full({kCount}, k.dtype, static_cast<double>(k.value));
      c.pg.all_reduce(t, op)->wait();
      expect_values(t, std::vector<double>(kCount, value),
                    c.where(case_name("all_reduce", k.dtype,
                                      (std::string(reduce_op_name(op)) + " wraps").c_str(),
                                      kCount)));
    }
  }
}

// Float max and min propagate NaN whichever rank holds it (torch.maximum; MPI_MAX keeps an
// operand depending on the order). Rank 0 has NaN at even elements, every other rank at odd.
void nan_propagation(Ctx& c) {
  constexpr int64_t kCount = 64;
  for (DType dtype : {DType::F32, DType::F64, DType::F16, DType::BF16}) {
    for (ReduceOp op : {ReduceOp::Max, ReduceOp::Min}) {
      std::vector<double> in(kCount);
      for (int64_t i = 0; i < kCount; ++i) {
        const bool nan_here = c.r == 0 ? i % 2 == 0 : i % 2 == 1;
        in[i] = nan_here ? std::nan("") : static_cast<double>(i % 7 - c.r);
      }
      Tensor t = make(in, {kCount}, dtype);
      c.pg.all_reduce(t, op)->wait();
      const std::string what = c.where(
          case_name("all_reduce", dtype, (std::string(reduce_op_name(op)) + " nan").c_str(), kCount));
      Tensor out = t.contiguous();
      for (int64_t i = 0; i < kCount; ++i) {
        const bool expect_nan = c.n > 1 || i % 2 == 0;
        const double v = element(dtype, out.const_data_ptr(), i);
        if (std::isnan(v) != expect_nan) {
          fail(what + ": element " + std::to_string(i) + " is " + std::to_string(v) +
               (expect_nan ? ", expected nan" : ", expected a number"));
        }
      }
    }
  }
}

// Float min and max order -0 below +0, so the sign of a zero result does not depend on the
// order a backend combines the ranks in. Element k holds -0 on rank j when bit j of k is set,
// else +0: min is -0 where any rank holds -0, max is +0 where any rank holds +0. all_reduce,
// and reduce_scatter of the pattern repeated once per rank (every block is the pattern).
void signed_zeros(Ctx& c) {
  const int64_t count = int64_t{1} << std::min(c.n, 8);
  const int64_t all = count - 1;  // ranks above 8 hold +0
  for (DType dtype : {DType::F32, DType::F64, DType::F16, DType::BF16}) {
    for (ReduceOp op : {ReduceOp::Min, ReduceOp::Max}) {
      std::vector<double> in(count);
      for (int64_t k = 0; k < count; ++k) in[k] = (k >> c.r) & 1 ? -0.0 : 0.0;
      auto check = [&](const char* collective, const Tensor& result) {
        const std::string what = c.where(case_name(
            collective, dtype, (std::string(reduce_op_name(op)) + " signed zeros").c_str(),
            count));
        Tensor out = result.contiguous();
        for (int64_t k = 0; k < count; ++k) {
          const bool any_negative = k != 0;
          const bool any_positive = k != all || c.n > 8;
          const bool negative = op == ReduceOp::Min ? any_negative : !any_positive;
          const double v = element(dtype, out.const_data_ptr(), k);
          if (v != 0 || std::signbit(v) != negative) {
            fail(what + ": element " + std::to_string(k) + " is " +
                 (std::signbit(v) ? "-" : "") + std::to_string(v) + ", expected " +
                 (negative ? "-0" : "+0"));
          }
        }
      };
      Tensor t = make(in, {count}, dtype);
      c.pg.all_reduce(t, op)->wait();
      check("all_reduce", t);
      std::vector<double> repeated;
      for (int i = 0; i < c.n; ++i) repeated.insert(repeated.end(), in.begin(), in.end());
      Tensor scattered = Tensor::empty({count}, dtype);
      c.pg.reduce_scatter(scattered, make(repeated, {count * c.n}, dtype), op)->wait();
      check("reduce_scatter", scattered);
    }
  }
}

// The value of `x` rounded once to f16 or bf16.
double round_to(DType dtype, double x) {
  const auto f = static_cast<float>(x);
  return dtype == DType::F16 ? static_cast<float>(Eigen::half(f))
                             : static_cast<float>(Eigen::bfloat16(f));
}

// f16/bf16 sums, averages and products accumulate in f32 and round once on every backend (MPI
// and Gloo combine two buffers at a time: rounding each partial result overflowed an f16 avg of
// 60000 to inf and made 2048 + 1 + 1 in f16 2048). The ranks' values (exact in the dtype):
// rank 0 `first`, every other rank `rest`; all_reduce, all_reduce_coalesced and reduce_scatter.
void low_precision_accumulation(Ctx& c) {
  constexpr int64_t kCount = 64;
  struct Case {
    DType dtype;
    ReduceOp op;
    double first, rest;
  };
  const Case cases[] = {{DType::F16, ReduceOp::Avg, 60000, 60000},
                        {DType::F16, ReduceOp::Sum, 2048, 1},
                        {DType::BF16, ReduceOp::Sum, 256, 1},
                        {DType::F16, ReduceOp::Product, 1.0 / 256, 256}};
  for (const Case& k : cases) {
    double exact = k.first;  // in f32 as the kernels accumulate, then rounded once
    for (int i = 1; i < c.n; ++i) {
      exact = k.op == ReduceOp::Product ? static_cast<float>(exact * k.rest)
                                        : static_cast<float>(exact + k.rest);
    }
    if (k.op == ReduceOp::Avg) exact = static_cast<float>(static_cast<float>(exact) / c.n);
    const std::vector<double> expected(kCount, round_to(k.dtype, exact));
    const double mine = c.r == 0 ? k.first : k.rest;
    const std::string label = std::string(reduce_op_name(k.op)) + " rounds once";
    Tensor t = Tensor::full({kCount}, k.dtype, mine);
    c.pg.all_reduce(t, k.op)->wait();
    expect_values(t, expected, c.where(case_name("all_reduce", k.dtype, label.c_str(), kCount)));
    std::vector<Tensor> list = {Tensor::full({kCount}, k.dtype, mine),
                                Tensor::full({3}, k.dtype, mine)};
    c.pg.all_reduce_coalesced(list, k.op)->wait();
    expect_values(list[0], expected,
                  c.where(case_name("all_reduce_coalesced", k.dtype, label.c_str(), kCount)));
    expect_values(list[1], std::vector<double>(3, expected[0]),
                  c.where(case_name("all_reduce_coalesced", k.dtype, label.c_str(), 3)));
    Tensor input = Tensor::full({kCount * c.n}, k.dtype, mine);
    Tensor output = Tensor::empty({kCount}, k.dtype);
    c.pg.reduce_scatter(output, input, k.op)->wait();
    expect_values(output, expected,
                  c.where(case_name("reduce_scatter", k.dtype, label.c_str(), kCount)));
  }
}


// f16/bf16 sums and averages in flight among other collectives, waited only at the end, in
// reverse order. On mpi each is an all-to-all, then an all-gather posted once the all-to-all
// completed: every rank must post both before anything issued after them (MPI pairs a
// communicator's collectives by posting order; small ones are one all-gather). Counts from 1
// up; every eighth is large (two steps there, in uneven blocks: 300001 elements).
void low_precision_in_flight(Ctx& c) {
  constexpr int kOps = 24;
  const int n = c.n;
  std::vector<Tensor> halves, maxima, gathered;
  std::vector<std::vector<Tensor>> lists;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < kOps; ++i) {
    const int64_t count = i % 8 == 0 ? 300001 : (i * 37) % 101 + 1;
    halves.push_back(Tensor::full({count}, i % 2 ? DType::BF16 : DType::F16, i + c.r));
    works.push_back(c.pg.all_reduce(halves.back(), ReduceOp::Sum));
    maxima.push_back(Tensor::full({5}, DType::F32, i * c.r));
    works.push_back(c.pg.all_reduce(maxima.back(), ReduceOp::Max));
    gathered.push_back(Tensor::empty({2 * n}, DType::I32));
    works.push_back(c.pg.all_gather(gathered.back(), Tensor::full({2}, DType::I32, i * n + c.r)));
    if (i % 4 == 0) {
      lists.push_back({Tensor::full({3}, DType::F16, c.r), Tensor::full({2}, DType::F32, c.r)});
      works.push_back(c.pg.all_reduce_coalesced(lists.back(), ReduceOp::Avg));
    }
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  for (int i = 0; i < kOps; ++i) {
    const std::string what = c.where("in flight #" + std::to_string(i));
    const int64_t count = halves[i].numel();
    expect_values(halves[i], std::vector<double>(count, n * i + n * (n - 1) / 2.0),
                  what + ": f16/bf16 sum");
    expect_values(maxima[i], std::vector<double>(5, i * (n - 1)), what + ": f32 max");
    std::vector<double> blocks;
    for (int r = 0; r < n; ++r) blocks.insert(blocks.end(), 2, i * n + r);
    expect_values(gathered[i], blocks, what + ": all_gather");
  }
  for (const auto& list : lists) {
    expect_values(list[0], std::vector<double>(3, (n - 1) / 2.0), c.where("in flight: f16 avg"));
    expect_values(list[1], std::vector<double>(2, (n - 1) / 2.0), c.where("in flight: f32 avg"));
  }
}

// Floating sums add in rank order on every backend: 2^24 (f32; 2^53 for f64) from rank 0 and 1
// from every other rank stays 2^24, each 1 lost in turn (the 1s added first would make 2^24 + 4
// on 4 ranks). all_reduce small (one all-gather on mpi and gloo) and large (two steps there),
// and reduce_scatter.
void float_sums_in_rank_order(Ctx& c) {
  for (DType dtype : {DType::F32, DType::F64}) {
    const double big = dtype == DType::F32 ? 16777216.0 : 9007199254740992.0;
    const double mine = c.r == 0 ? big : 1.0;
    double want = big;
    for (int k = 1; k < c.n; ++k) {
      want = dtype == DType::F32 ? static_cast<float>(static_cast<float>(want) + 1.0f)
                                 : want + 1.0;
    }
    for (int64_t count : {int64_t{3}, int64_t{300001}}) {
      Tensor t = Tensor::full({count}, dtype, mine);
      c.pg.all_reduce(t, ReduceOp::Sum)->wait();
      expect_values(t, std::vector<double>(count, want),
                    c.where(case_name("all_reduce", dtype, "sum in rank order", count)));
    }
    Tensor sum = Tensor::empty({3}, dtype);
    c.pg.reduce_scatter(sum, Tensor::full({3 * c.n}, dtype, mine), ReduceOp::Sum)->wait();
    expect_values(sum, std::vector<double>(3, want),
                  c.where(case_name("reduce_scatter", dtype, "sum in rank order", 3)));
  }
}

// Large all-reduces of integers and of min, max and the bitwise ops (mpi and gloo reduce them
// as a reduce-scatter and an all-gather, like the floating sums): i32 sums wrap, i64 xor of a
// bit per rank, u8 max, bool or.
void large_exact_all_reduces(Ctx& c) {
  constexpr int64_t kCount = 300001;  // more than 1 MiB gathered in every case
  struct Case {
    DType dtype;
    ReduceOp op;
    double mine, want;
  };
  const int n = c.n;
  const Case cases[] = {
      {DType::I32, ReduceOp::Sum, c.r == 0 ? 2147483647.0 : 1.0,
       static_cast<double>(static_cast<int32_t>(static_cast<uint32_t>(2147483647u + (n - 1))))},
      {DType::I64, ReduceOp::BXor, static_cast<double>(int64_t{1} << c.r),
       static_cast<double>((int64_t{1} << n) - 1)},
      {DType::U8, ReduceOp::Max, static_cast<double>(c.r), static_cast<double>(n - 1)},
      {DType::Bool, ReduceOp::BOr, c.r == n - 1 ? 1.0 : 0.0, 1.0}};
  for (const Case& k : cases) {
    Tensor t = Tensor::full({kCount}, k.dtype, k.mine);
    c.pg.all_reduce(t, k.op)->wait();
    expect_values(t, std::vector<double>(kCount, k.want),
                  c.where(case_name("all_reduce", k.dtype,
                                    std::string(reduce_op_name(k.op)).c_str(), kCount)));
  }
}

void run_all_reduce(Ctx& c, DType dtype, ReduceOp op, int64_t count) {
  std::string what = c.where(case_name("all_reduce", dtype, std::string(reduce_op_name(op)).c_str(), count));
  Tensor t = make(periodic(input_table(dtype, op, c.n, c.r), 0, count), {count}, dtype);
  auto work = c.pg.all_reduce(t, op);
  if (count % 2 == 1) work->wait();  // odd counts wait explicitly, even ones on first access
  expect_values(t, periodic(expected_table(dtype, op, c.n), 0, count), what);
  expect_true(work->is_completed() && t.is_ready(), what + ": not ready after reading it");
}

void family_all_reduce(Ctx& c, const LargePolicy& large) {
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : valid_ops(dtype)) {
      for (int64_t count : kSmallCounts) run_all_reduce(c, dtype, op, count);
    }
  }
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : valid_ops(dtype)) {
      if (large.runs(dtype, c.n, LargePolicy::kAllReduce, op)) run_all_reduce(c, dtype, op, kLarge);
    }
  }
  // Reference scenario: all_reduce(full(10x10, rank), avg) = mean of the ranks.
  Tensor t = Tensor::full({10, 10}, DType::F32, c.r);
  c.pg.all_reduce(t, ReduceOp::Avg)->wait();
  expect_values(t, std::vector<double>(100, (c.n - 1) / 2.0), c.where("all_reduce(full(rank), avg)"));
  // Integer avg truncates toward zero (the sum, then one division).
  Tensor neg = Tensor::full({3}, DType::I32, -c.r);
  c.pg.all_reduce(neg, ReduceOp::Avg)->wait();
  double sum = -(c.n * (c.n - 1) / 2.0);
  expect_values(neg, std::vector<double>(3, std::trunc(sum / c.n)),
                c.where("all_reduce(i32 full(-rank), avg) truncates toward zero"));
  integer_wraparound(c);
  nan_propagation(c);
  signed_zeros(c);
  low_precision_accumulation(c);
  low_precision_in_flight(c);
  float_sums_in_rank_order(c);
  large_exact_all_reduces(c);
}

// ---- reduce_scatter ----

void run_reduce_scatter(Ctx& c, DType dtype, ReduceOp op, int64_t count) {
  std::string what =
      c.where(case_name("reduce_scatter", dtype, std::string(reduce_op_name(op)).c_str(), count));
  std::vector<double> in = periodic(input_table(dtype, op, c.n, c.r), 0, count * c.n);
  Tensor input = make(in, {count * c.n}, dtype);
  Tensor output = Tensor::empty({count}, dtype);
  c.pg.reduce_scatter(output, input, op);
  expect_values(output, periodic(expected_table(dtype, op, c.n), c.r * count, count), what);
  expect_values(input, in, what + " left its input unchanged");
}

void family_reduce_scatter(Ctx& c, const LargePolicy& large) {
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : valid_ops(dtype)) {
      for (int64_t count : kSmallCounts) run_reduce_scatter(c, dtype, op, count);
    }
  }
  for (DType dtype : kAllDTypes) {
    for (ReduceOp op : valid_ops(dtype)) {
      if (large.every()) run_reduce_scatter(c, dtype, op, kLarge / c.n);
      if (large.f32_runs(dtype, c.n, LargePolicy::kReduceScatter, op)) {
        run_reduce_scatter(c, dtype, op, kLarge);
      }
    }
  }
  // Reference scenario: reduce_scatter(tensor(ranks), avg) gives rank r the value r.
  std::vector<double> ranks(c.n);
  for (int k = 0; k < c.n; ++k) ranks[k] = k;
  Tensor in = make(ranks, {c.n}, DType::F32);
  Tensor out = Tensor::empty({1}, DType::F32);
  c.pg.reduce_scatter(out, in, ReduceOp::Avg);
  expect_values(out, {static_cast<double>(c.r)}, c.where("reduce_scatter(tensor(ranks), avg)"));
}

// ---- all_gather ----

void run_all_gather(Ctx& c, DType dtype, int64_t count) {
  std::string what = c.where(case_name("all_gather", dtype, "", count));
  std::vector<double> in(count);
  for (int64_t i = 0; i < count; ++i) in[i] = tag(dtype, c.r * 7 + i);
  Tensor input = make(in, {count}, dtype);
  Tensor output = Tensor::empty({count * c.n}, dtype);
  c.pg.all_gather(output, input);
  std::vector<double> expected(count * c.n);
  for (int j = 0; j < c.n; ++j) {
    for (int64_t i = 0; i < count; ++i) expected[j * count + i] = tag(dtype, j * 7 + i);
  }
  expect_values(output, expected, what);
}

void family_all_gather(Ctx& c, const LargePolicy& large) {
  for (DType dtype : kAllDTypes) {
    for (int64_t count : kSmallCounts) run_all_gather(c, dtype, count);
  }
  for (DType dtype : kAllDTypes) {
    if (large.every()) run_all_gather(c, dtype, kLarge / c.n);
    if (large.f32_runs(dtype, c.n, LargePolicy::kOther)) run_all_gather(c, dtype, kLarge);
  }
  // In place: the input is this rank's block of the output.
  Tensor out = Tensor::zeros({c.n, 5}, DType::I64);
  Tensor mine = out.select(0, c.r);
  mine.fill_(c.r + 1);
  c.pg.all_gather(out, mine);
  std::vector<double> expected;
  for (int j = 0; j < c.n; ++j) expected.insert(expected.end(), 5, j + 1);
  expect_values(out, expected, c.where("all_gather in place (input is a view of the output)"));
}

// ---- all_to_all ----

// Rank `src`'s rows for rank `dst`: row e holds tag(src*7 + dst*3 + e) in each of its elements.
void run_all_to_all(Ctx& c, DType dtype, const std::vector<std::vector<int64_t>>& sends,
                    int64_t row, bool explicit_splits, const std::string& label) {
  const int n = c.n;
  std::string what = c.where("all_to_all(" + std::string(dtype_name(dtype)) + ", " + label + ")");
  std::vector<int64_t> in_splits(n), out_splits(n);
  int64_t in_rows = 0, out_rows = 0;
  for (int j = 0; j < n; ++j) {
    in_splits[j] = sends[c.r][j];
    out_splits[j] = sends[j][c.r];
    in_rows += in_splits[j];
    out_rows += out_splits[j];
  }
  std::vector<double> in;
  in.reserve(in_rows * row);
  for (int j = 0; j < n; ++j) {
    for (int64_t e = 0; e < in_splits[j]; ++e) in.insert(in.end(), row, tag(dtype, c.r * 7 + j * 3 + e));
  }
  Tensor input = make(in, {in_rows, row}, dtype);
  Tensor output = Tensor::empty({out_rows, row}, dtype);
  if (explicit_splits) {
    c.pg.all_to_all(output, input, out_splits, in_splits);
  } else {
    c.pg.all_to_all(output, input, {}, {});
  }
  std::vector<double> expected;
  expected.reserve(out_rows * row);
  for (int j = 0; j < n; ++j) {
    for (int64_t e = 0; e < out_splits[j]; ++e) {
      expected.insert(expected.end(), row, tag(dtype, j * 7 + c.r * 3 + e));
    }
  }
  expect_values(output, expected, what);
}

void family_all_to_all(Ctx& c, const LargePolicy& large) {
  const int n = c.n;
  auto even = [&](int64_t rows) {
    return std::vector<std::vector<int64_t>>(n, std::vector<int64_t>(n, rows));
  };
  for (DType dtype : kAllDTypes) {
    for (int64_t count : kSmallCounts) {
      // count rows to every peer, 1-D (even split with and without explicit splits).
      run_all_to_all(c, dtype, even(count), 1, count % 2 == 0, "even, rows " + std::to_string(count));
    }
  }
  for (DType dtype : kAllDTypes) {
    if (large.runs(dtype, n, LargePolicy::kOther)) {
      run_all_to_all(c, dtype, even(kLarge / n), 1, true, "even, rows 1<<20 / n");
    }
  }
  // Uneven splits with zeros, rows of 3 elements: rank i sends (i + j) % 3 rows to j.
  std::vector<std::vector<int64_t>> uneven(n, std::vector<int64_t>(n));
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) uneven[i][j] = (i + j) % 3;
  }
  for (DType dtype : {DType::F32, DType::I8, DType::Bool, DType::BF16}) {
    run_all_to_all(c, dtype, uneven, 3, true, "uneven splits with zeros");
  }
  // Reference scenario: a random send-size matrix (same seed on every rank).
  std::mt19937 rng(1234 + n);
  std::uniform_int_distribution<int> dist(0, 9);
  std::vector<std::vector<int64_t>> random(n, std::vector<int64_t>(n));
  for (auto& row : random) {
    for (auto& v : row) v = dist(rng);
  }
  run_all_to_all(c, DType::F32, random, 2, true, "random split matrix");
  // Everything to rank 0 (one big block, the rest empty).
  std::vector<std::vector<int64_t>> to_zero(n, std::vector<int64_t>(n, 0));
  for (int i = 0; i < n; ++i) to_zero[i][0] = 1000;
  run_all_to_all(c, DType::I32, to_zero, 1, true, "all rows to rank 0");
  // Reference scenario: an n x n input of rank+1, even split: block j of the output is j+1.
  Tensor input = Tensor::full({n, n}, DType::F32, c.r + 1);
  Tensor output = Tensor::empty({n, n}, DType::F32);
  c.pg.all_to_all(output, input, {}, {});
  std::vector<double> expected;
  for (int j = 0; j < n; ++j) expected.insert(expected.end(), n, j + 1);
  expect_values(output, expected, c.where("all_to_all(full(rank + 1)) even split"));
  // Rank 0 sends itself 3 rows but expects 1 from itself; every pair of ranks agrees. As for two
  // ranks at odds, rank 0's Work fails with a CommError naming the rows (not a synchronous
  // error that would leave its peers waiting); the peers fail with it where they can see it
  // (threads; process backends with FUNCOL_DEBUG=detail) and complete otherwise.
  {
    std::vector<int64_t> in_splits(n, 1), out_splits(n, 1);
    if (c.r == 0) in_splits[0] = 3;
    Tensor in = Tensor::zeros({c.r == 0 ? n + 2 : n, 2}, DType::I32);
    Tensor out = Tensor::zeros({n, 2}, DType::I32);
    const std::string g = std::to_string(c.pg.global_ranks()[0]);
    const std::string want = "mismatched split sizes: rank " + g + " sends 3 rows to rank " + g +
                             " but rank " + g + " expects 1 row from rank " + g;
    std::string error;
    try {
      c.pg.all_to_all(out, in, out_splits, in_splits)->wait();
    } catch (const CommError& e) {
      error = e.what();
    }
    expect_true(error.find(want) != std::string::npos || (c.r != 0 && error.empty()),
                c.where("all_to_all with rank 0 at odds with itself: " +
                        (error.empty() ? std::string("no error") : error)));
  }
  Tensor after = Tensor::full({2}, DType::I32, 1);
  c.pg.all_reduce(after, ReduceOp::Sum)->wait();
  expect_values(after, std::vector<double>(2, n), c.where("all_reduce after that all_to_all"));
}

// ---- broadcast ----

void run_broadcast(Ctx& c, DType dtype, int64_t count, int root) {
  std::string what =
      c.where(case_name("broadcast", dtype, ("src " + std::to_string(root)).c_str(), count));
  std::vector<double> in(count);
  for (int64_t i = 0; i < count; ++i) in[i] = tag(dtype, c.r * 11 + i);
  Tensor t = make(in, {count}, dtype);
  c.pg.broadcast(t, root);
  std::vector<double> expected(count);
  for (int64_t i = 0; i < count; ++i) expected[i] = tag(dtype, root * 11 + i);
  expect_values(t, expected, what);
}

void family_broadcast(Ctx& c, const LargePolicy& large) {
  for (DType dtype : kAllDTypes) {
    for (int64_t count : kSmallCounts) {
      for (int root = 0; root < c.n; ++root) {
        if (count == 1000 && root != c.n - 1 && root != 0) continue;  // every root at 0, 1, 7
        run_broadcast(c, dtype, count, root);
      }
    }
  }
  for (DType dtype : kAllDTypes) {
    if (large.runs(dtype, c.n, LargePolicy::kOther)) run_broadcast(c, dtype, kLarge, c.n - 1);
  }
  if (c.n >= 2) {
    // Reference scenario: broadcast(full(rank), src=1) is all ones.
    Tensor t = Tensor::full({4}, DType::F32, c.r);
    c.pg.broadcast(t, 1)->wait();
    expect_values(t, std::vector<double>(4, 1), c.where("broadcast(full(rank), src 1)"));
  }
}

// ---- coalesced ----

// into: out of place (all_reduce_coalesced_into) with tensor 1 in place; the other inputs are
// checked intact afterwards.
void run_all_reduce_coalesced(Ctx& c, const std::vector<DType>& dtypes,
                              const std::vector<int64_t>& counts, ReduceOp op, bool into = false) {
  std::vector<Tensor> tensors, outputs;
  std::vector<std::vector<double>> ins;
  for (size_t t = 0; t < dtypes.size(); ++t) {
    std::vector<double> in(counts[t]);
    for (int64_t i = 0; i < counts[t]; ++i) in[i] = reduce_input(dtypes[t], op, c.n, c.r, i + 13 * t);
    tensors.push_back(make(in, {counts[t]}, dtypes[t]));
    outputs.push_back(into && t != 1 ? Tensor::empty({counts[t]}, dtypes[t]) : tensors.back());
    ins.push_back(std::move(in));
  }
  auto work = into ? c.pg.all_reduce_coalesced_into(outputs, tensors, op)
                   : c.pg.all_reduce_coalesced(tensors, op);
  const char* name = into ? "all_reduce_coalesced_into" : "all_reduce_coalesced";
  for (size_t t = 0; t < dtypes.size(); ++t) {
    std::vector<double> expected(counts[t]);
    for (int64_t i = 0; i < counts[t]; ++i) expected[i] = reduce_expected(dtypes[t], op, c.n, i + 13 * t);
    const std::string what =
        "tensor " + std::to_string(t) + ", " + std::string(reduce_op_name(op));
    expect_values(outputs[t], expected, c.where(case_name(name, dtypes[t], what.c_str(), counts[t])));
    if (outputs[t].storage() != tensors[t].storage()) {
      expect_values(tensors[t], ins[t],
                    c.where(case_name(name, dtypes[t], (what + ", input intact").c_str(), counts[t])));
    }
  }
  work->wait();
}

// all_reduce_flat: the inputs (of `counts` elements, one dtype) reduced into one buffer laid
// end to end. With `scatter`, reduce_scatter_flat: input t has counts[t] * n elements, split
// into n blocks, and this rank's output holds, for each input in turn, the reduction of block r
// of every rank's input t. The inputs are checked intact afterwards.
void run_reduce_flat(Ctx& c, DType dtype, const std::vector<int64_t>& counts, ReduceOp op,
                     bool scatter) {
  const char* name = scatter ? "reduce_scatter_flat" : "all_reduce_flat";
  const int64_t blocks = scatter ? c.n : 1;
  auto inputs = std::make_shared<std::vector<Tensor>>();
  std::vector<std::vector<double>> ins;
  int64_t total = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    std::vector<double> in(counts[t] * blocks);
    for (int64_t i = 0; i < counts[t] * blocks; ++i) {
      in[i] = reduce_input(dtype, op, c.n, c.r, i + 13 * t);
    }
    inputs->push_back(make(in, {counts[t] * blocks}, dtype));
    ins.push_back(std::move(in));
    total += counts[t];
  }
  const Tensor output = Tensor::empty({total}, dtype);
  auto work = scatter ? c.pg.reduce_scatter_flat(output, inputs, op)
                      : c.pg.all_reduce_flat(output, inputs, op);
  int64_t off = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    const int64_t first = scatter ? c.r * counts[t] : 0;  // this rank's block
    std::vector<double> expected(counts[t]);
    for (int64_t i = 0; i < counts[t]; ++i) {
      expected[i] = reduce_expected(dtype, op, c.n, first + i + 13 * t);
    }
    const std::string what = "tensor " + std::to_string(t) + ", " + std::string(reduce_op_name(op));
    expect_values(output.narrow(0, off, counts[t]), expected,
                  c.where(case_name(name, dtype, what.c_str(), counts[t])));
    expect_values((*inputs)[t], ins[t],
                  c.where(case_name(name, dtype, (what + ", input intact").c_str(), counts[t])));
    off += counts[t];
  }
  work->wait();
}

// all_gather_flat: each input's stretch of the output holds every rank's input in rank order.
void run_all_gather_flat(Ctx& c, DType dtype, const std::vector<int64_t>& counts) {
  auto inputs = std::make_shared<std::vector<Tensor>>();
  int64_t total = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    std::vector<double> in(counts[t]);
    for (int64_t i = 0; i < counts[t]; ++i) in[i] = tag(dtype, c.r * 7 + i + t);
    inputs->push_back(make(in, {counts[t]}, dtype));
    total += counts[t];
  }
  const Tensor output = Tensor::empty({c.n * total}, dtype);
  c.pg.all_gather_flat(output, inputs);
  int64_t off = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    std::vector<double> expected(counts[t] * c.n);
    for (int j = 0; j < c.n; ++j) {
      for (int64_t i = 0; i < counts[t]; ++i) {
        expected[j * counts[t] + i] = tag(dtype, j * 7 + i + t);
      }
    }
    expect_values(output.narrow(0, off, c.n * counts[t]), expected,
                  c.where(case_name("all_gather_flat", dtype,
                                    ("tensor " + std::to_string(t)).c_str(), counts[t])));
    off += c.n * counts[t];
  }
}

// all_reduce_flat's argument errors, raised on every rank before anything is sent.
void all_reduce_flat_errors(Ctx& c) {
  auto expect_error = [&](auto&& call, const std::string& needle, const std::string& what) {
    try {
      call();
      fail(c.where("all_reduce_flat accepted " + what));
    } catch (const Error& e) {
      expect_true(std::string(e.what()).find(needle) != std::string::npos,
                  c.where("all_reduce_flat, " + what + ": " + e.what()));
    }
  };
  auto list = [](std::vector<Tensor> t) {
    return std::make_shared<const std::vector<Tensor>>(std::move(t));
  };
  const Tensor out = Tensor::zeros({6}, DType::F32);
  expect_error([&] { c.pg.all_reduce_flat(out, nullptr, ReduceOp::Sum); }, "null input list",
               "a null list");
  expect_error([&] {
    c.pg.all_reduce_flat(out, list({Tensor::zeros({5}, DType::F32)}), ReduceOp::Sum);
  }, "the inputs hold 5 elements but the output has 6", "a short output");
  expect_error([&] {
    c.pg.all_reduce_flat(out, list({Tensor::zeros({6}, DType::I32)}), ReduceOp::Sum);
  }, "dtype", "an input of another dtype");
  expect_error([&] {
    c.pg.all_reduce_flat(Tensor::zeros({2, 3}, DType::F32), list({Tensor::zeros({6}, DType::F32)}),
                         ReduceOp::Sum);
  }, "one-dimensional", "a 2-d output");
  expect_error([&] {
    c.pg.all_reduce_flat(out, list({Tensor::zeros({3}, DType::F32), out.narrow(0, 2, 3)}),
                         ReduceOp::Sum);
  }, "input 1 shares bytes with the output", "an input inside the output");
  expect_error([&] {
    c.pg.all_reduce_flat(Tensor::zeros({2}, DType::Bool), list({Tensor::zeros({2}, DType::Bool)}),
                         ReduceOp::Avg);
  }, "avg", "avg of bool");
  // all_gather_flat: size() times the inputs' elements, the same rules otherwise.
  const Tensor gathered = Tensor::zeros({4 * c.n}, DType::F32);
  if (c.n > 1) {
    expect_error([&] {
      c.pg.all_gather_flat(gathered, list({Tensor::zeros({4 * c.n}, DType::F32)}));
    }, "but the output has", "an output of all ranks' inputs for one rank's");
  }
  expect_error([&] {
    c.pg.all_gather_flat(gathered,
                         list({Tensor::zeros({3}, DType::F32), gathered.narrow(0, 0, 1)}));
  }, "input 1 shares bytes with the output", "an input inside the output");
  expect_error([&] { c.pg.all_gather_flat(gathered, nullptr); }, "null input list", "a null list");
  // reduce_scatter_flat: 1/size() of the inputs' elements, each input's a multiple of size().
  const Tensor scattered = Tensor::zeros({4}, DType::F32);
  expect_error([&] {
    c.pg.reduce_scatter_flat(scattered, list({Tensor::zeros({2 * c.n}, DType::F32)}),
                             ReduceOp::Sum);
  }, c.n > 1 ? fmt::format("the inputs hold {} elements (1/{}: 2) but the output has 4", 2 * c.n, c.n)
             : std::string("the inputs hold 2 elements but the output has 4"),
     "an output that is not 1/size() of the inputs");
  if (c.n > 1) {
    expect_error([&] {
      c.pg.reduce_scatter_flat(Tensor::zeros({1}, DType::F32),
                               list({Tensor::zeros({c.n + 1}, DType::F32)}), ReduceOp::Sum);
    }, fmt::format("input 0 has {} elements, not a multiple of the group size {}", c.n + 1, c.n),
       "an input that does not split into size() blocks");
  }
  expect_error([&] {
    c.pg.reduce_scatter_flat(scattered, list({Tensor::zeros({4 * c.n}, DType::I32)}),
                             ReduceOp::Sum);
  }, "dtype", "an input of another dtype");
  const Tensor own = Tensor::zeros({c.n}, DType::F32);
  expect_error([&] { c.pg.reduce_scatter_flat(own, list({own}), ReduceOp::Sum); },
               "input 0 shares bytes with the output", "the output as its own input");
  expect_error([&] {
    c.pg.reduce_scatter_flat(Tensor::zeros({1}, DType::Bool),
                             list({Tensor::zeros({c.n}, DType::Bool)}), ReduceOp::Avg);
  }, "avg", "avg of bool");
  expect_error([&] { c.pg.reduce_scatter_flat(scattered, nullptr, ReduceOp::Sum); },
               "null input list", "a null list");
}

void run_all_gather_coalesced(Ctx& c, const std::vector<DType>& dtypes,
                              const std::vector<int64_t>& counts) {
  std::vector<Tensor> inputs, outputs;
  for (size_t t = 0; t < dtypes.size(); ++t) {
    std::vector<double> in(counts[t]);
    for (int64_t i = 0; i < counts[t]; ++i) in[i] = tag(dtypes[t], c.r * 7 + i + t);
    inputs.push_back(make(in, {counts[t]}, dtypes[t]));
    outputs.push_back(Tensor::empty({counts[t] * c.n}, dtypes[t]));
  }
  c.pg.all_gather_coalesced(outputs, inputs);
  for (size_t t = 0; t < dtypes.size(); ++t) {
    std::vector<double> expected(counts[t] * c.n);
    for (int j = 0; j < c.n; ++j) {
      for (int64_t i = 0; i < counts[t]; ++i) expected[j * counts[t] + i] = tag(dtypes[t], j * 7 + i + t);
    }
    expect_values(outputs[t], expected,
                  c.where(case_name("all_gather_coalesced", dtypes[t],
                                    ("tensor " + std::to_string(t)).c_str(), counts[t])));
  }
}

void run_reduce_scatter_coalesced(Ctx& c, const std::vector<DType>& dtypes,
                                  const std::vector<int64_t>& counts, ReduceOp op) {
  std::vector<Tensor> inputs, outputs;
  for (size_t t = 0; t < dtypes.size(); ++t) {
    std::vector<double> in(counts[t] * c.n);
    for (int64_t i = 0; i < counts[t] * c.n; ++i) in[i] = reduce_input(dtypes[t], op, c.n, c.r, i + 13 * t);
    inputs.push_back(make(in, {counts[t] * c.n}, dtypes[t]));
    outputs.push_back(Tensor::empty({counts[t]}, dtypes[t]));
  }
  c.pg.reduce_scatter_coalesced(outputs, inputs, op);
  for (size_t t = 0; t < dtypes.size(); ++t) {
    std::vector<double> expected(counts[t]);
    for (int64_t i = 0; i < counts[t]; ++i) {
      expected[i] = reduce_expected(dtypes[t], op, c.n, c.r * counts[t] + i + 13 * t);
    }
    expect_values(outputs[t], expected,
                  c.where(case_name("reduce_scatter_coalesced", dtypes[t],
                                    ("tensor " + std::to_string(t) + ", " +
                                     std::string(reduce_op_name(op))).c_str(),
                                    counts[t])));
  }
}

void family_coalesced(Ctx& c, const LargePolicy&) {
  const std::vector<int64_t> counts = {1000, 0, 7, 1};
  for (DType dtype : kAllDTypes) {
    std::vector<DType> same(counts.size(), dtype);
    for (ReduceOp op : valid_ops(dtype)) {
      run_all_reduce_coalesced(c, same, counts, op);
      run_all_reduce_coalesced(c, same, counts, op, /*into=*/true);
      run_reduce_scatter_coalesced(c, same, counts, op);
      run_reduce_flat(c, dtype, {0, 1000, 0, 7, 1}, op, /*scatter=*/false);
      run_reduce_flat(c, dtype, {0, 1000, 0, 7, 1}, op, /*scatter=*/true);
    }
    run_all_gather_flat(c, dtype, {0, 1000, 0, 7, 1});
    if (dtype == DType::F32) {
      // Lists of empty tensors only: nothing to move, but a collective all the same.
      run_reduce_flat(c, dtype, {0, 0}, ReduceOp::Sum, /*scatter=*/false);
      run_reduce_flat(c, dtype, {0, 0}, ReduceOp::Sum, /*scatter=*/true);
      run_all_gather_flat(c, dtype, {0, 0});
    }
    run_all_gather_coalesced(c, same, counts);
  }
  const std::vector<DType> mixed = {DType::F32, DType::I32, DType::BF16, DType::U8, DType::F32};
  const std::vector<int64_t> mixed_counts = {1000, 7, 0, 1, 3};
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Product}) {
    run_all_reduce_coalesced(c, mixed, mixed_counts, op);
    run_all_reduce_coalesced(c, mixed, mixed_counts, op, /*into=*/true);
    run_reduce_scatter_coalesced(c, mixed, mixed_counts, op);
  }
  run_all_gather_coalesced(c, mixed, mixed_counts);
  // Empty lists are valid no-ops: finished at once, without communicating, so one rank may
  // issue them alone and still pair its next collective with its peers'.
  if (c.r == 0) {
    const std::vector<std::shared_ptr<Work>> works = {
        c.pg.all_reduce_coalesced({}, ReduceOp::Sum),
        c.pg.all_reduce_coalesced_into({}, {}, ReduceOp::Sum),
        c.pg.all_gather_coalesced({}, {}),
        c.pg.reduce_scatter_coalesced({}, {}, ReduceOp::Sum),
        c.pg.all_reduce_flat(Tensor::empty({0}, DType::F32),
                             std::make_shared<const std::vector<Tensor>>(), ReduceOp::Sum),
        c.pg.all_gather_flat(Tensor::empty({0}, DType::F32),
                             std::make_shared<const std::vector<Tensor>>()),
        c.pg.reduce_scatter_flat(Tensor::empty({0}, DType::F32),
                                 std::make_shared<const std::vector<Tensor>>(), ReduceOp::Sum)};
    for (const auto& w : works) {
      expect_true(w->is_completed(), c.where("empty " + w->description() + " not finished"));
    }
  }
  Tensor after = Tensor::full({3}, DType::I32, c.r + 1);
  c.pg.all_reduce(after, ReduceOp::Sum)->wait();
  expect_values(after, std::vector<double>(3, c.n * (c.n + 1) / 2.0),
                c.where("all_reduce after rank 0's empty coalesced lists"));
  // Outputs that overlap are refused on every rank before anything is sent.
  const std::vector<Tensor> small = {Tensor::full({2}, DType::F32, 1),
                                     Tensor::full({2}, DType::F32, 2)};
  const std::vector<Tensor> large = {Tensor::full({2 * c.n}, DType::F32, 1),
                                     Tensor::full({2 * c.n}, DType::F32, 2)};
  for (int which = 0; which < 3; ++which) {
    const int64_t len = which == 0 ? 2 * c.n : 2;  // output numel
    Tensor buf = Tensor::zeros({len + 1}, DType::F32);
    const std::vector<Tensor> overlapping = {buf.narrow(0, 0, len), buf.narrow(0, 1, len)};
    try {
      if (which == 0) {
        c.pg.all_gather_coalesced(overlapping, small)->wait();
      } else if (which == 1) {
        c.pg.reduce_scatter_coalesced(overlapping, large, ReduceOp::Sum)->wait();
      } else {
        c.pg.all_reduce_coalesced(overlapping, ReduceOp::Sum)->wait();
      }
      fail(c.where(std::string(which == 0   ? "all_gather_coalesced"
                               : which == 1 ? "reduce_scatter_coalesced"
                                            : "all_reduce_coalesced") +
                   " accepted overlapping outputs"));
    } catch (const InvalidArgument& e) {
      expect_true(std::string(e.what()).find("overlaps") != std::string::npos,
                  c.where(std::string("overlap message: ") + e.what()));
    }
  }
  all_reduce_flat_errors(c);
  // Reference scenario: int64 reduce_scatter_coalesced of ones(n) and ones(n)+1 -> [n], [2n].
  std::vector<Tensor> ins = {Tensor::full({c.n}, DType::I64, 1), Tensor::full({c.n}, DType::I64, 2)};
  std::vector<Tensor> outs = {Tensor::empty({1}, DType::I64), Tensor::empty({1}, DType::I64)};
  c.pg.reduce_scatter_coalesced(outs, ins, ReduceOp::Sum);
  expect_values(outs[0], {static_cast<double>(c.n)}, c.where("reduce_scatter_coalesced(ones)"));
  expect_values(outs[1], {2.0 * c.n}, c.where("reduce_scatter_coalesced(ones + 1)"));
}

// ---- an output over its input ----

// Every single-tensor form takes its output over its input only in its in-place layout (as the
// coalesced forms): anything else is refused on every rank before anything is sent, where the
// backends used to differ (threads raced, gloo garbled all_to_all, mpi copied).
void family_overlap(Ctx& c, const LargePolicy&) {
  const int n = c.n;
  const int other = (c.r + 1) % n;  // a block that is not this rank's (none on one rank)
  auto refused = [&](const std::string& what, const std::function<void()>& issue) {
    try {
      issue();
    } catch (const InvalidArgument& e) {
      expect_true(std::string(e.what()).find(what + ": output overlaps input") == 0,
                  c.where(what + " overlap message: " + e.what()));
      return;
    }
    fail(c.where(what + " accepted an output over its input"));
  };
  if (n > 1) {
    Tensor gathered = Tensor::zeros({2 * n}, DType::I32);
    refused("all_gather", [&] { c.pg.all_gather(gathered, gathered.narrow(0, 2 * other, 2)); });
    Tensor in = Tensor::full({2 * n}, DType::I32, 1);
    refused("reduce_scatter",
            [&] { c.pg.reduce_scatter(in.narrow(0, 2 * other, 2), in, ReduceOp::Sum); });
  }
  Tensor rows = Tensor::full({n, 2}, DType::I32, c.r);
  refused("all_to_all", [&] { c.pg.all_to_all(rows, rows, {}, {}); });
  // The in-place layouts still work: this rank's block of the output, or of the input.
  Tensor out = Tensor::zeros({2 * n}, DType::I32);
  Tensor mine = out.narrow(0, 2 * c.r, 2);
  mine.copy_(Tensor::full({2}, DType::I32, c.r + 1));
  c.pg.all_gather(out, mine)->wait();
  std::vector<double> expected;
  for (int j = 0; j < n; ++j) expected.insert(expected.end(), 2, j + 1);
  expect_values(out, expected, c.where("all_gather in place"));
  Tensor ones = Tensor::full({2 * n}, DType::I32, 1);
  Tensor block = ones.narrow(0, 2 * c.r, 2);
  c.pg.reduce_scatter(block, ones, ReduceOp::Sum)->wait();
  expect_values(block, std::vector<double>(2, n), c.where("reduce_scatter in place"));
}

// ---- barrier ----

void family_barrier(Ctx& c, const LargePolicy&) {
  for (int i = 0; i < 50; ++i) c.pg.barrier();
  auto w = c.pg.barrier_async();
  w->wait();
  expect_true(w->is_completed() && !w->failed(), c.where("barrier_async completed"));
  // A barrier orders collectives around it like any other collective.
  Tensor t = Tensor::full({8}, DType::I32, 1);
  auto a = c.pg.all_reduce(t, ReduceOp::Sum);
  c.pg.barrier();
  expect_true(a->is_completed(), c.where("all_reduce issued before a barrier done after it"));
  expect_values(t, std::vector<double>(8, c.n), c.where("all_reduce before a barrier"));
}

// ---- groups ----

std::vector<int> iota_ranks(int begin, int end) {
  std::vector<int> v;
  for (int i = begin; i < end; ++i) v.push_back(i);
  return v;
}

void family_groups(Ctx& c, const LargePolicy&) {
  const int n = c.n;
  const int me = c.pg.global_ranks()[c.r];
  // new_group over the first half (at least one rank); the others get null.
  std::vector<int> half = iota_ranks(0, std::max(1, n / 2));
  auto g = new_group(c.pg, half);
  bool member = std::find(half.begin(), half.end(), me) != half.end();
  expect_true((g != nullptr) == member, c.where("new_group returns a group exactly to members"));
  if (g) {
    expect_true(g->size() == static_cast<int>(half.size()) && g->global_ranks() == half,
                c.where("new_group ranks"));
    expect_true(c.pg.registry().find(g->name()) == g, c.where("new_group registers the group"));
    Tensor t = Tensor::full({5}, DType::F32, me + 1);
    g->all_reduce(t, ReduceOp::Sum);
    double s = 0;
    for (int r : half) s += r + 1;
    expect_values(t, std::vector<double>(5, s), c.where("all_reduce on new_group"));
  }
  // split_group into even and odd ranks: both halves run concurrently.
  std::vector<int> even, odd;
  for (int r = 0; r < n; ++r) (r % 2 ? odd : even).push_back(r);
  std::vector<std::vector<int>> lists = {even};
  if (!odd.empty()) lists.push_back(odd);
  auto parity = c.pg.split_group(lists, "conformance_parity");
  expect_true(parity != nullptr, c.where("split_group gives every listed rank a group"));
  expect_true(parity->global_ranks() == (me % 2 ? odd : even), c.where("split_group ranks"));
  Tensor gathered = Tensor::empty({parity->size()}, DType::I32);
  parity->all_gather(gathered, Tensor::full({1}, DType::I32, me));
  std::vector<double> expected;
  for (int r : parity->global_ranks()) expected.push_back(r);
  expect_values(gathered, expected, c.where("all_gather on split_group"));
  // A collective on the parent interleaved with the subgroups keeps working.
  Tensor w = Tensor::full({3}, DType::I64, 1);
  c.pg.all_reduce(w, ReduceOp::Sum);
  expect_values(w, std::vector<double>(3, n), c.where("all_reduce on the parent after splits"));
  // Groups are independent: two groups of the same ranks, issued in one order on even ranks and
  // in the other on odd ones, both complete (each group keeps its own order).
  auto first = c.pg.split_group({c.pg.global_ranks()}, "conformance_order_a");
  auto second = c.pg.split_group({c.pg.global_ranks()}, "conformance_order_b");
  constexpr int64_t kBlock = 3000;
  const Tensor mine = Tensor::full({kBlock}, DType::F32, me);
  Tensor in_first = Tensor::empty({n * kBlock}, DType::F32);
  Tensor in_second = Tensor::empty({n * kBlock}, DType::F32);
  std::shared_ptr<Work> done_first, done_second;
  if (me % 2 == 0) {
    done_first = first->all_gather(in_first, mine);
    done_second = second->all_gather(in_second, mine);
  } else {
    done_second = second->all_gather(in_second, mine);
    done_first = first->all_gather(in_first, mine);
  }
  done_second->wait();
  done_first->wait();
  std::vector<double> blocks;
  for (int r : c.pg.global_ranks()) blocks.insert(blocks.end(), kBlock, r);
  expect_values(in_first, blocks, c.where("all_gather on a group issued first on even ranks"));
  expect_values(in_second, blocks, c.where("all_gather on a group issued first on odd ranks"));

  // A 1-D mesh spans the whole group; a 2-D mesh is row-major with one group per dim.
  DeviceMesh line(c.pg, {{"conformance_line", n}});
  expect_true(line.group(0)->global_ranks() == c.pg.global_ranks(), c.where("1-D mesh group"));
  if (n % 2 == 0 && n >= 4) {
    const int rows = n / 2;
    DeviceMesh mesh(c.pg, {{"conformance_dp", rows}, {"conformance_tp", 2}});
    auto dp = mesh.group("conformance_dp");
    auto tp = mesh.group(1);
    // (mesh, 0): ranks with the same tp index, e.g. {0,2}/{1,3} on 2x2; (mesh, 1): {0,1}/{2,3}.
    std::vector<int> want_dp, want_tp = {me - me % 2, me - me % 2 + 1};
    for (int k = 0; k < rows; ++k) want_dp.push_back(k * 2 + me % 2);
    expect_true(dp->global_ranks() == want_dp, c.where("mesh dim 0 ranks"));
    expect_true(tp->global_ranks() == want_tp, c.where("mesh dim 1 ranks"));
    expect_true(mesh.coordinate() == std::vector<int>({me / 2, me % 2}), c.where("mesh coordinate"));
    expect_true(c.pg.registry().find("conformance_tp") == tp, c.where("mesh dims are registered"));
    Tensor ones = Tensor::full({4}, DType::F32, 1);
    tp->all_reduce(ones, ReduceOp::Sum);
    expect_values(ones, std::vector<double>(4, 2), c.where("all_reduce(ones) over (mesh, 1)"));
    Tensor ids = Tensor::full({1}, DType::I32, me);
    dp->all_reduce(ids, ReduceOp::Sum);
    double s = 0;
    for (int r : want_dp) s += r;
    expect_values(ids, {s}, c.where("all_reduce over (mesh, 0)"));
  }
}

// ---- async behaviour ----

void family_async(Ctx& c, const LargePolicy&) {
  const int n = c.n;
  // Many collectives in flight before the first wait, waited in reverse order.
  std::vector<Tensor> ts;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 16; ++i) {
    ts.push_back(Tensor::full({100 + i}, DType::F32, c.r + i));
    works.push_back(c.pg.all_reduce(ts.back(), ReduceOp::Sum));
  }
  for (int i = 15; i >= 0; --i) {
    works[i]->wait();
    expect_values(ts[i], std::vector<double>(100 + i, n * (n - 1) / 2.0 + n * i),
                  c.where("in-flight all_reduce " + std::to_string(i)));
  }
  // A dropped result: the op still completes; the next collective is unaffected.
  {
    Tensor dropped = Tensor::full({1 << 12}, DType::F32, 1);
    c.pg.all_reduce(dropped, ReduceOp::Sum);
  }
  Tensor after = Tensor::full({3}, DType::I32, 2);
  c.pg.all_reduce(after, ReduceOp::Sum);
  expect_values(after, std::vector<double>(3, 2 * n), c.where("all_reduce after a dropped one"));
  // Collectives run in issue order: all_gather reads the pending all_reduce's output.
  Tensor x = Tensor::full({4}, DType::I64, c.r);
  c.pg.all_reduce(x, ReduceOp::Sum);
  Tensor gathered = Tensor::empty({4 * n}, DType::I64);
  c.pg.all_gather(gathered, x);
  expect_values(gathered, std::vector<double>(4 * n, n * (n - 1) / 2.0),
                c.where("all_gather of a pending all_reduce result"));
  // A result read (waited) by another thread.
  Tensor y = Tensor::full({1000}, DType::F64, c.r);
  c.pg.all_reduce(y, ReduceOp::Max);
  std::string error;
  std::thread reader([&] {
    try {
      expect_values(y, std::vector<double>(1000, n - 1), c.where("result read by another thread"));
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  reader.join();
  expect_true(error.empty(), error);
  // Waiting twice is free; the Work stays completed.
  auto w = c.pg.broadcast(y, 0);
  w->wait();
  w->wait();
  expect_true(w->is_completed() && !w->failed(), c.where("Work after two waits"));
}

// ---- stress: a random (same seed on every rank) mix of collectives on overlapping groups,
// many in flight, waited in random order or dropped ----

struct PendingCheck {
  Tensor tensor;
  std::vector<double> expected;
  std::string what;
};

void family_stress(Ctx& c, const LargePolicy&) {
  const int me = c.pg.global_ranks()[c.r];
  std::vector<int> even, odd;
  for (int r : c.pg.global_ranks()) (r % 2 ? odd : even).push_back(r);
  std::vector<std::vector<int>> lists = {even};
  if (!odd.empty()) lists.push_back(odd);
  auto parity = c.pg.split_group(lists, "conformance_stress_parity");
  std::mt19937 rng(77);  // identical on every rank: every rank issues the same sequence
#ifdef FUNCOL_SANITIZED
  const int64_t kCounts[] = {0, 1, 5, 100, 1000, 5000};
  const int kSteps = 40;
#else
  const int64_t kCounts[] = {0, 1, 5, 100, 3000, 20000};  // 20000 f32: 2 chunks
  const int kSteps = 80;
#endif
  std::vector<PendingCheck> pending;
  for (int step = 0; step < kSteps; ++step) {
    ProcessGroup& g = rng() % 2 ? c.pg : *parity;
    const int gn = g.size();
    std::vector<int> members = g.global_ranks();
    const int64_t count = kCounts[rng() % 6];
    const DType dtype = step % 3 == 0 ? DType::I32 : (step % 3 == 1 ? DType::F32 : DType::BF16);
    const int kind = static_cast<int>(rng() % 5);
    const int root = static_cast<int>(rng() % gn);
    const unsigned fate = rng() % 6;  // 0-1: wait now; 2: drop; else: check at the end
    auto value = [&](int rank, int64_t i) { return static_cast<double>((step + rank * 3 + i) % 7); };
    std::string what = c.where("stress step " + std::to_string(step) + " kind " +
                               std::to_string(kind) + " count " + std::to_string(count) +
                               " on group '" + g.name() + "'");
    PendingCheck check;
    check.what = what;
    std::vector<double> in;
    switch (kind) {
      case 0: {  // all_reduce sum
        for (int64_t i = 0; i < count; ++i) in.push_back(value(me, i));
        check.tensor = make(in, {count}, dtype);
        g.all_reduce(check.tensor, ReduceOp::Sum);
        for (int64_t i = 0; i < count; ++i) {
          double s = 0;
          for (int r : members) s += value(r, i);
          check.expected.push_back(s);
        }
        break;
      }
      case 1: {  // all_gather
        for (int64_t i = 0; i < count; ++i) in.push_back(value(me, i));
        check.tensor = Tensor::empty({count * gn}, dtype);
        g.all_gather(check.tensor, make(in, {count}, dtype));
        for (int r : members) {
          for (int64_t i = 0; i < count; ++i) check.expected.push_back(value(r, i));
        }
        break;
      }
      case 2: {  // reduce_scatter sum
        for (int64_t i = 0; i < count * gn; ++i) in.push_back(value(me, i));
        check.tensor = Tensor::empty({count}, dtype);
        g.reduce_scatter(check.tensor, make(in, {count * gn}, dtype), ReduceOp::Sum);
        for (int64_t i = 0; i < count; ++i) {
          double s = 0;
          for (int r : members) s += value(r, g.rank() * count + i);
          check.expected.push_back(s);
        }
        break;
      }
      case 3: {  // broadcast
        for (int64_t i = 0; i < count; ++i) in.push_back(value(me, i));
        check.tensor = make(in, {count}, dtype);
        g.broadcast(check.tensor, root);
        for (int64_t i = 0; i < count; ++i) check.expected.push_back(value(members[root], i));
        break;
      }
      default: {  // all_to_all, even split: block j of rank r's input holds value(r, j)
        for (int j = 0; j < gn; ++j) in.insert(in.end(), count, value(me, j));
        check.tensor = Tensor::empty({count * gn}, dtype);
        g.all_to_all(check.tensor, make(in, {count * gn}, dtype), {}, {});
        for (int j = 0; j < gn; ++j) check.expected.insert(check.expected.end(), count, value(members[j], g.rank()));
        break;
      }
    }
    if (fate < 2) {
      expect_values(check.tensor, check.expected, what);
    } else if (fate > 2) {
      pending.push_back(std::move(check));
    }
  }
  std::shuffle(pending.begin(), pending.end(), rng);
  for (const auto& p : pending) expect_values(p.tensor, p.expected, p.what);
  // Hundreds in flight on two groups before any wait (mpi posts at most 64 of a group's at a
  // time and queues the rest), then checked newest first.
  std::vector<PendingCheck> many;
  for (int i = 0; i < 300; ++i) {
    ProcessGroup& g = i % 50 == 49 ? *parity : c.pg;
    PendingCheck check;
    check.what = c.where("in flight #" + std::to_string(i) + " on group '" + g.name() + "'");
    check.tensor = make({static_cast<double>(me + i), 1, static_cast<double>(i)}, {3}, DType::I64);
    g.all_reduce(check.tensor, ReduceOp::Sum);
    double ranks = 0;
    for (int r : g.global_ranks()) ranks += r + i;
    const double n = g.size();
    check.expected = {ranks, n, n * i};
    many.push_back(std::move(check));
  }
  for (auto it = many.rbegin(); it != many.rend(); ++it) {
    expect_values(it->tensor, it->expected, it->what);
  }
}

using Family = void (*)(Ctx&, const LargePolicy&);

struct FamilyEntry {
  const char* name;
  Family fn;
};

constexpr FamilyEntry kFamilies[] = {
    {"all_reduce", family_all_reduce}, {"reduce_scatter", family_reduce_scatter},
    {"all_gather", family_all_gather}, {"all_to_all", family_all_to_all},
    {"broadcast", family_broadcast},   {"coalesced", family_coalesced},
    {"overlap", family_overlap},       {"barrier", family_barrier},
    {"groups", family_groups},         {"async", family_async},
    {"stress", family_stress},
};

class ConformanceTest : public ::testing::Test {
 public:
  ConformanceTest(Launcher launch, int world_size, Family family, LargePolicy large)
      : launch_(std::move(launch)), world_size_(world_size), family_(family), large_(std::move(large)) {}

  void TestBody() override {
    try {
      launch_(world_size_, [this](ProcessGroup& world) {
        Ctx c{world, world.size(), world.rank()};
        family_(c, large_);
      });
    } catch (const std::exception& e) {
      FAIL() << e.what();
    }
  }

 private:
  Launcher launch_;
  int world_size_;
  Family family_;
  LargePolicy large_;
};

}  // namespace

void expect_values(const Tensor& actual, const std::vector<double>& expected,
                   const std::string& what) {
  if (actual.numel() != static_cast<int64_t>(expected.size())) {
    fail(what + ": numel " + std::to_string(actual.numel()) + ", expected " +
         std::to_string(expected.size()));
  }
  if (expected.empty()) {
    actual.wait();
    return;
  }
  Tensor c = actual.contiguous();
  const void* p = c.const_data_ptr();
  for (size_t i = 0; i < expected.size(); ++i) {
    double v = element(c.dtype(), p, static_cast<int64_t>(i));
    if (v != expected[i]) {
      std::ostringstream s;
      s.precision(17);  // every digit: 2^24 + 2 against 2^24
      s << what << ": element " << i << " is " << v << ", expected " << expected[i];
      fail(s.str());
    }
  }
}

void register_conformance_tests(const ConformanceConfig& config) {
  LargePolicy large{config.reduced, config.world_sizes, config.full_large};
  const std::string suite = "Conformance/" + config.backend;
  for (const FamilyEntry& family : kFamilies) {
    if (!config.families.empty() &&
        std::find(config.families.begin(), config.families.end(), family.name) ==
            config.families.end()) {
      continue;
    }
    for (int n : config.world_sizes) {
      std::string name = std::string(family.name) + "/ws" + std::to_string(n);
      Launcher launch = config.launch;
      Family fn = family.fn;
      ::testing::RegisterTest(suite.c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                              [launch, n, fn, large]() -> ::testing::Test* {
                                return new ConformanceTest(launch, n, fn, large);
                              });
    }
  }
}

}  // namespace funcol::testing
