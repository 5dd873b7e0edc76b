"""How a long prompt disturbs the streams decoding beside it, with chunked prefill and
without: the ratio to print is each run's longest pause during the prompt's prefill over
the longest pause before it arrived (PERFORMANCE.md, "Scheduling: chunked prefill and
prefix caching").

    python -m tools.bench_chunked_prefill [--config configs/smollm2_135m.py] [--streams 16]
        [--prompt-tokens 1900] [--json out.json]

For each mode (`--enable-chunked-prefill`, then `--no-enable-chunked-prefill
--max-num-batched-tokens MAX_MODEL_LEN`), one after the other on an otherwise idle
machine: launch serve.py, wait for its warm-up, start `--streams` streaming completions
(short prompts, long outputs), let them run `--settle` seconds, then send one prompt of
about `--prompt-tokens` tokens (4 output tokens). Reported per mode, over the streams:
- pause_before_ms: the longest gap between SSE content events in the `--settle` / 2
  seconds before the long prompt was sent;
- pause_during_ms: the longest gap that overlaps the prompt's prefill (sent -> its first
  token);
- ratio = during / before; the long prompt's TTFT; the streams' p50 / p99 ITL.
Gaps are between SSE events, so with multi-step decode (decode_steps tokens per event
while no request waits) the "before" pause is one burst. The streams ask for
`skip_special_tokens: false`: under ignore_eos a story that has ended goes on in end-of-text
tokens, and with their text skipped a stream got no event for whole bursts, a gap of two
or more steps that counted as a pause wherever it fell (session 39: 1.0-1.2 s "pauses"
in 3 of 4 runs, every step 0.3-0.6 s).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np

from jaxserve.bench.serve import (BenchRequest, BenchmarkError, DEFAULT_CONFIG, get_model_id,
                                  launched_server, make_client, run_tool, send_request, word_prompt)


def event_times(result) -> list[float]:
    """Absolute times (time.perf_counter) of a stream's content events."""
    t = result.start + result.ttft
    times = [t]
    for gap in result.itl:
        t += gap
        times.append(t)
    return times


def longest_gap(times: list[float], lo: float, hi: float) -> float:
    """The longest gap between successive events that overlaps [lo, hi] (seconds)."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= lo and a <= hi]
    return max(gaps, default=0.0)


async def measure(url: str, streams: int, stream_tokens: int, prompt_tokens: int,
                  settle_s: float) -> dict:
    """One run against a ready server; see the module docstring."""
    model = await get_model_id(url)
    async with make_client(streams + 1) as client:
        # special tokens' text kept (skip_special_tokens: see the module docstring)
        tasks = [asyncio.create_task(send_request(
            client, url, model, BenchRequest(f"Story {i}: once upon a time", stream_tokens),
            extra={"skip_special_tokens": False})) for i in range(streams)]
        await asyncio.sleep(settle_s)
        long = await send_request(client, url, model,
                                  BenchRequest(word_prompt(prompt_tokens - 1), 4))
        results = await asyncio.gather(*tasks)
    if not long.success or not all(r.success for r in results):
        errors = [r.error for r in [long, *results] if not r.success]
        raise BenchmarkError(f"requests failed: {errors[:3]}")
    sent, first = long.start, long.start + long.ttft
    before = max(longest_gap(event_times(r), sent - settle_s / 2, sent) for r in results)
    during = max(longest_gap(event_times(r), sent, first) for r in results)
    if event_times(results[0])[-1] < first:
        raise BenchmarkError("the streams ended before the long prompt's first token: "
                             "raise --stream-tokens")
    itl = np.array([g for r in results for g in r.itl]) * 1e3
    return {"pause_before_ms": round(before * 1e3, 1), "pause_during_ms": round(during * 1e3, 1),
            "ratio": round(during / before, 2) if before else None,
            "long_prompt_tokens": long.prompt_len, "long_ttft_ms": round(long.ttft * 1e3, 1),
            "itl_p50_ms": round(float(np.percentile(itl, 50)), 1),
            "itl_p99_ms": round(float(np.percentile(itl, 99)), 1)}


async def run_mode(args, name: str, extra: list[str]) -> dict:
    async with launched_server(args.config, args.cache_dir, extra) as url:
        result = await measure(url, args.streams, args.stream_tokens, args.prompt_tokens,
                               args.settle)
    print(f"{name:>10}: pause before {result['pause_before_ms']:7.1f} ms, during prefill "
          f"{result['pause_during_ms']:7.1f} ms = {result['ratio']}x; long prompt "
          f"({result['long_prompt_tokens']} tokens) TTFT {result['long_ttft_ms']:.0f} ms; "
          f"ITL p50 {result['itl_p50_ms']} ms, p99 {result['itl_p99_ms']} ms", flush=True)
    return result


async def main_async(args) -> dict:
    from jaxserve.config import load_config
    max_model_len = load_config(args.config).engine.max_model_len
    out = {"chunked": await run_mode(args, "chunked", ["--enable-chunked-prefill"])}
    out["unchunked"] = await run_mode(args, "unchunked", [
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len)])
    c, u = out["chunked"], out["unchunked"]
    print(f"chunked / unchunked: longest pause {c['pause_during_ms'] / u['pause_during_ms']:.2f}x, "
          f"ITL p99 {c['itl_p99_ms'] / u['itl_p99_ms']:.2f}x, long TTFT "
          f"{c['long_ttft_ms'] / u['long_ttft_ms']:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--cache-dir")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-tokens", type=int, default=600,
                    help="output tokens of each stream (they must outlast the long prompt)")
    ap.add_argument("--prompt-tokens", type=int, default=1900)
    ap.add_argument("--settle", type=float, default=6.0,
                    help="seconds the streams run before the long prompt is sent")
    ap.add_argument("--json", help="write the results here")
    return run_tool(main_async, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
