"""Ragged paged attention: the step's new tokens are packed one sequence after another (a
flat ragged batch of T rows over S sequences), and each sequence's tokens attend to its
whole context through its block table.

One interface serves prefill of several prompts, decode (one row per sequence; a static
`decode` flag lets implementations use their decode specialisation), and later chunked
prefill, prefix-cache hits and speculative verification. `AttentionMetadata` is built
once per step (outside the layer loop); each layer calls `paged_attention` with its own
pool. The "xla" implementation gathers the context pages and runs dense masked softmax
attention; kernels drop in behind the same function (EngineConfig.attention_impl).

Source: PagedAttention (Kwon et al., SOSP 2023); vLLM v1's unified ragged batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ATTENTION_KERNEL_IMPLS
from jaxserve.pytree import pytree_dataclass
from kernel_ops import kv_values, query_sequence

# Finite, so a padding row whose keys are all masked gets a harmless uniform softmax.
MASK_VALUE = -1e30


@pytree_dataclass(meta=("decode",))
class AttentionMetadata:
    """Per-step attention inputs shared by all layers.

    block_tables: [S, P] int32 page ids of each sequence, in order (padding -> null page).
    seq_lens: [S] int32 context length after this step's tokens are written (0 = padding).
    query_start: [S + 1] int32: sequence b owns token rows query_start[b] : query_start[b+1].
    positions: [T] int32 absolute position of each new token.
    bias: f32 additive mask (0 visible, MASK_VALUE hidden) for the "xla" implementation:
        [S, 1, P * page_size] for decode, [T, S * P * page_size] otherwise; None for
        implementations that mask inside the kernel.
    decode (static): T == S and row b is sequence b's only new token.
    """

    block_tables: Any
    seq_lens: Any
    query_start: Any
    positions: Any
    bias: Any = None
    decode: bool = False


def make_metadata(block_tables: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                  positions: jax.Array, page_size: int, impl: str,
                  decode: bool = False) -> AttentionMetadata:
    """Build the step's metadata; the causal + length mask is computed here, once per step
    (a `jnp.where` inside every layer cost 4-6x on XLA:CPU). Raises ValueError for an
    unknown impl."""
    if impl not in ATTENTION_KERNEL_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_KERNEL_IMPLS}, got {impl!r}")
    bias = None
    if impl == "xla":
        S, P = block_tables.shape
        key_pos = jnp.arange(P * page_size, dtype=jnp.int32)
        if decode:
            visible = ((key_pos[None, None, :] <= positions[:, None, None])
                       & (key_pos[None, None, :] < seq_lens[:, None, None]))  # [S, 1, P*ps]
        else:
            row_seq = query_sequence(query_start, positions.shape[0])  # [T]
            visible = ((row_seq[:, None, None] == jnp.arange(S)[None, :, None])
                       & (key_pos[None, None, :] <= positions[:, None, None])
                       & (key_pos[None, None, :] < seq_lens[None, :, None]))  # [T, S, P*ps]
            visible = visible.reshape(positions.shape[0], S * P * page_size)
        bias = jnp.where(visible, 0.0, MASK_VALUE).astype(jnp.float32)
    return AttentionMetadata(block_tables=block_tables, seq_lens=seq_lens,
                             query_start=query_start, positions=positions, bias=bias,
                             decode=decode)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    meta: AttentionMetadata, impl: str = "xla",
                    layout: str = "token_major") -> jax.Array:
    """Attention of a flat ragged batch of new queries over paged K/V.

    q: [T, H, Dh]; k_pages, v_pages: one layer's pool (this step's K/V already
    written) in `layout`: "token_major" [num_pages, page_size, K, Dh] or "head_major"
    [K, num_pages, page_size, Dh] (see jaxserve.kv_cache), f32, bf16, or uint16 holding
    bf16 bits (jaxserve.kv_cache.storage_dtype); returns [T, H, Dh] in
    q.dtype (rows outside every sequence: 0, or for "xla" a harmless finite value). Scale
    1/sqrt(Dh), softmax in f32. GQA: the H query heads are grouped as [K, H // K]; K/V are
    never repeated in memory.
    impl: "xla" (below; either layout); "cpu" (head-major only): the C++ kernel of
    cpu_kernels.paged_attention, which reads only each sequence's own pages, in place (its
    library must be loaded: jaxserve.kernels.select_kernels); "pallas" /
    "pallas_interpret" (token-major only): decode steps call the paged decode kernel,
    others the ragged flash-prefill kernel over the pool.
    Raises ValueError for an unknown `impl` or a layout the impl cannot read.
    """
    if impl != "cpu":  # the C++ kernel reads a bits pool as bf16 itself
        k_pages, v_pages = kv_values(k_pages), kv_values(v_pages)
    if impl == "xla":
        if meta.decode:
            attend = (_paged_attention_xla_head_major if layout == "head_major"
                      else _paged_attention_xla)
            return attend(q[:, None], k_pages, v_pages, meta)[:, 0]
        return _ragged_attention_xla(q, k_pages, v_pages, meta, layout)
    if impl not in ATTENTION_KERNEL_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_KERNEL_IMPLS}, got {impl!r}")
    want = "head_major" if impl == "cpu" else "token_major"
    if layout != want:
        raise ValueError(f"attention impl {impl!r} reads only the {want} KV layout, got {layout!r}")
    if impl == "cpu":
        from cpu_kernels.paged_attention import paged_attention as cpu_paged_attention
        out = cpu_paged_attention(q.astype(jnp.float32), k_pages, v_pages, meta.block_tables,
                                  meta.seq_lens, meta.query_start, meta.positions)
        return out.astype(q.dtype)
    return _paged_attention_pallas(q, k_pages, v_pages, meta, impl)


def _paged_attention_pallas(q, k_pages, v_pages, meta: AttentionMetadata, impl: str) -> jax.Array:
    from pallas_kernels.flash_attention import flash_attention
    from pallas_kernels.paged_attention import paged_attention as paged_decode

    if meta.decode:
        return paged_decode(q, k_pages, v_pages, meta.block_tables, meta.seq_lens, impl=impl)
    return flash_attention(q, k_pages, v_pages, meta.block_tables, meta.query_start,
                           meta.seq_lens, impl=impl)


def _widened(q, k, v):
    """Gathered K/V in the wider of q's and the pool's dtypes (f32 queries over a bf16 pool:
    f32), converted after the gather so the pool itself is never converted. (A bf16 x bf16
    -> f32 dot of probabilities and V is unimplemented in XLA:CPU's DotThunk.)"""
    dt = jnp.promote_types(q.dtype, k.dtype)
    return k.astype(dt), v.astype(dt)


def _ragged_attention_xla(q, k_pages, v_pages, meta: AttentionMetadata, layout: str) -> jax.Array:
    # Every row scores against the keys of all S sequences (gathered once, [S * P * ps]);
    # the bias keeps its own sequence's visible keys. S times the work of a per-sequence
    # formulation, but no [T, keys] gather per row; the kernels do the real thing.
    T, H, Dh = q.shape
    S, P = meta.block_tables.shape
    if layout == "head_major":
        K, _, ps, _ = k_pages.shape
        k = k_pages[:, meta.block_tables].reshape(K, S * P * ps, Dh)
        v = v_pages[:, meta.block_tables].reshape(K, S * P * ps, Dh)
    else:
        _, ps, K, _ = k_pages.shape
        k = k_pages[meta.block_tables].reshape(S * P * ps, K, Dh).transpose(1, 0, 2)
        v = v_pages[meta.block_tables].reshape(S * P * ps, K, Dh).transpose(1, 0, 2)
    k, v = _widened(q, k, v)
    qg = q.reshape(T, K, H // K, Dh)
    scores = jnp.einsum("tkgd,ksd->tkgs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (Dh ** -0.5) + meta.bias[:, None, None, :]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("tkgs,ksd->tkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(T, H, Dh).astype(q.dtype)


def _paged_attention_xla(q, k_pages, v_pages, meta: AttentionMetadata) -> jax.Array:
    B, Q, H, Dh = q.shape
    _, ps, K, _ = k_pages.shape
    P = meta.block_tables.shape[1]
    k = k_pages[meta.block_tables].reshape(B, P * ps, K, Dh)  # [B, S, K, Dh]
    v = v_pages[meta.block_tables].reshape(B, P * ps, K, Dh)
    k, v = _widened(q, k, v)
    qg = q.reshape(B, Q, K, H // K, Dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (Dh ** -0.5) + meta.bias[:, None, None, :, :]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, Q, H, Dh).astype(q.dtype)


def _paged_attention_xla_head_major(q, k_pages, v_pages, meta: AttentionMetadata) -> jax.Array:
    # Pages [K, N, ps, Dh] gathered -> [K, B, S, Dh]: both matmuls batch over (kv head,
    # sequence), the leading axes, so XLA moves only the small q / output, never K or V.
    B, Q, H, Dh = q.shape
    K, _, ps, _ = k_pages.shape
    G = H // K
    P = meta.block_tables.shape[1]
    k = k_pages[:, meta.block_tables].reshape(K, B, P * ps, Dh)
    v = v_pages[:, meta.block_tables].reshape(K, B, P * ps, Dh)
    k, v = _widened(q, k, v)
    qg = q.reshape(B, Q, K, G, Dh).transpose(2, 0, 3, 1, 4).reshape(K, B, G * Q, Dh)
    scores = jnp.einsum("kbqd,kbsd->kbqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(K, B, G, Q, P * ps) * (Dh ** -0.5) + meta.bias[None, :, None]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(K, B, G * Q, P * ps)
    out = jnp.einsum("kbqs,kbsd->kbqd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(K, B, G, Q, Dh).transpose(1, 3, 0, 2, 4).reshape(B, Q, H, Dh).astype(q.dtype)
