// The one list of every pass: add a pass here with one line, keeping the list sorted by name.
#include "funcol/passes/bucketing.h"
#include "funcol/passes/dce.h"
#include "funcol/passes/pass.h"

namespace funcol {

void register_all_passes(PassRegistry& registry) {
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
}

}  // namespace funcol
