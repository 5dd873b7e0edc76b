// exp(x) for x <= 0, shared by the CPU kernels (softmax arguments after subtracting the
// running maximum, log-sum-exp terms).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxserve {

// Cody-Waite range reduction and Cephes' degree-6 polynomial, relative error < 2e-7; plain
// arithmetic, so the compiler vectorises the loops that call it. x below -87 (-inf
// included) returns ~2^-126, not 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return y * two_n;
}

}  // namespace jaxserve
