// A preload library for the test gloo_no_hard_links_np2: link() fails as on a file system
// without hard links (vfat, some FUSE ones), so the directory store takes its fallback. Each
// process says at exit how many links it refused, which proves the library was loaded.
#include <cerrno>
#include <cstdio>

namespace {
int refused = 0;

__attribute__((destructor)) void report() {
  if (refused > 0) std::fprintf(stderr, "no_hard_links: refused %d link() calls\n", refused);
}
}  // namespace

extern "C" int link(const char* /*from*/, const char* /*to*/) noexcept {
  ++refused;
  errno = EPERM;
  return -1;
}
