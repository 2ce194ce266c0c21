// f16/bf16 reductions on the process backends: sums, averages and products accumulate in f32,
// each rank reducing its block over every rank in rank order (the reduce-scatters, and the
// all-reduces as a reduce-scatter and an all-gather).
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

}  // namespace funcol::process
