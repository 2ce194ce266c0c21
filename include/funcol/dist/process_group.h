// ProcessGroup: a set of ranks and the asynchronous collective primitives a backend implements.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "funcol/core/dtype.h"
#include "funcol/core/tensor.h"
#include "funcol/dist/work.h"

namespace funcol {

class GroupRegistry;

// A group of ranks with a backend behind it. Every primitive works on contiguous tensors,
// starts asynchronously and returns a Work; the output tensors are left pending until then
// (the Work is attached to their storage). All ranks of the group must issue the same
// primitives in the same order; each call takes the group's next sequence number. A rank may
// issue from any thread, but from one at a time, in an order the program fixes: two threads
// racing could not keep the order (the threads backend throws InvalidArgument when it sees two
// calls overlap), and calls from two threads that interleave differently on two ranks pair up
// by sequence number, which mixes their data silently where op, dtype and shape agree (as in
// PyTorch). Waiting on a Work and reading results are thread-safe.
//
// Primitives validate shapes and dtypes and throw InvalidArgument / ShapeError synchronously;
// communication failures (timeout, departed or dead peer, mismatched collectives) fail the Work.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  // This process's (or thread's) rank within the group, 0..size()-1.
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(global_ranks_.size()); }
  // Registry name: "world", a mesh dim name, or "group<N>" for new_group.
  const std::string& name() const { return name_; }
  // Global (world) rank of each group rank.
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  // The backend name: "threads", "mpi" or "gloo".
  virtual std::string backend() const = 0;

  // In place on `tensor` (contiguous).
  virtual std::shared_ptr<Work> all_reduce(const Tensor& tensor, ReduceOp op) = 0;
  // output: size() * input.numel() elements, rank-major (rank j's input at element j*numel).
  // The input may share bytes with the output only as its block rank() (in place).
  virtual std::shared_ptr<Work> all_gather(const Tensor& output, const Tensor& input) = 0;
  // input: size() * output.numel() elements; rank j receives reduce of block j. The output may
  // share bytes with the input only as its block rank() (in place).
  virtual std::shared_ptr<Work> reduce_scatter(const Tensor& output, const Tensor& input,
                                               ReduceOp op) = 0;
  // Splits count rows of dim 0 (row = numel / dim0 elements). input_splits[j] rows go to rank
  // j; output_splits[j] rows come from rank j. Empty split lists mean an even split of dim 0.
  // The output shares no bytes with the input (no in-place form).
  virtual std::shared_ptr<Work> all_to_all(const Tensor& output, const Tensor& input,
                                           const std::vector<int64_t>& output_splits,
                                           const std::vector<int64_t>& input_splits) = 0;
  // In place: every rank's `tensor` becomes rank `src`'s (src is a group rank).
  virtual std::shared_ptr<Work> broadcast(const Tensor& tensor, int src) = 0;
  virtual std::shared_ptr<Work> barrier_async() = 0;
  // Blocks until every rank of the group reached the barrier.
  void barrier() { barrier_async()->wait(); }

  // Coalesced forms: one sequence number and one Work for the whole list.
  virtual std::shared_ptr<Work> all_reduce_coalesced(const std::vector<Tensor>& tensors,
                                                     ReduceOp op);
  // Out of place: outputs[i] (inputs[i]'s dtype and numel; every tensor contiguous) receives
  // the reduction of every rank's inputs[i]; the inputs are only read. An output may be its own
  // input (in place) but may not overlap any other tensor of either list. The default stages
  // each dtype's inputs in one buffer, reduces it and copies the result to the outputs (the
  // same copies as the in-place form); threads reduces straight from the inputs, so a bucket of
  // tensors needs neither a pack nor an unpack copy.
  virtual std::shared_ptr<Work> all_reduce_coalesced_into(const std::vector<Tensor>& outputs,
                                                          const std::vector<Tensor>& inputs,
                                                          ReduceOp op);
  // All-reduce of `inputs` laid end to end: `output` (contiguous and one-dimensional, of the
  // inputs' dtype, as many elements as all of them) receives at each input's offset the
  // reduction of every rank's inputs[i]. A bucket of all_reduces without a pack copy: the
  // inputs are read where they are, the results are views of one buffer. The backend keeps the
  // list alive (one reference, not one per tensor) until the collective finished; nobody may
  // write the inputs meanwhile. An input still pending (the result of a collective not yet
  // waited) is waited for first. Every rank's inputs have the same element counts. The default
  // copies the inputs into `output` and all-reduces it in place; threads reduces straight from
  // the inputs.
  virtual std::shared_ptr<Work> all_reduce_flat(const Tensor& output,
                                                std::shared_ptr<const std::vector<Tensor>> inputs,
                                                ReduceOp op);
  // All-gather of `inputs` laid end to end: `output` (contiguous and one-dimensional, of the
  // inputs' dtype, size() times as many elements as all of them) receives, for each input i
  // in turn, every rank's inputs[i] in rank order: input i's stretch starts at size() times
  // the elements of the inputs before it (a bucket of all_gathers' results, back to back).
  // The list is held, and pending inputs waited, as all_reduce_flat's. The default runs
  // all_gather_coalesced on views of `output`.
  virtual std::shared_ptr<Work> all_gather_flat(const Tensor& output,
                                                std::shared_ptr<const std::vector<Tensor>> inputs);
  // Reduce-scatter of `inputs`, each split into size() blocks along its elements: `output`
  // (contiguous and one-dimensional, of the inputs' dtype, 1/size() of all their elements)
  // receives, for each input i in turn, the reduction of block rank() of every rank's inputs[i]
  // (a bucket of reduce_scatters' results, back to back). Every input's element count must
  // divide by size(). The list is held, and pending inputs waited, as all_reduce_flat's. The
  // default runs reduce_scatter_coalesced into views of `output`.
  virtual std::shared_ptr<Work> reduce_scatter_flat(
      const Tensor& output, std::shared_ptr<const std::vector<Tensor>> inputs, ReduceOp op);
  virtual std::shared_ptr<Work> all_gather_coalesced(const std::vector<Tensor>& outputs,
                                                     const std::vector<Tensor>& inputs);
  virtual std::shared_ptr<Work> reduce_scatter_coalesced(const std::vector<Tensor>& outputs,
                                                         const std::vector<Tensor>& inputs,
                                                         ReduceOp op);
  // True when the coalesced forms cost one collective for the whole list (the default forms
  // stage the list in one buffer per dtype; threads fuses it natively, copying nothing more).
  // False where a backend runs one collective per tensor (mpi, gloo): there a bucket must keep
  // its packed buffer to be one collective.
  virtual bool fuses_coalesced() const { return true; }
  // From this mean tensor size (bytes) on, all_gather_coalesced over a list costs less than
  // packing the list into one all_gather and unpacking the result (two copies of every byte):
  // 0 where coalesced lists fuse; where a backend loops, the point at which its per-collective
  // cost falls below the copies (mpi: its nonblocking gathers overlap, 64 KiB); INT64_MAX:
  // never (gloo runs them one after another).
  virtual int64_t all_gather_coalesced_min_bytes() const;

  // A subgroup of this group's members, given as global ranks. Collective over this group:
  // every rank of this group calls it with the same lists in the same order. `rank_lists`
  // partition the ranks (each rank joins the list that contains it); a rank in no list gets
  // null. Registered in the registry under `name`.
  virtual std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& rank_lists,
                                                    const std::string& name) = 0;

  // The registry this group belongs to (every rank has one; "world" is always there).
  // InvalidArgument once it is gone: a group kept after its world ended (run_local returned,
  // destroy_process_group) cannot make or find groups any more.
  GroupRegistry& registry() const;

  // A number no other ProcessGroup of this process had or will have (from 1): a key for caches
  // that must not take a new group allocated where a destroyed one was for the old one.
  uint64_t instance_id() const { return instance_id_; }

 protected:
  ProcessGroup(int rank, std::vector<int> global_ranks, std::string name, GroupRegistry* registry);

 private:
  // The default all_reduce coalesced forms (outputs may be the inputs themselves).
  std::shared_ptr<Work> staged_all_reduce(std::string_view what, const std::vector<Tensor>& outputs,
                                          const std::vector<Tensor>& inputs, ReduceOp op);

  int rank_;
  std::vector<int> global_ranks_;
  std::string name_;
  GroupRegistry* registry_;
  std::weak_ptr<const void> registry_alive_;  // GroupRegistry::alive_
  uint64_t instance_id_;
};

// Per-rank registry of groups by name. "world" always exists. Groups are created collectively,
// in the same order on every rank. Thread-safe (the lock is a leaf, held only inside these
// calls), but creating groups is collective over the parent: two threads of a rank may create
// groups at once only over parents whose collectives cannot interleave differently on the
// ranks (a parent of this rank alone, or parents of disjoint ranks); over two parents that
// share ranks, the ranks must create them in the same order, as with any collectives.
class GroupRegistry {
 public:
  // Throws InvalidArgument "unknown group 'x'" naming the known groups.
  std::shared_ptr<ProcessGroup> get(const std::string& name) const;
  std::shared_ptr<ProcessGroup> find(const std::string& name) const;  // null when absent
  // Registers; throws InvalidArgument when the name is taken by another group.
  void add(std::shared_ptr<ProcessGroup> group);
  std::shared_ptr<ProcessGroup> world() const { return get("world"); }
  // Names in registration order.
  std::vector<std::string> names() const;
  // Finds a registered group spanning exactly these global ranks (in order), or null.
  std::shared_ptr<ProcessGroup> find_by_ranks(const std::vector<int>& global_ranks) const;
  // Fresh name "group<N>", N counting up per registry. Counters differ between ranks once
  // unnamed groups were made over subgroups (they count on the subgroup's ranks only), so
  // new_group agrees on N (dist_detail::agreed_group_name).
  std::string next_group_name();
  // The N next_group_name() would use, and making it at least `id` + 1.
  int64_t next_group_id() const;
  void skip_group_ids_through(int64_t id);
  // Partitions of the world (sorted rank lists) that a group spec of rank lists resolved on
  // every rank, or whose every list got its group from a split over the whole world
  // (add_world_split): their uses find the groups here without asking the other ranks.
  bool resolved_partition(const std::vector<std::vector<int>>& lists) const;
  void add_resolved_partition(std::vector<std::vector<int>> lists);
  // The rank lists of a split whose parent spans the whole world (a DeviceMesh dim, new_group
  // over the world): every rank of the world took part, so every rank records the same lists
  // (those in increasing order only: find_by_ranks finds a group by its ranks in order).
  void add_world_split(const std::vector<std::vector<int>>& lists);

 private:
  std::shared_ptr<ProcessGroup> find_locked(const std::string& name) const;  // needs mu_

  mutable std::mutex mu_;  // everything below
  std::vector<std::shared_ptr<ProcessGroup>> groups_;  // registration order: deterministic
  // Lookups only (never iterated): thousands of groups made every lookup and registration a
  // scan (8,000 DeviceMesh groups took 11.7 s to create).
  std::unordered_map<std::string, size_t> by_name_;  // index into groups_
  std::map<std::vector<int>, size_t> by_ranks_;      // the first registered with these ranks
  int64_t next_id_ = 1;
  std::set<std::vector<std::vector<int>>> resolved_partitions_;
  std::set<std::vector<int>> world_split_lists_;  // sorted

  friend class ProcessGroup;
  // Expires with the registry: the groups' registry() checks it (a group may outlive it).
  const std::shared_ptr<const void> alive_ = std::make_shared<int>(0);
};

// Creates a group of the given global ranks over `parent` (collective over parent: every rank
// calls it, members and non-members alike). Returns null on ranks outside `ranks`.
std::shared_ptr<ProcessGroup> new_group(ProcessGroup& parent, const std::vector<int>& ranks,
                                        const std::string& name = {});
// The same over the calling rank's world (current_world(): inside run_local or after
// init_process_group), as torch.distributed.new_group(ranks). Throws InvalidArgument outside
// any world.
std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks,
                                        const std::string& name = {});

}  // namespace funcol
