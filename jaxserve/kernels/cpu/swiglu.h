// SwiGLU as a matmul's epilogue, shared by bf16_matmul.cc and ggml_matmul.cc (attribute
// swiglu): the weight holds gate | up with their output columns interleaved in groups of
// kSwigluGroup (column 32 g + i is gate's column 16 g + i, 32 g + 16 + i up's:
// bf16_matmul.interleave_gate_up, or GGML panels of 16 columns alternating), and the call's
// output is out [M, N / 2] = silu(gate) * up, silu(g) = g * sigmoid(g) with the sigmoid
// from exp(-|g|) (never overflows). A unit of the weight's columns (a bf16 panel of a
// multiple of 32 columns; a pair of GGML panels) runs into a thread's scratch, kSwigluRows
// rows at a time, and swiglu_rows writes that unit's activation columns.
//
// Source: Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU); the sigmoid of
// Ramachandran et al. 2017 ("Searching for Activation Functions", SiLU / swish).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp_nonpositive.h"

namespace jaxserve {

constexpr int64_t kSwigluGroup = 16;  // columns of gate, then of up, in each group of 32
// Rows per scratch chunk: whole 14-row (round_x) and 32-row (AMX) blocks of the bf16
// kernel, and 8-row ones of the GGML kernel; 224 x 64 f32 = 56 KB, in L2 while the
// epilogue reads it back.
constexpr int64_t kSwigluRows = 224;

// silu(g) * u for one element (the portable epilogue; swiglu_rows' AVX-512 one computes
// the same with exp16).
inline float silu_times(float g, float u) {
  const float e = exp_nonpositive(-std::fabs(g));
  return g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * u;
}

// A unit's raw output s [rows, P] (gate and up interleaved) -> out [rows, P / 2], rows
// ldo elements apart: f32 (O = float), or rounded to bf16 (O = uint16_t: to nearest even,
// as to_bf16 and XLA's convert).
template <typename O>
void swiglu_rows(const float* s, int64_t rows, int64_t P, O* out, int64_t ldo) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = s + r * P;
    O* o = out + r * ldo;
    for (int64_t g = 0; g < P / (2 * kSwigluGroup); ++g) {
      const float* gate = sr + 2 * kSwigluGroup * g;
      const float* up = gate + kSwigluGroup;
      O* og = o + kSwigluGroup * g;
#if defined(__AVX512F__)
      const __m512 vg = _mm512_loadu_ps(gate), vu = _mm512_loadu_ps(up);
      const __m512 one = _mm512_set1_ps(1.0f);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(vg)));
      const __mmask16 neg = _mm512_cmp_ps_mask(vg, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 sig = _mm512_div_ps(_mm512_mask_mov_ps(one, neg, e), _mm512_add_ps(one, e));
      const __m512 h = _mm512_mul_ps(_mm512_mul_ps(vg, sig), vu);
      if constexpr (std::is_same_v<O, float>) {
        _mm512_storeu_ps(og, h);
      } else {
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(og), (__m256i)_mm512_cvtneps_pbh(h));
#else
        alignas(64) float hs[kSwigluGroup];
        _mm512_store_ps(hs, h);
        for (int64_t i = 0; i < kSwigluGroup; ++i) og[i] = to_bf16(hs[i]);
#endif
      }
#else
      for (int64_t i = 0; i < kSwigluGroup; ++i) {
        const float h = silu_times(gate[i], up[i]);
        if constexpr (std::is_same_v<O, float>) og[i] = h;
        else og[i] = to_bf16(h);
      }
#endif
    }
  }
}

// Unit u (output columns u * width .. + width of the interleaved weight) over rows
// m_begin .. m_end of a swiglu problem p (a kernel's Problem: out [M, N / 2] f32, or bf16
// with out_bf16, ldo its row stride): run(q, m0, m1) computes the unit's rows m0 .. m1 into
// q's output (this thread's scratch: q.out, q.ldo = width, q.row0 = m0, q.col0 = u *
// width, where the kernel's blocks store through out_at), chunk by chunk, and each chunk's
// epilogue writes its width / 2 columns of p.out.
template <typename Problem, typename Run>
void run_unit_swiglu(const Problem& p, int64_t u, int64_t width, int64_t m_begin,
                     int64_t m_end, Run&& run) {
  thread_local std::vector<float> scratch;
  const int64_t chunk = std::min(kSwigluRows, m_end - m_begin);
  if (static_cast<int64_t>(scratch.size()) < chunk * width) scratch.resize(chunk * width);
  Problem q = p;
  q.out = scratch.data();
  q.ldo = width;
  q.col0 = u * width;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kSwigluRows) {
    const int64_t m1 = std::min(m0 + kSwigluRows, m_end);
    q.row0 = m0;
    run(q, m0, m1);
    const int64_t at = m0 * p.ldo + u * (width / 2);
    if (p.out_bf16)
      swiglu_rows(scratch.data(), m1 - m0, width, reinterpret_cast<uint16_t*>(p.out) + at,
                  p.ldo);
    else
      swiglu_rows(scratch.data(), m1 - m0, width, p.out + at, p.ldo);
  }
}

}  // namespace jaxserve
