// The functional collectives API (DESIGN §4): tensor in, tensor out, asynchronous, waited on
// first use. Semantics and error messages follow PyTorch's _functional_collectives.py.
// Under a tracer they record graph nodes; on an input a GradTape tracks they are differentiable
// (recorded on the tape as the *_autograd variants of <funcol/api/autograd.h> are). On meta
// inputs (no data) outside a tracer they give what PyTorch's meta kernels give: after the same
// checks, meta results of the result shapes, nothing issued (the in-place forms leave their
// meta output as it is; a coalesced call takes all meta inputs or none). The group is resolved
// as for real tensors: a rank list whose group does not exist yet makes it, a collective over
// the world that every rank must join, as in PyTorch.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "funcol/core/tensor.h"
#include "funcol/dist/device_mesh.h"
#include "funcol/dist/process_group.h"

namespace funcol {

// Any of the seed's group forms (RANK_TYPES), resolved against the calling rank's registry:
//  - a group name ("world", a mesh dim name, a new_group name);
//  - a list of global ranks (deprecated: warns once per process);
//  - a list of rank lists: the calling rank uses the list that contains it (unequal sizes:
//    "group sizes must be identical found A and B");
//  - a ProcessGroup (reference or shared_ptr);
//  - a 1-D DeviceMesh (n-D: "Only 1D mesh is supported, pass in (DeviceMesh, int) together if
//    mesh > 1D");
//  - a (DeviceMesh, dim) pair.
// Groups for rank lists are found among the calling rank's registered groups (the same global
// ranks; order does not matter: groups span sorted ranks, as torch.distributed.new_group), or
// created on first use. Creating is collective over the world: every rank
// of the world must resolve the same spec at the same point, in the same order. A list of rank
// lists creates all its groups at once (world.split_group), so it should partition the world.
// A plain rank list is created with new_group(world, ranks) when not found; a rank outside the
// list gets an error at once and takes no part, so for a strict subset create the group first
// on every rank with new_group(world, ranks) (or make the non-members call that concurrently).
namespace api_detail {

// One element of a braced group argument: a rank (`0`) or a rank list (`{0, 1}`, or a
// std::vector<int>). With separate initializer_list<int> and initializer_list<vector<int>>
// constructors, C++ would read {{0}, {1}} as the rank list [0, 1] ({0} initialises an int), so
// one-rank lists (tensor-parallel size 1) silently meant the whole group.
class RankOrRanks {
 public:
  RankOrRanks(int rank) : ranks_{rank}, is_list_(false) {}
  RankOrRanks(std::initializer_list<int> ranks) : ranks_(ranks), is_list_(true) {}
  RankOrRanks(std::vector<int> ranks) : ranks_(std::move(ranks)), is_list_(true) {}
  const std::vector<int>& ranks() const { return ranks_; }
  bool is_list() const { return is_list_; }

 private:
  std::vector<int> ranks_;
  bool is_list_;
};

}  // namespace api_detail

class GroupSpec {
 public:
  // A null name becomes the empty name, which resolve() rejects.
  GroupSpec(const char* name) : value_(std::string(name ? name : "")) {}
  GroupSpec(std::string name) : value_(std::move(name)) {}
  GroupSpec(std::vector<int> ranks) : value_(std::move(ranks)) {}
  GroupSpec(std::vector<std::vector<int>> rank_lists) : value_(std::move(rank_lists)) {}
  // A braced argument: {0, 1} is a rank list, {{0, 1}, {2, 3}} and {{0}, {1}} lists of rank
  // lists; ranks and lists mixed ({0, {1}}) throw InvalidArgument.
  GroupSpec(std::initializer_list<api_detail::RankOrRanks> items);
  // A std::initializer_list<int> or <std::vector<int>> object: a rank list or a list of rank
  // lists. (A braced argument deduces no L here, so every braced form takes the constructor
  // above; an initializer_list<T> parameter would take {0, {1}} as the ranks [0, 1].)
  template <typename L, typename List = std::remove_cvref_t<L>,
            typename = std::enable_if_t<std::is_same_v<List, std::initializer_list<int>> ||
                                        std::is_same_v<List,
                                                       std::initializer_list<std::vector<int>>>>>
  GroupSpec(L&& items) {
    if constexpr (std::is_same_v<List, std::initializer_list<int>>) {
      value_ = std::vector<int>(items);
    } else {
      value_ = std::vector<std::vector<int>>(items);
    }
  }
  GroupSpec(ProcessGroup& group) : value_(&group) {}
  GroupSpec(const std::shared_ptr<ProcessGroup>& group) : value_(group.get()) {}
  GroupSpec(const DeviceMesh& mesh) : value_(&mesh) {}
  GroupSpec(std::pair<const DeviceMesh*, int> mesh_dim) : value_(mesh_dim) {}
  // std::make_pair(&mesh, dim) of a non-const mesh (a template, so that it does not compete
  // with the constructor above).
  template <typename Mesh,
            typename = std::enable_if_t<std::is_same_v<std::remove_const_t<Mesh>, DeviceMesh>>>
  GroupSpec(std::pair<Mesh*, int> mesh_dim)
      : value_(std::pair<const DeviceMesh*, int>(mesh_dim.first, mesh_dim.second)) {}
  // The seed's (mesh, dim) pair; as a function argument, write it {mesh, dim} (a braced
  // {&mesh, dim} there does not compile: GroupSpec({&mesh, dim}) and std::make_pair do).
  GroupSpec(const DeviceMesh& mesh, int dim) : value_(std::make_pair(&mesh, dim)) {}
  // A bare int or nullptr is no group (the seed's "Unsupported group type"): a compile error
  // here rather than a literal 0 silently becoming a null group name. A one-rank list written
  // as a constructor call is GroupSpec{0}: clang reads GroupSpec({0}) as this int (g++ as the
  // list); as a function argument, {0} is the list on both.
  GroupSpec(int) = delete;
  GroupSpec(std::nullptr_t) = delete;

  // The ProcessGroup of the calling rank. Throws InvalidArgument with the seed's messages.
  ProcessGroup& resolve() const;
  // The group size without touching a backend when possible (tracing).
  int size() const { return resolve().size(); }
  // The group name when this spec is one, else null: tracing records names without resolving
  // them (the tracer's declared groups give their sizes).
  const std::string* name_if_string() const { return std::get_if<std::string>(&value_); }

 private:
  std::variant<std::string, std::vector<int>, std::vector<std::vector<int>>, ProcessGroup*,
               const DeviceMesh*, std::pair<const DeviceMesh*, int>>
      value_;
};

// all_reduce: a new tensor holding the reduction of `t` over the group. reduce_op is
// case-insensitive (sum avg product min max band bor bxor); bitwise ops need integer or bool.
// Integer sums and products wrap in the dtype, as in PyTorch and NCCL; avg sums so, then
// divides once, truncating (u8 avg of 200 and 100 is (300 mod 256) / 2 = 22).
Tensor all_reduce(const Tensor& t, const std::string& reduce_op, const GroupSpec& group);
// Gathers along gather_dim (input must be contiguous). A 0-d input gathers to [group_size].
// gather_dim != 0 is lazy too: the rank-major blocks are moved into place on first use.
Tensor all_gather_tensor(const Tensor& t, int64_t gather_dim, const GroupSpec& group);
// size(scatter_dim) must be a multiple of the group size; the input must be at least 1-d.
// scatter_dim != 0 rearranges a copy of the input before the collective (the seed's chunk +
// cat), so only scatter_dim 0 requires a contiguous input, as in the seed.
Tensor reduce_scatter_tensor(const Tensor& t, const std::string& reduce_op, int64_t scatter_dim,
                             const GroupSpec& group);
// Both split lists or neither (neither: even split of dim 0, which must divide). Sizes count
// rows of dim 0: group_size entries each, none negative, input splits summing to size(0).
Tensor all_to_all_single(const Tensor& t, std::optional<std::vector<int64_t>> output_split_sizes,
                         std::optional<std::vector<int64_t>> input_split_sizes,
                         const GroupSpec& group);
// Every rank gets rank `src`'s tensor (src is a rank of the group). A new tensor.
Tensor broadcast(const Tensor& t, int src, const GroupSpec& group);
// src_dst[m] == n: group rank m sends to n (src_dst must be a permutation of the group ranks).
// Returns what this rank received, in t's shape. Traced, it records this rank's
// all_to_all_single (a graph of this rank's own; see docs/runtime.md).
Tensor permute_tensor(const Tensor& t, const std::vector<int>& src_dst, const GroupSpec& group);

// Coalesced forms: one collective (one Work) for the whole list. An empty list returns an empty
// list without communicating.
std::vector<Tensor> all_reduce_coalesced(const std::vector<Tensor>& inputs,
                                         const std::string& reduce_op, const GroupSpec& group);
std::vector<Tensor> all_gather_into_tensor_coalesced(const std::vector<Tensor>& inputs,
                                                     const GroupSpec& group);
std::vector<Tensor> reduce_scatter_tensor_coalesced(const std::vector<Tensor>& inputs,
                                                    const std::string& reduce_op,
                                                    const std::vector<int64_t>& scatter_dims,
                                                    const GroupSpec& group);

// Waits for t's pending storage and returns t. Waiting twice, or on a ready tensor, is free.
const Tensor& wait_tensor(const Tensor& t);
// Waits every tensor (a shared Work is waited once). Empty list: InvalidArgument.
void wait_tensors(const std::vector<Tensor>& tensors);

// In-place remaps of the classic torch.distributed API: out.copy_(functional(...)), so they
// return with the data in place. The output's dtype must be the input's (InvalidArgument: the
// classic collectives do not convert). The collective is issued before the output's shape
// (ShapeError) and dtype are checked, so a rank with a bad output never leaves its peers waiting.
const Tensor& all_reduce_inplace(const Tensor& t, const std::string& reduce_op,
                                 const GroupSpec& group);
// Gathers `t` into the list (each entry t's shape; sizes must match: "Remapping variable size
// all_gather is not yet supported").
void all_gather_inplace(const std::vector<Tensor>& tensor_list, const Tensor& t,
                        const GroupSpec& group);
const Tensor& all_gather_tensor_inplace(const Tensor& output, const Tensor& input,
                                        const GroupSpec& group, int64_t gather_dim = 0);
const Tensor& reduce_scatter_tensor_inplace(const Tensor& output, const Tensor& input,
                                            const GroupSpec& group,
                                            const std::string& reduce_op = "sum",
                                            int64_t scatter_dim = 0);
const Tensor& all_to_all_inplace(const Tensor& output, const Tensor& input,
                                 std::optional<std::vector<int64_t>> output_split_sizes,
                                 std::optional<std::vector<int64_t>> input_split_sizes,
                                 const GroupSpec& group);

}  // namespace funcol
