// Tests of the threads backend: the shared conformance suite, run_local, and failure paths
// (departed ranks, mismatched collectives, timeouts) that must fail fast instead of hanging.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/process_group.h"
#include "dist/threads/threads_backend.h"
#include "testing/conformance.h"
#include "testing/poll.h"
#include "testing/run_ranks.h"

namespace funcol {
namespace {

using Clock = std::chrono::steady_clock;
using testing::poll_until_ready;
using testing::run_ranks;

// Sets an environment variable for a scope, then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

const bool kRegistered = [] {
  testing::ConformanceConfig config;
  config.backend = "threads";
  config.launch = testing::threads_launcher();
  config.world_sizes = {1, 2, 3, 4, 5, 6, 7, 8};
  config.full_large = true;
#ifdef FUNCOL_SANITIZED
  config.reduced = true;
  config.world_sizes = {1, 2, 3, 4, 8};
#endif
  testing::register_conformance_tests(config);
  // Again with every copy of 256 bytes or more streamed (FUNCOL_STREAM_MB=0): a machine with a
  // big cache never streams the conformance sizes, a machine with a small one streams only the
  // largest, and the streaming copy's head and tail must be right at every size and offset.
  // (Machines without SSE2 have no streaming copy: plain copies again. Sanitizer builds run it
  // with ordinary stores, which their checks see.)
  testing::ConformanceConfig streaming;
  streaming.backend = "threads_streaming";
  streaming.launch = [](int world_size, const testing::RankFn& fn) {
    ScopedEnv env("FUNCOL_STREAM_MB", "0");
    run_local(world_size, fn);
  };
  streaming.world_sizes = {2, 3};
  streaming.reduced = true;
  streaming.families = {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast",
                        "coalesced"};
  testing::register_conformance_tests(streaming);
  // And through the streaming copy's SSE2 loop, which a CPU with AVX2 would not take.
  testing::ConformanceConfig sse2 = streaming;
  sse2.backend = "threads_streaming_sse2";
  sse2.launch = [](int world_size, const testing::RankFn& fn) {
    ScopedEnv env("FUNCOL_STREAM_MB", "0");
    struct Sse2Loop {
      Sse2Loop() { threads_detail::stream_avx2_disabled = true; }
      ~Sse2Loop() { threads_detail::stream_avx2_disabled = false; }
    } sse2_loop;
    run_local(world_size, fn);
  };
  sse2.world_sizes = {2};
  sse2.families = {"all_gather", "all_to_all", "broadcast"};
  testing::register_conformance_tests(sse2);
  return true;
}();

TEST(RunLocalTest, RejectsAnInvalidStreamThreshold) {
  for (const char* bad : {"lots", "-1", "8 MB"}) {
    ScopedEnv env("FUNCOL_STREAM_MB", bad);
    try {
      run_local(2, [](ProcessGroup&) {});
      ADD_FAILURE() << "FUNCOL_STREAM_MB=" << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("FUNCOL_STREAM_MB=") + bad),
                std::string::npos)
          << e.what();
    }
  }
  // Empty means unset, and blanks may follow the number, as for FUNCOL_TIMEOUT. A number past
  // any copy means "never" (past 1e12 it was refused as not "0 or more"), and so does a stall
  // warning past any deadline.
  for (const char* good : {"", "16 ", "0.5", "2e12"}) {
    ScopedEnv env("FUNCOL_STREAM_MB", good);
    ScopedEnv warn("FUNCOL_STALL_WARNING", "2e9");
    EXPECT_NO_THROW(run_local(2, [](ProcessGroup& pg) {
      Tensor t = Tensor::full({1000}, DType::F32, 1);
      pg.all_reduce(t, ReduceOp::Sum)->wait();
      EXPECT_EQ(t.to_vector<float>(), std::vector<float>(1000, 2.0f));
    })) << "'" << good << "'";
  }
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Runs fn; returns its CommError's message, or "" when it throws none.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

// Runs fn expecting CommError; returns its message.
template <typename Fn>
std::string comm_error(Fn&& fn) {
  std::string message = error_of(fn);
  if (message.empty()) ADD_FAILURE() << "no CommError";
  return message;
}

// Spins (yielding) until flag is set; bounded so that a broken test fails instead of hanging.
void await(const std::atomic<bool>& flag) {
  auto start = Clock::now();
  while (!flag.load()) {
    if (seconds_since(start) > 20) throw std::runtime_error("await: flag never set");
    std::this_thread::yield();
  }
}

// A moment one rank records for another (an atomic of Clock ticks), and sleeping until `after`
// past it.
Clock::rep now_ticks() { return Clock::now().time_since_epoch().count(); }
void sleep_past(const std::atomic<Clock::rep>& moment, std::chrono::milliseconds after) {
  std::this_thread::sleep_until(Clock::time_point(Clock::duration(moment.load())) + after);
}

constexpr LocalOptions kShortTimeout{std::chrono::milliseconds(200)};

TEST(RunLocalTest, RejectsInvalidWorldSizes) {
  auto noop = [](ProcessGroup&) {};
  EXPECT_THROW(run_local(0, noop), InvalidArgument);
  EXPECT_THROW(run_local(-3, noop), InvalidArgument);
  try {
    run_local(0, noop);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("got 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(run_local(2, noop, LocalOptions{std::chrono::milliseconds(-1)}), InvalidArgument);
  try {
    run_local(2, std::function<void(ProcessGroup&)>());
    ADD_FAILURE() << "an empty rank function was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("run_local: the rank function is empty"),
              std::string::npos)
        << e.what();
  }
}

// A rank's second thread issuing on a group while the rank's own thread is inside an issue on
// it would race for the sequence numbers (and the ranks would disagree on which collective is
// which): refused. Rank 0's ninth small all_reduce waits at issue for the lane slot of its first,
// which rank 1 has not issued yet, so rank 0 is inside an issue while its helper tries.
TEST(RunLocalTest, TwoThreadsIssuingOnOneGroupIsAnError) {
  constexpr int kCalls = 9;  // one more than a group's lane slots
  std::atomic<bool> helper_done{false};
  std::string helper_error;
  run_ranks(2, [&](ProcessGroup& world) {
    std::vector<Tensor> tensors;
    std::vector<std::shared_ptr<Work>> works;
    auto issue_all = [&] {
      for (int i = 0; i < kCalls; ++i) {
        tensors.push_back(Tensor::full({4}, DType::F32, i + 1));
        works.push_back(world.all_reduce(tensors.back(), ReduceOp::Sum));
      }
    };
    if (world.rank() == 0) {
      std::thread helper([&] {
        // Long enough for rank 0 to reach its blocked ninth issue (microseconds away).
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        Tensor t = Tensor::full({4}, DType::F32, 100);
        try {
          world.all_reduce(t, ReduceOp::Sum);
        } catch (const InvalidArgument& e) {
          helper_error = e.what();
        }
        helper_done = true;
      });
      issue_all();
      helper.join();
    } else {
      await(helper_done);
      issue_all();
    }
    for (int i = 0; i < kCalls; ++i) {
      works[i]->wait();
      EXPECT_EQ(tensors[i].to_vector<float>(), std::vector<float>(4, 2.0f * (i + 1)));
    }
  }, LocalOptions{std::chrono::seconds(10)});  // a guard that let the helper in fails, not hangs
  EXPECT_NE(helper_error.find("group 'world' (threads backend, rank 0): collectives issued from "
                              "two threads at once"),
            std::string::npos)
      << helper_error;
}

// LocalOptions{milliseconds::max()} means "never time out": a late rank is waited for (the
// deadline used to overflow, and every collective timed out at once).
TEST(RunLocalTest, HugeTimeoutWaitsForALateRank) {
  run_local(
      2,
      [](ProcessGroup& world) {
        if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        Tensor t = Tensor::full({4}, DType::F32, 1);
        world.all_reduce(t, ReduceOp::Sum)->wait();
        EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 2.f));
      },
      LocalOptions{std::chrono::milliseconds::max()});
}

TEST(RunLocalTest, SetsTheWorldOfEachRankThread) {
  std::atomic<int> seen{0};
  EXPECT_EQ(current_world(), nullptr);
  run_ranks(3, [&](ProcessGroup& world) {
    EXPECT_EQ(current_world(), &world);
    EXPECT_EQ(world.size(), 3);
    EXPECT_EQ(world.name(), "world");
    EXPECT_EQ(world.backend(), "threads");
    EXPECT_EQ(world.global_ranks(), (std::vector<int>{0, 1, 2}));
    seen.fetch_or(1 << world.rank());
  });
  EXPECT_EQ(seen.load(), 7);
  EXPECT_EQ(current_world(), nullptr);
  auto names = available_backends();
  EXPECT_NE(std::find(names.begin(), names.end(), "threads"), names.end());
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
}

TEST(RunLocalTest, SizeOneCompletesImmediately) {
  run_ranks(1, [](ProcessGroup& world) {
    Tensor t = Tensor::full({4}, DType::F32, 3);
    auto w = world.all_reduce(t, ReduceOp::Avg);
    EXPECT_TRUE(w->is_completed());
    EXPECT_TRUE(t.is_ready());
    Tensor out = Tensor::empty({4}, DType::F32);
    EXPECT_TRUE(world.all_gather(out, t)->is_completed());
    EXPECT_EQ(out.to_vector<float>(), std::vector<float>(4, 3.0f));
    EXPECT_TRUE(world.barrier_async()->is_completed());
  });
}

TEST(RunLocalTest, ResultsOutliveTheRun) {
  std::vector<Tensor> results(3);
  run_ranks(3, [&](ProcessGroup& world) {
    Tensor t = Tensor::full({1000}, DType::I64, world.rank() + 1);
    world.all_reduce(t, ReduceOp::Sum);  // not waited: run_local drains it
    results[world.rank()] = t;
  });
  for (const Tensor& t : results) EXPECT_EQ(t.to_vector<int64_t>(), std::vector<int64_t>(1000, 6));
}

// A rank that returns leaving collectives unwaited waits for them (run_local drains it) until
// their timeout, the lane's small all_reduces as the Op path's others: a peer that comes within
// the timeout gets the result; one that comes later is told the others had given up, for both
// kinds alike (the small one used to complete whenever the peer came).
TEST(RunLocalTest, AReturnedRanksUnwaitedCollectivesKeepTheirTimeout) {
  for (const int late_ms : {50, 700}) {
    for (const int64_t numel : {int64_t{4}, int64_t{1} << 16}) {
      SCOPED_TRACE(::testing::Message() << numel << " elements, peer " << late_ms << " ms late");
      std::string message;
      std::vector<float> result;
      ::testing::internal::CaptureStderr();
      run_local(
          2,
          [&](ProcessGroup& world) {
            Tensor t = Tensor::full({numel}, DType::F32, world.rank() + 1);
            if (world.rank() == 0) {
              world.all_reduce(t, ReduceOp::Sum);  // not waited
              return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
            message = error_of([&] { world.all_reduce(t, ReduceOp::Sum)->wait(); });
            if (message.empty()) result = t.to_vector<float>();
          },
          LocalOptions{std::chrono::milliseconds(300)});
      const std::string warnings = ::testing::internal::GetCapturedStderr();
      if (late_ms < 300) {
        EXPECT_EQ(message, "");
        EXPECT_EQ(result, std::vector<float>(numel, 3.0f));
        EXPECT_EQ(warnings, "");
      } else {
        EXPECT_EQ(message,
                  "all_reduce on group 'world' (seq 0): timed out after 0.3 s; missing ranks [1]; "
                  "rank 1 issued it only after the others had given up on it");
        // Rank 0 never learns of it but from run_local's warning.
        EXPECT_EQ(warnings,
                  "funcol: warning: rank 0 ended with a collective it had not waited for, which "
                  "failed: all_reduce on group 'world' (seq 0): timed out after 0.3 s; missing "
                  "ranks [1]\n");
      }
    }
  }
}

// The CPUs the calling thread may run on.
std::vector<int> my_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(pthread_getaffinity_np(pthread_self(), sizeof set, &set), 0);
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// A rank that returns leaving collectives its peer never issues: they fail (here at their
// timeout, the peer returning later), and run_local, which returns normally (no rank threw),
// warns with the count and the first failure. When a rank threw, its rethrown error explains
// such failures: no warning.
TEST(RunLocalTest, WarnsOfUnwaitedCollectivesThatFailed) {
  ::testing::internal::CaptureStderr();
  run_local(
      2,
      [](ProcessGroup& world) {
        if (world.rank() == 1) {
          world.all_reduce(Tensor::full({4}, DType::F32, 1), ReduceOp::Sum);
          world.all_reduce(Tensor::full({4}, DType::F32, 1), ReduceOp::Sum);
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(2500));
        }
      },
      LocalOptions{std::chrono::milliseconds(500)});
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "funcol: warning: rank 1 ended with 2 collectives it had not waited for, which "
            "failed; the first: all_reduce on group 'world' (seq 0): timed out after 0.5 s; "
            "missing ranks [0]\n");

  ::testing::internal::CaptureStderr();
  EXPECT_THROW(run_local(2,
                         [](ProcessGroup& world) {
                           if (world.rank() == 0) throw InvalidArgument("rank 0's own error");
                           world.all_reduce(Tensor::full({4}, DType::F32, 1), ReduceOp::Sum);
                         }),
               InvalidArgument);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

// A collective that fails before its rank returns, whose result the rank dropped unwaited,
// is counted too: ranks that issue different collectives and never look at the results would
// otherwise end silently. A failure the rank saw (a wait threw it, or an access to the
// result) is not counted. Both the lane (small all_reduces) and the Op path.
TEST(RunLocalTest, WarnsOfDroppedResultsWhoseCollectiveFailedEarlier) {
  ::testing::internal::CaptureStderr();
  run_local(2, [](ProcessGroup& world) {
    const int64_t n = world.rank() == 0 ? 2 : 3;
    world.all_reduce(Tensor::full({n}, DType::F32, 1), ReduceOp::Sum);  // the lane
    // An Op:
    world.all_gather(Tensor::empty({2 * n}, DType::F32), Tensor::full({n}, DType::F32, 1));
    // Both failed (the mismatches are found when the last member arrives): the barrier
    // makes sure that each rank's were found before it returns.
    world.barrier();
  });
  const std::string first =
      "2 collectives it had not waited for, which failed; the first: all_reduce on group "
      "'world' (seq 0): mismatched collectives: rank 0 issued all_reduce(f32[2], op sum) but "
      "rank 1 issued all_reduce(f32[3], op sum)\n";
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "funcol: warning: rank 0 ended with " + first + "funcol: warning: rank 1 ended with " +
                first);

  ::testing::internal::CaptureStderr();
  run_local(2, [](ProcessGroup& world) {
    const int64_t n = world.rank() == 0 ? 2 : 3;
    Tensor t = Tensor::full({n}, DType::F32, 1);
    auto work = world.all_reduce(t, ReduceOp::Sum);
    EXPECT_THROW(work->wait(), CommError);
    Tensor g = Tensor::empty({2 * n}, DType::F32);
    world.all_gather(g, Tensor::full({n}, DType::F32, 1));
    EXPECT_THROW(g.to_vector<float>(), CommError);
  });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");

  // Issued after the peer returned: it fails at once.
  ::testing::internal::CaptureStderr();
  run_local(2, [](ProcessGroup& world) {
    if (world.rank() == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    world.all_reduce(Tensor::full({4}, DType::F32, 1), ReduceOp::Sum);
    world.all_gather(Tensor::empty({8}, DType::F32), Tensor::full({4}, DType::F32, 1));
  });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "funcol: warning: rank 1 ended with 2 collectives it had not waited for, which "
            "failed; the first: all_reduce on group 'world' (seq 0): rank 0 departed (returned) "
            "before joining; missing ranks [0]\n");

  // Issued past the collective's timeout, nobody waiting (Op path): the late rank's join finds
  // it timed out and fails it, and the rank gets its own Work saying it came late. Counted
  // once for each rank (it was twice: the failed op and the rank's own Work).
  ::testing::internal::CaptureStderr();
  run_local(
      2,
      [](ProcessGroup& world) {
        if (world.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(600));
        world.all_gather(Tensor::empty({8}, DType::F32), Tensor::full({4}, DType::F32, 1));
        if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
      },
      LocalOptions{std::chrono::milliseconds(200)});
  const std::string late = ::testing::internal::GetCapturedStderr();
  for (int r : {0, 1}) {
    const std::string line = fmt::format(
        "funcol: warning: rank {} ended with a collective it had not waited for, which failed: "
        "all_gather on group 'world' (seq 0): timed out after 0.2 s",
        r);
    EXPECT_NE(late.find(line), std::string::npos) << late;
  }

  // More unseen failures than a rank keeps (FailureLedger::kKept): the count is a lower bound,
  // and says so (it said "64 collectives" for 70).
  ::testing::internal::CaptureStderr();
  run_local(2, [](ProcessGroup& world) {
    if (world.rank() == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (int i = 0; i < 70; ++i) {
      world.all_gather(Tensor::empty({8}, DType::F32), Tensor::full({4}, DType::F32, 1));
    }
  });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(),
            "funcol: warning: rank 1 ended with at least 64 collectives it had not waited for, "
            "which failed; the first: all_gather on group 'world' (seq 0): rank 0 departed "
            "(returned) before joining; missing ranks [0]\n");
}

// bind_threads pins rank r to the r-th allowed CPU when there are enough of them, leaves the
// ranks alone otherwise, and gives the calling thread its own mask back.
TEST(RunLocalTest, BindThreads) {
  const std::vector<int> before = my_cpus();
  LocalOptions options;
  options.bind_threads = true;
  const int fits = static_cast<int>(before.size());
  std::vector<std::vector<int>> seen(fits);
  run_local(
      fits, [&](ProcessGroup& world) { seen[world.rank()] = my_cpus(); }, options);
  for (int r = 0; r < fits; ++r) EXPECT_EQ(seen[r], std::vector<int>{before[r]}) << r;
  EXPECT_EQ(my_cpus(), before);

  std::vector<std::vector<int>> unbound(fits + 1);
  run_local(
      fits + 1, [&](ProcessGroup& world) { unbound[world.rank()] = my_cpus(); }, options);
  for (const auto& cpus : unbound) EXPECT_EQ(cpus, before);
  EXPECT_EQ(my_cpus(), before);
}

TEST(RunLocalTest, BarrierSeparatesPhases) {
  std::atomic<int> arrived{0};
  run_ranks(4, [&](ProcessGroup& world) {
    for (int phase = 1; phase <= 20; ++phase) {
      arrived.fetch_add(1);
      world.barrier();
      // Every rank incremented before anyone passed the first barrier, and nobody increments
      // again before everyone passed the second.
      EXPECT_EQ(arrived.load(), 4 * phase);
      world.barrier();
    }
  });
}

// A rank's thread issuing on another rank's group object would post as that rank: refused,
// naming both ranks, before anything is posted. A thread the owner started may issue for it.
TEST(RunLocalTest, ARankCannotIssueOnAnotherRanksGroupObject) {
  std::atomic<ProcessGroup*> rank0_group{nullptr};
  std::atomic<bool> refused{false};
  run_ranks(4, [&](ProcessGroup& world) {
    auto g = new_group(world, {0, 1});
    if (world.rank() == 0) rank0_group = g.get();
    world.barrier();
    if (world.rank() == 2) {
      Tensor t = Tensor::full({4}, DType::F32, 100);
      try {
        rank0_group.load()->all_reduce(t, ReduceOp::Sum);
        ADD_FAILURE() << "rank 2 issued on rank 0's group object";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("all_reduce on group 'group1': this group object "
                                             "belongs to global rank 0, but global rank 2 called "
                                             "it"),
                  std::string::npos)
            << e.what();
      }
      // A flat call is named as such (not as the plain op it buckets).
      auto inputs = std::make_shared<const std::vector<Tensor>>(
          std::vector<Tensor>{Tensor::full({2}, DType::F32, 1), Tensor::full({2}, DType::F32, 2)});
      try {
        rank0_group.load()->all_reduce_flat(Tensor::empty({4}, DType::F32), inputs,
                                            ReduceOp::Sum);
        ADD_FAILURE() << "rank 2 issued a flat call on rank 0's group object";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("all_reduce_flat on group 'group1': this group "
                                             "object belongs to global rank 0"),
                  std::string::npos)
            << e.what();
      }
      refused = true;
    }
    if (world.rank() < 2) {
      await(refused);
      Tensor t = Tensor::full({4}, DType::F32, 1);
      if (world.rank() == 0) {
        std::thread helper([&] { g->all_reduce(t, ReduceOp::Sum)->wait(); });
        helper.join();
      } else {
        g->all_reduce(t, ReduceOp::Sum)->wait();
      }
      EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 2.0f)) << "rank " << world.rank();
    }
    world.barrier();  // rank 0's group object outlives rank 2's use of it
  });
}

// A thread that outlives run_local (a pool's) issues for rank 0 in one run and for rank 1 in the
// next, each time under that rank's WorldScope: it used to be refused in every other run ("this
// group object belongs to global rank 1, but global rank 0 called it"), as the check cached the
// thread's rank by its world group's address, where the next run's allocator put the other
// rank's group.
TEST(RunLocalTest, AThreadOutlivingRunLocalIssuesForAnotherRankInTheNextRun) {
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> job;
  bool quit = false;
  std::thread pool([&] {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return quit || job; });
      if (quit) return;
      job();
      job = nullptr;
      cv.notify_all();
    }
  });
  auto run_on_pool = [&](const std::function<void()>& fn) {
    std::unique_lock<std::mutex> lock(mu);
    job = fn;
    cv.notify_all();
    cv.wait(lock, [&] { return !job; });
  };
  LocalOptions options;
  options.timeout = std::chrono::seconds(20);
  for (int run = 0; run < 10; ++run) {
    const int delegating = run % 2;
    run_ranks(2, [&](ProcessGroup& world) {
      auto body = [&] {
        WorldScope scope(&world);
        Tensor t = Tensor::full({4}, DType::I32, world.rank() + 1);
        EXPECT_NO_THROW(world.all_reduce(t, ReduceOp::Sum)->wait()) << "run " << run;
        EXPECT_EQ(t.to_vector<int32_t>(), std::vector<int32_t>(4, 3)) << "run " << run;
      };
      if (world.rank() == delegating) {
        run_on_pool(body);
      } else {
        body();
      }
    }, options);
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    quit = true;
  }
  cv.notify_all();
  pool.join();
}

// Groups of more than 16 ranks keep no spare op per rank (R spares of R members each): the
// first rank to join makes the op. Results are the same.
TEST(RunLocalTest, LargeGroupsMakeTheirOpsWhenFirstJoined) {
  run_ranks(24, [](ProcessGroup& world) {
    std::vector<int> first20(20);
    for (int r = 0; r < 20; ++r) first20[r] = r;
    auto big = new_group(world, first20);
    for (int i = 0; i < 3; ++i) {
      Tensor t = Tensor::full({1000}, DType::I64, world.rank() + 1);
      world.all_reduce(t, ReduceOp::Sum)->wait();
      EXPECT_EQ(t.to_vector<int64_t>(), std::vector<int64_t>(1000, 24 * 25 / 2));
      if (big) {
        Tensor g = Tensor::empty({20}, DType::I64);
        big->all_gather(g, Tensor::full({1}, DType::I64, world.rank()))->wait();
        std::vector<int64_t> expected(20);
        for (int r = 0; r < 20; ++r) expected[r] = r;
        EXPECT_EQ(g.to_vector<int64_t>(), expected);
      }
    }
  });
}

TEST(RunLocalTest, IndependentGroupsOverlap) {
  // Rank 0/1 finish many collectives on their pair while ranks 2/3 hold theirs open: groups do
  // not serialize each other.
  std::atomic<bool> done01{false};
  run_ranks(4, [&](ProcessGroup& world) {
    auto pair = world.split_group({{0, 1}, {2, 3}}, "pairs");
    if (world.rank() < 2) {
      for (int i = 0; i < 100; ++i) {
        Tensor t = Tensor::full({64}, DType::F32, 1);
        pair->all_reduce(t, ReduceOp::Sum);
        EXPECT_EQ(t.to_vector<float>(), std::vector<float>(64, 2.0f));
      }
      done01 = true;
    } else {
      await(done01);
      Tensor t = Tensor::full({1}, DType::F32, 1);
      pair->all_reduce(t, ReduceOp::Sum);
      EXPECT_EQ(t.item<float>(), 2.0f);
    }
  });
}

// Groups are independent, as on gloo and mpi: a thread a group on each rank, and a ring of pair
// groups each issued in a cycle, complete (a rank's collectives of every group once ran in its
// issue order: each of these waited for the timeout, blaming a collective that every member
// joined). Two groups issued in opposite orders: the conformance suite's groups family. Sizes
// on the Op path and the lane (small all_reduces, which never waited for other groups).
TEST(RunLocalTest, GroupsOfTheSameRanksMayBeIssuedInAnyOrder) {
  const LocalOptions timeout{std::chrono::seconds(20)};
  for (const int64_t numel : {int64_t{4}, int64_t{1} << 16}) {
    SCOPED_TRACE(numel);
    // A thread a group: each issues 50 all_reduces on its own group, in its own time.
    run_ranks(2, [&](ProcessGroup& world) {
      std::vector<std::shared_ptr<ProcessGroup>> groups = {world.split_group({{0, 1}}, "t1"),
                                                           world.split_group({{0, 1}}, "t2")};
      std::vector<std::thread> threads;
      std::vector<std::string> errors(2);
      for (int i = 0; i < 2; ++i) {
        threads.emplace_back([&, i] {
          try {
            for (int k = 0; k < 50; ++k) {
              Tensor t = Tensor::full({numel}, DType::F32, i + k);
              groups[static_cast<size_t>(i)]->all_reduce(t, ReduceOp::Sum)->wait();
              if (t.to_vector<float>() != std::vector<float>(numel, 2.0f * (i + k))) {
                throw std::runtime_error(fmt::format("wrong sum at {}", k));
              }
            }
          } catch (const std::exception& e) {
            errors[static_cast<size_t>(i)] = e.what();
          }
        });
      }
      for (std::thread& t : threads) t.join();
      EXPECT_EQ(errors, std::vector<std::string>(2));
    }, timeout);
  }
  // A ring: rank 0 issues on {0,1} then {0,2}, rank 1 on {1,2} then {0,1}, rank 2 on {0,2}
  // then {1,2}: each group is second on one of its members.
  run_ranks(3, [&](ProcessGroup& world) {
    auto g01 = world.split_group({{0, 1}, {2}}, "g01");
    auto g12 = world.split_group({{1, 2}, {0}}, "g12");
    auto g02 = world.split_group({{0, 2}, {1}}, "g02");
    const int r = world.rank();
    std::vector<std::shared_ptr<ProcessGroup>> order =
        r == 0 ? std::vector{g01, g02} : r == 1 ? std::vector{g12, g01} : std::vector{g02, g12};
    std::vector<Tensor> outs;
    std::vector<std::shared_ptr<Work>> works;
    for (auto& g : order) {
      outs.push_back(Tensor::empty({2 << 14}, DType::I32));
      works.push_back(g->all_gather(outs.back(), Tensor::full({1 << 14}, DType::I32, r)));
    }
    for (size_t i = 0; i < works.size(); ++i) {
      works[i]->wait();
      const int first = order[i]->global_ranks()[0];
      const int second = order[i]->global_ranks()[1];
      std::vector<int32_t> expected(1 << 14, first);
      expected.resize(2 << 14, second);
      EXPECT_EQ(outs[i].to_vector<int32_t>(), expected);
    }
  }, timeout);
}

// Seeded random programs on overlapping groups (the world, pairs {0,1} {2,3}, pairs {0,2}
// {1,3}) in which each rank interleaves its groups' collectives in an order of its own, keeping
// each group's: every collective completes with the right values, within the timeout.
TEST(RunLocalTest, RandomInterleavingsOfGroupsComplete) {
  const LocalOptions timeout{std::chrono::seconds(20)};
  for (uint32_t seed = 0; seed < 40; ++seed) {
    SCOPED_TRACE(seed);
    struct Call {
      int group;      // 0: world, 1: {0,1}/{2,3}, 2: {0,2}/{1,3}
      int64_t numel;  // per rank; small ones of an all_reduce take the lane
      bool gather;    // all_gather, else all_reduce
    };
    std::mt19937 rng(seed);
    std::vector<Call> program(10 + rng() % 30);
    for (Call& c : program) {
      c.group = static_cast<int>(rng() % 3);
      c.numel = rng() % 2 ? 1 + rng() % 64 : 5000 + rng() % 20000;
      c.gather = rng() % 2 == 0;
    }
    run_ranks(4, [&](ProcessGroup& world) {
      const int me = world.rank();
      std::shared_ptr<ProcessGroup> groups[3] = {
          std::shared_ptr<ProcessGroup>(&world, [](ProcessGroup*) {}),
          world.split_group({{0, 1}, {2, 3}}, "rows"), world.split_group({{0, 2}, {1, 3}}, "cols")};
      // Each group's calls in program order; the rank draws which group goes next.
      std::vector<size_t> next(3, 0);
      std::mt19937 mine(seed * 16 + static_cast<uint32_t>(me));
      std::vector<std::function<void()>> checks;
      for (size_t done = 0; done < program.size(); ++done) {
        int g = 0;
        do {
          g = static_cast<int>(mine() % 3);
        } while (std::none_of(program.begin() + static_cast<std::ptrdiff_t>(next[g]),
                              program.end(), [&](const Call& c) { return c.group == g; }));
        while (program[next[g]].group != g) ++next[g];
        const Call& c = program[next[g]++];
        ProcessGroup& pg = *groups[g];
        const int step = static_cast<int>(&c - program.data());
        const Tensor x = Tensor::full({c.numel}, DType::I64, me * 100 + step);
        if (c.gather) {
          Tensor out = Tensor::empty({c.numel * pg.size()}, DType::I64);
          auto work = pg.all_gather(out, x);
          checks.push_back([&pg, out, work, c, step] {
            work->wait();
            std::vector<int64_t> want;
            for (int r : pg.global_ranks()) want.insert(want.end(), c.numel, r * 100 + step);
            EXPECT_EQ(out.to_vector<int64_t>(), want) << "all_gather at step " << step;
          });
        } else {
          auto work = pg.all_reduce(x, ReduceOp::Sum);
          checks.push_back([&pg, x, work, c, step] {
            work->wait();
            int64_t want = 0;
            for (int r : pg.global_ranks()) want += r * 100 + step;
            EXPECT_EQ(x.to_vector<int64_t>(), std::vector<int64_t>(c.numel, want))
                << "all_reduce at step " << step;
          });
        }
      }
      for (auto& check : checks) check();
    }, timeout);
  }
}

TEST(RunLocalTest, WaiterRunsTheChunksOfAPeerThatDoesNotWait) {
  // Each rank first takes the chunks of its own range of a big collective; rank 1 issues and
  // then does not wait until rank 0 saw the result, so rank 0 must run rank 1's range too.
  for (DType dtype : {DType::F32, DType::I64}) {
    std::atomic<bool> issued1{false};
    std::atomic<bool> done0{false};
    const int64_t numel = (int64_t{1} << 20) / static_cast<int64_t>(itemsize(dtype));
    run_ranks(2, [&](ProcessGroup& world) {
      const int r = world.rank();
      Tensor ar = Tensor::full({numel}, dtype, r + 1);
      Tensor rs_in = Tensor::full({2 * numel}, dtype, 10 * (r + 1));
      Tensor rs_out = Tensor::empty({numel}, dtype);
      if (r == 1) {
        auto w1 = world.all_reduce(ar, ReduceOp::Sum);
        auto w2 = world.reduce_scatter(rs_out, rs_in, ReduceOp::Sum);
        issued1 = true;
        await(done0);
        w1->wait();
        w2->wait();
      } else {
        await(issued1);
        world.all_reduce(ar, ReduceOp::Sum)->wait();
        world.reduce_scatter(rs_out, rs_in, ReduceOp::Sum)->wait();
        done0 = true;
      }
      EXPECT_EQ(ar.to_vector<double>(), std::vector<double>(numel, 3.0));
      EXPECT_EQ(rs_out.to_vector<double>(), std::vector<double>(numel, 30.0));
    });
  }
}

TEST(FailureTest, PeerThrowsBeforeJoining) {
  auto start = Clock::now();
  std::string message;
  try {
    run_local(2, [&](ProcessGroup& world) {
      if (world.rank() == 1) throw std::runtime_error("boom");
      Tensor t = Tensor::full({4}, DType::F32, 1);
      message = comm_error([&] { world.all_reduce(t, ReduceOp::Sum)->wait(); });
    });
    ADD_FAILURE() << "run_local did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom");  // the first failure, not rank 0's CommError
  }
  EXPECT_EQ(message,
            "all_reduce on group 'world' (seq 0): rank 1 departed (threw: boom) before joining; "
            "missing ranks [1]");
  EXPECT_LT(seconds_since(start), 1.0);  // within a second, not at the timeout
}

// A flat collective's failures name it as called (all_reduce_flat), not as the coalesced list
// it is posted like (they said all_reduce_coalesced, which neither the caller nor a lowered
// bucket called), as the mismatch message and the other backends do.
TEST(FailureTest, FlatCollectivesAreNamedAsCalled) {
  const char* names[] = {"all_reduce_flat", "all_gather_flat", "reduce_scatter_flat"};
  for (int kind = 0; kind < 3; ++kind) {
    std::string message;
    try {
      run_local(2, [&](ProcessGroup& world) {
        if (world.rank() == 1) throw std::runtime_error("boom");
        auto inputs = std::make_shared<std::vector<Tensor>>(2, Tensor::full({4}, DType::F32, 1));
        const Tensor out = Tensor::empty({kind == 1 ? 16 : kind == 2 ? 4 : 8}, DType::F32);
        message = comm_error([&] {
          (kind == 0   ? world.all_reduce_flat(out, inputs, ReduceOp::Sum)
           : kind == 1 ? world.all_gather_flat(out, inputs)
                       : world.reduce_scatter_flat(out, inputs, ReduceOp::Sum))
              ->wait();
        });
      });
      ADD_FAILURE() << "run_local did not rethrow";
    } catch (const std::runtime_error&) {
    }
    EXPECT_EQ(message, std::string(names[kind]) +
                           " on group 'world' (seq 0): rank 1 departed (threw: boom) before "
                           "joining; missing ranks [1]");
  }
}

// Only the departed rank is missing: a live member that joins after the failure was found
// gets the same error, which must not name it (it named [1, 2] when rank 2 came late).
TEST(FailureTest, DepartureNamesOnlyTheDepartedAsMissing) {
  std::vector<std::string> messages(3);
  try {
    run_local(3, [&](ProcessGroup& world) {
      if (world.rank() == 1) return;
      if (world.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      Tensor in = Tensor::full({2}, DType::F32, 1);
      Tensor out = Tensor::empty({6}, DType::F32);
      messages[world.rank()] = comm_error([&] { world.all_gather(out, in)->wait(); });
    });
  } catch (const CommError&) {
  }
  for (int r : {0, 2}) {
    EXPECT_EQ(messages[r],
              "all_gather on group 'world' (seq 0): rank 1 departed (returned) before joining; "
              "missing ranks [1]")
        << "rank " << r;
  }
}

// A rank that fails while the others make a group: their error is split_group's, the call
// they made, with the cause after it.
TEST(FailureTest, DepartureDuringSplitGroupNamesSplitGroup) {
  std::vector<std::string> messages(3);
  try {
    run_local(3, [&](ProcessGroup& world) {
      if (world.rank() == 2) throw std::runtime_error("gone");
      messages[world.rank()] = comm_error([&] { world.split_group({{0, 1, 2}}, "all"); });
    });
    ADD_FAILURE() << "no rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "gone");
  }
  for (int r : {0, 1}) {
    EXPECT_EQ(messages[r].rfind("split_group on group 'world' (split 0): all_reduce on group "
                                "'world' (seq 0): rank 2 departed (threw: gone) before joining; "
                                "missing ranks [2]",
                                0),
              0u)
        << messages[r];
  }
}

// More than 64 members: a join's check for departed members must not take member m for member
// m % 64 (a 64-bit mask of joined members did: rank 69 counted as joined once rank 5 had, and
// the op waited for the timeout instead of failing at once).
TEST(FailureTest, PeerBeyondRank64ThrowsBeforeJoining) {
  auto start = Clock::now();
  std::atomic<bool> thrown{false}, first_joined{false};
  std::vector<std::string> messages(70);
  LocalOptions options;
  options.timeout = std::chrono::milliseconds(20000);
  try {
    run_local(
        70,
        [&](ProcessGroup& world) {
          if (world.rank() == 69) {
            thrown = true;
            throw std::runtime_error("boom");
          }
          if (world.rank() == 5) {
            await(thrown);
            std::this_thread::sleep_for(std::chrono::milliseconds(100));  // rank 69 departs
          }
          if (world.rank() != 5) await(first_joined);  // rank 5 joins first
          auto w = world.barrier_async();
          if (world.rank() == 5) first_joined = true;
          messages[world.rank()] = comm_error([&] { w->wait(); });
        },
        options);
    ADD_FAILURE() << "run_local did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom");
  }
  // Failed at rank 5's join, when no other member had joined; only rank 69 is missing (the
  // others are alive and join later).
  for (int r = 0; r < 69; ++r) {
    EXPECT_EQ(messages[r],
              "barrier on group 'world' (seq 0): rank 69 departed (threw: boom) before joining; "
              "missing ranks [69]")
        << "rank " << r;
  }
  // Half the timeout: 70 threads take 1-3 s under ThreadSanitizer on two busy cores, and once
  // 5.04 s (a CI run beside a build).
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(FailureTest, PendingCollectiveFailsWhenPeerThrowsLater) {
  auto start = Clock::now();
  std::atomic<int> issued{0};
  std::atomic<bool> both_issued{false};
  std::string message;
  EXPECT_THROW(run_local(3,
                         [&](ProcessGroup& world) {
                           Tensor t = Tensor::full({1 << 16}, DType::F32, 1);
                           if (world.rank() == 2) {
                             await(both_issued);
                             throw std::logic_error("late failure");
                           }
                           auto w = world.all_reduce(t, ReduceOp::Sum);
                           if (issued.fetch_add(1) == 1) both_issued = true;
                           std::string m = comm_error([&] {
                             if (world.rank() == 0) {
                               t.wait();  // through the pending tensor
                             } else {
                               w->wait();
                             }
                           });
                           if (world.rank() == 0) message = m;
                         }),
               std::logic_error);
  EXPECT_EQ(message,
            "all_reduce on group 'world' (seq 0): rank 2 departed (threw: late failure) before "
            "joining; missing ranks [2]");
  EXPECT_LT(seconds_since(start), 1.0);  // within a second, not at the timeout
}

TEST(FailureTest, PeerReturnsEarly) {
  auto start = Clock::now();
  std::string first, second;
  EXPECT_THROW(run_local(2,
                         [&](ProcessGroup& world) {
                           if (world.rank() == 1) {
                             Tensor t = Tensor::full({2}, DType::F32, 1);
                             world.all_reduce(t, ReduceOp::Sum);  // issued, then it leaves
                             return;
                           }
                           Tensor a = Tensor::full({2}, DType::F32, 1);
                           world.all_reduce(a, ReduceOp::Sum)->wait();  // rank 1 joined this
                           EXPECT_EQ(a.to_vector<float>(), std::vector<float>(2, 2.0f));
                           Tensor b = Tensor::full({2}, DType::F32, 1);
                           first = comm_error([&] { world.all_reduce(b, ReduceOp::Sum)->wait(); });
                           second = comm_error([&] { world.barrier(); });
                           throw CommError(first);
                         }),
               CommError);
  EXPECT_EQ(first,
            "all_reduce on group 'world' (seq 1): rank 1 departed (returned) before joining; "
            "missing ranks [1]");
  EXPECT_NE(second.find("barrier on group 'world' (seq 2): rank 1 departed (returned)"),
            std::string::npos)
      << second;
  EXPECT_LT(seconds_since(start), 1.0);  // within a second, not at the timeout
}

// A collective issued after a peer left fails at once; its outputs must not read as data (the
// input's bytes, or whatever the buffer held): every access, with or without a wait, throws.
// Small all_reduces take the lane, the others the Op path.
TEST(FailureTest, CollectiveIssuedAfterPeerLeftFailsOnEveryDataAccess) {
  const char* kinds[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast"};
  for (int64_t numel : {int64_t{4}, int64_t{1} << 18}) {
    for (int kind = 0; kind < 4; ++kind) {
      std::atomic<bool> leaving{false};
      std::string errors[3];
      run_local(3, [&](ProcessGroup& world) {
        const int r = world.rank();
        if (r == 1) {
          leaving = true;
          return;
        }
        await(leaving);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // rank 1 is gone by now
        Tensor in = Tensor::full({numel}, DType::F32, 1);
        Tensor out = in;  // in place: all_reduce, broadcast
        if (kind == 0) {
          world.all_reduce(in, ReduceOp::Sum);
        } else if (kind == 1) {
          out = Tensor::empty({3 * numel}, DType::F32);
          world.all_gather(out, in);
        } else if (kind == 2) {
          in = Tensor::full({3 * numel}, DType::F32, 1);
          out = Tensor::empty({numel}, DType::F32);
          world.reduce_scatter(out, in, ReduceOp::Sum);
        } else {
          world.broadcast(in, 2);
        }
        for (int i = 0; i < 3; ++i) errors[r] = comm_error([&] { out.to_vector<float>(); });
      });
      for (int r : {0, 2}) {
        const std::string want =
            std::string(kinds[kind]) + " on group 'world' (seq 0): rank 1 departed (returned)";
        EXPECT_NE(errors[r].find(want), std::string::npos)
            << numel << " " << r << ": " << errors[r];
      }
    }
  }
}

TEST(FailureTest, SubgroupPeerDepartureFailsOnlyGroupsThatNeedIt) {
  run_ranks(4, [](ProcessGroup& world) {
    auto pairs = world.split_group({{0, 1}, {2, 3}}, "pairs");
    if (world.rank() == 3) return;
    Tensor t = Tensor::full({3}, DType::I32, 1);
    auto w = pairs->all_reduce(t, ReduceOp::Sum);
    if (world.rank() == 2) {
      std::string m = comm_error([&] { w->wait(); });
      EXPECT_NE(m.find("all_reduce on group 'pairs' (seq 0): rank 3 departed (returned)"),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("missing ranks [3]"), std::string::npos) << m;
    } else {
      w->wait();
      EXPECT_EQ(t.to_vector<int>(), std::vector<int>(3, 2));
    }
  });
}

// Each side of a mismatch gets a CommError naming both calls.
void expect_mismatch(const std::function<std::shared_ptr<Work>(ProcessGroup&)>& issue,
                     std::initializer_list<std::string> pieces) {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](ProcessGroup& world) {
    auto w = issue(world);
    messages[world.rank()] = comm_error([&] { w->wait(); });
    // The group stays usable after a mismatch.
    Tensor t = Tensor::full({2}, DType::F32, 1);
    world.all_reduce(t, ReduceOp::Sum);
    EXPECT_EQ(t.to_vector<float>(), std::vector<float>(2, 2.0f));
  });
  for (const auto& m : messages) {
    EXPECT_NE(m.find("(seq 0): mismatched"), std::string::npos) << m;
    for (const auto& p : pieces) EXPECT_NE(m.find(p), std::string::npos) << m << " lacks " << p;
  }
  EXPECT_EQ(messages[0], messages[1]);
}

TEST(FailureTest, MismatchedOp) {
  expect_mismatch(
      [](ProcessGroup& pg) -> std::shared_ptr<Work> {
        Tensor t = Tensor::full({4}, DType::F32, 1);
        if (pg.rank() == 0) return pg.all_reduce(t, ReduceOp::Sum);
        Tensor out = Tensor::empty({8}, DType::F32);
        return pg.all_gather(out, t);
      },
      {"collective on group 'world' (seq 0): mismatched collectives: rank 0 issued "
       "all_reduce(f32[4], op sum) but rank 1 issued all_gather(f32[4])"});
}

TEST(FailureTest, MismatchedDtype) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        Tensor t = Tensor::full({4}, pg.rank() == 0 ? DType::F32 : DType::F64, 1);
        return pg.all_reduce(t, ReduceOp::Sum);
      },
      {"all_reduce(f32[4], op sum)", "all_reduce(f64[4], op sum)"});
}

// all_reduce_flat lists whose counts differ (even with equal totals) are a mismatch: the
// reduction would pair different tensors' elements.
TEST(FailureTest, MismatchedFlatCounts) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        auto inputs = std::make_shared<std::vector<Tensor>>();
        inputs->push_back(Tensor::full({pg.rank() == 0 ? 2 : 3}, DType::F32, 1));
        inputs->push_back(Tensor::full({pg.rank() == 0 ? 3 : 2}, DType::F32, 1));
        return pg.all_reduce_flat(Tensor::empty({5}, DType::F32), inputs, ReduceOp::Sum);
      },
      {"all_reduce_flat(f32, 2 tensors: numel 2, 3, op sum)",
       "all_reduce_flat(f32, 2 tensors: numel 3, 2, op sum)"});
  expect_mismatch(
      [](ProcessGroup& pg) {
        auto inputs = std::make_shared<std::vector<Tensor>>(1, Tensor::full({2}, DType::F32, 1));
        if (pg.rank() == 0) return pg.all_gather_flat(Tensor::empty({4}, DType::F32), inputs);
        return pg.all_reduce_flat(Tensor::empty({2}, DType::F32), inputs, ReduceOp::Sum);
      },
      {"all_gather_flat(f32, 1 tensors: numel 2)",
       "all_reduce_flat(f32, 1 tensors: numel 2, op sum)"});
}

// Long flat lists that differ past the eighth tensor (a bucket of a thousand members) name the
// first difference, as coalesced lists do: both summaries list the same first eight counts.
// A flat list against a coalesced list of the same kind names neither in the head.
TEST(FailureTest, MismatchedLongFlatListsNameTheFirstDifference) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        auto inputs = std::make_shared<std::vector<Tensor>>(9, Tensor::full({1}, DType::F32, 1));
        inputs->push_back(Tensor::full({pg.rank() == 0 ? 2 : 3}, DType::F32, 1));
        inputs->push_back(Tensor::full({pg.rank() == 0 ? 3 : 2}, DType::F32, 1));
        return pg.all_reduce_flat(Tensor::empty({14}, DType::F32), inputs, ReduceOp::Sum);
      },
      {"(first difference: tensor 9: numel 2 on rank 0, numel 3 on rank 1)"});
  expect_mismatch(
      [](ProcessGroup& pg) {
        const Tensor in = Tensor::full({2}, DType::F32, 1);
        const Tensor out = Tensor::empty({2}, DType::F32);
        if (pg.rank() == 0) {
          return pg.all_reduce_coalesced_into({out}, {in}, ReduceOp::Sum);
        }
        return pg.all_reduce_flat(out, std::make_shared<std::vector<Tensor>>(1, in),
                                  ReduceOp::Sum);
      },
      {"collective on group 'world' (seq 0): mismatched collectives: rank 0 issued "
       "all_reduce_coalesced(1 tensors: f32[2], op sum) but rank 1 issued all_reduce_flat(f32, "
       "1 tensors: numel 2, op sum)"});
}

TEST(FailureTest, MismatchedShape) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        Tensor t = Tensor::full({pg.rank() == 0 ? 4 : 5}, DType::I32, 1);
        return pg.all_reduce(t, ReduceOp::Sum);
      },
      {"i32[4]", "i32[5]"});
}

TEST(FailureTest, MismatchedShapeWithEqualNumel) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        Tensor t = pg.rank() == 0 ? Tensor::full({2, 3}, DType::F32, 1)
                                  : Tensor::full({3, 2}, DType::F32, 1);
        Tensor out = Tensor::empty({12}, DType::F32);
        return pg.all_gather(out, t);
      },
      {"all_gather(f32[2,3])", "all_gather(f32[3,2])"});
}

// More dims than a slot holds in full: the first ones, the dim count and a hash of the whole
// shape are compared (a 7-d mismatch in the last dims went through unnoticed).
TEST(FailureTest, MismatchedShapeWithManyDims) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        Tensor t = pg.rank() == 0 ? Tensor::full({1, 1, 1, 1, 1, 2, 3}, DType::F32, 1)
                                  : Tensor::full({1, 1, 1, 1, 1, 3, 2}, DType::F32, 1);
        return pg.all_reduce(t, ReduceOp::Sum);
      },
      {"all_reduce(f32[1,1,1,1,1,...: 7 dims, #", "mismatched collectives"});
  expect_mismatch(
      [](ProcessGroup& pg) {
        Tensor t = pg.rank() == 0 ? Tensor::full({1, 1, 1, 1, 1, 1, 6}, DType::F32, 1)
                                  : Tensor::full({1, 1, 1, 1, 1, 6}, DType::F32, 1);
        return pg.all_reduce(t, ReduceOp::Sum);
      },
      {"f32[1,1,1,1,1,...: 7 dims, #", "f32[1,1,1,1,1,6]"});
}

TEST(FailureTest, MismatchedCoalescedLists) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        std::vector<Tensor> ts = {Tensor::full({2}, DType::F32, 1)};
        if (pg.rank() == 1) ts.push_back(Tensor::full({3}, DType::I64, 1));
        return pg.all_reduce_coalesced(ts, ReduceOp::Max);
      },
      {"all_reduce_coalesced(1 tensors: f32[2], op max)",
       "all_reduce_coalesced(2 tensors: f32[2], i64[3], op max)"});
}

// The in-place coalesced all_reduce reduces each listed tensor into rank 0's buffer and copies
// it back, chunk by chunk on any waiting thread: a tensor listed twice was reduced twice, the
// two passes racing (elements of one result came out 2, 3 or 4). Rejected, as overlapping
// outputs are in all_reduce_coalesced_into.
TEST(FailureTest, CoalescedAllReduceRejectsATensorListedTwice) {
  run_ranks(2, [](ProcessGroup& pg) {
    Tensor t = Tensor::full({1 << 20}, DType::F32, 1);
    Tensor other = Tensor::full({4}, DType::F32, 1);
    try {
      pg.all_reduce_coalesced({t, other, t}, ReduceOp::Sum)->wait();
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("all_reduce_coalesced: output 0 overlaps output 2"),
                std::string::npos)
          << e.what();
    }
    // The group stays usable.
    pg.all_reduce_coalesced({t.narrow(0, 0, 8), t.narrow(0, 8, 8), other}, ReduceOp::Sum)->wait();
    EXPECT_EQ(t.to_vector<float>()[15], 2);
    EXPECT_EQ(other.to_vector<float>()[3], 2);
  });
}

// all_gather_coalesced and reduce_scatter_coalesced write the caller's outputs chunk by chunk
// on any waiting thread while every rank reads the inputs: an output over another output, or
// over an input other than in place, gave wrong or racing results. Rejected naming the op and
// both tensors; the in-place forms (the input is its output's block for this rank, or the
// output its input's) still work, and the group stays usable.
TEST(FailureTest, CoalescedGatherAndScatterRejectOverlappingOutputs) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto expect_rejected = [](const std::function<void()>& issue,
                              const std::vector<std::string>& parts) {
      try {
        issue();
        ADD_FAILURE() << "no error, expected " << parts[0];
      } catch (const InvalidArgument& e) {
        for (const std::string& part : parts) {
          EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
        }
      }
    };
    const int other = 1 - pg.rank();
    Tensor a = Tensor::full({4}, DType::F32, 1);
    Tensor b = Tensor::full({4}, DType::F32, 2);
    Tensor buf = Tensor::zeros({16}, DType::F32);
    Tensor out = Tensor::zeros({8}, DType::F32);
    expect_rejected(
        [&] { pg.all_gather_coalesced({buf.narrow(0, 0, 8), buf.narrow(0, 4, 8)}, {a, b}); },
        {"all_gather_coalesced: output 0 overlaps output 1"});
    expect_rejected(
        [&] {
          pg.all_gather_coalesced({out, Tensor::zeros({8}, DType::F32)}, {a, out.narrow(0, 4, 4)});
        },
        {"all_gather_coalesced: output 0 overlaps input 1"});
    // Its own output, but the other rank's block.
    expect_rejected([&] { pg.all_gather_coalesced({out}, {out.narrow(0, 4 * other, 4)}); },
                    {"all_gather_coalesced: ", "output 0", "input 0", "block"});
    Tensor in = Tensor::full({8}, DType::F32, 1);
    expect_rejected(
        [&] {
          pg.reduce_scatter_coalesced({buf.narrow(0, 0, 4), buf.narrow(0, 2, 4)}, {in, in},
                                      ReduceOp::Sum);
        },
        {"reduce_scatter_coalesced: output 0 overlaps output 1"});
    expect_rejected(
        [&] {
          pg.reduce_scatter_coalesced({buf.narrow(0, 0, 4), Tensor::zeros({4}, DType::F32)},
                                      {in, buf.narrow(0, 2, 8)}, ReduceOp::Sum);
        },
        {"reduce_scatter_coalesced: output 0 overlaps input 1"});
    expect_rejected(
        [&] { pg.reduce_scatter_coalesced({in.narrow(0, 4 * other, 4)}, {in}, ReduceOp::Sum); },
        {"reduce_scatter_coalesced: ", "output 0", "input 0", "block"});
    // In place: gather into the block that holds this rank's input; scatter onto this rank's
    // block of the input.
    Tensor g = Tensor::zeros({8}, DType::F32);
    Tensor mine = g.narrow(0, 4 * pg.rank(), 4);
    mine.copy_(Tensor::full({4}, DType::F32, pg.rank() + 1));
    Tensor s = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6, 7, 8}, {8});
    pg.all_gather_coalesced({g}, {mine})->wait();
    pg.reduce_scatter_coalesced({s.narrow(0, 4 * pg.rank(), 4)}, {s}, ReduceOp::Sum)->wait();
    EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2}));
    std::vector<float> want = {1, 2, 3, 4, 5, 6, 7, 8};
    for (int k = 0; k < 4; ++k) want[4 * pg.rank() + k] *= 2;
    EXPECT_EQ(s.to_vector<float>(), want);
  });
}

// An empty coalesced list has nothing to move and nobody to meet: every coalesced form returns
// a finished Work at once, naming the op, and takes no sequence number, as the default forms
// (and PyTorch) do. Threads issued it as a collective: a rank that passed one alone hung in it
// or failed its peer with "all_reduce_coalesced(0 tensors: , op sum)".
TEST(FailureTest, EmptyCoalescedListsReturnAtOnce) {
  run_ranks(2, [](ProcessGroup& pg) {
    if (pg.rank() == 0) {
      const std::pair<std::string, std::shared_ptr<Work>> empty[] = {
          {"all_reduce_coalesced", pg.all_reduce_coalesced({}, ReduceOp::Sum)},
          {"all_reduce_coalesced_into", pg.all_reduce_coalesced_into({}, {}, ReduceOp::Sum)},
          {"all_gather_coalesced", pg.all_gather_coalesced({}, {})},
          {"reduce_scatter_coalesced", pg.reduce_scatter_coalesced({}, {}, ReduceOp::Sum)},
      };
      for (const auto& [op, work] : empty) {
        EXPECT_TRUE(work->is_completed()) << op;
        EXPECT_EQ(work->description().rfind(op + " ", 0), 0u) << work->description();
      }
    }
    // Rank 1 never issued them: the next collective is seq 0 on both.
    Tensor t = Tensor::full({4}, DType::F32, 1);
    pg.all_reduce(t, ReduceOp::Sum)->wait();
    EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 2));
  }, LocalOptions{std::chrono::seconds(5)});
}

// A summary lists only the first 8 tensors of a long list: a list that differs further on must
// still show the tensors that differ (both summaries read "..." there).
TEST(FailureTest, MismatchedCoalescedListsFarIn) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        std::vector<Tensor> ts;
        for (int i = 0; i < 12; ++i) ts.push_back(Tensor::full({2}, DType::F32, 1));
        ts[10] = Tensor::full({pg.rank() == 0 ? 3 : 5}, DType::F32, 1);
        return pg.all_reduce_coalesced(ts, ReduceOp::Sum);
      },
      {"tensor 10: f32[3] on rank 0, f32[5] on rank 1"});
}

TEST(FailureTest, MismatchedReduceOp) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        Tensor t = Tensor::full({4}, DType::F32, 1);
        return pg.all_reduce(t, pg.rank() == 0 ? ReduceOp::Sum : ReduceOp::Avg);
      },
      {"op sum", "op avg"});
}

TEST(FailureTest, MismatchedBroadcastRoot) {
  expect_mismatch(
      [](ProcessGroup& pg) {
        Tensor t = Tensor::full({4}, DType::F32, 1);
        return pg.broadcast(t, pg.rank());
      },
      {"src 0", "src 1"});
}

TEST(FailureTest, MismatchedAllToAllSplits) {
  std::vector<std::string> messages(2);
  run_ranks(2, [&](ProcessGroup& pg) {
    Tensor in = Tensor::zeros({3}, DType::F32);
    Tensor out = Tensor::zeros({3}, DType::F32);
    // Rank 0 sends 2 rows to rank 1, but rank 1 expects only 1 from rank 0.
    auto w = pg.rank() == 0 ? pg.all_to_all(out, in, {1, 2}, {1, 2})
                            : pg.all_to_all(out, in, {1, 2}, {2, 1});
    messages[pg.rank()] = comm_error([&] { w->wait(); });
  });
  for (const auto& m : messages) {
    // The first pair that disagrees, in rank order: rank 1's rows for itself.
    EXPECT_NE(m.find("mismatched split sizes: rank 1 sends 1 row to rank 1 but rank 1 expects 2 "
                     "rows from rank 1"),
              std::string::npos)
        << m;
  }
}

// The rows a rank keeps for itself are checked too, whichever rank it is: here every pair of
// ranks agrees, but one rank sends itself 3 rows and expects 1 from itself.
TEST(FailureTest, MismatchedAllToAllSplitsWithItself) {
  for (int odd : {0, 1}) {
    std::vector<std::string> messages(2);
    run_ranks(2, [&](ProcessGroup& pg) {
      std::shared_ptr<Work> w;
      if (pg.rank() == odd) {
        Tensor in = Tensor::zeros({5}, DType::F32);
        Tensor out = Tensor::zeros({3}, DType::F32);
        const std::vector<int64_t> out_splits =
            odd == 0 ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{2, 1};
        const std::vector<int64_t> in_splits =
            odd == 0 ? std::vector<int64_t>{3, 2} : std::vector<int64_t>{2, 3};
        w = pg.all_to_all(out, in, out_splits, in_splits);
      } else {
        Tensor in = Tensor::zeros({4}, DType::F32);
        Tensor out = Tensor::zeros({4}, DType::F32);
        w = pg.all_to_all(out, in, {2, 2}, {2, 2});
      }
      messages[pg.rank()] = comm_error([&] { w->wait(); });
    });
    const std::string r = std::to_string(odd);
    const std::string want = "mismatched split sizes: rank " + r + " sends 3 rows to rank " + r +
                             " but rank " + r + " expects 1 row from rank " + r;
    for (const auto& m : messages) EXPECT_NE(m.find(want), std::string::npos) << odd << ": " << m;
  }
}

// A small all_reduce (the lane) on one rank and a collective of the Op path on the other are a
// mismatch, whichever arrives first; both get one message, and the group keeps working for more
// small all_reduces than the lane has slots (the failed slot was freed).
TEST(LaneTest, MismatchWithTheOpPathInEitherOrder) {
  for (int late : {0, 1}) {
    std::vector<std::string> messages(2);
    run_ranks(2, [&](ProcessGroup& pg) {
      if (pg.rank() == late) std::this_thread::sleep_for(std::chrono::milliseconds(30));
      Tensor small = Tensor::full({4}, DType::F32, 1);
      Tensor big = Tensor::full({1 << 16}, DType::F32, 1);
      auto w = pg.rank() == 0 ? pg.all_reduce(small, ReduceOp::Sum)
                              : pg.all_reduce(big, ReduceOp::Sum);
      messages[pg.rank()] = comm_error([&] { w->wait(); });
      for (int i = 0; i < 20; ++i) {
        Tensor t = Tensor::full({3}, DType::I32, pg.rank() + i);
        pg.all_reduce(t, ReduceOp::Sum)->wait();
        EXPECT_EQ(t.to_vector<int>(), std::vector<int>(3, 1 + 2 * i));
      }
    });
    EXPECT_EQ(messages[0],
              "all_reduce on group 'world' (seq 0): mismatched collectives: rank 0 issued "
              "all_reduce(f32[4], op sum) but rank 1 issued all_reduce(f32[65536], op sum)")
        << "late rank " << late;
    EXPECT_EQ(messages[1], messages[0]) << "late rank " << late;
  }
}

// Three ranks: rank 1 takes the Op path first, rank 0 the lane, rank 2 the Op path after the
// lane was claimed. Every rank gets the mismatch, and the lane slot is freed (the members that
// never come to it are counted out), so later small all_reduces keep working.
TEST(LaneTest, MismatchWithTheOpPathOnThreeRanks) {
  std::vector<std::string> messages(3);
  run_ranks(3, [&](ProcessGroup& pg) {
    Tensor small = Tensor::full({4}, DType::F32, 1);
    Tensor big = Tensor::full({1 << 16}, DType::F32, 1);
    std::shared_ptr<Work> w;
    if (pg.rank() == 1) w = pg.all_reduce(big, ReduceOp::Sum);
    if (pg.rank() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      w = pg.all_reduce(small, ReduceOp::Sum);
      std::this_thread::sleep_for(std::chrono::milliseconds(60));
    }
    if (pg.rank() == 2) {
      std::this_thread::sleep_for(std::chrono::milliseconds(60));
      w = pg.all_reduce(big, ReduceOp::Sum);
    }
    messages[pg.rank()] = comm_error([&] { w->wait(); });
    for (int i = 0; i < 20; ++i) {
      Tensor t = Tensor::full({3}, DType::I32, i);
      pg.all_reduce(t, ReduceOp::Sum)->wait();
      EXPECT_EQ(t.to_vector<int>(), std::vector<int>(3, 3 * i));
    }
  });
  // Rank 1 or 2 (whichever joined the Op first, normally 1) is named with rank 0.
  EXPECT_EQ(messages[0].rfind("all_reduce on group 'world' (seq 0): mismatched collectives: rank 0 "
                              "issued all_reduce(f32[4], op sum) but rank ",
                              0),
            0u)
      << messages[0];
  EXPECT_NE(messages[0].find("issued all_reduce(f32[65536], op sum)"), std::string::npos)
      << messages[0];
  EXPECT_EQ(messages[1], messages[0]);
  EXPECT_EQ(messages[2], messages[0]);
}

// The mismatch is found when the lane rank arrives, not only when it waits on that collective:
// here both ranks wait on a barrier first, which the unfinished Op would otherwise block.
TEST(LaneTest, MismatchFoundWithoutWaitingOnTheLane) {
  auto start = Clock::now();
  std::vector<std::string> messages(2);
  run_ranks(2, [&](ProcessGroup& pg) {
    Tensor small = Tensor::full({4}, DType::F32, 1);
    Tensor big = Tensor::full({1 << 16}, DType::F32, 1);
    std::shared_ptr<Work> w;
    if (pg.rank() == 1) {
      w = pg.all_reduce(big, ReduceOp::Sum);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      w = pg.all_reduce(small, ReduceOp::Sum);
    }
    pg.barrier();
    messages[pg.rank()] = comm_error([&] { w->wait(); });
  });
  EXPECT_NE(messages[0].find("(seq 0): mismatched collectives"), std::string::npos)
      << messages[0];
  EXPECT_EQ(messages[1], messages[0]);
  EXPECT_LT(seconds_since(start), 1.0);  // within a second, not at the timeout
}

// The Op-path side of a lane/Op mismatch may run kLaneSlots (8) collectives ahead before the
// lane side comes: its eighth small all_reduce then holds the slot the lane side needs for
// the mismatched one. The lane side names the mismatch at once (a slot serving a later
// collective of its own means a peer did not take the lane there) instead of waiting for the
// timeout, and the peer's Op gets the same message; the later small all_reduces still work.
// On three ranks both lane ranks find it and report the first message.
TEST(LaneTest, MismatchWhenTheOpPathSideRunsAhead) {
  for (int n : {2, 3}) {
    SCOPED_TRACE(n);
    auto start = Clock::now();
    std::vector<std::string> messages(n);
    std::atomic<bool> ahead{false};
    run_local(
        n,
        [&](ProcessGroup& pg) {
          Tensor small = Tensor::full({4}, DType::F32, 1);
          Tensor big = Tensor::full({1 << 16}, DType::F32, 1);
          std::vector<Tensor> ts;
          std::vector<std::shared_ptr<Work>> works;
          std::shared_ptr<Work> w;
          if (pg.rank() == 1) {
            w = pg.all_reduce(big, ReduceOp::Sum);
            for (int i = 1; i <= 8; ++i) {
              ts.push_back(Tensor::full({3}, DType::I32, i));
              works.push_back(pg.all_reduce(ts.back(), ReduceOp::Sum));
            }
            ahead = true;
          } else {
            while (!ahead) std::this_thread::sleep_for(std::chrono::milliseconds(1));
            w = pg.all_reduce(small, ReduceOp::Sum);
          }
          messages[pg.rank()] = comm_error([&] { w->wait(); });
          if (pg.rank() != 1) {
            for (int i = 1; i <= 8; ++i) {
              ts.push_back(Tensor::full({3}, DType::I32, 10 * i));
              works.push_back(pg.all_reduce(ts.back(), ReduceOp::Sum));
            }
          }
          for (int i = 0; i < 8; ++i) {
            works[i]->wait();
            EXPECT_EQ(ts[i].to_vector<int>(), std::vector<int>(3, (10 * (n - 1) + 1) * (i + 1)))
                << i;
          }
        },
        LocalOptions{std::chrono::milliseconds(5000)});
    if (n == 2) {
      EXPECT_EQ(messages[0],
                "all_reduce on group 'world' (seq 0): mismatched collectives: rank 0 issued "
                "all_reduce(f32[4], op sum) but rank 1 issued all_reduce(f32[65536], op sum)");
    } else {
      // Rank 0 or 2, whichever found it first, is named with rank 1.
      EXPECT_NE(messages[0].find("all_reduce on group 'world' (seq 0): mismatched collectives: "
                                 "rank "),
                std::string::npos)
          << messages[0];
      EXPECT_NE(messages[0].find("issued all_reduce(f32[65536], op sum)"), std::string::npos)
          << messages[0];
    }
    for (int r = 1; r < n; ++r) EXPECT_EQ(messages[r], messages[0]) << r;
    EXPECT_LT(seconds_since(start), 1.0);  // within a second, not at the timeout
  }
}

// A lane collective between two Op-path ones: the Op path's window of unfinished collectives
// moves past the lane's sequence number once every member joined the Op before it. A late rank
// that issues that number on the Op path (a mismatch) gets the mismatch, not an internal error,
// and so do the lane ranks; the group keeps working. With the late rank after the others gave
// up on it, every rank gets the timeout, the late one told it came late.
TEST(LaneTest, MismatchAfterTheOpWindowMovedPastTheLane) {
  for (int n : {2, 3}) {
    for (int late_ms : {50, 700}) {
      SCOPED_TRACE(::testing::Message() << n << " ranks, late by " << late_ms << " ms");
      std::vector<std::string> messages(n);
      std::vector<std::string> errors(n);
      std::atomic<int> through{0};
      run_local(
          n,
          [&](ProcessGroup& pg) {
            const int r = pg.rank();
            if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
            Tensor a = Tensor::full({1 << 14}, DType::F32, 1);
            pg.all_reduce(a, ReduceOp::Sum);
            Tensor b = Tensor::full({r == 0 ? 1 << 14 : 4}, DType::F32, 1);
            std::shared_ptr<Work> w1;
            messages[r] = error_of([&] { w1 = pg.all_reduce(b, ReduceOp::Sum); });
            Tensor c = Tensor::full({1 << 14}, DType::F32, 1);
            auto w2 = pg.all_reduce(c, ReduceOp::Sum);
            if (messages[r].empty()) messages[r] = error_of([&] { w1->wait(); });
            errors[r] = error_of([&] { w2->wait(); });
            // The late rank may still be issuing when the others gave up: the barrier's timeout
            // must not run while it catches up.
            ++through;
            while (through.load() < n) std::this_thread::yield();
            pg.barrier();
            for (int i = 0; i < 12; ++i) {
              Tensor t = Tensor::full({3}, DType::I32, i + r);
              pg.all_reduce(t, ReduceOp::Sum)->wait();
              EXPECT_EQ(t.to_vector<int>(), std::vector<int>(3, n * i + n * (n - 1) / 2));
            }
          },
          LocalOptions{std::chrono::milliseconds(400)});
      if (late_ms == 50) {
        EXPECT_EQ(messages[0],
                  "all_reduce on group 'world' (seq 1): mismatched collectives: rank 0 issued "
                  "all_reduce(f32[16384], op sum) but rank 1 issued all_reduce(f32[4], op sum)");
        for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << r;
      } else {
        EXPECT_EQ(messages[1],
                  "all_reduce on group 'world' (seq 1): timed out after 0.4 s; missing ranks [0]");
        EXPECT_EQ(messages[0],
                  messages[1] + "; rank 0 issued it only after the others had given up on it");
      }
      for (int r = 1; r < n; ++r) EXPECT_EQ(messages[r], messages[1]) << r;
    }
  }
}

// A rank that runs kLaneSlots (8) small all_reduces ahead waits for a slot; when its peer is
// late past the timeout it gives up with an error, and its peer gets the same error for that
// collective instead of waiting for a rank that will never post it. The collective it waited
// for (seq 0) times out then too, as it would for a waiter: it is not reported unfinished at
// seq 8 and then completed. So do seq 1-7, which the peer issued past their deadlines although
// nobody waited for them then. Then the group works again.
TEST(LaneTest, GivingUpOnABusySlot) {
  std::atomic<bool> late_issued{false};
  std::vector<std::vector<std::string>> messages(2, std::vector<std::string>(9));
  run_local(
      2,
      [&](ProcessGroup& pg) {
        if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(700));
        std::vector<Tensor> ts;
        std::vector<std::shared_ptr<Work>> works;
        for (int i = 0; i < 9; ++i) {
          ts.push_back(Tensor::full({3}, DType::I32, i));
          works.push_back(pg.all_reduce(ts.back(), ReduceOp::Sum));
        }
        if (pg.rank() == 1) {
          late_issued = true;
        } else {
          await(late_issued);
        }
        for (int i = 0; i < 9; ++i) messages[pg.rank()][i] = comm_error([&] { works[i]->wait(); });
        for (int i = 0; i < 20; ++i) {
          Tensor t = Tensor::full({3}, DType::I32, i + pg.rank());
          pg.all_reduce(t, ReduceOp::Sum)->wait();
          EXPECT_EQ(t.to_vector<int>(), std::vector<int>(3, 2 * i + 1));
        }
      },
      LocalOptions{std::chrono::milliseconds(300)});
  const std::string late = "; rank 1 issued it only after the others had given up on it";
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(messages[0][i], fmt::format("all_reduce on group 'world' (seq {}): timed out after "
                                          "0.3 s; missing ranks [1]",
                                          i));
    EXPECT_EQ(messages[1][i], messages[0][i] + late);
  }
  EXPECT_EQ(messages[0][8],
            "all_reduce on group 'world' (seq 8): timed out after 0.3 s waiting for all_reduce on "
            "group 'world' (seq 0) to finish; missing ranks [1]");
  EXPECT_EQ(messages[1][8], messages[0][8] + late);
}

// A rank that runs 8 + 5 small all_reduces ahead of a late peer gives up on the last five at
// the deadlines of the collectives they wait for (all about one timeout after its first issue),
// not one whole timeout each: five timeouts before the rank could wait on anything. Each error
// names the collective it waited for, which timed out with it; the late peer gets the same
// errors, and those of the three collectives nobody waited for, which it issued past their
// deadlines. 8 + 8 + 8 ahead: the third eight wait behind failed collectives whose late member
// has yet to count out, and give up one timeout after those failed (each waited a whole
// timeout of its own: eight timeouts).
TEST(LaneTest, RunningFarAheadGivesUpWithinOneTimeout) {
  for (const int ahead : {13, 24}) {
    std::atomic<bool> issued{false};       // rank 0 issued all of them
    std::atomic<bool> late_issued{false};  // rank 1 did
    std::atomic<Clock::rep> issued_0_7{0};   // when rank 0 had issued seq 0-7
    double issue_seconds = 0;
    std::vector<std::vector<std::string>> messages(2, std::vector<std::string>(ahead));
    run_local(
        2,
        [&](ProcessGroup& pg) {
          const int r = pg.rank();
          if (r == 1) {
            await(issued);
            // Past the deadlines of seq 5-7 too (rank 0 ran on at seq 4's), which a rank 0
            // descheduled among its issues could otherwise put after rank 1's.
            sleep_past(issued_0_7, std::chrono::milliseconds(350));
          }
          std::vector<Tensor> ts;
          std::vector<std::shared_ptr<Work>> works;
          const auto start = Clock::now();
          for (int i = 0; i < ahead; ++i) {
            ts.push_back(Tensor::full({2}, DType::I32, i));
            works.push_back(pg.all_reduce(ts.back(), ReduceOp::Sum));
            if (r == 0 && i == 7) issued_0_7 = now_ticks();
          }
          if (r == 0) {
            issue_seconds = std::chrono::duration<double>(Clock::now() - start).count();
            issued = true;
            await(late_issued);
          } else {
            late_issued = true;
          }
          for (int i = 0; i < ahead; ++i) messages[r][i] = comm_error([&] { works[i]->wait(); });
          for (int i = 0; i < 10; ++i) {
            Tensor t = Tensor::full({2}, DType::I32, i + r);
            pg.all_reduce(t, ReduceOp::Sum)->wait();
            EXPECT_EQ(t.to_vector<int>(), std::vector<int>(2, 2 * i + 1));
          }
        },
        LocalOptions{std::chrono::milliseconds(250)});
    // One timeout (two past 16 ahead) and some slack for a sanitized build.
    EXPECT_LT(issue_seconds, ahead <= 16 ? 0.75 : 1.0) << ahead;
    EXPECT_GE(issue_seconds, ahead <= 16 ? 0.2 : 0.45) << ahead;
    for (int i = 0; i < ahead; ++i) {
      EXPECT_EQ(messages[0][i],
                i < 8 ? fmt::format("all_reduce on group 'world' (seq {}): timed out after 0.25 s; "
                                    "missing ranks [1]",
                                    i)
                      : fmt::format("all_reduce on group 'world' (seq {}): timed out after 0.25 s "
                                    "waiting for all_reduce on group 'world' (seq {}) to finish; "
                                    "missing ranks [1]",
                                    i, i % 8));
      EXPECT_EQ(messages[1][i],
                messages[0][i] + "; rank 1 issued it only after the others had given up on it");
    }
  }
}

// Ranks 0 and 1 wait at issue for seq 8's slot, whose seq 0 failed (a mismatch: rank 1 issued a
// large all_reduce) and waits for rank 2 to come and count out. They keep their own deadlines:
// the failed slot's arrived bits include absent members, whose records are stale, and reading
// those made them give up at once with a timeout. Rank 2 comes 200 ms late, within the 2 s
// timeout, and seq 8 completes for all three.
TEST(LaneTest, WaitingBehindAFailedSlotKeepsItsOwnDeadline) {
  std::vector<std::string> at0(3);
  std::vector<std::string> at8(3);
  std::atomic<bool> crossed{false};
  run_local(
      3,
      [&](ProcessGroup& pg) {
        const int r = pg.rank();
        if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(200));
        Tensor a = Tensor::full({r == 1 ? int64_t{1} << 14 : 4}, DType::I32, 1);
        auto w0 = pg.all_reduce(a, ReduceOp::Sum);
        if (r == 1) crossed = true;
        if (r == 0) await(crossed);
        std::vector<Tensor> ts;
        std::vector<std::shared_ptr<Work>> ws;
        for (int i = 1; i < 8; ++i) {
          ts.push_back(Tensor::full({4}, DType::I32, i));
          ws.push_back(pg.all_reduce(ts.back(), ReduceOp::Sum));
        }
        Tensor b = Tensor::full({4}, DType::I32, r);
        at8[r] = error_of([&] { pg.all_reduce(b, ReduceOp::Sum)->wait(); });
        if (at8[r].empty()) {
          EXPECT_EQ(b.to_vector<int>(), std::vector<int>(4, 3));
        }
        at0[r] = comm_error([&] { w0->wait(); });
        for (int i = 1; i < 8; ++i) {
          ws[i - 1]->wait();
          EXPECT_EQ(ts[i - 1].to_vector<int>(), std::vector<int>(4, 3 * i)) << i;
        }
      },
      LocalOptions{std::chrono::milliseconds(2000)});
  EXPECT_EQ(at8, std::vector<std::string>(3));
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(at0[r].find("mismatched collectives"), std::string::npos) << at0[r];
  }
}

// After giving up on a busy slot a rank runs on: its next collective of that slot must not be
// served before the one it gave up on (which its late peer still has to reach). Rank 0 runs on
// once its peer issued seq 0-7 (all timed out: the peer came past their deadlines): issued
// earlier, seq 9-15 would each give up on its own slot's late collective too.
TEST(LaneTest, GivingUpThenRunningOn) {
  std::vector<std::string> messages(2);
  std::atomic<bool> late_issued{false};
  run_local(
      2,
      [&](ProcessGroup& pg) {
        std::vector<Tensor> t;
        for (int i = 0; i < 17; ++i) t.push_back(Tensor::full({4}, DType::F32, i + pg.rank()));
        std::vector<std::shared_ptr<Work>> w(17);
        if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(800));
        for (int i = 0; i < 8; ++i) w[i] = pg.all_reduce(t[i], ReduceOp::Sum);
        if (pg.rank() == 1) {
          late_issued = true;
          for (int i = 0; i < 8; ++i) EXPECT_NE(comm_error([&] { w[i]->wait(); }), "");
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        w[8] = pg.all_reduce(t[8], ReduceOp::Sum);
        if (pg.rank() == 0) await(late_issued);
        messages[pg.rank()] = comm_error([&] { w[8]->wait(); });
        for (int i = 9; i < 17; ++i) w[i] = pg.all_reduce(t[i], ReduceOp::Sum);
        for (int i = 9; i < 17; ++i) {
          w[i]->wait();
          EXPECT_EQ(t[i].to_vector<float>(), std::vector<float>(4, 2 * i + 1)) << i;
        }
        // Rank 0 must not depart before rank 1 is through (a departure fails what is left).
        pg.barrier();
      },
      LocalOptions{std::chrono::milliseconds(600)});
  EXPECT_EQ(messages[0],
            "all_reduce on group 'world' (seq 8): timed out after 0.6 s waiting for all_reduce on "
            "group 'world' (seq 0) to finish; missing ranks [1]");
  EXPECT_EQ(messages[1],
            messages[0] + "; rank 1 issued it only after the others had given up on it");
}

// After giving up on seq 8, a rank's seq 16 (the same slot) waits for the late peer to come to
// seq 8 and times out: its error names that collective and the peer. The late peer is told for
// both that it came after the other had given up, and the group works afterwards.
TEST(LaneTest, GivingUpBehindAnEarlierAbsence) {
  std::atomic<bool> first_issued{false};  // rank 1 issued seq 0-7
  std::atomic<bool> gave_up{false};       // rank 0 gave up on seq 16
  std::atomic<bool> second_issued{false};  // rank 1 issued seq 8-16
  std::atomic<Clock::rep> issued_9_15{0};   // when rank 0 had issued seq 9-15
  std::vector<std::string> at8(2);
  std::vector<std::string> at16(2);
  run_local(
      2,
      [&](ProcessGroup& pg) {
        std::vector<Tensor> t;
        for (int i = 0; i < 17; ++i) t.push_back(Tensor::full({2}, DType::I64, i));
        std::vector<std::shared_ptr<Work>> w(17);
        if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
        for (int i = 0; i < 8; ++i) w[i] = pg.all_reduce(t[i], ReduceOp::Sum);
        if (pg.rank() == 0) {
          at8[0] = comm_error([&] { pg.all_reduce(t[8], ReduceOp::Sum)->wait(); });
          await(first_issued);
          for (int i = 9; i < 16; ++i) w[i] = pg.all_reduce(t[i], ReduceOp::Sum);
          issued_9_15 = now_ticks();
          at16[0] = comm_error([&] { pg.all_reduce(t[16], ReduceOp::Sum)->wait(); });
          gave_up = true;
          await(second_issued);
        } else {
          first_issued = true;
          await(gave_up);
          // Past the deadlines of rank 0's seq 9-15 by a margin: they time out, as seq 1-7 did.
          // (Rank 0's seq 16 gives up one timeout after slot 0 last moved, which may come before
          // those deadlines when rank 0 is descheduled after rank 1 released seq 0.)
          sleep_past(issued_9_15, std::chrono::milliseconds(250));
          at8[1] = comm_error([&] { pg.all_reduce(t[8], ReduceOp::Sum)->wait(); });
          for (int i = 9; i < 16; ++i) w[i] = pg.all_reduce(t[i], ReduceOp::Sum);
          at16[1] = comm_error([&] { pg.all_reduce(t[16], ReduceOp::Sum)->wait(); });
          second_issued = true;
        }
        // Rank 1 issued them past their deadlines (GivingUpOnABusySlot).
        for (int i = 0; i < 16; ++i) {
          if (i != 8) {
            EXPECT_NE(comm_error([&] { w[i]->wait(); }), "") << i;
          }
        }
        for (int i = 0; i < 10; ++i) {
          Tensor x = Tensor::full({2}, DType::I64, i + pg.rank());
          pg.all_reduce(x, ReduceOp::Sum)->wait();
          EXPECT_EQ(x.to_vector<int64_t>(), std::vector<int64_t>(2, 2 * i + 1));
        }
      },
      LocalOptions{std::chrono::milliseconds(200)});
  EXPECT_EQ(at8[0],
            "all_reduce on group 'world' (seq 8): timed out after 0.2 s waiting for all_reduce on "
            "group 'world' (seq 0) to finish; missing ranks [1]");
  EXPECT_EQ(at16[0],
            "all_reduce on group 'world' (seq 16): timed out after 0.2 s waiting for all_reduce "
            "on group 'world' (seq 8) to finish; missing ranks [1]");
  const std::string late = "; rank 1 issued it only after the others had given up on it";
  EXPECT_EQ(at8[1], at8[0] + late);
  EXPECT_EQ(at16[1], at16[0] + late);
}

// Ranks 0 and 1 wait for the slot of seq 8 behind late rank 2, rank 1 from later on; both give
// up when seq 0 times out (at rank 0's issue plus the timeout). Rank 1 was waiting before rank 0
// gave up, so only rank 2 is told it came after the others had, for seq 8 and for seq 0-7
// (which it issued past their deadlines).
TEST(LaneTest, ARankWaitingWhenAnotherGaveUpIsNotCalledLate) {
  std::atomic<bool> gave_up{false};
  std::atomic<bool> third_issued{false};
  std::atomic<Clock::rep> issued_0_7{0};  // when rank 0 had issued seq 0-7
  std::vector<std::string> at8(3);
  std::vector<std::vector<std::string>> at(3, std::vector<std::string>(8));
  run_local(
      3,
      [&](ProcessGroup& pg) {
        const int r = pg.rank();
        std::vector<Tensor> t;
        for (int i = 0; i < 9; ++i) t.push_back(Tensor::full({2}, DType::I32, i));
        std::vector<std::shared_ptr<Work>> w(8);
        if (r == 2) {
          await(gave_up);
          // Past the deadlines of seq 1-7 by a margin, not only seq 0's: rank 0 gives up at seq
          // 0's, and a slow issue of seq 1-7 (ThreadSanitizer on a busy machine) put theirs after
          // rank 2's arrival once, and they completed.
          sleep_past(issued_0_7, std::chrono::milliseconds(700));
        }
        for (int i = 0; i < 8; ++i) w[i] = pg.all_reduce(t[i], ReduceOp::Sum);
        if (r == 0) issued_0_7 = now_ticks();
        if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
        if (r == 2) third_issued = true;
        at8[r] = comm_error([&] { pg.all_reduce(t[8], ReduceOp::Sum)->wait(); });
        if (r == 0) gave_up = true;
        await(third_issued);
        for (int i = 0; i < 8; ++i) at[r][i] = comm_error([&] { w[i]->wait(); });
        for (int i = 0; i < 10; ++i) {
          Tensor x = Tensor::full({2}, DType::I32, i + r);
          pg.all_reduce(x, ReduceOp::Sum)->wait();
          EXPECT_EQ(x.to_vector<int>(), std::vector<int>(2, 3 * i + 3));
        }
      },
      LocalOptions{std::chrono::milliseconds(600)});
  EXPECT_EQ(at8[0],
            "all_reduce on group 'world' (seq 8): timed out after 0.6 s waiting for all_reduce on "
            "group 'world' (seq 0) to finish; missing ranks [2]");
  EXPECT_EQ(at8[1], at8[0]);
  EXPECT_EQ(at8[2], at8[0] + "; rank 2 issued it only after the others had given up on it");
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(at[0][i], fmt::format("all_reduce on group 'world' (seq {}): timed out after 0.6 s; "
                                    "missing ranks [2]",
                                    i));
    EXPECT_EQ(at[1][i], at[0][i]);
    EXPECT_EQ(at[2][i], at[0][i] + "; rank 2 issued it only after the others had given up on it");
  }
}

// A rank gave up on seq 8 of a busy slot; another issued seq 8 on the Op path; the third takes
// the lane. All three get the first error (the Op path's member too), and the slot is freed.
TEST(LaneTest, GivingUpMeetsTheOpPath) {
  std::vector<std::string> messages(3);
  std::atomic<int> late_issued{0};  // ranks 1 and 2 issued seq 0-7 (see GivingUpThenRunningOn)
  run_local(
      3,
      [&](ProcessGroup& pg) {
        std::vector<Tensor> t;
        for (int i = 0; i < 17; ++i) t.push_back(Tensor::full({4}, DType::F32, 1));
        Tensor big = Tensor::full({1 << 14}, DType::F32, 1);
        std::vector<std::shared_ptr<Work>> w(17);
        if (pg.rank() != 0) std::this_thread::sleep_for(std::chrono::milliseconds(800));
        for (int i = 0; i < 8; ++i) w[i] = pg.all_reduce(t[i], ReduceOp::Sum);
        if (pg.rank() != 0) late_issued.fetch_add(1);
        if (pg.rank() == 2) {
          w[8] = pg.all_reduce(big, ReduceOp::Sum);
        } else {
          if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(30));
          w[8] = pg.all_reduce(t[8], ReduceOp::Sum);
        }
        while (late_issued.load() < 2) std::this_thread::yield();
        for (int i = 9; i < 17; ++i) w[i] = pg.all_reduce(t[i], ReduceOp::Sum);
        for (int i = 9; i < 17; ++i) {
          w[i]->wait();
          EXPECT_EQ(t[i].to_vector<float>(), std::vector<float>(4, 3)) << i;
        }
        messages[pg.rank()] = comm_error([&] { w[8]->wait(); });
      },
      LocalOptions{std::chrono::milliseconds(600)});
  EXPECT_EQ(messages[0],
            "all_reduce on group 'world' (seq 8): timed out after 0.6 s waiting for all_reduce on "
            "group 'world' (seq 0) to finish; missing ranks [1, 2]");
  EXPECT_EQ(messages[1],
            messages[0] + "; rank 1 issued it only after the others had given up on it");
  EXPECT_EQ(messages[2],
            messages[0] + "; rank 2 issued it only after the others had given up on it");
}

// Lane collectives are not queued behind the Op path: rank 0 issues an all_gather and eight
// small all_reduces on the world (none waited) and then waits on a small all_reduce of another
// group, which rank 1 issues first. Nothing here may wait for rank 1 to reach the world ones.
TEST(LaneTest, NotQueuedBehindOpPathCollectives) {
  run_ranks(2, [](ProcessGroup& pg) {
    auto g2 = pg.split_group({{0, 1}}, "g2");
    std::vector<std::shared_ptr<Work>> works;
    std::vector<Tensor> keep;
    auto world_part = [&] {
      keep.push_back(Tensor::full({4}, DType::F32, 1));
      keep.push_back(Tensor::zeros({8}, DType::F32));
      works.push_back(pg.all_gather(keep.back(), keep[keep.size() - 2]));
      for (int i = 1; i <= 8; ++i) {
        keep.push_back(Tensor::full({4}, DType::F32, i));
        works.push_back(pg.all_reduce(keep.back(), ReduceOp::Sum));
      }
    };
    auto g2_part = [&] {
      Tensor t = Tensor::full({4}, DType::F32, 1);
      g2->all_reduce(t, ReduceOp::Sum)->wait();
      EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 2));
    };
    if (pg.rank() == 0) {
      world_part();
      g2_part();
    } else {
      g2_part();
      world_part();
    }
    for (auto& w : works) w->wait();
    EXPECT_EQ(keep[1].to_vector<float>(), std::vector<float>(8, 1));
    EXPECT_EQ(keep.back().to_vector<float>(), std::vector<float>(4, 16));
  });
}

// A rank may run many small all_reduces ahead of its peer without waiting (more than the lane's
// slots: the extra ones wait for a slot); every result is right.
TEST(LaneTest, RankRunsFarAhead) {
  run_ranks(2, [](ProcessGroup& pg) {
    if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<Tensor> ts;
    std::vector<std::shared_ptr<Work>> works;
    for (int i = 0; i < 50; ++i) {
      ts.push_back(Tensor::full({5}, DType::I64, i * (pg.rank() + 1)));
      works.push_back(pg.all_reduce(ts.back(), ReduceOp::Sum));
    }
    for (int i = 0; i < 50; ++i) {
      works[i]->wait();
      EXPECT_EQ(ts[i].to_vector<int64_t>(), std::vector<int64_t>(5, 3 * i)) << i;
    }
  });
}

// A small in-place all_reduce is not queued behind the rank's earlier collectives, so it must
// wait for those that still read its buffer: here an all_gather of the same tensor that cannot
// run before rank 2 arrives, while the all_reduce's group {0, 1} could run at once.
TEST(LaneTest, WaitsForEarlierReadersOfItsBuffer) {
  run_ranks(3, [](ProcessGroup& world) {
    auto pair = world.split_group({{0, 1}, {2}}, "pair");
    Tensor t = Tensor::full({4}, DType::F32, world.rank() + 1);
    Tensor gathered = Tensor::zeros({12}, DType::F32);
    if (world.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto gather = world.all_gather(gathered, t);
    if (pair) pair->all_reduce(t, ReduceOp::Sum)->wait();
    gather->wait();
    EXPECT_EQ(gathered.to_vector<float>(),
              std::vector<float>({1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}));
    if (pair) {
      EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 3));
    }
  });
}

// A lane all_reduce over an input of an unfinished all_reduce_flat waits for it: the flat
// collective reads its inputs in place.
TEST(LaneTest, WaitsForAnAllReduceFlatReadingItsBuffer) {
  run_ranks(3, [](ProcessGroup& world) {
    auto pair = world.split_group({{0, 1}, {2}}, "pair");
    auto inputs = std::make_shared<std::vector<Tensor>>();
    inputs->push_back(Tensor::full({5}, DType::F32, 1));
    inputs->push_back(Tensor::full({4}, DType::F32, world.rank() + 1));
    const Tensor out = Tensor::zeros({9}, DType::F32);
    if (world.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto flat = world.all_reduce_flat(out, inputs, ReduceOp::Sum);
    if (pair) pair->all_reduce((*inputs)[1], ReduceOp::Sum)->wait();
    flat->wait();
    EXPECT_EQ(out.to_vector<float>(), std::vector<float>({3, 3, 3, 3, 3, 6, 6, 6, 6}));
    if (pair) {
      EXPECT_EQ((*inputs)[1].to_vector<float>(), std::vector<float>(4, 3));
    }
  });
}

// A streamed all_gather_flat stores each block of an input, loaded once, to every rank's output
// with streaming stores when the outputs are 32-byte aligned alike, and copies per output when
// they are not: outputs at byte offsets that agree, or differ, mod 32 (views of one-byte
// elements), inputs whose copies start and end mid-block, each exact.
TEST(OpPathTest, StreamedAllGatherFlatToOutputsAlignedAlikeOrNot) {
  ScopedEnv stream("FUNCOL_STREAM_MB", "0");
  const std::vector<int64_t> counts = {1000, 7, 300, 4096, 64, 0, 333};
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  for (const int n : {2, 3}) {
    for (const int64_t stride : {int64_t{32}, int64_t{64}, int64_t{1}, int64_t{13}}) {
      SCOPED_TRACE(fmt::format("{} ranks, output of rank r at byte {} * r", n, stride));
      run_ranks(n, [&](ProcessGroup& pg) {
        const int me = pg.rank();
        auto value = [](int r, size_t i, int64_t k) {
          return static_cast<int8_t>((31 * r + 7 * static_cast<int64_t>(i) + k) % 101);
        };
        auto list = std::make_shared<std::vector<Tensor>>();
        for (size_t i = 0; i < counts.size(); ++i) {
          std::vector<int8_t> v(static_cast<size_t>(counts[i]));
          for (int64_t k = 0; k < counts[i]; ++k) v[k] = value(me, i, k);
          list->push_back(Tensor::from_vector<int8_t>(v));
        }
        const Tensor buffer = Tensor::zeros({n * total + 64 * n}, DType::I8);
        const Tensor out = buffer.narrow(0, stride * me, n * total);
        pg.all_gather_flat(out, list)->wait();
        std::vector<int8_t> want;
        for (size_t i = 0; i < counts.size(); ++i) {
          for (int r = 0; r < n; ++r) {
            for (int64_t k = 0; k < counts[i]; ++k) want.push_back(value(r, i, k));
          }
        }
        ASSERT_EQ(out.to_vector<int8_t>(), want) << "rank " << me;
        // Nothing written around the output.
        const std::vector<int8_t> all = buffer.to_vector<int8_t>();
        for (int64_t b = 0; b < static_cast<int64_t>(all.size()); ++b) {
          if (b >= stride * me && b < stride * me + n * total) continue;
          ASSERT_EQ(all[b], 0) << "rank " << me << " byte " << b;
        }
      });
    }
  }
}

// Flat collectives share a layout with the previous one of the same shape on their group (a
// bucket runs with one layout every step): layouts that come back, change two counts keeping
// the total, change dtype or kind with the same counts, or are in flight together, each give
// exact results.
TEST(OpPathTest, FlatLayoutsSharedAcrossCallsStayExact) {
  constexpr int n = 3;
  // Rank r's element k of input i: distinct, exact in every dtype used.
  auto value = [](int r, size_t i, int64_t k) {
    return 100.0 * r + 7.0 * static_cast<double>(i) + static_cast<double>(k % 50);
  };
  struct Layout {
    int kind;  // 0 all_reduce_flat, 1 all_gather_flat, 2 reduce_scatter_flat
    DType dtype;
    std::vector<int64_t> counts;  // multiples of n for reduce_scatter_flat
  };
  const std::vector<int64_t> a = {6, 3000, 3, 96, 0, 30000};
  std::vector<int64_t> a_changed = a;  // the same total
  a_changed[1] = 2997;
  a_changed[3] = 99;
  const std::vector<Layout> steps = {
      {0, DType::F32, a},       {0, DType::F32, a}, {0, DType::F32, a_changed},
      {0, DType::F32, a},       {0, DType::I32, a}, {1, DType::F32, a},
      {2, DType::F32, a},       {2, DType::F32, a}, {0, DType::F64, {12, 6}},
      {2, DType::F32, a}};
  run_ranks(n, [&](ProcessGroup& pg) {
    const int me = pg.rank();
    // Each layout twice in flight at once, then waited.
    for (size_t s = 0; s < steps.size(); ++s) {
      const Layout& l = steps[s];
      std::vector<std::shared_ptr<Work>> works;
      std::vector<Tensor> outs;
      for (int copy = 0; copy < 2; ++copy) {
        auto list = std::make_shared<std::vector<Tensor>>();
        int64_t total = 0;
        for (size_t i = 0; i < l.counts.size(); ++i) {
          std::vector<double> v(static_cast<size_t>(l.counts[i]));
          for (int64_t k = 0; k < l.counts[i]; ++k) v[k] = value(me, i, k) + copy;
          list->push_back(Tensor::from_vector<double>(v).to(l.dtype));
          total += l.counts[i];
        }
        const int64_t out_count = l.kind == 0 ? total : l.kind == 1 ? total * n : total / n;
        outs.push_back(Tensor::empty({out_count}, l.dtype));
        works.push_back(l.kind == 0   ? pg.all_reduce_flat(outs.back(), list, ReduceOp::Sum)
                        : l.kind == 1 ? pg.all_gather_flat(outs.back(), list)
                                      : pg.reduce_scatter_flat(outs.back(), list, ReduceOp::Sum));
      }
      for (int copy = 0; copy < 2; ++copy) {
        works[copy]->wait();
        const std::vector<double> got = outs[copy].to(DType::F64).to_vector<double>();
        std::vector<double> want;
        for (size_t i = 0; i < l.counts.size(); ++i) {
          const int64_t c = l.counts[i];
          if (l.kind == 0) {
            for (int64_t k = 0; k < c; ++k) {
              double sum = 0;
              for (int r = 0; r < n; ++r) sum += value(r, i, k) + copy;
              want.push_back(sum);
            }
          } else if (l.kind == 1) {
            for (int r = 0; r < n; ++r) {
              for (int64_t k = 0; k < c; ++k) want.push_back(value(r, i, k) + copy);
            }
          } else {
            for (int64_t k = me * c / n; k < (me + 1) * c / n; ++k) {
              double sum = 0;
              for (int r = 0; r < n; ++r) sum += value(r, i, k) + copy;
              want.push_back(sum);
            }
          }
        }
        ASSERT_EQ(got, want) << "step " << s << " copy " << copy << " rank " << me;
      }
    }
  });
}

// A coalesced list's references are released by the time its waiter returns, whichever rank
// finished it (complete() leaves another rank's references to that rank's thread), and the
// input list of an all_reduce_flat is held once and let go: the caller holds the only
// references again. Results nobody waited for are freed by the end of the run.
TEST(OpPathTest, ReleasesCoalescedListsToTheirRank) {
  std::vector<std::weak_ptr<Storage>> dropped(2);
  run_ranks(2, [&](ProcessGroup& pg) {
    for (int i = 0; i < 20; ++i) {
      if (pg.rank() == i % 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      std::vector<Tensor> ins, outs;
      for (int k = 0; k < 5; ++k) {
        ins.push_back(Tensor::full({64}, DType::F32, pg.rank() + k));
        outs.push_back(Tensor::zeros({128}, DType::F32));
      }
      pg.all_gather_coalesced(outs, ins)->wait();
      for (int k = 0; k < 5; ++k) {
        EXPECT_EQ(ins[k].storage().use_count(), 1) << i << " " << k;
        EXPECT_EQ(outs[k].storage().use_count(), 1) << i << " " << k;
        EXPECT_EQ(outs[k].narrow(0, 63, 2).to_vector<float>(),
                  std::vector<float>({0.f + k, 1.f + k}));
      }
      auto list = std::make_shared<std::vector<Tensor>>(ins);
      const Tensor flat = Tensor::empty({320}, DType::F32);
      pg.all_reduce_flat(flat, list, ReduceOp::Sum)->wait();
      EXPECT_EQ(list.use_count(), 1) << i;
      EXPECT_EQ(flat.storage().use_count(), 1) << i;
      EXPECT_EQ(flat.narrow(0, 64 * 4, 1).to_vector<float>(), std::vector<float>({9})) << i;
    }
    std::vector<Tensor> ins, outs;
    for (int k = 0; k < 5; ++k) {
      ins.push_back(Tensor::full({64}, DType::F32, 1));
      outs.push_back(Tensor::zeros({128}, DType::F32));
    }
    dropped[pg.rank()] = outs[0].storage();
    // Neither waited for nor kept, and finished by rank 1 (it joins last): rank 0's references
    // are left to rank 0's thread, which never issues again (the end of its run, which waits
    // for what it issued, releases them).
    if (pg.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    pg.all_gather_coalesced(outs, ins);
  });
  for (const auto& d : dropped) EXPECT_TRUE(d.expired());
}

// The lane keeps a buffer alive only until someone sees its collective finished: after a wait
// (or an issue that finished it) the caller holds the only reference again, and a result that
// nobody waited for or kept is freed by the end of the run (no reference cycle through its
// storage's pending Work).
TEST(LaneTest, ReleasesBuffers) {
  std::vector<std::weak_ptr<Storage>> dropped(2);
  run_ranks(2, [&](ProcessGroup& pg) {
    for (int i = 0; i < 20; ++i) {
      Tensor t = Tensor::full({4}, DType::F32, 1);
      auto w = pg.all_reduce(t, ReduceOp::Sum);
      w->wait();
      EXPECT_EQ(t.storage().use_count(), 1) << i;
      EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 2));
    }
    Tensor t = Tensor::full({4}, DType::F32, 1);
    dropped[pg.rank()] = t.storage();
    pg.all_reduce(t, ReduceOp::Sum);  // neither waited for nor kept
  });
  for (const auto& d : dropped) EXPECT_TRUE(d.expired());

  // The same when the slot's next collective is a mismatch (rank 0 never posts there again).
  std::weak_ptr<Storage> before_mismatch;
  run_ranks(2, [&](ProcessGroup& pg) {
    if (pg.rank() == 0) {
      Tensor t = Tensor::full({4}, DType::F32, 1);
      before_mismatch = t.storage();
      pg.all_reduce(t, ReduceOp::Sum);  // dropped; rank 1 arrives later
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      Tensor t = Tensor::full({4}, DType::F32, 1);
      pg.all_reduce(t, ReduceOp::Sum)->wait();
    }
    for (int i = 1; i < 8; ++i) {
      Tensor t = Tensor::full({4}, DType::F32, 1);
      pg.all_reduce(t, ReduceOp::Sum)->wait();
    }
    Tensor t = Tensor::full({pg.rank() == 0 ? 1 << 14 : 4}, DType::F32, 1);
    comm_error([&] { pg.all_reduce(t, ReduceOp::Sum)->wait(); });
  });
  EXPECT_TRUE(before_mismatch.expired());
}

// The same off the lane, whichever rank completes the collective: after a wait the caller holds
// the only references to its buffers again, a result nobody waited for or kept is freed by the
// end of the run, and a result read after the run, its world gone, reads what was gathered.
TEST(OpPathTest, ReleasesBuffers) {
  std::vector<std::weak_ptr<Storage>> dropped(2);
  std::vector<Tensor> kept(2);
  run_ranks(2, [&](ProcessGroup& pg) {
    for (int i = 0; i < 20; ++i) {
      // Each rank arrives last in turn, so each sees the other complete some of them.
      if (pg.rank() == i % 2) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      Tensor in = Tensor::full({256}, DType::F32, pg.rank() + 1);
      Tensor out = Tensor::zeros({512}, DType::F32);
      pg.all_gather(out, in)->wait();
      EXPECT_EQ(in.storage().use_count(), 1) << i;
      EXPECT_EQ(out.storage().use_count(), 1) << i;
      EXPECT_EQ(out.narrow(0, 255, 2).to_vector<float>(), std::vector<float>({1, 2})) << i;
    }
    Tensor in = Tensor::full({256}, DType::F32, pg.rank() + 1);
    Tensor out = Tensor::zeros({512}, DType::F32);
    dropped[pg.rank()] = out.storage();
    pg.all_gather(out, in);  // neither waited for nor kept
    kept[pg.rank()] = Tensor::zeros({512}, DType::F32);
    pg.all_gather(kept[pg.rank()], in);  // kept, not waited for
  });
  for (const auto& d : dropped) EXPECT_TRUE(d.expired());
  for (const Tensor& t : kept) {
    EXPECT_EQ(t.narrow(0, 255, 2).to_vector<float>(), std::vector<float>({1, 2}));
  }
}

// A peer that departs while others wait in the lane fails them at once, with the departure.
TEST(LaneTest, DepartureWhileWaiting) {
  auto start = Clock::now();
  std::vector<std::string> messages(4);
  EXPECT_THROW(run_local(4,
                         [&](ProcessGroup& world) {
                           if (world.rank() == 3) {
                             std::this_thread::sleep_for(std::chrono::milliseconds(30));
                             throw std::runtime_error("gone");
                           }
                           Tensor t = Tensor::full({8}, DType::F64, 1);
                           messages[world.rank()] = comm_error(
                               [&] { world.all_reduce(t, ReduceOp::Max)->wait(); });
                         }),
               std::runtime_error);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(messages[r],
              "all_reduce on group 'world' (seq 0): rank 3 departed (threw: gone) before "
              "joining; missing ranks [3]");
  }
  EXPECT_LT(seconds_since(start), 1.0);  // within a second, not at the timeout
}

TEST(FailureTest, TimeoutWhenAPeerNeverArrives) {
  std::atomic<bool> timed_out{false};
  std::vector<std::string> messages(2);
  std::vector<double> waited(2);
  run_local(
      2,
      [&](ProcessGroup& world) {
        Tensor t = Tensor::full({4}, DType::F32, 1);
        if (world.rank() == 1) {
          await(timed_out);  // busy elsewhere until rank 0 gave up
        }
        auto start = Clock::now();
        auto w = world.all_reduce(t, ReduceOp::Sum);
        messages[world.rank()] = comm_error([&] { w->wait(); });
        waited[world.rank()] = seconds_since(start);
        if (world.rank() == 0) timed_out = true;
      },
      kShortTimeout);
  EXPECT_EQ(messages[0],
            "all_reduce on group 'world' (seq 0): timed out after 0.2 s; missing ranks [1]");
  // The late rank joins the failed collective, and is told that it came too late rather than
  // only that it is missing.
  EXPECT_EQ(messages[1],
            messages[0] + "; rank 1 issued it only after the others had given up on it");
  EXPECT_GE(waited[0], 0.19);
  EXPECT_LT(waited[0], 2.0);
  EXPECT_LT(waited[1], 0.1);
}

// A caller that polls a result (Tensor::is_ready) instead of waiting sees a collective that can
// never finish fail within the timeout, on the lane and on the Op path: polling alone used to
// leave it pending for good (only a waiter enforced the deadline).
TEST(FailureTest, PollingAResultSeesItsTimeout) {
  for (int64_t numel : {int64_t{4}, int64_t{1} << 16}) {
    SCOPED_TRACE(numel);
    std::atomic<bool> gave_up{false};
    double polled = -1;
    std::string message;
    run_local(
        2,
        [&](ProcessGroup& world) {
          Tensor t = Tensor::full({numel}, DType::F32, 1);
          if (world.rank() == 1) await(gave_up);  // busy elsewhere until rank 0 gave up
          auto w = world.all_reduce(t, ReduceOp::Sum);
          if (world.rank() == 1) {
            comm_error([&] { w->wait(); });
            return;
          }
          polled = poll_until_ready(t, std::chrono::seconds(5));
          message = comm_error([&] { w->wait(); });
          gave_up = true;
        },
        kShortTimeout);
    EXPECT_GE(polled, 0.19);
    EXPECT_LT(polled, 2.0);
    EXPECT_EQ(message,
              "all_reduce on group 'world' (seq 0): timed out after 0.2 s; missing ranks [1]");
  }
}

// A Work's description, asked for after run_local returned (its world and groups are gone),
// on the lane and the Op path and on a group of the user's: it read the freed group.
TEST(FailureTest, ADescriptionOutlivesTheWorld) {
  std::vector<std::shared_ptr<Work>> works(4);
  run_local(2, [&](ProcessGroup& world) {
    const int r = world.rank();
    auto pair = new_group(world, {0, 1}, "pair-7");
    for (int64_t numel : {int64_t{4}, int64_t{1} << 16}) {
      Tensor t = Tensor::full({numel}, DType::F32, 1);
      auto w = (numel == 4 ? world : *pair).all_reduce(t, ReduceOp::Sum);
      w->wait();
      if (r == 0) works[numel == 4 ? 0 : 1] = w;
    }
  });
  // (new_group's agreement ran collectives on the world first.)
  EXPECT_NE(works[0]->description().find("all_reduce on group 'world' (seq "), std::string::npos);
  EXPECT_EQ(works[1]->description(), "all_reduce on group 'pair-7' (seq 0)");
}

// Worlds whose groups get names of their own each time (a job or step id in the name) keep
// none of them once their Works are gone: every group name used to be kept for the life of the
// process, about 130 bytes each (and pages of per-thread heaps pinned by them).
TEST(FailureTest, FreshGroupNamesAreNotKept) {
#ifdef FUNCOL_SANITIZED
  GTEST_SKIP() << "the sanitizers' allocators keep mallinfo2 at 0, so the heap's growth cannot "
                  "be measured here";
#endif
  auto worlds = [](int first, int count) {
    for (int i = first; i < first + count; ++i) {
      run_local(2, [&](ProcessGroup& world) {
        auto g = new_group(world, {0, 1}, fmt::format("step-{:08d}", i));
        g->all_reduce(Tensor::full({4}, DType::F32, 1), ReduceOp::Sum)->wait();
        g->all_reduce(Tensor::full({1 << 16}, DType::F32, 1), ReduceOp::Sum)->wait();
      });
    }
  };
  auto in_use = [] { return static_cast<int64_t>(mallinfo2().uordblks); };
  worlds(0, 200);  // caches and tables fill up first
  const int64_t before = in_use();
  worlds(200, 2000);
  EXPECT_LT(in_use() - before, 2000 * 32);
}

// Of several departed ranks, a peer's error names one that threw (its reason is the likely
// cause), not the lowest one that returned.
TEST(FailureTest, ADepartureErrorNamesTheRankThatThrew) {
  std::string message;
  EXPECT_THROW(run_local(3,
                         [&](ProcessGroup& world) {
                           if (world.rank() == 2) throw std::runtime_error("the real cause");
                           if (world.rank() == 0) return;
                           std::this_thread::sleep_for(std::chrono::milliseconds(300));
                           message = comm_error([&] { world.barrier(); });
                         }),
               std::runtime_error);
  EXPECT_EQ(message,
            "barrier on group 'world' (seq 0): rank 2 departed (threw: the real cause) before "
            "joining; missing ranks [0, 2]");
}

// The same on the Op path (a collective too big for the lane) and for a rank named among
// several missing ones; ranks that are not named keep the error as it is.
TEST(FailureTest, ARankLateForATimedOutCollectiveIsToldSo) {
  std::atomic<bool> gave_up{false};
  std::vector<std::string> messages(3);
  run_local(
      3,
      [&](ProcessGroup& world) {
        Tensor t = Tensor::full({1 << 16}, DType::F32, 1);
        if (world.rank() >= 1) {
          await(gave_up);  // rank 0 gave up on them both
        }
        messages[world.rank()] =
            comm_error([&] { world.all_reduce(t, ReduceOp::Sum)->wait(); });
        if (world.rank() == 0) gave_up = true;
      },
      kShortTimeout);
  const std::string base =
      "all_reduce on group 'world' (seq 0): timed out after 0.2 s; missing ranks [1, 2]";
  EXPECT_EQ(messages[0], base);
  EXPECT_EQ(messages[1], base + "; rank 1 issued it only after the others had given up on it");
  EXPECT_EQ(messages[2], base + "; rank 2 issued it only after the others had given up on it");
}

// Ranks that each wait for a collective the other has not issued (rank 1 on the world, rank 0,
// a little later, on a subgroup of both): a deadlock. Before the timeout each prints a warning
// (FUNCOL_STALL_WARNING seconds into its wait) naming what the missing rank waits for, and the
// first timeout says the same, so the cycle shows. On the lane and on the Op path.
TEST(FailureTest, CrossedWaitsNameWhatTheMissingRankWaitsFor) {
  for (const int64_t numel : {int64_t{4}, int64_t{1} << 16}) {
    ScopedEnv warn_after("FUNCOL_STALL_WARNING", "0.2");
    std::vector<std::string> messages(2);
    ::testing::internal::CaptureStderr();
    run_local(
        2,
        [&](ProcessGroup& world) {
          auto pair = new_group(world, {0, 1}, "pair");  // agreed over world's seq 0-1
          Tensor t = Tensor::full({numel}, DType::F32, 1);
          if (world.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
          ProcessGroup& group = world.rank() == 0 ? *pair : world;
          messages[world.rank()] = comm_error([&] { group.all_reduce(t, ReduceOp::Sum)->wait(); });
        },
        LocalOptions{std::chrono::milliseconds(1500)});
    const std::string warnings = ::testing::internal::GetCapturedStderr();
    const std::string rank0 =
        "missing ranks [0] (rank 0's last collective, all_reduce on group 'pair' (seq 0), is "
        "itself missing ranks [1])";
    const std::string rank1 =
        "missing ranks [1] (rank 1's last collective, all_reduce on group 'world' (seq 2), is "
        "itself missing ranks [0])";
    EXPECT_EQ(messages[1], "all_reduce on group 'world' (seq 2): timed out after 1.5 s; " + rank0)
        << numel;
    EXPECT_NE(messages[0].find("all_reduce on group 'pair' (seq 0)"), std::string::npos);
    for (const std::string& line : std::vector<std::string>{
             "funcol: warning: all_reduce on group 'world' (seq 2) has waited ",
          "funcol: warning: all_reduce on group 'pair' (seq 0) has waited ", rank0, rank1,
          "a deadlock unless a rank issues what another waits for; it fails when its timeout "
          "(1.5 s) runs out\n"}) {
      EXPECT_NE(warnings.find(line), std::string::npos) << numel << ": " << line << "\n"
                                                        << warnings;
    }
  }
}

// A rank that runs 9 small all_reduces ahead waits in the 9th issuing call for its peer, which
// first waits on another group for this rank: a stall. The blocked call warns (naming the
// earlier collective it waits for and what its missing rank waits for) and so does the peer's
// wait (naming where this rank is blocked); both fail at the timeout, and the rest completes.
TEST(FailureTest, AStallBehindNineSmallAllReducesIsWarnedOnBothSides) {
  ScopedEnv warn_after("FUNCOL_STALL_WARNING", "0.2");
  std::vector<std::string> messages(2);
  // Seq 2-9: seq 2 timed out when the 9th issue gave up; rank 1 issued the others only after
  // the stall, past their deadlines.
  std::vector<std::vector<std::string>> first(2, std::vector<std::string>(8));
  ::testing::internal::CaptureStderr();
  run_local(
      2,
      [&](ProcessGroup& world) {
        auto pair = new_group(world, {0, 1}, "pair");  // agreed over world's seq 0-1
        std::vector<Tensor> ts;
        std::vector<std::shared_ptr<Work>> works;
        auto run_ahead = [&] {
          for (int i = 0; i < 9; ++i) {
            ts.push_back(Tensor::full({4}, DType::F32, i));
            works.push_back(world.all_reduce(ts.back(), ReduceOp::Sum));
          }
        };
        Tensor p = Tensor::full({4}, DType::F32, 1);
        Tensor q = Tensor::full({4}, DType::F32, 1);
        if (world.rank() == 0) {
          run_ahead();
          pair->all_reduce(p, ReduceOp::Sum)->wait();
          // Rank 0's 9th issue gave up at seq 2's deadline (failing seq 2), so waiting for seq 3
          // before rank 1 issued it would time out at once: wait until rank 1 has run ahead too.
          pair->all_reduce(q, ReduceOp::Sum)->wait();
        } else {
          // Later than rank 0's 9th issue, so that this wait's timeout comes after rank 0 gave
          // up (the timeout runs from the first issue) even on a slow (sanitized) build.
          std::this_thread::sleep_for(std::chrono::milliseconds(400));
          pair->all_reduce(p, ReduceOp::Sum)->wait();
          // Rank 0 came to the pair when seq 2 timed out: a margin makes seq 3-9, which rank 0
          // issued with seq 2, clearly late too (by a tick they would count as in time).
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          run_ahead();
          pair->all_reduce(q, ReduceOp::Sum)->wait();
        }
        EXPECT_EQ(p.to_vector<float>(), std::vector<float>(4, 2.0f));
        EXPECT_EQ(q.to_vector<float>(), std::vector<float>(4, 2.0f));
        for (int i = 0; i < 8; ++i) first[world.rank()][i] = comm_error([&] { works[i]->wait(); });
        messages[world.rank()] = comm_error([&] { works[8]->wait(); });
      },
      LocalOptions{std::chrono::milliseconds(1000)});
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  const std::string blocked =
      "all_reduce on group 'world' (seq 10), which waits in the issuing call for all_reduce on "
      "group 'world' (seq 2) to finish (a rank runs at most 8 small all_reduces ahead of its "
      "peers on a group)";
  for (const std::string& line : std::vector<std::string>{
           "funcol: warning: " + blocked + ", has waited ",
           "; missing ranks [1] (rank 1's last collective, all_reduce on group 'pair' (seq 0), "
           "is itself missing ranks [0])",
           "funcol: warning: all_reduce on group 'pair' (seq 0) has waited ",
           "; missing ranks [0] (rank 0's last collective, " + blocked +
               ", is itself missing ranks [1])"}) {
    EXPECT_NE(warnings.find(line), std::string::npos) << line << "\n" << warnings;
  }
  const std::string whereabouts =
      "missing ranks [1] (rank 1's last collective, all_reduce on group 'pair' (seq 0), is "
      "itself missing ranks [0])";
  const std::string late = "; rank 1 issued it only after the others had given up on it";
  EXPECT_EQ(first[0][0], "all_reduce on group 'world' (seq 2): timed out after 1 s; " + whereabouts);
  for (int i = 1; i < 8; ++i) {
    EXPECT_EQ(first[0][i], fmt::format("all_reduce on group 'world' (seq {}): timed out after 1 s; "
                                       "missing ranks [1]",
                                       i + 2));
  }
  for (int i = 0; i < 8; ++i) EXPECT_EQ(first[1][i], first[0][i] + late);
  EXPECT_EQ(messages[0],
            "all_reduce on group 'world' (seq 10): timed out after 1 s waiting for all_reduce on "
            "group 'world' (seq 2) to finish; " + whereabouts);
  EXPECT_EQ(messages[1], messages[0] + late);
}

// A collective that nobody waits for still times out: ranks 1 and 2 issue it more than the
// timeout after rank 0, which waits only once they have. Every rank gets the timeout, and the
// late ones are told they came late, on the lane and on the Op path; the group works on. Issued
// within the timeout, it completes.
TEST(FailureTest, AnUnwaitedCollectiveTimesOutForItsLateMembers) {
  for (const int late_ms : {0, 450}) {
    for (const int64_t numel : {int64_t{4}, int64_t{1} << 16}) {
      SCOPED_TRACE(::testing::Message() << numel << " elements, " << late_ms << " ms late");
      std::vector<std::string> messages(3);
      std::atomic<int> issued{0};
      run_local(
          3,
          [&](ProcessGroup& world) {
            const int r = world.rank();
            Tensor t = Tensor::full({numel}, DType::I32, r + 1);
            // Late from rank 0's issue on, not from the start: a rank 0 that a loaded machine
            // (TSan beside another test) held back 150 ms before its issue made them timely.
            if (r > 0) {
              while (issued.load() == 0) std::this_thread::yield();
              std::this_thread::sleep_for(std::chrono::milliseconds(late_ms));
            }
            auto work = world.all_reduce(t, ReduceOp::Sum);
            issued.fetch_add(1);
            while (issued.load() < 3) std::this_thread::yield();
            messages[r] = error_of([&] { work->wait(); });
            if (messages[r].empty()) {
              EXPECT_EQ(t.to_vector<int>(), std::vector<int>(numel, 6));
            }
            Tensor u = Tensor::full({numel}, DType::I32, r);
            world.all_reduce(u, ReduceOp::Sum)->wait();
            EXPECT_EQ(u.to_vector<int>(), std::vector<int>(numel, 3));
          },
          LocalOptions{std::chrono::milliseconds(300)});
      if (late_ms == 0) {
        EXPECT_EQ(messages, std::vector<std::string>(3));
        continue;
      }
      EXPECT_EQ(messages[0],
                "all_reduce on group 'world' (seq 0): timed out after 0.3 s; missing ranks [1, 2]");
      for (int r : {1, 2}) {
        EXPECT_EQ(messages[r], fmt::format("{}; rank {} issued it only after the others had "
                                           "given up on it",
                                           messages[0], r));
      }
    }
  }
}

// A peer that issues just inside the timeout is not late. Timeouts of 1 s and more take their
// deadlines from Linux's coarse clock, which lags: comparing two such readings called a peer
// late up to a tick inside the timeout. Rank 1 issues 2 ms before rank 0's issue plus the
// timeout (a run where rank 1's call ended past that point checks nothing: it may be late), on
// the lane (a small all_reduce) and on the Op path (a small all_gather: its call is short too).
// Up to 16 tries for 2 checked runs: on a loaded machine (a sanitizer build beside other work)
// 4 tries once gave no run whose call ended in time.
TEST(FailureTest, APeerJustInsideTheTimeoutIsNotLate) {
  for (const bool lane : {true, false}) {
    SCOPED_TRACE(lane ? "lane" : "Op path");
    int checked = 0;
    for (int iter = 0; iter < 16 && checked < 2; ++iter) {
      std::atomic<Clock::rep> start{0};  // rank 0's issue, on steady_clock
      std::vector<std::string> messages(2);
      bool in_time = false;
      run_local(
          2,
          [&](ProcessGroup& world) {
            const int r = world.rank();
            Tensor t = Tensor::full({4}, DType::I32, r + 1);
            Tensor gathered = Tensor::empty({8}, DType::I32);
            auto issue = [&] {
              return lane ? world.all_reduce(t, ReduceOp::Sum) : world.all_gather(gathered, t);
            };
            std::shared_ptr<Work> work;
            if (r == 0) {
              const Clock::time_point now = Clock::now();
              work = issue();
              start.store(now.time_since_epoch().count());
            } else {
              while (start.load() == 0) std::this_thread::yield();
              const Clock::time_point due = Clock::time_point(Clock::duration(start.load())) +
                                            std::chrono::milliseconds(998);
              while (Clock::now() < due) {
              }
              work = issue();
              in_time = Clock::now() < due + std::chrono::milliseconds(2);
            }
            messages[r] = error_of([&] { work->wait(); });
          },
          LocalOptions{std::chrono::milliseconds(1000)});
      if (!in_time) continue;
      ++checked;
      EXPECT_EQ(messages, std::vector<std::string>(2)) << iter;
    }
    EXPECT_GT(checked, 0);
  }
}

// A collective times out its timeout after the first rank issued it, on the lane as on the Op
// path: rank 1 issues and does not wait, rank 0 issues 0.6 s later and waits, rank 2 comes
// after 1.2 s. With a 1 s timeout rank 0's wait fails at about 1 s, not at 1.6 s (its own
// issue plus the timeout), before rank 2 came; rank 2 is told it came late.
TEST(FailureTest, TheTimeoutRunsFromTheFirstIssue) {
  for (const int64_t numel : {int64_t{4}, int64_t{1} << 16}) {
    SCOPED_TRACE(numel);
    std::vector<std::string> messages(3);
    std::vector<double> failed_at(3);
    const auto start = Clock::now();
    run_local(
        3,
        [&](ProcessGroup& world) {
          const int r = world.rank();
          if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(600));
          if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
          Tensor t = Tensor::full({numel}, DType::F32, 1);
          auto work = world.all_reduce(t, ReduceOp::Sum);
          if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1300));
          messages[r] = comm_error([&] { work->wait(); });
          failed_at[r] = seconds_since(start);
        },
        LocalOptions{std::chrono::milliseconds(1000)});
    const std::string base =
        "all_reduce on group 'world' (seq 0): timed out after 1 s; missing ranks [2]";
    EXPECT_EQ(messages[0], base);
    EXPECT_EQ(messages[1], base);
    EXPECT_EQ(messages[2], base + "; rank 2 issued it only after the others had given up on it");
    EXPECT_LT(failed_at[0], 1.2);
  }
}

// A rank busy elsewhere (its last collective done) is no deadlock: no warning.
TEST(FailureTest, NoStallWarningForARankBusyElsewhere) {
  ScopedEnv warn_after("FUNCOL_STALL_WARNING", "0.1");
  ::testing::internal::CaptureStderr();
  run_local(2, [&](ProcessGroup& world) {
    if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    Tensor t = Tensor::full({4}, DType::F32, 1);
    world.all_reduce(t, ReduceOp::Sum)->wait();
    EXPECT_EQ(t.to_vector<float>(), std::vector<float>(4, 2.0f));
  });
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST(FailureTest, TimeoutFromEnvironment) {
  setenv("FUNCOL_TIMEOUT", "0.1", 1);
  std::string message;
  std::atomic<bool> gave_up{false};
  run_local(2, [&](ProcessGroup& world) {
    if (world.rank() == 1) {
      await(gave_up);
      return;
    }
    message = comm_error([&] { world.barrier(); });
    gave_up = true;
  });
  unsetenv("FUNCOL_TIMEOUT");
  EXPECT_EQ(message, "barrier on group 'world' (seq 0): timed out after 0.1 s; missing ranks [1]");
}

TEST(FailureTest, RethrowsTheFirstFailureAfterEveryRankFinished) {
  std::atomic<int> finished{0};
  try {
    run_local(4, [&](ProcessGroup& world) {
      struct Count {
        std::atomic<int>& n;
        ~Count() { n.fetch_add(1); }
      } count{finished};
      if (world.rank() == 2) throw std::runtime_error("first");
      // Fails because rank 2 departed; only then do the others throw their own errors.
      comm_error([&] { world.barrier(); });
      throw std::runtime_error("later " + std::to_string(world.rank()));
    });
    ADD_FAILURE() << "no rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "first");
  }
  EXPECT_EQ(finished.load(), 4);
}

// Every rank gets the same error at once, as on mpi and gloo: the ranks agree on the lists
// (and the name) over the parent before any group is built.
TEST(FailureTest, SplitGroupMismatchFailsEveryRank) {
  std::vector<std::string> errors(3);
  run_ranks(3, [&](ProcessGroup& world) {
    std::vector<std::vector<int>> lists = {{0, 1}, {2}};
    if (world.rank() == 1) lists = {{0, 2}, {1}};
    try {
      world.split_group(lists, "pairs");
    } catch (const CommError& e) {
      errors[world.rank()] = e.what();
    }
  });
  EXPECT_EQ(errors[0],
            "split_group on group 'world' (split 0): rank 0 passed [[0, 1], [2]] as 'pairs' but "
            "rank 1 passed [[0, 2], [1]] as 'pairs'");
  EXPECT_EQ(errors[1], errors[0]);
  EXPECT_EQ(errors[2], errors[0]);
}

TEST(FailureTest, SplitGroupNameMismatchFailsEveryRank) {
  std::atomic<int> errors{0};
  run_ranks(2, [&](ProcessGroup& world) {
    try {
      world.split_group({{0}, {1}}, world.rank() == 0 ? "solo" : "single");
    } catch (const CommError& e) {
      errors.fetch_add(1);
      EXPECT_NE(std::string(e.what()).find("passed [[0], [1]] as 'solo' but rank 1 passed "
                                           "[[0], [1]] as 'single'"),
                std::string::npos)
          << e.what();
    }
  });
  EXPECT_EQ(errors.load(), 2);
}

// A rank may create groups from two threads at once when each thread splits its own parent
// (a parent's collectives stay on one thread; here each parent holds one rank, so the threads
// need no collective that a peer's other thread could order differently). Both threads
// register their groups, and take fresh names, in the rank's one registry: that raced (the
// tsan build runs this test).
TEST(SplitGroupTest, TwoThreadsOfOneRankCreateGroupsAtOnce) {
  constexpr int kGroups = 50;
  run_ranks(2, [](ProcessGroup& world) {
    const std::shared_ptr<ProcessGroup> parents[2] = {world.split_group({{0}, {1}}, "left"),
                                                      world.split_group({{0}, {1}}, "right")};
    std::vector<std::string> fresh[2];
    std::string errors[2];
    auto create = [&](int side) {
      try {
        for (int k = 0; k < kGroups; ++k) {
          const std::string name = parents[side]->name() + std::to_string(k);
          const std::vector<int> me = {world.rank()};
          std::shared_ptr<ProcessGroup> g = parents[side]->split_group({me}, name);
          if (world.registry().find(name) != g) errors[side] += name + " not registered; ";
          fresh[side].push_back(world.registry().next_group_name());
        }
      } catch (const std::exception& e) {
        errors[side] += e.what();
      }
    };
    std::thread right(create, 1);
    create(0);
    right.join();
    EXPECT_EQ(errors[0], "");
    EXPECT_EQ(errors[1], "");
    EXPECT_EQ(world.registry().names().size(), 3u + 2 * kGroups);
    std::vector<std::string> names = fresh[0];
    names.insert(names.end(), fresh[1].begin(), fresh[1].end());
    std::sort(names.begin(), names.end());
    EXPECT_EQ(std::unique(names.begin(), names.end()), names.end()) << "a fresh name twice";
    EXPECT_EQ(names.size(), 2u * kGroups);
  }, LocalOptions{std::chrono::seconds(20)});
}

}  // namespace
}  // namespace funcol
