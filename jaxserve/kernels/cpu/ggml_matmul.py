"""GGML block-quantised weight matmul for XLA:CPU: the C++ kernel of ggml_matmul.cc behind
an FFI call, the panel packing it reads (the weight's own bytes, reordered once at load),
and two plain-jnp references.

y = x @ W^T with W [N, K] in GGUF's Q4_0 / Q4_1 / Q8_0 blocks (jaxserve.model.ggml_weight):
x is quantised per row and block of 32 inputs to int8 (llama.cpp's q8_0 / q8_1), each
block's product is an exact integer dot product (AVX512-VNNI vpdpbusd), scaled by the
weight's and x's block scales in f32. `ggml_matmul_q8_reference` does that arithmetic in
jnp; `jaxserve.model.ggml_weight.ggml_matmul_reference` multiplies the dequantised weights
by x unquantised (the error of x's quantisation between them: tests/test_cpu_kernel_ggml_matmul.py).

Packed layout (ggml_matmul.cc's header has it byte by byte): [N / 16, K / 32, B] u8, one
record of B bytes per panel of 16 output columns and block: their 16 f16 scales, Q4_1's 16
f16 minimums, then the quants interleaved so that 64 bytes hold 16 columns x 4 inputs.
B = 288 (Q4_0), 320 (Q4_1), 544 (Q8_0): the GGUF blocks' bytes exactly.

Sources: llama.cpp ggml-cpu quants.c (ggml_vec_dot_q4_0_q8_0, q4_1_q8_1, q8_0_q8_0,
quantize_row_q8_0 / q8_1) and repack.cpp (interleaved blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.kernels.common import check, check_array, layer_operand
from jaxserve.kernels.ggml_blocks import BLOCK, check_format, unpack_nibbles

TARGET = "jaxserve_ggml_matmul"
COLS = 16  # output columns per panel
FMT_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2}
RECORD_BYTES = {"q4_0": 288, "q4_1": 320, "q8_0": 544}
# the weights' quants offset to unsigned bytes, subtracted again through x's block sums
QUANT_OFFSET = {"q4_0": 8, "q4_1": 0, "q8_0": 128}


def can_pack(n: int) -> bool:
    """Whether a weight of `n` output rows can be packed: a multiple of 16."""
    return n % COLS == 0


def weight_quants(qs: jax.Array, fmt: str) -> jax.Array:
    """A GGML weight's quants (qs u8 [N, K / 32, 16] or i8 [N, K / 32, 32]) -> [N, K]
    int32, each as the kernel multiplies it (unsigned): the 4-bit nibble 0..15 (Q4_0,
    Q4_1), or the int8 quant + 128 (Q8_0)."""
    qs = jnp.asarray(qs)
    q = (qs.astype(jnp.int32) + 128) if fmt == "q8_0" else unpack_nibbles(qs).astype(jnp.int32)
    return q.reshape(q.shape[0], -1)


def pack(qs: jax.Array, d: jax.Array, m: jax.Array | None, fmt: str) -> jax.Array:
    """A GGML weight [N, K] (the fields of jaxserve.model.ggml_weight.GGMLWeight: qs, d f16
    [N, K / 32], m f16 [N, K / 32] for Q4_1 else None) -> the kernel's [N / 16, K / 32, B]
    u8 records (module docstring). Raises ValueError for an unknown fmt, or unless N is a
    multiple of 16."""
    check_format(fmt)
    N, KB = qs.shape[:2]
    check("ggml_matmul pack", can_pack(N), f"needs output rows a multiple of {COLS}, got {N}")
    P = N // COLS
    q = weight_quants(qs, fmt).astype(jnp.uint8).reshape(P, COLS, KB, BLOCK)
    q = q.transpose(0, 2, 1, 3)  # [P, KB, c, j]
    if fmt == "q8_0":  # quad i: inputs 4i .. 4i + 3 -> [P, KB, 8, c, 4]
        qs = q.reshape(P, KB, COLS, 8, 4).transpose(0, 1, 3, 2, 4)
    else:  # group g: inputs 8g + t (low nibble) and 8g + 4 + t (high) -> [P, KB, 4, c, 4]
        g = q.reshape(P, KB, COLS, 4, 2, 4)
        qs = (g[..., 0, :] | (g[..., 1, :] << 4)).transpose(0, 1, 3, 2, 4)
    scales = lambda a: jnp.asarray(a, jnp.float16).reshape(P, COLS, KB).transpose(0, 2, 1)  # noqa: E731
    fields = [jax.lax.bitcast_convert_type(scales(d), jnp.uint8).reshape(P, KB, 2 * COLS)]
    if fmt == "q4_1":
        fields.append(jax.lax.bitcast_convert_type(scales(m), jnp.uint8).reshape(P, KB, 2 * COLS))
    fields.append(qs.reshape(P, KB, -1))
    return jnp.concatenate(fields, axis=-1)


def packed_fields(data: jax.Array, ids: jax.Array, fmt: str
                  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Rows `ids` (int32 [T]) of a packed weight `data` [N / 16, K / 32, B] as the GGML
    fields `pack` took (qs [T, K / 32, 16 or 32], d f16 [T, K / 32], m or None): an
    embedding lookup over the packed table, undoing `pack` for those rows."""
    rec = jnp.take(data, ids // COLS, axis=0)  # [T, KB, B]
    c = (ids % COLS)[:, None, None]
    scale = lambda off: jax.lax.bitcast_convert_type(  # noqa: E731
        jnp.stack([jnp.take_along_axis(rec, off + 2 * c, -1),
                   jnp.take_along_axis(rec, off + 2 * c + 1, -1)], -1), jnp.float16)[..., 0]
    d = scale(0)
    m = scale(32) if fmt == "q4_1" else None
    head = 64 if fmt == "q4_1" else 32
    j = jnp.arange(BLOCK)
    if fmt == "q8_0":
        q = jnp.take_along_axis(rec, head + (j // 4) * 64 + c * 4 + j % 4, -1)  # [T, KB, 32]
        return jax.lax.bitcast_convert_type(q - jnp.uint8(128), jnp.int8), d, m
    byte = jnp.take_along_axis(rec, head + (j // 8) * 64 + c * 4 + j % 4, -1)
    nib = jnp.where(j % 8 < 4, byte & 15, byte >> 4)  # the quant of input j
    return nib[..., :16] | (nib[..., 16:] << 4), d, m  # GGML's order: j and j + 16 share a byte


def quantize_x(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [M, K] f32 -> (q int32 [M, K / 32, 32], d f32 [M, K / 32], s int32 [M, K / 32]):
    per block d = max|x| / 127, q = round(x / d) (ties away from zero), s = sum(q), as the
    kernel (llama.cpp's quantize_row_q8_0 / q8_1 reference)."""
    xb = x.reshape(x.shape[0], x.shape[1] // BLOCK, BLOCK)
    d = jnp.max(jnp.abs(xb), axis=-1) / 127.0
    inv = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0)
    v = xb * inv[..., None]
    q = (jnp.sign(v) * jnp.floor(jnp.abs(v) + 0.5)).astype(jnp.int32)
    return q, d, q.sum(-1)


def ggml_matmul_q8_reference(x: jax.Array, qs: jax.Array, d: jax.Array, m: jax.Array | None,
                             fmt: str) -> jax.Array:
    """Plain-jnp `ggml_matmul` (x [M, K] f32 times the GGML weight [N, K] of fields qs, d,
    m (as `pack` takes them), transposed -> [M, N] f32): x quantised as the kernel does,
    exact integer block sums, then per block d_w d_x sum + acc (and Q4_1's
    m_w d_x s_x + acc) in block order."""
    q, dx, sx = quantize_x(x)
    wq = weight_quants(qs, fmt).reshape(qs.shape[0], -1, BLOCK)  # [N, KB, 32]
    isum = jnp.einsum("mbj,nbj->mnb", q, wq, preferred_element_type=jnp.int32)
    isum = isum - QUANT_OFFSET[fmt] * sx[:, None, :]
    dw = jnp.asarray(d).astype(jnp.float32)  # [N, KB]
    terms = [(isum.astype(jnp.float32), dw[None] * dx[:, None, :])]  # [M, N, KB] each
    if fmt == "q4_1":  # [1, N, KB] x [M, 1, KB]
        terms.append((jnp.asarray(m).astype(jnp.float32)[None],
                      (dx * sx.astype(jnp.float32))[:, None, :]))

    def step(acc, b):
        for a, s in terms:
            acc = a[..., b] * s[..., b] + acc
        return acc, None
    acc, _ = jax.lax.scan(step, jnp.zeros(isum.shape[:2], jnp.float32),
                          jnp.arange(isum.shape[2]))
    return acc


@functools.partial(jax.jit, static_argnames=("fmt", "swiglu"))
def ggml_matmul(x: jax.Array, w_packed: jax.Array, fmt: str,
                layer: jax.Array | int | None = None, swiglu: bool = False) -> jax.Array:
    """x [M, K] f32 times a packed GGML weight [N / 16, K / 32, B] u8 (`pack`) of format
    `fmt` ("q4_0", "q4_1", "q8_0"), transposed -> [M, N] f32 (any M >= 0).

    layer: with a stack of packed weights w_packed [L, N / 16, K / 32, B] (a loop over
    layers), the int32 index of the one to use, traced or not: the kernel reads that
    layer's panels where they lie, where `w_packed[layer]` handed to the call is copied
    first (+36% over 30 layers in lax.scan: PERFORMANCE.md, "Against llama.cpp in its own
    formats"). swiglu: w holds gate | up with their 16-column panels alternating (gate's
    panel j, then up's: jaxserve.model.weight_layouts.fused_ggml_weight's interleaved
    layout, the columns of bf16_matmul.interleave_gate_up), and the result is silu(gate) *
    up [M, N / 2] f32, each pair of panels' epilogue (jaxserve/kernels/cpu/swiglu.h, as
    bf16_matmul's swiglu). Needs `jaxserve.kernels.cpu.build.load_library` called first. Raises
    ValueError for bad shapes, dtypes or an unknown fmt, naming the argument; a layer
    outside the stack fails the call (the kernel checks it: XLA's runtime error names it)."""
    fn = "cpu ggml_matmul"
    check(fn, fmt in FMT_IDS, f"fmt must be one of {sorted(FMT_IDS)}, got {fmt!r}")
    check_array(fn, "x", x, (None, None), (jnp.float32,))
    stack = () if layer is None else (None,)
    check_array(fn, "w_packed", w_packed,
                stack + (None, x.shape[1] // BLOCK, RECORD_BYTES[fmt]), (jnp.uint8,))
    check(fn, x.shape[1] % BLOCK == 0, f"x's columns must be whole blocks of {BLOCK}, got {x.shape[1]}")
    if swiglu:
        check(fn, w_packed.shape[-3] % 2 == 0,
              f"swiglu needs an even number of panels, got {w_packed.shape[-3]}")
    n = w_packed.shape[-3] * COLS // (2 if swiglu else 1)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, w_packed, layer_operand(fn, layer), fmt=FMT_IDS[fmt], swiglu=swiglu)


__all__ = ["COLS", "RECORD_BYTES", "can_pack", "ggml_matmul", "ggml_matmul_q8_reference",
           "pack", "packed_fields", "quantize_x", "weight_quants"]
