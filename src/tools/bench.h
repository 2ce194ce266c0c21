// `funcol bench` internals: flags, nccl-tests size and bandwidth rules, check data, the runner.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"
#include "funcol/dist/backend.h"

namespace funcol {
class ProcessGroup;
}  // namespace funcol

namespace funcol::tools {

// The collectives `funcol bench` measures, in the order `-o all` runs them.
enum class BenchOp { AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast };

inline constexpr BenchOp kAllBenchOps[] = {BenchOp::AllReduce, BenchOp::AllGather,
                                           BenchOp::ReduceScatter, BenchOp::AllToAll,
                                           BenchOp::Broadcast};

// "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast".
std::string_view bench_op_name(BenchOp op);
// One op name, or "all" for every op. Throws InvalidArgument naming the value and the choices.
std::vector<BenchOp> parse_bench_ops(std::string_view text);
// True for the ops that take a reduce op (all_reduce, reduce_scatter).
bool has_reduce_op(BenchOp op);
// Whether `op` takes a root (--root): broadcast.
bool has_root(BenchOp op);

// A byte count: decimal digits with an optional K, M or G suffix (1024-based, either case), as
// nccl-tests' -b/-e. `flag` names the option in the error: "invalid size '4X' for -b/--minbytes
// ...". Rejects empty, negative, fractional and overflowing values.
int64_t parse_size(std::string_view text, std::string_view flag);
// A decimal integer >= min_value; InvalidArgument naming the flag and the value otherwise.
int64_t parse_int(std::string_view text, std::string_view flag, int64_t min_value);
// A contract dtype name, or one of nccl-tests' names (float, half, bfloat16, double, int8, uint8,
// int32, int64). Throws InvalidArgument listing the contract names.
DType parse_bench_dtype(std::string_view text);
// A funcol reduce op name (case-insensitive), or nccl-tests' "prod". Throws InvalidArgument.
ReduceOp parse_bench_redop(std::string_view text);

// The sizes of one run: min, then times `factor` (factor > 1) or plus `step_bytes` (factor == 1)
// while <= max, as nccl-tests. A min of 0 is followed by 1 (0 * factor would repeat forever).
// Sizes whose row (coll_sizes' size and count) equals the previous one's are measured once.
// The size after `size` in that sequence, or -1 when it is the last.
int64_t next_size(int64_t size, int64_t max_bytes, int64_t factor, int64_t step_bytes);
std::vector<int64_t> size_sequence(int64_t min_bytes, int64_t max_bytes, int64_t factor,
                                   int64_t step_bytes);

// Buffers of one measurement, following nccl-tests' per-op conventions (src/*.cu
// GetCollByteCount and common.cu's row print): `count` elements per call per rank (per peer for
// all_to_all), `size_bytes` = the larger of the input and output buffers of one rank. For
// all_gather, reduce_scatter and all_to_all the requested size is rounded down to a multiple of
// ranks * itemsize, as nccl-tests does.
struct CollSizes {
  int64_t count = 0;       // the count column
  int64_t in_numel = 0;    // elements of this rank's input (all_reduce/broadcast: the buffer)
  int64_t out_numel = 0;   // elements of this rank's output
  int64_t size_bytes = 0;  // the size column; algbw = size_bytes / time
};
CollSizes coll_sizes(BenchOp op, int64_t bytes, size_t itemsize, int nranks);

// busbw / algbw (nccl-tests doc/PERFORMANCE.md): all_reduce 2(n-1)/n; all_gather,
// reduce_scatter, all_to_all (n-1)/n; broadcast 1. One rank moves nothing: 0 (broadcast: 1).
double bus_factor(BenchOp op, int nranks);

// Largest M such that every integer in [0, M] is exact in dtype (bool 1, u8 255, bf16 256,
// f16 2048, f32 2^24, ...; i64 is capped at 2^62).
int64_t exact_limit(DType dtype);

// The integer-valued data `-c` checks with: inputs depend on rank and element index, and every
// result is exact in the dtype (sums of n ranks stay <= exact_limit, avg divides exactly), so
// results are compared with ==. Expected outputs are computed here on the host from the inputs,
// never with a backend's kernels. Inputs are periodic in the element index, so fills and checks
// walk small tables. Build once per op and share read-only across ranks.
class CheckPattern {
 public:
  CheckPattern(BenchOp op, ReduceOp redop, DType dtype, int nranks, int root);

  // Element i of `rank`'s input buffer.
  int64_t input(int rank, int64_t i) const;
  // Element j of `rank`'s output, for a call with per-rank `count` (CollSizes::count).
  int64_t expected(int rank, int64_t j, int64_t count) const;
  // The period of input(rank, .) in the element index.
  int64_t period() const { return period_; }

  // Writes input(rank, i) into every element of `t` (contiguous, numel = in_numel); with
  // `rotation` k, input((rank + k) % nranks, i): the ranks' inputs trade places, which leaves
  // every reduction's result unchanged but moves what each rank's own buffer holds (how an
  // in-place reduction's check finds elements the collective left unwritten).
  void fill_input(const Tensor& t, int rank, int rotation = 0) const;
  // Writes into every element of `out` (contiguous, numel = out_numel) a value exact in the
  // dtype that differs from expected(rank, j, count): an element the collective leaves
  // unwritten is always counted wrong (a fixed poison equals some expected values: bool's 1).
  void fill_poison(const Tensor& out, int rank, int64_t count) const;
  // Elements of `out` (contiguous, waited) that differ from expected(rank, j, count).
  int64_t count_wrong(const Tensor& out, int rank, int64_t count) const;

 private:
  // One stretch of the output: table[(offset + k) % period] for k in [0, length).
  struct Segment {
    const std::vector<double>* table;
    int64_t offset;
    int64_t length;
  };
  std::vector<Segment> expected_segments(int rank, int64_t count) const;
  // expected_segments, after checking that `out` is contiguous and holds exactly them.
  std::vector<Segment> output_segments(const Tensor& out, int rank, int64_t count) const;
  std::vector<double> input_table(int rank) const;

  BenchOp op_;
  ReduceOp redop_;
  DType dtype_;
  int nranks_;
  int root_;
  int64_t modulus_ = 1;  // values are < modulus (times nranks for avg)
  int64_t period_ = 1;
  std::vector<double> reduced_;              // reduction ops: reduce over ranks, one period
  std::vector<std::vector<double>> inputs_;  // other ops: every rank's input, one period
};

// This run's memcpy bandwidth: two threads each copying `bytes` at the same time.
struct MemcpyRef {
  int64_t bytes = 0;
  double gbps_per_thread = 0;  // mean over the two threads
  double gbps_total = 0;       // both threads' bytes / the slower thread's time
  int cpus = 0;                // CPUs the two threads ran on: 2, or 1 where only one was allowed
};
MemcpyRef measure_memcpy(int64_t bytes);

// This run's cache-line handoff time: the mean round trip of a flag between two threads. A
// small collective crosses several such handoffs (posting, completing, waking the waiter), so
// this is the unit of its latency, and it varies from run to run with where the machine puts
// the threads (measured here: 60 ns to 600 ns).
struct HandoffRef {
  double round_trip_ns = 0;
};
HandoffRef measure_handoff();

// Everything one `funcol bench` run needs. Defaults: a scan, -b 32 -e 32M -f 2 (nccl-tests'
// README example; its own defaults, -b 32M -e 32M with -i 1M, measure one size), nccl-tests'
// -i 1M -n 20 -w 5 -c 1, and funcol's all ops, f32, sum, root 0, 2 ranks, threads.
struct BenchOptions {
  int64_t min_bytes = 32;
  int64_t max_bytes = int64_t{32} << 20;
  int64_t step_factor = 2;
  int64_t step_bytes = int64_t{1} << 20;  // nccl-tests' -i default, used when -f 1
  int iters = 20;
  int warmup_iters = 5;
  int check = 1;
  std::vector<BenchOp> ops{std::begin(kAllBenchOps), std::end(kAllBenchOps)};
  DType dtype = DType::F32;
  ReduceOp redop = ReduceOp::Sum;
  int root = 0;
  int ranks = 2;  // the CLI defaults it to --world-size when given
  std::string backend = "threads";
  InitOptions join;  // --rank, --world-size, --store: gloo joins that job (launch.h)
  bool json = false;
  // --in-place (nccl-tests' in-place columns): all_gather's input is this rank's block of its
  // output and reduce_scatter's output this rank's block of its input, as FSDP gathers into a
  // flat buffer; no copy of the rank's own block. all_reduce and broadcast always run in place;
  // all_to_all has no in-place form and runs out of place either way. An element an in-place
  // reduction (this reduce_scatter, or all_reduce) leaves unwritten still holds the rank's
  // input; each check of one therefore runs the collective a second time with the ranks'
  // inputs rotated by one, so such an element is counted wherever either of two ranks' inputs
  // differs from the result (every element for sum, product, min and max on every dtype but
  // bool; BenchCheck.RotatedInputsExposeUnwrittenElements has the rest).
  bool in_place = false;
  // 0: measure memcpy; > 0: skip the measurement and report this per-thread GB/s (tests).
  double memcpy_gbps_override = 0;
  // The references as funcol bench measured them before it started this mpi or gloo job (hidden
  // flag --references): mpirun binds each rank to one CPU, so rank 0's own two reference
  // threads would share it (memcpy about halved, the handoff a time slice). memcpy.bytes 0: none
  // given; rank 0 measures them itself.
  struct GivenReferences {
    MemcpyRef memcpy;
    HandoffRef handoff;
  } given_references;
  // Tests of the failure path: rank 0 overwrites element 0 of each output before checking it,
  // so every checked row has exactly one wrong value (hidden flag --inject-wrong).
  bool inject_wrong = false;
};

// Throws InvalidArgument when the options do not make a run (min > max, root out of range,
// bitwise reduce op on a floating dtype, a backend not compiled in, the largest size's buffers
// more than this machine's memory on the ranks it holds or, for a job funcol bench is about to
// start, on all of them, ...).
void validate(const BenchOptions& options);

// The CPU a reference's thread t (0 or 1) is pinned to: the t-th one this process may use, as
// the ranks of the threads backend get (LocalOptions::bind_threads); -1 (unbound) on one CPU.
int reference_cpu(int t);

// One printed row.
struct BenchRow {
  BenchOp op;
  CollSizes sizes;
  double time_us = 0;  // max over ranks of the mean per-iteration time
  double algbw = 0;    // GB/s, 1 GB = 1e9 B
  double busbw = 0;
  int64_t wrong = 0;  // summed over ranks; -1 when not checked (-c 0)
};

struct BenchReport {
  MemcpyRef memcpy;
  HandoffRef handoff;
  std::vector<BenchRow> rows;
  int64_t wrong = 0;     // over every row
  double avg_busbw = 0;  // mean busbw over every row, as nccl-tests' summary
};

// Runs the benchmark and prints the nccl-tests table (or JSON lines) to `out` from rank 0.
// threads: `options.ranks` thread ranks in this process. mpi, gloo: this process is one rank of
// a job (inside_job(backend, options.join), launch.h): it joins the world with init_process_group,
// runs the same collectives as its peers and leaves; rank 0 measures the memcpy reference, prints,
// and gets the rows (the other ranks' reports are empty); InvalidArgument outside a job. Times are
// the slowest rank's and #wrong the sum over ranks, gathered with an all_gather on the world.
// Throws on invalid options and communication failures (process ranks: "rank R: ..."); wrong
// results are reported, not thrown: the caller decides the exit code.
BenchReport run_bench(const BenchOptions& options, std::FILE* out);

// The arguments of `funcol bench` (after the executable) that make a process of an mpi or gloo
// job run `options`: every flag spelled out, sizes in bytes. Throws InvalidArgument when
// options.ops is neither one op nor all of them (-o cannot say so).
std::vector<std::string> bench_job_args(const BenchOptions& options);

}  // namespace funcol::tools
