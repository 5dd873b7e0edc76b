// Intel AMX (Advanced Matrix Extensions) for the bf16 matmul's round_x path: the OS
// permission a process needs before its first tile instruction, the one tile shape the
// kernels use, and a register block of tile dot products.
//
// AMX gives each core 8 tile registers of up to 16 rows x 64 bytes and TDPBF16PS:
// C[16 x 16] f32 += A[16 x 32] bf16 @ B[32 x 16] bf16, B in the same (k, k + 1) pair layout
// as bf16_matmul's packed panels (a tile row is one k pair of 16 columns: 64 bytes), so a
// panel's B tiles load as they lie, at the panel's row stride. Each output's sum runs over
// the k pairs in order, in its own lane, so a row's bits do not depend on the rows beside it.
// Measured on a 2-core Intel Xeon VM with AMX (2026-11-27): ~830 GFLOP/s per core in a
// register-only loop, 6.9-11x the f32 FMA rate (PERFORMANCE.md, "AMX tiles for the bf16
// matmul's round_x").
//
// Compiled only where the compiler targets AMX-TILE and AMX-BF16 (-march=native on such a
// CPU); elsewhere JAXSERVE_AMX is undefined and callers keep the AVX-512 paths.
//
// Sources: Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 1 ch. 18
// (AMX) and vol. 2 (TDPBF16PS, LDTILECFG); the Linux kernel's Documentation/arch/x86/xstate.rst
// (ARCH_REQ_XCOMP_PERM).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define JAXSERVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace jaxserve {

// Whether this process may use the tile registers: Linux (5.16+) hands a process the AMX
// tile state (8 KB of XSAVE area per thread) only after arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA); the permission then covers every thread of the process. Asked once.
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes: A (16 rows x 16 k pairs of bf16), B (16 k pairs x 16
// columns of bf16 pairs) and C (16 rows x 16 columns f32) alike. The configuration is a
// thread's state: load it before a thread's tile work, once per drain of a parallel call
// (jaxserve::drain_epoch): between two drains another library may have changed or released
// it (XLA:CPU's own kernels run on the same pool threads; with a load once per thread the
// engine died of SIGILL, a tile instruction after such a release).
inline void amx_configure() {
  struct alignas(64) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  } cfg = {};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// One register block: C tiles 0 .. RB * CB - 1 (tile r * CB + j: rows 16 r.., columns
// 16 j..) over `steps` steps of 16 k pairs. a: bf16 pairs of the block's first row, rows
// a_stride bytes apart (16 RB rows readable); b: the first column's k pair 0, k pairs
// b_stride bytes apart, 16 columns (64 bytes) per tile; b_last: what the last step reads
// instead of b (a zero-padded copy of a short tail), or nullptr. c: out[row 0, column 0],
// rows c_stride bytes apart. RB = 2: A in tiles 4 and 5, B in 6 and 7 (CB <= 2); RB = 1:
// A in tile 4, B in tiles 5, 6, 7 and 5 again (CB <= 4).
// pf: nullptr, or where the block's B rows start in the whole panel (column 0): each step
// then prefetches the panel's rows kAmxPrefetchSteps steps ahead, all b_stride bytes of
// them (a tile load's 16 strided rows wait on DRAM otherwise; the later column blocks of
// the panel find them in L2).
constexpr int64_t kAmxPrefetchSteps = 4;

template <int RB, int CB>
inline void amx_block(const char* a, int64_t a_stride, const char* b, const char* b_last,
                      int64_t b_stride, int64_t steps, char* c, int64_t c_stride,
                      const char* pf = nullptr) {
  static_assert((RB == 1 && CB >= 1 && CB <= 4) || (RB == 2 && CB >= 1 && CB <= 2));
  _tile_zero(0);
  if constexpr (RB * CB > 1) _tile_zero(1);
  if constexpr (RB * CB > 2) _tile_zero(2);
  if constexpr (RB * CB > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const char* as = a + s * 64;
    const char* bs = (b_last != nullptr && s == steps - 1) ? b_last : b + s * 16 * b_stride;
    if (pf != nullptr) {  // (a prefetch past the panel's end does not fault)
      const char* ahead = pf + (s + kAmxPrefetchSteps) * 16 * b_stride;
      for (int64_t off = 0; off < 16 * b_stride; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    }
    _tile_loadd(4, as, a_stride);
    if constexpr (RB == 2) {
      _tile_loadd(5, as + 16 * a_stride, a_stride);
      _tile_loadd(6, bs, b_stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (CB == 2) {
        _tile_loadd(7, bs + 64, b_stride);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_dpbf16ps(1, 5, 6);
      }
    } else {
      _tile_loadd(5, bs, b_stride);
      if constexpr (CB > 1) _tile_loadd(6, bs + 64, b_stride);
      if constexpr (CB > 2) _tile_loadd(7, bs + 128, b_stride);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (CB > 1) _tile_dpbf16ps(1, 4, 6);
      if constexpr (CB > 2) _tile_dpbf16ps(2, 4, 7);
      if constexpr (CB > 3) {
        _tile_loadd(5, bs + 192, b_stride);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
  }
  constexpr int64_t kRows = 16;
  _tile_stored(0, c, c_stride);
  if constexpr (RB * CB > 1) _tile_stored(1, c + (1 / CB) * kRows * c_stride + (1 % CB) * 64, c_stride);
  if constexpr (RB * CB > 2) _tile_stored(2, c + (2 / CB) * kRows * c_stride + (2 % CB) * 64, c_stride);
  if constexpr (RB * CB > 3) _tile_stored(3, c + (3 / CB) * kRows * c_stride + (3 % CB) * 64, c_stride);
}

}  // namespace jaxserve

#endif  // AMX-TILE and AMX-BF16
