// Eager autograd: a tape that records the ops run on its tensors and differentiates them with
// the op table's gradient rules (the code the autodiff pass uses), and the `*_autograd`
// functional collectives of DESIGN §4.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "funcol/api/functional.h"
#include "funcol/core/tensor.h"
#include "funcol/graph/graph.h"

namespace funcol {

// Records differentiable eager computation, like torch.autograd's tape. A tensor returned by
// requires_grad() is a *leaf*; every op run through call() or a functional collective (a
// `*_autograd` variant or the plain function: PyTorch registers the rules on its base ops) with
// a tracked operand runs eagerly at once and is recorded as a node of the tape's graph, its
// results tracked too. backward(loss) appends the backward of the recorded graph with the op
// table's rules (append_backward, as the autodiff pass), runs those nodes eagerly on this rank
// (collectives through the functional API, each waited) and adds the gradients into grad().
//
// One tape per rank (thread); every rank must record the same ops in the same order, since the
// backward collectives are issued in the order of the recorded graph, and every rank's loss
// must reach the same collectives: as PyTorch's, a backward differentiates only the
// collectives its loss reaches, so a collective whose result one rank's loss uses and
// another's does not (a loss on some ranks only) leaves the ranks' collectives out of step.
// Add the unused result into that rank's loss with a zero weight (loss + 0 * sum(result)): its
// backward collective then runs with zero gradients. Unlike PyTorch's, the collectives a
// backward issues are labelled, and the backends compare the label as they compare the call
// (threads always; mpi and gloo with FUNCOL_DEBUG=detail, and without it such a pair times out
// instead, as labelled collectives travel apart): a backward's collective never pairs with a
// user's own, so where the rank whose loss reaches fewer collectives goes on to a forward
// collective, both sides get a CommError "mismatched collectives: rank 0 issued ... [issued by
// GradTape::backward] but rank 1 issued ..." instead of wrong sums. (Where it goes on to
// another backward, its collectives pair as they come: the number of backward calls may
// differ between ranks, e.g. one per group's loss, so nothing tells those apart.)
// A tape records only on the thread that made it: on any other, a tracked tensor (or a Tensor
// method's view of one) given to an op or a collective, requires_grad, backward and zero_grad are
// refused (InvalidArgument), since taken as a constant the tensor would lose its gradient (a copy,
// t.clone(), is a constant); grad() may be read anywhere while the tape's thread does not record.
// data_ptr() and data<T>() count as writes (Storage::version) for the version checks below;
// const_data<T>() reads. Tensors stay tracked as long as the tape lives; a tensor of a destroyed
// tape counts as untracked. Tensor methods (t.view(...)) are not recorded: use call(). A view they
// make of a tracked tensor is refused (InvalidArgument) where it enters call(), funcol::ops or a
// collective, since as a constant it would lose its gradient without a word; copies they make
// (t.to(...), t.clone()) are untracked constants, and so is the tensor requires_grad() was given
// (the leaf's alias).
// The in-place collectives may write into such views. The tape keeps everything it recorded
// and each backward walks all of it: record each training step on a tape of its own.
class GradTape {
 public:
  GradTape();
  ~GradTape();
  GradTape(const GradTape&) = delete;
  GradTape& operator=(const GradTape&) = delete;

  // A tensor sharing t's data that the tape tracks as a leaf. t must have a floating dtype, have
  // data (not a meta tensor, such as a traced value) and not be tracked already
  // (InvalidArgument).
  Tensor requires_grad(const Tensor& t);

  // Runs op `op` of the op table (not a collective: use the `*_autograd` functions) on
  // `operands`; records it when an operand is tracked by this tape (results are then tracked).
  // Untracked operands enter the graph as constants. Throws like ops::call, and InvalidArgument
  // for an operand tracked by another tape, or for a recorded op's result written in place
  // since (in-place writes are not recorded, so the graph would not say what it holds; leaves
  // may be written between uses).
  std::vector<Tensor> call(std::string_view op, std::span<const Tensor> operands,
                           const NamedAttrs& attrs = {});
  Tensor call_one(std::string_view op, std::span<const Tensor> operands,
                  const NamedAttrs& attrs = {});

  // Adds d loss / d leaf to grad(leaf) for every leaf. `loss` must be a tracked scalar of a
  // floating dtype. Errors when backward runs (InvalidArgument, the graph left unchanged): a
  // non-sum all_reduce / reduce_scatter on the way ("all_reduce backward only supports 'sum'
  // reduction, got 'max' (node %ar)"), broadcast, an op without a rule, a value the gradient
  // reads that was written in place since it was recorded (Storage::version, PyTorch's
  // version check). May be called again: gradients accumulate, as in PyTorch with
  // retain_graph=True (the tape keeps its graph; PyTorch frees it by default). A backward that
  // fails after its gradient graph was built (such a version check, a kernel's error, a failed
  // collective) first issues its collectives not issued yet, failed, so that a rank failing
  // alone does not fall behind its peers: their backward fails naming it ("rank 1 could not
  // take part: it gave up on the rest of its backward after an error: ..."). So does one whose
  // loss is not a scalar (it issues, failed, the collectives its sum's backward would).
  void backward(const Tensor& loss);

  // The accumulated gradient of `leaf` (a tensor requires_grad() returned), zeros of its type
  // when nothing reached it yet. InvalidArgument for any other tensor.
  Tensor grad(const Tensor& leaf) const;
  // Forgets every accumulated gradient.
  void zero_grad();

  // True when `t` is tracked by this tape.
  bool tracks(const Tensor& t) const;
  // The recorded forward graph: inputs are the leaves and constants, in order of first use.
  const Graph& graph() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// True when `t` is tracked by a live GradTape.
bool is_tracked(const Tensor& t);

// The autograd variants of the functional collectives (DESIGN §4, PyTorch's
// `*_autograd`): the same eager result as the plain function; when the input is tracked by a
// tape, the collective and its wait_tensor are recorded (gather_dim / scatter_dim != 0 as the
// dim-0 collective plus recorded split and cat), so backward applies the rules: all_reduce
// (sum only) → all_reduce sum; all_gather → reduce_scatter sum; reduce_scatter (sum only) →
// all_gather; all_to_all_single → splits swapped; coalesced → coalesced. A non-sum reduce op
// runs forward and fails when backward runs.
Tensor all_reduce_autograd(const Tensor& t, const std::string& reduce_op, const GroupSpec& group);
Tensor all_gather_tensor_autograd(const Tensor& t, int64_t gather_dim, const GroupSpec& group);
Tensor reduce_scatter_tensor_autograd(const Tensor& t, const std::string& reduce_op,
                                      int64_t scatter_dim, const GroupSpec& group);
Tensor all_to_all_single_autograd(const Tensor& t,
                                  std::optional<std::vector<int64_t>> output_split_sizes,
                                  std::optional<std::vector<int64_t>> input_split_sizes,
                                  const GroupSpec& group);
std::vector<Tensor> all_reduce_coalesced_autograd(const std::vector<Tensor>& inputs,
                                                  const std::string& reduce_op,
                                                  const GroupSpec& group);
std::vector<Tensor> all_gather_into_tensor_coalesced_autograd(const std::vector<Tensor>& inputs,
                                                              const GroupSpec& group);
// Scatters along dim 0 of every input (the coalesced IR op has no scatter dims).
std::vector<Tensor> reduce_scatter_tensor_coalesced_autograd(const std::vector<Tensor>& inputs,
                                                             const std::string& reduce_op,
                                                             const GroupSpec& group);

}  // namespace funcol
