// Running a validated problem: the one place a backend is called. Entry points validate
// (core/validate.hpp, or their own validator for caches) and hand the problem here; the
// cpu backend then picks its schedule (cpu/forward_schedule.cpp).
#pragma once

#include "core/problem.hpp"
#include "qkv/options.hpp"

namespace qkv::cpu {
struct DecodePlan;
}

namespace qkv::detail {

// `backend` is resolved (qkv::resolve_backend): reference or cpu.
void run_forward(const ForwardProblem<float>& problem, Backend backend);
// A problem whose split-K plan was made ahead (qkv::BatchPlan; null: planned here): the
// cpu backend runs that schedule, the reference its fp64 oracle.
void run_planned_forward(const ForwardProblem<float>& problem, Backend backend, const cpu::DecodePlan* planned);

}  // namespace qkv::detail
