// Test helpers shared by the graph layer's unit tests: sample IR and error capture.
#pragma once

#include <string>
#include <string_view>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"

namespace funcol::testing_ir {

// The example of DESIGN §5.
inline constexpr std::string_view kDesignExample = R"(// comment to end of line
graph @fsdp_layer(%x: f32[8,16], %w: f32[4,16]) {
  %ag = all_gather_into_tensor(%w) {group_size = 4, group = "world"} : f32[16,16]
  %wf = wait_tensor(%ag) : f32[16,16]
  %y = matmul(%x, %wf) : f32[8,16]
  %p:2 = split_with_sizes(%y) {split_sizes = [4, 4], dim = 0} : f32[4,16], f32[4,16]
  return %y, %p#1
}
)";

// One node of every op of DESIGN §5, written as the printer writes it.
inline constexpr std::string_view kEveryOp = R"(graph @every_op(%x: f32[8,16], %w: f32[4,16], %i: i32[8], %b: bf16[4,6]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[8,16]
  %arc:2 = all_reduce_coalesced(%x, %w) {reduce_op = "avg", group = "world"} : f32[8,16], f32[4,16]
  %ag = all_gather_into_tensor(%w) {group_size = 4, group = "world"} : f32[16,16]
  %agc:2 = all_gather_into_tensor_coalesced(%w, %i) {group_size = 2, group = "dp"} : f32[8,16], i32[16]
  %rs = reduce_scatter_tensor(%x) {reduce_op = "sum", group_size = 4, group = "world"} : f32[2,16]
  %rsc:2 = reduce_scatter_tensor_coalesced(%x, %i) {reduce_op = "max", group_size = 2, group = "tp"} : f32[4,16], i32[4]
  %a2a = all_to_all_single(%x) {output_split_sizes = [1, 3, 2, 2], input_split_sizes = [2, 2, 2, 2], group = "world"} : f32[8,16]
  %bc = broadcast(%w) {src = 1, group = "world"} : f32[4,16]
  %wt = wait_tensor(%ag) : f32[16,16]
  %v = view(%wt) {shape = [4, -1]} : f32[4,64]
  %r = reshape(%v) {shape = [256]} : f32[256]
  %f = flatten(%x) : f32[128]
  %c = clone(%w) : f32[4,16]
  %cat = cat(%w, %c) {dim = 0} : f32[8,16]
  %s:2 = split_with_sizes(%x) {split_sizes = [4, 4], dim = 0} : f32[4,16], f32[4,16]
  %n = narrow(%x) {dim = 1, start = 2, length = 8} : f32[8,8]
  %t = transpose(%x) {dim0 = 0, dim1 = 1} : f32[16,8]
  %p = permute(%x) {dims = [1, 0]} : f32[16,8]
  %ce = convert_element_type(%x) {dtype = bf16} : bf16[8,16]
  %vd = view_dtype(%b) {dtype = f32} : f32[4,3]
  %e = empty() {shape = [2, 3], dtype = f32} : f32[2,3]
  %z = zeros() {shape = [], dtype = i64} : i64[]
  %add = add(%x, %x) : f32[8,16]
  %sub = sub(%x, %add) : f32[8,16]
  %mul = mul(%x, %sub) : f32[8,16]
  %div = div(%mul, %x) : f32[8,16]
  %relu = relu(%div) : f32[8,16]
  %neg = neg(%relu) : f32[8,16]
  %mm = matmul(%x, %t) : f32[8,8]
  %sum = sum(%x) {dims = [1], keepdim = false} : f32[8]
  %mean = mean(%x) {dims = [], keepdim = true} : f32[1,1]
  %loss = mse_loss(%x, %neg) : f32[]
  %full = full() {shape = [8, 16], dtype = f32, value = 0.5} : f32[8,16]
  %ex = expand(%mean) {shape = [8, 16]} : f32[8,16]
  %rb = relu_backward(%full, %ex) : f32[8,16]
  %bp = bucket_pack(%x, %w) {group_size = 4} : f32[192]
  %agp = all_gather_into_tensor_packed(%b, %w) {group_size = 2, group = "world", dtype = bf16, out_dtypes = [bf16, f32]} : bf16[304]
  return %loss, %s#1, %mm
}
)";

// The what() of the ParseError that parsing `text` as file "t.ir" throws, or "no error".
inline std::string parse_error(std::string_view text) {
  try {
    parse_module(text, ParseOptions{.file = "t.ir"});
  } catch (const ParseError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace funcol::testing_ir
