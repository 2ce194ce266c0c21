// One JSON value on one line, spaced as DESIGN §7 writes its JSON (`funcol opt --stats`,
// `funcol run --outputs json`): ", " between items and ": " after each key, as Python's
// json.dumps prints by default. nlohmann's dump() has no such style (compact or indented).
#pragma once

#include <string>

namespace funcol::tools {

template <typename Json>
void append_json_line(std::string& out, const Json& j) {
  if (j.is_object() || j.is_array()) {
    const bool object = j.is_object();
    out += object ? '{' : '[';
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      if (object) {
        out += Json(it.key()).dump();
        out += ": ";
      }
      append_json_line(out, it.value());
    }
    out += object ? '}' : ']';
    return;
  }
  out += j.dump();
}

template <typename Json>
std::string json_line(const Json& j) {
  std::string out;
  append_json_line(out, j);
  return out;
}

}  // namespace funcol::tools
