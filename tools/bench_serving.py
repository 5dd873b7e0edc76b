"""Measure a jaxserve (or any OpenAI-compatible) server through HTTP.

    python tools/bench_serving.py --launch [--config configs/smollm2_135m.py] [--cache-dir DIR]
    python tools/bench_serving.py --url http://127.0.0.1:8000/v1

Figures (streaming /v1/completions, ignore_eos, so every request yields max_tokens tokens):
  start_to_first_token_s  process start -> first streamed token (with --launch only)
  single_stream_tok_s     decode tokens/s of one stream: (n - 1) / (t_last - t_first)
  concurrent_tok_s        output tokens/s of N concurrent streams, end to end
  batching_gain           concurrent_tok_s / single_stream_tok_s (baseline in this run)
  ttft_512_s              time to first token of a 512-token prompt (median of 3)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt,
                            max_tokens: int) -> list[float]:
    """Send one streaming completion; return the arrival time of each token chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    async with client.stream("POST", f"{url}/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                    times.append(time.perf_counter())
    return times


async def measure(url: str, model: str, concurrency: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_completion(client, url, model, "Warm up", 4)
        # single stream
        t = await stream_completion(client, url, model, "Tell me a long story about a dragon.",
                                    max_tokens)
        single = (len(t) - 1) / (t[-1] - t[0])
        # N concurrent streams, different prompts
        prompts = [f"Write an essay about topic number {i}: the history of the number {i}."
                   for i in range(concurrency)]
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(stream_completion(client, url, model, p, max_tokens)
                                      for p in prompts))
        wall = time.perf_counter() - t0
        concurrent = sum(len(r) for r in runs) / wall
        # TTFT of a 512-token prompt (token ids, so its length is exact)
        ids = [(i * 7919) % 40000 + 100 for i in range(512)]
        ttfts = []
        for _ in range(3):
            t0 = time.perf_counter()
            t = await stream_completion(client, url, model, ids, 1)
            ttfts.append(t[0] - t0)
    return {"single_stream_tok_s": round(single, 1), "concurrency": concurrency,
            "concurrent_tok_s": round(concurrent, 1),
            "batching_gain": round(concurrent / single, 2),
            "ttft_512_s": round(statistics.median(ttfts), 3)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, cache_dir: str | None, log_path: Path) -> tuple[subprocess.Popen, str, float]:
    """Start serve.py; return (process, base url, process start time)."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "serve.py"), "--config", config, "--port", str(port)]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}/v1", t0


async def first_token_after_start(url: str, model: str, proc: subprocess.Popen, t0: float) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            try:
                if (await client.get(url.rsplit("/v1", 1)[0] + "/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
        t = await stream_completion(client, url, model, "Hello", 1)
    return t[0] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="base URL of a running server (…/v1)")
    ap.add_argument("--launch", action="store_true", help="start serve.py and time its start")
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m.py"))
    ap.add_argument("--cache-dir")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    if not args.url and not args.launch:
        ap.error("give --url or --launch")
    result, proc = {}, None
    try:
        if args.launch:
            log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_serving_{os.getpid()}.log"
            proc, args.url, t0 = launch(args.config, args.cache_dir, log)
            result["start_to_first_token_s"] = round(
                asyncio.run(first_token_after_start(args.url, args.model, proc, t0)), 1)
        result |= asyncio.run(measure(args.url, args.model, args.concurrency, args.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
