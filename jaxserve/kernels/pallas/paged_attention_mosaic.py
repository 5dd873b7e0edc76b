"""Paged decode attention for Hopper in Pallas' Mosaic GPU backend (TMA + wgmma).

The same function as `paged_attention` (Triton) and `paged_attention_reference`, for the
operands the Mosaic kernels take (`attention_mosaic.mosaic_attention_supports`): one new
token per sequence attends to its context in the KV pool.

Layout and blocking. Grid (batch, kv_heads, num_splits), one warpgroup per CTA: a CTA owns
sequence b, KV head h and split s of its context, and the `group = q_heads // kv_heads`
query heads sharing h are the first rows of the 64-row q tile (wgmma's M is 64; the padded
rows are never loaded or stored: each output row depends only on its own q row, so whatever
the tile holds there stays in rows nobody reads). Split s owns KV blocks [s *
blocks_per_split, (s + 1) * blocks_per_split) of block_kv keys; `attention_mosaic.
walk_kv_blocks` TMAs each block's pages from the pool through the block table and runs the
online softmax over them (wgmma products, the last block masked by the context length).
Each split writes its normalised partial output and log-sum-exp for the group's rows;
`merge_partials` combines the splits outside the kernel.

Sources: PagedAttention (Kwon et al., 2023) block tables; Flash-Decoding (Dao et al., 2023)
split-K with a log-sum-exp merge; FlashAttention-3 (Shah et al., 2024) as JAX writes it in
Mosaic GPU (`pallas/ops/gpu/attention_mgpu.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.kernels.pallas.attention_mosaic import (MAX_CONCURRENT_STEPS, WGMMA_ROWS,
                                                      check_mosaic_attention, default_block_kv,
                                                      kv_scratch, normalize, walk_kv_blocks)
from jaxserve.kernels.pallas.common import cdiv, check, merge_partials
from jaxserve.kernels.pallas.mosaic import (MOSAIC_IMPLS, compiler_params, mosaic_interpret_params,
                                            swizzled)
from jaxserve.kernels.pallas.paged_attention import check_operands
from jaxserve.kernels.pallas.quantized_matmul import TARGET_PROGRAMS

ROW_ALIGN = 8  # SMEM tiles are (8, 64)-tiled: q rows are loaded / stored 8 at a time
MIN_BLOCKS_PER_SPLIT = 2  # a split walks at least this many blocks (a full pipeline)


def _default_blocks(batch: int, kv_heads: int, pages_per_seq: int, page_size: int
                    ) -> tuple[int, int]:
    """(block_kv, num_splits): `default_block_kv` keys per block; num_splits so that batch x
    kv_heads x num_splits CTAs reach ~TARGET_PROGRAMS (2 per SM of an H100 / H200), each
    split walking >= MIN_BLOCKS_PER_SPLIT blocks of the table."""
    block_kv = default_block_kv(pages_per_seq * page_size, page_size)
    n_blocks = cdiv(pages_per_seq * page_size, block_kv)
    splits = min(cdiv(TARGET_PROGRAMS, batch * kv_heads), max(1, n_blocks // MIN_BLOCKS_PER_SPLIT))
    return block_kv, splits


def _decode_mosaic_call(q, k_pages, v_pages, block_tables, context_lens, *, sm_scale: float,
                        block_kv: int, num_splits: int, max_concurrent_steps: int,
                        interpret: bool):
    """The plgpu.kernel over grid (batch, kv_heads, num_splits). q: [batch, kv_heads, rows,
    head_dim] (rows = group rounded up to ROW_ALIGN). Returns ([batch, splits, kv_heads,
    rows, head_dim] f32 normalised partial outputs, [batch, splits, kv_heads, rows] f32
    log-sum-exps; an empty split: 0 and MASK_VALUE)."""
    batch, kv_heads, rows, head_dim = q.shape
    num_pages, page_size, _, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    max_context = pages_per_seq * page_size
    blocks_per_split = cdiv(cdiv(max_context, block_kv), num_splits)

    def kernel(q_gmem, k_gmem, v_gmem, bt_gmem, len_gmem, o_gmem, lse_gmem, o_smem, lse_smem,
               **scratch):
        # q_gmem [batch, kv_heads, rows, D]; k_gmem, v_gmem [num_pages, page_size, kv_heads,
        # D]; bt_gmem [batch, pages_per_seq] int32; len_gmem [batch] int32; o_gmem [batch,
        # splits, kv_heads, rows, D] f32; lse_gmem [batch, splits, kv_heads, rows] f32;
        # o_smem [64, D] f32 (swizzled); lse_smem [64] f32 (the epilogue's tiles).
        b, h, s = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
        kv_len = jnp.clip(len_gmem[b], 0, max_context)  # scalar int32
        n_full = kv_len // block_kv  # blocks entirely inside the context
        n_all = (kv_len + block_kv - 1) // block_kv  # blocks holding a key of it
        lo = s * blocks_per_split
        hi = jnp.minimum(lo + blocks_per_split, n_all)
        # the group's q rows: the first `rows` of the 64-row tile (the rest never stored)
        plgpu.copy_gmem_to_smem(q_gmem.at[b, h], scratch["q_smem"].at[pl.ds(0, rows)],
                                scratch["q_bar"])

        def page_id(col):
            col = jnp.minimum(col, pages_per_seq - 1)  # never past the table
            return jnp.clip(bt_gmem[b, col], 0, num_pages - 1)  # never outside the pool

        carry = walk_kv_blocks(scratch, k_gmem, v_gmem, page_id, h, lo, n_full, hi, kv_len,
                               sm_scale=sm_scale, block_kv=block_kv, page_size=page_size,
                               stages=max_concurrent_steps, visible=None, interpret=interpret)
        o_smem[...], lse_smem[...] = normalize(*carry)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_gmem.at[b, s, h])
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows)], lse_gmem.at[b, s, h])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((batch, num_splits, kv_heads, rows, head_dim), jnp.float32),
                  jax.ShapeDtypeStruct((batch, num_splits, kv_heads, rows), jnp.float32)),
        # o_smem swizzled: a store from the accumulator's (WGMMA) layout into a plain f32
        # tile has bank conflicts, which Mosaic GPU refuses to lower from JAX 0.12
        # (TransferPlanDerivationError); its copy out takes `rows`, a multiple of 8: whole tiles
        scratch_types=dict(o_smem=plgpu.SMEM((WGMMA_ROWS, head_dim), jnp.float32,
                                             transforms=swizzled(head_dim, 4, "out")),
                           lse_smem=plgpu.SMEM((WGMMA_ROWS,), jnp.float32),
                           **kv_scratch(q.dtype, head_dim, block_kv, page_size,
                                        max_concurrent_steps)),
        grid=(batch, kv_heads, num_splits),
        grid_names=("b", "h", "s"),
        compiler_params=compiler_params(),
        interpret=mosaic_interpret_params() if interpret else None,
    )(q, k_pages, v_pages, block_tables, context_lens)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "num_splits", "impl",
                                             "max_concurrent_steps"))
def paged_attention_mosaic(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, context_lens: jax.Array, *,
                           sm_scale: float | None = None, block_kv: int | None = None,
                           num_splits: int | None = None, impl: str = "pallas_mosaic",
                           max_concurrent_steps: int = MAX_CONCURRENT_STEPS) -> jax.Array:
    """Decode attention of one new token per sequence over the paged KV pool, in one Mosaic
    GPU kernel (Hopper: TMA page copies, wgmma) and a split merge.

    q: [batch, q_heads, head_dim] bf16 / f16; k_pages, v_pages: [num_pages, page_size,
    kv_heads, head_dim] in q's dtype, one layer's pool; block_tables: [batch, pages_per_seq]
    int32 page ids (key position p of sequence b is page block_tables[b, p // page_size],
    slot p % page_size; entries past a sequence's last page may be any page id);
    context_lens: [batch] int32 in [0, pages_per_seq * page_size] (0 = a padding row, whose
    output is exactly 0). Returns [batch, q_heads, head_dim] q.dtype: scores scaled by
    sm_scale (a Python float, default head_dim ** -0.5), products on the tensor cores in q's
    dtype with f32 accumulation, softmax in f32, p rounded to q's dtype for the p @ v
    product (as the Triton kernel). q heads [h * group, (h + 1) * group) use KV head h.
    Stale pool slots (keys at or past a context's length) never reach the output, whatever
    they hold (NaN included).
    Operands (`mosaic_attention_supports`): head_dim 64 / 128, page_size a power of two in
    8..128, q_heads / kv_heads <= 64.
    block_kv: keys per step, 64 or 128 and a multiple of page_size; num_splits: split-K
    partitions of the table (>= 1); both default from the shapes (`_default_blocks`);
    max_concurrent_steps: K / V blocks in flight (SMEM). impl: "pallas_mosaic" (a Hopper
    GPU) or "pallas_mosaic_interpret" (CPU). Raises ValueError (naming the argument and the
    limit) for bad shapes, dtypes, block parameters or impl; traced values (page ids,
    lengths) are the caller's contract (page ids are clamped to the pool, lengths to the
    table).
    Source: PagedAttention (Kwon et al., 2023) + Flash-Decoding split-K (Dao et al., 2023),
    written after JAX's Mosaic GPU FlashAttention-3 (`pallas/ops/gpu/attention_mgpu.py`).
    """
    fn = "paged_attention_mosaic"
    check(fn, impl in MOSAIC_IMPLS, f"impl must be one of {MOSAIC_IMPLS}, got {impl!r}")
    check_operands(fn, q, k_pages, v_pages, block_tables, context_lens, None, None)
    batch, q_heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    block_kv = check_mosaic_attention(fn, q, k_pages, block_tables, block_kv,
                                      max_concurrent_steps)
    if num_splits is None:
        num_splits = _default_blocks(batch, kv_heads, block_tables.shape[1], page_size)[1]
    check(fn, isinstance(num_splits, int) and num_splits >= 1,
          f"num_splits must be an int >= 1, got {num_splits}")
    group = q_heads // kv_heads
    rows = cdiv(group, ROW_ALIGN) * ROW_ALIGN
    qg = q.reshape(batch, kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    out, lse = _decode_mosaic_call(qg, k_pages, v_pages, block_tables, context_lens,
                                   sm_scale=scale, block_kv=block_kv, num_splits=num_splits,
                                   max_concurrent_steps=max_concurrent_steps,
                                   interpret=impl == "pallas_mosaic_interpret")
    out = merge_partials(out[..., :group, :], lse[..., :group], axis=1)
    return out.reshape(batch, q_heads, head_dim).astype(q.dtype)


__all__ = ["paged_attention_mosaic"]
