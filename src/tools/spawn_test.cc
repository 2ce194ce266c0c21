// Tests of the process utilities behind the mpi/gloo launchers of `funcol run`.
#include "tools/spawn.h"

#include <signal.h>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "funcol/core/error.h"

namespace funcol::tools {
namespace {

SpawnOptions command(std::vector<std::string> argv) {
  SpawnOptions s;
  s.argv = std::move(argv);
  return s;
}

TEST(Spawn, ExitStatusesAndEnvironment) {
  TempDir dir("funcol-spawn-test-");
  SpawnOptions s;
  s.argv = {"sh", "-c", "echo $FUNCOL_SPAWN_TEST; echo oops >&2; exit 3"};
  s.env = {{"FUNCOL_SPAWN_TEST", "hello"}};
  s.stdout_path = dir.path() + "/out";
  s.stderr_path = dir.path() + "/err";
  const pid_t pid = spawn_process(s);
  const auto st = wait_all({pid});
  ASSERT_EQ(st.size(), 1u);
  EXPECT_FALSE(st[0].ok());
  EXPECT_FALSE(st[0].signaled);
  EXPECT_EQ(st[0].code, 3);
  EXPECT_EQ(st[0].describe(), "exited with status 3");
  std::ifstream out(s.stdout_path), err(s.stderr_path);
  std::string line;
  std::getline(out, line);
  EXPECT_EQ(line, "hello");
  std::getline(err, line);
  EXPECT_EQ(line, "oops");
}

TEST(Spawn, FirstFailureStopsTheOthers) {
  // Two long sleepers and one child that fails at once: the sleepers are terminated, so this
  // returns long before they would end.
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<pid_t> pids;
  for (const char* cmd : {"sleep 60", "exit 7", "sleep 60"}) {
    pids.push_back(spawn_process(command({"sh", "-c", cmd})));
  }
  const auto st = wait_all(pids, std::chrono::seconds(5));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  ASSERT_EQ(st.size(), 3u);
  EXPECT_EQ(st[0].pid, pids[1]);  // the first to end is the failure
  EXPECT_EQ(st[0].code, 7);
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_TRUE(st[i].signaled);
    EXPECT_EQ(st[i].code, SIGTERM);
    EXPECT_NE(st[i].describe().find("was killed by signal 15"), std::string::npos);
  }
}

// A stopped child (SIGSTOP, Ctrl-Z) is continued with its SIGTERM: it ends at once rather than
// at the SIGKILL after the grace period (a launcher printed its failed job's error that late).
TEST(Spawn, AStoppedChildIsStoppedAtOnceToo) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<pid_t> pids;
  pids.push_back(spawn_process(command({"sleep", "60"})));
  ASSERT_EQ(kill(pids[0], SIGSTOP), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pids[0], &status, WUNTRACED), pids[0]);  // stopped, not reaped
  ASSERT_TRUE(WIFSTOPPED(status));
  pids.push_back(spawn_process(command({"sh", "-c", "exit 7"})));
  const auto st = wait_all(pids, std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(st[0].code, 7);
  EXPECT_TRUE(st[1].signaled);
  EXPECT_EQ(st[1].code, SIGTERM);
}

// any_failed sees a failed child without reaping it (wait_all still gets its status), and looks
// past children that ended well.
TEST(Spawn, AnyFailedSeesAFailureWithoutReapingIt) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<pid_t> pids;
  pids.push_back(spawn_process(command({"true"})));
  pids.push_back(spawn_process(command({"sleep", "60"})));
  while (true) {  // until `true` ended (well); the sleeper runs
    siginfo_t info{};
    waitid(P_PID, static_cast<id_t>(pids[0]), &info, WEXITED | WNOHANG | WNOWAIT);
    if (info.si_pid == pids[0]) break;
    ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_FALSE(any_failed(pids));
  pids.push_back(spawn_process(command({"sh", "-c", "exit 5"})));
  while (!any_failed(pids)) {
    ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const auto st = wait_all(pids, std::chrono::seconds(5));
  ASSERT_EQ(st.size(), 3u);
  int failures = 0;
  for (const ExitStatus& e : st) {
    if (e.pid == pids[2]) {
      EXPECT_EQ(e.code, 5);  // reaped by wait_all, not before
      ++failures;
    }
  }
  EXPECT_EQ(failures, 1);
}

// Whether process `pid` ignores `sig` (/proc's SigIgn mask).
bool ignores(pid_t pid, int sig) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("SigIgn:", 0) == 0) {
      return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
    }
  }
  ADD_FAILURE() << "no SigIgn line for pid " << pid;
  return false;
}

// A child of a group of its own ignores SIGTTOU (with `stty tostop` its first write to the
// terminal, whose foreground group it is not in, stopped it for good); one in our group does
// not (the terminal's job control treats it as ours). wait_all stops both kinds.
TEST(Spawn, ProcessGroupsAndTheTerminal) {
  struct sigaction ours {};
  ASSERT_EQ(sigaction(SIGTTOU, nullptr, &ours), 0);
  if (ours.sa_handler == SIG_IGN) {
    GTEST_SKIP() << "this test process ignores SIGTTOU: a child in its group would too";
  }
  std::vector<pid_t> pids;
  pids.push_back(spawn_process(command({"sleep", "60"})));
  SpawnOptions shared = command({"sleep", "60"});
  shared.own_process_group = false;
  pids.push_back(spawn_process(shared));
  struct sigaction after {};
  ASSERT_EQ(sigaction(SIGTTOU, nullptr, &after), 0);
  EXPECT_EQ(after.sa_handler, ours.sa_handler);  // ours as it was
  EXPECT_EQ(getpgid(pids[0]), pids[0]);
  EXPECT_EQ(getpgid(pids[1]), getpgid(0));
  // After exec: /proc shows the program's dispositions once sleep runs.
  const auto t0 = std::chrono::steady_clock::now();
  for (pid_t pid : pids) {
    while (std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/exe").filename() !=
           "sleep") {
      ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  EXPECT_TRUE(ignores(pids[0], SIGTTOU));
  EXPECT_FALSE(ignores(pids[1], SIGTTOU));
  pids.push_back(spawn_process(command({"sh", "-c", "exit 7"})));
  const auto st = wait_all(pids, std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  ASSERT_EQ(st.size(), 3u);
  EXPECT_EQ(st[0].code, 7);
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_TRUE(st[i].signaled);
    EXPECT_EQ(st[i].code, SIGTERM);
  }
}

// A signal ignored when the scope begins (nohup's SIGHUP) stays ignored: the launcher under
// nohup survived its terminal only on the threads backend. The others are recorded.
TEST(InterruptScopeTest, IgnoredSignalsStayIgnored) {
  struct sigaction ignore {}, before {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(sigaction(SIGHUP, &ignore, &before), 0);
  {
    InterruptScope scope;
    raise(SIGHUP);
    EXPECT_EQ(InterruptScope::signal(), 0);
    raise(SIGTERM);
    EXPECT_EQ(InterruptScope::signal(), SIGTERM);
  }
  struct sigaction now {};
  ASSERT_EQ(sigaction(SIGHUP, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_IGN);
  ASSERT_EQ(sigaction(SIGHUP, &before, nullptr), 0);
}

// A launcher that ignores SIGTERM (started so) still stops its children with it: they start
// with SIGTERM's default action.
TEST(Spawn, ChildrenTakeSigtermEvenWhereWeIgnoreIt) {
  struct sigaction ignore {}, before {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ASSERT_EQ(sigaction(SIGTERM, &ignore, &before), 0);
  std::vector<pid_t> pids;
  pids.push_back(spawn_process(command({"sleep", "60"})));
  SpawnOptions shared = command({"sleep", "60"});
  shared.own_process_group = false;
  pids.push_back(spawn_process(shared));
  ASSERT_EQ(sigaction(SIGTERM, &before, nullptr), 0);
  pids.push_back(spawn_process(command({"sh", "-c", "exit 7"})));
  const auto t0 = std::chrono::steady_clock::now();
  const auto st = wait_all(pids, std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  ASSERT_EQ(st.size(), 3u);
  for (size_t i = 1; i < 3; ++i) {
    EXPECT_TRUE(st[i].signaled);
    EXPECT_EQ(st[i].code, SIGTERM);
  }
}

TEST(Spawn, SuccessWaitsForEveryone) {
  std::vector<pid_t> pids;
  for (int i = 0; i < 3; ++i) pids.push_back(spawn_process(command({"true"})));
  const auto st = wait_all(pids);
  ASSERT_EQ(st.size(), 3u);
  for (const ExitStatus& s : st) EXPECT_TRUE(s.ok());
}

TEST(Spawn, MissingProgramIsAnError) {
  try {
    spawn_process(command({"funcol-no-such-program"}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot start funcol-no-such-program"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(spawn_process(SpawnOptions{}), InvalidArgument);
}

TEST(TempDirTest, RemovedWithItsContents) {
  std::string path;
  {
    TempDir dir("funcol-tempdir-test-");
    path = dir.path();
    std::filesystem::create_directory(path + "/sub");
    std::ofstream(path + "/sub/file") << "x";
    EXPECT_TRUE(std::filesystem::exists(path + "/sub/file"));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(SelfExecutable, IsAnAbsolutePath) {
  const std::string self = self_executable();
  EXPECT_EQ(self.front(), '/');
  EXPECT_TRUE(std::filesystem::exists(self));
}

}  // namespace
}  // namespace funcol::tools
