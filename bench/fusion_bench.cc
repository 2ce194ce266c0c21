// fusion_bench: bucketed vs unbucketed collectives on the threads, mpi or gloo backend.
//
// Usage: fusion_bench [--backend threads|mpi|gloo] [--ranks N] [--iters K] [--mode MODE]
//                     [--cap-mb C] [--only KIND[:COUNT]] [--check]
// For each kind (all_gather, reduce_scatter, all_reduce) and each shape (1000 collectives of
// 4 KiB, 100 of 256 KiB; the size is each collective's input on one rank), builds a graph of
// independent collectives, each followed by its wait_tensor, and the same graph after the
// kind's bucketing pass (default cap 2000 MB: one bucket; --cap-mb sets the passes' cap list,
// e.g. 1 for 1 MB buckets; --mode picks the packing, default "default"; --only runs the cases
// of one kind, e.g. all_reduce, or one case, e.g. all_reduce:1000).
// Every rank runs both graphs through its own Executor, K times each after two warm-up runs, in
// alternating blocks of 10 timed runs of one graph, each block after 5 untimed runs of its
// graph (a graph's working set takes several runs to settle back into the caches after the
// other graph's block); an iteration's time is the slowest rank's wall time for that run
// (ranks start each run after a barrier; the per-rank times are combined with an all_reduce
// max). Reports the median of each and speedup = unbucketed / bucketed. Targets:
// 1000 x 4 KiB >= 10x, 100 x 256 KiB >= 1.0x ("bucketing is never slower"). Outputs of the two
// graphs are compared bit for bit on every rank; "identical" is yes only when every rank found
// them equal. With --check it exits 1 when a target is missed or an output differs. On the
// threads backend the table is framed by this machine's memcpy bandwidth and cache-line round
// trip, measured before and after the cases as `funcol bench` measures them.
//
// threads runs the ranks as threads of this process. mpi and gloo run them as N processes of
// this executable, started the way `funcol run --backend mpi|gloo` starts its ranks (under
// `mpirun -np N`, or N processes with a temporary file store); rank 0 prints the table. A
// process started by a user's own mpirun (or with RANK/WORLD_SIZE/FUNCOL_STORE set for gloo) is
// one rank of that job; --ranks then defaults to the job's size. A rank that fails prints
// "fusion_bench: rank R: ..." and the job ends with status 1 (its peers get CommError).
// --fail-rank R (for testing that path) makes rank R throw halfway through the first case.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/graph/parser.h"
#include "funcol/passes/bucketing.h"
#include "funcol/runtime/executor.h"
#include "tools/bench.h"
#include "tools/launch.h"

namespace {

struct Case {
  funcol::CollectiveKind kind;
  const char* name;
  int count;
  int64_t bytes;
  double target;
};

struct Options {
  std::string backend = "threads";
  int ranks = 4;
  bool ranks_given = false;
  int iters = 20;
  funcol::BucketMode mode = funcol::BucketMode::Default;
  std::vector<double> cap_mb{funcol::kDefaultBucketCapMb};  // --cap-mb: the passes' cap list
  bool check = false;
  std::string only;  // --only: "" (every case), "KIND" or "KIND:COUNT"
  int fail_rank = -1;  // testing: this rank throws halfway through the first case
};

// One case's figures, the same on every rank (combined over the ranks).
struct CaseResult {
  double plain_ms = 0;   // median over iterations of the slowest rank's unbucketed run
  double bucket_ms = 0;  // same, bucketed
  bool identical = true;  // every rank's outputs were equal bit for bit
  double max_diff = 0;    // else the largest |unbucketed - bucketed| element on any rank
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

const std::vector<Case>& cases() {
  using K = funcol::CollectiveKind;
  static const std::vector<Case> kCases = {
      {K::AllGather, "all_gather", 1000, 4096, 10.0},
      {K::ReduceScatter, "reduce_scatter", 1000, 4096, 10.0},
      {K::AllReduce, "all_reduce", 1000, 4096, 10.0},
      {K::AllGather, "all_gather", 100, 262144, 1.0},
      {K::ReduceScatter, "reduce_scatter", 100, 262144, 1.0},
      {K::AllReduce, "all_reduce", 100, 262144, 1.0},
  };
  return kCases;
}

bool selected(const Case& c, const std::string& only) {
  if (only.empty()) return true;
  const size_t colon = only.find(':');
  if (only.substr(0, colon) != c.name) return false;
  return colon == std::string::npos || only.substr(colon + 1) == std::to_string(c.count);
}

funcol::BucketOptions bucket_options(const Case& c, funcol::BucketMode mode,
                                     const std::vector<double>& cap_mb) {
  funcol::BucketOptions opts;
  opts.kind = c.kind;
  opts.cap_mb = cap_mb;
  opts.mode = c.kind == funcol::CollectiveKind::AllGather ? mode
              : funcol::is_custom_ops(mode)                ? funcol::BucketMode::CustomOps
                                                           : funcol::BucketMode::Default;
  return opts;
}

// One rank's part of a case: both graphs, warm-up, K timed iterations each, then the ranks'
// times and comparisons combined (all_reduce max / min), so every rank returns the same result.
CaseResult run_case(funcol::ProcessGroup& world, const Case& c, const Options& o,
                    bool first_case) {
  const std::string text = graph_text(c, world.size());
  // Each rank owns its graphs (graphs are not shared across threads).
  const auto plain = funcol::parse_graph(text);
  auto bucketed = funcol::parse_graph(text);
  funcol::bucket_collectives(*bucketed, bucket_options(c, o.mode, o.cap_mb));
  funcol::Executor ex_plain(*plain, world);
  funcol::Executor ex_bucket(*bucketed, world);
  const auto inputs = funcol::make_inputs(*plain, 1, world.rank());
  int32_t identical = 1;
  double max_diff = 0;  // tells rounding (a different reduction order) from wrong data
  {
    const auto a = ex_plain.run(inputs);
    const auto b = ex_bucket.run(inputs);
    if (a.size() != b.size()) identical = 0;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      if (a[i].equal(b[i])) continue;
      identical = 0;
      const std::vector<float> x = a[i].to_vector<float>(), y = b[i].to_vector<float>();
      if (x.size() != y.size()) max_diff = HUGE_VAL;
      for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
        max_diff = std::max(max_diff, static_cast<double>(std::fabs(x[k] - y[k])));
      }
    }
  }
  ex_plain.run(inputs);
  ex_bucket.run(inputs);
  // ms[2 * it + which], which 0: unbucketed, 1: bucketed. The graphs take turns in blocks of
  // kBlock runs, the first of each block alternating: a program runs one graph step after step,
  // so a run should find the caches as its own graph's previous run left them. Alternating
  // single runs made each run start after the other graph had swept the caches (the bucketed
  // 1000 x 4 KiB all_gather took 0.69-0.82 ms so, 0.49 ms on its own); short blocks still keep
  // the two side by side in time. Each block starts with kBlockWarmup untimed runs: after the
  // other graph's block, a graph's working set takes several runs to settle back into the
  // caches (on a Zen 5 host the bucketed 1000 x 4 KiB all_reduce took 0.62, 0.51, 0.43, 0.36,
  // 0.33 ms in a block's first five runs and 0.23-0.27 ms after; a single thread re-reading an
  // 8 MB buffer after another one, 3.2x its settled time on the first pass and 2.0x on the
  // second: RESULTS.md, session 49), which a program running one graph step after step never
  // pays.
  constexpr int kBlock = 10;
  constexpr int kBlockWarmup = 5;
  std::vector<double> ms(2 * static_cast<size_t>(o.iters));
  for (int block = 0; block * kBlock < o.iters; ++block) {
    const int begin = block * kBlock;
    const int end = std::min(o.iters, begin + kBlock);
    for (int turn = 0; turn < 2; ++turn) {
      const int which = (turn + block) % 2;
      funcol::Executor& ex = which == 0 ? ex_plain : ex_bucket;
      for (int w = 0; w < kBlockWarmup; ++w) {
        world.barrier();
        ex.run(inputs);
      }
      for (int it = begin; it < end; ++it) {
        if (first_case && world.rank() == o.fail_rank && which == 0 && it == o.iters / 2) {
          throw funcol::Error("injected failure (--fail-rank " + std::to_string(o.fail_rank) +
                              ") at iteration " + std::to_string(it));
        }
        // The run gets its inputs as a training step does, handed over (moved) rather than
        // copied in the timed region: copying a thousand Tensors costs two reference counts
        // each, on lines the previous run's data swept out of the cache.
        std::vector<funcol::Tensor> args = inputs;
        world.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        auto out = ex.run(std::move(args));
        const auto t1 = std::chrono::steady_clock::now();
        ms[2 * static_cast<size_t>(it) + static_cast<size_t>(which)] =
            std::chrono::duration<double, std::milli>(t1 - t0).count();
      }
    }
  }
  // The slowest rank's time of each run, and whether every rank's outputs were identical.
  funcol::Tensor slowest = funcol::Tensor::from_vector<double>(ms);
  world.all_reduce(slowest, funcol::ReduceOp::Max)->wait();
  funcol::Tensor same = funcol::Tensor::from_vector<int32_t>({identical});
  world.all_reduce(same, funcol::ReduceOp::Min)->wait();
  funcol::Tensor diff = funcol::Tensor::from_vector<double>({max_diff});
  world.all_reduce(diff, funcol::ReduceOp::Max)->wait();
  const std::vector<double> all = slowest.to_vector<double>();
  std::vector<double> plain_ms, bucket_ms;
  for (int it = 0; it < o.iters; ++it) {
    plain_ms.push_back(all[2 * static_cast<size_t>(it)]);
    bucket_ms.push_back(all[2 * static_cast<size_t>(it) + 1]);
  }
  CaseResult r;
  r.plain_ms = median(plain_ms);
  r.bucket_ms = median(bucket_ms);
  r.identical = same.to_vector<int32_t>()[0] != 0;
  r.max_diff = diff.to_vector<double>()[0];
  return r;
}

void print_header(const Options& o, int ranks) {
  std::printf(
      "# %s backend, %d ranks, %d iterations, mode %s, cap-mb %s; time = median over "
      "iterations of the slowest rank\n",
      o.backend.c_str(), ranks, o.iters, std::string(funcol::bucket_mode_name(o.mode)).c_str(),
      funcol::format_cap_mb(o.cap_mb).c_str());
  std::printf("%-15s %6s %8s %14s %14s %9s %7s %4s %9s\n", "collective", "count", "bytes",
              "unbucketed_ms", "bucketed_ms", "speedup", "target", "met", "identical");
  std::fflush(stdout);
}

// Prints a case's row; returns whether its speedup met the target.
bool print_row(const Case& c, const CaseResult& r) {
  const double speedup = r.bucket_ms > 0 ? r.plain_ms / r.bucket_ms : 0;
  const bool met = speedup >= c.target;
  std::printf("%-15s %6d %8lld %14.3f %14.3f %8.2fx %6.1fx %4s %9s\n", c.name, c.count,
              static_cast<long long>(c.bytes), r.plain_ms, r.bucket_ms, speedup, c.target,
              met ? "yes" : "no", r.identical ? "yes" : "NO");
  std::fflush(stdout);
  if (!r.identical) {
    std::fprintf(stderr,
                 "fusion_bench: %s x %d: bucketed and unbucketed outputs differ (largest "
                 "element difference %g)\n",
                 c.name, c.count, r.max_diff);
  }
  return met;
}

// The machine's references, measured as `funcol bench` measures them, before and after the
// cases (the machine's state can change in between). The 1000 x 4 KiB buckets are bound by
// memory where the cache cannot hold their 16-24 MiB (a 2-vCPU Zen 3 guest with memcpy at
// 2-5 GB/s a thread gave 2.2-5.9x where a Zen 5 at 12-14 GB/s gave 7.4-13x), and the
// unbucketed runs by cache-line handoffs: the speedups are read against these. Threads backend
// only: in a job, the other ranks' processes would share the CPUs while one measures.
void print_references(const char* when) {
  constexpr int64_t kMemcpyBytes = 16 << 20;
  const funcol::tools::MemcpyRef m = funcol::tools::measure_memcpy(kMemcpyBytes);
  const funcol::tools::HandoffRef h = funcol::tools::measure_handoff();
  std::printf("# references %s: memcpy 2 threads x %lld MiB, %.2f GB/s per thread; cache-line "
              "round trip %.0f ns\n",
              when, static_cast<long long>(kMemcpyBytes >> 20), m.gbps_per_thread,
              h.round_trip_ns);
  std::fflush(stdout);
}

int run_threads(const Options& o) {
  print_references("before");
  print_header(o, o.ranks);
  bool ok = true;
  bool first = true;
  for (const Case& c : cases()) {
    if (!selected(c, o.only)) continue;
    CaseResult result;
    try {
      funcol::run_local(o.ranks, [&](funcol::ProcessGroup& world) {
        const CaseResult r = run_case(world, c, o, first);
        if (world.rank() == 0) result = r;
      });
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fusion_bench: %s x %d: %s\n", c.name, c.count, e.what());
      ok = false;
      first = false;
      continue;
    }
    first = false;
    const bool met = print_row(c, result);
    if (!result.identical || (o.check && !met)) ok = false;
  }
  print_references("after");
  return ok ? 0 : 1;
}

// This process is one rank of an mpi or gloo job: join the world, run every case, leave.
// Rank 0 prints the table and returns the run's status; a failing rank prints its error.
int run_in_job(Options o) {
  std::shared_ptr<funcol::ProcessGroup> world;
  try {
    world = funcol::init_process_group(o.backend);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusion_bench: %s\n", e.what());
    return 1;
  }
  const int rank = world->rank();
  int status = 0;
  const Case* current = nullptr;
  try {
    if (!o.ranks_given) o.ranks = world->size();
    if (world->size() != o.ranks) {
      throw funcol::InvalidArgument("--ranks " + std::to_string(o.ranks) +
                                    " does not match the job's " +
                                    std::to_string(world->size()) + " processes");
    }
    if (rank == 0) print_header(o, o.ranks);
    int differ = 0;
    int missed = 0;
    bool first = true;
    for (const Case& c : cases()) {
      if (!selected(c, o.only)) continue;
      current = &c;
      const CaseResult r = run_case(*world, c, o, first);
      first = false;
      if (rank == 0) {
        const bool met = print_row(c, r);
        differ += !r.identical;
        missed += !met;
      }
    }
    current = nullptr;
    // Only rank 0 reports a failed run: the launcher then names one rank, with its message.
    if (differ > 0) {
      std::fprintf(stderr,
                   "fusion_bench: bucketed and unbucketed outputs differ in %d case(s)\n",
                   differ);
      status = 1;
    } else if (o.check && missed > 0) {
      std::fprintf(stderr, "fusion_bench: --check: %d case(s) missed the speedup target\n",
                   missed);
      status = 1;
    }
  } catch (const std::exception& e) {
    if (current) {
      std::fprintf(stderr, "fusion_bench: rank %d: %s x %d: %s\n", rank, current->name,
                   current->count, e.what());
    } else {
      std::fprintf(stderr, "fusion_bench: rank %d: %s\n", rank, e.what());
    }
    funcol::tools::note_departure_error();
    status = 1;
  }
  std::fflush(nullptr);
  // No group may outlive the process group (mpi frees communicators before MPI_Finalize).
  world.reset();
  funcol::destroy_process_group();
  return status;
}

// Not inside a job: start one whose ranks are this executable with the same options.
int launch(const Options& o) {
  funcol::tools::JobOptions job;
  job.backend = o.backend;
  job.ranks = o.ranks;
  job.temp_prefix = "funcol-fusion-bench-";
  job.rank_args = [&](const std::string&) {
    std::vector<std::string> a = {"--backend", o.backend,
                                  "--ranks",   std::to_string(o.ranks),
                                  "--iters",   std::to_string(o.iters),
                                  "--mode",    std::string(funcol::bucket_mode_name(o.mode)),
                                  "--cap-mb",  funcol::format_cap_mb(o.cap_mb)};
    if (o.check) a.emplace_back("--check");
    if (!o.only.empty()) a.insert(a.end(), {"--only", o.only});
    if (o.fail_rank >= 0) a.insert(a.end(), {"--fail-rank", std::to_string(o.fail_rank)});
    return a;
  };
  try {
    return funcol::tools::launch_job(job, stderr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusion_bench: %s\n", e.what());
    return 1;
  }
}

constexpr const char* kUsage =
    "usage: fusion_bench [--backend threads|mpi|gloo] [--ranks N] [--iters K] [--mode M] "
    "[--cap-mb C] [--only KIND[:COUNT]] [--check]\n";

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    for (int i = 1; i < argc; ++i) {
      if (!std::strcmp(argv[i], "--check")) {
        o.check = true;
      } else if (!std::strcmp(argv[i], "--backend") && i + 1 < argc) {
        o.backend = argv[++i];
      } else if (!std::strcmp(argv[i], "--ranks") && i + 1 < argc) {
        o.ranks = std::max(1, std::atoi(argv[++i]));
        o.ranks_given = true;
      } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
        o.iters = std::max(1, std::atoi(argv[++i]));
      } else if (!std::strcmp(argv[i], "--mode") && i + 1 < argc) {
        o.mode = funcol::parse_bucket_mode(argv[++i]);
      } else if (!std::strcmp(argv[i], "--cap-mb") && i + 1 < argc) {
        o.cap_mb = funcol::parse_cap_mb(argv[++i]);
      } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
        o.only = argv[++i];
        if (std::none_of(cases().begin(), cases().end(),
                         [&](const Case& c) { return selected(c, o.only); })) {
          throw funcol::InvalidArgument("--only " + o.only +
                                        ": no such case (kinds all_gather, reduce_scatter, "
                                        "all_reduce; counts 1000, 100)");
        }
      } else if (!std::strcmp(argv[i], "--fail-rank") && i + 1 < argc) {
        o.fail_rank = std::atoi(argv[++i]);
      } else {
        std::fputs(kUsage, stderr);
        return 2;
      }
    }
    if (o.backend != "threads" && o.backend != "mpi" && o.backend != "gloo") {
      throw funcol::InvalidArgument("unknown backend '" + o.backend +
                                    "' for --backend: expected threads, mpi or gloo");
    }
    const std::vector<std::string> available = funcol::available_backends();
    if (std::find(available.begin(), available.end(), o.backend) == available.end()) {
      std::string names;
      for (const std::string& b : available) names += (names.empty() ? "" : ", ") + b;
      throw funcol::InvalidArgument("backend '" + o.backend +
                                    "' is not compiled into this build (configure with "
                                    "-DFUNCOL_WITH_" +
                                    (o.backend == "mpi" ? "MPI" : "GLOO") +
                                    "=ON); available backends: " + names);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fusion_bench: %s\n", e.what());
    return 2;
  }
  if (o.backend == "threads") return run_threads(o);
  if (funcol::tools::inside_job(o.backend)) return run_in_job(o);
  return launch(o);
}
