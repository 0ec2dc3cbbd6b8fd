// Large per-call workspaces kept between calls. A kernel's scratch of a few MiB (the
// backward's packed Q and dO, the forward's packed K and V) taken from malloc is mapped
// fresh by each call and freed back to the OS after it (glibc maps blocks above 128 KiB
// on their own), so every call paid a page fault per 4 KiB touched: ~9% of the bf16
// backward's samples in the kernel's page-fault path, and the backward 47 → 37 ms with
// glibc told to keep the memory (N 1024, 8 heads, d 128, Emerald Rapids, thread CPU time).
// Blocks of at least kCachedBytes (64 KiB; glibc's own threshold starts at 128 KiB) go back
// to a process-wide cache instead (best fit within 2× of the request; at most kCacheCap
// bytes kept, oldest given back first); smaller ones are plain malloc/free. (Raising
// glibc's M_MMAP_THRESHOLD would do the same for the whole process, which a library must
// not decide.) Thread-safe: a mutex per allocation and release of a large block, a few per
// call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "qkv/error.hpp"

namespace qkv::cpu {

inline constexpr std::size_t kCachedBytes = std::size_t{64} << 10;
inline constexpr std::size_t kCacheCap = std::size_t{256} << 20;

// hwy::AllocPtr / hwy::FreePtr (opaque unused): for hwy::AllocateAligned.
void* scratch_allocate(void* opaque, std::size_t bytes);
void scratch_free(void* opaque, void* memory);

// Bytes the cache holds now (tests).
std::size_t scratch_cached_bytes();

// An array of 32-bit words (packed pairs) from the cache: what std::vector<uint32_t> was for
// the per-call packings, minus the page faults. Contents undefined until written (assign
// fills, as std::vector's does).
class ScratchWords {
 public:
  ScratchWords() = default;
  explicit ScratchWords(std::size_t count) { reset(count); }

  void assign(std::size_t count, std::uint32_t value) {
    reset(count);
    std::fill(data(), data() + count, value);
  }
  std::uint32_t* data() { return words_.get(); }
  const std::uint32_t* data() const { return words_.get(); }
  std::size_t size() const { return size_; }

 private:
  struct Release {
    void operator()(std::uint32_t* words) const { scratch_free(nullptr, words); }
  };
  void reset(std::size_t count) {
    words_.reset();
    size_ = 0;
    if (count == 0) return;
    auto* memory = static_cast<std::uint32_t*>(scratch_allocate(nullptr, count * sizeof(std::uint32_t)));
    if (memory == nullptr)  // before any output is written: the entry points pack first
      throw Error("qkv: a workspace of " + std::to_string(count) + " words could not be allocated (out of memory)");
    words_.reset(memory);
    size_ = count;
  }
  std::unique_ptr<std::uint32_t[], Release> words_;
  std::size_t size_ = 0;
};

}  // namespace qkv::cpu
