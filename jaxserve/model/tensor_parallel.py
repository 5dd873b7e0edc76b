"""Tensor parallelism as explicit SPMD: the decoder layers, the token embedding and the LM
head run inside `jax.shard_map` over the `model` mesh axis.

Each device holds its own query / KV heads, MLP columns and vocabulary rows (the param and
KV pool shardings of jaxserve.distributed.sharding's rules) and runs every kernel (XLA, the C++ CPU
kernels, Pallas, the quantised matmuls) on its shard only. The reductions are explicit: a
`psum` after the attention output projection (wo) when the heads are split, after the MLP
down projection (w_down) when the MLP is split, and after the vocab-parallel embedding
lookup. Activations between these blocks are replicated, so no weight and no KV page ever
crosses devices: a step moves two [tokens, hidden] all-reduces per layer, and the logits
leave split over the vocabulary for the sampler.

A dimension that does not divide over the axis stays replicated (SmolLM2's 9 query / 3 KV
heads on 2 or 4 devices): every device then computes all of it, and its projection needs
no reduction. The query and KV heads split together or not at all
(jaxserve.config.check_deployment), except that with fewer KV heads than devices each KV
head is repeated over the devices whose query heads read it, as vLLM does
(`expand_kv_heads`: one KV head per device, the pool tp / num_kv_heads times larger).

The param tree's prepared leaves (QuantizedWeight, DualPrecisionWeight, FusedWeight) get
their PartitionSpecs from the logical axes of the weight they hold (`node_spec`); a fused
projection is fused per shard (FusedWeight.shards), so that a contiguous split of its
columns gives each device its own parts.

Source: Shoeybi et al. 2019, "Megatron-LM" (column- and row-parallel linear layers,
vocab-parallel embedding); JAX's shard_map (explicit collectives).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.model.ggml_weight import GGMLWeight, dequantize_rows
from jaxserve.model.kv_cache import KVCache, kv_axes
from jaxserve.model.params import EMBED_AXES, LAYER_AXES, LM_HEAD_AXES, LayerParams, Params
from jaxserve.model.params import PROJECTIONS
from jaxserve.model.weight_layouts import DualPrecisionWeight, FusedWeight, QuantizedWeight
from jaxserve.distributed.sharding import ShardingRules

REPLICATED = PartitionSpec()


def tp_axis(rules: ShardingRules | None) -> str | None:
    """The mesh axis tensor parallelism splits over (the `mlp` rule's), or None when there
    is no mesh or that axis has one device (then the model runs without shard_map)."""
    if rules is None:
        return None
    axis = rules.mesh_axis("mlp")
    return axis if axis is not None and rules.mesh.shape[axis] > 1 else None


def _split_axes(spec: PartitionSpec, n_in: int) -> tuple[str | None, str | None]:
    """(mesh axis of the input dims, mesh axis of the output dims) of a weight's spec."""
    ins = [a for a in tuple(spec)[:n_in] if a is not None]
    outs = [a for a in tuple(spec)[n_in:] if a is not None]
    return (ins[0] if ins else None), (outs[0] if outs else None)


def node_spec(node: Any, axes: tuple, n_in: int, rules: ShardingRules) -> Any:
    """The PartitionSpec tree (node's structure) of one param: a float array of logical
    `axes` (its first `n_in` contracted), or a QuantizedWeight, DualPrecisionWeight or
    FusedWeight standing for such a weight. None stays None."""
    if node is None:
        return None
    if isinstance(node, FusedWeight):  # [in, parts' columns], fused per shard
        out = rules.mesh_axis(axes[n_in]) if node.shards > 1 else None
        fused = PartitionSpec(None, out)
        if isinstance(node.w, DualPrecisionWeight):
            inner = _dual_spec(node.w, fused, None, out)
        elif isinstance(node.w, QuantizedWeight):  # per-column [cols] or per-group [G, cols]
            inner = dataclasses.replace(node.w, w_q=fused, scales=PartitionSpec(
                *(None,) * (node.w.scales.ndim - 1), out))
        elif isinstance(node.w, GGMLWeight):  # packed panels [rows / 16, in / 32, B]
            inner = jax.tree.map(lambda a: PartitionSpec(out, *(None,) * (a.ndim - 1)), node.w)
        else:
            inner = fused
        return dataclasses.replace(node, w=inner)
    if isinstance(node, GGMLWeight):  # [out, in / 32, ...] blocks: rows, then blocks
        vocab_major = len(axes) == 2 and "vocab" in axes
        table = EMBED_AXES if vocab_major else axes
        spec = rules.spec(table, node.shape)
        ax_out, ax_in = (spec[0], spec[1]) if vocab_major else _split_axes(spec, n_in)[::-1]
        return jax.tree.map(lambda a: PartitionSpec(ax_out, ax_in, *(None,) * (a.ndim - 2)),
                            node)
    if isinstance(node, QuantizedWeight):
        spec = rules.spec(axes, node.shape)
        ax_in, ax_out = _split_axes(spec, n_in)
        scales = (PartitionSpec(ax_out) if node.scales.ndim == 1
                  else PartitionSpec(ax_in, ax_out))
        return dataclasses.replace(node, w_q=spec, scales=scales)
    if isinstance(node, DualPrecisionWeight):
        # a tied head is held vocab-major: [vocab, embed], its input the last axis
        spec = rules.spec(EMBED_AXES if node.vocab_major else axes, node.shape)
        ax_in, ax_out = (spec[1], spec[0]) if node.vocab_major else _split_axes(spec, n_in)
        return _dual_spec(node, spec, ax_in, ax_out)
    return rules.spec(axes, node.shape)


def _dual_spec(node: DualPrecisionWeight, spec: PartitionSpec, ax_in: str | None,
               ax_out: str | None) -> DualPrecisionWeight:
    """A DualPrecisionWeight's specs: its f32 copy and a plain bf16 copy split as the
    weight (`spec`); a packed copy [N / P, K / 2, P, 2] by output then input axis."""
    return dataclasses.replace(
        node, w=None if node.w is None else spec,
        w_copy=PartitionSpec(ax_out, ax_in, None, None) if node.packed else spec)


def layer_specs(lp: LayerParams, rules: ShardingRules) -> LayerParams:
    """PartitionSpec trees of one layer's params (any prepared form; LoRA slots:
    `lora_specs`)."""
    specs = {f.name: node_spec(getattr(lp, f.name), LAYER_AXES[f.name],
                               PROJECTIONS.get(f.name, 1), rules)
             for f in dataclasses.fields(LayerParams) if f.name != "lora"}
    return LayerParams(**specs, lora=lora_specs(lp.lora, rules))


def lora_specs(lora: dict | None, rules: ShardingRules) -> dict | None:
    """PartitionSpecs of a layer's LoRA slots ({projection: LoraSlots}): A [S, in, R]
    split over its input as the base projection's input is, B [S, R, out] over its output
    as the base's output is (Megatron's column / row split carried to the factors: a
    column-parallel projection's B gives each device its own columns; a row-parallel
    one's A its own rows, the partial products summed by the projection's psum)."""
    if lora is None:
        return None
    out = {}
    for name, slots in lora.items():
        spec = rules.spec(LAYER_AXES[name], slots.logical_shape)
        ax_in, ax_out = _split_axes(spec, PROJECTIONS[name])
        out[name] = dataclasses.replace(slots, a=PartitionSpec(None, ax_in, None),
                                        b=PartitionSpec(None, None, ax_out))
    return out


def params_specs(params: Params, rules: ShardingRules) -> Params:
    """PartitionSpec trees of a whole Params tree (any prepared form)."""
    return Params(embed=node_spec(params.embed, EMBED_AXES, 1, rules),
                  layers=tuple(layer_specs(lp, rules) for lp in params.layers),
                  final_norm=node_spec(params.final_norm, ("embed",), 1, rules),
                  lm_head=node_spec(params.lm_head, LM_HEAD_AXES, 1, rules))


def cache_specs(cache: KVCache, rules: ShardingRules) -> KVCache:
    """PartitionSpecs of a KV pool's arrays (KV heads split when they divide; a pipeline's
    stage-stacked pool, jaxserve.model.kv_cache.abstract_kv_cache, also over `stage`)."""
    spec = lambda a: rules.spec(kv_axes(cache.layout, cache.staged), a.shape)  # noqa: E731
    return KVCache(k=tuple(map(spec, cache.k)), v=tuple(map(spec, cache.v)), layout=cache.layout)


def shard_params(params: Params, rules: ShardingRules) -> Params:
    """`params` placed on the shardings shard_map reads them in (params_specs): after
    prepare_params, whose jitted quantisation / packing leaves other layouts. With
    pipeline stages each decoder layer stays on its stage's devices (rules.for_layer)."""
    specs = params_specs(params, rules)
    put = lambda tree, spec, r: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(x, NamedSharding(r.mesh, s)), tree, spec)
    n = len(params.layers)
    return Params(embed=put(params.embed, specs.embed, rules),
                  layers=tuple(put(lp, sp, rules.for_layer(i, n))
                               for i, (lp, sp) in enumerate(zip(params.layers, specs.layers))),
                  final_norm=put(params.final_norm, specs.final_norm, rules),
                  lm_head=put(params.lm_head, specs.lm_head, rules))


def splits(lp: LayerParams, rules: ShardingRules) -> tuple[bool, bool]:
    """(heads split, MLP split) of a layer: whether the inputs of wo and w_down are split
    over devices, i.e. whether their outputs need a psum (from their logical shapes:
    every prepared form's `.shape` is the whole weight's)."""
    heads = rules.spec(LAYER_AXES["wo"], lp.wo.shape)[0] is not None
    mlp = rules.spec(LAYER_AXES["w_down"], lp.w_down.shape)[0] is not None
    return heads, mlp


def vocab_axis(params: Params, rules: ShardingRules) -> str | None:
    """The mesh axis the LM head's vocabulary columns are split over, or None."""
    if params.lm_head is None:
        return rules.spec(EMBED_AXES, params.embed.shape)[0]
    head = params.lm_head
    if isinstance(head, GGMLWeight):  # [vocab, D] blocks
        return rules.spec(EMBED_AXES, head.shape)[0]
    if isinstance(head, DualPrecisionWeight):  # [V, D] when tied or packed: vocab first
        spec = node_spec(head, LM_HEAD_AXES, 1, rules).w_copy
        return spec[0] if head.packed or head.vocab_major else spec[1]
    return rules.spec(LM_HEAD_AXES, head.shape)[1]


def embed_tokens(embed: jax.Array, tokens: jax.Array, rules: ShardingRules | None) -> jax.Array:
    """embed [vocab, D] rows of tokens [T] int32 -> [T, D] (a GGMLWeight table's
    dequantised, f32). Under tensor parallelism with
    the vocabulary split, each device looks up the ids in its own rows (others give
    zeros) and a psum assembles them (Megatron's vocab-parallel embedding): the table is
    never gathered."""
    axis = tp_axis(rules)
    spec = rules.spec(EMBED_AXES, embed.shape) if axis else None
    if axis is None or spec[0] is None:
        return _rows(embed, tokens)

    def local(e, ids):
        rows = e.matrix_shape[0] if isinstance(e, GGMLWeight) else e.shape[0]
        ids = ids - jax.lax.axis_index(axis) * rows
        mine = (ids >= 0) & (ids < rows)
        x = jnp.where(mine[:, None], _rows(e, jnp.clip(ids, 0, rows - 1)), 0)
        return jax.lax.psum(x, axis)

    in_spec = node_spec(embed, EMBED_AXES, 1, rules) if isinstance(embed, GGMLWeight) else spec
    return jax.shard_map(local, mesh=rules.mesh, in_specs=(in_spec, REPLICATED),
                         out_specs=REPLICATED, check_vma=False)(embed, tokens)


def _rows(embed: Any, ids: jax.Array) -> jax.Array:
    """Rows `ids` of an embedding table: an array's, or a GGMLWeight's dequantised (f32)."""
    return dequantize_rows(embed, ids) if isinstance(embed, GGMLWeight) else embed[ids]


def served_kv_heads(cfg: ModelConfig, tp: int) -> int:
    """The KV heads the model is served with over `tp` devices: its own, or `tp` when the
    query heads split over the devices but the fewer KV heads do not (each then repeated
    over tp / num_kv_heads devices; check_deployment asks that it divides)."""
    if tp > 1 and cfg.num_heads % tp == 0 and cfg.num_kv_heads < tp:
        return tp
    return cfg.num_kv_heads


def expand_kv_heads(params: Params, cfg: ModelConfig, tp: int) -> tuple[Params, ModelConfig]:
    """`params` and `cfg` with each KV head repeated tp / num_kv_heads times (wk, wv and
    their biases) when `served_kv_heads` says so; unchanged otherwise. Query head h reads
    KV head h // (H / K); after the repeat it reads head h // (H / tp), the copy on its own
    device: the same K and V, so the same attention (source: vLLM's KV-head replication
    for tensor parallel sizes above the KV head count)."""
    k2 = served_kv_heads(cfg, tp)
    if k2 == cfg.num_kv_heads:
        return params, cfg
    rep = k2 // cfg.num_kv_heads

    def grow(w, axis):
        if isinstance(w, GGMLWeight):  # [K * Dh, in] rows -> [K * rep * Dh, in]
            k = w.logical_shape[1]
            def rows(a):
                return jnp.repeat(a.reshape(k, -1, *a.shape[1:]), rep, axis=0).reshape(
                    -1, *a.shape[1:])
            lshape = (w.logical_shape[0], k * rep, *w.logical_shape[2:])
            return dataclasses.replace(jax.tree.map(rows, w), logical_shape=lshape)
        return None if w is None else jnp.repeat(w, rep, axis=axis)

    def layer(lp: LayerParams) -> LayerParams:
        return dataclasses.replace(lp, wk=grow(lp.wk, 1), wv=grow(lp.wv, 1),
                                   bk=grow(lp.bk, 0), bv=grow(lp.bv, 0))

    return (dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers)),
            cfg.replace(num_kv_heads=k2))
