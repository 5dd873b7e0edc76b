"""Weight-only quantisation of the layers' projection matrices (int8 / fp8 e4m3), bf16
copies of f32 weights for large steps, and the one matmul helper the model uses for every
projection, float, dual-precision or quantised.

A `QuantizedWeight` keeps the stored values in the weight's own shape ([embed, heads,
head_dim], [mlp, embed], ...) and its scales as the kernel wants them, flattened to the
output features: [out_features] per channel, or [in_features // group, out_features] per
group. `dense` contracts the leading `n_in` axes of the weight with the trailing ones of
the activations; with a QuantizedWeight it calls `jaxserve.kernels.pallas.quantized_matmul`
("pallas" / "pallas_interpret", Triton), `quantized_matmul_mosaic` ("pallas_mosaic" /
"pallas_mosaic_interpret", Hopper) or the plain-jnp reference ("xla": dequantise, then an
f32 matmul). Embeddings, norms, biases and the LM head are never quantised.

Source: weight-only per-channel int8 (LLM.int8 / vLLM's W8A16), per-group int8 as in
GPTQ/AWQ's group scales, FP8 e4m3 per-channel as in vLLM's fp8 W8A16 path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import KERNEL_IMPLS, MOSAIC_KERNEL_IMPLS, ConfigError
from jaxserve.kernels.cpu.ggml_matmul import can_pack
from jaxserve.model.ggml_weight import GGMLWeight, ggml_matmul_reference, pack_for_cpu
from jaxserve.model.params import (EMBED_AXES, LAYER_AXES, LM_HEAD_AXES, PROJECTIONS,
                                   LayerParams, Params)
from jaxserve.kernels.impl_table import lookup, pallas_impl
from jaxserve.pytree import pytree_dataclass

# PROJECTIONS (jaxserve.model.params): the LayerParams fields that are projections, with
# how many leading axes are inputs; imported from here too.


@pytree_dataclass(meta=("fmt", "n_in"))
class QuantizedWeight:
    """w_q: the stored weight, its float shape [*in, *out], int8 or float8_e4m3fn;
    scales: f32 [prod(out)] or [prod(in) // group, prod(out)]; fmt: "int8" / "fp8_e4m3";
    n_in: how many leading axes of w_q are contracted."""

    w_q: Any
    scales: Any
    fmt: str = "int8"
    n_in: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w_q.shape)


def quantize_weight(w: jax.Array, n_in: int, fmt: str, group_size: int | None = None) -> QuantizedWeight:
    """Quantise one float weight [*in, *out] (first `n_in` axes contracted).

    fmt: "int8" or "fp8_e4m3"; group_size: None (per output channel) or, for int8, a power
    of two dividing prod(in). Raises ValueError (from `quantize_weights`) otherwise.
    """
    from jaxserve.kernels.pallas.quantized_matmul import quantize_weights

    k = math.prod(w.shape[:n_in])
    w_q, scales = quantize_weights(w.reshape(k, -1), fmt, group_size)
    return QuantizedWeight(w_q=w_q.reshape(w.shape), scales=scales, fmt=fmt, n_in=n_in)


def quantize_params(params: Params, fmt: str, group_size: int | None = None,
                    rules: Any = None) -> Params:
    """`params` with every float layer projection (PROJECTIONS) replaced by a
    QuantizedWeight; everything else (GGMLWeight projections too) unchanged. Runs one
    small jitted quantisation per weight, so peak memory stays near the float weights plus
    one quantised copy. rules: the ShardingRules
    of a tensor-parallel mesh (None: one device); each device's input rows of a row-split
    weight must hold whole groups. Raises ConfigError (a ValueError) when they do not."""
    quantize = jax.jit(quantize_weight, static_argnums=(1, 2, 3))
    if rules is not None and group_size is not None:
        for name, n_in in PROJECTIONS.items():
            w = getattr(params.layers[0], name)
            spec = tuple(rules.spec(LAYER_AXES[name], w.shape))
            shards = math.prod(rules.mesh.shape[a] for a in spec[:n_in] if a is not None)
            if (math.prod(w.shape[:n_in]) // shards) % group_size:
                raise ConfigError(f"KernelConfig.weight_quant_group_size={group_size} does not divide the "
                                 f"{math.prod(w.shape[:n_in]) // shards} input rows of {name} "
                                 f"each of {shards} devices holds")

    # one weight at a time, each finished before the next is dispatched: bounds memory,
    # and on simulated CPU devices many queued sharded programs with collectives
    # deadlocked XLA:CPU's rendezvous (threads of 2 cores all waiting in earlier ones)
    def layer(lp: LayerParams) -> LayerParams:
        return dataclasses.replace(lp, **{name: jax.block_until_ready(
                                              quantize(getattr(lp, name), n_in, fmt, group_size))
                                          for name, n_in in PROJECTIONS.items()
                                          if not isinstance(getattr(lp, name), GGMLWeight)})

    return dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers))


@pytree_dataclass(meta=("min_rows", "vocab_major", "logical_shape", "max_rows", "round_x_min_rows"))
class DualPrecisionWeight:
    """An f32 weight kept twice: `w_bf16` (the same values rounded to bf16) for matmuls over
    `min_rows` to `max_rows` rows of activations (None: no upper limit), and `w` (f32) for
    the others. A plain bf16 copy runs XLA's bf16 x bf16 dot (x rounded to bf16, f32
    accumulation); a packed one the C++ CPU kernel (weights widened to f32, x and the
    arithmetic f32).

    Why: on XLA:CPU (YNNPACK) a bf16 matmul with f32 accumulation can beat f32 from a few
    rows up, while a 1-row bf16 product takes a matrix-vector path slower than f32
    (PERFORMANCE.md, "Measurements behind the code"; `jaxserve bench step --compare
    matmul` measures both on a machine): the XLA bf16 path pads 1 row to 2 (BF16_MIN_ROWS). Which copy runs is fixed per compiled
    step shape (row counts are static). Costs 1.5x the weights' memory, or 0.5x with
    min_rows = 1 and no max_rows (then `w` is None: every matmul uses the bf16 copy).
    max_rows is for machines where f32 wins again at prefill sizes (PERFORMANCE.md, the same
    section).
    vocab_major: the LM head tied to the embedding, stored [vocab, embed].
    logical_shape: None, or the weight's [*in, *out] shape when `w_bf16` is packed for the
    C++ CPU kernel (jaxserve.kernels.cpu.bf16_matmul.pack_weight: [N / P, K / 2, P, 2], input rows
    K = prod(in), N = prod(out); a vocab-major head packs as [embed, vocab]).
    round_x_min_rows: None, or for a packed copy: matmuls over at least this many rows round
    x to bf16 and use the CPU's bf16 dot-product instruction (jaxserve.kernels.cpu.bf16_matmul's
    round_x).
    """

    w: Any
    w_bf16: Any
    min_rows: int = 16
    vocab_major: bool = False
    logical_shape: tuple[int, ...] | None = None
    max_rows: int | None = None
    round_x_min_rows: int | None = None

    @property
    def packed(self) -> bool:
        return self.logical_shape is not None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.logical_shape if self.packed else tuple(self.w_bf16.shape)

    def uses_bf16(self, rows: int) -> bool:
        """Whether a matmul over `rows` rows uses the bf16 copy."""
        return self.w is None or self.min_rows <= rows <= (self.max_rows or rows)

    def pick(self, rows: int) -> jax.Array:
        """The copy a matmul over `rows` rows uses."""
        return self.w_bf16 if self.uses_bf16(rows) else self.w


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


def dual_precision(w: jax.Array, min_rows: int, vocab_major: bool = False, n_in: int = 1,
                   packed: bool = False, max_rows: int | None = None,
                   round_x_min_rows: int | None = None,
                   split: tuple[int, int] = (1, 1)) -> DualPrecisionWeight:
    """`w` (f32) with its bf16 copy for matmuls over min_rows .. max_rows rows (only the
    copy when min_rows is 1 and max_rows None). packed: store the bf16 copy in the C++
    kernel's layout (jaxserve.kernels.cpu.bf16_matmul.pack_weight, over the first `n_in` axes as
    input rows) where its shape allows (even K, N % 16 == 0), else plain; round_x_min_rows:
    see DualPrecisionWeight (packed copies only). split: (input, output) shards of a
    tensor-parallel weight: the packed layout is blockwise over N and pairwise over K, so
    the global packing split over devices is each shard's own packing when every shard's
    K and N pack (checked; else plain). A bf16 `w` used for every row count (min_rows 1,
    no max_rows) is its own copy: packing it is lossless. Raises ValueError if w is not
    f32 (or such a bf16), min_rows < 1 or max_rows < min_rows."""
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    if max_rows is not None and max_rows < min_rows:
        raise ValueError(f"max_rows must be >= min_rows ({min_rows}), got {max_rows}")
    keep = w if min_rows > 1 or max_rows is not None else None
    if w.dtype != jnp.float32 and not (w.dtype == jnp.bfloat16 and keep is None):
        raise ValueError(f"dual precision needs f32 weights (or bf16 ones with min_rows 1 "
                         f"and no max_rows), got {w.dtype} with min_rows {min_rows}")
    if packed:
        from jaxserve.kernels.cpu.bf16_matmul import LANES, PANEL, can_pack, pack_weight
        if vocab_major:  # [vocab, embed] = W^T of the [K = embed, N = vocab] product
            k, n, w2 = w.shape[1], w.shape[0], w
        else:
            k = math.prod(w.shape[:n_in])
            n, w2 = w.size // k, w.reshape(k, -1)
        # the widest panel whose blocks split evenly over the output shards
        panel = next((p for p in (PANEL, LANES) if n % (p * split[1]) == 0), None)
        if panel is not None and k % split[0] == 0 and can_pack(k // split[0], n // split[1]):
            w_packed = jax.jit(pack_weight, static_argnums=(1, 2))(w2, vocab_major, panel)
            return DualPrecisionWeight(w=keep, w_bf16=w_packed, min_rows=min_rows,
                                       vocab_major=vocab_major, logical_shape=tuple(w.shape),
                                       max_rows=max_rows, round_x_min_rows=round_x_min_rows)
    return DualPrecisionWeight(w=keep, w_bf16=w.astype(jnp.bfloat16), min_rows=min_rows,
                               vocab_major=vocab_major, max_rows=max_rows)


@pytree_dataclass(meta=("out_shapes", "shards"))
class FusedWeight:
    """Projections of one input stored as one matrix, so that they run as one matmul:
    w [in, sum of their output columns] (a float array or a DualPrecisionWeight) and
    out_shapes, each part's output shape (static; its columns are the product). Held in
    the first projection's place of a layer (wq for wq | wk | wv, w_gate for
    w_gate | w_up), the others None; `Matmul.project` runs it and splits the result.
    shards: under tensor parallelism, the parts are fused per shard (the columns of shard
    0's parts, then shard 1's, ...) and out_shapes are one shard's: a contiguous split of
    the columns over `shards` devices gives each its own parts. 1 otherwise."""

    w: Any
    out_shapes: tuple
    shards: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)


def fused_weight(ws: list[jax.Array], n_in: int = 1, shards: int = 1) -> tuple[jax.Array, tuple]:
    """ws (each [*in, *out_i], the same *in) as one [prod(in), sum(prod(out_i))] matrix
    and the out_i shapes: what a FusedWeight holds (before any copy or packing). With
    `shards` > 1 the columns are grouped per shard (each part split over its first output
    axis) and the shapes are one shard's. Raises ValueError when a part's first output
    axis does not divide by `shards`."""
    k = math.prod(ws[0].shape[:n_in])
    bad = [tuple(w.shape) for w in ws if w.shape[n_in] % shards]
    if bad:
        raise ValueError(f"cannot fuse weights {bad} per {shards} shards: their first output "
                         "axis does not divide")
    parts = [w.reshape(k, shards, -1) for w in ws]
    shapes = tuple((w.shape[n_in] // shards, *w.shape[n_in + 1:]) for w in ws)
    return jnp.concatenate(parts, axis=2).reshape(k, -1), shapes


def _shards(rules: Any, shape: tuple[int, ...], axes: tuple, n_in: int) -> tuple[int, int]:
    """(devices the input dims split over, devices the output dims split over) of a
    weight of logical `shape` and `axes` (its first n_in contracted) under the
    ShardingRules `rules` of a tensor-parallel mesh; (1, 1) when rules is None."""
    if rules is None:
        return 1, 1
    spec = tuple(rules.spec(axes, shape))
    size = lambda ax: rules.mesh.shape[ax] if ax is not None else 1  # noqa: E731
    ins = [a for a in spec[:n_in] if a is not None]
    outs = [a for a in spec[n_in:] if a is not None]
    return size(ins[0] if ins else None), size(outs[0] if outs else None)


def dual_precision_params(params: Params, min_rows: int, packed: bool = False,
                          max_rows: int | None = None, fuse: bool = True,
                          round_x_min_rows: int | None = None, rules: Any = None) -> Params:
    """`params` (f32) with every layer projection (PROJECTIONS) and the LM head as
    DualPrecisionWeights over min_rows .. max_rows rows (a tied LM head becomes `lm_head`
    [vocab, embed] over the same f32 embedding array, plus its bf16 copy); embeddings and
    norms unchanged. packed: the bf16 copies in the C++ CPU kernel's layout (matmul_impl
    "cpu"), and with `fuse` the projections that share an input fused (FusedWeight in wq:
    wq | wk | wv, in w_gate: w_gate | w_up; fewer, larger kernel calls, every output
    column summed exactly as unfused); round_x_min_rows: see DualPrecisionWeight.
    rules: the ShardingRules of a tensor-parallel mesh (None: one device): packing and
    fusion are then done per shard of each weight's split (jaxserve.model.tensor_parallel).
    GGMLWeight leaves (block-quantised weights) are kept as they are, and a layer holding
    one is not fused."""
    split = functools.partial(_shards, rules)
    def dual(w, split_, n_in=1, **kw):
        return dual_precision(w, min_rows, packed=packed, max_rows=max_rows, n_in=n_in,
                              round_x_min_rows=round_x_min_rows, split=split_, **kw)

    def proj(lp: LayerParams, name: str):
        w, n_in = getattr(lp, name), PROJECTIONS[name]
        if isinstance(w, GGMLWeight):  # served in its blocks
            return w
        return dual(w, split(w.shape, LAYER_AXES[name], n_in), n_in)

    def layer(lp: LayerParams) -> LayerParams:
        if not (packed and fuse) or any(isinstance(getattr(lp, name), GGMLWeight)
                                        for name in PROJECTIONS):
            return dataclasses.replace(lp, **{name: proj(lp, name) for name in PROJECTIONS})
        q_shards = split(lp.wq.shape, LAYER_AXES["wq"], 1)[1]
        mlp_shards = split(lp.w_gate.shape, LAYER_AXES["w_gate"], 1)[1]
        qkv, qkv_shapes = fused_weight([lp.wq, lp.wk, lp.wv], shards=q_shards)
        gate_up, gate_up_shapes = fused_weight([lp.w_gate, lp.w_up], shards=mlp_shards)
        return dataclasses.replace(
            lp, wq=FusedWeight(dual(qkv, (1, q_shards)), qkv_shapes, q_shards),
            wk=None, wv=None, wo=proj(lp, "wo"),
            w_gate=FusedWeight(dual(gate_up, (1, mlp_shards)), gate_up_shapes, mlp_shards),
            w_up=None, w_down=proj(lp, "w_down"))
    tied = params.lm_head is None
    head = params.embed if tied else params.lm_head
    params = dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers))
    if isinstance(head, GGMLWeight):  # a block-quantised head is served in its blocks
        return params
    head_split = (split(head.shape, EMBED_AXES, 1)[::-1] if tied
                  else split(head.shape, LM_HEAD_AXES, 1))
    return dataclasses.replace(params, lm_head=dual(head, head_split, vocab_major=tied))


def fused_ggml_weight(ws: list[GGMLWeight], n_in: int = 1, shards: int = 1
                      ) -> FusedWeight | None:
    """Packed GGMLWeights of one input (each standing for [*in, *out_i]) as one FusedWeight:
    their panel records concatenated (a panel is 16 output rows: the fused matrix's rows
    are the parts' rows, one after another), grouped per shard as `fused_weight` does
    (shard 0's rows of each part, then shard 1's, ...). One x quantisation and one kernel
    call instead of len(ws), the same integer dot products and scales per column. None
    (keep them apart) unless every part is packed, of the same format, and each shard's
    rows of each part are whole panels."""
    if (not all(isinstance(w, GGMLWeight) and w.packed for w in ws)
            or len({w.fmt for w in ws}) != 1 or len({w.qs.shape[1:] for w in ws}) != 1
            or any(w.qs.shape[0] % shards for w in ws)):
        return None
    tail = ws[0].qs.shape[1:]
    qs = jnp.concatenate([w.qs.reshape(shards, -1, *tail) for w in ws], axis=1)
    k = math.prod(ws[0].shape[:n_in])
    shapes = tuple((w.shape[n_in] // shards, *w.shape[n_in + 1:]) for w in ws)
    cols = sum(math.prod(w.shape[n_in:]) for w in ws)
    return FusedWeight(GGMLWeight(qs=qs.reshape(-1, *tail), d=None, m=None, fmt=ws[0].fmt,
                                  logical_shape=(k, cols)), shapes, shards)


def pack_ggml_params(params: Params, rules: Any = None, fuse: bool = True) -> Params:
    """`params` with every GGMLWeight leaf (projections, embedding, LM head) packed for the
    C++ kernel (jaxserve.model.ggml_weight.pack_for_cpu: the same bytes in 16-row panels),
    where each device's rows make whole panels (rules: the ShardingRules of a
    tensor-parallel mesh; None: one device); the others stay as they are (run by the
    jnp reference). With `fuse`, a layer's wq | wk | wv and w_gate | w_up, when all
    packed in one format, become FusedWeights (`fused_ggml_weight`, per shard)."""
    def pack(w: Any, axes: tuple, n_in: int | None) -> Any:
        if not isinstance(w, GGMLWeight) or w.packed:
            return w
        # rows: a projection's outputs; a vocab-major table's [vocab, embed] first axis
        devices = (_shards(rules, w.shape, EMBED_AXES, 1)[0] if n_in is None
                   else _shards(rules, w.shape, axes, n_in)[1])
        if not can_pack(w.matrix_shape[0] // devices):
            return w
        return jax.block_until_ready(pack_for_cpu(w))

    def fused(lp: LayerParams, names: tuple[str, ...]) -> dict[str, Any]:
        ws = [getattr(lp, n) for n in names]
        shards = _shards(rules, ws[0].shape, LAYER_AXES[names[0]], 1)[1]
        f = fused_ggml_weight(ws, shards=shards)
        if f is None:
            return {}
        return {names[0]: jax.block_until_ready(f), **{n: None for n in names[1:]}}

    def layer(lp: LayerParams) -> LayerParams:
        lp = dataclasses.replace(lp, **{n: pack(getattr(lp, n), LAYER_AXES[n], k)
                                        for n, k in PROJECTIONS.items()})
        if not fuse:
            return lp
        return dataclasses.replace(lp, **fused(lp, ("wq", "wk", "wv")),
                                   **fused(lp, ("w_gate", "w_up")))

    return dataclasses.replace(params, layers=tuple(map(layer, params.layers)),
                               embed=pack(params.embed, EMBED_AXES, None),
                               lm_head=pack(params.lm_head, LM_HEAD_AXES, None))


def packed_bf16_matmul(x2: jax.Array, w: DualPrecisionWeight) -> jax.Array:
    """x2 [rows, K] (any float) times a packed DualPrecisionWeight's bf16 copy -> [rows, N]
    f32 in the C++ CPU kernel (weights widened to f32, x and the arithmetic f32; any row
    count; from w.round_x_min_rows rows x rounded to bf16, bf16 dot products)."""
    from jaxserve.kernels.cpu.bf16_matmul import bf16_matmul as cpu_bf16_matmul
    round_x = w.round_x_min_rows is not None and x2.shape[0] >= w.round_x_min_rows
    return cpu_bf16_matmul(x2.astype(jnp.float32), w.w_bf16, round_x=round_x)


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

    def dense(self, x: jax.Array, w: Any, n_in: int) -> jax.Array:
        """x [..., *in] contracted with w [*in, *out] -> [..., *out].

        w: a float array (a plain dot_general in x.dtype), a DualPrecisionWeight (its f32
        or bf16 copy by the number of rows of x, prod(x.shape[:-n_in]); a packed bf16 copy
        runs in the C++ CPU kernel, the only one that reads that layout; result in
        x.dtype), a QuantizedWeight (f32 accumulation, result in x.dtype, in this
        implementation's kernel: `_quantized`) or a GGMLWeight (its blocks [out, in]
        standing for w.logical_shape; result in x.dtype, by `_ggml`)."""
        if isinstance(w, DualPrecisionWeight):
            lead, rows = x.shape[:x.ndim - n_in], math.prod(x.shape[:x.ndim - n_in])
            if w.packed and w.uses_bf16(rows):
                y = packed_bf16_matmul(x.reshape(rows, -1), w)
                return y.reshape(*lead, *_out_shape(w.shape[n_in:], y.shape[-1])).astype(x.dtype)
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
        parts = jnp.split(y, list(itertools.accumulate(sizes))[:-1], axis=-1)
        return tuple(p.reshape(*lead, *s) for p, s in zip(parts, fused.out_shapes))

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
            return ggml_matmul(x2.astype(jnp.float32), w.qs, w.fmt)
        return ggml_matmul_reference(x2, w)

    def _quantized(self, x2: jax.Array, w2: jax.Array, scales: jax.Array) -> jax.Array:
        """x2 [M, K] times a quantised w2 [K, N] with its scales -> [M, N] in x2.dtype."""
        raise ValueError(f"quantised weights need a matmul impl of "
                         f"{KERNEL_IMPLS + MOSAIC_KERNEL_IMPLS}, "
                         f"got {self.name!r}")


@dataclasses.dataclass(frozen=True)
class XlaMatmul(Matmul):
    """XLA's dot; quantised weights through the plain-jnp reference of the Pallas kernel."""

    name = "xla"

    def _quantized(self, x2, w2, scales):
        from jaxserve.kernels.pallas.quantized_matmul import quantized_matmul_reference
        return quantized_matmul_reference(x2, w2, scales)


@dataclasses.dataclass(frozen=True)
class CpuMatmul(Matmul):
    """bf16 weight copies packed at load for the C++ kernel of jaxserve/kernels/cpu/bf16_matmul (the
    packed leaves pick that kernel themselves); no quantised weights."""

    name = "cpu"
    packs_bf16 = True


@dataclasses.dataclass(frozen=True)
class PallasMatmul(Matmul):
    """Quantised weights in the Pallas kernels of jaxserve/kernels/pallas: the Triton one
    (quantized_matmul) or, with `mosaic`, the Mosaic GPU one for Hopper
    (quantized_matmul_mosaic) wherever it takes the shapes and dtypes, the Triton one
    elsewhere (f32 activations, widths not a multiple of 64). interpret: in the backend's
    interpret mode, on CPU, for tests."""

    interpret: bool = False
    mosaic: bool = False

    @property
    def name(self) -> str:
        return pallas_impl(self.mosaic, self.interpret)

    def _quantized(self, x2, w2, scales):
        from jaxserve.kernels.pallas.quantized_matmul import quantized_matmul
        if self.mosaic:
            from jaxserve.kernels.pallas.quantized_matmul_mosaic import (mosaic_supports,
                                                                         quantized_matmul_mosaic)
            (k, n), group = w2.shape, None if scales.ndim == 1 else w2.shape[0] // scales.shape[0]
            if mosaic_supports(x2.dtype, w2.dtype, k, n, group):
                return quantized_matmul_mosaic(x2, w2, scales, impl=self.name)
        return quantized_matmul(x2, w2, scales, impl=pallas_impl(False, self.interpret))


_MATMULS = {"xla": XlaMatmul(), "cpu": CpuMatmul(), "pallas": PallasMatmul(),
            "pallas_interpret": PallasMatmul(interpret=True),
            "pallas_mosaic": PallasMatmul(mosaic=True),
            "pallas_mosaic_interpret": PallasMatmul(interpret=True, mosaic=True)}


def matmul_backend(impl: "str | Matmul") -> Matmul:
    """The Matmul a matmul_impl name stands for ("xla", "cpu", "pallas",
    "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret"); a Matmul is returned
    as it is. Raises ValueError for an unknown name."""
    return lookup(_MATMULS, impl, Matmul, "matmul impl")


def dense(x: jax.Array, w: Any, n_in: int, impl: "str | Matmul" = "xla") -> jax.Array:
    """`matmul_backend(impl).dense(x, w, n_in)` (see Matmul.dense). Raises ValueError for an
    unknown impl."""
    return matmul_backend(impl).dense(x, w, n_in)
