// qkv bench: the FLOP formula, the timing loop and the table.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench.hpp"
#include "cli_test_support.hpp"
#include "qkv/error.hpp"

namespace qkv::cli {
namespace {

using test::run_cli;

TEST(Bench, FlopFormula) {
  const BenchShape shape{2, 3, 5, 7, Causal::none};
  EXPECT_EQ(attention_flops(shape, false), 4.0 * 2 * 3 * 5 * 5 * 7);
  EXPECT_EQ(attention_flops(shape, true), 2.5 * 4.0 * 2 * 3 * 5 * 5 * 7);
  const BenchShape causal{2, 3, 5, 7, Causal::top_left};
  EXPECT_EQ(attention_flops(causal, false), 2.0 * 2 * 3 * 5 * 5 * 7);
  EXPECT_EQ(attention_flops(causal, true), 2.5 * 2.0 * 2 * 3 * 5 * 5 * 7);
}

TEST(Bench, RunsEveryRowWithConsistentNumbers) {
  BenchConfig config;
  config.batch = 1;
  config.heads = 2;
  config.seqs = {8, 17};
  config.dims = {4};
  config.causal = {Causal::none, Causal::bottom_right};
  config.reps = 3;
  config.min_time = 0.0;
  int streamed = 0;
  const auto rows = run_bench(config, [&](const BenchRow&) { ++streamed; });
  ASSERT_EQ(rows.size(), 2u * 1 * 2 * 2);  // seqs × dims × causal × {forward, backward}
  EXPECT_EQ(streamed, 8);
  for (const BenchRow& row : rows) {
    EXPECT_EQ(row.reps, 3);  // min_time 0: exactly --reps
    EXPECT_GT(row.min_s, 0.0);
    EXPECT_GE(row.median_s, row.min_s);
    EXPECT_DOUBLE_EQ(row.flops, attention_flops(row.shape, row.backward));
    EXPECT_DOUBLE_EQ(row.gflops, row.flops / row.median_s * 1e-9);
  }
  EXPECT_FALSE(rows[0].backward);
  EXPECT_TRUE(rows[1].backward);
  EXPECT_EQ(rows[2].shape.causal, Causal::bottom_right);
}

TEST(Bench, RejectsOutOfRangeConfigurations) {
  BenchConfig config;
  config.seqs = {0};
  EXPECT_THROW(validate(config), Error);
  config = {};
  config.dims = {};
  EXPECT_THROW(validate(config), Error);
  config = {};
  config.batch = 1 << 15;
  config.heads = 1 << 10;  // tens of TB of tensors
  EXPECT_THROW(validate(config), Error);
  config = {};
  config.max_reps = 1;
  EXPECT_THROW(validate(config), Error);
}

TEST(Bench, PrintsATableAndJson) {
  const auto table = run_cli({"bench", "--seq", "8,16", "--dim", "4", "--heads", "2", "--reps", "1",
                              "--min-time", "0", "--pass", "forward", "--causal", "none,top_left"});
  ASSERT_EQ(table.code, 0) << table.err;
  EXPECT_NE(table.out.find("GFLOP/s"), std::string::npos);
  EXPECT_NE(table.out.find("% peak"), std::string::npos);
  // "% peak: of the fp32 FMA peak measured now, 123.4 GFLOP/s on 2 threads (AVX3)"
  const std::string peak_prefix = "% peak: of the fp32 FMA peak measured now, ";
  const auto peak_at = table.out.find(peak_prefix);
  ASSERT_NE(peak_at, std::string::npos) << table.out;
  std::size_t peak_digits = 0;
  const double peak = std::stod(table.out.substr(peak_at + peak_prefix.size()), &peak_digits);
  EXPECT_EQ(table.out.compare(peak_at + peak_prefix.size() + peak_digits, 11, " GFLOP/s on"), 0)
      << table.out;
  EXPECT_GT(peak, 0.0);  // (0.2 GFLOP/s in the ASan build: -O1 and instrumented)
  std::istringstream lines(table.out);
  std::string line;
  int rows = 0;
  while (std::getline(lines, line)) {
    const auto first = line.find_first_not_of(' ');
    const bool row = first != std::string::npos &&
                     std::isdigit(static_cast<unsigned char>(line[first])) &&
                     line.find(" forward ") != std::string::npos;
    if (!row) continue;
    ++rows;
    // The last two cells: GFLOP/s and its share of the peak, "12.3%".
    std::istringstream cells(line);
    std::vector<std::string> words{std::istream_iterator<std::string>(cells), {}};
    ASSERT_EQ(words.back().back(), '%') << line;
    const double gflops = std::stod(words[words.size() - 2]);
    // Both are printed rounded (%.2f, %.1f%%) and so is the peak (%.1f): the unrounded
    // values lie within half a printed step of them, so the printed share lies in the
    // share's range over those intervals, widened by its own half step. (Exact interval
    // bounds, not a first-order error: the ASan build's peak is ~0.5 GFLOP/s, where a
    // half step of the peak is 10% of it and the linear bound was exceeded, CI 12-03.)
    const double printed_share = std::stod(words.back());
    const double low = 100 * std::max(gflops - 0.005, 0.0) / (peak + 0.05);
    const double high = peak > 0.05 ? 100 * (gflops + 0.005) / (peak - 0.05) : HUGE_VAL;
    EXPECT_GE(printed_share, low - 0.05 - 1e-9) << line;
    EXPECT_LE(printed_share, high + 0.05 + 1e-9) << line;
  }
  EXPECT_EQ(rows, 4);  // 2 seqs × 2 causal modes, forward only

  const auto json = run_cli({"bench", "--seq", "8", "--dim", "4", "--reps", "1", "--min-time", "0", "--json"});
  ASSERT_EQ(json.code, 0) << json.err;
  EXPECT_EQ(json.out.front(), '{');
  EXPECT_NE(json.out.find("\"pass\": \"backward\""), std::string::npos);
  EXPECT_NE(json.out.find("\"flops\": 8192,"), std::string::npos);  // 4·B·H·N²·d = 4·1·8·64·4
  const auto parsed = nlohmann::json::parse(json.out);
  const double json_peak = parsed.at("fma_peak_gflops").get<double>();
  EXPECT_GT(json_peak, 0.0);
  EXPECT_FALSE(parsed.at("simd_target").get<std::string>().empty());
  // The dot-product peaks (0 where the CPU lacks the unit), in the table's header too.
  EXPECT_GE(parsed.at("bf16_dot_peak_gflops").get<double>(), 0.0);
  EXPECT_GE(parsed.at("int8_dot_peak_gops").get<double>(), 0.0);
  // The AMX peak: 0 exactly where the table says the CPU has no tiles.
  const bool no_tiles = table.out.find("AMX bf16 (tdpbf16ps) none on this CPU") != std::string::npos;
  EXPECT_EQ(parsed.at("amx_bf16_peak_gflops").get<double>() == 0.0, no_tiles) << table.out;
  EXPECT_NE(table.out.find("dot-product peaks measured now: bf16 (vdpbf16ps) "), std::string::npos) << table.out;
  for (const auto& row : parsed.at("rows")) {
    EXPECT_DOUBLE_EQ(row.at("peak_share").get<double>(), row.at("gflops").get<double>() / json_peak);
  }

  const auto bad = run_cli({"bench", "--seq", "0"});
  EXPECT_EQ(bad.code, kExitFailure);
  EXPECT_NE(bad.err.find("--seq"), std::string::npos);
}

}  // namespace
}  // namespace qkv::cli
