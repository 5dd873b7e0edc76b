"""What serving LoRA adapters costs: the output tok/s of `--streams` concurrent streams
spread over `--adapters` adapters, over the same streams on the base model without LoRA
(issue 31's target: >= 0.8x), and what loading an adapter at run time costs (its POST
/v1/load_lora_adapter time, target < 1 s, and the longest gap between two tokens of a
running stream while it loads, against that run's median inter-token latency).

    python -m tools.bench_lora [--config smollm2_135m] [--adapters 4] [--rank 16]
        [--streams 32] [--output-len 256] [--rounds 5] [--json out.json]

Two servers on an otherwise idle machine, both started and warmed up: serve.py as
configured (the base), and with `--enable-lora --max-loras ADAPTERS --max-lora-rank RANK
--lora-modules a0=... a1=...`; random adapters of rank RANK over all seven projections
(jaxserve.lora.dummy: a trained adapter's cost), written for the config's model shape.
`--rounds` times, the base then the LoRA server (the other one idle) get the same
prompts (the benchmark dataset's, new ones each round), all streams at once, each
`--output-len` tokens (ignore_eos); with LoRA request i names adapter i % ADAPTERS. The
ratio printed is the median of the rounds' (the VM's memory bandwidth drifts over
minutes: PERFORMANCE.md). Then, with LoRA, the streams again while an extra adapter is
loaded `--load-after` seconds in.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.bench.serve import (BenchmarkError, DEFAULT_CONFIG, launched_server, load_dataset,
                                  make_client, run_benchmark, run_tool)


def model_shape(config: str, cache_dir: str | None):
    """The served model's ModelConfig (its checkpoint fetched / converted if needed)."""
    from jaxserve.config import load_config
    from jaxserve.engine.builder import resolve_model_config
    from jaxserve.checkpoint.sources import default_cache_dir
    cfg = load_config(config)
    model, _ = resolve_model_config(cfg, Path(cache_dir) if cache_dir else default_cache_dir())
    return model.replace(dtype=cfg.dtype) if cfg.dtype else model


def token_times(result: dict) -> list[np.ndarray]:
    """Each request's content-chunk times (s, the benchmark's clock)."""
    out = []
    for start, ttft, itl in zip(result["send_times"], result["ttfts"], result["itls"]):
        if ttft is not None:
            out.append(start + ttft + np.concatenate([[0.0], np.cumsum(itl or [])]))
    return out


async def run(url: str, models, args, seed: int) -> dict:
    requests = load_dataset(num_prompts=args.streams, seed=seed, output_len=args.output_len)
    result = await run_benchmark(url, models, requests, progress=False)
    if result["completed"] != args.streams:
        raise BenchmarkError(f"requests failed: {list(result['errors'].items())[:3]}")
    return result


async def load_during_run(url: str, models, path: Path, args) -> dict:
    """The streams again, an adapter loaded `load_after` s in: its load time (s) and the
    longest gap between two tokens of one stream around it, vs the run's median ITL."""
    async def load():
        await asyncio.sleep(args.load_after)
        async with make_client() as client:
            t0 = time.perf_counter()
            r = await client.post(url.replace("/v1", "") + "/v1/load_lora_adapter",
                                  json={"lora_name": "late", "lora_path": str(path)})
            t1 = time.perf_counter()
        if r.status_code != 200:
            raise BenchmarkError(f"load_lora_adapter: {r.status_code} {r.text[:200]}")
        return t0, t1

    t_bench = time.perf_counter()
    result, (t0, t1) = await asyncio.gather(run(url, models, args, args.seed + 999), load())
    # the benchmark's send_times count from its own t0 (just after t_bench)
    times = token_times(result)
    gaps = [float(np.max(np.diff(t[(t >= t0 - t_bench - 1) & (t <= t1 - t_bench + 1)])))
            for t in times if np.sum((t >= t0 - t_bench - 1) & (t <= t1 - t_bench + 1)) > 1]
    itl = result["median_itl_ms"]
    return {"load_s": round(t1 - t0, 3), "max_itl_around_load_ms": round(max(gaps) * 1e3, 1),
            "median_itl_ms": round(itl, 1), "output_tok_s": round(result["output_throughput"], 1)}


async def main_async(args) -> dict:
    cfg = model_shape(args.config, args.cache_dir)
    from jaxserve.lora.dummy import MODULES, write_peft_adapter
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    names = [f"a{i}" for i in range(args.adapters)]
    paths = {n: write_peft_adapter(tmp / n, cfg, r=args.rank, alpha=2 * args.rank,
                                   modules=MODULES, seed=i) for i, n in enumerate(names)}
    late = write_peft_adapter(tmp / "late", cfg, r=args.rank, seed=99)
    flags = ["--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank",
             str(args.rank), "--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
    out = {"runs": []}
    # both servers up at once (the idle one sleeps), the workload alternating between them
    # with new prompts each round (cold prefix caches): the VM's slow and fast phases fall
    # on both alike
    async with launched_server(args.config, args.cache_dir) as base_url, \
            launched_server(args.config, args.cache_dir, flags) as lora_url:
        for i in range(args.rounds):
            base = await run(base_url, None, args, args.seed + i)
            lora = await run(lora_url, names, args, args.seed + i)
            r = {"base_tok_s": round(base["output_throughput"], 1),
                 "lora_tok_s": round(lora["output_throughput"], 1),
                 "ratio": round(lora["output_throughput"] / base["output_throughput"], 3),
                 "median_itl_ms": {"base": round(base["median_itl_ms"], 1),
                                   "lora": round(lora["median_itl_ms"], 1)}}
            out["runs"].append(r)
            print(f"round {i + 1}: base {r['base_tok_s']} output tok/s, {args.streams} streams "
                  f"over {args.adapters} adapters of rank {args.rank} {r['lora_tok_s']} = "
                  f"{r['ratio']:.2f}x (median ITL {r['median_itl_ms']['base']} / "
                  f"{r['median_itl_ms']['lora']} ms)", flush=True)
        out["load"] = await load_during_run(lora_url, names, late, args)
    out["ratio"] = round(float(np.median([r["ratio"] for r in out["runs"]])), 3)
    print(f"LoRA / base output tok/s, median of {args.rounds} rounds: {out['ratio']:.2f}x",
          flush=True)
    ld = out["load"]
    print(f"loading an adapter while the streams run: {ld['load_s']:.3f} s; the longest "
          f"inter-token gap around it {ld['max_itl_around_load_ms']:.1f} ms (median ITL "
          f"{ld['median_itl_ms']:.1f} ms = {ld['max_itl_around_load_ms'] / ld['median_itl_ms']:.2f}x)",
          flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--cache-dir")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--load-after", type=float, default=8.0,
                    help="seconds into the streams (past their prompts: decode steps only)")
    ap.add_argument("--rounds", type=int, default=5, help="base / LoRA runs alternated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    return run_tool(main_async, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
