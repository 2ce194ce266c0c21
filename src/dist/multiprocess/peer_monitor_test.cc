// Tests of the peer monitor: a mesh of monitors in one process (one per simulated rank).
#include "dist/multiprocess/peer_monitor.h"

#include <gtest/gtest.h>

#include <future>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "funcol/core/error.h"

namespace funcol::process {
namespace {

using std::chrono::milliseconds;

// n connected monitors on loopback.
std::vector<std::unique_ptr<PeerMonitor>> mesh(int n) {
  std::vector<std::unique_ptr<PeerMonitor>> monitors;
  std::vector<std::string> addresses;
  for (int r = 0; r < n; ++r) {
    monitors.push_back(std::make_unique<PeerMonitor>(r, n, "127.0.0.1"));
    addresses.push_back(monitors.back()->address());
  }
  std::vector<std::future<void>> connecting;
  for (int r = 0; r < n; ++r) {
    connecting.push_back(std::async(
        std::launch::async, [&, r] { monitors[r]->connect(addresses, milliseconds(10000)); }));
  }
  for (auto& f : connecting) f.get();
  return monitors;
}

TEST(PeerMonitor, AnswersProgressQueries) {
  auto m = mesh(3);
  auto issued = std::make_shared<std::atomic<int64_t>>(5);
  m[1]->add_group("world", issued);
  m[2]->add_group("world", std::make_shared<std::atomic<int64_t>>(2));
  auto progress = m[0]->query_progress("world", {1, 2}, milliseconds(5000));
  EXPECT_EQ(progress, (std::vector<int64_t>{5, 2}));
  issued->store(6);
  EXPECT_EQ(m[0]->query_progress("world", {1}, milliseconds(5000)), std::vector<int64_t>{6});
  // A group the peer does not have.
  EXPECT_EQ(m[0]->query_progress("tp", {1}, milliseconds(5000)), std::vector<int64_t>{-2});
}

// A query can also ask what each rank issued as one collective of the group.
TEST(PeerMonitor, AnswersWhatARankIssuedAsASeq) {
  auto m = mesh(3);
  auto describe = [](int64_t seq) {
    return seq == 3 ? std::string("all_reduce(f32[4], op sum)") : std::string();
  };
  m[1]->add_group("world", std::make_shared<std::atomic<int64_t>>(4), describe);
  m[2]->add_group("world", std::make_shared<std::atomic<int64_t>>(4));  // says nothing
  m[0]->add_group("world", std::make_shared<std::atomic<int64_t>>(4), describe);
  std::vector<std::string> at_seq;
  auto progress = m[0]->query_progress("world", {0, 1, 2}, milliseconds(5000), 3, &at_seq);
  EXPECT_EQ(progress, (std::vector<int64_t>{4, 4, 4}));
  EXPECT_EQ(at_seq, (std::vector<std::string>{"all_reduce(f32[4], op sum)",
                                               "all_reduce(f32[4], op sum)", ""}));
  m[0]->query_progress("world", {1}, milliseconds(5000), 2, &at_seq);
  EXPECT_EQ(at_seq, std::vector<std::string>{""});
}

// A timed-out rank tells its peers which collective it gave up on, with its error.
TEST(PeerMonitor, TellsPeersWhatItGaveUpOn) {
  auto m = mesh(3);
  struct GaveUp {
    int from;
    std::string name;
    int64_t seq;
    std::string error;
  };
  std::promise<GaveUp> seen;
  m[2]->set_on_gave_up([&](int from, const std::string& name, int64_t seq,
                           const std::string& error) { seen.set_value({from, name, seq, error}); });
  m[0]->tell_gave_up({0, 2}, "tp.2", 7, "all_reduce on group 'tp.2' (seq 7): timed out");
  auto f = seen.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const GaveUp got = f.get();
  EXPECT_EQ(got.from, 0);
  EXPECT_EQ(got.name, "tp.2");
  EXPECT_EQ(got.seq, 7);
  EXPECT_EQ(got.error, "all_reduce on group 'tp.2' (seq 7): timed out");
}

TEST(PeerMonitor, ReportsADeadPeerAtOnce) {
  auto m = mesh(3);
  std::promise<PeerLoss> seen;
  m[0]->set_on_peer_lost([&](const PeerLoss& loss) { seen.set_value(loss); });
  m[2]->close_abruptly();
  auto f = seen.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  PeerLoss loss = f.get();
  EXPECT_EQ(loss.rank, 2);
  EXPECT_FALSE(loss.clean);
  EXPECT_EQ(loss.describe(), "rank 2 died (its process exited or was killed)");
  EXPECT_TRUE(m[1]->wait_for_loss({2}, milliseconds(10000)).size() == 1);
  EXPECT_FALSE(m[0]->lost(1));
  // A lost peer answers no queries: -1 without waiting for the full period.
  EXPECT_EQ(m[0]->query_progress("world", {2}, milliseconds(100)), std::vector<int64_t>{-1});
}

// A goodbye says how many collectives the rank issued per group and what its last ones were.
TEST(PeerMonitor, AGoodbyeCarriesProgress) {
  auto m = mesh(2);
  std::promise<PeerLoss> seen;
  m[0]->set_on_peer_lost([&](const PeerLoss& loss) { seen.set_value(loss); });
  auto describe = [](int64_t seq) { return "op " + std::to_string(seq); };
  m[1]->add_group("world", std::make_shared<std::atomic<int64_t>>(12), describe);
  m[1]->add_group("tp", std::make_shared<std::atomic<int64_t>>(3), describe);
  m[1]->add_group("dp", std::make_shared<std::atomic<int64_t>>(2));  // says nothing
  // A group already gone still reports its final count and its last collectives.
  m[1]->remove_group("tp");
  m[1]->shutdown();
  auto f = seen.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  PeerLoss loss = f.get();
  EXPECT_TRUE(loss.clean);
  EXPECT_EQ(loss.issued.at("world"), 12);
  EXPECT_EQ(loss.issued.at("tp"), 3);
  EXPECT_EQ(loss.issued.at("dp"), 2);
  // The last kByeRecent of each group that describes its collectives.
  std::map<int64_t, std::string> world_recent;
  for (int64_t seq = 12 - kByeRecent; seq < 12; ++seq) world_recent[seq] = describe(seq);
  EXPECT_EQ(loss.recent.at("world"), world_recent);
  EXPECT_EQ(loss.recent.at("tp"),
            (std::map<int64_t, std::string>{{0, "op 0"}, {1, "op 1"}, {2, "op 2"}}));
  EXPECT_EQ(loss.recent.count("dp"), 0u);
  // A query about one of them gets the departed rank's answer from its goodbye.
  std::vector<std::string> at_seq;
  EXPECT_EQ(m[0]->query_progress("world", {1}, milliseconds(100), 11, &at_seq),
            std::vector<int64_t>{-1});
  EXPECT_EQ(at_seq, std::vector<std::string>{"op 11"});
  m[0]->query_progress("world", {1}, milliseconds(100), 3, &at_seq);  // forgotten
  EXPECT_EQ(at_seq, std::vector<std::string>{""});
  EXPECT_EQ(loss.describe(), "rank 1 departed (destroy_process_group)");
  // A departure alone does not end a wait for a death; the losses are still returned.
  auto losses = m[0]->wait_for_loss({1}, milliseconds(50));
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_TRUE(losses[0].clean);
}

// A goodbye sent from the process's exit (no destroy_process_group of its own) says so.
TEST(PeerMonitor, AGoodbyeAtExitSaysSo) {
  auto m = mesh(2);
  m[1]->shutdown(/*at_exit=*/true);
  while (!m[0]->lost(1)) std::this_thread::sleep_for(milliseconds(1));
  const PeerLoss loss = *m[0]->lost(1);
  EXPECT_TRUE(loss.clean);
  EXPECT_TRUE(loss.at_exit);
  EXPECT_EQ(loss.describe(), "rank 1 departed (its process exited without destroy_process_group)");
}

TEST(PeerMonitor, AGoodbyeCarriesTheDepartureError) {
  auto m = mesh(3);
  m[1]->set_departure_error("ShapeError: first line\nsecond line");
  m[1]->shutdown();
  m[2]->set_departure_error(std::string(1000, 'x'));
  m[2]->shutdown();
  for (int r : {1, 2}) {
    while (!m[0]->lost(r)) std::this_thread::sleep_for(milliseconds(1));
  }
  const PeerLoss one = *m[0]->lost(1);
  EXPECT_TRUE(one.clean);
  EXPECT_EQ(one.error, "ShapeError: first line");
  EXPECT_EQ(one.describe(), "rank 1 departed after an error (ShapeError: first line)");
  // Quoted inside other errors: at most 400 bytes.
  const PeerLoss two = *m[0]->lost(2);
  EXPECT_EQ(two.error, std::string(397, 'x') + "...");
}

// A rank that leaves after seeing another die: the death is the cause to name, even when the
// goodbye arrives first.
TEST(PeerMonitor, LossesNameADeathSeenAfterADeparture) {
  auto m = mesh(3);
  EXPECT_TRUE(m[0]->losses({1, 2}, milliseconds(0)).empty());
  m[1]->shutdown();
  while (!m[0]->lost(1)) std::this_thread::sleep_for(milliseconds(1));
  auto later = std::async(std::launch::async, [&] {
    std::this_thread::sleep_for(milliseconds(50));
    m[2]->close_abruptly();
  });
  auto losses = m[0]->losses({1, 2}, milliseconds(10000));
  later.get();
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_EQ(losses[0].describe(), "rank 2 died (its process exited or was killed)");
  EXPECT_EQ(losses[1].describe(), "rank 1 departed (destroy_process_group)");
  // Only departures and nothing more to come: they are returned after the wait.
  auto m2 = mesh(2);
  m2[1]->shutdown();
  while (!m2[0]->lost(1)) std::this_thread::sleep_for(milliseconds(1));
  auto departed = m2[0]->losses({1}, milliseconds(20));
  ASSERT_EQ(departed.size(), 1u);
  EXPECT_TRUE(departed[0].clean);
}

TEST(PeerMonitor, ConnectTimesOutNamingMissingRanks) {
  PeerMonitor lonely(0, 2, "127.0.0.1");
  try {
    lonely.connect({lonely.address(), "127.0.0.1:1"}, milliseconds(200));
    FAIL() << "connect returned";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("ranks [1] did not connect"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace funcol::process
