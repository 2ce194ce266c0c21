// Tests of the op table: schema, traits, shape inference edge cases and CPU kernels.
#include "funcol/graph/ops.h"

#include <limits>

#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/core/tensor.h"

namespace funcol {
namespace {

Type f32(Shape s) { return Type(DType::F32, std::move(s)); }

// Result types of `op` on `inputs` with named attributes.
std::vector<Type> infer(std::string_view op, std::vector<Type> inputs, const NamedAttrs& attrs = {}) {
  const OpDef& def = get_op(op);
  return infer_types(def, inputs, make_attrs(def, attrs));
}

Type infer1(std::string_view op, std::vector<Type> inputs, const NamedAttrs& attrs = {}) {
  auto types = infer(op, std::move(inputs), attrs);
  EXPECT_EQ(types.size(), 1u);
  return types.at(0);
}

// The message of the error `infer` throws (of type E).
template <typename E>
std::string infer_error(std::string_view op, std::vector<Type> inputs, const NamedAttrs& attrs = {}) {
  try {
    infer(op, std::move(inputs), attrs);
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

const NamedAttrs kWorld4 = {{"group_size", 4}, {"group", "world"}};

TEST(OpTable, HasEveryOpOfTheDesignWithItsAttributesInOrder) {
  const std::vector<std::pair<std::string_view, std::vector<std::string_view>>> expected = {
      {"all_reduce", {"reduce_op", "group"}},
      {"all_reduce_coalesced", {"reduce_op", "group"}},
      {"all_gather_into_tensor", {"group_size", "group"}},
      {"all_gather_into_tensor_coalesced", {"group_size", "group"}},
      {"reduce_scatter_tensor", {"reduce_op", "group_size", "group"}},
      {"reduce_scatter_tensor_coalesced", {"reduce_op", "group_size", "group"}},
      {"all_to_all_single", {"output_split_sizes", "input_split_sizes", "group"}},
      {"broadcast", {"src", "group"}},
      {"wait_tensor", {}},
      {"view", {"shape"}},
      {"reshape", {"shape"}},
      {"flatten", {}},
      {"clone", {}},
      {"cat", {"dim"}},
      {"split_with_sizes", {"split_sizes", "dim"}},
      {"narrow", {"dim", "start", "length"}},
      {"transpose", {"dim0", "dim1"}},
      {"permute", {"dims"}},
      {"convert_element_type", {"dtype"}},
      {"view_dtype", {"dtype"}},
      {"empty", {"shape", "dtype"}},
      {"zeros", {"shape", "dtype"}},
      {"full", {"shape", "dtype", "value"}},
      {"expand", {"shape"}},
      {"add", {}},
      {"sub", {}},
      {"mul", {}},
      {"div", {}},
      {"relu", {}},
      {"neg", {}},
      {"relu_backward", {}},
      {"matmul", {}},
      {"sum", {"dims", "keepdim"}},
      {"mean", {"dims", "keepdim"}},
      {"mse_loss", {}},
      {"bucket_pack", {"group_size"}},
      {"all_gather_into_tensor_packed", {"group_size", "group", "dtype", "out_dtypes"}},
  };
  ASSERT_EQ(all_ops().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    const OpDef& op = all_ops()[i];
    EXPECT_EQ(op.name, expected[i].first);
    EXPECT_EQ(find_op(op.name), &op);
    ASSERT_EQ(op.attrs.size(), expected[i].second.size()) << op.name;
    for (size_t k = 0; k < op.attrs.size(); ++k) EXPECT_EQ(op.attrs[k].name, expected[i].second[k]);
    EXPECT_NE(op.infer, nullptr) << op.name;
    // Every op has a gradient rule (some say "no gradient" or refuse), except the packing ops
    // the bucketing passes create after autodiff.
    EXPECT_EQ(static_cast<bool>(op.grad), op.pack == nullptr && op.name != "bucket_pack")
        << op.name;
  }
  EXPECT_EQ(find_op("nope"), nullptr);
  EXPECT_THROW(get_op("nope"), InvalidArgument);
}

TEST(OpTable, Traits) {
  for (const OpDef& op : all_ops()) {
    // Collectives and wait_tensor are exactly the side-effecting ops; collectives have no CPU
    // kernel (the executor runs them through dist).
    EXPECT_EQ(op.has_side_effect, op.collective != CollectiveKind::None) << op.name;
    EXPECT_EQ(op.kernel == nullptr, op.is_collective()) << op.name;
  }
  EXPECT_EQ(get_op("all_reduce_coalesced").collective, CollectiveKind::AllReduce);
  EXPECT_EQ(get_op("all_gather_into_tensor").collective, CollectiveKind::AllGather);
  EXPECT_EQ(get_op("reduce_scatter_tensor_coalesced").collective, CollectiveKind::ReduceScatter);
  EXPECT_EQ(get_op("all_to_all_single").collective, CollectiveKind::AllToAll);
  EXPECT_EQ(get_op("broadcast").collective, CollectiveKind::Broadcast);
  EXPECT_EQ(get_op("wait_tensor").collective, CollectiveKind::Wait);
  EXPECT_FALSE(get_op("wait_tensor").is_collective());
  for (std::string_view v : {"view", "reshape", "flatten", "split_with_sizes", "narrow", "transpose",
                             "permute", "view_dtype", "expand"}) {
    EXPECT_TRUE(get_op(v).is_view) << v;
  }
  for (std::string_view v : {"clone", "cat", "convert_element_type", "add", "wait_tensor"}) {
    EXPECT_FALSE(get_op(v).is_view) << v;
  }
  EXPECT_TRUE(get_op("split_with_sizes").multi_result());
  EXPECT_TRUE(get_op("all_reduce_coalesced").multi_result());
  EXPECT_FALSE(get_op("all_reduce").multi_result());
  EXPECT_EQ(collective_kind_name(CollectiveKind::ReduceScatter), "reduce_scatter");
}

TEST(OpTable, AttributeCoercion) {
  const OpDef& ar = get_op("all_reduce");
  // Reduce ops are validated and lower-cased.
  EXPECT_EQ(make_attrs(ar, {{"reduce_op", "BXor"}, {"group", "g"}})[0].as_string(), "bxor");
  for (std::string_view name : kReduceOpNames) {
    EXPECT_EQ(make_attrs(ar, {{"reduce_op", name}, {"group", "g"}})[0].as_string(), name);
  }
  EXPECT_THROW(make_attrs(ar, {{"reduce_op", "premul_sum"}, {"group", "g"}}), InvalidArgument);
  EXPECT_THROW(make_attrs(ar, {{"reduce_op", "sum"}, {"group", ""}}), InvalidArgument);
  EXPECT_THROW(make_attrs(ar, {{"reduce_op", "sum"}, {"reduce_op", "sum"}, {"group", "g"}}),
               InvalidArgument);
  // A generic list of integers becomes an integer list; an empty one too.
  const OpDef& view = get_op("view");
  EXPECT_EQ(make_attrs(view, {{"shape", Attr::list({Attr(2), Attr(-1)})}})[0].as_ints(),
            (std::vector<int64_t>{2, -1}));
  EXPECT_EQ(make_attrs(view, {{"shape", Attr::list({})}})[0].kind(), AttrKind::IntList);
  EXPECT_THROW(make_attrs(view, {{"shape", Attr::list({Attr(1.5)})}}), InvalidArgument);
  // Defaults.
  const auto sum = make_attrs(get_op("sum"), {});
  EXPECT_TRUE(sum[0].as_ints().empty());
  EXPECT_FALSE(sum[1].as_bool());
  EXPECT_EQ(make_attrs(get_op("cat"), {})[0].as_int(), 0);
}

TEST(ShapeInference, Collectives) {
  EXPECT_EQ(infer1("all_reduce", {f32({3, 5})}, {{"reduce_op", "sum"}, {"group", "w"}}), f32({3, 5}));
  EXPECT_EQ(infer1("all_gather_into_tensor", {f32({3, 5})}, kWorld4), f32({12, 5}));
  EXPECT_EQ(infer1("all_gather_into_tensor", {f32({})}, kWorld4), f32({4}));
  EXPECT_EQ(infer1("all_gather_into_tensor", {f32({0, 2})}, kWorld4), f32({0, 2}));
  const NamedAttrs rs = {{"reduce_op", "avg"}, {"group_size", 4}, {"group", "w"}};
  EXPECT_EQ(infer1("reduce_scatter_tensor", {f32({8, 2})}, rs), f32({2, 2}));
  EXPECT_EQ(infer_error<ShapeError>("reduce_scatter_tensor", {f32({6})}, rs),
            "reduce_scatter_tensor: input dim 0 (6) is not a multiple of group_size 4");
  EXPECT_EQ(infer_error<ShapeError>("reduce_scatter_tensor", {f32({})}, rs),
            "reduce_scatter_tensor: input must have at least one dim, got a scalar");
  EXPECT_EQ(infer_error<InvalidArgument>("all_gather_into_tensor", {f32({2})},
                                         {{"group_size", -2}, {"group", "w"}}),
            "group_size must be positive, got -2");
  EXPECT_EQ(infer_error<ShapeError>("all_gather_into_tensor", {f32({int64_t{1} << 40})},
                                    {{"group_size", 1 << 30}, {"group", "w"}}),
            "all_gather_into_tensor: gathered dim 0 overflows: 1099511627776 * 1073741824 is more "
            "than 2^62");
  EXPECT_EQ(infer1("broadcast", {f32({2})}, {{"src", 3}, {"group", "w"}}), f32({2}));
  EXPECT_EQ(infer1("wait_tensor", {Type(DType::I8, {2, 2})}), Type(DType::I8, {2, 2}));
}

TEST(ShapeInference, ReduceOpDtype) {
  const NamedAttrs band = {{"reduce_op", "band"}, {"group", "w"}};
  EXPECT_EQ(infer1("all_reduce", {Type(DType::I32, {2})}, band), Type(DType::I32, {2}));
  EXPECT_EQ(infer1("all_reduce", {Type(DType::Bool, {2})}, band), Type(DType::Bool, {2}));
  EXPECT_EQ(infer_error<InvalidArgument>("all_reduce", {f32({2})}, band),
            "all_reduce: input: reduce_op band is not supported for floating dtype f32 (only "
            "integer and bool)");
  EXPECT_EQ(infer_error<InvalidArgument>("all_reduce_coalesced", {Type(DType::I32, {2}), f32({2})}, band),
            "all_reduce_coalesced: input 1: reduce_op band is not supported for floating dtype "
            "f32 (only integer and bool)");
}

TEST(ShapeInference, Coalesced) {
  auto types = infer("all_gather_into_tensor_coalesced", {f32({2, 3}), Type(DType::I64, {})}, kWorld4);
  ASSERT_EQ(types.size(), 2u);
  EXPECT_EQ(types[0], f32({8, 3}));
  EXPECT_EQ(types[1], Type(DType::I64, {4}));
  const NamedAttrs rs = {{"reduce_op", "sum"}, {"group_size", 2}, {"group", "w"}};
  EXPECT_EQ(infer_error<ShapeError>("reduce_scatter_tensor_coalesced", {f32({4}), f32({3})}, rs),
            "reduce_scatter_tensor_coalesced: input 1 dim 0 (3) is not a multiple of group_size 2");
  EXPECT_EQ(infer_error<InvalidArgument>("all_reduce_coalesced", {}, {{"reduce_op", "sum"}, {"group", "w"}}),
            "all_reduce_coalesced expects at least 1 operand, got 0");
}

TEST(ShapeInference, AllToAll) {
  const NamedAttrs ok = {{"output_split_sizes", {1, 2, 3}}, {"input_split_sizes", {2, 2, 2}}, {"group", "w"}};
  EXPECT_EQ(infer1("all_to_all_single", {f32({6, 4})}, ok), f32({6, 4}));
  const NamedAttrs more = {{"output_split_sizes", {5, 5}}, {"input_split_sizes", {0, 6}}, {"group", "w"}};
  EXPECT_EQ(infer1("all_to_all_single", {f32({6, 4})}, more), f32({10, 4}));
  EXPECT_EQ(infer_error<ShapeError>("all_to_all_single", {f32({5})}, ok),
            "all_to_all_single: input_split_sizes [2,2,2] sum to 6 but input dim 0 is 5");
  EXPECT_EQ(infer_error<InvalidArgument>("all_to_all_single", {f32({6})},
                                         {{"output_split_sizes", {6}}, {"input_split_sizes", {3, 3}}, {"group", "w"}}),
            "all_to_all_single: output_split_sizes [6] and input_split_sizes [3,3] have different "
            "lengths (1 and 2)");
  EXPECT_EQ(infer_error<InvalidArgument>("all_to_all_single", {f32({6})},
                                         {{"output_split_sizes", {-1, 7}}, {"input_split_sizes", {3, 3}}, {"group", "w"}}),
            "all_to_all_single: output_split_sizes [-1,7] has a negative size");
  // A sum past 2^62 names the two terms that cross it.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(infer_error<ShapeError>("all_to_all_single", {f32({4})},
                                    {{"output_split_sizes", {3, kMax}},
                                     {"input_split_sizes", {2, 2}},
                                     {"group", "w"}}),
            "all_to_all_single: sum of output_split_sizes overflows: 3 + 9223372036854775807 is "
            "more than 2^62");
}

TEST(ShapeInference, Views) {
  EXPECT_EQ(infer1("view", {f32({4, 6})}, {{"shape", {3, -1}}}), f32({3, 8}));
  EXPECT_EQ(infer1("reshape", {f32({4, 6})}, {{"shape", {24}}}), f32({24}));
  EXPECT_EQ(infer1("reshape", {f32({})}, {{"shape", std::vector<int64_t>{}}}), f32({}));
  EXPECT_EQ(infer1("view", {f32({0, 6})}, {{"shape", {0, 3, 2}}}), f32({0, 3, 2}));
  EXPECT_EQ(infer_error<ShapeError>("view", {f32({4, 6})}, {{"shape", {5, -1}}}),
            "view: shape [5,-1] is invalid for input of size 24");
  EXPECT_EQ(infer_error<ShapeError>("view", {f32({4, 6})}, {{"shape", {-1, -1}}}),
            "view: shape [-1,-1] has more than one -1");
  EXPECT_EQ(infer_error<ShapeError>("reshape", {f32({0})}, {{"shape", {0, -1}}}),
            "reshape: shape [0,-1] is invalid for input of size 0");
  EXPECT_EQ(infer_error<ShapeError>("view", {f32({4})}, {{"shape", {INT64_MAX, INT64_MAX}}}),
            "view: shape [9223372036854775807,9223372036854775807] is invalid for input of size 4");
  EXPECT_EQ(infer1("flatten", {f32({2, 3, 4})}), f32({24}));
  EXPECT_EQ(infer1("flatten", {f32({})}), f32({1}));
  EXPECT_EQ(infer1("clone", {f32({2})}), f32({2}));
  EXPECT_EQ(infer1("narrow", {f32({4, 6})}, {{"dim", -1}, {"start", -4}, {"length", 3}}), f32({4, 3}));
  EXPECT_EQ(infer_error<ShapeError>("narrow", {f32({4, 6})}, {{"dim", 0}, {"start", 2}, {"length", 3}}),
            "narrow: start (2) + length (3) exceeds size 4 of dim 0");
  EXPECT_EQ(infer_error<ShapeError>("narrow", {f32({4, 6})}, {{"dim", 2}, {"start", 0}, {"length", 1}}),
            "narrow: dim 2 is out of range for a tensor of rank 2 (expected -2 to 1)");
  EXPECT_EQ(infer1("transpose", {f32({2, 3, 4})}, {{"dim0", 0}, {"dim1", -1}}), f32({4, 3, 2}));
  EXPECT_EQ(infer1("transpose", {f32({})}, {{"dim0", 0}, {"dim1", -1}}), f32({}));
  EXPECT_EQ(infer1("permute", {f32({2, 3, 4})}, {{"dims", {2, 0, 1}}}), f32({4, 2, 3}));
  EXPECT_EQ(infer_error<ShapeError>("permute", {f32({2, 3})}, {{"dims", {0, -2}}}),
            "permute: dims [0,-2] repeat dim 0");
  EXPECT_EQ(infer_error<ShapeError>("permute", {f32({2, 3})}, {{"dims", {0}}}),
            "permute: dims [0] has 1 entries but the input has rank 2");
}

TEST(ShapeInference, CatAndSplit) {
  EXPECT_EQ(infer1("cat", {f32({2, 3}), f32({4, 3})}), f32({6, 3}));
  EXPECT_EQ(infer1("cat", {f32({2, 3}), f32({2, 1})}, {{"dim", 1}}), f32({2, 4}));
  EXPECT_EQ(infer_error<ShapeError>("cat", {f32({2, 3}), f32({2, 1})}),
            "cat: input 1 has size 1 at dim 1 but input 0 has 3");
  EXPECT_EQ(infer_error<InvalidArgument>("cat", {f32({2}), Type(DType::F16, {2})}),
            "cat: input 1 has dtype f16 but input 0 has f32");
  EXPECT_EQ(infer_error<ShapeError>("cat", {f32({})}), "cat: input 0 is a scalar; scalars cannot be concatenated");
  // Inputs of type [0] join any concatenation (PyTorch's legacy rule).
  EXPECT_EQ(infer1("cat", {f32({0}), f32({2, 3}), f32({0}), f32({2, 1})}, {{"dim", 1}}),
            f32({2, 4}));
  EXPECT_EQ(infer1("cat", {f32({0}), f32({0})}), f32({0}));
  EXPECT_EQ(infer1("cat", {f32({0}), f32({0})}, {{"dim", 1}}), f32({0}));
  EXPECT_EQ(infer_error<ShapeError>("cat", {f32({0}), f32({2, 3}), f32({3, 3})}, {{"dim", 1}}),
            "cat: input 2 has size 3 at dim 0 but input 1 has 2");
  auto parts = infer("split_with_sizes", {f32({2, 7})}, {{"split_sizes", {3, 0, 4}}, {"dim", 1}});
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[1], f32({2, 0}));
  EXPECT_EQ(parts[2], f32({2, 4}));
  EXPECT_EQ(infer_error<ShapeError>("split_with_sizes", {f32({7})}, {{"split_sizes", {3, 3}}}),
            "split_with_sizes: split_sizes [3,3] sum to 6 but dim 0 has size 7");
  EXPECT_EQ(infer_error<InvalidArgument>("split_with_sizes", {f32({0})}, {{"split_sizes", std::vector<int64_t>{}}}),
            "split_with_sizes: split_sizes must not be empty");
}

TEST(ShapeInference, Dtypes) {
  EXPECT_EQ(infer1("convert_element_type", {f32({2})}, {{"dtype", DType::BF16}}), Type(DType::BF16, {2}));
  EXPECT_EQ(infer1("view_dtype", {f32({3, 2})}, {{"dtype", DType::BF16}}), Type(DType::BF16, {3, 4}));
  EXPECT_EQ(infer1("view_dtype", {Type(DType::U8, {8})}, {{"dtype", DType::F64}}), Type(DType::F64, {1}));
  EXPECT_EQ(infer1("view_dtype", {f32({})}, {{"dtype", DType::I32}}), Type(DType::I32, {}));
  EXPECT_EQ(infer_error<ShapeError>("view_dtype", {Type(DType::U8, {6})}, {{"dtype", DType::F32}}),
            "view_dtype: cannot view u8[6] as f32: the last dim (6) is not a multiple of 4");
  EXPECT_EQ(infer_error<ShapeError>("view_dtype", {f32({})}, {{"dtype", DType::F16}}),
            "view_dtype: cannot view a scalar of f32 as f16: their itemsizes differ");
  // A wider dtype can take a value past 2^62 bytes: an error, not an overflowed size.
  const Type huge(DType::I8, {int64_t{1} << 61});
  EXPECT_EQ(infer_error<ShapeError>("convert_element_type", {huge}, {{"dtype", DType::F64}}),
            "convert_element_type: result of type f64[2305843009213693952] is larger than 2^62 "
            "bytes");
  EXPECT_EQ(infer_error<ShapeError>("all_gather_into_tensor_packed", {huge},
                                    {{"group_size", 1},
                                     {"group", "w"},
                                     {"dtype", DType::I8},
                                     {"out_dtypes", Attr::list({Attr(DType::F64)})}}),
            "all_gather_into_tensor_packed: input 0 (i8[2305843009213693952] as f64) is larger "
            "than 2^62 bytes");
  EXPECT_EQ(infer1("zeros", {}, {{"shape", {2, 0}}, {"dtype", DType::Bool}}), Type(DType::Bool, {2, 0}));
  EXPECT_EQ(infer_error<ShapeError>("empty", {}, {{"shape", {-1}}, {"dtype", DType::F32}}),
            "empty: shape [-1] has a negative dim -1");
}

TEST(ShapeInference, Math) {
  EXPECT_EQ(infer1("add", {f32({2}), f32({2})}), f32({2}));
  EXPECT_EQ(infer_error<ShapeError>("mul", {f32({2}), f32({3})}), "mul: operand shapes differ: [2] and [3]");
  EXPECT_EQ(infer_error<InvalidArgument>("add", {f32({2}), Type(DType::F64, {2})}),
            "add: operand dtypes differ: f32 and f64");
  EXPECT_EQ(infer_error<InvalidArgument>("neg", {Type(DType::Bool, {2})}),
            "neg: input of dtype bool is not supported");
  EXPECT_EQ(infer1("matmul", {f32({2, 3}), f32({3, 5})}), f32({2, 5}));
  EXPECT_EQ(infer_error<ShapeError>("matmul", {f32({2, 3}), f32({2, 3})}), "matmul: inner dims differ: [2,3] x [2,3]");
  EXPECT_EQ(infer_error<ShapeError>("matmul", {f32({3}), f32({3, 1})}), "matmul: operands must be 2-D, got [3] and [3,1]");
  EXPECT_EQ(infer1("sum", {f32({2, 3, 4})}, {{"dims", {0, -1}}}), f32({3}));
  EXPECT_EQ(infer1("sum", {f32({2, 3, 4})}, {{"dims", {1}}, {"keepdim", true}}), f32({2, 1, 4}));
  EXPECT_EQ(infer1("sum", {Type(DType::I32, {2, 3})}), Type(DType::I64, {}));  // as torch.sum
  EXPECT_EQ(infer1("sum", {Type(DType::Bool, {2, 3})}, {{"dims", {1}}}), Type(DType::I64, {2}));
  EXPECT_EQ(infer1("mean", {f32({})}, {{"dims", {0}}}), f32({}));
  EXPECT_EQ(infer_error<ShapeError>("mean", {f32({})}, {{"dims", {0, -1}}}),
            "mean: dim 0 appears twice in dims [0,-1]");
  EXPECT_EQ(infer_error<ShapeError>("sum", {f32({2, 3})}, {{"dims", {1, -1}}}), "sum: dim 1 appears twice in dims [1,-1]");
  // A long list is shown by its first entries and its length.
  EXPECT_EQ(infer_error<ShapeError>("sum", {f32({2, 3})}, {{"dims", std::vector<int64_t>(100000, 0)}}),
            "sum: dim 0 appears twice in dims [0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,... (100000 values)]");
  EXPECT_EQ(infer_error<InvalidArgument>("mean", {Type(DType::I64, {2})}),
            "mean: input must have a floating dtype (f16 bf16 f32 f64), got i64");
  EXPECT_EQ(infer1("mse_loss", {f32({2, 2}), f32({2, 2})}), f32({}));
}

TEST(Kernels, RunThroughTheTable) {
  const Tensor x = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  const auto run = [](std::string_view op, std::vector<Tensor> in, const NamedAttrs& attrs = {}) {
    const OpDef& def = get_op(op);
    return run_kernel(def, in, make_attrs(def, attrs));
  };
  EXPECT_EQ(run("add", {x, x})[0].to_vector<float>(), (std::vector<float>{2, 4, 6, 8, 10, 12}));
  EXPECT_EQ(run("neg", {x})[0].to_vector<float>(), (std::vector<float>{-1, -2, -3, -4, -5, -6}));
  EXPECT_EQ(run("transpose", {x}, {{"dim0", 0}, {"dim1", 1}})[0].to_vector<float>(),
            (std::vector<float>{1, 4, 2, 5, 3, 6}));
  const Tensor mm = run("matmul", {x, run("transpose", {x}, {{"dim0", 0}, {"dim1", 1}})[0]})[0];
  EXPECT_EQ(mm.to_vector<float>(), (std::vector<float>{14, 32, 32, 77}));
  auto parts = run("split_with_sizes", {x}, {{"split_sizes", {1, 2}}, {"dim", 1}});
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[1].to_vector<float>(), (std::vector<float>{2, 3, 5, 6}));
  EXPECT_EQ(run("cat", {x, x})[0].sizes(), (Shape{4, 3}));
  EXPECT_EQ(run("narrow", {x}, {{"dim", 1}, {"start", -1}, {"length", 1}})[0].to_vector<float>(),
            (std::vector<float>{3, 6}));
  EXPECT_EQ(run("sum", {x}, {{"dims", {1}}})[0].to_vector<float>(), (std::vector<float>{6, 15}));
  EXPECT_EQ(run("convert_element_type", {x}, {{"dtype", DType::I32}})[0].to_vector<int32_t>(),
            (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(run("zeros", {}, {{"shape", {2}}, {"dtype", DType::I64}})[0].to_vector<int64_t>(),
            (std::vector<int64_t>{0, 0}));
  const Tensor zeros = run("zeros", {}, {{"shape", {2, 3}}, {"dtype", DType::F32}})[0];
  EXPECT_EQ(run("mse_loss", {Tensor::full({2, 3}, DType::F32, 2), zeros})[0].item<float>(), 4.0f);
  EXPECT_EQ(run("wait_tensor", {x})[0].storage(), x.storage());
  EXPECT_THROW(run("all_reduce", {x}, {{"reduce_op", "sum"}, {"group", "w"}}), InvalidArgument);
}

// Every kernel's output has exactly the type the meta kernel predicts.
TEST(Kernels, AgreeWithShapeInference) {
  const Tensor x = Tensor::arange(24, DType::F32).reshape({4, 6});
  const std::vector<std::pair<std::string_view, NamedAttrs>> cases = {
      {"view", {{"shape", {3, -1}}}},        {"reshape", {{"shape", {24}}}},
      {"flatten", {}},                       {"clone", {}},
      {"narrow", {{"dim", 0}, {"start", 1}, {"length", 2}}},
      {"transpose", {{"dim0", 1}, {"dim1", 0}}}, {"permute", {{"dims", {1, 0}}}},
      {"view_dtype", {{"dtype", DType::F16}}},  {"convert_element_type", {{"dtype", DType::F64}}},
      {"relu", {}},                          {"sum", {{"dims", {0}}, {"keepdim", true}}},
      {"mean", {}},
  };
  for (const auto& [op, attrs] : cases) {
    const OpDef& def = get_op(op);
    const auto values = make_attrs(def, attrs);
    const Type in(x.dtype(), x.sizes());
    const auto types = infer_types(def, std::span<const Type>(&in, 1), values);
    const auto out = run_kernel(def, std::span<const Tensor>(&x, 1), values);
    ASSERT_EQ(out.size(), types.size()) << op;
    EXPECT_EQ(Type(out[0].dtype(), out[0].sizes()), types[0]) << op;
  }
}

}  // namespace
}  // namespace funcol
