// Tests of `funcol run` in-process (threads backend): results against hand-computed values,
// meshes, traces, iterations, output formatting and every user error.
#include "tools/run.h"

#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/runtime/executor.h"
#include "tools/launch.h"
#include "tools/spawn.h"

namespace funcol::tools {
namespace {

using nlohmann::json;

struct Captured {
  int status = -1;
  std::string out;
  std::string err;
};

// Runs the command with stdout and stderr captured in memory.
Captured run(const RunOptions& o) {
  Captured c;
  char* out_buf = nullptr;
  char* err_buf = nullptr;
  size_t out_len = 0, err_len = 0;
  std::FILE* out = open_memstream(&out_buf, &out_len);
  std::FILE* err = open_memstream(&err_buf, &err_len);
  c.status = run_command(o, out, err);
  std::fclose(out);
  std::fclose(err);
  c.out.assign(out_buf, out_len);
  c.err.assign(err_buf, err_len);
  std::free(out_buf);
  std::free(err_buf);
  return c;
}

class RunTest : public ::testing::Test {
 protected:
  TempDir dir_{"funcol-run-test-"};

  std::string write(const std::string& name, const std::string& text) {
    const std::string path = dir_.path() + "/" + name;
    std::ofstream(path) << text;
    return path;
  }

  static std::vector<json> lines(const std::string& out) {
    std::vector<json> v;
    std::istringstream in(out);
    std::string line;
    while (std::getline(in, line)) v.push_back(json::parse(line));
    return v;
  }
};

const char* const kAllReduce = R"(graph @sum(%x: i32[5], %y: f32[3]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : i32[5]
  %w = wait_tensor(%ar) : i32[5]
  %z = sub(%y, %y) : f32[3]
  return %w, %z
}
)";

TEST_F(RunTest, AllReduceSumMatchesHandComputedValuesOnEveryWorldSize) {
  const std::string file = write("sum.ir", kAllReduce);
  const auto graph = parse_graph(kAllReduce);
  for (int n : {1, 2, 4, 8}) {
    SCOPED_TRACE(n);
    RunOptions o;
    o.file = file;
    o.ranks = n;
    o.seed = 42;
    o.outputs = "json";
    const Captured c = run(o);
    ASSERT_EQ(c.status, 0) << c.err;
    EXPECT_EQ(c.err, "");
    // Expected: the sum over ranks of each rank's generated input (integers: exact).
    std::vector<int64_t> expect(5, 0);
    for (int r = 0; r < n; ++r) {
      const auto in = make_inputs(*graph, 42, r)[0].to_vector<int64_t>();
      for (int i = 0; i < 5; ++i) expect[i] += in[i];
    }
    const std::vector<json> ls = lines(c.out);
    ASSERT_EQ(ls.size(), static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(ls[r]["rank"], r);  // ordered by rank
      const json& out0 = ls[r]["outputs"][0];
      EXPECT_EQ(out0["dtype"], "i32");
      EXPECT_EQ(out0["shape"], json::array({5}));
      EXPECT_EQ(out0["data"].get<std::vector<int64_t>>(), expect);
      EXPECT_EQ(out0["digest"], ls[0]["outputs"][0]["digest"]);
      EXPECT_EQ(ls[r]["outputs"][1]["data"], json::array({0, 0, 0}));
    }
  }
}

TEST_F(RunTest, MeshDimensionsAreGroups) {
  const std::string text = R"(graph @mesh(%x: i64[2]) {
  %tp = all_reduce(%x) {reduce_op = "sum", group = "tp"} : i64[2]
  %dp = all_gather_into_tensor(%x) {group_size = 2, group = "dp"} : i64[4]
  %w1 = wait_tensor(%tp) : i64[2]
  %w2 = wait_tensor(%dp) : i64[4]
  return %w1, %w2
}
)";
  const auto graph = parse_graph(text);
  RunOptions o;
  o.file = write("mesh.ir", text);
  o.ranks = 4;
  o.mesh = "dp=2,tp=2";
  o.outputs = "json";
  const Captured c = run(o);
  ASSERT_EQ(c.status, 0) << c.err;
  auto in = [&](int r) { return make_inputs(*graph, 0, r)[0].to_vector<int64_t>(); };
  const std::vector<json> ls = lines(c.out);
  ASSERT_EQ(ls.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    // Row-major 2x2 mesh: tp partner r^1, dp partner r^2.
    const int tp0 = r & ~1, dp0 = r & 1;
    std::vector<int64_t> tp = {in(tp0)[0] + in(tp0 + 1)[0], in(tp0)[1] + in(tp0 + 1)[1]};
    std::vector<int64_t> dp = {in(dp0)[0], in(dp0)[1], in(dp0 + 2)[0], in(dp0 + 2)[1]};
    EXPECT_EQ(ls[r]["outputs"][0]["data"].get<std::vector<int64_t>>(), tp) << r;
    EXPECT_EQ(ls[r]["outputs"][1]["data"].get<std::vector<int64_t>>(), dp) << r;
  }
}

TEST_F(RunTest, TraceHasBothTracksForEveryRank) {
  RunOptions o;
  o.file = write("t.ir", R"(graph @t(%x: f32[64], %y: f32[64]) {
  %ag = all_gather_into_tensor(%x) {group_size = 2, group = "world"} : f32[128]
  %n = neg(%y) : f32[64]
  %w = wait_tensor(%ag) : f32[128]
  return %w, %n
}
)");
  o.ranks = 2;
  o.iters = 3;
  o.trace = dir_.path() + "/trace.json";
  const Captured c = run(o);
  ASSERT_EQ(c.status, 0) << c.err;
  EXPECT_NE(c.out.find("trace: " + o.trace), std::string::npos) << c.out;
  std::ifstream f(o.trace);
  const json trace = json::parse(f);
  std::map<int, std::set<int>> tracks;
  std::map<int, std::set<std::string>> names;
  int iterations = 0;
  for (const json& e : trace["traceEvents"]) {
    if (e["ph"] == "X") {
      tracks[e["pid"].get<int>()].insert(e["tid"].get<int>());
      iterations = std::max(iterations, e["args"]["iteration"].get<int>() + 1);
    }
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      names[e["pid"].get<int>()].insert(e["args"]["name"].get<std::string>());
    }
  }
  EXPECT_EQ(iterations, 3);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(tracks[r], (std::set<int>{0, 1})) << r;
    EXPECT_EQ(names[r], (std::set<std::string>{"compute", "communication"})) << r;
  }
}

TEST_F(RunTest, IterationsGiveTheSameOutputsAndASummaryWithoutJson) {
  RunOptions o;
  o.file = write("sum.ir", kAllReduce);
  o.ranks = 2;
  o.outputs = "json";
  const Captured one = run(o);
  o.iters = 3;
  const Captured three = run(o);
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_EQ(one.out, three.out);
  o.outputs.clear();
  const Captured human = run(o);
  ASSERT_EQ(human.status, 0) << human.err;
  EXPECT_NE(human.out.find("graph @sum: 3 nodes, 1 collective; "), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("2 ranks on threads; 3 iterations"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("rank 0: %w i32[5] digest "), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("rank 1: %w i32[5] digest "), std::string::npos) << human.out;
}

TEST_F(RunTest, SeedsChangeTheInputs) {
  RunOptions o;
  o.file = write("sum.ir", kAllReduce);
  o.ranks = 1;
  o.outputs = "json";
  const Captured a = run(o);
  o.seed = 1;
  const Captured b = run(o);
  EXPECT_NE(a.out, b.out);
}

TEST_F(RunTest, GraphSelection) {
  const std::string file = write("two.ir", R"(graph @a(%x: f32[2]) {
  return %x
}
graph @b(%x: f32[2]) {
  %n = neg(%x) : f32[2]
  return %n
}
)");
  RunOptions o;
  o.file = file;
  o.ranks = 1;
  Captured c = run(o);
  EXPECT_EQ(c.status, 1);
  EXPECT_EQ(c.err, "funcol: error: " + file + " holds 2 graphs (@a, @b); choose one with --graph\n");
  o.graph = "b";
  c = run(o);
  EXPECT_EQ(c.status, 0) << c.err;
  EXPECT_NE(c.out.find("graph @b: 1 node, 0 collectives; 1 rank on threads; 1 iteration, "), std::string::npos) << c.out;
  o.graph = "c";
  c = run(o);
  EXPECT_EQ(c.err, "funcol: error: " + file + " has no graph @c (graphs: @a, @b)\n");
}

struct ErrorCase {
  std::string name;
  std::string text;
  int ranks;
  std::string mesh;
  std::string expect;  // the whole stderr, with FILE for the file's path
};

TEST_F(RunTest, UserErrorsExitOneWithOneClearMessage) {
  const std::vector<ErrorCase> cases = {
      {"group_size", R"(graph @g(%x: f32[2]) {
  %ag = all_gather_into_tensor(%x) {group_size = 4, group = "world"} : f32[8]
  return %ag
})",
       2, "",
       "FILE:2:3: error: graph @g, node %ag: group_size 4 does not match group 'world' of size "
       "2\n"},
      {"unknown_group", R"(graph @g(%x: f32[2]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "tp"} : f32[2]
  return %ar
})",
       4, "dp=4",
       "FILE:2:3: error: graph @g, node %ar: unknown group 'tp' (known groups: world, dp)\n"},
      {"mesh_product", "graph @g(%x: f32[2]) {\n  return %x\n}\n", 4, "dp=2,tp=3",
       "funcol: error: --mesh dp=2,tp=3 spans 6 ranks but --ranks is 4\n"},
      {"parse", "graph @g(%x: f32[2]) {\n  %y = nope(%x)\n  return %y\n}\n", 1, "",
       "FILE:2:8: error: unknown op 'nope'\n"},
      {"no_graph", "// comments only\n", 1, "",
       "FILE:1:1: error: expected a graph ('graph @name(...) { ... }'): the input holds none\n"},
  };
  for (const ErrorCase& ec : cases) {
    SCOPED_TRACE(ec.name);
    RunOptions o;
    o.file = write(ec.name + ".ir", ec.text);
    o.ranks = ec.ranks;
    o.mesh = ec.mesh;
    const Captured c = run(o);
    EXPECT_EQ(c.status, 1);
    std::string expect = ec.expect;
    if (expect.rfind("FILE", 0) == 0) expect.replace(0, 4, o.file);
    EXPECT_EQ(c.err, expect);
    EXPECT_EQ(c.out, "");
  }
}

TEST_F(RunTest, FlagErrors) {
  RunOptions o;
  o.file = write("sum.ir", kAllReduce);
  o.ranks = 0;
  EXPECT_EQ(run(o).err, "funcol: error: --ranks must be at least 1, got 0\n");
  o.ranks = 5000;
  EXPECT_EQ(run(o).err,
            "funcol: error: --ranks 5000: the threads backend runs at most 4096 ranks (a thread "
            "each)\n");
  o.ranks = 2;
  o.iters = 0;
  EXPECT_EQ(run(o).err, "funcol: error: --iters must be at least 1, got 0\n");
  o.iters = 1;
  o.outputs = "yaml";
  EXPECT_EQ(run(o).err, "funcol: error: --outputs must be 'json', got 'yaml'\n");
  o.outputs.clear();
  o.backend = "nccl";
  EXPECT_EQ(run(o).err,
            "funcol: error: unknown backend 'nccl' for --backend: expected threads, mpi or gloo\n");
  o.backend = "threads";
  o.trace = dir_.path() + "/no/such/dir/trace.json";
  const Captured c = run(o);
  EXPECT_EQ(c.status, 1);
  EXPECT_EQ(c.err.rfind("funcol: error: cannot write trace file " + o.trace, 0), 0u) << c.err;
  o.trace.clear();
  o.file = dir_.path() + "/missing.ir";
  EXPECT_EQ(run(o).err.rfind("funcol: error: cannot read " + o.file, 0), 0u);
}

TEST_F(RunTest, RuntimeErrorsNameTheRankOnce) {
  RunOptions o;
  o.file = write("div.ir", R"(graph @g(%x: i32[2,3]) {
  %z = zeros() {shape = [2, 3], dtype = i32}
  %v = div(%x, %z)
  return %v
}
)");
  o.ranks = 3;
  const Captured c = run(o);
  EXPECT_EQ(c.status, 1);
  EXPECT_EQ(c.err.rfind(o.file + ":3:3: error: rank ", 0), 0u) << c.err;
  EXPECT_NE(c.err.find(": graph @g, node %v: "), std::string::npos) << c.err;
  EXPECT_EQ(std::count(c.err.begin(), c.err.end(), '\n'), 1) << c.err;
}

TEST(ParseMesh, NamesAndSizes) {
  EXPECT_EQ(parse_mesh(""), (std::vector<std::pair<std::string, int>>{}));
  EXPECT_EQ(parse_mesh("dp=2,tp=4"),
            (std::vector<std::pair<std::string, int>>{{"dp", 2}, {"tp", 4}}));
  for (const char* bad : {"dp", "dp=", "dp=0", "dp=x", "dp=2,", "=2", "dp=2,dp=2", "world=2",
                          "d p=2", "dp=-1"}) {
    EXPECT_THROW(parse_mesh(bad), InvalidArgument) << bad;
  }
}

// The threads backend holds every rank in this process; an mpi process with no launcher
// variables counts itself alone.
TEST(FitsInMemory, CountsTheRanksThisProcessHolds) {
  EXPECT_TRUE(fits_in_memory("threads", 4, 1024));
  EXPECT_FALSE(fits_in_memory("threads", 1, 1e30));
  EXPECT_FALSE(fits_in_memory("gloo", 2, 1e30));
  const double most = 0.6 * static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                      static_cast<double>(sysconf(_SC_PAGESIZE));
  EXPECT_TRUE(fits_in_memory("threads", 1, most));
  EXPECT_FALSE(fits_in_memory("threads", 2, most));
  EXPECT_TRUE(fits_in_memory("mpi", 2, most));
}

TEST(OutputsJson, FormatsEveryDtype) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::string line = outputs_json_line(
      3, {Tensor::from_vector<float>({0.1f, -2.5f, nan, inf, -inf, -0.0f, 0.0f}),
          Tensor::from_vector<double>({0.1, -0.0}, {1, 2}), Tensor::full({}, DType::BF16, 1.5),
          Tensor::from_vector<int64_t>({-7, 1LL << 40}), Tensor::from_vector<bool>({true, false}),
          Tensor::zeros({4097}, DType::U8)});
  const json j = json::parse(line);
  EXPECT_EQ(j["rank"], 3);
  const json& o = j["outputs"];
  ASSERT_EQ(o.size(), 6u);
  EXPECT_EQ(o[0]["dtype"], "f32");
  EXPECT_EQ(o[0]["data"][0].get<float>(), 0.1f);  // %.9g round-trips
  EXPECT_EQ(o[0]["data"][2], "nan");
  EXPECT_EQ(o[0]["data"][3], "inf");
  EXPECT_EQ(o[0]["data"][4], "-inf");
  // A negative zero keeps its sign through a JSON reader (-0 would read as the integer 0).
  EXPECT_TRUE(o[0]["data"][5].is_number_float());
  EXPECT_TRUE(std::signbit(o[0]["data"][5].get<float>()));
  EXPECT_FALSE(std::signbit(o[0]["data"][6].get<float>()));
  EXPECT_EQ(o[1]["shape"], json::array({1, 2}));
  EXPECT_EQ(o[1]["data"][0].get<double>(), 0.1);  // %.17g round-trips
  EXPECT_TRUE(std::signbit(o[1]["data"][1].get<double>()));
  EXPECT_EQ(o[2]["shape"], json::array());
  EXPECT_EQ(o[2]["data"][0].get<double>(), 1.5);
  EXPECT_EQ(o[3]["data"][1].get<int64_t>(), 1LL << 40);
  EXPECT_EQ(o[4]["data"], json::array({true, false}));
  EXPECT_FALSE(o[5].contains("data"));  // more than 4096 elements: digest only
  EXPECT_EQ(o[5]["digest"].get<std::string>().size(), 16u);
  EXPECT_NE(line.find("{\"rank\": 3, \"outputs\": [{\"dtype\": \"f32\", \"shape\": [7], "),
            std::string::npos)
      << line;
}

}  // namespace
}  // namespace funcol::tools
