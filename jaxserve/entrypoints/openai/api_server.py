"""The OpenAI-compatible HTTP server: Starlette routes over an AsyncEngine.

    POST /v1/completions        prompt (text or token ids) -> text; SSE when "stream": true
    POST /v1/chat/completions   messages -> chat template -> text; SSE when "stream": true
    POST /v1/embeddings         input(s) -> pooled, normalised hidden states (--pooling)
    GET  /v1/models             the served model, and its LoRA adapters (`parent`: the base)
    POST /tokenize              {"prompt"} or {"messages"} -> token ids (vLLM's)
    POST /detokenize            {"tokens"} -> text (vLLM's)
    POST /v1/load_lora_adapter  {"lora_name", "lora_path"}: serve a PEFT adapter (vLLM's;
    POST /v1/unload_lora_adapter {"lora_name"}: stop serving it    with --enable-lora)
    GET  /health                liveness: 200 + engine counters while the engine thread
                                runs and steps, else 503
    GET  /ready                 readiness: 200 once the server takes traffic, 503 while it
                                drains for shutdown (or the engine is down)
    GET  /metrics               Prometheus text format (jaxserve.entrypoints.metrics)
    GET  /openapi.json          the API's OpenAPI document

Request parsing and response shapes live in `jaxserve.entrypoints.openai.request`, submitting and
collecting in `jaxserve.entrypoints.openai.serving` (shared with the batch runner); this file owns the
request lifecycle: read the body (bounded: 413), parse, template and tokenise it on a worker
thread (the event loop never blocks on a large body), submit (bounded queue: 503 with
Retry-After), stream or collect, and abort when the client goes away (so a disconnected
client's pages are freed at once). No response carries exception text or a stack trace:
failures are logged, the client gets a fixed message. `/v1/*` needs `Authorization: Bearer
KEY` when the app has an api_key. Source: OpenAI API reference (endpoints, SSE chunk
format ending in `data: [DONE]`, error objects); vLLM's OpenAI server (API key, /health,
/metrics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
from typing import AsyncIterator, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxserve.config import ServerConfig
from jaxserve.engine.async_engine import AsyncEngine, EngineError, RequestStream
from jaxserve.engine.outputs import RequestOutput
from jaxserve.entrypoints.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Metrics
from jaxserve.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from jaxserve.entrypoints.openai.request import (ApiError, parse_detokenize_request,
                                                 parse_tokenize_request, validate_body)
from jaxserve.entrypoints.openai.response import CHAT, COMPLETION, ResponseShape, sse_event
from jaxserve.entrypoints.openai.chat_reply import ChatReply
from jaxserve.entrypoints.openai.serving import (OpenAIServing, Submission, choice_usage,
                                                 engine_error, finish_reason_of, last_outputs)
from jaxserve.entrypoints.openai.openapi import openapi_schema
from jaxserve.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"
ENGINE_STALL_S = 120.0  # /health fails if the engine thread has not gone round for this long
INTERNAL_ERROR = "the server failed while handling this request"
_EVENT_STREAM_HEADERS = {"Cache-Control": "no-cache"}


@dataclasses.dataclass
class Lifecycle:
    """Whether the server still takes traffic: `draining` from a shutdown signal on (new
    requests then get 503). Set by serve.py; read by the handlers. (Ready otherwise:
    serve.py listens only once the engine is built and its first shapes compiled.)"""

    draining: bool = False


class _EventStream(StreamingResponse):
    """An SSE response that aborts its request however the response ends: finished, client
    disconnected (watched for with `receive` on every ASGI version, and a failed `send`
    under ASGI 2.4), or the task cancelled."""

    def __init__(self, events: AsyncIterator[bytes], streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream", headers=_EVENT_STREAM_HEADERS)
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def respond() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # client gone: an ASGI 2.4 server raises on send
                    tg.cancel_scope.cancel()

                tg.start_soon(respond)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            for stream in self._streams:
                stream.abort()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive, work) -> RequestOutput | None:
    """Await `work` (a coroutine); None if the client disconnects first (`work` cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        task.cancel()
        watch.cancel()


_DONE = object()


async def _merged(streams: list[tuple[int, RequestStream]]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of several streams as they come (one task per stream); the
    first failure (EngineError) is raised. Closing it cancels the tasks."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
            await queue.put((index, _DONE))
        except Exception as e:  # EngineError, or a bug: the merged stream raises it
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in streams]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` bytes (by Content-Length before
    reading, else as the chunks arrive)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"the request body has {declared} bytes; the limit is {limit}",
                       status=413, code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"the request body exceeds the limit of {limit} bytes",
                           status=413, code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _Routes:
    """Handlers bound to one engine, tokenizer, model name, limits and metrics (no
    module-level state); the request handling itself is `OpenAIServing`'s."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int, server: ServerConfig, metrics: Metrics,
                 lifecycle: Lifecycle):
        self.engine = engine
        self.model_name, self.max_model_len = model_name, max_model_len
        self.server, self.metrics, self.lifecycle = server, metrics, lifecycle
        self.serving = OpenAIServing(engine, tokenizer, model_name, max_model_len, server)
        self.created = int(time.time())
        self._openapi = openapi_schema(model_name)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions (OpenAI Completions API)."""
        return await self._serve(request, COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (OpenAI Chat Completions API)."""
        return await self._serve(request, CHAT)

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings (OpenAI Embeddings API; with --pooling): each input prefilled
        as an engine request of its own, in the same ragged steps as the others, its pooled
        final hidden state returned."""
        arrival = time.monotonic()
        sub = await self._accept(request, self.serving.parse_embedding,
                                 lambda req: self.serving.submit_embedding(req, arrival))
        if isinstance(sub, Response):
            return sub
        finals = await self._collect(request, sub)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(self.serving.embedding_response(sub, finals))

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the served model and the LoRA adapters served now, each with its
        base as `parent` (OpenAI's model list object, vLLM's fields)."""
        card = {"object": "model", "created": self.created, "owned_by": "jaxserve",
                "max_model_len": self.max_model_len}
        adapters = self.engine.lora_paths()
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, **card, "root": self.model_name, "parent": None},
            *({"id": name, **card, "root": path, "parent": self.model_name}
              for name, path in sorted(adapters.items()))]})

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (vLLM's): {"count", "max_model_len", "tokens", "token_strs"} of a
        prompt or chat messages (tokenised on a worker thread)."""
        raw = await _read_body(request, self.server.max_request_body_bytes)
        ids, strs = await anyio.to_thread.run_sync(
            parse_tokenize_request, raw, self.serving.tokenizer, self.model_name,
            self.engine.lora_names(), self.serving.parsers)
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len,
                             "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (vLLM's): {"prompt": the text of the token ids}."""
        raw = await _read_body(request, self.server.max_request_body_bytes)
        text = await anyio.to_thread.run_sync(
            parse_detokenize_request, raw, self.serving.tokenizer, self.model_name,
            self.engine.lora_names())
        return JSONResponse({"prompt": text})

    async def load_lora_adapter(self, request: Request) -> Response:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"} (vLLM's): the adapter is
        read on a worker thread (the engine steps on meanwhile), then registered between
        two steps; its device slot is written when a request first names it. 200 with
        vLLM's text; 400 naming the field for a name in use or an adapter that cannot be
        served (missing files, rank over --max-lora-rank, another base's shapes, modules
        not served)."""
        raw = await _read_body(request, self.server.max_request_body_bytes)
        req = validate_body(LoadLoRAAdapterRequest, raw)
        name = req.lora_name
        if name == self.model_name or name in self.engine.lora_names():
            raise ApiError(f"The lora adapter '{name[:200]}' has already been loaded.",
                           "lora_name")
        engine = self.engine.engine
        try:
            adapter = await anyio.to_thread.run_sync(engine.lora.read, req.lora_path, name)
            await self.engine.call(lambda e: e.add_lora(name, req.lora_path, adapter))
        except ValueError as e:  # AdapterError: one line naming the adapter and the limit
            raise ApiError(str(e)[:400], "lora_path") from None
        except EngineError as e:
            raise ApiError(str(e), status=503, type="server_error") from None
        log.info("LoRA adapter %r loaded from %s", name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """POST /v1/unload_lora_adapter {"lora_name"} (vLLM's): new requests for it are
        refused (404), its running ones finish with it. 200 with vLLM's text; 404 for a
        name not served."""
        raw = await _read_body(request, self.server.max_request_body_bytes)
        name = validate_body(UnloadLoRAAdapterRequest, raw).lora_name
        try:
            await self.engine.call(lambda e: e.remove_lora(name))
        except KeyError:
            raise ApiError(f"The lora adapter '{name[:200]}' cannot be found.", "lora_name",
                           status=404, code="model_not_found") from None
        except EngineError as e:
            raise ApiError(str(e), status=503, type="server_error") from None
        log.info("LoRA adapter %r unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def health(self, request: Request) -> Response:
        """GET /health (liveness): 200 {"status": "ok", engine counters} while the engine
        thread is alive, its engine not dead, and it went round its loop within
        ENGINE_STALL_S seconds; else 503."""
        stalled = time.monotonic() - self.engine.last_loop_time > ENGINE_STALL_S
        if self.engine.is_running and not stalled:
            return JSONResponse({"status": "ok", **self.engine.stats().as_dict()})
        why = "the engine is stalled" if stalled and self.engine.is_running else \
            "the engine is not running"
        return JSONResponse(ApiError(why, status=503, type="server_error").body(), status_code=503)

    async def ready(self, request: Request) -> Response:
        """GET /ready (readiness): 200 while the server takes traffic; 503 while it drains
        for shutdown, or when the engine is down."""
        if not self.lifecycle.draining and self.engine.is_running:
            return JSONResponse({"status": "ready"})
        why = "the server is shutting down" if self.lifecycle.draining else "not ready"
        return JSONResponse(ApiError(why, status=503, type="server_error").body(), status_code=503)

    async def prometheus(self, request: Request) -> Response:
        """GET /metrics: Prometheus text exposition format."""
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def openapi(self, request: Request) -> Response:
        """GET /openapi.json: the OpenAPI document of this API."""
        return JSONResponse(self._openapi)

    async def _accept(self, request: Request, parse, submit) -> Submission | Response:
        """Read the body, parse it on a worker thread (`parse(raw)`: JSON parsing, the chat
        template and tokenisation of a large body take seconds, off the event loop, which
        keeps answering /health and streaming meanwhile) and submit it (`await
        submit(parsed)`). Returns the Submission, or a 499 Response when the client left
        first. Refusals are counted by reason in the metrics and raised as ApiError (503
        while draining or with the engine down, 500 for a bug here)."""
        try:
            if self.lifecycle.draining:
                raise ApiError("the server is shutting down", status=503, type="server_error",
                               code="shutting_down")
            raw = await _read_body(request, self.server.max_request_body_bytes)
            req = await anyio.to_thread.run_sync(parse, raw)
            return await submit(req)
        except ApiError as e:
            self.metrics.request_rejected(_rejection_reason(e))
            raise
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except EngineError as e:
            self.metrics.request_rejected("engine_down")
            raise ApiError(str(e), status=503, type="server_error") from None
        except Exception:  # a bug: this request fails, the connection and the server stay
            log.exception("accepting a request failed")
            self.metrics.request_rejected("internal_error")
            raise ApiError(INTERNAL_ERROR, status=500, type="server_error") from None

    @staticmethod
    async def _collect(request: Request, sub: Submission) -> list[RequestOutput] | None:
        """Every choice's final output, or None if the client disconnects first; the
        submission is aborted either way (a no-op for finished choices)."""
        try:
            return await _unless_disconnected(request.receive, last_outputs(sub))
        except EngineError as e:
            raise engine_error(e) from None
        finally:
            sub.abort()

    async def _serve(self, request: Request, shape: ResponseShape) -> Response:
        """Read, parse (worker thread), submit, then stream (SSE) or collect the choices;
        shared by both APIs."""
        arrival = time.monotonic()
        sub = await self._accept(request, lambda raw: self.serving.parse(raw, shape),
                                 lambda req: self.serving.submit(req, shape, arrival))
        if isinstance(sub, Response):
            return sub
        if sub.req.stream:
            return _EventStream(self._events(sub), [s for _, s in sub.streams])
        finals = await self._collect(request, sub)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(self.serving.response(sub, finals, arrival))

    async def _events(self, sub: Submission) -> AsyncIterator[bytes]:
        """SSE chunks of every choice as they come (each chunk one choice, with its index,
        its new text and, if asked, the new tokens' logprobs; under echo the first chunk
        starts with the prompt), then the usage chunk (if asked) and `[DONE]`. A failure
        mid-stream becomes an error event (the status line is already sent)."""
        streams, req, shape, request_id = sub.streams, sub.req, sub.shape, sub.request_id
        n, created, include_usage = req.n, sub.created, req.include_usage
        first = {index for index, _ in streams}  # choices whose first chunk is to come
        last: dict[int, RequestOutput] = {}
        offsets: dict[int, int] = {}
        reported: dict[int, int] = {}  # output tokens whose logprobs were sent, by choice
        want_logprobs = req.params.logprobs is not None
        replies = {index: ChatReply(req.reply) for index, _ in streams} \
            if req.reply is not None else {}
        merged = _merged(streams)
        try:
            async for index, out in merged:
                last[index] = out
                new = len(out.token_ids) - reported.get(index, 0)
                if (out.new_text or out.finished or (index in first and (shape.chat or req.echo))
                        or (want_logprobs and new > 0)):
                    text, logprobs = out.new_text, None
                    echo = req.echo and index in first
                    if echo:
                        text = req.prompt_texts[index // n] + text
                    if want_logprobs:
                        entries = out.logprobs[len(out.logprobs) - new:] if out.logprobs else None
                        logprobs, offsets[index] = self.serving.logprobs_body(
                            shape, req, index // n, out.token_ids[len(out.token_ids) - new:],
                            entries, echo, out.prompt_logprobs, offsets.get(index, 0))
                        reported[index] = len(out.token_ids)
                    delta, finish_reason = None, out.finish_reason
                    reply = replies.get(index)
                    if reply is not None:
                        delta = reply.feed(text, final=out.finished)
                        finish_reason = finish_reason_of(reply, finish_reason)
                        if not (delta or out.finished or index in first or logprobs):
                            continue  # held back (a tag arriving in pieces)
                    choice = shape.delta_choice(text, finish_reason, index in first, index,
                                                logprobs, delta)
                    yield sse_event(shape.chunk(request_id, created, self.model_name, [choice],
                                                include_usage))
                    first.discard(index)
            if include_usage and last:
                yield sse_event(shape.chunk(request_id, created, self.model_name, [], True,
                                            choice_usage(list(last.values()), n)))
        except EngineError as e:
            yield sse_event(engine_error(e).body())
        except Exception:
            log.exception("streaming %s failed", request_id)
            yield sse_event(ApiError(INTERNAL_ERROR, status=500, type="server_error").body())
        finally:
            await merged.aclose()
        if len(last) == len(streams) and all(out.finished for out in last.values()):
            tokens = choice_usage(list(last.values()), n)
            log.info("%s: %d prompt + %d output tokens, %s (stream)", request_id,
                     tokens["prompt_tokens"], tokens["completion_tokens"],
                     ",".join(sorted({out.finish_reason for out in last.values()})))
        yield sse_event("[DONE]")


def _rejection_reason(e: ApiError) -> str:
    """The `reason` label of a refused request in the metrics."""
    return e.code or {400: "invalid_request", 404: "not_found", 413: "request_too_large",
                      503: "unavailable"}.get(e.status, f"http_{e.status}")


class _ApiKeyMiddleware:
    """Pure ASGI middleware: `/v1/*` needs `Authorization: Bearer <api_key>` (compared in
    constant time, `hmac.compare_digest`); else 401 in OpenAI's error shape. Other paths
    (/health, /ready, /metrics, /openapi.json) stay open. Source: vLLM's --api-key."""

    def __init__(self, app, api_key: str, on_reject: Callable[[str], None]):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_reject = on_reject

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") \
                and scope["method"] != "OPTIONS":  # CORS preflights carry no credentials
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                self._on_reject("unauthorized")
                error = ApiError("Incorrect or missing API key: send 'Authorization: Bearer "
                                 "<key>'", status=401, code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: ApiError) -> Response:
    headers = {"Retry-After": str(request.app.state.retry_after_s)} \
        if exc.code == "queue_full" else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 in OpenAI's error shape."""
    return JSONResponse(ApiError(exc.detail, status=exc.status_code).body(),
                        status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error serving %s", request.url.path, exc_info=exc)
    return JSONResponse(ApiError(INTERNAL_ERROR, status=500, type="server_error").body(),
                        status_code=500)


def build_app(async_engine: AsyncEngine, tokenizer: Tokenizer, served_model_name: str,
              max_model_len: int, server: ServerConfig = ServerConfig(), *,
              api_key: str | None = None, metrics: Metrics | None = None,
              lifecycle: Lifecycle | None = None) -> Starlette:
    """The Starlette app serving `async_engine` under `served_model_name` (the `model` field
    clients must send, if any). `max_model_len`: prompt + output token limit, checked here
    so that too-long prompts get a 400 naming both lengths. `server`: body size, stop
    string and CORS limits (the engine-side ones are the AsyncEngine's). `api_key`: if
    given, `/v1/*` needs it as a Bearer token. `metrics`: the Metrics to expose (default:
    the async engine's, else a new one). `lifecycle`: the draining state shared with
    serve.py (default: not draining)."""
    metrics = metrics or async_engine.metrics or Metrics(async_engine.stats)
    lifecycle = lifecycle or Lifecycle()
    routes = _Routes(async_engine, tokenizer, served_model_name, max_model_len, server,
                     metrics, lifecycle)
    lora_routes = []
    if getattr(async_engine.engine, "lora", None) is not None:  # --enable-lora
        lora_routes = [Route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"]),
                       Route("/v1/unload_lora_adapter", routes.unload_lora_adapter,
                             methods=["POST"])]
    middleware = []
    if server.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(server.allowed_origins),
                                     allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    if api_key:
        middleware.append(Middleware(_ApiKeyMiddleware, api_key=api_key,
                                     on_reject=metrics.request_rejected))
    app = Starlette(
        routes=[Route("/v1/completions", routes.completions, methods=["POST"]),
                Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
                Route("/v1/embeddings", routes.embeddings, methods=["POST"]),
                Route("/v1/models", routes.models, methods=["GET"]),
                Route("/health", routes.health, methods=["GET"]),
                Route("/ready", routes.ready, methods=["GET"]),
                Route("/metrics", routes.prometheus, methods=["GET"]),
                Route("/openapi.json", routes.openapi, methods=["GET"]),
                Route("/tokenize", routes.tokenize, methods=["POST"]),
                Route("/detokenize", routes.detokenize, methods=["POST"]), *lora_routes],
        middleware=middleware,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            Exception: _internal_error})
    app.state.retry_after_s = server.retry_after_s
    app.state.lifecycle = lifecycle
    app.state.metrics = metrics
    return app
