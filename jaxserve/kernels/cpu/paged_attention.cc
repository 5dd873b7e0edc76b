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
// Work split: one item per (sequence b, KV head h, block of q_block of its queries), handed out
// dynamically to XLA's intra-op thread pool and the calling thread (parallel.h; contexts
// are ragged, so items differ in size). An item owns the q_block * G query rows that share KV head h (GQA:
// G = H / K) and walks the pages once with an online softmax (FlashAttention), so each K/V
// page is read once per item and never copied.
//
// Shapes (all row-major):
//   q            [T, H, Dh]       f32   new tokens, packed by sequence
//   k_pages      [K, N, ps, Dh]   f32, or bf16 / u16 holding bf16 bits (head-major pool: K kv
//                                       heads, N pages, ps tokens/page; bf16 widened to
//                                       f32 on load: half the bytes of a long context's
//                                       K/V; jaxserve stores a bf16 pool as u16 bits)
//   v_pages      [K, N, ps, Dh]   the dtype of k_pages
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp_nonpositive.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve::exp_nonpositive;

namespace {

struct Problem {
  const float* q;
  const void* k;  // float, or bf16 (uint16_t) when kv_bf16
  const void* v;
  bool kv_bf16;
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
// A K/V element as f32: an f32 pool's value, or a bf16 pool's widened (the top half of an f32).
inline float kv_value(float x) { return x; }
inline float kv_value(uint16_t b) { return jaxserve::from_bf16(b); }

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
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
      const T* vt = v + t * DH;
      for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(pt, load16(vt + 16 * c), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
    return;
  }
#endif
  if (DH > 0) dh = DH;
  for (int64_t d = 0; d < dh; ++d) acc[d] *= corr;
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    const T* vt = v + t * dh;
    for (int64_t d = 0; d < dh; ++d) acc[d] += pt * kv_value(vt[d]);
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
  constexpr int64_t kBytes = sizeof(T);
  auto prefetch = [&](int64_t t) {
    if (k_next == nullptr) return;
    for (int64_t o = t * dh * kBytes; o < (t + 1) * dh * kBytes; o += 64) {
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
      const T* kt = k + t * DH;
      __m512 a = _mm512_mul_ps(qv[0], load16(kt));
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], load16(kt + 16 * c), a);
      s[t] = _mm512_reduce_add_ps(a) * scale;
    }
    return;
  }
#endif
  if (DH > 0) dh = DH;
  for (int64_t t = 0; t < n; ++t) {
    prefetch(t);
    const T* kt = k + t * dh;
    float dot = 0.0f;
    for (int64_t d = 0; d < dh; ++d) dot += q[d] * kv_value(kt[d]);
    s[t] = dot * scale;
  }
}

// One work item. DH > 0: the head dim as a compile-time constant (unrolled, vectorised
// inner loops); DH == 0: p.Dh at run time. Returns false on a bad page id / context.
struct Scratch {
  std::vector<float> f;
  std::vector<int64_t> limit;
};

template <int DH, typename T>
bool attend_item(const Problem& p, const Chunk& c, int64_t h, Scratch& scratch) {
  const int64_t dh = DH > 0 ? DH : p.Dh;
  const int64_t b = c.b, q0 = c.q0;
  const int64_t G = p.H / p.K;
  const int64_t rows = (c.q1 - q0) * G;
  const int64_t seq_len = p.seq_lens[b];
  if (seq_len > p.P * p.ps) return false;

  // Row r = (t - q0) * G + g: query row t, head h * G + g.
  auto q_row = [&](int64_t r) { return p.q + ((q0 + r / G) * p.H + h * G + r % G) * dh; };
  auto out_row = [&](int64_t r) { return p.out + ((q0 + r / G) * p.H + h * G + r % G) * dh; };

  scratch.f.resize(rows * dh + 2 * rows + p.ps);
  scratch.limit.resize(rows);
  float* acc = scratch.f.data();    // [rows, dh] unnormalised output
  float* m = acc + rows * dh;       // [rows] running max
  float* l = m + rows;              // [rows] running sum
  float* s = l + rows;              // [ps] scores of one row over one page
  int64_t* limit = scratch.limit.data();  // [rows] keys visible to the row
  int64_t max_limit = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t lim = std::min<int64_t>(seq_len, int64_t{p.positions[q0 + r / G]} + 1);
    limit[r] = std::max<int64_t>(lim, 0);
    max_limit = std::max(max_limit, lim);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    std::fill(acc + r * dh, acc + (r + 1) * dh, 0.0f);
  }

  const int64_t n_pages = (max_limit + p.ps - 1) / p.ps;
  for (int64_t pi = 0; pi < n_pages; ++pi) {
    const int64_t page = p.block_tables[b * p.P + pi];
    if (page < 0 || page >= p.N) return false;
    const T* kp = static_cast<const T*>(p.k) + ((h * p.N + page) * p.ps) * dh;
    const T* vp = static_cast<const T*>(p.v) + ((h * p.N + page) * p.ps) * dh;
    const int64_t first = pi * p.ps;
    // The next page's K and V rows, fetched into L2 a key at a time while the first row's
    // scores over this page are computed: pages lie anywhere in the pool, so no hardware
    // prefetcher sees them coming (32-row decode step on a 2-core VM: 540 -> ~445 us of
    // attention per layer; the same 128 prefetches issued at once per page did nothing).
    const char* k_next = nullptr;
    const char* v_next = nullptr;
    if (pi + 1 < n_pages) {
      const int64_t next = p.block_tables[b * p.P + pi + 1];
      if (next >= 0 && next < p.N) {
        k_next = reinterpret_cast<const char*>(static_cast<const T*>(p.k) +
                                               ((h * p.N + next) * p.ps) * dh);
        v_next = reinterpret_cast<const char*>(static_cast<const T*>(p.v) +
                                               ((h * p.N + next) * p.ps) * dh);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(limit[r] - first, p.ps);
      if (n <= 0) continue;
      score_keys<DH, T>(s, q_row(r), kp, n, dh, p.scale, r == 0 ? k_next : nullptr,
                        r == 0 ? v_next : nullptr);
      float mx = m[r];
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
      const float corr = exp_nonpositive(m[r] - mx);  // 0 on the first page (m = -inf)
      float sum = 0.0f;
      for (int64_t t = 0; t < n; ++t) {
        s[t] = exp_nonpositive(s[t] - mx);
        sum += s[t];
      }
      accumulate_values<DH, T>(acc + r * dh, corr, s, vp, n, dh);
      l[r] = l[r] * corr + sum;
      m[r] = mx;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out_row(r);
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;  // a row with no visible key -> 0
    for (int64_t d = 0; d < dh; ++d) o[d] = acc[r * dh + d] * inv;
  }
  return true;
}

bool attend(const Problem& p, const Chunk& c, int64_t h, Scratch& scratch) {
  switch (p.Dh) {
    case 64:
      return p.kv_bf16 ? attend_item<64, uint16_t>(p, c, h, scratch)
                       : attend_item<64, float>(p, c, h, scratch);
    case 128:
      return p.kv_bf16 ? attend_item<128, uint16_t>(p, c, h, scratch)
                       : attend_item<128, float>(p, c, h, scratch);
    default:
      return p.kv_bf16 ? attend_item<0, uint16_t>(p, c, h, scratch)
                       : attend_item<0, float>(p, c, h, scratch);
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                              ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> positions,
                              ffi::ResultBuffer<ffi::F32> out, int64_t q_block) {
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  const auto bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || bd.size() != 2)
    return ffi::Error::InvalidArgument(
        "paged_attention: q must be 3-D, k_pages 4-D, block_tables 2-D");
  Problem p;
  p.T = qd[0]; p.H = qd[1]; p.Dh = qd[2];
  p.K = kd[0]; p.N = kd[1]; p.ps = kd[2]; p.S = bd[0]; p.P = bd[1];
  if (kd[3] != p.Dh || p.K <= 0 || p.H % p.K != 0 || seq_lens.element_count() != p.S ||
      query_start.element_count() != p.S + 1 || positions.element_count() != p.T ||
      q_block <= 0)
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  const auto kt = k_pages.element_type();
  if ((kt != ffi::DataType::F32 && kt != ffi::DataType::BF16 && kt != ffi::DataType::U16) ||
      v_pages.element_type() != kt || v_pages.dimensions().size() != 4 ||
      v_pages.element_count() != k_pages.element_count())
    return ffi::Error::InvalidArgument(
        "paged_attention: k_pages and v_pages must be one shape, both f32, both bf16 or both "
        "u16 (bf16 bits)");
  p.kv_bf16 = kt != ffi::DataType::F32;
  p.q = q.typed_data(); p.k = k_pages.untyped_data(); p.v = v_pages.untyped_data();
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
  const bool ok = jaxserve::parallel_for(pool, total, [&p, &chunks](int64_t item) {
    thread_local Scratch scratch;
    return attend(p, chunks[item / p.K], item % p.K, scratch);
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
                                  .Arg<ffi::AnyBuffer>()         // k_pages f32, bf16 or u16
                                  .Arg<ffi::AnyBuffer>()         // v_pages, the same
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int64_t>("q_block"));
