// OpSignature: what a rank issued at one sequence number, compared across ranks in detail mode.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dist/checks.h"
#include "funcol/core/dtype.h"

namespace funcol::process {

// The kinds of collective a process backend runs; the order is the wire encoding.
enum class OpKind : uint8_t {
  AllReduce,
  AllGather,
  ReduceScatter,
  AllToAll,
  Broadcast,
  Barrier,
  AllReduceCoalesced,
  AllGatherCoalesced,
  ReduceScatterCoalesced,
  // A signature only: all_reduce_flat runs as one all_reduce of the packed inputs, and its
  // signature lists the inputs, so that detail mode tells apart ranks whose inputs differ but
  // add up to the same total (their elements would be reduced with the wrong peers').
  AllReduceFlat,
};

// "all_reduce", "all_gather_coalesced", ...
std::string_view op_kind_name(OpKind kind);
bool reduces(OpKind kind);

// One rank's view of one collective, compared as the threads backend compares its posts: the
// op, the reduce op (reductions), the root (broadcast), and per tensor its dtype, shape and
// per-rank element count (all_reduce/broadcast numel, all_gather input numel, reduce_scatter output
// numel, all_to_all elements per row); all_to_all also sends its split sizes, checked pairwise.
// With FUNCOL_DEBUG=detail every rank gathers every rank's signature before the collective
// runs, and all of them fail with the same CommError when they disagree (PyTorch's
// TORCH_DISTRIBUTED_DEBUG=DETAIL check).
struct OpSignature {
  struct Slot {
    DType dtype = DType::F32;
    int64_t count = 0;
    // The input's shape (dist_detail::pack_shape); ndim -1 where only the count is compared
    // (all_to_all rows, all_reduce_flat inputs).
    int ndim = -1;
    dist_detail::ShapeWords dims{};
  };
  OpKind kind = OpKind::Barrier;
  ReduceOp reduce_op = ReduceOp::Sum;
  int root = 0;
  std::vector<Slot> slots;
  std::vector<int64_t> input_splits;   // all_to_all: rows sent to each group rank
  std::vector<int64_t> output_splits;  // all_to_all: rows expected from each group rank
  // The label of dist_detail::internal_step() of the issuing thread ("" for a user's own),
  // compared and printed as the threads backend does.
  std::string step;

  // "all_reduce(f32 numel 16, op sum)", as the threads backend writes it.
  std::string summary() const;
  bool same_call(const OpSignature& other) const;
};

// Bytes of one encoded signature in a group of `group_size` ranks; equal on every rank so the
// signatures travel in one allgather.
size_t signature_bytes(int group_size);
// Fixed-size encoding: the first 8 tensors in full, the rest as a hash (compared, not printed).
std::vector<char> encode_signature(const OpSignature& sig, int group_size);
OpSignature decode_signature(const char* bytes, int group_size);
// `sig` as a peer decodes it (encoded, then decoded): a signature compares equal (same_call)
// only with one that made the same trip, as tensors past the first 8 travel as a hash.
OpSignature as_received(const OpSignature& sig, int group_size);

// Compares the signatures every group rank issued (index = group rank; ranks named by
// global_ranks). Returns nullopt when they agree, else the same message on every rank:
// "<description>: mismatched collectives: rank 0 issued X but rank 1 issued Y".
std::optional<std::string> check_signatures(const std::vector<OpSignature>& signatures,
                                            const std::vector<int>& global_ranks,
                                            const std::string& description);

// A signature some rank of a group issued: its group rank and what it issued.
struct RankSignature {
  int group_rank = 0;
  const OpSignature* signature = nullptr;
};

// How the signatures of `known` (some or all of a group's ranks, in group-rank order; ranks
// named by global_ranks) disagree, as check_signatures finds it: the calls differ, or, for
// all_to_all, a rank sends another a number of rows that one does not expect. A timeout
// compares what the ranks that answered issued (without FUNCOL_DEBUG=detail nothing else
// does).
struct SignatureDifference {
  bool splits = false;  // false: the calls differ; true: only all_to_all split sizes disagree
  // "rank 0 issued X but rank 1 issued Y" (calls), or dist_detail::split_mismatch's
  // "mismatched split sizes: rank 0 sends 3 rows to rank 1 but rank 1 expects 2 rows from
  // rank 0" (splits).
  std::string what;
};
std::optional<SignatureDifference> find_difference(const std::vector<RankSignature>& known,
                                                   const std::vector<int>& global_ranks);
// find_difference of what a timed-out collective's ranks issued: `mine`, this rank's (group
// rank `me`), and `answers`, the peers' (encode_signature bytes, one per other group rank in
// order; "" where a peer did not say, and one of another size is ignored).
std::optional<SignatureDifference> compare_answers(const OpSignature& mine, int me,
                                                   const std::vector<std::string>& answers,
                                                   const std::vector<int>& global_ranks);

}  // namespace funcol::process
