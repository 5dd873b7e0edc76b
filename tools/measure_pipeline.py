"""The pipeline bubble of the real model: stage utilisation with M microbatches over PP
stages, from measured stage times.

    python -m tools.measure_pipeline [--stages 2,4] [--microbatches 1,2,4,8]
        [--decode-seqs 16] [--prefill-tokens 512] [--context 256] [--iters 20]

A pipelined step (jaxserve.model.pipeline) runs M + PP - 1 ticks; in each, every stage
runs its ceil(L / PP) layers on one microbatch of T / M rows. On PP devices running at
the same time the step takes (M + PP - 1) x tau, tau = one stage's layers on one
microbatch, where one device runs all L layers on all T rows in B. The stage
utilisation is then B / (PP x (M + PP - 1) x tau): the schedule's M / (M + PP - 1) when
a microbatch costs 1 / M of the batch, less when smaller microbatches use the device
worse (decode, whose weights are read once per tick whatever the rows).

This tool measures B and tau on one device (the layers alone: the embedding, LM head and
sampler run once per step outside the pipeline), with the real microbatches of
split_microbatches and the engine's default kernels, and prints both utilisations and
the speedup over one device (PP x utilisation; the stage hand-offs, one [T / M, hidden]
ppermute per tick, are not counted). Why not time the pipelined program on simulated
CPU devices: they share this machine's two cores and XLA:CPU's thread pools, and hand
off through in-process rendezvous, so their wall time measures contention (PERFORMANCE.md,
"Pipeline parallel"); tests/test_tensor_parallel.py checks that program's outputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(args) -> dict:
    import time

    import jax
    import numpy as np

    from jaxserve.engine.builder import resolve_model_config
    from jaxserve.checkpoint import load_params
    from jaxserve.config import load_config
    from jaxserve.worker.kernel_selection import prepare_params, resolve_kernel_config, select_kernels
    from jaxserve.model.kv_cache import init_kv_cache
    from jaxserve.model.pipeline import layers_per_stage, split_microbatches
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.transformer import _decoder_layers
    from jaxserve.checkpoint.sources import default_cache_dir

    config = load_config(ROOT / "configs" / "smollm2_135m.py")
    if args.kernels != "auto":
        config = config.override(attention_impl=args.kernels, matmul_impl=args.kernels)
    cache_dir = default_cache_dir()
    cfg, ckpt = resolve_model_config(config, cache_dir)
    kcfg = resolve_kernel_config(config.engine.kernels, "cpu", cfg.dtype)
    kernels = select_kernels(kcfg, "cpu", 1, cfg.dtype, cache_dir / "kernels")
    params = prepare_params(load_params(ckpt, cfg), kcfg, kernels)
    L, ps, C = cfg.num_layers, 16, args.context
    S_dec, T_pre = args.decode_seqs, args.prefill_tokens
    per_seq = (C + T_pre) // ps + 1
    S_max = max(S_dec, 4)
    tables = np.arange(1, 1 + S_max * per_seq, dtype=np.int32).reshape(S_max, per_seq)

    def decode_batch():
        pos = np.full(S_dec, C - 1, np.int32)
        return StepBatch(tokens=np.arange(S_dec, dtype=np.int32) + 100, positions=pos,
                         slot_mapping=tables[:S_dec, (C - 1) // ps] * ps + (C - 1) % ps,
                         block_tables=tables[:S_dec], seq_lens=pos + 1,
                         query_start=np.arange(S_dec + 1, dtype=np.int32),
                         logits_indices=np.arange(S_dec, dtype=np.int32), decode=True)

    def prefill_batch():
        n = T_pre // 4
        pos = np.tile(np.arange(n, dtype=np.int32), 4)
        seq = np.repeat(np.arange(4), n)
        return StepBatch(tokens=np.arange(T_pre, dtype=np.int32) % 1000 + 100, positions=pos,
                         slot_mapping=tables[seq, pos // ps] * ps + pos % ps,
                         block_tables=tables[:4], seq_lens=np.full(4, n, np.int32),
                         query_start=np.arange(5, dtype=np.int32) * n,
                         logits_indices=np.arange(1, 5, dtype=np.int32) * n - 1)

    def layers_time(n: int, batch: StepBatch) -> float:
        """Median seconds of n decoder layers over `batch` (its K/V written to a pool of n
        layers, donated) on one device."""
        cache = init_kv_cache(cfg.replace(num_layers=n), 1 + S_max * per_seq, ps, cfg.dtype,
                              None, kernels.attention.kv_layout)
        x = jax.random.normal(jax.random.key(0), (batch.tokens.shape[0], cfg.hidden_size),
                              cfg.dtype) * 0.1
        run = jax.jit(lambda lps, c, b, x: _decoder_layers(x, lps, c, b, cfg, None, kernels),
                      donate_argnums=1)
        lps = params.layers[:n]
        y, cache = run(lps, cache, batch, x)
        jax.block_until_ready(y)
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            y, cache = run(lps, cache, batch, x)
            jax.block_until_ready(y)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def microbatch(batch: StepBatch, M: int) -> StepBatch:
        mb = split_microbatches(jax.tree.map(jax.numpy.asarray, batch), M)
        return jax.tree.map(lambda a: np.asarray(a[0]), mb)  # the first: all have its shape

    rows = []
    for kind, batch in (("decode", decode_batch()), ("prefill", prefill_batch())):
        base = layers_time(L, batch)
        for pp in args.stages:
            lp = layers_per_stage(L, pp)
            for M in args.microbatches:
                rows.append({"kind": kind, "pp": pp, "m": M, "layers": lp, "base": base,
                             "tau": layers_time(lp, microbatch(batch, M))})
    return {"rows": rows, "decode_seqs": S_dec, "prefill_tokens": T_pre, "context": C,
            "kernels": [kernels.attention.name, kernels.matmul.name], "dtype": cfg.dtype,
            "layers": L}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2,4", help="pipeline stage counts (PP)")
    ap.add_argument("--microbatches", default="1,2,4,8")
    ap.add_argument("--decode-seqs", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kernels", default="auto", choices=("auto", "xla", "cpu"),
                    help="attention and matmul implementations (default: the config's)")
    args = ap.parse_args(argv)
    args.stages = [int(p) for p in args.stages.split(",")]
    args.microbatches = [int(m) for m in args.microbatches.split(",")]
    r = measure(args)
    print(f"SmolLM2-135M ({r['layers']} layers, {r['dtype']}), kernels {r['kernels']}; decode "
          f"{r['decode_seqs']} seqs at context {r['context']}, prefill {r['prefill_tokens']} "
          "tokens (4 prompts)")
    print(f"{'step':8} {'PP':>3} {'M':>3} {'layers/stage':>12} {'B ms':>8} {'tau ms':>8} "
          f"{'schedule util':>14} {'measured util':>14} {'speedup':>8}")
    for row in r["rows"]:
        pp, m = row["pp"], row["m"]
        util = row["base"] / (pp * (m + pp - 1) * row["tau"])
        print(f"{row['kind']:8} {pp:>3} {m:>3} {row['layers']:>12} {row['base'] * 1e3:>8.2f} "
              f"{row['tau'] * 1e3:>8.2f} {m / (m + pp - 1):>14.2f} {util:>14.2f} "
              f"{pp * util:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
