// fusion_bench: bucketed vs unbucketed collectives on the threads backend, side by side.
//
// Usage: fusion_bench [--ranks N] [--iters K] [--mode MODE] [--check]
// For each kind (all_gather, reduce_scatter, all_reduce) and each shape (1000 collectives of
// 4 KiB, 100 of 256 KiB; the size is each collective's input on one rank), builds a graph of
// independent collectives, each followed by its wait_tensor, and the same graph after the
// kind's bucketing pass (default cap: one bucket; --mode picks the packing, default "default").
// Every rank runs both graphs through its own Executor, interleaved, K times after two warm-up
// runs; an iteration's time is the slowest rank's wall time for that run (ranks start each
// run after a barrier). Reports the median of each and speedup = unbucketed / bucketed.
// Targets: 1000 x 4 KiB >= 10x, 100 x 256 KiB >= 1.0x ("bucketing is never slower"). Outputs
// of the two graphs are compared bit for bit on every rank. With --check it exits 1 when a
// target is missed or an output differs.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "funcol/dist/backend.h"
#include "funcol/graph/parser.h"
#include "funcol/passes/bucketing.h"
#include "funcol/runtime/executor.h"

namespace {

struct Case {
  funcol::CollectiveKind kind;
  const char* name;
  int count;
  int64_t bytes;
  double target;
};

std::string graph_text(const Case& c, int ranks) {
  const int64_t n = c.bytes / 4;  // f32 elements of each input
  std::string text = "graph @fusion(";
  for (int i = 0; i < c.count; ++i) {
    text += (i ? ", %x" : "%x") + std::to_string(i) + ": f32[" + std::to_string(n) + "]";
  }
  text += ") {\n";
  const std::string g = std::to_string(ranks);
  for (int i = 0; i < c.count; ++i) {
    const std::string s = std::to_string(i);
    text += "  %c" + s + " = ";
    switch (c.kind) {
      case funcol::CollectiveKind::AllGather:
        text += "all_gather_into_tensor(%x" + s + ") {group_size = " + g + ", group = \"world\"}";
        break;
      case funcol::CollectiveKind::ReduceScatter:
        text += "reduce_scatter_tensor(%x" + s + ") {reduce_op = \"sum\", group_size = " + g +
                ", group = \"world\"}";
        break;
      default: text += "all_reduce(%x" + s + ") {reduce_op = \"sum\", group = \"world\"}"; break;
    }
    text += "\n  %w" + s + " = wait_tensor(%c" + s + ")\n";
  }
  text += "  return ";
  for (int i = 0; i < c.count; ++i) text += (i ? ", %w" : "%w") + std::to_string(i);
  text += "\n}\n";
  return text;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4;
  int iters = 20;
  bool check = false;
  funcol::BucketMode mode = funcol::BucketMode::Default;
  try {
    for (int i = 1; i < argc; ++i) {
      if (!std::strcmp(argv[i], "--check")) {
        check = true;
      } else if (!std::strcmp(argv[i], "--ranks") && i + 1 < argc) {
        ranks = std::max(1, std::atoi(argv[++i]));
      } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
        iters = std::max(1, std::atoi(argv[++i]));
      } else if (!std::strcmp(argv[i], "--mode") && i + 1 < argc) {
        mode = funcol::parse_bucket_mode(argv[++i]);
      } else {
        std::fprintf(stderr, "usage: fusion_bench [--ranks N] [--iters K] [--mode M] [--check]\n");
        return 2;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusion_bench: %s\n", e.what());
    return 2;
  }
  using K = funcol::CollectiveKind;
  const std::vector<Case> cases = {
      {K::AllGather, "all_gather", 1000, 4096, 10.0},
      {K::ReduceScatter, "reduce_scatter", 1000, 4096, 10.0},
      {K::AllReduce, "all_reduce", 1000, 4096, 10.0},
      {K::AllGather, "all_gather", 100, 262144, 1.0},
      {K::ReduceScatter, "reduce_scatter", 100, 262144, 1.0},
      {K::AllReduce, "all_reduce", 100, 262144, 1.0},
  };
  std::printf(
      "# threads backend, %d ranks, %d iterations, mode %s; time = median over iterations "
      "of the slowest rank\n",
      ranks, iters, std::string(funcol::bucket_mode_name(mode)).c_str());
  std::printf("%-15s %6s %8s %14s %14s %9s %7s %4s %9s\n", "collective", "count", "bytes",
              "unbucketed_ms", "bucketed_ms", "speedup", "target", "met", "identical");
  bool ok = true;
  for (const Case& c : cases) {
    const std::string text = graph_text(c, ranks);
    funcol::BucketOptions opts;
    opts.kind = c.kind;
    opts.mode = c.kind == K::AllGather        ? mode
                : funcol::is_custom_ops(mode) ? funcol::BucketMode::CustomOps
                                              : funcol::BucketMode::Default;
    // times[rank][iter][0: unbucketed, 1: bucketed]
    std::vector<std::vector<std::array<double, 2>>> times(
        static_cast<size_t>(ranks), std::vector<std::array<double, 2>>(static_cast<size_t>(iters)));
    std::vector<int> identical(static_cast<size_t>(ranks), 1);
    try {
      funcol::run_local(ranks, [&](funcol::ProcessGroup& world) {
        // Each rank owns its graphs (graphs are not shared across threads).
        const auto plain = funcol::parse_graph(text);
        auto bucketed = funcol::parse_graph(text);
        funcol::bucket_collectives(*bucketed, opts);
        funcol::Executor ex_plain(*plain, world);
        funcol::Executor ex_bucket(*bucketed, world);
        const auto inputs = funcol::make_inputs(*plain, 1, world.rank());
        auto a = ex_plain.run(inputs);
        auto b = ex_bucket.run(inputs);
        for (size_t i = 0; i < a.size(); ++i) {
          if (!a[i].equal(b[i])) identical[static_cast<size_t>(world.rank())] = 0;
        }
        ex_plain.run(inputs);
        ex_bucket.run(inputs);
        auto& mine = times[static_cast<size_t>(world.rank())];
        for (int it = 0; it < iters; ++it) {
          for (int which = 0; which < 2; ++which) {
            world.barrier();
            const auto t0 = std::chrono::steady_clock::now();
            auto out = (which == 0 ? ex_plain : ex_bucket).run(inputs);
            const auto t1 = std::chrono::steady_clock::now();
            mine[static_cast<size_t>(it)][static_cast<size_t>(which)] =
                std::chrono::duration<double, std::milli>(t1 - t0).count();
          }
        }
      });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fusion_bench: %s x %d: %s\n", c.name, c.count, e.what());
      ok = false;
      continue;
    }
    std::vector<double> plain_ms, bucket_ms;
    for (int it = 0; it < iters; ++it) {
      double p = 0, b = 0;
      for (int r = 0; r < ranks; ++r) {
        p = std::max(p, times[static_cast<size_t>(r)][static_cast<size_t>(it)][0]);
        b = std::max(b, times[static_cast<size_t>(r)][static_cast<size_t>(it)][1]);
      }
      plain_ms.push_back(p);
      bucket_ms.push_back(b);
    }
    const double p = median(plain_ms), b = median(bucket_ms);
    const double speedup = b > 0 ? p / b : 0;
    const bool same = std::all_of(identical.begin(), identical.end(), [](int v) { return v; });
    const bool met = speedup >= c.target;
    std::printf("%-15s %6d %8lld %14.3f %14.3f %8.2fx %6.1fx %4s %9s\n", c.name, c.count,
                static_cast<long long>(c.bytes), p, b, speedup, c.target, met ? "yes" : "no",
                same ? "yes" : "NO");
    std::fflush(stdout);
    if (!same || (check && !met)) ok = false;
  }
  return ok ? 0 : 1;
}
