// qkv._qkv: the compiled half of the Python package. The public API is in python/qkv/;
// everything here is internal and takes caller-allocated outputs.
#include <nanobind/nanobind.h>

#include "attention.hpp"
#include "debug.hpp"
#include "dist.hpp"
#include "decode.hpp"
#include "options.hpp"
#include "qkv/error.hpp"
#include "qkv/version.hpp"
#include "softmax.hpp"

namespace qkv::python {
void bind_varlen(nanobind::module_& m);   // varlen.cpp
void bind_dropout(nanobind::module_& m);  // dropout.cpp
void bind_batch_plan(nanobind::module_& m);  // batch_plan.cpp
void bind_sparse(nanobind::module_& m);      // sparse.cpp
void bind_index_topk(nanobind::module_& m);  // index_topk.cpp
void bind_mla(nanobind::module_& m);         // mla.cpp
void bind_rotary(nanobind::module_& m);      // rotary.cpp
}

NB_MODULE(_qkv, m) {
  m.doc() = "qkv's C++ library, bound with nanobind (internal: use the qkv package).";
  m.attr("__version__") = qkv::kVersion;
  // qkv::Error becomes qkv.Error, a ValueError carrying the C++ message unchanged.
  nanobind::exception<qkv::Error>(m, "Error", PyExc_ValueError);
  qkv::python::bind_options(m);
  qkv::python::bind_attention(m);
  qkv::python::bind_softmax(m);
  qkv::python::bind_varlen(m);
  qkv::python::bind_dropout(m);
  qkv::python::bind_debug(m);
  qkv::python::bind_dist(m);
  qkv::python::bind_decode(m);
  qkv::python::bind_batch_plan(m);
  qkv::python::bind_sparse(m);
  qkv::python::bind_index_topk(m);
  qkv::python::bind_mla(m);
  qkv::python::bind_rotary(m);
}
