#include "format.hpp"

#include "qkv/names.hpp"

#include <algorithm>
#include <cstdio>
#include <ostream>
#include <stdexcept>

namespace qkv::cli {

std::string format(const char* spec, double value) {
  char buffer[64];
  const int n = std::snprintf(buffer, sizeof buffer, spec, value);
  return std::string(buffer, static_cast<std::size_t>(std::clamp(n, 0, 63)));
}

// ---- Table ---------------------------------------------------------------------------

void Table::add_group(std::string title, int columns) {
  groups_.push_back({std::move(title), static_cast<int>(headers_.size()), columns});
}

void Table::add_column(std::string header) { headers_.push_back(std::move(header)); }

void Table::add_row(std::vector<std::string> cells) {
  if (cells.size() != headers_.size()) throw std::logic_error("Table: row width differs from header");
  rows_.push_back(std::move(cells));
}

namespace {
// Display width of UTF-8 text: code points, not bytes (our headers use ‖, √, ·, ⁻³).
std::size_t width(std::string_view text) {
  std::size_t n = 0;
  for (char c : text) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}
void pad(std::ostream& out, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) out << ' ';
}
}  // namespace

void Table::print(std::ostream& out, std::string_view indent) const {
  constexpr std::size_t kGap = 2;
  std::vector<std::size_t> widths(headers_.size());
  for (std::size_t c = 0; c < headers_.size(); ++c) {
    widths[c] = width(headers_[c]);
    for (const auto& row : rows_) widths[c] = std::max(widths[c], width(row[c]));
  }
  // A group title wider than its columns widens the last of them.
  for (const Group& group : groups_) {
    std::size_t span = 0;
    for (int c = group.first; c < group.first + group.count; ++c) span += widths[c] + (c > group.first ? kGap : 0);
    if (width(group.title) > span) widths[group.first + group.count - 1] += width(group.title) - span;
  }
  if (!groups_.empty()) {
    // Each title starts over the first of its columns; no trailing spaces.
    std::string line(indent);
    std::size_t column = 0, position = 0;
    for (const Group& group : groups_) {
      for (; static_cast<int>(column) < group.first; ++column) position += widths[column] + kGap;
      const std::size_t used = width(line) - width(indent);
      line.append(position > used ? position - used : (used > 0 ? 1 : 0), ' ');
      line += group.title;
    }
    out << line << '\n';
  }
  const auto print_cells = [&](const std::vector<std::string>& cells) {
    out << indent;
    for (std::size_t c = 0; c < cells.size(); ++c) {
      pad(out, widths[c] - width(cells[c]));
      out << cells[c];
      if (c + 1 < cells.size()) pad(out, kGap);
    }
    out << '\n';
  };
  print_cells(headers_);
  for (const auto& row : rows_) print_cells(row);
}

}  // namespace qkv::cli

namespace qkv::cli {

const char* backend_name(Backend backend) { return name_of(backend).data(); }

}  // namespace qkv::cli
