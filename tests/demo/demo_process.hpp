// Runs the real `qkv demo` in a child process and collects what it prints.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace qkv::demo::testing {

struct Finished {
  int exit_code = -1;  // -1: ended by a signal
  std::string output;  // stdout and stderr
};

// Runs `qkv demo <args>` (the real program, QKV_CLI_BINARY) with `environment` added to
// this process's; once its output contains `trigger` (if not empty), sends `signal` to
// it. Returns when the process has ended.
inline Finished run_demo(const std::vector<std::string>& args, const std::string& trigger = "",
                         int signal = 0,
                         const std::vector<std::pair<std::string, std::string>>& environment = {}) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) throw std::runtime_error("pipe failed");
  std::vector<std::string> argv_strings = {QKV_CLI_BINARY, "demo"};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_strings) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    for (const auto& [name, value] : environment) ::setenv(name.c_str(), value.c_str(), 1);
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  Finished result;
  bool sent = trigger.empty();
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) != 0;) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    result.output.append(buffer, static_cast<std::size_t>(n));
    if (!sent && result.output.find(trigger) != std::string::npos) {
      ::kill(pid, signal);
      sent = true;
    }
  }
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

}  // namespace qkv::demo::testing
