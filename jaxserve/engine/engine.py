"""The engine loop: continuous batching over a preallocated KV page pool.

`step()` asks the scheduler for a plan (prefill or decode), packs it into bucketed arrays,
runs the compiled step on device, then appends the sampled tokens, detokenises
incrementally, checks stop conditions and frees the pages of finished requests. Requests
join (`add_request`) and leave (finish, `abort_request`) between any two steps.

Not thread-safe: one thread drives it (`AsyncEngine` for the server, a plain loop for
`generate`). Input is validated at the edge (`add_request` checks what only the engine
knows: lengths against max_model_len, token ids against the vocabulary).
"""

from __future__ import annotations

import logging

import numpy as np

from jaxserve.config import ConfigError, EngineConfig, ModelConfig
from jaxserve.engine.batch import decode_batch, prefill_batch
from jaxserve.engine.outputs import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, RequestOutput
from jaxserve.engine.page_pool import PagePool
from jaxserve.engine.runner import Runner
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

log = logging.getLogger(__name__)


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
                f"EngineConfig.kv_cache_bytes holds {self.pool.capacity} pages of "
                f"{cache.page_size} tokens but one sequence of max_model_len="
                f"{engine_config.max_model_len} needs {engine_config.max_pages_per_seq}: "
                f"raise kv_cache_bytes or lower max_model_len")
        self.scheduler = Scheduler(engine_config, self.pool)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._rng = np.random.default_rng(engine_config.seed)
        self.num_steps = 0

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a request. Raises InvalidRequest: duplicate id, empty prompt, token id
        outside the vocabulary, or prompt of >= max_model_len tokens (no room for output)."""
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
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        seq = Sequence(request_id=request_id, prompt_ids=ids, params=params, seed=seed)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids)
        seq.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request and free its pages; its final output (finish_reason "abort")
        is returned by the next `step()`. Unknown ids are ignored."""
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            seq.finish_reason = FINISH_ABORT
            self._pending.append(self._output(seq, [], ""))
            del self._seqs[request_id]

    def stats(self) -> dict[str, int]:
        """Counters for /health and tests: requests running / waiting, KV pages free / total
        (pages, null page excluded), preemptions, steps, and step compilations."""
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "free_pages": self.pool.num_free, "total_pages": self.pool.capacity,
                "num_preemptions": self.scheduler.num_preemptions, "num_steps": self.num_steps,
                "num_compilations": self.num_compilations}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of requests that progressed or finished."""
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if plan is None:
            return outputs
        build = prefill_batch if plan.kind == "prefill" else decode_batch
        batch, sampling = build(plan.seqs, self.engine_config)
        tokens, _ = self.runner.run(batch, sampling)
        self.num_steps += 1
        for seq, token in zip(plan.seqs, tokens.tolist()):
            seq.num_computed = seq.num_tokens
            outputs.append(self._append(seq, token))
        return outputs

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        seq.output_ids.append(token)
        p = seq.params
        new_text, stopped_by_string = "", False
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.finish_reason = FINISH_STOP  # the stop token's text is not returned
        else:
            new_text, stopped_by_string = seq.stop_checker.feed(seq.detokenizer.add([token]))
            if stopped_by_string:
                seq.finish_reason = FINISH_STOP
        if seq.finish_reason is None and (len(seq.output_ids) >= p.max_tokens
                                          or seq.num_tokens >= self.engine_config.max_model_len):
            seq.finish_reason = FINISH_LENGTH
        if seq.finish_reason is not None:
            if not stopped_by_string:
                new_text += seq.stop_checker.flush()  # text held back for a stop string that never came
            self.scheduler.finish(seq)
            del self._seqs[seq.request_id]
        seq.text += new_text
        return self._output(seq, [token], new_text)

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, num_prompt_tokens=len(seq.prompt_ids),
            token_ids=list(seq.output_ids), new_token_ids=new_ids, text=seq.text,
            new_text=new_text, finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason)
