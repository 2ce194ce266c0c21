// Work: finishing, failing and waiting for one asynchronous collective.
#include "funcol/dist/work.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>

#include <fmt/format.h>

#include "checks.h"
#include "funcol/core/error.h"
#include "spin.h"

namespace funcol {

namespace {
// 300 s: torch.distributed's default timeout for non-NCCL process groups.
constexpr std::chrono::milliseconds kDefaultTimeout{300'000};
// Upper bound so that deadline arithmetic on steady_clock never overflows (~31 years).
constexpr double kMaxTimeoutSeconds = 1e9;
}  // namespace

std::chrono::milliseconds default_timeout() {
  const std::optional<double> env = dist_detail::env_number(
      "FUNCOL_TIMEOUT", "a positive number of seconds", [](double s) { return s > 0; });
  if (!env) return kDefaultTimeout;
  const double seconds = std::min(*env, kMaxTimeoutSeconds);
  // At least 1 ms, so that a tiny positive value still means "fail fast" rather than zero.
  auto ms = static_cast<int64_t>(std::ceil(seconds * 1000.0));
  return std::chrono::milliseconds(std::max<int64_t>(ms, 1));
}

std::chrono::milliseconds effective_timeout(std::chrono::milliseconds requested) {
  if (requested.count() <= 0) return default_timeout();
  constexpr auto kMax = std::chrono::milliseconds(static_cast<int64_t>(kMaxTimeoutSeconds * 1000));
  return std::min(requested, kMax);
}

struct Work::Sleep {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;  // bumped by wake_waiters()
};

Work::Work(std::string description) : description_(std::move(description)) {}

Work::~Work() { delete sleep_.load(std::memory_order_acquire); }

Work::Sleep& Work::sleep_state() {
  Sleep* s = sleep_.load(std::memory_order_acquire);
  if (s != nullptr) return *s;
  auto fresh = std::make_unique<Sleep>();
  if (sleep_.compare_exchange_strong(s, fresh.get(), std::memory_order_seq_cst,
                                     std::memory_order_acquire)) {
    return *fresh.release();
  }
  return *s;  // another sleeper made it first
}

void Work::wait() {
  if (!done_.load(std::memory_order_acquire)) {
    dist_detail::Backoff backoff;
    while (!done_.load(std::memory_order_acquire) && backoff.step()) {
    }
    if (!done_.load(std::memory_order_acquire)) {
      // This thread rethrows a failure once it wakes: it counts as seen now, or a rank ending
      // meanwhile (destroy_process_group on another thread) warned of it as never seen.
      set_failure_seen();
      Sleep& s = sleep_state();
      std::unique_lock<std::mutex> lock(s.mu);
      ++sleepers_;
      s.cv.wait(lock, [&] { return done_.load(std::memory_order_seq_cst); });
      --sleepers_;
    }
  }
  rethrow_if_failed();
}

bool Work::failed() const { return is_completed() && error_ != nullptr; }

std::exception_ptr Work::exception() const { return is_completed() ? error_ : nullptr; }

bool Work::failure_seen(int /*rank*/) const {
  return failure_seen_.load(std::memory_order_relaxed);
}

void Work::set_failure_seen() { failure_seen_.store(true, std::memory_order_relaxed); }

void Work::finish() { set_done(nullptr); }

void Work::fail(std::exception_ptr error) {
  FUNCOL_CHECK(error != nullptr, "Work::fail needs an exception");
  set_done(std::move(error));
}

void Work::set_done(std::exception_ptr error) {
  // The claim is atomic so that two finishers racing (a backend bug) cannot both write error_.
  FUNCOL_CHECK(!finishing_.exchange(true, std::memory_order_relaxed),
               "Work finished twice: " + description_);
  // Written only on failure: error_ may sit on another cache line than done_, and every write
  // of a line the waiter reads costs a transfer on the critical path of a small collective.
  if (error) error_ = std::move(error);
  // No lock unless someone sleeps: finishing is on the critical path of every collective. The
  // store and the load below are seq_cst, as are a sleeper's increment of sleepers_ (under the
  // Sleep's mutex, after it made the Sleep) and its check of done_ that follows: either the
  // sleeper sees done_, or we see it and notify under the mutex (so the notification cannot
  // fall between its check and its wait).
  done_.store(true, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    Sleep& s = *sleep_.load(std::memory_order_acquire);
    { std::lock_guard<std::mutex> lock(s.mu); }
    s.cv.notify_all();
  }
}

Tensor failed_tensor(const Shape& shape, DType dtype, std::exception_ptr error) {
  Tensor t = Tensor::empty(shape, dtype);
  auto failed = std::make_shared<Work>("a failed result");
  failed->fail(std::move(error));
  t.storage()->add_pending(std::move(failed));
  return t;
}

std::optional<Tensor> failed_stand_in(const Tensor& t, std::exception_ptr* error) {
  try {
    t.wait();
    return std::nullopt;
  } catch (...) {
    const std::exception_ptr failure = std::current_exception();
    if (error != nullptr) *error = failure;
    return failed_tensor(t.sizes(), t.dtype(), failure);
  }
}

std::exception_ptr abandoned_error(std::string_view rest, std::string_view where) {
  std::string what = "an unknown error";
  try {
    throw;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  return std::make_exception_ptr(AbandonedError(
      fmt::format("it gave up on the rest of its {} after an error{}: {}", rest, where, what)));
}

std::shared_ptr<Work> Work::completed(std::string description) {
  auto work = std::make_shared<Work>(std::move(description));
  work->finish();
  return work;
}

bool Work::sleep_until(std::chrono::steady_clock::time_point deadline) {
  if (done_.load(std::memory_order_acquire)) return true;
  set_failure_seen();  // its caller, a wait(), rethrows it: seen, as in wait() here
  Sleep& s = sleep_state();
  std::unique_lock<std::mutex> lock(s.mu);
  if (done_.load(std::memory_order_acquire)) return true;
  uint64_t generation = s.generation;
  ++sleepers_;
  s.cv.wait_until(lock, deadline, [&] {
    return done_.load(std::memory_order_seq_cst) || s.generation != generation;
  });
  --sleepers_;
  return done_.load(std::memory_order_acquire);
}

void Work::wake_waiters() {
  // A hint, not a handshake: a waiter that starts sleeping right after this check misses it
  // and sleeps until the Work finishes, which is still correct.
  if (sleepers_.load(std::memory_order_acquire) == 0) return;
  Sleep& s = *sleep_.load(std::memory_order_acquire);
  bool notify = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    ++s.generation;
    notify = sleepers_ > 0;
  }
  if (notify) s.cv.notify_all();
}

void Work::rethrow_if_failed() const {
  if (!done_.load(std::memory_order_acquire) || !error_) return;
  failure_seen_.store(true, std::memory_order_relaxed);
  // The caller gets a CommError of its own, copied while it holds this Work: the stored one is
  // released with the Work, maybe on another thread (a peer rank's, which held it last), and
  // the reference count inside exception_ptr is invisible to ThreadSanitizer, which would
  // take a caller still reading its caught error for a race with that release.
  try {
    std::rethrow_exception(error_);
  } catch (const CommError& e) {
    if (typeid(e) == typeid(CommError)) throw CommError(e.what());
    throw;
  }
}

}  // namespace funcol
