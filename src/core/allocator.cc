// The caching host allocator behind Storage (see funcol/core/allocator.h).
#include "funcol/core/allocator.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "memory.h"
#include "funcol/core/error.h"

#include <pthread.h>

#if defined(__SANITIZE_ADDRESS__)
#define FUNCOL_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUNCOL_ASAN 1
#endif
#endif
#ifdef FUNCOL_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace funcol {

namespace detail {

// FUNCOL_ALLOC_CACHE_MB's value (null or empty: the default, 1024 MB) in bytes. Anything but a
// whole number of megabytes is refused, as the other FUNCOL_* variables are; blanks around it
// and a '+' are allowed, as there (" 2" was taken and "2 " refused).
size_t cache_limit_from(const char* env) {
  if (env == nullptr || *env == '\0') return size_t{1024} << 20;
  std::string_view text(env);
  while (!text.empty() && (text.front() == ' ' || text.front() == '\t')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == ' ' || text.back() == '\t')) text.remove_suffix(1);
  if (text.size() > 1 && text.front() == '+' && text[1] != '-') text.remove_prefix(1);
  unsigned long long mb = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), mb);
  if (text.empty() || end != text.data() + text.size() || ec != std::errc() ||
      mb > (std::numeric_limits<size_t>::max() >> 20)) {
    throw InvalidArgument(fmt::format(
        "FUNCOL_ALLOC_CACHE_MB={}: expected a whole number of megabytes (0 or more)", env));
  }
  return static_cast<size_t>(mb) << 20;
}

}  // namespace detail

namespace {

constexpr size_t kPage = 4096;
// The most bytes of page blocks each thread keeps (see ThreadPages); they count against the
// cache's bound.
constexpr size_t kThreadPagesBytes = size_t{16} << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// What the system allocator is asked for: blocks of a page or more in whole pages (so a cached
// request of 4 KiB more or less still finds the same block class), smaller ones to the
// alignment.
size_t block_bytes(size_t nbytes) {
  // Rounding up would wrap to a tiny block.
  if (nbytes > SIZE_MAX - kPage) throw std::bad_alloc();
  const size_t n = std::max<size_t>(nbytes, 1);
  return n >= kPage ? round_up(n, kPage) : round_up(n, kStorageAlignment);
}

// Blocks of a page or more get pages of their own. malloc puts a block right after the
// previous allocation, often the tensor's own Storage (its reference counts): a peer that
// reads the block from its start (another rank reducing it) has its hardware prefetcher
// pull the line before it too, and every later count on that line waits for the line to come
// back (releasing 1000 such 4 KiB tensors after a peer read them took 185 us instead of 13).
// The prefetchers stay within a page.
size_t block_alignment(size_t bytes) { return bytes >= kPage ? kPage : kStorageAlignment; }

void* system_alloc(size_t bytes) {
  return ::operator new (bytes, std::align_val_t{block_alignment(bytes)});
}
void system_free(void* p, size_t bytes) {
  ::operator delete (p, std::align_val_t{block_alignment(bytes)});
}

void poison(void* p, size_t bytes) {
#ifdef FUNCOL_ASAN
  ASAN_POISON_MEMORY_REGION(p, bytes);
#else
  (void)p;
  (void)bytes;
#endif
}
void unpoison(void* p, size_t bytes) {
#ifdef FUNCOL_ASAN
  ASAN_UNPOISON_MEMORY_REGION(p, bytes);
#else
  (void)p;
  (void)bytes;
#endif
}

// The locks registered here are held across fork(), as glibc's malloc holds its own: a child
// never starts with one held by a thread it does not have, where its first allocation (or new
// tensor shape) through that lock would wait forever. At most kForkSafeLocks of them.
constexpr int kForkSafeLocks = 8;
detail::ForkSafeLock fork_safe_locks[kForkSafeLocks];
std::atomic<bool> fork_safe_ready[kForkSafeLocks];  // entry i written
std::atomic<int> fork_safe_next{0};

void fork_prepare() {
  for (int i = 0; i < kForkSafeLocks; ++i) {
    if (fork_safe_ready[i].load(std::memory_order_acquire)) {
      fork_safe_locks[i].acquire(fork_safe_locks[i].lock);
    }
  }
}
void fork_parent() {
  for (int i = kForkSafeLocks; i-- > 0;) {
    if (fork_safe_ready[i].load(std::memory_order_acquire)) {
      fork_safe_locks[i].release(fork_safe_locks[i].lock);
    }
  }
}
void fork_child() {
  // The child's only thread holds them all: each starts over, unlocked.
  for (int i = 0; i < kForkSafeLocks; ++i) {
    if (fork_safe_ready[i].load(std::memory_order_acquire)) {
      fork_safe_locks[i].renew(fork_safe_locks[i].lock);
    }
  }
}

}  // namespace

namespace detail {

void fork_safe(const ForkSafeLock& lock) {
  static const int registered = pthread_atfork(fork_prepare, fork_parent, fork_child);
  (void)registered;
  const int i = fork_safe_next.fetch_add(1, std::memory_order_relaxed);
  FUNCOL_CHECK(i < kForkSafeLocks, "too many fork-safe locks");
  fork_safe_locks[i] = lock;
  fork_safe_ready[i].store(true, std::memory_order_release);
}

}  // namespace detail

namespace {

size_t default_limit() { return detail::cache_limit_from(std::getenv("FUNCOL_ALLOC_CACHE_MB")); }

// A small number per thread, for the cache to hand a thread back its own blocks.
uint32_t thread_tag() {
  static std::atomic<uint32_t> next{0};
  thread_local const uint32_t tag = next.fetch_add(1, std::memory_order_relaxed);
  return tag;
}

class Cache {
 public:
  Cache() {
    detail::fork_safe(&mu_);
    try {
      limit_ = default_limit();
    } catch (const InvalidArgument& e) {
      env_error_ = e.what();
      env_refused_.store(true, std::memory_order_relaxed);
    }
  }

  // Throws FUNCOL_ALLOC_CACHE_MB's error while it stands (a thread's page-sized allocations:
  // one relaxed load unless it was refused).
  void check_env() {
    if (!env_refused_.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (!env_error_.empty()) throw InvalidArgument(env_error_);
  }

  void* take(size_t bytes) {
    const uint32_t me = thread_tag();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!env_error_.empty()) throw InvalidArgument(env_error_);
      auto it = free_.find(bytes);
      if (it != free_.end() && !it->second.empty()) {
        // The block this thread freed last, if it is among the last few freed: its lines are
        // likely still in this core's cache. Threads that run ranks allocate the same sizes each
        // step, and LIFO alone handed two ranks each other's 4 MB bucket buffers every few runs
        // (all their lines then cross cores; 1000 x 4 KiB all_reduce bucket, 2 ranks: about 5%
        // of its time).
        std::vector<Block>& list = it->second;
        size_t pick = list.size() - 1;
        for (size_t k = 0; k < std::min<size_t>(list.size(), kOwnScan); ++k) {
          if (list[list.size() - 1 - k].owner == me) {
            pick = list.size() - 1 - k;
            break;
          }
        }
        void* p = list[pick].ptr;
        list.erase(list.begin() + static_cast<std::ptrdiff_t>(pick));
        if (it->second.empty()) free_.erase(it);
        cached_bytes_ -= bytes;
        --cached_blocks_;
        ++hits_;
        unpoison(p, bytes);
        return p;
      }
      ++misses_;
    }
    return system_alloc(bytes);
  }

  void give(void* p, size_t bytes) {
    std::vector<std::pair<void*, size_t>> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes + page_reserved_ > limit_) {
        evicted.emplace_back(p, bytes);
      } else {
        make_room(bytes, evicted);
        poison(p, bytes);
        free_[bytes].push_back({p, thread_tag()});
        cached_bytes_ += bytes;
        ++cached_blocks_;
      }
    }
    for (const auto& [q, n] : evicted) system_free(q, n);
  }

  // `chosen`: the program's own bound (set_allocator_cache_limit), which stands instead of a
  // refused FUNCOL_ALLOC_CACHE_MB.
  void set_limit(size_t limit, bool chosen = false) {
    std::vector<std::pair<void*, size_t>> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      limit_ = limit;
      if (chosen) {
        env_error_.clear();
        env_refused_.store(false, std::memory_order_relaxed);
      }
      // Every thread's page blocks go back at its next allocation or free (and their room
      // with them).
      page_epoch_.fetch_add(1, std::memory_order_release);
      make_room(0, evicted);
    }
    for (const auto& [q, n] : evicted) system_free(q, n);
  }

  AllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {static_cast<int64_t>(cached_bytes_), static_cast<int64_t>(cached_blocks_), hits_,
            misses_, static_cast<int64_t>(limit_)};
  }

  // Room within the bound for `bytes` more of a thread's page blocks, made by evicting the
  // largest shared blocks where needed; false when the bound cannot hold them.
  bool reserve_pages(size_t bytes) {
    std::vector<std::pair<void*, size_t>> evicted;
    bool ok = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // (Not a throw: a free reaches here, from a destructor. The allocations throw.)
      if (env_error_.empty() && page_reserved_ + bytes <= limit_) {
        make_room(bytes, evicted);
        page_reserved_ += bytes;
        ok = true;
      }
    }
    for (const auto& [q, n] : evicted) system_free(q, n);
    return ok;
  }
  void release_pages(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    page_reserved_ -= bytes;
  }

  // The generation set_limit starts (a thread's page blocks go back when it changes).
  uint64_t page_epoch() const { return page_epoch_.load(std::memory_order_acquire); }

 private:
  // Evicts until `bytes` more fit within the bound beside the cached blocks and the threads'
  // reserved room (or nothing is left to evict), the largest blocks first: they are the rarest
  // to reuse and free the most memory per system call.
  void make_room(size_t bytes, std::vector<std::pair<void*, size_t>>& evicted) {
    while (cached_bytes_ + page_reserved_ + bytes > limit_ && !free_.empty()) {
      evict_largest(evicted);
    }
  }

  void evict_largest(std::vector<std::pair<void*, size_t>>& out) {
    auto it = std::prev(free_.end());
    const size_t bytes = it->first;
    void* p = it->second.back().ptr;
    it->second.pop_back();
    unpoison(p, bytes);
    cached_bytes_ -= bytes;
    --cached_blocks_;
    if (it->second.empty()) free_.erase(it);
    out.emplace_back(p, bytes);
  }

  struct Block {
    void* ptr;
    uint32_t owner;  // thread_tag() of the thread that freed it
  };
  static constexpr size_t kOwnScan = 8;  // how far back take() looks for the caller's block

  std::mutex mu_;
  std::map<size_t, std::vector<Block>> free_;  // block bytes -> cached blocks (LIFO)
  size_t cached_bytes_ = 0;
  int64_t cached_blocks_ = 0;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
  size_t limit_ = 0;
  // FUNCOL_ALLOC_CACHE_MB's error when its value was refused: every allocation of a page or
  // more (take, check_env) throws it until the program sets a bound of its own
  // (set_allocator_cache_limit); frees, allocator_stats() and the other calls work. Guarded
  // by mu_; env_refused_ says it is set, for check_env's lock-free look.
  std::string env_error_;
  std::atomic<bool> env_refused_{false};
  size_t page_reserved_ = 0;  // room the threads' page caches hold within limit_
  std::atomic<uint64_t> page_epoch_{0};
};

// Never destroyed: storages may be freed by other static destructors at exit.
Cache& cache() {
  static Cache* c = new Cache();
  return *c;
}

// Blocks of one page up to kMinCachedBytes, cached by the thread that frees them, without a
// lock. A step that makes a thousand 4 KiB tensors and drops them all left that much free at
// the top of malloc's heap, which glibc handed back to the system and the next step faulted in
// again, page by page: 1000 unbucketed 4 KiB all_reduces through the executor took 31 ms
// instead of 2.4 (fusion_bench, 2 ranks), depending on whether anything happened to sit above
// them in the heap. The shared cache's lock would have cost more than malloc for blocks this
// small, and its line would cross cores on every allocation.
class ThreadPages {
 public:
  ThreadPages() {
    std::lock_guard<std::mutex> lock(registry_mu());
    registry().push_back(this);
  }
  ~ThreadPages() {
    drop();
    {
      std::lock_guard<std::mutex> lock(registry_mu());
      auto& all = registry();
      all.erase(std::find(all.begin(), all.end(), this));
      retired().hits += hits_.load(std::memory_order_relaxed);
      retired().misses += misses_.load(std::memory_order_relaxed);
    }
    tl_gone = true;
  }
  ThreadPages(const ThreadPages&) = delete;
  ThreadPages& operator=(const ThreadPages&) = delete;

  // The calling thread's cache; null once it was destroyed (a storage freed by a thread_local
  // destructor that runs after it).
  static ThreadPages* mine() {
    if (tl_gone) return nullptr;
    thread_local ThreadPages pages;
    return &pages;
  }

  // A cached block of `bytes` (a whole number of pages below kMinCachedBytes), or null.
  void* take(size_t bytes) {
    sync();
    std::vector<void*>& list = lists_[bytes / kPage];
    if (list.empty()) {
      bump(misses_, 1);
      return nullptr;
    }
    void* p = list.back();
    list.pop_back();
    bump(bytes_, -static_cast<int64_t>(bytes));
    bump(blocks_, -1);
    bump(hits_, 1);
    unpoison(p, bytes);
    return p;
  }

  // Keeps a freed block unless this cache or the bound is full; false: the caller frees it.
  bool give(void* p, size_t bytes) {
    sync();
    const size_t need = static_cast<size_t>(bytes_.load(std::memory_order_relaxed)) + bytes;
    if (need > reserved_) {
      // Room is taken from the shared bound a megabyte at a time: one lock per megabyte of
      // growth, not per block.
      const size_t want = std::min(kThreadPagesBytes, std::max(need, reserved_ + kReserveStep));
      if (need > want || !cache().reserve_pages(want - reserved_)) return false;
      reserved_ = want;
    }
    lists_[bytes / kPage].push_back(p);
    bump(bytes_, static_cast<int64_t>(bytes));
    bump(blocks_, 1);
    poison(p, bytes);
    return true;
  }

  // Frees every block when set_limit started a new generation.
  void sync() {
    const uint64_t epoch = cache().page_epoch();
    if (epoch == epoch_) return;
    drop();
    epoch_ = epoch;
  }

  // Every thread's cached bytes and blocks, and the hits and misses of every thread that ever
  // had a cache, added to `stats`.
  static void add_to(AllocatorStats& stats) {
    std::lock_guard<std::mutex> lock(registry_mu());
    stats.hits += retired().hits;
    stats.misses += retired().misses;
    for (const ThreadPages* t : registry()) {
      stats.cached_bytes += t->bytes_.load(std::memory_order_relaxed);
      stats.cached_blocks += t->blocks_.load(std::memory_order_relaxed);
      stats.hits += t->hits_.load(std::memory_order_relaxed);
      stats.misses += t->misses_.load(std::memory_order_relaxed);
    }
  }

 private:
  void drop() {
    for (size_t c = 1; c < lists_.size(); ++c) {
      for (void* p : lists_[c]) {
        unpoison(p, c * kPage);
        system_free(p, c * kPage);
      }
      lists_[c].clear();
    }
    bytes_.store(0, std::memory_order_relaxed);
    blocks_.store(0, std::memory_order_relaxed);
    if (reserved_ > 0) cache().release_pages(reserved_);
    reserved_ = 0;
  }
  // Counters are written by the owner only (plain stores: no read-modify-write) and read by
  // allocator_stats() from any thread.
  static void bump(std::atomic<int64_t>& counter, int64_t delta) {
    counter.store(counter.load(std::memory_order_relaxed) + delta, std::memory_order_relaxed);
  }
  static std::mutex& registry_mu() {
    static auto* mu = [] {
      auto* m = new std::mutex;
      detail::fork_safe(m);
      return m;
    }();
    return *mu;
  }
  static std::vector<ThreadPages*>& registry() {
    static auto* all = new std::vector<ThreadPages*>;
    return *all;
  }
  struct Counts {
    int64_t hits = 0;
    int64_t misses = 0;
  };
  static Counts& retired() {  // of the threads that exited (guarded by registry_mu)
    static auto* counts = new Counts;
    return *counts;
  }

  std::array<std::vector<void*>, kMinCachedBytes / kPage> lists_;  // [pages]: LIFO
  static constexpr size_t kReserveStep = size_t{1} << 20;
  uint64_t epoch_ = cache().page_epoch();
  size_t reserved_ = 0;  // room taken from the shared bound (Cache::reserve_pages)
  std::atomic<int64_t> bytes_{0};
  std::atomic<int64_t> blocks_{0};
  std::atomic<int64_t> hits_{0};
  std::atomic<int64_t> misses_{0};
  static thread_local bool tl_gone;  // trivially destructible: readable after the cache is gone
};
thread_local bool ThreadPages::tl_gone = false;

bool page_cached(size_t bytes) { return bytes >= kPage && bytes < kMinCachedBytes; }

// Storage objects (see detail::SlotAllocator) in slots of kSlotBytes, carved from slabs that
// hold nothing else. A free slot is a link in a list. In AddressSanitizer builds a free slot is
// poisoned, its link too but while the pool reads or writes it (next_of, set_next): a write to
// a slot after it was freed, or a pool that hands one slot out twice, is reported where it
// happens (slot_pool_test runs the pool directly under both sanitizers; Storage objects there
// come from the system, kSlotsFromSystem).
struct FreeSlot {
  FreeSlot* next;
};

FreeSlot* next_of(FreeSlot* slot) {
  unpoison(slot, sizeof(FreeSlot));
  FreeSlot* next = slot->next;
  poison(slot, sizeof(FreeSlot));
  return next;
}
void set_next(FreeSlot* slot, FreeSlot* next) {
  unpoison(slot, sizeof(FreeSlot));
  slot->next = next;
  poison(slot, sizeof(FreeSlot));
}

// A slot freed (p) becomes a poisoned link; a slot taken, plain bytes again. AddressSanitizer
// builds stop on a slot freed twice (its second free would link it into a list twice) and on
// one handed out while it was not free.
FreeSlot* as_free_slot(void* p) {
#ifdef FUNCOL_ASAN
  if (__asan_address_is_poisoned(static_cast<char*>(p) + sizeof(FreeSlot))) {
    std::fprintf(stderr, "funcol: the Storage slot at %p was freed twice\n", p);
    std::abort();
  }
#endif
  poison(p, detail::kSlotBytes);
  return static_cast<FreeSlot*>(p);
}
void* as_taken(FreeSlot* slot) {
#ifdef FUNCOL_ASAN
  if (!__asan_address_is_poisoned(reinterpret_cast<char*>(slot) + sizeof(FreeSlot))) {
    std::fprintf(stderr, "funcol: the slot pool handed out the Storage slot at %p twice\n",
                 static_cast<void*>(slot));
    std::abort();
  }
#endif
  unpoison(slot, detail::kSlotBytes);
  return slot;
}
constexpr size_t kSlabBytes = size_t{64} << 10;
constexpr size_t kSlotsPerSlab = kSlabBytes / detail::kSlotBytes;
// A thread keeps at most this many free slots (384 KiB); beyond, half go back to the pool.
constexpr size_t kThreadSlotsMax = 2048;
// What a thread takes from the pool at once.
constexpr size_t kSlotBatch = 64;

// The slots no thread holds, and the slabs (never freed: a slot may be freed at any time, by
// any thread, static destructors included). A list of slots moves in and out under one lock.
class SlotPool {
 public:
  // Never destroyed, as cache().
  static SlotPool& instance() {
    static SlotPool* pool = new SlotPool;
    return *pool;
  }
  SlotPool() { detail::fork_safe(&mu_); }
  // Up to kSlotBatch free slots, linked, or null when none is free; *count says how many.
  FreeSlot* take(size_t* count) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_ == nullptr) return nullptr;
    FreeSlot* head = free_;
    FreeSlot* tail = head;
    size_t n = 1;
    for (FreeSlot* next = next_of(tail); n < kSlotBatch && next != nullptr;
         next = next_of(tail)) {
      tail = next;
      ++n;
    }
    free_ = next_of(tail);
    set_next(tail, nullptr);
    *count = n;
    return head;
  }
  // The linked slots from `head` to `tail`.
  void give(FreeSlot* head, FreeSlot* tail) {
    std::lock_guard<std::mutex> lock(mu_);
    set_next(tail, free_);
    free_ = head;
  }
  // A new slab's slots, linked, for the calling thread alone: its pages hold no other thread's
  // Storage objects (whose counts that thread writes: slots handed out in batches from one
  // slab to two ranks made both ranks' releases slower, not faster).
  FreeSlot* new_slab() {
    // Page-aligned and a whole number of pages: no other allocation shares its pages.
    auto* slab = static_cast<char*>(::operator new (kSlabBytes, std::align_val_t{kPage}));
    {
      std::lock_guard<std::mutex> lock(mu_);
      slabs_.push_back(slab);  // still reachable for leak checkers
    }
    FreeSlot* head = nullptr;
    for (size_t i = kSlotsPerSlab; i-- > 0;) {
      FreeSlot* slot = as_free_slot(slab + i * detail::kSlotBytes);
      set_next(slot, head);
      head = slot;
    }
    return head;
  }

 private:
  std::mutex mu_;
  FreeSlot* free_ = nullptr;
  std::vector<char*> slabs_;
};

// The last slot of the list from `head` (not null).
FreeSlot* last_of(FreeSlot* head) {
  for (FreeSlot* next = next_of(head); next != nullptr; next = next_of(head)) head = next;
  return head;
}

// A thread's free slots, taken and given without a lock.
class ThreadSlots {
 public:
  ~ThreadSlots() {
    if (head_ != nullptr) SlotPool::instance().give(head_, last_of(head_));
    tl_gone = true;
  }
  // Null once this thread's list was destroyed (a Storage freed by a later thread_local
  // destructor): such a slot goes to the pool at once.
  static ThreadSlots* mine() {
    if (tl_gone) return nullptr;
    thread_local ThreadSlots slots;
    return &slots;
  }
  void* take() {
    if (head_ == nullptr) {
      // Slots others gave up first (they were freed, so they are nobody's now), else a slab.
      head_ = SlotPool::instance().take(&count_);
      if (head_ == nullptr) {
        head_ = SlotPool::instance().new_slab();
        count_ = kSlotsPerSlab;
      }
    }
    FreeSlot* slot = head_;
    head_ = next_of(slot);
    --count_;
    return as_taken(slot);
  }
  void give(void* p) {
    FreeSlot* slot = as_free_slot(p);
    set_next(slot, head_);
    head_ = slot;
    if (++count_ <= kThreadSlotsMax) return;
    // A thread that frees what others made (a consumer of results): keep half.
    FreeSlot* last_kept = head_;
    for (size_t i = 1; i < kThreadSlotsMax / 2; ++i) last_kept = next_of(last_kept);
    FreeSlot* first_given = next_of(last_kept);
    set_next(last_kept, nullptr);
    count_ = kThreadSlotsMax / 2;
    SlotPool::instance().give(first_given, last_of(first_given));
  }

 private:
  FreeSlot* head_ = nullptr;
  size_t count_ = 0;
  static thread_local bool tl_gone;  // trivially destructible: readable after the list is gone
};
thread_local bool ThreadSlots::tl_gone = false;

}  // namespace

namespace detail {

void* pool_allocate_slot() {
  if (ThreadSlots* slots = ThreadSlots::mine()) return slots->take();
  size_t count = 0;
  FreeSlot* head = SlotPool::instance().take(&count);
  if (head == nullptr) head = SlotPool::instance().new_slab();
  if (FreeSlot* rest = next_of(head)) SlotPool::instance().give(rest, last_of(rest));
  return as_taken(head);
}

void pool_free_slot(void* p) {
  if (ThreadSlots* slots = ThreadSlots::mine()) {
    slots->give(p);
    return;
  }
  FreeSlot* slot = as_free_slot(p);
  set_next(slot, nullptr);
  SlotPool::instance().give(slot, slot);
}

}  // namespace detail

void* allocate_storage(size_t nbytes) {
  const size_t bytes = block_bytes(nbytes);
  if (bytes >= kMinCachedBytes) return cache().take(bytes);
  if (page_cached(bytes)) {
    cache().check_env();
    if (ThreadPages* pages = ThreadPages::mine()) {
      if (void* p = pages->take(bytes)) return p;
    }
  }
  return system_alloc(bytes);
}

void free_storage(void* ptr, size_t nbytes) {
  if (ptr == nullptr) return;
  const size_t bytes = block_bytes(nbytes);
  if (bytes >= kMinCachedBytes) {
    cache().give(ptr, bytes);
    return;
  }
  ThreadPages* pages = page_cached(bytes) ? ThreadPages::mine() : nullptr;
  if (pages == nullptr || !pages->give(ptr, bytes)) system_free(ptr, bytes);
}

AllocatorStats allocator_stats() {
  AllocatorStats stats = cache().stats();
  ThreadPages::add_to(stats);
  return stats;
}

void empty_storage_cache() {
  const size_t limit = static_cast<size_t>(cache().stats().limit_bytes);
  cache().set_limit(0);
  cache().set_limit(limit);
  if (ThreadPages* pages = ThreadPages::mine()) pages->sync();  // this thread's at once
}

void set_allocator_cache_limit(size_t bytes) { cache().set_limit(bytes, /*chosen=*/true); }

}  // namespace funcol
