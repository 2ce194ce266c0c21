// Tests of the process backends' option parsing: store URLs and integer variables.
#include "dist/multiprocess/process_env.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>

#include "funcol/core/error.h"

namespace funcol::process {
namespace {

TEST(StoreUrl, FileStoreNeedsAnAbsoluteDirectory) {
  auto u = parse_store_url("file:///tmp/store");
  EXPECT_EQ(u.kind, StoreUrl::Kind::File);
  EXPECT_EQ(u.path, "/tmp/store");
  EXPECT_THROW(parse_store_url("file://relative"), InvalidArgument);
}

// A path without a scheme is a directory: the same as file://DIR, made absolute.
TEST(StoreUrl, BareDirectoryIsAFileStore) {
  auto abs = parse_store_url("/tmp/store");
  EXPECT_EQ(abs.kind, StoreUrl::Kind::File);
  EXPECT_EQ(abs.path, "/tmp/store");
  EXPECT_EQ(abs.text, "/tmp/store");
  EXPECT_EQ(parse_store_url("/tmp/store/").path, "/tmp/store");
  const std::string cwd = std::filesystem::current_path().string();
  auto rel = parse_store_url("st");
  EXPECT_EQ(rel.kind, StoreUrl::Kind::File);
  EXPECT_EQ(rel.path, cwd + "/st");
  EXPECT_EQ(rel.text, "st");
  EXPECT_EQ(parse_store_url("./a/../st").path, cwd + "/st");
  // No "scheme://": a directory, even with a colon in its name.
  EXPECT_EQ(parse_store_url("host:6379").path, cwd + "/host:6379");
}

TEST(StoreUrl, RedisHostAndPort) {
  auto u = parse_store_url("redis://10.0.0.2:7000");
  EXPECT_EQ(u.kind, StoreUrl::Kind::Redis);
  EXPECT_EQ(u.host, "10.0.0.2");
  EXPECT_EQ(u.port, 7000);
  auto d = parse_store_url("redis://localhost");
  EXPECT_EQ(d.host, "localhost");
  EXPECT_EQ(d.port, 6379);
  auto v6 = parse_store_url("redis://[::1]:7001");
  EXPECT_EQ(v6.host, "::1");
  EXPECT_EQ(v6.port, 7001);
}

TEST(StoreUrl, BadUrlsNameTheValue) {
  for (const char* bad : {"", "tcp://x:1", "ftp://x", "redis://", "redis://h:0", "redis://h:70000",
                          "redis://h:x", "file://relative", "redis:/x", "redis:h:1",
                          "file:/tmp/st"}) {
    try {
      parse_store_url(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos)
          << e.what();
    }
  }
}

// Bare directories aside, a scheme other than file:// and redis:// and the empty string stay
// errors that say why.
TEST(StoreUrl, UnknownSchemeAndEmptyAreErrors) {
  auto message = [](const std::string& url) {
    try {
      parse_store_url(url);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message("ftp://x"),
            "invalid store 'ftp://x': unknown scheme (expected a directory, file:///dir or "
            "redis://host:port)");
  EXPECT_EQ(message(""),
            "invalid store '': empty (expected a directory, file:///dir or redis://host:port)");
  EXPECT_EQ(message("redis:/h"),
            "invalid store 'redis:/h': 'redis:' must be followed by // (expected a directory, "
            "file:///dir or redis://host:port)");
}

TEST(EnvInt, UnsetParsedAndMalformed) {
  ::unsetenv("FUNCOL_TEST_ENV_INT");
  EXPECT_FALSE(env_int("FUNCOL_TEST_ENV_INT"));
  ::setenv("FUNCOL_TEST_ENV_INT", "12", 1);
  EXPECT_EQ(env_int("FUNCOL_TEST_ENV_INT"), 12);
  ::setenv("FUNCOL_TEST_ENV_INT", "1x", 1);
  EXPECT_THROW(env_int("FUNCOL_TEST_ENV_INT"), InvalidArgument);
  ::unsetenv("FUNCOL_TEST_ENV_INT");
}

// A launcher's pid that is not one is an error naming the variable, before anything is watched
// (a rank would otherwise follow pid 0, its own process group, or nothing).
TEST(FollowLauncher, RefusesValuesThatAreNotPids) {
  for (const char* var : {kLauncherPidVar, kMpiLauncherPidVar}) {
    for (const char* value : {"abc", "0", "-7"}) {
      ::setenv(var, value, 1);
      try {
        follow_launcher();
        ADD_FAILURE() << var << "=" << value << " was accepted";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(var), std::string::npos) << e.what();
      }
      ::unsetenv(var);
    }
  }
}

TEST(DebugDetail, CaseInsensitive) {
  ::setenv("FUNCOL_DEBUG", "DETAIL", 1);
  EXPECT_TRUE(debug_detail());
  ::setenv("FUNCOL_DEBUG", "info", 1);
  EXPECT_FALSE(debug_detail());
  ::setenv("FUNCOL_DEBUG", "Off", 1);
  EXPECT_FALSE(debug_detail());
  ::unsetenv("FUNCOL_DEBUG");
  EXPECT_FALSE(debug_detail());
}

// A misspelled value would quietly leave the checks it asks for off.
TEST(DebugDetail, RefusesOtherValues) {
  ::setenv("FUNCOL_DEBUG", "details", 1);
  try {
    debug_detail();
    ADD_FAILURE() << "FUNCOL_DEBUG=details was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(),
                 "environment variable FUNCOL_DEBUG='details' is not one of OFF, INFO, DETAIL");
  }
  ::unsetenv("FUNCOL_DEBUG");
}

// A process of this machine tells whether another one still runs from its identity: running,
// then a zombie, then reaped. Identities from another machine or namespace, or malformed, are
// unknown (nullopt), never ended.
TEST(ProcessIdentity, AProcessIsAliveUntilItEnds) {
  const std::string mine = process_identity();
  if (!std::filesystem::exists("/proc/self/stat")) GTEST_SKIP() << "no /proc on this machine";
  ASSERT_FALSE(mine.empty());
  EXPECT_EQ(std::count(mine.begin(), mine.end(), '/'), 5) << mine;
  EXPECT_EQ(mine.find(' '), std::string::npos) << mine;
  EXPECT_EQ(process_running(mine), std::optional<bool>(true));
  EXPECT_TRUE(process_live(getpid()));

  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    const std::string id = process_identity();
    (void)!write(to_parent[1], id.data(), id.size());
    close(to_parent[1]);
    char go = 0;
    (void)!read(to_child[0], &go, 1);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  std::string theirs;
  char buf[256];
  for (ssize_t n; (n = read(to_parent[0], buf, sizeof buf)) > 0;) theirs.append(buf, n);
  close(to_parent[0]);
  ASSERT_FALSE(theirs.empty());
  EXPECT_NE(theirs, mine);
  EXPECT_EQ(process_running(theirs), std::optional<bool>(true));  // waiting for the go
  EXPECT_TRUE(process_live(child));
  close(to_child[1]);                   // go: it exits, a zombie until reaped
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (process_running(theirs) != std::optional<bool>(false) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(process_running(theirs), std::optional<bool>(false));  // a zombie
  EXPECT_FALSE(process_live(child));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_EQ(process_running(theirs), std::optional<bool>(false));  // gone
  EXPECT_FALSE(process_live(child));

  // Another machine, another start time of the same pid (a pid taken again), nonsense.
  EXPECT_EQ(process_running("x" + mine), std::nullopt);
  const std::string reused = mine.substr(0, mine.rfind('/') + 1) + "1";
  EXPECT_EQ(process_running(reused), std::optional<bool>(false));
  EXPECT_EQ(process_running(""), std::nullopt);
  EXPECT_EQ(process_running("garbage"), std::nullopt);
  EXPECT_EQ(process_running(mine.substr(0, mine.rfind('/') + 1)), std::nullopt);  // no start
}

}  // namespace
}  // namespace funcol::process
