// The option enums' one name table (qkv/names.hpp), which the command line and the
// Python package both read: every value has exactly one printed name, every name maps
// back to its value, aliases are accepted but never printed, unknown names are refused.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "qkv/names.hpp"

namespace qkv {
namespace {

template <class E, std::size_t N>
void expect_round_trip(const std::array<EnumName<E>, N>& table) {
  std::set<std::string_view> printed;
  for (const EnumName<E>& entry : table) {
    ASSERT_EQ(enum_from_name(table, entry.name), entry.value) << entry.name;
    const std::string_view name = enum_name(table, entry.value);
    ASSERT_FALSE(name.empty()) << entry.name << ": its value has no printed name";
    EXPECT_EQ(enum_from_name(table, name), entry.value);
    if (!entry.alias) {
      EXPECT_TRUE(printed.insert(entry.name).second) << entry.name << " twice";
    }
  }
  EXPECT_FALSE(enum_from_name(table, "").has_value());
  EXPECT_FALSE(enum_from_name(table, "no such name").has_value());
}

TEST(Names, CausalModesRoundTrip) {
  expect_round_trip(kCausalNames);
  EXPECT_EQ(name_of(Causal::none), "none");
  EXPECT_EQ(name_of(Causal::top_left), "top_left");
  EXPECT_EQ(name_of(Causal::bottom_right), "bottom_right");
  EXPECT_EQ(causal_from_name("bottom_right"), Causal::bottom_right);
  EXPECT_FALSE(causal_from_name("lower").has_value());
}

TEST(Names, BackendsRoundTripAndTheAliasIsNeverPrinted) {
  expect_round_trip(kBackendNames);
  EXPECT_EQ(name_of(Backend::automatic), "auto");
  EXPECT_EQ(backend_from_name("auto"), Backend::automatic);
  EXPECT_EQ(backend_from_name("automatic"), Backend::automatic);  // the CLI's former word
  EXPECT_EQ(backend_from_name("cpu"), Backend::cpu);
  EXPECT_FALSE(backend_from_name("gpu").has_value());
}

TEST(Names, ChoicesForMessagesListThePrintedNamesOnly) {
  EXPECT_EQ(enum_choices(kBackendNames, "'", ", "), "'auto', 'reference', 'cpu'");
  EXPECT_EQ(enum_choices(kCausalNames, "'", " or ", Causal::none), "'top_left' or 'bottom_right'");
  EXPECT_EQ(enum_choices(kCausalNames, "", " or "), "none, top_left or bottom_right");
}

}  // namespace
}  // namespace qkv
