// Synchronous argument checks shared by every backend's ProcessGroup primitives.
#include "checks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <tuple>
#include <utility>

#include "funcol/core/error.h"
#include "funcol/dist/process_group.h"
#include "funcol/dist/work.h"

namespace funcol::dist_detail {

namespace {
int64_t product_from(const Shape& sizes, size_t first) {
  int64_t n = 1;
  for (size_t i = first; i < sizes.size(); ++i) n *= sizes[i];
  return n;
}
}  // namespace

void check_buffer(std::string_view op, const Tensor& t, std::string_view what) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{}: {} is undefined", op, what));
  if (t.is_meta()) {
    throw InvalidArgument(fmt::format("{}: {} is a meta tensor ({}) without data", op, what,
                                      type_str(t.dtype(), t.sizes())));
  }
  if (!t.is_contiguous()) {
    throw InvalidArgument(fmt::format("{}: {} must be contiguous (sizes {}, strides {})", op,
                                      what, shape_str(t.sizes()), shape_str(t.strides())));
  }
}

void check_same_dtype(std::string_view op, const Tensor& a, std::string_view a_name,
                      const Tensor& b, std::string_view b_name) {
  if (a.dtype() != b.dtype()) {
    throw InvalidArgument(fmt::format("{}: {} dtype {} does not match {} dtype {}", op, a_name,
                                      dtype_name(a.dtype()), b_name, dtype_name(b.dtype())));
  }
}

void check_reduce(std::string_view op, ReduceOp reduce_op, DType dtype) {
  if (static_cast<int>(reduce_op) > static_cast<int>(ReduceOp::BXor)) {
    throw InvalidArgument(fmt::format("{}: invalid reduce op {}", op, static_cast<int>(reduce_op)));
  }
  bool bitwise = reduce_op == ReduceOp::BAnd || reduce_op == ReduceOp::BOr ||
                 reduce_op == ReduceOp::BXor;
  if (bitwise && is_floating(dtype)) {
    throw InvalidArgument(fmt::format("{}: reduce_op {} needs an integer or bool tensor, got {}",
                                      op, reduce_op_name(reduce_op), dtype_name(dtype)));
  }
  if (reduce_op == ReduceOp::Avg && dtype == DType::Bool) {
    throw InvalidArgument(fmt::format("{}: reduce_op avg is not supported on bool tensors", op));
  }
}

void check_all_reduce(const Tensor& tensor, ReduceOp reduce_op) {
  check_buffer("all_reduce", tensor, "tensor");
  check_reduce("all_reduce", reduce_op, tensor.dtype());
}

void check_all_gather(const Tensor& output, const Tensor& input, int group_size) {
  check_buffer("all_gather", input, "input");
  check_buffer("all_gather", output, "output");
  check_same_dtype("all_gather", output, "output", input, "input");
  if (output.numel() != group_size * input.numel()) {
    throw ShapeError(fmt::format(
        "all_gather: output numel ({}) must be group size ({}) * input numel ({})",
        output.numel(), group_size, input.numel()));
  }
}

void check_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp reduce_op,
                          int group_size) {
  check_buffer("reduce_scatter", input, "input");
  check_buffer("reduce_scatter", output, "output");
  check_same_dtype("reduce_scatter", output, "output", input, "input");
  check_reduce("reduce_scatter", reduce_op, input.dtype());
  if (input.numel() != group_size * output.numel()) {
    throw ShapeError(fmt::format(
        "reduce_scatter: input numel ({}) must be group size ({}) * output numel ({})",
        input.numel(), group_size, output.numel()));
  }
}

void check_broadcast(const Tensor& tensor, int src, int group_size) {
  check_buffer("broadcast", tensor, "tensor");
  if (src < 0 || src >= group_size) {
    throw InvalidArgument(
        fmt::format("broadcast: src {} is out of range for group size {}", src, group_size));
  }
}

AllToAllLayout check_all_to_all(const Tensor& output, const Tensor& input,
                                const std::vector<int64_t>& output_splits,
                                const std::vector<int64_t>& input_splits, int group_size) {
  check_buffer("all_to_all", input, "input");
  check_buffer("all_to_all", output, "output");
  check_same_dtype("all_to_all", output, "output", input, "input");
  if (input.dim() == 0 || output.dim() == 0) {
    throw ShapeError(fmt::format("all_to_all: input ({}) and output ({}) need at least one dim",
                                 shape_str(input.sizes()), shape_str(output.sizes())));
  }
  AllToAllLayout layout;
  layout.row_elems = product_from(input.sizes(), 1);
  int64_t out_row = product_from(output.sizes(), 1);
  if (out_row != layout.row_elems) {
    throw ShapeError(fmt::format(
        "all_to_all: output rows ({} elements, sizes {}) differ from input rows ({} elements, "
        "sizes {})",
        out_row, shape_str(output.sizes()), layout.row_elems, shape_str(input.sizes())));
  }
  if (output_splits.empty() != input_splits.empty()) {
    throw InvalidArgument(
        "all_to_all: output_split_sizes and input_split_sizes must either be specified "
        "together or both set to None");
  }
  if (input_splits.empty()) {
    for (const Tensor* t : {&input, &output}) {
      if (t->size(0) % group_size != 0) {
        throw ShapeError(fmt::format(
            "all_to_all: {} dim 0 ({}) is not a multiple of group size {} (no split sizes given)",
            t == &input ? "input" : "output", t->size(0), group_size));
      }
    }
    layout.input_splits.assign(group_size, input.size(0) / group_size);
    layout.output_splits.assign(group_size, output.size(0) / group_size);
    return layout;
  }
  auto check_splits = [&](const std::vector<int64_t>& splits, const Tensor& t,
                          std::string_view name) {
    if (static_cast<int>(splits.size()) != group_size) {
      throw InvalidArgument(fmt::format("all_to_all: {} has {} entries but group size is {}",
                                        name, splits.size(), group_size));
    }
    int64_t total = 0;
    for (size_t j = 0; j < splits.size(); ++j) {
      if (splits[j] < 0) {
        throw InvalidArgument(
            fmt::format("all_to_all: {}[{}] is negative ({})", name, j, splits[j]));
      }
      if (__builtin_add_overflow(total, splits[j], &total)) {
        throw InvalidArgument(
            fmt::format("all_to_all: {} {} sum to more than int64 holds", name, splits));
      }
    }
    if (total != t.size(0)) {
      throw ShapeError(fmt::format("all_to_all: {} sum to {} but {} dim 0 is {}", name, total,
                                   &t == &input ? "input" : "output",
                                   t.size(0)));
    }
  };
  check_splits(input_splits, input, "input_split_sizes");
  check_splits(output_splits, output, "output_split_sizes");
  layout.input_splits = input_splits;
  layout.output_splits = output_splits;
  return layout;
}

int8_t pack_shape(std::span<const int64_t> sizes, ShapeWords& words) {
  words.fill(0);
  const auto ndim = static_cast<int64_t>(sizes.size());
  if (ndim <= kShapeWords) {
    std::copy(sizes.begin(), sizes.end(), words.begin());
    return static_cast<int8_t>(ndim);
  }
  std::copy(sizes.begin(), sizes.begin() + (kShapeWords - 1), words.begin());
  Fnv1a h;  // over the count and every dim
  h.mix(ndim);
  for (int64_t d : sizes) h.mix(d);
  words[kShapeWords - 1] = static_cast<int64_t>(h.value());
  return static_cast<int8_t>(std::min<int64_t>(ndim, 127));
}

bool same_packed_shape(int ndim_a, const ShapeWords& a, int ndim_b, const ShapeWords& b) {
  if (ndim_a < 0 || ndim_b < 0) return true;
  if (ndim_a != ndim_b) return false;
  const int words = std::min(ndim_a, kShapeWords);
  return std::equal(a.begin(), a.begin() + words, b.begin());
}

int8_t pack_compared_shape(std::span<const int64_t> sizes, bool rows, ShapeWords& words) {
  return pack_shape(rows && !sizes.empty() ? sizes.subspan(1) : sizes, words);
}

std::string describe_compared_shape(DType dtype, int ndim, const ShapeWords& words, bool rows) {
  const char* any_rows = rows ? (ndim == 0 ? "*" : "*,") : "";
  if (ndim <= kShapeWords) {
    return fmt::format("{}[{}{}]", dtype_name(dtype), any_rows,
                       fmt::join(words.begin(), words.begin() + std::max(ndim, 0), ","));
  }
  // The tensor's dim count: a row's and its dim 0.
  const int dims = ndim + (rows ? 1 : 0);
  return fmt::format("{}[{}{},...: {}{} dims, #{:08x}]", dtype_name(dtype), any_rows,
                     fmt::join(words.begin(), words.end() - 1, ","), ndim == 127 ? ">= " : "",
                     dims, static_cast<uint32_t>(static_cast<uint64_t>(words.back()) >> 32));
}

std::string split_mismatch(int from, int64_t sent, int to, int64_t expected) {
  return fmt::format(
      "mismatched split sizes: rank {} sends {} row{} to rank {} but rank {} expects {} row{} "
      "from rank {}",
      from, sent, sent == 1 ? "" : "s", to, to, expected, expected == 1 ? "" : "s", from);
}

std::string failed_buffer_reason(std::string_view role, const std::exception& error) {
  if (dynamic_cast<const AbandonedError*>(&error) != nullptr) return error.what();
  return fmt::format("its {} holds the failed result of an earlier collective ({})", role,
                     error.what());
}

std::string failed_buffer_message(const std::string& what, int rank, const std::string& why) {
  return fmt::format("{}: rank {} could not take part: {}", what, rank, why);
}

void check_coalesced_lists(std::string_view op, size_t outputs, size_t inputs) {
  if (outputs != inputs) {
    throw InvalidArgument(
        fmt::format("{}: {} outputs but {} inputs (the lists must pair up)", op, outputs, inputs));
  }
}

void check_all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp reduce_op) {
  for (const Tensor& t : tensors) check_all_reduce(t, reduce_op);
  check_outputs_apart("all_reduce_coalesced", tensors, tensors);
}

void check_all_gather_coalesced(const ProcessGroup& group, const std::vector<Tensor>& outputs,
                                const std::vector<Tensor>& inputs) {
  constexpr std::string_view kOp = "all_gather_coalesced";
  check_coalesced_lists(kOp, outputs.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) check_all_gather(outputs[i], inputs[i], group.size());
  check_outputs_apart(kOp, outputs, inputs, InPlace::kInputInOutput, group.rank());
}

void check_reduce_scatter_coalesced(const ProcessGroup& group, const std::vector<Tensor>& outputs,
                                    const std::vector<Tensor>& inputs, ReduceOp reduce_op) {
  constexpr std::string_view kOp = "reduce_scatter_coalesced";
  check_coalesced_lists(kOp, outputs.size(), inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_reduce_scatter(outputs[i], inputs[i], reduce_op, group.size());
  }
  check_outputs_apart(kOp, outputs, inputs, InPlace::kOutputInInput, group.rank());
}

std::shared_ptr<Work> empty_coalesced(std::string_view op, const ProcessGroup& group) {
  return Work::completed(fmt::format("{} on group '{}' (empty list)", op, group.name()));
}

namespace {

// A tensor's bytes in its storage (an in-place pair is recorded once, as its output).
struct Range {
  const Storage* storage;
  size_t begin, end;
  size_t index;
  bool output;
};

// A tensor's bytes in its storage.
Range range_of(const Tensor& t, size_t i, bool output) {
  const size_t begin = static_cast<size_t>(t.storage_offset()) * t.itemsize();
  return Range{t.storage().get(), begin, begin + t.nbytes(), i, output};
}

// True when the pair shares bytes only as the in-place form: the smaller tensor is block
// `block` (in units of its own size) of the larger one, in the same storage. Equal sizes: the
// same bytes, at block 0.
bool in_place_pair(const Tensor& out, const Tensor& in, size_t block) {
  if (out.storage() != in.storage()) return false;
  const Range o = range_of(out, 0, true);
  const Range n = range_of(in, 0, false);
  const Range& small = o.end - o.begin <= n.end - n.begin ? o : n;
  const Range& large = &small == &o ? n : o;
  const size_t len = small.end - small.begin;
  return small.begin == large.begin + block * len && small.end <= large.end;
}

// The common case in O(n), without building or sorting ranges: the outputs sit in a few
// storages, each in ascending order without overlap (a bucket's results, views of one buffer),
// and no input lives in any of those storages (an in-place pair, an output that is its own
// input, counts as its output). False means "not shown", not "overlapping".
bool outputs_clearly_apart(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                           size_t block) {
  constexpr size_t kMaxStorages = 4;
  std::array<std::pair<const Storage*, size_t>, kMaxStorages> last{};  // storage, end so far
  size_t used = 0;
  auto find = [&](const Storage* st) -> std::pair<const Storage*, size_t>* {
    for (size_t k = 0; k < used; ++k) {
      if (last[k].first == st) return &last[k];
    }
    return nullptr;
  };
  for (const Tensor& out : outputs) {
    if (out.numel() == 0) continue;
    const Range r = range_of(out, 0, true);
    auto* slot = find(r.storage);
    if (slot == nullptr) {
      if (used == kMaxStorages) return false;
      last[used++] = {r.storage, r.end};
    } else if (r.begin < slot->second) {
      return false;
    } else {
      slot->second = r.end;
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& in = inputs[i];
    if (in.numel() == 0 || find(in.storage().get()) == nullptr) continue;
    // An in-place pair whose input is the larger (reduce_scatter) reaches past its output.
    if (in.nbytes() > outputs[i].nbytes() || !in_place_pair(outputs[i], in, block)) {
      return false;
    }
  }
  return true;
}

// The one way an output may share bytes with an input, for a message.
std::string in_place_rule(InPlace in_place, int rank) {
  switch (in_place) {
    case InPlace::kInputInOutput:
      return fmt::format("in place, an input may only be block {} of its own output", rank);
    case InPlace::kOutputInInput:
      return fmt::format("in place, an output may only be block {} of its own input", rank);
    case InPlace::kOwnInput:
      break;
  }
  return "an output may only be its own input";
}

}  // namespace

namespace {

// What check_buffer accepts, tested without formatting its message (buckets check thousands).
bool usable(const Tensor& t) { return t.defined() && !t.is_meta() && t.is_contiguous(); }

}  // namespace

void check_all_reduce_into(const std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs,
                           ReduceOp reduce_op) {
  constexpr std::string_view kOp = "all_reduce_coalesced_into";
  check_coalesced_lists(kOp, outputs.size(), inputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& out = outputs[i];
    const Tensor& in = inputs[i];
    // The names are formatted only for a message: a bucket passes thousands of pairs.
    if (!usable(out)) check_buffer(kOp, out, fmt::format("output {}", i));
    if (!usable(in)) check_buffer(kOp, in, fmt::format("input {}", i));
    if (out.dtype() != in.dtype()) {
      check_same_dtype(kOp, out, fmt::format("output {}", i), in, fmt::format("input {}", i));
    }
    if (i == 0 || in.dtype() != inputs[i - 1].dtype()) check_reduce(kOp, reduce_op, in.dtype());
    if (out.numel() != in.numel()) {
      throw ShapeError(fmt::format("{}: output {} numel ({}) does not match input {} numel ({})",
                                   kOp, i, out.numel(), i, in.numel()));
    }
  }
  check_outputs_apart(kOp, outputs, inputs);
}

namespace {

// The flat forms' checks: `output` holds `times` times the inputs' elements, or 1/`parts` of
// them (every input's count a multiple of `parts`).
void check_flat(std::string_view op, const Tensor& output, const std::vector<Tensor>* inputs,
                int64_t times, int64_t parts = 1) {
  if (inputs == nullptr) throw InvalidArgument(fmt::format("{}: null input list", op));
  if (!usable(output)) check_buffer(op, output, "output");
  if (output.dim() != 1) {
    throw ShapeError(fmt::format("{}: the output must be one-dimensional, got {}", op,
                                 type_str(output.dtype(), output.sizes())));
  }
  const Range out = range_of(output, 0, true);
  int64_t total = 0;
  for (size_t i = 0; i < inputs->size(); ++i) {
    const Tensor& in = (*inputs)[i];
    // The names are formatted only for a message: a bucket passes thousands of inputs.
    if (!usable(in)) check_buffer(op, in, fmt::format("input {}", i));
    if (in.dtype() != output.dtype()) {
      check_same_dtype(op, output, "output", in, fmt::format("input {}", i));
    }
    total += in.numel();
    if (in.numel() % parts != 0) {
      throw ShapeError(fmt::format("{}: input {} has {} elements, not a multiple of the group "
                                   "size {}", op, i, in.numel(), parts));
    }
    if (in.numel() > 0 && in.storage().get() == out.storage) {
      const Range r = range_of(in, i, false);
      if (r.begin < out.end && out.begin < r.end) {
        throw InvalidArgument(fmt::format("{}: input {} shares bytes with the output", op, i));
      }
    }
  }
  if (total * times != output.numel() * parts) {
    const std::string expected = times > 1   ? fmt::format(" ({}x: {})", times, total * times)
                                 : parts > 1 ? fmt::format(" (1/{}: {})", parts, total / parts)
                                             : "";
    throw ShapeError(fmt::format("{}: the inputs hold {} elements{} but the output has {}", op,
                                 total, expected, output.numel()));
  }
}

}  // namespace

void check_all_reduce_flat(const Tensor& output, const std::vector<Tensor>* inputs,
                           ReduceOp reduce_op) {
  check_flat("all_reduce_flat", output, inputs, 1);
  check_reduce("all_reduce_flat", reduce_op, output.dtype());
}

void check_all_gather_flat(const ProcessGroup& group, const Tensor& output,
                           const std::vector<Tensor>* inputs) {
  check_flat("all_gather_flat", output, inputs, group.size());
}

void check_reduce_scatter_flat(const ProcessGroup& group, const Tensor& output,
                               const std::vector<Tensor>* inputs, ReduceOp reduce_op) {
  check_flat("reduce_scatter_flat", output, inputs, 1, group.size());
  check_reduce("reduce_scatter_flat", reduce_op, output.dtype());
}

void check_outputs_apart(std::string_view op, const std::vector<Tensor>& outputs,
                         const std::vector<Tensor>& inputs, InPlace in_place, int rank) {
  const size_t block = in_place == InPlace::kOwnInput ? 0 : static_cast<size_t>(rank);
  if (outputs_clearly_apart(outputs, inputs, block)) return;
  std::vector<Range> ranges;
  ranges.reserve(3 * outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].numel() == 0) continue;
    const Range o = range_of(outputs[i], i, true);
    const Range n = range_of(inputs[i], i, false);
    ranges.push_back(o);
    if (!in_place_pair(outputs[i], inputs[i], block)) {
      ranges.push_back(n);
      continue;
    }
    // In place, the shared bytes count as the output's; an input larger than its output
    // (reduce_scatter) keeps the bytes on either side.
    if (n.begin < o.begin) ranges.push_back(Range{n.storage, n.begin, o.begin, i, false});
    if (o.end < n.end) ranges.push_back(Range{n.storage, o.end, n.end, i, false});
  }
  // In begin order, a range overlaps an earlier one iff it starts before the largest end so
  // far; inputs may overlap each other (they are only read), nothing may overlap an output.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    if (a.storage != b.storage) return std::less<>()(a.storage, b.storage);
    // Ties in a fixed order, so every rank names the same pair.
    return std::tie(a.begin, a.output, a.index) < std::tie(b.begin, b.output, b.index);
  });
  const Range* last_any = nullptr;     // largest end in this storage
  const Range* last_output = nullptr;  // largest end of an output in this storage
  auto name = [](const Range& r) {
    return fmt::format("{} {}", r.output ? "output" : "input", r.index);
  };
  for (const Range& r : ranges) {
    if (last_any != nullptr && last_any->storage != r.storage) last_any = last_output = nullptr;
    const Range* hit = r.output ? last_any : last_output;
    if (hit != nullptr && hit->end > r.begin) {
      throw InvalidArgument(fmt::format("{}: {} overlaps {} ({})", op, name(*hit), name(r),
                                        in_place_rule(in_place, rank)));
    }
    if (last_any == nullptr || r.end > last_any->end) last_any = &r;
    if (r.output && (last_output == nullptr || r.end > last_output->end)) last_output = &r;
  }
}

void check_pair_apart(std::string_view op, const Tensor& output, const Tensor& input,
                      std::optional<InPlace> in_place, int rank) {
  if (!output.shares_storage(input) || output.numel() == 0 || input.numel() == 0) return;
  const Range o = range_of(output, 0, true);
  const Range n = range_of(input, 0, false);
  if (o.end <= n.begin || n.end <= o.begin) return;
  if (in_place && in_place_pair(output, input, static_cast<size_t>(rank))) return;
  throw InvalidArgument(fmt::format("{}: output overlaps input ({})", op,
                                    in_place ? in_place_rule(*in_place, rank)
                                             : std::string("it has no in-place form")));
}

std::optional<std::vector<int>> check_split(const ProcessGroup& parent,
                                            const std::vector<std::vector<int>>& rank_lists,
                                            const std::string& new_name) {
  if (new_name.empty()) {
    throw InvalidArgument(fmt::format("{}: the group name is empty", split_caller()));
  }
  // A name registered here is refused by agree_on_split, on every rank at once.
  const std::vector<int>& members = parent.global_ranks();
  const int me = members[parent.rank()];
  std::optional<std::vector<int>> mine;
  std::vector<int> seen;
  for (const auto& list : rank_lists) {
    if (list.empty()) {
      throw InvalidArgument(fmt::format("{}: a rank list is empty", split_caller()));
    }
    for (int r : list) {
      if (std::find(members.begin(), members.end(), r) == members.end()) {
        throw InvalidArgument(fmt::format("{}: rank {} is not in group '{}' (ranks {})",
                                          split_caller(), r, parent.name(),
                                          format_ranks(members)));
      }
      if (std::find(seen.begin(), seen.end(), r) != seen.end()) {
        throw InvalidArgument(
            fmt::format("{}: rank {} appears in more than one place", split_caller(), r));
      }
      seen.push_back(r);
      if (r == me) mine = list;
    }
  }
  return mine;
}

std::string split_description(const std::vector<std::vector<int>>& rank_lists,
                              const std::string& new_name) {
  std::vector<std::string> lists;
  for (const auto& list : rank_lists) lists.push_back(format_ranks(list));
  return fmt::format("[{}] as '{}'", fmt::join(lists, ", "), new_name);
}

Tensor split_probe(const std::string& description, bool taken) {
  uint64_t hash = 14695981039346656037ull;  // FNV-1a
  for (const unsigned char c : description) hash = (hash ^ c) * 1099511628211ull;
  const auto hi = static_cast<int64_t>(hash >> 32), lo = static_cast<int64_t>(hash & 0xffffffff);
  const auto len = static_cast<int64_t>(description.size());
  const int64_t flag = taken ? 1 : 0;
  return Tensor::from_vector<int64_t>({hi, lo, len, flag, -hi, -lo, -len, -flag}, {8});
}

void note_split(const ProcessGroup& parent, const std::vector<std::vector<int>>& rank_lists) {
  GroupRegistry& registry = parent.registry();
  const std::shared_ptr<ProcessGroup> world = registry.find("world");
  if (world && parent.size() == world->size()) registry.add_world_split(rank_lists);
}

namespace {

// Every agreement step between ranks (agree's, agree_on_split's) begins with one all_reduce,
// op max, of this header: its kind `step` for `what` as a number every rank computes alike
// (FNV-1a, 62 bits: its negation fits) and the negation. Steps of different sizes or ops would
// otherwise pair on the process backends without FUNCOL_DEBUG=detail (a rank aborted inside
// Gloo's transport; mpi truncated one rank's data and went on).
std::vector<int64_t> step_header(std::string_view step, const char* what) {
  uint64_t h = 14695981039346656037ull;
  auto mix = [&](std::string_view text) {
    for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  };
  mix(step);
  mix(what);
  const auto kind = static_cast<int64_t>(h >> 2);
  return {kind, -kind};
}

// Whether the all-reduced headers say every rank ran the same step.
bool same_step(const std::vector<int64_t>& header) { return header[0] == -header[1]; }

// Every rank's error when they did not (the group stays usable: each ran one header).
CommError different_steps(const ProcessGroup& group, std::string_view step, const char* what) {
  return CommError(fmt::format(
      "{} on group '{}': the ranks ran different steps of funcol's agreement between ranks: "
      "this rank ran its {} step (ranks that make a group differently, such as different names, "
      "a named group against an unnamed one or a DeviceMesh against a new_group, or one that "
      "makes a group or an Executor while another does something else; FUNCOL_DEBUG=detail "
      "names each rank's step)",
      what, group.name(), step));
}

}  // namespace

Tensor split_header() {
  return Tensor::from_vector<int64_t>(step_header("split", split_caller()), {2});
}

void agree_on_split(ProcessGroup& parent, int split,
                    const std::vector<std::vector<int>>& rank_lists, const std::string& new_name) {
  const int n = parent.size();
  // Where the name is taken on this rank: after the agreement, every rank refuses the same way.
  std::string taken;
  if (auto existing = parent.registry().find(new_name)) {
    taken = fmt::format("{}: group name '{}' is already registered (ranks {}) on rank {}",
                        split_caller(), new_name, format_ranks(existing->global_ranks()),
                        parent.global_ranks()[parent.rank()]);
  }
  if (n == 1) {
    if (!taken.empty()) throw InvalidArgument(taken);
    return;
  }
  const std::string mine = split_description(rank_lists, new_name);
  // The user called new_group (or made a mesh): a failure of the collectives below is theirs.
  auto run = [&](const std::function<std::shared_ptr<Work>()>& issue) {
    try {
      const InternalStep step(split_caller());
      issue()->wait();
    } catch (const CommError& e) {
      throw CommError(fmt::format("{} on group '{}' (split {}): {}", split_caller(),
                                  parent.name(), split, e.what()));
    }
  };
  auto gather = [&](Tensor& out, const Tensor& in) {
    run([&] { return parent.all_gather(out, in); });
  };
  // Ranks normally pass the same and the name is free: an all_reduce of a hash of what each
  // passed says so in a few bytes a rank. Only otherwise are the texts gathered, for the
  // message (gathering them always cost O(n^2) bytes a rank: 649 MB for a new_group of 512
  // threads ranks, 5.2 GB at 1024).
  {
    Tensor header = split_header();
    run([&] { return parent.all_reduce(header, ReduceOp::Max); });
    if (!same_step(header.to_vector<int64_t>())) {
      throw different_steps(parent, "split", split_caller());
    }
    Tensor probe = split_probe(mine, !taken.empty());
    run([&] { return parent.all_reduce(probe, ReduceOp::Max); });
    const std::vector<int64_t> v = probe.to_vector<int64_t>();
    if (v[0] == -v[4] && v[1] == -v[5] && v[2] == -v[6] && v[3] == 0) return;
  }
  // "<what was passed>\n<where the name is taken, or nothing>", gathered in blocks of the
  // longest, whose lengths go first.
  const std::string record = mine + "\n" + taken;
  Tensor length = Tensor::full({1}, DType::I64, static_cast<int64_t>(record.size()));
  Tensor lengths = Tensor::empty({n}, DType::I64);
  gather(lengths, length);
  const std::vector<int64_t> sizes = lengths.to_vector<int64_t>();
  const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
  Tensor text = Tensor::zeros({longest}, DType::U8);
  std::memcpy(text.raw_data_ptr(), record.data(), record.size());
  Tensor texts = Tensor::empty({n * longest}, DType::U8);
  gather(texts, text);
  const char* all = static_cast<const char*>(texts.raw_data_ptr());
  auto part = [&](int r, bool second) {
    const std::string full(all + r * longest, sizes[r]);
    const size_t cut = full.find('\n');
    return second ? full.substr(cut + 1) : full.substr(0, cut);
  };
  for (int r = 1; r < n; ++r) {
    if (part(r, false) != part(0, false)) {
      throw CommError(fmt::format(
          "{} on group '{}' (split {}): rank {} passed {} but rank {} passed {}{}", split_caller(),
          parent.name(), split, parent.global_ranks()[0], part(0, false),
          parent.global_ranks()[r], part(r, false),
          split_mismatch_hint() != nullptr ? fmt::format(" ({})", split_mismatch_hint())
                                           : std::string()));
    }
  }
  for (int r = 0; r < n; ++r) {
    if (!part(r, true).empty()) throw InvalidArgument(part(r, true));
  }
}

namespace {
// The labels InternalSteps were given, id - 1 indexing them (one per call site: a handful).
std::mutex g_step_labels_mu;
std::vector<const char*> g_step_labels;
thread_local uint8_t t_internal_step = 0;
thread_local const char* t_split_caller = "split_group";
thread_local const char* t_split_hint = nullptr;

uint8_t step_id(const char* label) {
  std::lock_guard<std::mutex> lock(g_step_labels_mu);
  for (size_t i = 0; i < g_step_labels.size(); ++i) {
    if (std::strcmp(g_step_labels[i], label) == 0) return static_cast<uint8_t>(i + 1);
  }
  FUNCOL_CHECK(g_step_labels.size() < 255, "too many internal step labels");
  g_step_labels.push_back(label);
  return static_cast<uint8_t>(g_step_labels.size());
}
}  // namespace

InternalStep::InternalStep(const char* label) : previous_(t_internal_step) {
  t_internal_step = step_id(label);
}

InternalStep::~InternalStep() { t_internal_step = previous_; }

uint8_t internal_step() { return t_internal_step; }

SplitCaller::SplitCaller(const char* name, const char* mismatch_hint)
    : previous_(t_split_caller), previous_hint_(t_split_hint) {
  t_split_caller = name;
  if (mismatch_hint != nullptr) t_split_hint = mismatch_hint;
}

SplitCaller::~SplitCaller() {
  t_split_caller = previous_;
  t_split_hint = previous_hint_;
}

const char* split_caller() { return t_split_caller; }

const char* split_mismatch_hint() { return t_split_hint; }

const char* step_label(uint8_t step) {
  if (step == 0) return nullptr;
  std::lock_guard<std::mutex> lock(g_step_labels_mu);
  return g_step_labels[step - 1];
}

std::string describe_step(const char* label) {
  if (label == nullptr) return {};
  if (std::strcmp(label, kBackwardStep) == 0) return " [issued by GradTape::backward]";
  return fmt::format(" [funcol's agreement step for {}]", label);
}

namespace {

// The all_reduce of `values` (i64) over `group` with `op`, for an agreement step of `what`.
std::vector<int64_t> all_reduce_step(ProcessGroup& group, std::vector<int64_t> values,
                                     ReduceOp op, const char* what) {
  const int64_t n = static_cast<int64_t>(values.size());
  Tensor t = Tensor::from_vector<int64_t>(values, {n});
  try {
    const InternalStep step(what);
    group.all_reduce(t, op)->wait();
  } catch (const CommError& e) {
    throw CommError(fmt::format("{}: agreeing with the other ranks of group '{}' failed: {}",
                                what, group.name(), e.what()));
  }
  return t.to_vector<int64_t>();
}

}  // namespace

void begin_step(ProcessGroup& group, std::string_view step, const char* what) {
  const std::vector<int64_t> header =
      all_reduce_step(group, step_header(step, what), ReduceOp::Max, what);
  if (!same_step(header)) throw different_steps(group, step, what);
}

namespace {

// An agreement step `step` of `what`: its header (begin_step), then `values` all-reduced.
std::vector<int64_t> agree(ProcessGroup& group, std::vector<int64_t> values, ReduceOp op,
                           std::string_view step, const char* what) {
  begin_step(group, step, what);
  return all_reduce_step(group, std::move(values), op, what);
}

}  // namespace

bool same_on_every_rank(ProcessGroup& group, int64_t value, const char* what) {
  const std::vector<int64_t> v =
      agree(group, {value, -value}, ReduceOp::Max, "same_on_every_rank", what);
  return v[0] == -v[1];
}

int64_t max_over_ranks(ProcessGroup& group, int64_t value, const char* what) {
  return agree(group, {value}, ReduceOp::Max, "max_over_ranks", what)[0];
}

int64_t and_over_ranks(ProcessGroup& group, int64_t bits, const char* what) {
  return agree(group, {bits}, ReduceOp::BAnd, "and_over_ranks", what)[0];
}

std::string agreed_group_name(ProcessGroup& group, const char* what) {
  GroupRegistry& registry = group.registry();
  for (;;) {
    const int64_t id = max_over_ranks(group, registry.next_group_id(), what);
    registry.skip_group_ids_through(id);
    std::string name = "group" + std::to_string(id);
    if (on_every_rank(group, registry.find(name) == nullptr, what)) return name;
  }
}

bool on_every_rank(ProcessGroup& group, bool flag, const char* what) {
  return same_on_every_rank(group, flag ? 1 : 0, what) && flag;
}

std::string first_free_name(ProcessGroup& group, const std::function<std::string(int)>& candidate,
                            const char* what) {
  for (int k = 1;; ++k) {
    std::string name = candidate(k);
    if (on_every_rank(group, group.registry().find(name) == nullptr, what)) return name;
  }
}

std::string failure_message(const Work& work, const std::string& fallback) {
  if (!work.failed()) return fallback;
  try {
    std::rethrow_exception(work.exception());
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return fallback;
  }
}

UnwaitedFailures UnwaitedFailures::of(int rank, const std::vector<std::shared_ptr<Work>>& failed,
                                      const std::vector<std::shared_ptr<Work>>& unwaited,
                                      bool dropped) {
  auto in = [](const std::vector<std::shared_ptr<Work>>& works, const std::shared_ptr<Work>& w) {
    return std::find(works.begin(), works.end(), w) != works.end();
  };
  UnwaitedFailures failures;
  failures.dropped_ = dropped;
  // Waiting for the unwaited ones at the rank's end counted their failures seen.
  for (const auto& work : failed) {
    if (in(unwaited, work) || !work->failure_seen(rank)) failures.note(*work);
  }
  for (const auto& work : unwaited) {
    if (!in(failed, work)) failures.note(*work);  // failed past a full ledger
  }
  return failures;
}

void FailureLedger::add(std::shared_ptr<Work> work, int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  // A failure may be noted twice (a late joiner of a failed Op both joins it and gets it).
  if (std::find(works_.begin(), works_.end(), work) != works_.end()) return;
  if (works_.size() >= kKept) {
    std::erase_if(works_, [&](const std::shared_ptr<Work>& w) { return w->failure_seen(rank); });
    if (works_.size() >= kKept) {
      dropped_ = true;
      return;
    }
  }
  works_.push_back(std::move(work));
}

void FailureLedger::replace(const std::shared_ptr<Work>& instead, std::shared_ptr<Work> work,
                            int rank) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find(works_.begin(), works_.end(), instead);
    if (it != works_.end()) {
      *it = std::move(work);
      return;
    }
  }
  add(std::move(work), rank);
}

std::vector<std::shared_ptr<Work>> FailureLedger::take(bool* dropped) {
  std::lock_guard<std::mutex> lock(mu_);
  if (dropped != nullptr) *dropped = std::exchange(dropped_, false);
  return std::exchange(works_, {});
}

void UnwaitedFailures::note(const Work& work) {
  if (!work.failed()) return;
  if (count_++ == 0) first_ = failure_message(work, "a non-standard exception");
}

void UnwaitedFailures::warn(int rank) const {
  if (count_ == 0) return;
  if (count_ == 1 && !dropped_) {
    fmt::print(stderr,
               "funcol: warning: rank {} ended with a collective it had not waited for, which "
               "failed: {}\n",
               rank, first_);
  } else {
    fmt::print(stderr,
               "funcol: warning: rank {} ended with {}{} collective{} it had not waited for, "
               "which failed; the first: {}\n",
               rank, dropped_ ? "at least " : "", count_, count_ == 1 ? "" : "s", first_);
  }
  std::fflush(stderr);
}

std::string format_ranks(const std::vector<int>& ranks) {
  constexpr size_t kItems = 16;
  if (ranks.size() <= kItems) return fmt::format("[{}]", fmt::join(ranks, ", "));
  // A job of thousands of ranks: runs of three or more as "first-last", at most kItems items.
  std::vector<std::string> items;
  for (size_t i = 0; i < ranks.size() && items.size() <= kItems;) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (j - i >= 2) {
      items.push_back(fmt::format("{}-{}", ranks[i], ranks[j]));
      i = j + 1;
    } else {
      items.push_back(std::to_string(ranks[i++]));
    }
  }
  if (items.size() <= kItems) return fmt::format("[{}]", fmt::join(items, ", "));
  items.resize(kItems);
  return fmt::format("[{}, ... ({} ranks in all)]", fmt::join(items, ", "), ranks.size());
}

std::optional<double> env_number(const char* name, std::string_view expected,
                                 bool (*valid)(double)) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return std::nullopt;
  // Decimal only, whatever the program's locale (strtod also read "0x10" as 16, and "0.5" as 0
  // under a locale whose decimal point is a comma); blanks around it and a '+' allowed.
  const char* first = env;
  const char* last = env + std::strlen(env);
  while (first < last && (*first == ' ' || *first == '\t')) ++first;
  while (last > first && (last[-1] == ' ' || last[-1] == '\t')) --last;
  if (last - first > 1 && *first == '+' && first[1] != '-') ++first;
  double value = 0;
  const auto [end, ec] = std::from_chars(first, last, value);
  // A number beyond a double's range (1e400, 1e-400) is refused as such: it may well be what
  // `expected` asks for.
  if (first != last && end == last && ec == std::errc::result_out_of_range) {
    throw InvalidArgument(fmt::format("{}={}: out of range; expected {}", name, env, expected));
  }
  if (first == last || end != last || ec != std::errc() || !std::isfinite(value) ||
      !valid(value)) {
    throw InvalidArgument(fmt::format("{}={}: expected {}", name, env, expected));
  }
  return value;
}

}  // namespace funcol::dist_detail
