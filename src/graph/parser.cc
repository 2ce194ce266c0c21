// Parser of the IR text format: a hand-written lexer and a non-recursive descent parser.
#include "funcol/graph/parser.h"

#include <locale.h>  // newlocale, for strtod_l

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <unordered_map>

#include <fmt/format.h>

#include "funcol/core/error.h"

namespace funcol {
namespace {

// The double nearest to a decimal literal that std::from_chars found out of range: for one too
// small, a subnormal or a signed zero (std::from_chars reports the range and gives no value);
// for one too large, infinity. strtod in the "C" locale: a '.' whatever the program's locale.
double underflowed_value(std::string_view text) {
  static const locale_t c_numeric = newlocale(LC_NUMERIC_MASK, "C", nullptr);
  const std::string s(text);
  return strtod_l(s.c_str(), nullptr, c_numeric);
}

enum class Tok : uint8_t {
  Eof,
  Ident,   // graph, return, op names, dtype names, true, false, inf, nan
  Value,   // %name or %name#index (text: the name)
  Global,  // @name (text: the name)
  Int,
  Float,
  String,  // decoded value in Lexer::string_value()
  LParen,
  RParen,
  LBrace,
  RBrace,
  LBracket,
  RBracket,
  Comma,
  Colon,
  Equal,
};

struct Token {
  Tok kind = Tok::Eof;
  SourceLoc loc;
  std::string_view text;      // the token as written (Value/Global: the name without sigil)
  int64_t int_value = 0;      // Int
  double float_value = 0;     // Float
  int64_t result_index = -1;  // Value: the number after '#', -1 when absent
};

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.';
}
bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Up to `max` bytes of `text` for a message, with non-printable bytes escaped.
std::string excerpt(std::string_view text, size_t max = 32) {
  return printable(text.substr(0, max)) + (text.size() > max ? "..." : "");
}

// Splits text into tokens, tracking line and column. Copyable, so the parser can look ahead.
class Lexer {
 public:
  Lexer(std::string_view text, const std::string& file, uint32_t first_line)
      : p_(text.data()),
        end_(text.data() + text.size()),
        line_start_(text.data()),
        line_(first_line),
        file_(&file) {
    // A UTF-8 byte order mark (some editors write one) is not part of the text.
    if (first_line == 1 && text.starts_with("\xEF\xBB\xBF")) {
      p_ += 3;
      line_start_ = p_;
    }
  }

  [[noreturn]] void error(SourceLoc loc, const std::string& message) const {
    throw ParseError(*file_, static_cast<int>(loc.line), static_cast<int>(loc.col), message);
  }

  const std::string& string_value() const { return str_; }

  Token next() {
    skip_space();
    Token t;
    t.loc = here();
    if (p_ == end_) return t;
    const char* start = p_;
    const char c = *p_;
    switch (c) {
      case '(': return punct(t, Tok::LParen);
      case ')': return punct(t, Tok::RParen);
      case '{': return punct(t, Tok::LBrace);
      case '}': return punct(t, Tok::RBrace);
      case '[': return punct(t, Tok::LBracket);
      case ']': return punct(t, Tok::RBracket);
      case ',': return punct(t, Tok::Comma);
      case ':': return punct(t, Tok::Colon);
      case '=': return punct(t, Tok::Equal);
      case '"': return lex_string(t);
      case '%':
      case '@': {
        ++p_;
        const char* name = p_;
        while (p_ != end_ && is_name_char(*p_)) ++p_;
        check_name_end(start);
        if (p_ == name) {
          error(t.loc, c == '%' ? "expected a value name after '%'" : "expected a graph name after '@'");
        }
        t.kind = c == '%' ? Tok::Value : Tok::Global;
        t.text = std::string_view(name, static_cast<size_t>(p_ - name));
        if (c == '%' && p_ != end_ && *p_ == '#') {
          const SourceLoc index_loc = here();
          ++p_;
          const char* digits = p_;
          int64_t index = 0;
          while (p_ != end_ && is_digit(*p_)) {
            if (index <= (int64_t{1} << 31)) index = index * 10 + (*p_ - '0');
            ++p_;
          }
          if (p_ == digits) error(index_loc, "expected a result index after '#'");
          if (index > (int64_t{1} << 31)) {
            error(index_loc, fmt::format("result index {} is out of range",
                                         excerpt(std::string_view(digits, static_cast<size_t>(p_ - digits)))));
          }
          t.result_index = index;
        }
        return t;
      }
      default: break;
    }
    if (is_digit(c) || (c == '-' && p_ + 1 != end_ && is_digit(p_[1]))) return lex_number(t);
    // "-inf", and "-nan" (a NaN with its sign bit set, as the printer writes one).
    if (c == '-' && end_ - p_ >= 4 &&
        (std::string_view(p_ + 1, 3) == "inf" || std::string_view(p_ + 1, 3) == "nan") &&
        (end_ - p_ == 4 || !is_name_char(p_[4]))) {
      const bool inf = p_[1] == 'i';
      p_ += 4;
      t.kind = Tok::Float;
      t.text = std::string_view(start, 4);
      t.float_value = -(inf ? std::numeric_limits<double>::infinity()
                            : std::numeric_limits<double>::quiet_NaN());
      return t;
    }
    if (is_ident_start(c)) {
      while (p_ != end_ && is_name_char(*p_)) ++p_;
      check_name_end(start);
      t.kind = Tok::Ident;
      t.text = std::string_view(start, static_cast<size_t>(p_ - start));
      return t;
    }
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f) error(t.loc, fmt::format("unexpected character '{}'", c));
    error(t.loc, fmt::format("unexpected byte 0x{:02x}", byte));
  }

 private:
  const char* p_;
  const char* end_;
  const char* line_start_;
  uint32_t line_;
  const std::string* file_;
  std::string str_;

  // A name followed at once by a non-ASCII byte (UTF-8 "n\xc3\xa9g") is not two tokens: the
  // name would otherwise end before the byte and the error name only its ASCII prefix.
  void check_name_end(const char* start) const {
    if (p_ == end_ || static_cast<unsigned char>(*p_) < 0x80) return;
    const char* word_end = p_;
    auto in_word = [](char c) { return is_name_char(c) || static_cast<unsigned char>(c) >= 0x80; };
    while (word_end != end_ && in_word(*word_end)) ++word_end;
    const std::string_view word(start, static_cast<size_t>(word_end - start));
    error(here(), fmt::format("unexpected byte 0x{:02x} in '{}' (names are ASCII letters, "
                              "digits, '_' and '.')",
                              static_cast<unsigned char>(*p_), excerpt(word)));
  }

  SourceLoc here() const {
    return SourceLoc{line_, static_cast<uint32_t>(p_ - line_start_) + 1};
  }

  void newline() {
    ++line_;
    line_start_ = p_;
  }

  void skip_space() {
    while (p_ != end_) {
      const char c = *p_;
      if (c == '\n' || (c == '\r' && (p_ + 1 == end_ || p_[1] != '\n'))) {
        ++p_;  // \n, \r\n (its \r is a space) and a lone \r (classic Mac) end a line
        newline();
      } else if (c == ' ' || c == '\t' || c == '\r') {
        ++p_;
      } else if (c == '/' && p_ + 1 != end_ && p_[1] == '/') {
        while (p_ != end_ && *p_ != '\n' && *p_ != '\r') ++p_;
      } else {
        return;
      }
    }
  }

  Token punct(Token& t, Tok kind) {
    t.kind = kind;
    t.text = std::string_view(p_, 1);
    ++p_;
    return t;
  }

  Token lex_number(Token& t) {
    const char* start = p_;
    const bool negative = *p_ == '-';
    if (negative) ++p_;
    bool is_float = false;
    while (p_ != end_ && is_digit(*p_)) ++p_;
    if (p_ != end_ && *p_ == '.') {
      is_float = true;
      ++p_;
      while (p_ != end_ && is_digit(*p_)) ++p_;
    }
    if (p_ != end_ && (*p_ == 'e' || *p_ == 'E')) {
      is_float = true;
      ++p_;
      if (p_ != end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      const char* exp = p_;
      while (p_ != end_ && is_digit(*p_)) ++p_;
      if (p_ == exp) {
        error(t.loc, fmt::format("invalid number '{}': missing exponent digits",
                                 excerpt(std::string_view(start, static_cast<size_t>(p_ - start)))));
      }
    }
    if (p_ != end_ && is_name_char(*p_)) {
      const char* bad = p_;
      while (bad != end_ && is_name_char(*bad)) ++bad;
      error(t.loc, fmt::format("invalid number '{}'",
                               excerpt(std::string_view(start, static_cast<size_t>(bad - start)))));
    }
    t.text = std::string_view(start, static_cast<size_t>(p_ - start));
    if (is_float) {
      t.kind = Tok::Float;
      double value = 0;
      auto [ptr, ec] = std::from_chars(start, p_, value);
      if (ec == std::errc::result_out_of_range) {
        // Too small for a double: the nearest one (a subnormal or a signed zero), as C's
        // strtod and Python's float() read it. Too large has no finite value: an error.
        value = underflowed_value(t.text);
        if (!std::isfinite(value)) {
          error(t.loc, fmt::format("float literal {} is out of range", excerpt(t.text)));
        }
        ptr = p_;
        ec = std::errc();
      }
      if (ec != std::errc() || ptr != p_) {
        error(t.loc, fmt::format("invalid number '{}'", excerpt(t.text)));
      }
      t.float_value = value;
      return t;
    }
    // Accumulate the magnitude; 2^63 itself is allowed only with a minus sign.
    const uint64_t limit = negative ? (uint64_t{1} << 63) : (uint64_t{1} << 63) - 1;
    uint64_t magnitude = 0;
    for (const char* q = start + (negative ? 1 : 0); q != p_; ++q) {
      const auto digit = static_cast<uint64_t>(*q - '0');
      if (magnitude > (limit - digit) / 10) {
        error(t.loc, fmt::format("integer literal {} does not fit in 64 bits", excerpt(t.text, 40)));
      }
      magnitude = magnitude * 10 + digit;
    }
    t.kind = Tok::Int;
    t.int_value = negative ? static_cast<int64_t>(~magnitude + 1) : static_cast<int64_t>(magnitude);
    return t;
  }

  Token lex_string(Token& t) {
    const char* start = p_;
    ++p_;
    str_.clear();
    for (;;) {
      if (p_ == end_ || *p_ == '\n' || *p_ == '\r') error(t.loc, "unterminated string");
      const char c = *p_;
      if (c == '"') {
        ++p_;
        break;
      }
      if (c != '\\') {
        str_ += c;
        ++p_;
        continue;
      }
      const SourceLoc esc_loc = here();
      ++p_;
      if (p_ == end_) error(t.loc, "unterminated string");
      const char e = *p_++;
      switch (e) {
        case 'n': str_ += '\n'; break;
        case 't': str_ += '\t'; break;
        case '\\': str_ += '\\'; break;
        case '"': str_ += '"'; break;
        case 'x': {
          int value = 0;
          for (int k = 0; k < 2; ++k) {
            const char h = p_ == end_ ? '\0' : *p_;
            int digit;
            if (h >= '0' && h <= '9') {
              digit = h - '0';
            } else if (h >= 'a' && h <= 'f') {
              digit = h - 'a' + 10;
            } else if (h >= 'A' && h <= 'F') {
              digit = h - 'A' + 10;
            } else {
              error(esc_loc, "invalid escape in string: '\\x' needs two hex digits");
            }
            value = value * 16 + digit;
            ++p_;
          }
          str_ += static_cast<char>(value);
          break;
        }
        default:
          error(esc_loc, fmt::format("invalid escape '\\{}' in string", excerpt(std::string_view(&e, 1))));
      }
    }
    t.kind = Tok::String;
    t.text = std::string_view(start, static_cast<size_t>(p_ - start));
    return t;
  }
};

std::string describe(const Token& t) {
  switch (t.kind) {
    case Tok::Eof: return "end of file";
    case Tok::Value: return "'%" + excerpt(t.text) + (t.result_index >= 0 ? "#" + std::to_string(t.result_index) : "") + "'";
    case Tok::Global: return "'@" + excerpt(t.text) + "'";
    case Tok::String: return "string " + excerpt(t.text);
    default: return "'" + excerpt(t.text) + "'";
  }
}

std::string loc_str(SourceLoc loc) { return fmt::format("{}:{}", loc.line, loc.col); }

class Parser {
 public:
  Parser(std::string_view text, const ParseOptions& options)
      : file_(options.file), lex_(text, file_, options.first_line) {
    advance();
  }

  Module parse_module() {
    Module module;
    // Graph names seen so far (Module::find scans every graph: 32,000 graphs in one file took
    // 6 s). Looked up only; keys point into the graphs, which the module keeps alive.
    std::unordered_map<std::string_view, const Graph*> by_name;
    while (tok_.kind != Tok::Eof) {
      if (!is_ident("graph")) error_expected("'graph'");
      const Graph& g = module.add(parse_graph(by_name));
      by_name.emplace(g.name(), &g);
    }
    return module;
  }

 private:
  std::string file_;
  Lexer lex_;
  Token tok_;
  Graph* g_ = nullptr;
  std::vector<Type> in_types_;  // scratch, reused for every node
  Type given_;                  // scratch for result types written after ':'
  std::vector<int64_t> ints_;   // scratch for integer lists
  // Elements read so far (values, attribute list elements, operands and graphs, weighted):
  // see count_elements.
  int64_t elements_ = 0;

  void advance() { tok_ = lex_.next(); }

  // A value costs about 100 bytes and a list element up to about 80, while a split_with_sizes
  // into empty pieces defines a value per 2 bytes of text ("0,"): a 256 MiB file of them asked
  // for 13 GB. So a text holds at most kMaxParsedElements of them (under 2 GB; 100,000
  // bucketed collectives make about 450,000), counted as they are read, before inference
  // makes the values. Operands and graphs count too: an operand ("%x,", 3 bytes) takes about
  // 100 bytes and 8 more per dim of its type while its node is read (a cat of 4 M rank-64
  // operands took 2.35 GB), so it counts 1 + rank / 4; an empty graph ("graph @g(){return}")
  // takes about 1 KB, so it counts kGraphElements.
  static constexpr int64_t kMaxParsedElements = int64_t{1} << 24;
  static constexpr size_t kGraphElements = 64;
  void count_elements(size_t n, SourceLoc loc) {
    elements_ += static_cast<int64_t>(n);
    if (elements_ > kMaxParsedElements) {
      error(loc, fmt::format("the text holds more than {} elements (values and attribute list "
                             "elements 1 each, operands 1 + rank/4, graphs {}); larger graphs "
                             "are not read",
                             kMaxParsedElements, kGraphElements));
    }
  }
  bool is_ident(std::string_view word) const { return tok_.kind == Tok::Ident && tok_.text == word; }

  [[noreturn]] void error(SourceLoc loc, const std::string& message) const { lex_.error(loc, message); }
  [[noreturn]] void error_expected(std::string_view what) const {
    error(tok_.loc, fmt::format("expected {}, found {}", what, describe(tok_)));
  }
  void expect(Tok kind, std::string_view what) {
    if (tok_.kind != kind) error_expected(what);
    advance();
  }

  std::unique_ptr<Graph> parse_graph(
      const std::unordered_map<std::string_view, const Graph*>& by_name) {
    const SourceLoc graph_loc = tok_.loc;
    advance();
    if (tok_.kind != Tok::Global) error_expected("a graph name '@name'");
    if (auto it = by_name.find(tok_.text); it != by_name.end()) {
      const Graph* first = it->second;
      error(tok_.loc, fmt::format("redefinition of graph @{} (first defined at {})",
                                  excerpt(tok_.text, 64), loc_str(first->loc())));
    }
    if (tok_.text.size() > (size_t{1} << 20)) error(tok_.loc, "graph names are at most 2^20 bytes long");
    count_elements(kGraphElements, graph_loc);
    auto graph = std::make_unique<Graph>(std::string(tok_.text));
    graph->set_source(file_, graph_loc);
    g_ = graph.get();
    advance();
    expect(Tok::LParen, "'('");
    if (tok_.kind != Tok::RParen) {
      for (;;) {
        parse_input();
        if (tok_.kind != Tok::Comma) break;
        advance();
      }
    }
    expect(Tok::RParen, "')' or ','");
    expect(Tok::LBrace, "'{'");
    for (;;) {
      if (tok_.kind == Tok::Value) {
        parse_node();
      } else if (is_ident("return")) {
        parse_return();
        break;
      } else {
        error_expected("a node ('%name = op(...)') or 'return'");
      }
    }
    if (tok_.kind != Tok::RBrace) error_expected(fmt::format("'}}' to close graph @{}", excerpt(g_->name(), 64)));
    advance();
    g_ = nullptr;
    return graph;
  }

  // Errors when `tok_` (a Value token being defined) names an existing value.
  void check_new_name() const {
    if (tok_.result_index >= 0) {
      error(tok_.loc, fmt::format("a definition cannot name a result ('%{}#{}'); write '%{}' "
                                  "or '%{}:k'",
                                  excerpt(tok_.text), tok_.result_index, excerpt(tok_.text), excerpt(tok_.text)));
    }
    if (tok_.text.size() > (size_t{1} << 20)) error(tok_.loc, "value names are at most 2^20 bytes long");
    const Graph::Definition def = g_->find_definition(tok_.text);
    if (!def.node && !def.input) return;
    const SourceLoc first = def.node ? def.node->loc() : def.input->loc();
    error(tok_.loc, fmt::format("redefinition of value %{} (first defined at {})", excerpt(tok_.text, 64),
                                loc_str(first)));
  }

  void parse_input() {
    if (tok_.kind != Tok::Value) error_expected("an input '%name: type'");
    check_new_name();
    const Token name = tok_;
    advance();
    expect(Tok::Colon, "':' and the input's type");
    Type type = parse_type();
    count_elements(1, name.loc);
    g_->add_input(std::string(name.text), std::move(type), name.loc);
  }

  Type parse_type() {
    Type t;
    parse_type_into(t);
    return t;
  }

  // Parses a type into `out`, reusing its shape's capacity.
  void parse_type_into(Type& out) {
    const SourceLoc loc = tok_.loc;
    if (tok_.kind != Tok::Ident) error_expected("a type such as f32[8,16]");
    const std::optional<DType> dtype = parse_dtype(tok_.text);
    // A ':' that ends its line meets the next line's `return`: no type, not a bad one.
    if (!dtype && tok_.text == "return") error_expected("a type such as f32[8,16]");
    if (!dtype) error(tok_.loc, fmt::format("unknown dtype '{}'", excerpt(tok_.text)));
    advance();
    expect(Tok::LBracket, "'[' after the dtype");
    Shape& shape = out.shape;
    shape.clear();
    if (tok_.kind != Tok::RBracket) {
      for (;;) {
        if (tok_.kind != Tok::Int) error_expected("a dim (a non-negative integer)");
        if (tok_.int_value < 0) error(tok_.loc, fmt::format("negative dim {} in type", tok_.int_value));
        if (shape.size() == static_cast<size_t>(kMaxRank)) {
          error(tok_.loc, fmt::format("a type has at most {} dims", kMaxRank));
        }
        shape.push_back(tok_.int_value);
        advance();
        if (tok_.kind != Tok::Comma) break;
        advance();
      }
    }
    expect(Tok::RBracket, "']' or ','");
    try {
      check_type(*dtype, shape, "value");
    } catch (const ShapeError& e) {
      error(loc, e.what());
    }
    out.dtype = *dtype;
  }

  // A definition of `name` later in the current graph (the scan runs only on the error path).
  std::optional<SourceLoc> find_later_definition(std::string_view name) const {
    Lexer scan = lex_;
    int depth = 1;
    try {
      for (;;) {
        const Token t = scan.next();
        if (t.kind == Tok::Eof) return std::nullopt;
        if (t.kind == Tok::LBrace) ++depth;
        if (t.kind == Tok::RBrace && --depth == 0) return std::nullopt;
        if (t.kind != Tok::Value || t.text != name || t.result_index >= 0 || depth != 1) continue;
        Token n = scan.next();
        if (n.kind == Tok::Colon) {
          if (scan.next().kind != Tok::Int) continue;
          n = scan.next();
        }
        if (n.kind == Tok::Equal) return t.loc;
      }
    } catch (const ParseError&) {
      return std::nullopt;
    }
  }

  // The value `tok_` refers to; advances past it.
  Value* parse_ref() {
    if (tok_.kind != Tok::Value) error_expected("a value '%name'");
    const int64_t index = tok_.result_index;
    const auto name = [this] { return excerpt(tok_.text, 64); };
    Value* v = nullptr;
    const Graph::Definition def = g_->find_definition(tok_.text);
    if (Value* input = def.input) {
      if (index >= 0) {
        error(tok_.loc, fmt::format("%{} is a graph input; it has no results to index", name()));
      }
      v = input;
    } else if (Node* n = def.node) {
      const auto count = static_cast<int64_t>(n->num_results());
      if (n->op().multi_result()) {
        if (index < 0) {
          error(tok_.loc, count == 1
                              ? fmt::format("%{} has 1 result; refer to it as %{}#0", name(), name())
                              : fmt::format("%{} has {} result(s); refer to one as %{}#0 to %{}#{}",
                                            name(), count, name(), name(), count - 1));
        }
        if (index >= count) {
          error(tok_.loc, fmt::format("%{}#{} does not exist: %{} has {} result(s)", name(), index,
                                      name(), count));
        }
        v = n->result(static_cast<size_t>(index));
      } else {
        if (index >= 0) {
          error(tok_.loc, fmt::format("%{} has a single result; refer to it as %{}", name(), name()));
        }
        v = n->result(0);
      }
    } else if (auto later = find_later_definition(tok_.text)) {
      error(tok_.loc, fmt::format("use of value %{} before its definition at {}", name(), loc_str(*later)));
    } else {
      error(tok_.loc, fmt::format("use of undefined value %{}", name()));
    }
    advance();
    return v;
  }

  // parse_ref for an operand or an output, counted (see count_elements).
  Value* parse_counted_ref() {
    const SourceLoc loc = tok_.loc;
    Value* v = parse_ref();
    count_elements(1 + v->shape().size() / 4, loc);
    return v;
  }

  void parse_node() {
    check_new_name();
    const Token name = tok_;
    advance();
    std::optional<int64_t> declared;
    SourceLoc declared_loc;
    if (tok_.kind == Tok::Colon) {
      advance();
      if (tok_.kind != Tok::Int) error_expected("a result count after ':'");
      declared_loc = tok_.loc;
      declared = tok_.int_value;
      if (*declared <= 0) error(tok_.loc, fmt::format("result count must be positive, got {}", *declared));
      advance();
    }
    expect(Tok::Equal, "'='");
    if (tok_.kind != Tok::Ident) error_expected("an op name");
    const OpDef* op = find_op(tok_.text);
    const SourceLoc op_loc = tok_.loc;
    if (!op) error(tok_.loc, fmt::format("unknown op '{}'", excerpt(tok_.text, 64)));
    if (declared && !op->multi_result()) {
      error(declared_loc, fmt::format("{} has a single result; write %{} without ':{}'", op->name,
                                      excerpt(name.text, 64), *declared));
    }
    advance();
    if (tok_.kind != Tok::LParen) error_expected(fmt::format("'(' after {}", op->name));
    advance();
    std::vector<Value*> operands;
    operands.reserve(static_cast<size_t>(op->num_operands));
    if (tok_.kind != Tok::RParen) {
      for (;;) {
        operands.push_back(parse_counted_ref());
        if (tok_.kind != Tok::Comma) break;
        advance();
      }
    }
    expect(Tok::RParen, "')' or ','");
    try {
      op->check_operand_count(operands.size());
    } catch (const InvalidArgument& e) {
      error(op_loc, e.what());
    }

    std::vector<Attr> attrs(op->attrs.size());
    if (tok_.kind == Tok::LBrace) parse_attrs(*op, attrs);
    for (size_t i = 0; i < attrs.size(); ++i) {
      if (attrs[i].has_value()) continue;
      const AttrSpec& spec = op->attrs[i];
      if (spec.required) error(op_loc, fmt::format("missing attribute '{}' for {}", spec.name, op->name));
      attrs[i] = spec.default_value;
    }

    // Scratch types keep their shapes' capacity from node to node: no allocation here.
    in_types_.resize(operands.size());
    for (size_t i = 0; i < operands.size(); ++i) {
      in_types_[i].dtype = operands[i]->dtype();
      in_types_[i].shape.assign(operands[i]->shape().begin(), operands[i]->shape().end());
    }
    std::vector<Type> types;
    try {
      types = infer_types(*op, in_types_, attrs);
    } catch (const Error& e) {
      error(op_loc, fmt::format("%{}: {}", excerpt(name.text, 64), e.what()));
    }
    count_elements(types.size(), op_loc);
    if (declared && static_cast<size_t>(*declared) != types.size()) {
      error(declared_loc, fmt::format("%{} declares {} result(s) but {} produces {}",
                                      excerpt(name.text, 64), *declared, op->name, types.size()));
    }

    if (tok_.kind == Tok::Colon) {
      advance();
      const SourceLoc list_loc = tok_.loc;
      for (size_t i = 0;; ++i) {
        const SourceLoc type_loc = tok_.loc;
        parse_type_into(given_);
        const Type& given = given_;
        if (i >= types.size()) {
          error(type_loc, fmt::format("too many result types: {} produces {} result(s)", op->name,
                                      types.size()));
        }
        if (given != types[i]) {
          const std::string which = op->multi_result()
                                        ? fmt::format("%{}#{}", excerpt(name.text, 64), i)
                                        : fmt::format("%{}", excerpt(name.text, 64));
          error(type_loc, fmt::format("type {} of {} does not match its inferred type {}",
                                      given.str(), which, types[i].str()));
        }
        if (tok_.kind != Tok::Comma) {
          if (i + 1 < types.size()) {
            error(list_loc, fmt::format("expected {} result types, found {}", types.size(), i + 1));
          }
          break;
        }
        advance();
      }
    }
    g_->append_checked_node(*op, std::move(operands), std::move(attrs), std::move(types),
                            std::string(name.text), name.loc);
  }

  void parse_attrs(const OpDef& op, std::vector<Attr>& attrs) {
    advance();  // '{'
    if (tok_.kind == Tok::RBrace) {
      advance();
      return;
    }
    for (;;) {
      if (tok_.kind != Tok::Ident) error_expected("an attribute name");
      const int index = op.attr_index(tok_.text);
      if (index < 0) {
        std::string expected;
        for (const AttrSpec& s : op.attrs) expected += (expected.empty() ? "" : ", ") + std::string(s.name);
        error(tok_.loc, fmt::format("unknown attribute '{}' for {} ({})", excerpt(tok_.text, 64), op.name,
                                    expected.empty() ? "it has no attributes" : "expected: " + expected));
      }
      const AttrSpec& spec = op.attrs[static_cast<size_t>(index)];
      if (attrs[static_cast<size_t>(index)].has_value()) {
        error(tok_.loc, fmt::format("duplicate attribute '{}'", spec.name));
      }
      advance();
      if (tok_.kind != Tok::Equal) error_expected(fmt::format("'=' after attribute '{}'", spec.name));
      advance();
      const SourceLoc value_loc = tok_.loc;
      Attr value = parse_attr_value(spec);
      try {
        coerce_attr(op, spec, value);
      } catch (const InvalidArgument& e) {
        error(value_loc, e.what());
      }
      attrs[static_cast<size_t>(index)] = std::move(value);
      if (tok_.kind == Tok::Comma) {
        advance();
      } else if (tok_.kind == Tok::RBrace) {
        advance();
        return;
      } else {
        error_expected("',' or '}' in attributes");
      }
    }
  }

  Attr parse_scalar(const AttrSpec& spec) {
    Attr value;
    switch (tok_.kind) {
      case Tok::Int: value = Attr(tok_.int_value); break;
      case Tok::Float: value = Attr(tok_.float_value); break;
      case Tok::String: value = Attr(lex_.string_value()); break;
      case Tok::Ident:
        if (tok_.text == "true" || tok_.text == "false") {
          value = Attr(tok_.text == "true");
        } else if (tok_.text == "inf") {
          value = Attr(std::numeric_limits<double>::infinity());
        } else if (tok_.text == "nan") {
          value = Attr(std::numeric_limits<double>::quiet_NaN());
        } else if (auto dtype = parse_dtype(tok_.text)) {
          value = Attr(*dtype);
        } else if (spec.kind == AttrKind::DType) {
          error(tok_.loc, fmt::format("unknown dtype '{}'", excerpt(tok_.text)));
        } else {
          error(tok_.loc, fmt::format("unexpected '{}' in the value of attribute '{}'",
                                      excerpt(tok_.text), spec.name));
        }
        break;
      default: error_expected(fmt::format("a value for attribute '{}'", spec.name));
    }
    advance();
    return value;
  }

  // A scalar or a (nested) list, without recursion: open lists live on an explicit stack.
  Attr parse_attr_value(const AttrSpec& spec) {
    if (tok_.kind != Tok::LBracket) return parse_scalar(spec);
    advance();
    // Fast path: a flat list of integers (shapes, split sizes, dims) becomes an integer list
    // with one allocation. Anything else continues as a generic list holding those integers.
    ints_.clear();
    bool after_element = false;
    for (;;) {
      if (tok_.kind == Tok::RBracket) {
        if (!after_element && !ints_.empty()) break;  // "[1, ]": reported below
        advance();
        return Attr(std::vector<int64_t>(ints_.begin(), ints_.end()));
      }
      if (after_element ? tok_.kind != Tok::Comma : tok_.kind != Tok::Int) break;
      if (!after_element) {
        count_elements(1, tok_.loc);
        ints_.push_back(tok_.int_value);
      }
      after_element = !after_element;
      advance();
    }
    std::vector<std::vector<Attr>> open;
    open.emplace_back();
    for (int64_t v : ints_) open.back().emplace_back(v);
    for (;;) {
      if (tok_.kind == Tok::RBracket && (after_element || open.back().empty())) {
        Attr list = Attr::list(std::move(open.back()));
        open.pop_back();
        advance();
        if (open.empty()) return list;
        open.back().push_back(std::move(list));
        after_element = true;
      } else if (after_element) {
        if (tok_.kind != Tok::Comma) error_expected("',' or ']'");
        advance();
        after_element = false;
      } else if (tok_.kind == Tok::LBracket) {
        count_elements(1, tok_.loc);
        if (open.size() >= static_cast<size_t>(kMaxAttrListDepth)) {
          error(tok_.loc, fmt::format("attribute lists nest deeper than {} levels", kMaxAttrListDepth));
        }
        open.emplace_back();
        advance();
      } else {
        count_elements(1, tok_.loc);
        open.back().push_back(parse_scalar(spec));
        after_element = true;
      }
    }
  }

  void parse_return() {
    advance();
    std::vector<Value*> outputs;
    if (tok_.kind == Tok::Value) {
      for (;;) {
        outputs.push_back(parse_counted_ref());
        if (tok_.kind != Tok::Comma) break;
        advance();
      }
    }
    for (Value* v : outputs) g_->add_output(v);
  }
};

}  // namespace

Module parse_module(std::string_view text, const ParseOptions& options) {
  Parser parser(text, options);
  return parser.parse_module();
}

std::unique_ptr<Graph> parse_graph(std::string_view text, const ParseOptions& options) {
  Module module = parse_module(text, options);
  if (module.graphs().size() != 1) {
    const SourceLoc loc = module.graphs().size() > 1 ? module.graphs()[1]->loc()
                                                     : SourceLoc{options.first_line, 1};
    throw ParseError(options.file, static_cast<int>(loc.line), static_cast<int>(loc.col),
                     fmt::format("expected exactly one graph, found {}", module.graphs().size()));
  }
  return std::move(module.graphs()[0]);
}

ParseError no_graph_error(const std::string& file, size_t line) {
  return ParseError(file, static_cast<int>(line), 1,
                    "expected a graph ('graph @name(...) { ... }'): the input holds none");
}

namespace {

// Reads `in` to its end in blocks; a read error or a stream over max_bytes throws (never a
// silent prefix, as the standard streams give on a read error or when memory runs out).
std::string read_stream(std::FILE* in, const std::string& name, size_t max_bytes) {
  std::string text;
  constexpr size_t kBlock = size_t{1} << 20;
  for (;;) {
    const size_t at = text.size();
    // One byte past the limit tells a stream of exactly max_bytes from a longer one.
    const size_t want = std::min(kBlock, max_bytes + 1 - at);
    text.resize(at + want);
    const size_t got = std::fread(text.data() + at, 1, want, in);
    text.resize(at + got);
    if (text.size() > max_bytes) {
      throw InvalidArgument(fmt::format("cannot read {}: it holds more than {} bytes", name,
                                        max_bytes));
    }
    if (got == want) continue;
    if (std::ferror(in)) {
      throw InvalidArgument(fmt::format("cannot read {}: {}", name, std::strerror(errno)));
    }
    return text;
  }
}

}  // namespace

std::string read_text_file(const std::string& path, size_t max_bytes) {
  if (path == "-") return read_stream(stdin, "<stdin>", max_bytes);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw InvalidArgument(fmt::format("cannot read {}: is a directory", path));
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> in(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!in) throw InvalidArgument(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  return read_stream(in.get(), path, max_bytes);
}

Module parse_file(const std::string& path) {
  const std::string text = read_text_file(path);
  ParseOptions options;
  options.file = path == "-" ? "<stdin>" : path;
  return parse_module(text, options);
}

}  // namespace funcol
