"""Ragged causal flash-attention prefill over the paged KV pool.

A step packs the new tokens of `batch` sequences one after another in q; sequence b owns
rows cu_q_lens[b] : cu_q_lens[b+1] and attends, through its block table, to every key of
its context (cached prefix + earlier chunks + its own new tokens, which the engine has
already written into the pool). The j-th new token of b sits at absolute position
kv_lens[b] - q_len_b + j and sees keys at positions <= its own.

Layout and blocking. Grid (batch, cdiv(total_tokens, block_q), kv_heads): one program
owns block_q consecutive tokens of one sequence and the `group = q_heads // kv_heads`
query heads that share one KV head, i.e. a [block_q, group_pad, head_dim] query tile
flattened to block_q * group_pad dot rows (group padded to a power of two; rows >= 16),
so every K/V block is loaded once for the whole group and K/V are never repeated.
Programs whose block starts past their sequence's q_len skip the work (the grid's q axis
is a static upper bound); stores are masked to the program's own rows, and the last
sequence's programs also write zeros to the padding rows past cu_q_lens[batch].
The KV loop walks block_kv-token blocks only up to the last key the tile can see (causal
skipping): first the blocks every row sees in full (no mask), then the diagonal blocks
(causal + length mask). Each key row is gathered through the block table (the pool viewed
as [num_pages * page_size, kv_heads, head_dim]), so block_kv may span several pages or
part of one; block-table columns are clamped to pages_per_seq - 1 and page ids to the
pool, so the kernel never reads outside either, and keys at positions >= kv_len are
masked loads (never read, so stale or NaN pool contents cannot leak in).
Besides pages of q's dtype it reads the engine's narrow pools: fp8 e4m3fn pages (scale 1,
vLLM's default; widened to q's dtype in registers, exactly) and int8 rows carrying their
own scale (jaxserve.kernels.common.INT8_KV, [.., head_dim + 4]): the values widened
exactly, each key's K scale multiplying its scores, its V scale its p before the p @ v dot.

Sources: FlashAttention-2 (Dao, 2023) tiling / online softmax and causal block skipping;
PagedAttention (Kwon et al., 2023) block tables; vLLM v1 / tpu-inference ragged paged
attention for the packed ragged batch; JAX's `pallas.ops.gpu` kernels for Triton idioms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.kernels.common import INT8_KV, INT8_SCALE_BYTES, kv_rows_f32
from jaxserve.kernels.pallas.common import (FLOAT_DTYPES, IMPLS, MASK_VALUE, MIN_DOT,
                                            causal_visible, cdiv, check, check_array,
                                            check_page_pool, finish_softmax, is_power_of_2,
                                            load_kv, load_row_scales, next_power_of_2,
                                            online_softmax_step, triton_call_params)

# The page dtypes besides q's: fp8 e4m3fn (scale 1) and int8 rows with their scales.
NARROW_PAGES = (jnp.float8_e4m3fn, INT8_KV)


# ----------------------------------------------------------------------------- kernel body

def _flash_kernel(q_ref, k_ref, v_ref, bt_ref, cu_ref, kvl_ref, o_ref, *, block_q: int,
                  block_kv: int, group: int, group_pad: int, page_size: int, sm_scale: float,
                  row_scales: bool):
    """One (sequence b, q block i, KV head h) tile.

    q_ref:  [total_tokens, q_heads, head_dim] q.dtype, whole (tile picked with pl.ds);
    k_ref, v_ref: [num_pages * page_size, kv_heads, head_dim] q.dtype or float8_e4m3fn, the
            pool's token rows; with row_scales [.., head_dim + 4] int8 rows whose last 4
            bytes are the row's f32 scale;
    bt_ref: [batch, pages_per_seq] int32 block tables; cu_ref: [batch + 1] int32 row offsets;
    kvl_ref: [batch] int32 context lengths (new tokens included);
    o_ref:  [total_tokens, q_heads, head_dim] q.dtype, whole (this program stores its rows).
    """
    b, h = pl.program_id(0), pl.program_id(2)
    # q blocks in reverse launch order: the longest KV loops (last blocks) start first.
    i = pl.num_programs(1) - 1 - pl.program_id(1)
    total, _, head_dim = q_ref.shape  # (the pool's rows may be wider: int8 rows' scales)
    pool_rows = k_ref.shape[0]
    pages_per_seq = bt_ref.shape[1]
    rows = block_q * group_pad
    q_start, q_end, context = cu_ref[b], cu_ref[b + 1], kvl_ref[b]  # scalars int32
    q_len = q_end - q_start
    kv_len = jnp.minimum(context, pages_per_seq * page_size)  # keys exist only in the table
    first_pos = context - q_len + i * block_q  # absolute position of the tile's first token
    tok = i * block_q + jnp.arange(block_q)  # [block_q] int32 index inside the sequence
    row = q_start + tok  # [block_q] int32 row of q / out
    own = (tok < q_len) & (row < total)  # [block_q] bool
    head_ok = jnp.arange(group_pad) < group  # [group_pad] bool (padded heads never load/store)
    q_pos = first_pos + jnp.arange(rows) // group_pad  # [rows] int32, row r = token r // group_pad
    tile = (pl.ds(q_start + i * block_q, block_q), pl.ds(h * group, group_pad), slice(None))
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def attend():
        # q: [block_q, group_pad, head_dim] -> [rows, head_dim] q.dtype; masked rows are 0
        q = plgpu.load(q_ref.at[tile], mask=own[:, None, None] & head_ok[None, :, None], other=0)
        q = q.reshape(rows, head_dim)

        def body(kb, carry, masked: bool):
            acc, m, l = carry  # [rows, head_dim] f32, [rows] f32, [rows] f32
            k_pos = kb * block_kv + jnp.arange(block_kv)  # [block_kv] int32 absolute positions
            col = jnp.minimum(k_pos // page_size, pages_per_seq - 1)  # never past the table
            page = plgpu.load(bt_ref.at[b, col])  # [block_kv] int32 (a page id per key)
            page = jnp.minimum(jnp.maximum(page, 0), pool_rows // page_size - 1)
            kv_row = page * page_size + k_pos % page_size  # [block_kv] int32 row of the pool
            ok = (k_pos < kv_len) if masked else None  # [block_kv] bool
            kv_ok = None if ok is None else ok[:, None]  # [block_kv, 1] bool
            # gather [block_kv, head_dim] in q.dtype (integer indexers only: interpret mode
            # cannot mix a gather with slices)
            idx = (kv_row[:, None], h, jnp.arange(head_dim)[None, :])
            k = load_kv(k_ref, idx, kv_ok, q.dtype)
            v = load_kv(v_ref, idx, kv_ok, q.dtype)
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [rows, block_kv]
            v_scale = None
            if row_scales:  # int8 rows: each key's own scales
                s = s * load_row_scales(k_ref, kv_row, h, head_dim, ok)[None, :]
                v_scale = load_row_scales(v_ref, kv_row, h, head_dim, ok)
            if masked:
                s = jnp.where(causal_visible(q_pos, k_pos, kv_len), s, MASK_VALUE)
            return online_softmax_step(acc, m, l, s, v, precision, v_scale)

        last_pos = context - q_len + jnp.minimum(q_len, (i + 1) * block_q) - 1
        seen = jnp.maximum(jnp.minimum(kv_len, last_pos + 1), 0)  # keys any row sees
        n_blocks = (seen + block_kv - 1) // block_kv  # causal skipping
        seen_by_all = jnp.maximum(jnp.minimum(kv_len, first_pos + 1), 0)
        n_full = jnp.minimum(seen_by_all // block_kv, n_blocks)  # blocks needing no mask
        carry = (jnp.zeros((rows, head_dim), jnp.float32),
                 jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
        carry = jax.lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
        carry = jax.lax.fori_loop(n_full, n_blocks, functools.partial(body, masked=True), carry)
        return finish_softmax(*carry)[0]  # [rows, head_dim] f32

    out = jax.lax.cond(i * block_q < q_len, attend,
                       lambda: jnp.zeros((rows, head_dim), jnp.float32))
    # Padding rows past cu_q_lens[batch] (< total) belong to the last sequence's programs.
    pad = (b == pl.num_programs(0) - 1) & (row >= q_end) & (row < total)  # [block_q] bool
    out = jnp.where(own[:, None, None], out.reshape(block_q, group_pad, head_dim), 0.0)
    plgpu.store(o_ref.at[tile], out.astype(o_ref.dtype),
                mask=(own | pad)[:, None, None] & head_ok[None, :, None])


# ----------------------------------------------------------------------------- pallas_call

def _flash_call(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, *, sm_scale: float,
                block_q: int, block_kv: int, impl: str, num_warps: int, num_stages: int):
    """pallas_call over grid (batch, cdiv(total_tokens, block_q), kv_heads). Every operand is
    passed whole (no BlockSpecs: the tiles are ragged and gathered); the pool is viewed as
    token rows [num_pages * page_size, kv_heads, head_dim] (a free reshape)."""
    total, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, width = k_pages.shape
    group = q_heads // kv_heads
    kernel = functools.partial(_flash_kernel, block_q=block_q, block_kv=block_kv, group=group,
                               group_pad=next_power_of_2(group), page_size=page_size,
                               sm_scale=sm_scale, row_scales=width != head_dim)
    pool = (num_pages * page_size, kv_heads, width)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(block_tables.shape[0], cdiv(total, block_q), kv_heads),
        name="flash_attention",
        **triton_call_params(impl, num_warps=num_warps, num_stages=num_stages),
    )(q, k_pages.reshape(pool), v_pages.reshape(pool), block_tables, cu_q_lens, kv_lens)


# ----------------------------------------------------------------------------- checks

def check_operands(fn: str, q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens) -> None:
    """Static shape / dtype checks shared by the kernel and the reference."""
    check_array(fn, "q", q, (None, None, None), FLOAT_DTYPES)
    total, q_heads, head_dim = q.shape
    check(fn, total >= 1, f"q must have total_tokens >= 1, got shape {list(q.shape)}")
    rows = jnp.dtype(getattr(k_pages, "dtype", q.dtype)) == INT8_KV
    check_page_pool(fn, k_pages, v_pages, q_heads, head_dim + (INT8_SCALE_BYTES if rows else 0),
                    (q.dtype,) + NARROW_PAGES)
    check_array(fn, "block_tables", block_tables, (None, None), (jnp.int32,))
    batch, pages_per_seq = block_tables.shape
    check(fn, batch >= 1 and pages_per_seq >= 1,
          f"block_tables must have batch, pages_per_seq >= 1, got {list(block_tables.shape)}")
    check_array(fn, "cu_q_lens", cu_q_lens, (batch + 1,), (jnp.int32,))
    check_array(fn, "kv_lens", kv_lens, (batch,), (jnp.int32,))


def _default_blocks(total: int, head_dim: int, itemsize: int, group_pad: int, context: int,
                    num_warps: int) -> tuple[int, int]:
    """(block_q, block_kv): dot rows x keys per step chosen so the sm_90 build does not spill
    (tools/compile_triton.py). 4 warps, 16-bit: 128 x 32 at head_dim <= 64, 64 x 64 at 128;
    8 warps: 128 x 64. f32 (no tensor cores at HIGHEST): 32 x 32 / 32 x 16 (8 warps: 64 x 32
    / 32 x 32). Wider heads: 32 x 16. block_q = rows // group_pad, at most the step's tokens
    (rounded up to a power of two), rows >= 16; block_kv at most the table's context."""
    wide, warps8 = head_dim > 64, num_warps >= 8
    if head_dim > 128:
        rows, block_kv = 32, 16
    elif itemsize >= 4:
        rows, block_kv = (32 if wide else 64, 32) if warps8 else (32, 16 if wide else 32)
    else:
        rows, block_kv = (128, 64) if warps8 else ((64, 64) if wide else (128, 32))
    block_q = min(max(1, rows // group_pad), next_power_of_2(total))
    block_q = max(block_q, next_power_of_2(cdiv(MIN_DOT, group_pad)))
    return block_q, max(MIN_DOT, min(block_kv, next_power_of_2(context)))


# ----------------------------------------------------------------------------- public API

@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_kv", "impl",
                                             "num_warps", "num_stages"))
def flash_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    cu_q_lens: jax.Array, kv_lens: jax.Array, *, sm_scale: float | None = None,
                    block_q: int | None = None, block_kv: int | None = None, impl: str = "pallas",
                    num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Ragged causal attention of packed new tokens over the paged KV pool (one Pallas kernel).

    q: [total_tokens, q_heads, head_dim] f32/bf16/f16, the new tokens of each sequence packed
    in order; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim] q.dtype or
    float8_e4m3fn (scale 1), or [.., head_dim + 4] int8 rows carrying their f32 scale
    (jaxserve.kernels.common.INT8_KV), one layer's pool, the new tokens' K/V already
    written; block_tables: [batch, pages_per_seq]
    int32; cu_q_lens: [batch + 1] int32, non-decreasing from 0 (sequence b owns rows
    cu_q_lens[b]:cu_q_lens[b+1]); kv_lens: [batch] int32 context length including the new
    tokens (q_len_b <= kv_lens[b] <= pages_per_seq * page_size). Key position p of sequence
    b lives in page block_tables[b, p // page_size] at slot p % page_size; if kv_lens[b]
    runs past the table (the engine's padding tokens), keys past it count as absent.
    Returns [total_tokens, q_heads, head_dim] q.dtype; rows >= cu_q_lens[batch] are 0.
    sm_scale: a Python float (default head_dim ** -0.5); softmax in f32. f32 q: both
    products (q @ k, p @ v) IEEE f32 on the GPU (Precision.HIGHEST), so the result meets
    f32 tolerances; bf16 / f16 q: tensor-core products in q's dtype, f32 accumulation.
    block_q: tokens per tile (power of two; block_q * next_power_of_2(group) >= 16);
    block_kv: keys per KV step (power of two >= 16); both default from the shapes.
    impl: "pallas" (GPU, Triton) or "pallas_interpret" (CPU). head_dim must be a power of
    two >= 16. Raises ValueError for bad shapes, dtypes, blocks or impl (traced values such
    as cu_q_lens are the caller's contract and are not checked).
    Source: FlashAttention-2 (Dao, 2023) over PagedAttention block tables (Kwon et al.,
    2023), ragged batch as in vLLM v1.
    """
    fn = "flash_attention"
    check(fn, impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")
    check_operands(fn, q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens)
    total, q_heads, head_dim = q.shape
    check(fn, is_power_of_2(head_dim) and head_dim >= MIN_DOT,
          f"head_dim must be a power of two >= {MIN_DOT} for the kernel, got {head_dim}")
    group_pad = next_power_of_2(q_heads // k_pages.shape[2])
    context = block_tables.shape[1] * k_pages.shape[1]
    default_q, default_kv = _default_blocks(total, head_dim, jnp.dtype(q.dtype).itemsize,
                                            group_pad, context, num_warps)
    block_q = default_q if block_q is None else block_q
    block_kv = default_kv if block_kv is None else block_kv
    check(fn, isinstance(block_q, int) and is_power_of_2(block_q)
          and block_q * group_pad >= MIN_DOT,
          f"block_q must be a power of two with block_q * {group_pad} (padded group) >= {MIN_DOT}, "
          f"got {block_q}")
    check(fn, isinstance(block_kv, int) and is_power_of_2(block_kv) and block_kv >= MIN_DOT,
          f"block_kv must be a power of two >= {MIN_DOT}, got {block_kv}")
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    return _flash_call(q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens, sm_scale=scale,
                       block_q=block_q, block_kv=block_kv, impl=impl, num_warps=num_warps,
                       num_stages=num_stages)


def flash_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              block_tables: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array,
                              *, sm_scale: float | None = None) -> jax.Array:
    """Plain-jnp `flash_attention`: gather each sequence's keys through its (clamped) block
    table, give every q row its sequence and absolute position, and run a dense masked
    softmax in f32 (HIGHEST precision). Keys at positions >= min(kv_len, pages_per_seq *
    page_size) are absent (zeroed before use, so stale pool contents never leak in).

    Same arguments, shapes and dtypes as `flash_attention` (any head_dim); returns
    [total_tokens, q_heads, head_dim] q.dtype with rows >= cu_q_lens[batch] (and rows that
    see no key) equal to 0. Raises ValueError for bad shapes or dtypes.
    """
    check_operands("flash_attention_reference", q, k_pages, v_pages, block_tables, cu_q_lens,
                    kv_lens)
    total, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    batch, pages_per_seq = block_tables.shape
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    hp = jax.lax.Precision.HIGHEST
    k_pages, v_pages = kv_rows_f32(k_pages), kv_rows_f32(v_pages)  # (int8 rows dequantised)
    k_pos = jnp.arange(pages_per_seq * page_size)  # [S]
    pages = jnp.clip(block_tables, 0, num_pages - 1)[:, k_pos // page_size]  # [batch, S]
    in_len = k_pos[None, :] < kv_lens[:, None]  # [batch, S]
    k = jnp.where(in_len[..., None, None], k_pages[pages, k_pos % page_size], 0)  # [batch, S, K, D]
    v = jnp.where(in_len[..., None, None], v_pages[pages, k_pos % page_size], 0)
    t = jnp.arange(total)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, batch - 1)  # [T]
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    q_pos = kv_lens[seq] - q_len[seq] + (t - cu_q_lens[seq])  # [T]
    visible = ((k_pos[None, :] <= q_pos[:, None]) & in_len[seq]
               & (t < cu_q_lens[batch])[:, None])  # [T, S]
    qg = q.reshape(total, kv_heads, q_heads // kv_heads, head_dim).astype(jnp.float32)
    s = jnp.einsum("tkgd,tskd->tkgs", qg, k[seq].astype(jnp.float32), precision=hp) * scale
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    any_key = visible.any(axis=-1)[:, None, None, None]
    p = jnp.where(any_key, jax.nn.softmax(jnp.where(any_key, s, 0.0), axis=-1), 0.0)
    out = jnp.einsum("tkgs,tskd->tkgd", p, v[seq].astype(jnp.float32), precision=hp)
    return out.reshape(total, q_heads, head_dim).astype(q.dtype)


__all__ = ["flash_attention", "flash_attention_reference"]
