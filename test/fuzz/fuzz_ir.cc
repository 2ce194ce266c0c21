// libFuzzer target for the IR text path: parse, verify, print, reparse, compare, dce.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "funcol/core/error.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/verifier.h"
#include "funcol/passes/dce.h"

namespace {

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "funcol_fuzz_ir: %s\n", what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  funcol::Module module;
  try {
    module = funcol::parse_module(text, funcol::ParseOptions{.file = "fuzz.ir"});
  } catch (const funcol::ParseError& e) {
    // Malformed input: a located error is the only acceptable outcome.
    if (e.line() < 1 || e.col() < 1 || std::string_view(e.what()).substr(0, 8) != "fuzz.ir:") {
      fail(std::string("badly located error: ") + e.what());
    }
    return 0;
  }
  // Anything the parser accepts is valid IR and prints to text that parses back equal.
  funcol::verify(module);
  const std::string printed = funcol::print(module);
  funcol::Module again;
  try {
    again = funcol::parse_module(printed, funcol::ParseOptions{.file = "printed.ir"});
  } catch (const funcol::ParseError& e) {
    fail(std::string("printed IR does not parse: ") + e.what() + "\n" + printed);
  }
  std::string why;
  if (!funcol::structurally_equal(module, again, &why)) fail("round trip differs: " + why);
  if (funcol::print(again) != printed) fail("printing is not a fixed point");
  (void)funcol::to_dot(again);
  for (auto& g : again.graphs()) {
    funcol::eliminate_dead_code(*g);
    funcol::verify(*g);
  }
  return 0;
}
