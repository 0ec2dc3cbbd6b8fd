// Bad sparse calls: a qkv::Error naming the argument (an index out of range: its batch
// entry and row), options sparse attention does not take refused by name, and nothing
// written to any output.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "sparse_case.hpp"

namespace qkv::test {
namespace {

constexpr float kSentinel = 12345.0f;

SparseSpec small_spec(bool shared) {
  return {.name = "errors", .batch = 2, .q_len = 4, .k_len = 7, .q_heads = 4, .kv_heads = 2, .head_dim = 8,
          .v_dim = 8, .topk = 3, .shared = shared};
}

// Runs the forward and backward of `in` on both backends with `adjust` applied to the
// options; each must throw an Error mentioning `needle`, leaving every output untouched.
void expect_refused(const SparseSpec& s, const SparseInputs<float>& in, const std::string& needle,
                    const std::function<void(AttentionOptions&)>& adjust = [](AttentionOptions&) {}) {
  for (Backend backend : {Backend::reference, Backend::cpu}) {
    auto r = sparse_results<float>(s);
    for (auto* t : {&r.out, &r.dq, &r.dk, &r.dv}) fill(*t, kSentinel);
    fill(r.lse, kSentinel);
    AttentionOptions options = sparse_options(s, in.sinks, backend);
    adjust(options);
    const KeyIndices indices = indices_of(s, in.lists);
    expect_error(
        [&] {
          sparse_attention_forward(SparseForwardArgs<float>{.q = in.q.cview(), .k = in.k.cview(), .v = in.v.cview(),
                                                            .indices = indices, .out = r.out.view(),
                                                            .lse = r.lse.view()},
                                   options);
        },
        needle);
    expect_error(
        [&] {
          sparse_attention_backward(
              SparseBackwardArgs<float>{.q = in.q.cview(), .k = in.k.cview(), .v = in.v.cview(), .indices = indices,
                                        .out = in.dout.cview(), .lse = r.lse.cview(), .dout = in.dout.cview(),
                                        .dq = r.dq.view(), .dk = r.dk.view(), .dv = r.dv.view()},
              options);
        },
        needle);
    for (const auto* t : {&r.out, &r.dq, &r.dk, &r.dv})
      for (std::size_t i = 0; i < t->size(); ++i) ASSERT_EQ((*t)[i], kSentinel);
    for (std::size_t i = 0; i < r.lse.size(); ++i) ASSERT_EQ(r.lse[i], kSentinel);
  }
}

TEST(SparseErrors, IndexPastTheKeysNamesBatchAndRow) {
  for (bool shared : {true, false}) {
    const SparseSpec s = small_spec(shared);
    auto in = sparse_inputs<float>(s, 3);
    in.lists(1, shared ? 0 : 1, 2, 1) = s.k_len;  // one past the last key
    expect_refused(s, in, "(batch 1, query row 2): expected -1 (no key) or 0..6 (k.shape[1] = 7), got 7");
  }
}

TEST(SparseErrors, IndexBelowMinusOneNamesBatchAndRow) {
  const SparseSpec s = small_spec(true);
  auto in = sparse_inputs<float>(s, 4);
  in.lists(0, 0, 3, 0) = -2;
  expect_refused(s, in, "indices[0, 3, 0] (batch 0, query row 3)");
}

TEST(SparseErrors, ListsOfTheWrongShape) {
  SparseSpec s = small_spec(false);
  auto in = sparse_inputs<float>(s, 5);
  in.lists = Tensor<int64_t, 4>({s.batch, 3, s.q_len, s.topk});  // 3 lists, 2 kv heads
  expect_refused(s, in, "indices.shape[1] (heads): expected 2");
  s = small_spec(true);
  in = sparse_inputs<float>(s, 5);
  in.lists = Tensor<int64_t, 4>({s.batch, 1, s.q_len + 1, s.topk});
  expect_refused(s, in, "indices.shape[1] (queries): expected 4");
}

TEST(SparseErrors, MissingListsAreRefused) {
  const SparseSpec s = small_spec(true);
  auto r = sparse_results<float>(s);
  const auto in = sparse_inputs<float>(s, 6);
  expect_error(
      [&] {
        sparse_attention_forward(SparseForwardArgs<float>{.q = in.q.cview(), .k = in.k.cview(), .v = in.v.cview(),
                                                          .indices = {}, .out = r.out.view()});
      },
      "qkv::sparse_attention_forward: indices: required");
}

TEST(SparseErrors, OptionsTheKernelsDoNotTakeAreRefusedByName) {
  const SparseSpec s = small_spec(true);
  const auto in = sparse_inputs<float>(s, 7);
  Tensor<std::uint8_t, 4> keep({1, 1, 1, s.k_len});
  std::vector<int64_t> lengths(static_cast<std::size_t>(s.batch), s.k_len);
  std::vector<float> slopes(static_cast<std::size_t>(s.q_heads), 0.1f);
  expect_refused(s, in, "options.mask: not supported by sparse attention",
                 [&](AttentionOptions& o) { o.mask.keep = keep.cview(); });
  expect_refused(s, in, "options.key_lengths: not supported", [&](AttentionOptions& o) { o.key_lengths = lengths; });
  expect_refused(s, in, "options.window: not supported", [](AttentionOptions& o) { o.window.left = 2; });
  expect_refused(s, in, "options.alibi_slopes: not supported", [&](AttentionOptions& o) { o.alibi_slopes = slopes; });
  expect_refused(s, in, "options.dropout: not supported", [](AttentionOptions& o) { o.dropout.p = 0.1f; });
}

TEST(SparseErrors, DenseChecksNameTheSparseEntryPoint) {
  const SparseSpec s = small_spec(true);
  auto in = sparse_inputs<float>(s, 8);
  in.v = Tensor<float, 4>({s.batch, s.k_len + 1, s.kv_heads, s.v_dim});
  expect_refused(s, in, "v.shape[1] (seq): expected 7");
  auto r = sparse_results<float>(s);
  expect_error(
      [&] {
        sparse_attention_forward(SparseForwardArgs<float>{.q = in.q.cview(), .k = in.k.cview(), .v = in.v.cview(),
                                                          .indices = indices_of(s, in.lists), .out = r.out.view()});
      },
      "qkv::sparse_attention_forward: v.shape[1]");
}

}  // namespace
}  // namespace qkv::test
