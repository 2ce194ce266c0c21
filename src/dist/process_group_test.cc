// Tests of the backend-independent dist parts: registry, new_group, DeviceMesh, argument checks
// and the base class's coalesced defaults (through a group that only forwards primitives).
#include "funcol/dist/process_group.h"

#include <gtest/gtest.h>

#include <chrono>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "funcol/core/error.h"
#include "funcol/dist/backend.h"
#include "funcol/dist/device_mesh.h"
#include "testing/conformance.h"
#include "testing/forwarding_group.h"
#include "testing/poll.h"
#include "testing/run_ranks.h"

namespace funcol {
namespace {

using testing::ForwardingGroup;
using testing::poll_until_ready;
using testing::run_ranks;

// Expects `fn` to throw E with a message containing every piece.
template <typename E, typename Fn>
void expect_error(Fn&& fn, std::initializer_list<std::string> pieces) {
  try {
    fn();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    std::string what = e.what();
    for (const auto& p : pieces) EXPECT_NE(what.find(p), std::string::npos) << what << " lacks " << p;
  }
}

// The conformance suite's coalesced family over the base class's staging defaults.
const bool kRegistered = [] {
  testing::ConformanceConfig config;
  config.backend = "base_coalesced";
  config.launch = [](int n, const testing::RankFn& fn) {
    run_local(n, [&](ProcessGroup& world) {
      ForwardingGroup fwd(world);
      fn(fwd);
    });
  };
  config.world_sizes = {1, 2, 3, 4};
  config.families = {"coalesced"};
  testing::register_conformance_tests(config);
  return true;
}();

TEST(BaseCoalescedTest, DroppedAndUnwaitedResultsAreSafe) {
  run_ranks(2, [](ProcessGroup& world) {
    ForwardingGroup fwd(world);
    {
      std::vector<Tensor> ts = {Tensor::full({5}, DType::F32, 1), Tensor::full({3}, DType::I32, 2)};
      fwd.all_reduce_coalesced(ts, ReduceOp::Sum);  // dropped: result and Work
    }
    std::vector<Tensor> ts = {Tensor::full({5}, DType::F32, 1)};
    auto w = fwd.all_reduce_coalesced(ts, ReduceOp::Sum);
    EXPECT_EQ(ts[0].to_vector<float>(), std::vector<float>(5, 2.0f));  // waits through the tensor
    EXPECT_TRUE(w->is_completed());
  });
}

// A caller that polls a staged result (Tensor::is_ready) instead of waiting sees it complete,
// with its values, and a staged collective that can never finish fail at once (its peer
// returned without it): the
// staging Work finished only in wait(), so a loop on is_ready() spun for ever (a review's
// finding; mpi and gloo use the defaults for all_reduce_coalesced_into).
TEST(BaseCoalescedTest, PollingAStagedResultSeesItEnd) {
  enum Form { kAllReduce, kAllReduceInto, kAllGather, kReduceScatter };
  for (const Form form : {kAllReduce, kAllReduceInto, kAllGather, kReduceScatter}) {
    SCOPED_TRACE(form);
    // Rank 1 issues it too (complete) or returns without it (rank 0's fails).
    for (const bool peer_issues : {true, false}) {
      SCOPED_TRACE(peer_issues ? "complete" : "failed");
      std::string error;
      double polled = -1;
      run_local(
          2,
          [&](ProcessGroup& world) {
            ForwardingGroup fwd(world);
            const int r = world.rank();
            if (r == 1 && !peer_issues) return;  // departs: rank 0's fails at once
            Tensor in = Tensor::full({4}, DType::F32, r + 1);
            Tensor out = Tensor::empty({form == kAllGather ? 8 : form == kReduceScatter ? 2 : 4},
                                       DType::F32);
            std::vector<float> expected;
            switch (form) {
              case kAllReduce:
                out = in;
                fwd.all_reduce_coalesced({out}, ReduceOp::Sum);
                expected.assign(4, 3.0f);
                break;
              case kAllReduceInto:
                fwd.all_reduce_coalesced_into({out}, {in}, ReduceOp::Sum);
                expected.assign(4, 3.0f);
                break;
              case kAllGather:
                fwd.all_gather_coalesced({out}, {in});
                expected = {1, 1, 1, 1, 2, 2, 2, 2};
                break;
              case kReduceScatter:
                fwd.reduce_scatter_coalesced({out}, {in}, ReduceOp::Sum);
                expected.assign(2, 3.0f);
                break;
            }
            const double took = poll_until_ready(out, std::chrono::seconds(10));
            if (r == 0) polled = took;
            try {
              EXPECT_EQ(out.to_vector<float>(), expected);
            } catch (const CommError& e) {
              if (r == 0) error = e.what();
            }
          });
      EXPECT_LT(polled, 5.0);
      if (peer_issues) {
        EXPECT_EQ(error, "");
      } else {
        EXPECT_NE(error.find("rank 1 departed (returned) before joining; missing ranks [1]"),
                  std::string::npos)
            << error;
      }
    }
  }
}

// A staged collective of several dtypes runs one primitive per dtype. When they all fail, the
// rank that waited for the staged result saw their failure (one error stands for all: no
// warning at its end), and a rank that only polled the result (is_ready) and dropped it did
// not (warned once, as for a dropped primitive). Before, a wait counted only the first
// primitive's failure seen and warned of the second, and polling counted both seen.
TEST(BaseCoalescedTest, AStagedResultsFailureCountsSeenWhenItsWaitThrowsIt) {
  for (const bool waited : {true, false}) {
    SCOPED_TRACE(waited ? "waited" : "polled");
    ::testing::internal::CaptureStderr();
    run_local(2, [&](ProcessGroup& world) {
      ForwardingGroup fwd(world);
      if (world.rank() == 1) return;  // departs: rank 0's collectives fail at once
      std::vector<Tensor> ts = {Tensor::full({4}, DType::F32, 1), Tensor::full({2}, DType::I32, 2)};
      fwd.all_reduce_coalesced(ts, ReduceOp::Sum);
      if (waited) {
        EXPECT_THROW(ts[1].to_vector<int32_t>(), CommError);
      } else {
        poll_until_ready(ts[0], std::chrono::seconds(10));
        EXPECT_TRUE(ts[0].is_ready());
      }
    });
    const std::string err = ::testing::internal::GetCapturedStderr();
    if (waited) {
      EXPECT_EQ(err, "");
    } else {
      EXPECT_EQ(err,
                "funcol: warning: rank 0 ended with 2 collectives it had not waited for, which "
                "failed; the first: all_reduce on group 'world' (seq 0): rank 1 departed "
                "(returned) before joining; missing ranks [1]\n");
    }
  }
}

// The staging defaults check the lists as threads does: overlapping outputs (which the copies
// out of the staging buffer wrote one over the other, last one winning) are rejected, and an
// in-place pair (an input that is this rank's block of its output) is not.
TEST(BaseCoalescedTest, RejectsOverlappingOutputsAsThreadsDoes) {
  run_ranks(2, [](ProcessGroup& world) {
    ForwardingGroup fwd(world);
    for (ProcessGroup* pg : {&world, static_cast<ProcessGroup*>(&fwd)}) {
      Tensor buf = Tensor::zeros({16}, DType::F32);
      Tensor a = Tensor::full({4}, DType::F32, 1);
      Tensor in = Tensor::full({8}, DType::F32, 1);
      expect_error<InvalidArgument>(
          [&] { pg->all_gather_coalesced({buf.narrow(0, 0, 8), buf.narrow(0, 4, 8)}, {a, a}); },
          {"all_gather_coalesced: output 0 overlaps output 1"});
      expect_error<InvalidArgument>(
          [&] {
            pg->reduce_scatter_coalesced({buf.narrow(0, 0, 4), buf.narrow(0, 2, 4)}, {in, in},
                                         ReduceOp::Sum);
          },
          {"reduce_scatter_coalesced: output 0 overlaps output 1"});
      Tensor g = Tensor::full({8}, DType::F32, world.rank() + 1);
      pg->all_gather_coalesced({g}, {g.narrow(0, 4 * world.rank(), 4)})->wait();
      EXPECT_EQ(g.to_vector<float>(), (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2}))
          << pg->backend();
    }
  });
}

// On one rank every out-of-place reduction copies the bytes as the in-place all_reduce leaves
// them: a bool byte of 2 stays 2 (normalising it would make the forms disagree), whichever op.
TEST(AllReduceIntoTest, OneRankKeepsTheBytesAsTheyAre) {
  run_ranks(1, [](ProcessGroup& world) {
    ForwardingGroup staged(world);
    const std::vector<uint8_t> raw = {0, 2, 255, 1};
    auto bools = [&] { return Tensor::from_vector<uint8_t>(raw).view_dtype(DType::Bool); };
    auto bytes = [](const Tensor& t) { return t.view_dtype(DType::U8).to_vector<uint8_t>(); };
    for (ProcessGroup* pg : {&world, static_cast<ProcessGroup*>(&staged)}) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Min, ReduceOp::BXor}) {
        const std::string where = pg->backend() + " " + std::string(reduce_op_name(op));
        Tensor in = bools();
        pg->all_reduce(in, op)->wait();
        EXPECT_EQ(bytes(in), raw) << where << ": all_reduce";
        Tensor out = Tensor::empty({4}, DType::Bool);
        pg->all_reduce_coalesced_into({out}, {bools()}, op)->wait();
        EXPECT_EQ(bytes(out), raw) << where << ": all_reduce_coalesced_into";
        out = Tensor::empty({4}, DType::Bool);
        pg->reduce_scatter(out, bools(), op)->wait();
        EXPECT_EQ(bytes(out), raw) << where << ": reduce_scatter";
        out = Tensor::empty({4}, DType::Bool);
        pg->reduce_scatter_coalesced({out}, {bools()}, op)->wait();
        EXPECT_EQ(bytes(out), raw) << where << ": reduce_scatter_coalesced";
        for (const bool scatter : {false, true}) {
          auto list = std::make_shared<std::vector<Tensor>>(std::vector<Tensor>{bools(), bools()});
          Tensor flat = Tensor::empty({8}, DType::Bool);
          (scatter ? pg->reduce_scatter_flat(flat, list, op) : pg->all_reduce_flat(flat, list, op))
              ->wait();
          std::vector<uint8_t> twice = raw;
          twice.insert(twice.end(), raw.begin(), raw.end());
          EXPECT_EQ(bytes(flat), twice) << where << (scatter ? ": reduce_scatter_flat"
                                                             : ": all_reduce_flat");
        }
      }
    }
  });
}

TEST(GroupRegistryTest, WorldIsRegisteredAndNamesAreUnique) {
  run_ranks(2, [](ProcessGroup& world) {
    GroupRegistry& reg = world.registry();
    EXPECT_EQ(reg.world().get(), &world);
    EXPECT_EQ(reg.names(), std::vector<std::string>{"world"});
    EXPECT_EQ(reg.find("nope"), nullptr);
    expect_error<InvalidArgument>([&] { reg.get("nope"); }, {"unknown group 'nope'", "world"});
    EXPECT_EQ(reg.find_by_ranks({0, 1}).get(), &world);
    EXPECT_EQ(reg.find_by_ranks({1, 0}), nullptr);
    EXPECT_EQ(reg.next_group_name(), "group1");
    EXPECT_EQ(reg.next_group_name(), "group2");
    reg.add(reg.world());  // the same group again is a no-op
    EXPECT_EQ(reg.names().size(), 1u);
    // A second group of the same ranks: found by its name; by its ranks the first one is.
    auto dup = new_group(world, {0, 1}, "dup");
    EXPECT_EQ(reg.find("dup"), dup);
    EXPECT_EQ(reg.find_by_ranks({0, 1}).get(), &world);
    EXPECT_EQ(reg.names(), (std::vector<std::string>{"world", "dup"}));
  });
}

TEST(NewGroupTest, SortsRanksNamesGroupsAndRegistersThem) {
  run_ranks(4, [](ProcessGroup& world) {
    auto g = new_group(world, {3, 1});
    if (world.rank() == 1 || world.rank() == 3) {
      ASSERT_NE(g, nullptr);
      EXPECT_EQ(g->global_ranks(), (std::vector<int>{1, 3}));
      EXPECT_EQ(g->rank(), world.rank() == 1 ? 0 : 1);
      EXPECT_EQ(g->name(), "group1");
      EXPECT_EQ(world.registry().get("group1"), g);
      EXPECT_EQ(g->backend(), "threads");
    } else {
      EXPECT_EQ(g, nullptr);
      EXPECT_EQ(world.registry().find("group1"), nullptr);
    }
    auto named = new_group(world, {0, 1, 2, 3}, "everyone");
    ASSERT_NE(named, nullptr);
    EXPECT_EQ(named->name(), "everyone");
    EXPECT_EQ(world.registry().next_group_name(), "group2");
  });
}

// new_group(ranks) works over the calling rank's world, as torch.distributed.new_group does.
TEST(NewGroupTest, OverTheCurrentWorld) {
  run_ranks(4, [](ProcessGroup& world) {
    auto g = new_group({2, 0});
    if (world.rank() == 0 || world.rank() == 2) {
      ASSERT_NE(g, nullptr);
      EXPECT_EQ(g->global_ranks(), (std::vector<int>{0, 2}));
      EXPECT_EQ(g->name(), "group1");
      Tensor t = Tensor::full({3}, DType::I32, world.rank());
      g->all_reduce(t, ReduceOp::Sum)->wait();
      EXPECT_EQ(t.to_vector<int>(), (std::vector<int>{2, 2, 2}));
    } else {
      EXPECT_EQ(g, nullptr);
    }
    EXPECT_EQ(new_group({0, 1, 2, 3}, "all")->name(), "all");
  });
  expect_error<InvalidArgument>([] { new_group({0, 1}); }, {"new_group: no world on this thread"});
}

TEST(NewGroupTest, RejectsBadRankLists) {
  run_ranks(2, [](ProcessGroup& world) {
    expect_error<InvalidArgument>([&] { new_group(world, {}); }, {"new_group", "empty"});
    expect_error<InvalidArgument>([&] { new_group(world, {0, 0}); }, {"rank 0 is listed twice"});
    expect_error<InvalidArgument>([&] { new_group(world, {0, 5}); },
                                  {"rank 5 is not in group 'world'"});
    new_group(world, {0, 1}, "pair");
    expect_error<InvalidArgument>([&] { new_group(world, {0, 1}, "pair"); },
                                  {"new_group: group name 'pair' is already registered"});
  });
}

// new_group's errors name new_group, not the split_group it runs: ranks that pass different
// lists fail alike, each naming what two ranks passed.
TEST(NewGroupTest, DisagreeingRanksGetAnErrorNamingNewGroup) {
  run_ranks(3, [](ProcessGroup& world) {
    const std::vector<int> ranks =
        world.rank() == 2 ? std::vector<int>{0, 1, 2} : std::vector<int>{0, 1};
    expect_error<CommError>([&] { new_group(world, ranks, "g"); },
                            {"new_group on group 'world' (split ",
                             "): rank 0 passed [[0, 1]] as 'g' but rank 2 passed [[0, 1, 2]] as "
                             "'g'"});
    EXPECT_EQ(world.registry().find("g"), nullptr);
  });
}

// A peer that issued a collective of its own where new_group agrees: the mismatch labels the
// agreement step with new_group, the call the user made (it said split_group for a named one).
TEST(NewGroupTest, AMismatchedAgreementStepIsLabelledNewGroup) {
  run_ranks(2, [](ProcessGroup& world) {
    if (world.rank() == 0) {
      expect_error<CommError>([&] { new_group(world, {0, 1}, "a"); },
                              {"[funcol's agreement step for new_group]"});
    } else {
      Tensor t = Tensor::zeros({3}, DType::F32);
      expect_error<CommError>([&] { world.all_reduce(t, ReduceOp::Sum)->wait(); },
                              {"[funcol's agreement step for new_group]"});
    }
  });
}

// Registries differ between ranks (a group is registered on its members only), so name checks
// and automatic names are agreed by every rank: a name taken on some ranks fails every rank
// alike and leaves the world usable; an unnamed group skips a "group<N>" a user took.
TEST(NewGroupTest, NamesTakenOnSomeRanksOnly) {
  run_ranks(4, [](ProcessGroup& world) {
    const int r = world.rank();
    new_group(world, {0, 1}, "group1");  // on ranks 0 and 1 only
    expect_error<InvalidArgument>([&] { new_group(world, {2, 3}, "group1"); },
                                  {"new_group: group name 'group1' is already registered "
                                   "(ranks [0, 1]) on rank 0"});
    auto unnamed = new_group(world, {2, 3});
    if (r >= 2) {
      EXPECT_EQ(unnamed->name(), "group2");
    }
    Tensor t = Tensor::full({1}, DType::I32, 1);
    world.all_reduce(t, ReduceOp::Sum)->wait();  // the world is still in step
    EXPECT_EQ(t.item<int>(), 4);
  });
}

// A rank that never comes to new_group: the others' error names new_group's agreement, not
// only an all_reduce the user never called.
// Unnamed groups made over a subgroup count on its ranks only; the next unnamed group over
// the world must still get one name on every rank (each rank took its own counter's, and every
// later unnamed group failed: "passed ... as 'group4' but rank 2 passed ... as 'group3'").
TEST(NewGroupTest, UnnamedGroupsAfterOnesMadeOverASubgroup) {
  run_ranks(4, [](ProcessGroup& world) {
    auto a = new_group(world, {0, 1});
    if (world.rank() < 2) new_group(*a, {0, 1});
    for (int i = 0; i < 3; ++i) {
      auto all = new_group(world, {0, 1, 2, 3});
      ASSERT_NE(all, nullptr);
      EXPECT_EQ(all->name(), "group" + std::to_string(3 + i));
      Tensor t = Tensor::full({1}, DType::I32, 1);
      all->all_reduce(t, ReduceOp::Sum)->wait();
      EXPECT_EQ(t.item<int>(), 4);
    }
  });
}

// A group kept after its world ended cannot reach the freed registry: an error, not a read of
// freed memory (a hang on its mutex, or a crash).
TEST(NewGroupTest, AGroupKeptAfterItsWorldEndedHasNoRegistry) {
  std::vector<std::shared_ptr<ProcessGroup>> kept(2);
  run_ranks(2, [&](ProcessGroup& world) { kept[world.rank()] = new_group(world, {0, 1}, "kept"); });
  for (const auto& g : kept) {
    ASSERT_NE(g, nullptr);
    expect_error<InvalidArgument>([&] { g->registry(); },
                                  {"group 'kept' is used after its world ended"});
    expect_error<InvalidArgument>([&] { new_group(*g, {0}); }, {"after its world ended"});
  }
}

TEST(NewGroupTest, ARankThatNeverComesFailsTheAgreementByName) {
  run_ranks(3, [](ProcessGroup& world) {
    if (world.rank() == 2) return;  // leaves without calling new_group
    expect_error<CommError>([&] { new_group(world, {0, 1}); },
                            {"new_group: agreeing with the other ranks of group 'world' failed",
                             "missing ranks [2]"});
  });
}

// funcol's own collective inside new_group (its agreement's first step, the header: an
// all_reduce of two i64, op max) never pairs with a user's all_reduce of the same shape on a peer. Both fail with the
// mismatch, and the peer's message says what the other side was.
// Ranks that build a mesh with different dim names: the error names DeviceMesh, the call they
// made (it named split_group), and what each passed.
TEST(NewGroupTest, MeshesThatDisagreeNameDeviceMesh) {
  run_ranks(2, [](ProcessGroup& world) {
    expect_error<CommError>(
        [&] { DeviceMesh mesh(world, {{world.rank() == 0 ? "dp" : "a", 2}}); },
        {"DeviceMesh on group 'world' (split 0): rank 0 passed [[0, 1]] as 'dp' but rank 1 "
         "passed [[0, 1]] as 'a'"});
  });
}

TEST(NewGroupTest, TheAgreementNeverPairsWithAUsersCollective) {
  run_ranks(2, [](ProcessGroup& world) {
    const std::string mismatch =
        "mismatched collectives: rank 0 issued all_reduce(i64[2], op max) [funcol's agreement "
        "step for new_group] but rank 1 issued all_reduce(i64[2], op max)";
    if (world.rank() == 0) {
      expect_error<CommError>(
          [&] { new_group(world, {0, 1}); },
          {"new_group: agreeing with the other ranks of group 'world' failed", mismatch});
    } else {
      Tensor t = Tensor::zeros({2}, DType::I64);  // the first step's very shape
      expect_error<CommError>([&] { world.all_reduce(t, ReduceOp::Max)->wait(); }, {mismatch});
    }
  });
}

TEST(DeviceMeshTest, RowMajorGroupsPerDim) {
  run_ranks(8, [](ProcessGroup& world) {
    DeviceMesh mesh(world, {{"pp", 2}, {"dp", 2}, {"tp", 2}});
    int r = world.rank();
    EXPECT_EQ(mesh.ndim(), 3);
    EXPECT_EQ(mesh.coordinate(), (std::vector<int>{r / 4, (r / 2) % 2, r % 2}));
    EXPECT_EQ(mesh.group("pp")->global_ranks(), (std::vector<int>{r % 4, r % 4 + 4}));
    EXPECT_EQ(mesh.group("dp")->global_ranks(),
              (std::vector<int>{r - ((r / 2) % 2) * 2, r - ((r / 2) % 2) * 2 + 2}));
    EXPECT_EQ(mesh.group(2)->global_ranks(), (std::vector<int>{r - r % 2, r - r % 2 + 1}));
    EXPECT_EQ(mesh.ranks(), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
    EXPECT_EQ(world.registry().get("dp"), mesh.group("dp"));
    Tensor t = Tensor::full({2}, DType::I32, r);
    mesh.group("pp")->all_reduce(t, ReduceOp::Sum);
    EXPECT_EQ(t.to_vector<int>(), std::vector<int>(2, 2 * (r % 4) + 4));
    // Building the same mesh again reuses its groups.
    DeviceMesh again(world, {{"pp", 2}, {"dp", 2}, {"tp", 2}});
    EXPECT_EQ(again.group("tp"), mesh.group("tp"));
  });
}

TEST(DeviceMeshTest, MeshOverASubgroup) {
  run_ranks(4, [](ProcessGroup& world) {
    auto g = new_group(world, {1, 2, 3}, "three");
    if (!g) return;
    DeviceMesh mesh(*g, {{"m", 3}});
    EXPECT_EQ(mesh.ranks(), (std::vector<int>{1, 2, 3}));
    EXPECT_EQ(mesh.group("m")->global_ranks(), (std::vector<int>{1, 2, 3}));
  });
}

// A second mesh may name a dim as an earlier one did over other ranks (as PyTorch's meshes, whose
// dim names are their own): its group is registered as "tp.2". The ranks decide together, also
// when only some of them built a mesh over a subgroup before (a rank reusing its group while
// the others split used to leave the split waiting for it).
TEST(DeviceMeshTest, DimNamesCanBeReusedByAnotherShape) {
  run_ranks(4, [](ProcessGroup& world) {
    const int r = world.rank();
    DeviceMesh a(world, {{"dp", 2}, {"tp", 2}});
    DeviceMesh b(world, {{"tp", 2}, {"dp", 2}});
    EXPECT_EQ(a.group("tp")->name(), "tp");
    EXPECT_EQ(b.group("tp")->name(), "tp.2");
    EXPECT_EQ(b.group("tp")->global_ranks(), (std::vector<int>{r % 2, r % 2 + 2}));
    EXPECT_EQ(world.registry().get("tp"), a.group("tp"));
    Tensor t = Tensor::full({2}, DType::I32, r);
    b.group("tp")->all_reduce(t, ReduceOp::Sum)->wait();
    EXPECT_EQ(t.to_vector<int>(), std::vector<int>(2, 2 * (r % 2) + 2));
    DeviceMesh b_again(world, {{"tp", 2}, {"dp", 2}});
    EXPECT_EQ(b_again.group("dp"), b.group("dp"));
  });
  run_ranks(4, [](ProcessGroup& world) {
    if (auto pair = new_group(world, {0, 1}, "pair")) DeviceMesh sub(*pair, {{"tp", 2}});
    DeviceMesh mesh(world, {{"dp", 2}, {"tp", 2}});
    const int r = world.rank();
    EXPECT_EQ(mesh.group("tp")->global_ranks(), (std::vector<int>{r - r % 2, r - r % 2 + 1}));
    Tensor t = Tensor::full({1}, DType::I32, r);
    mesh.group("tp")->all_reduce(t, ReduceOp::Sum)->wait();
    EXPECT_EQ(t.item<int>(), 2 * (r - r % 2) + 1);
  });
}

// A mesh built again reuses its groups also when a dim's plain name is taken on some ranks
// only (the reuse scan stopped at the first name a rank lacked, so the ranks never agreed and
// every rebuild split the world again: tp.2, tp.3, tp.4).
TEST(DeviceMeshTest, RebuildsReuseGroupsPastNamesTakenOnSomeRanks) {
  run_ranks(4, [](ProcessGroup& world) {
    if (auto pair = new_group(world, {0, 1}, "pair")) DeviceMesh sub(*pair, {{"tp", 2}});
    new_group(world, {2, 3}, "dp");
    DeviceMesh first(world, {{"dp", 2}, {"tp", 2}});
    const size_t groups = world.registry().names().size();
    for (int i = 0; i < 3; ++i) {
      DeviceMesh again(world, {{"dp", 2}, {"tp", 2}});
      EXPECT_EQ(again.group("tp"), first.group("tp"));
      EXPECT_EQ(again.group("dp"), first.group("dp"));
    }
    EXPECT_EQ(world.registry().names().size(), groups);
    EXPECT_EQ(first.group("tp")->name(), "tp.2");
    EXPECT_EQ(first.group("dp")->name(), "dp.2");
  });
}

TEST(DeviceMeshTest, RejectsBadDims) {
  run_ranks(4, [](ProcessGroup& world) {
    expect_error<InvalidArgument>([&] { DeviceMesh(world, {{"dp", 2}, {"tp", 3}}); },
                                  {"dp=2 x tp=3", "need 6 ranks", "'world' has 4"});
    expect_error<InvalidArgument>([&] { DeviceMesh(world, {{"a", 2}, {"a", 2}}); },
                                  {"'a' is used twice"});
    expect_error<InvalidArgument>([&] { DeviceMesh(world, {}); }, {"at least one dim"});
    expect_error<InvalidArgument>([&] { DeviceMesh(world, {{"dp", 2}, {"", 2}}); },
                                  {"DeviceMesh: dim 1 has an empty name"});
    expect_error<InvalidArgument>([&] { DeviceMesh(world, {{"a", 0}, {"b", 4}}); },
                                  {"'a' has size 0"});
    // A product past int64 wraps to 4 (2^64 + 4) without the overflow check; it crashed.
    expect_error<InvalidArgument>(
        [&] { DeviceMesh(world, {{"d0", 769546}, {"d1", 494770}, {"d2", 8681}, {"d3", 5581}}); },
        {"need more than 2^63 ranks", "'world' has 4"});
    DeviceMesh mesh(world, {{"x", 4}});
    expect_error<InvalidArgument>([&] { mesh.group("y"); }, {"unknown dim 'y'", "x"});
    expect_error<InvalidArgument>([&] { mesh.group(1); }, {"dim 1 is out of range"});
  });
}

TEST(ArgumentChecksTest, PrimitivesValidateSynchronously) {
  run_ranks(2, [](ProcessGroup& pg) {
    Tensor f4 = Tensor::zeros({4}, DType::F32);
    Tensor f8 = Tensor::zeros({8}, DType::F32);
    Tensor i8 = Tensor::zeros({8}, DType::I32);
    Tensor strided = Tensor::zeros({4, 4}, DType::F32).transpose(0, 1);
    expect_error<ShapeError>([&] { pg.all_gather(f4, f4); },
                             {"all_gather", "output numel (4)", "group size (2)", "input numel (4)"});
    expect_error<InvalidArgument>([&] { pg.all_gather(i8, f4); },
                                  {"all_gather", "dtype i32", "f32"});
    expect_error<InvalidArgument>([&] { pg.all_reduce(strided, ReduceOp::Sum); },
                                  {"all_reduce", "contiguous"});
    expect_error<InvalidArgument>([&] { pg.all_reduce(f4, ReduceOp::BXor); },
                                  {"all_reduce", "bxor", "f32"});
    expect_error<InvalidArgument>(
        [&] { pg.all_reduce(Tensor::zeros({2}, DType::Bool), ReduceOp::Avg); },
        {"avg is not supported on bool"});
    expect_error<ShapeError>([&] { pg.reduce_scatter(f8, f4, ReduceOp::Sum); },
                             {"reduce_scatter", "input numel (4)", "output numel (8)"});
    expect_error<InvalidArgument>([&] { pg.broadcast(f4, 2); }, {"broadcast", "src 2"});
    expect_error<InvalidArgument>([&] { pg.all_reduce(Tensor(), ReduceOp::Sum); },
                                  {"all_reduce", "undefined"});
    expect_error<InvalidArgument>(
        [&] { pg.all_reduce(Tensor::meta({2}, DType::F32), ReduceOp::Sum); }, {"meta"});
    Tensor in = Tensor::zeros({5, 2}, DType::F32);
    Tensor out = Tensor::zeros({5, 2}, DType::F32);
    expect_error<ShapeError>([&] { pg.all_to_all(out, in, {}, {}); },
                             {"all_to_all", "dim 0 (5)", "multiple of group size 2"});
    expect_error<ShapeError>([&] { pg.all_to_all(out, in, {2, 3}, {1, 3}); },
                             {"input_split_sizes sum to 4", "dim 0 is 5"});
    expect_error<InvalidArgument>([&] { pg.all_to_all(out, in, {5}, {5}); },
                                  {"has 1 entries", "group size is 2"});
    expect_error<InvalidArgument>([&] { pg.all_to_all(out, in, {6, -1}, {6, -1}); },
                                  {"negative"});
    const int64_t kMax = std::numeric_limits<int64_t>::max();
    expect_error<InvalidArgument>([&] { pg.all_to_all(out, in, {kMax, kMax}, {2, 3}); },
                                  {"output_split_sizes", "sum to more than int64 holds"});
    expect_error<InvalidArgument>([&] { pg.all_to_all(out, in, {2, 3}, {}); },
                                  {"specified together"});
    expect_error<ShapeError>(
        [&] { pg.all_to_all(Tensor::zeros({5, 3}, DType::F32), in, {2, 3}, {2, 3}); },
        {"rows"});
    expect_error<InvalidArgument>(
        [&] { pg.all_gather_coalesced({f8}, {f4, f4}); }, {"all_gather_coalesced", "1 outputs", "2 inputs"});
    // all_reduce_coalesced_into: pairs of equal dtype and numel, no output overlapping anything
    // but its own input.
    Tensor buf = Tensor::zeros({16}, DType::F32);
    auto into = [&](std::vector<Tensor> outs, std::vector<Tensor> ins) {
      pg.all_reduce_coalesced_into(outs, ins, ReduceOp::Sum);
    };
    expect_error<InvalidArgument>([&] { into({f4}, {f4, f4}); },
                                  {"all_reduce_coalesced_into", "1 outputs", "2 inputs"});
    expect_error<ShapeError>([&] { into({f4}, {f8}); },
                             {"all_reduce_coalesced_into", "output 0 numel (4)", "input 0 numel (8)"});
    expect_error<InvalidArgument>([&] { into({f8}, {i8}); }, {"output 0 dtype f32", "input 0 dtype i32"});
    expect_error<InvalidArgument>([&] { into({strided}, {Tensor::zeros({16}, DType::F32)}); },
                                  {"output 0 must be contiguous"});
    expect_error<InvalidArgument>(
        [&] { into({f4, Tensor::zeros({4}, DType::F32)}, {Tensor::zeros({4}, DType::F32), f4}); },
        {"all_reduce_coalesced_into", "overlaps", "output 0", "input 1"});
    expect_error<InvalidArgument>(
        [&] { into({buf.narrow(0, 0, 8), buf.narrow(0, 4, 8)}, {f8, i8.view_dtype(DType::F32)}); },
        {"output 0 overlaps output 1"});
    expect_error<InvalidArgument>([&] { into({buf.narrow(0, 0, 8)}, {buf.narrow(0, 2, 8)}); },
                                  {"overlaps", "input 0"});
    // Overlapping inputs are only read, an output may be its own input: both are valid.
    Tensor shared = Tensor::full({8}, DType::F32, 1);
    Tensor own = Tensor::full({2}, DType::F32, 3);
    Tensor o1 = Tensor::empty({8}, DType::F32);
    Tensor o2 = Tensor::empty({4}, DType::F32);
    pg.all_reduce_coalesced_into({o1, o2, own}, {shared, shared.narrow(0, 4, 4), own},
                                 ReduceOp::Sum)
        ->wait();
    EXPECT_EQ(o1.to_vector<float>(), std::vector<float>(8, 2.0f));
    EXPECT_EQ(o2.to_vector<float>(), std::vector<float>(4, 2.0f));
    EXPECT_EQ(own.to_vector<float>(), std::vector<float>(2, 6.0f));
    EXPECT_EQ(shared.to_vector<float>(), std::vector<float>(8, 1.0f));
    // An input beside (not under) an output of the same storage is valid too.
    Tensor side = Tensor::full({8}, DType::F32, 5);
    pg.all_reduce_coalesced_into({side.narrow(0, 0, 4)}, {side.narrow(0, 4, 4)}, ReduceOp::Sum)
        ->wait();
    EXPECT_EQ(side.to_vector<float>(), (std::vector<float>{10, 10, 10, 10, 5, 5, 5, 5}));
    // Failed validation takes no sequence number: the next collective still matches.
    Tensor t = Tensor::full({3}, DType::F32, 1);
    pg.all_reduce(t, ReduceOp::Sum)->wait();
    EXPECT_EQ(t.to_vector<float>(), std::vector<float>(3, 2.0f));
  });
}

}  // namespace
}  // namespace funcol
