// Hashes: XXH3-64 of bytes, tensor digests, and the cross-rank check that every rank runs one
// graph.
#include <xxhash.h>

#include <fmt/format.h>

#include <fmt/ranges.h>
#include <algorithm>

#include "funcol/core/error.h"
#include "funcol/dist/work.h"
#include "funcol/graph/printer.h"
#include "funcol/runtime/executor.h"

namespace funcol {

uint64_t xxh3_64(const void* data, size_t n) {
  return static_cast<uint64_t>(XXH3_64bits(n == 0 ? nullptr : data, n));
}

std::string tensor_digest(const Tensor& tensor) {
  uint64_t h = 0;
  if (tensor.numel() == 0) {
    h = xxh3_64(nullptr, 0);
  } else {
    const Tensor c = tensor.contiguous();
    h = xxh3_64(c.const_data_ptr(), c.nbytes());
  }
  return fmt::format("{:016x}", h);
}

uint64_t graph_hash(const Graph& graph) {
  std::string text;
  print_to(graph, text);
  return xxh3_64(text.data(), text.size());
}

void check_same_graph(const Graph& graph, ProcessGroup& world) {
  if (world.size() == 1) return;
  const uint64_t mine = graph_hash(graph);
  Tensor in = Tensor::from_vector<int64_t>({static_cast<int64_t>(mine)});
  Tensor all = Tensor::empty({world.size()}, DType::I64);
  world.all_gather(all, in)->wait();
  const std::vector<int64_t> hashes = all.to_vector<int64_t>();
  bool same = true;
  for (int64_t h : hashes) same &= h == hashes[0];
  if (same) return;
  // Ranks grouped by hash, groups in order of their first rank.
  std::vector<std::pair<int64_t, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(hashes.size()); ++r) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == hashes[r]; });
    if (it == groups.end()) {
      groups.push_back({hashes[r], {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::string parts;
  for (const auto& [h, ranks] : groups) {
    if (!parts.empty()) parts += ", ";
    parts +=
        fmt::format("{} {} {} {:016x}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ","),
                    ranks.size() == 1 ? "has" : "have", static_cast<uint64_t>(h));
  }
  throw InvalidArgument(
      fmt::format("graph @{} differs between ranks: {} (every rank must run the same graph)",
                  graph.name(), parts));
}

}  // namespace funcol
