"""Continuous-batching scheduler: which sequences run in the next step. Plain Python.

Each step is either a prefill step (admit waiting sequences, computing all their tokens,
packed one after another within max_prefill_tokens token rows) or a decode step (one new
token for every running sequence). Prefill goes first whenever a waiting sequence can be
admitted without making the following decode step preempt.
When a decode step needs a page and none is free, the most recently admitted sequence is
preempted: its pages are freed and it waits (at the front of the queue) to be recomputed.

No deadlock, no livelock: a sequence is admitted only with pages for its tokens and for
the next decode step of everything running, so every admission is followed by at least
one decode step; the oldest running sequence is never preempted while others run, and the
pool holds at least one sequence of `max_model_len` tokens (checked by the engine).

Source: vLLM's scheduler (recompute preemption, FCFS), nano-vllm's Scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

from jaxserve.config import EngineConfig
from jaxserve.engine.buckets import bucket_for
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclasses.dataclass
class StepPlan:
    """What the next step computes: `kind` "prefill" or "decode" over `seqs` (in batch order)."""

    kind: str
    seqs: list[Sequence]


@dataclasses.dataclass
class InflightStep:
    """A dispatched step whose sampled tokens are not read yet: its plan, the tokens it
    samples per sequence (`num_steps`), each sequence's output index of the first of them
    (`first_index`, batch order) and the runner's handle to fetch them. While it runs,
    each of its sequences ends in `num_steps` PLACEHOLDER outputs; the next decode step
    reads the last of them on device, from the row `row_of` gives."""

    plan: StepPlan
    num_steps: int
    first_index: list[int]
    handle: object

    def row_of(self) -> dict[Sequence, int]:
        """{sequence: its row in this step's batch}."""
        return {seq: i for i, seq in enumerate(self.plan.seqs)}


class Scheduler:
    """Owns the waiting queue, the running set and their pages."""

    def __init__(self, cfg: EngineConfig, pool: PagePool):
        self.cfg = cfg
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = itertools.count()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, hold: frozenset | set = frozenset()) -> StepPlan | None:
        """Plan the next step, allocating pages; None when there is nothing to run.

        hold: running sequences that sit this decode step out (the engine knows they
        finish when their pending token arrives); they keep their pages."""
        admitted = self._admit()
        if admitted:
            return StepPlan("prefill", admitted)
        decode = self._reserve_decode_pages(hold)
        return StepPlan("decode", decode) if decode else None

    def reserve_ahead(self, seqs: list[Sequence], extra_tokens: int) -> bool:
        """Give each of `seqs` (a planned decode step's) the pages for `extra_tokens` more
        tokens after the step's own (multi-step decode), if the free pages hold them all;
        otherwise allocate nothing (never preempts). Returns whether it allocated."""
        need = [self._decode_need(s, extra_tokens) for s in seqs]
        if sum(need) > self.pool.num_free:
            return False
        for seq, n in zip(seqs, need):
            if n:
                seq.block_table += self.pool.allocate(n)
        return True

    def _decode_need(self, seq: Sequence, extra_tokens: int = 0) -> int:
        """New pages `seq` needs to hold its tokens (+ extra) in the next decode step."""
        return max(0, self.pool.pages_for(seq.num_tokens + extra_tokens) - len(seq.block_table))

    def _admit(self) -> list[Sequence]:
        cfg, limits, batch = self.cfg, self.cfg.scheduler, []
        reserve = sum(self._decode_need(s) for s in self.running)
        free = self.pool.num_free
        while self.waiting and len(self.running) + len(batch) < limits.max_num_seqs \
                and len(batch) < limits.max_prefill_seqs:
            seq = self.waiting[0]
            if batch:  # packed one after another: the step's rows are the summed lengths
                total = sum(s.num_tokens for s in batch) + seq.num_tokens
                if (total > cfg.prefill_lengths[-1]
                        or bucket_for(total, cfg.prefill_lengths) > limits.max_prefill_tokens):
                    break
            pages = self.pool.pages_for(seq.num_tokens)
            # its first decode writes one more token: it may need one more page
            growth = self.pool.pages_for(seq.num_tokens + 1) - pages
            if pages + growth + reserve > free:
                break
            free -= pages
            reserve += growth
            batch.append(self.waiting.popleft())
        for seq in batch:
            seq.block_table = self.pool.allocate(self.pool.pages_for(seq.num_tokens))
            seq.status = SequenceStatus.RUNNING
            seq.admitted = next(self._admissions)
            self.running.append(seq)
        return batch

    def _reserve_decode_pages(self, hold) -> list[Sequence]:
        for seq in sorted(self.running, key=lambda s: s.admitted):
            if seq.status is not SequenceStatus.RUNNING or seq in hold:
                continue  # preempted earlier in this loop, or sitting out
            need = self._decode_need(seq)
            while need > self.pool.num_free:
                victim = max(self.running, key=lambda s: s.admitted)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING and need:
                seq.block_table += self.pool.allocate(need)
        return [s for s in self.running if s not in hold]

    def launched(self, plan: StepPlan, num_steps: int) -> list[int]:
        """Record that `plan` was dispatched sampling `num_steps` tokens per sequence:
        each sequence's K/V now covers all its tokens up to the last sampled one (that one
        is computed by the next step), and ends in `num_steps` PLACEHOLDER outputs until
        they are read. Returns each sequence's output index of the first of them."""
        first = []
        for seq in plan.seqs:
            seq.num_computed = seq.num_tokens + num_steps - 1
            first.append(len(seq.output_ids))
            seq.output_ids.extend([PLACEHOLDER] * num_steps)
        return first

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s pages and queue it first for recomputation."""
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
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
            self.pool.free(seq.block_table)
        seq.block_table = []
