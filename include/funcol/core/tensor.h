// Tensor: shared storage + offset + sizes + strides + dtype, with pending (asynchronous) storage.
#pragma once

#include <atomic>
#include <concepts>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "funcol/core/dtype.h"
#include "funcol/core/error.h"

namespace funcol {

using Shape = std::vector<int64_t>;

// Something a storage waits on before its bytes may be read or written: a collective's Work.
// core knows nothing of process groups; dist's Work implements this interface. A future GPU
// backend's Work waits on a stream event here.
class Waitable {
 public:
  virtual ~Waitable() = default;
  // Blocks until the operation finished; throws (CommError, ...) when it failed.
  virtual void wait() = 0;
  // True once the operation finished, successfully or not. Never blocks.
  virtual bool is_completed() const = 0;
  // is_completed() for a caller that polls instead of waiting (Tensor::is_ready): a backend
  // whose waiters enforce its timeouts and departure checks does so here too, so that polling
  // a collective that can never finish sees it fail within the timeout. Never blocks.
  virtual bool poll() { return is_completed(); }
};

// A reference-counted byte buffer, possibly *pending*: while Waitables are attached, the bytes
// are being produced by an asynchronous operation. Every data access of a Tensor calls wait();
// views share the Storage and so share its pending state (PyTorch's AsyncCollectiveTensor rule,
// keyed on storage as its work registry is, so a view_dtype of a result still finds its work).
class Storage {
 public:
  // Allocates `nbytes` bytes, 64-byte aligned, uninitialised.
  explicit Storage(size_t nbytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  size_t nbytes() const { return nbytes_; }
  // The bytes without waiting. Only the producer of pending data (a backend) may use this.
  void* raw() const { return data_; }

  // Attaches an operation that produces these bytes. Attaching the one attached last again is a
  // no-op; one attached again later is still waited once (PyTorch's register_work de-dup).
  // Operations that completed successfully are detached now and then (amortised O(1)):
  // bytes written by many in-place collectives and never read in between do not collect them.
  void add_pending(std::shared_ptr<Waitable> work);
  // True when nothing is attached or every attached operation completed.
  bool is_ready() const;
  // Waits for and detaches every attached operation; rethrows the first failure. A failed
  // operation stays attached: its bytes were never produced, so every later access rethrows
  // its error too (the storage holds no defined data any more). Thread-safe; cheap (one atomic
  // load) when nothing is pending; waiting twice costs nothing.
  void wait();
  // wait() for every storage of `storages`, waiting an operation attached to several of them
  // once (the outputs of one coalesced collective share one): wait_tensors. Rethrows the first
  // failure, as wait() of the storage it failed would (it stays attached there); the operations
  // waited before it are detached. Null entries are skipped.
  static void wait_all(std::span<Storage* const> storages);
  // Number of distinct attached operations not yet waited through this storage (tests and leak
  // checks). An operation waited only through its Work (Work::wait) stays attached until the
  // next wait() here (wait_tensor, any data access), which detaches it without blocking: the
  // storage is not told when its Work is waited.
  size_t pending_count() const;

  // Attaches an operation that reads these bytes later (a collective reads its input when it
  // runs, perhaps after the call returned): writes wait for it, reads do not. Its failure is
  // not the storage's. Attaching the one attached last again is a no-op.
  void add_reader(std::shared_ptr<Waitable> work);
  // Waits for the attached readers (ignoring their failures), then as wait(): before a write.
  // Counts the write in version().
  void wait_for_write();
  // Number of attached readers not yet waited.
  size_t reader_count() const;
  // How many writes were announced through wait_for_write: every write path calls it
  // (data_ptr(), fill_, copy_'s destination, kernel outputs, collective outputs when issued),
  // no read does. The autograd tape compares it to catch an in-place change of a value that
  // backward needs, as PyTorch's version counter.
  uint64_t version() const { return version_.load(std::memory_order_acquire); }

 private:
  static constexpr size_t kPruneReadersAt = 16;  // add_reader's first pruning size
  static constexpr size_t kPrunePendingAt = 16;  // add_pending's first pruning size

  void* data_ = nullptr;
  size_t nbytes_ = 0;
  std::atomic<bool> has_pending_{false};
  std::atomic<bool> has_readers_{false};
  std::atomic<uint64_t> version_{0};
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<Waitable>> pending_;
  std::vector<std::shared_ptr<Waitable>> readers_;
  size_t prune_readers_at_ = kPruneReadersAt;  // add_reader's next pruning size
  size_t prune_pending_at_ = kPrunePendingAt;  // add_pending's next pruning size
};

namespace detail {

// A tensor's sizes and strides, immutable once built and shared by every Tensor that has them:
// copying a Tensor copies no vectors, and the contiguous layouts of recently used shapes are
// reused (a bucket's thousand results of one shape share one).
struct Layout {
  Shape sizes;
  Shape strides;
  int64_t numel = 1;
  bool contiguous = true;
};

inline const Shape kNoDims{};

}  // namespace detail

// The element types of from_vector, data, to_vector and item: the ten dtypes' (dtype_of) and
// long long (what 1LL gives; int64_t is long on LP64 Linux). Others fail to compile.
template <typename T>
concept ElementType =
    std::same_as<T, bool> || std::same_as<T, uint8_t> || std::same_as<T, int8_t> ||
    std::same_as<T, int16_t> || std::same_as<T, int32_t> || std::same_as<T, int64_t> ||
    std::same_as<T, long long> || std::same_as<T, Eigen::half> ||
    std::same_as<T, Eigen::bfloat16> || std::same_as<T, float> || std::same_as<T, double>;

// An n-dimensional strided view of a Storage. Copying a Tensor is cheap and shares the storage.
// A *meta* tensor has sizes and dtype but no storage (tracing and shape inference use it).
//
// Data accesses (kernels, data(), to_vector, printing, conversion, contiguous on a
// non-contiguous tensor) wait for pending storage first; view ops (view, reshape of a
// contiguous tensor, flatten, narrow, split, chunk, transpose, permute, view_dtype) never wait.
// Throws InvalidArgument "value V cannot be converted to DTYPE without overflow" where
// Tensor::full and fill_ refuse `value` for `dtype` (the verifier checks `full` nodes with it,
// before anything runs).
void check_fill_value(DType dtype, double value);
void check_fill_value(DType dtype, int64_t value);

class Tensor {
 public:
  // An undefined tensor (defined() == false).
  Tensor() = default;

  // ---- factories ----
  // Storage beyond the machine's memory and swap (capped by the process's cgroup limit, a
  // container's) is refused before allocating, Error "out of memory: cannot allocate N bytes",
  // even where overcommit would have let a tensor used only in part through. empty's elements
  // are uninitialized (torch.empty's): whatever its storage held before.
  static Tensor empty(const Shape& shape, DType dtype);
  static Tensor zeros(const Shape& shape, DType dtype);
  // `value` is converted to dtype (bool: value != 0); an integer dtype refuses a value it
  // cannot hold (but, as PyTorch, u8 takes an integer from -255 to -1 as 256 + value), f32/f16/
  // bf16 a finite value that would round to infinity (InvalidArgument; inf and nan are kept;
  // check_fill_value). An integer value is taken as an integer: an i64 tensor holds it exactly,
  // where a double would round those above 2^53.
  static Tensor full(const Shape& shape, DType dtype, double value);
  template <std::integral T>
  static Tensor full(const Shape& shape, DType dtype, T value) {
    if (above_int64(value)) return full(shape, dtype, static_cast<double>(value));
    return full_integer(shape, dtype, static_cast<int64_t>(value));
  }
  // [0, 1, ..., n-1] as a 1-D tensor.
  static Tensor arange(int64_t n, DType dtype);
  // Deterministic in seed: floats uniform in [-1, 1), integers in [0, 100), bool at random.
  static Tensor rand(const Shape& shape, DType dtype, uint64_t seed);
  // Copies `values` into a 1-D tensor of values.size() elements.
  template <ElementType T>
  static Tensor from_vector(const std::vector<T>& values) {
    return from_vector(values, Shape{static_cast<int64_t>(values.size())});
  }
  // Copies `values` into a tensor of `shape`; their count must be its numel, so an empty shape
  // takes one value and makes a 0-d tensor, as full({}, ...) does (ShapeError otherwise).
  template <ElementType T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape);
  // A tensor with sizes and dtype but no storage.
  static Tensor meta(const Shape& shape, DType dtype);
  // Wraps existing storage (backends, executor buffer reuse).
  static Tensor from_storage(std::shared_ptr<Storage> storage, const Shape& shape, DType dtype,
                             int64_t offset = 0);
  // A tensor of `like`'s sizes, strides and dtype on `storage` at element `offset`, sharing
  // `like`'s layout (`like` is usually a meta tensor): what from_storage gives, without
  // building or looking up a layout, for callers that place thousands of tensors of known
  // types (the executor's bucket results). The elements must lie inside the storage
  // (ShapeError); `like` must be defined and `storage` non-null (InvalidArgument).
  static Tensor placed(const Tensor& like, std::shared_ptr<Storage> storage, int64_t offset);
  // out.size() tensors placed back to back from element `offset`: out[k] is
  // placed(like, storage, offset + k * like.numel()), each one's former value released. Checks
  // once for the whole run (the same errors), then writes each tensor's fields.
  static void placed_run(const Tensor& like, const std::shared_ptr<Storage>& storage,
                         int64_t offset, std::span<Tensor> out);

  // ---- metadata (never waits) ----
  // A moved-from Tensor is undefined.
  bool defined() const { return layout_ != nullptr; }
  bool is_meta() const { return layout_ && !storage_; }
  DType dtype() const { return dtype_; }
  const Shape& sizes() const { return layout_ ? layout_->sizes : detail::kNoDims; }
  const Shape& strides() const { return layout_ ? layout_->strides : detail::kNoDims; }
  // The sizes and strides, shared by tensors built alike and never changed once built: a caller
  // that keeps it can tell a tensor of that very layout by pointer (the executor checks its
  // inputs' shapes so once per layout, not every step). Null when undefined.
  const std::shared_ptr<const detail::Layout>& layout() const { return layout_; }
  // Negative dims count from the end; throws ShapeError when out of range.
  int64_t size(int64_t dim) const;
  int64_t stride(int64_t dim) const;
  int64_t dim() const { return layout_ ? static_cast<int64_t>(layout_->sizes.size()) : 0; }
  int64_t numel() const { return layout_ ? layout_->numel : 0; }
  // Element offset of the first element into the storage.
  int64_t storage_offset() const { return offset_; }
  size_t itemsize() const { return funcol::itemsize(dtype_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * itemsize(); }
  bool is_contiguous() const { return !layout_ || layout_->contiguous; }
  // True when the storage has no pending operation (or the tensor is meta / undefined).
  bool is_ready() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  // Same storage (views of one buffer alias).
  bool shares_storage(const Tensor& other) const { return storage_ && storage_ == other.storage_; }

  // ---- data access (waits for pending storage) ----
  // Pointer to the first element, to read or write; waits for pending storage and for the
  // collectives still to read it (Storage::wait_for_write). Throws InvalidArgument on meta or
  // undefined tensors.
  void* data_ptr() const;
  // Pointer to the first element, to read only; waits for pending storage but not for the
  // collectives that read it too.
  const void* const_data_ptr() const;
  // Typed pointer, as data_ptr(); throws InvalidArgument when T does not match dtype().
  template <ElementType T>
  T* data() const;
  // Typed pointer, as const_data_ptr() (a read: not counted in Storage::version, so it does not
  // trip the autograd tape's in-place check); throws as data<T>().
  template <ElementType T>
  const T* const_data() const;
  // Pointer to the first element WITHOUT waiting, for the producer of pending data.
  void* raw_data_ptr() const;
  // Waits for pending storage; returns *this. Waiting twice costs nothing.
  const Tensor& wait() const;
  // Elements in logical (row-major) order converted to T; waits.
  template <ElementType T>
  std::vector<T> to_vector() const;
  // The only element converted to T; throws ShapeError unless numel() == 1, and
  // InvalidArgument when T cannot hold it (as PyTorch's item<T>(): 3e9 as int32_t, NaN as int).
  // to_vector converts as Tensor::to does instead (wrapping or saturating).
  template <ElementType T>
  T item() const;
  // "tensor(f32[2,2], [[1, 2], [3, 4]])"; waits. Long tensors are abbreviated.
  std::string to_string() const;

  // ---- views (never wait) ----
  // One dim may be -1. view requires a compatible layout (contiguous); reshape copies when not.
  Tensor view(const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;
  Tensor flatten() const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  // Pieces of `split_size` along dim (the last may be smaller).
  std::vector<Tensor> split(int64_t split_size, int64_t dim = 0) const;
  std::vector<Tensor> split_with_sizes(const std::vector<int64_t>& sizes, int64_t dim = 0) const;
  // `chunks` pieces of ceil(size/chunks) (fewer when the size runs out), as torch.chunk.
  std::vector<Tensor> chunk(int64_t chunks, int64_t dim = 0) const;
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  // Reinterprets the bits; the last dim scales by the itemsize ratio (must be contiguous there).
  Tensor view_dtype(DType dtype) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor squeeze(int64_t dim) const;
  Tensor select(int64_t dim, int64_t index) const;
  // Broadcast view (stride 0 on expanded dims) to `shape`, as torch.expand: `shape` may add
  // leading dims; each existing dim must equal its target or be 1; -1 keeps a dim.
  Tensor expand(const Shape& shape) const;

  // ---- copies (wait) ----
  // *this when already contiguous, else a contiguous copy.
  Tensor contiguous() const;
  Tensor clone() const;
  // Converted copy; same dtype → clone.
  Tensor to(DType dtype) const;
  // Copies src into *this (shapes must match; dtypes may differ: converts). Returns *this.
  const Tensor& copy_(const Tensor& src) const;
  // Fills every element with value (converted to dtype; integers as full()).
  const Tensor& fill_(double value) const;
  template <std::integral T>
  const Tensor& fill_(T value) const {
    if (above_int64(value)) return fill_(static_cast<double>(value));
    return fill_integer_(static_cast<int64_t>(value));
  }
  // Concatenation along dim; all inputs share dtype and every other dim.
  static Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);

  // Bitwise equality of shape, dtype and values (NaNs compare by bits).
  bool equal(const Tensor& other) const;

  // ---- annotation ----
  // An opaque handle a layer above core attaches to a tensor (the tracer marks the meta tensors
  // it creates with the graph value they stand for). Copies of this Tensor share it; views,
  // copies of the data and every other derived tensor start without one. Null by default.
  const std::shared_ptr<void>& annotation() const { return annotation_; }
  void set_annotation(std::shared_ptr<void> annotation) { annotation_ = std::move(annotation); }

 private:
  std::shared_ptr<Storage> storage_;
  std::shared_ptr<void> annotation_;
  std::shared_ptr<const detail::Layout> layout_;  // null exactly when undefined (or moved from)
  int64_t offset_ = 0;
  DType dtype_ = DType::F32;

  Tensor with_layout(Shape sizes, Shape strides, int64_t offset) const;
  // A view of the same elements with the same layout (shared), without the annotation.
  Tensor alias() const;
  void* first_element() const;  // storage_ non-null
  static Tensor full_integer(const Shape& shape, DType dtype, int64_t value);
  const Tensor& fill_integer_(int64_t value) const;
  // An unsigned value no int64_t holds (no integer dtype holds it either).
  template <std::integral T>
  static bool above_int64(T value) {
    if constexpr (std::is_unsigned_v<T> && sizeof(T) >= sizeof(int64_t)) {
      return value > static_cast<T>(INT64_MAX);
    } else {
      return false;
    }
  }
};

// Row-major (contiguous) strides of a shape.
Shape contiguous_strides(const Shape& shape);
// Product of the dims (1 for a scalar shape; 0 when any dim is 0, however large the others);
// ShapeError when it does not fit in int64.
int64_t shape_numel(const Shape& shape);
// "[2,3]".
std::string shape_str(const Shape& shape);
// "f32[2,3]".
std::string type_str(DType dtype, const Shape& shape);

// cat's legacy rule (PyTorch's): a 1-D shape of no elements, [0], joins any concatenation and
// takes no part in its shape checks.
inline bool cat_skips(const Shape& shape) { return shape.size() == 1 && shape[0] == 0; }
// The input whose shape a concatenation of `n` inputs takes (all dims but the cat dim): the
// first that cat does not skip, or input 0 when it skips them all.
template <typename ShapeOf>
size_t cat_reference(size_t n, ShapeOf shape_of) {
  for (size_t i = 0; i < n; ++i) {
    if (!cat_skips(shape_of(i))) return i;
  }
  return 0;
}

}  // namespace funcol
