// `qkv demo` through its command-line flags (cli/demo_command.cpp) and the CLI's own
// parsing and error reporting (cli/command.cpp), with only that subcommand registered.
#include <iostream>

#include "command.hpp"

namespace qkv::cli {
Command register_demo(CLI::App& parent);  // cli/demo_command.cpp
}  // namespace qkv::cli

int main(int argc, char** argv) {
  static constexpr qkv::cli::Registrar kCommands[] = {qkv::cli::register_demo};
  return qkv::cli::run(kCommands, argc, argv, {std::cout, std::cerr});
}
