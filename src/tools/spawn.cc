// Child processes for the launchers: posix_spawn, waitpid polling, kill on first failure.
#include "tools/spawn.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <thread>

#include "funcol/core/error.h"

extern char** environ;

namespace funcol::tools {

namespace {

volatile sig_atomic_t g_interrupt = 0;
constexpr int kInterruptSignals[] = {SIGINT, SIGTERM, SIGHUP};
struct sigaction g_previous[3];

extern "C" void record_interrupt(int sig) {
  if (g_interrupt == 0) g_interrupt = sig;
}

// For InterruptScope(ExitAtOnce): what to remove, and what to say for each signal (made before,
// as a handler may call only async-signal-safe functions).
char g_remove_on_exit[4096];
char g_exit_messages[std::size(kInterruptSignals)][128];
volatile sig_atomic_t g_line_open = 0;

extern "C" void exit_on_interrupt(int sig) {
  if (g_remove_on_exit[0] != '\0') ::unlink(g_remove_on_exit);
  if (g_line_open != 0) {
    [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, "\n", 1);
  }
  for (size_t i = 0; i < std::size(kInterruptSignals); ++i) {
    if (kInterruptSignals[i] != sig) continue;
    [[maybe_unused]] const ssize_t n =
        ::write(STDERR_FILENO, g_exit_messages[i], std::strlen(g_exit_messages[i]));
  }
  ::_exit(128 + sig);
}

// Handles every interrupt signal this process does not ignore with `handler`, saving the
// previous actions in g_previous.
void handle_interrupts(void (*handler)(int)) {
  struct sigaction sa {};
  sa.sa_handler = handler;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < std::size(kInterruptSignals); ++i) {
    sigaction(kInterruptSignals[i], nullptr, &g_previous[i]);
    if (g_previous[i].sa_handler == SIG_IGN) continue;  // nohup's SIGHUP, say: stays ignored
    sigaction(kInterruptSignals[i], &sa, nullptr);
  }
}

std::string errno_text(int err) { return std::strerror(err); }

ExitStatus decode(pid_t pid, int status) {
  ExitStatus s;
  s.pid = pid;
  if (WIFSIGNALED(status)) {
    s.signaled = true;
    s.code = WTERMSIG(status);
  } else {
    s.code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  }
  return s;
}

}  // namespace

std::string ExitStatus::describe() const {
  if (signaled) {
    const char* name = strsignal(code);
    return fmt::format("was killed by signal {} ({})", code, name ? name : "unknown");
  }
  return fmt::format("exited with status {}", code);
}

pid_t spawn_process(const SpawnOptions& options) {
  if (options.argv.empty()) throw InvalidArgument("spawn_process: empty argv");
  // The environment: ours, with options.env replacing or adding variables.
  std::vector<std::string> env_strings;
  for (char** e = environ; e && *e; ++e) {
    const std::string_view entry(*e);
    const std::string_view key = entry.substr(0, entry.find('='));
    const bool replaced = std::any_of(options.env.begin(), options.env.end(),
                                      [&](const auto& kv) { return kv.first == key; });
    if (!replaced) env_strings.emplace_back(entry);
  }
  for (const auto& [k, v] : options.env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (std::string& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = options.argv;
  std::vector<char*> argv;
  for (std::string& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (options.stdout_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, options.stdout_fd, STDOUT_FILENO);
  } else if (!options.stdout_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, options.stdout_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  if (!options.stderr_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, options.stderr_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
  }
  // A child of a group of its own: wait_all signals the whole group. SIGTTOU is ignored in it
  // (a disposition exec keeps) for the spawn: our own group may be the terminal's foreground
  // one, the child's is not, and with `stty tostop` its first write there would stop it for
  // good (the launcher waiting on it).
  // SIGTERM takes its default action in the child even where we ignore it: it is how wait_all
  // stops children (they would last until the SIGKILL after the grace period).
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  posix_spawnattr_setsigdefault(&attr, &term);
  short flags = POSIX_SPAWN_SETSIGDEF;
  struct sigaction ttou_before {};
  if (options.own_process_group) {
    flags |= POSIX_SPAWN_SETPGROUP;
    posix_spawnattr_setpgroup(&attr, 0);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGTTOU, &ignore, &ttou_before);
  }
  posix_spawnattr_setflags(&attr, flags);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, argv[0], &actions, &attr, argv.data(), envp.data());
  if (options.own_process_group) sigaction(SIGTTOU, &ttou_before, nullptr);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    throw Error(fmt::format("cannot start {}: {}", options.argv[0], errno_text(rc)));
  }
  return pid;
}

std::vector<ExitStatus> wait_all(const std::vector<pid_t>& pids, std::chrono::milliseconds grace,
                                 const std::function<bool()>& stuck) {
  // Asked while every child is unreaped (its pid still its own): after that, a pid that led no
  // group may be another process's.
  std::vector<char> leads(pids.size());
  for (size_t i = 0; i < pids.size(); ++i) leads[i] = getpgid(pids[i]) == pids[i];
  std::vector<pid_t> running = pids;
  auto signal_children = [&](int sig) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (leads[i]) {
        kill(-pids[i], sig);
      } else if (std::find(running.begin(), running.end(), pids[i]) != running.end()) {
        kill(pids[i], sig);
      }
    }
  };
  std::vector<ExitStatus> done;
  bool killing = false;
  auto kill_deadline = std::chrono::steady_clock::now();
  bool sent_kill = false;
  auto sleep_for = std::chrono::microseconds(200);
  while (!running.empty()) {
    bool progressed = false;
    for (size_t i = 0; i < running.size();) {
      int status = 0;
      const pid_t r = waitpid(running[i], &status, WNOHANG);
      if (r == running[i] || (r < 0 && errno == ECHILD)) {
        // ECHILD: reaped elsewhere; count it as a failure we cannot describe better.
        done.push_back(r == running[i] ? decode(r, status) : ExitStatus{running[i], false, 1});
        done.back().stopped = killing;
        running.erase(running.begin() + static_cast<std::ptrdiff_t>(i));
        progressed = true;
      } else {
        ++i;
      }
    }
    if (!killing && !running.empty() &&
        (g_interrupt != 0 ||
         std::any_of(done.begin(), done.end(), [](const ExitStatus& s) { return !s.ok(); }) ||
         (stuck && stuck()))) {
      killing = true;
      // Whole groups, the ended children's too: what they started may still run. A stopped
      // child (SIGSTOP, Ctrl-Z) keeps a SIGTERM pending until it is continued: it would end
      // only at the SIGKILL after `grace`, and the launcher print the failure that late.
      signal_children(SIGTERM);
      signal_children(SIGCONT);
      kill_deadline = std::chrono::steady_clock::now() + grace;
    }
    if (killing && !sent_kill && std::chrono::steady_clock::now() >= kill_deadline) {
      signal_children(SIGKILL);
      sent_kill = true;
    }
    if (running.empty()) break;
    if (progressed) {
      sleep_for = std::chrono::microseconds(200);
    } else {
      // Back off to 10 ms: a launcher waits for minutes-long runs without burning a core.
      std::this_thread::sleep_for(sleep_for);
      sleep_for = std::min<std::chrono::microseconds>(sleep_for * 2, std::chrono::milliseconds(10));
    }
  }
  return done;
}

bool any_failed(const std::vector<pid_t>& pids) {
  // One call for all children (a launcher has no others): waitid reports an ended child
  // without reaping it. One that ended well (which a rank cannot before its peers exist) would
  // hide the others from that call, so then each is asked.
  siginfo_t info{};
  if (waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) return false;
  if (info.si_code == CLD_EXITED && info.si_status == 0) {
    for (pid_t pid : pids) {
      siginfo_t one{};
      if (waitid(P_PID, static_cast<id_t>(pid), &one, WEXITED | WNOHANG | WNOWAIT) == 0 &&
          one.si_pid == pid && (one.si_code != CLD_EXITED || one.si_status != 0)) {
        return true;
      }
    }
    return false;
  }
  return std::find(pids.begin(), pids.end(), info.si_pid) != pids.end();
}

InterruptScope::InterruptScope() {
  g_interrupt = 0;
  handle_interrupts(record_interrupt);
}

InterruptScope::InterruptScope(const ExitAtOnce& how) {
  g_interrupt = 0;
  // A path too long to keep is left behind (as before), never cut short.
  g_remove_on_exit[0] = '\0';
  if (how.remove.size() < sizeof g_remove_on_exit) {
    std::memcpy(g_remove_on_exit, how.remove.c_str(), how.remove.size() + 1);
  }
  for (size_t i = 0; i < std::size(kInterruptSignals); ++i) {
    const std::string message = interrupted_message(kInterruptSignals[i]);
    const size_t n = std::min(message.size(), sizeof g_exit_messages[i] - 1);
    std::memcpy(g_exit_messages[i], message.data(), n);
    g_exit_messages[i][n] = '\0';
  }
  handle_interrupts(exit_on_interrupt);
}

InterruptScope::~InterruptScope() {
  for (size_t i = 0; i < std::size(kInterruptSignals); ++i) {
    sigaction(kInterruptSignals[i], &g_previous[i], nullptr);
  }
}

int InterruptScope::signal() { return g_interrupt; }

void InterruptScope::note_line_open(bool open) { g_line_open = open ? 1 : 0; }

std::string interrupted_message(int sig) {
  return fmt::format("funcol: error: interrupted by signal {} ({}); stopped every rank\n", sig,
                     strsignal(sig));
}

std::string self_executable() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw Error(fmt::format("cannot find the running executable: {}", ec.message()));
  return p.string();
}

std::string temp_root() {
  const char* base = std::getenv("TMPDIR");
  if (base == nullptr || *base == '\0') return "/tmp";
  // Absolute: the ranks' store is a directory under it, and a store must be named absolutely.
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::absolute(base, ec);
  return ec ? base : absolute.lexically_normal().string();
}

TempDir::TempDir(const std::string& prefix) {
  std::string templ = temp_root() + "/" + prefix + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) {
    throw Error(
        fmt::format("cannot create a temporary directory {}: {}", templ, errno_text(errno)));
  }
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace funcol::tools
