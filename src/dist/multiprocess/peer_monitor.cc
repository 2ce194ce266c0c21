// PeerMonitor: the TCP mesh that detects dead or departed peers and answers progress queries.
#include "dist/multiprocess/peer_monitor.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "dist/checks.h"
#include "funcol/core/error.h"

namespace funcol::process {
namespace {

// kByeAtExit: a goodbye (the same payload) sent as the process exits without having called
// destroy_process_group.
enum MessageType : uint8_t {
  kHello = 1,
  kBye = 2,
  kQuery = 3,
  kReply = 4,
  kGaveUp = 5,
  kByeAtExit = 6
};
constexpr size_t kFrameHeader = 5;  // u32 payload length, u8 type

std::string errno_text(int err) { return std::strerror(err); }

// The peer connections of every monitor, which a child forked without exec closes at once
// (pthread_atfork): holding them, it kept a rank that died while it ran looking alive to the
// peers (silent at the timeout instead of dead at once). A table of atomics, fd + 1 a slot (0:
// free), as the child's handler may take no lock; a connection beyond its size stays open there.
constexpr size_t kForkCloseSlots = 4096;
std::atomic<int> g_fork_close[kForkCloseSlots];

extern "C" void close_peer_connections_in_child() {
  for (auto& slot : g_fork_close) {
    const int v = slot.load(std::memory_order_relaxed);
    if (v > 0) ::close(v - 1);
  }
}

// `fd` is a peer connection: a forked child closes it.
void track_peer_connection(int fd) {
  static std::once_flag registered;
  std::call_once(registered,
                 [] { pthread_atfork(nullptr, nullptr, close_peer_connections_in_child); });
  for (auto& slot : g_fork_close) {
    int free = 0;
    if (slot.compare_exchange_strong(free, fd + 1)) return;
  }
}

// Closes a peer connection (tracked or not).
void close_peer_connection(int fd) {
  for (auto& slot : g_fork_close) {
    int held = fd + 1;
    if (slot.compare_exchange_strong(held, 0)) break;
  }
  ::close(fd);
}

void append_u32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
void append_i64(std::string& s, int64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }

bool read_u32(const std::string& s, size_t& pos, uint32_t& v) {
  if (pos + 4 > s.size()) return false;
  std::memcpy(&v, s.data() + pos, 4);
  pos += 4;
  return true;
}

bool read_i64(const std::string& s, size_t& pos, int64_t& v) {
  if (pos + 8 > s.size()) return false;
  std::memcpy(&v, s.data() + pos, 8);
  pos += 8;
  return true;
}

// Splits "host:port" or "[v6]:port".
std::pair<std::string, std::string> split_host_port(const std::string& address) {
  auto colon = address.rfind(':');
  if (colon == std::string::npos) {
    throw InvalidArgument(fmt::format("peer address '{}' has no port", address));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return {host, address.substr(colon + 1)};
}

std::string format_address(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    return fmt::format("[{}]:{}", host, ntohs(a->sin6_port));
  }
  const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
  inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
  return fmt::format("{}:{}", host, ntohs(a->sin_port));
}

void set_socket_options(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // A peer whose monitor thread is wedged must not block our writes forever.
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  fcntl(fd, F_SETFD, FD_CLOEXEC);
}

}  // namespace

struct PeerMonitor::Peer {
  int fd = -1;
  int rank = -1;  // -1 until its hello arrives (accepted connections)
  std::string inbox;
  std::mutex write_mu;
  bool closed = false;
};

std::string PeerLoss::describe() const {
  if (clean && !error.empty()) {
    return fmt::format("rank {} departed after an error ({})", rank, error);
  }
  if (clean && at_exit) {
    return fmt::format("rank {} departed (its process exited without destroy_process_group)",
                       rank);
  }
  if (clean) return fmt::format("rank {} departed (destroy_process_group)", rank);
  return fmt::format("rank {} died (its process exited or was killed)", rank);
}

PeerMonitor::PeerMonitor(int rank, int world_size, const std::string& host)
    : rank_(rank), world_size_(world_size) {
  peers_.resize(world_size);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), "0", &hints, &res);
  if (rc != 0) {
    throw CommError(fmt::format("peer monitor: cannot resolve '{}': {}", host, gai_strerror(rc)));
  }
  int last_errno = 0;
  for (addrinfo* ai = res; ai != nullptr && listen_fd_ < 0; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      last_errno = errno;
      close(fd);
      continue;
    }
    listen_fd_ = fd;
  }
  freeaddrinfo(res);
  if (listen_fd_ < 0) {
    throw CommError(
        fmt::format("peer monitor: cannot listen on '{}': {}", host, errno_text(last_errno)));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  address_ = format_address(ss);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  if (pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    close(listen_fd_);
    throw CommError(fmt::format("peer monitor: pipe failed: {}", errno_text(errno)));
  }
  thread_ = std::thread([this] { run(); });
}

PeerMonitor::~PeerMonitor() { shutdown(); }

void PeerMonitor::wake() {
  char c = 1;
  [[maybe_unused]] ssize_t n = write(wake_pipe_[1], &c, 1);
}

void PeerMonitor::connect(const std::vector<std::string>& addresses,
                          std::chrono::milliseconds timeout, const std::function<void()>& poll) {
  FUNCOL_CHECK(static_cast<int>(addresses.size()) == world_size_, "one address per rank");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  constexpr auto kPollEvery = std::chrono::milliseconds(100);
  auto next_poll = std::chrono::steady_clock::now() + kPollEvery;
  auto maybe_poll = [&] {
    if (!poll || std::chrono::steady_clock::now() < next_poll) return;
    next_poll = std::chrono::steady_clock::now() + kPollEvery;
    poll();
  };
  // Dial every lower rank; its listener exists before its address was published.
  for (int r = 0; r < rank_; ++r) {
    auto [host, port] = split_host_port(addresses[r]);
    int fd = -1;
    std::string last_error;
    while (fd < 0) {
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_NUMERICSERV;
      addrinfo* res = nullptr;
      int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
      if (rc != 0) {
        throw CommError(fmt::format("peer monitor: cannot resolve rank {}'s address '{}': {}", r,
                                    addresses[r], gai_strerror(rc)));
      }
      for (addrinfo* ai = res; ai != nullptr && fd < 0; ai = ai->ai_next) {
        int s = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (s < 0) continue;
        if (::connect(s, ai->ai_addr, ai->ai_addrlen) == 0) {
          fd = s;
        } else {
          last_error = errno_text(errno);
          close(s);
        }
      }
      freeaddrinfo(res);
      if (fd < 0) {
        maybe_poll();
        if (std::chrono::steady_clock::now() > deadline) {
          throw CommError(fmt::format("peer monitor: cannot connect to rank {} at {}: {}", r,
                                      addresses[r], last_error));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    set_socket_options(fd);
    track_peer_connection(fd);
    auto peer = std::make_unique<Peer>();
    peer->fd = fd;
    peer->rank = r;
    std::string hello;
    append_u32(hello, static_cast<uint32_t>(rank_));
    {
      std::lock_guard lock(mu_);
      peers_[r] = std::move(peer);
    }
    if (!send_to(r, kHello, hello)) {
      throw CommError(fmt::format("peer monitor: cannot reach rank {} at {}", r, addresses[r]));
    }
  }
  wake();
  std::unique_lock lock(mu_);
  auto all_here = [&] {
    for (int r = rank_ + 1; r < world_size_; ++r) {
      if (!peers_[r]) return false;
    }
    return true;
  };
  while (poll && !all_here() && std::chrono::steady_clock::now() < deadline) {
    cv_.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() + kPollEvery),
                   all_here);
    if (all_here()) break;
    lock.unlock();
    maybe_poll();
    lock.lock();
  }
  if (!cv_.wait_until(lock, deadline, all_here)) {
    std::vector<int> missing;
    for (int r = rank_ + 1; r < world_size_; ++r) {
      if (!peers_[r]) missing.push_back(r);
    }
    throw CommError(fmt::format("peer monitor: ranks {} did not connect within {} ms",
                                dist_detail::format_ranks(missing), timeout.count()));
  }
  connected_ = true;
}

void PeerMonitor::add_group(const std::string& name, std::shared_ptr<std::atomic<int64_t>> issued,
                            Describe describe) {
  std::lock_guard lock(mu_);
  removed_groups_.erase(name);
  groups_[name] = Group{std::move(issued), std::move(describe)};
}

void PeerMonitor::remove_group(const std::string& name) {
  std::lock_guard lock(mu_);
  auto it = groups_.find(name);
  if (it == groups_.end()) return;
  removed_groups_[name] = Removed{it->second.issued->load(), std::move(it->second.describe)};
  groups_.erase(it);
  // A name made again and removed again counts once, at its latest removal.
  std::erase(removed_described_, name);
  removed_described_.push_back(name);
  if (removed_described_.size() > kRemovedDescribed) {
    auto oldest = removed_groups_.find(removed_described_.front());
    if (oldest != removed_groups_.end()) oldest->second.describe = nullptr;
    removed_described_.pop_front();
  }
}

void PeerMonitor::set_on_peer_lost(std::function<void(const PeerLoss&)> callback) {
  std::lock_guard lock(mu_);
  on_peer_lost_ = std::move(callback);
}

void PeerMonitor::set_on_gave_up(GaveUpCallback callback) {
  std::lock_guard lock(mu_);
  on_gave_up_ = std::move(callback);
}

void PeerMonitor::tell_gave_up(const std::vector<int>& ranks, const std::string& name,
                               int64_t seq, const std::string& error) {
  std::string payload;
  append_u32(payload, static_cast<uint32_t>(name.size()));
  payload += name;
  append_i64(payload, seq);
  payload += error;
  for (int r : ranks) {
    if (r != rank_) send_to(r, kGaveUp, payload);  // a lost peer is skipped
  }
}

std::optional<std::pair<int, std::string>> PeerMonitor::rendezvous_given_up(
    const std::string& name) const {
  std::lock_guard lock(mu_);
  auto it = rendezvous_given_up_.find(name);
  if (it == rendezvous_given_up_.end()) return std::nullopt;
  return it->second;
}

std::optional<PeerLoss> PeerMonitor::lost(int rank) const {
  std::lock_guard lock(mu_);
  auto it = lost_.find(rank);
  if (it == lost_.end()) return std::nullopt;
  return it->second;
}

std::vector<PeerLoss> PeerMonitor::wait_for_loss(const std::vector<int>& ranks,
                                                 std::chrono::milliseconds wait) const {
  std::unique_lock lock(mu_);
  auto any_death = [&] {
    for (int r : ranks) {
      auto it = lost_.find(r);
      if (it != lost_.end() && !it->second.clean) return true;
    }
    return false;
  };
  cv_.wait_for(lock, wait, any_death);
  std::vector<PeerLoss> found;
  for (bool clean : {false, true}) {
    for (int r : ranks) {
      auto it = lost_.find(r);
      if (it != lost_.end() && it->second.clean == clean) found.push_back(it->second);
    }
  }
  return found;
}

std::vector<PeerLoss> PeerMonitor::losses(const std::vector<int>& ranks,
                                          std::chrono::milliseconds wait) const {
  std::vector<PeerLoss> found = wait_for_loss(ranks, std::chrono::milliseconds(0));
  if (!found.empty() && found.front().clean) found = wait_for_loss(ranks, wait);
  return found;
}

std::string PeerMonitor::silent_ranks_note(const std::vector<int>& ranks,
                                           std::chrono::milliseconds wait) {
  // Any group name: a rank that answers is not silent, whatever it says.
  const std::vector<int64_t> progress = query_progress("", ranks, wait);
  std::vector<int> silent;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (progress[i] == -1 && !lost(ranks[i])) silent.push_back(ranks[i]);
  }
  if (silent.empty()) return "";
  return "; missing ranks " + dist_detail::format_ranks(silent) + silent_note(silent, wait);
}

std::string silent_note(const std::vector<int>& silent, std::chrono::milliseconds wait) {
  return fmt::format(
      "; ranks {} did not answer a progress query within {} ms (their process is stopped or "
      "busy outside funcol)",
      dist_detail::format_ranks(silent), wait.count());
}

std::vector<int64_t> PeerMonitor::query_progress(const std::string& name,
                                                 const std::vector<int>& ranks,
                                                 std::chrono::milliseconds wait, int64_t seq,
                                                 std::vector<std::string>* at_seq) {
  if (at_seq) at_seq->assign(ranks.size(), std::string());
  uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_query_++;
    answers_[id];
  }
  std::string payload;
  payload.append(reinterpret_cast<const char*>(&id), sizeof id);
  append_i64(payload, seq);
  payload += name;
  size_t expected = 0;
  std::vector<int64_t> result(ranks.size(), -1);
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    if (r == rank_) {
      Answer mine = local_answer(name, seq);
      result[i] = mine.issued;
      if (at_seq) (*at_seq)[i] = std::move(mine.at_seq);
    } else if (r >= 0 && r < world_size_ && send_to(r, kQuery, payload)) {
      ++expected;
    }
  }
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, wait, [&] { return answers_[id].size() >= expected; });
  for (size_t i = 0; i < ranks.size(); ++i) {
    auto it = answers_[id].find(ranks[i]);
    if (it != answers_[id].end()) {
      result[i] = it->second.issued;
      if (at_seq) (*at_seq)[i] = it->second.at_seq;
      continue;
    }
    // A departed rank said in its goodbye what its last collectives were.
    const auto lost = lost_.find(ranks[i]);
    if (at_seq && lost != lost_.end()) {
      const auto group = lost->second.recent.find(name);
      if (group != lost->second.recent.end()) {
        const auto what = group->second.find(seq);
        if (what != group->second.end()) (*at_seq)[i] = what->second;
      }
    }
  }
  answers_.erase(id);
  return result;
}

bool PeerMonitor::send_to(int rank, uint8_t type, const std::string& payload) {
  Peer* peer;
  {
    std::lock_guard lock(mu_);
    peer = peers_[rank].get();
    if (peer == nullptr || lost_.count(rank) != 0) return false;
  }
  std::string frame;
  append_u32(frame, static_cast<uint32_t>(payload.size()));
  frame.push_back(static_cast<char>(type));
  frame += payload;
  std::lock_guard wlock(peer->write_mu);
  if (peer->closed) return false;
  size_t sent = 0;
  while (sent < frame.size()) {
    ssize_t n = ::send(peer->fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

void PeerMonitor::set_departure_error(std::string error) {
  // One line, and short: it is quoted inside the peers' own error messages.
  error = error.substr(0, error.find('\n'));
  constexpr size_t kMaxBytes = 400;
  if (error.size() > kMaxBytes) error = error.substr(0, kMaxBytes - 3) + "...";
  std::lock_guard lock(mu_);
  departure_error_ = std::move(error);
}

bool PeerMonitor::has_departure_error() const {
  std::lock_guard lock(mu_);
  return !departure_error_.empty();
}

void PeerMonitor::shutdown(bool at_exit) {
  {
    std::lock_guard lock(mu_);
    if (stopping_ || !thread_.joinable()) return;
  }
  // Goodbye with the departure error (possibly empty), then this process's progress per group
  // (so peers fail only what this rank never issued) and what its last collectives were (so
  // a peer comparing a mismatched one still gets this rank's side).
  std::string bye;
  std::map<std::string, std::pair<int64_t, Describe>> groups;
  {
    std::lock_guard lock(mu_);
    leaving_ = true;
    append_u32(bye, static_cast<uint32_t>(departure_error_.size()));
    bye += departure_error_;
    for (const auto& [name, removed] : removed_groups_) {
      groups[name] = {removed.count, removed.describe};
    }
    for (const auto& [name, group] : groups_) {
      groups[name] = {group.issued->load(), group.describe};
    }
  }
  for (const auto& [name, group] : groups) {
    const auto& [count, describe] = group;
    append_u32(bye, static_cast<uint32_t>(name.size()));
    bye += name;
    append_i64(bye, count);
    std::vector<std::pair<int64_t, std::string>> recent;
    for (int64_t seq = std::max<int64_t>(0, count - kByeRecent); describe && seq < count; ++seq) {
      std::string what = describe(seq);  // outside mu_: it takes the group's
      if (!what.empty()) recent.emplace_back(seq, std::move(what));
    }
    append_u32(bye, static_cast<uint32_t>(recent.size()));
    for (const auto& [seq, what] : recent) {
      append_i64(bye, seq);
      append_u32(bye, static_cast<uint32_t>(what.size()));
      bye += what;
    }
  }
  for (int r = 0; r < world_size_; ++r) {
    if (r == rank_) continue;
    if (send_to(r, at_exit ? kByeAtExit : kBye, bye)) {
      std::lock_guard lock(mu_);
      ::shutdown(peers_[r]->fd, SHUT_WR);
    }
  }
  stop_thread();
}

void PeerMonitor::close_abruptly() {
  {
    std::lock_guard lock(mu_);
    if (stopping_ || !thread_.joinable()) return;
  }
  stop_thread();
}

void PeerMonitor::stop_thread() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake();
  thread_.join();
  std::lock_guard lock(mu_);
  for (auto& peer : peers_) {
    if (peer) {
      std::lock_guard wlock(peer->write_mu);
      peer->closed = true;
      close_peer_connection(peer->fd);
    }
  }
  close(listen_fd_);
  close(wake_pipe_[0]);
  close(wake_pipe_[1]);
  cv_.notify_all();
}

void PeerMonitor::mark_lost(int rank, bool clean, bool at_exit,
                            std::map<std::string, int64_t> issued, std::string error,
                            std::map<std::string, std::map<int64_t, std::string>> recent) {
  PeerLoss loss;
  std::function<void(const PeerLoss&)> callback;
  {
    std::lock_guard lock(mu_);
    if (lost_.count(rank) != 0 || stopping_ || leaving_) return;
    loss.rank = rank;
    loss.clean = clean;
    loss.at_exit = at_exit;
    loss.issued = std::move(issued);
    loss.error = std::move(error);
    loss.recent = std::move(recent);
    lost_[rank] = loss;
    callback = on_peer_lost_;
  }
  cv_.notify_all();
  if (callback) callback(loss);
}

PeerMonitor::Answer PeerMonitor::local_answer(const std::string& name, int64_t seq) const {
  Answer answer{-2, {}};
  Describe describe;
  {
    std::lock_guard lock(mu_);
    auto it = groups_.find(name);
    if (it == groups_.end()) return answer;
    answer.issued = it->second.issued->load();
    describe = it->second.describe;
  }
  if (describe && seq >= 0) answer.at_seq = describe(seq);  // outside mu_: it takes the group's
  return answer;
}

void PeerMonitor::handle_message(int from, uint8_t type, const std::string& payload) {
  size_t pos = 0;
  switch (type) {
    case kBye:
    case kByeAtExit: {
      std::map<std::string, int64_t> issued;
      std::map<std::string, std::map<int64_t, std::string>> recent;
      std::string error;
      uint32_t len;
      if (read_u32(payload, pos, len) && pos + len <= payload.size()) {
        error = payload.substr(pos, len);
        pos += len;
      }
      // Per group: name, count, then its recent collectives (seq, description).
      while (read_u32(payload, pos, len) && pos + len <= payload.size()) {
        std::string name = payload.substr(pos, len);
        pos += len;
        int64_t v;
        uint32_t n;
        if (!read_i64(payload, pos, v) || !read_u32(payload, pos, n)) break;
        issued[name] = v;
        for (uint32_t i = 0; i < n; ++i) {
          int64_t seq;
          if (!read_i64(payload, pos, seq) || !read_u32(payload, pos, len) ||
              pos + len > payload.size()) {
            break;
          }
          recent[name][seq] = payload.substr(pos, len);
          pos += len;
        }
      }
      mark_lost(from, /*clean=*/true, /*at_exit=*/type == kByeAtExit, std::move(issued),
                std::move(error), std::move(recent));
      break;
    }
    case kQuery: {
      // id, the seq asked about (-1: none), the group's name.
      if (payload.size() < 16) return;
      std::string reply = payload.substr(0, 8);
      pos = 8;
      int64_t seq = -1;
      read_i64(payload, pos, seq);
      const Answer answer = local_answer(payload.substr(pos), seq);
      append_i64(reply, answer.issued);
      reply += answer.at_seq;
      send_to(from, kReply, reply);
      break;
    }
    case kGaveUp: {
      uint32_t len;
      int64_t seq;
      if (!read_u32(payload, pos, len) || pos + len > payload.size()) return;
      const std::string name = payload.substr(pos, len);
      pos += len;
      if (!read_i64(payload, pos, seq)) return;
      GaveUpCallback callback;
      {
        std::lock_guard lock(mu_);
        if (seq == kRendezvous) {
          rendezvous_given_up_.try_emplace(name, from, payload.substr(pos));
          break;
        }
        callback = on_gave_up_;
      }
      if (callback) callback(from, name, seq, payload.substr(pos));
      break;
    }
    case kReply: {
      uint64_t id;
      int64_t value;
      if (payload.size() < 16) return;
      std::memcpy(&id, payload.data(), 8);
      std::memcpy(&value, payload.data() + 8, 8);
      {
        std::lock_guard lock(mu_);
        auto it = answers_.find(id);
        if (it != answers_.end()) it->second[from] = Answer{value, payload.substr(16)};
      }
      cv_.notify_all();
      break;
    }
    default:
      break;
  }
}

void PeerMonitor::run() {
  std::vector<std::unique_ptr<Peer>> unidentified;  // accepted, hello not yet read
  std::vector<char> buf(64 * 1024);
  while (true) {
    std::vector<pollfd> fds;
    std::vector<Peer*> owners;  // parallel to fds from index 2
    {
      std::lock_guard lock(mu_);
      if (stopping_) break;
      fds.push_back({wake_pipe_[0], POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});
      for (auto& peer : peers_) {
        if (peer && !peer->closed && lost_.count(peer->rank) == 0) {
          fds.push_back({peer->fd, POLLIN, 0});
          owners.push_back(peer.get());
        }
      }
    }
    for (auto& peer : unidentified) {
      fds.push_back({peer->fd, POLLIN, 0});
      owners.push_back(peer.get());
    }
    int n = poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[0].revents) {
      char drain[64];
      while (read(wake_pipe_[0], drain, sizeof drain) > 0) {
      }
    }
    if (fds[1].revents & POLLIN) {
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        set_socket_options(fd);
        track_peer_connection(fd);
        auto peer = std::make_unique<Peer>();
        peer->fd = fd;
        unidentified.push_back(std::move(peer));
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Peer* peer = owners[i - 2];
      ssize_t got = recv(peer->fd, buf.data(), buf.size(), MSG_DONTWAIT);
      if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (got <= 0) {
        // EOF or reset: the peer's process is gone (a goodbye, if any, was handled first).
        if (peer->rank >= 0) {
          mark_lost(peer->rank, /*clean=*/false, /*at_exit=*/false, {});
        } else {
          std::erase_if(unidentified, [&](const auto& p) {
            if (p.get() != peer) return false;
            close_peer_connection(p->fd);
            return true;
          });
        }
        continue;
      }
      peer->inbox.append(buf.data(), static_cast<size_t>(got));
      while (peer->inbox.size() >= kFrameHeader) {
        uint32_t len;
        std::memcpy(&len, peer->inbox.data(), 4);
        if (peer->inbox.size() < kFrameHeader + len) break;
        uint8_t type = static_cast<uint8_t>(peer->inbox[4]);
        std::string payload = peer->inbox.substr(kFrameHeader, len);
        peer->inbox.erase(0, kFrameHeader + len);
        if (peer->rank < 0) {
          // The first frame of an accepted connection names its rank.
          uint32_t from;
          size_t pos = 0;
          if (type != kHello || !read_u32(payload, pos, from) || static_cast<int>(from) <= rank_ ||
              static_cast<int>(from) >= world_size_) {
            break;
          }
          peer->rank = static_cast<int>(from);
          std::unique_ptr<Peer> owned;
          for (auto& p : unidentified) {
            if (p.get() == peer) owned = std::move(p);
          }
          std::erase_if(unidentified, [](const auto& p) { return !p; });
          std::string rest = std::move(peer->inbox);
          {
            std::lock_guard lock(mu_);
            peers_[from] = std::move(owned);
          }
          cv_.notify_all();
          peer->inbox = std::move(rest);
          continue;
        }
        handle_message(peer->rank, type, payload);
      }
    }
  }
  for (auto& peer : unidentified) close_peer_connection(peer->fd);
}

std::string route_address(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    throw CommError(fmt::format("cannot resolve '{}': {}", host, gai_strerror(rc)));
  }
  std::string out;
  for (addrinfo* ai = res; ai != nullptr && out.empty(); ai = ai->ai_next) {
    // Connecting a UDP socket sends nothing; it only picks the route and source address.
    int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
        char buf[INET6_ADDRSTRLEN] = {};
        const void* addr =
            ss.ss_family == AF_INET6
                ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr)
                : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&ss)->sin_addr);
        if (inet_ntop(ss.ss_family, addr, buf, sizeof buf) != nullptr) out = buf;
      }
    }
    close(fd);
  }
  freeaddrinfo(res);
  if (out.empty()) throw CommError(fmt::format("no route to '{}'", host));
  return out;
}

std::string default_host_address() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "127.0.0.1";
  std::string out = "127.0.0.1";
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    out = buf;
    break;
  }
  freeifaddrs(list);
  return out;
}

std::string interface_address(const std::string& name) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    throw CommError(fmt::format("cannot list network interfaces: {}", errno_text(errno)));
  }
  std::string out;
  for (ifaddrs* i = list; i != nullptr && out.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET || name != i->ifa_name)
      continue;
    char buf[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    out = buf;
  }
  freeifaddrs(list);
  if (out.empty()) throw CommError(fmt::format("network interface '{}' has no IPv4 address", name));
  return out;
}

bool is_loopback_address(const std::string& ip) { return ip.rfind("127.", 0) == 0 || ip == "::1"; }

}  // namespace funcol::process
