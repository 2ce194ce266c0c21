// Failure scenarios for the process backends, one per run: every rank runs this program and
// prints "SCENARIO OK rank R: ..." when it saw what the scenario expects, or
// "SCENARIO FAILED rank R: ..." (exit 1) otherwise. run_scenario.sh counts the lines.
//
//   process_scenario --backend=gloo|mpi --scenario=kill|mismatch|timeout|step_pairing|depart
//
//  kill      the last rank raises SIGKILL mid-run; every survivor's next collective fails with
//            a CommError naming it within FUNCOL_TIMEOUT plus a few seconds
//  mismatch  (FUNCOL_DEBUG=detail) 100 collectives in flight at once each give their own
//            result; then ranks issue different collectives, then all_to_alls with
//            inconsistent split sizes, then all_reduce_flats whose inputs split the same total
//            differently, then new_group's agreement against a user's all_reduce, then a
//            backward's all_reduce against a user's (one rank's loss reaches more); each fails
//            on every rank showing both sides, and the group keeps working afterwards
//  count_limit  (mpi) a coalesced list with a tensor over MPI's int count fails on every rank
//            before any of it is posted; the group is unusable afterwards
//  timeout   the last rank stays away from a collective; the others time out naming it, and
//            when it issues the collective later it fails at once, saying it came too late
//  step_pairing  (without FUNCOL_DEBUG) rank 0 creates a group while rank 1 issues an
//            all_reduce of the shape and op of the creation's agreement step: they never pair
//            (the step's data travels apart), so both fail at the timeout instead of rank 1
//            returning the step's values (or Gloo aborting a rank on a longer message), and
//            the timeout says what each issued
//  depart    the last rank leaves (destroy_process_group) with collectives still in flight,
//            which complete for everyone; the others' next ones fail at once naming it
//  lonely    the last rank never calls init_process_group; the others fail after
//            FUNCOL_TIMEOUT: on gloo their rendezvous names it and takes its keys out of the
//            store, on mpi MPI_Init_thread (which waits for every rank) is given up on
//  split_kill  the last rank agrees to split_group([1..n-1]) and dies before the new group's
//            rendezvous (gloo) or MPI_Comm_split (mpi, under --enable-recovery); the members
//            fail at once naming it, not after FUNCOL_TIMEOUT
//  split_kill_arrived  (gloo, file store) the same for a group of the last two ranks, the
//            victim dying after its arrival key is in the store, before its address
//  exit      the last rank exits (status 0) without destroy_process_group; the others'
//            next collective fails at once saying so
//  failed_input  the last rank's all_reduce input holds the failed result of an earlier
//            collective: every rank's all_reduce fails at once naming it, and the group is
//            unusable afterwards; the collectives issued before it complete
//  two_failed_inputs  ranks 0 and 1 give up on seqs 2 and 1, in that order: every rank's seq 1
//            fails at once naming rank 1
//  stopped   the last rank stops (SIGSTOP) before a collective; the others time out naming it
//            missing and silent, and the launcher kills it
//  world_dead_arrival  (gloo, file store) the last rank writes its world arrival record, as
//            init_process_group would, and dies a second later, its address never there; the
//            others' init_process_group fails at once naming it (its identity, seen running,
//            says it ended), not after FUNCOL_TIMEOUT
//  group_disagree  rank 0 makes a named group where the others make it unnamed, then an
//            Executor where they make a group (no FUNCOL_DEBUG): every rank gets the
//            CommError at once each time, and the world still works
//  fork_kill  kill, the victim first forking a child that outlives it (no exec): the others
//            still fail at once naming the death (the child held the victim's connections open)
//  fork_child  the last rank forks a child (no exec) that returns from main through exit():
//            the child's exit handlers leave the world alone (they said goodbye for the rank,
//            and its peers failed it as departed; on mpi the child hung finalising MPI), and
//            the job goes on
//  split_no_files  (gloo) the last rank runs out of file descriptors while it makes a group:
//            the other members fail at once with its error, not after FUNCOL_TIMEOUT
//  reinit    every rank starts and destroys the world 45 times, an all_reduce in each: the
//            process keeps nothing of the worlds it destroyed (each used to keep its job)
//  linger    (--ready=DIR) every rank completes an all_reduce, writes DIR/rank<R> and stays
//            for a minute: gloo_launch_killed_test.sh kills the launcher meanwhile, which must
//            take every rank along
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>

#ifdef FUNCOL_WITH_GLOO
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#endif
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dist/checks.h"
#include "dist/multiprocess/process_group_base.h"
#include "funcol/api/autograd.h"
#include "funcol/api/functional.h"
#ifdef FUNCOL_WITH_GLOO
#include "dist/multiprocess/process_env.h"
#endif
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/work.h"
#include "funcol/graph/parser.h"
#include "funcol/runtime/executor.h"
#ifdef FUNCOL_WITH_MPI
#include <mpi.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;
using funcol::DType;
using funcol::ReduceOp;
using funcol::Tensor;

int g_rank = -1;

[[noreturn]] void failed(const std::string& why) {
  std::printf("SCENARIO FAILED rank %d: %s\n", g_rank, why.c_str());
  std::fflush(stdout);
  std::_Exit(1);
}

void ok(const std::string& what) {
  std::printf("SCENARIO OK rank %d: %s\n", g_rank, what.c_str());
  std::fflush(stdout);
}

// Called after ok() by a scenario whose every rank exits with status 1 (its group failed): mpirun
// stops the job at the first such exit, and a peer still on its way to its own report would be
// killed before it printed (failed_input: about once in 30 runs on 2 cores). The others'
// reports come within milliseconds of this one's.
void linger_for_peers_reports() { std::this_thread::sleep_for(std::chrono::seconds(1)); }

void expect_contains(const std::string& text, const std::string& part) {
  if (text.find(part) == std::string::npos) {
    failed(fmt::format("expected '{}' in: {}", part, text));
  }
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Runs fn, which must throw CommError; returns its message.
template <typename F>
std::string expect_comm_error(F&& fn, const std::string& what) {
  try {
    fn();
  } catch (const funcol::CommError& e) {
    return e.what();
  } catch (const std::exception& e) {
    failed(fmt::format("{}: expected CommError, got: {}", what, e.what()));
  }
  failed(fmt::format("{}: expected CommError, it succeeded", what));
}

void check_sum(funcol::ProcessGroup& world) {
  Tensor t = Tensor::full({16}, DType::I32, world.rank() + 1);
  world.all_reduce(t, ReduceOp::Sum)->wait();
  const int n = world.size();
  if (t.to_vector<int>()[0] != n * (n + 1) / 2) failed("all_reduce gave a wrong sum");
}

// Many collectives in flight at once, of two kinds, each with its own values, waited only
// afterwards: every one must give its own result. (mpi in detail mode posted a collective when
// its signature exchange completed, which ranks saw in different orders: results were mixed up
// between collectives, or MPI failed.)
void check_in_flight(funcol::ProcessGroup& world) {
  constexpr int kOps = 50;
  const int n = world.size();
  std::vector<Tensor> sums, gathered, halves;
  std::vector<std::shared_ptr<funcol::Work>> works;
  for (int i = 0; i < kOps; ++i) {
    sums.push_back(Tensor::full({4}, DType::I64, int64_t{1000} * i + world.rank() + 1));
    works.push_back(world.all_reduce(sums.back(), ReduceOp::Sum));
    if (i % 10 == 0) {  // large: on mpi an all-to-all, then an all-gather posted on its completion
      halves.push_back(Tensor::full({300001}, DType::F16, i + world.rank()));
      works.push_back(world.all_reduce(halves.back(), ReduceOp::Sum));
    }
    gathered.push_back(Tensor::empty({2 * n}, DType::I32));
    works.push_back(world.all_gather(gathered.back(), Tensor::full({2}, DType::I32, i * n +
                                                                        world.rank())));
  }
  for (auto& w : works) w->wait();
  for (int i = 0; i < kOps; ++i) {
    const int64_t want = int64_t{1000} * i * n + n * (n + 1) / 2;
    if (sums[i].to_vector<int64_t>() != std::vector<int64_t>(4, want)) {
      failed(fmt::format("in-flight all_reduce {} gave {} (want {})", i,
                         sums[i].to_vector<int64_t>()[0], want));
    }
    std::vector<int> want_g;
    for (int r = 0; r < n; ++r) want_g.insert(want_g.end(), 2, i * n + r);
    if (gathered[i].to_vector<int>() != want_g) {
      failed(fmt::format("in-flight all_gather {} gave wrong blocks", i));
    }
  }
  for (size_t k = 0; k < halves.size(); ++k) {
    const float want = static_cast<float>(10 * k * n + n * (n - 1) / 2);
    const std::vector<float> got = halves[k].to(DType::F32).to_vector<float>();
    if (std::any_of(got.begin(), got.end(), [&](float v) { return v != want; })) {
      failed(fmt::format("in-flight f16 all_reduce {} gave wrong sums", 10 * k));
    }
  }
}

double timeout_seconds() {
  return std::chrono::duration<double>(funcol::default_timeout()).count();
}

// `fork_first`: the victim first forks a child that does not exec and outlives it by 6 s
// (holding copies of its descriptors, the peer monitor's connections closed).
void scenario_kill(funcol::ProcessGroup& world, bool fork_first) {
  const int victim = world.size() - 1;
  check_sum(world);
  if (world.rank() == victim) {
    std::fflush(stdout);
    if (fork_first && ::fork() == 0) {
      std::this_thread::sleep_for(std::chrono::seconds(6));
      ::_exit(0);
    }
    std::raise(SIGKILL);
  }
  auto start = Clock::now();
  std::string msg = expect_comm_error(
      [&] {
        // Whichever collective is in flight when the rank dies must fail.
        world.barrier();
        for (int i = 0; i < 1000; ++i) check_sum(world);
      },
      "collectives after a rank died");
  const double took = seconds_since(start);
  expect_contains(msg, fmt::format("rank {} died", victim));
  // Missing: the victim, and any survivor that left without taking part in this collective
  // (its own was refused, the death known already), which the message says departed so.
  const size_t list = msg.find("missing ranks [");
  if (list == std::string::npos) failed("no missing ranks in: " + msg);
  std::string ranks = msg.substr(list + 15, msg.find(']', list) - list - 15);
  std::replace(ranks.begin(), ranks.end(), ',', ' ');
  std::istringstream in(ranks);
  bool victim_missing = false;
  for (int r = 0; in >> r;) {
    if (r == victim) {
      victim_missing = true;
    } else {
      expect_contains(msg,
                      fmt::format("rank {} departed (destroy_process_group) before joining", r));
    }
  }
  if (!victim_missing) failed(fmt::format("rank {} is not missing in: {}", victim, msg));
  // With a child that held the connections, the death showed only at the child's exit.
  if (took > (fork_first ? 3 : timeout_seconds() + 5)) {
    failed(fmt::format("the error took {:.1f} s", took));
  }
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

// Rank 0 creates a group (an agreement step: all_reduce of i64[2], op max) while the others
// issue an all_reduce of that shape and op; returns the CommError every rank must get.
std::string group_against_all_reduce(funcol::ProcessGroup& world) {
  return expect_comm_error(
      [&] {
        if (world.rank() == 0) {
          funcol::new_group(world, {0, 1});
        } else {
          Tensor t = Tensor::zeros({2}, DType::I64);
          world.all_reduce(t, ReduceOp::Max)->wait();
        }
      },
      "new_group's agreement against a user's all_reduce");
}

// Each rank's w (f32[3]) holds rank + 1; y = all_reduce_autograd(w); backward of sum(y * w)
// where `use_result`, else of sum(w * w); then an all_reduce of w's gradient, whose first
// element it returns.
float backward_of_all_reduce(funcol::ProcessGroup& world, bool use_result) {
  funcol::GradTape tape;
  const Tensor w = tape.requires_grad(Tensor::full({3}, DType::F32, world.rank() + 1));
  const Tensor y = funcol::all_reduce_autograd(w, "sum", world);
  const Tensor used = tape.call_one("mul", std::vector<Tensor>{use_result ? y : w, w});
  tape.backward(tape.call_one("sum", std::vector<Tensor>{used}));
  const float g = tape.grad(w).to_vector<float>()[0];
  funcol::all_reduce(tape.grad(w), "sum", world).to_vector<float>();
  return g;
}

void scenario_mismatch(funcol::ProcessGroup& world) {
  if (const char* d = std::getenv("FUNCOL_DEBUG"); d == nullptr || std::string(d) != "detail") {
    failed("run with FUNCOL_DEBUG=detail");
  }
  const int n = world.size();
  check_sum(world);
  check_in_flight(world);
  // Rank 0 all-reduces while the others all-gather.
  Tensor x = Tensor::full({8}, DType::F32, 1);
  Tensor gathered = Tensor::empty({8 * n}, DType::F32);
  std::string msg = expect_comm_error(
      [&] {
        if (world.rank() == 0) {
          world.all_reduce(x, ReduceOp::Sum)->wait();
        } else {
          world.all_gather(gathered, x)->wait();
        }
      },
      "mismatched collectives");
  expect_contains(msg, "mismatched collectives");
  expect_contains(msg, "rank 0 issued all_reduce(f32[8], op sum)");
  expect_contains(msg, "issued all_gather(f32[8])");
  // Same op, different dtype.
  std::string dtype_msg = expect_comm_error(
      [&] {
        Tensor t = Tensor::full({4}, world.rank() == 0 ? DType::F32 : DType::F64, 1);
        world.all_reduce(t, ReduceOp::Max)->wait();
      },
      "all_reduce with different dtypes");
  expect_contains(dtype_msg, "f32[4]");
  expect_contains(dtype_msg, "f64[4]");
  // Same op, dtype and element count, different shapes (torch.distributed's DETAIL mode
  // compares sizes too), also past the dims a signature holds in full.
  for (const auto& shapes : std::vector<std::pair<funcol::Shape, funcol::Shape>>{
           {{2, 3}, {3, 2}}, {{1, 1, 1, 1, 1, 2, 3}, {1, 1, 1, 1, 1, 3, 2}}}) {
    std::string shape_msg = expect_comm_error(
        [&] {
          Tensor t =
              Tensor::full(world.rank() == 0 ? shapes.first : shapes.second, DType::F32, 1);
          world.all_reduce(t, ReduceOp::Sum)->wait();
        },
        "all_reduce with different shapes");
    expect_contains(shape_msg, "mismatched collectives");
  }
  check_sum(world);  // the group stays usable
  // all_to_all: rank 0 sends rank 1 one row, rank 1 expects two from rank 0.
  std::vector<int64_t> in_splits(n, 1), out_splits(n, 1);
  if (world.rank() == 1) out_splits[0] = 2;
  int64_t rows_in = n, rows_out = world.rank() == 1 ? n + 1 : n;
  Tensor a = Tensor::zeros({rows_in, 3}, DType::I64);
  Tensor b = Tensor::zeros({rows_out, 3}, DType::I64);
  std::string split_msg = expect_comm_error(
      [&] { world.all_to_all(b, a, out_splits, in_splits)->wait(); }, "all_to_all split sizes");
  expect_contains(split_msg,
                  "mismatched split sizes: rank 0 sends 1 row to rank 1 but rank 1 "
                  "expects 2 rows from rank 0");
  // Rows of 3 elements on every rank, but rank 0's are [3] and the others' [1,3]: the rows'
  // shapes differ (they were paired silently, compared by size only).
  std::string row_msg = expect_comm_error(
      [&] {
        const funcol::Shape shape =
            world.rank() == 0 ? funcol::Shape{n, 3} : funcol::Shape{n, 1, 3};
        world.all_to_all(Tensor::zeros(shape, DType::I64), Tensor::zeros(shape, DType::I64),
                         std::vector<int64_t>(n, 1), std::vector<int64_t>(n, 1))
            ->wait();
      },
      "all_to_all rows of other shapes");
  expect_contains(row_msg, "rank 0 issued all_to_all(i64[*,3])");
  expect_contains(row_msg, "issued all_to_all(i64[*,1,3])");
  // Rank 0 sends itself 3 rows but expects 1 from itself, while every pair agrees: the
  // signatures show it to every rank, as the threads backend does. (Rows of two: rank 0's
  // signature showed its staged rows, flat, and every rank read a mismatch of row shapes.)
  std::vector<int64_t> own_in(n, 1), own_out(n, 1);
  if (world.rank() == 0) own_in[0] = 3;
  Tensor c = Tensor::zeros({world.rank() == 0 ? n + 2 : n, 2}, DType::I32);
  Tensor d = Tensor::zeros({n, 2}, DType::I32);
  std::string own_msg = expect_comm_error(
      [&] { world.all_to_all(d, c, own_out, own_in)->wait(); }, "all_to_all rows for itself");
  expect_contains(own_msg,
                  "mismatched split sizes: rank 0 sends 3 rows to rank 0 but rank 0 expects 1 "
                  "row from rank 0");
  // all_reduce_flat whose inputs add up to the same total but split differently (rank 0: 2 + 3
  // elements, the others 3 + 2): one packed all_reduce would reduce mismatched elements.
  auto flat_in = std::make_shared<std::vector<Tensor>>();
  flat_in->push_back(Tensor::full({world.rank() == 0 ? 2 : 3}, DType::F32, 1));
  flat_in->push_back(Tensor::full({world.rank() == 0 ? 3 : 2}, DType::F32, 1));
  Tensor flat_out = Tensor::empty({5}, DType::F32);
  std::string flat_msg = expect_comm_error(
      [&] { world.all_reduce_flat(flat_out, flat_in, ReduceOp::Sum)->wait(); },
      "all_reduce_flat with differently split inputs");
  expect_contains(flat_msg, "rank 0 issued all_reduce_flat(2 tensors: f32 numel 2, f32 numel 3, "
                            "op sum)");
  expect_contains(flat_msg, "issued all_reduce_flat(2 tensors: f32 numel 3, f32 numel 2, op sum)");
  // funcol's own collective inside new_group (its agreement on a name) against a user's
  // all_reduce of the same shape and op: a mismatch that names the agreement, on every rank.
  std::string step_msg = group_against_all_reduce(world);
  expect_contains(step_msg,
                  "rank 0 issued all_reduce(i64[2], op max) [funcol's agreement step for "
                  "new_group] but rank 1 issued all_reduce(i64[2], op max)");
  // A backward's collective against a user's all_reduce of the same shape (rank 0's loss
  // reaches the forward all_reduce, the others' do not): a mismatch that names the backward.
  // First every rank's loss reaches it: d(sum(y * w))/dw = y + sum of the ranks' w = n(n+1).
  if (const float g = backward_of_all_reduce(world, true); g != static_cast<float>(n * (n + 1))) {
    failed(fmt::format("a backward through all_reduce gave {}, not {}", g, n * (n + 1)));
  }
  std::string backward_msg = expect_comm_error(
      [&] { backward_of_all_reduce(world, world.rank() == 0); },
      "a backward's all_reduce against a user's");
  expect_contains(backward_msg,
                  "rank 0 issued all_reduce(f32[3], op sum) [issued by GradTape::backward] but "
                  "rank 1 issued all_reduce(f32[3], op sum)");
  // Every rank skipped the mismatched collectives: the group still works.
  world.barrier();
  check_sum(world);
  ok(fmt::format("mismatches reported on every rank: {}", msg));
}

void scenario_count_limit(funcol::ProcessGroup& world) {
  if (world.backend() != "mpi") failed("count_limit is an mpi scenario");
  check_sum(world);
  // The second tensor is over MPI's int count: the op fails on every rank before any request
  // is posted, so nothing is left running on its buffers. The 2 GiB buffer is never touched,
  // so its pages are never allocated.
  std::vector<Tensor> list = {Tensor::full({4}, DType::U8, 1),
                              Tensor::empty({int64_t{1} << 31}, DType::U8)};
  // Found by every rank alike, at once: not taken for a peer's doing (it waited half a second
  // for a lost peer, on the communication thread, and named rank 0, which had failed the same
  // way and left, as "departed before joining").
  if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto start = Clock::now();
  std::string msg = expect_comm_error(
      [&] { world.all_reduce_coalesced(list, ReduceOp::Sum)->wait(); }, "a count over INT_MAX");
  const double took = seconds_since(start);
  expect_contains(msg, "all_reduce_coalesced on group 'world' (seq 1): mpi: 2147483648 elements "
                       "exceed MPI's int count limit");
  if (msg.find("rank 0") != std::string::npos || msg.find("missing") != std::string::npos) {
    failed("the count limit blamed a peer: " + msg);
  }
  if (took > 0.3) failed(fmt::format("the count limit took {:.2f} s to report", took));
  // A failed collective leaves the group unusable (the job then exits without MPI_Finalize).
  std::string after = expect_comm_error([&] { world.barrier(); }, "a barrier after it");
  expect_contains(after, "unusable after an earlier failure");
  ok(fmt::format("count limit reported on every rank: {}", msg));
  linger_for_peers_reports();
}

// A rank whose group failed on its own (an mpi count over INT_MAX, refused before anything is
// posted), then refused its next collective at issue, leaves; the other waits in the collective
// the leaver never took part in. Its goodbye counts only what it took part in, so the waiting
// rank fails within a second of it. (The refused ones counted as issued: the other waited out
// its whole timeout, taking its collective for done by the leaver.)
void scenario_refused_then_departure(funcol::ProcessGroup& world) {
  if (world.backend() != "mpi") failed("refused_then_departure is an mpi scenario");
  check_sum(world);
  if (world.rank() == 0) {
    std::vector<Tensor> list = {Tensor::empty({int64_t{1} << 31}, DType::U8)};
    std::string msg = expect_comm_error(
        [&] { world.all_reduce_coalesced(list, ReduceOp::Sum)->wait(); }, "a count over INT_MAX");
    expect_contains(msg, "exceed MPI's int count limit");
    std::string after = expect_comm_error([&] { world.barrier(); }, "a barrier after it");
    expect_contains(after, "unusable after an earlier failure");
    // The other rank issues its collective first (the refusal is immediate: its departure
    // could come before that issue, which then fails as issued on a group known unusable).
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    funcol::set_departure_error("RuntimeError: rank 0's own error");
    funcol::destroy_process_group();
    ok("left");
    // A rank that failed ends the mpi job when it exits: the other has reported by then.
    std::this_thread::sleep_for(std::chrono::seconds(4));
    return;
  }
  Tensor t = Tensor::full({4}, DType::I32, 1);
  auto work = world.all_reduce(t, ReduceOp::Sum);
  const auto start = Clock::now();
  std::string msg = expect_comm_error([&] { work->wait(); }, "a collective rank 0 never joined");
  const double took = seconds_since(start);
  expect_contains(msg, "rank 0 departed after an error (RuntimeError: rank 0's own error) before "
                       "joining");
  expect_contains(msg, "missing ranks [0]");
  if (took > 5) failed(fmt::format("the error took {:.1f} s", took));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

void scenario_timeout(funcol::ProcessGroup& world) {
  const int late = world.size() - 1;
  check_sum(world);
  if (world.rank() == late) {
    // The slow rank: stays away past the others' timeout (the scenario itself, not a sync),
    // then issues the collective they gave up on: it fails at once, saying it came too late,
    // and so does the next one.
    std::this_thread::sleep_for(std::chrono::duration<double>(timeout_seconds() + 1.5));
    const auto start = Clock::now();
    std::string msg = expect_comm_error([&] { check_sum(world); }, "a collective issued late");
    expect_contains(msg, fmt::format("missing ranks [{}]", late));
    expect_contains(msg, fmt::format("rank {} issued it only after the others had given up on it",
                                     late));
    std::string next = expect_comm_error([&] { world.barrier(); }, "a barrier after it");
    expect_contains(next, "unusable after an earlier failure");
    const double took = seconds_since(start);
    if (took > 1) failed(fmt::format("the late rank's errors took {:.2f} s", took));
    ok(fmt::format("came late: {}", msg));
    // An mpi rank that failed ends the job when it exits: the other has reported by now.
    std::this_thread::sleep_for(std::chrono::duration<double>(4));
    return;
  }
  auto start = Clock::now();
  std::string msg = expect_comm_error([&] { check_sum(world); }, "a collective a rank skipped");
  const double took = seconds_since(start);
  // The timeout in force, as on threads (not the time measured, which drifts under load).
  expect_contains(msg, fmt::format("timed out after {:g} s; ", timeout_seconds()));
  expect_contains(msg, fmt::format("missing ranks [{}]", late));
  if (took < timeout_seconds() - 0.5 || took > timeout_seconds() + 3) {
    failed(fmt::format("timed out after {:.2f} s with FUNCOL_TIMEOUT {:.1f} s", took,
                       timeout_seconds()));
  }
  // Issued right after the timeout woke this rank: the group is unusable by then.
  std::string next = expect_comm_error([&] { world.barrier(); }, "a barrier after the timeout");
  expect_contains(next, "unusable after an earlier failure");
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
  // Stays until the late rank has issued (an mpi rank that failed ends the job when it exits).
  std::this_thread::sleep_for(std::chrono::duration<double>(4));
}

void scenario_step_pairing(funcol::ProcessGroup& world) {
  check_sum(world);
  const auto start = Clock::now();
  std::string msg = group_against_all_reduce(world);
  const double took = seconds_since(start);
  expect_contains(msg, "timed out after");
  // Every rank had issued a collective as seq 1: the timeout says they differ.
  expect_contains(msg, "the ranks issued different collectives as seq 1: rank 0 issued "
                       "all_reduce(i64[2], op max) [funcol's agreement step for new_group] but "
                       "rank 1 issued all_reduce(i64[2], op max)");
  if (world.rank() == 0) expect_contains(msg, "new_group: agreeing with the other ranks");
  if (took > timeout_seconds() + 3) failed(fmt::format("the error took {:.1f} s", took));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
  linger_for_peers_reports();
}

// The ranks issue different collectives as one seq (unchecked without FUNCOL_DEBUG=detail) and
// time out: each rank's error names its own collective, whichever rank gave up first. (A rank
// that heard of the other's timeout first failed with the other's error as it was: "barrier on
// group 'world' (seq 1): ..." for its all_reduce.)
void scenario_different_timeout(funcol::ProcessGroup& world) {
  check_sum(world);
  const auto start = Clock::now();
  std::string msg = expect_comm_error(
      [&] {
        if (world.rank() == 0) {
          world.barrier();
        } else {
          check_sum(world);
        }
      },
      "different collectives");
  const double took = seconds_since(start);
  const std::string own = fmt::format("{} on group 'world' (seq 1): ",
                                      world.rank() == 0 ? "barrier" : "all_reduce");
  if (msg.rfind(own, 0) != 0) {
    failed(fmt::format("the error does not begin with '{}': {}", own, msg));
  }
  expect_contains(msg, "timed out after");
  expect_contains(msg, "the ranks issued different collectives as seq 1");
  if (took > timeout_seconds() + 3) failed(fmt::format("the error took {:.1f} s", took));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

// Without FUNCOL_DEBUG=detail nothing compares the ranks' calls before they run. Collectives of
// one kind that differ in size, element type or reduction, or all_to_alls whose split sizes
// disagree, each on a group of its own (a group is unusable after a timeout): every rank's
// fails at the timeout naming what each issued, and none completes with another's bytes. (On
// gloo, sizes paired: Gloo aborted the rank that received more, and the other's output kept a
// tail never written.)
void scenario_unchecked_mismatch(funcol::ProcessGroup& world) {
  check_sum(world);
  const bool first = world.rank() == 0;
  using Issue = std::function<std::shared_ptr<funcol::Work>(funcol::ProcessGroup&)>;
  struct Case {
    const char* what;
    Issue issue;
    const char* expect;  // in every rank's error
  };
  constexpr const char* kDifferent = "the ranks issued different collectives as seq 0";
  const Case cases[] = {
      {"sizes",
       [&](funcol::ProcessGroup& g) {
         return g.all_reduce(Tensor::full({first ? 8 : 16}, DType::F32, 1), ReduceOp::Sum);
       },
       kDifferent},
      {"dtypes",
       [&](funcol::ProcessGroup& g) {
         return g.all_reduce(Tensor::full({4}, first ? DType::F32 : DType::I32, 1), ReduceOp::Sum);
       },
       kDifferent},
      {"reduce_ops",
       [&](funcol::ProcessGroup& g) {
         const ReduceOp op = first ? ReduceOp::Sum : ReduceOp::Max;
         return g.all_reduce(Tensor::full({4}, DType::F32, 1), op);
       },
       kDifferent},
      {"gather_sizes",
       [&](funcol::ProcessGroup& g) {
         const int64_t n = first ? 4 : 6;
         return g.all_gather(Tensor::empty({2 * n}, DType::F32), Tensor::full({n}, DType::F32, 1));
       },
       kDifferent},
      // Rank 0 sends rank 1 three rows, rank 1 expects two (every other piece agrees).
      {"split sizes",
       [&](funcol::ProcessGroup& g) {
         const std::vector<int64_t> out = first ? std::vector<int64_t>{1, 2}
                                                : std::vector<int64_t>{2, 2};
         const std::vector<int64_t> in = first ? std::vector<int64_t>{1, 3}
                                               : std::vector<int64_t>{2, 2};
         return g.all_to_all(Tensor::empty({out[0] + out[1]}, DType::F32),
                             Tensor::full({4}, DType::F32, 1), out, in);
       },
       "the ranks issued seq 0 with mismatched split sizes: rank 0 sends 3 rows to rank 1 but "
       "rank 1 expects 2 rows from rank 0"},
  };
  std::vector<std::shared_ptr<funcol::ProcessGroup>> groups;
  for (const Case& c : cases) groups.push_back(funcol::new_group(world, {0, 1}, c.what));
  if (world.rank() > 1) return;
  for (size_t i = 0; i < groups.size(); ++i) {
    const Case& c = cases[i];
    const auto start = Clock::now();
    const std::string msg = expect_comm_error([&] { c.issue(*groups[i])->wait(); },
                                              fmt::format("different {}", c.what));
    const double took = seconds_since(start);
    expect_contains(msg, "timed out after");
    expect_contains(msg, c.expect);
    if (took > timeout_seconds() + 3) failed(fmt::format("the error took {:.1f} s", took));
    ok(fmt::format("different {}: CommError after {:.2f} s: {}", c.what, took, msg));
  }
}

// Broadcasts whose ranks disagree on the root (unchecked without FUNCOL_DEBUG=detail), on 3 or
// 4 ranks: the last rank takes rank n-2 for the root, the others rank 0. No rank may complete
// with another root's data. On gloo the ranks that agree with rank 0's tree and get all they
// need from it (n=3: rank 1; n=4: ranks 0 and 1) complete with rank 0's data; the other two
// fail naming both sides. Before, the two trees paired: with 4 ranks rank 3 completed with rank
// 0's data as if rank 2 had sent it, and every rank reported success; with 3, ranks 0 and 2 got
// a bare "Connection closed by peer" when rank 1 left. On mpi the last rank fails naming the
// difference, also when the others completed and left (their goodbye says what they issued;
// it said "every rank issued it but mpi did not complete it"). The failing ranks stay a
// timeout longer, so that each answers the other's progress query.
void scenario_broadcast_roots(funcol::ProcessGroup& world) {
  const int n = world.size();
  const int r = world.rank();
  if (n != 3 && n != 4) failed("broadcast_roots runs on 3 or 4 ranks");
  const int root = r == n - 1 ? n - 2 : 0;
  const bool gloo = world.backend() == "gloo";
  const int a = n == 3 ? 0 : 2;  // on gloo the two that fail: a (root 0) and the last
  const bool must_fail = r == n - 1 || (gloo && r == a);
  const bool may_fail = must_fail || !gloo;
  Tensor x = Tensor::full({8}, DType::F32, 10 + r);
  std::string msg;
  try {
    const std::vector<float> got = funcol::broadcast(x, root, "world").to_vector<float>();
    if (must_fail) failed(fmt::format("rank {} completed with {} for root {}", r, got[0], root));
    if (got != std::vector<float>(8, 10.0f)) {
      failed(fmt::format("rank {} got {} from root 0", r, got[0]));
    }
    ok("completed with rank 0's data");
    return;
  } catch (const funcol::CommError& e) {
    msg = e.what();
    if (!may_fail) failed(fmt::format("rank {} failed: {}", r, msg));
  }
  // Rank 0's side, from it or from its goodbye, comes first.
  expect_contains(msg, fmt::format("the ranks issued different collectives as seq 0: rank 0 "
                                   "issued broadcast(f32[8], src 0) but rank {} issued "
                                   "broadcast(f32[8], src {})",
                                   n - 1, n - 2));
  std::this_thread::sleep_for(std::chrono::duration<double>(timeout_seconds() + 1));
  ok(msg);
}

// After a rank left: the next collectives (issued until one fails) fail within 10 s with a
// CommError saying `how` it left.
void expect_departure(funcol::ProcessGroup& world, const std::string& how) {
  auto start = Clock::now();
  std::string msg = expect_comm_error(
      [&] {
        for (int i = 0; i < 1000; ++i) check_sum(world);
      },
      "collectives after a rank left");
  const double took = seconds_since(start);
  expect_contains(msg, how);
  if (took > 10) failed(fmt::format("the error took {:.1f} s", took));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

// A collective a rank never waits for fails: the last rank leaves without issuing it. Nothing
// else would report it (the rank's program ends as if it had run), so destroy_process_group,
// which finds it still in flight, warns, naming it (the test greps the warning). The leaver
// leaves a second after the others issued it.
void scenario_unwaited(funcol::ProcessGroup& world) {
  check_sum(world);
  if (world.rank() == world.size() - 1) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    funcol::destroy_process_group();
    ok("left without issuing");
    return;
  }
  world.all_reduce(Tensor::full({4}, DType::F32, 1), ReduceOp::Sum);  // its result dropped
  ok("issued, not waited for");
  funcol::destroy_process_group();
}

// The same when the collective failed long before the rank ended: the last rank has left when
// the others issue it, so it fails at once; they drop the result, see the failure only through
// is_completed(), and go on. destroy_process_group warns of it (the test greps the warning),
// but not of a later one whose failure a wait threw.
void scenario_dropped_failed(funcol::ProcessGroup& world) {
  check_sum(world);
  if (world.rank() == world.size() - 1) {
    funcol::destroy_process_group();
    ok("left without issuing");
    return;
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  std::shared_ptr<funcol::Work> dropped =
      world.all_reduce(Tensor::full({4}, DType::F32, 1), ReduceOp::Sum);
  const auto start = std::chrono::steady_clock::now();
  while (!dropped->is_completed()) {
    if (seconds_since(start) > 10) failed("the collective did not fail within 10 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!dropped->failed()) failed("the collective did not fail");
  dropped.reset();
  try {
    world.all_reduce(Tensor::full({4}, DType::F32, 1), ReduceOp::Sum)->wait();
    failed("the second collective did not fail");
  } catch (const funcol::CommError&) {
  }
  ok("dropped a failed result, waited for a failed one");
  funcol::destroy_process_group();
}

void scenario_depart(funcol::ProcessGroup& world) {
  const int leaver = world.size() - 1;
  const int n = world.size();
  check_sum(world);
  // Every rank issues collectives it never waits for (their results dropped), and one it reads
  // only after the leaver destroyed its process group: what the leaver issued completes, for
  // it and for the others. (Its goodbye used to go out with them still running: the others
  // failed them, and on mpi the leaver hung or exited 1.) The others come 300 ms late, so the
  // leaver reaches destroy_process_group long before they issue their part.
  if (world.rank() != leaver) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (int i = 0; i < 20; ++i) {
    world.all_reduce(Tensor::full({1 << 20}, DType::F32, 1), ReduceOp::Sum);
  }
  Tensor kept = Tensor::full({3}, DType::I64, world.rank() + 1);
  world.all_reduce(kept, ReduceOp::Sum);
  // Collectives the leaver's part of completes without the others: an empty all_reduce (no
  // transport) and, on mpi, a small broadcast from it (sent at once; Gloo's root waits for its
  // receivers). The others issue them only after its goodbye, and they still complete: it took
  // part. (They were refused, naming it as missing.)
  Tensor empty = Tensor::zeros({0}, DType::F32);
  Tensor small = Tensor::full({2}, DType::I32, world.rank() + 1);
  const bool eager_broadcast = world.backend() == "mpi";
  if (world.rank() == leaver) {
    world.all_reduce(empty, ReduceOp::Sum);
    if (eager_broadcast) world.broadcast(small, leaver);
    // It leaves because of an error of its own: the others' errors name it (its first line).
    funcol::set_departure_error("ShapeError: the leaver's own error\nits second line");
    funcol::destroy_process_group();
    if (kept.to_vector<int64_t>() != std::vector<int64_t>(3, n * (n + 1) / 2)) {
      failed("a collective issued before destroy_process_group gave a wrong sum");
    }
    ok("left");
    return;
  }
  if (kept.to_vector<int64_t>() != std::vector<int64_t>(3, n * (n + 1) / 2)) {
    failed("a collective the leaver issued gave a wrong sum");
  }
  // Its goodbye arrives meanwhile (it comes within milliseconds of its leaving; on a host so
  // slow that it comes later, this part checks nothing new and still passes).
  std::this_thread::sleep_for(std::chrono::seconds(1));
  world.all_reduce(empty, ReduceOp::Sum)->wait();
  if (eager_broadcast) {
    world.broadcast(small, leaver)->wait();
    if (small.to_vector<int32_t>() != std::vector<int32_t>(2, leaver + 1)) {
      failed("a broadcast the leaver sent before leaving gave a wrong value");
    }
  }
  expect_departure(world, fmt::format("rank {} departed after an error (ShapeError: the "
                                      "leaver's own error)",
                                      leaver));
}

// One member dies in a collective that another never issues: that one leaves cleanly (an error
// of its own) while the others wait. Their error names the death as well as the departure, and
// both as missing. (The departure, read after the death, used to fail the collective at once
// naming only the rank that left, which had left because of the death.)
void scenario_death_then_departure(funcol::ProcessGroup& world) {
  const int victim = world.size() - 1;
  const int leaver = world.size() - 2;
  check_sum(world);
  if (world.rank() == leaver) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // after the death
    funcol::set_departure_error("RuntimeError: the leaver's own error");
    funcol::destroy_process_group();
    ok("left");
    return;
  }
  Tensor t = Tensor::full({16}, DType::I32, 1);
  auto work = world.all_reduce(t, ReduceOp::Sum);
  if (world.rank() == victim) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::fflush(stdout);
    std::raise(SIGKILL);
  }
  auto start = Clock::now();
  std::string msg =
      expect_comm_error([&] { work->wait(); }, "a collective whose members died and left");
  const double took = seconds_since(start);
  expect_contains(msg, fmt::format("rank {} died (its process exited or was killed)", victim));
  expect_contains(msg, fmt::format("rank {} departed after an error (RuntimeError: the leaver's "
                                   "own error) before joining",
                                   leaver));
  expect_contains(msg, fmt::format("missing ranks [{}, {}]", leaver, victim));
  if (took > 5) failed(fmt::format("the error took {:.1f} s", took));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

// The victim's part in split_group's agreement on `members` as "sub" (an all_reduce of a hash
// of what each rank passed, and whether the name is taken: nowhere), without making the group.
// Labelled as split_group's own step: its data travels apart from a user's.
void agree_to_split(funcol::ProcessGroup& world, const std::vector<int>& members) {
  const funcol::dist_detail::InternalStep step("split_group");
  Tensor header = funcol::dist_detail::split_header();
  world.all_reduce(header, ReduceOp::Max)->wait();
  Tensor probe = funcol::dist_detail::split_probe(
      funcol::dist_detail::split_description({members}, "sub"), /*taken=*/false);
  world.all_reduce(probe, ReduceOp::Max)->wait();
}

// split_group of `members` as "sub" on a rank other than the victim, which never takes its part:
// the CommError's message, or nullopt on a rank outside the group (reported OK: it has nothing
// to wait for).
std::optional<std::string> split_error(funcol::ProcessGroup& world,
                                       const std::vector<int>& members) {
  try {
    auto group = world.split_group({members}, "sub");
    if (group != nullptr) failed("split_group returned a group with the victim");
    ok("not a member");
    return std::nullopt;
  } catch (const funcol::CommError& e) {
    return e.what();
  }
}

void scenario_split_kill(funcol::ProcessGroup& world) {
  const int victim = world.size() - 1;
  check_sum(world);
  // A group of ranks 1..n-1, so that group ranks differ from global ranks in the messages.
  std::vector<int> members;
  for (int r = 1; r < world.size(); ++r) members.push_back(r);
  if (world.rank() == victim) {
    // Agree, then die before the new group's own setup.
    agree_to_split(world, members);
    std::fflush(stdout);
    std::raise(SIGKILL);
  }
  auto start = Clock::now();
  std::shared_ptr<funcol::ProcessGroup> group;
  std::string msg;
  try {
    group = world.split_group({members}, "sub");
  } catch (const funcol::CommError& e) {
    msg = e.what();
  }
  const double took = seconds_since(start);
  if (msg.empty()) {
    // gloo: a rank outside the new group has nothing to wait for.
    if (group != nullptr) failed("split_group returned a group without the dead rank");
    ok("not a member");
    return;
  }
  expect_contains(msg, fmt::format("rank {} died", victim));
  expect_contains(msg, fmt::format("{}]", victim));
  if (took > 5) failed(fmt::format("the error took {:.1f} s: {}", took, msg));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

// The last rank runs out of file descriptors while it makes a group of ranks 1..n-1 (its soft
// RLIMIT_NOFILE lowered to `spare` more than it holds; gloo, whose rendezvous opens the store's
// files): it fails naming `Too many open files`, and the other members fail at once with its
// error, instead of waiting for it until FUNCOL_TIMEOUT and then naming it as not arrived (or
// as dead). Twice: failing to read the store (no spare) and to write its arrival (one spare).
// The world works afterwards.
void scenario_split_no_files(funcol::ProcessGroup& world) {
  const int victim = world.size() - 1;
  check_sum(world);
  std::vector<int> members;
  for (int r = 1; r < world.size(); ++r) members.push_back(r);
  rlimit saved{};
  if (::getrlimit(RLIMIT_NOFILE, &saved) != 0) failed("getrlimit failed");
  std::string report;
  for (const int spare : {0, 1}) {
    const auto start = Clock::now();
    std::string msg;
    try {
      if (world.rank() == victim) {
        const int lowest_free = ::dup(0);  // every descriptor below it is open
        if (lowest_free < 0) failed("dup failed");
        ::close(lowest_free);
        rlimit low = saved;
        low.rlim_cur = static_cast<rlim_t>(lowest_free + spare);
        if (::setrlimit(RLIMIT_NOFILE, &low) != 0) failed("setrlimit failed");
      }
      const auto group = world.split_group({members}, fmt::format("sub{}", spare));
      if (world.rank() != 0) failed("split_group succeeded");
      if (group != nullptr) failed("split_group returned a group to a rank in no list");
    } catch (const funcol::CommError& e) {
      msg = e.what();
    }
    if (::setrlimit(RLIMIT_NOFILE, &saved) != 0) failed("setrlimit failed");
    const double took = seconds_since(start);
    if (world.rank() != 0) {
      expect_contains(msg, "Too many open files");
      if (world.rank() != victim) {
        expect_contains(msg, fmt::format("rank {} gave up on it", victim));
      }
      if (took > 5) failed(fmt::format("the error took {:.1f} s: {}", took, msg));
      report += fmt::format("{}CommError after {:.2f} s: {}", report.empty() ? "" : "; ", took,
                            msg);
    }
    check_sum(world);
  }
  ok(report.empty() ? "not a member" : report);
}

// An i32[16] of ones; with `holds_failure`, holding the failure of an earlier collective
// instead.
Tensor all_reduce_input(bool holds_failure) {
  Tensor t = Tensor::full({16}, DType::I32, 1);
  if (holds_failure) {
    auto earlier = std::make_shared<funcol::Work>("an earlier collective");
    earlier->fail(std::make_exception_ptr(funcol::CommError("the earlier collective failed")));
    t.storage()->add_pending(earlier);
  }
  return t;
}

// The last rank's input holds the failed result of an earlier collective (a Work failed by
// hand here): it still takes the all_reduce's place in the group's sequence, and every rank's
// all_reduce fails at once naming it (not at the timeout, and no rank pairs its next collective
// with another's); the group is unusable afterwards on every rank. The collectives issued
// before it complete on every rank, also those the others issue only after the last rank gave
// up (the last rank failed its own, still in flight, and dropped its part of them: the others
// waited in them until their timeout, or refused to issue them).
void scenario_failed_input(funcol::ProcessGroup& world) {
  const int culprit = world.size() - 1;
  const int n = world.size();
  check_sum(world);
  // The others come 0.3 s later: the last rank's are still in flight when it gives up.
  if (world.rank() != culprit) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::vector<Tensor> before;
  std::vector<std::shared_ptr<funcol::Work>> before_works;
  for (int i = 0; i < 3; ++i) {
    before.push_back(Tensor::full({1000}, DType::I64, int64_t{100} * i + world.rank()));
    before_works.push_back(world.all_reduce(before.back(), ReduceOp::Sum));
  }
  const Tensor t = all_reduce_input(world.rank() == culprit);
  const auto start = Clock::now();
  const std::string msg = expect_comm_error([&] { world.all_reduce(t, ReduceOp::Sum)->wait(); },
                                            "all_reduce with the last rank's input failed");
  const double took = seconds_since(start);
  for (int i = 0; i < 3; ++i) {
    before_works[i]->wait();
    const int64_t want = int64_t{100} * i * n + int64_t{n} * (n - 1) / 2;
    if (before[i].to_vector<int64_t>() != std::vector<int64_t>(1000, want)) {
      failed(fmt::format("the all_reduce before it, seq {}, gave a wrong sum", i + 1));
    }
  }
  if (seconds_since(start) > 5) {
    failed(fmt::format("the collectives before it took {:.1f} s", seconds_since(start)));
  }
  expect_contains(msg, "all_reduce on group 'world' (seq 4)");
  expect_contains(msg, fmt::format("rank {} could not take part: its tensor holds the failed "
                                   "result of an earlier collective (the earlier collective "
                                   "failed)",
                                   culprit));
  if (took > 5) failed(fmt::format("the error took {:.1f} s: {}", took, msg));
  const std::string next = expect_comm_error([&] { check_sum(world); }, "the next all_reduce");
  expect_contains(next, "could not take part");
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
  linger_for_peers_reports();
}

// Two ranks' inputs hold failures at different collectives, the lower one second: rank 0's at
// seq 2 (its seq 1 in flight), rank 1's at seq 1 0.3 s later; the others issue both 0.6 s in.
// The lower seq decides: every rank's seq 1 fails at once naming rank 1. (The second news was
// dropped, the first had decided: the others ran seq 1 without rank 1 and waited in it until
// their timeout.)
void scenario_two_failed_inputs(funcol::ProcessGroup& world) {
  if (world.size() < 3) failed("needs 3 ranks");
  const int r = world.rank();
  check_sum(world);
  std::this_thread::sleep_for(std::chrono::milliseconds(300 * std::min(r, 2)));
  const auto start = Clock::now();
  const Tensor a = all_reduce_input(r == 1);
  const Tensor b = all_reduce_input(r == 0);
  const auto first = world.all_reduce(a, ReduceOp::Sum);
  const auto second = world.all_reduce(b, ReduceOp::Sum);
  const std::string msg = expect_comm_error([&] { first->wait(); }, "seq 1");
  const double took = seconds_since(start);
  expect_contains(msg, "all_reduce on group 'world' (seq 1): rank 1 could not take part");
  const std::string next = expect_comm_error([&] { second->wait(); }, "seq 2");
  expect_contains(next, "all_reduce on group 'world' (seq 2)");
  if (took > 5) failed(fmt::format("seq 1 failed after {:.1f} s: {}", took, msg));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
  linger_for_peers_reports();
}

// The same on groups used as soon as they are made, each once: the last rank, whose input
// holds a failure, gives up at once and tells the others, which may not have registered the
// group yet (it finished making it first). They fail at once all the same: the news waits for
// the group. (It was dropped: such a rank waited for the timeout, about 1 run in 3.)
void scenario_failed_input_new_group(funcol::ProcessGroup& world) {
  const int culprit = world.size() - 1;
  std::vector<int> all(static_cast<size_t>(world.size()));
  std::iota(all.begin(), all.end(), 0);
  double slowest = 0;
  for (int i = 0; i < 20; ++i) {
    auto group = funcol::new_group(world, all, fmt::format("fresh{}", i));
    const Tensor t = all_reduce_input(world.rank() == culprit);
    const auto start = Clock::now();
    const std::string msg = expect_comm_error([&] { group->all_reduce(t, ReduceOp::Sum)->wait(); },
                                              "all_reduce with the last rank's input failed");
    const double took = seconds_since(start);
    expect_contains(msg, fmt::format("rank {} could not take part", culprit));
    if (took > 5) failed(fmt::format("group {}: the error took {:.1f} s: {}", i, took, msg));
    slowest = std::max(slowest, took);
  }
  check_sum(world);
  ok(fmt::format("20 fresh groups failed at once (the slowest after {:.2f} s)", slowest));
}

// Rank 0 makes a named group where the others make it unnamed: their agreement steps differ
// (without FUNCOL_DEBUG=detail they paired: gloo aborted a rank inside its transport, mpi
// truncated one rank's data and went on). Every rank gets the CommError at once; the world
// still works.
void scenario_group_disagree(funcol::ProcessGroup& world) {
  check_sum(world);
  std::vector<int> all(static_cast<size_t>(world.size()));
  std::iota(all.begin(), all.end(), 0);
  const std::string msg = expect_comm_error(
      [&] { funcol::new_group(world, all, world.rank() == 0 ? "named" : ""); },
      "a named group against an unnamed one");
  expect_contains(msg, "new_group on group 'world': the ranks ran different steps of funcol's "
                       "agreement between ranks");
  check_sum(world);
  // An Executor's graph check (an all_gather of one i64 a rank) against a group's agreement
  // (all_reduces of i64[2]): paired on gloo and mpi before both began with a header.
  const auto graph = funcol::parse_graph(R"(graph @g(%x: f32[2]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[2]
  %w = wait_tensor(%ar) : f32[2]
  return %w
})");
  const std::string executor_msg = expect_comm_error(
      [&] {
        if (world.rank() == 0) {
          funcol::Executor executor(*graph, world);
        } else {
          funcol::new_group(world, all, "");
        }
      },
      "an Executor against a new_group");
  expect_contains(executor_msg, world.rank() == 0 ? "Executor on group 'world'"
                                                  : "new_group on group 'world'");
  expect_contains(executor_msg, "the ranks ran different steps");
  check_sum(world);
  ok(fmt::format("every rank refused it: {}", msg));
}

void scenario_fork_child(funcol::ProcessGroup& world) {
  check_sum(world);
  if (world.rank() == world.size() - 1) {
    std::fflush(stdout);
    const pid_t child = ::fork();
    if (child < 0) failed("fork failed");
    if (child == 0) std::exit(0);  // the exit handlers of a process with a world
    int status = 0;
    const auto start = Clock::now();
    while (::waitpid(child, &status, WNOHANG) == 0) {
      if (seconds_since(start) > 10) {
        ::kill(child, SIGKILL);
        failed("the forked child did not exit within 10 s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed(fmt::format("the forked child ended with status {:#x}", status));
    }
  }
  for (int i = 0; i < 20; ++i) check_sum(world);
  world.barrier();
  ok("the job went on after the forked child's exit");
}

// The last rank exits (status 0) without destroy_process_group: the others' next collective
// fails at once saying so, not that it called destroy_process_group.
void scenario_exit(funcol::ProcessGroup& world) {
  const int leaver = world.size() - 1;
  check_sum(world);
  if (world.rank() == leaver) {
    ok("exits");
    std::fflush(stdout);
    std::exit(0);
  }
  expect_departure(
      world,
      fmt::format("rank {} departed (its process exited without destroy_process_group)", leaver));
}

// The victim stops itself (SIGSTOP) for good. It says so first with its process id; the
// launcher kills it once the others are done (run_scenario.sh under mpirun, gloo_launch.sh):
// a survivor that killed it could do so while another survivor still asked it for its
// progress, which then saw a death instead.
[[noreturn]] void stop_self() {
  std::printf("SCENARIO STOPPED pid %d\n", static_cast<int>(::getpid()));
  std::fflush(stdout);
  std::raise(SIGSTOP);
  failed("resumed after SIGSTOP");
}

// A timeout's error `msg` names the stopped `victim` as missing and as not answering.
void expect_silent(const std::string& msg, int victim) {
  expect_contains(msg, fmt::format("missing ranks [{}]", victim));
  expect_contains(msg, fmt::format("ranks [{}] did not answer a progress query", victim));
}

// Every rank completes an all_reduce, says so with a file DIR/rank<R>, and stays: its launcher
// is killed meanwhile, and the rank must end with it well within the minute.
void scenario_linger(funcol::ProcessGroup& world, const std::string& ready) {
  if (ready.empty()) failed("linger needs --ready=DIR");
  check_sum(world);
  std::ofstream(fmt::format("{}/rank{}", ready, world.rank())) << "joined\n";
  std::this_thread::sleep_for(std::chrono::seconds(60));
  failed("still running a minute after joining");
}

// The last rank stops (SIGSTOP) before a collective: its peer monitor cannot answer either.
// The others time out naming it missing and saying it did not answer.
void scenario_stopped(funcol::ProcessGroup& world) {
  const int victim = world.size() - 1;
  world.barrier();
  if (world.rank() == victim) stop_self();
  auto start = Clock::now();
  std::string msg = expect_comm_error([&] { check_sum(world); }, "a collective a rank skipped");
  const double took = seconds_since(start);
  expect_silent(msg, victim);
  if (took > timeout_seconds() + 3) failed(fmt::format("the error took {:.1f} s", took));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

#ifdef FUNCOL_WITH_GLOO
// Writes `record` as the arrival record of the member at `index` of the gloo rendezvous under
// `prefix` (in FUNCOL_STORE, a file store), as the backend would.
void arrive(const std::string& prefix, int index, const std::string& record) {
  const char* store = std::getenv("FUNCOL_STORE");
  if (store == nullptr || std::strncmp(store, "file://", 7) != 0) failed("needs a file store");
  gloo::rendezvous::FileStore files(store + 7);
  gloo::rendezvous::PrefixStore prefixed(prefix, files);
  prefixed.set(fmt::format("arrive/{}", index), std::vector<char>(record.begin(), record.end()));
}

// The rendezvous prefix of split_group's "sub" of `members` (two ranks), and the arrival record
// of its second member: the group's size, FUNCOL_DEBUG off, no monitor address.
std::string sub_prefix(const std::vector<int>& members) {
  return fmt::format("funcol/world/split0/sub/{}-{}", members[0], members[1]);
}
constexpr const char* kSubRecord = "2 plain -";
#endif

// The last rank agrees to a new group with the rank before it, then stops (SIGSTOP) where the
// group is made (gloo: after writing its arrival record, so that the other member waits for
// its address; mpi: before MPI_Comm_split). The others time out naming it missing and saying
// it did not answer (they named nobody, or a rank that left because of it).
void scenario_split_stopped(funcol::ProcessGroup& world, const std::string& backend) {
  const int victim = world.size() - 1;
  world.barrier();
  const std::vector<int> members = {victim - 1, victim};
  if (world.rank() == victim) {
    agree_to_split(world, members);
#ifdef FUNCOL_WITH_GLOO
    if (backend == "gloo") arrive(sub_prefix(members), 1, kSubRecord);
#endif
    stop_self();
  }
  auto start = Clock::now();
  const std::optional<std::string> error = split_error(world, members);
  if (!error) return;
  const std::string& msg = *error;
  const double took = seconds_since(start);
  expect_silent(msg, victim);
  // The timeout, Gloo's wait for the address (gloo), and a second for the progress query.
  if (took > timeout_seconds() + 5) failed(fmt::format("the error took {:.1f} s", took));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

#ifdef FUNCOL_WITH_GLOO
// The victim of a gloo rendezvous scenario: arrives (arrive), stays `linger` seconds, then
// dies before its address is there.
[[noreturn]] void arrive_and_die(const std::string& prefix, int index, const std::string& record,
                                 double linger) {
  arrive(prefix, index, record);
  std::this_thread::sleep_for(std::chrono::duration<double>(linger));
  std::fflush(stdout);
  std::raise(SIGKILL);
  std::abort();  // not reached
}

// A file store (FUNCOL_STORE=file://DIR) holds no key: the next job can use it. Another
// store is not looked at.
void expect_file_store_empty(const std::string& after) {
  const char* store_env = std::getenv("FUNCOL_STORE");
  const std::string store = store_env != nullptr ? store_env : "";
  if (store.rfind("file://", 0) != 0) return;
  const std::filesystem::path dir = store.substr(7);
  if (!std::filesystem::is_empty(dir)) {
    failed(fmt::format("{} left keys in {}", after, dir.string()));
  }
}

// A survivor's rendezvous error `msg`, `took` seconds after it began: it names the victim's
// death, at once.
void expect_died_during_rendezvous(const std::string& msg, double took, int victim) {
  expect_contains(msg, fmt::format("rank {} died (its process exited or was killed) during the "
                                   "rendezvous; missing ranks [{}]",
                                   victim, victim));
  if (took > 5) failed(fmt::format("the error took {:.1f} s: {}", took, msg));
  ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
}

// gloo: the victim agrees to the new group and writes its arrival key, as its rendezvous
// would, then dies before its address is there. The other member sees every arrival and waits
// for that address inside Gloo's connectFullMesh: it must fail at once naming the dead rank,
// not at the timeout.
void scenario_split_kill_arrived(funcol::ProcessGroup& world) {
  const int victim = world.size() - 1;
  check_sum(world);
  const std::vector<int> members = {victim - 1, victim};
  if (world.rank() == victim) {
    agree_to_split(world, members);
    arrive_and_die(sub_prefix(members), 1, kSubRecord, 0);
  }
  auto start = Clock::now();
  const std::optional<std::string> msg = split_error(world, members);
  if (!msg) return;
  const double took = seconds_since(start);
  // The dead member's arrival key went with this member's own: it would fail the next job
  // that makes this group (the non-member has written nothing since the world's rendezvous).
  expect_file_store_empty("the failed rendezvous of 'sub'");
  expect_died_during_rendezvous(*msg, took, victim);
}

// gloo: the last rank writes its world arrival record, as init_process_group would, and dies a
// second later; the others' init_process_group fails at once naming it.
void scenario_world_dead_arrival(const std::string& backend) {
  const char* rank = std::getenv("RANK");
  const char* size = std::getenv("WORLD_SIZE");
  if (rank == nullptr || size == nullptr) failed("run under gloo_launch.sh");
  g_rank = std::atoi(rank);
  const int victim = std::atoi(size) - 1;
  if (g_rank == victim) {
    // The world's size, FUNCOL_DEBUG off, no monitor address, this process; running long
    // enough for the others to see it running (only a process seen running, then gone, counts
    // as dead).
    arrive_and_die("funcol/world", victim,
                   fmt::format("{} plain - {}", size, funcol::process::process_identity()), 1);
  }
  auto start = Clock::now();
  std::string msg = expect_comm_error([&] { funcol::init_process_group(backend); },
                                      "init_process_group with a rank dead after arriving");
  expect_died_during_rendezvous(msg, seconds_since(start), victim);
}
#endif

#ifdef FUNCOL_WITH_MPI
// Counts the MPI_Comm_free calls of the backend (MPI's profiling interface: this definition
// stands in for the library's, which PMPI_Comm_free is).
std::atomic<int> g_comm_frees{0};
}  // namespace
extern "C" int MPI_Comm_free(MPI_Comm* comm) {
  g_comm_frees.fetch_add(1);
  return PMPI_Comm_free(comm);
}
namespace {
#endif

// A destroyed world's job goes at the latest at the next init_process_group: on mpi the
// communication thread may drop the world group's last reference a moment after
// destroy_process_group returns. Two worlds of slack keep the check free of that race.
void scenario_reinit(const std::string& backend) {
  constexpr int kCycles = 45;
  std::vector<std::weak_ptr<funcol::process::ProcessJob>> jobs;
  for (int i = 0; i < kCycles; ++i) {
    auto world = funcol::init_process_group(backend);
    g_rank = world->rank();
    jobs.push_back(dynamic_cast<funcol::process::ProcessGroupBase&>(*world).job());
    Tensor x = Tensor::full({4}, DType::I32, world->rank() + 1);
    const int n = world->size();
    world->all_reduce(x, ReduceOp::Sum)->wait();
    if (x.to_vector<int>() != std::vector<int>(4, n * (n + 1) / 2)) failed("a wrong sum");
#ifdef FUNCOL_WITH_MPI
    // Every earlier world's two communicators were freed (the communication thread frees them
    // in order, before this all_reduce), on the rank that leaves last too.
    if (backend == "mpi" && g_comm_frees.load() < 2 * i) {
      failed(fmt::format("{} communicators freed after {} worlds", g_comm_frees.load(), i));
    }
#endif
    world.reset();
    // Rank 0 leaves last: it reads its peers' goodbyes first.
    if (g_rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    funcol::destroy_process_group();
    for (int k = 0; k + 2 <= i; ++k) {
      if (!jobs[k].expired()) {
        failed(fmt::format("world {} kept its job after {} more worlds", k, i - k));
      }
    }
  }
  ok(fmt::format("{} worlds started and destroyed, none kept", kCycles));
}

#ifdef FUNCOL_WITH_GLOO
// Rank 0 gives up (its timeout is 2 s) on a collective the last rank issues only after 6 s;
// the ranks between, with a 40 s timeout, wait in Gloo for the last rank. Their collective
// fails when rank 0 gives up, and destroy_process_group returns at once: it used to wait for
// the group's worker, which stayed in Gloo's wait until their own timeout. Every rank but 0
// is told that rank 0 gave up (they read rank 0's timeout as if it were their own).
void scenario_abandoned(const std::string& backend) {
  const char* rank = std::getenv("RANK");
  if (rank == nullptr) failed("run under gloo_launch.sh");
  g_rank = std::atoi(rank);
  funcol::InitOptions options;
  options.timeout = std::chrono::seconds(g_rank == 0 ? 2 : 40);
  auto world = funcol::init_process_group(backend, options);
  check_sum(*world);
  const int late = world->size() - 1;
  const auto start = Clock::now();
  if (g_rank == late) std::this_thread::sleep_for(std::chrono::seconds(6));
  const std::string msg = expect_comm_error([&] { check_sum(*world); }, "an abandoned all_reduce");
  const double took = seconds_since(start);
  expect_contains(msg, g_rank == 0 ? "all_reduce on group 'world' (seq 1): timed out after 2 s"
                                    : "all_reduce on group 'world' (seq 1): rank 0 gave up on "
                                      "it: timed out after 2 s");
  if (g_rank == late) {
    expect_contains(msg, fmt::format("; rank {} issued it only after the others had given up on it",
                                     late));
  }
  if (g_rank != late && took > 10) failed(fmt::format("the error took {:.1f} s", took));
  world.reset();
  const auto destroying = Clock::now();
  funcol::destroy_process_group();
  const double destroyed = seconds_since(destroying);
  if (destroyed > 3) failed(fmt::format("destroy_process_group took {:.1f} s", destroyed));
  ok(fmt::format("CommError after {:.2f} s, destroyed in {:.2f} s: {}", took, destroyed, msg));
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::string backend, scenario, ready;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--backend=", 10) == 0) backend = argv[i] + 10;
    if (std::strncmp(argv[i], "--scenario=", 11) == 0) scenario = argv[i] + 11;
    if (std::strncmp(argv[i], "--ready=", 8) == 0) ready = argv[i] + 8;
  }
  if (backend.empty() || scenario.empty()) {
    std::fprintf(stderr,
                 "usage: process_scenario --backend=gloo|mpi "
                 "--scenario=kill|mismatch|timeout|step_pairing|depart|lonely|split_kill|"
                 "split_kill_arrived|exit|stopped|split_stopped|world_dead_arrival|reinit|"
                 "abandoned|fork_child|fork_kill|group_disagree|split_no_files|linger "
                 "[--ready=DIR]\n");
    return 2;
  }
#ifdef FUNCOL_WITH_GLOO
  if (scenario == "world_dead_arrival") {
    scenario_world_dead_arrival(backend);
    return 0;
  }
  if (scenario == "abandoned") {
    scenario_abandoned(backend);
    return 0;
  }
#endif
  if (scenario == "reinit") {
    scenario_reinit(backend);
    return 0;
  }
  if (scenario == "bad_options") {
    // The last rank passes InitOptions::rank 0, which MPI's numbering contradicts: it fails with
    // InvalidArgument, and the others at once with a CommError naming it and why (they waited
    // out the timeout, told only that some rank did not arrive).
    const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
    const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
    if (backend != "mpi" || rank == nullptr || size == nullptr) failed("run under mpirun");
    g_rank = std::atoi(rank);
    const int bad = std::atoi(size) - 1;
    const auto start = Clock::now();
    std::string msg;
    try {
      funcol::InitOptions options;
      if (g_rank == bad) options.rank = 0;
      funcol::init_process_group(backend, options);
      failed("init_process_group succeeded");
    } catch (const funcol::InvalidArgument& e) {
      if (g_rank != bad) failed(fmt::format("InvalidArgument on a good rank: {}", e.what()));
      msg = e.what();
      expect_contains(msg, fmt::format("InitOptions::rank 0 differs from MPI's rank {}", bad));
    } catch (const funcol::CommError& e) {
      if (g_rank == bad) failed(fmt::format("CommError on the bad rank: {}", e.what()));
      msg = e.what();
      expect_contains(msg, fmt::format("rank {} cannot join: InitOptions::rank 0 differs from "
                                       "MPI's rank {}; missing ranks [{}]",
                                       bad, bad, bad));
    }
    const double took = seconds_since(start);
    if (took > 5) failed(fmt::format("the error took {:.1f} s", took));
    ok(fmt::format("error after {:.2f} s: {}", took, msg));
    return 0;
  }
  if (scenario == "lonely") {
    // The last rank never calls init_process_group: the others fail at their timeout.
    const bool mpi = backend == "mpi";
    const char* rank = std::getenv(mpi ? "OMPI_COMM_WORLD_RANK" : "RANK");
    const char* size = std::getenv(mpi ? "OMPI_COMM_WORLD_SIZE" : "WORLD_SIZE");
    if (rank == nullptr || size == nullptr) failed("run under gloo_launch.sh or mpirun");
    g_rank = std::atoi(rank);
    const int late = std::atoi(size) - 1;
    if (g_rank == late) {
      // Under mpirun a rank that returns without MPI_Init ends the job: stay until the others
      // gave up (mpirun then ends this one with them).
      if (mpi) std::this_thread::sleep_for(std::chrono::duration<double>(timeout_seconds() + 20));
      ok("never joined");
      return 0;
    }
    auto start = Clock::now();
    std::string msg = expect_comm_error([&] { funcol::init_process_group(backend); },
                                        "init_process_group without the last rank");
    const double took = seconds_since(start);
    expect_contains(msg, mpi ? fmt::format("init_process_group timed out after {} ms in "
                                           "MPI_Init_thread",
                                           funcol::default_timeout().count())
                             : fmt::format("did not arrive: [{}]", late));
    if (took > timeout_seconds() + 3) failed(fmt::format("the error took {:.1f} s", took));
    // With two ranks nobody else wrote to the store: the failed rendezvous left it empty, ready
    // for the next job.
    if (late == 1) expect_file_store_empty("the failed rendezvous");
    ok(fmt::format("CommError after {:.2f} s: {}", took, msg));
    return 0;
  }
  try {
    auto world = funcol::init_process_group(backend);
    g_rank = world->rank();
    if (world->size() < 2) failed("needs at least 2 ranks");
    if (scenario == "kill" || scenario == "fork_kill") {
      scenario_kill(*world, scenario == "fork_kill");
    } else if (scenario == "mismatch") {
      scenario_mismatch(*world);
    } else if (scenario == "count_limit") {
      scenario_count_limit(*world);
    } else if (scenario == "refused_then_departure") {
      scenario_refused_then_departure(*world);
    } else if (scenario == "timeout") {
      scenario_timeout(*world);
    } else if (scenario == "step_pairing") {
      scenario_step_pairing(*world);
    } else if (scenario == "different_timeout") {
      scenario_different_timeout(*world);
    } else if (scenario == "unchecked_mismatch") {
      scenario_unchecked_mismatch(*world);
    } else if (scenario == "broadcast_roots") {
      scenario_broadcast_roots(*world);
    } else if (scenario == "depart") {
      scenario_depart(*world);
    } else if (scenario == "unwaited") {
      scenario_unwaited(*world);
    } else if (scenario == "dropped_failed") {
      scenario_dropped_failed(*world);
    } else if (scenario == "split_kill") {
      scenario_split_kill(*world);
    } else if (scenario == "death_then_departure") {
      scenario_death_then_departure(*world);
    } else if (scenario == "exit") {
      scenario_exit(*world);
    } else if (scenario == "failed_input") {
      scenario_failed_input(*world);
    } else if (scenario == "two_failed_inputs") {
      scenario_two_failed_inputs(*world);
    } else if (scenario == "failed_input_new_group") {
      scenario_failed_input_new_group(*world);
    } else if (scenario == "split_no_files") {
      scenario_split_no_files(*world);
    } else if (scenario == "group_disagree") {
      scenario_group_disagree(*world);
    } else if (scenario == "fork_child") {
      scenario_fork_child(*world);
    } else if (scenario == "stopped") {
      scenario_stopped(*world);
    } else if (scenario == "linger") {
      scenario_linger(*world, ready);
    } else if (scenario == "split_stopped") {
      scenario_split_stopped(*world, backend);
#ifdef FUNCOL_WITH_GLOO
    } else if (scenario == "split_kill_arrived") {
      scenario_split_kill_arrived(*world);
#endif
    } else {
      failed("unknown scenario " + scenario);
    }
    world.reset();
    funcol::destroy_process_group();
  } catch (const std::exception& e) {
    failed(fmt::format("unexpected error: {}", e.what()));
  }
  return 0;
}
