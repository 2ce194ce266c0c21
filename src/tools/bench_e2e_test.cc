// End-to-end tests of `funcol bench`: the built command, its exit status, table, JSON and errors.
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dist/affinity.h"
#include "tools/e2e_util.h"
#include "tools/spawn.h"

#ifndef FUNCOL_BIN
#error "FUNCOL_BIN must name the funcol command"
#endif

namespace {

// How many CPUs this process may run on (the launcher's, when it measures the references).
int allowed_cpus() {
  return std::max(1, static_cast<int>(funcol::dist_detail::allowed_cpus().size()));
}

using funcol::tools::e2e::alive;
using funcol::tools::e2e::eventually;
using funcol::tools::e2e::process_backends;
using funcol::tools::e2e::slurp;

struct Result {
  int status = -1;  // exit status, or -1 when the command did not exit normally
  std::string out;  // stdout and stderr together
  std::string out_only;
};

// Runs `funcol bench ARGS`; both streams are kept apart and together.
Result bench(const std::string& args) {
  const funcol::tools::e2e::ShellResult sh =
      funcol::tools::e2e::run_shell(std::string(FUNCOL_BIN) + " bench " + args);
  return Result{sh.status, sh.out + sh.err, sh.out};
}

int count_rows(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != '#') ++rows;
  }
  return rows;
}

const char* const kColumns =
    "#       size         count      type    redop    root     time   algbw   busbw  #wrong   ratio";

TEST(BenchE2E, EveryOpChecksCleanAndPrintsTheColumns) {
  for (const char* op : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}) {
    for (const char* ranks : {"2", "3"}) {
      SCOPED_TRACE(std::string(op) + " ranks " + ranks);
      Result r = bench(std::string("-o ") + op + " --ranks " + ranks +
                       " -b 32 -e 64K -f 4 -n 3 -w 1 -c 1");
      EXPECT_EQ(r.status, 0) << r.out;
      EXPECT_NE(r.out.find(std::string("# funcol bench: op ") + op + ", backend threads, " + ranks +
                           " ranks"),
                std::string::npos)
          << r.out;
      EXPECT_NE(r.out.find(kColumns), std::string::npos) << r.out;
      EXPECT_NE(r.out.find("# memcpy reference: 2 threads, 1 MiB each, "), std::string::npos)
          << r.out;
      EXPECT_NE(r.out.find("# handoff reference: 2 threads, cache-line round trip "),
                std::string::npos)
          << r.out;
      EXPECT_NE(r.out.find("# Out of bounds values : 0 OK"), std::string::npos) << r.out;
      EXPECT_NE(r.out.find("# Avg bus bandwidth    : "), std::string::npos) << r.out;
      EXPECT_EQ(count_rows(r.out_only), 6) << r.out;  // 32 128 512 2K 8K 32K
    }
  }
}

TEST(BenchE2E, DemoFlagsParse) {
  // The Makefile's demo line with smaller sizes: -b 4K -e 16M -f 4 -n 20 -w 5 -c 1.
  Result r = bench("--ranks 2 -b 4K -e 64K -f 4 -n 20 -w 5 -c 1");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("minBytes 4096 maxBytes 65536 step: 4(factor) warmup iters: 5 iters: 20"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(count_rows(r.out_only), 5 * 3) << r.out;  // 5 ops x (4K 16K 64K)
}

TEST(BenchE2E, JsonIsOneObjectPerSize) {
  Result r = bench("-o reduce_scatter -r max -d bf16 --ranks 2 -b 1K -e 4K --json");
  ASSERT_EQ(r.status, 0) << r.out;
  std::istringstream in(r.out_only);
  std::string line;
  std::vector<int64_t> sizes;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);  // throws (fails) on anything but JSON
    EXPECT_EQ(j["op"], "reduce_scatter");
    EXPECT_EQ(j["type"], "bf16");
    EXPECT_EQ(j["redop"], "max");
    EXPECT_EQ(j["wrong"], 0);
    EXPECT_GT(j["time_us"].get<double>(), 0);
    EXPECT_DOUBLE_EQ(j["busbw"].get<double>(), j["algbw"].get<double>() * 0.5);
    EXPECT_GT(j["memcpy_gbps"].get<double>(), 0);
    EXPECT_GT(j["handoff_ns"].get<double>(), 0);
    sizes.push_back(j["size"].get<int64_t>());
  }
  EXPECT_EQ(sizes, (std::vector<int64_t>{1024, 2048, 4096}));
}

TEST(BenchE2E, AWrongValueFailsTheRun) {
  Result r = bench("-o all_gather --ranks 2 -b 64 -e 256 --inject-wrong");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("# Out of bounds values : 3 FAILED"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("# Avg bus bandwidth    : "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("funcol: error: bench: 3 wrong values"), std::string::npos) << r.out;
  // The table is complete: every row printed, each with one wrong value.
  EXPECT_EQ(count_rows(r.out_only), 3) << r.out;
  Result json = bench("-o all_reduce --ranks 3 -b 64 -e 64 --inject-wrong --json");
  EXPECT_EQ(json.status, 1) << json.out;
  EXPECT_NE(json.out_only.find("\"wrong\": 1"), std::string::npos) << json.out;
}

// Sizes are made one at a time: -f 1 -i 1 -e 1G (a billion rows, as nccl-tests runs them) prints
// its first rows at once. It listed every size first: 8 GB before the header, under a 4 GB
// limit an "out of memory" error about buffers that fit.
TEST(BenchE2E, AStepOfOneByteStartsAtOnce) {
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "an AddressSanitizer build cannot run under ulimit -v (its shadow memory "
                  "reserves terabytes of address space)";
#endif
  const funcol::tools::e2e::ShellResult r = funcol::tools::e2e::run_shell(
      std::string("ulimit -v 4000000; timeout 10 ") + FUNCOL_BIN +
      " bench -o broadcast -b 0 -e 1G -f 1 -i 1 -n 1 -w 0 -c 0 | head -n 40");
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("# minBytes 0 maxBytes 1073741824 step: 1(bytes)"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\n           4             1       f32     none       0"),
            std::string::npos)
      << r.out;
}

// --root serves broadcast only, as nccl-tests' -r: with no broadcast among the ops it is not
// checked (it failed the run) and the header says "root none", as "redop none".
TEST(BenchE2E, RootIsOnlyBroadcasts) {
  Result r = bench("-o all_reduce --root 5 --ranks 2 -b 4 -e 4 -n 1 -w 0 -c 1");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out_only.find(", 2 ranks, dtype f32, redop sum, root none\n"), std::string::npos)
      << r.out;
  r = bench("-o all_reduce --root -1 --ranks 2 -b 4 -e 4 -n 1 -w 0 -c 1");
  EXPECT_EQ(r.status, 0) << r.out;
  r = bench("-o broadcast --root 5 --ranks 2 -b 4 -e 4 -n 1 -w 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("funcol: error: --root 5 is out of range for 2 ranks"), std::string::npos)
      << r.out;
  r = bench("-o broadcast --root -1 --ranks 2 -b 4 -e 4 -n 1 -w 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("funcol: error: --root -1 is out of range for 2 ranks"), std::string::npos)
      << r.out;
}

// Threads confined to one CPU: the binding line says "1 CPU", not "1 CPUs".
TEST(BenchE2E, OneAllowedCpuIsSingular) {
  const std::vector<int> cpus = funcol::dist_detail::allowed_cpus();
  ASSERT_FALSE(cpus.empty());
  const funcol::tools::e2e::ShellResult r = funcol::tools::e2e::run_shell(
      "taskset -c " + std::to_string(cpus.front()) + " " + FUNCOL_BIN +
      " bench -o all_reduce --ranks 2 -b 4 -e 4 -n 1 -w 0");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("; rank threads unbound (2 ranks, 1 CPU)\n"), std::string::npos) << r.out;
}

TEST(BenchE2E, BadFlagValuesExitOneWithAClearMessage) {
  struct Case {
    const char* args;
    const char* message;
  };
  const Case cases[] = {
      {"-b 4X", "funcol: error: invalid size '4X' for -b/--minbytes"},
      {"-e 1.5M", "funcol: error: invalid size '1.5M' for -e/--maxbytes"},
      {"-o allreduce", "funcol: error: unknown op 'allreduce' for -o/--op"},
      {"--backend nccl",
       "funcol: error: unknown backend 'nccl' for --backend: available backends: "},
      {"-d float8", "funcol: error: unknown dtype 'float8' for -d/--datatype"},
      {"-r mean", "funcol: error: unknown reduce op 'mean' for -r/--redop"},
      {"-n 0", "funcol: error: invalid value '0' for -n/--iters"},
      {"-b 1M -e 1K", "funcol: error: -b/--minbytes (1048576) is larger than -e/--maxbytes (1024)"},
      {"--root 2 --ranks 2", "funcol: error: --root 2 is out of range for 2 ranks"},
      {"-o all_reduce -r bxor -d f32", "funcol: error: "},
      // What the option parser refuses reads the same.
      {"-n abc", "funcol: error: invalid value 'abc' for -n/--iters: expected an integer"},
      {"-o", "funcol: error: --op: 1 required OP missing\nRun 'funcol bench --help'"},
      {"--frobnicate", "funcol: error: the following argument was not expected: --frobnicate"},
      // The hidden flag that carries the launcher's references to a job's ranks.
      {"--references 1048576:5:10:2", "funcol: error: --references '1048576:5:10:2': expected "
                                      "BYTES:GBPS_PER_THREAD:GBPS_TOTAL:CPUS:HANDOFF_NS"},
      {"--references 1048576:5:10:3:0", "funcol: error: --references '1048576:5:10:3:0'"},
      {"--references 1048576:-5:10:2:0", "funcol: error: --references '1048576:-5:10:2:0'"},
      {"--references 1M:5:10:2:0", "funcol: error: --references '1M:5:10:2:0'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    Result r = bench(c.args);
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find(c.message), std::string::npos) << r.out;
    EXPECT_EQ(r.out_only, "") << "errors go to stderr, before any table";
  }
  Result r = bench("--backend nccl");
  EXPECT_NE(r.out.find("threads"), std::string::npos) << r.out;
}

// A bad FUNCOL_TIMEOUT is refused before the references run and the header prints (the first
// collective read it, after both).
TEST(BenchE2E, ABadTimeoutFailsBeforeAnythingPrints) {
  const funcol::tools::e2e::ShellResult sh = funcol::tools::e2e::run_shell(
      std::string("FUNCOL_TIMEOUT=abc ") + FUNCOL_BIN + " bench -o all_reduce -b 4K -e 4K");
  EXPECT_EQ(sh.status, 1);
  EXPECT_EQ(sh.out, "");
  EXPECT_EQ(sh.err, "funcol: error: FUNCOL_TIMEOUT=abc: expected a positive number of seconds\n");
}

// ---- process backends: funcol bench starts the job itself (mpirun, or gloo processes) ----

// A bounded collective timeout for the ranks the commands below start, so a hang fails.
class BenchProcessE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("FUNCOL_TIMEOUT", "60", 1);
    if (process_backends().empty()) GTEST_SKIP() << "no process backend compiled in";
  }
};

TEST_F(BenchProcessE2E, EveryOpChecksCleanOnTwoProcesses) {
  for (const std::string& backend : process_backends()) {
    SCOPED_TRACE(backend);
    Result r = bench("--backend " + backend + " --ranks 2 -b 32 -e 8K -f 16 -n 3 -w 1 -c 1");
    EXPECT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out_only.find("# funcol bench: op all (all_reduce, all_gather, reduce_scatter, "
                              "all_to_all, broadcast), backend " +
                              backend + ", 2 ranks, dtype f32, redop sum, root 0"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out_only.find(kColumns), std::string::npos) << r.out;
    // Printed once, by rank 0's process; measured by the launcher before the job started, on
    // its CPUs (mpirun binds each rank to one CPU: rank 0's own figures were about halved).
    EXPECT_NE(r.out_only.find("# memcpy reference: 2 threads, 1 MiB each, "), std::string::npos)
        << r.out;
    // On one CPU the line also says the references understate the host.
    EXPECT_NE(r.out_only.find(std::string("# binding: reference threads ") +
                              (allowed_cpus() >= 2
                                   ? "one per CPU, measured by funcol bench before it started "
                                     "the job"
                                   : "unbound (1 CPU), measured by funcol bench before it "
                                     "started the job: both threads shared one CPU, so they "
                                     "understate this host") +
                              "; rank threads processes of the job\n"),
              std::string::npos)
        << r.out;
    EXPECT_EQ(r.out_only.find("# memcpy reference"), r.out_only.rfind("# memcpy reference"))
        << r.out;
    EXPECT_NE(r.out_only.find("# Out of bounds values : 0 OK"), std::string::npos) << r.out;
    EXPECT_EQ(count_rows(r.out_only), 5 * 3) << r.out;  // 5 ops x (32 512 8K)
  }
}

// Started with stdout closed, every backend fails the run (the output cannot arrive): under mpi
// the launcher's own files and pipe took descriptor 1, the ranks' output went into them, and
// the run "succeeded".
TEST_F(BenchProcessE2E, AClosedStdoutFailsTheRunOnEveryBackend) {
  std::vector<std::string> backends = process_backends();
  backends.insert(backends.begin(), "threads");
  for (const std::string& backend : backends) {
    SCOPED_TRACE(backend);
    const funcol::tools::e2e::ShellResult sh = funcol::tools::e2e::run_shell(
        std::string(FUNCOL_BIN) + " bench --backend " + backend +
        " --ranks 2 -o all_reduce -b 4K -e 4K -n 2 -w 1 >&-");
    EXPECT_EQ(sh.status, 1) << sh.err;
    EXPECT_NE(sh.err.find("funcol: error: cannot write the output: "), std::string::npos)
        << sh.err;
  }
}

// Too many processes to launch is the error, not the memory a job that size would need (the
// default -e of 32 MiB on 513 ranks).
TEST_F(BenchProcessE2E, TooManyLaunchedRanksIsTheErrorNamed) {
  for (const std::string& backend : process_backends()) {
    SCOPED_TRACE(backend);
    Result r = bench("--backend " + backend + " --ranks 513");
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.out.find("funcol: error: --ranks 513: the launcher starts every rank as a "
                         "process on this host, at most 512"),
              std::string::npos)
        << r.out;
  }
}

TEST_F(BenchProcessE2E, JsonNamesTheBackend) {
  for (const std::string& backend : process_backends()) {
    SCOPED_TRACE(backend);
    Result r = bench("--backend " + backend +
                     " -o all_to_all -d i32 --ranks 2 -b 1K -e 4K -n 2 -w 1 -c 1 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    std::istringstream in(r.out_only);
    std::string line;
    std::vector<int64_t> sizes;
    while (std::getline(in, line)) {
      nlohmann::json j = nlohmann::json::parse(line);
      EXPECT_EQ(j["op"], "all_to_all");
      EXPECT_EQ(j["backend"], backend);
      EXPECT_EQ(j["ranks"], 2);
      EXPECT_EQ(j["type"], "i32");
      EXPECT_EQ(j["wrong"], 0);
      EXPECT_GT(j["time_us"].get<double>(), 0);
      EXPECT_GT(j["memcpy_gbps"].get<double>(), 0);
      EXPECT_EQ(j["memcpy_cpus"], allowed_cpus() >= 2 ? 2 : 1);
      sizes.push_back(j["size"].get<int64_t>());
    }
    EXPECT_EQ(sizes, (std::vector<int64_t>{1024, 2048, 4096}));
  }
}

// --in-place travels to the ranks, and each backend gathers into (reduces from) the buffer
// its input (output) is a block of: mpi passes MPI_IN_PLACE or a private copy, gloo its own.
TEST_F(BenchProcessE2E, InPlaceChecksCleanOnThreeProcesses) {
  for (const std::string& backend : process_backends()) {
    SCOPED_TRACE(backend);
    for (const char* op : {"all_gather", "reduce_scatter"}) {
      Result r = bench("--backend " + backend + " -o " + op +
                       " --in-place --ranks 3 -b 24 -e 40344 -f 41 -n 2 -w 1 -c 2 --json");
      ASSERT_EQ(r.status, 0) << r.out;
      std::istringstream in(r.out_only);
      std::string line;
      int rows = 0;
      while (std::getline(in, line)) {
        nlohmann::json j = nlohmann::json::parse(line);
        EXPECT_EQ(j["op"], op);
        EXPECT_EQ(j["in_place"], true);
        EXPECT_EQ(j["wrong"], 0);
        ++rows;
      }
      EXPECT_EQ(rows, 3);
    }
  }
}

TEST_F(BenchProcessE2E, AWrongValueFailsTheRun) {
  for (const std::string& backend : process_backends()) {
    SCOPED_TRACE(backend);
    Result r = bench("--backend " + backend +
                     " -o reduce_scatter --ranks 2 -b 64 -e 256 -n 2 -w 1 --inject-wrong");
    EXPECT_NE(r.status, 0) << r.out;
    EXPECT_NE(r.out_only.find("# Out of bounds values : 3 FAILED"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("funcol: error: bench: 3 wrong values"), std::string::npos) << r.out;
    EXPECT_EQ(count_rows(r.out_only), 3) << r.out;
  }
}

TEST_F(BenchProcessE2E, ARankErrorIsPrintedWithItsRank) {
  // 1000000 GiB per rank (more than any machine) is refused before the job starts: one error,
  // no rank's (each rank used to start, join and refuse it at its first size).
  for (const std::string& backend : process_backends()) {
    SCOPED_TRACE(backend);
    Result r = bench("--backend " + backend +
                     " -o all_reduce --ranks 2 -b 1000000G -e 1000000G -n 1 -w 0");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_EQ(r.out.rfind("funcol: error: out of memory allocating ", 0), 0u) << r.out;
    EXPECT_EQ(r.out.find("error: rank "), std::string::npos) << r.out;
  }
#ifdef FUNCOL_WITH_MPI
  // An error inside a rank of the job names the rank: --ranks that disagrees with mpirun's -np.
  const std::string mpirun =
      geteuid() == 0 ? "mpirun --allow-run-as-root" : "mpirun";  // as the launcher (launch.cc)
  const funcol::tools::e2e::ShellResult sh = funcol::tools::e2e::run_shell(
      mpirun + " -np 2 --oversubscribe " + FUNCOL_BIN +
      " bench --backend mpi --ranks 3 -o all_reduce -b 8 -e 8 -n 1 -w 0");
  EXPECT_NE(sh.status, 0) << sh.err;
  EXPECT_NE(sh.err.find("funcol: error: rank 0: --ranks 3 does not match the job's 2 processes"),
            std::string::npos)
      << sh.err;
#endif
}

#ifdef FUNCOL_WITH_MPI
// Ranks started by the user's own mpirun measure the references in rank 0, which mpirun bound to
// one CPU: the binding line says so, and JSON gives memcpy_cpus 1. Given references (the hidden
// flag the launcher passes) are printed as given.
TEST_F(BenchProcessE2E, RanksOfAUsersMpirunSayWhereTheReferencesRan) {
  if (allowed_cpus() < 2) GTEST_SKIP() << "needs 2 CPUs (mpirun binds each rank to one of them)";
  const std::string mpirun = std::string(geteuid() == 0 ? "mpirun --allow-run-as-root" : "mpirun") +
                             " -np 2 --bind-to core " + FUNCOL_BIN +
                             " bench --backend mpi --ranks 2 -o all_reduce -b 4K -e 4K -n 2 -w 1";
  funcol::tools::e2e::ShellResult sh = funcol::tools::e2e::run_shell(mpirun);
  ASSERT_EQ(sh.status, 0) << sh.out << sh.err;
  EXPECT_NE(sh.out.find("# binding: reference threads unbound (1 CPU): both threads shared one "
                        "CPU, so they understate this host; rank threads processes of the job\n"),
            std::string::npos)
      << sh.out;
  sh = funcol::tools::e2e::run_shell(mpirun + " --json");
  ASSERT_EQ(sh.status, 0) << sh.out << sh.err;
  EXPECT_EQ(nlohmann::json::parse(sh.out.substr(0, sh.out.find('\n')))["memcpy_cpus"], 1)
      << sh.out;

  sh = funcol::tools::e2e::run_shell(mpirun + " --references 1048576:3.5:7.25:2:123");
  ASSERT_EQ(sh.status, 0) << sh.out << sh.err;
  EXPECT_NE(sh.out.find("# binding: reference threads one per CPU, measured by funcol bench "
                        "before it started the job; rank threads processes of the job\n"
                        "# memcpy reference: 2 threads, 1 MiB each, 3.50 GB/s per thread, 7.25 "
                        "GB/s total\n# handoff reference: 2 threads, cache-line round trip 123 "
                        "ns\n"),
            std::string::npos)
      << sh.out;
}
#endif

#ifdef FUNCOL_WITH_GLOO
// Two processes started by hand join one gloo job with --rank/--world-size/--store (--ranks
// defaults to the world size): rank 0 prints every row, checked clean; the other prints nothing.
TEST_F(BenchProcessE2E, GlooRanksJoinedWithFlagsRunTheBenchmark) {
  funcol::tools::TempDir dir("funcol-bench-e2e-");
  // No launcher variables (empty is unset): only the flags say which job each process joins.
  const std::string bin = "RANK= WORLD_SIZE= FUNCOL_STORE= " + std::string(FUNCOL_BIN) +
                          " bench --backend gloo -o all_reduce -b 32 -e 512 -f 4 -n 2 -w 1 "
                          "--json --world-size 2 --store " +
                          dir.path() + " --rank ";
  const funcol::tools::e2e::ShellResult sh = funcol::tools::e2e::run_shell(
      bin + "1 >" + dir.path() + "/rank1.out 2>&1 & " + bin + "0; s=$?; wait $! || s=1; exit $s");
  ASSERT_EQ(sh.status, 0) << sh.out << sh.err << slurp(dir.path() + "/rank1.out");
  EXPECT_EQ(slurp(dir.path() + "/rank1.out"), "");
  std::istringstream in(sh.out);
  std::string line;
  std::vector<int64_t> sizes;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j["backend"], "gloo");
    EXPECT_EQ(j["ranks"], 2);
    EXPECT_EQ(j["wrong"], 0);
    sizes.push_back(j["size"].get<int64_t>());
  }
  EXPECT_EQ(sizes, (std::vector<int64_t>{32, 128, 512}));

  // Ranks started with different flags (here -e) fail at once, both saying so, instead of
  // pairing collectives of other sizes (a hang until the timeout, or a garbled size).
  const std::string store2 = dir.path() + "/store2";
  const std::string flags = "RANK= WORLD_SIZE= FUNCOL_STORE= FUNCOL_TIMEOUT=60 " +
                            std::string(FUNCOL_BIN) +
                            " bench --backend gloo -o all_reduce -b 32 -n 2 -w 1 --world-size 2 "
                            "--store " +
                            store2 + " --rank ";
  const funcol::tools::e2e::ShellResult mixed = funcol::tools::e2e::run_shell(
      flags + "1 -e 128 >" + dir.path() + "/mixed1.out 2>&1 & " + flags +
      "0 -e 512 2>&1; s=$?; wait $! || s=1; exit $s");
  const std::string mixed1 = slurp(dir.path() + "/mixed1.out");
  EXPECT_NE(mixed.status, 0) << mixed.out << mixed.err;
  for (const std::string& text : {mixed.out + mixed.err, mixed1}) {
    EXPECT_NE(text.find("the ranks were started with different flags: rank 0 has 'bench -b 32 -e "
                        "512"),
              std::string::npos)
        << text;
  }

  // A rank that cannot run (here a flag value only it was given) still joins and leaves with
  // its error: rank 0 fails at once naming it, not at the 60 s rendezvous timeout.
  const std::string store3 = dir.path() + "/store3";
  const std::string bad_bin = "RANK= WORLD_SIZE= FUNCOL_STORE= FUNCOL_TIMEOUT=60 " +
                              std::string(FUNCOL_BIN) +
                              " bench --backend gloo -o all_reduce -b 32 -e 32 -w 1 "
                              "--world-size 2 --store " +
                              store3 + " --rank ";
  const auto start = std::chrono::steady_clock::now();
  const funcol::tools::e2e::ShellResult bad = funcol::tools::e2e::run_shell(
      bad_bin + "1 -n 0 >" + dir.path() + "/bad1.out 2>&1 & " + bad_bin +
      "0 -n 2 2>&1; s=$?; wait $! || s=1; exit $s");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_NE(bad.status, 0) << bad.out << bad.err;
  EXPECT_EQ(slurp(dir.path() + "/bad1.out"),
            "funcol: error: rank 1: invalid value '0' for -n/--iters: expected an integer from 1 "
            "to 2147483647\n");
  EXPECT_NE((bad.out + bad.err).find("rank 1 departed after an error (invalid value '0' for "
                                     "-n/--iters: expected an integer from 1 to 2147483647)"),
            std::string::npos)
      << bad.out << bad.err;

  Result r = bench("--backend gloo --rank 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out,
            "funcol: error: --rank 0 needs --world-size N (or WORLD_SIZE): the number of "
            "processes in the job\n");
  r = bench("--backend threads --world-size 2 --rank 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out,
            "funcol: error: --rank and --world-size are for --backend gloo (joining a job as one "
            "of its ranks); --backend threads runs every rank in this process\n");
}
#endif

#if defined(FUNCOL_WITH_GLOO) || defined(FUNCOL_WITH_MPI)
// Every process below `pid` (children first by /proc's order), for finding the ranks.
std::vector<pid_t> descendants(pid_t pid) {
  std::vector<pid_t> out;
  for (pid_t c : funcol::tools::e2e::children_of(pid)) {
    out.push_back(c);
    for (pid_t d : descendants(c)) out.push_back(d);
  }
  return out;
}

// True when /proc/PID/environ holds VAR=VALUE.
bool has_env(pid_t pid, const std::string& entry) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string item;
  while (std::getline(f, item, '\0')) {
    if (item == entry) return true;
  }
  return false;
}




// A rank killed mid-run: the command exits non-zero naming rank 1 and leaves no process behind.
TEST_F(BenchProcessE2E, ADeadRankIsAClearErrorAndLeavesNothingBehind) {
  for (const std::string& backend : process_backends()) {
    SCOPED_TRACE(backend);
    funcol::tools::TempDir dir("funcol-bench-e2e-");
    funcol::tools::SpawnOptions s;
    s.argv = {FUNCOL_BIN, "bench",     "--backend", backend, "--ranks", "2", "-o",
              "all_reduce", "-b",      "4K",        "-e",    "4K",      "-n", "1000000000"};
    s.stdout_path = dir.path() + "/stdout";
    s.stderr_path = dir.path() + "/stderr";
    const pid_t launcher = funcol::tools::spawn_process(s);
    // Rank 0 prints the columns once every rank has joined the world.
    ASSERT_TRUE(eventually([&] { return slurp(s.stdout_path).find("# all_reduce") !=
                                        std::string::npos; },
                           60))
        << slurp(s.stderr_path);
    const std::string rank1 = backend == "mpi" ? "OMPI_COMM_WORLD_RANK=1" : "RANK=1";
    std::vector<pid_t> procs = descendants(launcher);
    const auto victim =
        std::find_if(procs.begin(), procs.end(), [&](pid_t p) { return has_env(p, rank1); });
    ASSERT_NE(victim, procs.end());
    kill(*victim, SIGKILL);
    ASSERT_TRUE(eventually([&] { return !alive(launcher); }, 90));
    const funcol::tools::ExitStatus st = funcol::tools::wait_all({launcher}).front();
    EXPECT_FALSE(st.signaled);
    EXPECT_EQ(st.code, 1);
    const std::string err = slurp(s.stderr_path);
    if (backend == "gloo") {
      EXPECT_NE(err.find("funcol: error: rank 1 was killed by signal 9"), std::string::npos)
          << err;
    } else {
      // mpirun's own report names the rank and the signal.
      EXPECT_NE(err.find("rank 1"), std::string::npos) << err;
      EXPECT_NE(err.find("signal 9"), std::string::npos) << err;
    }
    for (pid_t p : procs) EXPECT_TRUE(eventually([&] { return !alive(p); }, 30)) << p;
  }
}
#endif

}  // namespace
