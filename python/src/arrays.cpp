#include "arrays.hpp"

#include <nanobind/stl/string.h>  // nb::cast<std::string>: every TU that casts must see it

#include <sstream>

#include "qkv/error.hpp"

namespace qkv::python {

std::string dtype_name(nb::dlpack::dtype dtype) {
  using Code = nb::dlpack::dtype_code;
  std::string kind;
  switch (static_cast<Code>(dtype.code)) {
    case Code::Int: kind = "int"; break;
    case Code::UInt: kind = "uint"; break;
    case Code::Float: kind = "float"; break;
    case Code::Bfloat: kind = "bfloat"; break;
    case Code::Complex: kind = "complex"; break;
    case Code::Bool: return "bool";
    default: kind = "dtype-code-" + std::to_string(dtype.code) + "-"; break;
  }
  std::string name = kind + std::to_string(dtype.bits);
  if (dtype.lanes != 1) name += "x" + std::to_string(dtype.lanes);
  return name;
}

thread_local const char* Caller::current_ = nullptr;

std::string Caller::named(const char* name) {
  return current_ == nullptr ? std::string(name) : std::string(current_) + ": " + name;
}

void argument_type_error(const char* name, const std::string& what) {
  throw nb::type_error((Caller::named(name) + ": " + what).c_str());
}

int64_t int64_argument(const char* name, nb::handle value) {
  // Python's bool is an int; anything with __index__ (a NumPy integer) is taken as one.
  if (!PyIndex_Check(value.ptr()))
    argument_type_error(name, std::string("expected an int, got ") + nb::type_name(value.type()).c_str() + " " +
                                  nb::repr(value).c_str());
  const nb::object index = nb::steal(PyNumber_Index(value.ptr()));
  if (!index.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long n = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (n == -1 && PyErr_Occurred()) throw nb::python_error();
  if (overflow != 0)
    throw Error(Caller::named(name) + ": expected an int in [-2**63, 2**63), got " + nb::repr(index).c_str());
  return n;
}

std::optional<std::vector<int64_t>> int64_list_argument(const char* name, nb::handle value) {
  if (value.is_none()) return std::nullopt;
  if (!PySequence_Check(value.ptr()))
    argument_type_error(name, std::string("expected None or a list of ints, got ") +
                                  nb::type_name(value.type()).c_str());
  std::vector<int64_t> out;
  const nb::sequence items = nb::borrow<nb::sequence>(value);
  const std::size_t n = nb::len(items);
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::string entry = std::string(name) + "[" + std::to_string(i) + "]";
    const nb::object item = items[i];
    out.push_back(int64_argument(entry.c_str(), item));
  }
  return out;
}

void expect_cpu(const char* name, int device_type) {
  if (device_type != nb::device::cpu::value) {
    argument_type_error(name, "expected an array in CPU memory, got DLPack device type " +
                                  std::to_string(device_type) +
                                  " (qkv computes on the CPU; move it with .cpu())");
  }
}

void expect_rank(const char* name, std::size_t actual, int expected) {
  if (actual != static_cast<std::size_t>(expected)) {
    std::ostringstream out;
    out << Caller::named(name) << ": expected " << expected << (expected == 1 ? " dimension" : " dimensions")
        << ", got " << actual;
    throw Error(out.str());
  }
}

void expect_dtype(const char* name, nb::dlpack::dtype actual, nb::dlpack::dtype expected,
                  const char* because) {
  if (actual != expected) {
    std::ostringstream out;
    out << "expected dtype " << dtype_name(expected) << " (" << because << "), got "
        << dtype_name(actual);
    argument_type_error(name, out.str());
  }
}

CallStorage call_storage(const ArrayRef& q, bool bfloat16_bits) {
  expect_cpu("q", q.device_type());
  if (bfloat16_bits) {
    if (q.dtype() != dlpack_dtype<bfloat16>() && !holds_16_bit_patterns(q.dtype())) {
      argument_type_error("q", "expected dtype bfloat16 (or 16-bit integers holding bfloat16 bits), got " +
                                   dtype_name(q.dtype()));
    }
    return {Storage::bfloat16, true};
  }
  if (q.dtype() == nb::dtype<float>()) return {Storage::float32, false};
  if (q.dtype() == nb::dtype<double>()) return {Storage::float64, false};
  if (q.dtype() == dlpack_dtype<bfloat16>()) return {Storage::bfloat16, false};
  if (q.dtype() == dlpack_dtype<float16>()) return {Storage::float16, false};
  argument_type_error("q", "expected dtype float32, float64, bfloat16 or float16, got " + dtype_name(q.dtype()));
}

namespace {

// torch's attributes and dtypes, looked up once (torch is imported before any tensor
// can reach us). Kept for the life of the process on purpose: no destructors at exit.
struct TorchNames {
  PyTypeObject* tensor = nullptr;
  PyObject* data_ptr = nullptr;  // interned attribute names
  PyObject* shape = nullptr;
  PyObject* stride = nullptr;
  PyObject* dtype = nullptr;
  PyObject* is_cpu = nullptr;
  PyObject* device = nullptr;
  PyObject* type = nullptr;
  // (torch dtype object, DLPack dtype) for every dtype a message may need to name.
  std::array<std::pair<PyObject*, nb::dlpack::dtype>, 12> dtypes{};

  // Null while torch is not imported (then no argument can be a tensor). Called with the
  // GIL held, which serializes the first load.
  static const TorchNames* get() {
    static const TorchNames* names = nullptr;
    if (names == nullptr) names = load();
    return names;
  }

 private:
  static const TorchNames* load() {
    PyObject* torch = PyImport_GetModule(nb::str("torch").ptr());  // new reference or null
    if (torch == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    auto* names = new TorchNames;  // never freed: see above
    names->tensor = reinterpret_cast<PyTypeObject*>(PyObject_GetAttrString(torch, "Tensor"));
    names->data_ptr = PyUnicode_InternFromString("data_ptr");
    names->shape = PyUnicode_InternFromString("shape");
    names->stride = PyUnicode_InternFromString("stride");
    names->dtype = PyUnicode_InternFromString("dtype");
    names->is_cpu = PyUnicode_InternFromString("is_cpu");
    names->device = PyUnicode_InternFromString("device");
    names->type = PyUnicode_InternFromString("type");
    using Code = nb::dlpack::dtype_code;
    auto code = [](Code c) { return static_cast<std::uint8_t>(c); };
    const std::pair<const char*, nb::dlpack::dtype> known[] = {
        {"float32", {code(Code::Float), 32, 1}},  {"float64", {code(Code::Float), 64, 1}},
        {"float16", {code(Code::Float), 16, 1}},  {"bfloat16", {code(Code::Bfloat), 16, 1}},
        {"bool", {code(Code::Bool), 8, 1}},       {"uint8", {code(Code::UInt), 8, 1}},
        {"int8", {code(Code::Int), 8, 1}},        {"int16", {code(Code::Int), 16, 1}},
        {"int32", {code(Code::Int), 32, 1}},      {"int64", {code(Code::Int), 64, 1}},
        {"complex64", {code(Code::Complex), 64, 1}}, {"complex128", {code(Code::Complex), 128, 1}},
    };
    for (std::size_t i = 0; i < names->dtypes.size(); ++i)
      names->dtypes[i] = {PyObject_GetAttrString(torch, known[i].first), known[i].second};
    Py_DECREF(torch);
    if (PyErr_Occurred()) throw nb::python_error();
    return names;
  }
};

// Why nanobind could not import `object` as an array, for the message.
std::string unreadable_array(nb::handle object, bool writable) {
  const nb::handle cls = object.type();
  const std::string type = nb::cast<std::string>(nb::str(cls.attr("__module__"))) + "." +
                           nb::cast<std::string>(nb::str(cls.attr("__qualname__")));
  if (nb::hasattr(object, "dtype") && nb::hasattr(nb::getattr(object, "dtype"), "isnative") &&
      !nb::cast<bool>(nb::getattr(object, "dtype").attr("isnative"))) {
    return "expected an array in native byte order, got " + type + " of dtype " +
           nb::cast<std::string>(nb::str(nb::getattr(object, "dtype"))) +
           " (convert it: x.astype(x.dtype.newbyteorder('=')))";
  }
  if (writable && nb::hasattr(object, "flags") &&
      !nb::cast<bool>(nb::getattr(object, "flags").attr("writeable"))) {
    return "expected a writable array, got a read-only " + type;
  }
  return "expected an array readable in place (NumPy, DLPack or the buffer protocol), got " + type;
}

int64_t to_int64(PyObject* value) {
  const long long n = PyLong_AsLongLong(value);
  if (n == -1 && PyErr_Occurred()) throw nb::python_error();
  return n;
}

}  // namespace

template <class Array>
ArrayRef ArrayRef::from_ndarray(const Array& array) {
  ArrayRef ref;
  ref.data_ = static_cast<char*>(array.data_handle()) + array.byte_offset();
  ref.ndim_ = static_cast<int>(array.ndim());
  ref.size_ = array.size();
  ref.dtype_ = array.dtype();
  ref.device_type_ = array.device_type();
  const int64_t* strides = array.stride_ptr();
  int64_t step = 1;  // DLPack allows null strides for C order
  const int rank = std::min(ref.ndim_, kMaxRank);
  for (int axis = ref.ndim_ - 1; axis >= 0; --axis) {
    const auto extent = static_cast<int64_t>(array.shape(static_cast<std::size_t>(axis)));
    if (axis < rank) {
      ref.shape_[axis] = extent;
      ref.strides_[axis] = strides != nullptr ? strides[axis] : step;
    }
    step *= std::max<int64_t>(extent, 1);
  }
  return ref;
}

ArrayRef ArrayRef::from_torch(nb::handle tensor) {
  const TorchNames& names = *TorchNames::get();
  PyObject* t = tensor.ptr();
  ArrayRef ref;
  const nb::object is_cpu = nb::steal(PyObject_GetAttr(t, names.is_cpu));
  if (!is_cpu.is_valid()) throw nb::python_error();
  if (is_cpu.ptr() != Py_True) {
    // Named by its DLPack code where it has one, for expect_cpu's message.
    const nb::object device = nb::steal(PyObject_GetAttr(t, names.device));
    const std::string type = device.is_valid() ? nb::cast<std::string>(device.attr("type")) : "";
    ref.device_type_ = type == "cuda" ? nb::device::cuda::value : -1;
  }
  const nb::object dtype = nb::steal(PyObject_GetAttr(t, names.dtype));
  if (!dtype.is_valid()) throw nb::python_error();
  ref.dtype_ = {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Complex), 0, 1};  // unknown
  for (const auto& [object, code] : names.dtypes)
    if (object == dtype.ptr()) ref.dtype_ = code;
  const nb::object shape = nb::steal(PyObject_GetAttr(t, names.shape));
  const nb::object strides = nb::steal(PyObject_CallMethodNoArgs(t, names.stride));
  if (!shape.is_valid() || !strides.is_valid()) throw nb::python_error();
  ref.ndim_ = static_cast<int>(PyTuple_GET_SIZE(shape.ptr()));
  ref.size_ = 1;
  for (int axis = 0; axis < ref.ndim_; ++axis) {
    const int64_t extent = to_int64(PyTuple_GET_ITEM(shape.ptr(), axis));
    ref.size_ *= static_cast<std::size_t>(extent);
    if (axis < kMaxRank) {
      ref.shape_[axis] = extent;
      ref.strides_[axis] = to_int64(PyTuple_GET_ITEM(strides.ptr(), axis));
    }
  }
  if (ref.device_type_ == nb::device::cpu::value) {
    const nb::object pointer = nb::steal(PyObject_CallMethodNoArgs(t, names.data_ptr));
    if (!pointer.is_valid()) throw nb::python_error();
    ref.data_ = PyLong_AsVoidPtr(pointer.ptr());
    if (ref.data_ == nullptr && PyErr_Occurred()) throw nb::python_error();
  }
  return ref;
}

ArrayRef ArrayRef::from(nb::handle object, bool writable, const char* name) {
  const TorchNames* torch = TorchNames::get();
  if (torch != nullptr && PyObject_TypeCheck(object.ptr(), torch->tensor)) return from_torch(object);
  // nb::try_cast, not nb::cast: a failed import is the caller's bad argument, not the
  // bare std::bad_cast nanobind would raise.
  if (writable) {
    OutArray array;
    if (nb::try_cast(object, array)) return from_ndarray(array);
  } else {
    InArray array;
    if (nb::try_cast(object, array)) return from_ndarray(array);
  }
  throw Error(Caller::named(name) + ": " + unreadable_array(object, writable));
}

ArrayRef ArrayRef::swapped_1_2() const {
  ArrayRef swapped = *this;
  if (ndim_ >= 3) {
    std::swap(swapped.shape_[1], swapped.shape_[2]);
    std::swap(swapped.strides_[1], swapped.strides_[2]);
  }
  return swapped;
}

TensorView<const std::uint8_t, 4> byte_mask_view(const char* name, const ArrayRef& array) {
  // bool and uint8 are the same bytes: re-describe the array, never convert it.
  if (array.dtype() == nb::dtype<bool>()) return raw_view<const std::uint8_t, 4>(name, array);
  return view_of<const std::uint8_t, 4>(name, array, "a keep mask is bool or uint8");
}

}  // namespace qkv::python
