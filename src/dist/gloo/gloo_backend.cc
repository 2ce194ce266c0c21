// The gloo backend: one Gloo context per group over the TCP transport, run by one worker thread
// per group in issue order; rendezvous through Gloo's FileStore or RedisStore.
#include "dist/gloo/gloo_backend.h"

#include <fcntl.h>
#include <netdb.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#define HIREDIS_NESTED_INCLUDE 1
#include <gloo/barrier.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "dist/checks.h"
#include "dist/multiprocess/process_env.h"
#include "dist/multiprocess/wide_reduce.h"
#include "funcol/core/error.h"

namespace funcol::gloo_backend {
namespace {

using process::CollectiveOp;
using process::OpKind;
using Clock = std::chrono::steady_clock;

// Each Gloo call of a collective times out this much past the collective's deadline. The
// job's watchdog reports the timeout (naming the ranks that did not arrive, after asking them,
// which takes up to a second a group); a worker whose Gloo call ended near the deadline waits
// up to kWatchdogWait past it for that report before giving Gloo's bare "Timed out" (which
// wins only when the watchdog is later still: several groups timing out together with a
// stopped peer). The worker is joined when its group is destroyed, so a long Gloo timeout
// delayed a failed rank's exit (it was 2 s: a rank exited 2 s after its timeout error).
constexpr std::chrono::milliseconds kGlooGrace{50};
constexpr std::chrono::milliseconds kWatchdogWait{2000};
// How long a rendezvous that saw only departures waits to see the death that probably caused
// them, so that the error names it.
constexpr std::chrono::milliseconds kLossWait{500};

// Gloo's messages start with "[/path/to/file.cc:123] "; users need only the rest.
std::string gloo_message(const std::exception& e) {
  std::string msg = e.what();
  // Some carry two ("[gloo/.../file_store.cc:157] [./gloo/rendezvous/file_store.cc:147] ...").
  while (!msg.empty() && msg[0] == '[') {
    auto end = msg.find("] ");
    if (end == std::string::npos) break;
    msg = msg.substr(end + 2);
  }
  return msg;
}

// A rendezvous store that can delete the keys this process wrote once every peer has read
// them, so a store directory or Redis server can serve the next job.
class KeyStore {
 public:
  virtual ~KeyStore() = default;
  virtual gloo::rendezvous::Store& store() = 0;
  // True when every key exists (no waiting).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // The key's value, or nullopt when it does not exist (no waiting).
  virtual std::optional<std::vector<char>> try_get(const std::string& key) = 0;
  virtual void erase_own_keys() noexcept = 0;
  // Deletes a key a previous job left where this process must write (Gloo's stores refuse to
  // overwrite one).
  virtual void erase_stale(const std::string& key) noexcept = 0;
  // Deletes `key` only while it holds `value`, atomically: a value another process wrote there
  // since (a rank restarted at once, a duplicate that replaced the same stale record first)
  // stays. True when this call deleted it.
  virtual bool erase_if_holds(const std::string& key, const std::string& value) noexcept = 0;
  // Called every poll of a wait for keys; it throws to end the wait (a member died).
  virtual void set_poll(std::function<void()> poll) = 0;
  // What broke the store's connection, once something did (a Redis server that stopped
  // answering); nullopt while it works.
  virtual std::optional<std::string> failure() const { return std::nullopt; }
  // After a failure(): connects again, its replies waited for briefly, so that the keys this
  // rank wrote can still go (a connection in error sends nothing).
  virtual void reconnect_for_cleanup() noexcept {}
};

// A Gloo store whose waits (Gloo's connectFullMesh waits for its peers' addresses) last the
// job's timeout, not the 30 s Gloo passes, and call `poll` every 10 ms while the keys are
// missing.
template <typename GlooStore>
struct TimedWaits : GlooStore {
  using GlooStore::GlooStore;
  void wait(const std::vector<std::string>& keys) override { wait_polling(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    wait_polling(keys);
  }
  void wait_polling(const std::vector<std::string>& keys) {
    const auto deadline = Clock::now() + timeout;
    while (!GlooStore::check(keys)) {
      if (poll) poll();
      if (Clock::now() >= deadline) {
        // Gloo's own wait says which keys are missing, as before.
        GlooStore::wait(keys, std::chrono::milliseconds(1));
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  std::chrono::milliseconds timeout = gloo::rendezvous::Store::kDefaultTimeout;
  std::function<void()> poll;
};

class FileKeyStore final : public KeyStore {
 public:
  FileKeyStore(const std::string& path, std::chrono::milliseconds timeout) : store_(path) {
    store_.timeout = timeout;
  }
  gloo::rendezvous::Store& store() override { return store_; }
  bool check(const std::vector<std::string>& keys) override { return store_.check(keys); }
  std::optional<std::vector<char>> try_get(const std::string& key) override {
    // Gloo writes a key's file whole under another name and renames it into place.
    const std::string path = store_.objectPath(key);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT) return std::nullopt;
    std::vector<char> value;
    bool ok = fd >= 0;
    char buf[4096];
    for (ssize_t got; ok && (got = ::read(fd, buf, sizeof buf)) != 0;) {
      if (got < 0 && errno == EINTR) continue;
      ok = got > 0;
      if (ok) value.insert(value.end(), buf, buf + got);
    }
    const int error = errno;
    if (fd >= 0) ::close(fd);
    if (!ok) {
      throw CommError(fmt::format("gloo: cannot read the store's key file {}: {}", path,
                                  std::strerror(error)));
    }
    return value;
  }
  void erase_own_keys() noexcept override {
    for (const auto& path : store_.written) ::unlink(path.c_str());
    store_.written.clear();
  }
  void erase_stale(const std::string& key) noexcept override {
    try {
      ::unlink(store_.objectPath(key).c_str());
    } catch (...) {  // a path Gloo cannot resolve: nothing to delete
    }
  }
  // The key's file is renamed to a name of this process's own (one process gets it), then
  // read: another value goes back (link: unless a third process set the key meanwhile, which
  // then holds it). Readers that look in between find no key and look again.
  bool erase_if_holds(const std::string& key, const std::string& value) noexcept override {
    try {
      const std::string path = store_.objectPath(key);
      const std::string taken =
          fmt::format("{}.erase.{}.{}", path, ::getpid(), store_.next_tmp++);
      if (::rename(path.c_str(), taken.c_str()) != 0) return false;  // gone already
      std::ifstream in(taken, std::ios::binary);
      const std::string held((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      in.close();
      const bool stale = held == value;
      if (!stale && ::link(taken.c_str(), path.c_str()) != 0) {
        // EEXIST: a third process set the key meanwhile, and holds it now.
      }
      ::unlink(taken.c_str());
      return stale;
    } catch (...) {  // a path Gloo cannot resolve, a failed read: left as it is
      return false;
    }
  }
  void set_poll(std::function<void()> poll) override { store_.poll = std::move(poll); }

 private:
  // Exposes FileStore's protected existence check and key paths, and creates keys atomically.
  struct Store : TimedWaits<gloo::rendezvous::FileStore> {
    using TimedWaits::TimedWaits;
    using FileStore::check;
    using FileStore::objectPath;
    // Gloo's FileStore writes a key through a temporary file named after the key, so two
    // processes setting one key (the same --rank given twice) share that file: one of them
    // lost its rename, or both succeeded, each over the other. Here each writes a file of its
    // own and links it to the key's name, which exactly one can do.
    void set(const std::string& key, const std::vector<char>& data) override {
      const std::string path = objectPath(key);
      const size_t slash = path.rfind('/');
      const std::string tmp = write_temporary(
          fmt::format("{}.{}.{}.{}", path.substr(0, slash + 1), path.substr(slash + 1),
                      ::getpid(), next_tmp++),
          data);
      int linked = ::link(tmp.c_str(), path.c_str());
      int error = errno;
      if (linked != 0 && (error == EPERM || error == ENOTSUP || error == EOPNOTSUPP ||
                          error == ENOSYS || error == EMLINK)) {
        // A file system without hard links (vfat, some FUSE ones): Gloo's own way, a look and
        // a rename, which two processes setting one key at once can both pass.
        if (::access(path.c_str(), F_OK) == 0) {
          linked = -1;
          error = EEXIST;
        } else {
          linked = ::rename(tmp.c_str(), path.c_str());
          error = errno;
        }
      }
      ::unlink(tmp.c_str());  // after a rename: gone already
      if (linked != 0) {
        // "already": the rendezvous reads it as a key taken (a previous job's, or a duplicate).
        if (error == EEXIST) throw std::runtime_error("Key '" + key + "' already set");
        errno = error;
        throw_errno("cannot create", path);
      }
      written.push_back(path);
    }
    // Writes `data` to a new file at `tmp` (one a killed process left there is replaced) and
    // returns its path; throws CommError naming the OS error.
    static std::string write_temporary(const std::string& tmp, const std::vector<char>& data) {
      int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd < 0 && errno == EEXIST) {  // its pid reused: that process is gone
        ::unlink(tmp.c_str());
        fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      }
      if (fd < 0) throw_errno("cannot create", tmp);
      size_t done = 0;
      bool ok = true;
      while (ok && done < data.size()) {
        const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
        if (n < 0 && errno == EINTR) continue;
        ok = n > 0;
        if (ok) done += static_cast<size_t>(n);
      }
      int error = errno;
      // A network file system may report a full disk or quota only here.
      if (::close(fd) != 0 && ok) {
        ok = false;
        error = errno;
      }
      if (!ok) {
        ::unlink(tmp.c_str());
        errno = error;
        throw_errno("cannot write", tmp);
      }
      return tmp;
    }
    [[noreturn]] static void throw_errno(const char* what, const std::string& path) {
      throw CommError(
          fmt::format("gloo: {} the store's key file {}: {}", what, path, std::strerror(errno)));
    }
    std::vector<std::string> written;  // the keys' paths, to delete
    uint64_t next_tmp = 0;
  };
  Store store_;
};

class RedisKeyStore final : public KeyStore {
 public:
  RedisKeyStore(const std::string& host, int port, std::chrono::milliseconds timeout)
      : store_(host, port) {
    store_.timeout = timeout;
    store_.where = fmt::format("{}:{}", host, port);
    // Every command waits at most the job's timeout for its reply: a server that accepts
    // connections but stops answering (stopped, overloaded, a proxy in front of a dead one)
    // fails the rendezvous instead of blocking it in read() for ever. (Gloo connects with a
    // timeout of its own.)
    if (!store_.set_reply_timeout(timeout)) {
      throw CommError(fmt::format("gloo: cannot set a reply timeout on the Redis connection to "
                                  "{}: {}",
                                  store_.where, store_.context()->errstr));
    }
  }
  gloo::rendezvous::Store& store() override { return store_; }
  bool check(const std::vector<std::string>& keys) override { return store_.check(keys); }
  std::optional<std::vector<char>> try_get(const std::string& key) override {
    return store_.try_get(key);
  }
  void erase_own_keys() noexcept override {
    // A connection in error sends nothing: a server still silent after reconnect_for_cleanup
    // (live_holder's look timed out) gets the deletions on a new one, which it runs when it
    // wakes even though nobody waits for the replies any more.
    if (store_.failure()) reconnect(std::chrono::milliseconds(100));
    store_.erase_written();
  }
  void erase_stale(const std::string& key) noexcept override { store_.erase(key); }
  bool erase_if_holds(const std::string& key, const std::string& value) noexcept override {
    return store_.erase_if_holds(key, value);
  }
  void set_poll(std::function<void()> poll) override { store_.poll = std::move(poll); }
  std::optional<std::string> failure() const override { return store_.failure(); }
  void reconnect_for_cleanup() noexcept override {
    // A server still silent costs at most this once more: the first unanswered command puts
    // the connection in error again, and the rest fail at once.
    reconnect(std::chrono::milliseconds(2000));
  }

 private:
  // A new connection whose replies are waited for `reply_timeout` at most.
  void reconnect(std::chrono::milliseconds reply_timeout) noexcept {
    if (redisReconnect(store_.context()) == REDIS_OK) {
      store_.set_reply_timeout(std::min(store_.timeout, reply_timeout));
    }
  }

  // Records the keys it sets so they can be deleted (RedisStore writes with SETNX, so a key
  // left behind would make the next job's rendezvous fail).
  struct Store : TimedWaits<gloo::rendezvous::RedisStore> {
    using TimedWaits::TimedWaits;
    void set(const std::string& key, const std::vector<char>& data) override {
      RedisStore::set(key, data);
      written.push_back(key);
    }
    void erase(const std::string& key) noexcept {
      void* reply = redisCommand(redis_, "DEL %b", key.data(), key.size());
      if (reply != nullptr) freeReplyObject(reply);
    }
    // One script, which Redis runs atomically.
    bool erase_if_holds(const std::string& key, const std::string& value) noexcept {
      static constexpr const char* kScript =
          "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
          "else return 0 end";
      auto* reply = static_cast<redisReply*>(redisCommand(
          redis_, "EVAL %s 1 %b %b", kScript, key.data(), key.size(), value.data(), value.size()));
      if (reply == nullptr) return false;
      const bool deleted = reply->type == REDIS_REPLY_INTEGER && reply->integer == 1;
      freeReplyObject(reply);
      return deleted;
    }
    redisContext* context() const { return redis_; }
    bool set_reply_timeout(std::chrono::milliseconds t) {
      timeval tv{};
      tv.tv_sec = static_cast<time_t>(t.count() / 1000);
      tv.tv_usec = static_cast<suseconds_t>(t.count() % 1000 * 1000);
      return redisSetTimeout(redis_, tv) == REDIS_OK;
    }
    std::optional<std::string> failure() const {
      if (redis_ == nullptr || redis_->err == 0) return std::nullopt;
      // hiredis reports a reply timeout as an I/O error "Resource temporarily unavailable".
      if (redis_->err == REDIS_ERR_IO && std::strcmp(redis_->errstr, std::strerror(EAGAIN)) == 0) {
        return fmt::format("the Redis server at {} did not answer within {} ms (FUNCOL_TIMEOUT)",
                           where, timeout.count());
      }
      return fmt::format("the connection to the Redis server at {} failed: {}", where,
                         redis_->errstr);
    }
    std::optional<std::vector<char>> try_get(const std::string& key) {
      auto* reply =
          static_cast<redisReply*>(redisCommand(redis_, "GET %b", key.data(), key.size()));
      if (reply == nullptr) {
        throw CommError("gloo: " + failure().value_or("the Redis store failed"));
      }
      std::optional<std::vector<char>> value;
      std::string error;
      if (reply->type == REDIS_REPLY_STRING) {
        value.emplace(reply->str, reply->str + reply->len);
      } else if (reply->type == REDIS_REPLY_ERROR) {
        error.assign(reply->str, reply->len);
      }
      freeReplyObject(reply);
      if (!error.empty()) throw CommError("gloo: the Redis store failed: " + error);
      return value;
    }
    // Sends every deletion before it reads any reply: a server that stopped answering still
    // has them all in its connection's buffer when it wakes (sent one by one, a deletion
    // waiting for its reply left the rest unsent).
    void erase_written() noexcept {
      if (written.empty() || redis_ == nullptr || redis_->err != 0) return;
      for (const auto& key : written) redisAppendCommand(redis_, "DEL %b", key.data(), key.size());
      int sent = 0;
      while (sent == 0 && redisBufferWrite(redis_, &sent) == REDIS_OK) {
      }
      for (size_t i = 0; i < written.size(); ++i) {
        void* reply = nullptr;
        if (redisGetReply(redis_, &reply) != REDIS_OK) break;  // no answer within the timeout
        freeReplyObject(reply);
      }
      written.clear();
    }
    std::vector<std::string> written;
    std::string where;  // "host:port"
  };
  Store store_;
};

// State every group of the process shares.
struct GlooShared {
  process::StoreUrl url;
  std::shared_ptr<gloo::transport::Device> device;
  std::chrono::milliseconds timeout{0};
  bool detail = false;  // FUNCOL_DEBUG=DETAIL: every rank must agree (rendezvous checks)

  // A fresh connection per rendezvous: concurrent splits in different threads never share one.
  std::unique_ptr<KeyStore> open_store() const {
    if (url.kind == process::StoreUrl::Kind::File) {
      // Like PyTorch's FileStore, create the directory on first use.
      std::error_code ec;
      std::filesystem::create_directories(url.path, ec);
      if (ec) {
        throw CommError(fmt::format("gloo: cannot create the store directory '{}': {}", url.path,
                                    ec.message()));
      }
    }
    try {
      if (url.kind == process::StoreUrl::Kind::File) {
        return std::make_unique<FileKeyStore>(url.path, timeout);
      }
      return std::make_unique<RedisKeyStore>(url.host, url.port, timeout);
    } catch (const std::exception& e) {
      // The Redis server's address as tried: a URL without a port means Redis's default.
      const std::string where =
          url.kind == process::StoreUrl::Kind::Redis
              ? fmt::format(" (Redis at {}, port {})", url.host, url.port)
              : std::string();
      throw CommError(fmt::format("gloo: cannot open store '{}'{}: {}", url.text, where,
                                  gloo_message(e)));
    }
  }
};

// The error of a rendezvous that lost a member after it arrived (its process died or left).
CommError lost_during_rendezvous(const std::string& what, const std::string& url,
                                 const process::PeerLoss& loss) {
  return CommError(
      fmt::format("gloo: rendezvous of {} at '{}' failed: {} during the rendezvous; missing "
                  "ranks [{}]",
                  what, url, loss.describe(), loss.rank));
}

// Throws when `host` (a name or an address for Gloo's TCP device) does not resolve, as Gloo's
// device looks it up (any family, stream sockets).
void check_resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    throw std::runtime_error(fmt::format(
        "the name does not resolve ({}); set FUNCOL_GLOO_HOSTNAME to an address or a name of "
        "this host, or FUNCOL_GLOO_IFNAME to an interface",
        gai_strerror(rc)));
  }
  freeaddrinfo(res);
}

// The world's rendezvous keys (a subgroup's: see split_group).
constexpr std::string_view kWorldPrefix = "funcol/world";

// Where the member at `index` of a rendezvous under `prefix` writes its arrival record.
std::string arrival_key(const std::string& prefix, int index) {
  return fmt::format("{}/arrive/{}", prefix, index);
}

// The process_identity in an arrival record "<size> <mode> <monitor> <identity>"; empty in a
// record of three fields (none).
std::string record_identity(const std::string& record) {
  if (std::count(record.begin(), record.end(), ' ') != 3) return "";
  return record.substr(record.rfind(' ') + 1);
}

// Whether the arrival record `record` was written by a process of this machine that has ended:
// a stale record (a killed rank's, or one stopped by a signal), which nobody will answer for.
bool written_by_ended_process(const std::string& record) {
  return process::process_running(record_identity(record)) == false;
}

// The arrival record at `key` when it is written_by_ended_process; nullopt otherwise.
std::optional<std::string> stale_record(KeyStore& store, const std::string& key) {
  const auto record = store.try_get(key);
  if (!record) return std::nullopt;
  std::string text(record->begin(), record->end());
  if (!written_by_ended_process(text)) return std::nullopt;
  return text;
}

// The pid of the process that wrote the arrival record at `key`, when that is another process
// and it runs (on this machine: elsewhere it cannot be known); nullopt otherwise.
std::optional<std::string> live_holder(KeyStore& store, const std::string& key) noexcept {
  try {
    const auto record = store.try_get(key);
    if (!record) return std::nullopt;
    const std::string identity = record_identity(std::string(record->begin(), record->end()));
    if (identity.empty() || identity == process::process_identity() ||
        process::process_running(identity) != true) {
      return std::nullopt;
    }
    const std::string pid = process::identity_pid(identity);
    return pid.empty() ? std::nullopt : std::optional<std::string>(pid);
  } catch (...) {  // a store that fails now: nothing known
    return std::nullopt;
  }
}

// Waits until every member (index i = global rank members[i]) wrote "<prefix>/arrive/<i>";
// names the missing ones on timeout. A record whose writer ended on this machine is a stale one
// (written_by_ended_process): its member has not arrived until it replaces it. A member that
// `watch` (the job's peer monitor, when there is one) reports dead or departed fails the wait at
// once: it will never arrive. Each arrival record is passed to `arrived(i, record)` as first
// seen; `poll` is called between looks (it throws to end the wait: a member that arrived and
// died).
void wait_for_arrivals(KeyStore& store, const std::string& prefix, const std::vector<int>& members,
                       const process::PeerMonitor* watch, std::chrono::milliseconds timeout,
                       const std::string& what, const std::string& url,
                       const std::function<void(int, const std::string&)>& arrived,
                       const std::function<void()>& poll) {
  const auto deadline = Clock::now() + timeout;
  std::vector<int> missing(members.size());
  std::iota(missing.begin(), missing.end(), 0);
  std::vector<int> stale;  // members whose index held a stale record at the last look
  while (true) {
    std::vector<int> still;
    stale.clear();
    for (int i : missing) {
      const auto record = store.try_get(arrival_key(prefix, i));
      const std::string text = record ? std::string(record->begin(), record->end()) : "";
      if (!record || written_by_ended_process(text)) {
        still.push_back(i);
        if (record) stale.push_back(members[i]);
      } else {
        arrived(i, text);
      }
    }
    missing.swap(still);
    if (missing.empty()) return;
    poll();
    std::vector<int> ranks;
    for (int i : missing) ranks.push_back(members[i]);
    if (watch != nullptr) {
      const auto losses = watch->losses(ranks, kLossWait);
      if (!losses.empty()) {
        // It may have arrived after the look at its key, and died since.
        const int lost = losses.front().rank;
        const auto at = std::find(members.begin(), members.end(), lost) - members.begin();
        if (store.check({arrival_key(prefix, static_cast<int>(at))})) {
          throw lost_during_rendezvous(what, url, losses.front());
        }
        throw CommError(fmt::format(
            "gloo: rendezvous of {} at '{}' failed: {}; ranks that did not arrive: {}", what,
            url, losses.front().describe(), dist_detail::format_ranks(ranks)));
      }
    }
    if (Clock::now() > deadline) {
      // Only a world's ranks can have failed on a previous job's keys before arriving.
      const char* world_note =
          prefix == kWorldPrefix && stale.size() < ranks.size()
              ? " (never started, or failed before arriving: one that found a previous job's "
                "key at its index failed at once and removed it, so starting it again succeeds)"
              : "";
      const std::string stale_note =
          stale.empty() ? ""
                        : fmt::format("; the keys there for ranks {} were written by a process "
                                      "of this machine that has ended (a rank of an earlier "
                                      "job, or one that died while it waited): each such rank "
                                      "replaces them when it arrives",
                                      dist_detail::format_ranks(stale));
      throw CommError(
          fmt::format("gloo: rendezvous of {} at '{}' timed out after {} ms; ranks that did "
                      "not arrive: {}{}{}",
                      what, url, timeout.count(), dist_detail::format_ranks(ranks), stale_note,
                      world_note));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Connects a Gloo context for `members` (global ranks; this process is members[my_index]) under
// `prefix`, and, when `monitor` is given, exchanges and connects the peer monitor too (the
// world). `watch`, the job's connected monitor (groups split later), fails the rendezvous at
// once when a member dies before arriving.
std::shared_ptr<gloo::Context> rendezvous(const GlooShared& shared, const std::string& prefix,
                                          const std::vector<int>& members, int my_index,
                                          const std::string& what, process::PeerMonitor* monitor,
                                          process::PeerMonitor* watch) {
  auto store = shared.open_store();
  const int n = static_cast<int>(members.size());
  // A failed rendezvous takes away every key at this rank's index: those it wrote, and any a
  // previous job left there (only a previous job can have: two jobs never share a store), so
  // the ranks that got the error can run the next job on the same directory or Redis server
  // (RedisStore refuses keys that exist). Whichever rank fails first, and however, each rank
  // of the failed job clears its own index.
  // Unless another process that runs holds this rank's arrival key: the same --rank given twice
  // (one job). Its keys are not stale, and deleting them would fail its job too; this process
  // leaves the store as it is and says so (`duplicate`, the other process's pid).
  std::optional<std::string> duplicate;
  // What broke the store, when that ended the rendezvous: seen before the cleanup reconnects.
  std::optional<std::string> broken;
  auto erase_gloo_keys = [&](int i) {
    store->erase_stale(fmt::format("{}/rank_{}", prefix, i));  // Gloo: the host name
    store->erase_stale(fmt::format("{}/{}", prefix, i));        // Gloo: the address
  };
  auto erase_index = [&](int i) {
    store->erase_stale(arrival_key(prefix, i));
    erase_gloo_keys(i);
  };
  // The keys at index i, only while its arrival record is still `record`: a process that took
  // the index since (a rank restarted at once, a duplicate that replaced the same stale record
  // first) keeps its own. (Its host name and address come only after every arrival.)
  auto erase_index_if_holds = [&](int i, const std::string& record) {
    if (store->erase_if_holds(arrival_key(prefix, i), record)) erase_gloo_keys(i);
  };
  // Fails the rendezvous when `watch` knows of a member lost (deaths named first).
  std::vector<int> others;
  for (int i = 0; i < n; ++i) {
    if (i != my_index) others.push_back(members[i]);
  }
  // Fails it, at once, when a member gave up on it (PeerMonitor::kRendezvous, as split_group
  // tells): its error came before it arrived (`Too many open files` opening the store) or after
  // (the connections), and waiting for it would last until the timeout.
  auto throw_if_member_gave_up = [&] {
    if (watch == nullptr) return;
    auto given_up = watch->rendezvous_given_up(prefix);
    if (!given_up) return;
    const std::string failed =
        fmt::format("gloo: rendezvous of {} at '{}' failed: ", what, shared.url.text);
    std::string error = std::move(given_up->second);
    if (error.rfind(failed, 0) == 0) error.erase(0, failed.size());
    throw CommError(fmt::format("{}rank {} gave up on it: {}", failed, given_up->first, error));
  };
  auto throw_if_member_lost = [&] {
    if (watch == nullptr) return;
    const auto losses = watch->losses(others, kLossWait);
    if (!losses.empty()) throw lost_during_rendezvous(what, shared.url.text, losses.front());
    throw_if_member_gave_up();
  };
  // Each member's process_identity, from its arrival record ("" until read, or unknown), and
  // whether this process saw that process running: only one seen running, then ended, counts
  // as a member that ended (a record a killed job left, or one from a machine or namespace
  // whose pids /proc here does not number, is never taken for a death).
  std::vector<std::string> identities(static_cast<size_t>(n));
  std::vector<std::string> records(static_cast<size_t>(n));  // as read ("" until read)
  std::vector<char> seen_running(static_cast<size_t>(n), 0);
  auto throw_if_member_ended = [&] {
    for (int i = 0; i < n; ++i) {
      if (i == my_index) continue;
      const std::optional<bool> running = process::process_running(identities[i]);
      if (!running) continue;
      if (*running) {
        seen_running[i] = 1;
        continue;
      }
      if (!seen_running[i]) continue;
      if (!store->check({arrival_key(prefix, i)})) {
        // It took its record back, as a rank whose rendezvous failed does, and exited.
        throw CommError(fmt::format(
            "gloo: rendezvous of {} at '{}' failed: rank {} gave up on it and exited (its own "
            "error says why); missing ranks [{}]",
            what, shared.url.text, members[i], members[i]));
      }
      process::PeerLoss died;  // not clean: its process ended
      died.rank = members[i];
      throw lost_during_rendezvous(what, shared.url.text, died);
    }
  };
  // The keys of this rank's index go, and those of every member known to have died: a dead
  // process writes nothing more, and its keys would fail the next job that makes this group,
  // perhaps many jobs later (only a job that makes the same group reads them).
  auto forget_keys = [&] {
    broken = store->failure();
    if (broken) store->reconnect_for_cleanup();
    duplicate = live_holder(*store, arrival_key(prefix, my_index));
    if (duplicate) return;
    store->erase_own_keys();
    erase_index(my_index);
    std::vector<int> dead;
    for (int i = 0; i < n; ++i) {
      if (i == my_index) continue;
      const std::optional<process::PeerLoss> loss =
          watch != nullptr ? watch->lost(members[i]) : std::nullopt;
      const bool ended = seen_running[i] && process::process_running(identities[i]) == false;
      if ((loss && !loss->clean) || ended) dead.push_back(i);
    }
    if (dead.empty()) return;
    // Half a second first, so that members still waiting (a look every 100 ms) see the dead
    // one's record there and name a death: a record gone from an ended process reads as a
    // member that gave up and took it back.
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    for (int i : dead) {
      if (records[static_cast<size_t>(i)].empty()) {
        erase_index(i);
      } else {
        erase_index_if_holds(i, records[static_cast<size_t>(i)]);
      }
    }
  };
  auto taken_by = [&](const std::string& pid) {
    return CommError(fmt::format(
        "gloo: rendezvous of {} at '{}' failed: rank {} is taken by another process that runs "
        "(pid {} on this machine): the same --rank given twice, or a rank of an earlier job on "
        "this store still waiting for its peers; this process left the store as it was",
        what, shared.url.text, members[my_index], pid));
  };
  auto store_broken = [&](const std::string& broken) {
    return CommError(
        fmt::format("gloo: rendezvous of {} at '{}' failed: {}", what, shared.url.text, broken));
  };
  // A member that dies after its arrival key never writes its address: Gloo's wait for it
  // (connectFullMesh) ends at once, not at the timeout.
  if (watch != nullptr) store->set_poll(throw_if_member_lost);
  try {
    gloo::rendezvous::PrefixStore prefixed(prefix, store->store());
    // "<size> <mode> <monitor address or ->": the size catches ranks started with different
    // world sizes, which Gloo would only report as a garbled address exchange; the mode ranks
    // with and without FUNCOL_DEBUG=DETAIL, whose collectives would pair a signature exchange
    // with the data (wrong bytes delivered without an error).
    // Then, last, this process's identity (process_identity), with which members on this
    // machine tell at once that one they saw running died during the rendezvous.
    const char* mode = shared.detail ? "detail" : "plain";
    const std::string mine =
        fmt::format("{} {} {} {}", n, mode, monitor ? monitor->address() : std::string("-"),
                    process::process_identity());
    // Keys at this index whose writer ended on this machine (a rank of an earlier job stopped
    // by Ctrl-C or killed while it waited here, which could not take them back) are stale:
    // they go, and this rank takes the index. Those of a writer that cannot be checked (another
    // machine) still fail the set below.
    if (const auto stale = stale_record(*store, arrival_key(prefix, my_index))) {
      erase_index_if_holds(my_index, *stale);
    }
    prefixed.set(fmt::format("arrive/{}", my_index), std::vector<char>(mine.begin(), mine.end()));
    // Each record is checked as it is read: a rank started for another world size or debug
    // mode fails the rendezvous at once on every rank that reads its record, not only on the
    // last to arrive (the others waited out their timeout, then named it as not arrived).
    std::vector<std::string> addresses(static_cast<size_t>(n));
    auto keep_record = [&](int i, const std::string& value) {
      records[static_cast<size_t>(i)] = value;
      identities[static_cast<size_t>(i)] = record_identity(value);
      const size_t space = value.find(' ');
      const size_t space2 = space == std::string::npos ? space : value.find(' ', space + 1);
      const std::string size = value.substr(0, space);
      // The rank that finds the disagreement keeps its own record half a second before it takes
      // it back, so that peers waiting for it (a look every 10 ms, on a loaded machine too) read
      // it and say the same.
      auto refuse = [&](const std::string& why) {
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        return CommError(
            fmt::format("gloo: rendezvous of {} at '{}' failed: {}", what, shared.url.text, why));
      };
      if (space2 == std::string::npos || size != std::to_string(n)) {
        throw refuse(fmt::format(
            "rank {} was started for {} ranks, this rank (rank {}) for {} (or a previous job "
            "left its keys there)",
            members[i], space == std::string::npos ? "?" : size, members[my_index], n));
      }
      if (value.substr(space + 1, space2 - space - 1) != mode) {
        throw refuse(process::debug_detail_mismatch(members[i], members[my_index], shared.detail));
      }
      const size_t space3 = value.find(' ', space2 + 1);
      addresses[static_cast<size_t>(i)] = value.substr(space2 + 1, space3 - space2 - 1);
    };
    auto last_look = Clock::now();
    // A member on this machine whose process ended fails the rendezvous at once, named (a
    // tenth of a second between looks), instead of a wait until the timeout.
    auto look_for_ended = [&] {
      if (Clock::now() - last_look < std::chrono::milliseconds(100)) return;
      last_look = Clock::now();
      throw_if_member_ended();
      throw_if_member_gave_up();
    };
    wait_for_arrivals(*store, prefix, members, watch, shared.timeout, what, shared.url.text,
                      keep_record, look_for_ended);
    // A key gone since wait_for_arrivals read it was taken back by its member, whose
    // rendezvous failed (forget_keys).
    std::vector<int> gone;
    for (int i = 0; i < n; ++i) {
      if (!store->check({arrival_key(prefix, i)})) gone.push_back(members[i]);
    }
    // A member that died explains more than one that gave up because of it.
    throw_if_member_ended();
    if (!gone.empty()) {
      throw CommError(fmt::format(
          "gloo: rendezvous of {} at '{}' failed: rank {} gave up on it after arriving (its own "
          "error says why); missing ranks {}",
          what, shared.url.text, gone.front(), dist_detail::format_ranks(gone)));
    }
    // So too while Gloo waits for addresses, connects and meets at a barrier.
    store->set_poll([&] {
      throw_if_member_lost();
      look_for_ended();
    });

    auto context = std::make_shared<gloo::rendezvous::Context>(my_index, n);
    // A Gloo pair waits five times its timeout for its first connection, and takes the
    // context's timeout when connectFullMesh makes it: a fifth of the job's timeout there bounds
    // the wait for a peer that died after writing its address (or a previous job's address) by
    // the job's timeout, not five times it. Pairs use their timeout for nothing else here: the
    // sockets are non-blocking and every collective passes its own.
    context->setTimeout(std::max(std::chrono::milliseconds(1), shared.timeout / 5));
    auto device = shared.device;
    context->connectFullMesh(prefixed, device);
    context->setTimeout(shared.timeout);

    if (monitor) monitor->connect(addresses, shared.timeout, throw_if_member_ended);
    // Every member has read every key once all pass this barrier; then the keys can go.
    gloo::BarrierOptions barrier(context);
    barrier.setTimeout(shared.timeout);
    gloo::barrier(barrier);
    store->erase_own_keys();
    return context;
  } catch (const Error&) {
    forget_keys();
    if (broken) throw store_broken(*broken);
    if (duplicate) throw taken_by(*duplicate);
    throw;
  } catch (const std::exception& e) {
    forget_keys();
    if (duplicate) throw taken_by(*duplicate);
    // A member lost meanwhile (a connection it never answered, a barrier it left) is the cause.
    throw_if_member_lost();
    throw_if_member_ended();
    // Or the store: Gloo says only "Resource temporarily unavailable".
    if (broken) throw store_broken(*broken);
    std::string msg = gloo_message(e);
    constexpr const char* kNextJob =
        "which the rank whose key was taken removes, so the next job can start there";
    // The store's waits for addresses last the timeout (TimedWaits), and so do a pair's for its
    // first connection (five times a fifth of it, see above).
    const auto waited = shared.timeout.count();
    if (msg.find("already") != std::string::npos) {
      // RedisStore's check comes first ("reply->integer == 1. 0 vs 1. Key '...' already set").
      if (const auto key = msg.find("Key '"); key != std::string::npos) msg.erase(0, key);
      msg += fmt::format(
          " (a previous job left its keys in '{}', or another process joined as rank {}: the "
          "same --rank given twice, or two jobs at one store; this rank removed its own keys, "
          "so the next job can start there)",
          shared.url.text, members[my_index]);
    } else if (msg.find("Wait timeout") != std::string::npos) {
      // Every member's arrival key was there, but a member never wrote its address.
      msg += fmt::format(
          " (every rank's arrival key was in '{}', but these never connected within {} ms: "
          "they failed during the rendezvous, or a previous job left their keys there, {})",
          shared.url.text, waited, kNextJob);
    } else if (msg.find("Connect timeout") != std::string::npos ||
               msg.find("Connection refused") != std::string::npos) {
      // A member's address was in the store, but nothing answered there.
      msg += fmt::format(
          " (a rank's address in '{}' did not answer, waited for up to {} ms: that rank failed "
          "during the rendezvous, or a previous job left its keys there, {})",
          shared.url.text, waited, kNextJob);
    }
    // A member stopped (SIGSTOP) or stuck outside funcol: the peer monitor can tell it.
    if (watch != nullptr) msg += watch->silent_ranks_note(others, process::kProgressQueryWait);
    throw CommError(
        fmt::format("gloo: rendezvous of {} at '{}' failed: {}", what, shared.url.text, msg));
  }
}

class GlooProcessGroup final : public process::ProcessGroupBase {
 public:
  static std::shared_ptr<GlooProcessGroup> create(int rank, std::vector<int> global_ranks,
                                                  std::string name, GroupRegistry* registry,
                                                  std::shared_ptr<process::ProcessJob> job,
                                                  std::shared_ptr<GlooShared> shared,
                                                  std::shared_ptr<gloo::Context> context) {
    std::shared_ptr<GlooProcessGroup> group(
        new GlooProcessGroup(rank, std::move(global_ranks), std::move(name), registry,
                             std::move(job), std::move(shared), std::move(context)));
    group->attach();
    return group;
  }

  ~GlooProcessGroup() override {
    {
      std::lock_guard lock(queue_mu_);
      stopping_ = true;
    }
    queue_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
  }

  std::string backend() const override { return "gloo"; }

  std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& rank_lists,
                                            const std::string& name) override {
    auto mine = dist_detail::check_split(*this, rank_lists, name);
    const int split = agree_on_split(rank_lists, name);
    if (!mine) {
      dist_detail::note_split(*this, rank_lists);
      return nullptr;
    }
    const int my_index =
        static_cast<int>(std::find(mine->begin(), mine->end(), global_rank()) - mine->begin());
    std::shared_ptr<gloo::Context> context;
    if (mine->size() > 1) {
      // Disjoint groups of one split share a name (a mesh dim), so the prefix names the members.
      std::string prefix =
          fmt::format("funcol/{}/split{}/{}/{}", this->name(), split, name, fmt::join(*mine, "-"));
      try {
        context = rendezvous(*shared_, prefix, *mine, my_index,
                             fmt::format("group '{}' [{}]", name, fmt::join(*mine, ", ")),
                             /*monitor=*/nullptr, job()->monitor());
      } catch (const std::exception& e) {
        // The members still waiting for this rank fail at once, with its error (unless another
        // member told them first: its error is the cause, and theirs names it).
        auto* monitor = job()->monitor();
        if (monitor != nullptr && !monitor->rendezvous_given_up(prefix)) {
          monitor->tell_gave_up(*mine, prefix, process::PeerMonitor::kRendezvous, e.what());
        }
        throw;
      }
    }
    auto group = create(my_index, *mine, name, &registry(), job(), shared_, std::move(context));
    registry().add(group);
    dist_detail::note_split(*this, rank_lists);
    return group;
  }

 protected:
  void submit(const std::shared_ptr<CollectiveOp>& op) override {
    {
      std::lock_guard lock(queue_mu_);
      queue_.push_back(op);
    }
    queue_cv_.notify_one();
  }

 private:
  GlooProcessGroup(int rank, std::vector<int> global_ranks, std::string name,
                   GroupRegistry* registry, std::shared_ptr<process::ProcessJob> job,
                   std::shared_ptr<GlooShared> shared, std::shared_ptr<gloo::Context> context)
      : ProcessGroupBase(rank, std::move(global_ranks), std::move(name), registry, std::move(job)),
        shared_(std::move(shared)),
        context_(std::move(context)) {
    if (context_) worker_ = std::thread([this] { work(); });
  }

  // Runs queued collectives in issue order; on stop, drains what was issued first.
  void work() {
    while (true) {
      std::shared_ptr<CollectiveOp> op;
      {
        std::unique_lock lock(queue_mu_);
        queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      // Failed already: timed out, a peer was lost, or the group broke.
      if (op->done()) continue;
      try {
        const Running running(*this, *op);
        run(op);
      } catch (const Aborted&) {
        // on_failed stopped it: its Work failed already, with the better message.
      } catch (const std::exception& e) {
        // At the deadline the watchdog's report is the better one: wait for it, briefly.
        const auto deadline = deadline_of(*op);
        if (Clock::now() + std::chrono::milliseconds(5) >= deadline) {
          const auto until = deadline + kWatchdogWait;
          while (!op->done() && Clock::now() < until) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
        }
        // Failed already (the watchdog, a lost peer): the message, which waits up to half a
        // second to name a lost peer, would be thrown away.
        if (!op->done()) fail_op(op, failure_message(*op, gloo_message(e)));
      }
    }
  }

  // The timeout of the collective's next Gloo call: what is left of its time (a lost peer
  // shortens it), plus kGlooGrace. Each call takes its own, so that a collective made of
  // several (the detail-mode signature exchange, coalesced tensors, a large all-reduce's two
  // steps) ends within the grace of its deadline, not up to a whole timeout after it.
  std::chrono::milliseconds gloo_timeout(const CollectiveOp& op) const {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline_of(op) - Clock::now());
    return std::max(left, std::chrono::milliseconds(1)) + kGlooGrace;
  }

  void run(const std::shared_ptr<CollectiveOp>& op) {
    const CollectiveOp& collective = *op;  // each Gloo call's timeout: gloo_timeout(collective)
    tag_ = kUserTag;  // the signature exchange pairs every op with its peers' (detail mode)
    if (job()->detail()) {
      const std::vector<char> encoded = process::encode_signature(op->signature, size());
      const auto bytes = static_cast<int64_t>(encoded.size());
      const Tensor mine = Tensor::empty({bytes}, DType::U8);
      std::memcpy(mine.raw_data_ptr(), encoded.data(), encoded.size());
      const Tensor gathered = Tensor::empty({bytes * size()}, DType::U8);
      all_gather_bytes(Purpose::kSignature, gathered, mine, collective);
      const auto* first = static_cast<const char*>(gathered.raw_data_ptr());
      const std::vector<char> all(first, first + bytes * size());
      if (auto mismatch = check_gathered(*op, all)) {
        fail_mismatch(op, *mismatch);
        return;
      }
    }
    if (!op->signature.step.empty()) tag_ = kStepTag;
    switch (op->kind) {
      case OpKind::AllReduce:
      case OpKind::AllReduceCoalesced:
      case OpKind::AllReduceFlat:  // a signature kind; such ops run as AllReduce
        for (const auto& t : op->outputs) all_reduce_one(t, op->reduce_op, collective);
        break;
      case OpKind::AllGather:
      case OpKind::AllGatherCoalesced:
        for (size_t i = 0; i < op->inputs.size(); ++i) {
          all_gather_one(op->outputs[i], op->inputs[i], collective);
        }
        break;
      case OpKind::ReduceScatter:
      case OpKind::ReduceScatterCoalesced:
        for (size_t i = 0; i < op->inputs.size(); ++i) {
          reduce_scatter_one(op->outputs[i], op->inputs[i], op->reduce_op, collective);
        }
        break;
      case OpKind::AllToAll:
        all_to_all_bytes(Purpose::kAllToAll, op->outputs[0], op->recv_counts, op->inputs[0],
                         op->send_counts, collective);
        break;
      case OpKind::Broadcast:
        if (op->outputs[0].numel() > 0) broadcast_bytes(op->outputs[0], op->root, collective);
        break;
      case OpKind::Barrier:
        barrier(collective);
        break;
    }
    complete(op);
  }

  // ---- funcol's exchanges over Gloo's unbound buffers ----
  // Gloo's own collectives wait inside, up to their timeout, and nothing can stop them: a
  // collective that the watchdog or a lost peer failed kept its group's worker, and with it
  // destroy_process_group and the process's exit, for up to a whole FUNCOL_TIMEOUT more (a
  // send to a killed peer is not even woken by its socket's error). These post the same sends
  // and receives on buffers the group holds, so on_failed can stop the waits.

  // Thrown out of an exchange that on_failed stopped.
  struct Aborted {};

  // Marks `op` as the one the worker runs, for on_failed, while it lives.
  class Running {
   public:
    Running(GlooProcessGroup& group, const CollectiveOp& op) : group_(group) {
      std::lock_guard lock(group_.running_mu_);
      group_.running_op_ = &op;
      group_.running_aborted_ = false;
    }
    ~Running() {
      std::lock_guard lock(group_.running_mu_);
      group_.running_op_ = nullptr;
    }
    Running(const Running&) = delete;
    Running& operator=(const Running&) = delete;

   private:
    GlooProcessGroup& group_;
  };

  void on_failed(const CollectiveOp& op) override {
    std::lock_guard lock(running_mu_);
    if (&op != running_op_) return;
    running_aborted_ = true;
    for (gloo::transport::UnboundBuffer* b : running_buffers_) {
      b->abortWaitSend();
      b->abortWaitRecv();
    }
  }

  // `nbytes` bytes at `offset` of a tensor, to or from group rank `peer`.
  struct Piece {
    int peer;
    size_t offset;
    size_t nbytes;
  };

  // What an exchange is for. Each has slots of its own, so that ranks that issued different
  // collectives (without FUNCOL_DEBUG=detail nothing compares them first) never pair their
  // messages: they time out, and the watchdog's query names the difference.
  enum class Purpose : uint8_t {
    kSignature,
    kAllReduceGathered,
    kAllReduceScatter,
    kAllReduceGather,
    kAllGather,
    kReduceScatter,
    kAllToAll,
    kBroadcast,
    kBarrier,
  };

  // The slot a piece of `nbytes` bytes travels on. Gloo pairs a send with a receive of the
  // same peer and slot, so the slot holds what the two sides must agree on: the exchange's
  // purpose, the op's tag, the piece's size and, for data, the element type (a coalesced
  // list's first tensor's), the reduction and the root (a broadcast's: ranks that disagreed on
  // it paired along both trees, and one whose parent in its own tree was a child in the
  // others' completed with the wrong root's data, silently).
  // Ranks that issued collectives that differ in these at one sequence number (unchecked
  // without FUNCOL_DEBUG=detail) then never pair: they time out, and the timeout names what
  // each issued. Paired, Gloo aborted the rank that received more (`op.preamble.length <=
  // op.nbytes`) and the one that received less completed, its output's tail never written.
  uint64_t piece_slot(Purpose purpose, const CollectiveOp& op, size_t nbytes) const {
    dist_detail::Fnv1a key;
    key.mix(static_cast<int64_t>(nbytes));
    // The signature exchange must pair whatever the ops are: it is what compares them.
    if (purpose != Purpose::kSignature) {
      key.mix(static_cast<int64_t>(op.dtype));
      key.mix(static_cast<int64_t>(op.reduce_op));
      key.mix(static_cast<int64_t>(op.root));
    }
    const auto hash24 = static_cast<uint32_t>(key.value() >> 40);  // 24 bits
    return gloo::Slot::build(
        static_cast<uint8_t>(kExchangeSlotPrefix + static_cast<uint8_t>(purpose)),
        (hash24 << 8) | tag_);
  }

  // Posts every receive into `into` and every send from `from`, then waits for them all,
  // each wait with what is left of the collective's time (gloo_timeout). Gloo pairs them by
  // peer and slot, in order. Throws Aborted when on_failed stopped it, Gloo's IoException on
  // a timeout or a broken connection. After a failure the buffers and the tensors they point
  // into stay with the group until it is destroyed: a peer may still write into them.
  void exchange(Purpose purpose, const Tensor& into, const std::vector<Piece>& recvs,
                const Tensor& from, const std::vector<Piece>& sends, const CollectiveOp& op) {
    Posted posted{into, from,
                  context_->createUnboundBuffer(into.raw_data_ptr(), into.nbytes()),
                  context_->createUnboundBuffer(from.raw_data_ptr(), from.nbytes())};
    {
      std::lock_guard lock(running_mu_);
      if (running_aborted_ || op.done()) throw Aborted{};
      running_buffers_ = {posted.recv.get(), posted.send.get()};
    }
    try {
      for (const Piece& p : recvs) {
        posted.recv->recv(p.peer, piece_slot(purpose, op, p.nbytes), p.offset, p.nbytes);
      }
      for (const Piece& p : sends) {
        posted.send->send(p.peer, piece_slot(purpose, op, p.nbytes), p.offset, p.nbytes);
      }
      for (size_t i = 0; i < recvs.size(); ++i) {
        if (!posted.recv->waitRecv(nullptr, gloo_timeout(op))) throw Aborted{};
      }
      for (size_t i = 0; i < sends.size(); ++i) {
        if (!posted.send->waitSend(nullptr, gloo_timeout(op))) throw Aborted{};
      }
    } catch (...) {
      std::lock_guard lock(running_mu_);
      running_buffers_.clear();
      parked_.push_back(std::move(posted));
      throw;
    }
    std::lock_guard lock(running_mu_);
    running_buffers_.clear();
  }

  // Every rank's `in` into `out`, block r from rank r (blocks of in.nbytes()).
  void all_gather_bytes(Purpose purpose, const Tensor& out, const Tensor& in,
                        const CollectiveOp& op) {
    all_gather_blocks(purpose, out, std::vector<size_t>(size(), in.nbytes()), in, op);
  }

  // Rank r's first block_bytes[r] bytes of `in` into `out`, the blocks back to back in rank
  // order.
  void all_gather_blocks(Purpose purpose, const Tensor& out, const std::vector<size_t>& block_bytes,
                         const Tensor& in, const CollectiveOp& op) {
    const size_t mine = block_bytes[rank()];
    std::vector<Piece> recvs, sends;
    size_t offset = 0;
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) {
        std::memcpy(static_cast<char*>(out.raw_data_ptr()) + offset, in.raw_data_ptr(), mine);
      } else {
        recvs.push_back({r, offset, block_bytes[r]});
        sends.push_back({r, 0, mine});
      }
      offset += block_bytes[r];
    }
    exchange(purpose, out, recvs, in, sends, op);
  }

  // all_to_all of elements: send_counts[r] of `in` (back to back, in rank order) go to rank
  // r, recv_counts[r] of `out` come from it.
  void all_to_all_bytes(Purpose purpose, const Tensor& out,
                        const std::vector<int64_t>& recv_counts,
                        const Tensor& in, const std::vector<int64_t>& send_counts,
                        const CollectiveOp& op) {
    const size_t isz = in.itemsize();
    std::vector<Piece> recvs, sends;
    size_t in_off = 0, out_off = 0;
    for (int r = 0; r < size(); ++r) {
      const size_t send = static_cast<size_t>(send_counts[r]) * isz;
      const size_t recv = static_cast<size_t>(recv_counts[r]) * isz;
      if (r == rank()) {
        FUNCOL_CHECK(send == recv, "all_to_all: this rank's own block changes size");
        std::memcpy(static_cast<char*>(out.raw_data_ptr()) + out_off,
                    static_cast<const char*>(in.raw_data_ptr()) + in_off, send);
      } else {
        recvs.push_back({r, out_off, recv});
        sends.push_back({r, in_off, send});
      }
      in_off += send;
      out_off += recv;
    }
    exchange(purpose, out, recvs, in, sends, op);
  }

  // `t` from group rank `root` to every rank, down a binomial tree rooted there: each rank
  // receives once from its parent, then sends to its children (log2(size) rounds in all).
  void broadcast_bytes(const Tensor& t, int root, const CollectiveOp& op) {
    const int n = size();
    const int me = (rank() - root + n) % n;  // position in the tree, the root at 0
    const size_t bytes = t.nbytes();
    int bit = 1;
    if (me != 0) {
      while ((me & bit) == 0) bit <<= 1;  // the lowest set bit: the parent is me - bit
      exchange(Purpose::kBroadcast, t, {{(me - bit + root) % n, 0, bytes}}, t, {}, op);
    } else {
      while (bit < n) bit <<= 1;
    }
    std::vector<Piece> children;
    for (int child = bit >> 1; child >= 1; child >>= 1) {
      if (me + child < n) children.push_back({(me + child + root) % n, 0, bytes});
    }
    if (!children.empty()) exchange(Purpose::kBroadcast, t, {}, t, children, op);
  }

  // A dissemination barrier: in round k each rank tells rank + 2^k and hears from rank - 2^k;
  // after ceil(log2(size)) rounds every rank has heard, at one remove or more, from all.
  void barrier(const CollectiveOp& op) {
    const int n = size();
    const Tensor token = Tensor::zeros({2}, DType::U8);
    for (int step = 1; step < n; step <<= 1) {
      exchange(Purpose::kBarrier, token, {{(rank() - step + n) % n, 1, 1}}, token,
               {{(rank() + step) % n, 0, 1}}, op);
    }
  }

  // Every all-reduce is reduced here, in rank order, as the threads backend does (Gloo's own
  // combines two buffers at a time in its order, and would round every f16/bf16 partial
  // result): small ones as one all-gather (Gloo's all-reduce cost 0.96 ms a collective with
  // 200 small i32 ones in flight, 2 ranks; its all-gather 0.07 ms), larger ones as a
  // reduce-scatter and an all-gather (64 MiB, 2 ranks: f32 55-60 ms against 62-107 ms for
  // Gloo's, i32 63-65 ms against 76-81 ms).
  void all_reduce_one(const Tensor& t, ReduceOp op, const CollectiveOp& collective) {
    if (t.numel() == 0) return;
    if (t.nbytes() * static_cast<size_t>(size()) <= process::kGatherReduceBytes) {
      all_reduce_gathered(t, op, collective);
    } else {
      all_reduce_scattered(t, op, collective);
    }
  }

  // Every rank's tensor, reduced here in rank order (process::reduce_blocks: f16/bf16 sums,
  // averages and products in f32, rounding once; avg divided once): one Gloo collective.
  void all_reduce_gathered(const Tensor& t, ReduceOp op, const CollectiveOp& collective) {
    const int64_t n = t.numel();
    const Tensor all = Tensor::empty({n * size()}, t.dtype());
    all_gather_bytes(Purpose::kAllReduceGathered, all, t, collective);
    process::reduce_blocks(op, t.dtype(), t.raw_data_ptr(), all.raw_data_ptr(), size(), n);
  }

  // A reduce-scatter (an all-to-all of the blocks, then each rank reduces its block over
  // every rank in rank order) and an all-gather of the reduced blocks: the same bytes on the
  // wire as a ring all-reduce.
  void all_reduce_scattered(const Tensor& t, ReduceOp op, const CollectiveOp& collective) {
    const int64_t n = t.numel();
    const int g = size();
    const int me = rank();
    const auto isz = static_cast<int64_t>(t.itemsize());
    std::vector<int64_t> counts(g);  // block r goes to rank r
    for (int r = 0; r < g; ++r) counts[r] = process::block_elements(n, g, r);
    // Scratch from the caching allocator, as scatter_reduce's.
    const Tensor mine = Tensor::empty({std::max<int64_t>(counts[me], 1) * isz}, DType::U8);
    scatter_reduce(Purpose::kAllReduceScatter, t, counts, mine.raw_data_ptr(), op, collective);
    // The reduced blocks back into t, block r from rank r.
    std::vector<size_t> block_bytes(g);
    for (int r = 0; r < g; ++r) block_bytes[r] = static_cast<size_t>(counts[r] * isz);
    all_gather_blocks(Purpose::kAllReduceGather, t, block_bytes, mine, collective);
  }

  void all_gather_one(const Tensor& out, const Tensor& in, const CollectiveOp& collective) {
    if (in.numel() == 0) return;
    all_gather_bytes(Purpose::kAllGather, out, in, collective);
  }

  // Gloo's reduce-scatter needs power-of-two-friendly layouts; an all-to-all of the blocks and
  // a local reduction over the ranks, in rank order, is exact for every dtype and op and
  // moves the same (n-1)/n of the data per rank.
  void reduce_scatter_one(const Tensor& out, const Tensor& in, ReduceOp op,
                          const CollectiveOp& collective) {
    const int64_t n = out.numel();
    if (n == 0) return;
    scatter_reduce(Purpose::kReduceScatter, in, std::vector<int64_t>(size(), n),
                   out.raw_data_ptr(), op, collective);
  }

  // Block r of `data` (counts[r] elements, the blocks back to back) goes to rank r; this rank
  // reduces the blocks it receives into `out` in rank order (process::reduce_blocks).
  void scatter_reduce(Purpose purpose, const Tensor& data, const std::vector<int64_t>& counts,
                      void* out, ReduceOp op, const CollectiveOp& collective) {
    const int g = size();
    const int64_t mine = counts[rank()];
    // From the caching allocator: a zeroed vector's memset and page faults took most of a 64
    // MiB reduce-scatter's time (0.92-1.08 s against 51-59 ms, 2 ranks, a loaded host).
    const Tensor blocks = Tensor::empty({mine * g}, data.dtype());
    all_to_all_bytes(purpose, blocks, std::vector<int64_t>(g, mine), data, counts, collective);
    process::reduce_blocks(op, data.dtype(), out, blocks.raw_data_ptr(), g, mine);
  }

  std::shared_ptr<GlooShared> shared_;
  std::shared_ptr<gloo::Context> context_;  // null for a group of one rank
  // Gloo pairs messages by the op and a tag. funcol's own agreement steps (new_group,
  // split_group, ...) and a tape's backward collectives (any InternalStep) move their data
  // under a tag of their own, so that Gloo never pairs one with a user's collective a peer
  // issued at the same point: without FUNCOL_DEBUG=detail nothing compares the two, and a
  // larger message than expected aborts the receiving rank inside Gloo's transport. Both sides
  // then wait, and time out naming each other.
  static constexpr uint32_t kUserTag = 0;
  static constexpr uint32_t kStepTag = 1;  // tags fit in 8 bits (piece_slot)
  uint32_t tag_ = kUserTag;  // the running op's (worker thread only)
  // The slots of funcol's exchanges (plus their Purpose), apart from Gloo's collectives'
  // (gloo/types.h's prefixes end at 0x08; the rendezvous still runs Gloo's barrier).
  static constexpr uint8_t kExchangeSlotPrefix = 0x20;

  // An exchange's buffers, and the tensors they point into: declared first, so destroyed
  // last (Gloo's device thread may write into a parked buffer until its destructor returns).
  struct Posted {
    Tensor into, from;
    std::unique_ptr<gloo::transport::UnboundBuffer> recv, send;
  };
  std::mutex running_mu_;
  const CollectiveOp* running_op_ = nullptr;  // what the worker runs (Running)
  bool running_aborted_ = false;              // on_failed stopped it
  std::vector<gloo::transport::UnboundBuffer*> running_buffers_;  // the exchange it waits in
  std::vector<Posted> parked_;  // failed exchanges' (see exchange)

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<CollectiveOp>> queue_;
  bool stopping_ = false;
  std::thread worker_;
};

// An InitOptions field, else its environment variable.
int resolve_identity(int option, const char* env, const char* field, const char* flag) {
  if (option >= 0) return option;
  if (auto v = process::env_int(env)) return *v;
  throw InvalidArgument(
      fmt::format("gloo backend needs InitOptions::{} (--{}) or the environment variable {}", field,
                  flag, env));
}

}  // namespace

process::ProcessWorld init_world(const InitOptions& options, GroupRegistry& registry) {
  const int world_size =
      resolve_identity(options.world_size, "WORLD_SIZE", "world_size", "world-size");
  const int rank = resolve_identity(options.rank, "RANK", "rank", "rank");
  if (world_size < 1) {
    throw InvalidArgument(
        fmt::format("gloo backend: world size {} must be at least 1", world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw InvalidArgument(
        fmt::format("gloo backend: rank {} is out of range for world size {}", rank, world_size));
  }
  // Gloo writes to TCP sockets: a peer that died must give this rank an error (EPIPE ->
  // CommError naming the peer), not kill it with SIGPIPE. A handler the program set is kept.
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
  auto shared = std::make_shared<GlooShared>();
  shared->timeout = process::resolve_timeout(options.timeout);
  const bool detail = process::debug_detail();  // a bad value fails before the rendezvous
  shared->detail = detail;
  std::string store = options.store.empty() ? process::env_string("FUNCOL_STORE") : options.store;
  std::shared_ptr<gloo::Context> context;
  std::unique_ptr<process::PeerMonitor> monitor;
  if (world_size > 1) {
    if (store.empty()) {
      throw InvalidArgument(
          "gloo backend needs a store: pass InitOptions::store (--store) or set FUNCOL_STORE to "
          "a directory, file:///dir or redis://host:port");
    }
    shared->url = process::parse_store_url(store);
    // The transport's address: an explicit interface or host, else loopback for a file store
    // (one host) and the address that routes to Redis for a Redis store (many hosts).
    gloo::transport::tcp::attr attr;
    std::string host = process::env_string("FUNCOL_GLOO_HOSTNAME");
    std::string iface = process::env_string("FUNCOL_GLOO_IFNAME");
    if (!iface.empty()) {
      attr.iface = iface;
    } else {
      if (host.empty() && shared->url.kind == process::StoreUrl::Kind::Redis) {
        try {
          host = process::route_address(shared->url.host, shared->url.port);
        } catch (const std::exception& e) {
          throw CommError(fmt::format("gloo: cannot reach the store '{}' (its Redis server): {}",
                                      shared->url.text, e.what()));
        }
      } else if (host.empty()) {
        host = "127.0.0.1";
      }
      attr.hostname = host;
    }
    try {
      // Gloo's own lookup of a name that does not resolve dereferences the failed result
      // (a segfault, not an exception): checked here first (a name that stops resolving
      // between the two lookups, as a DNS server fails, can still reach Gloo's).
      if (!attr.hostname.empty()) check_resolves(attr.hostname);
      shared->device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      throw CommError(fmt::format("gloo: cannot create a TCP device on {}: {}",
                                  iface.empty() ? host : "interface " + iface, gloo_message(e)));
    }
    if (host.empty()) host = process::interface_address(iface);
    monitor = std::make_unique<process::PeerMonitor>(rank, world_size, host);
    std::vector<int> members(world_size);
    std::iota(members.begin(), members.end(), 0);
    context = rendezvous(*shared, std::string(kWorldPrefix), members, rank,
                         fmt::format("the world ({} ranks)", world_size), monitor.get(),
                         /*watch=*/nullptr);
  }
  auto job = std::make_shared<process::ProcessJob>("gloo", rank, world_size, shared->timeout,
                                                   detail, std::move(monitor));
  std::vector<int> ranks(world_size);
  std::iota(ranks.begin(), ranks.end(), 0);
  auto world = GlooProcessGroup::create(rank, std::move(ranks), "world", &registry, job, shared,
                                        std::move(context));
  return {world, job};
}

}  // namespace funcol::gloo_backend
