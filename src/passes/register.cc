// The one list of every pass: add a pass here with one line, keeping the list sorted by name.
#include "funcol/passes/autodiff.h"
#include "funcol/passes/bucketing.h"
#include "funcol/passes/dce.h"
#include "funcol/passes/overlap.h"
#include "funcol/passes/pass.h"

namespace funcol {

void register_all_passes(PassRegistry& registry) {
  registry.add({"autodiff",
                "replace the graph by its joint graph: [loss, d loss / d inputs] (wrt=0:2)",
                {"wrt"}, make_autodiff_pass});
  registry.add({"bucket-all-gather", "merge runs of all_gather_into_tensor into buckets",
                {"cap-mb", "mode"}, [](const PassOptions& o) {
                  return make_bucket_pass(CollectiveKind::AllGather, o);
                }});
  registry.add({"bucket-all-reduce", "merge runs of all_reduce into buckets", {"cap-mb", "mode"},
                [](const PassOptions& o) { return make_bucket_pass(CollectiveKind::AllReduce, o); }});
  registry.add({"bucket-reduce-scatter", "merge runs of reduce_scatter_tensor into buckets",
                {"cap-mb", "mode"}, [](const PassOptions& o) {
                  return make_bucket_pass(CollectiveKind::ReduceScatter, o);
                }});
  registry.add({"dce", "erase nodes whose results are unused (never collectives or waits)", {},
                [](const PassOptions&) { return std::make_unique<DcePass>(); }});
  registry.add({"overlap", "issue collectives as early and wait as late as dependencies allow",
                {"memory-budget-mb"}, make_overlap_pass});
}

}  // namespace funcol
