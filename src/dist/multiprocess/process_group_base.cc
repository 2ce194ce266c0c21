// ProcessGroupBase and ProcessJob: argument checks, sequencing, timeouts and peer-loss handling
// shared by the mpi and gloo backends.
#include "dist/multiprocess/process_group_base.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string_view>
#include <thread>

#include "dist/checks.h"
#include "funcol/core/error.h"

namespace funcol::process {
namespace {

using Clock = std::chrono::steady_clock;

// The watchdog's longest sleep; timeouts fire at most this late.
constexpr std::chrono::milliseconds kWatchdogTick{100};
// How long a collective in flight when a member died may still complete: the dead rank may
// have done its part (sent its data) just before dying. A transport that needs the dead rank
// fails at once anyway (connection reset).
constexpr std::chrono::milliseconds kDeathGrace{1000};
// How long a collective that a member left without issuing still waits before it fails, when
// no member's death is known yet: a peer mostly leaves because of an error of its own, often
// the death of another member that this rank's monitor has not read yet (the goodbye and the
// dead rank's end of file can arrive in one poll, read in rank order). The failure then names
// the death as well as the departure.
constexpr std::chrono::milliseconds kDepartureWait{500};

std::vector<int64_t> displacements(const std::vector<int64_t>& counts) {
  std::vector<int64_t> displs(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
  return displs;
}

std::shared_ptr<CollectiveOp> make_op(OpKind kind) {
  auto op = std::make_shared<CollectiveOp>();
  op->kind = kind;
  op->signature.kind = kind;
  if (const char* step = dist_detail::step_label(dist_detail::internal_step())) {
    op->signature.step = step;
  }
  return op;
}

void add_slot(CollectiveOp& op, const Tensor& in, const Tensor& out, int64_t count) {
  op.inputs.push_back(in);
  op.outputs.push_back(out);
  OpSignature::Slot& slot = op.signature.slots.emplace_back();
  slot.dtype = in.dtype();
  slot.count = count;
  slot.ndim =
      dist_detail::pack_compared_shape(in.sizes(), op.kind == OpKind::AllToAll, slot.dims);
  if (op.inputs.size() == 1) op.dtype = in.dtype();
}

void set_reduce(CollectiveOp& op, ReduceOp reduce_op) {
  op.reduce_op = reduce_op;
  op.signature.reduce_op = reduce_op;
}

// `input` with `have` rows for this rank (`rows_before` rows into it) resized to `want`, the
// other ranks' rows where they were: what an all_to_all sends when this rank's rows for itself
// disagree with the rows it expects from itself (the rows it keeps are zeros).
Tensor resize_own_rows(const Tensor& input, int64_t row_elems, int64_t rows_before,
                       int64_t have, int64_t want) {
  Tensor staged = Tensor::zeros({(input.size(0) - have + want) * row_elems}, input.dtype());
  const size_t row_bytes = static_cast<size_t>(row_elems) * input.itemsize();
  const size_t before = static_cast<size_t>(rows_before) * row_bytes;
  const size_t after = input.nbytes() - before - static_cast<size_t>(have) * row_bytes;
  if (before + after == 0) return staged;
  const char* src = static_cast<const char*>(input.const_data_ptr());
  char* dst = static_cast<char*>(staged.raw_data_ptr());
  std::memcpy(dst, src, before);
  std::memcpy(dst + before + static_cast<size_t>(want) * row_bytes, src + input.nbytes() - after,
              after);
  return staged;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ProcessJob

ProcessJob::ProcessJob(std::string backend, int rank, int world_size,
                       std::chrono::milliseconds timeout, bool detail,
                       std::unique_ptr<PeerMonitor> monitor)
    : backend_(std::move(backend)),
      rank_(rank),
      world_size_(world_size),
      timeout_(timeout),
      detail_(detail),
      monitor_(std::move(monitor)) {
  if (monitor_) {
    monitor_->set_on_peer_lost([this](const PeerLoss& loss) { on_peer_lost(loss); });
    monitor_->set_on_gave_up(
        [this](int from, const std::string& name, int64_t seq, const std::string& error) {
          on_gave_up(from, name, seq, error);
        });
  }
  watchdog_ = std::thread([this] { watchdog(); });
}

ProcessJob::~ProcessJob() { shutdown(); }

void ProcessJob::shutdown(bool at_exit) {
  shut_down_.store(true, std::memory_order_release);
  if (monitor_) monitor_->shutdown(at_exit);
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

dist_detail::UnwaitedFailures ProcessJob::drain() {
  // Each collective's own deadline (the watchdog fails it) comes first; this one is a backstop.
  const auto deadline = std::chrono::steady_clock::now() + timeout_ + std::chrono::seconds(5);
  const auto groups = live_groups();
  // A process that reported an error of its own explains those failures with it: none are
  // collected (nor waited for beyond what drain waits).
  std::vector<std::shared_ptr<Work>> works;
  if (!leaving_after_error()) {
    for (const auto& group : groups) group->append_inflight_works(works);
  }
  for (const auto& group : groups) group->drain(deadline);
  for (const auto& work : works) {
    // Those a departed peer never issued fail at a deadline the departure shortened (drain
    // does not wait for them): within half a second.
    while (!work->is_completed() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  bool dropped = false;
  std::vector<std::shared_ptr<Work>> failed = failed_.take(&dropped);
  if (leaving_after_error()) return {};
  return dist_detail::UnwaitedFailures::of(rank_, failed, works, dropped);
}

bool ProcessJob::leaving_after_error() const {
  return monitor_ != nullptr && monitor_->has_departure_error();
}

void ProcessJob::add_group(const std::shared_ptr<ProcessGroupBase>& group) {
  std::vector<EarlyGaveUp> news;
  {
    std::lock_guard lock(mu_);
    groups_.push_back(group);
    std::vector<EarlyGaveUp> others;
    for (auto& n : early_gave_up_) {
      (n.name == group->name() ? news : others).push_back(std::move(n));
    }
    early_gave_up_ = std::move(others);
  }
  cv_.notify_all();
  for (const EarlyGaveUp& n : news) group->on_peer_gave_up(n.from, n.seq, n.error);
}

void ProcessJob::remove_group(const ProcessGroupBase* group) {
  std::lock_guard lock(mu_);
  std::erase_if(groups_, [&](const std::weak_ptr<ProcessGroupBase>& g) {
    auto locked = g.lock();
    return !locked || locked.get() == group;
  });
}

std::vector<std::shared_ptr<ProcessGroupBase>> ProcessJob::live_groups() {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<ProcessGroupBase>> out;
  for (auto& g : groups_) {
    if (auto locked = g.lock()) out.push_back(std::move(locked));
  }
  return out;
}

void ProcessJob::on_peer_lost(const PeerLoss& loss) {
  for (auto& group : live_groups()) group->on_peer_lost(loss);
}

void ProcessJob::on_gave_up(int from, const std::string& name, int64_t seq,
                            const std::string& error) {
  std::vector<std::shared_ptr<ProcessGroupBase>> named;
  {
    // Decided under the lock add_group takes, so that news for a group being registered is
    // either seen here or kept for add_group. (Kept news for a group this process never makes
    // stays, a few bytes.)
    std::lock_guard lock(mu_);
    for (auto& g : groups_) {
      if (auto locked = g.lock(); locked && locked->name() == name) named.push_back(locked);
    }
    if (named.empty()) early_gave_up_.push_back({from, name, seq, error});
  }
  for (auto& group : named) group->on_peer_gave_up(from, seq, error);
}

void ProcessJob::watchdog() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    lock.unlock();
    auto now = Clock::now();
    auto next = now + kWatchdogTick;
    for (auto& group : live_groups()) {
      if (auto deadline = group->check_deadlines(now)) next = std::min(next, *deadline);
    }
    lock.lock();
    cv_.wait_until(lock, std::max(next, now + std::chrono::milliseconds(1)),
                   [&] { return stopping_; });
  }
}

// ---------------------------------------------------------------------------------------------
// ProcessGroupBase

ProcessGroupBase::ProcessGroupBase(int rank, std::vector<int> global_ranks, std::string name,
                                   GroupRegistry* registry, std::shared_ptr<ProcessJob> job)
    : ProcessGroup(rank, std::move(global_ranks), std::move(name), registry),
      job_(std::move(job)) {}

ProcessGroupBase::~ProcessGroupBase() {
  if (attached_) {
    job_->remove_group(this);
    if (job_->monitor()) job_->monitor()->remove_group(name());
  }
}

void ProcessGroupBase::attach() {
  job_->add_group(shared_from_this());
  if (job_->monitor()) {
    job_->monitor()->add_group(name(), posted_, [recent = recent_, n = size()](int64_t seq) {
      return recent->encoded(seq, n);
    });
  }
  attached_ = true;
  // A peer may be gone before this group existed.
  if (job_->monitor()) {
    for (int r : global_ranks()) {
      if (auto loss = job_->monitor()->lost(r)) on_peer_lost(*loss);
    }
  }
}

std::shared_ptr<Work> ProcessGroupBase::all_reduce(const Tensor& tensor, ReduceOp op) {
  dist_detail::check_all_reduce(tensor, op);
  auto c = make_op(OpKind::AllReduce);
  set_reduce(*c, op);
  add_slot(*c, tensor, tensor, tensor.numel());
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::all_gather(const Tensor& output, const Tensor& input) {
  dist_detail::check_all_gather(output, input, size());
  dist_detail::check_pair_apart("all_gather", output, input,
                                dist_detail::InPlace::kInputInOutput, rank());
  auto c = make_op(OpKind::AllGather);
  add_slot(*c, input, output, input.numel());
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::reduce_scatter(const Tensor& output, const Tensor& input,
                                                       ReduceOp op) {
  dist_detail::check_reduce_scatter(output, input, op, size());
  dist_detail::check_pair_apart("reduce_scatter", output, input,
                                dist_detail::InPlace::kOutputInInput, rank());
  auto c = make_op(OpKind::ReduceScatter);
  set_reduce(*c, op);
  add_slot(*c, input, output, output.numel());
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::all_to_all(const Tensor& output, const Tensor& input,
                                                   const std::vector<int64_t>& output_splits,
                                                   const std::vector<int64_t>& input_splits) {
  auto layout = dist_detail::check_all_to_all(output, input, output_splits, input_splits, size());
  dist_detail::check_pair_apart("all_to_all", output, input, std::nullopt, rank());
  auto c = make_op(OpKind::AllToAll);
  c->signature.input_splits = layout.input_splits;
  c->signature.output_splits = layout.output_splits;
  // Rows this rank sends itself but does not expect from itself are a mismatch of the
  // collective, as between two ranks (the threads backend's rule), not an argument error: a
  // synchronous throw would leave the peers waiting for it. With FUNCOL_DEBUG=detail the
  // signatures show every rank the mismatch; otherwise only this rank knows, so it exchanges
  // the peers' rows as they expect (keeping zeros for itself) and its own Work fails.
  // Signed as the caller passed it (the staged rows are flat: peers were told of a row shape
  // nobody passed).
  add_slot(*c, input, output, layout.row_elems);
  const int64_t have = layout.input_splits[rank()];
  const int64_t want = layout.output_splits[rank()];
  if (have != want) {
    c->own_error = dist_detail::split_mismatch(global_rank(), have, global_rank(), want);
    const int64_t before = std::accumulate(layout.input_splits.begin(),
                                           layout.input_splits.begin() + rank(), int64_t{0});
    c->inputs.back() = resize_own_rows(input, layout.row_elems, before, have, want);
    layout.input_splits[rank()] = want;
  }
  for (int j = 0; j < size(); ++j) {
    c->send_counts.push_back(layout.input_splits[j] * layout.row_elems);
    c->recv_counts.push_back(layout.output_splits[j] * layout.row_elems);
  }
  c->send_displs = displacements(c->send_counts);
  c->recv_displs = displacements(c->recv_counts);
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::broadcast(const Tensor& tensor, int src) {
  dist_detail::check_broadcast(tensor, src, size());
  auto c = make_op(OpKind::Broadcast);
  c->root = src;
  c->signature.root = src;
  add_slot(*c, tensor, tensor, tensor.numel());
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::barrier_async() { return issue(make_op(OpKind::Barrier)); }

std::shared_ptr<Work> ProcessGroupBase::all_reduce_coalesced(const std::vector<Tensor>& tensors,
                                                             ReduceOp op) {
  dist_detail::check_all_reduce_coalesced(tensors, op);
  if (tensors.empty()) return dist_detail::empty_coalesced("all_reduce_coalesced", *this);
  auto c = make_op(OpKind::AllReduceCoalesced);
  set_reduce(*c, op);
  for (const auto& t : tensors) add_slot(*c, t, t, t.numel());
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::all_reduce_flat(
    const Tensor& output, std::shared_ptr<const std::vector<Tensor>> inputs, ReduceOp op) {
  dist_detail::check_all_reduce_flat(output, inputs.get(), op);
  if (inputs->empty()) return dist_detail::empty_coalesced("all_reduce_flat", *this);
  dist_detail::pack_flat(output, *inputs);
  auto c = make_op(OpKind::AllReduce);
  set_reduce(*c, op);
  add_slot(*c, output, output, output.numel());
  c->signature.kind = OpKind::AllReduceFlat;
  c->signature.slots.clear();
  for (const Tensor& t : *inputs) c->signature.slots.push_back({t.dtype(), t.numel()});
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::all_gather_coalesced(const std::vector<Tensor>& outputs,
                                                             const std::vector<Tensor>& inputs) {
  dist_detail::check_all_gather_coalesced(*this, outputs, inputs);
  if (inputs.empty()) return dist_detail::empty_coalesced("all_gather_coalesced", *this);
  auto c = make_op(OpKind::AllGatherCoalesced);
  for (size_t i = 0; i < inputs.size(); ++i) add_slot(*c, inputs[i], outputs[i], inputs[i].numel());
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::reduce_scatter_coalesced(const std::vector<Tensor>& outputs,
                                                                 const std::vector<Tensor>& inputs,
                                                                 ReduceOp op) {
  dist_detail::check_reduce_scatter_coalesced(*this, outputs, inputs, op);
  if (inputs.empty()) return dist_detail::empty_coalesced("reduce_scatter_coalesced", *this);
  auto c = make_op(OpKind::ReduceScatterCoalesced);
  set_reduce(*c, op);
  for (size_t i = 0; i < inputs.size(); ++i) {
    add_slot(*c, inputs[i], outputs[i], outputs[i].numel());
  }
  return issue(std::move(c));
}

std::shared_ptr<Work> ProcessGroupBase::issue(std::shared_ptr<CollectiveOp> op) {
  // A group a caller kept past destroy_process_group: its peers said goodbye and its transport
  // is gone, so the collective could only wait out the timeout and blame a peer.
  if (job_->shut_down()) {
    throw InvalidArgument(fmt::format(
        "{} on group '{}': the group was destroyed by destroy_process_group and cannot be used "
        "afterwards",
        op_kind_name(op->signature.kind), name()));
  }
  // Inputs produced by earlier collectives must be complete before the transport reads them;
  // waiting here (not on the communication thread) cannot deadlock it. Outputs are written: also
  // after the collectives still reading them. A tensor that holds a failed result still lets
  // this rank take the collective's sequence number, below (see failed_buffer_reason).
  std::string failed_buffer;
  using dist_detail::wait_or_note_failed;
  for (size_t i = 0; i < op->inputs.size(); ++i) {
    const Tensor& t = op->inputs[i];
    const bool in_place = i < op->outputs.size() && t.storage() == op->outputs[i].storage();
    wait_or_note_failed(in_place ? "tensor" : "input", failed_buffer, [&] { t.wait(); });
  }
  for (const auto& t : op->outputs) {
    if (t.storage()) {
      wait_or_note_failed("output", failed_buffer, [&] { t.storage()->wait_for_write(); });
    }
  }
  std::lock_guard issue_lock(issue_mu_);
  op->seq = issued_++;
  recent_->record(op->seq, op->signature);
  op->work = std::make_shared<Work>(
      fmt::format("{} on group '{}' (seq {})", op_kind_name(op->signature.kind), name(), op->seq));
  op->issued_at = Clock::now();
  op->deadline = op->issued_at + job_->timeout();
  for (const auto& t : op->outputs) {
    if (t.storage()) t.storage()->add_pending(op->work);
  }
  if (!failed_buffer.empty()) {
    // The transport cannot carry this rank's part: the peers learn at once that it gave up on
    // the collective (a transport cannot skip one), and the group is unusable from here on.
    // The collectives before it still in flight go on: the peers wait in those for this
    // rank's part (failing them here, as a broken group does, left the peers waiting out
    // their timeout, and this rank's results of them failed though their data moved).
    const std::string message = dist_detail::failed_buffer_message(op->work->description(),
                                                                    global_rank(), failed_buffer);
    if (PeerMonitor* monitor = size() > 1 ? job_->monitor() : nullptr) {
      monitor->tell_gave_up(global_ranks(), name(), op->seq, message);
    }
    {
      std::lock_guard lock(mu_);
      unusable_from_locked(op->seq, message);
      not_taken_part(op->seq);
    }
    on_broken(message);
    op->claim();
    fail_work(*op, std::make_exception_ptr(CommError(message)));
    return op->work;
  }
  if (size() == 1) {
    posted_->store(op->seq + 1);
    if (op->own_error.empty()) run_single_rank(*op);
    op->claim();
    finish_work(*op);
    return op->work;
  }
  {
    std::lock_guard lock(mu_);
    if (gave_up_ && op->seq == gave_up_->seq) {
      // The peers gave up on this very collective before this rank issued it.
      op->claim();
      fail_work(*op, std::make_exception_ptr(CommError(late_message(*op))));
      return op->work;
    }
    if (broken_ || op->seq >= unusable_from_) {
      op->claim();
      fail_work(*op, std::make_exception_ptr(
                         CommError(fmt::format("{}: group '{}' is unusable after an earlier "
                                               "failure: {}",
                                               op->work->description(), name(),
                                               broken_ ? *broken_ : *unusable_why_))));
      return op->work;
    }
    inflight_.push_back(op);
    posted_->store(op->seq + 1);
  }
  submit(op);
  return op->work;
}

void ProcessGroupBase::run_single_rank(CollectiveOp& op) {
  // One rank: gathers, scatters and all-to-alls are copies; reductions of one value (avg
  // included) leave it unchanged.
  switch (op.kind) {
    case OpKind::AllGather:
    case OpKind::ReduceScatter:
    case OpKind::AllToAll:
    case OpKind::AllGatherCoalesced:
    case OpKind::ReduceScatterCoalesced:
      for (size_t i = 0; i < op.inputs.size(); ++i) {
        if (op.inputs[i].nbytes() > 0) {
          std::memmove(op.outputs[i].raw_data_ptr(), op.inputs[i].raw_data_ptr(),
                       op.inputs[i].nbytes());
        }
      }
      break;
    default:
      break;
  }
}

void ProcessGroupBase::remove_inflight(const CollectiveOp* op) {
  std::lock_guard lock(mu_);
  // Usually the oldest (a group's collectives complete in issue order): found at once and
  // erased from the deque's front, where a scan of them all cost O(in flight) per completion.
  auto it = std::find_if(inflight_.begin(), inflight_.end(),
                         [&](const auto& p) { return p.get() == op; });
  if (it != inflight_.end()) inflight_.erase(it);
}

void ProcessGroupBase::append_inflight_works(std::vector<std::shared_ptr<Work>>& works) const {
  std::lock_guard lock(mu_);
  for (const auto& op : inflight_) {
    if (!op->work->is_completed()) works.push_back(op->work);
  }
}

void ProcessGroupBase::drain(std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    {
      std::lock_guard lock(mu_);
      // In issue order: from the first at unusable_from_ on, none can complete.
      if (inflight_.empty() || broken_ || inflight_.front()->seq >= unusable_from_) return;
    }
    if (std::chrono::steady_clock::now() >= deadline) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void ProcessGroupBase::complete(const std::shared_ptr<CollectiveOp>& op) {
  remove_inflight(op.get());
  if (op->claim()) finish_work(*op);
}

void ProcessGroupBase::not_taken_part(int64_t seq) {
  int64_t posted = posted_->load();
  while (seq < posted && !posted_->compare_exchange_weak(posted, seq)) {
  }
}

void ProcessGroupBase::mark_broken(const std::string& reason) {
  std::deque<std::shared_ptr<CollectiveOp>> others;
  {
    std::lock_guard lock(mu_);
    if (!broken_) broken_ = reason;
    others.swap(inflight_);
  }
  on_broken(reason);
  // Everything still in flight on this group would wait on the same broken transport.
  for (auto& other : others) {
    if (other->claim()) {
      fail_claimed(*other, std::make_exception_ptr(failed_earlier(*other, reason)));
    }
  }
}

void ProcessGroupBase::finish_work(const CollectiveOp& op) {
  if (op.own_error.empty()) return op.work->finish();
  fail_work(op, std::make_exception_ptr(
                    CommError(fmt::format("{}: {}", op.work->description(), op.own_error))));
}

void ProcessGroupBase::fail_work(const CollectiveOp& op, std::exception_ptr error) {
  op.work->fail(std::move(error));
  job_->note_failed(op.work);
}

void ProcessGroupBase::fail_claimed(const CollectiveOp& op, std::exception_ptr error) {
  fail_work(op, std::move(error));
  on_failed(op);
}

CommError ProcessGroupBase::failed_earlier(const CollectiveOp& op,
                                          const std::string& reason) const {
  return CommError(
      fmt::format("{}: group '{}' failed earlier: {}", op.work->description(), name(), reason));
}

void ProcessGroupBase::fail_op(const std::shared_ptr<CollectiveOp>& op, const std::string& message,
                               bool claimed) {
  remove_inflight(op.get());
  // The group is marked broken before the op's Work fails: a caller woken by that failure may
  // issue its next collective at once, which must then find the group unusable (not be taken
  // for one in flight and fail as "failed earlier").
  const bool mine = claimed || op->claim();
  mark_broken(message);
  if (mine) fail_claimed(*op, std::make_exception_ptr(CommError(message)));
}

void ProcessGroupBase::fail_unposted(const std::shared_ptr<CollectiveOp>& op,
                                     const std::string& message) {
  {
    // Broken first, under mu_, where issue() counts a collective only while the group is not
    // broken: a collective issued meanwhile on another thread cannot raise posted_ again.
    std::lock_guard lock(mu_);
    if (!broken_) broken_ = message;
    not_taken_part(op->seq);
  }
  fail_op(op, message);
}

void ProcessGroupBase::fail_mismatch(const std::shared_ptr<CollectiveOp>& op,
                                     const std::string& message) {
  remove_inflight(op.get());
  if (op->claim()) fail_work(*op, std::make_exception_ptr(CommError(message)));
}

void ProcessGroupBase::unusable_from_locked(int64_t seq, const std::string& why) {
  if (seq >= unusable_from_) return;  // an earlier limit stands, with its reason
  unusable_from_ = seq;
  unusable_why_ = why;
}

std::optional<std::string> ProcessGroupBase::broken() const {
  std::lock_guard lock(mu_);
  return broken_ ? broken_ : unusable_why_;
}

Clock::time_point ProcessGroupBase::deadline_of(const CollectiveOp& op) const {
  std::lock_guard lock(mu_);
  return op.deadline;
}

bool ProcessGroupBase::issued_before_leaving(const PeerLoss& loss, int64_t seq) const {
  if (!loss.clean) return false;  // it died: whether it got there is unknown
  const auto issued = loss.issued.find(name());
  return issued != loss.issued.end() && issued->second > seq;
}

std::string ProcessGroupBase::loss_text(const PeerLoss& loss, int64_t seq) const {
  const bool never_joined = loss.clean && !issued_before_leaving(loss, seq);
  return loss.describe() + (never_joined ? " before joining" : "");
}

std::string ProcessGroupBase::local_failure_message(const CollectiveOp& op,
                                                    const std::string& what) const {
  return fmt::format("{}: {}: {}", op.work->description(), job_->backend(), what);
}

std::string ProcessGroupBase::failure_message(const CollectiveOp& op,
                                              const std::string& what) const {
  std::string msg = local_failure_message(op, what);
  if (auto* monitor = job_->monitor()) {
    // A dead peer's sockets close at once, so its loss is known within moments of the
    // transport's error; wait briefly so the message can name it.
    // Members that left after issuing the collective did their part (a departure drains what
    // it issued first): not named, as in a departure's own error.
    auto losses = monitor->wait_for_loss(global_ranks(), std::chrono::milliseconds(500));
    std::vector<int> missing;
    for (const auto& loss : losses) {
      if (issued_before_leaving(loss, op.seq)) continue;
      msg += "; " + loss_text(loss, op.seq);
      missing.push_back(loss.rank);
    }
    std::sort(missing.begin(), missing.end());
    if (!missing.empty()) {
      msg += "; missing ranks " + dist_detail::format_ranks(missing);
    } else {
      // Nobody to blame (a transport error with every member there, or one that left after
      // issuing it): ranks that issued different collectives as this seq (unchecked without
      // FUNCOL_DEBUG=detail) are the likely cause. Gloo's "Connection closed by peer" when a
      // member that completed its own part left was all such a rank said. (A departed member
      // answers from its goodbye.)
      std::vector<int> peers;
      for (int r : global_ranks()) {
        if (r != global_rank()) peers.push_back(r);
      }
      std::vector<std::string> theirs;
      monitor->query_progress(name(), peers, kProgressQueryWait, op.seq, &theirs);
      msg += difference_note(op, peers, theirs);
    }
  }
  return msg;
}

std::string ProcessGroupBase::difference_note(const CollectiveOp& op,
                                              const std::vector<int>& peers,
                                              const std::vector<std::string>& theirs) const {
  // compare_answers takes one answer per other member, in group order ("" for none).
  std::vector<std::string> answers;
  for (int g = 0; g < size(); ++g) {
    if (g == rank()) continue;
    const auto it = std::find(peers.begin(), peers.end(), global_ranks()[static_cast<size_t>(g)]);
    const auto i = static_cast<size_t>(it - peers.begin());
    answers.push_back(it != peers.end() && i < theirs.size() ? theirs[i] : std::string());
  }
  const auto difference = compare_answers(op.signature, rank(), answers, global_ranks());
  if (!difference) return {};
  constexpr std::string_view kDetailNote =
      "FUNCOL_DEBUG=detail compares every collective before it runs";
  return difference->splits
             ? fmt::format("; the ranks issued seq {} with {} ({})", op.seq, difference->what,
                           kDetailNote)
             : fmt::format("; the ranks issued different collectives as seq {}: {} ({})", op.seq,
                           difference->what, kDetailNote);
}

int ProcessGroupBase::agree_on_split(const std::vector<std::vector<int>>& rank_lists,
                                     const std::string& new_name) {
  const int split = splits_++;
  dist_detail::agree_on_split(*this, split, rank_lists, new_name);
  return split;
}

std::optional<std::string> ProcessGroupBase::check_gathered(const CollectiveOp& op,
                                                            const std::vector<char>& all) const {
  const size_t bytes = signature_bytes(size());
  FUNCOL_CHECK(all.size() == bytes * size(), "gathered signatures have the wrong size");
  std::vector<OpSignature> sigs;
  for (int r = 0; r < size(); ++r) sigs.push_back(decode_signature(all.data() + r * bytes, size()));
  return check_signatures(sigs, global_ranks(), op.work->description());
}

std::string ProcessGroupBase::timeout_message(const CollectiveOp& op) {
  // The timeout in force, as the threads backend says it (the time measured since the issue
  // drifts past it on a loaded machine: "3.36 s" for FUNCOL_TIMEOUT=3).
  std::string msg =
      fmt::format("{}: timed out after {:g} s", op.work->description(),
                  std::chrono::duration<double>(job_->timeout()).count());
  PeerMonitor* monitor = job_->monitor();
  if (monitor == nullptr) return msg;
  std::vector<int> peers;
  for (int r : global_ranks()) {
    if (r != global_rank()) peers.push_back(r);
  }
  // Ask the peers how far they got on this group: those that never issued this seq are the
  // ranks that did not arrive. And what they issued as this seq: without FUNCOL_DEBUG=detail
  // nothing else compares them.
  std::vector<std::string> theirs;
  auto progress = monitor->query_progress(name(), peers, kProgressQueryWait, op.seq, &theirs);
  std::vector<int> missing, silent;
  std::vector<std::string> losses;
  for (size_t i = 0; i < peers.size(); ++i) {
    if (auto loss = monitor->lost(peers[i])) {
      if (!issued_before_leaving(*loss, op.seq)) missing.push_back(peers[i]);
      losses.push_back(loss->describe());
    } else if (progress[i] == -1) {
      silent.push_back(peers[i]);
    } else if (progress[i] <= op.seq) {
      missing.push_back(peers[i]);
    }
  }
  // A rank that does not answer (its process stopped, or stuck outside funcol) is counted
  // missing: whether or not it issued this collective, it is not taking part.
  missing.insert(missing.end(), silent.begin(), silent.end());
  std::sort(missing.begin(), missing.end());
  if (!missing.empty()) msg += "; missing ranks " + dist_detail::format_ranks(missing);
  for (const auto& l : losses) msg += "; " + l;
  if (!silent.empty()) msg += silent_note(silent, kProgressQueryWait);
  if (missing.empty()) {
    // What this rank and the peers that answered issued (a departed one answers from its
    // goodbye), compared as FUNCOL_DEBUG=detail would have compared them.
    const std::string difference = difference_note(op, peers, theirs);
    msg += difference.empty()
               ? fmt::format("; every rank issued it but {} did not complete it", job_->backend())
               : difference;
  }
  return msg;
}

void ProcessGroupBase::RecentOps::record(int64_t seq, const OpSignature& signature) {
  std::lock_guard lock(mu_);
  ring_[static_cast<size_t>(seq) % kKept] = {seq, signature};
}

std::string ProcessGroupBase::RecentOps::encoded(int64_t seq, int group_size) {
  std::lock_guard lock(mu_);
  if (seq < 0) return {};
  const auto& [at, signature] = ring_[static_cast<size_t>(seq) % kKept];
  if (at != seq) return {};
  const std::vector<char> bytes = encode_signature(signature, group_size);
  return std::string(bytes.begin(), bytes.end());
}

std::optional<Clock::time_point> ProcessGroupBase::check_deadlines(Clock::time_point now) {
  std::shared_ptr<CollectiveOp> expired;
  std::string loss;
  std::optional<Clock::time_point> earliest;
  {
    std::lock_guard lock(mu_);
    // The first open collective decides: inflight_ is in issue order and its deadlines never
    // decrease along it (issued_at plus the job's timeout, taken under issue_mu_; a peer's
    // death lowers each to min(deadline, a later now + kDeathGrace)). Scanning every one cost
    // O(in flight) per watchdog tick, O(N^2) over a long run with N in flight.
    for (auto& op : inflight_) {
      if (op->done()) continue;
      if (op->deadline <= now) {
        expired = op;
        loss = op->loss;
      } else {
        earliest = op->deadline;
      }
      break;
    }
  }
  if (expired) {
    if (!loss.empty()) {
      fail_op(expired, loss_message(*expired, loss));
    } else if (expired->claim()) {
      // Claimed before the peers are asked (up to kProgressQueryWait) and told: a transport
      // that completes it meanwhile finds it failed. (It succeeded here while the peers heard
      // that this rank gave up on it, and this rank's group broke over a collective it saw
      // complete.)
      const std::string message = timeout_message(*expired);
      // A peer that is only late learns at once, when it issues this, that nobody waits any
      // more (its transport could otherwise pair it with what this rank's peers still run).
      if (PeerMonitor* monitor = job_->monitor()) {
        monitor->tell_gave_up(global_ranks(), name(), expired->seq, message);
      }
      fail_op(expired, message, /*claimed=*/true);
    }
  }
  return earliest;
}

std::string ProcessGroupBase::gave_up_message(const CollectiveOp& op, const GaveUp& gave_up) const {
  const std::string& desc = op.work->description();
  // The peer's error names the same collective unless the two ranks issued different ones; it
  // is the peer's view ("timed out ...; missing ranks [this rank]" for a rank that was stopped
  // with the collective in flight), so it says whose it is, unless it begins with the peer
  // ("rank 2 could not take part: ...").
  std::string_view error = gave_up.error;
  if (error.starts_with(desc) && error.substr(desc.size()).starts_with(": ")) {
    error.remove_prefix(desc.size() + 2);
  }
  if (error.starts_with(fmt::format("rank {} ", gave_up.from))) {
    return fmt::format("{}: {}", desc, error);
  }
  return fmt::format("{}: rank {} gave up on it: {}", desc, gave_up.from, error);
}

std::string ProcessGroupBase::late_message(const CollectiveOp& op) const {
  return gave_up_message(op, *gave_up_) +
         fmt::format("; rank {} issued it only after the others had given up on it",
                     global_rank());
}

void ProcessGroupBase::on_peer_gave_up(int from, int64_t seq, const std::string& error) {
  const auto& members = global_ranks();
  if (std::find(members.begin(), members.end(), from) == members.end()) return;
  std::vector<std::shared_ptr<CollectiveOp>> victims;
  const GaveUp news{from, seq, error};  // gave_up_ may move to a lower seq once mu_ is released
  {
    std::lock_guard lock(mu_);
    // The lowest seq decides (a rank gives up on one collective and everything after it): news
    // of a later one says nothing new, but news of an earlier one, from another rank, that
    // comes second does (this rank would run it with peers that left it).
    if (gave_up_ && gave_up_->seq <= seq) return;
    gave_up_ = news;
    // What this rank issued before `seq`, or issues still, the peer does its part in: those
    // complete (a peer whose input held a failure gives up on that collective while its
    // earlier ones are in flight; this rank may not have issued them yet).
    unusable_from_locked(seq, error);
    for (auto& op : inflight_) {
      if (op->seq >= seq && !op->done()) victims.push_back(op);
    }
    std::erase_if(inflight_, [&](const auto& op) {
      return std::find(victims.begin(), victims.end(), op) != victims.end();
    });
  }
  on_broken(error);
  for (auto& op : victims) {
    if (!op->claim()) continue;
    fail_claimed(*op, std::make_exception_ptr(op->seq == seq
                                                  ? CommError(gave_up_message(*op, news))
                                                  : failed_earlier(*op, error)));
  }
}

void ProcessGroupBase::on_peer_lost(const PeerLoss& loss) {
  const auto& members = global_ranks();
  if (std::find(members.begin(), members.end(), loss.rank) == members.end()) return;
  int64_t peer_issued = -1;  // collectives the peer issued here; -1: unknown (it died)
  if (loss.clean) {
    auto it = loss.issued.find(name());
    peer_issued = it == loss.issued.end() ? 0 : it->second;
  }
  const std::string missing = "; missing ranks " + dist_detail::format_ranks({loss.rank});
  const std::string lost = loss.describe() + missing;  // why the group is unusable from now on
  // What a collective this loss fails says when the monitor knows no other loss.
  const std::string fails = loss.describe() + (loss.clean ? " before joining" : "") + missing;
  // A departure fails what the peer never issued at once only when a member's death is known
  // already (the death is named with it); else after kDepartureWait, so that a death read
  // just after the goodbye is named too.
  bool death_known = false;
  if (loss.clean && job_->monitor() != nullptr) {
    for (int r : members) {
      const auto other = job_->monitor()->lost(r);
      death_known = death_known || (other && !other->clean);
    }
  }
  std::vector<std::shared_ptr<CollectiveOp>> victims;
  bool affected = !loss.clean;
  {
    std::lock_guard lock(mu_);
    // Every later collective on this group would wait for the peer forever; after a clean
    // departure, every one from the first it did not issue (those before still complete).
    if (!loss.clean) {
      if (!broken_) broken_ = lost;
    } else {
      unusable_from_locked(peer_issued, lost);
    }
    for (auto& op : inflight_) {
      if (op->done()) continue;
      // A peer that left cleanly finished what it issued; only what it never issued is lost.
      // One that died may have finished its part before dying: fail soon unless it completes.
      if (loss.clean && op->seq < peer_issued) continue;
      affected = true;
      if (loss.clean && death_known) {
        victims.push_back(op);
        continue;
      }
      // The first loss stays the fallback; the failure names every loss known by then.
      if (op->loss.empty()) op->loss = fails;
      op->deadline = std::min(op->deadline, Clock::now() + (loss.clean ? kDepartureWait
                                                                        : kDeathGrace));
    }
    std::erase_if(inflight_, [&](const auto& op) {
      return std::find(victims.begin(), victims.end(), op) != victims.end();
    });
  }
  for (auto& op : victims) {
    if (op->claim()) {
      fail_claimed(*op, std::make_exception_ptr(CommError(loss_message(*op, fails))));
    }
  }
  // A clean goodbye with nothing of ours waiting on it leaves the transport healthy.
  if (affected) on_broken(lost);
}

std::string ProcessGroupBase::loss_message(const CollectiveOp& op,
                                           const std::string& first) const {
  std::vector<PeerLoss> losses;
  if (PeerMonitor* monitor = job_->monitor()) {
    losses = monitor->wait_for_loss(global_ranks(), std::chrono::milliseconds(0));
  }
  std::string msg = op.work->description() + ":";
  std::vector<int> missing;
  for (const PeerLoss& l : losses) {
    if (issued_before_leaving(l, op.seq)) continue;  // it did its part
    msg += fmt::format("{} {}", missing.empty() ? "" : ";", loss_text(l, op.seq));
    missing.push_back(l.rank);
  }
  if (missing.empty()) return fmt::format("{}: {}", op.work->description(), first);
  std::sort(missing.begin(), missing.end());
  return msg + "; missing ranks " + dist_detail::format_ranks(missing);
}

}  // namespace funcol::process
