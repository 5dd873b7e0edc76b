"""What the model's XLA code, the Pallas kernels and the C++ CPU kernels share: the one
module every kernel package may import (imports point host engine -> device model / KV ->
kernels -> jaxserve.kernels.common; nothing here imports jaxserve or a kernel package).

- input checks whose ValueErrors name the function, the argument and the limit;
- the flat ragged batch: which sequence owns each token row (`query_sequence`);
- the KV pool's storage: a bfloat16 pool held as its uint16 bits (`BF16_BITS`), an fp8
  e4m3fn pool as its uint8 bits (`FP8_BITS`), read through `kv_values` (a bitcast, no
  copy); an int8 pool's rows (`INT8_KV`: a head's values and their scale in one row,
  `quantize_kv_int8`, `kv_rows_f32`);
- the online softmax's statistics (`softmax_block`, `finish_softmax`), written once for the
  Pallas kernels and the model's XLA attention.

Source of the online softmax: FlashAttention (Dao et al., 2022), Algorithm 1.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# A KV pool of this storage dtype holds bfloat16 values as their bits: XLA:CPU updates a
# uint16 array in place, where it float-normalises a bfloat16 one (jaxserve.model.kv_cache).
BF16_BITS = jnp.dtype(jnp.uint16)
# ... and of this one, fp8 e4m3fn values (vLLM's --kv-cache-dtype fp8): as bf16's, a narrow
# float dynamic-update-slice is float-normalised on XLA:CPU, uint8 is updated in place.
FP8_BITS = jnp.dtype(jnp.uint8)
# storage dtype -> the values' dtype, for pools held as bits
KV_BITS_VALUES = {BF16_BITS: jnp.dtype(jnp.bfloat16), FP8_BITS: jnp.dtype(jnp.float8_e4m3fn)}
# The largest finite float8_e4m3fn: K/V are clipped to +-FP8_E4M3_MAX before the cast
# (e4m3fn has no infinity; XLA's convert would make an overflow NaN), as vLLM's
# scaled_fp8_quant clamps.
FP8_E4M3_MAX = 448.0
# ... and this one, int8 K/V with one f32 scale per (token, KV head) (--kv-cache-dtype int8):
# each row of the pool's last axis is the head's head_dim int8 values q followed by the 4
# bytes of their scale s (little-endian f32 bits, as every platform jaxserve runs on
# stores it), values q * s. One array per layer, as every other pool: tensor and pipeline
# parallel split it, write and read it as they do a float pool (its rows are head_dim +
# INT8_SCALE_BYTES wide, `kv_row_width`). Symmetric per-token scales as llama.cpp's q8_0
# K/V cache (a scale per 32 values there, per head here) and LMDeploy's int8 KV (per
# token and head); a scale per token, not per page, because a page is written a token at
# a time and a later token's larger values must not clip.
INT8_KV = jnp.dtype(jnp.int8)
INT8_SCALE_BYTES = 4
INT8_KV_MAX = 127
# The score of a masked key. Finite, so a row whose keys are all masked gives
# exp(MASK - MASK) = 1 rather than NaN; such a row's output is discarded (or merged with
# weight exp(-huge) = 0).
MASK_VALUE = -1e30


# ----------------------------------------------------------------------------- input checks

def check_array(fn: str, name: str, x: Any, shape: Sequence[int | None],
                dtypes: Sequence[Any] | None = None) -> None:
    """Raise ValueError("fn: name must be ...") unless x has len(shape) dims, each equal to
    the given size (None = any), and (if given) one of `dtypes`."""
    got = tuple(getattr(x, "shape", ()))
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        want = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"{fn}: {name} must have shape {want}, got {list(got)}")
    if dtypes is not None and jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        names = ", ".join(str(jnp.dtype(d)) for d in dtypes)
        raise ValueError(f"{fn}: {name} must be one of ({names}), got {jnp.dtype(x.dtype)}")


def check(fn: str, cond: bool, message: str) -> None:
    """Raise ValueError(f"{fn}: {message}") unless cond."""
    if not cond:
        raise ValueError(f"{fn}: {message}")


def layer_operand(fn: str, layer: Any) -> jax.Array:
    """The int32 scalar a C++ kernel reads a stacked operand [L, ...] at (a layer loop's
    weights or pool, read in place: jaxserve/kernels/cpu/stacked.h): `layer` checked, or 0
    when None (one layer's operand). Raises ValueError unless it is an int32 scalar."""
    if layer is None:
        return jnp.zeros((), jnp.int32)
    check_array(fn, "layer", layer, (), (jnp.int32,))
    return layer


def check_page_pool(fn: str, k_pages: Any, v_pages: Any, q_heads: int, head_dim: int,
                    dtypes: Sequence[Any]) -> tuple[int, int, int]:
    """Check one layer's K/V pool against the queries: k_pages [num_pages, page_size,
    kv_heads, head_dim] of one of `dtypes`, v_pages the same shape and dtype, every size
    >= 1 and q_heads a multiple of kv_heads. Returns (num_pages, page_size, kv_heads).
    Raises ValueError naming `fn`, the argument and the limit."""
    check_array(fn, "k_pages", k_pages, (None, None, None, head_dim), dtypes)
    check_array(fn, "v_pages", v_pages, k_pages.shape, (k_pages.dtype,))
    num_pages, page_size, kv_heads, _ = k_pages.shape
    check(fn, num_pages >= 1 and page_size >= 1 and kv_heads >= 1,
          f"k_pages must have num_pages, page_size, kv_heads >= 1, got {list(k_pages.shape)}")
    check(fn, q_heads % kv_heads == 0,
          f"q_heads must be a multiple of kv_heads, got q_heads {q_heads}, kv_heads {kv_heads}")
    return num_pages, page_size, kv_heads


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


# ----------------------------------------------------------------------------- ragged batch

def query_sequence(query_start: jax.Array, num_tokens: int) -> jax.Array:
    """[num_tokens] int32: the sequence each row of a flat ragged batch belongs to.

    query_start: [S + 1] int32, non-decreasing (sequence b owns rows query_start[b] :
    query_start[b + 1]); rows past query_start[S] get S, rows before query_start[0] -1, so
    neither matches a sequence."""
    rows = jnp.arange(num_tokens, dtype=query_start.dtype)
    return (jnp.searchsorted(query_start, rows, side="right") - 1).astype(jnp.int32)


# ----------------------------------------------------------------------------- KV storage

def kv_values(pages: jax.Array) -> jax.Array:
    """A pool array as its values: the bf16 view of a uint16 (bits) pool, the fp8 e4m3fn
    view of a uint8 one (a bitcast, no copy), any other pool unchanged (an int8 pool's
    values need their scales: `kv_rows_f32`). Same shape."""
    values = KV_BITS_VALUES.get(jnp.dtype(pages.dtype))
    if values is not None:
        return jax.lax.bitcast_convert_type(pages, values)
    return pages


def kv_row_width(dtype: Any, head_dim: int) -> int:
    """Elements in one (token, KV head) row of a pool stored as `dtype` (its storage
    dtype): head_dim, or head_dim + INT8_SCALE_BYTES for an int8 pool (values, then the
    scale's bytes)."""
    return head_dim + (INT8_SCALE_BYTES if jnp.dtype(dtype) == INT8_KV else 0)


def quantize_kv_int8(x: jax.Array) -> jax.Array:
    """K or V rows [..., head_dim] (any float dtype) as int8 pool rows [..., head_dim + 4]
    int8: q = round(x / s) (half to even) with s = max|x| / 127 over the row (f32; a row of
    zeros: s = 0, q = 0), then s's bytes. Every value is within s / 2 of q * s."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / INT8_KV_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe), -INT8_KV_MAX, INT8_KV_MAX).astype(INT8_KV)
    scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], INT8_KV)  # [..., 4]
    return jnp.concatenate([q, scale_bytes], axis=-1)


def kv_rows_f32(x: jax.Array) -> jax.Array:
    """Pool rows (any storage: f32, bf16 / fp8 bits, int8 with scales) as their values,
    f32 [..., head_dim]: an int8 row's q * s (one f32 product, as the C++ kernel computes
    it), the others widened exactly."""
    if jnp.dtype(x.dtype) == INT8_KV:
        scale = jax.lax.bitcast_convert_type(x[..., -INT8_SCALE_BYTES:], jnp.float32)
        return x[..., :-INT8_SCALE_BYTES].astype(jnp.float32) * scale[..., None]
    return kv_values(x).astype(jnp.float32)


# ----------------------------------------------------------------------------- online softmax
# Pure jnp on values: they lower to Triton inside the Pallas kernels and run as XLA ops.

def softmax_block(m: jax.Array, l: jax.Array, scores: jax.Array
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One block of the online softmax's statistics (FlashAttention, Alg. 1).

    m: [...] f32 running max; l: [...] f32 running sum of exp(score - m); scores: [..., N]
    f32, scaled, masked keys at MASK_VALUE. Returns (p [..., N] f32, correction [...] f32,
    m_new, l_new): the caller's running p @ v sum becomes acc * correction + p @ v."""
    m_new = jnp.maximum(m, scores.max(axis=-1))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(scores - m_new[..., None])
    return p, correction, m_new, l * correction + p.sum(axis=-1)


def finish_softmax(acc: jax.Array, m: jax.Array, l: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The normalised output acc / l ([..., D] f32) and its log-sum-exp m + log l ([...] f32)
    of an online softmax. A row that saw no visible key (l == 0) gives output 0 and
    lse MASK_VALUE, so a log-sum-exp merge of partials gives it zero weight."""
    empty = l == 0.0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, MASK_VALUE, m + jnp.log(jnp.where(empty, 1.0, l)))
    return out, lse
