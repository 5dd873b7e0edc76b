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


# --- the prefix cache -----------------------------------------------------------------------

def test_page_hashes_chain_over_the_whole_prefix():
    from jaxserve.engine.page_pool import page_hashes
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the partial third page has no hash
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    # same second page after a different first page: a different hash (chained)
    b = page_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert b[0] != a[0] and b[1] != a[1]
    # incremental: page 1 from page 0's hash
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, start=1, parent=a[0]) == a[1:]
    assert page_hashes([2**31 - 1, -1, 0, 5], 4) != page_hashes([-1, 2**31 - 1, 0, 5], 4)


def test_cached_pages_stay_until_evicted_least_recently_freed_first():
    pool = PagePool(num_pages=5, page_size=4)  # 4 usable pages
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a[0], b"ha")
    pool.register(b[0], b"hb")
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.lookup([b"ha", b"hb", b"hc"]) == a + b
    assert pool.lookup([b"hb"]) == b and pool.lookup([b"hx", b"ha"]) == []
    # never-cached pages go first, then the least recently freed cached page (a)
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(a + b) and pool.num_evictions == 0
    assert pool.allocate(1) == a and pool.num_evictions == 1
    assert pool.lookup([b"ha"]) == [] and pool.lookup([b"hb"]) == b
    # a hit takes a cached page off the evictable list; it is held again
    pool.share(b)
    assert pool.refcount(b[0]) == 1 and pool.num_free == 0
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    pool.free(b)
    assert pool.num_free == 1 and pool.lookup([b"hb"]) == b


def test_register_keeps_the_first_page_of_a_hash_and_clear_cache_forgets_all():
    pool = PagePool(num_pages=4, page_size=4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a[0], b"h")
    pool.register(b[0], b"h")  # the same content computed twice: b stays private
    assert pool.lookup([b"h"]) == a and pool.num_cached == 1
    pool.free(a + b)
    pool.clear_cache()
    assert pool.num_cached == 0 and pool.num_free == 3 and pool.lookup([b"h"]) == []
    with pytest.raises(ValueError, match="not allocated"):
        pool.register(a[0], b"h")
    with pytest.raises(ValueError, match="not allocated"):
        pool.share(a)
