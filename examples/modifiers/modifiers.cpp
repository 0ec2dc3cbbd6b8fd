// Programmable attention modifiers: a score_mod and a mask_mod written as C++ lambdas,
// run inside qkv's fused CPU kernels, forward and backward (qkv/modifiers.hpp has the
// contract). Three documents packed into one sequence of 384 tokens:
//   mask_mod   a query sees only earlier keys of its own document (causal document mask);
//              tiles that cross documents are skipped, not computed and masked
//   score_mod  a learned relative-position bias per head, read from a table captured by
//              pointer, plus Gemma 2's soft-cap as a score_mod, with their derivative
// Then two checks a user can trust: documents do not see each other (changing document 0
// leaves document 1's output bit for bit), and the soft-cap score_mod agrees with the
// built-in options.softcap.
#include <qkv/qkv.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

int main() {
  constexpr int64_t heads = 4, seq = 384, dim = 32;
  const std::vector<int64_t> starts{0, 100, 290};  // documents [0,100), [100,290), [290,384)
  std::vector<int32_t> document(seq);
  for (int64_t i = 0; i < seq; ++i) document[i] = i >= starts[2] ? 2 : i >= starts[1] ? 1 : 0;

  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  qkv::Tensor<float, 4> q({1, seq, heads, dim}), k(q.shape()), v(q.shape()), out(q.shape()),
      dout(q.shape()), dq(q.shape()), dk(q.shape()), dv(q.shape());
  for (auto* t : {&q, &k, &v, &dout})
    for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = normal(rng);
  qkv::Tensor<float, 3> lse({1, heads, seq});
  std::vector<float> bias_table(heads * seq);  // bias of distance i − j ∈ [0, seq), per head
  for (std::size_t x = 0; x < bias_table.size(); ++x) bias_table[x] = -0.01f * static_cast<float>(x % seq);

  // The modifiers own copies of what they capture by value; `doc` and `table` point at
  // vectors that outlive every call below. `auto s` lets the fp64 reference evaluate the
  // score_mod in double.
  const int32_t* doc = document.data();
  const float* table = bias_table.data();
  const float cap = 10.0f;
  const auto causal_documents = qkv::mask_mod(
      [doc](int64_t, int64_t, int64_t i, int64_t j) { return j <= i && doc[i] == doc[j]; },
      {.varies_with_head = false});
  const auto biased_softcap = qkv::score_mod(
      [table, cap](auto s, int64_t, int64_t h, int64_t i, int64_t j) {
        // Called also for pairs the mask removes (j > i here): keep every index valid.
        return cap * std::tanh(s / cap) + table[h * seq + (i > j ? i - j : 0)];
      },
      [cap](auto s, int64_t, int64_t, int64_t, int64_t) {  // d mod / d s
        const auto t = std::tanh(s / cap);
        return 1 - t * t;
      });

  qkv::AttentionOptions options;
  options.modifiers = {.score = biased_softcap, .mask = causal_documents};
  auto forward = [&](qkv::Tensor<float, 4>& keys, const qkv::AttentionOptions& o) {
    qkv::attention_forward({.q = q.cview(), .k = keys.cview(), .v = v.cview(), .out = out.view(),
                            .lse = lse.view()}, o);
  };
  forward(k, options);
  qkv::attention_backward({.q = q.cview(), .k = k.cview(), .v = v.cview(), .out = out.cview(),
                           .lse = lse.cview(), .dout = dout.cview(), .dq = dq.view(),
                           .dk = dk.view(), .dv = dv.view()},
                          options);
  std::printf("forward and backward with a document mask_mod and a biased soft-cap score_mod: "
              "out[0,200,0,0] = %.6f, dq[0,200,0,0] = %.6f\n", out(0, 200, 0, 0), dq(0, 200, 0, 0));

  // Documents do not see each other: new keys in document 0, same output for document 1.
  const qkv::Tensor<float, 4> before = out;
  qkv::Tensor<float, 4> k2 = k;
  for (int64_t j = 0; j < starts[1]; ++j)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t c = 0; c < dim; ++c) k2(0, j, h, c) += 1.0f;
  forward(k2, options);
  bool isolated = true;
  for (int64_t i = starts[1]; i < starts[2]; ++i)
    isolated = isolated && std::memcmp(&before(0, i, 0, 0), &out(0, i, 0, 0), heads * dim * sizeof(float)) == 0;
  std::printf("document 1 unchanged when document 0's keys change: %s\n", isolated ? "yes" : "NO");

  // The soft-cap as a score_mod against the built-in (Highway's Tanh vs std::tanh: a few
  // float roundings apart).
  const auto softcap = qkv::score_mod(
      [cap](float s, int64_t, int64_t, int64_t, int64_t) { return cap * std::tanh(s / cap); });
  qkv::AttentionOptions programmable, builtin;
  programmable.modifiers.score = softcap;
  builtin.softcap = cap;
  forward(k, programmable);
  const qkv::Tensor<float, 4> by_mod = out;
  forward(k, builtin);
  double worst = 0.0;
  for (std::size_t x = 0; x < out.size(); ++x) worst = std::max(worst, std::abs(static_cast<double>(out[x]) - by_mod[x]));
  std::printf("soft-cap score_mod vs built-in options.softcap: max |difference| = %.2e\n", worst);
  return isolated && worst < 1e-5 ? 0 : 1;
}
