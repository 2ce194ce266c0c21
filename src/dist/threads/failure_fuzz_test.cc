// Seeded random programs on the threads backend in which one rank fails at a random step: it
// throws, returns early, or issues a collective that does not match its peers'. Whatever the
// mix of collectives in flight (lane and Op-path all_reduces, all_gather, reduce_scatter,
// all_to_all, broadcast, barrier; on the world and on two subgroups; waited at once or later),
// every other rank must see each of its collectives either complete with the right values or
// fail with a CommError, and the run must end well before the collectives' timeout: a failure is
// never a hang.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/process_group.h"

namespace funcol {
namespace {

using Clock = std::chrono::steady_clock;

enum class Kind { kSmallAllReduce, kLargeAllReduce, kAllGather, kReduceScatter, kAllToAll,
                  kBroadcast, kBarrier };
enum class Failure { kThrow, kReturn, kMismatch };

struct Step {
  Kind kind;
  int group;      // 0: world, 1: the lower half, 2: the upper half
  int64_t count;  // elements per rank
  bool wait_now;  // else waited at the end (or when the program's pending list is full)
};

struct Program {
  int world_size;
  // Collectives a rank keeps unwaited at most; past 8 small all_reduces on one group, a rank
  // waits at issue for a lane slot.
  int max_pending;
  std::vector<Step> steps;
  int failing_rank;
  int failing_step;
  Failure failure;
};

// The same program on every rank (one seed).
Program make_program(uint32_t seed) {
  std::mt19937 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
  Program p;
  p.world_size = 2 + pick(7);
  p.max_pending = 1 + pick(16);
  const int target = 3 + pick(30);
  while (static_cast<int>(p.steps.size()) < target) {
    Step step;
    step.kind = static_cast<Kind>(pick(7));
    step.group = p.world_size >= 4 ? pick(3) : 0;
    // Small counts take the lane (all_reduce up to its limit); large ones the Op path.
    step.count = step.kind == Kind::kLargeAllReduce ? 4096 + pick(60000) : 1 + pick(300);
    step.wait_now = pick(5) == 0;
    // Now and then a burst of small all_reduces on one group, none waited: past the group's 8
    // lane slots a rank waits at issue for the slot of its own earlier one.
    const int copies = pick(6) == 0 ? 9 + pick(4) : 1;
    if (copies > 1) {
      step.kind = Kind::kSmallAllReduce;
      step.count = 1 + pick(300);
      step.wait_now = false;
    }
    for (int k = 0; k < copies; ++k) p.steps.push_back(step);
  }
  const int steps = static_cast<int>(p.steps.size());
  p.failing_rank = pick(p.world_size);
  p.failing_step = pick(steps);
  p.failure = static_cast<Failure>(pick(3));
  // A mismatch needs the failing rank among the step's members: the world's.
  if (p.failure == Failure::kMismatch) p.steps[p.failing_step].group = 0;
  return p;
}

// The members (global ranks) of a program's group.
std::vector<int> members(int world_size, int group) {
  std::vector<int> m;
  const int half = world_size / 2;
  for (int r = 0; r < world_size; ++r) {
    if (group == 0 || (group == 1 && r < half) || (group == 2 && r >= half)) m.push_back(r);
  }
  return m;
}

// What one rank saw.
struct Outcome {
  int completed = 0;
  int comm_errors = 0;
  // Issued a small all_reduce with 8 of its own on the group unwaited (it waited at issue).
  bool past_lane_slots = false;
  std::vector<std::string> problems;  // anything but a right value or a CommError
};

// A collective issued by this rank, checked when it is waited for.
struct Pending {
  std::shared_ptr<Work> work;
  std::function<std::string()> check;  // "" when the values are right
  int step;
};

// Checks for Pending::check: every element of `t` is `want` (all_equal), or every element of
// block j of `t` (`block` elements each, from member j) is block_value(j) (blocks_equal).
template <typename T>
std::function<std::string()> all_equal(const Tensor& t, T want, const char* what) {
  return [t, want, what] {
    for (T v : t.to_vector<T>()) {
      if (v != want) return std::string(what) + " gave " + std::to_string(v);
    }
    return std::string();
  };
}
template <typename T, typename BlockValue>
std::function<std::string()> blocks_equal(const Tensor& t, int64_t block, BlockValue block_value,
                                          const char* what) {
  return [t, block, block_value, what] {
    const std::vector<T> v = t.to_vector<T>();
    for (size_t i = 0; i < v.size(); ++i) {
      const T want = block_value(static_cast<int64_t>(i) / block);
      if (v[i] != want) return std::string(what) + " gave " + std::to_string(v[i]);
    }
    return std::string();
  };
}

void run_program(const Program& p, ProcessGroup& world, Outcome& out);

// run_program, with every exception but the injected failure and a CommError recorded as a
// problem (run_local rethrows only the first failure, which would hide a later rank's).
void run_rank(const Program& p, ProcessGroup& world, Outcome& out) {
  try {
    run_program(p, world, out);
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    if (std::string(e.what()) != "injected failure") {
      out.problems.push_back(std::string("unexpected exception: ") + e.what());
    }
    throw;
  }
}

void run_program(const Program& p, ProcessGroup& world, Outcome& out) {
  const int me = world.rank();
  std::shared_ptr<ProcessGroup> groups[3];
  groups[0] = std::shared_ptr<ProcessGroup>(&world, [](ProcessGroup*) {});
  if (p.world_size >= 4) {
    groups[1] = new_group(world, members(p.world_size, 1));
    groups[2] = new_group(world, members(p.world_size, 2));
  }
  std::vector<Pending> pending;
  int lane_pending[3] = {0, 0, 0};  // unwaited small all_reduces per group
  auto finish = [&](Pending& x) {
    try {
      x.work->wait();
      const std::string wrong = x.check();
      if (wrong.empty()) {
        ++out.completed;
      } else {
        out.problems.push_back("step " + std::to_string(x.step) + ": " + wrong);
      }
    } catch (const CommError& e) {
      ++out.comm_errors;
      if (std::string(e.what()).find("(seq ") == std::string::npos) {
        out.problems.push_back("step " + std::to_string(x.step) + ": a CommError without the "
                               "collective's seq: " + e.what());
      }
      // A rank that sees its group fail leaves, as a training loop would.
      throw;
    }
  };
  for (int s = 0; s < static_cast<int>(p.steps.size()); ++s) {
    const Step& step = p.steps[s];
    bool mismatch = false;
    if (me == p.failing_rank && s == p.failing_step) {
      if (p.failure == Failure::kThrow) throw std::runtime_error("injected failure");
      if (p.failure == Failure::kReturn) return;
      mismatch = true;
    }
    ProcessGroup* g = groups[step.group].get();
    if (g == nullptr) continue;  // not a member
    const int n = g->size();
    const int gr = g->rank();
    // A mismatch: one more element (a barrier becomes an all_reduce of one element).
    const int64_t count = step.count + (mismatch ? 1 : 0);
    Pending x;
    x.step = s;
    switch (mismatch && step.kind == Kind::kBarrier ? Kind::kSmallAllReduce : step.kind) {
      case Kind::kSmallAllReduce:
        if (lane_pending[step.group]++ >= 8) out.past_lane_slots = true;
        [[fallthrough]];
      case Kind::kLargeAllReduce: {
        Tensor t = Tensor::full({count}, DType::I64, gr + 1 + s);
        x.work = g->all_reduce(t, ReduceOp::Sum);
        const int64_t want = static_cast<int64_t>(n) * (n + 1) / 2 + static_cast<int64_t>(n) * s;
        x.check = all_equal(t, want, "all_reduce");
        break;
      }
      case Kind::kAllGather: {
        Tensor in = Tensor::full({count}, DType::I32, gr * 10 + s);
        Tensor o = Tensor::empty({count * n}, DType::I32);
        x.work = g->all_gather(o, in);
        x.check = blocks_equal<int32_t>(
            o, count, [s](int64_t j) { return static_cast<int32_t>(j * 10 + s); }, "all_gather");
        break;
      }
      case Kind::kReduceScatter: {
        // Block b of member m's input holds (b + 1) * 100 + m: member r gets
        // n (r + 1) 100 + n (n - 1) / 2 everywhere.
        Tensor in = Tensor::empty({count * n}, DType::F32);
        for (int b = 0; b < n; ++b) in.narrow(0, b * count, count).fill_((b + 1) * 100 + gr);
        Tensor o = Tensor::empty({count}, DType::F32);
        x.work = g->reduce_scatter(o, in, ReduceOp::Sum);
        const float want = static_cast<float>(n * (gr + 1) * 100 + n * (n - 1) / 2);
        x.check = all_equal(o, want, "reduce_scatter");
        break;
      }
      case Kind::kAllToAll: {
        Tensor in = Tensor::full({count * n}, DType::I16, gr);
        Tensor o = Tensor::empty({count * n}, DType::I16);
        x.work = g->all_to_all(o, in, {}, {});
        x.check = blocks_equal<int16_t>(
            o, count, [](int64_t j) { return static_cast<int16_t>(j); }, "all_to_all");
        break;
      }
      case Kind::kBroadcast: {
        const int root = s % n;
        Tensor t = Tensor::full({count}, DType::F64, gr == root ? 7.0 + s : -1.0);
        x.work = g->broadcast(t, root);
        x.check = all_equal(t, 7.0 + s, "broadcast");
        break;
      }
      case Kind::kBarrier:
        x.work = g->barrier_async();
        x.check = [] { return std::string(); };
        break;
    }
    pending.push_back(std::move(x));
    if (step.wait_now || static_cast<int>(pending.size()) >= p.max_pending) {
      for (Pending& q : pending) finish(q);
      pending.clear();
      for (int& k : lane_pending) k = 0;
    }
  }
  for (Pending& q : pending) finish(q);
}

TEST(FailureFuzzTest, OneRankFailsAtARandomStep) {
#ifdef FUNCOL_SANITIZED
  uint32_t seeds = 200;
#else
  uint32_t seeds = 2000;
#endif
  // FUNCOL_FAILURE_FUZZ_SEEDS=N runs seeds 0..N-1 instead, for a longer hunt.
  if (const char* env = std::getenv("FUNCOL_FAILURE_FUZZ_SEEDS")) {
    seeds = static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
  }
  // Far longer than any program takes: a run that lasts until it would be a hang.
  constexpr auto kTimeout = std::chrono::seconds(60);
  constexpr double kBoundSeconds = 5.0;
  int by_failure[3] = {0, 0, 0};
  int completed = 0, comm_errors = 0, past_lane_slots = 0;
  for (uint32_t seed = 0; seed < seeds; ++seed) {
    const Program p = make_program(seed);
    SCOPED_TRACE("seed " + std::to_string(seed) + ": " + std::to_string(p.world_size) +
                 " ranks, " + std::to_string(p.steps.size()) + " steps, rank " +
                 std::to_string(p.failing_rank) + " fails at step " +
                 std::to_string(p.failing_step) + " by " +
                 (p.failure == Failure::kThrow    ? "throwing"
                  : p.failure == Failure::kReturn ? "returning"
                                                  : "a mismatched collective"));
    ++by_failure[static_cast<int>(p.failure)];
    std::vector<Outcome> outcomes(p.world_size);
    const auto start = Clock::now();
    std::string thrown;
    bool comm_error = false;
    try {
      run_local(p.world_size,
                [&](ProcessGroup& world) { run_rank(p, world, outcomes[world.rank()]); },
                LocalOptions{kTimeout});
    } catch (const CommError& e) {
      thrown = e.what();
      comm_error = true;
    } catch (const std::runtime_error& e) {
      thrown = e.what();
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_LT(seconds, kBoundSeconds) << thrown;
    bool past = false;
    for (int r = 0; r < p.world_size; ++r) {
      for (const std::string& problem : outcomes[r].problems) {
        ADD_FAILURE() << "rank " << r << ": " << problem;
      }
      completed += outcomes[r].completed;
      comm_errors += outcomes[r].comm_errors;
      past = past || outcomes[r].past_lane_slots;
    }
    past_lane_slots += past ? 1 : 0;
    if (p.failure == Failure::kThrow) {
      EXPECT_EQ(thrown, "injected failure");  // the first failure, not a peer's CommError
      continue;
    }
    // A rank that returned early or issued a mismatched collective fails its peers only if one
    // of them shares a later (or that) collective with it: then run_local rethrows a CommError
    // naming the collective and its group's sequence number.
    if (!thrown.empty()) {
      EXPECT_TRUE(comm_error) << thrown;
      EXPECT_NE(thrown.find("(seq "), std::string::npos) << thrown;
    }
  }
  // Every kind of failure was drawn, collectives both completed and failed, and some ranks
  // waited at issue for a lane slot.
  if (seeds >= 100) {
    for (int k = 0; k < 3; ++k) EXPECT_GT(by_failure[k], 0) << "failure kind " << k;
    EXPECT_GT(completed, 0);
    EXPECT_GT(comm_errors, 0);
    EXPECT_GT(past_lane_slots, 0);
  }
  std::printf("%u programs: %d collectives completed, %d CommErrors seen by a waiting rank, %d "
              "programs with a rank waiting at issue for a lane slot\n",
              seeds, completed, comm_errors, past_lane_slots);
}

}  // namespace
}  // namespace funcol
