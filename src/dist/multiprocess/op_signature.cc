// Encoding and cross-rank comparison of collective signatures (FUNCOL_DEBUG=detail).
#include "dist/multiprocess/op_signature.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "dist/checks.h"
#include "funcol/core/error.h"

namespace funcol::process {
namespace {

constexpr int kSlotsInFull = 8;
// kind, reduce op, root, slot count, hash of every slot, the internal step's label (at most
// kStepBytes - 1 characters, zero-padded), then the slots, then the splits.
constexpr size_t kStepBytes = 48;
constexpr size_t kHeaderBytes =
    2 * sizeof(int64_t) + 2 * sizeof(int64_t) + sizeof(uint64_t) + kStepBytes;
constexpr size_t kSlotBytes = (3 + dist_detail::kShapeWords) * sizeof(int64_t);

class Writer {
 public:
  explicit Writer(std::vector<char>& out) : out_(out) {}
  void put(int64_t v) {
    std::memcpy(out_.data() + pos_, &v, sizeof v);
    pos_ += sizeof v;
  }
  // `text` cut to n - 1 bytes, then zeros up to n.
  void put_text(const std::string& text, size_t n) {
    std::memcpy(out_.data() + pos_, text.data(), std::min(text.size(), n - 1));
    pos_ += n;
  }

 private:
  std::vector<char>& out_;
  size_t pos_ = 0;
};

class Reader {
 public:
  explicit Reader(const char* in) : in_(in) {}
  int64_t get() {
    int64_t v;
    std::memcpy(&v, in_ + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  std::string get_text(size_t n) {
    const std::string text(in_ + pos_, strnlen(in_ + pos_, n));
    pos_ += n;
    return text;
  }

 private:
  const char* in_;
  size_t pos_ = 0;
};

// FNV-1a over every slot, so long coalesced lists compare in full.
uint64_t hash_slots(const std::vector<OpSignature::Slot>& slots) {
  dist_detail::Fnv1a h;
  for (const auto& s : slots) {
    h.mix(static_cast<int64_t>(s.dtype));
    h.mix(s.count);
    h.mix(s.ndim);
    for (int64_t w : s.dims) h.mix(w);
  }
  return h.value();
}

}  // namespace

std::string_view op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::AllReduce:
      return "all_reduce";
    case OpKind::AllGather:
      return "all_gather";
    case OpKind::ReduceScatter:
      return "reduce_scatter";
    case OpKind::AllToAll:
      return "all_to_all";
    case OpKind::Broadcast:
      return "broadcast";
    case OpKind::Barrier:
      return "barrier";
    case OpKind::AllReduceCoalesced:
      return "all_reduce_coalesced";
    case OpKind::AllGatherCoalesced:
      return "all_gather_coalesced";
    case OpKind::ReduceScatterCoalesced:
      return "reduce_scatter_coalesced";
    case OpKind::AllReduceFlat:
      return "all_reduce_flat";
  }
  return "unknown";
}

bool reduces(OpKind kind) {
  return kind == OpKind::AllReduce || kind == OpKind::ReduceScatter ||
         kind == OpKind::AllReduceCoalesced || kind == OpKind::ReduceScatterCoalesced ||
         kind == OpKind::AllReduceFlat;
}

namespace {
bool coalesced(OpKind kind) {
  return kind == OpKind::AllReduceCoalesced || kind == OpKind::AllGatherCoalesced ||
         kind == OpKind::ReduceScatterCoalesced || kind == OpKind::AllReduceFlat;
}
}  // namespace

std::string OpSignature::summary() const {
  std::string s = std::string(op_kind_name(kind)) + "(";
  if (kind == OpKind::Barrier) return s + ")";
  const char* count_name = kind == OpKind::AllToAll ? "row" : "numel";
  if (coalesced(kind)) s += fmt::format("{} tensors: ", slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    if (i) s += ", ";
    if (i == kSlotsInFull) {
      s += "...";
      break;
    }
    s += slots[i].ndim < 0
             ? fmt::format("{} {} {}", dtype_name(slots[i].dtype), count_name, slots[i].count)
             : dist_detail::describe_compared_shape(slots[i].dtype, slots[i].ndim, slots[i].dims,
                                                    kind == OpKind::AllToAll);
  }
  if (reduces(kind)) s += fmt::format(", op {}", reduce_op_name(reduce_op));
  if (kind == OpKind::Broadcast) s += fmt::format(", src {}", root);
  return s + ")" + dist_detail::describe_step(step.empty() ? nullptr : step.c_str());
}

bool OpSignature::same_call(const OpSignature& o) const {
  if (kind != o.kind || slots.size() != o.slots.size() || step != o.step) return false;
  if (reduces(kind) && reduce_op != o.reduce_op) return false;
  if (kind == OpKind::Broadcast && root != o.root) return false;
  return hash_slots(slots) == hash_slots(o.slots) &&
         std::equal(slots.begin(), slots.begin() + std::min<size_t>(slots.size(), kSlotsInFull),
                    o.slots.begin(), [](const Slot& a, const Slot& b) {
                      return a.dtype == b.dtype && a.count == b.count && a.ndim == b.ndim &&
                             a.dims == b.dims;
                    });
}

size_t signature_bytes(int group_size) {
  return kHeaderBytes + kSlotsInFull * kSlotBytes +
         2 * static_cast<size_t>(group_size) * sizeof(int64_t);
}

std::vector<char> encode_signature(const OpSignature& sig, int group_size) {
  std::vector<char> out(signature_bytes(group_size), 0);
  Writer w(out);
  w.put(static_cast<int64_t>(sig.kind));
  w.put(static_cast<int64_t>(sig.reduce_op));
  w.put(sig.root);
  w.put(static_cast<int64_t>(sig.slots.size()));
  w.put(static_cast<int64_t>(hash_slots(sig.slots)));
  w.put_text(sig.step, kStepBytes);
  for (int i = 0; i < kSlotsInFull; ++i) {
    bool have = i < static_cast<int>(sig.slots.size());
    w.put(have ? static_cast<int64_t>(sig.slots[i].dtype) : 0);
    w.put(have ? sig.slots[i].count : 0);
    w.put(have ? sig.slots[i].ndim : -1);
    for (int d = 0; d < dist_detail::kShapeWords; ++d) w.put(have ? sig.slots[i].dims[d] : 0);
  }
  for (int r = 0; r < group_size; ++r) {
    w.put(r < static_cast<int>(sig.input_splits.size()) ? sig.input_splits[r] : 0);
  }
  for (int r = 0; r < group_size; ++r) {
    w.put(r < static_cast<int>(sig.output_splits.size()) ? sig.output_splits[r] : 0);
  }
  return out;
}

OpSignature decode_signature(const char* bytes, int group_size) {
  Reader rd(bytes);
  OpSignature sig;
  sig.kind = static_cast<OpKind>(rd.get());
  sig.reduce_op = static_cast<ReduceOp>(rd.get());
  sig.root = static_cast<int>(rd.get());
  const int64_t nslots = rd.get();
  FUNCOL_CHECK(nslots >= 0, "corrupt collective signature");
  const uint64_t hash = static_cast<uint64_t>(rd.get());
  sig.step = rd.get_text(kStepBytes);
  for (int i = 0; i < kSlotsInFull; ++i) {
    OpSignature::Slot s;
    s.dtype = static_cast<DType>(rd.get());
    s.count = rd.get();
    s.ndim = static_cast<int>(rd.get());
    for (int64_t& d : s.dims) d = rd.get();
    if (i < nslots) sig.slots.push_back(s);
  }
  // Slots past the first eight are known only by the hash: stand-ins that carry it.
  if (nslots > kSlotsInFull) {
    sig.slots.resize(static_cast<size_t>(nslots));
    sig.slots.back().count = static_cast<int64_t>(hash);
  }
  sig.input_splits.resize(group_size);
  sig.output_splits.resize(group_size);
  for (int r = 0; r < group_size; ++r) sig.input_splits[r] = rd.get();
  for (int r = 0; r < group_size; ++r) sig.output_splits[r] = rd.get();
  return sig;
}

OpSignature as_received(const OpSignature& sig, int group_size) {
  const std::vector<char> bytes = encode_signature(sig, group_size);
  return decode_signature(bytes.data(), group_size);
}

std::optional<SignatureDifference> find_difference(const std::vector<RankSignature>& known,
                                                   const std::vector<int>& global_ranks) {
  if (known.empty()) return std::nullopt;
  const OpSignature& first = *known[0].signature;
  const int first_rank = global_ranks[known[0].group_rank];
  for (size_t k = 1; k < known.size(); ++k) {
    const OpSignature& other = *known[k].signature;
    if (!first.same_call(other)) {
      const std::string a = first.summary();
      const std::string b = other.summary();
      // Only the first kSlotsInFull tensors travel in full: say where the difference is when
      // the summaries cannot show it.
      return SignatureDifference{
          false, fmt::format("rank {} issued {} but rank {} issued {}{}", first_rank, a,
                             global_ranks[known[k].group_rank], b,
                             a == b ? fmt::format("; they differ in a tensor after the first {} "
                                                  "(not shown)",
                                                  kSlotsInFull)
                                    : "")};
    }
  }
  if (first.kind != OpKind::AllToAll) return std::nullopt;
  for (const RankSignature& from : known) {
    for (const RankSignature& to : known) {
      const int64_t sent = from.signature->input_splits[to.group_rank];
      const int64_t expected = to.signature->output_splits[from.group_rank];
      if (sent != expected) {
        return SignatureDifference{
            true, dist_detail::split_mismatch(global_ranks[from.group_rank], sent,
                                              global_ranks[to.group_rank], expected)};
      }
    }
  }
  return std::nullopt;
}

std::optional<SignatureDifference> compare_answers(const OpSignature& mine, int me,
                                                   const std::vector<std::string>& answers,
                                                   const std::vector<int>& global_ranks) {
  const int n = static_cast<int>(global_ranks.size());
  const OpSignature own = as_received(mine, n);  // as the answers read
  std::vector<OpSignature> answered;
  answered.reserve(answers.size());
  std::vector<RankSignature> known;
  for (int g = 0, p = 0; g < n; ++g) {
    if (g == me) {
      known.push_back({g, &own});
      continue;
    }
    const std::string& answer = answers[static_cast<size_t>(p++)];
    if (answer.size() != signature_bytes(n)) continue;  // none, or not this group's
    answered.push_back(decode_signature(answer.data(), n));
    known.push_back({g, &answered.back()});
  }
  return find_difference(known, global_ranks);
}

std::optional<std::string> check_signatures(const std::vector<OpSignature>& signatures,
                                            const std::vector<int>& global_ranks,
                                            const std::string& description) {
  std::vector<RankSignature> known;
  for (size_t r = 0; r < signatures.size(); ++r) {
    known.push_back({static_cast<int>(r), &signatures[r]});
  }
  auto difference = find_difference(known, global_ranks);
  if (!difference) return std::nullopt;
  return difference->splits
             ? fmt::format("{}: {}", description, difference->what)
             : fmt::format("{}: mismatched collectives: {}", description, difference->what);
}

}  // namespace funcol::process
