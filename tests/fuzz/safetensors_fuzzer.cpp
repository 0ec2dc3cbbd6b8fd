// libFuzzer target for the safetensors reader (scripts/fuzz.sh builds and runs it).
//
// Any input must either decode or throw qkv::Error: any other exception (nlohmann/json's
// own included), a crash, a leak, undefined behaviour (ASan/UBSan) or a hang is a bug.
// What decodes must survive an encode → decode round trip unchanged, and the file reader
// must agree with the in-memory decoder on every input.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <span>
#include <string>

#include "qkv/error.hpp"
#include "qkv/nn/safetensors.hpp"

namespace {

using qkv::nn::SafetensorsFile;

template <class Decode>
std::optional<SafetensorsFile> decode_or_error(Decode&& decode) {
  try {
    return decode();
  } catch (const qkv::Error&) {
    return std::nullopt;
  }
}

bool same(const SafetensorsFile& a, const SafetensorsFile& b) {
  if (a.metadata != b.metadata || a.tensors.size() != b.tensors.size()) return false;
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const auto &x = a.tensors[i], &y = b.tensors[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.bytes != y.bytes) {
      return false;
    }
  }
  return true;
}

const std::string& scratch_file() {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir != nullptr ? dir : "/tmp") + "/qkv_safetensors_fuzz_" +
           std::to_string(::getpid()) + ".safetensors";
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const auto file = decode_or_error([&] { return qkv::nn::decode_safetensors(bytes, "fuzz"); });
  if (file) {
    bool writable = true;  // the writer refuses an empty tensor name; the reader takes it
    for (const auto& tensor : file->tensors) writable = writable && !tensor.name.empty();
    if (writable) {
      const auto encoded = qkv::nn::encode_safetensors(*file);  // must not throw
      if (!same(*file, qkv::nn::decode_safetensors(encoded, "again"))) std::abort();
    }
  }
  {
    std::ofstream out(scratch_file(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  const auto from_file = decode_or_error([&] { return qkv::nn::read_safetensors(scratch_file()); });
  if (from_file.has_value() != file.has_value()) std::abort();
  if (from_file && !same(*from_file, *file)) std::abort();
  return 0;
}
