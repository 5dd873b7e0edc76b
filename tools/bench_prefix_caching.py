"""What prefix caching buys when requests share a long system prompt: the ratios to print
are a hit's TTFT over a miss's and the aggregate output tok/s of 32 streams with caching
over without (PERFORMANCE.md, "Scheduling: chunked prefill and prefix caching").

    python -m tools.bench_prefix_caching [--config configs/smollm2_135m.py]
        [--system-tokens 1000] [--streams 32] [--output-len 64] [--json out.json]

Two runs, one after the other on an otherwise idle machine: serve.py with
`--enable-prefix-caching`, then with `--no-enable-prefix-caching`. In each, after the
warm-up:
- TTFT, alone: `--probes` requests each with a new system prompt of `--system-tokens`
  tokens and a short question (misses), and as many with the system prompt of an earlier
  one and another question (hits with caching on); the median of each;
- throughput: `--streams` concurrent streaming requests sharing one system prompt, each
  with its own question, `--output-len` tokens each: output tok/s over the run, and the
  server's prefix-cache counters (/health).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from jaxserve.bench.serve import (BenchRequest, BenchmarkError, DEFAULT_CONFIG,
                                  fetch_server_counters, get_model_id, launched_server, make_client,
                                  run_tool, send_request, word_prompt)
QUESTIONS = ("What is a river?", "Name a planet.", "Why is the sky blue?", "Count to five.",
             "What is bread made of?", "Describe a violin.", "What is a ledger?",
             "Where do orchids grow?")


def system_prompt(num_tokens: int, seed: int) -> str:
    """About `num_tokens` SmolLM2 tokens of words after "System:"."""
    return "System: " + word_prompt(num_tokens - 2, seed) + "\n"


async def ttft(client, url, model, prompt: str) -> float:
    r = await send_request(client, url, model, BenchRequest(prompt, 2))
    if not r.success:
        raise BenchmarkError(f"request failed: {r.error}")
    return r.ttft


async def measure(url: str, args) -> dict:
    model = await get_model_id(url)
    async with make_client(args.streams + 1) as client:
        miss, hit = [], []
        for i in range(args.probes):
            system = system_prompt(args.system_tokens, seed=1000 + i)
            miss.append(await ttft(client, url, model, system + QUESTIONS[0]))
            hit.append(await ttft(client, url, model, system + QUESTIONS[1 + i % 7]))
        system = system_prompt(args.system_tokens, seed=1)
        before = await fetch_server_counters(client, url)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            send_request(client, url, model,
                         BenchRequest(system + f"Question {i}: " + QUESTIONS[i % 8],
                                      args.output_len))
            for i in range(args.streams)))
        duration = time.perf_counter() - t0
        after = await fetch_server_counters(client, url)
    if not all(r.success for r in results):
        raise BenchmarkError(f"requests failed: {[r.error for r in results if not r.success][:3]}")
    out = {"ttft_miss_ms": round(statistics.median(miss) * 1e3, 1),
           "ttft_hit_ms": round(statistics.median(hit) * 1e3, 1),
           "output_tok_s": round(sum(r.output_tokens for r in results) / duration, 1),
           "mean_ttft_streams_ms": round(statistics.mean(r.ttft for r in results) * 1e3, 1)}
    if before and after:
        for key in ("prefix_cache_queries", "prefix_cache_hits"):
            if key in after:
                out[key] = after[key] - before.get(key, 0)
    return out


async def run_mode(args, name: str, flag: str) -> dict:
    async with launched_server(args.config, args.cache_dir, [flag]) as url:
        result = await measure(url, args)
    print(f"{name:>9}: TTFT miss {result['ttft_miss_ms']:7.1f} ms, second request of a system "
          f"prompt {result['ttft_hit_ms']:7.1f} ms = {result['ttft_hit_ms'] / result['ttft_miss_ms']:.2f}x; "
          f"{args.streams} streams {result['output_tok_s']:.1f} output tok/s (mean TTFT "
          f"{result['mean_ttft_streams_ms']:.0f} ms); counters "
          f"{ {k: v for k, v in result.items() if k.startswith('prefix')} }", flush=True)
    return result


async def main_async(args) -> dict:
    out = {"cached": await run_mode(args, "cached", "--enable-prefix-caching"),
           "uncached": await run_mode(args, "uncached", "--no-enable-prefix-caching")}
    c, u = out["cached"], out["uncached"]
    print(f"hit / miss TTFT (caching on): {c['ttft_hit_ms'] / c['ttft_miss_ms']:.2f}x; "
          f"{args.streams}-stream output tok/s, cached / uncached: "
          f"{c['output_tok_s'] / u['output_tok_s']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--cache-dir")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--probes", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    return run_tool(main_async, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
