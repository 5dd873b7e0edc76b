"""What the Mosaic GPU (Hopper) kernels share: their impl names and the interpret mode that
runs them on CPU.

Pallas' Mosaic GPU backend lowers a kernel to TMA copies, wgmma and barriers for sm_90a;
its GPU interpret mode (`InterpretGPUParams`) runs the same kernel on CPU, simulating SMEM,
the TMA engine, barriers and wgmma, so the tests check a kernel's numbers without a GPU and
CUDA lowering checks its layouts (a layout Mosaic cannot lower fails at `.lower()`).
"""

from __future__ import annotations

# "pallas_mosaic": the Mosaic GPU kernel on a Hopper GPU; "pallas_mosaic_interpret": the
# same kernel in Mosaic GPU interpret mode on CPU (tests).
MOSAIC_IMPLS = ("pallas_mosaic", "pallas_mosaic_interpret")


def mosaic_interpret_params():
    """The `interpret=` value that runs a Mosaic GPU kernel on CPU. JAX 0.11 keeps the class
    in a private module (`jax._src.pallas.mosaic_gpu.interpret`), imported here only."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def compiler_params():
    """The `compiler_params=` of every Mosaic GPU kernel here: Lane lowering semantics (a
    thread's view of its registers, which `layout_cast` and `broadcasted_iota(layout=)`
    assume). JAX 0.10 defaults to it; JAX 0.11 turned Warpgroup lowering on by default
    (docs/pallas/CHANGELOG.md, "Released with JAX 0.11.0"), so it is asked for by name."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def with_layout(x, layout, interpret: bool):
    """`plgpu.layout_cast(x, layout)` in a kernel being lowered; x as it is in interpret mode
    (a register layout means nothing there, and the interpreter has no rule for the cast)."""
    if interpret:
        return x
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.layout_cast(x, layout)


def broadcasted_iota(dtype, shape, dimension: int, layout, interpret: bool):
    """`plgpu.broadcasted_iota(..., layout=layout)` in a kernel being lowered (Mosaic needs
    the register layout of an iota); `lax.broadcasted_iota` in interpret mode (no rule for
    the layout there)."""
    if interpret:
        from jax import lax
        return lax.broadcasted_iota(dtype, shape, dimension)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.broadcasted_iota(dtype, shape, dimension, layout=layout)


def swizzled(minor: int, itemsize: int, what: str = "SMEM tile"):
    """The (tiling, swizzle) transforms of an SMEM tile whose minor dimension is `minor`
    elements of `itemsize` bytes: the widest swizzle (<= 128 bytes) that divides a row, in
    (8, swizzle / itemsize) tiles, as wgmma's operands, TMA copies and conflict-free stores
    from registers want them (JAX's Mosaic GPU matmul and attention examples). Raises
    ValueError (Mosaic's, naming `what`) when no swizzle divides the row."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    swizzle = plgpu.find_swizzle(minor * itemsize * 8, what)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def matmul_transposed(a_smem, b_smem, interpret: bool):
    """a @ b^T with f32 accumulation, in a kernel: a_smem [64, K] and b_smem [N, K] 16-bit
    SMEM refs (wgmma's operands, 128-byte swizzled). Lowered: one wgmma reading b through
    a transposed view, `b_smem.transpose((1, 0))` (as JAX's FlashAttention-3 reads K; the
    same view the deprecated `plgpu.transpose_ref` returns); returns [64, N] f32 in the
    WGMMA layout. Interpret mode: the same product from registers (`lax.dot_general`, f32
    accumulation), since the interpreter's wgmma takes only sliced operands, not transposed
    ones; the transposed read itself is checked by CUDA lowering and the native tier."""
    import jax.numpy as jnp
    from jax import lax
    if interpret:
        return lax.dot_general(a_smem[...], b_smem[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC((a_smem.shape[0], b_smem.shape[0]), jnp.float32))


__all__ = ["MOSAIC_IMPLS", "broadcasted_iota", "compiler_params", "matmul_transposed",
           "mosaic_interpret_params", "swizzled", "with_layout"]
