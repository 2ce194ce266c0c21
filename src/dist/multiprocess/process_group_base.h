// ProcessGroupBase: what the process backends (mpi, gloo) share — argument checks, sequence
// numbers, detail-mode signatures, timeouts, and failing collectives when a peer is lost.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/multiprocess/op_signature.h"
#include "dist/multiprocess/peer_monitor.h"
#include "funcol/dist/process_group.h"

namespace funcol::process {

class ProcessGroupBase;

// One issued collective: its arguments, its Work, and the tensors the transport reads and
// writes (held here so they outlive the transport even when the Work failed early, e.g. on a
// timeout while MPI or Gloo still owns the buffers). Completed exactly once.
struct CollectiveOp {
  OpKind kind = OpKind::Barrier;
  int64_t seq = -1;
  DType dtype = DType::F32;
  ReduceOp reduce_op = ReduceOp::Sum;
  int root = -1;
  // One entry per tensor; in-place ops (all_reduce, broadcast) have inputs == outputs.
  std::vector<Tensor> inputs;
  std::vector<Tensor> outputs;
  // all_to_all, in elements, per group rank.
  std::vector<int64_t> send_counts, send_displs, recv_counts, recv_displs;
  OpSignature signature;
  std::shared_ptr<Work> work;
  std::chrono::steady_clock::time_point issued_at;
  std::chrono::steady_clock::time_point deadline;
  // Set when this rank's own arguments make the collective fail here (all_to_all rows it keeps
  // for itself that disagree with themselves): it still runs, so that no peer is left waiting,
  // and its Work then fails with a CommError saying this.
  std::string own_error;
  // Set when a member died while this was in flight: fail with this at the (shortened)
  // deadline unless it completes first. Guarded by the group's lock.
  std::string loss;

  // True when finished or failed (by the transport, the watchdog or a lost peer).
  bool done() const { return done_.load(std::memory_order_acquire); }
  // Claims completion; false when somebody completed it already.
  bool claim() { return !done_.exchange(true, std::memory_order_acq_rel); }

 private:
  std::atomic<bool> done_{false};
};

// Everything one process shares across its groups on a process backend: identity, timeout,
// the peer monitor and a watchdog thread that fails collectives past their deadline.
class ProcessJob {
 public:
  // `monitor` may be null (world size 1).
  ProcessJob(std::string backend, int rank, int world_size, std::chrono::milliseconds timeout,
             bool detail, std::unique_ptr<PeerMonitor> monitor);
  ~ProcessJob();
  ProcessJob(const ProcessJob&) = delete;
  ProcessJob& operator=(const ProcessJob&) = delete;

  const std::string& backend() const { return backend_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  bool detail() const { return detail_; }
  PeerMonitor* monitor() const { return monitor_.get(); }

  // Groups register themselves when created and unregister when destroyed.
  void add_group(const std::shared_ptr<ProcessGroupBase>& group);
  void remove_group(const ProcessGroupBase* group);

  // Waits until every collective issued on every live group has ended, within the timeout
  // (destroy_process_group, before shutdown: see ProcessGroupBase::drain). Returns the failures
  // nobody saw (the caller warns): of those that were still in flight, and of those that failed
  // earlier whose failure wait() never threw; none when leaving_after_error().
  dist_detail::UnwaitedFailures drain();
  // Keeps `work`, a collective of this process that failed, for drain's warning.
  void note_failed(std::shared_ptr<Work> work) { failed_.add(std::move(work), rank_); }
  // True when this process leaves because of an error it reported (set_departure_error).
  bool leaving_after_error() const;
  // Says goodbye to the peers and stops the watchdog (destroy_process_group; `at_exit`: called
  // by the process's exit instead).
  void shutdown(bool at_exit = false);
  // shutdown() was called: the job's groups can no longer be used.
  bool shut_down() const { return shut_down_.load(std::memory_order_acquire); }

 private:
  void watchdog();
  void on_peer_lost(const PeerLoss& loss);
  void on_gave_up(int from, const std::string& name, int64_t seq, const std::string& error);
  std::vector<std::shared_ptr<ProcessGroupBase>> live_groups();

  const std::string backend_;
  const int rank_;
  const int world_size_;
  const std::chrono::milliseconds timeout_;
  const bool detail_;
  std::unique_ptr<PeerMonitor> monitor_;
  dist_detail::FailureLedger failed_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::weak_ptr<ProcessGroupBase>> groups_;
  // News that a peer gave up on a collective of a group this process has not registered yet
  // (the peer made it and used it first): add_group hands it to the group.
  struct EarlyGaveUp {
    int from;
    std::string name;
    int64_t seq;
    std::string error;
  };
  std::vector<EarlyGaveUp> early_gave_up_;
  bool stopping_ = false;
  std::atomic<bool> shut_down_{false};
  std::thread watchdog_;
};

// The process backends' common ProcessGroup: validates arguments synchronously (InvalidArgument,
// ShapeError), waits for pending inputs, numbers collectives, attaches the Work to the outputs,
// runs world-size-1 groups locally, and hands everything else to submit() in issue order.
// Failures — timeouts (from the job's watchdog), lost peers, transport errors — fail the Work
// with a CommError naming the op, group, seq and the ranks that did not arrive, and leave the
// group unusable: its later collectives fail at once instead of hanging. (After a clean
// departure, only those from the first the leaver never issued: it did its part of the others.)
class ProcessGroupBase : public ProcessGroup,
                         public std::enable_shared_from_this<ProcessGroupBase> {
 public:
  ~ProcessGroupBase() override;

  std::shared_ptr<Work> all_reduce(const Tensor& tensor, ReduceOp op) override;
  std::shared_ptr<Work> all_gather(const Tensor& output, const Tensor& input) override;
  std::shared_ptr<Work> reduce_scatter(const Tensor& output, const Tensor& input,
                                       ReduceOp op) override;
  std::shared_ptr<Work> all_to_all(const Tensor& output, const Tensor& input,
                                   const std::vector<int64_t>& output_splits,
                                   const std::vector<int64_t>& input_splits) override;
  std::shared_ptr<Work> broadcast(const Tensor& tensor, int src) override;
  std::shared_ptr<Work> barrier_async() override;
  std::shared_ptr<Work> all_reduce_coalesced(const std::vector<Tensor>& tensors,
                                             ReduceOp op) override;
  // One all_reduce of the inputs packed into the output, as ProcessGroup's; its detail-mode
  // signature lists every input (OpKind::AllReduceFlat).
  std::shared_ptr<Work> all_reduce_flat(const Tensor& output,
                                        std::shared_ptr<const std::vector<Tensor>> inputs,
                                        ReduceOp op) override;
  std::shared_ptr<Work> all_gather_coalesced(const std::vector<Tensor>& outputs,
                                             const std::vector<Tensor>& inputs) override;
  std::shared_ptr<Work> reduce_scatter_coalesced(const std::vector<Tensor>& outputs,
                                                 const std::vector<Tensor>& inputs,
                                                 ReduceOp op) override;
  // The transports run a coalesced list as one collective per tensor.
  bool fuses_coalesced() const override { return false; }

  const std::shared_ptr<ProcessJob>& job() const { return job_; }
  // This process's global rank.
  int global_rank() const { return global_ranks()[rank()]; }

  // ---- called by the job ----
  // Fails collectives past their deadline; returns the earliest remaining deadline.
  std::optional<std::chrono::steady_clock::time_point> check_deadlines(
      std::chrono::steady_clock::time_point now);
  void on_peer_lost(const PeerLoss& loss);
  // Peer `from` (a global rank) gave up on collective `seq` of this group with `error` (it
  // timed out, or its input held a failure): this rank's collectives from `seq` on can never
  // complete (from the lowest such seq any peer gave up on). Those in flight fail now; if this
  // rank issues `seq` only later, it fails at once, saying it came too late.
  void on_peer_gave_up(int from, int64_t seq, const std::string& error);
  // Waits until every collective issued on this group has ended (completed, failed, or timed
  // out through the job's watchdog), or until `deadline`; at once when the group failed, or
  // when those left are ones a departed member never issued. destroy_process_group drains every
  // group before the goodbye: dropped results still complete, and peers get this process's
  // part of every collective it issued.
  void drain(std::chrono::steady_clock::time_point deadline);
  // The Works of the collectives in flight and not finished, in issue order, appended to
  // `works`.
  void append_inflight_works(std::vector<std::shared_ptr<Work>>& works) const;

 protected:
  ProcessGroupBase(int rank, std::vector<int> global_ranks, std::string name,
                   GroupRegistry* registry, std::shared_ptr<ProcessJob> job);
  // Registers with the job and the monitor; call once right after construction.
  void attach();

  // Runs `op` on the transport. Called in sequence order, never for world size 1, for a group
  // already broken, or for a collective a departed member never issued. The backend ends it
  // with complete() or fail_op().
  virtual void submit(const std::shared_ptr<CollectiveOp>& op) = 0;

  // Called (on any thread) when the group becomes unusable: a failure, a timeout, a lost peer.
  virtual void on_broken(const std::string& reason) { (void)reason; }

  // Called (on any thread) after a collective given to submit() failed by something other
  // than the backend's own report: the watchdog, a lost peer, a peer that gave up, an earlier
  // failure of the group. A transport that may still be waiting in it can stop waiting.
  virtual void on_failed(const CollectiveOp& op) { (void)op; }

  // Finishes the op's Work (no-op when it was already failed).
  void complete(const std::shared_ptr<CollectiveOp>& op);
  // Fails the op with CommError(message) and marks the group broken. `claimed`: the caller
  // claimed the op already (CollectiveOp::claim).
  void fail_op(const std::shared_ptr<CollectiveOp>& op, const std::string& message,
               bool claimed = false);
  // The same for an op that failed before the transport was given any of it (a count it
  // cannot carry, a transport already gone): this rank never took part in it, so the peers
  // waiting in it fail as soon as it leaves. (An op that failed in the transport may have
  // done its part for them, as when another member died.)
  void fail_unposted(const std::shared_ptr<CollectiveOp>& op, const std::string& message);
  // Fails the op because the ranks disagreed on it (detail mode). The group stays usable:
  // every rank saw the same signatures and skipped the collective.
  void fail_mismatch(const std::shared_ptr<CollectiveOp>& op, const std::string& message);
  // Why the group is unusable (from some collective on, after a departure), or nullopt.
  std::optional<std::string> broken() const;
  // The op's deadline now (a lost peer shortens it, under the group's lock).
  std::chrono::steady_clock::time_point deadline_of(const CollectiveOp& op) const;
  // Describes a failure for a CommError: "<op description> failed: <what>; <lost peers>".
  std::string failure_message(const CollectiveOp& op, const std::string& what) const;
  // The same for a failure of this rank's own that no peer explains (a count past MPI's
  // limit, which every rank finds alike): "<op description>: <backend>: <what>", at once.
  std::string local_failure_message(const CollectiveOp& op, const std::string& what) const;
  // Collective over this group: dist_detail::agree_on_split for this group's next split.
  // Returns the split's index in this group (0, 1, ... in call order).
  int agree_on_split(const std::vector<std::vector<int>>& rank_lists, const std::string& new_name);
  // Compares the gathered signatures (detail mode); nullopt when they agree.
  std::optional<std::string> check_gathered(const CollectiveOp& op,
                                            const std::vector<char>& all) const;

 private:
  std::shared_ptr<Work> issue(std::shared_ptr<CollectiveOp> op);
  void run_single_rank(CollectiveOp& op);
  void mark_broken(const std::string& reason);
  // Ends a claimed op's Work: finished, or failed with the error its own arguments left.
  void finish_work(const CollectiveOp& op);
  // Fails a claimed op's Work with `error` and notes it (ProcessJob::note_failed).
  void fail_work(const CollectiveOp& op, std::exception_ptr error);
  // Fails the Work of an op claimed by the caller with `error`, then tells on_failed.
  void fail_claimed(const CollectiveOp& op, std::exception_ptr error);
  // Collectives from `seq` on can never complete, because of `why`: lowers unusable_from_ to
  // `seq` (mu_ held).
  void unusable_from_locked(int64_t seq, const std::string& why);
  // This rank took no part in collective `seq`: posted_ goes back to it (the group is broken,
  // so nothing later is taken part in either).
  void not_taken_part(int64_t seq);
  // "<op>: group 'G' failed earlier: <reason>", for a collective a failure found in flight.
  CommError failed_earlier(const CollectiveOp& op, const std::string& reason) const;
  void remove_inflight(const CollectiveOp* op);
  std::string timeout_message(const CollectiveOp& op);
  // "; the ranks issued different collectives as seq S: ..." (or "...with mismatched split
  // sizes...") when this rank's op and the answers `theirs` of `peers` (global ranks; an empty
  // answer: none) to a progress query at op.seq differ; "" when they agree.
  std::string difference_note(const CollectiveOp& op, const std::vector<int>& peers,
                              const std::vector<std::string>& theirs) const;
  // The error of a collective that lost members: every member lost by now that had not issued
  // it, deaths first (the likely cause), with " before joining" on a departure, and them as
  // missing; `first` (the first loss seen, described) when the monitor knows none.
  std::string loss_message(const CollectiveOp& op, const std::string& first) const;
  struct GaveUp;
  // The error of collective `gave_up.seq`: "<op>: rank R gave up on it: <R's error>", where
  // R's error leaves out its "<op>: " when both issued the same collective, and "rank R gave up
  // on it: " is left out when R's error begins with "rank R ".
  std::string gave_up_message(const CollectiveOp& op, const GaveUp& gave_up) const;
  // The same for gave_up_, issued after the peer gave up on it (mu_ held).
  std::string late_message(const CollectiveOp& op) const;
  // Whether a peer that went away had issued collective `seq` of this group: only one that
  // left cleanly says so (its goodbye counts what it issued per group). Such a peer did
  // arrive; it only cannot help finish the collective.
  bool issued_before_leaving(const PeerLoss& loss, int64_t seq) const;
  // The loss as errors name it: with " before joining" for a departure without its part in
  // collective `seq`.
  std::string loss_text(const PeerLoss& loss, int64_t seq) const;

  // The signatures of the last few collectives issued, for the peer monitor's answers: a peer
  // whose collective timed out while every rank had issued one asks what each issued, so that
  // ranks that issued different collectives (unchecked without FUNCOL_DEBUG=detail) hear so.
  // Shared with the monitor's callback, which may outlive the group.
  class RecentOps {
   public:
    void record(int64_t seq, const OpSignature& signature);
    // Collective `seq`'s signature, encoded for a group of `group_size` ranks (encode_signature),
    // or "" when it is not among the last kKept.
    std::string encoded(int64_t seq, int group_size);

   private:
    static constexpr size_t kKept = 8;
    std::mutex mu_;
    // Entry seq % kKept: a collective and its signature; seq -1 where nothing was recorded yet.
    struct Entry {
      int64_t seq = -1;
      OpSignature signature;
    };
    std::array<Entry, kKept> ring_{};
  };

  std::shared_ptr<ProcessJob> job_;
  // The next sequence number (under issue_mu_): every collective issued counts, refused ones
  // included.
  int64_t issued_ = 0;
  // What the peer monitor reports to the peers (queries at a timeout, the goodbye): one past
  // the last collective this rank took part in. A collective refused at issue (the group had
  // failed) does not count, nor one that failed before its transport had any of it
  // (fail_unposted): a peer waiting in it after this rank left would wait out its timeout,
  // taking it for done here.
  std::shared_ptr<std::atomic<int64_t>> posted_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<RecentOps> recent_ = std::make_shared<RecentOps>();
  std::mutex issue_mu_;  // sequence numbers and submit() in one order
  mutable std::mutex mu_;
  std::deque<std::shared_ptr<CollectiveOp>> inflight_;  // issue order
  std::optional<std::string> broken_;
  // Collectives from unusable_from_ on never complete (why: unusable_why_); those before it
  // still do. A member that left cleanly took part in every collective before the fewest any
  // departed member issued here (its part is done: an eager broadcast's data, an empty
  // collective); this rank takes no part from the first one whose input held a failure (the
  // peers were told it gave up on that one, not on those before).
  int64_t unusable_from_ = std::numeric_limits<int64_t>::max();
  std::optional<std::string> unusable_why_;
  // The peer that gave up on the earliest collective of this group (on_peer_gave_up).
  struct GaveUp {
    int from = -1;
    int64_t seq = 0;
    std::string error;
  };
  std::optional<GaveUp> gave_up_;
  bool attached_ = false;
  std::atomic<int> splits_{0};  // split_group calls so far
};

}  // namespace funcol::process
