// Environment and option parsing shared by the process backends.
#include "dist/multiprocess/process_env.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <system_error>

#include "funcol/core/error.h"
#include "funcol/dist/work.h"

namespace funcol::process {

bool debug_detail() {
  const std::string given = env_string("FUNCOL_DEBUG");
  std::string v = given;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v.empty() || v == "off" || v == "info") return false;
  if (v == "detail") return true;
  // A misspelling must not quietly turn off the checks it was meant to turn on.
  throw InvalidArgument(fmt::format(
      "environment variable FUNCOL_DEBUG='{}' is not one of OFF, INFO, DETAIL", given));
}

std::string debug_detail_mismatch(int peer, int rank, bool mine) {
  return fmt::format(
      "rank {} runs {} FUNCOL_DEBUG=DETAIL and this rank (rank {}) {}; every rank of a job must "
      "set the same FUNCOL_DEBUG",
      peer, mine ? "without" : "with", rank, mine ? "with it" : "without it");
}

std::string env_string(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

std::optional<int> env_int(const char* name) {
  std::string v = env_string(name);
  if (v.empty()) return std::nullopt;
  int out = 0;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec == std::errc::result_out_of_range && ptr == v.data() + v.size()) {
    throw InvalidArgument(fmt::format("environment variable {}='{}' is out of range ({} to {})",
                                      name, v, std::numeric_limits<int>::min(),
                                      std::numeric_limits<int>::max()));
  }
  if (ec != std::errc() || ptr != v.data() + v.size()) {
    throw InvalidArgument(fmt::format("environment variable {}='{}' is not an integer", name, v));
  }
  return out;
}

std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds timeout) {
  return effective_timeout(timeout);
}

StoreUrl parse_store_url(const std::string& url) {
  StoreUrl out;
  out.text = url;
  auto bad = [&](const std::string& why) {
    return InvalidArgument(fmt::format(
        "invalid store '{}': {} (expected a directory, file:///dir or redis://host:port)", url,
        why));
  };
  if (url.rfind("file://", 0) == 0) {
    out.kind = StoreUrl::Kind::File;
    out.path = url.substr(7);
    if (out.path.empty() || out.path[0] != '/') throw bad("the directory must be absolute");
    return out;
  }
  if (url.rfind("redis://", 0) == 0) {
    out.kind = StoreUrl::Kind::Redis;
    std::string rest = url.substr(8);
    if (!rest.empty() && rest.back() == '/') rest.pop_back();
    // A port follows the last colon, unless the colons belong to a bare IPv6 address.
    const size_t bracket = rest.find(']');
    const size_t colon = rest.rfind(':');
    const bool has_port =
        colon != std::string::npos &&
        (bracket == std::string::npos ? rest.find(':') == colon : colon > bracket);
    if (has_port) {
      std::string port = rest.substr(colon + 1);
      int p = 0;
      auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
      if (ec != std::errc() || ptr != port.data() + port.size() || p <= 0 || p > 65535) {
        throw bad(fmt::format("bad port '{}'", port));
      }
      out.port = p;
      rest = rest.substr(0, colon);
    }
    if (rest.size() >= 2 && rest.front() == '[' && rest.back() == ']') {
      rest = rest.substr(1, rest.size() - 2);
    }
    if (rest.empty()) throw bad("no host");
    out.host = rest;
    return out;
  }
  if (url.empty()) throw bad("empty");
  if (url.find("://") != std::string::npos) throw bad("unknown scheme");
  // A bare directory (no scheme): a file store there; a relative one is taken from the working
  // directory now, so the path in messages and the store's files are the same wherever they go.
  out.kind = StoreUrl::Kind::File;
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::absolute(url, ec);
  if (ec) throw bad(fmt::format("cannot make the directory absolute: {}", ec.message()));
  out.path = dir.lexically_normal().string();
  if (out.path.size() > 1 && out.path.back() == '/') out.path.pop_back();
  return out;
}

namespace {

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// /proc/<pid>/stat's state (field 3) and start time (field 22, clock ticks since boot); nullopt
// when there is no such process.
std::optional<std::pair<char, std::string>> stat_of(const std::string& pid) {
  const std::string stat = first_line("/proc/" + pid + "/stat");
  const size_t comm_end = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (comm_end == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(comm_end + 1));
  std::string state, field;
  fields >> state;
  int at = 3;  // the field last read
  while (at < 22 && fields >> field) ++at;
  if (state.empty() || at != 22) return std::nullopt;
  return std::make_pair(state[0], field);
}

// "<boot id>/<pid namespace>": who can compare pids with this process.
const std::string& machine_and_namespace() {
  static const std::string mine = [] {
    const std::string boot = first_line("/proc/sys/kernel/random/boot_id");
    std::error_code ec;
    const std::string ns = std::filesystem::read_symlink("/proc/self/ns/pid", ec).string();
    if (boot.empty() || ec || ns.empty() || boot.find_first_of("/ ") != std::string::npos ||
        ns.find_first_of("/ ") != std::string::npos) {
      return std::string();
    }
    return boot + "/" + ns;
  }();
  return mine;
}

}  // namespace

std::string process_identity() {
  const std::string& where = machine_and_namespace();
  const auto self = stat_of("self");
  if (where.empty() || !self) return "";
  return fmt::format("{}/{}/{}", where, static_cast<long>(::getpid()), self->second);
}

bool process_ended(const std::string& identity) {
  const std::string& where = machine_and_namespace();
  if (where.empty() || identity.size() <= where.size() + 1 ||
      identity.compare(0, where.size(), where) != 0 || identity[where.size()] != '/') {
    return false;
  }
  const std::string rest = identity.substr(where.size() + 1);  // "<pid>/<start time>"
  const size_t slash = rest.find('/');
  if (slash == std::string::npos) return false;
  const std::string pid = rest.substr(0, slash);
  if (pid.empty() ||
      !std::all_of(pid.begin(), pid.end(), [](unsigned char c) { return std::isdigit(c); })) {
    return false;
  }
  const auto now = stat_of(pid);
  if (!now) return true;
  return now->second != rest.substr(slash + 1) || now->first == 'Z' || now->first == 'X';
}

}  // namespace funcol::process
