// libFuzzer target for the .npy reader (scripts/fuzz.sh builds and runs it).
//
// Any input must either parse or throw qkv::Error: any other exception, a crash, a leak,
// undefined behaviour (ASan/UBSan) or a hang is a bug. What parses must survive a
// serialize → parse round trip unchanged, and the file reader must agree with the
// in-memory parser on every input.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>

#include "npy.hpp"
#include "qkv/error.hpp"

namespace {

template <class Parse>
auto parse_or_error(Parse&& parse) -> std::optional<decltype(parse())> {
  try {
    return parse();
  } catch (const qkv::Error&) {
    return std::nullopt;
  }
}

template <class T>
bool same(const qkv::npy::Array<T>& a, const qkv::npy::Array<T>& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.data.size() == b.data.size() &&
         (a.data.empty() || std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(T)) == 0);
}

const std::string& scratch_file() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir != nullptr ? dir : "/tmp") + "/qkv_npy_fuzz_" + std::to_string(::getpid()) + ".npy";
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  using namespace qkv::npy;

  const auto floats = parse_or_error([&] { return parse_float32(bytes, "fuzz.npy"); });
  if (floats) {
    const auto again = parse_float32(serialize(floats->shape, floats->data), "again.npy");
    if (!same(*floats, again)) std::abort();
  }
  const auto masks = parse_or_error([&] { return parse_uint8(bytes, "fuzz.npy"); });
  if (masks) {
    const auto again = parse_uint8(serialize(masks->shape, masks->data, masks->dtype), "again.npy");
    if (!same(*masks, again)) std::abort();
  }
  if (floats && masks) std::abort();  // one file cannot be both
  (void)parse_or_error([&] { return parse_header(bytes, "fuzz.npy"); });

  // The file reader (streams, partial reads) must agree with the in-memory parser.
  {
    std::ofstream file(scratch_file(), std::ios::binary | std::ios::trunc);
    file.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  const auto from_file = parse_or_error([&] { return read_float32(scratch_file()); });
  if (from_file.has_value() != floats.has_value()) std::abort();
  if (from_file && !same(*from_file, *floats)) std::abort();
  const auto mask_file = parse_or_error([&] { return read_uint8(scratch_file()); });
  if (mask_file.has_value() != masks.has_value()) std::abort();
  return 0;
}
