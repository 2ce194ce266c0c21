// Reductions in rank order on the process backends.
#include "dist/multiprocess/wide_reduce.h"

#include <vector>

#include "funcol/core/kernels.h"

namespace funcol::process {

bool order_sensitive(DType dtype, ReduceOp op) {
  return is_floating(dtype) &&
         (op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::Product);
}

void reduce_blocks(ReduceOp op, DType dtype, void* out, const void* blocks, int ranks,
                   int64_t count) {
  const int64_t bytes = count * static_cast<int64_t>(itemsize(dtype));
  std::vector<const void*> srcs(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) srcs[r] = static_cast<const char*>(blocks) + r * bytes;
  reduce_buffers(op, dtype, out, srcs.data(), ranks, count);
}

}  // namespace funcol::process
