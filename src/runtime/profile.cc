// Chrome / Perfetto trace export of per-rank profiles.
#include "funcol/runtime/profile.h"

#include <algorithm>
#include <limits>

#include <nlohmann/json.hpp>

#include "funcol/dist/process_group.h"
#include "funcol/graph/graph.h"

#include "dist/checks.h"

namespace funcol {

namespace {

constexpr int kComputeTid = 0;
constexpr int kCommTid = 1;

double to_us(int64_t ns) { return static_cast<double>(ns) / 1000.0; }

nlohmann::json meta_event(int pid, int tid, const char* name, nlohmann::json args) {
  nlohmann::json e = {{"ph", "M"}, {"pid", pid}, {"name", name}, {"args", std::move(args)}};
  if (tid >= 0) e["tid"] = tid;
  return e;
}

nlohmann::json span_event(const Span& s, int pid, int tid, int64_t begin_ns, int64_t end_ns) {
  nlohmann::json args = {{"iteration", s.iteration}};
  std::string name = "?";
  if (s.node) {
    name = std::string(s.node->op_name());
    args["node"] = "%" + s.node->name();
    if (s.node->loc().known()) args["line"] = s.node->loc().line;
  }
  return {{"ph", "X"},
          {"pid", pid},
          {"tid", tid},
          {"name", name},
          {"cat", span_kind_name(s.kind)},
          {"ts", to_us(begin_ns)},
          {"dur", to_us(std::max<int64_t>(end_ns - begin_ns, 0))},
          {"args", std::move(args)}};
}

}  // namespace

const char* span_kind_name(SpanKind kind) {
  switch (kind) {
    case SpanKind::Compute:
      return "compute";
    case SpanKind::Communication:
      return "communication";
    case SpanKind::Wait:
      return "wait";
  }
  return "?";
}

void align_epochs(ProcessGroup& world, std::span<Profiler* const> profilers) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point mine = Clock::now();
  const int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(mine.time_since_epoch()).count();
  // Latest and (negated) earliest reading, in one collective.
  Tensor range = Tensor::from_vector<int64_t>({ns, -ns});
  // Headed and labelled (see dist_detail::begin_step, InternalStep): never paired with a
  // user's all_reduce or another of funcol's steps.
  dist_detail::begin_step(world, "align_epochs", "align_epochs");
  {
    const dist_detail::InternalStep step("align_epochs");
    world.all_reduce(range, ReduceOp::Max)->wait();
  }
  const std::vector<int64_t> r = range.to_vector<int64_t>();
  const bool shared_clock = r[0] + r[1] < int64_t{1'000'000'000};
  const Clock::time_point epoch =
      shared_clock ? Clock::time_point(std::chrono::duration_cast<Clock::duration>(
                         std::chrono::nanoseconds(r[0])))
                   : Clock::now();
  for (Profiler* p : profilers) p->set_epoch(epoch);
}

std::string trace_events_json(const Profiler& profiler, int rank) {
  nlohmann::json events = nlohmann::json::array();
  events.push_back(
      meta_event(rank, -1, "process_name", {{"name", "rank " + std::to_string(rank)}}));
  events.push_back(meta_event(rank, -1, "process_sort_index", {{"sort_index", rank}}));
  events.push_back(meta_event(rank, kComputeTid, "thread_name", {{"name", "compute"}}));
  events.push_back(meta_event(rank, kCommTid, "thread_name", {{"name", "communication"}}));
  events.push_back(meta_event(rank, kComputeTid, "thread_sort_index", {{"sort_index", 0}}));
  events.push_back(meta_event(rank, kCommTid, "thread_sort_index", {{"sort_index", 1}}));

  std::vector<const Span*> comm;
  for (const Span& s : profiler.spans()) {
    if (s.kind == SpanKind::Communication) {
      comm.push_back(&s);
    } else {
      events.push_back(span_event(s, rank, kComputeTid, s.begin_ns, s.end_ns));
    }
  }
  // Collectives are recorded when they complete; draw them in issue order, back to back.
  std::stable_sort(comm.begin(), comm.end(),
                   [](const Span* a, const Span* b) { return a->begin_ns < b->begin_ns; });
  int64_t prev_end = std::numeric_limits<int64_t>::min();
  for (const Span* s : comm) {
    const int64_t begin = std::max(s->begin_ns, prev_end);
    const int64_t end = std::max(s->end_ns, begin);
    nlohmann::json e = span_event(*s, rank, kCommTid, begin, end);
    e["args"]["issue_us"] = to_us(s->begin_ns);
    e["args"]["complete_us"] = to_us(s->end_ns);
    events.push_back(std::move(e));
    prev_end = end;
  }
  return events.dump();
}

std::string chrome_trace_json(const std::vector<std::string>& rank_events) {
  std::string out = "{\"displayTimeUnit\": \"ns\", \"traceEvents\": [";
  bool first = true;
  for (const std::string& events : rank_events) {
    // Each is a JSON array: splice its elements into ours.
    const size_t open = events.find('[');
    const size_t close = events.rfind(']');
    if (open == std::string::npos || close == std::string::npos || close <= open + 1) continue;
    if (!first) out += ",\n";
    out.append(events, open + 1, close - open - 1);
    first = false;
  }
  out += "]}\n";
  return out;
}

}  // namespace funcol
