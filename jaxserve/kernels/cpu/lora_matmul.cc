// Each row of a batch times its own LoRA slot's matrices (Punica's BGMV / SGMV, Chen et al.
// 2023). Two XLA FFI custom calls (see lora_matmul.py):
//   JaxserveLoraMatmul: y[t] = v[t] @ M[slot[t]], M a pool of slots [S, K, N];
//   JaxserveLoraDelta:  y[t] = (x[t] @ A[slot[t]]) @ B[slot[t]], A [S, in, R], B [S, R, out]
//                       (a projection's whole LoRA delta: the shrink and the expand in one
//                       call, the [rows, R] intermediate kept on the stack).
// Pools are f32 or bf16, one layer's or a stack [L, ...] read at `layer` in place
// (stacked.h).
//
// XLA has no per-row choice of matrix: its jnp form computes every slot for every row and
// keeps the row's own (S times the FLOPs), and the layer loop copied each layer's pools out
// of the stack first; with 4 adapters of rank 16 on SmolLM2 that took a 32-stream decode
// step from 22 to 33 ms (PERFORMANCE.md, "LoRA"). Here a row costs its own slot's
// multiply-adds, read where they lie.
//
// The rows are sorted by slot (a counting sort) and computed in blocks of up to 8 rows of
// one slot (SGMV's grouping): for each block of 16 columns, 8 x 16 f32 accumulators over
// k (independent FMA chains; the block of M read once for the rows), k in order. Rows of
// slot 0 (no adapter; its matrices are zeros) and of a slot outside [0, S) are zeros
// without reading M. The pools arrive from memory (the step's weights evicted them) and
// one block's loads keep too few misses in flight: every line of the slots a call reads is
// prefetched into L2 first (a 32-stream decode step 30.4 -> 28.6 ms). Work items are row
// blocks, split over the pool's threads when the call has enough work.
//
// Shapes: LoraMatmul v [T, K] f32, M [(L,) S, K, N], slot [T] s32, layer s32 scalar ->
// y [T, N] f32. LoraDelta x [T, in] f32, A [(L,) S, in, R], B [(L,) S, R, out] (one
// dtype), slot [T] s32, layer -> y [T, out] f32; R <= kMaxRank.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "parallel.h"
#include "stacked.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Below this many multiply-adds a call runs on the calling thread only (a pool task costs
// ~5-45 us to start on 2 cores: parallel.h).
constexpr int64_t kSerialMacs = 1 << 18;
constexpr int kRows = 8;         // rows of one slot computed together
constexpr int kCols = 16;        // columns per block: one AVX-512 vector of f32
constexpr int64_t kMaxRank = 512;  // LoraDelta's intermediate: kRows x R floats on the stack

template <typename W>
inline float widen(W w);
template <>
inline float widen<float>(float w) { return w; }
template <>
inline float widen<uint16_t>(uint16_t w) { return jaxserve::from_bf16(w); }

// Rows in[0 .. n) (n <= kRows, pointers to K floats each) times m [K, N] row-major into
// out[0 .. n) (pointers to N floats each): each block of kCols columns accumulated over
// k in kRows x kCols registers, then stored.
#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const uint16_t* p, __mmask16 mask) {  // bf16: the top half of an f32
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

template <typename W>
void block(const float* const* in, int n, const W* m, int64_t K, int64_t N, float* const* out) {
  const float* vr[kRows];
  for (int r = 0; r < kRows; ++r) vr[r] = in[r < n ? r : 0];
  for (int64_t n0 = 0; n0 < N; n0 += kCols) {
    const int64_t nb = std::min<int64_t>(kCols, N - n0);
    const __mmask16 mask = nb == kCols ? 0xffff : static_cast<__mmask16>((1u << nb) - 1);
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m512 mk = load16(m + k * N + n0, mask);
      for (int r = 0; r < kRows; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(vr[r][k]), mk, acc[r]);
    }
    // a constant trip count (unrolled): acc stays in registers (a loop to n spilled it)
    for (int r = 0; r < kRows; ++r)
      if (r < n) _mm512_mask_storeu_ps(out[r] + n0, mask, acc[r]);
  }
}

inline void prefetch(const void* begin, const void* end) {
  for (const char* p = static_cast<const char*>(begin); p < end; p += 64)
    _mm_prefetch(p, _MM_HINT_T1);
}
#else
template <typename W>
void block(const float* const* in, int n, const W* m, int64_t K, int64_t N, float* const* out) {
  for (int r = 0; r < n; ++r) {
    float* o = out[r];
    std::fill(o, o + N, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float a = in[r][k];
      const W* mk = m + k * N;
      for (int64_t j = 0; j < N; ++j) o[j] += a * widen(mk[j]);
    }
  }
}

inline void prefetch(const void*, const void*) {}
#endif

// A call's rows by slot: order (rows of slots 1 .. S-1, grouped by slot), start[s] ..
// start[s + 1] the rows of slot s in order, items (first index into order, slot) of up to
// kRows rows each. Rows of slot 0 or outside [0, S) are left out (the caller zeros them).
struct Groups {
  std::vector<int64_t> start;
  std::vector<int32_t> order;
  std::vector<std::pair<int64_t, int64_t>> items;

  Groups(const int32_t* slot, int64_t T, int64_t S) : start(S + 1, 0) {
    for (int64_t t = 0; t < T; ++t)
      if (slot[t] > 0 && slot[t] < S) ++start[slot[t] + 1];
    for (int64_t s = 1; s <= S; ++s) start[s] += start[s - 1];
    order.resize(start[S]);
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < T; ++t)
      if (slot[t] > 0 && slot[t] < S) order[fill[slot[t]]++] = static_cast<int32_t>(t);
    for (int64_t s = 1; s < S; ++s)
      for (int64_t i = start[s]; i < start[s + 1]; i += kRows) items.emplace_back(i, s);
  }
  bool used(int64_t s) const { return start[s + 1] > start[s]; }
  int rows(int64_t item) const {
    const auto [first, s] = items[item];
    return static_cast<int>(std::min<int64_t>(kRows, start[s + 1] - first));
  }
};

void zero_other_rows(const int32_t* slot, int64_t T, int64_t S, int64_t N, float* y) {
  for (int64_t t = 0; t < T; ++t)
    if (slot[t] <= 0 || slot[t] >= S) std::fill(y + t * N, y + (t + 1) * N, 0.0f);
}

template <typename W>
void matmul(ffi::ThreadPool& pool, const float* v, const W* m, const int32_t* slot, int64_t T,
            int64_t S, int64_t K, int64_t N, float* y) {
  zero_other_rows(slot, T, S, N, y);
  const Groups g(slot, T, S);
  for (int64_t s = 1; s < S; ++s)
    if (g.used(s)) prefetch(m + s * K * N, m + (s + 1) * K * N);
  const Groups* gp = &g;
  auto body = [=](int64_t i) {
    const auto [first, s] = gp->items[i];
    const int n = gp->rows(i);
    const float* in[kRows];
    float* out[kRows];
    for (int r = 0; r < n; ++r) {
      in[r] = v + gp->order[first + r] * K;
      out[r] = y + gp->order[first + r] * N;
    }
    block(in, n, m + s * K * N, K, N, out);
    return true;
  };
  jaxserve::parallel_for(pool, static_cast<int64_t>(g.items.size()), body,
                         g.start[S] * K * N < kSerialMacs ? 0 : 1 << 30);
}

template <typename W>
void delta(ffi::ThreadPool& pool, const float* x, const W* a, const W* b, const int32_t* slot,
           int64_t T, int64_t S, int64_t K, int64_t R, int64_t N, float* y) {
  zero_other_rows(slot, T, S, N, y);
  const Groups g(slot, T, S);
  for (int64_t s = 1; s < S; ++s) {
    if (!g.used(s)) continue;
    prefetch(a + s * K * R, a + (s + 1) * K * R);
    prefetch(b + s * R * N, b + (s + 1) * R * N);
  }
  const Groups* gp = &g;
  auto body = [=](int64_t i) {
    const auto [first, s] = gp->items[i];
    const int n = gp->rows(i);
    alignas(64) float xa[kRows * kMaxRank];
    const float* in[kRows];
    float* mid[kRows];
    const float* mid_in[kRows];
    float* out[kRows];
    for (int r = 0; r < n; ++r) {
      in[r] = x + gp->order[first + r] * K;
      mid_in[r] = mid[r] = xa + r * R;
      out[r] = y + gp->order[first + r] * N;
    }
    block(in, n, a + s * K * R, K, R, mid);        // shrink: [n, R]
    block(mid_in, n, b + s * R * N, R, N, out);    // expand: [n, out]
    return true;
  };
  jaxserve::parallel_for(pool, static_cast<int64_t>(g.items.size()), body,
                         g.start[S] * (K + N) * R < kSerialMacs ? 0 : 1 << 30);
}

ffi::Error LoraMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> v, ffi::AnyBuffer m,
                          ffi::Buffer<ffi::S32> slot, ffi::BufferR0<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> y) {
  int64_t md[3], offset;
  switch (jaxserve::layer_of_stack(m.dimensions(), 3, *layer.typed_data(), md, &offset)) {
    case jaxserve::StackError::kRank:
      return ffi::Error::InvalidArgument("lora_matmul: m must be [S, K, N] or [L, S, K, N]");
    case jaxserve::StackError::kLayer:
      return ffi::Error::InvalidArgument("lora_matmul: layer must be in [0, the stack's length)");
    case jaxserve::StackError::kNone: break;
  }
  const auto vd = v.dimensions();
  const int64_t S = md[0], K = md[1], N = md[2];
  if (vd.size() != 2 || vd[1] != K || slot.dimensions().size() != 1 ||
      slot.dimensions()[0] != vd[0])
    return ffi::Error::InvalidArgument("lora_matmul: v must be [T, K] and slot [T] for m [S, K, N]");
  const int64_t T = vd[0];
  if (T == 0 || N == 0) return ffi::Error::Success();
  const auto type = m.element_type();
  if (type == ffi::DataType::F32) {
    matmul(pool, v.typed_data(), static_cast<const float*>(m.untyped_data()) + offset,
           slot.typed_data(), T, S, K, N, y->typed_data());
  } else if (type == ffi::DataType::BF16) {
    matmul(pool, v.typed_data(), static_cast<const uint16_t*>(m.untyped_data()) + offset,
           slot.typed_data(), T, S, K, N, y->typed_data());
  } else {
    return ffi::Error::InvalidArgument("lora_matmul: m must be f32 or bf16");
  }
  return ffi::Error::Success();
}

ffi::Error LoraDeltaImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer a,
                         ffi::AnyBuffer b, ffi::Buffer<ffi::S32> slot,
                         ffi::BufferR0<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  int64_t ad[3], bd[3], a_off, b_off;
  const int64_t l = *layer.typed_data();
  const auto ea = jaxserve::layer_of_stack(a.dimensions(), 3, l, ad, &a_off);
  const auto eb = jaxserve::layer_of_stack(b.dimensions(), 3, l, bd, &b_off);
  if (ea == jaxserve::StackError::kRank || eb == jaxserve::StackError::kRank ||
      a.dimensions().size() != b.dimensions().size())
    return ffi::Error::InvalidArgument(
        "lora_delta: a must be [S, in, R] and b [S, R, out], or both stacked [L, ...]");
  if (ea == jaxserve::StackError::kLayer || eb == jaxserve::StackError::kLayer)
    return ffi::Error::InvalidArgument("lora_delta: layer must be in [0, the stack's length)");
  const auto xd = x.dimensions();
  const int64_t S = ad[0], K = ad[1], R = ad[2], N = bd[2];
  if (xd.size() != 2 || xd[1] != K || bd[0] != S || bd[1] != R ||
      slot.dimensions().size() != 1 || slot.dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument(
        "lora_delta: x must be [T, in], a [S, in, R], b [S, R, out] and slot [T]");
  if (R > kMaxRank)
    return ffi::Error::InvalidArgument("lora_delta: the rank must be at most 512");
  if (a.element_type() != b.element_type())
    return ffi::Error::InvalidArgument("lora_delta: a and b must have one dtype");
  const int64_t T = xd[0];
  if (T == 0 || N == 0) return ffi::Error::Success();
  if (a.element_type() == ffi::DataType::F32) {
    delta(pool, x.typed_data(), static_cast<const float*>(a.untyped_data()) + a_off,
          static_cast<const float*>(b.untyped_data()) + b_off, slot.typed_data(), T, S, K, R, N,
          y->typed_data());
  } else if (a.element_type() == ffi::DataType::BF16) {
    delta(pool, x.typed_data(), static_cast<const uint16_t*>(a.untyped_data()) + a_off,
          static_cast<const uint16_t*>(b.untyped_data()) + b_off, slot.typed_data(), T, S, K,
          R, N, y->typed_data());
  } else {
    return ffi::Error::InvalidArgument("lora_delta: a and b must be f32 or bf16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLoraMatmul, LoraMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // v [T, K]
                                  .Arg<ffi::AnyBuffer>()           // m [(L,) S, K, N] f32 / bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot [T]
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer of a stacked m
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [T, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLoraDelta, LoraDeltaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x [T, in]
                                  .Arg<ffi::AnyBuffer>()           // a [(L,) S, in, R]
                                  .Arg<ffi::AnyBuffer>()           // b [(L,) S, R, out]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot [T]
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // layer of stacked pools
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [T, out]
