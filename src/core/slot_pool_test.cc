// Tests of the slot pool that holds Storage objects (allocator.cc), through its own entry
// points: sanitizer builds take each Storage object from the system (memory.h), so the pool
// runs under AddressSanitizer (its free slots poisoned) and ThreadSanitizer only here.
#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "memory.h"

#if defined(__SANITIZE_ADDRESS__)
#define FUNCOL_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUNCOL_TEST_ASAN 1
#endif
#endif
#ifdef FUNCOL_TEST_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace funcol {
namespace {

using detail::kSlotBytes;
using detail::pool_allocate_slot;
using detail::pool_free_slot;

// Every byte of a slot tells its owner and its index.
unsigned char stamp(uint32_t owner, uint32_t index, size_t i) {
  return static_cast<unsigned char>(owner * 131 + index * 7 + i);
}
void fill(void* p, uint32_t owner, uint32_t index) {
  auto* bytes = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < kSlotBytes; ++i) bytes[i] = stamp(owner, index, i);
}
bool intact(const void* p, uint32_t owner, uint32_t index) {
  const auto* bytes = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < kSlotBytes; ++i) {
    if (bytes[i] != stamp(owner, index, i)) return false;
  }
  return true;
}

// The slots handed out and not yet freed, by all threads.
class LiveSlots {
 public:
  // False when `p` is live already: the pool handed one slot to two owners.
  bool add(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    ever_.insert(reinterpret_cast<uintptr_t>(p));
    return live_.insert(reinterpret_cast<uintptr_t>(p)).second;
  }
  // Every slot handed out so far.
  std::set<uintptr_t> ever() {
    std::lock_guard<std::mutex> lock(mu_);
    return ever_;
  }
  // Called before the slot goes back (another thread may take it at once).
  bool remove(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.erase(reinterpret_cast<uintptr_t>(p)) == 1;
  }

 private:
  std::mutex mu_;
  std::set<uintptr_t> live_;
  std::set<uintptr_t> ever_;
};

struct Held {
  void* slot;
  uint32_t owner;
  uint32_t index;
};

// Threads take more slots than a thread keeps (2048) and more than a slab holds, free half of
// them themselves and hand the rest to the next thread to free, round after round, and exit
// holding free slots (their lists go to the pool): no slot is ever live twice, each keeps its
// bytes while live, and the slots the exited threads left are handed out again.
TEST(SlotPool, EverySlotHasOneOwnerWhileThreadsTradeThem) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 6;
  constexpr uint32_t kPerRound = 3000;
  LiveSlots live;
  std::mutex inbox_mu;
  std::vector<Held> inbox[kThreads];
  std::barrier sync(kThreads);
  std::atomic<int> twice{0}, misaligned{0}, changed{0}, unknown{0};
  auto take = [&](uint32_t owner, uint32_t index) {
    void* p = pool_allocate_slot();
    if (!live.add(p)) twice.fetch_add(1);
    if (reinterpret_cast<uintptr_t>(p) % 64 != 0) misaligned.fetch_add(1);
    fill(p, owner, index);
    return Held{p, owner, index};
  };
  auto drop = [&](const Held& h) {
    if (!intact(h.slot, h.owner, h.index)) changed.fetch_add(1);
    if (!live.remove(h.slot)) unknown.fetch_add(1);
    pool_free_slot(h.slot);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        const auto owner = static_cast<uint32_t>(t * kRounds + round);
        std::vector<Held> mine;
        for (uint32_t i = 0; i < kPerRound; ++i) mine.push_back(take(owner, i));
        std::vector<Held> passed;
        for (const Held& h : mine) {
          if (h.index % 2 == 1) {
            passed.push_back(h);
          } else {
            drop(h);
          }
        }
        {
          std::lock_guard<std::mutex> lock(inbox_mu);
          auto& next = inbox[(t + 1) % kThreads];
          next.insert(next.end(), passed.begin(), passed.end());
        }
        sync.arrive_and_wait();
        std::vector<Held> received;
        {
          std::lock_guard<std::mutex> lock(inbox_mu);
          received.swap(inbox[t]);
        }
        EXPECT_EQ(received.size(), kPerRound / 2);
        for (const Held& h : received) drop(h);
        sync.arrive_and_wait();
      }
    });
  }
  for (auto& th : threads) th.join();
  // This thread's slots come first from what the exited threads left: every one of those is
  // handed out again before a new slab is carved (a list lost on the way is not).
  constexpr uint32_t kAfter = 20000;
  const std::set<uintptr_t> traded = live.ever();
  ASSERT_LT(traded.size(), size_t{kAfter} - 2048);
  std::vector<Held> after;
  for (uint32_t i = 0; i < kAfter; ++i) after.push_back(take(1000, i));
  size_t reused = 0;
  for (const Held& h : after) reused += traded.count(reinterpret_cast<uintptr_t>(h.slot));
  EXPECT_EQ(reused, traded.size()) << "slots the exited threads left that were not reused";
  for (const Held& h : after) drop(h);
  EXPECT_EQ(twice.load(), 0) << "slots handed to two owners at once";
  EXPECT_EQ(misaligned.load(), 0) << "slots not on a 64-byte boundary";
  EXPECT_EQ(changed.load(), 0) << "live slots whose bytes changed";
  EXPECT_EQ(unknown.load(), 0) << "slots freed that were not live";
}

// A slot freed by a thread whose list of free slots is gone (a thread_local destructor that
// runs after the list's) goes to the pool at once: it is the first slot the next thread gets.
// It takes a slot there too (from the pool, which keeps the rest of its batch).
struct LateFree {
  explicit LateFree(int) {}
  ~LateFree() {
    if (slot == nullptr) return;
    void* late_taken = pool_allocate_slot();
    fill(late_taken, 8, 8);
    *late_taken_intact = intact(late_taken, 8, 8);
    pool_free_slot(late_taken);
    pool_free_slot(slot);
  }
  void* slot = nullptr;
  bool* late_taken_intact = nullptr;
};

TEST(SlotPool, ASlotFreedAfterItsThreadsListWentIsTheNextHandedOut) {
  void* freed_late = nullptr;
  bool late_taken_intact = false;
  std::thread([&] {
    // Made before this thread's list of free slots (made by its first slot), so destroyed after.
    thread_local LateFree late(0);
    late.slot = pool_allocate_slot();
    fill(late.slot, 7, 7);
    freed_late = late.slot;
    late.late_taken_intact = &late_taken_intact;
  }).join();
  ASSERT_NE(freed_late, nullptr);
  EXPECT_TRUE(late_taken_intact) << "a slot taken after the thread's list went";
#ifdef FUNCOL_TEST_ASAN
  EXPECT_TRUE(__asan_address_is_poisoned(freed_late)) << "a free slot is not poisoned";
#endif
  void* next = nullptr;
  std::thread([&] {
    next = pool_allocate_slot();
    pool_free_slot(next);
  }).join();
  EXPECT_EQ(next, freed_late);
}

constexpr const char* kNeedsAsan =
    "checks AddressSanitizer's poisoning of free slots: runs in the ASan build (make test-asan)";

TEST(SlotPoolAsan, AFreeSlotIsPoisonedWholeAndATakenOneNot) {
#ifndef FUNCOL_TEST_ASAN
  GTEST_SKIP() << kNeedsAsan;
#else
  void* p = pool_allocate_slot();
  EXPECT_EQ(__asan_region_is_poisoned(p, kSlotBytes), nullptr);
  pool_free_slot(p);
  // Two slots in a thread's list, which the pool walks to its end (reading each link) when the
  // thread exits: both stay poisoned whole.
  void* in_list[2] = {};
  std::thread([&] {
    for (void*& q : in_list) q = pool_allocate_slot();
    for (void* q : in_list) pool_free_slot(q);
  }).join();
  for (void* q : {p, in_list[0], in_list[1]}) {
    for (size_t i = 0; i < kSlotBytes; i += 8) {
      EXPECT_TRUE(__asan_address_is_poisoned(static_cast<char*>(q) + i)) << "byte " << i;
    }
  }
#endif
}

#ifdef FUNCOL_TEST_ASAN
// Takes a slot, frees it and hands it to `misuse`.
template <typename Misuse>
void free_then(Misuse misuse) {
  void* p = pool_allocate_slot();
  pool_free_slot(p);
  misuse(p);
}
#endif

// A write to a freed slot and a second free of it stop the program, each naming what happened.
TEST(SlotPoolAsan, MisusingAFreedSlotStops) {
#ifndef FUNCOL_TEST_ASAN
  GTEST_SKIP() << kNeedsAsan;
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(free_then([](void* p) { static_cast<volatile char*>(p)[100] = 1; }),
               "use-after-poison");
  EXPECT_DEATH(free_then(pool_free_slot), "Storage slot at 0x[0-9a-f]+ was freed twice");
#endif
}

}  // namespace
}  // namespace funcol
