// The conformance suite on a process backend: every rank runs this binary (started by mpirun,
// or by gloo_launch.sh with RANK / WORLD_SIZE / FUNCOL_STORE), joins the world with
// init_process_group, and runs the same tests in the same order.
//
//   process_conformance --backend=gloo|mpi [--reduced] [gtest flags]
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <regex>
#include <string>

#include <algorithm>
#include <chrono>
#include <thread>

#include "funcol/api/functional.h"
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "testing/conformance.h"

namespace {

std::shared_ptr<funcol::ProcessGroup> g_world;

// Runs fn on this process's rank, then tells every rank which ranks failed, so a failure on
// one rank fails the test everywhere (each rank prints its own error).
void launch(int world_size, const funcol::testing::RankFn& fn) {
  using funcol::DType;
  if (world_size != g_world->size()) {
    throw std::runtime_error(
        fmt::format("this job has {} ranks, the test wants {}", g_world->size(), world_size));
  }
  std::string error;
  try {
    fn(*g_world);
  } catch (const std::exception& e) {
    error = e.what();
  }
  funcol::Tensor mine = funcol::Tensor::full({1}, DType::I32, error.empty() ? 0 : 1);
  funcol::Tensor all = funcol::Tensor::empty({g_world->size()}, DType::I32);
  g_world->all_gather(all, mine)->wait();
  if (!error.empty()) throw std::runtime_error(error);
  auto flags = all.to_vector<int>();
  std::string failed;
  for (size_t r = 0; r < flags.size(); ++r) {
    if (flags[r]) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!failed.empty()) throw std::runtime_error("ranks [" + failed + "] failed (see their output)");
}

// ---- what the process backends add to the suite (no communication unless noted) ----

TEST(ProcessBackend, TheProcessWorldIsEveryThreadsCurrentWorld) {
  EXPECT_EQ(funcol::current_world(), g_world.get());
  funcol::ProcessGroup* seen = nullptr;
  std::thread([&] { seen = funcol::current_world(); }).join();
  EXPECT_EQ(seen, g_world.get());
  EXPECT_EQ(g_world->registry().get("world"), g_world);
}

TEST(ProcessBackend, IsListedAndCannotBeInitialisedTwice) {
  auto names = funcol::available_backends();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_NE(std::find(names.begin(), names.end(), g_world->backend()), names.end());
  EXPECT_THROW(funcol::init_process_group(g_world->backend()), funcol::InvalidArgument);
  EXPECT_THROW(funcol::init_process_group("nccl"), funcol::InvalidArgument);
  EXPECT_THROW(funcol::init_process_group("threads"), funcol::InvalidArgument);
  // It names the process backends only (threads was listed among them).
  try {
    funcol::init_process_group("threads");
  } catch (const funcol::InvalidArgument& e) {
    const std::string what = e.what();
    const size_t list = what.find("(process backends available: ");
    ASSERT_NE(list, std::string::npos) << what;
    EXPECT_EQ(what.find("threads", list), std::string::npos) << what;
    EXPECT_NE(what.find(g_world->backend(), list), std::string::npos) << what;
  }
}

TEST(ProcessBackend, SplitGroupRejectsBadListsOnEveryRank) {
  EXPECT_THROW(g_world->split_group({{0, 0}}, "bad_dup"), funcol::InvalidArgument);
  EXPECT_THROW(g_world->split_group({{g_world->size()}}, "bad_rank"), funcol::InvalidArgument);
  EXPECT_THROW(g_world->split_group({{0}}, "world"), funcol::InvalidArgument);
}

// Communicates. Ranks that pass different lists get one CommError each, at once (gloo used to
// wait out the rendezvous timeout; mpi split by position and gave ranks a group of other
// members than they asked for), and the world stays usable.
TEST(ProcessBackend, SplitGroupWithDifferentListsFailsOnEveryRankAtOnce) {
  using funcol::DType;
  const int n = g_world->size();
  const int me = g_world->rank();
  if (n < 2) GTEST_SKIP() << "needs at least 2 ranks to disagree; this job has " << n;
  const auto start = std::chrono::steady_clock::now();
  try {
    // Rank r asks for the group {r}: no two ranks agree.
    g_world->split_group({{me}}, "disagree");
    ADD_FAILURE() << "split_group with different lists returned";
  } catch (const funcol::CommError& e) {
    // "(split N)": N counts the world's earlier splits.
    EXPECT_TRUE(std::regex_match(
        e.what(), std::regex(R"(split_group on group 'world' \(split [0-9]+\): rank 0 passed )"
                             R"(\[\[0\]\] as 'disagree' but rank 1 passed \[\[1\]\] as 'disagree')")))
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(g_world->registry().find("disagree"), nullptr);
  // The same name and lists on every rank then work.
  std::vector<std::vector<int>> singles;
  for (int r = 0; r < n; ++r) singles.push_back({r});
  auto group = g_world->split_group(singles, "disagree");
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->global_ranks(), std::vector<int>{me});
  funcol::Tensor x = funcol::Tensor::full({3}, DType::I32, 1);
  EXPECT_EQ(funcol::all_reduce(x, "sum", *g_world).to_vector<int>(), std::vector<int>(3, n));
}

// Communicates: the functional API finds "world" through current_world().
TEST(ProcessBackend, FunctionalApiUsesTheProcessWorld) {
  using funcol::DType;
  const int n = g_world->size();
  funcol::Tensor x = funcol::Tensor::full({4, 2}, DType::I32, g_world->rank() + 1);
  funcol::Tensor s = funcol::all_reduce(x, "sum", "world");
  funcol::Tensor g = funcol::all_gather_tensor(x, 0, *g_world);
  EXPECT_EQ(s.to_vector<int>(), std::vector<int>(8, n * (n + 1) / 2));
  EXPECT_EQ(g.sizes(), (funcol::Shape{4 * n, 2}));
  EXPECT_EQ(g.to_vector<int>().back(), n);
}

}  // namespace

int main(int argc, char** argv) {
  std::string backend;
  bool reduced = false;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--backend=", 10) == 0) {
      backend = argv[i] + 10;
    } else if (std::strcmp(argv[i], "--reduced") == 0) {
      reduced = true;
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  if (backend.empty()) {
    std::fprintf(stderr,
                 "usage: process_conformance --backend=gloo|mpi [--reduced] [gtest flags]\n");
    return 2;
  }
  try {
    g_world = funcol::init_process_group(backend);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "init_process_group(%s) failed: %s\n", backend.c_str(), e.what());
    return 1;
  }
  // Rank 0 reports in full; the others only their failures (set before gtest reads flags).
  if (g_world->rank() != 0) GTEST_FLAG_SET(brief, true);
  ::testing::InitGoogleTest(&argc, argv);
  funcol::testing::ConformanceConfig config;
  config.backend = backend;
  config.launch = launch;
  config.world_sizes = {g_world->size()};
  config.reduced = reduced;
  funcol::testing::register_conformance_tests(config);
  int rc = RUN_ALL_TESTS();
  // A group kept past destroy_process_group refuses collectives at once.
  std::shared_ptr<funcol::ProcessGroup> kept = std::move(g_world);
  funcol::destroy_process_group();
  try {
    kept->all_reduce(funcol::Tensor::zeros({2}, funcol::DType::F32), funcol::ReduceOp::Sum);
    std::fprintf(stderr, "a group used after destroy_process_group did not throw\n");
    rc = 1;
  } catch (const funcol::InvalidArgument& e) {
    if (std::string(e.what()).find("destroyed by destroy_process_group") == std::string::npos) {
      std::fprintf(stderr, "unexpected message: %s\n", e.what());
      rc = 1;
    }
  }
  return rc;
}
