"""The OpenAI-compatible HTTP server: Starlette routes over an AsyncEngine.

    POST /v1/completions        prompt (text or token ids) -> text; SSE when "stream": true
    POST /v1/chat/completions   messages -> chat template -> text; SSE when "stream": true
    GET  /v1/models             the one served model
    GET  /health                200 + engine counters while the engine thread runs, else 503

Request parsing and response shapes live in `jaxserve.openai_protocol`; this file owns the
request lifecycle: submit, stream or collect, and abort when the client goes away (so a
disconnected client's pages are freed at once). Source: OpenAI API reference (endpoints,
SSE chunk format ending in `data: [DONE]`, error objects); vLLM's OpenAI server.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxserve.engine.async_engine import AsyncEngine, EngineError, RequestStream
from jaxserve.engine.outputs import RequestOutput
from jaxserve.openai_protocol import (CHAT, COMPLETION, ApiError, ParsedRequest, ResponseShape,
                                      parse_chat_request, parse_completion_request,
                                      parse_json_object, sse_event, usage)
from jaxserve.sampling_params import InvalidRequest
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"


def _server_error(e: Exception) -> ApiError:
    return ApiError(str(e), status=500, type="server_error")


class _EventStream(StreamingResponse):
    """An SSE response that aborts its request however the response ends: finished, client
    disconnected (watched for with `receive` on every ASGI version, and a failed `send`
    under ASGI 2.4), or the task cancelled."""

    def __init__(self, events: AsyncIterator[bytes], stream: RequestStream):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._stream = stream

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
            self._stream.abort()


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


async def _last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


class _Routes:
    """Handlers bound to one engine, tokenizer and model name (no module-level state)."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.created = int(time.time())

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions (OpenAI Completions API)."""
        return await self._serve(request, COMPLETION, parse_completion_request)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (OpenAI Chat Completions API)."""
        return await self._serve(request, CHAT, parse_chat_request)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the served model (OpenAI's model list object)."""
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "jaxserve", "max_model_len": self.max_model_len}]})

    async def health(self, request: Request) -> Response:
        """GET /health: 200 {"status": "ok", running, waiting, free_pages, total_pages,
        num_preemptions, num_steps, num_compilations} while the engine thread runs, else 503."""
        if self.engine.is_running:
            return JSONResponse({"status": "ok", **self.engine.stats()})
        return JSONResponse(ApiError("the engine is not running", status=503,
                                     type="server_error").body(), status_code=503)

    async def _serve(self, request: Request, shape: ResponseShape,
                     parse: Callable[..., ParsedRequest]) -> Response:
        """Parse, submit, then stream (SSE) or collect the one choice; shared by both APIs."""
        body = parse_json_object(await request.body())
        req = parse(body, self.tokenizer, self.model_name, self.max_model_len)
        request_id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        try:
            stream = await self.engine.add_request(request_id, req.prompt_ids, req.params)
        except InvalidRequest as e:
            param = "messages" if shape.chat and e.field == "prompt" else e.field
            raise ApiError(str(e), param) from None
        except EngineError as e:
            raise _server_error(e) from None
        created = int(time.time())
        if req.stream:
            return _EventStream(self._events(stream, shape, request_id, created,
                                             req.include_usage), stream)
        try:
            final = await _unless_disconnected(request.receive, _last_output(stream))
        except EngineError as e:
            raise _server_error(e) from None
        finally:
            stream.abort()
        if final is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(shape.response(
            request_id, created, self.model_name, shape.choice(final.text, final.finish_reason),
            usage(final.num_prompt_tokens, final.num_output_tokens)))

    async def _events(self, stream: RequestStream, shape: ResponseShape, request_id: str,
                      created: int, include_usage: bool) -> AsyncIterator[bytes]:
        """SSE chunks of one request, then the usage chunk (if asked) and `[DONE]`. An engine
        failure mid-stream becomes an error event (the status line is already sent)."""
        first, last = True, None
        try:
            async for out in stream:
                last = out
                if out.new_text or out.finished or (first and shape.chat):
                    choice = shape.delta_choice(out.new_text, out.finish_reason, first)
                    yield sse_event(shape.chunk(request_id, created, self.model_name, [choice],
                                                include_usage))
                    first = False
            if include_usage and last is not None:
                yield sse_event(shape.chunk(request_id, created, self.model_name, [], True,
                                            usage(last.num_prompt_tokens, last.num_output_tokens)))
        except EngineError as e:
            yield sse_event(_server_error(e).body())
        yield sse_event("[DONE]")


async def _api_error(request: Request, exc: ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 in OpenAI's error shape."""
    return JSONResponse(ApiError(exc.detail, status=exc.status_code).body(),
                        status_code=exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error serving %s", request.url.path, exc_info=exc)
    return JSONResponse(_server_error(exc).body(), status_code=500)


def build_app(async_engine: AsyncEngine, tokenizer: Tokenizer, served_model_name: str,
              max_model_len: int) -> Starlette:
    """The Starlette app serving `async_engine` under `served_model_name` (the `model` field
    clients must send, if any). `max_model_len`: prompt + output token limit, checked here
    so that too-long prompts get a 400 naming both lengths."""
    routes = _Routes(async_engine, tokenizer, served_model_name, max_model_len)
    return Starlette(
        routes=[Route("/v1/completions", routes.completions, methods=["POST"]),
                Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
                Route("/v1/models", routes.models, methods=["GET"]),
                Route("/health", routes.health, methods=["GET"])],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                            Exception: _internal_error})
