// The funcol command's subcommands; each file adds one to the CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace funcol::tools {

// `funcol bench`: nccl-tests style collective micro-benchmarks (bench.cc).
void add_bench_command(CLI::App& app);

// `funcol run`: runs a graph on N ranks over a backend (run.cc).
void add_run_command(CLI::App& app);

// `funcol train`: trains an MLP with fully sharded data parallelism (train.cc).
void add_train_command(CLI::App& app);

// `funcol opt`: parses, verifies and transforms IR with a pass pipeline (opt.cc).
void add_opt_command(CLI::App& app);

// The last step of the funcol command, with its exit status: a rank of an mpirun job that
// funcol started and that failed (status != 0) tells its launcher so (launch.cc), which then
// knows that an error of a rank explains the job's end.
void note_rank_exit(int status);

// After a command line of run, train or bench that did not parse (`args`: what followed the
// command; `error`: the message, printed already). A rank of a gloo job started by hand
// (--backend gloo, and --rank, --world-size, --store or RANK, WORLD_SIZE, FUNCOL_STORE) joins
// the job and leaves it with that error, as a rank whose own checks fail does (launch.h,
// rank_checks_pass): its peers fail within about a second naming it, instead of waiting out the
// rendezvous. Does nothing for any other process, or when the joining flags do not read.
void leave_job_after_parse_error(const std::vector<std::string>& args, const std::string& error);

// The errno of the first failed write or flush of a command's output (ENOSPC, EPIPE), 0 while
// none failed: the funcol command's last flush finds the stream failed already, with no errno
// of its own (stdio drops what it could not write and keeps only an error flag), and says why
// from this. Atomic: mpi's launcher writes the ranks' output from a thread of its own.
inline std::atomic<int> output_errno{0};

inline void note_output_errno() {
  int none = 0;
  output_errno.compare_exchange_strong(none, errno);
}

// Flushes `out`, keeping the errno of a failure in output_errno. True when it flushed.
inline bool flush_output(std::FILE* out) {
  errno = 0;
  if (std::fflush(out) == 0) return true;
  note_output_errno();
  return false;
}

// Writes `text` to `out` and flushes it, keeping the errno of a failure in output_errno. True
// when all of it was written.
inline bool write_output(std::FILE* out, std::string_view text) {
  errno = 0;
  if (std::fwrite(text.data(), 1, text.size(), out) != text.size()) {
    note_output_errno();
    return false;
  }
  return flush_output(out);
}

}  // namespace funcol::tools
