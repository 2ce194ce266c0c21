// Tests of the profiler and the Chrome trace export, alone and recorded by the executor.
#include "funcol/runtime/profile.h"

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "funcol/dist/backend.h"
#include "funcol/graph/parser.h"
#include "funcol/runtime/executor.h"

namespace funcol {
namespace {

using nlohmann::json;

std::vector<json> events_of(const json& trace, int pid, const std::string& ph) {
  std::vector<json> out;
  for (const json& e : trace["traceEvents"]) {
    if (e["pid"] == pid && e["ph"] == ph) out.push_back(e);
  }
  return out;
}

TEST(Profile, EmptyProfileStillNamesBothTracks) {
  Profiler p;
  json events = json::parse(trace_events_json(p, 3));
  ASSERT_TRUE(events.is_array());
  std::map<int, std::string> threads;
  for (const json& e : events) {
    EXPECT_EQ(e["pid"], 3);
    if (e["name"] == "thread_name") threads[e["tid"].get<int>()] = e["args"]["name"];
  }
  EXPECT_EQ(threads[0], "compute");
  EXPECT_EQ(threads[1], "communication");
  json trace = json::parse(chrome_trace_json({trace_events_json(p, 0), trace_events_json(p, 1)}));
  EXPECT_EQ(events_of(trace, 0, "M").size(), events_of(trace, 1, "M").size());
}

TEST(Profile, CommunicationSpansAreDrawnBackToBackInIssueOrder) {
  auto g = parse_graph(R"(graph @g(%x: f32[2]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[2]
  %b = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[2]
  return %a, %b
})");
  Profiler p;
  const Node* a = g->find_node("a");
  const Node* b = g->find_node("b");
  // Recorded at completion (b first), overlapping: b was issued before a completed.
  p.add(Span{.kind = SpanKind::Communication, .node = b, .begin_ns = 2000, .end_ns = 9000});
  p.add(Span{.kind = SpanKind::Communication, .node = a, .begin_ns = 1000, .end_ns = 5000});
  json events = json::parse(trace_events_json(p, 0));
  std::vector<json> comm;
  for (const json& e : events) {
    if (e["ph"] == "X") comm.push_back(e);
  }
  ASSERT_EQ(comm.size(), 2u);
  EXPECT_EQ(comm[0]["args"]["node"], "%a");
  EXPECT_EQ(comm[0]["tid"], 1);
  EXPECT_DOUBLE_EQ(comm[0]["ts"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(comm[0]["dur"].get<double>(), 4.0);
  EXPECT_EQ(comm[1]["args"]["node"], "%b");
  EXPECT_DOUBLE_EQ(comm[1]["ts"].get<double>(), 5.0);  // starts when %a ended
  EXPECT_DOUBLE_EQ(comm[1]["dur"].get<double>(), 4.0);
  EXPECT_DOUBLE_EQ(comm[1]["args"]["issue_us"].get<double>(), 2.0);
  EXPECT_EQ(comm[1]["name"], "all_reduce");
  EXPECT_EQ(comm[1]["args"]["line"], 3);
}

TEST(Profile, ExecutorRecordsEveryKindOfSpanPerIteration) {
  auto g = parse_graph(R"(graph @g(%x: f32[16], %y: f32[16]) {
  %ag = all_gather_into_tensor(%x) {group_size = 2, group = "world"} : f32[32]
  %n = neg(%y) : f32[16]
  %r = relu(%n) : f32[16]
  %w = wait_tensor(%ag) : f32[32]
  return %w, %r
})");
  std::vector<Profiler> profs(2);
  run_local(2, [&](ProcessGroup& world) {
    ExecutorOptions options;
    options.profiler = &profs[world.rank()];
    Executor ex(*g, world, options);
    for (int i = 0; i < 3; ++i) ex.run(make_inputs(*g, 0, world.rank()));
  });
  for (int r = 0; r < 2; ++r) {
    int compute = 0, comm = 0, wait = 0;
    for (const Span& s : profs[r].spans()) {
      EXPECT_LE(s.begin_ns, s.end_ns);
      EXPECT_GE(s.iteration, 0);
      EXPECT_LT(s.iteration, 3);
      compute += s.kind == SpanKind::Compute;
      comm += s.kind == SpanKind::Communication;
      wait += s.kind == SpanKind::Wait;
    }
    EXPECT_EQ(compute, 6);
    EXPECT_EQ(comm, 3);
    EXPECT_EQ(wait, 3);
  }
  json trace = json::parse(
      chrome_trace_json({trace_events_json(profs[0], 0), trace_events_json(profs[1], 1)}));
  for (int r = 0; r < 2; ++r) {
    std::set<int> tids;
    for (const json& e : events_of(trace, r, "X")) tids.insert(e["tid"].get<int>());
    EXPECT_EQ(tids, (std::set<int>{0, 1})) << "rank " << r;
  }
}

// align_epochs gives every rank one time 0: the ranks here share the clock, so every profiler
// of every rank gets the same epoch, however late a rank comes (rank 1 comes 50 ms after rank
// 0); one rank's own reading would differ from another's.
TEST(Profile, AlignEpochsGivesEveryRankOneTimeZero) {
  using Clock = std::chrono::steady_clock;
  std::array<Clock::time_point, 4> epochs{};
  run_local(2, [&](ProcessGroup& world) {
    Profiler a, b;
    world.barrier();
    if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const Clock::time_point before = Clock::now();
    Profiler* const both[] = {&a, &b};
    align_epochs(world, both);
    const auto r = static_cast<size_t>(world.rank());
    epochs[2 * r] = a.epoch();
    epochs[2 * r + 1] = b.epoch();
    EXPECT_GE(a.epoch(), before);  // the latest reading: no rank's time 0 before its own
    EXPECT_GE(a.now_ns(), 0);
  });
  for (const Clock::time_point& e : epochs) {
    EXPECT_EQ(e.time_since_epoch().count(), epochs[0].time_since_epoch().count());
  }
}

// align_epochs' all_reduce is funcol's own: a peer that issued an all_reduce of the same shape
// instead gets a mismatch naming align_epochs, not a clock reading as its result.
TEST(Profile, AlignEpochsNeverPairsWithAUsersCollective) {
  std::vector<std::string> errors(2, "no error");
  run_local(2, [&](ProcessGroup& world) {
    const int r = world.rank();
    Profiler p;
    Profiler* const mine[] = {&p};
    try {
      if (r == 0) {
        align_epochs(world, mine);
      } else {
        Tensor t = Tensor::from_vector<int64_t>({1, 7});
        world.all_reduce(t, ReduceOp::Max)->wait();
        errors[r] = "all_reduce completed: " + std::to_string(t.to_vector<int64_t>()[0]);
      }
    } catch (const CommError& e) {
      errors[r] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("[funcol's agreement step for align_epochs]"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace funcol
