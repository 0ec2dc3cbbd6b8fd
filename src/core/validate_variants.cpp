// Checks of the variant options (window, ALiBi, soft-cap, sinks, dropout, score_mod and
// mask_mod), shared by the dense and varlen validators, and their normalized form for
// the backends.
#include <cmath>
#include <string>

#include "core/attention_rules.hpp"
#include "core/validate.hpp"

namespace qkv::detail {
namespace {

void expect_per_head(const Checker& check, std::span<const float> values, const char* name,
                     int64_t q_heads) {
  if (values.empty()) return;
  if (static_cast<int64_t>(values.size()) != q_heads) {
    check.fail(std::string(name) + ": expected one value per query head (" +
               std::to_string(q_heads) + "), got " + std::to_string(values.size()));
  }
  for (std::size_t h = 0; h < values.size(); ++h) {
    if (!std::isfinite(values[h])) {
      check.fail(std::string(name) + "[" + std::to_string(h) + "]: expected a finite value, got " +
                 std::to_string(values[h]));
    }
  }
}

// score_mod / mask_mod hooks (qkv/modifiers.hpp): complete, and not combined with what
// the kernels cannot honour.
void check_programmable(const Checker& check, const AttentionOptions& options) {
  const ScoreModHook& score = options.modifiers.score;
  if (score.active() && (score.tile == nullptr || score.value == nullptr)) {
    check.fail("options.modifiers.score: expected a hook made by qkv::score_mod (tile and value "
               "functions both set), got one with a null function");
  }
  const MaskModHook& mask = options.modifiers.mask;
  if (mask.active() && (mask.count == nullptr || mask.apply == nullptr || mask.keeps == nullptr)) {
    check.fail("options.modifiers.mask: expected a hook made by qkv::mask_mod (count, apply and "
               "keeps functions all set), got one with a null function");
  }
  if (mask.active() && !options.mask.bias.empty()) {
    check.fail("options.modifiers.mask: not supported together with options.mask.bias (fold the "
               "bias into a score_mod, or its removed keys into the mask_mod)");
  }
}

void check_modifier_gradient(const Checker& check, const AttentionOptions& options) {
  const ScoreModHook& score = options.modifiers.score;
  if (score.active() && score.derivative == nullptr) {
    check.fail("options.modifiers.score: the backward needs d score_mod / d score; make the "
               "hook with qkv::score_mod(mod, derivative), got one without a derivative");
  }
}

}  // namespace

void check_variants(const Checker& check, const AttentionOptions& options, const Extents& e,
                    MaskRule& mask, ScoreModifiers& modifiers) {
  const Window& window = options.window;
  if (window.left < -1 || window.right < -1) {
    check.fail("options.window: expected left and right >= 0, or -1 for unbounded, got (" +
               std::to_string(window.left) + ", " + std::to_string(window.right) + ")");
  }
  // A bound past any sequence length means unbounded; normalizing it keeps the kernels'
  // position arithmetic (i + offset + right + 1) from overflowing.
  constexpr int64_t kUnbounded = int64_t{1} << 62;
  mask.window = {window.left >= kUnbounded ? -1 : window.left, window.right >= kUnbounded ? -1 : window.right};
  expect_per_head(check, options.alibi_slopes, "options.alibi_slopes", e.q_heads);
  expect_per_head(check, options.sinks, "options.sinks", e.q_heads);
  if (!std::isfinite(options.softcap) || options.softcap < 0.0f) {
    check.fail("options.softcap: expected 0 (off) or a finite value > 0, got " +
               std::to_string(options.softcap));
  }
  const float p = options.dropout.p;
  if (!(p >= 0.0f && p < 1.0f)) {
    check.fail("options.dropout.p: expected a probability in [0, 1), got " + std::to_string(p));
  }
  check_programmable(check, options);
  mask.mask_mod = options.modifiers.mask;
  modifiers.score_mod = options.modifiers.score;
  mask.has_sinks = !options.sinks.empty();
  modifiers.softcap = options.softcap;
  modifiers.alibi_slopes = options.alibi_slopes;
  modifiers.sinks = options.sinks;
  modifiers.dropout = options.dropout;
}

namespace {

void check_sink_gradient(const Checker& check, const AttentionOptions& options,
                         std::span<float> dsinks, int64_t q_heads) {
  if (dsinks.empty()) return;
  if (options.sinks.empty()) {
    check.fail("dsinks: given, but options.sinks is empty (no sinks, no gradient)");
  }
  if (static_cast<int64_t>(dsinks.size()) != q_heads) {
    check.fail("dsinks: expected one value per query head (" + std::to_string(q_heads) +
               "), got " + std::to_string(dsinks.size()));
  }
}

void check_alibi_gradient(const Checker& check, const AttentionOptions& options,
                          std::span<float> dalibi_slopes, int64_t q_heads) {
  if (dalibi_slopes.empty()) return;
  if (options.alibi_slopes.empty()) {
    check.fail("dalibi_slopes: given, but options.alibi_slopes is empty (no slopes, no gradient)");
  }
  if (static_cast<int64_t>(dalibi_slopes.size()) != q_heads) {
    check.fail("dalibi_slopes: expected one value per query head (" + std::to_string(q_heads) +
               "), got " + std::to_string(dalibi_slopes.size()));
  }
  if (options.modifiers.score.active()) {
    check.fail("dalibi_slopes: not computed together with a score_mod (modifiers.score); "
               "write the ALiBi term inside the score_mod instead");
  }
}

}  // namespace

void check_variant_gradients(const Checker& check, const AttentionOptions& options,
                             std::span<float> dsinks, std::span<float> dalibi_slopes,
                             int64_t q_heads) {
  check_sink_gradient(check, options, dsinks, q_heads);
  check_alibi_gradient(check, options, dalibi_slopes, q_heads);
  check_modifier_gradient(check, options);
}

}  // namespace qkv::detail
