// Support for bench/bitwise_digest: one printed line of 64-bit hashes per case, and the
// sections' entry points. Inputs come from bench_inputs.hpp.
#pragma once

#include <qkv/qkv.hpp>

#include "bench_inputs.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace digest {

using namespace qkv_bench;  // NOLINT(google-build-using-namespace)

// The thread count every call asks for (--threads; results must not depend on it).
inline int threads = 1;

inline std::uint64_t fnv1a(const void* data, std::size_t bytes,
                           std::uint64_t hash = 0xCBF29CE484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001B3ull;
  return hash;
}

// Each case's inputs are seeded by its name.
inline std::uint64_t seed_of(const std::string& name) { return fnv1a(name.data(), name.size()); }

// One output line: the case name, then name=hash per output (FNV-1a of its bytes).
class Line {
 public:
  explicit Line(std::string name) : text_(std::move(name)) {}
  void print() const { std::printf("%s\n", text_.c_str()); }

  Line& add(const char* what, const void* data, std::size_t bytes) {
    char hex[40];
    std::snprintf(hex, sizeof hex, " %s=%016llx", what,
                  static_cast<unsigned long long>(fnv1a(data, bytes)));
    text_ += hex;
    return *this;
  }
  template <class T, int R>
  Line& add(const char* what, const qkv::Tensor<T, R>& t) {
    add(what, t.data(), t.size() * sizeof(T));
    return note(t.data(), t.size());
  }
  template <class T>
  Line& add(const char* what, const std::vector<T>& v) {
    add(what, v.data(), v.size() * sizeof(T));
    return note(v.data(), v.size());
  }
  // For the reader, not the comparison: NaN elements (a NaN output hides arithmetic
  // changes behind one payload) and elements still 777 (left unwritten).
  template <class T>
  Line& note(const T* data, std::size_t n) {
    if constexpr (!std::is_integral_v<T>) {
      std::size_t nan = 0, unwritten = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float x = static_cast<float>(data[i]);
        nan += x != x ? 1 : 0;
        unwritten += x == 777.0f ? 1 : 0;
      }
      if (nan > 0) text_ += "(nan:" + std::to_string(nan) + ")";
      if (unwritten > 0) text_ += "(unwritten:" + std::to_string(unwritten) + ")";
    }
    return *this;
  }
  Line& add_hash(const char* what, std::uint64_t hash) {
    char hex[40];
    std::snprintf(hex, sizeof hex, " %s=%016llx", what, static_cast<unsigned long long>(hash));
    text_ += hex;
    return *this;
  }

 private:
  std::string text_;
};

// Sections (bitwise_digest_decode.cpp holds the decode ones).
void dense_cases();
void mask_cases();
void varlen_cases();
void variant_cases();
void half_cases();
void decode_cases();
void cache_cases();
void small_call_cases();

}  // namespace digest
