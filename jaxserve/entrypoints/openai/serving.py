"""The OpenAI API's request handling without HTTP: parse a body, submit its choices to an
AsyncEngine, collect them and build the response body.

Shared by the HTTP server (`jaxserve.entrypoints.openai.api_server`, which adds body reading, disconnects, SSE
and metrics) and the offline batch runner (`jaxserve.entrypoints.openai.run_batch`), so that a request gets the
same answer and the same errors from both. Source: vLLM's `OpenAIServingCompletion` /
`OpenAIServingChat`, which its `run_batch` calls the same way.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import time
import uuid
from typing import Any

import numpy as np

from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import (AsyncEngine, EngineError, EngineShutdown, QueueFull,
                                          RequestStream, RequestTimeout)
from jaxserve.engine.outputs import RequestOutput
from jaxserve.entrypoints.openai.chat_reply import ChatReply
from jaxserve.entrypoints.openai.chat_prompt import ChatParsers
from jaxserve.entrypoints.openai.request import (ApiError, ParsedEmbedding, ParsedRequest,
                                                 RequestLimits, parse_chat_request,
                                                 parse_completion_request,
                                                 parse_embedding_request)
from jaxserve.entrypoints.openai.response import (CHAT, COMPLETION, LogprobsFormatter,
                                                  ResponseShape, usage)
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Path under /v1 -> the API's response shape.
ENDPOINTS: dict[str, ResponseShape] = {"/v1/completions": COMPLETION,
                                       "/v1/chat/completions": CHAT}
EMBEDDINGS = "/v1/embeddings"  # answered by parse_embedding / submit_embedding


def engine_error(e: EngineError) -> ApiError:
    """An EngineError as the client sees it (its messages are written to be shown): 504
    for a request timeout, 503 for a shutdown, else 500."""
    if isinstance(e, RequestTimeout):
        return ApiError(str(e), status=504, type="timeout", code="request_timeout")
    if isinstance(e, EngineShutdown):
        return ApiError(str(e), status=503, type="server_error", code="shutting_down")
    return ApiError(str(e), status=500, type="server_error")


@dataclasses.dataclass
class Submission:
    """A request whose choices are in the engine: its id, parsed form, response shape
    (None: an embeddings request), creation time (Unix seconds) and one (choice index,
    stream) per choice (per input)."""

    request_id: str
    req: ParsedRequest | ParsedEmbedding
    shape: ResponseShape | None
    created: int
    streams: list[tuple[int, RequestStream]]

    def abort(self) -> None:
        """Abort every choice still running (a no-op for finished ones)."""
        for _, stream in self.streams:
            stream.abort()


async def _last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


async def last_outputs(sub: Submission) -> list[RequestOutput]:
    """Each choice's final output, in `sub.streams` order; the first failure (EngineError)
    is raised."""
    return list(await asyncio.gather(*(_last_output(s) for _, s in sub.streams)))


class OpenAIServing:
    """Handles OpenAI requests for one engine, tokenizer, model name and set of limits (no
    module-level state). Thread use: `parse` may run on any thread (the server runs it on a
    worker thread); the coroutines run on the AsyncEngine's event loop."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int, server: ServerConfig = ServerConfig()):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.limits = RequestLimits.of(server, max_model_len)
        self.parsers = ChatParsers.of(server)
        self.logprobs = LogprobsFormatter(tokenizer)

    def parse(self, raw: bytes, shape: ResponseShape) -> ParsedRequest:
        """Validate a request body (its JSON bytes) for `shape`'s
        endpoint: tokenise, apply the chat template, check the limits. CPU-bound
        (milliseconds to seconds for a large body). Raises ApiError (400 naming the field,
        404 for another model), never anything else (see parse_completion_request)."""
        if shape.chat:
            return parse_chat_request(raw, self.tokenizer, self.model_name, self.limits,
                                      self.engine.lora_names(), self.parsers)
        return parse_completion_request(raw, self.tokenizer, self.model_name, self.limits,
                                        self.engine.lora_names())

    async def submit(self, req: ParsedRequest, shape: ResponseShape,
                     arrival: float | None = None) -> Submission:
        """Add one engine request per choice (n per prompt: they share the prompt's pages
        through the prefix cache); either all choices run or none does. arrival:
        time.monotonic() when the request arrived (default now; the engine's TTFT counts
        from it). Raises ApiError: 400 naming the field for what only the engine checks,
        503 (code queue_full) when the queue is full; EngineError when the engine is down."""
        arrival = time.monotonic() if arrival is None else arrival
        sub = Submission(f"{shape.id_prefix}-{uuid.uuid4().hex}", req, shape, int(time.time()),
                         [])
        return await self._add_all(sub, req.choices(), arrival, False,
                                   "messages" if shape.chat else "prompt")

    async def _add_all(self, sub: Submission, items: list[tuple[int, list[int], SamplingParams]],
                       arrival: float, embed: bool, prompt_param: str) -> Submission:
        """Add sub's engine requests, one per (index, prompt ids, params) of `items`;
        either all run or none does. Raises ApiError: 404 for an adapter unloaded since
        the request was parsed, 400 naming the field (prompt_param for the prompt) for
        what only the engine checks, 503 (code queue_full) when the queue is full."""
        try:
            for index, prompt_ids, params in items:
                engine_id = sub.request_id if len(items) == 1 else f"{sub.request_id}-{index}"
                sub.streams.append((index, await self.engine.add_request(
                    engine_id, prompt_ids, params, arrival, sub.req.lora_name, embed=embed)))
        except InvalidRequest as e:
            if e.field == "model":  # its LoRA adapter was unloaded since it was parsed
                raise ApiError(str(e), "model", status=404, code="model_not_found") from None
            raise ApiError(str(e), prompt_param if e.field == "prompt" else e.field) from None
        except QueueFull as e:
            raise ApiError(f"the server is overloaded: {e}; retry later", status=503,
                           type="server_error", code="queue_full") from None
        finally:
            if len(sub.streams) < len(items):  # one was refused: none runs
                sub.abort()
        return sub

    def parse_embedding(self, raw: bytes) -> ParsedEmbedding:
        """Validate a /v1/embeddings body (`parse_embedding_request`; CPU-bound: any
        thread). Raises ApiError (400 when the engine pools nothing: no --pooling), never
        anything else."""
        if self.engine.engine.engine_config.pooling is None:
            raise ApiError("this server serves no embeddings: start it with --pooling "
                           "last|mean")
        return parse_embedding_request(raw, self.tokenizer, self.model_name, self.limits,
                                       self.engine.engine.model_config.hidden_size,
                                       self.engine.lora_names())

    async def submit_embedding(self, req: ParsedEmbedding, arrival: float | None = None
                               ) -> Submission:
        """One embedding request per input in the engine (prefill only, batched with the
        other requests' steps); all run or none. Raises ApiError (400 / 404 / 503 queue
        full) as `submit` does; EngineError when the engine is down."""
        arrival = time.monotonic() if arrival is None else arrival
        sub = Submission(f"embd-{uuid.uuid4().hex}", req, None, int(time.time()), [])
        return await self._add_all(sub, [(i, ids, _EMBED_PARAMS) for i, ids in
                                         enumerate(req.prompts)], arrival, True, "input")

    def embedding_response(self, sub: Submission, finals: list[RequestOutput]
                           ) -> dict[str, Any]:
        """The /v1/embeddings body (OpenAI's list object) of a submission's final outputs.
        Raises ApiError 500 for an input the engine failed (its error logged)."""
        data = []
        for (index, _), f in zip(sub.streams, finals):
            if f.embedding is None:
                log.error("embedding %s failed: %s", f.request_id, f.error or f.finish_reason)
                raise ApiError("the server failed to embed this input", status=500,
                               type="server_error")
            vec = f.embedding
            if sub.req.encoding_format == "base64":
                vec = base64.b64encode(np.asarray(vec, "<f4").tobytes()).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": vec})
        tokens = sum(f.num_prompt_tokens for f in finals)
        log.info("%s: %d inputs, %d tokens embedded", sub.request_id, len(finals), tokens)
        return {"object": "list", "data": data, "model": self.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def response(self, sub: Submission, finals: list[RequestOutput],
                 arrival: float | None = None) -> dict[str, Any]:
        """The response body (a completion or chat.completion object) of a submission whose
        choices ended with `finals` (`last_outputs(sub)`); logs one line for it (with the
        latency from `arrival`, time.monotonic(), if given)."""
        req, shape, n = sub.req, sub.shape, sub.req.n
        tokens = choice_usage(finals, n)
        latency = f", {time.monotonic() - arrival:.2f} s" if arrival is not None else ""
        log.info("%s: %d prompt + %d output tokens, %s%s", sub.request_id,
                 tokens["prompt_tokens"], tokens["completion_tokens"],
                 ",".join(sorted({f.finish_reason for f in finals})), latency)
        choices = []
        for (index, _), f in zip(sub.streams, finals):
            prompt = index // n
            text = req.prompt_texts[prompt] + f.text if req.echo else f.text
            logprobs = self.logprobs_body(shape, req, prompt, f.token_ids, f.logprobs,
                                          req.echo, f.prompt_logprobs)[0]
            message, finish_reason = None, f.finish_reason
            if req.reply is not None:
                reply = ChatReply(req.reply)
                message = reply.message(text)
                finish_reason = finish_reason_of(reply, finish_reason)
            choices.append(shape.choice(text, finish_reason, index, logprobs, message))
        return shape.response(sub.request_id, sub.created, self.model_name, choices, tokens)

    def logprobs_body(self, shape: ResponseShape, req: ParsedRequest, prompt: int,
                      token_ids: list[int], entries: list | None, with_prompt: bool,
                      prompt_entries: list | None, offset: int = 0
                      ) -> tuple[dict | None, int]:
        """(The `logprobs` object of these output tokens, preceded by prompt `prompt`'s
        tokens when `with_prompt` (echo); the text offset after them), or (None, offset)
        when the request asked for no logprobs. entries / prompt_entries: their
        TokenLogprobs (None: a request that failed before any, reported as nulls)."""
        if req.params.logprobs is None:
            return None, offset
        entries = list(entries) if entries is not None else [None] * len(token_ids)
        if shape.chat:
            return self.logprobs.chat([e for e in entries if e is not None]), offset
        ids = list(token_ids)
        if with_prompt:
            ids = req.prompts[prompt] + ids
            entries = list(prompt_entries or [None] * len(req.prompts[prompt])) + entries
        body = self.logprobs.completion(ids, entries, offset)
        return body, offset + sum(len(t) for t in body["tokens"])


# An embedding request's sampling params (the engine replaces them: Engine.add_request)
_EMBED_PARAMS = SamplingParams()


def finish_reason_of(reply: ChatReply, finish_reason: str | None) -> str | None:
    """A chat choice's finish_reason: "tool_calls" for a reply that stopped after calling
    tools ("auto" / "required"), as OpenAI and vLLM report it."""
    return "tool_calls" if reply.called and finish_reason == "stop" else finish_reason


def choice_usage(finals: list[RequestOutput], n: int) -> dict[str, int]:
    """Usage of a request's choices (n per prompt): each prompt's tokens counted once, as
    OpenAI and vLLM do, and every choice's output tokens."""
    return usage(sum(f.num_prompt_tokens for f in finals) // n,
                 sum(f.num_output_tokens for f in finals))
