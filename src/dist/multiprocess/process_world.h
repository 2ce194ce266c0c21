// The contract between init_process_group and a process backend (mpi, gloo).
#pragma once

#include <memory>

#include "dist/multiprocess/process_group_base.h"
#include "funcol/dist/backend.h"

namespace funcol::process {

// A process backend's world: the group registered as "world", and the job every group of the
// process shares (destroy_process_group shuts it down).
struct ProcessWorld {
  std::shared_ptr<ProcessGroupBase> world;
  std::shared_ptr<ProcessJob> job;
};

// Creates the world; registry is the process's registry (the world registers itself in it).
using BackendInit = ProcessWorld (*)(const InitOptions& options, GroupRegistry& registry);

}  // namespace funcol::process

namespace funcol::dist_detail {
// Makes `world` current_world() for every thread without a WorldScope (null clears it).
// Defined next to current_world() in src/dist/backend.cc.
void set_process_world(ProcessGroup* world);
}  // namespace funcol::dist_detail
