"""Weight-only quantised matmul (W8A16): activations [M, K] in f32/bf16/f16 times an int8 or
fp8 e4m3 weight [K, N] with f32 scales per output channel or per (K-group, channel).

Layout and blocking. The grid is (cdiv(M, block_m), cdiv(N, block_n), splits); one program
owns an output tile [block_m, block_n] and walks its split's range of K in blocks of
block_k. Every step loads an activation block [block_m, block_k] and a quantised weight
block [block_k, block_n] with masked loads (edges of M, K and N need not be multiples of the
blocks: SmolLM2's 576 / 1536 / 49152), converts the weight block to the activations' dtype
in registers (int8 and e4m3 values are exact in bf16/f16/f32), and accumulates `plgpu.dot`
in f32.
Per-channel scales multiply the accumulator once after the K loop; per-group scales
multiply each block's partial dot by that group's scale row (block_k divides the group,
so a block never straddles two groups). No dequantised copy of the weight exists anywhere:
the weight crosses HBM once at 1 byte per element, which is the point at small M (decode),
where the matmul is bandwidth bound. Split-K for that GEMV shape: the N tiles alone are too
few programs to keep HBM busy (Llama-3-8B's 4096 outputs are 64 tiles of 64 for 132 SMs, and
the first GPU run measured this kernel at 13 ms per token against a ~2.1 ms bound), so for
M <= 64 K is cut in `splits` ranges (~264 programs in all, >= 4 K blocks each); each writes
an f32 partial tile and XLA sums them (and applies per-channel scales) in one fused pass.

Sources: weight-only int8 as in LLM.int8 (Dettmers et al., 2022) / vLLM's W8A16 path;
group scales as in GPTQ (Frantar et al., 2022) and AWQ (Lin et al., 2023); fp8 e4m3 as in
"FP8 Formats for Deep Learning" (Micikevicius et al., 2022); the tiled K loop follows
Triton's matmul tutorial and JAX's `pallas.ops.gpu` kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.kernels.pallas.common import (FLOAT_DTYPES, IMPLS, MIN_DOT, QUANT_FORMATS, block_size,
                                            cdiv, check, check_array, is_power_of_2,
                                            quant_format_of, store_gemv_rows,
                                            triton_call_params)

WEIGHT_DTYPES = tuple(f.dtype for f in QUANT_FORMATS.values())  # int8, float8_e4m3fn
# Split-K (both quantised-matmul kernels): programs (CTAs) to aim for, ~2 per SM of a 132-SM
# H100 / H200, and the fewest K blocks a range walks.
TARGET_PROGRAMS = 264
MIN_BLOCKS_PER_SPLIT = 4
# A GEMV (M <= GEMV_ROWS: one 16-row block, single-stream decode) defaults to 128 x 128
# weight tiles with 3 stages in flight: on an H200 this read the weight 1.07-1.81x faster
# than 64 x 128 tiles with 2 stages at each Llama-3-8B projection shape (PERFORMANCE.md,
# "The GPU run of session 27": `tools/bench_quantized_matmul --sweep`); a GEMV is
# latency bound, so the bytes in flight per SM are what count.
GEMV_ROWS = 16
GEMV_STAGES = 3
# `gemv` variants that multiply and reduce on the CUDA cores instead of a tensor-core dot
# (M <= REDUCE_ROWS): "reduce" widens the weight with Triton's conversion, "reduce_magic"
# with an integer add and a bitcast (int8 only). To be measured on a GPU
# (`tools/bench_quantized_matmul --sweep`); the default stays "dot" until then.
GEMV_MODES = ("dot", "reduce", "reduce_magic")
REDUCE_ROWS = 4
# their default block_k: the accumulators are rows x [block_k, block_n] f32 in registers, so
# 3-4 rows take half the K block (with group scales 4 rows at 32 spilled, tools/compile_triton)
REDUCE_BLOCK_K = 32
REDUCE_BLOCK_K_WIDE = 16
# Split-K's program target for those variants: their loads are not pipelined through
# shared memory (one K block in flight per warp), so the bytes in flight come from many
# programs: ~8 per SM of 132 (56 registers a thread: up to 9 programs of 4 warps fit).
REDUCE_TARGET_PROGRAMS = 1056
# The in-kernel dot's precision for f32 activations (bf16 / f16 use the plain tensor-core
# dot). On the GPU 3xTF32 (near-f32 accuracy on tensor cores): an IEEE f32 dot
# (HIGHEST) spills heavily at these tiles (compile_triton, sm_90). XLA:CPU has no 3xTF32,
# and there HIGHEST is the plain f32 dot.
F32_DOT_PRECISION = {"pallas": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                     "pallas_interpret": jax.lax.Precision.HIGHEST}


# ----------------------------------------------------------------------------- kernel body

def _qmm_kernel(x_ref, w_ref, s_ref, o_ref, *, m: int, k: int, n: int, block_m: int,
                block_n: int, block_k: int, blocks_per_split: int, group_size: int | None,
                f32_precision):
    """One [block_m, block_n] output tile over one split of K.

    x_ref: [M, K] x.dtype, the whole activations (rows / columns picked with pl.ds);
    w_ref: [K, N] int8 | float8_e4m3fn, the whole quantised weight;
    s_ref: [N] f32 (per channel) or [K // group_size, N] f32 (per group);
    o_ref: [M, N] x.dtype (one split: the scaled product), or [splits, M, N] f32 (split-K:
           this split's partial, per-channel scales not applied); the program writes its
           masked tile.
    """
    i, j, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    split_k = len(o_ref.shape) == 3
    rows = i * block_m + jnp.arange(block_m)  # [block_m] int32
    cols = j * block_n + jnp.arange(block_n)  # [block_n] int32
    row_ok, col_ok = rows < m, cols < n
    precision = f32_precision if x_ref.dtype == jnp.float32 else None

    def body(kb, acc):  # acc: [block_m, block_n] f32
        ks = kb * block_k + jnp.arange(block_k)  # [block_k] int32
        k_ok = ks < k
        # x: [block_m, block_k] x.dtype; padded rows / columns read as 0
        x = plgpu.load(x_ref.at[pl.ds(i * block_m, block_m), pl.ds(kb * block_k, block_k)],
                       mask=row_ok[:, None] & k_ok[None, :], other=0)
        # w: [block_k, block_n] int8 | fp8, converted in registers to x.dtype (exact); masked
        # with a select after the cast (Triton cannot splat an `other` fill into fp8)
        w_ok = k_ok[:, None] & col_ok[None, :]
        w = plgpu.load(w_ref.at[pl.ds(kb * block_k, block_k), pl.ds(j * block_n, block_n)],
                       mask=w_ok)
        w = jnp.where(w_ok, w.astype(x.dtype), 0)
        part = plgpu.dot(x, w, precision=precision)  # [block_m, block_n] f32
        if group_size is not None:
            # s: [block_n] f32, the scale row of the group holding this K block
            s = plgpu.load(s_ref.at[(kb * block_k) // group_size, pl.ds(j * block_n, block_n)],
                           mask=col_ok, other=0)
            part = part * s[None, :]
        return acc + part

    first = sp * blocks_per_split
    acc = jax.lax.fori_loop(first, jnp.minimum(first + blocks_per_split, cdiv(k, block_k)), body,
                            jnp.zeros((block_m, block_n), jnp.float32))
    if group_size is None and not split_k:
        s = plgpu.load(s_ref.at[pl.ds(j * block_n, block_n)], mask=col_ok, other=0)  # [block_n] f32
        acc = acc * s[None, :]
    tile = (pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n))
    plgpu.store(o_ref.at[(sp,) + tile if split_k else tile], acc.astype(o_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


def _int8_to_f32_magic(w: jax.Array) -> jax.Array:
    """int8 [..] -> f32 [..], exactly, by an integer add and a bitcast: 0x4B400000 is
    1.5 * 2**23, where f32's mantissa steps by 1, so its bits plus w are 12582912 + w.
    (An unsigned form, the byte's top bit flipped and OR-ed into 2**23's bits, compiled
    to more instructions for sm_90: tools/compile_triton.)
    Source: the magic-number conversion of FasterTransformer's weight-only GEMV
    (there for int8 -> f16)."""
    bits = w.astype(jnp.int32) + jnp.int32(0x4B400000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(12582912.0)


def _qmv_kernel(x_ref, w_ref, s_ref, o_ref, *, m: int, k: int, n: int, block_n: int,
                block_k: int, blocks_per_split: int, group_size: int | None, magic: bool):
    """`_qmm_kernel` for M <= REDUCE_ROWS on the CUDA cores (GEMV_MODES "reduce" /
    "reduce_magic"): one program owns the block_n columns of every row over one split of
    K; each K block's weight [block_k, block_n] is widened to f32 and multiplied into an
    f32 accumulator of the same shape per row (one FMA a weight element, no cross-thread
    work in the loop), which is summed over K once, after the loop. Group scales multiply
    each group's accumulators once (blocks_per_split holds whole groups). Same refs and
    outputs as `_qmm_kernel` (grid (1, N tiles, splits))."""
    j, sp = pl.program_id(1), pl.program_id(2)
    split_k = len(o_ref.shape) == 3
    cols = j * block_n + jnp.arange(block_n)  # [block_n] int32
    col_ok = cols < n
    whole = k % block_k == 0 and n % block_n == 0

    def body(kb, accs):  # accs: m x [block_k, block_n] f32
        ks = kb * block_k + jnp.arange(block_k)  # [block_k] int32
        k_ok = ks < k
        w_tile = w_ref.at[pl.ds(kb * block_k, block_k), pl.ds(j * block_n, block_n)]
        if whole:
            w = plgpu.load(w_tile)
        elif w_ref.dtype == jnp.int8:
            w = plgpu.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0)
        else:  # (Triton cannot splat an `other` fill into fp8)
            w_ok = k_ok[:, None] & col_ok[None, :]
            w = jnp.where(w_ok, plgpu.load(w_tile, mask=w_ok).astype(jnp.float32), 0)
        if magic and w.dtype == jnp.int8:
            w = _int8_to_f32_magic(w)  # [block_k, block_n] f32
        else:
            w = w.astype(jnp.float32)
        out = []
        for r in range(m):
            x_tile = x_ref.at[pl.ds(r, 1), pl.ds(kb * block_k, block_k)]
            x = (plgpu.load(x_tile) if whole else
                 plgpu.load(x_tile, mask=k_ok[None, :], other=0))[0].astype(jnp.float32)
            out.append(accs[r] + x[:, None] * w)
        return tuple(out)

    first = sp * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, cdiv(k, block_k))
    zeros = tuple(jnp.zeros((block_k, block_n), jnp.float32) for _ in range(m))
    if group_size is None:
        accs = jax.lax.fori_loop(first, last, body, zeros)
    else:
        # group scales once a group, not once a weight element: each group's K blocks sum
        # into accumulators of their own, added in times the group's scale row (splits
        # hold whole groups: `_qmm_call`)
        per_group = group_size // block_k

        def group(g, accs):
            s = plgpu.load(s_ref.at[g, pl.ds(j * block_n, block_n)], mask=col_ok, other=0)
            part = jax.lax.fori_loop(g * per_group, (g + 1) * per_group, body, zeros)
            return tuple(a + p * s[None, :] for a, p in zip(accs, part))

        accs = jax.lax.fori_loop(first // per_group, last // per_group, group, zeros)
    rows = [jnp.sum(a, axis=0) for a in accs]  # m x [block_n] f32
    if group_size is None and not split_k:
        s = plgpu.load(s_ref.at[pl.ds(j * block_n, block_n)], mask=col_ok, other=0)
        rows = [row * s for row in rows]
    store_gemv_rows(o_ref, rows, j, sp, block_n, col_ok)


# ----------------------------------------------------------------------------- pallas_call

def _qmm_call(x, w_q, scales, *, block_m: int, block_n: int, block_k: int, splits: int,
              group_size: int | None, impl: str, num_warps: int, num_stages: int,
              gemv: str = "dot"):
    """pallas_call over grid (cdiv(M, block_m), cdiv(N, block_n), splits); every operand is
    passed whole (no BlockSpecs) and the kernel indexes and masks its own tiles. With splits
    > 1 the f32 partials are summed (and per-channel scales applied) here. gemv: one of
    GEMV_MODES (not "dot": `_qmv_kernel`, block_m = M)."""
    m, k = x.shape
    n = w_q.shape[1]
    k_blocks = cdiv(k, block_k)
    if gemv == "dot":
        kernel = functools.partial(_qmm_kernel, m=m, k=k, n=n, block_m=block_m,
                                   block_n=block_n, block_k=block_k,
                                   blocks_per_split=cdiv(k_blocks, splits),
                                   group_size=group_size,
                                   f32_precision=F32_DOT_PRECISION.get(impl))
    else:
        block_m = m
        per_split = cdiv(k_blocks, splits)
        if group_size is not None:  # whole groups a split (block_k divides the group)
            per_group = group_size // block_k
            per_split = cdiv(per_split, per_group) * per_group
        kernel = functools.partial(_qmv_kernel, m=m, k=k, n=n, block_n=block_n,
                                   block_k=block_k, blocks_per_split=per_split,
                                   group_size=group_size, magic=gemv == "reduce_magic")
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n) if splits == 1 else (splits, m, n),
                                       x.dtype if splits == 1 else jnp.float32),
        grid=(cdiv(m, block_m), cdiv(n, block_n), splits),
        name="quantized_matmul",
        **triton_call_params(impl, num_warps=num_warps, num_stages=num_stages),
    )(x, w_q, scales)
    return out if splits == 1 else finish_split_k(out, scales, group_size, x.dtype)


def finish_split_k(partials: jax.Array, scales: jax.Array, group_size: int | None,
                   dtype) -> jax.Array:
    """The product from split-K partials: partials [splits, M, N] f32 (group scales already
    applied in the kernel, per-channel ones not); scales [N] or [K // g, N] f32. Returns
    [M, N] `dtype`: the partials summed in f32, times the per-channel scales, in one fused
    XLA pass."""
    total = partials.sum(axis=0)  # [M, N] f32
    if group_size is None:
        total = total * scales[None, :]
    return total.astype(dtype)


def default_splits(m: int, n: int, k_blocks: int, block_n: int,
                   target: int = TARGET_PROGRAMS) -> int:
    """Split-K ranges for M <= 64 (decode): the largest power of two keeping >=
    MIN_BLOCKS_PER_SPLIT K blocks per range and <= `target` programs over the N tiles (1
    for larger M, whose M tiles give the grid its size, and where partials would cost M x
    N x 4 bytes each)."""
    if m > 64:
        return 1
    splits = 1
    while (splits * 2 * MIN_BLOCKS_PER_SPLIT <= k_blocks
           and splits * 2 * cdiv(n, block_n) <= target):
        splits *= 2
    return splits


# ----------------------------------------------------------------------------- checks

def check_qmm_operands(fn: str, x, w_q, scales) -> int | None:
    """Validate x / w_q / scales for a quantised matmul (both kernels and the reference;
    ValueErrors name `fn`, the argument and the limit); return the group size (None for
    per-channel scales)."""
    check_array(fn, "x", x, (None, None), FLOAT_DTYPES)
    check(fn, x.shape[0] >= 1, f"x must have at least one row, got shape {list(x.shape)}")
    check_array(fn, "w_q", w_q, (x.shape[1], None), WEIGHT_DTYPES)
    k, n = w_q.shape
    if getattr(scales, "ndim", None) == 1:
        check_array(fn, "scales", scales, (n,), (jnp.float32,))
        return None
    check_array(fn, "scales", scales, (None, n), (jnp.float32,))
    groups = scales.shape[0]
    check(fn, groups >= 1 and k % groups == 0,
          f"scales [groups, N] must have groups dividing in_features {k}, got {groups}")
    g = k // groups
    check(fn, is_power_of_2(g) and g >= MIN_DOT,
          f"group size in_features // groups must be a power of two >= {MIN_DOT}, got {k} // {groups}")
    check(fn, quant_format_of(w_q.dtype).name == "int8",
          f"group scales are only supported for int8 weights, got {jnp.dtype(w_q.dtype)}")
    return g


# ----------------------------------------------------------------------------- public API

@functools.partial(jax.jit, static_argnames=("fmt", "group_size"))
def quantize_weights(w: jax.Array, fmt: str, group_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Quantise a weight for `quantized_matmul`.

    w: [in_features, out_features] f32/bf16/f16. fmt: "int8" or "fp8_e4m3".
    group_size: None -> one scale per output channel (amax over in_features), scales
    [out_features] f32; g (int8 only; a power of two >= 16 dividing in_features) -> one
    scale per (group of g input rows, channel), scales [in_features // g, out_features] f32.
    Returns (w_q [in_features, out_features] int8 | float8_e4m3fn, scales) with
    w ~= w_q * scale (int8: |error| <= scale / 2 per element). A zero slice gets scale 1.
    Raises ValueError for a bad shape / dtype / fmt / group_size, or fp8 with groups.
    Source: symmetric absmax quantisation (LLM.int8, GPTQ/AWQ group scales).
    """
    fn = "quantize_weights"
    check_array(fn, "w", w, (None, None), FLOAT_DTYPES)
    check(fn, fmt in QUANT_FORMATS, f"fmt must be one of {tuple(QUANT_FORMATS)}, got {fmt!r}")
    f = QUANT_FORMATS[fmt]
    k, n = w.shape
    if group_size is None:
        w_q, scale = f.quantize(w, (0,))
        return w_q, scale.reshape(n)
    check(fn, fmt == "int8", f"group_size is only supported for int8, got fmt {fmt!r}")
    check(fn, isinstance(group_size, int) and is_power_of_2(group_size) and group_size >= MIN_DOT
          and k % group_size == 0,
          f"group_size must be a power of two >= {MIN_DOT} dividing in_features {k}, got {group_size}")
    w_q, scale = f.quantize(w.reshape(k // group_size, group_size, n), (1,))
    return w_q.reshape(k, n), scale.reshape(k // group_size, n)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "splits", "impl",
                                             "num_warps", "num_stages", "gemv"))
def quantized_matmul(x: jax.Array, w_q: jax.Array, scales: jax.Array, *, block_m: int | None = None,
                     block_n: int | None = None, block_k: int | None = None,
                     splits: int | None = None, impl: str = "pallas", num_warps: int = 4,
                     num_stages: int | None = None, gemv: str = "dot") -> jax.Array:
    """x @ dequantise(w_q, scales) with f32 accumulation, in one Pallas (Triton) kernel.

    x: [M, in_features] f32/bf16/f16 activations (any M >= 1); w_q: [in_features,
    out_features] int8 or float8_e4m3fn; scales: [out_features] f32 (per channel) or
    [in_features // g, out_features] f32 (per group of g input rows; int8 only; g a power
    of two >= 16). Returns [M, out_features] in x.dtype. f32 x: 3xTF32 dot on the GPU
    (about f32 accuracy), a plain f32 dot in interpret mode.
    block_m / block_n / block_k: power-of-two tiles >= 16 (defaults from the shapes; with
    groups block_k must divide g). splits: K ranges reduced in f32 outside the kernel
    (split-K; default: `default_splits`, > 1 only for M <= 64). num_warps, num_stages:
    Triton's (stages default: GEMV_STAGES for M <= GEMV_ROWS, else 2). impl: "pallas"
    (GPU) or "pallas_interpret" (CPU). gemv: one of GEMV_MODES: "dot" (the tiled dot, any
    M), or for M <= REDUCE_ROWS "reduce" / "reduce_magic": f32 multiply-and-reduce on the
    CUDA cores (IEEE f32 products and sums; block_k default REDUCE_BLOCK_K, for 3-4 rows
    REDUCE_BLOCK_K_WIDE; "reduce_magic" widens int8 by an integer add and a bitcast, fp8
    as "reduce").
    Raises ValueError for bad shapes, dtypes, scales, blocks, gemv or impl.
    Source: W8A16 weight-only quantised GEMM (vLLM / TensorRT-LLM), Triton's tiled matmul.
    """
    fn = "quantized_matmul"
    check(fn, impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")
    group = check_qmm_operands(fn, x, w_q, scales)
    m, k = x.shape
    n = w_q.shape[1]
    check(fn, gemv in GEMV_MODES, f"gemv must be one of {GEMV_MODES}, got {gemv!r}")
    check(fn, gemv == "dot" or m <= REDUCE_ROWS,
          f"gemv {gemv!r} takes at most {REDUCE_ROWS} rows of x, got {m}")
    small = m <= 64  # decode: more, narrower column tiles to spread the weight over SMs
    is_gemv = m <= GEMV_ROWS
    block_m = block_size(m, 64) if block_m is None else block_m
    block_n = block_size(n, 64 if small and not is_gemv else 128) if block_n is None else block_n
    if block_k is None:
        block_k = ((REDUCE_BLOCK_K if m <= 2 else REDUCE_BLOCK_K_WIDE) if gemv != "dot" else
                   block_size(k, 128 if small else 64))
        block_k = block_k if group is None else min(block_k, group)
    num_stages = (GEMV_STAGES if is_gemv else 2) if num_stages is None else num_stages
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        check(fn, isinstance(b, int) and is_power_of_2(b) and b >= MIN_DOT,
              f"{name} must be a power of two >= {MIN_DOT}, got {b}")
    check(fn, group is None or group % block_k == 0,
          f"block_k must divide the group size {group}, got {block_k}")
    k_blocks = cdiv(k, block_k)
    if splits is None:
        splits = default_splits(m, n, k_blocks, block_n,
                                TARGET_PROGRAMS if gemv == "dot" else REDUCE_TARGET_PROGRAMS)
    check(fn, isinstance(splits, int) and 1 <= splits <= k_blocks,
          f"splits must be in [1, cdiv(in_features, block_k) = {k_blocks}], got {splits}")
    return _qmm_call(x, w_q, scales, block_m=block_m, block_n=block_n, block_k=block_k,
                     splits=splits, group_size=group, impl=impl, num_warps=num_warps,
                     num_stages=num_stages, gemv=gemv)


def quantized_matmul_reference(x: jax.Array, w_q: jax.Array, scales: jax.Array) -> jax.Array:
    """Plain-jnp `quantized_matmul`: dequantise the whole weight to f32 (group scales
    broadcast back over in_features), then x.astype(f32) @ w in f32 (HIGHEST precision).

    Same arguments, shapes, dtypes and ValueErrors as `quantized_matmul`; returns
    [M, out_features] in x.dtype.
    """
    group = check_qmm_operands("quantized_matmul_reference", x, w_q, scales)
    k, n = w_q.shape
    f = quant_format_of(w_q.dtype)
    if group is None:
        w = f.dequantize(w_q, scales[None, :])
    else:
        w = f.dequantize(w_q.reshape(k // group, group, n), scales[:, None, :]).reshape(k, n)
    out = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def quantized_matmul_xla(x: jax.Array, w_q: jax.Array, scales: jax.Array) -> jax.Array:
    """`quantized_matmul` as XLA compiles it with no Pallas kernel (KernelConfig.matmul_impl
    "xla"): per-channel scales -> x @ w_q.astype(x.dtype) with f32 accumulation, times the
    scales, so the widening of the weight is an operand of the dot that XLA:GPU fuses into
    its GEMM (the weight read from HBM at 1 byte per element; `tools/bench_quantized_matmul`
    measures it against the kernels). The products are exact (int8 and e4m3 values are
    bf16 / f16 / f32 values) and the scale multiplies the f32 sum, not each product;
    f32 x uses Precision.HIGHEST (IEEE f32 products, no TF32). Group scales: the
    plain-jnp reference (a [M, K / g, N] f32 intermediate of per-group sums would grow
    with M).

    Same arguments, shapes, dtypes and ValueErrors as `quantized_matmul`; returns
    [M, out_features] in x.dtype.
    Source: W8A16 as XLA's own int8-weight GEMM fusion runs it (a convert feeding a dot).
    """
    group = check_qmm_operands("quantized_matmul_xla", x, w_q, scales)
    if group is not None:
        return quantized_matmul_reference(x, w_q, scales)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    out = jnp.dot(x, w_q.astype(x.dtype), precision=precision,
                  preferred_element_type=jnp.float32)  # [M, N] f32
    return (out * scales[None, :]).astype(x.dtype)


__all__ = ["quantize_weights", "quantized_matmul", "quantized_matmul_reference",
           "quantized_matmul_xla"]
