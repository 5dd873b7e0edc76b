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
    """The `interpret=` value that runs a Mosaic GPU kernel on CPU. JAX 0.10 keeps the class
    in a private module (`jax._src.pallas.mosaic_gpu.interpret`), imported here only."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def with_layout(x, layout, interpret: bool):
    """`plgpu.layout_cast(x, layout)` in a kernel being lowered; x as it is in interpret mode
    (a register layout means nothing there, and the interpreter has no rule for the cast)."""
    if interpret:
        return x
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.layout_cast(x, layout)


__all__ = ["MOSAIC_IMPLS", "mosaic_interpret_params", "with_layout"]
