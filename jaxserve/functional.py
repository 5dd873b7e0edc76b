"""Generation as a pure function, for research code: usable under `jax.jit`, `jax.vmap`
(over keys or prompts) and inside training loops.

    tokens, logprobs = jaxserve.functional.generate(params, cfg, prompt_tokens,
                                                    prompt_lengths, key, max_new_tokens=16)
    logprobs_again = jaxserve.functional.score(params, cfg, sequences, lengths)

No engine, scheduler or host loop: the KV cache is a page pool allocated inside the call
(each sequence its own pages, in order), the prompts are prefilled as one ragged batch and
the new tokens decoded in a `lax.fori_loop`, all through the same model code
(jaxserve.model.transformer.forward) and sampler (jaxserve.sample.sampler.sample) as the engine.
Every sequence decodes `max_new_tokens` tokens: stopping at an end-of-sequence token is
the caller's (mask with `tokens == eos`), since shapes are fixed. `jaxserve.LLM` keeps the
engine for serving-style use (continuous batching, prefix caching, streaming).

Source: the functional sampling loops of research codebases (e.g. MaxText's and
jax-llm-examples' decode), with vLLM's sampling semantics (jaxserve.sample.sampler).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import init_kv_cache
from jaxserve.model.layer_loop import StackedLayers
from jaxserve.model.params import Params
from jaxserve.model.pooling import pool_hidden
from jaxserve.model.inputs import StepBatch, next_decode_batch
from jaxserve.model.transformer import (Kernels, compute_logits, forward)
from jaxserve.sample.sampler import SamplingBatch, sample

PAGE_SIZE = 16


def _prefill_batch(tokens: jax.Array, lengths: jax.Array, tables: jax.Array,
                   lora_slot: jax.Array | None = None) -> StepBatch:
    """The ragged prefill of B prompts tokens [B, P] int32 of lengths [B] (each >= 1),
    packed one after another in B * P rows (the rest padding), sequence b on its pages
    tables[b]; lora_slot [B] int32: each sequence's LoRA slot (its rows'), or None."""
    B, P = tokens.shape
    T = B * P
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lengths)]).astype(jnp.int32)
    pos = jnp.arange(P, dtype=jnp.int32)
    valid = pos[None, :] < lengths[:, None]
    rows = jnp.where(valid, starts[:-1, None] + pos[None, :], T)  # T: dropped
    slots = tables[:, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE  # [B, P]
    put = lambda fill, x: jnp.full((T,), fill, jnp.int32).at[rows].set(x, mode="drop")  # noqa: E731
    row_slot = None if lora_slot is None else put(
        0, jnp.broadcast_to(lora_slot.astype(jnp.int32)[:, None], (B, P)))
    return StepBatch(tokens=put(0, tokens), positions=put(0, jnp.broadcast_to(pos, (B, P))),
                     slot_mapping=put(0, slots), block_tables=tables, seq_lens=lengths,
                     query_start=starts, logits_indices=starts[1:] - 1, decode=False,
                     lora_slot=row_slot)


def _page_pool(cfg: ModelConfig, B: int, num_tokens: int, kernels: Kernels,
               kv_dtype: str | None = None, stacked: bool = False):
    """(block tables [B, pages] int32, zeroed KV pool of kv_dtype values, None: the
    model's dtype): each of B sequences its own pages for num_tokens tokens, in order;
    page 0 is the null page. stacked: the pool of params whose layers run as a loop
    (jaxserve.model.layer_loop.StackedLayers, as an engine's may)."""
    pages = -(-num_tokens // PAGE_SIZE)
    tables = (1 + jnp.arange(B * pages, dtype=jnp.int32)).reshape(B, pages)
    cache = init_kv_cache(cfg, 1 + B * pages, PAGE_SIZE, kv_dtype or cfg.dtype, None,
                          kernels.attention.kv_layout, stacked=stacked)
    return tables, cache


def _check(prompt_tokens, prompt_lengths, max_new_tokens: int) -> None:
    if prompt_tokens.ndim != 2 or prompt_lengths.shape != prompt_tokens.shape[:1]:
        raise ValueError(f"prompt_tokens must be [batch, max_prompt_len] and prompt_lengths "
                         f"[batch], got {prompt_tokens.shape} and {prompt_lengths.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "kernels"))
def generate(params: Params, cfg: ModelConfig, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, key: jax.Array, *, max_new_tokens: int,
             temperature: float | jax.Array = 1.0, top_k: int | jax.Array = 0,
             top_p: float | jax.Array = 1.0, kernels: Kernels = Kernels()
             ) -> tuple[jax.Array, jax.Array]:
    """Sample `max_new_tokens` tokens after each prompt.

    params: the model's Params (float, unprepared: jaxserve.checkpoint.load_params or
        jaxserve.model.params.init_params); cfg: its ModelConfig (static).
    prompt_tokens: [B, P] int32, prompt b in its first prompt_lengths[b] entries (the rest
        ignored); prompt_lengths: [B] int32, each in 1..P.
    key: a jax.random key; row b's token i is drawn with fold_in(key, b)'s bits and i, as
        the engine draws a request's (jaxserve.sample.sampler), so each row's samples do not
        depend on the others.
    temperature, top_k, top_p: scalars or [B] arrays; temperature 0 is greedy, top_k <= 0
        and top_p 1 are off (vLLM's semantics).
    kernels: the model's kernels (default XLA, which jax.vmap can batch; the C++ kernels
        cannot be vmapped).
    Returns (tokens [B, max_new_tokens] int32, logprobs [B, max_new_tokens] f32): each
    token's log-softmax under the model's raw logits (before temperature or filters), the
    value `score` gives for the same tokens. Raises ValueError for mismatched shapes or
    max_new_tokens < 1 (at trace time).
    """
    _check(prompt_tokens, prompt_lengths, max_new_tokens)
    B, P = prompt_tokens.shape
    tables, cache = _page_pool(cfg, B, P + max_new_tokens, kernels,
                               stacked=isinstance(params.layers, StackedLayers))
    lengths = prompt_lengths.astype(jnp.int32)
    seeds = jax.vmap(lambda b: jax.random.bits(jax.random.fold_in(key, b), (2,), jnp.uint32))(
        jnp.arange(B))
    sb = SamplingBatch(temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)),
                       top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (B,)),
                       top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (B,)),
                       min_p=jnp.zeros((B,), jnp.float32), seed=seeds,
                       step=jnp.zeros((B,), jnp.int32))

    def step(batch, cache, i):
        hidden, cache = forward(params, cache, batch, cfg, None, kernels)
        logits = compute_logits(params, hidden[batch.logits_indices], None, kernels.matmul)
        tok, lp = sample(logits, dataclasses.replace(sb, step=sb.step + i), kernels.sampling)
        return tok, lp, cache

    batch = _prefill_batch(prompt_tokens.astype(jnp.int32), lengths, tables)
    tok, lp, cache = step(batch, cache, 0)
    out_t = jnp.zeros((max_new_tokens, B), jnp.int32).at[0].set(tok)
    out_l = jnp.zeros((max_new_tokens, B), jnp.float32).at[0].set(lp)
    last = lengths - 1  # the position of each sequence's last token so far
    page = tables[jnp.arange(B), last // PAGE_SIZE]
    decode = StepBatch(tokens=tok, positions=last, slot_mapping=page * PAGE_SIZE + last % PAGE_SIZE,
                       block_tables=tables, seq_lens=lengths,
                       query_start=jnp.arange(B + 1, dtype=jnp.int32),
                       logits_indices=jnp.arange(B, dtype=jnp.int32), decode=True)

    def body(i, carry):
        decode, cache, out_t, out_l = carry
        decode = next_decode_batch(decode, out_t[i - 1], PAGE_SIZE)
        tok, lp, cache = step(decode, cache, i)
        return decode, cache, out_t.at[i].set(tok), out_l.at[i].set(lp)

    _, _, out_t, out_l = jax.lax.fori_loop(1, max_new_tokens, body, (decode, cache, out_t, out_l))
    return out_t.T, out_l.T


@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "kv_dtype"))
def logits(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
           kernels: Kernels = Kernels(), kv_dtype: str | None = None,
           lora_slot: jax.Array | None = None) -> jax.Array:
    """Teacher-forced logits of sequences: one forward over tokens [B, L] int32 (sequence
    b in its first lengths[b] entries, each >= 1) -> [B, L, vocab] f32, entry [b, t] the
    raw logits of the token after tokens[b, :t + 1] (garbage past lengths[b]). kv_dtype:
    the dtype the K/V are stored in and read back from (an engine's
    CacheConfig.kv_dtype, e.g. "float8_e4m3fn"); None: the model's. lora_slot: [B] int32,
    each sequence's LoRA adapter slot in params' pools (jaxserve.model.lora.attach_pools;
    0: none), or None. Raises ValueError for mismatched shapes (at trace time)."""
    _check(tokens, lengths, 1)
    B, L = tokens.shape
    tables, cache = _page_pool(cfg, B, L, kernels, kv_dtype,
                               stacked=isinstance(params.layers, StackedLayers))
    lengths = lengths.astype(jnp.int32)
    batch = _prefill_batch(tokens.astype(jnp.int32), lengths, tables, lora_slot)
    hidden, _ = forward(params, cache, batch, cfg, None, kernels)  # [B * L, D] packed
    rows = jnp.clip(batch.query_start[:-1, None] + jnp.arange(L)[None, :], 0, B * L - 1)
    return compute_logits(params, hidden[rows], None, kernels.matmul)


@functools.partial(jax.jit, static_argnames=("cfg", "pooling", "kernels"))
def embed(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
          pooling: str = "last", kernels: Kernels = Kernels()) -> jax.Array:
    """Sequence embeddings: one forward over tokens [B, L] int32 (sequence b in its first
    lengths[b] entries, each >= 1) -> [B, D] f32, each sequence's final hidden states
    (after the final norm) pooled ("last": its last token's; "mean": the mean over its
    tokens) and L2-normalised, as the engine's /v1/embeddings (EngineConfig.pooling).
    Raises ValueError for mismatched shapes or an unknown pooling (at trace time).
    Source: vLLM's LAST / MEAN poolers with normalize."""
    _check(tokens, lengths, 1)
    if pooling not in ("last", "mean"):
        raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
    B, L = tokens.shape
    tables, cache = _page_pool(cfg, B, L, kernels, None,
                               stacked=isinstance(params.layers, StackedLayers))
    lengths = lengths.astype(jnp.int32)
    batch = _prefill_batch(tokens.astype(jnp.int32), lengths, tables)
    hidden, _ = forward(params, cache, batch, cfg, None, kernels)  # [B * L, D] packed
    vec = pool_hidden(hidden, batch, pooling)
    if pooling == "mean":
        vec = vec / lengths[:, None]
    return vec / jnp.linalg.norm(vec, axis=-1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def score(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array,
          kernels: Kernels = Kernels(), lora_slot: jax.Array | None = None) -> jax.Array:
    """Teacher-forced log-probabilities of sequences: one forward over tokens [B, L] int32
    (sequence b in its first lengths[b] entries, each >= 1) -> [B, L] f32 whose entry
    [b, t] (t >= 1) is log p(tokens[b, t] | tokens[b, :t]) (log-softmax of the raw logits),
    0 at t = 0 and past lengths[b]. Differentiable in `params` for float32 models (a
    policy-gradient loss is -sum(score * advantage); a bfloat16 pool stores bits), LoRA
    pools included (lora_slot: as `logits`; training an adapter: jaxserve.train.lora).
    Raises ValueError for mismatched shapes (at trace time)."""
    B, L = tokens.shape
    logp = jax.nn.log_softmax(logits(params, cfg, tokens, lengths, kernels,
                                     lora_slot=lora_slot)[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    valid = jnp.arange(1, L)[None, :] < lengths[:, None]
    return jnp.concatenate([jnp.zeros((B, 1), jnp.float32), jnp.where(valid, picked, 0.0)],
                           axis=1)
