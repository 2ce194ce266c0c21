// Tests of `funcol bench`'s pieces: flags, nccl-tests conventions, check data, in-process runs.
#include "tools/bench.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <Eigen/Core>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/core/tensor.h"
#include "funcol/dist/backend.h"
#include "tools/launch.h"

namespace funcol::tools {
namespace {

// ---- flag values ----

TEST(BenchParse, SizesTakeOptional1024BasedSuffixes) {
  EXPECT_EQ(parse_size("0", "-b"), 0);
  EXPECT_EQ(parse_size("32", "-b"), 32);
  EXPECT_EQ(parse_size("4K", "-b"), 4096);
  EXPECT_EQ(parse_size("4k", "-b"), 4096);
  EXPECT_EQ(parse_size("64M", "-e"), int64_t{64} << 20);
  EXPECT_EQ(parse_size("16m", "-e"), int64_t{16} << 20);
  EXPECT_EQ(parse_size("2G", "-e"), int64_t{2} << 30);
}

TEST(BenchParse, BadSizesNameTheValueAndTheFlag) {
  for (const char* bad : {"", "4X", "K", "-1", "1.5M", "4KB", " 4", "4 ", "0x10"}) {
    try {
      parse_size(bad, "-b/--minbytes");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()).rfind(
                    std::string("invalid size '") + bad + "' for -b/--minbytes: ", 0),
                0u)
          << e.what();
    }
  }
  EXPECT_THROW(parse_size("99999999999999999999", "-e"), InvalidArgument);
  EXPECT_THROW(parse_size("9000000000G", "-e"), InvalidArgument);
  EXPECT_EQ(parse_size("8589934591G", "-e"), int64_t{8589934591} << 30);  // INT64_MAX >> 30
}

TEST(BenchParse, Integers) {
  EXPECT_EQ(parse_int("20", "-n", 1), 20);
  EXPECT_EQ(parse_int("0", "-w", 0), 0);
  EXPECT_THROW(parse_int("0", "-n/--iters", 1), InvalidArgument);
  EXPECT_THROW(parse_int("-1", "-w", 0), InvalidArgument);
  EXPECT_THROW(parse_int("abc", "-n", 1), InvalidArgument);
  EXPECT_THROW(parse_int("3x", "-n", 1), InvalidArgument);
  EXPECT_THROW(parse_int("", "-n", 1), InvalidArgument);
  EXPECT_THROW(parse_int("99999999999", "-n", 1), InvalidArgument);
  try {
    parse_int("0", "-n/--iters", 1);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'0' for -n/--iters"), std::string::npos) << e.what();
  }
}

TEST(BenchParse, Ops) {
  EXPECT_EQ(parse_bench_ops("all").size(), 5u);
  EXPECT_EQ(parse_bench_ops("all")[0], BenchOp::AllReduce);
  EXPECT_EQ(parse_bench_ops("all")[4], BenchOp::Broadcast);
  for (BenchOp op : kAllBenchOps) {
    ASSERT_EQ(parse_bench_ops(bench_op_name(op)).size(), 1u);
    EXPECT_EQ(parse_bench_ops(bench_op_name(op))[0], op);
  }
  try {
    parse_bench_ops("allreduce");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown op 'allreduce' for -o/--op"), std::string::npos);
  }
}

TEST(BenchParse, DtypesAndReduceOps) {
  EXPECT_EQ(parse_bench_dtype("bf16"), DType::BF16);
  EXPECT_EQ(parse_bench_dtype("bool"), DType::Bool);
  EXPECT_EQ(parse_bench_dtype("float"), DType::F32);
  EXPECT_EQ(parse_bench_dtype("half"), DType::F16);
  try {
    parse_bench_dtype("f8");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'f8'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("bool, u8, i8, i16, i32, i64, f16, bf16, f32, f64"),
              std::string::npos);
  }
  EXPECT_EQ(parse_bench_redop("sum"), ReduceOp::Sum);
  EXPECT_EQ(parse_bench_redop("MAX"), ReduceOp::Max);
  EXPECT_EQ(parse_bench_redop("prod"), ReduceOp::Product);
  EXPECT_EQ(parse_bench_redop("product"), ReduceOp::Product);
  EXPECT_EQ(parse_bench_redop("bxor"), ReduceOp::BXor);
  EXPECT_THROW(parse_bench_redop("mean"), InvalidArgument);
}

// ---- nccl-tests conventions ----

TEST(BenchSizes, SequenceFollowsNcclTests) {
  EXPECT_EQ(size_sequence(4096, 16 << 20, 4, 1 << 20),
            (std::vector<int64_t>{4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20}));
  EXPECT_EQ(size_sequence(32, 32 << 20, 2, 1 << 20).size(), 21u);
  EXPECT_EQ(size_sequence(32, 100, 2, 1), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(size_sequence(64, 64, 2, 1), (std::vector<int64_t>{64}));
  EXPECT_EQ(size_sequence(0, 4, 2, 1), (std::vector<int64_t>{0, 1, 2, 4}));
  EXPECT_EQ(size_sequence(10, 35, 1, 10), (std::vector<int64_t>{10, 20, 30}));
  EXPECT_EQ(size_sequence(0, 0, 2, 1), (std::vector<int64_t>{0}));
  EXPECT_EQ(next_size(30, 35, 1, 10), -1);
  EXPECT_EQ(next_size(0, 35, 2, 1), 1);
  // No overflow near the top of int64.
  const int64_t big = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(size_sequence(big / 2, big, 2, 1).size(), 2u);
  EXPECT_EQ(size_sequence(big / 2 + 1, big, 2, 1).size(), 1u);
  EXPECT_EQ(size_sequence(big - 1, big, 1, 1).size(), 2u);
}

TEST(BenchSizes, CollSizesFollowNcclTests) {
  // all_reduce, broadcast: one buffer of the requested size.
  CollSizes ar = coll_sizes(BenchOp::AllReduce, 4096, 4, 2);
  EXPECT_EQ(ar.count, 1024);
  EXPECT_EQ(ar.in_numel, 1024);
  EXPECT_EQ(ar.out_numel, 1024);
  EXPECT_EQ(ar.size_bytes, 4096);
  CollSizes bc = coll_sizes(BenchOp::Broadcast, 4096, 2, 4);
  EXPECT_EQ(bc.count, 2048);
  EXPECT_EQ(bc.size_bytes, 4096);
  // all_gather: size is the output, count the per-rank input.
  CollSizes ag = coll_sizes(BenchOp::AllGather, 4096, 4, 2);
  EXPECT_EQ(ag.count, 512);
  EXPECT_EQ(ag.in_numel, 512);
  EXPECT_EQ(ag.out_numel, 1024);
  EXPECT_EQ(ag.size_bytes, 4096);
  // reduce_scatter: size is the input, count the per-rank output.
  CollSizes rs = coll_sizes(BenchOp::ReduceScatter, 4096, 4, 4);
  EXPECT_EQ(rs.count, 256);
  EXPECT_EQ(rs.in_numel, 1024);
  EXPECT_EQ(rs.out_numel, 256);
  EXPECT_EQ(rs.size_bytes, 4096);
  // all_to_all: count is per peer.
  CollSizes a2a = coll_sizes(BenchOp::AllToAll, 4096, 4, 4);
  EXPECT_EQ(a2a.count, 256);
  EXPECT_EQ(a2a.in_numel, 1024);
  EXPECT_EQ(a2a.out_numel, 1024);
  EXPECT_EQ(a2a.size_bytes, 4096);
  // Rounded down to a multiple of ranks * itemsize, as nccl-tests: 32 B of f32 on 3 ranks.
  CollSizes odd = coll_sizes(BenchOp::AllGather, 32, 4, 3);
  EXPECT_EQ(odd.count, 2);
  EXPECT_EQ(odd.out_numel, 6);
  EXPECT_EQ(odd.size_bytes, 24);
  CollSizes tiny = coll_sizes(BenchOp::ReduceScatter, 4, 4, 2);
  EXPECT_EQ(tiny.count, 0);
  EXPECT_EQ(tiny.size_bytes, 0);
}

TEST(BenchSizes, BusFactors) {
  EXPECT_DOUBLE_EQ(bus_factor(BenchOp::AllReduce, 2), 1.0);
  EXPECT_DOUBLE_EQ(bus_factor(BenchOp::AllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_factor(BenchOp::AllReduce, 8), 1.75);
  EXPECT_DOUBLE_EQ(bus_factor(BenchOp::AllGather, 2), 0.5);
  EXPECT_DOUBLE_EQ(bus_factor(BenchOp::ReduceScatter, 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_factor(BenchOp::AllToAll, 8), 0.875);
  EXPECT_DOUBLE_EQ(bus_factor(BenchOp::Broadcast, 8), 1.0);
  EXPECT_DOUBLE_EQ(bus_factor(BenchOp::AllReduce, 1), 0.0);
}

// ---- check data ----

template <typename T>
double round_trip(double v) {
  return static_cast<double>(static_cast<float>(T(static_cast<float>(v))));
}

// v converted to dtype and back, to show it is exact.
double through_dtype(DType dtype, double v) {
  switch (dtype) {
    case DType::Bool:
      return v == 0 ? 0 : (v == 1 ? 1 : -1);
    case DType::U8:
      return static_cast<double>(static_cast<uint8_t>(v));
    case DType::I8:
      return static_cast<double>(static_cast<int8_t>(v));
    case DType::I16:
      return static_cast<double>(static_cast<int16_t>(v));
    case DType::I32:
      return static_cast<double>(static_cast<int32_t>(v));
    case DType::I64:
      return static_cast<double>(static_cast<int64_t>(v));
    case DType::F16:
      return round_trip<Eigen::half>(v);
    case DType::BF16:
      return round_trip<Eigen::bfloat16>(v);
    case DType::F32:
      return static_cast<double>(static_cast<float>(v));
    case DType::F64:
      return v;
  }
  return -1;
}

TEST(BenchCheck, ExactLimitIsTheLastExactInteger) {
  EXPECT_EQ(exact_limit(DType::BF16), 256);
  EXPECT_EQ(exact_limit(DType::F16), 2048);
  EXPECT_EQ(exact_limit(DType::I8), 127);
  EXPECT_EQ(exact_limit(DType::Bool), 1);
  for (DType d : {DType::F16, DType::BF16, DType::F32}) {
    const double m = static_cast<double>(exact_limit(d));
    EXPECT_EQ(through_dtype(d, m), m) << dtype_name(d);
    EXPECT_NE(through_dtype(d, m + 1), m + 1) << dtype_name(d);
  }
}

bool bitwise(ReduceOp op) {
  return op == ReduceOp::BAnd || op == ReduceOp::BOr || op == ReduceOp::BXor;
}

// A second, deliberately plain computation of one reduced element (a bool sum is an or).
int64_t reduce_over_ranks(const CheckPattern& p, ReduceOp op, DType dtype, int n, int64_t i) {
  std::vector<int64_t> v;
  for (int r = 0; r < n; ++r) v.push_back(p.input(r, i));
  int64_t acc = v[0];
  for (int r = 1; r < n; ++r) {
    if (op == ReduceOp::Sum && dtype == DType::Bool) acc |= v[r];
    if ((op == ReduceOp::Sum && dtype != DType::Bool) || op == ReduceOp::Avg) acc += v[r];
    if (op == ReduceOp::Product) acc *= v[r];
    if (op == ReduceOp::Min) acc = std::min(acc, v[r]);
    if (op == ReduceOp::Max) acc = std::max(acc, v[r]);
    if (op == ReduceOp::BAnd) acc &= v[r];
    if (op == ReduceOp::BOr) acc |= v[r];
    if (op == ReduceOp::BXor) acc ^= v[r];
  }
  if (op == ReduceOp::Avg) {
    EXPECT_EQ(acc % n, 0);
    acc /= n;
  }
  return acc;
}

TEST(BenchCheck, EveryPatternIsExactAndMatchesAPlainReduction) {
  const ReduceOp redops[] = {ReduceOp::Sum, ReduceOp::Avg,  ReduceOp::Product, ReduceOp::Min,
                             ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr,     ReduceOp::BXor};
  for (DType dtype : kAllDTypes) {
    for (int n : {1, 2, 3, 4, 5, 8, 16}) {
      for (BenchOp op : kAllBenchOps) {
        for (ReduceOp redop : redops) {
          if (bitwise(redop) && is_floating(dtype)) continue;
          if (!has_reduce_op(op) && redop != ReduceOp::Sum) continue;
          SCOPED_TRACE(std::string(bench_op_name(op)) + " " + std::string(dtype_name(dtype)) + " " +
                       std::string(reduce_op_name(redop)) + " n=" + std::to_string(n));
          const int root = n - 1;
          CheckPattern p(op, redop, dtype, n, root);
          const int64_t count = 2 * p.period() + 3;  // not a multiple of the period
          const double m = static_cast<double>(exact_limit(dtype));
          bool varies_by_rank = false;
          for (int r = 0; r < n; ++r) {
            for (int64_t i = 0; i < count; ++i) {  // periodic: one period and a bit is all
              const double x = static_cast<double>(p.input(r, i));
              ASSERT_GE(x, 0);
              ASSERT_LE(x, m);
              ASSERT_EQ(through_dtype(dtype, x), x);
              ASSERT_EQ(p.input(r, i), p.input(r, i + p.period()));
              if (r > 0 && p.input(r, i) != p.input(0, i)) varies_by_rank = true;
            }
          }
          // Inputs depend on the rank whenever the dtype leaves room for more than zeros.
          const bool degenerate = (redop == ReduceOp::Avg || dtype != DType::Bool) &&
                                  (redop == ReduceOp::Sum || redop == ReduceOp::Avg) &&
                                  exact_limit(dtype) / n == 0;
          if (n > 1 && !degenerate) {
            EXPECT_TRUE(varies_by_rank);
          }
          for (int rank : std::vector<int>{0, std::min(1, n - 1), n - 1}) {
            const int64_t out_numel =
                op == BenchOp::AllReduce || op == BenchOp::Broadcast || op == BenchOp::ReduceScatter
                    ? count
                    : n * count;
            for (int64_t j = 0; j < out_numel; ++j) {
              const int64_t e = p.expected(rank, j, count);
              ASSERT_GE(e, 0);
              ASSERT_LE(static_cast<double>(e), m);
              int64_t want = 0;
              switch (op) {
                case BenchOp::AllReduce:
                  want = reduce_over_ranks(p, redop, dtype, n, j);
                  break;
                case BenchOp::ReduceScatter:
                  want = reduce_over_ranks(p, redop, dtype, n, rank * count + j);
                  break;
                case BenchOp::AllGather:
                  want = p.input(j / count, j % count);
                  break;
                case BenchOp::AllToAll:
                  want = p.input(j / count, rank * count + j % count);
                  break;
                case BenchOp::Broadcast:
                  want = p.input(root, j);
                  break;
              }
              ASSERT_EQ(e, want) << "rank " << rank << " j " << j;
            }
            // The check poisons the output before the call, and a non-root rank's broadcast
            // buffer holds its own input: an element the collective leaves unwritten is wrong
            // there, on every dtype (bool has two values: a fixed poison of 1 hid every expected
            // 1, and on 3 ranks rank 0's bool broadcast input equalled root 2's).
            Tensor out = Tensor::empty({out_numel}, dtype);
            p.fill_poison(out, rank, count);
            ASSERT_EQ(p.count_wrong(out, rank, count), out_numel) << "rank " << rank;
            if (op == BenchOp::Broadcast && rank != root) {
              p.fill_input(out, rank);
              ASSERT_EQ(p.count_wrong(out, rank, count), out_numel) << "rank " << rank;
            }
          }
        }
      }
    }
  }
}

// An in-place reduction's check runs twice, the second time with the inputs rotated by one
// rank (fill_input): an element a rank leaves unwritten holds its own input, and goes unseen
// only where both its input and its neighbour's equal the result. Sum, product, min and max
// leave no such element on any dtype but bool, avg one in its modulus (1-7%: all zeros), the
// bitwise ops and bool at most two thirds; bool xor on an odd number of ranks every element
// (its inputs alternate with the rank, and rotating by one keeps a wrapped pair equal).
TEST(BenchCheck, RotatedInputsExposeUnwrittenElements) {
  const ReduceOp redops[] = {ReduceOp::Sum, ReduceOp::Avg,  ReduceOp::Product, ReduceOp::Min,
                             ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr,     ReduceOp::BXor};
  for (DType dtype : kAllDTypes) {
    for (int n : {2, 3, 4, 5, 8}) {
      for (ReduceOp redop : redops) {
        if (bitwise(redop) && is_floating(dtype)) continue;
        if (redop == ReduceOp::Avg && dtype == DType::Bool) continue;  // rejected by validate()
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::string(reduce_op_name(redop)) +
                     " n=" + std::to_string(n));
        CheckPattern p(BenchOp::AllReduce, redop, dtype, n, 0);
        int64_t unseen = 0;
        for (int64_t i = 0; i < p.period(); ++i) {
          const int64_t result = p.expected(0, i, p.period());
          for (int d = 0; d < n; ++d) {
            if (p.input(d, i) == result && p.input((d + 1) % n, i) == result) {
              ++unseen;
              break;
            }
          }
        }
        const double fraction = static_cast<double>(unseen) / static_cast<double>(p.period());
        const bool exact = (redop == ReduceOp::Sum || redop == ReduceOp::Product ||
                            redop == ReduceOp::Min || redop == ReduceOp::Max) &&
                           dtype != DType::Bool;
        if (exact) {
          EXPECT_EQ(unseen, 0);
        } else if (redop == ReduceOp::Avg) {
          EXPECT_LT(fraction, 0.1);
        } else if (!(dtype == DType::Bool && redop == ReduceOp::BXor && n % 2 == 1)) {
          EXPECT_LT(fraction, 0.7);
        }
      }
    }
  }
}

TEST(BenchCheck, HandComputedValues) {
  CheckPattern sum(BenchOp::AllReduce, ReduceOp::Sum, DType::F32, 2, 0);
  EXPECT_EQ(sum.input(0, 0), 0);
  EXPECT_EQ(sum.input(1, 0), 7);
  EXPECT_EQ(sum.expected(0, 0, 16), 7);
  EXPECT_EQ(sum.input(0, 5), 5);
  EXPECT_EQ(sum.input(1, 5), 12);
  EXPECT_EQ(sum.expected(1, 5, 16), 17);
  // avg on 4 ranks: element 1 is held by rank 3 as 4 * 1; the others hold 0.
  CheckPattern avg(BenchOp::AllReduce, ReduceOp::Avg, DType::I32, 4, 0);
  EXPECT_EQ(avg.input(3, 1), 4);
  EXPECT_EQ(avg.input(0, 1), 0);
  EXPECT_EQ(avg.expected(0, 1, 8), 1);
  // product on 3 ranks: element 2 is held by rank 1 ((1 + 2) % 3 == 0) as 0, 2 or 3 (by a hash
  // of the element), the others hold 1; the product is the holder's value. Element 253 is
  // element 2 again (the patterns repeat every 251 elements).
  CheckPattern prod(BenchOp::ReduceScatter, ReduceOp::Product, DType::F16, 3, 0);
  EXPECT_EQ(prod.input(0, 2), 1);
  EXPECT_EQ(prod.input(2, 2), 1);
  EXPECT_TRUE(prod.input(1, 2) == 0 || prod.input(1, 2) == 2 || prod.input(1, 2) == 3);
  EXPECT_EQ(prod.expected(0, 2, 4), prod.input(1, 2));
  EXPECT_EQ(prod.input(1, 2 + 251), prod.input(1, 2));
  std::set<int64_t> products;
  for (int64_t i = 0; i < prod.period(); ++i) products.insert(prod.expected(0, i, 4));
  EXPECT_EQ(products, (std::set<int64_t>{0, 2, 3}));
  // a bool sum (an or): element k's holder, rank (2 - k % 2) % 2, holds a hash bit, the other 0.
  CheckPattern bor(BenchOp::AllReduce, ReduceOp::Sum, DType::Bool, 2, 0);
  EXPECT_EQ(bor.input(1, 0), 0);
  EXPECT_EQ(bor.input(0, 1), 0);
  EXPECT_EQ(bor.expected(0, 0, 3), bor.input(0, 0));
  EXPECT_EQ(bor.expected(0, 1, 3), bor.input(1, 1));
  std::set<int64_t> bits;
  for (int64_t i = 0; i < bor.period(); ++i) bits.insert(bor.expected(0, i, 4));
  EXPECT_EQ(bits, (std::set<int64_t>{0, 1}));
  // reduce_scatter: rank 1 of 2 gets elements [count, 2 count) reduced.
  CheckPattern rs(BenchOp::ReduceScatter, ReduceOp::Sum, DType::F32, 2, 0);
  EXPECT_EQ(rs.expected(1, 0, 4), rs.input(0, 4) + rs.input(1, 4));
  // all_gather on 2 ranks: (13 r + i) mod 251.
  CheckPattern ag(BenchOp::AllGather, ReduceOp::Sum, DType::F32, 2, 0);
  EXPECT_EQ(ag.expected(0, 3, 3), 13);  // rank 1's element 0
  // bf16 sums stay within 256 on 16 ranks.
  CheckPattern bf(BenchOp::AllReduce, ReduceOp::Sum, DType::BF16, 16, 0);
  for (int64_t i = 0; i < bf.period(); ++i) EXPECT_LE(bf.expected(0, i, bf.period()), 256);
}

TEST(BenchCheck, FillAndCountWrongOnTensors) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::I8, DType::Bool, DType::I64}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const int n = 3;
    const int64_t count = 300;
    CheckPattern ag(BenchOp::AllGather, ReduceOp::Sum, dtype, n, 0);
    Tensor in = Tensor::empty({count}, dtype);
    ag.fill_input(in, 2);
    const std::vector<double> got = in.to_vector<double>();
    for (int64_t i = 0; i < count; ++i) ASSERT_EQ(got[i], static_cast<double>(ag.input(2, i)));

    // A correct all_gather output, then one and then three corrupted elements.
    std::vector<double> out_values;
    for (int r = 0; r < n; ++r) {
      for (int64_t k = 0; k < count; ++k) out_values.push_back(static_cast<double>(ag.input(r, k)));
    }
    Tensor out = Tensor::from_vector<double>(out_values, {n * count}).to(dtype);
    EXPECT_EQ(ag.count_wrong(out, 1, count), 0);
    auto corrupt = [&](int64_t j) {
      out.narrow(0, j, 1).fill_(ag.expected(1, j, count) == 0 ? 1.0 : 0.0);
    };
    corrupt(5);
    EXPECT_EQ(ag.count_wrong(out, 1, count), 1);
    corrupt(2 * count + 7);
    corrupt(2 * count + 8);
    EXPECT_EQ(ag.count_wrong(out, 1, count), 3);
  }
}

TEST(BenchCheck, NanAndSwappedBlocksAreWrong) {
  const int n = 2;
  const int64_t count = 64;
  CheckPattern a2a(BenchOp::AllToAll, ReduceOp::Sum, DType::F32, n, 0);
  std::vector<float> v;
  for (int src = 0; src < n; ++src) {
    for (int64_t k = 0; k < count; ++k)
      v.push_back(static_cast<float>(a2a.input(src, 1 * count + k)));
  }
  Tensor out = Tensor::from_vector<float>(v, {n * count});
  EXPECT_EQ(a2a.count_wrong(out, 1, count), 0);
  EXPECT_EQ(a2a.count_wrong(out, 0, count), 2 * count);  // rank 0 expects block 0 of each peer
  out.narrow(0, 3, 1).fill_(std::nan(""));
  EXPECT_EQ(a2a.count_wrong(out, 1, count), 1);
}

// A block that went to the wrong rank or offset is seen at the default (power-of-two) sizes, on
// every dtype: rank n-1 handed rank 0's reduce_scatter or all_to_all result, and an all_gather
// result with blocks 0 and 1 swapped. The patterns used to repeat with a period that divided
// such counts (i8's 128, bitwise ops' 256, bool's 2, product's lcm(n, 3)), and #wrong was 0.
TEST(BenchCheck, BlocksInTheWrongPlaceAreSeenAtPowerOfTwoCounts) {
  const ReduceOp redops[] = {ReduceOp::Sum, ReduceOp::Avg,  ReduceOp::Product, ReduceOp::Min,
                             ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr,     ReduceOp::BXor};
  auto tensor_of = [](const std::vector<double>& v, DType dtype) {
    return Tensor::from_vector<double>(v, {static_cast<int64_t>(v.size())}).to(dtype);
  };
  for (DType dtype : kAllDTypes) {
    for (int n : {2, 3, 4, 8}) {
      for (int64_t count : {int64_t{8}, int64_t{16}, int64_t{64}, int64_t{128}, int64_t{256},
                            int64_t{512}, int64_t{4096}}) {
        for (BenchOp op : {BenchOp::ReduceScatter, BenchOp::AllToAll, BenchOp::AllGather}) {
          for (ReduceOp redop : redops) {
            if (!has_reduce_op(op) && redop != ReduceOp::Sum) continue;
            if (bitwise(redop) && is_floating(dtype)) continue;
            if (redop == ReduceOp::Avg && dtype == DType::Bool) continue;  // refused
            SCOPED_TRACE(std::string(bench_op_name(op)) + " " + std::string(dtype_name(dtype)) +
                         " " + std::string(reduce_op_name(redop)) + " n=" + std::to_string(n) +
                         " count=" + std::to_string(count));
            const CheckPattern p(op, redop, dtype, n, 0);
            const int64_t out_numel = op == BenchOp::ReduceScatter ? count : n * count;
            std::vector<double> v;
            if (op == BenchOp::AllGather) {
              for (int64_t j = 0; j < out_numel; ++j) {
                const int64_t from = j < count ? j + count : j < 2 * count ? j - count : j;
                v.push_back(static_cast<double>(p.expected(0, from, count)));
              }
              EXPECT_GT(p.count_wrong(tensor_of(v, dtype), 0, count), 0);
              continue;
            }
            for (int64_t j = 0; j < out_numel; ++j) {
              v.push_back(static_cast<double>(p.expected(0, j, count)));
            }
            EXPECT_EQ(p.count_wrong(tensor_of(v, dtype), 0, count), 0);
            EXPECT_GT(p.count_wrong(tensor_of(v, dtype), n - 1, count), 0);
          }
        }
      }
    }
  }
}

// ---- validation and runs ----

TEST(BenchRun, ValidateRejectsRunsThatCannotWork) {
  BenchOptions o;
  EXPECT_NO_THROW(validate(o));
  BenchOptions bad = o;
  bad.min_bytes = 1 << 20;
  bad.max_bytes = 1024;
  EXPECT_THROW(validate(bad), InvalidArgument);
  bad = o;
  bad.root = 2;
  EXPECT_THROW(validate(bad), InvalidArgument);
  bad.ops = {BenchOp::AllReduce, BenchOp::AllToAll};  // no root involved: ignored, as nccl-tests
  EXPECT_NO_THROW(validate(bad));
  bad.ops = {BenchOp::AllReduce, BenchOp::Broadcast};
  EXPECT_THROW(validate(bad), InvalidArgument);
  bad = o;
  bad.redop = ReduceOp::BXor;
  EXPECT_THROW(validate(bad), InvalidArgument);
  bad.ops = {BenchOp::AllGather};  // no reduce op involved: fine
  EXPECT_NO_THROW(validate(bad));
  bad = o;
  bad.backend = "nccl";
  try {
    validate(bad);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown backend 'nccl'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("threads"), std::string::npos);
  }
}

// A size beyond the machine's memory is refused before anything runs or prints (it was refused
// only when reached, after every smaller size had run and printed its row); a job that funcol
// bench is about to start (mpi, gloo) holds all its ranks on this machine.
TEST(BenchRun, SizesBeyondMemoryAreRefusedUpFront) {
  const double ram = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                     static_cast<double>(sysconf(_SC_PAGESIZE));
  BenchOptions o;
  o.ops = {BenchOp::AllReduce};
  o.min_bytes = 8;
  o.step_factor = static_cast<int64_t>(0.6 * ram) / 8;
  o.max_bytes = 8 * o.step_factor;  // sizes 8 and 0.6 of the memory, twice over on 2 ranks
  o.iters = 1;
  o.warmup_iters = 0;
  o.memcpy_gbps_override = 1;
  o.ranks = 1;
  EXPECT_NO_THROW(validate(o));  // validated only: one rank's buffer fits
  o.ranks = 2;
  EXPECT_THROW(validate(o), InvalidArgument);
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  try {
    run_bench(o, out);
    ADD_FAILURE() << "ran";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory allocating"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("-e/--maxbytes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::ftell(out), 0) << "nothing printed";
  std::fclose(out);
  for (const std::string& backend : available_backends()) {
    if (backend == "threads" || inside_job(backend)) continue;
    SCOPED_TRACE(backend);
    o.backend = backend;
    EXPECT_THROW(validate(o), InvalidArgument);
    o.ranks = 1;
    EXPECT_NO_THROW(validate(o));
    o.ranks = 2;
  }
}

TEST(BenchRun, JobArgsSpellOutEveryFlag) {
  BenchOptions o;
  o.min_bytes = 4096;
  o.max_bytes = int64_t{64} << 20;
  o.step_factor = 4;
  o.iters = 7;
  o.warmup_iters = 0;
  o.check = 2;
  o.ops = {BenchOp::ReduceScatter};
  o.dtype = DType::BF16;
  o.redop = ReduceOp::Max;
  o.root = 1;
  o.ranks = 3;
  o.backend = "gloo";
  o.json = true;
  EXPECT_EQ(bench_job_args(o),
            (std::vector<std::string>{"bench", "-b", "4096", "-e", "67108864", "-f", "4", "-i",
                                      "1048576", "-n", "7", "-w", "0", "-c", "2", "-o",
                                      "reduce_scatter", "-d", "bf16", "-r", "max", "--root", "1",
                                      "--ranks", "3", "--backend", "gloo", "--json"}));
  o = BenchOptions{};
  o.in_place = true;
  o.inject_wrong = true;
  const std::vector<std::string> all = bench_job_args(o);
  EXPECT_EQ(all[16], "all");  // -o all: every op, in order
  EXPECT_EQ(all[all.size() - 2], "--in-place");
  EXPECT_EQ(all.back(), "--inject-wrong");
  o.ops = {BenchOp::AllReduce, BenchOp::Broadcast};  // -o cannot name two ops
  EXPECT_THROW(bench_job_args(o), InvalidArgument);
}

TEST(BenchRun, ProcessBackendsRunOnlyInsideAJob) {
  BenchOptions o;
  for (const std::string& backend : available_backends()) {
    if (backend == "threads" || inside_job(backend)) continue;
    o.backend = backend;
    EXPECT_NO_THROW(validate(o));
    std::FILE* out = std::tmpfile();
    ASSERT_NE(out, nullptr);
    try {
      run_bench(o, out);
      ADD_FAILURE() << backend;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("backend '" + backend + "' runs in a job's processes"),
                std::string::npos)
          << e.what();
    }
    std::fclose(out);
  }
}

// The processes of a job that funcol started (gloo: FUNCOL_LAUNCHER_PID) or that mpirun says
// share this machine (OMPI_COMM_WORLD_LOCAL_SIZE, torchrun's LOCAL_WORLD_SIZE) all hold their
// buffers here: checked one process at a time, -b 6G on 4 gloo ranks of a 23 GiB machine passed
// and went on to write 24 GiB.
TEST(BenchRun, ProcessRanksOnThisMachineShareItsMemory) {
  const double most = 0.6 * static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                      static_cast<double>(sysconf(_SC_PAGESIZE));
  ASSERT_EQ(std::getenv("FUNCOL_LAUNCHER_PID"), nullptr);
  ASSERT_EQ(std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"), nullptr);
  ASSERT_EQ(std::getenv("LOCAL_WORLD_SIZE"), nullptr);
  EXPECT_TRUE(fits_in_memory("gloo", 2, most));  // a joined job: its ranks may be anywhere
  EXPECT_TRUE(fits_in_memory("mpi", 2, most));
  // Only read here, never acted on: the pid of a process that is not this one's parent.
  setenv("FUNCOL_LAUNCHER_PID", "1", 1);
  EXPECT_FALSE(fits_in_memory("gloo", 2, most));
  EXPECT_TRUE(fits_in_memory("gloo", 1, most));
  unsetenv("FUNCOL_LAUNCHER_PID");
  setenv("LOCAL_WORLD_SIZE", "2", 1);  // torchrun's
  EXPECT_FALSE(fits_in_memory("gloo", 4, most));
  unsetenv("LOCAL_WORLD_SIZE");
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  EXPECT_FALSE(fits_in_memory("mpi", 4, most));
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1", 1);
  EXPECT_TRUE(fits_in_memory("mpi", 4, most));
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  // A tool outside a job starts one here: every rank of it on this machine.
  const InitOptions none;
  ASSERT_EQ(std::getenv("RANK"), nullptr);
  EXPECT_EQ(ranks_on_this_machine("threads", 4, none), 4);
  EXPECT_EQ(ranks_on_this_machine("gloo", 4, none), 4);
  EXPECT_EQ(ranks_on_this_machine("mpi", 4, none), 4);
  InitOptions joined;  // --rank 1 --world-size 4: a job someone else started
  joined.rank = 1;
  joined.world_size = 4;
  EXPECT_EQ(ranks_on_this_machine("gloo", 4, joined), 1);
}

TEST(BenchRun, MemcpyReferenceIsPositive) {
  MemcpyRef ref = measure_memcpy(1 << 20);
  EXPECT_EQ(ref.bytes, 1 << 20);
  EXPECT_GT(ref.gbps_per_thread, 0);
  EXPECT_GT(ref.gbps_total, 0);
}

TEST(BenchRun, HandoffReferenceIsAPlausibleRoundTrip) {
  HandoffRef ref = measure_handoff();
  EXPECT_GT(ref.round_trip_ns, 0);
  // Even two threads on one busy core hand a line back and forth well within 1 ms on average.
  EXPECT_LT(ref.round_trip_ns, 1e6);
}

std::string read_all(std::FILE* f) {
  std::rewind(f);
  std::string s;
  char buf[4096];
  size_t k;
  while ((k = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, k);
  return s;
}

// Runs the bench and returns its report; what it printed goes to *text.
BenchReport run_captured(const BenchOptions& o, std::string* text) {
  std::FILE* out = std::tmpfile();
  if (out == nullptr) throw std::runtime_error("tmpfile failed");
  BenchReport report;
  try {
    report = run_bench(o, out);
  } catch (...) {
    std::fclose(out);
    throw;
  }
  *text = read_all(out);
  std::fclose(out);
  return report;
}

TEST(BenchRun, EveryOpChecksCleanAndPrintsTheTable) {
  for (int ranks : {1, 2, 3}) {
    SCOPED_TRACE("ranks " + std::to_string(ranks));
    BenchOptions o;
    o.ranks = ranks;
    o.min_bytes = 0;
    o.max_bytes = 4096;
    o.step_factor = 4;
    o.iters = 2;
    o.warmup_iters = 1;
    o.memcpy_gbps_override = 10;
    std::string text;
    BenchReport report = run_captured(o, &text);
    EXPECT_EQ(report.wrong, 0);
    // One row per distinct (op, size, count): 0, 1, 4, ... 4096 bytes of f32 are fewer rows
    // (1 byte is 0 elements again, and so are 4 for the ops that split by rank).
    std::set<std::tuple<BenchOp, int64_t, int64_t>> distinct;
    for (BenchOp op : kAllBenchOps) {
      for (int64_t bytes : size_sequence(0, 4096, 4, 1)) {
        const CollSizes s = coll_sizes(op, bytes, /*itemsize=*/4, ranks);
        distinct.emplace(op, s.size_bytes, s.count);
      }
    }
    ASSERT_EQ(report.rows.size(), distinct.size());
    for (const BenchRow& row : report.rows) {
      EXPECT_EQ(row.wrong, 0);
      EXPECT_GT(row.time_us, 0);
      EXPECT_DOUBLE_EQ(row.busbw, row.algbw * bus_factor(row.op, ranks));
    }
    EXPECT_NE(text.find("# funcol bench: op all (all_reduce, all_gather, reduce_scatter, "
                        "all_to_all, broadcast), backend threads, " +
                        std::to_string(ranks) + (ranks == 1 ? " rank," : " ranks,")),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("#       size         count      type    redop    root     time   algbw"
                        "   busbw  #wrong   ratio"),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("# Out of bounds values : 0 OK"), std::string::npos) << text;
    EXPECT_NE(text.find("# Avg bus bandwidth    : "), std::string::npos) << text;
  }
}

// Sizes that truncate to the same elements (per rank) give one row, not one per size: -b 0
// with factor 2 (0, 1, 2 bytes of f32 are all 0 elements), -f 1 with steps below an element,
// sizes below one element per rank for the ops that split by rank.
TEST(BenchRun, EachDistinctRowIsPrintedOnce) {
  struct Case {
    BenchOp op;
    int ranks;
    int64_t min_bytes, max_bytes, factor, step_bytes;
    std::vector<std::pair<int64_t, int64_t>> rows;  // (size, count)
  };
  const std::vector<Case> cases = {
      {BenchOp::AllReduce, 2, 0, 64, 2, 1, {{0, 0}, {4, 1}, {8, 2}, {16, 4}, {32, 8}, {64, 16}}},
      {BenchOp::AllReduce, 2, 0, 12, 1, 1, {{0, 0}, {4, 1}, {8, 2}, {12, 3}}},
      {BenchOp::AllGather, 4, 4, 64, 2, 1, {{0, 0}, {16, 1}, {32, 2}, {64, 4}}},
      {BenchOp::ReduceScatter, 4, 8, 32, 1, 4, {{0, 0}, {16, 1}, {32, 2}}},
      {BenchOp::AllToAll, 3, 0, 24, 1, 6, {{0, 0}, {12, 1}, {24, 2}}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(bench_op_name(c.op)) + " ranks " + std::to_string(c.ranks) +
                 " -b " + std::to_string(c.min_bytes) + " -e " + std::to_string(c.max_bytes) +
                 " -f " + std::to_string(c.factor) + " -i " + std::to_string(c.step_bytes));
    BenchOptions o;
    o.ops = {c.op};
    o.ranks = c.ranks;
    o.min_bytes = c.min_bytes;
    o.max_bytes = c.max_bytes;
    o.step_factor = c.factor;
    o.step_bytes = c.step_bytes;
    o.iters = 1;
    o.warmup_iters = 0;
    o.memcpy_gbps_override = 10;
    std::string text;
    const BenchReport report = run_captured(o, &text);
    std::vector<std::pair<int64_t, int64_t>> rows;
    for (const BenchRow& row : report.rows) {
      rows.emplace_back(row.sizes.size_bytes, row.sizes.count);
    }
    EXPECT_EQ(rows, c.rows);
    EXPECT_EQ(report.wrong, 0);
    // The table has as many rows as the report: lines that do not start with '#'.
    std::istringstream lines(text);
    size_t printed = 0;
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty() && line[0] != '#') ++printed;
    }
    EXPECT_EQ(printed, c.rows.size()) << text;
  }
}

TEST(BenchRun, EveryDtypeAndReduceOpChecksClean) {
  const ReduceOp redops[] = {ReduceOp::Sum, ReduceOp::Avg,  ReduceOp::Product, ReduceOp::Min,
                             ReduceOp::Max, ReduceOp::BAnd, ReduceOp::BOr,     ReduceOp::BXor};
  for (DType dtype : kAllDTypes) {
    for (ReduceOp redop : redops) {
      if (bitwise(redop) && is_floating(dtype)) continue;
      if (redop == ReduceOp::Avg && dtype == DType::Bool) continue;  // rejected by validate()
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + std::string(reduce_op_name(redop)));
      BenchOptions o;
      o.ranks = 3;
      o.ops = {BenchOp::AllReduce, BenchOp::ReduceScatter};
      if (redop == ReduceOp::Sum) o.ops = {std::begin(kAllBenchOps), std::end(kAllBenchOps)};
      o.dtype = dtype;
      o.redop = redop;
      o.root = 1;
      o.min_bytes = 24;  // 24 and 1000 bytes: counts that do not divide evenly
      o.max_bytes = 1000;
      o.step_factor = 41;
      o.iters = 1;
      o.warmup_iters = 0;
      o.memcpy_gbps_override = 10;
      o.json = true;
      std::FILE* out = std::tmpfile();
      ASSERT_NE(out, nullptr);
      BenchReport report = run_bench(o, out);
      std::fclose(out);
      EXPECT_EQ(report.wrong, 0);
      EXPECT_EQ(report.rows.size(), o.ops.size() * 2);
    }
  }
}

TEST(BenchRun, InjectedWrongValuesAreCountedAndReported) {
  BenchOptions o;
  o.ranks = 2;
  o.min_bytes = 64;
  o.max_bytes = 256;
  o.iters = 1;
  o.memcpy_gbps_override = 10;
  o.inject_wrong = true;
  std::string text;
  BenchReport report = run_captured(o, &text);
  ASSERT_EQ(report.rows.size(), 5u * 3u);
  for (const BenchRow& row : report.rows) EXPECT_EQ(row.wrong, 1) << bench_op_name(row.op);
  EXPECT_EQ(report.wrong, 15);
  EXPECT_NE(text.find("# Out of bounds values : 15 FAILED"), std::string::npos) << text;
}

// --in-place: all_gather gathers into the output its input is a block of, reduce_scatter
// reduces into a block of its input; every element is still checked (the poison goes on
// before the input, which it would otherwise overwrite), and an injected wrong value counts.
TEST(BenchRun, InPlaceChecksCleanAndSaysSo) {
  const std::pair<DType, ReduceOp> cases[] = {{DType::F32, ReduceOp::Sum},
                                              {DType::I32, ReduceOp::Product},
                                              {DType::BF16, ReduceOp::Max}};
  for (int ranks : {1, 2, 3}) {
    for (auto [dtype, redop] : cases) {
      for (bool inject : {false, true}) {
        SCOPED_TRACE(fmt::format("ranks {} {} {} inject {}", ranks, dtype_name(dtype),
                                 reduce_op_name(redop), inject));
        BenchOptions o;
        o.ranks = ranks;
        o.ops = {BenchOp::AllGather, BenchOp::ReduceScatter, BenchOp::AllToAll};
        o.dtype = dtype;
        o.redop = redop;
        o.min_bytes = 24;  // 24, 984 and 40344 bytes: counts that do not divide evenly
        o.max_bytes = 40344;
        o.step_factor = 41;
        o.iters = 3;
        o.warmup_iters = 1;
        o.check = 2;
        o.memcpy_gbps_override = 10;
        o.json = true;
        o.in_place = true;
        o.inject_wrong = inject;
        std::string text;
        BenchReport report = run_captured(o, &text);
        ASSERT_EQ(report.rows.size(), 9u);
        for (const BenchRow& row : report.rows) {
          // Two checks per row, one injected value each.
          EXPECT_EQ(row.wrong, inject ? 2 : 0) << bench_op_name(row.op);
        }
        EXPECT_NE(text.find(R"("op": "all_gather")"), std::string::npos) << text;
        size_t lines = 0;
        for (size_t at = text.find("{\"op\""); at != std::string::npos;
             at = text.find("{\"op\"", at + 1)) {
          const std::string line = text.substr(at, text.find('\n', at) - at);
          const bool a2a = line.find(R"("op": "all_to_all")") != std::string::npos;
          EXPECT_NE(line.find(a2a ? R"("in_place": false)" : R"("in_place": true)"),
                    std::string::npos)
              << line;
          ++lines;
        }
        EXPECT_EQ(lines, 9u);
      }
    }
  }
  // The table says which ops ran in place.
  BenchOptions o;
  o.ops = {BenchOp::AllGather};
  o.min_bytes = o.max_bytes = 4096;
  o.iters = 1;
  o.memcpy_gbps_override = 10;
  o.in_place = true;
  std::string text;
  BenchReport report = run_captured(o, &text);
  EXPECT_EQ(report.wrong, 0);
  EXPECT_NE(text.find("# one group of columns, --in-place: all_reduce and broadcast in place"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("#   out of place (it has no in-place form)"), std::string::npos) << text;
}

TEST(BenchRun, UncheckedRowsSayNA) {
  BenchOptions o;
  o.ops = {BenchOp::Broadcast};
  o.min_bytes = o.max_bytes = 64;
  o.check = 0;
  o.memcpy_gbps_override = 10;
  std::string text;
  BenchReport report = run_captured(o, &text);
  ASSERT_EQ(report.rows.size(), 1u);
  EXPECT_EQ(report.rows[0].wrong, -1);
  EXPECT_EQ(report.wrong, 0);
  EXPECT_NE(text.find("N/A"), std::string::npos) << text;
  EXPECT_NE(text.find("# Out of bounds values : N/A (-c 0)"), std::string::npos) << text;
}

}  // namespace
}  // namespace funcol::tools
