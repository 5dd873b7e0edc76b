"""Training an EAGLE head by self-distillation: the target's own outputs and hidden states
teach the head to guess the next hidden state (tools/train_draft_head.py drives this).

Each example is a window of one sequence (prompt + the target's answer): tokens x_p,
the target's features f_p (final hidden states) and positions. The head's element p
reads (x_p, f_{p-1}) and guesses f_p; the loss is EAGLE's: smooth-L1 between guessed
and true feature plus 0.1 x the cross-entropy between the target's next-token
distribution and the head's, both over the draft vocabulary (Li et al. 2024, section 4.3).
Inputs carry a little uniform noise (EAGLE's data augmentation: at inference the head
reads its own guesses). `head_forward` is the same computation as the serving path
(jaxserve.spec_decode.eagle.head_features over the paged KV pool), written over whole
windows with a causal mask (tested equal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.layers import apply_rope, rms_norm, rope_tables, swiglu_mlp
from jaxserve.spec_decode.eagle import EagleParams

REG_WEIGHT, CLS_WEIGHT = 1.0, 0.1   # EAGLE's loss weights
NOISE = 0.1                          # half-width of the uniform noise on input features (x RMS)


def head_forward(hp: EagleParams, embed: jax.Array, tokens: jax.Array, prev: jax.Array,
                 positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The head over windows: tokens [B, W] int32, prev [B, W, D] (the feature of the
    position before each), positions [B, W] int32 -> guessed features [B, W, D] f32, each
    attending causally within its window (all f32, XLA ops)."""
    B, W = tokens.shape
    D = embed.shape[1]
    x = jnp.concatenate([embed[tokens].astype(jnp.float32), prev.astype(jnp.float32)], -1)
    x = (x @ hp.fc.astype(jnp.float32)).reshape(B * W, D)
    lp = hp.body.layers[0]
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q = jnp.einsum("td,dhk->thk", h, lp.wq.astype(jnp.float32))
    k = jnp.einsum("td,dhk->thk", h, lp.wk.astype(jnp.float32))
    v = jnp.einsum("td,dhk->thk", h, lp.wv.astype(jnp.float32))
    cos, sin = rope_tables(positions.reshape(-1), cfg)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    H, KH, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = q.reshape(B, W, KH, H // KH, Dh)
    k, v = k.reshape(B, W, KH, Dh), v.reshape(B, W, KH, Dh)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, k) / jnp.sqrt(jnp.float32(Dh))
    causal = jnp.tril(jnp.ones((W, W), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    attn = jnp.einsum("bgrqk,bkgd->bqgrd", jax.nn.softmax(scores, axis=-1), v)
    attn = attn.reshape(B * W, H, Dh)
    x = x + jnp.einsum("thk,hkd->td", attn, lp.wo.astype(jnp.float32))
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    x = x + swiglu_mlp(h, lp.w_gate.astype(jnp.float32), lp.w_up.astype(jnp.float32),
                       lp.w_down.astype(jnp.float32), None)
    return rms_norm(x, hp.body.final_norm.astype(jnp.float32), cfg.rms_norm_eps).reshape(B, W, D)


def shifted_features(features: jax.Array) -> jax.Array:
    """prev [B, W, D]: the feature of the position before each (0 before the first)."""
    return jnp.pad(features, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def loss_fn(trainable, frozen, batch, cfg: ModelConfig, key: jax.Array | None = None):
    """EAGLE's loss on a batch {tokens [B, W], features [B, W, D], positions [B, W],
    mask [B, W] (1 where the position counts: real tokens after the window's first)}.
    trainable: {"fc", "layer", "norm"}; frozen: {"embed" [V, D], "lm_head" [D, N]}.
    key: noise on the input features (None: none). Returns (loss, {"reg", "cls", "top1"})
    where top1 is the share of positions whose head argmax is the target's."""
    hp = join(trainable, frozen)
    feats = batch["features"].astype(jnp.float32)
    prev = shifted_features(feats)
    if key is not None:
        scale = jnp.sqrt(jnp.mean(prev ** 2, axis=-1, keepdims=True))
        prev = prev + NOISE * scale * jax.random.uniform(key, prev.shape, minval=-1, maxval=1)
    guess = head_forward(hp, frozen["embed"], batch["tokens"], prev, batch["positions"], cfg)
    mask = batch["mask"].astype(jnp.float32)
    denom = jnp.maximum(mask.sum(), 1.0)
    diff = jnp.abs(guess - feats)
    smooth_l1 = jnp.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5).mean(-1)
    reg = (smooth_l1 * mask).sum() / denom
    head = frozen["lm_head"].astype(jnp.float32)
    target_logp = jax.nn.log_softmax(feats @ head, -1)
    guess_logits = guess @ head
    cls = (-(jnp.exp(target_logp) * jax.nn.log_softmax(guess_logits, -1)).sum(-1) * mask).sum() / denom
    top1 = ((guess_logits.argmax(-1) == target_logp.argmax(-1)) * mask).sum() / denom
    return REG_WEIGHT * reg + CLS_WEIGHT * cls, {"reg": reg, "cls": cls, "top1": top1}


def split(hp: EagleParams, embed: jax.Array) -> tuple[dict, dict]:
    """(trainable, frozen) pytrees of a head (see loss_fn)."""
    return ({"fc": hp.fc, "layer": hp.body.layers[0], "norm": hp.body.final_norm},
            {"embed": embed, "lm_head": hp.body.lm_head, "vocab": hp.vocab})


def join(trainable, frozen) -> EagleParams:
    """The EagleParams of (trainable, frozen) (the inverse of `split`)."""
    from jaxserve.model.params import Params
    return EagleParams(fc=trainable["fc"],
                       body=Params(embed=None, layers=(trainable["layer"],),
                                   final_norm=trainable["norm"], lm_head=frozen["lm_head"]),
                       vocab=frozen["vocab"])
