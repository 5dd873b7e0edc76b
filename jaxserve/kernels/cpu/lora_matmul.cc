// Each row of a batch times its own LoRA slot's matrix (Punica's BGMV, Chen et al. 2023):
// y[t] = v[t] @ M[slot[t]], M a pool of slots [S, K, N] (f32 or bf16), or a stack of pools
// [L, S, K, N] read at `layer` in place (stacked.h). The LoRA shrink is v = x [T, in],
// M = A [S, in, R]; the expand v = x A [T, R], M = B [S, R, out]. An XLA FFI custom call
// (see lora_matmul.py).
//
// XLA has no per-row choice of matrix: its jnp form computes every slot for every row and
// keeps the row's own (S times the FLOPs), and the layer loop copied each layer's pools
// out of the stack first; with 4 adapters of rank 16 on SmolLM2 that took a 32-stream
// decode step from 22 to 33 ms (PERFORMANCE.md, "LoRA"). Here a row costs K x N
// multiply-adds of its own slot, read where it lies.
//
// The rows are sorted by slot (a counting sort) and computed in blocks of up to 8 rows of
// one slot (Punica's SGMV grouping): for each block of 16 columns, 8 x 16 f32
// accumulators over k (independent FMA chains; the block of M read once for the rows),
// k in order. Rows of slot 0 (no adapter; its matrices are zeros) and of a slot outside
// [0, S) are zeros without reading M. Work items are row blocks, split over the pool's
// threads when the call has enough work.
//
// Shapes: v [T, K] f32, M [S, K, N] or [L, S, K, N] f32 / bf16, slot [T] s32, layer s32
// scalar -> y [T, N] f32.

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
constexpr int kRows = 8;   // rows of one slot computed together: kRows accumulators per column
constexpr int kCols = 16;  // columns per block: one AVX-512 vector of f32

template <typename W>
inline float widen(W w);
template <>
inline float widen<float>(float w) { return w; }
template <>
inline float widen<uint16_t>(uint16_t w) { return jaxserve::from_bf16(w); }

// Rows rows[0 .. n) (n <= kRows, all of one slot) of y = v @ m, m [K, N] row-major: each
// block of kCols columns accumulated over k in kRows x kCols registers (independent FMA
// chains; m's block read once for the rows), then stored.
#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const uint16_t* p, __mmask16 mask) {  // bf16: the top half of an f32
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

template <typename W>
void rows_block(const float* v, const W* m, int64_t K, int64_t N, const int32_t* rows, int n,
                float* y) {
  const float* vr[kRows];
  for (int r = 0; r < kRows; ++r) vr[r] = v + static_cast<int64_t>(rows[r < n ? r : 0]) * K;
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
    for (int r = 0; r < n; ++r)
      _mm512_mask_storeu_ps(y + static_cast<int64_t>(rows[r]) * N + n0, mask, acc[r]);
  }
}
#else
template <typename W>
void rows_block(const float* v, const W* m, int64_t K, int64_t N, const int32_t* rows, int n,
                float* y) {
  for (int r = 0; r < n; ++r) {
    const float* vr = v + static_cast<int64_t>(rows[r]) * K;
    float* out = y + static_cast<int64_t>(rows[r]) * N;
    std::fill(out, out + N, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float a = vr[k];
      const W* mk = m + k * N;
      for (int64_t j = 0; j < N; ++j) out[j] += a * widen(mk[j]);
    }
  }
}
#endif

template <typename W>
void run(ffi::ThreadPool& pool, const float* v, const W* m, const int32_t* slot, int64_t T,
         int64_t S, int64_t K, int64_t N, float* y) {
  // rows by slot (a counting sort; slot 0 and invalid slots are zeros), then items of up
  // to kRows rows of one slot
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = slot[t];
    if (s > 0 && s < S) ++start[s + 1];
    else std::fill(y + t * N, y + (t + 1) * N, 0.0f);
  }
  for (int64_t s = 1; s <= S; ++s) start[s] += start[s - 1];
  std::vector<int32_t> order(start[S]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = slot[t];
    if (s > 0 && s < S) order[fill[s]++] = static_cast<int32_t>(t);
  }
  std::vector<std::pair<int64_t, int64_t>> items;  // (first index into order, slot)
  for (int64_t s = 1; s < S; ++s)
    for (int64_t i = start[s]; i < start[s + 1]; i += kRows) items.emplace_back(i, s);
  const int32_t* ord = order.data();
  const int64_t* st = start.data();
  const auto* it = items.data();
  auto body = [=](int64_t i) {
    const auto [first, s] = it[i];
    const int n = static_cast<int>(std::min<int64_t>(kRows, st[s + 1] - first));
    rows_block(v, m + s * K * N, K, N, ord + first, n, y);
    return true;
  };
  const int64_t macs = start[S] * K * N;
  jaxserve::parallel_for(pool, static_cast<int64_t>(items.size()), body,
                         macs < kSerialMacs ? 0 : 1 << 30);
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
    run(pool, v.typed_data(), static_cast<const float*>(m.untyped_data()) + offset,
        slot.typed_data(), T, S, K, N, y->typed_data());
  } else if (type == ffi::DataType::BF16) {
    run(pool, v.typed_data(), static_cast<const uint16_t*>(m.untyped_data()) + offset,
        slot.typed_data(), T, S, K, N, y->typed_data());
  } else {
    return ffi::Error::InvalidArgument("lora_matmul: m must be f32 or bf16");
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
