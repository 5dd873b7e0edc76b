"""Pipeline parallelism as explicit SPMD: the decoder layers split into consecutive stages
over the `stage` mesh axis, one jitted step for all of them.

Layout. With PP stages and L layers, stage s holds layers s * Lp .. s * Lp + Lp - 1
(Lp = ceil(L / PP)). Local layer j of every stage is stacked into one array [PP, ...]
split over `stage` (`StagedLayers`), and so is its KV pool ([PP, pages, ...]): each
device holds only its stage's layers and their pages, split further over `model` by
tensor parallelism inside the stage. When PP does not divide L the last stage's extra
slots hold all-zero layers, which are exactly the identity on the residual stream: their
RMSNorm weight, projections and biases are zero (quantised ones: zero values and
scales), so attention and MLP add 0 (tested with the XLA and C++ kernels).

Schedule (GPipe's, per step). The step's flat ragged batch is split into M microbatches
of equal shape (`split_microbatches`: a decode batch by sequences, a prefill / mixed
batch by token rows: a prompt chunk cut between two microbatches is fine, because a
stage runs microbatch m before m + 1, so the later rows find the earlier rows' K/V in
the pool). At tick t = 0 .. M + PP - 2 stage s runs microbatch t - s through its layers
and passes the activations [T / M, D] to stage s + 1 by `ppermute`; a stage with no
microbatch at a tick (the bubble) computes on stale data and writes its K/V to the null
page (slot 0). The last stage's outputs are summed over `stage` (only it holds non-zero
ones), so the hidden states leave replicated, and the LM head and sampler run after the
pipeline on every device, as without stages. Stage utilisation is M / (M + PP - 1).

Why SPMD and not one program per stage (MPMD): the host loop dispatches one program per
step (its host time per step: PERFORMANCE.md, "Measurements behind the code"), and a decode step of
a small batch is short on a GPU: dispatching and synchronising PP
programs per step, with the host passing activations between them, would add that cost
per stage. Here the stages' hand-offs are device-to-device collectives inside one
program, and the host does not know stages exist.

Source: Huang et al. 2019, "GPipe" (microbatch schedule, bubble (PP - 1) / (M + PP - 1));
the scan-over-stages pipelining of praxis / MaxText (stage-stacked weights, a ppermute
per iteration).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.model.kv_cache import KVCache
from jaxserve.model import tensor_parallel as tp
from jaxserve.model.params import LayerParams, Params
from jaxserve.pytree import pytree_dataclass
from jaxserve.distributed.sharding import ShardingRules, layers_per_stage

STAGE_AXES = ("stages",)  # the logical axis of the stacked leading dimension


@pytree_dataclass(meta=("num_layers", "microbatches", "decode_microbatches"))
class StagedLayers:
    """A model's decoder layers stacked by stage: `layers` is a tuple of Lp LayerParams
    whose every leaf has a leading [PP] axis (split over `stage`); local layer j of stage
    s is layer s * Lp + j of the model, all zeros past `num_layers` (the identity).
    microbatches / decode_microbatches: the microbatches a prefill / mixed step and a
    decode step aim for (ParallelConfig.microbatches, .pipeline_decode_microbatches).
    Params.layers holds one of these instead of a tuple of LayerParams when the engine
    runs pipeline stages."""

    layers: tuple
    num_layers: int
    microbatches: int = 1
    decode_microbatches: int = 1

    @property
    def num_stages(self) -> int:
        return jax.tree.leaves(self.layers[0])[0].shape[0]

    def template(self) -> LayerParams:
        """One stage's local layer 0 as ShapeDtypeStructs (the leaf types and shapes the
        tensor-parallel specs are derived from)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.layers[0])


def num_stages(rules: ShardingRules | None) -> int:
    """Pipeline stages of the mesh (1 without a `stage` axis)."""
    return 1 if rules is None else rules.size("stages")


def _stacked_spec(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec("stage", *spec)


def staged_specs(staged: StagedLayers, rules: ShardingRules) -> StagedLayers:
    """PartitionSpec tree of staged layers: `stage` on the leading axis, then each leaf's
    tensor-parallel spec (jaxserve.model.tensor_parallel.layer_specs)."""
    one = tp.layer_specs(staged.template(), rules)
    specs = jax.tree.map(_stacked_spec, one, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return dataclasses.replace(staged, layers=(specs,) * len(staged.layers))


def stage_params(params: Params, rules: ShardingRules, microbatches: int = 1,
                 decode_microbatches: int = 1, donate: bool = False) -> Params:
    """`params` with its layers stacked by stage (`StagedLayers`), each stacked leaf on
    `stage` x its tensor-parallel spec, so that a device keeps only its stage's layers.

    When every layer sits on its own stage's devices (the shardings of param_shardings /
    rules.for_layer, which load_params and dummy_params use in one process), each
    device's part of a stacked leaf is its copy of its own stage's layer: no layer
    crosses devices, and with `donate` each input layer's arrays are deleted once
    stacked (the engine's build keeps only the staged tree), so stacking costs one leaf.
    Otherwise (layers on the whole mesh, as over several processes) one jitted stack per
    local layer index gathers nothing either: every device already holds every layer.
    Raises ValueError when the mesh has more stages than the model has layers."""
    pp = num_stages(rules)
    L = len(params.layers)
    if pp > L:
        raise ValueError(f"{pp} pipeline stages for {L} layers: each stage needs one")
    lp = layers_per_stage(L, pp)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    specs = tp.layer_specs(params.layers[0], rules)  # the same for every layer
    spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
    placed = all(
        x.sharding.is_equivalent_to(NamedSharding(rules.stage(i // lp).mesh, s), x.ndim)
        for i, layer in enumerate(params.layers)
        for x, s in zip(jax.tree.leaves(layer), spec_leaves, strict=True))
    if not placed:
        stacked = _stack_whole(params.layers, rules, specs, pp, lp)
        return dataclasses.replace(params, layers=StagedLayers(
            layers=stacked, num_layers=L, microbatches=microbatches,
            decode_microbatches=decode_microbatches))
    first = jax.tree.leaves(params.layers[0])
    shapes, dtypes = [x.shape for x in first], [x.dtype for x in first]
    treedef = jax.tree.structure(params.layers[0])
    stacked = []
    for j in range(lp):
        sources = [s * lp + j for s in range(pp)]
        leaves = [jax.tree.leaves(params.layers[i]) if i < L else None for i in sources]
        out = []
        for k, spec in enumerate(spec_leaves):
            parts = {}
            for s, i in enumerate(sources):
                target = NamedSharding(rules.stage(s).mesh, spec)
                if i >= L:  # a short last stage: zero layers (the identity)
                    shard = target.shard_shape(shapes[k])
                    for d in target.addressable_devices:
                        parts[d] = jnp.zeros((1, *shard), dtypes[k], device=d)
                    continue
                x = leaves[s][k]
                for shard in x.addressable_shards:
                    parts[shard.device] = shard.data[None]
                if donate and not leaves[s][k].is_deleted():
                    leaves[s][k].delete()
            shape = (pp, *shapes[k])
            sharding = NamedSharding(rules.mesh, PartitionSpec("stage", *spec))
            out.append(jax.make_array_from_single_device_arrays(
                shape, sharding, [parts[d] for d in sharding.addressable_devices]))
        stacked.append(jax.tree.unflatten(treedef, out))
    return dataclasses.replace(params, layers=StagedLayers(
        layers=tuple(stacked), num_layers=L, microbatches=microbatches,
        decode_microbatches=decode_microbatches))


def _stack_whole(layers, rules: ShardingRules, specs, pp: int, lp: int) -> tuple:
    """stage_params for layers held on the whole mesh: a jitted stack per local layer
    index, out on `stage` x the layer's spec (each device keeps its stage's slice)."""
    L = len(layers)
    shardings = jax.tree.map(lambda s: NamedSharding(rules.mesh, PartitionSpec("stage", *s)),
                             specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

    @functools.partial(jax.jit, static_argnums=0, out_shardings=shardings)
    def stack(n_real, *real):
        pad = [jax.tree.map(jnp.zeros_like, real[0])] * (pp - n_real)
        return jax.tree.map(lambda *xs: jnp.stack(xs), *real, *pad)

    out = []
    for j in range(lp):
        real = [layers[s * lp + j] for s in range(pp) if s * lp + j < L]
        out.append(stack(len(real), *real))
    return tuple(out)


def split_microbatches(batch, M: int):
    """A StepBatch (jaxserve.model.transformer) as M microbatches of equal shape, every
    array with a leading [M] axis.

    Decode batch (T == S): microbatch m is sequences / rows m * S / M .. (m + 1) * S / M,
    itself a decode batch. Otherwise microbatch m is token rows m * T / M .. (m+1) * T / M
    with all S sequences: query_start clipped to those rows, and seq_lens the context
    length after the microbatch's own rows (0 for a sequence with none there, so kernels
    see it as padding). logits_indices are not split (the pipeline's
    output is reassembled into the whole batch's rows). Raises ValueError when M does not
    divide the rows."""
    T, S = batch.tokens.shape[0], batch.seq_lens.shape[0]
    if T % M:
        raise ValueError(f"{M} microbatches do not divide the step's {T} token rows")
    rows = lambda a: a.reshape(M, -1, *a.shape[1:])  # noqa: E731
    if batch.decode:
        n = S // M
        qs = jnp.broadcast_to(jnp.arange(n + 1, dtype=jnp.int32), (M, n + 1))
        return dataclasses.replace(
            batch, tokens=rows(batch.tokens), positions=rows(batch.positions),
            slot_mapping=rows(batch.slot_mapping), block_tables=rows(batch.block_tables),
            seq_lens=rows(batch.seq_lens), query_start=qs, logits_indices=None,
)
    tm = T // M
    lo = (jnp.arange(M, dtype=jnp.int32) * tm)[:, None]  # [M, 1]
    qs = batch.query_start[None, :]
    local_qs = jnp.clip(qs - lo, 0, tm)  # [M, S + 1]
    start, end = qs[:, :-1], qs[:, 1:]
    later = end - jnp.clip(lo + tm, start, end)  # a sequence's rows after this microbatch
    q_len = local_qs[:, 1:] - local_qs[:, :-1]
    seq_lens = jnp.where(q_len > 0, batch.seq_lens[None, :] - later, 0)
    return dataclasses.replace(
        batch, tokens=rows(batch.tokens), positions=rows(batch.positions),
        slot_mapping=rows(batch.slot_mapping),
        block_tables=jnp.broadcast_to(batch.block_tables, (M,) + batch.block_tables.shape),
        seq_lens=seq_lens, query_start=local_qs, logits_indices=None)


def microbatches_for(batch, target: int) -> int:
    """The microbatch count of a step: the largest M <= target dividing its sequences
    (decode) or token rows (otherwise)."""
    n = batch.seq_lens.shape[0] if batch.decode else batch.tokens.shape[0]
    return max(m for m in range(1, max(1, min(target, n)) + 1) if n % m == 0)


def pipeline_layers(x: jax.Array, staged: StagedLayers, cache: KVCache, batch,
                    rules: ShardingRules, layers_fn) -> tuple[jax.Array, KVCache]:
    """The staged decoder layers over the batch's input activations x [T, D] (replicated):
    the residual stream after the last layer [T, D] (replicated) and the staged cache
    (each array [PP, ...]) with this step's K/V written, run as the module docstring's
    schedule with `staged.microbatches` (`.decode_microbatches` for a decode batch;
    reduced to a divisor of the step: microbatches_for).
    layers_fn(x, layers, cache, batch, reduce_heads, reduce_mlp): one device's run of its
    local layers (transformer._decoder_layers)."""
    pp = staged.num_stages
    M = microbatches_for(batch, staged.decode_microbatches if batch.decode
                         else staged.microbatches)
    mb = split_microbatches(batch, M)
    T, D = x.shape
    x_mb = x.reshape(M, T // M, D)
    axis = tp.tp_axis(rules)
    heads, mlp = tp.splits(staged.template(), rules) if axis else (False, False)
    perm = [(s, (s + 1) % pp) for s in range(pp)]

    def local(x_mb, layers, cache, mb):
        layers = jax.tree.map(lambda a: a[0], layers)
        pool = KVCache(k=tuple(a[0] for a in cache.k), v=tuple(a[0] for a in cache.v),
                       layout=cache.layout)
        stage = jax.lax.axis_index("stage")

        def tick(t, carry):
            buf, out, pool = carry
            m = t - stage
            valid = (m >= 0) & (m < M)
            mc = jnp.clip(m, 0, M - 1)
            b = jax.tree.map(lambda a: a[mc], mb)
            b = dataclasses.replace(b, slot_mapping=jnp.where(valid, b.slot_mapping, 0))
            y, pool = layers_fn(jnp.where(stage == 0, x_mb[mc], buf), layers, pool, b,
                                axis if heads else None, axis if mlp else None)
            keep = valid & (stage == pp - 1)
            out = jnp.where(keep, jax.lax.dynamic_update_index_in_dim(out, y, mc, 0), out)
            return jax.lax.ppermute(y, "stage", perm), out, pool

        init = (jnp.zeros_like(x_mb[0]), jnp.zeros_like(x_mb), pool)
        _, out, pool = jax.lax.fori_loop(0, M + pp - 1, tick, init)
        out = jax.lax.psum(out, "stage")
        return out, KVCache(k=tuple(a[None] for a in pool.k), v=tuple(a[None] for a in pool.v),
                            layout=pool.layout)

    layer_specs = staged_specs(staged, rules).layers
    kv_specs = tp.cache_specs(cache, rules)
    rep = tp.REPLICATED
    out, cache = jax.shard_map(local, mesh=rules.mesh,
                               in_specs=(rep, layer_specs, kv_specs, rep),
                               out_specs=(rep, kv_specs), check_vma=False)(
        x_mb, staged.layers, cache, mb)
    return out.reshape(T, D), cache
