// Bindings of the ring-attention plan and the LSE merge (qkv/dist/ring_plan.hpp,
// qkv/merge.hpp) for qkv.dist, which runs the same schedule as qkv::dist over
// torch.distributed. No MPI here.
#pragma once

#include <nanobind/nanobind.h>

namespace qkv::python {

void bind_dist(nanobind::module_& m);

}  // namespace qkv::python
