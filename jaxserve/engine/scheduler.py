"""Continuous-batching scheduler with a token budget: which sequences run in the next step,
and how many of their tokens. Plain Python.

Every step is one flat ragged batch of at most `max_num_batched_tokens` token rows. The
running sequences that decode get their one token first (oldest first); then sequences
part-way through their prompt get the next chunk of it, then waiting sequences are
admitted with their first chunk, while the budget lasts (chunked prefill, as vLLM v1 and
SGLang schedule). A sequence's tokens still to compute are `num_tokens - num_computed`: one
for a decoding sequence (its last sampled token), the rest of its prompt (and, after a
preemption, of its earlier outputs) otherwise. Only the chunk that reaches the last token
samples. With `enable_chunked_prefill` off, a prompt is admitted only whole.

Prefix caching (`enable_prefix_caching`): a sequence admitted from the queue first takes
the cached pages of the longest prefix of its full pages (jaxserve.engine.page_pool: by
chained page hash, shared by reference count) and computes only the rest; at least its last
token is always computed, for its logits. Each full page a launched step computes (of
known tokens) is registered in the cache, so a request arriving one step later already
hits it: the device runs steps in order, so the K/V are written before they are read. A
waiting request whose next uncached page another request is computing right now (the same
prompt, or the same system prompt, arriving together) waits for it instead of computing it
a second time; requests behind it may be admitted meanwhile.

Pages follow the computed tokens: a sequence holds the pages of the tokens up to its
chunk's end. When a running sequence needs a page and none is free, the most recently
admitted sequence newer than it is preempted (its pages freed; it waits, first in the queue,
to be recomputed); a decoding sequence that is itself the newest preempts itself.
Admission never preempts: a waiting sequence is admitted only while the free pages hold
its chunk and the page each planned decode may need in the step after, and not in a step
that preempted.

No deadlock, no livelock: the oldest running sequence always gets its tokens (it can
preempt every newer one, and the pool holds one sequence of max_model_len: checked by the
engine); a budget of at least max_num_seqs rows gives every decoding sequence its token in
every step (SchedulerConfig checks it), so a prompt's chunks follow the decodes and it
completes among any number of streams.

Source: vLLM v1's scheduler (token budget, chunked prefill, recompute preemption, FCFS);
nano-vllm's Scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

from jaxserve.config import EngineConfig
from jaxserve.engine.page_pool import PagePool, page_hashes
from jaxserve.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclasses.dataclass
class StepPlan:
    """What the next step computes: `num_new[i]` tokens of `seqs[i]` (batch order), from its
    `num_computed`-th token on; the last `len(drafts[i])` of them are draft tokens to verify
    (speculative decoding: `drafts` None = none). Made before the step launches:
    `samples[i]` says whether sequence i's chunk reaches its last token (its sampled token
    is kept), `decode` whether every sequence brings one token and samples (a decode batch,
    which may sample several tokens per sequence: multi-step decode), `verify` whether
    some sequence brings drafts (a verify batch: every sequence samples, at up to
    1 + len(drafts[i]) positions)."""

    seqs: list[Sequence]
    num_new: list[int]
    drafts: list[list[int]] | None = None
    samples: list[bool] = dataclasses.field(init=False)
    decode: bool = dataclasses.field(init=False)
    verify: bool = dataclasses.field(init=False)

    def __post_init__(self):
        if self.drafts is None:
            self.drafts = [[] for _ in self.seqs]
        self.samples = [s.num_computed + n - len(d) == s.num_tokens
                        for s, n, d in zip(self.seqs, self.num_new, self.drafts)]
        self.verify = any(self.drafts)
        self.decode = all(n == 1 for n in self.num_new) and all(self.samples)

    @property
    def num_tokens(self) -> int:
        """Token rows this step computes."""
        return sum(self.num_new)


@dataclasses.dataclass
class InflightStep:
    """A dispatched step whose sampled tokens are not read yet: its plan, the tokens it
    samples per sequence (`num_steps`), each sequence's output index of the first of them
    (`first_index`, batch order; None for a prompt chunk that does not sample) and the
    runner's handle to fetch them. While it runs, each sampling sequence ends in
    `num_steps` PLACEHOLDER outputs; the next step reads the last of them on device, from
    the row `row_of` gives."""

    plan: StepPlan
    num_steps: int
    first_index: list[int | None]
    handle: object
    chunk_starts: list[int] | None = None  # each sequence's first position in the step

    def row_of(self) -> dict[Sequence, int]:
        """{sequence: its row in this step's batch} for the sequences that sampled."""
        return {seq: i for i, (seq, first) in enumerate(zip(self.plan.seqs, self.first_index))
                if first is not None}


class Scheduler:
    """Owns the waiting queue, the running set, their pages and their computed tokens.

    Counters: num_preemptions; prefix_cache_queries / prefix_cache_hits: prompt tokens
    looked up in the prefix cache at admission, and those found (vLLM's names)."""

    def __init__(self, cfg: EngineConfig, pool: PagePool):
        self.cfg = cfg
        self.pool = pool
        self.prefix_caching = cfg.cache.enable_prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = itertools.count()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, hold: frozenset | set = frozenset(),
                 drafts: dict[Sequence, list[int]] | None = None) -> StepPlan | None:
        """Plan the next step, allocating its pages (see the module docstring); None when
        there is nothing to run.

        hold: running sequences that sit this step out (the engine knows they finish when
        their pending token arrives); they keep their pages.
        drafts: {decoding sequence: draft tokens to verify after its last token}. A
        sequence's drafts are cut to what the step's budget and the free pages hold (drafts
        never preempt); its pages then cover them until `verified` gives back those of
        rejected ones."""
        limits = self.cfg.scheduler
        drafts = drafts or {}
        plan: dict[Sequence, int] = {}
        taken: dict[Sequence, list[int]] = {}
        preemptions = self.num_preemptions

        def left() -> int:  # token rows still free in this step
            return limits.max_num_batched_tokens - sum(plan.values())

        by_age = sorted(self.running, key=lambda s: s.admitted)
        for seq in by_age:  # decodes first
            if (seq in hold or seq.status is not SequenceStatus.RUNNING or _todo(seq) != 1
                    or left() <= 0):
                continue
            if self._take_pages(seq, seq.num_tokens, plan, self_victim=True):
                plan[seq] = 1
        for seq in by_age:  # then drafts, with the pages every decode left
            if plan.get(seq) == 1 and drafts.get(seq):
                k = min(len(drafts[seq]), left(),
                        self._chunk(seq, 1 + len(drafts[seq]), 0) - 1)
                if k > 0:
                    self._grow(seq, seq.num_tokens + k)
                    taken[seq] = list(drafts[seq][:k])
                    plan[seq] += k
        for seq in by_age:  # then the prompts part-way through, oldest first
            if seq in hold or seq.status is not SequenceStatus.RUNNING or _todo(seq) <= 1:
                continue
            want = min(_todo(seq), left())
            if want <= 0:
                break
            n = self._chunk(seq, want, self._reserve(plan))
            if n == 0 and self._take_pages(seq, seq.num_computed + 1, plan, self_victim=False):
                n = self._chunk(seq, min(_todo(seq), left()), 0)
            if n:
                self._grow(seq, seq.num_computed + n)
                plan[seq] = n
        deferred: list[Sequence] = []
        while (self.waiting and left() > 0 and self.num_preemptions == preemptions
               and len(self.running) < limits.max_num_seqs):
            seq = self.waiting[0]
            if seq.has_placeholder:  # preempted while its token was being sampled
                break
            if self._prefix_in_progress(seq):
                deferred.append(self.waiting.popleft())
                continue
            hit = self._take_cached_prefix(seq)
            n = min(_todo(seq), left())
            n = self._chunk(seq, n, self._reserve(plan) + self._growth(seq, n))
            if n == 0 or (n < _todo(seq) and not limits.enable_chunked_prefill):
                self._release(seq)  # the cached pages it took stay cached
                seq.num_computed = seq.num_registered = 0
                break
            if self.prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += hit
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.admitted = next(self._admissions)
            self.running.append(seq)
            self._grow(seq, seq.num_computed + n)
            plan[seq] = n
        self.waiting.extendleft(reversed(deferred))  # first in the queue again, in order
        if not plan:
            return None
        return StepPlan(list(plan), list(plan.values()),
                        [taken.get(s, []) for s in plan] if taken else None)

    def _prefix_in_progress(self, seq: Sequence) -> bool:
        """Whether a running sequence is computing, as a prompt chunk, the first page of
        waiting `seq`'s prefix that is not cached yet (their page hashes agree there)."""
        if not self.prefix_caching or seq.needs_prompt_logprobs:
            return False
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.pool.page_size)
        cached = len(self.pool.lookup(hashes))
        if cached == len(hashes):
            return False
        return any(len(r.page_hashes) > cached and r.page_hashes[cached] == hashes[cached]
                   and r.num_computed < r.num_known for r in self.running)

    def _take_cached_prefix(self, seq: Sequence) -> int:
        """Give `seq` (waiting, no pages) the cached pages of the longest prefix of its full
        pages, leaving at least its last token to compute; returns the tokens matched. A
        sequence still needing prompt logprobs takes none (they come from computing)."""
        if not self.prefix_caching or seq.needs_prompt_logprobs:
            return 0
        ps = self.pool.page_size
        usable = (seq.num_tokens - 1) // ps
        pages = self.pool.lookup(self._hashes(seq, usable))
        self.pool.share(pages)
        seq.block_table = pages
        seq.num_computed = len(pages) * ps
        seq.num_registered = len(pages)
        return seq.num_computed

    def _hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """`seq`'s chained hashes of its first `num_pages` full pages (of known tokens),
        computed once each."""
        have = len(seq.page_hashes)
        if num_pages > have:
            ps = self.pool.page_size
            ids = seq.ids(0, num_pages * ps)
            seq.page_hashes += page_hashes(ids, ps, have, seq.page_hashes[-1] if have else None)
        return seq.page_hashes[:num_pages]

    def _register(self, seq: Sequence) -> None:
        """Register `seq`'s full pages whose K/V are computed (and tokens known)."""
        full = min(seq.num_computed, seq.num_known) // self.pool.page_size
        if self.prefix_caching and full > seq.num_registered:
            for i, h in enumerate(self._hashes(seq, full)[seq.num_registered:],
                                  start=seq.num_registered):
                self.pool.register(seq.block_table[i], h)
            seq.num_registered = full

    def _chunk(self, seq: Sequence, n: int, reserve: int) -> int:
        """The most of `n` next tokens of `seq` whose pages fit in the free pages, keeping
        `reserve` of them free."""
        have = len(seq.block_table) * self.pool.page_size - seq.num_computed
        room = have + max(0, self.pool.num_free - reserve) * self.pool.page_size
        return max(0, min(n, room))

    def _growth(self, seq: Sequence, n: int) -> int:
        """1 if `seq`'s first decode after a chunk of `n` that completes it needs a new page."""
        end = seq.num_computed + n
        return int(end == seq.num_tokens and end % self.pool.page_size == 0)

    def _reserve(self, plan: dict[Sequence, int]) -> int:
        """Pages the planned decodes may need in the step after this one."""
        return sum(self._growth(s, n) for s, n in plan.items() if n == 1)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.pool.pages_for(num_tokens) - len(seq.block_table)
        if need > 0:
            seq.block_table += self.pool.allocate(need)

    def _take_pages(self, seq: Sequence, num_tokens: int, plan: dict[Sequence, int],
                    self_victim: bool) -> bool:
        """Give `seq` the pages of `num_tokens` tokens, preempting newer running sequences
        (newest first; planned ones leave the plan) while the free pages are short. If
        none newer is left: preempt `seq` itself when `self_victim`; returns whether `seq`
        got its pages."""
        need = self.pool.pages_for(num_tokens) - len(seq.block_table)
        while need > self.pool.num_free:
            newer = [s for s in self.running if s.admitted > seq.admitted]
            if not newer:
                if self_victim:
                    self.preempt(seq)
                return False
            victim = max(newer, key=lambda s: s.admitted)
            plan.pop(victim, None)
            self.preempt(victim)
        self._grow(seq, num_tokens)
        return True

    def reserve_ahead(self, seqs: list[Sequence], extra_tokens: int) -> bool:
        """Give each of `seqs` (a planned decode step's) the pages for `extra_tokens` more
        tokens after the step's own (multi-step decode), if the free pages hold them all;
        otherwise allocate nothing (never preempts). Returns whether it allocated."""
        need = [max(0, self.pool.pages_for(s.num_tokens + extra_tokens) - len(s.block_table))
                for s in seqs]
        if sum(need) > self.pool.num_free:
            return False
        for seq, n in zip(seqs, need):
            if n:
                seq.block_table += self.pool.allocate(n)
        return True

    def launched(self, plan: StepPlan, num_steps: int) -> list[int | None]:
        """Record that `plan` was dispatched sampling `num_steps` tokens per sequence: each
        sequence's K/V now covers its chunk; a sequence whose chunk reached its last token
        also covers the first num_steps - 1 sampled tokens (multi-step decode; the last
        one is computed by the next step) and ends in `num_steps` PLACEHOLDER outputs
        until they are read. Returns each sequence's output index of the first of them
        (None for a chunk that does not sample).

        A verify plan changes nothing yet: how many of its tokens count is known when it
        is read (`verified`); its outputs start at each sequence's current length."""
        if plan.verify:
            return [len(seq.output_ids) for seq in plan.seqs]
        first = []
        for i, seq in enumerate(plan.seqs):
            if plan.samples[i]:
                seq.num_computed = seq.num_tokens + num_steps - 1
                self._register(seq)
                first.append(len(seq.output_ids))
                seq.output_ids.extend([PLACEHOLDER] * num_steps)
            else:
                seq.num_computed += plan.num_new[i]
                self._register(seq)
                first.append(None)
        return first

    def verified(self, seq: Sequence, num_tokens: int) -> None:
        """Record that a verify step kept `num_tokens` output tokens of running `seq` (its
        accepted drafts and the token after them, already appended to its outputs): its
        K/V covers its last token and the accepted drafts; the pages past what its next
        token needs (those of rejected drafts) go back to the pool."""
        seq.num_computed += num_tokens
        keep = self.pool.pages_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:][::-1])
            del seq.block_table[keep:]
        self._register(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s pages and queue it first for recomputation."""
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = seq.num_registered = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence (running, or waiting after a preemption) and free
        its pages."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, request_id: str) -> Sequence | None:
        """Remove the sequence with `request_id` wherever it is; None if unknown."""
        for seq in itertools.chain(self.running, self.waiting):
            if seq.request_id == request_id:
                self.finish(seq)
                return seq
        return None

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.block_table:
            # last page first: a sequence's tail pages are evicted before its head, which
            # other prompts are likelier to share (vLLM does the same)
            self.pool.free(seq.block_table[::-1])
        seq.block_table = []


def _todo(seq: Sequence) -> int:
    """Tokens of `seq` whose K/V are not in its pages yet."""
    return seq.num_tokens - seq.num_computed
