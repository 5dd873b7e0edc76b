"""What the Mosaic GPU (Hopper) attention kernels share: the walk over a sequence's KV blocks
(pages TMA'd from the pool through the block table, wgmma products, the online softmax in
registers) and the normalisation at its end. `paged_attention_mosaic` (decode: a GQA group's
one token per sequence, split-K) and `flash_attention_mosaic` (ragged prefill: tiles of a
sequence's new tokens x the group, causal) differ only in which q rows a CTA owns, which
blocks it walks and which keys each row sees.

The q tile is 64 rows (wgmma's M for one warpgroup) in SMEM; K and V blocks of `block_kv`
keys (whole pages) go into `stages` SMEM slots, one barrier per slot for K and one for V, each
expecting one TMA per page. Per block: S = q K^T (wgmma, K transposed in SMEM), scale, the
caller's mask, online softmax (FlashAttention), P to a swizzled SMEM tile in q's dtype, O += P V
(wgmma). In the context's last block V rows past its length are zeroed in SMEM first: a stale
slot may hold anything, NaN too, and p = 0 times NaN is NaN.

Sources: FlashAttention-2 (Dao, 2023) online softmax; FlashAttention-3 (Shah et al., 2024) as
JAX writes it in Mosaic GPU (`pallas/ops/gpu/attention_mgpu.py`: wgmma with K transposed in
SMEM); PagedAttention (Kwon et al., 2023) block tables.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.kernels.pallas.common import MASK_VALUE, check
from jaxserve.kernels.pallas.mosaic import (broadcasted_iota, matmul_transposed, swizzled,
                                            with_layout)

Q_DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma's 16-bit inputs (f32 q: the Triton kernels)
HEAD_DIMS = (64, 128)  # whole 128-byte swizzle rows; 128 keeps K, V, P and q/out in SMEM
PAGE_SIZES = (8, 16, 32, 64, 128)  # whole (8, 64) SMEM tiles, whole pages per block
WGMMA_ROWS = 64  # one warpgroup's wgmma is 64 rows tall: the q tile
BLOCK_KVS = (64, 128)  # keys per step: P's 128-byte swizzle (as V's) needs >= 64
MAX_CONCURRENT_STEPS = 2  # K / V blocks in flight: 2 x 64 KiB at 128 keys, head_dim 128


def mosaic_attention_supports(q_dtype, page_dtype, head_dim: int, page_size: int,
                              group: int) -> bool:
    """Whether the Mosaic GPU attention kernels take these operands: q and the pages both
    bf16 or both f16, head_dim 64 or 128, page_size a power of two from 8 to 128, a GQA
    group (q_heads / kv_heads) of at most 64 (its rows fit the q tile). Anything else (f32,
    int8 / fp8 pages, other head sizes) runs the Triton kernels."""
    return (jnp.dtype(q_dtype) in [jnp.dtype(d) for d in Q_DTYPES]
            and jnp.dtype(page_dtype) == jnp.dtype(q_dtype) and head_dim in HEAD_DIMS
            and page_size in PAGE_SIZES and group <= WGMMA_ROWS)


def default_block_kv(table_keys: int, page_size: int) -> int:
    """Keys per step when the caller gives none: 128, or 64 for a table of at most 64 keys
    (`table_keys` = pages_per_seq x page_size); never fewer than one page."""
    return max(64 if table_keys <= 64 else 128, page_size)


def check_mosaic_attention(fn: str, q, k_pages, block_tables, block_kv: int | None,
                           max_concurrent_steps: int) -> int:
    """The checks both Mosaic attention kernels make after their operand checks: operands
    they take (`mosaic_attention_supports`), block_kv (one of BLOCK_KVS, whole pages) and
    max_concurrent_steps (1 to 4). q: [tokens, q_heads, head_dim]; k_pages: [num_pages,
    page_size, kv_heads, head_dim]. Returns block_kv (`default_block_kv` for None). Raises
    ValueError naming the argument, the limit and what it got."""
    _, q_heads, head_dim = q.shape
    page_size, kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = q_heads // kv_heads
    check(fn, mosaic_attention_supports(q.dtype, k_pages.dtype, head_dim, page_size, group),
          f"needs q and pages both bf16 or both f16 (got {jnp.dtype(q.dtype)}, "
          f"{jnp.dtype(k_pages.dtype)}), head_dim in {HEAD_DIMS} (got {head_dim}), page_size "
          f"a power of two in 8..128 (got {page_size}) and q_heads / kv_heads <= {WGMMA_ROWS} "
          f"(got {group})")
    if block_kv is None:
        block_kv = default_block_kv(block_tables.shape[1] * page_size, page_size)
    check(fn, block_kv in BLOCK_KVS and block_kv % page_size == 0,
          f"block_kv must be one of {BLOCK_KVS} and a multiple of page_size ({page_size}), "
          f"got {block_kv}")
    check(fn, isinstance(max_concurrent_steps, int) and 1 <= max_concurrent_steps <= 4,
          f"max_concurrent_steps must be 1 to 4, got {max_concurrent_steps}")
    return block_kv


def kv_scratch(dtype, head_dim: int, block_kv: int, page_size: int, stages: int) -> dict:
    """The scratch `walk_kv_blocks` needs, as plgpu.kernel scratch_types: q_smem [64, D],
    k_smem / v_smem [stages, block_kv, D], p_smem [64, block_kv] (all `dtype`, swizzled),
    and the q, K and V barriers."""
    tf = swizzled(head_dim, 2)
    pages = block_kv // page_size
    return dict(q_smem=plgpu.SMEM((WGMMA_ROWS, head_dim), dtype, transforms=tf),
                k_smem=plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=tf),
                v_smem=plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=tf),
                p_smem=plgpu.SMEM((WGMMA_ROWS, block_kv), dtype,
                                  transforms=swizzled(block_kv, 2)),
                q_bar=plgpu.Barrier(),
                k_bar=plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
                v_bar=plgpu.Barrier(num_arrivals=pages, num_barriers=stages))


def walk_kv_blocks(scratch: dict, k_gmem, v_gmem, page_id: Callable, h, lo, n_full, hi, kv_len,
                   *, sm_scale: float, block_kv: int, page_size: int, stages: int,
                   visible: Callable | None, interpret: bool):
    """Inside a kernel: the online softmax of the q tile (already TMA'd into
    scratch["q_smem"] against scratch["q_bar"], waited here) over KV blocks [lo, hi) of one
    sequence, blocks [lo, n_full) unmasked, [n_full, hi) masked by `visible`.

    k_gmem, v_gmem: [num_pages, page_size, kv_heads, D] refs; page_id(col): the pool page of
    block-table column col (a traced int32, clamped by the caller); h: the KV head; kv_len:
    the sequence's context length (keys at positions >= kv_len are absent: their V rows are
    zeroed in masked blocks); visible(key): [64, block_kv] bool for absolute key positions
    `key` ([64, block_kv] int32, WGMMA layout) in a masked block (None: keys < kv_len).
    Returns (acc [64, D] f32 unnormalised, m [64] f32 running max, l [64] f32 running sum),
    acc in the WGMMA layout, m and l in its row layout."""
    q_smem, k_smem, v_smem, p_smem = (scratch[n] for n in ("q_smem", "k_smem", "v_smem", "p_smem"))
    k_bar, v_bar = scratch["k_bar"], scratch["v_bar"]
    head_dim = q_smem.shape[-1]
    dtype = q_smem.dtype
    pages_per_block = block_kv // page_size

    def fetch(kb, slot):  # TMA block kb's pages into `slot`: a copy per page, K and V
        for j in range(pages_per_block):
            page = page_id(kb * pages_per_block + j)
            dst = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_gmem.at[page, :, h], k_smem.at[slot, dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_gmem.at[page, :, h], v_smem.at[slot, dst], v_bar.at[slot])

    for i in range(stages):
        @pl.when(lo + i < hi)
        def _():
            fetch(lo + i, i)

    plgpu.barrier_wait(scratch["q_bar"])
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    carry = (with_layout(jnp.zeros((WGMMA_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA,
                         interpret),
             with_layout(jnp.full((WGMMA_ROWS,), MASK_VALUE, jnp.float32), row_layout, interpret),
             with_layout(jnp.zeros((WGMMA_ROWS,), jnp.float32), row_layout, interpret))

    def step(kb, carry, masked: bool):
        acc, m, l = carry
        slot = lax.rem(kb - lo, stages)
        plgpu.barrier_wait(k_bar.at[slot])
        scores = matmul_transposed(q_smem, k_smem.at[slot], interpret) * sm_scale
        if masked:
            key = kb * block_kv + broadcasted_iota(jnp.int32, (WGMMA_ROWS, block_kv), 1,
                                                   plgpu.Layout.WGMMA, interpret)
            ok = key < kv_len if visible is None else visible(key)
            scores = jnp.where(ok, scores, MASK_VALUE)
        m_new = jnp.maximum(m, scores.max(axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(scores - lax.broadcast_in_dim(m_new, scores.shape, [0]))
        l = l * correction + p.sum(axis=1)
        p_smem[...] = p.astype(dtype)
        plgpu.barrier_wait(v_bar.at[slot])
        if masked:  # zero the V rows of keys past the context (stale slots: maybe NaN)
            v_ref = v_smem.at[slot]
            slot_key = kb * block_kv + broadcasted_iota(jnp.int32, (block_kv, head_dim), 0,
                                                        plgpu.Layout.WGMMA, interpret)
            v_ref[...] = jnp.where(slot_key < kv_len,
                                   with_layout(v_ref[...], plgpu.Layout.WGMMA, interpret), 0)
        plgpu.commit_smem()  # the registers' stores (P, masked V) visible to wgmma

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            plgpu.wgmma_wait(0)
            return acc_ref[...]
        acc = (acc * lax.broadcast_in_dim(correction, acc.shape, [0])
               + pl.run_scoped(pv, plgpu.ACC((WGMMA_ROWS, head_dim), jnp.float32)))

        @pl.when(kb + stages < hi)  # the slot is free again (both wgmmas done)
        def _():
            fetch(kb + stages, slot)
        return acc, m_new, l

    carry = lax.fori_loop(lo, jnp.minimum(hi, n_full), functools.partial(step, masked=False),
                          carry)
    return lax.fori_loop(jnp.maximum(lo, n_full), hi, functools.partial(step, masked=True), carry)


def normalize(acc, m, l):
    """(acc / l [64, D] f32, log-sum-exp m + log l [64] f32) of `walk_kv_blocks`' result; a
    row that saw no key (l == 0) gives 0 and MASK_VALUE (weight 0 in a split merge)."""
    empty = l == 0.0
    out = acc / lax.broadcast_in_dim(jnp.where(empty, 1.0, l), acc.shape, [0])
    return out, jnp.where(empty, MASK_VALUE, m + jnp.log(jnp.where(empty, 1.0, l)))


__all__ = ["BLOCK_KVS", "HEAD_DIMS", "MAX_CONCURRENT_STEPS", "PAGE_SIZES", "Q_DTYPES",
           "WGMMA_ROWS", "check_mosaic_attention", "default_block_kv", "kv_scratch",
           "mosaic_attention_supports", "normalize", "walk_kv_blocks"]
