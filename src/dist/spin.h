// Spin-then-yield backoff shared by Work::wait and the threads backend's waiters.
#pragma once

#include <chrono>
#include <thread>

namespace funcol::dist_detail {

// One pause instruction: tells the core we are spinning (frees the sibling hyper-thread).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
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
  explicit Backoff(std::chrono::nanoseconds spin = kSpin)
      : start_(std::chrono::steady_clock::now()), spin_(spin) {}
  void reset() {
    start_ = std::chrono::steady_clock::now();
    iterations_ = 0;
    phase_ = 0;
  }
  // One backoff step; returns false once the caller should sleep instead.
  bool step() {
    ++iterations_;
    // Read the clock only every 32 spins: now() costs ~20 ns.
    if (phase_ == 0) {
      if (spin_.count() > 0 &&
          ((iterations_ & 31) != 0 || std::chrono::steady_clock::now() - start_ < spin_)) {
        cpu_relax();
        return true;
      }
      phase_ = 1;
    }
    if (phase_ == 1) {
      if (std::chrono::steady_clock::now() - start_ < spin_ + kYield) {
        std::this_thread::yield();
        return true;
      }
      phase_ = 2;
    }
    return false;
  }

 private:
  std::chrono::steady_clock::time_point start_;
  std::chrono::nanoseconds spin_;
  unsigned iterations_ = 0;
  int phase_ = 0;
};

}  // namespace funcol::dist_detail
