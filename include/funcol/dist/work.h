// Work: the handle of one asynchronous collective; failures travel to wait() as exceptions.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "funcol/core/tensor.h"

namespace funcol {

// Default collective timeout: 300 s, as torch.distributed's default for non-NCCL backends.
// FUNCOL_TIMEOUT (seconds, may be fractional) overrides it.
std::chrono::milliseconds default_timeout();
// The timeout a run uses when `requested` is asked for: default_timeout() for zero (or less),
// else `requested` capped at about 31 years, so that deadline arithmetic never overflows
// (std::chrono::milliseconds::max() means "never time out" in effect).
std::chrono::milliseconds effective_timeout(std::chrono::milliseconds requested);

// One collective in flight. Backends finish it exactly once with finish() or fail();
// wait() blocks until then (spinning briefly, then sleeping) and rethrows a failure.
// Also a Waitable, so it can be attached to the output tensor's Storage. Room for a GPU
// backend: a subclass may override wait() to make a stream wait on an event instead.
class Work : public Waitable {
 public:
  explicit Work(std::string description = {});
  ~Work() override;

  // Blocks until finished; throws the failure (CommError) if the collective failed.
  void wait() override;
  bool is_completed() const override { return done_.load(std::memory_order_acquire); }
  // True when finished with a failure.
  bool failed() const;
  // The failure, or null.
  std::exception_ptr exception() const;
  // Whether wait() has thrown this Work's failure (directly, or through an access to a result
  // it writes). A Work that several ranks share (the threads backend's) answers for the thread
  // of global rank `rank`; others ignore it. A rank that ends with a failed collective whose
  // failure it never saw is warned (run_local, destroy_process_group).
  virtual bool failure_seen(int rank) const;
  // Makes failure_seen() true (for the calling thread's rank; for every member when the thread
  // is none of them), now or once it fails, without waiting: for a caller that reports the
  // failure by other means (an Executor whose run failed drops the run's collectives and
  // rethrows the run's error).
  virtual void set_failure_seen();
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
  // A sleeping waiter rethrows the failure once it wakes: it counts as seen (set_failure_seen)
  // from when it sleeps, so a rank that ends meanwhile does not warn of it as never seen.
  bool sleep_until(std::chrono::steady_clock::time_point deadline);
  // Wakes every thread sleeping in wait() or sleep_until() so it re-checks its condition.
  void wake_waiters();
  // Rethrows the failure once finished (which counts it seen); no-op on success.
  void rethrow_if_failed() const;

 private:
  void set_done(std::exception_ptr error);

  // What sleeping waiters share, made by the first of them: most collectives finish while
  // their waiter still spins, and a mutex and condition variable in every Work cost their
  // construction and destruction on every small collective.
  struct Sleep;
  Sleep& sleep_state();

  std::string description_;
  std::atomic<bool> done_{false};
  std::atomic<bool> finishing_{false};  // claimed by the one finish() or fail()
  std::exception_ptr error_;  // written before done_ is set, read after it is seen
  mutable std::atomic<bool> failure_seen_{false};  // see failure_seen()
  std::atomic<Sleep*> sleep_{nullptr};  // set once, freed with the Work
  // Written under the Sleep's mutex; read without it by set_done() and wake_waiters() (they
  // touch the Sleep only when someone sleeps, so it exists then).
  std::atomic<int> sleepers_{0};
};

// A contiguous tensor of `shape` and `dtype` holding the failure `error`: every access to its
// data throws it. Given to a collective as input, it still lets the rank take the collective's
// place in the group's sequence, and the collective fails on every rank, naming this rank and
// the failure ("rank R could not take part: its input holds the failed result of an earlier
// collective (...)", or, for an AbandonedError, its message).
Tensor failed_tensor(const Shape& shape, DType dtype, std::exception_ptr error);

// Null once the collective still writing `t` (if any) is done; or, when `t` holds a failure
// (the failed result of an earlier collective), a failed_tensor of its shape and dtype holding
// the same failure, which `error` (when given) receives too. A collective given the stand-in
// takes its place in the group's sequence and fails for every member; throwing before the
// backend call instead would leave this rank one collective behind its peers, its next
// collective pairing with their current one, silently so when the two look alike.
std::optional<Tensor> failed_stand_in(const Tensor& t, std::exception_ptr* error = nullptr);

// For failed_tensor, called while an exception is in flight: the AbandonedError "it gave up on
// the rest of its <rest> after an error<where>: <the exception's message>", where a rank stops
// part-way through a sequence of collectives and issues the rest failed (Executor::run,
// GradTape::backward).
std::exception_ptr abandoned_error(std::string_view rest, std::string_view where = {});

}  // namespace funcol
