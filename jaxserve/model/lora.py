"""LoRA adapter slots in the model's params: every decoder layer's pools
(LayerParams.lora, {projection: jaxserve.lora.batched.LoraSlots}) and one adapter written
into or cleared from a slot of all of them at once.

The pools keep their shapes whatever is loaded: `max_loras + 1` slots (slot 0 = no
adapter, zeros) of rank `max_lora_rank`, for all seven projections of every layer (an
adapter that leaves a projection or a layer alone has zero factors there). Loading,
swapping or unloading an adapter changes values only: `slot_writer` is one program,
compiled when the engine is built, that writes a slot of every pool from host arrays
(`adapter_arrays`). Under tensor parallelism the pools are split as the base projections
are (jaxserve.model.tensor_parallel.lora_specs); under the layer loop they are stacked
[L, ...] with the other layer weights, and the loop's layer index travels with them
(LoraSlots.layer: the C++ kernel reads that layer in place, the jnp form slices it).

Source: S-LoRA (Sheng et al., 2023: a unified pool of adapter weights, loaded without
touching the compiled kernels), vLLM's LoRAModelManager (slots of max_loras, activated
and deactivated by index).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import LoRAConfig, ModelConfig
from jaxserve.lora.adapter import LoraAdapter, flat_shapes
from jaxserve.lora.batched import LoraSlots, empty_slots
from jaxserve.model import tensor_parallel as tp
from jaxserve.model.layer_loop import StackedLayers
from jaxserve.model.params import LAYER_AXES, PROJECTIONS, Params, layer_shapes


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each projection's logical shape ([*in, *out], jaxserve.model.params layout)."""
    shapes = layer_shapes(cfg)
    return {name: shapes[name] for name in PROJECTIONS}


def lora_dtype(lcfg: LoRAConfig, cfg: ModelConfig) -> jnp.dtype:
    """The pools' dtype: lora_dtype, "auto" = the model's."""
    return jnp.dtype(cfg.dtype if lcfg.lora_dtype == "auto" else lcfg.lora_dtype)


def layer_pools(cfg: ModelConfig, lcfg: LoRAConfig) -> dict[str, LoraSlots]:
    """One layer's zeroed pools: {projection: LoraSlots a [S, in, R], b [S, R, out]},
    S = max_loras + 1, R = max_lora_rank."""
    dt = lora_dtype(lcfg, cfg)
    flat = flat_shapes(cfg)
    return {name: empty_slots(lcfg.num_slots, *flat[name], lcfg.max_lora_rank, dt, shape)
            for name, shape in projection_shapes(cfg).items()}


def pool_bytes(cfg: ModelConfig, lcfg: LoRAConfig, rules=None) -> tuple[int, int]:
    """(bytes on one device, bytes on all devices) of every layer's pools (the memory
    plan's LoRA term; 0 without enable_lora): A and B of each projection, split over a
    tensor-parallel mesh (`rules`, abstract or real) as tensor_parallel.lora_specs
    splits them (a factor not split is on every device)."""
    if not lcfg.enable_lora:
        return 0, 0
    itemsize = lora_dtype(lcfg, cfg).itemsize
    devices = 1 if rules is None else rules.mesh.size
    flat = flat_shapes(cfg)
    one = every = 0
    for name, shape in projection_shapes(cfg).items():
        n_in, n_out = flat[name]
        ax_in = ax_out = None
        if tp.tp_axis(rules) is not None:
            ax_in, ax_out = tp._split_axes(rules.spec(LAYER_AXES[name], shape), PROJECTIONS[name])
        for size, ax in ((n_in, ax_in), (n_out, ax_out)):
            split = 1 if ax is None else rules.mesh.shape[ax]
            one += size // split
            every += size // split * devices
    scale = cfg.num_layers * lcfg.num_slots * lcfg.max_lora_rank * itemsize
    return one * scale, every * scale


def attach_pools(params: Params, cfg: ModelConfig, lcfg: LoRAConfig, rules=None) -> Params:
    """`params` (a tuple of LayerParams, before the layer loop stacks them) with zeroed
    LoRA pools in every layer, placed as the model's shard_map reads them under a
    tensor-parallel mesh (`rules`). Raises ValueError for stage-stacked layers
    (pipeline parallelism serves no LoRA)."""
    if not isinstance(params.layers, tuple):
        raise ValueError("LoRA pools are attached to a tuple of layers (not pipeline stages)")
    layers = []
    for lp in params.layers:
        pools = layer_pools(cfg, lcfg)
        if tp.tp_axis(rules) is not None:
            specs = tp.lora_specs(pools, rules)
            pools = jax.tree.map(lambda x, s: jax.device_put(
                x, jax.sharding.NamedSharding(rules.mesh, s)), pools, specs)
        elif rules is not None:
            pools = jax.device_put(pools, jax.sharding.NamedSharding(
                rules.mesh, jax.sharding.PartitionSpec()))
        layers.append(dataclasses.replace(lp, lora=pools))
    return dataclasses.replace(params, layers=tuple(layers))


def lora_pools(params: Params):
    """The LoRA pools of `params`: a tuple (one {projection: LoraSlots} per layer), or one
    dict of stacked [L, ...] pools under the layer loop; None without LoRA (and for
    pipeline stages, which serve none)."""
    layers = params.layers
    if isinstance(layers, StackedLayers):
        return layers.layers.lora
    if not isinstance(layers, tuple) or layers[0].lora is None:
        return None
    return tuple(lp.lora for lp in layers)


def with_pools(params: Params, pools) -> Params:
    """`params` with its LoRA pools replaced by `pools` (lora_pools' form)."""
    layers = params.layers
    if isinstance(layers, StackedLayers):
        return dataclasses.replace(params, layers=dataclasses.replace(
            layers, layers=dataclasses.replace(layers.layers, lora=pools)))
    return dataclasses.replace(params, layers=tuple(
        dataclasses.replace(lp, lora=p) for lp, p in zip(layers, pools)))


def adapter_arrays(adapter: LoraAdapter | None, cfg: ModelConfig, lcfg: LoRAConfig
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{projection: (A [L, in, R], B [L, R, out])} host arrays of `adapter` padded to the
    pools' rank, in their dtype (zeros for projections it does not adapt; all zeros for
    None: a cleared slot). `cfg` is the served shape: an adapter's wk / wv outputs are
    repeated over KV heads as the base weights are (jaxserve.model.tensor_parallel.
    expand_kv_heads) when cfg serves more KV heads than the adapter was trained with.
    Raises ValueError for a rank above max_lora_rank or a layer count other than cfg's."""
    R, L = lcfg.max_lora_rank, cfg.num_layers
    dt = lora_dtype(lcfg, cfg)
    flat = flat_shapes(cfg)
    out = {}
    if adapter is not None and (adapter.rank > R or len(adapter.a) != L):
        raise ValueError(f"LoRA adapter {adapter.name}: rank {adapter.rank} / {len(adapter.a)} "
                         f"layers; the pools hold rank <= {R} over {L} layers")
    for name in PROJECTIONS:
        n_in, n_out = flat[name]
        a = np.zeros((L, n_in, R), np.float32)
        b = np.zeros((L, R, n_out), np.float32)
        if adapter is not None and name in adapter.targets:
            r = adapter.rank
            for i in range(L):
                a[i, :, :r] = adapter.a[i][name]
                bi = adapter.b[i][name]
                if bi.shape[1] != n_out:  # KV heads repeated over more devices
                    rep = n_out // bi.shape[1]
                    bi = np.repeat(bi.reshape(r, -1, cfg.head_dim), rep, axis=1).reshape(r, -1)
                b[i, :r] = bi
        out[name] = (a.astype(dt), b.astype(dt))
    return out


def slot_writer(pools):
    """A jitted function (pools, slot int32, arrays) -> pools with slot `slot` of every
    pool set from `arrays` (adapter_arrays' form); the old pools donated, the new ones
    placed as the old (the tensor-parallel shards stay where they were). `pools`:
    lora_pools' form, fixing the program's shapes and shardings."""
    shardings = jax.tree.map(lambda x: x.sharding, pools)
    stacked = isinstance(pools, dict)

    def write(pools, slot, arrays):
        if stacked:  # {name: LoraSlots a [L, S, in, R]}
            return {name: dataclasses.replace(
                p, a=p.a.at[:, slot].set(arrays[name][0]),
                b=p.b.at[:, slot].set(arrays[name][1])) for name, p in pools.items()}
        return tuple({name: dataclasses.replace(
            p, a=p.a.at[slot].set(arrays[name][0][i]), b=p.b.at[slot].set(arrays[name][1][i]))
            for name, p in layer.items()} for i, layer in enumerate(pools))

    return jax.jit(write, donate_argnums=(0,), out_shardings=shardings)


__all__ = ["adapter_arrays", "attach_pools", "layer_pools", "lora_dtype", "lora_pools",
           "pool_bytes", "projection_shapes", "slot_writer", "with_pools"]
