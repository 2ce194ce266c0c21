// `funcol train`: an MLP trained with fully sharded data parallelism through the whole stack.
//
// Every rank holds a dim-0 shard of each weight. The forward (traced from the functional API)
// all-gathers each weight before its matmul; autodiff turns those gathers into gradient
// reduce-scatters; the bucketing passes fuse the per-layer collectives; overlap moves issues up
// and waits down; the executor runs the step on every rank. The optimizer (SGD or Adam) runs
// on the host, on each rank's shards, with the reduce-scattered gradients divided by the number
// of ranks (the loss is the mean over the global batch, so its gradient is the mean of the
// ranks' gradients). A single-process reference (full weights, global batch, hand-written
// backward, same optimizer, same CPU kernels) checks the result.
#include "tools/train.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <span>

#include <nlohmann/json.hpp>

#include "core/memory.h"
#include "funcol/api/functional.h"
#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/dist/backend.h"
#include "funcol/graph/tracer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/autodiff.h"
#include "funcol/passes/bucketing.h"
#include "funcol/passes/pipeline.h"
#include "funcol/runtime/executor.h"
#include "funcol/runtime/profile.h"
#include "tools/commands.h"
#include "tools/json_line.h"
#include "tools/launch.h"
#include "tools/spawn.h"

namespace funcol::tools {

namespace {

// torch.optim.Adam's defaults.
constexpr double kAdamBeta1 = 0.9;
constexpr double kAdamBeta2 = 0.999;
constexpr double kAdamEps = 1e-8;

// Seed indices of the generated tensors (input_seed(seed, index, rank) mixes them).
constexpr uint64_t kSeedInput = 0;
constexpr uint64_t kSeedTeacher = 1;
constexpr uint64_t kSeedWeight = 2;  // + layer

int64_t shard_rows(const TrainOptions& o) { return o.hidden / o.ranks; }

// ---- optimizers --------------------------------------------------------------------------------

// One parameter's optimizer state (f32, as PyTorch keeps it for f32 parameters): the ranks (their
// shards) and the reference (full weights) run literally the same update. train_test checks it
// against the definitions worked out by hand in double precision.
class ParamOptimizer {
 public:
  ParamOptimizer(const TrainOptions& o, int64_t n) : adam_(o.optimizer == "adam"), lr_(o.lr) {
    if (adam_) {
      m_.assign(static_cast<size_t>(n), 0.0f);
      v_.assign(static_cast<size_t>(n), 0.0f);
    }
  }
  // w -= update(grad * scale); `step` counts from 1 (Adam's bias correction).
  void update(float* w, const float* grad, int64_t n, float scale, int step) {
    const auto lr = static_cast<float>(lr_);
    if (!adam_) {
      for (int64_t i = 0; i < n; ++i) w[i] -= lr * (grad[i] * scale);
      return;
    }
    const auto b1 = static_cast<float>(kAdamBeta1);
    const auto b2 = static_cast<float>(kAdamBeta2);
    const auto c1 = static_cast<float>(1.0 - std::pow(kAdamBeta1, step));
    const auto c2 = static_cast<float>(1.0 - std::pow(kAdamBeta2, step));
    const auto eps = static_cast<float>(kAdamEps);
    for (int64_t i = 0; i < n; ++i) {
      const float g = grad[i] * scale;
      float& m = m_[static_cast<size_t>(i)];
      float& v = v_[static_cast<size_t>(i)];
      m = b1 * m + (1 - b1) * g;
      v = b2 * v + (1 - b2) * g * g;
      w[i] -= lr * (m / c1) / (std::sqrt(v / c2) + eps);
    }
  }

 private:
  bool adam_;
  double lr_;
  std::vector<float> m_, v_;
};

// ---- the single-process reference ------------------------------------------------------------

struct ReferenceResult {
  std::vector<Tensor> weights;  // full [hidden, hidden] weights after training
  std::vector<double> losses;
};

// One process, full weights, the whole global batch, a hand-written backward and the same
// optimizer; no graph, no collectives. The batch is processed in the ranks' row blocks with the
// same CPU kernels, and the blocks' weight gradients are summed in rank order (as the threads
// backend's reduce-scatter sums): the float rounding then matches the distributed run's, so a
// difference is an error of the distributed path, not of summation order. (A plain relu stack
// 32 deep is chaotic: rounding-level differences flip a relu after some tens of steps and the
// trajectories separate, which would hide real errors.)
ReferenceResult run_reference(const TrainOptions& o, const std::vector<Tensor>& xs,
                              const std::vector<Tensor>& targets) {
  ReferenceResult ref;
  std::vector<ParamOptimizer> opt;
  for (int l = 0; l < o.layers; ++l) {
    ref.weights.push_back(initial_weight(o, l));
    opt.emplace_back(o, ref.weights.back().numel());
  }
  const size_t n = static_cast<size_t>(o.layers);
  const size_t ranks = static_cast<size_t>(o.ranks);
  // d mse / d output of one block: 2 (y - t) / numel, as mse_loss's gradient rule.
  const double scale = 2.0 / (static_cast<double>(o.batch) * o.hidden);
  std::vector<std::vector<Tensor>> acts(ranks, std::vector<Tensor>(n + 1));
  std::vector<std::vector<Tensor>> pre(ranks, std::vector<Tensor>(n));
  std::vector<Tensor> grad(ranks);
  for (int step = 1; step <= o.steps; ++step) {
    double loss = 0;
    for (size_t r = 0; r < ranks; ++r) {
      acts[r][0] = xs[r];
      for (size_t l = 0; l < n; ++l) {
        pre[r][l] = matmul(acts[r][l], ref.weights[l]);
        acts[r][l + 1] = l + 1 < n ? relu(pre[r][l]) : pre[r][l];
      }
      loss += mse_loss(acts[r][n], targets[r]).item<double>() / o.ranks;
      grad[r] = mul_scalar(sub(acts[r][n], targets[r]), scale);
    }
    ref.losses.push_back(loss);
    for (size_t l = n; l-- > 0;) {
      Tensor dw;
      for (size_t r = 0; r < ranks; ++r) {
        if (l + 1 < n) grad[r] = relu_backward(grad[r], pre[r][l]);
        const Tensor part = matmul(acts[r][l].transpose(0, 1), grad[r]);
        dw = r == 0 ? part : add(dw, part);
        if (l > 0) grad[r] = matmul(grad[r], ref.weights[l].transpose(0, 1));
      }
      opt[l].update(ref.weights[l].data<float>(), dw.data<float>(), dw.numel(),
                    1.0f / static_cast<float>(o.ranks), step);
    }
  }
  return ref;
}

// ---- the ranks ----------------------------------------------------------------------------------

int64_t count_collectives(const Graph& g) {
  int64_t n = 0;
  for (const Node& node : g.nodes()) n += node.op().is_collective();
  return n;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// One variant (unbucketed or bucketed) on one rank: its graph, executor and span totals.
struct Variant {
  std::unique_ptr<Graph> graph;
  Profiler profiler;
  std::unique_ptr<Executor> executor;
  size_t seen_spans = 0;
  double span_ms[3] = {0, 0, 0};  // by SpanKind
  std::map<std::string, double> compute_ms_by_op;
  std::vector<Tensor> outputs;

  // Adds the spans recorded since the last call (one run); forgets them unless `keep`
  // (tracing). Communication counts the time at least one collective was in flight (the union
  // of the collectives' spans), not their sum.
  void collect(bool timed, bool keep) {
    const std::vector<Span>& spans = profiler.spans();
    std::vector<std::pair<int64_t, int64_t>> comm;
    for (size_t i = seen_spans; timed && i < spans.size(); ++i) {
      const Span& sp = spans[i];
      if (sp.kind == SpanKind::Communication) {
        comm.emplace_back(sp.begin_ns, sp.end_ns);
        continue;
      }
      const double ms = static_cast<double>(sp.end_ns - sp.begin_ns) / 1e6;
      span_ms[static_cast<int>(sp.kind)] += ms;
      if (sp.kind == SpanKind::Compute && sp.node) {
        compute_ms_by_op[std::string(sp.node->op_name())] += ms;
      }
    }
    std::sort(comm.begin(), comm.end());
    int64_t covered_ns = 0, end = INT64_MIN;
    for (const auto& [b, e] : comm) {
      const int64_t from = std::max(b, end);
      if (e > from) covered_ns += e - from;
      end = std::max(end, e);
    }
    span_ms[static_cast<int>(SpanKind::Communication)] += static_cast<double>(covered_ns) / 1e6;
    if (keep) {
      seen_spans = spans.size();
    } else {
      profiler.clear();
      seen_spans = 0;
    }
  }
};

// What the ranks hand back (written by rank 0, or by each rank into its own slot).
struct Shared {
  std::vector<double> losses;
  std::vector<double> ms_unbucketed, ms_bucketed;
  std::vector<Tensor> final_weights;
  double split[6] = {0, 0, 0, 0, 0, 0};
  bool identical = true;
  std::vector<std::string> trace_events;
  int64_t nodes[2] = {0, 0};
  int64_t collectives[2] = {0, 0};
  std::map<std::string, double> compute_ms_by_op[2];  // rank 0's, summed over timed steps
};

bool same_outputs(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].equal(b[i])) return false;
  }
  return true;
}

void run_rank(ProcessGroup& world, const TrainOptions& o, const StepCallback& on_step, Shared& sh) {
  const int rank = world.rank();
  const bool tracing = !o.trace.empty();
  const Tensor x = train_inputs(o, rank);
  const Tensor target = train_targets(o, x);

  // Every rank builds its own graphs (as separate processes would); the executors check that
  // they hash the same on every rank before running.
  Variant variants[2];
  const bool run_variant[2] = {true, !o.no_bucketing};
  const int trained = o.no_bucketing ? 0 : 1;
  for (int v = 0; v < 2; ++v) {
    if (!run_variant[v]) continue;
    variants[v].graph = build_step_graph(o, /*bucketed=*/v == 1);
    ExecutorOptions eo;
    eo.profiler = &variants[v].profiler;
    variants[v].executor = std::make_unique<Executor>(*variants[v].graph, world, eo);
    if (rank == 0) {
      sh.nodes[v] = static_cast<int64_t>(variants[v].graph->num_nodes());
      sh.collectives[v] = count_collectives(*variants[v].graph);
    }
  }

  std::vector<Tensor> shards;
  std::vector<ParamOptimizer> opt;
  for (int l = 0; l < o.layers; ++l) {
    shards.push_back(initial_weight(o, l).narrow(0, rank * shard_rows(o), shard_rows(o)).clone());
    opt.emplace_back(o, shards.back().numel());
  }
  const float grad_scale = 1.0f / static_cast<float>(o.ranks);
  bool identical = true;

  world.barrier();
  std::vector<Profiler*> profilers;
  for (Variant& v : variants) profilers.push_back(&v.profiler);
  align_epochs(world, profilers);
  for (int step = 1; step <= o.steps; ++step) {
    if (step == o.leave_before_step) {
      throw Error(fmt::format("leaving before step {} (--leave-before-step)", step));
    }
    // The first step warms caches and allocators up; it is not timed (unless it is the only one).
    const bool timed = step > 1 || o.steps == 1;
    std::vector<Tensor> inputs = {x, target};
    inputs.insert(inputs.end(), shards.begin(), shards.end());
    double ms[2] = {0, 0};
    // Side by side: both variants on the same inputs, alternating which goes first.
    for (int k = 0; k < 2; ++k) {
      const int v = (step % 2 == 0) ? k : 1 - k;
      if (!run_variant[v]) continue;
      world.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      variants[v].outputs = variants[v].executor->run(inputs);
      ms[v] =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      variants[v].collect(timed, tracing && v == trained);
    }
    if (run_variant[0] && run_variant[1] &&
        !same_outputs(variants[0].outputs, variants[1].outputs)) {
      identical = false;
    }
    const std::vector<Tensor>& out = variants[trained].outputs;
    for (int l = 0; l < o.layers; ++l) {
      const Tensor& g = out[static_cast<size_t>(l) + 1];
      opt[static_cast<size_t>(l)].update(shards[static_cast<size_t>(l)].data<float>(),
                                         g.contiguous().data<float>(), g.numel(), grad_scale, step);
    }
    // The global loss (mean over ranks) and the slowest rank's times, outside the timed runs.
    Tensor loss = Tensor::from_vector<double>({out[0].item<double>() / o.ranks});
    world.all_reduce(loss, ReduceOp::Sum)->wait();
    Tensor times = Tensor::from_vector<double>({ms[0], ms[1]});
    world.all_reduce(times, ReduceOp::Max)->wait();
    if (rank == 0) {
      const double l = loss.item<double>();
      sh.losses.push_back(l);
      const std::vector<double> t = times.to_vector<double>();
      if (timed) {
        sh.ms_unbucketed.push_back(t[0]);
        if (run_variant[1]) sh.ms_bucketed.push_back(t[1]);
      }
      if (on_step) on_step(step, l);
    }
  }

  // Where the time went, summed over ranks (divided by ranks and steps by the caller).
  Tensor split = Tensor::from_vector<double>({variants[0].span_ms[0], variants[0].span_ms[1],
                                              variants[0].span_ms[2], variants[1].span_ms[0],
                                              variants[1].span_ms[1], variants[1].span_ms[2]});
  world.all_reduce(split, ReduceOp::Sum)->wait();
  Tensor same = Tensor::from_vector<int32_t>({identical ? 1 : 0});
  world.all_reduce(same, ReduceOp::Min)->wait();
  // The trained weights, whole, on rank 0.
  std::vector<Tensor> full;
  for (const Tensor& s : shards) {
    Tensor w = Tensor::empty({o.hidden, o.hidden}, DType::F32);
    world.all_gather(w, s)->wait();
    full.push_back(w);
  }
  if (tracing) {
    sh.trace_events[static_cast<size_t>(rank)] =
        trace_events_json(variants[trained].profiler, rank);
  }
  if (rank == 0) {
    const std::vector<double> s = split.to_vector<double>();
    std::copy(s.begin(), s.end(), sh.split);
    sh.identical = same.item<int32_t>() == 1;
    sh.final_weights = std::move(full);
    for (int v = 0; v < 2; ++v) sh.compute_ms_by_op[v] = variants[v].compute_ms_by_op;
  }
}

std::string format_ms(double ms) { return fmt::format("{:.3f} ms", ms); }

// Timed steps below which the two variants' step times are not worth comparing: the first
// step is not timed and each step runs one variant first, alternating, so a few steps favour
// whichever went second (measured here: --steps 2 gave 0.61x to 1.04x for identical variants,
// --steps 100 0.96x to 0.99x).
constexpr int kFairSteps = 10;

}  // namespace

Tensor train_inputs(const TrainOptions& o, int rank) {
  return Tensor::rand({o.batch, o.hidden}, DType::F32, input_seed(o.seed, kSeedInput, rank));
}

Tensor train_targets(const TrainOptions& o, const Tensor& x) {
  const Tensor teacher =
      Tensor::rand({o.hidden, o.hidden}, DType::F32, input_seed(o.seed, kSeedTeacher, 0));
  return matmul(x, mul_scalar(teacher, std::sqrt(3.0 / o.hidden)));
}

Tensor initial_weight(const TrainOptions& o, int layer) {
  const double gain = layer + 1 < o.layers ? 2.0 : 1.0;
  const Tensor u = Tensor::rand({o.hidden, o.hidden}, DType::F32,
                                input_seed(o.seed, kSeedWeight + static_cast<uint64_t>(layer), 0));
  return mul_scalar(u, std::sqrt(3.0 * gain / o.hidden));
}

void validate(const TrainOptions& o) {
  auto at_least = [](const char* flag, int64_t value, int64_t min) {
    if (value < min) {
      throw InvalidArgument(fmt::format("{} must be at least {}, got {}", flag, min, value));
    }
  };
  at_least("--ranks", o.ranks, 1);
  at_least("--layers", o.layers, 1);
  at_least("--hidden", o.hidden, 1);
  at_least("--batch", o.batch, 1);
  at_least("--steps", o.steps, 1);
  if (o.hidden % o.ranks != 0) {
    throw InvalidArgument(fmt::format(
        "--hidden {} is not divisible by --ranks {} (each weight is sharded along dim 0 over "
        "the ranks)",
        o.hidden, o.ranks));
  }
  if (!(o.lr > 0) || !std::isfinite(o.lr)) {
    throw InvalidArgument(fmt::format("--lr must be a positive number, got {}", o.lr));
  }
  // The optimizers step in f32: a rate that becomes 0 or infinity there would train nothing, or
  // only NaN, with no error.
  const auto lr32 = static_cast<float>(o.lr);
  if (!(lr32 > 0) || !std::isfinite(lr32)) {
    throw InvalidArgument(fmt::format(
        "--lr {} is {} in f32, in which the optimizers step (it must lie within {:g} to {:g})",
        o.lr, lr32 > 0 ? "infinite" : "zero", std::numeric_limits<float>::denorm_min(),
        std::numeric_limits<float>::max()));
  }
  if (o.optimizer != "sgd" && o.optimizer != "adam") {
    throw InvalidArgument(
        fmt::format("unknown optimizer '{}' for --optimizer: expected sgd or adam", o.optimizer));
  }
  try {
    parse_cap_mb(o.bucket_cap_mb);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(fmt::format("--bucket-cap-mb: {}", e.what()));
  }
  check_backend_option(o.backend);
  check_job_options(o.backend, o.join, o.ranks);
  // Keep a run within memory (f32 throughout, in doubles: the products overflow int64). Fitted
  // to the peak resident memory of 2-step Adam runs here (FUNCOL_ALLOC_CACHE_MB at its default)
  // and rounded up: with W the bytes of one full set of weights, 6.0 W for 1 rank, 8.1 W (no
  // bucket merges: 64 MiB layers) to 10.9 W (64 layers of 4 MiB: the bucketed variant keeps its
  // packed buffers) for 2, 12.8 W for 4 and 17.7 W for 8. Every rank holds its shards, Adam's
  // moments, the gathered weights and full gradients of both variants, the reference the full
  // weights, moments and gradients. Activations: every rank keeps its batch's activations of
  // every layer for the backward and the reference the global batch's (measured: about 1.2
  // buffers of a layer's activations per layer and rank; 2 here). Every rank builds its own
  // two step graphs and executors: about 20 KB per layer (measured with --hidden 4), so 25 KB.
  const double weights = 4.0 * o.hidden * o.hidden * o.layers * (1.75 * o.ranks + 7.5);
  const double activations = 4.0 * o.batch * o.hidden * (o.layers + 1.0) * o.ranks * 2;
  const double graphs = 25e3 * o.layers * o.ranks;
  const double bytes = weights + activations + graphs;
  if (bytes > 8e9) {
    throw InvalidArgument(fmt::format(
        "--layers {} x --hidden {} x --batch {} on --ranks {} needs about {:.0f} GB; use a "
        "smaller model",
        o.layers, o.hidden, o.batch, o.ranks, bytes / 1e9));
  }
  // Also within the memory of this machine (a container's limit included) for the ranks it
  // holds: over it, the run would be killed while it writes.
  const int here = ranks_on_this_machine(o.backend, o.ranks, o.join);
  const double mine = bytes * here / o.ranks;
  const auto memory = static_cast<double>(detail::physical_memory_bytes());
  if (memory > 0 && mine > memory) {
    throw InvalidArgument(fmt::format(
        "--layers {} x --hidden {} x --batch {} on --ranks {} needs about {:.2f} GB for the {} "
        "rank{} on this machine, more than its {:.2f} GB; use a smaller model",
        o.layers, o.hidden, o.batch, o.ranks, mine / 1e9, here, here == 1 ? "" : "s",
        memory / 1e9));
  }
}

std::unique_ptr<Graph> trace_forward(const TrainOptions& o) {
  std::vector<Type> inputs = {Type(DType::F32, {o.batch, o.hidden}),
                              Type(DType::F32, {o.batch, o.hidden})};
  for (int l = 0; l < o.layers; ++l)
    inputs.emplace_back(DType::F32, Shape{shard_rows(o), o.hidden});
  return trace("fsdp_mlp", inputs,
               [&](std::span<const Tensor> in) {
                 Tensor h = in[0];
                 for (int l = 0; l < o.layers; ++l) {
                   const Tensor w = all_gather_tensor(in[2 + static_cast<size_t>(l)], 0, "world");
                   h = ops::matmul(h, w);
                   if (l + 1 < o.layers) h = ops::relu(h);
                 }
                 return std::vector<Tensor>{ops::mse_loss(h, in[1])};
               },
               {{"world", o.ranks}});
}

std::string step_pipeline(const TrainOptions& o, bool bucketed) {
  const std::string tail = o.no_overlap ? "dce" : "overlap,dce";
  if (!bucketed) return tail;
  const std::string cap = format_cap_mb(parse_cap_mb(o.bucket_cap_mb));
  return fmt::format("bucket-all-gather{{cap-mb={0}}},bucket-reduce-scatter{{cap-mb={0}}},{1}", cap,
                     tail);
}

std::unique_ptr<Graph> build_step_graph(const TrainOptions& o, bool bucketed) {
  const std::unique_ptr<Graph> forward = trace_forward(o);
  std::vector<int> wrt;
  for (int l = 0; l < o.layers; ++l) wrt.push_back(2 + l);
  auto joint = std::make_unique<Graph>(build_joint_graph(*forward, wrt));
  Pipeline::parse(step_pipeline(o, bucketed)).run(*joint);
  verify(*joint);
  return joint;
}

namespace {

// Rank 0's part once every rank has trained: the reference run and the report.
TrainReport make_report(const TrainOptions& o, const Shared& sh) {
  std::vector<Tensor> xs, targets;
  for (int r = 0; r < o.ranks; ++r) {
    xs.push_back(train_inputs(o, r));
    targets.push_back(train_targets(o, xs.back()));
  }
  const ReferenceResult ref = run_reference(o, xs, targets);

  TrainReport report;
  report.losses = sh.losses;
  report.initial_loss = sh.losses.front();
  report.final_loss = sh.losses.back();
  report.reference_final_loss = ref.losses.back();
  report.final_weights = sh.final_weights;
  for (size_t l = 0; l < ref.weights.size(); ++l) {
    const std::vector<float> got = sh.final_weights[l].to_vector<float>();
    const std::vector<float> want = ref.weights[l].to_vector<float>();
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
      if (std::isnan(d) && got[i] != want[i]) {
        // A NaN weight matches nothing: the difference is NaN too, not ignored by max.
        report.max_abs_diff_vs_reference = std::numeric_limits<double>::quiet_NaN();
      } else if (d > report.max_abs_diff_vs_reference) {  // also false once it is NaN
        report.max_abs_diff_vs_reference = d;
      }
    }
  }
  report.timed_steps = static_cast<int>(sh.ms_unbucketed.size());
  report.trained_bucketed = !o.no_bucketing;
  report.variants_identical = sh.identical;
  const double per = static_cast<double>(o.ranks) * std::max(report.timed_steps, 1);
  auto fill = [&](VariantReport& v, int index, const std::vector<double>& ms) {
    v.ran = true;
    v.nodes = sh.nodes[index];
    v.collectives_per_step = sh.collectives[index];
    v.step_ms = median(ms);
    for (double m : ms) v.mean_step_ms += m / static_cast<double>(ms.size());
    v.split.compute_ms = sh.split[index * 3 + static_cast<int>(SpanKind::Compute)] / per;
    v.split.communication_ms =
        sh.split[index * 3 + static_cast<int>(SpanKind::Communication)] / per;
    v.split.wait_ms = sh.split[index * 3 + static_cast<int>(SpanKind::Wait)] / per;
    v.split.other_ms = std::max(0.0, v.mean_step_ms - v.split.compute_ms - v.split.wait_ms);
    for (const auto& [op, ms] : sh.compute_ms_by_op[index]) {
      v.compute_ms_by_op.emplace_back(op, ms / std::max(report.timed_steps, 1));
    }
    std::stable_sort(v.compute_ms_by_op.begin(), v.compute_ms_by_op.end(),
                     [](const auto& a, const auto& b) { return a.second > b.second; });
  };
  fill(report.unbucketed, 0, sh.ms_unbucketed);
  if (!o.no_bucketing) fill(report.bucketed, 1, sh.ms_bucketed);
  if (!o.trace.empty()) write_file(o.trace, chrome_trace_json(sh.trace_events), "trace file");
  return report;
}

}  // namespace

TrainReport run_train(const TrainOptions& o, const StepCallback& on_step) {
  validate(o);
  if (o.backend != "threads") {
    throw InvalidArgument(fmt::format(
        "run_train runs the threads backend in this process; --backend {} runs through "
        "train_command, which starts a job",
        o.backend));
  }
  Shared sh;
  sh.trace_events.resize(static_cast<size_t>(o.ranks));
  run_local(o.ranks, [&](ProcessGroup& world) { run_rank(world, o, on_step, sh); });
  return make_report(o, sh);
}

std::string train_json_line(const TrainOptions& o, const TrainReport& r) {
  using json = nlohmann::ordered_json;
  json j;
  j["initial_loss"] = r.initial_loss;
  j["final_loss"] = r.final_loss;
  j["max_abs_diff_vs_reference"] = r.max_abs_diff_vs_reference;
  j["collectives_per_step"] = {
      {"unbucketed", r.unbucketed.collectives_per_step},
      {"bucketed", r.bucketed.ran ? json(r.bucketed.collectives_per_step) : json(nullptr)}};
  j["step_ms"] = {{"unbucketed", r.unbucketed.step_ms},
                  {"bucketed", r.bucketed.ran ? json(r.bucketed.step_ms) : json(nullptr)}};
  j["reference_final_loss"] = r.reference_final_loss;
  j["bucketed_over_unbucketed"] = r.bucketed.ran && r.unbucketed.step_ms > 0
                                      ? json(r.bucketed.step_ms / r.unbucketed.step_ms)
                                      : json(nullptr);
  auto split = [](const VariantReport& v) {
    return json{{"compute_ms", v.split.compute_ms},
                {"wait_ms", v.split.wait_ms},
                {"communication_ms", v.split.communication_ms},
                {"other_ms", v.split.other_ms}};
  };
  j["time_split"] = {{"unbucketed", split(r.unbucketed)},
                     {"bucketed", r.bucketed.ran ? split(r.bucketed) : json(nullptr)}};
  auto by_op = [](const VariantReport& v) {
    json ops = json::object();
    for (const auto& [op, ms] : v.compute_ms_by_op) ops[op] = ms;
    return ops;
  };
  j["compute_ms_by_op"] = {{"unbucketed", by_op(r.unbucketed)},
                           {"bucketed", r.bucketed.ran ? by_op(r.bucketed) : json(nullptr)}};
  // Compared only when both variants ran.
  j["variants_identical"] = r.bucketed.ran ? json(r.variants_identical) : json(nullptr);
  j["timed_steps"] = r.timed_steps;
  j["config"] = {{"ranks", o.ranks},
                 {"layers", o.layers},
                 {"hidden", o.hidden},
                 {"batch", o.batch},
                 {"steps", o.steps},
                 {"lr", o.lr},
                 {"optimizer", o.optimizer},
                 {"bucket_cap_mb", o.bucket_cap_mb},
                 {"no_bucketing", o.no_bucketing},
                 {"no_overlap", o.no_overlap},
                 {"seed", o.seed},
                 {"backend", o.backend}};
  return json_line(j);
}

namespace {

// The index of the first step whose loss is not finite (training diverged), if any.
std::optional<size_t> first_non_finite_loss(const TrainReport& r) {
  for (size_t i = 0; i < r.losses.size(); ++i) {
    if (!std::isfinite(r.losses[i])) return i;
  }
  return std::nullopt;
}

// Whether a trained weight is not finite: the last update diverged (its loss is never seen).
bool non_finite_weights(const TrainReport& r) {
  for (const Tensor& w : r.final_weights) {
    for (float v : w.to_vector<float>()) {
      if (!std::isfinite(v)) return true;
    }
  }
  return false;
}

}  // namespace

void check_train_report(const TrainReport& r) {
  if (r.bucketed.ran && !r.variants_identical) {
    throw InternalError(
        "the bucketed and unbucketed steps gave different results (they are bit-identical by "
        "construction): a funcol bug");
  }
  if (first_non_finite_loss(r) || non_finite_weights(r)) return;  // diverged: not compared
  if (r.max_abs_diff_vs_reference != 0) {  // NaN too
    throw InternalError(fmt::format(
        "the trained weights differ from the single-process reference by up to {:.3g} (they are "
        "bit-identical by construction): a funcol bug",
        r.max_abs_diff_vs_reference));
  }
}

// A loss as printed: a NaN as "nan" whatever its sign bit (a diverged run's NaNs mostly have
// it set, which printed "-nan").
static double shown(double loss) { return std::isnan(loss) ? std::fabs(loss) : loss; }

std::string train_summary(const TrainOptions& o, const TrainReport& r) {
  std::string s;
  s += fmt::format(
      "funcol train: {}-layer MLP, hidden {}, FSDP over {} rank{} ({}), batch {} per rank ({} "
      "global), {} lr {}, {} step{}\n",
      o.layers, o.hidden, o.ranks, o.ranks == 1 ? "" : "s", o.backend, o.batch,
      o.batch * o.ranks, o.optimizer, o.lr, o.steps, o.steps == 1 ? "" : "s");
  s += fmt::format("  loss                 {:.6g} -> {:.6g} (step 1 -> {})\n",
                   shown(r.initial_loss), shown(r.final_loss), o.steps);
  s += fmt::format(
      "  vs reference         max abs weight difference {:.3g} (1 process, full weights, "
      "global batch; its last loss {:.6g})\n",
      r.max_abs_diff_vs_reference, shown(r.reference_final_loss));
  if (r.bucketed.ran) {
    s += fmt::format("  collectives per step {} unbucketed -> {} bucketed (cap {} MB)\n",
                     r.unbucketed.collectives_per_step, r.bucketed.collectives_per_step,
                     o.bucket_cap_mb);
    s += fmt::format(
        "  step time            {} unbucketed, {} bucketed: bucketed/unbucketed {:.2f} (median "
        "of {} step{}, side by side, slowest rank{})\n",
        format_ms(r.unbucketed.step_ms), format_ms(r.bucketed.step_ms),
        r.unbucketed.step_ms > 0 ? r.bucketed.step_ms / r.unbucketed.step_ms : 0.0, r.timed_steps,
        r.timed_steps == 1 ? "" : "s",
        // Each step runs one variant first (alternating): a few steps favour one of them.
        r.timed_steps < kFairSteps
            ? fmt::format("; too few to compare: use --steps {} or more", kFairSteps + 1)
            : std::string());
  } else {
    s += fmt::format("  collectives per step {} (bucketing off)\n",
                     r.unbucketed.collectives_per_step);
    s += fmt::format("  step time            {} (median of {} step{}, slowest rank)\n",
                     format_ms(r.unbucketed.step_ms), r.timed_steps,
                     r.timed_steps == 1 ? "" : "s");
  }
  // The split is of the mean step, which one slow step moves more than the median above.
  s += fmt::format(
      "  where the time went  per step, mean over steps and ranks (mean step {}{}; communication: "
      "time with a collective in flight, overlapping the rest):\n",
      format_ms(r.unbucketed.mean_step_ms),
      r.bucketed.ran ? fmt::format(" unbucketed, {} bucketed", format_ms(r.bucketed.mean_step_ms))
                     : std::string());
  auto line = [&](const char* name, const VariantReport& v) {
    s += fmt::format("    {:<11} compute {}, waiting {}, other {}; communication in flight {}\n",
                     name, format_ms(v.split.compute_ms), format_ms(v.split.wait_ms),
                     format_ms(v.split.other_ms), format_ms(v.split.communication_ms));
    std::string ops;
    for (size_t i = 0; i < std::min<size_t>(4, v.compute_ms_by_op.size()); ++i) {
      ops += fmt::format("{}{} {}", i ? ", " : "", v.compute_ms_by_op[i].first,
                         format_ms(v.compute_ms_by_op[i].second));
    }
    if (!ops.empty()) s += fmt::format("    {:<11} compute by op (rank 0): {}\n", "", ops);
  };
  line("unbucketed", r.unbucketed);
  if (r.bucketed.ran) {
    line("bucketed", r.bucketed);
    s += fmt::format("  bucketed vs unbucketed results: {}\n",
                     r.variants_identical ? "bit-identical at every step" : "DIFFERENT");
  }
  if (!o.trace.empty()) s += fmt::format("  trace                {}\n", o.trace);
  return s;
}

namespace {

// The flags a launched rank gets: the same training, as a rank of the job.
std::vector<std::string> train_rank_args(const TrainOptions& o) {
  std::vector<std::string> a = {"train",
                                "--ranks", std::to_string(o.ranks),
                                "--layers", std::to_string(o.layers),
                                "--hidden", std::to_string(o.hidden),
                                "--batch", std::to_string(o.batch),
                                "--steps", std::to_string(o.steps),
                                "--lr", fmt::format("{}", o.lr),
                                "--optimizer", o.optimizer,
                                "--bucket-cap-mb", o.bucket_cap_mb,
                                "--backend", o.backend,
                                "--seed", std::to_string(o.seed)};
  if (o.no_bucketing) a.emplace_back("--no-bucketing");
  if (o.no_overlap) a.emplace_back("--no-overlap");
  if (o.json) a.emplace_back("--json");
  if (!o.trace.empty()) a.insert(a.end(), {"--trace", o.trace});
  if (o.progress_fd >= 0) a.insert(a.end(), {"--progress-fd", std::to_string(o.progress_fd)});
  if (o.progress_bar) a.emplace_back("--progress-bar");
  return a;
}

// The progress of training: a bar (on a terminal) or a line every tenth of the steps (none with
// --json), on the descriptor the launcher handed this rank (--progress-fd) when it is open, else
// on `err`. A bar's line is ended before anything else is printed: at the last step, or by
// end_line() (an error) and at destruction.
class Progress {
 public:
  Progress(const TrainOptions& o, std::FILE* err, bool err_is_terminal)
      : steps_(o.steps),
        json_(o.json),
        own_(o.progress_fd >= 0 && fcntl(o.progress_fd, F_GETFD) != -1
                 ? fdopen(dup(o.progress_fd), "w")
                 : nullptr),
        file_(own_ ? own_ : err),
        bar_(own_ ? isatty(o.progress_fd) != 0 : err_is_terminal || o.progress_bar) {}
  ~Progress() {
    end_line();
    if (own_) std::fclose(own_);
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void step(int step, double loss) {
    if (bar_) {
      constexpr int kWidth = 30;
      const int done = static_cast<int>(static_cast<int64_t>(kWidth) * step / steps_);
      std::fprintf(file_, "\r[%s%s] step %d/%d  loss %.6g", std::string(done, '#').c_str(),
                   std::string(kWidth - done, '.').c_str(), step, steps_, shown(loss));
      line_open_ = true;
      if (file_ == stderr) InterruptScope::note_line_open(true);
      if (step == steps_) end_line();
    } else if (!json_ && (step == 1 || step % std::max(1, steps_ / 10) == 0 || step == steps_)) {
      std::fprintf(file_, "step %d/%d loss %.6g\n", step, steps_, shown(loss));
    }
    std::fflush(file_);
  }
  void end_line() {
    if (!line_open_) return;
    std::fputc('\n', file_);
    std::fflush(file_);
    line_open_ = false;
    if (file_ == stderr) InterruptScope::note_line_open(false);
  }

 private:
  int steps_;
  bool json_;
  std::FILE* own_;
  std::FILE* file_;
  bool bar_;
  bool line_open_ = false;
};

// The summary or JSON line to `out`; a warning to `err` when the loss stopped being finite
// (a NaN weight differs from the reference by NaN, which JSON writes as null); then
// check_train_report's error, if any.
void print_report(const TrainOptions& o, const TrainReport& r, std::FILE* out, std::FILE* err) {
  const std::string text = o.json ? train_json_line(o, r) + "\n" : train_summary(o, r);
  write_output(out, text);
  if (const std::optional<size_t> step = first_non_finite_loss(r)) {
    std::fprintf(err,
                 "funcol train: warning: the loss is %g from step %zu on: training diverged "
                 "(lower --lr)\n",
                 shown(r.losses[*step]), *step + 1);
  } else if (non_finite_weights(r)) {
    std::fprintf(err,
                 "funcol train: warning: the last step's update made weights infinite or NaN: "
                 "training diverged (lower --lr)\n");
  }
  check_train_report(r);
}

// This process is one rank of an mpi or gloo job: train; rank 0 reports.
int train_in_job(const TrainOptions& o, Progress& progress, std::FILE* out, std::FILE* err) {
  return run_as_rank(o.backend, o.ranks, o.join, err, [&](ProcessGroup& world) {
    // Ranks started by hand with different flags would pair other collectives (a rank with
    // fewer --steps met the next step's with its report's): the launcher's rank flags, less
    // those that may differ (where progress goes, the failure test's).
    TrainOptions same = o;
    same.progress_fd = -1;
    same.progress_bar = false;
    same.leave_before_step = 0;
    check_same_flags(world, train_rank_args(same), "training flags");
    Shared sh;
    sh.trace_events.resize(static_cast<size_t>(o.ranks));
    StepCallback on_step;
    if (world.rank() == 0) on_step = [&](int step, double loss) { progress.step(step, loss); };
    try {
      run_rank(world, o, on_step, sh);
    } catch (...) {
      progress.end_line();  // run_as_rank prints the error
      throw;
    }
    if (!o.trace.empty()) {
      sh.trace_events = gather_strings(world, sh.trace_events[static_cast<size_t>(world.rank())]);
    }
    if (world.rank() != 0) return;
    print_report(o, make_report(o, sh), out, err);
  });
}

}  // namespace

int train_command(const TrainOptions& o, std::FILE* out, std::FILE* err, bool progress_bar) {
  try {
    if (o.backend != "threads" && inside_job(o.backend, o.join)) {
      std::optional<TraceFile> trace;
      if (!rank_checks_pass(o.backend, o.ranks, o.join, err, [&] {
            validate(o);
            trace.emplace(o.trace);
          })) {
        return 1;
      }
      Progress progress(o, err, progress_bar);
      const int status = train_in_job(o, progress, out, err);
      if (status == 0) trace->keep();
      return status;
    }
    validate(o);
    // A trace that cannot be written fails now, not after training (in the launcher, before a
    // job starts); a failed run removes the file it created.
    TraceFile trace(o.trace);
    if (o.backend != "threads") {
      JobOptions job;
      job.backend = o.backend;
      job.ranks = o.ranks;
      job.temp_prefix = "funcol-train-";
      TrainOptions ranks = o;
      // A gloo launcher shows its ranks' stderr only once the job has ended: rank 0 writes its
      // progress to a copy of `err` instead (not close-on-exec, so the ranks inherit it).
      // mpirun passes the ranks' stderr on as it comes, and no descriptor of ours.
      const int progress_fd = o.backend == "gloo" ? dup(fileno(err)) : -1;
      ranks.progress_fd = progress_fd;
      ranks.progress_bar = progress_bar;
      job.rank_args = [&](const std::string&) { return train_rank_args(ranks); };
      std::fflush(err);
      int status = 1;
      try {
        status = launch_job(job, err);
      } catch (...) {
        if (progress_fd >= 0) close(progress_fd);
        throw;
      }
      if (progress_fd >= 0) close(progress_fd);
      if (status == 0) trace.keep();
      return status;
    }
    {
      // Until the trace is written: a signal after it must not remove it.
      InterruptScope interrupt(InterruptScope::ExitAtOnce{trace.created()});
      Progress progress(o, err, progress_bar);
      print_report(o, run_train(o, [&](int step, double loss) { progress.step(step, loss); }),
                   out, err);
    }
    trace.keep();
    return 0;
  } catch (...) {
    return print_command_error(err);
  }
}

void add_train_command(CLI::App& app) {
  CLI::App* sub = app.add_subcommand(
      "train",
      "train an MLP with fully sharded data parallelism: trace, autodiff, bucketing, overlap, "
      "execute; compare with a single-process reference");
  auto o = std::make_shared<TrainOptions>();
  auto job = std::make_shared<JobFlags>();
  CLI::Option* ranks = add_integer_option(
      *sub, "--ranks", o->ranks, "number of ranks (inside an mpirun or gloo job: its world size)");
  add_integer_option(*sub, "--layers", o->layers, "number of [hidden, hidden] layers");
  add_integer_option(*sub, "--hidden", o->hidden, "width; a multiple of --ranks");
  add_integer_option(*sub, "--batch", o->batch, "rows per rank");
  add_integer_option(*sub, "--steps", o->steps, "training steps");
  sub->add_option("--lr", o->lr, "learning rate")->check(decimal_number())->capture_default_str();
  sub->add_option("--optimizer", o->optimizer, "sgd or adam")->capture_default_str();
  sub->add_option("--bucket-cap-mb", o->bucket_cap_mb,
                  "bucket cap in MB (a list such as 1:25 sets the cap of each bucket)")
      ->capture_default_str();
  sub->add_flag("--no-bucketing", o->no_bucketing,
                "train with the unbucketed graph only (no side-by-side comparison)");
  sub->add_flag(
      "--no-overlap", o->no_overlap,
      "leave the overlap pass out of both variants (each collective waited where traced)");
  sub->add_option("--backend", o->backend,
                  "threads, mpi (relaunches under mpirun) or gloo (spawns processes, or with "
                  "--rank joins a job as one of them)")
      ->capture_default_str();
  add_job_flags(*sub, *job);
  sub->add_option("--trace", o->trace,
                  "write a Chrome/Perfetto trace of every rank's steps (the trained variant)")
      ->check(given("a file name"));
  sub->add_flag("--json", o->json, "print one JSON line of results");
  // Set by the launcher of an mpi or gloo job for its ranks.
  sub->add_option("--progress-fd", o->progress_fd)->group("");
  sub->add_flag("--progress-bar", o->progress_bar)->group("");
  // Tests of the failure path: this rank leaves the job before step N.
  sub->add_option("--leave-before-step", o->leave_before_step)->group("");
  add_seed_option(*sub, o->seed, "seed of the weights, inputs and targets");
  sub->callback([o, job, ranks]() {
    o->join = parse_job_flags(*job);
    o->ranks = resolve_ranks(o->backend, o->join,
                             ranks->count() > 0 ? std::optional<int>(o->ranks) : std::nullopt,
                             /*fallback=*/o->ranks);
    const int rc = train_command(*o, stdout, stderr, isatty(fileno(stderr)) != 0);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace funcol::tools
