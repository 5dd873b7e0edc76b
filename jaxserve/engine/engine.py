"""The engine loop: continuous batching over a preallocated KV page pool.

`step()` asks the scheduler for a plan (decode tokens and prompt chunks within a token
budget), packs it into bucketed arrays and launches the compiled step on device; only
then does it read the previous step's sampled tokens, detokenise incrementally, check stop
conditions and free the pages of finished requests, so that host work overlaps the device
step. A step's outputs are
therefore returned by the next `step()` call. The step in flight is one record
(`InflightStep`: its plan, tokens per sequence, output indices and device handle); the
scheduler records its launch in the sequences (`Scheduler.launched`: computed tokens,
one PLACEHOLDER output per token being sampled), and the next step takes those tokens
from device memory. When no request waits, a decode step may sample
`decode_steps` tokens per sequence in one dispatch (multi-step decode, vLLM's
num_scheduler_steps): the sequences then carry that many placeholders, and tokens after
a stop are dropped. A sequence that stops on a token it could not foresee (EOS, stop
string) has one wasted row in the step after; one that reaches max_tokens /
max_model_len sits that step out. Source: vLLM v1 async scheduling; JetStream's overlapped detokenisation.
Requests join (`add_request`) and leave (finish, `abort_request`) between any two steps.

Not thread-safe: one thread drives it (`AsyncEngine` for the server, a plain loop for
`generate`). Input is validated at the edge (`add_request` checks what only the engine
knows: lengths against max_model_len, token ids and top_k against the vocabulary).

Faults stay with the request they belong to: a request whose host-side work (packing its
sampling parameters, detokenising, stop matching) raises finishes alone with
finish_reason "error". A failed device step fails the requests of that step; the KV pool
it was donated may be gone, so the runner allocates a fresh one and every other running
request is recomputed from its tokens (as after a preemption). If even that fails, the
engine is dead: `healthy` turns False and `step()` raises EngineDeadError.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.batch_builder import step_batch
from jaxserve.engine.outputs import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP,
                                     RequestOutput)
from jaxserve.engine.page_pool import PagePool
from jaxserve.worker.runner import Runner
from jaxserve.engine.scheduler import InflightStep, Scheduler
from jaxserve.engine.sequence import PLACEHOLDER, Sequence, TokenLogprobs
from jaxserve.sample.logits_processors import LogitsControls, bias_entries
from jaxserve.sample.sampler import SamplingBatch
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.spec_decode.proposers import make_proposer
from jaxserve.tokenization.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

log = logging.getLogger(__name__)
# Speculating steps in a row whose proposer found no drafts before the engine decodes in
# multi-step bursts until it finds some (Engine._num_decode_steps; PERFORMANCE.md,
# "Speculative decoding").
SPEC_BURST_AFTER_MISSES = 3


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more: a device step failed and no valid KV pool could be
    made again. Every request is failed; the server reports itself unhealthy."""


class Engine:
    """Serves requests on one model. See module docstring."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 runner: Runner, tokenizer: Tokenizer):
        self.model_config = model_config
        self.engine_config = engine_config
        self.runner = runner
        self.tokenizer = tokenizer
        cache = runner.cache
        self.pool = PagePool(cache.num_pages, cache.page_size)
        if self.pool.capacity < engine_config.max_pages_per_seq:
            raise ConfigError(
                f"CacheConfig.kv_cache_memory_bytes holds {self.pool.capacity} pages of "
                f"{cache.page_size} tokens but one sequence of max_model_len="
                f"{engine_config.max_model_len} needs {engine_config.max_pages_per_seq}: "
                f"raise kv_cache_memory_bytes or lower max_model_len")
        self.scheduler = Scheduler(engine_config, self.pool)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._rng = np.random.default_rng(engine_config.seed)
        self._inflight: InflightStep | None = None  # the launched step not read yet
        self._grammar_tok = None  # structured output's tokenizer (_grammar_tokenizer)
        self.proposer = make_proposer(engine_config.speculative)
        # speculative decoding (vLLM's names): sequences' draft proposals verified, their
        # draft tokens, the accepted ones, and accepted ones by draft position
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        k = engine_config.speculative.num_speculative_tokens if engine_config.speculative else 0
        self.spec_accepted_per_pos = [0] * k
        self._propose_seconds = 0.0
        self._spec_misses = 0  # speculating steps in a row whose proposer found no drafts
        self.num_steps = 0
        self.healthy = True
        self._kv_lost = False         # set by a failed device step, cleared by _reset_kv
        self.num_failed_requests = 0  # finished with "error" (faults, failed device steps)
        self.num_kv_resets = 0        # fresh KV pools after a failed device step
        # Accumulated over steps (see stats()).
        self._kv_live_token_steps = 0
        self._kv_allocated_token_steps = 0
        self._host_seconds = 0.0
        self._step_seconds = 0.0

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a request. Raises InvalidRequest: duplicate id, empty prompt, token id
        outside the vocabulary, prompt of >= max_model_len tokens (no room for output),
        top_k above the vocabulary size, or parameters that cannot be packed for the
        device (checked here, alone, so that they can never fail a batch). Raises
        EngineDeadError once the engine is dead."""
        if not self.healthy:
            raise EngineDeadError("the engine is dead (a device step failed and the KV pool "
                                  "could not be restored)")
        if request_id in self._seqs:
            raise InvalidRequest("request_id", f"request {request_id!r} is already running")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise InvalidRequest("prompt", "prompt is empty")
        limit = self.engine_config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequest("prompt", f"prompt has {len(ids)} tokens; max_model_len is "
                                           f"{limit} (prompt + at least 1 output token)")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if params.top_k > vocab:
            raise InvalidRequest("top_k", f"must be at most the vocabulary size {vocab} "
                                          f"(0 or -1: off), got {params.top_k}")
        self._check_sampler_limits(params)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        seq = Sequence(request_id=request_id, prompt_ids=ids, params=params, seed=seed)
        try:  # what every step does for this request on the host, tried once, alone
            SamplingBatch.from_params([params], [seed], [0], 1)
            seq.controls = self._controls_row(params, len(ids))
            if params.structured_outputs is not None:
                seq.matcher = self._grammar_tokenizer().matcher(params.structured_outputs)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids,
                                                     params.skip_special_tokens)
            seq.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        except InvalidRequest:
            raise
        except Exception as e:
            log.warning("request %r refused: %r", request_id, e)
            raise InvalidRequest("request", "the engine cannot take these sampling "
                                            "parameters or this prompt") from e
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _check_sampler_limits(self, params: SamplingParams) -> None:
        """What only the engine knows about a request's sampler fields: token ids against
        the vocabulary, logprobs against SamplerConfig.max_logprobs, the bias table's size
        against max_logit_bias. Raises InvalidRequest naming the field and the limit."""
        vocab = self.model_config.vocab_size
        limit = self.engine_config.sampler.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise InvalidRequest(name, f"at most {limit} (the server's max_logprobs), "
                                           f"got {value}")
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise InvalidRequest(name, f"token id {bad} is outside the vocabulary "
                                           f"[0, {vocab})")
        if params.uses_controls:
            n = len(self._bias_entries(params))
            size = self.engine_config.sampler.max_logit_bias
            if n > size:
                raise InvalidRequest("logit_bias", f"at most {size} entries (the server's "
                                     f"max_logit_bias; with min_tokens, the stop token ids and "
                                     f"EOS ids count too), got {n}")

    def _grammar_tokenizer(self):
        """The tokenizer's grammar-engine view, built at the first constrained request (~1 s
        for a 50k vocabulary) and kept."""
        if self._grammar_tok is None:
            from jaxserve.sample.grammar import GrammarTokenizer
            self._grammar_tok = GrammarTokenizer(self.tokenizer.backend,
                                                 self.model_config.vocab_size,
                                                 sorted(self.eos_token_ids))
        return self._grammar_tok

    def _bias_entries(self, params: SamplingParams) -> list[tuple]:
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return bias_entries(dict(params.logit_bias), params.min_tokens, stop_ids)

    def _controls_row(self, params: SamplingParams, prompt_len: int) -> LogitsControls | None:
        """The request's row of the logits-controls table (None if it uses none)."""
        if not params.uses_controls:
            return None
        c = LogitsControls.neutral(1, self.engine_config.sampler.max_logit_bias,
                                   self.model_config.vocab_size)
        entries = self._bias_entries(params)
        for j, (token, value, until) in enumerate(entries):
            c.bias_ids[0, j], c.bias_values[0, j], c.bias_until[0, j] = token, value, until
        c.presence_penalty[0] = params.presence_penalty
        c.frequency_penalty[0] = params.frequency_penalty
        c.repetition_penalty[0] = params.repetition_penalty
        c.prompt_len[0] = prompt_len
        return LogitsControls(**{k: v[0] for k, v in dataclasses.asdict(c).items()})

    def abort_request(self, request_id: str) -> None:
        """Cancel a request and free its pages; its final output (finish_reason "abort")
        is returned by the next `step()`. Unknown ids are ignored."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_reason = FINISH_ABORT
            self._pending.append(self._output(seq, [], ""))
            del self._seqs[request_id]

    def stats(self) -> dict[str, int | float]:
        """Counters for /health, tests and benchmarks.

        Gauges: requests running / waiting, KV pages free / total (null page excluded).
        Counters since start: preemptions, steps, step compilations;
        kv_live_token_steps / kv_allocated_token_steps: per launched step, the tokens whose
        K/V the running sequences hold, and the token slots of all allocated pages (their
        ratio over an interval is the KV utilisation); step_seconds: wall time in `step()`;
        host_seconds: the part of it not spent waiting for the device (seconds).
        warmup_pending: step shapes a background warm-up has still to compile.
        num_failed_requests: requests finished with "error"; num_kv_resets: fresh KV
        pools after failed device steps; healthy: False once the engine is dead.
        Prefix cache: prefix_cache_queries / prefix_cache_hits (prompt tokens looked up at
        admission / found cached), prefix_cache_evictions (cached pages taken for new
        content), cached_pages (pages registered now; free_pages counts the unheld ones).
        Speculative decoding (vLLM's names): spec_decode_num_drafts (a sequence's drafts
        verified in one step), spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos (accepted drafts at positions 1..k),
        spec_decode_mean_acceptance_length (tokens per verified proposal: 1 + accepted /
        drafts; None before the first); spec_decode_propose_seconds: host time proposing."""
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "free_pages": self.pool.num_free, "total_pages": self.pool.capacity,
                "num_preemptions": self.scheduler.num_preemptions, "num_steps": self.num_steps,
                "num_compilations": self.num_compilations,
                "kv_live_token_steps": self._kv_live_token_steps,
                "kv_allocated_token_steps": self._kv_allocated_token_steps,
                "host_seconds": round(self._host_seconds, 6),
                "step_seconds": round(self._step_seconds, 6),
                "warmup_pending": self.runner.warmup_pending,
                "num_failed_requests": self.num_failed_requests,
                "num_kv_resets": self.num_kv_resets, "healthy": self.healthy,
                "prefix_cache_queries": self.scheduler.prefix_cache_queries,
                "prefix_cache_hits": self.scheduler.prefix_cache_hits,
                "prefix_cache_evictions": self.pool.num_evictions,
                "cached_pages": self.pool.num_cached,
                "spec_decode_num_drafts": self.spec_num_drafts,
                "spec_decode_num_draft_tokens": self.spec_num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.spec_num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
                "spec_decode_propose_seconds": round(self._propose_seconds, 6),
                "spec_decode_mean_acceptance_length": (
                    round(1 + self.spec_num_accepted_tokens / self.spec_num_drafts, 4)
                    if self.spec_num_drafts else None)}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """Launch the next step, then finish the previous one: returns the outputs of
        requests that progressed or finished in the previous step (and aborts, and
        requests failed by a fault). Raises EngineDeadError once the engine is dead.

        Speculative decoding needs each sequence's tokens before its drafts can be
        proposed, and a verify step's accepted count before the next step can be planned:
        while it speculates (and after a verify step) the previous step is finished
        first, and the host work no longer overlaps the device."""
        if not self.healthy:
            raise EngineDeadError("the engine is dead")
        t0 = time.perf_counter()
        wait = 0.0
        if self._inflight is not None and (self._inflight.plan.verify or self._speculating()):
            wait += self._finish(self._inflight)
            self._inflight = None
            if self._kv_lost:
                self._reset_kv()
        launched = self._launch()
        if self._inflight is not None:
            wait += self._finish(self._inflight)
        self._inflight = launched
        if self._kv_lost:
            # the step launched over the lost pool is abandoned: _reset_kv recomputes its
            # requests (its tokens would have been read from a failed step)
            self._inflight = None
            self._reset_kv()
        outputs, self._pending = self._pending, []
        dt = time.perf_counter() - t0
        self._step_seconds += dt
        self._host_seconds += dt - wait
        return outputs

    def _finish(self, step: InflightStep) -> float:
        """Wait for `step` and process its tokens; returns the seconds spent waiting."""
        t1 = time.perf_counter()
        wants = any(s.logprobs is not None or s.needs_prompt_logprobs for s in step.plan.seqs)
        try:
            out = self.runner.fetch(step.handle, logprobs=wants)  # tokens [n, S]
        except Exception as e:  # the step failed on device
            out = None
            self._device_failure(step.plan.seqs, e)
        wait = time.perf_counter() - t1
        if out is None:
            return wait
        if step.plan.verify:
            for b, (seq, index, drafts) in enumerate(zip(step.plan.seqs, step.first_index,
                                                         step.plan.drafts)):
                m = int(out.num_tokens[b])
                logprobs = self._logprobs_alone(seq, out, b, m)
                if seq.finish_reason is None:
                    self._verified_alone(seq, index, len(drafts), out.tokens[:m, b].tolist(),
                                         logprobs)
            return wait
        if wants and not step.plan.decode:
            self._record_prompt_logprobs(step, out)
        n = out.tokens.shape[0]
        for b, (seq, index, column) in enumerate(zip(step.plan.seqs, step.first_index,
                                                     out.tokens.T.tolist())):
            if index is not None:  # None: a prompt chunk that does not sample
                logprobs = self._logprobs_alone(seq, out, b, n)
                if seq.finish_reason is None:
                    self._resolve_alone(seq, index, column, logprobs)
        return wait

    def _logprobs_alone(self, seq: Sequence, out, b: int, m: int) -> list | None:
        """`_token_logprobs`, with a fault failing this request alone (then None)."""
        try:
            return self._token_logprobs(seq, out, b, m)
        except Exception as e:
            log.exception("reading the logprobs of request %r failed", seq.request_id)
            self._fail(seq, f"reading its logprobs failed: {e!r}")
            return None

    @staticmethod
    def _token_logprobs(seq: Sequence, out, b: int, m: int) -> list[TokenLogprobs] | None:
        """TokenLogprobs of the first m tokens of column b of a fetched step, for a
        sequence that asked for logprobs (else None)."""
        if seq.logprobs is None:
            return None
        k = seq.params.logprobs
        tokens, lps = out.tokens[:m, b].tolist(), out.logprobs[:m, b].tolist()
        if not k:
            return [TokenLogprobs(t, lp) for t, lp in zip(tokens, lps)]
        ids = out.extra["top_ids"][:m, b, :k].tolist()
        tops = out.extra["top_logprobs"][:m, b, :k].tolist()
        return [TokenLogprobs(t, lp, tuple(zip(i, p)))
                for t, lp, i, p in zip(tokens, lps, ids, tops)]

    def _record_prompt_logprobs(self, step: InflightStep, out) -> None:
        """Put the prompt logprobs a mixed step computed into its sequences (each prompt
        row r of a sequence at position p gives token p + 1's); a fault fails that
        request alone."""
        row = 0
        for seq, n, start in zip(step.plan.seqs, step.plan.num_new, step.chunk_starts):
            if seq.prompt_logprobs is not None and seq.finish_reason is None:
                try:
                    _put_prompt_logprobs(seq, out.extra, row, start, n)
                except Exception as e:
                    log.exception("reading the prompt logprobs of %r failed", seq.request_id)
                    self._fail(seq, f"reading its prompt logprobs failed: {e!r}")
            row += n

    def _speculating(self) -> bool:
        """Whether the next step may verify drafts: speculative decoding is on, no waiting
        request could start (none waits, or max_num_seqs run), and 1..disable_by_batch_size
        sequences run, all decoding (none part-way through its prompt)."""
        spec = self.engine_config.speculative
        running = self.scheduler.running
        if spec is None or (self.scheduler.waiting and
                            len(running) < self.engine_config.scheduler.max_num_seqs):
            return False
        return (0 < len(running) <= spec.disable_by_batch_size
                and all(s.num_tokens - s.num_computed == 1 for s in running))

    def _propose(self, hold) -> dict[Sequence, list[int]]:
        """Draft tokens for each running sequence (none for those in `hold`): at most
        num_speculative_tokens, and no more than its max_tokens and max_model_len leave
        room for after the token each step adds."""
        k = self.engine_config.speculative.num_speculative_tokens
        limit = self.engine_config.max_model_len
        drafts = {}
        for seq in self.scheduler.running:
            room = min(k, seq.params.max_tokens - len(seq.output_ids) - 1,
                       limit - seq.num_tokens - 1)
            if seq in hold or room <= 0 or seq.matcher is not None:
                continue
            context = seq.ids(0, seq.num_tokens) if self.proposer.needs_context else None
            d = self.proposer.propose(context, room)
            if d:
                drafts[seq] = d
        return drafts

    def _verified_alone(self, seq: Sequence, index: int, num_drafts: int,
                        tokens: list[int], logprobs: list[TokenLogprobs] | None) -> None:
        """A verify step kept `tokens` of `seq` (its accepted drafts and the token after
        them, at output index `index`): count them, give back the rejected drafts' pages,
        process them as any sampled tokens. A fault fails this request alone."""
        if seq.finish_reason is not None:  # aborted while the step ran
            return
        if num_drafts:
            accepted = len(tokens) - 1
            self.spec_num_drafts += 1
            self.spec_num_draft_tokens += num_drafts
            self.spec_num_accepted_tokens += accepted
            for j in range(accepted):
                self.spec_accepted_per_pos[j] += 1
        try:
            seq.output_ids.extend(tokens)
            self.scheduler.verified(seq, len(tokens))
        except Exception as e:
            log.exception("recording the verified tokens of request %r failed", seq.request_id)
            self._fail(seq, f"recording its verified tokens failed: {e!r}")
            return
        self._resolve_alone(seq, index, tokens, logprobs)

    def _launch(self) -> InflightStep | None:
        """Plan and dispatch the next step; None when there is nothing to run."""
        limit = self.engine_config.max_model_len
        # Sequences whose pending token is their last (length limits) sit the step out, and
        # so do constrained ones whose last token is not read yet: their grammar's mask
        # for the next token needs it. Their mask is then computed while this step runs,
        # and they join the next one; the others are never held up by them.
        hold = {s for s in self.scheduler.running if s.has_placeholder and (
            len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= limit
            or s.matcher is not None)}
        drafts = None
        if self._inflight is None and self._speculating():
            t0 = time.perf_counter()
            drafts = self._propose(hold)
            self._propose_seconds += time.perf_counter() - t0
            self._spec_misses = 0 if drafts else self._spec_misses + 1
        plan = self.scheduler.schedule(hold, drafts)
        if plan is None:
            return None
        if plan.verify:
            n = self.runner.shapes.verify_rows
        else:
            n = self._num_decode_steps(plan) if plan.decode else 1
        prev_rows = self._inflight.row_of() if self._inflight else {}
        try:
            batch, sampling = step_batch(plan, self.runner.shapes, prev_rows)
        except Exception as e:  # a bug: fail the step's requests, not the engine
            log.exception("building a step of %d tokens failed", plan.num_tokens)
            for seq in plan.seqs:
                self._fail(seq, f"building the step failed: {e!r}")
            return None
        try:
            handle = self.runner.dispatch(batch, sampling, n)
        except Exception as e:  # compile or launch failed; the donated pool may be gone
            self._device_failure(plan.seqs, e)
            return None
        self.num_steps += 1
        starts = [s.num_computed for s in plan.seqs]
        first_index = self.scheduler.launched(plan, n)
        live = sum(s.num_computed for s in self.scheduler.running)
        self._kv_live_token_steps += live
        self._kv_allocated_token_steps += (self.pool.capacity - self.pool.num_free) * self.pool.page_size
        return InflightStep(plan, n, first_index, handle, starts)

    def _num_decode_steps(self, plan) -> int:
        """Tokens per sequence for a planned decode step: decode_steps when no request
        waits, every sequence has that many tokens left (max_tokens, max_model_len) and
        the free pages hold them (reserved here); else 1. While speculative decoding is
        on for this batch (a step without drafts: the proposer found none), 1 token per
        step until the proposer has found nothing SPEC_BURST_AFTER_MISSES times in a row,
        then decode_steps bursts until it finds drafts again (each burst's tokens are
        looked up before the next step): on text without repeats an n-gram proposer then
        costs little against plain multi-step decoding, and it still speculates soon
        after repeats begin. (Only 1 and decode_steps are compiled: no burst size
        between.)"""
        n = self.engine_config.scheduler.decode_steps
        if self._speculating() and self._spec_misses < SPEC_BURST_AFTER_MISSES:
            return 1
        if n == 1 or self.scheduler.waiting or any(s.matcher is not None for s in plan.seqs):
            return 1
        limit = self.engine_config.max_model_len
        if any(s.params.max_tokens - len(s.output_ids) < n or limit - s.num_tokens < n
               for s in plan.seqs):
            return 1
        return n if self.scheduler.reserve_ahead(plan.seqs, n - 1) else 1

    def _device_failure(self, seqs: list[Sequence], error: Exception) -> None:
        """A dispatched step failed: fail its requests; the KV pool is reset at the end of
        this `step()` (it was donated to the failed step)."""
        log.error("a device step of %d requests failed: %r", len(seqs), error)
        for seq in seqs:
            self._fail(seq, f"the device step failed: {error!r}")
        self._kv_lost = True

    def _reset_kv(self) -> None:
        """After a failed device step: a fresh KV pool, and every request still running
        recomputed from its tokens (its K/V were in the old pool). Kills the engine if
        the pool cannot be made again."""
        try:
            self.runner.reset_cache()
        except Exception as e:
            log.critical("the KV pool could not be restored after a failed step: %r", e)
            self.healthy = False
            for seq in list(self._seqs.values()):
                self._fail(seq, f"the engine is dead: {e!r}")
            return
        self.num_kv_resets += 1
        self._kv_lost = False
        for seq in list(self.scheduler.running):
            while seq.has_placeholder:  # sampled by the abandoned step
                seq.output_ids.pop()
            self.scheduler.preempt(seq)
        self.pool.clear_cache()  # the cached pages' K/V were in the old pool

    def _fail(self, seq: Sequence, error: str) -> None:
        """Finish `seq` with finish_reason "error" (its pages freed); its output is
        returned by this step."""
        if seq.finish_reason is not None:
            return
        seq.finish_reason = FINISH_ERROR
        while seq.has_placeholder:
            seq.output_ids.pop()
        self.scheduler.finish(seq)
        self._seqs.pop(seq.request_id, None)
        self.num_failed_requests += 1
        out = self._output(seq, [], "")
        out.error = error
        self._pending.append(out)

    def _resolve_alone(self, seq: Sequence, index: int, tokens: list[int],
                       logprobs: list[TokenLogprobs] | None = None) -> None:
        """`_resolve`, with a fault in this request's host work failing it alone."""
        try:
            out = self._resolve(seq, index, tokens, logprobs)
        except Exception as e:
            log.exception("processing the output of request %r failed", seq.request_id)
            self._fail(seq, f"processing its output failed: {e!r}")
            return
        if out is not None:
            self._pending.append(out)

    def _resolve(self, seq: Sequence, index: int, tokens: list[int],
                 logprobs: list[TokenLogprobs] | None = None) -> RequestOutput | None:
        """Put the sampled `tokens` at output positions `index`, `index + 1`, ... and
        process them in order up to the first that finishes the sequence (the rest are
        dropped); one output for all of them. logprobs: the tokens' TokenLogprobs, for a
        request that asked. None if the sequence already finished (aborted, or stopped on
        an earlier token). Stop strings are matched from min_tokens output tokens on (EOS
        and stop token ids cannot be sampled before: they are masked on device)."""
        if seq.finish_reason is not None:
            return None
        p = seq.params
        new_ids, new_text = [], ""
        for j, (i, token) in enumerate(enumerate(tokens, start=index)):
            seq.output_ids[i] = token
            new_ids.append(token)
            if seq.logprobs is not None:
                del seq.logprobs[i:]  # a recomputed sequence's
                seq.logprobs.append(logprobs[j])
            stopped_by_string = False
            if seq.matcher is not None and not seq.matcher.accept(token):
                raise RuntimeError(f"the grammar refused sampled token {token}: "
                                   f"{seq.matcher.error}")
            if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                seq.finish_reason = FINISH_STOP  # the stop token's text is not returned
            else:
                text, stopped_by_string = seq.stop_checker.feed(seq.detokenizer.add([token]),
                                                                i + 1 > p.min_tokens)
                new_text += text
                if stopped_by_string:
                    seq.finish_reason = FINISH_STOP
            if seq.finish_reason is None and (i + 1 >= p.max_tokens or len(seq.prompt_ids)
                                              + i + 1 >= self.engine_config.max_model_len):
                seq.finish_reason = FINISH_LENGTH
            if seq.finish_reason is not None:
                if not stopped_by_string:
                    new_text += seq.stop_checker.flush()  # held back for a stop string that never came
                del seq.output_ids[i + 1:]  # tokens sampled in vain (this or the running step)
                if seq.logprobs is not None:
                    del seq.logprobs[i + 1:]
                self.scheduler.finish(seq)
                del self._seqs[seq.request_id]
                break
        seq.text += new_text
        return self._output(seq, new_ids, new_text, index + len(new_ids))

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], new_text: str,
                num_known: int | None = None) -> RequestOutput:
        """Snapshot of `seq`; num_known: output tokens already read (default: all but the
        trailing PLACEHOLDERs)."""
        if num_known is None:
            num_known = (seq.output_ids.index(PLACEHOLDER) if seq.has_placeholder
                         else len(seq.output_ids))
        return RequestOutput(
            request_id=seq.request_id, num_prompt_tokens=len(seq.prompt_ids),
            token_ids=seq.output_ids[:num_known], new_token_ids=new_ids, text=seq.text,
            new_text=new_text, finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            logprobs=None if seq.logprobs is None else seq.logprobs[:num_known],
            prompt_logprobs=seq.prompt_logprobs)


def _put_prompt_logprobs(seq: Sequence, extra: dict, row: int, start: int, n: int) -> None:
    """seq's prompt logprobs from a step's rows row .. row + n - 1 (its chunk from
    position `start`): the row at position p gives prompt token p + 1's."""
    k = seq.params.prompt_logprobs
    stop = min(start + n, len(seq.prompt_ids) - 1)
    for i, pos in enumerate(range(start, stop), start=row):
        top = ()
        if k:
            top = tuple(zip(extra["prompt_top_ids"][i, :k].tolist(),
                            extra["prompt_top_logprobs"][i, :k].tolist()))
        seq.prompt_logprobs[pos + 1] = TokenLogprobs(
            seq.prompt_ids[pos + 1], float(extra["prompt_logprobs"][i]), top)
