// Tensors: a non-owning strided view (the currency of the API) and an owning,
// 64-byte-aligned, contiguous tensor for tests, examples and layers.
//
// Attention tensors are 4-D views in the logical order [batch, seq, heads, dim].
// PyTorch's [batch, heads, seq, dim] memory layout is the same logical view with other
// strides (see `TensorView::from_bhsd`), so callers never copy to call qkv.
// Strides are in elements, not bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <new>
#include <type_traits>

namespace qkv {

template <class T, int Rank>
struct TensorView {
  static_assert(Rank >= 1 && Rank <= 4, "qkv views have rank 1 to 4");
  using Shape = std::array<int64_t, Rank>;

  T* data = nullptr;
  Shape shape{};
  Shape strides{};

  constexpr TensorView() = default;
  constexpr TensorView(T* data_, const Shape& shape_, const Shape& strides_)
      : data(data_), shape(shape_), strides(strides_) {}

  // A view over mutable elements converts to a view over const ones.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  constexpr TensorView(const TensorView<U, Rank>& other)  // NOLINT(google-explicit-constructor)
      : data(other.data), shape(other.shape), strides(other.strides) {}

  // Row-major (C order) view over `data`.
  static constexpr TensorView contiguous(T* data, const Shape& shape) {
    Shape strides{};
    int64_t step = 1;
    for (int axis = Rank - 1; axis >= 0; --axis) {
      strides[axis] = step;
      step *= shape[axis];
    }
    return TensorView(data, shape, strides);
  }

  // A C-order [batch, heads, seq, dim] buffer (PyTorch's layout) seen as the logical
  // [batch, seq, heads, dim] view that qkv's attention functions take. No copy.
  template <int R = Rank, class = std::enable_if_t<R == 4>>
  static constexpr TensorView from_bhsd(T* data, int64_t batch, int64_t heads, int64_t seq,
                                        int64_t dim) {
    return TensorView(data, Shape{batch, seq, heads, dim},
                      Shape{heads * seq * dim, dim, seq * dim, 1});
  }

  constexpr bool empty() const { return data == nullptr; }

  constexpr int64_t numel() const {
    int64_t n = 1;
    for (int64_t extent : shape) n *= extent;
    return n;
  }

  template <class... Index>
  constexpr T& operator()(Index... index) const {
    static_assert(sizeof...(Index) == Rank, "one index per axis");
    const std::array<int64_t, Rank> idx{static_cast<int64_t>(index)...};
    int64_t offset = 0;
    for (int axis = 0; axis < Rank; ++axis) offset += idx[axis] * strides[axis];
    return data[offset];
  }
};

template <class T>
using View4 = TensorView<T, 4>;
template <class T>
using View3 = TensorView<T, 3>;

// Owning, contiguous (C order), 64-byte-aligned tensor. Elements start zeroed.
template <class T, int Rank>
class Tensor {
  static_assert(std::is_trivially_destructible_v<T>, "Tensor holds plain numbers");

 public:
  using Shape = std::array<int64_t, Rank>;
  static constexpr std::size_t kAlignment = 64;  // one cache line; every SIMD width we target

  Tensor() = default;
  explicit Tensor(const Shape& shape) : shape_(shape) {
    std::size_t count = 1;
    for (int64_t extent : shape) {
      if (extent < 0) throw std::bad_array_new_length();
      count *= static_cast<std::size_t>(extent);
    }
    size_ = count;
    // aligned_alloc wants a size that is a multiple of the alignment.
    const std::size_t bytes = ((count * sizeof(T) + kAlignment - 1) / kAlignment) * kAlignment;
    void* raw = std::aligned_alloc(kAlignment, bytes == 0 ? kAlignment : bytes);
    if (raw == nullptr) throw std::bad_alloc();
    data_.reset(static_cast<T*>(raw));
    for (std::size_t i = 0; i < count; ++i) new (data_.get() + i) T{};
  }

  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor& other) : Tensor(other.shape_) {
    for (std::size_t i = 0; i < size_; ++i) data_[i] = other.data_[i];
  }
  Tensor& operator=(const Tensor& other) {
    if (this != &other) *this = Tensor(other);
    return *this;
  }

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  const Shape& shape() const { return shape_; }

  TensorView<T, Rank> view() { return TensorView<T, Rank>::contiguous(data(), shape_); }
  TensorView<const T, Rank> view() const {
    return TensorView<const T, Rank>::contiguous(data(), shape_);
  }
  TensorView<const T, Rank> cview() const { return view(); }

  T& operator[](std::size_t i) { return data_[i]; }
  const T& operator[](std::size_t i) const { return data_[i]; }

  template <class... Index>
  T& operator()(Index... index) {
    return view()(index...);
  }
  template <class... Index>
  const T& operator()(Index... index) const {
    return view()(index...);
  }

 private:
  struct FreeDeleter {
    void operator()(T* p) const { std::free(p); }
  };
  Shape shape_{};
  std::size_t size_ = 0;
  std::unique_ptr<T[], FreeDeleter> data_;
};

}  // namespace qkv
