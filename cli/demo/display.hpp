// What the demo draws in the terminal: the progress bar and the attention heatmap.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

#include "qkv/tensor.hpp"

namespace qkv::demo {

// "1.23k" style: 3 significant digits with k / M suffixes.
std::string si(double value);
// "m:ss".
std::string clock_text(double seconds);

// One line: step, a bar of eighth-blocks, loss, tokens/s, elapsed time.
std::string progress_line(int64_t step, int64_t total, double loss, double tokens_per_second,
                          double seconds);

// One head's attention probabilities over `text` (weights [n, n] of head `head` in
// [1, H, n, n]) as rows of Unicode shade blocks, query characters down the side, key
// characters across the top, causally hidden cells blank.
void draw_heatmap(std::ostream& out, const Tensor<float, 4>& weights, int64_t head,
                  const std::string& text);

// A character as shown in a heatmap label (space → ␣, newline → ⏎).
std::string label(char c);

}  // namespace qkv::demo
