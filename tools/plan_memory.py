"""Print the per-device memory plan of a config (no devices needed, nothing allocated).

    python tools/plan_memory.py --config configs/llama70b.py [--device-gib 80]
"""

import argparse
import sys

from jaxserve.config import load_config
from jaxserve.memory_plan import plan_memory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a configs/NAME.py file")
    ap.add_argument("--device-gib", type=float, default=80.0, help="memory of one device (GiB)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    if cfg.model is None:
        print(f"error: {args.config} gives no model shape (Config.model); a checkpoint's "
              f"config.json holds it", file=sys.stderr)
        return 1
    plan = plan_memory(cfg)
    print(f"{cfg.name}: {cfg.model.num_layers} layers, dtype {cfg.dtype or cfg.model.dtype}, "
          f"tensor parallel {cfg.parallel.tensor_parallel_size}")
    print(plan.table(int(args.device_gib * 2**30)))
    if plan.replicated_leaves:
        print("replicated (not divisible by the mesh):", ", ".join(plan.replicated_leaves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
