// `funcol run`: runs a graph on N ranks (threads, or processes under mpirun or a gloo store).
#include "tools/run.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/device_mesh.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/verifier.h"
#include "funcol/runtime/executor.h"
#include "funcol/runtime/profile.h"
#include "tools/commands.h"
#include "tools/launch.h"
#include "tools/spawn.h"

namespace funcol::tools {

namespace {

// DESIGN §7: `data` is printed for tensors of at most this many elements.
constexpr int64_t kMaxDataElements = 4096;

// Everything checked before any rank starts.
struct Prepared {
  Module module;
  const Graph* graph = nullptr;
  std::vector<std::pair<std::string, int>> mesh;
};

// One rank's results, as the printing rank needs them.
struct RankReport {
  int rank = 0;
  std::string text;    // the JSON line or the summary line
  std::string events;  // trace events (a JSON array), when tracing
  double seconds = 0;  // wall time of all iterations
};

bool is_identifier(std::string_view s) {
  if (s.empty()) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
  });
}

void validate_options(const RunOptions& o) {
  if (o.ranks < 1) {
    throw InvalidArgument(fmt::format("--ranks must be at least 1, got {}", o.ranks));
  }
  if (o.iters < 1) {
    throw InvalidArgument(fmt::format("--iters must be at least 1, got {}", o.iters));
  }
  if (!o.outputs.empty() && o.outputs != "json") {
    throw InvalidArgument(fmt::format("--outputs must be 'json', got '{}'", o.outputs));
  }
  check_backend_option(o.backend);
  check_job_options(o.backend, o.join, o.ranks);
}

const Graph& select_graph(const Module& module, const RunOptions& o, const std::string& file) {
  const auto& graphs = module.graphs();
  std::string names;
  for (const auto& g : graphs) names += (names.empty() ? "@" : ", @") + g->name();
  if (!o.graph.empty()) {
    const std::string name = o.graph[0] == '@' ? o.graph.substr(1) : o.graph;
    if (const Graph* g = module.find(name)) return *g;
    throw InvalidArgument(fmt::format("{} has no graph @{} (graphs: {})", file, name,
                                      names.empty() ? "none" : names));
  }
  if (graphs.empty()) throw no_graph_error(file);
  if (graphs.size() > 1) {
    throw InvalidArgument(fmt::format("{} holds {} graphs ({}); choose one with --graph", file,
                                      graphs.size(), names));
  }
  return *graphs[0];
}

// Every rank generates (and writes) its inputs before the graph runs, and holds them and its
// outputs when it ends: inputs, or inputs and outputs, larger than this machine's memory are an
// error here, not an out-of-memory kill while they are written. An output counts the value
// whose storage it surely holds: the base of its chain of views and waits (each shares its
// operand's storage, or copies it), once, and nothing when that base is an input; so the sum
// never exceeds what the run holds.
void check_held_memory(const Graph& graph, const RunOptions& o) {
  double inputs = 0;  // doubles: each value has up to 2^62 bytes, so the sums may not fit
  for (const Value* v : graph.inputs()) inputs += static_cast<double>(v->type().nbytes());
  double outputs = 0;
  std::unordered_set<const Value*> counted;  // looked up only
  for (const Value* v : graph.outputs()) {
    while (!v->is_input() &&
           (v->node()->op().is_view || v->node()->op().collective == CollectiveKind::Wait)) {
      v = v->node()->operand(0);
    }
    if (v->is_input() || !counted.insert(v).second) continue;
    outputs += static_cast<double>(v->type().nbytes());
  }
  const int ranks_here = ranks_on_this_machine(o.backend, o.ranks, o.join);
  const std::string where = fmt::format("{} rank{} {}", ranks_here, ranks_here != 1 ? "s" : "",
                                        o.backend == "threads" ? "in this process"
                                                               : "on this machine");
  if (!fits_in_memory(ranks_here, inputs)) {
    throw InvalidArgument(fmt::format(
        "graph @{}'s inputs take {:.0f} bytes per rank: more than this machine's memory holds "
        "for {}",
        graph.name(), inputs, where));
  }
  if (!fits_in_memory(ranks_here, inputs + outputs)) {
    throw InvalidArgument(fmt::format(
        "graph @{}'s inputs and outputs take {:.0f} bytes per rank ({:.0f} of inputs, {:.0f} of "
        "outputs, all held when the graph ends): more than this machine's memory holds for {}",
        graph.name(), inputs + outputs, inputs, outputs, where));
  }
  // While a node runs its result exists beside the inputs: the largest result the run allocates
  // (the executor runs every node, even one nothing uses; a view or a wait shares its operand's
  // storage) and the inputs are a floor of its peak. Beyond memory it was an out-of-memory kill
  // (an 8 GiB all_reduce of an 8 GiB input, 2 ranks, 23 GiB).
  const Value* largest = nullptr;
  for (const Node& n : graph.nodes()) {
    if (n.op().is_view || n.op().collective == CollectiveKind::Wait) continue;
    for (size_t r = 0; r < n.num_results(); ++r) {
      const Value* v = n.result(r);
      if (largest == nullptr || v->type().nbytes() > largest->type().nbytes()) largest = v;
    }
  }
  if (largest == nullptr) return;
  const double value = static_cast<double>(largest->type().nbytes());
  if (fits_in_memory(ranks_here, inputs + value)) return;
  throw InvalidArgument(fmt::format(
      "graph @{}'s inputs and its value {} ({}) take {:.0f} bytes per rank ({:.0f} of inputs, "
      "{:.0f} for {}, which exists beside them while the graph runs): more than this machine's "
      "memory holds for {}",
      graph.name(), largest->ref(), largest->type().str(), inputs + value, inputs, value,
      largest->ref(), where));
}

// A digest reads every element of an output, a view of a few bytes expanded to 2^62 too: an
// output whose elements take more than this machine's memory is an error here, at its node,
// rather than a run that never ends (or, copied to hash, an out-of-memory error naming
// nothing).
void check_output_sizes(const Graph& graph) {
  for (size_t i = 0; i < graph.outputs().size(); ++i) {
    const Value* v = graph.outputs()[i];
    const double bytes = static_cast<double>(v->type().nbytes());
    if (v->is_input() || fits_in_memory(1, bytes)) continue;  // inputs are checked as inputs
    const std::string message = fmt::format(
        "graph @{}: output {} ({}: {}) has {:.0f} bytes of elements, more than this machine's "
        "memory: funcol run reads every element for its digest",
        graph.name(), i, v->ref(), v->type().str(), bytes);
    throw_at<InvalidArgument>(*v->node(), message, message);
  }
}

// Parses, selects and verifies the graph and checks every collective against the groups the
// run will have: the same errors on every rank, so they are reported once, before any starts.
Prepared prepare(const RunOptions& o, const std::string& text) {
  Prepared p;
  const std::string file = o.file == "-" ? "<stdin>" : o.file;
  p.module = parse_module(text, ParseOptions{.file = file});
  p.graph = &select_graph(p.module, o, file);
  verify(*p.graph);
  p.mesh = parse_mesh(o.mesh);
  if (!p.mesh.empty()) {
    int64_t product = 1;
    bool overflow = false;
    for (const auto& [name, size] : p.mesh) {
      overflow = overflow || __builtin_mul_overflow(product, int64_t{size}, &product);
    }
    if (overflow || product != o.ranks) {
      throw InvalidArgument(fmt::format("--mesh {} spans {} ranks but --ranks is {}", o.mesh,
                                        overflow ? "more than 2^63" : std::to_string(product),
                                        o.ranks));
    }
  }
  std::vector<std::string> known = {"world"};
  for (const auto& [name, size] : p.mesh) known.push_back(name);
  validate_groups(
      *p.graph,
      [&](const std::string& name) -> std::optional<int> {
        if (name == "world") return o.ranks;
        for (const auto& [n, s] : p.mesh) {
          if (n == name) return s;
        }
        return std::nullopt;
      },
      known);
  check_held_memory(*p.graph, o);
  check_output_sizes(*p.graph);
  return p;
}

std::string summary_text(int rank, const Graph& graph, const std::vector<Tensor>& outputs) {
  std::string s = fmt::format("rank {}:", rank);
  for (size_t i = 0; i < outputs.size(); ++i) {
    s += fmt::format("{} {} {} digest {}", i == 0 ? "" : ";", graph.outputs()[i]->ref(),
                     type_str(outputs[i].dtype(), outputs[i].sizes()), tensor_digest(outputs[i]));
  }
  if (outputs.empty()) s += " no outputs";
  return s;
}

RankReport run_rank(const Prepared& p, const RunOptions& o, ProcessGroup& world) {
  const int rank = world.rank();
  try {
    std::optional<DeviceMesh> mesh;
    if (!p.mesh.empty()) mesh.emplace(world, p.mesh);
    Profiler profiler;
    ExecutorOptions options;
    if (!o.trace.empty()) options.profiler = &profiler;
    Executor executor(*p.graph, world, options);
    const std::vector<Tensor> inputs = make_inputs(*p.graph, o.seed, rank);
    if (!o.trace.empty()) {
      // Spans of every iteration, up to a million reserved ahead (more grow as needed).
      profiler.reserve(std::min<size_t>(static_cast<size_t>(o.iters) * (p.graph->num_nodes() + 1),
                                        size_t{1} << 20));
    }
    // Line the ranks up: one time 0 for every rank's trace (align_epochs).
    world.barrier();
    Profiler* const profilers[] = {&profiler};
    align_epochs(world, profilers);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<Tensor> outputs;
    for (int i = 0; i < o.iters; ++i) {
      outputs.clear();  // the last run's outputs go before the next run makes its own
      outputs = executor.run(inputs);
    }
    RankReport r;
    r.rank = rank;
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.text = o.outputs == "json" ? outputs_json_line(rank, outputs)
                                 : summary_text(rank, *p.graph, outputs);
    if (!o.trace.empty()) r.events = trace_events_json(profiler, rank);
    return r;
  } catch (...) {
    rethrow_for_rank(rank);
  }
}

// Prints every rank's report in rank order, then writes the trace (the printing process only).
void print_reports(const Prepared& p, const RunOptions& o, std::vector<RankReport>& reports,
                   std::FILE* out) {
  std::sort(reports.begin(), reports.end(),
            [](const RankReport& a, const RankReport& b) { return a.rank < b.rank; });
  if (o.outputs != "json") {
    double slowest = 0;
    for (const RankReport& r : reports) slowest = std::max(slowest, r.seconds);
    size_t collectives = 0;
    for (const Node& n : p.graph->nodes()) collectives += n.op().is_collective();
    auto count = [](size_t n, const char* what) {
      return fmt::format("{} {}{}", n, what, n == 1 ? "" : "s");
    };
    write_output(out, fmt::format("graph @{}: {}, {}; {} on {}; {}, {:.3f} ms per iteration "
                                  "(slowest rank)\n",
                                  p.graph->name(), count(p.graph->num_nodes(), "node"),
                                  count(collectives, "collective"),
                                  count(static_cast<size_t>(o.ranks), "rank"), o.backend,
                                  count(static_cast<size_t>(o.iters), "iteration"),
                                  slowest / o.iters * 1e3));
  }
  for (const RankReport& r : reports) write_output(out, r.text + "\n");
  if (!o.trace.empty()) {
    std::vector<std::string> events;
    for (const RankReport& r : reports) events.push_back(r.events);
    write_file(o.trace, chrome_trace_json(events), "trace file");
    if (o.outputs != "json") write_output(out, fmt::format("trace: {}\n", o.trace));
  }
}

// ---- running the ranks ----------------------------------------------------------------------

int run_threads(const Prepared& p, const RunOptions& o, std::FILE* out) {
  TraceFile trace(o.trace);
  {
    // Until the trace is written: a signal after it must not remove it.
    InterruptScope interrupt(InterruptScope::ExitAtOnce{trace.created()});
    std::vector<RankReport> reports(static_cast<size_t>(o.ranks));
    run_local(o.ranks,
              [&](ProcessGroup& world) { reports[world.rank()] = run_rank(p, o, world); });
    print_reports(p, o, reports, out);
  }
  trace.keep();
  return 0;
}

// The flags every rank of a job must agree on beyond the graph (which the executor checks):
// the launcher passes its own to every rank, but ranks started by hand could differ, and then a
// rank with fewer --iters would meet its peers' graph collectives with the gathering of the
// reports (a truncated message: gloo aborts), a --mesh on some ranks only would meet their
// graph collectives with the mesh's agreement, and a --outputs or --trace on some ranks only
// would print or write part of the run.
void check_same_run_flags(const RunOptions& o, ProcessGroup& world) {
  std::vector<std::string> mine = {"--iters", std::to_string(o.iters), "--seed",
                                   std::to_string(o.seed)};
  if (!o.mesh.empty()) mine.insert(mine.end(), {"--mesh", o.mesh});
  if (!o.outputs.empty()) mine.insert(mine.end(), {"--outputs", o.outputs});
  if (!o.trace.empty()) mine.insert(mine.end(), {"--trace", o.trace});
  check_same_flags(world, mine, "--iters, --seed, --mesh, --outputs and --trace");
}

// This process is one rank of an mpi or gloo job: run, then gather the reports to rank 0.
int run_in_job(const Prepared& p, const RunOptions& o, std::FILE* out, std::FILE* err) {
  return run_as_rank(o.backend, o.ranks, o.join, err, [&](ProcessGroup& world) {
    check_same_run_flags(o, world);
    std::optional<TraceFile> trace;
    if (world.rank() == 0) trace.emplace(o.trace);
    RankReport mine = run_rank(p, o, world);
    const nlohmann::json j = {{"rank", mine.rank},
                              {"text", mine.text},
                              {"events", mine.events},
                              {"seconds", mine.seconds}};
    std::vector<std::string> all = gather_strings(world, j.dump());
    if (world.rank() != 0) return;
    std::vector<RankReport> reports;
    for (const std::string& s : all) {
      const nlohmann::json r = nlohmann::json::parse(s);
      reports.push_back(RankReport{r["rank"].get<int>(), r["text"].get<std::string>(),
                                   r["events"].get<std::string>(), r["seconds"].get<double>()});
    }
    print_reports(p, o, reports, out);
    trace->keep();
  });
}

// The flags a launched rank gets: the same run, as a rank of the job.
std::vector<std::string> rank_args(const RunOptions& o, const std::string& file) {
  std::vector<std::string> a = {"run",
                                "--ranks",   std::to_string(o.ranks),
                                "--backend", o.backend,
                                "--seed",    std::to_string(o.seed),
                                "--iters",   std::to_string(o.iters)};
  if (!o.mesh.empty()) a.insert(a.end(), {"--mesh", o.mesh});
  if (!o.outputs.empty()) a.insert(a.end(), {"--outputs", o.outputs});
  if (!o.trace.empty()) a.insert(a.end(), {"--trace", o.trace});
  if (!o.graph.empty()) a.insert(a.end(), {"--graph", o.graph});
  // Last, after "--": a file named like a flag (-model.ir) is still the file.
  a.insert(a.end(), {"--", file});
  return a;
}

// Whether `path`, or a symbolic link on the way from it to its file, is under /dev or /proc:
// one of this process's descriptors (/dev/stdin, /dev/fd/3, a link to them), which launched
// ranks do not share.
bool via_dev_or_proc(std::filesystem::path path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (int hop = 0; hop < 40; ++hop) {
    path = fs::absolute(path, ec).lexically_normal();
    const std::string s = path.string();
    if (s.starts_with("/dev/") || s.starts_with("/proc/")) return true;
    if (!fs::is_symlink(path, ec)) return false;
    const fs::path target = fs::read_symlink(path, ec);
    if (ec) return false;
    path = target.is_absolute() ? target : path.parent_path() / target;
  }
  return true;  // a loop of links: the copy serves
}

// Not inside a job: start one (launch_job). The ranks read the graph from a file: standard
// input, any FILE that is not a regular file (a pipe, `<(...)`: this process drained it), and
// any reached through /dev or /proc (/dev/stdin or /dev/fd/3 on a regular file: mpirun's ranks
// inherit neither the descriptor nor its position) are saved to the job's temporary directory
// with the text this process read and checked.
int launch(const RunOptions& o, const std::string& text, std::FILE* err) {
  TraceFile trace(o.trace);
  JobOptions job;
  job.backend = o.backend;
  job.ranks = o.ranks;
  job.temp_prefix = "funcol-run-";
  job.rank_args = [&](const std::string& dir) {
    std::string file = o.file;
    std::error_code ec;
    if (o.file == "-" || !std::filesystem::is_regular_file(o.file, ec) ||
        via_dev_or_proc(o.file)) {
      file = dir + (o.file == "-" ? "/stdin.ir" : "/input.ir");
      write_file(file, text, "the graph's copy");
    }
    return rank_args(o, file);
  };
  const int status = launch_job(job, err);
  if (status == 0) trace.keep();
  return status;
}

int run_command_impl(const RunOptions& o, std::FILE* out, std::FILE* err) {
  if (o.backend != "threads" && inside_job(o.backend, o.join)) {
    std::optional<Prepared> p;
    const bool ok = rank_checks_pass(o.backend, o.ranks, o.join, err, [&] {
      validate_options(o);
      p.emplace(prepare(o, read_text_file(o.file)));
    });
    return ok ? run_in_job(*p, o, out, err) : 1;
  }
  validate_options(o);
  const std::string text = read_text_file(o.file);
  const Prepared p = prepare(o, text);
  if (o.backend == "threads") return run_threads(p, o, out);
  return launch(o, text, err);
}

}  // namespace

std::vector<std::pair<std::string, int>> parse_mesh(std::string_view text) {
  std::vector<std::pair<std::string, int>> dims;
  if (text.empty()) return dims;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view item = text.substr(pos, comma - pos);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      throw InvalidArgument(fmt::format(
          "--mesh '{}': expected NAME=SIZE, got '{}' (e.g. --mesh dp=2,tp=2)", text, item));
    }
    const std::string name(item.substr(0, eq));
    const std::string size_text(item.substr(eq + 1));
    if (!is_identifier(name)) {
      throw InvalidArgument(fmt::format("--mesh '{}': invalid dimension name '{}'", text, name));
    }
    if (name == "world") {
      throw InvalidArgument(fmt::format(
          "--mesh '{}': 'world' is the group of all ranks; name the dimension otherwise", text));
    }
    char* end = nullptr;
    errno = 0;
    const long size = size_text.empty() ? 0 : std::strtol(size_text.c_str(), &end, 10);
    if (size_text.empty() || *end != '\0' || errno != 0 || size < 1 || size > (1 << 20)) {
      throw InvalidArgument(
          fmt::format("--mesh '{}': size of '{}' must be an integer from 1 to {}, got '{}'",
                      text, name, 1 << 20, size_text));
    }
    for (const auto& [n, s] : dims) {
      if (n == name) {
        throw InvalidArgument(fmt::format("--mesh '{}': dimension '{}' appears twice", text, name));
      }
    }
    dims.emplace_back(name, static_cast<int>(size));
    pos = comma + 1;
  }
  return dims;
}

std::string outputs_json_line(int rank, const std::vector<Tensor>& outputs) {
  std::string s = fmt::format("{{\"rank\": {}, \"outputs\": [", rank);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const Tensor& t = outputs[i];
    if (i) s += ", ";
    s += fmt::format("{{\"dtype\": \"{}\", \"shape\": [{}], \"digest\": \"{}\"",
                     dtype_name(t.dtype()), fmt::join(t.sizes(), ", "), tensor_digest(t));
    if (t.numel() <= kMaxDataElements) {
      s += ", \"data\": [";
      auto put_float = [&](double v, const char* format) {
        if (std::isnan(v)) {
          s += "\"nan\"";
        } else if (std::isinf(v)) {
          s += v > 0 ? "\"inf\"" : "\"-inf\"";
        } else if (v == 0 && std::signbit(v)) {
          s += "-0.0";  // JSON readers take -0 for the integer 0 and lose the sign
        } else {
          char buf[40];
          std::snprintf(buf, sizeof buf, format, v);
          s += buf;
        }
      };
      const int64_t n = t.numel();
      if (t.dtype() == DType::F64) {
        const auto v = t.to_vector<double>();
        for (int64_t k = 0; k < n; ++k) {
          if (k) s += ", ";
          put_float(v[k], "%.17g");
        }
      } else if (is_floating(t.dtype())) {
        const auto v = t.to_vector<float>();
        for (int64_t k = 0; k < n; ++k) {
          if (k) s += ", ";
          put_float(static_cast<double>(v[k]), "%.9g");
        }
      } else if (t.dtype() == DType::Bool) {
        const auto v = t.to_vector<int64_t>();
        for (int64_t k = 0; k < n; ++k) s += (k ? ", " : "") + std::string(v[k] ? "true" : "false");
      } else {
        const auto v = t.to_vector<int64_t>();
        for (int64_t k = 0; k < n; ++k) s += fmt::format("{}{}", k ? ", " : "", v[k]);
      }
      s += "]";
    }
    s += "}";
  }
  s += "]}";
  return s;
}

int run_command(const RunOptions& options, std::FILE* out, std::FILE* err) {
  try {
    return run_command_impl(options, out, err);
  } catch (...) {
    return print_command_error(err);
  }
}

void add_run_command(CLI::App& app) {
  CLI::App* sub = app.add_subcommand(
      "run", "run a graph on N ranks: generated inputs, collectives over a real backend");
  auto o = std::make_shared<RunOptions>();
  auto job = std::make_shared<JobFlags>();
  sub->add_option("file", o->file, "IR file ('-' reads standard input)")->required();
  CLI::Option* ranks = sub->add_option(
      "--ranks", o->ranks,
      "number of ranks (required unless this process is a rank of an mpirun or gloo job)");
  ranks->transform(
      decimal_integer(std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
  sub->add_option("--backend", o->backend,
                  "threads, mpi (starts mpirun) or gloo (starts processes, or with --rank joins "
                  "a job as one of them)")
      ->capture_default_str();
  add_job_flags(*sub, *job);
  sub->add_option("--mesh", o->mesh,
                  "device mesh over the ranks, e.g. dp=2,tp=2; its dim names are group names")
      ->check(given("NAME=SIZE[,NAME=SIZE...], e.g. dp=2,tp=2"));
  add_seed_option(*sub, o->seed, "seed of the generated inputs");
  sub->add_option("--outputs", o->outputs,
                  "'json': one line per rank with every output's dtype, shape, digest and data")
      ->check(given("'json'"));
  add_integer_option(*sub, "--iters", o->iters, "runs of the graph (outputs are the last run's)");
  // An empty value given is an error, not the option left out (an empty string means that).
  sub->add_option("--trace", o->trace,
                  "write a Chrome/Perfetto trace of every rank's compute and communication")
      ->check(given("a file name"));
  sub->add_option("--graph", o->graph, "the graph to run when FILE holds several")
      ->check(given("a graph name"));
  sub->callback([o, job, ranks]() {
    o->join = parse_job_flags(*job);
    o->ranks = resolve_ranks(o->backend, o->join,
                             ranks->count() > 0 ? std::optional<int>(o->ranks) : std::nullopt,
                             /*fallback=*/std::nullopt);
    const int rc = run_command(*o, stdout, stderr);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace funcol::tools
