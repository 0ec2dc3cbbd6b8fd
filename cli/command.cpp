// Parsing and error reporting shared by every subcommand.
#include "command.hpp"

#include <exception>
#include <new>
#include <ostream>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/version.hpp"

namespace qkv::cli {

int run(std::span<const Registrar> commands, int argc, const char* const* argv, Streams streams) {
  try {
    CLI::App app("qkv — exact, fast scaled dot-product attention\n"
                 "softmax(scale·Q·Kᵀ + mask)·V, forward and backward",
                 "qkv");
    app.set_version_flag("--version", std::string(kVersion));
    app.require_subcommand(1);
    app.get_formatter()->column_width(34);
    std::vector<Command> registered;
    registered.reserve(commands.size());
    for (Registrar add : commands) registered.push_back(add(app));

    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      const int code = app.exit(e, streams.out, streams.err);
      return code == 0 ? kExitOk : kExitUsage;
    }

    for (const Command& command : registered) {
      if (!command.app->parsed()) continue;
      try {
        return command.action(streams);
      } catch (const std::bad_alloc&) {
        streams.err << "qkv " << command.app->get_name() << ": error: out of memory\n";
      } catch (const std::exception& e) {
        streams.err << "qkv " << command.app->get_name() << ": error: " << e.what() << "\n";
      }
      return kExitFailure;
    }
    streams.err << "qkv: error: no subcommand chosen (run qkv --help)\n";
    return kExitUsage;
  } catch (const std::exception& e) {  // building the app itself failed: a bug in qkv
    streams.err << "qkv: internal error: " << e.what() << "\n";
    return kExitFailure;
  }
}

}  // namespace qkv::cli
