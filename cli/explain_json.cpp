// `qkv explain --json`: every number of the report, keys in a fixed order.
#include <cstdint>
#include <ostream>
#include <utility>

#include "explain.hpp"
#include "json.hpp"

namespace qkv::cli {

void print_json(const ExplainResults& results, std::ostream& out) {
  const ExplainConfig& c = results.config;
  Json json;
  json["seed"] = static_cast<int64_t>(c.seed);
  json["samples"] = c.samples;
  json["keys"] = c.keys;
  json["dims"] = c.dims;
  json["dead_jacobian_threshold"] = json_number(kDeadJacobian);
  json["saturation_threshold"] = json_number(kSaturated);
  json["softcap"] = json_number(c.softcap);
  json["softcap_weight_bound"] = json_number(softcap_weight_bound(c.softcap, c.keys));
  json["backends"] = {{"weights", results.weights_backend}, {"backward", results.backward_backend}};

  Json& variance = json["variance"] = Json::array();
  for (const DimResult& r : results.dims) {
    variance.push_back({{"d", r.d},
                        {"unscaled", json_number(r.var_unscaled)},
                        {"unscaled_theory", r.d},
                        {"scaled", json_number(r.var_scaled)},
                        {"scaled_theory", 1},
                        {"relative_std_error", json_number(r.var_relative_std_error)}});
  }

  const auto estimate = [](const Estimate& e) {
    return Json{{"mean", json_number(e.mean)}, {"std_error", json_number(e.std_error)},
                {"median", json_number(e.median)}};
  };
  const auto stats = [&](const RowStats& s) {
    return Json{{"max_weight", estimate(s.max_weight)},
                {"entropy", estimate(s.entropy)},
                {"jacobian_norm", estimate(s.jacobian_norm)},
                {"grad_norm", estimate(s.grad_norm)},
                {"query_grad_norm", estimate(s.query_grad_norm)},
                {"dead", estimate(s.dead)},
                {"saturated", estimate(s.saturated)}};
  };
  Json& rows = json["rows"] = Json::array();
  for (const DimResult& r : results.dims) {
    rows.push_back({{"d", r.d},
                    {"unscaled", stats(r.unscaled)},
                    {"scaled", stats(r.scaled)},
                    {"capped_unscaled", stats(r.capped_unscaled)},
                    {"capped_scaled", stats(r.capped_scaled)}});
  }

  Json& softmax = json["softmax"] = Json::array();
  for (const SoftmaxExample* e : {&results.huge, &results.moderate}) {
    Json jacobian = Json::array();
    const std::size_t n = e->x.size();
    for (std::size_t i = 0; i < n; ++i) {
      Json row = Json::array();
      for (std::size_t j = 0; j < n; ++j) row.push_back(json_number(e->jacobian[i * n + j]));
      jacobian.push_back(std::move(row));
    }
    softmax.push_back({{"x", json_numbers(e->x)},
                       {"s", json_numbers(e->s)},
                       {"jacobian", std::move(jacobian)},
                       {"attention_weights", json_numbers(e->attention_weights)},
                       {"attention_lse", json_number(e->attention_lse)}});
  }
  write_json(json, out);
}

}  // namespace qkv::cli
