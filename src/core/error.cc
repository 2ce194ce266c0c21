// The failure path of FUNCOL_CHECK.
#include "funcol/core/error.h"

#include <fmt/format.h>

#include <new>

namespace funcol {
namespace {

// Throws a T with `prefix` in front of e's message, located where e was, else at `at`.
template <class T>
[[noreturn]] void throw_prefixed(const T& e, const std::string& prefix, const SourceLocated* at) {
  if (const auto* own = dynamic_cast<const SourceLocated*>(&e)) {
    throw LocatedError<T>(prefix + e.what(), own->file(), own->line(), own->col(),
                          prefix + own->message());
  }
  if (at != nullptr) {
    throw LocatedError<T>(prefix + e.what(), at->file(), at->line(), at->col(),
                          at->message() + e.what());
  }
  throw T(prefix + e.what());
}

}  // namespace

std::string printable(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    const auto b = static_cast<unsigned char>(c);
    if (b >= 0x20 && b < 0x7f) {
      out += c;
    } else {
      out += fmt::format("\\x{:02x}", b);
    }
  }
  return out;
}

void rethrow_prefixed(const std::string& prefix, const SourceLocated* at) {
  try {
    throw;
  } catch (const ParseError& e) {
    throw LocatedError<InvalidArgument>(prefix + e.what(), e.file(), e.line(), e.col(),
                                        prefix + e.message());
  } catch (const ShapeError& e) {
    throw_prefixed(e, prefix, at);
  } catch (const InvalidArgument& e) {
    throw_prefixed(e, prefix, at);
  } catch (const CommError& e) {
    throw_prefixed(e, prefix, at);
  } catch (const AbandonedError& e) {
    throw_prefixed(e, prefix, at);
  } catch (const InternalError& e) {
    throw_prefixed(e, prefix, at);
  } catch (const Error& e) {
    throw_prefixed(e, prefix, at);
  } catch (const std::bad_alloc&) {
    throw_prefixed(Error("out of memory"), prefix, at);
  } catch (const std::exception& e) {
    throw_prefixed(Error(e.what()), prefix, at);
  }
}

namespace detail {

void check_failed(const char* cond, const char* file, int line, const std::string& msg) {
  std::string text = std::string("internal error: check failed: ") + cond + " at " + file + ":" +
                     std::to_string(line);
  if (!msg.empty()) text += ": " + msg;
  throw InternalError(text);
}

}  // namespace detail
}  // namespace funcol
