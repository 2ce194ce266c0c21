// The packing ops the bucketing passes' custom_ops modes create: bucket_pack and
// all_gather_into_tensor_packed (schemas, shape inference, CPU kernel and packing function).
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "funcol/core/tensor.h"
#include "ops_table.h"

namespace funcol::detail {
namespace {

using Types = std::vector<Type>;
using In = std::span<const Type>;
using Tensors = std::vector<Tensor>;
using TIn = std::span<const Tensor>;

void canon_positive_group_size(Attr& a) {
  if (a.as_int() <= 0) {
    throw InvalidArgument(fmt::format("group_size must be positive, got {}", a.as_int()));
  }
}

void canon_group_name(Attr& a) {
  if (a.as_string().empty()) throw InvalidArgument("group must not be empty");
}

// out_dtypes: a list whose every element is a dtype (`[bf16, f32]`).
void canon_dtype_list(Attr& a) {
  const auto& items = a.as_list();
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i].kind() != AttrKind::DType) {
      throw InvalidArgument(
          fmt::format("out_dtypes[{}] must be a dtype, got {}", i, items[i].str()));
    }
  }
}

// ---- bucket_pack ------------------------------------------------------------------------------
// bucket_pack(x_1..x_k) {group_size = G}: every x_i viewed as [G, numel_i / G], concatenated
// along dim 1 and flattened, so row j of the result holds every input's j-th chunk. With G = 1
// it is the concatenation of the flattened inputs (the all-reduce bucket's buffer); with G the
// group size it is the reduce-scatter bucket's buffer (PyTorch's _pre_bucket_reduce_scatter).

Types infer_bucket_pack(In in, const AttrList& a) {
  const int64_t g = a.get_int("group_size");
  int64_t total = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i].dtype != in[0].dtype) {
      throw InvalidArgument(fmt::format("input {} has dtype {} but input 0 has {}", i,
                                        dtype_name(in[i].dtype), dtype_name(in[0].dtype)));
    }
    const int64_t n = in[i].numel();
    if (n % g != 0) {
      throw ShapeError(fmt::format("input {} ({}) has {} elements, not a multiple of group_size {}",
                                   i, in[i].str(), n, g));
    }
    if (n > kMaxTypeBytes - total) throw ShapeError("packed size overflows");
    total += n;
  }
  Shape s{total};
  check_type(in[0].dtype, s, "result");
  return {Type(in[0].dtype, std::move(s))};
}

Tensors kernel_bucket_pack(TIn in, const AttrList& a) {
  const int64_t g = a.get_int("group_size");
  int64_t total = 0;
  for (const Tensor& t : in) total += t.numel();
  Tensor out = Tensor::empty({total}, in[0].dtype());
  const Tensor rows = out.view({g, total / g});
  int64_t col = 0;
  for (const Tensor& t : in) {
    const int64_t w = t.numel() / g;
    rows.narrow(1, col, w).copy_(t.reshape({g, w}));
    col += w;
  }
  return {out};
}

// ---- all_gather_into_tensor_packed ------------------------------------------------------------
// all_gather_into_tensor_packed(x_1..x_k) {group_size, group, dtype, out_dtypes}: one
// all-gather of the bytes of every x_i converted to out_dtypes[i], packed back to back in this
// rank's slot and read as `dtype`. Equal to
//   all_gather_into_tensor(cat(view_dtype(flatten(convert_element_type(x_i, out_dtypes[i])),
//                                         dtype)...))
// but without the concatenated input buffer: see PackFn.

// Bytes of `t` once converted to `out`; a wider dtype can leave the range of a value
// (i8[2^62] as f64), which is a ShapeError naming input `i`.
int64_t packed_bytes(const Type& t, DType out, size_t i) {
  const int64_t n = t.numel();
  const auto size = static_cast<int64_t>(itemsize(out));
  if (n > kMaxTypeBytes / size) {
    throw ShapeError(fmt::format("input {} ({} as {}) is larger than 2^62 bytes", i, t.str(),
                                 dtype_name(out)));
  }
  return n * size;
}

Types infer_all_gather_packed(In in, const AttrList& a) {
  const int64_t g = a.get_int("group_size");
  const DType bucket = a.get_dtype("dtype");
  const auto& outs = a.get("out_dtypes").as_list();
  if (outs.size() != in.size()) {
    throw InvalidArgument(
        fmt::format("out_dtypes has {} entries for {} inputs", outs.size(), in.size()));
  }
  const auto bucket_size = static_cast<int64_t>(itemsize(bucket));
  int64_t bytes = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const int64_t b = packed_bytes(in[i], outs[i].as_dtype(), i);
    if (b % bucket_size != 0) {
      throw ShapeError(fmt::format(
          "input {} ({} as {}) packs {} bytes, not a multiple of the itemsize of {} ({})", i,
          in[i].str(), dtype_name(outs[i].as_dtype()), b, dtype_name(bucket), bucket_size));
    }
    if (b > kMaxTypeBytes - bytes) throw ShapeError("packed size overflows");
    bytes += b;
  }
  const int64_t n = bytes / bucket_size;
  if (n != 0 && g > kMaxTypeBytes / bucket_size / n) throw ShapeError("gathered size overflows");
  Shape s{n * g};
  check_type(bucket, s, "result");
  return {Type(bucket, std::move(s))};
}

void pack_all_gather(TIn in, const AttrList& a, const Tensor& dst) {
  const auto& outs = a.get("out_dtypes").as_list();
  FUNCOL_CHECK(outs.size() == in.size(), "all_gather_into_tensor_packed: out_dtypes length");
  FUNCOL_CHECK(dst.is_contiguous(), "all_gather_into_tensor_packed: slot must be contiguous");
  int64_t want = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    want += in[i].numel() * static_cast<int64_t>(itemsize(outs[i].as_dtype()));
  }
  if (static_cast<int64_t>(dst.nbytes()) != want) {
    throw ShapeError(fmt::format(
        "all_gather_into_tensor_packed: slot of {} bytes for {} packed bytes", dst.nbytes(), want));
  }
  auto* base = static_cast<char*>(dst.data_ptr());
  size_t offset = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const DType out = outs[i].as_dtype();
    // Same dtype: a contiguous input is copied as is; otherwise one converting copy first.
    const Tensor src = in[i].dtype() == out ? in[i].contiguous() : in[i].to(out);
    const size_t n = src.nbytes();
    if (n != 0) std::memcpy(base + offset, src.const_data_ptr(), n);
    offset += n;
  }
}

}  // namespace

void add_bucketing_ops(std::vector<OpDef>& t) {
  const AttrSpec group_size{
      .name = "group_size", .kind = AttrKind::Int, .canonicalize = canon_positive_group_size};
  const AttrSpec group{.name = "group", .kind = AttrKind::String, .canonicalize = canon_group_name};
  t.push_back(OpDef{.name = "bucket_pack",
                    .num_operands = 1,
                    .variadic = true,
                    .attrs = {group_size},
                    .infer = infer_bucket_pack,
                    .kernel = kernel_bucket_pack});
  t.push_back(OpDef{
      .name = "all_gather_into_tensor_packed",
      .num_operands = 1,
      .variadic = true,
      .attrs = {group_size,
                group,
                {.name = "dtype", .kind = AttrKind::DType},
                {.name = "out_dtypes", .kind = AttrKind::List, .canonicalize = canon_dtype_list}},
      .infer = infer_all_gather_packed,
      .has_side_effect = true,
      .collective = CollectiveKind::AllGather,
      .pack = pack_all_gather});
}

}  // namespace funcol::detail
