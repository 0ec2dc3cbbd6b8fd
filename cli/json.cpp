#include "json.hpp"

#include <cmath>
#include <cstdint>
#include <ostream>

namespace qkv::cli {

Json json_number(double value) {
  if (!std::isfinite(value)) return nullptr;
  // Integers up to 2⁵³ are exact in a double, and so in an int64_t.
  constexpr double kExactIntegers = 0x1.0p53;
  if (std::trunc(value) == value && std::abs(value) <= kExactIntegers) return static_cast<int64_t>(value);
  return value;
}

Json json_numbers(const std::vector<double>& values) {
  Json array = Json::array();
  for (double value : values) array.push_back(json_number(value));
  return array;
}

void write_json(const Json& json, std::ostream& out) { out << json.dump(2) << '\n'; }

}  // namespace qkv::cli
