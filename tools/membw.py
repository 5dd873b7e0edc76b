"""The memory-bandwidth bound of single-stream decode on this machine.

    python -m tools.membw [--config configs/smollm2_135m.py] [--gib 1] [--repeats 7]
        [--samples 1] [--interval 1.0]

Decoding one stream reads every weight once per token, so tokens/s cannot exceed
(read bandwidth) / (weight bytes per token). This measures the read bandwidth as the
median of `repeats` XLA reductions over a `gib`-GiB f32 array (far larger than any cache,
all cores: XLA:CPU splits the reduction over its threads), less that of the same call over
1,024 floats (a call's fixed cost: negligible on a CPU, half the time on a GPU),
`samples` times `interval`
seconds apart, and takes the median sample (on the project's VMs the read bandwidth
jumps between ~31 and ~50 GB/s for seconds at a time, and a single sample can catch a
burst that no workload running over minutes sees), counts the bytes the engine
reads per token in the weight format the config serves (bf16 for the C++ matmul and XLA
bf16 copies, else the model dtype or the int8 / fp8 quantised projections; a GGUF file's
blocks as loaded for `quantization="gguf"`, the default config's Q4_1), and prints
both and the bound as JSON. tools/bench_peers.py runs it before the peers and reports the
single-stream decode rate as a fraction of the bound. K/V reads (small next to the
weights for short contexts) and activations are not counted, so the bound is optimistic.
A benchmark, not a test: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxserve.bench.bandwidth import (bound_from_samples, ggml_weight_bytes_per_token,  # noqa: F401
                                      read_bandwidth_gb_s, weight_bytes_per_token)

ROOT = Path(__file__).resolve().parent.parent


def weight_parts(config_path: str, cache_dir=None) -> dict[str, int]:
    """Bytes of weights a decode step of one sequence reads under `config_path`, by part
    (weight_bytes_per_token; for a GGUF file served in its blocks, `quantization="gguf"`,
    the blocks as loaded: ggml_weight_bytes_per_token). cache_dir: where the checkpoint is
    (default_cache_dir() when None)."""
    from jaxserve.checkpoint import load_model_config
    from jaxserve.config import load_config
    from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint

    cfg = load_config(config_path)
    model, parts = cfg.model, None
    if model is None:
        blocks = cfg.quantization == "gguf"
        ckpt = resolve_checkpoint(cfg.source, cache_dir or default_cache_dir(),
                                  "gguf" if blocks else None)
        model = load_model_config(ckpt)
        if blocks:
            from jaxserve.checkpoint import load_params
            parts = ggml_weight_bytes_per_token(load_params(ckpt, model))
    if cfg.dtype is not None:
        model = model.replace(dtype=cfg.dtype)
    return parts or weight_bytes_per_token(model, cfg.engine)


def bound(config_path: str, gib: float = 1.0, repeats: int = 7, samples: int = 1,
          interval_s: float = 1.0) -> dict:
    """`bound_from_samples` of `samples` bandwidth samples and the weights `config_path`
    serves (`weight_parts`)."""
    parts = weight_parts(config_path)
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
