"""The projection weights' leaf types and the load-time passes that produce them: weight-only
quantisation (int8 / fp8 e4m3, `QuantizedWeight`), bf16 copies of f32 weights for large steps
(`DualPrecisionWeight`), projections of one input fused into one matrix (`FusedWeight`), and
GGML block weights packed for the C++ kernel. `jaxserve.model.linear.Matmul` runs them.

A `QuantizedWeight` keeps the stored values in the weight's own shape ([embed, heads,
head_dim], [mlp, embed], ...) and its scales as the kernel wants them, flattened to the
output features: [out_features] per channel, or [in_features // group, out_features] per
group. Embeddings, norms, biases and the LM head are never quantised by `quantize_params`.

Source: weight-only per-channel int8 (LLM.int8 / vLLM's W8A16), per-group int8 as in
GPTQ/AWQ's group scales, FP8 e4m3 per-channel as in vLLM's fp8 W8A16 path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ConfigError
from jaxserve.kernels.cpu.bf16_matmul import SWIGLU_GROUP, interleave_gate_up
from jaxserve.kernels.cpu.ggml_matmul import can_pack
from jaxserve.model.ggml_weight import GGMLWeight, pack_for_cpu
from jaxserve.model.params import (EMBED_AXES, LAYER_AXES, LM_HEAD_AXES, PROJECTIONS,
                                   LayerParams, Params)
from jaxserve.pytree import pytree_dataclass


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
    QuantizedWeight, a fused one's matrix too (FusedWeight of a QuantizedWeight [D, cols]:
    per-column or per-group scales make its columns the parts' own quantised columns);
    everything else (GGMLWeight projections too) unchanged. Runs one
    small jitted quantisation per weight, so peak memory stays near the float weights plus
    one quantised copy. rules: the ShardingRules
    of a tensor-parallel mesh (None: one device); each device's input rows of a row-split
    weight must hold whole groups. Raises ConfigError (a ValueError) when they do not."""
    quantize = jax.jit(quantize_weight, static_argnums=(1, 2, 3))
    if rules is not None and group_size is not None:
        for name, n_in in PROJECTIONS.items():
            w = getattr(params.layers[0], name)
            if w is None or isinstance(w, FusedWeight):  # fused: column-split, rows whole
                continue
            spec = tuple(rules.spec(LAYER_AXES[name], w.shape))
            shards = math.prod(rules.mesh.shape[a] for a in spec[:n_in] if a is not None)
            if (math.prod(w.shape[:n_in]) // shards) % group_size:
                raise ConfigError(f"KernelConfig.weight_quant_group_size={group_size} does not divide the "
                                 f"{math.prod(w.shape[:n_in]) // shards} input rows of {name} "
                                 f"each of {shards} devices holds")

    # one weight at a time, each finished before the next is dispatched: bounds memory,
    # and on simulated CPU devices many queued sharded programs with collectives
    # deadlocked XLA:CPU's rendezvous (threads of 2 cores all waiting in earlier ones)
    def one(w, n_in):
        if isinstance(w, FusedWeight):
            return dataclasses.replace(w, w=one(w.w, 1))
        return jax.block_until_ready(quantize(w, n_in, fmt, group_size))

    def layer(lp: LayerParams) -> LayerParams:
        return dataclasses.replace(lp, **{name: one(getattr(lp, name), n_in)
                                          for name, n_in in PROJECTIONS.items()
                                          if getattr(lp, name) is not None
                                          and not isinstance(getattr(lp, name), GGMLWeight)})

    return dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers))


@pytree_dataclass(meta=("min_rows", "vocab_major", "logical_shape", "max_rows", "round_x_min_rows"))
class DualPrecisionWeight:
    """An f32 weight kept twice: `w_copy` (the same values rounded to bf16) for matmuls over
    `min_rows` to `max_rows` rows of activations (None: no upper limit), and `w` (f32) for
    the others. A plain bf16 copy runs XLA's bf16 x bf16 dot (x rounded to bf16, f32
    accumulation); a packed one the C++ CPU kernel (weights widened to f32, x and the
    arithmetic f32). With min_rows 1 and no max_rows the copy is the only weight (`w` None),
    and a packed one may also be the f32 weight itself in the kernel's f32 panels
    (`dual_precision`'s copy_dtype float32: KernelConfig.matmul_impl "cpu" without
    bf16_matmul_min_rows).

    Why: on XLA:CPU (YNNPACK) a bf16 matmul with f32 accumulation can beat f32 from a few
    rows up, while a 1-row bf16 product takes a matrix-vector path slower than f32
    (PERFORMANCE.md, "Measurements behind the code"; `jaxserve bench step --compare
    matmul` measures both on a machine): the XLA bf16 path pads 1 row to 2
    (jaxserve.model.linear.BF16_MIN_ROWS). Which copy runs is fixed per compiled step
    shape (row counts are static). Costs 1.5x the weights' memory, or 0.5x with min_rows =
    1 and no max_rows (then `w` is None: every matmul uses the bf16 copy).
    max_rows is for machines where f32 wins again at prefill sizes (PERFORMANCE.md, the same
    section).
    vocab_major: the LM head tied to the embedding, stored [vocab, embed].
    logical_shape: None, or the weight's [*in, *out] shape when `w_copy` is packed for the
    C++ CPU kernel (jaxserve.kernels.cpu.bf16_matmul.pack_weight: [N / P, K / 2, P, 2] bf16
    or [N / P, K / 2, 2, P] f32, input rows K = prod(in), N = prod(out); a vocab-major head
    packs as [embed, vocab]).
    round_x_min_rows: None, or for a packed copy: matmuls over at least this many rows round
    x to bf16 and use the CPU's bf16 dot-product instruction (jaxserve.kernels.cpu.bf16_matmul's
    round_x).
    """

    w: Any
    w_copy: Any
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
        return self.logical_shape if self.packed else tuple(self.w_copy.shape)

    def uses_bf16(self, rows: int) -> bool:
        """Whether a matmul over `rows` rows uses the bf16 copy."""
        return self.w is None or self.min_rows <= rows <= (self.max_rows or rows)

    def pick(self, rows: int) -> jax.Array:
        """The copy a matmul over `rows` rows uses."""
        return self.w_copy if self.uses_bf16(rows) else self.w


def dual_precision(w: jax.Array, min_rows: int, vocab_major: bool = False, n_in: int = 1,
                   packed: bool = False, max_rows: int | None = None,
                   round_x_min_rows: int | None = None,
                   split: tuple[int, int] = (1, 1),
                   copy_dtype: Any = jnp.bfloat16) -> DualPrecisionWeight:
    """`w` (f32) with its bf16 copy for matmuls over min_rows .. max_rows rows (only the
    copy when min_rows is 1 and max_rows None). packed: store the bf16 copy in the C++
    kernel's layout (jaxserve.kernels.cpu.bf16_matmul.pack_weight, over the first `n_in` axes as
    input rows) where its shape allows (even K, N % 16 == 0), else plain; round_x_min_rows:
    see DualPrecisionWeight (packed copies only). split: (input, output) shards of a
    tensor-parallel weight: the packed layout is blockwise over N and pairwise over K, so
    the global packing split over devices is each shard's own packing when every shard's
    K and N pack (checked; else plain). A bf16 `w` used for every row count (min_rows 1,
    no max_rows) is its own copy: packing it is lossless. copy_dtype float32 (packed, min_rows
    1, no max_rows, no round_x_min_rows): the f32 weight itself in the kernel's f32 panels,
    where its shape packs (else the plain f32 weight: XLA's f32 dot). Raises ValueError if
    w is not f32 (or such a bf16), min_rows < 1 or max_rows < min_rows, or copy_dtype
    float32 is asked for otherwise."""
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    if max_rows is not None and max_rows < min_rows:
        raise ValueError(f"max_rows must be >= min_rows ({min_rows}), got {max_rows}")
    keep = w if min_rows > 1 or max_rows is not None else None
    f32_panels = jnp.dtype(copy_dtype) == jnp.float32
    if f32_panels and (not packed or keep is not None or round_x_min_rows is not None
                       or w.dtype != jnp.float32):
        raise ValueError("f32 panels (copy_dtype float32) are the whole f32 weight, packed: "
                         "needs packed, min_rows 1, no max_rows or round_x_min_rows")
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
            w_packed = jax.jit(pack_weight, static_argnums=(1, 2, 3))(w2, vocab_major, panel,
                                                                      copy_dtype)
            return DualPrecisionWeight(w=keep, w_copy=w_packed, min_rows=min_rows,
                                       vocab_major=vocab_major, logical_shape=tuple(w.shape),
                                       max_rows=max_rows, round_x_min_rows=round_x_min_rows)
    # not packed: a plain copy (f32 panels that do not pack: the f32 weight, XLA's dot)
    return DualPrecisionWeight(w=keep, w_copy=w.astype(copy_dtype), min_rows=min_rows,
                               vocab_major=vocab_major, max_rows=max_rows)


@pytree_dataclass(meta=("out_shapes", "shards", "interleaved"))
class FusedWeight:
    """Projections of one input stored as one matrix, so that they run as one matmul:
    w [in, sum of their output columns] (a float array or a DualPrecisionWeight) and
    out_shapes, each part's output shape (static; its columns are the product). Held in
    the first projection's place of a layer (wq for wq | wk | wv, w_gate for
    w_gate | w_up), the others None; `Matmul.project` runs it and splits the result.
    shards: under tensor parallelism, the parts are fused per shard (the columns of shard
    0's parts, then shard 1's, ...) and out_shapes are one shard's: a contiguous split of
    the columns over `shards` devices gives each its own parts. 1 otherwise.
    interleaved: 0 (each shard's parts one after another), or g: w_gate | w_up laid out
    for the C++ kernel's SwiGLU epilogue, two parts of one shape whose columns alternate
    in groups of g within each shard (jaxserve.kernels.cpu.bf16_matmul.interleave_gate_up;
    `Matmul.swiglu` runs it, `Matmul.project` splits it back)."""

    w: Any
    out_shapes: tuple
    shards: int = 1
    interleaved: int = 0

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


def _fused_layer(lp: LayerParams, rules: Any, wrap=lambda w, split: w,
                 swiglu: bool = False) -> LayerParams:
    """`lp` with wq | wk | wv and w_gate | w_up each one FusedWeight (fused per shard of
    their output split under `rules`), its matrix passed through wrap(w, (1, shards))
    (a layout, e.g. dual_precision's; the identity by default); the other leaves as
    they are. swiglu: w_gate | w_up's columns interleaved for the C++ kernel's SwiGLU
    epilogue (FusedWeight.interleaved) where each shard's F divides into its groups."""
    q_shards = _shards(rules, lp.wq.shape, LAYER_AXES["wq"], 1)[1]
    mlp_shards = _shards(rules, lp.w_gate.shape, LAYER_AXES["w_gate"], 1)[1]
    qkv, qkv_shapes = fused_weight([lp.wq, lp.wk, lp.wv], shards=q_shards)
    gate_up, gate_up_shapes = fused_weight([lp.w_gate, lp.w_up], shards=mlp_shards)
    group = SWIGLU_GROUP if swiglu and gate_up_shapes[0][0] % SWIGLU_GROUP == 0 else 0
    if group:
        gate_up = interleave_gate_up(gate_up, group, mlp_shards)
    return dataclasses.replace(
        lp, wq=FusedWeight(wrap(qkv, (1, q_shards)), qkv_shapes, q_shards), wk=None, wv=None,
        w_gate=FusedWeight(wrap(gate_up, (1, mlp_shards)), gate_up_shapes, mlp_shards, group),
        w_up=None)


def fuse_projections(params: Params, rules: Any = None) -> Params:
    """`params` with the projections that share an input stored as one matrix each
    (FusedWeight: wq | wk | wv [D, (H + 2 K) * Dh] in wq, w_gate | w_up [D, 2 F] in
    w_gate; the others None), so that each runs as one matmul, as vLLM's
    QKVParallelLinear and MergedColumnParallelLinear do. Every output column is the same
    sum as unfused (up to the order XLA picks for the larger matrix). Layers whose
    projections are not all plain float arrays (quantised, GGUF blocks, bf16 copies) are
    kept as they are. rules: the ShardingRules of a tensor-parallel mesh (None: one
    device): the columns are grouped per shard of the output split
    (jaxserve.model.tensor_parallel reads them so).

    Why (KernelConfig.fuse_projections; PERFORMANCE.md, "The GPU run of session 24"):
    XLA:GPU turns a product of one activation row by a small matrix into a multiply and
    a reduction rather than a GEMM: Llama-3-8B's K and V projections (4096 x 1024) took
    ~32 us a layer on an H100 (~0.5 TB/s) where the GEMMs of the other projections read
    at ~2.3-2.9 TB/s. Fused, q | k | v is one GEMM of 4096 x 6144."""
    plain = lambda w: (isinstance(w, (jax.Array, np.ndarray))  # noqa: E731
                       and jnp.issubdtype(w.dtype, jnp.floating))

    def layer(lp: LayerParams) -> LayerParams:
        if not all(plain(getattr(lp, name)) for name in ("wq", "wk", "wv", "w_gate", "w_up")):
            return lp
        return _fused_layer(lp, rules)
    return dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers))


def dual_precision_params(params: Params, min_rows: int, packed: bool = False,
                          max_rows: int | None = None, fuse: bool = True,
                          round_x_min_rows: int | None = None, rules: Any = None,
                          copy_dtype: Any = jnp.bfloat16, swiglu: bool = False) -> Params:
    """`params` (f32) with every layer projection (PROJECTIONS) and the LM head as
    DualPrecisionWeights over min_rows .. max_rows rows (a tied LM head becomes `lm_head`
    [vocab, embed] over the same f32 embedding array, plus its bf16 copy); embeddings and
    norms unchanged. packed: the bf16 copies in the C++ CPU kernel's layout (matmul_impl
    "cpu"), and with `fuse` the projections that share an input fused (FusedWeight in wq:
    wq | wk | wv, in w_gate: w_gate | w_up; fewer, larger kernel calls, every output
    column summed exactly as unfused); round_x_min_rows: see DualPrecisionWeight;
    copy_dtype float32 (packed, min_rows 1): the f32 weights themselves in the kernel's f32
    panels instead of bf16 copies (dual_precision). rules: the ShardingRules of a
    tensor-parallel mesh (None: one device): packing and fusion are then done per shard
    of each weight's split (jaxserve.model.tensor_parallel). swiglu (packed and fused):
    w_gate | w_up laid out for the C++ kernel's SwiGLU epilogue (`_fused_layer`;
    jaxserve.model.linear.Matmul.swiglu).
    GGMLWeight leaves (block-quantised weights) are kept as they are, and a layer holding
    one is not fused."""
    split = functools.partial(_shards, rules)
    def dual(w, split_, n_in=1, **kw):
        return dual_precision(w, min_rows, packed=packed, max_rows=max_rows, n_in=n_in,
                              round_x_min_rows=round_x_min_rows, split=split_,
                              copy_dtype=copy_dtype, **kw)

    def proj(lp: LayerParams, name: str):
        w, n_in = getattr(lp, name), PROJECTIONS[name]
        if isinstance(w, GGMLWeight):  # served in its blocks
            return w
        return dual(w, split(w.shape, LAYER_AXES[name], n_in), n_in)

    def layer(lp: LayerParams) -> LayerParams:
        if not (packed and fuse) or any(isinstance(getattr(lp, name), GGMLWeight)
                                        for name in PROJECTIONS):
            return dataclasses.replace(lp, **{name: proj(lp, name) for name in PROJECTIONS})
        return dataclasses.replace(_fused_layer(lp, rules, dual, swiglu), wo=proj(lp, "wo"),
                                   w_down=proj(lp, "w_down"))
    tied = params.lm_head is None
    head = params.embed if tied else params.lm_head
    params = dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers))
    if isinstance(head, GGMLWeight):  # a block-quantised head is served in its blocks
        return params
    head_split = (split(head.shape, EMBED_AXES, 1)[::-1] if tied
                  else split(head.shape, LM_HEAD_AXES, 1))
    return dataclasses.replace(params, lm_head=dual(head, head_split, vocab_major=tied))


def fused_ggml_weight(ws: list[GGMLWeight], n_in: int = 1, shards: int = 1,
                      swiglu: bool = False) -> FusedWeight | None:
    """Packed GGMLWeights of one input (each standing for [*in, *out_i]) as one FusedWeight:
    their panel records concatenated (a panel is 16 output rows: the fused matrix's rows
    are the parts' rows, one after another), grouped per shard as `fused_weight` does
    (shard 0's rows of each part, then shard 1's, ...). One x quantisation and one kernel
    call instead of len(ws), the same integer dot products and scales per column. swiglu
    (two parts of one shape: w_gate, w_up): each shard's panels alternate instead, gate's
    panel j then up's (FusedWeight.interleaved 16: the C++ kernel's SwiGLU epilogue). None
    (keep them apart) unless every part is packed, of the same format, and each shard's
    rows of each part are whole panels."""
    if (not all(isinstance(w, GGMLWeight) and w.packed for w in ws)
            or len({w.fmt for w in ws}) != 1 or len({w.qs.shape[1:] for w in ws}) != 1
            or any(w.qs.shape[0] % shards for w in ws)):
        return None
    tail = ws[0].qs.shape[1:]
    parts = [w.qs.reshape(shards, -1, *tail) for w in ws]
    swiglu = swiglu and len(ws) == 2 and parts[0].shape == parts[1].shape
    qs = (jnp.stack(parts, axis=2) if swiglu  # [shards, panels, 2, ...]: gate's, up's
          else jnp.concatenate(parts, axis=1))
    k = math.prod(ws[0].shape[:n_in])
    shapes = tuple((w.shape[n_in] // shards, *w.shape[n_in + 1:]) for w in ws)
    cols = sum(math.prod(w.shape[n_in:]) for w in ws)
    return FusedWeight(GGMLWeight(qs=qs.reshape(-1, *tail), d=None, m=None, fmt=ws[0].fmt,
                                  logical_shape=(k, cols)), shapes, shards,
                       SWIGLU_GROUP if swiglu else 0)


def pack_ggml_params(params: Params, rules: Any = None, fuse: bool = True,
                     swiglu: bool = False) -> Params:
    """`params` with every GGMLWeight leaf (projections, embedding, LM head) packed for the
    C++ kernel (jaxserve.model.ggml_weight.pack_for_cpu: the same bytes in 16-row panels),
    where each device's rows make whole panels (rules: the ShardingRules of a
    tensor-parallel mesh; None: one device); the others stay as they are (run by the
    jnp reference). With `fuse`, a layer's wq | wk | wv and w_gate | w_up, when all
    packed in one format, become FusedWeights (`fused_ggml_weight`, per shard; with
    `swiglu`, w_gate | w_up's panels alternating for the C++ kernel's SwiGLU epilogue)."""
    def pack(w: Any, axes: tuple, n_in: int | None) -> Any:
        if not isinstance(w, GGMLWeight) or w.packed:
            return w
        # rows: a projection's outputs; a vocab-major table's [vocab, embed] first axis
        devices = (_shards(rules, w.shape, EMBED_AXES, 1)[0] if n_in is None
                   else _shards(rules, w.shape, axes, n_in)[1])
        if not can_pack(w.matrix_shape[0] // devices):
            return w
        return jax.block_until_ready(pack_for_cpu(w))

    def fused(lp: LayerParams, names: tuple[str, ...], interleave: bool = False
              ) -> dict[str, Any]:
        ws = [getattr(lp, n) for n in names]
        shards = _shards(rules, ws[0].shape, LAYER_AXES[names[0]], 1)[1]
        f = fused_ggml_weight(ws, shards=shards, swiglu=interleave)
        if f is None:
            return {}
        return {names[0]: jax.block_until_ready(f), **{n: None for n in names[1:]}}

    def layer(lp: LayerParams) -> LayerParams:
        lp = dataclasses.replace(lp, **{n: pack(getattr(lp, n), LAYER_AXES[n], k)
                                        for n, k in PROJECTIONS.items()})
        if not fuse:
            return lp
        return dataclasses.replace(lp, **fused(lp, ("wq", "wk", "wv")),
                                   **fused(lp, ("w_gate", "w_up"), swiglu))

    return dataclasses.replace(params, layers=tuple(map(layer, params.layers)),
                               embed=pack(params.embed, EMBED_AXES, None),
                               lm_head=pack(params.lm_head, LM_HEAD_AXES, None))
