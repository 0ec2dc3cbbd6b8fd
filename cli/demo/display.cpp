#include "demo/display.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>

namespace qkv::demo {

std::string si(double value) {
  char text[32];
  if (value >= 1e6) {
    std::snprintf(text, sizeof text, "%.3gM", value / 1e6);
  } else if (value >= 1e3) {
    std::snprintf(text, sizeof text, "%.3gk", value / 1e3);
  } else {
    std::snprintf(text, sizeof text, "%.3g", value);
  }
  return text;
}

std::string clock_text(double seconds) {
  const auto whole = static_cast<long>(std::lround(std::max(0.0, seconds)));
  char text[32];
  std::snprintf(text, sizeof text, "%ld:%02ld", whole / 60, whole % 60);
  return text;
}

std::string progress_line(int64_t step, int64_t total, double loss, double tokens_per_second,
                          double seconds) {
  // A bar 24 cells wide, each cell split in eighths: █ full, ▏▎▍▌▋▊▉ partial.
  static const char* const kEighths[] = {"", "▏", "▎", "▍", "▌", "▋", "▊", "▉"};
  constexpr int kWidth = 24;
  const double fraction = total > 0 ? std::clamp(static_cast<double>(step) / static_cast<double>(total), 0.0, 1.0) : 1.0;
  const int eighths = static_cast<int>(fraction * kWidth * 8);
  std::string bar;
  for (int cell = 0; cell < kWidth; ++cell) {
    const int filled = std::clamp(eighths - cell * 8, 0, 8);
    bar += filled == 8 ? "█" : filled == 0 ? " " : kEighths[filled];
  }
  const int width = static_cast<int>(std::to_string(total).size());
  char text[160];
  std::snprintf(text, sizeof text, "step %*lld/%lld │%s│ loss %.3f │ %s tok/s │ %s", width,
                static_cast<long long>(step), static_cast<long long>(total), bar.c_str(), loss,
                si(tokens_per_second).c_str(), clock_text(seconds).c_str());
  return text;
}

std::string label(char c) {
  if (c == ' ') return "␣";
  if (c == '\n') return "⏎";
  if (c == '\t') return "⇥";
  return std::string(1, c);
}

void draw_heatmap(std::ostream& out, const Tensor<float, 4>& weights, int64_t head,
                  const std::string& text) {
  // Shades by weight; thresholds roughly logarithmic so small but real weights show.
  struct Shade {
    float below;
    const char* cell;
  };
  static const Shade kShades[] = {{0.05f, "··"}, {0.15f, "░░"}, {0.35f, "▒▒"},
                                  {0.65f, "▓▓"}, {2.0f, "██"}};
  const int64_t n = weights.shape()[2];
  out << "      ";
  for (int64_t j = 0; j < n; ++j) out << label(text[j]) << ' ';
  out << "  ← keys\n";
  for (int64_t i = 0; i < n; ++i) {
    out << "    " << label(text[i]) << ' ';
    for (int64_t j = 0; j < n; ++j) {
      if (j > i) {
        out << "  ";  // the future: causally masked
        continue;
      }
      const float w = weights(0, head, i, j);
      for (const Shade& shade : kShades) {
        if (w < shade.below) {
          out << shade.cell;
          break;
        }
      }
    }
    out << (i == 0 ? "  ↑ queries\n" : "\n");
  }
  out << "      ·· < 0.05   ░░ < 0.15   ▒▒ < 0.35   ▓▓ < 0.65   ██ ≥ 0.65\n";
}

}  // namespace qkv::demo
