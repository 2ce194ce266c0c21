// The failure path of FUNCOL_CHECK.
#include "funcol/core/error.h"

namespace funcol::detail {

void check_failed(const char* cond, const char* file, int line, const std::string& msg) {
  std::string text = std::string("internal error: check failed: ") + cond + " at " + file + ":" +
                     std::to_string(line);
  if (!msg.empty()) text += ": " + msg;
  throw InternalError(text);
}

}  // namespace funcol::detail
