// gloo_baseline: Gloo's own all_reduce between two local processes, without funcol: the
// floor under `funcol bench --backend gloo` on the same machine (RESULTS.md). Forks one child
// (rank 1) before any thread exists; both meet through a temporary file store over TCP on
// 127.0.0.1 and run gloo::allreduce (f32 sum, in place) `-n` times per size after `-w`
// warm-up calls. Rank 0 prints one line per size: bytes, mean us per call, algbw GB/s.
//
// Usage: gloo_baseline [-b BYTES] [-e BYTES] [-f FACTOR] [-n ITERS] [-w WARMUP] (sizes as
// funcol bench's: K, M, G suffixes). Links funcol only for those flag parsers.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include "funcol/core/error.h"
#include "tools/bench.h"

namespace {

struct Options {
  size_t begin = 4096;
  size_t end = 1 << 20;
  size_t factor = 16;
  int iters = 300;
  int warmup = 30;
};

int run_rank(int rank, const Options& o, const std::string& dir) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(dir);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, 2);
  context->connectFullMesh(store, device);
  for (size_t bytes = o.begin; bytes <= o.end; bytes *= o.factor) {
    std::vector<float> buf(bytes / sizeof(float), 1.0f);
    auto call = [&] {
      gloo::AllreduceOptions opts(context);
      opts.setOutput(buf.data(), buf.size());
      void (*sum)(void*, const void*, const void*, size_t) = &gloo::sum<float>;
      opts.setReduceFunction(sum);
      gloo::allreduce(opts);
    };
    for (int i = 0; i < o.warmup; ++i) call();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < o.iters; ++i) call();
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        o.iters;
    if (rank == 0) std::printf("%12zu %12.1f %8.3f\n", bytes, us, bytes / us / 1e3);
    if (o.factor <= 1) break;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    using funcol::tools::parse_int;
    using funcol::tools::parse_size;
    if ((argc - 1) % 2 != 0) throw funcol::InvalidArgument("every flag takes a value");
    for (int i = 1; i + 1 < argc; i += 2) {
      const std::string flag = argv[i];
      const char* value = argv[i + 1];
      if (flag == "-b") {
        o.begin = static_cast<size_t>(parse_size(value, "-b"));
      } else if (flag == "-e") {
        o.end = static_cast<size_t>(parse_size(value, "-e"));
      } else if (flag == "-f") {
        o.factor = static_cast<size_t>(parse_int(value, "-f", 1));
      } else if (flag == "-n") {
        o.iters = static_cast<int>(parse_int(value, "-n", 1));
      } else if (flag == "-w") {
        o.warmup = static_cast<int>(parse_int(value, "-w", 0));
      } else {
        throw funcol::InvalidArgument("unknown flag " + flag);
      }
    }
    if (o.begin < sizeof(float)) throw funcol::InvalidArgument("-b must be at least 4 bytes");
  } catch (const funcol::Error& e) {
    std::fprintf(stderr, "gloo_baseline: %s\nusage: gloo_baseline [-b BYTES] [-e BYTES] "
                         "[-f FACTOR] [-n ITERS] [-w WARMUP]\n", e.what());
    return 2;
  }
  char templ[] = "/tmp/gloo_baseline.XXXXXX";
  if (mkdtemp(templ) == nullptr) {
    std::perror("gloo_baseline: mkdtemp");
    return 1;
  }
  const std::string dir = templ;
  std::printf(
      "# gloo::allreduce, 2 processes, TCP on 127.0.0.1, f32 sum in place, %d iterations\n",
      o.iters);
  std::printf("# %10s %12s %8s\n", "bytes", "time_us", "algbw");
  std::fflush(stdout);
  const pid_t child = fork();
  if (child < 0) {
    std::perror("gloo_baseline: fork");
    return 1;
  }
  int rc = 1;
  try {
    rc = run_rank(child == 0 ? 1 : 0, o, dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gloo_baseline: rank %d: %s\n", child == 0 ? 1 : 0, e.what());
  }
  if (child == 0) _exit(rc);
  int status = 0;
  waitpid(child, &status, 0);
  std::filesystem::remove_all(dir);
  return rc == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
