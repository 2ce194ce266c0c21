// The functional collectives: validate as the seed does, allocate the output, start the
// ProcessGroup primitive and return at once; the output's storage stays pending until first use.
#include "funcol/api/functional.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>

#include "funcol/api/autograd.h"
#include "funcol/core/dtype.h"
#include "funcol/core/error.h"
#include "funcol/dist/work.h"
#include "arg_checks.h"
#include "funcol/graph/tracer.h"
#include "tape_hooks.h"
#include "trace_hooks.h"

namespace funcol {
namespace {

using api_detail::check_contiguous;
using api_detail::check_reduce_op_for;
using api_detail::check_reduce_scatter_input;
using api_detail::check_scatter_dims_count;
using api_detail::index_suffix;
using api_detail::normalize_dim;

void check_input(const Tensor& t, std::string_view op, std::string_view suffix = {}) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{}: undefined input tensor{}", op, suffix));
  // Refused as ops::call refuses it: outside its trace a traced tensor is a meta tensor of a
  // graph that is gone, and the collective returned a meta result of it, silently.
  if (current_tracer() == nullptr && is_traced(t)) {
    throw InvalidArgument(fmt::format(
        "{}: a traced tensor is used outside its trace (no tracer is current){}", op, suffix));
  }
}

// Meta inputs outside a tracer get what PyTorch's meta kernels give: after the same checks (the
// group resolved too), a meta result of the result's shape and dtype, and nothing is issued.
// Whether a coalesced call's inputs are meta: all of them or none (InvalidArgument otherwise).
bool meta_inputs(std::span<const Tensor> inputs, std::string_view op) {
  size_t metas = 0;
  for (const Tensor& t : inputs) metas += t.is_meta() ? 1 : 0;
  if (metas != 0 && metas != inputs.size()) {
    throw InvalidArgument(fmt::format(
        "{}: {} of the {} inputs are meta tensors (no data) and the others are not: give all "
        "or none",
        op, metas, inputs.size()));
  }
  return metas != 0;
}

int64_t prod(const Shape& s, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= s[i];
  return p;
}

// What the backend reads: `t` once ready (free when it is), or its failed stand-in.
Tensor ready_input(const Tensor& t) {
  std::optional<Tensor> stand_in = failed_stand_in(t);
  return stand_in ? std::move(*stand_in) : t;
}

// A contiguous copy that the collective may overwrite, so the input stays untouched.
Tensor contiguous_copy(const Tensor& t) {
  if (std::optional<Tensor> stand_in = failed_stand_in(t)) return std::move(*stand_in);
  return t.is_contiguous() ? t.clone() : t.contiguous();
}

// The backends read an input when the collective runs, which may be after the call returned
// (a peer comes later): a write to the input before then would change or tear the result
// (all_reduce and broadcast copy their input at the call and need no guard). So writes to the
// input's storage wait for the collective (Storage::add_reader); reads do not.
void guard_inputs(const std::shared_ptr<Work>& work, std::span<const Tensor> inputs) {
  if (work == nullptr || work->is_completed()) return;
  for (const Tensor& t : inputs) {
    if (t.storage()) t.storage()->add_reader(work);
  }
}

void guard_input(const std::shared_ptr<Work>& work, const Tensor& input) {
  guard_inputs(work, std::span<const Tensor>(&input, 1));
}

// dst[j][i][:] = src[i][j][:] where src is laid out [a][b][block_bytes].
void transpose_blocks(void* dst, const void* src, int64_t a, int64_t b, size_t block_bytes) {
  if (a == 0 || b == 0 || block_bytes == 0) return;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  for (int64_t i = 0; i < a; ++i) {
    for (int64_t j = 0; j < b; ++j) {
      std::memcpy(d + static_cast<size_t>(j * a + i) * block_bytes,
                  s + static_cast<size_t>(i * b + j) * block_bytes, block_bytes);
    }
  }
}

// Finishes an all_gather along gather_dim != 0: once the staging buffer's collective is done,
// moves rank-major blocks [world][outer][block] into the result's [outer][world][block] layout.
// It is attached to the result's storage, so the first data access (from any thread) or an
// explicit wait runs it, exactly once; nothing waits at call time (PyTorch #172214).
class GatherRearrange final : public Waitable {
 public:
  GatherRearrange(Tensor staging, std::shared_ptr<Work> work,
                  const std::shared_ptr<Storage>& result, int64_t world, int64_t outer,
                  size_t block_bytes)
      : staging_(std::move(staging)),
        work_(std::move(work)),
        result_(result),
        world_(world),
        outer_(outer),
        block_bytes_(block_bytes) {}

  void wait() override {
    std::lock_guard<std::mutex> lock(mu_);
    run_locked(/*block=*/true);
    if (error_) {
      // Thrown here, the collective's failure counts seen (found by polling, it did not).
      if (work_) work_->set_failure_seen();
      std::rethrow_exception(error_);
    }
  }

  // Never blocks: when the collective has finished it does the (bounded) copy itself, so that
  // polling is_ready() on the result eventually sees true without an explicit wait.
  bool is_completed() const override {
    if (done_.load(std::memory_order_acquire)) return true;
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    if (!done_.load(std::memory_order_relaxed) && staging_.is_ready()) run_locked(false);
    return done_.load(std::memory_order_relaxed);
  }

 private:
  // Waits for the collective (`block`; else it is complete) and rearranges its result, once.
  // A failure found without blocking is read from the Work, not thrown by waiting for it, which
  // would count it seen: a rank that only polls the result and drops it is warned of it.
  void run_locked(bool block) const {
    if (done_.load(std::memory_order_relaxed)) return;
    try {
      if (!block && work_ && work_->failed()) std::rethrow_exception(work_->exception());
      staging_.wait();
      // The result's storage owns this object; a weak reference avoids a cycle.
      if (std::shared_ptr<Storage> result = result_.lock()) {
        transpose_blocks(result->raw(), staging_.raw_data_ptr(), world_, outer_, block_bytes_);
      }
    } catch (...) {
      error_ = std::current_exception();
    }
    staging_ = Tensor();  // frees the staging buffer
    if (!error_) work_.reset();  // kept failed for wait()'s set_failure_seen
    done_.store(true, std::memory_order_release);
  }

  mutable std::mutex mu_;
  mutable Tensor staging_;
  mutable std::shared_ptr<Work> work_;  // the all_gather writing staging_
  std::weak_ptr<Storage> result_;
  int64_t world_;
  int64_t outer_;
  size_t block_bytes_;
  mutable std::exception_ptr error_;
  mutable std::atomic<bool> done_{false};
};

Shape gathered_shape(const Shape& s, int64_t dim, int64_t world, std::string_view op) {
  if (s.empty()) return {world};
  Shape out = s;
  int64_t& d = out[static_cast<size_t>(dim)];
  if (__builtin_mul_overflow(d, world, &d)) {
    throw ShapeError(fmt::format("{}: dim {} of size {} gathered from {} ranks does not fit in "
                                 "int64",
                                 op, dim, s[static_cast<size_t>(dim)], world));
  }
  return out;
}

Tensor all_gather_impl(ProcessGroup& pg, const Tensor& t, int64_t dim) {
  const int64_t world = pg.size();
  const Shape& s = t.sizes();
  if (t.is_meta()) {
    return Tensor::meta(gathered_shape(s, dim, world, "all_gather_tensor"), t.dtype());
  }
  const Shape staging_shape = gathered_shape(s, 0, world, "all_gather_tensor");
  Tensor staging = Tensor::empty(staging_shape, t.dtype());
  std::shared_ptr<Work> work = pg.all_gather(staging, ready_input(t));
  guard_input(work, t);
  const Shape result_shape = gathered_shape(s, dim, world, "all_gather_tensor");
  const int64_t outer = prod(s, 0, static_cast<size_t>(dim));
  // Rank-major blocks already are the result's layout when nothing precedes gather_dim.
  if (dim == 0 || world == 1 || outer == 1 || t.numel() == 0) return staging.view(result_shape);
  Tensor result = Tensor::empty(result_shape, t.dtype());
  const size_t block_bytes =
      static_cast<size_t>(prod(s, static_cast<size_t>(dim), s.size())) * t.itemsize();
  result.storage()->add_pending(std::make_shared<GatherRearrange>(
      std::move(staging), std::move(work), result.storage(), world, outer, block_bytes));
  return result;
}

// The seed's chunk(world, dim) + cat(dim 0), done eagerly (it needs only the input): the block
// for rank j becomes the j-th contiguous slab, as reduce_scatter expects. A copy, so the input
// may be non-contiguous unless dim is 0. The result has the seed's shape (dim 0 times world,
// dim divided by it) on every path: the collective's shape is what ranks compare, so ranks that
// disagree on scatter_dim fail, and a non-contiguous input on one rank still pairs with a
// contiguous one on another (the traced and autograd forms record the same shape).
Tensor scatter_dim_to_front(const Tensor& t, int64_t dim, int64_t world) {
  const Shape& s = t.sizes();
  Shape front_shape = s;
  if (dim != 0 && world != 1) {
    front_shape[0] *= world;
    front_shape[static_cast<size_t>(dim)] /= world;
  }
  // A failed input's stand-in has the shape the peers' inputs have.
  if (std::optional<Tensor> stand_in = failed_stand_in(t)) return stand_in->view(front_shape);
  if (dim == 0 || world == 1) return t.contiguous();
  const int64_t outer = prod(s, 0, static_cast<size_t>(dim));
  // With nothing before dim, the chunks are the input's slabs in order already.
  if (outer == 1 || t.numel() == 0) return t.contiguous().view(front_shape);
  if (!t.is_contiguous()) return Tensor::cat(t.chunk(world, dim), 0);
  Tensor front = Tensor::empty(front_shape, t.dtype());
  const size_t block_bytes = static_cast<size_t>(s[static_cast<size_t>(dim)] / world *
                                                 prod(s, static_cast<size_t>(dim) + 1, s.size())) *
                             t.itemsize();
  transpose_blocks(front.raw_data_ptr(), t.const_data_ptr(), outer, world, block_bytes);
  return front;
}

Shape scattered_shape(const Shape& s, int64_t dim, int64_t world) {
  Shape out = s;
  out[static_cast<size_t>(dim)] /= world;
  return out;
}

// all_to_all over dim-0 rows with validated splits; the output has out_rows =
// sum(output_splits) rows.
Tensor all_to_all_impl(ProcessGroup& pg, const Tensor& t, const std::vector<int64_t>& out_splits,
                       const std::vector<int64_t>& in_splits, int64_t out_rows) {
  Shape out_shape = t.sizes();
  out_shape[0] = out_rows;
  if (t.is_meta()) return Tensor::meta(out_shape, t.dtype());
  Tensor out = Tensor::empty(out_shape, t.dtype());
  guard_input(pg.all_to_all(out, ready_input(t), out_splits, in_splits), t);
  return out;
}

// An in-place collective's result computed from an input a GradTape tracks (eagerly, the
// collective recorded it): the output it is copied into is not tracked, so a tape op reading the
// output would take it for a constant, and the input's gradient through it would be lost
// without a word (PyTorch records the copy_). Refused; issued first, so no peer waits.
void refuse_tracked_result(const Tensor& result, std::string_view op) {
  if (current_tracer() != nullptr || !is_tracked(result)) return;
  throw InvalidArgument(fmt::format(
      "{}: the input is tracked by a GradTape and the output is not, so the gradient through "
      "the in-place collective would be lost (use the functional form, whose result the tape "
      "tracks, or pass input.clone() to use the input's values as a constant)",
      op));
}

// output.copy_(result); under a tracer, output stands for result from now on, as graphs are
// functional (DESIGN §4: the in-place remaps trace too). The dtypes match (check_output).
void assign(const Tensor& output, const Tensor& result, std::string_view op) {
  FUNCOL_CHECK(output.dtype() == result.dtype(), std::string(op));
  Tracer* tr = current_tracer();
  if (tr == nullptr && (output.is_meta() || result.is_meta())) {
    // PyTorch's meta kernels of the in-place collectives return their output as it is.
    if (output.is_meta() && result.is_meta()) return;
    throw InvalidArgument(fmt::format(
        "{}: the {} is a meta tensor (no data) and the {} is not: give both or neither", op,
        output.is_meta() ? "output" : "input", output.is_meta() ? "input" : "output"));
  }
  if (tr == nullptr) {
    // PyTorch refuses in-place changes that autograd cannot follow; the tape records values,
    // and an overwritten tracked tensor would feed its backward the new bytes.
    if (is_tracked(output)) {
      throw InvalidArgument(fmt::format(
          "{}: the output is tracked by a GradTape, and an in-place collective cannot be "
          "differentiated (use the functional form, which returns a new tensor)",
          op));
    }
    refuse_tracked_result(result, op);
    output.copy_(result);
    return;
  }
  tr->assign(output, result);
}

// The classic collectives write their output in the input's dtype and refuse any other, as
// PyTorch's c10d ones do: a silent conversion would hide a wrong buffer. `what` names the
// output ("output", "tensor_list[1]").
void check_output_dtype(const Tensor& output, const Tensor& input, std::string_view op,
                        std::string_view what) {
  if (output.dtype() != input.dtype()) {
    throw InvalidArgument(fmt::format("{}: {} dtype {} does not match the input dtype {}", op,
                                      what, dtype_name(output.dtype()),
                                      dtype_name(input.dtype())));
  }
}

// An in-place remap's output must take the result as it is: defined, same shape (ShapeError),
// same dtype (InvalidArgument).
void check_output(const Tensor& output, const Tensor& result, std::string_view op) {
  if (!output.defined()) throw InvalidArgument(fmt::format("{}: undefined output tensor", op));
  if (output.sizes() != result.sizes()) {
    throw ShapeError(fmt::format("{}: output shape {} does not match the result shape {}", op,
                                 shape_str(output.sizes()), shape_str(result.sizes())));
  }
  check_output_dtype(output, result, op, "output");
}

}  // namespace

Tensor all_reduce(const Tensor& t, const std::string& reduce_op, const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) {
    return api_detail::trace_all_reduce(*tr, t, reduce_op, group);
  }
  if (api_detail::tape_input(t, "all_reduce")) return all_reduce_autograd(t, reduce_op, group);
  constexpr std::string_view kOp = "all_reduce";
  check_input(t, kOp);
  const ReduceOp op = parse_reduce_op(reduce_op);
  check_reduce_op_dtype(op, t.dtype(), kOp);
  ProcessGroup& pg = group.resolve();
  if (t.is_meta()) return Tensor::meta(t.sizes(), t.dtype());
  Tensor out = contiguous_copy(t);
  pg.all_reduce(out, op);
  return out;
}

Tensor all_gather_tensor(const Tensor& t, int64_t gather_dim, const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) {
    return api_detail::trace_all_gather_tensor(*tr, t, gather_dim, group);
  }
  if (api_detail::tape_input(t, "all_gather_tensor")) {
    return all_gather_tensor_autograd(t, gather_dim, group);
  }
  constexpr std::string_view kOp = "all_gather_tensor";
  check_input(t, kOp);
  check_contiguous(t, kOp);
  const int64_t dim = normalize_dim(gather_dim, t.dim(), kOp, "gather_dim");
  return all_gather_impl(group.resolve(), t, dim);
}

Tensor reduce_scatter_tensor(const Tensor& t, const std::string& reduce_op, int64_t scatter_dim,
                             const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) {
    return api_detail::trace_reduce_scatter_tensor(*tr, t, reduce_op, scatter_dim, group);
  }
  if (api_detail::tape_input(t, "reduce_scatter_tensor")) {
    return reduce_scatter_tensor_autograd(t, reduce_op, scatter_dim, group);
  }
  constexpr std::string_view kOp = "reduce_scatter_tensor";
  check_input(t, kOp);
  const ReduceOp op = parse_reduce_op(reduce_op);
  check_reduce_op_dtype(op, t.dtype(), kOp);
  ProcessGroup& pg = group.resolve();
  const int64_t world = pg.size();
  const int64_t dim = check_reduce_scatter_input(t, scatter_dim, world, kOp, {});
  const Shape out_shape = scattered_shape(t.sizes(), dim, world);
  if (t.is_meta()) return Tensor::meta(out_shape, t.dtype());
  Tensor in = scatter_dim_to_front(t, dim, world);
  Tensor out = Tensor::empty(out_shape, t.dtype());
  guard_input(pg.reduce_scatter(out, in, op), in);
  return out;
}

Tensor all_to_all_single(const Tensor& t, std::optional<std::vector<int64_t>> output_split_sizes,
                         std::optional<std::vector<int64_t>> input_split_sizes,
                         const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) {
    return api_detail::trace_all_to_all_single(*tr, t, output_split_sizes, input_split_sizes,
                                               group);
  }
  if (api_detail::tape_input(t, "all_to_all_single")) {
    return all_to_all_single_autograd(t, output_split_sizes, input_split_sizes, group);
  }
  constexpr std::string_view kOp = "all_to_all_single";
  check_input(t, kOp);
  if (output_split_sizes.has_value() != input_split_sizes.has_value()) {
    throw InvalidArgument(
        "output_split_sizes and input_split_sizes must either be specified together or both set "
        "to None");
  }
  check_contiguous(t, kOp);
  if (t.dim() == 0) {
    throw ShapeError("all_to_all_single: input must have at least one dimension");
  }
  ProcessGroup& pg = group.resolve();
  const int64_t world = pg.size();
  std::vector<int64_t> out_splits;
  std::vector<int64_t> in_splits;
  int64_t out_rows = t.size(0);  // even splits: as many rows as the input
  if (input_split_sizes) {
    out_splits = std::move(*output_split_sizes);
    in_splits = std::move(*input_split_sizes);
    out_rows = api_detail::check_all_to_all_splits(out_splits, in_splits, world, t.size(0));
  } else {
    if (t.size(0) % world != 0) {
      throw ShapeError(fmt::format(
          "all_to_all_single: input dimension 0 ({}) must be a multiple of group_size {} when no "
          "split sizes are given",
          t.size(0), world));
    }
    out_splits.assign(static_cast<size_t>(world), t.size(0) / world);
    in_splits = out_splits;
  }
  return all_to_all_impl(pg, t, out_splits, in_splits, out_rows);
}

Tensor broadcast(const Tensor& t, int src, const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) {
    return api_detail::trace_broadcast(*tr, t, src, group);
  }
  if (api_detail::tape_input(t, "broadcast")) return api_detail::tape_broadcast(t, src, group);
  constexpr std::string_view kOp = "broadcast";
  check_input(t, kOp);
  ProcessGroup& pg = group.resolve();
  if (src < 0 || src >= pg.size()) {
    throw InvalidArgument(fmt::format("broadcast: src {} is not a rank of group '{}' of size {}",
                                      src, pg.name(), pg.size()));
  }
  if (t.is_meta()) return Tensor::meta(t.sizes(), t.dtype());
  Tensor out = contiguous_copy(t);
  pg.broadcast(out, src);
  return out;
}

Tensor permute_tensor(const Tensor& t, const std::vector<int>& src_dst, const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) return api_detail::trace_permute_tensor(*tr, t, src_dst, group);
  constexpr std::string_view kOp = "permute_tensor";
  check_input(t, kOp);
  ProcessGroup& pg = group.resolve();
  // As the seed: one all_to_all_single where this rank sends everything to src_dst[rank] and
  // receives everything from the m with src_dst[m] == rank. In rows of dim 0 (a 0-d tensor is
  // one), not in elements: a peer whose tensor has other rows or another row shape is then
  // refused, and named in rows, by the exchange's checks.
  const Shape rows = api_detail::permute_rows(t);
  const api_detail::PermuteSplits splits =
      api_detail::permute_splits(src_dst, pg.size(), pg.rank(), rows[0]);
  if (t.is_meta()) return Tensor::meta(t.sizes(), t.dtype());
  if (api_detail::tape_input(t, "permute_tensor")) {
    return api_detail::tape_permute(t, splits.out, splits.in, pg);
  }
  Tensor x = ready_input(t).contiguous().view(rows);
  return all_to_all_impl(pg, x, splits.out, splits.in, rows[0]).view(t.sizes());
}

std::vector<Tensor> all_reduce_coalesced(const std::vector<Tensor>& inputs,
                                         const std::string& reduce_op, const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) {
    return api_detail::trace_all_reduce_coalesced(*tr, inputs, reduce_op, group);
  }
  if (api_detail::tape_inputs(inputs, "all_reduce_coalesced")) {
    return all_reduce_coalesced_autograd(inputs, reduce_op, group);
  }
  constexpr std::string_view kOp = "all_reduce_coalesced";
  const ReduceOp op = parse_reduce_op(reduce_op);
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_input(inputs[i], kOp, index_suffix(i));
    check_reduce_op_for(op, inputs[i], kOp, index_suffix(i));
  }
  ProcessGroup& pg = group.resolve();
  if (inputs.empty()) return {};
  std::vector<Tensor> outputs;
  outputs.reserve(inputs.size());
  const bool meta = meta_inputs(inputs, kOp);
  for (const Tensor& t : inputs) outputs.push_back(contiguous_copy(t));  // meta: a meta tensor
  if (meta) return outputs;
  pg.all_reduce_coalesced(outputs, op);
  return outputs;
}

std::vector<Tensor> all_gather_into_tensor_coalesced(const std::vector<Tensor>& inputs,
                                                     const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) {
    return api_detail::trace_all_gather_into_tensor_coalesced(*tr, inputs, group);
  }
  if (api_detail::tape_inputs(inputs, "all_gather_into_tensor_coalesced")) {
    return all_gather_into_tensor_coalesced_autograd(inputs, group);
  }
  constexpr std::string_view kOp = "all_gather_into_tensor_coalesced";
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_input(inputs[i], kOp, index_suffix(i));
    check_contiguous(inputs[i], kOp, index_suffix(i));
  }
  ProcessGroup& pg = group.resolve();
  if (inputs.empty()) return {};
  std::vector<Tensor> outputs;
  std::vector<Tensor> ready;
  outputs.reserve(inputs.size());
  ready.reserve(inputs.size());
  const bool meta = meta_inputs(inputs, kOp);
  for (const Tensor& t : inputs) {
    const Shape shape = gathered_shape(t.sizes(), 0, pg.size(), kOp);
    outputs.push_back(meta ? Tensor::meta(shape, t.dtype()) : Tensor::empty(shape, t.dtype()));
    if (!meta) ready.push_back(ready_input(t));
  }
  if (meta) return outputs;
  guard_inputs(pg.all_gather_coalesced(outputs, ready), inputs);
  return outputs;
}

std::vector<Tensor> reduce_scatter_tensor_coalesced(const std::vector<Tensor>& inputs,
                                                    const std::string& reduce_op,
                                                    const std::vector<int64_t>& scatter_dims,
                                                    const GroupSpec& group) {
  if (Tracer* tr = current_tracer()) {
    return api_detail::trace_reduce_scatter_tensor_coalesced(*tr, inputs, reduce_op, scatter_dims,
                                                             group);
  }
  if (api_detail::tape_inputs(inputs, "reduce_scatter_tensor_coalesced")) {
    return api_detail::tape_reduce_scatter_coalesced(inputs, reduce_op, scatter_dims, group);
  }
  constexpr std::string_view kOp = "reduce_scatter_tensor_coalesced";
  const ReduceOp op = parse_reduce_op(reduce_op);
  check_scatter_dims_count(scatter_dims.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_input(inputs[i], kOp, index_suffix(i));
    check_reduce_op_for(op, inputs[i], kOp, index_suffix(i));
  }
  ProcessGroup& pg = group.resolve();
  if (inputs.empty()) return {};
  const int64_t world = pg.size();
  std::vector<int64_t> dims;
  for (size_t i = 0; i < inputs.size(); ++i) {
    dims.push_back(
        check_reduce_scatter_input(inputs[i], scatter_dims[i], world, kOp, index_suffix(i)));
  }
  std::vector<Tensor> fronts;
  std::vector<Tensor> outputs;
  const bool meta = meta_inputs(inputs, kOp);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Shape shape = scattered_shape(inputs[i].sizes(), dims[i], world);
    const DType dtype = inputs[i].dtype();
    outputs.push_back(meta ? Tensor::meta(shape, dtype) : Tensor::empty(shape, dtype));
    if (!meta) fronts.push_back(scatter_dim_to_front(inputs[i], dims[i], world));
  }
  if (meta) return outputs;
  guard_inputs(pg.reduce_scatter_coalesced(outputs, fronts, op), fronts);
  return outputs;
}

const Tensor& wait_tensor(const Tensor& t) { return t.wait(); }

void wait_tensors(const std::vector<Tensor>& tensors) {
  if (tensors.empty()) throw InvalidArgument("wait_tensors requires at least one tensor");
  // Each storage once (a tensor listed twice, views of one result), and each Work once: the
  // outputs of one coalesced op share it.
  std::unordered_set<const Storage*> listed;
  std::vector<Storage*> storages;
  for (const Tensor& t : tensors) {
    Storage* s = t.storage().get();
    if (s != nullptr && listed.insert(s).second) storages.push_back(s);
  }
  Storage::wait_all(storages);
}

const Tensor& all_reduce_inplace(const Tensor& t, const std::string& reduce_op,
                                 const GroupSpec& group) {
  const api_detail::UntrackedViewsAllowed writes;  // into t, which may view a leaf
  assign(t, all_reduce(t, reduce_op, group), "all_reduce_inplace");
  return t;
}

void all_gather_inplace(const std::vector<Tensor>& tensor_list, const Tensor& t,
                        const GroupSpec& group) {
  constexpr std::string_view kOp = "all_gather_inplace";
  const api_detail::UntrackedViewsAllowed writes;  // into tensor_list, as all_reduce_inplace
  // Tracing needs no live group (declared sizes); eager resolves the spec once.
  Tracer* tr = current_tracer();
  ProcessGroup* pg = tr ? nullptr : &group.resolve();
  const int world = pg ? pg->size() : api_detail::traced_group_size(*tr, group, kOp);
  // Issued before the local checks below, so peers never wait on a rank that gave up early.
  Tensor gathered = pg ? all_gather_tensor(t, 0, *pg) : all_gather_tensor(t, 0, group);
  refuse_tracked_result(gathered, kOp);
  if (static_cast<int64_t>(tensor_list.size()) != world) {
    throw InvalidArgument(fmt::format("{}: tensor_list has {} tensors, expected group_size {}", kOp,
                                      tensor_list.size(), world));
  }
  for (size_t j = 0; j < tensor_list.size(); ++j) {
    if (!tensor_list[j].defined()) {
      throw InvalidArgument(fmt::format("{}: tensor_list[{}] is undefined", kOp, j));
    }
    if (tensor_list[j].sizes() != t.sizes()) {
      throw InvalidArgument(fmt::format(
          "Remapping variable size all_gather is not yet supported (tensor_list[{}] has shape {}, "
          "the input {})",
          j, shape_str(tensor_list[j].sizes()), shape_str(t.sizes())));
    }
    check_output_dtype(tensor_list[j], t, kOp, fmt::format("tensor_list[{}]", j));
  }
  if (!tr && gathered.is_meta()) {
    for (const Tensor& out : tensor_list) assign(out, gathered, kOp);  // nothing to write
    return;
  }
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  for (size_t j = 0; j < tensor_list.size(); ++j) {
    const int64_t jj = static_cast<int64_t>(j);
    // ops::narrow and ops::view record under a tracer; Tensor methods would not.
    const Tensor block = ops::narrow(gathered, 0, jj * rows, rows);
    assign(tensor_list[j], t.dim() == 0 ? ops::view(block, {}) : block, kOp);
  }
}

const Tensor& all_gather_tensor_inplace(const Tensor& output, const Tensor& input,
                                        const GroupSpec& group, int64_t gather_dim) {
  const api_detail::UntrackedViewsAllowed writes;  // into output, as all_reduce_inplace
  Tensor result = all_gather_tensor(input, gather_dim, group);
  check_output(output, result, "all_gather_tensor_inplace");
  assign(output, result, "all_gather_tensor_inplace");
  return output;
}

const Tensor& reduce_scatter_tensor_inplace(const Tensor& output, const Tensor& input,
                                            const GroupSpec& group, const std::string& reduce_op,
                                            int64_t scatter_dim) {
  const api_detail::UntrackedViewsAllowed writes;  // into output, as all_reduce_inplace
  Tensor result = reduce_scatter_tensor(input, reduce_op, scatter_dim, group);
  check_output(output, result, "reduce_scatter_tensor_inplace");
  assign(output, result, "reduce_scatter_tensor_inplace");
  return output;
}

const Tensor& all_to_all_inplace(const Tensor& output, const Tensor& input,
                                 std::optional<std::vector<int64_t>> output_split_sizes,
                                 std::optional<std::vector<int64_t>> input_split_sizes,
                                 const GroupSpec& group) {
  const api_detail::UntrackedViewsAllowed writes;  // into output, as all_reduce_inplace
  Tensor result =
      all_to_all_single(input, std::move(output_split_sizes), std::move(input_split_sizes), group);
  check_output(output, result, "all_to_all_inplace");
  assign(output, result, "all_to_all_inplace");
  return output;
}

}  // namespace funcol
