"""Resident memory and warm-up time of an engine, with its layers unrolled (the baseline) and
as a loop (CompilationConfig.layer_loop), each built in a process of its own.

    python -m tools.bench_memory [--config smollm2_135m] [--max-num-seqs 32]
        [--kv-cache-memory-bytes N] [--malloc-arena-max N] [--json OUT]

Per variant: the seconds `jaxserve.LLM(config, warmup=True)` takes (load, every warm-up step
shape compiled and run once; the persistent compilation cache off, so every run compiles),
the number of step shapes, and VmRSS after it (MB), then the loop's ratio to the unrolled
engine's. --kv-cache-memory-bytes sizes the pool as another server's (llama-server -c 65536
with f16 K/V holds 1,509,949,440 bytes for SmolLM2: PERFORMANCE.md, "Against llama.cpp in
its own formats"); --malloc-arena-max sets glibc's MALLOC_ARENA_MAX in both processes.

A benchmark, not a test: run it alone on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time
import jax
jax.config.update("jax_enable_compilation_cache", False)
import jaxserve
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
llm = jaxserve.LLM(args["config"], warmup=True, max_num_seqs=args["max_num_seqs"],
                   layer_loop=args["layer_loop"], **args["overrides"])
seconds = time.perf_counter() - t0
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
print(json.dumps({"seconds": seconds, "rss_mb": rss, "shapes": len(llm.engine.runner._compiled),
                  "looped": llm.engine.runner.cache.stacked}))
"""


def measure(config: str, layer_loop: bool, max_num_seqs: int, overrides: dict,
            arena_max: int | None) -> dict:
    """One engine built and warmed up in a fresh process: {seconds, rss_mb, shapes,
    looped}. Raises RuntimeError with the child's stderr if it fails."""
    env = dict(os.environ)
    if arena_max is not None:
        env["MALLOC_ARENA_MAX"] = str(arena_max)
    arg = json.dumps({"config": config, "layer_loop": layer_loop, "max_num_seqs": max_num_seqs,
                      "overrides": overrides})
    proc = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the layer_loop={layer_loop} engine failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="smollm2_135m")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-cache-memory-bytes", type=int)
    ap.add_argument("--malloc-arena-max", type=int)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    overrides = {}
    if args.kv_cache_memory_bytes is not None:
        overrides["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    rows = {}
    for name, loop in (("unrolled", False), ("loop", True)):
        rows[name] = measure(args.config, loop, args.max_num_seqs, overrides,
                             args.malloc_arena_max)
        r = rows[name]
        print(f"{name:>9}: warm-up {r['seconds']:6.1f} s, {r['shapes']} step shapes, "
              f"RSS {r['rss_mb']:7.0f} MB (layers looped: {r['looped']})", flush=True)
    base, var = rows["unrolled"], rows["loop"]
    print(f"loop / unrolled: warm-up {var['seconds'] / base['seconds']:.2f}x, "
          f"RSS {var['rss_mb'] / base['rss_mb']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
