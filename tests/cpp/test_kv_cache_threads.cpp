// qkv::KVCache from several threads (the documented contract in qkv/kv_cache.hpp): four
// threads appending to (and resetting) their own sequences of one cache while another
// attends keep the books balanced (blocks in use + free == pool, no block held twice) and
// every sequence reads back exactly its own keys. And sizes that overflow or cannot be
// allocated are refused with qkv::Error naming the config.
#include <gtest/gtest.h>

#include <qkv/kv_cache.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"

namespace qkv {
namespace {

constexpr int64_t kThreads = 4, kCapacity = 3000, kDim = 4;

// The key that sequence `seq` holds at position `pos`, in every column (exact in float).
float key_value(int64_t seq, int64_t pos, int64_t column) {
  return static_cast<float>(seq * 4096 + pos) + 0.25f * static_cast<float>(column);
}

// Appends to `seq` in chunks of 1..3 tokens until full, resetting once half-way (so that
// blocks go back to the pool while the other threads take them), then fills it again.
// The keys are made up front, so the threads spend their time in append itself.
void fill_sequence(KVCache& cache, int64_t seq, std::atomic<int>& ready) {
  Tensor<float, 4> keys({1, kCapacity, 1, kDim});
  for (int64_t pos = 0; pos < kCapacity; ++pos)
    for (int64_t c = 0; c < kDim; ++c) keys(0, pos, 0, c) = key_value(seq, pos, c);
  const std::vector<int64_t> seqs{seq};
  ++ready;
  while (ready.load() < kThreads) {
  }
  for (int pass = 0; pass < 2; ++pass) {
    int64_t length = 0;
    const int64_t target = pass == 0 ? kCapacity / 2 : kCapacity;
    for (int64_t step = 0; length < target; ++step) {
      const int64_t tokens = std::min<int64_t>(1 + (step + seq) % 3, target - length);
      const auto chunk = View4<const float>::contiguous(&keys(0, length, 0, 0), {1, tokens, 1, kDim});
      cache.append(chunk, chunk, seqs);
      length += tokens;
    }
    if (pass == 0) cache.reset(seq);
  }
}

void check_books_and_contents(const KVCache& cache) {
  const KVCacheConfig& c = cache.config();
  const DecodeArgs<float> args = cache.views<float>();
  std::set<int32_t> held;
  int64_t in_use = 0;
  for (int64_t seq = 0; seq < c.batch; ++seq) {
    ASSERT_EQ(cache.lengths()[static_cast<std::size_t>(seq)], kCapacity) << "sequence " << seq;
    for (int64_t pos = 0; pos < kCapacity; ++pos) {
      int64_t slot = seq, row = pos;
      if (c.paged) {
        const int32_t block = args.block_table(seq, pos / c.block_size);
        ASSERT_GE(block, 0) << "sequence " << seq << " position " << pos;
        if (pos % c.block_size == 0) {
          EXPECT_TRUE(held.insert(block).second) << "block " << block << " held twice";
          ++in_use;
        }
        slot = block, row = pos % c.block_size;
      }
      for (int64_t col = 0; col < kDim; ++col) {
        ASSERT_EQ(args.k_cache(slot, row, 0, col), key_value(seq, pos, col)) << "sequence " << seq << " key " << pos;
        ASSERT_EQ(args.v_cache(slot, row, 0, col), key_value(seq, pos, col)) << "sequence " << seq << " value " << pos;
      }
    }
  }
  if (c.paged) {
    EXPECT_EQ(in_use + cache.free_blocks(), c.num_blocks);
  }
}

void run_threads(KVCache& cache) {
  std::atomic<bool> done{false};
  std::atomic<int64_t> attends{0};
  std::string reader_error;
  // A reader beside the writers: attend may run concurrently with appends (it waits for
  // each), and must never fail or see a half-done append.
  std::thread reader([&] {
    const auto q = test::random_tensor<float, 4>({kThreads, 1, 1, kDim}, 7);
    Tensor<float, 4> out({kThreads, 1, 1, kDim});
    while (!done.load()) {
      try {
        AttentionOptions options;
        options.causal = Causal::none;
        (void)cache.free_blocks();
        cache.attend(q.cview(), out.view(), {}, options);
        ++attends;
      } catch (const Error& e) {
        reader_error = e.what();
        break;
      }
    }
  });
  std::vector<std::thread> writers;
  std::atomic<int> ready{0};  // the writers start together
  for (int64_t seq = 0; seq < kThreads; ++seq)
    writers.emplace_back([&cache, &ready, seq] { fill_sequence(cache, seq, ready); });
  for (std::thread& t : writers) t.join();
  done = true;
  reader.join();
  EXPECT_EQ(reader_error, "");
}

TEST(KVCacheThreads, PagedAppendsFromFourThreadsKeepTheBooks) {
  // Block size 1: every append takes blocks, so the threads contend for the pool.
  KVCache cache({.batch = kThreads, .capacity = kCapacity, .kv_heads = 1, .head_dim = kDim, .paged = true,
                 .block_size = 1});
  for (int round = 0; round < 6; ++round) {
    run_threads(cache);
    check_books_and_contents(cache);
    cache.reset();
    EXPECT_EQ(cache.free_blocks(), cache.config().num_blocks);
  }
}

TEST(KVCacheThreads, ContiguousAppendsFromFourThreadsStayApart) {
  KVCache cache({.batch = kThreads, .capacity = kCapacity, .kv_heads = 1, .head_dim = kDim});
  run_threads(cache);
  check_books_and_contents(cache);
}

void expect_error(const std::function<void()>& call, const std::vector<std::string>& needles) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning " << needles.front();
  } catch (const Error& e) {
    for (const std::string& needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(KVCacheSizes, OverflowingSizesAreRefused) {
  // 2^62 + 1 keys of 4 floats: the byte count used to wrap to 16 and the first append
  // wrote past the buffer.
  expect_error([] { KVCache({.capacity = (int64_t{1} << 62) + 1, .head_dim = 4}); },
               {"qkv::KVCache", "config.capacity (4611686018427387905)", "config.head_dim (4)"});
  constexpr int64_t kHuge = int64_t{1} << 20;
  expect_error([] { KVCache({.batch = kHuge, .capacity = kHuge, .kv_heads = kHuge, .head_dim = kHuge}); },
               {"qkv::KVCache", "overflows a 64-bit size", "config.batch"});
  // A capacity near INT64_MAX: ⌈capacity / block_size⌉ must not wrap either.
  expect_error([] { KVCache({.capacity = INT64_MAX, .head_dim = 1, .paged = true}); }, {"config.num_blocks"});
}

TEST(KVCacheSizes, AnAllocationThatCannotBeMadeIsAnError) {
#ifdef QKV_TEST_SMALL
  GTEST_SKIP() << "the sanitizers' allocator aborts on a request this size instead of failing it";
#else
  // Sizes beyond every x86-64 address space, 5-level paging's 57 bits (128 PiB) included:
  // on a 57-bit machine with overcommit a 4 PiB request succeeds, and filling a 4 TiB
  // block table then runs until the OOM killer ends the test (seen on a 16-core Xeon VM).
  // 2^60 floats (4 EiB) of keys:
  expect_error([] { KVCache({.capacity = int64_t{1} << 40, .head_dim = int64_t{1} << 20}); },
               {"qkv::KVCache: the key storage of 4611686018427387904 bytes could not be allocated"});
  // A small pool but a block table of 2^58 entries (1 EiB).
  constexpr int64_t kHuge = int64_t{1} << 29;
  expect_error(
      [] {
        KVCache({.batch = kHuge, .capacity = kHuge, .kv_heads = 1, .head_dim = 1, .paged = true,
                 .block_size = 1, .num_blocks = 1});
      },
      {"qkv::KVCache: the block table of 1152921504606846976 bytes could not be allocated"});
#endif
}

}  // namespace
}  // namespace qkv
