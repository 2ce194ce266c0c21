// PeerMonitor: a TCP connection to every peer process that reports deaths and departures and
// answers "how far did you get on group G" queries, for the process backends' error messages.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace funcol::process {

// The collectives per group whose descriptions a goodbye carries (PeerLoss::recent).
inline constexpr int64_t kByeRecent = 8;

// How long a timeout's error waits for the peers' answers to a progress query.
inline constexpr std::chrono::milliseconds kProgressQueryWait{1000};

// How a peer went away.
struct PeerLoss {
  int rank = -1;
  bool clean = false;  // true: destroy_process_group (a goodbye); false: its process vanished
  // Clean leaves only: the goodbye came from the process's exit, not a destroy_process_group
  // call of its own (a main that returned, or exit(), with the world still up).
  bool at_exit = false;
  // Clean leaves only: collectives the peer had issued per group name when it left.
  std::map<std::string, int64_t> issued;
  // Clean leaves only: what the peer issued as its last collectives (kByeRecent at most) per
  // group name, seq -> its Describe bytes, so that a query about one still gets its answer
  // (query_progress): a peer that did its part of a mismatched collective and left is still
  // compared.
  std::map<std::string, std::map<int64_t, std::string>> recent;
  // Clean leaves only: the error the peer left because of (set_departure_error), or empty.
  std::string error;
  // "rank 2 died (its process exited or was killed)" / "rank 2 departed (destroy_process_group)"
  // / "rank 2 departed after an error (ShapeError: ...)".
  std::string describe() const;
};

// One process's side of a full mesh of small TCP connections between all ranks of a job,
// separate from the data path (MPI or Gloo) so it keeps working while a collective blocks.
// It notices a peer whose process dies (the kernel closes its sockets: EOF or reset within
// milliseconds) or leaves, and it answers progress queries so that a timed-out collective can
// name the ranks that did not arrive. A monitor thread owns every read; writes take a lock.
class PeerMonitor {
 public:
  // Listens on `host` (an IP address) at an ephemeral port.
  PeerMonitor(int rank, int world_size, const std::string& host);
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  // "ip:port" for the other ranks to connect to.
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Connects the mesh given every rank's address (index = rank): dials lower ranks, accepts
  // higher ones. Throws CommError naming the missing ranks when not done within `timeout`.
  // `poll`, when given, is called about every 100 ms while it waits; it throws to end the wait
  // (a rank known to have died).
  void connect(const std::vector<std::string>& addresses, std::chrono::milliseconds timeout,
               const std::function<void()>& poll = {});

  // What this process issued as collective `seq` of a group, as bytes the monitor carries
  // without reading them (the process backends send an encoded OpSignature), or "" when it no
  // longer knows.
  using Describe = std::function<std::string(int64_t seq)>;
  // Progress counters the monitor reports to peers: the number of collectives this process
  // issued on the group `name`, and what a given one was. Names are unique per process (the
  // group registry's names).
  void add_group(const std::string& name, std::shared_ptr<std::atomic<int64_t>> issued,
                 Describe describe = nullptr);
  // The group's final count is kept for the goodbye: its last collectives may still be
  // completing on the peers.
  void remove_group(const std::string& name);

  // Called on the monitor thread once per lost peer. Set before connect().
  void set_on_peer_lost(std::function<void(const PeerLoss&)> callback);
  // Called on the monitor thread when a peer gave up on collective `seq` of group `name` (it
  // timed out), with the peer's rank and its error. Set before connect().
  using GaveUpCallback =
      std::function<void(int from, const std::string& name, int64_t seq, const std::string& error)>;
  void set_on_gave_up(GaveUpCallback callback);
  // Tells `ranks` that this process gave up on collective `seq` of group `name`, with its
  // error: a rank that issues it later then fails at once, saying it came too late, instead of
  // running a collective nobody else will.
  void tell_gave_up(const std::vector<int>& ranks, const std::string& name, int64_t seq,
                    const std::string& error);
  // The seq that tells `ranks` this process gave up on making a group (tell_gave_up's `name`
  // then names that group's rendezvous, the same on every member) rather than on a collective:
  // the peers keep the first such news per name for rendezvous_given_up, and pass it to no
  // callback.
  static constexpr int64_t kRendezvous = -1;
  // The rank and error of the first member that gave up on rendezvous `name` (tell_gave_up with
  // kRendezvous), or nullopt.
  std::optional<std::pair<int, std::string>> rendezvous_given_up(const std::string& name) const;
  // The loss of `rank`, or nullopt while it is connected.
  std::optional<PeerLoss> lost(int rank) const;
  // Waits up to `wait` until one of `ranks` is reported dead (a departure alone does not end
  // the wait: a peer often leaves because of another's death, and the death is the cause to
  // report); returns every loss among `ranks`, deaths first.
  std::vector<PeerLoss> wait_for_loss(const std::vector<int>& ranks,
                                      std::chrono::milliseconds wait) const;
  // The losses among `ranks` known now, deaths first (empty: none). When only departures are
  // known, waits up to `wait` for a death among them, so that the cause can be named.
  std::vector<PeerLoss> losses(const std::vector<int>& ranks,
                               std::chrono::milliseconds wait) const;

  // Asks each of `ranks` how many collectives it issued on group `name`; -1 for a rank that
  // did not answer within `wait` (lost, or its process is stuck outside funcol), -2 for one
  // that has no such group.
  // With `at_seq`, also what each rank issued as collective `seq` (parallel to `ranks`; "" where
  // it did not say: not issued, forgotten, or no answer), a departed rank's from its goodbye.
  std::vector<int64_t> query_progress(const std::string& name, const std::vector<int>& ranks,
                                      std::chrono::milliseconds wait, int64_t seq = -1,
                                      std::vector<std::string>* at_seq = nullptr);

  // What a timeout's error adds about the ranks of `ranks` that are connected but do not answer
  // a progress query within `wait` (their process is stopped, or busy outside funcol):
  // "; missing ranks [2]" and silent_note's, or "" when every one answers or is lost (a loss
  // is named by its own message).
  std::string silent_ranks_note(const std::vector<int>& ranks, std::chrono::milliseconds wait);

  // What this process is leaving because of, for the goodbye (peers name it); empty: none.
  void set_departure_error(std::string error);
  bool has_departure_error() const;
  // Says goodbye to every peer (with this process's progress and its departure error, if any)
  // and stops the monitor thread. Idempotent; the destructor calls it.
  // `at_exit`: the process is exiting without having called destroy_process_group.
  void shutdown(bool at_exit = false);
  // Stops and closes every connection without a goodbye, as if this process died (tests).
  void close_abruptly();

 private:
  struct Peer;
  void stop_thread();
  void run();
  void handle_message(int from, uint8_t type, const std::string& payload);
  // A progress answer: collectives issued on a group (-2: no such group), and what collective
  // `seq` was (query_progress).
  struct Answer {
    int64_t issued = -1;
    std::string at_seq;
  };
  // This process's answer about group `name`.
  Answer local_answer(const std::string& name, int64_t seq) const;
  void mark_lost(int rank, bool clean, bool at_exit, std::map<std::string, int64_t> issued,
                 std::string error = {},
                 std::map<std::string, std::map<int64_t, std::string>> recent = {});
  bool send_to(int rank, uint8_t type, const std::string& payload);
  void wake();

  const int rank_;
  const int world_size_;
  std::string address_;
  int port_ = 0;
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<std::unique_ptr<Peer>> peers_;  // index = rank; null for this rank
  struct Group {
    std::shared_ptr<std::atomic<int64_t>> issued;
    Describe describe;
  };
  std::map<std::string, Group> groups_;
  // Groups removed, still reported in the goodbye: final counts, and what their last
  // collectives were for the kRemovedDescribed removed last (the world's, usually: its group is
  // dropped before the goodbye), in removal order.
  struct Removed {
    int64_t count = 0;
    Describe describe;
  };
  static constexpr size_t kRemovedDescribed = 64;
  std::map<std::string, Removed> removed_groups_;
  std::deque<std::string> removed_described_;
  std::string departure_error_;
  std::map<int, PeerLoss> lost_;
  // Per rendezvous name, the first member that gave up on it and its error.
  std::map<std::string, std::pair<int, std::string>> rendezvous_given_up_;
  std::function<void(const PeerLoss&)> on_peer_lost_;
  GaveUpCallback on_gave_up_;
  uint64_t next_query_ = 1;
  std::map<uint64_t, std::map<int, Answer>> answers_;  // query id -> rank -> answer
  bool stopping_ = false;
  // Set by shutdown() before the goodbyes go out: from then on no loss is reported. A peer
  // that already closed its end answers our goodbye with a reset, and the reset can discard
  // its own goodbye before we read it; that peer left cleanly, and we are leaving anyway.
  bool leaving_ = false;
  bool connected_ = false;
  std::thread thread_;
};

// The local IP address this host uses to reach host:port (the interface its route goes out
// of), e.g. for advertising an address peers on other hosts can reach. Throws CommError.
std::string route_address(const std::string& host, int port);
// The first non-loopback IPv4 address of an interface that is up, or "127.0.0.1" when none.
std::string default_host_address();
// The IPv4 address of the named interface; throws CommError when it has none.
std::string interface_address(const std::string& name);
// True for 127.0.0.0/8 and ::1.
bool is_loopback_address(const std::string& ip);

// "; ranks [2] did not answer a progress query within 1000 ms (their process is stopped or
// busy outside funcol)", for ranks that did not answer after `wait`.
std::string silent_note(const std::vector<int>& silent, std::chrono::milliseconds wait);

}  // namespace funcol::process
