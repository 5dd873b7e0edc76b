"""GGML block-quantised weights (GGUF Q4_0, Q4_1, Q8_0) kept in their own blocks, and
their dequantisation, bit for bit as llama.cpp's.

A GGUF matrix of `out` rows by `in` columns is stored row by row (a row: one output
feature's weights over the inputs), each row cut into blocks of 32 consecutive inputs:

| format | bytes per block | fields, in order         | element j (0..31) of the block |
|--------|-----------------|--------------------------|--------------------------------|
| Q4_0   | 18              | d f16, qs u8[16]         | (nibble_j - 8) * d             |
| Q4_1   | 20              | d f16, m f16, qs u8[16]  | nibble_j * d + m               |
| Q8_0   | 34              | d f16, qs i8[32]         | qs[j] * d                      |

with nibble_j = qs[j] & 15 for j < 16 and qs[j - 16] >> 4 for j >= 16 (the low nibbles
hold the block's first half), products and sums in f32 (d and m widened from f16).

`GGMLWeight` keeps those fields as separate arrays, output-major as stored, so that one
output feature's blocks are contiguous (what a matrix-vector kernel streams):
qs u8 [out, in / 32, 16] (4-bit) or i8 [out, in / 32, 32] (Q8_0), d f16 [out, in / 32], m
f16 [out, in / 32] (Q4_1 only).

Source: ggml's block_q4_0 / block_q4_1 / block_q8_0 (ggml/src/ggml-common.h) and
dequantize_row_q4_0 / _q4_1 / _q8_0 (ggml/src/ggml-quants.c); gguf-py's port of them
(gguf/quants.py, Q4_0 / Q4_1 / Q8_0 `dequantize_blocks`), which the tests compare bit for
bit on the real model's tensors.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve.pytree import pytree_dataclass

BLOCK = 32  # inputs per block, every format here
# format -> (bytes per block, bytes of scale fields before the quants)
FORMATS = {"q4_0": (18, 2), "q4_1": (20, 4), "q8_0": (34, 2)}
# GGUF tensor type names (gguf.GGMLQuantizationType) -> format
GGUF_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}


@pytree_dataclass(meta=("fmt",))
class GGMLWeight:
    """One GGML block-quantised matrix [out, in] (module docstring for the layout).

    qs: u8 [out, in / 32, 16] (q4_0, q4_1: two 4-bit quants per byte) or i8
    [out, in / 32, 32] (q8_0); d: f16 [out, in / 32] block scales; m: f16 [out, in / 32]
    block minimums (q4_1), else None; fmt: "q4_0", "q4_1" or "q8_0"."""

    qs: Any
    d: Any
    m: Any = None
    fmt: str = "q4_1"

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in): the matrix the blocks hold."""
        return int(self.qs.shape[0]), int(self.qs.shape[1]) * BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (the GGUF tensor's bytes)."""
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (self.qs, self.d, self.m)
                   if a is not None)


def check_format(fmt: str) -> None:
    """Raises ValueError naming `fmt` and the formats there are."""
    if fmt not in FORMATS:
        raise ValueError(f"GGML block format must be one of {sorted(FORMATS)}, got {fmt!r}")


def from_gguf_bytes(raw: np.ndarray, fmt: str) -> GGMLWeight:
    """Split a GGUF tensor's bytes into a GGMLWeight of numpy arrays.

    raw: u8 [out, in / 32 * block bytes] (gguf.GGUFReader's `data` for a quantised tensor);
    fmt: "q4_0", "q4_1" or "q8_0". Raises ValueError for another format, or a row length
    that is not a whole number of blocks."""
    check_format(fmt)
    size, head = FORMATS[fmt]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"a {fmt} tensor's rows must be whole {size}-byte blocks, got bytes of "
                         f"shape {raw.shape}")
    blocks = raw.reshape(raw.shape[0], raw.shape[1] // size, size)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if fmt == "q4_1" else None
    qs = np.ascontiguousarray(blocks[..., head:])
    if fmt == "q8_0":
        qs = qs.view(np.int8)
    return GGMLWeight(qs=qs, d=d, m=m, fmt=fmt)


def to_gguf_bytes(w: GGMLWeight) -> np.ndarray:
    """The inverse of `from_gguf_bytes`: u8 [out, in / 32 * block bytes]."""
    check_format(w.fmt)
    fields = [np.asarray(w.d, np.float16)[..., None].view(np.uint8)]
    if w.fmt == "q4_1":
        fields.append(np.asarray(w.m, np.float16)[..., None].view(np.uint8))
    fields.append(np.asarray(w.qs).view(np.uint8))
    blocks = np.concatenate(fields, axis=-1)
    return blocks.reshape(blocks.shape[0], -1)


def unpack_nibbles(qs):
    """u8 [..., 16] -> u8 [..., 32]: each block's 32 4-bit quants, low nibbles first."""
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def dequantize(w: GGMLWeight):
    """f32 [out, in]: each element as ggml's dequantize_row_* computes it (module
    docstring), bit for bit: one f32 product, and for q4_1 one f32 sum after it (never a
    fused multiply-add: XLA:CPU does not contract them)."""
    check_format(w.fmt)
    d = jnp.asarray(w.d).astype(jnp.float32)[..., None]
    if w.fmt == "q8_0":
        x = jnp.asarray(w.qs).astype(jnp.float32) * d
    else:
        nib = unpack_nibbles(jnp.asarray(w.qs))
        if w.fmt == "q4_0":
            x = (nib.astype(jnp.int8) - 8).astype(jnp.float32) * d
        else:
            x = nib.astype(jnp.float32) * d + jnp.asarray(w.m).astype(jnp.float32)[..., None]
    return x.reshape(x.shape[0], -1)
