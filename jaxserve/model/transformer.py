"""The Llama-family forward pass over a ragged, paged batch.

`forward` is one code path for prefill, decode and (later) chunked prefill and
speculative verification: the step's new tokens are packed one sequence after another in
a flat ragged batch of T tokens (each of the S sequences brings q_len >= 1 of them), their
K/V are written into the page pool, and each attends to its own context through its block
table. Padding costs only the bucket's rounding of T, not a rectangle of B x longest.
Pure function: params and the KV cache go in, hidden states and the updated cache come
out (callers jit it with the cache donated).

Source: Llama (Touvron et al. 2023) as implemented in HF transformers' `LlamaModel`
(pre-norm, RMSNorm, rotate_half RoPE, GQA, SwiGLU); Qwen2 adds q/k/v biases.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.model.inputs import StepBatch
from jaxserve.model.kv_cache import KVCache, write_kv
from jaxserve.model.attention import Attention, AttentionMetadata, attention_backend
from jaxserve.model.layers import apply_rope, rms_norm, rope_tables, swiglu_mlp
from jaxserve.model import pipeline
from jaxserve.model.layer_loop import StackedLayers, layer_view
from jaxserve.model import tensor_parallel as tp
from jaxserve.model.params import EMBED_AXES, LM_HEAD_AXES, LayerParams, Params
from jaxserve.model.linear import Matmul, matmul_backend
from jaxserve.kernels.sampling_ops import SamplerOps, sampler_ops
from jaxserve.lora.batched import add_lora
from jaxserve.distributed.sharding import ShardingRules, constrain

ACT_AXES = ("tokens", "embed")


def _attention_block(x, lp: LayerParams, k_pages, v_pages, cos, sin, batch: StepBatch,
                     meta: AttentionMetadata, cfg: ModelConfig, rules, kernels: Kernels,
                     layout: str, reduce_heads: str | None = None, layer=None):
    """Attention with its residual input x [T, D] -> (output [T, D], K pool, V pool).
    reduce_heads: the mesh axis to psum wo's partial sums over (inside shard_map, the
    heads split), else None. layer: None, or the int32 layer index into stacked pools
    (the layer loop). With LoRA slots (lp.lora, batch.lora_slot) each row's adapter
    delta joins every projection's output, wo's before the psum (its input split as
    wo's is: each device adds its heads' share)."""
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q, k, v = kernels.matmul.project(h, (lp.wq, lp.wk, lp.wv))  # [T, H | K | K, Dh]
    lora, row_slot, delta = lp.lora or {}, batch.lora_slot, kernels.matmul.lora_delta
    q, k, v = (add_lora(y, h, lora.get(name), row_slot, delta)
               for y, name in ((q, "wq"), (k, "wk"), (v, "wv")))
    if lp.bq is not None:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
    q = constrain(rules, apply_rope(q, cos, sin), ("tokens", "q_heads", "head_dim"))
    k = constrain(rules, apply_rope(k, cos, sin), ("tokens", "kv_heads", "head_dim"))
    v = constrain(rules, v, ("tokens", "kv_heads", "head_dim"))
    k_pages = write_kv(k_pages, k, batch.slot_mapping, layout, layer)
    v_pages = write_kv(v_pages, v, batch.slot_mapping, layout, layer)
    attn = kernels.attention(q, k_pages, v_pages, meta, layout, layer)
    out = add_lora(kernels.matmul.dense(attn, lp.wo, 2), attn, lora.get("wo"), row_slot, delta)
    if reduce_heads is not None:
        out = jax.lax.psum(out, reduce_heads)
    return constrain(rules, out, ACT_AXES), k_pages, v_pages


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The implementations one engine runs, resolved once when it is built
    (jaxserve.worker.kernel_selection.select_kernels; no "auto"), as the model calls them.

    attention: an Attention (jaxserve.model.attention: XlaAttention, CpuAttention,
        PallasAttention), which also says the KV layout to allocate; a name ("xla",
        "cpu", "pallas", "pallas_interpret") is turned into one.
    matmul: a Matmul (jaxserve.model.linear: XlaMatmul, CpuMatmul, PallasMatmul), which
        runs the projections; a name is turned into one.
    sampling: the sampler's per-row argmax / log-sum-exp, a SamplerOps
        (jaxserve.kernels.sampling_ops: XlaSamplerOps, CpuSamplerOps); a name ("xla", "cpu") is
        turned into one.
    round_x_min_rows: the row count from which the C++ bf16 matmul rounds x to bf16 for
        the CPU's dot-product instruction, None when not used (resolved: the config asked
        for it and this CPU runs it fast).
    host_branches: the step programs branch only where the host decided
        (KernelConfig.branches "host": the sampler's jaxserve.sample.plan.SamplerPlan; no
        `lax.cond` around the RoPE tables, which is there for XLA:CPU's fusion), as GPUs
        need: XLA:GPU waits on the host at a conditional. (XLA attention's choice between
        gathering a block's pages once or per row stays on device: GPUs run the Pallas
        kernels.)
    Hashable and equal by value (a part of the jitted step's static configuration)."""

    attention: Attention = dataclasses.field(default_factory=lambda: attention_backend("xla"))
    matmul: Matmul = dataclasses.field(default_factory=lambda: matmul_backend("xla"))
    sampling: SamplerOps = dataclasses.field(default_factory=lambda: sampler_ops("xla"))
    round_x_min_rows: int | None = None
    host_branches: bool = False

    def __post_init__(self):
        object.__setattr__(self, "attention", attention_backend(self.attention))
        object.__setattr__(self, "matmul", matmul_backend(self.matmul))
        object.__setattr__(self, "sampling", sampler_ops(self.sampling))


def forward(params: Params, cache: KVCache, batch: StepBatch, cfg: ModelConfig,
            rules: ShardingRules | None = None,
            kernels: Kernels = Kernels()) -> tuple[jax.Array, KVCache]:
    """Run all layers on the batch's new tokens.

    Returns hidden states [T, D] (after the final RMSNorm, in cfg.dtype) and the cache
    with this step's K/V written at `batch.slot_mapping`. `kernels` picks the attention
    and matmul implementations; params may hold QuantizedWeight projections. The cache
    may be in either layout for "xla" attention, token-major for the Pallas kernels.
    Under a tensor-parallel mesh (`rules`) the embedding and the layers run per device
    (jaxserve.model.tensor_parallel); the hidden states come back replicated.
    """
    hidden, _, cache = forward_features(params, cache, batch, cfg, rules, kernels)
    return hidden, cache


def forward_features(params: Params, cache: KVCache, batch: StepBatch, cfg: ModelConfig,
                     rules: ShardingRules | None = None, kernels: Kernels = Kernels(),
                     feature_layers: tuple[int, ...] = ()
                     ) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
    """`forward`, also returning the residual stream entering each layer of
    `feature_layers` (ascending layer indices, each < cfg.num_layers): (hidden [T, D]
    after the final norm, features: one [T, D] cfg.dtype per index, cache). What an
    EAGLE-3 draft head reads (Li et al. 2025: the low, middle and high layers' features;
    vLLM's `aux_hidden_state_layers`, taken at the same point: before layer i runs).
    Raises ValueError for indices out of order or range, or under a pipeline mesh."""
    x = tp.embed_tokens(params.embed, batch.tokens, rules).astype(cfg.dtype)
    x = constrain(rules, x, ACT_AXES)
    x, feats, cache = _run_layers(x, params.layers, cache, batch, cfg, rules, kernels,
                                  tuple(feature_layers))
    return rms_norm(x, params.final_norm, cfg.rms_norm_eps), feats, cache


def decoder_layers(x: jax.Array, layers, cache: KVCache, batch: StepBatch, cfg: ModelConfig,
                   rules: ShardingRules | None = None,
                   kernels: Kernels = Kernels()) -> tuple[jax.Array, KVCache]:
    """The decoder layers `layers` (a sequence of LayerParams, one KV pool layer each) over
    the batch's input activations x [T, D]: the residual stream after the last layer
    [T, D] (no final norm) and the cache with their K/V written. `forward` runs the model's
    layers on its token embeddings; a draft head (jaxserve.spec_decode.eagle) its own.
    Under a tensor-parallel mesh all of them run in one `jax.shard_map`, each device on
    its own heads, MLP columns and KV pool shard, with a psum after wo and w_down where
    their inputs are split (x in and out replicated). Stage-stacked layers
    (jaxserve.model.pipeline.StagedLayers) run as a pipeline over the `stage` mesh axis,
    each stage running its layers on its own tensor-parallel group as above.
    StackedLayers (one device, jaxserve.model.layer_loop) run as a loop over the stack,
    with the cache's stacked pools."""
    x, _, cache = _run_layers(x, layers, cache, batch, cfg, rules, kernels, ())
    return x, cache


def _run_layers(x, layers, cache: KVCache, batch: StepBatch, cfg: ModelConfig,
                rules: ShardingRules | None, kernels: Kernels, feature_layers: tuple[int, ...]):
    """decoder_layers, also returning the residual stream entering each layer of
    `feature_layers`: (x, features tuple, cache)."""
    n = len(layers) if not isinstance(layers, (StackedLayers, pipeline.StagedLayers)) \
        else layers.num_layers
    if list(feature_layers) != sorted(set(feature_layers)) or any(
            not 0 <= i < n for i in feature_layers):
        raise ValueError(f"feature_layers {feature_layers}: ascending layer indices in "
                         f"[0, {n})")
    if isinstance(layers, StackedLayers):
        if rules is not None and (tp.tp_axis(rules) is not None or pipeline.num_stages(rules) > 1):
            raise ValueError("the layer loop runs on one device: no tensor or pipeline mesh")
        return _looped_layers(x, layers, cache, batch, cfg, rules, kernels, feature_layers)
    if isinstance(layers, pipeline.StagedLayers):
        if feature_layers:
            raise ValueError("feature_layers: not under pipeline parallelism (the features "
                             "of a layer live on its stage)")
        def local(x, lps, pool, b, reduce_heads, reduce_mlp):
            x, _, pool = _decoder_layers(x, lps, pool, b, cfg, None, kernels, reduce_heads,
                                         reduce_mlp)
            return x, pool
        x, cache = pipeline.pipeline_layers(x, layers, cache, batch, rules, local)
        return x, (), cache
    axis = tp.tp_axis(rules)
    if axis is None:
        return _decoder_layers(x, layers, cache, batch, cfg, rules, kernels,
                               feature_layers=feature_layers)
    heads, mlp = tp.splits(layers[0], rules)
    local = functools.partial(_decoder_layers, cfg=cfg, rules=None, kernels=kernels,
                              reduce_heads=axis if heads else None,
                              reduce_mlp=axis if mlp else None, feature_layers=feature_layers)
    layer_specs = tuple(tp.layer_specs(lp, rules) for lp in layers)
    kv_specs = tp.cache_specs(cache, rules)
    rep = tp.REPLICATED
    return jax.shard_map(local, mesh=rules.mesh, in_specs=(rep, layer_specs, kv_specs, rep),
                         out_specs=(rep, (rep,) * len(feature_layers), kv_specs),
                         check_vma=False)(x, tuple(layers), cache, batch)


def _step_tables(batch: StepBatch, cfg: ModelConfig, kernels: Kernels, page_size: int):
    """What every layer of a step shares: the RoPE tables of its positions and the
    attention metadata."""
    cos, sin = rope_tables(batch.positions, cfg, fusion_barrier=not kernels.host_branches)
    meta = kernels.attention.metadata(batch.block_tables, batch.seq_lens, batch.query_start,
                                      batch.positions, page_size, batch.decode)
    return cos, sin, meta


def _decoder_layer(x, lp: LayerParams, k_pages, v_pages, cos, sin, batch: StepBatch,
                   meta: AttentionMetadata, cfg: ModelConfig, rules, kernels: Kernels,
                   layout: str, reduce_heads: str | None = None,
                   reduce_mlp: str | None = None, layer=None):
    """One decoder layer over the residual stream x [T, D]: (x after it, K pool, V pool).
    reduce_heads / reduce_mlp: mesh axes to psum the wo / w_down outputs over (inside
    shard_map); layer: the int32 index into stacked pools (the layer loop) or None."""
    a, k_pages, v_pages = _attention_block(x, lp, k_pages, v_pages, cos, sin, batch, meta,
                                           cfg, rules, kernels, layout, reduce_heads, layer)
    x = x + a
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    mlp = swiglu_mlp(h, lp.w_gate, lp.w_up, lp.w_down, rules, kernels.matmul, lp.lora,
                     batch.lora_slot)
    if reduce_mlp is not None:
        mlp = jax.lax.psum(mlp, reduce_mlp)
    return constrain(rules, x + mlp, ACT_AXES), k_pages, v_pages


# One decoder layer as one program function: the unrolled stack calls it once per layer,
# so JAX traces and lowers a layer once per step program (not num_layers times) and XLA
# inlines the calls before it optimises (measured: PERFORMANCE.md, "The test suite's
# time"). Static: cfg, rules, kernels, layout, reduce_heads, reduce_mlp.
_traced_layer = jax.jit(_decoder_layer, static_argnums=(8, 9, 10, 11, 12, 13))


def _looped_layers(x, layers: StackedLayers, cache: KVCache, batch: StepBatch,
                   cfg: ModelConfig, rules: ShardingRules | None, kernels: Kernels,
                   feature_layers: tuple[int, ...] = ()):
    """The decoder layers as a fori_loop over `layers`' stack and the cache's stacked
    pools (KVCache.stacked), carried through the loop and updated in place; the features
    carried too, each taking x at its layer: (x, features, cache). (Not one loop per
    stretch between feature layers: measured 4% slower a 16-row step.)"""
    if not cache.stacked:
        raise ValueError("stacked layers need a stacked KV pool (init_kv_cache(stacked=True))")
    cos, sin, meta = _step_tables(batch, cfg, kernels, cache.page_size)

    def body(i, carry):
        x, feats, k_pool, v_pool = carry
        # x kept in its feature's slot before layer i runs
        feats = tuple(jnp.where(i == j, x, f) for j, f in zip(feature_layers, feats))
        x, k_pool, v_pool = _decoder_layer(x, layer_view(layers, i), k_pool, v_pool, cos, sin,
                                           batch, meta, cfg, rules, kernels, cache.layout,
                                           layer=i)
        return x, feats, k_pool, v_pool

    x, feats, k_pool, v_pool = jax.lax.fori_loop(
        0, layers.num_layers, body,
        (x, tuple(jnp.zeros_like(x) for _ in feature_layers), cache.k[0], cache.v[0]))
    return x, feats, KVCache(k=(k_pool,), v=(v_pool,), layout=cache.layout, stacked=True)


def _decoder_layers(x, layers, cache: KVCache, batch: StepBatch, cfg: ModelConfig,
                    rules: ShardingRules | None, kernels: Kernels,
                    reduce_heads: str | None = None, reduce_mlp: str | None = None,
                    feature_layers: tuple[int, ...] = ()):
    """decoder_layers on one device (or under GSPMD with `rules`); reduce_heads /
    reduce_mlp: mesh axes to psum the wo / w_down outputs over (inside shard_map):
    (x, the features entering `feature_layers`, cache)."""
    cos, sin, meta = _step_tables(batch, cfg, kernels, cache.page_size)
    ks, vs, feats = [], [], []
    for i, lp in enumerate(layers):
        if i in feature_layers:
            feats.append(x)
        x, kp, vp = _traced_layer(x, lp, cache.k[i], cache.v[i], cos, sin, batch, meta, cfg,
                                  rules, kernels, cache.layout, reduce_heads, reduce_mlp)
        ks.append(kp)
        vs.append(vp)
    return x, tuple(feats), KVCache(k=tuple(ks), v=tuple(vs), layout=cache.layout)


def compute_logits(params: Params, hidden: jax.Array, rules: ShardingRules | None = None,
                   matmul: Matmul | str = "xla") -> jax.Array:
    """LM head: hidden [..., D] -> logits [..., vocab] f32, by `matmul`'s lm_head (tied to
    the embedding when `params.lm_head` is None). Under a tensor-parallel mesh each device
    computes its own vocabulary columns (in shard_map, any kernel); the logits come back
    split over the vocabulary (the sampler's reductions run on that split)."""
    mm = matmul_backend(matmul)
    axis = tp.tp_axis(rules)
    if axis is None:
        logits = mm.lm_head(hidden, params.embed, params.lm_head)
        return constrain(rules, logits, (None,) * (logits.ndim - 1) + ("vocab",))
    embed_spec = tp.node_spec(params.embed, EMBED_AXES, 1, rules)
    head_spec = tp.node_spec(params.lm_head, LM_HEAD_AXES, 1, rules)
    out = PartitionSpec(*(None,) * (hidden.ndim - 1), tp.vocab_axis(params, rules))
    return jax.shard_map(lambda h, e, w: mm.lm_head(h, e, w), mesh=rules.mesh,
                         in_specs=(tp.REPLICATED, embed_spec, head_spec), out_specs=out,
                         check_vma=False)(hidden, params.embed, params.lm_head)


def logits_sharding(params: Params, rules: ShardingRules | None, vocab_size: int
                    ) -> NamedSharding | None:
    """The sharding of `compute_logits`' [rows, vocab] output: split over the vocabulary
    as the LM head is under tensor parallelism, else as the rules place the `vocab` axis;
    None without a mesh (one device)."""
    if rules is None:
        return None
    axis = tp.tp_axis(rules)
    if axis is None:
        return rules.sharding((None, "vocab"), (1, vocab_size))
    return NamedSharding(rules.mesh, PartitionSpec(None, tp.vocab_axis(params, rules)))


def pin_lm_head(params: Params, rules: ShardingRules | None) -> Params:
    """params with the embedding and LM head constrained to their tensor-parallel
    shardings: for `compute_logits` inside a loop body, where the weights it closes over
    arrive without their sharding and the partitioner could otherwise gather them.
    params as it is without a TP mesh."""
    if tp.tp_axis(rules) is None:
        return params

    def pin(node, axes):
        if node is None:
            return None
        specs = tp.node_spec(node, axes, 1, rules)
        return jax.tree.map(lambda x, spec: jax.lax.with_sharding_constraint(
            x, NamedSharding(rules.mesh, spec)), node, specs)

    return dataclasses.replace(params, embed=pin(params.embed, EMBED_AXES),
                               lm_head=pin(params.lm_head, LM_HEAD_AXES))


def last_token_logits(params: Params, hidden: jax.Array, logits_indices: jax.Array,
                      rules: ShardingRules | None = None,
                      matmul: Matmul | str = "xla") -> jax.Array:
    """Logits [S, vocab] f32 of hidden [T, D] at the rows `logits_indices` [S] int32 (each
    sequence's last token)."""
    return compute_logits(params, hidden[logits_indices], rules, matmul)
