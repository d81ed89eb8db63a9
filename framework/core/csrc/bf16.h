// bfloat16 <-> float32 for the native kernels, bit for bit as torch converts: widening is
// exact (the 16 bits become the high half), narrowing rounds to nearest even and keeps a NaN
// a quiet NaN.  Used by passes/csrc/small_m_linear.cpp, int8_linear.cpp and
// fused_moe_packed.cpp (the ctypes libraries and the piecewise torch op library that includes
// all three).  No torch headers.  backends/attention/csrc/cpu_paged_attention.cpp keeps its
// own two functions: it is built as one file, also from other revisions
// (experiments.bench.attention_ab copies it alone into a scratch folder).
#pragma once

#include <cstdint>
#include <cstring>

namespace pw_bf16 {

inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace pw_bf16
