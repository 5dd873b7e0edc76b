"""The engine loop: continuous batching over a preallocated KV page pool.

`step()` reads schedule -> execute -> update: the scheduler decides everything the step
needs (SchedulerOutput: decode tokens and prompt chunks within a token budget, held
sequences, drafts, the burst size), the batch builder packs it into bucketed arrays and
the runner launches the compiled step on device; only then are the previous step's
sampled tokens read, processed (the output processor: detokenising, stop conditions) and
recorded (the scheduler: tokens, finishes, freed pages), so that host work overlaps the
device step. A step's outputs are
therefore returned by the next `step()` call. The step in flight is one record
(`InflightStep`: what was scheduled, tokens per sequence, output indices and device
handle); the scheduler records its launch in the sequences (`Scheduler.launched`:
computed tokens, one PLACEHOLDER output per token being sampled), and the next step takes
those tokens from device memory. When no request waits, a decode step may sample
`decode_steps` tokens per sequence in one dispatch (multi-step decode, vLLM's
num_scheduler_steps): the sequences then carry that many placeholders, and tokens after
a stop are dropped. A sequence that stops on a token it could not foresee (EOS, stop
string) has one wasted row in the step after; one that reaches max_tokens /
max_model_len sits that step out. A one-token step runs as two programs, the forward and
the sampler: a structured-output sequence takes every step, its forward dispatched before
its last token is read, and the sampler half, with the grammar's bitmask for its next token,
dispatched once that token is read and processed, while the forward runs (vLLM v1's
execute_model / sample_tokens with the grammar bitmask). The tokens its grammar then
forces (jump-forward, SchedulerConfig.jump_forward) join its output at once: the step in
flight drops the token it samples for it, and its next step computes them as one chunk
and samples after them. With speculative decoding whose
drafts are proposed on device (a draft model, an EAGLE head, n-gram lookup), a verify step
is planned and dispatched before the previous verify step is read
(`Scheduler.schedule_ahead`): as if that step had kept one token of each sequence, with
the pages of every unread draft accepted; the step moves each sequence's rows by the
tokens kept beyond one on device, and reading the previous step gives back the pages its
successor cannot reach. A verify step may run SpeculativeConfig.verify_steps rounds in one
dispatch (as multi-step decode runs decode_steps; its one PLACEHOLDER then stands for the
tokens of every round, read at once). Source: vLLM v1 async scheduling (with speculative
decoding); JetStream's overlapped detokenisation.
Requests join (`add_request`) and leave (finish, `abort_request`) between any two steps.

Not thread-safe: one thread drives it (`AsyncEngine` for the server, a plain loop for
`generate`). Input is validated at the edge (`add_request`, through the input processor,
checks what only the engine knows: lengths against max_model_len, token ids and top_k
against the vocabulary).

Faults stay with the request they belong to: a request whose host-side work (packing its
sampling parameters, detokenising, stop matching) raises finishes alone with
finish_reason "error". A failed device step fails the requests of that step; the KV pool
it was donated may be gone, so the runner allocates a fresh one and every other running
request is recomputed from its tokens (as after a preemption). If even that fails, the
engine is dead: `healthy` turns False and `step()` raises EngineDeadError.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.batch_builder import constrained_rows, step_batch
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.lora_manager import LoraManager
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import FINISH_ABORT, FINISH_ERROR, RequestOutput
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.scheduler import InflightStep, Scheduler, SchedulerOutput
from jaxserve.engine.sequence import Sequence, TokenLogprobs
from jaxserve.engine.stats import EngineStats
from jaxserve.lora.adapter import AdapterError, LoraAdapter
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.spec_decode.controller import SpecDecodeController
from jaxserve.tokenization.tokenizer import Tokenizer
from jaxserve.worker import compile_events
from jaxserve.worker.runner import Runner

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more: a device step failed and no valid KV pool could be
    made again. Every request is failed; the server reports itself unhealthy."""


class Engine:
    """Serves requests on one model. See module docstring."""

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 runner: Runner, tokenizer: Tokenizer,
                 adapter_model_config: ModelConfig | None = None):
        """adapter_model_config: the shape LoRA adapters are trained for, the checkpoint's
        (default model_config; the builder gives it when model_config serves KV heads
        repeated over more devices: jaxserve.model.tensor_parallel.expand_kv_heads)."""
        self.model_config = model_config
        self.engine_config = engine_config
        self.runner = runner
        self.tokenizer = tokenizer
        cache = runner.cache
        pool = PagePool(cache.num_pages, cache.page_size)
        if pool.capacity < engine_config.max_pages_per_seq:
            raise ConfigError(
                f"CacheConfig.kv_cache_memory_bytes holds {pool.capacity} pages of "
                f"{cache.page_size} tokens but one sequence of max_model_len="
                f"{engine_config.max_model_len} needs {engine_config.max_pages_per_seq}: "
                f"raise kv_cache_memory_bytes or lower max_model_len")
        spec = engine_config.speculative
        self.spec = (SpecDecodeController(spec, engine_config.scheduler.max_num_seqs,
                                          engine_config.max_model_len) if spec else None)
        self.kv_cache_manager = KVCacheManager(pool, engine_config.cache.enable_prefix_caching)
        lcfg = engine_config.lora
        self.lora = (LoraManager(lcfg, adapter_model_config or model_config)
                     if lcfg.enable_lora else None)
        for name, path in lcfg.modules().items():  # --lora-modules: refused at start-up
            try:
                self.lora.add(name, path)
            except AdapterError as e:
                raise ConfigError(f"LoRAConfig.lora_modules: {e}") from None
        self.scheduler = Scheduler(engine_config, self.kv_cache_manager, self.spec, self.lora,
                                   plain_bursts=runner.kernels.host_branches)
        eos = frozenset(model_config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        self.eos_token_ids = eos
        self.input_processor = InputProcessor(model_config, engine_config, tokenizer, eos)
        self.output_processor = OutputProcessor(eos, engine_config.max_model_len)
        self._async = engine_config.scheduler.async_scheduling
        self._jump_forward = engine_config.scheduler.jump_forward
        self._pending: list[RequestOutput] = []
        self._inflight: InflightStep | None = None  # the launched step not read yet
        self.num_steps = 0
        self.num_forced_tokens = 0  # output tokens jump-forward added (`_forced`)
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
    def pool(self) -> PagePool:
        return self.kv_cache_manager.pool

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, lora_name: str | None = None,
                    embed: bool = False) -> None:
        """Queue a request, run with the LoRA adapter `lora_name` (None: the base model).
        embed: an embedding request (EngineConfig.pooling on): its prompt is prefilled in
        the same ragged steps as the others, its pooled final hidden state comes back as
        RequestOutput.embedding, and it finishes then, its pages freed (`params` is
        ignored: it samples one token, dropped). Raises InvalidRequest: duplicate id, an
        adapter not served (field "model"), embed without pooling (field "pooling"), or
        what the input processor refuses (InputProcessor.process: empty prompt, token
        ids, lengths, sampler limits, parameters that cannot be packed for the device).
        Raises EngineDeadError once the engine is dead. A structured-output request's
        first tokens, when its grammar forces them (jump-forward: `_forced`), join its
        output at once and its prompt's last chunk computes them. Source: vLLM's pooling
        requests (`LLM.embed`)."""
        if not self.healthy:
            raise EngineDeadError("the engine is dead (a device step failed and the KV pool "
                                  "could not be restored)")
        if request_id in self.scheduler.requests:
            raise InvalidRequest("request_id", f"request {request_id!r} is already running")
        salt = None
        if lora_name is not None:
            if self.lora is None or not self.lora.is_served(lora_name):
                raise InvalidRequest("model", f"no LoRA adapter {lora_name!r} is loaded"
                                     + ("" if self.lora else " (LoRA is off: --enable-lora)"))
            salt = self.lora.cache_salt(lora_name)
        pooling = None
        if embed:
            pooling = self.engine_config.pooling
            if pooling is None:
                raise InvalidRequest("pooling", "this engine serves no embeddings: build it "
                                                "with EngineConfig.pooling (--pooling last|mean)")
            params = _EMBED_PARAMS
        seq = self.input_processor.process(request_id, prompt_token_ids, params, lora_name,
                                           salt, pooling)
        self.scheduler.add(seq)
        if seq.matcher is not None:  # what its grammar forces first joins its prompt's chunk
            self._resolve_alone(seq, 0, [])

    # --- LoRA adapters -------------------------------------------------------------------

    def add_lora(self, name: str, path: str, adapter: LoraAdapter | None = None) -> None:
        """Serve the PEFT adapter in directory `path` as `name` (requests name it as their
        model); `adapter`: it already read (jaxserve.lora.load_peft_adapter, e.g. off the
        engine's thread). Its device slot is written when a request first needs it.
        Raises AdapterError (one line) for a name in use or an adapter that cannot be
        served, ValueError when LoRA is off."""
        self._lora_manager().add(name, path, adapter)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name`: its running requests finish with it, waiting ones
        fail, new ones are refused. Raises KeyError for a name not served, ValueError when
        LoRA is off."""
        self._lora_manager().remove(name)

    def _lora_manager(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA is off: start the engine with enable_lora (--enable-lora)")
        return self.lora

    def lora_names(self) -> list[str]:
        """The adapters served now, by name (none when LoRA is off)."""
        return sorted(self.lora.names) if self.lora is not None else []

    def abort_request(self, request_id: str) -> None:
        """Cancel a request and free its pages; its final output (finish_reason "abort")
        is returned by the next `step()`. Unknown ids are ignored."""
        seq = self.scheduler.abort(request_id, FINISH_ABORT)
        if seq is not None:
            self._pending.append(self.output_processor.make_output(seq, [], ""))

    def stats(self) -> EngineStats:
        """The counters /health reports and /metrics exports (EngineStats)."""
        return EngineStats(
            scheduler=self.scheduler.stats(),
            spec_decode=self.spec.stats.snapshot() if self.spec else None,
            num_steps=self.num_steps, num_compilations=self.num_compilations,
            kv_live_token_steps=self._kv_live_token_steps,
            kv_allocated_token_steps=self._kv_allocated_token_steps,
            host_seconds=self._host_seconds, step_seconds=self._step_seconds,
            warmup_pending=self.runner.warmup_pending,
            num_failed_requests=self.num_failed_requests, num_kv_resets=self.num_kv_resets,
            num_forced_tokens=self.num_forced_tokens,
            healthy=self.healthy, compile_events=compile_events.snapshot())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then update from the previous one: returns the
        outputs of requests that progressed or finished in the previous step (and aborts,
        and requests failed by a fault). Raises EngineDeadError once the engine is dead.

        Speculative decoding: a verify step after a verify step is planned before the
        first is read when the drafts are proposed on device (Scheduler.schedule_ahead);
        otherwise (host-proposed drafts, a step that is not a verify step on either side)
        the step in flight is read first, and the host work does not overlap the device.
        With async_scheduling off every step is read before the next is planned."""
        if not self.healthy:
            raise EngineDeadError("the engine is dead")
        t0 = time.perf_counter()
        wait = 0.0
        inflight = self._inflight
        scheduled = None
        if inflight is not None and (not self._async or inflight.scheduled.verify
                                     or self.scheduler.spec_active()):
            if self._async and inflight.scheduled.verify:
                scheduled = self.scheduler.schedule_ahead(_reach(inflight))
            if scheduled is None:
                wait += self._update(inflight)
                self._inflight = None
                if self._kv_lost:
                    self._reset_kv()
        if scheduled is None:
            scheduled = self.scheduler.schedule(can_propose=self._inflight is None)
        for seq, why in self.scheduler.take_refused():
            self._fail(seq, why)
        launched = self._execute(scheduled) if scheduled is not None else None
        if self._inflight is not None:
            wait += self._update(self._inflight, launched)
        if launched is not None and launched.pending_sample is not None and not self._kv_lost:
            self._sample(launched)  # the tokens its grammars wait for are read now
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

    # --- execute -----------------------------------------------------------------------

    def _execute(self, scheduled: SchedulerOutput) -> InflightStep | None:
        """Pack and dispatch a scheduled step; None if that failed (its requests failed).

        A one-token step is dispatched in two halves (Runner.dispatch_forward, then
        dispatch_sample): when one of its sequences samples under a grammar, the sampler
        half waits (`pending_sample`) until the previous step's tokens are read and the
        grammars' bitmasks can be computed (`_sample`, while the forward runs). Multi-step
        decode and verify steps hold no such sequence whose token is pending (the first is
        never planned with a grammar, the second only after the previous step is read):
        their bitmasks are filled in now."""
        prev_rows = self._inflight.row_of() if self._inflight else {}
        try:
            batch, sampling, prev_index = step_batch(scheduled, self.runner.shapes, prev_rows)
        except Exception as e:  # a bug: fail the step's requests, not the engine
            log.exception("building a step of %d tokens failed", scheduled.num_tokens)
            for seq in scheduled.seqs:
                self._fail(seq, f"building the step failed: {e!r}")
            return None
        split = not scheduled.verify and scheduled.num_steps == 1
        constrained = constrained_rows(scheduled)
        handle = pending = None
        try:
            if self.lora is not None:  # adapters the step's sequences took new slots for
                for slot, adapter in self.lora.take_writes():
                    self.runner.write_lora(slot, adapter)
            if split and constrained:
                forward = self.runner.dispatch_forward(batch, sampling, prev_index)
                pending = forward, sampling, constrained
            else:
                self._fill_masks(scheduled, sampling, constrained)
                handle = self.runner.dispatch(batch, sampling, scheduled.num_steps,
                                              prev_index)
        except Exception as e:  # compile or launch failed; the donated pool may be gone
            self._device_failure(scheduled.seqs, e)
            return None
        self.num_steps += 1
        starts = [s.num_computed for s in scheduled.seqs]
        first_index = self.scheduler.launched(scheduled)
        pool = self.pool
        self._kv_live_token_steps += sum(s.num_computed for s in self.scheduler.running)
        self._kv_allocated_token_steps += (pool.capacity - pool.num_free) * pool.page_size
        return InflightStep(scheduled, first_index, handle, starts, pending)

    def _sample(self, step: InflightStep) -> None:
        """Dispatch the sampler half of `step`, its grammars' bitmasks filled in (the
        tokens before them are read); a launch failure fails the step's requests."""
        forward, sampling, rows = step.pending_sample
        step.pending_sample = None
        self._fill_masks(step.scheduled, sampling, rows)
        try:
            step.handle = self.runner.dispatch_sample(forward, sampling)
        except Exception as e:
            self._device_failure(step.scheduled.seqs, e)

    def _fill_masks(self, scheduled: SchedulerOutput, sampling, rows: list[int]) -> None:
        """Write the next-token bitmask of each constrained sequence at `rows` into its row
        of sampling.controls.allowed (jaxserve.sample.grammar); one that finished meanwhile
        keeps the all-allowed row (its token is dropped), one whose matcher raises fails
        alone."""
        for i in rows:
            seq = scheduled.seqs[i]
            if seq.finished:
                continue
            try:
                seq.matcher.fill_bitmask(sampling.controls.allowed[i])
            except Exception as e:
                log.exception("the grammar of request %r failed", seq.request_id)
                self._fail(seq, f"computing its grammar's bitmask failed: {e!r}")

    # --- update ------------------------------------------------------------------------

    def _update(self, step: InflightStep, after: InflightStep | None = None) -> float:
        """Wait for `step`, process its tokens and record them; returns the seconds spent
        waiting for the device. after: the step dispatched after it (a verify step
        planned ahead of this one's read keeps the pages its draft rows may reach)."""
        scheduled = step.scheduled
        t1 = time.perf_counter()
        wants = any(s.logprobs is not None or s.needs_prompt_logprobs for s in scheduled.seqs)
        pools = not scheduled.verify and any(s.pooling is not None for s in scheduled.seqs)
        try:
            out = self.runner.fetch(step.handle, logprobs=wants, pooled=pools)  # tokens [n, S]
        except Exception as e:  # the step failed on device
            out = None
            self._device_failure(scheduled.seqs, e)
        wait = time.perf_counter() - t1
        if out is None:
            return wait
        if scheduled.verify:
            ahead = _reach(after) if after is not None and after.scheduled.verify else {}
            found = None  # whether its live sequences had drafts (None: none was live)
            for b, (seq, index) in enumerate(zip(scheduled.seqs, step.first_index)):
                if index is None or seq.finished:
                    continue
                rounds = list(zip(out.num_drafts[:, b].tolist(), out.num_tokens[:, b].tolist()))
                m = sum(kept for _, kept in rounds)
                found = bool(found) or any(d > 0 for d, _ in rounds)
                logprobs = self._logprobs_alone(seq, out, b, m)
                if not seq.finished:
                    self._verified_alone(seq, rounds, out.tokens[:m, b].tolist(), logprobs,
                                         ahead.get(seq, 0))
            if self.spec is not None and found is not None:
                self.spec.record_found(found)
            return wait
        if wants and not scheduled.decode:
            self._record_prompt_logprobs(step, out)
        if pools:
            self._record_pooled(step, out.extra["pooled"])
        n = out.tokens.shape[0]
        for b, (seq, index, column) in enumerate(zip(scheduled.seqs, step.first_index,
                                                     out.tokens.T.tolist())):
            if index is not None:  # None: a prompt chunk that does not sample
                logprobs = self._logprobs_alone(seq, out, b, n)
                if not seq.finished:
                    self._resolve_alone(seq, index, column, logprobs, after)
        return wait

    def _logprobs_alone(self, seq: Sequence, out, b: int, m: int) -> list | None:
        """OutputProcessor.token_logprobs, with a fault failing this request alone (then
        None)."""
        try:
            return self.output_processor.token_logprobs(seq, out, b, m)
        except Exception as e:
            log.exception("reading the logprobs of request %r failed", seq.request_id)
            self._fail(seq, f"reading its logprobs failed: {e!r}")
            return None

    def _record_prompt_logprobs(self, step: InflightStep, out) -> None:
        """Put the prompt logprobs a mixed step computed into its sequences (each prompt
        row r of a sequence at position p gives token p + 1's); a fault fails that
        request alone. A sequence whose prompt logprobs are all known (its prompt computed
        again after a preemption) keeps them: the step computed none for it (with host
        branches, a step whose rows need none runs no prompt-logprobs program at all)."""
        row = 0
        for seq, n, start in zip(step.scheduled.seqs, step.scheduled.num_new, step.chunk_starts):
            if seq.needs_prompt_logprobs and not seq.finished:
                try:
                    self.output_processor.record_prompt_logprobs(seq, out.extra, row, start, n)
                except Exception as e:
                    log.exception("reading the prompt logprobs of %r failed", seq.request_id)
                    self._fail(seq, f"reading its prompt logprobs failed: {e!r}")
            row += n

    def _record_pooled(self, step: InflightStep, pooled: np.ndarray) -> None:
        """Give each embedding request of a step what it pooled ([S, D] f32,
        `jaxserve.model.pooling.pool_hidden`; OutputProcessor.record_pooled), its prompt rows only (a
        decode row planned before its sampled token was read adds nothing); a fault fails
        that request alone."""
        for b, (seq, n, start) in enumerate(zip(step.scheduled.seqs, step.scheduled.num_new,
                                                step.chunk_starts)):
            if seq.pooling is None or seq.finished or n == 0 or start >= len(seq.prompt_ids):
                continue
            try:
                self.output_processor.record_pooled(seq, pooled[b], start, n)
            except Exception as e:
                log.exception("pooling the hidden states of %r failed", seq.request_id)
                self._fail(seq, f"pooling its hidden states failed: {e!r}")

    def _verified_alone(self, seq: Sequence, rounds: list[tuple[int, int]],
                        tokens: list[int], logprobs: list[TokenLogprobs] | None,
                        ahead: int = 0) -> None:
        """A verify step kept `tokens` of `seq` (each round's accepted drafts and the token
        after them, at the output index of its first PLACEHOLDER); rounds: (drafts
        verified, tokens kept) of each of its rounds. Count them, record them (the
        rejected drafts' pages go back, but for those the rows of the verify step
        dispatched after it may reach: `ahead` tokens after its last), process them as any
        sampled tokens. A fault fails this request alone."""
        if self.spec is not None:
            for num_drafts, kept in rounds:
                self.spec.record_verified(num_drafts, kept - 1 if num_drafts else 0)
        index = seq.num_known - len(seq.prompt_ids)
        try:
            self.scheduler.verified(seq, index, tokens, ahead)
        except Exception as e:
            log.exception("recording the verified tokens of request %r failed", seq.request_id)
            self._fail(seq, f"recording its verified tokens failed: {e!r}")
            return
        self._resolve_alone(seq, index, tokens, logprobs)

    def _resolve_alone(self, seq: Sequence, index: int, tokens: list[int],
                       logprobs: list[TokenLogprobs] | None = None,
                       after: InflightStep | None = None) -> None:
        """Process `seq`'s sampled `tokens` at output positions index, index + 1, ...
        (OutputProcessor.process), then the tokens its grammar forces after them
        (`_forced`: jump-forward), record them and its finish (the scheduler), and queue
        its output; a fault in this request's host work fails it alone. after: the step
        dispatched after the one these tokens come from (None: none), whose token for
        `seq` the forced ones replace."""
        try:
            update = self.output_processor.process(seq, index, tokens, logprobs)
            self.scheduler.commit(seq, index, update.tokens)
            num_known = index + len(update.tokens)
            new_ids, new_text = update.tokens, update.text
            forced = self._forced(seq, after) if update.finish_reason is None else []
            if forced:
                # the forced tokens take the place of the token the step in flight samples
                # for `seq` (its PLACEHOLDER; `_forced` dropped that row), or follow
                index = num_known
                update = self.output_processor.process(seq, index, forced)
                self.scheduler.commit(seq, index, update.tokens)
                num_known = index + len(update.tokens)
                new_ids, new_text = new_ids + update.tokens, new_text + update.text
            if update.finish_reason is not None:
                self.scheduler.finish(seq, update.finish_reason, num_outputs=num_known)
            elif not new_ids:
                return  # (at admission, nothing forced)
            out = self.output_processor.make_output(seq, new_ids, new_text, num_known)
        except Exception as e:
            log.exception("processing the output of request %r failed", seq.request_id)
            self._fail(seq, f"processing its output failed: {e!r}")
            return
        self._pending.append(out)

    def _forced(self, seq: Sequence, after: InflightStep | None) -> list[int]:
        """Jump-forward (SchedulerConfig.jump_forward): the tokens `seq`'s grammar forces
        after its last known token (GrammarMatcher.forced_tokens, up to an EOS), for a
        structured-output request that asks for no logprobs; [] for any other. When the
        step dispatched after the one just read (`after`) samples `seq`'s next token, that
        row is dropped (its token is not read, its bitmask not computed): the forced
        tokens replace its PLACEHOLDER, and the next step computes them as a chunk, as
        Scheduler._plan does any tokens not yet computed. Raises what the matcher raises."""
        if not self._jump_forward or seq.matcher is None or seq.logprobs is not None:
            return []
        forced = list(itertools.takewhile(lambda t: t not in self.eos_token_ids,
                                          seq.matcher.forced_tokens()))
        if forced and seq.has_placeholder and not (after is not None
                                                   and after.drop_sample(seq)):
            return []  # (a PLACEHOLDER is only ever the step in flight's)
        self.num_forced_tokens += len(forced)
        return forced

    # --- faults ------------------------------------------------------------------------

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
            for seq in list(self.scheduler.requests.values()):
                self._fail(seq, f"the engine is dead: {e!r}")
            return
        self.num_kv_resets += 1
        self._kv_lost = False
        self.scheduler.recompute_all()

    def _fail(self, seq: Sequence, error: str) -> None:
        """Finish `seq` with finish_reason "error" (its pages freed); its output is
        returned by this step."""
        if seq.finished:
            return
        self.scheduler.finish(seq, FINISH_ERROR)
        self.num_failed_requests += 1
        out = self.output_processor.make_output(seq, [], "")
        out.error = error
        self._pending.append(out)


# What an embedding request samples: one greedy token, dropped (EOS may be it: either way
# the request ends with its prompt).
_EMBED_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def _reach(step: InflightStep) -> dict[Sequence, int]:
    """{sequence: the most tokens it may keep beyond one} in a dispatched verify step (its
    draft rows, of every round: rounds x (1 + drafts) - 1), for the sequences it samples
    that have not finished since."""
    return {seq: step.scheduled.num_steps * (1 + len(drafts)) - 1 for seq, drafts, first in
            zip(step.scheduled.seqs, step.scheduled.drafts, step.first_index)
            if first is not None and not seq.finished}
