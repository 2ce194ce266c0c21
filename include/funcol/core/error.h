// Error types thrown by funcol: every error the library throws derives from funcol::Error.
#pragma once

#include <stdexcept>
#include <string>

namespace funcol {

// Base of every error funcol throws. Messages start lower-case, have no final period and name
// the offending value.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// A bad argument: unknown reduce op, bad group spec, non-contiguous input, bad dtype.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Shapes that do not fit: wrong rank, non-divisible dims, mismatched sizes.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// Malformed IR text. what() is "FILE:LINE:COL: error: message".
class ParseError : public Error {
 public:
  ParseError(std::string file, int line, int col, const std::string& message)
      : Error(file + ":" + std::to_string(line) + ":" + std::to_string(col) + ": error: " + message),
        file_(std::move(file)),
        line_(line),
        col_(col),
        message_(message) {}
  const std::string& file() const { return file_; }
  int line() const { return line_; }
  int col() const { return col_; }
  // The message without the location prefix.
  const std::string& message() const { return message_; }

 private:
  std::string file_;
  int line_;
  int col_;
  std::string message_;
};

// A collective that failed: timeout, a dead or departed peer, mismatched collectives.
class CommError : public Error {
 public:
  using Error::Error;
};

// A broken internal invariant (a funcol bug, never bad user input).
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void check_failed(const char* cond, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace funcol

// Always-on invariant check for programmer bugs. User input is validated with typed errors
// instead and never reaches a FUNCOL_CHECK.
#define FUNCOL_CHECK(cond, ...)                                                          \
  do {                                                                                   \
    if (!(cond)) ::funcol::detail::check_failed(#cond, __FILE__, __LINE__, std::string{__VA_ARGS__}); \
  } while (0)
