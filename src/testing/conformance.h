// The shared conformance suite: every backend must pass it (backend x world size x count x
// dtype x reduce op), registered as GoogleTest tests for a given launcher.
#pragma once

#include <string>
#include <vector>

#include "testing/run_ranks.h"

namespace funcol::testing {

// Which backend to test and how to start its ranks.
struct ConformanceConfig {
  // Test suite name: "Conformance/<backend>".
  std::string backend;
  Launcher launch;
  // World sizes to run (threads: 1..8; a process backend: the size it was started with).
  std::vector<int> world_sizes;
  // Smaller matrix for sanitizer builds and slow transports: the 1<<20 counts run only for
  // f32 with sum, on the first two world sizes that are > 1 (and in a build compiled with
  // FUNCOL_SANITIZED, with 1<<17 elements instead).
  bool reduced = false;
  // The whole matrix at 1<<20 too: every dtype and every valid reduce op on every world size,
  // reduce_scatter and all_gather with 1<<20 elements in their larger buffer (the threads
  // backend outside sanitizer builds). Ignored when `reduced`.
  bool full_large = false;
  // Families to register (names as in the test names); empty means all of them.
  std::vector<std::string> families;
};

// Registers one test per (collective family, world size), e.g.
// "Conformance/threads.all_reduce/ws4". Call before RUN_ALL_TESTS (a static initializer in the
// backend's test file will do). Each test runs the whole dtype x reduce op x count matrix of
// its family on every rank with exact checks (integer-valued inputs, chosen so that sums and
// products stay exact in f16/bf16 and fit i8/u8).
//
// Matrix: counts {0, 1, 7, 1000} for every dtype and every valid reduce op (bitwise ops on
// integer and bool only; avg on every dtype but bool, integer avg truncating); count 1<<20 for
// f32: every collective with sum up to 4 ranks (all_reduce at every size), every reduce op for
// all_reduce on 2 and 3 ranks and for reduce_scatter on 2; with `full_large`, every dtype and
// reduce op on every world size as well (reduce_scatter and all_gather: 1<<20 / n per rank).
// Families: all_reduce, reduce_scatter, all_gather, all_to_all (even, uneven and zero
// splits, random split matrix), broadcast (every root), coalesced (all three forms, mixed
// dtypes and counts), overlap (an output over its input other than in place is refused),
// barrier, groups (new_group, split_group, 2-D DeviceMesh membership and
// collectives on its dims), async (results read from another thread, dropped results, many
// collectives in flight before the first wait, a collective reading a pending result) and
// stress (a seeded random mix of collectives and sizes on overlapping groups).
void register_conformance_tests(const ConformanceConfig& config);

// Compares a tensor's elements (converted to double) with `expected`; throws
// std::runtime_error naming `what`, the first differing index and both values.
void expect_values(const Tensor& actual, const std::vector<double>& expected,
                   const std::string& what);

}  // namespace funcol::testing
