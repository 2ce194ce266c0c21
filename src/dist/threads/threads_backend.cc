// The `threads` backend: ranks are threads of one process; collectives run in shared memory.
//
// Design. Every collective is one shared `Op` per (group, sequence number), created by the first
// rank that issues it; each rank *joins* it by posting its buffer pointers and a descriptor
// (checked against the first rank's: a mismatch fails the op on every rank). Each rank also
// keeps an ordered queue of the ops it issued: an op becomes *eligible* once it is its group's
// first unfinished op in every member's queue, so a group's collectives execute in issue order,
// while the collectives of different groups run independently, as on gloo and mpi (two groups
// of the same ranks may be issued in different orders on different ranks, or from a thread a
// group). A collective that reads a buffer an earlier one of the rank's still writes waits at
// issue (through the tensor), whatever the groups; so does one that writes a buffer a pending
// functional collective reads (the API registers its readers) and a small all_reduce writing
// a buffer any pending collective of the rank reads (wait_readers). The ProcessGroup
// primitives otherwise leave a write to a buffer that another group's pending collective still
// reads to the caller, as gloo and mpi do (README).
//
// Nobody owns an op's execution: the thread that makes it eligible (the last rank to issue it,
// or the thread that completed the op ahead of it) runs it at once, and every thread that waits
// on an op helps: the work is cut into chunks (32-64 KiB; one chunk below 32 KiB, where moving
// cache lines between cores costs more than the copy) claimed through atomic cursors, one per
// member over its own range of chunks (a rank takes its range first, then what is left of the
// others'), and each chunk reads the peers' buffers directly and writes every destination
// (all_reduce: reduce the chunk of all inputs, in rank order, into rank 0's buffer and copy it
// to the others). No staging copies, no communication threads, no handoff when the caller
// waits at once. Outputs stay pending on the Op (attached to their Storage) until the last
// chunk finished.
//
// Small all_reduces (the common latency-bound call: a loss, a norm, a flag) skip all of this:
// they meet in a per-group *lane* of persistent slots, one atomic arrival each, and the last to
// arrive executes (see LaneSlot).
//
// Failure is never a hang: waits spin a few µs, yield, then sleep with the op's deadline
// (issue time + timeout); a departed rank fails every op it has not joined at once. The short
// critical sections of joining and queueing use a spin-then-yield-then-nap lock (SpinMutex).
#include "threads/threads_backend.h"

#include <sched.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#ifdef __SSE2__
#include <immintrin.h>
#endif
#include <deque>
#include <span>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "checks.h"
#include "funcol/core/error.h"
#include "funcol/core/kernels.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/work.h"
#include "spin.h"

namespace funcol::threads_detail {

using Clock = std::chrono::steady_clock;
using dist_detail::Backoff;
using dist_detail::format_ranks;
using dist_detail::split_mismatch;

// The failure a rank gets for a collective that had failed before it issued it. When its peers
// timed out waiting for it (`given_up_on`: the global ranks that timeout found missing), their
// error names it among the missing ranks; said to it as it is, that reads as if it never came:
// it is told it came too late. (Other failures, a departure or a mismatch of others, stand as
// they are.)
// `error` said to `ranks`, which issued the collective after the failure (none: as it is).
std::string came_late(const std::string& error, const std::vector<int>& ranks) {
  if (ranks.empty()) return error;
  if (ranks.size() == 1) {
    return fmt::format("{}; rank {} issued it only after the others had given up on it", error,
                       ranks[0]);
  }
  return fmt::format("{}; ranks {} issued it only after the others had given up on it", error,
                     format_ranks(ranks));
}

std::string issued_after_failure(const std::string& error, const std::vector<int>& given_up_on,
                                 int rank) {
  if (std::find(given_up_on.begin(), given_up_on.end(), rank) == given_up_on.end()) return error;
  return came_late(error, {rank});
}

// The global rank this thread last issued a collective as (-1: none): where it starts taking
// chunks of a running op (see Op::claim).
thread_local int tl_rank = -1;

// Work granularity: at most 64 KiB, which keeps a chunk in L2 (reduce then copy re-reads it
// from cache) and makes the atomic claim (~100 ns) negligible next to the copy (~5 µs). Mid-size
// collectives are cut into about one chunk per rank so that every waiting rank takes a share,
// but never below 32 KiB: splitting a 4 KiB all_reduce in two measured 2x slower on the 2-core
// CI machine (the cache-line handoffs of a second executor cost more than the bytes).
constexpr int64_t kMaxChunkBytes = 64 * 1024;
constexpr int64_t kMinChunkBytes = 32 * 1024;
constexpr int kListedChunks = 8;
// Collectives moving at least this much (total, all ranks) write their copies with streaming
// stores: the outputs cannot stay in cache anyway, and skipping the read-for-ownership of
// every destination line gives ~25% more copy bandwidth (measured: 9.9 -> 12.6 GB/s on the
// 2-core CI machine). Below 8 MB the outputs do stay in its cache: streaming them made 4 MB
// all_gather, all_reduce and all_to_all 1.3-1.9x slower there; at 8 MB and above it is as
// fast or faster. (glibc's memcpy streams only from 3/4 of the shared cache. On a machine that
// reports 384 MB, streaming from 8 MB still made 64 MiB all_gather and all_to_all 10-20%
// faster in `funcol bench -c 1` runs, with mixed results in -c 0 runs: bench/RESULTS.md.)
// FUNCOL_STREAM_MB sets the threshold (0: stream every copy of 256 bytes or more); it is read
// when run_local starts.
int64_t stream_threshold() {
  constexpr int64_t kDefaultStreamBytes = 8 << 20;
  const std::optional<double> mb =
      dist_detail::env_number("FUNCOL_STREAM_MB", "a number of megabytes (0 or more)",
                              [](double v) { return v >= 0; });
  // Past 1e12 MB (more than any copy) it means "never", as 1e12 does.
  return mb ? static_cast<int64_t>(std::min(*mb, 1e12) * (1 << 20)) : kDefaultStreamBytes;
}

#if defined(__SSE2__)
#define FUNCOL_STREAMING_COPY 1
#endif

std::atomic<bool> stream_avx2_disabled{false};

#ifdef FUNCOL_STREAMING_COPY
// GCC's AddressSanitizer and ThreadSanitizer do not see its non-temporal store builtins (a
// streaming store past a buffer's end, or racing with a reader, goes unreported): sanitizer
// builds store the same bytes with ordinary aligned stores, which they check (and which fault
// on a misaligned address, as the streaming ones do), so that the streaming copies' bounds and
// races are checked as they run everywhere else. (Ordinary stores are ordered, so a missing
// sfence would not show there.) Sanitizer builds run copy_to_each_avx2 too.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline void stream_store(__m128i* p, __m128i v) { _mm_store_si128(p, v); }
__attribute__((target("avx2"))) inline void stream_store(__m256i* p, __m256i v) {
  _mm256_store_si256(p, v);
}
#else
inline void stream_store(__m128i* p, __m128i v) { _mm_stream_si128(p, v); }
__attribute__((target("avx2"))) inline void stream_store(__m256i* p, __m256i v) {
  _mm256_stream_si256(p, v);
}
#endif

// The streaming copy's AVX2 loop: 32-byte streaming stores, 1.05-1.17x the SSE2 loop's
// bandwidth in 10 side-by-side 64 MiB all_to_all runs on a Zen 5 host (RESULTS.md, session 49).
// n >= 256.
__attribute__((target("avx2"))) void stream_copy_avx2(char* dst, const char* src, size_t n) {
  size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 64 <= n; i += 64) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    stream_store(reinterpret_cast<__m256i*>(dst + i), a);
    stream_store(reinterpret_cast<__m256i*>(dst + i + 32), b);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
}

// Whether this CPU runs the AVX2 copies (stream_copy_avx2, copy_to_each_avx2).
bool cpu_has_avx2() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
}
#endif

// Copies n bytes between non-overlapping buffers, with streaming stores when `stream`.
void copy_bytes(char* dst, const char* src, size_t n, bool stream) {
#ifdef FUNCOL_STREAMING_COPY
  if (stream && n >= 256 && cpu_has_avx2() &&
      !stream_avx2_disabled.load(std::memory_order_relaxed)) {
    stream_copy_avx2(dst, src, n);
    return;
  }
  if (stream && n >= 256) {
    size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      stream_store(reinterpret_cast<__m128i*>(dst + i), a);
      stream_store(reinterpret_cast<__m128i*>(dst + i + 16), b);
      stream_store(reinterpret_cast<__m128i*>(dst + i + 32), c);
      stream_store(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, n - i);
    _mm_sfence();  // streaming stores are weakly ordered: publish before the chunk counts done
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// The most destinations copy_to_each stores each loaded block to.
constexpr int kCopyToEachMax = 8;

#ifdef FUNCOL_STREAMING_COPY
// Stores each 64-byte block of `src` loaded once to every destination; with Stream, by streaming
// stores, which need every destination 32-byte aligned alike (copy_to_each checks). Those are
// not fenced here: the chunk running the copy fences once at its end (Op::run_chunk), as a fence
// after each small input's copy cost more than streaming saved.
template <int N, bool Stream>
__attribute__((target("avx2"))) void copy_to_each_avx2(char* const* dst_list, const char* src,
                                                       size_t bytes) {
  // In registers: the stores may alias anything, so each would reload the list.
  std::array<char*, N> dsts;
  std::copy_n(dst_list, N, dsts.begin());
  size_t i = 0;
  if constexpr (Stream) {
    i = std::min(bytes, (32 - (reinterpret_cast<uintptr_t>(dsts[0]) & 31)) & 31);
    for (int k = 0; k < N; ++k) std::memcpy(dsts[k], src, i);
  }
  for (; i + 64 <= bytes; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    for (int k = 0; k < N; ++k) {
      if constexpr (Stream) {
        stream_store(reinterpret_cast<__m256i*>(dsts[k] + i), a);
        stream_store(reinterpret_cast<__m256i*>(dsts[k] + i + 32), b);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsts[k] + i), a);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsts[k] + i + 32), b);
      }
    }
  }
  if (i < bytes) {
    for (int k = 0; k < N; ++k) std::memcpy(dsts[k] + i, src + i, bytes - i);
  }
}

// copy_to_each_avx2<n, Stream> for n in [2, kCopyToEachMax] (a loop over a count known only at
// run time kept the gain from being had).
template <bool Stream, int... N>
constexpr auto copy_to_each_table(std::integer_sequence<int, N...>) {
  return std::array<void (*)(char* const*, const char*, size_t), sizeof...(N)>{
      &copy_to_each_avx2<N + 2, Stream>...};
}
constexpr auto kCopyToEach =
    copy_to_each_table<false>(std::make_integer_sequence<int, kCopyToEachMax - 1>());
constexpr auto kStreamToEach =
    copy_to_each_table<true>(std::make_integer_sequence<int, kCopyToEachMax - 1>());
#endif

// Copies `bytes` from `src` into each of n destinations, none of which overlaps it, with streaming
// stores when `stream` (left unfenced: see copy_to_each_avx2). Up to kCopyToEachMax destinations
// are written from one load of each block: a bucketed all_gather copies each small input into
// every rank's output, and a copy per destination read the input again and restarted the copy
// for each (with the next input's prefetch in run_piece, all_gather_flat of 1000 x 4 KiB on 2
// ranks went 7-21% faster: RESULTS.md, session 51; streamed, and fenced once per chunk rather
// than per copy, 1.04-1.13 -> 0.68-0.75 ms on an Intel host: session 57). Streaming that way
// needs the destinations 32-byte aligned alike; others are copied one at a time.
template <typename DstOf>  // char* (int k): destination k
void copy_to_each(int n, const DstOf& dst_of, const char* src, size_t bytes, bool stream) {
#ifdef FUNCOL_STREAMING_COPY
  if (cpu_has_avx2() && n > 1 && n <= kCopyToEachMax && bytes >= (stream ? 256 : 64) &&
      !(stream && stream_avx2_disabled.load(std::memory_order_relaxed))) {
    std::array<char*, kCopyToEachMax> dsts;
    bool aligned_alike = true;
    for (int k = 0; k < n; ++k) {
      dsts[k] = dst_of(k);
      aligned_alike &=
          ((reinterpret_cast<uintptr_t>(dsts[k]) - reinterpret_cast<uintptr_t>(dsts[0])) & 31) == 0;
    }
    if (!stream) {
      kCopyToEach[n - 2](dsts.data(), src, bytes);
      return;
    }
    if (aligned_alike) {
      kStreamToEach[n - 2](dsts.data(), src, bytes);
      return;
    }
  }
#endif
  for (int k = 0; k < n; ++k) copy_bytes(dst_of(k), src, bytes, stream);
}

// Asks for the first lines of the `bytes` at `p`, its own only and at most 8: the next input of a
// flat collective, which starts on another page, where the hardware prefetcher starts over. (A
// whole page asked for made the 1000 x 4 KiB all_reduce bucket slower; 8 lines of inputs
// smaller than that filled the miss queue with prefetches past them, each waiting for a slot.)
void prefetch_head(const char* p, int64_t bytes) {
  const int64_t lines = std::min<int64_t>(8, (bytes + 63) / 64);
  for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(p + 64 * l, 0, 3);
}

// Copies unless the ranges are the same; tolerates overlap (an input that is a view of the
// output).
void move_bytes(char* dst, const char* src, size_t n, bool stream) {
  if (dst == src || n == 0) return;
  if (dst + n <= src || src + n <= dst) {
    copy_bytes(dst, src, n, stream);
  } else {
    std::memmove(dst, src, n);
  }
}

// A vector that stores up to N elements inline: a collective usually has one tensor and one or
// two storages, and allocating for them would dominate the latency of a small collective.
template <typename T, size_t N>
class InlineVec {
 public:
  void push_back(T v) { emplace_back() = std::move(v); }
  // A new value-initialised element, built where it stays: filled in place, a coalesced list's
  // slots are not copied from a temporary (whose wide loads waited on the narrow stores that
  // built it: 67 -> 34 us for a 1000-slot post on one rank).
  T& emplace_back() {
    if (size_ < N) {
      inline_[size_] = T();
      return inline_[size_++];
    }
    if (size_ == N) {
      heap_.reserve(2 * N);
      for (auto& x : inline_) heap_.push_back(std::exchange(x, T()));
    }
    ++size_;
    return heap_.emplace_back();
  }
  // Room for n elements without reallocating (a coalesced list of thousands of tensors).
  void reserve(size_t n) {
    if (n > N) heap_.reserve(n);
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* begin() { return size_ <= N ? inline_.data() : heap_.data(); }
  T* end() { return begin() + size_; }
  const T* begin() const { return size_ <= N ? inline_.data() : heap_.data(); }
  const T* end() const { return begin() + size_; }
  T& operator[](size_t i) { return begin()[i]; }
  const T& operator[](size_t i) const { return begin()[i]; }
  T& back() { return begin()[size_ - 1]; }
  void pop_back() {
    if (size_ <= N) {
      inline_[--size_] = T();
      return;
    }
    heap_.pop_back();
    if (--size_ == N) {  // back to inline storage
      for (size_t i = 0; i < N; ++i) inline_[i] = std::move(heap_[i]);
      heap_.clear();
    }
  }
  void clear() {
    for (auto& x : inline_) x = T();
    heap_.clear();
    size_ = 0;
  }

 private:
  std::array<T, N> inline_{};
  std::vector<T> heap_;
  size_t size_ = 0;
};

// A lock for the short critical sections of joining and queueing (a few hundred ns, no
// syscalls inside): ranks issuing the same collective contend for it at the same moment, and a
// std::mutex then parks the loser in the kernel (futex wait + wake cost several µs, more than
// the whole collective). The loser spins briefly, then yields (an oversubscribed holder gets
// the core), then sleeps in short naps: never an unbounded spin.
class SpinMutex {
 public:
  void lock() {
    if (!locked_.exchange(true, std::memory_order_acquire)) return;
    lock_slow();
  }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  void lock_slow() {
    for (int attempt = 0;; ++attempt) {
      if (attempt < 256) {
        dist_detail::cpu_relax();
      } else if (attempt < 256 + 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      if (!locked_.load(std::memory_order_relaxed) &&
          !locked_.exchange(true, std::memory_order_acquire)) {
        return;
      }
    }
  }

  std::atomic<bool> locked_{false};
};

enum class OpKind : uint8_t { AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Barrier };

// "all_reduce", "all_reduce_coalesced", "all_reduce_flat" (a flat post is coalesced too).
std::string op_name(OpKind kind, bool coalesced, bool flat = false) {
  std::string name;
  switch (kind) {
    case OpKind::AllReduce: name = "all_reduce"; break;
    case OpKind::AllGather: name = "all_gather"; break;
    case OpKind::ReduceScatter: name = "reduce_scatter"; break;
    case OpKind::AllToAll: name = "all_to_all"; break;
    case OpKind::Broadcast: name = "broadcast"; break;
    case OpKind::Barrier: name = "barrier"; break;
  }
  if (flat) {
    name += "_flat";
  } else if (coalesced) {
    name += "_coalesced";
  }
  return name;
}

bool reduces(OpKind kind) { return kind == OpKind::AllReduce || kind == OpKind::ReduceScatter; }

// One tensor of a rank's part of a collective. `count` is the per-rank element count the
// descriptors are compared on: all_reduce/broadcast numel, all_gather input numel,
// reduce_scatter output numel, all_to_all elements per row.
// The input's shape is compared across ranks too (as torch.distributed's DETAIL debug mode
// does; packed as dist_detail::pack_compared_shape); all_to_all compares a row's shape.
// The shape comes last: a peer comparing two slots of equal count reads it only for two or
// more dims (one cache line less per member for the lane's executor).
struct Slot {
  DType dtype = DType::F32;
  int8_t ndim = -1;  // -1: shape not recorded
  int64_t count = 0;
  const char* in = nullptr;
  char* out = nullptr;
  const Storage* in_storage = nullptr;  // identity only: whose bytes `in` reads
  dist_detail::ShapeWords dims{};

  // For slots of equal count (a 0- or 1-dim shape is its count then).
  bool same_shape(const Slot& o) const {
    if (ndim < 0 || o.ndim < 0) return true;
    if (ndim != o.ndim) return false;
    return ndim <= 1 || dist_detail::same_packed_shape(ndim, dims, o.ndim, o.dims);
  }
  // "f32[2,3]" ("f32[*,3]": an all_to_all's rows), or "f32 numel 6" without a recorded shape.
  std::string describe(bool rows) const {
    if (ndim < 0) return fmt::format("{} {} {}", dtype_name(dtype), rows ? "row" : "numel", count);
    return dist_detail::describe_compared_shape(dtype, ndim, dims, rows);
  }
};

// One rank's part of a collective: what it asked for and where its buffers are.
struct Post {
  OpKind kind = OpKind::Barrier;
  bool coalesced = false;
  ReduceOp reduce_op = ReduceOp::Sum;
  int root = 0;
  InlineVec<Slot, 1> slots;
  std::vector<int64_t> input_splits;   // all_to_all rows to each rank
  std::vector<int64_t> output_splits;  // all_to_all rows from each rank
  // Keeps the buffers alive until the op finished (a dropped result must stay valid).
  InlineVec<std::shared_ptr<Storage>, 2> keep;
  // all_reduce_flat / all_gather_flat / reduce_scatter_flat: slots[0] is the output (its count
  // its numel, no input); the inputs are read in order into it. Counts are compared across
  // ranks as a coalesced list's slots are.
  bool flat = false;
  std::vector<const char*> flat_in;
  std::vector<int64_t> flat_counts;
  std::vector<const Storage*> flat_storages;  // identity only (World::wait_readers)
  std::shared_ptr<const void> hold;           // the input list, alive until the op finished
  uint8_t step = 0;  // dist_detail::internal_step() of the issuing thread
  // Non-empty when a buffer of this rank's holds the failed result of an earlier collective
  // (say why): the rank still takes the collective's place in the group's sequence, and the
  // collective fails for every member with this reason (see ThreadsGroup::buffer_ptr).
  std::string failed_buffer;

  // "all_reduce(f32, numel 16, op sum)", for mismatch messages.
  std::string summary() const {
    return call_summary() + dist_detail::describe_step(dist_detail::step_label(step));
  }
  std::string call_summary() const {
    if (flat) {
      std::string s = fmt::format("{}({}, {} tensors: numel ",
                                  op_name(kind, /*coalesced=*/true, /*flat=*/true),
                                  dtype_name(slots[0].dtype), flat_counts.size());
      for (size_t i = 0; i < flat_counts.size(); ++i) {
        if (i == 8 && flat_counts.size() > 9) {
          s += ", ...";
          break;
        }
        s += fmt::format("{}{}", i ? ", " : "", flat_counts[i]);
      }
      return s + (reduces(kind) ? fmt::format(", op {})", reduce_op_name(reduce_op)) : ")");
    }
    std::string s = op_name(kind, coalesced) + "(";
    if (kind == OpKind::Barrier) return s + ")";
    if (coalesced) s += fmt::format("{} tensors: ", slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      if (i) s += ", ";
      if (i == 8 && slots.size() > 9) {
        s += "...";
        break;
      }
      s += slots[i].describe(kind == OpKind::AllToAll);
    }
    if (reduces(kind)) s += fmt::format(", op {}", reduce_op_name(reduce_op));
    if (kind == OpKind::Broadcast) s += fmt::format(", src {}", root);
    return s + ")";
  }

  bool same_call(const Post& o) const {
    if (kind != o.kind || coalesced != o.coalesced || slots.size() != o.slots.size()) return false;
    if (step != o.step) return false;
    if (flat != o.flat || flat_counts != o.flat_counts) return false;
    if (reduces(kind) && reduce_op != o.reduce_op) return false;
    if (kind == OpKind::Broadcast && root != o.root) return false;
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i].dtype != o.slots[i].dtype || slots[i].count != o.slots[i].count ||
          !slots[i].same_shape(o.slots[i])) {
        return false;
      }
    }
    return true;
  }
};

// ---------------------------------------------------------------------------------------------
// The lane: small all_reduces (one tensor, at most kLaneMaxBytes, groups of 2..kLaneMaxRanks)
// skip the Op machinery. Each group has kLaneSlots persistent slots; the collective with
// sequence number S uses slot S % kLaneSlots. A rank posts its buffers into its record of the
// slot and sets its bit in the slot's state with one atomic; the rank that completes the mask
// checks every record against rank 0's and executes at once (reduce into rank 0's buffer, copy
// to the others), finishes every member's LaneWork and frees the slot. No queue, no group lock,
// no allocation shared between ranks: a 2-rank call moves a handful of cache lines instead of
// the Op's dozens (RESULTS.md, issue 2).
//
// Every rank takes the lane for the same collectives (the choice depends only on the call), so
// a slot serves one sequence number at a time: a rank that runs kLaneSlots lane collectives
// ahead of a peer waits for the slot (every later collective of its would be queued behind the
// unfinished one anyway). A lane collective is not queued behind the rank's earlier ones; it
// waits at issue for the earlier ones that still read its buffer (writes and reads of pending
// outputs already wait through the tensor). Failures: a mismatch between members is found by the
// executor; a departed member, a timeout, or a member that issued a different collective on the
// Op path (a mismatch too; found when either side arrives) by the arrivals' and waiters' checks,
// which *fail* the slot: the members that arrived get the error, later arrivals get it at once,
// and the slot is freed once every member arrived or was counted absent. A rank that gives up
// waiting for a busy slot leaves an absence (SharedGroup::lane_absences) for whoever claims the
// slot for its collective. When the Op-path side of such a mismatch runs kLaneSlots
// collectives ahead and claims the slot for a later one before the lane side reached the
// mismatched one, the lane side finds the slot serving a later collective than its own, which
// no correct program allows, and reports the mismatch then (the Op path never blocks at issue
// for the lane's sake, which would delay correct programs).
constexpr int kLaneMaxRanks = 8;
constexpr int kLaneSlots = 8;
constexpr int64_t kLaneMaxBytes = kMinChunkBytes;
// A slot's state is one word: the bits of the members that arrived (0-7), busy (8: serving the
// sequence number in bits 9-61), absences (62: a member gave up waiting for the slot, see
// SharedGroup::lane_absences) and failed (63). Claiming a free slot, arriving and failing are
// each one atomic operation on it, and a failer's compare-exchange includes the sequence
// number, so it can never hit the slot's next collective.
constexpr uint64_t kLaneArrived = 0xff;
constexpr uint64_t kLaneBusy = uint64_t{1} << 8;
constexpr uint64_t kLaneAbsent = uint64_t{1} << 62;
constexpr uint64_t kLaneFailed = uint64_t{1} << 63;
constexpr uint64_t lane_seq_bits(uint64_t seq) { return (seq << 9) & ~(kLaneFailed | kLaneAbsent); }
constexpr uint64_t lane_seq(uint64_t state) { return (state & ~(kLaneFailed | kLaneAbsent)) >> 9; }
constexpr bool lane_serves(uint64_t state, uint64_t seq) {
  return (state & kLaneBusy) != 0 && lane_seq(state) == lane_seq(lane_seq_bits(seq));
}

// RankState::last_issued: the low bits hold the group id.
constexpr int kIssuedGroupBits = 20;
// A wait that has slept this long (and has at least as long left before its deadline) prints
// what it waits for if every missing rank's last collective waits too (World::warn_stalled).
// FUNCOL_STALL_WARNING sets it in seconds (0: never), read when run_local starts.
std::chrono::nanoseconds stall_warning_after() {
  const std::optional<double> seconds =
      dist_detail::env_number("FUNCOL_STALL_WARNING", "a number of seconds (0 or more)",
                              [](double v) { return v >= 0; });
  // Past 1e9 s (31 years, past any deadline) a warning never comes, as at 1e9.
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(std::min(seconds.value_or(10.0), 1e9)));
}

// When a sleeping wait looks whether it stalls: every `after` while it sleeps, until it warned
// or its deadline is less than `after` away. `after` is read at the first due() only: a wait
// that ends while it spins never touches the line that holds it.
class StallClock {
 public:
  explicit StallClock(const std::chrono::nanoseconds& after) : after_ref_(after) {}
  // Whether to look now.
  bool due(Clock::time_point now, Clock::time_point deadline) {
    if (done_) return false;
    if (look_ == Clock::time_point()) {
      after_ = after_ref_;
      done_ = after_.count() == 0;
      look_ = now + after_;
      return false;
    }
    if (now < look_) return false;
    look_ = now + after_;
    looks_++;
    done_ = deadline - now < after_;
    return !done_;
  }
  void warned() { done_ = true; }
  // How long the wait has slept, in whole `after`s.
  std::chrono::nanoseconds slept() const { return looks_ * after_; }
  // Until when a wait with `deadline` may sleep before it looks.
  Clock::time_point next(Clock::time_point deadline) const {
    if (done_ || look_ == Clock::time_point()) return deadline;
    return std::min(deadline, look_);
  }

 private:
  const std::chrono::nanoseconds& after_ref_;
  std::chrono::nanoseconds after_{0};
  Clock::time_point look_{};
  int looks_ = 0;
  bool done_ = false;
};

class LaneWork;

// One member's part of a lane collective; written by the member before it sets its bit.
// What the executor reads (the Work, the deadline, the op, the slot up to its shape) fits the
// first line.
struct alignas(64) LaneRecord {
  std::shared_ptr<LaneWork> work;  // finished (and released) by the executor or a failer
  // The work's deadline (steady clock ticks), for its peers: the collective times out at its
  // members' earliest, as an Op times out at its first joiner's (see World::lane_deadline).
  // Read without the lock by waiters that may race with the slot's next collective, which can
  // only move the deadline later (and a failer's compare-exchange checks the seq anyway).
  std::atomic<Clock::rep> deadline{0};
  ReduceOp reduce_op = ReduceOp::Sum;
  uint8_t step = 0;  // as Post::step
  Slot slot;

  Post post() const { return post(slot, reduce_op, step); }
  static Post post(const Slot& slot, ReduceOp reduce_op, uint8_t step) {
    Post p;
    p.kind = OpKind::AllReduce;
    p.reduce_op = reduce_op;
    p.slots.push_back(slot);
    p.step = step;
    return p;
  }
  bool same_call(const LaneRecord& o) const {
    return slot.dtype == o.slot.dtype && slot.count == o.slot.count &&
           slot.same_shape(o.slot) && reduce_op == o.reduce_op && step == o.step;
  }
};

struct LaneSlot {
  alignas(64) std::atomic<uint64_t> state{0};
  // After a failure: the failer and the members counted out so far; freed at size + 1.
  std::atomic<int> exits{0};
  // Written under the group's mu before kLaneFailed is set; read by whoever sees it set.
  std::string error;
  std::vector<int> given_up_on;  // a timeout's missing ranks (global); else empty
  // One timeout after the slot last failed, or was freed after a failure (steady clock
  // ticks): a member blocked behind the failed collective or a later absence, waiting for late
  // members to come, gives up then unless they move it on. Atomic: such a member reads it
  // while the slot may move on and fail again.
  std::atomic<Clock::rep> late_deadline{0};
  std::array<LaneRecord, kLaneMaxRanks> records;
};

// A contiguous range of one piece of work (see Op::run_piece for what a, b mean per kind).
struct Piece {
  int32_t t;  // slot
  int32_t a;
  int32_t b;
  int64_t begin;  // elements (bytes for all_to_all)
  int64_t len;
};

// The layout of a flat collective (all_reduce_flat and friends): its pieces, chunks and input
// offsets, which depend only on the kind, the group size, the dtype, the output's count and the
// inputs' counts. A bucket runs with the same layout every step, so its group keeps the last
// one and the next op of that layout shares it: planning 2000 pieces took 15-23 us a step, in
// the way of both ranks (a bucketed 1000 x 4 KiB reduce_scatter, 2 ranks).
struct FlatPlan {
  // What the layout depends on.
  OpKind kind = OpKind::Barrier;
  int size = 0;
  DType dtype = DType::F32;
  int64_t count = 0;  // the output's elements
  std::vector<int64_t> counts;  // the inputs' elements
  // The layout.
  bool stream = false;  // streaming stores (from the size; the world's threshold is fixed)
  std::vector<Piece> pieces;
  std::vector<uint32_t> chunk_starts;  // chunks + 1 entries
  std::vector<int64_t> flat_off;       // input i's first element; then the total
};

class World;
struct SharedGroup;

enum State : int { kPending = 0, kPlanning = 1, kRunning = 2, kFinished = 3 };

// One collective shared by the members of a group; also every member's Work.
// The group's name as member `member`'s Works hold it (SharedGroup::member_names).
std::shared_ptr<const std::string> member_name(const SharedGroup& group, int member);

class Op final : public Work, public std::enable_shared_from_this<Op> {
 public:
  // Created ahead of need by a rank (outside the group's lock); the identity is set by
  // init() under the lock before any other rank can see it.
  // `member`: the creating rank's group rank.
  Op(World* world, SharedGroup* group, int size, int member)
      : world_(world),
        group_(group),
        group_name_(member_name(*group, member)),
        size_(size),
        members_(size) {
    init_members();
  }
  // Releases the keep-alive references complete() left for `global_rank`'s thread (-1: for
  // every member); touches nothing but this op, so it is safe after the world is gone.
  void release_returned_keep(int global_rank) {
    for (Member& m : members_) {
      if ((global_rank < 0 || m.global_rank == global_rank) &&
          m.keep_returned.load(std::memory_order_acquire) &&
          m.keep_returned.exchange(false, std::memory_order_acq_rel)) {
        m.post.keep.clear();
      }
    }
  }
  void init(uint64_t seq, OpKind kind, bool coalesced, bool flat, Clock::time_point deadline) {
    seq_ = seq;
    kind_ = kind;
    coalesced_ = coalesced;
    flat_ = flat;
    deadline_ = deadline;
  }

  void wait() override;
  bool poll() override;
  // Per member: the threads of every member wait on this one Work.
  bool failure_seen(int global_rank) const override {
    return std::any_of(members_.begin(), members_.end(), [&](const Member& m) {
      return m.global_rank == global_rank && m.saw_failure.load(std::memory_order_relaxed);
    });
  }
  // For the member whose thread calls (every member's for a thread that is none of them: it
  // may read any member's result).
  void set_failure_seen() override {
    const bool member = caller_is_member();
    for (Member& m : members_) {
      if (!member || m.global_rank == tl_rank) m.saw_failure.store(true, std::memory_order_relaxed);
    }
  }
  // Whether the calling thread is a member's (its rank, tl_rank, is one of theirs).
  bool caller_is_member() const {
    return std::any_of(members_.begin(), members_.end(),
                       [](const Member& m) { return m.global_rank == tl_rank; });
  }
  // Fails this pending op past its deadline, naming the missing ranks (wait and poll).
  void time_out();
  // "all_reduce on group 'world' (seq 4)", formatted on first use.
  const std::string& description() const override;
  // Wakes sleeping waiters so that they come and help with chunks.
  void wake() { wake_waiters(); }

  // Set by init() before the op is published, constant afterwards.
  OpKind kind_ = OpKind::Barrier;  // of the first rank to issue it
  bool coalesced_ = false;
  bool flat_ = false;  // all_reduce_flat and friends: named so in errors, not "_coalesced"
  uint64_t seq_ = 0;
  Clock::time_point deadline_;

  mutable std::once_flag description_once_;
  mutable std::string description_;
  World* const world_;
  SharedGroup* const group_;
  const std::shared_ptr<const std::string> group_name_;  // outlives the group
  const int size_;

  // ---- guarded by group_->mu ----
  // By group rank. post and joined are guarded by group_->mu (post is read without it once the
  // op is eligible); head_marked by the queue mutex of the member's rank.
  struct Member {
    Post post;
    uint8_t joined = 0;
    uint8_t issued = 0;  // joined by issuing this op (not a lane member counted absent)
    uint8_t head_marked = 0;
    int global_rank = -1;  // constant: the member's rank, readable after its group is gone
    // complete() left post.keep for the member's own thread to release (see there).
    std::atomic<bool> keep_returned{false};
    std::atomic<bool> saw_failure{false};  // wait() threw the failure to the member's thread
  };
  std::vector<Member> members_;
  int joined_count_ = 0;
  int ref_ = -1;  // the first rank whose post was stored: the reference descriptor
  bool doomed_ = false;  // a join found a mismatch or departure; fail_op follows
  // A timeout's missing ranks (global), written by fail_op before the op completes.
  std::vector<int> given_up_on_;

  std::atomic<int> heads_{0};  // members at whose queue head this op is
  std::atomic<int> state_{kPending};

  // ---- the plan: written in kPlanning, read by helpers once they saw kRunning ----
  // A flat op's layout is flat_plan_'s (shared with other ops of its layout); any other op's
  // pieces and chunk starts are its own. piece_at_ and chunk_at_ point at whichever it is.
  InlineVec<Piece, 1> pieces_;
  InlineVec<uint32_t, 2> chunk_starts_;  // num_chunks_ + 1 entries
  std::shared_ptr<const FlatPlan> flat_plan_;
  const Piece* piece_at_ = nullptr;
  const uint32_t* chunk_at_ = nullptr;
  int num_chunks_ = 0;
  bool stream_ = false;  // copy with streaming stores (big collectives)
  std::vector<int64_t> a2a_in_off_, a2a_out_off_;  // bytes, [src * n + dst] / [dst * n + src]
  // A flat op's input offsets (flat_plan_->flat_off): input i's first element; the total.
  const int64_t* flat_off_ = nullptr;
  size_t flat_off_size_ = 0;
  // The reduction kernel of slot 0's dtype, resolved once (a bucket reduces thousands of
  // pieces with it); other dtypes of a coalesced list go through reduce_buffers.
  ReduceKernel reduce_kernel_ = nullptr;
  // Chunks are handed out from one cursor per member over a contiguous range of them (the
  // member's own blocks for all_gather/reduce_scatter/all_to_all, its share of all_reduce):
  // each rank starts with its range, so the same rank handles the same bytes in every call
  // (they stay in its cache, and two ranks never pull the same lines back and forth), then
  // takes what is left of the others' ranges. One cursor (next_chunk_) when at most one chunk.
  struct alignas(64) Cursor {
    std::atomic<int> next{0};
    int end = 0;
  };
  std::unique_ptr<Cursor[]> cursors_;
  int num_cursors_ = 0;
  std::atomic<int> next_chunk_{0};
  std::atomic<int> done_chunks_{0};
  std::mutex error_mu_;
  std::exception_ptr chunk_error_;
  bool registered_running_ = false;

  void plan();
  // The layout part of plan(): pieces_, chunk_starts_, stream_ and, for a flat op, its input
  // offsets into `flat_off`.
  void plan_layout(std::vector<int64_t>* flat_off);
  // A flat op's shared layout: its group's last one when this op has the same, else planned.
  std::shared_ptr<const FlatPlan> flat_layout();
  void run_chunk(int c);
  void init_members();  // the members' global ranks (SharedGroup is complete only below)
  void run_piece(const Piece& p);
  // An all_reduce_flat range: the inputs it spans reduced into rank 0's output, then the range
  // copied to the other outputs. `srcs`: room for size_ pointers.
  void run_flat_piece(const Piece& p, const void** srcs);
  // reduce_buffers of this op's reduce op, through reduce_kernel_ when the dtype is its.
  void reduce(DType dtype, void* out, const void* const* srcs, int64_t count) const {
    if (count == 0) return;
    if (reduce_kernel_ != nullptr && dtype == members_[0].post.slots[0].dtype) {
      reduce_kernel_(out, srcs, size_, count);
    } else {
      reduce_buffers(members_[0].post.reduce_op, dtype, out, srcs, size_, count);
    }
  }
  // Only once the plan is visible (state_ kRunning seen, or under running_mu_).
  bool has_chunks_left() const {
    if (num_cursors_ == 0) return next_chunk_.load(std::memory_order_relaxed) < num_chunks_;
    for (int i = 0; i < num_cursors_; ++i) {
      if (cursors_[i].next.load(std::memory_order_relaxed) < cursors_[i].end) return true;
    }
    return false;
  }
  // The next chunk for the calling thread to run, or -1 when none is left.
  int claim() {
    if (num_cursors_ == 0) {
      int c = next_chunk_.fetch_add(1, std::memory_order_relaxed);
      return c < num_chunks_ ? c : -1;
    }
    const int home = home_cursor();
    for (int i = 0; i < num_cursors_; ++i) {
      Cursor& cur = cursors_[(home + i) % num_cursors_];
      if (cur.next.load(std::memory_order_relaxed) >= cur.end) continue;
      int c = cur.next.fetch_add(1, std::memory_order_relaxed);
      if (c < cur.end) return c;
    }
    return -1;
  }
  int home_cursor() const;
};

// The state of one group shared by its members: name, ranks and the ops not yet joined by all.
struct SharedGroup {
  int id = 0;
  std::string name;
  // A copy of `name` per member, each an allocation of its own cache lines: a Work's
  // description is built when first asked for, which may be after run_local freed this group,
  // so the Works a member creates hold its copy. Their reference counts then touch no line
  // that another member's collectives touch, and the copies go with the last Work.
  std::vector<std::shared_ptr<const std::string>> member_names;
  std::vector<int> global_ranks;
  SpinMutex mu;
  // Ops not yet joined by every member, at seq - pending_base (null: not created yet, or
  // joined by all). Sequence numbers are dense, so a deque window beats a map.
  std::deque<std::shared_ptr<Op>> pending;
  uint64_t pending_base = 0;
  std::unique_ptr<LaneSlot[]> lane;  // null unless 2..kLaneMaxRanks members
  // Members that gave up waiting for a slot (timeout, departure) before posting `seq`: applied
  // by whoever claims the slot for `seq` (a failure that counts them as arrived), so that the
  // slot is freed once the others came. Guarded by mu; kLaneAbsent marks the slot.
  struct LaneAbsence {
    uint64_t seq;
    uint64_t members;
    std::string message;
    // One timeout after the first member gave up: members blocked behind the absence, waiting
    // for the late members to come, give up then.
    Clock::time_point deadline;
    // The members that were already waiting for the slot for `seq` when the first gave up:
    // unlike later comers, they are not told that they came after the others had given up.
    uint64_t early;
  };
  std::vector<LaneAbsence> lane_absences;
  // (seq, members) waiting for the slot for seq past their spin (guarded by mu): see
  // LaneAbsence::early.
  std::vector<std::pair<uint64_t, uint64_t>> lane_waiting;
  // Whether `pending` holds anything (written under mu): a lane arrival checks the Op path for
  // a mismatch only then.
  std::atomic<bool> ops_pending{false};
  // The layout of the last flat op planned on this group (Op::flat_layout).
  std::mutex flat_plan_mu;
  std::shared_ptr<const FlatPlan> flat_plan;

  SharedGroup() = default;
  SharedGroup(const SharedGroup&) = delete;
  SharedGroup& operator=(const SharedGroup&) = delete;
  ~SharedGroup();

  // Sets member_names and the lane from name and global_ranks.
  void init() {
    struct alignas(64) NameCopy {
      std::string name;
    };
    member_names.reserve(global_ranks.size());
    for (size_t i = 0; i < global_ranks.size(); ++i) {
      auto copy = std::make_shared<const NameCopy>(NameCopy{name});
      member_names.emplace_back(copy, &copy->name);
    }
    const size_t n = global_ranks.size();
    if (n >= 2 && n <= kLaneMaxRanks) lane = std::make_unique<LaneSlot[]>(kLaneSlots);
  }
  LaneSlot& lane_slot(uint64_t seq) { return lane[seq % kLaneSlots]; }
  // The member index of global rank `rank`; -1 if it is not a member.
  int member_of(int rank) const {
    const auto it = std::find(global_ranks.begin(), global_ranks.end(), rank);
    return it == global_ranks.end() ? -1 : static_cast<int>(it - global_ranks.begin());
  }
  uint64_t full_mask() const { return (uint64_t{1} << global_ranks.size()) - 1; }
  // The op of `seq` if it exists and not every member joined it (null; no creation, unlike
  // pending_slot).
  std::shared_ptr<Op> find_pending(uint64_t seq) const {
    if (seq < pending_base || seq - pending_base >= pending.size()) return nullptr;
    return pending[seq - pending_base];
  }

  std::shared_ptr<Op>& pending_slot(uint64_t seq) {
    FUNCOL_CHECK(seq >= pending_base, "joined a collective that every member already joined");
    uint64_t idx = seq - pending_base;
    if (idx >= pending.size()) {
      pending.resize(idx + 1);
      // Before the joiner looks at the lane (see World::lane_issue).
      ops_pending.store(true, std::memory_order_seq_cst);
    }
    return pending[idx];
  }
  void release_pending(uint64_t seq) {
    pending[seq - pending_base].reset();
    while (!pending.empty() && !pending.front()) {
      pending.pop_front();
      ++pending_base;
    }
    if (pending.empty()) ops_pending.store(false, std::memory_order_relaxed);
  }
};

// "all_reduce on group 'world' (seq 4)".
std::string collective_name(OpKind kind, bool coalesced, const std::string& group_name,
                            uint64_t seq, bool flat = false) {
  return fmt::format("{} on group '{}' (seq {})", op_name(kind, coalesced, flat), group_name,
                     seq);
}
std::string collective_name(OpKind kind, bool coalesced, const SharedGroup& group, uint64_t seq) {
  return collective_name(kind, coalesced, group.name, seq);
}

std::shared_ptr<const std::string> member_name(const SharedGroup& group, int member) {
  return group.member_names[member];
}

struct QueueEntry {
  std::shared_ptr<Op> op;
  int member;  // this rank's group rank in op's group
};

// One rank: its ordered queue of unfinished collectives (of every group: a group's first
// unfinished one is at its head for that group) and whether it departed.
// The three parts live on separate cache lines: the owner writes mu and queue on every
// collective, completers on other threads read `queued`, and joiners read `departed`.
struct RankState {
  SpinMutex mu;
  std::deque<QueueEntry> queue;
  // queue.size(), readable without mu: a completer skips locking a rank whose queue holds
  // nothing behind the op it completed (the rank pops it itself on its next push).
  alignas(64) std::atomic<int> queued{0};
  alignas(64) std::atomic<bool> departed{false};
  std::string departed_reason;  // written before departed is set, read after it is seen
  // The collective this rank issued last, for timeout messages and stall warnings (what a
  // missing rank is doing): (seq + 1) << kIssuedGroupBits | group id, 0 before any; written by
  // the issuing thread, read by others (one word, so never a torn pair).
  alignas(64) std::atomic<uint64_t> last_issued{0};
  // The ops another thread completed whose keep-alive references for this rank it left for
  // this rank's own thread to release (see World::complete).
  alignas(64) SpinMutex returned_mu;
  std::atomic<bool> has_returned{false};
  std::vector<std::shared_ptr<Op>> returned;  // guarded by returned_mu
  // The failed collectives this rank issued (World::note_failed), for the warning at its end.
  dist_detail::FailureLedger failed;

  // A rank that never issued again: its references go with the world (each breaks the cycle
  // from a result's storage, through the Work attached to it, back to the storage).
  ~RankState() {
    for (auto& op : returned) op->release_returned_keep(-1);
  }
};

// A split_group in progress: the first rank creates the groups, the others find them.
struct SplitEntry {
  std::vector<std::vector<int>> lists;
  std::vector<SharedGroup*> groups;
  int arrivals = 0;
};

// Ops that became eligible, to run. Usually one; inline so that no collective allocates it.
using OpList = InlineVec<std::shared_ptr<Op>, 4>;

// The cores this process may run on (its affinity mask), at least 1.
int usable_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

class World {
 public:
  World(int size, std::chrono::milliseconds timeout)
      : size_(size),
        timeout_(timeout),
        wait_spin_(size > usable_cores() ? std::chrono::nanoseconds(0) : Backoff::kSpin),
        stream_bytes_(stream_threshold()),
        stall_warning_(stall_warning_after()) {
    for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<RankState>());
    std::vector<int> all(size);
    for (int r = 0; r < size; ++r) all[r] = r;
    create_group("world", all);
  }

  SharedGroup* create_group(std::string name, std::vector<int> ranks) {
    std::lock_guard<std::mutex> lock(mu_);
    auto g = std::make_unique<SharedGroup>();
    g->id = static_cast<int>(groups_.size());
    g->name = std::move(name);
    g->global_ranks = std::move(ranks);
    g->init();
    groups_.push_back(std::move(g));
    return groups_.back().get();
  }
  SharedGroup* world_group() {
    std::lock_guard<std::mutex> lock(mu_);
    return groups_.front().get();
  }

  // The group (of `lists`) containing `global_rank`, or null; creates them on first arrival.
  SharedGroup* split(const SharedGroup& parent, uint64_t index,
                     const std::vector<std::vector<int>>& lists, const std::string& name,
                     int global_rank);

  // Posts `post` as member `member` of op `seq` on `group`; fails the op on mismatch or when a
  // member departed before joining. Returns the op (possibly already failed). The first member
  // to join publishes `spare` (a fresh Op of this group, allocated outside the group's lock)
  // as the op; the others leave it for their next collective. `*late`: the op had already
  // failed (a timeout, a departure, a mismatch of others) when this member joined.
  std::shared_ptr<Op> join(SharedGroup& group, int member, uint64_t seq, Post&& post,
                           std::shared_ptr<Op>& spare, bool* late);
  // Appends op to `global_rank`'s queue and runs whatever became eligible.
  void push(int global_rank, int member, const std::shared_ptr<Op>& op);
  // Removes finished ops from `global_rank`'s queue and marks `group`'s first unfinished op in
  // it (and that of each removed op's group) as at its head; collects ops that became eligible
  // into `ready`.
  void advance(int global_rank, const SharedGroup* group, OpList& ready);
  void advance_locked(RankState& rs, const SharedGroup* group, OpList& ready);
  // Runs eligible ops (and, transitively, the ops their completion makes eligible).
  void run_ready(OpList& ready);
  // Claims and runs chunks of a running op until none is left; may complete it.
  void work(const std::shared_ptr<Op>& op, OpList& ready);
  // Helps any running op with chunks left; false when there was nothing to do.
  bool help_any();
  // Fails a pending op (exactly once; false when it already started or finished);
  // `given_up_on`: the members a timeout found missing (global ranks).
  bool fail_op(const std::shared_ptr<Op>& op, const std::string& message,
               std::vector<int> given_up_on = {});
  // The timeout failure of op (missing ranks, or the collectives it is stuck behind); the
  // missing ranks also go to *missing.
  std::string timeout_message(Op& op, std::vector<int>* missing);
  // "<what>: timed out after N s; missing ranks [...]", for a collective the timeout found
  // lacking `missing` (global ranks).
  std::string timed_out_message(const std::string& what, const std::vector<int>& missing) const;
  // Why op is not done yet: "; missing ranks [1] (...)" or " waiting for earlier
  // collectives: ..." (timeout_message's text after "timed out after N s").
  // `all_waiting` (optional): whether every missing rank's last collective is itself missing
  // ranks (whereabouts).
  std::string stall_report(Op& op, std::vector<int>* missing, bool* all_waiting = nullptr);
  // Where `global_rank` records the collective it issued last (RankState::last_issued); a
  // group caches it, so that issuing touches no line of the World's.
  std::atomic<uint64_t>& last_issued_of(int global_rank) {
    return ranks_[global_rank]->last_issued;
  }
  // " (rank 1's last collective, all_reduce on group 'g' (seq 3), is itself missing ranks
  // [0])" for the missing ranks whose last collective waits for others (at most 4 named), or
  // "": a deadlock shows as ranks each missing in the other's collective.
  // `all_waiting` (optional): whether every missing rank's last collective is so.
  std::string whereabouts(const std::vector<int>& missing, bool* all_waiting = nullptr);
  // "; missing ranks [0] (...)": the ranks, then their whereabouts.
  std::string missing_report(const std::vector<int>& missing, bool* all_waiting = nullptr) {
    return fmt::format("; missing ranks {}{}", format_ranks(missing),
                       whereabouts(missing, all_waiting));
  }
  // Prints a warning to stderr for a wait that has slept `slept` (StallClock): `description`
  // waits; `report` says why (stall_report).
  void warn_stalled(const std::string& description, std::chrono::nanoseconds slept,
                    const std::string& report);
  // warn_stalled for a lane collective whose missing ranks all wait elsewhere (true: warned).
  bool lane_warn_stalled(LaneWork& work, std::chrono::nanoseconds slept);
  // When `work`'s collective times out: the earliest deadline of the members that arrived (the
  // first issue plus the timeout, as for an Op), or its own while its slot serves another.
  static Clock::time_point lane_deadline(const LaneWork& work);
  // The earliest of `own` and the deadlines of the members that arrived in `state` (a state of
  // `ls` that serves a collective).
  static Clock::time_point lane_deadline(const LaneSlot& ls, uint64_t state,
                                         Clock::time_point own);
  // Whether `global_rank`, whose last collective is `seq` on `group`, waits in the issuing call
  // for the slot (`state`) to finish an earlier collective (kLaneSlots behind). Under group.mu.
  bool lane_blocked_at_issue(const SharedGroup& group, int global_rank, uint64_t seq,
                             uint64_t state) const;
  // "all_reduce ... (seq 9), which waits in the issuing call for ... (seq 1) to finish (...)".
  static std::string lane_blocked_description(const SharedGroup& group, uint64_t seq,
                                              uint64_t blocker);
  // warn_stalled for a lane collective blocked at issue behind the slot's earlier collective
  // (`state`) whose missing ranks all wait elsewhere (true: warned).
  bool lane_warn_blocked(LaneWork& work, uint64_t state, std::chrono::nanoseconds slept);
  // warn_stalled for `description`, a lane collective of `group` that the members not in
  // `arrived` miss, if each of them waits elsewhere (true: warned).
  bool warn_if_stalled(const SharedGroup& group, uint64_t arrived, const std::string& description,
                       std::chrono::nanoseconds slept);
  void depart(int rank, const std::string& reason);
  dist_detail::UnwaitedFailures drain(int rank);
  // Keeps `work`, a collective of `global_rank` that failed, for the warning at its end.
  void note_failed(int global_rank, std::shared_ptr<Work> work) {
    ranks_[global_rank]->failed.add(std::move(work), global_rank);
  }
  // The same for `work`, which the rank got instead of the failed `op` (if noted, it goes).
  void note_failed_instead(int global_rank, const std::shared_ptr<Work>& op,
                           std::shared_ptr<Work> work) {
    ranks_[global_rank]->failed.replace(op, std::move(work), global_rank);
  }
  // Fails a lane member's Work with `message` (LaneWork::fail_with) and notes it failed.
  void lane_fail(const std::shared_ptr<LaneWork>& work, const std::string& message);
  // The groups `rank` (global) is a member of, in creation order.
  std::vector<SharedGroup*> groups_of(int rank);
  // Releases the references complete() left for `global_rank` on ops its thread has not waited
  // for: called by that thread when it issues.
  void release_returned(int global_rank);

  // ---- the lane (see LaneSlot) ----
  // Posts member `member`'s small all_reduce `seq` on `group`; executes it when this completes
  // the slot. The returned Work may already be finished (or failed).
  std::shared_ptr<LaneWork> lane_issue(SharedGroup& group, int member, uint64_t seq,
                                       const Slot& slot, ReduceOp op,
                                       std::shared_ptr<Storage> keep);
  // A waiter's checks once spinning did not finish `work`: a departed member, a member that
  // issued `seq` on the Op path, and (when `timed_out`) the timeout fail the slot.
  void lane_check(LaneWork& work, bool timed_out);
  // The same for `member`'s collective `seq`, which `member` arrived at (its Work need not be at
  // hand: a member blocked at issue behind it checks it too).
  void lane_check(SharedGroup& group, uint64_t seq, int member, bool timed_out);
  // Waits for the collectives `global_rank` issued earlier that still read `storage` (before a
  // lane collective, which is not queued behind them, overwrites it).
  void wait_readers(int global_rank, const Storage* storage);

  int size_;
  std::chrono::milliseconds timeout_;
  // How long a waiter spins before yielding: not at all when there are more ranks than cores,
  // where a spinning waiter takes the core a peer needs to arrive (measured with 4 ranks on 2
  // cores: 4 KiB all_reduce 8.8-13.5 us instead of 13-20 us; funcol train's step 10% shorter).
  std::chrono::nanoseconds wait_spin_;
  const int64_t stream_bytes_;  // copies of ops moving this much stream (stream_threshold)
  const std::chrono::nanoseconds stall_warning_;  // stall_warning_after()
  std::vector<std::unique_ptr<RankState>> ranks_;
  // Ranks that departed so far: joins look for departed members only when it is non-zero
  // (reading every member's RankState on every collective would pull their cache lines).
  std::atomic<int> departures_{0};

 private:
  void start(const std::shared_ptr<Op>& op, OpList& ready);
  void complete(const std::shared_ptr<Op>& op, OpList& ready);
  // The first of `ranks` (global) that departed, or -1.
  int first_departed(const std::vector<int>& ranks) const;
  std::string departed_message(const std::string& what, int departed_rank,
                               const std::vector<int>& missing);
  void lane_execute(SharedGroup& group, LaneSlot& ls);
  // Fails the lane collective `seq` with `message` unless it failed already or every member
  // arrived; `absent` (bits) are members that will never arrive (they issued `seq` on the Op
  // path, or gave up waiting for the slot). Fails the members that arrived. Needs group.mu.
  // `given_up_on`: as fail_op's; an arrived member among them is told it came late.
  bool lane_fail_locked(SharedGroup& group, uint64_t seq, const std::string& message,
                        uint64_t absent, uint64_t* failed_arrived = nullptr,
                        const std::vector<int>& given_up_on = {});
  // Whether members gave up on an earlier (or a later) collective of `seq`'s slot.
  bool lane_absence_locked(const SharedGroup& group, uint64_t seq, bool earlier) const;
  // The members (global ranks) of a lane collective whose every member arrived (`records`)
  // that issued it more than the timeout after its first issue; empty when none did. It timed
  // out before they came, whether or not anybody waited to see it.
  std::vector<int> lane_late(const SharedGroup& group,
                             const std::array<LaneRecord, kLaneMaxRanks>& records) const;
  // Applies the absences registered for `seq` to the slot this rank just claimed for it: fails
  // it, counting the absent members (and those that issued `seq` on the Op path) as arrived.
  // Returns that Op, to fail with *op_message and *op_given_up_on once mu is released. The
  // members that did not give up are told they came after those that did.
  std::shared_ptr<Op> lane_apply_absences_locked(SharedGroup& group, uint64_t seq,
                                                 std::string* op_message,
                                                 std::vector<int>* op_given_up_on);
  // Counts `count` more members (or the failer) out of failed slot `ls`; frees it after the last.
  void lane_exit(SharedGroup& group, LaneSlot& ls, int count);
  // Frees a failed slot: releases and drops the records' Works and frees it.
  // Sets ls.late_deadline one timeout from now (the slot failed, or is freed after a failure).
  void note_lane_moved(LaneSlot& ls) const;
  void lane_release(LaneSlot& ls);
  // Frees the slot for its next collective.
  static void lane_free(LaneSlot& ls);
  // Lane members (bits of `mask`) will never join the Op of `seq`: count them joined.
  void join_absent_locked(SharedGroup& group, uint64_t seq, uint64_t mask);
  // Counts the members of `mask` joined to `op` (those not joined yet). Needs group.mu.
  static void mark_joined(Op& op, uint64_t mask);
  // The bits of the members that joined `op` (lane groups only: at most 64 members). Needs
  // group.mu.
  static uint64_t joined_mask(const Op& op);
  // The global ranks of `group`'s members whose bits are not in `arrived`.
  static std::vector<int> missing_ranks(const SharedGroup& group, uint64_t arrived);
  // The global ranks of the members that have not joined `op`, from its flags (any group
  // size, unlike joined_mask()). Needs group.mu.
  static std::vector<int> unjoined_ranks(const Op& op);
  // The Op-path join of `member` at `seq` when members took the lane for it: the mismatch (or
  // the lane's failure) message, after counting this member out of the lane slot; empty when
  // the lane has nobody at `seq`. Needs group.mu.
  std::string lane_crossed_locked(SharedGroup& group, int member, uint64_t seq, const Post& post,
                                  Op& op);
  // "rank A issued X but rank B issued Y", lower rank first.
  static std::string mismatch_message(const std::string& what, int rank_a, const Post& a,
                                      int rank_b, const Post& b);

  std::mutex mu_;  // groups_ and splits_
  std::vector<std::unique_ptr<SharedGroup>> groups_;
  std::map<std::pair<int, uint64_t>, SplitEntry> splits_;

  std::mutex running_mu_;  // running_
  std::vector<std::shared_ptr<Op>> running_;  // ops with more than one chunk, for helpers
  std::atomic<int> running_count_{0};
};

// One member's handle of a lane collective.
class LaneWork final : public Work {
 public:
  LaneWork(World* world, SharedGroup* group, uint64_t seq, int member, Clock::time_point deadline)
      : world_(world),
        group_(group),
        group_name_(member_name(*group, member)),
        seq_(seq),
        member_(member),
        deadline_(deadline) {}

  void wait() override;
  bool poll() override;
  const std::string& description() const override;

  World* const world_;
  SharedGroup* const group_;
  const std::shared_ptr<const std::string> group_name_;  // outlives the group
  const uint64_t seq_;
  const int member_;
  const Clock::time_point deadline_;
  // The member's buffer, alive until the collective finished (a dropped result must stay
  // valid). The executor does not release it (the storage's reference count is the member's
  // cache line): whoever sees this Work finished does, once, through release_keep(): a wait,
  // the member itself when its issue finished it or when it next posts into the same slot.
  // Released before a wait returns, so a waiter holds the only references to its buffer again
  // (the runtime donates a buffer nobody else holds).
  std::shared_ptr<Storage> keep_;
  std::atomic<bool> keep_released_{false};
  void release_keep() {
    if (!keep_released_.load(std::memory_order_acquire) &&
        !keep_released_.exchange(true, std::memory_order_acq_rel)) {
      keep_.reset();
    }
  }
  // Each member gets its own exception object: they are read and released on different threads,
  // and the reference count inside exception_ptr is invisible to ThreadSanitizer.
  void fail_with(const std::string& message) {
    release_keep();
    fail(std::make_exception_ptr(CommError(message)));
  }

 private:
  mutable std::once_flag description_once_;
  mutable std::string description_;
};

// The last collective of each slot may hold a result nobody waited for, attached to its
// storage that its Work keeps alive: break the cycle.
SharedGroup::~SharedGroup() {
  // A collective still unfinished when the world ends (a member never issued it, and nobody
  // waited to see that) never will: it fails, so that a result polled after run_local returned
  // says so, and no Work of this world reaches into it again.
  auto message = [](const Work& w) {
    return w.description() + ": unfinished when run_local ended (a member never issued it)";
  };
  for (int i = 0; lane && i < kLaneSlots; ++i) {
    for (auto& record : lane[i].records) {
      if (!record.work) continue;
      if (!record.work->is_completed()) record.work->fail_with(message(*record.work));
      record.work->release_keep();
    }
  }
  for (const std::shared_ptr<Op>& op : pending) {
    if (op && !op->is_completed()) op->fail(std::make_exception_ptr(CommError(message(*op))));
  }
}

// ---------------------------------------------------------------------------------------------
// Planning and executing an op.

// Every buffer of the post is its own input (all_reduce out of place copies even on one rank).
bool in_place(const Post& p) {
  return std::all_of(p.slots.begin(), p.slots.end(),
                     [](const Slot& s) { return s.in == s.out; });
}

void Op::plan() {
  const Post& p0 = members_[0].post;
  const int n = size_;
  if ((p0.kind == OpKind::AllReduce || p0.kind == OpKind::ReduceScatter) && !p0.slots.empty()) {
    reduce_kernel_ = reduce_kernel(p0.reduce_op, p0.slots[0].dtype);
  }
  if (p0.flat) {
    flat_plan_ = flat_layout();
    piece_at_ = flat_plan_->pieces.data();
    chunk_at_ = flat_plan_->chunk_starts.data();
    flat_off_ = flat_plan_->flat_off.data();
    flat_off_size_ = flat_plan_->flat_off.size();
    stream_ = flat_plan_->stream;
    num_chunks_ = static_cast<int>(flat_plan_->chunk_starts.size()) - 1;
  } else {
    plan_layout(nullptr);
    piece_at_ = pieces_.begin();
    chunk_at_ = chunk_starts_.begin();
  }
  if (num_chunks_ > 1) {
    const int nc = std::min(n, num_chunks_);
    cursors_ = std::make_unique<Cursor[]>(static_cast<size_t>(nc));
    for (int k = 0; k < nc; ++k) {
      cursors_[k].next.store(static_cast<int>(int64_t{num_chunks_} * k / nc),
                             std::memory_order_relaxed);
      cursors_[k].end = static_cast<int>(int64_t{num_chunks_} * (k + 1) / nc);
    }
    num_cursors_ = nc;
  }
}

std::shared_ptr<const FlatPlan> Op::flat_layout() {
  const Post& p0 = members_[0].post;
  std::shared_ptr<const FlatPlan> last;
  {
    std::lock_guard lock(group_->flat_plan_mu);
    last = group_->flat_plan;
  }
  const Slot& out = p0.slots[0];
  if (last && last->kind == p0.kind && last->size == size_ && last->dtype == out.dtype &&
      last->count == out.count && last->counts == p0.flat_counts) {
    return last;
  }
  auto fresh = std::make_shared<FlatPlan>();
  fresh->kind = p0.kind;
  fresh->size = size_;
  fresh->dtype = out.dtype;
  fresh->count = out.count;
  fresh->counts = p0.flat_counts;
  plan_layout(&fresh->flat_off);
  fresh->stream = stream_;
  fresh->pieces.assign(pieces_.begin(), pieces_.end());
  fresh->chunk_starts.assign(chunk_starts_.begin(), chunk_starts_.end());
  pieces_.clear();
  chunk_starts_.clear();
  std::lock_guard lock(group_->flat_plan_mu);
  group_->flat_plan = fresh;
  return fresh;
}

void Op::plan_layout(std::vector<int64_t>* flat_off) {
  const Post& p0 = members_[0].post;
  const int n = size_;
  // Bytes each kind moves per unit of work, to size the chunks.
  int64_t total = 0;
  int64_t row_bytes = 0;
  if (p0.flat) {
    // Each input's first element (the same on every rank: the counts agree); the output holds
    // the total (all_reduce), size_ times it (all_gather) or 1/size_ of it (reduce_scatter,
    // whose inputs are what moves, as the others' output is).
    flat_off->resize(p0.flat_counts.size() + 1);
    (*flat_off)[0] = 0;
    for (size_t i = 0; i < p0.flat_counts.size(); ++i) {
      (*flat_off)[i + 1] = (*flat_off)[i] + p0.flat_counts[i];
    }
    total = p0.slots[0].count * static_cast<int64_t>(itemsize(p0.slots[0].dtype)) *
            (p0.kind == OpKind::ReduceScatter ? n : 1);
  } else switch (p0.kind) {
    case OpKind::AllReduce:
    case OpKind::Broadcast:
      if (n == 1 && in_place(p0)) break;  // nothing to move
      for (const Slot& s : p0.slots) total += s.count * static_cast<int64_t>(itemsize(s.dtype));
      break;
    case OpKind::AllGather:
    case OpKind::ReduceScatter:
      for (const Slot& s : p0.slots) total += n * s.count * static_cast<int64_t>(itemsize(s.dtype));
      break;
    case OpKind::AllToAll:
      row_bytes = p0.slots[0].count * static_cast<int64_t>(itemsize(p0.slots[0].dtype));
      for (int j = 0; j < n; ++j) {
        for (int64_t rows : members_[j].post.input_splits) total += rows * row_bytes;
      }
      break;
    case OpKind::Barrier:
      break;
  }
  const int64_t chunk_bytes = std::clamp(total / n, kMinChunkBytes, kMaxChunkBytes);
  stream_ = total >= world_->stream_bytes_;
  if (p0.flat) {
    // One piece per input (all_reduce: per chunk of the output) and rank, at least.
    const bool per_rank = p0.kind == OpKind::AllGather || p0.kind == OpKind::ReduceScatter;
    pieces_.reserve(per_rank ? p0.flat_counts.size() * static_cast<size_t>(n) : 1);
  }
  auto add_ranges = [&](int t, int a, int b, int64_t count, int64_t unit) {
    int64_t step = std::max<int64_t>(1, chunk_bytes / unit);
    for (int64_t begin = 0; begin < count; begin += step) {
      pieces_.push_back({t, a, b, begin, std::min(step, count - begin)});
    }
  };
  switch (p0.kind) {
    case OpKind::AllReduce:
    case OpKind::Broadcast:
      if (n == 1 && in_place(p0)) break;
      for (size_t t = 0; t < p0.slots.size(); ++t) {
        add_ranges(static_cast<int>(t), 0, 0, p0.slots[t].count, itemsize(p0.slots[t].dtype));
      }
      break;
    case OpKind::AllGather:
      if (p0.flat) {
        // t = the input, a = the source rank.
        for (size_t t = 0; t < p0.flat_counts.size(); ++t) {
          for (int j = 0; j < n; ++j) {
            add_ranges(static_cast<int>(t), j, 0, p0.flat_counts[t], itemsize(p0.slots[0].dtype));
          }
        }
        break;
      }
      [[fallthrough]];
    case OpKind::ReduceScatter:
      if (p0.flat) {
        // t = the input, a = the destination rank: block a of every rank's input t.
        for (size_t t = 0; t < p0.flat_counts.size(); ++t) {
          for (int j = 0; j < n; ++j) {
            add_ranges(static_cast<int>(t), j, 0, p0.flat_counts[t] / n,
                       itemsize(p0.slots[0].dtype));
          }
        }
        break;
      }
      for (size_t t = 0; t < p0.slots.size(); ++t) {
        for (int j = 0; j < n; ++j) {
          add_ranges(static_cast<int>(t), j, 0, p0.slots[t].count, itemsize(p0.slots[t].dtype));
        }
      }
      break;
    case OpKind::AllToAll: {
      a2a_in_off_.assign(static_cast<size_t>(n) * n, 0);
      a2a_out_off_.assign(static_cast<size_t>(n) * n, 0);
      for (int j = 0; j < n; ++j) {
        int64_t in_off = 0, out_off = 0;
        for (int k = 0; k < n; ++k) {
          a2a_in_off_[j * n + k] = in_off;
          in_off += members_[j].post.input_splits[k] * row_bytes;
          a2a_out_off_[j * n + k] = out_off;
          out_off += members_[j].post.output_splits[k] * row_bytes;
        }
      }
      for (int j = 0; j < n; ++j) {
        for (int k = 0; k < n; ++k) {
          add_ranges(0, j, k, members_[j].post.input_splits[k] * row_bytes, 1);
        }
      }
      break;
    }
    case OpKind::Barrier:
      break;
  }
  // Group consecutive small pieces (coalesced lists, small per-rank blocks) into chunks of
  // about chunk_bytes.
  chunk_starts_.clear();
  int64_t acc = 0;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const Piece& p = pieces_[i];
    int64_t bytes = p0.kind == OpKind::AllToAll
                        ? p.len
                        : p.len * static_cast<int64_t>(itemsize(p0.slots[p0.flat ? 0 : p.t].dtype));
    if (chunk_starts_.empty() || acc >= chunk_bytes) {
      chunk_starts_.push_back(static_cast<uint32_t>(i));
      acc = 0;
    }
    acc += bytes;
  }
  num_chunks_ = static_cast<int>(chunk_starts_.size());
  chunk_starts_.push_back(static_cast<uint32_t>(pieces_.size()));
}

void Op::init_members() {
  for (int m = 0; m < size_; ++m) members_[m].global_rank = group_->global_ranks[m];
}

int Op::home_cursor() const {
  const std::vector<int>& ranks = group_->global_ranks;
  auto it = std::find(ranks.begin(), ranks.end(), tl_rank);
  return it == ranks.end() ? 0 : static_cast<int>(it - ranks.begin()) % num_cursors_;
}

void Op::run_chunk(int c) {
  for (uint32_t i = chunk_at_[c]; i < chunk_at_[c + 1]; ++i) run_piece(piece_at_[i]);
#ifdef FUNCOL_STREAMING_COPY
  // Streaming stores are weakly ordered: the chunk's are published before it counts as done
  // (copy_to_each leaves them unfenced).
  if (stream_) _mm_sfence();
#endif
}

void Op::run_piece(const Piece& p) {
  const Post& p0 = members_[0].post;
  const int n = size_;
  if (p0.kind == OpKind::AllToAll) {
    // a = source rank, b = destination rank, begin/len in bytes.
    const char* src = members_[p.a].post.slots[0].in + a2a_in_off_[p.a * n + p.b] + p.begin;
    char* dst = members_[p.b].post.slots[0].out + a2a_out_off_[p.b * n + p.a] + p.begin;
    move_bytes(dst, src, p.len, stream_);
    return;
  }
  const Slot& slot0 = p0.slots[p0.flat ? 0 : p.t];  // a flat all_gather's t is an input
  const DType dtype = slot0.dtype;
  const int64_t isz = static_cast<int64_t>(itemsize(dtype));
  const int64_t count = slot0.count;
  const int64_t off = p.begin * isz;
  const size_t bytes = static_cast<size_t>(p.len * isz);
  std::array<const void*, 64> stack_srcs;
  std::vector<const void*> heap_srcs;
  const void** srcs = stack_srcs.data();
  if (n > static_cast<int>(stack_srcs.size())) {
    heap_srcs.resize(n);
    srcs = heap_srcs.data();
  }
  switch (p0.kind) {
    case OpKind::AllReduce: {
      if (p0.flat) {
        run_flat_piece(p, srcs);
        break;
      }
      char* out0 = members_[0].post.slots[p.t].out + off;
      if (n == 1) {
        // Out of place on one rank: the bytes as they are (a reduction of one source could
        // normalise bool bytes or NaN payloads, and the in-place form leaves them alone).
        move_bytes(out0, members_[0].post.slots[p.t].in + off, bytes, stream_);
        break;
      }
      // Reduce the chunk of every input, in rank order, into rank 0's output (usually its
      // input: in place), then copy the result (hot in cache) to every other rank's output.
      for (int k = 0; k < n; ++k) srcs[k] = members_[k].post.slots[p.t].in + off;
      reduce(dtype, out0, srcs, p.len);
      for (int k = 1; k < n; ++k) {
        const Slot& slot = members_[k].post.slots[p.t];
        // An in-place destination was just read as a source, so it is in cache; a separate
        // output (all_reduce_coalesced_into) is cold: stream it when the op is big.
        copy_bytes(slot.out + off, out0, bytes, stream_ && slot.in != slot.out);
      }
      break;
    }
    case OpKind::Broadcast: {
      const char* src = members_[p0.root].post.slots[p.t].out + off;
      for (int k = 0; k < n; ++k) {
        if (k != p0.root) copy_bytes(members_[k].post.slots[p.t].out + off, src, bytes, stream_);
      }
      break;
    }
    case OpKind::AllGather: {
      if (p0.flat) {
        // t = the input, a = the source rank: rank a's input t goes to its block of input t's
        // stretch of every output (size_ times the input's offset).
        const char* src = members_[p.a].post.flat_in[p.t] + off;
        const int64_t dst_off =
            (n * flat_off_[p.t] + p.a * p0.flat_counts[p.t]) * isz + off;
        // The next piece's first lines: usually another input's.
        if (&p + 1 < piece_at_ + chunk_at_[num_chunks_]) {
          const Piece& q = (&p)[1];
          prefetch_head(members_[q.a].post.flat_in[q.t] + q.begin * isz, q.len * isz);
        }
        copy_to_each(
            n, [&](int k) { return members_[k].post.slots[0].out + dst_off; }, src, bytes,
            stream_);
        break;
      }
      // a = the source rank: its input goes to block a of every output.
      const char* src = members_[p.a].post.slots[p.t].in + off;
      const int64_t dst_off = (p.a * count) * isz + off;
      for (int k = 0; k < n; ++k) {
        char* dst = members_[k].post.slots[p.t].out + dst_off;
        move_bytes(dst, src, bytes, stream_);  // the input may be a view of the output
      }
      break;
    }
    case OpKind::ReduceScatter: {
      if (p0.flat) {
        // t = the input, a = the destination rank: block a of every rank's input t reduced
        // into input t's stretch of rank a's output (1/size_ of the input's offset).
        const int64_t src_off = p.a * (p0.flat_counts[p.t] / n) * isz + off;
        for (int k = 0; k < n; ++k) srcs[k] = members_[k].post.flat_in[p.t] + src_off;
        char* out = members_[p.a].post.slots[0].out + flat_off_[p.t] / n * isz + off;
        reduce(dtype, out, srcs, p.len);
        break;
      }
      // a = the destination rank: reduce block a of every input into its output.
      const int64_t src_off = (p.a * count) * isz + off;
      for (int k = 0; k < n; ++k) srcs[k] = members_[k].post.slots[p.t].in + src_off;
      reduce(dtype, members_[p.a].post.slots[p.t].out + off, srcs, p.len);
      break;
    }
    case OpKind::AllToAll:
    case OpKind::Barrier:
      break;
  }
}

void Op::run_flat_piece(const Piece& p, const void** srcs) {
  constexpr size_t kListAhead = 16;
  const Post& p0 = members_[0].post;
  const int n = size_;
  const DType dtype = p0.slots[0].dtype;
  const auto isz = static_cast<int64_t>(itemsize(dtype));
  char* out0 = p0.slots[0].out;
  const int64_t end = p.begin + p.len;
  // Copies the reduced elements [from, to) from rank 0's output to every other rank's: each
  // input's as soon as it is reduced, still in the first-level cache (all_reduce_flat of 1000
  // x 4 KiB on 2 ranks: 2-6% faster than a copy of the whole piece, 18 alternating pairs), or,
  // streaming, the whole piece at once (each streaming copy ends with a fence).
  auto copy_out = [&](int64_t from, int64_t to) {
    for (int k = 1; k < n; ++k) {
      copy_bytes(members_[k].post.slots[0].out + from * isz, out0 + from * isz,
                 static_cast<size_t>((to - from) * isz), stream_);
    }
  };
  // The last input starting at or before the range (inputs of no elements are passed over).
  size_t i = static_cast<size_t>(
      std::upper_bound(flat_off_, flat_off_ + flat_off_size_ - 1, p.begin) - flat_off_ - 1);
  for (int64_t pos = p.begin; pos < end; ++i) {
    const int64_t stop = std::min(end, flat_off_[i + 1]);
    if (stop <= pos) continue;
    const int64_t skip = (pos - flat_off_[i]) * isz;
    if (n == 1) {
      // One rank: the bytes as they are (see the in-place all_reduce).
      std::memcpy(out0 + pos * isz, members_[0].post.flat_in[i] + skip,
                  static_cast<size_t>((stop - pos) * isz));
    } else {
      // The next input's first lines on every rank (1000 x 4 KiB all_reduce bucket, 2 ranks:
      // 0.24-0.26 -> 0.23-0.24 ms).
      if (i + 2 < flat_off_size_) {
        for (int k = 0; k < n; ++k) {
          prefetch_head(members_[k].post.flat_in[i + 1],
                        (flat_off_[i + 2] - flat_off_[i + 1]) * isz);
        }
      }
      // The lists themselves a chunk ahead: every rank wrote its own input list and the planner
      // the offsets, so each of their lines is a miss from another core (all_reduce_flat of
      // 1000 x 4 KiB on 2 ranks, six alternating pairs at 110-120 ns round trips: 127-136 ->
      // 108-119 us).
      if (i + kListAhead + 1 < flat_off_size_) {  // an input i + kListAhead exists
        __builtin_prefetch(&flat_off_[i + kListAhead], 0, 3);
        for (int k = 0; k < n; ++k) {
          __builtin_prefetch(&members_[k].post.flat_in[i + kListAhead], 0, 3);
        }
      }
      for (int k = 0; k < n; ++k) srcs[k] = members_[k].post.flat_in[i] + skip;
      reduce(dtype, out0 + pos * isz, srcs, stop - pos);
      if (!stream_) copy_out(pos, stop);
    }
    pos = stop;
  }
  if (stream_) copy_out(p.begin, end);
}

void World::start(const std::shared_ptr<Op>& op, OpList& ready) {
  int expected = kPending;
  if (!op->state_.compare_exchange_strong(expected, kPlanning, std::memory_order_acq_rel)) {
    return;  // failed (timeout, departure, mismatch) before it became eligible
  }
  try {
    op->plan();
  } catch (...) {
    op->chunk_error_ = std::current_exception();
    op->pieces_.clear();
    op->num_chunks_ = 0;
    op->num_cursors_ = 0;
  }
  if (op->num_chunks_ == 0) {
    op->state_.store(kRunning, std::memory_order_release);
    complete(op, ready);
    return;
  }
  // Big ops are listed for helpers waiting on other ops; the few chunks of a small one are
  // taken by its own waiters, without touching the shared list.
  if (op->num_chunks_ > kListedChunks) {
    std::lock_guard<std::mutex> lock(running_mu_);
    running_.push_back(op);
    running_count_.fetch_add(1, std::memory_order_relaxed);
    op->registered_running_ = true;
  }
  op->state_.store(kRunning, std::memory_order_release);
  // Sleeping waiters of a multi-chunk op come and take chunks.
  if (op->num_chunks_ > 1) op->wake();
  work(op, ready);
}

void World::work(const std::shared_ptr<Op>& op, OpList& ready) {
  // A big op's chunks are counted once this thread finds none left to claim: one update of the
  // shared counter per thread, not one per chunk, each of which pulled its line from the core
  // that counted last (1000 x 4 KiB all_reduce_flat, 2 ranks, 64 chunks: 2-5% faster). A
  // small op's are counted as they finish, as before: looking for another chunk first would put
  // a read of the other ranks' cursors between a rank's last chunk and the count that may
  // complete the op.
  const bool batch = op->num_chunks_ > kListedChunks;
  int ran = 0;
  for (;;) {
    const int c = op->claim();
    if (c < 0) break;
    try {
      op->run_chunk(c);
    } catch (...) {
      std::lock_guard<std::mutex> lock(op->error_mu_);
      if (!op->chunk_error_) op->chunk_error_ = std::current_exception();
    }
    if (++ran < op->num_chunks_ && batch) continue;
    if (op->done_chunks_.fetch_add(ran, std::memory_order_acq_rel) + ran == op->num_chunks_) {
      complete(op, ready);
      return;
    }
    ran = 0;
  }
  if (ran > 0 &&
      op->done_chunks_.fetch_add(ran, std::memory_order_acq_rel) + ran == op->num_chunks_) {
    complete(op, ready);
  }
}

void World::complete(const std::shared_ptr<Op>& op, OpList& ready) {
  if (op->registered_running_) {
    std::lock_guard<std::mutex> lock(running_mu_);
    auto it = std::find(running_.begin(), running_.end(), op);
    if (it != running_.end()) running_.erase(it);
    running_count_.fetch_sub(1, std::memory_order_relaxed);
  }
  // Every member joined (the op was eligible), so nobody writes the posts any more. Released
  // before finishing, so that a waiter that returns holds the only references to its buffers
  // (the runtime reuses a buffer in place when nothing else holds it). A coalesced list's
  // references of another rank are left to that rank's thread instead, which releases them
  // when it waits for this op (before its waiter returns) or issues next: the reference counts
  // sit on its storages' lines, which that thread reads and counts again on its next
  // collective, and a thousand of them dropped from here moved each line across cores and back
  // (1000 x 4 KiB reduce_scatter bucket: 0.41 -> 0.37 ms).
  for (int m = 0; m < op->size_; ++m) {
    Op::Member& member = op->members_[m];
    member.post.hold.reset();  // one count: the list's owner usually holds it too
    if (member.post.keep.size() <= 2 || member.global_rank == tl_rank) {
      member.post.keep.clear();
      continue;
    }
    member.keep_returned.store(true, std::memory_order_release);
    RankState& rs = *ranks_[member.global_rank];
    std::lock_guard<SpinMutex> lock(rs.returned_mu);
    rs.returned.push_back(op);
    rs.has_returned.store(true, std::memory_order_release);
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(op->error_mu_);
    error = op->chunk_error_;
  }
  op->state_.store(kFinished, std::memory_order_release);
  if (error) {
    op->fail(error);
    for (const Op::Member& m : op->members_) {
      if (m.issued) note_failed(m.global_rank, op);
    }
  } else {
    op->finish();
  }
  // Advance only the ranks with something queued beside this op. Both this read and push()'s
  // increment are acq_rel RMWs of `queued`: if ours comes first, the pusher sees this op
  // completed (finish() happened before) and passes it itself; otherwise we see its push. An
  // advance for another group that popped this op first marks this group's next op itself.
  for (int m = 0; m < op->size_; ++m) {
    int r = op->group_->global_ranks[m];
    if (ranks_[r]->queued.fetch_add(0, std::memory_order_acq_rel) > 1) {
      advance(r, op->group_, ready);
    }
  }
}

void World::release_returned(int global_rank) {
  RankState& rs = *ranks_[global_rank];
  if (!rs.has_returned.load(std::memory_order_acquire)) return;
  std::vector<std::shared_ptr<Op>> returned;
  {
    std::lock_guard<SpinMutex> lock(rs.returned_mu);
    returned.swap(rs.returned);
    rs.has_returned.store(false, std::memory_order_relaxed);
  }
  for (auto& op : returned) op->release_returned_keep(global_rank);
}

void World::advance(int global_rank, const SharedGroup* group, OpList& ready) {
  RankState& rs = *ranks_[global_rank];
  std::lock_guard<SpinMutex> lock(rs.mu);
  advance_locked(rs, group, ready);
}

void World::advance_locked(RankState& rs, const SharedGroup* group, OpList& ready) {
  // Marks the first unfinished op of `group`, and of the group of each finished op removed here,
  // whose completer may have found only the op behind it queued and skipped this rank (see
  // complete()). Finished ops are removed wherever they are, so that the queue holds only
  // unfinished ones and the few finished since: behind a long-pending op of one group, another
  // group's thousands of finished ops would otherwise stay, and every advance and wait_readers
  // would walk them.
  InlineVec<const SharedGroup*, 4> wanted;
  wanted.push_back(group);
  InlineVec<const SharedGroup*, 4> passed;  // whose first unfinished op this walk passed
  auto holds = [](const InlineVec<const SharedGroup*, 4>& list, const SharedGroup* g) {
    return std::find(list.begin(), list.end(), g) != list.end();
  };
  for (auto it = rs.queue.begin(); it != rs.queue.end();) {
    const SharedGroup* g = it->op->group_;
    if (it->op->is_completed()) {
      // A group's ops finish in order, except that a later one may fail first (a timeout or a
      // departure): one behind its group's first unfinished op changes nothing.
      if (!holds(wanted, g) && !holds(passed, g)) wanted.push_back(g);
      it = rs.queue.erase(it);
      rs.queued.fetch_sub(1, std::memory_order_relaxed);
      continue;
    }
    if (holds(passed, g)) {
      ++it;
      continue;
    }
    passed.push_back(g);
    const SharedGroup** at = std::find(wanted.begin(), wanted.end(), g);
    if (at != wanted.end()) {
      *at = wanted.back();
      wanted.pop_back();
      QueueEntry& e = *it;
      if (!e.op->members_[e.member].head_marked) {
        e.op->members_[e.member].head_marked = 1;
        if (e.op->heads_.fetch_add(1, std::memory_order_acq_rel) + 1 == e.op->size_) {
          ready.push_back(e.op);
        }
      }
      if (wanted.empty()) break;
    }
    ++it;
  }
}

void World::push(int global_rank, int member, const std::shared_ptr<Op>& op) {
  OpList ready;
  {
    RankState& rs = *ranks_[global_rank];
    std::lock_guard<SpinMutex> lock(rs.mu);
    rs.queue.push_back({op, member});
    rs.queued.fetch_add(1, std::memory_order_acq_rel);  // see complete()
    advance_locked(rs, op->group_, ready);
  }
  run_ready(ready);
}

void World::run_ready(OpList& ready) {
  while (!ready.empty()) {
    std::shared_ptr<Op> op = std::move(ready.back());
    ready.pop_back();
    start(op, ready);
  }
}

bool World::help_any() {
  if (running_count_.load(std::memory_order_relaxed) == 0) return false;
  std::shared_ptr<Op> op;
  {
    std::lock_guard<std::mutex> lock(running_mu_);
    for (auto& o : running_) {
      if (o->has_chunks_left()) {
        op = o;
        break;
      }
    }
  }
  if (!op) return false;
  OpList ready;
  work(op, ready);
  run_ready(ready);
  return true;
}


bool World::fail_op(const std::shared_ptr<Op>& op, const std::string& message,
                    std::vector<int> given_up_on) {
  int expected = kPending;
  if (!op->state_.compare_exchange_strong(expected, kFinished, std::memory_order_acq_rel)) {
    return false;
  }
  op->given_up_on_ = std::move(given_up_on);  // before fail(): read once the op is completed
  std::vector<std::shared_ptr<Storage>> keep;
  std::vector<std::shared_ptr<const void>> holds;
  std::vector<int> joined;
  std::vector<int> issued;  // whose Work this op is
  {
    std::lock_guard<SpinMutex> lock(op->group_->mu);
    for (int m = 0; m < op->size_; ++m) {
      for (auto& s : op->members_[m].post.keep) keep.push_back(std::move(s));
      op->members_[m].post.keep.clear();
      if (op->members_[m].post.hold) holds.push_back(std::move(op->members_[m].post.hold));
      if (op->members_[m].joined) joined.push_back(op->group_->global_ranks[m]);
      if (op->members_[m].issued) issued.push_back(op->group_->global_ranks[m]);
    }
  }
  // Noted first: a late joiner that finds the op failed notes its own Work in its place.
  for (int r : issued) note_failed(r, op);  // a member that joins later notes it then
  op->fail(std::make_exception_ptr(CommError(message)));
  keep.clear();
  holds.clear();
  OpList ready;
  for (int r : joined) advance(r, op->group_, ready);
  run_ready(ready);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Joining, departing, waiting.

std::string World::departed_message(const std::string& what, int departed_rank,
                                    const std::vector<int>& missing) {
  // Members that have not joined yet but are still running will come (and get this error):
  // only the departed ones are missing.
  std::vector<int> gone;
  for (int r : missing) {
    if (ranks_[r]->departed.load(std::memory_order_acquire)) gone.push_back(r);
  }
  return fmt::format("{}: rank {} departed ({}) before joining; missing ranks {}", what,
                     departed_rank, ranks_[departed_rank]->departed_reason, format_ranks(gone));
}

std::string World::mismatch_message(const std::string& what, int rank_a, const Post& a,
                                    int rank_b, const Post& b) {
  // Lower rank first, so every rank (and every run) reads the same message.
  if (rank_b < rank_a) return mismatch_message(what, rank_b, b, rank_a, a);
  // Every member reads this one message: when the sides issued different ops, the head names
  // neither ("collective on group ..."), so that no rank reads that it issued the other's.
  std::string head = what;
  if (a.kind != b.kind || a.coalesced != b.coalesced || a.flat != b.flat) {
    const size_t on = what.find(" on group ");
    if (on != std::string::npos) head = "collective" + what.substr(on);
  }
  std::string message =
      fmt::format("{}: mismatched collectives: rank {} issued {} but rank {} issued {}", head,
                  rank_a, a.summary(), rank_b, b.summary());
  // A summary lists a long list's first 8 tensors only (a coalesced list's slots, a flat
  // list's counts): when the lists differ only further on, both would read the same, so name
  // the first tensor that differs. `describe(post, i)` is tensor i of either side.
  auto name_first_difference = [&](size_t size, const auto& differs, const auto& describe) {
    for (size_t i = 0; i < size; ++i) {
      if (!differs(i)) continue;
      if (i >= 8) {  // not shown above
        message += fmt::format(" (first difference: tensor {}: {} on rank {}, {} on rank {})", i,
                               describe(a, i), rank_a, describe(b, i), rank_b);
      }
      return;
    }
  };
  if (a.kind == b.kind && a.slots.size() == b.slots.size() && a.slots.size() > 9) {
    const bool rows = a.kind == OpKind::AllToAll;
    name_first_difference(
        a.slots.size(),
        [&](size_t i) {
          const Slot& x = a.slots[i];
          const Slot& y = b.slots[i];
          return x.dtype != y.dtype || x.count != y.count || !x.same_shape(y);
        },
        [&](const Post& p, size_t i) { return p.slots[i].describe(rows); });
  }
  if (a.flat && b.flat && a.flat_counts.size() == b.flat_counts.size() &&
      a.flat_counts.size() > 9) {
    name_first_difference(
        a.flat_counts.size(), [&](size_t i) { return a.flat_counts[i] != b.flat_counts[i]; },
        [](const Post& p, size_t i) { return fmt::format("numel {}", p.flat_counts[i]); });
  }
  return message;
}

std::shared_ptr<Op> World::join(SharedGroup& group, int member, uint64_t seq, Post&& post,
                                std::shared_ptr<Op>& spare, bool* late) {
  std::shared_ptr<Op> op;
  std::string failure;
  std::vector<int> given_up_on;
  const Clock::time_point now = Clock::now();  // as a waiter compares it with the deadline
  {
    std::lock_guard<SpinMutex> lock(group.mu);
    // Below pending_base: every member joined `seq`'s op already (impossible: this member
    // joins each collective once), or the window moved past it while it had no op, which
    // happens only once a member went past `seq` having issued it on the lane. A mismatch
    // then: this op lives outside the window, and fails below.
    const bool crossed_gone = seq < group.pending_base;
    std::shared_ptr<Op> outside;
    std::shared_ptr<Op>& slot = crossed_gone ? outside : group.pending_slot(seq);
    if (!slot) {
      if (!spare) {
        spare = std::make_shared<Op>(this, &group, static_cast<int>(group.global_ranks.size()),
                                     member);
      }
      spare->init(seq, post.kind, post.coalesced, post.flat,
                  dist_detail::deadline_after(timeout_));
      slot = std::move(spare);
    }
    op = slot;
    *late = op->state_.load(std::memory_order_acquire) != kPending;
    const int me = group.global_ranks[member];
    if (group.lane) failure = lane_crossed_locked(group, member, seq, post, *op);
    // Kept as the op's post even so: members that took the lane find it there (lane_check).
    bool keep_post = false;
    if (failure.empty() && !*late && !op->doomed_ && !post.failed_buffer.empty()) {
      failure = dist_detail::failed_buffer_message(op->description(), me, post.failed_buffer);
      keep_post = true;
    }
    if (crossed_gone && failure.empty()) {
      // The lane side already finished or gave up on `seq` (its records may be reused): say
      // what is known. The other members never join this op.
      failure = fmt::format(
          "{}: mismatched collectives: rank {} issued {} but the other members issued a "
          "different collective at this sequence number (a small all_reduce, which they "
          "completed or gave up on without rank {})",
          op->description(), me, post.summary(), me);
      mark_joined(*op, group.full_mask() & ~(uint64_t{1} << member));
    }
    if (failure.empty() && !*late && !op->doomed_) {
      // The rows a member keeps for itself must agree with themselves too (the pairwise check
      // below sees only members that joined before it).
      if (post.kind == OpKind::AllToAll &&
          post.input_splits[member] != post.output_splits[member]) {
        failure = fmt::format(
            "{}: {}", op->description(),
            split_mismatch(me, post.input_splits[member], me, post.output_splits[member]));
      }
      if (failure.empty() && op->ref_ >= 0) {
        const Post& ref = op->members_[op->ref_].post;
        const int ref_rank = group.global_ranks[op->ref_];
        if (!post.same_call(ref)) {
          failure = mismatch_message(op->description(), ref_rank, ref, me, post);
        } else if (post.kind == OpKind::AllToAll) {
          // Rows rank `me` sends to j must equal the rows j expects from `me`, and back.
          for (int j = 0; j < op->size_ && failure.empty(); ++j) {
            if (!op->members_[j].joined) continue;
            const Post& other = op->members_[j].post;
            const int jr = group.global_ranks[j];
            if (post.input_splits[j] != other.output_splits[member]) {
              failure = fmt::format(
                  "{}: {}", op->description(),
                  split_mismatch(me, post.input_splits[j], jr, other.output_splits[member]));
            } else if (other.input_splits[member] != post.output_splits[j]) {
              failure = fmt::format(
                  "{}: {}", op->description(),
                  split_mismatch(jr, other.input_splits[member], me, post.output_splits[j]));
            }
          }
        }
      }
      if (failure.empty() && now > op->deadline_) {
        // It timed out before this member came, whether or not anybody waited to see it: the
        // members not here by then are told they came late.
        given_up_on = unjoined_ranks(*op);
        failure = timed_out_message(op->description(), given_up_on);
        *late = true;
      }
      if (failure.empty()) keep_post = true;
    }
    if (keep_post) {
      op->members_[member].post = std::move(post);
      if (op->ref_ < 0) op->ref_ = member;
    }
    op->members_[member].joined = 1;
    op->members_[member].issued = 1;
    ++op->joined_count_;
    if (op->joined_count_ == op->size_) {
      if (!crossed_gone) group.release_pending(seq);
    } else if (failure.empty() && departures_.load(std::memory_order_acquire) > 0) {
      // A member that departed will never join: fail now rather than at the timeout. (depart()
      // counts itself before it takes this lock to fail the ops it left, so a join that reads
      // 0 here comes before that and its op is failed there.)
      const std::vector<int> missing = unjoined_ranks(*op);
      const int departed = first_departed(missing);
      if (departed >= 0) failure = departed_message(op->description(), departed, missing);
    }
    if (!failure.empty()) op->doomed_ = true;
  }
  if (!failure.empty()) fail_op(op, failure, std::move(given_up_on));
  return op;
}

std::vector<SharedGroup*> World::groups_of(int rank) {
  std::vector<SharedGroup*> groups;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& g : groups_) {
    if (g->member_of(rank) >= 0) groups.push_back(g.get());
  }
  return groups;
}

void World::depart(int rank, const std::string& reason) {
  RankState& rs = *ranks_[rank];
  rs.departed_reason = reason;
  rs.departed.store(true, std::memory_order_release);
  departures_.fetch_add(1, std::memory_order_seq_cst);
  for (SharedGroup* g : groups_of(rank)) {
    std::vector<std::pair<std::shared_ptr<Op>, std::string>> victims;
    {
      std::lock_guard<SpinMutex> lock(g->mu);
      const int member = g->member_of(rank);
      for (auto& op : g->pending) {
        if (!op || op->members_[member].joined) continue;
        victims.emplace_back(op, departed_message(op->description(), rank, unjoined_ranks(*op)));
      }
      // Lane collectives that others arrived at but this rank did not.
      for (int i = 0; g->lane && i < kLaneSlots; ++i) {
        const uint64_t state = g->lane[i].state.load(std::memory_order_seq_cst);
        const uint64_t arrived = state & kLaneArrived;
        if ((state & kLaneBusy) == 0 || (state & kLaneFailed) != 0 ||
            (arrived & (uint64_t{1} << member)) != 0) {
          continue;
        }
        const uint64_t seq = lane_seq(state);
        lane_fail_locked(*g, seq,
                         departed_message(collective_name(OpKind::AllReduce, false, *g, seq), rank,
                                          missing_ranks(*g, arrived)),
                         0);
      }
    }
    for (auto& [op, message] : victims) fail_op(op, message);
  }
}

dist_detail::UnwaitedFailures World::drain(int rank) {
  std::vector<std::shared_ptr<Work>> works;
  {
    RankState& rs = *ranks_[rank];
    std::lock_guard<SpinMutex> lock(rs.mu);
    for (auto& e : rs.queue) works.push_back(e.op);
  }
  // The lane collectives this rank arrived at and that still wait for others: the same timeout
  // applies to them, or one would complete whenever its late peer came, long after it.
  for (SharedGroup* g : groups_of(rank)) {
    if (!g->lane) continue;
    const int member = g->member_of(rank);
    std::lock_guard<SpinMutex> lock(g->mu);  // a failure moves the records' Works under it
    for (int i = 0; i < kLaneSlots; ++i) {
      const uint64_t state = g->lane[i].state.load(std::memory_order_acquire);
      if ((state & kLaneBusy) != 0 && (state & kLaneFailed) == 0 &&
          (state & (uint64_t{1} << member)) != 0 && g->lane[i].records[member].work) {
        works.push_back(g->lane[i].records[member].work);
      }
    }
  }
  // Those still running now; the ledger has those that failed earlier (a finished op may stay
  // queued a while).
  std::erase_if(works, [](const std::shared_ptr<Work>& w) { return w->is_completed(); });
  for (auto& work : works) {
    try {
      work->wait();
    } catch (const Error&) {
      // Counted below: the rank already finished, and run_local says so.
    }
  }
  bool dropped = false;
  std::vector<std::shared_ptr<Work>> failed = ranks_[rank]->failed.take(&dropped);
  return dist_detail::UnwaitedFailures::of(rank, failed, works, dropped);
}

// ---------------------------------------------------------------------------------------------
// The lane (see LaneSlot).

std::shared_ptr<LaneWork> World::lane_issue(SharedGroup& group, int member, uint64_t seq,
                                            const Slot& slot, ReduceOp op,
                                            std::shared_ptr<Storage> keep) {
  auto work =
      std::make_shared<LaneWork>(this, &group, seq, member, dist_detail::deadline_after(timeout_));
  work->keep_ = std::move(keep);
  LaneSlot& ls = group.lane_slot(seq);
  LaneRecord& record = ls.records[member];
  const uint64_t bit = uint64_t{1} << member;
  // This member's Work of the slot's previous collective (finished): its buffer may go now
  // (breaking the cycle storage -> pending Work -> storage of a result nobody waited for). Both
  // happen after this arrival, off the path the peers wait on.
  std::shared_ptr<LaneWork> previous;
  struct ReleasePrevious {
    std::shared_ptr<LaneWork>& work;
    ~ReleasePrevious() {
      if (work) work->release_keep();
    }
  } release_previous{previous};
  auto post = [&] {
    record.slot = slot;
    record.reduce_op = op;
    record.step = dist_detail::internal_step();
    record.deadline.store(work->deadline_.time_since_epoch().count(), std::memory_order_relaxed);
    if (record.work != work) previous = std::exchange(record.work, work);
  };
  uint64_t prev = ls.state.load(std::memory_order_acquire);
  Backoff backoff(wait_spin_);
  StallClock stall(stall_warning_);
  // Listed in group.lane_waiting once its spin ran out, until it returns.
  struct Waiting {
    SharedGroup& group;
    const uint64_t seq, bit;
    bool listed = false;
    void list() {
      std::lock_guard<SpinMutex> lock(group.mu);
      auto it = std::find_if(group.lane_waiting.begin(), group.lane_waiting.end(),
                             [&](const auto& w) { return w.first == seq; });
      if (it == group.lane_waiting.end()) {
        group.lane_waiting.emplace_back(seq, bit);
      } else {
        it->second |= bit;
      }
      listed = true;
    }
    ~Waiting() {
      if (!listed) return;
      std::lock_guard<SpinMutex> lock(group.mu);
      auto it = std::find_if(group.lane_waiting.begin(), group.lane_waiting.end(),
                             [&](const auto& w) { return w.first == seq; });
      if (it != group.lane_waiting.end() && (it->second &= ~bit) == 0) {
        group.lane_waiting.erase(it);
      }
    }
  } waiting{group, seq, bit};
  std::shared_ptr<Op> crossed;  // an Op-path collective at `seq`, failed by an absence below
  std::string crossed_message;
  uint64_t looked_ahead = 0;  // the last state seen serving a later collective
  for (;;) {
    if (lane_serves(prev, seq)) {
      // Another member claimed it; it cannot move on without this member.
      post();
      prev = ls.state.fetch_or(bit, std::memory_order_seq_cst);
      break;
    }
    if ((prev & (kLaneBusy | kLaneAbsent)) == 0) {
      // Free: every earlier collective of this slot finished, so nobody reads the records.
      post();
      if (ls.state.compare_exchange_weak(prev, lane_seq_bits(seq) | kLaneBusy | bit,
                                         std::memory_order_seq_cst, std::memory_order_acquire)) {
        prev = lane_seq_bits(seq) | kLaneBusy;
        break;
      }
      continue;
    }
    if ((prev & kLaneBusy) == 0) {
      // Free, but members gave up on some collective of this slot (kLaneAbsent): claiming and
      // applying them happen under mu (nothing else changes a free slot with absences then).
      // A later collective waits until the earlier one with absences was served: its other
      // members come first.
      std::unique_lock<SpinMutex> lock(group.mu);
      prev = ls.state.load(std::memory_order_acquire);
      if ((prev & kLaneBusy) != 0) continue;
      if (!lane_absence_locked(group, seq, /*earlier=*/true)) {
        post();
        const uint64_t later = lane_absence_locked(group, seq, /*earlier=*/false) ? kLaneAbsent : 0;
        ls.state.store(lane_seq_bits(seq) | kLaneBusy | bit | later, std::memory_order_seq_cst);
        std::vector<int> crossed_given_up_on;
        crossed = lane_apply_absences_locked(group, seq, &crossed_message, &crossed_given_up_on);
        lock.unlock();
        if (crossed) fail_op(crossed, crossed_message, std::move(crossed_given_up_on));
        if (work->is_completed()) return work;  // failed: the absent members' error
        prev = lane_seq_bits(seq) | kLaneBusy;
        break;
      }
    }
    if ((prev & kLaneBusy) != 0 && lane_seq(prev) > lane_seq(lane_seq_bits(seq)) &&
        prev != looked_ahead) {
      looked_ahead = prev;  // once per state: the lookup takes the group's lock
      // The slot serves a later collective although this member has not come to `seq`: a slot
      // moves past a collective only once every member arrived or was counted absent, so the
      // members there issued `seq` on the Op path, a different call. Both sides fail with the
      // mismatch (every member that finds it reads the first message, the Op's).
      std::shared_ptr<Op> ahead;
      std::string message;
      {
        std::lock_guard<SpinMutex> lock(group.mu);
        ahead = group.find_pending(seq);
        if (ahead && ahead->ref_ >= 0) {
          message = mismatch_message(
              work->description(), group.global_ranks[member],
              LaneRecord::post(slot, op, dist_detail::internal_step()),
              group.global_ranks[ahead->ref_], ahead->members_[ahead->ref_].post);
          ahead->doomed_ = true;
          join_absent_locked(group, seq, bit);  // this member never joins it
        }
      }
      if (!message.empty()) {
        if (!fail_op(ahead, message)) {
          // Another member (or a timeout) failed it first and is setting its error now: the
          // Op cannot finish otherwise without this member, so this wait is short.
          while (!ahead->is_completed()) std::this_thread::yield();
          message = dist_detail::failure_message(*ahead, message);
        }
        lane_fail(work, message);
        return work;
      }
    }
    // Blocked: the slot serves an earlier collective (a peer is kLaneSlots behind), or waits for
    // the members of an earlier one with absences.
    if (!backoff.step()) {
      if (!waiting.listed) waiting.list();
      std::string failure;
      bool departure = false;
      const Clock::time_point now = Clock::now();
      // Behind an earlier collective this member waits for it: it gives up when that one times
      // out (its first issue plus the timeout), not a whole timeout after this issue, or a rank
      // k collectives ahead of a late peer would block k timeouts before its first wait. Behind
      // a failed collective or an absence, whose late members have yet to come, it gives up
      // one timeout after the slot last moved (failed, was freed, or got its first absence),
      // or at its own deadline if sooner: its own alone was k timeouts again for a rank
      // 2 x kLaneSlots ahead. (A failed slot's arrived bits include absent members, whose
      // records are stale.)
      Clock::time_point deadline = work->deadline_;
      if ((prev & (kLaneBusy | kLaneFailed)) == kLaneBusy) {
        deadline = lane_deadline(ls, prev, deadline);
      } else {
        Clock::time_point moved(Clock::duration(ls.late_deadline.load(std::memory_order_relaxed)));
        if ((prev & kLaneFailed) == 0) {
          std::lock_guard<SpinMutex> lock(group.mu);
          for (const SharedGroup::LaneAbsence& a : group.lane_absences) {
            if (a.seq % kLaneSlots == seq % kLaneSlots && a.seq < seq) {
              moved = std::max(moved, a.deadline);
            }
          }
        }
        deadline = std::min(deadline, moved);
      }
      if (now >= deadline) {
        // This member waits for the earlier collective as a waiter of its would: that one
        // times out now, so that it is not reported unfinished here and completed later.
        if ((prev & kLaneBusy) != 0 && (prev & bit) != 0) {
          lane_check(group, lane_seq(prev), member, /*timed_out=*/true);
        }
        // Names the earlier collective and the ranks it still misses (the late ones).
        uint64_t blocker = seq - kLaneSlots;
        uint64_t came = group.full_mask();  // none missing unless known
        if ((prev & kLaneBusy) != 0) {
          blocker = lane_seq(prev);
          came = prev & kLaneArrived;
        } else {
          // Waiting for the members of an earlier collective with absences: the ones that
          // gave up on it came (and went); the rest are late.
          std::lock_guard<SpinMutex> lock(group.mu);
          blocker = seq;
          for (const SharedGroup::LaneAbsence& a : group.lane_absences) {
            if (a.seq % kLaneSlots == seq % kLaneSlots && a.seq < blocker) {
              blocker = a.seq;
              came = a.members;
            }
          }
        }
        if (blocker == seq) blocker = seq - kLaneSlots;  // freed meanwhile
        const std::vector<int> missing = missing_ranks(group, came);
        failure = fmt::format(
            "{}: timed out after {:g} s waiting for {} to finish{}", work->description(),
            std::chrono::duration<double>(timeout_).count(),
            collective_name(OpKind::AllReduce, false, group, blocker),
            missing.empty() ? std::string() : missing_report(missing));
      } else if (departures_.load(std::memory_order_acquire) > 0) {
        const std::vector<int> missing = missing_ranks(group, bit);
        const int departed = first_departed(missing);
        if (departed >= 0) {
          // A member that gave up on `seq` before it departed left the first error for it,
          // which every member reads (it said "departed before joining" of a member that came
          // to `seq` and timed out behind the same earlier collective as this one).
          std::lock_guard<SpinMutex> lock(group.mu);
          auto it = std::find_if(group.lane_absences.begin(), group.lane_absences.end(),
                                 [&](const SharedGroup::LaneAbsence& a) { return a.seq == seq; });
          failure = it != group.lane_absences.end()
                        ? it->message
                        : departed_message(work->description(), departed, missing);
        }
        departure = departed >= 0;
      }
      if (!failure.empty()) {
        // Give up, but leave word for whoever claims the slot for `seq`: the others must not
        // wait for this member there, and the slot must be freed once they came. After a
        // departure there is nobody to tell (the group cannot complete anything any more).
        std::lock_guard<SpinMutex> lock(group.mu);
        uint64_t cur = ls.state.load(std::memory_order_acquire);
        for (;;) {
          const bool busy = (cur & kLaneBusy) != 0;
          const bool still_blocked =
              busy ? !lane_serves(cur, seq)
                   : (cur & kLaneAbsent) != 0 && lane_absence_locked(group, seq, /*earlier=*/true);
          if (!still_blocked) break;
          // kLaneAbsent goes on while the slot still serves the earlier collective (one atomic
          // step): freeing keeps it, so whoever claims the slot next does so under mu and sees
          // the entry. (Set after a check, a claim on the fast path could slip in between.)
          if (busy && (cur & kLaneAbsent) == 0 &&
              !ls.state.compare_exchange_weak(cur, cur | kLaneAbsent, std::memory_order_seq_cst,
                                              std::memory_order_acquire)) {
            continue;
          }
          if (!departure) {
            auto it = std::find_if(
                group.lane_absences.begin(), group.lane_absences.end(),
                [&](const SharedGroup::LaneAbsence& a) { return a.seq == seq; });
            if (it == group.lane_absences.end()) {
              uint64_t early = 0;
              for (const auto& [waiting_seq, members] : group.lane_waiting) {
                if (waiting_seq == seq) early = members & ~bit;
              }
              group.lane_absences.push_back(
                  {seq, bit, failure, dist_detail::deadline_after(timeout_), early});
              it = group.lane_absences.end() - 1;
            } else {
              it->members |= bit;
              failure = it->message;  // every member reads the first one
            }
            // Nobody comes to `seq` at all: nothing to apply.
            if (it->members == group.full_mask()) group.lane_absences.erase(it);
          }
          lane_fail(work, failure);
          return work;
        }
        prev = cur;  // unblocked meanwhile: arrive after all
        continue;
      }
      if (stall.due(now, deadline) && lane_warn_blocked(*work, prev, stall.slept())) {
        stall.warned();
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    prev = ls.state.load(std::memory_order_acquire);
  }
  if ((prev & kLaneFailed) != 0) {
    // Failed before this member arrived (timeout, departure, mismatch): the same error, said
    // from this member's side.
    record.work.reset();  // nobody else touches a record that arrived after the failure
    {
      std::lock_guard<SpinMutex> lock(group.mu);
      join_absent_locked(group, seq, bit);
    }
    lane_fail(work, issued_after_failure(ls.error, ls.given_up_on, group.global_ranks[member]));
    lane_exit(group, ls, 1);
  } else if (((prev | bit) & kLaneArrived) == group.full_mask()) {
    lane_execute(group, ls);
  } else if (group.ops_pending.load(std::memory_order_seq_cst) ||
             departures_.load(std::memory_order_seq_cst) > 0) {
    // A member may have issued `seq` on the Op path (a joiner that came first did not see this
    // arrival: the stores and loads of ops_pending and the state are ordered), or departed
    // before this arrival (depart() fails only slots it sees): find it now, not at the timeout.
    lane_check(*work, false);
  }
  return work;
}

bool World::lane_absence_locked(const SharedGroup& group, uint64_t seq, bool earlier) const {
  return std::any_of(group.lane_absences.begin(), group.lane_absences.end(),
                     [&](const SharedGroup::LaneAbsence& a) {
                       return a.seq % kLaneSlots == seq % kLaneSlots &&
                              (earlier ? a.seq < seq : a.seq > seq);
                     });
}

std::shared_ptr<Op> World::lane_apply_absences_locked(SharedGroup& group, uint64_t seq,
                                                      std::string* op_message,
                                                      std::vector<int>* op_given_up_on) {
  auto it = std::find_if(group.lane_absences.begin(), group.lane_absences.end(),
                         [&](const SharedGroup::LaneAbsence& a) { return a.seq == seq; });
  if (it == group.lane_absences.end()) return nullptr;
  const SharedGroup::LaneAbsence absence = *it;
  group.lane_absences.erase(it);
  // Members that issued `seq` on the Op path never come here either.
  std::shared_ptr<Op> op = group.find_pending(seq);
  const uint64_t absent = absence.members | (op ? joined_mask(*op) : 0);
  // Everyone but the members that gave up, or were already waiting then, issued `seq` only
  // after they had: each is told so.
  std::vector<int> late = missing_ranks(group, absence.members | absence.early);
  uint64_t failed = 0;
  lane_fail_locked(group, seq, absence.message, absent, &failed, late);
  if (!op || op->ref_ < 0) return nullptr;
  // ... and the lane members never join that op, which fails with the same error.
  op->doomed_ = true;
  join_absent_locked(group, seq, failed | absence.members);
  // The op's members share one message: it names them all.
  std::vector<int> op_members;
  for (int m = 0; m < op->size_; ++m) {
    if (op->members_[m].joined && (absence.members & (uint64_t{1} << m)) == 0 &&
        (failed & (uint64_t{1} << m)) == 0) {
      op_members.push_back(group.global_ranks[m]);
    }
  }
  *op_message = came_late(absence.message, op_members);
  *op_given_up_on = std::move(late);
  return op;
}

// Asks for every member's lines before the reduction touches any: the peers' buffers sit in
// other cores' caches, and one request per line up front overlaps their transfers, which the
// reduction's in-order loads (the hardware prefetcher does not cross pages or start at once)
// would otherwise wait for a few at a time. Outputs are asked for with intent to write. Capped
// so that the prefetched lines fit in L1 with room. At 360-490 ns round trips it took a 4 KiB
// all_reduce from 1.48-1.54 to 1.18-1.36 us (funcol bench); at 110-140 ns it changes nothing
// beyond noise (0.46-0.53 us either way).
void prefetch_members(const std::array<LaneRecord, kLaneMaxRanks>& records, int n,
                      size_t bytes) {
  constexpr size_t kMaxPrefetchBytes = 16 * 1024;
  const size_t each = std::min(bytes, kMaxPrefetchBytes / static_cast<size_t>(n));
  for (int m = 0; m < n; ++m) {
    const auto* in = static_cast<const char*>(records[m].slot.in);
    const auto* out = static_cast<const char*>(records[m].slot.out);
    for (size_t b = 0; b < each; b += 64) {
      if (in == out) {
        __builtin_prefetch(out + b, 1, 3);
      } else {
        __builtin_prefetch(in + b, 0, 3);
        __builtin_prefetch(out + b, 1, 3);
      }
    }
  }
}

void World::lane_execute(SharedGroup& group, LaneSlot& ls) {
  const int n = static_cast<int>(group.global_ranks.size());
  auto& records = ls.records;
  std::string failure;  // a mismatch, a timeout or a kernel's error: every member gets it
  for (int m = 1; m < n && failure.empty(); ++m) {
    if (!records[m].same_call(records[0])) {
      failure = mismatch_message(records[0].work->description(), group.global_ranks[0],
                                 records[0].post(), group.global_ranks[m], records[m].post());
    }
  }
  // Timed out before the last member came (nobody waited to see it): the members that issued
  // it only after the deadline are told they came late.
  std::vector<int> late;
  if (failure.empty()) {
    late = lane_late(group, records);
    if (!late.empty()) failure = timed_out_message(records[0].work->description(), late);
  }
  // A failure of the kernel (cannot happen for a call that passed its checks) fails it too.
  if (failure.empty() && records[0].slot.count > 0) {
    try {
      // As an Op's chunk: reduce in rank order into rank 0's buffer, copy it to the others.
      const Slot& s0 = records[0].slot;
      const size_t bytes = static_cast<size_t>(s0.count) * itemsize(s0.dtype);
      prefetch_members(records, n, bytes);
      std::array<const void*, kLaneMaxRanks> srcs;
      for (int m = 0; m < n; ++m) srcs[m] = records[m].slot.in;
      reduce_buffers(records[0].reduce_op, s0.dtype, s0.out, srcs.data(), n, s0.count);
      for (int m = 1; m < n; ++m) copy_bytes(records[m].slot.out, s0.out, bytes, false);
    } catch (const std::exception& e) {
      failure = fmt::format("{}: {}", records[0].work->description(), e.what());
    }
  }
  // The records keep their Works (each member drops its own when it next posts here): moving
  // them out would write every member's reference count, one more cache line each.
  for (int m = 0; m < n; ++m) {
    if (!failure.empty()) {
      lane_fail(records[m].work, issued_after_failure(failure, late, group.global_ranks[m]));
    } else {
      records[m].work->finish();
    }
  }
  lane_free(ls);
}

std::vector<int> World::lane_late(const SharedGroup& group,
                                  const std::array<LaneRecord, kLaneMaxRanks>& records) const {
  // Each member's deadline is its issue plus the timeout (plus the coarse clock's slack: a
  // member counts as late only if it certainly issued past the first member's deadline).
  const int n = static_cast<int>(group.global_ranks.size());
  auto deadline = [&](int m) { return records[m].deadline.load(std::memory_order_relaxed); };
  Clock::rep first = deadline(0);
  Clock::rep last = first;
  for (int m = 1; m < n; ++m) {
    first = std::min(first, deadline(m));
    last = std::max(last, deadline(m));
  }
  std::vector<int> late;
  const Clock::rep timeout = std::chrono::duration_cast<Clock::duration>(
                                timeout_ + dist_detail::deadline_slack(timeout_))
                                .count();
  if (last - first <= timeout) return late;
  for (int m = 0; m < n; ++m) {
    if (deadline(m) - first > timeout) late.push_back(group.global_ranks[m]);
  }
  return late;
}

bool World::lane_fail_locked(SharedGroup& group, uint64_t seq, const std::string& message,
                             uint64_t absent, uint64_t* failed_arrived,
                             const std::vector<int>& given_up_on) {
  LaneSlot& ls = group.lane_slot(seq);
  uint64_t prev = ls.state.load(std::memory_order_acquire);
  for (;;) {
    if (!lane_serves(prev, seq) || (prev & kLaneFailed) != 0 ||
        (prev & kLaneArrived) == group.full_mask()) {
      return false;  // finished, failed already, or being executed
    }
    ls.error = message;
    ls.given_up_on = given_up_on;
    note_lane_moved(ls);
    if (ls.state.compare_exchange_weak(prev, prev | absent | kLaneFailed,
                                       std::memory_order_seq_cst, std::memory_order_acquire)) {
      break;
    }
  }
  if (failed_arrived != nullptr) *failed_arrived = prev & kLaneArrived;
  int exits = 1;  // this failer
  for (size_t m = 0; m < group.global_ranks.size(); ++m) {
    const uint64_t bit = uint64_t{1} << m;
    if ((prev & bit) != 0) {
      std::shared_ptr<LaneWork> work = std::move(ls.records[m].work);
      lane_fail(work, issued_after_failure(message, given_up_on, group.global_ranks[m]));
      ++exits;
    } else if ((absent & bit) != 0) {
      ++exits;
    }
  }
  lane_exit(group, ls, exits);
  return true;
}

void World::lane_fail(const std::shared_ptr<LaneWork>& work, const std::string& message) {
  work->fail_with(message);
  note_failed(work->group_->global_ranks[work->member_], work);
}

void World::lane_exit(SharedGroup& group, LaneSlot& ls, int count) {
  const int last = static_cast<int>(group.global_ranks.size()) + 1;
  if (ls.exits.fetch_add(count, std::memory_order_acq_rel) + count == last) lane_release(ls);
}

void World::note_lane_moved(LaneSlot& ls) const {
  ls.late_deadline.store(dist_detail::deadline_after(timeout_).time_since_epoch().count(),
                         std::memory_order_relaxed);
}

void World::lane_release(LaneSlot& ls) {
  note_lane_moved(ls);  // published by lane_free
  for (auto& record : ls.records) {
    // An absent member's record still holds its previous (finished) collective.
    if (record.work) record.work->release_keep();
    record.work.reset();
  }
  ls.exits.store(0, std::memory_order_relaxed);
  lane_free(ls);
}

void World::lane_free(LaneSlot& ls) {
  // Keeps the sequence number and kLaneAbsent (a member may set it meanwhile).
  ls.state.fetch_and(~(kLaneBusy | kLaneArrived | kLaneFailed), std::memory_order_acq_rel);
}

void World::mark_joined(Op& op, uint64_t mask) {
  for (int m = 0; m < op.size_; ++m) {
    if ((mask & (uint64_t{1} << m)) == 0 || op.members_[m].joined) continue;
    op.members_[m].joined = 1;
    ++op.joined_count_;
  }
}

uint64_t World::joined_mask(const Op& op) {
  uint64_t mask = 0;
  for (int m = 0; m < op.size_; ++m) {
    if (op.members_[m].joined) mask |= uint64_t{1} << m;
  }
  return mask;
}

int World::first_departed(const std::vector<int>& ranks) const {
  // A rank that threw first (its reason is the likely cause), else the lowest departed one.
  int first = -1;
  for (int r : ranks) {
    if (!ranks_[r]->departed.load(std::memory_order_acquire)) continue;
    if (ranks_[r]->departed_reason.starts_with("threw")) return r;
    if (first < 0) first = r;
  }
  return first;
}

std::vector<int> World::unjoined_ranks(const Op& op) {
  std::vector<int> missing;
  for (int m = 0; m < op.size_; ++m) {
    if (!op.members_[m].joined) missing.push_back(op.group_->global_ranks[m]);
  }
  return missing;
}

std::vector<int> World::missing_ranks(const SharedGroup& group, uint64_t arrived) {
  std::vector<int> missing;
  for (size_t m = 0; m < group.global_ranks.size(); ++m) {
    if ((arrived & (uint64_t{1} << m)) == 0) missing.push_back(group.global_ranks[m]);
  }
  return missing;
}

void World::join_absent_locked(SharedGroup& group, uint64_t seq, uint64_t mask) {
  std::shared_ptr<Op> op = group.find_pending(seq);
  if (!op) return;
  mark_joined(*op, mask);
  if (op->joined_count_ == op->size_) group.release_pending(seq);
}

std::string World::lane_crossed_locked(SharedGroup& group, int member, uint64_t seq,
                                       const Post& post, Op& op) {
  LaneSlot& ls = group.lane_slot(seq);
  const uint64_t bit = uint64_t{1} << member;
  const uint64_t state = ls.state.load(std::memory_order_seq_cst);  // pairs with ops_pending
  if (!lane_serves(state, seq) || (state & bit) != 0) return {};
  uint64_t arrived = state & kLaneArrived;
  std::string message;
  if ((state & kLaneFailed) != 0) {
    message = issued_after_failure(ls.error, ls.given_up_on, group.global_ranks[member]);
    arrived = ls.state.fetch_or(bit, std::memory_order_acq_rel) & kLaneArrived;
    lane_exit(group, ls, 1);
  } else {
    const int first = __builtin_ctzll(arrived);  // a claimed slot has its claimer's bit
    const std::string what = collective_name(OpKind::AllReduce, false, group, seq);
    const int me = group.global_ranks[member];
    message = post.failed_buffer.empty()
                  ? mismatch_message(what, group.global_ranks[first], ls.records[first].post(),
                                     me, post)
                  : dist_detail::failed_buffer_message(what, me, post.failed_buffer);
    // This member and those that joined the op before the lane was claimed never arrive there.
    lane_fail_locked(group, seq, message, bit | joined_mask(op), &arrived);
  }
  // The members in the lane never join this op (bits of Op members are marked already).
  mark_joined(op, arrived);
  return message;
}

Clock::time_point World::lane_deadline(const LaneWork& work) {
  const LaneSlot& ls = work.group_->lane_slot(work.seq_);
  const uint64_t state = ls.state.load(std::memory_order_acquire);
  if (!lane_serves(state, work.seq_)) return work.deadline_;
  return lane_deadline(ls, state, work.deadline_);
}

Clock::time_point World::lane_deadline(const LaneSlot& ls, uint64_t state,
                                       Clock::time_point own) {
  Clock::time_point deadline = own;
  for (uint64_t arrived = state & kLaneArrived; arrived != 0; arrived &= arrived - 1) {
    const Clock::rep ticks =
        ls.records[__builtin_ctzll(arrived)].deadline.load(std::memory_order_relaxed);
    deadline = std::min(deadline, Clock::time_point(Clock::duration(ticks)));
  }
  return deadline;
}

void World::lane_check(LaneWork& work, bool timed_out) {
  if (!work.is_completed()) lane_check(*work.group_, work.seq_, work.member_, timed_out);
}

void World::lane_check(SharedGroup& group, uint64_t seq, int member, bool timed_out) {
  LaneSlot& ls = group.lane_slot(seq);
  std::shared_ptr<Op> crossed;
  std::string failure;
  // A timeout's account of the missing ranks, taken before the lock (whereabouts locks other
  // groups): used if they are still the ones missing under it.
  uint64_t noted_arrived = 0;
  std::string notes;
  if (timed_out) {
    noted_arrived = ls.state.load(std::memory_order_acquire) & kLaneArrived;
    notes = whereabouts(missing_ranks(group, noted_arrived));
  }
  {
    std::lock_guard<SpinMutex> lock(group.mu);
    const uint64_t state = ls.state.load(std::memory_order_acquire);
    const uint64_t arrived = state & kLaneArrived;
    if (!lane_serves(state, seq) || (state & kLaneFailed) != 0 || arrived == group.full_mask()) {
      return;  // finished, failed, or being executed
    }
    const std::string what = collective_name(OpKind::AllReduce, false, group, seq);
    const std::vector<int> missing = missing_ranks(group, arrived);
    const int departed = first_departed(missing);
    std::shared_ptr<Op> op = group.find_pending(seq);
    if (op && op->ref_ >= 0) {
      // A member issued `seq` on the Op path: a different collective, or the same one with a
      // tensor that holds a failed result (Post::failed_buffer). Both fail.
      const uint64_t absent = joined_mask(*op);
      const Post& ref = op->members_[op->ref_].post;
      const int ref_rank = group.global_ranks[op->ref_];
      failure = ref.failed_buffer.empty()
                    ? mismatch_message(what, group.global_ranks[member],
                                       ls.records[member].post(), ref_rank, ref)
                    : dist_detail::failed_buffer_message(what, ref_rank, ref.failed_buffer);
      uint64_t failed = 0;
      if (lane_fail_locked(group, seq, failure, absent, &failed)) {
        op->doomed_ = true;
        crossed = op;
        join_absent_locked(group, seq, failed);
      }
    } else if (departed >= 0) {
      lane_fail_locked(group, seq, departed_message(what, departed, missing), 0);
    } else if (timed_out) {
      lane_fail_locked(group, seq,
                       timed_out_message(what, missing) + (arrived == noted_arrived ? notes : ""),
                       0, nullptr, missing);
    }
  }
  if (crossed) fail_op(crossed, failure);
}

void World::wait_readers(int global_rank, const Storage* storage) {
  RankState& rs = *ranks_[global_rank];
  // Only this rank pushes to its queue, so empty now means empty until it pushes again.
  if (storage == nullptr || rs.queued.load(std::memory_order_acquire) == 0) return;
  std::vector<std::shared_ptr<Op>> readers;
  {
    std::lock_guard<SpinMutex> lock(rs.mu);
    for (const QueueEntry& e : rs.queue) {
      if (e.op->is_completed()) continue;
      // This rank wrote its post at join, and nobody writes it afterwards.
      const Post& post = e.op->members_[e.member].post;
      const auto& fs = post.flat_storages;
      if (std::any_of(post.slots.begin(), post.slots.end(),
                      [&](const Slot& slot) { return slot.in_storage == storage; }) ||
          std::find(fs.begin(), fs.end(), storage) != fs.end()) {
        readers.push_back(e.op);
      }
    }
  }
  for (auto& op : readers) {
    try {
      op->wait();
    } catch (const Error&) {
      // It failed: it no longer reads the buffer, and its waiter gets the error.
    }
  }
}

void LaneWork::wait() {
  if (!is_completed()) {
    Backoff backoff(world_->wait_spin_);
    StallClock stall(world_->stall_warning_);
    for (unsigned polls = 0; !is_completed(); ++polls) {
      // Help any big op while spinning (as Op::wait), every 16th poll.
      if ((!backoff.spinning() || polls % 16 == 0) && world_->help_any()) {
        backoff.reset();
        continue;
      }
      if (backoff.step()) continue;
      // Departures and Op-path mismatches are checked now and then; the timeout at the deadline.
      auto now = Clock::now();
      world_->lane_check(*this, now >= World::lane_deadline(*this));
      if (!is_completed() && stall.due(now, deadline_) &&
          world_->lane_warn_stalled(*this, stall.slept())) {
        stall.warned();
      }
      if (!is_completed()) sleep_until(std::min(deadline_, now + std::chrono::milliseconds(20)));
      backoff.reset();
    }
  }
  release_keep();
  rethrow_if_failed();
}

// A poller drives the timeout and the departure checks as a waiter does (without helping or
// sleeping), or a collective that can never finish would never fail for it.
bool LaneWork::poll() {
  if (is_completed()) return true;
  world_->lane_check(*this, Clock::now() >= World::lane_deadline(*this));
  return is_completed();
}

bool Op::poll() {
  if (is_completed()) return true;
  if (state_.load(std::memory_order_acquire) == kPending && Clock::now() >= deadline_) {
    time_out();
  }
  return is_completed();
}

void Op::time_out() {
  std::vector<int> missing;
  std::string message = world_->timeout_message(*this, &missing);
  world_->fail_op(shared_from_this(), message, std::move(missing));
}

std::string World::timed_out_message(const std::string& what,
                                     const std::vector<int>& missing) const {
  return fmt::format("{}: timed out after {:g} s; missing ranks {}", what,
                     std::chrono::duration<double>(timeout_).count(), format_ranks(missing));
}

std::string World::timeout_message(Op& op, std::vector<int>* missing_out) {
  return fmt::format("{}: timed out after {:g} s{}", op.description(),
                     std::chrono::duration<double>(timeout_).count(),
                     stall_report(op, missing_out));
}

std::string World::stall_report(Op& op, std::vector<int>* missing_out, bool* all_waiting) {
  std::vector<int> missing;
  std::vector<std::pair<int, int>> members;  // (member, global rank) of joined members
  {
    std::lock_guard<SpinMutex> lock(op.group_->mu);
    for (int m = 0; m < op.size_; ++m) {
      if (!op.members_[m].joined) {
        missing.push_back(op.group_->global_ranks[m]);
      } else {
        members.emplace_back(m, op.group_->global_ranks[m]);
      }
    }
  }
  if (!missing.empty()) {
    std::string report = missing_report(missing, all_waiting);
    *missing_out = std::move(missing);
    return report;
  }
  // Everyone joined, but some member is still busy with an earlier collective of the group.
  std::string blockers;
  for (auto [m, r] : members) {
    RankState& rs = *ranks_[r];
    std::lock_guard<SpinMutex> lock(rs.mu);
    if (op.members_[m].head_marked) continue;
    auto it = std::find_if(rs.queue.begin(), rs.queue.end(), [&](const QueueEntry& e) {
      return e.op->group_ == op.group_ && !e.op->is_completed();
    });
    if (it == rs.queue.end() || it->op.get() == &op) continue;
    if (!blockers.empty()) blockers += "; ";
    blockers += fmt::format("rank {} is still in {}", r, it->op->description());
  }
  if (all_waiting) *all_waiting = false;
  return fmt::format(" waiting for earlier collectives: {}",
                     blockers.empty() ? "(none found)" : blockers);
}

std::string World::whereabouts(const std::vector<int>& missing, bool* all_waiting) {
  constexpr size_t kMaxNamed = 4;
  std::vector<std::string> notes;
  bool all = !missing.empty();
  for (int r : missing) {
    const uint64_t last = ranks_[r]->last_issued.load(std::memory_order_relaxed);
    const uint64_t seq = (last >> kIssuedGroupBits) - 1;
    SharedGroup* group = nullptr;
    if (last != 0) {
      std::lock_guard<std::mutex> lock(mu_);  // never held with a group's mu
      group = groups_[last & ((uint64_t{1} << kIssuedGroupBits) - 1)].get();
    }
    std::string what;
    std::vector<int> waits_for;
    if (group != nullptr) {
      std::lock_guard<SpinMutex> lock(group->mu);
      if (std::shared_ptr<Op> op = group->find_pending(seq)) {
        for (int m = 0; m < op->size_; ++m) {
          if (!op->members_[m].joined) waits_for.push_back(group->global_ranks[m]);
        }
        what = op->description();
      } else if (group->lane) {
        const uint64_t state = group->lane_slot(seq).state.load(std::memory_order_acquire);
        if (lane_serves(state, seq) && (state & kLaneFailed) == 0) {
          waits_for = missing_ranks(*group, state & kLaneArrived);
          what = collective_name(OpKind::AllReduce, false, *group, seq);
        } else if (lane_blocked_at_issue(*group, r, seq, state)) {
          waits_for = missing_ranks(*group, state & kLaneArrived);
          what = lane_blocked_description(*group, seq, lane_seq(state));
        }
      }
    }
    if (waits_for.empty()) {
      all = false;
      continue;
    }
    if (notes.size() < kMaxNamed) {
      notes.push_back(fmt::format("rank {}'s last collective, {}, is itself missing ranks {}", r,
                                  what, format_ranks(waits_for)));
    }
  }
  if (all_waiting) *all_waiting = all;
  return notes.empty() ? std::string() : fmt::format(" ({})", fmt::join(notes, "; "));
}

bool World::lane_blocked_at_issue(const SharedGroup& group, int global_rank, uint64_t seq,
                                  uint64_t state) const {
  if ((state & kLaneBusy) == 0 || (state & kLaneFailed) != 0 ||
      lane_seq(state) >= lane_seq(lane_seq_bits(seq))) {
    return false;
  }
  const uint64_t bit = uint64_t{1} << group.member_of(global_rank);
  // A member that gave up on `seq` left it (an absence) and no longer waits.
  return std::none_of(group.lane_absences.begin(), group.lane_absences.end(),
                      [&](const SharedGroup::LaneAbsence& a) {
                        return a.seq == seq && (a.members & bit) != 0;
                      });
}

std::string World::lane_blocked_description(const SharedGroup& group, uint64_t seq,
                                            uint64_t blocker) {
  return fmt::format(
      "{}, which waits in the issuing call for {} to finish (a rank runs at most {} small "
      "all_reduces ahead of its peers on a group)",
      collective_name(OpKind::AllReduce, false, group, seq),
      collective_name(OpKind::AllReduce, false, group, blocker), kLaneSlots);
}

bool World::lane_warn_blocked(LaneWork& work, uint64_t state, std::chrono::nanoseconds slept) {
  SharedGroup& group = *work.group_;
  {
    std::lock_guard<SpinMutex> lock(group.mu);
    if (!lane_blocked_at_issue(group, group.global_ranks[work.member_], work.seq_, state)) {
      return false;
    }
  }
  return warn_if_stalled(group, state & kLaneArrived,
                         lane_blocked_description(group, work.seq_, lane_seq(state)) + ",", slept);
}

bool World::warn_if_stalled(const SharedGroup& group, uint64_t arrived,
                            const std::string& description, std::chrono::nanoseconds slept) {
  bool all_waiting = false;
  const std::string report = missing_report(missing_ranks(group, arrived), &all_waiting);
  if (!all_waiting) return false;
  warn_stalled(description, slept, report);
  return true;
}

bool World::lane_warn_stalled(LaneWork& work, std::chrono::nanoseconds slept) {
  SharedGroup& group = *work.group_;
  const uint64_t state = group.lane_slot(work.seq_).state.load(std::memory_order_acquire);
  if (!lane_serves(state, work.seq_) || (state & kLaneFailed) != 0) return false;
  return warn_if_stalled(group, state & kLaneArrived, work.description(), slept);
}

void World::warn_stalled(const std::string& description, std::chrono::nanoseconds slept,
                         const std::string& report) {
  fmt::print(stderr,
             "funcol: warning: {} has waited {:g} s{}: a deadlock unless a rank issues what "
             "another waits for; it fails when its timeout ({:g} s) runs out\n",
             description, std::chrono::duration<double>(slept).count(), report,
             std::chrono::duration<double>(timeout_).count());
  std::fflush(stderr);
}

const std::string& Op::description() const {
  std::call_once(description_once_,
                 [this] {
                   description_ = collective_name(kind_, coalesced_, *group_name_, seq_, flat_);
                 });
  return description_;
}

const std::string& LaneWork::description() const {
  std::call_once(description_once_, [this] {
    description_ = collective_name(OpKind::AllReduce, false, *group_name_, seq_);
  });
  return description_;
}

void Op::wait() {
  if (!is_completed()) {
    Backoff backoff(world_->wait_spin_);
    StallClock stall(world_->stall_warning_);
    for (unsigned polls = 0; !is_completed(); ++polls) {
      // Help: take chunks of this op, or of any running op (the one this op waits behind).
      // While spinning, look only every 16th poll: the executor of a small op writes the
      // op's state and chunk counters, and every read of them here pulls their cache line
      // away from it (helping pays only for big ops, where 16 polls are nothing).
      if (!backoff.spinning() || polls % 16 == 0) {
        if (state_.load(std::memory_order_acquire) == kRunning && has_chunks_left()) {
          OpList ready;
          auto self = shared_from_this();
          world_->work(self, ready);
          world_->run_ready(ready);
          backoff.reset();
          continue;
        }
        if (world_->help_any()) {
          backoff.reset();
          continue;
        }
      }
      if (backoff.step()) continue;
      auto now = Clock::now();
      bool pending = state_.load(std::memory_order_acquire) == kPending;
      if (pending && now >= deadline_) {
        time_out();
        continue;
      }
      if (pending && stall.due(now, deadline_)) {
        std::vector<int> missing;
        bool all_waiting = false;
        const std::string report = world_->stall_report(*this, &missing, &all_waiting);
        if (all_waiting) {
          world_->warn_stalled(description(), stall.slept(), report);
          stall.warned();
        }
      }
      // A running op finishes without us; re-check now and then all the same.
      sleep_until(pending ? stall.next(deadline_) : now + std::chrono::milliseconds(100));
      backoff.reset();
    }
  }
  // complete() may have left this op's references for its members' threads: a waiter that
  // returns holds the only references to its buffers. A thread that is no member of the op (a
  // reader of another rank's result) releases them for the members.
  release_returned_keep(caller_is_member() ? tl_rank : -1);
  if (failed()) set_failure_seen();
  rethrow_if_failed();
}


// ---------------------------------------------------------------------------------------------
// Groups.

SharedGroup* World::split(const SharedGroup& parent, uint64_t index,
                          const std::vector<std::vector<int>>& lists, const std::string& name,
                          int global_rank) {
  std::lock_guard<std::mutex> lock(mu_);
  auto key = std::make_pair(parent.id, index);
  auto [it, inserted] = splits_.try_emplace(key);
  SplitEntry& entry = it->second;
  if (inserted) {
    entry.lists = lists;
    for (const auto& list : lists) {
      auto g = std::make_unique<SharedGroup>();
      g->id = static_cast<int>(groups_.size());
      g->name = name;
      g->global_ranks = list;
      g->init();
      groups_.push_back(std::move(g));
      entry.groups.push_back(groups_.back().get());
    }
  } else {
    // split_group agreed on the lists over the parent first.
    FUNCOL_CHECK(entry.lists == lists, "split lists differ after the ranks agreed on them");
  }
  SharedGroup* result = nullptr;
  for (size_t i = 0; i < entry.lists.size(); ++i) {
    const auto& l = entry.lists[i];
    if (std::find(l.begin(), l.end(), global_rank) != l.end()) result = entry.groups[i];
  }
  if (++entry.arrivals == static_cast<int>(parent.global_ranks.size())) splits_.erase(it);
  return result;
}

// One rank's view of a group on the threads backend.
class ThreadsGroup final : public ProcessGroup {
 public:
  ThreadsGroup(std::shared_ptr<World> world, SharedGroup* shared, int rank, std::string name,
               GroupRegistry* registry)
      : ProcessGroup(rank, shared->global_ranks, std::move(name), registry),
        world_(std::move(world)),
        shared_(shared),
        global_rank_(shared->global_ranks[rank]),
        last_issued_(world_->last_issued_of(global_rank_)),
        group_id_(static_cast<uint64_t>(shared->id)) {}

  std::string backend() const override { return "threads"; }

  std::shared_ptr<Work> all_reduce(const Tensor& tensor, ReduceOp op) override {
    dist_detail::check_all_reduce(tensor, op);
    if (shared_->lane &&
        tensor.numel() * static_cast<int64_t>(itemsize(tensor.dtype())) <= kLaneMaxBytes) {
      return issue_lane(tensor, op);
    }
    Post p = make_post(OpKind::AllReduce, false);
    p.reduce_op = op;
    add_slot(p, tensor.dtype(), tensor.numel(), tensor, tensor);
    return issue(std::move(p), tensor);
  }

  std::shared_ptr<Work> all_gather(const Tensor& output, const Tensor& input) override {
    dist_detail::check_all_gather(output, input, size());
    dist_detail::check_pair_apart("all_gather", output, input,
                                  dist_detail::InPlace::kInputInOutput, rank());
    Post p = make_post(OpKind::AllGather, false);
    add_slot(p, input.dtype(), input.numel(), input, output);
    return issue(std::move(p), output);
  }

  std::shared_ptr<Work> reduce_scatter(const Tensor& output, const Tensor& input,
                                       ReduceOp op) override {
    dist_detail::check_reduce_scatter(output, input, op, size());
    dist_detail::check_pair_apart("reduce_scatter", output, input,
                                  dist_detail::InPlace::kOutputInInput, rank());
    Post p = make_post(OpKind::ReduceScatter, false);
    p.reduce_op = op;
    add_slot(p, input.dtype(), output.numel(), input, output);
    return issue(std::move(p), output);
  }

  std::shared_ptr<Work> all_to_all(const Tensor& output, const Tensor& input,
                                   const std::vector<int64_t>& output_splits,
                                   const std::vector<int64_t>& input_splits) override {
    auto layout =
        dist_detail::check_all_to_all(output, input, output_splits, input_splits, size());
    dist_detail::check_pair_apart("all_to_all", output, input, std::nullopt, rank());
    Post p = make_post(OpKind::AllToAll, false);
    add_slot(p, input.dtype(), layout.row_elems, input, output);
    p.input_splits = std::move(layout.input_splits);
    p.output_splits = std::move(layout.output_splits);
    return issue(std::move(p), output);
  }

  std::shared_ptr<Work> broadcast(const Tensor& tensor, int src) override {
    dist_detail::check_broadcast(tensor, src, size());
    Post p = make_post(OpKind::Broadcast, false);
    p.root = src;
    add_slot(p, tensor.dtype(), tensor.numel(), tensor, tensor);
    return issue(std::move(p), tensor);
  }

  std::shared_ptr<Work> barrier_async() override {
    return issue(make_post(OpKind::Barrier, false), std::span<const Tensor* const>());
  }

  std::shared_ptr<Work> all_reduce_coalesced(const std::vector<Tensor>& tensors,
                                             ReduceOp op) override {
    // Every slot reduces its bytes into rank 0's buffer and copies them back, chunk by chunk on
    // any waiting thread: a tensor listed twice (or overlapping another) would be reduced twice,
    // with the two passes racing (elements came out 2, 3 or 4 for two ranks of ones).
    dist_detail::check_all_reduce_coalesced(tensors, op);
    if (tensors.empty()) return dist_detail::empty_coalesced("all_reduce_coalesced", *this);
    Post p = make_post(OpKind::AllReduce, true, tensors.size());
    p.reduce_op = op;
    add_slots(p, tensors, tensors, /*count_from_input=*/true);  // in place: the same objects
    return issue(std::move(p), tensors);
  }

  // The in-place form's op with separate buffers: each chunk is reduced from the members'
  // inputs into rank 0's output and copied to the other outputs (no staging either way).
  std::shared_ptr<Work> all_reduce_coalesced_into(const std::vector<Tensor>& outputs,
                                                  const std::vector<Tensor>& inputs,
                                                  ReduceOp op) override {
    dist_detail::check_all_reduce_into(outputs, inputs, op);
    if (inputs.empty()) return dist_detail::empty_coalesced("all_reduce_coalesced_into", *this);
    Post p = make_post(OpKind::AllReduce, true, inputs.size());
    p.reduce_op = op;
    add_slots(p, outputs, inputs, /*count_from_input=*/true);
    return issue(std::move(p), outputs);
  }

  // One output slot; each chunk of it reduces the inputs it spans straight from every rank's
  // tensors into rank 0's output and copies the chunk to the others. Per input only its
  // pointer, count and storage are recorded: no slot and no reference count (the list is held
  // as a whole). Through the executor a bucket of 1000 x 4 KiB all_reduces took 0.29-0.30 ms
  // instead of 0.45-0.49 ms as a coalesced list (fusion_bench, 2 ranks).
  std::shared_ptr<Work> all_reduce_flat(const Tensor& output,
                                        std::shared_ptr<const std::vector<Tensor>> inputs,
                                        ReduceOp op) override {
    dist_detail::check_all_reduce_flat(output, inputs.get(), op);
    if (inputs->empty()) return dist_detail::empty_coalesced("all_reduce_flat", *this);
    Post p = flat_post(OpKind::AllReduce, output, std::move(inputs));
    p.reduce_op = op;
    return issue(std::move(p), output);
  }

  // As all_reduce_flat: each piece copies one rank's input (or 64 KiB of it) to its block of
  // every output. A bucket of 1000 x 4 KiB all_gathers took 0.43-0.46 ms instead of 0.51-0.57
  // ms as a coalesced list.
  std::shared_ptr<Work> all_gather_flat(
      const Tensor& output, std::shared_ptr<const std::vector<Tensor>> inputs) override {
    dist_detail::check_all_gather_flat(*this, output, inputs.get());
    if (inputs->empty()) return dist_detail::empty_coalesced("all_gather_flat", *this);
    Post p = flat_post(OpKind::AllGather, output, std::move(inputs));
    return issue(std::move(p), output);
  }

  // As all_gather_flat: each piece reduces one block of every rank's input (or 64 KiB of it)
  // into its rank's output.
  std::shared_ptr<Work> reduce_scatter_flat(const Tensor& output,
                                            std::shared_ptr<const std::vector<Tensor>> inputs,
                                            ReduceOp op) override {
    dist_detail::check_reduce_scatter_flat(*this, output, inputs.get(), op);
    if (inputs->empty()) return dist_detail::empty_coalesced("reduce_scatter_flat", *this);
    Post p = flat_post(OpKind::ReduceScatter, output, std::move(inputs));
    p.reduce_op = op;
    return issue(std::move(p), output);
  }

  // A flat post: slots[0] is `output`; per input only its pointer, count and storage.
  static Post flat_post(OpKind kind, const Tensor& output,
                        std::shared_ptr<const std::vector<Tensor>> inputs) {
    const size_t m = inputs->size();
    Post p = make_post(kind, true, 1);
    p.flat = true;
    // Written by index through plain pointers: push_back reloads and stores each vector's end
    // on every call (the stores through char pointers may alias it), a chain from one input
    // to the next (posting 1000 inputs took 15 us on a Zen 5).
    p.flat_in.resize(m);
    p.flat_counts.resize(m);
    p.flat_storages.resize(m);
    const char** in_at = p.flat_in.data();
    int64_t* count_at = p.flat_counts.data();
    const Storage** storage_at = p.flat_storages.data();
    for (size_t i = 0; i < m; ++i) {
      const Tensor& in = (*inputs)[i];
      const int64_t count = in.numel();
      // An input still being produced by another collective is waited first.
      in_at[i] = count > 0 ? buffer_ptr(in, /*write=*/false, "input", p.failed_buffer) : nullptr;
      count_at[i] = count;
      storage_at[i] = in.storage().get();
    }
    Slot& s = p.slots.emplace_back();
    s.dtype = output.dtype();
    s.count = output.numel();
    if (output.numel() > 0) s.out = buffer_ptr(output, /*write=*/true, "output", p.failed_buffer);
    keep(p, output.storage());
    p.hold = std::move(inputs);
    return p;
  }

  std::shared_ptr<Work> all_gather_coalesced(const std::vector<Tensor>& outputs,
                                             const std::vector<Tensor>& inputs) override {
    // Every rank copies each input into every output, chunk by chunk on any waiting thread: an
    // output over another output or over an input (other than in place) would race with them.
    dist_detail::check_all_gather_coalesced(*this, outputs, inputs);
    if (inputs.empty()) return dist_detail::empty_coalesced("all_gather_coalesced", *this);
    Post p = make_post(OpKind::AllGather, true, inputs.size());
    add_slots(p, outputs, inputs, /*count_from_input=*/true);
    return issue(std::move(p), outputs);
  }

  std::shared_ptr<Work> reduce_scatter_coalesced(const std::vector<Tensor>& outputs,
                                                 const std::vector<Tensor>& inputs,
                                                 ReduceOp op) override {
    // As all_gather_coalesced: the blocks are reduced from every rank's inputs while the
    // outputs are written, so nothing but an in-place pair may share bytes with an output.
    dist_detail::check_reduce_scatter_coalesced(*this, outputs, inputs, op);
    if (inputs.empty()) return dist_detail::empty_coalesced("reduce_scatter_coalesced", *this);
    Post p = make_post(OpKind::ReduceScatter, true, inputs.size());
    p.reduce_op = op;
    add_slots(p, outputs, inputs, /*count_from_input=*/false);
    return issue(std::move(p), outputs);
  }

  std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& rank_lists,
                                            const std::string& name) override {
    dist_detail::check_split(*this, rank_lists, name);
    const uint64_t index = next_split_.fetch_add(1, std::memory_order_relaxed);
    dist_detail::agree_on_split(*this, static_cast<int>(index), rank_lists, name);
    SharedGroup* mine = world_->split(*shared_, index, rank_lists, name, global_rank_);
    if (mine == nullptr) {
      dist_detail::note_split(*this, rank_lists);
      return nullptr;
    }
    auto group = std::make_shared<ThreadsGroup>(world_, mine, mine->member_of(global_rank_), name,
                                                &registry());
    registry().add(group);
    dist_detail::note_split(*this, rank_lists);
    return group;
  }

 private:
  static Post make_post(OpKind kind, bool coalesced, size_t slots = 1) {
    Post p;
    p.kind = kind;
    p.coalesced = coalesced;
    p.step = dist_detail::internal_step();
    p.slots.reserve(slots);
    return p;
  }

  // A slot of `in` and `out`; `failed`: see buffer_ptr.
  static Slot make_slot(OpKind kind, DType dtype, int64_t count, const Tensor& in,
                        const Tensor& out, std::string& failed) {
    Slot s;
    fill_slot(s, kind, dtype, count, in, out, /*out_ready=*/false, failed);
    return s;
  }

  // The first byte of `t`'s elements, once the collectives still writing it (and, for `write`,
  // those still reading it) are done. When `t` holds the failed result of an earlier
  // collective: null, and `failed` (Post::failed_buffer) says so unless it already says why.
  // The rank then still takes this collective's place in the group's sequence and the
  // collective fails for every member: throwing here, before the sequence number, would pair
  // this rank's next collective with its peers' current one, silently when the two look alike.
  static char* buffer_ptr(const Tensor& t, bool write, std::string_view role,
                          std::string& failed) {
    char* p = nullptr;
    dist_detail::wait_or_note_failed(role, failed, [&] {
      p = static_cast<char*>(write ? t.data_ptr() : const_cast<void*>(t.const_data_ptr()));
    });
    return p;
  }

  // make_slot into `s`, a value-initialised slot. `out_ready`: the output's storage was already
  // waited for writing (an earlier slot of the same post has it too), so its pointer is taken
  // as it is.
  static void fill_slot(Slot& s, OpKind kind, DType dtype, int64_t count, const Tensor& in,
                        const Tensor& out, bool out_ready, std::string& failed) {
    s.dtype = dtype;
    s.count = count;
    s.ndim = dist_detail::pack_compared_shape(in.sizes(), kind == OpKind::AllToAll, s.dims);
    // An input (or in-place output) still being produced by another collective must be
    // complete before any rank reads or writes it; an output also waits for the collectives
    // that still read it (data_ptr).
    s.in_storage = in.storage().get();
    if (&out == &in) {
      // In place: one wait and check is enough.
      if (in.numel() > 0) s.in = buffer_ptr(in, /*write=*/true, "tensor", failed);
      s.out = const_cast<char*>(s.in);
    } else {
      if (in.numel() > 0) s.in = buffer_ptr(in, /*write=*/false, "input", failed);
      if (out.numel() > 0) {
        s.out = out_ready ? static_cast<char*>(out.raw_data_ptr())
                          : buffer_ptr(out, /*write=*/true, "output", failed);
      }
    }
  }

  // A coalesced post's slots, each counting its input's (or output's) elements, then the
  // storages to keep. Every slot is written before the first reference count: a slot's lines
  // were last read by a peer, and each locked increment would otherwise wait for the slot
  // stores queued before it (in a bucket of 1000 x 4 KiB all_gathers, add_slot took 12% of
  // the run that way).
  static void add_slots(Post& p, const std::vector<Tensor>& outputs,
                        const std::vector<Tensor>& inputs, bool count_from_input) {
    // A bucket's outputs often share one storage: waiting for it once is enough, and each
    // wait counts a write with a locked add, which would wait for the slot stores before it
    // (1000 x 4 KiB buckets, 5 alternating pairs: all_gather 0.717 -> 0.689 ms, all_reduce
    // 0.489 -> 0.482 ms, medians).
    const Storage* ready = nullptr;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Tensor& counted = count_from_input ? inputs[i] : outputs[i];
      const Storage* out_storage = outputs[i].storage().get();
      const bool out_ready = &outputs[i] != &inputs[i] && out_storage != nullptr &&
                             out_storage == ready && out_storage != inputs[i].storage().get();
      fill_slot(p.slots.emplace_back(), p.kind, inputs[i].dtype(), counted.numel(), inputs[i],
                outputs[i], out_ready, p.failed_buffer);
      if (&outputs[i] != &inputs[i] && outputs[i].numel() > 0) ready = out_storage;
    }
    p.keep.reserve(inputs.size() + 1);  // distinct inputs and a shared output: no regrowth
    for (size_t i = 0; i < inputs.size(); ++i) {
      keep(p, inputs[i].storage());
      keep(p, outputs[i].storage());
    }
  }

  // Once per storage in a row: a bucket's members often share one.
  static void keep(Post& p, const std::shared_ptr<Storage>& st) {
    if (st && (p.keep.size() == 0 || p.keep[p.keep.size() - 1] != st) &&
        (p.keep.size() < 2 || p.keep[p.keep.size() - 2] != st)) {
      p.keep.push_back(st);
    }
  }

  static void add_slot(Post& p, DType dtype, int64_t count, const Tensor& in, const Tensor& out) {
    p.slots.push_back(make_slot(p.kind, dtype, count, in, out, p.failed_buffer));
    keep(p, in.storage());
    keep(p, out.storage());
  }

  std::shared_ptr<Work> issue(Post&& post, const Tensor& output) {
    return issue(std::move(post), std::span<const Tensor>(&output, 1));
  }

  // `outputs`: a range of Tensors or of pointers to them.
  template <typename Outputs>
  std::shared_ptr<Work> issue(Post&& post, const Outputs& outputs) {
    check_caller(post.kind, post.coalesced, post.flat);
    // One thread at a time: the ranks must agree on the order of a group's collectives, which
    // two threads issuing on one rank's group cannot promise (and spare_ is this thread's).
    IssueGuard guard(issuing_, *this);
    uint64_t seq = next_seq_++;
    tl_rank = global_rank_;
    note_issued(seq);
    world_->release_returned(global_rank_);  // before this post counts its storages again
    // A spare sized to the group, made before the lock; not kept for large groups, where every
    // rank's spare would hold a member record per rank (R^2 in all: 5.9 GB at 4096 ranks).
    if (!spare_ && size() <= kMaxSpareMembers) {
      spare_ = std::make_shared<Op>(world_.get(), shared_, size(), rank());
    }
    bool late = false;
    std::shared_ptr<Op> op = world_->join(*shared_, rank(), seq, std::move(post), spare_, &late);
    world_->push(global_rank_, rank(), op);
    if (late) {
      // This rank gets the failure said from its side (a timeout's "missing ranks" names it).
      while (!op->is_completed()) std::this_thread::yield();  // its failer is finishing it
      const std::string error = dist_detail::failure_message(*op, "unknown failure");
      const std::string mine = issued_after_failure(error, op->given_up_on_, global_rank_);
      if (mine != error) {
        auto failed = std::make_shared<Work>(op->description());
        failed->fail(std::make_exception_ptr(CommError(mine)));
        world_->note_failed_instead(global_rank_, op, failed);
        attach(failed, outputs);
        return failed;
      }
      world_->note_failed(global_rank_, op);
    }
    attach(op, outputs);
    return op;
  }

  // A small all_reduce through the lane (see LaneSlot): no Post, no Op.
  std::shared_ptr<Work> issue_lane(const Tensor& tensor, ReduceOp op) {
    std::string failed;
    const Slot slot =
        make_slot(OpKind::AllReduce, tensor.dtype(), tensor.numel(), tensor, tensor, failed);
    if (!failed.empty()) {
      // Through the Op path, whose join fails the lane's members too (lane_crossed_locked).
      Post p = make_post(OpKind::AllReduce, false);
      p.reduce_op = op;
      p.slots.push_back(slot);
      p.failed_buffer = std::move(failed);
      return issue(std::move(p), tensor);
    }
    check_caller(OpKind::AllReduce, false, false);
    IssueGuard guard(issuing_, *this);
    uint64_t seq = next_seq_++;
    tl_rank = global_rank_;
    note_issued(seq);
    world_->release_returned(global_rank_);
    world_->wait_readers(global_rank_, slot.in_storage);
    std::shared_ptr<LaneWork> work =
        world_->lane_issue(*shared_, rank(), seq, slot, op, tensor.storage());
    if (work->is_completed()) work->release_keep();  // this rank executed it, or it failed
    attach(work, std::span<const Tensor>(&tensor, 1));
    return work;
  }

  // Attaches an issued collective to its outputs' storages. Not when this call completed it
  // successfully (the usual case for the last rank to arrive): nobody else sees the outputs
  // before we return. A collective that failed at issue (a member departed, a mismatch) is
  // attached, so that reading its outputs throws the error instead of returning stale bytes.
  // (A template: the lane passes its LaneWork without a converted copy on its fast path.)
  template <typename W, typename Outputs>
  static void attach(const std::shared_ptr<W>& work, const Outputs& outputs) {
    if (work->is_completed() && !work->failed()) return;
    const Storage* last = nullptr;  // outputs sharing a storage attach once
    for (const auto& output : outputs) {
      const Tensor& t = deref(output);
      if (t.storage() && t.storage().get() != last) t.storage()->add_pending(work);
      last = t.storage().get();
    }
  }
  static const Tensor& deref(const Tensor& t) { return t; }
  static const Tensor& deref(const Tensor* t) { return *t; }

  std::shared_ptr<World> world_;
  SharedGroup* shared_;
  int global_rank_;
  std::atomic<uint64_t>& last_issued_;  // this rank's RankState::last_issued
  const uint64_t group_id_;             // shared_->id, for last_issued_

  void note_issued(uint64_t seq) {
    if (group_id_ < (uint64_t{1} << kIssuedGroupBits)) {
      last_issued_.store(((seq + 1) << kIssuedGroupBits) | group_id_, std::memory_order_relaxed);
    }
  }
  // A rank's thread that issues on another rank's group object of the same world would post as
  // that rank (rank 2 calling rank 0's group gave rank 1 a wrong sum, silently): refused. Any
  // other thread (one a rank started, or a rank of another world) may issue for this rank.
  void check_caller(OpKind kind, bool coalesced, bool flat) const {
    // The calling thread's rank in this group's world, cached per thread by its world's
    // instance id (not its address: a thread that outlives a run_local met the next run's world
    // group at the address of the old one, of another rank, and was refused).
    thread_local uint64_t seen_world = 0;
    thread_local const World* caller_world = nullptr;
    thread_local int caller_rank = -1;
    const ProcessGroup* cw = funcol::current_world();
    const uint64_t cw_id = cw != nullptr ? cw->instance_id() : 0;
    if (cw_id != seen_world) {
      seen_world = cw_id;
      const auto* tg = dynamic_cast<const ThreadsGroup*>(cw);
      caller_world = tg ? tg->world_.get() : nullptr;
      caller_rank = tg ? tg->global_rank_ : -1;
    }
    if (caller_world != world_.get() || caller_rank == global_rank_) return;
    throw InvalidArgument(fmt::format(
        "{} on group '{}': this group object belongs to global rank {}, but global rank {} "
        "called it; each rank must issue on its own group objects (new_group, DeviceMesh and "
        "the registry give every rank its own)",
        op_name(kind, coalesced, flat), name(), global_rank_, caller_rank));
  }

  // Marks an issue in progress; a second thread issuing on the same group meanwhile gets an
  // error instead of racing on the sequence numbers.
  class IssueGuard {
   public:
    IssueGuard(std::atomic<bool>& flag, const ProcessGroup& group) : flag_(flag) {
      if (flag_.exchange(true, std::memory_order_acquire)) {
        throw InvalidArgument(fmt::format(
            "group '{}' (threads backend, rank {}): collectives issued from two threads at once; "
            "every rank must issue a group's collectives in one order, so issue them from one "
            "thread",
            group.name(), group.rank()));
      }
    }
    ~IssueGuard() { flag_.store(false, std::memory_order_release); }
    IssueGuard(const IssueGuard&) = delete;
    IssueGuard& operator=(const IssueGuard&) = delete;

   private:
    std::atomic<bool>& flag_;
  };

  std::atomic<bool> issuing_{false};
  uint64_t next_seq_ = 0;
  std::atomic<uint64_t> next_split_{0};  // two threads may split at once (a misuse: told)
  // The Op this rank publishes if it is first to join the next one (groups of at most
  // kMaxSpareMembers; a larger group's first joiner makes it under the group's lock).
  static constexpr int kMaxSpareMembers = 16;
  std::shared_ptr<Op> spare_;
};

std::shared_ptr<World> make_world(int world_size, std::chrono::milliseconds timeout) {
  return std::make_shared<World>(world_size, timeout);
}

std::shared_ptr<ProcessGroup> make_world_group(const std::shared_ptr<World>& world, int rank,
                                               GroupRegistry* registry) {
  return std::make_shared<ThreadsGroup>(world, world->world_group(), rank, "world", registry);
}

void depart(World& world, int rank, const std::string& reason) { world.depart(rank, reason); }

dist_detail::UnwaitedFailures drain(World& world, int rank) { return world.drain(rank); }

}  // namespace funcol::threads_detail
