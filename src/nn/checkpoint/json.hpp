// The small part of JSON a safetensors header uses: objects, arrays, strings, integers
// (and, for tolerance, other numbers, booleans and null). Parsing is strict (RFC 8259),
// bounded in depth, and throws qkv::Error with the byte offset of the first problem.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::nn::json {

struct Value {
  enum class Kind { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool boolean = false;
  std::string text;             // string contents, or a number's literal
  std::vector<Value> items;     // array
  std::vector<std::pair<std::string, Value>> members;  // object, in file order

  bool is_integer() const;      // a number without fraction or exponent
  int64_t as_int64() const;     // an integer that fits, else qkv::Error
};

// `what` names the input in error messages.
Value parse(std::string_view text, const std::string& what);

// A JSON string literal (with quotes) for `text`, escaping what RFC 8259 requires.
std::string quote(std::string_view text);

}  // namespace qkv::nn::json
