// Tests of the executor: every op kind, memory release, overlap, errors, the graph hash check.
#include "funcol/runtime/executor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/device_mesh.h"
#include "funcol/graph/parser.h"
#include "funcol/runtime/profile.h"

namespace funcol {
namespace {

std::unique_ptr<Graph> parse(std::string_view text) {
  return parse_graph(text, ParseOptions{.file = "t.ir"});
}

// Runs `text` on n thread ranks; input i of rank r is make(r, i). Returns outputs[rank].
std::vector<std::vector<Tensor>> run_graph(
    int n, std::string_view text,
    const std::function<std::vector<Tensor>(int rank)>& make_inputs_for, int iters = 1) {
  auto graph = parse(text);
  std::vector<std::vector<Tensor>> outputs(n);
  run_local(n, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    for (int i = 0; i < iters; ++i) outputs[world.rank()] = ex.run(make_inputs_for(world.rank()));
  });
  return outputs;
}

std::vector<float> floats(const Tensor& t) { return t.to_vector<float>(); }

std::string fmt_hash(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

TEST(Executor, AllReduceSumOnEveryWorldSize) {
  for (int n : {1, 2, 4, 8}) {
    std::vector<Tensor> inputs(n);
    auto out = run_graph(n, R"(graph @g(%x: f32[3]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[3]
  %w = wait_tensor(%ar) : f32[3]
  return %w
})",
                         [&](int r) {
                           inputs[r] = Tensor::from_vector<float>({float(r), float(10 * r), 1.0f});
                           return std::vector<Tensor>{inputs[r]};
                         });
    const float s = n * (n - 1) / 2.0f;
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(floats(out[r][0]), (std::vector<float>{s, 10 * s, float(n)})) << n;
      // The input is left unmodified (all_reduce clones).
      EXPECT_EQ(floats(inputs[r]), (std::vector<float>{float(r), float(10 * r), 1.0f}));
    }
  }
}

TEST(Executor, AllGatherReduceScatterBroadcast) {
  auto out = run_graph(4, R"(graph @g(%x: i32[2], %y: i32[8]) {
  %ag = all_gather_into_tensor(%x) {group_size = 4, group = "world"} : i32[8]
  %rs = reduce_scatter_tensor(%y) {reduce_op = "max", group_size = 4, group = "world"} : i32[2]
  %bc = broadcast(%x) {src = 2, group = "world"} : i32[2]
  %w1 = wait_tensor(%ag) : i32[8]
  %w2 = wait_tensor(%rs) : i32[2]
  %w3 = wait_tensor(%bc) : i32[2]
  return %w1, %w2, %w3
})",
                       [](int r) {
                         std::vector<int32_t> y(8);
                         for (int i = 0; i < 8; ++i) y[i] = i * 10 + r;
                         return std::vector<Tensor>{Tensor::from_vector<int32_t>({r, 100 + r}),
                                                    Tensor::from_vector<int32_t>(y)};
                       });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(out[r][0].to_vector<int32_t>(),
              (std::vector<int32_t>{0, 100, 1, 101, 2, 102, 3, 103}));
    // Block r of every rank's y, max over ranks: rank 3's values.
    EXPECT_EQ(out[r][1].to_vector<int32_t>(),
              (std::vector<int32_t>{2 * r * 10 + 3, (2 * r + 1) * 10 + 3}));
    EXPECT_EQ(out[r][2].to_vector<int32_t>(), (std::vector<int32_t>{2, 102}));
  }
}

TEST(Executor, AllToAllSingleWithSplits) {
  // Every rank sends 1 row to each peer; row j of the output comes from rank j.
  auto out = run_graph(3, R"(graph @g(%x: f32[3,2]) {
  %a = all_to_all_single(%x) {output_split_sizes = [1, 1, 1], input_split_sizes = [1, 1, 1], group = "world"} : f32[3,2]
  %w = wait_tensor(%a) : f32[3,2]
  return %w
})",
                       [](int r) {
                         std::vector<float> v;
                         for (int j = 0; j < 3; ++j) {
                           v.push_back(10.0f * r + j);
                           v.push_back(-(10.0f * r + j));
                         }
                         return std::vector<Tensor>{Tensor::from_vector<float>(v, {3, 2})};
                       });
  for (int r = 0; r < 3; ++r) {
    std::vector<float> expect;
    for (int j = 0; j < 3; ++j) {
      expect.push_back(10.0f * j + r);
      expect.push_back(-(10.0f * j + r));
    }
    EXPECT_EQ(floats(out[r][0]), expect);
  }
}

TEST(Executor, CoalescedCollectivesShareOneWork) {
  auto out = run_graph(2, R"(graph @g(%a: f32[2], %b: i64[4]) {
  %ar:2 = all_reduce_coalesced(%a, %b) {reduce_op = "sum", group = "world"} : f32[2], i64[4]
  %ag:2 = all_gather_into_tensor_coalesced(%a, %b) {group_size = 2, group = "world"} : f32[4], i64[8]
  %rs:2 = reduce_scatter_tensor_coalesced(%a, %b) {reduce_op = "sum", group_size = 2, group = "world"} : f32[1], i64[2]
  %w0 = wait_tensor(%ar#0) : f32[2]
  %w1 = wait_tensor(%ar#1) : i64[4]
  %w2 = wait_tensor(%ag#0) : f32[4]
  %w3 = wait_tensor(%ag#1) : i64[8]
  %w4 = wait_tensor(%rs#0) : f32[1]
  %w5 = wait_tensor(%rs#1) : i64[2]
  return %w0, %w1, %w2, %w3, %w4, %w5
})",
                       [](int r) {
                         return std::vector<Tensor>{
                             Tensor::from_vector<float>({float(r + 1), float(2 * (r + 1))}),
                             Tensor::from_vector<int64_t>({r, r + 10, r + 20, r + 30})};
                       });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(floats(out[r][0]), (std::vector<float>{3, 6}));
    EXPECT_EQ(out[r][1].to_vector<int64_t>(), (std::vector<int64_t>{1, 21, 41, 61}));
    EXPECT_EQ(floats(out[r][2]), (std::vector<float>{1, 2, 2, 4}));
    EXPECT_EQ(out[r][3].to_vector<int64_t>(), (std::vector<int64_t>{0, 10, 20, 30, 1, 11, 21, 31}));
    EXPECT_EQ(floats(out[r][4]), (std::vector<float>{r == 0 ? 3.0f : 6.0f}));
    EXPECT_EQ(out[r][5].to_vector<int64_t>(),
              r == 0 ? (std::vector<int64_t>{1, 21}) : (std::vector<int64_t>{41, 61}));
  }
}

TEST(Executor, ComputeOpsMatchTheirKernels) {
  auto out = run_graph(1, R"(graph @g(%x: f32[2,3], %w: f32[3,2]) {
  %y = matmul(%x, %w) : f32[2,2]
  %t = transpose(%y) {dim0 = 0, dim1 = 1} : f32[2,2]
  %s = add(%y, %t) : f32[2,2]
  %n = neg(%s) : f32[2,2]
  %r = relu(%s) : f32[2,2]
  %p:2 = split_with_sizes(%x) {split_sizes = [1, 1], dim = 0} : f32[1,3], f32[1,3]
  %c = cat(%p#1, %p#0) {dim = 0} : f32[2,3]
  %f = flatten(%c) : f32[6]
  %m = mean(%f) {dims = [0]} : f32[]
  %h = convert_element_type(%n) {dtype = f64} : f64[2,2]
  return %s, %n, %r, %f, %m, %h
})",
                       [](int) {
                         return std::vector<Tensor>{
                             Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}),
                             Tensor::from_vector<float>({1, 0, 0, 1, 1, -1}, {3, 2})};
                       });
  const auto& o = out[0];
  // y = [[4, -1], [10, -1]]; y + y^T = [[8, 9], [9, -2]].
  EXPECT_EQ(floats(o[0]), (std::vector<float>{8, 9, 9, -2}));
  EXPECT_EQ(floats(o[1]), (std::vector<float>{-8, -9, -9, 2}));
  EXPECT_EQ(floats(o[2]), (std::vector<float>{8, 9, 9, 0}));
  EXPECT_EQ(floats(o[3]), (std::vector<float>{4, 5, 6, 1, 2, 3}));
  EXPECT_EQ(o[4].item<float>(), 3.5f);
  EXPECT_EQ(o[5].dtype(), DType::F64);
  EXPECT_EQ(o[5].to_vector<double>(), (std::vector<double>{-8, -9, -9, 2}));
}

TEST(Executor, RepeatedOperandsAndManyOperands) {
  std::string text =
      "graph @g(%x: i32[2]) {\n  %y = neg(%x) : i32[2]\n  %z = add(%y, %y) : i32[2]\n";
  text += "  %c = cat(";
  for (int i = 0; i < 100; ++i) text += std::string(i ? ", " : "") + (i % 2 ? "%z" : "%y");
  text += ") {dim = 0} : i32[200]\n  return %z, %c\n}\n";
  auto out = run_graph(1, text, [](int) {
    return std::vector<Tensor>{Tensor::from_vector<int32_t>({3, 5})};
  });
  EXPECT_EQ(out[0][0].to_vector<int32_t>(), (std::vector<int32_t>{-6, -10}));
  const auto c = out[0][1].to_vector<int32_t>();
  ASSERT_EQ(c.size(), 200u);
  EXPECT_EQ(c[0], -3);
  EXPECT_EQ(c[2], -6);
  EXPECT_EQ(c[199], -10);
}

TEST(Executor, ViewOpsShareStorage) {
  auto graph = parse(R"(graph @g(%x: f32[2,3]) {
  %v = view(%x) {shape = [6]} : f32[6]
  %n = narrow(%v) {dim = 0, start = 2, length = 3} : f32[3]
  %c = clone(%n) : f32[3]
  return %v, %n, %c
})");
  run_local(1, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    Tensor x = Tensor::arange(6, DType::F32).view({2, 3});
    auto out = ex.run({x});
    EXPECT_TRUE(out[0].shares_storage(x));
    EXPECT_TRUE(out[1].shares_storage(x));
    EXPECT_FALSE(out[2].shares_storage(x));
    EXPECT_EQ(floats(out[1]), (std::vector<float>{2, 3, 4}));
  });
}

// 20 neg in a chain over 4 KiB tensors: with release after last use at most the input of a node
// and its result are alive (plus the kept output), not all 21.
// An IR value has no layout: view and view_dtype of a transposed value compute the same
// elements as of its contiguous copy (eagerly, as in PyTorch, they would need a compatible
// layout; the verifier cannot know strides and accepts the graph).
TEST(Executor, ViewsOfTransposedValuesAreValues) {
  const auto out = run_graph(1, R"(graph @g(%x: f32[2,3]) {
  %t = transpose(%x) {dim0 = 0, dim1 = 1}
  %v = view(%t) {shape = [6]}
  %d = view_dtype(%t) {dtype = bf16}
  %n = narrow(%x) {dim = 1, start = 1, length = 2}
  %nd = view_dtype(%n) {dtype = i64}
  return %v, %d, %nd
})",
                             [](int) {
                               return std::vector<Tensor>{Tensor::from_vector(
                                   std::vector<float>{0, 1, 2, 3, 4, 5}, {2, 3})};
                             });
  EXPECT_EQ(floats(out[0][0]), (std::vector<float>{0, 3, 1, 4, 2, 5}));
  const Tensor x = Tensor::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5}, {2, 3});
  EXPECT_TRUE(out[0][1].equal(x.transpose(0, 1).contiguous().view_dtype(DType::BF16)));
  EXPECT_EQ(out[0][1].sizes(), (Shape{3, 4}));
  EXPECT_TRUE(out[0][2].equal(x.narrow(1, 1, 2).contiguous().view_dtype(DType::I64)));
  EXPECT_EQ(out[0][2].sizes(), (Shape{2, 1}));
}

TEST(Executor, ReleasesEveryValueAfterItsLastUse) {
  std::string text = "graph @chain(%x: f32[1024]) {\n  %v0 = neg(%x) : f32[1024]\n";
  for (int i = 1; i < 20; ++i) {
    text += "  %v" + std::to_string(i) + " = neg(%v" + std::to_string(i - 1) + ") : f32[1024]\n";
  }
  text += "  return %v5, %v19\n}\n";
  auto graph = parse(text);
  run_local(1, [&](ProcessGroup& world) {
    int64_t peak = 0;
    bool input_freed_after_first = false;
    std::weak_ptr<Storage> input_storage;
    Executor* self = nullptr;
    ExecutorOptions options;
    options.on_node = [&](const Node& node) {
      peak = std::max(peak, self->live_bytes());
      if (node.name() == "v0") input_freed_after_first = input_storage.expired();
    };
    Executor ex(*graph, world, options);
    self = &ex;
    {
      Tensor x = Tensor::full({1024}, DType::F32, 1.0);
      input_storage = x.storage();
      std::vector<Tensor> inputs;
      inputs.push_back(std::move(x));
      auto out = ex.run(std::move(inputs));
      EXPECT_EQ(floats(out[0])[0], 1.0f);  // v5 = neg^6(1): kept as an output
      EXPECT_EQ(floats(out[1])[0], 1.0f);  // v19 = neg^20(1)
    }
    EXPECT_TRUE(input_freed_after_first);
    // The kept %v5 plus the live value and the new result: 3 buffers of 4 KiB at most.
    EXPECT_LE(peak, 3 * 4096);
    EXPECT_GE(peak, 2 * 4096);
    EXPECT_EQ(ex.live_bytes(), 0);  // nothing is held between runs
  });
}

TEST(Executor, RunsManyTimesFromOnePlan) {
  auto graph = parse(R"(graph @g(%x: i32[2]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : i32[2]
  %w = wait_tensor(%ar) : i32[2]
  %y = add(%w, %x) : i32[2]
  return %y
})");
  std::vector<std::vector<int32_t>> results(2);
  run_local(2, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    for (int it = 0; it < 5; ++it) {
      auto out = ex.run({Tensor::from_vector<int32_t>({it, world.rank()})});
      results[world.rank()] = out[0].to_vector<int32_t>();
      if (world.rank() == 0) {
        EXPECT_EQ(results[0], (std::vector<int32_t>{3 * it, 1}));
      }
    }
    EXPECT_EQ(ex.runs(), 5);
  });
  EXPECT_EQ(results[1], (std::vector<int32_t>{12, 2}));
}

// Outputs are moved out of their slots, except where a value is returned more than once: every
// listing gets it, on every run, and a returned input is the caller's tensor.
TEST(Executor, AValueReturnedTwiceAndAnInputReturnedAreEveryOutput) {
  auto graph = parse(R"(graph @g(%x: i32[2]) {
  %y = add(%x, %x) : i32[2]
  return %y, %x, %y, %y
})");
  run_local(1, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    for (int it = 0; it < 3; ++it) {
      Tensor x = Tensor::from_vector<int32_t>({it, 5});
      auto out = ex.run({x});
      ASSERT_EQ(out.size(), 4u);
      for (size_t i : {0, 2, 3}) {
        ASSERT_TRUE(out[i].defined()) << i;
        EXPECT_EQ(out[i].to_vector<int32_t>(), (std::vector<int32_t>{2 * it, 10})) << i;
      }
      EXPECT_EQ(out[1].to_vector<int32_t>(), (std::vector<int32_t>{it, 5}));
      EXPECT_EQ(out[0].storage(), out[3].storage());
    }
  });
}

// A wait_tensor takes its operand at the operand's last use and shares it otherwise: a graph
// input waited and returned stays the caller's; a wait result that is also an output is not
// reduced in place by a later all_reduce of a value sharing its storage.
TEST(Executor, WaitsOfInputsAndOfOutputsKeepEveryListing) {
  auto graph = parse(R"(graph @g(%x: f32[4]) {
  %wx = wait_tensor(%x)
  %y = neg(%x)
  %ar = all_reduce(%y) {reduce_op = "sum", group = "world"}
  %w1 = wait_tensor(%ar)
  %w2 = wait_tensor(%w1)
  %ar2 = all_reduce(%w2) {reduce_op = "sum", group = "world"}
  %w3 = wait_tensor(%ar2)
  return %wx, %x, %w1, %w3, %w1
})");
  run_local(2, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    for (int it = 0; it < 3; ++it) {
      const float v = static_cast<float>(1 + world.rank() + 2 * it);
      const float sum = -static_cast<float>(3 + 4 * it);  // -(v of rank 0 + v of rank 1)
      const auto out = ex.run({Tensor::full({4}, DType::F32, v)});
      ASSERT_EQ(out.size(), 5u);
      EXPECT_EQ(floats(out[0]), std::vector<float>(4, v)) << it;
      EXPECT_EQ(floats(out[1]), std::vector<float>(4, v)) << it;
      EXPECT_EQ(floats(out[2]), std::vector<float>(4, sum)) << it;
      EXPECT_EQ(floats(out[3]), std::vector<float>(4, 2 * sum)) << it;
      EXPECT_EQ(floats(out[4]), std::vector<float>(4, sum)) << it;
    }
  });
}

TEST(Executor, UnwaitedCollectivesCompleteByTheEndOfARun) {
  auto out =
      run_graph(2, R"(graph @g(%x: f32[2]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[2]
  %unused = all_reduce(%x) {reduce_op = "max", group = "world"} : f32[2]
  return %ar
})",
                [](int r) { return std::vector<Tensor>{Tensor::full({2}, DType::F32, r + 1)}; });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(out[r][0].is_ready());
    EXPECT_EQ(floats(out[r][0]), (std::vector<float>{3, 3}));
  }
}

// A collective fed by another collective's unwaited result reads its input only once ready.
TEST(Executor, CollectiveInputsArePendingResultsWaitedFirst) {
  auto out =
      run_graph(2, R"(graph @g(%x: f32[2]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[2]
  %b = all_gather_into_tensor(%a) {group_size = 2, group = "world"} : f32[4]
  %c = all_reduce(%b) {reduce_op = "sum", group = "world"} : f32[4]
  %w = wait_tensor(%c) : f32[4]
  return %w
})",
                [](int r) { return std::vector<Tensor>{Tensor::full({2}, DType::F32, r + 1)}; });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(floats(out[r][0]), (std::vector<float>{6, 6, 6, 6}));
}

TEST(Executor, MeshGroupsResolveByDimName) {
  auto graph = parse(R"(graph @g(%x: i32[1]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "tp"} : i32[1]
  %b = all_gather_into_tensor(%x) {group_size = 2, group = "dp"} : i32[2]
  %wa = wait_tensor(%a) : i32[1]
  %wb = wait_tensor(%b) : i32[2]
  return %wa, %wb
})");
  std::vector<std::vector<int32_t>> a(4), b(4);
  run_local(4, [&](ProcessGroup& world) {
    DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    Executor ex(*graph, world);
    auto out = ex.run({Tensor::from_vector<int32_t>({world.rank()})});
    a[world.rank()] = out[0].to_vector<int32_t>();
    b[world.rank()] = out[1].to_vector<int32_t>();
  });
  // tp groups {0,1} {2,3}; dp groups {0,2} {1,3}.
  EXPECT_EQ(a[0], (std::vector<int32_t>{1}));
  EXPECT_EQ(a[3], (std::vector<int32_t>{5}));
  EXPECT_EQ(b[0], (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(b[3], (std::vector<int32_t>{1, 3}));
}

// Rank 1 issues its all_gather only after rank 0 ran the compute node placed between its
// all_gather and the wait: so rank 0's compute provably ran while the collective was in flight.
TEST(Executor, ComputeBetweenACollectiveAndItsWaitOverlapsIt) {
  auto graph = parse(R"(graph @g(%x: f32[4], %y: f32[4]) {
  %ag = all_gather_into_tensor(%x) {group_size = 2, group = "world"} : f32[8]
  %c = neg(%y) : f32[4]
  %w = wait_tensor(%ag) : f32[8]
  return %w, %c
})");
  std::promise<size_t> pending_at_compute;
  std::shared_future<size_t> reached = pending_at_compute.get_future().share();
  Profiler prof0;
  run_local(2, [&](ProcessGroup& world) {
    ExecutorOptions options;
    Executor* self = nullptr;
    if (world.rank() == 0) {
      options.profiler = &prof0;
      options.on_node = [&](const Node& node) {
        if (node.name() == "c") pending_at_compute.set_value(self->pending_collectives());
      };
    }
    Executor ex(*graph, world, options);
    self = &ex;
    if (world.rank() == 1) {
      // Bounded, so a broken executor fails the test instead of hanging it.
      ASSERT_EQ(reached.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    }
    auto out = ex.run(make_inputs(*graph, 1, world.rank()));
    EXPECT_EQ(out[0].sizes(), (Shape{8}));
  });
  EXPECT_EQ(reached.get(), 1u);
  // The trace shows it: the compute span lies inside the collective's span, before the wait ends.
  const Span* comm = nullptr;
  const Span* compute = nullptr;
  const Span* wait = nullptr;
  for (const Span& s : prof0.spans()) {
    if (s.kind == SpanKind::Communication) comm = &s;
    if (s.kind == SpanKind::Compute) compute = &s;
    if (s.kind == SpanKind::Wait) wait = &s;
  }
  ASSERT_TRUE(comm && compute && wait);
  EXPECT_EQ(compute->node->name(), "c");
  EXPECT_LE(comm->begin_ns, compute->begin_ns);
  EXPECT_LE(compute->end_ns, wait->begin_ns);
  EXPECT_GE(comm->end_ns, compute->end_ns);
  EXPECT_LE(comm->end_ns, wait->end_ns);
}

template <typename E>
std::string error_of(int n, std::string_view text, bool run = false) {
  auto graph = parse(text);
  try {
    run_local(n, [&](ProcessGroup& world) {
      Executor ex(*graph, world);
      if (run) ex.run(make_inputs(*graph, 0, world.rank()));
    });
  } catch (const E& e) {
    return e.what();
  }
  return "no error";
}

TEST(ExecutorErrors, GroupSizeMismatchNamesNodeAndLine) {
  EXPECT_EQ(error_of<InvalidArgument>(2, R"(graph @g(%x: f32[2]) {
  %y = neg(%x) : f32[2]
  %ag = all_gather_into_tensor(%y) {group_size = 4, group = "world"} : f32[8]
  return %ag
})"),
            "graph @g, node %ag (line 3): group_size 4 does not match group 'world' of size 2");
}

TEST(ExecutorErrors, UnknownGroupListsTheKnownOnes) {
  // Whichever rank failed first is rethrown.
  const std::string error = error_of<InvalidArgument>(2, R"(graph @g(%x: f32[2]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "tp"} : f32[2]
  return %ar
})");
  const auto expected = [](int rank) {
    return fmt::format("graph @g, node %ar (line 2): unknown group 'tp' (known groups: world; a "
                       "group is known on its members only, and rank {} may not be one)",
                       rank);
  };
  EXPECT_TRUE(error == expected(0) || error == expected(1)) << error;
}

// One Executor belongs to one thread: a second thread calling run() while the first is in it
// gets InvalidArgument (its slots and plan are one run's: a second run corrupted the heap).
// Two threads of rank 0 run one Executor; whichever comes second is refused, and the other
// blocks in the all_reduce until rank 1, which waits for that refusal, runs its part.
TEST(ExecutorErrors, ASecondThreadInRunIsRefused) {
  auto graph = parse(R"(graph @g(%x: f32[2]) {
  %ar = all_reduce(%x) {reduce_op = "sum", group = "world"} : f32[2]
  %w = wait_tensor(%ar) : f32[2]
  return %w
})");
  std::promise<std::string> refused;
  std::shared_future<std::string> refusal = refused.get_future().share();
  run_local(2, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    const Tensor x = Tensor::full({2}, DType::F32, world.rank() + 1);
    if (world.rank() == 1) {
      refusal.wait();
      for (int i = 0; i < 2; ++i) EXPECT_EQ(floats(ex.run({x})[0]), (std::vector<float>{3, 3}));
      return;
    }
    std::mutex mu;
    int completed = 0;
    auto run_one = [&] {
      try {
        const std::vector<Tensor> out = ex.run({x});
        EXPECT_EQ(floats(out[0]), (std::vector<float>{3, 3}));
        std::lock_guard lock(mu);
        ++completed;
      } catch (const InvalidArgument& e) {
        refused.set_value(e.what());
      }
    };
    std::thread a(run_one);
    std::thread b(run_one);
    a.join();
    b.join();
    EXPECT_EQ(completed, 1);
    EXPECT_EQ(refusal.get(),
              "Executor::run: this Executor is running already (on another thread, or run() "
              "was called from inside a run); one Executor belongs to one rank's thread (make "
              "one per thread)");
    // Refused, it left the Executor usable.
    EXPECT_EQ(floats(ex.run({x})[0]), (std::vector<float>{3, 3}));
  });
}

TEST(ExecutorErrors, BroadcastSrcAndAllToAllSplitsAreChecked) {
  EXPECT_EQ(error_of<InvalidArgument>(2, R"(graph @g(%x: f32[2]) {
  %b = broadcast(%x) {src = 2, group = "world"} : f32[2]
  return %b
})"),
            "graph @g, node %b (line 2): src 2 is out of range for group 'world' of size 2");
  EXPECT_EQ(error_of<InvalidArgument>(2, R"(graph @g(%x: f32[3]) {
  %a = all_to_all_single(%x) {output_split_sizes = [1, 1, 1], input_split_sizes = [1, 1, 1], group = "world"} : f32[3]
  return %a
})"),
            "graph @g, node %a (line 2): output_split_sizes has 3 entries but group 'world' has 2 "
            "ranks");
}

// Every rank runs the same graph (check_same_graph): rank r sends input_split_sizes[j] rows to
// rank j, which expects output_split_sizes[r], so only equal entries can match. The first pair
// that cannot is named, whichever list differs.
TEST(ExecutorErrors, UnevenSplitSizesInOneGraphForEveryRankAreRefused) {
  EXPECT_EQ(error_of<InvalidArgument>(2, R"(graph @g(%x: f32[4]) {
  %a = all_to_all_single(%x) {output_split_sizes = [2, 2], input_split_sizes = [1, 3], group = "world"} : f32[4]
  return %a
})"),
            "graph @g, node %a (line 2): mismatched split sizes (every rank runs this graph): "
            "rank 0 sends 1 row to rank 0 (input_split_sizes[0]) but rank 0 expects 2 rows from "
            "rank 0 (output_split_sizes[0]); split sizes the same on every rank must all be equal");
  EXPECT_EQ(error_of<InvalidArgument>(3, R"(graph @g(%x: f32[6]) {
  %a = all_to_all_single(%x) {output_split_sizes = [2, 2, 0], input_split_sizes = [2, 2, 2], group = "world"} : f32[4]
  return %a
})"),
            "graph @g, node %a (line 2): mismatched split sizes (every rank runs this graph): "
            "rank 2 sends 2 rows to rank 0 (input_split_sizes[0]) but rank 0 expects 0 rows from "
            "rank 2 (output_split_sizes[2]); split sizes the same on every rank must all be equal");
  // One rank: what it sends itself is what it receives.
  EXPECT_EQ(error_of<InvalidArgument>(1, R"(graph @g(%x: f32[3]) {
  %a = all_to_all_single(%x) {output_split_sizes = [3], input_split_sizes = [3], group = "world"} : f32[3]
  return %a
})"),
            "no error");
}

// Ranks that run graphs of their own (check_same_graph off) may split unevenly, as long as
// their lists agree pairwise.
TEST(Executor, PerRankGraphsSplitUnevenly) {
  // Rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to rank 0 and 1 to itself.
  const std::unique_ptr<Graph> graphs[2] = {
      parse(R"(graph @g(%x: f32[3]) {
  %a = all_to_all_single(%x) {output_split_sizes = [1, 3], input_split_sizes = [1, 2], group = "world"} : f32[4]
  %w = wait_tensor(%a) : f32[4]
  return %w
})"),
      parse(R"(graph @g(%x: f32[4]) {
  %a = all_to_all_single(%x) {output_split_sizes = [2, 1], input_split_sizes = [3, 1], group = "world"} : f32[3]
  %w = wait_tensor(%a) : f32[3]
  return %w
})")};
  std::vector<float> got[2];
  run_local(2, [&](ProcessGroup& world) {
    const int r = world.rank();
    ExecutorOptions options;
    options.check_same_graph = false;
    Executor ex(*graphs[r], world, options);
    const Tensor x = r == 0 ? Tensor::from_vector<float>({1, 2, 3})
                            : Tensor::from_vector<float>({10, 20, 30, 40});
    got[r] = floats(ex.run({x})[0]);
  });
  EXPECT_EQ(got[0], (std::vector<float>{1, 10, 20, 30}));
  EXPECT_EQ(got[1], (std::vector<float>{2, 3, 40}));
}

// A collective that fails (here ranks running graphs of their own issue different shapes) is
// named in the error, not the wait that found out.
TEST(ExecutorErrors, ACollectivesFailureNamesTheCollective) {
  const std::unique_ptr<Graph> graphs[2] = {
      parse(R"(graph @g(%x: f32[4]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %w = wait_tensor(%a)
  return %w
})"),
      parse(R"(graph @g(%x: f32[2]) {
  %a = all_reduce(%x) {reduce_op = "sum", group = "world"}
  %w = wait_tensor(%a)
  return %w
})")};
  std::string errors[2];
  run_local(2, [&](ProcessGroup& world) {
    const int r = world.rank();
    ExecutorOptions options;
    options.check_same_graph = false;
    Executor ex(*graphs[r], world, options);
    try {
      ex.run({Tensor::zeros({r == 0 ? 4 : 2}, DType::F32)});
    } catch (const CommError& e) {
      errors[r] = e.what();
    }
  });
  for (const std::string& e : errors) {
    EXPECT_EQ(e.rfind("graph @g, node %a (line 2): all_reduce on group 'world' (seq 0): "
                      "mismatched collectives",
                      0),
              0u)
        << e;
  }
}

TEST(ExecutorErrors, KernelErrorsNameTheNode) {
  // Integer division by zero passes shape inference but not the kernel.
  const std::string e = error_of<Error>(1, R"(graph @g(%x: i32[2]) {
  %z = zeros() {shape = [2], dtype = i32}
  %v = div(%x, %z)
  return %v
})",
                                        /*run=*/true);
  EXPECT_EQ(e, "graph @g, node %v (line 3): div: integer division by zero");
}

// A run that fails part-way on one rank (a kernel's error, after the rank issued a collective)
// still issues the run's later collectives, failed: its peers' run fails naming the rank and
// why, instead of their next collectives pairing with this rank's next run's (which gave every
// later run on both sides the other run's data, silently: a review's finding). Later runs are
// exact everywhere. The later collectives take each path: an all_gather (the threads backend's
// Op path), a small all_reduce (its lane), a lowered all_reduce bucket (a flat primitive); the
// failing rank comes first or last.
TEST(ExecutorErrors, ARunFailingPartWayStillIssuesItsLaterCollectives) {
  const auto graph = parse(
      R"(graph @g(%a: f32[2], %n: i32[2], %d: i32[2], %c: f32[3], %e: f32[2,3]) {
  %ag1 = all_gather_into_tensor(%a) {group_size = 3, group = "world"}
  %q = div(%n, %d)
  %ag2 = all_gather_into_tensor(%a) {group_size = 3, group = "world"}
  %ar = all_reduce(%a) {reduce_op = "sum", group = "world"}
  %ef = flatten(%e)
  %pack = cat(%c, %ef) {dim = 0}
  %bucket = all_reduce(%pack) {reduce_op = "sum", group = "world"}
  %w1 = wait_tensor(%ag1)
  %w2 = wait_tensor(%ag2)
  %w3 = wait_tensor(%ar)
  %w = wait_tensor(%bucket)
  %s:2 = split_with_sizes(%w) {split_sizes = [3, 6], dim = 0}
  %o = reshape(%s#1) {shape = [2, 3]}
  return %w1, %w2, %w3, %s#0, %o, %q
})");
  constexpr int n = 3;
  // Rank r's inputs in run k: every value distinct across ranks and runs.
  auto base = [](int r, int k) { return static_cast<float>(100 * k + 10 * r); };
  for (const bool failing_first : {true, false}) {
    SCOPED_TRACE(failing_first ? "the failing rank first" : "the failing rank last");
    std::string errors[n];
    ::testing::internal::CaptureStderr();
    run_local(n, [&](ProcessGroup& world) {
      const int r = world.rank();
      Executor ex(*graph, world);
      EXPECT_EQ(ex.lowered_buckets(), 1u);
      for (int k = 0; k < 3; ++k) {
        const float b = base(r, k);
        const bool fails = r == 1 && k == 0;  // rank 1 divides by zero in run 0
        if (k == 0 && (r == 1) != failing_first) {
          std::this_thread::sleep_for(std::chrono::milliseconds(30));
        }
        std::vector<Tensor> in = {
            Tensor::from_vector<float>({b, b + 1}), Tensor::full({2}, DType::I32, 6),
            Tensor::full({2}, DType::I32, fails ? 0 : 3), Tensor::full({3}, DType::F32, b),
            Tensor::full({2, 3}, DType::F32, b + 2)};
        if (k == 0) {
          try {
            ex.run(std::move(in));
            ADD_FAILURE() << "rank " << r << ": run 0 did not fail";
          } catch (const Error& e) {
            errors[r] = e.what();
          }
          continue;
        }
        const std::vector<Tensor> out = ex.run(std::move(in));
        std::vector<float> gathered, sum(2, 0), c(3, 0), e(6, 0);
        for (int p = 0; p < n; ++p) {
          gathered.insert(gathered.end(), {base(p, k), base(p, k) + 1});
          sum[0] += base(p, k);
          sum[1] += base(p, k) + 1;
          for (float& x : c) x += base(p, k);
          for (float& x : e) x += base(p, k) + 2;
        }
        EXPECT_EQ(floats(out[0]), gathered) << "rank " << r << " run " << k;
        EXPECT_EQ(floats(out[1]), gathered) << "rank " << r << " run " << k;
        EXPECT_EQ(floats(out[2]), sum) << "rank " << r << " run " << k;
        EXPECT_EQ(floats(out[3]), c) << "rank " << r << " run " << k;
        EXPECT_EQ(floats(out[4].reshape({6})), e) << "rank " << r << " run " << k;
        EXPECT_EQ(out[5].to_vector<int32_t>(), std::vector<int32_t>({2, 2}));
      }
    });
    // The failed run's error explains the failures of the collectives it dropped: no rank
    // warns of them when it ends.
    EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
    EXPECT_EQ(errors[1], "graph @g, node %q (line 3): div: integer division by zero");
    for (const int r : {0, 2}) {
      // Its run fails at the first later collective it waits for (the others fail too).
      // (seqs 0 and 1 are the executor's check that every rank runs this graph.)
      EXPECT_EQ(errors[r].rfind("graph @g, node %ag2 (line 4): all_gather on group 'world' (seq "
                                "3): rank 1 could not take part: it gave up on the "
                                "rest of its run after an error at graph @g, node %q (line 3): "
                                "div: integer division by zero",
                                0),
                0u)
          << "rank " << r << ": " << errors[r];
    }
  }
}

TEST(ExecutorErrors, InputsAreChecked) {
  auto graph = parse("graph @g(%x: f32[2]) {\n  %y = neg(%x) : f32[2]\n  return %y\n}\n");
  run_local(1, [&](ProcessGroup& world) {
    Executor ex(*graph, world);
    auto expect_error = [&](std::vector<Tensor> inputs, const char* message) {
      try {
        ex.run(std::move(inputs));
        ADD_FAILURE() << "expected InvalidArgument: " << message;
      } catch (const InvalidArgument& e) {
        EXPECT_STREQ(e.what(), message);
      }
    };
    expect_error({}, "graph @g takes 1 inputs, got 0");
    expect_error({Tensor::zeros({3}, DType::F32)}, "graph @g: input %x expects f32[2], got f32[3]");
    EXPECT_THROW(ex.run({Tensor::meta({2}, DType::F32)}), InvalidArgument);
    // The executor still works after a failed run.
    EXPECT_EQ(floats(ex.run({Tensor::full({2}, DType::F32, 2.0)})[0]),
              (std::vector<float>{-2, -2}));
    // After a good run the same checks hold (the layout of a checked input is remembered): a
    // tensor of another shape, or of the same shape (and layout) in another dtype, or a view
    // of the same sizes with other strides.
    expect_error({Tensor::zeros({3}, DType::F32)}, "graph @g: input %x expects f32[2], got f32[3]");
    expect_error({Tensor::zeros({2}, DType::I32)}, "graph @g: input %x expects f32[2], got i32[2]");
    const Tensor strided = Tensor::full({2, 2}, DType::F32, 3.0).select(1, 0);
    EXPECT_EQ(floats(ex.run({strided})[0]), (std::vector<float>{-3, -3}));
    EXPECT_EQ(floats(ex.run({Tensor::full({2}, DType::F32, 4.0)})[0]),
              (std::vector<float>{-4, -4}));
  });
  // A bad input after good ones: the run keeps none of them (inputs are checked and taken in
  // one pass).
  auto two = parse(
      "graph @g(%x: f32[2], %y: f32[2]) {\n  %z = add(%x, %y) : f32[2]\n  return %z\n}\n");
  run_local(1, [&](ProcessGroup& world) {
    Executor ex(*two, world);
    const Tensor x = Tensor::full({2}, DType::F32, 1.0);
    EXPECT_THROW(ex.run({x, Tensor::zeros({3}, DType::F32)}), InvalidArgument);
    EXPECT_EQ(ex.live_bytes(), 0);
    EXPECT_EQ(x.storage().use_count(), 1);
    EXPECT_EQ(floats(ex.run({x, x})[0]), (std::vector<float>{2, 2}));
  });
}

// An all_reduce of an f32[2] on group `group`, waited.
std::unique_ptr<Graph> all_reduce_on(const std::string& group) {
  return parse("graph @g(%x: f32[2]) {\n  %ar = all_reduce(%x) {reduce_op = \"sum\", group = \"" +
               group + "\"} : f32[2]\n  %w = wait_tensor(%ar) : f32[2]\n  return %w\n}\n");
}

// Each rank's InvalidArgument ("" for none) making an Executor of graphs[r] on rank r.
std::vector<std::string> executor_errors(const std::vector<const Graph*>& graphs) {
  std::vector<std::string> errors(graphs.size());
  run_local(static_cast<int>(graphs.size()), [&](ProcessGroup& world) {
    const auto r = static_cast<size_t>(world.rank());
    try {
      Executor ex(*graphs[r], world);
    } catch (const InvalidArgument& e) {
      errors[r] = e.what();
    }
  });
  return errors;
}

TEST(ExecutorErrors, DifferentGraphsOnDifferentRanksFailFast) {
  auto g0 = parse("graph @g(%x: f32[2]) {\n  %y = neg(%x) : f32[2]\n  return %y\n}\n");
  auto g1 = parse("graph @g(%x: f32[2]) {\n  %y = relu(%x) : f32[2]\n  return %y\n}\n");
  EXPECT_NE(graph_hash(*g0), graph_hash(*g1));
  const std::vector<std::string> errors = executor_errors({g0.get(), g1.get(), g0.get()});
  const std::string expect =
      "graph @g differs between ranks: its printed line 2 is `%y = neg(%x) : f32[2]` on ranks "
      "0,2 and `%y = relu(%x) : f32[2]` on rank 1 (every rank must run the same graph; graphs "
      "traced with per-rank split sizes, such as permute_tensor's, need "
      "ExecutorOptions::check_same_graph = false)";
  for (const std::string& e : errors) EXPECT_EQ(e, expect);
}

// The ranks find the first line that differs together, whatever its place: each round they
// compare a prefix, so they must all take the same branch (or deadlock). Graphs of 1 to 40
// nodes, on 4 ranks, differing in one node's op or (on rank 3) in length.
TEST(ExecutorErrors, DifferentGraphsNameTheirFirstDifferentLine) {
  auto chain = [](int nodes, int odd, const char* op) {
    std::string text = "graph @g(%v0: f32[2]) {\n";
    for (int i = 1; i <= nodes; ++i) {
      text += fmt::format("  %v{} = {}(%v{}) : f32[2]\n", i, i == odd ? op : "neg", i - 1);
    }
    return parse(text + fmt::format("  return %v{}\n}}\n", nodes));
  };
  for (int nodes : {1, 2, 7, 40}) {
    for (int odd = 1; odd <= nodes; odd += std::max(1, nodes / 5)) {
      SCOPED_TRACE(fmt::format("{} nodes, node {} differs", nodes, odd));
      const std::string line = fmt::format("%v{} = relu(%v{}) : f32[2]", odd, odd - 1);
      const auto same = chain(nodes, odd, "neg");
      const auto other = chain(nodes, odd, "relu");
      for (const std::string& e :
           executor_errors({same.get(), same.get(), other.get(), same.get()})) {
        EXPECT_NE(e.find(fmt::format("its printed line {} is `%v{} = neg(%v{}) : f32[2]` on "
                                     "ranks 0,1,3 and `{}` on rank 2",
                                     odd + 1, odd, odd - 1, line)),
                  std::string::npos)
            << e;
      }
      // A longer graph on rank 3: its first extra line against the others' return.
      const auto shorter = chain(nodes, 0, "neg");
      const auto longer = chain(nodes + 3, 0, "neg");
      for (const std::string& e :
           executor_errors({shorter.get(), shorter.get(), shorter.get(), longer.get()})) {
        EXPECT_NE(e.find(fmt::format("its printed line {} is `return %v{}` on ranks 0,1,2 and "
                                     "`%v{} = neg(%v{}) : f32[2]` on rank 3",
                                     nodes + 2, nodes, nodes + 1, nodes)),
                  std::string::npos)
            << e;
      }
    }
  }
}

// Of a long line, the message shows the part around the first byte that differs.
TEST(ExecutorErrors, ALongDifferentLineIsShownWhereItDiffers) {
  const std::string name(300, 'n');
  const std::string half = name.substr(0, 150);
  for (const auto& [a, b] : {std::pair<std::string, std::string>{name + "a", name + "b"},
                             {"a" + name, "b" + name},
                             {half + "a" + name, half + "b" + name}}) {
    const auto g0 = all_reduce_on(a);
    const auto g1 = all_reduce_on(b);
    const std::vector<std::string> errors = executor_errors({g0.get(), g1.get()});
    EXPECT_EQ(errors[0], errors[1]);
    const std::string& e = errors[0];
    // Up to 60 bytes before the difference, 128 in all with the ellipses.
    const size_t at = a.find_first_of("ab");
    const size_t head = std::min<size_t>(at, 60);
    const std::string before = a.substr(at - head, head);
    for (const char* side : {"a", "b"}) {
      const std::string start =
          at > 60 ? "..." : "%ar = all_reduce(%x) {reduce_op = \"sum\", group = \"";
      const std::string shown = start + before + side;
      EXPECT_NE(e.find("`" + shown), std::string::npos) << shown << "\n" << e;
    }
    EXPECT_NE(e.find("its printed line 2 is `"), std::string::npos) << e;
    // Cut after it where the line goes on for longer.
    const bool cut_after = a.size() - at > 60;
    EXPECT_NE(e.find(cut_after ? "...` on rank 0 and `" : "a\"} : f32[2]` on rank 0 and `"),
              std::string::npos)
        << e;
    EXPECT_LT(e.size(), 2 * 128 + 300u) << e;
  }
}

// Ranks whose lines agree around the first difference but differ further on are not shown as
// one: grouped by the whole line, they are marked.
TEST(ExecutorErrors, LinesThatDifferPastWhatIsShownAreMarked) {
  const std::string name(300, 'n');
  const auto g0 = all_reduce_on(name);
  const auto g1 = all_reduce_on("b" + name.substr(1));
  const auto g2 = all_reduce_on(name.substr(1) + "c");
  const std::vector<std::string> errors = executor_errors({g0.get(), g1.get(), g2.get(), g0.get()});
  for (const std::string& e : errors) EXPECT_EQ(e, errors[0]);
  const std::string shown = "`%ar = all_reduce(%x) {reduce_op = \"sum\", group = \"";
  const std::string& e = errors[0];
  EXPECT_NE(e.find(shown + "n"), std::string::npos) << e;
  EXPECT_NE(e.find(shown + "b"), std::string::npos) << e;
  EXPECT_NE(e.find("` on ranks 0,3, " + shown + "b"), std::string::npos) << e;
  EXPECT_NE(e.find("` on rank 2, whose line differs further on"), std::string::npos) << e;
}

// The graph check is a collective of funcol's own: a peer that issued one of the same shape
// instead (an all_gather of one i64, or an all_reduce of the i64[2] header every such check
// begins with) gets a mismatch naming the check, not this rank's hash or header as its
// result, and this rank's Executor fails naming the peer's collective.
TEST(ExecutorErrors, TheGraphCheckNeverPairsWithAUsersCollective) {
  auto g = parse("graph @g(%x: f32[2]) {\n  %y = neg(%x) : f32[2]\n  return %y\n}\n");
  for (const bool header_shaped : {false, true}) {
    SCOPED_TRACE(header_shaped ? "the peer's all_reduce" : "the peer's all_gather");
    std::vector<std::string> errors(2, "no error");
    run_local(2, [&](ProcessGroup& world) {
      const int r = world.rank();
      try {
        if (r == 0) {
          Executor ex(*g, world);
        } else if (header_shaped) {
          Tensor t = Tensor::from_vector<int64_t>({100, -100});
          world.all_reduce(t, ReduceOp::Max)->wait();
          errors[r] = fmt::format("all_reduce completed: {}", t.to_vector<int64_t>());
        } else {
          Tensor all = Tensor::empty({2}, DType::I64);
          world.all_gather(all, Tensor::from_vector<int64_t>({100}))->wait();
          errors[r] = fmt::format("all_gather completed: {}", all.to_vector<int64_t>());
        }
      } catch (const CommError& e) {
        errors[r] = e.what();
      }
    });
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("mismatched collectives"), std::string::npos) << e;
      EXPECT_NE(e.find("all_reduce(i64[2], op max) [funcol's agreement step for Executor]"),
                std::string::npos)
          << e;
    }
  }
}

TEST(ExecutorErrors, ValidateGroupsWithoutLiveGroups) {
  auto graph = parse(R"(graph @g(%x: f32[4]) {
  %rs = reduce_scatter_tensor(%x) {reduce_op = "sum", group_size = 2, group = "tp"} : f32[2]
  return %rs
})");
  auto sizes = [](int tp) {
    return [tp](const std::string& name) -> std::optional<int> {
      if (name == "world") return 4;
      if (name == "tp") return tp;
      return std::nullopt;
    };
  };
  EXPECT_NO_THROW(validate_groups(*graph, sizes(2), {"world", "tp"}));
  EXPECT_THROW(validate_groups(*graph, sizes(4), {"world", "tp"}), InvalidArgument);
  EXPECT_THROW(validate_groups(*graph, [](const std::string&) { return std::optional<int>(); }, {}),
               InvalidArgument);
}

TEST(MakeInputs, DeterministicPerSeedIndexAndRank) {
  auto graph = parse(
      "graph @g(%a: f32[64], %b: i32[64], %c: bool[64], %d: bf16[2,3]) {\n"
      "  return %a, %b, %c, %d\n}\n");
  auto x = make_inputs(*graph, 7, 0);
  auto y = make_inputs(*graph, 7, 0);
  ASSERT_EQ(x.size(), 4u);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(x[i].equal(y[i]));
  EXPECT_FALSE(x[0].equal(make_inputs(*graph, 7, 1)[0]));
  EXPECT_FALSE(x[0].equal(make_inputs(*graph, 8, 0)[0]));
  for (float v : x[0].to_vector<float>()) {
    EXPECT_GE(v, -1.0f);
    EXPECT_LT(v, 1.0f);
  }
  for (int32_t v : x[1].to_vector<int32_t>()) {
    EXPECT_GE(v, 0);
    EXPECT_LT(v, 100);
  }
  EXPECT_EQ(x[3].sizes(), (Shape{2, 3}));
  EXPECT_EQ(x[3].dtype(), DType::BF16);
  EXPECT_EQ(input_seed(7, 0, 0), input_seed(7, 0, 0));
  EXPECT_NE(input_seed(7, 0, 1), input_seed(7, 1, 0));
}

TEST(Digest, HexOfXxh3OverLogicalBytes) {
  Tensor a = Tensor::arange(6, DType::I32).view({2, 3});
  const std::string d = tensor_digest(a);
  EXPECT_EQ(d.size(), 16u);
  EXPECT_EQ(d.find_first_not_of("0123456789abcdef"), std::string::npos);
  // A transposed view hashes its elements in logical order.
  EXPECT_EQ(tensor_digest(a.transpose(0, 1)), tensor_digest(a.transpose(0, 1).contiguous()));
  EXPECT_NE(tensor_digest(a.transpose(0, 1)), d);
  EXPECT_EQ(tensor_digest(Tensor::zeros({0}, DType::F32)), fmt_hash(xxh3_64(nullptr, 0)));
}

// Views of more than the 4 MiB a digest copies at a time hash as their contiguous copies do:
// pieces of rows, of a single row longer than a piece, and of an expanded view.
TEST(Digest, LargeViewsHashInPieces) {
  const Tensor a = Tensor::rand({1100, 1500}, DType::F32, 3);  // 6.6 MB
  const auto one_shot = [](const Tensor& t) {
    const Tensor c = t.contiguous();
    return fmt_hash(xxh3_64(c.const_data_ptr(), c.nbytes()));
  };
  EXPECT_EQ(tensor_digest(a), one_shot(a));
  EXPECT_EQ(tensor_digest(a.transpose(0, 1)), one_shot(a.transpose(0, 1)));
  const Tensor row = Tensor::rand({1, 3, 1}, DType::F64, 4).expand({1, 3, 400000});  // 9.6 MB
  EXPECT_EQ(tensor_digest(row), one_shot(row));
  EXPECT_EQ(tensor_digest(row.permute({0, 2, 1})), one_shot(row.permute({0, 2, 1})));
  const Tensor narrow = a.narrow(1, 7, 1400);
  EXPECT_EQ(tensor_digest(narrow), one_shot(narrow));
  EXPECT_NE(tensor_digest(narrow), tensor_digest(a.narrow(1, 8, 1400)));
}

}  // namespace
}  // namespace funcol
