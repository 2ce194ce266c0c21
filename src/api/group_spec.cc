// GroupSpec::resolve: turns any of the seed's group forms into the calling rank's ProcessGroup.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "dist/checks.h"
#include "funcol/api/functional.h"
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/device_mesh.h"
#include "funcol/dist/process_group.h"

namespace funcol {
namespace {

ProcessGroup& require_world() {
  ProcessGroup* world = current_world();
  if (world == nullptr) {
    throw InvalidArgument(
        "no current rank: call inside run_local or after init (group names and rank lists "
        "resolve against the calling thread's rank; on a thread a rank started, pass the "
        "ProcessGroup or make it current there with funcol::WorldScope scope(&world))");
  }
  return *world;
}

// The seed warns (FutureWarning) on rank-list groups; once per process is enough noise.
void warn_rank_list_deprecated() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::fputs(
        "funcol: warning: passing a list of ranks as a group is deprecated; pass a "
        "ProcessGroup, a DeviceMesh or a group name\n",
        stderr);
  });
}

// Every rank of `list` in [0, world_size) and seen only once (`seen` spans all lists of a spec);
// `spec` is the whole spec as printed in messages.
void check_ranks(const std::vector<int>& list, int world_size, std::set<int>& seen,
                 const std::string& spec) {
  if (list.empty()) throw InvalidArgument(fmt::format("empty rank list in group {}", spec));
  for (int r : list) {
    if (r < 0 || r >= world_size) {
      throw InvalidArgument(fmt::format("rank {} in group {} is out of range for world size {}", r,
                                        spec, world_size));
    }
    if (!seen.insert(r).second) {
      throw InvalidArgument(fmt::format("rank {} appears twice in group {}", r, spec));
    }
  }
}

ProcessGroup& resolve_rank_list(const std::vector<int>& ranks) {
  warn_rank_list_deprecated();
  ProcessGroup& world = require_world();
  if (ranks.empty()) throw InvalidArgument("empty rank list as group");
  std::set<int> seen;
  check_ranks(ranks, world.size(), seen, fmt::format("{}", ranks));
  const int me = world.rank();
  if (std::find(ranks.begin(), ranks.end(), me) == ranks.end()) {
    throw InvalidArgument(fmt::format("rank {} is not in the group's ranks {}", me, ranks));
  }
  // Order does not matter: groups span sorted ranks (as torch.distributed.new_group and the
  // seed's find-or-create by ranks).
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  if (auto group = world.registry().find_by_ranks(sorted)) return *group;
  // Collective over the world (see the header): every other rank creates it at the same point.
  // Ranks that passed different lists most likely each passed their own set (one group per
  // set, SPMD style): the mismatch error says what to pass instead.
  const dist_detail::SplitCaller hint(
      dist_detail::split_caller(),
      "a rank list as a group is created over the whole world, which must all pass the same "
      "list; for a group per set of ranks pass the list of rank lists, e.g. {{0, 1}, {2, 3}}");
  std::shared_ptr<ProcessGroup> group = new_group(world, sorted);
  FUNCOL_CHECK(group != nullptr, "new_group returned null on a member rank");
  return *group;
}

ProcessGroup& resolve_rank_lists(const std::vector<std::vector<int>>& lists) {
  ProcessGroup& world = require_world();
  if (lists.empty()) throw InvalidArgument("empty list of rank lists as group");
  for (const auto& list : lists) {
    if (list.size() != lists.front().size()) {
      throw InvalidArgument(fmt::format("group sizes must be identical found {} and {}",
                                        lists.front().size(), list.size()));
    }
  }
  std::set<int> seen;
  for (const auto& list : lists) check_ranks(list, world.size(), seen, fmt::format("{}", lists));
  const int me = world.rank();
  // Neither order matters (each rank takes the list that holds it): the ranks may list their
  // own first. Sorted, the lists are the same on every rank.
  std::vector<std::vector<int>> sorted = lists;
  for (auto& list : sorted) std::sort(list.begin(), list.end());
  std::sort(sorted.begin(), sorted.end());
  const std::vector<int>* mine = nullptr;
  for (const auto& list : sorted) {
    if (std::find(list.begin(), list.end(), me) != list.end()) mine = &list;
  }
  if (mine == nullptr) {
    throw InvalidArgument(fmt::format("rank {} is not in any of the rank lists {}", me, lists));
  }
  std::shared_ptr<ProcessGroup> existing = world.registry().find_by_ranks(*mine);
  if (static_cast<int>(seen.size()) != world.size()) {
    // Only the listed ranks call: they may use groups that exist (as the seed), but creating
    // groups is collective over the world, and the ranks left out never join it. Fail at once
    // rather than wait for them.
    if (existing) return *existing;
    std::vector<int> missing;
    for (int r = 0; r < world.size(); ++r) {
      if (!seen.count(r)) missing.push_back(r);
    }
    throw InvalidArgument(fmt::format(
        "the rank lists {} leave out ranks {} of the world: their groups do not exist yet, and "
        "creating them is collective over the whole world (pass a partition of it)",
        lists, missing));
  }
  // A partition: every rank calls. The ranks reuse their groups only when every rank has one
  // (registries differ: a group is registered on its members only), else every rank splits
  // with the same lists and the same fresh name.
  // Once every rank resolved a partition, each remembers it: later uses are a local lookup, as
  // the seed's find by ranks, not a collective over the world every call.
  GroupRegistry& registry = world.registry();
  if (existing && registry.resolved_partition(sorted)) return *existing;
  constexpr const char* kWhat = "a group spec of rank lists";
  if (!dist_detail::on_every_rank(world, existing != nullptr, kWhat)) {
    const std::string name = dist_detail::agreed_group_name(world, kWhat);
    // Its errors name the spec, not split_group.
    const dist_detail::SplitCaller caller(
        kWhat, "every rank must pass the same partition of the world, in any order");
    existing = world.split_group(sorted, name);
    FUNCOL_CHECK(existing != nullptr, "split_group returned null on a member rank");
  }
  registry.add_resolved_partition(std::move(sorted));
  return *existing;
}

ProcessGroup& resolve_mesh_dim(const DeviceMesh* mesh, int dim) {
  if (mesh == nullptr) throw InvalidArgument("null DeviceMesh as group");
  return *mesh->group(dim);
}

}  // namespace

GroupSpec::GroupSpec(std::initializer_list<api_detail::RankOrRanks> items) {
  const bool lists = items.size() > 0 && items.begin()->is_list();
  std::vector<int> ranks;
  std::vector<std::vector<int>> rank_lists;
  for (const api_detail::RankOrRanks& item : items) {
    if (item.is_list() != lists) {
      throw InvalidArgument(
          "a braced group holds ranks and rank lists both: give ranks ({0, 1}) or rank lists "
          "({{0, 1}, {2, 3}})");
    }
    if (lists) {
      rank_lists.push_back(item.ranks());
    } else {
      ranks.push_back(item.ranks().front());
    }
  }
  if (lists) {
    value_ = std::move(rank_lists);
  } else {
    value_ = std::move(ranks);
  }
}

ProcessGroup& GroupSpec::resolve() const {
  return std::visit(
      [](const auto& v) -> ProcessGroup& {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, std::string>) {
          if (v.empty()) throw InvalidArgument("empty group name");
          return *require_world().registry().get(v);
        } else if constexpr (std::is_same_v<V, std::vector<int>>) {
          return resolve_rank_list(v);
        } else if constexpr (std::is_same_v<V, std::vector<std::vector<int>>>) {
          return resolve_rank_lists(v);
        } else if constexpr (std::is_same_v<V, ProcessGroup*>) {
          if (v == nullptr) {
            throw InvalidArgument(
                "null ProcessGroup as group (new_group returns null on the ranks it leaves out)");
          }
          return *v;
        } else if constexpr (std::is_same_v<V, const DeviceMesh*>) {
          if (v == nullptr) throw InvalidArgument("null DeviceMesh as group");
          if (v->ndim() != 1) {
            throw InvalidArgument(
                "Only 1D mesh is supported, pass in (DeviceMesh, int) together if mesh > 1D");
          }
          return resolve_mesh_dim(v, 0);
        } else {
          return resolve_mesh_dim(v.first, v.second);
        }
      },
      value_);
}

}  // namespace funcol
