"""PagePool: free list and refcounts (host only, no JAX)."""

import pytest

from jaxserve.engine.page_pool import NULL_PAGE, OutOfPages, PagePool


def test_allocate_and_free_round_trip():
    pool = PagePool(num_pages=9, page_size=16)
    assert pool.capacity == 8 and pool.num_free == 8
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert NULL_PAGE not in a + b
    assert len(set(a + b)) == 8 and pool.num_free == 0
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 3
    pool.free(b)
    assert pool.num_free == 8


def test_out_of_pages_allocates_nothing():
    pool = PagePool(num_pages=5, page_size=4)
    pool.allocate(2)
    with pytest.raises(OutOfPages):
        pool.allocate(3)
    assert pool.num_free == 2


def test_refcounts_share_and_double_free():
    pool = PagePool(num_pages=4, page_size=4)
    pages = pool.allocate(2)
    pool.share(pages)
    assert all(pool.refcount(p) == 2 for p in pages)
    pool.free(pages)
    assert pool.num_free == 1  # still referenced once
    pool.free(pages)
    assert pool.num_free == 3
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(pages[:1])
    with pytest.raises(ValueError):
        pool.free([NULL_PAGE])


@pytest.mark.parametrize("tokens,pages", [(1, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_pages_for(tokens, pages):
    assert PagePool(num_pages=8, page_size=16).pages_for(tokens) == pages
