"""Scheduler tests (pure Python, no JAX): the token budget, chunked prefill, preemption,
and the invariants any workload keeps (budget never exceeded, pages cover the computed
tokens, no page owned twice, everything finishes, the pool is full again)."""

import collections
import itertools
import random

import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from jaxserve.sampling_params import SamplingParams


def make(num_pages, **kw):
    cfg = EngineConfig(max_model_len=kw.pop("max_model_len", 32)).override(
        page_size=4, max_num_seqs=kw.pop("max_num_seqs", 8),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64), **kw)
    pool = PagePool(num_pages, cfg.cache.page_size)
    return Scheduler(cfg, KVCacheManager(pool, cfg.cache.enable_prefix_caching)), pool


_prompts = itertools.count()


def seq(rid, n, max_tokens=8):
    """A request of an `n`-token prompt shared with no other (no prefix-cache hits)."""
    base = 10_000 * next(_prompts)
    return Sequence(request_id=rid, prompt_ids=list(range(base, base + n)),
                    params=SamplingParams(max_tokens=max_tokens), seed=0)


def check_plan(sched, plan):
    """What every plan keeps: within the budget, every planned sequence running with the
    pages of its chunk, each page referenced once per holder, pool accounting exact."""
    assert plan.num_tokens <= sched.cfg.scheduler.max_num_batched_tokens
    assert len(sched.running) <= sched.cfg.scheduler.max_num_seqs
    for s, n in zip(plan.seqs, plan.num_new):
        assert s.status is SequenceStatus.RUNNING and n >= 1
        assert s.num_computed + n <= s.num_tokens
        assert len(s.block_table) * sched.kv.pool.page_size >= s.num_computed + n
    owners = collections.Counter(p for s in sched.running for p in s.block_table)
    for s in sched.running:
        assert len(set(s.block_table)) == len(s.block_table), "a page is in a table twice"
    for page, n in owners.items():  # shared pages: one reference per holder
        assert sched.kv.pool.refcount(page) == n
    assert len(owners) + sched.kv.pool.num_free == sched.kv.pool.capacity


def advance(sched, plan, token=7):
    """What the engine does with a launched plan once its tokens are read."""
    first = sched.launched(plan)
    for s, index in zip(plan.seqs, first):
        if index is None:
            continue
        sched.commit(s, index, [token])
        if len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= sched.cfg.max_model_len:
            sched.finish(s, "length")


def run_to_completion(sched, max_steps=10_000, on_plan=None):
    """Drive the scheduler like the engine does; returns the plans."""
    plans = []
    for _ in range(max_steps):
        plan = sched.schedule()
        if plan is None:
            return plans
        check_plan(sched, plan)
        if on_plan:
            on_plan(plan)
        plans.append(plan)
        advance(sched, plan)
    raise AssertionError("scheduler did not finish: livelock")


def test_prompts_share_a_step_then_decode():
    sched, pool = make(num_pages=64)
    for i in range(3):
        sched.add(seq(f"r{i}", 5))
    plan = sched.schedule()
    assert not plan.decode and [s.request_id for s in plan.seqs] == ["r0", "r1", "r2"]
    assert plan.num_new == [5, 5, 5] and plan.samples == [True] * 3
    assert all(len(s.block_table) == 2 for s in plan.seqs)
    advance(sched, plan)
    plan = sched.schedule()
    assert plan.decode and plan.num_new == [1, 1, 1]


def test_decodes_come_first_then_chunks_up_to_the_budget():
    sched, _ = make(num_pages=64, max_num_batched_tokens=16)
    a, b = seq("a", 3), seq("b", 30)
    sched.add(a)
    advance(sched, sched.schedule())  # a prefilled: it decodes from now on
    sched.add(b)
    plan = sched.schedule()
    # a's decode token first, then 15 of b's 30 prompt tokens (ending mid-page)
    assert [s.request_id for s in plan.seqs] == ["a", "b"] and plan.num_new == [1, 15]
    assert plan.samples == [True, False] and not plan.decode
    assert sched.launched(plan) == [1, None]
    assert b.num_computed == 15 and b.output_ids == [] and len(b.block_table) == 4
    sched.commit(a, len(a.output_ids) - 1, [7])
    plan = sched.schedule()
    assert plan.num_new == [1, 15] and plan.samples == [True, True]  # b's last chunk samples
    assert sched.launched(plan) == [2, 0] and b.num_computed == 30


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it():
    sched, _ = make(num_pages=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    sched.add(seq("a", 20))
    sched.add(seq("b", 20))
    plan = sched.schedule()
    assert plan.num_new == [20]  # b's 20 do not fit in the 12 rows left
    advance(sched, plan)
    assert sched.schedule().num_new == [1, 20]


def test_no_chunked_prefill_needs_a_budget_of_max_model_len():
    from jaxserve.config import ConfigError
    with pytest.raises(ConfigError, match="must hold max_model_len"):
        make(num_pages=64, max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ConfigError, match="at least max_num_seqs"):
        make(num_pages=64, max_num_batched_tokens=4, max_num_seqs=8)


def test_max_num_seqs_caps_running():
    sched, _ = make(num_pages=64, max_num_seqs=2)
    for i in range(5):
        sched.add(seq(f"r{i}", 3))
    plan = sched.schedule()
    assert len(plan.seqs) == 2
    advance(sched, plan)
    assert sched.schedule().decode


def test_preempts_most_recent_and_completes_everything():
    # 9 usable pages of 4 tokens; each sequence grows to 4 + 12 = 16 tokens = 4 pages
    sched, pool = make(num_pages=10)
    seqs = [seq(f"r{i}", 4, max_tokens=12) for i in range(5)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert all(s.finished and len(s.output_ids) == 12 for s in seqs)
    assert pool.num_free == pool.capacity


def test_oldest_is_never_preempted_while_others_run():
    sched, pool = make(num_pages=10)
    seqs = [seq(f"r{i}", 4, max_tokens=12) for i in range(3)]
    for s in seqs:
        sched.add(s)
    preempted = []
    orig = sched.preempt
    sched.preempt = lambda s: (preempted.append(s.request_id), orig(s))
    run_to_completion(sched)
    assert "r0" not in preempted
    assert preempted and preempted[0] == "r2"


def test_abort_frees_pages_waiting_or_running():
    sched, pool = make(num_pages=16)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.schedule()
    sched.add(b)
    assert sched.abort("a", "abort") is a and a.finished
    assert sched.abort("b", "abort") is b
    assert sched.abort("nope", "abort") is None
    assert pool.num_free == pool.capacity and not sched.has_work()


@pytest.mark.parametrize("chunked,keys", [(True, None), (False, None), (True, 3), (False, 3)])
def test_random_workloads_keep_the_invariants_and_finish(chunked, keys):
    rng = random.Random(0)
    hits = 0
    for trial in range(40):
        budget = rng.choice([8, 13, 32, 64]) if chunked else 32
        sched, pool = make(num_pages=rng.randint(9, 30), max_num_batched_tokens=budget,
                           max_num_seqs=rng.choice([2, 4, 8]), enable_chunked_prefill=chunked,
                           dynamic_chunking_keys=keys)
        seqs = [seq(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12))
                for i in range(12)]
        for s in seqs[::2]:  # half of them share a prefix with others (prefix-cache hits)
            s.prompt_ids[:8] = range(8) if rng.random() < 0.5 else range(50, 58)
        pending = list(seqs)
        preempt = sched.preempt

        def checked_preempt(s):  # the oldest running sequence always progresses
            assert s is not min(sched.running, key=lambda r: r.admitted)
            preempt(s)

        sched.preempt = checked_preempt

        def arrive(plan):  # requests keep arriving while others run
            while pending and rng.random() < 0.5:
                sched.add(pending.pop(0))

        sched.add(pending.pop(0))
        while pending or sched.has_work():
            run_to_completion(sched, on_plan=arrive)
            if pending:
                sched.add(pending.pop(0))
        assert all(s.finished for s in seqs)
        assert pool.num_free == pool.capacity
        hits += sched.kv.prefix_cache_hits
    assert hits > 0


def long_prompt_chunks(num_streams, budget, keys=None):
    """(start, rows) of each chunk of a 1,900-token prompt among `num_streams` decoding
    streams, `budget` rows a step (dynamic chunking: `keys`); checks that every stream
    decodes in every step and that the prompt completes without preemptions."""
    sched, _ = make(num_pages=2000, max_num_seqs=num_streams + 1,
                    max_num_batched_tokens=budget, max_model_len=2048,
                    dynamic_chunking_keys=keys)
    streams = [seq(f"s{i}", 8, max_tokens=1000) for i in range(num_streams)]
    for s in streams:
        sched.add(s)
    while not all(s.output_ids for s in streams):
        advance(sched, sched.schedule())
    long = seq("long", 1900, max_tokens=1)
    sched.add(long)
    chunks = []
    while not long.finished:
        plan = sched.schedule()
        check_plan(sched, plan)
        assert sum(1 for s in plan.seqs if s in streams) == num_streams  # every step
        chunks.append((long.num_computed, plan.num_new[plan.seqs.index(long)]))
        advance(sched, plan)
    assert sum(n for _, n in chunks) == 1900 and sched.num_preemptions == 0
    return chunks


def test_a_long_prompt_among_32_decoding_streams_completes():
    """No starvation: 32 streams decode in every step, and a long prompt's chunks fill the
    rest of each step's budget until it completes."""
    chunks = long_prompt_chunks(32, 48)
    assert [n for _, n in chunks] == [16] * (1900 // 16) + [1900 % 16]


def chunk_cost(n, start, keys):
    """A prompt chunk's cost in token rows under dynamic chunking
    (SchedulerConfig.dynamic_chunking_keys): its rows, plus its query-key pairs over K."""
    return n + (n * start + n * (n + 1) / 2) / keys


def test_dynamic_chunking_cuts_a_long_prompts_late_chunks_to_the_first_ones_cost():
    """Without it every chunk takes the 48 rows the streams leave; with it the chunks
    from the first 64 tokens (the budget) do too, and each later one the most rows whose
    cost (rows + query-key pairs / K) stays within the first one's, so the chunks shrink
    as the context they attend to grows (SGLang's dynamic chunking)."""
    assert [n for _, n in long_prompt_chunks(16, 64)[:-1]] == [48] * (1900 // 48)
    keys = 256
    chunks = long_prompt_chunks(16, 64, keys)
    assert chunks[:2] == [(0, 48), (48, 48)]
    first = chunk_cost(48, 0, keys)
    for start, n in chunks[2:-1]:  # (the last one is what is left of the prompt)
        assert chunk_cost(n, start, keys) <= first < chunk_cost(n + 1, start, keys)
    sizes = [n for _, n in chunks]
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True)
    assert sizes[-2] <= 48 / 4  # at ~1,850 keys, a row costs ~8 rows' matmuls here


def prefix_hit_chunk(budget, keys, cached=32):
    """Rows planned for a 72-token prompt whose first `cached` tokens are in the prefix
    cache, admitted beside one decoding stream (page size 4, dynamic chunking: keys)."""
    sched, _ = make(num_pages=64, max_num_batched_tokens=budget, max_model_len=128,
                    dynamic_chunking_keys=keys)
    a = seq("a", cached, max_tokens=1)
    sched.add(a)
    run_to_completion(sched)
    stream = seq("s", 3, max_tokens=20)
    sched.add(stream)
    advance(sched, sched.schedule())
    b = seq("b", 72)
    b.prompt_ids[:cached] = a.prompt_ids
    sched.add(b)
    plan = sched.schedule()
    assert b.num_computed == cached and plan.seqs == [stream, b]
    return plan.num_new[1]


def test_dynamic_chunking_leaves_short_prompts_whole():
    """Prompts with nothing computed before them are planned as without it (their chunks
    together cost at most what the rows left cost as one: n1^2 + n2^2 <= (n1 + n2)^2), and
    so is one with a cached prefix no longer than the budget; a longer cached prefix is
    attended to, and its chunk cut; a long prompt alone (no stream waits on its steps) is
    chunked as without it."""
    plans = {}
    for keys in (None, 3):
        sched, _ = make(num_pages=64, max_num_batched_tokens=64, dynamic_chunking_keys=keys)
        stream = seq("s", 3, max_tokens=20)
        sched.add(stream)
        advance(sched, sched.schedule())  # it decodes from now on
        for i, n in enumerate((20, 30, 30)):
            sched.add(seq(f"r{i}", n))
        plans[keys] = sched.schedule().num_new
    assert plans[3] == plans[None] == [1, 20, 30, 13]

    keys = 4
    assert prefix_hit_chunk(41, keys) == prefix_hit_chunk(41, None) == 40
    assert prefix_hit_chunk(25, None) == 24
    n = prefix_hit_chunk(25, keys)  # 32 cached tokens > the budget of 25
    assert n < 24 and chunk_cost(n, 32, keys) <= chunk_cost(24, 0, keys) < chunk_cost(n + 1, 32, keys)

    sched, _ = make(num_pages=64, max_num_batched_tokens=16, max_model_len=128,
                    dynamic_chunking_keys=keys)
    sched.add(seq("alone", 100, max_tokens=1))
    assert [p.num_new for p in run_to_completion(sched)] == [[16]] * 6 + [[4]]


def test_pages_ahead_are_all_or_nothing():
    """Multi-step decode's lookahead pages: every sequence gets the pages for its extra
    tokens, or (not enough free) none does and nothing is preempted."""
    sched, pool = make(num_pages=9)  # page_size 4; 8 usable pages (page 0 is the null page)
    a, b = seq("a", 4), seq("b", 7)
    for s in (a, b):
        sched.add(s)
    plan = sched.schedule()
    assert len(plan.seqs) == 2  # a: 1 page, b: 2 pages
    advance(sched, plan)
    plan = sched.schedule()  # decode: a 5 tokens -> 2 pages, b 8 -> 2 pages
    assert plan.decode and pool.num_free == 4
    more = sched.kv.allocate_all
    assert more(plan.seqs, [s.num_tokens + 3 for s in plan.seqs])  # a 8 -> 2 pages, b 11 -> 3
    assert [len(s.block_table) for s in (a, b)] == [2, 3] and pool.num_free == 3
    assert not more(plan.seqs, [s.num_tokens + 12 for s in plan.seqs])  # a 17 -> 5, b 20 -> 5 > 3
    assert [len(s.block_table) for s in (a, b)] == [2, 3] and pool.num_free == 3
    assert sched.num_preemptions == 0 and len(sched.running) == 2


def test_launched_records_computed_tokens_and_placeholders():
    """Scheduler.launched: after a step sampling n tokens per sequence, each sequence's
    K/V covers every token but the last sampled one, n PLACEHOLDER outputs stand for the
    tokens in flight, and the first one's output index is returned."""
    sched, pool = make(num_pages=16)
    a, b = seq("a", 5), seq("b", 3)
    b.output_ids = [7, 8]
    a.num_computed, b.num_computed = 4, 4
    a.block_table, b.block_table = pool.allocate(3), pool.allocate(3)
    plan = SchedulerOutput([a, b], [1, 1], num_steps=4)
    assert plan.decode
    assert sched.launched(plan) == [0, 2]
    assert a.output_ids == [PLACEHOLDER] * 4 and b.output_ids == [7, 8] + [PLACEHOLDER] * 4
    assert (a.num_computed, b.num_computed) == (5 + 4 - 1, 5 + 4 - 1)
    # the prefix cache holds the full pages of known tokens: a 1 (of 5 known), b 1 (of 5)
    assert (a.num_cached_pages, b.num_cached_pages) == (1, 1) and pool.num_cached == 2


# --- prefix caching ---------------------------------------------------------------------------

def prompt_seq(rid, ids, max_tokens=4):
    return Sequence(request_id=rid, prompt_ids=list(ids), params=SamplingParams(max_tokens=max_tokens),
                    seed=0)


def finish_all(sched, max_steps=1000):
    for _ in range(max_steps):
        plan = sched.schedule()
        if plan is None:
            return
        check_plan(sched, plan)
        advance(sched, plan)
    raise AssertionError("did not finish")


def test_a_shared_prefix_is_computed_once():
    """b shares a's first 3 full pages (12 tokens); only its own tail is computed, and the
    counters say so; the last prompt token is always computed, even on a full match."""
    sched, pool = make(num_pages=32)
    system = list(range(100, 112))  # 3 pages of 4
    a = prompt_seq("a", system + [1, 2])
    sched.add(a)
    finish_all(sched)
    b, c = prompt_seq("b", system + [3, 4, 5]), prompt_seq("c", system)
    sched.add(b)
    sched.add(c)
    plan = sched.schedule()
    assert plan.num_new == [3, 4]  # b: its 3 own tokens; c: its whole last page again
    assert b.num_computed == 12 and c.num_computed == 8
    assert sched.kv.prefix_cache_hits == 12 + 8
    assert sched.kv.prefix_cache_queries == 14 + 15 + 12
    shared = b.block_table[:3]
    assert c.block_table[:2] == shared[:2] and all(pool.refcount(p) == 2 for p in shared[:2])
    advance(sched, plan)
    finish_all(sched)
    assert pool.num_free == pool.capacity  # shared pages freed exactly once


def test_prefix_caching_off_computes_everything():
    sched, pool = make(num_pages=32, enable_prefix_caching=False)
    for rid in ("a", "b"):
        sched.add(prompt_seq(rid, range(100, 114)))
        plan = sched.schedule()
        assert plan.num_new == [14]
        finish_all(sched)
    assert sched.kv.prefix_cache_hits == sched.kv.prefix_cache_queries == 0
    assert pool.num_cached == 0


def test_a_hit_on_pages_a_running_prefill_is_still_writing():
    """Pages are registered when the step computing them is launched: a request arriving
    one step later hits them while that step may still run (the engine launches the next
    step before it reads this one's results; the device runs them in order)."""
    sched, pool = make(num_pages=32, max_num_batched_tokens=8)
    ids = list(range(100, 112))  # 3 pages
    a = prompt_seq("a", ids)
    sched.add(a)
    plan = sched.schedule()
    assert plan.num_new == [8]
    sched.launched(plan)  # a's first two pages computed (in flight on device)
    b = prompt_seq("b", ids[:10])
    sched.add(b)
    plan = sched.schedule()
    assert plan.seqs == [a, b] and plan.num_new == [4, 2]
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed == 8
    assert sched.kv.prefix_cache_hits == 8


def test_eviction_under_a_small_pool_and_abort_of_one_sharer():
    sched, pool = make(num_pages=9, max_model_len=32)  # 8 usable pages
    base = list(range(200, 216))  # 4 pages
    a, b = prompt_seq("a", base + [1]), prompt_seq("b", base + [2])
    sched.add(a)
    finish_all(sched)
    assert pool.num_cached >= 4
    sched.add(b)
    plan = sched.schedule()
    assert plan.num_new == [1] and b.num_computed == 16  # all 4 pages hit
    c = prompt_seq("c", base + [3])
    sched.add(c)
    advance(sched, plan)
    plan = sched.schedule()
    assert c in plan.seqs and c.block_table[:4] == b.block_table[:4]
    assert all(pool.refcount(p) == 2 for p in b.block_table[:4])
    sched.abort("b", "abort")  # one sharer leaves: the pages stay with the other
    assert all(pool.refcount(p) == 1 for p in c.block_table[:4])
    advance(sched, plan)
    finish_all(sched)
    # different content fills the pool: the cached pages are evicted for it
    d = prompt_seq("d", range(300, 330), max_tokens=2)
    sched.add(d)
    finish_all(sched)
    assert pool.num_evictions > 0 and d.finished
    assert pool.lookup(page_hashes_of(base, 4)) == []  # evicted for d
    assert pool.num_free == pool.capacity


def page_hashes_of(ids, page_size):
    from jaxserve.engine.page_pool import page_hashes
    return page_hashes(ids, page_size)


def test_preempted_sequence_recomputes_from_its_own_cached_pages():
    sched, pool = make(num_pages=10, max_model_len=32)
    seqs = [prompt_seq(f"r{i}", range(10 * i, 10 * i + 8), max_tokens=12) for i in range(4)]
    for s in seqs:
        sched.add(s)
    finish_all(sched)
    assert sched.num_preemptions > 0
    assert sched.kv.prefix_cache_hits > 0, "a recomputed sequence found its pages cached"
    assert all(len(s.output_ids) == 12 for s in seqs)
    assert pool.num_free == pool.capacity


def test_a_request_waits_for_the_prefix_another_is_computing():
    """Two requests with one 30-token prompt arrive together (budget 8): the second waits
    while the first computes the shared pages chunk by chunk (an unrelated request is
    admitted meanwhile), then takes all 7 full pages from the cache."""
    sched, pool = make(num_pages=64, max_num_batched_tokens=8)
    ids = list(range(500, 530))
    first, second, other = prompt_seq("a", ids), prompt_seq("b", ids), seq("c", 3)
    for s in (first, second, other):
        sched.add(s)
    for _ in range(10):
        plan = sched.schedule()
        check_plan(sched, plan)
        if second in plan.seqs:
            assert plan.num_new[plan.seqs.index(second)] == 2 and second.num_computed == 28
            break
        advance(sched, plan)
    assert other.status is not SequenceStatus.WAITING, "admitted while the second waited"
    advance(sched, plan)
    finish_all(sched)
    assert sched.kv.prefix_cache_hits == 28 and pool.num_free == pool.capacity
