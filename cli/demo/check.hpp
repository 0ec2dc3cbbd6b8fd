// Argument checks of the demo: each throws qkv::Error naming the function, the argument,
// what was expected and what was received.
#pragma once

#include <string>

#include "qkv/error.hpp"

namespace qkv::demo {

[[noreturn]] inline void fail(const std::string& function, const std::string& message) {
  throw Error("qkv::demo::" + function + ": " + message);
}

inline void expect(bool condition, const std::string& function, const std::string& message) {
  if (!condition) fail(function, message);
}

}  // namespace qkv::demo
