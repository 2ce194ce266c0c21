// Hashes: XXH3-64 of bytes, tensor digests, and the cross-rank check that every rank runs one
// graph.
#include <xxhash.h>

#include <fmt/format.h>

#include <fmt/ranges.h>
#include <algorithm>
#include <memory>
#include <new>

#include "funcol/core/error.h"
#include "funcol/dist/work.h"
#include "funcol/graph/printer.h"
#include "funcol/runtime/executor.h"

#include "dist/checks.h"

namespace funcol {

uint64_t xxh3_64(const void* data, size_t n) {
  return static_cast<uint64_t>(XXH3_64bits(n == 0 ? nullptr : data, n));
}

namespace {

// Feeds the elements of `t` in logical order to `state`, a contiguous piece at a time: a strided
// or expanded tensor is copied a few MiB at a time, never whole (an expanded view of 4 bytes
// may stand for gigabytes).
void hash_elements(XXH3_state_t* state, const Tensor& t) {
  constexpr size_t kPieceBytes = size_t{4} << 20;
  if (t.numel() == 0) return;
  if (t.is_contiguous() || t.nbytes() <= kPieceBytes) {
    const Tensor c = t.contiguous();  // t itself when contiguous
    XXH3_64bits_update(state, c.const_data_ptr(), c.nbytes());
    return;
  }
  // Pieces along the first dim longer than 1 (there is one: the tensor has over 4 MiB).
  int64_t d = 0;
  while (t.sizes()[static_cast<size_t>(d)] == 1) ++d;
  const int64_t n = t.sizes()[static_cast<size_t>(d)];
  const size_t row_bytes = t.nbytes() / static_cast<size_t>(n);
  const auto rows = std::max<int64_t>(1, static_cast<int64_t>(kPieceBytes / row_bytes));
  for (int64_t start = 0; start < n; start += rows) {
    hash_elements(state, t.narrow(d, start, std::min(rows, n - start)));
  }
}

}  // namespace

std::string tensor_digest(const Tensor& tensor) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                 &XXH3_freeState);
  if (!state) throw std::bad_alloc();
  XXH3_64bits_reset(state.get());
  hash_elements(state.get(), tensor);
  return fmt::format("{:016x}", static_cast<uint64_t>(XXH3_64bits_digest(state.get())));
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
  // Headed (a peer making a group instead fails with this rank, at once) and labelled, so that
  // it never pairs with a user's collective a peer issued instead of making its Executor: the
  // peer's all_gather of one i64 would hold this rank's hash.
  dist_detail::begin_step(world, "check_same_graph", "Executor");
  {
    const dist_detail::InternalStep step("Executor");
    world.all_gather(all, in)->wait();
  }
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
