// Polling a result instead of waiting for it (tests only).
#pragma once

#include <chrono>
#include <thread>

#include "funcol/core/tensor.h"

namespace funcol::testing {

// Polls t.is_ready() every millisecond until it is true or `limit` passed; returns the seconds
// that took (at least `limit` when it never became ready).
inline double poll_until_ready(const Tensor& t, std::chrono::duration<double> limit) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  while (!t.is_ready() && Clock::now() - start < limit) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace funcol::testing
