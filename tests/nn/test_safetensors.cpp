// safetensors: a byte-exact layout check, round trips, every corruption the reader must
// catch, and atomic replacement under SIGKILL.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "nn_test_support.hpp"
#include "qkv/error.hpp"
#include "qkv/nn/safetensors.hpp"

namespace qkv::nn {
namespace {

namespace fs = std::filesystem;

std::vector<std::byte> bytes_of(const std::string& text) {
  std::vector<std::byte> out(text.size());
  if (!text.empty()) std::memcpy(out.data(), text.data(), text.size());
  return out;
}

// 8-byte little-endian length + header + data, as the format specifies.
std::vector<std::byte> make_file(const std::string& header, const std::vector<std::byte>& data) {
  std::vector<std::byte> out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>((header.size() >> (8 * i)) & 0xFF);
  const auto h = bytes_of(header);
  out.insert(out.end(), h.begin(), h.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

std::string expect_decode_error(const std::vector<std::byte>& bytes) {
  try {
    decode_safetensors(bytes, "test.safetensors");
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("test.safetensors: ", 0), 0u) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

SafetensorsFile sample() {
  SafetensorsFile file;
  file.metadata = {{"note", "line 1\n\"quoted\" \\ tab\t"}, {"step", "12"}};
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -0.0f};
  const std::vector<double> b = {3.141592653589793};
  const std::vector<int64_t> c = {-1, 1LL << 40};
  file.tensors.push_back(SafetensorsTensor::from<float>("layer.weight", {2, 3}, a));
  file.tensors.push_back(SafetensorsTensor::from<double>("pi", {}, b));
  file.tensors.push_back(SafetensorsTensor::from<int64_t>("ids", {2}, c));
  file.tensors.push_back(SafetensorsTensor::from<float>("empty", {0, 4}, std::vector<float>{}));
  return file;
}

TEST(Safetensors, LayoutIsTheSpecifiedOne) {
  SafetensorsFile file;
  const std::vector<float> x = {1.0f, 2.0f};
  file.tensors.push_back(SafetensorsTensor::from<float>("x", {2}, x));
  const auto bytes = encode_safetensors(file);
  const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  // Padded with spaces to a multiple of 8 after the length field.
  const std::size_t padded = (header.size() + 7) / 8 * 8;
  ASSERT_EQ(bytes.size(), 8 + padded + 8);
  EXPECT_EQ(static_cast<std::size_t>(bytes[0]), padded);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(bytes.data()) + 8, header.size()), header);
  float back[2];
  std::memcpy(back, bytes.data() + 8 + padded, 8);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 2.0f);
}

TEST(Safetensors, RoundTripsThroughAFile) {
  const fs::path path = testing::temp_path("qkv_nn_roundtrip");
  write_safetensors(path, sample());
  const SafetensorsFile back = read_safetensors(path);
  EXPECT_EQ(back.metadata, sample().metadata);
  ASSERT_EQ(back.tensors.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(back.tensors[i].name, sample().tensors[i].name);
    EXPECT_EQ(back.tensors[i].shape, sample().tensors[i].shape);
    EXPECT_EQ(back.tensors[i].bytes, sample().tensors[i].bytes);
  }
  EXPECT_EQ(back.find("pi")->to_vector<double>()[0], 3.141592653589793);
  EXPECT_THROW(back.find("pi")->to_vector<float>(), Error);
  EXPECT_EQ(back.find("nope"), nullptr);
  EXPECT_FALSE(fs::exists(path.string() + ".tmp-" + std::to_string(::getpid())));
  fs::remove(path);
}

TEST(Safetensors, ReadsForeignHeadersWithEscapesAndAnyOrder) {
  // Keys in another order, metadata last, whitespace, a \u escape (é), offsets out of
  // file order: all valid.
  std::vector<std::byte> data(12);
  const float one = 1.0f;
  const double two = 2.0;
  std::memcpy(data.data(), &two, 8);
  std::memcpy(data.data() + 8, &one, 4);
  const std::string header =
      "{ \"b\" : {\"shape\":[1],\"dtype\":\"F32\",\"data_offsets\":[8,12]},\n"
      "  \"a\\u00e9\": {\"data_offsets\":[0,8],\"dtype\":\"F64\",\"shape\":[]},"
      "  \"__metadata__\": {\"k\": \"v\"} }";
  const SafetensorsFile file = decode_safetensors(make_file(header, data));
  ASSERT_EQ(file.tensors.size(), 2u);
  EXPECT_EQ(file.tensors[0].name, "a\xc3\xa9");  // sorted by offset
  EXPECT_EQ(file.tensors[0].to_vector<double>()[0], 2.0);
  EXPECT_EQ(file.tensors[1].to_vector<float>()[0], 1.0f);
  EXPECT_EQ(file.metadata.at("k"), "v");
}

TEST(Safetensors, RejectsEveryKindOfCorruption) {
  const std::vector<std::byte> four(4);
  const std::string ok = R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  EXPECT_NE(expect_decode_error(std::vector<std::byte>(3)).find("shorter than"), std::string::npos);
  auto huge = make_file(ok, four);
  huge[5] = std::byte{1};  // a header length of ~1 TB
  EXPECT_NE(expect_decode_error(huge).find("header length"), std::string::npos);
  auto truncated = make_file(ok, four);
  truncated.pop_back();
  EXPECT_NE(expect_decode_error(truncated).find("outside the data"), std::string::npos);
  auto trailing = make_file(ok, four);
  trailing.push_back(std::byte{0});
  EXPECT_NE(expect_decode_error(trailing).find("after the last tensor"), std::string::npos);
  EXPECT_NE(expect_decode_error(make_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", four))
                .find("invalid JSON"),
            std::string::npos);
  EXPECT_NE(expect_decode_error(make_file(R"({"x":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}})", four))
                .find("BF16"),
            std::string::npos);
  EXPECT_NE(expect_decode_error(make_file(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", four))
                .find("need 8"),
            std::string::npos);
  EXPECT_NE(expect_decode_error(make_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                          R"("y":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                          std::vector<std::byte>(8)))
                .find("overlapping"),
            std::string::npos);
  EXPECT_NE(expect_decode_error(make_file(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                          R"("x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                          std::vector<std::byte>(8)))
                .find("duplicate"),
            std::string::npos);
  EXPECT_NE(expect_decode_error(make_file(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", four))
                .find("out of range"),
            std::string::npos);
  EXPECT_NE(expect_decode_error(make_file(R"([1,2])", {})).find("not a JSON object"), std::string::npos);
  std::string deep(100, '[');
  EXPECT_NE(expect_decode_error(make_file(deep, {})).find("nested too deeply"), std::string::npos);
  EXPECT_THROW(read_safetensors("/nonexistent/qkv.safetensors"), Error);
}

TEST(Safetensors, CorruptHeadersSayWhatIsWrongAndWhere) {
  // The JSON parser is nlohmann/json; what it reports is rewritten to name the file, the
  // byte offset in the header and the problem, without the library's own prefixes.
  const std::vector<std::byte> four(4);
  const struct {
    std::string header, message;
  } cases[] = {
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})",
       "test.safetensors: invalid JSON header at byte 53: syntax error while parsing object - "
       "unexpected end of input; expected '}'"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x)",
       "invalid JSON header at byte 55: syntax error while parsing value - invalid literal"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],}})",
       "invalid JSON header at byte 53: syntax error while parsing object key - unexpected '}'"},
      {R"({"__metadata__":{"k":"a","k":"b"},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "invalid JSON header: duplicate key \"k\""},
      {"{\"x\xff\":{}}", "invalid JSON header at byte 3: syntax error while parsing object key - "
                         "invalid string: ill-formed UTF-8 byte"},
      {R"({"x":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})",
       "invalid JSON header at byte 33: number overflow parsing '1e999'"},  // its last digit
      {R"({"x":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})",
       "tensor \"x\": shape entries must be integers"},
      {R"({"x":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}})",
       "tensor \"x\": shape entry 18446744073709551615 is out of range"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[-1,4]}})",
       "tensor \"x\": data_offsets must be non-negative integers"},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0]}})",
       "tensor \"x\": missing field \"data_offsets\" [begin, end]"},
      {R"({"x":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})",
       "tensor \"x\": missing string field \"dtype\""},
      {R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})",
       "tensor \"x\": unknown field \"extra\""},
      {R"({"x":[1]})", "tensor \"x\" is not an object"},
      {R"({"__metadata__":{"k":1},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "__metadata__[\"k\"] is not a string"},
      {R"({"__metadata__":[]})", "__metadata__ is not an object"},
      {"", "invalid JSON header at byte 0: syntax error while parsing value - unexpected end of input"},
  };
  for (const auto& c : cases) {
    const std::string message = expect_decode_error(make_file(c.header, four));
    EXPECT_NE(message.find(c.message), std::string::npos)
        << "header: " << c.header << "\n  got: " << message << "\n  expected: " << c.message;
    EXPECT_EQ(message.find("json.exception"), std::string::npos) << message;
  }
  // Depth: 64 levels are accepted by the parser (then refused as a header), 65 are not.
  EXPECT_NE(expect_decode_error(make_file(std::string(64, '[') + std::string(64, ']'), {}))
                .find("the header is not a JSON object"),
            std::string::npos);
  EXPECT_NE(expect_decode_error(make_file(std::string(65, '[') + std::string(65, ']'), {}))
                .find("nested too deeply"),
            std::string::npos);
}

TEST(Safetensors, WritesOnlyUtf8NamesAndMetadata) {
  SafetensorsFile file;
  const std::vector<float> one = {1.0f};
  file.tensors.push_back(SafetensorsTensor::from<float>("bad\xff", {1}, one));
  try {
    encode_safetensors(file);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be UTF-8"), std::string::npos) << e.what();
  }
  file.tensors[0].name = "caf\xc3\xa9";  // é in UTF-8: fine, written as is
  file.metadata["control"] = std::string("a\x01" "b");
  const auto bytes = encode_safetensors(file);
  const std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  EXPECT_NE(text.find("\"caf\xc3\xa9\""), std::string::npos);
  EXPECT_NE(text.find(R"("a\u0001b")"), std::string::npos);
  const SafetensorsFile back = decode_safetensors(bytes);
  EXPECT_EQ(back.metadata.at("control"), std::string("a\x01" "b"));
  EXPECT_EQ(back.tensors.at(0).name, "caf\xc3\xa9");
}

TEST(Safetensors, ManyTensorsCostNoQuadraticTime) {
  // 100k tensors: a hostile (or just large) header must not take O(n²) to read or write.
  // Quadratic work here would be ~10¹⁰ string comparisons: minutes, not milliseconds.
  SafetensorsFile file;
  const std::vector<float> one = {1.0f};
  for (int i = 0; i < 100'000; ++i) {
    std::string name = "t";  // (not "t" + ...: GCC 12 warns falsely, -Wrestrict)
    name += std::to_string(i);
    file.tensors.push_back(SafetensorsTensor::from<float>(name, {1}, one));
  }
  const auto start = std::chrono::steady_clock::now();
  const SafetensorsFile back = decode_safetensors(encode_safetensors(file));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(back.tensors.size(), file.tensors.size());
  EXPECT_EQ(back.tensors[99'999].name, "t99999");  // the writer's order, by offset
  EXPECT_LT(seconds, 20.0);  // measured ≈ 0.5 s; generous for loaded machines and ASan
}

TEST(Safetensors, AKilledWriterLeavesTheOldFileIntact) {
  // A child rewrites a large file over and over; the parent SIGKILLs it at several
  // moments, each time mid-way through some write with high likelihood. The file at
  // the path must always be one complete version, never a torn mix.
  const fs::path path = testing::temp_path("qkv_nn_atomic");
  auto version = [](float value) {
    SafetensorsFile file;
    file.metadata["value"] = std::to_string(value);
    const std::vector<float> data(2'000'000, value);  // 8 MB: writing it takes a while
    file.tensors.push_back(SafetensorsTensor::from<float>("data", {2'000'000}, data));
    return file;
  };
  write_safetensors(path, version(0.0f));
  for (int round = 0; round < 4; ++round) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      for (int i = 1;; ++i) write_safetensors(path, version(static_cast<float>(i)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(30 + 40 * round));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    const SafetensorsFile file = read_safetensors(path);  // throws if torn
    const std::vector<float> data = file.tensors.at(0).to_vector<float>();
    EXPECT_EQ(std::to_string(data.front()), file.metadata.at("value"));
    EXPECT_EQ(data.front(), data.back());
    fs::remove(path.string() + ".tmp-" + std::to_string(child));  // what a kill leaves
  }
  fs::remove(path);
}

}  // namespace
}  // namespace qkv::nn
