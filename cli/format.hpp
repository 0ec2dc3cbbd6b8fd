// Text output helpers: number formatting, aligned tables, and a small JSON writer.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::cli {

// printf-style formatting of one double ("%.4g", "%.3f", ...).
std::string format(const char* spec, double value);

// Columns of right-aligned cells under left-aligned headers; widths fit the content.
// A header may span several columns (add_group) to label scaled/unscaled pairs.
class Table {
 public:
  void add_group(std::string title, int columns);  // a spanning header above the next columns
  void add_column(std::string header);
  void add_row(std::vector<std::string> cells);
  void print(std::ostream& out, std::string_view indent = "  ") const;

 private:
  struct Group {
    std::string title;
    int first = 0, count = 0;
  };
  std::vector<Group> groups_;
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

// Streaming JSON writer: objects, arrays, numbers (non-finite ones become null),
// strings, booleans; two-space indentation, arrays of numbers on one line.
class Json {
 public:
  explicit Json(std::ostream& out) : out_(out) {}
  Json& begin_object();
  Json& end_object();
  Json& begin_array();
  Json& end_array();
  Json& key(std::string_view name);
  Json& value(double number);
  Json& value(int64_t number);
  Json& value(int number) { return value(static_cast<int64_t>(number)); }
  Json& value(std::string_view text);
  Json& value(const char* text) { return value(std::string_view(text)); }
  Json& value(bool flag);
  Json& field(std::string_view name, double number) { return key(name).value(number); }
  Json& field(std::string_view name, int64_t number) { return key(name).value(number); }
  Json& field(std::string_view name, std::string_view text) { return key(name).value(text); }
  Json& field(std::string_view name, const std::vector<double>& numbers);
  void finish();  // a final newline; checks that every bracket was closed

 private:
  struct Level {
    bool is_object = false;
    bool empty = true;
    bool inline_items = true;  // arrays stay on one line while they hold only scalars
  };
  void before_value();
  void newline();
  void write_string(std::string_view text);
  std::ostream& out_;
  std::vector<Level> stack_;
  bool after_key_ = false;
};

}  // namespace qkv::cli

#include "qkv/options.hpp"

namespace qkv::cli {

// "auto", "reference", "cpu": the library's name table (qkv/names.hpp).
const char* backend_name(Backend backend);

}  // namespace qkv::cli
