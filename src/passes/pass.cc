// Pass options and the pass registry.
#include "funcol/passes/pass.h"

#include <algorithm>

#include <fmt/format.h>

#include "funcol/core/error.h"
#include "number.h"

namespace funcol {
namespace {

double parse_number(std::string_view pass, std::string_view key, std::string_view text) {
  const auto r = parse_whole_number<double>(text);
  if (r.whole && r.ec == std::errc::result_out_of_range) {
    throw InvalidArgument(
        fmt::format("option {} of pass {} is out of range, got '{}'", key, pass, text));
  }
  if (!r.whole || r.ec != std::errc()) {
    throw InvalidArgument(
        fmt::format("option {} of pass {} must be a number, got '{}'", key, pass, text));
  }
  return r.value;
}

}  // namespace

const std::string* PassOptions::find(std::string_view key) const {
  for (const auto& [k, v] : entries_) {
    if (k == key) return &v;
  }
  return nullptr;
}

std::string PassOptions::get(std::string_view key, std::string_view default_value) const {
  const std::string* v = find(key);
  return v ? *v : std::string(default_value);
}

double PassOptions::get_double(std::string_view pass, std::string_view key,
                               double default_value) const {
  const std::string* v = find(key);
  return v ? parse_number(pass, key, *v) : default_value;
}

int64_t PassOptions::get_int(std::string_view pass, std::string_view key,
                             int64_t default_value) const {
  const std::string* v = find(key);
  if (!v) return default_value;
  const auto r = parse_whole_number<int64_t>(*v);
  if (!r.whole || r.ec != std::errc()) {
    throw InvalidArgument(
        fmt::format("option {} of pass {} must be an integer, got '{}'", key, pass, *v));
  }
  return r.value;
}

std::vector<double> PassOptions::get_double_list(std::string_view pass, std::string_view key,
                                                 std::vector<double> default_value) const {
  const std::string* v = find(key);
  if (!v) return default_value;
  std::vector<double> out;
  std::string_view rest = *v;
  for (;;) {
    const size_t colon = rest.find(':');
    out.push_back(parse_number(pass, key, rest.substr(0, colon)));
    if (colon == std::string_view::npos) break;
    rest.remove_prefix(colon + 1);
  }
  return out;
}

void PassRegistry::add(PassInfo info) {
  FUNCOL_CHECK(info.create != nullptr, "pass " + info.name + " has no factory");
  auto it = std::lower_bound(passes_.begin(), passes_.end(), info.name,
                             [](const PassInfo& p, const std::string& n) { return p.name < n; });
  if (it != passes_.end() && it->name == info.name) {
    throw InvalidArgument(fmt::format("pass '{}' is registered twice", info.name));
  }
  passes_.insert(it, std::move(info));
}

const PassInfo* PassRegistry::find(std::string_view name) const {
  for (const PassInfo& p : passes_) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string PassRegistry::names() const {
  std::string out;
  for (const PassInfo& p : passes_) out += (out.empty() ? "" : ", ") + p.name;
  return out;
}

std::unique_ptr<Pass> PassRegistry::create(std::string_view name,
                                           const PassOptions& options) const {
  const PassInfo* info = find(name);
  if (!info) throw InvalidArgument(fmt::format("unknown pass '{}' (available: {})", name, names()));
  for (const auto& [key, value] : options.entries()) {
    if (std::find(info->options.begin(), info->options.end(), key) == info->options.end()) {
      throw InvalidArgument(fmt::format(
          "unknown option '{}' for pass {} ({})", key, name,
          info->options.empty() ? std::string("it takes none")
                                : fmt::format("options: {}", fmt::join(info->options, ", "))));
    }
  }
  return info->create(options);
}

const PassRegistry& default_pass_registry() {
  static const PassRegistry registry = [] {
    PassRegistry r;
    register_all_passes(r);
    return r;
  }();
  return registry;
}

}  // namespace funcol
