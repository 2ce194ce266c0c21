// Tests of tracing the functional collectives: recorded nodes, shapes, errors, and traced graphs
// run by the executor giving the eager results bit for bit.
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "funcol/api/functional.h"
#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/device_mesh.h"
#include "funcol/graph/parser.h"
#include "funcol/graph/printer.h"
#include "funcol/graph/tracer.h"
#include "funcol/graph/verifier.h"
#include "funcol/runtime/executor.h"
#include "testing/error_of.h"

namespace funcol {
namespace {

std::vector<std::string> op_names(const Graph& g) {
  std::vector<std::string> names;
  for (const Node& n : g.nodes()) names.emplace_back(n.op_name());
  return names;
}

TEST(TraceCollectives, AllReduceThenComputeRecordsCollectiveWaitCompute) {
  auto g = trace("g", {Type(DType::F32, {4, 8})},
                 [](std::span<const Tensor> in) {
                   Tensor r = all_reduce(in[0], "SUM", "world");
                   EXPECT_TRUE(r.is_meta());
                   EXPECT_EQ(r.sizes(), (Shape{4, 8}));
                   return std::vector<Tensor>{ops::add(r, in[0])};
                 },
                 {{"world", 4}});
  EXPECT_EQ(op_names(*g), (std::vector<std::string>{"all_reduce", "wait_tensor", "add"}));
  const Node* ar = g->first_node();
  EXPECT_EQ(ar->attr("reduce_op").as_string(), "sum");  // lower-cased, as the seed does
  EXPECT_EQ(ar->attr("group").as_string(), "world");
  // The wait consumes the collective and the add consumes the wait.
  EXPECT_EQ(ar->next()->operand(0), ar->result(0));
  EXPECT_EQ(ar->next()->next()->operand(0), ar->next()->result(0));
  EXPECT_EQ(g->outputs()[0]->type(), Type(DType::F32, {4, 8}));
}

TEST(TraceCollectives, ShapesFollowTheGroupSize) {
  auto g = trace("g", {Type(DType::BF16, {3, 3, 3}), Type(DType::F32, {8, 6})},
                 [](std::span<const Tensor> in) {
                   Tensor ag0 = all_gather_tensor(in[0], 0, "world");
                   Tensor ag1 = all_gather_tensor(in[0], 1, "world");
                   Tensor ag2 = all_gather_tensor(in[0], -1, "world");
                   Tensor rs0 = reduce_scatter_tensor(in[1], "sum", 0, "world");
                   Tensor rs1 = reduce_scatter_tensor(in[1], "avg", 1, "tp");
                   Tensor a2a = all_to_all_single(in[1], std::nullopt, std::nullopt, "world");
                   Tensor bc = broadcast(in[1], 3, "world");
                   return std::vector<Tensor>{ag0, ag1, ag2, rs0, rs1, a2a, bc};
                 },
                 {{"world", 4}, {"tp", 2}});
  std::vector<Shape> shapes;
  for (const Value* v : g->outputs()) shapes.push_back(v->shape());
  EXPECT_EQ(shapes, (std::vector<Shape>{
                        {12, 3, 3}, {3, 12, 3}, {3, 3, 12}, {2, 6}, {8, 3}, {8, 6}, {8, 6}}));
  const std::string text = print(*g);
  EXPECT_NE(text.find("output_split_sizes = [2, 2, 2, 2], input_split_sizes = [2, 2, 2, 2]"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("group_size = 2, group = \"tp\""), std::string::npos) << text;
  verify(*g);
}

TEST(TraceCollectives, CoalescedFormsRecordOneNodeAndAWaitPerResult) {
  auto g = trace("g", {Type(DType::F32, {4}), Type(DType::I32, {2, 4})},
                 [](std::span<const Tensor> in) {
                   std::vector<Tensor> ins(in.begin(), in.end());
                   auto ar = all_reduce_coalesced(ins, "max", "world");
                   auto ag = all_gather_into_tensor_coalesced(ins, "world");
                   auto rs = reduce_scatter_tensor_coalesced(ins, "sum", {0, 1}, "world");
                   EXPECT_TRUE(all_reduce_coalesced({}, "sum", "world").empty());
                   std::vector<Tensor> out = ar;
                   out.insert(out.end(), ag.begin(), ag.end());
                   out.insert(out.end(), rs.begin(), rs.end());
                   return out;
                 },
                 {{"world", 2}});
  int coalesced = 0, waits = 0;
  for (const Node& n : g->nodes()) {
    coalesced += n.op().is_collective();
    waits += n.op().collective == CollectiveKind::Wait;
  }
  EXPECT_EQ(coalesced, 3);
  EXPECT_EQ(waits, 6);
  EXPECT_EQ(g->outputs()[5]->shape(), (Shape{2, 2}));  // scatter_dim 1 of i32[2,4] over 2
}

TEST(TraceCollectives, ErrorsMatchTheEagerOnes) {
  auto expect_error = [](const std::function<void(std::span<const Tensor>)>& fn,
                         const std::string& message) {
    try {
      trace("g", {Type(DType::F32, {6, 4})},
            [&](std::span<const Tensor> in) {
              fn(in);
              return std::vector<Tensor>{in[0]};
            },
            {{"world", 4}});
      ADD_FAILURE() << "expected an error: " << message;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  };
  expect_error([](auto in) { reduce_scatter_tensor(in[0], "sum", 0, "world"); },
               "reduce_scatter_tensor: input dimension 0 (6) must be a multiple of group_size 4");
  expect_error([](auto in) { all_reduce(in[0], "foo", "world"); }, "Unrecognized reduce_op: foo");
  expect_error([](auto in) { all_reduce(in[0], "sum", "nope"); },
               "all_reduce: unknown group 'nope' while tracing");
  expect_error([](auto in) { broadcast(in[0], 4, "world"); },
               "broadcast: src 4 is not a rank of group 'world' of size 4");
  expect_error(
      [](auto in) { all_to_all_single(in[0], std::vector<int64_t>{6}, std::nullopt, "world"); },
      "must either be specified together or both set to None");
  // Its split sizes depend on the rank: a group only declared to the tracer has none.
  expect_error(
      [](auto in) {
        permute_tensor(in[0], {1, 2, 3, 0}, "world");
      },
      "permute_tensor: tracing it needs the calling rank's number in group 'world'");
  expect_error(
      [](auto in) {
        reduce_scatter_tensor_coalesced({in[0]}, "sum", {0, 1}, "world");
      },
      "Length of scatter_dim (2) must equal length of inputs (1)");
  // Empty coalesced lists check their group and reduce op as the eager calls do.
  expect_error([](auto) { all_reduce_coalesced({}, "sum", "nope"); },
               "all_reduce_coalesced: unknown group 'nope' while tracing");
  expect_error([](auto) { all_reduce_coalesced({}, "foo", "world"); },
               "Unrecognized reduce_op: foo");
  expect_error([](auto) { all_gather_into_tensor_coalesced({}, "nope"); },
               "all_gather_into_tensor_coalesced: unknown group 'nope' while tracing");
  expect_error([](auto) { reduce_scatter_tensor_coalesced({}, "foo", {}, "world"); },
               "Unrecognized reduce_op: foo");
  expect_error([](auto) { reduce_scatter_tensor_coalesced({}, "sum", {}, "nope"); },
               "reduce_scatter_tensor_coalesced: unknown group 'nope' while tracing");
  // An in-place output of another dtype is refused (the graph converted it).
  expect_error(
      [](auto in) { all_gather_tensor_inplace(ops::zeros({24, 4}, DType::I64), in[0], "world"); },
      "all_gather_tensor_inplace: output dtype i64 does not match the input dtype f32");
  expect_error(
      [](auto in) {
        std::vector<Tensor> list(4, ops::zeros({6, 4}, DType::F16));
        all_gather_inplace(list, in[0], "world");
      },
      "all_gather_inplace: tensor_list[0] dtype f16 does not match the input dtype f32");
  // Views carry their eager layout: what eagerly refuses a layout refuses it traced.
  expect_error([](auto in) { all_gather_tensor(ops::transpose(in[0], 0, 1), 0, "world"); },
               "Tensor must be contiguous for all_gather_tensor");
  expect_error(
      [](auto in) { reduce_scatter_tensor(ops::transpose(in[0], 0, 1), "sum", 0, "world"); },
      "Tensor must be contiguous for reduce_scatter_tensor");
  expect_error(
      [](auto in) {
        all_to_all_single(ops::transpose(in[0], 0, 1), std::nullopt, std::nullopt, "world");
      },
      "Tensor must be contiguous for all_to_all_single");
  expect_error([](auto in) { ops::view(ops::transpose(in[0], 0, 1), {24}); },
               "view: cannot view f32[4,6] with strides [1,4] as shape [24] without a copy");
  expect_error([](auto in) { ops::view(ops::narrow(in[0], 1, 1, 2), {12}); },
               "without a copy (use reshape)");
  expect_error([](auto in) { ops::view_dtype(ops::transpose(in[0], 0, 1), DType::I16); },
               "the last dim must have stride 1, it has 4");
  expect_error(
      [](auto in) {
        ops::view_dtype(ops::narrow(ops::view_dtype(in[0], DType::I16), 1, 1, 2), DType::I32);
      },
      "the storage offset (1) is not a multiple of 2");
  // A collective through ops::call is refused traced as eagerly (it would have no wait).
  expect_error(
      [](auto in) { ops::call("all_reduce", std::vector<Tensor>{in[0]}, {{"reduce_op", "sum"}}); },
      "all_reduce: collectives run through the functional API");
  // A view that needs no copy is fine, and so is a reshape that copies.
  trace("ok", {Type(DType::F32, {6, 4})},
        [](std::span<const Tensor> in) {
          const Tensor t = ops::transpose(in[0], 0, 1);
          return std::vector<Tensor>{ops::view(ops::narrow(in[0], 0, 1, 2), {8}),
                                     ops::reshape(t, {24}),
                                     all_gather_tensor(ops::clone(t), 0, "world")};
        },
        {{"world", 4}});
}

// The reduce op against the dtype and all_to_all's split sizes are refused traced with the eager
// message, word for word (the op table's own checks said "all_reduce: input: ..." and dropped
// a coalesced list's "for tensor at index i", which names the bad entry of a long list).
TEST(TraceCollectives, ReduceOpAndSplitErrorsAreTheEagerMessagesVerbatim) {
  using Call = std::function<void(const Tensor& a, const Tensor& b, const GroupSpec& group)>;
  const std::vector<std::pair<std::string, Call>> calls = {
      {"band on f32", [](auto& a, auto&, auto& g) { all_reduce(a, "band", g); }},
      {"avg on bool", [](auto&, auto& b, auto& g) { all_reduce(b, "AVG", g); }},
      {"bor on f32 scattered",
       [](auto& a, auto&, auto& g) { reduce_scatter_tensor(a, "bor", 1, g); }},
      {"coalesced bxor, index 1",
       [](auto& a, auto& b, auto& g) { all_reduce_coalesced({b, a}, "bxor", g); }},
      {"coalesced avg on bool, index 1",
       [](auto& a, auto& b, auto& g) {
         reduce_scatter_tensor_coalesced({a, b}, "avg", {0, 0}, g);
       }},
      {"negative output split",
       [](auto& a, auto&, auto& g) {
         all_to_all_single(a, std::vector<int64_t>{-1, 5}, std::vector<int64_t>{2, 2}, g);
       }},
      {"negative input split",
       [](auto& a, auto&, auto& g) {
         all_to_all_single(a, std::vector<int64_t>{2, 2}, std::vector<int64_t>{5, -1}, g);
       }},
      {"input splits not summing to dim 0",
       [](auto& a, auto&, auto& g) {
         all_to_all_single(a, std::vector<int64_t>{1, 1}, std::vector<int64_t>{1, 1}, g);
       }},
  };
  const Type a_type(DType::F32, {4, 2});
  const Type b_type(DType::Bool, {4});
  // No structured bindings: clang 14 refuses a lambda capturing one.
  for (const auto& entry : calls) {
    const std::string& what = entry.first;
    const Call& call = entry.second;
    std::string eager = "<no error>";
    std::string traced = "<no error>";
    try {
      run_local(2, [&](ProcessGroup& world) {
        call(Tensor::zeros(a_type.shape, a_type.dtype), Tensor::zeros(b_type.shape, b_type.dtype),
             world);
      });
    } catch (const Error& e) {
      eager = e.what();
    }
    try {
      trace("g", {a_type, b_type},
            [&](std::span<const Tensor> in) {
              call(in[0], in[1], "world");
              return std::vector<Tensor>{in[0]};
            },
            {{"world", 2}});
    } catch (const Error& e) {
      traced = e.what();
    }
    EXPECT_NE(eager, "<no error>") << what;
    EXPECT_EQ(traced, eager) << what;
  }
}

// Groups resolve through the rank's registry when tracing inside a rank: mesh dims by name.
TEST(TraceCollectives, InsideARankMeshGroupsResolveByName) {
  std::vector<std::string> texts(4);
  run_local(4, [&](ProcessGroup& world) {
    DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    auto g = trace("g", {Type(DType::F32, {4})}, [&](std::span<const Tensor> in) {
      Tensor a = all_reduce(in[0], "sum", GroupSpec(mesh, 1));
      Tensor b = all_gather_tensor(a, 0, "dp");
      return std::vector<Tensor>{b};
    });
    texts[world.rank()] = print(*g);
  });
  EXPECT_NE(texts[0].find("group = \"tp\""), std::string::npos) << texts[0];
  EXPECT_NE(texts[0].find("group_size = 2, group = \"dp\""), std::string::npos) << texts[0];
  for (const std::string& t : texts) EXPECT_EQ(t, texts[0]);  // the same graph on every rank
}

using Fn = std::function<std::vector<Tensor>(std::span<const Tensor>)>;

// Runs `fn` eagerly and `graph` (its trace) on the executor on 4 ranks with the inputs
// `inputs_of(rank)`, and expects every output bit-identical.
void expect_runs_like_eager(const Graph& graph, const Fn& fn,
                            const std::function<std::vector<Tensor>(int)>& inputs_of) {
  constexpr int kRanks = 4;
  std::vector<std::vector<Tensor>> eager(kRanks), traced(kRanks);
  run_local(kRanks, [&](ProcessGroup& world) {
    const int r = world.rank();
    eager[r] = fn(inputs_of(r));
    for (Tensor& t : eager[r]) t.wait();
    Executor ex(graph, world);
    traced[r] = ex.run(inputs_of(r));
  });
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(traced[r].size(), eager[r].size());
    for (size_t i = 0; i < eager[r].size(); ++i) {
      EXPECT_TRUE(traced[r][i].equal(eager[r][i]))
          << "rank " << r << " output " << i << ": " << traced[r][i].to_string() << " vs "
          << eager[r][i].to_string() << "\n" << print(graph);
    }
  }
}

// One f32[4,2] input of small integers that differ between ranks (sums stay exact).
std::vector<Tensor> small_4x2_input(int rank) {
  std::vector<float> x(8);
  for (int i = 0; i < 8; ++i) x[i] = static_cast<float>((i * 5 + rank) % 9 - 4);
  return {Tensor::from_vector<float>(x, {4, 2})};
}

// A function written once runs eagerly and traced; the executor gives the eager result exactly.
std::vector<Tensor> fsdp_layer(std::span<const Tensor> in) {
  // x: [2, 8], w: this rank's [2, 4] shard of an [8, 4] weight.
  Tensor w = all_gather_tensor(in[1], 0, "world");  // [8, 4]
  Tensor y = ops::relu(ops::matmul(in[0], w));      // [2, 4]
  Tensor g =
      reduce_scatter_tensor(ops::clone(ops::transpose(y, 0, 1)), "sum", 0, "world");  // [1, 2]
  Tensor s = all_reduce(ops::mul(g, g), "max", "world");
  Tensor c = all_gather_tensor(y, 1, "world");  // [2, 16]
  return {s, c, ops::sum(c)};
}

TEST(TraceCollectives, TracedGraphRunsLikeTheEagerFunction) {
  auto graph = trace("fsdp", {Type(DType::F32, {2, 8}), Type(DType::F32, {2, 4})}, fsdp_layer,
                     {{"world", 4}});
  expect_runs_like_eager(*graph, fsdp_layer, [](int r) {
    std::vector<float> x(16), w(8);
    for (int i = 0; i < 16; ++i) x[i] = static_cast<float>((i * 3 + r) % 7 - 3);
    for (int i = 0; i < 8; ++i) w[i] = static_cast<float>((i + 2 * r) % 5 - 2);
    return std::vector<Tensor>{Tensor::from_vector<float>(x, {2, 8}),
                               Tensor::from_vector<float>(w, {2, 4})};
  });
}

// A traced tensor kept past its trace is refused by the eager collectives, as ops are refused
// it: they returned a meta result of it, silently.
TEST(TraceCollectives, ATracedTensorOutsideItsTraceIsRefused) {
  Tensor leaked;
  std::vector<Tensor> leaked_list;
  (void)trace("g", {Type(DType::F32, {4})},
              [&](std::span<const Tensor> in) {
                leaked = in[0];
                leaked_list = {in[0], in[0]};
                return std::vector<Tensor>{all_reduce(in[0], "sum", "world")};
              },
              {{"world", 2}});
  run_local(2, [&](ProcessGroup&) {
    using testing::error_of;
    const std::string outside =
        ": a traced tensor is used outside its trace (no tracer is current)";
    EXPECT_EQ(error_of<InvalidArgument>([&] { (void)all_reduce(leaked, "sum", "world"); }),
              "all_reduce" + outside);
    EXPECT_EQ(error_of<InvalidArgument>([&] { (void)broadcast(leaked, 0, "world"); }),
              "broadcast" + outside);
    EXPECT_EQ(error_of<InvalidArgument>(
                  [&] { (void)all_reduce_coalesced(leaked_list, "sum", "world"); }),
              "all_reduce_coalesced" + outside + " for tensor at index 0");
    EXPECT_EQ(error_of<InvalidArgument>([&] { (void)ops::add(leaked, leaked); }), "add" + outside);
  });
}

// The in-place remaps trace functionally (DESIGN §4): the written tensor, and its copies,
// stand for the collective's result afterwards, so the graph computes what the eager calls
// leave in their buffers; it verifies and round-trips through the text format.
std::vector<Tensor> inplace_remaps(std::span<const Tensor> in) {
  // x: [4, 2] f32, i: [4] i32.
  const Tensor x = in[0];
  const Tensor alias = x;  // a copy of the tensor: written with it
  all_reduce_inplace(x, "sum", "world");
  Tensor gathered = ops::zeros({4, 8}, DType::F32);
  all_gather_tensor_inplace(gathered, x, "world", /*gather_dim=*/1);
  Tensor scattered = ops::zeros({1, 2}, DType::F32);
  reduce_scatter_tensor_inplace(scattered, x, "world", "max");
  Tensor exchanged = ops::zeros({4}, DType::I32);
  all_to_all_inplace(exchanged, in[1], std::nullopt, std::nullopt, "world");
  std::vector<Tensor> list;
  for (int r = 0; r < 4; ++r) list.push_back(ops::zeros({}, DType::I64));
  all_gather_inplace(list, ops::sum(in[1]), "world");
  std::vector<Tensor> out = {x, alias, gathered, scattered, exchanged};
  out.insert(out.end(), list.begin(), list.end());
  return out;
}

TEST(TraceCollectives, InplaceRemapsTraceFunctionally) {
  auto traced = trace("inplace", {Type(DType::F32, {4, 2}), Type(DType::I32, {4})},
                      inplace_remaps, {{"world", 4}});
  const std::string text = print(*traced);
  auto graph = parse_graph(text);
  EXPECT_EQ(print(*graph), text);
  expect_runs_like_eager(*graph, inplace_remaps, [](int r) {
    std::vector<float> x(8);
    for (int i = 0; i < 8; ++i) x[i] = static_cast<float>((i * 3 + r) % 7 - 3);
    return std::vector<Tensor>{Tensor::from_vector<float>(x, {4, 2}),
                               Tensor::from_vector<int32_t>({r, 2 * r, -r, 5}, {4})};
  });
}

// A write into an input that the graph does not return is refused when the trace ends: a
// graph cannot write its inputs, while the eager call leaves the caller's tensor written (the
// graph dropped the write without a word). Into the input or a view of it; returned, it is kept.
TEST(TraceCollectives, AnInputWrittenInPlaceMustBeReturned) {
  using Fn = std::function<std::vector<Tensor>(std::span<const Tensor>)>;
  const std::vector<Type> types = {Type(DType::F32, {4, 2}), Type(DType::F32, {4, 2})};
  const std::vector<Fn> dropped = {
      [](std::span<const Tensor> in) {
        all_reduce_inplace(in[0], "sum", "world");  // gradients reduced in place
        return std::vector<Tensor>{ops::relu(in[1])};
      },
      [](std::span<const Tensor> in) {
        all_reduce_inplace(ops::narrow(in[0], 0, 0, 2), "sum", "world");
        return std::vector<Tensor>{ops::narrow(in[0], 0, 0, 2)};  // the view, not the input
      },
  };
  for (const Fn& fn : dropped) {
    try {
      trace("step", types, fn, {{"world", 4}});
      ADD_FAILURE() << "an input written in place and not returned was traced";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("tracer: input %x was written in place", 0), 0u)
          << e.what();
    }
  }
  auto kept = trace("step", types,
                    [](std::span<const Tensor> in) {
                      all_reduce_inplace(in[0], "sum", "world");
                      return std::vector<Tensor>{in[0], ops::relu(in[1])};
                    },
                    {{"world", 4}});
  EXPECT_EQ(kept->outputs()[0]->node()->op_name(), "wait_tensor");
}

// An in-place collective into a view writes the view's base too, eagerly and traced (the graph
// returned the base unchanged): narrow, a narrow of a transpose, a narrow of a view, and the
// same view written twice.
std::vector<Tensor> inplace_into_views(std::span<const Tensor> in) {
  // x: [4, 2] f32.
  Tensor z = ops::clone(in[0]);
  Tensor head = ops::narrow(z, 0, 1, 2);  // rows 1 and 2
  all_reduce_inplace(head, "sum", "world");
  all_reduce_inplace(head, "max", "world");
  Tensor col = ops::narrow(ops::transpose(z, 0, 1), 1, 3, 1);  // row 3, as a column
  all_reduce_inplace(col, "sum", "world");
  Tensor before = ops::clone(z);
  Tensor v = ops::view(z, {8});
  reduce_scatter_tensor_inplace(ops::narrow(v, 0, 0, 2), ops::clone(v), "world", "sum");
  return {z, head, col, before, v};
}

TEST(TraceCollectives, InplaceIntoAViewWritesItsBase) {
  auto traced = trace("views", {Type(DType::F32, {4, 2})}, inplace_into_views, {{"world", 4}});
  expect_runs_like_eager(*traced, inplace_into_views, small_4x2_input);
  // Views that eagerly may be copies (reshape) cannot be written through: an error, not a
  // graph that differs from eager.
  try {
    trace("reshape", {Type(DType::F32, {4, 2})},
          [](std::span<const Tensor> in) {
            Tensor z = ops::clone(in[0]);
            all_reduce_inplace(ops::reshape(z, {8}), "sum", "world");
            return std::vector<Tensor>{z};
          },
          {{"world", 4}});
    ADD_FAILURE() << "an in-place write into a reshape was traced";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be traced"), std::string::npos) << e.what();
  }
}

// Views see the in-place writes into their base made after them, eagerly and traced (the
// graph used to keep the value a view was made from): a narrow taken before a write that
// overlaps it, a view of a view, split_with_sizes parts (written through, and seeing the other
// parts' writes), a view written through a later view of the same base, a narrow with a
// negative dim and start.
std::vector<Tensor> views_see_later_writes(std::span<const Tensor> in) {
  // x: [4, 2] f32.
  Tensor z = ops::clone(in[0]);
  Tensor early = ops::narrow(z, 0, 0, 2);  // rows 0-1
  Tensor t = ops::transpose(z, 0, 1);
  Tensor deep = ops::narrow(t, 1, 1, 2);  // rows 1-2, as columns of the transpose
  std::vector<Tensor> parts = ops::split_with_sizes(z, {1, 3});
  Tensor flat = ops::view(z, {8});
  all_reduce_inplace(ops::narrow(z, 0, 1, 2), "sum", "world");  // rows 1-2
  all_reduce_inplace(parts[1], "max", "world");                  // rows 1-3
  all_reduce_inplace(ops::narrow(flat, 0, 0, 2), "sum", "world");  // row 0
  all_reduce_inplace(ops::narrow(z, -1, -1, 1), "max", "world");    // column 1, dims wrapped
  Tensor after = ops::clone(early);
  all_reduce_inplace(early, "max", "world");  // rows 0-1, through the first view
  return {z, early, t, deep, parts[0], parts[1], flat, after};
}

// ops::call("wait_tensor") returns its operand itself, eagerly and traced: a write into one
// shows in the other. And a write the tracer refuses (into an expand) changes nothing, as the
// eager write that fails writes nothing, when the program catches the error.
std::vector<Tensor> wait_alias_and_refused_write(std::span<const Tensor> in) {
  const Tensor r = all_reduce(in[0], "sum", "world");
  const Tensor w = ops::call_one("wait_tensor", std::vector<Tensor>{r});
  all_reduce_inplace(r, "sum", "world");
  const Tensor z = ops::clone(in[0]);
  const Tensor e = ops::call_one("expand", std::vector<Tensor>{ops::narrow(z, 0, 0, 1)},
                                 {{"shape", Shape{4, 2}}});
  try {
    all_reduce_inplace(e, "sum", "world");
    throw std::logic_error("a write into an expand was not refused");
  } catch (const InvalidArgument&) {
  }
  return {w, e, z};
}

TEST(TraceCollectives, WaitAliasesAndRefusedWritesChangeNothing) {
  auto traced = trace("alias", {Type(DType::F32, {4, 2})}, wait_alias_and_refused_write,
                      {{"world", 4}});
  expect_runs_like_eager(*traced, wait_alias_and_refused_write, small_4x2_input);
}

TEST(TraceCollectives, ViewsSeeLaterWritesIntoTheirBase) {
  auto traced =
      trace("later", {Type(DType::F32, {4, 2})}, views_see_later_writes, {{"world", 4}});
  expect_runs_like_eager(*traced, views_see_later_writes, small_4x2_input);
  // A reshape used after a write into its base: eagerly it may be a copy that misses the write.
  try {
    trace("stale", {Type(DType::F32, {4, 2})},
          [](std::span<const Tensor> in) {
            Tensor z = ops::clone(in[0]);
            Tensor r = ops::reshape(z, {8});
            all_reduce_inplace(ops::narrow(z, 0, 0, 2), "sum", "world");
            return std::vector<Tensor>{ops::neg(r)};
          },
          {{"world", 4}});
    ADD_FAILURE() << "a reshape used after a write into its base was traced";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("is used after an in-place write into"),
              std::string::npos)
        << e.what();
  }
}

// permute_tensor traced inside a rank records that rank's all_to_all_single (a graph per rank,
// as PyTorch traces it; run with check_same_graph = false): each rank's graph gives its eager
// result, for non-contiguous inputs too (a transpose, and a column, whose flat reshape would be
// a strided view), and a bad src_dst fails with the eager message.
TEST(TraceCollectives, PermuteTensorTracesInsideARank) {
  const Fn fn = [](std::span<const Tensor> in) {
    return std::vector<Tensor>{permute_tensor(in[0], {1, 2, 3, 0}, "world"),
                               permute_tensor(ops::transpose(in[0], 0, 1), {2, 0, 3, 1}, "world"),
                               permute_tensor(ops::narrow(in[0], 1, 1, 1), {3, 2, 1, 0}, "world")};
  };
  std::vector<std::string> printed(4);
  run_local(4, [&](ProcessGroup& world) {
    const int r = world.rank();
    const std::vector<Tensor> inputs = small_4x2_input(r);
    std::vector<Tensor> eager = fn(inputs);
    for (Tensor& t : eager) t.wait();
    auto graph = trace("permute", {Type(DType::F32, {4, 2})}, fn);
    printed[r] = print(*graph);
    ExecutorOptions own_graphs;  // the graphs differ in their split sizes
    own_graphs.check_same_graph = false;
    Executor ex(*graph, world, own_graphs);
    const std::vector<Tensor> traced = ex.run(inputs);
    ASSERT_EQ(traced.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(traced[i].sizes(), eager[i].sizes());
      EXPECT_TRUE(traced[i].equal(eager[i])) << "rank " << r << " output " << i << "\n"
                                             << printed[r];
    }
    // Rank r got rank (r - 1 mod 4)'s tensor from the first.
    EXPECT_TRUE(eager[0].equal(small_4x2_input((r + 3) % 4)[0])) << r;
    try {
      trace("bad", {Type(DType::F32, {4, 2})}, [](std::span<const Tensor> in) {
        return std::vector<Tensor>{permute_tensor(in[0], {1, 1, 3, 0}, "world")};
      });
      ADD_FAILURE() << "a src_dst that is not a permutation was traced";
    } catch (const InvalidArgument& e) {
      EXPECT_STREQ(e.what(), "permute_tensor: src_dst [1, 1, 3, 0] is not a permutation of 0..3");
    }
  });
  // Rank 0 sends its 4 rows to rank 1 and receives rank 3's; the transposed tensor is copied
  // first (rows of a contiguous tensor), the other exchanged as it is.
  EXPECT_NE(printed[0].find("output_split_sizes = [0, 0, 0, 4]"), std::string::npos)
      << printed[0];
  EXPECT_NE(printed[0].find("input_split_sizes = [0, 4, 0, 0]"), std::string::npos)
      << printed[0];
  EXPECT_NE(printed[0].find("all_to_all_single(%x)"), std::string::npos) << printed[0];
  EXPECT_NE(printed[1], printed[0]);
}

// A random program of views and in-place all_reduces into them (seeded: the eager run and the
// trace make the same choices): narrows, transposes, split_with_sizes parts and a flat view,
// taken from the base and from each other before and after writes through any of them. The
// traced graph gives the eager values for every one of them.
Fn random_views_program(uint32_t seed) {
  return [seed](std::span<const Tensor> in) {
    std::mt19937 rng(seed);
    auto pick = [&rng](size_t n) { return static_cast<size_t>(rng() % n); };
    Tensor z = ops::clone(in[0]);  // [4, 6]
    std::vector<Tensor> live = {z, ops::view(z, {24})};
    for (int step = 0; step < 40; ++step) {
      const Tensor v = live[pick(live.size())];
      const int64_t rank = static_cast<int64_t>(v.sizes().size());
      switch (pick(4)) {
        case 0: {  // a narrow of any dim
          const int64_t dim = static_cast<int64_t>(pick(static_cast<size_t>(rank)));
          const int64_t size = v.sizes()[static_cast<size_t>(dim)];
          if (size < 1) break;
          const int64_t start = static_cast<int64_t>(pick(static_cast<size_t>(size)));
          const int64_t length = 1 + static_cast<int64_t>(pick(static_cast<size_t>(size - start)));
          live.push_back(ops::narrow(v, dim, start, length));
          break;
        }
        case 1:
          if (rank == 2) live.push_back(ops::transpose(v, 0, 1));
          break;
        case 2: {  // split dim 0 in two
          const int64_t size = v.sizes()[0];
          if (size < 2) break;
          const int64_t first = 1 + static_cast<int64_t>(pick(static_cast<size_t>(size - 1)));
          for (const Tensor& part : ops::split_with_sizes(v, {first, size - first})) {
            live.push_back(part);
          }
          break;
        }
        default:
          all_reduce_inplace(v, pick(2) == 0 ? "sum" : "max", "world");
          break;
      }
    }
    return live;
  };
}

TEST(TraceCollectives, RandomViewsAndInplaceWritesRunLikeEager) {
  for (uint32_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Fn program = random_views_program(seed);
    auto traced = trace("random", {Type(DType::F32, {4, 6})}, program, {{"world", 4}});
    expect_runs_like_eager(*traced, program, [](int r) {
      std::vector<float> x(24);
      for (int i = 0; i < 24; ++i) x[i] = static_cast<float>((i * 7 + 3 * r) % 11 - 5);
      return std::vector<Tensor>{Tensor::from_vector<float>(x, {4, 6})};
    });
    if (HasFailure()) break;
  }
}

}  // namespace
}  // namespace funcol
