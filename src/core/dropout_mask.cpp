// qkv::dropout_keep_mask: core/dropout.hpp's keep decisions, written out.
#include "qkv/dropout.hpp"

#include <string>

#include "core/dropout.hpp"
#include "qkv/error.hpp"

namespace qkv {

void dropout_keep_mask(TensorView<bool, 4> keep, const Dropout& dropout) {
  if (!(dropout.p >= 0.0f && dropout.p < 1.0f))
    throw Error("qkv::dropout_keep_mask: dropout.p: expected a probability in [0, 1), got " +
                std::to_string(dropout.p));
  const uint32_t threshold = detail::dropout_threshold(dropout.p);
  for (int64_t b = 0; b < keep.shape[0]; ++b)
    for (int64_t h = 0; h < keep.shape[1]; ++h) {
      const uint32_t head_key = detail::dropout_head_key(dropout.seed, dropout.offset, b, h);
      for (int64_t i = 0; i < keep.shape[2]; ++i) {
        const uint32_t row_key = detail::dropout_row_key(head_key, i);
        for (int64_t j = 0; j < keep.shape[3]; ++j) keep(b, h, i, j) = detail::dropout_bits(row_key, j) >= threshold;
      }
    }
}

}  // namespace qkv
