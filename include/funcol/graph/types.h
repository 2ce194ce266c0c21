// Value types (dtype + shape), attribute values and source locations of the graph IR.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"

namespace funcol {

// Where a graph, node or value was written in IR text; line 0 means "not from text" (a node
// a pass created). Lines and columns count from 1; columns count bytes.
struct SourceLoc {
  uint32_t line = 0;
  uint32_t col = 0;
  bool known() const { return line != 0; }
  friend bool operator==(const SourceLoc&, const SourceLoc&) = default;
};

// The type of an IR value: a dtype and a static shape. A scalar has an empty shape (`f32[]`).
struct Type {
  DType dtype = DType::F32;
  Shape shape;

  Type() = default;
  Type(DType d, Shape s) : dtype(d), shape(std::move(s)) {}

  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  // Product of the dims (1 for a scalar). Types built by the parser or shape inference never
  // overflow here: both reject shapes of more than 2^62 bytes.
  int64_t numel() const;
  int64_t nbytes() const { return numel() * static_cast<int64_t>(itemsize(dtype)); }
  // "f32[8,16]".
  std::string str() const;

  friend bool operator==(const Type&, const Type&) = default;
};

// Largest number of dims a type may have (PyTorch's limit for most kernels is 25; 64 leaves
// room and keeps every per-dim loop small).
inline constexpr int kMaxRank = 64;
// Largest size in bytes of a value, so that numel * itemsize and sums of sizes never overflow.
inline constexpr int64_t kMaxTypeBytes = int64_t{1} << 62;
// Throws ShapeError when `shape` has a negative dim, more than kMaxRank dims, or more than
// kMaxTypeBytes bytes of `dtype`. `what` names the value in the message.
void check_type(DType dtype, const Shape& shape, std::string_view what);

// The kind of an attribute value, as written in IR text: `4`, `1.5`, `"world"`, `true`,
// `f32`, `[4, 4]` (a list of integers) or `[[1], "a"]` (a list of anything).
enum class AttrKind : uint8_t { None, Int, Float, String, Bool, DType, IntList, List };

// "an integer", "a list of integers", ... (for error messages).
std::string_view attr_kind_description(AttrKind kind);

// One attribute value. Integer lists get their own kind because almost every list attribute
// (shape, split sizes, dims) is one; a generic list holds Attrs of any kind, nested.
class Attr {
 public:
  Attr() = default;
  template <typename T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool>)
  Attr(T value) : v_(static_cast<int64_t>(value)) {}
  Attr(double value) : v_(value) {}
  Attr(bool value) : v_(value) {}
  Attr(DType value) : v_(value) {}
  Attr(std::string value) : v_(std::move(value)) {}
  Attr(std::string_view value) : v_(std::string(value)) {}
  Attr(const char* value) : v_(std::string(value)) {}
  Attr(std::vector<int64_t> values) : v_(std::move(values)) {}
  Attr(std::initializer_list<int64_t> values) : v_(std::vector<int64_t>(values)) {}
  // A generic list (kind List).
  static Attr list(std::vector<Attr> items);

  AttrKind kind() const { return static_cast<AttrKind>(v_.index()); }
  bool has_value() const { return kind() != AttrKind::None; }

  // Typed access; FUNCOL_CHECK on a kind mismatch (callers check kind() or rely on the op
  // schema, which the parser, Builder and verifier enforce).
  int64_t as_int() const;
  double as_float() const;
  const std::string& as_string() const;
  bool as_bool() const;
  DType as_dtype() const;
  const std::vector<int64_t>& as_ints() const;
  const std::vector<Attr>& as_list() const;

  // Equal kind and value; floats compare by value, every NaN equals every NaN.
  friend bool operator==(const Attr& a, const Attr& b);
  // IR text form, e.g. `[4, 4]`, `"world"`, `1.5`, `bf16`.
  std::string str() const;

 private:
  std::variant<std::monostate, int64_t, double, std::string, bool, DType, std::vector<int64_t>,
               std::vector<Attr>>
      v_;
};

}  // namespace funcol
