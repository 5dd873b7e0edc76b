"""The memory-bandwidth bound of single-stream decode on this machine.

    python -m tools.membw [--config configs/smollm2_135m.py] [--gib 1] [--repeats 7]
        [--samples 1] [--interval 1.0]

Decoding one stream reads every weight once per token, so tokens/s cannot exceed
(read bandwidth) / (weight bytes per token). This measures the read bandwidth as the
median of `repeats` XLA reductions over a `gib`-GiB f32 array (far larger than any cache,
all cores: XLA:CPU splits the reduction over its threads), `samples` times `interval`
seconds apart, and takes the median sample (on the project's VMs the read bandwidth
jumps between ~31 and ~50 GB/s for seconds at a time, and a single sample can catch a
burst that no workload running over minutes sees), counts the bytes the engine
reads per token in the weight format the config serves (bf16 for the C++ matmul and XLA
bf16 copies, else the model dtype or the int8 / fp8 quantised projections), and prints
both and the bound as JSON. tools/bench_peers.py runs it before the peers and reports the
single-stream decode rate as a fraction of the bound. K/V reads (small next to the
weights for short contexts) and activations are not counted, so the bound is optimistic.
A benchmark, not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def weight_bytes_per_token(model, engine) -> dict[str, int]:
    """Bytes of weights one decode step of one sequence reads, by part: the layers'
    projections and the LM head (norm weights and the one embedding row are negligible
    and left out). model: ModelConfig; engine: EngineConfig (its bf16_matmul_min_rows /
    weight_quant pick the format)."""
    from jaxserve.model.params import param_specs
    from jaxserve.model.linear import PROJECTIONS

    spec = param_specs(model).layers[0]
    layer = sum(math.prod(getattr(spec, name).shape) for name in PROJECTIONS)
    D, V = model.hidden_size, model.vocab_size
    itemsize = 4 if model.dtype == "float32" else 2
    proj = head = itemsize
    if engine.kernels.bf16_matmul_min_rows == 1:  # decode (1 row) uses the bf16 copies
        proj = head = 2
    elif engine.kernels.weight_quant is not None:  # int8 / fp8 projections, head in the model dtype
        proj = 1
    return {"layers": model.num_layers * layer * proj, "lm_head": V * D * head}


def read_bandwidth_gb_s(gib: float = 1.0, repeats: int = 7, samples: int = 1,
                        interval_s: float = 1.0) -> list[float]:
    """Read bandwidth samples in GB/s (1e9 bytes/s), `samples` of them `interval_s` seconds
    apart, each the median of `repeats` XLA sums over a gib-GiB f32 array."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // 4
    x = jnp.ones((n,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    out = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            total(x).block_until_ready()
            rates.append(n * 4 / (time.perf_counter() - t0) / 1e9)
        out.append(statistics.median(rates))
    return out


def bound_from_samples(samples_gb_s: list[float], weight_bytes: dict[str, int]) -> dict:
    """{"read_gb_s" (the median sample), "samples_gb_s", "weight_bytes", "bytes_per_token",
    "bound_tok_s"} from bandwidth samples and the weight bytes read per token by part."""
    per_token = sum(weight_bytes.values())
    bw = statistics.median(samples_gb_s)
    return {"read_gb_s": round(bw, 2), "samples_gb_s": [round(x, 2) for x in samples_gb_s],
            "weight_bytes": weight_bytes, "bytes_per_token": per_token,
            "bound_tok_s": round(bw * 1e9 / per_token, 1)}


def bound(config_path: str, gib: float = 1.0, repeats: int = 7, samples: int = 1,
          interval_s: float = 1.0) -> dict:
    """`bound_from_samples` of `samples` bandwidth samples and the weights `config_path`
    serves."""
    from jaxserve.checkpoint import load_model_config
    from jaxserve.config import load_config
    from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint

    cfg = load_config(config_path)
    model = cfg.model
    if model is None:
        model = load_model_config(resolve_checkpoint(cfg.source, default_cache_dir()))
    if cfg.dtype is not None:
        model = model.replace(dtype=cfg.dtype)
    parts = weight_bytes_per_token(model, cfg.engine)
    return bound_from_samples(read_bandwidth_gb_s(gib, repeats, samples, interval_s), parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m.py"))
    ap.add_argument("--gib", type=float, default=1.0, help="size of the array read (GiB)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--samples", type=int, default=1, help="bandwidth samples (median taken)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.repeats < 1:
        ap.error("--samples and --repeats must be >= 1")
    print(json.dumps(bound(args.config, args.gib, args.repeats, args.samples, args.interval)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
