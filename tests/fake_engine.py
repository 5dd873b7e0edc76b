"""A model-free Engine for testing the server and the async bridge (JetStream's mock-engine
idea): the Engine interface (add_request, abort_request, step, has_unfinished_requests,
tokenizer, engine_config, num_compilations) over a canned reply, with page accounting so
tests can assert that finished and aborted requests give their pages back.

`tiny_tokenizer()` builds a byte-level tokenizer (one token per UTF-8 byte, ids 0..255,
plus ChatML special tokens) with a ChatML chat template, in memory.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import tokenizers

from jaxserve.config import EngineConfig
from jaxserve.engine.scheduler import SchedulerStats
from jaxserve.engine.stats import EngineStats
from jaxserve.engine.outputs import (FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP,
                                     RequestOutput)
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.tokenization.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer, byte_chars
from jaxserve.worker.compile_events import CompileEvents

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: token id = byte value (0..255); 256 = <|im_start|> (BOS),
    257 = <|im_end|> (EOS). Multi-byte characters span several tokens, as in real BPE."""
    vocab = {ch: b for b, ch in enumerate(byte_chars())}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(backend, chat_template=CHATML_TEMPLATE, bos_token="<|im_start|>",
                     eos_token="<|im_end|>")


class FakeEngine:
    """Generates `reply` (as tokens) then EOS, over and over if ignore_eos.

    page_size / num_pages: page accounting (a request holds ceil(tokens / page_size) pages).
    step_delay: seconds each step sleeps (to keep requests in flight in tests).
    max_num_seqs: most requests generating at once; the rest wait (FIFO), as in a full batch.
    fail_steps: number of upcoming steps that raise RuntimeError.
    fail_requests: request ids the engine fails on their next step (finish_reason "error",
        as Engine does for a fault in one request's host work).
    Records add/abort calls; asserts it is only ever driven by one thread.
    """

    def __init__(self, tokenizer: Tokenizer, reply: str = "Hi there! 😀 Bye.", *,
                 max_model_len: int = 64, page_size: int = 4, num_pages: int = 256,
                 step_delay: float = 0.0, max_num_seqs: int | None = None):
        self.tokenizer = tokenizer
        self.engine_config = EngineConfig(max_model_len=max_model_len).override(page_size=page_size)
        self.model_config = SimpleNamespace(vocab_size=tokenizer.vocab_size,
                                            eos_token_ids=tokenizer.eos_token_ids)
        self.reply_ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        self.page_size, self.num_pages, self.step_delay = page_size, num_pages, step_delay
        self.max_num_seqs = max_num_seqs
        self.fail_steps = 0
        self.fail_requests: set[str] = set()
        self.free_pages = list(range(num_pages))
        self.requests: dict[str, SimpleNamespace] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.added_params: list[SamplingParams] = []
        self.num_steps = 0
        self._pending: list[RequestOutput] = []
        self._thread: int | None = None

    @property
    def num_compilations(self) -> int:
        """Always 0: nothing is compiled."""
        return 0

    def stats(self) -> EngineStats:
        """Engine.stats(): the counters /health reports."""
        running = len(self._running())
        sched = SchedulerStats(running=running, waiting=len(self.requests) - running,
                               free_pages=len(self.free_pages), total_pages=self.num_pages,
                               cached_pages=0, num_preemptions=0, prefix_cache_queries=0,
                               prefix_cache_hits=0, prefix_cache_evictions=0)
        return EngineStats(scheduler=sched, spec_decode=None, num_steps=self.num_steps,
                           num_compilations=0, kv_live_token_steps=0,
                           kv_allocated_token_steps=0, host_seconds=0.0, step_seconds=0.0,
                           warmup_pending=0, num_failed_requests=0, num_kv_resets=0,
                           num_forced_tokens=0, healthy=True,
                           compile_events=CompileEvents.zero())

    def _running(self) -> list:
        return list(self.requests.values())[:self.max_num_seqs]

    @property
    def pages_in_use(self) -> int:
        """Pages held by live requests (0 once everything finished or was aborted)."""
        return self.num_pages - len(self.free_pages)

    def _check_thread(self) -> None:
        me = threading.get_ident()
        assert self._thread in (None, me), "FakeEngine driven from two threads"
        self._thread = me

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None, embed: bool = False) -> None:
        """Engine.add_request of an engine without LoRA or pooling: InvalidRequest for an
        adapter, an embedding request, a duplicate id, empty or too long prompt."""
        self._check_thread()
        if lora_name is not None:
            raise InvalidRequest("model", f"no LoRA adapter {lora_name!r} is loaded")
        if embed:
            raise InvalidRequest("pooling", "this engine serves no embeddings")
        if request_id in self.requests:
            raise InvalidRequest("request_id", f"request {request_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidRequest("prompt", "prompt is empty")
        if len(prompt_token_ids) >= self.engine_config.max_model_len:
            raise InvalidRequest("prompt", f"prompt has {len(prompt_token_ids)} tokens; "
                                           f"max_model_len is {self.engine_config.max_model_len}")
        self.added.append(request_id)
        self.added_params.append(params)
        self.requests[request_id] = SimpleNamespace(
            id=request_id, prompt=list(prompt_token_ids), params=params, out=[], text="",
            pages=[], detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids),
            stop=StopChecker(params.stop, params.include_stop_str_in_output))
        self._grow(self.requests[request_id])

    def _grow(self, r) -> None:
        need = -(-(len(r.prompt) + len(r.out)) // self.page_size)
        while len(r.pages) < need:
            r.pages.append(self.free_pages.pop())

    def _release(self, r) -> None:
        self.free_pages.extend(r.pages)
        r.pages = []
        del self.requests[r.id]

    def abort_request(self, request_id: str) -> None:
        """Engine.abort_request: free pages now, report "abort" from the next step."""
        self._check_thread()
        r = self.requests.get(request_id)
        if r is None:
            return
        self.aborted.append(request_id)
        self._release(r)
        self._pending.append(self._output(r, [], "", FINISH_ABORT))

    def has_unfinished_requests(self) -> bool:
        """Engine.has_unfinished_requests."""
        self._check_thread()
        return bool(self.requests or self._pending)

    def step(self) -> list[RequestOutput]:
        """Engine.step: one token for every live request (or the injected failure)."""
        self._check_thread()
        self.num_steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        outputs, self._pending = self._pending, []
        for r in self._running():
            if r.id in self.fail_requests:
                self._release(r)
                out = self._output(r, [], "", FINISH_ERROR)
                out.error = "injected request fault"
                outputs.append(out)
                continue
            token = self.reply_ids[len(r.out) % len(self.reply_ids)]
            r.out.append(token)
            self._grow(r)
            finish, text, stopped = None, "", False
            if token in self.tokenizer.eos_token_ids and not r.params.ignore_eos:
                finish = FINISH_STOP
            else:
                text, stopped = r.stop.feed(r.detok.add([token]))
                finish = FINISH_STOP if stopped else None
            if finish is None and (len(r.out) >= r.params.max_tokens or
                                   len(r.prompt) + len(r.out) >= self.engine_config.max_model_len):
                finish = FINISH_LENGTH
            if finish is not None and not stopped:
                text += r.stop.flush()  # held back for a stop string that never came
            r.text += text
            if finish is not None:
                self._release(r)
            outputs.append(self._output(r, [token], text, finish))
        return outputs

    @staticmethod
    def _output(r, new_ids: list[int], new_text: str, finish: str | None) -> RequestOutput:
        return RequestOutput(request_id=r.id, num_prompt_tokens=len(r.prompt), token_ids=list(r.out),
                             new_token_ids=new_ids, text=r.text, new_text=new_text,
                             finished=finish is not None, finish_reason=finish)
