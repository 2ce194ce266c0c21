// End-to-end tests of `funcol run` as a user runs it: the built command on every backend that is
// compiled in, exit statuses, output lines and errors printed once.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
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
using funcol::tools::e2e::eventually;
using funcol::tools::e2e::slurp;

struct Result {
  int status = -1;
  std::string out;
  std::string err;
};


class RunE2E : public ::testing::Test {
 protected:
  TempDir dir_{"funcol-run-e2e-"};

  std::string write(const std::string& name, const std::string& text) {
    const std::string path = dir_.path() + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  // Runs `funcol run ARGS` with a bounded collective timeout, so a hang fails the test.
  Result run(const std::vector<std::string>& args) {
    SpawnOptions s;
    s.argv = {FUNCOL_BIN, "run"};
    s.argv.insert(s.argv.end(), args.begin(), args.end());
    s.env = {{"FUNCOL_TIMEOUT", "60"}};
    s.stdout_path = dir_.path() + "/stdout";
    s.stderr_path = dir_.path() + "/stderr";
    Result r;
    const ExitStatus st = wait_all({spawn_process(s)}).front();
    r.status = st.signaled ? -1 : st.code;
    r.out = slurp(s.stdout_path);
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
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const Result r = run({file, "--ranks", "2", "--backend", backend});
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err,
              "funcol: error: graph @g, node %ag (line 2): group_size 3 does not match group "
              "'world' of size 2\n");
    EXPECT_EQ(r.out, "");
  }
}

TEST_F(RunE2E, RuntimeErrorIsPrintedOnceWithItsRank) {
  const std::string file = write("view.ir", R"(graph @g(%x: f32[2,3]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[2,3]
  %w = wait_tensor(%ar) : f32[2,3]
  %t = transpose(%w) {dim0 = 0, dim1 = 1} : f32[3,2]
  %v = view(%t) {shape = [6]} : f32[6]
  return %v
}
)");
  for (const std::string& backend : backends()) {
    SCOPED_TRACE(backend);
    const Result r = run({file, "--ranks", "2", "--backend", backend});
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err.rfind("funcol: error: rank ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find("graph @g, node %v (line 5): "), std::string::npos) << r.err;
    if (backend != "mpi") {
      // mpirun adds its own report; threads and gloo print exactly one line.
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    }
  }
}

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

#ifdef FUNCOL_WITH_GLOO
// The child pids of `pid` (/proc/PID/task/PID/children).
std::vector<pid_t> children_of(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  std::vector<pid_t> out;
  pid_t c;
  while (f >> c) out.push_back(c);
  return out;
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
  const ExitStatus st = wait_all({launcher}, std::chrono::seconds(30)).front();
  EXPECT_FALSE(st.signaled);
  EXPECT_EQ(st.code, 128 + SIGTERM);
  for (pid_t r : ranks) EXPECT_TRUE(eventually([&] { return !alive(r); }, 30)) << r;
  EXPECT_TRUE(std::filesystem::is_empty(tmp));
  EXPECT_NE(slurp(s.stderr_path).find("interrupted by signal 15"), std::string::npos);
}
#endif

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

}  // namespace
}  // namespace funcol::tools
