"""Benchmark any OpenAI-compatible server the way vLLM's benchmarks/benchmark_serving.py does.

    jaxserve bench serve --launch [--config smollm2_135m] [--cache-dir DIR]
    jaxserve bench serve --url http://127.0.0.1:8000/v1 [--num-prompts 200]
        [--max-concurrency C] [--request-rate R] [--output-len N] [--endpoint chat]
        [--result-json out.json]

Workload: `--num-prompts` requests sampled (seeded) from jaxserve/bench/data/bench_prompts.jsonl, real
English prompts of 10 to ~900 tokens, each with its own output length (16..256 tokens). Every
request streams with temperature 0, max_tokens = output_len and ignore_eos, so the server
generates exactly output_len tokens; counts come from the server's usage chunk
(stream_options.include_usage). Requests arrive all at once (--request-rate inf, the default)
or as a Poisson process of rate R (seeded exponential inter-arrival times); at most
--max-concurrency are in flight.

Metrics (as vLLM defines them): duration, completed / failed requests, request, output-token
and total-token throughput, and mean / median / std / p99 of TTFT, TPOT, ITL and E2E latency
in ms. If GET {server}/health returns JSON counters (jaxserve does), their deltas over the run
are reported under "server_counters" (plus compilations_during_run,
jax_compile_events_during_run, kv_utilization, host_overhead when the fields exist). With
--launch, serve.py is started first and start_to_first_token_s (process start -> first
streamed token) is reported.

Importable: `load_dataset`, `run_benchmark`, `launch`, `wait_ready`, `get_model_id`,
`start_to_first_token`, `print_summary` are used by other tools.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterable, Sequence

import httpx
import numpy as np
from tqdm import tqdm

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_DATASET = DATA_DIR / "bench_prompts.jsonl"
DEFAULT_CONFIG = "smollm2_135m"
ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": ("Time to First Token", "TTFT"),
                 "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
                 "itl": ("Inter-token Latency", "ITL"),
                 "e2el": ("End-to-end Latency", "E2EL")}


class BenchmarkError(RuntimeError):
    """The benchmark cannot run: server unreachable, not ready, or the test request failed.
    `main` prints its message (no traceback) and exits with status 1."""


@dataclass
class BenchRequest:
    """One request of the workload: the prompt text, the number of tokens to generate, and
    the prompt's length in tokens if the dataset knows it (SmolLM2 tokenizer; only a
    fallback for servers that send no usage)."""
    prompt: str
    output_len: int
    prompt_len: int | None = None


@dataclass
class RequestResult:
    """What one streamed request measured. Times in seconds (time.perf_counter based).

    ttft: request sent -> first non-empty content chunk. itl: every gap between successive
    non-empty content chunks. latency (E2E): request sent -> last chunk carrying choices
    (vLLM's definition). output_tokens: the server's usage.completion_tokens, else the number
    of non-empty content chunks. send_time: when the request was sent, relative to the
    benchmark start; start: the absolute time.perf_counter() it was sent. error: why it
    failed ("" on success).
    """
    success: bool = False
    prompt_len: int | None = None
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    send_time: float = 0.0
    start: float = 0.0
    error: str = ""


def summarise_chunks(start: float, content_times: Sequence[float], last_choice_time: float | None,
                     usage_tokens: int | None) -> RequestResult:
    """Turn the arrival times of one stream into a RequestResult (pure; the unit of the
    metric definitions). `start`: when the request was sent; `content_times`: arrival of
    each non-empty content chunk; `last_choice_time`: arrival of the last chunk with choices
    (None: same as the last content chunk); `usage_tokens`: usage.completion_tokens if the
    server sent it. All in seconds. A stream without any content chunk is a failure.
    Source: vLLM benchmarks/backend_request_func.py (TTFT, ITL, latency)."""
    if not content_times:
        return RequestResult(error="the stream ended without any content chunk")
    end = max(content_times[-1], last_choice_time or content_times[-1])
    return RequestResult(
        success=True, ttft=content_times[0] - start, latency=end - start,
        itl=[b - a for a, b in zip(content_times, content_times[1:])],
        output_tokens=usage_tokens if usage_tokens else len(content_times))


# --- workload -----------------------------------------------------------------------------

def read_dataset(path: str | Path = DEFAULT_DATASET) -> list[BenchRequest]:
    """Every entry of a JSON-lines dataset ({"prompt": str, "output_len": int, optional
    "prompt_len": int, "source": str}). Raises ValueError (with the line number) on a bad
    line, FileNotFoundError if the file is missing."""
    entries = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt, output_len = obj["prompt"], obj["output_len"]
                if not isinstance(prompt, str) or not prompt.strip():
                    raise ValueError("prompt must be a non-empty string")
                if not isinstance(output_len, int) or output_len < 1:
                    raise ValueError("output_len must be a positive integer")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: bad dataset entry: {e!r}") from None
            entries.append(BenchRequest(prompt, output_len, obj.get("prompt_len")))
    if not entries:
        raise ValueError(f"{path}: no entries")
    return entries


def load_dataset(path: str | Path = DEFAULT_DATASET, num_prompts: int = 200, seed: int = 0,
                 output_len: int | None = None) -> list[BenchRequest]:
    """`num_prompts` requests sampled from the dataset with random.Random(seed): without
    replacement when the file has enough entries, with replacement otherwise. `output_len`
    (tokens) overrides every request's output length (vLLM's --sharegpt-output-len).
    Deterministic for a given file and seed. Raises ValueError on a bad file or arguments."""
    if num_prompts < 1:
        raise ValueError("num_prompts must be >= 1")
    if output_len is not None and output_len < 1:
        raise ValueError("output_len must be >= 1")
    entries = read_dataset(path)
    rng = random.Random(seed)
    if num_prompts <= len(entries):
        chosen = rng.sample(entries, num_prompts)
    else:
        chosen = [rng.choice(entries) for _ in range(num_prompts)]
    return [BenchRequest(r.prompt, output_len or r.output_len, r.prompt_len) for r in chosen]


def arrival_times(num_requests: int, request_rate: float = math.inf, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """When each request is sent, in seconds after the benchmark start. request_rate inf:
    all at 0. Finite: the first at 0, then gamma(shape=burstiness, scale=1/(rate*burstiness))
    inter-arrival times from random.Random(seed); burstiness 1 is a Poisson process
    (exponential gaps, mean 1/rate). Source: vLLM benchmarks/benchmark_serving.py get_request."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    rng, t, times = random.Random(seed), 0.0, []
    theta = 1.0 / (request_rate * burstiness)
    for _ in range(num_requests):
        times.append(t)
        t += rng.gammavariate(burstiness, theta)
    return times


# --- one request --------------------------------------------------------------------------

def request_body(endpoint: str, model: str | None, prompt: str, output_len: int,
                 extra: dict | None = None) -> dict:
    """The JSON body of one streaming benchmark request (temperature 0, ignore_eos, usage
    in the stream) for "completions" or "chat"; `extra`: more fields (they win)."""
    body = {"temperature": 0.0, "max_tokens": output_len, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = output_len
    else:
        body["prompt"] = prompt
    body.update(extra or {})
    return body


def _error_message(status: int, raw: bytes) -> str:
    """`HTTP <status>: <message>` from an error response (OpenAI's error shape or raw text)."""
    text = raw.decode("utf-8", "replace").strip()
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(text)
        err = err.get("error", err) if isinstance(err, dict) else err
        text = err.get("message", text) if isinstance(err, dict) else str(err)
    return f"HTTP {status}: {text[:300] or '(empty body)'}"


async def send_request(client: httpx.AsyncClient, url: str, model: str | None,
                       request: BenchRequest, endpoint: str = "completions",
                       extra: dict | None = None) -> RequestResult:
    """Send one streaming request to {url}/completions or {url}/chat/completions and time
    its chunks (see RequestResult); `extra`: more body fields (request_body). Never raises
    for server or network errors: those give success=False with the error message."""
    body = request_body(endpoint, model, request.prompt, request.output_len, extra)
    content_times: list[float] = []
    last_choice_time = usage_tokens = prompt_tokens = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + ENDPOINTS[endpoint], json=body) as r:
            if r.status_code != 200:
                return RequestResult(error=_error_message(r.status_code, await r.aread()),
                                     prompt_len=request.prompt_len)
            async for line in r.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event: lines
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if not isinstance(data, dict):
                    continue
                if data.get("error"):
                    return RequestResult(error=_error_message(200, payload.encode()),
                                         prompt_len=request.prompt_len)
                if choices := data.get("choices"):
                    last_choice_time = now
                    c = choices[0]
                    text = c.get("text") if endpoint == "completions" else \
                        (c.get("delta") or {}).get("content")
                    if text:
                        content_times.append(now)
                if usage := data.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
                    prompt_tokens = usage.get("prompt_tokens")
    except (httpx.HTTPError, OSError, ValueError) as e:
        return RequestResult(error=f"{type(e).__name__}: {e}"[:300] or type(e).__name__,
                             prompt_len=request.prompt_len)
    result = summarise_chunks(start, content_times, last_choice_time, usage_tokens)
    result.prompt_len = prompt_tokens if prompt_tokens is not None else request.prompt_len
    result.start = start
    return result


# --- metrics ------------------------------------------------------------------------------

def _stats_ms(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict:
    """mean/median/std/p<P> of seconds, as ms; 0 for an empty list (as vLLM)."""
    v = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(v)), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(np.std(v))}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(v, p))
    return out


def calculate_metrics(results: Sequence[RequestResult], duration_s: float,
                      percentiles: Iterable[float] = (99,)) -> dict:
    """Aggregate metrics of a run (duration in seconds; latencies in ms).

    completed / failed requests; total_input_tokens (prompt tokens of completed requests,
    where known); total_output_tokens; request_throughput = completed / duration (req/s);
    output_throughput = output tokens / duration (tok/s); total_token_throughput = (input +
    output tokens) / duration; TTFT and E2E latency of every completed request; TPOT per
    request = (e2e - ttft) / (output_tokens - 1) for requests with more than one output
    token; ITL = every inter-chunk gap of every request. For each: mean, median, std (numpy,
    population) and the given percentiles (numpy linear interpolation).
    Source: vLLM benchmarks/benchmark_serving.py calculate_metrics."""
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itls = [g for r in ok for g in r.itl]
    total_in = sum(r.prompt_len or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    percentiles = list(percentiles)
    m = {"duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
         "output_throughput": total_out / duration_s if duration_s > 0 else 0.0,
         "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else 0.0}
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m |= _stats_ms(name, values, percentiles)
    return m


def summarise_errors(results: Iterable[RequestResult], limit: int = 10) -> dict[str, int]:
    """{error message: count} of the failed requests, most frequent first (at most `limit`)."""
    return dict(collections.Counter(r.error for r in results if not r.success).most_common(limit))


# --- server counters ----------------------------------------------------------------------

def server_root(url: str) -> str:
    """The server's root URL: the API base without its trailing /v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def fetch_server_counters(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The numeric fields of GET {root}/health (jaxserve's engine counters), or None when
    the server has no such endpoint, answers non-200 or non-JSON, or cannot be reached."""
    try:
        r = await client.get(server_root(url) + "/health", timeout=10)
        data = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    counters = {k: v for k, v in data.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return counters or None


async def wait_warmup_done(client: httpx.AsyncClient, url: str, timeout_s: float = 900.0,
                           poll_s: float = 0.5) -> dict[str, float] | None:
    """The server's counters (fetch_server_counters) once its background warm-up is over:
    polls while /health reports warmup_pending > 0 (jaxserve compiling step shapes after it
    started serving), so compilations are not counted in the run. Raises BenchmarkError
    after `timeout_s` seconds."""
    deadline = time.perf_counter() + timeout_s
    while True:
        counters = await fetch_server_counters(client, url)
        if not counters or not counters.get("warmup_pending"):
            return counters
        if time.perf_counter() > deadline:
            raise BenchmarkError(f"the server still had {counters['warmup_pending']:g} step "
                                 f"shapes to compile after {timeout_s:g} s")
        await asyncio.sleep(poll_s)


def counter_deltas(before: dict | None, after: dict | None) -> dict:
    """server_counters (after - before of every numeric field in both), plus
    compilations_during_run (delta num_compilations), jax_compile_events_during_run
    (delta jax_compile_events: every JAX trace, lowering, compilation and cache fetch of
    the server process), kv_utilization (delta kv_live_token_steps / delta
    kv_allocated_token_steps) and host_overhead (delta host_seconds / delta step_seconds),
    each None when its fields are missing."""
    out = {"server_counters": None, "compilations_during_run": None,
           "jax_compile_events_during_run": None, "kv_utilization": None,
           "host_overhead": None}
    if not before or not after:
        return out
    d = {k: after[k] - before[k] for k in before if k in after}
    out["server_counters"] = d
    out["compilations_during_run"] = d.get("num_compilations")
    out["jax_compile_events_during_run"] = d.get("jax_compile_events")
    for key, num, den in (("kv_utilization", "kv_live_token_steps", "kv_allocated_token_steps"),
                          ("host_overhead", "host_seconds", "step_seconds")):
        if num in d and den in d and d[den]:
            out[key] = d[num] / d[den]
    return out


# --- the benchmark ------------------------------------------------------------------------

def make_client(concurrency: int | None = None) -> httpx.AsyncClient:
    """An AsyncClient for benchmarking: no connection-pool limit (or `concurrency`
    connections), 10 s to connect, 30 min to wait for a chunk."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=1800.0, write=60.0, pool=None),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))


async def get_model_id(url: str) -> str:
    """The first model id of GET {url}/models. Raises BenchmarkError if the server cannot be
    reached, answers an error or lists no model."""
    async with make_client() as client:
        try:
            r = await client.get(url.rstrip("/") + "/models")
        except (httpx.HTTPError, OSError) as e:
            raise BenchmarkError(f"cannot reach {url}/models: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise BenchmarkError(f"{url}/models: {_error_message(r.status_code, r.content)}")
        try:
            return r.json()["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise BenchmarkError(f"{url}/models lists no model: {r.text[:200]}") from None


async def check_server(url: str, model: str | None, request: BenchRequest,
                       endpoint: str = "completions") -> RequestResult:
    """vLLM's "initial test run": send one request; return its result, or raise
    BenchmarkError with the server's error message if it failed."""
    async with make_client() as client:
        result = await send_request(client, url.rstrip("/"), model, request, endpoint)
    if not result.success:
        raise BenchmarkError(f"the test request to {url} failed: {result.error}")
    return result


async def run_benchmark(url: str, model: str | Sequence[str] | None,
                        requests: Sequence[BenchRequest],
                        max_concurrency: int | None = None, request_rate: float = math.inf,
                        seed: int = 0, endpoint: str = "completions", progress: bool = True, *,
                        burstiness: float = 1.0, percentiles: Iterable[float] = (99,)) -> dict:
    """Run the benchmark against the OpenAI-compatible API at `url` (…/v1) and return the
    result dict: metrics (see calculate_metrics; duration in s, latencies in ms, throughput
    in req/s and tok/s), failed-request error summary ("errors"), max_concurrent_requests
    (peak in flight as the client saw it), server counter deltas (see counter_deltas), the
    run's config, and per-request lists (input_lens, output_lens in tokens; ttfts, e2els,
    itls, send_times in seconds; error strings).

    Requests are sent at `arrival_times(len(requests), request_rate, burstiness, seed)`
    (request_rate inf: all at once), at most `max_concurrency` in flight (None: unlimited);
    a request waiting for a slot is timed from when it is actually sent. `model`: one
    name, or a list: request i names model[i % len(model)] (LoRA adapters served beside
    their base, as vLLM's benchmark spreads requests over --lora-modules). `progress`: a
    tqdm bar. Server and network errors count as failed requests, never raise.
    Source: vLLM benchmarks/benchmark_serving.py benchmark."""
    url = url.rstrip("/")
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError("max_concurrency must be >= 1")
    schedule = arrival_times(len(requests), request_rate, burstiness, seed)
    models = [model] if model is None or isinstance(model, str) else list(model)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = peak = 0
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")

    async with make_client(max_concurrency) as client:
        before = await wait_warmup_done(client, url)

        async def one(i: int, req: BenchRequest, at: float, t0: float) -> RequestResult:
            nonlocal in_flight, peak
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with (sem or contextlib.nullcontext()):
                in_flight += 1
                peak = max(peak, in_flight)
                sent = time.perf_counter() - t0
                try:
                    res = await send_request(client, url, models[i % len(models)], req,
                                             endpoint)
                finally:
                    in_flight -= 1
                    bar.update(1)
            res.send_time = sent
            return res

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, r, at, t0)
                                         for i, (r, at) in enumerate(zip(requests, schedule))))
        duration = time.perf_counter() - t0
        after = await fetch_server_counters(client, url)
    bar.close()

    rate = "inf" if math.isinf(request_rate) else request_rate  # strict JSON, as vLLM
    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-" + endpoint,
           "model_id": model, "num_prompts": len(requests), "request_rate": rate,
           "burstiness": burstiness, "max_concurrency": max_concurrency,
           "config": {"url": url, "model": model, "endpoint": endpoint, "seed": seed,
                      "num_prompts": len(requests), "max_concurrency": max_concurrency,
                      "request_rate": rate, "burstiness": burstiness}}
    out |= calculate_metrics(results, duration, percentiles)
    out["max_concurrent_requests"] = peak
    out["errors"] = summarise_errors(results)
    out |= counter_deltas(before, after)
    out["server_health_before"], out["server_health_after"] = before, after
    out |= {"input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens for r in results],
            "requested_output_lens": [r.output_len for r in requests],
            "ttfts": [r.ttft for r in results], "e2els": [r.latency for r in results],
            "itls": [r.itl for r in results], "send_times": [r.send_time for r in results],
            "scheduled_times": schedule, "request_errors": [r.error for r in results]}
    return out


# --- output -------------------------------------------------------------------------------

def print_summary(result: dict, file=None) -> None:
    """Print the vLLM-style result table of a run_benchmark result (plus jaxserve counters
    and start_to_first_token_s when present)."""
    p = lambda *a: print(*a, file=file or sys.stdout)
    row = lambda k, v: p(f"{k:<40} {v:<10.2f}" if isinstance(v, float) else f"{k:<40} {v!s:<10}")
    p("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate", "inf") not in ("inf", math.inf):
        row("Request rate configured (RPS):", float(result["request_rate"]))
    row("Benchmark duration (s):", float(result["duration"]))
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", float(result["request_throughput"]))
    row("Output token throughput (tok/s):", float(result["output_throughput"]))
    row("Total Token throughput (tok/s):", float(result["total_token_throughput"]))
    row("Peak concurrent requests:", result.get("max_concurrent_requests", "-"))
    for name in METRICS:
        title, short = METRIC_TITLES[name]
        p("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        row(f"Std {short} (ms):", result[f"std_{name}_ms"])
        for key in result:
            if key.startswith("p") and key.endswith(f"_{name}_ms"):
                row(f"P{key[1:-len(name) - 4]} {short} (ms):", result[key])
    extra = [("Start to first token (s):", result.get("start_to_first_token_s")),
             ("Compilations during run:", result.get("compilations_during_run")),
             ("JAX compile events during run:", result.get("jax_compile_events_during_run")),
             ("KV utilization:", result.get("kv_utilization")),
             ("Host overhead (host_s / step_s):", result.get("host_overhead"))]
    if any(v is not None for _, v in extra):
        p("{s:{c}^{n}}".format(s="Server", n=50, c="-"))
        for k, v in extra:
            if v is not None:
                row(k, float(v) if isinstance(v, float) else v)
    p("=" * 50)
    if result.get("errors"):
        p("Errors of failed requests (count: message):")
        for msg, n in result["errors"].items():
            p(f"  {n}: {msg}")


# --- launching serve.py -------------------------------------------------------------------

def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str | Path = DEFAULT_CONFIG, cache_dir: str | Path | None = None,
           log_path: str | Path | None = None, port: int | None = None,
           extra_args: Sequence[str] = (), env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen, str, float]:
    """Start `jaxserve serve --config CONFIG [extra_args]` on 127.0.0.1 (a free port unless
    given), its output going to `log_path` (default $TMPDIR/bench_serving_<pid>.log), with
    `env` (default: this process's). Returns (process, API base URL …/v1,
    time.perf_counter() at process start). The caller terminates it."""
    port = port or free_port()
    log_path = Path(log_path or Path(os.environ.get("TMPDIR", "/tmp")) /
                    f"bench_serving_{os.getpid()}.log")
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--config", str(config), "--host",
           "127.0.0.1", "--port", str(port)]
    if cache_dir:
        cmd += ["--cache-dir", str(cache_dir)]
    cmd += list(extra_args)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc, f"http://127.0.0.1:{port}/v1", t0


def _log_tail(proc: subprocess.Popen | None, lines: int = 15) -> str:
    path = getattr(proc, "log_path", None)
    if not path:
        return ""
    with contextlib.suppress(OSError):
        return "\n  ".join([""] + Path(path).read_text(errors="replace").splitlines()[-lines:])
    return ""


async def wait_ready(url: str, proc: subprocess.Popen | None = None,
                     timeout_s: float = 1800.0, interval_s: float = 0.2) -> float:
    """Poll GET {url}/models until it answers 200; return the seconds waited. Raises
    BenchmarkError if `proc` (the server process, if we started it) exits first (with the
    tail of its log) or after `timeout_s` seconds."""
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise BenchmarkError(f"the server exited with status {proc.returncode} before "
                                     f"it was ready{_log_tail(proc)}")
            with contextlib.suppress(httpx.HTTPError, OSError):
                if (await client.get(url.rstrip("/") + "/models")).status_code == 200:
                    return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout_s:
                raise BenchmarkError(f"{url} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def launched_server(config: str | Path, cache_dir: str | Path | None = None,
                          extra_args: Sequence[str] = ()):
    """`launch` serve.py, wait until it is ready and its background warm-up is over, and
    yield its API base URL (…/v1); the server is terminated on exit (killed if it does not
    stop within 60 s). Raises BenchmarkError as `wait_ready` does."""
    proc, url, _ = launch(config, cache_dir, extra_args=extra_args)
    try:
        await wait_ready(url, proc)
        async with make_client() as client:
            await wait_warmup_done(client, url)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_tool(main_async, args: argparse.Namespace) -> int:
    """A benchmark tool's exit status: run `main_async(args)` (returning a JSON-able
    result), print a BenchmarkError's message (status 1) instead of a traceback, and write
    the result to `args.json` if given."""
    try:
        out = asyncio.run(main_async(args))
    except BenchmarkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


WORDS = ("river mountain quantum bread violin galaxy ledger orchid tensor harbor lantern "
         "meadow cipher saffron glacier").split()


def word_prompt(num_words: int, seed: int = 0) -> str:
    """`num_words` random words (each one SmolLM2 token with its space)."""
    return " ".join(np.random.default_rng(seed).choice(WORDS, num_words))


async def start_to_first_token(url: str, model: str | None, t0: float,
                               endpoint: str = "completions") -> float:
    """Seconds from `t0` (time.perf_counter() at process start, from `launch`) to the first
    content chunk of a short streamed request sent now. Raises BenchmarkError if it fails."""
    async with make_client() as client:
        r = await send_request(client, url.rstrip("/"), model, BenchRequest("Hello", 4), endpoint)
    if not r.success:
        raise BenchmarkError(f"first request failed: {r.error}")
    return r.start + r.ttft - t0


# --- command line -------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None, prog: str = "jaxserve bench serve"
               ) -> argparse.Namespace:
    """The command line (vLLM benchmark_serving.py option names where they exist)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="API base URL of a running server (…/v1)")
    src.add_argument("--launch", action="store_true", help="start `jaxserve serve`, time its start")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="the server's config, a name or a path (--launch)")
    ap.add_argument("--cache-dir", help="the server's --cache-dir (--launch)")
    ap.add_argument("--model", help="model name to send (default: first id of GET /v1/models); "
                    "a comma-separated list spreads the requests over them in turn (LoRA "
                    "adapters)")
    ap.add_argument("--dataset", default=str(DEFAULT_DATASET), help="JSON-lines prompts file")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-concurrency", type=int, default=None, help="default: unlimited")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests/s; inf sends all at once, else Poisson arrivals")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of inter-arrival times (1: Poisson)")
    ap.add_argument("--output-len", type=int, default=None,
                    help="override every request's output length (tokens)")
    ap.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    ap.add_argument("--metric-percentiles", default="99",
                    help="comma-separated percentiles of TTFT/TPOT/ITL/E2EL to report")
    ap.add_argument("--result-json", help="write the full result (and per-request lists) here")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_args(argv)


async def main_async(args: argparse.Namespace) -> dict:
    """Launch (if asked), resolve the model, send the test request, run the benchmark."""
    requests = load_dataset(args.dataset, args.num_prompts, args.seed, args.output_len)
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    proc, extra = None, {}
    try:
        if args.launch:
            proc, args.url, t0 = launch(args.config, args.cache_dir)
            print(f"launched jaxserve serve (pid {proc.pid}, log {proc.log_path}); waiting ...",
                  file=sys.stderr)
            await wait_ready(args.url, proc)
        model = args.model or await get_model_id(args.url)
        if "," in model:
            model = [m.strip() for m in model.split(",") if m.strip()]
        if args.launch:
            extra["start_to_first_token_s"] = round(
                await start_to_first_token(args.url, model, t0, args.endpoint), 2)
        print(f"model {model} at {args.url}; initial test run ...", file=sys.stderr)
        for m in ([model] if isinstance(model, str) else model):
            await check_server(args.url, m, requests[0], args.endpoint)
        result = await run_benchmark(args.url, model, requests, args.max_concurrency,
                                     args.request_rate, args.seed, args.endpoint,
                                     not args.no_progress, burstiness=args.burstiness,
                                     percentiles=percentiles)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    result |= extra
    result["config"] |= {"dataset": str(args.dataset), "output_len": args.output_len,
                         "launch": args.launch, "launch_config": args.config if args.launch else None}
    return result


def main(argv: list[str] | None = None, prog: str = "jaxserve bench serve") -> int:
    """Command-line entry point; returns the exit status (1 on error or if no request
    completed)."""
    args = parse_args(argv, prog)
    try:
        result = asyncio.run(main_async(args))
    except (BenchmarkError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print_summary(result)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
