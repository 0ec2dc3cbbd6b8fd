// safetensors: encode/decode in memory, and an atomic file write. The header is JSON,
// parsed and written with nlohmann/json (Debian: nlohmann-json3-dev, header-only).
#include "qkv/nn/safetensors.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_set>
#include <vector>

#include "qkv/error.hpp"

namespace qkv::nn {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; qkv::nn copies it as is");

namespace {

// Read headers go into nlohmann::json (objects are std::maps: members sorted by name, so
// a header of n tensors costs O(n log n) even when it is hostile). Written headers are
// ordered_json, which keeps the tensors in the order given, as the format's writers do.
using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// The reference implementation refuses headers over 100 MB; a larger length field is a
// corrupt file, and checking first avoids a huge allocation.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;
constexpr int kMaxDepth = 64;  // a header nests 3 deep; more means a corrupt file

[[noreturn]] void fail(const std::string& what, const std::string& message) {
  throw Error(what + ": " + message);
}

// nlohmann's message without its "[json.exception.parse_error.101] parse error at line
// 1, column 9: " prefix (we give the byte offset instead), and with bytes that are not
// printable ASCII (the header may be anything) shown as '?'.
std::string library_message(const std::string& message) {
  std::string text = message;
  if (const auto bracket = text.find("] "); text.starts_with("[json.exception.") &&
                                             bracket != std::string::npos) {
    text.erase(0, bracket + 2);
  }
  if (text.starts_with("parse error")) {
    if (const auto colon = text.find(": "); colon != std::string::npos) text.erase(0, colon + 2);
  }
  for (char& c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  }
  return text;
}

// The checks nlohmann/json does not make, as a first SAX pass that keeps no values:
// depth (the library has no limit) and duplicate keys (it keeps the last of two equal
// ones, so a duplicate tensor name would silently hide a tensor). A separate pass,
// because the library's DOM parse with a callback is quadratic in the members of an
// object (each member's end rescans its parent), and headers may hold many tensors.
class HeaderChecks final : public nlohmann::json_sax<Json> {
 public:
  explicit HeaderChecks(std::string invalid) : invalid_(std::move(invalid)) {}

  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    enter();
    keys_.emplace_back();
    return true;
  }
  bool key(string_t& key) override {
    if (!keys_.back().insert(key).second) throw Error(invalid_ + ": duplicate key \"" + key + "\"");
    return true;
  }
  bool end_object() override {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    enter();
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  // Syntax errors and numbers beyond double's range. `position` counts bytes read, so
  // the offending byte's offset (from 0) is one less.
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& e) override {
    throw Error(invalid_ + " at byte " + std::to_string(position > 0 ? position - 1 : 0) + ": " +
                library_message(e.what()));
  }

 private:
  void enter() {
    if (++depth_ > kMaxDepth) throw Error(invalid_ + ": nested too deeply (over 64 levels)");
  }

  std::string invalid_;
  int depth_ = 0;
  std::vector<std::unordered_set<std::string>> keys_;  // the keys seen in each open object
};

// Strict RFC 8259 parsing of the header, errors as qkv::Error naming the byte offset.
// The second parse meets only text the first accepted.
Json parse_header(std::string_view text, const std::string& what) {
  HeaderChecks checks(what + ": invalid JSON header");
  Json::sax_parse(text.begin(), text.end(), &checks);
  return Json::parse(text.begin(), text.end());
}

// A shape entry or data offset: a JSON integer in [0, 2⁶³), else -1.
int64_t non_negative_integer(const Json& value) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    return v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? static_cast<int64_t>(v) : -1;
  }
  if (value.is_number_integer()) return std::max<int64_t>(value.get<int64_t>(), -1);
  return -1;
}

std::string str(int64_t value) { return std::to_string(value); }

Dtype parse_dtype(const std::string& name, const std::string& what, const std::string& tensor) {
  if (name == "F32") return Dtype::f32;
  if (name == "F64") return Dtype::f64;
  if (name == "I64") return Dtype::i64;
  fail(what, "tensor \"" + tensor + "\": dtype \"" + name +
                 "\" is not supported (expected F32, F64 or I64)");
}

template <class T>
constexpr Dtype dtype_of() {
  if constexpr (std::is_same_v<T, float>) return Dtype::f32;
  if constexpr (std::is_same_v<T, double>) return Dtype::f64;
  return Dtype::i64;
}

}  // namespace

std::size_t dtype_size(Dtype dtype) {
  switch (dtype) {
    case Dtype::f32: return 4;
    case Dtype::f64:
    case Dtype::i64: return 8;
  }
  return 0;
}

const char* dtype_name(Dtype dtype) {
  switch (dtype) {
    case Dtype::f32: return "F32";
    case Dtype::f64: return "F64";
    case Dtype::i64: return "I64";
  }
  return "?";
}

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

template <class T>
std::vector<T> SafetensorsTensor::to_vector() const {
  if (dtype != dtype_of<T>()) {
    throw Error("safetensors tensor \"" + name + "\": dtype is " + dtype_name(dtype) +
                ", not " + dtype_name(dtype_of<T>()));
  }
  std::vector<T> values(bytes.size() / sizeof(T));
  if (!bytes.empty()) std::memcpy(values.data(), bytes.data(), values.size() * sizeof(T));
  return values;
}

template <class T>
SafetensorsTensor SafetensorsTensor::from(std::string name, std::vector<int64_t> shape,
                                          std::span<const T> values) {
  SafetensorsTensor tensor;
  tensor.name = std::move(name);
  tensor.dtype = dtype_of<T>();
  tensor.shape = std::move(shape);
  if (tensor.numel() != static_cast<int64_t>(values.size())) {
    throw Error("safetensors tensor \"" + tensor.name + "\": shape holds " +
                str(tensor.numel()) + " elements, got " + str(static_cast<int64_t>(values.size())));
  }
  tensor.bytes.resize(values.size_bytes());
  if (!values.empty()) std::memcpy(tensor.bytes.data(), values.data(), values.size_bytes());
  return tensor;
}

template std::vector<float> SafetensorsTensor::to_vector<float>() const;
template std::vector<double> SafetensorsTensor::to_vector<double>() const;
template std::vector<int64_t> SafetensorsTensor::to_vector<int64_t>() const;
template SafetensorsTensor SafetensorsTensor::from<float>(std::string, std::vector<int64_t>,
                                                          std::span<const float>);
template SafetensorsTensor SafetensorsTensor::from<double>(std::string, std::vector<int64_t>,
                                                           std::span<const double>);
template SafetensorsTensor SafetensorsTensor::from<int64_t>(std::string, std::vector<int64_t>,
                                                            std::span<const int64_t>);

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

std::vector<std::byte> encode_safetensors(const SafetensorsFile& file) {
  OrderedJson header = OrderedJson::object();
  // Members are appended to the object's vector directly: ordered_json's own insertion
  // searches it for the key first, which would make n tensors cost O(n²). Names are
  // checked for duplicates here instead.
  auto& members = header.get_ref<OrderedJson::object_t&>();
  if (!file.metadata.empty()) members.emplace_back("__metadata__", file.metadata);
  std::unordered_set<std::string> names;
  uint64_t offset = 0;
  for (std::size_t i = 0; i < file.tensors.size(); ++i) {
    const auto& tensor = file.tensors[i];
    if (tensor.name.empty() || tensor.name == "__metadata__") {
      throw Error("encode_safetensors: tensor " + std::to_string(i) + ": invalid name \"" +
                  tensor.name + "\"");
    }
    if (!names.insert(tensor.name).second) {
      throw Error("encode_safetensors: duplicate tensor name \"" + tensor.name + "\"");
    }
    for (int64_t extent : tensor.shape) {
      if (extent < 0) throw Error("encode_safetensors: tensor \"" + tensor.name + "\": negative extent");
    }
    const uint64_t size = static_cast<uint64_t>(tensor.numel()) * dtype_size(tensor.dtype);
    if (size != tensor.bytes.size()) {
      throw Error("encode_safetensors: tensor \"" + tensor.name + "\": shape and dtype need " +
                  std::to_string(size) + " bytes, it has " + std::to_string(tensor.bytes.size()));
    }
    members.emplace_back(tensor.name, OrderedJson{{"dtype", dtype_name(tensor.dtype)},
                                                  {"shape", tensor.shape},
                                                  {"data_offsets", {offset, offset + size}}});
    offset += size;
  }
  std::string text;
  try {
    text = header.dump();  // compact, as the reference writer's
  } catch (const OrderedJson::exception& e) {  // a name or metadata string that is not UTF-8
    throw Error("encode_safetensors: " + library_message(e.what()) +
                " (tensor names and metadata must be UTF-8 text)");
  }
  // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
  while ((8 + text.size()) % 8 != 0) text += ' ';

  std::vector<std::byte> bytes(8 + text.size() + offset);
  const uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<std::byte>((length >> (8 * i)) & 0xFF);
  std::memcpy(bytes.data() + 8, text.data(), text.size());
  std::byte* data = bytes.data() + 8 + text.size();
  for (const auto& tensor : file.tensors) {
    if (!tensor.bytes.empty()) std::memcpy(data, tensor.bytes.data(), tensor.bytes.size());
    data += tensor.bytes.size();
  }
  return bytes;
}

SafetensorsFile decode_safetensors(std::span<const std::byte> bytes, const std::string& what) {
  if (bytes.size() < 8) {
    fail(what, "not a safetensors file: " + std::to_string(bytes.size()) +
                   " bytes, shorter than the 8-byte header length");
  }
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  if (length > kMaxHeaderBytes || length > bytes.size() - 8) {
    fail(what, "not a safetensors file or truncated: header length " + std::to_string(length) +
                   " does not fit in the file's " + std::to_string(bytes.size()) + " bytes");
  }
  const std::string_view header_text(reinterpret_cast<const char*>(bytes.data() + 8), length);
  const Json header = parse_header(header_text, what);
  if (!header.is_object()) fail(what, "the header is not a JSON object");

  const std::span<const std::byte> data = bytes.subspan(8 + length);
  SafetensorsFile file;
  struct Range {
    uint64_t begin, end;
    std::size_t tensor;  // index in file.tensors
  };
  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail(what, "__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) fail(what, "__metadata__[\"" + key + "\"] is not a string");
        file.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor \"" + name + "\"";
    if (!entry.is_object()) fail(what, where + " is not an object");
    for (const auto& [key, value] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        fail(what, where + ": unknown field \"" + key + "\"");
      }
    }
    const auto dtype = entry.find("dtype");
    const auto shape = entry.find("shape");
    const auto offsets = entry.find("data_offsets");
    if (dtype == entry.end() || !dtype->is_string()) {
      fail(what, where + ": missing string field \"dtype\"");
    }
    if (shape == entry.end() || !shape->is_array()) {
      fail(what, where + ": missing array field \"shape\"");
    }
    if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2) {
      fail(what, where + ": missing field \"data_offsets\" [begin, end]");
    }
    SafetensorsTensor tensor;
    tensor.name = name;
    tensor.dtype = parse_dtype(dtype->get<std::string>(), what, name);
    uint64_t count = 1;
    for (const Json& extent : *shape) {
      if (!extent.is_number_integer()) fail(what, where + ": shape entries must be integers");
      const int64_t value = non_negative_integer(extent);
      if (value < 0 || (value > 0 && count > (uint64_t{1} << 40) / static_cast<uint64_t>(value))) {
        fail(what, where + ": shape entry " + extent.dump() + " is out of range");
      }
      count *= static_cast<uint64_t>(value);
      tensor.shape.push_back(value);
    }
    for (const Json& offset : *offsets) {
      if (non_negative_integer(offset) < 0) {
        fail(what, where + ": data_offsets must be non-negative integers");
      }
    }
    const auto begin = static_cast<uint64_t>(non_negative_integer((*offsets)[0]));
    const auto end = static_cast<uint64_t>(non_negative_integer((*offsets)[1]));
    if (begin > end || end > data.size()) {
      fail(what, where + ": data_offsets [" + std::to_string(begin) + ", " +
                     std::to_string(end) + "] outside the data section of " +
                     std::to_string(data.size()) + " bytes (truncated file?)");
    }
    if (end - begin != count * dtype_size(tensor.dtype)) {
      fail(what, where + ": data_offsets span " + std::to_string(end - begin) +
                     " bytes, but the shape and dtype need " +
                     std::to_string(count * dtype_size(tensor.dtype)));
    }
    tensor.bytes.assign(data.begin() + static_cast<std::ptrdiff_t>(begin),
                        data.begin() + static_cast<std::ptrdiff_t>(end));
    ranges.push_back({begin, end, file.tensors.size()});
    file.tensors.push_back(std::move(tensor));
  }
  // The tensors must tile the data section exactly: no overlap, no gaps, nothing after.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.tensor < b.tensor;
  });
  uint64_t covered = 0;
  for (const auto& range : ranges) {
    if (range.begin != covered) {
      fail(what, "tensor \"" + file.tensors[range.tensor].name + "\" starts at byte " + std::to_string(range.begin) +
                     " of the data, expected " + std::to_string(covered) +
                     " (overlapping or missing data)");
    }
    covered = range.end;
  }
  if (covered != data.size()) {
    fail(what, std::to_string(data.size() - covered) +
                   " bytes after the last tensor (not a safetensors file, or a corrupt one)");
  }
  // Keep the writer's order: by data offset.
  std::vector<SafetensorsTensor> ordered;
  ordered.reserve(ranges.size());
  for (const auto& range : ranges) ordered.push_back(std::move(file.tensors[range.tensor]));
  file.tensors = std::move(ordered);
  return file;
}

void write_safetensors(const std::filesystem::path& path, const SafetensorsFile& file) {
  const std::vector<std::byte> bytes = encode_safetensors(file);
  const std::string what = "write_safetensors(" + path.string() + ")";
  const std::filesystem::path temporary =
      path.string() + ".tmp-" + std::to_string(static_cast<long>(::getpid()));
  auto system_error = [&](const std::string& step) {
    const std::string reason = std::strerror(errno);
    ::unlink(temporary.c_str());
    fail(what, step + ": " + reason);
  };
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(what, "cannot create " + temporary.string() + ": " + std::strerror(errno));
  std::size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      system_error("writing " + temporary.string());
    }
    written += static_cast<std::size_t>(n);
  }
  // The data must be on disk before the rename makes it the checkpoint.
  if (::fsync(fd) != 0) {
    ::close(fd);
    system_error("fsync " + temporary.string());
  }
  if (::close(fd) != 0) system_error("close " + temporary.string());
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    system_error("rename " + temporary.string() + " → " + path.string());
  }
  // Make the rename itself durable (best effort: some filesystems refuse fsync on a dir).
  const std::filesystem::path directory =
      path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

SafetensorsFile read_safetensors(const std::filesystem::path& path) {
  const std::string what = path.string();
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    fail(what, std::filesystem::exists(path, error) ? "not a regular file" : "no such file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(what, std::string("cannot open: ") + std::strerror(errno));
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) fail(what, "cannot read its size");
  in.seekg(0);
  std::vector<std::byte> bytes(static_cast<std::size_t>(size));
  if (size > 0 && !in.read(reinterpret_cast<char*>(bytes.data()), size)) {
    fail(what, "read failed");
  }
  return decode_safetensors(bytes, what);
}

}  // namespace qkv::nn
