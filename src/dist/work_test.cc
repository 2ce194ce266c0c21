// Tests of Work: finish/fail exactly once, waiting from many threads, default_timeout parsing.
#include "funcol/dist/work.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

#include "funcol/core/error.h"
#include "spin.h"

namespace funcol {
namespace {

TEST(WorkTest, CompletedIsDoneWithoutError) {
  auto w = Work::completed("nothing");
  EXPECT_TRUE(w->is_completed());
  EXPECT_FALSE(w->failed());
  EXPECT_EQ(w->exception(), nullptr);
  EXPECT_EQ(w->description(), "nothing");
  w->wait();
  w->wait();  // waiting twice costs nothing
}

TEST(WorkTest, FinishWakesEveryWaiter) {
  Work w("all_reduce on group 'world' (seq 0)");
  EXPECT_FALSE(w.is_completed());
  std::atomic<int> woke{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 4; ++i) {
    waiters.emplace_back([&] {
      w.wait();
      woke.fetch_add(1);
    });
  }
  // Waiters spin, yield, then sleep: finishing must wake the sleepers too.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(woke.load(), 0);
  w.finish();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(woke.load(), 4);
  EXPECT_TRUE(w.is_completed());
}

// A subclass's view of the sleeping helpers the threads backend's waiters use.
class SleepyWork : public Work {
 public:
  using Work::sleep_until;
  using Work::wake_waiters;
};

TEST(WorkTest, SleepUntilReturnsOnWakeDeadlineOrFinish) {
  using Clock = std::chrono::steady_clock;
  SleepyWork w;
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    EXPECT_FALSE(w.sleep_until(Clock::now() + std::chrono::seconds(20)));  // woken, not done
    woke = true;
  });
  while (!woke) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    w.wake_waiters();
  }
  sleeper.join();
  EXPECT_TRUE(w.failure_seen(0));  // a sleeping waiter rethrows a failure: seen from then
  auto t0 = Clock::now();
  EXPECT_FALSE(w.sleep_until(t0 + std::chrono::milliseconds(30)));  // the deadline
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(30));
  std::thread finisher([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    w.finish();
  });
  EXPECT_TRUE(w.sleep_until(Clock::now() + std::chrono::seconds(20)));
  finisher.join();
  EXPECT_TRUE(w.sleep_until(Clock::now()));  // done: at once
}

// Collective deadlines: exact for short timeouts; for long ones (the coarse clock) within a
// few ticks, and late rather than early while the kernel's coarse clock keeps up.
TEST(WorkTest, DeadlineAfterIsCloseToNowPlusTimeout) {
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < 1000; ++i) {
    const auto timeout = std::chrono::milliseconds(250);
    const auto before = Clock::now();
    const auto deadline = dist_detail::deadline_after(timeout);
    const auto after = Clock::now();
    ASSERT_GE(deadline, before + timeout);
    ASSERT_LE(deadline, after + timeout);
  }
  for (int i = 0; i < 1000; ++i) {
    const auto timeout = std::chrono::seconds(300);
    const auto before = Clock::now();
    const auto deadline = dist_detail::deadline_after(timeout);
    const auto after = Clock::now();
    // Ticks are 1-10 ms; a late tick on a busy host may add one or two more.
    ASSERT_GE(deadline, before + timeout - std::chrono::milliseconds(30));
    ASSERT_LE(deadline, after + timeout + std::chrono::milliseconds(50));
  }
}

TEST(WorkTest, FailRethrowsInEveryWaiter) {
  Work w("x");
  std::atomic<int> caught{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&] {
      try {
        w.wait();
      } catch (const CommError& e) {
        if (std::string(e.what()) == "peer died") caught.fetch_add(1);
      }
    });
  }
  w.fail(std::make_exception_ptr(CommError("peer died")));
  for (auto& t : waiters) t.join();
  EXPECT_EQ(caught.load(), 3);
  EXPECT_TRUE(w.failed());
  EXPECT_NE(w.exception(), nullptr);
  EXPECT_THROW(w.wait(), CommError);
}

// A thread asleep in wait() rethrows the failure once it wakes: the failure counts as seen as
// soon as it sleeps, so a rank that ends meanwhile (destroy_process_group on another thread)
// does not warn of it as never seen. It used to count only once the thread woke.
TEST(WorkTest, AWaiterAsleepCountsTheFailureSeen) {
  Work w("asleep");
  std::thread waiter([&] { EXPECT_THROW(w.wait(), CommError); });
  bool seen = false;
  for (int i = 0; i < 500 && !seen; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = w.failure_seen(0);
  }
  EXPECT_TRUE(seen) << "the waiter never counted as seeing the failure";
  w.fail(std::make_exception_ptr(CommError("peer died")));
  EXPECT_TRUE(w.failure_seen(0));
  waiter.join();
  // Nobody waits: unseen until a wait throws it.
  Work alone("alone");
  alone.fail(std::make_exception_ptr(CommError("peer died")));
  EXPECT_FALSE(alone.failure_seen(0));
  EXPECT_THROW(alone.wait(), CommError);
  EXPECT_TRUE(alone.failure_seen(0));
}

TEST(WorkTest, FinishingTwiceIsABug) {
  Work w("twice");
  w.finish();
  EXPECT_THROW(w.finish(), InternalError);
  EXPECT_THROW(w.fail(std::make_exception_ptr(CommError("late"))), InternalError);
  EXPECT_FALSE(w.failed());
}

TEST(WorkTest, AttachedToStorageMakesItPending) {
  auto storage = std::make_shared<Storage>(16);
  auto w = std::make_shared<Work>("pending");
  storage->add_pending(w);
  EXPECT_FALSE(storage->is_ready());
  std::thread finisher([&] { w->finish(); });
  storage->wait();
  finisher.join();
  EXPECT_TRUE(storage->is_ready());
}

// default_timeout reads FUNCOL_TIMEOUT on each call (these tests run single-threaded).
class DefaultTimeoutTest : public ::testing::Test {
 protected:
  void TearDown() override { unsetenv("FUNCOL_TIMEOUT"); }
};

TEST_F(DefaultTimeoutTest, DefaultIs300Seconds) {
  unsetenv("FUNCOL_TIMEOUT");
  EXPECT_EQ(default_timeout(), std::chrono::milliseconds(300'000));
}

TEST_F(DefaultTimeoutTest, ReadsFractionalSeconds) {
  setenv("FUNCOL_TIMEOUT", "0.25", 1);
  EXPECT_EQ(default_timeout(), std::chrono::milliseconds(250));
  setenv("FUNCOL_TIMEOUT", "12", 1);
  EXPECT_EQ(default_timeout(), std::chrono::milliseconds(12'000));
  setenv("FUNCOL_TIMEOUT", "0.0001", 1);  // rounds up to the 1 ms minimum
  EXPECT_EQ(default_timeout(), std::chrono::milliseconds(1));
  setenv("FUNCOL_TIMEOUT", " +2.5\t", 1);  // blanks around it and a '+', as strtod takes them
  EXPECT_EQ(default_timeout(), std::chrono::milliseconds(2500));
}

// A huge requested timeout ("never", milliseconds::max()) is capped so that now + timeout does
// not overflow (it made every collective time out at once); zero means the default.
TEST_F(DefaultTimeoutTest, EffectiveTimeoutCapsHugeValues) {
  unsetenv("FUNCOL_TIMEOUT");
  EXPECT_EQ(effective_timeout(std::chrono::milliseconds(0)), std::chrono::milliseconds(300'000));
  EXPECT_EQ(effective_timeout(std::chrono::milliseconds(1500)), std::chrono::milliseconds(1500));
  const auto cap = effective_timeout(std::chrono::milliseconds::max());
  EXPECT_EQ(cap, std::chrono::milliseconds(int64_t{1'000'000'000'000}));
  EXPECT_GT(std::chrono::steady_clock::now() + cap, std::chrono::steady_clock::now());
}

// FUNCOL_TIMEOUT's error for `value`, or "" (a failure) when it was accepted.
std::string timeout_refusal(const char* value) {
  setenv("FUNCOL_TIMEOUT", value, 1);
  try {
    default_timeout();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted FUNCOL_TIMEOUT=" << value;
  return "";
}

TEST_F(DefaultTimeoutTest, RejectsGarbage) {
  // Decimal only: strtod read "0x10" as 16 s.
  for (const char* bad : {"abc", "-1", "0", "5s", "nan", "inf", "0x10", "1e400", "+", "++1", "+-1", " "}) {
    const std::string error = timeout_refusal(bad);
    EXPECT_NE(error.find(bad), std::string::npos) << error;
  }
  // A number past a double's range says so (1e400 is a positive number of seconds).
  for (const char* huge : {"1e400", "1e-400"}) {
    const std::string error = timeout_refusal(huge);
    EXPECT_NE(error.find(std::string("FUNCOL_TIMEOUT=") + huge +
                         ": out of range; expected a positive number of seconds"),
              std::string::npos)
        << error;
  }
}

}  // namespace
}  // namespace funcol
