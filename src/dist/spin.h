// Spin-then-yield backoff shared by Work::wait and the threads backend's waiters.
#pragma once

#include <chrono>
#include <thread>
#if defined(__linux__)
#include <time.h>
#endif

namespace funcol::dist_detail {

// One pause instruction: tells the core we are spinning (frees the sibling hyper-thread).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
// The resolution of Linux's coarse monotonic clock (4 ms at 250 Hz).
inline std::chrono::nanoseconds coarse_tick() {
  static const std::chrono::nanoseconds tick = [] {
    timespec res{};
    clock_getres(CLOCK_MONOTONIC_COARSE, &res);
    return std::chrono::seconds(res.tv_sec) + std::chrono::nanoseconds(res.tv_nsec);
  }();
  return tick;
}
#endif

// now + timeout on steady_clock, for a deadline taken at every collective's issue. Long
// timeouts (1 s and more: the default is 300 s) read Linux's coarse monotonic clock, which
// costs a third of steady_clock::now() (10 vs 32 ns on the 2-core CI machine, where small
// collectives take 0.5-1 us) and shares its epoch but lags it: by up to 1.4 ticks measured
// here (5.6 ms at 4 ms ticks), more when ticks are missed. Two ticks are added
// (deadline_slack), so such a deadline is a few ms late rather than early, which is nothing
// next to the timeout. Short timeouts (tests of failure paths) read steady_clock: exact.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::nanoseconds timeout) {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
  timespec now{};
  if (timeout >= std::chrono::seconds(1) && clock_gettime(CLOCK_MONOTONIC_COARSE, &now) == 0) {
    return std::chrono::steady_clock::time_point(std::chrono::seconds(now.tv_sec) +
                                                 std::chrono::nanoseconds(now.tv_nsec) +
                                                 2 * coarse_tick() + timeout);
  }
#endif
  return std::chrono::steady_clock::now() + timeout;
}

// What deadline_after(timeout) adds to the coarse clock's reading beyond `timeout` (0 where it
// reads steady_clock). Two such deadlines taken at times a <= b differ by more than
// timeout + slack only if b is past a's deadline: the coarse clock never runs ahead.
inline std::chrono::nanoseconds deadline_slack(std::chrono::nanoseconds timeout) {
#if defined(__linux__) && defined(CLOCK_MONOTONIC_COARSE)
  if (timeout >= std::chrono::seconds(1)) return 2 * coarse_tick();
#endif
  return std::chrono::nanoseconds(0);
}

// Polls until `done()` holds: a pause between polls and a yield every `yield_every`, so that
// two threads sharing one core still make progress. Unbounded, so only for benchmarks that time
// handoffs between threads; waiters use Backoff and then sleep.
template <typename Done>
void poll_until(Done done, unsigned yield_every) {
  for (unsigned polls = 1; !done(); ++polls) {
    if (polls % yield_every == 0) {
      std::this_thread::yield();
    } else {
      cpu_relax();
    }
  }
}

// Backoff for a waiter: spin for kSpin (a handoff between two running cores takes well under
// a microsecond, so a few µs of spinning catches it without a syscall), then yield the core for
// kYield (lets an oversubscribed peer, e.g. 4 ranks on 2 cores, run and arrive), then tell the
// caller to sleep. Never spins unboundedly: the caller sleeps on a condvar afterwards.
class Backoff {
 public:
  static constexpr std::chrono::nanoseconds kSpin{4000};
  static constexpr std::chrono::nanoseconds kYield{50000};

  // `spin`: how long to spin before yielding; 0 where the waiter's spinning would take a core
  // from a peer that still has to arrive (more ranks than cores).
  explicit Backoff(std::chrono::nanoseconds spin = kSpin) : spin_(spin) {}
  void reset() {
    iterations_ = 0;
    phase_ = 0;
    started_ = false;
  }
  // True while in the spinning phase (before the first yield).
  bool spinning() const { return phase_ == 0 && spin_.count() > 0; }
  // One backoff step; returns false once the caller should sleep instead.
  bool step() {
    ++iterations_;
    // Read the clock only every 32 spins (now() costs ~20 ns), and not at all for a wait that
    // ends within the first 32: the budget starts at the first reading.
    if (phase_ == 0) {
      if (spin_.count() > 0 && ((iterations_ & 31) != 0 || elapsed() < spin_)) {
        cpu_relax();
        return true;
      }
      phase_ = 1;
    }
    if (phase_ == 1) {
      if (elapsed() < spin_ + kYield) {
        std::this_thread::yield();
        return true;
      }
      phase_ = 2;
    }
    return false;
  }

 private:
  // Time since the first call (zero on the first call).
  std::chrono::nanoseconds elapsed() {
    auto now = std::chrono::steady_clock::now();
    if (!started_) {
      start_ = now;
      started_ = true;
    }
    return now - start_;
  }

  std::chrono::steady_clock::time_point start_;
  std::chrono::nanoseconds spin_;
  unsigned iterations_ = 0;
  int phase_ = 0;
  bool started_ = false;
};

}  // namespace funcol::dist_detail
