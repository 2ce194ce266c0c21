// Environment and option parsing shared by the process backends.
#include "dist/multiprocess/process_env.h"

#include <fmt/format.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>

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
  // "redis:/x" or "file:dir" is a mistyped URL, not a directory named "redis:".
  for (const char* scheme : {"redis:", "file:"}) {
    if (url.rfind(scheme, 0) == 0) throw bad(fmt::format("'{}' must be followed by //", scheme));
  }
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

bool all_digits(const std::string& s) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// A process's state (field 3 of /proc/<pid>/stat) and start time (field 22, clock ticks since
// boot), or the errno that kept it from being read (0: read but not understood).
struct Stat {
  char state = 0;
  std::string start;
  int error = 0;
};
Stat stat_of(const std::string& pid) {
  Stat out;
  const int fd = ::open(("/proc/" + pid + "/stat").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    out.error = errno;
    return out;
  }
  std::string text(4096, '\0');
  const ssize_t n = ::read(fd, text.data(), text.size());
  ::close(fd);
  if (n <= 0) {
    out.error = n < 0 ? errno : 0;
    return out;
  }
  text.resize(static_cast<size_t>(n));
  const size_t comm_end = text.rfind(')');  // the command name may hold spaces and parentheses
  if (comm_end == std::string::npos) return out;
  std::istringstream fields(text.substr(comm_end + 1));
  std::string state, field;
  fields >> state;
  int at = 3;  // the field last read
  while (at < 22 && fields >> field) ++at;
  if (state.size() != 1 || at != 22) return out;
  out.state = state[0];
  out.start = field;
  return out;
}

// "<host name>/<boot id>/<pid namespace>[+<time namespace>]/<device of /proc>": who may look
// up this process's pids in its /proc and compare start times (/proc gives start times shifted
// by the reader's time namespace; kernels before 5.6 have none). Empty when one of them cannot
// be read.
const std::string& machine_and_namespace() {
  static const std::string mine = [] {
    char host[256] = {};
    if (::gethostname(host, sizeof host - 1) != 0) return std::string();
    const std::string boot = first_line("/proc/sys/kernel/random/boot_id");
    std::error_code ec;
    std::string ns = std::filesystem::read_symlink("/proc/self/ns/pid", ec).string();
    std::error_code no_time_ns;
    const std::string time_ns =
        std::filesystem::read_symlink("/proc/self/ns/time", no_time_ns).string();
    if (!no_time_ns && !time_ns.empty()) ns += "+" + time_ns;
    struct stat proc {};
    if (boot.empty() || ec || ns.empty() || ::stat("/proc", &proc) != 0) return std::string();
    std::string key = fmt::format("{}/{}/{}/{}", host, boot, ns, static_cast<uint64_t>(proc.st_dev));
    if (std::count(key.begin(), key.end(), '/') != 3 || key.find(' ') != std::string::npos) {
      return std::string();
    }
    return key;
  }();
  return mine;
}

}  // namespace

std::string process_identity() {
  const std::string& where = machine_and_namespace();
  if (where.empty()) return "";
  // The pid as /proc numbers it (its namespace may not be this process's own).
  std::error_code ec;
  const std::string pid = std::filesystem::read_symlink("/proc/self", ec).string();
  if (ec || !all_digits(pid)) return "";
  const Stat self = stat_of(pid);
  if (self.start.empty()) return "";
  return fmt::format("{}/{}/{}", where, pid, self.start);
}

std::optional<bool> process_running(const std::string& identity) {
  const std::string& where = machine_and_namespace();
  if (where.empty() || identity.size() <= where.size() + 1 ||
      identity.compare(0, where.size(), where) != 0 || identity[where.size()] != '/') {
    return std::nullopt;
  }
  const std::string rest = identity.substr(where.size() + 1);  // "<pid>/<start time>"
  const size_t slash = rest.find('/');
  if (slash == std::string::npos || slash + 1 == rest.size()) return std::nullopt;
  const std::string pid = rest.substr(0, slash);
  if (!all_digits(pid)) return std::nullopt;
  const Stat now = stat_of(pid);
  if (now.error == ENOENT || now.error == ESRCH) return false;  // no such process
  if (now.start.empty()) return std::nullopt;                    // unreadable: cannot tell
  if (now.start != rest.substr(slash + 1)) return false;         // the pid went to a later one
  return now.state != 'Z' && now.state != 'X';
}

namespace {
std::atomic<pid_t> g_backend_owner{0};
}  // namespace

void note_backend_owner() { g_backend_owner.store(::getpid()); }

bool forked_from_backend_owner() {
  const pid_t owner = g_backend_owner.load();
  return owner != 0 && owner != ::getpid();
}

namespace {

[[noreturn]] void launcher_gone(pid_t launcher) {
  const std::string line = fmt::format(
      "funcol: error: the launcher of this job (pid {}) is gone; stopping this rank\n", launcher);
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
  ::_exit(1);
}

void watch_launcher(pid_t launcher) {
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, launcher, 0));
  if (fd < 0) {
    if (errno == ESRCH) launcher_gone(launcher);
    return;  // no pidfd (an old kernel): not watched
  }
  std::thread([fd, launcher] {
    pollfd p{fd, POLLIN, 0};
    while (::poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
    launcher_gone(launcher);
  }).detach();
}

// The launcher pid in `var`, if set.
std::optional<pid_t> launcher_pid(const char* var) {
  const std::optional<int> pid = env_int(var);
  if (pid && *pid <= 0) {
    throw InvalidArgument(fmt::format("{} must be a process id, got {}", var, *pid));
  }
  return pid ? std::optional<pid_t>(static_cast<pid_t>(*pid)) : std::nullopt;
}

void follow(pid_t launcher) {
  if (::getppid() == launcher) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    // The launcher may have died before prctl took effect: then this rank was re-parented.
    if (::getppid() != launcher) launcher_gone(launcher);
    return;
  }
  watch_launcher(launcher);
}

// Whether follow_launcher ran to its end (a mutex and a flag, not std::call_once: a call_once
// whose function throws made the next call hang under ThreadSanitizer).
std::mutex g_follow_mu;
bool g_followed = false;

}  // namespace

void follow_launcher() {
  std::lock_guard<std::mutex> lock(g_follow_mu);
  if (g_followed) return;
  const std::optional<pid_t> launcher = launcher_pid(kLauncherPidVar);
  const std::optional<pid_t> mpi_launcher = launcher_pid(kMpiLauncherPidVar);
  g_followed = true;
  if (!launcher && !mpi_launcher) return;
  // In another PID namespace the launcher's pid names no process, or another one: a rank there
  // took its launcher for gone at once. (A parent outside the namespace shows as 0.)
  const std::string ns = env_string(kLauncherPidNamespaceVar);
  if ((!ns.empty() && ns != pid_namespace()) || ::getppid() == 0) return;
  if (launcher) follow(*launcher);
  if (mpi_launcher) follow(*mpi_launcher);
}

std::string pid_namespace() {
  std::error_code ec;
  const std::filesystem::path ns = std::filesystem::read_symlink("/proc/self/ns/pid", ec);
  return ec ? std::string() : ns.string();
}

bool process_live(int pid) {
  const Stat now = stat_of(std::to_string(pid));
  if (now.error == ENOENT || now.error == ESRCH) return false;
  return now.state != 'Z' && now.state != 'X';
}

std::string identity_pid(const std::string& identity) {
  // "<...>/<pid>/<start time>": the field before the last.
  const size_t end = identity.rfind('/');
  if (end == std::string::npos || end == 0) return "";
  const size_t begin = identity.rfind('/', end - 1);
  if (begin == std::string::npos) return "";
  const std::string pid = identity.substr(begin + 1, end - begin - 1);
  return all_digits(pid) ? pid : "";
}

}  // namespace funcol::process
