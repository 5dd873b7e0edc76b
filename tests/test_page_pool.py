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


# --- which page: a sequence's pages kept together ------------------------------------------

def _runs(pages):
    """Lengths of the runs of consecutive page ids in a block table."""
    runs = [1]
    for a, b in zip(pages, pages[1:]):
        if b == a + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def test_sequences_decoding_side_by_side_get_runs_of_an_extent():
    """Three sequences taking one page each in turn (as decode does) each get extents of
    consecutive pages, not every third page of one list."""
    pool = PagePool(num_pages=1 + 4 * 8, page_size=16, extent_pages=4)
    tables = [[], [], []]
    for _ in range(8):
        for t in tables:
            t += pool.allocate(1, t[-1] if t else None)
    for t in tables:
        assert _runs(t) == [4, 4] and all((t[i] - 1) % 4 == 0 for i in (0, 4))
    assert len(set(sum(tables, []))) == 24
    # a prompt's pages in one call: consecutive across extents while whole ones are in order
    assert _runs(pool.allocate(8)) == [8]


def test_a_partial_extent_is_used_only_when_no_whole_one_is_left():
    pool = PagePool(num_pages=1 + 2 * 4, page_size=16, extent_pages=4)
    a = pool.allocate(1)  # extent 0
    b = pool.allocate(1)  # extent 1
    assert (a, b) == ([1], [5])
    c = pool.allocate(1)  # no whole extent left: the first free page, even in a's extent
    assert c == [2]
    assert pool.allocate(1, after=a[0]) == [3]  # a's next free page, past c's
    pool.free(a + b + c)


def test_eviction_takes_the_callers_next_page_then_whole_extents_least_recently_released():
    pool = PagePool(num_pages=1 + 3 * 4, page_size=16, extent_pages=4)
    seqs = [pool.allocate(4) for _ in range(3)]  # extents 0, 1, 2
    assert seqs == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    for i, s in enumerate(seqs):
        for j, p in enumerate(s):
            pool.register(p, bytes([i, j]))
    pool.free(seqs[1][::-1])
    pool.free(seqs[0][::-1])
    pool.free(seqs[2][::-1])
    assert pool.num_free == 12 and pool.num_cached == 12
    # no never-cached page: extent 1 was released first, so it goes first, page by page
    new = pool.allocate(2)
    assert new == [5, 6] and pool.num_evictions == 2
    assert pool.lookup([bytes([1, 0])]) == [] and pool.lookup([bytes([0, 0])]) == [1]
    # a prefix hit on extent 0 holds it; the next new sequence takes extent 2
    pool.share([1])
    assert pool.allocate(1) == [9]
    # the first sequence's next page is its extent's next one, though cached
    assert pool.allocate(1, after=new[-1]) == [7]
    # no whole extent left: the least recently freed page (page-level LRU)
    assert pool.allocate(1) == [8]  # freed before extent 0's pages 2-4 (extent 1 first)


def test_a_prefix_hit_does_not_evict_the_cached_page_after_it():
    """A conversation's cached turn after a shared system prompt survives another
    conversation that hits the same system prompt: the hit continues elsewhere."""
    pool = PagePool(num_pages=1 + 2 * 4, page_size=16, extent_pages=4)
    first = pool.allocate(4)  # the system prompt (2 pages), then conversation A's turn
    assert first == [1, 2, 3, 4]
    for i, p in enumerate(first):
        pool.register(p, b"turn-a" + bytes([i]))
    other = pool.allocate(4)  # extent 1, cached by someone else and released earlier
    for i, p in enumerate(other):
        pool.register(p, b"other" + bytes([i]))
    pool.free(other[::-1])
    pool.free(first[::-1])
    hit = pool.lookup([b"turn-a\x00", b"turn-a\x01"])
    assert hit == [1, 2]
    pool.share(hit)  # conversation B: the same system prompt
    assert pool.allocate(1, after=hit[-1]) == [5]  # not A's turn (3): extent 1, LRU
    assert pool.lookup([b"turn-a" + bytes([i]) for i in range(4)]) == [1, 2, 3, 4]
    # the allocation opened extent 1, so its sequence continues there though cached
    assert pool.allocate(1, after=5) == [6]


def test_bookkeeping_holds_under_random_use():
    """Random allocate / share / free / register / clear_cache: the pool's per-extent
    counts and whole-extent sets equal a recount, and every page is in one state."""
    import random
    rng = random.Random(0)
    pool = PagePool(num_pages=1 + 7 * 3 + 2, page_size=4, extent_pages=3)  # a short last extent
    tables: list[list[int]] = []
    clears = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45 and pool.num_free:
            if tables and rng.random() < 0.7:
                t = rng.choice(tables)
                t += pool.allocate(rng.randint(1, min(3, pool.num_free)), t[-1] if t else None)
            else:
                tables.append(pool.allocate(rng.randint(1, min(4, pool.num_free))))
        elif op < 0.6 and tables:
            t = rng.choice(tables)
            if t:
                pool.register(rng.choice(t), rng.randbytes(2))
        elif op < 0.7:
            hashes = [rng.randbytes(2) for _ in range(3)]
            hit = pool.lookup(hashes) + [p for p in list(pool._evictable)[:1]]
            pool.share(hit)
            tables.append(hit)
        elif op < 0.98 and tables:
            t = tables.pop(rng.randrange(len(tables)))
            pool.free(t[::-1])
        elif op >= 0.98:
            pool.clear_cache()  # held pages keep their K/V but are no longer cached
            clears += 1
        held = [0] * pool.num_pages
        for t in tables:
            for p in t:
                held[p] += 1
        assert held[1:] == pool._refs[1:] and NULL_PAGE not in pool._free
        unheld = [p for p in range(1, pool.num_pages) if not held[p]]
        assert set(unheld) == set(pool._free) | set(pool._evictable)
        assert not set(pool._free) & set(pool._evictable)
        assert set(pool._evictable) <= set(pool._hash_of)
        assert not set(pool._free) & set(pool._hash_of)
        ext = [(p - 1) // 3 for p in range(pool.num_pages)]
        for e, size in enumerate(pool._extent_size):
            n_unheld = sum(1 for p in unheld if ext[p] == e)
            n_free = sum(1 for p in pool._free if ext[p] == e)
            assert (pool._unheld[e], pool._nfree[e]) == (n_unheld, n_free)
            assert (e in pool._whole) == (n_unheld == size)
            assert (e in pool._whole_free) == (n_free == size)
            assert not (pool._claimed[e] and e in pool._whole)
    assert pool.num_evictions > 0 and clears > 0


def test_extents_of_one_page_hand_out_pages_in_fifo_and_lru_order():
    """extent_pages=1 is the order of before (and vLLM's free-block queue): never-cached
    pages first in the order freed, then cached ones least recently freed first; checked
    against that rule written out, under random use."""
    import random
    from collections import OrderedDict, deque
    rng = random.Random(1)
    pool = PagePool(num_pages=40, page_size=4, extent_pages=1)
    free, evictable, cached = deque(range(1, 40)), OrderedDict(), set()
    tables = []
    for _ in range(2000):
        if rng.random() < 0.5 and pool.num_free:
            n = rng.randint(1, min(4, pool.num_free))
            want = []
            for _ in range(n):
                if free:
                    want.append(free.popleft())
                else:
                    p, _ = evictable.popitem(last=False)
                    cached.discard(p)
                    want.append(p)
            got = pool.allocate(n, rng.choice([None, *range(1, 40)]))
            assert got == want
            tables.append(got)
            if rng.random() < 0.5:
                pool.register(got[0], rng.randbytes(4))
                cached.add(got[0])
        elif tables:
            t = tables.pop(rng.randrange(len(tables)))
            pool.free(t[::-1])
            for p in t[::-1]:
                (evictable.__setitem__(p, None) if p in cached else free.append(p))
    assert pool.num_evictions > 0
