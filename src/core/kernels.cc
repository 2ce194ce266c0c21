// CPU kernels: collective reductions on raw buffers, dtype conversion and tensor math.
#include "funcol/core/kernels.h"

#include <fmt/format.h>

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "elem.h"
#include "gemm.h"
#include "memory.h"
#include "simd.h"
#include "strided.h"

namespace funcol {

using detail::BoolByte;
using detail::cvt;
using detail::dispatch;
using detail::kIsLowFloat;

namespace detail {

std::atomic<bool> reduce_avx2_disabled{false};

bool have_avx2() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have && !reduce_avx2_disabled.load(std::memory_order_relaxed);
}

}  // namespace detail

namespace {

// ---------------------------------------------------------------------------------------------
// Reduction kernels.
//
// Loops are written as fixed 16-element inner loops over __restrict pointers: g++ -O2 uses the
// "very cheap" vectoriser cost model, which only vectorises loops whose trip count is a known
// multiple of the vector width and needs no runtime alias check, so a plain `for (i < n)` loop
// would stay scalar. The block helpers are noinline so that their __restrict parameters
// survive (inlined into the caller, the compiler loses them and stops vectorising).

constexpr int64_t kLanes = 16;
// Elements per accumulation block: the accumulator (<= 16 KiB) stays in L1.
constexpr int64_t kBlock = 2048;

// How a storage type is read in the reduction loops: Raw is the element as loaded (f16/bf16 as
// their 16 bits, bool as a byte), Acc what it accumulates in (f16/bf16 in f32; bool as 0/1).
template <typename T>
using RawOf = std::conditional_t<kIsLowFloat<T>, uint16_t,
                                 std::conditional_t<std::is_same_v<T, BoolByte>, uint8_t, T>>;
template <typename T>
using AccOf = std::conditional_t<kIsLowFloat<T>, float,
                                 std::conditional_t<std::is_same_v<T, BoolByte>, uint8_t, T>>;

// Unsigned type at least 32 bits wide: integer sum/product wrap there without UB (narrower
// unsigned types would promote to int and could overflow it).
template <typename A>
using WideUnsigned = std::conditional_t<(sizeof(A) < 4), uint32_t, std::make_unsigned_t<A>>;

template <typename T>
inline AccOf<T> to_acc(RawOf<T> v) {
  if constexpr (std::is_same_v<T, BoolByte>) {
    return static_cast<uint8_t>(v != 0);
  } else if constexpr (std::is_same_v<T, Eigen::half>) {
    return detail::half_bits_to_float(v);
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    return detail::bf16_bits_to_float(v);
  } else {
    return v;
  }
}

template <typename T>
inline RawOf<T> from_acc(AccOf<T> a) {
  if constexpr (std::is_same_v<T, Eigen::half>) {
    return detail::float_to_half_bits(a);
  } else if constexpr (std::is_same_v<T, Eigen::bfloat16>) {
    return detail::float_to_bf16_bits(a);
  } else {
    return a;
  }
}

struct OpSum {
  template <typename A>
  static A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using W = WideUnsigned<A>;
      return static_cast<A>(static_cast<W>(a) + static_cast<W>(b));
    } else {
      return a + b;
    }
  }
};
struct OpProd {
  template <typename A>
  static A apply(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using W = WideUnsigned<A>;
      return static_cast<A>(static_cast<W>(a) * static_cast<W>(b));
    } else {
      return a * b;
    }
  }
};
// The bits of two floats of equal value (a zero of either sign) or-ed (a negative zero if
// either is) or and-ed (a positive zero if either is); other equal floats have equal bits.
template <typename A>
using BitsOf = std::conditional_t<sizeof(A) == 4, uint32_t, uint64_t>;
template <typename A>
inline A or_bits(A a, A b) {
  return std::bit_cast<A>(static_cast<BitsOf<A>>(std::bit_cast<BitsOf<A>>(a) |
                                                 std::bit_cast<BitsOf<A>>(b)));
}
template <typename A>
inline A and_bits(A a, A b) {
  return std::bit_cast<A>(static_cast<BitsOf<A>>(std::bit_cast<BitsOf<A>>(a) &
                                                 std::bit_cast<BitsOf<A>>(b)));
}

// Of two NaNs, the one whose bits are the larger unsigned integer: which NaN a min or max of
// several gives then does not depend on the order they are combined in.
template <typename A>
inline A larger_nan(A a, A b) {
  return std::bit_cast<BitsOf<A>>(a) >= std::bit_cast<BitsOf<A>>(b) ? a : b;
}

// Min and max propagate NaN (as torch.minimum / torch.maximum; of several NaNs, larger_nan's),
// and order -0 below +0 (IEEE 754-2019 minimum and maximum): the result does not depend on the
// order in which the ranks' values are combined, so every backend (MPI and Gloo combine in
// their own order) gives the same bits.
struct OpMin {
  template <typename A>
  static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) {
      return a < b   ? a
             : b < a ? b
             : a != a ? (b != b ? larger_nan(a, b) : a)
             : b != b ? b
                      : or_bits(a, b);
    } else {
      return a < b ? a : b;
    }
  }
};
struct OpMax {
  template <typename A>
  static A apply(A a, A b) {
    if constexpr (std::is_floating_point_v<A>) {
      return a > b   ? a
             : b > a ? b
             : a != a ? (b != b ? larger_nan(a, b) : a)
             : b != b ? b
                      : and_bits(a, b);
    } else {
      return a > b ? a : b;
    }
  }
};
struct OpAnd {
  template <typename A>
  static A apply(A a, A b) {
    return static_cast<A>(a & b);
  }
};
struct OpOr {
  template <typename A>
  static A apply(A a, A b) {
    return static_cast<A>(a | b);
  }
};
struct OpXor {
  template <typename A>
  static A apply(A a, A b) {
    return static_cast<A>(a ^ b);
  }
};

// Average of an accumulated value over n sources: integers truncate toward zero.
template <typename A>
inline A avg_of(A a, int64_t n) {
  if constexpr (std::is_integral_v<A>) {
    return static_cast<A>(static_cast<int64_t>(a) / n);
  } else {
    return a / static_cast<A>(n);
  }
}

template <typename T>
[[gnu::noinline]] void load_block(AccOf<T>* __restrict acc, const RawOf<T>* __restrict src,
                                  int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[i + j] = to_acc<T>(src[i + j]);
  }
  for (; i < n; ++i) acc[i] = to_acc<T>(src[i]);
}

template <typename T, typename Op>
[[gnu::noinline]] void combine_block(AccOf<T>* __restrict acc, const RawOf<T>* __restrict src,
                                     int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      acc[i + j] = Op::apply(acc[i + j], to_acc<T>(src[i + j]));
    }
  }
  for (; i < n; ++i) acc[i] = Op::apply(acc[i], to_acc<T>(src[i]));
}

template <typename T>
[[gnu::noinline]] void store_block(RawOf<T>* __restrict out, const AccOf<T>* __restrict acc,
                                   int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) out[i + j] = from_acc<T>(acc[i + j]);
  }
  for (; i < n; ++i) out[i] = from_acc<T>(acc[i]);
}

template <typename T>
[[gnu::noinline]] void store_block_avg(RawOf<T>* __restrict out, const AccOf<T>* __restrict acc,
                                       int64_t n, int64_t divisor) {
  using A = AccOf<T>;
  if constexpr (std::is_floating_point_v<A>) {
    const A d = static_cast<A>(divisor);
    int64_t i = 0;
    if (std::has_single_bit(static_cast<uint64_t>(divisor))) {
      // x / 2^k is x * 2^-k exactly (one rounding of the same value), and a multiply costs a
      // fraction of a divide: the 2-rank average.
      const A r = A{1} / d;
      for (; i + kLanes <= n; i += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) out[i + j] = from_acc<T>(acc[i + j] * r);
      }
      for (; i < n; ++i) out[i] = from_acc<T>(acc[i] * r);
      return;
    }
    for (; i + kLanes <= n; i += kLanes) {
      for (int64_t j = 0; j < kLanes; ++j) out[i + j] = from_acc<T>(acc[i + j] / d);
    }
    for (; i < n; ++i) out[i] = from_acc<T>(acc[i] / d);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = from_acc<T>(avg_of(acc[i], divisor));
  }
}

// Whether lanes that added up r - r of each result r (0 when finite, NaN when not), and `rest`,
// which did so for the results past the last whole lane group, met a result that is not finite.
template <typename A>
inline bool any_not_finite(const A (&lanes)[kLanes], A rest) {
  for (int64_t j = 0; j < kLanes; ++j) rest += lanes[j];
  return rest != rest;
}

// combine_block of a floating sum's or product's last source that also tells whether a result
// is not finite: lanes add up r - r of each result r (0 when finite, NaN when not), two more
// operations on registers. (A separate pass over the block cost 10-20% of a 3-source average.)
template <typename T, typename Op>
[[gnu::noinline]] bool combine_last_block(AccOf<T>* __restrict acc,
                                          const RawOf<T>* __restrict src, int64_t n) {
  using A = AccOf<T>;
  A lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const A r = Op::apply(acc[i + j], to_acc<T>(src[i + j]));
      acc[i + j] = r;
      lanes[j] += r - r;
    }
  }
  A rest = 0;
  for (; i < n; ++i) {
    const A r = Op::apply(acc[i], to_acc<T>(src[i]));
    acc[i] = r;
    rest += r - r;
  }
  return any_not_finite(lanes, rest);
}

// A floating sum, product or average (avg's Op is OpSum) with NaN sources is the first of them
// in rank order, quieted, wherever the output is and wherever the element sits. Of two NaNs the
// hardware keeps one by the order of the instruction's operands, which the compiler picks per
// loop: an in-place 2-rank all_reduce and a bucket's separate output kept different ranks'
// NaNs, and 4-source sums other bits in a loop's vector body than in its tail. (Min and max
// choose their NaN themselves: larger_nan.) x + x is NaN x quieted, as an operation returns it.
template <typename A, typename Op>
constexpr bool kKeepsFirstNan =
    std::is_floating_point_v<A> && (std::is_same_v<Op, OpSum> || std::is_same_v<Op, OpProd>);

// The first NaN of element i of the sources in rank order, quieted, in `nan` (kKeepsFirstNan);
// false when none is NaN.
template <typename T>
bool first_nan_source(const RawOf<T>* const* srcs, int nsrc, int64_t i, AccOf<T>* nan) {
  using A = AccOf<T>;
  for (int k = 0; k < nsrc; ++k) {
    const A v = to_acc<T>(srcs[k][i]);
    if (v != v) {
      *nan = v + v;
      return true;
    }
  }
  return false;
}

// Each NaN of a floating sum's or product's block `acc` with NaN sources becomes theirs.
template <typename T>
void mend_nans(AccOf<T>* acc, const RawOf<T>* const* srcs, int nsrc, int64_t start, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (acc[i] != acc[i]) first_nan_source<T>(srcs, nsrc, start + i, &acc[i]);
  }
}

// The floating average of `nsrc` sources whose sum `acc` is not finite (overflowed, or met an
// infinite source after overflowing): the sources scaled by 2^-m (2^m >= nsrc) are summed, then
// divided by nsrc * 2^-m. Scaling large magnitudes by a power of two is exact, so the result
// rounds as the sum and division would with no limit on the exponent (but for a source so small
// that scaled it loses bits): the average of 3e38 and 3e38 in f32 is 3e38, not inf (NCCL
// averages floats without overflow too, scaling each source by 1/nsrc). A sum that is infinite
// or NaN because sources are stays so ([3e38, 3e38, -inf] gives -inf, not NaN).
template <typename T>
AccOf<T> avg_past_overflow(const RawOf<T>* const* srcs, int nsrc, int64_t i) {
  using A = AccOf<T>;
  int m = 0;
  while ((int64_t{1} << m) < nsrc) ++m;
  const A scale = std::ldexp(A{1}, -m);
  A sum = to_acc<T>(srcs[0][i]) * scale;
  for (int k = 1; k < nsrc; ++k) sum += to_acc<T>(srcs[k][i]) * scale;
  return sum / (static_cast<A>(nsrc) * scale);
}

// Any number of sources, any aliasing of `out` with a source: each block of every source is
// read into the accumulator before that block of `out` is written.
template <typename T, typename Op>
void reduce_blocked(RawOf<T>* out, const RawOf<T>* const* srcs, int nsrc, int64_t count, bool avg) {
  using A = AccOf<T>;
  A acc[kBlock];
  for (int64_t start = 0; start < count; start += kBlock) {
    const int64_t n = std::min(kBlock, count - start);
    load_block<T>(acc, srcs[0] + start, n);
    // A floating sum, product or average (whose Op is OpSum) combines its last source checking
    // for results that are not finite: NaNs to mend, an average's overflowed sum. With one
    // source there is none.
    constexpr bool kArith = kKeepsFirstNan<A, Op>;
    const bool checked = kArith && nsrc > 1;
    const int unchecked = checked ? nsrc - 1 : nsrc;
    for (int k = 1; k < unchecked; ++k) combine_block<T, Op>(acc, srcs[k] + start, n);
    bool not_finite = false;
    if constexpr (kArith) {
      not_finite = checked && combine_last_block<T, Op>(acc, srcs[nsrc - 1] + start, n);
    }
    if (!avg) {
      if constexpr (kArith) {
        if (not_finite) mend_nans<T>(acc, srcs, nsrc, start, n);
      }
      store_block<T>(out + start, acc, n);
      continue;
    }
    if constexpr (std::is_floating_point_v<A>) {
      if (not_finite) {
        // Element by element: element i of every source is read before out[i] is written. A
        // NaN without NaN sources is an overflowed sum that met an infinity.
        for (int64_t i = 0; i < n; ++i) {
          A v = acc[i] / static_cast<A>(nsrc);
          if (!std::isfinite(acc[i]) && !first_nan_source<T>(srcs, nsrc, start + i, &v)) {
            v = avg_past_overflow<T>(srcs, nsrc, start + i);
          }
          out[start + i] = from_acc<T>(v);
        }
        continue;
      }
    }
    store_block_avg<T>(out + start, acc, n, nsrc);
  }
}

// Two sources in native precision (the hot path of a 2-rank all_reduce). kAvg halves.
template <typename T, typename Op, bool kAvg>
inline T combine2(T a, T b) {
  T r = Op::apply(a, b);
  if constexpr (kAvg) r = avg_of(r, 2);
  return r;
}

template <typename T, typename Op, bool kAvg>
[[gnu::always_inline]] inline void reduce2_distinct(T* __restrict out, const T* __restrict a,
                                                    const T* __restrict b, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) out[i + j] = combine2<T, Op, kAvg>(a[i + j], b[i + j]);
  }
  for (; i < n; ++i) out[i] = combine2<T, Op, kAvg>(a[i], b[i]);
}

// out == a.
template <typename T, typename Op, bool kAvg>
[[gnu::always_inline]] inline void reduce2_into_a(T* __restrict a, const T* __restrict b,
                                                  int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) a[i + j] = combine2<T, Op, kAvg>(a[i + j], b[i + j]);
  }
  for (; i < n; ++i) a[i] = combine2<T, Op, kAvg>(a[i], b[i]);
}

// out == b.
template <typename T, typename Op, bool kAvg>
[[gnu::always_inline]] inline void reduce2_into_b(const T* __restrict a, T* __restrict b,
                                                  int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) b[i + j] = combine2<T, Op, kAvg>(a[i + j], b[i + j]);
  }
  for (; i < n; ++i) b[i] = combine2<T, Op, kAvg>(a[i], b[i]);
}

// The two-source reduction (every 2-rank reduction), its loops compiled for the baseline ISA
// or, on a CPU that has it, AVX2: twice the elements per instruction. The results are the same
// either way (no FMA is enabled, nothing is reassociated).
template <typename T, typename Op, bool kAvg>
[[gnu::always_inline]] inline void reduce2_plain(T* out, const T* a, const T* b, int64_t n) {
  if (out == a) {
    reduce2_into_a<T, Op, kAvg>(out, b, n);
  } else if (out == b) {
    reduce2_into_b<T, Op, kAvg>(a, out, n);
  } else {
    reduce2_distinct<T, Op, kAvg>(out, a, b, n);
  }
}

// out[i] = f(a[i], b[i]) (f(x, y, r) sets r), f applied to explicit vectors of 32 bytes, then to
// the elements left (f is generic: its selects work on both; its vectors go by reference, which
// leaves the baseline ABI alone). Each element's sources are read before its result is written,
// so `out` may be either source.
template <typename T, typename F>
[[gnu::always_inline]] inline void map2_vectors(T* out, const T* a, const T* b, int64_t n, F f) {
  typedef T V __attribute__((vector_size(32)));
  constexpr int64_t kWidth = 32 / sizeof(T);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    V va;
    V vb;
    std::memcpy(&va, a + i, sizeof(V));
    std::memcpy(&vb, b + i, sizeof(V));
    V v;
    f(va, vb, v);
    std::memcpy(out + i, &v, sizeof(V));
  }
  for (; i < n; ++i) f(a[i], b[i], out[i]);
}

// A floating sum or product of two sources into `out`, which may be either source, keeping the
// first NaN source (kKeepsFirstNan). Of one NaN source the hardware keeps that one, quieted,
// whatever the order of the operands, so only where `a` is NaN is the result chosen: `a`,
// quieted. Selected in explicit vectors (the vectoriser leaves a loop with a select scalar).
template <typename T, typename Op>
[[gnu::always_inline]] inline void reduce2_float(T* out, const T* a, const T* b, int64_t n) {
  map2_vectors(out, a, b, n, [](const auto& x, const auto& y, auto& v) {
    const auto r = std::is_same_v<Op, OpSum> ? x + y : x * y;
    v = x != x ? x + x : r;
  });
}

// dst = (a + b) / 2, in lanes that also add up r - r of each result r (0 when finite, NaN when
// not): whether any result may be infinite, for two more operations on registers. (A separate
// pass over the results cost more than the average itself.)
template <typename T>
[[gnu::always_inline]] inline bool halve_sums(T* __restrict dst, const T* __restrict a,
                                              const T* __restrict b, int64_t n) {
  T lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const T r = (a[i + j] + b[i + j]) * T{0.5};
      dst[i + j] = r;
      lanes[j] += r - r;
    }
  }
  T rest = 0;
  for (; i < n; ++i) {
    const T r = (a[i] + b[i]) * T{0.5};
    dst[i] = r;
    rest += r - r;
  }
  return any_not_finite(lanes, rest);
}

// The floating average of two sources, `out` one of them: (a + b) / 2, or where that is not
// finite, a / 2 + b / 2 (see avg_past_overflow; the same where a source is not finite). Both
// are computed and one selected, in explicit vectors (the vectoriser leaves a loop with a
// select scalar, 6x slower): about 15% slower than the halved sum alone in a 2-rank all_reduce
// of 256 KiB-1 MiB, where the check of halve_sums needs a second pass or a copy, as the
// overwritten source would be lost for an element found infinite (20-60% slower).
template <typename T>
[[gnu::always_inline]] inline void avg2_in_place(T* out, const T* a, const T* b, int64_t n) {
  map2_vectors(out, a, b, n, [](const auto& x, const auto& y, auto& v) {
    using W = std::remove_cvref_t<decltype(x)>;
    const W half = W{} + T{0.5};
    const W r = (x + y) * half;
    v = r - r == W{} ? r : x != x ? x + x : x * half + y * half;
  });
}

// The floating average of two sources: in place, avg2_in_place; else (a + b) / 2 block by
// block, each block checked as it is written, and where a halved sum is infinite, the halved
// sources added instead.
template <typename T>
[[gnu::always_inline]] inline void avg2_checked(T* out, const T* a, const T* b, int64_t count) {
  if (out == a || out == b) {
    avg2_in_place<T>(out, a, b, count);
    return;
  }
  for (int64_t start = 0; start < count; start += kBlock) {
    const int64_t n = std::min(kBlock, count - start);
    if (!halve_sums<T>(out + start, a + start, b + start, n)) continue;
    for (int64_t i = start; i < start + n; ++i) {
      if (a[i] != a[i]) {
        out[i] = a[i] + a[i];
      } else if (std::isinf(out[i])) {
        out[i] = a[i] * T{0.5} + b[i] * T{0.5};
      }
    }
  }
}

template <typename T, typename Op, bool kAvg>
[[gnu::always_inline]] inline void reduce2(T* out, const T* a, const T* b, int64_t n) {
  if constexpr (kAvg && std::is_floating_point_v<T>) {
    avg2_checked<T>(out, a, b, n);
  } else if constexpr (kKeepsFirstNan<T, Op>) {
    reduce2_float<T, Op>(out, a, b, n);
  } else {
    reduce2_plain<T, Op, kAvg>(out, a, b, n);
  }
}

template <typename T, typename Op, bool kAvg>
__attribute__((target("avx2"))) void reduce2_avx2(T* out, const T* a, const T* b, int64_t n) {
  reduce2<T, Op, kAvg>(out, a, b, n);  // inlined: compiled for AVX2 here
}

template <typename T, typename Op>
void reduce_typed(void* out_ptr, const void* const* src_ptrs, int nsrc, int64_t count, bool avg) {
  using R = RawOf<T>;
  auto* out = static_cast<R*>(out_ptr);
  const R* const* srcs = reinterpret_cast<const R* const*>(src_ptrs);
  if (nsrc == 1 && !avg) {
    // Every op of one source is that source: a copy of its bytes as they are, for every dtype
    // (a one-rank collective leaves a bool byte of 2 or a NaN's payload alone, as the in-place
    // form does). The block loop made a single-rank bucket of 1000 x 4 KiB reduce_scatters
    // 0.52-0.55 ms in fusion_bench, memmove 0.49-0.52.
    if (out != srcs[0]) std::memmove(out, srcs[0], static_cast<size_t>(count) * sizeof(R));
    return;
  }
  // Native types only: f16/bf16 need the f32 accumulator, bool the 0/1 normalisation.
  if constexpr (std::is_same_v<AccOf<T>, T>) {
    if (nsrc == 2) {
      const R* a = srcs[0];
      const R* b = srcs[1];
      auto run = [&](auto avg_tag) {
        constexpr bool kAvg = decltype(avg_tag)::value;
        if (out == a && out == b) {
          reduce_blocked<T, Op>(out, srcs, nsrc, count, avg);
        } else if (detail::have_avx2()) {
          reduce2_avx2<R, Op, kAvg>(out, a, b, count);
        } else {
          reduce2<R, Op, kAvg>(out, a, b, count);
        }
      };
      if (avg) {
        run(std::true_type{});
      } else {
        run(std::false_type{});
      }
      return;
    }
  }
  reduce_blocked<T, Op>(out, srcs, nsrc, count, avg);
}

// Calls f(Op{}) for a reduce op on storage type T; bool maps sum/max to or, product/min to and.
template <typename T, typename F>
void dispatch_op(ReduceOp op, F&& f) {
  constexpr bool kBool = std::is_same_v<T, BoolByte>;
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      if constexpr (kBool) {
        f(OpOr{});
      } else {
        f(OpSum{});
      }
      return;
    case ReduceOp::Product:
      if constexpr (kBool) {
        f(OpAnd{});
      } else {
        f(OpProd{});
      }
      return;
    case ReduceOp::Min:
      if constexpr (kBool) {
        f(OpAnd{});
      } else {
        f(OpMin{});
      }
      return;
    case ReduceOp::Max:
      if constexpr (kBool) {
        f(OpOr{});
      } else {
        f(OpMax{});
      }
      return;
    case ReduceOp::BAnd:
    case ReduceOp::BOr:
    case ReduceOp::BXor:
      if constexpr (std::is_floating_point_v<AccOf<T>>) {
        FUNCOL_CHECK(false, "bitwise reduce op on a floating dtype passed validation");
      } else if (op == ReduceOp::BAnd) {
        f(OpAnd{});
      } else if (op == ReduceOp::BOr) {
        f(OpOr{});
      } else {
        f(OpXor{});
      }
      return;
  }
  FUNCOL_CHECK(false, "unknown reduce op " + std::to_string(static_cast<int>(op)));
}

void check_count(int64_t count, const char* what) {
  if (count < 0) throw InvalidArgument(fmt::format("{}: negative count {}", what, count));
}

// ---------------------------------------------------------------------------------------------
// Tensor math helpers.

void check_data(const Tensor& t, const char* what) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{} on an undefined tensor", what));
  if (t.is_meta()) {
    throw InvalidArgument(fmt::format("{} on a meta tensor {} (it has no data)", what,
                                      type_str(t.dtype(), t.sizes())));
  }
}

void check_same(const Tensor& a, const Tensor& b, const char* what) {
  check_data(a, what);
  check_data(b, what);
  if (a.dtype() != b.dtype()) {
    throw InvalidArgument(fmt::format("{}: dtype mismatch {} vs {}", what, dtype_name(a.dtype()),
                                      dtype_name(b.dtype())));
  }
  if (a.sizes() != b.sizes()) {
    throw ShapeError(fmt::format("{}: shape mismatch {} vs {}", what, shape_str(a.sizes()),
                                 shape_str(b.sizes())));
  }
}

// Compute type of elementwise math: f16/bf16 in f32, bool as bool, others native.
template <typename S>
using ComputeOf = std::conditional_t<kIsLowFloat<S>, float,
                                     std::conditional_t<std::is_same_v<S, BoolByte>, bool, S>>;

template <typename A>
inline A wrap_add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using W = WideUnsigned<A>;
    return static_cast<A>(static_cast<W>(a) + static_cast<W>(b));
  } else {
    return a + b;
  }
}
template <typename A>
inline A wrap_sub(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using W = WideUnsigned<A>;
    return static_cast<A>(static_cast<W>(a) - static_cast<W>(b));
  } else {
    return a - b;
  }
}
template <typename A>
inline A wrap_mul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using W = WideUnsigned<A>;
    return static_cast<A>(static_cast<W>(a) * static_cast<W>(b));
  } else {
    return a * b;
  }
}

enum class Binary { Add, Sub, Mul, Div, ReluGrad };  // ReluGrad: b <= 0 ? 0 : a

const char* binary_name(Binary op) {
  switch (op) {
    case Binary::Add: return "add";
    case Binary::Sub: return "sub";
    case Binary::Mul: return "mul";
    case Binary::Div: return "div";
    case Binary::ReluGrad: return "relu_backward";
  }
  return "?";
}

template <Binary op, typename C>
C apply_binary(C a, C b) {
  switch (op) {
    case Binary::Add: return wrap_add(a, b);
    case Binary::Sub: return wrap_sub(a, b);
    case Binary::Mul: return wrap_mul(a, b);
    case Binary::ReluGrad: return b <= C{0} ? C{0} : a;
    case Binary::Div:
      if constexpr (std::is_integral_v<C>) {
        if (b == 0) throw InvalidArgument("div: integer division by zero");
        if constexpr (std::is_signed_v<C>) {
          // min / -1 overflows; wrap as two's complement does.
          if (b == -1) return wrap_sub(C{0}, a);
        }
        return static_cast<C>(a / b);
      } else {
        return a / b;
      }
  }
  return a;
}

template <Binary op, typename S>
void binary_loop(const S* pa, const S* pb, S* po, int64_t n) {
  using C = ComputeOf<S>;
  for (int64_t i = 0; i < n; ++i) {
    C r;
    if constexpr (op == Binary::ReluGrad && !std::is_same_v<C, bool>) {
      // A select, as PyTorch's threshold_backward (not grad * mask, which turns an infinite or
      // NaN gradient at x <= 0 into NaN). The comparison first, then the gradient: with the
      // gradient loaded before the comparison (which may trap on NaN), GCC 12 keeps a branch
      // and does not vectorize the loop.
      const bool drop = cvt<C>(pb[i]) <= C{0};
      const C g = cvt<C>(pa[i]);
      r = drop ? C{0} : g;
    } else {
      const C x = cvt<C>(pa[i]);
      const C y = cvt<C>(pb[i]);
      if constexpr (std::is_same_v<C, bool>) {
        r = op == Binary::Add ? (x || y) : (x && y);
      } else {
        r = apply_binary<op, C>(x, y);
      }
    }
    po[i] = cvt<S>(r);
  }
}

Tensor binary(Binary op, const Tensor& a_in, const Tensor& b_in) {
  const char* what = binary_name(op);
  check_same(a_in, b_in, what);
  if (a_in.dtype() == DType::Bool && (op == Binary::Sub || op == Binary::Div)) {
    throw InvalidArgument(fmt::format("{}: not supported for bool tensors", what));
  }
  const Tensor a = a_in.contiguous();
  const Tensor b = b_in.contiguous();
  Tensor out = Tensor::empty(a.sizes(), a.dtype());
  const int64_t n = a.numel();
  if (n == 0) return out;
  dispatch(a.dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S* pa = static_cast<const S*>(a.const_data_ptr());
    const S* pb = static_cast<const S*>(b.const_data_ptr());
    S* po = static_cast<S*>(out.data_ptr());
    // One loop per op, so the op is no branch inside it and the loop vectorizes.
    switch (op) {
      case Binary::Add: binary_loop<Binary::Add>(pa, pb, po, n); break;
      case Binary::Sub: binary_loop<Binary::Sub>(pa, pb, po, n); break;
      case Binary::Mul: binary_loop<Binary::Mul>(pa, pb, po, n); break;
      case Binary::Div: binary_loop<Binary::Div>(pa, pb, po, n); break;
      case Binary::ReluGrad: binary_loop<Binary::ReluGrad>(pa, pb, po, n); break;
    }
  });
  return out;
}

// Applies fn(C) -> C elementwise, C the compute type.
template <typename Fn>
Tensor unary(const Tensor& a_in, const char* what, Fn&& fn) {
  check_data(a_in, what);
  const Tensor a = a_in.contiguous();
  Tensor out = Tensor::empty(a.sizes(), a.dtype());
  const int64_t n = a.numel();
  if (n == 0) return out;
  dispatch(a.dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    using C = ComputeOf<S>;
    const S* pa = static_cast<const S*>(a.const_data_ptr());
    S* po = static_cast<S*>(out.data_ptr());
    for (int64_t i = 0; i < n; ++i) po[i] = cvt<S>(fn(cvt<C>(pa[i])));
  });
  return out;
}

std::vector<bool> reduced_dims(const Tensor& a, const std::vector<int64_t>& dims,
                               const char* what) {
  const int64_t ndim = a.dim();
  // A 0-d tensor accepts dim 0 / -1 (once) as PyTorch does; there is nothing to reduce.
  const int64_t range = std::max<int64_t>(ndim, 1);
  std::vector<bool> reduce(static_cast<size_t>(range), dims.empty());
  for (int64_t d : dims) {
    if (d < -range || d >= range) {
      throw ShapeError(
          fmt::format("{}: dim {} is out of range for a tensor of rank {}", what, d, ndim));
    }
    const int64_t w = d < 0 ? d + range : d;
    if (reduce[w]) {
      throw InvalidArgument(
          fmt::format("{}: dim {} appears more than once in {}", what, w, shape_str(dims)));
    }
    reduce[w] = true;
  }
  reduce.resize(static_cast<size_t>(ndim));
  return reduce;
}

// Accumulator of sum / mean / mse_loss: every floating dtype in f64 (an f32 accumulator of f16
// or bf16 ones stops growing at 2^24: the mean of 2^25 ones was 0.5), rounded once at the end
// (cvt rounds f64 to f16 and bf16 directly, through f32 rounded to odd); integers wrap in 64
// bits (uint64, exact modulo 2^64; sum writes i64, as torch.sum), bool as a count.
template <typename S>
using SumAccOf = std::conditional_t<std::is_floating_point_v<ComputeOf<S>>, double, uint64_t>;

Tensor reduce_over(const Tensor& a_in, const std::vector<int64_t>& dims, bool keepdim, bool mean,
                   const char* what) {
  check_data(a_in, what);
  if (mean && !is_floating(a_in.dtype())) {
    throw InvalidArgument(
        fmt::format("{}: expected a floating dtype, got {}", what, dtype_name(a_in.dtype())));
  }
  const std::vector<bool> reduce = reduced_dims(a_in, dims, what);
  const Tensor a = a_in.contiguous();
  const Shape& sizes = a.sizes();
  Shape out_shape;
  Shape keep_shape;  // out shape with reduced dims kept as 1
  int64_t count = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (reduce[d]) {
      count *= sizes[d];
      keep_shape.push_back(1);
      if (keepdim) out_shape.push_back(1);
    } else {
      keep_shape.push_back(sizes[d]);
      out_shape.push_back(sizes[d]);
    }
  }
  // Output strides in the input's index space: 0 along reduced dims.
  Shape out_strides = contiguous_strides(keep_shape);
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (reduce[d]) out_strides[d] = 0;
  }
  // As torch.sum: integers and bool sum into i64.
  Tensor out = Tensor::empty(out_shape, is_floating(a.dtype()) ? a.dtype() : DType::I64);
  const Shape in_strides = contiguous_strides(sizes);
  dispatch(a.dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    using Acc = SumAccOf<S>;
    std::vector<Acc> acc = detail::vector_or_throw<Acc>(static_cast<size_t>(out.numel()));
    const S* pa = static_cast<const S*>(a.const_data_ptr());
    detail::for_each_row<2>(
        sizes, {&in_strides, &out_strides},
        [&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& inner) {
          for (int64_t i = 0; i < n; ++i) {
            Acc& dst = acc[static_cast<size_t>(off[1] + i * inner[1])];
            const S v = pa[off[0] + i * inner[0]];
            if constexpr (std::is_same_v<S, BoolByte>) {
              dst += v.v != 0 ? 1 : 0;
            } else if constexpr (std::is_same_v<Acc, uint64_t>) {
              dst += static_cast<uint64_t>(static_cast<int64_t>(v));
            } else {
              dst += cvt<Acc>(v);
            }
          }
        });
    if constexpr (std::is_same_v<Acc, uint64_t>) {
      auto* po = static_cast<int64_t*>(out.data_ptr());  // wraps modulo 2^64, as torch.sum
      for (size_t i = 0; i < acc.size(); ++i) po[i] = static_cast<int64_t>(acc[i]);
    } else {
      S* po = static_cast<S*>(out.data_ptr());
      for (size_t i = 0; i < acc.size(); ++i) {
        po[i] = cvt<S>(mean ? acc[i] / static_cast<Acc>(count) : acc[i]);
      }
    }
  });
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Collective reduction kernels

void reduce_buffers(ReduceOp op, DType dtype, void* out, const void* const* srcs, int nsrc,
                    int64_t count) {
  if (nsrc < 1)
    throw InvalidArgument(fmt::format("reduce_buffers: nsrc must be >= 1, got {}", nsrc));
  check_count(count, "reduce_buffers");
  const ReduceKernel kernel = reduce_kernel(op, dtype);  // checks op against dtype
  if (count == 0) return;
  FUNCOL_CHECK(out != nullptr && srcs != nullptr, "reduce_buffers: null buffer");
  kernel(out, srcs, nsrc, count);
}

namespace {

template <typename T, typename Op, bool kAvg>
void reduce_entry(void* out, const void* const* srcs, int nsrc, int64_t count) {
  reduce_typed<T, Op>(out, srcs, nsrc, count, kAvg);
}

}  // namespace

ReduceKernel reduce_kernel(ReduceOp op, DType dtype) {
  check_reduce_op_dtype(op, dtype, "reduce_buffers");
  ReduceKernel kernel = nullptr;
  dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_op<T>(op, [&](auto op_tag) {
      using Op = decltype(op_tag);
      kernel = op == ReduceOp::Avg ? &reduce_entry<T, Op, true> : &reduce_entry<T, Op, false>;
    });
  });
  return kernel;
}

void reduce_inplace(ReduceOp op, DType dtype, void* acc, const void* src, int64_t count) {
  if (op == ReduceOp::Avg) {
    check_reduce_op_dtype(op, dtype, "reduce_inplace");
    op = ReduceOp::Sum;
  }
  const void* srcs[2] = {acc, src};
  check_count(count, "reduce_inplace");
  check_reduce_op_dtype(op, dtype, "reduce_inplace");
  if (count == 0) return;
  reduce_buffers(op, dtype, acc, srcs, 2, count);
}

void finish_avg(DType dtype, void* buf, int64_t count, int64_t divisor) {
  check_count(count, "finish_avg");
  if (divisor <= 0) {
    throw InvalidArgument(fmt::format("finish_avg: divisor must be positive, got {}", divisor));
  }
  check_reduce_op_dtype(ReduceOp::Avg, dtype, "finish_avg");
  if (count == 0) return;
  dispatch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, BoolByte>) {
      auto* p = static_cast<RawOf<T>*>(buf);
      for (int64_t i = 0; i < count; ++i) p[i] = from_acc<T>(avg_of(to_acc<T>(p[i]), divisor));
    }
  });
}

void convert_buffer(DType src_dtype, const void* src, DType dst_dtype, void* dst, int64_t count) {
  check_count(count, "convert_buffer");
  if (count == 0) return;
  if (src_dtype == dst_dtype) {
    std::memmove(dst, src, static_cast<size_t>(count) * itemsize(src_dtype));
    return;
  }
  dispatch(src_dtype, [&](auto s_tag) {
    using S = typename decltype(s_tag)::type;
    dispatch(dst_dtype, [&](auto d_tag) {
      using D = typename decltype(d_tag)::type;
      const S* s = static_cast<const S*>(src);
      D* d = static_cast<D*>(dst);
      for (int64_t i = 0; i < count; ++i) d[i] = cvt<D>(s[i]);
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Tensor math

Tensor add(const Tensor& a, const Tensor& b) { return binary(Binary::Add, a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(Binary::Sub, a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(Binary::Mul, a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary(Binary::Div, a, b); }

Tensor neg(const Tensor& a) {
  check_data(a, "neg");
  if (a.dtype() == DType::Bool) throw InvalidArgument("neg: not supported for bool tensors");
  return unary(a, "neg", [](auto x) {
    using X = decltype(x);
    if constexpr (std::is_same_v<X, bool>) {
      return x;  // unreachable: rejected above
    } else if constexpr (std::is_integral_v<X>) {
      return wrap_sub(X{0}, x);
    } else {
      return -x;  // flips the sign bit, as torch.neg: neg(+0.0) is -0.0, not 0 - 0.0 = +0.0
    }
  });
}

Tensor relu(const Tensor& a) {
  check_data(a, "relu");
  if (a.dtype() == DType::Bool) throw InvalidArgument("relu: not supported for bool tensors");
  return unary(a, "relu", [](auto x) {
    using C = decltype(x);
    if constexpr (std::is_same_v<C, bool>) {
      return x;  // unreachable: rejected above
    } else if constexpr (std::is_floating_point_v<C>) {
      // torch.relu is clamp_min(x, 0): NaN propagates, and -0.0 (not below 0) stays -0.0.
      return (x >= 0 || x != x) ? x : C{0};
    } else {
      return x > 0 ? x : C{0};
    }
  });
}

Tensor mul_scalar(const Tensor& a, double scalar) {
  check_data(a, "mul_scalar");
  // Integer tensors times an integral scalar stay exact (wrapping); otherwise go through double.
  const bool integral_scalar =
      std::isfinite(scalar) && std::trunc(scalar) == scalar && std::fabs(scalar) < 9.2e18;
  return unary(a, "mul_scalar", [&](auto x) {
    using C = decltype(x);
    if constexpr (std::is_same_v<C, bool>) {
      return x && scalar != 0;
    } else if constexpr (std::is_floating_point_v<C>) {
      return static_cast<C>(x * static_cast<C>(scalar));
    } else {
      if (integral_scalar) return wrap_mul(x, static_cast<C>(static_cast<int64_t>(scalar)));
      return cvt<C>(static_cast<double>(x) * scalar);
    }
  });
}

Tensor relu_backward(const Tensor& grad, const Tensor& x) {
  return binary(Binary::ReluGrad, grad, x);
}

Tensor gt_zero_mask(const Tensor& a) {
  return unary(a, "gt_zero_mask", [](auto x) {
    using C = decltype(x);
    if constexpr (std::is_same_v<C, bool>) {
      return x;
    } else {
      return x > 0 ? C{1} : C{0};
    }
  });
}

namespace {
// A 2-D tensor whose transpose is contiguous: column-major [rows, cols] with no gaps.
bool is_transposed_contiguous(const Tensor& t) {
  return t.dim() == 2 && t.stride(0) == 1 && t.stride(1) == t.size(0);
}
}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  check_data(a_in, "matmul");
  check_data(b_in, "matmul");
  if (a_in.dim() != 2 || b_in.dim() != 2) {
    throw ShapeError(fmt::format("matmul: expected 2-D tensors, got {} and {}",
                                 shape_str(a_in.sizes()), shape_str(b_in.sizes())));
  }
  if (a_in.dtype() != b_in.dtype()) {
    throw InvalidArgument(fmt::format("matmul: dtype mismatch {} vs {}", dtype_name(a_in.dtype()),
                                      dtype_name(b_in.dtype())));
  }
  if (a_in.size(1) != b_in.size(0)) {
    throw ShapeError(fmt::format("matmul: shapes {} and {} cannot be multiplied ({} != {})",
                                 shape_str(a_in.sizes()), shape_str(b_in.sizes()), a_in.size(1),
                                 b_in.size(0)));
  }
  if (a_in.dtype() == DType::Bool) throw InvalidArgument("matmul: not supported for bool tensors");
  const int64_t m = a_in.size(0);
  const int64_t k = a_in.size(1);
  const int64_t n = b_in.size(1);
  const DType dtype = a_in.dtype();
  // f32 on a CPU with AVX2 and FMA goes to detail::gemm_f32, which reads operands of any strides
  // in place and sums in one order whatever their layout. Otherwise Eigen: f32 / f64 operands
  // that are transposes of contiguous matrices (the backward pass's matmul(g, w.t()) and
  // matmul(x.t(), g)) are read in place, as column-major, where Eigen runs its blocked product:
  // no vector shapes and m + n + k >= 20 (below, Eigen's coefficient-wise and matrix-vector
  // products sum in an order that depends on the layout, so the result would too). Anything
  // else is made contiguous first.
  const bool fast = dtype == DType::F32 && detail::have_gemm_f32();
  const bool native = !fast && (dtype == DType::F32 || dtype == DType::F64) && m > 1 && n > 1 &&
                      m + n + k >= 20;
  const bool a_cols = native && !a_in.is_contiguous() && is_transposed_contiguous(a_in);
  const bool b_cols = native && !b_in.is_contiguous() && is_transposed_contiguous(b_in);
  const Tensor a = fast || a_cols ? a_in : a_in.contiguous();
  const Tensor b = fast || b_cols ? b_in : b_in.contiguous();
  a.wait();
  b.wait();
  if (m == 0 || n == 0 || k == 0) return Tensor::zeros({m, n}, dtype);
  Tensor out = Tensor::empty({m, n}, dtype);
  dispatch(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    const S* pa = static_cast<const S*>(a.const_data_ptr());
    const S* pb = static_cast<const S*>(b.const_data_ptr());
    S* po = static_cast<S*>(out.data_ptr());
    if constexpr (std::is_same_v<S, float>) {
      if (fast) {
        detail::gemm_f32(m, n, k, pa, a.stride(0), a.stride(1), pb, b.stride(0), b.stride(1), po);
        return;
      }
    }
    if constexpr (std::is_floating_point_v<S>) {
      using M = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
      using ColM = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
      Eigen::Map<M> mo(po, m, n);
      auto times = [&](const auto& ma) {
        if (b_cols) {
          mo.noalias() = ma * Eigen::Map<const ColM>(pb, k, n);
        } else {
          mo.noalias() = ma * Eigen::Map<const M>(pb, k, n);
        }
      };
      if (a_cols) {
        times(Eigen::Map<const ColM>(pa, m, k));
      } else {
        times(Eigen::Map<const M>(pa, m, k));
      }
    } else if constexpr (kIsLowFloat<S>) {
      using M = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
      Eigen::Map<const M> ma(pa, m, k);
      Eigen::Map<const M> mb(pb, k, n);
      RowMajor fo = ma.template cast<float>() * mb.template cast<float>();
      Eigen::Map<M> mo(po, m, n);
      mo = fo.template cast<S>();
    } else if constexpr (std::is_integral_v<S>) {
      // Integers wrap: multiply-accumulate modulo 2^64, then truncate to the dtype's width.
      std::vector<uint64_t> acc = detail::vector_or_throw<uint64_t>(static_cast<size_t>(m * n));
      for (int64_t i = 0; i < m; ++i) {
        uint64_t* row = acc.data() + i * n;
        for (int64_t p = 0; p < k; ++p) {
          const auto x = static_cast<uint64_t>(static_cast<int64_t>(pa[i * k + p]));
          const S* brow = pb + p * n;
          for (int64_t j = 0; j < n; ++j) {
            row[j] += x * static_cast<uint64_t>(static_cast<int64_t>(brow[j]));
          }
        }
      }
      for (int64_t i = 0; i < m * n; ++i) po[i] = static_cast<S>(acc[static_cast<size_t>(i)]);
    }
  });
  return out;
}

Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce_over(a, dims, keepdim, /*mean=*/false, "sum");
}

Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  return reduce_over(a, dims, keepdim, /*mean=*/true, "mean");
}

Tensor mse_loss(const Tensor& a_in, const Tensor& b_in) {
  check_same(a_in, b_in, "mse_loss");
  if (!is_floating(a_in.dtype())) {
    throw InvalidArgument(
        fmt::format("mse_loss: expected a floating dtype, got {}", dtype_name(a_in.dtype())));
  }
  const Tensor a = a_in.contiguous();
  const Tensor b = b_in.contiguous();
  const int64_t n = a.numel();
  Tensor out = Tensor::empty({}, a.dtype());
  dispatch(a.dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    if constexpr (std::is_floating_point_v<ComputeOf<S>>) {
      using Acc = SumAccOf<S>;
      const S* pa = static_cast<const S*>(a.const_data_ptr());
      const S* pb = static_cast<const S*>(b.const_data_ptr());
      Acc total = 0;
      for (int64_t i = 0; i < n; ++i) {
        const Acc d = cvt<Acc>(pa[i]) - cvt<Acc>(pb[i]);
        total += d * d;
      }
      // 0 elements: 0 / 0 = NaN, as PyTorch.
      *static_cast<S*>(out.data_ptr()) = cvt<S>(total / static_cast<Acc>(n));
    }
  });
  return out;
}

Tensor expand_to(const Tensor& a, const Shape& shape) {
  if (!a.defined()) throw InvalidArgument("expand_to on an undefined tensor");
  bool ok = shape.size() >= a.sizes().size();
  const size_t lead = ok ? shape.size() - a.sizes().size() : 0;
  for (size_t i = 0; ok && i < shape.size(); ++i) {
    if (shape[i] < 0) ok = false;
    if (i >= lead) {
      const int64_t own = a.sizes()[i - lead];
      ok = ok && (own == shape[i] || own == 1);
    }
  }
  if (!ok) {
    throw ShapeError(fmt::format("expand_to: cannot broadcast {} to {}", shape_str(a.sizes()),
                                 shape_str(shape)));
  }
  return a.expand(shape).clone();
}

}  // namespace funcol
