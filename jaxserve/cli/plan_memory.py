"""Print the per-device memory plan of a config and the engine's decision on it: the KV
pool it would allocate, or the one-line refusal `jaxserve serve` would give (exit status
2). No devices needed, nothing allocated.

    jaxserve plan-memory --config llama70b [--platform gpu --device-gib 80]
        [--tensor-parallel-size N] [--pipeline-parallel-size M] [engine flags ...]

    # llama70b on 8 GPUs, and on 2 hosts x 8 (a pipeline stage per host)
    jaxserve plan-memory --config llama70b -tp 8
    jaxserve plan-memory --config llama70b -tp 8 -pp 2
    # what `jaxserve serve` with the same flags decides on this machine's CPU, its
    # config.parallel.num_devices simulated devices sharing the host's available memory
    jaxserve plan-memory --config llama70b --platform cpu --load-format dummy --num-layers 2

Takes the engine flags of `jaxserve batch` (--kv-cache-memory-bytes,
--gpu-memory-utilization, --cpu-kv-cache-space, --max-num-batched-tokens, ...): the plan
is of the config they make. A config without a model shape (a `source` only) reads it
from its checkpoint, fetched and converted into --cache-dir on first use.
"""

import argparse
import sys

from jaxserve.checkpoint import CheckpointError
from jaxserve.checkpoint.sources import default_cache_dir
from jaxserve.cli.args import BATCH_FLAGS, apply_flags
from jaxserve.config import ConfigError, load_config
from jaxserve.config.args import add_flags
from jaxserve.engine.builder import resolve_model_config
from jaxserve.worker.device_memory import cpu_device_bytes, memory_name
from jaxserve.worker.memory_plan import GiB, check_fits, plan_memory

GPU_GIB = 80.0  # --device-gib's default on GPU: an 80 GB H100 / A100


def main(argv=None, prog: str = "jaxserve plan-memory") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True,
                    help="a shipped config's name (llama70b, ...) or a config file's path")
    ap.add_argument("--platform", default="gpu", choices=("gpu", "cpu"),
                    help="the devices (what 'auto' kernels, weight layouts and pool sizing "
                         "resolve to)")
    ap.add_argument("--device-gib", type=float,
                    help=f"memory of one device (GiB; default: {GPU_GIB:g} on GPU, on CPU this "
                         "host's available memory split over the config's devices)")
    ap.add_argument("--cache-dir", help="where a config's checkpoint is fetched and converted")
    add_flags(ap, BATCH_FLAGS)
    args = ap.parse_args(argv)
    try:
        cfg = apply_flags(load_config(args.config), args)
        cache_dir = args.cache_dir or default_cache_dir()
        # a config's own model shape needs no weights to plan
        model, _ = resolve_model_config(
            cfg if cfg.model is None else cfg.replace(load_format="dummy"), cache_dir)
    except (ConfigError, CheckpointError) as e:
        ap.error(str(e))
    n = cfg.parallel.num_devices
    if args.device_gib is not None:
        device_bytes = int(args.device_gib * GiB)
    elif args.platform == "cpu":
        device_bytes = cpu_device_bytes(n)  # as build_engine measures it
    else:
        device_bytes = int(GPU_GIB * GiB)
    print(f"{cfg.name}: {model.num_layers} layers, dtype {model.dtype}, tensor parallel "
          f"{cfg.parallel.tensor_parallel_size} x pipeline parallel "
          f"{cfg.parallel.pipeline_parallel_size}, {args.platform}, "
          f"{device_bytes / GiB:.2f} GiB per device")
    try:
        plan = plan_memory(cfg, model, args.platform, device_bytes)
        print(plan.table(device_bytes))
        if plan.replicated_leaves:
            print("replicated (not divisible by the mesh):", ", ".join(plan.replicated_leaves))
        check_fits(plan, device_bytes, memory_name(args.platform, n))
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"decision: a KV page pool of {plan.kv_pages} pages "
          f"({plan.kv_pages * plan.page_bytes_total} bytes over all devices, sized by "
          f"{plan.kv_sized_by})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
