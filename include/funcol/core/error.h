// Error types thrown by funcol: every error the library throws derives from funcol::Error.
#pragma once

#include "funcol/core/cxx20.h"  // first: a clear error under an older standard

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

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

// Where in IR text an error points. Mixed into ParseError and into the errors thrown about one
// node of a graph parsed from text (LocatedError), so a tool can print any of them as
// "FILE:LINE:COL: error: message" (DESIGN section 5) without parsing what().
class SourceLocated {
 public:
  SourceLocated(std::string file, int line, int col, std::string message)
      : file_(std::move(file)), line_(line), col_(col), message_(std::move(message)) {}
  virtual ~SourceLocated() = default;
  const std::string& file() const { return file_; }
  int line() const { return line_; }
  int col() const { return col_; }
  // The message without the location.
  const std::string& message() const { return message_; }
  // "FILE:LINE:COL: error: message".
  std::string located() const {
    return file_ + ":" + std::to_string(line_) + ":" + std::to_string(col_) + ": error: " + message_;
  }

 private:
  std::string file_;
  int line_;
  int col_;
  std::string message_;
};

// Malformed IR text. what() is "FILE:LINE:COL: error: message".
class ParseError : public Error, public SourceLocated {
 public:
  ParseError(std::string file, int line, int col, const std::string& message)
      : Error(SourceLocated(file, line, col, message).located()),
        SourceLocated(std::move(file), line, col, message) {}
};

// A collective that failed: timeout, a dead or departed peer, mismatched collectives.
class CommError : public Error {
 public:
  using Error::Error;
};

// What the data of a value throws when its rank gave up computing it: an Executor run or a
// GradTape backward that failed part-way issues the collectives it had not issued yet with such
// inputs (so that no rank falls behind its peers in a group's sequence). The message says why;
// a collective given such a value fails on every rank with "rank R could not take part: <that
// message>".
class AbandonedError : public Error {
 public:
  using Error::Error;
};

// A broken internal invariant (a funcol bug, never bad user input).
class InternalError : public Error {
 public:
  using Error::Error;
};

// A typed error (`Base` is InvalidArgument, ShapeError, ...) about one node of a graph parsed
// from text: what() is the full message, which names the node in its own words; the location
// and the message without it come from SourceLocated. Catch it as Base.
template <class Base>
class LocatedError : public Base, public SourceLocated {
 public:
  LocatedError(const std::string& what, std::string file, int line, int col, std::string message)
      : Base(what), SourceLocated(std::move(file), line, col, std::move(message)) {}
};

// Rethrows the exception in flight (call it in a catch block) with `prefix` in front of its
// message, keeping its funcol type and its SourceLocated location. An error without a location
// is located at `at` when given, its message then `at->message()` followed by the error's. A
// ParseError becomes an InvalidArgument (its what() already starts with the location); a
// bad_alloc, an Error saying "out of memory"; any other exception, an Error.
[[noreturn]] void rethrow_prefixed(const std::string& prefix, const SourceLocated* at = nullptr);

// `text` for a message: bytes outside printable ASCII as \xHH, so a name from user input (a
// group, a reduce op) can neither end a message early (NUL) nor split or colour it.
std::string printable(std::string_view text);

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
