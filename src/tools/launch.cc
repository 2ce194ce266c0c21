// Process jobs of the funcol command: mpirun or N gloo processes with a file store.
#include "tools/launch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <new>
#include <thread>

#include "core/memory.h"
#include "dist/multiprocess/process_env.h"
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/work.h"
#include "tools/commands.h"
#include "tools/spawn.h"

namespace funcol::tools {

namespace {

// What a launcher passes to the ranks it starts, besides the gloo backend's own
// RANK/WORLD_SIZE/FUNCOL_STORE (DESIGN §3): its pid, which a rank follows (follow_launcher).
using process::kLauncherPidVar;
using process::kMpiLauncherPidVar;
// For the ranks of an mpirun job that funcol started: the job's temporary directory, where a
// rank that fails leaves a file named kRankFailedPrefix + its pid (note_rank_exit), so the
// launcher can tell an mpirun that ended the job before any rank said why.
constexpr const char* kMpiJobDirVar = "FUNCOL_MPI_JOB_DIR";
constexpr const char* kRankFailedPrefix = "failed-rank-";
// In a launcher's temporary directory: the launcher's process_identity. A launcher killed with
// SIGKILL cannot remove its directory; the next launcher on the machine sees from this file
// that its owner is gone and removes it (remove_abandoned_job_dirs).
constexpr const char* kLauncherFile = ".launcher";

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The running launcher's name in its temporary directory (kLauncherFile), under an exclusive
// flock held as long as this object lives: the kernel drops it when the launcher dies, however
// it dies, in whatever namespaces, so a live launcher's directory is never taken for
// abandoned. The name is written whole before it appears (renamed into place). When it cannot
// be written or locked the job still runs; only a later clean-up is lost.
class JobDirClaim {
 public:
  explicit JobDirClaim(const std::string& dir) {
    const std::string me = process::process_identity();
    if (me.empty()) return;
    const std::string path = dir + "/" + kLauncherFile;
    const std::string fresh = path + ".new";
    const int fd =
        ::open(fresh.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0) return;
    const std::string line = me + "\n";
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 ||
        ::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()) ||
        ::rename(fresh.c_str(), path.c_str()) != 0) {
      ::close(fd);
      ::unlink(fresh.c_str());
      return;
    }
    fd_ = fd;  // the name is there, locked
  }
  ~JobDirClaim() {
    if (fd_ >= 0) ::close(fd_);
  }
  JobDirClaim(const JobDirClaim&) = delete;
  JobDirClaim& operator=(const JobDirClaim&) = delete;

 private:
  int fd_ = -1;
};

// Removes the temporary directories that launchers killed with SIGKILL left in temp_root():
// those named funcol-*, owned by this user, whose kLauncherFile is not locked (its launcher
// has ended, whatever /proc says) and names a process on this machine that has ended. A
// directory without that file, of another user, or whose launcher runs or cannot be seen from
// here (another machine, PID or time namespace sharing the directory) is left alone, and so
// is everything under a temp_root() where others may rename entries (not sticky), since a
// directory checked there could be swapped for a link before its removal. Errors are ignored:
// this only tidies up.
void remove_abandoned_job_dirs() {
  namespace fs = std::filesystem;
  struct stat root {};
  if (::stat(temp_root().c_str(), &root) != 0 ||
      ((root.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (root.st_mode & S_ISVTX) == 0)) {
    return;
  }
  std::error_code ec;
  for (fs::directory_iterator it(temp_root(), ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& dir = it->path();
    if (dir.filename().string().rfind("funcol-", 0) != 0) continue;
    struct stat st {};
    if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
      continue;
    }
    const int fd = ::open((dir / kLauncherFile).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    char text[512];
    ssize_t n = -1;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) n = ::read(fd, text, sizeof text - 1);
    std::string owner = n > 0 ? std::string(text, static_cast<size_t>(n)) : "";
    if (!owner.empty() && owner.back() == '\n') owner.pop_back();
    if (!owner.empty() && process::process_running(owner) == false) {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
    ::close(fd);
  }
}

// Whether a rank of the mpirun job whose temporary directory is `dir` failed and said so.
bool a_rank_reported_failure(const std::string& dir) {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->path().filename().string().rfind(kRankFailedPrefix, 0) == 0) return true;
  }
  return false;
}

// The launcher's exit status after a signal stopped the job: 128 + the signal, as a shell's.
int interrupted(std::FILE* err) {
  const int sig = InterruptScope::signal();
  std::fputs(interrupted_message(sig).c_str(), err);
  return 128 + sig;
}

// Copies what arrives on `fd` to stdout as it comes, until end of file, or until `done` is set
// and nothing more arrives for a moment (something mpirun started may hold the pipe open). A
// write that fails leaves ferror(stdout) set; the rest is still read, so mpirun never blocks.
void copy_to_stdout(int fd, const std::atomic<bool>& done) {
  char buf[1 << 16];
  bool writing = true;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, 100);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      if (done.load()) break;
      continue;
    }
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (writing) writing = write_output(stdout, std::string_view(buf, static_cast<size_t>(n)));
  }
  close(fd);
}

// Tells an mpirun that outlives its ranks: Open MPI 4.1.4's mpirun, when one rank finalised and
// others exited with an error, or when sent SIGTERM, can hang in PMIx_server_finalize with no
// rank left (not even reaped: they stay zombies). hung() is true once mpirun, having had live
// processes under it (its ranks, or the daemons and ssh sessions that run them elsewhere), has
// had none for kLinger. Where /proc does not list children it never is.
class MpirunWatch {
 public:
  static constexpr std::chrono::seconds kLinger{10};
  explicit MpirunWatch(pid_t mpirun)
      : children_(fmt::format("/proc/{}/task/{}/children", mpirun, mpirun)) {}
  bool hung() {
    const auto now = std::chrono::steady_clock::now();
    if (now < next_look_) return false;
    next_look_ = now + std::chrono::milliseconds(100);
    std::ifstream f(children_);
    if (!f) return false;
    pid_t child;
    while (f >> child) {
      if (!process::process_live(child)) continue;
      had_children_ = true;
      last_child_ = now;
      return false;
    }
    fired_ = had_children_ && now - last_child_ >= kLinger;
    return fired_;
  }
  bool fired() const { return fired_; }

 private:
  std::string children_;
  std::chrono::steady_clock::time_point next_look_{};
  std::chrono::steady_clock::time_point last_child_{};
  bool had_children_ = false;
  bool fired_ = false;
};

int launch_mpi(const JobOptions& o, const std::string& dir, const std::string& self,
               const std::vector<std::string>& args, std::FILE* err) {
  SpawnOptions s;
  s.argv = {"mpirun", "-np", std::to_string(o.ranks), "--oversubscribe"};
  s.env = {{kMpiLauncherPidVar, std::to_string(getpid())},
           {process::kLauncherPidNamespaceVar, process::pid_namespace()},
           {kMpiJobDirVar, dir}};
  if (geteuid() == 0) s.argv.push_back("--allow-run-as-root");
  s.argv.push_back(self);
  s.argv.insert(s.argv.end(), args.begin(), args.end());
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) {
    throw Error(fmt::format("--backend mpi: cannot create a pipe: {}", std::strerror(errno)));
  }
  s.stdout_fd = out[1];
  pid_t pid = -1;
  try {
    pid = spawn_process(s);
  } catch (const Error& e) {
    close(out[0]);
    close(out[1]);
    throw Error(fmt::format("--backend mpi: {} (is Open MPI installed?)", e.what()));
  }
  close(out[1]);
  // A reader that closed our stdout (`| head`) must not kill the launcher with SIGPIPE: mpirun
  // would be left without it, its output pipe unread. The failed write is reported at the end
  // instead ("cannot write the output: Broken pipe"), as the other backends do, once the job
  // ended; mpirun itself keeps the default (set after it started).
  signal(SIGPIPE, SIG_IGN);
  flush_output(stdout);
  std::atomic<bool> done{false};
  std::thread copier(copy_to_stdout, out[0], std::cref(done));
  MpirunWatch watch(pid);
  const ExitStatus st =
      wait_all({pid}, std::chrono::seconds(5), [&] { return watch.hung(); }).front();
  done = true;
  copier.join();
  if (InterruptScope::signal() != 0) return interrupted(err);
  if (watch.fired()) {
    std::fprintf(err,
                 "funcol: error: mpirun did not exit within %lld s after its last rank ended "
                 "(Open MPI 4.1's mpirun can hang while finishing a job that failed or was "
                 "stopped); stopped it\n",
                 static_cast<long long>(MpirunWatch::kLinger.count()));
    return 1;
  }
  if (st.ok()) return 0;
  // The ranks printed their errors; add mpirun's own status only when it died oddly, or ended
  // the job with no rank's word (mpirun, sent SIGTERM, stops the ranks and exits with 1 quietly;
  // a rank killed by a signal says nothing either, though mpirun then does).
  if (st.signaled) {
    std::fprintf(err, "funcol: error: mpirun %s\n", st.describe().c_str());
  } else if (!a_rank_reported_failure(dir)) {
    std::fprintf(err,
                 "funcol: error: mpirun ended the job with exit status %d before any rank "
                 "reported an error (a rank may have crashed or been killed, mpirun may have "
                 "been sent a signal, or the ranks never started; mpirun's own messages, if "
                 "any, are above)\n",
                 st.code);
  }
  return 1;
}

int launch_gloo(const JobOptions& o, const std::string& dir, const std::string& self,
                const std::vector<std::string>& args, std::FILE* err) {
  const std::string store = dir + "/store";
  std::filesystem::create_directory(store);
  std::vector<pid_t> pids;
  std::vector<std::string> err_files;
  try {
    for (int r = 0; r < o.ranks; ++r) {
      // Starting many ranks takes a while: a signal, or a rank that already failed (a bad file,
      // say), stops the starting; wait_all below then stops the ranks started so far.
      if (InterruptScope::signal() != 0 || any_failed(pids)) break;
      SpawnOptions s;
      s.argv = {self};
      s.argv.insert(s.argv.end(), args.begin(), args.end());
      s.env = {{"RANK", std::to_string(r)},
               {"WORLD_SIZE", std::to_string(o.ranks)},
               {"FUNCOL_STORE", "file://" + store},
               {kLauncherPidVar, std::to_string(getpid())},
               {process::kLauncherPidNamespaceVar, process::pid_namespace()}};
      err_files.push_back(fmt::format("{}/rank{}.err", dir, r));
      s.stderr_path = err_files.back();
      // In the launcher's process group: the terminal's Ctrl-Z stops the ranks with it, and
      // they may write to it (rank 0's results) under `stty tostop`.
      s.own_process_group = false;
      pids.push_back(spawn_process(s));
    }
  } catch (...) {
    for (pid_t pid : pids) kill(pid, SIGKILL);
    wait_all(pids, std::chrono::milliseconds(0));
    throw;
  }
  const std::vector<ExitStatus> statuses = wait_all(pids);
  if (InterruptScope::signal() != 0) return interrupted(err);
  auto rank_of = [&](pid_t pid) {
    return static_cast<int>(std::find(pids.begin(), pids.end(), pid) - pids.begin());
  };
  // Among the ranks that failed before the launcher stopped the others, one killed by a signal
  // explains the failure best (its peers only saw it vanish); else the first rank that failed.
  auto failed = std::find_if(statuses.begin(), statuses.end(),
                             [](const ExitStatus& s) { return s.signaled && !s.stopped; });
  if (failed == statuses.end()) {
    failed = std::find_if(statuses.begin(), statuses.end(),
                          [](const ExitStatus& s) { return !s.ok(); });
  }
  if (failed == statuses.end()) {
    // Success: pass on whatever the ranks wrote to stderr (warnings), in rank order.
    for (const std::string& f : err_files) std::fputs(read_all(f).c_str(), err);
    return 0;
  }
  // The first rank that failed explains the failure; the others only saw it fail.
  const int rank = rank_of(failed->pid);
  const std::string message = read_all(err_files[static_cast<size_t>(rank)]);
  if (!message.empty()) std::fputs(message.c_str(), err);
  if (message.empty() || failed->signaled) {
    std::fprintf(err, "funcol: error: rank %d %s\n", rank, failed->describe().c_str());
  }
  return 1;
}

// An integer flag as typed: nullopt when not given. Throws InvalidArgument naming the flag
// unless it is an integer >= `min`.
std::optional<int> flag_int(const std::string& text, const char* flag, int min) {
  if (text.empty()) return std::nullopt;
  int v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec == std::errc::result_out_of_range && ptr == text.data() + text.size()) {
    throw InvalidArgument(fmt::format("{} must be an integer from {} to {}, got '{}'", flag, min,
                                      std::numeric_limits<int>::max(), text));
  }
  if (ec != std::errc() || ptr != text.data() + text.size() || v < min) {
    throw InvalidArgument(
        fmt::format("{} must be an integer of at least {}, got '{}'", flag, min, text));
  }
  return v;
}

// A rank or world size of a gloo job and where it came from, as messages name it ("--rank 2",
// "RANK=2"): the flag's value (>= 0), else the environment variable's.
struct Known {
  int value = 0;
  std::string said;
};
std::optional<Known> known(int option, const char* flag, const char* env) {
  if (option >= 0) return Known{option, fmt::format("{} {}", flag, option)};
  if (const std::optional<int> v = process::env_int(env)) {
    return Known{*v, fmt::format("{}={}", env, *v)};
  }
  return std::nullopt;
}

// A gloo job's world size, from --world-size or WORLD_SIZE; throws InvalidArgument naming where
// it came from unless it is at least 1.
std::optional<Known> known_world_size(const InitOptions& join) {
  std::optional<Known> size = known(join.world_size, "--world-size", "WORLD_SIZE");
  if (size && size->value < 1) {
    throw InvalidArgument(fmt::format("{}: the world size must be at least 1", size->said));
  }
  return size;
}

// "--rank", "--rank and --store", "--rank, --world-size and --store".
std::string flag_list(const std::vector<std::string>& flags) {
  std::string s;
  for (size_t i = 0; i < flags.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == flags.size() ? " and " : ", ") + flags[i];
  }
  return s;
}

// RANK without WORLD_SIZE, or WORLD_SIZE without RANK, for --backend gloo: half of a job's
// coordinates, which PyTorch's env:// rendezvous refuses too. Left alone, funcol would start a
// job of its own and ignore the rank (or size) set.
void check_job_variables_pair() {
  const std::optional<Known> rank = known(-1, "--rank", "RANK");
  const std::optional<Known> size = known(-1, "--world-size", "WORLD_SIZE");
  if (rank.has_value() == size.has_value()) return;
  const Known& set = rank ? *rank : *size;
  throw InvalidArgument(fmt::format(
      "{} is set but {} is not: a rank joining a gloo job needs both (or --rank and "
      "--world-size); unset {} to have funcol start the job itself",
      set.said, rank ? "WORLD_SIZE" : "RANK", rank ? "RANK" : "WORLD_SIZE"));
}

// The checks of --rank/--world-size/--store that need no --ranks: that they fit the backend and
// that a gloo rank gets both its rank and the world size.
void check_job_flags_fit(const std::string& backend, const InitOptions& join) {
  std::vector<std::string> given;
  if (join.rank >= 0) given.push_back("--rank");
  if (join.world_size >= 0) given.push_back("--world-size");
  if (!join.store.empty()) given.push_back("--store");
  if (given.empty()) {
    if (backend == "gloo") check_job_variables_pair();
    return;
  }
  const std::string flags = flag_list(given);
  const char* verb = given.size() == 1 ? "is" : "are";
  if (backend == "threads") {
    throw InvalidArgument(fmt::format(
        "{} {} for --backend gloo (joining a job as one of its ranks); --backend threads runs "
        "every rank in this process",
        flags, verb));
  }
  if (backend == "mpi") {
    throw InvalidArgument(fmt::format(
        "{} {} for --backend gloo (joining a job as one of its ranks); --backend mpi takes each "
        "process's rank and the world size from mpirun",
        flags, verb));
  }
  if (backend != "gloo") return;  // an unknown backend: the command's own check names it
  const std::optional<Known> rank = known(join.rank, "--rank", "RANK");
  const std::optional<Known> size = known_world_size(join);
  if (join.rank >= 0 && !size) {
    throw InvalidArgument(fmt::format(
        "--rank {} needs --world-size N (or WORLD_SIZE): the number of processes in the job",
        join.rank));
  }
  if (join.world_size >= 0 && !rank) {
    throw InvalidArgument(fmt::format(
        "--world-size {} needs --rank R (or RANK): this process's rank in the job, 0 to {}",
        join.world_size, join.world_size - 1));
  }
  if (!join.store.empty() && !(rank && size)) {
    // Name what is missing: with RANK set, "needs --rank and --world-size" read as if it was not.
    const std::string missing = rank   ? "--world-size (or WORLD_SIZE)"
                                : size ? "--rank (or RANK)"
                                       : "--rank and --world-size (or RANK and WORLD_SIZE)";
    throw InvalidArgument(
        fmt::format("--store {} needs {} to join a job; without them funcol starts the job "
                    "itself, with a store of its own",
                    join.store, missing));
  }
}

}  // namespace

void add_job_flags(CLI::App& command, JobFlags& flags) {
  command
      .add_option("--rank", flags.rank,
                  "with --backend gloo: join a job as this rank (0 to N-1) instead of starting "
                  "one; overrides RANK")
      ->type_name("R");
  command
      .add_option("--world-size", flags.world_size,
                  "with --backend gloo and --rank: the number of processes in the job (--ranks "
                  "defaults to it); overrides WORLD_SIZE")
      ->type_name("N");
  command
      .add_option("--store", flags.store,
                  "with --backend gloo and --rank: where the job's processes meet: a directory "
                  "every rank can reach (file:///dir is the same) or redis://host:port; "
                  "overrides FUNCOL_STORE")
      ->type_name("URL")
      ->check(given("a directory or redis://host:port"));
}

InitOptions parse_job_flags(const JobFlags& flags) {
  InitOptions o;
  if (const std::optional<int> r = flag_int(flags.rank, "--rank", 0)) o.rank = *r;
  if (const std::optional<int> n = flag_int(flags.world_size, "--world-size", 1)) {
    o.world_size = *n;
  }
  o.store = flags.store;
  return o;
}

bool inside_job(const std::string& backend, const InitOptions& join) {
  if (backend == "gloo") {
    return known(join.rank, "--rank", "RANK") &&
           known_world_size(join);
  }
  return backend == "mpi" && inside_job(backend);
}

std::optional<int> job_world_size(const std::string& backend, const InitOptions& join) {
  if (!inside_job(backend, join)) return std::nullopt;
  if (backend == "mpi") return process::env_int("OMPI_COMM_WORLD_SIZE");
  return known_world_size(join)->value;
}

namespace {

// For the error of a command that has no rank count: a job this process looks like a rank of,
// which `backend` does not join ("" when there is none).
std::string job_hint(const std::string& backend) {
  if (backend != "threads") return "";
  const std::string mpi_size = process::env_string("OMPI_COMM_WORLD_SIZE");
  if (!mpi_size.empty()) {
    return fmt::format(
        "; this process is a rank of an mpirun job (OMPI_COMM_WORLD_SIZE={}): pass --backend "
        "mpi to join it",
        mpi_size);
  }
  if (!process::env_string("RANK").empty() && !process::env_string("WORLD_SIZE").empty()) {
    return "; RANK and WORLD_SIZE are set: pass --backend gloo to join that job as rank RANK";
  }
  return "";
}

}  // namespace

int resolve_ranks(const std::string& backend, const InitOptions& join, std::optional<int> typed,
                  std::optional<int> fallback) {
  // Flags that do not fit the backend are the error to report, before any about --ranks.
  check_job_flags_fit(backend, join);
  if (typed) return *typed;
  if (const std::optional<int> n = job_world_size(backend, join)) return *n;
  if (fallback) return *fallback;
  throw InvalidArgument(fmt::format(
      "--ranks is required (the number of ranks), unless this process is a rank of an mpirun "
      "job or joins a gloo job as one rank with --rank and --world-size{}",
      job_hint(backend)));
}

void check_job_options(const std::string& backend, const InitOptions& join, int ranks) {
  check_job_flags_fit(backend, join);
  // Said once a process (the commands check their options again before the ranks start).
  static bool warned = false;
  const bool launches_here =
      backend == "threads" || (backend == "gloo" && !inside_job(backend, join));
  if (launches_here && !warned && !process::env_string("OMPI_COMM_WORLD_SIZE").empty()) {
    warned = true;
    std::fprintf(stderr,
                 "funcol: warning: this process is a rank of an mpirun job, but --backend %s %s "
                 "all %d ranks %s (each mpirun process runs a job of its own): pass --backend "
                 "mpi to run one rank a process\n",
                 backend.c_str(), backend == "threads" ? "runs" : "starts", ranks,
                 backend == "threads" ? "in it" : "itself");
  }
  if (backend == "threads" && ranks > kMaxLocalRanks) {
    throw InvalidArgument(fmt::format(
        "--ranks {}: the threads backend runs at most {} ranks (a thread each)", ranks,
        kMaxLocalRanks));
  }
  if (backend == "mpi") {
    // Inside mpirun, before MPI starts: the graph and sizes are checked against --ranks next.
    const std::optional<int> size = job_world_size(backend, join);
    if (size && *size != ranks) {
      const std::optional<int> rank = process::env_int("OMPI_COMM_WORLD_RANK");
      throw InvalidArgument(fmt::format("{}--ranks {} does not match the job's {} processes",
                                        rank ? fmt::format("rank {}: ", *rank) : "", ranks,
                                        *size));
    }
    return;
  }
  if (backend != "gloo") return;
  const std::optional<Known> rank = known(join.rank, "--rank", "RANK");
  const std::optional<Known> size = known_world_size(join);
  if (!rank || !size) return;  // not inside a job: the command starts one
  if (rank->value < 0 || rank->value >= size->value) {
    throw InvalidArgument(fmt::format("{} is out of range for {} (ranks 0 to {})", rank->said,
                                      size->said, size->value - 1));
  }
  if (ranks != size->value) {
    throw InvalidArgument(fmt::format("--ranks {} does not match {}", ranks, size->said));
  }
  const std::string store = join.store.empty() ? process::env_string("FUNCOL_STORE") : join.store;
  if (store.empty()) {
    if (size->value == 1) return;  // a job of one process meets nobody
    throw InvalidArgument(fmt::format(
        "rank {} of a gloo job of {} processes needs a store: --store DIR (a directory every "
        "rank can reach), file:///dir or redis://host:port, or FUNCOL_STORE",
        rank->value, size->value));
  }
  process::parse_store_url(store);  // "invalid store '...': ..." before the job is joined
}

[[noreturn]] void rethrow_for_rank(int rank) { rethrow_prefixed(fmt::format("rank {}: ", rank)); }

namespace {

// The message of the exception being handled.
std::string handled_error_text() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// For a rank that failed before joining (its error printed): joins the job only to leave it
// with `why`, which its peers' errors name within about a second.
void leave_job_with(const std::string& backend, const InitOptions& join,
                    const std::string& why) noexcept {
  try {
    std::shared_ptr<ProcessGroup> world = init_process_group(backend, join);
    set_departure_error(why);
    world.reset();
    destroy_process_group();
  } catch (...) {
    // Not joined (the peers never came, or the backend is not built in): the error printed is
    // this rank's answer, and its peers report it missing.
  }
}

}  // namespace

void note_departure_error() { set_departure_error(handled_error_text()); }

std::string error_line(const Error& e, const std::string& prefix) {
  const auto* at = dynamic_cast<const SourceLocated*>(&e);
  std::string message = at != nullptr ? at->message() : e.what();
  if (message.rfind(prefix, 0) != 0) message = prefix + message;
  if (at == nullptr) return "funcol: error: " + message;
  return SourceLocated(at->file(), at->line(), at->col(), message).located();
}

int print_command_error(std::FILE* err, const std::string& prefix) {
  try {
    throw;
  } catch (const Error& e) {
    std::fprintf(err, "%s\n", error_line(e, prefix).c_str());
  } catch (const std::bad_alloc&) {
    std::fprintf(err, "funcol: error: %sout of memory\n", prefix.c_str());
  } catch (const std::exception& e) {
    std::fprintf(err, "funcol: error: %s%s\n", prefix.c_str(), e.what());
  }
  std::fflush(err);
  return 1;
}

CLI::Validator decimal_integer(int64_t min, uint64_t max) {
  return CLI::Validator(
      [min, max](std::string& text) -> std::string {
        const bool negative = !text.empty() && text[0] == '-';
        const char* begin = text.data() + (negative ? 1 : 0);
        const char* end = text.data() + text.size();
        uint64_t magnitude = 0;
        const auto [ptr, ec] = std::from_chars(begin, end, magnitude);
        if (begin == end || ptr != end) return "expected a decimal integer, got " + text;
        // -min as unsigned: 2^63 for INT64_MIN, 0 for a non-negative min.
        const uint64_t most_negative = min < 0 ? uint64_t{0} - static_cast<uint64_t>(min) : 0;
        // Names the bound crossed only: "from -2147483648" would read as if --ranks took
        // negative counts.
        if (negative && (ec != std::errc() || magnitude > most_negative)) {
          return fmt::format("{} is out of range: the least is {}", text, min);
        }
        if (ec != std::errc() || (!negative && magnitude > max)) {
          return fmt::format("{} is out of range: the most is {}", text, max);
        }
        text = (negative && magnitude != 0 ? "-" : "") + std::to_string(magnitude);
        return {};
      },
      "");
}

CLI::Validator decimal_number() {
  return CLI::Validator(
      [](const std::string& text) -> std::string {
        double value = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (text.empty() || ptr != end || ec != std::errc()) {
          return "expected a number, got '" + text + "'";
        }
        return {};
      },
      "");
}

TraceFile::TraceFile(std::string path) : path_(std::move(path)) {
  if (path_.empty()) return;
  std::error_code ec;
  created_ = !std::filesystem::exists(path_, ec);
  errno = 0;
  std::ofstream f(path_, std::ios::binary | std::ios::app);
  if (!f) {
    throw InvalidArgument(fmt::format("cannot write trace file {}: {}", path_,
                                      errno != 0 ? std::strerror(errno) : "cannot open it"));
  }
}

TraceFile::~TraceFile() {
  if (!created_ || kept_) return;
  std::error_code ec;
  std::filesystem::remove(path_, ec);
}

void write_file(const std::string& path, const std::string& text, std::string_view what) {
  errno = 0;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (f) f << text;
  if (f) f.close();
  if (!f) {
    throw InvalidArgument(fmt::format("cannot write {} {}: {}", what, path,
                                      errno != 0 ? std::strerror(errno) : "write error"));
  }
}

CLI::Validator given(const std::string& what) {
  return CLI::Validator(
      [what](const std::string& text) {
        return text.empty() ? fmt::format("expected {}, got ''", what) : std::string();
      },
      "");
}

void add_seed_option(CLI::App& command, uint64_t& seed, const std::string& description) {
  // CLI11 alone saturates 2^64 and more to 2^64 - 1; one range for every value out of it.
  command.add_option("--seed", seed, description)
      ->transform(decimal_integer(0, std::numeric_limits<uint64_t>::max()))
      ->capture_default_str();
}

namespace {

// The ranks of a running job on this machine: all of them on the threads backend and in a gloo
// job funcol started; what the launcher says (OMPI_COMM_WORLD_LOCAL_SIZE, LOCAL_WORLD_SIZE),
// else this process's one.
int local_ranks(const std::string& backend, int ranks) {
  if (backend == "threads") return ranks;
  if (backend == "gloo" && std::getenv(kLauncherPidVar) != nullptr) return ranks;
  const std::optional<int> local =
      process::env_int(backend == "mpi" ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "LOCAL_WORLD_SIZE");
  return std::clamp(local.value_or(1), 1, std::max(ranks, 1));
}

}  // namespace

int ranks_on_this_machine(const std::string& backend, int ranks, const InitOptions& join) {
  // Outside a job funcol is about to start one, every rank of it on this machine.
  if (backend != "threads" && !inside_job(backend, join)) return ranks;
  return local_ranks(backend, ranks);
}

bool fits_in_memory(int ranks_here, double bytes_per_rank) {
  const uint64_t memory = detail::physical_memory_bytes();
  return memory == 0 || bytes_per_rank * ranks_here <= static_cast<double>(memory);
}

bool fits_in_memory(const std::string& backend, int ranks, double bytes_per_rank) {
  return fits_in_memory(local_ranks(backend, ranks), bytes_per_rank);
}

void check_backend_option(const std::string& backend) {
  if (backend != "threads" && backend != "mpi" && backend != "gloo") {
    throw InvalidArgument(fmt::format(
        "unknown backend '{}' for --backend: expected threads, mpi or gloo", backend));
  }
  const std::vector<std::string> available = available_backends();
  if (std::find(available.begin(), available.end(), backend) == available.end()) {
    throw InvalidArgument(fmt::format(
        "backend '{}' is not compiled into this build (configure with -DFUNCOL_WITH_{}=ON); "
        "available backends: {}",
        backend, backend == "mpi" ? "MPI" : "GLOO", fmt::join(available, ", ")));
  }
}

bool inside_job(const std::string& backend) {
  if (backend == "mpi") return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  return std::getenv("RANK") != nullptr && std::getenv("WORLD_SIZE") != nullptr;
}

void note_rank_exit(int status) {
  const char* dir = std::getenv(kMpiJobDirVar);
  // Only a rank of that job: mpirun set its rank, the launcher its directory.
  if (status == 0 || dir == nullptr || *dir == '\0' || !std::getenv("OMPI_COMM_WORLD_RANK")) {
    return;
  }
  const std::string path = fmt::format("{}/{}{}", dir, kRankFailedPrefix, getpid());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd >= 0) ::close(fd);
}

void check_launched_ranks(int ranks) {
  if (ranks > kMaxLaunchedRanks) {
    throw InvalidArgument(fmt::format(
        "--ranks {}: the launcher starts every rank as a process on this host, at most {} (to "
        "run more, start the ranks yourself on several hosts)",
        ranks, kMaxLaunchedRanks));
  }
}

int launch_job(const JobOptions& o, std::FILE* err) {
  FUNCOL_CHECK(o.backend == "mpi" || o.backend == "gloo", "launch_job: not a process backend");
  FUNCOL_CHECK(o.ranks >= 1 && o.rank_args, "launch_job: needs ranks and rank_args");
  check_launched_ranks(o.ranks);
  // What every rank reads from its environment, checked once here before any starts: a bad
  // value failed each rank instead (under mpi each printing it, under mpirun's banner).
  (void)default_timeout();
  (void)process::debug_detail();
  (void)detail::cache_limit_from(std::getenv("FUNCOL_ALLOC_CACHE_MB"));
  // Declared before the directory: a signal stops the ranks, then the directory is removed.
  InterruptScope interrupts;
  remove_abandoned_job_dirs();
  TempDir dir(o.temp_prefix);
  const JobDirClaim claim(dir.path());
  const std::vector<std::string> args = o.rank_args(dir.path());
  const std::string self = self_executable();
  if (o.backend == "mpi") return launch_mpi(o, dir.path(), self, args, err);
  return launch_gloo(o, dir.path(), self, args, err);
}

int run_as_rank(const std::string& backend, int ranks, const InitOptions& join, std::FILE* err,
                const std::function<void(ProcessGroup& world)>& body) {
  std::shared_ptr<ProcessGroup> world = init_process_group(backend, join);
  const int rank = world->rank();
  int status = 0;
  try {
    if (world->size() != ranks) {
      throw InvalidArgument(
          fmt::format("--ranks {} does not match the job's {} processes", ranks, world->size()));
    }
    body(*world);
  } catch (const Error& e) {
    std::fprintf(err, "%s\n", error_line(e, fmt::format("rank {}: ", rank)).c_str());
    std::fflush(err);
    note_departure_error();
    status = 1;
  }
  world.reset();
  destroy_process_group();
  return status;
}

bool rank_checks_pass(const std::string& backend, int ranks, const InitOptions& join,
                      std::FILE* err, const std::function<void()>& checks) {
  check_job_options(backend, join, ranks);
  try {
    checks();
    return true;
  } catch (...) {
    // The rank as the job will number it: --rank or RANK (gloo), mpirun's variable (mpi).
    std::optional<int> rank;
    if (backend == "mpi") {
      rank = process::env_int("OMPI_COMM_WORLD_RANK");
    } else if (const std::optional<Known> k = known(join.rank, "--rank", "RANK")) {
      rank = k->value;
    }
    print_command_error(err, rank ? fmt::format("rank {}: ", *rank) : "");
    leave_job_with(backend, join, handled_error_text());
    return false;
  }
}

void leave_job_after_parse_error(const std::vector<std::string>& args, const std::string& error) {
  // The joining flags as CLI11 reads them: "--name value" or "--name=value", the last one given.
  std::string backend = "threads";
  JobFlags flags;
  const std::pair<const char*, std::string*> names[] = {{"--backend", &backend},
                                                        {"--rank", &flags.rank},
                                                        {"--world-size", &flags.world_size},
                                                        {"--store", &flags.store}};
  for (size_t i = 0; i < args.size(); ++i) {
    for (const auto& [name, value] : names) {
      const std::string eq = std::string(name) + "=";
      if (args[i] == name && i + 1 < args.size()) {
        *value = args[i + 1];
      } else if (args[i].rfind(eq, 0) == 0) {
        *value = args[i].substr(eq.size());
      }
    }
  }
  if (backend != "gloo") return;  // mpirun ends the job when a rank exits with an error
  InitOptions join;
  try {
    join = parse_job_flags(flags);
    const std::optional<int> size = job_world_size(backend, join);
    if (!inside_job(backend, join) || !size) return;
    check_job_options(backend, join, *size);
  } catch (...) {
    return;  // flags that do not read: the error printed is this rank's answer
  }
  leave_job_with(backend, join, error);
}

void check_same_flags(ProcessGroup& world, const std::vector<std::string>& flags,
                      std::string_view which) {
  const std::vector<std::string> all =
      gather_strings(world, fmt::format("{}", fmt::join(flags, " ")));
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    throw InvalidArgument(fmt::format(
        "the ranks were started with different flags: rank 0 has '{}' but rank {} has '{}' "
        "(every rank of a job must pass the same {})",
        all[0], r, all[r], which));
  }
}

std::vector<std::string> gather_strings(ProcessGroup& world, const std::string& mine) {
  // Lengths first, then every string padded to the longest.
  const int n = world.size();
  Tensor len = Tensor::from_vector<int64_t>({static_cast<int64_t>(mine.size())});
  Tensor lens = Tensor::empty({n}, DType::I64);
  world.all_gather(lens, len)->wait();
  const std::vector<int64_t> sizes = lens.to_vector<int64_t>();
  const int64_t width = std::max<int64_t>(1, *std::max_element(sizes.begin(), sizes.end()));
  Tensor buf = Tensor::zeros({width}, DType::U8);
  std::memcpy(buf.data_ptr(), mine.data(), mine.size());
  Tensor all = Tensor::empty({n * width}, DType::U8);
  world.all_gather(all, buf)->wait();
  const auto* bytes = static_cast<const char*>(all.const_data_ptr());
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) out.emplace_back(bytes + r * width, static_cast<size_t>(sizes[r]));
  return out;
}

}  // namespace funcol::tools
