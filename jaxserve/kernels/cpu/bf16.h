// bf16 <-> f32 conversions shared by the CPU kernels (bf16 is the top half of an f32).
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxserve {

inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// bf16(x) by round to nearest even (NaN kept a quiet NaN), as _mm512_cvtne2ps_pbh.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace jaxserve
