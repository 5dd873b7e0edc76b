"""jaxserve.bench.pages: where a benchmark's sequences' pages lie in the pool (`jaxserve
bench step --page-order`, `tools/bench_cpu_attention.py --page-order`)."""

import numpy as np
import pytest

from jaxserve.engine.page_pool import EXTENT_PAGES
from jaxserve.bench.pages import page_ids
from jaxserve.bench.step import make_batch, shape_pages


@pytest.mark.parametrize("n", [1, EXTENT_PAGES, 5 * EXTENT_PAGES + 3])
@pytest.mark.parametrize("order", ["contiguous", "extents", "random"])
def test_every_order_lists_each_page_but_the_null_page_once(order, n):
    ids = page_ids(np.random.default_rng(0), n, order)
    assert sorted(ids.tolist()) == list(range(1, n + 1))


def test_extents_are_whole_runs_of_consecutive_ids_in_a_shuffled_order():
    n = 12 * EXTENT_PAGES + 5  # 12 whole extents and a short one
    ids = page_ids(np.random.default_rng(1), n, "extents")
    firsts, pos = [], 0
    while pos < n:  # each run: consecutive ids from an extent's first page
        first = int(ids[pos])
        assert (first - 1) % EXTENT_PAGES == 0
        length = min(EXTENT_PAGES, n - (first - 1))
        assert ids[pos:pos + length].tolist() == list(range(first, first + length))
        firsts.append(first)
        pos += length
    assert len(firsts) == 13
    assert firsts != sorted(firsts)  # shuffled (a sorted draw is 1 in 13!)


def test_random_order_is_not_contiguous_and_a_bad_order_is_named():
    ids = page_ids(np.random.default_rng(2), 64, "random")
    assert ids.tolist() != list(range(1, 65))
    with pytest.raises(ValueError, match="page order must be one of"):
        page_ids(np.random.default_rng(0), 4, "strided")


def test_bench_step_batch_takes_the_pages_in_the_order_asked():
    """make_batch's block tables follow page_ids, so --page-order reaches the step; the
    default (random) draws the same batch as before the option existed."""
    ps, B, L = 16, 4, 2 * EXTENT_PAGES
    num_pages = 1 + shape_pages("decode", B, L, 0, ps)
    b, _ = make_batch("decode", B, L, ps, num_pages, np.random.default_rng(3),
                      page_order="extents")
    want = page_ids(np.random.default_rng(3), num_pages - 1, "extents")
    assert b.block_tables[:B, :L].reshape(-1).tolist() == want[:B * L].tolist()
    old, _ = make_batch("decode", B, L, ps, num_pages, np.random.default_rng(3))
    drawn = np.random.default_rng(3).permutation(np.arange(1, num_pages))
    assert old.block_tables[:B, :L].reshape(-1).tolist() == drawn[:B * L].tolist()
