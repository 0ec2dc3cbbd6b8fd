// Each function takes [rows, n] arrays whose rows are contiguous (the Python package
// reshapes any leading axes into rows) and calls the span function of qkv/softmax.hpp
// once per row: the same code, and the same double accumulation, as the C++ API.
#include "softmax.hpp"

#include <nanobind/ndarray.h>

#include <span>
#include <string>

#include "arrays.hpp"
#include "qkv/error.hpp"
#include "qkv/softmax.hpp"

namespace qkv::python {
namespace {

// Rows of a 2-D (or, for the Jacobian, 3-D) array as spans.
template <class T, int R>
struct Rows {
  TensorView<T, R> view;
  int64_t row_length = 0;  // elements per row: n, or n·n for a Jacobian

  Rows(const char* name, const TensorView<T, R>& v) : view(v), row_length(1) {
    for (int axis = 1; axis < R; ++axis) row_length *= v.shape[axis];
    // Within a row the elements must be one contiguous run (C order); an empty array's
    // strides mean nothing.
    int64_t step = 1;
    for (int axis = R - 1; axis >= 1 && v.numel() > 0; --axis) {
      if (v.shape[axis] > 1 && v.strides[axis] != step) {
        throw Error(std::string(name) + ": each row must be contiguous (C order), got strides[" +
                    std::to_string(axis) + "] = " + std::to_string(v.strides[axis]));
      }
      step *= v.shape[axis];
    }
  }
  int64_t count() const { return view.shape[0]; }
  std::span<T> operator[](int64_t row) const {
    return std::span<T>(view.data + row * view.strides[0], static_cast<std::size_t>(row_length));
  }
};

void expect_same_rows(const char* function, const char* name, int64_t expected, int64_t actual) {
  if (expected != actual) {
    throw Error(std::string("qkv::") + function + ": " + name + ".shape[0] (rows): expected " +
                std::to_string(expected) + ", got " + std::to_string(actual));
  }
}

// y = f(x) row by row, for softmax and log_softmax.
template <class T>
void unary_rows(const char* function, void (*f)(std::span<const T>, std::span<T>),
                const InArray& x_array, const OutArray& y_array, const char* because) {
  const Rows<const T, 2> x("x", view_of<const T, 2>("x", x_array, because));
  const Rows<T, 2> y("out", view_of<T, 2>("out", y_array, because));
  expect_same_rows(function, "out", x.count(), y.count());
  nanobind::gil_scoped_release release;
  for (int64_t row = 0; row < x.count(); ++row) f(x[row], y[row]);
}

template <class T>
void jacobian_rows(const InArray& s_array, const OutArray& j_array) {
  const Rows<const T, 2> s("s", view_of<const T, 2>("s", s_array, "the dtype of s"));
  const Rows<T, 3> jacobian(
      "jacobian", view_of<T, 3>("jacobian", j_array, "the dtype of s"));
  expect_same_rows("softmax_jacobian", "jacobian", s.count(), jacobian.count());
  nanobind::gil_scoped_release release;
  for (int64_t row = 0; row < s.count(); ++row) softmax_jacobian(s[row], jacobian[row]);
}

template <class T>
void backward_rows(const InArray& s_array, const InArray& g_array, const OutArray& dx_array) {
  const Rows<const T, 2> s("s", view_of<const T, 2>("s", s_array, "the dtype of s"));
  const Rows<const T, 2> g("g", view_of<const T, 2>("g", g_array, "the dtype of s"));
  const Rows<T, 2> dx("dx", view_of<T, 2>("dx", dx_array, "the dtype of s"));
  expect_same_rows("softmax_backward", "g", s.count(), g.count());
  expect_same_rows("softmax_backward", "dx", s.count(), dx.count());
  nanobind::gil_scoped_release release;
  for (int64_t row = 0; row < s.count(); ++row) softmax_backward(s[row], g[row], dx[row]);
}

// Calls body<float>() or body<double>() by the dtype of `first`.
template <class Body>
void by_dtype(const char* name, const InArray& first, Body&& body) {
  expect_cpu(name, first.device_type());
  if (first.dtype() == nanobind::dtype<float>()) return body(float{});
  if (first.dtype() == nanobind::dtype<double>()) return body(double{});
  argument_type_error(name, "expected dtype float32 or float64, got " + dtype_name(first.dtype()));
}

}  // namespace

void bind_softmax(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def(
      "softmax_rows",
      [](const InArray& x, const OutArray& out) {
        const Caller caller("qkv.softmax");
        by_dtype("x", x, [&](auto zero) {
          using T = decltype(zero);
          unary_rows<T>("softmax", &qkv::softmax, x, out, "the dtype of x");
        });
      },
      nb::arg("x"), nb::arg("out"), "qkv::softmax on each row of x [rows, n] into out.");
  m.def(
      "log_softmax_rows",
      [](const InArray& x, const OutArray& out) {
        const Caller caller("qkv.log_softmax");
        by_dtype("x", x, [&](auto zero) {
          using T = decltype(zero);
          unary_rows<T>("log_softmax", &qkv::log_softmax, x, out, "the dtype of x");
        });
      },
      nb::arg("x"), nb::arg("out"), "qkv::log_softmax on each row of x [rows, n] into out.");
  m.def(
      "softmax_jacobian_rows",
      [](const InArray& s, const OutArray& jacobian) {
        const Caller caller("qkv.softmax_jacobian");
        by_dtype("s", s, [&](auto zero) { jacobian_rows<decltype(zero)>(s, jacobian); });
      },
      nb::arg("s"), nb::arg("jacobian"),
      "qkv::softmax_jacobian of each row of s [rows, n] into jacobian [rows, n, n].");
  m.def(
      "softmax_backward_rows",
      [](const InArray& s, const InArray& g, const OutArray& dx) {
        const Caller caller("qkv.softmax_backward");
        by_dtype("s", s, [&](auto zero) { backward_rows<decltype(zero)>(s, g, dx); });
      },
      nb::arg("s"), nb::arg("g"), nb::arg("dx"),
      "qkv::softmax_backward of each row: dx = s ⊙ (g − ⟨s, g⟩).");
}

}  // namespace qkv::python
