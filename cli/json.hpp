// JSON output of `qkv explain --json` and `qkv bench --json`, through nlohmann/json: keys
// in the order they were added, two-space indentation, one final newline.
#pragma once

#include <iosfwd>
#include <vector>

#include <nlohmann/json.hpp>

namespace qkv::cli {

using Json = nlohmann::ordered_json;

// A double as JSON: null when not finite (JSON has neither NaN nor infinity), an integer
// when it holds one exactly (8192 FLOPs print as 8192, not 8192.0), otherwise the
// shortest decimal that reads back as the same double.
Json json_number(double value);
Json json_numbers(const std::vector<double>& values);

// `json`, indented by two spaces, and a newline.
void write_json(const Json& json, std::ostream& out);

}  // namespace qkv::cli
