"""Offline batch inference against the server at the same concurrency: the ratio to print
is the batch runner's output tok/s over the server's (PERFORMANCE.md, "Offline batch inference").

    jaxserve bench batch [--config smollm2_135m] [--num-prompts 200]
        [--max-concurrency 32] [--endpoint completions] [--json out.json]

One workload, two runs, one after the other on an otherwise idle machine:
- server: `jaxserve serve` launched and warmed up, then `jaxserve bench serve`'s benchmark
  (streaming, every request at once, at most --max-concurrency in flight);
- batch: the same request bodies (not streamed) as an OpenAI Batch file through
  `jaxserve batch --max-concurrency C` (its own process, engine built and warmed
  up first).
Every request is greedy with ignore_eos, so both generate exactly the same number of tokens.
Throughput is output tokens over the time from the first request sent to the last
finished (bench_serving's duration; the batch runner's elapsed_s), engine start excluded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxserve.bench.serve import (DEFAULT_CONFIG, DEFAULT_DATASET, BenchmarkError, get_model_id,
                                  launched_server, load_dataset, request_body, run_benchmark,
                                  run_tool)


def batch_lines(requests, endpoint: str) -> list[str]:
    """The workload as OpenAI Batch input lines: bench_serving's bodies, not streamed."""
    url = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    lines = []
    for i, req in enumerate(requests):
        body = request_body(endpoint, None, req.prompt, req.output_len)
        body.pop("stream"), body.pop("stream_options")
        lines.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url,
                                 "body": body}))
    return lines


def run_batch_process(args, requests) -> dict:
    """`jaxserve batch` over the workload; its stats (the JSON line it prints)."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        inp.write_text("\n".join(batch_lines(requests, args.endpoint)) + "\n")
        cmd = [sys.executable, "-m", "jaxserve", "batch", "-i", str(inp), "-o", str(out),
               "--config", str(args.config), "--max-concurrency", str(args.max_concurrency),
               "--no-progress"]
        if args.cache_dir:
            cmd += ["--cache-dir", str(args.cache_dir)]
        print("batch: " + " ".join(cmd[1:]), file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchmarkError(f"the batch runner failed ({done.returncode}): "
                                 f"{done.stderr[-2000:]}")
        stats = json.loads(done.stdout.strip().splitlines()[-1])
        lines = out.read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 in JSON
        failed = [json.loads(x) for x in lines
                  if x.strip() and json.loads(x)["response"]["status_code"] != 200]
        if failed:
            raise BenchmarkError(f"{len(failed)} batch requests failed, e.g. {failed[0]}")
    return stats


async def main_async(args: argparse.Namespace) -> dict:
    requests = load_dataset(args.dataset, args.num_prompts, args.seed)
    print(f"server: serve.py --config {args.config}", file=sys.stderr)
    async with launched_server(args.config, args.cache_dir) as url:
        model = await get_model_id(url)
        server = await run_benchmark(url, model, requests, args.max_concurrency,
                                     endpoint=args.endpoint, progress=not args.no_progress)
    m = server
    if m["failed"]:
        raise BenchmarkError(f"{m['failed']} server requests failed: {server['errors']}")
    batch = run_batch_process(args, requests)
    ratio = batch["output_tokens_per_s"] / m["output_throughput"]
    print(f"\n{len(requests)} requests, concurrency {args.max_concurrency}, "
          f"{args.endpoint}", file=sys.stderr)
    print(f"  server: {m['total_output_tokens']} output tokens in {m['duration']:.1f} s = "
          f"{m['output_throughput']:.1f} tok/s")
    print(f"  batch:  {batch['completion_tokens']} output tokens in {batch['elapsed_s']:.1f} s"
          f" = {batch['output_tokens_per_s']:.1f} tok/s")
    print(f"  batch / server output throughput: {ratio:.3f}x (target >= 0.95)")
    if batch["completion_tokens"] != m["total_output_tokens"]:
        print(f"  note: token counts differ ({batch['completion_tokens']} vs "
              f"{m['total_output_tokens']})")
    return {"server": {k: m[k] for k in ("duration", "completed", "total_output_tokens",
                                         "output_throughput")},
            "batch": batch, "ratio": ratio,
            "config": {"config": str(args.config), "num_prompts": len(requests),
                       "max_concurrency": args.max_concurrency, "endpoint": args.endpoint}}


def parse_args(argv=None, prog: str = "jaxserve bench batch") -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--cache-dir")
    ap.add_argument("--dataset", default=str(DEFAULT_DATASET))
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", help="write the result here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None, prog: str = "jaxserve bench batch") -> int:
    """Command-line entry point; returns the exit status."""
    return run_tool(main_async, parse_args(argv, prog))


if __name__ == "__main__":
    sys.exit(main())
