// GGML block-quantised weight matmul on the CPU: y[M, N] f32 = x[M, K] f32 @ W^T, W [N, K]
// stored in GGUF's Q4_0 / Q4_1 / Q8_0 blocks of 32 inputs (scales as stored, f16). An XLA FFI
// custom call (see ggml_matmul.py).
//
// x is quantised per row and block of 32 to int8 as llama.cpp's q8_0 / q8_1 path does
// (d_x = max|x| / 127, q = round(x / d_x), and the block's sum of q), then each block's
// product is an integer dot product, scaled:
//   Q4_1: d_w d_x sum(q_w q_x) + m_w d_x sum(q_x)
//   Q4_0: d_w d_x (sum(q_w q_x) - 8 sum(q_x))        (q_w the nibble 0..15)
//   Q8_0: d_w d_x (sum((q_w + 128) q_x) - 128 sum(q_x))  (q_w int8, stored + 128 as u8)
// The unsigned x signed byte products are AVX512-VNNI's vpdpbusd (4 per 32-bit lane), the
// integer sums exact; one f32 FMA per block and row adds them to the output.
//
// The weights are repacked once at load (ggml_matmul.pack, the same bytes) into panels of
// 16 output columns: w[N / 16, K / 32, B] u8, one record of B bytes per (panel, block):
//   d   16 x f16 (the 16 columns' block scales)                          32 bytes
//   m   16 x f16 (Q4_1's block minimums)                                 32 bytes, Q4_1 only
//   qs  Q4: 4 groups of 8 inputs x 16 columns x 4 bytes: byte t of column c in group g
//           holds input 8g + t in its low nibble, 8g + 4 + t in its high one   256 bytes
//       Q8_0: 8 quads of 4 inputs x 16 columns x 4 bytes (q_w + 128)        512 bytes
// so that one 64-byte load is 16 columns x 4 inputs: vpdpbusd's lanes are the 16 output
// columns, each summing its own 4 products with x's 4 bytes broadcast: no horizontal sums,
// and a panel's record stream (<= 17 KB for K = 1536) is read once per call, shared by a
// register block of up to 8 rows. B = 288 (Q4_0), 320 (Q4_1), 544 (Q8_0).
//
// Work split as bf16_matmul.cc: items of consecutive panels over XLA's intra-op threads
// (parallel.h), split by rows too when x has many and the weight few panels. Without
// AVX512-VNNI, an AVX2 (+ FMA, F16C) path takes each 64-byte load as two 8-column halves
// and each 4-product lane sum as vpmaddubsw then vpmaddwd against ones (llama.cpp's
// mul_sum_us8_pairs_float; Q8_0's weights made signed, their sign moved onto x so no
// 16-bit pair sum saturates; a Q4 block's 8 vpmaddubsw results added in int16 first, one
// vpmaddwd per block), and elsewhere a portable loop; all three do the same integer sums
// (exact) and f32 arithmetic in the same order (bit-identical results). Which one runs is
// fixed when the library is built for the machine (-march=native, build.py). x's quants,
// scales and sums are stored block-major ([K / 32, M, ...], x_block): a register block's
// rows of one block lie together.
//
// Shapes: x [M, K] f32; w [N / 16, K / 32, B] u8, or a stack of them [L, N / 16, K / 32, B]
// (a layer loop's weights) read at layer (s32 scalar, 0 for an unstacked w) in place; out
// [M, N] f32; attributes fmt (0 Q4_0, 1 Q4_1, 2 Q8_0) and swiglu (bool: w is gate | up with
// their 16-column panels alternating, gate's panel j then up's, and out [M, N / 2] f32 =
// silu(gate) * up, each pair of panels' epilogue: swiglu.h).
//
// Sources: llama.cpp's ggml_vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0 and quantize_row_q8_0
// / q8_1 (ggml/src/ggml-cpu/quants.c); the interleaved repacking of its ggml-cpu/repack.cpp
// (block_q4_0x8), here 16 columns wide for 512-bit registers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "stacked.h"
#include "swiglu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kCols = 16;
constexpr int64_t kItemsPerCall = 16;
constexpr int64_t kMinSplitRows = 64;
constexpr int64_t kMaxRows = 8;

enum Fmt : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

int64_t record_bytes(int64_t fmt) {
  return fmt == kQ4_0 ? 288 : fmt == kQ4_1 ? 320 : 544;
}

// IEEE half -> float, exact (subnormals, inf, NaN).
inline float from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { mant <<= 1; ++e; } while (!(mant & 0x400u));
    u = sign | ((112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

struct Problem {
  const int8_t* xq;     // [K / 32, M, 32] x quantised per block, block-major (x_block)
  const float* dx;      // [K / 32, M] x's block scales
  const int32_t* sx;    // [K / 32, M] sums of x's quants per block
  const uint8_t* w;     // [N / 16, K / 32, B]
  float* out;           // [M, N] (or a unit's scratch: out_at)
  int64_t M, KB, N, fmt, B;
  // Where the blocks store output (row m, column n): out + (m - row0) * ldo + (n - col0);
  // the whole output: ldo N, row0 = col0 = 0 (swiglu: jaxserve::run_unit_swiglu's scratch).
  int64_t ldo = 0, row0 = 0, col0 = 0;
  bool out_bf16 = false;  // (swiglu.h's field; this kernel's activation is f32)
};

inline float* out_at(const Problem& p, int64_t m, int64_t n) {
  return p.out + (m - p.row0) * p.ldo + (n - p.col0);
}

// Where row m's block b of x is in xq (times 32), dx and sx: block-major, so that a register
// block's rows of one block lie together (one pointer, constant offsets).
inline int64_t x_block(int64_t M, int64_t m, int64_t b) { return b * M + m; }

// x [M, K] -> per row and block of 32: d = max|x| / 127, q = round(x / d) (nearest, ties
// away from zero, as llama.cpp's quantize_row_q8_0_ref), s = sum(q); stored at x_block.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, int32_t* sx) {
  const int64_t KB = K / kBlock;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < KB; ++b) {
      const float* v = x + (m * KB + b) * kBlock;
      const int64_t i = x_block(M, m, b);
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t s = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int q = static_cast<int>(std::round(v[j] * id));
        xq[i * kBlock + j] = static_cast<int8_t>(q);
        s += q;
      }
      dx[i] = d;
      sx[i] = s;
    }
}

// x's quants of row m, block b, inputs 8g .. 8g + 3 and 8g + 4 .. 8g + 7 as two 32-bit words
// (what a Q4 record's low and high nibbles of group g multiply).
inline void x_quads(const Problem& p, int64_t m, int64_t b, int g, int32_t* x0, int32_t* x1) {
  const int8_t* xr = p.xq + x_block(p.M, m, b) * kBlock + 8 * g;
  std::memcpy(x0, xr, 4);
  std::memcpy(x1, xr + 4, 4);
}

// The quant of column c, input j (0..31) of a record's qs (the packing above).
inline int32_t weight_quant(const uint8_t* qs, int64_t fmt, int c, int j) {
  if (fmt == kQ8_0) return static_cast<int32_t>(qs[(j / 4) * 64 + c * 4 + j % 4]);  // + 128
  const int g = j / 8, t = j % 8;
  const uint8_t byte = qs[g * 64 + c * 4 + (t & 3)];
  return t < 4 ? (byte & 15) : (byte >> 4);
}

// Portable: rows m_begin .. m_end of panel pi, the kernel's arithmetic in its order. Each
// record's quants are unpacked once into q[32][16] (input-major, the 16 columns contiguous)
// for all the rows, whose integer sums then run over the columns as plain loops the compiler
// vectorises (SSE, NEON): the same integer sums and f32 steps as the SIMD paths.
void panel_portable(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end) {
  const int64_t head = p.fmt == kQ4_1 ? 64 : 32;
  const int32_t off = p.fmt == kQ4_0 ? 8 : p.fmt == kQ8_0 ? 128 : 0;
  constexpr int64_t kRows = 8;  // rows sharing one unpacked record
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kRows) {
    const int64_t rows = std::min(kRows, m_end - m0);
    float acc[kRows][kCols] = {};
    for (int64_t b = 0; b < p.KB; ++b) {
      const uint8_t* rec = p.w + (pi * p.KB + b) * p.B;
      int32_t q[kBlock][kCols];
      for (int j = 0; j < kBlock; ++j)
        for (int c = 0; c < kCols; ++c) q[j][c] = weight_quant(rec + head, p.fmt, c, j);
      float dw[kCols], mw[kCols];
      for (int c = 0; c < kCols; ++c) {
        uint16_t h;
        std::memcpy(&h, rec + 2 * c, 2);
        dw[c] = from_f16(h);
        if (p.fmt == kQ4_1) {
          std::memcpy(&h, rec + 32 + 2 * c, 2);
          mw[c] = from_f16(h);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = x_block(p.M, m0 + r, b);
        const int8_t* xq = p.xq + i * kBlock;
        const float dx = p.dx[i];
        const int32_t sx = p.sx[i];
        int32_t isum[kCols] = {};
        for (int j = 0; j < kBlock; ++j)
          for (int c = 0; c < kCols; ++c) isum[c] += q[j][c] * xq[j];
        for (int c = 0; c < kCols; ++c) {
          acc[r][c] = std::fma(static_cast<float>(isum[c] - off * sx), dw[c] * dx, acc[r][c]);
          if (p.fmt == kQ4_1) acc[r][c] = std::fma(mw[c], dx * static_cast<float>(sx), acc[r][c]);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      std::copy(acc[r], acc[r] + kCols, out_at(p, m0 + r, pi * kCols));
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// R rows (m0 ..) of panel pi: per block, R int32 accumulators of vpdpbusd over the record's
// qs, then one scaled f32 FMA per row (and Q4_1's minimum term).
template <int R, int64_t kFmt>
inline void block_vnni(const Problem& p, int64_t pi, int64_t m0, bool prefetch) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const uint8_t* rec = p.w + pi * p.KB * p.B;
  constexpr int64_t head = kFmt == kQ4_1 ? 64 : 32;
  constexpr int32_t off = kFmt == kQ4_0 ? 8 : kFmt == kQ8_0 ? 128 : 0;
  for (int64_t b = 0; b < p.KB; ++b, rec += p.B) {
    if (prefetch)  // the record 4 ahead: a panel streams from memory once
      for (int64_t o = 0; o < p.B; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * p.B + o), _MM_HINT_T0);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    const uint8_t* qs = rec + head;
    if constexpr (kFmt == kQ8_0) {
      for (int q = 0; q < 8; ++q) {
        const __m512i w = _mm512_loadu_si512(qs + 64 * q);
        for (int r = 0; r < R; ++r) {
          int32_t xv;
          std::memcpy(&xv, p.xq + x_block(p.M, m0 + r, b) * kBlock + 4 * q, 4);
          isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(xv));
        }
      }
    } else {
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(qs + 64 * g);
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < R; ++r) {
          int32_t x0, x1;
          x_quads(p, m0 + r, b, g, &x0, &x1);
          isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(x0));
          isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(x1));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    __m512 mw;
    if constexpr (kFmt == kQ4_1)
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = x_block(p.M, m0 + r, b);
      const float dx = p.dx[i];
      __m512i s = isum[r];
      if constexpr (off != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(off * p.sx[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx)),
                               acc[r]);
      if constexpr (kFmt == kQ4_1)
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx * static_cast<float>(p.sx[i])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out_at(p, m0 + r, pi * kCols), acc[r]);
}

template <int64_t kFmt>
void panel_vnni(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end) {
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kMaxRows) {
    const bool first = m0 == m_begin;
    switch (std::min(kMaxRows, m_end - m0)) {
      case 8: block_vnni<8, kFmt>(p, pi, m0, first); break;
      case 7: block_vnni<7, kFmt>(p, pi, m0, first); break;
      case 6: block_vnni<6, kFmt>(p, pi, m0, first); break;
      case 5: block_vnni<5, kFmt>(p, pi, m0, first); break;
      case 4: block_vnni<4, kFmt>(p, pi, m0, first); break;
      case 3: block_vnni<3, kFmt>(p, pi, m0, first); break;
      case 2: block_vnni<2, kFmt>(p, pi, m0, first); break;
      default: block_vnni<1, kFmt>(p, pi, m0, first);
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__))
// Sum of 4 u8 x s8 products per 32-bit lane (as vpdpbusd), for weights of at most 128 (Q4's
// nibbles; Q8_0's magnitudes, x carrying their signs): a 16-bit pair sum is at most
// 2 * 128 * 127, no saturation.
inline __m256i dot4(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// R rows (m0 ..) of panel pi, as block_vnni, on 8-column halves (h: the records' 32-byte
// halves): per block and row an int32 sum of each half's 8 columns, then the same scaled f32
// FMAs. Up to 2 rows take both halves in one pass over the panel; more rows take one half per
// pass, halving the accumulators and sums live at once (both halves of 4 rows at once, GCC
// spilled them around every multiply; at 8 rows a few accumulators still spill, once per
// block); the second pass reads the panel from L1 (a record stream of <= 17 KB).
template <int R, int64_t kFmt>
inline void block_avx2(const Problem& p, int64_t pi, int64_t m0, bool prefetch) {
  constexpr int kH = R <= 2 ? 2 : 1;  // halves per pass
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones16 = _mm256_set1_epi16(1);
  constexpr int64_t head = kFmt == kQ4_1 ? 64 : 32;
  // Q8_0's sums here are of the signed quants (the stored + 128 made signed): no offset
  constexpr int32_t off = kFmt == kQ4_0 ? 8 : 0;
  for (int h0 = 0; h0 < 2; h0 += kH) {
    __m256 acc[kH][R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < kH; ++h) acc[h][r] = _mm256_setzero_ps();
    const uint8_t* rec = p.w + pi * p.KB * p.B;
    for (int64_t b = 0; b < p.KB; ++b, rec += p.B) {
      if (prefetch && h0 == 0)  // the record 4 ahead: a panel streams from memory once
        for (int64_t o = 0; o < p.B; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * p.B + o), _MM_HINT_T0);
      __m256i isum[kH][R];
      const uint8_t* qs = rec + head + 32 * h0;
      const int64_t i0 = x_block(p.M, m0, b);  // rows m0 + r's quants at xb + 32 r
      const int8_t* xb = p.xq + i0 * kBlock;
      asm("" : "+r"(xb));  // one pointer: else GCC keeps one per (row, load), spilled
      if constexpr (kFmt == kQ8_0) {
        const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 2
        for (int h = 0; h < kH; ++h)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) isum[h][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q)
#pragma GCC unroll 2
          for (int h = 0; h < kH; ++h) {
            const __m256i w = _mm256_xor_si256(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * q + 32 * h)), flip);
            const __m256i aw = _mm256_sign_epi8(w, w);  // |w| (-128 stays 0x80: 128 unsigned)
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              int32_t xv;
              std::memcpy(&xv, xb + kBlock * r + 4 * q, 4);
              const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(xv), w);
              isum[h][r] = _mm256_add_epi32(isum[h][r], dot4(aw, sx));
            }
          }
      } else {
        // Q4: the block's 8 vpmaddubsw pair sums per row and half added in int16 (each
        // |pair| <= 2 * 15 * 127, 8 of them <= 30,480: no overflow), then one vpmaddwd: the
        // same exact int32 sums as dot4 per group, with a third of the multiplies.
        __m256i psum[kH][R];
#pragma GCC unroll 8
        for (int g = 0; g < 4; ++g)
#pragma GCC unroll 2
          for (int h = 0; h < kH; ++h) {
            const __m256i v =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * g + 32 * h));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              int32_t x0, x1;  // inputs 8g .. 8g + 3 (low nibbles), 8g + 4 .. 8g + 7 (high)
              std::memcpy(&x0, xb + kBlock * r + 8 * g, 4);
              std::memcpy(&x1, xb + kBlock * r + 8 * g + 4, 4);
              const __m256i pairs =
                  _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
              psum[h][r] = g == 0 ? pairs : _mm256_add_epi16(psum[h][r], pairs);
              // a chain: GCC's reassociation would otherwise hold all 32 products live
              asm("" : "+x"(psum[h][r]));
            }
          }
#pragma GCC unroll 2
        for (int h = 0; h < kH; ++h)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) isum[h][r] = _mm256_madd_epi16(psum[h][r], ones16);
      }
#pragma GCC unroll 2
      for (int h = 0; h < kH; ++h) {
        const uint8_t* scales = rec + 16 * (h0 + h);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
        __m256 mw;
        if constexpr (kFmt == kQ4_1)
          mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 32)));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float dx = p.dx[i0 + r];
          __m256i s = isum[h][r];
          if constexpr (off != 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(off * p.sx[i0 + r]));
          acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s),
                                      _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[h][r]);
          if constexpr (kFmt == kQ4_1)
            acc[h][r] = _mm256_fmadd_ps(
                mw, _mm256_set1_ps(dx * static_cast<float>(p.sx[i0 + r])), acc[h][r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < kH; ++h)
        _mm256_storeu_ps(out_at(p, m0 + r, pi * kCols + 8 * (h0 + h)), acc[h][r]);
  }
}

template <int64_t kFmt>
void panel_avx2(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end) {
  // rows sharing a panel's pass: 8 as block_vnni (4, 5 and 6 measured within 5% of it)
  constexpr int64_t kAvx2Rows = 8;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kAvx2Rows) {
    const bool first = m0 == m_begin;
    switch (std::min(kAvx2Rows, m_end - m0)) {
      case 8: block_avx2<8, kFmt>(p, pi, m0, first); break;
      case 7: block_avx2<7, kFmt>(p, pi, m0, first); break;
      case 6: block_avx2<6, kFmt>(p, pi, m0, first); break;
      case 5: block_avx2<5, kFmt>(p, pi, m0, first); break;
      case 4: block_avx2<4, kFmt>(p, pi, m0, first); break;
      case 3: block_avx2<3, kFmt>(p, pi, m0, first); break;
      case 2: block_avx2<2, kFmt>(p, pi, m0, first); break;
      default: block_avx2<1, kFmt>(p, pi, m0, first);
    }
  }
}
#define JAXSERVE_GGML_AVX2 1
#endif

void run_panel(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  switch (p.fmt) {
    case kQ4_0: return panel_vnni<kQ4_0>(p, pi, m_begin, m_end);
    case kQ4_1: return panel_vnni<kQ4_1>(p, pi, m_begin, m_end);
    default: return panel_vnni<kQ8_0>(p, pi, m_begin, m_end);
  }
#elif defined(JAXSERVE_GGML_AVX2)
  switch (p.fmt) {
    case kQ4_0: return panel_avx2<kQ4_0>(p, pi, m_begin, m_end);
    case kQ4_1: return panel_avx2<kQ4_1>(p, pi, m_begin, m_end);
    default: return panel_avx2<kQ8_0>(p, pi, m_begin, m_end);
  }
#else
  panel_portable(p, pi, m_begin, m_end);
#endif
}

ffi::Error GgmlMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::U8> w, ffi::BufferR0<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out, int64_t fmt, bool swiglu) {
  const auto xd = x.dimensions();
  if (fmt < kQ4_0 || fmt > kQ8_0)
    return ffi::Error::InvalidArgument("ggml_matmul: fmt must be 0 (Q4_0), 1 (Q4_1) or 2 (Q8_0)");
  int64_t wd[3], offset;
  switch (jaxserve::layer_of_stack(w.dimensions(), 3, *layer.typed_data(), wd, &offset)) {
    case jaxserve::StackError::kRank:
      return ffi::Error::InvalidArgument("ggml_matmul: w must be [N / 16, K / 32, B] or [L, ...]");
    case jaxserve::StackError::kLayer:
      return ffi::Error::InvalidArgument("ggml_matmul: layer must be in [0, the stack's length)");
    case jaxserve::StackError::kNone: break;
  }
  if (xd.size() != 2 || xd[1] != wd[1] * kBlock || wd[2] != record_bytes(fmt))
    return ffi::Error::InvalidArgument(
        "ggml_matmul: x must be [M, K] and w [N / 16, K / 32, record bytes of fmt]");
  if (swiglu && wd[0] % 2 != 0)
    return ffi::Error::InvalidArgument(
        "ggml_matmul: swiglu needs an even number of panels (gate's and up's alternating)");
  const auto od = out->dimensions();
  const int64_t out_cols = swiglu ? wd[0] * kCols / 2 : wd[0] * kCols;
  if (od.size() != 2 || od[0] != xd[0] || od[1] != out_cols)
    return ffi::Error::InvalidArgument(std::string("ggml_matmul: out must be [M, ") +
                                       (swiglu ? "N / 2" : "N") + "]");
  Problem p;
  p.M = xd[0]; p.KB = wd[1]; p.N = wd[0] * kCols; p.fmt = fmt; p.B = wd[2];
  p.ldo = out_cols;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  std::vector<int8_t> xq(p.M * p.KB * kBlock);
  std::vector<float> dx(p.M * p.KB);
  std::vector<int32_t> sx(p.M * p.KB);
  quantize_rows(x.typed_data(), p.M, p.KB * kBlock, xq.data(), dx.data(), sx.data());
  p.xq = xq.data(); p.dx = dx.data(); p.sx = sx.data();
  p.w = w.typed_data() + offset;  // the layer's panels, not a copy
  p.out = out->typed_data();
  if (swiglu) {  // units of two panels: gate's 16 columns, then up's (swiglu.h)
    jaxserve::parallel_panels(
        pool, wd[0] / 2, p.M, kItemsPerCall, kMinSplitRows, kMaxRows,
        [&p](int64_t u, int64_t m_begin, int64_t m_end) {
          jaxserve::run_unit_swiglu(p, u, 2 * kCols, m_begin, m_end,
                                    [u](const Problem& q, int64_t m0, int64_t m1) {
                                      run_panel(q, 2 * u, m0, m1);
                                      run_panel(q, 2 * u + 1, m0, m1);
                                    });
        });
    return ffi::Error::Success();
  }
  jaxserve::parallel_panels(pool, wd[0], p.M, kItemsPerCall, kMinSplitRows, kMaxRows,
                            [&p](int64_t pi, int64_t m_begin, int64_t m_end) {
                              run_panel(p, pi, m_begin, m_end);
                            });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveGgmlMatmul, GgmlMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::U8>>()   // w, packed
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer of a stacked w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("fmt")
                                  .Attr<bool>("swiglu"));
