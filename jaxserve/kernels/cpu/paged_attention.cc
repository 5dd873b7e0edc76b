// Ragged paged attention on the CPU: an XLA FFI custom call (see paged_attention.py).
//
// The step's new tokens are packed one sequence after another (a flat ragged batch, as in
// vLLM v1): sequence b owns query rows query_start[b] .. query_start[b + 1] - 1, and the
// query at row t attends to keys 0 .. min(seq_lens[b], positions[t] + 1) - 1 of its own
// context, read in place from the head-major page pool through its block table. Rows past
// query_start[S], and the rows of padding sequences (seq_lens 0), get output 0.
// Only the pages a row really uses are read (the XLA formulation gathers and copies every
// row's pages up to the batch's page bucket).
//
// Work split: one item per (sequence b, KV head h, block of q_block of its queries), handed
// out dynamically to XLA's intra-op thread pool and the calling thread (parallel.h's
// parallel_for_ahead: contexts are ragged, so items differ in size, and a thread learns its
// next item early enough to prefetch that item's first keys). An item owns the q_block * G
// query rows that share KV head h (GQA: G = H / K) and walks the pages once with an online
// softmax (FlashAttention), so each K/V page is read once per item. With AVX-512 (and DQ),
// head dim 64 or 128 and pages of a multiple of 16 keys, items of >= 8 rows (prefill) first
// transpose each page's K (and widen a bf16 V) into f32 scratch and score 16 keys per FMA
// (`attend_item_tiled`); every row, transposed or not, sums its scores in the same order,
// so its bits do not depend on the rows beside it. That path's online softmax steps over 32
// keys (two 16-key tiles) and its p @ V loads each V vector once for up to 4 rows (the GQA
// group's in decode); decode items widen a block's K to f32 once for their rows and sum 16
// keys' lanes at once. Without AVX-512, with AVX2 and FMA (Zen 1-3, Intel's client CPUs),
// the same plan runs on 8-lane vectors (`attend_item_tiled8`: head dims 64 / 128, pages of
// a multiple of 8 keys): 32-key steps over four 8-key tiles of K widened to f32 once for
// the item's rows, each row scoring a tile's 8 keys from them and summing each key's 8-lane
// partials in one tree; other page sizes take the per-row path on 8-lane vectors (scores of
// 8 keys at once, exp on 8 lanes, p @ V with 64 columns of the row's output in registers).
// AMD Zen 3 VM, one layer: the per-row path 5.3-6.5x the portable loop's query-key pairs/s,
// the tiled one 1.7-2.0x the per-row path's in prefill, 1.0-1.2x in decode.
//
// Shapes (all row-major):
//   q            [T, H, Dh]       f32   new tokens, packed by sequence
//   k_pages      [K, N, ps, Dh]   f32, or bf16 / u16 holding bf16 bits, or f8e4m3fn / u8
//                                       holding its bits (head-major pool: K kv heads, N
//                                       pages, ps tokens/page; bf16 and fp8 widened to f32
//                                       on load, exactly: half / a quarter of the bytes of
//                                       a long context's K/V; jaxserve stores these pools
//                                       as their bits)
//             or [K, N, ps, Dh + 4] s8: int8 rows, each a (token, head)'s Dh values q and
//                                       the 4 bytes of their f32 scale s (little-endian);
//                                       an element's value is the f32 product q * s
//                                       (jaxserve.kernels.common.INT8_KV)
//   v_pages      [K, N, ps, Dh(+4)] the dtype and shape of k_pages
//                (either pool may be a stack of layers' pools [L, K, N, ps, Dh], both alike,
//                read at `layer` in place: a layer loop's pool)
//   layer        []               s32   the layer of stacked pools (0 for one layer's)
//   block_tables [S, P]           s32   page ids (< N) of each sequence, in order
//   seq_lens     [S]              s32   context length (0 = padding sequence: output 0)
//   query_start  [S + 1]          s32   first query row of each sequence (non-decreasing, <= T)
//   positions    [T]              s32   absolute position of each query token
//   out          [T, H, Dh]       f32
// Errors: a page id outside [0, N) in a visited block-table entry, a context longer than
// P * ps, or query_start not non-decreasing within [0, T] returns an FFI error (raised by
// JAX) instead of reading or writing out of bounds.
//
// Sources: PagedAttention (Kwon et al., SOSP 2023) block tables; FlashAttention (Dao et al.,
// 2022) online softmax; vLLM's CPU paged attention (csrc/cpu/attention.cpp) for the
// one-item-per-(sequence, head) split.

// No reassociation in this file (the build's -fassociative-math is for the matmul's
// reductions): the tiled path's score_direct and score_transposed must sum in exactly the
// order written, for a row's bits not to depend on which of them its item took.
#if defined(__clang__)
#pragma float_control(precise, on)
#elif defined(__GNUC__)
#pragma GCC optimize("no-associative-math")
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// Without AVX-512: the per-row path's scores, softmax and p @ V on 8-lane AVX2 vectors.
#define JAXSERVE_ATTENTION_AVX2 1
#endif

#include "bf16.h"
#include "fp8.h"
#include "exp_nonpositive.h"
#include "parallel.h"
#include "stacked.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve::exp_nonpositive;
#if defined(__AVX512F__)
using jaxserve::exp16;
#elif defined(JAXSERVE_ATTENTION_AVX2)
using jaxserve::exp8;
#endif

namespace {

enum class KvType { kF32, kBF16, kFP8, kInt8 };

struct Problem {
  const float* q;
  const void* k;  // float, bf16 bits (uint16_t), fp8 e4m3fn bits (uint8_t) or int8 rows
                  // with their scales (int8_t), as `kv`
  const void* v;
  KvType kv;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* positions;
  float* out;
  int64_t T, S, H, Dh, K, N, ps, P;
  float scale;
};

// Query rows q0 .. q1 - 1 of sequence b (one block of at most q_block rows).
struct Chunk {
  int64_t b, q0, q1;
};

// acc[0 .. dh) = corr * acc + sum_t p[t] * v[t] over the n value rows v [n, dh] of a page.
// With AVX-512 and a compile-time head dim the row of acc stays in registers across the
// keys (through memory, each key's update waited on the previous one's stores: a 512-token
// prefill's attention took 1.6x as long).
// A K/V element as f32: an f32 pool's value, or a bf16 / fp8 e4m3fn pool's widened (exact).
inline float kv_value(float x) { return x; }
inline float kv_value(uint16_t b) { return jaxserve::from_bf16(b); }
inline float kv_value(uint8_t b) { return jaxserve::from_fp8_e4m3(b); }
inline float kv_value(int8_t b) { return static_cast<float>(b); }

// A pool row of type T: dh values, then (int8 pools, `kScaled`) their f32 scale's bytes.
// row_value / row_load16 give the values as f32: q * s for int8 (one rounding, as the
// XLA reference's kv_rows_f32), the widened element otherwise (no multiply: those paths'
// bits are unchanged).
template <typename T>
constexpr bool kScaled = std::is_same_v<T, int8_t>;
template <typename T>
constexpr int64_t row_stride(int64_t dh) { return dh + (kScaled<T> ? 4 : 0); }
template <typename T>
inline float row_scale(const T* row, int64_t dh) {
  if constexpr (kScaled<T>) {
    float s;
    std::memcpy(&s, row + dh, sizeof(float));
    return s;
  } else {
    return 1.0f;
  }
}
template <typename T>
inline float row_value(const T* row, int64_t d, float s) {
  if constexpr (kScaled<T>) return kv_value(row[d]) * s;
  else return kv_value(row[d]);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline __m512 load16(const uint8_t* x) { return jaxserve::load16_fp8_e4m3(x); }
inline __m512 load16(const int8_t* x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
// Values d .. d + 15 of a row as f32 (s: the row's scale, broadcast; used for int8 only).
template <typename T>
inline __m512 row_load16(const T* row, int64_t d, __m512 s) {
  if constexpr (kScaled<T>) return _mm512_mul_ps(load16(row + d), s);
  else return load16(row + d);
}
#elif defined(JAXSERVE_ATTENTION_AVX2)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline __m256 load8(const uint8_t* x) { return jaxserve::load8_fp8_e4m3(x); }
inline __m256 load8(const int8_t* x) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
// Values d .. d + 7 of a row as f32 (s: the row's scale, broadcast; used for int8 only).
template <typename T>
inline __m256 row_load8(const T* row, int64_t d, __m256 s) {
  if constexpr (kScaled<T>) return _mm256_mul_ps(load8(row + d), s);
  else return load8(row + d);
}
#endif

#if defined(JAXSERVE_ATTENTION_AVX2)
// scale * the lane sums of 8 keys' partials a[u] (lane j: P_j of key u) as 8 lanes (key u
// in lane u), by a tree of horizontal adds: ((P0 + P1) + (P2 + P3)) + ((P4 + P5) + (P6 +
// P7)) for every key alike. score8 and score_tiles8 both end here: one order, the same bits.
[[gnu::always_inline]] inline __m256 key_sums8(const __m256 a[8], float scale) {
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // g0 = [keys 0-3: l0..l3 summed | keys 0-3: l4..l7 summed], g1 likewise for keys 4-7
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20),
                                    _mm256_permute2f128_ps(g0, g1, 0x31));
  return _mm256_mul_ps(sums, _mm256_set1_ps(scale));
}

// The scores scale * (q . k[t]) of the n <= 8 key rows k [n, DH] as 8 lanes (lanes from n
// on: 0). Each key's lane-wise products summed over the row's 8-lane slices (a[u], one FMA
// per slice; lane j holds P_j = sum_c q[8c + j] k[8c + j], in c order), then the 8 keys'
// lanes summed at once (key_sums8). prefetch(u) is called before key u is read.
template <int DH, typename T, typename Prefetch>
inline __m256 score8(const float* q, const T* k, int64_t n, float scale, Prefetch&& prefetch) {
  constexpr int C = DH / 8;
  __m256 a[8];
  for (int u = 0; u < 8; ++u) {
    if (u >= n) {
      a[u] = _mm256_setzero_ps();
      continue;
    }
    prefetch(u);
    const T* kt = k + u * row_stride<T>(DH);
    const __m256 ks = _mm256_set1_ps(row_scale(kt, DH));
    a[u] = _mm256_mul_ps(_mm256_loadu_ps(q), row_load8(kt, 0, ks));
    for (int c = 1; c < C; ++c)
      a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), row_load8(kt, 8 * c, ks), a[u]);
  }
  return key_sums8(a, scale);
}
#endif

template <int DH, typename T>
inline void accumulate_values(float* acc, float corr, const float* p, const T* v,
                              int64_t n, int64_t dh) {
#if defined(__AVX512F__)
  if constexpr (DH > 0 && DH % 16 == 0 && DH <= 256) {
    constexpr int C = DH / 16;
    __m512 a[C];
    const __m512 vc = _mm512_set1_ps(corr);
    for (int c = 0; c < C; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), vc);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 pt = _mm512_set1_ps(p[t]);
      const T* vt = v + t * row_stride<T>(DH);
      const __m512 vs = _mm512_set1_ps(row_scale(vt, DH));
      for (int c = 0; c < C; ++c)
        a[c] = _mm512_fmadd_ps(pt, row_load16(vt, 16 * c, vs), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
    return;
  }
#elif defined(JAXSERVE_ATTENTION_AVX2)
  if constexpr (DH > 0 && DH % 8 == 0 && (DH <= 64 || DH % 64 == 0) && DH <= 256) {
    // 64 columns of acc (8 of the 16 ymm registers) at a time, each over all n keys: an
    // element's sum runs in key order whatever the chunking
    constexpr int C = DH / 8, kChunk = 8;
    const __m256 vc = _mm256_set1_ps(corr);
    for (int c0 = 0; c0 < C; c0 += kChunk) {
      constexpr int W = C < kChunk ? C : kChunk;
      __m256 a[W];
      for (int c = 0; c < W; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (c0 + c)), vc);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        const T* vt = v + t * row_stride<T>(DH);
        const __m256 vs = _mm256_set1_ps(row_scale(vt, DH));
        for (int c = 0; c < W; ++c)
          a[c] = _mm256_fmadd_ps(pt, row_load8(vt, 8 * (c0 + c), vs), a[c]);
      }
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc + 8 * (c0 + c), a[c]);
    }
    return;
  }
#endif
  if (DH > 0) dh = DH;
  for (int64_t d = 0; d < dh; ++d) acc[d] *= corr;
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    const T* vt = v + t * row_stride<T>(dh);
    const float vs = row_scale(vt, dh);
    for (int64_t d = 0; d < dh; ++d) acc[d] += pt * row_value(vt, d, vs);
  }
}

// s[t] = scale * (q . k[t]) for the n key rows k [n, dh] of a page. With AVX-512 and a
// compile-time head dim, q stays in registers and each dot product is dh / 16 FMAs and one
// horizontal sum (a scalar loop is one dependent FMA per element: the scores of a
// 496-token prompt chunk over a 1,900-token context took ~4x the rest of its attention).
// k_next / v_next (or null): the next page's rows, prefetched into L2 a key at a time.
template <int DH, typename T>
inline void score_keys(float* s, const float* q, const T* k, int64_t n, int64_t dh,
                       float scale, const char* k_next, const char* v_next) {
  const int64_t row_bytes = row_stride<T>(DH > 0 ? DH : dh) * int64_t{sizeof(T)};
  auto prefetch = [&](int64_t t) {
    if (k_next == nullptr) return;
    for (int64_t o = t * row_bytes; o < (t + 1) * row_bytes; o += 64) {
      __builtin_prefetch(k_next + o, 0, 2);
      __builtin_prefetch(v_next + o, 0, 2);
    }
  };
#if defined(__AVX512F__)
  if constexpr (DH > 0 && DH % 16 == 0 && DH <= 256) {
    constexpr int C = DH / 16;
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int64_t t = 0; t < n; ++t) {
      prefetch(t);
      const T* kt = k + t * row_stride<T>(DH);
      const __m512 ks = _mm512_set1_ps(row_scale(kt, DH));
      __m512 a = _mm512_mul_ps(qv[0], row_load16(kt, 0, ks));
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], row_load16(kt, 16 * c, ks), a);
      s[t] = _mm512_reduce_add_ps(a) * scale;
    }
    return;
  }
#elif defined(JAXSERVE_ATTENTION_AVX2)
  if constexpr (DH > 0 && DH % 8 == 0 && DH <= 256) {
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const __m256 s8 = score8<DH>(q, k + t0 * row_stride<T>(DH), std::min<int64_t>(n - t0, 8),
                                   scale, [&](int u) { prefetch(t0 + u); });
      if (t0 + 8 <= n) {
        _mm256_storeu_ps(s + t0, s8);
      } else {
        alignas(32) float tail[8];
        _mm256_store_ps(tail, s8);
        std::copy(tail, tail + (n - t0), s + t0);
      }
    }
    return;
  }
#endif
  if (DH > 0) dh = DH;
  for (int64_t t = 0; t < n; ++t) {
    prefetch(t);
    const T* kt = k + t * row_stride<T>(dh);
    const float ks = row_scale(kt, dh);
    float dot = 0.0f;
    for (int64_t d = 0; d < dh; ++d) dot += q[d] * row_value(kt, d, ks);
    s[t] = dot * scale;
  }
}

// One work item. DH > 0: the head dim as a compile-time constant (unrolled, vectorised
// inner loops); DH == 0: p.Dh at run time. Returns false on a bad page id / context.
struct Scratch {
  std::vector<float> f;
  std::vector<int64_t> limit;
  std::vector<float> page;  // the tiled paths' f32 K (K^T with AVX-512) and V of a block
};

// What both item paths keep: the item's rows (row r = (t - q0) * G + g: query row t, head
// h * G + g), their running output, max and sum (online softmax) and visible keys, in
// `scratch` (extra: floats of the path's own after them).
struct Item {
  const Problem& p;
  int64_t b, q0, h, G, rows, dh, max_limit = 0;
  float *acc, *m, *l, *extra;  // [rows, dh], [rows], [rows], [extra]
  int64_t* limit;              // [rows] keys visible to the row

  Item(const Problem& p_, const Chunk& c, int64_t h_, int64_t dh_, Scratch& scratch,
       int64_t extra_floats)
      : p(p_), b(c.b), q0(c.q0), h(h_), G(p_.H / p_.K), rows((c.q1 - c.q0) * G), dh(dh_) {
    scratch.f.resize(rows * dh + 2 * rows + extra_floats);
    scratch.limit.resize(rows);
    acc = scratch.f.data();
    m = acc + rows * dh;
    l = m + rows;
    extra = l + rows;
    limit = scratch.limit.data();
    const int64_t seq_len = p.seq_lens[b];
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t lim = std::min<int64_t>(seq_len, int64_t{p.positions[q0 + r / G]} + 1);
      limit[r] = std::max<int64_t>(lim, 0);
      max_limit = std::max(max_limit, lim);
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.0f;
      std::fill(acc + r * dh, acc + (r + 1) * dh, 0.0f);
    }
  }
  bool context_fits() const { return p.seq_lens[b] <= p.P * p.ps; }
  int64_t num_pages() const { return (max_limit + p.ps - 1) / p.ps; }
  const float* q_row(int64_t r) const {
    return p.q + ((q0 + r / G) * p.H + h * G + r % G) * dh;
  }
  // The pool rows of page `pi` of the sequence's table in `pool` (K or V), or null for a
  // page id outside [0, N).
  template <typename T>
  const T* page_rows(const void* pool, int64_t pi) const {
    const int64_t page = p.block_tables[b * p.P + pi];
    if (page < 0 || page >= p.N) return nullptr;
    return static_cast<const T*>(pool) + ((h * p.N + page) * p.ps) * row_stride<T>(dh);
  }
  // Page pi + 1's rows in `pool` as bytes, for prefetching; null past the last page or for
  // a page id outside [0, N) (K and V pages share the id, so both are null or neither).
  template <typename T>
  const char* next_page_bytes(const void* pool, int64_t pi) const {
    if (pi + 1 >= num_pages()) return nullptr;
    return reinterpret_cast<const char*>(page_rows<T>(pool, pi + 1));
  }
  // out rows = acc / l; a row with no visible key -> 0.
  void finish() const {
    for (int64_t r = 0; r < rows; ++r) {
      float* o = p.out + ((q0 + r / G) * p.H + h * G + r % G) * dh;
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      for (int64_t d = 0; d < dh; ++d) o[d] = acc[r * dh + d] * inv;
    }
  }
};

// The tiled paths (AVX-512's and AVX2's, below):
// Items with at least this many rows (query rows x GQA group) widen a narrow pool's V to
// f32 once for all their rows, and with AVX-512 transpose each page's K: a vector of keys
// per FMA instead of one key and a lane sum; fewer rows (decode: the group) do not repay
// either.
constexpr int64_t kTransposeRows = 8;
// Keys per online-softmax step: two 16-key tiles (four 8-key tiles with AVX2; two 16-token
// pages, or part of a longer page). A row's max, rescaling of its running output and sum
// come once per step: per 16-key step they were ~40 instructions beside the 64 FMAs of
// scores and 64 of p @ V (AVX-512).
constexpr int64_t kBlockKeys = 32;

// The item its thread runs next (parallel_for_ahead's ahead()): the tiled paths prefetch
// its first keys' K and V during their own last block, which no prefetch covered before
// (the hardware prefetchers do not see the jump to another sequence's or head's page).
struct NextItem {
  const std::function<int64_t()>& ahead;  // the next item's index, or `total`: none
  const std::vector<Chunk>& chunks;
  int64_t total;  // items: chunks x KV heads

  // Claims the next item and points k[i] / v[i] at the pool rows of its tiles of
  // `tile_keys` keys (a divisor of p.ps) covering its first block (kBlockKeys keys); returns
  // how many tiles (0: no next item; stops at a page id outside [0, N), which its own item
  // reports).
  template <typename T>
  int first_tiles(const Problem& p, int64_t tile_keys, const T** k, const T** v) const {
    const int64_t j = ahead();
    if (j >= total) return 0;
    const Chunk& c = chunks[j / p.K];
    const int64_t h = j % p.K, stride = row_stride<T>(p.Dh);
    const int64_t keys = std::min<int64_t>(kBlockKeys, p.seq_lens[c.b]);
    int n = 0;
    for (int64_t key = 0; key < keys && key / p.ps < p.P; key += tile_keys, ++n) {
      const int64_t page = p.block_tables[c.b * p.P + key / p.ps];
      if (page < 0 || page >= p.N) break;
      const int64_t row = ((h * p.N + page) * p.ps + key % p.ps) * stride;
      k[n] = static_cast<const T*>(p.k) + row;
      v[n] = static_cast<const T*>(p.v) + row;
    }
    return n;
  }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// ----------------------------------------------------------------------------- tiled path
// With AVX-512, a head dim that is a multiple of 16 and pages of a multiple of 16 keys,
// each item turns every page it visits into f32 K^T (16 keys per vector, a 16 x 16
// register transpose) and f32 V once, for all its rows; a row's 16 scores are then
// dh FMAs over broadcast q elements, for 4 rows at a time (each K^T vector loaded once
// for the 4), with no horizontal sum per key; exp over 16 scores at once. Every row, in
// decode and in prefill, takes the same path and the same summation order, so a row's
// bits do not depend on the rows beside it or on q_block. (The per-row path below read
// and widened each K/V element once per row and summed each key's dot product across
// lanes: ~260 M query-key pairs/s on 2 Zen 4 cores.)

// r[i][j] <- r[j][i] for a 16 x 16 f32 block held as 16 vectors.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

// A row's score over one key: the products of its 16-lane slices summed lane by lane,
// slice after slice (P_j = sum_c q[16c + j] k[16c + j], j the lane), then the lanes in a
// fixed tree: (P_j + P_j+8), then + 4, + 2, + 1 lanes apart. `score_direct` computes it for
// 16 keys of K as stored (rows, widened to f32), `score_transposed` for 16 keys from K^T;
// both give the same bits, so a row's scores do not depend on which one its item took.
// score_direct runs the tree for the 16 keys at once: their 16 partial vectors combined
// pairwise, each level's sums for two keys (then four, eight) in one vector, then the keys
// put back in order (it took one horizontal sum of ~8 instructions per key and row: most
// of a decode item's work).
template <int DH>
inline __m512 score_direct(const float* q, const float* k, int64_t n, float scale) {
  constexpr int C = DH / 16;
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 a[16];  // P of key t (keys from n on: 0, as they score 0 * scale)
  for (int t = 0; t < 16; ++t) {
    if (t >= n) {
      a[t] = _mm512_setzero_ps();
      continue;
    }
    a[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k + t * DH));
    for (int c = 1; c < C; ++c)
      a[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + t * DH + 16 * c), a[t]);
  }
  // + 8 lanes: x[i] holds keys 2i (lanes 0-7) and 2i + 1 (lanes 8-15)
  __m512 x[8];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  // + 4: y[m]'s 128-bit lane L holds key 4m + L
  __m512 y[4];
  for (int m = 0; m < 4; ++m)
    y[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], 0xDD));
  // + 2: z[i]'s lane L holds keys 8i + L (elements 0, 1) and 8i + 4 + L (2, 3)
  __m512 z[2];
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  // + 1: element 4L + i holds key L + 4i
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                 _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_mul_ps(_mm512_permutexvar_ps(order, w), _mm512_set1_ps(scale));
}

// P_j (the lane-j partial of score_direct) of R rows for 16 keys: sum over the slices c
// of q_i[16c + j] * K^T[16c + j]; each K^T vector loaded once for the R rows.
template <int DH, int R>
inline void lane_partial(__m512* x, const float* const* q, const float* kt, int j) {
  const __m512 k0 = _mm512_loadu_ps(kt + j * 16);
  for (int i = 0; i < R; ++i) x[i] = _mm512_mul_ps(_mm512_set1_ps(q[i][j]), k0);
  for (int c = 1; c < DH / 16; ++c) {
    const __m512 k = _mm512_loadu_ps(kt + (16 * c + j) * 16);
    for (int i = 0; i < R; ++i) x[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][16 * c + j]), k, x[i]);
  }
}

// The tree over lanes j, j + W, j + 2W, ... (W = 16 / 2^level): sum of P_j and P_j+W at the
// leaves (W = 8), then + 4, + 2, + 1 apart, evaluated depth first so that few partial sums
// of the R rows are live at once.
template <int DH, int R, int W>
inline void lane_tree(__m512* x, const float* const* q, const float* kt, int j) {
  if constexpr (W == 8) {
    __m512 y[R];
    lane_partial<DH, R>(x, q, kt, j);
    lane_partial<DH, R>(y, q, kt, j + 8);
    for (int i = 0; i < R; ++i) x[i] = _mm512_add_ps(x[i], y[i]);
  } else {
    __m512 y[R];
    lane_tree<DH, R, W * 2>(x, q, kt, j);
    lane_tree<DH, R, W * 2>(y, q, kt, j + W);
    for (int i = 0; i < R; ++i) x[i] = _mm512_add_ps(x[i], y[i]);
  }
}

// Scores of R rows over 16 keys from K^T ([DH, 16] f32): score_direct's bits.
template <int DH, int R>
inline void score_transposed(__m512* s, const float* const* q, const float* kt, float scale) {
  lane_tree<DH, R, 1>(s, q, kt, 0);
  for (int i = 0; i < R; ++i) s[i] = _mm512_mul_ps(s[i], _mm512_set1_ps(scale));
}

// Rows scored together from K^T (each K^T vector loaded once for them); their p @ V
// shares each V load (4 rows at head dim 64, 2 + 2 at 128: registers).
constexpr int kRows = 4;

// acc[i][0 .. DH) = corr[i] * acc[i] + sum_{t < n} p[i * kBlockKeys + t] * v[t] for R rows,
// v[t] the row t % 16 of tile v[t / 16] ([16, DH]). Each V vector is loaded once for the R
// rows, their outputs held in registers across the keys; a row's sum runs in key order with
// one FMA per key whatever R is, so its bits do not depend on the rows beside it (a row
// whose keys end before n adds p = 0 times a visible key's finite V: + 0). each_key(t) is
// called before key t (the caller's prefetches, spread over the loop).
template <int DH, int R, typename V, typename EachKey>
inline void accumulate_rows(float* const* acc, const float* corr, const float* p,
                            const V* const* v, int64_t n, EachKey&& each_key) {
  constexpr int C = DH / 16;
  __m512 a[R][C];
  for (int i = 0; i < R; ++i) {
    const __m512 ci = _mm512_set1_ps(corr[i]);
    for (int c = 0; c < C; ++c) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[i] + 16 * c), ci);
  }
  for (int64_t t = 0; t < n; ++t) {
    each_key(t);
    const V* vt = v[t / 16] + (t % 16) * row_stride<V>(DH);
    const __m512 vs = _mm512_set1_ps(row_scale(vt, DH));
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = row_load16(vt, 16 * c, vs);
    for (int i = 0; i < R; ++i) {
      const __m512 pt = _mm512_set1_ps(p[i * kBlockKeys + t]);
      for (int c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(pt, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[i] + 16 * c, a[i][c]);
}

// accumulate_rows over a group of nr <= kRows rows, as many at once as registers hold.
template <int DH, typename V, typename EachKey>
inline void accumulate_group(float* const* acc, const float* corr, const float* p,
                             const V* const* v, int64_t n, int nr, EachKey&& each_key) {
  constexpr int kMax = DH <= 64 ? 4 : 2;
  for (int i = 0; i < nr; i += kMax) {
    const float* pi = p + i * kBlockKeys;
    switch (std::min(kMax, nr - i)) {
      case 1: accumulate_rows<DH, 1, V>(acc + i, corr + i, pi, v, n, each_key); break;
      case 2: accumulate_rows<DH, 2, V>(acc + i, corr + i, pi, v, n, each_key); break;
      case 3:
        accumulate_rows<DH, (kMax >= 3 ? 3 : 1), V>(acc + i, corr + i, pi, v, n, each_key);
        break;
      default: accumulate_rows<DH, kMax, V>(acc + i, corr + i, pi, v, n, each_key); break;
    }
  }
}

// Lanes [0, n) of 16 live (n clamped to [0, 16]).
inline __mmask16 first_lanes(int64_t n) {
  return n <= 0 ? 0 : n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1u);
}

template <int DH, typename T>
bool attend_item_tiled(const Problem& p, const Chunk& c, int64_t h, Scratch& scratch,
                       const NextItem& next_item) {
  Item it(p, c, h, DH, scratch, kRows * kBlockKeys + kRows);
  if (!it.context_fits()) return false;
  const int64_t rows = it.rows;
  const bool transposed = rows >= kTransposeRows;
  const bool widen = transposed && !std::is_same_v<T, float>;  // V in f32 once for many rows
  scratch.page.resize(2 * kBlockKeys * DH);
  float *acc = it.acc, *m = it.m, *l = it.l;
  float* pr = it.extra;                   // [kRows, kBlockKeys] a group's probabilities
  float* corr = pr + kRows * kBlockKeys;  // [kRows] their running outputs' rescaling
  float* kt = scratch.page.data();        // [2][DH, 16] K^T of the block's tiles, f32
                                          // (decode items: K [kBlockKeys, DH], f32)
  float* vf = kt + kBlockKeys * DH;       // [kBlockKeys, DH] V of the block, f32 (widen)
  const float* vf_tiles[2] = {vf, vf + 16 * DH};
  const int64_t* limit = it.limit;
  constexpr int64_t kStride = row_stride<T>(DH);  // a pool row's elements
  constexpr int64_t kTileBytes = 16 * kStride * int64_t{sizeof(T)};
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // The pool rows of the 16-key tile from key `key` (a multiple of 16: pages hold a multiple
  // of 16 keys, so a tile never spans two), or null for a page id outside [0, N).
  auto tile = [&](const void* pool, int64_t key) -> const T* {
    const T* page = it.page_rows<T>(pool, key / p.ps);
    return page == nullptr ? nullptr : page + (key % p.ps) * kStride;
  };
  // The block's first n rows of the tiles (t / 16, row t % 16) as f32 rows [n, DH] in out.
  auto widen_rows = [](float* out, const T* const* tiles, int64_t n, auto&& each_row) {
    for (int64_t t = 0; t < n; ++t) {
      each_row();
      const T* row = tiles[t / 16] + (t % 16) * kStride;
      const __m512 scale = _mm512_set1_ps(row_scale(row, DH));
      for (int cc = 0; cc < DH / 16; ++cc)
        _mm512_storeu_ps(out + t * DH + cc * 16, row_load16(row, cc * 16, scale));
    }
  };

  const int64_t n_keys = it.max_limit;  // keys any row sees
  for (int64_t key0 = 0; key0 < n_keys; key0 += kBlockKeys) {
    const int64_t used = std::min(n_keys - key0, kBlockKeys);
    const int tiles = used > 16 ? 2 : 1;
    const T* kp[2] = {nullptr, nullptr};
    const T* vp[2] = {nullptr, nullptr};
    for (int j = 0; j < tiles; ++j) {
      kp[j] = tile(p.k, key0 + 16 * j);
      vp[j] = tile(p.v, key0 + 16 * j);
      if (kp[j] == nullptr) return false;
    }
    // The next block's K and V tiles (in the last block, the next item's first) into L2, a
    // cache line of each at a time, spread over this block's work: per loaded row of the
    // transpose, or in decode items per other K row widened and per other key of p @ V
    // (pages lie anywhere in the pool: no hardware prefetcher sees them coming; all at once
    // at the page's start they came too late: the 32-row decode step's attention took 1.5x;
    // all at once per block in decode items, they stalled the item and came late: 32 x 256
    // over 30 layers' pools, 0.44 -> 0.32 ms a layer spread so and with the next item's
    // first block; kernels README, session 46).
    const T* next_k[2];
    const T* next_v[2];
    int n_tiles = 0;
    for (int64_t key = key0 + kBlockKeys; key < std::min(n_keys, key0 + 2 * kBlockKeys);
         key += 16) {
      const T* kn = tile(p.k, key);
      if (kn == nullptr) break;  // a bad page id: reported when its block comes
      next_k[n_tiles] = kn;
      next_v[n_tiles++] = tile(p.v, key);
    }
    if (key0 + kBlockKeys >= n_keys)  // the last block: the next item's first
      n_tiles = next_item.first_tiles<T>(p, 16, next_k, next_v);
    const char* next[4];  // each tile's K, then its V (interleaved: K tiles first was slower)
    int n_next = 0;
    for (int i = 0; i < n_tiles; ++i) {
      next[n_next++] = reinterpret_cast<const char*>(next_k[i]);
      next[n_next++] = reinterpret_cast<const char*>(next_v[i]);
    }
    int64_t fetched = 0;  // bytes of each next tile prefetched
    auto prefetch_line = [&] {
      for (int i = 0; i < n_next; ++i) __builtin_prefetch(next[i] + fetched, 0, 2);
      fetched += 64;
    };
    // Decode items: K widened to f32 once for the group's rows (kt as [kBlockKeys, DH])
    int64_t widened = 0;
    if (!transposed)
      widen_rows(kt, kp, used, [&] {
        if (widened++ % 2 == 0 && fetched < kTileBytes) prefetch_line();
      });
    // K^T per tile (rows past `used` are transposed too: never read unmasked)
    for (int j = 0; transposed && j < tiles; ++j)
      for (int cc = 0; cc < DH / 16; ++cc) {
        __m512 r16[16];
        for (int t = 0; t < 16; ++t) {
          const T* row = kp[j] + t * kStride;
          r16[t] = row_load16(row, cc * 16, _mm512_set1_ps(row_scale(row, DH)));
          if (fetched < kTileBytes) prefetch_line();
        }
        transpose16(r16);
        for (int d = 0; d < 16; ++d)
          _mm512_storeu_ps(kt + j * 16 * DH + (cc * 16 + d) * 16, r16[d]);
      }
    if (transposed) while (n_next > 0 && fetched < kTileBytes) prefetch_line();
    if (widen) widen_rows(vf, vp, used, [] {});

    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
      __m512 st[2][kRows];  // the group's scores over the two tiles (transposed)
      if (transposed) {
        const float* qs[kRows];
        for (int u = 0; u < kRows; ++u) qs[u] = it.q_row(r0 + std::min(u, nr - 1));
        for (int j = 0; j < 2; ++j) {
          const float* ktj = kt + j * 16 * DH;
          if (j == tiles) for (int u = 0; u < kRows; ++u) st[j][u] = ninf;
          else if (nr == kRows) score_transposed<DH, kRows>(st[j], qs, ktj, p.scale);
          else
            for (int u = 0; u < nr; ++u)
              score_transposed<DH, 1>(st[j] + u, qs + u, ktj, p.scale);
        }
      }
      int64_t n_group = 0;  // keys any row of the group sees in this block
      for (int u = 0; u < nr; ++u) {
        const int64_t r = r0 + u;
        const int64_t n = std::min(limit[r] - key0, kBlockKeys);
        float* pu = pr + u * kBlockKeys;
        if (n <= 0) {  // no key of this block: output unchanged (p = 0, corr = 1)
          corr[u] = 1.0f;
          std::fill(pu, pu + kBlockKeys, 0.0f);
          continue;
        }
        n_group = std::max(n_group, n);
        const __m512 s0 = transposed ? st[0][u]
                                     : score_direct<DH>(it.q_row(r), kt,
                                                        std::min<int64_t>(n, 16), p.scale);
        const __m512 s1 = transposed ? st[1][u]
                          : n > 16 ? score_direct<DH>(it.q_row(r), kt + 16 * DH, n - 16, p.scale)
                                   : ninf;
        const __mmask16 live0 = first_lanes(n), live1 = first_lanes(n - 16);
        const float mx = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(
            _mm512_mask_mov_ps(ninf, live0, s0), _mm512_mask_mov_ps(ninf, live1, s1))));
        // no new maximum: no rescaling (exp(0) is exactly 1: the same bits); on the row's
        // first block acc and l are 0, whatever corr
        corr[u] = mx == m[r] ? 1.0f : exp_nonpositive(m[r] - mx);
        const __m512 vmx = _mm512_set1_ps(mx);
        const __m512 e0 = _mm512_maskz_mov_ps(live0, exp16(_mm512_sub_ps(s0, vmx)));
        const __m512 e1 = _mm512_maskz_mov_ps(live1, exp16(_mm512_sub_ps(s1, vmx)));
        _mm512_storeu_ps(pu, e0);
        _mm512_storeu_ps(pu + 16, e1);
        l[r] = l[r] * corr[u] + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
        m[r] = mx;
      }
      if (n_group == 0) continue;
      float* accs[kRows];
      for (int u = 0; u < nr; ++u) accs[u] = acc + (r0 + u) * DH;
      auto each_key = [&](int64_t t) __attribute__((always_inline)) {
        if (t % 2 == 0 && fetched < kTileBytes) prefetch_line();
      };
      if (widen) accumulate_group<DH, float>(accs, corr, pr, vf_tiles, n_group, nr, each_key);
      else accumulate_group<DH, T>(accs, corr, pr, vp, n_group, nr, each_key);
    }
    while (n_next > 0 && fetched < kTileBytes) prefetch_line();
  }
  it.finish();
  return true;
}
#endif

#if defined(JAXSERVE_ATTENTION_AVX2)
// ------------------------------------------------------------------------ tiled path, AVX2
// AVX-512's tiled plan on 8-lane vectors, for head dims 64 and 128 and pages of a multiple
// of 8 keys: an item steps over blocks of kBlockKeys keys (four 8-key tiles). Each block's
// K is widened to f32 once for the item's rows (and, in items of >= kTransposeRows rows,
// a narrow pool's V too); every row, decode or prefill, scores a tile's 8 keys with
// score_tiles8 (score8's sums: the lanes' partials P_j, then ((P0 + P1) + (P2 + P3)) +
// ((P4 + P5) + (P6 + P7))), takes the same softmax steps (per block: max, rescale, exp on 8
// lanes, sum) and the same p @ V (one FMA per key in key order, each V vector loaded once
// for 2 rows), so a row's bits do not depend on the rows beside it. (The per-row path,
// kept for other page sizes, scored each key from the pool for every row, widening bf16
// each time, and kept the softmax's max and sum in scalar loops.) Zen 3 VM, against the
// per-row path, calls alternated: prefill 1.7-2.0x the query-key pairs/s over one layer's
// pool and 30 layers' (~125-160 -> ~215-315 M/s on 2 cores), decode 1.0-1.2x. (Until
// session 39 prefill items scored from f32 K^T, 2 rows per K^T load over broadcast q
// elements, as the AVX-512 path does: 1.5 loads an FMA, 1.06-1.12x slower in the kernel.)

// Rows sharing each V load in p @ V: 2 rows' 8 FMA chains (Zen 3: two FMA pipes of
// latency 4) in 8 of the 16 ymm registers.
constexpr int kRows8 = 2;

// score8's scores of one row over the first `tiles` 8-key tiles of a block's f32 K rows
// (k [kBlockKeys, DH]), in s[0 .. tiles): the same products and sums in the same order
// (lane j of key u: P_j = sum_c q[8c + j] k_u[8c + j], in c order; then the tree of
// horizontal adds), so the bits are score8's. Each tile's 8 keys take a slice c of q at a
// time (one q load for 8 FMAs, the key rows as the FMAs' memory operands): 1.1-1.6x the
// L1 rate of 2 rows scored from K^T with broadcast q elements (the previous prefill path:
// 1.5 loads an FMA) on the Zen 3 VM.
template <int DH>
[[gnu::always_inline]] inline void score_tiles8(__m256* s, const float* q, const float* k,
                                                int tiles, float scale) {
  constexpr int C = DH / 8;
  for (int j = 0; j < tiles; ++j) {
    const float* kb = k + 8 * j * DH;
    __m256 a[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int u = 0; u < 8; ++u) a[u] = _mm256_mul_ps(q0, _mm256_loadu_ps(kb + u * DH));
#pragma GCC unroll 16
    for (int c = 1; c < C; ++c) {
      __m256 qc = _mm256_loadu_ps(q + 8 * c);
      asm("" : "+x"(qc));  // one load of the slice for the 8 keys
      for (int u = 0; u < 8; ++u)
        a[u] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kb + u * DH + 8 * c), a[u]);
    }
    s[j] = key_sums8(a, scale);
  }
}

// acc[i][0 .. DH) = corr[i] * acc[i] + sum_{t < n} p[i * kBlockKeys + t] * v[t] for R rows,
// v[t] the row t % 8 of tile v[t / 8] ([8, DH]): accumulate_values's sums (one FMA per key,
// in key order) with each V vector loaded once for the R rows, W of each row's output
// vectors held in registers across the keys. A row whose keys end before n adds p = 0
// times a visible key's finite V: + 0. each_key(t) is called before key t's first use.
template <int DH, int R, typename V, typename EachKey>
inline void accumulate_rows8(float* const* acc, const float* corr, const float* p,
                             const V* const* v, int64_t n, EachKey&& each_key) {
  constexpr int W = 8 / R;  // R * W = 8 accumulators, 8 independent FMA chains
  for (int c0 = 0; c0 < DH / 8; c0 += W) {
    __m256 a[R][W];
    for (int i = 0; i < R; ++i) {
      const __m256 ci = _mm256_set1_ps(corr[i]);
      for (int w = 0; w < W; ++w)
        a[i][w] = _mm256_mul_ps(_mm256_loadu_ps(acc[i] + 8 * (c0 + w)), ci);
    }
    for (int64_t t0 = 0; t0 < n; t0 += 8) {  // tile by tile
      const V* vtile = v[t0 / 8];
      const int64_t tn = std::min<int64_t>(n - t0, 8);
      for (int64_t t = 0; t < tn; ++t) {
        if (c0 == 0) each_key(t0 + t);
        const V* vt = vtile + t * row_stride<V>(DH);
        const __m256 vs = _mm256_set1_ps(row_scale(vt, DH));
        __m256 pt[R];
        for (int i = 0; i < R; ++i) pt[i] = _mm256_set1_ps(p[i * kBlockKeys + t0 + t]);
        for (int w = 0; w < W; ++w) {
          __m256 vv = row_load8(vt, 8 * (c0 + w), vs);
          asm("" : "+x"(vv));  // one load for the R rows (GCC folds it into each FMA otherwise)
          for (int i = 0; i < R; ++i) a[i][w] = _mm256_fmadd_ps(pt[i], vv, a[i][w]);
        }
      }
    }
    for (int i = 0; i < R; ++i)
      for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc[i] + 8 * (c0 + w), a[i][w]);
  }
}

template <int DH, typename V, typename EachKey>
inline void accumulate_group8(float* const* acc, const float* corr, const float* p,
                              const V* const* v, int64_t n, int nr, EachKey&& each_key) {
  if (nr == 1) accumulate_rows8<DH, 1, V>(acc, corr, p, v, n, each_key);
  else accumulate_rows8<DH, 2, V>(acc, corr, p, v, n, each_key);
}

// Lanes [0, n) of 8 as an all-ones mask (n clamped to [0, 8]).
inline __m256 first_lanes8(int64_t n) {
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(std::clamp<int64_t>(n, 0, 8))),
                       _CMP_LT_OQ);
}

// Horizontal max / sum of 8 lanes (the sum in a fixed order: the halves, then pairs).
inline float reduce_max8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float reduce_add8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <int DH, typename T>
bool attend_item_tiled8(const Problem& p, const Chunk& c, int64_t h, Scratch& scratch,
                        const NextItem& next_item) {
  constexpr int kTiles = kBlockKeys / 8;
  Item it(p, c, h, DH, scratch, kRows8 * kBlockKeys + kRows8);
  if (!it.context_fits()) return false;
  const int64_t rows = it.rows;
  // V in f32 once for many rows (K always: every row scores from f32 rows)
  const bool widen = rows >= kTransposeRows && !std::is_same_v<T, float>;
  scratch.page.resize(2 * kBlockKeys * DH);
  float *acc = it.acc, *m = it.m, *l = it.l;
  float* pr = it.extra;                    // [kRows8, kBlockKeys] a group's probabilities
  float* corr = pr + kRows8 * kBlockKeys;  // [kRows8] their running outputs' rescaling
  float* kf = scratch.page.data();         // [kBlockKeys, DH] K of the block, f32
  float* vf = kf + kBlockKeys * DH;        // [kBlockKeys, DH] V of the block, f32 (widen)
  const float* vf_tiles[kTiles];
  for (int j = 0; j < kTiles; ++j) vf_tiles[j] = vf + 8 * j * DH;
  const int64_t* limit = it.limit;
  constexpr int64_t kStride = row_stride<T>(DH);  // a pool row's elements
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  // The pool rows of the 8-key tile from key `key` (a multiple of 8: pages hold a multiple
  // of 8 keys, so a tile never spans two), or null for a page id outside [0, N).
  auto tile = [&](const void* pool, int64_t key) -> const T* {
    const T* page = it.page_rows<T>(pool, key / p.ps);
    return page == nullptr ? nullptr : page + (key % p.ps) * kStride;
  };
  // The block's first n rows of the tiles (t / 8, row t % 8) as f32 rows [n, DH] in out;
  // each_row() before each row.
  auto widen_rows = [](float* out, const T* const* tiles, int64_t n, auto&& each_row) {
    for (int64_t t = 0; t < n; ++t) {
      each_row();
      const T* row = tiles[t / 8] + (t % 8) * kStride;
      const __m256 scale = _mm256_set1_ps(row_scale(row, DH));
      for (int cc = 0; cc < DH / 8; ++cc)
        _mm256_storeu_ps(out + t * DH + cc * 8, row_load8(row, cc * 8, scale));
    }
  };

  const int64_t n_keys = it.max_limit;  // keys any row sees
  for (int64_t key0 = 0; key0 < n_keys; key0 += kBlockKeys) {
    const int64_t used = std::min(n_keys - key0, kBlockKeys);
    const int tiles = static_cast<int>((used + 7) / 8);
    const T* kp[kTiles] = {};
    const T* vp[kTiles] = {};
    for (int j = 0; j < tiles; ++j) {
      kp[j] = tile(p.k, key0 + 8 * j);
      vp[j] = tile(p.v, key0 + 8 * j);
      if (kp[j] == nullptr) return false;
    }
    // The next block's K and V rows (in the last block, the next item's first) into L2,
    // one key's rows per other K row widened and per other key of p @ V (pages lie anywhere
    // in the pool: no hardware prefetcher sees them coming). A 32-row decode over 512
    // tokens of 30 layers' pools (DRAM) ran at ~0.86x the per-row path's pairs/s without
    // prefetching, ~1.0x with one key per K row widened; spread over p @ V too and with the
    // next item's first block, 0.90-0.93x that time (kernels README, session 46).
    const T* next_k[kTiles] = {};
    const T* next_v[kTiles] = {};
    int64_t next_keys = 0;
    for (int64_t key = key0 + kBlockKeys; key < std::min(n_keys, key0 + 2 * kBlockKeys);
         key += 8) {
      const T* kn = tile(p.k, key);
      if (kn == nullptr) break;  // a bad page id: reported when its block comes
      next_k[next_keys / 8] = kn;
      next_v[next_keys / 8] = tile(p.v, key);
      next_keys += 8;
    }
    if (key0 + kBlockKeys >= n_keys)  // the last block: the next item's first
      next_keys = 8 * next_item.first_tiles<T>(p, 8, next_k, next_v);
    // The next block's key u: its K and V rows' cache lines. (Inlined: as a call, GCC
    // finds it free of side effects and drops it, prefetches and all.)
    auto prefetch_key = [&](int64_t u) __attribute__((always_inline)) {
      if (u >= next_keys) return;
      const char* kr = reinterpret_cast<const char*>(next_k[u / 8] + (u % 8) * kStride);
      const char* vr = reinterpret_cast<const char*>(next_v[u / 8] + (u % 8) * kStride);
      for (int64_t o = 0; o < kStride * int64_t{sizeof(T)}; o += 64) {
        __builtin_prefetch(kr + o, 0, 2);
        __builtin_prefetch(vr + o, 0, 2);
      }
    };
    int64_t fetched = 0;  // keys of the next block prefetched
    auto prefetch_some = [&] { prefetch_key(fetched++); };
    // the tiles' rows, all 8 of the last one (rows past `used` are scored too: their lanes
    // are masked, and the lane sums never mix keys)
    // (decode items: a key per other K row widened, the rest over p @ V; prefill items,
    // whose p @ V runs once per 2 rows, all over the K rows: spread as in decode, their
    // pairs/s measured 0.94-0.98x)
    const bool decode_item = rows < kTransposeRows;
    int64_t widened = 0;
    widen_rows(kf, kp, 8 * tiles, [&] {
      if (!decode_item || widened++ % 2 == 0) prefetch_some();
    });
    if (widen) widen_rows(vf, vp, used, [] {});

    for (int64_t r0 = 0; r0 < rows; r0 += kRows8) {
      const int nr = static_cast<int>(std::min<int64_t>(kRows8, rows - r0));
      int64_t n_group = 0;  // keys any row of the group sees in this block
      for (int u = 0; u < nr; ++u) {
        const int64_t r = r0 + u;
        const int64_t n = std::min(limit[r] - key0, kBlockKeys);
        float* pu = pr + u * kBlockKeys;
        if (n <= 0) {  // no key of this block: output unchanged (p = 0, corr = 1)
          corr[u] = 1.0f;
          std::fill(pu, pu + kBlockKeys, 0.0f);
          continue;
        }
        n_group = std::max(n_group, n);
        __m256 s[kTiles], live[kTiles];
        __m256 smax = ninf;
        const int row_tiles = static_cast<int>((n + 7) / 8);  // tiles with a key the row sees
        score_tiles8<DH>(s, it.q_row(r), kf, row_tiles, p.scale);
        for (int j = 0; j < kTiles; ++j) {
          const int64_t nj = n - 8 * j;  // this tile's keys the row sees
          if (nj <= 0) s[j] = ninf;
          live[j] = first_lanes8(nj);
          smax = _mm256_max_ps(smax, _mm256_blendv_ps(ninf, s[j], live[j]));
        }
        const float mx = std::max(m[r], reduce_max8(smax));
        // no new maximum: no rescaling (exp(0) is exactly 1: the same bits); on the row's
        // first block acc and l are 0, whatever corr
        corr[u] = mx == m[r] ? 1.0f : exp_nonpositive(m[r] - mx);
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 e[kTiles];
        for (int j = 0; j < kTiles; ++j) {
          e[j] = _mm256_and_ps(live[j], exp8(_mm256_sub_ps(s[j], vmx)));
          _mm256_storeu_ps(pu + 8 * j, e[j]);
        }
        static_assert(kTiles == 4, "the sum's tree below");
        l[r] = l[r] * corr[u] +
               reduce_add8(_mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3])));
        m[r] = mx;
      }
      if (n_group == 0) continue;
      float* accs[kRows8];
      for (int u = 0; u < nr; ++u) accs[u] = acc + (r0 + u) * DH;
      auto each_key = [&](int64_t t) __attribute__((always_inline)) {
        if (decode_item && t % 2 == 0) prefetch_some();
      };
      if (widen) accumulate_group8<DH, float>(accs, corr, pr, vf_tiles, n_group, nr, each_key);
      else accumulate_group8<DH, T>(accs, corr, pr, vp, n_group, nr, each_key);
    }
    while (fetched < next_keys) prefetch_some();
  }
  it.finish();
  return true;
}
#endif

template <int DH, typename T>
bool attend_item(const Problem& p, const Chunk& c, int64_t h, Scratch& scratch) {
  const int64_t dh = DH > 0 ? DH : p.Dh;
  Item it(p, c, h, dh, scratch, p.ps);
  if (!it.context_fits()) return false;
  const int64_t rows = it.rows;
  float *acc = it.acc, *m = it.m, *l = it.l;
  float* s = it.extra;  // [ps] scores of one row over one page
  const int64_t* limit = it.limit;

  const int64_t n_pages = it.num_pages();
  for (int64_t pi = 0; pi < n_pages; ++pi) {
    const T* kp = it.page_rows<T>(p.k, pi);
    const T* vp = it.page_rows<T>(p.v, pi);
    if (kp == nullptr) return false;
    const int64_t first = pi * p.ps;
    // The next page's K and V rows, fetched into L2 a key at a time while the first row's
    // scores over this page are computed: pages lie anywhere in the pool, so no hardware
    // prefetcher sees them coming (32-row decode step on a 2-core VM: 540 -> ~445 us of
    // attention per layer; the same 128 prefetches issued at once per page did nothing).
    const char* k_next = it.next_page_bytes<T>(p.k, pi);
    const char* v_next = it.next_page_bytes<T>(p.v, pi);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(limit[r] - first, p.ps);
      if (n <= 0) continue;
      score_keys<DH, T>(s, it.q_row(r), kp, n, dh, p.scale, r == 0 ? k_next : nullptr,
                        r == 0 ? v_next : nullptr);
      float mx = m[r];
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
      const float corr = exp_nonpositive(m[r] - mx);  // 0 on the first page (m = -inf)
      int64_t t = 0;
#if defined(JAXSERVE_ATTENTION_AVX2)
      for (const __m256 vmx = _mm256_set1_ps(mx); t + 8 <= n; t += 8)
        _mm256_storeu_ps(s + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx)));
#endif
      for (; t < n; ++t) s[t] = exp_nonpositive(s[t] - mx);
      float sum = 0.0f;
      for (t = 0; t < n; ++t) sum += s[t];
      accumulate_values<DH, T>(acc + r * dh, corr, s, vp, n, dh);
      l[r] = l[r] * corr + sum;
      m[r] = mx;
    }
  }
  it.finish();
  return true;
}

// DH: 64, 128 (compile-time head dims) or 0 (any); the tiled path where it applies.
template <int DH, typename T>
bool attend_dh_typed(const Problem& p, const Chunk& c, int64_t h, Scratch& scratch,
                     const NextItem& next_item) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if constexpr (DH > 0)
    if (p.ps % 16 == 0) return attend_item_tiled<DH, T>(p, c, h, scratch, next_item);
#elif defined(JAXSERVE_ATTENTION_AVX2)
  if constexpr (DH > 0)
    if (p.ps % 8 == 0) return attend_item_tiled8<DH, T>(p, c, h, scratch, next_item);
#endif
  return attend_item<DH, T>(p, c, h, scratch);
}

template <int DH>
bool attend_dh(const Problem& p, const Chunk& c, int64_t h, Scratch& scratch,
               const NextItem& next_item) {
  switch (p.kv) {
    case KvType::kBF16: return attend_dh_typed<DH, uint16_t>(p, c, h, scratch, next_item);
    case KvType::kFP8: return attend_dh_typed<DH, uint8_t>(p, c, h, scratch, next_item);
    case KvType::kInt8: return attend_dh_typed<DH, int8_t>(p, c, h, scratch, next_item);
    default: return attend_dh_typed<DH, float>(p, c, h, scratch, next_item);
  }
}

bool attend(const Problem& p, const Chunk& c, int64_t h, Scratch& scratch,
            const NextItem& next_item) {
  switch (p.Dh) {
    case 64: return attend_dh<64>(p, c, h, scratch, next_item);
    case 128: return attend_dh<128>(p, c, h, scratch, next_item);
    default: return attend_dh<0>(p, c, h, scratch, next_item);
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::BufferR0<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                              ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> positions,
                              ffi::ResultBuffer<ffi::F32> out, int64_t q_block) {
  const auto qd = q.dimensions();
  const auto bd = block_tables.dimensions();
  int64_t kd[4], offset;
  const auto stack = jaxserve::layer_of_stack(k_pages.dimensions(), 4, *layer.typed_data(), kd,
                                              &offset);
  if (qd.size() != 3 || stack == jaxserve::StackError::kRank || bd.size() != 2)
    return ffi::Error::InvalidArgument(
        "paged_attention: q must be 3-D, k_pages 4-D (5-D stacked), block_tables 2-D");
  if (stack == jaxserve::StackError::kLayer)
    return ffi::Error::InvalidArgument(
        "paged_attention: layer must be in [0, the stack's length)");
  Problem p;
  p.T = qd[0]; p.H = qd[1]; p.Dh = qd[2];
  p.K = kd[0]; p.N = kd[1]; p.ps = kd[2]; p.S = bd[0]; p.P = bd[1];
  const auto kt = k_pages.element_type();
  const bool int8 = kt == ffi::DataType::S8;
  if (kd[3] != p.Dh + (int8 ? 4 : 0) || p.K <= 0 || p.H % p.K != 0 || seq_lens.element_count() != p.S ||
      query_start.element_count() != p.S + 1 || positions.element_count() != p.T ||
      q_block <= 0)
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  const bool bf16 = kt == ffi::DataType::BF16 || kt == ffi::DataType::U16;
  const bool fp8 = kt == ffi::DataType::F8E4M3FN || kt == ffi::DataType::U8;
  if ((kt != ffi::DataType::F32 && !bf16 && !fp8 && !int8) || v_pages.element_type() != kt ||
      v_pages.dimensions().size() != k_pages.dimensions().size() ||
      v_pages.element_count() != k_pages.element_count())
    return ffi::Error::InvalidArgument(
        "paged_attention: k_pages and v_pages must be one shape and one dtype: f32, bf16 "
        "(or u16 bf16 bits), f8e4m3fn (or u8 fp8 bits) or s8 rows with their scales");
  p.kv = bf16 ? KvType::kBF16 : fp8 ? KvType::kFP8 : int8 ? KvType::kInt8 : KvType::kF32;
  // the layer's pool where it lies, not a copy
  const int64_t offset_bytes = offset * (bf16 ? 2 : (fp8 || int8) ? 1 : 4);
  p.q = q.typed_data();
  p.k = static_cast<const char*>(k_pages.untyped_data()) + offset_bytes;
  p.v = static_cast<const char*>(v_pages.untyped_data()) + offset_bytes;
  p.block_tables = block_tables.typed_data(); p.seq_lens = seq_lens.typed_data();
  p.positions = positions.typed_data(); p.out = out->typed_data();
  p.scale = 1.0f / std::sqrt(static_cast<float>(p.Dh));

  // Split each sequence's query rows into blocks; zero the rows no item writes.
  const int32_t* qs = query_start.typed_data();
  if (qs[0] < 0 || qs[p.S] > p.T)
    return ffi::Error::InvalidArgument("paged_attention: query_start outside [0, T]");
  for (int64_t b = 0; b < p.S; ++b)
    if (qs[b + 1] < qs[b])
      return ffi::Error::InvalidArgument("paged_attention: query_start is not non-decreasing");
  std::vector<Chunk> chunks;
  const int64_t row = p.H * p.Dh;
  float* o = p.out;
  std::fill(o, o + qs[0] * row, 0.0f);
  for (int64_t b = 0; b < p.S; ++b) {
    if (p.seq_lens[b] <= 0) {
      std::fill(o + qs[b] * row, o + qs[b + 1] * row, 0.0f);
      continue;
    }
    for (int64_t q0 = qs[b]; q0 < qs[b + 1]; q0 += q_block)
      chunks.push_back({b, q0, std::min<int64_t>(qs[b + 1], q0 + q_block)});
  }
  std::fill(o + qs[p.S] * row, o + p.T * row, 0.0f);

  const int64_t total = static_cast<int64_t>(chunks.size()) * p.K;
  const bool ok = jaxserve::parallel_for_ahead(
      pool, total, [&p, &chunks, total](int64_t item, const std::function<int64_t()>& ahead) {
        thread_local Scratch scratch;
        return attend(p, chunks[item / p.K], item % p.K, scratch, NextItem{ahead, chunks, total});
      });
  if (!ok)
    return ffi::Error::InvalidArgument(
        "paged_attention: a block table holds a page id outside [0, num_pages) or a sequence "
        "length exceeds pages_per_seq * page_size");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages f32, bf16/u16, f8/u8, s8
                                  .Arg<ffi::AnyBuffer>()         // v_pages, the same
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer of stacked pools
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("q_block"));
