"""Speculative decoding's host-side planning, pure Python (no JAX): the pages and budget
drafts take, verify steps planned ahead of the previous one's read (the furthest case's
pages, given back when read), verify rounds (SpeculativeConfig.verify_steps), and what
schedule_ahead refuses."""

import pytest

from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import PLACEHOLDER, Sequence
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.controller import SpecDecodeController


def _sched(num_pages, spec=None, **kw):
    cfg = EngineConfig(max_model_len=64).override(
        **{"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, **kw})
    spec = SpecDecodeController(SpeculativeConfig(**(spec or {"method": "ngram",
                                                               "num_speculative_tokens": 16})),
                                cfg.scheduler.max_num_seqs, cfg.max_model_len)
    return Scheduler(cfg, KVCacheManager(PagePool(num_pages, 4), True), spec)


def _schedule(sched, drafts=None):
    """sched.schedule() with the controller proposing `drafts` ({sequence: tokens})."""
    sched.spec.propose = lambda running, hold: dict(drafts or {})
    return sched.schedule()


def _running(sched, n_prompt, rid="a"):
    seq = Sequence(request_id=rid, prompt_ids=list(range(100, 100 + n_prompt)),
                   params=SamplingParams(max_tokens=50), seed=0)
    sched.add(seq)
    plan = _schedule(sched)
    first = sched.launched(plan)
    sched.commit(seq, first[0], [1])
    return seq


def test_drafts_take_pages_and_budget_and_verified_gives_back_the_rest():
    sched = _sched(8)
    seq = _running(sched, 7)   # 8 tokens: 2 pages, 7 computed
    plan = _schedule(sched, {seq: [5, 6, 7, 8, 9]})
    assert plan.verify and plan.num_new == [6] and plan.drafts == [[5, 6, 7, 8, 9]]
    assert len(seq.block_table) == 4   # tokens 7..12 -> pages for 13 tokens
    # launched as if it kept one token: token 7 computed, one pending output
    assert sched.launched(plan) == [1] and seq.num_computed == 8
    assert seq.output_ids == [1, PLACEHOLDER]
    sched.verified(seq, 1, [5, 6])     # drafts 5 accepted, then the recovered token 6
    assert seq.output_ids == [1, 5, 6]
    assert seq.num_computed == 9 and len(seq.block_table) == 3  # 10 tokens: 3 pages
    assert sched.kv.pool.num_free == sched.kv.pool.capacity - 3
    with pytest.raises(ValueError, match="pending"):
        sched.verified(seq, 1, [7])    # no verify step's token is pending there


def _launched_verify(sched, seq, drafts):
    plan = _schedule(sched, {seq: drafts})
    assert plan.verify
    return plan, sched.launched(plan)


def test_a_verify_step_planned_ahead_takes_the_furthest_case_pages_then_gives_them_back():
    """schedule_ahead plans the next verify step as if the unread one kept one token (its
    rows start one position on, its last token pending), with the pages of every unread
    draft accepted; reading the first keeps what the second may reach, reading the second
    what its tokens need."""
    sched = _sched(16)
    seq = _running(sched, 7)                       # 8 tokens, 7 computed
    _, first = _launched_verify(sched, seq, [5, 6, 7])
    assert seq.num_computed == 8 and seq.num_tokens == 9
    ahead = sched.schedule_ahead({seq: 3})
    # 16 drafts allowed, 1 + 16 rows of the 16-row budget: 15 drafts
    assert ahead.verify and ahead.num_new == [16] and ahead.drafts == [[0] * 15]
    assert ahead.samples == [True]
    # row 0 at position 8 as planned, at most 11 once read: pages for 12 + 15 tokens
    assert len(seq.block_table) == sched.kv.pool.pages_for(9 + 3 + 15)
    second = sched.launched(ahead)
    assert seq.output_ids == [1, PLACEHOLDER, PLACEHOLDER] and seq.num_computed == 9
    assert first == [1] and second == [2]
    sched.verified(seq, 1, [5], ahead=15)          # the first step kept 1 token
    # the second step computes token 5 at position 8 (its row 0, as planned)
    assert seq.output_ids == [1, 5, PLACEHOLDER] and seq.num_computed == 9
    # and its drafts reach position 23: pages for 24 tokens are kept, one fewer
    assert len(seq.block_table) == sched.kv.pool.pages_for(24) == 6
    sched.verified(seq, 2, [4, 8, 2])              # two drafts accepted
    assert seq.output_ids == [1, 5, 4, 8, 2] and seq.num_computed == 11
    assert len(seq.block_table) == sched.kv.pool.pages_for(12)


def test_schedule_ahead_refuses_what_it_cannot_plan_without_the_tokens():
    # no room for a draft in the furthest case (max_model_len), a newcomer waiting, a
    # grammar, a host-side proposer, or the last step read found nothing: the engine reads
    # the step in flight first
    sched = _sched(16)
    seq = _running(sched, 7)
    _launched_verify(sched, seq, [5, 6, 7])
    assert sched.schedule_ahead({seq: 3}) is not None
    sched = _sched(16, max_model_len=13)
    seq = _running(sched, 7)
    _launched_verify(sched, seq, [5, 6, 7])        # 9 tokens, up to 12 once read
    assert sched.schedule_ahead({seq: 3}) is None
    for case in ("waiting", "grammar", "host", "missed"):
        sched = _sched(16)
        seq = _running(sched, 7)
        _launched_verify(sched, seq, [5, 6, 7])
        if case == "waiting":
            sched.add(Sequence(request_id="w", prompt_ids=[1, 2], params=SamplingParams(),
                               seed=0))
        elif case == "grammar":
            seq.matcher = object()
        elif case == "host":
            sched.spec.proposer = object()
        else:
            sched.spec.record_found(False)
        free = sched.kv.pool.num_free
        assert sched.schedule_ahead({seq: 3}) is None, case
        assert sched.kv.pool.num_free == free, case   # nothing taken


def test_verify_rounds_take_the_pages_of_every_round_or_run_one():
    """verify_steps 3: a verify step planned ahead (its drafts proposed on device) runs 3
    rounds when every round has room, with the pages of the furthest case (each round's
    drafts all accepted); host-proposed drafts, too little room (max_tokens) or too few
    free pages give one round, and reading the step keeps what the next one may reach."""
    rounds = {"method": "ngram", "num_speculative_tokens": 3, "verify_steps": 3}
    sched = _sched(16, spec=rounds)
    seq = _running(sched, 7)                       # 8 tokens, 7 computed
    plan, first = _launched_verify(sched, seq, [5, 6, 7])
    assert plan.num_steps == 1                     # drafts the host proposed: one round
    ahead = sched.schedule_ahead({seq: 3})
    assert ahead.num_steps == 3 and ahead.drafts == [[0, 0, 0]]
    # row 0 at position 8, 11 at most once read; 3 rounds of 4 rows: up to position 22
    assert len(seq.block_table) == sched.kv.pool.pages_for(9 + 3 + 3 * 4 - 1)
    second = sched.launched(ahead)
    sched.verified(seq, first[0], [5], ahead=3 * 4 - 1)
    # the second step's last round reaches position 8 + 2 * 4 + 3: pages for 20 tokens
    assert len(seq.block_table) == sched.kv.pool.pages_for(9 + 11)
    # its 3 rounds kept 3 + 1 + 3 tokens
    sched.verified(seq, second[0], [4, 8, 2, 9, 9, 9, 3])
    assert seq.output_ids == [1, 5, 4, 8, 2, 9, 9, 9, 3] and seq.num_computed == 15
    assert len(seq.block_table) == sched.kv.pool.pages_for(16)
    for case in ("max_tokens", "pages"):
        sched = _sched(6 if case == "pages" else 16, spec=rounds)  # 6: 5 usable pages
        seq = _running(sched, 7)
        if case == "max_tokens":
            seq.params = SamplingParams(max_tokens=12)  # 1 + 1 pending + 10 more at most
        _launched_verify(sched, seq, [5, 6, 7])
        ahead = sched.schedule_ahead({seq: 3})
        assert ahead.num_steps == 1 and ahead.drafts == [[0, 0, 0]], case
        assert len(seq.block_table) == sched.kv.pool.pages_for(9 + 3 + 3), case
    sched = _sched(16, spec={**rounds, "method": "eagle", "model": "head"})
    seq = _running(sched, 7)
    plan = _schedule(sched, {seq: [0, 0, 0]})      # a drafter's placeholders
    assert plan.verify and plan.num_steps == 3
    assert len(seq.block_table) == sched.kv.pool.pages_for(8 + 3 * 4 - 1)


def test_drafts_are_cut_to_the_free_pages_and_the_budget_never_preempt():
    sched = _sched(4)                  # 3 usable pages (+ the null page): 12 tokens
    seq = _running(sched, 7)
    plan = _schedule(sched, {seq: list(range(10))})
    assert plan.num_new == [1 + 4]     # the 3rd page holds tokens 8..11: 4 drafts
    sched2 = _sched(16, max_num_batched_tokens=4, max_num_seqs=2)
    a = _running(sched2, 3, "a")
    plan = _schedule(sched2, {a: list(range(10))})
    assert plan.num_new == [4]         # the budget of 4 rows
    assert sched2.num_preemptions == 0


def test_drafts_take_only_pages_no_decode_needs():
    """An older sequence's drafts never take the page a newer sequence's decode needs
    (which would make it preempt itself)."""
    sched = _sched(6)                  # 5 usable pages
    a = Sequence(request_id="a", prompt_ids=list(range(100, 107)),
                 params=SamplingParams(max_tokens=50), seed=0)
    b = Sequence(request_id="b", prompt_ids=list(range(200, 208)),
                 params=SamplingParams(max_tokens=50), seed=0)
    sched.add(a)
    sched.add(b)
    plan = _schedule(sched)
    for seq, i in zip(plan.seqs, sched.launched(plan)):
        sched.commit(seq, i, [1])
    assert sched.kv.pool.num_free == 1  # a: 8 tokens in 2 pages, b: 9 tokens, 2 pages + 1 more
    plan = _schedule(sched, {a: [1, 2, 3, 4, 5]})
    assert sched.num_preemptions == 0 and plan.num_new == [1, 1] and not plan.verify
    assert len(b.block_table) == 3
