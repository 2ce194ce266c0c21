// CPU kernels: reduction (for collectives), elementwise math, reductions over dims, matmul.
#pragma once

#include <cstdint>
#include <vector>

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"

namespace funcol {

// ---- collective reduction kernels on raw contiguous buffers ----
// out[i] = op(srcs[0][i], ..., srcs[nsrc-1][i]) for i in [0, count), combining sources in index
// order so every rank computes bit-identical results. f16/bf16 accumulate in f32 and round
// once; Avg sums then divides by nsrc (integers: truncating division). Float min and max
// propagate NaN and order -0 below +0. Bitwise ops on floating dtypes throw InvalidArgument.
// `out` may alias srcs[k]. One source with an op other than Avg is copied byte for byte (bool
// bytes other than 0/1 stay as they are).
void reduce_buffers(ReduceOp op, DType dtype, void* out, const void* const* srcs, int nsrc,
                    int64_t count);
// reduce_buffers for one (op, dtype), resolved once: no checks and no dispatch per call, for
// a caller that reduces thousands of small pieces with the same op (a bucket's members).
// count must be positive and the buffers valid.
using ReduceKernel = void (*)(void* out, const void* const* srcs, int nsrc, int64_t count);
// Throws InvalidArgument as reduce_buffers does for an op the dtype does not support.
ReduceKernel reduce_kernel(ReduceOp op, DType dtype);
// acc[i] = op(acc[i], src[i]); Avg behaves as Sum here (call finish_avg once at the end).
void reduce_inplace(ReduceOp op, DType dtype, void* acc, const void* src, int64_t count);
// buf[i] /= divisor for Avg after a chain of reduce_inplace calls.
void finish_avg(DType dtype, void* buf, int64_t count, int64_t divisor);
// Converts count elements between dtypes (src and dst contiguous).
void convert_buffer(DType src_dtype, const void* src, DType dst_dtype, void* dst, int64_t count);

// ---- tensor math (inputs are waited; results are new contiguous tensors) ----
// Elementwise; equal shapes and dtypes required (ShapeError / InvalidArgument otherwise).
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
// Integers divide in their own dtype, truncating toward zero (-7 / 2 = -3, as torch.div with
// rounding_mode="trunc"; a plain torch.div promotes to a floating result); by zero is an
// InvalidArgument.
Tensor div(const Tensor& a, const Tensor& b);
Tensor neg(const Tensor& a);
Tensor relu(const Tensor& a);
// a * scalar in a's dtype (gradients, optimizers): an integer tensor times an integral scalar
// wraps; times any other scalar the product is converted back, truncated (i32 3 * 0.5 = 1,
// where PyTorch would promote to a floating result).
Tensor mul_scalar(const Tensor& a, double scalar);
// 1 where a > 0 else 0, in a's dtype (relu's gradient mask).
Tensor gt_zero_mask(const Tensor& a);
// relu's gradient as PyTorch's threshold_backward: 0 where x <= 0, grad elsewhere (x NaN
// included); a select, so an infinite or NaN grad where x <= 0 gives 0, not NaN (x may be relu's
// input or its result, which are positive at the same places).
Tensor relu_backward(const Tensor& grad, const Tensor& x);
// 2-D x 2-D; f16/bf16 compute in f32. Integer dtypes supported.
Tensor matmul(const Tensor& a, const Tensor& b);
// Sum / mean over `dims` (empty = all dims), keeping them as size 1 when keepdim.
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim);
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim);
// mean((a - b)^2) as a scalar of a's dtype.
Tensor mse_loss(const Tensor& a, const Tensor& b);
// Broadcasts a (shape with 1s, or fewer leading dims) to `shape` (sum/mean gradients).
Tensor expand_to(const Tensor& a, const Shape& shape);

}  // namespace funcol
