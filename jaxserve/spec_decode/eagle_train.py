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

An EAGLE-3-style head (`EagleParams.fuse`) reads the fusion of the target's features
entering its feature layers (`eagle.fused_features`) in place of the final hidden state;
train it over as many draft depths as it will propose. EAGLE-3 drops the feature
regression (reg_weight 0); on SmolLM2 with 0.54 M training tokens keeping it (the head's
output regressed onto the target's final feature) over-fitted less and accepted more
(PERFORMANCE.md), as the shipped head is trained.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.layers import apply_rope, rms_norm, rope_tables, swiglu_mlp
from jaxserve.spec_decode.eagle import EagleParams, fused_features

REG_WEIGHT, CLS_WEIGHT = 1.0, 0.1   # EAGLE's loss weights
NOISE = 0.1                          # half-width of the uniform noise on input features (x RMS)
DEPTH_DECAY = 0.8                    # loss weight of draft depth j: DEPTH_DECAY ** j


def head_forward(hp: EagleParams, embed: jax.Array, tokens: jax.Array, prev: jax.Array,
                 positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The head over windows: tokens [B, W] int32, prev [B, W, D] (the feature of the
    position before each), positions [B, W] int32 -> guessed features [B, W, D] f32, each
    attending causally within its window (all f32, XLA ops)."""
    return head_forward_depths(hp, embed, tokens, prev, positions, cfg, 1)[0]


def head_forward_depths(hp: EagleParams, embed: jax.Array, tokens: jax.Array, prev: jax.Array,
                        positions: jax.Array, cfg: ModelConfig, depths: int) -> list[jax.Array]:
    """The head over windows at draft depths 0 .. depths - 1, as serving runs it while it
    proposes a chain: depth 0 is `head_forward` (element q reads the target's feature of
    q - 1 and attends to depth-0 elements 0 .. q); at depth j element q reads the depth
    j - 1 guess of q - 1 and attends to the depth-0 elements 0 .. q - j and to the chain's
    own elements: depth d at q - j + d for d = 1 .. j (what the head's KV pool holds when
    it proposes the (j + 1)-th draft). EAGLE-3's "training-time test" (Li et al. 2025,
    section 3.2); the fed-back guesses are held constant (stop_gradient).
    tokens [B, W] int32, prev [B, W, D], positions [B, W] int32 -> `depths` guesses
    [B, W, D] f32 (all f32, XLA ops)."""
    B, W = tokens.shape
    D = embed.shape[1]
    H, KH, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lp = hp.body.layers[0]
    cos, sin = rope_tables(positions.reshape(-1), cfg)
    idx = jnp.arange(W)
    keys, values, guesses = [], [], []
    feed = prev
    for j in range(depths):
        x = jnp.concatenate([embed[tokens].astype(jnp.float32), feed.astype(jnp.float32)], -1)
        x = (x @ hp.fc.astype(jnp.float32)).reshape(B * W, D)
        h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
        q = jnp.einsum("td,dhk->thk", h, lp.wq.astype(jnp.float32))
        k = jnp.einsum("td,dhk->thk", h, lp.wk.astype(jnp.float32))
        v = jnp.einsum("td,dhk->thk", h, lp.wv.astype(jnp.float32))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = q.reshape(B, W, KH, H // KH, Dh)
        keys.append(k.reshape(B, W, KH, Dh))
        values.append(v.reshape(B, W, KH, Dh))
        scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, keys[0]) / jnp.sqrt(jnp.float32(Dh))
        scores = jnp.where(idx[None, :] <= idx[:, None] - j, scores, -jnp.inf)
        if j:  # the chain's own elements: depth d at q - j + d
            own_k = jnp.stack([_shift(keys[d], j - d) for d in range(1, j + 1)], -1)
            own_v = jnp.stack([_shift(values[d], j - d) for d in range(1, j + 1)], -1)
            own = jnp.einsum("bqgrd,bqgdn->bgrqn", q, own_k) / jnp.sqrt(jnp.float32(Dh))
            real = idx[:, None] - j + jnp.arange(1, j + 1)[None, :] >= 0  # [q, d - 1]
            scores = jnp.concatenate([scores, jnp.where(real, own, -jnp.inf)], -1)
        p = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("bgrqk,bkgd->bqgrd", p[..., :W], values[0])
        if j:
            attn = attn + jnp.einsum("bgrqn,bqgdn->bqgrd", p[..., W:], own_v)
        attn = attn.reshape(B * W, H, Dh)
        x = x + jnp.einsum("thk,hkd->td", attn, lp.wo.astype(jnp.float32))
        h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        x = x + swiglu_mlp(h, lp.w_gate.astype(jnp.float32), lp.w_up.astype(jnp.float32),
                           lp.w_down.astype(jnp.float32), None)
        g = rms_norm(x, hp.body.final_norm.astype(jnp.float32), cfg.rms_norm_eps).reshape(B, W, D)
        guesses.append(g)
        feed = shifted_features(jax.lax.stop_gradient(g))
    return guesses


def _shift(a: jax.Array, n: int) -> jax.Array:
    """a [B, W, ...] moved n positions later along W, zeros first: out[:, q] = a[:, q - n]."""
    if n == 0:
        return a
    return jnp.pad(a, [(0, 0), (n, 0)] + [(0, 0)] * (a.ndim - 2))[:, :a.shape[1]]


def shifted_features(features: jax.Array) -> jax.Array:
    """prev [B, W, D]: the feature of the position before each (0 before the first)."""
    return jnp.pad(features, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def input_features(hp: EagleParams, batch) -> jax.Array:
    """[B, W, D] f32: what the head reads beside each token at depth 0 (before the shift
    to the next position): the target's final features, or for an EAGLE-3-style head the
    fusion of batch["aux"] [B, W, n, D] (the residual streams entering its n feature
    layers)."""
    if hp.fuse is None:
        return batch["features"].astype(jnp.float32)
    aux = batch["aux"]
    return fused_features(hp.fuse, [aux[:, :, i] for i in range(aux.shape[2])])


def loss_fn(trainable, frozen, batch, cfg: ModelConfig, key: jax.Array | None = None,
            depths: int = 1, reg_weight: float = REG_WEIGHT):
    """EAGLE's loss on a batch {tokens [B, W], features [B, W, D], positions [B, W],
    mask [B, W] (1 where the position counts), and for an EAGLE-3-style head aux
    [B, W, n, D] (`input_features`)}, over draft depths 0 .. depths - 1
    (`head_forward_depths`; depth j weighs DEPTH_DECAY ** j; at depth j > 0 a window's
    first j + 1 positions do not count: the guesses they would read lie before it).
    trainable: {"fc", "layer", "norm"[, "fuse"]}; frozen: {"embed" [V, D], "lm_head"
    [D, N]}. key: noise on the head's input features (None: none). reg_weight: the
    feature regression's weight (0: EAGLE-3's token loss alone). Returns (loss, {"reg",
    "cls", "top1", "top1_<j>"}) where reg / cls / top1 are depth 0's and top1 is the share
    of positions whose head argmax is the target's."""
    hp = join(trainable, frozen)
    feats = batch["features"].astype(jnp.float32)
    prev = shifted_features(input_features(hp, batch))
    if key is not None:
        # the noise's size is no function to train (and sqrt's gradient at a zero row,
        # the window's first and padding, is inf)
        scale = jax.lax.stop_gradient(jnp.sqrt(jnp.mean(prev ** 2, axis=-1, keepdims=True)))
        prev = prev + NOISE * scale * jax.random.uniform(key, prev.shape, minval=-1, maxval=1)
    guesses = head_forward_depths(hp, frozen["embed"], batch["tokens"], prev,
                                  batch["positions"], cfg, depths)
    head = frozen["lm_head"].astype(jnp.float32)
    target_logp = jax.nn.log_softmax(feats @ head, -1)
    target_top = target_logp.argmax(-1)
    idx = jnp.arange(feats.shape[1])
    total, aux = 0.0, {}
    for j, guess in enumerate(guesses):
        mask = batch["mask"].astype(jnp.float32)
        if j:
            mask = mask * (idx > j)
        denom = jnp.maximum(mask.sum(), 1.0)
        diff = jnp.abs(guess - feats)
        smooth_l1 = jnp.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5).mean(-1)
        reg = (smooth_l1 * mask).sum() / denom
        guess_logits = guess @ head
        cls = (-(jnp.exp(target_logp) * jax.nn.log_softmax(guess_logits, -1)).sum(-1)
               * mask).sum() / denom
        top1 = ((guess_logits.argmax(-1) == target_top) * mask).sum() / denom
        total = total + DEPTH_DECAY ** j * (reg_weight * reg + CLS_WEIGHT * cls)
        aux[f"top1_{j}"] = top1
        if j == 0:
            aux.update(reg=reg, cls=cls, top1=top1)
    return total, aux


def split(hp: EagleParams, embed: jax.Array) -> tuple[dict, dict]:
    """(trainable, frozen) pytrees of a head (see loss_fn)."""
    trainable = {"fc": hp.fc, "layer": hp.body.layers[0], "norm": hp.body.final_norm}
    if hp.fuse is not None:
        trainable["fuse"] = hp.fuse
    return trainable, {"embed": embed, "lm_head": hp.body.lm_head, "vocab": hp.vocab}


def join(trainable, frozen) -> EagleParams:
    """The EagleParams of (trainable, frozen) (the inverse of `split`)."""
    from jaxserve.model.params import Params
    return EagleParams(fc=trainable["fc"],
                       body=Params(embed=None, layers=(trainable["layer"],),
                                   final_norm=trainable["norm"], lm_head=frozen["lm_head"]),
                       vocab=frozen["vocab"], fuse=trainable.get("fuse"))
