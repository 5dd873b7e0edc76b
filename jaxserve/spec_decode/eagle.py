"""An EAGLE-style draft head: one decoder layer over the target's hidden states.

The head reads, at position p, the embedding of token p (the target's own embedding
table) and the target's final hidden state ("feature", after its final norm) at p - 1,
fused by a linear layer `fc` [2D -> D]; one decoder layer with its own KV pool (the
target's pages: jaxserve.spec_decode.draft_model) and a norm give its guess of the
target's feature at p, read out through the target's LM head restricted to a draft
vocabulary of N frequent tokens (the head's logits over the other tokens are -inf). While
proposing, the head feeds its own guessed feature forward in place of the target's.
Source: EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"), indexed one position later (the head's element p pairs token p with feature
p - 1, which both exist once the target has computed p - 1); the reduced vocabulary as
EAGLE-3 / FR-Spec (Zhao et al. 2025) read the head out.

An EAGLE-3-style head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test") reads, in place of the final hidden state,
a fusion of the residual streams entering three of the target's layers (low, middle,
high: `feature_layers`, by default 2, L // 2 and L - 3 as EAGLE-3 and vLLM take them):
each RMS-normalised (no weight), concatenated and projected by `fuse` [3D -> D]. While
proposing it feeds its own output forward in that place; it is trained on its own guesses
(eagle_train's draft depths), as EAGLE-3 is.

The target's features (fused, for an EAGLE-3-style head) are kept per token slot in a
feature pool [num_pages * page_size, D] beside the head's KV pool (the drafter's cache:
(KVCache, features)), written by every step, so that a step's first row finds the feature
of the position before it.

Files (`save_head` / `load_head`): `config.json` (format, the head layer's shape, the
target's shape it was trained for, the feature layers) and `head.safetensors` (fc, fuse,
the layer, norm, vocab ids).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ConfigError, ModelConfig
from jaxserve.kernels.common import query_sequence
from jaxserve.model.ggml_weight import GGMLWeight, dequantize_rows
from jaxserve.model.kv_cache import KVCache, page_bytes
from jaxserve.model.layers import rms_norm
from jaxserve.model.params import LayerParams, Params, init_params
from jaxserve.model.tensor_parallel import embed_tokens
from jaxserve.model.inputs import StepBatch
from jaxserve.model.transformer import (Kernels, compute_logits, decoder_layers)
from jaxserve.pytree import pytree_dataclass
from jaxserve.distributed.sharding import ShardingRules
from jaxserve.spec_decode.draft_model import Drafter

FORMAT = "jaxserve-eagle-head"


@pytree_dataclass
class EagleParams:
    """fc: [2D, D] (input: concat(token embedding, previous feature)); body: Params of one
    layer (`layers`), its output norm (`final_norm`) and the draft vocabulary's LM head
    (`lm_head` [D, N]: the target's head columns of those tokens; `embed` None); vocab:
    [N] int32, the target token id of each draft logit; fuse: [3D, D] for an EAGLE-3-style
    head (`fused_features`), None for one reading the target's final hidden state."""

    fc: Any
    body: Params
    vocab: Any
    fuse: Any = None


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers (2, L // 2, L - 3; vLLM's
    `aux_hidden_state_layers`): the residual streams entering them are fused."""
    return (2, num_layers // 2, num_layers - 3)


def fused_features(fuse: Any, features, matmul: Any = None) -> jax.Array:
    """The fused feature [T, D] f32 of the residual streams `features` (one [T, D] per
    feature layer; `forward_features`): each RMS-normalised without weight, concatenated,
    times fuse [len(features) * D, D]: a float array (an f32 dot), or any weight leaf
    `matmul` (a jaxserve.model.linear.Matmul; default XLA's) runs, such as the packed bf16
    copy the engine serves (`layout_head_matrix`)."""
    x = jnp.concatenate([rms_norm(f.astype(jnp.float32), 1.0, 1e-6) for f in features], -1)
    return (matmul or Kernels().matmul).dense(x, fuse, 1, out_dtype=jnp.float32)


def head_config(target: ModelConfig, intermediate_size: int | None = None) -> ModelConfig:
    """The shape of the head's layer: the target's, one layer (and its own MLP width)."""
    return target.replace(num_layers=1,
                          intermediate_size=intermediate_size or target.intermediate_size)


def eagle_page_bytes(target: ModelConfig, page_size: int, kv_dtype: Any) -> int:
    """Bytes an EAGLE head adds to each page of the target's pool (its pools share the
    target's pages): its one layer's K and V, and the target's f32 feature of each of the
    page's token slots."""
    return (page_bytes(head_config(target), page_size, kv_dtype)
            + page_size * target.hidden_size * 4)


def init_head(target: ModelConfig, target_params: Params, vocab: np.ndarray, key: jax.Array,
              intermediate_size: int | None = None, scale: float = 0.02,
              num_feature_layers: int = 0) -> EagleParams:
    """A random head (normal(scale) matrices, unit norms) for the draft vocabulary `vocab`
    ([N] token ids), its LM head taken from the target's; num_feature_layers > 0: an
    EAGLE-3-style head fusing that many layers' features (`fuse` [n * D, D])."""
    cfg = head_config(target, intermediate_size)
    layer = init_params(cfg, key, scale=scale).layers[0]
    D = target.hidden_size
    fc = scale * jax.random.normal(jax.random.fold_in(key, 99), (2 * D, D), jnp.float32)
    fuse = None
    if num_feature_layers:
        fuse = scale * jax.random.normal(jax.random.fold_in(key, 98),
                                         (num_feature_layers * D, D), jnp.float32)
        fuse = fuse.astype(cfg.dtype)
    return EagleParams(fc=fc.astype(cfg.dtype),
                       body=Params(embed=None, layers=(layer,),
                                   final_norm=jnp.ones((D,), cfg.dtype),
                                   lm_head=draft_lm_head(target_params, vocab)),
                       vocab=jnp.asarray(vocab, jnp.int32), fuse=fuse)


def draft_lm_head(target_params: Params, vocab: np.ndarray) -> jax.Array:
    """[D, N]: the target's LM head columns of the draft vocabulary (the embedding rows
    when tied; dequantised, f32, from a block-quantised head or embedding)."""
    ids = jnp.asarray(vocab, jnp.int32)
    head = target_params.embed if target_params.lm_head is None else target_params.lm_head
    if isinstance(head, GGMLWeight):  # [vocab, D] blocks
        return dequantize_rows(head, ids).T
    if target_params.lm_head is None:
        return jnp.asarray(head)[ids].T
    return jnp.asarray(head)[:, ids]


def head_features(hp: EagleParams, embed: jax.Array, kv: KVCache, batch: StepBatch,
                  prev: jax.Array, cfg: ModelConfig, rules: ShardingRules | None,
                  kernels: Kernels) -> tuple[jax.Array, KVCache]:
    """The head over a batch: token embeddings (`embed[batch.tokens]`) and the previous
    position's features prev [T, D] -> its guessed features [T, D] (normed) and its KV
    pool with the rows' K/V written."""
    x = jnp.concatenate([embed_tokens(embed, batch.tokens, rules).astype(jnp.float32),
                         prev.astype(jnp.float32)],
                        axis=-1)
    # hp.fc: a float array, or the engine's packed copy (layout_head_matrix)
    x = kernels.matmul.dense(x, hp.fc, 1, out_dtype=jnp.float32).astype(cfg.dtype)
    x, kv = decoder_layers(x, hp.body.layers, kv, batch, cfg, rules, kernels)
    return rms_norm(x, hp.body.final_norm, cfg.rms_norm_eps), kv


def prev_slots(batch: StepBatch, page_size: int) -> jax.Array:
    """[T] int32: the slot of the position before each row's (its sequence's block
    table), -1 where the row is at position 0."""
    T = batch.tokens.shape[0]
    S = batch.seq_lens.shape[0]
    if batch.decode:
        seq = jnp.minimum(jnp.arange(T, dtype=jnp.int32), S - 1)
    else:
        seq = jnp.clip(query_sequence(batch.query_start, T), 0, S - 1)
    p = jnp.maximum(batch.positions - 1, 0)
    page = batch.block_tables[seq, p // page_size]
    return jnp.where(batch.positions > 0, page * page_size + p % page_size, -1)


def _gather(features: jax.Array, slots: jax.Array) -> jax.Array:
    return jnp.where((slots >= 0)[:, None], features[jnp.maximum(slots, 0)], 0)


@dataclasses.dataclass(frozen=True)
class EagleHead(Drafter):
    """The drafter of an EAGLE head whose layer has shape `cfg` (head_config). Its cache:
    (KVCache of one layer, features [num_slots, D] of the target: its final hidden states,
    or for an EAGLE-3-style head the fusion of those entering `feature_layers`)."""

    cfg: ModelConfig
    feature_layers: tuple[int, ...] = ()

    def sync(self, params, hp, dcache, batch, hidden, features, rules, kernels):
        kv, feats = dcache
        new = fused_features(hp.fuse, features, kernels.matmul) if self.feature_layers else hidden
        feats = feats.at[batch.slot_mapping].set(new.astype(feats.dtype))
        prev = _gather(feats, prev_slots(batch, kv.page_size))
        _, kv = head_features(hp, params.embed, kv, batch, prev, self.cfg, rules, kernels)
        return kv, feats

    def start(self, params, hp, dcache, pb):
        kv, feats = dcache
        return _gather(feats, prev_slots(pb, kv.page_size)).astype(jnp.float32)

    def step(self, params, hp, dcache, pb, carry, rules, kernels):
        kv, feats = dcache
        f, kv = head_features(hp, params.embed, kv, pb, carry, self.cfg, rules, kernels)
        reduced = compute_logits(hp.body, f, rules, kernels.matmul)            # [S, N]
        V = params.embed.shape[0]
        logits = jnp.full((reduced.shape[0], V), -jnp.inf, jnp.float32)
        logits = logits.at[:, hp.vocab].set(reduced)
        return logits, f.astype(jnp.float32), (kv, feats)


# --- files -----------------------------------------------------------------------------

def _flat(hp: EagleParams) -> dict[str, np.ndarray]:
    lp = hp.body.layers[0]
    out = {"fc": hp.fc, "norm": hp.body.final_norm, "vocab": hp.vocab}
    if hp.fuse is not None:
        out["fuse"] = hp.fuse
    for f in dataclasses.fields(LayerParams):
        v = getattr(lp, f.name)
        if v is not None:
            out[f"layer.{f.name}"] = v
    return {k: np.asarray(jax.device_get(v)) for k, v in out.items()}


def save_head(out_dir: str | Path, hp: EagleParams, target: ModelConfig,
              info: dict | None = None, feature_layers: tuple[int, ...] = ()) -> Path:
    """Write the head (not its LM head: taken from the target at load) to `out_dir`, its
    weights in float16; feature_layers: those an EAGLE-3-style head fuses (hp.fuse);
    returns the directory."""
    if bool(feature_layers) != (hp.fuse is not None) or (
            hp.fuse is not None and hp.fuse.shape[0] != len(feature_layers) * target.hidden_size):
        raise ValueError(f"feature_layers {feature_layers} do not match the head's fuse")
    from safetensors.numpy import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lp = hp.body.layers[0]
    header = {"format": FORMAT, "version": 1,
              "intermediate_size": int(lp.w_gate.shape[-1]),
              "draft_vocab_size": int(hp.vocab.shape[0]),
              "target": {"vocab_size": target.vocab_size, "hidden_size": target.hidden_size,
                         "num_heads": target.num_heads, "num_kv_heads": target.num_kv_heads,
                         "head_dim": target.head_dim, "num_layers": target.num_layers},
              "info": info or {}}
    if feature_layers:
        header["feature_layers"] = [int(i) for i in feature_layers]
    # float16: half the bytes of f32 in the repository, ample for weights of this size
    save_file({k: np.ascontiguousarray(v.astype(np.float16) if v.dtype.kind == "f" else v)
               for k, v in _flat(hp).items()}, str(out / "head.safetensors"))
    (out / "config.json").write_text(json.dumps(header, indent=2), encoding="utf-8")
    return out


def load_head(path: str | Path, target: ModelConfig, target_params: Params
              ) -> tuple[ModelConfig, EagleParams, tuple[int, ...]]:
    """The head at `path` for `target` (its LM head taken from `target_params`), in the
    target's dtype: (its layer's config, params, the feature layers it fuses: () for a
    head reading the final hidden state). Raises ConfigError naming
    SpeculativeConfig.model when `path` is not a head or was made for another target
    shape."""
    from safetensors.numpy import load_file
    d = Path(path)
    try:
        header = json.loads((d / "config.json").read_text(encoding="utf-8"))
        tensors = load_file(str(d / "head.safetensors"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"SpeculativeConfig.model: {d} is not an EAGLE head ({e})") from None
    if header.get("format") != FORMAT:
        raise ConfigError(f"SpeculativeConfig.model: {d}/config.json is not a {FORMAT}")
    want = {k: getattr(target, k) for k in header["target"]}
    if header["target"] != want:
        raise ConfigError(f"SpeculativeConfig.model: {d} was trained for a target of shape "
                          f"{header['target']}, this one is {want}")
    cfg = head_config(target, header["intermediate_size"])
    dt = jnp.dtype(target.dtype)
    layer = LayerParams(**{f.name: jnp.asarray(tensors[f"layer.{f.name}"], dt)
                           for f in dataclasses.fields(LayerParams)
                           if f"layer.{f.name}" in tensors})
    vocab = tensors["vocab"].astype(np.int32)
    feature_layers = tuple(header.get("feature_layers", ()))
    if feature_layers and ("fuse" not in tensors or tensors["fuse"].shape != (
            len(feature_layers) * target.hidden_size, target.hidden_size)):
        raise ConfigError(f"SpeculativeConfig.model: {d} names feature_layers "
                          f"{list(feature_layers)} but has no matching fuse tensor")
    hp = EagleParams(fc=jnp.asarray(tensors["fc"], dt),
                     body=Params(embed=None, layers=(layer,),
                                 final_norm=jnp.asarray(tensors["norm"], dt),
                                 lm_head=draft_lm_head(target_params, vocab).astype(dt)),
                     vocab=jnp.asarray(vocab),
                     fuse=jnp.asarray(tensors["fuse"], dt) if feature_layers else None)
    return cfg, hp, feature_layers
