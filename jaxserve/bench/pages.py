"""Where a benchmark's sequences' pages lie in the KV page pool (`jaxserve bench step`,
`tools/bench_cpu_attention.py`): decode attention reads each sequence's pages through its
block table, and how far apart they lie decides how well the CPU's prefetchers stream them
(PERFORMANCE.md, "Decode attention and the page pool's layout").

  contiguous: each sequence's pages one run of consecutive ids;
  extents:    runs of EXTENT_PAGES consecutive ids in a random order, as the engine's page
              pool (jaxserve.engine.page_pool) hands them out;
  random:     every page anywhere.
"""

from __future__ import annotations

import numpy as np

from jaxserve.engine.page_pool import EXTENT_PAGES

PAGE_ORDERS = ("contiguous", "extents", "random")


def page_ids(rng: np.random.Generator, n: int, order: str) -> np.ndarray:
    """Page ids 1 .. n (page 0 is the pool's null page) in the order block tables take
    them, the first sequence's first: [n] int64. `order`: one of PAGE_ORDERS. extents:
    runs of EXTENT_PAGES consecutive ids from 1 + k * EXTENT_PAGES (the last run shorter
    when n is not a multiple), shuffled as whole runs. Raises ValueError for another order."""
    ids = 1 + np.arange(n)
    if order == "contiguous":
        return ids
    if order == "random":
        return rng.permutation(ids)
    if order == "extents":
        runs = [ids[i:i + EXTENT_PAGES] for i in range(0, n, EXTENT_PAGES)]
        return np.concatenate([runs[i] for i in rng.permutation(len(runs))])
    raise ValueError(f"page order must be one of {PAGE_ORDERS}, got {order!r}")
