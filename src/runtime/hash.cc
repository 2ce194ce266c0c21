// Hashes: XXH3-64 of bytes, tensor digests, and the cross-rank check that every rank runs one
// graph.
#include <xxhash.h>

#include <fmt/format.h>

#include <fmt/ranges.h>
#include <algorithm>
#include <cstring>
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

namespace {

// Every rank's `mine`, in rank order (an all_gather over `world`, labelled as the Executor's).
std::vector<int64_t> gather_i64(ProcessGroup& world, int64_t mine) {
  Tensor in = Tensor::from_vector<int64_t>({mine});
  Tensor all = Tensor::empty({world.size()}, DType::I64);
  {
    const dist_detail::InternalStep step("Executor");
    world.all_gather(all, in)->wait();
  }
  return all.to_vector<int64_t>();
}

// The printed graphs of the ranks differ: the line of their first differing byte (1-based;
// the bytes before it are the same on every rank, so it is too) and each rank's text of that
// line around the byte ("" past the end of its graph), for the message. The ranks search in
// lockstep, halving the bytes each round (one all_gather of a prefix's hash), so every rank
// takes the same branches; then they gather their text of the line, at most kShownBytes of it,
// and a hash of the whole line (ranks may differ again past what is shown).
struct Difference {
  int64_t line = 0;
  std::vector<std::string> shown;      // per rank
  std::vector<int64_t> line_hashes;    // per rank
};
Difference first_difference(const std::string& text, ProcessGroup& world) {
  constexpr size_t kBefore = 60;      // bytes shown before the first differing one
  constexpr size_t kShownBytes = 128;  // with the "..." at either end
  const std::vector<int64_t> sizes = gather_i64(world, static_cast<int64_t>(text.size()));
  // The first `same` bytes are the same on every rank; the first `differ` are not (they are
  // every rank's whole text, which differ).
  size_t same = 0;
  auto differ = static_cast<size_t>(*std::max_element(sizes.begin(), sizes.end()));
  while (differ - same > 1) {
    const size_t mid = same + (differ - same) / 2;
    const std::vector<int64_t> hashes = gather_i64(
        world, static_cast<int64_t>(xxh3_64(text.data(), std::min(mid, text.size()))));
    const bool all_same = std::all_of(hashes.begin(), hashes.end(),
                                      [&](int64_t h) { return h == hashes[0]; });
    (all_same ? same : differ) = mid;
  }
  const size_t at = same;  // the first byte that differs (or lies past some rank's end)
  const int64_t line =
      1 + std::count(text.begin(), text.begin() + static_cast<ptrdiff_t>(at), '\n');
  size_t line_begin = at == 0 ? 0 : text.rfind('\n', at - 1);
  line_begin = line_begin == std::string::npos || at == 0 ? 0 : line_begin + 1;
  size_t begin = line_begin;
  while (begin < at && text[begin] == ' ') ++begin;  // the indentation
  const size_t end = std::min(text.find('\n', at), text.size());
  std::string shown;
  if (begin < end) {
    const size_t from = at - begin > kBefore ? at - kBefore : begin;
    const size_t to = std::min(end, from + kShownBytes - 6);
    shown = (from > begin ? "..." : "") + text.substr(from, to - from) + (to < end ? "..." : "");
  }
  std::vector<uint8_t> mine(kShownBytes, 0);
  std::copy(shown.begin(), shown.end(), mine.begin());
  Tensor in = Tensor::from_vector<uint8_t>(mine);
  Tensor all = Tensor::empty({world.size() * static_cast<int64_t>(kShownBytes)}, DType::U8);
  {
    const dist_detail::InternalStep step("Executor");
    world.all_gather(all, in)->wait();
  }
  const std::vector<uint8_t> bytes = all.to_vector<uint8_t>();
  Difference difference{line, {}, {}};
  for (int r = 0; r < world.size(); ++r) {
    const auto* first = reinterpret_cast<const char*>(bytes.data()) + r * kShownBytes;
    difference.shown.emplace_back(first, strnlen(first, kShownBytes));
  }
  difference.line_hashes = gather_i64(
      world, static_cast<int64_t>(xxh3_64(text.data() + line_begin, end - line_begin)));
  return difference;
}

}  // namespace

void check_same_graph(const Graph& graph, ProcessGroup& world) {
  if (world.size() == 1) return;
  std::string text;
  print_to(graph, text);
  // Headed (a peer making a group instead fails with this rank, at once) and labelled, so that
  // it never pairs with a user's collective a peer issued instead of making its Executor: the
  // peer's all_gather of one i64 would hold this rank's hash.
  dist_detail::begin_step(world, "check_same_graph", "Executor");
  const std::vector<int64_t> hashes =
      gather_i64(world, static_cast<int64_t>(xxh3_64(text.data(), text.size())));
  if (std::all_of(hashes.begin(), hashes.end(), [&](int64_t h) { return h == hashes[0]; })) {
    return;
  }
  const Difference difference = first_difference(text, world);
  // Ranks grouped by their whole line, groups in order of their first rank.
  std::vector<std::pair<int64_t, std::vector<int>>> groups;
  for (int r = 0; r < world.size(); ++r) {
    const int64_t h = difference.line_hashes[static_cast<size_t>(r)];
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == h; });
    if (it == groups.end()) {
      groups.push_back({h, {r}});
    } else {
      it->second.push_back(r);
    }
  }
  std::string parts;
  std::vector<std::string> said;
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::vector<int>& ranks = groups[i].second;
    const std::string& t = difference.shown[static_cast<size_t>(ranks[0])];
    if (i > 0) parts += i + 1 == groups.size() ? " and " : ", ";
    parts += fmt::format("{} on {} {}", t.empty() ? "past the end" : fmt::format("`{}`", t),
                         ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ","));
    // The same text as an earlier group's: they differ past what is shown.
    if (std::find(said.begin(), said.end(), t) != said.end()) {
      parts += ", whose line differs further on";
    }
    said.push_back(t);
  }
  throw InvalidArgument(fmt::format(
      "graph @{} differs between ranks: its printed line {} is {} (every rank must run the same "
      "graph; graphs traced with per-rank split sizes, such as permute_tensor's, need "
      "ExecutorOptions::check_same_graph = false)",
      graph.name(), difference.line, parts));
}

}  // namespace funcol
