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
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from typing import AsyncIterator, Sequence

from jaxserve.engine.outputs import RequestOutput
from jaxserve.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while serving this request (an exception in `engine.step()`), or
    it was shut down. HTTP 500 at the edge; the engine thread keeps serving others."""


_ACCEPTED = object()  # first item of a stream's queue: the engine took the request


class RequestStream:
    """The outputs of one request, as an async iterator of RequestOutput (the last one has
    `finished=True`). Raises EngineError from `__anext__` if the engine failed it.

    `abort()` (also `aclose()` and leaving `async with`) cancels the request if it has not
    finished; it is idempotent and synchronous, so it is safe in `finally` blocks of
    cancelled tasks. Created by `AsyncEngine.add_request`; bound to the caller's event loop.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, owner: "AsyncEngine"):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._owner = owner
        self._finished = False

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


class AsyncEngine:
    """Runs `engine` on a background thread; asyncio code submits requests and awaits outputs.

    engine: a jaxserve Engine (or anything with its interface: add_request, abort_request,
    step, has_unfinished_requests, tokenizer). Not thread-safe itself, so only this class's
    thread calls it after construction.

    An exception in `engine.step()` fails every in-flight request with EngineError (their
    streams raise it, the engine is told to abort them) and the thread keeps serving new
    requests; it does not step again until a new command arrives, so a persistently broken
    engine cannot spin.
    """

    def __init__(self, engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._commands: collections.deque = collections.deque()  # guarded by _cv
        self._stopping = False                                    # guarded by _cv
        self._streams: dict[str, RequestStream] = {}              # engine thread only
        self._stalled = False                                     # engine thread only
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # -- asyncio side ---------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and not shut down (the /health check)."""
        return self._thread.is_alive() and not self._stopping

    def stats(self) -> dict[str, int]:
        """`Engine.stats()` read from this thread: plain ints, possibly one step stale."""
        return self.engine.stats()

    async def add_request(self, request_id: str, prompt_ids: Sequence[int],
                          params: SamplingParams) -> RequestStream:
        """Submit a request; return its stream once the engine has accepted it.

        Raises InvalidRequest (from `Engine.add_request`: empty or too long prompt, token id
        outside the vocabulary, duplicate id) or EngineError (shut down, or the engine
        raised). If the caller is cancelled while waiting, the request is aborted.
        """
        stream = RequestStream(request_id, asyncio.get_running_loop(), self)
        self._submit(("add", request_id, list(prompt_ids), params, stream))
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

    def abort(self, request_id: str) -> None:
        """Cancel a request by id (no-op if unknown or finished). Thread-safe."""
        self._submit(("abort", request_id, None, None, None))

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
            if command[0] == "add" and (self._stopping or not self._thread.is_alive()):
                stopped = True
            else:
                stopped = False
                self._commands.append(command)
                self._cv.notify()
        if stopped:
            self._deliver(command[4], EngineError("the engine is shut down"))

    # -- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._commands or self._stopping or self._has_work()):
                    self._cv.wait()
                commands, self._commands = self._commands, collections.deque()
                stopping = self._stopping
            try:
                for command in commands:
                    self._apply(command)
                if stopping:
                    self._fail_all(EngineError("the engine is shut down"))
                    return
                if self._has_work():
                    self._step()
            except Exception as e:  # a bug in this loop must not strand every request
                log.exception("engine loop error")
                self._fail_all(EngineError(f"engine loop error: {e!r}"))
                self._stalled = True

    def _has_work(self) -> bool:
        return not self._stalled and self.engine.has_unfinished_requests()

    def _apply(self, command: tuple) -> None:
        kind, request_id, prompt_ids, params, stream = command
        self._stalled = False
        if kind == "abort":
            self._streams.pop(request_id, None)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("engine.abort_request(%r) failed", request_id)
            return
        if self._stopping:
            self._deliver(stream, EngineError("the engine is shut down"))
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except InvalidRequest as e:
            self._deliver(stream, e)
            return
        except Exception as e:
            log.exception("engine.add_request(%r) failed", request_id)
            self._deliver(stream, EngineError(f"the engine could not take the request: {e!r}"))
            return
        self._streams[request_id] = stream
        if not self._deliver(stream, _ACCEPTED):
            self._abort_quietly(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine.step() failed; failing %d in-flight requests", len(self._streams))
            self._fail_all(EngineError(f"the engine failed while serving this request: {e!r}"))
            self._stalled = True
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its consumer, or failed earlier
            if out.finished:
                del self._streams[out.request_id]
            if not self._deliver(stream, out) and not out.finished:
                self._abort_quietly(out.request_id)

    def _fail_all(self, error: EngineError) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._deliver(stream, error)
            self._abort_quietly(request_id)

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
