// Private allocation helpers shared by tensor.cc and kernels.cc: funcol::Error is the base of
// every error the library throws, a failed allocation too (DESIGN section 4), never a bare
// std::bad_alloc.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

#include "funcol/core/allocator.h"
#include "funcol/core/error.h"

namespace funcol::detail {

// The machine's memory and swap in bytes, capped by the limits of the process's cgroup (a
// container's, a CI job's); 0 when unknown. Asked once (memory.cc).
uint64_t machine_memory_bytes();
// The same without swap: what can be written before the kernel (or the cgroup) swaps or kills.
uint64_t physical_memory_bytes();

// The allocator's cache limit FUNCOL_ALLOC_CACHE_MB's value `env` (nullptr: unset) gives, in
// bytes; InvalidArgument naming the variable when it is not a whole number of megabytes.
size_t cache_limit_from(const char* env);

// Whether `bytes` is more than the machine's memory and swap hold: such a request is refused
// before asking, since AddressSanitizer's allocator aborts on it rather than throwing.
inline bool beyond_memory(uint64_t bytes) {
  const uint64_t memory = machine_memory_bytes();
  return memory != 0 && bytes > memory;
}

// The allocator of Storage objects (Tensor::empty): each in a slot of kSlotBytes (three cache
// lines, 64-byte aligned) on pages that hold Storage objects only. A Storage holds the
// reference counts its owner's thread writes at every copy and release of a Tensor; in
// malloc's heap it sat next to arrays that other threads read in bulk (a rank's list of input
// pointers, which its peers read through), and a reader's hardware prefetcher, running ahead
// through the page, pulled those lines too: every later count there waited for its line to come
// back from the other core (a bucket of 1000 x 4 KiB all_reduces, 2 ranks: one rank released
// its inputs in 10-31 us instead of 6). A thread keeps the slots it frees for its next ones
// (allocator.cc). Slabs are never handed back to the system: a program keeps 192 bytes for each
// Storage it ever had alive at once. Anything larger than a slot is an ordinary allocation, and
// so is every Storage in AddressSanitizer and ThreadSanitizer builds (kSlotsFromSystem).
inline constexpr size_t kSlotBytes = 192;
// Whether this build takes each Storage from the system instead: the builds whose sanitizer
// tracks memory through the system allocator (AddressSanitizer reports a use after free there,
// and ThreadSanitizer forgets a freed Storage's mutex, where a slot reused at once would give
// the next Storage's mutex the old one's lock order: false lock-order inversions).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSlotsFromSystem = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSlotsFromSystem = true;
#else
inline constexpr bool kSlotsFromSystem = false;
#endif
#else
inline constexpr bool kSlotsFromSystem = false;
#endif
// The slot pool itself, which allocate_slot and free_slot use where kSlotsFromSystem is false;
// every build has it, so that its test runs under the sanitizers too (slot_pool_test).
void* pool_allocate_slot();
void pool_free_slot(void* p);
// Inline, so that a Storage's allocation calls the pool itself (no second jump).
inline void* allocate_slot() {
  if constexpr (kSlotsFromSystem) {
    return ::operator new (kSlotBytes, std::align_val_t{kStorageAlignment});
  }
  return pool_allocate_slot();
}
inline void free_slot(void* p) {
  if constexpr (kSlotsFromSystem) {
    ::operator delete (p, std::align_val_t{kStorageAlignment});
    return;
  }
  pool_free_slot(p);
}

template <typename T>
struct SlotAllocator {
  using value_type = T;
  SlotAllocator() = default;
  template <typename U>
  SlotAllocator(const SlotAllocator<U>&) noexcept {}
  T* allocate(size_t n) {
    if (n * sizeof(T) <= kSlotBytes && alignof(T) <= 64) return static_cast<T*>(allocate_slot());
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n * sizeof(T) <= kSlotBytes && alignof(T) <= 64) {
      free_slot(p);
    } else {
      std::allocator<T>().deallocate(p, n);
    }
  }
  template <typename U>
  bool operator==(const SlotAllocator<U>&) const noexcept {
    return true;
  }
};

// A lock held across fork() (allocator.cc): taken before, released in the parent and made anew
// in the child, so that a child forked while another thread held it can still take it. For the
// process-wide locks of making tensors (the allocator's, the layout table's); the lock must live
// as long as the process, and no two such locks may be held at once (they are taken in
// registration order).
struct ForkSafeLock {
  void* lock = nullptr;
  void (*acquire)(void*) = nullptr;
  void (*release)(void*) = nullptr;
  void (*renew)(void*) = nullptr;
};
void fork_safe(const ForkSafeLock& lock);
template <typename Mutex>
void fork_safe(Mutex* mu) {
  fork_safe(ForkSafeLock{mu, [](void* m) { static_cast<Mutex*>(m)->lock(); },
                         [](void* m) { static_cast<Mutex*>(m)->unlock(); },
                         [](void* m) { new (m) Mutex; }});
}

// v.reserve(n), whose failure to allocate throws funcol::Error.
template <typename V>
void reserve_or_throw(std::vector<V>& v, size_t n) {
  if (n <= SIZE_MAX / sizeof(V) && !beyond_memory(uint64_t{n} * sizeof(V))) {
    try {
      v.reserve(n);
      return;
    } catch (const std::bad_alloc&) {
    } catch (const std::length_error&) {
    }
  }
  throw Error(fmt::format("out of memory: cannot allocate {} elements of {} bytes", n, sizeof(V)));
}

// std::vector<V>(n, value), whose failure to allocate throws funcol::Error.
template <typename V>
std::vector<V> vector_or_throw(size_t n, const V& value = V{}) {
  std::vector<V> v;
  reserve_or_throw(v, n);
  v.resize(n, value);
  return v;
}

}  // namespace funcol::detail
