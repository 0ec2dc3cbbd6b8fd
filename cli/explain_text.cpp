// `qkv explain`'s report as text: the tables and the sentences around them.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "explain.hpp"
#include "format.hpp"

namespace qkv::cli {
namespace {

// A table of d and, under each title, one column per label (unscaled and scaled, ...).
Table grouped_table(std::initializer_list<const char*> titles, std::initializer_list<const char*> labels) {
  Table table;
  table.add_column("d");
  for (const char* title : titles) {
    table.add_group(title, static_cast<int>(labels.size()));
    for (const char* label : labels) table.add_column(label);
  }
  return table;
}

std::string percent(double share) { return format("%.1f", 100.0 * share) + " %"; }

std::string pm(double value, double error) {
  return format("%.4g", value) + " ± " + format("%.2g", error);
}

std::string vector_string(const std::vector<double>& x, const char* spec) {
  std::string text = "(";
  for (std::size_t i = 0; i < x.size(); ++i) text += (i ? ", " : "") + format(spec, x[i]);
  return text + ")";
}

void print_matrix(std::ostream& out, const std::vector<double>& m, std::size_t n,
                  const char* label) {
  Table table;
  for (std::size_t j = 0; j < n; ++j) table.add_column("");
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<std::string> row;
    for (std::size_t j = 0; j < n; ++j) row.push_back(format("%.6g", m[i * n + j] == 0.0 ? 0.0 : m[i * n + j]));
    table.add_row(row);
  }
  std::ostringstream text;
  table.print(text, "");
  std::istringstream lines(text.str());
  std::string line;
  std::getline(lines, line);  // the empty header line
  std::size_t index = 0;
  const std::string pad(std::string(label).size(), ' ');
  while (std::getline(lines, line)) {
    out << "    " << (index == n / 2 - (n % 2 == 0 ? 1 : 0) ? label : pad.c_str()) << "│ " << line
        << " │\n";
    ++index;
  }
}

}  // namespace

void print_softmax_section(const ExplainResults& results, std::ostream& out) {
  const SoftmaxExample& huge = results.huge;
  const SoftmaxExample& moderate = results.moderate;
  out << "(d) softmax((1, 2, 3, 10⁶)) without overflow\n"
      << "    exp(10⁶) is " << format("%g", std::exp(huge.x[3]))
      << " in double precision: the textbook formula exp(x_i)/Σ exp(x_j) gives inf/inf.\n"
      << "    qkv subtracts the row maximum first: every exponent is ≤ 0, nothing overflows.\n\n"
      << "    s = softmax((1, 2, 3, 10⁶)) = " << vector_string(huge.s, "%.6g") << "\n"
      << "    J = diag(s) − s·sᵀ:\n";
  print_matrix(out, huge.jacobian, huge.s.size(), "J = ");
  out << "    A one-hot s has J = 0: no gradient flows back through this row at all.\n\n"
      << "    For contrast, s = softmax((1, 2, 3, 4)) = " << vector_string(moderate.s, "%.6g") << "\n";
  print_matrix(out, moderate.jacobian, moderate.s.size(), "J = ");
  out << "\n    The same logits as the additive mask of one attention row (attention_forward):\n"
      << "    weights " << vector_string(huge.attention_weights, "%.6g") << ", log-sum-exp "
      << format("%.10g", huge.attention_lse) << "\n";
}

void print_softcap_section(const ExplainResults& results, std::ostream& out) {
  const ExplainConfig& c = results.config;
  // 1 − bound, without cancellation: (L − 1)e^(−2c) / (1 + (L − 1)e^(−2c)).
  const double tail = static_cast<double>(c.keys - 1) * std::exp(-2.0 * c.softcap);
  out << "\n(e) Soft-capping: S ← c·tanh(S/c) (AttentionOptions::softcap; Gemma 2 uses c = 50), here c = "
      << format("%g", c.softcap) << "\n"
      << "    It bounds |S| < c, so no weight can exceed 1/(1 + (L − 1)·e^(−2c)) = 1 − "
      << format("%.3g", tail / (1.0 + tail)) << " (L = " << c.keys << ").\n"
      << "    tanh also squeezes the largest logits together, and the gradient reaching q carries\n"
      << "    its slope 1 − tanh²(S/c). The same rows as (b)–(c), with and without the cap:\n\n";
  Table table = grouped_table({"largest weight", "dead rows", "median ‖∂L/∂q‖"},
                              {"unscaled", "capped", "scaled+cap"});
  for (const DimResult& r : results.dims) {
    table.add_row({std::to_string(r.d), format("%.4f", r.unscaled.max_weight.mean),
                   format("%.4f", r.capped_unscaled.max_weight.mean),
                   format("%.4f", r.capped_scaled.max_weight.mean), percent(r.unscaled.dead.mean),
                   percent(r.capped_unscaled.dead.mean), percent(r.capped_scaled.dead.mean),
                   format("%.3g", r.unscaled.query_grad_norm.median),
                   format("%.3g", r.capped_unscaled.query_grad_norm.median),
                   format("%.3g", r.capped_scaled.query_grad_norm.median)});
  }
  table.print(out, "    ");
  const auto widest = std::max_element(results.dims.begin(), results.dims.end(),
                                       [](const DimResult& a, const DimResult& b) { return a.d < b.d; });
  out << "\n    Without 1/√d, at d = " << widest->d << ", the cap moves the largest weight "
      << format("%.3f", widest->unscaled.max_weight.mean) << " → "
      << format("%.3f", widest->capped_unscaled.max_weight.mean) << ", dead rows "
      << format("%.1f", 100.0 * widest->unscaled.dead.mean) << " % → "
      << format("%.1f", 100.0 * widest->capped_unscaled.dead.mean) << " %\n    and the median ‖∂L/∂q‖ "
      << format("%.3g", widest->unscaled.query_grad_norm.median) << " → "
      << format("%.3g", widest->capped_unscaled.query_grad_norm.median)
      << ".\n    With 1/√d the logits are ~N(0, 1), far inside the cap: it changes almost nothing"
         " (largest\n    weight "
      << format("%.4f", widest->scaled.max_weight.mean) << " uncapped, "
      << format("%.4f", widest->capped_scaled.max_weight.mean)
      << " capped).\n    The cap guards against runaway logits; 1/√d is what keeps them in range.\n";
}

void print_text(const ExplainResults& results, std::ostream& out) {
  const ExplainConfig& c = results.config;
  const double L = static_cast<double>(c.keys);
  out << "qkv explain — why attention divides its logits by √d\n"
      << "  " << c.samples << " rows per head dim d, " << c.keys
      << " keys per row, every entry of q and k i.i.d. N(0, 1), seed " << c.seed << ".\n"
      << "  Unscaled: S = q·kᵀ.  Scaled: S = q·kᵀ/√d (qkv's default).  Same rows for both.\n"
      << "  Weights from attention_forward (" << results.weights_backend
      << " backend), gradients from attention_backward\n  (" << results.backward_backend
      << " backend).\n\n";

  out << "(a) The variance of a logit grows like d\n"
      << "    Var(q·k) = Σ_c Var(q_c·k_c) = d, so unscaled logits are typically ±√d;\n"
      << "    Var(q·k/√d) = 1 for every d. Measured over n = " << c.samples
      << " samples; ± is one standard error,\n    √((2 + 6/d)/n)·theory.\n\n";
  {
    Table table;
    for (const char* h : {"d", "Var(q·k)", "theory", "Var(q·k/√d)", "theory"}) table.add_column(h);
    for (const DimResult& r : results.dims) {
      const double d = static_cast<double>(r.d);
      table.add_row({std::to_string(r.d), pm(r.var_unscaled, r.var_relative_std_error * d),
                     format("%g", d), pm(r.var_scaled, r.var_relative_std_error), "1"});
    }
    table.print(out, "    ");
  }

  out << "\n(b) Large logits saturate the softmax\n"
      << "    Mean over rows of the largest attention weight (uniform " << format("%.4g", 1.0 / L)
      << ", one-hot 1), of the\n    entropy −Σ P·ln P in nats (uniform ln " << c.keys << " = "
      << format("%.4g", std::log(L)) << ", one-hot 0), and the share of saturated rows\n"
      << "    (largest weight > " << format("%g", kSaturated)
      << "), from attention_forward's softmax statistics (return_stats).\n\n";
  {
    Table table = grouped_table({"largest weight", "entropy", "saturated rows"}, {"unscaled", "scaled"});
    for (const DimResult& r : results.dims) {
      table.add_row({std::to_string(r.d), format("%.4f", r.unscaled.max_weight.mean),
                     format("%.4f", r.scaled.max_weight.mean), format("%.4f", r.unscaled.entropy.mean),
                     format("%.4f", r.scaled.entropy.mean), percent(r.unscaled.saturated.mean),
                     percent(r.scaled.saturated.mean)});
    }
    table.print(out, "    ");
  }

  out << "\n(c) A saturated softmax passes back (almost) no gradient\n"
      << "    J = diag(P) − P·Pᵀ (softmax_jacobian). For an upstream gradient g = ∂L/∂P ~ N(0, I),\n"
      << "    ∂L/∂S = J·g. A row is dead when ‖J‖_F < " << format("%g", kDeadJacobian)
      << ": it passes back under 0.1 % of any g.\n"
      << "    ∂L/∂q is the query gradient attention_backward returns (V = I, dout = g).\n\n";
  {
    Table table = grouped_table({"mean ‖J‖_F", "median ‖∂L/∂S‖", "dead rows", "median ‖∂L/∂q‖"},
                                {"unscaled", "scaled"});
    for (const DimResult& r : results.dims) {
      table.add_row({std::to_string(r.d), format("%.4f", r.unscaled.jacobian_norm.mean),
                     format("%.4f", r.scaled.jacobian_norm.mean),
                     format("%.3g", r.unscaled.grad_norm.median), format("%.3g", r.scaled.grad_norm.median),
                     percent(r.unscaled.dead.mean), percent(r.scaled.dead.mean),
                     format("%.3g", r.unscaled.query_grad_norm.median),
                     format("%.3g", r.scaled.query_grad_norm.median)});
    }
    table.print(out, "    ");
  }

  // The conclusion, from the numbers of the first and the largest d.
  const auto widest = std::max_element(results.dims.begin(), results.dims.end(),
                                       [](const DimResult& a, const DimResult& b) { return a.d < b.d; });
  const auto narrowest = std::min_element(results.dims.begin(), results.dims.end(),
                                          [](const DimResult& a, const DimResult& b) { return a.d < b.d; });
  out << "\n    Without the scale, from d = " << narrowest->d << " to d = " << widest->d
      << ": largest weight " << format("%.3f", narrowest->unscaled.max_weight.mean) << " → "
      << format("%.3f", widest->unscaled.max_weight.mean) << ",\n    median ‖∂L/∂S‖ "
      << format("%.3g", narrowest->unscaled.grad_norm.median) << " → "
      << format("%.3g", widest->unscaled.grad_norm.median) << ", dead rows "
      << format("%.1f", 100.0 * narrowest->unscaled.dead.mean) << " % → "
      << format("%.1f", 100.0 * widest->unscaled.dead.mean)
      << " %.\n    The few near-tied rows that stay alive get large gradients, so training sees "
         "gradients\n    that are mostly zero and sometimes huge. With 1/√d, at d = "
      << widest->d << " the largest weight is " << format("%.3f", widest->scaled.max_weight.mean)
      << ",\n    the median ‖∂L/∂S‖ " << format("%.3g", widest->scaled.grad_norm.median) << " and "
      << format("%.1f", 100.0 * widest->scaled.dead.mean) << " % of rows are dead.\n\n";

  print_softmax_section(results, out);
  print_softcap_section(results, out);
}

}  // namespace qkv::cli
