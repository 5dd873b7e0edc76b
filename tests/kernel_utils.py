"""Inputs shared by the attention-kernel tests: a shuffled page pool."""

from __future__ import annotations

import numpy as np


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
