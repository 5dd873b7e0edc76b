"""Ragged paged attention: every sequence in the batch brings Q >= 1 new tokens and attends
to its whole context through its block table.

One interface serves prefill (Q = prompt bucket), decode (Q = 1), and later chunked
prefill, prefix-cache hits and speculative verification. `AttentionMetadata` is built
once per step (outside the layer loop); each layer calls `paged_attention` with its own
pool. The "xla" implementation gathers the context pages and runs dense masked softmax
attention; Pallas kernels drop in behind the same function (EngineConfig.attention_impl).

Source: PagedAttention (Kwon et al., SOSP 2023); vLLM v1's unified ragged batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ATTENTION_KERNEL_IMPLS
from jaxserve.pytree import pytree_dataclass

# Finite, so a padding row whose keys are all masked gets a harmless uniform softmax.
MASK_VALUE = -1e30


@pytree_dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by all layers.

    block_tables: [B, P] int32 page ids of each sequence, in order (padding -> null page).
    seq_lens: [B] int32 context length after this step's tokens are written (0 = padding).
    positions: [B, Q] int32 absolute position of each new token.
    bias: [B, Q, P * page_size] f32 additive mask (0 visible, MASK_VALUE hidden), or None
        for implementations that mask inside the kernel.
    """

    block_tables: Any
    seq_lens: Any
    positions: Any
    bias: Any = None


def make_metadata(block_tables: jax.Array, seq_lens: jax.Array, positions: jax.Array,
                  page_size: int, impl: str) -> AttentionMetadata:
    """Build the step's metadata; the causal + length mask is computed here, once per step
    (a `jnp.where` inside every layer cost 4-6x on XLA:CPU)."""
    if impl not in ATTENTION_KERNEL_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_KERNEL_IMPLS}, got {impl!r}")
    bias = None
    if impl == "xla":
        S = block_tables.shape[1] * page_size
        key_pos = jnp.arange(S, dtype=jnp.int32)
        visible = ((key_pos[None, None, :] <= positions[:, :, None])
                   & (key_pos[None, None, :] < seq_lens[:, None, None]))
        bias = jnp.where(visible, 0.0, MASK_VALUE).astype(jnp.float32)
    return AttentionMetadata(block_tables=block_tables, seq_lens=seq_lens,
                             positions=positions, bias=bias)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    meta: AttentionMetadata, impl: str = "xla",
                    layout: str = "token_major") -> jax.Array:
    """Attention of new queries over paged K/V.

    q: [B, Q, H, Dh]; k_pages, v_pages: one layer's pool (this step's K/V already
    written) in `layout`: "token_major" [num_pages, page_size, K, Dh] or "head_major"
    [K, num_pages, page_size, Dh] (see jaxserve.kv_cache); returns [B, Q, H, Dh] in
    q.dtype. Scale 1/sqrt(Dh), softmax in f32. GQA: the H query heads are grouped as
    [K, H // K]; K/V are never repeated in memory.
    impl: "xla" (below; either layout); "cpu" (head-major only): the C++ kernel of
    cpu_kernels.paged_attention, which reads only each row's own pages, in place (its
    library must be loaded: jaxserve.kernels.select_kernels); "pallas" /
    "pallas_interpret" (token-major only): decode steps (Q = 1) call the paged decode
    kernel, longer steps the ragged flash-prefill kernel over the pool.
    Raises ValueError for an unknown `impl` or a layout the impl cannot read.
    """
    if impl == "xla":
        if layout == "head_major":
            return _paged_attention_xla_head_major(q, k_pages, v_pages, meta)
        return _paged_attention_xla(q, k_pages, v_pages, meta)
    if impl not in ATTENTION_KERNEL_IMPLS:
        raise ValueError(f"attention impl must be one of {ATTENTION_KERNEL_IMPLS}, got {impl!r}")
    want = "head_major" if impl == "cpu" else "token_major"
    if layout != want:
        raise ValueError(f"attention impl {impl!r} reads only the {want} KV layout, got {layout!r}")
    if impl == "cpu":
        from cpu_kernels.paged_attention import paged_attention as cpu_paged_attention
        out = cpu_paged_attention(q.astype(jnp.float32), k_pages, v_pages, meta.block_tables,
                                  meta.seq_lens, meta.positions)
        return out.astype(q.dtype)
    return _paged_attention_pallas(q, k_pages, v_pages, meta, impl)


def _paged_attention_pallas(q, k_pages, v_pages, meta: AttentionMetadata, impl: str) -> jax.Array:
    from pallas_kernels.flash_attention import flash_attention
    from pallas_kernels.paged_attention import paged_attention as paged_decode

    B, Q, H, Dh = q.shape
    if Q == 1:
        out = paged_decode(q[:, 0], k_pages, v_pages, meta.block_tables, meta.seq_lens, impl=impl)
        return out[:, None]
    # Row b owns Q packed query rows. Its real tokens (the first q_len) sit at positions
    # seq_len - q_len + j, so giving the row a context of positions[b, 0] + Q puts every
    # real token at its true position; the padding tokens after them see only finite
    # (stale or null-page) keys and their outputs are never read. That context may run
    # past the block table (P * page_size); the kernel never reads past its last column.
    cu_q_lens = jnp.arange(B + 1, dtype=jnp.int32) * Q
    kv_lens = (meta.positions[:, 0] + Q).astype(jnp.int32)
    out = flash_attention(q.reshape(B * Q, H, Dh), k_pages, v_pages, meta.block_tables,
                          cu_q_lens, kv_lens, impl=impl)
    return out.reshape(B, Q, H, Dh)


def _paged_attention_xla(q, k_pages, v_pages, meta: AttentionMetadata) -> jax.Array:
    B, Q, H, Dh = q.shape
    _, ps, K, _ = k_pages.shape
    P = meta.block_tables.shape[1]
    k = k_pages[meta.block_tables].reshape(B, P * ps, K, Dh)  # [B, S, K, Dh]
    v = v_pages[meta.block_tables].reshape(B, P * ps, K, Dh)
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
    qg = q.reshape(B, Q, K, G, Dh).transpose(2, 0, 3, 1, 4).reshape(K, B, G * Q, Dh)
    scores = jnp.einsum("kbqd,kbsd->kbqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores.reshape(K, B, G, Q, P * ps) * (Dh ** -0.5) + meta.bias[None, :, None]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(K, B, G * Q, P * ps)
    out = jnp.einsum("kbqs,kbsd->kbqd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(K, B, G, Q, Dh).transpose(1, 3, 0, 2, 4).reshape(B, Q, H, Dh).astype(q.dtype)
