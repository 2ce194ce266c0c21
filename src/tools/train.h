// `funcol train` internals: options, the FSDP step graphs, the host reference and the runner.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "funcol/core/tensor.h"
#include "funcol/dist/backend.h"
#include "funcol/graph/graph.h"

namespace funcol::tools {

// The flags of `funcol train`. The default model is the demo's: 32 small layers on 4 ranks,
// where each collective moves 4 KiB and bucketing matters most.
struct TrainOptions {
  int ranks = 4;                     // --ranks (the CLI defaults it to --world-size when given)
  int layers = 32;                   // --layers: square weights [hidden, hidden]
  int hidden = 64;                   // --hidden: must be a multiple of --ranks (dim-0 shards)
  int batch = 16;                    // --batch: rows per rank (the global batch is ranks x batch)
  int steps = 100;                   // --steps
  double lr = 0.05;                  // --lr: SGD on 32 plain relu layers diverges above ~0.1
  std::string optimizer = "sgd";     // --optimizer sgd|adam
  std::string bucket_cap_mb = "25";  // --bucket-cap-mb: PyTorch DDP's bucket_cap_mb default
  bool no_bucketing = false;         // --no-bucketing: train and time the unbucketed graph only
  bool no_overlap = false;           // --no-overlap: leave the overlap pass out of both variants
  std::string backend = "threads";   // --backend threads|mpi|gloo
  std::string trace;                 // --trace OUT.json: Chrome trace of the trained variant
  bool json = false;                 // --json: one line of results on stdout
  uint64_t seed = 0;                 // --seed: weights, data and targets
  InitOptions join;                  // --rank, --world-size, --store: gloo joins that job
  // --progress-fd (hidden): the launcher of a gloo job keeps its ranks' stderr until the job
  // ends, so it hands them its own stderr as this descriptor and rank 0 shows progress there.
  int progress_fd = -1;
  // --progress-bar (hidden): the launcher's stderr is a terminal (mpirun passes rank 0's stderr
  // on through a pipe, so rank 0 cannot see that itself): show a bar.
  bool progress_bar = false;
  // --leave-before-step (hidden, tests): this rank throws before step N (0: never).
  int leave_before_step = 0;
};

// Throws InvalidArgument naming the flag and value when the options do not make a run.
void validate(const TrainOptions& options);

// The data and initial weights every run starts from, the ranks' and the reference's alike.
// Rank r's inputs [batch, hidden], uniform in [-1, 1) and different on every rank.
Tensor train_inputs(const TrainOptions& options, int rank);
// The regression targets of inputs x: a fixed random linear teacher (the same on every rank)
// applied to x, scaled so the targets have about the inputs' variance.
Tensor train_targets(const TrainOptions& options, const Tensor& x);
// Layer `layer`'s full [hidden, hidden] weight: uniform with He's variance 2 / fan_in before a
// relu (1 / fan_in for the last, linear layer), so activations keep their scale through deep
// stacks. Rank r holds rows [r * hidden / ranks, (r + 1) * hidden / ranks).
Tensor initial_weight(const TrainOptions& options, int layer);

// The forward graph of one step on every rank: inputs x [batch, hidden], target [batch, hidden]
// and one weight shard [hidden / ranks, hidden] per layer; each layer all-gathers its weight
// (all_gather_into_tensor + wait_tensor) and computes h = relu(h @ W) (no relu after the last);
// the only output is mse_loss(h, target).
std::unique_ptr<Graph> trace_forward(const TrainOptions& options);

// The step graphs that run: the joint graph of the forward (loss, then the gradient of every
// weight shard) through `bucket-all-gather{cap-mb=C},bucket-reduce-scatter{cap-mb=C},overlap,
// dce` (bucketed) or `overlap,dce` (unbucketed); --no-overlap leaves overlap out of both.
// Identical on every rank.
std::unique_ptr<Graph> build_step_graph(const TrainOptions& options, bool bucketed);
// The pipeline text build_step_graph runs.
std::string step_pipeline(const TrainOptions& options, bool bucketed);

// Where one variant's step time went, per step, averaged over ranks and timed steps.
struct TimeSplit {
  double compute_ms = 0;        // kernels of non-collective nodes
  double wait_ms = 0;           // blocked in wait_tensor
  double communication_ms = 0;  // time with at least one collective in flight (overlaps the rest)
  double other_ms = 0;          // the rest of the step: executor bookkeeping, issuing
};

struct VariantReport {
  bool ran = false;
  int64_t nodes = 0;
  int64_t collectives_per_step = 0;
  double step_ms = 0;       // median over timed steps of the slowest rank's step time
  double mean_step_ms = 0;  // mean of the same
  TimeSplit split;
  // Rank 0's compute per step by op name, largest first.
  std::vector<std::pair<std::string, double>> compute_ms_by_op;
};

struct TrainReport {
  std::vector<double> losses;  // global loss (mean over ranks) before each step's update
  double initial_loss = 0;
  double final_loss = 0;
  double reference_final_loss = 0;
  double max_abs_diff_vs_reference = 0;
  std::vector<Tensor> final_weights;  // the trained weights, whole ([hidden, hidden] each)
  int timed_steps = 0;  // steps whose times count (the first is warm-up when steps > 1)
  VariantReport unbucketed;
  VariantReport bucketed;
  bool trained_bucketed = true;
  // Both variants gave bit-identical loss and gradients at every step (when both ran).
  bool variants_identical = true;
};

// Called by rank 0 after every step (1-based) with the global loss before that step's update.
using StepCallback = std::function<void(int step, double loss)>;

// Trains on options.ranks thread ranks (threads backend) and checks the result against the
// single-process reference. Throws InvalidArgument for bad options (see validate).
TrainReport run_train(const TrainOptions& options, const StepCallback& on_step = {});

// The --json line: {"initial_loss", "final_loss", "max_abs_diff_vs_reference",
// "collectives_per_step": {"unbucketed", "bucketed"}, "step_ms": {"unbucketed", "bucketed"},
// ...}; every "bucketed" field is null under --no-bucketing (that variant did not run).
std::string train_json_line(const TrainOptions& options, const TrainReport& report);
// The human summary printed after training.
std::string train_summary(const TrainOptions& options, const TrainReport& report);

// Throws InternalError when the result failed its checks: the trained weights differ from the
// single-process reference (they are bit-identical by construction: the same kernels, the same
// order of combination), or the bucketed and unbucketed variants differed at some step. A run
// whose loss or trained weights stopped being finite (diverged: lower --lr) is not compared with
// the reference: its weights hold NaN, and so may the reference's.
void check_train_report(const TrainReport& report);

// Runs the command: progress on `err` (a bar when `progress_bar`, `err` being a terminal, else
// plain lines, none with --json; a launched rank 0 writes it where its launcher said, see
// progress_fd and progress_bar), the summary or the JSON line on `out`, errors on `err` as
// "funcol: error: ...". Returns the exit status: 1 also when the result failed its checks
// (check_train_report), after the summary.
int train_command(const TrainOptions& options, std::FILE* out, std::FILE* err, bool progress_bar);

}  // namespace funcol::tools
