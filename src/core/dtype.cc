// DType and ReduceOp names, parsing and properties.
#include "funcol/core/dtype.h"

#include <cctype>
#include <string>

#include "funcol/core/error.h"

namespace funcol {

namespace detail {
void throw_unknown_dtype(DType dtype) {
  check_failed("dtype is one of the ten", __FILE__, __LINE__,
               "unknown dtype " + std::to_string(static_cast<int>(dtype)));
}
}  // namespace detail

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Bool: return "bool";
    case DType::U8: return "u8";
    case DType::I8: return "i8";
    case DType::I16: return "i16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::F16: return "f16";
    case DType::BF16: return "bf16";
    case DType::F32: return "f32";
    case DType::F64: return "f64";
  }
  FUNCOL_CHECK(false, "unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType dtype : kAllDTypes) {
    if (dtype_name(dtype) == name) return dtype;
  }
  return std::nullopt;
}

bool is_floating(DType dtype) {
  return dtype == DType::F16 || dtype == DType::BF16 || dtype == DType::F32 || dtype == DType::F64;
}

bool is_integer(DType dtype) {
  return dtype == DType::U8 || dtype == DType::I8 || dtype == DType::I16 || dtype == DType::I32 ||
         dtype == DType::I64;
}

namespace {
constexpr ReduceOp kAllReduceOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product,
                                      ReduceOp::Min, ReduceOp::Max, ReduceOp::BAnd,
                                      ReduceOp::BOr, ReduceOp::BXor};

bool is_bitwise(ReduceOp op) {
  return op == ReduceOp::BAnd || op == ReduceOp::BOr || op == ReduceOp::BXor;
}
}  // namespace

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Product: return "product";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
    case ReduceOp::BAnd: return "band";
    case ReduceOp::BOr: return "bor";
    case ReduceOp::BXor: return "bxor";
  }
  FUNCOL_CHECK(false, "unknown reduce op " + std::to_string(static_cast<int>(op)));
}

ReduceOp parse_reduce_op(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (ReduceOp op : kAllReduceOps) {
    if (reduce_op_name(op) == lower) return op;
  }
  // The seed's message, kept verbatim (capitalised) so users of the reference recognise it.
  throw InvalidArgument("Unrecognized reduce_op: " + printable(name));
}

void check_reduce_op_dtype(ReduceOp op, DType dtype, std::string_view what) {
  if (is_bitwise(op) && is_floating(dtype)) {
    throw InvalidArgument(std::string(what) + ": reduce_op " + std::string(reduce_op_name(op)) +
                          " is not supported for floating dtype " + std::string(dtype_name(dtype)) +
                          " (only integer and bool)");
  }
  if (op == ReduceOp::Avg && dtype == DType::Bool) {
    throw InvalidArgument(std::string(what) + ": reduce_op avg is not supported for dtype bool");
  }
}

}  // namespace funcol
