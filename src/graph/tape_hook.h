// The eager tape's entry into funcol::ops::call (graph-private; the api layer sets it).
#pragma once

#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "funcol/core/tensor.h"
#include "funcol/graph/ops.h"

namespace funcol::ops_detail {

// Called by ops::call for every eager call (no tracer involved) once a GradTape exists, on any
// thread: records the op on the tape that tracks an operand and returns its tracked results,
// or refuses an untracked view of a tracked value, and a tracked operand on a thread other than
// its tape's; nullopt to run the op as it is. Without it a funcol::ops result of a tracked
// tensor was an untracked constant, and its gradient was lost without a word.
using TapeHook = std::optional<std::vector<Tensor>> (*)(std::string_view op,
                                                         std::span<const Tensor> operands,
                                                         const NamedAttrs& attrs);

// Installs `hook` for every thread (GradTape's constructor; the same hook every time).
void set_tape_hook(TapeHook hook);

}  // namespace funcol::ops_detail
