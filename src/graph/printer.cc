// The IR printer (deterministic text that parses back to an equal graph) and the dot export.
#include "funcol/graph/printer.h"

#include <algorithm>
#include <charconv>
#include <cmath>

#include <fmt/format.h>

namespace funcol {
namespace {

void append_int(int64_t v, std::string& out) {
  char buf[24];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  out.append(buf, end);
}

void append_float(double v, std::string& out) {
  if (std::isnan(v)) {
    out += std::signbit(v) ? "-nan" : "nan";  // the sign reads back (the payload does not)
    return;
  }
  if (std::isinf(v)) {
    out += v < 0 ? "-inf" : "inf";
    return;
  }
  char buf[32];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  std::string_view s(buf, static_cast<size_t>(end - buf));
  out += s;
  // Keep the float kind visible: "1" would read back as an integer.
  if (s.find_first_of(".e") == std::string_view::npos) out += ".0";
}

void append_value_ref(const Value* v, std::string& out) {
  out += '%';
  if (v->is_input()) {
    out += v->name();
    return;
  }
  const Node* n = v->node();
  out += n->name();
  if (n->op().multi_result()) {
    out += '#';
    append_int(v->index(), out);
  }
}

}  // namespace

void print_type(const Type& type, std::string& out) {
  out += dtype_name(type.dtype);
  out += '[';
  for (size_t i = 0; i < type.shape.size(); ++i) {
    if (i) out += ',';
    append_int(type.shape[i], out);
  }
  out += ']';
}

void print_string_literal(std::string_view text, std::string& out) {
  out += '"';
  for (char c : text) {
    const auto b = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (b < 0x20 || b >= 0x7f) {
          out += fmt::format("\\x{:02x}", b);
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void print_attr(const Attr& attr, std::string& out) {
  switch (attr.kind()) {
    case AttrKind::None: out += "<none>"; break;
    case AttrKind::Int: append_int(attr.as_int(), out); break;
    case AttrKind::Float: append_float(attr.as_float(), out); break;
    case AttrKind::String: print_string_literal(attr.as_string(), out); break;
    case AttrKind::Bool: out += attr.as_bool() ? "true" : "false"; break;
    case AttrKind::DType: out += dtype_name(attr.as_dtype()); break;
    case AttrKind::IntList: {
      out += '[';
      const auto& v = attr.as_ints();
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += ", ";
        append_int(v[i], out);
      }
      out += ']';
      break;
    }
    case AttrKind::List: {
      out += '[';
      const auto& v = attr.as_list();
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += ", ";
        print_attr(v[i], out);
      }
      out += ']';
      break;
    }
  }
}

void print_to(const Graph& graph, std::string& out) {
  out += "graph @";
  out += graph.name();
  out += '(';
  for (size_t i = 0; i < graph.num_inputs(); ++i) {
    if (i) out += ", ";
    const Value* v = graph.input(i);
    append_value_ref(v, out);
    out += ": ";
    print_type(v->type(), out);
  }
  out += ") {\n";
  for (const Node& n : graph.nodes()) {
    const OpDef& op = n.op();
    out += "  %";
    out += n.name();
    if (op.multi_result()) {
      out += ':';
      append_int(static_cast<int64_t>(n.num_results()), out);
    }
    out += " = ";
    out += op.name;
    out += '(';
    for (size_t i = 0; i < n.num_operands(); ++i) {
      if (i) out += ", ";
      append_value_ref(n.operand(i), out);
    }
    out += ')';
    const auto attrs = n.attr_values();
    if (!attrs.empty()) {
      out += " {";
      for (size_t i = 0; i < attrs.size(); ++i) {
        if (i) out += ", ";
        out += op.attrs[i].name;
        out += " = ";
        print_attr(attrs[i], out);
      }
      out += '}';
    }
    out += " : ";
    for (size_t i = 0; i < n.num_results(); ++i) {
      if (i) out += ", ";
      print_type(n.result(i)->type(), out);
    }
    out += '\n';
  }
  out += "  return";
  for (size_t i = 0; i < graph.outputs().size(); ++i) {
    out += i ? ", " : " ";
    append_value_ref(graph.outputs()[i], out);
  }
  out += "\n}\n";
}

std::string print(const Graph& graph) {
  std::string out;
  // About 80 bytes per node line; one reservation avoids most regrowth on large graphs.
  out.reserve(128 + graph.num_nodes() * 80);
  print_to(graph, out);
  return out;
}

std::string print(const Module& module) {
  std::string out;
  for (size_t i = 0; i < module.graphs().size(); ++i) {
    if (i) out += '\n';
    print_to(*module.graphs()[i], out);
  }
  return out;
}

// ---- Graphviz -------------------------------------------------------------------------------

namespace {

// A dot string literal: only '"' and '\\' need escaping; newlines become \l-free "\n".
std::string dot_quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

// Graphviz refuses a quoted string longer than 16 KiB, so a label shows at most 64 bytes of a
// name and the first 8 result types of a node (a bucket's split has one per member; a type
// is at most about 1.3 KB: 64 dims of 19 digits, when one is 0).
constexpr size_t kDotNameBytes = 64;
constexpr size_t kDotTypes = 8;

std::string dot_name(std::string_view name) {
  if (name.size() <= kDotNameBytes) return std::string(name);
  return std::string(name.substr(0, kDotNameBytes)) + "...";
}

void dot_graph(const Graph& graph, std::string& out) {
  out += "digraph " + dot_quote(dot_name(graph.name())) + " {\n";
  out += "  node [fontname=\"monospace\"];\n";
  std::unordered_map<const Node*, size_t> ids;
  ids.reserve(graph.num_nodes());
  for (size_t i = 0; i < graph.num_inputs(); ++i) {
    const Value* v = graph.input(i);
    out += fmt::format("  in{} [shape=ellipse, label={}];\n", i,
                       dot_quote("%" + dot_name(v->name()) + ": " + v->type().str()));
  }
  size_t k = 0;
  for (const Node& n : graph.nodes()) {
    ids.emplace(&n, k);
    std::string types;
    for (size_t i = 0; i < std::min(n.num_results(), kDotTypes); ++i) {
      types += (i ? ", " : "") + n.result(i)->type().str();
    }
    if (n.num_results() > kDotTypes) types += fmt::format(", ... ({} results)", n.num_results());
    const std::string label = "%" + dot_name(n.name()) + " = " + std::string(n.op_name()) + "\n" + types;
    const char* style = "shape=box";
    if (n.op().is_collective()) {
      style = "shape=box, style=filled, fillcolor=\"lightblue\"";
    } else if (n.op().collective == CollectiveKind::Wait) {
      style = "shape=box, style=filled, fillcolor=\"lightgrey\"";
    }
    out += fmt::format("  n{} [{}, label={}];\n", k, style, dot_quote(label));
    ++k;
  }
  out += "  ret [shape=doublecircle, label=\"return\"];\n";
  const auto source = [&](const Value* v) {
    return v->is_input() ? fmt::format("in{}", v->index()) : fmt::format("n{}", ids.at(v->node()));
  };
  const auto edge = [&](const Value* v, std::string_view target) {
    out += fmt::format("  {} -> {}", source(v), target);
    if (!v->is_input() && v->node()->op().multi_result()) {
      out += fmt::format(" [label=\"#{}\"]", v->index());
    }
    out += ";\n";
  };
  k = 0;
  for (const Node& n : graph.nodes()) {
    const std::string target = fmt::format("n{}", k++);
    for (const Value* v : n.operands()) edge(v, target);
  }
  for (const Value* v : graph.outputs()) edge(v, "ret");
  out += "}\n";
}

}  // namespace

std::string to_dot(const Graph& graph) {
  std::string out;
  dot_graph(graph, out);
  return out;
}

std::string to_dot(const Module& module) {
  std::string out;
  for (const auto& g : module.graphs()) dot_graph(*g, out);
  return out;
}

}  // namespace funcol
