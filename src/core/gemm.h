// Private f32 matrix product with AVX2 and FMA, chosen at run time (used by kernels.cc).
#pragma once

#include <atomic>
#include <cstdint>

namespace funcol::detail {

// True when this CPU runs gemm_f32 (x86-64 with AVX2 and FMA) and it is not disabled.
bool have_gemm_f32();
// Tests: true sends f32 products to the portable path (Eigen) on every CPU.
extern std::atomic<bool> gemm_f32_disabled;

// c[m, n] (row-major, contiguous) = a[m, k] * b[k, n], where element (i, p) of a is
// a[i * a_row + p * a_col] and element (p, j) of b is b[p * b_row + j * b_col]: row-major or
// transposed operands are read in place. Each c[i][j] is one chain of fused multiply-adds over
// p = 0 .. k-1 starting from 0, so the result depends neither on the operands' layout nor on m
// or n (a rank's rows equal the same rows of a whole-batch product). Only when have_gemm_f32();
// m, n, k > 0.
void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_row, int64_t a_col,
              const float* b, int64_t b_row, int64_t b_col, float* c);

}  // namespace funcol::detail
