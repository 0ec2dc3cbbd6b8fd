// qkv::Error — the one exception type every bad call throws.
//
// The message always names the function, the argument, what was expected and what was
// received, e.g. "qkv::attention_forward: k.shape[0] (batch): expected 2 (as q), got 3".
// Outputs are never written when an Error is thrown: validation happens before any work.
#pragma once

#include <stdexcept>
#include <string>

namespace qkv {

class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& message) : std::invalid_argument(message) {}
};

}  // namespace qkv
