// Launchers that run a function on N ranks and rethrow the first failure (tests only).
#pragma once

#include <functional>

#include "funcol/dist/backend.h"
#include "funcol/dist/process_group.h"

namespace funcol::testing {

// What one rank runs.
using RankFn = std::function<void(ProcessGroup& world)>;
// Runs `fn` on `world_size` ranks of some backend; throws the first failure once every rank
// finished. Threads: run_local. A process backend (mpi, gloo) runs fn on this process's rank
// and should make a failure on any rank visible on every rank (e.g. all-reduce a flag).
using Launcher = std::function<void(int world_size, const RankFn& fn)>;

// The threads backend's launcher, with run_local's options (e.g. a small timeout).
inline Launcher threads_launcher(LocalOptions options = {}) {
  return [options](int world_size, const RankFn& fn) { run_local(world_size, fn, options); };
}

// Runs fn on `world_size` thread ranks; rethrows the first failure after all ranks finished.
inline void run_ranks(int world_size, const RankFn& fn, LocalOptions options = {}) {
  run_local(world_size, fn, options);
}

}  // namespace funcol::testing
