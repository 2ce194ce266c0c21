// f16/bf16 reductions on the process backends: sums, averages and products accumulate in f32
// (mpi's all-reduce reduces an f32 copy; the reduce-scatters, and gloo's all-reduce, reduce
// each rank's block over every rank in rank order).
#pragma once

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"

namespace funcol::process {

// Whether a reduction of `dtype` by `op` must not be combined pairwise in the dtype: f16/bf16
// sum, avg and product. MPI and Gloo combine two buffers at a time and would round every
// partial result to the dtype (an f16 avg of 60000 and 60000 overflowed to inf on two ranks;
// 2048 + 1 + 1 gave 2048 on three); in f32 they accumulate and round once, as the threads
// backend's kernels do. Min, max and the bitwise ops are exact in any dtype.
bool reduces_in_f32(DType dtype, ReduceOp op);

// Reduces `ranks` blocks of `count` elements each, back to back in `blocks` (block r from rank
// r), into `out` in rank order, as the threads backend's kernels do (f16/bf16 in f32, rounding
// once; avg divided once): the local step of a reduce-scatter made of an all-to-all.
void reduce_blocks(ReduceOp op, DType dtype, void* out, const void* blocks, int ranks,
                   int64_t count);

// The f32 values of contiguous `t`, in a buffer from the caching allocator (reused from one
// collective to the next, as the tensors' own buffers are).
Tensor to_f32(const Tensor& t);

// Writes reduced f32 `values` (a contiguous f32 tensor as long as `out`) into contiguous `out`,
// rounding each once; Avg first divides by `ranks` in f32 (as the threads backend divides its
// f32 sum).
void from_f32(const Tensor& values, ReduceOp op, int ranks, const Tensor& out);

}  // namespace funcol::process
