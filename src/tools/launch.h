// Process jobs of the funcol command (mpi, gloo): starting one, and joining one as a rank.
#pragma once

#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

#include "funcol/core/error.h"
#include "funcol/dist/backend.h"

namespace funcol {
class ProcessGroup;
}

namespace funcol::tools {

// Throws InvalidArgument unless `backend` is threads, mpi or gloo and compiled into this build
// ("backend 'mpi' is not compiled into this build (configure with -DFUNCOL_WITH_MPI=ON); ...").
void check_backend_option(const std::string& backend);

// True when this process is a rank of a `backend` job: mpi when mpirun started it
// (OMPI_COMM_WORLD_SIZE is set), gloo when RANK and WORLD_SIZE are set.
bool inside_job(const std::string& backend);

// True unless `bytes_per_rank` on every rank this machine holds (all `ranks` on the threads
// backend and in a gloo job funcol started; an mpi or other gloo job's local ranks as its
// launcher says, else one) is more than this machine's physical memory (or the memory limit of
// the process's cgroup, a container's, when that is smaller). Allocations under the
// RAM size succeed and fail only when written, as an out-of-memory kill, so the tools check
// what they are about to write first. True when the memory size is unknown.
bool fits_in_memory(const std::string& backend, int ranks, double bytes_per_rank);
// The same for `ranks_here` ranks.
bool fits_in_memory(int ranks_here, double bytes_per_rank);

// ---- Joining a gloo job as one of its ranks: --rank, --world-size, --store (DESIGN §3) ----
// funcol run, train and bench take these flags; with --backend gloo they make the process one
// rank of a job that someone else starts (on this host or many), instead of starting one.

// The three flags as typed (parsed by parse_job_flags, so a bad value is a funcol error).
struct JobFlags {
  std::string rank;        // --rank R
  std::string world_size;  // --world-size N
  std::string store;       // --store DIR|file:///DIR|redis://HOST:PORT
};

// Adds --rank, --world-size and --store to a command, writing into `flags`.
void add_job_flags(CLI::App& command, JobFlags& flags);
// Adds --seed (an unsigned 64-bit seed in decimal; "-1" is an error, not 2^64 - 1).
void add_seed_option(CLI::App& command, uint64_t& seed, const std::string& description);
// For integer options (->transform(decimal_integer(min, max))): accepts decimal digits with an
// optional '-' and rewrites them without leading zeros, as CLI11 alone reads 010 as octal 8 and
// 0x10 as 16; a value outside [min, max] (the option's type's range) is an error that names it.
CLI::Validator decimal_integer(int64_t min, uint64_t max);
// For floating-point options: a decimal number, all of the text ("1e-3", not "abc" or "1x").
CLI::Validator decimal_number();
// For string options whose empty value would read as the option left out: "" given is an
// error, "expected WHAT, got ''".
CLI::Validator given(const std::string& what);
// Adds an integer option read through decimal_integer() over T's range, its default shown in
// --help.
template <typename T>
CLI::Option* add_integer_option(CLI::App& command, const std::string& name, T& value,
                                const std::string& description) {
  static_assert(std::is_integral_v<T>);
  return command.add_option(name, value, description)
      ->transform(decimal_integer(static_cast<int64_t>(std::numeric_limits<T>::min()),
                                  static_cast<uint64_t>(std::numeric_limits<T>::max())))
      ->capture_default_str();
}

// The InitOptions the flags name (-1 and "" for those not given). Throws InvalidArgument naming
// the flag when --rank is not an integer >= 0 or --world-size not one >= 1.
InitOptions parse_job_flags(const JobFlags& flags);

// inside_job, given the flags: gloo when rank and world size each come from `join` or from
// RANK / WORLD_SIZE (the flags override the variables); mpi as inside_job(backend); threads
// never.
bool inside_job(const std::string& backend, const InitOptions& join);

// How many ranks of a `ranks`-rank job a tool run with these flags holds on this machine: as
// fits_in_memory inside a job, and all of them outside one (funcol starts the job here).
int ranks_on_this_machine(const std::string& backend, int ranks, const InitOptions& join);

// The world size of the job this process joins, when known before it joins: `join`'s or
// WORLD_SIZE (gloo), OMPI_COMM_WORLD_SIZE (mpi); nullopt when it joins none.
std::optional<int> job_world_size(const std::string& backend, const InitOptions& join);

// A command's number of ranks: --ranks when typed (`typed`), else the world size of the job this
// process joins, else `fallback`. Throws InvalidArgument "--ranks is required ..." when none,
// and first, when the flags do not fit the backend (as check_job_options).
int resolve_ranks(const std::string& backend, const InitOptions& join, std::optional<int> typed,
                  std::optional<int> fallback);

// Throws InvalidArgument when `join` (the flags) does not make sense for `backend` and `ranks`:
// any of them with threads or mpi; with threads, more ranks than kMaxLocalRanks; with gloo,
// --rank without a world size (--world-size or WORLD_SIZE), --world-size without a rank,
// --store with neither (funcol starts the job and its store then), a rank out of range, no
// store for a world of more than one, a store that does not parse, and --ranks other than the
// world size. Environment values that are not integers are errors naming the variable.
void check_job_options(const std::string& backend, const InitOptions& join, int ranks);

// How to start a job.
struct JobOptions {
  std::string backend;                  // "mpi" or "gloo"
  int ranks = 0;                        // processes to start
  std::string temp_prefix = "funcol-";  // name prefix of the job's temporary directory
  // The arguments every rank process gets after the executable's path, given the job's
  // temporary directory (which lives until every rank has ended; a command may write files the
  // ranks read there). Runs after the directory exists and before any rank starts.
  std::function<std::vector<std::string>(const std::string& dir)> rank_args;
};

// The most processes launch_job starts on one host: each gloo rank connects to every other, so
// a mistyped --ranks (5000) would otherwise fork thousands of processes before anything fails.
inline constexpr int kMaxLaunchedRanks = 512;
// Throws InvalidArgument naming that limit when `ranks` is over it (launch_job checks it too;
// commands call it first when they launch, before errors a job of that size would also have).
void check_launched_ranks(int ranks);

// Starts `ranks` processes of this executable as one job and waits for them. mpi: under
// `mpirun -np N --oversubscribe` (plus --allow-run-as-root when root); the ranks' output goes
// through mpirun, whose stdout this process copies to its own (so a write that fails there sets
// ferror(stdout) as on the other backends: mpirun itself ignores such failures). gloo: N
// processes with RANK, WORLD_SIZE and a file store in the temporary directory
// (FUNCOL_STORE=file://DIR/store); their stdout is this process's, their stderr is
// kept until the end. The first rank to fail stops the others; its stderr is printed to `err`
// (with "funcol: error: rank R was killed by signal ..." when it died or said nothing); on
// success the ranks' stderr is passed on in rank order. A SIGINT, SIGTERM or SIGHUP stops every
// rank. Returns the exit status: 0 when every rank succeeded, 1 when one failed, 128 + N when
// signal N stopped the job. Throws Error when a process cannot be started (mpirun missing).
int launch_job(const JobOptions& options, std::FILE* err);

// The file a --trace flag names ("" : none). Constructing it checks that it can be written,
// before anything runs, and throws InvalidArgument "cannot write trace file P: why". When the
// check created the file and the run then fails (keep() never called), the destructor removes
// it again, so a failed run leaves no empty trace behind.
class TraceFile {
 public:
  explicit TraceFile(std::string path);
  ~TraceFile();
  TraceFile(const TraceFile&) = delete;
  TraceFile& operator=(const TraceFile&) = delete;
  // The run succeeded: the file stays.
  void keep() { kept_ = true; }
  // The file when the check created it (a failed run removes it), else "".
  std::string created() const { return created_ ? path_ : std::string(); }

 private:
  std::string path_;
  bool created_ = false;
  bool kept_ = false;
};
// Writes `text` to `path`, replacing it; throws InvalidArgument "cannot write WHAT P: why"
// (`what`: "trace file", ...).
void write_file(const std::string& path, const std::string& text, std::string_view what);

// Runs `body` as this process's rank of a `backend` job that must have `ranks` processes:
// follows the launcher, joins the job (init_process_group with `join`: --rank, --world-size,
// --store; unset fields come from the environment), checks its size, runs body(world).
// A failure is printed to `err` as "funcol: error: rank R: ..." and gives exit status 1. The
// process group is torn down before returning (mpi frees communicators before MPI_Finalize).
int run_as_rank(const std::string& backend, int ranks, const InitOptions& join, std::FILE* err,
                const std::function<void(ProcessGroup& world)>& body);

// For a process that is one rank of a job, before it joins: checks how it joins
// (check_job_options: an error there is thrown, as the job cannot be joined), then runs
// `checks`, this rank's own checks of its flags, files and memory. A rank that failed those
// alone (a file missing on its host, less memory there, a flag only it was given) used to
// leave its peers waiting at the rendezvous until the timeout; so it prints its error at once
// ("funcol: error: rank R: ..."), then joins the job and leaves it with that error, which its
// peers' errors name within about a second. Returns whether the checks passed (false: exit
// status 1).
bool rank_checks_pass(const std::string& backend, int ranks, const InitOptions& join,
                      std::FILE* err, const std::function<void()>& checks);

// All-gathers one string per rank over `world`: every rank gets every rank's, in rank order.
std::vector<std::string> gather_strings(ProcessGroup& world, const std::string& mine);

// The first collective of a rank of a job that funcol did not start (ranks started by hand,
// or by a user's mpirun): `flags` (what this rank was given that every rank must share, as
// typed) is compared with every rank's, and a difference is one InvalidArgument on every rank,
// "the ranks were started with different flags: rank 0 has '...' but rank R has '...' (every
// rank of a job must pass the same WHICH)", instead of collectives that do not pair.
void check_same_flags(ProcessGroup& world, const std::vector<std::string>& flags,
                      std::string_view which);

// Rethrows the exception in flight with "rank R: " in front, keeping funcol's error kinds and
// locations (rethrow_prefixed).
[[noreturn]] void rethrow_for_rank(int rank);
// Inside a catch block: records the exception being handled as this process's departure error
// (set_departure_error), so that its peers' errors name it.
void note_departure_error();

// How the command prints an error: "FILE:LINE:COL: error: MESSAGE" for one located in IR text
// (SourceLocated), else "funcol: error: MESSAGE"; MESSAGE starts with `prefix` (once).
std::string error_line(const Error& e, const std::string& prefix = "");

// Prints the exception in flight as a command's one error line ("funcol: error: ..."; a
// ParseError as its FILE:LINE:COL line), its message starting with `prefix`, to `err` and
// returns the exit status 1.
int print_command_error(std::FILE* err, const std::string& prefix = "");

}  // namespace funcol::tools
