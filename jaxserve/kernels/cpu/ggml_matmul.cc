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
// 16-bit pair sum saturates), and elsewhere a portable loop; all three do the same
// integer and f32 arithmetic in the same order (bit-identical results). Which one runs is
// fixed when the library is built for the machine (-march=native, build.py).
//
// Shapes: x [M, K] f32; w [N / 16, K / 32, B] u8, or a stack of them [L, N / 16, K / 32, B]
// (a layer loop's weights) read at layer (s32 scalar, 0 for an unstacked w) in place; out
// [M, N] f32; attribute fmt (0 Q4_0, 1 Q4_1, 2 Q8_0).
//
// Sources: llama.cpp's ggml_vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0 and quantize_row_q8_0
// / q8_1 (ggml/src/ggml-cpu/quants.c); the interleaved repacking of its ggml-cpu/repack.cpp
// (block_q4_0x8), here 16 columns wide for 512-bit registers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "stacked.h"
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
  const int8_t* xq;     // [M, K] x quantised per block
  const float* dx;      // [M, K / 32] x's block scales
  const int32_t* sx;    // [M, K / 32] sums of x's quants per block
  const uint8_t* w;     // [N / 16, K / 32, B]
  float* out;           // [M, N]
  int64_t M, KB, N, fmt, B;
};

// x [M, K] -> per row and block of 32: d = max|x| / 127, q = round(x / d) (nearest, ties
// away from zero, as llama.cpp's quantize_row_q8_0_ref), s = sum(q).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, int32_t* sx) {
  const int64_t KB = K / kBlock;
  for (int64_t i = 0; i < M * KB; ++i) {
    const float* v = x + i * kBlock;
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
  const int8_t* xr = p.xq + (m * p.KB + b) * kBlock + 8 * g;
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
        const int64_t i = (m0 + r) * p.KB + b;
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
      std::copy(acc[r], acc[r] + kCols, p.out + (m0 + r) * p.N + pi * kCols);
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
          std::memcpy(&xv, p.xq + ((m0 + r) * p.KB + b) * kBlock + 4 * q, 4);
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
      const int64_t i = (m0 + r) * p.KB + b;
      const float dx = p.dx[i];
      __m512i s = isum[r];
      if constexpr (off != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(off * p.sx[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx)),
                               acc[r]);
      if constexpr (kFmt == kQ4_1)
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx * static_cast<float>(p.sx[i])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.out + (m0 + r) * p.N + pi * kCols, acc[r]);
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

// R rows (m0 ..) of panel pi, as block_vnni: per block and row, two 8-column int32 sums
// (the record's two 32-byte halves), then the same scaled f32 FMAs.
template <int R, int64_t kFmt>
inline void block_avx2(const Problem& p, int64_t pi, int64_t m0, bool prefetch) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const uint8_t* rec = p.w + pi * p.KB * p.B;
  constexpr int64_t head = kFmt == kQ4_1 ? 64 : 32;
  // Q8_0's sums here are of the signed quants (the stored + 128 made signed): no offset
  constexpr int32_t off = kFmt == kQ4_0 ? 8 : 0;
  for (int64_t b = 0; b < p.KB; ++b, rec += p.B) {
    if (prefetch)
      for (int64_t o = 0; o < p.B; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * p.B + o), _MM_HINT_T0);
    __m256i isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    const uint8_t* qs = rec + head;
    if constexpr (kFmt == kQ8_0) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int q = 0; q < 8; ++q)
        for (int h = 0; h < 2; ++h) {
          const __m256i w = _mm256_xor_si256(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * q + 32 * h)), flip);
          const __m256i aw = _mm256_sign_epi8(w, w);  // |w| (-128 stays 0x80: 128 unsigned)
          for (int r = 0; r < R; ++r) {
            int32_t xv;
            std::memcpy(&xv, p.xq + ((m0 + r) * p.KB + b) * kBlock + 4 * q, 4);
            const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(xv), w);
            isum[r][h] = _mm256_add_epi32(isum[r][h], dot4(aw, sx));
          }
        }
    } else {
      for (int g = 0; g < 4; ++g)
        for (int h = 0; h < 2; ++h) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * g + 32 * h));
          const __m256i lo = _mm256_and_si256(v, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          for (int r = 0; r < R; ++r) {
            int32_t x0, x1;
            x_quads(p, m0 + r, b, g, &x0, &x1);
            isum[r][h] = _mm256_add_epi32(isum[r][h], dot4(lo, _mm256_set1_epi32(x0)));
            isum[r][h] = _mm256_add_epi32(isum[r][h], dot4(hi, _mm256_set1_epi32(x1)));
          }
        }
    }
    __m256 dw[2], mw[2];
    for (int h = 0; h < 2; ++h) {
      dw[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16 * h)));
      if constexpr (kFmt == kQ4_1)
        mw[h] = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 + 16 * h)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * p.KB + b;
      const float dx = p.dx[i];
      for (int h = 0; h < 2; ++h) {
        __m256i s = isum[r][h];
        if constexpr (off != 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(off * p.sx[i]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw[h], _mm256_set1_ps(dx)),
                                    acc[r][h]);
        if constexpr (kFmt == kQ4_1)
          acc[r][h] = _mm256_fmadd_ps(mw[h], _mm256_set1_ps(dx * static_cast<float>(p.sx[i])),
                                      acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(p.out + (m0 + r) * p.N + pi * kCols + 8 * h, acc[r][h]);
}

template <int64_t kFmt>
void panel_avx2(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end) {
  constexpr int64_t kAvx2Rows = 4;  // 2 x 4 accumulators + 2 x 4 sums: 16 ymm registers
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kAvx2Rows) {
    const bool first = m0 == m_begin;
    switch (std::min(kAvx2Rows, m_end - m0)) {
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
                          ffi::ResultBuffer<ffi::F32> out, int64_t fmt) {
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
  Problem p;
  p.M = xd[0]; p.KB = wd[1]; p.N = wd[0] * kCols; p.fmt = fmt; p.B = wd[2];
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  std::vector<int8_t> xq(p.M * p.KB * kBlock);
  std::vector<float> dx(p.M * p.KB);
  std::vector<int32_t> sx(p.M * p.KB);
  quantize_rows(x.typed_data(), p.M, p.KB * kBlock, xq.data(), dx.data(), sx.data());
  p.xq = xq.data(); p.dx = dx.data(); p.sx = sx.data();
  p.w = w.typed_data() + offset;  // the layer's panels, not a copy
  p.out = out->typed_data();
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
                                  .Attr<int64_t>("fmt"));
