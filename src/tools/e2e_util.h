// Helpers of the end-to-end tests that run the funcol command: file contents, process liveness
// and bounded polling.
#pragma once

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

namespace funcol::tools::e2e {

// The whole file at `path` (empty when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The state letter of `pid` in /proc/PID/stat ('R', 'S', 'T', 'Z', ...); '\0' when there is
// no such process.
inline char process_state(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(f, stat)) return '\0';
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() ? stat[close + 2] : '\0';
}

// True while `pid` runs. A zombie counts as gone: it has stopped running (its parent or init
// reaps it).
inline bool alive(pid_t pid) {
  const char state = process_state(pid);
  return state != '\0' && state != 'Z';
}

// The child pids of `pid` (/proc/PID/task/PID/children), in /proc's order.
inline std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  std::vector<pid_t> out;
  pid_t c;
  while (f >> c) out.push_back(c);
  return out;
}

// Polls `cond` every 10 ms for up to `seconds`; a bounded wait, never a fixed sleep.
inline bool eventually(const std::function<bool()>& cond, int seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

// The process backends compiled into this test (its target defines FUNCOL_WITH_GLOO and
// FUNCOL_WITH_MPI as the build does).
inline std::vector<std::string> process_backends() {
  std::vector<std::string> b;
#ifdef FUNCOL_WITH_GLOO
  b.push_back("gloo");
#endif
#ifdef FUNCOL_WITH_MPI
  b.push_back("mpi");
#endif
  return b;
}

// What a shell command did.
struct ShellResult {
  int status = -1;  // exit status, or -1 when it did not exit normally (or could not start)
  std::string out;  // standard output
  std::string err;  // standard error
};

// Runs `command` through /bin/sh, its stderr into a temporary file, and waits for it.
inline ShellResult run_shell(const std::string& command) {
  ShellResult r;
  char err_path[] = "/tmp/funcol_e2e_err_XXXXXX";
  const int fd = mkstemp(err_path);
  if (fd < 0) return r;
  ::close(fd);
  std::FILE* p = popen((command + " 2>" + err_path).c_str(), "r");
  if (p != nullptr) {
    char buf[4096];
    size_t k;
    while ((k = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, k);
    const int st = pclose(p);
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  r.err = slurp(err_path);
  std::remove(err_path);
  return r;
}

}  // namespace funcol::tools::e2e
