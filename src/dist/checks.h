// Synchronous argument checks shared by every backend's ProcessGroup primitives.
#pragma once

#include <array>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"

namespace funcol {
class ProcessGroup;
class Work;
}

namespace funcol::dist_detail {

// A defined, non-meta, contiguous tensor; InvalidArgument naming `op` and `what` otherwise.
void check_buffer(std::string_view op, const Tensor& t, std::string_view what);
// InvalidArgument unless both dtypes are equal.
void check_same_dtype(std::string_view op, const Tensor& a, std::string_view a_name,
                      const Tensor& b, std::string_view b_name);
// Bitwise ops need integer or bool; avg is rejected on bool (as PyTorch's NCCL backend does:
// "cannot use avg with boolean inputs"); integer avg truncates toward zero.
void check_reduce(std::string_view op, ReduceOp reduce_op, DType dtype);

void check_all_reduce(const Tensor& tensor, ReduceOp reduce_op);
// output.numel() == group_size * input.numel(), equal dtypes.
void check_all_gather(const Tensor& output, const Tensor& input, int group_size);
// input.numel() == group_size * output.numel(), equal dtypes.
void check_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp reduce_op,
                          int group_size);
void check_broadcast(const Tensor& tensor, int src, int group_size);

// The all_to_all layout in rows of dim 0 (a row holds numel / dim0 elements).
struct AllToAllLayout {
  std::vector<int64_t> output_splits;  // rows from each rank
  std::vector<int64_t> input_splits;   // rows to each rank
  int64_t row_elems = 0;               // elements per row (product of dims 1..)
};
// Checks the tensors and splits and fills in an even split when both lists are empty.
AllToAllLayout check_all_to_all(const Tensor& output, const Tensor& input,
                                const std::vector<int64_t>& output_splits,
                                const std::vector<int64_t>& input_splits, int group_size);

// FNV-1a over 64-bit words, byte by byte (collective signatures and long shapes, compared
// across ranks: the same on every machine).
class Fnv1a {
 public:
  void mix(int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h_ ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
      h_ *= 1099511628211ull;
    }
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 1469598103934665603ull;
};

// A tensor's shape as the ranks of a collective compare it (torch.distributed's DETAIL mode
// compares whole shapes), in a fixed size that fits a slot or a fixed-size signature: up to
// kShapeWords dims as they are; a longer shape as its first kShapeWords - 1 dims and, last, a
// hash of all of them with their count.
constexpr int kShapeWords = 6;
using ShapeWords = std::array<int64_t, kShapeWords>;
// Fills `words`; returns the dim count (at most 127: longer shapes differ in their hash).
int8_t pack_shape(std::span<const int64_t> sizes, ShapeWords& words);
// Whether two packed shapes are equal; a negative ndim (no shape recorded) matches any.
bool same_packed_shape(int ndim_a, const ShapeWords& a, int ndim_b, const ShapeWords& b);
// The shape ranks compare for a tensor of a collective: all of it, or for an all_to_all, whose
// ranks may send and receive different numbers of rows, the shape of a row (sizes after dim
// 0), so that rows of [3,2] against rows of [2,3] fail while the row counts may differ.
int8_t pack_compared_shape(std::span<const int64_t> sizes, bool rows, ShapeWords& words);
// A pack_compared_shape as messages show it: "f32[2,3]", longer shapes "f32[2,3,4,5,6,...: 9
// dims, #1a2b3c4d]"; `rows` (an all_to_all's) with "*" rows: "f32[*,3,2]".
std::string describe_compared_shape(DType dtype, int ndim, const ShapeWords& words, bool rows);

// "mismatched split sizes: rank 0 sends 3 rows to rank 1 but rank 1 expects 1 row from rank 0",
// for an all_to_all whose ranks disagree on the rows between `from` and `to` (global ranks; the
// same rank when one disagrees with itself), on every backend.
std::string split_mismatch(int from, int64_t sent, int to, int64_t expected);

// A rank that issues a collective with a tensor holding the failed result of an earlier one
// still takes the collective's place in the group's sequence (else its next collective would
// pair with its peers' current one), and the collective fails for every member with
// failed_buffer_message(what, rank, why), why = failed_buffer_reason(role, error): its `role`
// ("input", "output" or, in place, "tensor") rethrew `error` when waited for; an
// AbandonedError (a value the rank gave up computing) gives its own message as the reason.
std::string failed_buffer_reason(std::string_view role, const std::exception& error);
// Runs `wait` (a wait for the collectives still producing or reading a tensor in `role`). When
// it throws, `failed` gets failed_buffer_reason(role, error) unless it already says why (the
// first failed tensor names the cause).
template <typename Wait>
void wait_or_note_failed(std::string_view role, std::string& failed, Wait&& wait) {
  try {
    wait();
  } catch (const std::exception& e) {
    if (failed.empty()) failed = failed_buffer_reason(role, e);
  }
}
// "<what>: rank R could not take part: <why>".
std::string failed_buffer_message(const std::string& what, int rank, const std::string& why);

// all_reduce_flat: a one-dimensional contiguous output of the inputs' dtype and their total
// element count, contiguous inputs, none of them sharing bytes with the output.
void check_all_reduce_flat(const Tensor& output, const std::vector<Tensor>* inputs,
                           ReduceOp reduce_op);
// all_gather_flat: the same, with group.size() times the inputs' elements in the output.
void check_all_gather_flat(const ProcessGroup& group, const Tensor& output,
                           const std::vector<Tensor>* inputs);
// reduce_scatter_flat: the same, with 1/group.size() of the inputs' elements in the output, and
// every input's element count a multiple of group.size().
void check_reduce_scatter_flat(const ProcessGroup& group, const Tensor& output,
                               const std::vector<Tensor>* inputs, ReduceOp reduce_op);
// Copies checked all_reduce_flat inputs back to back into the output (after whatever still
// reads or writes it), for a backend that then reduces the output in place.
void pack_flat(const Tensor& output, const std::vector<Tensor>& inputs);

// Coalesced forms: equal list lengths, each pair checked as the single-tensor form.
void check_coalesced_lists(std::string_view op, size_t outputs, size_t inputs);
// all_reduce_coalesced (in place): each tensor checked as all_reduce's, and no two overlapping
// (a tensor listed twice would be reduced twice on backends that reduce each in place).
void check_all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp reduce_op);
// all_gather_coalesced and reduce_scatter_coalesced, on `group`: equal list lengths, each pair
// checked as the single-tensor form, and no output over another output or over an input other
// than in place (check_outputs_apart).
void check_all_gather_coalesced(const ProcessGroup& group, const std::vector<Tensor>& outputs,
                                const std::vector<Tensor>& inputs);
void check_reduce_scatter_coalesced(const ProcessGroup& group, const std::vector<Tensor>& outputs,
                                    const std::vector<Tensor>& inputs, ReduceOp reduce_op);
// What every coalesced form returns for an empty list, once its lists are checked: a finished
// Work naming the op and the group. It takes no sequence number (nothing to move, nobody to
// meet; PyTorch returns an empty list at once too), so a rank may pass one alone.
std::shared_ptr<Work> empty_coalesced(std::string_view op, const ProcessGroup& group);
// all_reduce_coalesced_into: equal list lengths; every tensor contiguous, each output with its
// input's dtype and numel; no output overlaps another output or an input other than its own
// (identical bytes: in place).
void check_all_reduce_into(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                           ReduceOp reduce_op);
// How an output may share bytes with its own input (each collective's in-place form).
enum class InPlace {
  kOwnInput,       // all_reduce: the output is its input (the same bytes)
  kInputInOutput,  // all_gather: the input is block `rank` of its output
  kOutputInInput,  // reduce_scatter: the output is block `rank` of its input
};
// The overlap part of it, for every coalesced form that writes caller-given outputs (each pair
// already checked for sizes): no output overlaps another output, or an input other than its
// own in the in-place form; inputs may overlap each other (they are only read).
// all_reduce_coalesced checks its list with itself too.
void check_outputs_apart(std::string_view op, const std::vector<Tensor>& outputs,
                         const std::vector<Tensor>& inputs, InPlace in_place = InPlace::kOwnInput,
                         int rank = 0);

// The single-tensor forms' rule, after their checks above: all_gather's input may share bytes
// with its output only as block `rank` of it and reduce_scatter's output only as block `rank` of
// its input (their in-place forms, `in_place`); all_to_all's output none with its input
// (nullopt: its rows move between ranks while they are read, so it has no in-place form).
// O(1); InvalidArgument "<op>: output overlaps input (...)" otherwise.
void check_pair_apart(std::string_view op, const Tensor& output, const Tensor& input,
                      std::optional<InPlace> in_place, int rank);

// The collective funcol itself runs inside a user's call (e.g. new_group's agreement on a
// name) is labelled with that call while it is issued: backends record internal_step() with
// each collective (0 for a user's own), compare it across ranks like the op and print its
// label in mismatch messages ("... [funcol's agreement step for new_group]"), so that such a
// step never pairs with a user's collective of the same shape and a peer's error says what it
// was. `label` must outlive the program (a string literal); scopes nest.
// GradTape::backward labels the collectives it issues kBackwardStep, so that where one rank's
// loss reaches more collectives than its peers', its remaining backward collectives meet the
// peers' next collectives of their own with a mismatch ("... [issued by GradTape::backward]")
// instead of pairing with them.
class InternalStep {
 public:
  explicit InternalStep(const char* label);
  ~InternalStep();
  InternalStep(const InternalStep&) = delete;
  InternalStep& operator=(const InternalStep&) = delete;

 private:
  uint8_t previous_;
};
// The calling thread's innermost InternalStep as a small id (one byte, for records compared on
// a hot path; equal labels get equal ids in one process), or 0.
uint8_t internal_step();
// The label of an id internal_step() gave (nullptr for 0).
const char* step_label(uint8_t step);
inline constexpr char kBackwardStep[] = "backward";
// " [funcol's agreement step for <label>]", " [issued by GradTape::backward]" for
// kBackwardStep, or "" for nullptr.
std::string describe_step(const char* label);

// The public call a split_group runs for while in scope (new_group), which its errors name
// instead of split_group: a user who called new_group never called split_group. `name` and
// `mismatch_hint` must outlive the scope (string literals); scopes nest. `mismatch_hint` ends,
// in parentheses, the error for ranks that passed different lists; null keeps the enclosing
// scope's (new_group called for a rank-list group spec keeps the spec's hint).
class SplitCaller {
 public:
  explicit SplitCaller(const char* name, const char* mismatch_hint = nullptr);
  ~SplitCaller();
  SplitCaller(const SplitCaller&) = delete;
  SplitCaller& operator=(const SplitCaller&) = delete;

 private:
  const char* previous_;
  const char* previous_hint_;
};
// The innermost SplitCaller's name on this thread, or "split_group".
const char* split_caller();
// The innermost SplitCaller's mismatch hint on this thread, or null.
const char* split_mismatch_hint();

// split_group, on every backend: validates the arguments (a new name; lists of members of
// `parent`, each rank in at most one) and returns the calling rank's list, or nullopt when it
// is in none.
std::optional<std::vector<int>> check_split(const ProcessGroup& parent,
                                            const std::vector<std::vector<int>>& rank_lists,
                                            const std::string& new_name);
// Collective over `parent`: checks that every rank passed the same rank lists and name to
// split number `split` of `parent` (two small all_gathers), so ranks that disagree all get the
// same CommError at once, naming two of them and what each passed, instead of building groups
// that never meet or that meet the wrong ranks. A name registered on some rank fails every
// rank the same way. A missing rank fails the all_gathers as any collective does.
// What a rank passed to split_group, as agree_on_split's messages show it: "[[0, 1]] as 'g'".
std::string split_description(const std::vector<std::vector<int>>& rank_lists,
                              const std::string& new_name);
// agree_on_split's first step, as every agreement step between ranks begins: the i64[2] every
// rank all-reduces with max, naming the step (here a split for split_caller()), so that ranks
// running different steps find out before anything of another size is exchanged.
Tensor split_header();
// agree_on_split's second step: the i64[8] every rank all-reduces with max (a hash and the
// length of its description, whether the name is taken on it, and their negations). The ranks
// agree when the maxima are minus the minima and no rank has the name taken.
Tensor split_probe(const std::string& description, bool taken);
void agree_on_split(ProcessGroup& parent, int split,
                    const std::vector<std::vector<int>>& rank_lists, const std::string& new_name);
// split_group, on every backend, on every rank of the parent once its part succeeded (a member
// once it registered its group; a rank in no list too): a split over a
// parent that spans the whole world made the groups of its lists with every rank taking part,
// so a group spec of rank lists made so (GroupSpec({{0, 1}, {2, 3}}) after a DeviceMesh or two
// new_groups made them) finds them without asking the other ranks, as after its own first
// resolution (GroupRegistry::resolved_partition).
void note_split(const ProcessGroup& parent, const std::vector<std::vector<int>>& rank_lists);

// The header every agreement step between ranks begins with (every rank of `group` calls it):
// one all_reduce, op max, of an i64[2] naming step `step` of the user's call `what` (a string
// literal, as InternalStep's label). Ranks running different steps pair their headers instead
// of exchanging data of other sizes (which the process backends may pair without
// FUNCOL_DEBUG=detail), and every rank gets the same CommError, the group still usable.
// funcol's other collectives between ranks (the Executor's graph check, align_epochs) begin
// with it too.
void begin_step(ProcessGroup& group, std::string_view step, const char* what);

// Whether every rank of `group` holds the same `value` (one small all_reduce; every rank of
// `group` calls it). Registries differ between ranks (a group is registered on its members
// only), so decisions that read one must be agreed this way. `what` (a string literal) names
// the user's call (e.g. "new_group") and labels the all_reduce (InternalStep); a CommError of
// the all_reduce (a rank that never came) says it was that call's agreement that failed.
bool same_on_every_rank(ProcessGroup& group, int64_t value, const char* what);
// Whether `flag` is true on every rank of `group` (same_on_every_rank; every rank calls it,
// whatever its flag).
bool on_every_rank(ProcessGroup& group, bool flag, const char* what);
// The largest `value` / the bitwise and of `bits` over the ranks of `group` (as
// same_on_every_rank: one small all_reduce every rank calls).
int64_t max_over_ranks(ProcessGroup& group, int64_t value, const char* what);
int64_t and_over_ranks(ProcessGroup& group, int64_t bits, const char* what);
// A fresh "group<N>" for an unnamed group over `group`: N is the largest of the ranks'
// registry counters (they differ once unnamed groups were made over subgroups), moved on until
// no rank has the name; every rank's counter then passes it. Every rank of `group` calls it.
std::string agreed_group_name(ProcessGroup& group, const char* what);
// The first of candidate(1), candidate(2), ... that no rank of `group` has registered (one
// same_on_every_rank per candidate tried; every rank of `group` calls it).
std::string first_free_name(ProcessGroup& group, const std::function<std::string(int)>& candidate,
                            const char* what);

// "[0, 2, 3]". A list longer than 16 shows runs of three or more consecutive ranks as
// "first-last" and at most 16 items: "[0-4095, 4097-9999]", "[0, 2, 4, ..., ... (5000 ranks in
// all)]", so that an error about a large job stays one readable line.
std::string format_ranks(const std::vector<int>& ranks);

// The message `work` failed with, or `fallback` when it did not fail (or not with a
// std::exception).
std::string failure_message(const Work& work, const std::string& fallback);

// The collectives whose failure a rank never saw when it ended (run_local's function returned,
// destroy_process_group): those it left in flight, and those that failed earlier whose result
// it dropped unwaited. Their failures reach nobody else, so a rank that issued a collective its
// peers never issued, or a different one, would end silently. note() counts a failed one;
// warn() says so on stderr.
class UnwaitedFailures {
 public:
  // The failures of `rank`: each of `failed` (a FailureLedger's, in failure order) that the
  // rank never saw or that is in `unwaited` (the Works it left in flight, which its end then
  // waited for), and each failed one of `unwaited` besides.
  // `dropped`: the ledger was full and kept some failures no more, so the count is a lower bound.
  static UnwaitedFailures of(int rank, const std::vector<std::shared_ptr<Work>>& failed,
                             const std::vector<std::shared_ptr<Work>>& unwaited,
                             bool dropped = false);
  // Counts `work` when it has failed (a Work not yet finished is not counted).
  void note(const Work& work);
  // On stderr, when any failed: "funcol: warning: rank R ended with a collective it had not
  // waited for, which failed: MESSAGE" (or "N collectives ...; the first: MESSAGE", "at least
  // N collectives ..." when some were dropped).
  void warn(int rank) const;

 private:
  size_t count_ = 0;
  bool dropped_ = false;
  std::string first_;
};

// The failed collectives a rank issued, kept until it ends for UnwaitedFailures::of. At most
// kKept: a full ledger first drops those whose failure the rank saw, then keeps no more (a
// program that handles many failures is not the one the warning is for). Thread-safe: a
// collective fails on whichever thread finds the failure.
class FailureLedger {
 public:
  static constexpr size_t kKept = 64;
  // Keeps `work` (once: adding it again does nothing), a failed collective of global rank
  // `rank`.
  void add(std::shared_ptr<Work> work, int rank);
  // Keeps `work` in place of `instead` (a failed Work the rank never got: it got `work`,
  // which says the failure from its side), or adds it when `instead` is not kept.
  void replace(const std::shared_ptr<Work>& instead, std::shared_ptr<Work> work, int rank);
  // Everything kept, in failure order; empties the ledger. `*dropped`: whether a failure came
  // when it was full of unseen ones (and was not kept).
  std::vector<std::shared_ptr<Work>> take(bool* dropped = nullptr);

 private:
  std::mutex mu_;  // taken last: nothing is locked under it
  std::vector<std::shared_ptr<Work>> works_;
  bool dropped_ = false;
};

// The number in environment variable `name` (blanks may follow it), or nullopt when the
// variable is unset or empty. InvalidArgument "NAME=value: expected <expected>" when the value
// is not a finite number or `valid` rejects it.
std::optional<double> env_number(const char* name, std::string_view expected,
                                 bool (*valid)(double));

}  // namespace funcol::dist_detail
