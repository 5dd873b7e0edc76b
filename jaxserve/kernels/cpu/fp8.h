// fp8 e4m3fn -> f32 conversion shared by the CPU kernels (an fp8 KV pool's elements).
//
// e4m3fn (OCP FP8, ml_dtypes.float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa
// bits; no infinities, 0x7f / 0xff are NaN (jaxserve clips K/V to +-448 before storing,
// so a pool never holds them). Normal (exponent e in 1..15): (-1)^s 2^(e-7) (1 + m/8);
// subnormal (e = 0): (-1)^s m 2^-9. Every e4m3fn value is an f32 exactly, so both
// conversions below are exact; the vector one never makes an f32 subnormal (a CPU with
// denormals-are-zero set would read those as 0).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace jaxserve {

inline float from_fp8_e4m3(uint8_t b) {
  const uint32_t mag = b & 0x7fu;
  float f;
  if (mag < 8) {  // exponent field 0: subnormal (or zero)
    f = static_cast<float>(mag) * 0x1p-9f;
  } else {        // exponent e + 120 in f32's field, the 3 mantissa bits on top of its 23
    const uint32_t u = (mag << 20) + (120u << 23);
    std::memcpy(&f, &u, sizeof(f));
  }
  return (b & 0x80u) ? -f : f;
}

#if defined(__AVX512F__)
// 16 e4m3fn bytes -> 16 f32, as from_fp8_e4m3.
inline __m512 load16_fp8_e4m3(const uint8_t* x) {
  const __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7f));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20),
                                          _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1p-9f));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 f = _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(normal), sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
}
#endif

#if defined(__AVX2__)
// 8 e4m3fn bytes -> 8 f32, as from_fp8_e4m3.
inline __m256 load8_fp8_e4m3(const uint8_t* x) {
  const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
  const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7f));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20),
                                          _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
  const __m256 f = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub,
                                    _mm256_castsi256_ps(is_sub));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign));
}
#endif

}  // namespace jaxserve
