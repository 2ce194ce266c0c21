// Tests of the caching storage allocator.
#include "funcol/core/allocator.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <memory>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "memory.h"
#include "funcol/core/error.h"
#include "funcol/core/tensor.h"

namespace funcol {

namespace {

// Sanitizer builds allocate each Storage object from the system (memory.h).
constexpr bool kStorageFromSystem = detail::kSlotsFromSystem;
constexpr const char* kSlotsSkip =
    "sanitizer builds allocate each Storage object from the system, whose allocator the "
    "sanitizer tracks";

// FUNCOL_ALLOC_CACHE_MB: a whole number of megabytes or nothing; anything else is refused (it
// was ignored, the default applying silently), as FUNCOL_TIMEOUT and FUNCOL_STREAM_MB are.
TEST(AllocatorEnv, CacheLimitIsAWholeNumberOfMegabytes) {
  EXPECT_EQ(detail::cache_limit_from(nullptr), size_t{1024} << 20);
  EXPECT_EQ(detail::cache_limit_from(""), size_t{1024} << 20);
  EXPECT_EQ(detail::cache_limit_from("0"), 0u);
  EXPECT_EQ(detail::cache_limit_from("64"), size_t{64} << 20);
  // Blanks on either side and a '+', as FUNCOL_TIMEOUT takes them (" 2" was taken, "2 " not).
  EXPECT_EQ(detail::cache_limit_from(" 2"), size_t{2} << 20);
  EXPECT_EQ(detail::cache_limit_from("2 \t"), size_t{2} << 20);
  EXPECT_EQ(detail::cache_limit_from("+3"), size_t{3} << 20);
  for (const char* bad :
       {"abc", "12MB", "-1", "1.5", "99999999999999999999", "+-1", "- 1", " ", "+", "1 2"}) {
    try {
      detail::cache_limit_from(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("FUNCOL_ALLOC_CACHE_MB=" + std::string(bad)),
                std::string::npos)
          << e.what();
    }
  }
}

// Restores the default bound and empties the cache around each test.
class AllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    limit_ = static_cast<size_t>(allocator_stats().limit_bytes);
    empty_storage_cache();
  }
  void TearDown() override { set_allocator_cache_limit(limit_); }
  size_t limit_ = 0;
};

TEST_F(AllocatorTest, BlocksAreAligned) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{63}, size_t{4097}, kMinCachedBytes + 1}) {
    void* p = allocate_storage(n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kStorageAlignment, 0u) << n;
    std::memset(p, 0xab, n);
    free_storage(p, n);
  }
}

// A thread gets back the block it freed, not the one another thread freed after it: two ranks'
// threads allocating the same size each step keep their own buffers (and their cached lines).
TEST_F(AllocatorTest, AThreadGetsBackTheBlockItFreed) {
  constexpr size_t n = 2 * kMinCachedBytes;
  void* main_block = allocate_storage(n);
  std::atomic<int> step{0};
  void* mine = nullptr;
  void* again = nullptr;
  std::thread other([&] {
    mine = allocate_storage(n);
    free_storage(mine, n);
    step.store(1);
    while (step.load() != 2) std::this_thread::yield();
    again = allocate_storage(n);
  });
  while (step.load() != 1) std::this_thread::yield();
  free_storage(main_block, n);  // now the most recently freed block of this size
  step.store(2);
  other.join();
  EXPECT_NE(mine, main_block);
  EXPECT_EQ(again, mine);
  void* main_again = allocate_storage(n);
  EXPECT_EQ(main_again, main_block);
  free_storage(again, n);
  free_storage(main_again, n);
}

// A block of a page or more has its pages to itself: nothing else (a Storage's reference
// counts, malloc's headers) sits on a line that a peer reading the block pulls into its cache.
TEST_F(AllocatorTest, BlocksOfAPageOrMoreOwnTheirPages) {
  std::vector<std::pair<void*, size_t>> blocks;
  for (size_t n : {size_t{4096}, size_t{4097}, size_t{12288}, kMinCachedBytes + 1}) {
    for (int i = 0; i < 3; ++i) {
      void* p = allocate_storage(n);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 4096, 0u) << n;
      std::memset(p, 0xcd, n);
      blocks.emplace_back(p, n);
    }
  }
  for (const auto& [p, n] : blocks) free_storage(p, n);
  // The same for tensors: the data of a 4 KiB tensor does not share its page with its Storage.
  const Tensor t = Tensor::zeros({1024}, DType::F32);
  const auto data = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  const auto meta = reinterpret_cast<uintptr_t>(t.storage().get());
  EXPECT_EQ(data % 4096, 0u);
  EXPECT_NE(data / 4096, meta / 4096);
}

// A child forked while other threads allocate and free (taking the allocator's locks) and make
// tensors of many shapes (the layout table's lock) can make tensors, of new shapes too: no lock
// is held by a thread the child does not have.
TEST_F(AllocatorTest, AForkedChildCanAllocate) {
  if (kStorageFromSystem) {
    GTEST_SKIP() << "the sanitizer's own allocator (GCC 12's) does not hold its locks across "
                    "fork(): a child hangs in its malloc, whatever funcol does";
  }
  std::atomic<bool> stop{false};
  std::vector<Tensor> handoff[2];
  std::mutex handoff_mu;
  std::vector<std::thread> churn;
  for (int t = 0; t < 2; ++t) {
    churn.emplace_back([&, t] {
      while (!stop.load()) {
        std::vector<Tensor> made;
        for (int i = 0; i < 200; ++i) {
          made.push_back(Tensor::empty({1 + (i % 3) * 1024}, DType::F32));
          made.push_back(Tensor::empty({1 + i % 40, 7}, DType::U8));  // past a thread's cache
        }
        std::lock_guard<std::mutex> lock(handoff_mu);
        handoff[t] = std::move(handoff[1 - t]);  // dropped here: made on the other thread
        handoff[1 - t] = std::move(made);
        set_allocator_cache_limit(t == 0 ? 0 : size_t{1} << 30);
      }
    });
  }
  int hung = 0;
  for (int f = 0; f < 20; ++f) {
    const pid_t child = fork();
    if (child < 0) {
      ADD_FAILURE() << "fork failed";
      break;
    }
    if (child == 0) {
      alarm(10);  // a child that cannot allocate dies of SIGALRM
      std::vector<Tensor> mine;
      for (int i = 0; i < 500; ++i) {
        mine.push_back(Tensor::full({1 + (i % 5) * 1024}, DType::F32, 1.0));
      }
      mine.push_back(Tensor::full({1000 + f, 3}, DType::F32, 1.0));  // a shape nobody made
      const std::vector<float> last = mine.back().to_vector<float>();
      const bool ok = mine.front().narrow(0, 0, 1).item<float>() == 1.0f &&
                      last.size() == static_cast<size_t>(3 * (1000 + f)) && last.back() == 1.0f;
      _exit(ok ? 0 : 1);
    }
    int status = 0;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
        WEXITSTATUS(status) != 0) {
      ++hung;
    }
  }
  stop = true;
  for (auto& th : churn) th.join();
  EXPECT_EQ(hung, 0) << "forked children that could not allocate";
}

TEST_F(AllocatorTest, LargeBlockIsReusedAfterFree) {
  const size_t n = size_t{1} << 20;
  const AllocatorStats before = allocator_stats();
  void* p = allocate_storage(n);
  free_storage(p, n);
  EXPECT_EQ(allocator_stats().cached_bytes, static_cast<int64_t>(n));
  void* q = allocate_storage(n - 100);  // same page-rounded class
  EXPECT_EQ(q, p);
  const AllocatorStats after = allocator_stats();
  EXPECT_EQ(after.hits - before.hits, 1);
  EXPECT_EQ(after.misses - before.misses, 1);
  EXPECT_EQ(after.cached_bytes, 0);
  free_storage(q, n - 100);
}

TEST_F(AllocatorTest, BlocksBelowAPageAreNotCached) {
  void* p = allocate_storage(4000);
  free_storage(p, 4000);
  EXPECT_EQ(allocator_stats().cached_blocks, 0);
}

// Blocks of a page up to kMinCachedBytes stay with the thread that freed them: that thread gets
// them back, another thread does not, and the bound and empty_storage_cache apply to them.
TEST_F(AllocatorTest, PageBlocksAreCachedByTheThreadThatFreesThem) {
  constexpr size_t n = 3 * 4096;
  const AllocatorStats before = allocator_stats();
  void* p = allocate_storage(n);
  free_storage(p, n);
  EXPECT_EQ(allocator_stats().cached_bytes, static_cast<int64_t>(n));
  EXPECT_EQ(allocator_stats().cached_blocks, 1);
  void* elsewhere = nullptr;
  std::thread([&] {
    elsewhere = allocate_storage(n);
    std::memset(elsewhere, 1, n);
  }).join();
  EXPECT_NE(elsewhere, p);
  void* again = allocate_storage(n - 100);  // the same page-rounded class
  EXPECT_EQ(again, p);
  EXPECT_EQ(allocator_stats().cached_blocks, 0);
  const AllocatorStats after = allocator_stats();
  EXPECT_EQ(after.hits - before.hits, 1);
  EXPECT_EQ(after.misses - before.misses, 2);  // this thread's first and the other thread's
  free_storage(elsewhere, n);  // freed here: now this thread's
  free_storage(again, n);
  EXPECT_EQ(allocator_stats().cached_blocks, 2);
  empty_storage_cache();
  EXPECT_EQ(allocator_stats().cached_blocks, 0);
  EXPECT_EQ(allocator_stats().cached_bytes, 0);
  // A bound smaller than a block keeps none; 0 disables.
  set_allocator_cache_limit(n - 1);
  void* q = allocate_storage(n);
  free_storage(q, n);
  EXPECT_EQ(allocator_stats().cached_blocks, 0);
}

// Page blocks count against the bound with the shared cache's blocks: room for them evicts the
// largest shared blocks, and threads together keep no more than the bound.
TEST_F(AllocatorTest, PageBlocksStayWithinTheBound) {
  constexpr size_t kMiB = size_t{1} << 20, page_block = 60 << 10;
  set_allocator_cache_limit(kMiB);
  void* big = allocate_storage(kMiB);
  free_storage(big, kMiB);
  ASSERT_EQ(allocator_stats().cached_bytes, static_cast<int64_t>(kMiB));
  auto free_sixteen = [] {
    std::vector<void*> blocks;
    for (int i = 0; i < 16; ++i) blocks.push_back(allocate_storage(page_block));
    for (void* p : blocks) free_storage(p, page_block);
  };
  free_sixteen();  // 960 KiB: the 1 MiB shared block makes room
  AllocatorStats s = allocator_stats();
  EXPECT_EQ(s.cached_bytes, static_cast<int64_t>(16 * page_block));
  EXPECT_EQ(s.cached_blocks, 16);
  std::atomic<int> done{0};
  std::atomic<bool> leave{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&] {
      free_sixteen();  // no room left: to the system
      done.fetch_add(1);
      while (!leave.load()) std::this_thread::yield();
    });
  }
  while (done.load() != 3) std::this_thread::yield();
  s = allocator_stats();  // the threads still live, with whatever they kept
  EXPECT_LE(s.cached_bytes, s.limit_bytes);
  leave.store(true);
  for (auto& t : threads) t.join();
  // Emptying gives the room back: a large block is cached again.
  empty_storage_cache();
  void* again = allocate_storage(kMiB);
  free_storage(again, kMiB);
  EXPECT_EQ(allocator_stats().cached_bytes, static_cast<int64_t>(kMiB));
}

// A thread that exits frees the page blocks it kept, and its cache no longer counts.
TEST_F(AllocatorTest, AThreadsPageBlocksGoWhenItExits) {
  std::thread([] {
    void* p = allocate_storage(4096);
    free_storage(p, 4096);
    EXPECT_EQ(allocator_stats().cached_blocks, 1);
  }).join();
  EXPECT_EQ(allocator_stats().cached_blocks, 0);
}

TEST_F(AllocatorTest, DifferentSizeClassIsNotReused) {
  const size_t n = size_t{256} << 10;
  void* p = allocate_storage(n);
  free_storage(p, n);
  void* q = allocate_storage(2 * n);
  EXPECT_NE(q, p);
  EXPECT_EQ(allocator_stats().cached_bytes, static_cast<int64_t>(n));
  free_storage(q, 2 * n);
}

TEST_F(AllocatorTest, BoundEvictsLargestFirst) {
  const size_t small = size_t{128} << 10, big = size_t{1} << 20;
  set_allocator_cache_limit(big + small);
  void* a = allocate_storage(big);
  void* b = allocate_storage(small);
  void* c = allocate_storage(small);
  free_storage(a, big);
  free_storage(b, small);
  EXPECT_EQ(allocator_stats().cached_bytes, static_cast<int64_t>(big + small));
  free_storage(c, small);  // over the bound: the 1 MiB block goes back to the system
  EXPECT_EQ(allocator_stats().cached_bytes, static_cast<int64_t>(2 * small));
  EXPECT_EQ(allocator_stats().cached_blocks, 2);
  // A block larger than the whole bound is never cached.
  void* d = allocate_storage(4 * big);
  free_storage(d, 4 * big);
  EXPECT_EQ(allocator_stats().cached_bytes, static_cast<int64_t>(2 * small));
}

TEST_F(AllocatorTest, ZeroLimitDisablesCaching) {
  set_allocator_cache_limit(0);
  void* p = allocate_storage(size_t{1} << 20);
  free_storage(p, size_t{1} << 20);
  EXPECT_EQ(allocator_stats().cached_blocks, 0);
}

TEST_F(AllocatorTest, EmptyCacheReleasesEverythingAndKeepsTheBound) {
  void* p = allocate_storage(size_t{1} << 20);
  free_storage(p, size_t{1} << 20);
  ASSERT_EQ(allocator_stats().cached_blocks, 1);
  const int64_t limit = allocator_stats().limit_bytes;
  empty_storage_cache();
  EXPECT_EQ(allocator_stats().cached_blocks, 0);
  EXPECT_EQ(allocator_stats().limit_bytes, limit);
}

TEST_F(AllocatorTest, TensorsReuseStorageAcrossIterations) {
  const AllocatorStats before = allocator_stats();
  for (int i = 0; i < 10; ++i) {
    Tensor t = Tensor::full({int64_t{1} << 16}, DType::F32, 1.0 * i);  // 256 KiB
    EXPECT_EQ(t.narrow(0, 123, 1).item<float>(), static_cast<float>(i));
  }
  const AllocatorStats after = allocator_stats();
  EXPECT_EQ(after.misses - before.misses, 1);
  EXPECT_EQ(after.hits - before.hits, 9);
}

TEST_F(AllocatorTest, ConcurrentUseFromManyThreads) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        const size_t n = (size_t{64} << 10) * static_cast<size_t>(1 + (i + t) % 3);
        auto* p = static_cast<unsigned char*>(allocate_storage(n));
        std::memset(p, t, n);
        EXPECT_EQ(p[n - 1], t);
        free_storage(p, n);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(allocator_stats().cached_blocks, 12);
}


// The first byte of each of the 64-byte lines [p, p + bytes) touches.
std::vector<uintptr_t> lines_of(const void* p, size_t bytes) {
  std::vector<uintptr_t> lines;
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t l = a / 64 * 64; l < a + bytes; l += 64) lines.push_back(l);
  return lines;
}

// A tensor's Storage object (its reference counts, written by its owner's thread) lives on
// pages that hold nothing but Storage objects of one thread, each on lines of its own: no
// array that another thread reads through (a rank's list of input pointers, read by its peers)
// shares a page with it, where the reader's prefetcher would pull its lines away.
TEST_F(AllocatorTest, StorageObjectsLiveOnPagesOfTheirOwn) {
  if (kStorageFromSystem) GTEST_SKIP() << kSlotsSkip;
  std::vector<Tensor> tensors;
  std::vector<std::unique_ptr<char[]>> arrays;
  std::vector<std::pair<const void*, size_t>> array_spans;
  // Interleaved, as a rank makes its inputs and posts its lists.
  for (int i = 0; i < 300; ++i) {
    tensors.push_back(Tensor::full({i % 3 == 0 ? 1024 : 3}, DType::F32, 1.0 * i));
    const size_t bytes = 24 + 8 * static_cast<size_t>(i % 50);
    arrays.push_back(std::make_unique<char[]>(bytes));
    array_spans.emplace_back(arrays.back().get(), bytes);
  }
  std::vector<uintptr_t> array_pages;
  for (const auto& [p, bytes] : array_spans) {
    for (uintptr_t l : lines_of(p, bytes)) array_pages.push_back(l / 4096);
  }
  std::sort(array_pages.begin(), array_pages.end());
  std::vector<uintptr_t> storage_lines;
  for (const Tensor& t : tensors) {
    const auto meta = reinterpret_cast<uintptr_t>(t.storage().get());
    EXPECT_FALSE(std::binary_search(array_pages.begin(), array_pages.end(), meta / 4096))
        << "a Storage object shares a page with a malloc'd array";
    const auto data = reinterpret_cast<uintptr_t>(t.const_data_ptr());
    EXPECT_NE(data / 4096, meta / 4096);
    for (uintptr_t l : lines_of(t.storage().get(), sizeof(Storage))) storage_lines.push_back(l);
  }
  // No line holds two Storage objects.
  std::sort(storage_lines.begin(), storage_lines.end());
  EXPECT_EQ(std::adjacent_find(storage_lines.begin(), storage_lines.end()), storage_lines.end());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(tensors[i].narrow(0, 0, 1).item<float>(), static_cast<float>(i));
  }
}

// Two threads that start with no free slots get their Storage objects from slabs of their own:
// no page holds both threads' (each writes its own reference counts).
TEST_F(AllocatorTest, ThreadsStorageObjectsShareNoPage) {
  if (kStorageFromSystem) GTEST_SKIP() << kSlotsSkip;
  // Other tests' threads left free slots in the shared pool: take them all first, so that the
  // two threads below start from new slabs.
  std::vector<Tensor> drained;
  for (int i = 0; i < 20000; ++i) drained.push_back(Tensor::empty({1}, DType::U8));
  std::vector<Tensor> mine[2];
  std::vector<std::thread> threads;
  std::atomic<int> done{0};
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      for (int i = 0; i < 500; ++i) mine[r].push_back(Tensor::empty({16}, DType::F32));
      // Both alive until both are done: a thread that exits gives its free slots to the pool,
      // where the other could take them.
      done.fetch_add(1);
      while (done.load() < 2) std::this_thread::yield();
    });
  }
  for (auto& th : threads) th.join();
  std::vector<uintptr_t> pages[2];
  for (int r = 0; r < 2; ++r) {
    for (const Tensor& t : mine[r]) {
      pages[r].push_back(reinterpret_cast<uintptr_t>(t.storage().get()) / 4096);
    }
    std::sort(pages[r].begin(), pages[r].end());
  }
  std::vector<uintptr_t> shared;
  std::set_intersection(pages[0].begin(), pages[0].end(), pages[1].begin(), pages[1].end(),
                        std::back_inserter(shared));
  EXPECT_TRUE(shared.empty()) << shared.size() << " pages hold both threads' Storage objects";
}

// Storage objects made on one thread and dropped on another (a consumer of results) are reused,
// by the thread that dropped them and, past its bound, by others; the bytes stay each tensor's.
TEST_F(AllocatorTest, StorageObjectsMadeAndDroppedOnDifferentThreads) {
  for (int round = 0; round < 20; ++round) {
    std::vector<Tensor> made;
    std::thread producer([&] {
      for (int i = 0; i < 3000; ++i) made.push_back(Tensor::full({2}, DType::I32, i + round));
    });
    producer.join();
    std::thread consumer([&] {
      for (size_t i = 0; i < made.size(); ++i) {
        ASSERT_EQ(made[i].narrow(0, 1, 1).item<int32_t>(), static_cast<int32_t>(i) + round);
      }
      made.clear();
      // Made here from what the drops left, mixed with the next round's producer's.
      std::vector<Tensor> again;
      for (int i = 0; i < 2500; ++i) again.push_back(Tensor::full({1}, DType::I64, i));
      for (int i = 0; i < 2500; ++i) ASSERT_EQ(again[i].item<int64_t>(), i);
    });
    consumer.join();
  }
}

}  // namespace
}  // namespace funcol
