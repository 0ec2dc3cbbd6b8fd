// Checked size arithmetic (src/core/checked_size.hpp) and where it guards: products of
// caller-supplied extents that would wrap, or allocations that cannot be made, become a
// qkv::Error naming the factors instead of a wrapped, tiny buffer or a std::bad_alloc.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "core/checked_size.hpp"
#include "core/attention_rules.hpp"
#include "core/tile_plan.hpp"

namespace qkv {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

std::string message_of(auto&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CheckedSize, ProductsThatFitAreExact) {
  EXPECT_EQ(detail::checked_product("f", "x", {{"a", 3}, {"b", 5}, {"c", 7}}), 105);
  EXPECT_EQ(detail::checked_product("f", "x", {{"a", kMax}, {"b", 1}}), kMax);
  // A zero factor makes the product 0 even where the others alone would overflow.
  EXPECT_EQ(detail::checked_product("f", "x", {{"a", kMax}, {"b", kMax}, {"c", 0}}), 0);
  EXPECT_EQ(detail::checked_bytes("f", "x", {{"a", 3}, {"b", 5}}, 4), 60u);
}

TEST(CheckedSize, OverflowNamesTheFunctionAndTheFactors) {
  const std::string m = message_of([] {
    (void)detail::checked_product("qkv::f", "the storage", {{"config.capacity", (int64_t{1} << 62) + 1}, {"d", 4}});
  });
  EXPECT_EQ(m, "qkv::f: the storage = config.capacity (4611686018427387905) x d (4) overflows a 64-bit size");
  // Fits int64 as a count, not as bytes.
  EXPECT_NE(message_of([] { (void)detail::checked_bytes("qkv::f", "x", {{"n", kMax / 2}}, 4); })
                .find("elements of 4 bytes exceed"),
            std::string::npos);
  EXPECT_NE(message_of([] { (void)detail::checked_sum("qkv::f", "x", {"a", kMax}, {"b", 1}); }).find("overflows"),
            std::string::npos);
}

TEST(CheckedSize, CeilDivDoesNotWrapNearTheTop) {
  EXPECT_EQ(detail::ceil_div(0, 16), 0);
  EXPECT_EQ(detail::ceil_div(1, 16), 1);
  EXPECT_EQ(detail::ceil_div(32, 16), 2);
  EXPECT_EQ(detail::ceil_div(kMax, 16), kMax / 16 + 1);
}

TEST(CheckedSize, FailedAllocationBecomesAnError) {
  const std::string m = message_of([] {
    detail::allocate_or_throw("qkv::f", "the workspace", 123, []() -> int { throw std::bad_alloc(); });
  });
  EXPECT_EQ(m, "qkv::f: the workspace of 123 bytes could not be allocated (out of memory)");
}

TEST(CheckedSize, TilePlanRefusesAPlanWhoseSizeWraps) {
  // 2^40 entries × 2^25 × 2^25 tiles of 64 × 64: no such plan fits in 64 bits.
  detail::MaskRule rule;
  rule.sequences = {.count = int64_t{1} << 40, .dense_q_len = detail::kMaxRows, .dense_k_len = detail::kMaxRows};
  const detail::Extents e{.batch = int64_t{1} << 40, .q_len = detail::kMaxRows, .k_len = detail::kMaxRows,
                          .q_heads = 1, .kv_heads = 1, .head_dim = 8, .v_dim = 8};
  const std::string m = message_of([&] { const detail::TilePlan plan(rule, e, 64, 64, 1); });
  EXPECT_NE(m.find("tile plan"), std::string::npos) << m;
  EXPECT_NE(m.find("overflows"), std::string::npos) << m;
}

}  // namespace
}  // namespace qkv
