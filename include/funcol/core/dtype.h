// Element types of funcol tensors and their contract text names (DESIGN §2).
#pragma once

#include "funcol/core/cxx20.h"  // first: a clear error under an older standard

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace Eigen {
struct half;
struct bfloat16;
}  // namespace Eigen

namespace funcol {

// The ten dtypes. Text names (contract): bool u8 i8 i16 i32 i64 f16 bf16 f32 f64.
enum class DType : uint8_t { Bool, U8, I8, I16, I32, I64, F16, BF16, F32, F64 };

inline constexpr DType kAllDTypes[] = {DType::Bool, DType::U8,  DType::I8,   DType::I16, DType::I32,
                                       DType::I64,  DType::F16, DType::BF16, DType::F32, DType::F64};

namespace detail {
[[noreturn]] void throw_unknown_dtype(DType dtype);
}  // namespace detail

// Bytes per element (inline: every tensor's byte count and data pointer uses it).
inline size_t itemsize(DType dtype) {
  switch (dtype) {
    case DType::Bool:
    case DType::U8:
    case DType::I8: return 1;
    case DType::I16:
    case DType::F16:
    case DType::BF16: return 2;
    case DType::I32:
    case DType::F32: return 4;
    case DType::I64:
    case DType::F64: return 8;
  }
  detail::throw_unknown_dtype(dtype);
}
// Contract text name, e.g. "bf16".
std::string_view dtype_name(DType dtype);
// Parses a contract text name; nullopt when unknown.
std::optional<DType> parse_dtype(std::string_view name);
// f16, bf16, f32, f64.
bool is_floating(DType dtype);
// u8 .. i64 (bool excluded).
bool is_integer(DType dtype);

// The C++ type that holds one element of a dtype (bool for Bool, Eigen::half for F16, ...).
template <typename T>
struct DTypeOf;
template <> struct DTypeOf<bool> { static constexpr DType value = DType::Bool; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::U8; };
template <> struct DTypeOf<int8_t> { static constexpr DType value = DType::I8; };
template <> struct DTypeOf<int16_t> { static constexpr DType value = DType::I16; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::I32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::I64; };
template <> struct DTypeOf<Eigen::half> { static constexpr DType value = DType::F16; };
template <> struct DTypeOf<Eigen::bfloat16> { static constexpr DType value = DType::BF16; };
template <> struct DTypeOf<float> { static constexpr DType value = DType::F32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::F64; };
template <typename T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

// Reduction operators of all_reduce / reduce_scatter. Text names (contract, case-insensitive):
// sum avg product min max band bor bxor.
enum class ReduceOp : uint8_t { Sum, Avg, Product, Min, Max, BAnd, BOr, BXor };

std::string_view reduce_op_name(ReduceOp op);
// Case-insensitive; throws InvalidArgument "Unrecognized reduce_op: X" (the seed's message).
ReduceOp parse_reduce_op(std::string_view name);
// Throws InvalidArgument when `op` is bitwise and `dtype` is floating.
void check_reduce_op_dtype(ReduceOp op, DType dtype, std::string_view what);

}  // namespace funcol
