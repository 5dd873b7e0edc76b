"""Inputs shared by the attention-kernel tests: a shuffled page pool, a ragged prefill batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest


def shuffled_pool(rng, ctx_lens, *, kv_heads, head_dim, page_size, pages_per_seq, spare_pages=3,
                  max_pages=64):
    """f32 numpy K, V [num_pages, page_size, kv_heads, head_dim], block tables [batch,
    pages_per_seq] and live [num_pages, page_size] (slots holding a context token).
    Sequence b owns cdiv(ctx_b, page_size) distinct pages of a shuffled pool; its other
    columns point at random pages (possibly another sequence's or a spare one)."""
    ctx = np.asarray(ctx_lens)
    assert (ctx <= pages_per_seq * page_size).all()
    used = -(-ctx // page_size)
    num_pages = int(used.sum()) + spare_pages
    assert num_pages <= max_pages, "keep interpret-mode pools small"
    perm = rng.permutation(num_pages)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    tables = rng.integers(0, num_pages, (len(ctx), pages_per_seq))
    live = np.zeros((num_pages, page_size), bool)
    start = 0
    for b, (n, c) in enumerate(zip(used, ctx)):
        tables[b, :n] = perm[start:start + n]
        start += n
        for pos in range(c):
            live[tables[b, pos // page_size], pos % page_size] = True
    return k.astype(np.float32), v.astype(np.float32), tables.astype(np.int32), live


def ragged_prefill_case(rng, seqs, *, total, q_heads, kv_heads, head_dim, page_size,
                        pages_per_seq, dtype=None, spare_pages=3):
    """Random inputs for `seqs` = [(q_len, kv_len), ...] packed into `total` rows.

    Each sequence gets cdiv(kv_len, page_size) distinct pages drawn from a shuffled pool;
    its remaining block-table columns point at random pages (any, possibly NaN ones).
    Pool slots that hold no context token are NaN; q padding rows are random. Returns
    (q, k_pages, v_pages, block_tables, cu_q_lens, kv_lens), the floats in `dtype`
    (default float32)."""
    dtype = jnp.float32 if dtype is None else dtype
    q_lens = np.array([s[0] for s in seqs])
    kv_lens = np.array([s[1] for s in seqs])
    assert q_lens.sum() <= total and (q_lens <= kv_lens).all()
    assert (kv_lens <= pages_per_seq * page_size).all()
    k, v, tables, live = shuffled_pool(rng, kv_lens, kv_heads=kv_heads, head_dim=head_dim,
                                       page_size=page_size, pages_per_seq=pages_per_seq,
                                       spare_pages=spare_pages, max_pages=10**6)
    k[~live], v[~live] = np.nan, np.nan
    q = rng.standard_normal((total, q_heads, head_dim))
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables, jnp.int32), jnp.asarray(cu, jnp.int32),
            jnp.asarray(kv_lens, jnp.int32))


def bf16_and_f16_cases(names, f16_names) -> list:
    """pytest params (name, dtype) for a Mosaic kernel test: every case in bf16, and the
    few `f16_names` again in f16 (the same code with another element type; the full tier
    only); ids "NAME-bf16" / "NAME-f16"."""
    return ([pytest.param(n, jnp.bfloat16, id=f"{n}-bf16") for n in names]
            + [pytest.param(n, jnp.float16, id=f"{n}-f16", marks=pytest.mark.full)
               for n in f16_names])


DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def case_grid(cases, variants: dict, ids=None) -> list:
    """pytest params of every case in every variant: (*case, value) for a tuple case,
    (case, value) otherwise; `variants` maps an id to its value (DTYPES: f32, bf16), ids
    "CASE-VARIANT" (`ids`: the cases' own, default str(case)). The fast tier keeps one
    variant per case, taking the variants in turn (case i runs variant i mod len), so each
    variant still runs on its share of the cases; the other combinations are marked
    `full` (an interpret-mode kernel run costs ~1 s here)."""
    names = list(variants)
    ids = ids or [str(c) for c in cases]
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), variants[v],
                         id=f"{cid}-{v}",
                         marks=() if (i - j) % len(names) == 0 else pytest.mark.full)
            for i, (c, cid) in enumerate(zip(cases, ids)) for j, v in enumerate(names)]


# The engine's narrow KV pools (jaxserve.model.kv_cache), as the attention kernels get them:
# fp8 e4m3fn pages of scale 1, and int8 rows carrying their own scale.
NARROW_POOLS = ("fp8", "int8-rows")


def narrow_pool(pages, kind: str):
    """A float pool [..., head_dim] (NaN in the slots no context uses) as the engine stores
    it for --kv-cache-dtype fp8 ("fp8": float8_e4m3fn values, NaN kept) or int8
    ("int8-rows": quantize_kv_int8's rows [..., head_dim + 4], a NaN row's scale NaN): the
    poison survives, so a slot the kernel should not read still fails the test."""
    from jaxserve.kernels.common import quantize_kv_int8
    pages = jnp.asarray(pages, jnp.float32)
    if kind == "fp8":
        return pages.astype(jnp.float8_e4m3fn)
    if kind == "int8-rows":
        return quantize_kv_int8(pages)
    raise ValueError(f"kind must be one of {NARROW_POOLS}, got {kind!r}")
