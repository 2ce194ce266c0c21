// The mpi backend: every MPI call runs on one communication thread per process, which posts
// nonblocking collectives in issue order and polls them with MPI_Testall.
#include "dist/mpi/mpi_backend.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <numeric>
#include <thread>

#include "dist/checks.h"
#include "dist/multiprocess/process_env.h"
#include "dist/multiprocess/wide_reduce.h"
#include "funcol/core/error.h"
#include "funcol/core/kernels.h"

namespace funcol::mpi_backend {
namespace {

using process::CollectiveOp;
using process::OpKind;
using process::order_sensitive;
using Clock = std::chrono::steady_clock;

// Polls without sleeping this many times after the last progress, then backs off to at most
// kMaxIdleSleep between polls, so idle ranks leave the cores (CI oversubscribes them) while a
// busy stream of collectives keeps low latency.
constexpr int kSpinPolls = 200;
constexpr std::chrono::microseconds kMaxIdleSleep{1000};
// At exit, how long outstanding collectives may take to drain before giving up on them.
constexpr std::chrono::seconds kExitDrain{10};
// How often a caller blocked on the communication thread (call_until) checks for lost ranks.
constexpr std::chrono::milliseconds kGiveUpPoll{50};
// How long a rank that saw only departures waits to see the death that probably caused them.
constexpr std::chrono::milliseconds kLossWait{500};

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

// ---- datatypes and reduction operators (created once, on the communication thread) ----

MPI_Datatype g_f16 = MPI_DATATYPE_NULL;
MPI_Datatype g_bf16 = MPI_DATATYPE_NULL;
MPI_Op g_custom_ops[8] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL,
                          MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::Bool:
      return MPI_C_BOOL;
    case DType::U8:
      return MPI_UINT8_T;
    case DType::I8:
      return MPI_INT8_T;
    case DType::I16:
      return MPI_INT16_T;
    case DType::I32:
      return MPI_INT32_T;
    case DType::I64:
      return MPI_INT64_T;
    case DType::F16:
      return g_f16;
    case DType::BF16:
      return g_bf16;
    case DType::F32:
      return MPI_FLOAT;
    case DType::F64:
      return MPI_DOUBLE;
  }
  return MPI_DATATYPE_NULL;
}

// The funcol dtype of a datatype handed to a user-defined operator.
DType dtype_of(MPI_Datatype t) {
  if (t == g_f16) return DType::F16;
  if (t == g_bf16) return DType::BF16;
  if (t == MPI_C_BOOL) return DType::Bool;
  for (DType d : kAllDTypes) {
    if (mpi_type(d) == t) return d;
  }
  FUNCOL_CHECK(false, "user-defined MPI operator called with an unknown datatype");
  return DType::F32;
}

// MPI's contract: inout[i] = in[i] op inout[i]; every funcol reduce op is commutative.
template <ReduceOp R>
void user_reduce(void* in, void* inout, int* len, MPI_Datatype* type) {
  reduce_inplace(R, dtype_of(*type), inout, in, *len);
}

void create_types_and_ops() {
  MPI_Type_contiguous(2, MPI_BYTE, &g_f16);
  MPI_Type_commit(&g_f16);
  MPI_Type_contiguous(2, MPI_BYTE, &g_bf16);
  MPI_Type_commit(&g_bf16);
  MPI_User_function* fns[8] = {user_reduce<ReduceOp::Sum>,     user_reduce<ReduceOp::Sum>,
                               user_reduce<ReduceOp::Product>, user_reduce<ReduceOp::Min>,
                               user_reduce<ReduceOp::Max>,     user_reduce<ReduceOp::BAnd>,
                               user_reduce<ReduceOp::BOr>,     user_reduce<ReduceOp::BXor>};
  for (int i = 0; i < 8; ++i) MPI_Op_create(fns[i], /*commute=*/1, &g_custom_ops[i]);
}

// Predefined operators where they compute exactly what funcol's kernels do: bitwise ops, integer
// min and max. funcol's kernels through user-defined operators for the rest: f16/bf16 min and
// max, bool; integer sum and product, which must wrap around (Open MPI 4.1's AVX component
// saturates i8/u8/i16 sums of 16 bytes or more, so results changed with the buffer size and
// hence with bucketing); float min and max, which must propagate NaN (MPI_MAX keeps one operand
// or the other depending on their order). Floating sums, averages and products never reach
// MPI's operators: they are reduced in rank order (order_sensitive). Avg sums; the caller
// divides afterwards.
MPI_Op mpi_op(ReduceOp op, DType dtype) {
  const bool adds = op == ReduceOp::Sum || op == ReduceOp::Avg || op == ReduceOp::Product;
  if (!is_integer(dtype) || adds) {
    return g_custom_ops[static_cast<int>(op == ReduceOp::Avg ? ReduceOp::Sum : op)];
  }
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      return MPI_SUM;
    case ReduceOp::Product:
      return MPI_PROD;
    case ReduceOp::Min:
      return MPI_MIN;
    case ReduceOp::Max:
      return MPI_MAX;
    case ReduceOp::BAnd:
      return MPI_BAND;
    case ReduceOp::BOr:
      return MPI_BOR;
    case ReduceOp::BXor:
      return MPI_BXOR;
  }
  return MPI_OP_NULL;
}

// ---- the communication thread ----

// Owns MPI for the process: initialises it, runs every MPI call, polls outstanding requests,
// and finalises (or aborts) it at exit. Intentionally leaked so that it outlives static
// destructors that may still drop groups.
class Runtime {
 public:
  // The first call starts MPI (MPI_Init_thread, which Open MPI returns from only once every
  // rank of the job called it) and gives up after `init_timeout` (default: FUNCOL_TIMEOUT):
  // a rank that never starts must not hang the others.
  static Runtime& get(std::chrono::milliseconds init_timeout = {}) {
    static Runtime* runtime = [&] {
      auto* r = new Runtime();
      r->start(process::resolve_timeout(init_timeout));
      return r;
    }();
    if (!runtime->init_error_.empty()) throw CommError(runtime->init_error_);
    return *runtime;
  }

  // Runs fn on the communication thread and returns its result; rethrows its exception.
  template <typename F>
  auto call(F&& fn) -> decltype(fn()) {
    using R = decltype(fn());
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    auto future = task->get_future();
    if (!post([task] { (*task)(); })) throw CommError("mpi: " + unusable());
    return future.get();
  }

  // Runs fn on the communication thread, like call(), for a blocking MPI call that needs every
  // rank (MPI_Comm_split, described by `what`): gives up with CommError when `give_up()`
  // returns a reason (a rank died, so the call can never return) or after `timeout`. MPI then
  // keeps the communication thread for good: the runtime is stuck, later work fails at once
  // and the process exits without MPI_Finalize. fn must own what it uses: it may run after
  // this returns.
  // At the timeout, the error says "<what> timed out after <ms> ms" and `missing()`, which
  // names the ranks that did not arrive where it can ("; some ranks did not arrive" else).
  template <typename F, typename G, typename H>
  auto call_until(const std::string& what, F fn, std::chrono::milliseconds timeout, G&& give_up,
                  H&& missing) -> decltype(fn()) {
    const auto deadline = Clock::now() + timeout;
    using R = decltype(fn());
    auto task = std::make_shared<std::packaged_task<R()>>(std::move(fn));
    auto future = task->get_future();
    if (!post([task] { (*task)(); })) throw CommError(unusable());
    while (future.wait_for(kGiveUpPoll) != std::future_status::ready) {
      std::string why = give_up();
      if (why.empty() && Clock::now() < deadline) continue;
      // Asked before the lock: it may take a while.
      if (why.empty()) {
        why = fmt::format("{} timed out after {} ms{}", what, timeout.count(), missing());
      }
      {
        std::lock_guard lock(mu_);
        // The call may have returned meanwhile; then the runtime is fine.
        if (future.wait_for(std::chrono::seconds(0)) == std::future_status::ready) break;
        if (stuck_.empty()) stuck_ = why;
      }
      mark_unclean("an MPI call did not return in time", why);
      throw CommError(why);
    }
    return future.get();
  }

  // Why work cannot be queued: the communication thread is stuck, or MPI is finalised.
  std::string unusable() {
    std::lock_guard lock(mu_);
    if (!stuck_.empty()) return "the MPI communication thread is blocked for good: " + stuck_;
    return "MPI was already finalised (the process is exiting)";
  }

  // Queues fn for the communication thread; false once MPI is finalised or the thread is
  // stuck in a call that cannot return.
  bool post(std::function<void()> fn) {
    {
      std::lock_guard lock(mu_);
      if (stopped_ || !stuck_.empty()) return false;
      tasks_.push_back(std::move(fn));
    }
    cv_.notify_one();
    return true;
  }

  // Communication thread only: calls done(MPI_SUCCESS or an error code) once every request
  // completed (done may track more requests).
  void track(std::vector<MPI_Request> requests, std::function<void(int)> done) {
    if (requests.empty()) {
      done(MPI_SUCCESS);
      return;
    }
    active_.push_back({std::move(requests), std::move(done)});
  }

  // A collective failed or was abandoned, or a group lost a rank: finalising could wait for
  // it forever. The first cause (`because`: what happened, for the exit's line) and its reason
  // are printed when the process leaves without MPI_Finalize.
  void mark_unclean(const std::string& because, const std::string& reason) {
    {
      std::lock_guard lock(mu_);
      if (unclean_reason_.empty()) {
        unclean_because_ = because;
        unclean_reason_ = reason;
      }
    }
    unclean_.store(true);
  }

 private:
  struct Active {
    std::vector<MPI_Request> requests;
    std::function<void(int)> done;
  };

  void start(std::chrono::milliseconds timeout) {
    // This process starts MPI: its exit handlers below do nothing in a child it forks.
    process::note_backend_owner();
    // Shared with the thread, which may return from MPI_Init_thread after start() gave up.
    auto ready = std::make_shared<std::promise<std::string>>();
    auto ready_future = ready->get_future();
    thread_ = std::thread([this, ready] {
      std::string error = initialise();
      ready->set_value(std::move(error));
      loop();
    });
    if (ready_future.wait_for(timeout) != std::future_status::ready) {
      init_error_ = fmt::format(
          "mpi: init_process_group timed out after {} ms in MPI_Init_thread, which returns once "
          "every rank of the job called it: some rank never started or never called "
          "init_process_group",
          timeout.count());
      {
        std::lock_guard lock(mu_);
        stuck_ = init_error_;
      }
      thread_.detach();
      // A normal exit could block in Open MPI's teardown behind the thread still inside
      // MPI_Init_thread.
      std::atexit([] {
        if (process::forked_from_backend_owner()) return;  // a forked child is no rank
        exit_without_finalize("MPI_Init_thread never returned", "init_process_group timed out");
      });
      return;
    }
    init_error_ = ready_future.get();
    if (init_error_.empty()) {
      std::atexit([] {
        // A forked child is no rank: MPI and the communication thread are its parent's.
        if (!process::forked_from_backend_owner()) get_unchecked().finalise_at_exit();
      });
    }
  }

  static Runtime& get_unchecked() { return get(); }

  // Starts MPI on the communication thread; an error message, empty when it worked.
  std::string initialise() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (!initialized) {
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
        return "mpi: MPI_Init_thread failed";
      }
      owns_mpi_ = true;
      // This thread made MPI_Init_thread and makes every later call, so any level works.
    } else {
      MPI_Query_thread(&provided);
      if (provided < MPI_THREAD_SERIALIZED) {
        return fmt::format(
            "mpi: MPI was initialised with thread level {} by someone else; funcol calls MPI from "
            "its own communication thread and needs MPI_THREAD_SERIALIZED ({}) or higher",
            provided, static_cast<int>(MPI_THREAD_SERIALIZED));
      }
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    create_types_and_ops();
    return {};
  }

  // Tests every tracked request at once with MPI_Testsome: one pass of Open MPI's progress
  // engine for all of them (an MPI_Testall per collective drove it once each, so a pass cost
  // O(in flight): waiting for 64,000 small all_reduces in flight took 19.5 s). Collectives
  // whose requests all completed, or one of which failed, leave the list in order; then, with
  // `call_done`, their callbacks run (done(MPI_SUCCESS or the error), which may track more).
  // True when any left.
  bool test_active(bool call_done) {
    if (active_.empty()) return false;
    flat_.clear();
    for (const Active& a : active_) flat_.insert(flat_.end(), a.requests.begin(), a.requests.end());
    const int n = static_cast<int>(flat_.size());
    indices_.resize(flat_.size());
    statuses_.resize(flat_.size());
    int outcount = 0;
    const int rc = MPI_Testsome(n, flat_.data(), &outcount, indices_.data(), statuses_.data());
    // The error of each request that completed with one; any other failure fails them all.
    errors_.assign(flat_.size(), MPI_SUCCESS);
    if (rc == MPI_ERR_IN_STATUS) {
      for (int k = 0; k < outcount && outcount != MPI_UNDEFINED; ++k) {
        errors_[static_cast<size_t>(indices_[k])] = statuses_[k].MPI_ERROR;
      }
    } else if (rc != MPI_SUCCESS) {
      errors_.assign(flat_.size(), rc);
    }
    std::vector<std::pair<std::function<void(int)>, int>> finished;
    size_t off = 0, kept = 0;
    for (size_t i = 0; i < active_.size(); ++i) {
      Active& a = active_[i];
      bool all_done = true;
      int error = MPI_SUCCESS;
      for (size_t r = 0; r < a.requests.size(); ++r, ++off) {
        a.requests[r] = flat_[off];
        if (flat_[off] != MPI_REQUEST_NULL) all_done = false;
        if (error == MPI_SUCCESS) error = errors_[off];
      }
      if (all_done || error != MPI_SUCCESS) {
        finished.emplace_back(std::move(a.done), error);
      } else {
        if (kept != i) active_[kept] = std::move(a);
        ++kept;
      }
    }
    active_.resize(kept);
    if (call_done) {
      for (auto& [done, error] : finished) done(error);
    }
    return !finished.empty();
  }

  void loop() {
    int idle = 0;
    while (true) {
      std::deque<std::function<void()>> tasks;
      {
        std::unique_lock lock(mu_);
        auto has_work = [&] { return !tasks_.empty() || stopping_; };
        if (active_.empty()) {
          cv_.wait(lock, has_work);
        } else if (idle > kSpinPolls) {
          auto sleep = std::min<std::chrono::microseconds>(
              kMaxIdleSleep, std::chrono::microseconds(1 << std::min(idle - kSpinPolls, 10)));
          cv_.wait_for(lock, sleep, has_work);
        }
        tasks.swap(tasks_);
        if (stopping_ && tasks.empty()) break;
      }
      for (auto& task : tasks) task();
      bool progressed = !tasks.empty();
      if (test_active(/*call_done=*/true)) progressed = true;
      if (progressed) {
        idle = 0;
      } else if (++idle <= kSpinPolls) {
        std::this_thread::yield();
      }
    }
  }

  [[noreturn]] static void exit_without_finalize(const char* because, const std::string& why) {
    std::fprintf(stderr,
                 "funcol mpi: exiting with status 1 without MPI_Finalize because %s (%s)\n",
                 because, why.c_str());
    std::fflush(nullptr);
    std::_Exit(1);
  }

  void finalise_at_exit() {
    {
      std::lock_guard lock(mu_);
      // Neither MPI_Finalize nor a normal exit: the communication thread is still inside MPI.
      if (!stuck_.empty()) exit_without_finalize("an MPI call can never return", stuck_);
    }
    std::promise<void> finished;
    auto posted = post([&] {
      // Let healthy collectives still in flight finish first.
      const auto deadline = Clock::now() + kExitDrain;
      while (!active_.empty() && !unclean_.load() && Clock::now() < deadline) {
        test_active(/*call_done=*/false);
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (unclean_.load() || !active_.empty()) {
        // MPI_Finalize synchronises with every rank, and after a failure some never come.
        // Leave without it: mpirun then ends the job as for a crashed rank. (Not MPI_Abort:
        // two ranks aborting at once can deadlock Open MPI 4.1's mpirun in PMIx_server_finalize.)
        std::string because = "a collective never completed";
        std::string why;
        {
          std::lock_guard lock(mu_);
          if (unclean_.load()) {
            because = unclean_because_;
            why = unclean_reason_;
          } else {
            why = fmt::format("{} MPI request(s) still pending after {} s", active_.size(),
                              kExitDrain.count());
          }
        }
        exit_without_finalize(because.c_str(), why);
      }
      if (owns_mpi_) MPI_Finalize();
      finished.set_value();
    });
    if (!posted) return;
    finished.get_future().wait();
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      stopped_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  bool stopped_ = false;
  std::vector<Active> active_;  // communication thread only
  // test_active's scratch (communication thread only).
  std::vector<MPI_Request> flat_;
  std::vector<int> indices_;
  std::vector<MPI_Status> statuses_;
  std::vector<int> errors_;
  std::string init_error_;
  bool owns_mpi_ = false;
  std::atomic<bool> unclean_{false};
  std::string unclean_because_;  // guarded by mu_
  std::string unclean_reason_;  // guarded by mu_
  std::string stuck_;           // guarded by mu_: why the thread is blocked in MPI for good
};

// Starts a nonblocking MPI operation on the communication thread and waits for it from the
// calling thread until `deadline`; throws CommError naming `what` on error or timeout.
void run_with_deadline(Runtime& rt, const std::function<int(MPI_Request*)>& start,
                       Clock::time_point deadline, const std::string& what) {
  auto result = std::make_shared<std::promise<int>>();
  auto future = result->get_future();
  auto request = std::make_shared<MPI_Request>(MPI_REQUEST_NULL);
  if (!rt.post([&rt, start, result, request] {
        int rc = start(request.get());
        if (rc != MPI_SUCCESS) {
          result->set_value(rc);
          return;
        }
        rt.track({*request}, [result](int code) { result->set_value(code); });
      })) {
    throw CommError(fmt::format("mpi: {}: MPI was already finalised", what));
  }
  if (future.wait_until(deadline) != std::future_status::ready) {
    std::string message = fmt::format("mpi: {} timed out; some ranks did not arrive", what);
    rt.mark_unclean("an MPI call did not complete in time", message);
    throw CommError(message);
  }
  int rc = future.get();
  if (rc != MPI_SUCCESS) throw CommError(fmt::format("mpi: {} failed: {}", what, mpi_error(rc)));
}

// A pointer range, to detect MPI send and receive buffers that overlap.
bool overlaps(const void* a, size_t a_len, const void* b, size_t b_len) {
  auto pa = reinterpret_cast<uintptr_t>(a);
  auto pb = reinterpret_cast<uintptr_t>(b);
  return a_len > 0 && b_len > 0 && pa < pb + b_len && pb < pa + a_len;
}

// One collective of a group on the communication thread, in issue order.
struct Slot {
  std::shared_ptr<CollectiveOp> op;
  bool finished = false;         // MPI is done with it (or it failed)
  std::function<void()> finish;  // what completes its Work, run in issue order
  bool posted = false;           // counted in its group's window (see kMaxPosted)
};

class MpiProcessGroup final : public process::ProcessGroupBase {
 public:
  static std::shared_ptr<MpiProcessGroup> create(int rank, std::vector<int> global_ranks,
                                                 std::string name, GroupRegistry* registry,
                                                 std::shared_ptr<process::ProcessJob> job,
                                                 MPI_Comm comm, MPI_Comm step_comm) {
    std::shared_ptr<MpiProcessGroup> group(new MpiProcessGroup(rank, std::move(global_ranks),
                                                               std::move(name), registry,
                                                               std::move(job), comm, step_comm));
    group->attach();
    return group;
  }

  ~MpiProcessGroup() override {
    // A broken communicator may still have requests MPI owns; the process exits without
    // MPI_Finalize then, so leave it alone. (Not every group broken() names: after a peer's
    // clean departure that failed nothing of ours MPI owns nothing here. Keeping those leaked
    // two communicators, about 16 KB, a world on the rank that left last.)
    if (comm_ != MPI_COMM_NULL && !unclean_.load(std::memory_order_acquire)) {
      MPI_Comm comm = comm_;
      MPI_Comm step_comm = step_comm_;
      // The last reference may go while the runtime finalises (a Work's completion drained at
      // exit holds the group): after MPI_Finalize, MPI frees communicators itself.
      Runtime::get().post([comm, step_comm]() mutable {
        int finalized = 0;
        MPI_Finalized(&finalized);
        if (finalized) return;
        MPI_Comm_free(&comm);
        if (step_comm != MPI_COMM_NULL) MPI_Comm_free(&step_comm);
      });
    }
  }

  std::string backend() const override { return "mpi"; }

  // A coalesced list posts one nonblocking MPI_Iallgather per tensor, all in flight at once:
  // measured (fusion_bench, 2 ranks, 100 x 256 KiB) 1.3x the unbucketed run, where the packed
  // bucket with its pack and unpack copies ran 0.55-0.8x; 1000 x 4 KiB: 2.3x coalesced, 3.8-5.5x
  // packed.
  int64_t all_gather_coalesced_min_bytes() const override { return 64 * 1024; }

  // MPI may still own requests of this communicator: finalising could wait for them forever.
  void on_broken(const std::string& reason) override {
    unclean_.store(true, std::memory_order_release);
    Runtime::get().mark_unclean(
        fmt::format("group '{}' broke (MPI_Finalize could wait for a rank that is gone)", name()),
        fmt::format("group '{}': {}", name(), reason));
  }

  std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& rank_lists,
                                            const std::string& name) override {
    auto mine = dist_detail::check_split(*this, rank_lists, name);
    int color = MPI_UNDEFINED;
    int key = 0;
    for (size_t i = 0; i < rank_lists.size(); ++i) {
      auto it = std::find(rank_lists[i].begin(), rank_lists[i].end(), global_rank());
      if (it != rank_lists[i].end()) {
        color = static_cast<int>(i);
        key = static_cast<int>(it - rank_lists[i].begin());
      }
    }
    // MPI_Comm_split blocks until every rank of the communicator calls it, and groups ranks by
    // their position in rank_lists: agreeing first, with this group's timeout, makes a missing
    // rank a CommError instead of a hang and different lists an error instead of a group of
    // other ranks than this one asked for.
    const int split = agree_on_split(rank_lists, name);
    const std::string what = fmt::format("mpi: split_group '{}' on group '{}' (split {})", name,
                                         this->name(), split);
    // A rank that dies after agreeing never calls MPI_Comm_split, which then blocks for good
    // (mpirun --enable-recovery keeps the survivors running): give up when the monitor reports
    // a loss, or after the group's timeout.
    auto lost = [this, &what]() -> std::string {
      if (job()->monitor() == nullptr) return {};
      const auto losses = job()->monitor()->losses(global_ranks(), kLossWait);
      if (losses.empty()) return {};
      std::vector<int> missing;
      for (const auto& loss : losses) missing.push_back(loss.rank);
      std::sort(missing.begin(), missing.end());
      return fmt::format("{}: {} before MPI_Comm_split; missing ranks {}", what,
                         losses.front().describe(), dist_detail::format_ranks(missing));
    };
    MPI_Comm parent = comm_;
    auto [comm, step_comm] = Runtime::get().call_until(
        what,
        [parent, color, key, what] {
          MPI_Comm out = MPI_COMM_NULL;
          MPI_Comm step = MPI_COMM_NULL;
          int rc = MPI_Comm_split(parent, color, key, &out);
          if (rc != MPI_SUCCESS) throw CommError(fmt::format("{} failed: {}", what, mpi_error(rc)));
          if (out != MPI_COMM_NULL) {
            MPI_Comm_set_errhandler(out, MPI_ERRORS_RETURN);
            rc = MPI_Comm_dup(out, &step);
            if (rc != MPI_SUCCESS) {
              throw CommError(fmt::format("{} failed: MPI_Comm_dup: {}", what, mpi_error(rc)));
            }
          }
          return std::pair<MPI_Comm, MPI_Comm>(out, step);
        },
        job()->timeout(), lost, [this]() -> std::string {
          // A rank stopped (SIGSTOP) or stuck outside funcol does not answer the peer monitor.
          std::vector<int> others;
          for (int r : global_ranks()) {
            if (r != global_rank()) others.push_back(r);
          }
          std::string note;
          if (job()->monitor() != nullptr) {
            note = job()->monitor()->silent_ranks_note(others, process::kProgressQueryWait);
          }
          return note.empty() ? std::string("; some ranks did not arrive") : note;
        });
    if (!mine) {
      dist_detail::note_split(*this, rank_lists);
      return nullptr;
    }
    auto group = create(key, *mine, name, &registry(), job(), comm, step_comm);
    registry().add(group);
    dist_detail::note_split(*this, rank_lists);
    return group;
  }

 protected:
  void submit(const std::shared_ptr<CollectiveOp>& op) override {
    auto self = std::static_pointer_cast<MpiProcessGroup>(shared_from_this());
    if (!Runtime::get().post([self, op] { self->start(op); })) {
      fail_unposted(op, local_failure_message(*op, Runtime::get().unusable()));
    }
  }

 private:
  MpiProcessGroup(int rank, std::vector<int> global_ranks, std::string name,
                  GroupRegistry* registry, std::shared_ptr<process::ProcessJob> job, MPI_Comm comm,
                  MPI_Comm step_comm)
      : ProcessGroupBase(rank, std::move(global_ranks), std::move(name), registry, std::move(job)),
        comm_(comm),
        step_comm_(step_comm) {}

  // Where an op's data travels: funcol's own agreement steps (new_group, split_group, ...) and
  // a tape's backward collectives (any InternalStep) on a communicator of their own, so that
  // MPI never pairs one with a user's collective that a peer issued at the same point (without
  // FUNCOL_DEBUG=detail nothing compares the two; the signature exchange of detail mode stays
  // on comm_, where it catches such a pair).
  MPI_Comm data_comm(const CollectiveOp& op) const {
    return op.signature.step.empty() ? comm_ : step_comm_;
  }

  void fail_mpi(const std::shared_ptr<Slot>& slot, int rc) {
    std::string message = failure_message(*slot->op, mpi_error(rc));
    Runtime::get().mark_unclean("a collective failed in MPI", message);
    fail_op(slot->op, message);
    finished(slot, {});
  }

  // Communication thread: the signature exchange (detail mode), then the collective.
  void start(const std::shared_ptr<CollectiveOp>& op) {
    if (op->done()) return;
    auto slot = std::make_shared<Slot>();
    slot->op = op;
    order_.push_back(slot);
    if (!job()->detail()) {
      // At most kMaxPosted of a group's collectives are posted to MPI at once; the rest wait
      // here, in issue order, so every rank posts the same sequence.
      window_queue_.push_back(slot);
      post_from_window();
      return;
    }
    // MPI matches a communicator's collectives by the order each rank posts them. A
    // collective is posted when its signature exchange completes, and exchanges can complete
    // in a different order on different ranks: with two in flight, one rank could post
    // [sig 1, sig 2, data 1] and another [sig 1, data 1, sig 2], pairing a signature with
    // data (wrong results, MPI_ERR_IN_STATUS, crashes). So one exchange at a time: every
    // rank posts sig 1, data 1, sig 2, data 2, ... Collectives still overlap each other.
    detail_queue_.push_back(slot);
    if (!exchanging_) exchange_next();
  }

  // Posts queued collectives while the window has room (not in detail mode, whose exchanges
  // already keep one collective at a time waiting to be posted). Open MPI's nonblocking
  // collectives are walked on every progress call, each of them: with all of 64,000 small
  // all_reduces posted, waiting for them took 15.7 s, quadratic in the number in flight.
  void post_from_window() {
    while (!gate_ && posted_ < kMaxPosted && !window_queue_.empty()) {
      std::shared_ptr<Slot> slot = std::move(window_queue_.front());
      window_queue_.pop_front();
      if (slot->op->done()) {  // failed while it waited (timeout, lost peer)
        finished(slot, {});
        continue;
      }
      slot->posted = true;
      ++posted_;
      start_collective(slot);
    }
  }

  // Posts the signature exchange of the next queued collective (detail mode). One that failed
  // while it waited (timeout, lost peer, a peer that gave up) is skipped, as post_from_window
  // skips it: its exchange would pair with whatever a peer that has not heard yet posts next
  // on comm_, such as that collective's data.
  void exchange_next() {
    while (!detail_queue_.empty() && !gate_ && detail_queue_.front()->op->done()) {
      std::shared_ptr<Slot> failed = std::move(detail_queue_.front());
      detail_queue_.pop_front();
      finished(failed, {});
    }
    if (detail_queue_.empty() || gate_) {  // open_gate() comes back here
      exchanging_ = false;
      return;
    }
    exchanging_ = true;
    const std::shared_ptr<Slot> slot = std::move(detail_queue_.front());
    detail_queue_.pop_front();
    const std::shared_ptr<CollectiveOp>& op = slot->op;
    const int bytes = static_cast<int>(process::signature_bytes(size()));
    auto mine =
        std::make_shared<std::vector<char>>(process::encode_signature(op->signature, size()));
    auto all = std::make_shared<std::vector<char>>(static_cast<size_t>(bytes) * size());
    MPI_Request request;
    int rc = MPI_Iallgather(mine->data(), bytes, MPI_BYTE, all->data(), bytes, MPI_BYTE, comm_,
                            &request);
    if (rc != MPI_SUCCESS) {
      fail_mpi(slot, rc);
      return exchange_next();
    }
    auto self = std::static_pointer_cast<MpiProcessGroup>(shared_from_this());
    Runtime::get().track({request}, [self, slot, mine, all](int code) {
      if (code != MPI_SUCCESS) {
        self->fail_mpi(slot, code);
      } else if (slot->op->done()) {
        self->finished(slot, {});
      } else if (auto mismatch = self->check_gathered(*slot->op, *all)) {
        // Every rank saw the same signatures and skips the collective: the group stays usable.
        self->finished(slot, [self, op = slot->op, m = *mismatch] { self->fail_mismatch(op, m); });
      } else {
        self->start_collective(slot);
      }
      self->exchange_next();
    });
  }

  void start_collective(const std::shared_ptr<Slot>& slot) {
    const auto& op = slot->op;
    const MPI_Comm comm = data_comm(*op);
    // Buffers MPI reads or writes until completion: copies of overlapping inputs and the
    // all-to-all count arrays.
    struct Scratch {
      std::vector<Tensor> copies;
      std::vector<int> sc, sd, rc, rd;
      // Outputs by index (not a Tensor: another reference would keep the executor from
      // donating one). A reduce-scatter's blocks from every rank, or a small floating sum,
      // avg or product all-reduce's tensors (order_sensitive), reduced into the output in rank
      // order at the end (f16/bf16 in f32, rounding once), as the threads backend does.
      std::vector<std::pair<size_t, Tensor>> blocks;
      std::vector<size_t> by_mpi;  // outputs MPI's all-reduce reduced (an avg is its sum)
      // A larger all-reduce (every dtype and op) in two steps, in the dtype's bytes: an
      // all-to-all gives this rank every rank's block rank() (`blocks`), reduced as a
      // reduce-scatter's into its place in the output, then an all-gather of the reduced
      // blocks.
      struct TwoStep {
        size_t index;
        Tensor blocks;
        Tensor late;  // the all-gather's buffer when the op failed before it was posted
        std::vector<int> counts, displs;  // block r: elements [displs[r], + counts[r])
        std::vector<int> mine, mine_displs;  // counts[rank()] from every rank, back to back
      };
      std::vector<TwoStep> two_step;
    };
    auto scratch = std::make_shared<Scratch>();
    std::vector<MPI_Request> requests;
    // A start that fails after earlier members of a list were posted leaves those running on
    // the op's buffers: they stay tracked, holding the op (its tensors) and the scratch.
    auto post = [&](int rc, MPI_Request request) {
      if (rc == MPI_SUCCESS) {
        requests.push_back(request);
        return true;
      }
      if (!requests.empty()) Runtime::get().track(std::move(requests), [slot, scratch](int) {});
      return false;
    };
    // Every count is checked before anything is posted (the largest tensor of the op bounds
    // them all: all_gather's output, reduce_scatter's input, all_to_all's larger side).
    int64_t largest = 0;
    for (const auto& t : op->inputs) largest = std::max(largest, t.numel());
    for (const auto& t : op->outputs) largest = std::max(largest, t.numel());
    if (largest > INT_MAX) {
      const std::string what = fmt::format("{} elements exceed MPI's int count limit", largest);
      fail_unposted(op, local_failure_message(*op, what));
      finished(slot, {});
      return;
    }
    // An input that overlaps its output travels from a private copy (MPI forbids aliasing).
    auto send_buffer = [&](const Tensor& in, const Tensor& out) -> const void* {
      const void* p = in.raw_data_ptr();
      if (!overlaps(p, in.nbytes(), out.raw_data_ptr(), out.nbytes())) return p;
      // From the caching allocator: a fresh vector's zeroing and page faults cost more than
      // the copy (see gloo's scatter_reduce).
      const Tensor& copy = scratch->copies.emplace_back(
          Tensor::empty({static_cast<int64_t>(in.nbytes())}, DType::U8));
      std::memcpy(copy.raw_data_ptr(), p, in.nbytes());
      return copy.raw_data_ptr();
    };
    int rc = MPI_SUCCESS;
    MPI_Request request = MPI_REQUEST_NULL;
    switch (op->kind) {
      case OpKind::AllReduce:
      case OpKind::AllReduceCoalesced:
      case OpKind::AllReduceFlat:  // a signature kind; such ops run as AllReduce
        for (size_t i = 0; i < op->outputs.size(); ++i) {
          const Tensor& t = op->outputs[i];
          if (t.numel() == 0) continue;
          const MPI_Datatype type = mpi_type(t.dtype());
          const bool small =
              t.nbytes() * static_cast<size_t>(size()) <= process::kGatherReduceBytes;
          if (small && !order_sensitive(t.dtype(), op->reduce_op)) {
            rc = MPI_Iallreduce(MPI_IN_PLACE, t.raw_data_ptr(), static_cast<int>(t.numel()), type,
                                mpi_op(op->reduce_op, t.dtype()), comm, &request);
            scratch->by_mpi.push_back(i);
          } else if (small) {
            // A small floating sum, avg or product: every rank's tensor, reduced here in rank
            // order at the end (as a reduce-scatter's blocks). One collective, posted as any
            // other.
            Tensor& all =
                scratch->blocks.emplace_back(i, Tensor::empty({t.numel() * size()}, t.dtype()))
                    .second;
            rc = MPI_Iallgather(t.raw_data_ptr(), static_cast<int>(t.numel()), type,
                                all.raw_data_ptr(), static_cast<int>(t.numel()), type, comm,
                                &request);
          } else {
            // Larger ones of every dtype and op in two steps: Open MPI's all-reduce slows
            // sharply from 32 MiB a call here (i32, 64 MiB: 0.32-0.33 s against 26-29 ms).
            auto& step = scratch->two_step.emplace_back();
            step.index = i;
            const int n = static_cast<int>(t.numel());
            const int g = size();
            for (int r = 0, at = 0; r < g; ++r) {
              step.counts.push_back(static_cast<int>(process::block_elements(n, g, r)));
              step.displs.push_back(at);
              at += step.counts.back();
            }
            const int mine = step.counts[static_cast<size_t>(rank())];
            for (int r = 0; r < g; ++r) {
              step.mine.push_back(mine);
              step.mine_displs.push_back(r * mine);
            }
            step.blocks = Tensor::empty({int64_t{mine} * g}, t.dtype());
            rc = MPI_Ialltoallv(t.raw_data_ptr(), step.counts.data(), step.displs.data(), type,
                                step.blocks.raw_data_ptr(), step.mine.data(),
                                step.mine_displs.data(), type, comm, &request);
          }
          if (!post(rc, request)) return fail_mpi(slot, rc);
        }
        break;
      case OpKind::AllGather:
      case OpKind::AllGatherCoalesced:
        for (size_t i = 0; i < op->inputs.size(); ++i) {
          const Tensor& in = op->inputs[i];
          const Tensor& out = op->outputs[i];
          if (in.numel() == 0) continue;
          const int n = static_cast<int>(in.numel());
          const MPI_Datatype type = mpi_type(in.dtype());
          // In place when the input is this rank's own block of the output.
          const char* own = static_cast<const char*>(out.raw_data_ptr()) + rank() * in.nbytes();
          const void* send = in.raw_data_ptr() == own ? MPI_IN_PLACE : send_buffer(in, out);
          rc = MPI_Iallgather(send, n, type, out.raw_data_ptr(), n, type, comm, &request);
          if (!post(rc, request)) return fail_mpi(slot, rc);
        }
        break;
      case OpKind::ReduceScatter:
      case OpKind::ReduceScatterCoalesced:
        for (size_t i = 0; i < op->inputs.size(); ++i) {
          const Tensor& in = op->inputs[i];
          const Tensor& out = op->outputs[i];
          if (out.numel() == 0) continue;
          const int n = static_cast<int>(out.numel());
          const MPI_Datatype type = mpi_type(in.dtype());
          // An all-to-all of the blocks; each rank reduces its own over every rank in rank
          // order at the end (f16/bf16 in f32, rounding once), as the threads and gloo
          // backends do: exact for every dtype and op, and Open MPI 4.1's reduce-scatter took
          // 40x the time at 16 MiB (f32, 2 ranks: 98-105 ms against 2.3-2.5 ms).
          Tensor& blocks =
              scratch->blocks.emplace_back(i, Tensor::empty({in.numel()}, in.dtype())).second;
          rc = MPI_Ialltoall(in.raw_data_ptr(), n, type, blocks.raw_data_ptr(), n, type, comm,
                             &request);
          if (!post(rc, request)) return fail_mpi(slot, rc);
        }
        break;
      case OpKind::AllToAll: {
        const Tensor& in = op->inputs[0];
        const Tensor& out = op->outputs[0];
        for (int j = 0; j < size(); ++j) {
          scratch->sc.push_back(static_cast<int>(op->send_counts[j]));
          scratch->sd.push_back(static_cast<int>(op->send_displs[j]));
          scratch->rc.push_back(static_cast<int>(op->recv_counts[j]));
          scratch->rd.push_back(static_cast<int>(op->recv_displs[j]));
        }
        const MPI_Datatype type = mpi_type(in.dtype());
        rc = MPI_Ialltoallv(send_buffer(in, out), scratch->sc.data(), scratch->sd.data(), type,
                            out.raw_data_ptr(), scratch->rc.data(), scratch->rd.data(), type, comm,
                            &request);
        if (!post(rc, request)) return fail_mpi(slot, rc);
        break;
      }
      case OpKind::Broadcast: {
        const Tensor& t = op->outputs[0];
        if (t.numel() == 0) break;
        rc = MPI_Ibcast(t.raw_data_ptr(), static_cast<int>(t.numel()), mpi_type(t.dtype()),
                        op->root, comm, &request);
        if (!post(rc, request)) return fail_mpi(slot, rc);
        break;
      }
      case OpKind::Barrier:
        rc = MPI_Ibarrier(comm, &request);
        if (!post(rc, request)) return fail_mpi(slot, rc);
        break;
    }
    auto self = std::static_pointer_cast<MpiProcessGroup>(shared_from_this());
    auto when_done = [self, slot, scratch](int code) {
      if (code != MPI_SUCCESS) return self->fail_mpi(slot, code);
      self->finished(slot, [self, op = slot->op, scratch] {
        if (op->done()) return;  // failed meanwhile (timeout, lost peer): leave the buffers be
        for (auto& [i, blocks] : scratch->blocks) {
          const Tensor& out = op->outputs[i];
          process::reduce_blocks(op->reduce_op, out.dtype(), out.raw_data_ptr(),
                                 blocks.raw_data_ptr(), self->size(), out.numel());
        }
        if (op->reduce_op == ReduceOp::Avg) {
          for (size_t i : scratch->by_mpi) {
            const Tensor& t = op->outputs[i];
            finish_avg(t.dtype(), t.raw_data_ptr(), t.numel(), self->size());
          }
        }
        self->complete(op);
      });
    };
    if (scratch->two_step.empty()) {
      Runtime::get().track(std::move(requests), std::move(when_done));
      return;
    }
    // The all-gathers are posted when the all-to-alls completed, and MPI pairs a
    // communicator's collectives by the order each rank posts them: nothing else is posted on
    // it meanwhile (gate_), so every rank posts all-to-all, all-gather, then what came next.
    gate_ = true;
    Runtime::get().track(std::move(requests), [self, slot, scratch, when_done](int code) {
      // On an error the group is failed first (queued collectives then leave without being
      // posted on the failed communicator), then let go.
      if (code != MPI_SUCCESS) {
        self->fail_mpi(slot, code);
        return self->open_gate();
      }
      const auto& op = slot->op;
      std::vector<MPI_Request> gathers;
      int rc = MPI_SUCCESS;
      for (auto& step : scratch->two_step) {
        const Tensor& out = op->outputs[step.index];
        // Failed meanwhile (timeout, lost peer): the output is left alone, but the block is
        // still reduced and gathered, in a scratch buffer, for the ranks that go on.
        Tensor late;
        if (op->done()) late = Tensor::empty({out.numel()}, out.dtype());
        char* base = static_cast<char*>(late.defined() ? late.raw_data_ptr() : out.raw_data_ptr());
        if (late.defined()) step.late = late;
        const auto me = static_cast<size_t>(self->rank());
        process::reduce_blocks(op->reduce_op, out.dtype(),
                               base + int64_t{step.displs[me]} * out.itemsize(),
                               step.blocks.raw_data_ptr(), self->size(), step.counts[me]);
        MPI_Request request = MPI_REQUEST_NULL;
        const MPI_Datatype type = mpi_type(out.dtype());
        rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, type, base, step.counts.data(), step.displs.data(),
                             type, self->data_comm(*op), &request);
        if (rc != MPI_SUCCESS) break;
        gathers.push_back(request);
      }
      if (rc != MPI_SUCCESS) {
        if (!gathers.empty()) Runtime::get().track(std::move(gathers), [slot, scratch](int) {});
        self->fail_mpi(slot, rc);
        return self->open_gate();
      }
      self->open_gate();
      Runtime::get().track(std::move(gathers), when_done);
    });
  }

  // Lets the group post again after a two-step all-reduce posted its all-gathers (gate_).
  void open_gate() {
    gate_ = false;
    post_from_window();
    if (job()->detail() && !exchanging_) exchange_next();
  }

  // Ends the slot's collective once every collective issued before it on this group ended:
  // MPI may complete a later request first (a barrier before the all_reduce issued ahead of
  // it), but Works complete in issue order, like every other backend's.
  void finished(const std::shared_ptr<Slot>& slot, std::function<void()> finish) {
    slot->finished = true;
    slot->finish = std::move(finish);
    if (slot->posted) {
      slot->posted = false;
      --posted_;
      post_from_window();
    }
    while (!order_.empty() && (order_.front()->finished || order_.front()->op->done())) {
      auto front = std::move(order_.front());
      order_.pop_front();
      if (front->finished && front->finish) front->finish();
    }
  }

  MPI_Comm comm_;
  MPI_Comm step_comm_;  // agreement steps' data (data_comm): a duplicate of comm_
  std::atomic<bool> unclean_{false};  // on_broken: MPI may own requests of comm_
  std::deque<std::shared_ptr<Slot>> order_;  // communication thread only
  // Detail mode (communication thread only): collectives waiting for their signature
  // exchange, and whether one exchange is in flight.
  std::deque<std::shared_ptr<Slot>> detail_queue_;
  bool exchanging_ = false;
  // The window (communication thread only): collectives not posted yet, and how many are.
  static constexpr int kMaxPosted = 64;
  std::deque<std::shared_ptr<Slot>> window_queue_;
  int posted_ = 0;
  // Set while a two-step all-reduce waits for its all-to-alls (communication thread only):
  // nothing is posted on comm_ until its all-gathers are.
  bool gate_ = false;
};

}  // namespace

process::ProcessWorld init_world(const InitOptions& options, GroupRegistry& registry) {
  const auto timeout = process::resolve_timeout(options.timeout);
  Runtime& rt = Runtime::get(timeout);
  const bool detail = process::debug_detail();  // a bad value fails before any exchange
  auto [rank, size] = rt.call([] {
    int r = 0, n = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return std::pair<int, int>(r, n);
  });
  // Options that disagree with MPI: told to the others through the address exchange below, so
  // that they fail at once naming this rank (they waited out the timeout in the exchange).
  std::string options_error;
  if (options.rank >= 0 && options.rank != rank) {
    options_error = fmt::format("InitOptions::rank {} differs from MPI's rank {}", options.rank,
                                rank);
  } else if (options.world_size >= 0 && options.world_size != size) {
    options_error = fmt::format(
        "InitOptions::world_size {} differs from MPI's world size {} (mpirun -np)",
        options.world_size, size);
  }
  if (!options_error.empty() && size == 1) {
    throw InvalidArgument("mpi backend: " + options_error);
  }
  const auto deadline = Clock::now() + timeout;
  auto comm = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  run_with_deadline(
      rt, [comm](MPI_Request* r) { return MPI_Comm_idup(MPI_COMM_WORLD, comm.get(), r); }, deadline,
      fmt::format("init_process_group (MPI_Comm_idup over {} ranks)", size));
  rt.call([comm] { return MPI_Comm_set_errhandler(*comm, MPI_ERRORS_RETURN); });
  auto step_comm = std::make_shared<MPI_Comm>(MPI_COMM_NULL);
  run_with_deadline(
      rt, [comm, step_comm](MPI_Request* r) { return MPI_Comm_idup(*comm, step_comm.get(), r); },
      deadline, fmt::format("init_process_group (MPI_Comm_idup over {} ranks)", size));

  std::unique_ptr<process::PeerMonitor> monitor;
  if (size > 1) {
    // The monitor listens on every interface; peers on this host dial loopback, others the
    // host's first non-loopback address.
    monitor = std::make_unique<process::PeerMonitor>(rank, size, "0.0.0.0");
    constexpr int kInfoBytes = 512;
    auto mine = std::make_shared<std::vector<char>>(kInfoBytes, 0);
    auto all = std::make_shared<std::vector<char>>(static_cast<size_t>(kInfoBytes) * size, 0);
    char host[MPI_MAX_PROCESSOR_NAME] = {};
    int host_len = 0;
    rt.call([&] { return MPI_Get_processor_name(host, &host_len); });
    // "D|host|address|port|error", D: FUNCOL_DEBUG=DETAIL (1) or not (0) (ranks that differ
    // would pair one's signature exchange with the other's data, delivering wrong bytes);
    // error: options_error, or empty.
    std::string info = fmt::format("{}|{}|{}|{}|{}", detail ? 1 : 0,
                                   std::string(host, static_cast<size_t>(host_len)),
                                   process::default_host_address(), monitor->port(),
                                   options_error);
    std::memcpy(mine->data(), info.data(), std::min<size_t>(info.size(), kInfoBytes - 1));
    run_with_deadline(
        rt,
        [mine, all, comm](MPI_Request* r) {
          return MPI_Iallgather(mine->data(), kInfoBytes, MPI_BYTE, all->data(), kInfoBytes,
                                MPI_BYTE, *comm, r);
        },
        deadline, "init_process_group (exchanging peer addresses)");
    if (!options_error.empty()) throw InvalidArgument("mpi backend: " + options_error);
    std::vector<std::string> addresses(size);
    for (int r = 0; r < size; ++r) {
      std::string entry(all->data() + static_cast<size_t>(r) * kInfoBytes);
      if (entry.empty() || entry[0] != (detail ? '1' : '0')) {
        throw CommError(fmt::format("mpi backend: {} (mpirun -x passes a variable to all)",
                                    process::debug_detail_mismatch(r, rank, detail)));
      }
      // Fields: host, address, port, then the error (which may hold '|').
      std::vector<std::string> fields;
      size_t at = 2;
      for (int f = 0; f < 3; ++f) {
        const size_t bar = std::min(entry.find('|', at), entry.size());
        fields.push_back(entry.substr(std::min(at, entry.size()), bar - std::min(at, bar)));
        at = bar + 1;
      }
      const std::string peer_error = at < entry.size() ? entry.substr(at) : std::string();
      if (!peer_error.empty()) {
        throw CommError(fmt::format(
            "mpi backend: init_process_group failed: rank {} cannot join: {}; missing ranks [{}]",
            r, peer_error, r));
      }
      const std::string& peer_host = fields[0];
      const std::string& ip = fields[1];
      const std::string& port = fields[2];
      addresses[r] =
          (peer_host == std::string(host, static_cast<size_t>(host_len)) ? "127.0.0.1" : ip) + ":" +
          port;
    }
    monitor->connect(addresses,
                     std::chrono::duration_cast<std::chrono::milliseconds>(std::max(
                         deadline - Clock::now(), Clock::duration(std::chrono::seconds(1)))));
  }
  auto job = std::make_shared<process::ProcessJob>("mpi", rank, size, timeout,
                                                   detail, std::move(monitor));
  std::vector<int> ranks(size);
  std::iota(ranks.begin(), ranks.end(), 0);
  auto world = MpiProcessGroup::create(rank, std::move(ranks), "world", &registry, job, *comm,
                                       *step_comm);
  return {world, job};
}

}  // namespace funcol::mpi_backend
