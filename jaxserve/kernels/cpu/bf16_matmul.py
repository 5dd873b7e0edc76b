"""bf16-weight matmul for XLA:CPU: the C++ kernel of bf16_matmul.cc behind an FFI call, the
weight packing it reads, and its plain-jnp reference.

y = x @ W with W stored in bf16 (half the bytes of f32: decode is memory-bound) and x, the
products and the sums in f32: the kernel widens each bf16 weight to f32 in registers and
runs f32 FMAs. Weights are packed once at load into panels of P output columns with input
rows paired ([N / P, K / 2, P, 2]). XLA:CPU's own bf16 dot rounds x to bf16 too, is slow
for 1 row (a matrix-vector product several times slower than 2 rows) and reaches a
fraction of the machine's throughput at decode batch sizes.

The same kernel also multiplies f32 weights packed into panels ([N / P, K / 2, 2, P]:
each k pair's two rows of P columns, loaded as they lie) in its AVX2 register blocks on
every CPU with AVX2 and FMA (one path at every row count, so a row's result never depends
on the rows beside it: the tests' f32 engine needs that; XLA:CPU's f32 dot of an LM head
of a few rows took 3-7x the C++ kernel's time on an AMD Zen 3 VM).

Sources: oneDNN's VNNI-style pair packing; GotoBLAS panels.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.kernels.common import check, check_array, layer_operand

TARGET = "jaxserve_bf16_matmul"
BF16X_TARGET = "jaxserve_bf16_matmul_bf16x"  # round_x with x already bf16
F32_TARGET = "jaxserve_f32_matmul"  # f32 panels
LANES = 16  # f32 lanes of one AVX-512 register: panel widths are multiples of this
PANEL = 64  # preferred panel width (4 registers)
# swiglu: gate | up interleaved in groups of this many columns (the kernel's kSwigluGroup)
SWIGLU_GROUP = 16


def panel_width(n: int) -> int | None:
    """The panel width P used for `n` output columns: 64 if it divides n, else 16 if that
    does, else None (not packable: use the XLA path)."""
    for p in (PANEL, LANES):
        if n % p == 0:
            return p
    return None


def can_pack(k: int, n: int) -> bool:
    """Whether a [k, n] weight can be packed (k even, n a multiple of 16)."""
    return k % 2 == 0 and panel_width(n) is not None


def pack_weight(w: jax.Array, transposed: bool = False, panel: int | None = None,
                dtype=jnp.bfloat16) -> jax.Array:
    """Pack W [K, N] (or [N, K] when `transposed`, e.g. a tied LM head [vocab, embed]), any
    float dtype, into the kernel's layout: for `dtype` bfloat16, [N / P, K / 2, P, 2] bf16
    with element [n // P, k // 2, n % P, k % 2] = bf16(W[k, n]) (round to nearest even);
    for float32, f32 panels [N / P, K / 2, 2, P] with element [n // P, k // 2, k % 2, n % P]
    = W[k, n]. P = `panel` (a multiple of 16 dividing N; default panel_width(N): a split
    of the panels over devices may need a narrower one). Raises ValueError if K is odd
    or N not a multiple of 16, or of `panel`, or dtype is neither."""
    w = w.T if transposed else w
    check_array("pack_weight", "w", w, (None, None))
    K, N = w.shape
    check("pack_weight", can_pack(K, N),
          f"w [K, N] needs an even K and N a multiple of {LANES}, got [{K}, {N}]")
    P = panel or panel_width(N)
    check("pack_weight", P % LANES == 0 and N % P == 0,
          f"panel must be a multiple of {LANES} dividing N={N}, got {P}")
    check("pack_weight", jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)),
          f"dtype must be bfloat16 or float32, got {jnp.dtype(dtype)}")
    wb = w.astype(dtype).reshape(K // 2, 2, N // P, P)
    return wb.transpose(2, 0, 1, 3) if wb.dtype == jnp.float32 else wb.transpose(2, 0, 3, 1)


def unpack_weight(w_packed: jax.Array) -> jax.Array:
    """The W [K, N] a packed weight holds, in its dtype: [N / P, K / 2, P, 2] bf16 or
    [N / P, K / 2, 2, P] f32 panels (the inverse of pack_weight, up to the bf16
    rounding)."""
    if w_packed.dtype == jnp.float32:
        nb, k2, _, p = w_packed.shape
        return w_packed.transpose(1, 2, 0, 3).reshape(2 * k2, nb * p)
    nb, k2, p, _ = w_packed.shape
    return w_packed.transpose(1, 3, 0, 2).reshape(2 * k2, nb * p)


def interleave_gate_up(w: jax.Array, group: int = SWIGLU_GROUP, shards: int = 1) -> jax.Array:
    """gate | up [K, 2 F] (gate's F columns, then up's) with their columns interleaved in
    groups of `group`: column 2 g j + i is gate's column g j + i, 2 g j + g + i up's (j a
    group, i < g): the layout `bf16_matmul(..., swiglu=True)` reads, so that a panel of a
    multiple of 2 g columns holds the gate and up columns of the same outputs. shards: w
    is `shards` such blocks side by side ([K, shards * 2 F_s], a tensor-parallel split's
    gate | up per shard), each interleaved on its own. Raises ValueError when a shard's F
    is not a multiple of `group`."""
    K, N = w.shape
    check("interleave_gate_up", N % (2 * group * shards) == 0,
          f"w must be [K, {shards} x 2 F] with F a multiple of {group}, got [{K}, {N}]")
    blocks = w.reshape(K, shards, 2, N // (2 * group * shards), group)
    return blocks.transpose(0, 1, 3, 2, 4).reshape(K, N)


def deinterleave_gate_up(y: jax.Array, group: int = SWIGLU_GROUP) -> tuple[jax.Array, jax.Array]:
    """The (gate, up) columns [..., F] each of y [..., 2 F], the output of a weight laid out
    by `interleave_gate_up` (its inverse over the last axis)."""
    *lead, n = y.shape
    parts = y.reshape(*lead, n // (2 * group), 2, group)
    return (parts[..., 0, :].reshape(*lead, n // 2), parts[..., 1, :].reshape(*lead, n // 2))


def packed_panel_width(w_packed) -> int:
    """P of a packed weight (or a stack of them): its last axis for f32 panels."""
    return w_packed.shape[-1] if w_packed.dtype == jnp.float32 else w_packed.shape[-2]


def _check_operands(fn: str, x, w_packed, stacked: bool = False) -> None:
    check_array(fn, "x", x, (None, None), (jnp.float32, jnp.bfloat16))
    layout = ((None, x.shape[1] // 2, 2, None) if w_packed.dtype == jnp.float32
              else (None, x.shape[1] // 2, None, 2))
    check_array(fn, "w_packed", w_packed, (None,) * stacked + layout,
                (jnp.bfloat16, jnp.float32))
    check(fn, x.shape[1] % 2 == 0, f"x must have an even number of columns, got {x.shape[1]}")
    width = packed_panel_width(w_packed)
    check(fn, width % LANES == 0,
          f"w_packed's panel width must be a multiple of {LANES}, got {width}")


@functools.partial(jax.jit, static_argnames=("round_x", "swiglu", "out_dtype"))
def bf16_matmul(x: jax.Array, w_packed: jax.Array, round_x: bool = False,
                layer: jax.Array | int | None = None, swiglu: bool = False,
                out_dtype: Any = jnp.float32) -> jax.Array:
    """x [M, K] f32 (or bf16: below) times a packed bf16 weight [N / P, K / 2, P, 2] -> [M, N]
    f32: the weights widened to f32, products and sums in f32 (any M >= 0); or times f32
    panels [N / P, K / 2, 2, P] (pack_weight's float32 layout; not with round_x), each
    column summed k after k with one f32 FMA a k at every row count (AVX2 blocks for 1-2
    rows, AVX-512 ones from 3 where the CPU has them). round_x: x rounded to bf16 first
    (round to nearest even) and the products summed by the CPU's bf16 dot-product
    instructions, f32 accumulation: AMX tiles (TDPBF16PS, 16 x 16 outputs per instruction;
    jaxserve/kernels/cpu/amx.h) where the CPU has AMX-BF16 and Linux grants the process the
    tile state, else AVX512-BF16 vdpbf16ps (the portable build does the same arithmetic in
    f32): 2x (Zen 4's vdpbf16ps) to 5-11x (AMX) the f32 FMA rate where
    `bf16_dot_speedup()` says so, for compute-bound row counts. A bf16 x is round_x's
    rounded x given by the caller (round_x is then implied): the kernel reads it in place
    instead of rounding f32 x in a pass of its own before its threads start, and the
    producer of x (a norm, an activation) writes half the bytes; the same result as f32 x
    with round_x (to nearest even; both paths' dot instructions read a bf16 denormal as
    zero). Not with f32 panels. Within one path a row's
    result does not depend on the rows beside it. layer: with a stack of packed weights
    [L, N / P, K / 2, P, 2] (a loop over layers), the int32 index of the one to use, traced or not, read where it
    lies (a slice of the stack handed to the call would be copied first; see
    jaxserve.kernels.cpu.ggml_matmul.ggml_matmul). swiglu: w holds gate | up laid out by
    `interleave_gate_up` (panels of a multiple of 32 columns), and the result is
    silu(gate) * up [M, N / 2] f32 (SwiGLU's hidden activation; Shazeer 2020), computed as
    each panel's epilogue: the [M, N] product stays in each thread's L2. silu(g) = g *
    sigmoid(g) with the sigmoid from exp(-|g|) (a polynomial exp, relative error < 2e-7);
    a row's result still does not depend on the rows beside it. out_dtype: float32, or
    with swiglu bfloat16 (the activation rounded to nearest even in the epilogue: the x
    of a next matmul that rounds it anyway, round_x, written at half the bytes). Needs
    `jaxserve.kernels.cpu.build.load_library` called first. Raises ValueError for bad
    shapes or dtypes, naming the argument; a layer outside the stack fails the call (the
    kernel checks it)."""
    fn = "cpu bf16_matmul"
    _check_operands(fn, x, w_packed, stacked=layer is not None)
    width = packed_panel_width(w_packed)
    n = w_packed.shape[-4] * width
    if swiglu:
        check(fn, width % (2 * SWIGLU_GROUP) == 0,
              f"swiglu needs panels of a multiple of {2 * SWIGLU_GROUP} columns, got {width}")
    out_dtype = jnp.dtype(out_dtype)
    check(fn, out_dtype == jnp.float32 or (swiglu and out_dtype == jnp.bfloat16),
          f"out_dtype must be float32 (or bfloat16 with swiglu), got {out_dtype}")
    out = jax.ShapeDtypeStruct((x.shape[0], n // 2 if swiglu else n), out_dtype)
    if w_packed.dtype == jnp.float32:
        check(fn, not round_x and x.dtype == jnp.float32,
              "round_x rounds x for the bf16 dot: not with f32 panels (nor a bf16 x)")
        return jax.ffi.ffi_call(F32_TARGET, out)(x, w_packed, layer_operand(fn, layer),
                                                 swiglu=swiglu)
    if x.dtype == jnp.bfloat16:
        return jax.ffi.ffi_call(BF16X_TARGET, out)(x, w_packed, layer_operand(fn, layer),
                                                   swiglu=swiglu)
    return jax.ffi.ffi_call(TARGET, out)(x, w_packed, layer_operand(fn, layer), round_x=round_x,
                                         swiglu=swiglu)


def bf16_matmul_reference(x: jax.Array, w_packed: jax.Array, round_x: bool = False,
                          swiglu: bool = False) -> jax.Array:
    """Plain-jnp `bf16_matmul` (same arguments and result): unpack, widen to f32 (x rounded
    to bf16 first with round_x), then an f32 dot at HIGHEST precision (with swiglu,
    jax.nn.silu(gate) * up of its de-interleaved columns)."""
    _check_operands("bf16_matmul_reference", x, w_packed)
    if (round_x or x.dtype == jnp.bfloat16) and w_packed.dtype == jnp.float32:
        raise ValueError("bf16_matmul_reference: round_x (or a bf16 x) is not for f32 panels")
    if round_x or x.dtype == jnp.bfloat16:
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    y = jnp.dot(x, unpack_weight(w_packed).astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
    if not swiglu:
        return y
    gate, up = deinterleave_gate_up(y)
    return jax.nn.silu(gate) * up


def bf16_dot_speedup(library) -> float:
    """How many times the f32 FMA rate (in flops) this CPU runs the bf16 dot-product
    instruction of `round_x` at (AMX's TDPBF16PS where the process may use the tiles, else
    AVX512-BF16's vdpbf16ps), measured by the loaded kernel `library`
    (jaxserve.kernels.cpu.build.load_library's result) in a few ms of register-only loops
    (values seen: PERFORMANCE.md, "Measurements behind the code"); 0 without AVX512-BF16
    (or in a portable build)."""
    fn = library.jaxserve_bf16_dot_speedup
    fn.restype = ctypes.c_double
    return float(fn())


__all__ = ["LANES", "PANEL", "SWIGLU_GROUP", "bf16_dot_speedup", "bf16_matmul",
           "bf16_matmul_reference", "can_pack", "deinterleave_gate_up", "interleave_gate_up",
           "pack_weight", "packed_panel_width", "panel_width", "unpack_weight"]
