// Type and Attr: the value types and attribute values of the IR.
#include "funcol/graph/types.h"

#include <algorithm>
#include <cmath>

#include "funcol/core/error.h"
#include "funcol/graph/printer.h"

namespace funcol {

int64_t Type::numel() const { return shape_numel(shape); }

std::string Type::str() const {
  std::string out;
  print_type(*this, out);
  return out;
}

void check_type(DType dtype, const Shape& shape, std::string_view what) {
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    throw ShapeError(std::string(what) + " has " + std::to_string(shape.size()) +
                     " dims; at most " + std::to_string(kMaxRank) + " are supported");
  }
  int64_t bytes = static_cast<int64_t>(itemsize(dtype));
  for (int64_t d : shape) {
    if (d < 0) {
      throw ShapeError(std::string(what) + " has a negative dim " + std::to_string(d) +
                       " in shape " + shape_str(shape));
    }
  }
  // The nonzero dims must multiply to at most 2^62 bytes even in a zero-sized value: then every
  // product of some of its dims (a stride, the count a reduction folds, a row) fits in int64
  // too, and nothing downstream needs to guard against overflow.
  const bool empty = std::find(shape.begin(), shape.end(), 0) != shape.end();
  for (int64_t d : shape) {
    if (d == 0) continue;
    if (bytes > kMaxTypeBytes / d) {
      throw ShapeError(std::string(what) + " of type " + std::string(dtype_name(dtype)) +
                       shape_str(shape) +
                       (empty ? " has nonzero dims that span more than 2^62 bytes"
                              : " is larger than 2^62 bytes"));
    }
    bytes *= d;
  }
}

std::string_view attr_kind_description(AttrKind kind) {
  switch (kind) {
    case AttrKind::None: return "nothing";
    case AttrKind::Int: return "an integer";
    case AttrKind::Float: return "a float";
    case AttrKind::String: return "a string";
    case AttrKind::Bool: return "a boolean";
    case AttrKind::DType: return "a dtype";
    case AttrKind::IntList: return "a list of integers";
    case AttrKind::List: return "a list";
  }
  return "?";
}

Attr Attr::list(std::vector<Attr> items) {
  Attr a;
  a.v_ = std::move(items);
  return a;
}

int64_t Attr::as_int() const {
  FUNCOL_CHECK(kind() == AttrKind::Int, "attribute is not an integer");
  return std::get<int64_t>(v_);
}
double Attr::as_float() const {
  FUNCOL_CHECK(kind() == AttrKind::Float, "attribute is not a float");
  return std::get<double>(v_);
}
const std::string& Attr::as_string() const {
  FUNCOL_CHECK(kind() == AttrKind::String, "attribute is not a string");
  return std::get<std::string>(v_);
}
bool Attr::as_bool() const {
  FUNCOL_CHECK(kind() == AttrKind::Bool, "attribute is not a boolean");
  return std::get<bool>(v_);
}
DType Attr::as_dtype() const {
  FUNCOL_CHECK(kind() == AttrKind::DType, "attribute is not a dtype");
  return std::get<DType>(v_);
}
const std::vector<int64_t>& Attr::as_ints() const {
  FUNCOL_CHECK(kind() == AttrKind::IntList, "attribute is not a list of integers");
  return std::get<std::vector<int64_t>>(v_);
}
const std::vector<Attr>& Attr::as_list() const {
  FUNCOL_CHECK(kind() == AttrKind::List, "attribute is not a list");
  return std::get<std::vector<Attr>>(v_);
}

bool operator==(const Attr& a, const Attr& b) {
  if (a.kind() != b.kind()) return false;
  if (a.kind() == AttrKind::Float) {
    double x = a.as_float(), y = b.as_float();
    return x == y || (std::isnan(x) && std::isnan(y));
  }
  return a.v_ == b.v_;
}

std::string Attr::str() const {
  std::string out;
  print_attr(*this, out);
  return out;
}

}  // namespace funcol
