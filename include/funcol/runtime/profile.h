// Per-rank profiling of graph runs (compute, communication, waits) and Chrome trace export.
#pragma once

#include "funcol/core/cxx20.h"  // first: a clear error under an older standard

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace funcol {

class Node;
class ProcessGroup;

// What a span measures. Compute: one non-collective node's kernel. Communication: one
// collective, from the moment it was issued until its Work was seen complete (polled after
// every node, and at the wait that completes it). Wait: a wait_tensor blocking the rank.
enum class SpanKind : uint8_t { Compute, Communication, Wait };

// "compute", "communication", "wait".
const char* span_kind_name(SpanKind kind);

// One recorded interval, in nanoseconds since the profiler's epoch.
struct Span {
  SpanKind kind = SpanKind::Compute;
  int32_t iteration = 0;
  const Node* node = nullptr;  // the graph must outlive the profiler's spans
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
};

// The spans of one rank. The Executor records into it when given one in ExecutorOptions;
// nothing is recorded (and nothing costs) otherwise. Not thread-safe: one per rank.
class Profiler {
 public:
  Profiler() : epoch_(std::chrono::steady_clock::now()) {}

  // Moves the epoch to now (see also align_epochs, which gives every rank the same time 0).
  void reset_epoch() { epoch_ = std::chrono::steady_clock::now(); }
  void set_epoch(std::chrono::steady_clock::time_point epoch) { epoch_ = epoch; }
  std::chrono::steady_clock::time_point epoch() const { return epoch_; }
  int64_t now_ns() const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                epoch_)
        .count();
  }
  void add(const Span& span) { spans_.push_back(span); }
  void reserve(size_t n) { spans_.reserve(n); }
  const std::vector<Span>& spans() const { return spans_; }
  void clear() { spans_.clear(); }

 private:
  std::chrono::steady_clock::time_point epoch_;
  std::vector<Span> spans_;
};

// Gives every rank's profilers one time 0: collective over `world` (every rank calls it, after
// the same collectives). Each rank reads its clock; where the readings lie within a second of
// each other (ranks on one host share the monotonic clock: threads, or processes on loopback),
// time 0 is the latest reading on any rank, one instant for all, so the ranks' traces line up
// exactly. Otherwise (hosts whose clocks differ) each rank's time 0 is its own reading, taken
// as the ranks leave the collective. Call it right after a barrier. Its all_reduce is labelled
// as funcol's own step, so it never pairs with a user's collective a peer issued instead.
void align_epochs(ProcessGroup& world, std::span<Profiler* const> profilers);

// One rank's trace events as a JSON array (text): metadata naming process `rank` "rank R" and
// its threads "compute" (tid 0) and "communication" (tid 1), then one complete ("X") event per
// span, timestamps in microseconds. Compute and wait spans go on tid 0, collectives on tid 1;
// collectives of one rank are drawn back to back (each starts no earlier than the previous one
// ended, its issue time kept in args.issue_us) so the track nests as trace viewers require.
std::string trace_events_json(const Profiler& profiler, int rank);

// A Chrome / Perfetto trace, {"traceEvents": [...], "displayTimeUnit": "ns"}, joining the
// per-rank arrays of trace_events_json (in rank order).
std::string chrome_trace_json(const std::vector<std::string>& rank_events);

}  // namespace funcol
