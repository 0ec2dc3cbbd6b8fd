// The real `qkv` program's choice of BLAS kernels: OpenBLAS falls back to its slowest
// kernels on CPUs newer than its release; the program then restarts itself with
// OPENBLAS_CORETYPE set (cli/faster_blas.cpp), and a user's OPENBLAS_CORETYPE wins.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "demo_process.hpp"

namespace {

using qkv::demo::testing::run_demo;

const std::vector<std::string> kTiny = {"--layers", "1", "--embed-dim", "16", "--heads", "2",
                                        "--context", "16", "--batch", "4", "--chars", "0",
                                        "--phrase", "", "--threads", "1", "--steps", "1"};

// The word after "GEMM: OpenBLAS " in the description, or "".
std::string kernels(const std::string& output) {
  const std::string prefix = "GEMM: OpenBLAS ";
  const auto at = output.find(prefix);
  if (at == std::string::npos) return "";
  const auto begin = at + prefix.size();
  return output.substr(begin, output.find_first_of(" \n", begin) - begin);
}

TEST(DemoProgram, RunsVectorKernelsOnVectorCpus) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) GTEST_SKIP() << "OPENBLAS_CORETYPE is set";
  const auto run = run_demo(kTiny);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::string chosen = kernels(run.output);
  ASSERT_FALSE(chosen.empty()) << run.output;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_NE(chosen, "Prescott") << "the SSE3 fallback on a CPU with AVX2 + FMA";
  }
#endif
}

TEST(DemoProgram, TheUsersCoretypeWins) {
  const auto run = run_demo(kTiny, "", 0, {{"OPENBLAS_CORETYPE", "Prescott"}});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_EQ(kernels(run.output), "Prescott") << run.output;
}

}  // namespace
