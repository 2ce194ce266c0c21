// End-to-end tests of `funcol run` as a user runs it: the built command on every backend that is
// compiled in, exit statuses, output lines and errors printed once.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tools/e2e_util.h"
#include "tools/spawn.h"

#ifndef FUNCOL_BIN
#error "FUNCOL_BIN must name the funcol command"
#endif

namespace funcol::tools {
namespace {

using funcol::tools::e2e::alive;
using funcol::tools::e2e::children_of;
using funcol::tools::e2e::eventually;
using funcol::tools::e2e::process_state;
using funcol::tools::e2e::slurp;

struct Result {
  int status = -1;
  std::string out;
  std::string err;
};

// `pid` and what runs under it, one line a process ("PID STATE COMMAND"), indented by depth.
std::string process_tree(pid_t pid, int depth = 0) {
  std::string cmd = slurp("/proc/" + std::to_string(pid) + "/cmdline");
  std::replace(cmd.begin(), cmd.end(), '\0', ' ');
  const char state = process_state(pid);
  std::string out = std::string(2 * depth, ' ') + std::to_string(pid) + " " +
                    (state != '\0' ? state : '?') + " " + cmd + "\n";
  for (pid_t c : children_of(pid)) out += process_tree(c, depth + 1);
  return out;
}

// Waits up to `seconds` for the child `pid` (spawn_process: its own process group) and reaps
// it. Still running then: adds a test failure showing what runs under it, kills its process
// group and returns nullopt, so that a hang fails this test instead of ctest's whole run.
// (wait_all's duration is the grace between SIGTERM and SIGKILL, not a limit.)
std::optional<ExitStatus> wait_within(pid_t pid, int seconds) {
  if (!eventually([&] { return !alive(pid); }, seconds)) {
    ADD_FAILURE() << "still running after " << seconds << " s:\n" << process_tree(pid);
    kill(-pid, SIGKILL);
    wait_all({pid});
    return std::nullopt;
  }
  return wait_all({pid}).front();
}


class RunE2E : public ::testing::Test {
 protected:
  TempDir dir_{"funcol-run-e2e-"};

  std::string write(const std::string& name, const std::string& text) {
    const std::string path = dir_.path() + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  // Runs `funcol run ARGS` with a bounded collective timeout, so a hang fails the test. Its
  // stdout goes to `stdout_path` (a file of the test's directory when empty).
  // `env`: more variables for the command.
  Result run(const std::vector<std::string>& args, const std::string& stdout_path = "",
             const std::vector<std::pair<std::string, std::string>>& env = {}) {
    SpawnOptions s;
    s.argv = {FUNCOL_BIN, "run"};
    s.argv.insert(s.argv.end(), args.begin(), args.end());
    s.env = {{"FUNCOL_TIMEOUT", "60"}};
    s.env.insert(s.env.end(), env.begin(), env.end());
    s.stdout_path = stdout_path.empty() ? dir_.path() + "/stdout" : stdout_path;
    s.stderr_path = dir_.path() + "/stderr";
    Result r;
    const ExitStatus st = wait_all({spawn_process(s)}).front();
    r.status = st.signaled ? -1 : st.code;
    if (stdout_path.empty()) r.out = slurp(s.stdout_path);
    r.err = slurp(s.stderr_path);
    return r;
  }
};

// Integer data, so every backend computes the same bits.
const char* const kGraph = R"(graph @g(%x: i32[6], %y: i64[4]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : i32[6]
  %ag = all_gather_into_tensor(%y) {group_size = 4, group = "world"} : i64[16]
  %n = neg(%x) : i32[6]
  %w1 = wait_tensor(%ar) : i32[6]
  %w2 = wait_tensor(%ag) : i64[16]
  %tp = all_reduce(%w1) {reduce_op = "max", group = "tp"} : i32[6]
  %w3 = wait_tensor(%tp) : i32[6]
  %s = add(%w3, %n) : i32[6]
  return %s, %w2
}
)";

// Two ranks, integer data: the launcher's job and one started by hand print the same bits.
const char* const kGraph2 = R"(graph @g(%x: i32[6], %y: i64[4]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : i32[6]
  %ag = all_gather_into_tensor(%y) {group_size = 2, group = "world"} : i64[8]
  %n = neg(%x) : i32[6]
  %w1 = wait_tensor(%ar) : i32[6]
  %w2 = wait_tensor(%ag) : i64[8]
  %s = add(%w1, %n) : i32[6]
  return %s, %w2
}
)";

std::vector<std::string> backends() {
  std::vector<std::string> b = {"threads"};
  for (const std::string& p : e2e::process_backends()) b.push_back(p);
  return b;
}

// A mistyped --ranks is refused before any process starts, on every process backend.
TEST_F(RunE2E, TooManyProcessRanksAreRefusedAtOnce) {
  const std::string file = write("n.ir", "graph @n(%x: f32[2]) {\n  %y = neg(%x) : f32[2]\n"
                                        "  return %y\n}\n");
  for (const std::string& backend : e2e::process_backends()) {
    SCOPED_TRACE(backend);
    const Result r = run({file, "--ranks", "5000", "--backend", backend});
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("funcol: error: --ranks 5000: the launcher starts every rank as a "
                         "process on this host, at most 512"),
              std::string::npos)
        << r.err;
  }
}

TEST_F(RunE2E, EveryBackendPrintsTheSameLines) {
  const std::string file = write("g.ir", kGraph);
  std::string reference;
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const Result r = run({file, "--ranks", "4", "--mesh", "dp=2,tp=2", "--backend", backend,
                          "--outputs", "json", "--seed", "5", "--iters", "2"});
    ASSERT_EQ(r.status, 0) << r.err;
    std::istringstream in(r.out);
    std::string line;
    int rank = 0;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      EXPECT_EQ(j["rank"], rank++);
      EXPECT_EQ(j["outputs"].size(), 2u);
    }
    EXPECT_EQ(rank, 4);
    if (reference.empty()) {
      reference = r.out;
    } else {
      EXPECT_EQ(r.out, reference);
    }
  }
}

TEST_F(RunE2E, TraceFileFromEveryBackend) {
  const std::string file = write("g.ir", kGraph);
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const std::string trace = dir_.path() + "/" + backend + ".json";
    const Result r =
        run({file, "--ranks", "4", "--mesh", "dp=2,tp=2", "--backend", backend, "--trace", trace});
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = nlohmann::json::parse(slurp(trace));
    std::set<std::pair<int, int>> tracks;
    for (const auto& e : j["traceEvents"]) {
      if (e["ph"] == "X") tracks.insert({e["pid"].get<int>(), e["tid"].get<int>()});
    }
    EXPECT_EQ(tracks.size(), 8u);  // 4 ranks x {compute, communication}
  }
}

TEST_F(RunE2E, StaticErrorsArePrintedOnceBeforeAnyRankStarts) {
  const std::string file = write("bad.ir", R"(graph @g(%x: f32[2]) {
  %ag = all_gather_into_tensor(%x) {group_size = 3, group = "world"} : f32[6]
  return %ag
}
)");
  // Split sizes that differ between entries cannot match when every rank runs the graph: Gloo
  // aborted the rank that received 3 rows where it expected 1.
  const std::string splits = write("splits.ir", R"(graph @g(%x: f32[4]) {
  %a = all_to_all_single(%x) {output_split_sizes = [1, 3], input_split_sizes = [1, 3], group = "world"} : f32[4]
  %w = wait_tensor(%a) : f32[4]
  return %w
}
)");
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    Result r = run({file, "--ranks", "2", "--backend", backend});
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err, file +
                         ":2:3: error: graph @g, node %ag: group_size 3 does not match group "
                         "'world' of size 2\n");
    EXPECT_EQ(r.out, "");
    r = run({splits, "--ranks", "2", "--backend", backend});
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err, splits +
                         ":2:3: error: graph @g, node %a: mismatched split sizes (every rank runs "
                         "this graph): rank 0 sends 3 rows to rank 1 (input_split_sizes[1]) but "
                         "rank 1 expects 1 row from rank 0 (output_split_sizes[0]); split sizes "
                         "the same on every rank must all be equal\n");
    EXPECT_EQ(r.out, "");
  }
}

// Output that never arrives (a full disk) fails the run on every backend: under mpi the ranks'
// output goes through mpirun, which ignores a failed write.
// The reason is named also when the output is larger than stdio's buffer (the write, not the
// last flush, fails then, and stdio keeps only an error flag).
TEST_F(RunE2E, OutputThatCannotBeWrittenFailsTheRun) {
  const std::string small = write("g.ir", kGraph);
  const std::string large = write("large.ir", "graph @g() {\n"
                                              "  %x = zeros() {shape = [4096], dtype = f32}\n"
                                              "  %y = neg(%x)\n"
                                              "  return %y\n"
                                              "}\n");
  for (const std::string& backend : backends()) {
    for (const std::string& file : {small, large}) {
      SCOPED_TRACE(backend + " " + file);
      const Result r = run({file, "--ranks", "4", "--mesh", "dp=2,tp=2", "--backend", backend,
                            "--outputs", "json"},
                           "/dev/full");
      EXPECT_EQ(r.status, 1);
      EXPECT_NE(r.err.find("funcol: error: cannot write the output: No space left on device"),
                std::string::npos)
          << r.err;
    }
  }
}

// A reader that closes the output early (`| head`) fails the run with the same error on the
// process backends, and leaves nothing running: mpi's launcher died of SIGPIPE as it copied
// the ranks' output, which left its mpirun behind, hung, and its ranks printing that their
// launcher had died.
TEST_F(RunE2E, AReaderThatClosesTheOutputEarlyFailsTheRunAndLeavesNothingRunning) {
  // About 200 KB of JSON a rank: far more than a pipe holds.
  const std::string file = write("closed.ir", "graph @closed(%a: f32[4096], %b: f32[4096], "
                                              "%c: f32[4096], %d: f32[4096]) {\n"
                                              "  return %a, %b, %c, %d\n"
                                              "}\n");
  for (const std::string& backend : e2e::process_backends()) {
    SCOPED_TRACE(backend);
    const e2e::ShellResult r = e2e::run_shell(
        "{ (" + std::string(FUNCOL_BIN) + " run " + file + " --ranks 3 --outputs json " +
        "--backend " + backend + "; echo \"status $?\" >&2) | head -c 100; }");
    EXPECT_EQ(r.out.size(), 100u);
    EXPECT_NE(r.err.find("funcol: error: cannot write the output: Broken pipe\nstatus 1\n"),
              std::string::npos)
        << r.err;
    // Nothing of the job is left: no process has the graph's file among its arguments.
    std::vector<std::string> left;
    for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
      const std::string cmdline = slurp(entry.path().string() + "/cmdline");
      if (cmdline.find(file) != std::string::npos) left.push_back(entry.path().string());
    }
    EXPECT_TRUE(left.empty()) << left.front();
  }
}

// A bad value of what the ranks read from their environment is one error from the launcher,
// before any rank starts: under mpi every rank printed it, under mpirun's banner.
TEST_F(RunE2E, ABadRankEnvironmentIsOneErrorBeforeTheJob) {
  const std::string file = write("g.ir", kGraph);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"FUNCOL_DEBUG", "environment variable FUNCOL_DEBUG='xyz' is not one of OFF, INFO, DETAIL"},
      {"FUNCOL_ALLOC_CACHE_MB",
       "FUNCOL_ALLOC_CACHE_MB=xyz: expected a whole number of megabytes (0 or more)"}};
  for (const std::string& backend : e2e::process_backends()) {
    for (const auto& [name, message] : cases) {
      SCOPED_TRACE(backend + " " + name);
      const Result r = run({file, "--ranks", "4", "--mesh", "dp=2,tp=2", "--backend", backend},
                           "", {{name, "xyz"}});
      EXPECT_EQ(r.status, 1);
      EXPECT_EQ(r.err, "funcol: error: " + message + "\n");
      EXPECT_EQ(r.out, "");
    }
  }
}

// A file named like a flag, given after "--", is the file on every backend (the launched ranks
// get it after "--" too).
TEST_F(RunE2E, AFileNamedLikeAFlagIsTheFile) {
  write("-g.ir", kGraph);
  const std::filesystem::path before = std::filesystem::current_path();
  std::filesystem::current_path(dir_.path());
  std::string reference;
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const Result r = run({"--ranks", "4", "--mesh", "dp=2,tp=2", "--backend", backend,
                          "--outputs", "json", "--", "-g.ir"});
    EXPECT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 4) << r.out;
    if (reference.empty()) reference = r.out;
    EXPECT_EQ(r.out, reference);
  }
  std::filesystem::current_path(before);
}

// A run that fails leaves no trace file behind when it created it (the check that it can be
// written creates it before any rank starts); one that was there stays.
TEST_F(RunE2E, AFailedRunLeavesNoEmptyTraceFile) {
  const std::string file = write("div.ir", R"(graph @g(%x: i32[2]) {
  %z = zeros() {shape = [2], dtype = i32}
  %v = div(%x, %z)
  return %v
}
)");
  const std::string kept = write("kept.json", "{}");
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const std::string trace = dir_.path() + "/" + backend + ".json";
    Result r = run({file, "--ranks", "2", "--backend", backend, "--trace", trace});
    EXPECT_EQ(r.status, 1);
    EXPECT_FALSE(std::filesystem::exists(trace));
    r = run({file, "--ranks", "2", "--backend", backend, "--trace", kept});
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(slurp(kept), "{}");
  }
  const Result r = run({file, "--ranks", "2", "--trace", ""});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("--trace: expected a file name, got ''"), std::string::npos) << r.err;
}

#ifdef FUNCOL_WITH_MPI
// Inside a user's mpirun, --ranks that disagrees with -np is the error, not the graph's group
// sizes checked against the mistyped --ranks.
TEST_F(RunE2E, RanksThatDisagreeWithMpirunAreTheError) {
  const std::string file = write("ag.ir", R"(graph @g(%x: f32[2]) {
  %ag = all_gather_into_tensor(%x) {group_size = 2, group = "world"} : f32[4]
  %w = wait_tensor(%ag) : f32[4]
  return %w
}
)");
  const std::string mpirun =
      geteuid() == 0 ? "mpirun --allow-run-as-root" : "mpirun";  // as the launcher (launch.cc)
  const e2e::ShellResult bad = e2e::run_shell(mpirun + " -np 2 --oversubscribe " + FUNCOL_BIN +
                                              " run " + file + " --backend mpi --ranks 1");
  EXPECT_NE(bad.status, 0) << bad.err;
  EXPECT_NE(bad.err.find("funcol: error: rank 0: --ranks 1 does not match the job's 2 processes"),
            std::string::npos)
      << bad.err;
  EXPECT_EQ(bad.err.find("group_size"), std::string::npos) << bad.err;
  // Without --ranks the job's size is the number of ranks.
  const e2e::ShellResult good = e2e::run_shell(mpirun + " -np 2 --oversubscribe " + FUNCOL_BIN +
                                               " run " + file + " --backend mpi --outputs json");
  EXPECT_EQ(good.status, 0) << good.err;
  EXPECT_EQ(std::count(good.out.begin(), good.out.end(), '\n'), 2) << good.out;
  // FUNCOL_DEBUG=detail on one rank only: its signature exchange before each collective met the
  // other rank's data (rank 1 took rank 0's signature bytes as its result, rank 0 aborted).
  // Every rank now refuses the job at init, saying why.
  const std::string rank = std::string(FUNCOL_BIN) + " run " + file + " --backend mpi";
  const e2e::ShellResult mixed = e2e::run_shell(
      "FUNCOL_TIMEOUT=20 " + mpirun + " --oversubscribe -np 1 -x FUNCOL_DEBUG=detail " + rank +
      " : -np 1 -x FUNCOL_DEBUG= " + rank);
  EXPECT_NE(mixed.status, 0) << mixed.err;
  EXPECT_NE(mixed.err.find("funcol: error: mpi backend: rank 1 runs without FUNCOL_DEBUG=DETAIL "
                           "and this rank (rank 0) with it; every rank of a job must set the "
                           "same FUNCOL_DEBUG"),
            std::string::npos)
      << mixed.err;
  EXPECT_EQ(mixed.out, "");
}
#endif

TEST_F(RunE2E, RuntimeErrorIsPrintedOnceWithItsRank) {
  const std::string file = write("div.ir", R"(graph @g(%x: i32[2,3]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : i32[2,3]
  %w = wait_tensor(%ar) : i32[2,3]
  %z = zeros() {shape = [2, 3], dtype = i32}
  %v = div(%w, %z)
  return %v
}
)");
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const Result r = run({file, "--ranks", "2", "--backend", backend});
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err.rfind(file + ":5:3: error: rank ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(": graph @g, node %v: "), std::string::npos) << r.err;
    if (backend != "mpi") {
      // mpirun adds its own report; threads and gloo print exactly one line.
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    }
    // A rank said why: the launcher does not add that none did.
    EXPECT_EQ(r.err.find("before any rank reported"), std::string::npos) << r.err;
  }
}

// A kernel's error on one rank after its first collective (seed 2 gives rank 0 a zero divisor,
// rank 1 none): the rank still issues the run's later collective, failed, so on every backend
// the job ends at once naming the error, never at the timeout.
TEST_F(RunE2E, AKernelErrorOnOneRankMidRunEndsTheJobAtOnce) {
  const std::string file = write("mid.ir", R"(graph @g(%a: f32[4], %n: i32[40]) {
  %ag1 = all_gather_into_tensor(%a) {group_size = 2, group = "world"}
  %q = div(%n, %n)
  %ag2 = all_gather_into_tensor(%a) {group_size = 2, group = "world"}
  %w1 = wait_tensor(%ag1)
  %w2 = wait_tensor(%ag2)
  return %w1, %w2, %q
}
)");
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const auto start = std::chrono::steady_clock::now();
    const Result r = run({file, "--ranks", "2", "--seed", "2", "--backend", backend});
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("div: integer division by zero"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("timed out"), std::string::npos) << r.err;
  }
}

#ifdef FUNCOL_WITH_MPI
// mpirun sent SIGTERM (by a user, or a batch system that signals it alone) stops the ranks and
// exits with status 1 quietly; the launcher then says that the job ended before any rank
// reported an error, so the failure is never silent.
TEST_F(RunE2E, AnMpirunStoppedBySignalIsNotASilentFailure) {
  const std::string file = write("g.ir", kGraph);
  SpawnOptions s;
  s.argv = {FUNCOL_BIN,  "run",       file,  "--ranks", "4",        "--mesh",
            "dp=2,tp=2", "--backend", "mpi", "--iters", "100000000"};
  s.env = {{"FUNCOL_TIMEOUT", "60"}};
  s.stdout_path = dir_.path() + "/stdout";
  s.stderr_path = dir_.path() + "/stderr";
  const pid_t launcher = spawn_process(s);
  // The launcher's one child is mpirun, whose children are the 4 ranks.
  pid_t mpirun = 0;
  ASSERT_TRUE(eventually(
      [&] {
        const std::vector<pid_t> c = children_of(launcher);
        mpirun = c.empty() ? 0 : c.front();
        return mpirun != 0 && children_of(mpirun).size() == 4;
      },
      60))
      << slurp(s.stderr_path);
  kill(mpirun, SIGTERM);
  const std::optional<ExitStatus> st = wait_within(launcher, 60);
  ASSERT_TRUE(st);
  EXPECT_FALSE(st->signaled);
  EXPECT_EQ(st->code, 1);
  // Usually mpirun ends the job with status 1 and no word; Open MPI 4.1.4's mpirun, stopping
  // its ranks, now and then dies of SIGPIPE (1 run in about 30 here) or hangs once they ended:
  // the launcher then says that instead.
  const std::string err = slurp(s.stderr_path);
  EXPECT_TRUE(err.find("funcol: error: mpirun ended the job with exit status 1 before any rank "
                       "reported an error") != std::string::npos ||
              err.find("funcol: error: mpirun was killed by signal 13") != std::string::npos ||
              err.find("funcol: error: mpirun did not exit within") != std::string::npos)
      << err;
}

// An mpirun that outlives its ranks (Open MPI 4.1.4's can hang in PMIx_server_finalize after a
// failed job or a SIGTERM, its ranks left unreaped) is stopped 10 s after its last child ended,
// and the launcher says so: it waited forever. The stand-in, first in PATH, has a child that
// runs for a second and then stays a zombie, as that mpirun's ranks do.
TEST_F(RunE2E, AnMpirunThatOutlivesItsRanksIsStopped) {
  const std::string file = write("g.ir", kGraph);
  const std::string bin = dir_.path() + "/bin";
  std::filesystem::create_directory(bin);
  const std::string fake = write("bin/mpirun", "#!/bin/sh\nsleep 1 &\nexec sleep 600\n");
  std::filesystem::permissions(fake, std::filesystem::perms::owner_all);
  SpawnOptions s;
  s.argv = {FUNCOL_BIN, "run", file, "--ranks", "4", "--mesh", "dp=2,tp=2", "--backend", "mpi"};
  const char* path = std::getenv("PATH");
  s.env = {{"PATH", bin + ":" + (path != nullptr ? path : "/usr/bin:/bin")}};
  s.stdout_path = dir_.path() + "/stdout";
  s.stderr_path = dir_.path() + "/stderr";
  const auto start = std::chrono::steady_clock::now();
  const std::optional<ExitStatus> st = wait_within(spawn_process(s), 60);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(st);
  EXPECT_FALSE(st->signaled);
  EXPECT_EQ(st->code, 1);
  EXPECT_GE(took, 10.0);
  EXPECT_EQ(slurp(s.stderr_path),
            "funcol: error: mpirun did not exit within 10 s after its last rank ended (Open MPI "
            "4.1's mpirun can hang while finishing a job that failed or was stopped); stopped "
            "it\n");
}
#endif

TEST_F(RunE2E, BackendsNotCompiledInAreAClearError) {
  const std::string file = write("g.ir", kGraph);
  for (const char* backend : {"mpi", "gloo"}) {
    const auto b = backends();
    if (std::find(b.begin(), b.end(), backend) != b.end()) continue;
    const Result r = run({file, "--ranks", "2", "--backend", backend});
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err.rfind(std::string("funcol: error: backend '") + backend +
                              "' is not compiled into this build",
                          0),
              0u)
        << r.err;
  }
}

// A process that looks like a rank of a job (mpirun's variables, or RANK and WORLD_SIZE) but runs
// --backend threads is told which backend joins that job: the error without --ranks said "unless
// this process is a rank of an mpirun job" to a process that was one; with --ranks, each such
// process runs a whole job of its own, which a warning says.
TEST_F(RunE2E, ThreadsInsideAJobSaysWhichBackendJoinsIt) {
  const std::string file = write("g2.ir", kGraph2);
  const std::string e = "funcol: error: --ranks is required (the number of ranks), unless this "
                        "process is a rank of an mpirun job or joins a gloo job as one rank with "
                        "--rank and --world-size; ";
  struct Case {
    std::vector<std::pair<std::string, std::string>> env;
    std::vector<std::string> flags;
    int code;
    std::string err;  // the whole of stderr, or (code 0) its first line (once)
  };
  const std::vector<Case> cases = {
      {{{"OMPI_COMM_WORLD_SIZE", "2"}}, {}, 1,
       e + "this process is a rank of an mpirun job (OMPI_COMM_WORLD_SIZE=2): pass --backend mpi "
           "to join it\n"},
      {{{"RANK", "0"}, {"WORLD_SIZE", "2"}}, {}, 1,
       e + "RANK and WORLD_SIZE are set: pass --backend gloo to join that job as rank RANK\n"},
      {{{"OMPI_COMM_WORLD_SIZE", "2"}}, {"--ranks", "2"}, 0,
       "funcol: warning: this process is a rank of an mpirun job, but --backend threads runs all "
       "2 ranks in it (each mpirun process runs a job of its own): pass --backend mpi to run one "
       "rank a process"},
#ifdef FUNCOL_WITH_GLOO
      // The gloo launcher inside mpirun: each mpirun process started a gloo job of its own.
      {{{"OMPI_COMM_WORLD_SIZE", "2"}}, {"--ranks", "2", "--backend", "gloo"}, 0,
       "funcol: warning: this process is a rank of an mpirun job, but --backend gloo starts all "
       "2 ranks itself (each mpirun process runs a job of its own): pass --backend mpi to run "
       "one rank a process"},
#endif
  };
  for (const Case& c : cases) {
    SpawnOptions s;
    s.argv = {FUNCOL_BIN, "run", file};
    s.argv.insert(s.argv.end(), c.flags.begin(), c.flags.end());
    s.env = {{"RANK", ""}, {"WORLD_SIZE", ""}, {"OMPI_COMM_WORLD_SIZE", ""}};
    for (const auto& var : c.env) {
      std::erase_if(s.env, [&](const auto& kv) { return kv.first == var.first; });
      s.env.push_back(var);
    }
    SCOPED_TRACE(c.err);
    s.stdout_path = dir_.path() + "/stdout";
    s.stderr_path = dir_.path() + "/stderr";
    const ExitStatus st = wait_all({spawn_process(s)}, std::chrono::seconds(30)).front();
    EXPECT_FALSE(st.signaled);
    EXPECT_EQ(st.code, c.code);
    const std::string err = slurp(s.stderr_path);
    EXPECT_EQ(c.code == 0 ? err.substr(0, err.find('\n')) : err, c.err);
    if (c.code == 0) {
      EXPECT_EQ(err.find(c.err, 1), std::string::npos) << "said twice: " << err;
    }
  }
}

#ifdef FUNCOL_WITH_GLOO

// A relative TMPDIR is taken from the working directory: the launcher's store under it must be
// named absolutely (the job failed with "invalid store 'file://rel/funcol-run-.../store': the
// directory must be absolute", naming a store the user never gave).
TEST_F(RunE2E, ARelativeTmpdirIsTakenFromTheWorkingDirectory) {
  const std::string file = write("g2.ir", kGraph2);
  const std::string relative =
      std::filesystem::relative(dir_.path(), std::filesystem::current_path()).string();
  ASSERT_FALSE(relative.empty());
  ASSERT_NE(relative.front(), '/');
  const Result r = run({file, "--ranks", "2", "--backend", "gloo"}, "", {{"TMPDIR", relative}});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("2 ranks on gloo"), std::string::npos) << r.out;
}

// A launcher stopped by SIGTERM stops its ranks, removes its temporary directory and exits
// with 128 + 15; nothing is left running.
TEST_F(RunE2E, GlooLauncherStoppedBySignalLeavesNothingBehind) {
  const std::string file = write("g.ir", kGraph);
  const std::string tmp = dir_.path() + "/tmp";
  std::filesystem::create_directory(tmp);
  SpawnOptions s;
  s.argv = {FUNCOL_BIN,  "run",       file,   "--ranks", "4",        "--mesh",
            "dp=2,tp=2", "--backend", "gloo", "--iters", "100000000"};
  s.env = {{"TMPDIR", tmp}, {"FUNCOL_TIMEOUT", "60"}};
  s.stdout_path = dir_.path() + "/stdout";
  s.stderr_path = dir_.path() + "/stderr";
  const pid_t launcher = spawn_process(s);
  std::vector<pid_t> ranks;
  ASSERT_TRUE(eventually(
      [&] {
        ranks = children_of(launcher);
        return ranks.size() == 4;
      },
      30));
  kill(launcher, SIGTERM);
  const std::optional<ExitStatus> st = wait_within(launcher, 30);
  ASSERT_TRUE(st);
  EXPECT_FALSE(st->signaled);
  EXPECT_EQ(st->code, 128 + SIGTERM);
  for (pid_t r : ranks) EXPECT_TRUE(eventually([&] { return !alive(r); }, 30)) << r;
  EXPECT_TRUE(std::filesystem::is_empty(tmp));
  EXPECT_NE(slurp(s.stderr_path).find("interrupted by signal 15"), std::string::npos);
}

// The threads backend's ranks are this process's threads: a SIGINT or SIGTERM ends the run as
// the launchers end theirs (saying so, exit status 128 + the signal) and removes the trace file
// the run created. It used to die of the signal silently, leaving the trace file empty.
TEST_F(RunE2E, ThreadsRunStoppedBySignalSaysSoAndLeavesNoTrace) {
  const std::string file = write("g.ir", kGraph);
  for (int sig : {SIGINT, SIGTERM}) {
    SCOPED_TRACE(sig);
    const std::string trace = dir_.path() + "/t.json";
    SpawnOptions s;
    s.argv = {FUNCOL_BIN, "run",     file,      "--ranks", "4",  "--mesh",
              "dp=2,tp=2", "--iters", "100000000", "--trace", trace};
    s.stdout_path = dir_.path() + "/stdout";
    s.stderr_path = dir_.path() + "/stderr";
    const pid_t run = spawn_process(s);
    // The trace file exists once its check ran, just before the ranks start.
    ASSERT_TRUE(eventually([&] { return std::filesystem::exists(trace); }, 30));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kill(run, sig);
    const std::optional<ExitStatus> st = wait_within(run, 30);
    ASSERT_TRUE(st);
    EXPECT_FALSE(st->signaled);
    EXPECT_EQ(st->code, 128 + sig);
    EXPECT_FALSE(std::filesystem::exists(trace));
    EXPECT_NE(slurp(s.stderr_path)
                  .find(fmt::format("funcol: error: interrupted by signal {} ({}); stopped every "
                                    "rank\n",
                                    sig, strsignal(sig))),
              std::string::npos)
        << slurp(s.stderr_path);
  }
}

// A launcher killed with SIGKILL cannot remove its temporary directory; the next launcher on
// the machine does, and only that one: not the directory of a launcher that still runs, one
// without the launcher's name, one naming a process on another machine, or one that funcol
// did not name funcol-*.
TEST_F(RunE2E, TheNextLauncherRemovesTheDirectoryOfAKilledOne) {
  const std::string file = write("g.ir", kGraph);
  const std::string tmp = dir_.path() + "/tmp";
  std::filesystem::create_directory(tmp);
  // Starts a gloo job that runs until stopped; returns its launcher once its 4 ranks run.
  auto start_job = [&](const std::string& name) {
    SpawnOptions s;
    s.argv = {FUNCOL_BIN,  "run",       file,   "--ranks", "4",        "--mesh",
              "dp=2,tp=2", "--backend", "gloo", "--iters", "100000000"};
    s.env = {{"TMPDIR", tmp}, {"FUNCOL_TIMEOUT", "60"}};
    s.stdout_path = dir_.path() + "/" + name + ".out";
    s.stderr_path = dir_.path() + "/" + name + ".err";
    const pid_t launcher = spawn_process(s);
    EXPECT_TRUE(eventually([&] { return children_of(launcher).size() == 4; }, 30));
    return launcher;
  };
  auto job_dirs = [&] {
    std::set<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(tmp)) {
      names.insert(e.path().filename().string());
    }
    return names;
  };
  const pid_t running = start_job("running");
  const std::set<std::string> running_dir = job_dirs();
  ASSERT_EQ(running_dir.size(), 1u);
  const pid_t killed = start_job("killed");
  const std::vector<pid_t> killed_ranks = children_of(killed);
  kill(killed, SIGKILL);
  wait_all({killed});
  for (pid_t r : killed_ranks) ASSERT_TRUE(eventually([&] { return !alive(r); }, 30)) << r;
  std::set<std::string> left = job_dirs();
  ASSERT_EQ(left.size(), 2u);
  std::string abandoned;
  for (const std::string& d : left) {
    if (running_dir.count(d) == 0) abandoned = d;
  }
  const std::string owner = slurp(tmp + "/" + abandoned + "/.launcher");
  ASSERT_FALSE(owner.empty()) << "the launcher did not name itself in " << abandoned;
  // Directories the next launcher must keep.
  auto make = [&](const std::string& name, const std::string& launcher_file) {
    std::filesystem::create_directory(tmp + "/" + name);
    if (!launcher_file.empty()) std::ofstream(tmp + "/" + name + "/.launcher") << launcher_file;
  };
  make("funcol-run-unnamed", "");
  make("funcol-run-elsewhere", "another-host/boot/pid:[1]/1/1234/5678\n");
  make("not-funcol", owner);
  // A launcher's lock is what proves it runs, whatever its name says (another time namespace
  // shifts the start times /proc gives): this one names the killed launcher but is locked.
  make("funcol-run-locked", owner);
  const int lock = ::open((tmp + "/funcol-run-locked/.launcher").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(lock, 0);
  ASSERT_EQ(::flock(lock, LOCK_EX), 0);

  const Result next = run({file, "--ranks", "4", "--mesh", "dp=2,tp=2", "--backend", "gloo"},
                          "", {{"TMPDIR", tmp}});
  ASSERT_EQ(next.status, 0) << next.err;
  left = job_dirs();
  ::close(lock);
  EXPECT_EQ(left.count(abandoned), 0u) << abandoned << " of the killed launcher is still there";
  for (const std::string& keep :
       {*running_dir.begin(), std::string("funcol-run-unnamed"),
        std::string("funcol-run-elsewhere"), std::string("not-funcol"),
        std::string("funcol-run-locked")}) {
    EXPECT_EQ(left.count(keep), 1u) << keep << " was removed";
  }
  EXPECT_EQ(left.size(), 5u);
  kill(running, SIGTERM);
  const std::optional<ExitStatus> st = wait_within(running, 30);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->code, 128 + SIGTERM);
  EXPECT_EQ(job_dirs().count(*running_dir.begin()), 0u);
}

// ---- joining a gloo job as one rank: --rank, --world-size, --store ----


// The environment of a rank started by hand: none of the launcher's variables (empty is unset),
// so only the flags say which job it joins; a bounded collective timeout.
const std::vector<std::pair<std::string, std::string>> kHandEnv = {
    {"RANK", ""}, {"WORLD_SIZE", ""}, {"FUNCOL_STORE", ""}, {"FUNCOL_TIMEOUT", "60"}};

// DIR/rankR.EXT: where a rank started by a test writes its stdout or stderr.
std::string rank_file(const std::string& dir, int rank, const char* ext) {
  return dir + "/rank" + std::to_string(rank) + "." + ext;
}

// Starts the 2 processes of a gloo job, rank r with `funcol run rank_args(r)` and the
// environment `env` (in `cwd` when given), and waits for both: what each printed. When one
// fails the other is stopped (a launcher's behaviour), unless `let_finish`: then each ends on
// its own, and a test can check how every rank fails.
std::vector<Result> run_job_by_hand(const std::string& dir,
                                    const std::function<std::vector<std::string>(int)>& rank_args,
                                    const std::vector<std::pair<std::string, std::string>>& env,
                                    const std::string& cwd = "", bool let_finish = false) {
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    SpawnOptions s;
    s.argv = {FUNCOL_BIN, "run"};
    const std::vector<std::string> args = rank_args(r);
    s.argv.insert(s.argv.end(), args.begin(), args.end());
    if (!cwd.empty()) {
      // posix_spawn has no working directory: a shell changes it, then becomes the rank.
      std::string line = "cd '" + cwd + "' && exec";
      for (const std::string& a : s.argv) line += " '" + a + "'";
      s.argv = {"sh", "-c", line};
    }
    s.env = env;
    s.stdout_path = rank_file(dir, r, "out");
    s.stderr_path = rank_file(dir, r, "err");
    pids.push_back(spawn_process(s));
  }
  std::vector<ExitStatus> st;
  if (let_finish) {
    for (pid_t pid : pids) st.push_back(wait_all({pid}).front());
  } else {
    st = wait_all(pids, std::chrono::seconds(120));  // in the order the ranks ended
  }
  std::vector<Result> out(2);
  for (int r = 0; r < 2; ++r) {
    const ExitStatus& s = *std::find_if(st.begin(), st.end(),
                                        [&](const ExitStatus& e) { return e.pid == pids[r]; });
    out[r].status = s.signaled ? -1 : s.code;
    out[r].out = slurp(rank_file(dir, r, "out"));
    out[r].err = slurp(rank_file(dir, r, "err"));
  }
  return out;
}

// The flags of rank r of a 2-rank gloo job started by hand on `file`, meeting at `store`.
std::vector<std::string> hand_rank_args(const std::string& file, int r, const std::string& store,
                                        const std::vector<std::string>& run_flags) {
  std::vector<std::string> a = {file, "--backend",  "gloo", "--rank",  std::to_string(r),
                                "--world-size", "2", "--store", store};
  a.insert(a.end(), run_flags.begin(), run_flags.end());
  return a;
}

class RunJoinE2E : public RunE2E {
 protected:
  // Runs a 2-rank job by hand, each rank with --store `store` (and `env`, in `cwd`), and checks
  // that it prints what the launcher prints for the same run.
  void expect_same_as_launcher(const std::string& store,
                               const std::vector<std::pair<std::string, std::string>>& env,
                               const std::string& cwd = "") {
    const std::string file = write("g2.ir", kGraph2);
    const std::vector<std::string> run_flags = {"--outputs", "json", "--seed", "3", "--iters", "2"};
    std::vector<std::string> launched = {file, "--ranks", "2", "--backend", "gloo"};
    launched.insert(launched.end(), run_flags.begin(), run_flags.end());
    const Result reference = run(launched);
    ASSERT_EQ(reference.status, 0) << reference.err;
    ASSERT_EQ(std::count(reference.out.begin(), reference.out.end(), '\n'), 2) << reference.out;
    const std::vector<Result> ranks = run_job_by_hand(
        dir_.path(), [&](int r) { return hand_rank_args(file, r, store, run_flags); }, env, cwd);
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_EQ(ranks[r].status, 0) << ranks[r].err;
      EXPECT_EQ(ranks[r].err, "");
    }
    // Rank 0 prints every rank's line, as the launcher does; the other rank prints nothing.
    EXPECT_EQ(ranks[0].out, reference.out);
    EXPECT_EQ(ranks[1].out, "");
  }
};

TEST_F(RunJoinE2E, RanksStartedByHandWithAFileUrlStorePrintWhatTheLauncherPrints) {
  expect_same_as_launcher("file://" + dir_.path() + "/store", kHandEnv);
}

TEST_F(RunJoinE2E, ABareDirectoryIsAStore) {
  expect_same_as_launcher(dir_.path() + "/store", kHandEnv);
}

TEST_F(RunJoinE2E, ARelativeDirectoryIsAStoreUnderTheWorkingDirectory) {
  expect_same_as_launcher("st", kHandEnv, dir_.path());
  EXPECT_TRUE(std::filesystem::is_directory(dir_.path() + "/st"));
}

// The flags override RANK / WORLD_SIZE / FUNCOL_STORE: ranks whose environment names another
// job (a world of 3, a store that does not parse) join the one their flags name.
TEST_F(RunJoinE2E, FlagsOverrideTheEnvironment) {
  expect_same_as_launcher(
      dir_.path() + "/store",
      {{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"FUNCOL_STORE", "ftp://x"}, {"FUNCOL_TIMEOUT", "60"}});
}

// Ranks started by hand with different run flags: every rank fails with one line naming both
// sides, before the graph runs (a rank with fewer --iters used to meet its peers' collectives
// with the gathering of the reports, and gloo aborted; --outputs or --trace on one rank only
// printed or wrote part of the run, with exit 0).
TEST_F(RunJoinE2E, RanksWithDifferentRunFlagsFailCleanly) {
  const std::string file = write("g2.ir", kGraph2);
  const std::string trace = dir_.path() + "/t.json";
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"--iters", "1"}, {"--iters", "3"}},
      {{"--outputs", "json"}, {}},
      {{}, {"--trace", trace}},
      {{"--seed", "1"}, {"--seed", "2"}},
      {{"--mesh", "dp=2"}, {}},
  };
  int n = 0;
  for (const auto& flags : cases) {
    const std::string store = dir_.path() + "/store" + std::to_string(n++);
    const std::vector<Result> ranks = run_job_by_hand(
        dir_.path(),
        [&](int r) {
          return hand_rank_args(file, r, store, r == 0 ? flags.first : flags.second);
        },
        kHandEnv, "", /*let_finish=*/true);
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("case " + std::to_string(n) + ", rank " + std::to_string(r));
      EXPECT_EQ(ranks[r].status, 1) << ranks[r].err;
      EXPECT_EQ(ranks[r].out, "");
      EXPECT_NE(ranks[r].err.find("funcol: error: rank " + std::to_string(r) +
                                  ": the ranks were started with different flags: rank 0 has '"),
                std::string::npos)
          << ranks[r].err;
      EXPECT_NE(ranks[r].err.find("every rank of a job must pass the same --iters"),
                std::string::npos)
          << ranks[r].err;
      EXPECT_EQ(std::count(ranks[r].err.begin(), ranks[r].err.end(), '\n'), 1) << ranks[r].err;
    }
    EXPECT_NE(ranks[0].err.find("' but rank 1 has '"), std::string::npos) << ranks[0].err;
    EXPECT_FALSE(std::filesystem::exists(trace));
  }
}

// A rank that cannot run (its file missing, inputs beyond its machine's memory, a flag value
// only it was given) prints its error, then still joins the job and leaves it with that error:
// its peer fails at once naming it, instead of waiting at the rendezvous until the timeout
// (60 s here) and reporting the rank missing.
TEST_F(RunJoinE2E, ARankThatCannotRunFailsItsPeersAtOnceNamingWhy) {
  const std::string file = write("g2.ir", kGraph2);
  const std::string huge = write("huge.ir", R"(graph @g(%x: i32[1099511627776]) {
  return %x
}
)");
  const std::string missing = dir_.path() + "/missing.ir";
  struct Case {
    std::vector<std::string> rank1;  // rank 1's file and flags (rank 0 runs `file`)
    std::string error;               // rank 1's error, which rank 0's names
    bool parse = false;              // a command line that does not parse (CLI11's)
  };
  const std::vector<Case> cases = {
      {{missing}, "cannot read " + missing + ": No such file or directory"},
      {{huge}, "graph @g's inputs take 4398046511104 bytes per rank: more than this "
               "machine's memory holds for 1 rank on this machine"},
      {{file, "--iters", "0"}, "--iters must be at least 1, got 0"},
      // These waited out the timeout: the command line did not parse, so the rank never
      // reached its checks.
      {{file, "--seed", "abc"}, "--seed: expected a decimal integer, got abc", true},
      {{file, "--bogus"}, "the following argument was not expected: --bogus", true},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.error);
    const std::string store = dir_.path() + "/store-cannot-run" + std::to_string(n++);
    const auto start = std::chrono::steady_clock::now();
    const std::vector<Result> ranks = run_job_by_hand(
        dir_.path(),
        [&](int r) {
          std::vector<std::string> a =
              hand_rank_args(r == 0 ? file : c.rank1.front(), r, store, {});
          if (r == 1) a.insert(a.end(), c.rank1.begin() + 1, c.rank1.end());
          return a;
        },
        kHandEnv, "", /*let_finish=*/true);
    // Far under the 60 s timeout: the peer learned why at once.
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
    EXPECT_EQ(ranks[1].status, 1);
    EXPECT_EQ(ranks[1].err,
              c.parse ? "funcol: error: " + c.error +
                            "\nRun 'funcol run --help' for more information.\n"
                      : "funcol: error: rank 1: " + c.error + "\n");
    EXPECT_EQ(ranks[0].status, 1);
    EXPECT_EQ(ranks[0].out, "");
    EXPECT_NE(ranks[0].err.find("funcol: error: rank 0: "), std::string::npos) << ranks[0].err;
    EXPECT_NE(ranks[0].err.find("rank 1 departed after an error (" + c.error + ")"),
              std::string::npos)
        << ranks[0].err;
    EXPECT_EQ(std::count(ranks[0].err.begin(), ranks[0].err.end(), '\n'), 1) << ranks[0].err;
  }
}

// A rank that timed out exits as soon as it has printed its error. (Its Gloo call, which runs
// past the collective's deadline, held the exit 2.5 s longer: Gloo's own timeout ran 2 s past
// the deadline, and the worker then waited half a second to name a lost peer in a message it
// threw away.) Rank 1 is stopped (SIGSTOP) mid-run; rank 0 times out and exits.
TEST_F(RunJoinE2E, ARankThatTimedOutExitsRightAfterItsError) {
  const std::string file = write("forever.ir", R"(graph @forever(%x: f32[1024]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %w = wait_tensor(%ar)
  return %w
}
)");
  // Rank 1 is stopped `run_for` seconds after both started; on a loaded machine it may not have
  // joined by then (rank 0 then times out in the rendezvous): tried again, waiting longer.
  for (const int run_for : {1, 4, 10}) {
    SCOPED_TRACE("rank 1 stopped after " + std::to_string(run_for) + " s");
    const std::string store = dir_.path() + "/store-timeout-" + std::to_string(run_for);
    std::vector<pid_t> pids;
    for (int r = 0; r < 2; ++r) {
      SpawnOptions s;
      s.argv = {FUNCOL_BIN, "run"};
      for (const std::string& a : hand_rank_args(file, r, store, {"--iters", "1000000000"})) {
        s.argv.push_back(a);
      }
      s.env = kHandEnv;
      for (auto& [name, value] : s.env) {
        if (name == "FUNCOL_TIMEOUT") value = "2";
      }
      s.stdout_path = rank_file(dir_.path(), r, "out");
      s.stderr_path = rank_file(dir_.path(), r, "err");
      pids.push_back(spawn_process(s));
    }
    std::this_thread::sleep_for(std::chrono::seconds(run_for));
    ASSERT_TRUE(alive(pids[0]) && alive(pids[1])) << slurp(rank_file(dir_.path(), 0, "err"));
    ASSERT_EQ(kill(pids[1], SIGSTOP), 0);
    const std::string err0 = rank_file(dir_.path(), 0, "err");
    ASSERT_TRUE(eventually([&] { return !slurp(err0).empty(); }, 60));
    const auto printed = std::chrono::steady_clock::now();
    const std::optional<ExitStatus> st = wait_within(pids[0], 60);
    const auto exited = std::chrono::steady_clock::now();
    kill(pids[1], SIGKILL);
    wait_all({pids[1]});
    ASSERT_TRUE(st);
    EXPECT_EQ(st->code, 1);
    const std::string err = slurp(err0);
    if (err.find("ranks that did not arrive: [1]") != std::string::npos && run_for < 10) continue;
    EXPECT_NE(err.find("timed out after 2 s; missing ranks [1]"), std::string::npos) << err;
    EXPECT_LT(exited - printed, std::chrono::milliseconds(1000))
        << "rank 0 exited "
        << std::chrono::duration<double>(exited - printed).count() << " s after its error";
    break;
  }
}

// Flags that make no sense for the backend, or together, and a store that cannot be reached:
// one line, exit 1, before any rank joins anything.
TEST_F(RunJoinE2E, MisusedFlagsAreOneClearError) {
  const std::string file = write("g2.ir", kGraph2);
  const std::string store = dir_.path() + "/store";
  const std::string e = "funcol: error: ";
  const std::string gloo_only = " for --backend gloo (joining a job as one of its ranks); ";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--ranks", "2", "--store", store},
       e + "--store is" + gloo_only + "--backend threads runs every rank in this process\n"},
      {{"--backend", "threads", "--rank", "0", "--world-size", "2"},
       e + "--rank and --world-size are" + gloo_only +
           "--backend threads runs every rank in this process\n"},
      {{"--backend", "mpi", "--ranks", "2", "--rank", "0", "--world-size", "2", "--store", store},
       e + "--rank, --world-size and --store are" + gloo_only +
           "--backend mpi takes each process's rank and the world size from mpirun\n"},
      {{"--backend", "gloo", "--rank", "0"},
       e + "--rank 0 needs --world-size N (or WORLD_SIZE): the number of processes in the job\n"},
      {{"--backend", "gloo", "--world-size", "2", "--store", store},
       e + "--world-size 2 needs --rank R (or RANK): this process's rank in the job, 0 to 1\n"},
      {{"--backend", "gloo", "--ranks", "2", "--store", store},
       e + "--store " + store +
           " needs --rank and --world-size (or RANK and WORLD_SIZE) to join a job; without them "
           "funcol starts the job itself, with a store of its own\n"},
      {{"--backend", "gloo", "--rank", "2", "--world-size", "2", "--store", store},
       e + "--rank 2 is out of range for --world-size 2 (ranks 0 to 1)\n"},
      {{"--backend", "gloo", "--rank", "-1", "--world-size", "2", "--store", store},
       e + "--rank must be an integer of at least 0, got '-1'\n"},
      {{"--backend", "gloo", "--rank", "x", "--world-size", "2", "--store", store},
       e + "--rank must be an integer of at least 0, got 'x'\n"},
      {{"--backend", "gloo", "--rank", "0", "--world-size", "0", "--store", store},
       e + "--world-size must be an integer of at least 1, got '0'\n"},
      {{"--backend", "gloo", "--ranks", "3", "--rank", "0", "--world-size", "2", "--store", store},
       e + "--ranks 3 does not match --world-size 2\n"},
      {{"--backend", "gloo", "--rank", "0", "--world-size", "2"},
       e + "rank 0 of a gloo job of 2 processes needs a store: --store DIR (a directory every "
           "rank can reach), file:///dir or redis://host:port, or FUNCOL_STORE\n"},
      {{"--backend", "gloo", "--rank", "0", "--world-size", "2", "--store", "ftp://x"},
       e + "invalid store 'ftp://x': unknown scheme (expected a directory, file:///dir or "
           "redis://host:port)\n"},
      {{"--backend", "gloo"},
       e + "--ranks is required (the number of ranks), unless this process is a rank of an "
           "mpirun job or joins a gloo job as one rank with --rank and --world-size\n"},
      // (It said only "cannot resolve 'no-such-host.invalid'", not that the store's host.)
      {{"--backend", "gloo", "--rank", "0", "--world-size", "2", "--store",
        "redis://no-such-host.invalid:6379"},
       e + "gloo: cannot reach the store 'redis://no-such-host.invalid:6379' (its Redis server): "
           "cannot resolve 'no-such-host.invalid': "},
  };
  for (const auto& [flags, message] : cases) {
    SpawnOptions s;
    s.argv = {FUNCOL_BIN, "run", file};
    s.argv.insert(s.argv.end(), flags.begin(), flags.end());
    SCOPED_TRACE(testing::PrintToString(s.argv));
    s.env = kHandEnv;
    s.stdout_path = dir_.path() + "/stdout";
    s.stderr_path = dir_.path() + "/stderr";
    const ExitStatus st = wait_all({spawn_process(s)}, std::chrono::seconds(30)).front();
    EXPECT_FALSE(st.signaled);
    EXPECT_EQ(st.code, 1);
    const std::string err = slurp(s.stderr_path);
    if (message.back() == '\n') {
      EXPECT_EQ(err, message);
    } else {  // the resolver's own words follow
      EXPECT_EQ(err.rfind(message, 0), 0u) << err;
    }
    EXPECT_EQ(slurp(s.stdout_path), "");
  }
  // Half of a job's coordinates in the environment. With RANK set, --store names only the
  // missing world size (it said "needs --rank and --world-size (or RANK and WORLD_SIZE)"
  // although RANK was there); without flags, RANK or WORLD_SIZE alone is refused (funcol
  // started a job of its own and ignored it).
  struct HalfSet {
    std::string name, value;
    std::vector<std::string> flags;
    std::string message;
  };
  const std::vector<HalfSet> half_set = {
      {"RANK", "0", {"--store", store},
       e + "--store " + store + " needs --world-size (or WORLD_SIZE) to join a job; without them "
           "funcol starts the job itself, with a store of its own\n"},
      {"RANK", "1", {"--ranks", "2"},
       e + "RANK=1 is set but WORLD_SIZE is not: a rank joining a gloo job needs both (or --rank "
           "and --world-size); unset RANK to have funcol start the job itself\n"},
      {"WORLD_SIZE", "2", {},
       e + "WORLD_SIZE=2 is set but RANK is not: a rank joining a gloo job needs both (or --rank "
           "and --world-size); unset WORLD_SIZE to have funcol start the job itself\n"},
  };
  for (const HalfSet& c : half_set) {
    SpawnOptions s;
    s.argv = {FUNCOL_BIN, "run", file, "--backend", "gloo"};
    s.argv.insert(s.argv.end(), c.flags.begin(), c.flags.end());
    SCOPED_TRACE(c.name + "=" + c.value);
    for (const auto& [name, value] : kHandEnv) {
      s.env.emplace_back(name, name == c.name ? c.value : value);
    }
    s.stdout_path = dir_.path() + "/stdout";
    s.stderr_path = dir_.path() + "/stderr";
    const ExitStatus st = wait_all({spawn_process(s)}, std::chrono::seconds(30)).front();
    EXPECT_EQ(st.code, 1);
    EXPECT_EQ(slurp(s.stderr_path), c.message);
  }
  EXPECT_FALSE(std::filesystem::exists(store));  // nothing joined, nothing written
}

// A job's size from WORLD_SIZE is named as such when it is wrong, not as a --ranks never typed.
TEST_F(RunJoinE2E, ABadWorldSizeVariableIsNamed) {
  const std::string file = write("g2.ir", kGraph2);
  const std::string store = dir_.path() + "/store";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"-3", "funcol: error: WORLD_SIZE=-3: the world size must be at least 1\n"},
      {"0", "funcol: error: WORLD_SIZE=0: the world size must be at least 1\n"},
      {"99999999999", "funcol: error: environment variable WORLD_SIZE='99999999999' is out of "
                      "range (-2147483648 to 2147483647)\n"},
  };
  for (const auto& [size, message] : cases) {
    SpawnOptions s;
    s.argv = {FUNCOL_BIN, "run", file, "--backend", "gloo"};
    SCOPED_TRACE(size);
    s.env = {{"RANK", "0"}, {"WORLD_SIZE", size}, {"FUNCOL_STORE", store}};
    s.stdout_path = dir_.path() + "/stdout";
    s.stderr_path = dir_.path() + "/stderr";
    const ExitStatus st = wait_all({spawn_process(s)}, std::chrono::seconds(30)).front();
    EXPECT_EQ(st.code, 1);
    EXPECT_EQ(slurp(s.stderr_path), message);
  }
  EXPECT_FALSE(std::filesystem::exists(store));
}

// A FUNCOL_GLOO_HOSTNAME that does not resolve is an error naming it: Gloo's own lookup
// dereferenced the failed result (the rank died of SIGSEGV).
TEST_F(RunJoinE2E, AGlooHostNameThatDoesNotResolveIsAnError) {
  const std::string file = write("g2.ir", kGraph2);
  SpawnOptions s;
  s.argv = {FUNCOL_BIN, "run", file,           "--backend", "gloo",
            "--rank",   "0",  "--world-size", "2",         "--store",
            dir_.path() + "/store"};
  s.env = kHandEnv;
  s.env.emplace_back("FUNCOL_GLOO_HOSTNAME", "no-such-host.invalid");
  s.stdout_path = dir_.path() + "/stdout";
  s.stderr_path = dir_.path() + "/stderr";
  const ExitStatus st = wait_all({spawn_process(s)}, std::chrono::seconds(60)).front();
  EXPECT_FALSE(st.signaled) << st.code;
  EXPECT_EQ(st.code, 1);
  const std::string err = slurp(s.stderr_path);
  EXPECT_EQ(err.rfind("funcol: error: gloo: cannot create a TCP device on no-such-host.invalid: "
                      "the name does not resolve (",
                      0),
            0u)
      << err;
}
#endif

// A memory cgroup (v1 or v2) of `limit` bytes for the commands a test runs in it (prefix()),
// removed at the end. ok() is false where this machine lets the test make none (not root, no
// cgroup file system with the memory controller): the test then says so and skips.
class MemoryCgroup {
 public:
  explicit MemoryCgroup(const std::string& limit) {
    const std::string name = "/funcol-test-" + std::to_string(getpid());
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::is_directory("/sys/fs/cgroup/memory", ec)) {
      make("/sys/fs/cgroup/memory" + name, "memory.limit_in_bytes", limit);
    } else if (slurp("/sys/fs/cgroup/cgroup.subtree_control").find("memory") !=
               std::string::npos) {
      make("/sys/fs/cgroup" + name, "memory.max", limit);
    }
  }
  ~MemoryCgroup() {
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  bool ok() const { return !dir_.empty(); }
  std::string prefix() const { return "echo $$ > " + dir_ + "/cgroup.procs && exec "; }

 private:
  void make(const std::string& dir, const char* file, const std::string& limit) {
    if (mkdir(dir.c_str(), 0755) != 0) return;
    std::ofstream(dir + "/" + file) << limit;
    if (slurp(dir + "/" + file).empty()) {
      rmdir(dir.c_str());
      return;
    }
    dir_ = dir;
  }
  std::string dir_;
};

// In a container whose memory limit is below the machine's, the memory guards use the limit:
// a graph's inputs, a value it makes (refused before the run: it said "node %z: out of memory"
// once the run allocated it), `bench` buffers and a `train` model larger than it are errors,
// not an out-of-memory kill (exit 137) while they are written.
TEST_F(RunE2E, MemoryGuardsHonourTheContainersLimit) {
  const MemoryCgroup cgroup("300M");
  if (!cgroup.ok()) GTEST_SKIP() << "cannot make a memory cgroup here (needs root and cgroupfs)";
  const std::string made = write("made.ir", R"(graph @g() {
  %z = zeros() {shape = [1073741824], dtype = u8}
  %s = sum(%z) {dims = [0], keepdim = false}
  return %s
}
)");
  const std::string inputs = write("inputs.ir", "graph @g(%x: u8[1073741824]) {\n  return %x\n}\n");
  const std::string bin = std::string(FUNCOL_BIN);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {bin + " run " + made + " --ranks 1",
       "graph @g's inputs and its value %z (u8[1073741824]) take 1073741824 bytes per rank (0 of "
       "inputs, 1073741824 for %z, which exists beside them while the graph runs): more than "
       "this machine's memory holds for 1 rank in this process"},
      {bin + " run " + inputs + " --ranks 1",
       "graph @g's inputs take 1073741824 bytes per rank: more than this machine's memory"},
      {bin + " bench -b 1G -e 1G -n 1 -w 0 -c 0 -o all_reduce --ranks 1",
       "out of memory allocating 1073741824 bytes per rank"},
      {bin + " train --ranks 2 --layers 1 --hidden 8192 --batch 4096 --steps 1",
       "needs about 4.03 GB for the 2 ranks on this machine, more than its 0.31 GB; use a "
       "smaller model"},
  };
  for (const auto& [command, message] : cases) {
    SCOPED_TRACE(command);
    SpawnOptions s;
    s.argv = {"sh", "-c", cgroup.prefix() + command};
    s.env = {{"FUNCOL_TIMEOUT", "60"}};
    s.stdout_path = dir_.path() + "/stdout";
    s.stderr_path = dir_.path() + "/stderr";
    const ExitStatus st = wait_all({spawn_process(s)}).front();
    EXPECT_FALSE(st.signaled) << slurp(s.stderr_path);
    EXPECT_EQ(st.code, 1) << slurp(s.stderr_path);
    EXPECT_NE(slurp(s.stderr_path).find(message), std::string::npos) << slurp(s.stderr_path);
  }
}

TEST_F(RunE2E, ReadsStandardInput) {
  const std::string file = write("g.ir", kGraph);
  SpawnOptions s;
  s.argv = {"sh", "-c",
            std::string(FUNCOL_BIN) + " run - --ranks 4 --mesh dp=2,tp=2 --outputs json < " + file +
                " > " + dir_.path() + "/stdin.out"};
  ASSERT_TRUE(wait_all({spawn_process(s)}).front().ok());
  const Result r = run({file, "--ranks", "4", "--mesh", "dp=2,tp=2", "--outputs", "json"});
  EXPECT_EQ(slurp(dir_.path() + "/stdin.out"), r.out);
}

// A FILE that is not a regular file (a pipe: `<(...)`, /dev/stdin) runs on every backend. The
// process backends' ranks read FILE again; the launcher had drained the pipe (gloo: "the input
// holds none") and mpirun's ranks have no /dev/fd of it ("cannot read /dev/fd/63"). The same
// through /dev/stdin or /dev/fd/3 on a regular file: those name a regular file, which the ranks
// were sent to read again ("the input holds none" from /dev/stdin at its end, no /dev/fd/3).
TEST_F(RunE2E, ReadsAFileThatIsAPipeOnEveryBackend) {
  const std::string file = write("g.ir", kGraph);
  const Result want = run({file, "--ranks", "4", "--mesh", "dp=2,tp=2", "--outputs", "json"});
  ASSERT_EQ(want.status, 0) << want.err;
  const std::string link = dir_.path() + "/stdin-link";  // a link to /dev/stdin is one too
  std::filesystem::create_symlink("/dev/stdin", link);
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const std::string out = dir_.path() + "/pipe." + backend + ".out";
    SpawnOptions s;
    s.argv = {"sh", "-c",
              "cat " + file + " | FUNCOL_TIMEOUT=60 " + std::string(FUNCOL_BIN) +
                  " run /dev/stdin --ranks 4 --mesh dp=2,tp=2 --outputs json --backend " +
                  backend + " > " + out + " 2>&1"};
    EXPECT_TRUE(wait_all({spawn_process(s)}).front().ok()) << slurp(out);
    EXPECT_EQ(slurp(out), want.out);
    for (const std::string& redirect :
         std::vector<std::string>{"/dev/stdin < ", "/dev/fd/3 3< ", link + " < "}) {
      s.argv = {"sh", "-c",
                "FUNCOL_TIMEOUT=60 " + std::string(FUNCOL_BIN) + " run " + redirect + file +
                    " --ranks 4 --mesh dp=2,tp=2 --outputs json --backend " + backend + " > " +
                    out + " 2>&1"};
      SCOPED_TRACE(redirect);
      EXPECT_TRUE(wait_all({spawn_process(s)}).front().ok()) << slurp(out);
      EXPECT_EQ(slurp(out), want.out);
    }
  }
}

}  // namespace
}  // namespace funcol::tools
