"""GGML block-quantised weights (GGUF Q4_0, Q4_1, Q8_0) kept in their own blocks, and
their dequantisation, bit for bit as llama.cpp's.

A GGUF matrix of `out` rows by `in` columns is stored row by row (a row: one output
feature's weights over the inputs), each row cut into blocks of 32 consecutive inputs, in
the formats of jaxserve.kernels.ggml_blocks (its table: fields and element values);
products and sums in f32 (d and m widened from f16).

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

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu.ggml_matmul import COLS as PANEL_COLS
from jaxserve.kernels.cpu.ggml_matmul import can_pack, pack, packed_fields
from jaxserve.kernels.ggml_blocks import (BLOCK, FORMATS, check_format, dequantize_blocks,
                                          unpack_nibbles)
from jaxserve.pytree import pytree_dataclass

__all__ = ["BLOCK", "FORMATS", "GGUF_TYPES", "GGMLWeight", "block_fields", "check_format",
           "dequantize", "dequantize_rows", "from_gguf_bytes", "ggml_matmul_reference",
           "pack_for_cpu", "to_gguf_bytes", "unpack_nibbles"]
# GGUF tensor type names (gguf.GGMLQuantizationType) -> format
GGUF_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}


@pytree_dataclass(meta=("fmt", "logical_shape"))
class GGMLWeight:
    """One GGML block-quantised matrix [out, in] (module docstring for the layout).

    qs: u8 [out, in / 32, 16] (q4_0, q4_1: two 4-bit quants per byte) or i8
    [out, in / 32, 32] (q8_0); d: f16 [out, in / 32] block scales; m: f16 [out, in / 32]
    block minimums (q4_1), else None; fmt: "q4_0", "q4_1" or "q8_0". Or, `packed` for
    the C++ CPU kernel (`pack_for_cpu`): qs its panel records, d and m None.
    logical_shape: None, or the shape of the float weight the blocks stand for in the
    model's layout (jaxserve.model.params): a projection's [*in, *out] (its `out` rows are
    prod(*out), its `in` columns prod(*in)); an embedding's or LM head's [vocab, embed]
    (vocab-major, as stored). Under tensor parallelism a device's blocks are part of it.
    (Fields stacked [L, ...] over layers: jaxserve.model.layer_loop.)"""

    qs: Any
    d: Any
    m: Any = None
    fmt: str = "q4_1"
    logical_shape: tuple[int, ...] | None = None

    @property
    def packed(self) -> bool:
        """Whether qs holds the C++ kernel's panel records (jaxserve.kernels.cpu.ggml_matmul
        .pack: u8 [out / 16, in / 32, record bytes], d and m None) instead of the fields."""
        return self.d is None

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(out, in): the matrix these arrays hold."""
        rows = int(self.qs.shape[-3]) * (PANEL_COLS if self.packed else 1)
        return rows, int(self.qs.shape[-2]) * BLOCK

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape when given (as the other weight types' `shape`), else
        matrix_shape."""
        return self.logical_shape if self.logical_shape is not None else self.matrix_shape

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (the GGUF tensor's bytes)."""
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (self.qs, self.d, self.m)
                   if a is not None)


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


def block_fields(fmt: str) -> dict[str, tuple[int | None, str]]:
    """The arrays of a `fmt` weight: field -> (its last dim, or None for [out, in / 32]
    only; numpy dtype name). Raises ValueError for an unknown format."""
    check_format(fmt)
    fields = {"qs": (32, "int8") if fmt == "q8_0" else (16, "uint8"), "d": (None, "float16")}
    if fmt == "q4_1":
        fields["m"] = (None, "float16")
    return fields


def dequantize(w: GGMLWeight):
    """f32 [out, in]: each element as ggml's dequantize_row_* computes it (module
    docstring), bit for bit (jaxserve.kernels.ggml_blocks.dequantize_blocks)."""
    return dequantize_blocks(w.qs, w.d, w.m, w.fmt)


def dequantize_rows(w: GGMLWeight, ids):
    """f32 [T, in]: rows `ids` (int32 [T], each in 0..out-1) of `w` (packed or not),
    dequantised as `dequantize` does (bit for bit): an embedding lookup over a
    block-quantised table."""
    if w.packed:
        qs, d, m = packed_fields(w.qs, ids, w.fmt)
        return dequantize(GGMLWeight(qs=qs, d=d, m=m, fmt=w.fmt))
    take = lambda a: None if a is None else jnp.take(jnp.asarray(a), ids, axis=0)  # noqa: E731
    return dequantize(GGMLWeight(qs=take(w.qs), d=take(w.d), m=take(w.m), fmt=w.fmt))


def pack_for_cpu(w: GGMLWeight) -> GGMLWeight:
    """`w` with its fields packed into the C++ CPU kernel's panel records (the same bytes;
    jaxserve.kernels.cpu.ggml_matmul.pack), or `w` itself when its rows do not make whole
    16-row panels. Runs one jitted packing."""
    if w.packed or not can_pack(w.matrix_shape[0]):
        return w
    data = jax.jit(pack, static_argnums=3)(w.qs, w.d, w.m, w.fmt)
    return GGMLWeight(qs=data, d=None, m=None, fmt=w.fmt, logical_shape=w.logical_shape)


def ggml_matmul_reference(x2, w: GGMLWeight):
    """x2 [rows, in] (any float) times `w`'s matrix transposed -> [rows, out] f32: the
    weights dequantised (`dequantize`), then one f32 matmul at HIGHEST precision. The
    reference of the C++ kernel (jaxserve.kernels.cpu.ggml_matmul), which quantises x
    per block as llama.cpp does and so differs from it by that rounding."""
    return jnp.einsum("ri,oi->ro", jnp.asarray(x2).astype(jnp.float32), dequantize(w),
                      precision="highest", preferred_element_type=jnp.float32)
