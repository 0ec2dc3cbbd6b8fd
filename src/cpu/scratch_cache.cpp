// The workspace cache of scratch_cache.hpp.
#include "cpu/scratch_cache.hpp"

#include <cstdlib>
#include <mutex>
#include <vector>

namespace qkv::cpu {
namespace {

// In front of every block: its usable size (16 bytes keep malloc's alignment).
struct alignas(16) Header {
  std::size_t bytes;
};

struct Cache {
  std::mutex mutex;
  std::vector<Header*> blocks;  // oldest first
  std::size_t total = 0;
};

// Never destroyed: worker threads may free their scratch after static destructors ran,
// and the blocks stay reachable (no leak report) until the process ends.
Cache& cache() {
  static Cache* const instance = new Cache;
  return *instance;
}

void* payload(Header* header) { return header + 1; }

}  // namespace

void* scratch_allocate(void*, std::size_t bytes) {
  if (bytes >= kCachedBytes) {
    Cache& c = cache();
    const std::lock_guard<std::mutex> lock(c.mutex);
    std::size_t best = c.blocks.size();
    for (std::size_t i = 0; i < c.blocks.size(); ++i) {
      const std::size_t size = c.blocks[i]->bytes;
      if (size >= bytes && size / 2 <= bytes && (best == c.blocks.size() || size < c.blocks[best]->bytes)) best = i;
    }
    if (best != c.blocks.size()) {
      Header* header = c.blocks[best];
      c.blocks.erase(c.blocks.begin() + static_cast<std::ptrdiff_t>(best));
      c.total -= header->bytes;
      return payload(header);
    }
  }
  auto* header = static_cast<Header*>(std::malloc(sizeof(Header) + bytes));
  if (header == nullptr) return nullptr;
  header->bytes = bytes;
  return payload(header);
}

void scratch_free(void*, void* memory) {
  if (memory == nullptr) return;
  Header* header = static_cast<Header*>(memory) - 1;
  if (header->bytes < kCachedBytes || header->bytes > kCacheCap) {
    std::free(header);
    return;
  }
  Cache& c = cache();
  std::vector<Header*> evicted;
  {
    const std::lock_guard<std::mutex> lock(c.mutex);
    while (!c.blocks.empty() && c.total + header->bytes > kCacheCap) {
      evicted.push_back(c.blocks.front());
      c.total -= c.blocks.front()->bytes;
      c.blocks.erase(c.blocks.begin());
    }
    c.blocks.push_back(header);
    c.total += header->bytes;
  }
  for (Header* old : evicted) std::free(old);
}

std::size_t scratch_cached_bytes() {
  Cache& c = cache();
  const std::lock_guard<std::mutex> lock(c.mutex);
  return c.total;
}

}  // namespace qkv::cpu
