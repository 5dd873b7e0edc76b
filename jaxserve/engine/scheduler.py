"""Continuous-batching scheduler with a token budget: which sequences run in the next step,
and how many of their tokens. Plain Python.

Every step is one flat ragged batch of at most `max_num_batched_tokens` token rows. The
running sequences that decode get their one token first (oldest first); then sequences
part-way through their prompt get the next chunk of it, then waiting sequences are
admitted with their first chunk, while the budget lasts (chunked prefill, as vLLM v1 and
SGLang schedule). A sequence's tokens still to compute are `num_tokens - num_computed`: one
for a decoding sequence (its last sampled token), the rest of its prompt (and, after a
preemption, of its earlier outputs) otherwise. Only the chunk that reaches the last token
samples. With `enable_chunked_prefill` off, a prompt is admitted only whole. With dynamic
chunking (`dynamic_chunking_keys`) a chunk is also cut by the cost of its attention to the
tokens before it (`_ChunkCost`), so that a long prompt's late chunks do not lengthen the
steps of the streams decoding beside it.

Prefix caching (`enable_prefix_caching`, the pages and the cache are the KVCacheManager's):
a sequence admitted from the queue first takes the cached pages of the longest prefix of
its full pages (by chained page hash, shared by reference count) and computes only the rest; at least its last
token is always computed, for its logits. Each full page a launched step computes (of
known tokens) is registered in the cache, so a request arriving one step later already
hits it: the device runs steps in order, so the K/V are written before they are read. A
waiting request whose next uncached page another request is computing right now (the same
prompt, or the same system prompt, arriving together) waits for it instead of computing it
a second time; requests behind it may be admitted meanwhile.

LoRA (the LoraManager's slots): a sequence is admitted only with its adapter's device
slot (`LoraManager.acquire`), at most max_loras adapters among the running sequences; one
whose adapter finds no slot waits, and those behind it may be admitted meanwhile. A
sequence whose adapter was unloaded while it waited is refused (`take_refused`: the engine
fails it). Preempted or finished, it gives its slot back.

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

Besides the plan, `schedule()` decides everything else the step needs (SchedulerOutput):
the sequences held out of it (their pending token is their last), the drafts to verify
(asked of the SpecDecodeController), and how many tokens
each sequence samples (multi-step decode bursts, pages reserved for them).

Writes, of a Sequence: `output_ids` (PLACEHOLDERs at launch, the tokens read back, the
accepted drafts; truncated when it finishes), `status`, `num_computed`, `admitted`,
`num_preemptions` and `finish_reason`. Its pages are the KVCacheManager's.

Source: vLLM v1's scheduler (token budget, chunked prefill, recompute preemption, FCFS;
update_from_output writing the request's tokens); nano-vllm's Scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque

from jaxserve.config import EngineConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.lora_manager import LoraManager
from jaxserve.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from jaxserve.lora.adapter import AdapterError
from jaxserve.spec_decode.controller import SpecDecodeController


@dataclasses.dataclass
class SchedulerOutput:
    """Everything the next step needs: `num_new[i]` tokens of `seqs[i]` (batch order), from
    its `num_computed`-th token on; the last `len(drafts[i])` of them are draft tokens to
    verify (speculative decoding: `drafts` None = none); `num_steps` tokens sampled per
    sequence (1, or decode_steps for a multi-step decode burst), or a verify step's rounds
    (1, or SpeculativeConfig.verify_steps: its drafts' rows are run that many times, each
    round moved on by the tokens the ones before kept); `held`: running sequences sitting
    this step out.
    Derived: `samples[i]` whether sequence i's chunk reaches its last token (its sampled
    token is kept), `decode` whether every sequence brings one token and samples (a decode
    batch), `verify` whether some sequence brings drafts (a verify batch: every sequence
    samples, at up to 1 + len(drafts[i]) positions)."""

    seqs: list[Sequence]
    num_new: list[int]
    drafts: list[list[int]] | None = None
    num_steps: int = 1
    held: frozenset = frozenset()
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
    """A dispatched step whose sampled tokens are not read yet: what was scheduled, each
    sequence's output index of the first token it samples (`first_index`, batch order;
    None for a prompt chunk that does not sample) and the runner's handle to fetch them
    (None while its sampler half waits: `pending_sample`).
    While it runs, each sampling sequence ends in `scheduled.num_steps` PLACEHOLDER
    outputs; the next step reads the last of them on device, from the row `row_of` gives."""

    scheduled: SchedulerOutput
    first_index: list[int | None]
    handle: object
    chunk_starts: list[int] | None = None  # each sequence's first position in the step
    # a split step whose sampler half waits for its grammars' bitmasks (Engine._sample):
    # (the runner's forward handle, the step's SamplingBatch, its constrained rows);
    # handle is None until then
    pending_sample: tuple | None = None

    def drop_sample(self, seq: Sequence) -> bool:
        """Make this step's token for `seq` not count: it is not read back (its
        `first_index` None, as a prompt chunk's that does not sample), and while the
        sampler half waits its grammar's bitmask is not computed (the row keeps the
        all-allowed one). The caller puts known tokens in place of its PLACEHOLDER
        (jump-forward: Engine._forced). Returns False if `seq` samples nothing here."""
        for b, (s, first) in enumerate(zip(self.scheduled.seqs, self.first_index)):
            if s is seq and first is not None:
                self.first_index[b] = None
                if self.pending_sample is not None and b in self.pending_sample[2]:
                    self.pending_sample[2].remove(b)
                return True
        return False

    def row_of(self) -> dict[Sequence, int]:
        """{sequence: its row in this step's batch} for the sequences that sampled."""
        return {seq: i for i, (seq, first) in
                enumerate(zip(self.scheduled.seqs, self.first_index)) if first is not None}


@dataclasses.dataclass
class SchedulerStats:
    """Gauges (running / waiting requests, KV pages free and in all, pages registered in the
    prefix cache now) and counters since start (preemptions; prompt tokens looked up in the
    prefix cache at admission and found; cached pages evicted for new content)."""

    running: int
    waiting: int
    free_pages: int
    total_pages: int
    cached_pages: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_evictions: int


class Scheduler:
    """Owns the live requests (`requests`: id -> Sequence; the waiting queue and the
    running set), their computed tokens and their output tokens; asks `kv` for pages,
    `spec` (None: speculative decoding off) for drafts and `lora` (None: no adapters) for
    adapter slots. plain_bursts: multi-step decode only for batches without logits controls
    or top logprobs (an engine whose host decides the sampler's branches compiles its
    multi-step programs for those batches' plans only: jaxserve.sample.plan.FUSED_PLANS;
    the others decode a token a step, their sampler programs static too)."""

    def __init__(self, cfg: EngineConfig, kv: KVCacheManager,
                 spec: SpecDecodeController | None = None, lora: LoraManager | None = None,
                 plain_bursts: bool = False):
        self.cfg = cfg
        self.plain_bursts = plain_bursts
        self.kv = kv
        self.spec = spec
        self.lora = lora
        self._refused: list[tuple[Sequence, str]] = []
        self.requests: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = itertools.count()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request. Raises ValueError if its id is live already."""
        if seq.request_id in self.requests:
            raise ValueError(f"request {seq.request_id!r} is already live")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def spec_active(self) -> bool:
        """Whether the next step may verify drafts (SpecDecodeController.active)."""
        return self.spec is not None and self.spec.active(self.running, len(self.waiting))

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting), free_pages=pool.num_free,
            total_pages=pool.capacity, cached_pages=pool.num_cached,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            prefix_cache_evictions=pool.num_evictions)

    # --- planning ------------------------------------------------------------------------

    def schedule(self, can_propose: bool = True) -> SchedulerOutput | None:
        """Plan the next step, allocating its pages (see the module docstring); None when
        there is nothing to run.

        Held sequences: those whose pending token is their last (max_tokens or
        max_model_len); they keep their pages. A constrained (structured-output) sequence
        whose pending token is not read yet runs: its grammar's bitmask is filled in after
        the step's forward is dispatched, once that token is read (Engine._sample).
        can_propose: whether drafts may be asked
        for (every sequence's tokens are read: no step in flight); whether speculation is
        on for this step is decided once, before planning."""
        limit = self.cfg.max_model_len
        hold = frozenset(s for s in self.running if s.has_placeholder and (
            len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= limit))
        speculating = self.spec_active()
        drafts = self.spec.propose(self.running, hold) if speculating and can_propose else None
        out = self._plan(hold, drafts)
        if out is None:
            return None
        out.held = hold
        if out.verify:
            out.num_steps = self._verify_rounds(out, {}, planned_ahead=False)
        elif out.decode:
            out.num_steps = self._num_decode_steps(out, speculating)
        return out

    def schedule_ahead(self, unread: dict[Sequence, int]) -> SchedulerOutput | None:
        """Plan the next verify step before the tokens of the verify step in flight are read
        (speculation with async scheduling); None when it cannot be, and the engine reads
        that step first.

        unread: {sequence: the most tokens the step in flight may keep of it beyond one, its
        draft rows of every round} (each ends in that step's PLACEHOLDER, `launched`). The
        plan is made as if that step kept one token of each (the step moves each
        sequence's rows by the rest on device: verify_step), with drafts the step proposes
        on device (SpecDecodeController.propose_ahead), and the pages of the furthest case
        (every unread draft accepted) taken now; it neither admits nor preempts. Its
        rounds: `_verify_rounds`. None when: speculation is off for the next step, the
        proposer cannot propose on device or found nothing in the last step read, a running
        sequence is not in `unread` or samples under a grammar (its bitmask needs its
        tokens), the furthest case's pages are not free, or no sequence has room for a
        draft. Held: a sequence the step in flight brings to max_tokens or max_model_len
        whatever it keeps."""
        spec, kv = self.spec, self.kv
        if (spec is None or not self.spec_active() or not spec.can_propose_ahead()
                or set(self.running) != set(unread)
                or any(s.matcher is not None for s in self.running)):
            return None
        limit = self.cfg.max_model_len
        hold = frozenset(s for s in self.running if len(s.output_ids) >= s.params.max_tokens
                         or s.num_tokens >= limit)
        seqs = sorted((s for s in self.running if s not in hold), key=lambda s: s.admitted)
        drafts = spec.propose_ahead(seqs, unread)
        left = self.cfg.scheduler.max_num_batched_tokens - len(seqs)
        for seq in seqs:  # the budget, oldest first
            drafts[seq] = drafts.get(seq, [])[:max(0, left)]
            left -= len(drafts[seq])
        furthest = {s: s.num_tokens + unread[s] for s in seqs}  # its last token's, + 1
        if (not any(drafts.values()) or
                sum(kv.pages_needed(s, n) for s, n in furthest.items()) > kv.num_free):
            return None
        for seq in seqs:
            kv.allocate(seq, furthest[seq])
        for seq in seqs:  # then the drafts' pages, oldest first, while free pages last
            k = len(drafts[seq])
            while k and kv.pages_needed(seq, furthest[seq] + k) > kv.num_free:
                k -= 1
            kv.allocate(seq, furthest[seq] + k)
            del drafts[seq][k:]
        if not any(drafts.values()):
            return None  # (the pages taken go back when the step in flight is read)
        out = SchedulerOutput(seqs, [1 + len(drafts[s]) for s in seqs],
                              [drafts[s] for s in seqs])
        out.held = hold
        out.num_steps = self._verify_rounds(out, unread, planned_ahead=True)
        return out

    def _plan(self, hold: frozenset, drafts: dict[Sequence, list[int]] | None
              ) -> SchedulerOutput | None:
        """Which sequences run and how many tokens each (see the module docstring).

        drafts: {decoding sequence: draft tokens to verify after its last token}. A
        sequence's drafts are cut to what the step's budget and the free pages hold (drafts
        never preempt); its pages then cover them until `verified` gives back those of
        rejected ones."""
        limits = self.cfg.scheduler
        kv = self.kv
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
                k = min(len(drafts[seq]), left(), kv.room(seq, 1 + len(drafts[seq]), 0) - 1)
                if k > 0:
                    kv.allocate(seq, seq.num_tokens + k)
                    taken[seq] = list(drafts[seq][:k])
                    plan[seq] += k
        # then prompt chunks: the rows left, and with dynamic chunking in a step that
        # decodes (sequences wait on its time) their attention's cost
        keys = limits.dynamic_chunking_keys
        budget = (_ChunkCost(keys, left(), limits.max_num_batched_tokens)
                  if keys is not None and limits.enable_chunked_prefill and plan else None)

        def chunk_rows(seq: Sequence) -> int:
            return left() if budget is None else budget.rows(seq.num_computed, left())

        for seq in by_age:  # the prompts part-way through, oldest first
            if seq in hold or seq.status is not SequenceStatus.RUNNING or _todo(seq) <= 1:
                continue
            if left() <= 0:
                break
            want = min(_todo(seq), chunk_rows(seq))
            if want == 0:  # its chunk's cost is spent on older ones
                continue
            n = kv.room(seq, want, self._reserve(plan))
            if n == 0 and self._take_pages(seq, seq.num_computed + 1, plan, self_victim=False):
                n = kv.room(seq, min(_todo(seq), chunk_rows(seq)), 0)
            if n:
                if budget is not None:
                    budget.take(seq.num_computed, n)
                kv.allocate(seq, seq.num_computed + n)
                plan[seq] = n
        deferred: list[Sequence] = []
        while (self.waiting and left() > 0 and self.num_preemptions == preemptions
               and len(self.running) < limits.max_num_seqs):
            seq = self.waiting[0]
            if seq.has_placeholder:  # preempted while its token was being sampled
                break
            if kv.prefix_in_progress(seq, self.running):
                deferred.append(self.waiting.popleft())
                continue
            if self.lora is not None:
                try:
                    got_slot = self.lora.acquire(seq)
                except AdapterError as e:
                    self._refused.append((self.waiting.popleft(), str(e)))
                    continue
                if not got_slot:  # every slot holds another adapter's running requests
                    deferred.append(self.waiting.popleft())
                    continue
            hit = seq.num_computed = kv.take_cached_prefix(seq)
            n = min(_todo(seq), chunk_rows(seq))
            n = kv.room(seq, n, self._reserve(plan) + self._growth(seq, n)) if n else 0
            if n == 0 or (n < _todo(seq) and not limits.enable_chunked_prefill):
                kv.free(seq)  # the cached pages it took stay cached
                seq.num_computed = 0
                if self.lora is not None:
                    self.lora.release(seq)
                break
            if budget is not None:
                budget.take(seq.num_computed, n)
            kv.count_admission(seq, hit)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.admitted = next(self._admissions)
            self.running.append(seq)
            kv.allocate(seq, seq.num_computed + n)
            plan[seq] = n
        self.waiting.extendleft(reversed(deferred))  # first in the queue again, in order
        if not plan:
            return None
        return SchedulerOutput(list(plan), list(plan.values()),
                               [taken.get(s, []) for s in plan] if taken else None)

    def _verify_rounds(self, out: SchedulerOutput, more: dict[Sequence, int],
                       planned_ahead: bool) -> int:
        """Rounds for a planned verify step (SpecDecodeController.verify_rounds), the
        pages of the furthest case taken here (every draft of every round accepted, after
        the more[seq] tokens the step in flight may keep beyond the one it records); 1
        when they are not free (the pages of one round are taken already)."""
        rounds = self.spec.verify_rounds(out.seqs, out.drafts, more, len(self.waiting),
                                          planned_ahead)
        if rounds == 1:
            return 1
        furthest = [s.num_tokens + more.get(s, 0) + rounds * (1 + len(d)) - 1
                    for s, d in zip(out.seqs, out.drafts)]
        return rounds if self.kv.allocate_all(out.seqs, furthest) else 1

    def _num_decode_steps(self, out: SchedulerOutput, speculating: bool) -> int:
        """Tokens per sequence for a planned decode step: decode_steps when no request
        waits, every sequence has that many tokens left (max_tokens, max_model_len) and
        the free pages hold them (reserved here), and with `plain_bursts` none uses a
        logits control or asks for top logprobs; else 1. While speculative decoding is
        on for this batch (a step without drafts: the proposer found none), 1 token per
        step until the controller allows bursts again (its proposer found nothing
        several steps in a row): on text without repeats an n-gram proposer then costs
        little against plain multi-step decoding, and it still speculates soon after
        repeats begin. (Only 1 and decode_steps are compiled: no burst size between.)"""
        n = self.cfg.scheduler.decode_steps
        if speculating and not self.spec.allows_burst():
            return 1
        if n == 1 or self.waiting or any(s.matcher is not None for s in out.seqs):
            return 1
        if self.plain_bursts and any(s.controls is not None or s.params.logprobs
                                     for s in out.seqs):
            return 1
        limit = self.cfg.max_model_len
        if any(s.params.max_tokens - len(s.output_ids) < n or limit - s.num_tokens < n
               for s in out.seqs):
            return 1
        ok = self.kv.allocate_all(out.seqs, [s.num_tokens + n - 1 for s in out.seqs])
        return n if ok else 1

    def _growth(self, seq: Sequence, n: int) -> int:
        """1 if `seq`'s first decode after a chunk of `n` that completes it needs a new page."""
        end = seq.num_computed + n
        return int(end == seq.num_tokens and end % self.kv.page_size == 0)

    def _reserve(self, plan: dict[Sequence, int]) -> int:
        """Pages the planned decodes may need in the step after this one."""
        return sum(self._growth(s, n) for s, n in plan.items() if n == 1)

    def _take_pages(self, seq: Sequence, num_tokens: int, plan: dict[Sequence, int],
                    self_victim: bool) -> bool:
        """Give `seq` the pages of `num_tokens` tokens, preempting newer running sequences
        (newest first; planned ones leave the plan) while the free pages are short. If
        none newer is left: preempt `seq` itself when `self_victim`; returns whether `seq`
        got its pages."""
        while self.kv.pages_needed(seq, num_tokens) > self.kv.num_free:
            newer = [s for s in self.running if s.admitted > seq.admitted]
            if not newer:
                if self_victim:
                    self.preempt(seq)
                return False
            victim = max(newer, key=lambda s: s.admitted)
            plan.pop(victim, None)
            self.preempt(victim)
        self.kv.allocate(seq, num_tokens)
        return True

    # --- what happened to a scheduled step ------------------------------------------------

    def launched(self, out: SchedulerOutput) -> list[int | None]:
        """Record that `out` was dispatched: each sequence's K/V now covers its chunk; a
        sequence whose chunk reached its last token also covers the first num_steps - 1
        sampled tokens (multi-step decode; the last one is computed by the next step) and
        ends in `num_steps` PLACEHOLDER outputs until they are read. Returns each
        sequence's output index of the first of them (None for a chunk that does not
        sample, or that finished since it was scheduled).

        A verify step is recorded as if it kept one token (its last token's K/V computed,
        one PLACEHOLDER output), which is what the next verify step is planned on when it
        is dispatched before this one is read (`schedule_ahead`); how many tokens it kept
        is known when it is read (`verified`)."""
        first = []
        if out.verify:
            for seq in out.seqs:
                if seq.finished:
                    first.append(None)
                    continue
                seq.num_computed = seq.num_tokens
                self.kv.cache_full_pages(seq)
                first.append(len(seq.output_ids))
                seq.output_ids.append(PLACEHOLDER)
            return first
        for i, seq in enumerate(out.seqs):
            if seq.finished:
                first.append(None)
            elif out.samples[i]:
                seq.num_computed = seq.num_tokens + out.num_steps - 1
                self.kv.cache_full_pages(seq)
                first.append(len(seq.output_ids))
                seq.output_ids.extend([PLACEHOLDER] * out.num_steps)
            else:
                seq.num_computed += out.num_new[i]
                self.kv.cache_full_pages(seq)
                first.append(None)
        return first

    def commit(self, seq: Sequence, index: int, tokens: list[int]) -> None:
        """Put tokens read back from a step at `seq`'s output positions index, index + 1, ...
        (its PLACEHOLDERs, or tokens of a recomputed sequence)."""
        seq.output_ids[index:index + len(tokens)] = tokens

    def verified(self, seq: Sequence, index: int, tokens: list[int], ahead: int = 0) -> None:
        """Record that a verify step kept `tokens` of running `seq` (its accepted drafts and
        the token after them), at output index `index` (the PLACEHOLDER `launched` put
        there): they join its outputs, its K/V covers its last token and the accepted
        drafts, and the pages past what it needs go back to the pool (those of rejected
        drafts). ahead: the tokens after its last known one that the rows of a verify step
        dispatched after this one, still running, may reach (its draft rows, of every
        round): the pages they reach are kept.
        Raises ValueError if no PLACEHOLDER is at `index`."""
        if seq.output_ids[index:index + 1] != [PLACEHOLDER]:
            raise ValueError(f"request {seq.request_id!r}: output {index} is not a verify "
                             "step's pending token")
        seq.output_ids[index:index + 1] = tokens
        seq.num_computed += len(tokens) - 1
        self.kv.trim(seq, seq.num_known + ahead)
        self.kv.cache_full_pages(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s pages and queue it first for recomputation."""
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def recompute_all(self) -> None:
        """After the KV pool was lost (a failed device step): every running sequence drops
        the tokens the abandoned step was sampling and is preempted (recomputed from its
        tokens), and the prefix cache is forgotten."""
        for seq in list(self.running):
            _drop_placeholders(seq)
            self.preempt(seq)
        self.kv.reset_prefix_cache()

    def finish(self, seq: Sequence, reason: str, num_outputs: int | None = None) -> None:
        """Finish `seq` (running, or waiting after a preemption) with finish_reason
        `reason`: it leaves the live requests and its pages are freed. Its outputs are cut
        to `num_outputs` (the rest were sampled in vain) or, by default, to those read
        back. A finished sequence is left as it is."""
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        if num_outputs is not None:
            del seq.output_ids[num_outputs:]
        _drop_placeholders(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        self.requests.pop(seq.request_id, None)

    def abort(self, request_id: str, reason: str) -> Sequence | None:
        """Finish the live request `request_id` with `reason`; None if unknown."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq, reason)
        return seq

    def take_refused(self) -> list[tuple[Sequence, str]]:
        """Waiting sequences planning refused since the last call, with why (their LoRA
        adapter was unloaded or cannot be read): the engine fails them."""
        out, self._refused = self._refused, []
        return out

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            if self.lora is not None:
                self.lora.release(seq)
        self.kv.free(seq)


def _drop_placeholders(seq: Sequence) -> None:
    while seq.has_placeholder:
        seq.output_ids.pop()


class _ChunkCost:
    """What a step's prompt chunks may cost with dynamic chunking
    (SchedulerConfig.dynamic_chunking_keys = K): a chunk of n rows from position L (its
    sequence's computed tokens) costs n + (n * L + n * (n + 1) / 2) / K token rows (each
    row attends to the keys up to its own: n * L + n * (n + 1) / 2 query-key pairs, K of
    which cost as much as a row's matmuls), and the step's chunks together at most what
    the `rows` rows left after its decodes cost as one chunk at L = 0. A chunk from L <=
    `uncut` (max_num_batched_tokens: a prompt's first two chunks, a short cached prefix)
    is never cut, its cost counted: cutting a short prompt only moves its last tokens
    into a step of their own (measured: PERFORMANCE.md, "Dynamic chunking"). Only in a
    step with decode rows: without, no sequence waits on its time, and chunks take the
    rows left, so a prompt alone is chunked as without it. A long prompt's later chunks get
    fewer rows. Costs are kept in units of 1 / (2K), as integers."""

    def __init__(self, k: int, rows: int, uncut: int):
        self.k = k
        self.uncut = uncut
        self.left = self._cost(0, rows)
        self.first = True

    def _cost(self, start: int, n: int) -> int:
        return n * n + n * (2 * self.k + 2 * start + 1)

    def rows(self, start: int, rows: int) -> int:
        """The most rows (<= `rows`) of a chunk from position `start` within what is left
        (all of them from start <= uncut); at least 1 for the step's first chunk (rows >
        0), so that a prompt always progresses."""
        if rows <= 0:
            return 0
        if start <= self.uncut:
            return rows
        b = 2 * self.k + 2 * start + 1  # cost = n^2 + b n
        n = int((math.sqrt(b * b + 4 * max(self.left, 0)) - b) / 2)
        n = max(0, min(n, rows))
        while n < rows and self._cost(start, n + 1) <= self.left:
            n += 1
        while n > 0 and self._cost(start, n) > self.left:
            n -= 1
        return max(n, 1) if self.first else n

    def take(self, start: int, n: int) -> None:
        """A chunk of n rows from `start` planned."""
        self.left -= self._cost(start, n)
        self.first = False


def _todo(seq: Sequence) -> int:
    """Tokens of `seq` whose K/V are not in its pages yet."""
    return seq.num_tokens - seq.num_computed
