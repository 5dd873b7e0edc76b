"""Print the per-device memory plan of a config (no devices needed, nothing allocated).

    jaxserve plan-memory --config llama70b [--device-gib 80]
        [--tensor-parallel-size N] [--pipeline-parallel-size M] [--platform gpu|cpu]

    # llama70b on 8 GPUs, and on 2 hosts x 8 (a pipeline stage per host)
    jaxserve plan-memory --config llama70b -tp 8
    jaxserve plan-memory --config llama70b -tp 8 -pp 2

With a config whose CacheConfig.kv_cache_memory_bytes is None the KV pool is what
gpu_memory_utilization of --device-gib leaves after the weights and activations.
"""

import argparse
import sys

from jaxserve.config import ConfigError, load_config
from jaxserve.worker.memory_plan import plan_memory


def main(argv=None, prog: str = "jaxserve plan-memory") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a shipped config's name (llama70b, ...) or a config file's path")
    ap.add_argument("--device-gib", type=float, default=80.0, help="memory of one device (GiB)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, help="override the config's")
    ap.add_argument("--pipeline-parallel-size", "-pp", type=int, help="override the config's")
    ap.add_argument("--platform", default="gpu", choices=("gpu", "cpu"),
                    help="the devices (what 'auto' kernels and weight layouts resolve to)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        ap.error(str(e))
    given = {"tensor_parallel_size": args.tensor_parallel_size,
             "pipeline_parallel_size": args.pipeline_parallel_size}
    cfg = cfg.override(**{k: v for k, v in given.items() if v})
    if cfg.model is None:
        print(f"error: {args.config} gives no model shape (Config.model); a checkpoint's "
              f"config.json holds it", file=sys.stderr)
        return 1
    plan = plan_memory(cfg, platform=args.platform, device_bytes=int(args.device_gib * 2**30))
    print(f"{cfg.name}: {cfg.model.num_layers} layers, dtype {cfg.dtype or cfg.model.dtype}, "
          f"tensor parallel {cfg.parallel.tensor_parallel_size} x pipeline parallel "
          f"{cfg.parallel.pipeline_parallel_size}")
    print(plan.table(int(args.device_gib * 2**30)))
    if plan.replicated_leaves:
        print("replicated (not divisible by the mesh):", ", ".join(plan.replicated_leaves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
