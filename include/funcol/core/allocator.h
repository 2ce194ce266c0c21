// Host memory for tensor storage: 64-byte aligned blocks (page-aligned from a page up, so that
// nothing else shares their lines), large ones cached for reuse.
//
// A training step or a bucketed graph allocates the same large buffers (packed buckets,
// gathered outputs) every iteration. Returning them to the OS and faulting fresh zeroed pages
// back in costs more than the collective itself, so blocks of at least kMinCachedBytes are kept
// on free lists keyed by their page-rounded size and handed out again, like PyTorch's caching
// allocators; a thread gets back the blocks it freed where it can. Blocks of one page up to
// kMinCachedBytes are kept by the thread that frees them (up to 16 MiB each, without a lock):
// a step that drops a thousand 4 KiB tensors would otherwise leave them free at the top of the
// heap, for malloc to hand back to the system and the next step to fault in again. The cache
// is bounded: FUNCOL_ALLOC_CACHE_MB (whole megabytes, default 1024, 0 disables; another value
// is an InvalidArgument at each allocation of a page or more until set_allocator_cache_limit
// sets a bound instead) or set_allocator_cache_limit; beyond it
// the largest cached blocks are freed first (a thread's page blocks count against it too,
// taken a megabyte at a time). Thread-safe. Under AddressSanitizer cached blocks are poisoned, so a
// use after free is still reported.
#pragma once

#include "funcol/core/cxx20.h"  // first: a clear error under an older standard

#include <cstddef>
#include <cstdint>

namespace funcol {

inline constexpr size_t kStorageAlignment = 64;           // a cache line; every SIMD width in use
// Smaller blocks go to malloc, or from a page up to the freeing thread's own cache.
inline constexpr size_t kMinCachedBytes = size_t{64} << 10;

// `nbytes` uninitialised bytes, kStorageAlignment-aligned (nbytes may be 0).
void* allocate_storage(size_t nbytes);
// Returns a block from allocate_storage with the same nbytes.
void free_storage(void* ptr, size_t nbytes);

// Totals over the shared cache and every thread's page blocks.
struct AllocatorStats {
  int64_t cached_bytes = 0;   // bytes held on the free lists now
  int64_t cached_blocks = 0;  // blocks held on the free lists now
  int64_t hits = 0;           // cacheable allocations (a page or more) served from a cache
  int64_t misses = 0;         // cacheable allocations that went to the system
  int64_t limit_bytes = 0;    // the cache bound
};
AllocatorStats allocator_stats();
// Frees every cached block (the memory goes back to the system): the shared cache's and the
// calling thread's at once, another thread's page blocks at its next allocation or free.
void empty_storage_cache();
// Bounds the cache; 0 disables caching. Frees cached blocks beyond the new bound (another
// thread's page blocks as empty_storage_cache does).
void set_allocator_cache_limit(size_t bytes);

}  // namespace funcol
