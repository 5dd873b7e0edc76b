"""Ragged causal prefill attention over the paged KV pool for Hopper, in Pallas' Mosaic GPU
backend (TMA + wgmma): the function of `flash_attention` (Triton) and its reference for the
operands the Mosaic kernels take (`mosaic_attention_supports`).

A step packs the new tokens of `batch` sequences one after another in q; sequence b owns rows
cu_q_lens[b] : cu_q_lens[b+1] and attends, through its block table, to every key of its
context up to its own position (the engine has already written the new tokens' K/V).

Layout and blocking. The wrapper cuts each sequence's new tokens into tiles of block_q tokens
(block_q = 64 / group_pad, so a tile's block_q tokens x the GQA group's heads, padded to a
power of two, are the 64 rows of one wgmma) and gathers them into a dense [num_tiles, kv_heads,
64, head_dim] array (num_tiles = cdiv(total_tokens, block_q) + batch bounds the tiles of any
split of the tokens into sequences); a tile table gives each tile's sequence and index, and
tiles past the last are empty. Grid (num_tiles, kv_heads), one warpgroup per CTA: the q tile
is TMA'd into SMEM and `attention_mosaic.walk_kv_blocks` walks the sequence's KV blocks up to
the last key the tile can see (causal block skipping): blocks every row sees in full run
unmasked, the diagonal blocks with the causal + length mask. The normalised tile is written in
q's dtype and the wrapper gathers each token's rows back to [total_tokens, q_heads,
head_dim]; rows past cu_q_lens[batch] are 0.

Sources: FlashAttention-2 (Dao, 2023) tiling, online softmax and causal block skipping;
FlashAttention-3 (Shah et al., 2024) as JAX writes it in Mosaic GPU; PagedAttention (Kwon et
al., 2023) block tables; vLLM v1 / tpu-inference ragged paged attention for the packed batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.kernels.pallas.attention_mosaic import (MAX_CONCURRENT_STEPS, WGMMA_ROWS,
                                                      check_mosaic_attention, kv_scratch,
                                                      normalize, walk_kv_blocks)
from jaxserve.kernels.pallas.common import cdiv, check, next_power_of_2
from jaxserve.kernels.pallas.flash_attention import check_operands
from jaxserve.kernels.pallas.mosaic import (MOSAIC_IMPLS, broadcasted_iota, compiler_params,
                                            mosaic_interpret_params, swizzled)


def _tile_table(cu_q_lens, block_q: int, num_tiles: int):
    """[3, num_tiles] int32: each tile's sequence, its index among that sequence's tiles,
    and 1 if it holds tokens (0 for the tiles past the last); the [batch + 1] int32 first
    tile of each sequence (the last entry: the number of tiles in use); and the [batch]
    int32 new tokens of each sequence."""
    batch = cu_q_lens.shape[0] - 1
    q_len = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                             jnp.cumsum(cdiv(q_len, block_q)).astype(jnp.int32)])
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(first[1:], t, side="right"), 0, batch - 1).astype(jnp.int32)
    used = (t < first[batch]).astype(jnp.int32)
    return jnp.stack([seq, t - first[seq], used]), first, q_len


def _prefill_mosaic_call(q_tiles, tiles, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, *,
                         group_pad: int, sm_scale: float, block_kv: int,
                         max_concurrent_steps: int, interpret: bool):
    """The plgpu.kernel over grid (num_tiles, kv_heads). q_tiles: [num_tiles, kv_heads, 64,
    head_dim] (row r = token r // group_pad of the tile, head r % group_pad of the group);
    tiles: the [3, num_tiles] int32 tile table. Returns [num_tiles, kv_heads, 64, head_dim]
    in q's dtype (an empty tile: 0)."""
    num_tiles, kv_heads, _, head_dim = q_tiles.shape
    num_pages, page_size, _, _ = k_pages.shape
    dtype = q_tiles.dtype
    block_q = WGMMA_ROWS // group_pad
    pages_per_seq = block_tables.shape[1]
    max_context = pages_per_seq * page_size

    def kernel(q_gmem, k_gmem, v_gmem, bt_gmem, tile_gmem, cu_gmem, kvl_gmem, o_gmem, o_smem,
               **scratch):
        # q_gmem [num_tiles, kv_heads, 64, D]; k_gmem, v_gmem [num_pages, page_size, kv_heads,
        # D]; bt_gmem [batch, pages_per_seq] int32; tile_gmem [3, num_tiles] int32; cu_gmem
        # [batch + 1] int32; kvl_gmem [batch] int32; o_gmem [num_tiles, kv_heads, 64, D];
        # o_smem [64, D] q.dtype (the epilogue's tile).
        t, h = lax.axis_index("t"), lax.axis_index("h")
        b, i, used = tile_gmem[0, t], tile_gmem[1, t], tile_gmem[2, t]
        q_len = cu_gmem[b + 1] - cu_gmem[b]
        context = kvl_gmem[b]
        kv_len = jnp.clip(context, 0, max_context)  # keys exist only in the table
        first_pos = context - q_len + i * block_q  # absolute position of the tile's first token
        last_pos = context - q_len + jnp.minimum(q_len, (i + 1) * block_q) - 1
        seen = jnp.clip(jnp.minimum(kv_len, last_pos + 1), 0, None)  # keys any row sees
        n_blocks = jnp.where(used == 1, (seen + block_kv - 1) // block_kv, 0)  # causal skipping
        seen_by_all = jnp.clip(jnp.minimum(kv_len, first_pos + 1), 0, None)
        n_full = jnp.minimum(seen_by_all // block_kv, n_blocks)  # blocks needing no mask

        plgpu.copy_gmem_to_smem(q_gmem.at[t, h], scratch["q_smem"], scratch["q_bar"])
        q_pos = first_pos + broadcasted_iota(jnp.int32, (WGMMA_ROWS, block_kv), 0,
                                             plgpu.Layout.WGMMA, interpret) // group_pad

        def page_id(col):
            col = jnp.minimum(col, pages_per_seq - 1)  # never past the table
            return jnp.clip(bt_gmem[b, col], 0, num_pages - 1)  # never outside the pool

        carry = walk_kv_blocks(scratch, k_gmem, v_gmem, page_id, h, 0, n_full, n_blocks, kv_len,
                               sm_scale=sm_scale, block_kv=block_kv, page_size=page_size,
                               stages=max_concurrent_steps,
                               visible=lambda key: (key <= q_pos) & (key < kv_len),
                               interpret=interpret)
        o_smem[...] = normalize(*carry)[0].astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[t, h])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, dtype),
        scratch_types=dict(o_smem=plgpu.SMEM((WGMMA_ROWS, head_dim), dtype,
                                             transforms=swizzled(head_dim, 2)),
                           **kv_scratch(dtype, head_dim, block_kv, page_size,
                                        max_concurrent_steps)),
        grid=(num_tiles, kv_heads),
        grid_names=("t", "h"),
        compiler_params=compiler_params(),
        interpret=mosaic_interpret_params() if interpret else None,
    )(q_tiles, k_pages, v_pages, block_tables, tiles, cu_q_lens, kv_lens)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "impl",
                                             "max_concurrent_steps"))
def flash_attention_mosaic(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array, *,
                           sm_scale: float | None = None, block_kv: int | None = None,
                           impl: str = "pallas_mosaic",
                           max_concurrent_steps: int = MAX_CONCURRENT_STEPS) -> jax.Array:
    """Causal attention of a ragged batch of new tokens over the paged KV pool (Hopper,
    Mosaic GPU: TMA page copies, wgmma).

    q: [total_tokens, q_heads, head_dim] bf16 / f16, sequence b's new tokens in rows
    cu_q_lens[b] : cu_q_lens[b + 1]; k_pages, v_pages: [num_pages, page_size, kv_heads,
    head_dim] in q's dtype, one layer's pool (the new tokens' K/V already written);
    block_tables: [batch, pages_per_seq] int32; cu_q_lens: [batch + 1] int32 non-decreasing,
    cu_q_lens[batch] <= total_tokens; kv_lens: [batch] int32 context lengths with the new
    tokens (>= the sequence's new tokens). The j-th new token of b is at position kv_lens[b]
    - q_len_b + j and sees keys at positions <= its own. Returns [total_tokens, q_heads,
    head_dim] q.dtype (rows past cu_q_lens[batch]: 0). Scores scaled by sm_scale (default
    head_dim ** -0.5); products on the tensor cores in q's dtype with f32 accumulation,
    softmax in f32, p rounded to q's dtype for the p @ v product (as the Triton kernel).
    Stale pool slots never reach the output, whatever they hold (NaN included).
    Operands (`mosaic_attention_supports`): head_dim 64 / 128, page_size a power of two in
    8..128, q_heads / kv_heads <= 64. block_kv: keys per step, 64 or 128 and a multiple of
    page_size (default 128, or 64 for tables of at most 64 keys); max_concurrent_steps: K / V
    blocks in flight. impl: "pallas_mosaic" (a Hopper GPU) or "pallas_mosaic_interpret"
    (CPU). Raises ValueError (naming the argument and the limit) for bad shapes, dtypes,
    block parameters or impl; traced values (offsets, lengths, page ids) are the caller's
    contract (page ids are clamped to the pool, table columns to the table).
    Source: FlashAttention-2 / -3 with PagedAttention block tables (module docstring).
    """
    fn = "flash_attention_mosaic"
    check(fn, impl in MOSAIC_IMPLS, f"impl must be one of {MOSAIC_IMPLS}, got {impl!r}")
    check_operands(fn, q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens)
    total, q_heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    batch = block_tables.shape[0]
    group = q_heads // kv_heads
    block_kv = check_mosaic_attention(fn, q, k_pages, block_tables, block_kv,
                                      max_concurrent_steps)
    group_pad = next_power_of_2(group)
    block_q = WGMMA_ROWS // group_pad
    num_tiles = cdiv(total, block_q) + batch
    tiles, first, q_len = _tile_table(cu_q_lens, block_q, num_tiles)
    # gather the tiles' tokens: [num_tiles, block_q] rows of q (clamped; rows a tile does
    # not own are zero and their outputs never read)
    seq, idx = tiles[0], tiles[1]
    local = idx[:, None] * block_q + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    own = (tiles[2][:, None] == 1) & (local < q_len[seq][:, None])
    rows = jnp.clip(cu_q_lens[seq][:, None] + local, 0, total - 1)
    qg = jnp.pad(q.reshape(total, kv_heads, group, head_dim),
                 ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    q_tiles = jnp.where(own[..., None, None, None], qg[rows], 0)  # [tiles, block_q, K, gp, D]
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_tiles, kv_heads, WGMMA_ROWS, head_dim)
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    out = _prefill_mosaic_call(q_tiles, tiles, k_pages, v_pages, block_tables, cu_q_lens,
                               kv_lens, group_pad=group_pad, sm_scale=scale, block_kv=block_kv,
                               max_concurrent_steps=max_concurrent_steps,
                               interpret=impl == "pallas_mosaic_interpret")
    # each token's rows back: token r of sequence b is row (r - cu[b]) % block_q of tile
    # first[b] + (r - cu[b]) // block_q
    out = out.reshape(num_tiles, kv_heads, block_q, group_pad, head_dim)
    r = jnp.arange(total, dtype=jnp.int32)
    b = jnp.clip(jnp.searchsorted(cu_q_lens[1:], r, side="right"), 0, batch - 1)
    loc = r - cu_q_lens[b]
    inside = r < cu_q_lens[batch]
    tile = jnp.clip(first[b] + loc // block_q, 0, num_tiles - 1)
    got = out[tile, :, loc % block_q, :group]  # [total, K, G, D]
    got = jnp.where(inside[:, None, None, None], got, 0)
    return got.reshape(total, q_heads, head_dim).astype(q.dtype)


__all__ = ["flash_attention_mosaic"]
