"""The bridge between asyncio (the HTTP server) and the synchronous, single-threaded Engine.

One background thread owns the Engine: it applies queued add/abort commands between steps,
calls `engine.step()` while there is work, sleeps on a condition variable when there is
none, and hands each RequestOutput to its request's `asyncio.Queue` with
`loop.call_soon_threadsafe`. Coroutines never touch the Engine. (vLLM's `AsyncLLMEngine`
and JetStream's orchestrator have the same shape: an engine loop plus per-request streams.)

    stream = await async_engine.add_request("r1", prompt_ids, params)  # InvalidRequest here
    async with stream:                                                 # aborts on early exit
        async for out in stream: ...

or `async for out in async_engine.generate("r1", prompt_ids, params): ...`.

Each request can fail only itself. The engine thread enforces, per request: a deadline
(`request_timeout_s` after it arrived: aborted, its stream raises RequestTimeout) and a cap
on output produced but not yet taken by its consumer (`max_stream_buffer_bytes`: a client
that does not read its stream is aborted, its pages freed: StreamBufferFull). A request
the engine fails (finish_reason "error") raises EngineError in its own stream only.
`add_request` refuses a request while `max_queued_requests` wait (QueueFull). Optional
`metrics` (jaxserve.entrypoints.metrics.Metrics) observe every request's life on the engine thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from typing import AsyncIterator, Sequence

from jaxserve.engine.outputs import FINISH_ERROR, RequestOutput
from jaxserve.engine.stats import EngineStats
from jaxserve.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)

STREAM_EVENT_OVERHEAD_BYTES = 128  # an SSE chunk's JSON envelope, counted per queued output


class EngineError(RuntimeError):
    """The engine failed while serving this request (a fault in its step or its output
    processing), or it was shut down. HTTP 500 at the edge; the engine thread keeps
    serving others. The message is safe to show a client (no exception text)."""


class EngineShutdown(EngineError):
    """The engine is shut down, or the request was aborted because the server is shutting
    down (HTTP 503 at the edge)."""


class RequestTimeout(EngineError):
    """The request was still unfinished `request_timeout_s` after it arrived: aborted."""


class StreamBufferFull(EngineError):
    """The consumer left more than `max_stream_buffer_bytes` of output unread: aborted."""


class QueueFull(EngineError):
    """`max_queued_requests` requests already wait: the request was not taken (HTTP 503)."""


_ACCEPTED = object()  # first item of a stream's queue: the engine took the request


class RequestStream:
    """The outputs of one request, as an async iterator of RequestOutput (the last one has
    `finished=True`). Raises EngineError from `__anext__` if the engine failed it.

    `abort()` (also `aclose()` and leaving `async with`) cancels the request if it has not
    finished; it is idempotent and synchronous, so it is safe in `finally` blocks of
    cancelled tasks. Created by `AsyncEngine.add_request`; bound to the caller's event loop.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: "AsyncEngine",
                 arrival: float, deadline: float | None = None):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._owner = owner
        self._finished = False
        self.arrival = arrival    # time.monotonic() when the request arrived
        self.deadline = deadline  # time.monotonic() value, or None
        # bytes of output queued (written by the engine thread only) and taken (by the
        # consumer's loop only): their difference is what the consumer has not read
        self._produced = 0
        self._consumed = 0
        # engine thread only: when its last output with tokens was delivered (metrics)
        self.last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        """True once the final output, an error, or an abort has ended this stream."""
        return self._finished

    def _put_threadsafe(self, item) -> None:
        """Engine thread -> this stream's event loop. Raises RuntimeError if the loop closed."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def _wait_accepted(self) -> None:
        item = await self._queue.get()
        if item is not _ACCEPTED:
            self._finished = True
            raise item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        self._consumed += _size(item)
        if item.finished:
            self._finished = True
        return item

    def abort(self) -> None:
        """Cancel the request in the engine (frees its pages) unless it already ended."""
        if not self._finished:
            self._finished = True
            self._owner._submit(("abort", self.request_id, None, None, None))

    async def aclose(self) -> None:
        """Same as abort(); for `contextlib.aclosing` and async-iterator protocols."""
        self.abort()

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


def _size(out: RequestOutput) -> int:
    """What one queued output counts against `max_stream_buffer_bytes` (bytes)."""
    return len(out.new_text.encode("utf-8", "replace")) + STREAM_EVENT_OVERHEAD_BYTES


class AsyncEngine:
    """Runs `engine` on a background thread; asyncio code submits requests and awaits outputs.

    engine: a jaxserve Engine (or anything with its interface: add_request, abort_request,
    step, has_unfinished_requests, stats, tokenizer). Not thread-safe itself, so only this
    class's thread calls it after construction.
    request_timeout_s: seconds from arrival after which an unfinished request is aborted
        (RequestTimeout in its stream); None = no limit.
    max_stream_buffer_bytes: output left unread by a stream's consumer past which the
        request is aborted (StreamBufferFull); None = no limit.
    max_queued_requests: requests that may wait for the engine (submitted, not yet
        running); `add_request` raises QueueFull beyond; None = no limit.
    metrics: a jaxserve.entrypoints.metrics.Metrics observing requests (or None).

    A request the engine fails (finish_reason "error") gets EngineError in its stream; the
    others go on. An unexpected exception out of `engine.step()` (a bug outside any one
    request) fails every in-flight request with EngineError, and the thread does not step
    again until a new command arrives, so a persistently broken engine cannot spin. If
    the engine reports itself dead (`healthy` False), `is_running` turns False.
    """

    def __init__(self, engine, *, request_timeout_s: float | None = None,
                 max_stream_buffer_bytes: int | None = None,
                 max_queued_requests: int | None = None, metrics=None):
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.max_stream_buffer_bytes = max_stream_buffer_bytes
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self._cv = threading.Condition()
        self._commands: collections.deque = collections.deque()  # guarded by _cv
        self._num_adds_queued = 0                                 # guarded by _cv
        self._stopping = False                                    # guarded by _cv
        self._streams: dict[str, RequestStream] = {}              # engine thread only
        self._stalled = False                                     # engine thread only
        self._dead = False                                        # set by the engine thread
        self.last_loop_time = time.monotonic()  # when the engine thread last went round
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # -- asyncio side ---------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive, not shut down and the engine not dead
        (the /health liveness check)."""
        return self._thread.is_alive() and not self._stopping and not self._dead

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not finished (read from any thread; may be a step stale)."""
        return len(self._streams) + self._num_adds_queued

    def stats(self) -> EngineStats:
        """`Engine.stats()` read from this thread, possibly one step stale."""
        return self.engine.stats()

    def num_queued(self) -> int:
        """Requests waiting for the engine: submitted but not yet applied, plus the
        engine's waiting queue (possibly a step stale)."""
        return self._num_adds_queued + self.engine.stats().scheduler.waiting

    async def add_request(self, request_id: str, prompt_ids: Sequence[int],
                          params: SamplingParams, arrival_time: float | None = None,
                          lora_name: str | None = None, embed: bool = False) -> RequestStream:
        """Submit a request; return its stream once the engine has accepted it.
        arrival_time: time.monotonic() when the request arrived (default: now), from
        which its timeout and latency metrics count. lora_name: the LoRA adapter it runs
        with (None: the base model). embed: an embedding request (`Engine.add_request`).

        Raises InvalidRequest (from `Engine.add_request`: empty or too long prompt, token id
        outside the vocabulary, duplicate id), QueueFull (max_queued_requests wait), or
        EngineError (shut down, or the engine raised). If the caller is cancelled while
        waiting, the request is aborted.
        """
        if self.max_queued_requests is not None and self.num_queued() >= self.max_queued_requests:
            raise QueueFull(f"{self.max_queued_requests} requests are already waiting")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        deadline = None if self.request_timeout_s is None else arrival + self.request_timeout_s
        stream = RequestStream(request_id, asyncio.get_running_loop(), self, arrival, deadline)
        self._submit(("add", request_id, (list(prompt_ids), lora_name, embed), params, stream))
        try:
            await stream._wait_accepted()
        except asyncio.CancelledError:
            self._submit(("abort", request_id, None, None, None))
            raise
        return stream

    async def generate(self, request_id: str, prompt_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's RequestOutputs until it finishes (vLLM's `AsyncLLM.generate`).

        Raises InvalidRequest / EngineError as `add_request` and `RequestStream` do. If the
        consumer stops early (break, aclose, task cancelled by a client disconnect), the
        request is aborted and its pages are freed.
        """
        stream = await self.add_request(request_id, prompt_ids, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def call(self, fn):
        """`fn(engine)` run on the engine thread between two steps (what changes the
        engine's state besides requests: loading a LoRA adapter); returns its result or
        raises what it raised. Raises EngineShutdown once the engine is shut down."""
        future = concurrent.futures.Future()
        self._submit(("call", None, fn, None, future))
        return await asyncio.wrap_future(future)

    def lora_names(self) -> list[str]:
        """The LoRA adapters served now (read from any thread; `Engine.lora_names`)."""
        names = getattr(self.engine, "lora_names", None)
        return names() if names is not None else []

    def lora_paths(self) -> dict[str, str]:
        """{adapter name: its directory} of the LoRA adapters served now (any thread)."""
        lora = getattr(self.engine, "lora", None)
        return lora.paths() if lora is not None else {}

    def abort(self, request_id: str) -> None:
        """Cancel a request by id (no-op if unknown or finished). Thread-safe."""
        self._submit(("abort", request_id, None, None, None))

    def abort_all(self) -> None:
        """Cancel every in-flight request (their streams raise EngineShutdown);
        the engine keeps serving new ones. Thread-safe."""
        self._submit(("abort_all", None, None, None, None))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread after its current step: in-flight requests are aborted
        and their streams raise EngineError; later add_request calls raise EngineError."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _submit(self, command: tuple) -> None:
        with self._cv:
            if command[0] in ("add", "call") and (self._stopping or self._dead
                                                  or not self._thread.is_alive()):
                stopped = True
            else:
                stopped = False
                self._commands.append(command)
                self._num_adds_queued += command[0] == "add"
                self._cv.notify()
        if stopped and command[0] == "call":
            command[4].set_exception(EngineShutdown("the engine is shut down"))
        elif stopped:
            self._deliver(command[4], EngineShutdown("the engine is shut down"))

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._commands or self._stopping or self._has_work()):
                    self._cv.wait(timeout=1.0)
                    self.last_loop_time = time.monotonic()
                commands, self._commands = self._commands, collections.deque()
                self._num_adds_queued = 0
                stopping = self._stopping
            self.last_loop_time = time.monotonic()
            try:
                for command in commands:
                    self._apply(command)
                if stopping:
                    self._fail_all(EngineShutdown("the engine is shut down"))
                    return
                if self._has_work():
                    self._step()
                self._enforce_limits()
            except Exception:  # a bug in this loop must not strand every request
                log.exception("engine loop error")
                self._fail_all(EngineError("the engine failed while serving this request"))
                self._stalled = True

    def _has_work(self) -> bool:
        return not self._stalled and not self._dead and self.engine.has_unfinished_requests()

    def _apply(self, command: tuple) -> None:
        kind, request_id, prompt_ids, params, stream = command
        self._stalled = False
        if kind == "abort":
            stream = self._streams.pop(request_id, None)
            if stream is not None and self.metrics is not None:  # its consumer left
                self.metrics.request_finished(stream, "abort", time.monotonic())
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("engine.abort_request(%r) failed", request_id)
            return
        if kind == "abort_all":
            self._fail_all(EngineShutdown("the request was aborted: the server is shutting down"))
            return
        if kind == "call":
            fn, future = prompt_ids, stream
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # the caller's to handle (an adapter that cannot load)
                future.set_exception(e)
            return
        if self._stopping or self._dead:
            self._deliver(stream, EngineShutdown("the engine is shut down"))
            return
        prompt_ids, lora_name, embed = prompt_ids
        try:
            self.engine.add_request(request_id, prompt_ids, params, lora_name, embed=embed)
        except InvalidRequest as e:
            self._deliver(stream, e)
            return
        except Exception:
            log.exception("engine.add_request(%r) failed", request_id)
            self._deliver(stream, EngineError("the engine could not take the request"))
            return
        self._streams[request_id] = stream
        if self.metrics is not None:
            self.metrics.request_added(len(prompt_ids))
        if not self._deliver(stream, _ACCEPTED):
            self._abort_quietly(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine.step() failed; failing %d in-flight requests", len(self._streams))
            self._fail_all(EngineError("the engine failed while serving this request"))
            if not getattr(self.engine, "healthy", True):
                self._dead = True
            self._stalled = True
            return
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its consumer, or failed earlier
            if out.finished:
                del self._streams[out.request_id]
            if self.metrics is not None:
                self.metrics.output(stream, out, now)
            if out.finish_reason == FINISH_ERROR:
                log.error("request %r failed: %s", out.request_id, out.error)
                self._deliver(stream, EngineError("the engine failed while serving this request"))
                continue
            stream._produced += _size(out)
            if not self._deliver(stream, out) and not out.finished:
                self._abort_quietly(out.request_id)
        if not getattr(self.engine, "healthy", True):
            self._dead = True
            self._fail_all(EngineError("the engine failed while serving this request"))

    def _enforce_limits(self) -> None:
        """Abort requests past their deadline, and those whose consumer left more than
        max_stream_buffer_bytes unread."""
        now, cap = time.monotonic(), self.max_stream_buffer_bytes
        for request_id, stream in list(self._streams.items()):
            if stream.deadline is not None and now > stream.deadline:
                error = RequestTimeout(f"the request did not finish within "
                                       f"{self.request_timeout_s:g} s")
            elif cap is not None and stream._produced - stream._consumed > cap:
                error = StreamBufferFull(f"the client left more than {cap} bytes of its "
                                         f"stream unread")
            else:
                continue
            self._fail_one(request_id, stream, error)

    def _fail_one(self, request_id: str, stream: RequestStream, error: EngineError) -> None:
        if self.metrics is not None:
            self.metrics.request_failed(_failure_reason(error))
        self._deliver(stream, error)
        self._abort_quietly(request_id)

    def _fail_all(self, error: EngineError) -> None:
        for request_id, stream in list(self._streams.items()):
            self._fail_one(request_id, stream, error)

    def _abort_quietly(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("engine.abort_request(%r) failed", request_id)

    @staticmethod
    def _deliver(stream: RequestStream, item) -> bool:
        """Queue `item` on the stream's loop; False if that loop is closed (consumer gone)."""
        try:
            stream._put_threadsafe(item)
            return True
        except RuntimeError:
            return False


def _failure_reason(error: EngineError) -> str:
    """The `reason` label of a failed request in the metrics."""
    if isinstance(error, RequestTimeout):
        return "timeout"
    if isinstance(error, StreamBufferFull):
        return "stream_buffer_full"
    if isinstance(error, EngineShutdown):
        return "shutdown"
    return "engine_error"
