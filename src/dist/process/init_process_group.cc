// init_process_group / destroy_process_group: the process backends' factory table and the
// process-wide world.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dist/multiprocess/process_env.h"
#include "dist/multiprocess/process_world.h"
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#ifdef FUNCOL_WITH_GLOO
#include "dist/gloo/gloo_backend.h"
#endif
#ifdef FUNCOL_WITH_MPI
#include "dist/mpi/mpi_backend.h"
#endif

namespace funcol {
namespace {

struct BackendEntry {
  const char* name;
  process::BackendInit init;
};

// Every process backend compiled into this build, sorted by name: the one place a process
// backend is registered (no self-registering statics).
std::vector<BackendEntry> register_all_backends() {
  return {
#ifdef FUNCOL_WITH_GLOO
      {"gloo", &gloo_backend::init_world},
#endif
#ifdef FUNCOL_WITH_MPI
      {"mpi", &mpi_backend::init_world},
#endif
  };
}

// The process's world. Leaked on purpose: the exit handler still uses it after static
// destructors may have run.
struct ProcessState {
  std::mutex mu;
  std::string backend;
  std::unique_ptr<GroupRegistry> registry;
  process::ProcessWorld world;
  // The jobs started and not yet known to be unused, kept so that no job is destroyed on one
  // of its own threads (a group dropped last by the watchdog or the peer monitor);
  // destroy_process_group shuts a job down explicitly. Guarded by mu.
  std::vector<std::shared_ptr<process::ProcessJob>> jobs;
  bool exit_handler = false;

  // Destroys the jobs that are shut down (their threads joined) and held by nothing else (no
  // group a caller kept): each init/destroy cycle used to keep its job, about 1.5 KB and a
  // record per peer, for the life of the process. Nothing holds a job weakly, so one held
  // only here stays so until it is dropped. Called with mu held.
  void prune_jobs() {
    std::erase_if(jobs, [](const std::shared_ptr<process::ProcessJob>& job) {
      return job->shut_down() && job.use_count() == 1;
    });
  }
};

ProcessState& state() {
  static auto* s = new ProcessState;
  return *s;
}

// destroy_process_group, or the process's exit with the world still up (`at_exit`: the peers
// are told it exited without destroy_process_group).
void destroy_world(bool at_exit);

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const std::string& backend,
                                                 const InitOptions& options) {
  const auto backends = register_all_backends();
  const BackendEntry* entry = nullptr;
  for (const auto& b : backends) {
    if (backend == b.name) entry = &b;
  }
  if (entry == nullptr) {
    const std::string available = fmt::format("{}", fmt::join(available_backends(), ", "));
    if (backend == "threads") {
      std::vector<std::string> process_backends;
      for (const auto& b : backends) process_backends.emplace_back(b.name);
      throw InvalidArgument(fmt::format(
          "init_process_group: the threads backend runs ranks as threads of one process; use "
          "run_local (process backends available: {})",
          process_backends.empty() ? std::string("none")
                                   : fmt::format("{}", fmt::join(process_backends, ", "))));
    }
    if (backend == "mpi" || backend == "gloo") {
      throw InvalidArgument(fmt::format(
          "init_process_group: backend '{}' is not compiled into this build (configure with "
          "-DFUNCOL_WITH_{}=ON); available backends: {}",
          backend, backend == "mpi" ? "MPI" : "GLOO", available));
    }
    throw InvalidArgument(fmt::format(
        "init_process_group: unknown backend '{}'; available backends: {}", backend, available));
  }
  if (options.timeout.count() < 0) {
    throw InvalidArgument(fmt::format("init_process_group: timeout must not be negative, got {} ms",
                                      options.timeout.count()));
  }
  ProcessState& s = state();
  std::lock_guard lock(s.mu);
  if (s.world.world) {
    throw InvalidArgument(fmt::format(
        "init_process_group: already initialised with backend '{}'; call destroy_process_group "
        "first",
        s.backend));
  }
  // A rank a funcol launcher started ends with it (before joining, if it is gone already).
  process::follow_launcher();
  auto registry = std::make_unique<GroupRegistry>();
  process::ProcessWorld world = entry->init(options, *registry);
  registry->add(world.world);
  s.backend = backend;
  s.registry = std::move(registry);
  s.world = world;
  s.prune_jobs();
  s.jobs.push_back(world.job);
  dist_detail::set_process_world(world.world.get());
  process::note_backend_owner();
  if (!s.exit_handler) {
    // A process that exits without destroy_process_group still says goodbye, so its peers
    // tell "finished" from "died".
    std::atexit([] { destroy_world(/*at_exit=*/true); });
    s.exit_handler = true;
  }
  return world.world;
}

void destroy_process_group() { destroy_world(/*at_exit=*/false); }

namespace {

void destroy_world(bool at_exit) {
  // A child forked without exec (its exit handlers run this too) is no rank: its parent is.
  if (process::forked_from_backend_owner()) return;
  ProcessState& s = state();
  std::unique_ptr<GroupRegistry> registry;
  process::ProcessWorld world;
  {
    std::lock_guard lock(s.mu);
    if (!s.world.world) return;
    dist_detail::set_process_world(nullptr);
    registry = std::move(s.registry);
    world = std::move(s.world);
    s.world = {};
    s.backend.clear();
  }
  // Every collective issued on any group (a caller may still hold groups, or have dropped a
  // result) ends first, within the timeout: what this process issued completes for its peers
  // too (a goodbye with collectives still running failed them). Dropping the groups lets their
  // workers finish; then the goodbye tells the peers how far this process got. Groups a caller
  // still holds must not be used afterwards.
  auto job = world.job;
  job->drain().warn(job->rank());  // collectives in flight that failed: see ProcessJob::drain
  registry.reset();
  world = {};
  job->shutdown(at_exit);
  job.reset();
  if (!at_exit) {
    std::lock_guard lock(s.mu);
    s.prune_jobs();
  }
}

}  // namespace

void set_departure_error(const std::string& what) {
  ProcessState& s = state();
  std::lock_guard lock(s.mu);
  // The world's peer monitor sends it with its goodbye (a job of one process has none).
  if (s.world.job && s.world.job->monitor() != nullptr) {
    s.world.job->monitor()->set_departure_error(what);
  }
}

}  // namespace funcol
