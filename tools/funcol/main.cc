// funcol: the command-line tool. Parses the subcommand and hands off to the tools library.
#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tools/commands.h"
#include "funcol/core/error.h"

namespace {

// Output that never arrived (a full disk, a closed pipe) is a failure, not a success.
// `error`: the errno of a write that failed before (0: none seen).
int finish(int status, int error = 0) {
  // The failing write sets errno (ENOSPC, EPIPE): keep the first one.
  errno = 0;
  std::cout.flush();
  if (error == 0) error = errno;
  const bool flushed = std::fflush(stdout) == 0;
  if (error == 0) error = errno;
  // A command's own flush failed first and the stream kept only its error flag.
  if (error == 0) error = funcol::tools::output_errno;
  if (!flushed || std::ferror(stdout) || !std::cout) {
    std::fprintf(stderr, "funcol: error: cannot write the output: %s\n",
                 error != 0 ? std::strerror(error) : "write error");
    return 1;
  }
  return status;
}

// The command itself: its exit status.
int run_funcol(int argc, char** argv) {
  CLI::App app{"funcol: functional collectives, their compiler and their backends"};
  app.require_subcommand(1);
  // FUNCOL_VERSION is project(funcol VERSION ...) in the top-level CMakeLists.txt.
  app.set_version_flag("--version", "funcol " FUNCOL_VERSION);
  funcol::tools::add_bench_command(app);
  funcol::tools::add_run_command(app);
  funcol::tools::add_opt_command(app);
  funcol::tools::add_train_command(app);
  // A flag given twice is an error, as an option given twice is (`--stats --stats=false` said
  // nothing of the conflict: the last one won).
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    for (CLI::Option* option : sub->get_options()) {
      if (option->get_expected_min() == 0 && option != sub->get_help_ptr()) {
        option->multi_option_policy(CLI::MultiOptionPolicy::Throw);
      }
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Help, and a command's own failure (it printed its error and chose the status).
    if (e.get_exit_code() == 0) {
      errno = 0;  // --version flushes its line itself
      const int status = app.exit(e);
      return finish(status, errno);
    }
    if (dynamic_cast<const CLI::RuntimeError*>(&e) != nullptr) return app.exit(e);
    // A command line that does not parse is an error like every other ("funcol: error: ...",
    // exit status 1), not CLI11's own message and codes (104-115).
    std::string what = e.what();
    // An option given more often than it may be: CLI11 says "--graph: At Most 1 required but
    // received 2".
    const std::string at_most = ": At Most 1 required but received ";
    if (const size_t at = what.find(at_most); at != std::string::npos) {
      what = what.substr(0, at) + ": given " + what.substr(at + at_most.size()) +
             " times; give it once";
    }
    // Messages start in lower case, as every other error; CLI11 capitalises its sentences
    // ("A subcommand is required"), not acronyms.
    if (what.size() > 1 && std::isupper(static_cast<unsigned char>(what[0])) &&
        (std::islower(static_cast<unsigned char>(what[1])) || what[1] == ' ')) {
      what[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(what[0])));
    }
    std::string command = "funcol";
    const std::string unexpected = "the following argument was not expected: ";
    if (argc > 1 && argv[1][0] == '-') {
      // Before the command only --help and --version are options; CLI11 takes an unknown one
      // for an argument of the command that follows, or says the command is missing.
      what = unexpected + funcol::printable(argv[1]);
    } else if (!app.get_subcommands().empty()) {
      const CLI::App* sub = app.get_subcommands().front();
      command += " " + sub->get_name();
      // CLI11 checks required arguments before unexpected ones: "funcol opt --frob" would say
      // the file is missing, not that --frob is unknown.
      for (const std::string& arg : sub->remaining()) {
        if (arg.size() > 1 && arg[0] == '-') {
          what = unexpected + funcol::printable(arg);
          break;
        }
      }
    } else if (argc > 1) {
      what = "unknown command '" + funcol::printable(argv[1]) +
             "' (commands: bench, opt, run, train)";
    }
    std::fprintf(stderr, "funcol: error: %s\nRun '%s --help' for more information.\n",
                 what.c_str(), command.c_str());
    if (command == "funcol run" || command == "funcol train" || command == "funcol bench") {
      std::fflush(stderr);
      funcol::tools::leave_job_after_parse_error(std::vector<std::string>(argv + 2, argv + argc),
                                                 what);
    }
    return 1;
  } catch (const funcol::Error& e) {
    std::fprintf(stderr, "funcol: error: %s\n", e.what());
    return 1;
  }
  return finish(0);
}

}  // namespace

// A standard descriptor the command was started without (`>&-`) is reserved with /dev/null
// opened the other way round, so that its writes (reads) still fail as on a closed descriptor,
// and no file the command opens later takes its number: the launcher's own files and pipes took
// descriptor 1, and the ranks' output went into them, "written" with exit status 0.
void reserve_standard_descriptors() {
  for (int fd = STDIN_FILENO; fd <= STDERR_FILENO; ++fd) {
    if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int got = open("/dev/null", fd == STDIN_FILENO ? O_WRONLY : O_RDONLY);
    if (got >= 0 && got != fd) {
      dup2(got, fd);
      close(got);
    }
  }
}

int main(int argc, char** argv) {
  reserve_standard_descriptors();
  const int status = run_funcol(argc, argv);
  funcol::tools::note_rank_exit(status);
  return status;
}
