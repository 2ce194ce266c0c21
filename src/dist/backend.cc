// Backend selection and the threads launcher: run_local, the calling thread's world.
#include "funcol/dist/backend.h"

#include <fmt/format.h>

#include <atomic>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "funcol/core/error.h"
#include "funcol/dist/work.h"
#include "affinity.h"
#include "checks.h"
#include "threads/threads_backend.h"

namespace funcol {

namespace {

thread_local ProcessGroup* t_current_world = nullptr;
// The world of a process backend (init_process_group), for threads without a WorldScope.
std::atomic<ProcessGroup*> g_process_world{nullptr};

// The first exception any rank threw, in time order.
class FirstFailure {
 public:
  void record(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_) first_ = std::move(e);
  }
  void rethrow() {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::mutex mu_;
  std::exception_ptr first_;
};

}  // namespace

void run_local(int world_size, const std::function<void(ProcessGroup& world)>& fn) {
  run_local(world_size, fn, LocalOptions{});
}

void run_local(int world_size, const std::function<void(ProcessGroup& world)>& fn,
               const LocalOptions& options) {
  if (world_size < 1 || world_size > kMaxLocalRanks) {
    throw InvalidArgument(fmt::format("run_local: world_size must be between 1 and {}, got {}",
                                      kMaxLocalRanks, world_size));
  }
  if (!fn) throw InvalidArgument("run_local: the rank function is empty");
  if (options.timeout.count() < 0) {
    throw InvalidArgument(
        fmt::format("run_local: timeout must not be negative, got {} ms", options.timeout.count()));
  }
  std::chrono::milliseconds timeout = effective_timeout(options.timeout);
  auto world = threads_detail::make_world(world_size, timeout);
  std::vector<std::unique_ptr<GroupRegistry>> registries;
  std::vector<std::shared_ptr<ProcessGroup>> groups;
  for (int r = 0; r < world_size; ++r) {
    registries.push_back(std::make_unique<GroupRegistry>());
    groups.push_back(threads_detail::make_world_group(world, r, registries.back().get()));
    registries.back()->add(groups.back());
  }

  std::vector<int> cpus;
  if (options.bind_threads) cpus = dist_detail::allowed_cpus();
  const bool bind = static_cast<int>(cpus.size()) >= world_size;

  FirstFailure failure;
  std::vector<dist_detail::UnwaitedFailures> unwaited(static_cast<size_t>(world_size));
  auto body = [&](int rank) {
    dist_detail::CpuBinding binding(bind ? cpus[rank] : -1);
    std::string reason = "returned";
    {
      WorldScope scope(groups[rank].get());
      try {
        fn(*groups[rank]);
      } catch (const std::exception& e) {
        failure.record(std::current_exception());
        reason = std::string("threw: ") + e.what();
      } catch (...) {
        failure.record(std::current_exception());
        reason = "threw a non-standard exception";
      }
    }
    threads_detail::depart(*world, rank, reason);
    unwaited[static_cast<size_t>(rank)] = threads_detail::drain(*world, rank);
  };

  // Rank 0 runs on the calling thread; a thread that cannot start counts as a departed rank.
  std::vector<std::thread> threads;
  for (int r = 1; r < world_size; ++r) {
    try {
      threads.emplace_back(body, r);
    } catch (const std::system_error& e) {
      failure.record(std::make_exception_ptr(
          CommError(fmt::format("run_local: could not start the thread of rank {}: {}", r, e.what()))));
      for (int q = r; q < world_size; ++q) {
        threads_detail::depart(*world, q, "its thread could not start");
      }
      break;
    }
  }
  body(0);
  for (auto& t : threads) t.join();
  failure.rethrow();
  // Every rank returned, yet a collective one of them left unwaited failed (a peer never issued
  // it, or it timed out): nothing else would say so. After a rank's error the rethrown error
  // explains those failures.
  for (int r = 0; r < world_size; ++r) unwaited[static_cast<size_t>(r)].warn(r);
}

ProcessGroup* current_world() {
  return t_current_world != nullptr ? t_current_world
                                    : g_process_world.load(std::memory_order_acquire);
}

namespace dist_detail {
// Declared in dist/multiprocess/process_world.h; set by init_process_group.
void set_process_world(ProcessGroup* world) {
  g_process_world.store(world, std::memory_order_release);
}
}  // namespace dist_detail

WorldScope::WorldScope(ProcessGroup* world) : previous_(t_current_world) {
  t_current_world = world;
}

WorldScope::~WorldScope() { t_current_world = previous_; }

std::vector<std::string> available_backends() {
  std::vector<std::string> names;
#ifdef FUNCOL_WITH_GLOO
  names.push_back("gloo");
#endif
#ifdef FUNCOL_WITH_MPI
  names.push_back("mpi");
#endif
  names.push_back("threads");
  return names;
}

}  // namespace funcol
