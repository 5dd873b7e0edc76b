"""Scheduler: admission, decode page reservation, preemption order (host only, no JAX).

A fake "model" appends token 7 to every scheduled sequence, so the scheduler's page
accounting is checked step by step without a device.
"""

import random

from jaxserve.config import EngineConfig
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence, SequenceStatus
from jaxserve.sampling_params import SamplingParams


def make(num_pages, **kw):
    cfg = EngineConfig(max_model_len=32).override(
        page_size=4, max_num_seqs=kw.pop("max_num_seqs", 8),
        max_prefill_tokens=kw.pop("max_prefill_tokens", 64), max_prefill_seqs=4, **kw)
    pool = PagePool(num_pages, cfg.cache.page_size)
    return Scheduler(cfg, pool), pool


def seq(rid, n, max_tokens=8):
    return Sequence(request_id=rid, prompt_ids=list(range(1, n + 1)),
                    params=SamplingParams(max_tokens=max_tokens), seed=0)


def run_to_completion(sched, seqs, max_steps=10_000):
    """Drive the scheduler like the engine does; returns the kinds of steps taken."""
    kinds = []
    for _ in range(max_steps):
        plan = sched.schedule()
        if plan is None:
            return kinds
        kinds.append(plan.kind)
        for s in plan.seqs:
            # invariants: pages hold every token whose K/V this step writes
            assert len(s.block_table) * sched.pool.page_size >= s.num_tokens
            assert len(set(s.block_table)) == len(s.block_table)
            s.num_computed = s.num_tokens
            s.output_ids.append(7)
            if len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= sched.cfg.max_model_len:
                sched.finish(s)
        live = [p for s in sched.running for p in s.block_table]
        assert len(live) == len(set(live)), "a page is owned twice"
        assert len(live) + sched.pool.num_free == sched.pool.capacity
    raise AssertionError("scheduler did not finish: livelock")


def test_prefill_batches_then_decodes():
    sched, pool = make(num_pages=64)
    for i in range(3):
        sched.add(seq(f"r{i}", 5))
    plan = sched.schedule()
    assert plan.kind == "prefill" and [s.request_id for s in plan.seqs] == ["r0", "r1", "r2"]
    assert all(len(s.block_table) == 2 for s in plan.seqs)
    for s in plan.seqs:
        s.output_ids.append(1)
    assert sched.schedule().kind == "decode"


def test_prefill_token_budget_splits_batches():
    sched, _ = make(num_pages=64, max_prefill_tokens=32)
    for i in range(4):
        sched.add(seq(f"r{i}", 16))
    assert len(sched.schedule().seqs) == 2  # 2 x 16 = 32 fits; 4 x 16 does not


def test_prefill_packs_prompts_by_summed_length():
    """Prompts share a step by their summed length (packed rows), not by batch x longest:
    5 + 9 + 10 = 24 tokens fit a 32-row budget (a padded 3 -> 4 x 16 rectangle would not);
    a fourth prompt would make 30 -> still 32 rows, a fifth 34 > 32."""
    sched, _ = make(num_pages=64, max_prefill_tokens=32)
    for i, n in enumerate((5, 9, 10, 6, 4)):
        sched.add(seq(f"r{i}", n))
    assert [s.request_id for s in sched.schedule().seqs] == ["r0", "r1", "r2", "r3"]


def test_max_num_seqs_caps_running():
    sched, _ = make(num_pages=64, max_num_seqs=2)
    for i in range(5):
        sched.add(seq(f"r{i}", 3))
    assert len(sched.schedule().seqs) == 2
    assert sched.schedule().kind == "decode"


def test_preempts_most_recent_and_completes_everything():
    # 9 usable pages of 4 tokens; each sequence grows to 4 + 12 = 16 tokens = 4 pages
    sched, pool = make(num_pages=10)
    seqs = [seq(f"r{i}", 4, max_tokens=12) for i in range(5)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched, seqs)
    assert sched.num_preemptions > 0
    assert all(s.status is SequenceStatus.FINISHED and len(s.output_ids) == 12 for s in seqs)
    assert pool.num_free == pool.capacity


def test_oldest_is_never_preempted_while_others_run():
    sched, pool = make(num_pages=10)
    seqs = [seq(f"r{i}", 4, max_tokens=12) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    for s in seqs:
        s.output_ids.append(7)
    preempted = []
    orig = sched.preempt
    sched.preempt = lambda s: (preempted.append(s.request_id), orig(s))
    run_to_completion(sched, seqs)
    assert "r0" not in preempted
    assert preempted and preempted[0] == "r2"


def test_abort_frees_pages_waiting_or_running():
    sched, pool = make(num_pages=16)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.schedule()
    sched.add(b)
    assert sched.abort("a") is a and a.status is SequenceStatus.FINISHED
    assert sched.abort("b") is b
    assert sched.abort("nope") is None
    assert pool.num_free == pool.capacity and not sched.has_work()


def test_random_workloads_finish_with_pool_full_again():
    rng = random.Random(0)
    for trial in range(20):
        sched, pool = make(num_pages=rng.randint(9, 30))
        seqs = [seq(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12)) for i in range(12)]
        for s in seqs:
            sched.add(s)
        run_to_completion(sched, seqs)
        assert all(s.status is SequenceStatus.FINISHED for s in seqs)
        assert pool.num_free == pool.capacity


def test_reserve_ahead_is_all_or_nothing():
    """Multi-step decode's lookahead pages: every sequence gets the pages for its extra
    tokens, or (not enough free) none does and nothing is preempted."""
    sched, pool = make(num_pages=9)  # page_size 4; 8 usable pages (page 0 is the null page)
    a, b = seq("a", 4), seq("b", 7)
    for s in (a, b):
        sched.add(s)
    plan = sched.schedule()
    assert plan.kind == "prefill" and len(plan.seqs) == 2  # a: 1 page, b: 2 pages
    for s in plan.seqs:
        s.output_ids.append(7)
    plan = sched.schedule()  # decode: a 5 tokens -> 2 pages, b 8 -> 2 pages
    assert plan.kind == "decode" and pool.num_free == 4
    assert sched.reserve_ahead(plan.seqs, 3)  # a 8 -> 2 pages, b 11 -> 3: one more page
    assert [len(s.block_table) for s in (a, b)] == [2, 3] and pool.num_free == 3
    assert not sched.reserve_ahead(plan.seqs, 12)  # a 17 -> 5, b 20 -> 5: 5 more > 3 free
    assert [len(s.block_table) for s in (a, b)] == [2, 3] and pool.num_free == 3
    assert sched.num_preemptions == 0 and len(sched.running) == 2


def test_launched_records_computed_tokens_and_placeholders():
    """Scheduler.launched: after a step sampling n tokens per sequence, each sequence's
    K/V covers every token but the last sampled one, n PLACEHOLDER outputs stand for the
    tokens in flight, and the first one's output index is returned."""
    from jaxserve.engine.scheduler import StepPlan
    from jaxserve.engine.sequence import PLACEHOLDER
    pool = PagePool(16, 4)
    sched = Scheduler(EngineConfig(max_model_len=32).override(
        page_size=4, max_num_seqs=4, max_prefill_tokens=32), pool)
    a, b = seq("a", 5), seq("b", 3)
    b.output_ids = [7, 8]
    assert sched.launched(StepPlan("decode", [a, b]), 4) == [0, 2]
    assert a.output_ids == [PLACEHOLDER] * 4 and b.output_ids == [7, 8] + [PLACEHOLDER] * 4
    assert (a.num_computed, b.num_computed) == (5 + 4 - 1, 5 + 4 - 1)
