// Bucketing: fuses runs of small collectives of one kind into one collective per bucket
// (DESIGN §6; the seed's greedy_bucket_collective_by_mb, XLA's CombineInstructionsByKey).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/graph/graph.h"
#include "funcol/passes/pass.h"

namespace funcol {

// How a bucket is packed (the seed's BucketMode).
//   default                plain ops: flatten, cat, view, split_with_sizes, reshape
//   custom_ops             one packing op: all_gather_into_tensor_packed writes every input
//                          straight into this rank's slot of the gathered buffer; bucket_pack
//                          builds the reduce-scatter / all-reduce buffer in one kernel
//   multidtype             all-gather only: members of different dtypes share a bucket, packed
//                          as bytes in the smallest itemsize and viewed back per member
//   custom_ops_multidtype  both
enum class BucketMode : uint8_t { Default, CustomOps, MultiDtype, CustomOpsMultiDtype };

// "default", "custom_ops", "multidtype", "custom_ops_multidtype".
std::string_view bucket_mode_name(BucketMode mode);
// Throws InvalidArgument "unknown bucket mode 'x' (expected default, custom_ops, multidtype or
// custom_ops_multidtype)".
BucketMode parse_bucket_mode(std::string_view text);
inline bool is_custom_ops(BucketMode m) {
  return m == BucketMode::CustomOps || m == BucketMode::CustomOpsMultiDtype;
}
inline bool is_multidtype(BucketMode m) {
  return m == BucketMode::MultiDtype || m == BucketMode::CustomOpsMultiDtype;
}

// The seed's bucket_cap_mb_by_bucket_idx_default: 2000 MB for every bucket.
inline constexpr double kDefaultBucketCapMb = 2000.0;
// One MB of a cap, as the seed converts it: int(MB * 1024 * 1024) bytes.
inline constexpr double kBytesPerMb = 1024.0 * 1024.0;
// A positive number of MB as the passes count bytes (bucket caps, overlap's memory budget):
// int(MB * 1024 * 1024), but at least one byte (a positive size under a byte still admits
// one) and at most `max` (beyond it the size saturates).
inline int64_t mb_to_bytes(double mb, int64_t max) {
  const double bytes = std::floor(mb * kBytesPerMb);
  if (bytes >= static_cast<double>(max)) return max;
  return std::max<int64_t>(1, static_cast<int64_t>(bytes));
}

// The default budget of a run's later tries (BucketOptions::retry_work): 2^18 region nodes and
// members. Tries that each take a whole region cost about 0.7 us a node on the 2-vCPU hosts
// here, so the budget is about 0.2 s, a fifth of the 100,000-collective target (issue 4), and
// far more than the tries of real graphs (FSDP's buckets drop nothing).
inline constexpr int64_t kDefaultRetryWork = int64_t{1} << 18;
// The default of BucketOptions::max_rounds (see bucket_collectives): no generated graph has
// needed more than four.
inline constexpr int kMaxBucketingRounds = 8;

struct BucketOptions {
  // AllGather (all_gather_into_tensor), ReduceScatter (reduce_scatter_tensor) or AllReduce
  // (all_reduce); the coalesced forms are never bucketed.
  CollectiveKind kind = CollectiveKind::AllGather;
  // Cap of bucket i in MB: cap_mb[i], the last entry repeating. Not empty; entries > 0.
  std::vector<double> cap_mb{kDefaultBucketCapMb};
  BucketMode mode = BucketMode::Default;
  // The budget of a run's later tries of dropped members (see bucket_collectives): the region
  // nodes and members they may visit, the same on every rank. Not a pass option: the default
  // bounds the pass's time and is far above what real graphs use; tests set it small.
  int64_t retry_work = kDefaultRetryWork;
  // The most rounds (walks) bucket_collectives runs; at least 1. Not a pass option either.
  int max_rounds = kMaxBucketingRounds;
};

// "1:25" → {1, 25}; "2000" → {2000}. Throws InvalidArgument "cap-mb: 'x' is not a positive
// number" for an empty entry, a non-number, zero, a negative, an infinite or a NaN value, and
// "cap-mb: 'x' is out of range" for a number a double cannot hold (1e400, 1e-400).
std::vector<double> parse_cap_mb(std::string_view text);
// "1:25", each entry in the shortest form that reads back exactly.
std::string format_cap_mb(const std::vector<double>& cap_mb);
// Cap of bucket `index` in bytes: int(cap_mb[min(index, size - 1)] * 1024 * 1024), at least 1
// and at most kMaxTypeBytes (a bucket's buffer is a value).
int64_t bucket_cap_bytes(const BucketOptions& options, int64_t index);
// Throws InvalidArgument for a kind that is not bucketed, an empty or non-positive cap list,
// a multidtype mode outside all-gather ("reduce scatter bucketing does not support
// multidtype", "all reduce bucketing does not support multidtype"), a negative retry_work or
// max_rounds below 1.
void check_bucket_options(const BucketOptions& options);

// The pass names (contract): bucket-all-gather, bucket-reduce-scatter, bucket-all-reduce.
std::string_view bucket_pass_name(CollectiveKind kind);

// What one run of the routine did.
struct BucketingStats {
  int64_t collectives = 0;  // collectives of the pass's op, waited or not
  int64_t buckets = 0;      // buckets closed, buckets of one included (the final bucket index)
  int64_t merged_buckets = 0;
  int64_t merged_collectives = 0;  // members of merged buckets
  int64_t skipped_dependent = 0;
  int64_t skipped_ineligible = 0;
  int64_t dropped = 0;          // members dropped because merging would reorder others
  int64_t region_reorders = 0;  // buckets placed by reordering their region
  // The figures above are the first round's. A round that merged and dropped members on a
  // first try is followed by another (see bucket_collectives).
  int64_t rounds = 1;
  int64_t later_merged_buckets = 0;  // buckets the rounds after the first merged
  bool changed() const { return merged_buckets > 0; }
};

// The shared routine of the three bucketing passes. Walks the wait_tensor nodes of `graph` in
// order; each whose input is the pass's collective contributes it. Runs of equal key (group,
// group_size, dtype, reduce_op as the kind has them; multidtype all-gather leaves out the
// dtype) are split greedily into buckets under the cap; a collective with another user than
// its wait is ineligible (left alone, though its key still ends a run of another key) and one
// that depends on the current bucket is skipped, neither closing the bucket. Every bucket of
// two or more becomes one collective over a packed buffer with unpacking that gives every
// consumer exactly the value it had; a single-user convert_element_type feeding an all-gather
// is folded into the packing. New nodes go where every input is defined and before every
// consumer; when no such place exists, the nodes from the first consumer of a member's wait to
// the latest member input (a span within the members' region) are reordered (stably, keeping
// the issue order of the collectives not merged). When the members have no such order
// together, the bucket is split into the fewest groups that each have one (each member's
// placements are a range between two unmerged collectives), the largest merges, then each
// other group on its own, and the members left are bucketed again on their own, until no two
// of them merge (after four more tries, only while the pass's later tries have visited fewer
// than `retry_work` region nodes and members, which bounds its time; members left then are
// dropped, as are members of groups of one).
//
// Merging a later bucket can move the collective that kept a member out of an earlier bucket.
// So after a round (one walk as above) that merged and dropped members on a first try, the
// walk runs again on its result, until a round merges nothing (at most options.max_rounds
// rounds; the rounds share the tries' budget, and members it left untried end them). In a
// later round the earlier rounds' buckets are collectives like any other; a bucket that takes
// one packs what its pack packed, and an all-gather bucket gives the earlier bucket's [G, n]
// view its block instead, so no byte is packed or unpacked twice.
//
// Decisions depend only on the graph and `options`; the result verifies, and running the
// routine again on it merges nothing more, unless the tries' budget left members untried (the
// explanation says so; a second run has a budget of its own) or the rounds stopped at
// max_rounds (likewise). Near-linear time and memory. When `explain` is given, appends a
// human-readable account: every round, every bucket with its members, bytes and why it closed,
// every skipped collective and why. Throws what check_bucket_options throws.
BucketingStats bucket_collectives(Graph& graph, const BucketOptions& options,
                                  std::string* explain = nullptr);

// One bucketing pass (name() is bucket_pass_name(kind)). With set_explain, run() writes the
// routine's account to the explain stream. The constructor throws what check_bucket_options
// throws, so a bad pipeline fails before any pass runs.
class BucketPass : public Pass {
 public:
  explicit BucketPass(BucketOptions options);
  std::string name() const override;
  bool run(Graph& graph) override;
  const BucketOptions& options() const { return options_; }

 private:
  BucketOptions options_;
};

// The pass of `kind` from pipeline options `cap-mb` (default 2000) and `mode` (default
// default); throws InvalidArgument for a bad value, its message prefixed by "pass NAME: ".
std::unique_ptr<Pass> make_bucket_pass(CollectiveKind kind, const PassOptions& options);

}  // namespace funcol
