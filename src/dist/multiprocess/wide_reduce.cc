// Exact f16/bf16 reductions on the process backends.
#include "dist/multiprocess/wide_reduce.h"

#include <vector>

#include "funcol/core/error.h"
#include "funcol/core/kernels.h"

namespace funcol::process {

bool reduces_in_f32(DType dtype, ReduceOp op) {
  return (dtype == DType::F16 || dtype == DType::BF16) &&
         (op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::Product);
}

void reduce_blocks(ReduceOp op, DType dtype, void* out, const void* blocks, int ranks,
                   int64_t count) {
  const int64_t bytes = count * static_cast<int64_t>(itemsize(dtype));
  std::vector<const void*> srcs(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) srcs[r] = static_cast<const char*>(blocks) + r * bytes;
  reduce_buffers(op, dtype, out, srcs.data(), ranks, count);
}

Tensor to_f32(const Tensor& t) {
  FUNCOL_CHECK(t.is_contiguous(), "to_f32: the tensor must be contiguous");
  // Raw pointers: `t` is pending on the very collective that converts it (Tensor::to would
  // wait for it).
  Tensor values = Tensor::empty({t.numel()}, DType::F32);
  convert_buffer(t.dtype(), t.raw_data_ptr(), DType::F32, values.raw_data_ptr(), t.numel());
  return values;
}

void from_f32(const Tensor& values, ReduceOp op, int ranks, const Tensor& out) {
  FUNCOL_CHECK(out.is_contiguous() && values.is_contiguous() && values.dtype() == DType::F32 &&
                   values.numel() == out.numel(),
               "from_f32: the values must be contiguous f32 as long as the contiguous output");
  if (op == ReduceOp::Avg) finish_avg(DType::F32, values.raw_data_ptr(), values.numel(), ranks);
  convert_buffer(DType::F32, values.raw_data_ptr(), out.dtype(), out.raw_data_ptr(),
                 out.numel());
}

}  // namespace funcol::process
