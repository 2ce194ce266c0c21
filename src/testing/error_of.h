// The message of an error a test expects (tests only).
#pragma once

#include <functional>
#include <string>

#include "funcol/core/error.h"

namespace funcol::testing {

// The what() of the funcol::Error (or the E) that fn throws, or a marker when it throws none.
template <typename E = Error>
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "<no funcol::Error thrown>";
}

}  // namespace funcol::testing
