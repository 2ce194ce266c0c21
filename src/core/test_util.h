// Test helpers for core tests: a Waitable the test completes by hand.
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <future>
#include <stdexcept>

#include "funcol/core/tensor.h"

namespace funcol::testing {

// A Waitable that completes only when the test calls release() (or fail()). wait() counts its
// calls; it gives up after 10 s so a test that waits by mistake fails instead of hanging.
class ManualWork : public Waitable {
 public:
  void wait() override {
    wait_calls_.fetch_add(1);
    if (future_.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      throw std::runtime_error("ManualWork: waited on a work that was never released");
    }
    if (failure_) std::rethrow_exception(failure_);
  }
  bool is_completed() const override { return completed_.load(); }

  void release() {
    completed_.store(true);
    promise_.set_value();
  }
  void fail(std::exception_ptr e) {
    failure_ = std::move(e);
    release();
  }
  int wait_calls() const { return wait_calls_.load(); }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_ = promise_.get_future().share();
  std::atomic<bool> completed_{false};
  std::atomic<int> wait_calls_{0};
  std::exception_ptr failure_;
};

}  // namespace funcol::testing
