// Private allocation helpers shared by tensor.cc and kernels.cc: funcol::Error is the base of
// every error the library throws, a failed allocation too (DESIGN section 4), never a bare
// std::bad_alloc.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <vector>

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
