// qkv — the command-line program. Each subcommand lives in its own <name>_command.cpp;
// to add one, declare its registrar in command.hpp and list it here.
#include <iostream>

#include "command.hpp"
#include "load_time_environment.hpp"

int main(int argc, char** argv) {
  qkv::cli::restart_with_load_time_environment(argv);  // what OpenBLAS and OpenMP read at load: see there
  static constexpr qkv::cli::Registrar kCommands[] = {
      qkv::cli::register_explain,
      qkv::cli::register_run,
      qkv::cli::register_bench,
      qkv::cli::register_demo,
  };
  return qkv::cli::run(kCommands, argc, argv, {std::cout, std::cerr});
}
