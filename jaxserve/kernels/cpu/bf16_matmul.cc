// bf16-weight matmul on the CPU: y[M, N] f32 = x[M, K] f32 @ W, W stored in bf16, products
// and sums in f32. An XLA FFI custom call (see bf16_matmul.py).
//
// W is packed once at load (bf16_matmul.pack_weight) as panels of P output columns with the
// input rows paired: w[N / P, K / 2, P, 2] bf16, element [n / P, k / 2, n % P, k % 2] =
// W[k, n]. One panel is a contiguous stream of K * P * 2 bytes; each 64-byte row of it holds
// the (k, k + 1) weights of 16 output columns, which two AVX-512 integer ops widen to f32
// (bf16 is the top half of an f32: shift left 16 for the even row, mask for the odd one).
// Half the bytes of f32 weights (decode is memory-bound), f32 FMAs for the arithmetic:
// measured on Sapphire Rapids (2 cores) vdpbf16ps ran at a quarter of the f32 FMA rate in
// flops, so widening and FMA beats the bf16 dot product instruction from a few rows up,
// and x keeps its f32 precision (no bf16 rounding of the activations).
//
// Work split: items of consecutive panels (about 16 items a call, so each thread streams
// long contiguous stretches of W; a weight of fewer panels is also split into chunks of
// >= 128 rows when x has many), handed out to XLA's intra-op threads (parallel.h). A
// panel's rows of x are walked in blocks of up to 8 rows x 32 columns (16 zmm
// accumulators, 4 widened weight registers: per pair of input rows 4 widening ops feed 32
// FMAs; 4 x 64 blocks measured 15-25% slower at 32 rows; round_x's: up to 14 rows,
// kDotRows), so the panel (<= 200 KB) streams from memory once and stays in L2 for the
// later row blocks. 1-6 rows (decode of
// a few streams, a speculative verify step of one) are load-bound instead: all 64 columns
// in one pass, with software prefetch 4 KB ahead (5 rows: 1.06x the time of 1, against
// 1.37x in two strided 32-column passes; tools/bench_step.py, prefill:1x5 vs decode:1x13). Measured on a Sapphire Rapids VM (2 cores) for the 56 MB LM head streamed
// from DRAM at 1 row: 16 GB/s before these two changes, 19-24 after (XLA's own f32 sum
// reads 24-27 GB/s there). Without AVX-512 (the library is built with -march=native),
// where the CPU has AVX2 and FMA (Zen 1-3, Intel's client CPUs), the same blocks run on
// 8-column vectors (block_avx2: 4 rows x 16 columns, or 1 x 64 / 2 x 32 streamed; AMD Zen 3
// VM: 1.3-1.8x the portable loop at 1 row, 3-5x from 8 rows, and faster than XLA's f32 dot
// at every shape measured); elsewhere a portable loop does the same arithmetic for the
// compiler to vectorise.
// Up to 64 rows (batched decode) each panel's register blocks also prefetch, into L2, the
// panel their thread multiplies next (the item's next one, or the first of the item the
// thread claims then: parallel_panels_ahead), so the weights' DRAM stream overlaps the
// arithmetic instead of stalling each panel's first block (AMD Zen 4 VM, weights read
// from DRAM: 8 rows 1.13-1.43x, 32 rows 1.00-1.08x as fast).
//
// round_x (compute-bound row counts, where vdpbf16ps outruns f32 FMAs: 2x the flops on AMD
// Zen 4, a quarter on Intel Sapphire Rapids; jaxserve_bf16_dot_speedup measures it): x is
// rounded to bf16 once per call, as (x[2k], x[2k + 1]) pairs in 32 bits, and each register
// block runs one vdpbf16ps per row, 16 columns and k pair on the packed weights as they are
// (the pair layout is the instruction's). 512-token prefill steps: 0.63-0.67x the time.
// The engine hands x over in bf16 instead (JaxserveBf16MatmulBf16x): a row of bf16 x is
// those pairs as they lie, read in place, and the op that makes x rounds it in its own
// fusion, so no single-threaded rounding pass runs before the call's threads start.
// Where the CPU has AMX-BF16 and Linux grants the tile state (amx.h), round_x runs on AMX
// tiles instead, at every row count (run_panel_amx): the same rounding of x, the panels'
// k-pair rows loaded as B tiles as they lie, 5-11x the f32 FMA flop rate of a core; on an
// Intel Xeon VM a 32-row decode step took 0.63x the f32-x time, a 256-token prefill 0.40x.
//
// Shapes: x [M, K] f32; w [N / P, K / 2, P, 2] bf16 (P a multiple of 16, K even), or a
// stack of them [L, N / P, K / 2, P, 2] (a layer loop's weights) read at layer (s32 scalar,
// 0 for an unstacked w) in place; out [M, N] f32; attributes round_x and swiglu (bool). Or
// x [M, K] bf16 (JaxserveBf16MatmulBf16x: round_x on x the caller rounded; attribute
// swiglu). swiglu (every handler, f32 panels too): W is gate | up interleaved by 16 columns
// and out [M, N / 2] = silu(gate) * up (swiglu.h), f32 or bf16 (rounded to nearest
// even: the next matmul's round_x x).
//
// Sources: the VNNI-style pair packing of oneDNN's bf16 GEMM; the panel / register-block
// structure of GotoBLAS (Goto & van de Geijn, 2008).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
// The register blocks on 8-column AVX2 vectors (block_avx2): bf16 panels without AVX-512,
// and f32 panels on every CPU with AVX2 and FMA (on AVX-512 ones: their 1- and 2-row calls).
#define JAXSERVE_MATMUL_AVX2 1
#endif

#include "amx.h"
#include "bf16.h"
#include "parallel.h"
#include "stacked.h"
#include "swiglu.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve::from_bf16;
using jaxserve::to_bf16;

namespace {

constexpr int64_t kPrefetchPairs = 16;  // k pairs ahead (16 x 256 B = 4 KB at P = 64)
constexpr int64_t kItemsPerCall = 16;
constexpr int64_t kMinSplitRows = 128;  // rows per item when a call is also split by rows
constexpr int64_t kMaxRows = 8;  // rows of x per register block (8 x 32 columns: 16 zmm)
// round_x's register blocks (vdpbf16ps) take up to 14 rows x 32 columns: 28 zmm
// accumulators, 2 weight registers and a broadcast, so a panel is read from L2 once per
// 14 rows instead of once per 8. AMD Zen 4 VM, SmolLM2's four step matmuls over 30 layers
// of weights read from DRAM: 16 rows 0.91-0.99x the time of 8-row blocks, 32 rows
// 0.88-0.93x, 64 rows 0.86-0.91x; the engine's 32-row decode step 0.93x, a 256-row mixed
// step 0.97x (12-row blocks: 0.95x and 0.96x; 16 x 16 blocks, a broadcast per
// accumulator: slower than 8 x 32; kernels README, "2026-12-01").
constexpr int64_t kDotRows = 14;
// Up to this many rows, a panel's 64 columns are taken in one streaming pass (R x 4
// accumulators + 8 widened weights <= 32 zmm; x is an FMA's broadcast memory operand).
constexpr int kStreamRows = 6;
// Up to this many rows of x (decode), a panel's register blocks prefetch the panel their
// thread multiplies next (Ahead): its arithmetic is short beside its DRAM read. A
// prefill's panel is reused by 32 row blocks, so its first block's wait is a small share.
constexpr int64_t kAheadMaxRows = 64;
// The AVX2 blocks' limit for the same (AMD Zen 3 VM, SmolLM2's step matmuls with weights
// from DRAM: 2-16 rows 0.72-0.97x the time without, 32 and 64 rows 0.90-1.12x: there the
// blocks are compute-bound, and an f32 panel of 393 KB and the next overflow a 512 KB L2).
constexpr int64_t kAheadMaxRowsAvx2 = 16;


struct Problem {
  const float* x;      // [M, K]
  const uint32_t* xb;  // nullptr, or x rounded to bf16, (k, k + 1) pairs: [M, xb_pairs]
  int64_t xb_pairs;    // xb's row stride in pairs: K / 2, or rounded up to 16 for AMX
  const void* w;       // bf16 [N / P, K / 2, P, 2] or f32 panels [N / P, K / 2, 2, P]
  float* out;          // [M, N] (or a panel's scratch: out_at)
  int64_t M, K2, N, P;
  // Where the blocks store output (row m, column n): out + (m - row0) * ldo + (n - col0).
  // The whole [M, N] output: ldo N, row0 = col0 = 0; jaxserve::run_unit_swiglu points them
  // at a thread's scratch for one panel's rows.
  int64_t ldo = 0, row0 = 0, col0 = 0;
  bool out_bf16 = false;  // out holds bf16 (swiglu only: swiglu_rows rounds its output)
};

inline float* out_at(const Problem& p, int64_t m, int64_t n) {
  return p.out + (m - p.row0) * p.ldo + (n - p.col0);
}

// Panel pi of p.w, whose elements are W (uint16_t: bf16 bits, or float): K * P of them.
template <typename W>
inline const W* panel_at(const Problem& p, int64_t pi) {
  return static_cast<const W*>(p.w) + pi * p.K2 * p.P * 2;
}

// A register block's share of the next panel (kAheadMaxRows), fetched into L2 while the
// block computes: per_k lines per k pair, from `next` up to `lines` lines.
struct Ahead {
  const char* next = nullptr;  // the share's first byte (null: nothing to fetch)
  int64_t lines = 0;           // 64-byte lines in the share
  int64_t per_k = 0;           // lines fetched per k pair
};

// The share of the panel `next` (`next_lines` 64-byte lines; null: none) that register
// block `block` of `blocks` fetches into L2 over its `steps` k steps (kAheadMaxRows).
inline Ahead ahead_share(const char* next, int64_t next_lines, int64_t blocks, int64_t block,
                         int64_t steps) {
  const int64_t share = (next_lines + blocks - 1) / blocks, first = block * share;
  return next != nullptr && first < next_lines
             ? Ahead{next + 64 * first, std::min(share, next_lines - first),
                     (share + steps - 1) / steps}
             : Ahead{};
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// A register block's k step k of its Ahead share: per_k lines of the next panel into L2
// (always inlined: a prefetch-only call GCC does not inline may be dropped).
[[gnu::always_inline]] inline void fetch_ahead(const Ahead& a, int64_t k) {
  for (int64_t l = k * a.per_k, e = std::min(a.lines, l + a.per_k); l < e; ++l)
    _mm_prefetch(a.next + 64 * l, _MM_HINT_T1);
}
#endif


#if defined(__AVX512F__)
// acc[r][j] (16 columns each) over rows m0 .. m0 + R of x and columns c0 .. c0 + 16 * J of
// the panel; J * 16 <= P.
// fetch_panel (the first register block of a panel, R > 2): prefetch the panel's whole
// k-pair row kPrefetchPairs ahead, all P columns (the later blocks find it in L2).
template <int R, int J, bool kAhead = false>
inline void block_avx512(const Problem& p, const uint16_t* panel, int64_t m0, int64_t c0,
                         int64_t n0, bool fetch_panel = false, Ahead ahead = {}) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + (m0 + r) * p.K2 * 2;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const uint16_t* wk = panel + c0 * 2;
  const int64_t stride = p.P * 2;  // bf16 elements per k pair
  for (int64_t k = 0; k < p.K2; ++k, wk += stride) {
    // Fetch ahead of the hardware prefetcher (it stops at 4 KB pages): the one-pass
    // blocks (1-6 rows) are load-bound; more rows wait on DRAM in a panel's first block
    // only.
    if (R <= kStreamRows && J == 4) {
      for (int j = 0; j < J; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchPairs * stride + 32 * j),
                     _MM_HINT_T0);
    } else if (fetch_panel) {
      const char* row = reinterpret_cast<const char*>(panel + (k + kPrefetchPairs) * stride);
      for (int64_t b = 0; b < stride * 2; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    if constexpr (kAhead) fetch_ahead(ahead, k);
    __m512 w_even[J], w_odd[J];
    for (int j = 0; j < J; ++j) {
      const __m512i w = _mm512_loadu_si512(wk + 32 * j);
      w_even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
      w_odd[j] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_set1_ps(xr[r][2 * k]);
      const __m512 x1 = _mm512_set1_ps(xr[r][2 * k + 1]);
      for (int j = 0; j < J; ++j) {
        acc[r][j] = _mm512_fmadd_ps(x0, w_even[j], acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(x1, w_odd[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      _mm512_storeu_ps(out_at(p, m0 + r, n0 + c0 + 16 * j), acc[r][j]);
}

#if defined(__AVX512BF16__)
// The same block with x rounded to bf16 (p.xb): one vdpbf16ps per (row, 16 columns, k pair)
// multiplies the pair of x by the pair of W in each lane and adds both products to the f32
// accumulator; W's packing is already the instruction's pair layout.
template <int R, int J, bool kAhead = false>
inline void block_dot(const Problem& p, const uint16_t* panel, int64_t m0, int64_t c0,
                      int64_t n0, bool fetch_panel, Ahead ahead = {}) {
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.xb + (m0 + r) * p.xb_pairs;
  const uint16_t* wk = panel + c0 * 2;
  const int64_t stride = p.P * 2;
  for (int64_t k = 0; k < p.K2; ++k, wk += stride) {
    if (R <= kStreamRows && J == 4) {  // the one-pass blocks, as in block_avx512
      for (int j = 0; j < J; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchPairs * stride + 32 * j),
                     _MM_HINT_T0);
    } else if (fetch_panel) {
      const char* row = reinterpret_cast<const char*>(panel + (k + kPrefetchPairs) * stride);
      for (int64_t b = 0; b < stride * 2; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    if constexpr (kAhead) fetch_ahead(ahead, k);
    __m512bh w[J];
    for (int j = 0; j < J; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wk + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh xp = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r][k]));
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xp, w[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      _mm512_storeu_ps(out_at(p, m0 + r, n0 + c0 + 16 * j), acc[r][j]);
}
#endif
#endif

// Calls f(std::integral_constant<int, R>) for rows = R in 1 .. kDotRows (any other count
// as 1), one instantiation of f per R.
template <typename F, int... I>
inline void with_rows_of(int64_t rows, F& f, std::integer_sequence<int, I...>) {
  if (!((rows == I + 1 && (f(std::integral_constant<int, I + 1>{}), true)) || ...))
    f(std::integral_constant<int, 1>{});
}
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  with_rows_of(rows, f, std::make_integer_sequence<int, kDotRows>{});
}

#if defined(__AVX512F__)
template <int J>
inline void rows_avx512(const Problem& p, const uint16_t* panel, int64_t m0, int64_t rows,
                        int64_t c0, int64_t n0, bool first, Ahead ahead) {
  with_rows(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    const bool a = ahead.lines > 0;
#if defined(__AVX512BF16__)
    if (p.xb != nullptr)
      return a ? block_dot<R, J, true>(p, panel, m0, c0, n0, first, ahead)
               : block_dot<R, J>(p, panel, m0, c0, n0, first);
#endif
    if constexpr (R <= kMaxRows)  // (f32 x: blocks of up to kMaxRows rows)
      a ? block_avx512<R, J, true>(p, panel, m0, c0, n0, first, ahead)
        : block_avx512<R, J>(p, panel, m0, c0, n0, first);
  });
}
#endif

#if defined(JAXSERVE_MATMUL_AVX2)
// The even and odd k rows of 8 columns from column c of a k pair's row `wk` of a panel P
// columns wide, as f32: bf16 pairs widened (shift left 16 for the even row, mask for the
// odd one), or f32 panels' two rows loaded as they are.
inline void load_pair(const uint16_t* wk, int64_t /*P*/, int64_t c, __m256& even, __m256& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 2 * c));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void load_pair(const float* wk, int64_t P, int64_t c, __m256& even, __m256& odd) {
  even = _mm256_loadu_ps(wk + c);
  odd = _mm256_loadu_ps(wk + P + c);
}

// Prefetch columns c .. c + n of a k pair's row `wk` (both of its rows).
inline void prefetch_cols(const uint16_t* wk, int64_t /*P*/, int64_t c, int64_t n) {
  const char* b = reinterpret_cast<const char*>(wk + 2 * c);
  for (int64_t o = 0; o < n * 4; o += 64) _mm_prefetch(b + o, _MM_HINT_T0);
}
inline void prefetch_cols(const float* wk, int64_t P, int64_t c, int64_t n) {
  for (int64_t o = 0; o < n; o += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(wk + c + o), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + P + c + o), _MM_HINT_T0);
  }
}

// block_avx512 on 8-column vectors, for bf16 panels (W = uint16_t) or f32 panels (W =
// float): acc[r][j] over rows m0 .. m0 + R of x and columns c0 .. c0 + 8 * J of the panel,
// each column summed in the same order (k pair after k pair, the even row's product, then
// the odd one's: an f32 panel's column is summed k after k). The 16 ymm registers hold
// R x J accumulators and either 2 J loaded weights and two broadcasts (4 x 16 blocks for
// many rows) or, where those do not fit (1 x 64 and 2 x 32, which stream the panel in one
// or two passes: a 1-row block of 32 columns read the LM head from DRAM 8% slower than the
// portable loop's one pass), 2 R broadcasts and one 8-column vector's pair at a time.
// fetch_panel (a panel's first block of many rows): prefetch the panel's whole k-pair row
// kPrefetchPairs ahead; 1- and 2-row blocks prefetch their own columns.
template <int R, int J, typename W, bool kAhead = false>
inline void block_avx2(const Problem& p, const W* panel, int64_t m0, int64_t c0, int64_t n0,
                       bool fetch_panel, Ahead ahead = {}) {
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + (m0 + r) * p.K2 * 2;
  const int64_t stride = p.P * 2;  // elements per k pair
  const W* wk = panel;
  for (int64_t k = 0; k < p.K2; ++k, wk += stride) {
    if (R <= 2) {
      prefetch_cols(wk + kPrefetchPairs * stride, p.P, c0, 8 * J);
    } else if (fetch_panel) {
      const char* row = reinterpret_cast<const char*>(panel + (k + kPrefetchPairs) * stride);
      for (int64_t b = 0; b < stride * static_cast<int64_t>(sizeof(W)); b += 64)
        _mm_prefetch(row + b, _MM_HINT_T0);
    }
    if constexpr (kAhead) fetch_ahead(ahead, k);
    if constexpr (R * J + 2 * J + 2 > 16) {
      __m256 x0[R], x1[R];
      for (int r = 0; r < R; ++r) {
        x0[r] = _mm256_set1_ps(xr[r][2 * k]);
        x1[r] = _mm256_set1_ps(xr[r][2 * k + 1]);
      }
      for (int j = 0; j < J; ++j) {
        __m256 w_even, w_odd;
        load_pair(wk, p.P, c0 + 8 * j, w_even, w_odd);
        for (int r = 0; r < R; ++r) {
          acc[r][j] = _mm256_fmadd_ps(x0[r], w_even, acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(x1[r], w_odd, acc[r][j]);
        }
      }
      continue;
    }
    __m256 w_even[J], w_odd[J];
    for (int j = 0; j < J; ++j) load_pair(wk, p.P, c0 + 8 * j, w_even[j], w_odd[j]);
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_set1_ps(xr[r][2 * k]);
      const __m256 x1 = _mm256_set1_ps(xr[r][2 * k + 1]);
      for (int j = 0; j < J; ++j) {
        acc[r][j] = _mm256_fmadd_ps(x0, w_even[j], acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(x1, w_odd[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      _mm256_storeu_ps(out_at(p, m0 + r, n0 + c0 + 8 * j), acc[r][j]);
}

// A panel's rows m_begin .. m_end in AVX2 register blocks: 4 x 16 for many rows, one
// 64-column pass for 1 row (load-bound). next_pi >= 0: the panel this thread multiplies
// next, which the blocks of 2 or more rows fetch into L2 in shares (Ahead); without it
// (more than kAheadMaxRowsAvx2 rows of x) 2 rows take 32-column passes.
template <typename W>
void run_panel_avx2(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end,
                    int64_t next_pi = -1) {
  const W* panel = panel_at<W>(p, pi);
  const int64_t n0 = pi * p.P;
  constexpr int64_t kRowsAvx2 = 4;
  const char* next = next_pi >= 0 ? reinterpret_cast<const char*>(panel_at<W>(p, next_pi))
                                   : nullptr;
  const int64_t next_lines = p.K2 * p.P * 2 * static_cast<int64_t>(sizeof(W)) / 64;
  const int64_t blocks = (m_end - m_begin + kRowsAvx2 - 1) / kRowsAvx2 * (p.P / 16);
  int64_t block = 0;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kRowsAvx2) {
    const int64_t rows = std::min(kRowsAvx2, m_end - m0);
    const bool first_rows = m0 == m_begin;
    int64_t c0 = 0;
    if (rows == 1)
      for (; c0 + 64 <= p.P; c0 += 64) block_avx2<1, 8>(p, panel, m0, c0, n0, false);
    if (rows == 2 && next == nullptr)
      for (; c0 + 32 <= p.P; c0 += 32) block_avx2<2, 4>(p, panel, m0, c0, n0, false);
    for (; c0 < p.P; c0 += 16) {  // (P is a multiple of 16)
      const bool fetch = first_rows && c0 == 0 && rows > 1;
      const Ahead ahead = ahead_share(next, next_lines, blocks, block++, p.K2);
      if (ahead.lines > 0) {  // the prefetch compiled in only where it runs
        switch (rows) {
          case 4: block_avx2<4, 2, W, true>(p, panel, m0, c0, n0, fetch, ahead); break;
          case 3: block_avx2<3, 2, W, true>(p, panel, m0, c0, n0, fetch, ahead); break;
          case 2: block_avx2<2, 2, W, true>(p, panel, m0, c0, n0, fetch, ahead); break;
          default: block_avx2<1, 2, W, true>(p, panel, m0, c0, n0, false, ahead); break;
        }
        continue;
      }
      switch (rows) {
        case 4: block_avx2<4, 2>(p, panel, m0, c0, n0, fetch); break;
        case 3: block_avx2<3, 2>(p, panel, m0, c0, n0, fetch); break;
        case 2: block_avx2<2, 2>(p, panel, m0, c0, n0, fetch); break;
        default: block_avx2<1, 2>(p, panel, m0, c0, n0, false); break;
      }
    }
  }
}
#endif

// Weight (k, column c) of a k pair's row `wk`, as f32: `odd` picks the pair's second row.
inline float weight_at(const uint16_t* wk, int64_t /*P*/, int64_t c, int odd) {
  return from_bf16(wk[2 * c + odd]);
}
inline float weight_at(const float* wk, int64_t P, int64_t c, int odd) { return wk[odd * P + c]; }

// Portable path: the same packing and f32 arithmetic, bf16 panels (W = uint16_t) or f32.
template <typename W>
void panel_portable(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end) {
  const W* panel = panel_at<W>(p, pi);
  const int64_t n0 = pi * p.P;
  std::vector<float> acc(p.P);
  for (int64_t m = m_begin; m < m_end; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < p.K2; ++k) {
      float x0, x1;
      if (p.xb != nullptr) {  // x rounded to bf16: the pair's low half is x[2k]
        x0 = from_bf16(static_cast<uint16_t>(p.xb[m * p.xb_pairs + k] & 0xffffu));
        x1 = from_bf16(static_cast<uint16_t>(p.xb[m * p.xb_pairs + k] >> 16));
      } else {
        x0 = p.x[(m * p.K2 + k) * 2];
        x1 = p.x[(m * p.K2 + k) * 2 + 1];
      }
      const W* wk = panel + k * p.P * 2;
      for (int64_t c = 0; c < p.P; ++c)
        acc[c] += x0 * weight_at(wk, p.P, c, 0) + x1 * weight_at(wk, p.P, c, 1);
    }
    std::copy(acc.begin(), acc.end(), out_at(p, m, n0));
  }
}

template <typename NextPanel>
void run_panel(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end,
               NextPanel next_panel) {
#if defined(__AVX512F__)
  const uint16_t* panel = panel_at<uint16_t>(p, pi);
  const int64_t n0 = pi * p.P;
#if !defined(__AVX512BF16__)
  if (p.xb != nullptr) return panel_portable<uint16_t>(p, pi, m_begin, m_end);
#endif
  if (p.M <= kStreamRows && p.P % 64 == 0) {
    // 1-6 rows (decode of a few streams, a verify step of one) are load-bound: take the
    // panel's 64 columns in one contiguous pass (4 weight registers per k pair; f32 x: 8
    // FMAs a row after 8 widening ops, bf16 x: 4 vdpbf16ps a row) instead of two strided
    // 32-column passes. Each column's sum runs in the same order as in the register
    // blocks, so a row's result does not depend on the rows beside it.
    for (int64_t c0 = 0; c0 < p.P; c0 += 64)
      with_rows(p.M, [&](auto r) {
        constexpr int R = decltype(r)::value;
        if constexpr (R <= kStreamRows) {  // (7 rows and more never come here)
#if defined(__AVX512BF16__)
          if (p.xb != nullptr) return block_dot<R, 4>(p, panel, 0, c0, n0, false);
#endif
          block_avx512<R, 4>(p, panel, 0, c0, n0);
        }
      });
    return;
  }
  // The next panel, if this thread multiplies one, split into equal shares of lines over
  // this panel's register blocks (each fetches its share over its own k pairs).
  const int64_t next_pi = next_panel();
  const int64_t rb = p.xb != nullptr ? kDotRows : kMaxRows;  // rows per register block
  const int64_t blocks = (m_end - m_begin + rb - 1) / rb * ((p.P + 31) / 32);
  const char* next = next_pi >= 0 ? reinterpret_cast<const char*>(panel_at<uint16_t>(p, next_pi))
                                   : nullptr;
  int64_t block = 0;
  auto ahead = [&]() { return ahead_share(next, p.K2 * p.P * 4 / 64, blocks, block++, p.K2); };
  for (int64_t m0 = m_begin; m0 < m_end; m0 += rb) {
    const int64_t rows = std::min(rb, m_end - m0);
    const bool first_rows = m0 == m_begin;  // this item's first block of the panel
    int64_t c0 = 0;
    for (; c0 + 32 <= p.P; c0 += 32)
      rows_avx512<2>(p, panel, m0, rows, c0, n0, first_rows && c0 == 0, ahead());
    for (; c0 + 16 <= p.P; c0 += 16)
      rows_avx512<1>(p, panel, m0, rows, c0, n0, first_rows && c0 == 0, ahead());
  }
#elif defined(JAXSERVE_MATMUL_AVX2)
  if (p.xb != nullptr) return panel_portable<uint16_t>(p, pi, m_begin, m_end);  // (no bf16 dot)
  const bool ahead = p.M > 1 && p.M <= kAheadMaxRowsAvx2;
  run_panel_avx2<uint16_t>(p, pi, m_begin, m_end, ahead ? next_panel() : -1);
#else
  (void)next_panel;
  panel_portable<uint16_t>(p, pi, m_begin, m_end);
#endif
}

#if defined(JAXSERVE_MATMUL_AVX2)
// The f32 vector ops block_f32 runs on: 8-lane ymm (AVX2) or 16-lane zmm (AVX-512).
struct Ymm {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* x) { return _mm256_loadu_ps(x); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* y, V v) { _mm256_storeu_ps(y, v); }
};
#if defined(__AVX512F__)
struct Zmm {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* x) { return _mm512_loadu_ps(x); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* y, V v) { _mm512_storeu_ps(y, v); }
};
#endif

// An f32 panel's rows m0 .. m0 + R (R <= 6) times its columns c0 .. c0 + J vectors of
// Vec (an f32 panel [K / 2, 2, P] is [K, P]: row k at k * P), k after k with one FMA a k:
// R x J accumulators, J weight vectors and a broadcast. Ymm with J = 2: 6 x 16, the AVX2
// f32 GEMM micro-kernel of BLIS (12 of the 16 ymm accumulators); Zmm with J = 4: a
// 64-column panel's whole width in one pass (24 accumulators and 4 weight vectors in 28
// of the 32 zmm registers). Each column is summed k after k, as in block_avx2's pairs (the
// even row, then the odd one), and an FMA rounds each lane alone whatever the vector's
// width, so every block gives a row the same result. fetch_panel: as block_avx2's.
template <typename Vec, int R, int J, bool kAhead = false>
inline void block_f32(const Problem& p, const float* panel, int64_t m0, int64_t c0, int64_t n0,
                      bool fetch_panel, Ahead ahead = {}) {
  typename Vec::V acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = Vec::zero();
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = p.x + (m0 + r) * p.K2 * 2;
  const int64_t K = p.K2 * 2;
  const float* wk = panel + c0;
  for (int64_t k = 0; k < K; ++k, wk += p.P) {
    if (fetch_panel) {
      const char* row = reinterpret_cast<const char*>(panel + (k + 2 * kPrefetchPairs) * p.P);
      for (int64_t b = 0; b < p.P * 4; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    if constexpr (kAhead) fetch_ahead(ahead, k);
    typename Vec::V w[J];
    for (int j = 0; j < J; ++j) w[j] = Vec::load(wk + Vec::kLanes * j);
    for (int r = 0; r < R; ++r) {
      const typename Vec::V xk = Vec::set1(xr[r][k]);
      for (int j = 0; j < J; ++j) acc[r][j] = Vec::fma(xk, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j)
      Vec::store(out_at(p, m0 + r, n0 + c0 + Vec::kLanes * j), acc[r][j]);
}
#endif

// An f32 panel's rows: 1 and 2 rows stream the panel as block_avx2 does wherever the CPU
// has AVX2 and FMA; more rows run in 6-row blocks (block_f32): 6 x 64 of zmm on AVX-512
// CPUs, else 6 x 16 of ymm. Without AVX2, the portable loop.
// Every path sums a column k after k with one FMA a k, so a row's result never depends on
// the rows beside it. With next_pi >= 0 (up to kAheadMaxRowsAvx2 rows) the blocks share the
// prefetch of the panel this thread multiplies next into L2 (Ahead, as the AVX-512 bf16
// blocks do: a panel's first block otherwise waits on DRAM alone).
void run_panel_f32(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end,
                   int64_t next_pi) {
#if defined(JAXSERVE_MATMUL_AVX2)
  if (m_end - m_begin <= 2) return run_panel_avx2<float>(p, pi, m_begin, m_end, next_pi);
  const float* panel = panel_at<float>(p, pi);
  const int64_t n0 = pi * p.P;
  constexpr int64_t kRowsF32 = 6;
#if defined(__AVX512F__)
  constexpr int64_t kCols = 64;  // a block's columns (a 16-column panel: one 16-column block)
#else
  constexpr int64_t kCols = 16;
#endif
  const int64_t K = p.K2 * 2;
  const int64_t col_blocks = (p.P + kCols - 1) / kCols;
  const int64_t blocks = (m_end - m_begin + kRowsF32 - 1) / kRowsF32 * col_blocks;
  const char* next = next_pi >= 0 ? reinterpret_cast<const char*>(panel_at<float>(p, next_pi))
                                   : nullptr;
  int64_t block = 0;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kRowsF32) {
    const int64_t rows = std::min(kRowsF32, m_end - m0);
    for (int64_t c0 = 0; c0 < p.P; c0 += kCols) {  // (P is 64, or 16: panel_width)
      const bool fetch = m0 == m_begin && c0 == 0;
      const Ahead ahead = ahead_share(next, K * p.P * 4 / 64, blocks, block++, K);
      with_rows(rows, [&](auto r) {  // (rows <= kRowsF32)
        constexpr int R = decltype(r)::value;
        if constexpr (R <= kRowsF32) {
#if defined(__AVX512F__)
          if (p.P - c0 >= 64)
            return ahead.lines > 0
                       ? block_f32<Zmm, R, 4, true>(p, panel, m0, c0, n0, fetch, ahead)
                       : block_f32<Zmm, R, 4>(p, panel, m0, c0, n0, fetch);
          for (int64_t c = c0; c < p.P; c += 16)  // (a 16-column panel)
            ahead.lines > 0
                ? block_f32<Zmm, R, 1, true>(p, panel, m0, c, n0, fetch && c == c0, ahead)
                : block_f32<Zmm, R, 1>(p, panel, m0, c, n0, fetch && c == c0);
#else
          ahead.lines > 0 ? block_f32<Ymm, R, 2, true>(p, panel, m0, c0, n0, fetch, ahead)
                          : block_f32<Ymm, R, 2>(p, panel, m0, c0, n0, fetch);
#endif
        }
      });
    }
  }
#else
  (void)next_pi;
  panel_portable<float>(p, pi, m_begin, m_end);
#endif
}

// x [M, 2 K2] f32 rounded to bf16 into xb, rows `stride` pairs apart, (x[2k], x[2k + 1])
// in one 32-bit pair: 32 at a time by vcvtne2ps2bf16 (round to nearest even, NaN kept a
// quiet NaN, as to_bf16; a denormal becomes zero, as the dot instructions would read it),
// the rest by to_bf16.
void round_to_bf16_pairs(const float* x, int64_t M, int64_t K2, uint32_t* xb, int64_t stride) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K2 * 2;
    uint32_t* out = xb + m * stride;
    int64_t k = 0;
#if defined(__AVX512BF16__)
    for (; k + 16 <= K2; k += 16) {
      const __m512 lo = _mm512_loadu_ps(xr + 2 * k), hi = _mm512_loadu_ps(xr + 2 * k + 16);
      _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
#endif
    for (; k < K2; ++k)
      out[k] = to_bf16(xr[2 * k]) | (static_cast<uint32_t>(to_bf16(xr[2 * k + 1])) << 16);
  }
}

constexpr int64_t kAmxRows = 32;  // rows of x per AMX register block (2 A tiles)

// Whether round_x runs on AMX tiles here: compiled for AMX and granted by the OS (amx.h).
bool amx_runs_round_x() {
#if defined(JAXSERVE_AMX)
  return jaxserve::amx_usable();
#else
  return false;
#endif
}

#if defined(JAXSERVE_AMX)

// round_x on AMX: a panel's rows m_begin .. m_end in register blocks of 32 rows x 32
// columns (2 A tiles, 2 B tiles, 4 C tiles) or, for the last 16 or fewer rows, 16 rows x
// 64 columns (1 A tile, 4 B tile loads). p.xb is padded: 32 zero rows after row M (a
// block's A tiles read 16 or 32 rows whatever is left) and each row to a multiple of 16
// k pairs (zero pairs). A K / 2 that is not a multiple of 16 reads its last step's B from
// a zero-padded copy of the panel's last rows (the panel's own would run past its end).
// A block with fewer rows than its tiles stores them through `partial`.
void run_panel_amx(const Problem& p, int64_t pi, int64_t m_begin, int64_t m_end) {
  // The tile configuration, once per drain of the call's items (nothing else runs on the
  // thread within one; amx.h): loaded for every panel, LDTILECFG took ~0.3 us a panel.
  // Intel Xeon VM with AMX, SmolLM2's 30 layers' matmuls and LM head (~3,200 panels) at 1
  // to 32 rows: 0.3-1 ms less (kernels README, "2026-12-03").
  static thread_local uint64_t configured_in = ~uint64_t{0};
  if (const uint64_t epoch = jaxserve::drain_epoch(); configured_in != epoch) {
    jaxserve::amx_configure();
    configured_in = epoch;
  }
  const uint16_t* panel = panel_at<uint16_t>(p, pi);
  const int64_t n0 = pi * p.P;
  const int64_t b_stride = p.P * 4;  // bytes per k pair of the panel
  const int64_t steps = (p.K2 + 15) / 16, tail = p.K2 % 16;
  std::vector<uint16_t> last;
  if (tail != 0) {
    last.assign(16 * p.P * 2, 0);
    std::memcpy(last.data(), panel + (p.K2 - tail) * p.P * 2, tail * b_stride);
  }
  alignas(64) float partial[kAmxRows * 64];
  const int64_t a_stride = p.xb_pairs * 4;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kAmxRows) {
    const int64_t rows = std::min(kAmxRows, m_end - m0);
    const char* a = reinterpret_cast<const char*>(p.xb + m0 * p.xb_pairs);
    auto block = [&](auto rb, auto cb, int64_t c0) {
      constexpr int RB = decltype(rb)::value, CB = decltype(cb)::value;
      const char* b = reinterpret_cast<const char*>(panel + c0 * 2);
      const char* b_last = tail != 0 ? reinterpret_cast<const char*>(last.data() + c0 * 2) : nullptr;
      float* out = out_at(p, m0, n0 + c0);
      // the panel's first block fetches its rows ahead, whole (the later blocks read L2)
      const char* pf = (m0 == m_begin && c0 == 0) ? reinterpret_cast<const char*>(panel) : nullptr;
      if (rows >= 16 * RB) {
        jaxserve::amx_block<RB, CB>(a, a_stride, b, b_last, b_stride, steps,
                                    reinterpret_cast<char*>(out), p.ldo * 4, pf);
        return;
      }
      jaxserve::amx_block<RB, CB>(a, a_stride, b, b_last, b_stride, steps,
                                  reinterpret_cast<char*>(partial), 64 * 4, pf);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * p.ldo, partial + r * 64, CB * 64);
    };
    using One = std::integral_constant<int, 1>;
    using Two = std::integral_constant<int, 2>;
    int64_t c0 = 0;
    if (rows > 16) {
      for (; c0 + 32 <= p.P; c0 += 32) block(Two{}, Two{}, c0);
      for (; c0 < p.P; c0 += 16) block(Two{}, One{}, c0);
    } else {
      for (; c0 + 64 <= p.P; c0 += 64) block(One{}, std::integral_constant<int, 4>{}, c0);
      for (; c0 + 32 <= p.P; c0 += 32) block(One{}, Two{}, c0);
      for (; c0 < p.P; c0 += 16) block(One{}, One{}, c0);
    }
  }
}
#endif

// SwiGLU as the matmul's epilogue (attribute swiglu): W holds gate | up with their
// columns interleaved in groups of 16 (W column 32 g + i is gate's column 16 g + i, 32 g +
// 16 + i is up's; bf16_matmul.interleave_gate_up), P a multiple of 32, and out [M, N / 2]
// = silu(gate) * up, silu(g) = g * sigmoid(g), the sigmoid from exp(-|g|) (never
// overflows). A panel's rows run into a thread's scratch in chunks of kSwigluRows, then
// swiglu_rows writes their P / 2 output columns (swiglu.h, shared with ggml_matmul.cc):
// the gate | up product (3 MB a call at 256
// rows of SmolLM2) stays in the thread's L2, no separate elementwise op reads it back, and
// the down matmul's bf16 x comes out of the epilogue (out bf16). AMD Zen 4 VM, SmolLM2's
// gate | up then down over 30 layers of weights (bf16 x, round_x): 32 rows 586 -> 477 us a
// layer, 256 rows 3,560 -> 3,274; the served 32-stream workload +4% output tok/s (kernels
// README, "2026-12-01 (session 49)").

// The Problem of x [M, K] times layer `layer` of w (a layer's panels, read in place, not
// copied): bf16 [N / P, K / 2, P, 2] or, with `f32`, f32 panels [N / P, K / 2, 2, P]
// (or a stack [L, ...] of either); *panels = N / P; out [M, N], or with `swiglu` [M, N / 2]
// (jaxserve::run_unit_swiglu). An InvalidArgument error naming `fn` when the shapes or the layer do
// not fit. x: f32, or bf16 (p->x is then null: the
// caller points p->xb at it).
template <typename XBuffer, typename WBuffer>
ffi::Error make_problem(const char* fn, bool f32, const XBuffer& x,
                        const WBuffer& w, int32_t layer, ffi::Result<ffi::AnyBuffer>& out,
                        bool swiglu, Problem* p, int64_t* panels) {
  const std::string name(fn);
  const std::string layout = f32 ? "[N / P, K / 2, 2, P]" : "[N / P, K / 2, P, 2]";
  const auto xd = x.dimensions();
  int64_t wd[4], offset;
  switch (jaxserve::layer_of_stack(w.dimensions(), 4, layer, wd, &offset)) {
    case jaxserve::StackError::kRank:
      return ffi::Error::InvalidArgument(name + ": w must be " + layout + " or [L, ...]");
    case jaxserve::StackError::kLayer:
      return ffi::Error::InvalidArgument(name + ": layer must be in [0, the stack's length)");
    case jaxserve::StackError::kNone: break;
  }
  const int64_t P = f32 ? wd[3] : wd[2], pair_axis = f32 ? wd[2] : wd[3];
  if (xd.size() != 2 || pair_axis != 2 || P % 16 != 0 || xd[1] != 2 * wd[1])
    return ffi::Error::InvalidArgument(name + ": x must be [M, K] and w " + layout +
                                       " with P % 16 == 0");
  p->M = xd[0]; p->K2 = wd[1]; p->P = P; p->N = wd[0] * P;
  if (swiglu && P % (2 * jaxserve::kSwigluGroup) != 0)
    return ffi::Error::InvalidArgument(name + ": swiglu needs panels of a multiple of 32 "
                                       "columns (gate and up interleaved by 16)");
  const auto od = out->dimensions();
  const ffi::DataType ot = out->element_type();
  if (ot != ffi::DataType::F32 && !(swiglu && ot == ffi::DataType::BF16))
    return ffi::Error::InvalidArgument(name + ": out must be f32 (or bf16 with swiglu)");
  const int64_t out_cols = swiglu ? p->N / 2 : p->N;
  if (od.size() != 2 || od[0] != p->M || od[1] != out_cols)
    return ffi::Error::InvalidArgument(name + ": out must be [M, " +
                                       (swiglu ? "N / 2" : "N") + "]");
  if constexpr (std::is_same_v<XBuffer, ffi::Buffer<ffi::F32>>) p->x = x.typed_data();
  else p->x = nullptr;
  p->xb = nullptr;
  p->xb_pairs = p->K2;
  p->w = static_cast<const char*>(w.untyped_data()) +
         offset * static_cast<int64_t>(f32 ? sizeof(float) : sizeof(uint16_t));
  p->out = static_cast<float*>(out->untyped_data());
  p->out_bf16 = ot == ffi::DataType::BF16;
  p->ldo = out_cols;
  *panels = wd[0];
  return ffi::Error::Success();
}

// body(q, m_begin, m_end) over panel pi's rows: into p's output, or with `swiglu` through
// jaxserve::run_unit_swiglu's scratch and epilogue.
template <typename Body>
inline void panel_rows(const Problem& p, bool swiglu, int64_t pi, int64_t m_begin,
                       int64_t m_end, Body&& body) {
  if (swiglu) return jaxserve::run_unit_swiglu(p, pi, p.P, m_begin, m_end, body);
  body(p, m_begin, m_end);
}

// The panels of p (p.xb set: x as bf16 pairs, or null: f32 x) over the pool's threads.
void run_bf16(ffi::ThreadPool& pool, const Problem& p, int64_t panels, bool amx, bool swiglu) {
  if (!amx && p.M <= kAheadMaxRows) {  // few rows: each panel prefetches the next (Ahead)
    jaxserve::parallel_panels_ahead(
        pool, panels, p.M, kItemsPerCall, kMaxRows,
        [&p, swiglu](int64_t pi, int64_t m_begin, int64_t m_end, auto next_panel) {
          panel_rows(p, swiglu, pi, m_begin, m_end,
                     [&](const Problem& q, int64_t m0, int64_t m1) {
                       run_panel(q, pi, m0, m1, next_panel);
                     });
        });
    return;
  }
  jaxserve::parallel_panels(
      pool, panels, p.M, kItemsPerCall, kMinSplitRows, amx ? kAmxRows : kMaxRows,
      [&p, amx, swiglu](int64_t pi, int64_t m_begin, int64_t m_end) {
        panel_rows(p, swiglu, pi, m_begin, m_end,
                   [&](const Problem& q, int64_t m0, int64_t m1) {
#if defined(JAXSERVE_AMX)
                     if (amx) return run_panel_amx(q, pi, m0, m1);
#endif
                     (void)amx;
                     run_panel(q, pi, m0, m1, [] { return int64_t{-1}; });
                   });
      });
}

// x times layer `layer` of the packed bf16 w into out: x f32 (rounded to bf16 pairs here
// when round_x), or bf16 (round_x on x the caller rounded: a row of bf16 x is its (x[2k],
// x[2k + 1]) pairs in 32 bits as they lie, little-endian, x[2k] the low half; read in
// place, so no pass over x runs on the calling thread before its helpers start: in a
// 256-token prefill step the f32 rounding took 90-240 us a call, one core idle). AMX
// reads a padded copy either way.
template <typename XBuffer>
ffi::Error bf16_matmul(ffi::ThreadPool& pool, const XBuffer& x, const ffi::Buffer<ffi::BF16>& w,
                       int32_t layer, ffi::Result<ffi::AnyBuffer>& out, bool round_x,
                       bool swiglu) {
  constexpr bool kBf16X = !std::is_same_v<XBuffer, ffi::Buffer<ffi::F32>>;
  Problem p;
  int64_t panels = 0;
  if (ffi::Error e = make_problem("bf16_matmul", false, x, w, layer, out, swiglu, &p, &panels);
      e.failure())
    return e;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  const bool amx = (round_x || kBf16X) && amx_runs_round_x();  // (run_panel_amx)
  if constexpr (kBf16X) p.xb = static_cast<const uint32_t*>(x.untyped_data());
  std::vector<uint32_t> xb;
  if (amx || (round_x && !kBf16X)) {  // x as bf16 (x[2k], x[2k + 1]) pairs in 32 bits
    // AMX: padded for the tiles (rows to a multiple of 16 pairs, kAmxRows zero rows after)
    if (amx) p.xb_pairs = (p.K2 + 15) / 16 * 16;
    xb.assign((p.M + (amx ? kAmxRows : 0)) * p.xb_pairs, 0u);
    if constexpr (kBf16X) {
      for (int64_t m = 0; m < p.M; ++m)
        std::memcpy(xb.data() + m * p.xb_pairs, p.xb + m * p.K2, p.K2 * sizeof(uint32_t));
    } else {
      round_to_bf16_pairs(p.x, p.M, p.K2, xb.data(), p.xb_pairs);
    }
    p.xb = xb.data();
  }
  run_bf16(pool, p, panels, amx, swiglu);
  return ffi::Error::Success();
}

ffi::Error Bf16MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::BF16> w, ffi::BufferR0<ffi::S32> layer,
                          ffi::Result<ffi::AnyBuffer> out, bool round_x, bool swiglu) {
  return bf16_matmul(pool, x, w, *layer.typed_data(), out, round_x, swiglu);
}

ffi::Error Bf16MatmulBf16xImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                               ffi::Buffer<ffi::BF16> w, ffi::BufferR0<ffi::S32> layer,
                               ffi::Result<ffi::AnyBuffer> out, bool swiglu) {
  return bf16_matmul(pool, x, w, *layer.typed_data(), out, true, swiglu);
}

// The f32-weight matmul: w packed as f32 panels [N / P, K / 2, 2, P] (or a stack of them),
// every row count summed k after k (run_panel_f32).
ffi::Error F32MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::F32> w, ffi::BufferR0<ffi::S32> layer,
                         ffi::Result<ffi::AnyBuffer> out, bool swiglu) {
  Problem p;
  int64_t panels = 0;
  if (ffi::Error e = make_problem("f32_matmul", true, x, w, *layer.typed_data(), out, swiglu,
                                  &p, &panels);
      e.failure())
    return e;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  if (p.M <= kAheadMaxRowsAvx2) {  // few rows: each panel prefetches the next (Ahead)
    jaxserve::parallel_panels_ahead(
        pool, panels, p.M, kItemsPerCall, kMaxRows,
        [&p, swiglu](int64_t pi, int64_t m_begin, int64_t m_end, auto next_panel) {
          panel_rows(p, swiglu, pi, m_begin, m_end,
                     [&](const Problem& q, int64_t m0, int64_t m1) {
                       run_panel_f32(q, pi, m0, m1, p.M > 1 ? next_panel() : -1);
                     });
        });
    return ffi::Error::Success();
  }
  jaxserve::parallel_panels(pool, panels, p.M, kItemsPerCall, kMinSplitRows, kMaxRows,
                            [&p, swiglu](int64_t pi, int64_t m_begin, int64_t m_end) {
                              panel_rows(p, swiglu, pi, m_begin, m_end,
                                         [&](const Problem& q, int64_t m0, int64_t m1) {
                                           run_panel_f32(q, pi, m0, m1, -1);
                                         });
                            });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveBf16Matmul, Bf16MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w, packed
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer of a stacked w
                                  .Ret<ffi::AnyBuffer>()  // out: f32 (bf16 with swiglu)
                                  .Attr<bool>("round_x")
                                  .Attr<bool>("swiglu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveBf16MatmulBf16x, Bf16MatmulBf16xImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x, bf16
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w, packed
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer of a stacked w
                                  .Ret<ffi::AnyBuffer>()  // out: f32 (bf16 with swiglu)
                                  .Attr<bool>("swiglu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveF32Matmul, F32MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w, f32 panels
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer of a stacked w
                                  .Ret<ffi::AnyBuffer>()  // out: f32 (bf16 with swiglu)
                                  .Attr<bool>("swiglu"));

#if defined(__AVX512BF16__)
// Seconds for kChainIters rounds of `op` on 12 independent accumulator chains (distinct starts:
// equal ones would be merged into one chain by the compiler).
constexpr int64_t kChainIters = 1 << 17;  // time_chains' rounds (12 instructions each)

template <typename Op>
double time_chains(Op op) {
  __m512 a0 = _mm512_set1_ps(0.0f), a1 = _mm512_set1_ps(1.0f), a2 = _mm512_set1_ps(2.0f),
         a3 = _mm512_set1_ps(3.0f), a4 = _mm512_set1_ps(4.0f), a5 = _mm512_set1_ps(5.0f),
         a6 = _mm512_set1_ps(6.0f), a7 = _mm512_set1_ps(7.0f), a8 = _mm512_set1_ps(8.0f),
         a9 = _mm512_set1_ps(9.0f), a10 = _mm512_set1_ps(10.0f), a11 = _mm512_set1_ps(11.0f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < kChainIters; ++i) {
    a0 = op(a0); a1 = op(a1); a2 = op(a2); a3 = op(a3); a4 = op(a4); a5 = op(a5);
    a6 = op(a6); a7 = op(a7); a8 = op(a8); a9 = op(a9); a10 = op(a10); a11 = op(a11);
  }
  const auto t1 = std::chrono::steady_clock::now();
  const __m512 sum = _mm512_add_ps(
      _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)),
                    _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
  asm volatile("" : : "v"(sum));
  return std::chrono::duration<double>(t1 - t0).count();
}
#endif

constexpr int64_t kAmxIters = 1 << 13;  // time_amx's rounds (4 TDPBF16PS each)

#if defined(JAXSERVE_AMX)
// Seconds for kAmxIters rounds of 4 independent TDPBF16PS (4 x 16 x 16 x 32 x 2 flops a
// round) on tiles that stay in the registers.
double time_amx() {
  jaxserve::amx_configure();
  alignas(64) static const uint16_t zeros[16 * 32] = {};  // the values do not matter
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, zeros, 64); _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64); _tile_loadd(7, zeros, 64);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < kAmxIters; ++i) {
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sink[16 * 16];
  _tile_stored(0, sink, 64);  // waits for the chain
  _tile_release();
  const auto t1 = std::chrono::steady_clock::now();
  asm volatile("" : : "r"(sink) : "memory");
  return std::chrono::duration<double>(t1 - t0).count();
}
#endif

// The speed of the instruction round_x runs against f32 FMAs on this CPU, in flops: AMX's
// TDPBF16PS where this process may use the tiles (32,768 flops per instruction), else
// AVX512-BF16's vdpbf16ps (64; vfmadd231ps: 32): short register-only loops on the calling
// thread, ~4 ms in all. 0 without either (or in a portable build). Measured: vdpbf16ps 2.0 on
// an AMD Zen 4 VM and ~0.25 on Intel Xeon VMs, where AMX measured 6.9-11.
extern "C" double jaxserve_bf16_dot_speedup() {
#if defined(__AVX512BF16__)
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(1e-9f);  // not 1: a*1 folds
  const __m512bh xb = (__m512bh)_mm512_set1_epi16(0x3f80);
  const __m512bh yb = (__m512bh)_mm512_set1_epi16(0x3000);
  auto fma = [x, y](__m512 a) { return _mm512_fmadd_ps(x, y, a); };
  auto dot = [xb, yb](__m512 a) { return _mm512_dpbf16_ps(a, xb, yb); };
  const bool amx = amx_runs_round_x();
  double best_fma = 1e30, best_dot = 1e30;
  for (int rep = 0; rep < 4; ++rep) {  // the first round warms the units up
    const double t_fma = time_chains(fma);
    double t_dot = 0.0;
#if defined(JAXSERVE_AMX)
    if (amx) t_dot = time_amx();
#endif
    if (!amx) t_dot = time_chains(dot);
    if (rep == 0) continue;
    best_fma = std::min(best_fma, t_fma);
    best_dot = std::min(best_dot, t_dot);
  }
  const double fma_flops = 12.0 * kChainIters * 32;
  const double dot_flops = amx ? 4.0 * kAmxIters * 16 * 16 * 32 * 2 : 2.0 * fma_flops;
  return (dot_flops / best_dot) / (fma_flops / best_fma);
#else
  return 0.0;
#endif
}
