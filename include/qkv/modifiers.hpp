// Programmable score and mask modifiers (FlexAttention's score_mod / mask_mod) for the
// fused CPU kernels and the fp64 reference, forward and backward.
//
//   const auto bias = qkv::score_mod(
//       [table](auto score, int64_t b, int64_t h, int64_t i, int64_t j) {
//         return score + table[h * 1023 + (i - j + 511)];          // relative-position bias
//       },
//       [](auto, int64_t, int64_t, int64_t, int64_t) { return 1.0f; });  // d mod / d score
//   const auto docs = qkv::mask_mod(
//       [doc](int64_t, int64_t, int64_t i, int64_t j) { return doc[i] == doc[j]; },
//       {.varies_with_head = false});
//   qkv::AttentionOptions options;
//   options.modifiers = {.score = bias, .mask = docs};  // refers to `bias` and `docs`
//   qkv::attention_forward(args, options);
//
// score_mod(score, b, h, i, j) → new score. `score` is the scaled logit scale·q_i·k_j of
//   entry b, query head h, query i, key j, after the built-in soft-cap and ALiBi when
//   those are set too; the result goes on to the mask's bias and the softmax. For the
//   backward, give its derivative d mod / d score with the same signature (evaluated at
//   the same score): the kernels recompute the raw score, apply the mod and multiply dS
//   by the derivative. The built-in variants are such mods:
//     soft-cap c:  mod = c·tanh(s/c),        derivative = 1 − tanh²(s/c)
//     ALiBi slope: mod = s − slope·|i + Nk − Nq − j|,  derivative = 1
//   (the built-ins stay faster: their tile code is vectorized for every SIMD target).
// mask_mod(b, h, i, j) → bool: true keeps key j for query i (like a boolean mask; it is
//   combined with causality, windows, key_lengths and mask.keep: a key takes part only
//   if all of them keep it). Before any kernel runs, mask_mod is evaluated once per call
//   over every (query, key) pair the other masks leave, and each 64×64 tile is classed
//   empty (skipped: no product, no exp, no score_mod call), full (no mask work) or
//   partial (mask_mod evaluated again, elementwise, inside the kernel). With
//   {.varies_with_head = false} it is evaluated for head 0 only and the classes are
//   shared by every head (as FlexAttention's H=None): then it must not depend on h.
//
// The contract (what the kernels rely on; breaking it gives wrong results, not errors):
// - Pure and deterministic: the result depends only on the arguments and on data that
//   does not change during the call. It may be called in any order, from several
//   threads at once, any number of times for the same arguments (forward and backward
//   each evaluate it again), and also for pairs that other masks remove; results for
//   removed pairs are discarded. As long as this holds, results are bitwise identical
//   for any thread count.
// - Thread-safe and non-throwing: it runs inside OpenMP regions (an exception there ends
//   the program). Mutable lambdas are refused at compile time (they are called as const).
// - Captures: by value (copied into the qkv::ScoreMod / qkv::MaskMod object), or pointers
//   and references to data that outlives the call. The ScoreMod / MaskMod object itself
//   must outlive every call whose options refer to it (options hold a non-owning
//   reference, like the masks' views; binding a temporary does not compile).
// - Indices: b is the batch entry (varlen: the sequence), h the query head (GQA: not the
//   key/value head), i and j positions within the entry: 0 ≤ i < its query length,
//   0 ≤ j < its key length (the views' key extent; with key_lengths, keys past an
//   entry's length may be passed and their results are discarded).
// - Precision: the kernels call score_mod with a float score. The reference backend (the
//   fp64 oracle) calls it with a double score when it returns double for one — write the
//   score parameter as `auto` to give the oracle full precision — and with a float score
//   otherwise. The derivative likewise.
// - Non-finite results: a NaN (or +inf) score_mod result poisons its query row, as a NaN
//   input does (that row's out and lse become NaN; no other output row is touched). A
//   −inf result gives the key weight 0, but unlike mask_mod it does not remove the key
//   (a NaN in its V row may still reach the row); remove keys with mask_mod. A row all
//   of whose keys are removed has out 0, lse −inf and zero gradients.
//
// Cost: the kernels call each modifier once per 64×64 tile through one indirect call;
// the loop over the tile's entries is the template below, compiled in *your* translation
// unit with your flags, with your callable inlined in it (build with -O2 and your
// -march to let the compiler vectorize it). Refused combinations (qkv::Error): a
// score_mod without derivative in a backward, mask_mod together with mask.bias (fold the
// bias into score_mod), and ring attention (qkv::dist) with any modifier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

namespace qkv {

// What the kernels hand a modifier: one tile, stored transposed as the kernels keep it.
namespace hooks {

// scores[j·ld + i] is the score of query first_query + i and key first_key + j
// (0 ≤ i < queries, 0 ≤ j < keys); `derivative` (null in the forward) takes
// d mod / d score in the same layout.
struct ScoreTile {
  float* scores = nullptr;
  float* derivative = nullptr;
  std::size_t ld = 0;
  int64_t batch = 0, head = 0;
  int64_t first_query = 0, queries = 0;
  int64_t first_key = 0, keys = 0;
};

// For the plan: query first_query + r (r < queries) counts keys [key_begin[r], key_end[r]).
struct MaskCount {
  int64_t batch = 0, head = 0;
  int64_t first_query = 0, queries = 0;
  const int32_t* key_begin = nullptr;
  const int32_t* key_end = nullptr;
};

}  // namespace hooks

// A score_mod as the library sees it: type-erased, non-owning (made by qkv::ScoreMod).
struct ScoreModHook {
  const void* context = nullptr;
  // Kernels: every score of the tile through the mod (and its derivative when asked).
  void (*tile)(const void* context, const hooks::ScoreTile& tile) = nullptr;
  // Reference: one score, and its derivative (null without one).
  double (*value)(const void* context, double score, int64_t b, int64_t h, int64_t i,
                  int64_t j) = nullptr;
  double (*derivative)(const void* context, double score, int64_t b, int64_t h, int64_t i,
                       int64_t j) = nullptr;

  bool active() const { return tile != nullptr || value != nullptr || derivative != nullptr; }
};

// A mask_mod as the library sees it: type-erased, non-owning (made by qkv::MaskMod).
struct MaskModHook {
  const void* context = nullptr;
  // Plan: how many of the listed pairs it keeps.
  int64_t (*count)(const void* context, const hooks::MaskCount& rows) = nullptr;
  // Kernels: scores of removed pairs become −inf (tile.derivative is ignored).
  void (*apply)(const void* context, const hooks::ScoreTile& tile) = nullptr;
  // Reference: one pair.
  bool (*keeps)(const void* context, int64_t b, int64_t h, int64_t i, int64_t j) = nullptr;
  bool varies_with_head = true;

  bool active() const { return count != nullptr || apply != nullptr || keeps != nullptr; }
};

// AttentionOptions::modifiers. Default: none.
struct Modifiers {
  ScoreModHook score;
  MaskModHook mask;
  bool active() const { return score.active() || mask.active(); }
};

// No derivative: the mod can be used in forward calls only.
struct NoDerivative {};

namespace modifier_detail {

template <class F>
constexpr bool score_callable() {
  if constexpr (std::is_same_v<F, NoDerivative>) {
    return true;  // checked where it matters: no backward without a derivative
  } else if constexpr (std::is_invocable_v<const F&, float, int64_t, int64_t, int64_t, int64_t>) {
    return std::is_convertible_v<
        std::invoke_result_t<const F&, float, int64_t, int64_t, int64_t, int64_t>, float>;
  } else {
    return false;
  }
}

// Does F give a double for a double score (a generic `auto score`)? Then the reference
// evaluates it in double.
template <class F>
constexpr bool returns_double() {
  if constexpr (std::is_invocable_v<const F&, double, int64_t, int64_t, int64_t, int64_t>) {
    return std::is_same_v<
        std::remove_cvref_t<std::invoke_result_t<const F&, double, int64_t, int64_t, int64_t, int64_t>>,
        double>;
  } else {
    return false;
  }
}

template <class F>
double evaluate(const F& f, double score, int64_t b, int64_t h, int64_t i, int64_t j) {
  if constexpr (returns_double<F>()) {
    return f(score, b, h, i, j);
  } else {
    return static_cast<double>(f(static_cast<float>(score), b, h, i, j));
  }
}

}  // namespace modifier_detail

// Owns a score_mod (and optionally its derivative); converts to the ScoreModHook that
// AttentionOptions::modifiers.score holds. Neither copyable nor movable: the hook points
// at it. Make one with qkv::score_mod.
template <class F, class D = NoDerivative>
class ScoreMod {
  static_assert(!std::is_same_v<F, NoDerivative> && modifier_detail::score_callable<F>(),
                "score_mod: expected a const-callable (float score, int64_t b, int64_t h, "
                "int64_t i, int64_t j) -> float");
  static constexpr bool kHasDerivative = !std::is_same_v<D, NoDerivative>;
  static_assert(modifier_detail::score_callable<D>(),
                "score_mod derivative: expected a const-callable (float score, int64_t b, "
                "int64_t h, int64_t i, int64_t j) -> float");

 public:
  explicit ScoreMod(F mod, D derivative = {})
      : mod_(std::move(mod)), derivative_(std::move(derivative)) {}
  ScoreMod(const ScoreMod&) = delete;
  ScoreMod& operator=(const ScoreMod&) = delete;

  ScoreModHook hook() const& {
    ScoreModHook h;
    h.context = this;
    h.tile = &tile;
    h.value = &value;
    if constexpr (kHasDerivative) h.derivative = &slope;
    return h;
  }
  operator ScoreModHook() const& { return hook(); }  // NOLINT(google-explicit-constructor)
  operator ScoreModHook() const&& = delete;          // a temporary would dangle

 private:
  // The loop the kernels run, one call per tile: along a key row the queries are
  // contiguous, so the compiler can vectorize the inlined mod over i.
  static void tile(const void* context, const hooks::ScoreTile& t) {
    const ScoreMod& self = *static_cast<const ScoreMod*>(context);
    const F& mod = self.mod_;
    for (int64_t j = 0; j < t.keys; ++j) {
      float* row = t.scores + static_cast<std::size_t>(j) * t.ld;
      const int64_t key = t.first_key + j;
      if constexpr (kHasDerivative) {
        if (t.derivative != nullptr) {
          float* slopes = t.derivative + static_cast<std::size_t>(j) * t.ld;
          const D& derivative = self.derivative_;
          for (int64_t i = 0; i < t.queries; ++i) {
            const float score = row[i];
            row[i] = static_cast<float>(mod(score, t.batch, t.head, t.first_query + i, key));
            slopes[i] = static_cast<float>(derivative(score, t.batch, t.head, t.first_query + i, key));
          }
          continue;
        }
      }
      for (int64_t i = 0; i < t.queries; ++i)
        row[i] = static_cast<float>(mod(row[i], t.batch, t.head, t.first_query + i, key));
    }
  }
  static double value(const void* context, double score, int64_t b, int64_t h, int64_t i,
                      int64_t j) {
    return modifier_detail::evaluate(static_cast<const ScoreMod*>(context)->mod_, score, b, h, i, j);
  }
  static double slope(const void* context, double score, int64_t b, int64_t h, int64_t i,
                      int64_t j) {
    if constexpr (kHasDerivative) {
      return modifier_detail::evaluate(static_cast<const ScoreMod*>(context)->derivative_, score, b,
                                       h, i, j);
    } else {
      return 1.0;
    }
  }

  F mod_;
  [[no_unique_address]] D derivative_;
};

struct MaskModOptions {
  // false: mask_mod does not depend on h; the plan evaluates it once per entry, not once
  // per head, and the tile classes are shared by every head.
  bool varies_with_head = true;
};

// Owns a mask_mod; converts to the MaskModHook that AttentionOptions::modifiers.mask
// holds. Make one with qkv::mask_mod.
template <class F>
class MaskMod {
  static_assert(std::is_invocable_r_v<bool, const F&, int64_t, int64_t, int64_t, int64_t>,
                "mask_mod: expected a const-callable (int64_t b, int64_t h, int64_t i, "
                "int64_t j) -> bool");

 public:
  explicit MaskMod(F mod, MaskModOptions options = {})
      : mod_(std::move(mod)), options_(options) {}
  MaskMod(const MaskMod&) = delete;
  MaskMod& operator=(const MaskMod&) = delete;

  MaskModHook hook() const& {
    MaskModHook h;
    h.context = this;
    h.count = &count;
    h.apply = &apply;
    h.keeps = &keeps;
    h.varies_with_head = options_.varies_with_head;
    return h;
  }
  operator MaskModHook() const& { return hook(); }  // NOLINT(google-explicit-constructor)
  operator MaskModHook() const&& = delete;          // a temporary would dangle

 private:
  static int64_t count(const void* context, const hooks::MaskCount& rows) {
    const F& mod = static_cast<const MaskMod*>(context)->mod_;
    int64_t kept = 0;
    for (int64_t r = 0; r < rows.queries; ++r) {
      const int64_t query = rows.first_query + r;
      for (int64_t j = rows.key_begin[r]; j < rows.key_end[r]; ++j)
        kept += mod(rows.batch, rows.head, query, j) ? 1 : 0;
    }
    return kept;
  }
  static void apply(const void* context, const hooks::ScoreTile& t) {
    const F& mod = static_cast<const MaskMod*>(context)->mod_;
    constexpr float kRemoved = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < t.keys; ++j) {
      float* row = t.scores + static_cast<std::size_t>(j) * t.ld;
      const int64_t key = t.first_key + j;
      for (int64_t i = 0; i < t.queries; ++i)
        row[i] = mod(t.batch, t.head, t.first_query + i, key) ? row[i] : kRemoved;
    }
  }
  static bool keeps(const void* context, int64_t b, int64_t h, int64_t i, int64_t j) {
    return static_cast<const MaskMod*>(context)->mod_(b, h, i, j);
  }

  F mod_;
  MaskModOptions options_;
};

// qkv::score_mod(mod): forward only. qkv::score_mod(mod, derivative): forward and backward.
template <class F>
ScoreMod<std::decay_t<F>> score_mod(F&& mod) {
  return ScoreMod<std::decay_t<F>>(std::forward<F>(mod));
}
template <class F, class D>
ScoreMod<std::decay_t<F>, std::decay_t<D>> score_mod(F&& mod, D&& derivative) {
  return ScoreMod<std::decay_t<F>, std::decay_t<D>>(std::forward<F>(mod),
                                                    std::forward<D>(derivative));
}
template <class F>
MaskMod<std::decay_t<F>> mask_mod(F&& mod, MaskModOptions options = {}) {
  return MaskMod<std::decay_t<F>>(std::forward<F>(mod), options);
}

}  // namespace qkv
