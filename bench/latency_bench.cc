// latency_bench: a 2-rank in-place all_reduce on the threads backend next to the smallest
// protocol that can do the same job, measured side by side in one run (RESULTS.md, issue 2).
//
// The minimal protocol has no queue, no op objects and no failure handling: each thread
// publishes its buffer and bumps one shared arrival counter; the last to arrive reduces both
// buffers in rank order into rank 0's, copies the result to rank 1's and publishes a done
// counter the other spins on. It shows how much of funcol's latency is protocol and how much is
// the machine (cache-line handoffs and the data's cache misses). A variant with a fixed
// executor (rank 1 always reduces) keeps the data in one core's cache, as a loop that never
// reads its results allows; it is the floor, not a design.
//
// Both sides run one thread per CPU (as `funcol bench`: see LocalOptions::bind_threads).
//
// Usage: latency_bench [--iters N]   (prints one table; run on a quiet machine)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dist/affinity.h"
#include "dist/spin.h"
#include "funcol/core/kernels.h"
#include "funcol/funcol.h"
#include "tools/bench.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Stats {
  double p50 = 0;
  double mean = 0;
};

Stats summarize(std::vector<double> us) {
  Stats s;
  if (us.empty()) return s;
  double sum = 0;
  for (double x : us) sum += x;
  s.mean = sum / static_cast<double>(us.size());
  std::nth_element(us.begin(), us.begin() + static_cast<std::ptrdiff_t>(us.size() / 2), us.end());
  s.p50 = us[us.size() / 2];
  return s;
}

// funcol: rank 0's per-call times of ProcessGroup::all_reduce + wait on a f32[numel] tensor.
Stats funcol_all_reduce(int64_t numel, int iters) {
  std::vector<double> times;
  funcol::LocalOptions bound;
  bound.bind_threads = true;  // as the minimal protocol's threads: one per CPU
  auto rank = [&](funcol::ProcessGroup& pg) {
    funcol::Tensor t = funcol::Tensor::zeros({numel}, funcol::DType::F32);
    for (int i = 0; i < iters / 10; ++i) {
      pg.all_reduce(t, funcol::ReduceOp::Sum)->wait();
      t.wait();
    }
    pg.barrier();
    std::vector<double> mine(static_cast<size_t>(iters));
    for (int i = 0; i < iters; ++i) {
      const auto t0 = Clock::now();
      pg.all_reduce(t, funcol::ReduceOp::Sum)->wait();
      t.wait();
      mine[static_cast<size_t>(i)] =
          std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    }
    if (pg.rank() == 0) times = std::move(mine);
  };
  funcol::run_local(2, rank, bound);
  return summarize(std::move(times));
}

// The minimal protocol; `fixed`: rank 1 always executes.
Stats minimal_all_reduce(int64_t numel, int iters, bool fixed) {
  struct alignas(64) Box {
    std::atomic<int64_t> seq{0};
    float* buf = nullptr;
  };
  struct alignas(64) Counter {
    std::atomic<int64_t> v{0};
  };
  Box box[2];
  Counter arrivals, done;
  const auto n = static_cast<size_t>(numel);
  const int total = iters + iters / 10;
  std::vector<double> times(static_cast<size_t>(iters));
  auto spin_until = [](const std::atomic<int64_t>& a, int64_t v) {
    funcol::dist_detail::poll_until([&] { return a.load(std::memory_order_acquire) >= v; }, 4096);
  };
  auto body = [&](int r) {
    funcol::dist_detail::CpuBinding binding(funcol::tools::reference_cpu(r));
    std::vector<float> buf(n, 0.0f);
    for (int64_t i = 1; i <= total; ++i) {
      const auto t0 = Clock::now();
      box[r].buf = buf.data();
      box[r].seq.store(i, std::memory_order_release);
      const int64_t arrived = arrivals.v.fetch_add(1, std::memory_order_acq_rel) + 1;
      const bool execute = fixed ? r == 1 : arrived == 2 * i;
      if (execute) {
        spin_until(box[1 - r].seq, i);
        // funcol's own kernel, so that only the protocol differs.
        const void* srcs[2] = {box[0].buf, box[1].buf};
        funcol::reduce_buffers(funcol::ReduceOp::Sum, funcol::DType::F32, box[0].buf, srcs, 2,
                               numel);
        std::memcpy(box[1].buf, box[0].buf, n * sizeof(float));
        done.v.store(i, std::memory_order_release);
      } else {
        spin_until(done.v, i);
      }
      const int64_t timed = i - (total - iters) - 1;
      if (r == 0 && timed >= 0) {
        times[static_cast<size_t>(timed)] =
            std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      }
    }
  };
  std::thread peer(body, 1);
  body(0);
  peer.join();
  return summarize(std::move(times));
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 100000;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iters" && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: latency_bench [--iters N]\n");
      return 2;
    }
  }
  if (iters < 10) {
    std::fprintf(stderr, "latency_bench: --iters must be at least 10\n");
    return 2;
  }
  const double handoff = funcol::tools::measure_handoff().round_trip_ns;
  std::printf("# latency_bench: 2 ranks, in-place all_reduce of f32, %d timed calls each; rank 0's "
              "per-call time in us\n",
              iters);
  std::printf("# handoff reference: 2 threads, cache-line round trip %.0f ns\n", handoff);
  std::printf("%-10s %-34s %8s %8s %10s\n", "bytes", "implementation", "p50_us", "mean_us",
              "p50/handoff");
  for (int64_t numel : {int64_t{1}, int64_t{1024}}) {
    const Stats f = funcol_all_reduce(numel, iters);
    const Stats m = minimal_all_reduce(numel, iters, false);
    const Stats x = minimal_all_reduce(numel, iters, true);
    const int64_t bytes = numel * 4;
    auto row = [&](const char* name, const Stats& s) {
      std::printf("%-10lld %-34s %8.2f %8.2f %10.1f\n", static_cast<long long>(bytes), name, s.p50,
                  s.mean, s.p50 * 1000.0 / handoff);
    };
    row("funcol threads", f);
    row("minimal (last arrival executes)", m);
    row("minimal (fixed executor: floor)", x);
  }
  return 0;
}
