"""What the Pallas kernels share, written once: block-size choice, the Triton compiler
params, masking, the online-softmax step, the log-sum-exp merge of split-K partials, the
GEMV kernels' row stores,
quantised formats (int8, fp8 e4m3); the input checks every kernel package shares are
`jaxserve.kernels.common`' (re-exported here).

The kernels target Pallas' Triton backend (GPU) and run unchanged with `interpret=True`
on CPU. Triton wants power-of-two block shapes and `plgpu.dot` operands of at least 16 on
every side; no scalar prefetch (block tables are ordinary inputs).

Sources: FlashAttention (Dao et al., 2022) for the online softmax; Flash-Decoding (Dao et
al., 2023) for split-K with a log-sum-exp merge; JAX's `pallas.ops.gpu` kernels for the
Triton-backend idioms.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.kernels.common import (FLOAT_DTYPES, INT8_SCALE_BYTES, MASK_VALUE,  # noqa: F401
                                     cdiv, check, check_array, check_page_pool,
                                     finish_softmax, softmax_block)

# The smallest side Triton's tensor-core dot accepts.
MIN_DOT = 16

IMPLS = ("pallas", "pallas_interpret")
# Note for tests: in interpret mode Pallas fills every output buffer with NaN (int: its
# minimum) before the kernel runs, and pads partial input blocks the same way, so an
# element a kernel forgets to write, or an unmasked out-of-bounds read, shows up.


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def block_size(n: int, max_block: int, min_block: int = MIN_DOT) -> int:
    """A power-of-two block for a dimension of n elements: the smallest power of two
    covering n, clamped to [min_block, max_block] (both powers of two).
    Raises ValueError if a bound is not a power of two or min_block > max_block."""
    for name, v in (("max_block", max_block), ("min_block", min_block)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if min_block > max_block:
        raise ValueError(f"min_block {min_block} > max_block {max_block}")
    return max(min_block, min(max_block, next_power_of_2(n)))


def is_power_of_2(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return n >= 1 and not n & (n - 1)


def triton_call_params(impl: str, *, num_warps: int = 4, num_stages: int = 2) -> dict[str, Any]:
    """The `pl.pallas_call` keyword arguments that pick the backend: the Triton compiler
    params always (without them Pallas now defaults to Mosaic GPU), and `interpret=True`
    for "pallas_interpret" (CPU). Raises ValueError for any other `impl`."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                interpret=impl == "pallas_interpret")


# ----------------------------------------------------------------------------- in-kernel math
# These operate on values (not refs) and lower both to Triton and in interpret mode.

def online_softmax_step(acc: jax.Array, m: jax.Array, l: jax.Array, scores: jax.Array,
                        v: jax.Array, precision: Any = None, v_scale: jax.Array | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of the online softmax (FlashAttention, Alg. 1) inside a kernel.

    acc: [M, D] f32 running sum of p @ v (unnormalised); m: [M] f32 running max;
    l: [M] f32 running sum of p; scores: [M, N] f32, already scaled and masked with
    MASK_VALUE; v: [N, D] (any float dtype; p is cast to it for the dot, f32 accumulate).
    precision: the p @ v dot's (`plgpu.dot`; the kernel's q @ k precision, so an f32
    kernel is f32 in both products: None would be TF32 on the GPU).
    v_scale: [N] f32 or None: v's rows are v * v_scale (int8 rows' scales), computed as
    (p * v_scale) @ v, so v's integers enter the dot exactly; l sums the unscaled p.
    Returns the updated (acc, m, l). The statistics: jaxserve.kernels.common.softmax_block.
    """
    p, correction, m_new, l_new = softmax_block(m, l, scores)
    pw = p if v_scale is None else p * v_scale[None, :]
    pv = plgpu.dot(pw.astype(v.dtype), v, precision=precision)  # [M, D]; M, N, D >= MIN_DOT
    return acc * correction[:, None] + pv.astype(jnp.float32), m_new, l_new


def load_kv(ref, idx, ok, dtype):
    """Gather K or V rows of a page pool and convert them to `dtype` (exact for int8 /
    e4m3 into f32 / bf16 / f16). idx: integer indexers (rows, head, columns) giving
    [block_kv, head_dim]; ok: [block_kv, 1] bool or None (all rows valid); rows not ok read
    as 0 (a select after the cast: Triton cannot splat a fill into fp8)."""
    if ref.dtype == dtype:
        return plgpu.load(ref.at[idx], mask=ok, other=None if ok is None else 0)
    x = plgpu.load(ref.at[idx], mask=ok).astype(dtype)
    return x if ok is None else jnp.where(ok, x, 0)


def load_row_scales(ref, row: jax.Array, h: Any, head_dim: int, ok: jax.Array | None
                    ) -> jax.Array:
    """[block_kv] f32: the scales of an int8 pool's rows (jaxserve.kernels.common.INT8_KV:
    a row is head_dim int8 values, then the scale's INT8_SCALE_BYTES little-endian f32
    bytes) `row` [block_kv] int32 of KV head h, the bytes assembled into the f32's bits;
    rows not ok (ok: [block_kv] bool or None) give 0."""
    bits = jnp.zeros(row.shape, jnp.int32)
    for j in range(INT8_SCALE_BYTES):
        byte = plgpu.load(ref.at[row, h, head_dim + j], mask=ok)  # [block_kv] int8
        bits = bits | ((byte.astype(jnp.int32) & 0xFF) << (8 * j))
    scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return scale if ok is None else jnp.where(ok, scale, 0.0)


def store_gemv_rows(o_ref, rows: Sequence[jax.Array], j, sp, block_n: int,
                    col_ok: jax.Array) -> None:
    """The GEMV kernels' epilogue: row r of `rows` ([block_n] f32 each, the M rows of one
    program's output columns j * block_n ..) into o_ref [M, N] (cast to its dtype), or
    into split `sp` of o_ref [splits, M, N] f32 (split-K partials), masked to col_ok."""
    split_k = len(o_ref.shape) == 3
    for r, row in enumerate(rows):
        tile = (pl.ds(r, 1), pl.ds(j * block_n, block_n))
        plgpu.store(o_ref.at[(sp,) + tile if split_k else tile],
                    row[None, :].astype(o_ref.dtype), mask=col_ok[None, :])


def causal_visible(q_pos: jax.Array, k_pos: jax.Array, kv_len: jax.Array) -> jax.Array:
    """[M, N] bool: key k is visible to query q iff k_pos <= q_pos and k_pos < kv_len.
    q_pos: [M] int32 absolute positions; k_pos: [N] int32; kv_len: scalar int32."""
    return (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)


# ----------------------------------------------------------------------------- outside kernels

def merge_partials(out: jax.Array, lse: jax.Array, axis: int = 0) -> jax.Array:
    """Merge split-K partial attention outputs with their log-sum-exps (Flash-Decoding).

    out: [..., S, ..., D] f32 normalised partial outputs along `axis` (S splits);
    lse: the same shape without D, f32 (MASK_VALUE for a split that saw no key).
    Returns the merged output, `axis` removed, f32. If every split is empty the result
    is 0 (their outputs are 0).
    """
    lse_max = lse.max(axis=axis, keepdims=True)
    w = jnp.exp(lse - lse_max)  # [.., S, ..]; a split at MASK_VALUE weighs exp(-huge) = 0
    total = w.sum(axis=axis, keepdims=True)
    return (out * (w / total)[..., None]).sum(axis=axis)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """A quantised storage format: values stored as `dtype`, real value = stored * scale,
    scale = amax / max_value over the scaling group."""

    name: str
    dtype: Any
    max_value: float

    def quantize(self, x: jax.Array, reduce_axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
        """(stored, scale) of x with one f32 scale per slice over `reduce_axes`
        (the scale keeps those axes as size 1). A slice of zeros gets scale 1."""
        amax = jnp.abs(x.astype(jnp.float32)).max(axis=tuple(reduce_axes), keepdims=True)
        scale = jnp.where(amax > 0, amax / self.max_value, 1.0)
        y = x.astype(jnp.float32) / scale
        if jnp.issubdtype(self.dtype, jnp.integer):
            y = jnp.round(y)
        return jnp.clip(y, -self.max_value, self.max_value).astype(self.dtype), scale

    def dequantize(self, stored: jax.Array, scale: jax.Array) -> jax.Array:
        """f32 stored * scale (scale broadcast against stored)."""
        return stored.astype(jnp.float32) * scale


INT8 = QuantFormat("int8", jnp.int8, 127.0)
FP8_E4M3 = QuantFormat("fp8_e4m3", jnp.float8_e4m3fn, 448.0)
QUANT_FORMATS = {f.name: f for f in (INT8, FP8_E4M3)}


def quant_format_of(dtype: Any) -> QuantFormat | None:
    """The QuantFormat stored as `dtype`, or None for a float dtype (f32/bf16/f16)."""
    for f in QUANT_FORMATS.values():
        if jnp.dtype(dtype) == jnp.dtype(f.dtype):
            return f
    return None


__all__ = [
    "FLOAT_DTYPES", "FP8_E4M3", "IMPLS", "INT8", "MASK_VALUE", "MIN_DOT", "QUANT_FORMATS",
    "QuantFormat", "block_size", "causal_visible", "cdiv", "check", "check_array",
    "check_page_pool",
    "finish_softmax", "is_power_of_2", "load_kv", "load_row_scales", "merge_partials",
    "next_power_of_2", "online_softmax_step", "quant_format_of", "triton_call_params",
]

