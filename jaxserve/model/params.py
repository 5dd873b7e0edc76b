"""The param tree of a Llama-family decoder.

Each leaf is first described by a `ParamSpec` (shape, logical axes, initializer); one
description yields the abstract tree (no memory: a 70B config plans on a laptop), the
shardings for a mesh, and real initialised arrays for tests.

Layouts (logical axes in brackets), all in `ModelConfig.dtype`:
  embed       [vocab, embed]
  layers[i]   attn_norm [embed]; wq [embed, q_heads, head_dim]; wk, wv [embed, kv_heads,
              head_dim]; bq [q_heads, head_dim], bk, bv [kv_heads, head_dim] (Qwen2 only);
              wo [q_heads, head_dim, embed]; mlp_norm [embed]; w_gate, w_up [embed, mlp];
              w_down [mlp, embed]
  final_norm  [embed]
  lm_head     [embed, vocab], None when tied to `embed`
A weight named in ModelConfig.weight_formats is a GGMLWeight instead (its GGUF blocks,
output-major: a projection's [prod(out), prod(in) / 32, ...] rows, the embedding's and LM
head's [vocab, embed / 32, ...]; jaxserve.model.ggml_weight), each array with its own
dtype (ParamSpec.dtype) and the logical axes of its rows and blocks.
A tree for the C++ CPU matmul (jaxserve.model.weight_layouts.dual_precision_params, packed)
fuses the projections that share their input into one matmul each: wq holds a
FusedWeight of wq | wk | wv (wk, wv None) and w_gate one of w_gate | w_up (w_up None);
jaxserve.model.weight_layouts. Checkpoints always hold them unfused.

Layers are a tuple of per-layer trees, not one stacked array: on XLA:CPU slicing stacked
weights inside a scan copies them each step (a scanned step was slower: PERFORMANCE.md,
"Measurements behind the code").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.ggml_weight import BLOCK, GGMLWeight, block_fields
from jaxserve.pytree import pytree_dataclass
from jaxserve.distributed.sharding import ShardingRules


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Description of one weight: shape, logical axes, initializer ("normal", "ones",
    "zeros"; for the arrays of a block-quantised weight "quants": random bytes,
    "scales_q4" / "scales_q8" / "mins_q4": block scales and minimums that make its values
    span about what "normal" does: _block_field), dtype (None: the model's)."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    dtype: str | None = None


def ggml_spec(fmt: str, logical_shape: tuple[int, ...], axes: tuple[str | None, ...],
              n_in: int | None) -> GGMLWeight:
    """The GGMLWeight of ParamSpecs of a weight of `logical_shape` and logical `axes`
    stored in GGML block format `fmt`. A projection ([*in, *out], its first `n_in` axes
    contracted): out rows = prod(out) on the first output axis, in / 32 blocks on the
    first input axis. n_in None: a vocab-major table [vocab, embed] (an embedding or LM
    head), rows over vocab."""
    if n_in is None:
        (n, k), (ax_out, ax_in) = logical_shape, axes
    else:
        k, n = math.prod(logical_shape[:n_in]), math.prod(logical_shape[n_in:])
        ax_in, ax_out = axes[0], axes[n_in]
    fields = {}
    for name, (last, dtype) in block_fields(fmt).items():
        shape = (n, k // BLOCK) + (() if last is None else (last,))
        init = {"qs": "quants", "d": "scales_q8" if fmt == "q8_0" else "scales_q4",
                "m": "mins_q4"}[name]
        fields[name] = ParamSpec(shape, (ax_out, ax_in) + (() if last is None else (None,)),
                                 init, dtype)
    return GGMLWeight(**fields, fmt=fmt, logical_shape=tuple(logical_shape))


@pytree_dataclass
class LayerParams:
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    mlp_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    # LoRA adapter slots (serving with enable_lora): {projection: jaxserve.lora.LoraSlots},
    # every projection's; None without LoRA (jaxserve.model.lora)
    lora: Any = None


@pytree_dataclass
class Params:
    embed: Any
    layers: tuple
    final_norm: Any
    lm_head: Any = None


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


# The logical axes of each LayerParams field (biases: the heads of their projection).
LAYER_AXES = {
    "attn_norm": ("embed",), "wq": ("embed", "q_heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"), "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("q_heads", "head_dim", "embed"), "mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
    "bq": ("q_heads", "head_dim"), "bk": ("kv_heads", "head_dim"), "bv": ("kv_heads", "head_dim"),
}
# The LayerParams fields that are projections, with how many leading axes are inputs.
PROJECTIONS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
EMBED_AXES = ("vocab", "embed")
LM_HEAD_AXES = ("embed", "vocab")


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The logical shape of each LayerParams weight of `cfg` (biases included; a
    projection's is [*in, *out], PROJECTIONS of its axes inputs)."""
    D, H, K, Dh, F = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                      cfg.intermediate_size)
    return {"attn_norm": (D,), "wq": (D, H, Dh), "wk": (D, K, Dh), "wv": (D, K, Dh),
            "wo": (H, Dh, D), "mlp_norm": (D,), "w_gate": (D, F), "w_up": (D, F),
            "w_down": (F, D), "bq": (H, Dh), "bk": (K, Dh), "bv": (K, Dh)}


def param_specs(cfg: ModelConfig) -> Params:
    """The param tree of `cfg` with a ParamSpec at every leaf."""
    D, V = cfg.hidden_size, cfg.vocab_size
    shapes = layer_shapes(cfg)
    inits = {"attn_norm": "ones", "mlp_norm": "ones", "bq": "zeros", "bk": "zeros", "bv": "zeros"}

    def spec(name: str, shape: tuple[int, ...], i: int) -> Any:
        fmt = cfg.weight_format(name, i) if name in PROJECTIONS else None
        if fmt is not None:
            return ggml_spec(fmt, shape, LAYER_AXES[name], PROJECTIONS[name])
        return ParamSpec(shape, LAYER_AXES[name], inits.get(name, "normal"))

    def layer(i: int) -> LayerParams:
        return LayerParams(**{name: spec(name, shape, i) for name, shape in shapes.items()
                              if cfg.attention_bias or name not in ("bq", "bk", "bv")})

    def vocab_major(name: str, axes: tuple, shape: tuple[int, int]) -> Any:
        fmt = cfg.weight_format(name)  # stored [vocab, embed] whatever our float layout
        return ParamSpec(shape, axes) if fmt is None else ggml_spec(fmt, (V, D), EMBED_AXES, None)

    return Params(
        embed=vocab_major("embed", EMBED_AXES, (V, D)),
        layers=tuple(layer(i) for i in range(cfg.num_layers)),
        final_norm=ParamSpec((D,), ("embed",), "ones"),
        lm_head=None if cfg.tie_word_embeddings else vocab_major("lm_head", LM_HEAD_AXES, (D, V)),
    )


def map_specs(fn: Callable[[ParamSpec], Any], specs: Params) -> Params:
    return jax.tree.map(fn, specs, is_leaf=_is_spec)


def map_placed(fn: Callable[[ParamSpec, ShardingRules], Any], cfg: ModelConfig,
               rules: ShardingRules, staged_layers: int | None = None) -> Params:
    """fn(spec, rules of its placement) at every leaf: decoder layer i's by
    rules.for_layer(i, staged_layers or cfg.num_layers) (its pipeline stage's devices),
    the rest by `rules`."""
    specs = param_specs(cfg)
    n = staged_layers or cfg.num_layers
    place = lambda tree, r: map_specs(lambda s: fn(s, r), tree)  # noqa: E731
    return Params(embed=place(specs.embed, rules),
                  layers=tuple(place(lp, rules.for_layer(i, n)) for i, lp in enumerate(specs.layers)),
                  final_norm=place(specs.final_norm, rules),
                  lm_head=None if specs.lm_head is None else place(specs.lm_head, rules))


def param_shardings(cfg: ModelConfig, rules: ShardingRules,
                    staged_layers: int | None = None) -> Params:
    """NamedSharding for every leaf (dims not divisible by their mesh axis replicate; with
    pipeline stages, each decoder layer on its stage's devices: map_placed)."""
    return map_placed(lambda s, r: r.sharding(s.axes, s.shape), cfg, rules, staged_layers)


def abstract_params(cfg: ModelConfig, rules: ShardingRules | None = None,
                    staged_layers: int | None = None) -> Params:
    """ShapeDtypeStructs of the param tree (with shardings if `rules`: param_shardings);
    allocates nothing. staged_layers: the layer count pipeline stages are computed for
    (default cfg.num_layers; a checkpoint group read past the served layers)."""
    if rules is None:
        return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, spec_dtype(s, cfg)),
                         param_specs(cfg))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, spec_dtype(s, cfg), sharding=sh),
                        param_specs(cfg), param_shardings(cfg, rules, staged_layers),
                        is_leaf=_is_spec)


def spec_dtype(spec: ParamSpec, cfg: ModelConfig) -> jnp.dtype:
    """The dtype of a leaf: its own, else the model's."""
    return jnp.dtype(spec.dtype or cfg.dtype)


def param_count(cfg: ModelConfig) -> int:
    """Number of weights (elements of the float weights they stand for, block-quantised
    ones included), counting a tied embedding once."""
    count = lambda x: math.prod(x.logical_shape if isinstance(x, GGMLWeight) else x.shape)  # noqa: E731
    return sum(count(x) for x in jax.tree.leaves(
        param_specs(cfg), is_leaf=lambda x: _is_spec(x) or isinstance(x, GGMLWeight)))


def _block_field(init: str, uniform: jax.Array, scale, dtype) -> jax.Array | None:
    """A random block-quantised weight's array from `uniform` (values in [-1, 1), its
    shape) for the inits of ParamSpec ("quants", "scales_q4", "scales_q8", "mins_q4"), or
    None for another init. Its values then lie in about [-scale, scale]: 4-bit quants
    0..15 with d = scale / 8 and m = -scale; 8-bit -127..127 with d = scale / 127."""
    if init == "quants":
        if jnp.dtype(dtype) == jnp.int8:
            return jnp.round(uniform * 127).astype(jnp.int8)
        return jnp.floor((uniform + 1) * 128).astype(jnp.uint8)
    per = {"scales_q4": 1 / 8, "scales_q8": 1 / 127, "mins_q4": -1.0}.get(init)
    return None if per is None else jnp.full(uniform.shape, scale * per, dtype)


def init_params(cfg: ModelConfig, key: jax.Array, rules: ShardingRules | None = None,
                scale: float = 0.02) -> Params:
    """Random params (normal(0, scale) matrices, unit norms, zero biases) for tests.

    Each leaf gets its own key derived from its position, so the result does not depend
    on `rules`.
    """
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    out = []
    for i, s in enumerate(leaves):
        dtype = spec_dtype(s, cfg)
        if s.init == "ones":
            x = jnp.ones(s.shape, dtype)
        elif s.init == "zeros":
            x = jnp.zeros(s.shape, dtype)
        elif s.init != "normal":  # a block-quantised weight's arrays
            u = jax.random.uniform(jax.random.fold_in(key, i), s.shape, jnp.float32, -1, 1)
            x = _block_field(s.init, u, scale * 1.7, dtype)  # ~ the std of `scale` normals
        else:
            x = (scale * jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32)).astype(dtype)
        if rules is not None:
            x = jax.device_put(x, rules.sharding(s.axes, s.shape))
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def _hash_uniform(shape: tuple[int, ...], dtype, seed: jax.Array, scale: jax.Array) -> jax.Array:
    """uniform(-scale, scale) values [shape] from an integer hash of each element's flat
    index and `seed` (uint32 scalar): a counter-based hash, ~20x cheaper than jax.random
    on CPU. Under jit with out_shardings each device computes its own shard."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    h = (idx + seed * jnp.uint32(0x9E3779B9)) * jnp.uint32(2654435761)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(2246822519)
    h = h ^ (h >> 13)
    u = (h >> 8).astype(jnp.float32) * (2.0 / (1 << 24)) - 1.0  # [-1, 1)
    return (u * scale).astype(dtype)


@functools.lru_cache(maxsize=None)
def _dummy_maker(shape: tuple[int, ...], dtype, init: str, sharding) -> Callable:
    """The jitted maker of one dummy leaf (cached: a model's layers share their shapes)."""
    def make(seed, scale):
        if init == "ones":
            return jnp.ones(shape, dtype)
        if init == "zeros":
            return jnp.zeros(shape, dtype)
        if init != "normal":  # a block-quantised weight's arrays
            return _block_field(init, _hash_uniform(shape, jnp.float32, seed, 1.0), scale, dtype)
        return _hash_uniform(shape, dtype, seed, scale)
    return jax.jit(make, out_shardings=sharding)


def dummy_params(cfg: ModelConfig, rules: ShardingRules | None = None, seed: int = 0,
                 scale: float = 0.02 * math.sqrt(3)) -> Params:
    """Random-looking params made on the devices (vLLM's `--load-format dummy`): matrices
    uniform(-scale, scale) (std 0.02 by default, as init_params), unit norms, zero biases,
    each leaf computed in place on its shardings (with `rules`; else the default device),
    one leaf at a time: no host copy, peak memory the params themselves. Deterministic in
    `seed`; does not depend on `rules`. For benchmarks and tests of big configs; outputs
    are meaningless."""
    leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=_is_spec)
    shardings = (jax.tree.leaves(param_shardings(cfg, rules)) if rules is not None
                 else [None] * len(leaves))
    out = []
    for i, (s, sharding) in enumerate(zip(leaves, shardings, strict=True)):
        make = _dummy_maker(tuple(s.shape), spec_dtype(s, cfg), s.init, sharding)
        out.append(make(jnp.uint32((seed * 1_000_003 + i) % 2**32), jnp.float32(scale)))
    return jax.tree.unflatten(treedef, out)
