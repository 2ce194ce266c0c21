// Private row-by-row iteration over strided tensors, shared by tensor.cc and kernels.cc.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "funcol/core/tensor.h"

namespace funcol::detail {

// Calls fn(offsets, n, inner_strides) for every innermost row of `sizes`, in row-major order.
// offsets[k] is the element offset of the row's first element for operand k (relative to its
// first element); inner_strides[k] the element stride along the row. Size-1 dims are dropped
// and adjacent dims that are contiguous in every operand are merged, so a contiguous operand
// set gives a single row. Nothing is called when any size is 0.
template <size_t K, typename F>
void for_each_row(const Shape& sizes, const std::array<const Shape*, K>& strides, F&& fn) {
  std::vector<int64_t> sz;
  std::array<std::vector<int64_t>, K> st;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return;
    if (sizes[d] == 1) continue;
    // Merge into the previous (outer) kept dim when that dim steps exactly over this one.
    bool merge = !sz.empty();
    for (size_t k = 0; k < K && merge; ++k) {
      merge = st[k].back() == (*strides[k])[d] * sizes[d];
    }
    if (merge) {
      sz.back() *= sizes[d];
      for (size_t k = 0; k < K; ++k) st[k].back() = (*strides[k])[d];
    } else {
      sz.push_back(sizes[d]);
      for (size_t k = 0; k < K; ++k) st[k].push_back((*strides[k])[d]);
    }
  }
  std::array<int64_t, K> offsets{};
  std::array<int64_t, K> inner{};
  if (sz.empty()) {
    for (size_t k = 0; k < K; ++k) inner[k] = 1;
    fn(offsets, int64_t{1}, inner);
    return;
  }
  const size_t rank = sz.size();
  const int64_t n = sz[rank - 1];
  for (size_t k = 0; k < K; ++k) inner[k] = st[k][rank - 1];
  std::vector<int64_t> counter(rank - 1, 0);
  while (true) {
    fn(offsets, n, inner);
    // Advance the outer counters (odometer), updating offsets incrementally.
    size_t d = rank - 1;
    while (d > 0) {
      --d;
      if (++counter[d] < sz[d]) {
        for (size_t k = 0; k < K; ++k) offsets[k] += st[k][d];
        break;
      }
      for (size_t k = 0; k < K; ++k) offsets[k] -= st[k][d] * (sz[d] - 1);
      counter[d] = 0;
      if (d == 0) return;
    }
    if (rank == 1) return;
  }
}

}  // namespace funcol::detail
