#include "demo/corpus.hpp"

#include <array>
#include <cmath>
#include <string>

#include "demo/check.hpp"
#include "demo/demo.hpp"

namespace qkv::demo {

std::string_view demo_text() { return embedded_demo_text(); }

Corpus::Corpus(std::string_view text, double held_out_fraction) {
  expect(held_out_fraction >= 0 && held_out_fraction < 1, "Corpus",
         "held_out_fraction: expected in [0, 1), got " + std::to_string(held_out_fraction));
  std::array<bool, 256> present{};
  for (const char c : text) present[static_cast<unsigned char>(c)] = true;
  for (int& entry : index_) entry = -1;
  for (int byte = 0; byte < 256; ++byte) {
    if (!present[byte]) continue;
    index_[byte] = static_cast<int32_t>(vocab_.size());
    vocab_ += static_cast<char>(byte);
  }
  const std::vector<int32_t> ids = encode(text, "text");
  const auto split = static_cast<std::ptrdiff_t>(
      std::floor(static_cast<double>(ids.size()) * (1.0 - held_out_fraction)));
  train_.assign(ids.begin(), ids.begin() + split);
  held_out_.assign(ids.begin() + split, ids.end());

  std::vector<int64_t> counts(vocab_.size(), 0);
  for (int32_t id : train_) ++counts[static_cast<std::size_t>(id)];
  const double n = static_cast<double>(train_.size());
  for (int64_t count : counts) {
    if (count == 0) continue;
    const double p = static_cast<double>(count) / n;
    unigram_entropy_ -= p * std::log(p);
  }
}

std::vector<int32_t> Corpus::encode(std::string_view text, const char* what) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const int32_t id = index_[static_cast<unsigned char>(text[i])];
    if (id < 0) {
      const auto byte = static_cast<unsigned char>(text[i]);
      std::string shown = byte >= 0x20 && byte < 0x7F ? std::string(1, text[i])
                                                      : "byte " + std::to_string(byte);
      fail("demo", std::string(what) + ": character " + std::to_string(i) + " ('" + shown +
                       "') does not occur in the training text");
    }
    ids.push_back(id);
  }
  return ids;
}

}  // namespace qkv::demo
