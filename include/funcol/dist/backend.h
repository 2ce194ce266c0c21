// Backend selection and the threads launcher: run_local and the current rank's world.
#pragma once

#include <chrono>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "funcol/dist/process_group.h"

namespace funcol {

// The most ranks run_local runs: a thread each, on one machine (InvalidArgument beyond).
constexpr int kMaxLocalRanks = 4096;

// Runs fn once per rank, as `world_size` threads of this process over the `threads` backend.
// Blocks until every rank has finished, then rethrows the first exception any rank threw
// (the earliest in time). A rank that throws or returns early makes its peers' pending and
// future collectives on shared groups fail with CommError within about a second. A rank that
// returns waits for the collectives it left in flight (each within its timeout); when no rank
// threw and some of those failed, or some that failed earlier had results the rank dropped
// without a wait throwing the failure (Work::failure_seen), it warns on stderr ("funcol:
// warning: rank R ended with a collective it had not waited for, which failed: ...").
void run_local(int world_size, const std::function<void(ProcessGroup& world)>& fn);

// Options of run_local.
struct LocalOptions {
  // Timeout of every collective of the run; zero means default_timeout() (FUNCOL_TIMEOUT or
  // 300 s). Tests of failure paths set it small.
  std::chrono::milliseconds timeout{0};
  // Pin rank r's thread to the r-th CPU the calling thread may run on, while the rank runs
  // (the calling thread, rank 0, gets its own mask back afterwards). Only when there are at
  // least as many such CPUs as ranks. Two ranks on one core hand every small collective over
  // through the scheduler (3-9 us instead of 1 for a 4 KiB all_reduce); binding rules that
  // out, as mpirun's --bind-to core does. Threads a rank starts inherit its CPU, so it is off
  // by default; `funcol bench` turns it on.
  bool bind_threads = false;
};
void run_local(int world_size, const std::function<void(ProcessGroup& world)>& fn,
               const LocalOptions& options);

// The world group of the calling thread's rank (set by run_local and by the process backends'
// init), or null outside any rank.
ProcessGroup* current_world();

// Makes `world` the calling thread's world until the guard dies (backends and launchers).
class WorldScope {
 public:
  explicit WorldScope(ProcessGroup* world);
  ~WorldScope();
  WorldScope(const WorldScope&) = delete;
  WorldScope& operator=(const WorldScope&) = delete;

 private:
  ProcessGroup* previous_;
};

// Backend names compiled into this build, sorted ("gloo", "mpi", "threads").
std::vector<std::string> available_backends();

// How a process backend ("mpi", "gloo") finds its peers. Unset fields come from the
// environment: RANK, WORLD_SIZE, FUNCOL_STORE (a directory, file:///dir or redis://host:port),
// and FUNCOL_TIMEOUT; mpi takes rank and size from MPI itself.
struct InitOptions {
  int rank = -1;
  int world_size = -1;
  std::string store;
  std::chrono::milliseconds timeout{0};  // 0: default_timeout()
};

// Creates this process's world group on a process backend, registers it as "world" in the
// process's registry and makes it current_world() for every thread of the process that has
// no WorldScope of its own. Throws InvalidArgument for an unknown or not-compiled backend
// (naming available_backends()) and CommError when rendezvous fails or times out.
std::shared_ptr<ProcessGroup> init_process_group(const std::string& backend,
                                                 const InitOptions& options = {});
// Releases the process's world (and its subgroups). Safe to call when none exists. First waits
// for every collective this process issued (results dropped included) to end, each within its
// timeout, so that what it issued completes for its peers too; then says goodbye. Warns on
// stderr, as run_local, of those that failed and of earlier failures whose results the process
// dropped unseen, unless it recorded an error of its own (set_departure_error).
void destroy_process_group();

// Records why this process is about to leave its job (one line, say an exception's what()), for
// a process backend's goodbye: the peers' errors about collectives it never joined then read
// "rank R departed after an error (WHAT)" instead of "rank R departed (destroy_process_group)".
// Call it before destroy_process_group (or before exiting, when the exit handler says goodbye).
// Does nothing without a process world (or in a job of one process). The threads backend needs
// none: a rank's exception reaches its peers' errors by itself.
void set_departure_error(const std::string& what);

}  // namespace funcol
