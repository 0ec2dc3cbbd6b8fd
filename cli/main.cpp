// qkv — the command-line program. Each subcommand lives in its own <name>_command.cpp;
// to add one, declare its registrar in command.hpp and list it here.
#include <iostream>

#include "command.hpp"
#include "faster_blas.hpp"

int main(int argc, char** argv) {
  qkv::cli::restart_for_faster_blas(argv);  // OpenBLAS on a CPU newer than it: see there
  static constexpr qkv::cli::Registrar kCommands[] = {
      qkv::cli::register_explain,
      qkv::cli::register_run,
      qkv::cli::register_bench,
      qkv::cli::register_demo,
  };
  return qkv::cli::run(kCommands, argc, argv, {std::cout, std::cerr});
}
