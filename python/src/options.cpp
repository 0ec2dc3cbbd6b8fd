#include "options.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "arrays.hpp"
#include "qkv/error.hpp"
#include "qkv/names.hpp"

namespace qkv::python {
namespace {

namespace nb = nanobind;

// numbers.Real / numbers.Integral, for the scalars that are neither float nor int (NumPy
// scalars): imported on first need and kept for the life of the process.
bool is_instance_of_numbers(nb::handle value, const char* abc) {
  static PyObject* numbers = PyImport_ImportModule("numbers");
  if (numbers == nullptr) throw nb::python_error();
  const nb::object type = nb::steal(PyObject_GetAttrString(numbers, abc));
  const int result = PyObject_IsInstance(value.ptr(), type.ptr());
  if (result < 0) throw nb::python_error();
  return result == 1;
}

std::string type_and_repr(nb::handle value) {
  return std::string(nb::type_name(value.type()).c_str()) + " " + nb::repr(value).c_str();
}

[[noreturn]] void type_error(const char* function, const std::string& what) {
  throw nb::type_error((std::string(function) + ": " + what).c_str());
}

std::string causal_choices() {
  return "None, " + enum_choices(kCausalNames, "'", " or ", Causal::none);
}

Causal causal_of(const char* function, nb::handle value) {
  if (value.is_none()) return Causal::none;
  if (nb::isinstance<nb::str>(value)) {
    const char* name = nb::borrow<nb::str>(value).c_str();
    if (const auto causal = causal_from_name(name)) return *causal;
    throw Error(std::string(function) + ": causal: expected " + causal_choices() + ", got '" +
                name + "'");
  }
  if (nb::isinstance<Causal>(value)) return nb::cast<Causal>(value);
  type_error(function, "causal: expected " + causal_choices() + ", got " + type_and_repr(value));
}

// Messages are built only on failure: a call that succeeds pays two table lookups.
Backend backend_of(const char* function, nb::handle value) {
  if (nb::isinstance<nb::str>(value)) {
    if (const auto backend = backend_from_name(nb::borrow<nb::str>(value).c_str())) return *backend;
  } else if (nb::isinstance<Backend>(value)) {
    return nb::cast<Backend>(value);
  }
  const std::string message = std::string(function) + ": backend: expected one of (" +
                              enum_choices(kBackendNames, "'", ", ") + "), got " +
                              nb::repr(value).c_str();
  if (!nb::isinstance<nb::str>(value)) throw nb::type_error(message.c_str());
  throw Error(message);
}

std::optional<double> scale_of(const char* function, nb::handle value) {
  if (value.is_none()) return std::nullopt;
  const bool number = PyFloat_Check(value.ptr()) ||
                      (PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr())) ||
                      (!PyBool_Check(value.ptr()) && is_instance_of_numbers(value, "Real"));
  if (!number) type_error(function, "scale: expected None or a number, got " + std::string(nb::repr(value).c_str()));
  const double scale = PyFloat_AsDouble(value.ptr());
  if (scale == -1.0 && PyErr_Occurred()) throw nb::python_error();
  return scale;
}

int threads_of(const char* function, nb::handle value) {
  if (value.is_none()) return 0;
  const bool integer = !PyBool_Check(value.ptr()) &&
                       (PyLong_Check(value.ptr()) || is_instance_of_numbers(value, "Integral"));
  if (!integer) type_error(function, "threads: expected None or an int, got " + std::string(nb::repr(value).c_str()));
  const nb::object as_int = nb::steal(PyNumber_Index(value.ptr()));
  if (!as_int.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long threads = PyLong_AsLongAndOverflow(as_int.ptr(), &overflow);
  if (overflow != 0 || threads > INT32_MAX || threads < INT32_MIN) {
    throw Error(std::string(function) + ": threads: expected a thread count, got " + nb::repr(value).c_str());
  }
  return static_cast<int>(threads);
}

// The stored form of an optional array: null (not given) for None.
// Python's truth of a value (check_finite=1 is fine, as bool(1) is).
bool truthy(nb::handle value) {
  const int truth = PyObject_IsTrue(value.ptr());
  if (truth < 0) throw nb::python_error();
  return truth == 1;
}

nb::object array_or_none(nb::handle value) { return value.is_none() ? nb::object() : nb::borrow(value); }


// Sets the field `key` of `o` from a Python value; shared by the constructor's keywords
// and replace().
void set_field(BoundOptions& o, const char* function, std::string_view key, nb::handle value) {
  AttentionOptions& a = o.options;
  if (key == "causal") a.causal = causal_of(function, value);
  else if (key == "scale") a.scale = scale_of(function, value);
  else if (key == "backend") a.execution.backend = backend_of(function, value);
  else if (key == "threads") a.execution.threads = threads_of(function, value);
  else if (key == "check_finite") a.execution.check_finite = truthy(value);
  else if (key == "keep") o.keep = array_or_none(value);
  else if (key == "bias") o.bias = array_or_none(value);
  else if (key == "key_lengths") o.key_lengths = array_or_none(value);
  else if (key == "alibi_slopes") o.alibi_slopes = array_or_none(value);
  else if (key == "sinks") o.sinks = array_or_none(value);
  else if (key == "window") {
    const auto [left, right] = nb::cast<std::tuple<int64_t, int64_t>>(value);
    a.window = {left, right};
  } else if (key == "softcap") a.softcap = nb::cast<float>(value);
  else if (key == "dropout_p") a.dropout.p = nb::cast<float>(value);
  else if (key == "seed") a.dropout.seed = nb::cast<std::uint64_t>(value);
  else if (key == "offset") a.dropout.offset = nb::cast<std::uint64_t>(value);
  else type_error(function, "unexpected option '" + std::string(key) + "'");
}

nb::object optional_array(const nb::object& array) { return array.is_valid() ? array : nb::none(); }

}  // namespace

// A contiguous float32 vector of one value per query head (alibi_slopes, sinks).
std::span<const float> per_head(const char* name, nb::handle array) {
  const auto values = view_of<const float, 1>(name, ArrayRef::from(array, false), "one float32 value per query head");
  if (values.shape[0] > 1 && values.strides[0] != 1) {
    throw Error(std::string(name) + ": expected a contiguous array, got stride " +
                std::to_string(values.strides[0]));
  }
  return {values.data, static_cast<std::size_t>(values.shape[0])};
}

Backend parse_backend(const std::string& name) {
  if (const auto backend = backend_from_name(name)) return *backend;
  throw Error("backend: expected " + enum_choices(kBackendNames, "'", " or ") + ", got '" + name + "'");
}

Causal parse_causal(const std::string& name) {
  if (const auto causal = causal_from_name(name)) return *causal;
  throw Error("causal: expected None, " + enum_choices(kCausalNames, "'", " or ", Causal::none) +
              ", got '" + name + "'");
}

bool BoundOptions::has_variants() const {
  return options.window.active() || alibi_slopes.is_valid() || options.softcap != 0.0f ||
         sinks.is_valid() || options.dropout.p != 0.0f;
}

AttentionOptions BoundOptions::for_call() const {
  AttentionOptions a = options;
  if (keep.is_valid()) a.mask.keep = byte_mask_view("mask", ArrayRef::from(keep, false));
  if (bias.is_valid()) {
    a.mask.bias = view_of<const float, 4>("mask", ArrayRef::from(bias, false),
                                          "an additive mask is added in float32");
  }
  if (alibi_slopes.is_valid()) a.alibi_slopes = per_head("alibi_slopes", alibi_slopes);
  if (sinks.is_valid()) a.sinks = per_head("sinks", sinks);
  if (key_lengths.is_valid()) {
    const auto lengths = view_of<const int64_t, 1>("key_lengths", ArrayRef::from(key_lengths, false),
                                                   "one length per batch entry");
    if (lengths.shape[0] > 1 && lengths.strides[0] != 1) {
      throw Error("key_lengths: expected a contiguous array, got stride " +
                  std::to_string(lengths.strides[0]));
    }
    a.key_lengths = std::span<const int64_t>(lengths.data, static_cast<std::size_t>(lengths.shape[0]));
  }
  return a;
}

void bind_options(nb::module_& m) {
  // Python's enum members are the table's names (Causal.top_left, Backend.auto).
  nb::enum_<Causal> causal_enum(m, "Causal",
                                "Causal mode (qkv/options.hpp); names from qkv/names.hpp.");
  for (const auto& entry : kCausalNames)
    if (!entry.alias) causal_enum.value(entry.name.data(), entry.value);
  nb::enum_<Backend> backend_enum(m, "Backend",
                                  "Backend (qkv/options.hpp); names from qkv/names.hpp.");
  for (const auto& entry : kBackendNames)
    if (!entry.alias) backend_enum.value(entry.name.data(), entry.value);

  nb::class_<BoundOptions>(m, "Options",
                           "The options of one attention call, converted once (qkv/_options.py "
                           "builds it). Immutable: replace() returns a changed copy.")
      .def(
          "__init__",
          [](BoundOptions* self, const char* function, nb::handle causal, nb::handle scale,
             nb::handle backend, nb::handle threads, nb::handle check_finite, nb::handle keep,
             nb::handle bias, nb::handle key_lengths, int64_t window_left, int64_t window_right,
             nb::handle alibi_slopes, float softcap, nb::handle sinks, float dropout_p,
             std::uint64_t seed) {
            BoundOptions* o = new (self) BoundOptions();
            AttentionOptions& a = o->options;
            a.causal = causal_of(function, causal);
            a.scale = scale_of(function, scale);
            a.execution.backend = backend_of(function, backend);
            a.execution.threads = threads_of(function, threads);
            a.execution.check_finite = truthy(check_finite);
            if (!keep.is_none()) o->keep = nb::borrow(keep);
            if (!bias.is_none()) o->bias = nb::borrow(bias);
            if (!key_lengths.is_none()) o->key_lengths = nb::borrow(key_lengths);
            a.window = {window_left, window_right};
            if (!alibi_slopes.is_none()) o->alibi_slopes = nb::borrow(alibi_slopes);
            a.softcap = softcap;
            if (!sinks.is_none()) o->sinks = nb::borrow(sinks);
            a.dropout = {.p = dropout_p, .seed = seed, .offset = 0};
          },
          nb::arg("function") = "qkv", nb::arg("causal").none() = nb::none(),
          nb::arg("scale").none() = nb::none(), nb::arg("backend") = "auto",
          nb::arg("threads").none() = nb::none(), nb::arg("check_finite") = false,
          nb::arg("keep").none() = nb::none(), nb::arg("bias").none() = nb::none(),
          nb::arg("key_lengths").none() = nb::none(), nb::arg("window_left") = -1,
          nb::arg("window_right") = -1, nb::arg("alibi_slopes").none() = nb::none(),
          nb::arg("softcap") = 0.0f, nb::arg("sinks").none() = nb::none(),
          nb::arg("dropout_p") = 0.0f, nb::arg("seed") = 0,
          "function names the caller in messages. causal: None, a name or a Causal; "
          "backend: a name or a Backend; threads: None (= 0, every hardware thread) or an "
          "int. Arrays (keep: bool/uint8 4-D, bias: float32 4-D, key_lengths: int64, "
          "alibi_slopes and sinks: float32 per query head) are NumPy arrays or torch tensors.")
      .def(
          "replace",
          [](const BoundOptions& self, const nb::kwargs& changes) {
            BoundOptions copy = self;
            for (auto [key, value] : changes)
              set_field(copy, "qkv", nb::borrow<nb::str>(key).c_str(), value);
            return copy;
          },
          "A copy with the given fields changed (the constructor's names; window as (left, right)).")
      .def("has_variants", &BoundOptions::has_variants,
           "Whether a window, ALiBi, soft-cap, sinks or dropout is set.")
      .def_prop_ro("causal", [](const BoundOptions& o) { return o.options.causal; })
      .def_prop_ro("causal_name", [](const BoundOptions& o) { return std::string(name_of(o.options.causal)); })
      .def_prop_ro("backend", [](const BoundOptions& o) { return o.options.execution.backend; })
      .def_prop_ro("backend_name", [](const BoundOptions& o) { return std::string(name_of(o.options.execution.backend)); })
      .def_prop_ro("scale", [](const BoundOptions& o) { return o.options.scale; })
      .def_prop_ro("threads", [](const BoundOptions& o) { return o.options.execution.threads; })
      .def_prop_ro("check_finite", [](const BoundOptions& o) { return o.options.execution.check_finite; })
      .def_prop_ro("keep", [](const BoundOptions& o) { return optional_array(o.keep); })
      .def_prop_ro("bias", [](const BoundOptions& o) { return optional_array(o.bias); })
      .def_prop_ro("key_lengths", [](const BoundOptions& o) { return optional_array(o.key_lengths); })
      .def_prop_ro("window", [](const BoundOptions& o) { return std::make_tuple(o.options.window.left, o.options.window.right); })
      .def_prop_ro("alibi_slopes", [](const BoundOptions& o) { return optional_array(o.alibi_slopes); })
      .def_prop_ro("softcap", [](const BoundOptions& o) { return o.options.softcap; })
      .def_prop_ro("sinks", [](const BoundOptions& o) { return optional_array(o.sinks); })
      .def_prop_ro("dropout_p", [](const BoundOptions& o) { return o.options.dropout.p; })
      .def_prop_ro("seed", [](const BoundOptions& o) { return o.options.dropout.seed; });
}

}  // namespace qkv::python
