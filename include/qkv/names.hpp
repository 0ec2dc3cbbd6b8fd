// The names of the option enums: one table per enum, shared by every front end. The `qkv`
// command line (--causal, --backend) and the Python package (causal=, backend=, and the
// enums qkv._qkv.Causal / Backend) accept the same words, print the same words and list
// the same choices in their messages, because they all read these tables.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "qkv/options.hpp"

namespace qkv {

template <class E>
struct EnumName {
  std::string_view name;  // a string literal: .data() is null-terminated
  E value;
  bool alias = false;  // accepted as input, never printed or listed
};

inline constexpr std::array<EnumName<Causal>, 3> kCausalNames{{
    {"none", Causal::none},
    {"top_left", Causal::top_left},
    {"bottom_right", Causal::bottom_right},
}};

inline constexpr std::array<EnumName<Backend>, 4> kBackendNames{{
    {"auto", Backend::automatic},
    {"reference", Backend::reference},
    {"cpu", Backend::cpu},
    {"automatic", Backend::automatic, true},  // the command line's word before this table
}};

inline constexpr std::array<EnumName<Precision>, 2> kPrecisionNames{{
    {"fast", Precision::fast},
    {"exact", Precision::exact},
}};

// The value called `name`, or nothing.
template <class E, std::size_t N>
constexpr std::optional<E> enum_from_name(const std::array<EnumName<E>, N>& table,
                                          std::string_view name) {
  for (const EnumName<E>& entry : table)
    if (entry.name == name) return entry.value;
  return std::nullopt;
}

// The printed name of `value` (its first entry that is not an alias), "" if it has none.
template <class E, std::size_t N>
constexpr std::string_view enum_name(const std::array<EnumName<E>, N>& table, E value) {
  for (const EnumName<E>& entry : table)
    if (entry.value == value && !entry.alias) return entry.name;
  return {};
}

// The listed names joined for a message: "'a', 'b' or 'c'" (quote = "'"), skipping the
// aliases and the value `skip` when given (e.g. Causal::none where None stands for it).
template <class E, std::size_t N>
std::string enum_choices(const std::array<EnumName<E>, N>& table, std::string_view quote,
                         std::string_view last_separator,
                         std::type_identity_t<std::optional<E>> skip = std::nullopt) {
  std::array<std::string_view, N> names{};
  std::size_t count = 0;
  for (const EnumName<E>& entry : table)
    if (!entry.alias && entry.value != skip) names[count++] = entry.name;
  std::string text;
  for (std::size_t i = 0; i < count; ++i) {
    if (i > 0) text += i + 1 == count ? last_separator : std::string_view(", ");
    text.append(quote).append(names[i]).append(quote);
  }
  return text;
}

inline std::optional<Causal> causal_from_name(std::string_view name) {
  return enum_from_name(kCausalNames, name);
}
inline std::optional<Backend> backend_from_name(std::string_view name) {
  return enum_from_name(kBackendNames, name);
}
inline std::optional<Precision> precision_from_name(std::string_view name) {
  return enum_from_name(kPrecisionNames, name);
}
constexpr std::string_view name_of(Precision value) { return enum_name(kPrecisionNames, value); }
constexpr std::string_view name_of(Causal value) { return enum_name(kCausalNames, value); }
constexpr std::string_view name_of(Backend value) { return enum_name(kBackendNames, value); }

}  // namespace qkv
