// Work: the handle of one asynchronous collective; failures travel to wait() as exceptions.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>

#include "funcol/core/tensor.h"

namespace funcol {

// Default collective timeout: 300 s, as torch.distributed's default for non-NCCL backends.
// FUNCOL_TIMEOUT (seconds, may be fractional) overrides it.
std::chrono::milliseconds default_timeout();

// One collective in flight. Backends finish it exactly once with finish() or fail();
// wait() blocks until then (spinning briefly, then sleeping) and rethrows a failure.
// Also a Waitable, so it can be attached to the output tensor's Storage. Room for a GPU
// backend: a subclass may override wait() to make a stream wait on an event instead.
class Work : public Waitable {
 public:
  explicit Work(std::string description = {});
  ~Work() override = default;

  // Blocks until finished; throws the failure (CommError) if the collective failed.
  void wait() override;
  bool is_completed() const override { return done_.load(std::memory_order_acquire); }
  // True when finished with a failure.
  bool failed() const;
  // The failure, or null.
  std::exception_ptr exception() const;
  // "all_reduce on group 'world' (seq 3)" — used in error messages. Virtual so that a backend
  // can build it lazily (formatting it for every collective costs more than a small one).
  virtual const std::string& description() const { return description_; }

  // ---- for backends ----
  void finish();
  void fail(std::exception_ptr error);

  // A Work that is already complete (world size 1, count 0).
  static std::shared_ptr<Work> completed(std::string description = {});

 protected:
  // For subclasses that wait actively (helping progress) before sleeping: sleeps until the
  // Work finished, wake_waiters() was called, or `deadline` passed; returns is_completed().
  bool sleep_until(std::chrono::steady_clock::time_point deadline);
  // Wakes every thread sleeping in wait() or sleep_until() so it re-checks its condition.
  void wake_waiters();
  // Rethrows the failure once finished; no-op on success.
  void rethrow_if_failed() const;

 private:
  void set_done(std::exception_ptr error);

  std::string description_;
  std::atomic<bool> done_{false};
  std::atomic<bool> finishing_{false};  // claimed by the one finish() or fail()
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr error_;  // written before done_ is set, read after it is seen
  // Written under mu_; read without it by set_done() and wake_waiters() (notify only when
  // someone sleeps).
  std::atomic<int> sleepers_{0};
  uint64_t wake_generation_ = 0;  // guarded by mu_: bumped by wake_waiters()
};

}  // namespace funcol
