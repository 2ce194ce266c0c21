// The executor: runs a Graph on one rank over a ProcessGroup, planned once and run many times.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/core/tensor.h"
#include "funcol/dist/process_group.h"
#include "funcol/graph/graph.h"

namespace funcol {

class Profiler;

// Options of an Executor. The defaults are what `funcol run` uses without --trace.
struct ExecutorOptions {
  // Compare a hash of the printed graph across the world before planning (one all_gather over
  // world), so ranks that loaded different graphs fail at once instead of deadlocking later.
  bool check_same_graph = true;
  // Where to record compute, communication and wait spans; null records nothing (no cost).
  Profiler* profiler = nullptr;
  // Called after every node of every run (tests and debugging); empty: never called.
  std::function<void(const Node& node)> on_node;
  // Run the pack / collective / unpack chains the bucketing passes write as one coalesced
  // primitive on the members themselves (all_gather: cat or packed gather, wait, view, split,
  // reshapes; reduce_scatter: reshapes, cat, flatten, scatter, wait, split; all_reduce: flattens,
  // cat or bucket_pack, all_reduce out of place, wait, split), so the members are
  // neither copied into a bucket nor out of it where the group fuses coalesced lists
  // (ProcessGroup::fuses_coalesced: threads). Where the group loops over a list (mpi, gloo) only
  // all_gather buckets whose members average ProcessGroup::all_gather_coalesced_min_bytes or
  // more are lowered (mpi: 64 KiB; gloo: never).
  // Results are bit-identical either way; false runs the chain node by node, as does
  // check_same_graph false (ranks with graphs of their own could lower a collective unalike).
  bool lower_buckets = true;
};

// Runs one graph on the calling rank. The constructor plans: it resolves every collective's
// group in the rank's registry (world.registry(): "world", mesh dim names, new_group names),
// checks its attributes against the real group, and precomputes operand slots and the last
// use of every value, so run() touches no map and allocates nothing of its own per node.
//
// run() issues collectives asynchronously in graph order through the group's primitives
// (compute placed between a collective and its wait_tensor overlaps with it); wait_tensor
// blocks; every other op runs its op-table CPU kernel, views sharing storage. A value is
// released right after its last use (graph outputs are kept). Errors name the graph, the node
// and its source line: "graph @g, node %ag (line 3): group_size 4 does not match group 'world'
// of size 2". One Executor belongs to one rank (thread): run() from a second thread while one
// runs throws InvalidArgument. The graph must outlive it.
class Executor {
 public:
  // Throws InvalidArgument (unknown group, group_size mismatch, bad src or split sizes, an op
  // without a kernel) or, when options.check_same_graph, InvalidArgument naming the ranks and
  // hashes when the ranks' graphs differ (collective over world; a world of 1 skips it).
  Executor(const Graph& graph, ProcessGroup& world, ExecutorOptions options = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs the graph once. `inputs` holds one tensor per graph input, of its dtype and shape
  // (InvalidArgument otherwise); they are released after their last use too. Returns the
  // graph outputs, complete: collectives never waited by the graph are waited at the end. (An
  // input returned as it is comes back as it was given: one still pending on a collective of
  // the caller's waits on first use, as every pending tensor does.) A run that fails part-way
  // (a kernel's error, a collective that failed) throws that error after issuing the run's
  // collectives it had not issued yet, failed, so that every rank issues each collective once
  // per run: the peers' run fails with a CommError naming this rank and the error ("rank 1
  // could not take part: it gave up on the rest of its run after an error at graph @g, node
  // %q (line 3): ..."), and the next run pairs up right. (On mpi and gloo the group is
  // unusable after such a collective, as after a timeout.) Bad inputs are refused before
  // anything is issued.
  std::vector<Tensor> run(std::vector<Tensor> inputs);

  const Graph& graph() const;
  int rank() const;
  // Runs completed so far (the iteration number recorded in profile spans).
  int runs() const;

  // For on_node observers: collectives issued and not yet complete.
  size_t pending_collectives() const;
  // For on_node observers: bytes of the distinct storages held by live values.
  int64_t live_bytes() const;
  // Bucket chains run as one coalesced primitive (see ExecutorOptions::lower_buckets).
  size_t lowered_buckets() const;
  // Casts folded into the cat that is their only user: that cat converts as it copies, one copy
  // instead of two (the convert_element_type nodes right before a cat that only it uses: the
  // packing the bucketing passes' default mode writes for cast members).
  size_t folded_casts() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Checks every collective of `graph` against the groups it names: `group_size(name)` returns
// the group's size or nullopt when no such group exists (`known` lists the names for the
// message). Checks group_size attributes, broadcast src and all_to_all split list lengths,
// and, as every rank runs this graph, that each all_to_all's split sizes are all equal (rank r
// sends input_split_sizes[j] rows to rank j, which expects output_split_sizes[r]). Throws
// InvalidArgument "graph @g, node %ag (line 3): ...". Used by `funcol run` before it starts
// any rank; the Executor checks the same with its real groups (split sizes only when
// options.check_same_graph: ranks that run graphs of their own may split unevenly).
void validate_groups(const Graph& graph,
                     const std::function<std::optional<int>(const std::string&)>& group_size,
                     const std::vector<std::string>& known);

// XXH3-64 of the printed graph (print(graph)): equal graphs hash equal on every rank.
uint64_t graph_hash(const Graph& graph);
// All-gathers graph_hash over `world`; when they differ, the ranks find the first byte of the
// printed graph that differs (in lockstep, a hash of a prefix per round) and every rank throws
// the same InvalidArgument showing each rank's text of its line (of a long line, the part
// around that byte): "graph @g differs between ranks: its printed line 2 is
// `%y = neg(%x) : f32[2]` on ranks 0,2 and `%y = relu(%x) : f32[2]` on rank 1 (...)". The
// all_gather is labelled as funcol's own step: a peer's collective issued in its place fails
// (CommError, "[funcol's agreement step for Executor]") instead of pairing with it.
void check_same_graph(const Graph& graph, ProcessGroup& world);

// The inputs `funcol run` feeds a graph: input i of rank `rank` is Tensor::rand of its type
// with a seed mixed from (seed, i, rank) by splitmix64, so floats are uniform in [-1, 1),
// integers in [0, 100) and bools random, identical across backends and runs.
std::vector<Tensor> make_inputs(const Graph& graph, uint64_t seed, int rank);
// The seed make_inputs uses for input `index` of `rank`.
uint64_t input_seed(uint64_t seed, uint64_t index, int rank);

// XXH3-64 of `n` bytes.
uint64_t xxh3_64(const void* data, size_t n);
// XXH3-64 of a tensor's elements in logical order (waits), as 16 lowercase hex digits.
std::string tensor_digest(const Tensor& tensor);

}  // namespace funcol
