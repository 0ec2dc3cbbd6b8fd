// Text output helpers: number formatting and aligned tables.
#pragma once

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

}  // namespace qkv::cli

#include "qkv/options.hpp"

namespace qkv::cli {

// "auto", "reference", "cpu": the library's name table (qkv/names.hpp).
const char* backend_name(Backend backend);

}  // namespace qkv::cli
