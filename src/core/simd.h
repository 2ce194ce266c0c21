// Private: the run-time choice between the reduction kernels' AVX2 loops and their portable
// ones (used by kernels.cc; gemm.h makes the same choice for the f32 product).
#pragma once

#include <atomic>

namespace funcol::detail {

// True when this CPU has AVX2 and reduce_avx2_disabled is false: the two-source reductions
// (every 2-rank all_reduce and reduce_scatter) then run their AVX2 loops.
bool have_avx2();
// Tests: true sends the two-source reductions to the portable loops on every CPU, so that the
// loops a CPU without AVX2 runs are tested on one that has it.
extern std::atomic<bool> reduce_avx2_disabled;

}  // namespace funcol::detail
