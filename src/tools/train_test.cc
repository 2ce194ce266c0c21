// `funcol train` in-process on the threads backend: the loss falls, the weights match the
// single-process reference, bucketing fuses the collectives, and bad options fail clearly.
#include "tools/train.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "funcol/core/error.h"
#include "funcol/graph/printer.h"

namespace funcol::tools {
namespace {

TrainOptions small(int ranks = 2) {
  TrainOptions o;
  o.ranks = ranks;
  o.layers = 3;
  o.hidden = 8;
  o.batch = 4;
  o.steps = 8;
  o.lr = 0.05;
  return o;
}

int64_t count_op(const Graph& g, std::string_view op) {
  int64_t n = 0;
  for (const Node& node : g.nodes()) n += node.op_name() == op;
  return n;
}

TEST(Train, StepGraphsGatherForwardAndReduceScatterBackward) {
  const TrainOptions o = small(4);
  const auto unbucketed = build_step_graph(o, /*bucketed=*/false);
  EXPECT_EQ(count_op(*unbucketed, "all_gather_into_tensor"), 3);
  EXPECT_EQ(count_op(*unbucketed, "reduce_scatter_tensor"), 3);
  ASSERT_EQ(unbucketed->outputs().size(), 4u);  // loss, then one gradient per shard
  EXPECT_EQ(unbucketed->outputs()[0]->type(), Type(DType::F32, {}));
  for (size_t l = 1; l < 4; ++l) {
    EXPECT_EQ(unbucketed->outputs()[l]->type(), Type(DType::F32, {2, 8}));
  }
  const auto bucketed = build_step_graph(o, /*bucketed=*/true);
  EXPECT_EQ(count_op(*bucketed, "all_gather_into_tensor"), 1);
  EXPECT_EQ(count_op(*bucketed, "reduce_scatter_tensor"), 1);
  // Deterministic: every rank builds the same graph.
  EXPECT_EQ(print(*build_step_graph(o, true)), print(*bucketed));
  EXPECT_EQ(step_pipeline(o, true),
            "bucket-all-gather{cap-mb=25},bucket-reduce-scatter{cap-mb=25},overlap,dce");
  EXPECT_EQ(step_pipeline(o, false), "overlap,dce");
}

TEST(Train, SgdLossFallsAndMatchesReference) {
  const TrainOptions o = small();
  int calls = 0;
  const TrainReport r = run_train(o, [&](int step, double loss) {
    ++calls;
    EXPECT_EQ(step, calls);
    EXPECT_TRUE(std::isfinite(loss));
  });
  EXPECT_EQ(calls, o.steps);
  ASSERT_EQ(r.losses.size(), static_cast<size_t>(o.steps));
  EXPECT_LT(r.final_loss, r.initial_loss);
  EXPECT_LT(r.max_abs_diff_vs_reference, 1e-4);
  EXPECT_NEAR(r.final_loss, r.reference_final_loss, 1e-4 * std::max(1.0, r.final_loss));
  EXPECT_EQ(r.unbucketed.collectives_per_step, 6);
  EXPECT_EQ(r.bucketed.collectives_per_step, 2);
  EXPECT_TRUE(r.variants_identical);
  EXPECT_EQ(r.timed_steps, o.steps - 1);
  EXPECT_GT(r.unbucketed.step_ms, 0);
  EXPECT_GT(r.bucketed.step_ms, 0);
}

// An independent check of the math the ranks and the reference share (the optimizer, the loss
// and its scaling): the same training in double precision, written out by hand from the
// definitions. The loss is mse over the global batch (every rank's rows); SGD is
// torch.optim.SGD's default (w -= lr g); Adam is torch.optim.Adam's default (betas 0.9, 0.999,
// eps 1e-8 added to sqrt(v) / sqrt(1 - beta2^t), step lr / (1 - beta1^t)).
struct Dense {  // a row-major matrix of doubles
  int64_t rows = 0, cols = 0;
  std::vector<double> a;
  double& at(int64_t i, int64_t j) { return a[static_cast<size_t>(i * cols + j)]; }
  double at(int64_t i, int64_t j) const { return a[static_cast<size_t>(i * cols + j)]; }
};
Dense dense(const Tensor& t) {
  const std::vector<float> v = t.to_vector<float>();
  return Dense{t.sizes()[0], t.sizes()[1], std::vector<double>(v.begin(), v.end())};
}
Dense product(const Dense& x, const Dense& y, bool transpose_x, bool transpose_y) {
  const int64_t n = transpose_x ? x.cols : x.rows, k = transpose_x ? x.rows : x.cols;
  const int64_t m = transpose_y ? y.rows : y.cols;
  Dense z{n, m, std::vector<double>(static_cast<size_t>(n * m), 0.0)};
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      for (int64_t p = 0; p < k; ++p) {
        const double xv = transpose_x ? x.at(p, i) : x.at(i, p);
        z.at(i, j) += xv * (transpose_y ? y.at(j, p) : y.at(p, j));
      }
    }
  }
  return z;
}

// Trains by hand; returns the losses (before each update) and the final weights.
std::pair<std::vector<double>, std::vector<Dense>> train_by_hand(const TrainOptions& o) {
  std::vector<Dense> w, m, v;
  for (int l = 0; l < o.layers; ++l) {
    w.push_back(dense(initial_weight(o, l)));
    m.push_back(Dense{o.hidden, o.hidden, std::vector<double>(w.back().a.size(), 0.0)});
    v.push_back(m.back());
  }
  std::vector<Dense> xs, ts;
  for (int r = 0; r < o.ranks; ++r) {
    const Tensor x = train_inputs(o, r);
    xs.push_back(dense(x));
    ts.push_back(dense(train_targets(o, x)));
  }
  const double global_numel = static_cast<double>(o.ranks) * o.batch * o.hidden;
  std::vector<double> losses;
  for (int step = 1; step <= o.steps; ++step) {
    std::vector<Dense> grads;
    for (int l = 0; l < o.layers; ++l) {
      grads.push_back(Dense{o.hidden, o.hidden, std::vector<double>(w[0].a.size(), 0.0)});
    }
    double loss = 0;
    for (int r = 0; r < o.ranks; ++r) {
      std::vector<Dense> h = {xs[static_cast<size_t>(r)]}, pre;
      for (int l = 0; l < o.layers; ++l) {
        pre.push_back(product(h.back(), w[static_cast<size_t>(l)], false, false));
        Dense next = pre.back();
        if (l + 1 < o.layers) {
          for (double& e : next.a) e = std::max(e, 0.0);
        }
        h.push_back(next);
      }
      Dense d = h.back();  // d loss / d output
      for (size_t i = 0; i < d.a.size(); ++i) {
        const double diff = d.a[i] - ts[static_cast<size_t>(r)].a[i];
        loss += diff * diff / global_numel;
        d.a[i] = 2 * diff / global_numel;
      }
      for (int l = o.layers - 1; l >= 0; --l) {
        const auto li = static_cast<size_t>(l);
        if (l + 1 < o.layers) {
          for (size_t i = 0; i < d.a.size(); ++i) d.a[i] = pre[li].a[i] > 0 ? d.a[i] : 0.0;
        }
        const Dense g = product(h[li], d, true, false);
        for (size_t i = 0; i < g.a.size(); ++i) grads[li].a[i] += g.a[i];
        d = product(d, w[li], false, true);
      }
    }
    losses.push_back(loss);
    const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.999, step);
    for (size_t l = 0; l < w.size(); ++l) {
      for (size_t i = 0; i < w[l].a.size(); ++i) {
        const double g = grads[l].a[i];
        if (o.optimizer == "sgd") {
          w[l].a[i] -= o.lr * g;
          continue;
        }
        m[l].a[i] = 0.9 * m[l].a[i] + 0.1 * g;
        v[l].a[i] = 0.999 * v[l].a[i] + 0.001 * g * g;
        w[l].a[i] -= o.lr / bc1 * m[l].a[i] / (std::sqrt(v[l].a[i]) / std::sqrt(bc2) + 1e-8);
      }
    }
  }
  return {losses, w};
}

TEST(Train, SgdAndAdamMatchTheirDefinitionsWorkedOutByHand) {
  for (const char* optimizer : {"sgd", "adam"}) {
    TrainOptions o = small(2);
    o.optimizer = optimizer;
    o.steps = 3;
    o.lr = o.optimizer == "sgd" ? 0.5 : 0.01;  // large enough that a wrong scale shows
    // Each rank trains on its own rows; the hand computation (and the reference) on them all.
    EXPECT_FALSE(train_inputs(o, 0).equal(train_inputs(o, 1)));
    const TrainReport r = run_train(o);
    const auto [losses, weights] = train_by_hand(o);
    ASSERT_EQ(r.losses.size(), losses.size());
    for (size_t s = 0; s < losses.size(); ++s) {
      EXPECT_NEAR(r.losses[s], losses[s], 1e-5 * losses[s]) << optimizer << " step " << s + 1;
    }
    ASSERT_EQ(r.final_weights.size(), weights.size());
    double max_diff = 0, max_change = 0;
    for (size_t l = 0; l < weights.size(); ++l) {
      const Dense got = dense(r.final_weights[l]);
      const Dense initial = dense(initial_weight(o, static_cast<int>(l)));
      for (size_t i = 0; i < got.a.size(); ++i) {
        max_diff = std::max(max_diff, std::fabs(got.a[i] - weights[l].a[i]));
        max_change = std::max(max_change, std::fabs(weights[l].a[i] - initial.a[i]));
      }
    }
    EXPECT_LT(max_diff, 1e-5) << optimizer;
    EXPECT_GT(max_change, 1e-3) << optimizer;  // the training moved the weights
  }
}

TEST(Train, AdamOnFourRanksMatchesReference) {
  TrainOptions o = small(4);
  o.optimizer = "adam";
  o.lr = 0.01;
  const TrainReport r = run_train(o);
  EXPECT_LT(r.final_loss, r.initial_loss);
  EXPECT_LT(r.max_abs_diff_vs_reference, 1e-4);
  EXPECT_TRUE(r.variants_identical);
}

TEST(Train, NoBucketingRunsOneVariantAndJsonSaysSo) {
  TrainOptions o = small();
  o.no_bucketing = true;
  o.steps = 3;
  const TrainReport r = run_train(o);
  EXPECT_FALSE(r.bucketed.ran);
  EXPECT_LT(r.max_abs_diff_vs_reference, 1e-4);
  const nlohmann::json j = nlohmann::json::parse(train_json_line(o, r));
  EXPECT_EQ(j["collectives_per_step"]["unbucketed"], 6);
  // The bucketed variant did not run: all its fields are null, its collective count too.
  for (const char* key : {"collectives_per_step", "step_ms", "time_split", "compute_ms_by_op"}) {
    EXPECT_TRUE(j[key]["bucketed"].is_null()) << key;
    EXPECT_FALSE(j[key]["unbucketed"].is_null()) << key;
  }
  EXPECT_TRUE(j["bucketed_over_unbucketed"].is_null());
  EXPECT_TRUE(j["variants_identical"].is_null());  // nothing was compared
  EXPECT_EQ(j["config"]["no_bucketing"], true);
  EXPECT_EQ(j["config"]["no_overlap"], o.no_overlap);
  EXPECT_EQ(j["config"]["seed"], o.seed);
}

// Runs the command and returns (status, stdout, stderr).
struct CommandResult {
  int status;
  std::string out, err;
};
CommandResult command(const TrainOptions& o) {
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  const int status = train_command(o, out, err, /*progress_bar=*/false);
  auto slurp = [](std::FILE* f) {
    std::string s;
    std::rewind(f);
    char buf[4096];
    size_t k;
    while ((k = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, k);
    std::fclose(f);
    return s;
  };
  CommandResult r{status, slurp(out), ""};
  r.err = slurp(err);
  return r;
}

TEST(Train, CommandPrintsJsonLineAndSummary) {
  TrainOptions o = small();
  o.steps = 4;
  o.json = true;
  CommandResult r = command(o);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");  // no progress lines with --json when stderr is not a terminal
  ASSERT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  for (const char* key : {"initial_loss", "final_loss", "max_abs_diff_vs_reference"}) {
    EXPECT_TRUE(j[key].is_number()) << key;
  }
  EXPECT_EQ(j["collectives_per_step"]["bucketed"], 2);
  EXPECT_TRUE(j["step_ms"]["unbucketed"].is_number());
  EXPECT_TRUE(j["step_ms"]["bucketed"].is_number());

  o.json = false;
  r = command(o);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("collectives per step 6 unbucketed -> 2 bucketed"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("where the time went"), std::string::npos);
  EXPECT_NE(r.err.find("step 1/4 loss "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("step 4/4 loss "), std::string::npos) << r.err;
}


// A learning rate that blows the weights up: the reference check must not report a match
// (a NaN weight used to count as a difference of 0), and the command says what happened.
TEST(Train, DivergedTrainingIsReportedNotMatched) {
  TrainOptions o = small();
  o.steps = 4;
  o.lr = 1e30;  // finite in f32, where the optimizers step
  const TrainReport r = run_train(o);
  EXPECT_TRUE(std::isfinite(r.initial_loss));
  EXPECT_FALSE(std::isfinite(r.final_loss));
  EXPECT_TRUE(std::isnan(r.max_abs_diff_vs_reference)) << r.max_abs_diff_vs_reference;
  o.json = true;
  const CommandResult c = command(o);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_TRUE(nlohmann::json::parse(c.out)["max_abs_diff_vs_reference"].is_null()) << c.out;
  EXPECT_NE(c.err.find("funcol train: warning: the loss is "), std::string::npos) << c.err;
  EXPECT_NE(c.err.find("training diverged (lower --lr)"), std::string::npos) << c.err;
  EXPECT_EQ(c.err.find("-nan"), std::string::npos) << c.err;
  // The summary says "nan", as PyTorch prints it, whatever the NaN's sign bit ("-nan" before).
  const std::string text = train_summary(o, r);
  if (std::isnan(r.final_loss)) {
    EXPECT_NE(text.find(" -> nan (step 1 -> 4)"), std::string::npos) << text;
  }
  EXPECT_EQ(text.find("-nan"), std::string::npos) << text;
}
// The command fails (exit 1, after its summary) when its result fails its checks: a report
// that differs from the reference or between its variants is an error naming what differed.
TEST(Train, ResultsThatFailTheirChecksAreErrors) {
  TrainReport good;
  good.losses = {2.0, 1.5};
  good.bucketed.ran = true;
  EXPECT_NO_THROW(check_train_report(good));
  auto expect_error = [](const TrainReport& r, const std::string& naming) {
    try {
      check_train_report(r);
      ADD_FAILURE() << "no error; expected one naming: " << naming;
    } catch (const InternalError& e) {
      EXPECT_NE(std::string(e.what()).find(naming), std::string::npos) << e.what();
    }
  };
  TrainReport off = good;
  off.max_abs_diff_vs_reference = 8.08e-4;
  expect_error(off, "the trained weights differ from the single-process reference by up to "
                    "0.000808");
  off.max_abs_diff_vs_reference = std::numeric_limits<double>::quiet_NaN();
  expect_error(off, "by up to nan");
  TrainReport split = good;
  split.variants_identical = false;
  expect_error(split, "the bucketed and unbucketed steps gave different results");
  split.bucketed.ran = false;  // --no-bucketing: nothing was compared
  EXPECT_NO_THROW(check_train_report(split));
  // Diverged: NaN weights on both sides are not compared (the command warns instead).
  TrainReport diverged = good;
  diverged.losses.push_back(std::numeric_limits<double>::infinity());
  diverged.max_abs_diff_vs_reference = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NO_THROW(check_train_report(diverged));
  // Diverged in the last update only: every loss finite, a weight NaN.
  TrainReport last = good;
  last.final_weights = {Tensor::from_vector<float>({1.0f, std::nanf("")})};
  last.max_abs_diff_vs_reference = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NO_THROW(check_train_report(last));
}

// The reviewer's run that diverges in its last update: a warning, exit 0 (it was "a funcol
// bug", exit 1).
TEST(Train, DivergingInTheLastUpdateIsAWarning) {
  TrainOptions o = small(2);
  o.layers = 8;
  o.hidden = 8;
  o.steps = 2;
  o.batch = 16;
  o.lr = 1e6;
  o.optimizer = "adam";
  const TrainReport r = run_train(o);
  for (double loss : r.losses) EXPECT_TRUE(std::isfinite(loss)) << loss;
  EXPECT_TRUE(std::isnan(r.max_abs_diff_vs_reference)) << r.max_abs_diff_vs_reference;
  o.json = true;
  const CommandResult c = command(o);
  EXPECT_EQ(c.status, 0) << c.err;
  EXPECT_NE(c.err.find("training diverged (lower --lr)"), std::string::npos) << c.err;
  EXPECT_EQ(c.err.find("funcol: error"), std::string::npos) << c.err;
}

// A model too large for memory is an error naming the flags, before anything is allocated:
// the activations (--batch rows on every rank, kept for the backward) count, not only the
// weights. (--batch 100000000 used to pass and then fail as "out of memory", or be killed.)
TEST(Train, ModelsThatDoNotFitInMemoryAreRejectedUpFront) {
  auto expect_rejected = [](const TrainOptions& o, const std::string& naming) {
    try {
      validate(o);
      ADD_FAILURE() << naming << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(naming), std::string::npos) << e.what();
    }
  };
  TrainOptions o = small();
  o.batch = 100000000;
  expect_rejected(o, "--batch 100000000");
  o = small();
  o.layers = 1;
  o.hidden = 65536;
  o.ranks = 2;
  EXPECT_THROW(validate(o), InvalidArgument);
  // Measured at a peak of 10.45 GB with Adam (batch 16): estimated at 7.6 GB (under the 8 GB limit)
  // before the estimate was fitted to measured runs.
  o = small();
  o.layers = 4;
  o.hidden = 8192;
  o.ranks = 2;
  o.optimizer = "adam";
  expect_rejected(o, "--layers 4 x --hidden 8192 x --batch 4 on --ranks 2 needs about 12 GB");
  // Tiny layers, but a million of them: every rank's step graphs (tens of nodes per layer,
  // two variants) alone take tens of GB.
  o = small();
  o.layers = 1000000;
  o.hidden = 4;
  o.batch = 1;
  expect_rejected(o, "--layers 1000000");
  EXPECT_NO_THROW(validate(small()));
}

TEST(Train, BadOptionsFailWithClearMessages) {
  struct Case {
    void (*edit)(TrainOptions&);
    const char* message;
  };
  const Case cases[] = {
      {[](TrainOptions& o) { o.optimizer = "rmsprop"; },
       "unknown optimizer 'rmsprop' for --optimizer: expected sgd or adam"},
      {[](TrainOptions& o) {
         o.hidden = 10;
         o.ranks = 4;
       },
       "--hidden 10 is not divisible by --ranks 4"},
      {[](TrainOptions& o) { o.lr = 0; }, "--lr must be a positive number, got 0"},
      {[](TrainOptions& o) { o.lr = 1e-46; },
       "--lr 1e-46 is zero in f32, in which the optimizers step (it must lie within 1.4013e-45 "
       "to 3.40282e+38)"},
      {[](TrainOptions& o) { o.lr = 1e39; }, "--lr 1e+39 is infinite in f32"},
      {[](TrainOptions& o) { o.steps = 0; }, "--steps must be at least 1, got 0"},
      {[](TrainOptions& o) { o.ranks = 0; }, "--ranks must be at least 1, got 0"},
      {[](TrainOptions& o) { o.bucket_cap_mb = "x"; }, "--bucket-cap-mb: cap-mb: 'x'"},
      {[](TrainOptions& o) { o.backend = "nccl"; }, "unknown backend 'nccl' for --backend"},
  };
  for (const Case& c : cases) {
    TrainOptions o = small();
    c.edit(o);
    EXPECT_THROW(validate(o), InvalidArgument) << c.message;
    const CommandResult r = command(o);
    EXPECT_EQ(r.status, 1) << c.message;
    EXPECT_EQ(r.out, "");
    EXPECT_EQ(r.err.rfind("funcol: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(c.message), std::string::npos) << r.err;
  }
  // Process backends run as jobs through train_command, never inside this process.
  TrainOptions o = small();
  o.backend = "gloo";
  EXPECT_THROW(run_train(o), InvalidArgument);
}

}  // namespace
}  // namespace funcol::tools
