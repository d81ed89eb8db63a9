// Greedy argmax of logits rows (see framework/engine/greedy_native.py for the contract): per
// row the index of its first maximum and that maximum, in one pass over the row as it lies
// (bfloat16 or float32, no float32 copy of the logits), rows over OpenMP threads.  The row
// pass (and its rules for ties, NaN and -inf) is framework/core/csrc/row_argmax.h, which the
// LM head's fused greedy epilogue (passes/csrc/small_m_linear.cpp) runs too.
//
// No torch headers: a C ABI on data pointers, called through ctypes (framework/core/
// native_build.py builds it with -O3 -march=native, or portable -O3 where that fails).
#include <cstdint>

#include "../../core/csrc/row_argmax.h"

namespace {

using pw_argmax::row_argmax;

template <typename T>
void run(const T* x, int64_t rows, int64_t n, int64_t stride, int64_t* idx, float* val) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) row_argmax(x + r * stride, n, idx + r, val + r);
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16.  x: rows of n values, row r at x + r * stride (elements).
// idx[r], val[r]: the first maximum's column and value.  Returns 0, 1 for a bad dtype, 2 for
// bad sizes.
int piecewise_greedy_argmax(const void* x, int64_t rows, int64_t n, int64_t stride, int64_t dtype,
                            int64_t* idx, float* val) {
  if (rows < 0 || n <= 0 || stride < n) return 2;
  if (dtype == 0) {
    run(static_cast<const float*>(x), rows, n, stride, idx, val);
  } else if (dtype == 1) {
    run(static_cast<const uint16_t*>(x), rows, n, stride, idx, val);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
