// Size arithmetic on caller-supplied numbers that cannot wrap: a product of extents (or
// its byte count) either fits in int64 / size_t or throws qkv::Error naming the function
// and the factors, so that an absurd size is refused instead of allocating a wrapped,
// tiny buffer and writing past it. And an allocation that cannot be satisfied becomes a
// qkv::Error, never a std::bad_alloc escaping to the caller as a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "qkv/error.hpp"

namespace qkv::detail {

// One factor of a size: its name (as the caller knows it, "config.capacity") and value.
struct SizeFactor {
  std::string_view name;
  int64_t value;
};

namespace checked_size_detail {

inline std::string describe_factors(std::initializer_list<SizeFactor> factors) {
  std::string text;
  for (const SizeFactor& f : factors) {
    if (!text.empty()) text += " x ";
    text += std::string(f.name) + " (" + std::to_string(f.value) + ")";
  }
  return text;
}

}  // namespace checked_size_detail

// The product of non-negative factors, or qkv::Error "<fn>: <what> = a (..) x b (..)
// overflows int64" when it does not fit. A negative factor is an internal error: the
// callers check signs first, with their own wording.
inline int64_t checked_product(std::string_view fn, std::string_view what, std::initializer_list<SizeFactor> factors) {
  int64_t product = 1;
  bool overflow = false;
  for (const SizeFactor& f : factors) {
    if (f.value < 0) throw Error(std::string(fn) + ": internal error: negative size factor " + std::string(f.name));
    int64_t next = 0;
    overflow = overflow || __builtin_mul_overflow(product, f.value, &next);
    product = next;
  }
  // A zero factor makes the product 0 whatever overflowed before it.
  for (const SizeFactor& f : factors) {
    if (f.value == 0) return 0;
  }
  if (overflow)
    throw Error(std::string(fn) + ": " + std::string(what) + " = " + checked_size_detail::describe_factors(factors) +
                " overflows a 64-bit size");
  return product;
}

// The bytes of `element_bytes`-byte elements counted by the factors, checked as above and
// refused past `limit` bytes (default: what a signed 64-bit size holds, so that pointer
// differences over the buffer cannot wrap either).
inline std::size_t checked_bytes(std::string_view fn, std::string_view what, std::initializer_list<SizeFactor> factors,
                                 std::size_t element_bytes,
                                 std::size_t limit = static_cast<std::size_t>(std::numeric_limits<int64_t>::max())) {
  const int64_t count = checked_product(fn, what, factors);
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(static_cast<std::size_t>(count), element_bytes, &bytes) || bytes > limit)
    throw Error(std::string(fn) + ": " + std::string(what) + " = " + checked_size_detail::describe_factors(factors) +
                " elements of " + std::to_string(element_bytes) + " bytes exceed " + std::to_string(limit) + " bytes");
  return bytes;
}

// a + b for non-negative sizes, or qkv::Error naming both.
inline int64_t checked_sum(std::string_view fn, std::string_view what, SizeFactor a, SizeFactor b) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a.value, b.value, &sum))
    throw Error(std::string(fn) + ": " + std::string(what) + " = " + std::string(a.name) + " (" +
                std::to_string(a.value) + ") + " + std::string(b.name) + " (" + std::to_string(b.value) +
                ") overflows a 64-bit size");
  return sum;
}

// ⌈value / divisor⌉ for value ≥ 0, divisor ≥ 1, without the (value + divisor − 1) that
// wraps for a value near INT64_MAX.
constexpr int64_t ceil_div(int64_t value, int64_t divisor) {
  return value == 0 ? 0 : (value - 1) / divisor + 1;
}

// Runs `make` (which allocates) and turns std::bad_alloc into qkv::Error "<fn>: <what>
// of <bytes> bytes could not be allocated": an unsatisfiable request is a bad argument
// the caller can handle, like every other.
template <class Make>
auto allocate_or_throw(std::string_view fn, std::string_view what, std::size_t bytes, Make&& make) {
  try {
    return std::forward<Make>(make)();
  } catch (const std::bad_alloc&) {
    throw Error(std::string(fn) + ": " + std::string(what) + " of " + std::to_string(bytes) +
                " bytes could not be allocated (out of memory)");
  } catch (const std::length_error&) {  // a std::vector longer than its max_size()
    throw Error(std::string(fn) + ": " + std::string(what) + " of " + std::to_string(bytes) +
                " bytes exceeds what a vector can hold");
  }
}

}  // namespace qkv::detail
