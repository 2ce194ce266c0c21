// bucketing_bench: time and peak memory of the bucketing passes (and of the overlap pass after
// them) on synthetic FSDP graphs.
//
// Usage: bucketing_bench [--sizes 1000,10000,100000] [--cap-mb 2000] [--check]
// For each size N (collectives), builds an FSDP-like graph of N/2 layers, each
//   %ag = all_gather_into_tensor(%w) ; %wa = wait_tensor(%ag) ; %h = matmul(%h_prev, %wa)
//   %rs = reduce_scatter_tensor(%h) ; %wr = wait_tensor(%rs)
// and runs bucket-all-gather then bucket-reduce-scatter on it, in a child process of its own
// so that peak RSS belongs to that size alone. Reports the graph's node count, each pass's
// time (the thread's CPU time, so time descheduled on a shared machine does not count), the
// buckets made, the RSS before the passes and the child's peak RSS, and, as the reference
// measured side by side, the time to build the graph itself with Builder. It also times the
// overlap pass on the bucketed graph (ov_ms) and on a second, unbucketed copy (ov_raw_ms: every
// collective moves up past all the layers before it, the pass's long-distance case), and on a
// third copy with memory-budget-mb=1 (ov_budget_ms: the reduce_scatters' results, graph outputs,
// are held to the end, so from about 8,000 layers on the budget stops every hoist). With
// --check it exits 1 unless 100,000 collectives (or the largest size) are bucketed in under one
// second, each overlap run takes under one second, and every graph verifies afterwards.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "funcol/graph/graph.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/bucketing.h"
#include "funcol/passes/overlap.h"

namespace {

double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Current resident set in MiB (from /proc/self/statm).
double current_rss_mib() {
  long pages_total = 0, pages_resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  if (std::fscanf(f, "%ld %ld", &pages_total, &pages_resident) != 2) pages_resident = 0;
  std::fclose(f);
  return static_cast<double>(pages_resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) /
         (1024.0 * 1024.0);
}

std::unique_ptr<funcol::Graph> fsdp_graph(int64_t collectives) {
  using funcol::DType;
  using funcol::Type;
  auto g = std::make_unique<funcol::Graph>("fsdp");
  funcol::Builder b(*g);
  funcol::Value* h = g->add_input("x", Type(DType::F32, {8, 16}));
  const int64_t layers = collectives / 2;
  for (int64_t l = 0; l < layers; ++l) {
    funcol::Value* w = g->add_input("w" + std::to_string(l), Type(DType::F32, {4, 16}));
    funcol::Value* ag =
        b.value("all_gather_into_tensor", {w}, {{"group_size", 4}, {"group", "world"}});
    funcol::Value* wa = b.value("wait_tensor", {ag});
    h = b.value("matmul", {h, wa});
    funcol::Value* rs = b.value("reduce_scatter_tensor", {h},
                                {{"reduce_op", "sum"}, {"group_size", 4}, {"group", "world"}});
    g->add_output(b.value("wait_tensor", {rs}));
  }
  g->add_output(h);
  return g;
}

struct Result {
  int64_t collectives = 0;
  double build_ms = 0;  // building the graph with Builder: the reference cost of its nodes
  int64_t nodes_before = 0;
  int64_t nodes_after = 0;
  double ag_ms = 0;
  double rs_ms = 0;
  int64_t ag_buckets = 0;
  int64_t rs_buckets = 0;
  int64_t merged = 0;
  double rss_before_mib = 0;
  double ov_ms = 0;      // overlap after the bucketing passes
  double ov_raw_ms = 0;  // overlap on the unbucketed graph
  double ov_budget_ms = 0;  // overlap{memory-budget-mb=1} on the unbucketed graph
  int verified = 0;
};

Result measure(int64_t n, const std::vector<double>& cap_mb) {
  Result r;
  r.collectives = n;
  const double b0 = thread_seconds();
  auto g = fsdp_graph(n);
  r.build_ms = (thread_seconds() - b0) * 1e3;
  r.nodes_before = static_cast<int64_t>(g->num_nodes());
  r.rss_before_mib = current_rss_mib();
  funcol::BucketOptions ag;
  ag.kind = funcol::CollectiveKind::AllGather;
  ag.cap_mb = cap_mb;
  funcol::BucketOptions rs = ag;
  rs.kind = funcol::CollectiveKind::ReduceScatter;
  double t0 = thread_seconds();
  const funcol::BucketingStats a = funcol::bucket_collectives(*g, ag);
  double t1 = thread_seconds();
  const funcol::BucketingStats s = funcol::bucket_collectives(*g, rs);
  double t2 = thread_seconds();
  r.ag_ms = (t1 - t0) * 1e3;
  r.rs_ms = (t2 - t1) * 1e3;
  r.ag_buckets = a.merged_buckets;
  r.rs_buckets = s.merged_buckets;
  r.merged = a.merged_collectives + s.merged_collectives;
  r.nodes_after = static_cast<int64_t>(g->num_nodes());
  t0 = thread_seconds();
  funcol::schedule_overlap(*g);
  r.ov_ms = (thread_seconds() - t0) * 1e3;
  auto raw = fsdp_graph(n);
  t0 = thread_seconds();
  funcol::schedule_overlap(*raw);
  r.ov_raw_ms = (thread_seconds() - t0) * 1e3;
  auto budgeted = fsdp_graph(n);
  t0 = thread_seconds();
  funcol::schedule_overlap(*budgeted, {.memory_budget_bytes = 1 << 20});
  r.ov_budget_ms = (thread_seconds() - t0) * 1e3;
  try {
    funcol::verify(*g);
    funcol::verify(*raw);
    funcol::verify(*budgeted);
    r.verified = 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "verify failed: %s\n", e.what());
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {1000, 10000, 100000};
  std::string cap = "2000";
  bool check = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--check")) {
      check = true;
    } else if (!std::strcmp(argv[i], "--sizes") && i + 1 < argc) {
      sizes.clear();
      for (char* p = std::strtok(argv[++i], ","); p; p = std::strtok(nullptr, ",")) {
        sizes.push_back(std::atoll(p));
      }
    } else if (!std::strcmp(argv[i], "--cap-mb") && i + 1 < argc) {
      cap = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bucketing_bench [--sizes N,N,...] [--cap-mb C] [--check]\n");
      return 2;
    }
  }
  std::vector<double> cap_mb;
  try {
    cap_mb = funcol::parse_cap_mb(cap);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bucketing_bench: %s\n", e.what());
    return 2;
  }
  std::printf(
      "# bucket-all-gather then bucket-reduce-scatter, cap-mb=%s, FSDP graph; then overlap\n",
      cap.c_str());
  std::printf("%12s %10s %10s %10s %10s %10s %10s %10s %10s %12s %12s %10s %10s %12s\n",
              "collectives", "nodes", "after", "build_ms", "ag_ms", "rs_ms", "total_ms", "buckets",
              "merged", "rss_in_MiB", "peak_MiB", "ov_ms", "ov_raw_ms", "ov_budget_ms");
  bool ok = true;
  for (int64_t n : sizes) {
    int fds[2];
    if (pipe(fds) != 0) return 1;
    const pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      const Result r = measure(n, cap_mb);
      const ssize_t w = write(fds[1], &r, sizeof(r));
      _exit(w == static_cast<ssize_t>(sizeof(r)) ? 0 : 1);
    }
    close(fds[1]);
    Result r;
    const ssize_t got = read(fds[0], &r, sizeof(r));
    close(fds[0]);
    int status = 0;
    rusage ru{};
    wait4(pid, &status, 0, &ru);
    if (got != static_cast<ssize_t>(sizeof(r)) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "size %lld: child failed\n", static_cast<long long>(n));
      ok = false;
      continue;
    }
    const double peak_mib = static_cast<double>(ru.ru_maxrss) / 1024.0;
    std::printf(
        "%12lld %10lld %10lld %10.1f %10.1f %10.1f %10.1f %10lld %10lld %12.1f %12.1f %10.1f "
        "%10.1f %12.1f\n",
        static_cast<long long>(n), static_cast<long long>(r.nodes_before),
        static_cast<long long>(r.nodes_after), r.build_ms, r.ag_ms, r.rs_ms, r.ag_ms + r.rs_ms,
        static_cast<long long>(r.ag_buckets + r.rs_buckets), static_cast<long long>(r.merged),
        r.rss_before_mib, peak_mib, r.ov_ms, r.ov_raw_ms, r.ov_budget_ms);
    std::fflush(stdout);
    if (!r.verified) ok = false;
    if (check && n == sizes.back() && r.ag_ms + r.rs_ms >= 1000.0) {
      std::fprintf(stderr, "FAIL: %lld collectives took %.1f ms (target < 1000 ms)\n",
                   static_cast<long long>(n), r.ag_ms + r.rs_ms);
      ok = false;
    }
    const double ov_max = std::max({r.ov_ms, r.ov_raw_ms, r.ov_budget_ms});
    if (check && ov_max >= 1000.0) {
      std::fprintf(stderr, "FAIL: overlap on %lld collectives took %.1f ms (target < 1000 ms)\n",
                   static_cast<long long>(n), ov_max);
      ok = false;
    }
  }
  return ok ? 0 : 1;
}
