"""Helpers for model tests: tiny configs, a dense (non-paged) reference forward, and a
paged prefill/decode driver over an explicit page layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.model.kv_cache import init_kv_cache
from jaxserve.model.layers import apply_rope, rms_norm, rope_tables
from jaxserve.model.inputs import StepBatch
from jaxserve.model.transformer import (Kernels, compute_logits, forward)


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, rope_theta=10000.0, max_position_embeddings=256)
    base.update(kw)
    return ModelConfig(**base)


def dense_reference_logits(params, cfg: ModelConfig, ids: list[int]) -> np.ndarray:
    """All-position logits [T, V] f32 with plain causal attention and K/V repeated per
    query head: an independent formulation of the same model."""
    T = len(ids)
    x = params.embed[jnp.asarray(ids)][None]
    pos = jnp.arange(T)[None]
    cos, sin = rope_tables(pos, cfg)
    g = cfg.num_heads // cfg.num_kv_heads
    causal = jnp.tril(jnp.ones((T, T), bool))
    for lp in params.layers:
        h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
        q = jnp.einsum("bqd,dhk->bqhk", h, lp.wq)
        k = jnp.einsum("bqd,dhk->bqhk", h, lp.wk)
        v = jnp.einsum("bqd,dhk->bqhk", h, lp.wv)
        if lp.bq is not None:
            q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        s = jnp.einsum("bqhd,bshd->bhqs", q, k) / np.sqrt(cfg.head_dim)
        s = jnp.where(causal, s, -jnp.inf)
        a = jnp.einsum("bhqs,bshd->bqhd", jax.nn.softmax(s, -1), v)
        x = x + jnp.einsum("bqhk,hkd->bqd", a, lp.wo)
        h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
        x = x + (jax.nn.silu(h @ lp.w_gate) * (h @ lp.w_up)) @ lp.w_down
    x = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    return np.asarray(compute_logits(params, x))[0]


_fwd = jax.jit(lambda p, c, b, cfg, kernels: (lambda h, c: (compute_logits(p, h), c))(
    *forward(p, c, b, cfg, kernels=kernels)), static_argnums=(3, 4))


class PagedDriver:
    """Runs the model over a page pool with explicit (shuffled) block tables, one
    sequence or a ragged batch at a time; returns all-position logits."""

    def __init__(self, params, cfg: ModelConfig, num_pages=64, page_size=4, seed=0,
                 kernels: Kernels = Kernels(), layout: str = "token_major", kv_dtype=None):
        self.params, self.cfg, self.ps, self.kernels = params, cfg, page_size, kernels
        self.cache = init_kv_cache(cfg, num_pages, page_size, kv_dtype or cfg.dtype, layout=layout)
        perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
        self._free = list(perm)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]], T: int, P: int,
             S: int | None = None) -> dict[str, np.ndarray]:
        """Append `chunks[name]` (new tokens) to each named sequence in one flat ragged step
        of T token rows, S sequences (default: len(chunks)) and P pages (a decode step when
        every chunk is one token and T == S)."""
        S = len(chunks) if S is None else S
        b = StepBatch(tokens=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                      slot_mapping=np.zeros(T, np.int32), block_tables=np.zeros((S, P), np.int32),
                      seq_lens=np.zeros(S, np.int32), query_start=np.zeros(S + 1, np.int32),
                      logits_indices=np.zeros(S, np.int32),
                      decode=T == S and all(len(t) == 1 for t in chunks.values()))
        row = 0
        for i, (name, toks) in enumerate(chunks.items()):
            start = self.lens.get(name, 0)
            end = start + len(toks)
            table = self.tables.setdefault(name, [])
            while len(table) * self.ps < end:
                table.append(self._free.pop())
            pos = np.arange(start, end)
            rows = slice(row, row + len(toks))
            b.tokens[rows] = toks
            b.positions[rows] = pos
            b.slot_mapping[rows] = np.asarray(table)[pos // self.ps] * self.ps + pos % self.ps
            b.block_tables[i, :len(table)] = table
            b.seq_lens[i] = end
            row += len(toks)
            b.query_start[i + 1:] = row
            self.lens[name] = end
        logits, self.cache = _fwd(self.params, self.cache, b, self.cfg, self.kernels)
        logits = np.asarray(logits)
        out, row = {}, 0
        for name, t in chunks.items():
            out[name] = logits[row:row + len(t)]
            row += len(t)
        return out
