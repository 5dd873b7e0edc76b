"""Run an OpenAI Batch file through an engine: read, validate, submit with bounded
concurrency, write each result as it finishes; resume after an interrupt.

The input is read through a grain pipeline: a random-access source over the file's line
offsets (`JsonlLines`), then, on grain's reader threads and ahead of the engine, each line
is decoded and its body validated and tokenised (`OpenAIServing.parse`, the HTTP server's
own parse). The prefetch buffer bounds how far ahead it reads, so the requests held do not
grow with the file (what does: the custom_ids seen, kept to refuse duplicates and to skip
finished ones on resume). Requests then go to the engine through `OpenAIServing.submit`,
at most `max_concurrency` at once, and every result line is written and flushed as soon
as it exists: an interrupt loses only the requests in flight, and the next run with the
same output file skips every request that has a result line (`scan_results`).

Source: vLLM's `run_batch` (same file format, same per-request handling as its server).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from pathlib import Path

import grain
from tqdm import tqdm

from jaxserve.entrypoints.openai.batch_file import (DUPLICATE_CUSTOM_ID, UNSUPPORTED_URL,
                                                    BatchFileError, BatchLine, Finished, JsonlLines,
                                                    error_line, read_line, result_line,
                                                    scan_results)
from jaxserve.engine.async_engine import EngineError, EngineShutdown
from jaxserve.entrypoints.openai.request import ApiError
from jaxserve.entrypoints.openai.response import ResponseShape
from jaxserve.entrypoints.openai.serving import (EMBEDDINGS, ENDPOINTS, OpenAIServing,
                                                 engine_error, last_outputs)

log = logging.getLogger(__name__)


class BatchInterrupted(RuntimeError):
    """The engine stopped before the batch finished. The results written so far are kept;
    running the batch again with the same output file does the rest."""


@dataclasses.dataclass
class BatchStats:
    """What one run did. lines: non-blank input lines; resumed: results an earlier run
    had written (skipped); succeeded / failed: results this run wrote (status 200 /
    anything else); prompt_tokens / completion_tokens: of the succeeded requests;
    elapsed_s: from the first submission to the last result (seconds)."""

    lines: int = 0
    resumed: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def output_tokens_per_s(self) -> float:
        """Completion tokens per second of elapsed time (0 when nothing ran)."""
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def summary(self) -> dict:
        """The stats as a JSON-able dict, with output_tokens_per_s."""
        return {**dataclasses.asdict(self), "output_tokens_per_s": self.output_tokens_per_s}


def _validate(serving: OpenAIServing, done: Finished, item: BatchLine) -> BatchLine:
    """Validate a read line's body (on a grain reader thread): `item.parsed` becomes the
    ParsedRequest, or the ApiError refusing it. Lines already done and lines that are not
    requests are left as they are."""
    if item.error is not None or item.custom_id in done.custom_ids:
        return item
    shape = ENDPOINTS.get(item.url)
    if shape is None and item.url != EMBEDDINGS:
        item.error = (UNSUPPORTED_URL, f"line {item.line}: url: {item.url!r} is not one of "
                                       f"{', '.join([*ENDPOINTS, EMBEDDINGS])}"[:400])
        return item
    try:
        if shape is None:
            item.parsed = serving.parse_embedding(item.body)
            return item
        parsed = serving.parse(item.body, shape)
        if parsed.stream:
            raise ApiError("stream: a batch request cannot stream; leave stream out or "
                           "false", "stream")
        item.parsed = parsed
    except ApiError as e:
        item.parsed = e
    return item


def input_pipeline(source: JsonlLines, serving: OpenAIServing, done: Finished,
                   read_threads: int, prefetch: int) -> grain.IterDataset:
    """The grain pipeline over `source`: lines not answered by an earlier run's error
    line, read (`read_line`) and validated (`_validate`) on `read_threads` threads, at
    most `prefetch` lines ahead of the consumer, in input order."""
    return (grain.MapDataset.source(source)
            .filter(lambda item: item[0] not in done.lines)
            .map(lambda item: _validate(serving, done, read_line(*item)))
            .to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                               prefetch_buffer_size=prefetch)))


async def run_batch(serving: OpenAIServing, input_path: str | Path, output_path: str | Path,
                    *, max_concurrency: int, progress: bool = True,
                    read_threads: int = 2) -> BatchStats:
    """Answer every request of the batch file `input_path` into `output_path` (see
    jaxserve.entrypoints.openai.batch_file for both formats), at most `max_concurrency` requests in the
    engine at once. An existing output file is resumed: requests with a result line there
    are skipped, a last line cut short is dropped. A custom_id used by an earlier line
    gets an error line (the first line with it runs). `progress`: a tqdm bar over the
    input's lines.

    Returns this run's BatchStats. Raises BatchFileError for an unusable input or output
    file, ValueError for max_concurrency < 1, BatchInterrupted when the engine stops
    (results written so far stay); a cancelled run aborts its requests in the engine and
    keeps what it wrote.
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    done = scan_results(output_path)
    source = JsonlLines(input_path)
    try:
        out = Path(output_path).open("a", encoding="utf-8")
    except OSError as e:
        source.close()
        raise BatchFileError(f"{output_path}: cannot write the output file: "
                             f"{e.strerror}") from None
    stats = BatchStats(lines=len(source), resumed=len(done))
    claimed: set[str] = set()  # custom_ids seen in this run's reading (or resumed)
    pipeline = iter(input_pipeline(source, serving, done, read_threads, 2 * max_concurrency))
    slots = asyncio.Semaphore(max_concurrency)
    tasks: set[asyncio.Task] = set()
    bar = tqdm(total=len(source), initial=min(len(done), len(source)), unit="req",
               desc="batch", disable=not progress, dynamic_ncols=True)
    start = None
    loop = asyncio.get_running_loop()
    reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-batch-read")
    try:
        with out:
            def write(text: str, ok: bool) -> None:
                out.write(text)
                out.flush()
                bar.update()
                if ok:
                    stats.succeeded += 1
                else:
                    stats.failed += 1

            while (item := await loop.run_in_executor(reader, next, pipeline, None)) is not None:
                if item.custom_id is not None and item.error is None:
                    if item.custom_id in done.custom_ids and item.custom_id not in claimed:
                        claimed.add(item.custom_id)  # answered by an earlier run
                        continue
                    if item.custom_id in claimed:
                        item.error = (DUPLICATE_CUSTOM_ID, f"line {item.line}: custom_id: "
                                      f"{item.custom_id!r} is used by an earlier line; "
                                      "custom_ids must be unique")
                    claimed.add(item.custom_id)
                if item.error is not None:
                    write(error_line(item.custom_id, item.line, *item.error), False)
                    continue
                if isinstance(item.parsed, ApiError):
                    write(result_line(item.custom_id, item.parsed.status,
                                      item.parsed.body()), False)
                    continue
                await slots.acquire()
                for task in [t for t in tasks if t.done()]:
                    tasks.discard(task)
                    task.result()  # BatchInterrupted stops the batch
                start = start or time.monotonic()
                task = asyncio.ensure_future(
                    _run_one(serving, item, ENDPOINTS.get(item.url), write, stats))
                task.add_done_callback(lambda _: slots.release())
                tasks.add(task)
            source.close()  # read to the end: no reader thread touches it again
            for task in asyncio.as_completed(list(tasks)):
                await task
            tasks.clear()
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
        reader.shutdown(wait=True)
        stats.elapsed_s = time.monotonic() - start if start is not None else 0.0
    return stats


async def _run_one(serving: OpenAIServing, item: BatchLine, shape: ResponseShape | None,
                   write, stats: BatchStats) -> None:
    """Submit one validated request (shape None: an embeddings request), wait for its
    choices, write its result line. An engine that is shut down raises BatchInterrupted
    (nothing is written: the request runs again on resume); a failure of this request
    alone is its 500 result line."""
    try:
        embed = shape is None
        sub = await (serving.submit_embedding(item.parsed) if embed
                     else serving.submit(item.parsed, shape))
        try:
            finals = await last_outputs(sub)
        finally:
            sub.abort()
        body = (serving.embedding_response(sub, finals) if embed
                else serving.response(sub, finals))
    except ApiError as e:
        write(result_line(item.custom_id, e.status, e.body()), False)
        return
    except EngineShutdown as e:
        raise BatchInterrupted(f"the engine stopped: {e}") from None
    except EngineError as e:
        if not serving.engine.is_running:
            raise BatchInterrupted(f"the engine stopped: {e}") from None
        error = engine_error(e)
        write(result_line(item.custom_id, error.status, error.body()), False)
        return
    stats.prompt_tokens += body["usage"]["prompt_tokens"]
    stats.completion_tokens += body["usage"].get("completion_tokens", 0)
    write(result_line(item.custom_id, 200, body), True)
