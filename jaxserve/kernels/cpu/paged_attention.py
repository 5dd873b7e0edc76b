"""Ragged paged attention for XLA:CPU: the C++ kernel of paged_attention.cc behind an FFI
call, and its plain-jnp reference.

The step's new tokens are packed one sequence after another (a flat ragged batch): sequence
b owns query rows query_start[b] : query_start[b + 1], and the query at row t attends
causally to keys 0 .. min(seq_lens[b], positions[t] + 1) - 1 of its own context, read in
place from the head-major page pool through its block table. One call serves decode (one
row per sequence), prefill of several prompts and chunked prefill. The kernel reads only the pages each
row uses, where the XLA formulation (jaxserve.model.attention) gathers and copies every
row's pages up to the batch's page bucket, most of a batched decode step with ragged
contexts (jaxserve/kernels/cpu/README.md).

Sources: PagedAttention (Kwon et al., SOSP 2023); FlashAttention (Dao et al., 2022) online
softmax; vLLM's CPU paged attention for the per-(sequence, KV head) work split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.kernels.common import (INT8_KV, check, check_array, kv_row_width, kv_rows_f32,
                                     layer_operand, query_sequence)

TARGET = "jaxserve_paged_attention"
# Queries per work item: one item reads its sequence's pages once for this many queries
# (x the GQA group); smaller gives the 2 threads more items to balance in a short prefill.
DEFAULT_Q_BLOCK = 32


def _check_operands(fn: str, q, k_pages, v_pages, block_tables, seq_lens, query_start,
                    positions, stacked: bool = False) -> None:
    check_array(fn, "q", q, (None, None, None), (jnp.float32,))
    T, H, Dh = q.shape
    check_array(fn, "k_pages", k_pages, (None,) * stacked + (None, None, None, None),
                (jnp.float32, jnp.bfloat16, jnp.uint16, jnp.float8_e4m3fn, jnp.uint8, INT8_KV))
    width = kv_row_width(k_pages.dtype, Dh)
    check(fn, k_pages.shape[-1] == width,
          f"k_pages' last axis must be {width} (head_dim {Dh}"
          f"{' + 4 scale bytes' if width != Dh else ''}), got {k_pages.shape[-1]}")
    check_array(fn, "v_pages", v_pages, k_pages.shape, (k_pages.dtype,))
    K = k_pages.shape[-4]
    check(fn, K >= 1 and H % K == 0,
          f"q_heads must be a multiple of kv_heads, got q_heads {H}, kv_heads {K}")
    check_array(fn, "block_tables", block_tables, (None, None), (jnp.int32,))
    S = block_tables.shape[0]
    check_array(fn, "seq_lens", seq_lens, (S,), (jnp.int32,))
    check_array(fn, "query_start", query_start, (S + 1,), (jnp.int32,))
    check_array(fn, "positions", positions, (T,), (jnp.int32,))


@functools.partial(jax.jit, static_argnames=("q_block",))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_tables: jax.Array, seq_lens: jax.Array, query_start: jax.Array,
                    positions: jax.Array, *, q_block: int = DEFAULT_Q_BLOCK,
                    layer: jax.Array | int | None = None) -> jax.Array:
    """Causal attention of a flat ragged batch of queries over a head-major page pool, on
    the CPU.

    q: [T, H, Dh] f32, the new tokens packed by sequence; k_pages, v_pages: [K, num_pages,
    page_size, Dh] f32, bf16, uint16 holding bf16 bits, float8_e4m3fn or uint8 holding its
    bits, or [K, num_pages, page_size, Dh + 4] int8 rows with their f32 scales
    (jaxserve.kernels.common.INT8_KV), both the same (one layer's head-major pool,
    jaxserve.model.kv_cache; bf16 and fp8 are widened to f32 as they are read, int8 rows
    dequantised to q * s); block_tables:
    [S, P] int32 page ids; seq_lens: [S] int32 context length (0 = padding sequence);
    query_start: [S + 1] int32, non-decreasing within [0, T] (sequence b owns rows
    query_start[b] : query_start[b + 1]); positions: [T] int32 absolute position of each
    query. Returns [T, H, Dh] f32, scale 1/sqrt(Dh), GQA with the H heads grouped
    [K, H // K]; rows of padding sequences and rows past query_start[S] are 0.

    layer: with stacked pools k_pages, v_pages [L, K, num_pages, page_size, Dh] (a loop
    over layers), the int32 index of the layer to read, traced or not, read where it lies
    (a slice of the stack handed to the call would be copied first; see
    jaxserve.kernels.cpu.ggml_matmul.ggml_matmul).

    Needs `jaxserve.kernels.cpu.build.load_library(...)` called first (registers the target).
    Raises ValueError for bad shapes or dtypes (naming the argument) at trace time; at run
    time a page id outside [0, num_pages) in a used block-table entry, seq_lens above
    P * page_size, a bad query_start or a layer outside the stack raises instead of reading
    out of bounds.
    """
    fn = "cpu paged_attention"
    _check_operands(fn, q, k_pages, v_pages, block_tables, seq_lens, query_start, positions,
                    stacked=layer is not None)
    check(fn, q_block >= 1, f"q_block must be >= 1, got {q_block}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_pages, v_pages, layer_operand(fn, layer), block_tables, seq_lens, query_start, positions,
                q_block=q_block)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              block_tables: jax.Array, seq_lens: jax.Array,
                              query_start: jax.Array, positions: jax.Array) -> jax.Array:
    """Plain-jnp `paged_attention` (same arguments, shapes and result): gather every
    sequence's P pages, let row t see the keys of its own sequence b at index < seq_lens[b]
    and <= positions[t], softmax in f32 at HIGHEST precision; rows with no visible key
    give 0; a pool's values as kv_rows_f32 gives them (bf16 / fp8 widened, int8 rows
    dequantised). Raises ValueError like it."""
    _check_operands("paged_attention_reference", q, k_pages, v_pages, block_tables, seq_lens,
                    query_start, positions)
    T, H, Dh = q.shape
    K, N, ps, W = k_pages.shape
    S, P = block_tables.shape
    hp = jax.lax.Precision.HIGHEST
    pages = jnp.clip(block_tables, 0, N - 1)
    k = kv_rows_f32(k_pages[:, pages].reshape(K, S, P * ps, W))
    v = kv_rows_f32(v_pages[:, pages].reshape(K, S, P * ps, W))
    key = jnp.arange(P * ps)
    row_seq = query_sequence(query_start, T)  # [T], S = no sequence
    own = row_seq[:, None] == jnp.arange(S)[None, :]  # [T, S]
    visible = (own[:, :, None] & (key[None, None, :] < seq_lens[None, :, None])
               & (key[None, None, :] <= positions[:, None, None]))  # [T, S, P * ps]
    qg = q.reshape(T, K, H // K, Dh)
    s = jnp.einsum("tkgd,kbsd->tkgbs", qg, k, precision=hp) * Dh ** -0.5
    s = jnp.where(visible[:, None, None], s, -jnp.inf).reshape(T, K, H // K, S * P * ps)
    any_key = visible.reshape(T, -1).any(axis=-1)[:, None, None, None]
    p = jnp.where(any_key, jax.nn.softmax(jnp.where(any_key, s, 0.0), axis=-1), 0.0)
    out = jnp.einsum("tkgs,ksd->tkgd", p, v.reshape(K, S * P * ps, Dh), precision=hp)
    return out.reshape(T, H, Dh)


__all__ = ["DEFAULT_Q_BLOCK", "paged_attention", "paged_attention_reference"]
