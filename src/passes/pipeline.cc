// The pipeline text parser and the pipeline runner (timing, verification after each pass).
#include "funcol/passes/pipeline.h"

#include <chrono>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "funcol/graph/verifier.h"

namespace funcol {
namespace {

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_';
}
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
// Printable ASCII only: a value is a number, a name or a list of them, and the bytes a value
// stops at are shown in the error (escaped there when not printable).
bool is_value_char(char c) {
  return c > ' ' && c < 0x7f && c != ',' && c != '{' && c != '}' && c != '=';
}

class PipelineParser {
 public:
  explicit PipelineParser(std::string_view text) : text_(text) {}

  std::vector<PassSpec> parse() {
    std::vector<PassSpec> specs;
    skip_space();
    if (at_end()) return specs;
    for (;;) {
      specs.push_back(parse_pass());
      skip_space();
      if (at_end()) return specs;
      if (peek() != ',') fail("expected ',' between passes");
      ++pos_;
      skip_space();
    }
  }

 private:
  std::string_view text_;
  size_t pos_ = 0;

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return text_[pos_]; }
  void skip_space() {
    while (!at_end() && is_space(peek())) ++pos_;
  }

  // `what` at the current column, and what was found there unless `found` is false (an error
  // about a whole option, not a character).
  [[noreturn]] void fail(std::string_view what, bool found = true) const {
    std::string message = fmt::format("invalid pass pipeline '{}': {} at column {}",
                                      printable(text_), what, pos_ + 1);
    if (found) {
      message += at_end() ? ", found end of pipeline"
                          : fmt::format(", found '{}'", printable(text_.substr(pos_, 1)));
    }
    throw InvalidArgument(message);
  }

  std::string_view take(bool (*pred)(char)) {
    const size_t start = pos_;
    while (!at_end() && pred(peek())) ++pos_;
    return text_.substr(start, pos_ - start);
  }

  PassSpec parse_pass() {
    PassSpec spec;
    spec.name = take(is_name_char);
    if (spec.name.empty()) fail("expected a pass name");
    skip_space();
    if (at_end() || peek() != '{') return spec;
    ++pos_;
    std::vector<std::pair<std::string, std::string>> entries;
    for (;;) {
      skip_space();
      if (at_end()) fail("expected an option or '}'");
      if (peek() == '}') {
        ++pos_;
        break;
      }
      if (peek() == ',') fail("options are separated by spaces, not commas");
      const size_t key_pos = pos_;
      std::string key(take(is_name_char));
      if (key.empty()) fail("expected an option name");
      if (at_end() || peek() != '=') fail(fmt::format("expected '=' after option '{}'", key));
      ++pos_;
      std::string value(take(is_value_char));
      if (value.empty()) fail(fmt::format("expected a value for option '{}'", key));
      for (const auto& [k, v] : entries) {
        if (k == key) {
          pos_ = key_pos;
          fail(fmt::format("option '{}' of pass {} is given twice", key, spec.name),
               /*found=*/false);
        }
      }
      entries.emplace_back(std::move(key), std::move(value));
      if (!at_end() && !is_space(peek()) && peek() != '}') {
        fail(peek() == ',' ? "options are separated by spaces, not commas"
                           : "expected a space or '}' after an option");
      }
    }
    spec.options = PassOptions(std::move(entries));
    return spec;
  }
};

}  // namespace

std::vector<PassSpec> parse_pipeline(std::string_view text) { return PipelineParser(text).parse(); }

Pipeline Pipeline::parse(std::string_view text, const PassRegistry& registry) {
  Pipeline p;
  for (const PassSpec& spec : parse_pipeline(text)) p.add(registry.create(spec.name, spec.options));
  return p;
}

void Pipeline::set_explain(std::ostream* out) {
  for (auto& pass : passes_) pass->set_explain(out);
}

bool Pipeline::run(Graph& graph, std::vector<PassStat>* stats, bool verify_each) const {
  bool changed = false;
  for (const auto& pass : passes_) {
    const auto start = std::chrono::steady_clock::now();
    const bool c = pass->run(graph);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    changed = changed || c;
    if (stats) stats->push_back(PassStat{pass->name(), ms, c});
    if (verify_each) {
      try {
        verify(graph);
      } catch (const Error& e) {
        throw InvalidArgument(
            fmt::format("pass '{}' produced an invalid graph: {}", pass->name(), e.what()));
      }
    }
  }
  return changed;
}

}  // namespace funcol
