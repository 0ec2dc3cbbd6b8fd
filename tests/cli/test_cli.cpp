// The program as a whole: help, version, usage errors, exit codes, the real binary.
#include <gtest/gtest.h>

#include <cstdio>

#include "cli_test_support.hpp"
#include "qkv/version.hpp"

namespace qkv::cli {
namespace {

using test::run_cli;

TEST(Cli, HelpListsEverySubcommand) {
  const auto help = run_cli({"--help"});
  EXPECT_EQ(help.code, 0);
  for (const char* name : {"explain", "run", "bench"}) EXPECT_NE(help.out.find(name), std::string::npos) << name;
  EXPECT_TRUE(help.err.empty());
}

TEST(Cli, EachSubcommandHasHelpNamingItsFlags) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> expected{
      {"explain", {"--seed", "--samples", "--keys", "--dims", "--softcap", "--json", "--plot"}},
      {"run", {"--q", "--k", "--v", "--out", "--causal", "--mask", "--scale", "--lse", "--weights",
               "--grad", "--dq", "--dk", "--dv", "--layout", "--backend", "--threads", "--check-finite"}},
      {"bench", {"--batch", "--heads", "--seq", "--dim", "--causal", "--pass", "--backend", "--threads",
                 "--reps", "--min-time", "--json"}}};
  for (const auto& [command, flags] : expected) {
    const auto help = run_cli({command, "--help"});
    EXPECT_EQ(help.code, 0) << command;
    for (const std::string& flag : flags) EXPECT_NE(help.out.find(flag), std::string::npos) << command << " " << flag;
  }
}

TEST(Cli, UsageErrorsExitTwoWithAMessageOnStderr) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {},                                   // no subcommand
           {"frobnicate"},                       // unknown subcommand
           {"explain", "--samples"},             // missing value
           {"explain", "--samples", "ten"},      // not a number
           {"explain", "--samples", "1"},        // out of range
           {"explain", "--dims", "4,0"},         // out of range
           {"explain", "--softcap", "0"},        // out of range
           {"explain", "--softcap", "nan"},
           {"explain", "--no-such-flag"},
           {"run", "--q", "q.npy"},              // required flags missing
           {"run", "--q", "a", "--k", "b", "--v", "c", "-o", "d", "--causal", "diagonal"},
           {"run", "--q", "a", "--k", "b", "--v", "c", "-o", "d", "--layout", "sbhd"},
           {"bench", "--pass", "sideways"},
       }) {
    const auto result = run_cli(args);
    EXPECT_EQ(result.code, kExitUsage) << ::testing::PrintToString(args);
    EXPECT_FALSE(result.err.empty()) << ::testing::PrintToString(args);
    EXPECT_TRUE(result.out.empty()) << ::testing::PrintToString(args);
  }
}

TEST(Cli, Version) {
  const auto result = run_cli({"--version"});
  EXPECT_EQ(result.code, 0);
  EXPECT_NE(result.out.find(kVersion), std::string::npos);
}

// The installed program itself links, runs and reports failure through its exit status.
TEST(Cli, RealBinaryRunsAndFailsCleanly) {
  const std::string binary = QKV_CLI_BINARY;
  FILE* pipe = ::popen((binary + " --version 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char buffer[256] = {};
  const std::size_t n = std::fread(buffer, 1, sizeof buffer - 1, pipe);
  EXPECT_EQ(::pclose(pipe), 0);
  EXPECT_NE(std::string(buffer, n).find(kVersion), std::string::npos);

  pipe = ::popen((binary + " run --q /nonexistent/q.npy --k k --v v -o o.npy 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  const std::size_t m = std::fread(buffer, 1, sizeof buffer - 1, pipe);
  const int status = ::pclose(pipe);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == kExitFailure) << status;
  EXPECT_NE(std::string(buffer, m).find("/nonexistent/q.npy: no such file"), std::string::npos)
      << std::string(buffer, m);
}

}  // namespace
}  // namespace qkv::cli
