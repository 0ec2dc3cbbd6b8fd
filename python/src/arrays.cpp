#include "arrays.hpp"

#include <sstream>

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

void expect_cpu(const char* name, int device_type) {
  if (device_type != nb::device::cpu::value) {
    throw nb::type_error((std::string(name) + ": expected an array in CPU memory, got DLPack "
                          "device type " + std::to_string(device_type) +
                          " (qkv computes on the CPU; move it with .cpu())")
                             .c_str());
  }
}

void expect_rank(const char* name, std::size_t actual, int expected) {
  if (actual != static_cast<std::size_t>(expected)) {
    std::ostringstream out;
    out << name << ": expected " << expected << " dimensions, got " << actual;
    throw nb::value_error(out.str().c_str());
  }
}

void expect_dtype(const char* name, nb::dlpack::dtype actual, nb::dlpack::dtype expected,
                  const char* because) {
  if (actual != expected) {
    std::ostringstream out;
    out << name << ": expected dtype " << dtype_name(expected) << " (" << because << "), got "
        << dtype_name(actual);
    throw nb::type_error(out.str().c_str());
  }
}

CallStorage call_storage(const InArray& q, const std::string& storage) {
  expect_cpu("q", q.device_type());
  if (storage == "bfloat16" || storage == "float16") {
    const bool half_dtype = q.dtype() == (storage == "bfloat16" ? dlpack_dtype<bfloat16>()
                                                              : dlpack_dtype<float16>());
    if (!half_dtype && !holds_16_bit_patterns(q.dtype())) {
      throw nb::type_error(("q: expected dtype " + storage + " (or 16-bit integers holding " +
                            storage + " bits), got " + dtype_name(q.dtype()))
                               .c_str());
    }
    return {storage == "bfloat16" ? Storage::bfloat16 : Storage::float16, true};
  }
  if (!storage.empty()) {
    throw nb::value_error(("storage: expected '', 'bfloat16' or 'float16', got '" + storage + "'")
                              .c_str());
  }
  if (q.dtype() == nb::dtype<float>()) return {Storage::float32, false};
  if (q.dtype() == nb::dtype<double>()) return {Storage::float64, false};
  if (q.dtype() == dlpack_dtype<bfloat16>()) return {Storage::bfloat16, false};
  if (q.dtype() == dlpack_dtype<float16>()) return {Storage::float16, false};
  throw nb::type_error(("q: expected dtype float32, float64, bfloat16 or float16, got " +
                        dtype_name(q.dtype()))
                           .c_str());
}

TensorView<const std::uint8_t, 4> byte_mask_view(const char* name, const InArray& array) {
  // bool and uint8 are the same bytes: re-describe the array, never convert it.
  if (array.dtype() == nb::dtype<bool>()) return raw_view<const std::uint8_t, 4>(name, array);
  return view_of<const std::uint8_t, 4>(name, array, "a keep mask is bool or uint8");
}

}  // namespace qkv::python
