// The mpi backend: Open MPI's nonblocking collectives driven by one communication thread.
#pragma once

#include "dist/multiprocess/process_world.h"

namespace funcol::mpi_backend {

// init_process_group("mpi"): initialises MPI on first use (MPI_THREAD_MULTIPLE when the
// library offers it; every MPI call is made by the one communication thread either way) and
// takes rank and size from MPI_COMM_WORLD. InitOptions::rank / world_size, when set, must
// agree with MPI. MPI is finalised at process exit; after a failed collective the process
// exits with status 1 without MPI_Finalize instead, so that no rank of a broken job waits
// forever in it (mpirun then ends the job).
process::ProcessWorld init_world(const InitOptions& options, GroupRegistry& registry);

}  // namespace funcol::mpi_backend
