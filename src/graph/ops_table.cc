// The op table: schema, shape inference and CPU kernel of every op of DESIGN §5, in one place.
#include <algorithm>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/core/tensor.h"
#include "ops_table.h"

namespace funcol::detail {
namespace {

using Types = std::vector<Type>;
using In = std::span<const Type>;
using Tensors = std::vector<Tensor>;
using TIn = std::span<const Tensor>;

// A list attribute in a message: a long one (a million dims, from a generated or a hostile
// file) shows its first entries and its length, so the error stays one readable line.
std::string list_str(const std::vector<int64_t>& v) {
  constexpr size_t kShown = 16;
  if (v.size() <= 2 * kShown) return fmt::format("[{}]", fmt::join(v, ","));
  return fmt::format("[{},... ({} values)]", fmt::join(v.begin(), v.begin() + kShown, ","),
                     v.size());
}

// ---- shape helpers ------------------------------------------------------------------------

// Wraps a possibly negative dim into [0, rank). A scalar accepts 0 and -1 (PyTorch's rule).
int64_t wrap_dim(int64_t dim, int64_t rank, std::string_view what = "dim") {
  const int64_t r = std::max<int64_t>(rank, 1);
  if (dim < -r || dim >= r) {
    throw ShapeError(fmt::format("{} {} is out of range for a tensor of rank {} (expected {} to {})",
                                 what, dim, rank, -r, r - 1));
  }
  return dim < 0 ? dim + r : dim;
}

// a * b for dims, as a ShapeError when the product leaves the range a value may have.
int64_t mul_dim(int64_t a, int64_t b, std::string_view what) {
  if (a != 0 && b > kMaxTypeBytes / a) {
    throw ShapeError(fmt::format("{} overflows: {} * {} is more than 2^62", what, a, b));
  }
  return a * b;
}

int64_t add_dim(int64_t a, int64_t b, std::string_view what) {
  if (b > kMaxTypeBytes - a) {
    throw ShapeError(fmt::format("{} overflows: {} + {} is more than 2^62", what, a, b));
  }
  return a + b;
}

// Checks a result type (negative dims, rank, overflow) and returns it.
Type result(DType dtype, Shape shape) {
  check_type(dtype, shape, "result");
  return Type(dtype, std::move(shape));
}

void require_rank_at_least_1(const Type& t, std::string_view what) {
  if (t.rank() == 0) throw ShapeError(fmt::format("{} must have at least one dim, got a scalar", what));
}

void require_same_dtype(const Type& a, const Type& b) {
  if (a.dtype != b.dtype) {
    throw InvalidArgument(fmt::format("operand dtypes differ: {} and {}", dtype_name(a.dtype),
                                      dtype_name(b.dtype)));
  }
}

void require_same_type(const Type& a, const Type& b) {
  require_same_dtype(a, b);
  if (a.shape != b.shape) {
    throw ShapeError(fmt::format("operand shapes differ: {} and {}", shape_str(a.shape),
                                 shape_str(b.shape)));
  }
}

void require_not_bool(const Type& t, std::string_view what = "input") {
  if (t.dtype == DType::Bool) throw InvalidArgument(fmt::format("{} of dtype bool is not supported", what));
}

void require_floating(const Type& t, std::string_view what = "input") {
  if (!is_floating(t.dtype)) {
    throw InvalidArgument(fmt::format("{} must have a floating dtype (f16 bf16 f32 f64), got {}",
                                      what, dtype_name(t.dtype)));
  }
}

// "input" for a single-input op, "input 2" for one of many (coalesced ops name the index).
std::string input_name(size_t i, size_t n) {
  return n == 1 ? std::string("input") : fmt::format("input {}", i);
}

// A shape with at most one -1, resolved against `numel` (view, reshape).
Shape resolve_shape(const std::vector<int64_t>& shape, int64_t numel) {
  int infer_at = -1;
  int64_t known = 1;  // the product of the nonzero given dims (then 0 if any is 0)
  bool zero = false;
  bool overflow = false;  // they multiply past 2^62: no value has that shape (check_type)
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = shape[i];
    if (d == -1) {
      if (infer_at >= 0) throw ShapeError(fmt::format("shape {} has more than one -1", list_str(shape)));
      infer_at = static_cast<int>(i);
    } else if (d < 0) {
      throw ShapeError(fmt::format("shape {} has a negative dim {}", list_str(shape), d));
    } else if (d == 0) {
      zero = true;
    } else if (!overflow) {
      if (known > kMaxTypeBytes / d) {
        overflow = true;
      } else {
        known *= d;
      }
    }
  }
  if (zero) known = 0;
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    throw ShapeError(fmt::format("shape has {} dims; at most {} are supported", shape.size(), kMaxRank));
  }
  Shape out(shape.begin(), shape.end());
  if (infer_at >= 0) {
    if (overflow || known == 0 || numel % known != 0) {
      throw ShapeError(fmt::format("shape {} is invalid for input of size {}", list_str(shape), numel));
    }
    out[static_cast<size_t>(infer_at)] = numel / known;
  } else if (overflow || known != numel) {
    throw ShapeError(fmt::format("shape {} is invalid for input of size {}", list_str(shape), numel));
  }
  return out;
}

// ---- attribute canonicalizers ---------------------------------------------------------------

void canon_reduce_op(Attr& a) {
  a = Attr(std::string(reduce_op_name(parse_reduce_op(a.as_string()))));
}

void canon_group(Attr& a) {
  if (a.as_string().empty()) throw InvalidArgument("group must not be empty");
}

void canon_positive(Attr& a) {
  if (a.as_int() <= 0) throw InvalidArgument(fmt::format("group_size must be positive, got {}", a.as_int()));
}

void canon_non_negative_src(Attr& a) {
  if (a.as_int() < 0) throw InvalidArgument(fmt::format("src must be non-negative, got {}", a.as_int()));
}

// ---- schema pieces ----------------------------------------------------------------------------

AttrSpec reduce_op_attr() {
  return {.name = "reduce_op", .kind = AttrKind::String, .canonicalize = canon_reduce_op};
}
AttrSpec group_attr() {
  return {.name = "group", .kind = AttrKind::String, .canonicalize = canon_group};
}
AttrSpec group_size_attr() {
  return {.name = "group_size", .kind = AttrKind::Int, .canonicalize = canon_positive};
}
AttrSpec int_attr(std::string_view name) { return {.name = name, .kind = AttrKind::Int}; }
AttrSpec int_attr(std::string_view name, int64_t dflt) {
  return {.name = name, .kind = AttrKind::Int, .required = false, .default_value = Attr(dflt)};
}
AttrSpec ints_attr(std::string_view name) { return {.name = name, .kind = AttrKind::IntList}; }
AttrSpec dtype_attr() { return {.name = "dtype", .kind = AttrKind::DType}; }

ReduceOp reduce_op_of(const AttrList& a) { return parse_reduce_op(a.get_string("reduce_op")); }

void check_reduce_dtype(ReduceOp op, const Type& t, std::string_view what) {
  check_reduce_op_dtype(op, t.dtype, what);
}

// ---- collectives ----------------------------------------------------------------------------

Types infer_all_reduce(In in, const AttrList& a) {
  const ReduceOp op = reduce_op_of(a);
  for (size_t i = 0; i < in.size(); ++i) check_reduce_dtype(op, in[i], input_name(i, in.size()));
  return Types(in.begin(), in.end());
}

Types infer_all_gather(In in, const AttrList& a) {
  const int64_t g = a.get_int("group_size");
  Types out;
  out.reserve(in.size());
  for (const Type& t : in) {
    Shape s = t.shape;
    if (s.empty()) {
      s = {g};
    } else {
      s[0] = mul_dim(s[0], g, "gathered dim 0");
    }
    out.push_back(result(t.dtype, std::move(s)));
  }
  return out;
}

Types infer_reduce_scatter(In in, const AttrList& a) {
  const ReduceOp op = reduce_op_of(a);
  const int64_t g = a.get_int("group_size");
  Types out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const Type& t = in[i];
    const std::string what = input_name(i, in.size());
    check_reduce_dtype(op, t, what);
    require_rank_at_least_1(t, what);
    if (t.shape[0] % g != 0) {
      throw ShapeError(fmt::format("{} dim 0 ({}) is not a multiple of group_size {}", what,
                                   t.shape[0], g));
    }
    Shape s = t.shape;
    s[0] /= g;
    out.push_back(result(t.dtype, std::move(s)));
  }
  return out;
}

Types infer_all_to_all(In in, const AttrList& a) {
  const auto& outs = a.get_ints("output_split_sizes");
  const auto& ins = a.get_ints("input_split_sizes");
  if (outs.size() != ins.size()) {
    throw InvalidArgument(fmt::format(
        "output_split_sizes {} and input_split_sizes {} have different lengths ({} and {})",
        list_str(outs), list_str(ins), outs.size(), ins.size()));
  }
  if (outs.empty()) throw InvalidArgument("split sizes must not be empty (one entry per rank)");
  const Type& t = in[0];
  require_rank_at_least_1(t, "input");
  int64_t in_sum = 0, out_sum = 0;
  for (int64_t s : ins) {
    if (s < 0) throw InvalidArgument(fmt::format("input_split_sizes {} has a negative size", list_str(ins)));
    in_sum = add_dim(in_sum, s, "sum of input_split_sizes");
  }
  for (int64_t s : outs) {
    if (s < 0) throw InvalidArgument(fmt::format("output_split_sizes {} has a negative size", list_str(outs)));
    out_sum = add_dim(out_sum, s, "sum of output_split_sizes");
  }
  if (in_sum != t.shape[0]) {
    throw ShapeError(fmt::format("input_split_sizes {} sum to {} but input dim 0 is {}",
                                 list_str(ins), in_sum, t.shape[0]));
  }
  Shape s = t.shape;
  s[0] = out_sum;
  return {result(t.dtype, std::move(s))};
}

Types infer_same(In in, const AttrList&) { return Types(in.begin(), in.end()); }

// ---- views and copies -----------------------------------------------------------------------

Types infer_view(In in, const AttrList& a) {
  return {result(in[0].dtype, resolve_shape(a.get_ints("shape"), in[0].numel()))};
}
Tensors kernel_view(TIn in, const AttrList& a) { return {in[0].view(a.get_ints("shape"))}; }
Tensors kernel_reshape(TIn in, const AttrList& a) { return {in[0].reshape(a.get_ints("shape"))}; }

Types infer_flatten(In in, const AttrList&) { return {Type(in[0].dtype, {in[0].numel()})}; }
Tensors kernel_flatten(TIn in, const AttrList&) { return {in[0].flatten()}; }

Tensors kernel_clone(TIn in, const AttrList&) { return {in[0].clone()}; }

Types infer_cat(In in, const AttrList& a) {
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].rank() == 0) {
      throw ShapeError(fmt::format("input {} is a scalar; scalars cannot be concatenated", i));
    }
  }
  // Inputs of type [0] join any concatenation (Tensor::cat).
  const size_t ref = cat_reference(in.size(), [&](size_t i) -> const Shape& {
    return in[i].shape;
  });
  const Type& first = in[ref];
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].dtype != first.dtype) {
      throw InvalidArgument(fmt::format("input {} has dtype {} but input {} has {}", i,
                                        dtype_name(in[i].dtype), ref, dtype_name(first.dtype)));
    }
  }
  // Every input skipped: [0], whatever `dim` is (Tensor::cat).
  if (cat_skips(first.shape)) return {result(first.dtype, {0})};
  const int64_t d = wrap_dim(a.get_int("dim"), first.rank());
  Shape s = first.shape;
  for (size_t i = 0; i < in.size(); ++i) {
    const Type& t = in[i];
    if (i == ref || cat_skips(t.shape)) continue;
    if (t.rank() != first.rank()) {
      throw ShapeError(fmt::format("input {} has rank {} but input {} has rank {}", i, t.rank(),
                                   ref, first.rank()));
    }
    for (int64_t k = 0; k < t.rank(); ++k) {
      if (k != d && t.shape[k] != first.shape[k]) {
        throw ShapeError(fmt::format("input {} has size {} at dim {} but input {} has {}", i,
                                     t.shape[k], k, ref, first.shape[k]));
      }
    }
    s[d] = add_dim(s[d], t.shape[d], "concatenated dim");
  }
  return {result(first.dtype, std::move(s))};
}
Tensors kernel_cat(TIn in, const AttrList& a) {
  return {Tensor::cat(std::vector<Tensor>(in.begin(), in.end()), a.get_int("dim"))};
}

Types infer_split_with_sizes(In in, const AttrList& a) {
  const Type& t = in[0];
  const auto& sizes = a.get_ints("split_sizes");
  require_rank_at_least_1(t, "input");
  if (sizes.empty()) throw InvalidArgument("split_sizes must not be empty");
  const int64_t d = wrap_dim(a.get_int("dim"), t.rank());
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0) throw ShapeError(fmt::format("split_sizes {} has a negative size", list_str(sizes)));
    total = add_dim(total, s, "sum of split_sizes");
  }
  if (total != t.shape[d]) {
    throw ShapeError(fmt::format("split_sizes {} sum to {} but dim {} has size {}",
                                 list_str(sizes), total, d, t.shape[d]));
  }
  Types out;
  out.reserve(sizes.size());
  for (int64_t s : sizes) {
    Shape shape = t.shape;
    shape[d] = s;
    out.emplace_back(t.dtype, std::move(shape));
  }
  return out;
}
Tensors kernel_split_with_sizes(TIn in, const AttrList& a) {
  return in[0].split_with_sizes(a.get_ints("split_sizes"), a.get_int("dim"));
}

Types infer_narrow(In in, const AttrList& a) {
  const Type& t = in[0];
  require_rank_at_least_1(t, "input");
  const int64_t d = wrap_dim(a.get_int("dim"), t.rank());
  const int64_t size = t.shape[d];
  int64_t start = a.get_int("start");
  const int64_t length = a.get_int("length");
  if (length < 0) throw ShapeError(fmt::format("length ({}) must be non-negative", length));
  if (start < -size || start > size) {
    throw ShapeError(fmt::format("start ({}) is out of range for size {} of dim {}", start, size, d));
  }
  if (start < 0) start += size;
  if (length > size - start) {
    throw ShapeError(fmt::format("start ({}) + length ({}) exceeds size {} of dim {}", start,
                                 length, size, d));
  }
  Shape s = t.shape;
  s[d] = length;
  return {Type(t.dtype, std::move(s))};
}
Tensors kernel_narrow(TIn in, const AttrList& a) {
  return {in[0].narrow(a.get_int("dim"), a.get_int("start"), a.get_int("length"))};
}

Types infer_transpose(In in, const AttrList& a) {
  const Type& t = in[0];
  const int64_t d0 = wrap_dim(a.get_int("dim0"), t.rank(), "dim0");
  const int64_t d1 = wrap_dim(a.get_int("dim1"), t.rank(), "dim1");
  Shape s = t.shape;
  if (!s.empty()) std::swap(s[d0], s[d1]);
  return {Type(t.dtype, std::move(s))};
}
Tensors kernel_transpose(TIn in, const AttrList& a) {
  return {in[0].transpose(a.get_int("dim0"), a.get_int("dim1"))};
}

Types infer_permute(In in, const AttrList& a) {
  const Type& t = in[0];
  const auto& dims = a.get_ints("dims");
  if (static_cast<int64_t>(dims.size()) != t.rank()) {
    throw ShapeError(fmt::format("dims {} has {} entries but the input has rank {}",
                                 list_str(dims), dims.size(), t.rank()));
  }
  Shape s(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], t.rank());
    if (seen[d]) throw ShapeError(fmt::format("dims {} repeat dim {}", list_str(dims), d));
    seen[d] = true;
    s[i] = t.shape[d];
  }
  return {Type(t.dtype, std::move(s))};
}
Tensors kernel_permute(TIn in, const AttrList& a) { return {in[0].permute(a.get_ints("dims"))}; }

// A wider dtype can push the value past kMaxTypeBytes (i8[2^62] as f64): checked like any result.
Types infer_convert(In in, const AttrList& a) { return {result(a.get_dtype("dtype"), in[0].shape)}; }
Tensors kernel_convert(TIn in, const AttrList& a) { return {in[0].to(a.get_dtype("dtype"))}; }

Types infer_view_dtype(In in, const AttrList& a) {
  const Type& t = in[0];
  const DType to = a.get_dtype("dtype");
  const auto old_size = static_cast<int64_t>(itemsize(t.dtype));
  const auto new_size = static_cast<int64_t>(itemsize(to));
  Shape s = t.shape;
  if (old_size == new_size) return {Type(to, std::move(s))};
  if (s.empty()) {
    throw ShapeError(fmt::format("cannot view a scalar of {} as {}: their itemsizes differ",
                                 dtype_name(t.dtype), dtype_name(to)));
  }
  if (new_size < old_size) {
    s.back() = mul_dim(s.back(), old_size / new_size, "last dim");
  } else {
    const int64_t ratio = new_size / old_size;
    if (s.back() % ratio != 0) {
      throw ShapeError(fmt::format("cannot view {} as {}: the last dim ({}) is not a multiple of {}",
                                   t.str(), dtype_name(to), s.back(), ratio));
    }
    s.back() /= ratio;
  }
  return {result(to, std::move(s))};
}
Tensors kernel_view_dtype(TIn in, const AttrList& a) { return {in[0].view_dtype(a.get_dtype("dtype"))}; }
// view_dtype to another itemsize rescales the last dim: it needs that dim dense and, to a
// larger itemsize, the offset and the other strides in whole new elements (Tensor::view_dtype's
// layout rules; the shape rules are the verifier's). Otherwise a fresh contiguous copy.
Tensors kernel_view_dtype_value(TIn in, const AttrList& a) {
  const Tensor& t = in[0];
  const DType to = a.get_dtype("dtype");
  const auto from_size = static_cast<int64_t>(itemsize(t.dtype()));
  const auto to_size = static_cast<int64_t>(itemsize(to));
  bool viewable = from_size == to_size || t.dim() == 0 ||
                  t.strides().back() == 1 || t.sizes().back() == 1;
  if (viewable && to_size > from_size && t.dim() > 0) {
    const int64_t ratio = to_size / from_size;
    viewable = t.storage_offset() % ratio == 0;
    for (int64_t i = 0; i + 1 < t.dim(); ++i) {
      viewable = viewable && (t.strides()[i] % ratio == 0 || t.sizes()[i] == 1);
    }
  }
  return {(viewable ? t : t.clone()).view_dtype(to)};
}

Types infer_factory(In, const AttrList& a) {
  const auto& shape = a.get_ints("shape");
  for (int64_t d : shape) {
    if (d < 0) throw ShapeError(fmt::format("shape {} has a negative dim {}", list_str(shape), d));
  }
  return {result(a.get_dtype("dtype"), Shape(shape.begin(), shape.end()))};
}
Tensors kernel_empty(TIn, const AttrList& a) {
  return {Tensor::empty(a.get_ints("shape"), a.get_dtype("dtype"))};
}
Tensors kernel_zeros(TIn, const AttrList& a) {
  return {Tensor::zeros(a.get_ints("shape"), a.get_dtype("dtype"))};
}

// `value` is an integer exactly as written (int64 values above 2^53 included), a float, or
// true/false (1/0 in a numeric dtype, as torch.full(..., True, dtype=...)); one its dtype cannot
// hold is refused when the graph is checked, not first when it runs.
Types infer_full(In in, const AttrList& a) {
  const Attr& value = a.get("value");
  const DType dtype = a.get_dtype("dtype");
  if (value.kind() == AttrKind::Int) {
    check_fill_value(dtype, value.as_int());
  } else if (value.kind() != AttrKind::Bool) {
    check_fill_value(dtype, value.as_float());
  }
  return infer_factory(in, a);
}
Tensors kernel_full(TIn, const AttrList& a) {
  const Attr& value = a.get("value");
  if (value.kind() == AttrKind::Int || value.kind() == AttrKind::Bool) {
    const int64_t v = value.kind() == AttrKind::Bool ? int64_t{value.as_bool()} : value.as_int();
    return {Tensor::full(a.get_ints("shape"), a.get_dtype("dtype"), v)};
  }
  return {Tensor::full(a.get_ints("shape"), a.get_dtype("dtype"), value.as_float())};
}

// expand: torch.expand's broadcast view (gradients of sum and mean). `shape` may add leading
// dims; every existing dim must equal its target or be 1; -1 keeps a dim.
Types infer_expand(In in, const AttrList& a) {
  const Type& t = in[0];
  const auto& shape = a.get_ints("shape");
  if (static_cast<int64_t>(shape.size()) < t.rank()) {
    throw ShapeError(fmt::format("shape {} has fewer dims than the input {}", list_str(shape),
                                 shape_str(t.shape)));
  }
  const size_t lead = shape.size() - static_cast<size_t>(t.rank());
  Shape s(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t want = shape[i];
    if (i < lead) {
      if (want < 0) {
        throw ShapeError(fmt::format("shape {}: a new leading dim must be non-negative, got {}",
                                     list_str(shape), want));
      }
      s[i] = want;
      continue;
    }
    const int64_t have = t.shape[i - lead];
    if (want == -1 || want == have) {
      s[i] = have;
    } else if (have == 1 && want >= 0) {
      s[i] = want;
    } else {
      throw ShapeError(fmt::format("cannot expand {} to {}: dim {} has size {}",
                                   shape_str(t.shape), list_str(shape), i - lead, have));
    }
  }
  return {result(t.dtype, std::move(s))};
}
Tensors kernel_expand(TIn in, const AttrList& a) { return {in[0].expand(a.get_ints("shape"))}; }

// ---- math -----------------------------------------------------------------------------------

Types infer_binary(In in, const AttrList&) {
  require_same_type(in[0], in[1]);
  return {in[0]};
}
Types infer_binary_numeric(In in, const AttrList& a) {
  require_not_bool(in[0]);
  return infer_binary(in, a);
}
Tensors kernel_add(TIn in, const AttrList&) { return {add(in[0], in[1])}; }
Tensors kernel_sub(TIn in, const AttrList&) { return {sub(in[0], in[1])}; }
Tensors kernel_mul(TIn in, const AttrList&) { return {mul(in[0], in[1])}; }
Tensors kernel_div(TIn in, const AttrList&) { return {div(in[0], in[1])}; }

Types infer_unary_numeric(In in, const AttrList&) {
  require_not_bool(in[0]);
  return {in[0]};
}
Tensors kernel_relu(TIn in, const AttrList&) { return {relu(in[0])}; }
Tensors kernel_neg(TIn in, const AttrList&) { return {neg(in[0])}; }

// relu_backward(grad, x): 0 where x <= 0, else grad (relu's gradient, PyTorch's
// threshold_backward; x may be relu's input or its result, which are positive at the same places).
Types infer_relu_backward(In in, const AttrList& a) {
  require_floating(in[0], "grad");
  return infer_binary(in, a);
}
Tensors kernel_relu_backward(TIn in, const AttrList&) { return {relu_backward(in[0], in[1])}; }

Types infer_matmul(In in, const AttrList&) {
  const Type& x = in[0];
  const Type& y = in[1];
  if (x.rank() != 2 || y.rank() != 2) {
    throw ShapeError(fmt::format("operands must be 2-D, got {} and {}", shape_str(x.shape),
                                 shape_str(y.shape)));
  }
  require_same_dtype(x, y);
  require_not_bool(x, "operand");
  if (x.shape[1] != y.shape[0]) {
    throw ShapeError(fmt::format("inner dims differ: {} x {}", shape_str(x.shape), shape_str(y.shape)));
  }
  return {result(x.dtype, {x.shape[0], y.shape[1]})};
}
Tensors kernel_matmul(TIn in, const AttrList&) { return {matmul(in[0], in[1])}; }

Types infer_reduction(In in, const AttrList& a, bool is_mean) {
  const Type& t = in[0];
  if (is_mean) require_floating(t);
  const auto& dims = a.get_ints("dims");
  const bool keepdim = a.get_bool("keepdim");
  // A 0-d operand takes dim 0 / -1 once, as PyTorch: its one pseudo-dim, dropped after.
  std::vector<bool> reduced(static_cast<size_t>(std::max<int64_t>(t.rank(), 1)), dims.empty());
  for (int64_t d : dims) {
    const int64_t w = wrap_dim(d, t.rank());
    if (reduced[w]) throw ShapeError(fmt::format("dim {} appears twice in dims {}", w, list_str(dims)));
    reduced[w] = true;
  }
  reduced.resize(static_cast<size_t>(t.rank()));
  Shape s;
  for (int64_t k = 0; k < t.rank(); ++k) {
    if (!reduced[k]) {
      s.push_back(t.shape[k]);
    } else if (keepdim) {
      s.push_back(1);
    }
  }
  // As torch.sum: integers and bool sum into i64.
  // Checked as every result is: i64 is wider than the input, and dims of 0 can be reduced away.
  return {result(is_floating(t.dtype) ? t.dtype : DType::I64, std::move(s))};
}
Types infer_sum(In in, const AttrList& a) { return infer_reduction(in, a, false); }
Types infer_mean(In in, const AttrList& a) { return infer_reduction(in, a, true); }
Tensors kernel_sum(TIn in, const AttrList& a) {
  return {sum(in[0], a.get_ints("dims"), a.get_bool("keepdim"))};
}
Tensors kernel_mean(TIn in, const AttrList& a) {
  return {mean(in[0], a.get_ints("dims"), a.get_bool("keepdim"))};
}

Types infer_mse_loss(In in, const AttrList&) {
  require_same_type(in[0], in[1]);
  require_floating(in[0]);
  return {Type(in[0].dtype, {})};
}
Tensors kernel_mse_loss(TIn in, const AttrList&) { return {mse_loss(in[0], in[1])}; }

Tensors kernel_wait(TIn in, const AttrList&) {
  in[0].wait();
  return {in[0]};
}

// ---- table builders -------------------------------------------------------------------------

OpDef collective(std::string_view name, CollectiveKind kind, bool coalesced,
                 std::vector<AttrSpec> attrs, InferFn infer) {
  return OpDef{.name = name,
               .num_operands = 1,
               .variadic = coalesced,
               .results = coalesced ? ResultArity::PerOperand : ResultArity::One,
               .attrs = std::move(attrs),
               .infer = infer,
               .has_side_effect = true,
               .collective = kind};
}

OpDef compute(std::string_view name, int num_operands, std::vector<AttrSpec> attrs, InferFn infer,
              KernelFn kernel, bool is_view = false) {
  return OpDef{.name = name,
               .num_operands = num_operands,
               .attrs = std::move(attrs),
               .infer = infer,
               .kernel = kernel,
               .is_view = is_view};
}

}  // namespace

std::vector<OpDef> build_op_table() {
  using K = CollectiveKind;
  const AttrSpec dims_attr{.name = "dims",
                           .kind = AttrKind::IntList,
                           .required = false,
                           .default_value = Attr(std::vector<int64_t>{})};
  const AttrSpec keepdim_attr{
      .name = "keepdim", .kind = AttrKind::Bool, .required = false, .default_value = Attr(false)};
  const AttrSpec shape_attr = ints_attr("shape");

  std::vector<OpDef> t;
  // Collectives (has_side_effect; no CPU kernel: the executor runs them over a process group).
  t.push_back(collective("all_reduce", K::AllReduce, false, {reduce_op_attr(), group_attr()},
                         infer_all_reduce));
  t.push_back(collective("all_reduce_coalesced", K::AllReduce, true,
                         {reduce_op_attr(), group_attr()}, infer_all_reduce));
  t.push_back(collective("all_gather_into_tensor", K::AllGather, false,
                         {group_size_attr(), group_attr()}, infer_all_gather));
  t.push_back(collective("all_gather_into_tensor_coalesced", K::AllGather, true,
                         {group_size_attr(), group_attr()}, infer_all_gather));
  t.push_back(collective("reduce_scatter_tensor", K::ReduceScatter, false,
                         {reduce_op_attr(), group_size_attr(), group_attr()},
                         infer_reduce_scatter));
  t.push_back(collective("reduce_scatter_tensor_coalesced", K::ReduceScatter, true,
                         {reduce_op_attr(), group_size_attr(), group_attr()},
                         infer_reduce_scatter));
  t.push_back(collective("all_to_all_single", K::AllToAll, false,
                         {ints_attr("output_split_sizes"), ints_attr("input_split_sizes"),
                          group_attr()},
                         infer_all_to_all));
  t.push_back(collective("broadcast", K::Broadcast, false,
                         {{.name = "src", .kind = AttrKind::Int, .canonicalize = canon_non_negative_src},
                          group_attr()},
                         infer_same));
  {
    OpDef wait = compute("wait_tensor", 1, {}, infer_same, kernel_wait);
    wait.has_side_effect = true;
    wait.collective = K::Wait;
    t.push_back(std::move(wait));
  }
  // Views (the result aliases operand 0) and copies.
  t.push_back(compute("view", 1, {shape_attr}, infer_view, kernel_view, true));
  t.push_back(compute("reshape", 1, {shape_attr}, infer_view, kernel_reshape, true));
  t.push_back(compute("flatten", 1, {}, infer_flatten, kernel_flatten, true));
  t.push_back(compute("clone", 1, {}, infer_same, kernel_clone));
  {
    OpDef cat = compute("cat", 1, {int_attr("dim", 0)}, infer_cat, kernel_cat);
    cat.variadic = true;
    t.push_back(std::move(cat));
  }
  {
    OpDef split = compute("split_with_sizes", 1, {ints_attr("split_sizes"), int_attr("dim", 0)},
                          infer_split_with_sizes, kernel_split_with_sizes, true);
    split.results = ResultArity::PerListElement;
    split.list_attr = 0;
    t.push_back(std::move(split));
  }
  t.push_back(compute("narrow", 1, {int_attr("dim"), int_attr("start"), int_attr("length")},
                      infer_narrow, kernel_narrow, true));
  t.push_back(compute("transpose", 1, {int_attr("dim0"), int_attr("dim1")}, infer_transpose,
                      kernel_transpose, true));
  t.push_back(compute("permute", 1, {ints_attr("dims")}, infer_permute, kernel_permute, true));
  t.push_back(compute("convert_element_type", 1, {dtype_attr()}, infer_convert, kernel_convert));
  t.push_back(compute("view_dtype", 1, {dtype_attr()}, infer_view_dtype, kernel_view_dtype, true));
  t.push_back(compute("empty", 0, {shape_attr, dtype_attr()}, infer_factory, kernel_empty));
  t.push_back(compute("zeros", 0, {shape_attr, dtype_attr()}, infer_factory, kernel_zeros));
  // Made by autodiff: constants (the loss seed, 1/N scales) and broadcasts of reduced gradients.
  t.push_back(compute(
      "full", 0,
      {shape_attr, dtype_attr(), {.name = "value", .kind = AttrKind::Float, .keeps_exact = true}},
      infer_full, kernel_full));
  t.push_back(compute("expand", 1, {shape_attr}, infer_expand, kernel_expand, true));
  // Math.
  t.push_back(compute("add", 2, {}, infer_binary, kernel_add));
  t.push_back(compute("sub", 2, {}, infer_binary_numeric, kernel_sub));
  t.push_back(compute("mul", 2, {}, infer_binary, kernel_mul));
  t.push_back(compute("div", 2, {}, infer_binary_numeric, kernel_div));
  t.push_back(compute("relu", 1, {}, infer_unary_numeric, kernel_relu));
  t.push_back(compute("neg", 1, {}, infer_unary_numeric, kernel_neg));
  t.push_back(compute("relu_backward", 2, {}, infer_relu_backward, kernel_relu_backward));
  t.push_back(compute("matmul", 2, {}, infer_matmul, kernel_matmul));
  t.push_back(compute("sum", 1, {dims_attr, keepdim_attr}, infer_sum, kernel_sum));
  t.push_back(compute("mean", 1, {dims_attr, keepdim_attr}, infer_mean, kernel_mean));
  t.push_back(compute("mse_loss", 2, {}, infer_mse_loss, kernel_mse_loss));
  // Made by the bucketing passes (custom_ops modes).
  add_bucketing_ops(t);
  // Gradient rules (ops_grad.cc), set on the entries above by name.
  add_grad_rules(t);
  return t;
}

}  // namespace funcol::detail

namespace funcol {

KernelFn value_kernel(const OpDef& op) {
  // reshape is view where the strides allow one, else a contiguous copy viewed.
  if (op.name == "view") return detail::kernel_reshape;
  if (op.name == "view_dtype") return detail::kernel_view_dtype_value;
  return op.kernel;
}

}  // namespace funcol
