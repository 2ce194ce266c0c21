// Private helpers shared by tensor.cc and kernels.cc: element storage types, conversion, dispatch.
#pragma once

#include <Eigen/Core>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "funcol/core/dtype.h"
#include "funcol/core/error.h"

namespace funcol::detail {

// How a bool element is stored and read inside funcol: as a byte, never through `bool`, so bytes
// other than 0/1 (a view_dtype of u8 data) are read as "nonzero" instead of being UB.
struct BoolByte {
  uint8_t v;
};

template <typename T>
inline constexpr bool kIsLowFloat =
    std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>;

static_assert(sizeof(Eigen::half) == 2 && std::is_trivially_copyable_v<Eigen::half>);
static_assert(sizeof(Eigen::bfloat16) == 2 && std::is_trivially_copyable_v<Eigen::bfloat16>);

// f16/bf16 <-> f32 on raw bits, without branches, bit-identical to Eigen's conversions (round
// to nearest even; NaN becomes the quiet NaN Eigen produces), so that loops over them vectorise
// without F16C. Selections are done with masks: a ternary would let the compiler sink the
// floating-point operations into branches, which it then cannot vectorise. Assumes the default
// floating-point environment (no flush-to-zero), as Eigen's scalar code does.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t bits = h;
  const uint32_t em = bits & 0x7fffu;  // exponent and mantissa
  // Scaling the shifted bits by 2^(127-15) is exact for normal and subnormal halves alike.
  const uint32_t scaled = std::bit_cast<uint32_t>(std::bit_cast<float>(em << 13) * 0x1p112f);
  const uint32_t inf_nan = 0u - static_cast<uint32_t>(em >= 0x7c00u);
  return std::bit_cast<float>(scaled | (inf_nan & 0x7f800000u) | ((bits & 0x8000u) << 16));
}

inline uint16_t float_to_half_bits(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t a = bits & 0x7fffffffu;
  // Normal range: rebias, then round to nearest even on the 13 dropped bits (a carry into the
  // exponent is correct, up to infinity).
  const uint32_t normal = ((a - 0x38000000u) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5f makes the FPU round at the half's subnormal ulp.
  const uint32_t subnormal = std::bit_cast<uint32_t>(std::bit_cast<float>(a) + 0.5f) - 0x3f000000u;
  // At or above 65536: infinity, or the quiet NaN 0x7e00.
  const uint32_t overflow = 0x7c00u | ((0u - static_cast<uint32_t>(a > 0x7f800000u)) & 0x0200u);
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < 0x38800000u);
  const uint32_t is_over = 0u - static_cast<uint32_t>(a >= 0x47800000u);
  uint32_t m = (subnormal & is_sub) | (normal & ~is_sub);
  m = (overflow & is_over) | (m & ~is_over);
  return static_cast<uint16_t>(m | sign);
}

inline float bf16_bits_to_float(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = 0x7fc0u | ((bits >> 16) & 0x8000u);
  const uint32_t is_nan = 0u - static_cast<uint32_t>((bits & 0x7fffffffu) > 0x7f800000u);
  return static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
}

inline float half_to_float(Eigen::half h) { return half_bits_to_float(std::bit_cast<uint16_t>(h)); }
inline Eigen::half float_to_half(float f) {
  return std::bit_cast<Eigen::half>(float_to_half_bits(f));
}
inline float bf16_to_float(Eigen::bfloat16 b) {
  return bf16_bits_to_float(std::bit_cast<uint16_t>(b));
}
inline Eigen::bfloat16 float_to_bf16(float f) {
  return std::bit_cast<Eigen::bfloat16>(float_to_bf16_bits(f));
}

template <typename T>
inline float low_to_float(T v) {
  if constexpr (std::is_same_v<T, Eigen::half>) {
    return half_to_float(v);
  } else {
    return bf16_to_float(v);
  }
}

template <typename T>
inline T float_to_low(float f) {
  if constexpr (std::is_same_v<T, Eigen::half>) {
    return float_to_half(f);
  } else {
    return float_to_bf16(f);
  }
}

// `v` rounded to float to odd (toward zero, the last bit set when inexact). A float so rounded
// then rounds to f16 or bf16 (11 and 8 bits: float's 24 are more than 2 more) as `v` itself
// would, where rounding to nearest twice did not (f64 1 + 2^-11 + 2^-40 became 1 in f16, not
// 1 + 2^-10). Beyond float's range: the largest float, odd, which rounds to infinity there.
inline float float_rounded_to_odd(double v) {
  const float f = static_cast<float>(v);
  if (std::isnan(v) || static_cast<double>(f) == v) return f;
  uint32_t bits = std::bit_cast<uint32_t>(f);
  if (std::fabs(static_cast<double>(f)) > std::fabs(v)) bits -= 1;  // rounded away from zero
  return std::bit_cast<float>(bits | 1u);
}

// `v` rounded to double to odd (as float_rounded_to_odd; rounding to odd twice is rounding to
// odd once), for i64 values beyond 2^53.
inline double double_rounded_to_odd(int64_t v) {
  const double d = static_cast<double>(v);
  if (d >= 0x1p63) {  // v near INT64_MAX rounded up to 2^63, which no int64 holds
    return std::bit_cast<double>((std::bit_cast<uint64_t>(d) - 1) | 1u);
  }
  const auto back = static_cast<int64_t>(d);
  if (back == v) return d;
  uint64_t bits = std::bit_cast<uint64_t>(d);
  if (v >= 0 ? back > v : back < v) bits -= 1;  // rounded away from zero
  return std::bit_cast<double>(bits | 1u);
}

// Converts one element; no conversion is undefined behaviour. To f16 and bf16 every value
// rounds once, to nearest even (Eigen's and PyTorch's CPU conversions of f64 go through f32,
// rounding twice). Floating to integer truncates
// toward zero; i32 and i64 saturate at their range (PyTorch's result is undefined there), and
// u8, i8 and i16 wrap modulo 2^bits as PyTorch's CPU conversions do (through int64), except
// that infinities and magnitudes beyond int64 saturate at the target's range too. NaN gives 0.
// To bool: value != 0.
template <typename To, typename From>
inline To cvt(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, BoolByte>) {
    return cvt<To>(v.v != 0);
  } else if constexpr (kIsLowFloat<From>) {
    return cvt<To>(low_to_float(v));
  } else if constexpr (std::is_same_v<To, BoolByte>) {
    return BoolByte{static_cast<uint8_t>(v != From(0) ? 1 : 0)};
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else if constexpr (kIsLowFloat<To>) {
    // Rounded once, as `v` itself (f64, i32 and i64 hold values float does not).
    if constexpr (std::is_same_v<From, double> || std::is_same_v<From, int32_t>) {
      return float_to_low<To>(float_rounded_to_odd(static_cast<double>(v)));
    } else if constexpr (std::is_same_v<From, int64_t>) {
      return float_to_low<To>(float_rounded_to_odd(double_rounded_to_odd(v)));
    } else {
      return float_to_low<To>(static_cast<float>(v));
    }
  } else if constexpr (std::is_integral_v<To> && std::is_floating_point_v<From>) {
    using Lim = std::numeric_limits<To>;
    if (std::isnan(v)) return To(0);
    if (v >= static_cast<From>(9.2233720368547758e18)) return Lim::max();
    if (v < static_cast<From>(-9.2233720368547758e18)) return Lim::min();
    const int64_t i = static_cast<int64_t>(v);
    if constexpr (sizeof(To) == sizeof(int32_t)) {  // i32 saturates; narrower types wrap
      if (i > static_cast<int64_t>(Lim::max())) return Lim::max();
      if (i < static_cast<int64_t>(Lim::min())) return Lim::min();
    }
    return static_cast<To>(i);
  } else {
    return static_cast<To>(v);
  }
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<StorageType>{}) for dtype; the storage type of Bool is BoolByte.
template <typename F>
decltype(auto) dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Bool: return f(Tag<BoolByte>{});
    case DType::U8: return f(Tag<uint8_t>{});
    case DType::I8: return f(Tag<int8_t>{});
    case DType::I16: return f(Tag<int16_t>{});
    case DType::I32: return f(Tag<int32_t>{});
    case DType::I64: return f(Tag<int64_t>{});
    case DType::F16: return f(Tag<Eigen::half>{});
    case DType::BF16: return f(Tag<Eigen::bfloat16>{});
    case DType::F32: return f(Tag<float>{});
    case DType::F64: return f(Tag<double>{});
  }
  FUNCOL_CHECK(false, "unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

// Loads / stores one element at an unaligned byte address (strided views of byte buffers).
template <typename T>
inline T load_elem(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
inline void store_elem(void* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace funcol::detail
