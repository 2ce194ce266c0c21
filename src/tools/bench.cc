// `funcol bench`: nccl-tests style micro-benchmarks of a ProcessGroup's collective primitives.
#include "tools/bench.h"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cctype>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <new>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <type_traits>

#include <CLI/CLI.hpp>
#include <Eigen/Core>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dist/affinity.h"
#include "dist/spin.h"
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/process_group.h"
#include "funcol/dist/work.h"
#include "tools/commands.h"
#include "tools/json_line.h"
#include "tools/launch.h"

namespace funcol::tools {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += sep;
    out += parts[i];
  }
  return out;
}

// Calls f(std::type_identity<T>{}) with the C++ type one element of dtype is stored as. bool is
// one byte holding 0 or 1, so it is read and written as uint8_t.
template <typename F>
decltype(auto) visit_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Bool:
      return f(std::type_identity<uint8_t>{});
    case DType::U8:
      return f(std::type_identity<uint8_t>{});
    case DType::I8:
      return f(std::type_identity<int8_t>{});
    case DType::I16:
      return f(std::type_identity<int16_t>{});
    case DType::I32:
      return f(std::type_identity<int32_t>{});
    case DType::I64:
      return f(std::type_identity<int64_t>{});
    case DType::F16:
      return f(std::type_identity<Eigen::half>{});
    case DType::BF16:
      return f(std::type_identity<Eigen::bfloat16>{});
    case DType::F32:
      return f(std::type_identity<float>{});
    case DType::F64:
      return f(std::type_identity<double>{});
  }
  FUNCOL_CHECK(false, "unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

// An exact integer value as an element of type T (the pattern keeps it in range).
template <typename T>
T to_elem(double v) {
  if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    return T(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

// The per-period table in the element type.
template <typename T>
std::vector<T> typed_table(const std::vector<double>& table) {
  std::vector<T> out(table.size());
  for (size_t k = 0; k < table.size(); ++k) out[k] = to_elem<T>(table[k]);
  return out;
}

// Bitwise equality for integers; value equality for floats (NaN is never equal: a wrong value).
template <typename T>
bool same(T a, T b) {
  if constexpr (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>) {
    return static_cast<float>(a) == static_cast<float>(b);
  } else {
    return a == b;
  }
}

bool in_place(BenchOp op) { return op == BenchOp::AllReduce || op == BenchOp::Broadcast; }

// Whether this run's `op` runs in place (its output and input share bytes).
bool runs_in_place(const BenchOptions& o, BenchOp op) {
  return in_place(op) || (o.in_place && op != BenchOp::AllToAll);
}

const char* const kSizeHelp =
    "expected a byte count with an optional K, M or G suffix (1024-based), e.g. 4K or 64M";

}  // namespace

// ---- names and flag values ----

std::string_view bench_op_name(BenchOp op) {
  switch (op) {
    case BenchOp::AllReduce:
      return "all_reduce";
    case BenchOp::AllGather:
      return "all_gather";
    case BenchOp::ReduceScatter:
      return "reduce_scatter";
    case BenchOp::AllToAll:
      return "all_to_all";
    case BenchOp::Broadcast:
      return "broadcast";
  }
  FUNCOL_CHECK(false, "unknown bench op " + std::to_string(static_cast<int>(op)));
}

std::vector<BenchOp> parse_bench_ops(std::string_view text) {
  if (text == "all") return {std::begin(kAllBenchOps), std::end(kAllBenchOps)};
  for (BenchOp op : kAllBenchOps) {
    if (bench_op_name(op) == text) return {op};
  }
  throw InvalidArgument(
      fmt::format("unknown op '{}' for -o/--op: expected all_reduce, all_gather, reduce_scatter, "
                  "all_to_all, broadcast or all",
                  text));
}

bool has_reduce_op(BenchOp op) { return op == BenchOp::AllReduce || op == BenchOp::ReduceScatter; }

bool has_root(BenchOp op) { return op == BenchOp::Broadcast; }

int64_t parse_size(std::string_view text, std::string_view flag) {
  auto fail = [&]() -> int64_t {
    throw InvalidArgument(fmt::format("invalid size '{}' for {}: {}", text, flag, kSizeHelp));
  };
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0 || digits + 1 < text.size()) return fail();
  int shift = 0;
  if (digits < text.size()) {
    switch (text[digits]) {
      case 'K':
      case 'k':
        shift = 10;
        break;
      case 'M':
      case 'm':
        shift = 20;
        break;
      case 'G':
      case 'g':
        shift = 30;
        break;
      default:
        return fail();
    }
  }
  const int64_t limit = INT64_MAX >> shift;
  int64_t value = 0;
  for (size_t i = 0; i < digits; ++i) {
    const int d = text[i] - '0';
    if (value > (limit - d) / 10) {
      throw InvalidArgument(fmt::format("size '{}' for {} is too large", text, flag));
    }
    value = value * 10 + d;
  }
  return value << shift;
}

int64_t parse_int(std::string_view text, std::string_view flag, int64_t min_value) {
  size_t i = 0;
  bool negative = false;
  if (i < text.size() && (text[i] == '-' || text[i] == '+')) negative = text[i++] == '-';
  const size_t start = i;
  int64_t value = 0;
  bool overflow = false;
  for (; i < text.size() && std::isdigit(static_cast<unsigned char>(text[i])); ++i) {
    const int d = text[i] - '0';
    if (value > (INT_MAX - d) / 10) overflow = true;
    if (!overflow) value = value * 10 + d;
  }
  if (i == start || i != text.size()) {
    throw InvalidArgument(
        fmt::format("invalid value '{}' for {}: expected an integer", text, flag));
  }
  if (negative) value = -value;
  if (overflow || value < min_value) {
    throw InvalidArgument(
        fmt::format("invalid value '{}' for {}: expected an integer from {} to {}", text, flag,
                    min_value, INT_MAX));
  }
  return value;
}

DType parse_bench_dtype(std::string_view text) {
  if (std::optional<DType> d = parse_dtype(text)) return *d;
  // nccl-tests' type names, so its -d values carry over. (Its -o is the reduce op and -r the
  // root; here -o is the collective and -r the reduce op: see `funcol bench --help`.)
  static const std::pair<std::string_view, DType> kAliases[] = {
      {"float", DType::F32},   {"float32", DType::F32},   {"half", DType::F16},
      {"float16", DType::F16}, {"bfloat16", DType::BF16}, {"double", DType::F64},
      {"float64", DType::F64}, {"int8", DType::I8},       {"uint8", DType::U8},
      {"int32", DType::I32},   {"int", DType::I32},       {"int64", DType::I64}};
  for (const auto& [name, dtype] : kAliases) {
    if (name == text) return dtype;
  }
  std::vector<std::string> names;
  for (DType d : kAllDTypes) names.emplace_back(dtype_name(d));
  throw InvalidArgument(fmt::format("unknown dtype '{}' for -d/--datatype: expected one of {}",
                                    text, join(names, ", ")));
}

ReduceOp parse_bench_redop(std::string_view text) {
  const std::string name = lower(text) == "prod" ? "product" : std::string(text);
  try {
    return parse_reduce_op(name);
  } catch (const InvalidArgument&) {
    throw InvalidArgument(fmt::format(
        "unknown reduce op '{}' for -r/--redop: expected sum, avg, product, min, max, band, bor "
        "or bxor",
        text));
  }
}

// ---- nccl-tests conventions ----

int64_t next_size(int64_t size, int64_t max_bytes, int64_t factor, int64_t step_bytes) {
  FUNCOL_CHECK(factor >= 1 && (factor > 1 || step_bytes >= 1), "bad size step");
  if (factor > 1) {
    if (size == 0) return max_bytes >= 1 ? 1 : -1;
    return size > max_bytes / factor ? -1 : size * factor;
  }
  return size > max_bytes - step_bytes ? -1 : size + step_bytes;
}

std::vector<int64_t> size_sequence(int64_t min_bytes, int64_t max_bytes, int64_t factor,
                                   int64_t step_bytes) {
  std::vector<int64_t> sizes;
  for (int64_t size = min_bytes <= max_bytes ? min_bytes : -1; size >= 0;
       size = next_size(size, max_bytes, factor, step_bytes)) {
    sizes.push_back(size);
  }
  return sizes;
}

CollSizes coll_sizes(BenchOp op, int64_t bytes, size_t itemsize, int nranks) {
  const int64_t n = nranks;
  const int64_t total = bytes / static_cast<int64_t>(itemsize);
  CollSizes s;
  switch (op) {
    case BenchOp::AllReduce:
    case BenchOp::Broadcast:
      s.count = total;
      s.in_numel = s.out_numel = total;
      break;
    case BenchOp::AllGather:
      s.count = total / n;
      s.in_numel = s.count;
      s.out_numel = s.count * n;
      break;
    case BenchOp::ReduceScatter:
      s.count = total / n;
      s.in_numel = s.count * n;
      s.out_numel = s.count;
      break;
    case BenchOp::AllToAll:
      s.count = total / n;  // per peer
      s.in_numel = s.out_numel = s.count * n;
      break;
  }
  s.size_bytes = std::max(s.in_numel, s.out_numel) * static_cast<int64_t>(itemsize);
  return s;
}

double bus_factor(BenchOp op, int nranks) {
  const double n = nranks;
  switch (op) {
    case BenchOp::AllReduce:
      return 2.0 * (n - 1) / n;
    case BenchOp::AllGather:
    case BenchOp::ReduceScatter:
    case BenchOp::AllToAll:
      return (n - 1) / n;
    case BenchOp::Broadcast:
      return 1.0;
  }
  FUNCOL_CHECK(false, "unknown bench op");
}

int64_t exact_limit(DType dtype) {
  switch (dtype) {
    case DType::Bool:
      return 1;
    case DType::U8:
      return 255;
    case DType::I8:
      return 127;
    case DType::I16:
      return 32767;
    case DType::I32:
      return INT32_MAX;
    case DType::I64:
      return int64_t{1} << 62;
    case DType::F16:
      return 2048;  // 11-bit significand
    case DType::BF16:
      return 256;  // 8-bit significand
    case DType::F32:
      return int64_t{1} << 24;
    case DType::F64:
      return int64_t{1} << 53;
  }
  FUNCOL_CHECK(false, "unknown dtype");
}

// ---- check data ----
//
// Values by op (M = exact_limit(dtype), n = ranks, every value >= 0 so partial results of any
// reduction order are bounded by the final one), with k = i mod 251 (kCycle, a prime): every
// pattern repeats every 251 elements, and every modulus below is odd. A period or modulus that
// divides the per-rank count (the default sizes are powers of two) makes every rank's block
// alike, and a block sent to the wrong rank or offset then goes unseen (i8's modulus 128, an
// avg or product pattern of period lcm(n, 3) on 4 ranks, bool's 2 did).
//   all_gather, all_to_all, broadcast: (13 r + k) mod P, P = the largest odd number <=
//             min(M, 250) + 1; bool: a hash bit of (r, k). Broadcast's non-root ranks hold the
//             root's value plus one mod P (bool: its complement): every element differs
//   sum:      (7 r + k) mod P, P the largest odd number <= A + 1 that is no multiple of 7,
//             A = min(M / n, 100): the sum of n ranks is <= M; for bool (an or) and where A is
//             1, a hash bit of k on the holder, rank (n - k mod n) mod n, 0 elsewhere; where A
//             is 0 (more ranks than M), 0
//   avg:      n * (k mod P) on the holder, 0 elsewhere (P as sum's, 2 where A is 1): the sum
//             divides by n
//   product:  on the holder 0, 2 or 3 by a hash of k (bool: a hash bit), 1 elsewhere: the
//             product is the holder's
//   min, max: (7 r + 3 k) mod 101; bool: a hash bit of k on the holder, 1 (min) or 0 (max)
//             elsewhere
//   band, bor, bxor: the result R = a hash of k mod P, P = the largest odd number <=
//             min(M + 1, 256), is the holder's value; the others hold R | m (band), R & m
//             (bor) or m (bxor, the holder then R ^ the others' m), m = (37 r + 11 k) mod P:
//             every rank's input varies, and the result is R; bool: as min (band) or max
namespace {

constexpr int64_t kCycle = 251;

int64_t largest_odd_at_most(int64_t x) { return x % 2 == 1 ? x : x - 1; }

// A well-mixed number of (r, k) (splitmix64's finaliser): values no short period or rank shift
// repeats.
uint64_t mix(int64_t r, int64_t k) {
  uint64_t z = static_cast<uint64_t>(r) * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(k) + 1;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
int64_t hash_bit(int64_t r, int64_t k) { return static_cast<int64_t>(mix(r, k) & 1); }
// The seed a reduction's result pattern is drawn with (any rank number would do).
constexpr int64_t kResultSeed = -1;

}  // namespace

CheckPattern::CheckPattern(BenchOp op, ReduceOp redop, DType dtype, int nranks, int root)
    : op_(op), redop_(redop), dtype_(dtype), nranks_(nranks), root_(root) {
  FUNCOL_CHECK(nranks >= 1, "nranks must be positive");
  const int64_t m = exact_limit(dtype);
  const int64_t n = nranks;
  const bool is_bool = dtype == DType::Bool;
  period_ = kCycle;
  if (!has_reduce_op(op)) {
    modulus_ = is_bool ? 2 : largest_odd_at_most(std::min<int64_t>(m, 250) + 1);
    for (int r = 0; r < nranks; ++r) inputs_.push_back(input_table(r));
    return;
  }
  const int64_t a = std::min<int64_t>(m / n, 100);
  auto sum_modulus = [&] {
    int64_t p = largest_odd_at_most(a + 1);
    while (p > 1 && p % 7 == 0) p -= 2;
    return p;
  };
  switch (redop) {
    case ReduceOp::Sum:
      // bool sums are ors: a pattern of zeros and ones (see input()), as where A is 1.
      modulus_ = is_bool || a == 1 ? 3 : a == 0 ? 1 : sum_modulus();
      break;
    case ReduceOp::Avg:
      modulus_ = a <= 1 ? a + 1 : sum_modulus();
      break;
    case ReduceOp::Product:
      // Non-bool: the holder's values 0, 2, 3 (never 1, so a product of all ones, which every
      // rank's own input would equal, never occurs); bool (an and): 0 and 1.
      modulus_ = is_bool ? 2 : 3;
      break;
    case ReduceOp::Min:
    case ReduceOp::Max:
      modulus_ = is_bool ? 2 : 101;
      break;
    case ReduceOp::BAnd:
    case ReduceOp::BOr:
    case ReduceOp::BXor:
      modulus_ = is_bool ? 2 : largest_odd_at_most(std::min<int64_t>(m + 1, 256));
      break;
  }
  // The reduction over ranks, computed here from the inputs: the reference the backend is
  // checked against.
  reduced_.resize(static_cast<size_t>(period_));
  for (int64_t i = 0; i < period_; ++i) {
    int64_t acc = input(0, i);
    for (int r = 1; r < nranks; ++r) {
      const int64_t v = input(r, i);
      switch (redop) {
        case ReduceOp::Sum:
        case ReduceOp::Avg:
          acc = dtype == DType::Bool ? (acc | v) : acc + v;
          break;
        case ReduceOp::Product:
          acc *= v;
          break;
        case ReduceOp::Min:
          acc = std::min(acc, v);
          break;
        case ReduceOp::Max:
          acc = std::max(acc, v);
          break;
        case ReduceOp::BAnd:
          acc &= v;
          break;
        case ReduceOp::BOr:
          acc |= v;
          break;
        case ReduceOp::BXor:
          acc ^= v;
          break;
      }
    }
    if (redop == ReduceOp::Avg) {
      FUNCOL_CHECK(acc % n == 0, "avg pattern must divide exactly");
      acc /= n;
    }
    FUNCOL_CHECK(acc >= 0 && acc <= m, "check pattern out of the exact range");
    reduced_[static_cast<size_t>(i)] = static_cast<double>(acc);
  }
}

int64_t CheckPattern::input(int rank, int64_t i) const {
  const int64_t r = rank;
  const int64_t k = i % kCycle;
  const bool is_bool = dtype_ == DType::Bool;
  if (!has_reduce_op(op_)) {
    auto value = [&](int64_t q) { return is_bool ? hash_bit(q, k) : (13 * q + k) % modulus_; };
    // A broadcast's other ranks hold something else at every element, so one left unwritten
    // is seen.
    if (op_ == BenchOp::Broadcast && rank != root_) {
      return is_bool ? 1 - value(root_) : (value(root_) + 1) % modulus_;
    }
    return value(r);
  }
  const bool holder = (r + k) % nranks_ == 0;
  const int64_t bit = hash_bit(kResultSeed, k);
  auto mask = [&](int64_t q) { return (37 * q + 11 * k) % modulus_; };
  switch (redop_) {
    case ReduceOp::Sum:
      if (modulus_ == 3 && (is_bool || exact_limit(dtype_) / nranks_ == 1)) {
        return holder ? bit : 0;
      }
      return (7 * r + k) % modulus_;
    case ReduceOp::Avg:
      return holder ? nranks_ * (k % modulus_) : 0;
    case ReduceOp::Product: {
      if (!holder) return 1;
      if (is_bool) return bit;
      const int64_t v = static_cast<int64_t>(mix(kResultSeed, k) % 3);
      return v == 0 ? 0 : v + 1;
    }
    case ReduceOp::Min:
    case ReduceOp::Max:
      if (is_bool) return holder ? bit : (redop_ == ReduceOp::Min ? 1 : 0);
      return (7 * r + 3 * k) % modulus_;
    case ReduceOp::BAnd:
    case ReduceOp::BOr:
    case ReduceOp::BXor: {
      if (is_bool) return holder ? bit : (redop_ == ReduceOp::BAnd ? 1 : 0);
      const int64_t result = static_cast<int64_t>(mix(kResultSeed, k) % modulus_);
      if (redop_ == ReduceOp::BAnd) return holder ? result : result | mask(r);
      if (redop_ == ReduceOp::BOr) return holder ? result : result & mask(r);
      if (!holder) return mask(r);
      int64_t v = result;
      for (int64_t q = 0; q < nranks_; ++q) {
        if ((q + k) % nranks_ != 0) v ^= mask(q);
      }
      return v;
    }
  }
  FUNCOL_CHECK(false, "unknown reduce op");
}

int64_t CheckPattern::expected(int rank, int64_t j, int64_t count) const {
  switch (op_) {
    case BenchOp::AllReduce:
      return static_cast<int64_t>(reduced_[static_cast<size_t>(j % period_)]);
    case BenchOp::ReduceScatter:
      return static_cast<int64_t>(reduced_[static_cast<size_t>((rank * count + j) % period_)]);
    case BenchOp::AllGather:
      return input(static_cast<int>(j / count), j % count);
    case BenchOp::AllToAll:
      return input(static_cast<int>(j / count), rank * count + j % count);
    case BenchOp::Broadcast:
      return input(root_, j);
  }
  FUNCOL_CHECK(false, "unknown bench op");
}

std::vector<double> CheckPattern::input_table(int rank) const {
  std::vector<double> table(static_cast<size_t>(period_));
  for (int64_t i = 0; i < period_; ++i)
    table[static_cast<size_t>(i)] = static_cast<double>(input(rank, i));
  return table;
}

std::vector<CheckPattern::Segment> CheckPattern::expected_segments(int rank, int64_t count) const {
  switch (op_) {
    case BenchOp::AllReduce:
      return {{&reduced_, 0, count}};
    case BenchOp::ReduceScatter:
      return {{&reduced_, rank * count, count}};
    case BenchOp::Broadcast:
      return {{&inputs_[static_cast<size_t>(root_)], 0, count}};
    case BenchOp::AllGather:
    case BenchOp::AllToAll: {
      // Block j comes from rank j: its input from element 0 (all_gather) or from this rank's
      // block of it (all_to_all).
      std::vector<Segment> segs;
      for (int j = 0; j < nranks_; ++j) {
        segs.push_back(
            {&inputs_[static_cast<size_t>(j)], op_ == BenchOp::AllToAll ? rank * count : 0, count});
      }
      return segs;
    }
  }
  FUNCOL_CHECK(false, "unknown bench op");
}

void CheckPattern::fill_input(const Tensor& t, int rank, int rotation) const {
  FUNCOL_CHECK(t.dtype() == dtype_ && t.is_contiguous(), "fill_input needs a contiguous buffer");
  FUNCOL_CHECK(rotation == 0 || has_reduce_op(op_), "only a reduction's inputs may rotate");
  rank = (rank + rotation) % nranks_;
  const std::vector<double> table =
      has_reduce_op(op_) ? input_table(rank) : inputs_[static_cast<size_t>(rank)];
  const int64_t numel = t.numel();
  if (numel == 0) return;
  visit_dtype(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const std::vector<T> typed = typed_table<T>(table);
    T* p = static_cast<T*>(t.data_ptr());
    for (int64_t i = 0; i < numel; i += period_) {
      const int64_t len = std::min(period_, numel - i);
      std::memcpy(p + i, typed.data(), static_cast<size_t>(len) * sizeof(T));
    }
  });
}

std::vector<CheckPattern::Segment> CheckPattern::output_segments(const Tensor& out, int rank,
                                                                 int64_t count) const {
  FUNCOL_CHECK(out.dtype() == dtype_ && out.is_contiguous(),
               "a check's output must be a contiguous buffer of the pattern's dtype");
  std::vector<Segment> segs = expected_segments(rank, count);
  int64_t total = 0;
  for (const Segment& s : segs) total += s.length;
  FUNCOL_CHECK(total == out.numel(), "check: output has " + std::to_string(out.numel()) +
                                         " elements, expected " + std::to_string(total));
  return segs;
}

void CheckPattern::fill_poison(const Tensor& out, int rank, int64_t count) const {
  const std::vector<Segment> segs = output_segments(out, rank, count);
  if (out.numel() == 0) return;
  visit_dtype(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* p = static_cast<T*>(out.data_ptr());
    for (const Segment& s : segs) {
      // Expected values are in [0, exact_limit]: v - 1, or 1 for 0, is exact and differs.
      std::vector<double> poison(*s.table);
      for (double& v : poison) v = v == 0 ? 1 : v - 1;
      const std::vector<T> typed = typed_table<T>(poison);
      int64_t k = s.offset % period_;
      for (int64_t j = 0; j < s.length; ++j) {
        p[j] = typed[static_cast<size_t>(k)];
        if (++k == period_) k = 0;
      }
      p += s.length;
    }
  });
}

int64_t CheckPattern::count_wrong(const Tensor& out, int rank, int64_t count) const {
  const std::vector<Segment> segs = output_segments(out, rank, count);
  if (out.numel() == 0) return 0;
  return visit_dtype(dtype_, [&](auto tag) -> int64_t {
    using T = typename decltype(tag)::type;
    const T* p = static_cast<const T*>(out.const_data_ptr());
    int64_t wrong = 0;
    for (const Segment& s : segs) {
      const std::vector<T> typed = typed_table<T>(*s.table);
      int64_t k = s.offset % period_;
      for (int64_t j = 0; j < s.length; ++j) {
        wrong += same(p[j], typed[static_cast<size_t>(k)]) ? 0 : 1;
        if (++k == period_) k = 0;
      }
      p += s.length;
    }
    return wrong;
  });
}

// ---- options ----

namespace {

// The largest size of size_sequence(min, max, factor, step), without listing the others (-f 1
// -i 1 -e 1G has a billion).
int64_t largest_size(const BenchOptions& o) {
  if (o.step_factor == 1) {
    return o.min_bytes + (o.max_bytes - o.min_bytes) / o.step_bytes * o.step_bytes;
  }
  int64_t size = o.min_bytes;
  for (int64_t next; (next = next_size(size, o.max_bytes, o.step_factor, o.step_bytes)) >= 0;) {
    size = next;
  }
  return size;
}

// Throws InvalidArgument unless `op`'s buffers at `bytes` fit in this machine's memory on each
// of the ranks it holds: allocations under the memory's size succeed and fail only when
// written, as an out-of-memory kill.
void check_fits(const BenchOptions& o, BenchOp op, int64_t bytes) {
  const CollSizes s = coll_sizes(op, bytes, itemsize(o.dtype), o.ranks);
  // A double: in + out of a size near 8 EiB does not fit in int64.
  const double in = static_cast<double>(s.in_numel);
  const double out = static_cast<double>(s.out_numel);
  const double need = (runs_in_place(o, op) ? std::max(in, out) : in + out) *
                      static_cast<double>(itemsize(o.dtype));
  if (!fits_in_memory(ranks_on_this_machine(o.backend, o.ranks, o.join), need)) {
    throw InvalidArgument(fmt::format(
        "out of memory allocating {:.0f} bytes per rank for {} at size {}: lower -e/--maxbytes or "
        "--ranks",
        need, bench_op_name(op), bytes));
  }
}

}  // namespace

void validate(const BenchOptions& o) {
  const std::vector<std::string> available = available_backends();
  if (std::find(available.begin(), available.end(), o.backend) == available.end()) {
    throw InvalidArgument(fmt::format("unknown backend '{}' for --backend: available backends: {}",
                                      o.backend, join(available, ", ")));
  }
  if (o.ranks < 1) {
    throw InvalidArgument(fmt::format("--ranks must be at least 1, got {}", o.ranks));
  }
  check_job_options(o.backend, o.join, o.ranks);
  if (o.backend != "threads" && !inside_job(o.backend, o.join)) check_launched_ranks(o.ranks);
  if (o.min_bytes < 0 || o.max_bytes < 0) throw InvalidArgument("sizes must not be negative");
  if (o.min_bytes > o.max_bytes) {
    throw InvalidArgument(fmt::format("-b/--minbytes ({}) is larger than -e/--maxbytes ({})",
                                      o.min_bytes, o.max_bytes));
  }
  if (o.step_factor < 1) {
    throw InvalidArgument(fmt::format("-f/--stepfactor must be at least 1, got {}", o.step_factor));
  }
  if (o.step_factor == 1 && o.step_bytes < 1) {
    throw InvalidArgument(
        fmt::format("-i/--stepbytes must be at least 1 with -f 1, got {}", o.step_bytes));
  }
  if (o.iters < 1) {
    throw InvalidArgument(fmt::format("-n/--iters must be at least 1, got {}", o.iters));
  }
  if (o.warmup_iters < 0) {
    throw InvalidArgument(
        fmt::format("-w/--warmup_iters must not be negative, got {}", o.warmup_iters));
  }
  if (o.check < 0) {
    throw InvalidArgument(fmt::format("-c/--check must not be negative, got {}", o.check));
  }
  if (o.ops.empty()) throw InvalidArgument("no op to run");
  // Only a rooted op reads --root (nccl-tests: -r serves rooted ops); the others ignore it.
  if (std::any_of(o.ops.begin(), o.ops.end(), has_root) && (o.root < 0 || o.root >= o.ranks)) {
    throw InvalidArgument(fmt::format("--root {} is out of range for {} ranks (0 to {})", o.root,
                                      o.ranks, o.ranks - 1));
  }
  for (BenchOp op : o.ops) {
    if (has_reduce_op(op)) check_reduce_op_dtype(o.redop, o.dtype, bench_op_name(op));
  }
  // FUNCOL_TIMEOUT is read by the first collective, after the references and the header.
  (void)default_timeout();
  // Every size's buffers, before the run prints or runs anything (the largest needs the most).
  for (BenchOp op : o.ops) check_fits(o, op, largest_size(o));
}

// ---- references ----

int reference_cpu(int t) {
  static const std::vector<int> cpus = dist_detail::allowed_cpus();
  return cpus.size() >= 2 ? cpus[static_cast<size_t>(t)] : -1;
}

// ---- memcpy reference ----

MemcpyRef measure_memcpy(int64_t bytes) {
  FUNCOL_CHECK(bytes > 0, "memcpy reference needs a positive size");
  // At least 256 MiB per thread, so small buffers still give a stable figure.
  const int64_t reps = std::max<int64_t>(4, (int64_t{256} << 20) / bytes);
  const size_t n = static_cast<size_t>(bytes);
  // Buffers are allocated and paged in here, so the threads only copy.
  std::vector<unsigned char> src[2] = {std::vector<unsigned char>(n, 1),
                                       std::vector<unsigned char>(n, 2)};
  std::vector<unsigned char> dst[2] = {std::vector<unsigned char>(n, 0),
                                       std::vector<unsigned char>(n, 0)};
  double secs[2] = {0, 0};
  std::barrier start(2);
  auto body = [&](int t) {
    dist_detail::CpuBinding binding(reference_cpu(t));
    std::memcpy(dst[t].data(), src[t].data(), n);  // caches and TLB warm before timing
    start.arrive_and_wait();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < reps; ++r) {
      std::memcpy(dst[t].data(), src[t].data(), n);
      // Keeps the compiler from merging or dropping the repeated copies.
      asm volatile("" : : "r"(dst[t].data()) : "memory");
    }
    secs[t] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::thread a(body, 0);
  std::thread b;
  try {
    b = std::thread(body, 1);
  } catch (...) {
    start.arrive_and_drop();  // lets thread a through the barrier alone
    a.join();
    throw;
  }
  a.join();
  b.join();
  const double per_thread_bytes = static_cast<double>(bytes) * static_cast<double>(reps);
  MemcpyRef ref;
  ref.bytes = bytes;
  ref.gbps_per_thread = (per_thread_bytes / secs[0] + per_thread_bytes / secs[1]) / 2 / 1e9;
  ref.gbps_total = 2 * per_thread_bytes / std::max(secs[0], secs[1]) / 1e9;
  ref.cpus = reference_cpu(0) >= 0 ? 2 : 1;
  return ref;
}

// ---- handoff reference ----

HandoffRef measure_handoff() {
  struct alignas(64) Flag {
    std::atomic<int64_t> value{0};
  };
  Flag ping, pong;
  // Waits until `flag` differs from `seen` and returns its value: spins briefly, then yields,
  // so that two threads sharing one core (a loaded machine, a sanitizer build) still hand over
  // within a time slice.
  auto await_change = [](const Flag& flag, int64_t seen) {
    int64_t v = seen;
    dist_detail::poll_until(
        [&] { return (v = flag.value.load(std::memory_order_acquire)) != seen; }, 256);
    return v;
  };
  // The answerer echoes every ping until it reads -1.
  dist_detail::CpuBinding binding(reference_cpu(0));
  std::thread answerer([&] {
    dist_detail::CpuBinding answerer_binding(reference_cpu(1));
    for (int64_t seen = 0;;) {
      seen = await_change(ping, seen);
      if (seen < 0) return;
      pong.value.store(seen, std::memory_order_release);
    }
  });
  auto round_trip = [&](int64_t i) {
    ping.value.store(i, std::memory_order_release);
    while (await_change(pong, i - 1) != i) {
    }
  };
  // 1000 warm-up round trips, then up to 100,000 timed ones or 50 ms of them, whichever ends
  // first (the clock is read every 1024, so it costs nothing per round trip).
  constexpr int64_t kWarmup = 1000;
  constexpr int64_t kIters = 100000;
  constexpr auto kBudget = std::chrono::milliseconds(50);
  int64_t i = 1;
  for (; i <= kWarmup; ++i) round_trip(i);
  const auto t0 = std::chrono::steady_clock::now();
  auto t1 = t0;
  int64_t timed = 0;
  while (timed < kIters) {
    round_trip(i++);
    if (++timed % 1024 == 0 && (t1 = std::chrono::steady_clock::now()) - t0 >= kBudget) break;
  }
  if (timed % 1024 != 0) t1 = std::chrono::steady_clock::now();
  ping.value.store(-1, std::memory_order_release);
  answerer.join();
  return {std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(timed)};
}

// ---- the run ----

namespace {

// One measurement's buffers; in-place ops use one buffer as both.
struct Buffers {
  Tensor in;
  Tensor out;
};

// Starts one collective through the ProcessGroup primitive (no functional-API wrapper, so the
// figure is the backend's).
std::shared_ptr<Work> issue(ProcessGroup& pg, BenchOp op, const Buffers& b, ReduceOp redop,
                            int root) {
  switch (op) {
    case BenchOp::AllReduce:
      return pg.all_reduce(b.out, redop);
    case BenchOp::AllGather:
      return pg.all_gather(b.out, b.in);
    case BenchOp::ReduceScatter:
      return pg.reduce_scatter(b.out, b.in, redop);
    case BenchOp::AllToAll:
      return pg.all_to_all(b.out, b.in, {}, {});
    case BenchOp::Broadcast:
      return pg.broadcast(b.out, root);
  }
  FUNCOL_CHECK(false, "unknown bench op");
}

void run_once(ProcessGroup& pg, BenchOp op, const Buffers& b, ReduceOp redop, int root) {
  issue(pg, op, b, redop, root)->wait();
  b.out.wait();  // detaches the finished Work from the output storage
}

// Measures one size on this rank; every rank returns the same row (max time, summed #wrong).
BenchRow measure(ProcessGroup& pg, const BenchOptions& o, BenchOp op, const CheckPattern& pattern,
                 int64_t bytes) {
  const int rank = pg.rank();
  const int n = pg.size();
  BenchRow row;
  row.op = op;
  row.sizes = coll_sizes(op, bytes, itemsize(o.dtype), n);
  Buffers b;
  const bool aliased = runs_in_place(o, op);
  // validate() refused sizes whose buffers are more than the machine's memory.
  try {
    if (!aliased) {
      b.in = Tensor::empty({row.sizes.in_numel}, o.dtype);
      b.out = Tensor::empty({row.sizes.out_numel}, o.dtype);
    } else if (op == BenchOp::AllGather) {
      b.out = Tensor::empty({row.sizes.out_numel}, o.dtype);
      b.in = b.out.narrow(0, rank * row.sizes.in_numel, row.sizes.in_numel);
    } else if (op == BenchOp::ReduceScatter) {
      b.in = Tensor::empty({row.sizes.in_numel}, o.dtype);
      b.out = b.in.narrow(0, rank * row.sizes.out_numel, row.sizes.out_numel);
    } else {
      b.in = Tensor::empty({row.sizes.in_numel}, o.dtype);
      b.out = b.in;
    }
  } catch (const std::bad_alloc&) {
    throw InvalidArgument(fmt::format("out of memory allocating the buffers of {} at size {}: "
                                      "lower -e/--maxbytes or --ranks",
                                      bench_op_name(op), bytes));
  }

  // Timed data. An in-place all_reduce (or reduce_scatter) feeds each result into the next
  // call, so it starts from a fixed point of the reduce op (0, or 1 for product): values never
  // grow into overflow.
  if (op == BenchOp::AllReduce || (op == BenchOp::ReduceScatter && aliased)) {
    b.in.fill_(o.redop == ReduceOp::Product ? 1.0 : 0.0);
  } else {
    pattern.fill_input(b.in, rank);
  }
  for (int i = 0; i < o.warmup_iters; ++i) run_once(pg, op, b, o.redop, o.root);
  pg.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < o.iters; ++i) run_once(pg, op, b, o.redop, o.root);
  const double mean_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o.iters;

  // Check: fresh inputs, a poisoned output, one more call, every element compared. Every rank
  // runs all -c iterations (stopping early on one rank would desynchronise the collectives).
  int64_t wrong = 0;
  for (int c = 0; c < o.check; ++c) {
    // The poison goes first: an in-place all_gather's input is a block of its output (an
    // in-place reduce_scatter's output a block of its input, refilled next).
    if (!in_place(op)) pattern.fill_poison(b.out, rank, row.sizes.count);
    pattern.fill_input(b.in, rank);
    run_once(pg, op, b, o.redop, o.root);
    if (o.inject_wrong && rank == 0 && b.out.numel() > 0) {
      b.out.narrow(0, 0, 1).fill_(pattern.expected(rank, 0, row.sizes.count) == 0 ? 1.0 : 0.0);
    }
    wrong += pattern.count_wrong(b.out, rank, row.sizes.count);
    if (aliased && has_reduce_op(op) && n > 1) {
      // An element left unwritten holds this rank's input, which may equal the result: again
      // with the inputs rotated (same result, other own values; see fill_input).
      pattern.fill_input(b.in, rank, 1);
      run_once(pg, op, b, o.redop, o.root);
      wrong += pattern.count_wrong(b.out, rank, row.sizes.count);
    }
  }

  // Every rank's (time, #wrong), gathered so rank 0 reports the slowest rank and every error.
  Tensor mine = Tensor::from_vector<double>({mean_s, static_cast<double>(wrong)}, {2});
  Tensor all = Tensor::empty({2 * static_cast<int64_t>(n)}, DType::F64);
  pg.all_gather(all, mine)->wait();
  const std::vector<double> v = all.to_vector<double>();
  double max_s = 0;
  double wrong_sum = 0;
  for (int r = 0; r < n; ++r) {
    max_s = std::max(max_s, v[static_cast<size_t>(2 * r)]);
    wrong_sum += v[static_cast<size_t>(2 * r + 1)];
  }
  row.time_us = max_s * 1e6;
  row.algbw = max_s > 0 ? static_cast<double>(row.sizes.size_bytes) / max_s / 1e9 : 0;
  row.busbw = row.algbw * bus_factor(op, n);
  row.wrong = o.check > 0 ? static_cast<int64_t>(wrong_sum) : -1;
  return row;
}

// nccl-tests' time format: fewer decimals as the time grows.
std::string format_time(double us) {
  if (us >= 10000.0) return fmt::format("{:7.0f}", us);
  if (us >= 100.0) return fmt::format("{:7.1f}", us);
  return fmt::format("{:7.2f}", us);
}

std::string mib(int64_t bytes) {
  if (bytes % (int64_t{1} << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1 << 20));
}

void emit(std::FILE* out, std::string line) {
  line.erase(line.find_last_not_of(' ') + 1);
  line += '\n';
  write_output(out, line);
}

// Where the references' two threads ran. On one CPU they share it: memcpy is about halved and a
// handoff waits for a time slice, so the figures understate the machine (said on the line).
std::string reference_binding(const BenchOptions& o, const BenchReport& report) {
  const bool given = o.given_references.memcpy.bytes > 0;
  std::string where = report.memcpy.cpus >= 2 ? "one per CPU" : "unbound (1 CPU)";
  if (given) where += ", measured by funcol bench before it started the job";
  if (report.memcpy.cpus < 2 && std::thread::hardware_concurrency() >= 2) {
    where += ": both threads shared one CPU, so they understate this host";
  }
  return where;
}

void print_header(std::FILE* out, const BenchOptions& o, const BenchReport& report) {
  const MemcpyRef& ref = report.memcpy;
  std::vector<std::string> names;
  for (BenchOp op : o.ops) names.emplace_back(bench_op_name(op));
  const std::string ops = o.ops.size() == std::size(kAllBenchOps)
                              ? "all (" + join(names, ", ") + ")"
                              : join(names, ", ");
  // The reduce op only where a selected op reduces (rows say "none" elsewhere, as nccl-tests).
  const bool reduces = std::any_of(o.ops.begin(), o.ops.end(), has_reduce_op);
  const std::string_view rank_word = o.ranks == 1 ? "rank" : "ranks";
  // The root likewise, only where a selected op has one (validate checks it only then).
  const bool rooted = std::any_of(o.ops.begin(), o.ops.end(), has_root);
  emit(out, fmt::format("# funcol bench: op {}, backend {}, {} {}, dtype {}, redop {}, root {}",
                        ops, o.backend, o.ranks, rank_word, dtype_name(o.dtype),
                        reduces ? reduce_op_name(o.redop) : "none",
                        rooted ? std::to_string(o.root) : "none"));
  const std::string step = o.step_factor > 1 ? fmt::format("{}(factor)", o.step_factor)
                                             : fmt::format("{}(bytes)", o.step_bytes);
  emit(out, fmt::format("# minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} "
                        "validation: {}",
                        o.min_bytes, o.max_bytes, step, o.warmup_iters, o.iters, o.check));
  emit(out, fmt::format("# host: {} hardware threads", std::thread::hardware_concurrency()));
  const std::vector<int> cpus = dist_detail::allowed_cpus();
  const bool ranks_bound = o.backend == "threads" && static_cast<int>(cpus.size()) >= o.ranks;
  const std::string cpu_count = fmt::format("{} CPU{}", cpus.size(), cpus.size() == 1 ? "" : "s");
  emit(out, fmt::format("# binding: reference threads {}; rank threads {}",
                        reference_binding(o, report),
                        ranks_bound ? fmt::format("one per CPU ({})", cpu_count)
                        : o.backend == "threads"
                            ? fmt::format("unbound ({} ranks, {})", o.ranks, cpu_count)
                            : "processes of the job"));
  emit(out, fmt::format("# memcpy reference: 2 threads, {} each, {:.2f} GB/s per thread, "
                        "{:.2f} GB/s total",
                        mib(ref.bytes), ref.gbps_per_thread, ref.gbps_total));
  if (report.handoff.round_trip_ns > 0) {
    emit(out, fmt::format("# handoff reference: 2 threads, cache-line round trip {:.0f} ns",
                          report.handoff.round_trip_ns));
  }
  emit(out,
       "# size: bytes of one rank's larger buffer, as nccl-tests (all_gather: the output, "
       "reduce_scatter: the input,");
  emit(out,
       "#   all_to_all: the whole buffer); count: elements per rank per call (all_to_all: "
       "per peer)");
  emit(out,
       "# time: mean per-iteration time in us of the slowest rank (nccl-tests reports the "
       "mean over ranks by default)");
  emit(out, fmt::format("# algbw = size / time, busbw = algbw * factor, in GB/s (1e9 B/s); "
                        "factor for {} {}: all_reduce 2(n-1)/n = {:.4g},",
                        o.ranks, rank_word, bus_factor(BenchOp::AllReduce, o.ranks)));
  emit(out, fmt::format("#   all_gather, reduce_scatter, all_to_all (n-1)/n = {:.4g}, "
                        "broadcast 1",
                        bus_factor(BenchOp::AllGather, o.ranks)));
  if (o.in_place) {
    emit(out,
         "# one group of columns, --in-place: all_reduce and broadcast in place (the "
         "primitives' form), all_gather into");
    emit(out,
         "#   the output with its input the rank's block of it, reduce_scatter into the rank's "
         "block of its input; all_to_all");
    emit(out, "#   out of place (it has no in-place form)");
  } else {
    emit(out,
         "# one group of columns: all_reduce and broadcast run in place (the primitives' "
         "form), the others out of place");
  }
  emit(out, "# ratio = busbw / memcpy GB/s per thread");
}

void print_columns(std::FILE* out, BenchOp op) {
  emit(out, "#");
  emit(out, fmt::format("# {}", bench_op_name(op)));
  emit(out, fmt::format("# {:>10}  {:>12}  {:>8}  {:>7}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>6}",
                        "size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                        "#wrong", "ratio"));
  emit(out, fmt::format("# {:>10}  {:>12}  {:>8}  {:>7}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>6}",
                        "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", ""));
}

void print_row(std::FILE* out, const BenchOptions& o, const BenchRow& row,
               const BenchReport& report) {
  const MemcpyRef& ref = report.memcpy;
  const bool reduces = has_reduce_op(row.op);
  const std::string redop = reduces ? std::string(reduce_op_name(o.redop)) : "none";
  const int root = has_root(row.op) ? o.root : -1;
  const double ratio = ref.gbps_per_thread > 0 ? row.busbw / ref.gbps_per_thread : 0;
  if (o.json) {
    nlohmann::ordered_json j = {{"op", bench_op_name(row.op)},
                                {"backend", o.backend},
                                {"ranks", o.ranks},
                                {"size", row.sizes.size_bytes},
                                {"count", row.sizes.count},
                                {"type", dtype_name(o.dtype)},
                                {"redop", redop},
                                {"root", root},
                                {"time_us", row.time_us},
                                {"algbw", row.algbw},
                                {"busbw", row.busbw},
                                {"in_place", runs_in_place(o, row.op)},
                                {"memcpy_gbps", ref.gbps_per_thread},
                                {"memcpy_cpus", ref.cpus},
                                {"busbw_memcpy_ratio", ratio}};
    if (report.handoff.round_trip_ns > 0) {
      j["handoff_ns"] = report.handoff.round_trip_ns;
    }
    if (row.wrong >= 0) {
      j["wrong"] = row.wrong;
    } else {
      j["wrong"] = nullptr;
    }
    emit(out, json_line(j));
    return;
  }
  const std::string wrong = row.wrong >= 0 ? std::to_string(row.wrong) : "N/A";
  emit(out, fmt::format("{:>12}  {:>12}  {:>8}  {:>7}  {:>6}  {}  {:6.2f}  {:6.2f}  {:>6}  {:6.2f}",
                        row.sizes.size_bytes, row.sizes.count, dtype_name(o.dtype), redop, root,
                        format_time(row.time_us), row.algbw, row.busbw, wrong, ratio));
}

double mean_busbw(const std::vector<BenchRow>& rows) {
  if (rows.empty()) return 0;
  double sum = 0;
  for (const BenchRow& r : rows) sum += r.busbw;
  return sum / static_cast<double>(rows.size());
}

// One rank's benchmark: every op at every size on `world`. Rank 0 prints the rows to `out`
// and keeps them in `report`; every rank runs the same collectives.
void bench_rank(ProcessGroup& world, const BenchOptions& o,
                const std::vector<CheckPattern>& patterns, BenchReport& report, std::FILE* out) {
  const bool printer = world.rank() == 0;
  for (size_t k = 0; k < o.ops.size(); ++k) {
    const BenchOp op = o.ops[k];
    if (printer && !o.json) print_columns(out, op);
    std::vector<BenchRow> op_rows;
    // A size below one element (per rank) truncates to the row of the size before it (-b 0,
    // -f 1 with small steps): each distinct (size, count) row is measured and printed once.
    CollSizes last;
    last.count = -1;
    // One size at a time, never a list: -f 1 -i 1 -e 1G is a billion rows.
    for (int64_t bytes = o.min_bytes; bytes >= 0;
         bytes = next_size(bytes, o.max_bytes, o.step_factor, o.step_bytes)) {
      const CollSizes sizes = coll_sizes(op, bytes, itemsize(o.dtype), o.ranks);
      if (sizes.count == last.count && sizes.size_bytes == last.size_bytes) continue;
      last = sizes;
      BenchRow row = measure(world, o, op, patterns[k], bytes);
      if (!printer) continue;
      print_row(out, o, row, report);
      op_rows.push_back(row);
      report.rows.push_back(row);
    }
    if (printer && !o.json && o.ops.size() > 1) {
      emit(out, fmt::format("# Avg bus bandwidth ({}) : {:g}", bench_op_name(op),
                            mean_busbw(op_rows)));
    }
  }
}

// The memcpy reference of a run at the run's largest size, at least 1 MiB (smaller buffers
// measure the cache), at most 64 MiB (beyond that the figure no longer changes; it only costs
// time).
MemcpyRef memcpy_reference(const BenchOptions& o) {
  const int64_t bytes = std::clamp<int64_t>(largest_size(o), int64_t{1} << 20, int64_t{64} << 20);
  if (o.memcpy_gbps_override > 0) {
    return {bytes, o.memcpy_gbps_override, 2 * o.memcpy_gbps_override, 2};
  }
  return measure_memcpy(bytes);
}

// The run's references: measured here, or as the launcher measured them. The handoff reference is
// skipped when the memcpy figure is given (tests, which want neither the time nor the noise).
BenchOptions::GivenReferences measure_references(const BenchOptions& o) {
  if (o.given_references.memcpy.bytes > 0) return o.given_references;
  return {memcpy_reference(o), o.memcpy_gbps_override > 0 ? HandoffRef{} : measure_handoff()};
}

// Measures the run's references into `report` and prints the header.
void start_report(std::FILE* out, const BenchOptions& o, BenchReport& report) {
  const BenchOptions::GivenReferences refs = measure_references(o);
  report.memcpy = refs.memcpy;
  report.handoff = refs.handoff;
  if (!o.json) print_header(out, o, report);
}

void print_summary(std::FILE* out, const BenchOptions& o, const BenchReport& report) {
  if (o.json) return;
  emit(out, "#");
  if (o.check > 0) {
    emit(out, fmt::format("# Out of bounds values : {} {}", report.wrong,
                          report.wrong == 0 ? "OK" : "FAILED"));
  } else {
    emit(out, "# Out of bounds values : N/A (-c 0)");
  }
  emit(out, fmt::format("# Avg bus bandwidth    : {:g}", report.avg_busbw));
  emit(out, "#");
}

void finish_report(BenchReport& report) {
  for (const BenchRow& r : report.rows) report.wrong += std::max<int64_t>(r.wrong, 0);
  report.avg_busbw = mean_busbw(report.rows);
}

// This process is one rank of an mpi or gloo job: join the world, run, leave. Rank 0 measures
// the memcpy reference (its peers wait in their first collective) and prints everything.
BenchReport run_process_rank(const BenchOptions& o, std::FILE* out) {
  std::shared_ptr<ProcessGroup> world = init_process_group(o.backend, o.join);
  const int rank = world->rank();
  BenchReport report;
  std::exception_ptr failure;
  try {
    if (world->size() != o.ranks) {
      throw InvalidArgument(fmt::format("--ranks {} does not match the job's {} processes",
                                        o.ranks, world->size()));
    }
    // Ranks started by hand with different sizes, ops or counts would pair other collectives.
    check_same_flags(*world, bench_job_args(o), "flags (sizes, ops, dtype, counts, --root)");
    std::vector<CheckPattern> patterns;
    for (BenchOp op : o.ops) patterns.emplace_back(op, o.redop, o.dtype, o.ranks, o.root);
    if (rank == 0) {
      start_report(out, o, report);
    }
    bench_rank(*world, o, patterns, report, out);
    finish_report(report);
    if (rank == 0) print_summary(out, o, report);
  } catch (...) {
    note_departure_error();
    try {
      rethrow_for_rank(rank);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  // No group may outlive the process group (mpi frees communicators before MPI_Finalize).
  world.reset();
  destroy_process_group();
  if (failure) std::rethrow_exception(failure);
  return report;
}

}  // namespace

BenchReport run_bench(const BenchOptions& o, std::FILE* out) {
  validate(o);
  if (o.backend != "threads") {
    if (!inside_job(o.backend, o.join)) {
      throw InvalidArgument(fmt::format(
          "run_bench: backend '{}' runs in a job's processes (started by funcol bench or mpirun)",
          o.backend));
    }
    return run_process_rank(o, out);
  }
  BenchReport report;
  // The references run before the ranks start, so nothing else competes with them.
  start_report(out, o, report);

  std::vector<CheckPattern> patterns;
  for (BenchOp op : o.ops) patterns.emplace_back(op, o.redop, o.dtype, o.ranks, o.root);
  LocalOptions local;
  local.bind_threads = true;  // one rank per CPU, as the references' threads
  run_local(
      o.ranks, [&](ProcessGroup& world) { bench_rank(world, o, patterns, report, out); },
      local);
  finish_report(report);
  print_summary(out, o, report);
  return report;
}

std::vector<std::string> bench_job_args(const BenchOptions& o) {
  std::string ops;
  if (o.ops.size() == 1) {
    ops = bench_op_name(o.ops[0]);
  } else if (std::equal(o.ops.begin(), o.ops.end(), std::begin(kAllBenchOps),
                        std::end(kAllBenchOps))) {
    ops = "all";
  } else {
    throw InvalidArgument(fmt::format(
        "a {} job of funcol bench runs one op or all of them, got {} ops", o.backend,
        o.ops.size()));
  }
  std::vector<std::string> a = {"bench",
                                "-b", std::to_string(o.min_bytes),
                                "-e", std::to_string(o.max_bytes),
                                "-f", std::to_string(o.step_factor),
                                "-i", std::to_string(o.step_bytes),
                                "-n", std::to_string(o.iters),
                                "-w", std::to_string(o.warmup_iters),
                                "-c", std::to_string(o.check),
                                "-o", ops,
                                "-d", std::string(dtype_name(o.dtype)),
                                "-r", std::string(reduce_op_name(o.redop)),
                                "--root", std::to_string(o.root),
                                "--ranks", std::to_string(o.ranks),
                                "--backend", o.backend};
  if (o.json) a.emplace_back("--json");
  if (o.in_place) a.emplace_back("--in-place");
  if (o.inject_wrong) a.emplace_back("--inject-wrong");
  const BenchOptions::GivenReferences& refs = o.given_references;
  if (refs.memcpy.bytes > 0) {
    a.emplace_back("--references");
    a.push_back(fmt::format("{}:{}:{}:{}:{}", refs.memcpy.bytes, refs.memcpy.gbps_per_thread,
                            refs.memcpy.gbps_total, refs.memcpy.cpus,
                            refs.handoff.round_trip_ns));
  }
  return a;
}

// ---- the command ----

namespace {

// Flag values as typed, parsed in the callback so every bad value is a funcol error (exit 1)
// that names the flag.
struct BenchFlags {
  std::string min_bytes = "32";
  std::string max_bytes = "32M";
  std::string step_factor = "2";
  std::string step_bytes = "1M";
  std::string iters = "20";
  std::string warmup_iters = "5";
  std::string check = "1";
  std::string op = "all";
  std::string dtype = "f32";
  std::string redop = "sum";
  std::string root = "0";
  std::string ranks = "2";
  bool ranks_typed = true;  // false: --ranks defaults to the world size of the job joined
  std::string backend = "threads";
  JobFlags job;  // --rank, --world-size, --store
  bool json = false;
  bool in_place = false;
  bool inject_wrong = false;
  std::string references;  // hidden: the launcher's references (BenchOptions::given_references)
};

// How the run is placed: the backend, the job it joins, its ranks.
BenchOptions job_from_flags(const BenchFlags& f) {
  BenchOptions o;
  o.backend = f.backend;
  o.join = parse_job_flags(f.job);
  const int ranks = static_cast<int>(parse_int(f.ranks, "--ranks", 1));
  o.ranks =
      resolve_ranks(o.backend, o.join, f.ranks_typed ? std::optional<int>(ranks) : std::nullopt,
                    /*fallback=*/ranks);
  return o;
}

// --references BYTES:GBPS_PER_THREAD:GBPS_TOTAL:CPUS:HANDOFF_NS, as bench_job_args writes it.
BenchOptions::GivenReferences parse_references(const std::string& text) {
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  auto bad = [&] {
    return InvalidArgument(fmt::format(
        "--references '{}': expected BYTES:GBPS_PER_THREAD:GBPS_TOTAL:CPUS:HANDOFF_NS, positive "
        "numbers (CPUS 1 or 2; HANDOFF_NS 0: not measured)",
        text));
  };
  if (parts.size() != 5) throw bad();
  double v[5];
  for (size_t i = 0; i < 5; ++i) {
    try {
      size_t used = 0;
      v[i] = std::stod(parts[i], &used);
      if (used != parts[i].size() || !std::isfinite(v[i]) || v[i] < 0) throw bad();
    } catch (const std::logic_error&) {
      throw bad();
    }
  }
  if (v[0] < 1 || v[0] != std::floor(v[0]) || v[1] <= 0 || v[2] <= 0 ||
      (v[3] != 1 && v[3] != 2)) {
    throw bad();
  }
  BenchOptions::GivenReferences refs;
  refs.memcpy = {static_cast<int64_t>(v[0]), v[1], v[2], static_cast<int>(v[3])};
  refs.handoff.round_trip_ns = v[4];
  return refs;
}

// The rest of the flags into `o`, checked (validate).
void run_from_flags(const BenchFlags& f, BenchOptions& o) {
  o.min_bytes = parse_size(f.min_bytes, "-b/--minbytes");
  o.max_bytes = parse_size(f.max_bytes, "-e/--maxbytes");
  o.step_factor = parse_int(f.step_factor, "-f/--stepfactor", 1);
  o.step_bytes = parse_size(f.step_bytes, "-i/--stepbytes");
  o.iters = static_cast<int>(parse_int(f.iters, "-n/--iters", 1));
  o.warmup_iters = static_cast<int>(parse_int(f.warmup_iters, "-w/--warmup_iters", 0));
  o.check = static_cast<int>(parse_int(f.check, "-c/--check", 0));
  o.ops = parse_bench_ops(f.op);
  o.dtype = parse_bench_dtype(f.dtype);
  o.redop = parse_bench_redop(f.redop);
  // Any integer: only a broadcast checks it (validate), as nccl-tests prints root -1 elsewhere.
  o.root = static_cast<int>(parse_int(f.root, "--root", -INT_MAX));
  o.json = f.json;
  o.in_place = f.in_place;
  o.inject_wrong = f.inject_wrong;
  if (!f.references.empty()) o.given_references = parse_references(f.references);
  validate(o);
}

}  // namespace

void add_bench_command(CLI::App& app) {
  CLI::App* sub = app.add_subcommand(
      "bench",
      "collective micro-benchmarks in the nccl-tests format (size count type redop root "
      "time algbw busbw #wrong)");
  auto f = std::make_shared<BenchFlags>();
  sub->add_option("-b,--minbytes", f->min_bytes,
                  "smallest size in bytes; K, M, G suffixes are 1024-based")
      ->type_name("SIZE")
      ->capture_default_str();
  sub->add_option("-e,--maxbytes", f->max_bytes, "largest size in bytes")
      ->type_name("SIZE")
      ->capture_default_str();
  sub->add_option("-f,--stepfactor", f->step_factor, "multiply the size by this between rows")
      ->type_name("INT")
      ->capture_default_str();
  sub->add_option("-i,--stepbytes", f->step_bytes, "add this many bytes between rows when -f is 1")
      ->type_name("SIZE")
      ->capture_default_str();
  sub->add_option("-n,--iters", f->iters, "timed iterations per size")
      ->type_name("INT")
      ->capture_default_str();
  sub->add_option("-w,--warmup_iters,--warmup-iters", f->warmup_iters,
                  "untimed iterations before timing")
      ->type_name("INT")
      ->capture_default_str();
  sub->add_option("-c,--check", f->check,
                  "check every element this many times after timing (0: no check)")
      ->type_name("INT")
      ->capture_default_str();
  sub->add_option("-o,--op", f->op,
                  "all_reduce, all_gather, reduce_scatter, all_to_all, broadcast or all")
      ->type_name("OP")
      ->capture_default_str();
  sub->add_option("-d,--datatype", f->dtype,
                  "element type: bool u8 i8 i16 i32 i64 f16 bf16 f32 f64 (or nccl-tests' "
                  "names: float half bfloat16 double int8 uint8 int32 int64 ...)")
      ->type_name("DTYPE")
      ->capture_default_str();
  sub->add_option("-r,--redop", f->redop,
                  "reduce op of all_reduce and reduce_scatter: sum avg product (or prod) min "
                  "max band bor bxor")
      ->type_name("REDOP")
      ->capture_default_str();
  sub->add_option("--root", f->root, "source rank of broadcast")
      ->type_name("RANK")
      ->capture_default_str();
  CLI::Option* ranks =
      sub->add_option("--ranks", f->ranks,
                      "number of ranks (inside an mpirun or gloo job: its world size)")
          ->type_name("N")
          ->capture_default_str();
  sub->add_option("--backend", f->backend,
                  "communication backend (built: " + join(available_backends(), ", ") +
                      "); mpi starts mpirun, gloo starts processes, or with --rank joins a job "
                      "as one of them")
      ->type_name("NAME")
      ->capture_default_str();
  add_job_flags(*sub, f->job);
  sub->add_flag("--json", f->json, "print one JSON object per size instead of the table");
  sub->add_flag("--in-place", f->in_place,
                "all_gather's input is the rank's block of its output, reduce_scatter's output "
                "the rank's block of its input (nccl-tests' in-place columns; all_to_all stays "
                "out of place; -c checks an in-place reduction twice, the second time with the "
                "ranks' inputs rotated, so that elements left unwritten show)");
  // Hidden (no group): proves end to end that a wrong value fails the run.
  sub->add_flag("--inject-wrong", f->inject_wrong, "corrupt one output element per size")
      ->group("");
  // Hidden: the references funcol bench measured before it started an mpi or gloo job.
  sub->add_option("--references", f->references, "the launcher's reference figures")->group("");
  sub->callback([f, ranks]() {
    BenchReport report;
    try {
      f->ranks_typed = ranks->count() > 0;
      BenchOptions o = job_from_flags(*f);
      const bool rank_of_job = o.backend != "threads" && inside_job(o.backend, o.join);
      if (!rank_of_job) {
        run_from_flags(*f, o);
      } else if (!rank_checks_pass(o.backend, o.ranks, o.join, stderr,
                                   [&] { run_from_flags(*f, o); })) {
        throw CLI::RuntimeError(1);
      }
      if (o.backend != "threads" && !rank_of_job) {
        // Start the job; its rank 0 prints the table and reports wrong values itself. The
        // references are measured here first, on this process's CPUs with nothing else running:
        // mpirun binds each rank to one CPU, where rank 0's two reference threads would share it.
        o.given_references = measure_references(o);
        JobOptions job;
        job.backend = o.backend;
        job.ranks = o.ranks;
        job.temp_prefix = "funcol-bench-";
        job.rank_args = [&](const std::string&) { return bench_job_args(o); };
        const int rc = launch_job(job, stderr);
        if (rc != 0) throw CLI::RuntimeError(rc);
        return;
      }
      report = run_bench(o, stdout);
    } catch (const Error&) {
      throw;
    } catch (const std::bad_alloc&) {
      throw InvalidArgument("bench: out of memory: lower -e/--maxbytes or --ranks");
    } catch (const std::system_error& e) {
      throw Error(fmt::format("bench: {}", e.what()));
    }
    if (report.wrong > 0) {
      std::fprintf(stderr, "funcol: error: bench: %lld wrong values\n",
                   static_cast<long long>(report.wrong));
      throw CLI::RuntimeError(1);  // exit status 1, after the report
    }
  });
}

}  // namespace funcol::tools
