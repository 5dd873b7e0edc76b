"""Run as a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4: the memory
plan of configs/smollm2_135m.py (the real model, the preset's kernels and its GGUF Q4_1
blocks in the C++ kernel's panels) against what the built engine holds on one device, at
tensor parallel TP.

Measured on device 0: the params' and the KV pool's shard bytes (the live arrays), and for
the largest mixed and decode buckets the compiled step's own accounting
(`memory_analysis()`: arguments + temporaries + outputs not aliased to a donated input).
Prints JSON {"plan": {weights, kv_pool, activations, total}, "measured": {weights,
kv_pool, step_peak, step_temp}, "devices"}.

    python tests/memory_check.py TP CACHE_DIR
"""

import json
import sys
from pathlib import Path

import jax

from jaxserve.api import LLM
from jaxserve.config import load_config
from jaxserve.worker.memory_plan import plan_memory

ROOT = Path(__file__).resolve().parent.parent


def device0_bytes(tree) -> int:
    """Bytes of the shards of `tree`'s arrays that live on device 0."""
    dev = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == dev)


def main(tp: int, cache_dir: str) -> None:
    config = load_config(ROOT / "configs" / "smollm2_135m.py").override(tensor_parallel_size=tp)
    llm = LLM(config, cache_dir=cache_dir, warmup=False)
    runner = llm.engine.runner
    plan = plan_memory(config, runner.model_cfg, platform="cpu")
    shapes = runner.shapes.warmup()
    biggest = [max((s for s in shapes if s[0] == kind and s[4] == 1), key=lambda s: (s[1], s[3]))
               for kind in ("mixed", "decode", "sample")]
    runner.warmup(biggest)
    resident = device0_bytes(runner.params) + device0_bytes(runner.cache)
    peak = temp = 0
    for key, exe in runner._compiled.items():
        m = exe.memory_analysis()
        temp = max(temp, m.temp_size_in_bytes)
        # the sampler program runs beside the weights and the KV pool, not its arguments
        peak = max(peak, m.argument_size_in_bytes + m.temp_size_in_bytes
                   + m.output_size_in_bytes - m.alias_size_in_bytes
                   + (resident if key.kind == "sample" else 0))
    print(json.dumps({
        "plan": {"weights": plan.weights, "kv_pool": plan.kv_pool,
                 "activations": plan.activations, "total": plan.total},
        "measured": {"weights": device0_bytes(runner.params), "kv_pool": device0_bytes(runner.cache),
                     "step_peak": peak, "step_temp": temp},
        "devices": len(jax.devices())}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
