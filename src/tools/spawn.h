// Starting, watching and stopping child processes (the launchers of `funcol run`).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace funcol::tools {

// How to start one child process.
struct SpawnOptions {
  // argv[0] is searched in PATH unless it contains a '/'. Must not be empty.
  std::vector<std::string> argv;
  // Variables added to (or replacing those of) this process's environment.
  std::vector<std::pair<std::string, std::string>> env;
  // Files that replace the child's stdout / stderr (created or truncated); empty: inherited.
  std::string stdout_path;
  std::string stderr_path;
  // A descriptor of ours that becomes the child's stdout (a pipe's write end, say); -1: none.
  // Takes the place of stdout_path.
  int stdout_fd = -1;
  // The child leads a process group of its own, so that stopping it also stops whatever it
  // starts (mpirun's daemons, a shell's commands). Such a group is not the terminal's foreground
  // one: the terminal's Ctrl-C and Ctrl-Z reach only the caller, and with `stty tostop` a write
  // to the terminal stops the child (SIGTTOU; ignored in the child, which then writes). false:
  // the child stays in the caller's group, as torchrun's children do, and gets the terminal's
  // signals with it (a launcher's ranks, which start nothing).
  bool own_process_group = true;
};

// Starts a child with posix_spawn. Throws funcol::Error naming the program when it cannot be
// started (not found, not executable, out of processes).
pid_t spawn_process(const SpawnOptions& options);

// How a child ended.
struct ExitStatus {
  pid_t pid = -1;
  bool signaled = false;  // killed by a signal
  int code = 0;           // exit code, or the signal number when signaled
  bool stopped = false;   // ended after wait_all began stopping the children (collateral)
  bool ok() const { return !signaled && code == 0; }
  // "exited with status 3", "was killed by signal 9 (Killed)".
  std::string describe() const;
};

// Waits for every child in `pids`. As soon as one fails (non-zero exit or killed by a signal),
// an InterruptScope recorded a signal, or `stuck` (when given; asked at each poll) returns
// true, the others get SIGTERM, then SIGKILL after `grace`, so nothing is left running (a
// child that leads a process group: its whole group, also once it ended). Returns every status
// in the order the children ended (the first failure is the first non-ok entry); every child is
// reaped. Polls with waitpid(WNOHANG) so it never reaps children it did not start. `grace` is
// no limit: a child that runs on well is waited for.
std::vector<ExitStatus> wait_all(const std::vector<pid_t>& pids,
                                 std::chrono::milliseconds grace = std::chrono::seconds(5),
                                 const std::function<bool()>& stuck = {});

// True when one of `pids` ended with a failure (non-zero exit or a signal). Does not reap it
// (wait_all still collects its status). Never blocks.
bool any_failed(const std::vector<pid_t>& pids);

// While alive, SIGINT, SIGTERM and SIGHUP do not kill this process but are recorded: wait_all
// then stops the children as on a failure, and the launcher cleans up and exits with
// 128 + signal() itself. A signal this process ignores (nohup's SIGHUP, a background job's
// SIGINT) stays ignored, and so it is in the children, but for SIGTERM, with which wait_all
// stops them; the others start with default handlers (exec resets them).
class InterruptScope {
 public:
  InterruptScope();
  // For a job whose ranks are this process's threads (the threads backend), with no children to
  // stop: a signal ends the process at once as the launchers end their jobs. It removes
  // `remove` (the trace file the run created; none when empty), prints interrupted_message and
  // exits with 128 + the signal. (The signals' default action said nothing and left the trace
  // file empty.)
  struct ExitAtOnce {
    std::string remove;
  };
  explicit InterruptScope(const ExitAtOnce& how);
  ~InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
  // The first signal received while a scope was alive, or 0.
  static int signal();
  // Whether stderr's last line is left open (a progress bar's): an ExitAtOnce scope then ends
  // it before its message.
  static void note_line_open(bool open);
};

// "funcol: error: interrupted by signal N (Name); stopped every rank\n": what a launcher
// says when a signal stopped its job.
std::string interrupted_message(int sig);

// The absolute path of the running executable (/proc/self/exe).
std::string self_executable();

// Where temporary directories go: $TMPDIR (made absolute), or /tmp when it is unset or empty.
std::string temp_root();

// A fresh private directory (mkdtemp under temp_root()), removed with its contents when the
// object dies.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace funcol::tools
