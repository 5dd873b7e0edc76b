"""The EAGLE head's training side: its windowed forward is the serving path's computation,
each deeper draft depth is the chain the serving path runs (the head reading its own
guesses), and a short optax run lowers the loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from engine_utils import TINY_CFG, tiny_params
from jaxserve.model.kv_cache import init_kv_cache
from jaxserve.model.inputs import StepBatch
from jaxserve.model.transformer import Kernels
from jaxserve.spec_decode.eagle import EagleHead, head_config, head_features, init_head
from jaxserve.spec_decode.eagle_train import (head_forward, head_forward_depths,
                                              input_features, loss_fn, shifted_features, split)

PAGE = 4


def _head(params, seed=0, num_feature_layers=0):
    vocab = np.arange(0, 258, 3)
    return head_config(TINY_CFG, 32), init_head(TINY_CFG, params, vocab, jax.random.key(seed),
                                                intermediate_size=32, scale=0.3,
                                                num_feature_layers=num_feature_layers)


@pytest.mark.parametrize("fused", [False, True])
def test_windowed_forward_is_the_paged_serving_computation(fused):
    """The training forward over a window = the serving head over the paged pools; for an
    EAGLE-3-style head (fused) the serving sync writes the fusion of the features entering
    the target's layers to the feature pool (what the head then reads at the next
    position), the training side fuses the same way (`input_features`)."""
    params = tiny_params()
    cfg, hp = _head(params, num_feature_layers=2 if fused else 0)
    rng = np.random.default_rng(0)
    L, D = 11, TINY_CFG.hidden_size
    tokens = rng.integers(0, 258, L).astype(np.int32)
    feats = rng.standard_normal((L, D)).astype(np.float32)
    aux = 3.0 * rng.standard_normal((L, 2, D)).astype(np.float32)
    inputs = np.asarray(input_features(hp, {"features": feats[None], "aux": aux[None]}))[0]
    prev = np.asarray(shifted_features(jnp.asarray(inputs)[None]))[0]
    pages = np.arange(1, 1 + -(-L // PAGE)).astype(np.int32)
    pos = np.arange(L, dtype=np.int32)
    batch = StepBatch(tokens=tokens, positions=pos, slot_mapping=pages[pos // PAGE] * PAGE + pos % PAGE,
                      block_tables=pages[None, :], seq_lens=np.array([L], np.int32),
                      query_start=np.array([0, L], np.int32), logits_indices=np.array([L - 1], np.int32))
    kv = init_kv_cache(cfg, 8, PAGE, cfg.dtype)
    kernels = Kernels("xla", "xla", "xla")
    drafter = EagleHead(cfg, (0, 1) if fused else ())
    kv_sync, pool = drafter.sync(params, hp, (kv, jnp.zeros((8 * PAGE, D), jnp.float32)),
                                 jax.tree.map(jnp.asarray, batch), jnp.asarray(feats),
                                 (jnp.asarray(aux[:, 0]), jnp.asarray(aux[:, 1])), None, kernels)
    np.testing.assert_allclose(np.asarray(pool)[batch.slot_mapping], inputs, rtol=1e-6, atol=1e-6)
    if fused:  # the fusion reads the features, not the final hidden states
        assert not np.allclose(inputs, feats, atol=0.1)
    paged, kv2 = head_features(hp, params.embed, kv, batch, jnp.asarray(prev), cfg, None, kernels)
    windowed = head_forward(hp, params.embed, tokens[None], prev[None], pos[None], cfg)[0]
    np.testing.assert_allclose(np.asarray(windowed), np.asarray(paged), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(kv_sync.k[0]), np.asarray(kv2.k[0]), rtol=1e-6, atol=1e-6)


def test_each_depth_is_the_draft_chain_the_head_runs_when_serving():
    """Depth j at position q = the head run causally over the window where elements
    q - j + 1 .. q read the previous element's guess instead of the target's feature (what
    proposing j + 1 tokens after position q - j does); an off-by-one in the depth masks or
    shifts fails it."""
    params = tiny_params()
    cfg, hp = _head(params, seed=2)
    rng = np.random.default_rng(2)
    W, D = 12, TINY_CFG.hidden_size
    tokens = rng.integers(0, 258, W).astype(np.int32)
    feats = rng.standard_normal((W, D)).astype(np.float32)
    prev = np.asarray(shifted_features(jnp.asarray(feats)[None]))[0]
    pos = np.arange(W, dtype=np.int32)
    g = [np.asarray(x)[0] for x in head_forward_depths(hp, params.embed, tokens[None],
                                                        prev[None], pos[None], cfg, 3)]
    np.testing.assert_allclose(g[0], np.asarray(head_forward(
        hp, params.embed, tokens[None], prev[None], pos[None], cfg))[0], rtol=1e-6, atol=1e-6)
    for q in (2, 7, W - 1):
        for j in (1, 2):
            chain_prev = prev[:q + 1].copy()
            for d in range(1, j + 1):  # element q - j + d reads the depth d - 1 guess before it
                chain_prev[q - j + d] = g[d - 1][q - j + d - 1]
            out = np.asarray(head_forward(hp, params.embed, tokens[None, :q + 1], chain_prev[None],
                                          pos[None, :q + 1], cfg))[0]
            np.testing.assert_allclose(g[j][q], out[q], rtol=2e-5, atol=2e-5)
            assert not np.allclose(g[j][q], g[0][q], atol=1e-3)  # the depth matters


@pytest.mark.parametrize("fused", [False, True])
def test_a_short_run_lowers_the_loss(fused):
    """EAGLE's loss (feature regression + token loss), and an EAGLE-3-style head's (token
    loss over aux features it fuses), fall in 60 steps."""
    params = tiny_params()
    cfg, hp = _head(params, seed=1, num_feature_layers=2 if fused else 0)
    trainable, frozen = split(hp, params.embed)
    rng = np.random.default_rng(1)
    B, W, D = 4, 16, TINY_CFG.hidden_size
    # features with structure to learn: a fixed function of the token and the previous one
    tokens = rng.integers(0, 258, (B, W)).astype(np.int32)
    table = rng.standard_normal((258, D)).astype(np.float32)
    feats = np.tanh(table[tokens] + 0.5 * np.roll(table[tokens], 1, axis=1))
    batch = {"tokens": tokens, "features": feats, "positions": np.tile(np.arange(W), (B, 1)),
             "mask": np.ones((B, W), np.float32)}
    if fused:  # "earlier layers": other functions of the same tokens
        batch["aux"] = np.stack([table[tokens] * 2.0, np.roll(table[tokens], 1, axis=1)], 2)
        assert "fuse" in trainable
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
    state = opt.init(trainable)

    @jax.jit
    def step(trainable, state, key):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, batch,
                                                                        cfg, key, depths=2)
        updates, state = opt.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state, loss

    losses = []
    for i in range(60):
        trainable, state, loss = step(trainable, state, jax.random.key(i))
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_training_prompts_mix_two_sources_and_leave_out_every_evaluation_prompt():
    """tools/train_draft_head.py's prompts: the share asked for from the instruction
    builder, the rest from the benchmark-style generator, distinct, seeded, and none of
    the benchmark's or the hand-written held-out sets' prompts (the EAGLE head is measured
    on those)."""
    from jaxserve.bench.serve import DATA_DIR, DEFAULT_DATASET, read_dataset
    from tools.instruction_prompts import build
    from tools.train_draft_head import training_prompts
    prompts = training_prompts(40, seed=3, instruction_share=0.5)
    assert len(prompts) == len(set(prompts)) == 40
    assert prompts == training_prompts(40, seed=3, instruction_share=0.5)
    instructions = {e["prompt"] for e in build(20, 3)}
    assert len(instructions & set(prompts)) == 20
    held = {r.prompt for path in (DEFAULT_DATASET, DATA_DIR / "chat_handwritten.jsonl",
                                  DATA_DIR / "copy_handwritten.jsonl")
            for r in read_dataset(path)}
    assert not held & set(prompts)
    kinds = {e["kind"] for e in build(200, 0)}
    assert {"code", "foreign", "summarize", "brainstorm", "message"} <= kinds
