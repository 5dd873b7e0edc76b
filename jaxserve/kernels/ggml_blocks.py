"""GGML's block formats as the kernels and the model both need them: the block width, each
format's bytes, and the 4-bit quants' order in a block.

| format | bytes per block | fields, in order         | element j (0..31) of the block |
|--------|-----------------|--------------------------|--------------------------------|
| Q4_0   | 18              | d f16, qs u8[16]         | (nibble_j - 8) * d             |
| Q4_1   | 20              | d f16, m f16, qs u8[16]  | nibble_j * d + m               |
| Q8_0   | 34              | d f16, qs i8[32]         | qs[j] * d                      |

nibble_j = qs[j] & 15 for j < 16 and qs[j - 16] >> 4 for j >= 16 (the low nibbles hold
the block's first half). Source: ggml/src/ggml-common.h (block_q4_0, block_q4_1,
block_q8_0) and ggml-quants.c's dequantize_row_*.
"""

from __future__ import annotations

import jax.numpy as jnp

BLOCK = 32  # inputs per block, every format here (jaxserve.config.model.BLOCK_SIZE)
# format -> (bytes per block, bytes of scale fields before the quants)
FORMATS = {"q4_0": (18, 2), "q4_1": (20, 4), "q8_0": (34, 2)}


def check_format(fmt: str) -> None:
    """Raises ValueError naming `fmt` and the formats there are."""
    if fmt not in FORMATS:
        raise ValueError(f"GGML block format must be one of {sorted(FORMATS)}, got {fmt!r}")


def unpack_nibbles(qs):
    """u8 [..., 16] -> u8 [..., 32]: each block's 32 4-bit quants, low nibbles first."""
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def dequantize_blocks(qs, d, m, fmt: str):
    """f32 [out, in]: the blocks' elements as ggml's dequantize_row_* computes them (the
    table above), bit for bit: one f32 product, and for q4_1 one f32 sum after it (never a
    fused multiply-add: XLA:CPU does not contract them).

    qs: u8 [out, in / 32, 16] (q4_0, q4_1) or i8 [out, in / 32, 32] (q8_0); d: f16
    [out, in / 32]; m: f16 [out, in / 32] for q4_1, else None. Raises ValueError for an
    unknown fmt."""
    check_format(fmt)
    d = jnp.asarray(d).astype(jnp.float32)[..., None]
    if fmt == "q8_0":
        x = jnp.asarray(qs).astype(jnp.float32) * d
    else:
        nib = unpack_nibbles(jnp.asarray(qs))
        if fmt == "q4_0":
            x = (nib.astype(jnp.int8) - 8).astype(jnp.float32) * d
        else:
            x = nib.astype(jnp.float32) * d + jnp.asarray(m).astype(jnp.float32)[..., None]
    return x.reshape(x.shape[0], -1)
