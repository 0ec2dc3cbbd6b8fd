// Arrays from Python (NumPy, PyTorch, anything speaking DLPack) seen as qkv views.
//
// nanobind hands us each array as an `nb::ndarray` with no constraint on dtype, device,
// shape or strides, so it never converts or copies: the view's pointer is the caller's
// memory. Every check a constraint would have made is made here instead, with a message
// that names the argument (TypeError for dtype and device, ValueError for shape).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "qkv/sparse.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "qkv/half.hpp"
#include "qkv/tensor.hpp"

namespace qkv::python {

namespace nb = nanobind;

using InArray = nb::ndarray<nb::ro>;  // read: also accepts read-only NumPy arrays
using OutArray = nb::ndarray<>;       // written in place

// "float32", "bool", ... for messages.
std::string dtype_name(nb::dlpack::dtype dtype);

// The Python entry point a binding call serves ("qkv.BatchPlan.run"), for the messages of
// the array checks below it: one check (expect_rank) serves every binding and knows only
// the argument, and `except qkv.Error` callers need the function named too. A binding
// sets it for the duration of its call, on its own thread (arguments are checked with the
// GIL held; a call nested in another restores the outer name when it returns).
class Caller {
 public:
  explicit Caller(const char* function) : previous_(current_) { current_ = function; }
  ~Caller() { current_ = previous_; }
  Caller(const Caller&) = delete;
  Caller& operator=(const Caller&) = delete;

  // "<function>: <name>", or the name alone outside any binding call.
  static std::string named(const char* name);

 private:
  static thread_local const char* current_;
  const char* previous_;
};

// The checks every array passes before it becomes a view: device and dtype are
// TypeErrors, rank a qkv::Error (qkv.Error), each naming Caller's function and the argument.
void expect_cpu(const char* name, int device_type);
void expect_rank(const char* name, std::size_t actual, int expected);
void expect_dtype(const char* name, nb::dlpack::dtype actual, nb::dlpack::dtype expected,
                  const char* because);
// A TypeError "<function>: <name>: <what>".
[[noreturn]] void argument_type_error(const char* name, const std::string& what);

// An int argument (a size, a count, a sequence index) as int64, range-checked before it is
// narrowed: bindings take such arguments as handles, because nanobind refuses an int past
// int64 (2**64) for the whole call ("incompatible function arguments", naming nothing).
// Past int64: a qkv::Error naming Caller's function and `name`; not an int: a TypeError.
int64_t int64_argument(const char* name, nb::handle value);
// None: nullopt; else a sequence of ints, each as int64_argument ("seqs[2]").
std::optional<std::vector<int64_t>> int64_list_argument(const char* name, nb::handle value);

// `array` as a rank-R view of T, without looking at its dtype. Strides are the array's
// own, in elements, except for an array with no elements: NumPy and PyTorch give those
// arbitrary strides (NumPy all 0), which mean nothing since no element is read, so the
// view gets C-order strides instead and passes the library's layout checks.
template <class T, int R, class Array>
TensorView<T, R> raw_view(const char* name, const Array& array) {
  expect_cpu(name, array.device_type());
  expect_rank(name, array.ndim(), R);
  typename TensorView<T, R>::Shape shape{}, strides{};
  const int64_t* array_strides = array.stride_ptr();
  const bool empty = array.size() == 0;
  int64_t step = 1;  // DLPack allows null strides for C order
  for (int axis = R - 1; axis >= 0; --axis) {
    shape[axis] = static_cast<int64_t>(array.shape(axis));
    strides[axis] = array_strides && !empty ? array_strides[axis] : step;
    step *= std::max<int64_t>(shape[axis], 1);
  }
  auto* data = reinterpret_cast<T*>(static_cast<char*>(array.data_handle()) +
                                    array.byte_offset());
  return TensorView<T, R>(data, shape, strides);
}

// The DLPack dtype of an element type, the 16-bit storage types included.
template <class T>
nb::dlpack::dtype dlpack_dtype() {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  } else if constexpr (std::is_same_v<T, float16>) {
    return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
  } else {
    return nb::dtype<T>();
  }
}

// Whether `dtype` is 16-bit integers: how the Python package hands over bfloat16 memory
// that NumPy cannot describe (torch's `tensor.view(torch.int16).numpy()`, an
// ml_dtypes array's `.view(np.int16)`): the same bytes, read as the call's storage type.
inline bool holds_16_bit_patterns(nb::dlpack::dtype dtype) {
  return dtype == nb::dtype<std::int16_t>() || dtype == nb::dtype<std::uint16_t>();
}

// A view of `array` as T, rank R; `because` says where the expected dtype comes from
// ("the dtype of q"). For the 16-bit types, with `bits` set (the call's storage was named
// explicitly), 16-bit integer arrays are taken as holding T's bit patterns.
template <class T, int R, class Array>
TensorView<T, R> view_of(const char* name, const Array& array, const char* because,
                         bool bits = false) {
  using Element = std::remove_const_t<T>;
  if constexpr (std::is_same_v<Element, bfloat16> || std::is_same_v<Element, float16>) {
    if (bits && holds_16_bit_patterns(array.dtype())) return raw_view<T, R>(name, array);
  }
  expect_dtype(name, array.dtype(), dlpack_dtype<Element>(), because);
  return raw_view<T, R>(name, array);
}

// The storage type of a call: q's own dtype or, with `bfloat16_bits` (NumPy has no
// bfloat16: ml_dtypes arrays arrive as int16 views of their memory), bfloat16.
enum class Storage { float32, float64, bfloat16, float16 };
struct CallStorage {
  Storage type;
  bool bits;  // 16-bit integer arrays hold the storage type's bit patterns
};
class ArrayRef;
CallStorage call_storage(const ArrayRef& q, bool bfloat16_bits);

// Runs f.template operator()<T>() for the call's storage type T.
template <class F>
void with_storage(const CallStorage& storage, F&& f) {
  switch (storage.type) {
    case Storage::float32: return f.template operator()<float>();
    case Storage::float64: return f.template operator()<double>();
    case Storage::bfloat16: return f.template operator()<bfloat16>();
    case Storage::float16: return f.template operator()<float16>();
  }
}

// One array argument of the attention bindings, whoever made it: a torch.Tensor is read
// through its own attributes (data_ptr(), shape, stride(), dtype, is_cpu: ~0.1 µs each),
// anything else is imported by nanobind (NumPy through the buffer protocol, or DLPack).
// torch's own DLPack export runs in Python (~10 µs a tensor) and .detach().numpy() costs
// ~2 µs, which a small call cannot afford four times. Only the data pointer is kept: the
// caller holds the object for the duration of the call. Same accessors as nb::ndarray,
// so raw_view and view_of take either.
class ArrayRef {
 public:
  static constexpr int kMaxRank = 8;  // deeper arrays keep their rank only (for messages)

  // `writable`: the library writes into it (NumPy: a read-only array is refused). An
  // object nanobind cannot import (a NumPy array in non-native byte order, a non-array)
  // is a qkv::Error naming `name`.
  static ArrayRef from(nb::handle object, bool writable, const char* name);

  int device_type() const { return device_type_; }
  std::size_t ndim() const { return static_cast<std::size_t>(ndim_); }
  std::size_t size() const { return size_; }
  std::size_t shape(std::size_t axis) const { return static_cast<std::size_t>(shape_[axis]); }
  int64_t stride(std::size_t axis) const { return strides_[axis]; }
  const int64_t* stride_ptr() const { return strides_.data(); }
  void* data_handle() const { return data_; }
  std::size_t byte_offset() const { return 0; }
  nb::dlpack::dtype dtype() const { return dtype_; }

  // The same memory with axes 1 and 2 exchanged: PyTorch's [batch, heads, seq, dim] seen
  // as qkv's [batch, seq, heads, dim], no copy.
  ArrayRef swapped_1_2() const;

 private:
  template <class Array>
  static ArrayRef from_ndarray(const Array& array);
  static ArrayRef from_torch(nb::handle tensor);

  void* data_ = nullptr;
  int ndim_ = 0;
  std::size_t size_ = 0;
  std::array<int64_t, kMaxRank> shape_{}, strides_{};
  nb::dlpack::dtype dtype_{};
  int device_type_ = nb::device::cpu::value;
};

// A boolean or uint8 array as the uint8 view qkv's keep masks use (same bytes: NumPy
// and PyTorch store bool as one byte holding 0 or 1).
TensorView<const std::uint8_t, 4> byte_mask_view(const char* name, const ArrayRef& array);

// An optional float32 vector output (a per-head gradient: dsinks, dalibi_slopes) as the
// span the library writes; empty when not given.
inline std::span<float> optional_float_span(const char* name, const std::optional<ArrayRef>& array,
                                            const char* because) {
  if (!array) return {};
  const auto view = view_of<float, 1>(name, *array, because);
  return {view.data, static_cast<std::size_t>(view.shape[0])};
}

// Calls float32() or float64(), decided by q's dtype; anything else is a TypeError naming
// q's dtype. The entry points whose other arrays follow q's dtype dispatch through this.
template <class Float32, class Float64>
void dispatch_on_q(const InArray& q, Float32&& float32, Float64&& float64) {
  expect_cpu("q", q.device_type());
  if (q.dtype() == nb::dtype<float>()) return float32();
  if (q.dtype() == nb::dtype<double>()) return float64();
  argument_type_error("q", "expected dtype float32 or float64, got " + dtype_name(q.dtype()));
}

// Key lists (DeepSeek sparse attention's top-k) as the library's KeyIndices, read in
// place: rank 3 [B, Nq, topk] shared by the heads, rank 4 [B, Hkv, Nq, topk] per kv head;
// int32 or int64, else an error naming the Caller's function (sparse.cpp).
KeyIndices indices_of(const ArrayRef& array);
// Packed lists [total_q, topk] (qkv.BatchPlan.run's), int32 or int64.
KeyIndices packed_indices_of(const ArrayRef& array);

}  // namespace qkv::python
