"""Paged decode attention: one new token per sequence attends to its context in the KV pool.

Layout and blocking. Grid (batch, kv_heads, num_splits): one program owns one sequence b,
one KV head h and one split s of its context, and the `group = q_heads // kv_heads` query
heads that share h as the rows of one [group_pad, head_dim] tile (group padded to a power of
two >= 16 for the tensor-core dot; padded rows are never loaded or stored), so each K/V
token is read once per group and K/V are never repeated in memory. The context is walked in
compute blocks of `pages_per_compute_block` pages (block_kv = pages * page_size tokens);
split s owns compute blocks [s * blocks_per_split, (s + 1) * blocks_per_split). Each key row
is gathered through the block table from the pool viewed as token rows [num_pages *
page_size, kv_heads, head_dim]; the blocks entirely inside the context run unmasked, the
last (partial) block masks its loads and scores by the context length, and blocks past the
context are never visited (an empty split writes output 0 and log-sum-exp MASK_VALUE).
Each split writes a normalised partial output and its log-sum-exp; `merge_partials`
combines them outside the kernel (with one split the kernel writes the output directly).
int8 / fp8 pages are converted in registers to q's dtype (exact); the per-page-per-head
K scale multiplies the scores, the V scale the V rows before the p @ v dot. The engine's
pools: fp8 pages without scales (vLLM's per-tensor scale 1), and int8 rows that carry
their own scale (jaxserve.kernels.common.INT8_KV: [.., head_dim + 4], a scale per token
and head): the K scale multiplies each key's score, the V scale each key's p before the
p @ v dot, whose int8 operand stays exact.

Sources: PagedAttention (Kwon et al., 2023) block tables; Flash-Decoding (Dao et al., 2023)
split-K with a log-sum-exp merge; FlashAttention online softmax; JAX's
`pallas.ops.gpu.paged_attention` for the Triton idioms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve.kernels.common import INT8_SCALE_BYTES, kv_rows_f32
from jaxserve.kernels.pallas.common import (FLOAT_DTYPES, FP8_E4M3, IMPLS, INT8, MASK_VALUE,
                                            MIN_DOT, QUANT_FORMATS, cdiv, check, check_array,
                                            check_page_pool, finish_softmax, is_power_of_2,
                                            load_kv, load_row_scales, merge_partials,
                                            next_power_of_2, online_softmax_step,
                                            quant_format_of, triton_call_params)

# Both dots' precision (q @ k, and p @ v in `online_softmax_step`) for f32 q: 3xTF32 on the
# GPU, the plain f32 dot in interpret mode (XLA:CPU has no 3xTF32). 3xTF32 splits each
# operand x = hi + lo (hi = x rounded to TF32's 11-bit significand, lo = the rest rounded
# again) and sums hi*hi + hi*lo + lo*hi in f32: a product's relative error is at most about
# 3 x 2^-22 (the dropped lo*lo and the second rounding), against TF32's 2^-10 and f32's
# 2^-24, so f32 kernels meet f32 tolerances (~1e-5 at O(1) values) on tensor cores.
F32_DOT_PRECISION = {"pallas": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                     "pallas_interpret": jax.lax.Precision.HIGHEST}


# ----------------------------------------------------------------------------- kernel body

def _decode_kernel(q_ref, k_ref, v_ref, ks_ref, vs_ref, bt_ref, len_ref, o_ref, lse_ref, *,
                   group: int, group_pad: int, page_size: int, block_kv: int,
                   blocks_per_split: int, max_context: int, sm_scale: float, f32_precision,
                   row_scales: bool):
    """One (sequence b, KV head h, split s) program.

    q_ref:  [batch, q_heads, head_dim] q.dtype, whole (rows h*group : h*group+group used);
    k_ref, v_ref: [num_pages * page_size, kv_heads, head_dim] page dtype (q.dtype, int8 or
            float8_e4m3fn), the pool's token rows, whole; with row_scales [.., head_dim + 4]
            int8 rows whose last 4 bytes are the row's f32 scale;
    ks_ref, vs_ref: [num_pages, kv_heads] f32 per-page-per-head scales, or None (float
            pages, fp8 pages of scale 1, int8 rows);
    bt_ref: [batch, padded_pages] int32 block tables (padded to whole compute blocks with 0);
    len_ref: [batch] int32 context lengths;
    o_ref:  [batch, num_splits, q_heads, head_dim] f32 (q.dtype if num_splits == 1), whole:
            this program stores its split's normalised partial output for its group's rows;
    lse_ref: [batch, num_splits, q_heads] f32, whole: the partial's log-sum-exp.
    """
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]  # (the pool's rows may be wider: int8 rows' scale bytes)
    pool_pages = k_ref.shape[0] // page_size
    kv_len = jnp.clip(len_ref[b], 0, max_context)  # scalar int32
    head_ok = jnp.arange(group_pad) < group  # [group_pad] bool
    heads = pl.ds(h * group, group_pad)
    q = plgpu.load(q_ref.at[b, heads, :], mask=head_ok[:, None], other=0)  # [group_pad, head_dim]
    precision = f32_precision if q.dtype == jnp.float32 else None

    def body(kb, carry, masked: bool):
        acc, m, l = carry  # [group_pad, head_dim] f32, [group_pad] f32, [group_pad] f32
        pos = kb * block_kv + jnp.arange(block_kv)  # [block_kv] int32 key positions
        page = plgpu.load(bt_ref.at[b, pos // page_size])  # [block_kv] int32, a page per key
        page = jnp.clip(page, 0, pool_pages - 1)  # never outside the pool
        row = page * page_size + pos % page_size  # [block_kv] int32 pool row
        ok = pos < kv_len if masked else None  # [block_kv] bool
        ok2 = None if ok is None else ok[:, None]
        idx = (row[:, None], h, jnp.arange(head_dim)[None, :])  # integer indexers only
        k = load_kv(k_ref, idx, ok2, q.dtype)  # [block_kv, head_dim] q.dtype
        scores = plgpu.dot(q, k, trans_b=True, precision=precision)  # [group_pad, block_kv] f32
        v_scale = None
        if row_scales:  # int8 rows: each key's own scales
            k_scale = load_row_scales(k_ref, row, h, head_dim, ok)
            scores = scores * (k_scale * sm_scale)[None, :]
            v_scale = load_row_scales(v_ref, row, h, head_dim, ok)
        elif ks_ref is None:
            scores = scores * sm_scale
        else:
            k_scale = plgpu.load(ks_ref.at[page, h], mask=ok, other=None if ok is None else 0)
            scores = scores * (k_scale * sm_scale)[None, :]  # [block_kv] f32 per key
        if masked:
            scores = jnp.where(ok[None, :], scores, MASK_VALUE)
        if vs_ref is None:
            v = load_kv(v_ref, idx, ok2, q.dtype)  # [block_kv, head_dim] q.dtype
        else:
            vs = plgpu.load(vs_ref.at[page, h], mask=ok, other=None if ok is None else 0)
            v = load_kv(v_ref, idx, ok2, jnp.float32) * vs[:, None]  # [block_kv, head_dim]
            v = v.astype(q.dtype)
        return online_softmax_step(acc, m, l, scores, v, precision, v_scale)

    lo = s * blocks_per_split
    hi = lo + blocks_per_split
    n_full = kv_len // block_kv  # blocks entirely inside the context: no mask
    n_all = (kv_len + block_kv - 1) // block_kv
    carry = (jnp.zeros((group_pad, head_dim), jnp.float32),
             jnp.full((group_pad,), MASK_VALUE, jnp.float32), jnp.zeros((group_pad,), jnp.float32))
    carry = jax.lax.fori_loop(lo, jnp.minimum(hi, n_full), functools.partial(body, masked=False),
                              carry)
    carry = jax.lax.fori_loop(jnp.maximum(lo, n_full), jnp.minimum(hi, n_all),
                              functools.partial(body, masked=True), carry)
    out, lse = finish_softmax(*carry)  # [group_pad, head_dim] f32, [group_pad] f32
    plgpu.store(o_ref.at[b, s, heads, :], out.astype(o_ref.dtype), mask=head_ok[:, None])
    plgpu.store(lse_ref.at[b, s, heads], lse, mask=head_ok)


# ----------------------------------------------------------------------------- pallas_call

def _decode_call(q, k_pages, v_pages, k_scales, v_scales, block_tables, context_lens, *,
                 sm_scale: float, pages_per_compute_block: int, num_splits: int, impl: str,
                 num_warps: int, num_stages: int):
    """pallas_call over grid (batch, kv_heads, num_splits), every operand whole (no
    BlockSpecs: K/V rows are gathered through the block table); then the split merge."""
    batch, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, width = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    n_blocks = cdiv(pages_per_seq, pages_per_compute_block)
    tables = jnp.pad(block_tables, ((0, 0), (0, n_blocks * pages_per_compute_block - pages_per_seq)))
    kernel = functools.partial(
        _decode_kernel, group=q_heads // kv_heads,
        group_pad=max(MIN_DOT, next_power_of_2(q_heads // kv_heads)), page_size=page_size,
        block_kv=pages_per_compute_block * page_size, blocks_per_split=cdiv(n_blocks, num_splits),
        max_context=pages_per_seq * page_size, sm_scale=sm_scale,
        f32_precision=F32_DOT_PRECISION[impl], row_scales=width != head_dim)
    pool = (num_pages * page_size, kv_heads, width)
    out_dtype = q.dtype if num_splits == 1 else jnp.float32
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((batch, num_splits, q_heads, head_dim), out_dtype),
                   jax.ShapeDtypeStruct((batch, num_splits, q_heads), jnp.float32)),
        grid=(batch, kv_heads, num_splits),
        name="paged_attention",
        **triton_call_params(impl, num_warps=num_warps, num_stages=num_stages),
    )(q, k_pages.reshape(pool), v_pages.reshape(pool), k_scales, v_scales, tables, context_lens)
    if num_splits == 1:
        return out[:, 0]
    return merge_partials(out, lse, axis=1).astype(q.dtype)


# ----------------------------------------------------------------------------- checks

def check_operands(fn: str, q, k_pages, v_pages, block_tables, context_lens, k_scales,
                    v_scales):
    """Static shape / dtype checks shared by the kernel and the reference; returns the
    QuantFormat of pages given per-page scales (None for float pages, fp8 pages of scale
    1 and int8 rows with their own scales)."""
    check_array(fn, "q", q, (None, None, None), FLOAT_DTYPES)
    batch, q_heads, head_dim = q.shape
    check(fn, batch >= 1 and q_heads >= 1 and head_dim >= 1,
          f"q must have batch, q_heads, head_dim >= 1, got {list(q.shape)}")
    fmt = quant_format_of(getattr(k_pages, "dtype", q.dtype))  # (check_page_pool checks it)
    # int8 pages without scales: the engine's rows [.., head_dim + 4] with their own scale
    rows = fmt is INT8 and k_scales is None and v_scales is None
    check(fn, not rows or k_pages.shape[-1] != head_dim,
          f"k_scales [num_pages, kv_heads] f32 is required for int8 pages of head_dim "
          f"{head_dim} (or rows of head_dim + {INT8_SCALE_BYTES} carrying their scales)")
    num_pages, _, kv_heads = check_page_pool(
        fn, k_pages, v_pages, q_heads, head_dim + (INT8_SCALE_BYTES if rows else 0),
        (q.dtype,) + tuple(f.dtype for f in QUANT_FORMATS.values()))
    if rows or (fmt is FP8_E4M3 and k_scales is None and v_scales is None):
        fmt = None  # scales in the rows / per-tensor 1
    check_array(fn, "block_tables", block_tables, (batch, None), (jnp.int32,))
    check(fn, block_tables.shape[1] >= 1,
          f"block_tables must have pages_per_seq >= 1, got {list(block_tables.shape)}")
    check_array(fn, "context_lens", context_lens, (batch,), (jnp.int32,))
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if fmt is None:
            check(fn, scales is None, f"{name} must be None for {jnp.dtype(k_pages.dtype)} pages"
                  + (" carrying their scales" if rows else ""))
        else:
            check(fn, scales is not None,
                  f"{name} [num_pages, kv_heads] f32 is required for {fmt.name} pages")
            check_array(fn, name, scales, (num_pages, kv_heads), (jnp.float32,))
    return fmt


def _default_blocks(pages_per_seq: int, page_size: int, head_dim: int,
                   itemsize: int) -> tuple[int, int]:
    """(pages_per_compute_block, num_splits) for a decode call: a compute block of ~128 keys
    (64 at head_dim > 64 or f32, keeping the gathered [block_kv, head_dim] tiles in
    registers), never fewer than 16 keys nor (beyond that) more pages than the table has;
    num_splits = the largest power of two <= (compute blocks per sequence) / 4, at most 16,
    so every split walks >= 4 blocks. Both powers of two."""
    keys = 128 if head_dim <= 64 and itemsize < 4 else 64
    ppcb = max(1, keys // page_size)
    ppcb = max(min(ppcb, next_power_of_2(pages_per_seq)), next_power_of_2(cdiv(MIN_DOT, page_size)))
    quarter = max(1, cdiv(pages_per_seq, ppcb) // 4)
    return ppcb, min(16, 1 << (quarter.bit_length() - 1))


# ----------------------------------------------------------------------------- public API

@functools.partial(jax.jit, static_argnames=("sm_scale", "pages_per_compute_block", "num_splits",
                                             "impl", "num_warps", "num_stages"))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                    context_lens: jax.Array, *, k_scales: jax.Array | None = None,
                    v_scales: jax.Array | None = None, sm_scale: float | None = None,
                    pages_per_compute_block: int | None = None, num_splits: int | None = None,
                    impl: str = "pallas", num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Decode attention of one new token per sequence over the paged KV pool (Pallas kernel).

    q: [batch, q_heads, head_dim] f32/bf16/f16; k_pages, v_pages: [num_pages, page_size,
    kv_heads, head_dim] one layer's pool, either q.dtype or int8 / float8_e4m3fn with
    k_scales, v_scales: [num_pages, kv_heads] f32 (real value = stored * scale), or
    float8_e4m3fn without scales (scale 1: the engine's fp8 pool, vLLM's default), or
    [num_pages, page_size, kv_heads, head_dim + 4] int8 rows carrying their f32 scale
    without k_scales / v_scales (the engine's int8 pool, jaxserve.kernels.common.INT8_KV);
    block_tables: [batch, pages_per_seq] int32 page ids (key position p
    of sequence b is page block_tables[b, p // page_size], slot p % page_size; entries past a
    sequence's last page may be any page id); context_lens: [batch] int32 in [0, pages_per_seq
    * page_size] (0 = a padding row, whose output is exactly 0).
    Returns [batch, q_heads, head_dim] q.dtype. Scores are scaled by sm_scale (a Python float,
    default head_dim ** -0.5), softmax in f32. f32 q: both products (q @ k, p @ v) in 3xTF32
    on the GPU, a relative error of about 3 x 2^-22 per product (F32_DOT_PRECISION), plain
    f32 in interpret mode; bf16 / f16 q: products in q's dtype, f32 accumulation. q heads
    [h * group, (h + 1) * group) use KV
    head h (GQA, group = q_heads // kv_heads).
    pages_per_compute_block: pages per kernel step (power of two, times page_size >= 16);
    num_splits: split-K partitions of the table (power of two); both default from the shapes
    (`_default_blocks`). impl: "pallas" (GPU, Triton) or "pallas_interpret" (CPU).
    head_dim and page_size must be powers of two (head_dim >= 16). Raises ValueError for bad
    shapes, dtypes, scales, block parameters or impl; traced values (page ids, lengths) are
    the caller's contract (page ids are clamped to the pool, lengths to the table).
    Source: PagedAttention (Kwon et al., 2023) + Flash-Decoding split-K (Dao et al., 2023).
    """
    fn = "paged_attention"
    check(fn, impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")
    check_operands(fn, q, k_pages, v_pages, block_tables, context_lens, k_scales, v_scales)
    head_dim, page_size = q.shape[2], k_pages.shape[1]
    check(fn, is_power_of_2(head_dim) and head_dim >= MIN_DOT,
          f"head_dim must be a power of two >= {MIN_DOT} for the kernel, got {head_dim}")
    check(fn, is_power_of_2(page_size),
          f"page_size must be a power of two for the kernel, got {page_size}")
    ppcb, splits = _default_blocks(block_tables.shape[1], page_size, head_dim,
                                  jnp.dtype(q.dtype).itemsize)
    ppcb = ppcb if pages_per_compute_block is None else pages_per_compute_block
    splits = splits if num_splits is None else num_splits
    check(fn, isinstance(ppcb, int) and is_power_of_2(ppcb) and ppcb * page_size >= MIN_DOT,
          f"pages_per_compute_block must be a power of two with pages_per_compute_block * "
          f"page_size ({page_size}) >= {MIN_DOT}, got {ppcb}")
    check(fn, isinstance(splits, int) and is_power_of_2(splits),
          f"num_splits must be a power of two >= 1, got {splits}")
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    return _decode_call(q, k_pages, v_pages, k_scales, v_scales, block_tables, context_lens,
                        sm_scale=scale, pages_per_compute_block=ppcb, num_splits=splits,
                        impl=impl, num_warps=num_warps, num_stages=num_stages)


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              block_tables: jax.Array, context_lens: jax.Array, *,
                              k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                              sm_scale: float | None = None) -> jax.Array:
    """Plain-jnp `paged_attention`: dequantise the pages in f32 (stored * scale; float pages
    are just cast), gather each sequence's keys through its (clamped) block table, and run a
    dense masked softmax in f32 (HIGHEST precision). Keys at positions >= context_lens[b]
    are absent (zeroed before use, so stale pool contents never leak in).

    Same arguments, shapes and dtypes as `paged_attention` (any head_dim / page_size);
    returns [batch, q_heads, head_dim] q.dtype, rows with context 0 equal to 0. With scales
    it equals itself on the f32 dequantised pages exactly. Raises ValueError for bad shapes,
    dtypes or scales.
    """
    fmt = check_operands("paged_attention_reference", q, k_pages, v_pages, block_tables,
                          context_lens, k_scales, v_scales)
    batch, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    hp = jax.lax.Precision.HIGHEST
    if fmt is None:  # float pages, fp8 of scale 1, int8 rows and their scales
        k, v = kv_rows_f32(k_pages), kv_rows_f32(v_pages)
    else:
        k = fmt.dequantize(k_pages, k_scales[:, None, :, None])
        v = fmt.dequantize(v_pages, v_scales[:, None, :, None])
    pos = jnp.arange(block_tables.shape[1] * page_size)  # [S]
    pages = jnp.clip(block_tables, 0, num_pages - 1)[:, pos // page_size]  # [batch, S]
    visible = pos[None, :] < context_lens[:, None]  # [batch, S]
    k = jnp.where(visible[..., None, None], k[pages, pos % page_size], 0)  # [batch, S, K, D]
    v = jnp.where(visible[..., None, None], v[pages, pos % page_size], 0)
    qg = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim).astype(jnp.float32)
    s = jnp.einsum("bkgd,bskd->bkgs", qg, k, precision=hp) * scale
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    any_key = visible.any(axis=-1)[:, None, None, None]
    p = jnp.where(any_key, jax.nn.softmax(jnp.where(any_key, s, 0.0), axis=-1), 0.0)
    out = jnp.einsum("bkgs,bskd->bkgd", p, v, precision=hp)
    return out.reshape(batch, q_heads, head_dim).astype(q.dtype)


__all__ = ["paged_attention", "paged_attention_reference"]
