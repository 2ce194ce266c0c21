// The `threads` backend: N ranks as threads of one process, shared-memory collectives.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "funcol/dist/process_group.h"

namespace funcol::dist_detail {
class UnwaitedFailures;  // checks.h
}  // namespace funcol::dist_detail

namespace funcol::threads_detail {

// Shared state of one run_local: ranks, their collective queues, groups and rendezvous.
class World;

// A world of `world_size` thread ranks whose collectives time out after `timeout`.
std::shared_ptr<World> make_world(int world_size, std::chrono::milliseconds timeout);
// Rank `rank`'s "world" group (not yet registered in `registry`).
std::shared_ptr<ProcessGroup> make_world_group(const std::shared_ptr<World>& world, int rank,
                                               GroupRegistry* registry);
// Marks `rank` departed: every pending or future collective that still needs it fails at once
// with CommError "... rank R departed (<reason>) before joining; missing ranks [...]".
// Collectives it already joined still complete (its peers' threads execute them).
void depart(World& world, int rank, const std::string& reason);
// Waits (each with its timeout) for every collective `rank` issued and has not finished; returns
// their failures (an unwaited result's failure has nobody else to report to: run_local warns).
dist_detail::UnwaitedFailures drain(World& world, int rank);

// Tests: true makes the streaming copies (FUNCOL_STREAM_MB) take their SSE2 loop on every CPU,
// the loop a CPU without AVX2 runs.
extern std::atomic<bool> stream_avx2_disabled;

}  // namespace funcol::threads_detail
