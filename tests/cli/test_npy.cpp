// The .npy reader and writer: files NumPy wrote (tests/cli/data, made by numpy.save and
// numpy.lib.format.write_array), byte-exact headers, and every way a file can be wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "cli_test_support.hpp"
#include "npy.hpp"
#include "qkv/error.hpp"

namespace qkv::npy {
namespace {

using cli::test::ScratchDir;

std::string data(const std::string& name) { return std::string(QKV_CLI_TEST_DATA) + "/" + name; }

std::vector<std::byte> bytes_of(const std::string& text) {
  std::vector<std::byte> bytes(text.size());
  if (!text.empty()) std::memcpy(bytes.data(), text.data(), text.size());
  return bytes;
}

// A v1.0 file image with the given header text (padded like NumPy's) and data bytes.
std::vector<std::byte> image(const std::string& header, const std::string& payload,
                             char major = 1) {
  std::string text = "\x93NUMPY";
  text += major;
  text += '\0';
  std::string padded = header;
  const std::size_t preamble = major == 1 ? 10 : 12;
  while ((preamble + padded.size() + 1) % 64 != 0) padded += ' ';
  padded += '\n';
  const std::size_t n = padded.size();
  text += static_cast<char>(n & 0xff);
  text += static_cast<char>((n >> 8) & 0xff);
  if (major != 1) text += std::string(2, '\0');
  return bytes_of(text + padded + payload);
}

std::string floats(std::initializer_list<float> values) {
  std::string out;
  for (float v : values) out.append(reinterpret_cast<const char*>(&v), 4);
  return out;
}

// Expects qkv::Error whose message names `name` and contains `fragment`.
template <class F>
void expect_error(F&& call, const std::string& name, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing: " << fragment;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(name), std::string::npos) << message;
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
  }
}

TEST(Npy, ReadsWhatNumpyWrote) {
  const Array<float> a = read_float32(data("f4_2x3.npy"));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data, (std::vector<float>{-2.5f, -1.5f, -0.5f, 0.5f, 1.5f, 2.5f}));

  const Array<float> scalar = read_float32(data("f4_scalar.npy"));
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.data, std::vector<float>{7.25f});

  const Array<float> empty = read_float32(data("f4_empty_0x4.npy"));
  EXPECT_EQ(empty.shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(empty.data.empty());

  const Array<float> v2 = read_float32(data("f4_v2_2x2.npy"));
  EXPECT_EQ(v2.data, (std::vector<float>{1, 2, 3, 4}));
  const Array<float> v3 = read_float32(data("f4_v3_2.npy"));
  EXPECT_EQ(v3.data, (std::vector<float>{0.5f, -0.5f}));

  const Array<std::uint8_t> tril = read_uint8(data("b1_tril_3x3.npy"));
  EXPECT_EQ(tril.dtype, DType::bool8);
  EXPECT_EQ(tril.data, (std::vector<std::uint8_t>{1, 0, 0, 1, 1, 0, 1, 1, 1}));
  const Array<std::uint8_t> u1 = read_uint8(data("u1_4.npy"));
  EXPECT_EQ(u1.dtype, DType::uint8);
  EXPECT_EQ(u1.data, (std::vector<std::uint8_t>{0, 1, 2, 255}));

  const Header header = read_header(data("f4_2x3.npy"));
  EXPECT_EQ(header.numel, 6);
  EXPECT_EQ(header.data_offset, 128u);
}

TEST(Npy, RejectsWhatQkvDoesNotRead) {
  expect_error([] { read_float32(data("f8_2.npy")); }, "f8_2.npy", "'<f8' is not supported");
  expect_error([] { read_float32(data("f8_2.npy")); }, "f8_2.npy", "astype(numpy.float32)");
  expect_error([] { read_float32(data("f4_fortran_2x3.npy")); }, "f4_fortran_2x3.npy", "Fortran order");
  expect_error([] { read_float32(data("f4_bigendian_3.npy")); }, "f4_bigendian_3.npy", "big-endian");
  expect_error([] { read_float32(data("b1_tril_3x3.npy")); }, "b1_tril_3x3.npy", "dtype bool where float32");
  expect_error([] { read_uint8(data("f4_2x3.npy")); }, "f4_2x3.npy", "boolean mask");
  expect_error([] { read_float32(data("no_such_file.npy")); }, "no_such_file.npy", "no such file");
  expect_error([] { read_float32(QKV_CLI_TEST_DATA); }, "data", "is a directory");
}

TEST(Npy, WritesTheBytesNumpyWrites) {
  const std::vector<int64_t> shape{2, 3};
  const std::vector<float> values{-2.5f, -1.5f, -0.5f, 0.5f, 1.5f, 2.5f};
  const std::vector<std::byte> ours = serialize(shape, values);
  const std::string numpy = cli::test::read_text(data("f4_2x3.npy"));
  ASSERT_EQ(ours.size(), numpy.size());
  EXPECT_EQ(std::memcmp(ours.data(), numpy.data(), numpy.size()), 0);

  const std::vector<std::uint8_t> tril{1, 0, 0, 1, 1, 0, 1, 1, 1};
  const std::vector<int64_t> square{3, 3};
  const std::vector<std::byte> mask = serialize(square, tril, DType::bool8);
  const std::string numpy_mask = cli::test::read_text(data("b1_tril_3x3.npy"));
  ASSERT_EQ(mask.size(), numpy_mask.size());
  EXPECT_EQ(std::memcmp(mask.data(), numpy_mask.data(), mask.size()), 0);

  const std::vector<int64_t> none;
  const std::vector<float> one{7.25f};
  const std::vector<std::byte> scalar = serialize(none, one);
  const std::string numpy_scalar = cli::test::read_text(data("f4_scalar.npy"));
  ASSERT_EQ(scalar.size(), numpy_scalar.size());
  EXPECT_EQ(std::memcmp(scalar.data(), numpy_scalar.data(), scalar.size()), 0);
}

TEST(Npy, RoundTripsEveryBitAndShape) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special{0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                                   std::numeric_limits<float>::denorm_min(), 1e38f, -3.0f};
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{8}, {2, 4}, {1, 2, 1, 4}, {2, 2, 2}, {1, 1, 1, 1, 1, 8}}) {
    const auto file = serialize(shape, special);
    EXPECT_EQ(file.size() % 64, special.size() * 4 % 64);  // header padded to 64 bytes
    const Array<float> back = parse_float32(file, "mem");
    EXPECT_EQ(back.shape, shape);
    ASSERT_EQ(back.data.size(), special.size());
    EXPECT_EQ(std::memcmp(back.data.data(), special.data(), special.size() * 4), 0);
  }
  const std::vector<int64_t> zero{3, 0, 2};
  EXPECT_TRUE(parse_float32(serialize(zero, std::vector<float>{}), "mem").data.empty());
}

TEST(Npy, StrictAboutEveryMalformedFile) {
  const std::string ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  const std::string two = floats({1.0f, 2.0f});
  // Sanity: the well-formed image parses, in v1 and v2, with either quote and key order.
  EXPECT_EQ(parse_float32(image(ok, two), "x.npy").data.size(), 2u);
  EXPECT_EQ(parse_float32(image(ok, two, 2), "x.npy").data.size(), 2u);
  EXPECT_EQ(parse_float32(image("{\"shape\": (2,), \"fortran_order\": False, \"descr\": \"<f4\"}", two), "x.npy")
                .data.size(),
            2u);

  struct Case {
    std::vector<std::byte> file;
    std::string fragment;
  };
  const auto header = [&](const std::string& h) { return image(h, two); };
  std::vector<Case> cases{
      {bytes_of(""), "not a .npy file"},
      {bytes_of("\x93NUMP"), "not a .npy file"},
      {bytes_of("PK\x03\x04 this is a zip"), "not a .npy file"},
      {bytes_of("\x93NUMPY\x01"), "truncated"},
      {bytes_of(std::string("\x93NUMPY\x01\x00\x10", 9)), "truncated"},
      {bytes_of(std::string("\x93NUMPY\x04\x00\x10\x00", 10)), "unsupported .npy format version 4.0"},
      {bytes_of(std::string("\x93NUMPY\x01\x00\xff\x00{}", 12)), "truncated: the header says it is 255 bytes"},
      {bytes_of(std::string("\x93NUMPY\x02\x00\x00\x00\x10\x00", 12)), "absurdly long"},
      {header("['descr', '<f4']"), "expected '{'"},
      {header("{'descr': '<f4', 'fortran_order': False}"), "'shape' is missing"},
      {header("{'descr': '<f4', 'shape': (2,)}"), "'fortran_order' is missing"},
      {header("{'fortran_order': False, 'shape': (2,)}"), "'descr' is missing"},
      {header("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}"), "appears twice"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}"), "unexpected key 'extra'"},
      {header("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}"), "expected True or False"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (2)}"), "(n,)"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': [2]}"), "expected '('"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,)}"), "non-negative integer"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,)}"), "expected ',' or ')'"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} trailing"), "after the closing"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)"), "the header ends early"},
      {header("{'descr': '<f4 , 'fortran_order': False, 'shape': (2,)}"), "expected ',' or '}'"},
      {header("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}"), "structured dtypes"},
      {header("{'descr': '<i4', 'fortran_order': False, 'shape': (2,)}"), "'<i4' is not supported"},
      {header("{'descr': '<f2', 'fortran_order': False, 'shape': (2,)}"), "'<f2' is not supported"},
      {header("{'descr': 'O', 'fortran_order': False, 'shape': (2,)}"), "'O' is not supported"},
      {header("{'descr': '<f4', 'fortran_order': True, 'shape': (2,)}"), "Fortran order"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}"), "does not fit in 64 bits"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296)}"), "absurd shape"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,)}"), "truncated: float32 (1099511627776,) needs 4398046511104 bytes"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (3,)}"), "truncated"},
      {header("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)}"), "4 more bytes follow it"},
  };
  std::string rank33 = "(";
  for (int i = 0; i < 33; ++i) rank33 += "1, ";
  cases.push_back({header("{'descr': '<f4', 'fortran_order': False, 'shape': " + rank33 + ")}"),
                   "more than 32 dimensions"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.fragment);
    expect_error([&] { parse_float32(c.file, "bad.npy"); }, "bad.npy", c.fragment);
  }
  // Bool bytes must be 0 or 1.
  expect_error([] {
    parse_uint8(image("{'descr': '|b1', 'fortran_order': False, 'shape': (3,)}", std::string("\x01\x02\x00", 3)),
                "mask.npy");
  }, "mask.npy", "bool element 1 is the byte 2");
}

TEST(Npy, WritesAtomicallyAndLeavesNoTrace) {
  ScratchDir dir;
  const std::vector<int64_t> shape{2};
  const std::vector<float> first{1, 2}, second{3, 4};
  write(dir / "a.npy", shape, first);
  EXPECT_EQ(read_float32(dir / "a.npy").data, first);
  write(dir / "a.npy", shape, second);  // replaces
  EXPECT_EQ(read_float32(dir / "a.npy").data, second);
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"a.npy"});

  {  // staged, never committed: neither the target nor a temporary remains
    StagedWrite staged(dir / "b.npy", serialize(shape, first));
    EXPECT_FALSE(std::filesystem::exists(dir / "b.npy"));
  }
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"a.npy"});

  {  // committed: appears whole
    StagedWrite staged(dir / "b.npy", serialize(shape, first));
    staged.commit();
    EXPECT_THROW(staged.commit(), Error);
  }
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{"a.npy", "b.npy"}));

  expect_error([&] { write(dir / "missing/c.npy", shape, first); }, "missing/c.npy", "cannot create");
  expect_error([&] { write(dir.path().string(), shape, first); }, dir.path().string(), "is a directory");
  expect_error([&] { write(dir / "d.npy", shape, std::vector<float>{1, 2, 3}); }, "serialize", "expected 2 elements");
  const std::vector<int64_t> negative{-1};
  expect_error([&] { write(dir / "d.npy", negative, std::vector<float>{}); }, "serialize", "negative extent");
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{"a.npy", "b.npy"}));
}

}  // namespace
}  // namespace qkv::npy
