// Reductions on the process backends in rank order, as on threads: the reduce-scatters, and
// the all-reduces mpi and gloo reduce themselves (f16/bf16 sums, averages and products
// accumulating in f32).
#pragma once

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"

namespace funcol::process {

// Whether the result of reducing `dtype` by `op` depends on the order the ranks' values are
// combined in: floating sums, averages and products. MPI and Gloo combine two buffers at a time
// in their own order, and round every f16/bf16 partial result to the dtype (an f16 avg of 60000
// and 60000 overflowed to inf on two ranks; 2048 + 1 + 1 gave 2048 on three). Each rank reduces
// its block over every rank in rank order instead (reduce_blocks), as the threads backend's
// kernels do: bit-identical to it on every backend and group size.
bool order_sensitive(DType dtype, ReduceOp op);

// The all-reduces reduced here (gloo: all of them; mpi: order_sensitive ones, and every
// larger one) whose tensors, gathered from every rank, take at most this many bytes run as one
// all-gather and a local reduction (reduce_blocks); larger ones as a reduce-scatter (an
// all-to-all and reduce_blocks) and an all-gather of the reduced blocks, which on mpi holds back
// the group's later collectives until its first step is done (40,000 f16 all-reduces of 4 KiB,
// 200 in flight, 2 ranks: 1.7x the time in two steps).
inline constexpr size_t kGatherReduceBytes = size_t{1} << 20;

// Elements of block `r` when `n` are split over `ranks` blocks for a reduce-scatter and an
// all-gather: the first n % ranks blocks get one more.
inline int64_t block_elements(int64_t n, int ranks, int r) {
  return n / ranks + (r < n % ranks ? 1 : 0);
}

// Reduces `ranks` blocks of `count` elements each, back to back in `blocks` (block r from rank
// r), into `out` in rank order, as the threads backend's kernels do (f16/bf16 in f32, rounding
// once; avg divided once): the local step of a reduce-scatter made of an all-to-all.
void reduce_blocks(ReduceOp op, DType dtype, void* out, const void* blocks, int ranks,
                   int64_t count);

}  // namespace funcol::process
