#include "options.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
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

// precision=: None is the default ("fast"), else a name of qkv/names.hpp's table.
Precision precision_of(const char* function, nb::handle value) {
  if (value.is_none()) return Precision::fast;
  if (nb::isinstance<nb::str>(value)) {
    if (const auto precision = precision_from_name(nb::borrow<nb::str>(value).c_str())) return *precision;
    throw Error(std::string(function) + ": precision: expected None, " + enum_choices(kPrecisionNames, "'", " or ") +
                ", got " + nb::repr(value).c_str());
  }
  type_error(function, "precision: expected None, " + enum_choices(kPrecisionNames, "'", " or ") + ", got " +
                           type_and_repr(value));
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

bool is_integer(nb::handle value) {
  return !PyBool_Check(value.ptr()) &&
         (PyLong_Check(value.ptr()) || is_instance_of_numbers(value, "Integral"));
}

// An integer as int64, nullopt when it does not fit (checked before any narrowing).
std::optional<int64_t> int64_of(nb::handle value) {
  const nb::object as_int = nb::steal(PyNumber_Index(value.ptr()));
  if (!as_int.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(as_int.ptr(), &overflow);
  if (n == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow != 0) return std::nullopt;
  return static_cast<int64_t>(n);
}

int threads_of(const char* function, nb::handle value) {
  if (value.is_none()) return 0;
  if (!is_integer(value)) type_error(function, "threads: expected None or an int, got " + std::string(nb::repr(value).c_str()));
  const std::optional<int64_t> threads = int64_of(value);
  if (!threads || *threads > INT32_MAX || *threads < INT32_MIN) {
    throw Error(std::string(function) + ": threads: expected a thread count, got " + nb::repr(value).c_str());
  }
  return static_cast<int>(*threads);
}

// (left, right), FlashAttention's window_size: None (either side or both) is -1,
// unbounded. Each bound must fit int64 (the library checks >= -1).
Window window_of(const char* function, nb::handle value) {
  if (value.is_none()) return {};
  const std::string got = nb::repr(value).c_str();
  const bool pair = PySequence_Check(value.ptr()) && !PyUnicode_Check(value.ptr()) &&
                    !PyBytes_Check(value.ptr()) && PySequence_Size(value.ptr()) == 2;
  if (PyErr_Occurred()) PyErr_Clear();  // a sequence without a length is no pair either
  if (!pair) type_error(function, "window: expected (left, right), got " + got);
  int64_t bounds[2] = {-1, -1};
  for (std::size_t side = 0; side < 2; ++side) {
    const nb::object bound = nb::steal(PySequence_GetItem(value.ptr(), static_cast<Py_ssize_t>(side)));
    if (!bound.is_valid()) throw nb::python_error();
    if (bound.is_none()) continue;
    if (!is_integer(bound)) type_error(function, "window: expected two ints or None, got " + got);
    const std::optional<int64_t> n = int64_of(bound);
    if (!n) {
      throw Error(std::string(function) + ": window: expected left and right >= 0, or -1 (or None) "
                  "for unbounded, each fitting int64, got " + got);
    }
    bounds[side] = *n;
  }
  return {bounds[0], bounds[1]};
}

// A number stored as a float (softcap, dropout_p): refused, not rounded to inf, when it
// overflows float. None is 0 (off).
float float_of(const char* function, const char* name, nb::handle value) {
  if (value.is_none()) return 0.0f;
  const bool number = !PyBool_Check(value.ptr()) &&
                      (PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr()) ||
                       is_instance_of_numbers(value, "Real"));
  if (!number) type_error(function, std::string(name) + ": expected a number, got " + nb::repr(value).c_str());
  const double x = PyFloat_AsDouble(value.ptr());
  if (x == -1.0 && PyErr_Occurred()) throw nb::python_error();
  if (std::isfinite(x) && std::fabs(x) > std::numeric_limits<float>::max()) {
    throw Error(std::string(function) + ": " + name + ": expected a value that fits float32, got " +
                nb::repr(value).c_str());
  }
  return static_cast<float>(x);
}

// A non-negative integer below 2**64 (dropout seed and offset).
std::uint64_t uint64_of(const char* function, const char* name, nb::handle value) {
  if (value.is_none()) return 0;
  if (!is_integer(value)) type_error(function, std::string(name) + ": expected None or an int >= 0, got " + nb::repr(value).c_str());
  const nb::object as_int = nb::steal(PyNumber_Index(value.ptr()));
  if (!as_int.is_valid()) throw nb::python_error();
  const unsigned long long n = PyLong_AsUnsignedLongLong(as_int.ptr());
  if (n == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw Error(std::string(function) + ": " + name + ": expected an int in [0, 2**64), got " +
                nb::repr(value).c_str());
  }
  return n;
}

// Python's truth of a value (check_finite=1 is fine, as bool(1) is).
bool truthy(nb::handle value) {
  const int truth = PyObject_IsTrue(value.ptr());
  if (truth < 0) throw nb::python_error();
  return truth == 1;
}

// The stored form of an optional array: null (not given) for None.
nb::object array_or_none(nb::handle value) { return value.is_none() ? nb::object() : nb::borrow(value); }

// A per-head vector (alibi_slopes, sinks): an empty one would read as "off", so it is
// refused here; its length against the heads is the library's check.
nb::object per_head_or_none(const char* function, const char* name, nb::handle value) {
  if (value.is_none()) return {};
  const ArrayRef array = ArrayRef::from(value, false, name);
  if (array.ndim() != 1) {
    std::string shape;
    for (std::size_t axis = 0; axis < std::min<std::size_t>(array.ndim(), ArrayRef::kMaxRank); ++axis)
      shape += (axis ? ", " : "") + std::to_string(array.shape(axis));
    throw Error(std::string(function) + ": " + name + ": expected one value per query head (1-D), got shape (" +
                shape + ")");
  }
  if (array.size() == 0) {
    throw Error(std::string(function) + ": " + name +
                ": expected one value per query head, got an empty array (pass None for none)");
  }
  return nb::borrow(value);
}

// (state, slot, bytes, block_q, block_k): a block-sparse mask (qkv/block_sparse.hpp),
// checked by its constructor (qkv::Error naming the field otherwise).
void set_block_mask(BoundOptions& o, const char* function, nb::handle value) {
  o.block_mask = nb::object();
  o.blocks.reset();
  if (value.is_none()) return;
  if (!PyTuple_Check(value.ptr()) || PyTuple_Size(value.ptr()) != 5)
    type_error(function, "block_mask: expected (state, slot, bytes, block_q, block_k)");
  const nb::tuple parts = nb::borrow<nb::tuple>(value);
  BlockSparseView view;
  view.state = view_of<const std::uint8_t, 4>("block_mask.state", ArrayRef::from(parts[0], false, "block_mask.state"), "block states are uint8");
  view.slot = view_of<const int32_t, 4>("block_mask.slot", ArrayRef::from(parts[1], false, "block_mask.slot"), "block slots are int32");
  view.bytes = view_of<const std::uint8_t, 3>("block_mask.bytes", ArrayRef::from(parts[2], false, "block_mask.bytes"), "partial blocks' masks are uint8");
  if (!is_integer(parts[3]) || !is_integer(parts[4]))
    type_error(function, "block_mask: expected int block sizes");
  const std::optional<int64_t> block_q = int64_of(parts[3]), block_k = int64_of(parts[4]);
  view.block_q = block_q.value_or(0);
  view.block_k = block_k.value_or(0);
  o.blocks = std::make_shared<const BlockSparseMask>(view);
  o.block_mask = nb::borrow(value);
}

// The one table of fields: every way Python sets an option (the constructor, by position
// in this order or by keyword, and replace()) goes through it. Each entry converts and
// range-checks its value before storing it in the library's type; checks of the values
// themselves (scale > 0, threads >= 0, window >= -1, ...) are the library's, made when a
// call runs, so every entry point reports them alike.
using Setter = void (*)(BoundOptions&, const char* function, nb::handle value);
struct Field {
  std::string_view name;
  Setter set;
};

constexpr Field kFields[] = {
    {"causal", [](BoundOptions& o, const char* f, nb::handle v) { o.options.causal = causal_of(f, v); }},
    {"scale", [](BoundOptions& o, const char* f, nb::handle v) { o.options.scale = scale_of(f, v); }},
    {"backend", [](BoundOptions& o, const char* f, nb::handle v) { o.options.execution.backend = backend_of(f, v); }},
    {"threads", [](BoundOptions& o, const char* f, nb::handle v) { o.options.execution.threads = threads_of(f, v); }},
    {"check_finite", [](BoundOptions& o, const char*, nb::handle v) { o.options.execution.check_finite = truthy(v); }},
    {"keep", [](BoundOptions& o, const char*, nb::handle v) { o.keep = array_or_none(v); }},
    {"bias", [](BoundOptions& o, const char*, nb::handle v) { o.bias = array_or_none(v); }},
    {"key_lengths", [](BoundOptions& o, const char*, nb::handle v) { o.key_lengths = array_or_none(v); }},
    {"window", [](BoundOptions& o, const char* f, nb::handle v) { o.options.window = window_of(f, v); }},
    {"alibi_slopes", [](BoundOptions& o, const char* f, nb::handle v) { o.alibi_slopes = per_head_or_none(f, "alibi_slopes", v); }},
    {"softcap", [](BoundOptions& o, const char* f, nb::handle v) { o.options.softcap = float_of(f, "softcap", v); }},
    {"sinks", [](BoundOptions& o, const char* f, nb::handle v) { o.sinks = per_head_or_none(f, "sinks", v); }},
    {"dropout_p", [](BoundOptions& o, const char* f, nb::handle v) { o.options.dropout.p = float_of(f, "dropout_p", v); }},
    {"seed", [](BoundOptions& o, const char* f, nb::handle v) { o.options.dropout.seed = uint64_of(f, "seed", v); }},
    {"offset", [](BoundOptions& o, const char* f, nb::handle v) { o.options.dropout.offset = uint64_of(f, "offset", v); }},
    {"block_mask", &set_block_mask},
    // Keyword only in practice (qkv.BatchPlan): after the positional fields.
    {"fixed_key_split", [](BoundOptions& o, const char*, nb::handle v) { o.options.execution.fixed_key_split = truthy(v); }},
    {"precision", [](BoundOptions& o, const char* f, nb::handle v) { o.options.precision = precision_of(f, v); }},
};

void set_field(BoundOptions& o, const char* function, std::string_view key, nb::handle value) {
  for (const Field& field : kFields) {
    if (field.name == key) return field.set(o, function, value);
  }
  type_error(function, "unexpected option '" + std::string(key) + "'");
}

// Sets the fields named by `changes` (keywords of the constructor or replace()).
void set_fields(BoundOptions& o, const char* function, const nb::kwargs& changes) {
  for (auto [key, value] : changes) set_field(o, function, nb::borrow<nb::str>(key).c_str(), value);
}

nb::object optional_array(const nb::object& array) { return array.is_valid() ? array : nb::none(); }

// The fields as the constructor's keywords (names for the enums, window as a pair): what
// autograd keeps between forward and backward instead of the bound object itself.
nb::dict fields_of(const BoundOptions& o) {
  const AttentionOptions& a = o.options;
  nb::dict d;
  d["causal"] = nb::str(name_of(a.causal).data(), name_of(a.causal).size());
  d["scale"] = a.scale ? nb::object(nb::float_(*a.scale)) : nb::none();
  d["backend"] = nb::str(name_of(a.execution.backend).data(), name_of(a.execution.backend).size());
  d["threads"] = a.execution.threads;
  d["check_finite"] = a.execution.check_finite;
  d["fixed_key_split"] = a.execution.fixed_key_split;
  d["keep"] = optional_array(o.keep);
  d["bias"] = optional_array(o.bias);
  d["key_lengths"] = optional_array(o.key_lengths);
  d["window"] = nb::make_tuple(a.window.left, a.window.right);
  d["alibi_slopes"] = optional_array(o.alibi_slopes);
  d["softcap"] = a.softcap;
  d["sinks"] = optional_array(o.sinks);
  d["dropout_p"] = a.dropout.p;
  d["seed"] = a.dropout.seed;
  d["offset"] = a.dropout.offset;
  d["block_mask"] = optional_array(o.block_mask);
  d["precision"] = nb::str(name_of(a.precision).data(), name_of(a.precision).size());
  return d;
}

// A contiguous float32 vector of one value per query head (alibi_slopes, sinks).
std::span<const float> per_head(const char* name, nb::handle array) {
  const auto values = view_of<const float, 1>(name, ArrayRef::from(array, false, name), "one float32 value per query head");
  if (values.shape[0] > 1 && values.strides[0] != 1) {
    throw Error(std::string(name) + ": expected a contiguous array, got stride " +
                std::to_string(values.strides[0]));
  }
  return {values.data, static_cast<std::size_t>(values.shape[0])};
}

}  // namespace

Backend parse_backend(const std::string& name) {
  if (const auto backend = backend_from_name(name)) return *backend;
  throw Error("backend: expected " + enum_choices(kBackendNames, "'", " or ") + ", got '" + name + "'");
}

bool BoundOptions::has_variants() const {
  return options.window.active() || alibi_slopes.is_valid() || options.softcap != 0.0f ||
         sinks.is_valid() || options.dropout.p != 0.0f || blocks != nullptr;
}

AttentionOptions BoundOptions::for_call() const {
  AttentionOptions a = options;
  if (keep.is_valid()) a.mask.keep = byte_mask_view("mask", ArrayRef::from(keep, false, "mask"));
  if (bias.is_valid()) {
    a.mask.bias = view_of<const float, 4>("mask", ArrayRef::from(bias, false, "mask"),
                                          "an additive mask is added in float32");
  }
  if (alibi_slopes.is_valid()) a.alibi_slopes = per_head("alibi_slopes", alibi_slopes);
  if (blocks) a.modifiers.mask = blocks->hook();
  if (sinks.is_valid()) a.sinks = per_head("sinks", sinks);
  if (key_lengths.is_valid()) {
    const auto lengths = view_of<const int64_t, 1>("key_lengths", ArrayRef::from(key_lengths, false, "key_lengths"),
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
          [](BoundOptions* self, const char* function, const nb::args& values, const nb::kwargs& changes) {
            BoundOptions* o = new (self) BoundOptions();
            o->function = function;
            if (values.size() > std::size(kFields))
              type_error(function, "Options: at most " + std::to_string(std::size(kFields)) + " fields by position");
            for (std::size_t i = 0; i < values.size(); ++i) {
              if (changes.size() != 0 && changes.contains(kFields[i].name.data()))
                type_error(function, "Options: '" + std::string(kFields[i].name) + "' given by position and by keyword");
              kFields[i].set(*o, function, nb::handle(PyTuple_GET_ITEM(values.ptr(), static_cast<Py_ssize_t>(i))));
            }
            set_fields(*o, function, changes);
          },
          nb::arg("function") = "qkv", nb::arg("values"), nb::arg("changes"),
          "function names the caller in messages. Then the fields, by position in this order "
          "or by keyword: causal (None, a name or a Causal), scale (None or a number), "
          "backend (a name or a Backend), threads (None = 0, every hardware thread, or an "
          "int), check_finite, keep (bool/uint8 4-D), bias (float32 4-D), key_lengths "
          "(int64), window ((left, right), None = -1 on either side), alibi_slopes "
          "(float32, per query head), softcap, sinks (float32, per query head), dropout_p, "
          "seed, offset, block_mask ((state, slot, bytes, block_q, block_k): qkv/block_sparse.hpp), "
          "fixed_key_split, precision (None = 'fast', or 'exact'). Arrays are NumPy arrays or torch tensors, held as given.")
      .def(
          "replace",
          [](const BoundOptions& self, const nb::kwargs& changes) {
            BoundOptions copy = self;
            set_fields(copy, self.function.c_str(), changes);
            return copy;
          },
          "A copy with the given fields changed (the constructor's names).")
      .def("fields", &fields_of,
           "The fields as the constructor's keywords: Options(function, **o.fields()) is o.")
      .def("has_variants", &BoundOptions::has_variants,
           "Whether a window, ALiBi, soft-cap, sinks, dropout or a block mask is set.")
      .def_prop_ro("causal", [](const BoundOptions& o) { return o.options.causal; })
      .def_prop_ro("causal_name", [](const BoundOptions& o) { return std::string(name_of(o.options.causal)); })
      .def_prop_ro("backend", [](const BoundOptions& o) { return o.options.execution.backend; })
      .def_prop_ro("backend_name", [](const BoundOptions& o) { return std::string(name_of(o.options.execution.backend)); })
      .def_prop_ro("scale", [](const BoundOptions& o) { return o.options.scale; })
      .def_prop_ro("threads", [](const BoundOptions& o) { return o.options.execution.threads; })
      .def_prop_ro("check_finite", [](const BoundOptions& o) { return o.options.execution.check_finite; })
      .def_prop_ro("fixed_key_split", [](const BoundOptions& o) { return o.options.execution.fixed_key_split; })
      .def_prop_ro("keep", [](const BoundOptions& o) { return optional_array(o.keep); })
      .def_prop_ro("bias", [](const BoundOptions& o) { return optional_array(o.bias); })
      .def_prop_ro("key_lengths", [](const BoundOptions& o) { return optional_array(o.key_lengths); })
      .def_prop_ro("window", [](const BoundOptions& o) { return std::make_tuple(o.options.window.left, o.options.window.right); })
      .def_prop_ro("alibi_slopes", [](const BoundOptions& o) { return optional_array(o.alibi_slopes); })
      .def_prop_ro("softcap", [](const BoundOptions& o) { return o.options.softcap; })
      .def_prop_ro("sinks", [](const BoundOptions& o) { return optional_array(o.sinks); })
      .def_prop_ro("dropout_p", [](const BoundOptions& o) { return o.options.dropout.p; })
      .def_prop_ro("seed", [](const BoundOptions& o) { return o.options.dropout.seed; })
      .def_prop_ro("precision_name", [](const BoundOptions& o) { return std::string(name_of(o.options.precision)); });
}

}  // namespace qkv::python
