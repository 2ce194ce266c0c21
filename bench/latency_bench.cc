// latency_bench: a 2-rank in-place all_reduce on the threads backend next to the smallest
// protocol that can do the same job, measured side by side in one run (RESULTS.md, issue 2).
//
// The minimal protocol has no queue, no op objects and no failure handling: each thread
// publishes its buffer and bumps one shared arrival counter; the last to arrive reduces both
// buffers in rank order into rank 0's, copies the result to rank 1's and publishes a done
// counter the other spins on. It shows how much of funcol's latency is protocol and how much is
// the machine (cache-line handoffs and the data's cache misses). A variant with a fixed
// executor (rank 1 always reduces) keeps the data in one core's cache, as a loop that never
// reads its results allows; it is the floor, not a design. A one-shot protocol (each rank
// stages its buffer and reduces everyone's into its own, as small all-reduces on GPUs often
// do) shows whether trading the writes to the peer's buffer for a staging copy pays here. A
// symmetric protocol (each rank reduces the peer's buffer, read in place, into a scratch, and
// writes its own buffer once both have read) shows whether moving the data both ways at once,
// with no staging copy, pays for its second handoff and for invalidating the lines the peer read.
// A split protocol (each rank reduces half of both buffers in place) shows what a loop that
// never touches its buffers gains when each half stays with its reducer. An LL protocol (as
// NCCL's: each 8-byte store carries 4 data bytes and the call's number, so the reader needs no
// separate flag) shows what a single one-way handoff, with data and flag in the same lines,
// costs when every staging line changes owner twice per call.
//
// Both sides run one thread per CPU (as `funcol bench`: see LocalOptions::bind_threads).
//
// With --touch every thread, before each call (outside the timed part), scales its buffer: it
// reads the last result and writes its next input, as a program does. The buffer's lines then
// cross between the cores in every protocol, and the ones that keep each line with one
// reducer lose that advantage.
//
// Usage: latency_bench [--iters N] [--touch]   (prints one table; run on a quiet machine)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <immintrin.h>

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

// Whether each thread scales its buffer before each call (--touch).
struct Run {
  int iters = 100000;
  bool touch = false;
};

// What a program does between two calls with --touch: reads its result, writes its next input.
void touch_buffer(const Run& run, float* data, int64_t numel) {
  if (!run.touch) return;
  for (int64_t e = 0; e < numel; ++e) data[e] *= 0.5f;
}

// funcol: rank 0's per-call times of ProcessGroup::all_reduce + wait on a f32[numel] tensor.
Stats funcol_all_reduce(int64_t numel, const Run& run) {
  const int iters = run.iters;
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
      touch_buffer(run, t.data<float>(), numel);
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

// Runs `call(r, i, buf)` for i = 1.. on two threads bound one per CPU, each with its own
// f32[numel] buffer, allocated as funcol's tensors are (page-aligned from 4 KiB: a split at a
// line boundary then shares no line); returns rank 0's per-call times, after a tenth as many
// untimed calls.
template <typename Call>
Stats time_pair(int64_t numel, const Run& run, Call call) {
  const int iters = run.iters;
  const int total = iters + iters / 10;
  std::vector<double> times(static_cast<size_t>(iters));
  auto body = [&](int r) {
    funcol::dist_detail::CpuBinding binding(funcol::tools::reference_cpu(r));
    const funcol::Tensor buf = funcol::Tensor::zeros({numel}, funcol::DType::F32);
    float* data = buf.data<float>();
    for (int64_t i = 1; i <= total; ++i) {
      touch_buffer(run, data, numel);
      const auto t0 = Clock::now();
      call(r, i, data);
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

// The protocols' shared state, a cache line each: a counter, and a rank's published buffer
// with the call it is published for.
struct alignas(64) Counter {
  std::atomic<int64_t> v{0};
};
struct alignas(64) Published {
  std::atomic<int64_t> seq{0};
  float* buf = nullptr;
};

void spin_until(const std::atomic<int64_t>& a, int64_t v) {
  funcol::dist_detail::poll_until([&] { return a.load(std::memory_order_acquire) >= v; }, 4096);
}

// One-shot: each thread copies its buffer (streaming stores) into its own staging area and
// publishes it, then reduces every staging area in rank order into its own buffer. Two staging
// areas alternate by call, so a peer still reading the previous call's copy is never
// overwritten: a thread can only start call i+2 after its peer started call i+1, that is,
// finished call i. One one-way handoff per call and no writes to another thread's memory;
// every rank computes the same sum in the same order.
Stats one_shot_all_reduce(int64_t numel, const Run& run) {
  const auto n = static_cast<size_t>(numel);
  std::vector<float> staging[2][2];
  for (auto& r : staging) {
    for (auto& b : r) b.assign(n + 16, 0.0f);
  }
  Counter staged[2];
  return time_pair(numel, run, [&](int r, int64_t i, float* buf) {
    float* mine = staging[r][i % 2].data();
    if (n % 16 == 0) {
      // Streamed to memory: a plain copy first has to take the lines back from the peer,
      // which read them two calls ago (1.59 against 1.48 us at 4 KiB, 465 ns round trips).
      for (size_t b = 0; b < n; b += 4) _mm_stream_ps(mine + b, _mm_loadu_ps(buf + b));
      _mm_sfence();
    } else {
      std::memcpy(mine, buf, n * sizeof(float));
    }
    staged[r].v.store(i, std::memory_order_release);
    spin_until(staged[1 - r].v, i);
    const void* srcs[2] = {staging[0][i % 2].data(), staging[1][i % 2].data()};
    const char* theirs = static_cast<const char*>(srcs[1 - r]);
    for (size_t b = 0; b < n * sizeof(float); b += 64) __builtin_prefetch(theirs + b, 0, 3);
    funcol::reduce_buffers(funcol::ReduceOp::Sum, funcol::DType::F32, buf, srcs, 2, numel);
  });
}

// Symmetric: each rank publishes its buffer, reads the peer's in place and reduces both (in
// rank order) into a private scratch, says it has finished reading, waits for the peer to say
// the same, then copies the scratch into its own buffer. Two one-way handoffs, no staging copy,
// each rank's data crosses once, both directions at the same time.
Stats symmetric_all_reduce(int64_t numel, const Run& run) {
  Published box[2];
  Counter done[2];
  const auto n = static_cast<size_t>(numel);
  std::vector<float> scratch[2];
  scratch[0].assign(n + 16, 0.0f);
  scratch[1].assign(n + 16, 0.0f);
  return time_pair(numel, run, [&](int r, int64_t i, float* buf) {
    box[r].buf = buf;
    box[r].seq.store(i, std::memory_order_release);
    spin_until(box[1 - r].seq, i);
    const char* theirs = reinterpret_cast<const char*>(box[1 - r].buf);
    for (size_t b = 0; b < n * sizeof(float); b += 64) __builtin_prefetch(theirs + b, 0, 3);
    const void* srcs[2] = {box[0].buf, box[1].buf};
    float* out = scratch[r].data();
    funcol::reduce_buffers(funcol::ReduceOp::Sum, funcol::DType::F32, out, srcs, 2, numel);
    done[r].v.store(i, std::memory_order_release);
    spin_until(done[1 - r].v, i);
    std::memcpy(buf, out, n * sizeof(float));
  });
}

// Split: after both published their buffers, each rank reduces its own half of both (in rank
// order, in place) and copies it into the peer's buffer, then waits for the peer's half. Two
// one-way handoffs; a loop that never touches its buffer between calls keeps each half in its
// reducer's cache, so no data crosses (session 7 measured a program that writes its buffer
// before each call and reads it after: no gain there).
Stats split_all_reduce(int64_t numel, const Run& run) {
  Published box[2];
  Counter done[2];
  const auto n = static_cast<size_t>(numel);
  const size_t half = n / 2 / 16 * 16;  // whole lines of f32
  return time_pair(numel, run, [&](int r, int64_t i, float* buf) {
    box[r].buf = buf;
    box[r].seq.store(i, std::memory_order_release);
    spin_until(box[1 - r].seq, i);
    const size_t lo = r == 0 ? 0 : half;
    const size_t hi = r == 0 ? half : n;
    if (hi > lo) {
      const void* srcs[2] = {box[0].buf + lo, box[1].buf + lo};
      funcol::reduce_buffers(funcol::ReduceOp::Sum, funcol::DType::F32, buf + lo, srcs, 2,
                             static_cast<int64_t>(hi - lo));
      std::memcpy(box[1 - r].buf + lo, buf + lo, (hi - lo) * sizeof(float));
    }
    done[r].v.store(i, std::memory_order_release);
    spin_until(done[1 - r].v, i);
  });
}

// LL: each thread stores its buffer into its own staging area as 8-byte units, the element's
// bits under the call's number, each in one store; the peer spins on each unit until it
// carries this call's number and adds the element to its own. Two staging areas alternate by
// call, as the one-shot's. One one-way handoff, but each staging line changes owner twice per
// call (the writer takes it back from the reader of two calls ago).
Stats ll_all_reduce(int64_t numel, const Run& run) {
  const auto n = static_cast<size_t>(numel);
  std::vector<std::atomic<uint64_t>> staging[2][2];
  for (auto& r : staging) {
    for (auto& b : r) b = std::vector<std::atomic<uint64_t>>(n);  // zero: no call's number
  }
  return time_pair(numel, run, [&](int r, int64_t i, float* buf) {
    std::atomic<uint64_t>* mine = staging[r][i % 2].data();
    const std::atomic<uint64_t>* theirs = staging[1 - r][i % 2].data();
    const uint64_t tag = static_cast<uint64_t>(i) << 32;
    for (size_t k = 0; k < n; ++k) {
      uint32_t bits;
      std::memcpy(&bits, buf + k, sizeof bits);
      mine[k].store(tag | bits, std::memory_order_relaxed);
    }
    for (size_t k = 0; k < n; ++k) {
      uint64_t unit = 0;
      funcol::dist_detail::poll_until(
          [&] {
            unit = theirs[k].load(std::memory_order_relaxed);
            return (unit >> 32) == (tag >> 32);
          },
          4096);
      const auto bits = static_cast<uint32_t>(unit);
      float theirs_k;
      std::memcpy(&theirs_k, &bits, sizeof bits);
      buf[k] += theirs_k;  // a + b == b + a: both ranks get the same bits
    }
  });
}

// The minimal protocol; `fixed`: rank 1 always executes.
Stats minimal_all_reduce(int64_t numel, const Run& run, bool fixed) {
  Published box[2];
  Counter arrivals, done;
  const auto n = static_cast<size_t>(numel);
  return time_pair(numel, run, [&](int r, int64_t i, float* buf) {
    box[r].buf = buf;
    box[r].seq.store(i, std::memory_order_release);
    const int64_t arrived = arrivals.v.fetch_add(1, std::memory_order_acq_rel) + 1;
    const bool execute = fixed ? r == 1 : arrived == 2 * i;
    if (execute) {
      spin_until(box[1 - r].seq, i);
      // As funcol's lane: ask for all of the peer's lines, to be written, before reducing.
      const char* theirs = reinterpret_cast<const char*>(box[1 - r].buf);
      for (size_t b = 0; b < n * sizeof(float); b += 64) __builtin_prefetch(theirs + b, 1, 3);
      // funcol's own kernel, so that only the protocol differs.
      const void* srcs[2] = {box[0].buf, box[1].buf};
      funcol::reduce_buffers(funcol::ReduceOp::Sum, funcol::DType::F32, box[0].buf, srcs, 2,
                             numel);
      std::memcpy(box[1].buf, box[0].buf, n * sizeof(float));
      done.v.store(i, std::memory_order_release);
    } else {
      spin_until(done.v, i);
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  Run run;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--iters" && i + 1 < argc) {
      run.iters = std::atoi(argv[++i]);
    } else if (arg == "--touch") {
      run.touch = true;
    } else {
      std::fprintf(stderr, "usage: latency_bench [--iters N] [--touch]\n");
      return 2;
    }
  }
  const int iters = run.iters;
  if (iters < 10) {
    std::fprintf(stderr, "latency_bench: --iters must be at least 10\n");
    return 2;
  }
  const double handoff = funcol::tools::measure_handoff().round_trip_ns;
  std::printf("# latency_bench: 2 ranks, in-place all_reduce of f32, %d timed calls each; rank 0's "
              "per-call time in us%s\n",
              iters, run.touch ? "; buffers scaled before each call (--touch)" : "");
  std::printf("# handoff reference: 2 threads, cache-line round trip %.0f ns\n", handoff);
  std::printf("%-10s %-38s %8s %8s %10s\n", "bytes", "implementation", "p50_us", "mean_us",
              "p50/handoff");
  for (int64_t numel : {int64_t{1}, int64_t{1024}}) {
    const Stats f = funcol_all_reduce(numel, run);
    const Stats m = minimal_all_reduce(numel, run, false);
    const Stats x = minimal_all_reduce(numel, run, true);
    const Stats o = one_shot_all_reduce(numel, run);
    const Stats y = symmetric_all_reduce(numel, run);
    const Stats z = split_all_reduce(numel, run);
    const Stats l = ll_all_reduce(numel, run);
    const int64_t bytes = numel * 4;
    auto row = [&](const char* name, const Stats& s) {
      std::printf("%-10lld %-38s %8.2f %8.2f %10.1f\n", static_cast<long long>(bytes), name, s.p50,
                  s.mean, s.p50 * 1000.0 / handoff);
    };
    row("funcol threads", f);
    row("minimal (last arrival executes)", m);
    row("minimal (fixed executor: floor)", x);
    row("one-shot (staged, every rank reduces)", o);
    row("symmetric (read in place, scratch)", y);
    row("split (each rank reduces half)", z);
    row("LL (flag in every 8-byte store)", l);
  }
  return 0;
}
