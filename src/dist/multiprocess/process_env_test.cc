// Tests of the process backends' option parsing: store URLs and integer variables.
#include "dist/multiprocess/process_env.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "funcol/core/error.h"

namespace funcol::process {
namespace {

TEST(StoreUrl, FileStoreNeedsAnAbsoluteDirectory) {
  auto u = parse_store_url("file:///tmp/store");
  EXPECT_EQ(u.kind, StoreUrl::Kind::File);
  EXPECT_EQ(u.path, "/tmp/store");
  EXPECT_THROW(parse_store_url("file://relative"), InvalidArgument);
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
  for (const char* bad :
       {"", "tcp://x:1", "redis://", "redis://h:0", "redis://h:70000", "redis://h:x"}) {
    try {
      parse_store_url(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos)
          << e.what();
    }
  }
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

TEST(DebugDetail, CaseInsensitive) {
  ::setenv("FUNCOL_DEBUG", "DETAIL", 1);
  EXPECT_TRUE(debug_detail());
  ::setenv("FUNCOL_DEBUG", "info", 1);
  EXPECT_FALSE(debug_detail());
  ::unsetenv("FUNCOL_DEBUG");
  EXPECT_FALSE(debug_detail());
}

}  // namespace
}  // namespace funcol::process
