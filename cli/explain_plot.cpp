// `qkv explain --plot`: the report as a gnuplot script (four charts on one page).
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>

#include "explain.hpp"
#include "format.hpp"

namespace qkv::cli {

std::string gnuplot_script(const ExplainResults& results) {
  const ExplainConfig& c = results.config;
  std::ostringstream s;
  const auto g = [](double v) { return format("%.9g", v); };
  s << "$variance << EOD\n# d  Var(q.k)  s.e.  Var(q.k/sqrt d)  s.e.\n";
  for (const DimResult& r : results.dims) {
    s << r.d << ' ' << g(r.var_unscaled) << ' ' << g(r.var_relative_std_error * static_cast<double>(r.d))
      << ' ' << g(r.var_scaled) << ' ' << g(r.var_relative_std_error) << '\n';
  }
  s << "EOD\n$rows << EOD\n"
    << "# d  maxw_u maxw_s  entropy/lnL_u _s  meanJ_u _s  median_dS_u _s  dead_u _s  median_dq_u _s\n";
  const double log_keys = std::log(static_cast<double>(c.keys));
  for (const DimResult& r : results.dims) {
    s << r.d << ' ' << g(r.unscaled.max_weight.mean) << ' ' << g(r.scaled.max_weight.mean) << ' '
      << g(r.unscaled.entropy.mean / log_keys) << ' ' << g(r.scaled.entropy.mean / log_keys) << ' '
      << g(r.unscaled.jacobian_norm.mean) << ' ' << g(r.scaled.jacobian_norm.mean) << ' '
      << g(r.unscaled.grad_norm.median) << ' ' << g(r.scaled.grad_norm.median) << ' '
      << g(r.unscaled.dead.mean) << ' ' << g(r.scaled.dead.mean) << ' '
      << g(r.unscaled.query_grad_norm.median) << ' ' << g(r.scaled.query_grad_norm.median) << '\n';
  }
  s << "EOD\n";
  const auto [dmin, dmax] = std::minmax_element(c.dims.begin(), c.dims.end());
  s << "set xrange [" << g(static_cast<double>(*dmin) / 1.6) << ":" << g(static_cast<double>(*dmax) * 1.6)
    << "]\n"
    << "set logscale x 2\nset grid\nset key top left box opaque\nset pointsize 1.2\n"
    << "set xlabel 'head dim d'\n"
    << "red = '#c0392b'; blue = '#2563eb'\n"
    << "set multiplot layout 2,2 title \"qkv explain — why attention divides its logits by √d   ("
    << c.samples << " rows per d, " << c.keys << " keys, seed " << c.seed << ")\" font ',13'\n";
  // 1: variance of the logits.
  s << "set title 'Variance of a logit: grows like d without the scale'\n"
    << "set logscale y 10\nset ylabel 'variance'\nset format y '%g'\n"
    << "plot $variance using 1:2:(2*$3) with yerrorbars pt 7 lc rgb red title 'Var(q·k), measured ±2 s.e.', \\\n"
    << "     x with lines dt 2 lc rgb red title 'theory: d', \\\n"
    << "     $variance using 1:4:(2*$5) with yerrorbars pt 5 lc rgb blue title 'Var(q·k/√d), measured', \\\n"
    << "     1 with lines dt 2 lc rgb blue title 'theory: 1'\n";
  // 2: saturation.
  s << "set title 'Softmax saturation: rows go one-hot without the scale'\n"
    << "unset logscale y\nset yrange [0:1.05]\nset ylabel 'mean over rows'\nset key center right\n"
    << "plot $rows using 1:2 with linespoints pt 7 lc rgb red title 'largest weight, unscaled', \\\n"
    << "     $rows using 1:3 with linespoints pt 5 lc rgb blue title 'largest weight, scaled', \\\n"
    << "     $rows using 1:4 with linespoints pt 6 dt 2 lc rgb red title 'entropy / ln L, unscaled', \\\n"
    << "     $rows using 1:5 with linespoints pt 4 dt 2 lc rgb blue title 'entropy / ln L, scaled'\n";
  // 3: gradient norms (log scale: the median collapses by orders of magnitude).
  s << "set title 'Gradient through the softmax: vanishes without the scale'\n"
    << "set autoscale y\nset logscale y 10\nset format y '10^{%T}'\nset ylabel 'norm'\nset key bottom left\n"
    << "plot $rows using 1:8 with linespoints pt 7 lc rgb red title 'median ‖∂L/∂S‖, unscaled', \\\n"
    << "     $rows using 1:9 with linespoints pt 5 lc rgb blue title 'median ‖∂L/∂S‖, scaled', \\\n"
    << "     $rows using 1:6 with linespoints pt 6 dt 2 lc rgb red title 'mean ‖J‖_F, unscaled', \\\n"
    << "     $rows using 1:7 with linespoints pt 4 dt 2 lc rgb blue title 'mean ‖J‖_F, scaled'\n";
  // 4: dead rows.
  s << "set title 'Rows whose softmax passes back < 0.1 % of any gradient (‖J‖_F < 10^{-3})'\n"
    << "unset logscale y\nset format y '%g%%'\nset yrange [-2:102]\nset ylabel 'share of rows'\n"
    << "set key top left\n"
    << "plot $rows using 1:(100*$10) with linespoints pt 7 lc rgb red title 'unscaled', \\\n"
    << "     $rows using 1:(100*$11) with linespoints pt 5 lc rgb blue title 'scaled'\n"
    << "unset multiplot\n";
  return s.str();
}

}  // namespace qkv::cli
