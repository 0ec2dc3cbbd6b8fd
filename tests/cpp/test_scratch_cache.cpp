// The workspace cache (cpu/scratch_cache.hpp): a large block comes back to the next call
// that fits it, small ones and oversized ones go straight back to malloc, the cache never
// holds more than its cap, and ScratchWords behaves as the std::vector it replaced.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu/scratch_cache.hpp"

namespace qkv {
namespace {

using cpu::kCacheCap;
using cpu::kCachedBytes;
using cpu::scratch_allocate;
using cpu::scratch_cached_bytes;
using cpu::scratch_free;

// (Other tests' calls in the same process — the whole binary run at once — may have left
// blocks in the cache: the request may then be served by one of them, up to 2× its size,
// which is what the cache holds again once it is freed.)
TEST(ScratchCache, ALargeBlockIsReusedByTheNextRequestItFits) {
  const std::size_t bytes = 3 * kCachedBytes + 4242;
  void* first = scratch_allocate(nullptr, bytes);
  ASSERT_NE(first, nullptr);
  std::memset(first, 1, bytes);  // usable in full
  const std::size_t before = scratch_cached_bytes();
  scratch_free(nullptr, first);
  EXPECT_GE(scratch_cached_bytes(), before + bytes);
  EXPECT_LE(scratch_cached_bytes(), before + 2 * bytes);
  void* again = scratch_allocate(nullptr, bytes);
  EXPECT_EQ(again, first);
  EXPECT_EQ(scratch_cached_bytes(), before);
  scratch_free(nullptr, again);
  void* tiny = scratch_allocate(nullptr, bytes / 3 - 1);  // under half of it: never that block
  EXPECT_NE(tiny, first);
  scratch_free(nullptr, tiny);
}

TEST(ScratchCache, SmallAndOversizedBlocksAreNotKept) {
  const std::size_t before = scratch_cached_bytes();
  scratch_free(nullptr, scratch_allocate(nullptr, kCachedBytes - 1));
  EXPECT_EQ(scratch_cached_bytes(), before);
  void* huge = scratch_allocate(nullptr, kCacheCap + 1);
  ASSERT_NE(huge, nullptr);
  scratch_free(nullptr, huge);
  EXPECT_EQ(scratch_cached_bytes(), before);
  scratch_free(nullptr, nullptr);  // a no-op, as free(nullptr)
}

TEST(ScratchCache, NeverHoldsMoreThanItsCap) {
  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(scratch_allocate(nullptr, kCacheCap / 4 + static_cast<std::size_t>(i)));
  for (void* block : blocks) {
    ASSERT_NE(block, nullptr);
    scratch_free(nullptr, block);
    EXPECT_LE(scratch_cached_bytes(), kCacheCap);
  }
}

TEST(ScratchCache, ThreadsTakeAndGiveBack) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) {
        const std::size_t bytes = kCachedBytes * static_cast<std::size_t>(1 + (i + t) % 5);
        auto* block = static_cast<unsigned char*>(scratch_allocate(nullptr, bytes));
        ASSERT_NE(block, nullptr);
        block[0] = block[bytes - 1] = static_cast<unsigned char>(t);
        EXPECT_EQ(block[0], block[bytes - 1]);
        scratch_free(nullptr, block);
      }
    });
  for (std::thread& thread : threads) thread.join();
  EXPECT_LE(scratch_cached_bytes(), kCacheCap);
}

TEST(ScratchCache, ScratchWordsAssignsLikeAVector) {
  cpu::ScratchWords words;
  EXPECT_EQ(words.data(), nullptr);
  EXPECT_EQ(words.size(), 0u);
  words.assign(kCachedBytes, 7u);  // a cached size
  ASSERT_EQ(words.size(), kCachedBytes);
  for (std::size_t i = 0; i < words.size(); i += 997) ASSERT_EQ(words.data()[i], 7u);
  EXPECT_EQ(words.data()[words.size() - 1], 7u);
  words.assign(0, 1u);
  EXPECT_EQ(words.data(), nullptr);
}

}  // namespace
}  // namespace qkv
