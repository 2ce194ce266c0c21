// Tests of pass pipelines: the text syntax, the registry, options and the runner.
#include "funcol/passes/pipeline.h"

#include <gtest/gtest.h>

#include "funcol/core/error.h"
#include "funcol/passes/bucketing.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"

namespace funcol {
namespace {

std::string pipeline_error(std::string_view text) {
  try {
    parse_pipeline(text);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(PipelineSyntax, DesignExample) {
  auto specs = parse_pipeline("bucket-all-gather{cap-mb=25 mode=multidtype},bucket-reduce-scatter,dce");
  ASSERT_EQ(specs.size(), 3u);
  EXPECT_EQ(specs[0].name, "bucket-all-gather");
  ASSERT_EQ(specs[0].options.entries().size(), 2u);
  EXPECT_EQ(specs[0].options.get("cap-mb", ""), "25");
  EXPECT_EQ(specs[0].options.get("mode", ""), "multidtype");
  EXPECT_EQ(specs[0].options.entries()[1].first, "mode");
  EXPECT_EQ(specs[1].name, "bucket-reduce-scatter");
  EXPECT_TRUE(specs[1].options.empty());
  EXPECT_EQ(specs[2].name, "dce");
}

TEST(PipelineSyntax, ValuesWithColonsSpacesAndEmptyPipelines) {
  auto specs = parse_pipeline("  a{ cap-mb=1:25   mode=x }  ,  b{}  ");
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].options.get("cap-mb", ""), "1:25");
  EXPECT_EQ(specs[0].options.get_double_list("a", "cap-mb", {}), (std::vector<double>{1, 25}));
  EXPECT_EQ(specs[0].options.get_double_list("a", "other", {2000}), (std::vector<double>{2000}));
  EXPECT_TRUE(specs[1].options.empty());
  EXPECT_TRUE(parse_pipeline("").empty());
  EXPECT_TRUE(parse_pipeline("  \t").empty());
}

TEST(PipelineSyntax, Errors) {
  EXPECT_EQ(pipeline_error("dce,"),
            "invalid pass pipeline 'dce,': expected a pass name at column 5, found end of pipeline");
  EXPECT_EQ(pipeline_error(",dce"),
            "invalid pass pipeline ',dce': expected a pass name at column 1, found ','");
  EXPECT_EQ(pipeline_error("dce dce"),
            "invalid pass pipeline 'dce dce': expected ',' between passes at column 5, found 'd'");
  EXPECT_EQ(pipeline_error("a{cap-mb=1"),
            "invalid pass pipeline 'a{cap-mb=1': expected an option or '}' at column 11, found end "
            "of pipeline");
  EXPECT_EQ(pipeline_error("a{cap-mb}"),
            "invalid pass pipeline 'a{cap-mb}': expected '=' after option 'cap-mb' at column 9, "
            "found '}'");
  EXPECT_EQ(pipeline_error("a{cap-mb=}"),
            "invalid pass pipeline 'a{cap-mb=}': expected a value for option 'cap-mb' at column 10, "
            "found '}'");
  EXPECT_EQ(pipeline_error("a{x=1,y=2}"),
            "invalid pass pipeline 'a{x=1,y=2}': options are separated by spaces, not commas at "
            "column 6, found ','");
  EXPECT_EQ(pipeline_error("a{x=1 x=2}"),
            "invalid pass pipeline 'a{x=1 x=2}': option 'x' of pass a is given twice at column 7");
  EXPECT_EQ(pipeline_error("a{x=1=2}"),
            "invalid pass pipeline 'a{x=1=2}': expected a space or '}' after an option at column 6, "
            "found '='");
  EXPECT_EQ(pipeline_error("a}"), "invalid pass pipeline 'a}': expected ',' between passes at column 2, found '}'");
  EXPECT_EQ(pipeline_error("a{{"), "invalid pass pipeline 'a{{': expected an option name at column 3, found '{'");
  // Bytes outside printable ASCII are shown escaped, and no option value holds them.
  EXPECT_EQ(pipeline_error("dce\xff"),
            "invalid pass pipeline 'dce\\xff': expected ',' between passes at column 4, found "
            "'\\xff'");
  EXPECT_EQ(pipeline_error("a{cap-mb=1\xff}"),
            "invalid pass pipeline 'a{cap-mb=1\\xff}': expected a space or '}' after an option "
            "at column 11, found '\\xff'");
  EXPECT_EQ(pipeline_error(std::string("a{x=\0}", 6)),
            "invalid pass pipeline 'a{x=\\x00}': expected a value for option 'x' at column 5, "
            "found '\\x00'");
}

TEST(PassOptionsTest, NumbersAreChecked) {
  PassOptions o({{"cap-mb", "x"}, {"n", "3"}, {"list", "1:x"}});
  EXPECT_EQ(o.get_int("p", "n", 0), 3);
  EXPECT_EQ(o.get_int("p", "missing", 7), 7);
  EXPECT_DOUBLE_EQ(o.get_double("p", "n", 0), 3.0);
  try {
    o.get_double("p", "cap-mb", 0);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "option cap-mb of pass p must be a number, got 'x'");
  }
  EXPECT_THROW(o.get_double_list("p", "list", {}), InvalidArgument);
  EXPECT_THROW(o.get_int("p", "cap-mb", 0), InvalidArgument);
  // A number too large for a double is out of range, not "not a number".
  PassOptions huge({{"memory-budget-mb", "1e400"}, {"n", "1"}});
  try {
    huge.get_double("overlap", "memory-budget-mb", 0);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "option memory-budget-mb of pass overlap is out of range, got '1e400'");
  }
}

// A leading '+' reads as C's strtod reads it, in every numeric option (cap-mb took it and
// memory-budget-mb did not); a second sign, or a sign alone, is still not a number.
TEST(PassOptionsTest, NumbersTakeALeadingPlus) {
  PassOptions o({{"a", "+0.5"}, {"b", "+3"}, {"c", "+1:+2"}, {"d", "+-1"}, {"e", "+"}, {"f", "++1"}});
  EXPECT_DOUBLE_EQ(o.get_double("p", "a", 0), 0.5);
  EXPECT_EQ(o.get_int("p", "b", 0), 3);
  EXPECT_EQ(o.get_double_list("p", "c", {}), (std::vector<double>{1, 2}));
  for (const char* key : {"d", "e", "f"}) {
    EXPECT_THROW(o.get_double("p", key, 0), InvalidArgument) << key;
    EXPECT_THROW(o.get_int("p", key, 0), InvalidArgument) << key;
  }
  EXPECT_EQ(parse_cap_mb("+0.5:+2"), (std::vector<double>{0.5, 2}));
  EXPECT_THROW(parse_cap_mb("+-1"), InvalidArgument);
}

// A pass that counts its runs and can be told to break the graph.
class ProbePass : public Pass {
 public:
  explicit ProbePass(bool corrupt) : corrupt_(corrupt) {}
  std::string name() const override { return corrupt_ ? "corrupt" : "probe"; }
  bool run(Graph& graph) override {
    ++runs;
    if (corrupt_) graph.first_node()->result()->set_type(Type(DType::F64, {}));
    return corrupt_;
  }
  static inline int runs = 0;

 private:
  bool corrupt_;
};

PassRegistry test_registry() {
  PassRegistry r;
  register_all_passes(r);
  r.add({"probe", "counts runs", {"level"},
         [](const PassOptions&) { return std::make_unique<ProbePass>(false); }});
  r.add({"corrupt", "breaks the graph", {},
         [](const PassOptions&) { return std::make_unique<ProbePass>(true); }});
  return r;
}

TEST(Registry, IsSortedAndRejectsDuplicates) {
  PassRegistry r = test_registry();
  std::vector<std::string> names;
  for (const PassInfo& p : r.passes()) names.push_back(p.name);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_NE(r.find("dce"), nullptr);
  EXPECT_EQ(r.find("nope"), nullptr);
  EXPECT_THROW(r.add({"dce", "again", {}, [](const PassOptions&) { return std::make_unique<ProbePass>(false); }}),
               InvalidArgument);
  EXPECT_NE(default_pass_registry().find("dce"), nullptr);
}

TEST(Registry, UnknownPassOrOption) {
  PassRegistry r = test_registry();
  try {
    Pipeline::parse("dce,frob", r);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()), "unknown pass 'frob' (available: " + r.names() + ")");
  }
  try {
    Pipeline::parse("dce{level=2}", r);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "unknown option 'level' for pass dce (it takes none)");
  }
  try {
    Pipeline::parse("probe{lvl=2}", r);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "unknown option 'lvl' for pass probe (options: level)");
  }
  EXPECT_EQ(Pipeline::parse("probe{level=2},dce", r).size(), 2u);
}

TEST(PipelineRun, RunsInOrderWithStatsAndVerifies) {
  PassRegistry r = test_registry();
  Module m = parse_module("graph @g(%x: f32[2]) {\n  %y = neg(%x)\n  %z = relu(%x)\n  return %z\n}");
  Graph& g = *m.graphs()[0];
  ProbePass::runs = 0;
  std::vector<PassStat> stats;
  Pipeline p = Pipeline::parse("probe,dce,probe,dce", r);
  EXPECT_TRUE(p.run(g, &stats));
  EXPECT_EQ(ProbePass::runs, 2);
  ASSERT_EQ(stats.size(), 4u);
  EXPECT_EQ(stats[0].name, "probe");
  EXPECT_FALSE(stats[0].changed);
  EXPECT_EQ(stats[1].name, "dce");
  EXPECT_TRUE(stats[1].changed);
  EXPECT_FALSE(stats[3].changed);
  EXPECT_GE(stats[1].ms, 0.0);
  EXPECT_EQ(g.num_nodes(), 1u);
  try {
    Pipeline::parse("corrupt", r).run(g);
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("pass 'corrupt' produced an invalid graph: graph @g: node %z", 0), 0u)
        << e.what();
  }
}

}  // namespace
}  // namespace funcol
