// A refused FUNCOL_ALLOC_CACHE_MB (this test runs with FUNCOL_ALLOC_CACHE_MB=abc, set by ctest;
// a process of its own, as the cache reads the variable once): every allocation of a page or
// more throws until the program sets a bound, and nothing else does. Before, a page-sized
// tensor was allocated and its free threw from a destructor (std::terminate), and every other
// allocator call threw, set_allocator_cache_limit too, so a program could not override it.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "funcol/core/allocator.h"
#include "funcol/core/error.h"
#include "funcol/core/tensor.h"

namespace funcol {
namespace {

TEST(AllocatorEnvRefused, PageAllocationsThrowUntilTheProgramSetsABound) {
  const char* env = std::getenv("FUNCOL_ALLOC_CACHE_MB");
  if (env == nullptr || std::string(env) != "abc") {
    GTEST_SKIP() << "needs FUNCOL_ALLOC_CACHE_MB=abc (ctest sets it)";
  }
  EXPECT_NO_THROW((void)Tensor::zeros({16}, DType::F32));  // under a page: malloc's
  for (const int64_t n : {int64_t{1024}, int64_t{1} << 20}) {  // a page's block, a cached one
    try {
      (void)Tensor::zeros({n}, DType::F32);
      ADD_FAILURE() << n << " floats were allocated";
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(std::string(e.what()),
                "FUNCOL_ALLOC_CACHE_MB=abc: expected a whole number of megabytes (0 or more)");
    }
  }
  EXPECT_NO_THROW((void)allocator_stats());
  EXPECT_NO_THROW(empty_storage_cache());
  set_allocator_cache_limit(size_t{8} << 20);
  EXPECT_EQ(allocator_stats().limit_bytes, int64_t{8} << 20);
  for (const int64_t n : {int64_t{1024}, int64_t{1} << 20}) {
    const Tensor t = Tensor::full({n}, DType::F32, 2);
    EXPECT_EQ(t.to_vector<float>().back(), 2.0f);
  }
}

}  // namespace
}  // namespace funcol
