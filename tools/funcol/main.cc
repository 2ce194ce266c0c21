// funcol: the command-line tool. Parses the subcommand and hands off to the tools library.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>

#include <CLI/CLI.hpp>

#include "tools/commands.h"
#include "funcol/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"funcol: functional collectives, their compiler and their backends"};
  app.require_subcommand(1);
  funcol::tools::add_bench_command(app);
  funcol::tools::add_run_command(app);
  funcol::tools::add_opt_command(app);
  funcol::tools::add_train_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const funcol::Error& e) {
    std::fprintf(stderr, "funcol: error: %s\n", e.what());
    return 1;
  }
  // Output that never arrived (a full disk, a closed pipe) is a failure, not a success.
  std::cout.flush();
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout) {
    std::fprintf(stderr, "funcol: error: cannot write the output: %s\n",
                 errno != 0 ? std::strerror(errno) : "write error");
    return 1;
  }
  return 0;
}
