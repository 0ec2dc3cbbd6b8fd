// The demo's text as a character-level token stream: vocabulary, encoding, the
// train/held-out split and the unigram entropy the model has to beat.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::demo {

std::string_view embedded_demo_text();  // generated at build time from data/alice.txt

class Corpus {
 public:
  // Vocabulary: the distinct bytes of `text`, in byte order. The first
  // (1 − held_out_fraction) of the text trains, the rest is held out.
  Corpus(std::string_view text, double held_out_fraction);

  const std::string& vocab() const { return vocab_; }
  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  const std::vector<int32_t>& train() const { return train_; }
  const std::vector<int32_t>& held_out() const { return held_out_; }
  int64_t text_size() const { return static_cast<int64_t>(train_.size() + held_out_.size()); }

  // Throws qkv::Error naming the first character not in the vocabulary.
  std::vector<int32_t> encode(std::string_view text, const char* what) const;
  char decode(int32_t id) const { return vocab_[static_cast<std::size_t>(id)]; }

  // −Σ p(c)·ln p(c) over the training text's character frequencies, in nats: the
  // cross-entropy of the best model that ignores context.
  double unigram_entropy() const { return unigram_entropy_; }

 private:
  std::string vocab_;
  int32_t index_[256];
  std::vector<int32_t> train_, held_out_;
  double unigram_entropy_ = 0;
};

}  // namespace qkv::demo
