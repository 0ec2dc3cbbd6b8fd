// The `qkv` program: one CLI11 app, one subcommand per file.
//
// Each subcommand file defines a registrar: a function that adds its subcommand (with
// its options) to the top-level app and returns what to run when the user picks it.
// main.cpp lists the registrars, one line each; adding a subcommand is one line there
// plus its declaration below.
#pragma once

#include <CLI/CLI.hpp>

#include <array>
#include <functional>
#include <iosfwd>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "qkv/names.hpp"

namespace qkv::cli {

// Where a subcommand prints: results to `out`, diagnostics to `err`.
struct Streams {
  std::ostream& out;
  std::ostream& err;
};

// Exit status conventions of every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // the command was understood but failed (bad input file, ...)
inline constexpr int kExitUsage = 2;    // the command line itself is wrong

// What runs once the command line is parsed; returns the exit status. It may throw
// qkv::Error (or any std::exception): run() reports it on `err` and exits 1.
using Action = std::function<int(Streams)>;

struct Command {
  CLI::App* app = nullptr;  // the subcommand, owned by the parent app
  Action action;
};

using Registrar = Command (*)(CLI::App& parent);

// An option taking one of the names in `choices` (shown in --help as {a,b,c}) and
// storing the matching value in `target`. For enums (backend, causal mode, layout).
template <class T>
CLI::Option* add_choice(CLI::App* app, const std::string& name, T& target,
                        std::vector<std::pair<std::string, T>> choices, const std::string& help) {
  std::vector<std::string> names;
  std::string current;
  for (const auto& [key, value] : choices) {
    names.push_back(key);
    if (value == target) current = key;
  }
  return app
      ->add_option_function<std::string>(
          name,
          [&target, choices](const std::string& chosen) {
            for (const auto& [key, value] : choices)
              if (key == chosen) target = value;
          },
          help)
      ->check(CLI::IsMember(names))
      ->default_str(current);
}

// The choices of an option enum as the library's name table spells them
// (qkv/names.hpp): the command line accepts exactly the words the Python package does.
template <class E, std::size_t N>
std::vector<std::pair<std::string, E>> choices_of(const std::array<EnumName<E>, N>& table) {
  std::vector<std::pair<std::string, E>> choices;
  for (const EnumName<E>& entry : table) choices.emplace_back(std::string(entry.name), entry.value);
  return choices;
}

// Parses argv, runs the chosen subcommand and returns the process exit status.
// Never throws and never calls exit.
int run(std::span<const Registrar> commands, int argc, const char* const* argv, Streams streams);

// The subcommands (one line each).
Command register_explain(CLI::App& parent);
Command register_run(CLI::App& parent);
Command register_bench(CLI::App& parent);
Command register_demo(CLI::App& parent);

}  // namespace qkv::cli
