"""Weight-only quantised matmul for Hopper in Pallas' Mosaic GPU backend (TMA + wgmma).

x [M, K] bf16/f16 times int8 / float8_e4m3fn weights [K, N] with per-channel [N] or per-group
[K // g, N] f32 scales, f32 accumulation: the same function as `quantized_matmul` (Triton) and
`quantized_matmul_reference`, for the shapes this kernel takes (`mosaic_supports`).

Layout and blocking. A CTA (one warpgroup) owns a [tile_m, tile_n] output tile and one of
`splits` contiguous ranges of K. `plgpu.emit_pipeline` streams [tile_m, tile_k] x tiles and
[tile_k, tile_n] weight tiles GMEM -> SMEM with TMA, `max_concurrent_steps` in flight (the
bytes in flight are what a memory-bound GEMV needs: ~4 x 8 KiB per CTA, 2 CTAs per SM). Each
step widens the weight tile in registers to x's dtype (exact: int8 and e4m3 values are bf16 /
f16 values) into an SMEM tile that wgmma reads (wgmma takes an 8-bit operand only with an 8-bit
partner, so the weight goes through SMEM once more: SMEM bandwidth, which a GEMV has to spare),
then `wgmma` accumulates [tile_m, tile_n] f32 in registers.
- Per-channel scales multiply the accumulator once, in the epilogue (f32, exact as the
  reference's order up to summation order).
- Group scales: a step never spans two groups (tile_k divides g); each step accumulates into a
  fresh accumulator that is scaled by its group's row of scales (TMA'd beside the weight tile)
  and added to a running f32 sum in registers.
- GEMV (M <= tile_m = 64: decode): the N tiles alone are too few CTAs to keep HBM busy
  (Llama-3-8B's 4096 outputs are 32 tiles for 132 SMs), so K is split in `splits` ranges
  (split-K); each split writes its f32 partial [M8, N] (the M real rows rounded up to 8: whole
  swizzled tiles, which Mosaic GPU needs from JAX 0.12) and XLA sums the partials' real rows
  and applies the scales in one fused pass (M8 x N x splits x 4 bytes: 8 rows x 4096 x 8
  splits = 1 MiB next to 16 MiB of weights).
- GEMM (M > 64: prefill): tile_m 128 (64 with group scales: their running sum takes registers
  too), splits 1, x rows padded to whole tiles; the scaled tile is written in x's dtype.
wgmma needs 64 rows, so a decode step's x (1 to 64 rows) is padded to 64 rows in the wrapper
(tile_m x K x 2 bytes, L2-resident; the padded rows' products are never stored).

Sources: JAX's Mosaic GPU examples (`pallas/ops/gpu/hopper_matmul_mgpu.py`,
`hopper_mixed_type_matmul_mgpu.py`: TMA tiles, swizzle transforms, wgmma) and the Mosaic GPU
pipelining guide; split-K GEMV as in vLLM / TensorRT-LLM weight-only kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.kernels.pallas.common import cdiv, check
from jaxserve.kernels.pallas.mosaic import (MOSAIC_IMPLS, compiler_params, mosaic_interpret_params,
                                            swizzled, with_layout)
from jaxserve.kernels.pallas.quantized_matmul import (MIN_BLOCKS_PER_SPLIT, TARGET_PROGRAMS,
                                                      check_qmm_operands, finish_split_k)

X_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma's 16-bit inputs (f32 x: the Triton kernel)
WGMMA_ROWS = 64  # one warpgroup's wgmma is 64 rows tall
TILE_N = 128
TILE_K = 64  # one 128-byte swizzle row of 16-bit x
GEMM_TILE_M = 128
MAX_CONCURRENT_STEPS = 4
PARTIAL_ROW_ALIGN = 8  # split-K partials leave SMEM in whole (8, 32)-tiles of f32 rows


def mosaic_supports(x_dtype, w_dtype, k: int, n: int, group_size: int | None) -> bool:
    """Whether `quantized_matmul_mosaic` takes these operands: x bf16 / f16, in_features a
    multiple of TILE_K (64), out_features a multiple of 64 (int8) or 128 (e4m3: Mosaic
    lowers the e4m3 -> f16 widening only from a 128-byte swizzled tile), groups (if any) a
    multiple of TILE_K. Anything else runs the Triton kernel (PallasMatmul's choice)."""
    min_n = 128 if jnp.dtype(w_dtype) == jnp.dtype(jnp.float8_e4m3fn) else 64
    return (jnp.dtype(x_dtype) in [jnp.dtype(d) for d in X_DTYPES] and k % TILE_K == 0
            and n % min_n == 0 and (group_size is None or group_size % TILE_K == 0))


def _split_count(k_steps: int, tiles: int) -> int:
    """The number of K ranges for a GEMV of `tiles` output tiles and `k_steps` K tiles: the
    largest divisor of k_steps (every range a whole pipeline of equal length) that keeps >=
    MIN_BLOCKS_PER_SPLIT steps per range (a pipeline shorter than its depth never fills) and
    no more than cdiv(TARGET_PROGRAMS, tiles) ranges."""
    most = cdiv(TARGET_PROGRAMS, tiles)
    return max(d for d in range(1, k_steps + 1)
               if k_steps % d == 0 and (d == 1 or (k_steps // d >= MIN_BLOCKS_PER_SPLIT
                                                   and d <= most)))


def _qmm_mosaic_call(x, w_q, scales, *, rows: int, group_size: int | None, tile_m: int,
                     tile_n: int, splits: int, max_concurrent_steps: int, interpret: bool):
    """The plgpu.kernel over grid (m tiles, n tiles, splits). x: [M_pad, K] (M_pad a multiple
    of tile_m), `rows` of them real. Returns [splits, rows8, N] f32 partials (group scales
    applied, per-channel ones not; rows8 = rows rounded up to PARTIAL_ROW_ALIGN, the rows
    past `rows` the products of x's zero padding, for the caller to drop) when splits > 1 (then rows <= tile_m), else
    the scaled [M_pad, N] in x.dtype."""
    m_pad, k = x.shape
    n = w_q.shape[1]
    xdt = x.dtype
    k_steps = k // TILE_K // splits  # pipeline steps per CTA
    x_tf = swizzled(TILE_K, 2, "lhs")
    w_tf = swizzled(tile_n, 1, "rhs")
    wdq_tf = swizzled(tile_n, 2, "rhs")
    out_dtype = xdt if splits == 1 else jnp.float32
    # the epilogue's tile, swizzled: a store from the accumulator's (WGMMA) layout into a
    # plain tile has bank conflicts (no fast store for 16 bits; refused for f32 by Mosaic GPU
    # from JAX 0.12: TransferPlanDerivationError). Split-K partials are f32, copied out in
    # whole (8, 32) tiles: the real rows rounded up to PARTIAL_ROW_ALIGN
    o_tf = swizzled(tile_n, jnp.dtype(out_dtype).itemsize, "out")
    rows8 = cdiv(rows, PARTIAL_ROW_ALIGN) * PARTIAL_ROW_ALIGN
    grouped = group_size is not None
    steps_per_group = None if not grouped else group_size // TILE_K

    def kernel(x_gmem, w_gmem, s_gmem, o_gmem, wdq_smem, o_smem, s_smem, s_barrier):
        # x_gmem [M_pad, K] x.dtype; w_gmem [K, N] int8 | e4m3; s_gmem [N] or [K // g, N] f32;
        # o_gmem [M_pad, N] x.dtype or [splits, rows8, N] f32; wdq_smem [TILE_K, tile_n] x.dtype
        # (the widened weight tile); o_smem [tile_m, tile_n] out dtype (the epilogue's tile);
        # s_smem [tile_n] f32: the tile's per-channel scales (TMA'd while the K loop runs).
        i, j, sp = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("k")
        k0 = sp * k_steps  # first K tile of this split
        cols = pl.ds(j * tile_n, tile_n)
        scale_epilogue = not grouped and splits == 1
        if scale_epilogue:
            plgpu.copy_gmem_to_smem(s_gmem.at[cols], s_smem, s_barrier)

        def widen(w_smem):
            w = w_smem[...]  # [TILE_K, tile_n] int8 | e4m3
            if w.dtype == jnp.float8_e4m3fn and xdt != jnp.float16:
                w = w.astype(jnp.float16)  # sm_90 converts e4m3 only to f16 (exact)
            wdq_smem[...] = w.astype(xdt)  # exact: every int8 / e4m3 value is a bf16 / f16 one
            plgpu.commit_smem()  # make the registers' stores visible to wgmma

        in_specs = [plgpu.BlockSpec((tile_m, TILE_K), lambda kk: (i, k0 + kk), transforms=x_tf),
                    plgpu.BlockSpec((TILE_K, tile_n), lambda kk: (k0 + kk, j), transforms=w_tf)]

        def scale_row(s_ref):  # [tile_n] f32 in the accumulator's column layout
            return with_layout(s_ref[...], plgpu.Layout.WGMMA.reduce(0), interpret)

        if not grouped:
            def run(acc_ref):
                def step(_, x_smem, w_smem):
                    widen(w_smem)
                    plgpu.wgmma(acc_ref, x_smem, wdq_smem)
                    plgpu.wgmma_wait(0)  # wdq_smem and the stage are rewritten next step
                plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=in_specs,
                                    max_concurrent_steps=max_concurrent_steps)(x_gmem, w_gmem)
                return acc_ref[...]
            acc = pl.run_scoped(run, plgpu.ACC((tile_m, tile_n), jnp.float32))
            if scale_epilogue:
                plgpu.barrier_wait(s_barrier)
                acc = acc * lax.broadcast_in_dim(scale_row(s_smem), acc.shape, [1])
        else:
            # a [1, tile_n] block of the group's scale row rides along with each weight tile
            s_spec = plgpu.BlockSpec((1, tile_n), lambda kk: ((k0 + kk) // steps_per_group, j))

            def step(_, x_smem, w_smem, s_smem, total):
                widen(w_smem)

                def one(acc_ref):
                    plgpu.wgmma(acc_ref, x_smem, wdq_smem)
                    plgpu.wgmma_wait(0)
                    return acc_ref[...]
                part = pl.run_scoped(one, plgpu.ACC((tile_m, tile_n), jnp.float32))
                return total + part * lax.broadcast_in_dim(scale_row(s_smem.at[0]), part.shape,
                                                           [1])
            zero = with_layout(jnp.zeros((tile_m, tile_n), jnp.float32), plgpu.Layout.WGMMA,
                               interpret)
            acc = plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=in_specs + [s_spec],
                                      max_concurrent_steps=max_concurrent_steps,
                                      init_carry=zero)(x_gmem, w_gmem, s_gmem)
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        if splits == 1:
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(i * tile_m, tile_m), cols])
        else:  # the one m tile's real rows, rounded up to whole tiles
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows8)], o_gmem.at[sp, :, cols])
        plgpu.wait_smem_to_gmem(0)

    out_shape = (m_pad, n) if splits == 1 else (splits, rows8, n)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        scratch_types=dict(wdq_smem=plgpu.SMEM((TILE_K, tile_n), xdt, transforms=wdq_tf),
                           o_smem=plgpu.SMEM((tile_m, tile_n), out_dtype, transforms=o_tf),
                           s_smem=plgpu.SMEM((tile_n,), jnp.float32),
                           s_barrier=plgpu.Barrier()),
        grid=(m_pad // tile_m, n // tile_n, splits),
        grid_names=("m", "n", "k"),
        compiler_params=compiler_params(),
        interpret=mosaic_interpret_params() if interpret else None,
    )(x, w_q, scales)



@functools.partial(jax.jit, static_argnames=("impl", "tile_n", "splits", "max_concurrent_steps"))
def quantized_matmul_mosaic(x: jax.Array, w_q: jax.Array, scales: jax.Array, *,
                            impl: str = "pallas_mosaic", tile_n: int | None = None,
                            splits: int | None = None,
                            max_concurrent_steps: int = MAX_CONCURRENT_STEPS) -> jax.Array:
    """x @ dequantise(w_q, scales) with f32 accumulation, in one Mosaic GPU kernel (Hopper).

    x: [M, in_features] bf16 / f16 (any M >= 1); w_q: [in_features, out_features] int8 or
    float8_e4m3fn; scales: [out_features] f32 (per channel) or [in_features // g,
    out_features] f32 (per group of g input rows, int8 only). Returns [M, out_features] in
    x.dtype: the weight is widened to x's dtype exactly, products on the tensor cores in
    x's dtype with f32 accumulation; group scales multiply each group's f32 partial sum,
    per-channel scales the f32 total (the reference: `quantized_matmul_reference`).
    Shapes (`mosaic_supports`): in_features and g multiples of 64, out_features of 64
    (int8) or 128 (e4m3).
    tile_n: output columns per CTA (128 when out_features allows, else 64); splits: K ranges
    for M <= 64 (default from the shapes: `_split_count`; M > 64 always 1);
    max_concurrent_steps: TMA stages in flight per CTA. impl: "pallas_mosaic" (a Hopper GPU)
    or "pallas_mosaic_interpret" (CPU). Raises ValueError (naming the argument and the
    limit) for bad shapes, dtypes, scales, tiles or impl.
    Source: W8A16 weight-only GEMM / split-K GEMV (vLLM, TensorRT-LLM) written with JAX's
    Mosaic GPU matmul examples (TMA pipeline, wgmma).
    """
    fn = "quantized_matmul_mosaic"
    check(fn, impl in MOSAIC_IMPLS, f"impl must be one of {MOSAIC_IMPLS}, got {impl!r}")
    group = check_qmm_operands(fn, x, w_q, scales)
    m, k = x.shape
    n = w_q.shape[1]
    check(fn, mosaic_supports(x.dtype, w_q.dtype, k, n, group),
          f"needs x bf16 / f16 (got {jnp.dtype(x.dtype)}), in_features % {TILE_K} == 0 (got "
          f"{k}), out_features % 64 == 0, % 128 for e4m3 (got {n}) and group size % "
          f"{TILE_K} == 0 (got {group})")
    fp8 = jnp.dtype(w_q.dtype) == jnp.dtype(jnp.float8_e4m3fn)
    tile_n = (TILE_N if n % TILE_N == 0 else 64) if tile_n is None else tile_n
    check(fn, tile_n in ((128, 256) if fp8 else (64, 128, 256)) and n % tile_n == 0,
          f"tile_n must be 64 (int8 only), 128 or 256 and divide out_features {n}, got {tile_n}")
    gemv = m <= WGMMA_ROWS
    # group scales keep a second [tile_m, tile_n] f32 sum in registers: 64 rows, so the
    # two stay within a thread's 255 registers
    tile_m = WGMMA_ROWS if gemv or group is not None else GEMM_TILE_M
    k_tiles = k // TILE_K
    if splits is None:
        splits = _split_count(k_tiles, n // tile_n) if gemv else 1
    check(fn, isinstance(splits, int) and splits >= 1 and k_tiles % splits == 0
          and (gemv or splits == 1),
          f"splits must divide in_features / {TILE_K} = {k_tiles} (and be 1 for M > "
          f"{WGMMA_ROWS}), got {splits}")
    check(fn, isinstance(max_concurrent_steps, int) and max_concurrent_steps >= 1,
          f"max_concurrent_steps must be >= 1, got {max_concurrent_steps}")
    m_pad = cdiv(m, tile_m) * tile_m
    out = _qmm_mosaic_call(jnp.pad(x, ((0, m_pad - m), (0, 0))), w_q, scales, rows=m,
                           group_size=group, tile_m=tile_m, tile_n=tile_n, splits=splits,
                           max_concurrent_steps=max_concurrent_steps,
                           interpret=impl == "pallas_mosaic_interpret")
    return out[:m] if splits == 1 else finish_split_k(out[:, :m], scales, group, x.dtype)


__all__ = ["mosaic_supports", "quantized_matmul_mosaic"]
