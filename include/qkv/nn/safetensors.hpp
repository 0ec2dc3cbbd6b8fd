// Reading and writing the safetensors format (https://huggingface.co/docs/safetensors):
//
//   bytes 0..8      N, the header's length, unsigned 64-bit little-endian
//   bytes 8..8+N    UTF-8 JSON object:
//                     "<tensor name>": {"dtype": "F32"|"F64"|"I64", "shape": [..],
//                                       "data_offsets": [begin, end]}   (into the data)
//                     "__metadata__": {"<key>": "<string value>", ...}   (optional)
//   then the data   every tensor's elements, C order, little-endian, back to back
//
// Files written here are read by the `safetensors` Python package and vice versa.
// Writing is atomic: the bytes go to "<path>.tmp-<pid>" in the same directory, are
// flushed to disk, and the temporary is then renamed over `path`; a process killed
// mid-write leaves the old file intact. Reading checks everything (header length and
// JSON, dtypes, shapes against byte ranges, ranges inside the file and not overlapping,
// no bytes left over) and throws qkv::Error naming the file and what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace qkv::nn {

enum class Dtype { f32, f64, i64 };

std::size_t dtype_size(Dtype dtype);
const char* dtype_name(Dtype dtype);  // "F32", "F64", "I64"

struct SafetensorsTensor {
  std::string name;
  Dtype dtype = Dtype::f32;
  std::vector<int64_t> shape;
  std::vector<std::byte> bytes;  // little-endian elements, C order

  int64_t numel() const;
  // Copies the elements out; the type must match dtype, else qkv::Error.
  template <class T>
  std::vector<T> to_vector() const;
  // Copies `values` in and sets dtype (float → F32, double → F64, int64_t → I64).
  template <class T>
  static SafetensorsTensor from(std::string name, std::vector<int64_t> shape,
                                std::span<const T> values);
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsTensor> tensors;  // written in this order

  // nullptr if absent.
  const SafetensorsTensor* find(const std::string& name) const;
};

void write_safetensors(const std::filesystem::path& path, const SafetensorsFile& file);
SafetensorsFile read_safetensors(const std::filesystem::path& path);

// The same, in memory (tests and tools).
std::vector<std::byte> encode_safetensors(const SafetensorsFile& file);
SafetensorsFile decode_safetensors(std::span<const std::byte> bytes,
                                   const std::string& what = "safetensors data");

}  // namespace qkv::nn
