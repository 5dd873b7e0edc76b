"""The one matmul helper the model uses for every projection and the LM head, whatever
the weight leaf holds: a float array, a `DualPrecisionWeight` (its f32 or bf16 copy by the
step's rows), a `QuantizedWeight` (int8 / fp8), a `GGMLWeight` (GGML blocks) or a
`FusedWeight` of several (jaxserve.model.weight_layouts makes them at load). `Matmul.dense`
contracts the leading `n_in` axes of the weight with the trailing ones of the activations;
with a QuantizedWeight it calls `jaxserve.kernels.pallas.quantized_matmul` ("pallas" /
"pallas_interpret", Triton; "pallas_gemv" / "pallas_gemv_interpret" with its CUDA-core GEMV
for a few rows), `quantized_matmul_mosaic` ("pallas_mosaic" /
"pallas_mosaic_interpret", Hopper) or the plain-jnp reference ("xla": dequantise, then an
f32 matmul).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import GEMV_KERNEL_IMPLS, KERNEL_IMPLS, MOSAIC_KERNEL_IMPLS
from jaxserve.kernels.cpu.bf16_matmul import bf16_matmul as cpu_bf16_matmul
from jaxserve.kernels.cpu.bf16_matmul import deinterleave_gate_up, packed_panel_width
from jaxserve.kernels.impl_table import lookup, pallas_impl
from jaxserve.lora.batched import lora_delta
from jaxserve.model.ggml_weight import GGMLWeight, ggml_matmul_reference
from jaxserve.model.weight_layouts import DualPrecisionWeight, FusedWeight, QuantizedWeight


# XLA:CPU runs a 1-row bf16 matmul several times slower than a 2-row one: pad to this many.
BF16_MIN_ROWS = 2


def bf16_matmul(x2: jax.Array, w: jax.Array, w_vocab_major: bool = False) -> jax.Array:
    """x2 [rows, in] (any float) times a bf16 weight -> [rows, out] f32, accumulated in f32.

    w: [in, out], or [out, in] when `w_vocab_major` (a tied LM head). Fewer than
    BF16_MIN_ROWS rows are zero-padded for the matmul (see DualPrecisionWeight)."""
    rows = x2.shape[0]
    xb = x2.astype(jnp.bfloat16)
    if rows < BF16_MIN_ROWS:
        xb = jnp.pad(xb, ((0, BF16_MIN_ROWS - rows), (0, 0)))
    spec = "ri,oi->ro" if w_vocab_major else "ri,io->ro"
    return jnp.einsum(spec, xb, w, preferred_element_type=jnp.float32)[:rows]


def rounds_x(w: Any, rows: int) -> bool:
    """Whether a matmul of `rows` rows by `w` rounds its x to bf16 (a packed bf16 copy in the
    C++ kernel with round_x from w.round_x_min_rows rows: `packed_bf16_matmul`)."""
    return (isinstance(w, DualPrecisionWeight) and w.packed and w.uses_bf16(rows)
            and w.w_copy.dtype == jnp.bfloat16 and w.round_x_min_rows is not None
            and rows >= w.round_x_min_rows)


def packed_bf16_matmul(x2: jax.Array, w: DualPrecisionWeight, swiglu: bool = False,
                       out_dtype: Any = jnp.float32) -> jax.Array:
    """x2 [rows, K] (any float) times a packed DualPrecisionWeight's copy -> [rows, N] f32 in
    the C++ CPU kernel: a bf16 copy's weights widened to f32, x and the arithmetic f32
    (any row count; from w.round_x_min_rows rows x rounded to bf16, bf16 dot products),
    or f32 panels (the f32 weight itself) in f32 FMAs. A rounded x is rounded here, where
    XLA fuses the rounding into the op that makes x (the kernel reads bf16 x in place).
    swiglu: w is gate | up interleaved (FusedWeight.interleaved) and the result silu(gate)
    * up [rows, N / 2], the kernel's epilogue, in out_dtype (f32, or bf16)."""
    round_x = rounds_x(w, x2.shape[0])
    return cpu_bf16_matmul(x2.astype(jnp.bfloat16 if round_x else jnp.float32), w.w_copy,
                           layer=getattr(w, "layer", None), swiglu=swiglu, out_dtype=out_dtype)


def _out_shape(logical: tuple[int, ...], cols: int) -> tuple[int, ...]:
    """The output dims of a packed weight whose kernel gave `cols` columns: its logical
    output dims, or one device's part of them under tensor parallelism (the logical
    shape is the whole weight's; the columns split over the first output axis)."""
    rest = math.prod(logical[1:])
    return logical if math.prod(logical) == cols else (cols // rest, *logical[1:])


class Matmul:
    """The projections' implementation, chosen once when the engine is built
    (KernelConfig.matmul_impl) and called by the model. The weight's leaf type says what
    it holds (a float array, a DualPrecisionWeight, a QuantizedWeight); the Matmul says
    which kernel a quantised weight runs in and whether the bf16 copies are packed for the
    C++ kernel (`packs_bf16`, at load). Subclasses are frozen dataclasses: hashable, equal
    by value. name: the matmul_impl it stands for."""

    name: str
    packs_bf16: bool = False

    def dense(self, x: jax.Array, w: Any, n_in: int, out_dtype: Any = None) -> jax.Array:
        """x [..., *in] contracted with w [*in, *out] -> [..., *out], in out_dtype (None:
        x.dtype; a packed bf16 copy's f32 result is cast to it once).

        w: a float array (a plain dot_general in x.dtype), a DualPrecisionWeight (its f32
        or bf16 copy by the number of rows of x, prod(x.shape[:-n_in]); a packed bf16 copy
        runs in the C++ CPU kernel, the only one that reads that layout; result in
        x.dtype), a QuantizedWeight (f32 accumulation, result in x.dtype, in this
        implementation's kernel: `_quantized`) or a GGMLWeight (its blocks [out, in]
        standing for w.logical_shape; result in x.dtype, by `_ggml`)."""
        lead, rows = x.shape[:x.ndim - n_in], math.prod(x.shape[:x.ndim - n_in])
        if isinstance(w, DualPrecisionWeight) and w.packed and w.uses_bf16(rows):
            y = packed_bf16_matmul(x.reshape(rows, -1), w)
            return y.reshape(*lead, *_out_shape(w.shape[n_in:], y.shape[-1])).astype(
                out_dtype or x.dtype)
        y = self._dense(x, w, n_in)
        return y if out_dtype is None else y.astype(out_dtype)

    def _dense(self, x: jax.Array, w: Any, n_in: int) -> jax.Array:
        """`dense`, in x.dtype, of any weight but a packed copy that these rows use."""
        if isinstance(w, DualPrecisionWeight):
            lead, rows = x.shape[:x.ndim - n_in], math.prod(x.shape[:x.ndim - n_in])
            wx = w.pick(rows)
            if wx.dtype == x.dtype:
                return jnp.tensordot(x, wx, axes=n_in)
            y = bf16_matmul(x.reshape(rows, -1), wx.reshape(math.prod(wx.shape[:n_in]), -1))
            return y.reshape(*lead, *wx.shape[n_in:]).astype(x.dtype)
        if isinstance(w, GGMLWeight):  # [out, in] blocks standing for [*in, *out]
            lead, rows = x.shape[:x.ndim - n_in], math.prod(x.shape[:x.ndim - n_in])
            y = self._ggml(x.reshape(rows, -1), w)
            return y.reshape(*lead, *_out_shape(w.shape[n_in:], y.shape[-1])).astype(x.dtype)
        if not isinstance(w, QuantizedWeight):
            return jnp.tensordot(x, w, axes=n_in)
        in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
        lead = x.shape[:x.ndim - n_in]
        x2 = x.reshape(-1, math.prod(in_shape))
        y = self._quantized(x2, w.w_q.reshape(x2.shape[1], -1), w.scales)
        return y.reshape(*lead, *out_shape)

    def project(self, x: jax.Array, ws: tuple, n_in: int = 1) -> tuple[jax.Array, ...]:
        """Each of `ws` (weights of the same input x) applied to x: a tuple of `dense`
        results. A FusedWeight in ws[0] (the rest None) runs as one matmul whose columns
        are split into its parts, reshaped to their output shapes: the same sums as
        separate matmuls."""
        if not isinstance(ws[0], FusedWeight):
            return tuple(self.dense(x, w, n_in) for w in ws)
        fused = ws[0]
        lead = x.shape[:x.ndim - n_in]
        sizes = [math.prod(s) for s in fused.out_shapes]
        y = self.dense(x, fused.w, n_in)  # [..., sum(sizes)]
        if fused.interleaved:  # w_gate | w_up laid out for the SwiGLU epilogue
            parts = deinterleave_gate_up(y, fused.interleaved)
        else:
            parts = jnp.split(y, list(itertools.accumulate(sizes))[:-1], axis=-1)
        return tuple(p.reshape(*lead, *s) for p, s in zip(parts, fused.out_shapes))

    def swiglu(self, x: jax.Array, w_gate: Any, w_up: Any, w_next: Any = None) -> jax.Array:
        """silu(x @ w_gate) * (x @ w_up): x [..., D] -> [..., F] in x.dtype, the hidden
        activation of a SwiGLU MLP (Shazeer 2020). w_gate | w_up fused for the C++
        kernel's epilogue (a FusedWeight with `interleaved`, over a packed bf16 copy or
        f32 panels that this many rows use, in panels of a multiple of 32 columns, or over
        packed GGML blocks) runs as one kernel call whose output is the activation
        (jaxserve.kernels.cpu.bf16_matmul or ggml_matmul, swiglu: silu in f32 from a
        polynomial exp), a bf16 copy's rounded there to bf16 when the matmul
        by `w_next` (the down projection) would round it to bf16 anyway (`rounds_x`):
        then in bf16, and that matmul reads it as it is; any other weights as `project`,
        then jax.nn.silu(gate) * up."""
        rows = math.prod(x.shape[:-1])
        w = w_gate.w if isinstance(w_gate, FusedWeight) and w_gate.interleaved else None
        if isinstance(w, GGMLWeight) and w.packed:  # alternating panels: ggml_matmul's
            from jaxserve.kernels.cpu.ggml_matmul import ggml_matmul
            h = ggml_matmul(x.reshape(rows, -1).astype(jnp.float32), w.qs, w.fmt,
                            layer=getattr(w, "layer", None), swiglu=True)
            return h.reshape(*x.shape[:-1], -1).astype(x.dtype)
        if (isinstance(w, DualPrecisionWeight) and w.packed and w.uses_bf16(rows)
                and packed_panel_width(w.w_copy) % (2 * w_gate.interleaved) == 0):
            out = jnp.bfloat16 if rounds_x(w_next, rows) else jnp.float32
            h = packed_bf16_matmul(x.reshape(rows, -1), w, swiglu=True, out_dtype=out)
            return h.reshape(*x.shape[:-1], -1).astype(x.dtype if out == jnp.float32 else out)
        gate, up = self.project(x, (w_gate, w_up))
        return jax.nn.silu(gate) * up

    def lm_head(self, hidden: jax.Array, embed: jax.Array, head: Any) -> jax.Array:
        """LM head: hidden [..., D] -> logits [..., vocab] f32. head: None (tied to `embed`
        [vocab, D]), an array [D, vocab], a DualPrecisionWeight, which picks its copy by
        the rows of hidden and is [vocab, D] when tied, [D, vocab] otherwise (a packed bf16
        copy runs in the C++ CPU kernel), or a GGMLWeight [vocab, D] (as a block-quantised
        `embed` is when tied: `_ggml`)."""
        vocab_major, packed = head is None, None
        rows = math.prod(hidden.shape[:-1])
        table = embed if head is None else head
        if isinstance(table, GGMLWeight):  # [vocab, D] blocks
            logits = self._ggml(hidden.reshape(rows, -1), table)
            return logits.reshape(*hidden.shape[:-1], -1)
        if isinstance(head, DualPrecisionWeight):
            packed = head if head.packed and head.uses_bf16(rows) else None
            head, vocab_major = head.pick(rows), head.vocab_major
        if packed is not None:  # the bf16 copy packed for the C++ CPU kernel
            logits = packed_bf16_matmul(hidden.reshape(rows, -1), packed)
            return logits.reshape(*hidden.shape[:-1], -1)
        if head is not None and head.dtype != hidden.dtype:  # the bf16 copy of a dual head
            logits = bf16_matmul(hidden.reshape(-1, hidden.shape[-1]), head, vocab_major)
            return logits.reshape(*hidden.shape[:-1], -1)
        if vocab_major:
            return jnp.einsum("...d,vd->...v", hidden, embed if head is None else head,
                              preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)

    def _ggml(self, x2: jax.Array, w: GGMLWeight) -> jax.Array:
        """x2 [M, in] times a GGML block-quantised w [out, in], transposed -> [M, out] f32:
        a packed w (CpuMatmul packs them at load) in the C++ kernel, the only one that
        reads that layout (x quantised per block to int8 as llama.cpp does); otherwise the
        plain-jnp reference (dequantise, f32 matmul)."""
        if w.packed:
            from jaxserve.kernels.cpu.ggml_matmul import ggml_matmul
            return ggml_matmul(x2.astype(jnp.float32), w.qs, w.fmt,
                               layer=getattr(w, "layer", None))
        return ggml_matmul_reference(x2, w)

    def lora_delta(self, x2: jax.Array, slots, row_slot: jax.Array) -> jax.Array:
        """Each row's LoRA adapter delta: x2 [T, in] times its slot's A then B of `slots`
        (a jaxserve.lora.batched.LoraSlots, stacked with a layer index inside a layer
        loop), row_slot [T] int32 -> [T, out] f32. Here the plain-jnp batched form
        (jaxserve.lora.batched.lora_delta: every slot, the row's kept)."""
        return lora_delta(x2, slots, row_slot)

    def _quantized(self, x2: jax.Array, w2: jax.Array, scales: jax.Array) -> jax.Array:
        """x2 [M, K] times a quantised w2 [K, N] with its scales -> [M, N] in x2.dtype."""
        raise ValueError(f"quantised weights need a matmul impl of "
                         f"{KERNEL_IMPLS + MOSAIC_KERNEL_IMPLS + GEMV_KERNEL_IMPLS}, "
                         f"got {self.name!r}")


@dataclasses.dataclass(frozen=True)
class XlaMatmul(Matmul):
    """XLA's dot; quantised weights as a dot of their widened values
    (jaxserve.kernels.pallas.quantized_matmul.quantized_matmul_xla: XLA:GPU reads the
    1-byte weight inside its GEMM)."""

    name = "xla"

    def _quantized(self, x2, w2, scales):
        from jaxserve.kernels.pallas.quantized_matmul import quantized_matmul_xla
        return quantized_matmul_xla(x2, w2, scales)


@dataclasses.dataclass(frozen=True)
class CpuMatmul(Matmul):
    """Float weights packed at load for the C++ kernel of jaxserve/kernels/cpu/bf16_matmul:
    bf16 copies, or f32 panels of a float32 model's own weights (the packed leaves pick
    that kernel themselves); GGUF blocks packed for ggml_matmul; no quantised weights."""

    name = "cpu"
    packs_bf16 = True

    def lora_delta(self, x2, slots, row_slot):
        """Each row's own adapter only, in the C++ kernel (jaxserve.kernels.cpu.lora_matmul.
        lora_delta: the shrink x A and the expand (x A) B in one call, a row's slot read
        in place, a layer loop's stacked pools at its layer)."""
        from jaxserve.kernels.cpu.lora_matmul import lora_delta
        return lora_delta(x2.astype(jnp.float32), slots.a, slots.b, row_slot, slots.layer)


@dataclasses.dataclass(frozen=True)
class PallasMatmul(Matmul):
    """Quantised weights in the Pallas kernels of jaxserve/kernels/pallas: the Triton one
    (quantized_matmul) or, with `mosaic`, the Mosaic GPU one for Hopper
    (quantized_matmul_mosaic) wherever it takes the shapes and dtypes, the Triton one
    elsewhere (f32 activations, widths not a multiple of 64); GGML blocks (GGUF, GPTQ, AWQ,
    compressed-tensors) in the Triton ggml_matmul. interpret: in the backend's interpret
    mode, on CPU, for tests. gemv: the Triton kernels' CUDA-core GEMVs for matmuls of at
    most 4 rows (quantized_matmul's "reduce_magic", ggml_matmul's "reduce"), their tiled
    dot for more (not with mosaic)."""

    interpret: bool = False
    mosaic: bool = False
    gemv: bool = False

    @property
    def name(self) -> str:
        if self.gemv:
            return "pallas_gemv" + ("_interpret" if self.interpret else "")
        return pallas_impl(self.mosaic, self.interpret)

    def _gemv_mode(self, rows: int, mode: str) -> str:
        """The Triton kernel's `gemv` argument for a matmul of `rows` rows: `mode` (its
        CUDA-core GEMV) with `gemv` for at most REDUCE_ROWS rows, else "dot"."""
        from jaxserve.kernels.pallas.quantized_matmul import REDUCE_ROWS
        return mode if self.gemv and rows <= REDUCE_ROWS else "dot"

    def _ggml(self, x2, w):
        """GGML blocks (not packed for the CPU) in the Pallas (Triton) kernel
        jaxserve.kernels.pallas.ggml_matmul, unpacked in registers; f32 out."""
        if w.packed:
            return super()._ggml(x2, w)
        from jaxserve.kernels.pallas.ggml_matmul import ggml_matmul
        return ggml_matmul(x2, w.qs, w.d, w.m, w.fmt, out_dtype=jnp.float32,
                           impl=pallas_impl(False, self.interpret),
                           gemv=self._gemv_mode(x2.shape[0], "reduce"))

    def _quantized(self, x2, w2, scales):
        from jaxserve.kernels.pallas.quantized_matmul import quantized_matmul
        if self.mosaic:
            from jaxserve.kernels.pallas.quantized_matmul_mosaic import (mosaic_supports,
                                                                         quantized_matmul_mosaic)
            (k, n), group = w2.shape, None if scales.ndim == 1 else w2.shape[0] // scales.shape[0]
            if mosaic_supports(x2.dtype, w2.dtype, k, n, group):
                return quantized_matmul_mosaic(x2, w2, scales, impl=self.name)
        return quantized_matmul(x2, w2, scales, impl=pallas_impl(False, self.interpret),
                                gemv=self._gemv_mode(x2.shape[0], "reduce_magic"))


_MATMULS = {"xla": XlaMatmul(), "cpu": CpuMatmul(), "pallas": PallasMatmul(),
            "pallas_interpret": PallasMatmul(interpret=True),
            "pallas_mosaic": PallasMatmul(mosaic=True),
            "pallas_mosaic_interpret": PallasMatmul(interpret=True, mosaic=True),
            "pallas_gemv": PallasMatmul(gemv=True),
            "pallas_gemv_interpret": PallasMatmul(interpret=True, gemv=True)}


def matmul_backend(impl: "str | Matmul") -> Matmul:
    """The Matmul a matmul_impl name stands for ("xla", "cpu", "pallas",
    "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret", "pallas_gemv",
    "pallas_gemv_interpret"); a Matmul is returned
    as it is. Raises ValueError for an unknown name."""
    return lookup(_MATMULS, impl, Matmul, "matmul impl")


def dense(x: jax.Array, w: Any, n_in: int, impl: "str | Matmul" = "xla") -> jax.Array:
    """`matmul_backend(impl).dense(x, w, n_in)` (see Matmul.dense). Raises ValueError for an
    unknown impl."""
    return matmul_backend(impl).dense(x, w, n_in)
