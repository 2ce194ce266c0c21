// Host memory for tensor storage: 64-byte aligned blocks (page-aligned from a page up, so that
// nothing else shares their lines), large ones cached for reuse.
//
// A training step or a bucketed graph allocates the same large buffers (packed buckets,
// gathered outputs) every iteration. Returning them to the OS and faulting fresh zeroed pages
// back in costs more than the collective itself, so blocks of at least kMinCachedBytes are kept
// on free lists keyed by their page-rounded size and handed out again, like PyTorch's caching
// allocators; a thread gets back the blocks it freed where it can. The cache is bounded:
// FUNCOL_ALLOC_CACHE_MB (whole megabytes, default 1024, 0 disables; another value is an
// InvalidArgument at the first cached allocation) or set_allocator_cache_limit; beyond it the
// largest cached blocks are freed first. Thread-safe. Under AddressSanitizer cached blocks are
// poisoned, so a use after free is still reported.
#pragma once

#include <cstddef>
#include <cstdint>

namespace funcol {

inline constexpr size_t kStorageAlignment = 64;           // a cache line; every SIMD width in use
inline constexpr size_t kMinCachedBytes = size_t{64} << 10;  // smaller blocks go to malloc

// `nbytes` uninitialised bytes, kStorageAlignment-aligned (nbytes may be 0).
void* allocate_storage(size_t nbytes);
// Returns a block from allocate_storage with the same nbytes.
void free_storage(void* ptr, size_t nbytes);

struct AllocatorStats {
  int64_t cached_bytes = 0;   // bytes held on the free lists now
  int64_t cached_blocks = 0;  // blocks held on the free lists now
  int64_t hits = 0;           // large allocations served from the cache
  int64_t misses = 0;         // large allocations that went to the system
  int64_t limit_bytes = 0;    // the cache bound
};
AllocatorStats allocator_stats();
// Frees every cached block (the memory goes back to the system).
void empty_storage_cache();
// Bounds the cache; 0 disables caching. Frees cached blocks beyond the new bound.
void set_allocator_cache_limit(size_t bytes);

}  // namespace funcol
