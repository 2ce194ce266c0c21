// End to end: build/bin/funcol train as a user runs it (JSON line, exit status, bad options).
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tools/e2e_util.h"

#ifndef FUNCOL_BIN
#error "FUNCOL_BIN must name the funcol command"
#endif

namespace {

struct Result {
  int status = -1;  // exit status, or -1 when the command did not exit normally
  std::string out;  // stdout, then stderr
};

// Runs `funcol train ARGS` (stderr is not a terminal: plain progress lines, no bar).
Result train(const std::string& args) {
  const funcol::tools::e2e::ShellResult sh =
      funcol::tools::e2e::run_shell(std::string(FUNCOL_BIN) + " train " + args);
  return Result{sh.status, sh.out + sh.err};
}

TEST(TrainE2e, JsonLineLossFallsWeightsMatchReference) {
  const Result r = train("--ranks 2 --layers 4 --hidden 16 --batch 8 --steps 10 --lr 0.05 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  ASSERT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_LT(j["final_loss"].get<double>(), j["initial_loss"].get<double>());
  EXPECT_LT(j["max_abs_diff_vs_reference"].get<double>(), 1e-4);
  EXPECT_EQ(j["collectives_per_step"]["unbucketed"], 8);
  EXPECT_EQ(j["collectives_per_step"]["bucketed"], 2);
  EXPECT_GT(j["step_ms"]["unbucketed"].get<double>(), 0);
  EXPECT_GT(j["step_ms"]["bucketed"].get<double>(), 0);
}

// The same training as a job of processes: the weights equal the reference's bit for bit (the
// step's reduce-scatters add in rank order on every backend; mpi's own reduce-scatter, adding
// in its order, ended 3e-8 away on these 4 ranks), the bucketing counts agree with the threads
// backend's, and no rank is left behind.
TEST(TrainE2e, MpiAndGlooJobsTrainTheSameModel) {
  const std::vector<std::string> backends = funcol::tools::e2e::process_backends();
  if (backends.empty()) GTEST_SKIP() << "neither mpi nor gloo is compiled into this build";
  const std::string args =
      "--ranks 4 --layers 4 --hidden 16 --batch 8 --steps 10 --lr 0.05 --json --backend ";
  const Result threads = train(args + "threads");
  ASSERT_EQ(threads.status, 0) << threads.out;
  const nlohmann::json want = nlohmann::json::parse(threads.out);
  for (const std::string& backend : backends) {
    const Result r = train(args + backend);
    ASSERT_EQ(r.status, 0) << backend << ": " << r.out;
    const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    EXPECT_EQ(j["config"]["backend"], backend);
    EXPECT_LT(j["final_loss"].get<double>(), j["initial_loss"].get<double>()) << backend;
    EXPECT_EQ(j["max_abs_diff_vs_reference"].get<double>(), 0.0) << backend;
    EXPECT_EQ(j["final_loss"].get<double>(), want["final_loss"].get<double>()) << backend;
    EXPECT_EQ(j["collectives_per_step"]["bucketed"], 2) << backend;
    EXPECT_TRUE(j["variants_identical"].get<bool>()) << backend;
  }
}

#ifdef FUNCOL_WITH_GLOO
// The progress of a gloo job arrives while it trains, not when it has ended: the launcher keeps
// the ranks' stderr until the end, so rank 0 writes its progress to the launcher's own stderr.
// (Stdout and stderr in one pipe: the progress comes before rank 0's summary.)
TEST(TrainE2e, GlooJobShowsProgressWhileItTrains) {
  const funcol::tools::e2e::ShellResult r = funcol::tools::e2e::run_shell(
      "(" + std::string(FUNCOL_BIN) +
      " train --ranks 2 --layers 2 --hidden 8 --steps 3 --backend gloo 2>&1)");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const size_t progress = r.out.find("step 3/3 loss ");
  const size_t summary = r.out.find("funcol train: 2-layer MLP");
  ASSERT_NE(progress, std::string::npos) << r.out;
  ASSERT_NE(summary, std::string::npos) << r.out;
  EXPECT_LT(progress, summary) << r.out;
  EXPECT_EQ(r.out.find("step 3/3 loss ", progress + 1), std::string::npos) << r.out;  // once
}
#endif

// On a terminal (script(1) gives the command one) the progress is a bar, whichever process
// trains: with --backend mpi rank 0's stderr is a pipe to mpirun, which used to make it print
// nothing at all under --json.
TEST(TrainE2e, ProgressIsABarOnATerminalOnEveryBackend) {
  if (std::system("command -v script >/dev/null 2>&1") != 0) GTEST_SKIP() << "no script(1)";
  std::vector<std::string> backends = funcol::tools::e2e::process_backends();
  backends.insert(backends.begin(), "threads");
  for (const std::string& backend : backends) {
    const funcol::tools::e2e::ShellResult r = funcol::tools::e2e::run_shell(
        "script -qec '" + std::string(FUNCOL_BIN) +
        " train --ranks 2 --layers 2 --hidden 8 --steps 3 --json --backend " + backend +
        "' /dev/null");
    ASSERT_EQ(r.status, 0) << backend << ": " << r.out << r.err;
    EXPECT_NE(r.out.find("] step 3/3  loss "), std::string::npos) << backend << ": " << r.out;
    EXPECT_EQ(r.out.find("step 3/3 loss "), std::string::npos) << backend << ": " << r.out;
  }
}

// Stopped by a signal on the threads backend, training says so on a line of its own: the
// progress bar's line is ended first (the message used to follow the bar on its line).
TEST(TrainE2e, ASignalEndsTheBarLineBeforeItsMessage) {
  const funcol::tools::e2e::ShellResult r = funcol::tools::e2e::run_shell(
      "f=$(mktemp); " + std::string(FUNCOL_BIN) +
      " train --ranks 2 --layers 2 --hidden 8 --steps 100000000 --progress-bar 2>\"$f\" & "
      "p=$!; for i in $(seq 600); do grep -q ' step ' \"$f\" && break; sleep 0.05; done; "
      "kill -TERM $p; wait $p; echo \"status $?\"; cat \"$f\"; rm -f \"$f\"");
  EXPECT_NE(r.out.find("status 143\n"), std::string::npos) << r.out;
  const size_t message = r.out.find("funcol: error: interrupted by signal 15");
  ASSERT_NE(message, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("] step "), std::string::npos) << r.out;
  EXPECT_EQ(r.out[message - 1], '\n') << r.out;
}

TEST(TrainE2e, BadOptionsExitNonZeroWithOneClearLine) {
  Result r = train("--optimizer rmsprop --steps 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out,
            "funcol: error: unknown optimizer 'rmsprop' for --optimizer: expected sgd or adam\n");
  r = train("--ranks 4 --hidden 10 --steps 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("funcol: error: --hidden 10 is not divisible by --ranks 4"),
            std::string::npos)
      << r.out;
  r = train("--steps many");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("--steps"), std::string::npos) << r.out;
}

// An unwritable --trace is one error line before any rank starts, on every backend (with mpi
// every rank used to print it, followed by mpirun's report of the failed job).
TEST(TrainE2e, UnwritableTraceIsOneErrorBeforeTheJobStarts) {
  std::vector<std::string> backends = funcol::tools::e2e::process_backends();
  backends.insert(backends.begin(), "threads");
  for (const std::string& backend : backends) {
    const Result r = train("--ranks 2 --layers 2 --hidden 8 --steps 1 --json --backend " +
                           backend + " --trace /nonexistent-dir/t.json");
    EXPECT_EQ(r.status, 1) << backend;
    EXPECT_EQ(r.out,
              "funcol: error: cannot write trace file /nonexistent-dir/t.json: No such file or "
              "directory\n")
        << backend;
  }
}

#ifdef FUNCOL_WITH_GLOO
// Two processes started by hand join one gloo job with --rank/--world-size/--store (--ranks
// defaults to the world size) and train what the launcher's job trains; rank 0 reports.
TEST(TrainE2e, GlooRanksJoinedWithFlagsTrainWhatTheLauncherTrains) {
  const std::string model = "--layers 2 --hidden 8 --batch 4 --steps 3 --json --backend gloo";
  const Result launched = train("--ranks 2 " + model);
  ASSERT_EQ(launched.status, 0) << launched.out;
  const nlohmann::json want = nlohmann::json::parse(launched.out.substr(launched.out.find('{')));
  char dir[] = "/tmp/funcol_train_e2e_XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string d = dir;
  // No launcher variables (empty is unset): only the flags say which job each process joins.
  const std::string bin = "RANK= WORLD_SIZE= FUNCOL_STORE= FUNCOL_TIMEOUT=60 " +
                          std::string(FUNCOL_BIN) + " train " + model + " --world-size 2 --store " +
                          d + "/store --rank ";
  const funcol::tools::e2e::ShellResult sh = funcol::tools::e2e::run_shell(
      bin + "1 >" + d + "/rank1.out 2>&1 & " + bin + "0; s=$?; wait $! || s=1; exit $s");
  const std::string rank1 = funcol::tools::e2e::slurp(d + "/rank1.out");
  std::filesystem::remove_all(d);
  ASSERT_EQ(sh.status, 0) << sh.out << sh.err << rank1;
  EXPECT_EQ(rank1, "");
  const nlohmann::json j = nlohmann::json::parse(sh.out);
  EXPECT_EQ(j["config"]["ranks"], 2);
  EXPECT_EQ(j["initial_loss"], want["initial_loss"]);
  EXPECT_EQ(j["final_loss"], want["final_loss"]);

  // A rank that fails mid-training prints its error on a line of its own, not glued to the
  // progress bar: here rank 1 trains 2 steps and leaves, so rank 0 fails in step 3.
  char dir2[] = "/tmp/funcol_train_e2e_XXXXXX";
  ASSERT_NE(mkdtemp(dir2), nullptr);
  const std::string d2 = dir2;
  const std::string fail = "RANK= WORLD_SIZE= FUNCOL_STORE= FUNCOL_TIMEOUT=2 " +
                           std::string(FUNCOL_BIN) +
                           " train --layers 2 --hidden 8 --batch 4 --json --backend gloo "
                           "--world-size 2 --store " +
                           d2 + "/store --progress-bar --rank ";
  const funcol::tools::e2e::ShellResult failed = funcol::tools::e2e::run_shell(
      "(" + fail + "1 --steps 50 --leave-before-step 3 >/dev/null 2>&1 & " + fail +
      "0 --steps 50 2>&1; s=$?; wait; exit $s)");
  std::filesystem::remove_all(d2);
  EXPECT_EQ(failed.status, 1) << failed.out;
  EXPECT_NE(failed.out.find("] step 2/50  loss "), std::string::npos) << failed.out;
  const size_t error = failed.out.find("funcol: error: rank 0: ");
  ASSERT_NE(error, std::string::npos) << failed.out;
  EXPECT_EQ(failed.out[error - 1], '\n') << failed.out;

  // Ranks started with different flags (here --steps) fail at once, saying so, instead of
  // meeting the next step's collectives with the report's (a hang until the timeout).
  char dir3[] = "/tmp/funcol_train_e2e_XXXXXX";
  ASSERT_NE(mkdtemp(dir3), nullptr);
  const std::string d3 = dir3;
  const std::string mixed_bin = "RANK= WORLD_SIZE= FUNCOL_STORE= FUNCOL_TIMEOUT=60 " +
                                std::string(FUNCOL_BIN) +
                                " train --layers 2 --hidden 8 --batch 4 --backend gloo "
                                "--world-size 2 --store " +
                                d3 + "/store --rank ";
  const funcol::tools::e2e::ShellResult mixed = funcol::tools::e2e::run_shell(
      "(" + mixed_bin + "1 --steps 2 >" + d3 + "/rank1.out 2>&1 & " + mixed_bin +
      "0 --steps 1 2>&1; s=$?; wait $! || s=1; exit $s)");
  const std::string mixed1 = funcol::tools::e2e::slurp(d3 + "/rank1.out");
  std::filesystem::remove_all(d3);
  EXPECT_EQ(mixed.status, 1) << mixed.out;
  for (const std::string& text : {mixed.out, mixed1}) {
    EXPECT_NE(text.find("the ranks were started with different flags: rank 0 has 'train "),
              std::string::npos)
        << text;
    EXPECT_NE(text.find("(every rank of a job must pass the same training flags)"),
              std::string::npos)
        << text;
  }

  // A rank that cannot train (here a flag value only it was given) still joins and leaves with
  // its error: rank 0 fails at once naming it, not at the 60 s rendezvous timeout.
  char dir4[] = "/tmp/funcol_train_e2e_XXXXXX";
  ASSERT_NE(mkdtemp(dir4), nullptr);
  const std::string d4 = dir4;
  const std::string bad_bin = "RANK= WORLD_SIZE= FUNCOL_STORE= FUNCOL_TIMEOUT=60 " +
                              std::string(FUNCOL_BIN) +
                              " train --layers 2 --hidden 8 --batch 4 --backend gloo "
                              "--world-size 2 --store " +
                              d4 + "/store --rank ";
  const auto start = std::chrono::steady_clock::now();
  const funcol::tools::e2e::ShellResult bad = funcol::tools::e2e::run_shell(
      "(" + bad_bin + "1 --lr -1 >" + d4 + "/rank1.out 2>&1 & " + bad_bin +
      "0 2>&1; s=$?; wait $! || s=1; exit $s)");
  const std::string bad1 = funcol::tools::e2e::slurp(d4 + "/rank1.out");
  std::filesystem::remove_all(d4);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(bad.status, 1) << bad.out;
  EXPECT_EQ(bad1, "funcol: error: rank 1: --lr must be a positive number, got -1\n");
  EXPECT_NE(bad.out.find("funcol: error: rank 0: "), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("rank 1 departed after an error (--lr must be a positive number, got "
                         "-1)"),
            std::string::npos)
      << bad.out;

  Result r = train("--backend threads --store " + d);
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out,
            "funcol: error: --store is for --backend gloo (joining a job as one of its ranks); "
            "--backend threads runs every rank in this process\n");
  r = train("--backend gloo --rank 0 --world-size 2 --ranks 4 --store " + d);
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "funcol: error: --ranks 4 does not match --world-size 2\n");
}
#endif

}  // namespace
