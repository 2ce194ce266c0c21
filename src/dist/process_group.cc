// ProcessGroup's backend-independent parts: coalesced defaults, the group registry, new_group.
#include "funcol/dist/process_group.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>

#include "checks.h"
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"

namespace funcol {

namespace {

using dist_detail::format_ranks;

// A Work that waits for inner Works, then runs `then` (copying results out of a staging
// buffer) exactly once, in whichever thread waits first. Until someone waits it reports
// incomplete, so a Storage it is attached to stays pending until the copy is done.
class ThenWork final : public Work {
 public:
  ThenWork(std::string description, std::vector<std::shared_ptr<Work>> inner,
           std::function<void()> then)
      : Work(std::move(description)), inner_(std::move(inner)), then_(std::move(then)) {}

  void wait() override {
    {
      std::lock_guard<std::mutex> lock(run_mu_);
      run_locked(/*block=*/true);
    }
    // Thrown here, this Work's failure is every failed inner Work's: each counts it seen (a
    // poll() that found them failed did not). No writes to failed_inner_ after run_locked.
    for (const auto& w : failed_inner_) w->set_failure_seen();
    Work::wait();
  }

  // Never blocks: once every inner Work polls complete it runs `then` itself (bounded copies),
  // so that polling is_ready() on an output sees the collective end, or fail within the
  // timeout, without a wait() (it never did: a loop on is_ready() spun for ever).
  bool poll() override {
    if (is_completed()) return true;
    std::unique_lock<std::mutex> lock(run_mu_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    for (const auto& w : inner_) {
      if (!w->poll()) return false;
    }
    run_locked(/*block=*/false);
    return true;
  }

 private:
  // Waits for the inner Works (`block`; else they are complete), then runs `then` and finishes
  // this Work, or fails it with the first inner failure, once. Only wait() counts the inner
  // failures seen: a rank that polls the result and drops it is warned of them at its end.
  void run_locked(bool block) {
    if (is_completed()) return;
    std::exception_ptr error;
    for (auto& w : inner_) {
      if (block) {
        try {
          w->wait();
        } catch (...) {
          // Read below, as a polled one's.
        }
      }
      if (w->failed()) {
        failed_inner_.push_back(w);
        if (!error) error = w->exception();
      }
    }
    if (!error) {
      try {
        then_();
      } catch (...) {
        error = std::current_exception();
      }
    }
    inner_.clear();
    then_ = nullptr;
    if (error) {
      fail(error);
    } else {
      finish();
    }
  }

  std::mutex run_mu_;
  std::vector<std::shared_ptr<Work>> inner_;
  std::vector<std::shared_ptr<Work>> failed_inner_;  // written once, by run_locked
  std::function<void()> then_;
};

// Indices of `dtypes` grouped by dtype, groups in order of first appearance (equal on every
// rank, since every rank passes the same list).
std::vector<std::vector<size_t>> group_by_dtype(const std::vector<DType>& dtypes) {
  std::vector<std::vector<size_t>> groups;
  std::vector<DType> keys;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    auto it = std::find(keys.begin(), keys.end(), dtypes[i]);
    if (it == keys.end()) {
      keys.push_back(dtypes[i]);
      groups.push_back({i});
    } else {
      groups[it - keys.begin()].push_back(i);
    }
  }
  return groups;
}

char* raw_bytes(const Tensor& t) { return static_cast<char*>(t.raw_data_ptr()); }

// Where a result is copied to. Weak: the Work is attached to this storage, so a strong
// reference would be a cycle that leaks a dropped, never-waited result.
struct OutRef {
  std::weak_ptr<Storage> storage;
  size_t offset = 0;  // bytes
  size_t nbytes = 0;

  explicit OutRef(const Tensor& t)
      : storage(t.storage()), offset(t.storage_offset() * t.itemsize()), nbytes(t.nbytes()) {}
  // The destination, or null when the tensor is gone (nobody can read it any more).
  char* lock(std::shared_ptr<Storage>& hold) const {
    hold = storage.lock();
    return hold ? static_cast<char*>(hold->raw()) + offset : nullptr;
  }
};

std::vector<OutRef> out_refs(const std::vector<Tensor>& tensors) {
  std::vector<OutRef> refs;
  for (const Tensor& t : tensors) refs.emplace_back(t);
  return refs;
}

// Copies `nbytes` of t's data (waiting for it first) to dst.
void copy_in(char* dst, const Tensor& t) {
  if (t.numel() > 0) std::memcpy(dst, t.const_data_ptr(), t.nbytes());
}

std::shared_ptr<Work> attach(std::shared_ptr<Work> work, const std::vector<Tensor>& outputs) {
  for (const Tensor& t : outputs) {
    if (t.storage()) t.storage()->add_pending(work);
  }
  return work;
}

}  // namespace

// Default coalesced forms: stage each dtype's tensors in one flat buffer and run one primitive
// per dtype (one sequence number when all tensors share a dtype, as bucketing produces).
// Backends with native multi-buffer collectives (threads) override these and copy nothing.
std::shared_ptr<Work> ProcessGroup::all_reduce_coalesced(const std::vector<Tensor>& tensors,
                                                         ReduceOp op) {
  dist_detail::check_all_reduce_coalesced(tensors, op);
  return staged_all_reduce("all_reduce_coalesced", tensors, tensors, op);
}

// Both all_reduce coalesced defaults: inputs[i] packed into its dtype's flat buffer, one
// all_reduce per dtype, then the results copied to outputs[i] (the same tensors in place).
std::shared_ptr<Work> ProcessGroup::staged_all_reduce(std::string_view what,
                                                      const std::vector<Tensor>& outputs,
                                                      const std::vector<Tensor>& inputs,
                                                      ReduceOp op) {
  if (inputs.empty()) return dist_detail::empty_coalesced(what, *this);
  std::vector<DType> dtypes;
  for (const Tensor& t : inputs) dtypes.push_back(t.dtype());
  std::vector<std::shared_ptr<Work>> inner;
  std::vector<std::function<void()>> copies;
  for (const auto& idx : group_by_dtype(dtypes)) {
    int64_t total = 0;
    for (size_t i : idx) total += inputs[i].numel();
    Tensor flat = Tensor::empty({total}, inputs[idx[0]].dtype());
    size_t isz = flat.itemsize();
    int64_t off = 0;
    for (size_t i : idx) {
      copy_in(raw_bytes(flat) + off * isz, inputs[i]);
      off += inputs[i].numel();
    }
    inner.push_back(all_reduce(flat, op));
    copies.push_back([flat, idx, outs = out_refs(outputs)]() {
      size_t o = 0;
      for (size_t i : idx) {
        std::shared_ptr<Storage> hold;
        char* dst = outs[i].lock(hold);
        if (dst && outs[i].nbytes > 0) std::memcpy(dst, raw_bytes(flat) + o, outs[i].nbytes);
        o += outs[i].nbytes;
      }
    });
  }
  auto work = std::make_shared<ThenWork>(fmt::format("{} on group '{}'", what, name()),
                                         std::move(inner), [copies = std::move(copies)]() {
                                           for (auto& c : copies) c();
                                         });
  return attach(std::move(work), outputs);
}

int64_t ProcessGroup::all_gather_coalesced_min_bytes() const {
  return fuses_coalesced() ? 0 : std::numeric_limits<int64_t>::max();
}

std::shared_ptr<Work> ProcessGroup::all_reduce_coalesced_into(const std::vector<Tensor>& outputs,
                                                              const std::vector<Tensor>& inputs,
                                                              ReduceOp op) {
  dist_detail::check_all_reduce_into(outputs, inputs, op);
  // The results are written when the reduction finishes: an output still being written by an
  // earlier collective (or still read by one) must be done first.
  for (const Tensor& t : outputs) {
    if (t.storage()) t.storage()->wait_for_write();
  }
  return staged_all_reduce("all_reduce_coalesced_into", outputs, inputs, op);
}

std::shared_ptr<Work> ProcessGroup::all_reduce_flat(
    const Tensor& output, std::shared_ptr<const std::vector<Tensor>> inputs, ReduceOp op) {
  dist_detail::check_all_reduce_flat(output, inputs.get(), op);
  if (inputs->empty()) return dist_detail::empty_coalesced("all_reduce_flat", *this);
  // The output is the staging buffer: the inputs are packed into it and it is reduced in place.
  dist_detail::pack_flat(output, *inputs);
  return all_reduce(output, op);
}

void dist_detail::pack_flat(const Tensor& output, const std::vector<Tensor>& inputs) {
  output.storage()->wait_for_write();
  const size_t isz = output.itemsize();
  int64_t off = 0;
  for (const Tensor& t : inputs) {
    copy_in(raw_bytes(output) + off * isz, t);
    off += t.numel();
  }
}

namespace {

// The stretches of a flat collective's output that hold each input's result, back to back:
// `times` times the input's elements, or 1/`parts` of them. Pending inputs are waited first, as
// all_reduce_flat's.
std::vector<Tensor> flat_output_views(const Tensor& output, const std::vector<Tensor>& inputs,
                                      int64_t times, int64_t parts) {
  std::vector<Tensor> outputs;
  outputs.reserve(inputs.size());
  int64_t off = 0;
  for (const Tensor& t : inputs) {
    t.wait();
    const int64_t n = t.numel() * times / parts;
    outputs.push_back(output.narrow(0, off, n));
    off += n;
  }
  return outputs;
}

}  // namespace

std::shared_ptr<Work> ProcessGroup::all_gather_flat(
    const Tensor& output, std::shared_ptr<const std::vector<Tensor>> inputs) {
  dist_detail::check_all_gather_flat(*this, output, inputs.get());
  if (inputs->empty()) return dist_detail::empty_coalesced("all_gather_flat", *this);
  return all_gather_coalesced(flat_output_views(output, *inputs, size(), 1), *inputs);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_flat(
    const Tensor& output, std::shared_ptr<const std::vector<Tensor>> inputs, ReduceOp op) {
  dist_detail::check_reduce_scatter_flat(*this, output, inputs.get(), op);
  if (inputs->empty()) return dist_detail::empty_coalesced("reduce_scatter_flat", *this);
  return reduce_scatter_coalesced(flat_output_views(output, *inputs, 1, size()), *inputs, op);
}

std::shared_ptr<Work> ProcessGroup::all_gather_coalesced(const std::vector<Tensor>& outputs,
                                                         const std::vector<Tensor>& inputs) {
  dist_detail::check_all_gather_coalesced(*this, outputs, inputs);
  if (inputs.empty()) return dist_detail::empty_coalesced("all_gather_coalesced", *this);
  std::vector<DType> dtypes;
  for (const Tensor& t : inputs) dtypes.push_back(t.dtype());
  std::vector<std::shared_ptr<Work>> inner;
  std::vector<std::function<void()>> copies;
  const int n = size();
  for (const auto& idx : group_by_dtype(dtypes)) {
    int64_t total = 0;
    for (size_t i : idx) total += inputs[i].numel();
    DType dtype = inputs[idx[0]].dtype();
    Tensor flat_in = Tensor::empty({total}, dtype);
    Tensor flat_out = Tensor::empty({total * n}, dtype);
    size_t isz = flat_in.itemsize();
    int64_t off = 0;
    for (size_t i : idx) {
      copy_in(raw_bytes(flat_in) + off * isz, inputs[i]);
      off += inputs[i].numel();
    }
    inner.push_back(all_gather(flat_out, flat_in));
    // flat_out block j = rank j's inputs back to back; output i block j = rank j's input i.
    copies.push_back([flat_out, idx, total, n, isz, outs = out_refs(outputs)]() {
      for (int j = 0; j < n; ++j) {
        size_t o = 0;  // bytes into rank j's block
        for (size_t i : idx) {
          size_t m = outs[i].nbytes / n;  // bytes of one rank's input i
          std::shared_ptr<Storage> hold;
          char* dst = outs[i].lock(hold);
          if (dst && m > 0) std::memcpy(dst + j * m, raw_bytes(flat_out) + j * total * isz + o, m);
          o += m;
        }
      }
    });
  }
  auto work = std::make_shared<ThenWork>(
      fmt::format("all_gather_coalesced on group '{}'", name()), std::move(inner),
      [copies = std::move(copies)]() {
        for (auto& c : copies) c();
      });
  return attach(std::move(work), outputs);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_coalesced(const std::vector<Tensor>& outputs,
                                                             const std::vector<Tensor>& inputs,
                                                             ReduceOp op) {
  dist_detail::check_reduce_scatter_coalesced(*this, outputs, inputs, op);
  if (inputs.empty()) return dist_detail::empty_coalesced("reduce_scatter_coalesced", *this);
  std::vector<DType> dtypes;
  for (const Tensor& t : inputs) dtypes.push_back(t.dtype());
  std::vector<std::shared_ptr<Work>> inner;
  std::vector<std::function<void()>> copies;
  const int n = size();
  for (const auto& idx : group_by_dtype(dtypes)) {
    int64_t total = 0;  // elements of this rank's outputs
    for (size_t i : idx) total += outputs[i].numel();
    DType dtype = inputs[idx[0]].dtype();
    Tensor flat_in = Tensor::empty({total * n}, dtype);
    Tensor flat_out = Tensor::empty({total}, dtype);
    size_t isz = flat_in.itemsize();
    // flat_in block j = block j of every input, back to back.
    int64_t o = 0;
    for (size_t i : idx) {
      int64_t m = outputs[i].numel();
      if (m > 0) {
        const char* src = static_cast<const char*>(inputs[i].const_data_ptr());
        for (int j = 0; j < n; ++j) {
          std::memcpy(raw_bytes(flat_in) + (j * total + o) * isz, src + j * m * isz, m * isz);
        }
      }
      o += m;
    }
    inner.push_back(reduce_scatter(flat_out, flat_in, op));
    copies.push_back([flat_out, idx, outs = out_refs(outputs)]() {
      size_t o = 0;
      for (size_t i : idx) {
        std::shared_ptr<Storage> hold;
        char* dst = outs[i].lock(hold);
        if (dst && outs[i].nbytes > 0) std::memcpy(dst, raw_bytes(flat_out) + o, outs[i].nbytes);
        o += outs[i].nbytes;
      }
    });
  }
  auto work = std::make_shared<ThenWork>(
      fmt::format("reduce_scatter_coalesced on group '{}'", name()), std::move(inner),
      [copies = std::move(copies)]() {
        for (auto& c : copies) c();
      });
  return attach(std::move(work), outputs);
}

ProcessGroup::ProcessGroup(int rank, std::vector<int> global_ranks, std::string name,
                           GroupRegistry* registry)
    : rank_(rank),
      global_ranks_(std::move(global_ranks)),
      name_(std::move(name)),
      registry_(registry),
      registry_alive_(registry != nullptr ? registry->alive_ : nullptr),
      instance_id_([] {
        static std::atomic<uint64_t> next{1};
        return next.fetch_add(1, std::memory_order_relaxed);
      }()) {}

GroupRegistry& ProcessGroup::registry() const {
  if (registry_alive_.expired()) {
    throw InvalidArgument(fmt::format(
        "group '{}' is used after its world ended (run_local returned, or "
        "destroy_process_group): it has no registry to make or find groups in any more",
        name_));
  }
  return *registry_;
}

// ---- GroupRegistry ----

std::shared_ptr<ProcessGroup> GroupRegistry::get(const std::string& name) const {
  if (auto g = find(name)) return g;
  throw InvalidArgument(
      fmt::format("unknown group '{}' (known groups: {})", name, fmt::join(names(), ", ")));
}

std::shared_ptr<ProcessGroup> GroupRegistry::find(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return find_locked(name);
}

std::shared_ptr<ProcessGroup> GroupRegistry::find_locked(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : groups_[it->second];
}

void GroupRegistry::add(std::shared_ptr<ProcessGroup> group) {
  FUNCOL_CHECK(group != nullptr, "GroupRegistry::add(null)");
  std::lock_guard<std::mutex> lock(mu_);
  if (auto existing = find_locked(group->name())) {
    if (existing == group) return;
    throw InvalidArgument(fmt::format("group name '{}' is already registered (ranks {})",
                                      group->name(), format_ranks(existing->global_ranks())));
  }
  by_name_.emplace(group->name(), groups_.size());
  by_ranks_.emplace(group->global_ranks(), groups_.size());  // keeps the first
  groups_.push_back(std::move(group));
}

std::vector<std::string> GroupRegistry::names() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& g : groups_) out.push_back(g->name());
  return out;
}

std::shared_ptr<ProcessGroup> GroupRegistry::find_by_ranks(
    const std::vector<int>& global_ranks) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_ranks_.find(global_ranks);
  return it == by_ranks_.end() ? nullptr : groups_[it->second];
}

std::string GroupRegistry::next_group_name() {
  std::lock_guard<std::mutex> lock(mu_);
  return "group" + std::to_string(next_id_++);
}

int64_t GroupRegistry::next_group_id() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_id_;
}

void GroupRegistry::skip_group_ids_through(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  next_id_ = std::max(next_id_, id + 1);
}

bool GroupRegistry::resolved_partition(const std::vector<std::vector<int>>& lists) const {
  std::lock_guard<std::mutex> lock(mu_);
  return resolved_partitions_.count(lists) > 0 ||
         std::all_of(lists.begin(), lists.end(),
                     [&](const std::vector<int>& list) { return world_split_lists_.count(list); });
}

void GroupRegistry::add_world_split(const std::vector<std::vector<int>>& lists) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::vector<int>& list : lists) {
    // Only a list in order: its group's ranks are in the order given, and a group spec finds
    // groups by sorted ranks, so the members of a group of [1, 0] would not find it while the
    // other ranks, finding theirs, took the shortcut alone.
    if (std::is_sorted(list.begin(), list.end())) world_split_lists_.insert(list);
  }
}

void GroupRegistry::add_resolved_partition(std::vector<std::vector<int>> lists) {
  std::lock_guard<std::mutex> lock(mu_);
  resolved_partitions_.insert(std::move(lists));
}

std::shared_ptr<ProcessGroup> new_group(ProcessGroup& parent, const std::vector<int>& ranks,
                                        const std::string& name) {
  if (ranks.empty()) throw InvalidArgument("new_group: ranks is empty");
  std::vector<int> sorted = ranks;
  // Sorted, as torch.distributed.new_group does: group rank i is the i-th smallest global rank.
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (i > 0 && sorted[i] == sorted[i - 1]) {
      throw InvalidArgument(fmt::format("new_group: rank {} is listed twice in {}", sorted[i],
                                        format_ranks(ranks)));
    }
    const auto& parent_ranks = parent.global_ranks();
    if (std::find(parent_ranks.begin(), parent_ranks.end(), sorted[i]) == parent_ranks.end()) {
      throw InvalidArgument(fmt::format("new_group: rank {} is not in group '{}' (ranks {})",
                                        sorted[i], parent.name(), format_ranks(parent_ranks)));
    }
  }
  // An unnamed group takes the next "group<N>" that no rank has registered (a user may have
  // named a group so, on its members only), N agreed by the ranks.
  const std::string group_name =
      !name.empty() ? name : dist_detail::agreed_group_name(parent, "new_group");
  const dist_detail::SplitCaller caller("new_group");
  return parent.split_group({sorted}, group_name);
}

std::shared_ptr<ProcessGroup> new_group(const std::vector<int>& ranks, const std::string& name) {
  ProcessGroup* world = current_world();
  if (world == nullptr) {
    throw InvalidArgument(
        "new_group: no world on this thread (call it inside run_local or after "
        "init_process_group, or pass the parent group)");
  }
  return new_group(*world, ranks, name);
}

}  // namespace funcol
