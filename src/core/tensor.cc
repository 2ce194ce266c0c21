// Tensor and Storage: layout, views, copies, factories and pending-storage waiting.
#include "funcol/core/tensor.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "elem.h"
#include "funcol/core/allocator.h"
#include "memory.h"
#include "strided.h"

namespace funcol {

using detail::BoolByte;
using detail::cvt;
using detail::dispatch;
using detail::for_each_row;
using detail::kIsLowFloat;
using detail::load_elem;
using detail::store_elem;

// ---------------------------------------------------------------------------------------------
// Shape helpers

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

int64_t shape_numel(const Shape& shape) {
  // A zero dim makes the product zero whatever the others are: found first, the product of
  // the others (which need not fit in int64) is never taken.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) {
      throw ShapeError(fmt::format("shape {} has more elements than an int64 holds",
                                   shape_str(shape)));
    }
  }
  return n;
}

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string type_str(DType dtype, const Shape& shape) {
  return std::string(dtype_name(dtype)) + shape_str(shape);
}

namespace {

std::shared_ptr<const detail::Layout> make_layout(Shape sizes, Shape strides) {
  auto layout = std::make_shared<detail::Layout>();
  layout->numel = shape_numel(sizes);
  int64_t expected = 1;
  // An empty tensor is contiguous, whatever its strides (so the loop does not look).
  for (size_t i = sizes.size(); layout->numel > 0 && i-- > 0;) {
    if (sizes[i] == 1) continue;
    if (strides[i] != expected) {
      layout->contiguous = false;
      break;
    }
    expected *= sizes[i];
  }
  layout->sizes = std::move(sizes);
  layout->strides = std::move(strides);
  return layout;
}

// Contiguous layouts are interned: the first kMaxInterned shapes a process uses get one
// layout each, made once, shared by every thread and never freed. A Tensor holds an interned
// layout through a shared_ptr that owns nothing (the aliasing constructor on an empty one), so
// copying or destroying the Tensor counts no reference on it: of the two atomic operations a
// Tensor copy costs (storage and layout) one is left. Atomic read-modify-writes cost 6-9 ns
// each on the 2-core test host, and a bucket of a thousand results makes and drops a thousand
// views. Shapes past the cap get counted layouts of their own.
class LayoutInterns {
 public:
  static constexpr size_t kMaxInterned = 4096;

  // The interned contiguous layout of `shape`, or null when the table is full.
  static const detail::Layout* find_or_add(const Shape& shape) {
    LayoutInterns& t = instance();
    {
      std::shared_lock<std::shared_mutex> lock(t.mu_);
      auto it = t.layouts_.find(shape);
      if (it != t.layouts_.end()) return it->second.get();
      if (t.layouts_.size() >= kMaxInterned) return nullptr;
    }
    std::lock_guard<std::shared_mutex> lock(t.mu_);
    auto it = t.layouts_.find(shape);  // another thread may have added it meanwhile
    if (it != t.layouts_.end()) return it->second.get();
    if (t.layouts_.size() >= kMaxInterned) return nullptr;
    auto layout = std::make_unique<detail::Layout>(*make_layout(shape, contiguous_strides(shape)));
    const detail::Layout* raw = layout.get();
    t.layouts_.emplace(shape, std::move(layout));
    return raw;
  }

 private:
  // Never destroyed: tensors in static or thread_local objects may outlive any destructor order.
  static LayoutInterns& instance() {
    static LayoutInterns* t = [] {
      auto* interns = new LayoutInterns;
      detail::fork_safe(&interns->mu_);  // a child makes tensors of new shapes too
      return interns;
    }();
    return *t;
  }
  std::shared_mutex mu_;
  std::map<Shape, std::unique_ptr<const detail::Layout>> layouts_;
};

// A shared_ptr to an interned layout that owns nothing: copies count no references.
std::shared_ptr<const detail::Layout> unowned(const detail::Layout* layout) {
  return std::shared_ptr<const detail::Layout>(std::shared_ptr<const detail::Layout>(), layout);
}

// The last few contiguous layouts this thread used, for reuse without the interning table's
// lock: tensors of a shape seen recently (a kernel's outputs, a bucket's members, the pieces of
// a split) share one and allocate nothing for it. Layouts are immutable, so a Tensor may carry
// one to another thread.
class LayoutCache {
 public:
  ~LayoutCache() { tl_gone = true; }
  // The contiguous layout of `shape`: from this thread's cache, else the interned one, else the
  // one `make()` builds (the table is full), which the cache keeps. After this thread's cache
  // was destroyed (a tensor made by a static or thread_local destructor that runs after it),
  // the interned one or `make()`'s.
  template <typename Make>
  static std::shared_ptr<const detail::Layout> get(const Shape& shape, Make make) {
    if (tl_gone) return interned_or(shape, make);
    for (auto& e : tl_cache.entries_) {
      if (e && e->sizes == shape) return e;
    }
    std::shared_ptr<const detail::Layout> layout = interned_or(shape, make);
    tl_cache.entries_[tl_cache.next_] = layout;
    tl_cache.next_ = (tl_cache.next_ + 1) % kEntries;
    return layout;
  }

 private:
  template <typename Make>
  static std::shared_ptr<const detail::Layout> interned_or(const Shape& shape, Make make) {
    const detail::Layout* interned = LayoutInterns::find_or_add(shape);
    return interned != nullptr ? unowned(interned) : make();
  }

  static constexpr size_t kEntries = 16;
  std::array<std::shared_ptr<const detail::Layout>, kEntries> entries_;
  size_t next_ = 0;  // round-robin replacement
  static thread_local LayoutCache tl_cache;
  static thread_local bool tl_gone;  // trivially destructible: readable after tl_cache is gone
};
thread_local LayoutCache LayoutCache::tl_cache;
thread_local bool LayoutCache::tl_gone = false;

// The contiguous layout of `shape`, from the cache when it holds one.
std::shared_ptr<const detail::Layout> contiguous_layout(const Shape& shape) {
  return LayoutCache::get(shape, [&] { return make_layout(shape, contiguous_strides(shape)); });
}

// Whether `strides` equal contiguous_strides(sizes), checked without building those.
bool has_contiguous_strides(const Shape& sizes, const Shape& strides) {
  int64_t expected = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    if (strides[i] != expected) return false;
    expected *= std::max<int64_t>(sizes[i], 1);
  }
  return true;
}

// The layout of a view: a shared one from the cache when the strides are exactly the
// contiguous ones (a split along dim 0, a view of a contiguous tensor), else its own.
std::shared_ptr<const detail::Layout> view_layout(Shape sizes, Shape strides) {
  if (!has_contiguous_strides(sizes, strides)) {
    return make_layout(std::move(sizes), std::move(strides));
  }
  return LayoutCache::get(sizes, [&] { return make_layout(std::move(sizes), std::move(strides)); });
}

std::string list_str(const std::vector<int64_t>& v) { return shape_str(v); }

// Validates a shape given to a factory: no negative dims, byte size representable.
// The nonzero dims must multiply to an int64 byte count even in a zero-sized tensor (as the
// IR's check_type): then its strides and every product of some of its dims fit too.
void check_shape(const Shape& shape, DType dtype, const char* what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      throw ShapeError(fmt::format("{}: negative size {} in shape {}", what, d, shape_str(shape)));
    }
    if (d != 0 && __builtin_mul_overflow(n, d, &n)) {
      throw InvalidArgument(fmt::format("{}: shape {} is too large", what, shape_str(shape)));
    }
  }
  int64_t bytes;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(itemsize(dtype)), &bytes)) {
    throw InvalidArgument(fmt::format("{}: shape {} is too large", what, shape_str(shape)));
  }
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* what) {
  if (dim < -ndim || dim >= ndim) {
    throw ShapeError(
        fmt::format("{}: dim {} is out of range for a tensor of rank {}", what, dim, ndim));
  }
  return dim < 0 ? dim + ndim : dim;
}

void check_defined(const Tensor& t, const char* what) {
  if (!t.defined()) throw InvalidArgument(fmt::format("{} on an undefined tensor", what));
}

// A written tensor whose elements share memory (a stride of 0 on a dim of size > 1, as
// expand() makes) would be written once per alias: PyTorch refuses such writes, so do we.
void check_no_internal_overlap(const Tensor& t, const char* what) {
  if (t.numel() == 0) return;  // nothing is written (as PyTorch: an empty tensor is dense)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) {
      throw InvalidArgument(fmt::format(
          "{}: more than one element of the written-to tensor ({}, strides {}) refers to a single "
          "memory location (dim {} has stride 0); clone() it first",
          what, type_str(t.dtype(), t.sizes()), shape_str(t.strides()), d));
    }
  }
}

// A value written into a dtype must be representable there: no finite value that rounds to
// infinity in f32, f16 or bf16 (inf and nan themselves are kept), no integer an integer dtype
// cannot hold: PyTorch's "value cannot be converted to type at::Half without overflow". As
// there (c10::overflows), a negative integer down to minus an unsigned dtype's largest value
// wraps (-1 as u8 is 255, -256 an error); a negative double does not. V is double or int64_t.
// `what` (nullptr: none) starts the message.
template <typename V>
void check_value_fits(DType dtype, V value, const char* what) {
  bool fits = true;
  dispatch(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    if constexpr (std::is_integral_v<S> && !std::is_same_v<S, bool>) {
      if constexpr (std::is_integral_v<V>) {
        fits = std::in_range<S>(value);
        if constexpr (std::is_unsigned_v<S> && sizeof(S) < 8) {
          fits = fits || (value < 0 && value >= -static_cast<V>(std::numeric_limits<S>::max()));
        }
      } else {
        // [lowest, max], as PyTorch's overflow check (255.5 does not fit u8, though it would
        // truncate to 255); for int64, whose max is no double, [lowest, max + 1 = 2^63).
        const double lo = static_cast<double>(std::numeric_limits<S>::lowest());
        const double max = static_cast<double>(std::numeric_limits<S>::max());
        fits = value >= lo && (sizeof(S) == 8 ? value < max + 1.0 : value <= max);
      }
    } else if constexpr (std::is_same_v<S, float> || kIsLowFloat<S>) {
      // PyTorch's check: a finite value beyond the dtype's largest finite one overflows, even
      // where it would round down to it (65505 for f16); infinities and NaN convert.
      const double d = static_cast<double>(value);
      if (std::isfinite(d)) fits = std::fabs(d) <= cvt<double>(std::numeric_limits<S>::max());
    }
  });
  if (!fits) {
    throw InvalidArgument(fmt::format("{}{}value {} cannot be converted to {} without overflow",
                                      what ? what : "", what ? ": " : "", value,
                                      dtype_name(dtype)));
  }
}

void check_not_meta(const Tensor& t, const char* what) {
  check_defined(t, what);
  if (t.is_meta()) {
    throw InvalidArgument(fmt::format("{} on a meta tensor {} (it has no data)", what,
                                      type_str(t.dtype(), t.sizes())));
  }
}

// The storage offset of a view `index` elements of `stride` past `t`'s. It must stay an int64
// count of bytes (first_element and view_dtype scale it by the itemsize): a view of a tensor
// with elements stays inside its storage, but views of an empty one (narrowed to the end of one
// dim, then of another) add products of sizes and strides that can leave int64.
int64_t view_offset(const Tensor& t, int64_t index, int64_t stride, const char* what) {
  int64_t offset = 0;
  int64_t bytes = 0;
  if (__builtin_mul_overflow(index, stride, &offset) ||
      __builtin_add_overflow(t.storage_offset(), offset, &offset) ||
      __builtin_mul_overflow(offset, static_cast<int64_t>(t.itemsize()), &bytes)) {
    throw ShapeError(fmt::format(
        "{}: storage offset {} + {} * stride {} does not fit in int64 (as bytes of {})", what,
        t.storage_offset(), index, stride, dtype_name(t.dtype())));
  }
  return offset;
}

// Resolves one -1 in a requested shape against numel.
Shape infer_shape(const Shape& shape, int64_t numel, const char* what) {
  Shape out = shape;
  int64_t known = 1;  // the product of the nonzero given dims (then 0 if any is 0)
  bool zero = false;
  // Those dims multiply past int64: no tensor has that shape, not even an empty one (see
  // check_shape).
  bool overflow = false;
  std::optional<size_t> infer;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer) {
        throw ShapeError(
            fmt::format("{}: only one dimension can be -1, got shape {}", what, shape_str(shape)));
      }
      infer = i;
    } else if (shape[i] < 0) {
      throw ShapeError(
          fmt::format("{}: invalid size {} in shape {}", what, shape[i], shape_str(shape)));
    } else if (shape[i] == 0) {
      zero = true;
    } else {
      overflow = overflow || __builtin_mul_overflow(known, shape[i], &known);
    }
  }
  if (zero) known = 0;
  if (overflow) {
    throw ShapeError(fmt::format("{}: shape {} is invalid for a tensor of {} elements", what,
                                 shape_str(shape), numel));
  }
  if (infer) {
    if (known == 0) {
      throw ShapeError(fmt::format(
          "{}: cannot infer the -1 in shape {} for a tensor of {} elements (any size fits)", what,
          shape_str(shape), numel));
    }
    if (numel % known != 0) {
      throw ShapeError(fmt::format("{}: shape {} is invalid for a tensor of {} elements", what,
                                   shape_str(shape), numel));
    }
    out[*infer] = numel / known;
  } else if (known != numel) {
    throw ShapeError(fmt::format("{}: shape {} is invalid for a tensor of {} elements", what,
                                 shape_str(shape), numel));
  }
  return out;
}

// Strides that view (old_sizes, old_strides) as new_sizes without copying, if they exist.
// Walks both shapes from the innermost dim, matching runs of old dims that are contiguous with
// each other ("chunks") against runs of new dims with the same element count.
std::optional<Shape> view_strides(const Shape& old_sizes, const Shape& old_strides,
                                  const Shape& new_sizes) {
  Shape new_strides(new_sizes.size(), 0);
  if (old_sizes.empty()) {
    return contiguous_strides(new_sizes);
  }
  if (shape_numel(old_sizes) == 0) return contiguous_strides(new_sizes);
  int64_t view_d = static_cast<int64_t>(new_sizes.size()) - 1;
  int64_t chunk_base_stride = old_strides.back();
  int64_t tensor_numel = 1;
  int64_t view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(old_sizes.size()) - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= old_sizes[tensor_d];
    // Strides of meta tensors (no storage) may be so large that these products overflow: a
    // product past int64 is no stride the old layout has, nor one the view could have.
    int64_t next_stride = 0;
    const bool next_fits =
        !__builtin_mul_overflow(tensor_numel, chunk_base_stride, &next_stride);
    bool chunk_ends = tensor_d == 0 || (old_sizes[tensor_d - 1] != 1 &&
                                        (!next_fits || old_strides[tensor_d - 1] != next_stride));
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || new_sizes[view_d] == 1)) {
      if (__builtin_mul_overflow(view_numel, chunk_base_stride, &new_strides[view_d])) {
        return std::nullopt;
      }
      view_numel *= new_sizes[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return std::nullopt;
    if (tensor_d > 0) {
      chunk_base_stride = old_strides[tensor_d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return new_strides;
}

// Copies (and converts) the elements of one strided layout into another of the same sizes.
using RowFn = void (*)(const char* src, int64_t src_stride, char* dst, int64_t dst_stride,
                       int64_t n);

template <typename S, typename D>
void copy_row(const char* src, int64_t ss, char* dst, int64_t ds, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    if (ss == 1 && ds == 1) {
      std::memmove(dst, src, static_cast<size_t>(n) * sizeof(S));
      return;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    store_elem<D>(dst + i * ds * static_cast<int64_t>(sizeof(D)),
                  cvt<D>(load_elem<S>(src + i * ss * static_cast<int64_t>(sizeof(S)))));
  }
}

RowFn row_fn(DType src, DType dst) {
  return dispatch(src, [&](auto s) {
    using S = typename decltype(s)::type;
    return dispatch(dst, [&](auto d) -> RowFn {
      using D = typename decltype(d)::type;
      return &copy_row<S, D>;
    });
  });
}

// Element copy between two layouts with equal sizes. Pointers are at the first elements;
// neither side is waited here.
void copy_elements(const void* src, DType src_dtype, const Shape& src_strides, void* dst,
                   DType dst_dtype, const Shape& dst_strides, const Shape& sizes) {
  RowFn fn = row_fn(src_dtype, dst_dtype);
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  const auto sis = static_cast<int64_t>(itemsize(src_dtype));
  const auto dis = static_cast<int64_t>(itemsize(dst_dtype));
  for_each_row<2>(
      sizes, {&src_strides, &dst_strides},
      [&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& inner) {
        fn(s + off[0] * sis, inner[0], d + off[1] * dis, inner[1], n);
      });
}

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Significand bits of a floating storage type: rand draws that many bits so that 2u - 1 is
// exactly representable and never rounds up to 1.
template <typename T>
constexpr int rand_bits() {
  if constexpr (std::is_same_v<T, Eigen::half>) return 11;
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return 8;
  if constexpr (std::is_same_v<T, float>) return 24;
  return 53;
}

template <typename T>
std::string format_elem(T v) {
  if constexpr (std::is_same_v<T, BoolByte>) {
    return v.v != 0 ? "true" : "false";
  } else if constexpr (detail::kIsLowFloat<T>) {
    return format_elem(detail::low_to_float(v));
  } else if constexpr (std::is_floating_point_v<T>) {
    // fmt writes "-nan" for a NaN with its sign bit set; a NaN has no sign (PyTorch: "nan").
    return std::isnan(v) ? std::string("nan") : fmt::format("{}", v);
  } else {
    return std::to_string(static_cast<int64_t>(v));
  }
}

// Maps a public element type to its dtype; long long is I64 where it is not int64_t.
template <typename T>
constexpr DType dtype_for() {
  if constexpr (std::is_same_v<T, long long> && !std::is_same_v<long long, int64_t>) {
    return DType::I64;
  } else {
    return dtype_of<T>;
  }
}

template <typename T>
using StorageOf = std::conditional_t<std::is_same_v<T, bool>, BoolByte, T>;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Storage

namespace {

// A failed allocation throws funcol::Error (memory.h), a request beyond the machine's memory
// before asking.
void* allocate_or_throw(size_t nbytes) {
  if (!detail::beyond_memory(nbytes)) {
    try {
      return allocate_storage(nbytes);
    } catch (const std::bad_alloc&) {
    }
  }
  throw Error(fmt::format("out of memory: cannot allocate {} bytes", nbytes));
}

// Waits for `works` (taken from `list` under `mu`) without the lock (other threads may wait on
// the same works, and a work's completion may attach or query the storage), then detaches from
// `list` those that succeeded, and the failed ones too unless `failures_stay`. Returns the
// first failure when one stays attached.
std::exception_ptr wait_and_detach(std::mutex& mu, std::vector<std::shared_ptr<Waitable>>& list,
                                   const std::vector<std::shared_ptr<Waitable>>& works,
                                   bool failures_stay) {
  std::exception_ptr first_failure;
  // What was waited and leaves (looked up only): a set, since the list can be long.
  std::unordered_set<const Waitable*> detached;
  // An operation attached twice (not one after the other) is waited once.
  std::unordered_set<const Waitable*> tried;
  for (const auto& w : works) {
    if (!tried.insert(w.get()).second) continue;
    try {
      w->wait();
    } catch (...) {
      if (failures_stay) {
        if (!first_failure) first_failure = std::current_exception();
        continue;
      }
    }
    detached.insert(w.get());
  }
  std::lock_guard<std::mutex> lock(mu);
  std::erase_if(list,
                [&](const std::shared_ptr<Waitable>& w) { return detached.contains(w.get()); });
  return first_failure;
}

}  // namespace

Storage::Storage(size_t nbytes) : data_(allocate_or_throw(nbytes)), nbytes_(nbytes) {}

Storage::~Storage() { free_storage(data_, nbytes_); }

void Storage::add_pending(std::shared_ptr<Waitable> work) {
  FUNCOL_CHECK(work != nullptr, "add_pending: null work");
  std::vector<std::shared_ptr<Waitable>> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // One collective attaches itself once per view of these bytes, one after the other.
    if (!pending_.empty() && pending_.back() == work) return;
    pending_.push_back(std::move(work));
    has_pending_.store(true, std::memory_order_release);
    // Whenever the list doubled since the last time, the completed operations are detached,
    // except failed ones (they stay, as Storage::wait keeps them). Whether one failed is known
    // only by waiting on it.
    if (pending_.size() < prune_pending_at_) return;
    prune_pending_at_ = 2 * pending_.size();
    for (const auto& w : pending_) {
      if (w->is_completed()) done.push_back(w);
    }
  }
  (void)wait_and_detach(mu_, pending_, done, /*failures_stay=*/true);
  std::lock_guard<std::mutex> lock(mu_);
  prune_pending_at_ = std::max(kPrunePendingAt, 2 * pending_.size());
}

bool Storage::is_ready() const {
  if (!has_pending_.load(std::memory_order_acquire)) return true;
  std::vector<std::shared_ptr<Waitable>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending = pending_;
  }
  // Polled without the lock: a poll may fail the operation, whose completion may query this
  // storage.
  for (const auto& w : pending) {
    if (!w->poll()) return false;
  }
  return true;
}

namespace {

// Waits for every operation of `list` until it is empty, a snapshot at a time (wait_and_detach).
// With `failures_stay` a failed operation stays attached and the first failure is returned (see
// Storage::wait); otherwise failures are ignored (readers: their failure is their result's, not
// these bytes').
std::exception_ptr drain(std::mutex& mu, std::vector<std::shared_ptr<Waitable>>& list,
                         std::atomic<bool>& attached, bool failures_stay) {
  while (true) {
    std::vector<std::shared_ptr<Waitable>> snapshot;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (list.empty()) {
        attached.store(false, std::memory_order_release);
        return nullptr;
      }
      snapshot = list;
    }
    if (std::exception_ptr failure = wait_and_detach(mu, list, snapshot, failures_stay)) {
      return failure;
    }
  }
}

}  // namespace

void Storage::wait() {
  if (!has_pending_.load(std::memory_order_acquire)) return;
  {
    // The usual case: one attached operation, already completed (the caller waited on its
    // Work first). It stays attached while it is waited, so that a concurrent reader cannot see
    // an empty list and read bytes a failed operation never produced; it is detached after.
    std::shared_ptr<Waitable> only;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_.empty()) {
        has_pending_.store(false, std::memory_order_release);
        return;
      }
      if (pending_.size() == 1 && pending_[0]->is_completed()) only = pending_[0];
    }
    if (only) {
      only->wait();  // completed: returns, or rethrows (a failure stays attached)
      std::lock_guard<std::mutex> lock(mu_);
      std::erase(pending_, only);
      if (pending_.empty()) {
        has_pending_.store(false, std::memory_order_release);
        return;
      }
      // Another operation was attached meanwhile: wait for it below.
    }
  }
  if (std::exception_ptr failure = drain(mu_, pending_, has_pending_, /*failures_stay=*/true)) {
    std::rethrow_exception(failure);
  }
}

void Storage::wait_all(std::span<Storage* const> storages) {
  // Each distinct operation once, in the order the storages list them (lookups only).
  std::vector<std::shared_ptr<Waitable>> works;
  std::unordered_set<const Waitable*> seen;
  for (Storage* s : storages) {
    if (s == nullptr || !s->has_pending_.load(std::memory_order_acquire)) continue;
    std::lock_guard<std::mutex> lock(s->mu_);
    for (const auto& w : s->pending_) {
      if (seen.insert(w.get()).second) works.push_back(w);
    }
  }
  // Waited while still attached (see wait()), detached after; a failure stops the waits and
  // stays attached.
  std::unordered_set<const Waitable*> done;
  std::exception_ptr failure;
  for (const auto& w : works) {
    try {
      w->wait();
    } catch (...) {
      failure = std::current_exception();
      break;
    }
    done.insert(w.get());
  }
  for (Storage* s : storages) {
    if (s == nullptr || done.empty()) continue;
    std::lock_guard<std::mutex> lock(s->mu_);
    std::erase_if(s->pending_,
                  [&](const std::shared_ptr<Waitable>& w) { return done.contains(w.get()); });
  }
  if (failure) std::rethrow_exception(failure);
  // What was attached meanwhile, and the flags of the lists now empty.
  for (Storage* s : storages) {
    if (s != nullptr) s->wait();
  }
}

size_t Storage::pending_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::unordered_set<const Waitable*> distinct;
  for (const auto& w : pending_) distinct.insert(w.get());
  return distinct.size();
}

void Storage::add_reader(std::shared_ptr<Waitable> work) {
  FUNCOL_CHECK(work != nullptr, "add_reader: null work");
  std::lock_guard<std::mutex> lock(mu_);
  // One collective attaches itself once per view of these bytes, one after the other.
  if (!readers_.empty() && readers_.back() == work) return;
  // A buffer read by many collectives and never written in between would collect them all:
  // finished ones are dropped whenever the list doubled since the last time (amortised O(1)).
  if (readers_.size() >= prune_readers_at_) {
    std::erase_if(readers_, [](const std::shared_ptr<Waitable>& w) { return w->is_completed(); });
    prune_readers_at_ = std::max(kPruneReadersAt, 2 * readers_.size());
  }
  readers_.push_back(std::move(work));
  has_readers_.store(true, std::memory_order_release);
}

void Storage::wait_for_write() {
  version_.fetch_add(1, std::memory_order_acq_rel);
  if (has_readers_.load(std::memory_order_acquire)) {
    drain(mu_, readers_, has_readers_, /*failures_stay=*/false);
  }
  wait();
}

size_t Storage::reader_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return readers_.size();
}

// ---------------------------------------------------------------------------------------------
// Factories

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  check_shape(shape, dtype, "empty");
  auto storage = std::allocate_shared<Storage>(
      detail::SlotAllocator<Storage>(),
      static_cast<size_t>(shape_numel(shape)) * funcol::itemsize(dtype));
  return from_storage(std::move(storage), shape, dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  check_shape(shape, dtype, "zeros");
  Tensor t = empty(shape, dtype);
  std::memset(t.raw_data_ptr(), 0, t.nbytes());
  return t;
}

namespace {

template <typename V>
Tensor full_of(const Shape& shape, DType dtype, V value) {
  check_shape(shape, dtype, "full");
  check_value_fits(dtype, value, "full");
  Tensor t = Tensor::empty(shape, dtype);
  t.fill_(value);
  return t;
}

}  // namespace

void check_fill_value(DType dtype, double value) { check_value_fits(dtype, value, nullptr); }

void check_fill_value(DType dtype, int64_t value) { check_value_fits(dtype, value, nullptr); }

Tensor Tensor::full(const Shape& shape, DType dtype, double value) {
  return full_of(shape, dtype, value);
}

Tensor Tensor::full_integer(const Shape& shape, DType dtype, int64_t value) {
  return full_of(shape, dtype, value);
}

Tensor Tensor::arange(int64_t n, DType dtype) {
  if (n < 0) throw InvalidArgument(fmt::format("arange: n must be non-negative, got {}", n));
  if (dtype == DType::Bool && n > 2) {  // fill_ makes any non-zero true; a range cannot
    throw InvalidArgument(fmt::format("arange: {} values do not fit bool (0 and 1 only)", n));
  }
  if (n > 1) check_value_fits(dtype, n - 1, "arange");
  Tensor t = empty({n}, dtype);
  dispatch(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    auto* p = static_cast<S*>(t.raw_data_ptr());
    for (int64_t i = 0; i < n; ++i) p[i] = cvt<S>(i);
  });
  return t;
}

Tensor Tensor::rand(const Shape& shape, DType dtype, uint64_t seed) {
  check_shape(shape, dtype, "rand");
  Tensor t = empty(shape, dtype);
  const int64_t n = t.numel();
  uint64_t state = seed;
  dispatch(dtype, [&](auto tag) {
    using S = typename decltype(tag)::type;
    auto* p = static_cast<S*>(t.raw_data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      uint64_t x = splitmix64(state);
      if constexpr (std::is_same_v<S, BoolByte>) {
        p[i] = BoolByte{static_cast<uint8_t>(x >> 63)};
      } else if constexpr (std::is_integral_v<S>) {
        p[i] = static_cast<S>(x % 100);
      } else {
        constexpr int kBits = rand_bits<S>();
        double u = static_cast<double>(x >> (64 - kBits)) / static_cast<double>(1ULL << kBits);
        p[i] = cvt<S>(2.0 * u - 1.0);
      }
    }
  });
  return t;
}

template <ElementType T>
Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  const DType dtype = dtype_for<T>();
  check_shape(shape, dtype, "from_vector");
  if (shape_numel(shape) != static_cast<int64_t>(values.size())) {
    throw ShapeError(fmt::format("from_vector: {} values do not fit shape {} ({} elements)",
                                 values.size(), shape_str(shape), shape_numel(shape)));
  }
  Tensor t = empty(shape, dtype);
  using S = StorageOf<T>;
  using Src = std::conditional_t<std::is_same_v<T, long long>, int64_t, T>;
  auto* p = static_cast<S*>(t.raw_data_ptr());
  for (size_t i = 0; i < values.size(); ++i) p[i] = cvt<S>(static_cast<Src>(values[i]));
  return t;
}

Tensor Tensor::meta(const Shape& shape, DType dtype) {
  check_shape(shape, dtype, "meta");
  Tensor t;
  t.layout_ = contiguous_layout(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::from_storage(std::shared_ptr<Storage> storage, const Shape& shape, DType dtype,
                            int64_t offset) {
  if (!storage) throw InvalidArgument("from_storage: null storage");
  check_shape(shape, dtype, "from_storage");
  if (offset < 0) {
    throw InvalidArgument(fmt::format("from_storage: negative offset {}", offset));
  }
  // (offset + numel) elements in bytes; check_shape bounded the shape's bytes, so only an
  // offset far past any storage overflows here. An empty tensor may lie past the end, but its
  // offset too must be an int64 count of bytes (first_element scales it by the itemsize).
  const int64_t numel = shape_numel(shape);
  const auto isz = static_cast<int64_t>(funcol::itemsize(dtype));
  int64_t needed = 0;
  const bool overflow = __builtin_add_overflow(offset, numel, &needed) ||
                        __builtin_mul_overflow(needed, isz, &needed);
  if (overflow) {
    throw ShapeError(fmt::format("from_storage: {} at offset {} lies past the end of the storage "
                                 "({} bytes)",
                                 type_str(dtype, shape), offset, storage->nbytes()));
  }
  if (numel > 0 && static_cast<uint64_t>(needed) > storage->nbytes()) {
    throw ShapeError(
        fmt::format("from_storage: {} at offset {} needs {} bytes but the storage has {}",
                    type_str(dtype, shape), offset, needed, storage->nbytes()));
  }
  Tensor t;
  t.storage_ = std::move(storage);
  t.layout_ = contiguous_layout(shape);
  t.offset_ = offset;
  t.dtype_ = dtype;
  return t;
}

namespace {

// placed()'s checks of `like` at element `offset` of `storage`.
void check_placement(const Tensor& like, const std::shared_ptr<Storage>& storage,
                     int64_t offset) {
  check_defined(like, "placed");
  if (!storage) throw InvalidArgument("placed: null storage");
  if (offset < 0) throw InvalidArgument(fmt::format("placed: negative offset {}", offset));
  if (like.numel() > 0) {
    // One past the last element `like` reaches (strides are never negative), in bytes.
    bool overflow = false;
    int64_t end = offset;
    const Shape& sizes = like.sizes();
    const Shape& strides = like.strides();
    for (size_t d = 0; d < sizes.size() && !overflow; ++d) {
      int64_t reach = 0;
      overflow = __builtin_mul_overflow(sizes[d] - 1, strides[d], &reach) ||
                 __builtin_add_overflow(end, reach, &end);
    }
    int64_t needed = 0;
    overflow = overflow || __builtin_add_overflow(end, 1, &end) ||
               __builtin_mul_overflow(end, static_cast<int64_t>(like.itemsize()), &needed);
    if (overflow) {
      throw ShapeError(fmt::format("placed: {} at offset {} lies past the end of the storage "
                                   "({} bytes)",
                                   type_str(like.dtype(), sizes), offset, storage->nbytes()));
    }
    if (static_cast<uint64_t>(needed) > storage->nbytes()) {
      throw ShapeError(fmt::format("placed: {} at offset {} needs {} bytes but the storage has {}",
                                   type_str(like.dtype(), sizes), offset, needed,
                                   storage->nbytes()));
    }
  } else if (int64_t bytes = 0;
             __builtin_mul_overflow(offset, static_cast<int64_t>(like.itemsize()), &bytes)) {
    // Nothing to hold, but first_element scales the offset by the itemsize (as from_storage).
    throw ShapeError(fmt::format("placed: {} at offset {} lies past the end of the storage "
                                 "({} bytes)",
                                 type_str(like.dtype(), like.sizes()), offset, storage->nbytes()));
  }
}

}  // namespace

Tensor Tensor::placed(const Tensor& like, std::shared_ptr<Storage> storage, int64_t offset) {
  check_placement(like, storage, offset);
  Tensor t;
  t.storage_ = std::move(storage);
  t.layout_ = like.layout_;
  t.offset_ = offset;
  t.dtype_ = like.dtype_;
  return t;
}

void Tensor::placed_run(const Tensor& like, const std::shared_ptr<Storage>& storage,
                        int64_t offset, std::span<Tensor> out) {
  if (out.empty()) return;
  check_placement(like, storage, offset);
  const int64_t numel = like.numel();
  int64_t last = 0;
  if (__builtin_mul_overflow(numel, static_cast<int64_t>(out.size() - 1), &last) ||
      __builtin_add_overflow(last, offset, &last)) {
    throw ShapeError(fmt::format("placed_run: {} tensors of {} from offset {} lie past the end of "
                                 "the storage ({} bytes)",
                                 out.size(), type_str(like.dtype_, like.sizes()), offset,
                                 storage->nbytes()));
  }
  check_placement(like, storage, last);
  for (Tensor& t : out) {
    t.storage_ = storage;
    t.annotation_.reset();
    t.layout_ = like.layout_;
    t.offset_ = offset;
    t.dtype_ = like.dtype_;
    offset += numel;
  }
}

// ---------------------------------------------------------------------------------------------
// Metadata

int64_t Tensor::size(int64_t dim) const { return sizes()[wrap_dim(dim, this->dim(), "size")]; }

int64_t Tensor::stride(int64_t dim) const {
  return strides()[wrap_dim(dim, this->dim(), "stride")];
}


bool Tensor::is_ready() const { return !storage_ || storage_->is_ready(); }

// ---------------------------------------------------------------------------------------------
// Data access

// The data accessors test the storage only: a tensor without one is undefined or meta, and
// check_not_meta throws for either (a bucket's thousand inputs are read through these, and two
// calls of it each cost more than the pointer).
void* Tensor::data_ptr() const {
  if (storage_ == nullptr) check_not_meta(*this, "data_ptr");
  storage_->wait_for_write();
  return first_element();
}

const void* Tensor::const_data_ptr() const {
  if (storage_ == nullptr) check_not_meta(*this, "const_data_ptr");
  storage_->wait();
  return first_element();
}

void* Tensor::raw_data_ptr() const {
  if (storage_ == nullptr) check_not_meta(*this, "raw_data_ptr");
  return first_element();
}

// An empty tensor's offset may lie past the end of its storage (views narrowed to the end,
// from_storage): it gets the storage's first byte, never a pointer outside the allocation.
void* Tensor::first_element() const {
  if (layout_->numel == 0) return storage_->raw();
  return static_cast<char*>(storage_->raw()) + offset_ * static_cast<int64_t>(itemsize());
}

namespace {
// data<T>() and const_data<T>(): T must be the tensor's dtype.
template <ElementType T>
void check_element_type(const Tensor& t, std::string_view what) {
  constexpr DType want = dtype_for<T>();
  if (t.defined() && want != t.dtype()) {
    throw InvalidArgument(fmt::format("{}: requested {} but the tensor is {}", what,
                                      dtype_name(want), dtype_name(t.dtype())));
  }
}
}  // namespace

template <ElementType T>
T* Tensor::data() const {
  check_element_type<T>(*this, "data");
  return static_cast<T*>(data_ptr());
}

template <ElementType T>
const T* Tensor::const_data() const {
  check_element_type<T>(*this, "const_data");
  return static_cast<const T*>(const_data_ptr());
}

const Tensor& Tensor::wait() const {
  if (storage_) storage_->wait();
  return *this;
}

template <ElementType T>
std::vector<T> Tensor::to_vector() const {
  check_not_meta(*this, "to_vector");
  storage_->wait();
  std::vector<T> out = detail::vector_or_throw<T>(static_cast<size_t>(numel()));
  const char* base = static_cast<const char*>(raw_data_ptr());
  size_t k = 0;
  using Dst = std::conditional_t<std::is_same_v<T, long long>, int64_t, T>;
  dispatch(dtype_, [&](auto tag) {
    using S = typename decltype(tag)::type;
    for_each_row<1>(
        sizes(), {&strides()},
        [&](const std::array<int64_t, 1>& off, int64_t n, const std::array<int64_t, 1>& inner) {
          const char* p = base + off[0] * static_cast<int64_t>(sizeof(S));
          const int64_t step = inner[0] * static_cast<int64_t>(sizeof(S));
          for (int64_t i = 0; i < n; ++i) {
            out[k++] = static_cast<T>(cvt<Dst>(load_elem<S>(p + i * step)));
          }
        });
  });
  return out;
}

template <ElementType T>
T Tensor::item() const {
  check_not_meta(*this, "item");
  if (numel() != 1) {
    throw ShapeError(
        fmt::format("item: expected a tensor with exactly one element, got {} ({} "
                    "elements)",
                    type_str(dtype_, sizes()), numel()));
  }
  storage_->wait();
  const void* p = raw_data_ptr();
  using Dst = std::conditional_t<std::is_same_v<T, long long>, int64_t, T>;
  return dispatch(dtype_, [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S v = load_elem<S>(p);
    // As PyTorch's item<T>() (Scalar::to, checked_convert): a value T cannot hold is an error,
    // not wrapped or saturated as element conversions are (3e9 as int32, 300 as uint8, 1e300
    // as float, NaN or infinity as an integer). Bool and floating infinities and NaN convert.
    // A negative integer down to minus the largest value of an unsigned T wraps, as there (-1
    // as uint8_t is 255, -256 an error: check_value_fits).
    if constexpr (std::is_integral_v<S>) {
      check_value_fits(dtype_of<Dst>, static_cast<int64_t>(v), "item");
    } else {
      check_value_fits(dtype_of<Dst>, cvt<double>(v), "item");
    }
    return static_cast<T>(cvt<Dst>(v));
  });
}

std::string Tensor::to_string() const {
  if (!defined()) return "tensor(undefined)";
  const std::string type = type_str(dtype_, sizes());
  if (is_meta()) return "tensor(" + type + ", meta)";
  storage_->wait();
  // No elements: "[]" whatever the shape (which the type shows), as PyTorch prints
  // tensor([], size=(N, 0)); one "[]" per row would cost as much as the rows.
  if (numel() == 0) return "tensor(" + type + ", [])";
  // Like PyTorch's print options: beyond 1000 elements show 3 items at each end of every dim.
  constexpr int64_t kThreshold = 1000;
  constexpr int64_t kEdge = 3;
  const bool summarize = numel() > kThreshold;
  const char* base = static_cast<const char*>(raw_data_ptr());
  std::string out = "tensor(" + type + ", ";
  dispatch(dtype_, [&](auto tag) {
    using S = typename decltype(tag)::type;
    auto rec = [&](auto& self, size_t d, int64_t off) -> void {
      if (d == sizes().size()) {
        out += format_elem(load_elem<S>(base + off * static_cast<int64_t>(sizeof(S))));
        return;
      }
      out += "[";
      const int64_t n = sizes()[d];
      for (int64_t i = 0; i < n; ++i) {
        if (i > 0) out += ", ";
        if (summarize && n > 2 * kEdge && i == kEdge) {
          out += "..., ";
          i = n - kEdge;
        }
        self(self, d + 1, off + i * strides()[d]);
      }
      out += "]";
    };
    rec(rec, 0, 0);
  });
  return out + ")";
}

// ---------------------------------------------------------------------------------------------
// Views

Tensor Tensor::with_layout(Shape sizes, Shape strides, int64_t offset) const {
  Tensor t;
  if (!defined()) return t;
  t.storage_ = storage_;
  t.layout_ = view_layout(std::move(sizes), std::move(strides));
  t.offset_ = offset;
  t.dtype_ = dtype_;
  return t;
}

Tensor Tensor::alias() const {
  Tensor t = *this;
  t.annotation_.reset();
  return t;
}

Tensor Tensor::view(const Shape& shape) const {
  check_defined(*this, "view");
  Shape s = infer_shape(shape, numel(), "view");
  // An empty tensor's new nonzero dims must fit in int64 bytes too, as any tensor's.
  check_shape(s, dtype_, "view");
  auto strides = view_strides(this->sizes(), this->strides(), s);
  if (!strides) {
    throw InvalidArgument(
        fmt::format("view: cannot view {} with strides {} as shape {} without a copy (use reshape)",
                    type_str(dtype_, this->sizes()), shape_str(this->strides()), shape_str(shape)));
  }
  return with_layout(std::move(s), std::move(*strides), offset_);
}

Tensor Tensor::reshape(const Shape& shape) const {
  check_defined(*this, "reshape");
  Shape s = infer_shape(shape, numel(), "reshape");
  check_shape(s, dtype_, "reshape");  // as view's
  if (auto strides = view_strides(this->sizes(), this->strides(), s)) {
    return with_layout(std::move(s), std::move(*strides), offset_);
  }
  return contiguous().view(s);
}

Tensor Tensor::flatten() const {
  check_defined(*this, "flatten");
  return reshape({numel()});
}

Tensor Tensor::narrow(int64_t dim, int64_t start, int64_t length) const {
  check_defined(*this, "narrow");
  const int64_t d = wrap_dim(dim, this->dim(), "narrow");
  const int64_t size = sizes()[d];
  if (length < 0) {
    throw ShapeError(fmt::format("narrow: length ({}) must be non-negative", length));
  }
  if (start < -size || start > size) {
    throw ShapeError(
        fmt::format("narrow: start ({}) is out of range for size {} of dim {}", start, size, d));
  }
  if (start < 0) start += size;
  if (length > size - start) {
    throw ShapeError(fmt::format("narrow: start ({}) + length ({}) exceeds size {} of dim {}",
                                 start, length, size, d));
  }
  Shape sizes = this->sizes();
  sizes[d] = length;
  const int64_t offset = view_offset(*this, start, strides()[d], "narrow");
  return with_layout(std::move(sizes), strides(), offset);
}

std::vector<Tensor> Tensor::split(int64_t split_size, int64_t dim) const {
  check_defined(*this, "split");
  const int64_t d = wrap_dim(dim, this->dim(), "split");
  const int64_t size = sizes()[d];
  if (split_size < 0 || (split_size == 0 && size > 0)) {
    throw InvalidArgument(fmt::format(
        "split: split_size must be positive for dim {} of size {}, got {}", d, size, split_size));
  }
  std::vector<Tensor> out;
  if (size == 0) {
    out.push_back(narrow(d, 0, 0));
    return out;
  }
  // Every piece is a Tensor: a dim of 2^40 (an expanded one) split by 1 would not fit.
  detail::reserve_or_throw(out, static_cast<size_t>(size / split_size + (size % split_size != 0)));
  // Stepped by the piece's length, not split_size: start + split_size may pass INT64_MAX after
  // the last piece of a bool/u8/i8 dim near it (chunk(2) of one of INT64_MAX).
  for (int64_t start = 0, length = 0; start < size; start += length) {
    length = std::min(split_size, size - start);
    out.push_back(narrow(d, start, length));
  }
  return out;
}

std::vector<Tensor> Tensor::split_with_sizes(const std::vector<int64_t>& sizes, int64_t dim) const {
  check_defined(*this, "split_with_sizes");
  const int64_t d = wrap_dim(dim, this->dim(), "split_with_sizes");
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0) {
      throw ShapeError(fmt::format("split_with_sizes: negative size {} in {}", s, list_str(sizes)));
    }
    if (__builtin_add_overflow(total, s, &total)) {
      throw ShapeError(fmt::format(
          "split_with_sizes: sizes {} sum to more than int64 holds but dim {} has size {}",
          list_str(sizes), d, this->sizes()[d]));
    }
  }
  if (total != this->sizes()[d]) {
    throw ShapeError(fmt::format("split_with_sizes: sizes {} sum to {} but dim {} has size {}",
                                 list_str(sizes), total, d, this->sizes()[d]));
  }
  std::vector<Tensor> out;
  detail::reserve_or_throw(out, sizes.size());
  int64_t start = 0;
  for (int64_t s : sizes) {
    out.push_back(narrow(d, start, s));
    start += s;
  }
  return out;
}

std::vector<Tensor> Tensor::chunk(int64_t chunks, int64_t dim) const {
  check_defined(*this, "chunk");
  if (chunks <= 0) {
    throw InvalidArgument(fmt::format("chunk: chunks must be positive, got {}", chunks));
  }
  const int64_t d = wrap_dim(dim, this->dim(), "chunk");
  const int64_t size = sizes()[d];
  if (size == 0) {
    // torch.chunk: an empty dim still gives `chunks` (empty) pieces.
    return split_with_sizes(detail::vector_or_throw<int64_t>(static_cast<size_t>(chunks)), d);
  }
  return split(size / chunks + (size % chunks != 0 ? 1 : 0), d);  // ceil, without overflow
}

Tensor Tensor::transpose(int64_t dim0, int64_t dim1) const {
  check_defined(*this, "transpose");
  if (dim() == 0) {
    // A scalar takes dims 0 and -1 and stays as it is (PyTorch's rule, and the op table's).
    for (const int64_t d : {dim0, dim1}) {
      if (d != 0 && d != -1) {
        throw ShapeError(
            fmt::format("transpose: dim {} is out of range for a scalar (0 or -1)", d));
      }
    }
    return alias();
  }
  const int64_t a = wrap_dim(dim0, dim(), "transpose");
  const int64_t b = wrap_dim(dim1, dim(), "transpose");
  Shape sizes = this->sizes();
  Shape strides = this->strides();
  std::swap(sizes[a], sizes[b]);
  std::swap(strides[a], strides[b]);
  return with_layout(std::move(sizes), std::move(strides), offset_);
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  check_defined(*this, "permute");
  if (static_cast<int64_t>(dims.size()) != dim()) {
    throw ShapeError(fmt::format("permute: dims {} has {} entries but the tensor has rank {}",
                                 list_str(dims), dims.size(), dim()));
  }
  Shape sizes(dims.size());
  Shape strides(dims.size());
  std::vector<bool> seen(dims.size(), false);
  for (size_t i = 0; i < dims.size(); ++i) {
    const int64_t d = wrap_dim(dims[i], dim(), "permute");
    if (seen[d]) {
      throw InvalidArgument(fmt::format("permute: dims {} repeat dim {}", list_str(dims), d));
    }
    seen[d] = true;
    sizes[i] = this->sizes()[d];
    strides[i] = this->strides()[d];
  }
  return with_layout(std::move(sizes), std::move(strides), offset_);
}

Tensor Tensor::expand(const Shape& shape) const {
  check_defined(*this, "expand");
  if (shape.size() < sizes().size()) {
    throw ShapeError(fmt::format("expand: cannot expand {} to {} (fewer dims)", shape_str(sizes()),
                                 shape_str(shape)));
  }
  const size_t lead = shape.size() - sizes().size();
  Shape sizes(shape.size());
  Shape strides(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) {
      if (shape[i] < 0) {
        throw ShapeError(fmt::format("expand: cannot expand {} to {}", shape_str(this->sizes()),
                                     shape_str(shape)));
      }
      sizes[i] = shape[i];
      strides[i] = 0;
      continue;
    }
    const int64_t own = this->sizes()[i - lead];
    const int64_t want = shape[i] == -1 ? own : shape[i];
    if (want == own) {
      sizes[i] = own;
      strides[i] = this->strides()[i - lead];
    } else if (own == 1 && want >= 0) {
      sizes[i] = want;
      strides[i] = 0;
    } else {
      throw ShapeError(fmt::format("expand: cannot expand {} to {} (dim {}: {} vs {})",
                                   shape_str(this->sizes()), shape_str(shape), i, own, shape[i]));
    }
  }
  check_shape(sizes, dtype_, "expand");  // numel (and nbytes) must stay representable
  return with_layout(std::move(sizes), std::move(strides), offset_);
}

Tensor Tensor::view_dtype(DType dtype) const {
  check_defined(*this, "view_dtype");
  const auto old_size = static_cast<int64_t>(itemsize());
  const auto new_size = static_cast<int64_t>(funcol::itemsize(dtype));
  if (old_size == new_size) {
    Tensor t = alias();
    t.dtype_ = dtype;
    return t;
  }
  const std::string what =
      fmt::format("view_dtype: cannot view {} as {}", type_str(dtype_, sizes()), dtype_name(dtype));
  if (dim() == 0) throw InvalidArgument(what + ": a 0-d tensor has no last dim to rescale");
  if (strides().back() != 1 && sizes().back() != 1) {
    throw InvalidArgument(
        what + fmt::format(": the last dim must have stride 1, it has {}", strides().back()));
  }
  Shape sizes = this->sizes();
  Shape strides = this->strides();
  int64_t offset;
  if (new_size < old_size) {
    const int64_t ratio = old_size / new_size;
    sizes.back() *= ratio;
    for (size_t i = 0; i + 1 < strides.size(); ++i) strides[i] *= ratio;
    strides.back() = 1;
    offset = offset_ * ratio;
  } else {
    const int64_t ratio = new_size / old_size;
    if (sizes.back() % ratio != 0) {
      throw InvalidArgument(
          what + fmt::format(": the last dim ({}) is not a multiple of {}", sizes.back(), ratio));
    }
    if (offset_ % ratio != 0) {
      throw InvalidArgument(
          what + fmt::format(": the storage offset ({}) is not a multiple of {}", offset_, ratio));
    }
    if (numel() == 0) {
      // No element to address: the strides of the other dims do not matter (a contiguous
      // [3, 0] has strides [1, 1], which PyTorch refuses to widen, while the IR's types accept
      // it). The last dim's stride is still 1, as PyTorch asks, and the offset is rescaled as
      // PyTorch's (an empty narrow keeps its place).
      sizes.back() /= ratio;
      Tensor t = with_layout(sizes, contiguous_strides(sizes), offset_ / ratio);
      t.dtype_ = dtype;
      return t;
    }
    for (size_t i = 0; i + 1 < strides.size(); ++i) {
      if (strides[i] % ratio != 0 && sizes[i] != 1) {
        throw InvalidArgument(what + fmt::format(": stride {} of dim {} is not a multiple of {}",
                                                 strides[i], i, ratio));
      }
      strides[i] /= ratio;
    }
    sizes.back() /= ratio;
    strides.back() = 1;
    offset = offset_ / ratio;
  }
  Tensor t = with_layout(std::move(sizes), std::move(strides), offset);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::unsqueeze(int64_t dim) const {
  check_defined(*this, "unsqueeze");
  // The new dim goes anywhere from before the first to after the last: rank + 1 places.
  const int64_t places = this->dim() + 1;
  if (dim < -places || dim >= places) {
    throw ShapeError(fmt::format("unsqueeze: dim {} is out of range for a tensor of rank {} "
                                 "(expected {} to {})",
                                 dim, this->dim(), -places, places - 1));
  }
  const int64_t d = dim < 0 ? dim + places : dim;
  Shape sizes = this->sizes();
  Shape strides = this->strides();
  const int64_t stride = d < this->dim() ? this->sizes()[d] * this->strides()[d] : 1;
  sizes.insert(sizes.begin() + d, 1);
  strides.insert(strides.begin() + d, stride);
  return with_layout(std::move(sizes), std::move(strides), offset_);
}

Tensor Tensor::squeeze(int64_t dim) const {
  check_defined(*this, "squeeze");
  // A scalar takes dims 0 and -1 and stays as it is (PyTorch's rule, as transpose).
  // (Views, without the annotation, as every view.)
  if (this->dim() == 0 && (dim == 0 || dim == -1)) return alias();
  const int64_t d = wrap_dim(dim, this->dim(), "squeeze");
  // As PyTorch: squeezing a dim that is not 1 changes nothing.
  if (sizes()[d] != 1) return alias();
  Shape sizes = this->sizes();
  Shape strides = this->strides();
  sizes.erase(sizes.begin() + d);
  strides.erase(strides.begin() + d);
  return with_layout(std::move(sizes), std::move(strides), offset_);
}

Tensor Tensor::select(int64_t dim, int64_t index) const {
  check_defined(*this, "select");
  const int64_t d = wrap_dim(dim, this->dim(), "select");
  const int64_t size = sizes()[d];
  if (index < -size || index >= size) {
    throw ShapeError(
        fmt::format("select: index {} is out of range for size {} of dim {}", index, size, d));
  }
  if (index < 0) index += size;
  Shape sizes = this->sizes();
  Shape strides = this->strides();
  const int64_t offset = view_offset(*this, index, this->strides()[d], "select");
  sizes.erase(sizes.begin() + d);
  strides.erase(strides.begin() + d);
  return with_layout(std::move(sizes), std::move(strides), offset);
}

// ---------------------------------------------------------------------------------------------
// Copies

Tensor Tensor::contiguous() const {
  check_defined(*this, "contiguous");
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const { return to(dtype_); }

Tensor Tensor::to(DType dtype) const {
  check_defined(*this, "to");
  if (is_meta()) return meta(sizes(), dtype);
  Tensor out = empty(sizes(), dtype);
  storage_->wait();
  copy_elements(raw_data_ptr(), dtype_, strides(), out.raw_data_ptr(), dtype, out.strides(),
                sizes());
  return out;
}

const Tensor& Tensor::copy_(const Tensor& src) const {
  check_not_meta(*this, "copy_");
  check_not_meta(src, "copy_");
  check_no_internal_overlap(*this, "copy_");
  if (src.sizes() != sizes()) {
    throw ShapeError(fmt::format("copy_: source shape {} does not match destination shape {}",
                                 shape_str(src.sizes()), shape_str(sizes())));
  }
  src.storage_->wait();
  storage_->wait_for_write();
  if (shares_storage(src)) {
    // Overlapping source and destination: go through a temporary.
    Tensor tmp = src.clone();
    copy_elements(tmp.raw_data_ptr(), tmp.dtype_, tmp.strides(), raw_data_ptr(), dtype_, strides(),
                  sizes());
  } else {
    copy_elements(src.raw_data_ptr(), src.dtype_, src.strides(), raw_data_ptr(), dtype_, strides(),
                  sizes());
  }
  return *this;
}

namespace {

template <typename V>
void fill_with(const Tensor& t, V value) {
  check_not_meta(t, "fill_");
  check_no_internal_overlap(t, "fill_");
  check_value_fits(t.dtype(), value, "fill_");
  t.storage()->wait_for_write();
  char* base = static_cast<char*>(t.raw_data_ptr());
  const Shape& strides = t.strides();
  dispatch(t.dtype(), [&](auto tag) {
    using S = typename decltype(tag)::type;
    const S v = cvt<S>(value);
    for_each_row<1>(
        t.sizes(), {&strides},
        [&](const std::array<int64_t, 1>& off, int64_t n, const std::array<int64_t, 1>& inner) {
          char* p = base + off[0] * static_cast<int64_t>(sizeof(S));
          const int64_t step = inner[0] * static_cast<int64_t>(sizeof(S));
          for (int64_t i = 0; i < n; ++i) store_elem<S>(p + i * step, v);
        });
  });
}

}  // namespace

const Tensor& Tensor::fill_(double value) const {
  fill_with(*this, value);
  return *this;
}

const Tensor& Tensor::fill_integer_(int64_t value) const {
  fill_with(*this, value);
  return *this;
}

Tensor Tensor::cat(const std::vector<Tensor>& tensors, int64_t dim) {
  if (tensors.empty()) throw InvalidArgument("cat: expected a non-empty list of tensors");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined()) {
      throw InvalidArgument(fmt::format("cat: tensor {} is undefined", i));
    }
    if (tensors[i].dim() == 0) {
      throw ShapeError(fmt::format("cat: zero-dimensional tensor {} cannot be concatenated", i));
    }
  }
  // As PyTorch, a 1-D tensor of no elements joins any concatenation (a list built up from an
  // empty start): the shapes are those of the first other tensor.
  const size_t ref = cat_reference(tensors.size(), [&](size_t i) -> const Shape& {
    return tensors[i].sizes();
  });
  const Tensor& first = tensors[ref];
  bool any_meta = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (t.dtype_ != first.dtype_) {
      throw InvalidArgument(fmt::format("cat: tensor {} has dtype {} but tensor {} has {}", i,
                                        dtype_name(t.dtype_), ref, dtype_name(first.dtype_)));
    }
    any_meta = any_meta || t.is_meta();
  }
  // Every tensor skipped: an empty result, whatever `dim` is (PyTorch does not check it then).
  if (cat_skips(first.sizes())) return any_meta ? meta({0}, first.dtype_) : empty({0}, first.dtype_);
  const int64_t d = wrap_dim(dim, first.dim(), "cat");
  Shape sizes = first.sizes();
  sizes[d] = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (i != ref && cat_skips(t.sizes())) continue;
    bool match = t.dim() == first.dim();
    for (int64_t k = 0; match && k < first.dim(); ++k) {
      match = k == d || t.sizes()[k] == first.sizes()[k];
    }
    if (!match) {
      throw ShapeError(fmt::format(
          "cat: tensor {} has shape {} but tensor {} has {} (all dims but {} must match)", i,
          shape_str(t.sizes()), ref, shape_str(first.sizes()), d));
    }
    if (__builtin_add_overflow(sizes[d], t.sizes()[d], &sizes[d])) {
      throw ShapeError(fmt::format("cat: the tensors' sizes at dim {} sum to more than int64 holds",
                                   d));
    }
  }
  if (any_meta) return meta(sizes, first.dtype_);
  Tensor out = empty(sizes, first.dtype_);
  int64_t start = 0;
  for (const Tensor& t : tensors) {
    // A tensor of no elements is passed over: it adds nothing along `d`, or it shares a dim of
    // size 0 with the output, which then has nothing to copy. (One that cat skips may have no
    // dim `d` at all.)
    if (t.numel() == 0) continue;
    const int64_t len = t.sizes()[d];
    Tensor slot = out.narrow(d, start, len);
    t.storage_->wait();
    copy_elements(t.raw_data_ptr(), t.dtype_, t.strides(), slot.raw_data_ptr(), slot.dtype_,
                  slot.strides(), slot.sizes());
    start += len;
  }
  return out;
}

bool Tensor::equal(const Tensor& other) const {
  if (!defined() || !other.defined()) return defined() == other.defined();
  check_not_meta(*this, "equal");
  check_not_meta(other, "equal");
  storage_->wait();
  other.storage_->wait();
  if (dtype_ != other.dtype_ || sizes() != other.sizes()) return false;
  const auto isz = static_cast<int64_t>(itemsize());
  const char* a = static_cast<const char*>(raw_data_ptr());
  const char* b = static_cast<const char*>(other.raw_data_ptr());
  bool same = true;
  for_each_row<2>(
      sizes(), {&strides(), &other.strides()},
      [&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& inner) {
        if (!same) return;
        const char* pa = a + off[0] * isz;
        const char* pb = b + off[1] * isz;
        if (inner[0] == 1 && inner[1] == 1) {
          same = std::memcmp(pa, pb, static_cast<size_t>(n * isz)) == 0;
          return;
        }
        for (int64_t i = 0; i < n && same; ++i) {
          same = std::memcmp(pa + i * inner[0] * isz, pb + i * inner[1] * isz,
                             static_cast<size_t>(isz)) == 0;
        }
      });
  return same;
}

// ---------------------------------------------------------------------------------------------
// Explicit instantiations of the element-typed templates.

#define FUNCOL_INSTANTIATE(T)                                                  \
  template Tensor Tensor::from_vector<T>(const std::vector<T>&, const Shape&); \
  template T* Tensor::data<T>() const;                                         \
  template const T* Tensor::const_data<T>() const;                             \
  template std::vector<T> Tensor::to_vector<T>() const;                        \
  template T Tensor::item<T>() const;

FUNCOL_INSTANTIATE(bool)
FUNCOL_INSTANTIATE(uint8_t)
FUNCOL_INSTANTIATE(int8_t)
FUNCOL_INSTANTIATE(int16_t)
FUNCOL_INSTANTIATE(int32_t)
FUNCOL_INSTANTIATE(int64_t)
FUNCOL_INSTANTIATE(Eigen::half)
FUNCOL_INSTANTIATE(Eigen::bfloat16)
FUNCOL_INSTANTIATE(float)
FUNCOL_INSTANTIATE(double)
// On LP64 Linux int64_t is `long`, so `long long` (what 1LL literals give) is a distinct type.
#if defined(__linux__) && defined(__LP64__)
static_assert(!std::is_same_v<long long, int64_t>);
FUNCOL_INSTANTIATE(long long)
#endif
#undef FUNCOL_INSTANTIATE

}  // namespace funcol
