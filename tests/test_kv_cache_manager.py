"""KVCacheManager (pure Python, no JAX): pages follow a sequence's tokens, the prefix cache
hands out computed pages by reference, and every page comes back."""

from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.sequence import PLACEHOLDER, Sequence
from jaxserve.sampling_params import SamplingParams

PAGE = 4


def make(num_pages=17, prefix_caching=True) -> KVCacheManager:
    return KVCacheManager(PagePool(num_pages, PAGE), prefix_caching)


def seq(rid, ids, outputs=()) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(ids), params=SamplingParams(max_tokens=8),
                    seed=0, output_ids=list(outputs))


def computed(kv, s, n):
    """What the scheduler does: the pages of n tokens, then n tokens computed."""
    kv.allocate(s, n)
    s.num_computed = n
    kv.cache_full_pages(s)


def test_allocate_room_trim_free():
    kv = make(num_pages=5)  # 4 usable pages (page 0 is the null page): 16 tokens
    a = seq("a", range(6))
    assert kv.room(a, 100, reserve=0) == 16
    kv.allocate(a, 6)
    assert len(a.block_table) == 2 and kv.num_free == 2
    assert kv.room(a, 100, reserve=1) == 8 - 0 + 4  # 2 pages held + 1 free page usable
    kv.allocate(a, 13)  # room for drafts: 4 pages
    assert len(a.block_table) == 4 and kv.num_free == 0
    kv.trim(a)  # 6 tokens need 2 pages: the other 2 come back, last page first
    assert len(a.block_table) == 2 and kv.num_free == 2
    kv.free(a)
    assert a.block_table == [] and kv.num_free == 4


def test_allocate_all_is_all_or_nothing():
    kv = make(num_pages=5)
    a, b = seq("a", range(4)), seq("b", range(10, 14))
    kv.allocate(a, 4)
    kv.allocate(b, 4)
    assert not kv.allocate_all([a, b], [13, 13])  # 3 more pages each > 2 free
    assert (len(a.block_table), len(b.block_table), kv.num_free) == (1, 1, 2)
    assert kv.allocate_all([a, b], [8, 5])
    assert (len(a.block_table), len(b.block_table), kv.num_free) == (2, 2, 0)


def test_a_cached_prefix_is_shared_and_its_last_token_left_to_compute():
    kv = make()
    a = seq("a", range(100, 110))  # 2 full pages + 2 tokens
    computed(kv, a, 10)
    assert a.num_cached_pages == 2 and len(a.page_hashes) == 2
    b = seq("b", list(range(100, 108)) + [7, 7, 7])
    hit = kv.take_cached_prefix(b)
    assert hit == 8 and b.block_table == a.block_table[:2] and b.num_cached_pages == 2
    assert all(kv.pool.refcount(p) == 2 for p in b.block_table)
    kv.count_admission(b, hit)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (11, 8)
    c = seq("c", range(100, 108))  # a full match still computes its last token
    assert kv.take_cached_prefix(c) == 4
    kv.free(a)
    kv.free(b)
    kv.free(c)
    assert kv.num_free == kv.pool.capacity and kv.pool.num_cached == 2  # kept for later


def test_pages_of_unknown_tokens_are_not_cached():
    """A page whose last token is still being sampled (a PLACEHOLDER) is not registered."""
    kv = make()
    a = seq("a", range(100, 107), outputs=[PLACEHOLDER])
    computed(kv, a, 8)
    assert a.num_cached_pages == 1
    a.output_ids[-1] = 5
    kv.cache_full_pages(a)
    assert a.num_cached_pages == 2


def test_prefix_caching_off_shares_nothing():
    kv = make(prefix_caching=False)
    a = seq("a", range(100, 110))
    computed(kv, a, 10)
    b = seq("b", range(100, 110))
    assert kv.take_cached_prefix(b) == 0 and b.block_table == []
    kv.count_admission(b, 0)
    assert kv.prefix_cache_queries == kv.pool.num_cached == 0


def test_a_prefix_being_computed_is_waited_for():
    kv = make()
    a = seq("a", range(100, 120))
    kv.allocate(a, 8)
    a.num_computed = 8  # its first 2 pages in flight
    kv.cache_full_pages(a)
    assert a.num_cached_pages == 2
    b = seq("b", range(100, 120))
    kv._hashes(a, 4)  # a's hashes of the pages it will compute next
    assert kv.prefix_in_progress(b, [a])  # b's 3rd page is a's next chunk
    a.num_computed = 20
    assert not kv.prefix_in_progress(b, [a])  # a is done computing its prompt


def test_a_sequence_needing_prompt_logprobs_takes_no_cached_pages():
    kv = make()
    computed(kv, seq("a", range(100, 110)), 10)
    b = Sequence(request_id="b", prompt_ids=list(range(100, 110)),
                 params=SamplingParams(max_tokens=8, prompt_logprobs=0), seed=0)
    assert kv.take_cached_prefix(b) == 0 and not kv.prefix_in_progress(b, [])


def test_reset_forgets_every_cached_page():
    kv = make()
    a = seq("a", range(100, 110))
    computed(kv, a, 10)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.take_cached_prefix(seq("b", range(100, 110))) == 0


def test_sequences_decoding_side_by_side_keep_their_pages_together():
    """The manager hands the pool each sequence's last page, so decode's one page at a
    time per sequence still gives each a run of consecutive pages (an extent's worth)."""
    kv = KVCacheManager(PagePool(1 + 4 * 8, PAGE, extent_pages=8), False)
    a, b = seq("a", range(3)), seq("b", range(3))
    for n in range(4, 4 * PAGE * 8 // 2 + 1):
        for s in (a, b):
            kv.allocate(s, n)
    assert a.block_table == list(range(1, 9)) + list(range(17, 25))
    assert b.block_table == list(range(9, 17)) + list(range(25, 33))
