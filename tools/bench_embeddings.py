"""Embeddings: jaxserve's /v1/embeddings against llama.cpp's llama-server on the same Q4_1
GGUF of SmolLM2-135M-Instruct, both servers up, rounds alternating between them.

    python -m tools.bench_embeddings [--inputs 256] [--batch 16] [--concurrency 4]
                                     [--rounds 3] [--pooling mean] [--config configs/smollm2_135m.py]

Inputs: `--inputs` instruction prompts (tools.instruction_prompts, seed 7: chat questions,
paragraphs to summarise, code, other languages; ~10-120 tokens), sent `--batch` per request
with `--concurrency` requests in flight. Each round sends every input once; the figure is
inputs/s (and prompt tokens/s by each server's own count) over the round's wall time,
median of the rounds. Also printed: how far the vectors agree (cosine per input), against
llama.cpp's with one input per request and one request at a time (its unbatched path):
both pool the final hidden states of the same weights, so they should agree to the
quantised arithmetic's precision, in any batch. (Measured 2026-11-26: jaxserve's agree with
them to 0.9999 in batches of 16; llama-server's own batched vectors do not, down to 0.65:
PERFORMANCE.md, "Embeddings".)

jaxserve runs `serve.py --config CONFIG --pooling POOLING` (the Q4_1 blocks the default
config serves); llama-server runs with `--embeddings --pooling POOLING` (normalised, its
default), -np `--concurrency` slots, 2 threads, batch and ubatch 2048. llama.cpp is built
from the llama-cpp-python sdist as tools/bench_peers.py builds it (cached under
~/.cache/jaxserve/peers). Run nothing else meanwhile: the ratio is only as good as the
machine's quiet.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from tools.instruction_prompts import build as build_prompts
from tools.peers.common import Server, default_cache_dir, free_port
from tools.peers.llamacpp import llama_server_cmd, setup_llamacpp, setup_q4_1_gguf

ROOT = Path(__file__).resolve().parent.parent


async def _round(url: str, batches: list[list[str]], concurrency: int
                 ) -> tuple[float, int, list[list[float]]]:
    """Send every batch (at most `concurrency` requests at once); (wall seconds, prompt
    tokens the server counted, the vectors in input order)."""
    import httpx
    gate = asyncio.Semaphore(concurrency)
    out: list = [None] * len(batches)
    tokens = 0

    async def one(i: int, client) -> None:
        nonlocal tokens
        async with gate:
            r = await client.post(f"{url}/v1/embeddings",
                                  json={"input": batches[i]})
            r.raise_for_status()
            body = r.json()
            tokens += body["usage"]["prompt_tokens"]
            out[i] = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, client) for i in range(len(batches))))
        wall = time.perf_counter() - t0
    return wall, tokens, [v for b in out for v in b]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_embeddings",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="inputs per request")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pooling", choices=("mean", "last"), default="mean")
    ap.add_argument("--config", default="configs/smollm2_135m.py")
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = ap.parse_args(argv)

    texts = [p["prompt"] for p in build_prompts(args.inputs, seed=7)]
    batches = [texts[i:i + args.batch] for i in range(0, len(texts), args.batch)]
    llama = setup_llamacpp(args.cache_dir)
    gguf = setup_q4_1_gguf(args.cache_dir)
    logs = args.cache_dir / "logs"
    jport, lport = free_port(), free_port()
    jax_cmd = [sys.executable, "serve.py", "--config", args.config, "--port", str(jport),
               "--pooling", args.pooling]
    llama_cmd = llama_server_cmd(llama.bins["llama-server"], gguf, lport, args.concurrency,
                                 2048, threads=2) + [
        "--embeddings", "--pooling", args.pooling, "-b", "2048", "-ub", "2048"]
    servers = {"jaxserve": f"http://127.0.0.1:{jport}", "llama.cpp": f"http://127.0.0.1:{lport}"}
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in servers}
    vectors: dict[str, list] = {}
    with Server("jaxserve", jax_cmd, logs / "embeddings-jaxserve.log",
                f"{servers['jaxserve']}/health", cwd=ROOT), \
            Server("llama.cpp", llama_cmd, logs / "embeddings-llamacpp.log",
                   f"{servers['llama.cpp']}/health"):
        for name, url in servers.items():  # a warm-up round each (not counted)
            vectors[name] = asyncio.run(_round(url, batches, args.concurrency))[2]
        alone = [[t] for t in texts]  # the reference: llama.cpp unbatched, and jaxserve's
        vectors["llama.cpp alone"] = asyncio.run(_round(servers["llama.cpp"], alone, 1))[2]
        vectors["jaxserve alone"] = asyncio.run(_round(servers["jaxserve"], alone, 1))[2]
        for r in range(args.rounds):
            for name in (servers if r % 2 == 0 else reversed(list(servers))):
                wall, tokens, _ = asyncio.run(_round(servers[name], batches, args.concurrency))
                results[name].append((wall, tokens))
                print(f"[round {r + 1}] {name}: {len(texts) / wall:.1f} inputs/s, "
                      f"{tokens / wall:.0f} prompt tok/s ({wall:.2f} s)", flush=True)

    def rate(name: str) -> tuple[float, float]:
        walls = [w for w, _ in results[name]]
        wall = statistics.median(walls)
        tokens = results[name][0][1]
        return len(texts) / wall, tokens / wall

    (j_in, j_tok), (l_in, l_tok) = rate("jaxserve"), rate("llama.cpp")
    def cos(x: str, y: str) -> str:
        a, b = np.asarray(vectors[x]), np.asarray(vectors[y])
        c = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        return f"min {c.min():.4f}, median {np.median(c):.4f}"

    print(f"\n{len(texts)} inputs, {args.batch} per request, {args.concurrency} in flight, "
          f"pooling {args.pooling}, median of {args.rounds} rounds")
    print(f"{'':10s} {'inputs/s':>9s} {'prompt tok/s':>13s}")
    print(f"{'jaxserve':10s} {j_in:9.1f} {j_tok:13.0f}")
    print(f"{'llama.cpp':10s} {l_in:9.1f} {l_tok:13.0f}")
    print(f"jaxserve / llama.cpp inputs/s: {j_in / l_in:.2f}x")
    print("cosine per input, against llama.cpp one input at a time:")
    print(f"  jaxserve (batched)   {cos('jaxserve', 'llama.cpp alone')}")
    print(f"  jaxserve (alone)     {cos('jaxserve alone', 'llama.cpp alone')}")
    print(f"  llama.cpp (batched)  {cos('llama.cpp', 'llama.cpp alone')}")
    print(f"jaxserve batched vs alone: {cos('jaxserve', 'jaxserve alone')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
