// .npy reading and writing. The format (numpy/lib/format.py):
//
//   bytes 0–5   magic "\x93NUMPY"
//   bytes 6–7   version major, minor: 1.0 (2-byte header length), 2.0 and 3.0 (4-byte)
//   then        header length HLEN, little-endian
//   then        HLEN bytes: a Python dict literal {'descr': ..., 'fortran_order': ...,
//               'shape': (...), } padded with spaces and ended by '\n'
//   then        the data, numel · item_size bytes, nothing after it
//
// The header is parsed by a small strict parser of exactly that literal (never by an
// evaluator): three known keys, each once; strings in either quote; True/False; a tuple
// of non-negative decimal integers.
#include "npy.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string_view>
#include <utility>

#include "qkv/error.hpp"

namespace qkv::npy {

std::string shape_string(std::span<const int64_t> shape) {
  std::string text = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  if (shape.size() == 1) text += ",";
  return text + ")";
}

namespace {

constexpr std::array<unsigned char, 6> kMagic{0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr std::size_t kPreambleV1 = 10;  // magic, version, uint16 length
constexpr std::size_t kPreambleV2 = 12;  // magic, version, uint32 length
constexpr std::size_t kHeaderAlignment = 64;  // NumPy pads header + preamble to this

[[noreturn]] void fail(const std::string& name, const std::string& what) {
  throw Error("qkv::npy: " + name + ": " + what);
}

// ---- the preamble -----------------------------------------------------------------

struct Preamble {
  std::size_t size = 0;        // bytes before the header text
  std::size_t header_len = 0;  // bytes of header text
};

// Needs the first kPreambleV2 bytes of the file, or all of it if it is shorter.
Preamble parse_preamble(std::span<const std::byte> head, std::uintmax_t file_size,
                        const std::string& name) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(head[i]); };
  if (head.size() < kMagic.size() ||
      !std::equal(kMagic.begin(), kMagic.end(), head.begin(),
                  [](unsigned char m, std::byte b) { return m == static_cast<unsigned char>(b); })) {
    fail(name, "not a .npy file (the first bytes are not the magic \"\\x93NUMPY\")");
  }
  if (head.size() < 8) fail(name, "truncated: the file ends inside the version bytes");
  const unsigned major = byte(6), minor = byte(7);
  if (major < 1 || major > 3 || minor != 0) {
    fail(name, "unsupported .npy format version " + std::to_string(major) + "." +
                   std::to_string(minor) + " (qkv reads 1.0, 2.0 and 3.0)");
  }
  Preamble preamble;
  if (major == 1) {
    if (head.size() < kPreambleV1) fail(name, "truncated: the file ends inside the header length");
    preamble.size = kPreambleV1;
    preamble.header_len = byte(8) | (static_cast<std::size_t>(byte(9)) << 8);
  } else {
    if (head.size() < kPreambleV2) fail(name, "truncated: the file ends inside the header length");
    preamble.size = kPreambleV2;
    preamble.header_len = byte(8) | (static_cast<std::size_t>(byte(9)) << 8) |
                          (static_cast<std::size_t>(byte(10)) << 16) |
                          (static_cast<std::size_t>(byte(11)) << 24);
  }
  if (preamble.header_len > kMaxHeaderBytes) {
    fail(name, "header of " + std::to_string(preamble.header_len) + " bytes is absurdly long (limit " +
                   std::to_string(kMaxHeaderBytes) + ")");
  }
  if (file_size < preamble.size + preamble.header_len) {
    fail(name, "truncated: the header says it is " + std::to_string(preamble.header_len) +
                   " bytes long, the file ends after " +
                   std::to_string(file_size - std::min<std::uintmax_t>(file_size, preamble.size)));
  }
  return preamble;
}

// ---- the header dict ----------------------------------------------------------------

class DictParser {
 public:
  DictParser(std::string_view text, const std::string& name) : text_(text), name_(name) {}

  Header parse() {
    std::optional<std::string> descr;
    std::optional<bool> fortran_order;
    std::optional<std::vector<int64_t>> shape;
    skip_space();
    expect('{');
    skip_space();
    while (peek() != '}') {
      const std::string key = parse_string();
      skip_space();
      expect(':');
      skip_space();
      if (key == "descr") {
        if (descr) syntax("the key 'descr' appears twice");
        if (peek() == '[') fail(name_, "structured dtypes are not supported (qkv reads float32 arrays)");
        descr = parse_string();
      } else if (key == "fortran_order") {
        if (fortran_order) syntax("the key 'fortran_order' appears twice");
        fortran_order = parse_bool();
      } else if (key == "shape") {
        if (shape) syntax("the key 'shape' appears twice");
        shape = parse_shape();
      } else {
        syntax("unexpected key '" + key + "' (a .npy header has 'descr', 'fortran_order', 'shape')");
      }
      skip_space();
      if (peek() == ',') {
        ++pos_;
        skip_space();
      } else if (peek() != '}') {
        syntax("expected ',' or '}'");
      }
    }
    ++pos_;  // '}'
    while (pos_ < text_.size()) {
      if (!is_space(text_[pos_])) syntax("unexpected text after the closing '}'");
      ++pos_;
    }
    if (!descr) syntax("the key 'descr' is missing");
    if (!fortran_order) syntax("the key 'fortran_order' is missing");
    if (!shape) syntax("the key 'shape' is missing");

    Header header;
    header.dtype = parse_descr(*descr);
    if (*fortran_order) {
      fail(name_, "the array is in Fortran order; qkv reads C order (save "
                  "numpy.ascontiguousarray(a) instead)");
    }
    header.shape = std::move(*shape);
    return header;
  }

 private:
  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
  char peek() const {
    if (pos_ >= text_.size()) syntax("the header ends early");
    return text_[pos_];
  }
  void skip_space() {
    while (pos_ < text_.size() && is_space(text_[pos_])) ++pos_;
  }
  void expect(char c) {
    if (peek() != c) syntax(std::string("expected '") + c + "'");
    ++pos_;
  }
  [[noreturn]] void syntax(const std::string& what) const {
    fail(name_, "malformed header at byte " + std::to_string(pos_) + ": " + what);
  }

  std::string parse_string() {
    const char quote = peek();
    if (quote != '\'' && quote != '"') syntax("expected a quoted string");
    ++pos_;
    std::string value;
    while (peek() != quote) {
      const char c = text_[pos_++];
      if (c == '\\' || static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
        syntax("unexpected character in a string");
      }
      value += c;
      if (value.size() > 64) syntax("string too long");
    }
    ++pos_;
    return value;
  }

  bool parse_bool() {
    if (text_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (text_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    syntax("expected True or False");
  }

  std::vector<int64_t> parse_shape() {
    expect('(');
    skip_space();
    std::vector<int64_t> shape;
    bool trailing_comma = false;
    while (peek() != ')') {
      if (static_cast<int>(shape.size()) == kMaxRank) {
        fail(name_, "shape has more than " + std::to_string(kMaxRank) + " dimensions");
      }
      shape.push_back(parse_extent());
      skip_space();
      trailing_comma = false;
      if (peek() == ',') {
        ++pos_;
        trailing_comma = true;
        skip_space();
      } else if (peek() != ')') {
        syntax("expected ',' or ')' in the shape");
      }
    }
    ++pos_;
    if (shape.size() == 1 && !trailing_comma) syntax("a 1-element shape must be written (n,)");
    return shape;
  }

  int64_t parse_extent() {
    if (peek() < '0' || peek() > '9') syntax("expected a non-negative integer in the shape");
    int64_t value = 0;
    constexpr int64_t kLimit = std::numeric_limits<int64_t>::max() / 10 - 9;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      if (value > kLimit) fail(name_, "absurd shape: an extent does not fit in 64 bits");
      value = value * 10 + (text_[pos_] - '0');
      ++pos_;
    }
    return value;
  }

  DType parse_descr(const std::string& descr) const {
    if (descr == "<f4") return DType::float32;
    if (descr == "|u1" || descr == "<u1" || descr == ">u1" || descr == "=u1") return DType::uint8;
    if (descr == "|b1" || descr == "<b1" || descr == ">b1" || descr == "=b1") return DType::bool8;
    if (descr == ">f4") {
      fail(name_, "dtype '>f4' is big-endian float32; qkv reads little-endian '<f4' "
                  "(save a.astype('<f4'))");
    }
    std::string hint;
    if (descr.size() == 3 && (descr[1] == 'f' || descr[1] == 'i' || descr[1] == 'u')) {
      hint = " (convert with a.astype(numpy.float32))";
    }
    fail(name_, "dtype '" + descr + "' is not supported: qkv reads float32 '<f4' (and '|u1' or "
                "'|b1' for boolean masks)" + hint);
  }

  std::string_view text_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

// Product of the extents, with the overflow check that makes absurd shapes an error
// rather than a wrapped-around small size.
int64_t checked_numel(std::span<const int64_t> shape, std::size_t item, const std::string& name) {
  int64_t numel = 1;
  for (int64_t extent : shape) {
    if (extent == 0) return 0;
  }
  const int64_t limit = std::numeric_limits<int64_t>::max() / static_cast<int64_t>(item);
  for (int64_t extent : shape) {
    if (numel > limit / extent) {
      fail(name, "absurd shape " + shape_string(shape) + ": its size does not fit in 64 bits");
    }
    numel *= extent;
  }
  return numel;
}

Header parse_header_text(std::string_view text, const Preamble& preamble,
                         std::uintmax_t file_size, const std::string& name) {
  Header header = DictParser(text, name).parse();
  const std::size_t item = item_size(header.dtype);
  header.numel = checked_numel(header.shape, item, name);
  header.data_offset = preamble.size + preamble.header_len;
  const std::uintmax_t have = file_size - header.data_offset;
  const auto want = static_cast<std::uintmax_t>(header.numel) * item;
  const std::string described = std::string(dtype_name(header.dtype)) + " " +
                                shape_string(header.shape) + " needs " + std::to_string(want) +
                                " bytes of data";
  if (have < want) fail(name, "truncated: " + described + ", the file has " + std::to_string(have));
  if (have > want) {
    fail(name, described + ", but " + std::to_string(have - want) +
                   " more bytes follow it (not a single .npy array?)");
  }
  return header;
}

void check_bools(std::span<const std::uint8_t> data, const std::string& name) {
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (data[i] > 1) {
      fail(name, "bool element " + std::to_string(i) + " is the byte " + std::to_string(data[i]) +
                     ", not 0 or 1");
    }
  }
}

template <class T>
void from_little_endian(std::vector<T>& data) {
  if constexpr (sizeof(T) > 1 && std::endian::native == std::endian::big) {
    for (T& value : data) {
      auto bytes = std::bit_cast<std::array<unsigned char, sizeof(T)>>(value);
      std::reverse(bytes.begin(), bytes.end());
      value = std::bit_cast<T>(bytes);
    }
  }
}

template <class T>
Array<T> parse_array(std::span<const std::byte> file, Header header) {
  Array<T> array;
  array.dtype = header.dtype;
  array.shape = std::move(header.shape);
  array.data.resize(static_cast<std::size_t>(header.numel));
  if (!array.data.empty()) {  // memcpy from/to the null pointer of an empty vector is UB
    std::memcpy(array.data.data(), file.data() + header.data_offset, array.data.size() * sizeof(T));
  }
  from_little_endian(array.data);
  return array;
}

// ---- files --------------------------------------------------------------------------

std::string path_name(const std::filesystem::path& path) { return path.string(); }

std::ifstream open_for_reading(const std::filesystem::path& path, std::uintmax_t& size) {
  const std::string name = path_name(path);
  std::error_code error;
  const auto status = std::filesystem::status(path, error);
  if (error || !std::filesystem::exists(status)) fail(name, "no such file");
  if (std::filesystem::is_directory(status)) fail(name, "is a directory, not a .npy file");
  std::ifstream stream(path, std::ios::binary);
  if (!stream) fail(name, std::string("cannot open: ") + std::strerror(errno));
  stream.seekg(0, std::ios::end);
  const auto end = stream.tellg();
  if (end < 0) fail(name, "cannot determine the file size (not a regular file?)");
  size = static_cast<std::uintmax_t>(end);
  stream.seekg(0);
  return stream;
}

void read_exactly(std::ifstream& stream, void* into, std::size_t bytes, const std::string& name) {
  if (bytes == 0) return;
  stream.read(static_cast<char*>(into), static_cast<std::streamsize>(bytes));
  if (static_cast<std::size_t>(stream.gcount()) != bytes) {
    fail(name, "read error (the file changed while it was read?)");
  }
}

Header read_header_from(std::ifstream& stream, std::uintmax_t size, const std::string& name) {
  std::array<std::byte, kPreambleV2> head{};
  const std::size_t head_size = static_cast<std::size_t>(std::min<std::uintmax_t>(size, head.size()));
  read_exactly(stream, head.data(), head_size, name);
  const Preamble preamble = parse_preamble(std::span(head.data(), head_size), size, name);
  std::string text(preamble.header_len, '\0');
  stream.seekg(static_cast<std::streamoff>(preamble.size));
  read_exactly(stream, text.data(), text.size(), name);
  return parse_header_text(text, preamble, size, name);
}

template <class T>
Array<T> read_array(const std::filesystem::path& path, bool want_float) {
  const std::string name = path_name(path);
  std::uintmax_t size = 0;
  std::ifstream stream = open_for_reading(path, size);
  Header header = read_header_from(stream, size, name);
  if (want_float != (header.dtype == DType::float32)) {
    fail(name, std::string("dtype ") + dtype_name(header.dtype) + " where " +
                   (want_float ? "float32 ('<f4')" : "a boolean mask (bool '|b1' or uint8 '|u1')") +
                   " is expected");
  }
  Array<T> array;
  array.dtype = header.dtype;
  array.shape = std::move(header.shape);
  array.data.resize(static_cast<std::size_t>(header.numel));
  stream.seekg(static_cast<std::streamoff>(header.data_offset));
  read_exactly(stream, array.data.data(), array.data.size() * sizeof(T), name);
  from_little_endian(array.data);
  return array;
}

std::vector<std::byte> serialize_bytes(std::span<const int64_t> shape, const void* data,
                                       std::size_t count, DType dtype) {
  if (static_cast<int>(shape.size()) > kMaxRank) {
    throw Error("qkv::npy::serialize: shape has " + std::to_string(shape.size()) +
                " dimensions, more than " + std::to_string(kMaxRank));
  }
  for (int64_t extent : shape) {
    if (extent < 0) throw Error("qkv::npy::serialize: shape " + shape_string(shape) + " has a negative extent");
  }
  const int64_t numel = checked_numel(shape, item_size(dtype), "qkv::npy::serialize");
  if (static_cast<std::uintmax_t>(numel) != count) {
    throw Error("qkv::npy::serialize: data: expected " + std::to_string(numel) +
                " elements (shape " + shape_string(shape) + "), got " + std::to_string(count));
  }
  const char* descr = dtype == DType::float32 ? "<f4" : dtype == DType::uint8 ? "|u1" : "|b1";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " +
                       shape_string(shape) + ", }";
  // Pad with spaces so that preamble + header + '\n' is a multiple of 64 bytes. With at
  // most kMaxRank extents the header stays far below format 1.0's 65535-byte limit.
  constexpr std::size_t preamble = kPreambleV1;
  const std::size_t unpadded = preamble + header.size() + 1;
  header.append((kHeaderAlignment - unpadded % kHeaderAlignment) % kHeaderAlignment, ' ');
  header += '\n';

  const std::size_t data_bytes = count * item_size(dtype);
  std::vector<std::byte> file(preamble + header.size() + data_bytes);
  for (std::size_t i = 0; i < kMagic.size(); ++i) file[i] = std::byte{kMagic[i]};
  file[6] = std::byte{1};
  file[7] = std::byte{0};
  std::size_t length = header.size();
  for (std::size_t i = 8; i < preamble; ++i, length >>= 8) file[i] = std::byte(length & 0xff);
  std::memcpy(file.data() + preamble, header.data(), header.size());
  std::byte* out = file.data() + preamble + header.size();
  if (data_bytes > 0) std::memcpy(out, data, data_bytes);
  if (dtype == DType::float32 && std::endian::native == std::endian::big) {
    for (std::size_t i = 0; i < count; ++i) std::reverse(out + 4 * i, out + 4 * i + 4);
  }
  return file;
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::float32:
      return "float32";
    case DType::uint8:
      return "uint8";
    case DType::bool8:
      return "bool";
  }
  return "?";
}

std::size_t item_size(DType dtype) { return dtype == DType::float32 ? 4 : 1; }

Header parse_header(std::span<const std::byte> file, const std::string& name) {
  const Preamble preamble =
      parse_preamble(file.first(std::min(file.size(), kPreambleV2)), file.size(), name);
  const std::string_view text(reinterpret_cast<const char*>(file.data() + preamble.size),
                              preamble.header_len);
  return parse_header_text(text, preamble, file.size(), name);
}

Array<float> parse_float32(std::span<const std::byte> file, const std::string& name) {
  Header header = parse_header(file, name);
  if (header.dtype != DType::float32) {
    fail(name, std::string("dtype ") + dtype_name(header.dtype) + " where float32 ('<f4') is expected");
  }
  return parse_array<float>(file, std::move(header));
}

Array<std::uint8_t> parse_uint8(std::span<const std::byte> file, const std::string& name) {
  Header header = parse_header(file, name);
  if (header.dtype == DType::float32) {
    fail(name, "dtype float32 where a boolean mask (bool '|b1' or uint8 '|u1') is expected");
  }
  Array<std::uint8_t> array = parse_array<std::uint8_t>(file, std::move(header));
  if (array.dtype == DType::bool8) check_bools(array.data, name);
  return array;
}

Header read_header(const std::filesystem::path& path) {
  std::uintmax_t size = 0;
  std::ifstream stream = open_for_reading(path, size);
  return read_header_from(stream, size, path_name(path));
}

Array<float> read_float32(const std::filesystem::path& path) {
  return read_array<float>(path, true);
}

Array<std::uint8_t> read_uint8(const std::filesystem::path& path) {
  Array<std::uint8_t> array = read_array<std::uint8_t>(path, false);
  if (array.dtype == DType::bool8) check_bools(array.data, path_name(path));
  return array;
}

std::vector<std::byte> serialize(std::span<const int64_t> shape, std::span<const float> data) {
  return serialize_bytes(shape, data.data(), data.size(), DType::float32);
}

std::vector<std::byte> serialize(std::span<const int64_t> shape,
                                 std::span<const std::uint8_t> data, DType dtype) {
  if (dtype == DType::float32) {
    throw Error("qkv::npy::serialize: dtype: expected uint8 or bool for uint8 data, got float32");
  }
  if (dtype == DType::bool8) check_bools(data, "qkv::npy::serialize data");
  return serialize_bytes(shape, data.data(), data.size(), dtype);
}

// ---- atomic writes ------------------------------------------------------------------

StagedWrite::StagedWrite(std::filesystem::path target, std::span<const std::byte> bytes)
    : target_(std::move(target)) {
  const std::string name = path_name(target_);
  if (target_.filename().empty()) fail(name, "not a file name");
  std::error_code error;
  if (std::filesystem::is_directory(target_, error)) fail(name, "is a directory");
  // A name next to the target, so the final rename stays within one file system.
  std::random_device entropy;
  int fd = -1;
  for (int attempt = 0; attempt < 100 && fd < 0; ++attempt) {
    std::ostringstream suffix;
    suffix << ".tmp-" << ::getpid() << "-" << std::hex << entropy();
    temporary_ = target_;
    temporary_ += suffix.str();
    // 0666 less the umask: the permissions numpy.save's files get.
    fd = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno != EEXIST) {
      const int code = errno;
      temporary_.clear();
      fail(name, std::string("cannot create a file next to it: ") + std::strerror(code));
    }
  }
  if (fd < 0) {
    temporary_.clear();
    fail(name, "cannot find a free temporary name next to it");
  }
  std::size_t written = 0;
  int code = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      code = errno;
      break;
    }
    written += static_cast<std::size_t>(n);
  }
  if (code == 0 && ::fsync(fd) != 0) code = errno;
  if (::close(fd) != 0 && code == 0) code = errno;
  if (code != 0) {
    discard();
    fail(name, std::string("write failed: ") + std::strerror(code));
  }
}

StagedWrite::StagedWrite(StagedWrite&& other) noexcept
    : target_(std::move(other.target_)), temporary_(std::exchange(other.temporary_, {})) {}

StagedWrite& StagedWrite::operator=(StagedWrite&& other) noexcept {
  if (this != &other) {
    discard();
    target_ = std::move(other.target_);
    temporary_ = std::exchange(other.temporary_, {});
  }
  return *this;
}

StagedWrite::~StagedWrite() { discard(); }

void StagedWrite::discard() noexcept {
  if (!temporary_.empty()) {
    ::unlink(temporary_.c_str());
    temporary_.clear();
  }
}

void StagedWrite::commit() {
  if (temporary_.empty()) fail(path_name(target_), "already committed or discarded");
  if (std::rename(temporary_.c_str(), target_.c_str()) != 0) {
    const int code = errno;
    discard();
    fail(path_name(target_), std::string("cannot move the written file into place: ") +
                                 std::strerror(code));
  }
  temporary_.clear();
}

void write(const std::filesystem::path& path, std::span<const int64_t> shape,
           std::span<const float> data) {
  StagedWrite(path, serialize(shape, data)).commit();
}

void write(const std::filesystem::path& path, std::span<const int64_t> shape,
           std::span<const std::uint8_t> data, DType dtype) {
  StagedWrite(path, serialize(shape, data, dtype)).commit();
}

}  // namespace qkv::npy
