// A strict recursive-descent JSON parser, enough for safetensors headers.
#include "checkpoint/json.hpp"

#include <charconv>
#include <string>

#include "qkv/error.hpp"

namespace qkv::nn::json {
namespace {

constexpr int kMaxDepth = 64;  // a header nests 3 deep; more means a corrupt file

class Parser {
 public:
  Parser(std::string_view text, const std::string& what) : text_(text), what_(what) {}

  Value document() {
    Value value = parse_value(0);
    skip_space();
    if (pos_ != text_.size()) fail("unexpected characters after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    throw Error(what_ + ": invalid JSON header at byte " + std::to_string(pos_) + ": " + message);
  }

  void skip_space() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
            text_[pos_] == '\r')) {
      ++pos_;
    }
  }

  char peek() {
    if (pos_ >= text_.size()) fail("unexpected end");
    return text_[pos_];
  }

  void expect_char(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "', got '" + text_[pos_] + "'");
    ++pos_;
  }

  void expect_word(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail("unknown literal");
    pos_ += word.size();
  }

  Value parse_value(int depth) {
    if (depth > kMaxDepth) fail("nested too deeply");
    skip_space();
    Value value;
    switch (peek()) {
      case '{':
        value.kind = Value::Kind::object;
        parse_object(value, depth);
        break;
      case '[':
        value.kind = Value::Kind::array;
        parse_array(value, depth);
        break;
      case '"':
        value.kind = Value::Kind::string;
        value.text = parse_string();
        break;
      case 't':
        expect_word("true");
        value.kind = Value::Kind::boolean;
        value.boolean = true;
        break;
      case 'f':
        expect_word("false");
        value.kind = Value::Kind::boolean;
        break;
      case 'n':
        expect_word("null");
        break;
      default:
        value.kind = Value::Kind::number;
        value.text = parse_number();
    }
    return value;
  }

  void parse_object(Value& value, int depth) {
    expect_char('{');
    skip_space();
    if (peek() == '}') {
      ++pos_;
      return;
    }
    while (true) {
      skip_space();
      std::string key = parse_string();
      for (const auto& member : value.members) {
        if (member.first == key) fail("duplicate key \"" + key + "\"");
      }
      skip_space();
      expect_char(':');
      value.members.emplace_back(std::move(key), parse_value(depth + 1));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect_char('}');
      return;
    }
  }

  void parse_array(Value& value, int depth) {
    expect_char('[');
    skip_space();
    if (peek() == ']') {
      ++pos_;
      return;
    }
    while (true) {
      value.items.push_back(parse_value(depth + 1));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect_char(']');
      return;
    }
  }

  unsigned hex4() {
    if (pos_ + 4 > text_.size()) fail("truncated \\u escape");
    unsigned code = 0;
    const auto [end, error] =
        std::from_chars(text_.data() + pos_, text_.data() + pos_ + 4, code, 16);
    if (error != std::errc() || end != text_.data() + pos_ + 4) fail("bad \\u escape");
    pos_ += 4;
    return code;
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

  std::string parse_string() {
    expect_char('"');
    std::string out;
    while (true) {
      const char c = peek();
      ++pos_;
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      const char escape = peek();
      ++pos_;
      switch (escape) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned code = hex4();
          if (code >= 0xD800 && code < 0xDC00) {  // a surrogate pair
            expect_char('\\');
            expect_char('u');
            const unsigned low = hex4();
            if (low < 0xDC00 || low >= 0xE000) fail("unpaired surrogate");
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          } else if (code >= 0xDC00 && code < 0xE000) {
            fail("unpaired surrogate");
          }
          append_utf8(out, code);
          break;
        }
        default:
          fail("bad escape");
      }
    }
  }

  std::string parse_number() {
    const std::size_t start = pos_;
    auto digits = [&] {
      const std::size_t first = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      if (pos_ == first) fail("expected a digit");
    };
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    if (pos_ < text_.size() && text_[pos_] == '0') {
      ++pos_;
    } else {
      digits();
    }
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      digits();
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      digits();
    }
    return std::string(text_.substr(start, pos_ - start));
  }

  std::string_view text_;
  const std::string& what_;
  std::size_t pos_ = 0;
};

}  // namespace

bool Value::is_integer() const {
  return kind == Kind::number && text.find_first_of(".eE") == std::string::npos;
}

int64_t Value::as_int64() const {
  int64_t result = 0;
  if (is_integer()) {
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), result);
    if (error == std::errc() && end == text.data() + text.size()) return result;
  }
  throw Error("JSON: expected a 64-bit integer, got " + (kind == Kind::number ? text : "a non-number"));
}

Value parse(std::string_view text, const std::string& what) { return Parser(text, what).document(); }

std::string quote(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          static constexpr char kHex[] = "0123456789abcdef";
          out += "\\u00";
          out += kHex[(c >> 4) & 0xF];
          out += kHex[c & 0xF];
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace qkv::nn::json
