// f16/bf16 reductions in f32 on the process backends.
#include "dist/multiprocess/wide_reduce.h"

#include "funcol/core/error.h"
#include "funcol/core/kernels.h"

namespace funcol::process {

bool reduces_in_f32(DType dtype, ReduceOp op) {
  return (dtype == DType::F16 || dtype == DType::BF16) &&
         (op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::Product);
}

std::vector<float> to_f32(const Tensor& t) {
  FUNCOL_CHECK(t.is_contiguous(), "to_f32: the tensor must be contiguous");
  std::vector<float> values(static_cast<size_t>(t.numel()));
  convert_buffer(t.dtype(), t.raw_data_ptr(), DType::F32, values.data(), t.numel());
  return values;
}

void from_f32(std::vector<float>& values, ReduceOp op, int ranks, const Tensor& out) {
  FUNCOL_CHECK(out.is_contiguous() && static_cast<int64_t>(values.size()) == out.numel(),
               "from_f32: the output must be contiguous and as long as the values");
  const auto n = static_cast<int64_t>(values.size());
  if (op == ReduceOp::Avg) finish_avg(DType::F32, values.data(), n, ranks);
  convert_buffer(DType::F32, values.data(), out.dtype(), out.raw_data_ptr(), n);
}

}  // namespace funcol::process
