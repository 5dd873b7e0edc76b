"""Ragged paged attention for XLA:CPU: the C++ kernel of paged_attention.cc behind an FFI
call, and its plain-jnp reference.

Every sequence b brings Q query tokens (padded) at absolute positions positions[b, j];
query j attends causally to keys 0 .. min(seq_lens[b], positions[b, j] + 1) - 1 of its own
context, read in place from the head-major page pool through its block table. One call
serves decode (Q = 1), prefill and chunked prefill. The kernel reads only the pages each
row uses, where the XLA formulation (jaxserve.model.attention) gathers and copies every
row's pages up to the batch's page bucket: at batch 32 with ragged contexts that was ~85%
of a decode step.

Sources: PagedAttention (Kwon et al., SOSP 2023); FlashAttention (Dao et al., 2022) online
softmax; vLLM's CPU paged attention for the per-(sequence, KV head) work split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import check, check_array

TARGET = "jaxserve_paged_attention"
# Queries per work item: one item reads its sequence's pages once for this many queries
# (x the GQA group); smaller gives the 2 threads more items to balance in a short prefill.
DEFAULT_Q_BLOCK = 32


def _check_operands(fn: str, q, k_pages, v_pages, block_tables, seq_lens, positions) -> None:
    check_array(fn, "q", q, (None, None, None, None), (jnp.float32,))
    B, Q, H, Dh = q.shape
    check_array(fn, "k_pages", k_pages, (None, None, None, Dh), (jnp.float32,))
    check_array(fn, "v_pages", v_pages, k_pages.shape, (jnp.float32,))
    K = k_pages.shape[0]
    check(fn, K >= 1 and H % K == 0,
          f"q_heads must be a multiple of kv_heads, got q_heads {H}, kv_heads {K}")
    check_array(fn, "block_tables", block_tables, (B, None), (jnp.int32,))
    check_array(fn, "seq_lens", seq_lens, (B,), (jnp.int32,))
    check_array(fn, "positions", positions, (B, Q), (jnp.int32,))


@functools.partial(jax.jit, static_argnames=("q_block",))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_tables: jax.Array, seq_lens: jax.Array, positions: jax.Array, *,
                    q_block: int = DEFAULT_Q_BLOCK) -> jax.Array:
    """Causal attention of ragged queries over a head-major page pool, on the CPU.

    q: [B, Q, H, Dh] f32; k_pages, v_pages: [K, num_pages, page_size, Dh] f32 (one layer's
    head-major pool, jaxserve.kv_cache); block_tables: [B, P] int32 page ids; seq_lens: [B]
    int32 context length (0 = padding row, output 0); positions: [B, Q] int32 absolute
    position of each query. Returns [B, Q, H, Dh] f32, scale 1/sqrt(Dh), GQA with the H
    heads grouped [K, H // K].

    Needs `cpu_kernels.build.load_library(...)` called first (registers the target).
    Raises ValueError for bad shapes or dtypes (naming the argument) at trace time; at run
    time a page id outside [0, num_pages) in a used block-table entry, or seq_lens above
    P * page_size, raises instead of reading out of bounds.
    """
    _check_operands("cpu paged_attention", q, k_pages, v_pages, block_tables, seq_lens, positions)
    check("cpu paged_attention", q_block >= 1, f"q_block must be >= 1, got {q_block}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_pages, v_pages, block_tables, seq_lens, positions, q_block=q_block)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              block_tables: jax.Array, seq_lens: jax.Array,
                              positions: jax.Array) -> jax.Array:
    """Plain-jnp `paged_attention` (same arguments, shapes and result): gather each
    sequence's P pages, mask keys at index >= seq_lens[b] or > positions[b, j], softmax in
    f32 at HIGHEST precision; rows with no visible key give 0. Raises ValueError like it."""
    _check_operands("paged_attention_reference", q, k_pages, v_pages, block_tables, seq_lens,
                    positions)
    B, Q, H, Dh = q.shape
    K, N, ps, _ = k_pages.shape
    P = block_tables.shape[1]
    hp = jax.lax.Precision.HIGHEST
    pages = jnp.clip(block_tables, 0, N - 1)
    k = k_pages[:, pages].reshape(K, B, P * ps, Dh)
    v = v_pages[:, pages].reshape(K, B, P * ps, Dh)
    key = jnp.arange(P * ps)
    visible = ((key[None, None, :] < seq_lens[:, None, None])
               & (key[None, None, :] <= positions[:, :, None]))  # [B, Q, S]
    qg = q.reshape(B, Q, K, H // K, Dh)
    s = jnp.einsum("bqkgd,kbsd->bqkgs", qg, k, precision=hp) * Dh ** -0.5
    s = jnp.where(visible[:, :, None, None, :], s, -jnp.inf)
    any_key = visible.any(axis=-1)[:, :, None, None, None]
    p = jnp.where(any_key, jax.nn.softmax(jnp.where(any_key, s, 0.0), axis=-1), 0.0)
    out = jnp.einsum("bqkgs,kbsd->bqkgd", p, v, precision=hp)
    return out.reshape(B, Q, H, Dh)


__all__ = ["DEFAULT_Q_BLOCK", "paged_attention", "paged_attention_reference"]
