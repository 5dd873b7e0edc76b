"""GGML block-quantised weights (Q4_0, Q4_1, Q8_0: GGUF files, and the GPTQ / AWQ /
compressed-tensors checkpoints jaxserve reads into the same blocks) times activations on
the GPU, the blocks unpacked in registers: x [M, K] f32/bf16/f16 times w [N, K] -> [M, N].

The weight stays in the fields of jaxserve.kernels.ggml_blocks, output-major as stored:
qs u8 [N, K / 32, 16] (two 4-bit quants a byte, a block's low nibbles its first 16
elements) or i8 [N, K / 32, 32] (Q8_0), d f16 [N, K / 32] block scales, m f16 [N, K / 32]
block minimums (Q4_1). It crosses HBM once at its own size (4.5 / 5 / 8.5 bits a weight):
the point at small M (decode), where the matmul is bandwidth bound.

Layout and blocking. As jaxserve.kernels.pallas.quantized_matmul: grid (cdiv(M, block_m),
cdiv(N, block_n), splits); a program owns an output tile [block_m, block_n] and walks its
split's range of K in steps of block_k inputs (a multiple of 32: whole blocks). Each step
loads x [block_m, block_k] and gathers the weight tile [block_n, block_k] element by
element from the fields (input i of row n: block i // 32; Q4: byte (i // 32) * 16 + i % 16
of the row, its low nibble for i % 32 < 16, else its high one; each byte is read for both
of its nibbles, from cache the second time), the block's d (and m) beside it; the tile is
dequantised in f32 exactly as ggml does (q * d, Q4_0 (q - 8) * d, Q4_1 q * d + m), cast to
x's dtype for the tensor-core dot (bf16 / f16: each weight rounded once more, to x's
precision; f32 x: 3xTF32, about f32) and accumulated in f32. Split-K for M <= 64 (the
quantised matmul's `default_splits`), the f32 partials summed outside the kernel.

Sources: ggml's block formats and dequantize_row_q4_0 / _q4_1 / _q8_0
(ggml/src/ggml-quants.c); the tiled K loop and split-K of this package's quantized_matmul
(Triton's matmul tutorial); vLLM's GGUF kernels dequantise the same blocks in-kernel (its
csrc/quantization/gguf).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.kernels.ggml_blocks import BLOCK, dequantize_blocks
from jaxserve.kernels.pallas.common import (FLOAT_DTYPES, IMPLS, block_size, cdiv, check,
                                            check_array, is_power_of_2, store_gemv_rows,
                                            triton_call_params)
from jaxserve.kernels.pallas.quantized_matmul import (F32_DOT_PRECISION, REDUCE_ROWS,
                                                      REDUCE_TARGET_PROGRAMS, TARGET_PROGRAMS,
                                                      default_splits)

GGML_FORMATS = ("q4_0", "q4_1", "q8_0")
GGML_GEMV_MODES = ("dot", "reduce")


# ----------------------------------------------------------------------------- kernel body

def _ggml_kernel(x_ref, qs_ref, d_ref, m_ref, o_ref, *, fmt: str, m: int, k: int, n: int,
                 block_m: int, block_n: int, block_k: int, blocks_per_split: int,
                 f32_precision):
    """One [block_m, block_n] output tile over one split of K.

    x_ref: [M, K] x.dtype, whole; qs_ref: u8 [N, K / 2] (q4_0, q4_1: a row's blocks' 16
    bytes one after another) or i8 [N, K] (q8_0); d_ref, m_ref: f16 [N, K / 32] (m_ref
    None but for q4_1); o_ref: [M, N] x.dtype (one split) or [splits, M, N] f32 (split-K:
    this split's partial); the program writes its masked tile.
    """
    i, j, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    split_k = len(o_ref.shape) == 3
    rows = i * block_m + jnp.arange(block_m)  # [block_m] int32
    cols = j * block_n + jnp.arange(block_n)  # [block_n] int32 output features (weight rows)
    row_ok, col_ok = rows < m, cols < n
    precision = f32_precision if x_ref.dtype == jnp.float32 else None

    def body(kb, acc):  # acc: [block_m, block_n] f32
        ks = kb * block_k + jnp.arange(block_k)  # [block_k] int32 inputs
        k_ok = ks < k
        x = plgpu.load(x_ref.at[pl.ds(i * block_m, block_m), pl.ds(kb * block_k, block_k)],
                       mask=row_ok[:, None] & k_ok[None, :], other=0)  # [block_m, block_k]
        ok = col_ok[:, None] & k_ok[None, :]  # [block_n, block_k]
        n_idx, blk = cols[:, None], (ks // BLOCK)[None, :]
        d = plgpu.load(d_ref.at[n_idx, blk], mask=ok).astype(jnp.float32)
        if fmt == "q8_0":
            q = plgpu.load(qs_ref.at[n_idx, ks[None, :]], mask=ok).astype(jnp.float32)
            w = q * d
        else:
            pos = ks % BLOCK  # [block_k] the input's place in its block
            byte = plgpu.load(qs_ref.at[n_idx, (blk * (BLOCK // 2) + pos[None, :] % (BLOCK // 2))],
                              mask=ok).astype(jnp.int32)  # [block_n, block_k] 0..255
            shift = jnp.where(pos < BLOCK // 2, 0, 4)[None, :]
            nib = (byte >> shift) & 15
            if fmt == "q4_0":
                w = (nib - 8).astype(jnp.float32) * d
            else:
                mins = plgpu.load(m_ref.at[n_idx, blk], mask=ok).astype(jnp.float32)
                w = nib.astype(jnp.float32) * d + mins
        w = jnp.where(ok, w, 0).astype(x.dtype)  # a select after the loads: no fill values
        return acc + plgpu.dot(x, w, trans_b=True, precision=precision)  # [block_m, block_n]

    first = sp * blocks_per_split
    acc = jax.lax.fori_loop(first, jnp.minimum(first + blocks_per_split, cdiv(k, block_k)), body,
                            jnp.zeros((block_m, block_n), jnp.float32))
    tile = (pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n))
    plgpu.store(o_ref.at[(sp,) + tile if split_k else tile], acc.astype(o_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


def _ggml_gemv_kernel(x_ref, qs_ref, d_ref, m_ref, o_ref, *, fmt: str, m: int, k: int, n: int,
                      block_n: int, block_k: int, blocks_per_split: int):
    """`_ggml_kernel` for M <= REDUCE_ROWS on the CUDA cores (gemv "reduce"): one
    program owns block_n output features of every row over one split of K. Each K step
    loads its blocks whole, as stored: the quants [block_n, blocks, 16 | 32] (a Q4 byte
    once, both nibbles), the scales d (and Q4_1's m) [block_n, blocks] once a block, and x
    as [blocks, 16 | 32] halves. A block's 32 products are summed in f32, then multiplied by
    its d once (Q4_1 adds m times the block's sum of x). x_ref: [M, K / 32, 32] x.dtype;
    qs_ref: as stored, [N, K / 32, 16] u8 or [N, K / 32, 32] i8; d_ref, m_ref: f16
    [N, K / 32]; o_ref as `_ggml_kernel`'s (grid (1, N tiles, splits))."""
    j, sp = pl.program_id(1), pl.program_id(2)
    nb = block_k // BLOCK  # blocks a K step
    cols = j * block_n + jnp.arange(block_n)  # [block_n] int32 output features
    col_ok = cols < n
    num_blocks = k // BLOCK

    def body(kb, accs):  # accs: m x [block_n, nb] f32, each block's scaled sums
        blks = kb * nb + jnp.arange(nb)
        ok = col_ok[:, None] & (blks < num_blocks)[None, :]  # [block_n, nb]
        rows_blks = (pl.ds(j * block_n, block_n), pl.ds(kb * nb, nb))
        d = plgpu.load(d_ref.at[rows_blks], mask=ok).astype(jnp.float32)
        d = jnp.where(ok, d, 0)  # [block_n, nb] (no fill value for f16 loads)
        halves = [(0, BLOCK)] if fmt == "q8_0" else [(0, BLOCK // 2), (BLOCK // 2, BLOCK // 2)]
        if fmt == "q8_0":
            qs = plgpu.load(qs_ref.at[rows_blks + (pl.ds(0, BLOCK),)], mask=ok[:, :, None],
                            other=0)
            quants = [qs.astype(jnp.float32)]  # [block_n, nb, 32]
        else:
            qs = plgpu.load(qs_ref.at[rows_blks + (pl.ds(0, BLOCK // 2),)],
                            mask=ok[:, :, None], other=0).astype(jnp.int32)
            bias = 8 if fmt == "q4_0" else 0
            quants = [((qs & 15) - bias).astype(jnp.float32),  # the block's first 16
                      ((qs >> 4) - bias).astype(jnp.float32)]  # and its last 16
        mins = None
        if fmt == "q4_1":
            mins = jnp.where(ok, plgpu.load(m_ref.at[rows_blks], mask=ok).astype(jnp.float32), 0)
        out = []
        for r in range(m):
            dots, xsum = 0.0, 0.0
            for q, (start, size) in zip(quants, halves):
                xh = plgpu.load(x_ref.at[pl.ds(r, 1), pl.ds(kb * nb, nb), pl.ds(start, size)],
                                mask=(blks < num_blocks)[None, :, None], other=0)
                xh = xh[0].astype(jnp.float32)  # [nb, size]
                dots = dots + jnp.sum(q * xh[None], axis=2)  # [block_n, nb]
                if mins is not None:
                    xsum = xsum + jnp.sum(xh, axis=1)  # [nb]
            acc = accs[r] + dots * d
            if mins is not None:
                acc = acc + mins * xsum[None, :]
            out.append(acc)
        return tuple(out)

    first = sp * blocks_per_split
    accs = jax.lax.fori_loop(first, jnp.minimum(first + blocks_per_split, cdiv(k, block_k)),
                             body, tuple(jnp.zeros((block_n, nb), jnp.float32) for _ in range(m)))
    store_gemv_rows(o_ref, [jnp.sum(a, axis=1) for a in accs], j, sp, block_n, col_ok)


# ----------------------------------------------------------------------------- checks

def check_ggml_operands(fn: str, x, qs, d, m, fmt: str) -> None:
    """Validate a GGML matmul's operands (kernel and reference alike; ValueErrors name
    `fn`, the argument and the limit)."""
    check(fn, fmt in GGML_FORMATS, f"fmt must be one of {GGML_FORMATS}, got {fmt!r}")
    check_array(fn, "x", x, (None, None), FLOAT_DTYPES)
    rows, k = x.shape
    check(fn, rows >= 1 and k >= BLOCK and k % BLOCK == 0,
          f"x must have rows >= 1 and in_features a multiple of {BLOCK}, got {list(x.shape)}")
    q8 = fmt == "q8_0"
    check_array(fn, "qs", qs, (None, k // BLOCK, BLOCK if q8 else BLOCK // 2),
                (jnp.int8,) if q8 else (jnp.uint8,))
    n = qs.shape[0]
    check(fn, n >= 1, f"qs must have out_features >= 1, got {list(qs.shape)}")
    check_array(fn, "d", d, (n, k // BLOCK), (jnp.float16,))
    if fmt == "q4_1":
        check(fn, m is not None, "m [out_features, in_features / 32] f16 is required for q4_1")
        check_array(fn, "m", m, (n, k // BLOCK), (jnp.float16,))
    else:
        check(fn, m is None, f"m must be None for {fmt}")


# ----------------------------------------------------------------------------- public API

@functools.partial(jax.jit, static_argnames=("fmt", "out_dtype", "block_m", "block_n", "block_k",
                                             "splits", "impl", "num_warps", "num_stages", "gemv"))
def ggml_matmul(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None, fmt: str, *,
                out_dtype: Any = None, block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None, splits: int | None = None, impl: str = "pallas",
                num_warps: int = 4, num_stages: int = 2, gemv: str = "dot") -> jax.Array:
    """x @ dequantise(w).T for a GGML block-quantised w, in one Pallas (Triton) kernel.

    x: [M, in_features] f32/bf16/f16 (in_features a multiple of 32); qs: u8 [out_features,
    in_features / 32, 16] (q4_0, q4_1) or i8 [.., 32] (q8_0); d: f16 [out_features,
    in_features / 32]; m: f16 like d for q4_1, else None; fmt: "q4_0", "q4_1" or "q8_0".
    Returns [M, out_features] in out_dtype (default x.dtype; f32 for logits): the sums in
    f32 over the weights as ggml
    dequantises them (f32; cast to x's dtype for the dot: bf16 / f16 x round each weight
    once more; f32 x: 3xTF32 on the GPU, a plain f32 dot in interpret mode).
    block_m / block_n: power-of-two tiles >= 16; block_k: a power of two >= 32 (whole
    blocks); defaults from the shapes, as quantized_matmul's. splits: split-K ranges
    (default `default_splits`: > 1 only for M <= 64). impl: "pallas" (GPU) or
    "pallas_interpret" (CPU). gemv: one of GGML_GEMV_MODES: "dot" (the tiled dot, any
    M) or, for M <= REDUCE_ROWS (quantized_matmul's), "reduce": each block's quants,
    scale and x halves loaded whole and summed in f32 on the CUDA cores, the scale
    applied once a block (IEEE f32 products; block_m is M; to be timed on a GPU).
    Raises ValueError for bad shapes, dtypes, fields, blocks, gemv or impl.
    Source: ggml's dequantize_row_* (ggml-quants.c) inside a weight-only quantised GEMM.
    """
    fn = "ggml_matmul"
    check(fn, impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")
    check_ggml_operands(fn, x, qs, d, m, fmt)
    rows, k = x.shape
    n = qs.shape[0]
    check(fn, gemv in GGML_GEMV_MODES, f"gemv must be one of {GGML_GEMV_MODES}, got {gemv!r}")
    check(fn, gemv == "dot" or rows <= REDUCE_ROWS,
          f"gemv {gemv!r} takes at most {REDUCE_ROWS} rows of x, got {rows}")
    small = rows <= 64
    block_m = block_size(rows, 64) if block_m is None else block_m
    block_n = block_size(n, 64 if small else 128) if block_n is None else block_n
    if block_k is None:  # the GEMV's registers grow with the rows and Q8_0's 32-byte
        # blocks: 3-4 rows and Q8_0 take 64 (tools/compile_triton: no spills)
        wide = gemv == "reduce" and (rows > 2 or fmt == "q8_0")
        block_k = block_size(k, 64 if wide else 128 if small else 64, BLOCK)
    for name, b, least in (("block_m", block_m, 16), ("block_n", block_n, 16),
                           ("block_k", block_k, BLOCK)):
        check(fn, isinstance(b, int) and is_power_of_2(b) and b >= least,
              f"{name} must be a power of two >= {least}, got {b}")
    k_blocks = cdiv(k, block_k)
    if splits is None:  # the GEMV's loads are not pipelined: more programs (as
        # quantized_matmul's GEMV)
        splits = default_splits(rows, n, k_blocks, block_n,
                                REDUCE_TARGET_PROGRAMS if gemv == "reduce" else TARGET_PROGRAMS)
    check(fn, isinstance(splits, int) and 1 <= splits <= k_blocks,
          f"splits must be in [1, cdiv(in_features, block_k) = {k_blocks}], got {splits}")
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if gemv == "reduce":
        block_m = rows
        kernel = functools.partial(_ggml_gemv_kernel, fmt=fmt, m=rows, k=k, n=n,
                                   block_n=block_n, block_k=block_k,
                                   blocks_per_split=cdiv(k_blocks, splits))
        operands = (x.reshape(rows, k // BLOCK, BLOCK), qs, d, m)  # free reshapes
    else:
        kernel = functools.partial(_ggml_kernel, fmt=fmt, m=rows, k=k, n=n, block_m=block_m,
                                   block_n=block_n, block_k=block_k,
                                   blocks_per_split=cdiv(k_blocks, splits),
                                   f32_precision=F32_DOT_PRECISION.get(impl))
        # the fields' rows as flat byte / value rows (free)
        operands = (x, qs.reshape(n, -1), d, m)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, n) if splits == 1 else (splits, rows, n),
                                       out_dtype if splits == 1 else jnp.float32),
        grid=(cdiv(rows, block_m), cdiv(n, block_n), splits),
        name="ggml_matmul",
        **triton_call_params(impl, num_warps=num_warps, num_stages=num_stages),
    )(*operands)
    return out if splits == 1 else out.sum(axis=0).astype(out_dtype)


def ggml_matmul_reference(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None,
                          fmt: str, *, out_dtype: Any = None) -> jax.Array:
    """Plain-jnp `ggml_matmul`: the whole weight dequantised as ggml does
    (jaxserve.kernels.ggml_blocks.dequantize_blocks, f32), then x.astype(f32) @ w.T in f32
    (HIGHEST precision). Same arguments, shapes, dtypes and ValueErrors; returns
    [M, out_features] in out_dtype (default x.dtype)."""
    check_ggml_operands("ggml_matmul_reference", x, qs, d, m, fmt)
    w = dequantize_blocks(qs, d, m, fmt)
    out = jnp.einsum("ri,oi->ro", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype if out_dtype is None else out_dtype)


__all__ = ["GGML_FORMATS", "ggml_matmul", "ggml_matmul_reference"]
