// `qkv demo` stopped by a real signal: the real program runs in a child process, the
// test sends SIGINT (then SIGTERM to the resumed run) while it trains, and the checkpoint
// finally written after resuming must be byte for byte the one of a run never stopped.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "demo_process.hpp"

namespace {

using qkv::demo::testing::Finished;
using qkv::demo::testing::run_demo;

namespace fs = std::filesystem;

std::vector<char> bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// The step a stopped run reports ("stopped  at step K of N on request"), or -1. (No
// std::regex: GCC 12 warns falsely inside it under the sanitizers.)
long stopped_at(const std::string& output) {
  const std::string prefix = "stopped  at step ";
  const auto at = output.find(prefix);
  if (at == std::string::npos || output.find(" on request", at) == std::string::npos) return -1;
  return std::stol(output.substr(at + prefix.size()));
}

TEST(DemoInterrupt, SignalsStopSaveAndResumeToTheSameBits) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("qkv_demo_signal_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string full = (dir / "full.safetensors").string();
  const std::string part = (dir / "part.safetensors").string();
  // Tiny: each step takes about a millisecond, and the first progress line (which
  // triggers the signal) comes at step 30 of 300, so the signal always lands mid-run.
  const std::vector<std::string> tiny = {"--layers", "1", "--embed-dim", "16", "--heads", "2",
                                         "--context", "16", "--batch", "4", "--chars", "0",
                                         "--phrase", "", "--threads", "2", "--progress",
                                         "lines", "--steps", "300"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = tiny;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };

  const Finished straight = run_demo(with({"--save", full}));
  ASSERT_EQ(straight.exit_code, 0) << straight.output;

  // Ctrl-C during the first run: it finishes its step, saves, says where, exits 0.
  const Finished first = run_demo(with({"--save", part}), "step ", SIGINT);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const long first_stop = stopped_at(first.output);
  ASSERT_GT(first_stop, 0) << first.output;
  ASSERT_LT(first_stop, 300) << first.output;
  EXPECT_NE(first.output.find("saved    " + part + " (step " + std::to_string(first_stop) + ")"),
            std::string::npos)
      << first.output;
  EXPECT_NE(first.output.find("resume   with --resume " + part), std::string::npos) << first.output;
  EXPECT_EQ(first.output.find("Result after"), std::string::npos) << "a stopped run reports nothing more";

  // SIGTERM during the resumed run, then a resume to the end.
  const Finished second = run_demo(with({"--resume", part, "--save", part}), "step ", SIGTERM);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  const long second_stop = stopped_at(second.output);
  ASSERT_GT(second_stop, first_stop) << second.output;
  ASSERT_LT(second_stop, 300) << second.output;

  const Finished last = run_demo(with({"--resume", part, "--save", part}));
  ASSERT_EQ(last.exit_code, 0) << last.output;
  EXPECT_NE(last.output.find("saved    " + part + " (step 300)"), std::string::npos) << last.output;

  const auto expected = bytes(full);
  ASSERT_GT(expected.size(), 10'000u);
  EXPECT_TRUE(bytes(part) == expected)
      << "stopped at " << first_stop << " and " << second_stop
      << ", then resumed: the checkpoint differs from the run never stopped";
  fs::remove_all(dir);
}

TEST(DemoInterrupt, WithoutSaveNothingIsWrittenAndTheExitIsClean) {
  const Finished run = run_demo({"--layers", "1", "--embed-dim", "16", "--heads", "2", "--context",
                                 "16", "--batch", "4", "--chars", "0", "--phrase", "",
                                 "--threads", "2", "--progress", "lines", "--steps", "300"},
                                "step ", SIGINT);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  EXPECT_GT(stopped_at(run.output), 0) << run.output;
  EXPECT_NE(run.output.find("nothing saved (no --save)"), std::string::npos) << run.output;
}

}  // namespace
