// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0), for `qkv run`
// (a CLI library, qkv_npy: not part of qkv::qkv or its installed headers).
//
// qkv reads exactly what its attention functions take: little-endian float32 ('<f4')
// arrays, and uint8 ('|u1') or bool ('|b1') arrays for boolean masks, in C order. Reading
// is strict, because a silently misread tensor is worse than an error: bad magic, an
// unsupported version, a malformed header, another dtype, Fortran order, a shape that is
// not a tuple of non-negative integers or whose size overflows, data shorter or longer
// than the shape promises, and bool bytes other than 0 and 1 each throw qkv::Error with a
// message that names the file (or the name given for an in-memory buffer).
//
// Writing produces the same bytes as numpy.save for a C-ordered array of that dtype and
// shape, and is atomic: the bytes go to a temporary file next to the target, which is
// renamed over the target only once everything is written (StagedWrite lets a caller
// stage several files and commit them together after all of them were written).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace qkv::npy {

enum class DType {
  float32,  // '<f4'
  uint8,    // '|u1'
  bool8,    // '|b1', one byte per element, 0 or 1
};

// The dtype's name as NumPy spells it ("float32", "uint8", "bool").
const char* dtype_name(DType dtype);

// NumPy's own limit on the number of dimensions (NPY_MAXDIMS in NumPy 1.x).
inline constexpr int kMaxRank = 32;
// Headers longer than this are refused (NumPy refuses 10000 by default; format 1.0
// cannot describe more than 65535).
inline constexpr std::size_t kMaxHeaderBytes = 65535;

// What a .npy header says: dtype, shape, and where the data starts.
struct Header {
  DType dtype = DType::float32;
  std::vector<int64_t> shape;  // empty: a 0-d array holding one element
  int64_t numel = 1;           // product of shape
  std::size_t data_offset = 0;  // bytes from the start of the file to the first element
};

// Bytes per element: 4 for float32, 1 for uint8 and bool.
std::size_t item_size(DType dtype);

// A shape as NumPy writes it in a header (and `qkv run` in its messages): "(2, 3)",
// "(5,)", "()".
std::string shape_string(std::span<const int64_t> shape);

// A whole array in C order. T is float for '<f4' and std::uint8_t for '|u1' and '|b1'.
template <class T>
struct Array {
  DType dtype = DType::float32;
  std::vector<int64_t> shape;
  std::vector<T> data;  // numel() elements, C order

  int64_t numel() const { return static_cast<int64_t>(data.size()); }
};

// Parses and checks the header of a file (data not read; sizes checked against the file).
Header read_header(const std::filesystem::path& path);

// Reads a '<f4' array.
Array<float> read_float32(const std::filesystem::path& path);
// Reads a '|u1' or '|b1' array (bool bytes must be 0 or 1).
Array<std::uint8_t> read_uint8(const std::filesystem::path& path);

// The same, from a complete file image in memory; `name` stands for the file in errors.
Header parse_header(std::span<const std::byte> file, const std::string& name);
Array<float> parse_float32(std::span<const std::byte> file, const std::string& name);
Array<std::uint8_t> parse_uint8(std::span<const std::byte> file, const std::string& name);

// The complete file image of an array: header (padded to a multiple of 64 bytes, as
// NumPy writes it) followed by the data. data.size() must equal the product of shape.
std::vector<std::byte> serialize(std::span<const int64_t> shape, std::span<const float> data);
std::vector<std::byte> serialize(std::span<const int64_t> shape,
                                 std::span<const std::uint8_t> data, DType dtype);

// A file written to a temporary next to its target and not yet in place. commit()
// renames it over the target (atomic on POSIX file systems); destroying a StagedWrite
// that was not committed removes the temporary, so an error leaves no trace.
class StagedWrite {
 public:
  StagedWrite(std::filesystem::path target, std::span<const std::byte> bytes);
  StagedWrite(StagedWrite&& other) noexcept;
  StagedWrite& operator=(StagedWrite&& other) noexcept;
  StagedWrite(const StagedWrite&) = delete;
  StagedWrite& operator=(const StagedWrite&) = delete;
  ~StagedWrite();

  void commit();
  const std::filesystem::path& target() const { return target_; }

 private:
  void discard() noexcept;
  std::filesystem::path target_;
  std::filesystem::path temporary_;
};

// serialize + StagedWrite + commit.
void write(const std::filesystem::path& path, std::span<const int64_t> shape,
           std::span<const float> data);
void write(const std::filesystem::path& path, std::span<const int64_t> shape,
           std::span<const std::uint8_t> data, DType dtype = DType::uint8);

}  // namespace qkv::npy
