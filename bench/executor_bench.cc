// executor_bench: the executor's cost per node beyond the kernel, on a chain of cheap ops.
//
// Usage: executor_bench [NODES] [--reps K] [--check]
// Runs a graph of NODES (default 10000) chained `neg` on f32[1] through the Executor, and, side
// by side in the same process, the same NODES kernel calls in a plain loop (the reference: the
// op table's kernel, its result vector, freeing the previous value). overhead/node = (executor
// time - reference time) / NODES, best of K interleaved repetitions each. Also reports the
// executor with profiling on. Times are the thread's CPU time (clock_gettime
// CLOCK_THREAD_CPUTIME_ID), so time descheduled on a shared machine does not count. With
// --check it exits 1 when the overhead exceeds the 1 us target.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "funcol/dist/backend.h"
#include "funcol/graph/graph.h"
#include "funcol/graph/ops.h"
#include "funcol/graph/parser.h"
#include "funcol/runtime/executor.h"
#include "funcol/runtime/profile.h"

namespace {

// CPU time of the calling thread: time spent descheduled on a shared machine does not count.
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

std::string chain_graph(int nodes) {
  std::string text = "graph @chain(%x: f32[1]) {\n";
  text.reserve(static_cast<size_t>(nodes) * 40);
  std::string prev = "x";
  for (int i = 0; i < nodes; ++i) {
    std::string name = "v" + std::to_string(i);
    text += "  %" + name + " = neg(%" + prev + ") : f32[1]\n";
    prev = std::move(name);
  }
  text += "  return %" + prev + "\n}\n";
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  int nodes = 10000;
  int reps = 30;
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--check") == 0) {
      check = true;
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else {
      nodes = std::max(1, std::atoi(argv[i]));
    }
  }
  const auto graph = funcol::parse_graph(chain_graph(nodes));
  const funcol::OpDef& neg = funcol::get_op("neg");
  const std::vector<funcol::Attr> no_attrs;

  double best_exec = 1e30, best_ref = 1e30, best_prof = 1e30;
  float checksum = 0;
  funcol::run_local(1, [&](funcol::ProcessGroup& world) {
    funcol::Executor ex(*graph, world);
    funcol::Profiler profiler;
    funcol::ExecutorOptions popts;
    popts.profiler = &profiler;
    funcol::Executor pex(*graph, world, popts);
    const funcol::Tensor x = funcol::Tensor::full({1}, funcol::DType::F32, 1.0);
    ex.run({x});  // warm up the allocator
    for (int r = 0; r < reps; ++r) {
      double t0 = thread_seconds();
      auto out = ex.run({x});
      best_exec = std::min(best_exec, thread_seconds() - t0);
      checksum += out[0].item<float>();

      t0 = thread_seconds();
      funcol::Tensor t = x;
      for (int i = 0; i < nodes; ++i) {
        std::vector<funcol::Tensor> res =
            neg.kernel(std::span<const funcol::Tensor>(&t, 1), funcol::AttrList(neg, no_attrs));
        t = std::move(res[0]);
      }
      best_ref = std::min(best_ref, thread_seconds() - t0);
      checksum += t.item<float>();

      profiler.clear();
      t0 = thread_seconds();
      out = pex.run({x});
      best_prof = std::min(best_prof, thread_seconds() - t0);
    }
  });
  const double per_node_exec = best_exec / nodes * 1e9;
  const double per_node_ref = best_ref / nodes * 1e9;
  const double per_node_prof = best_prof / nodes * 1e9;
  const double overhead = per_node_exec - per_node_ref;
  std::printf("# executor_bench: %d x neg on f32[1], best of %d (checksum %g)\n", nodes, reps,
              static_cast<double>(checksum));
  std::printf("%-34s %10s\n", "measure", "ns/node");
  std::printf("%-34s %10.1f\n", "kernel loop (reference)", per_node_ref);
  std::printf("%-34s %10.1f\n", "executor", per_node_exec);
  std::printf("%-34s %10.1f\n", "executor, profiling on", per_node_prof);
  std::printf("%-34s %10.1f   (target <= 1000)\n", "executor overhead beyond kernel", overhead);
  if (check && overhead > 1000.0) {
    std::fprintf(stderr, "executor_bench: overhead %.1f ns/node exceeds the 1 us target\n",
                 overhead);
    return 1;
  }
  return 0;
}
