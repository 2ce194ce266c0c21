// End to end: build/bin/funcol train as a user runs it (JSON line, exit status, bad options).
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
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

// The same training as a job of processes: the reference and the bucketing counts agree with
// the threads backend's, and no rank is left behind.
TEST(TrainE2e, MpiAndGlooJobsTrainTheSameModel) {
  const std::vector<std::string> backends = funcol::tools::e2e::process_backends();
  if (backends.empty()) GTEST_SKIP() << "neither mpi nor gloo is compiled into this build";
  const std::string args =
      "--ranks 2 --layers 4 --hidden 16 --batch 8 --steps 10 --lr 0.05 --json --backend ";
  const Result threads = train(args + "threads");
  ASSERT_EQ(threads.status, 0) << threads.out;
  const nlohmann::json want = nlohmann::json::parse(threads.out);
  for (const std::string& backend : backends) {
    const Result r = train(args + backend);
    ASSERT_EQ(r.status, 0) << backend << ": " << r.out;
    const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
    EXPECT_EQ(j["config"]["backend"], backend);
    EXPECT_LT(j["final_loss"].get<double>(), j["initial_loss"].get<double>()) << backend;
    EXPECT_LT(j["max_abs_diff_vs_reference"].get<double>(), 1e-4) << backend;
    // Sums of two ranks are exact in any order: the losses match the threads backend's.
    EXPECT_NEAR(j["final_loss"].get<double>(), want["final_loss"].get<double>(), 1e-6) << backend;
    EXPECT_EQ(j["collectives_per_step"]["bucketed"], 2) << backend;
    EXPECT_TRUE(j["variants_identical"].get<bool>()) << backend;
  }
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

}  // namespace
