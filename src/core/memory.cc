// The machine's memory as this process may use it: the host's, capped by the limits of the
// cgroup (v1 or v2) the process runs in, as a container or a CI job sets them.
#include "memory.h"

#include <sys/sysinfo.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <optional>
#include <string>
#include <system_error>

namespace funcol::detail {
namespace {

constexpr uint64_t kNone = UINT64_MAX;

// The number in a cgroup limit file; none for "max", a missing file or anything else.
std::optional<uint64_t> read_limit(const std::string& path) {
  std::ifstream f(path);
  std::string word;
  if (!(f >> word)) return std::nullopt;
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(word.data(), word.data() + word.size(), v);
  if (ec != std::errc() || end != word.data() + word.size()) return std::nullopt;
  return v;
}

// The smallest `file` limit of cgroup `path` under `root` and of its ancestors (a parent's
// limit binds its children), or kNone.
uint64_t smallest_limit(const std::string& root, std::string path, const char* file) {
  uint64_t limit = kNone;
  for (;;) {
    if (std::optional<uint64_t> v = read_limit(root + path + "/" + file)) {
      limit = std::min(limit, *v);
    }
    if (path.empty() || path == "/") return limit;
    path.resize(path.rfind('/'));
  }
}

uint64_t saturating_add(uint64_t a, uint64_t b) { return a > kNone - b ? kNone : a + b; }

struct Limits {
  uint64_t memory = kNone;
  uint64_t swap = kNone;             // v2: swap on top of memory
  uint64_t memory_and_swap = kNone;  // v1: the two together
};

Limits cgroup_limits() {
  Limits l;
  std::ifstream f("/proc/self/cgroup");
  std::string line;
  while (std::getline(f, line)) {
    // "ID:CONTROLLERS:PATH"; v2 is "0::PATH".
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (controllers.empty()) {
      l.memory = std::min(l.memory, smallest_limit("/sys/fs/cgroup", path, "memory.max"));
      l.swap = std::min(l.swap, smallest_limit("/sys/fs/cgroup", path, "memory.swap.max"));
      continue;
    }
    const std::string list = "," + controllers + ",";
    if (list.find(",memory,") == std::string::npos) continue;
    const std::string root = "/sys/fs/cgroup/memory";
    l.memory = std::min(l.memory, smallest_limit(root, path, "memory.limit_in_bytes"));
    l.memory_and_swap =
        std::min(l.memory_and_swap, smallest_limit(root, path, "memory.memsw.limit_in_bytes"));
  }
  return l;
}

struct Memory {
  uint64_t physical = 0;  // 0: unknown
  uint64_t with_swap = 0;
};

const Memory& memory() {
  static const Memory m = [] {
    Memory m;
    struct sysinfo info {};
    if (sysinfo(&info) != 0) return m;
    const uint64_t ram = static_cast<uint64_t>(info.totalram) * info.mem_unit;
    const uint64_t swap = static_cast<uint64_t>(info.totalswap) * info.mem_unit;
    const Limits l = cgroup_limits();
    m.physical = std::min(ram, l.memory);
    m.with_swap = std::min({saturating_add(ram, swap), l.memory_and_swap,
                            saturating_add(l.memory, std::min(swap, l.swap))});
    return m;
  }();
  return m;
}

}  // namespace

uint64_t machine_memory_bytes() { return memory().with_swap; }
uint64_t physical_memory_bytes() { return memory().physical; }

}  // namespace funcol::detail
