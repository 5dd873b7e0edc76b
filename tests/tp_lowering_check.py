"""Run as a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=16: the
engine's step (jaxserve.worker.step.model_step: forward, LM head, sampler) for
configs/llama70b.py at tensor parallel 8, on abstract shapes (nothing allocated), a decode
and a mixed bucket:

- lowered for CUDA with all 80 layers and the Pallas attention kernels: every weight and
  KV pool argument enters its shard_map with the sharding it already has (so the SPMD
  partitioner has nothing to gather), and the program has no all-gather, only the
  all-reduces of the explicit psums;
- compiled for 8 of these CPU devices with 2 layers and XLA kernels, where the
  partitioner runs: the shapes of every all-gather of the compiled program;
- at tensor parallel 8 x pipeline parallel 2 (16 devices, 2 hosts' worth), the decode
  step lowered for CUDA the same way ("cuda_pp"), the layers stage-stacked
  (jaxserve.model.pipeline).

Prints JSON {"cuda": {kind: {"layers", "all_reduce", "all_gather", "args_checked",
"mismatched": [...]}}, "cpu": {kind: {"all_gather_shapes": [...]}}, "control_mismatched":
[...] (the check run on a program that does read a split argument whole), "vocab",
"devices"}.
"""

import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.config import ParallelConfig, load_config
from jaxserve.worker.compilation import StepKey, abstract_inputs
from jaxserve.worker.step import model_step
from jaxserve.model.kv_cache import abstract_kv_cache
from jaxserve.model.params import abstract_params
from jaxserve.model.pipeline import StagedLayers, layers_per_stage
from jaxserve.model.tensor_parallel import layer_specs
from jaxserve.model.transformer import Kernels
from jaxserve.distributed.sharding import ShardingRules, make_mesh
from jaxserve.kernels.pallas.lowering import cuda_target

from lowered_text import count_executed

ROOT = Path(__file__).resolve().parent.parent
KEYS = (StepKey("decode", 64, 64, 32, 1), StepKey("mixed", 512, 16, 32, 1))


def staged(params, rules, stages: int):
    """Abstract params with their layers stacked by stage, as stage_params places them."""
    lp = layers_per_stage(len(params.layers), stages)
    specs = layer_specs(params.layers[0], rules)
    layer = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct((stages, *x.shape), x.dtype, sharding=NamedSharding(
            rules.mesh, PartitionSpec("stage", *s))), params.layers[0], specs)
    return params.__class__(embed=params.embed, final_norm=params.final_norm,
                            lm_head=params.lm_head,
                            layers=StagedLayers(layers=(layer,) * lp, num_layers=len(params.layers)))


def lowered(cfg, rules, kernels, key, platform, stages: int = 1):
    params = abstract_params(cfg, rules)
    if stages > 1:
        params = staged(params, rules, stages)
    cache = abstract_kv_cache(cfg, 4096, 16, "bfloat16", rules, kernels.attention.kv_layout)
    rep = NamedSharding(rules.mesh, PartitionSpec())
    batch, sampling, prev_index = abstract_inputs(key, rep, 300, cfg.vocab_size)
    fn = jax.jit(functools.partial(model_step, cfg=cfg, drafter=None, rules=rules, kernels=kernels,
                                   num_top=20),
                 donate_argnums=(1, 8), static_argnames=("num_steps",))
    def lower():
        traced = fn.trace(params, cache, batch, sampling,
                          jax.ShapeDtypeStruct((64,), jnp.int32, sharding=rep), prev_index, None,
                          None, jax.ShapeDtypeStruct((4096 * 16,), jnp.int32, sharding=rep))
        return traced.lower(lowering_platforms=(platform,)) if platform != "cpu" else traced.lower()
    if platform != "cuda":
        return lower()
    with cuda_target(rules.mesh):  # the Triton kernels' target GPU (JAX 0.11)
        return lower()


def _split_top(text: str) -> list[str]:
    """Split `text` at the commas outside brackets / braces / angle brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{<(" and 1 or 0
        depth -= ch in "]}>)" and 1 or 0
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def check_manual_inputs(text: str) -> tuple[int, list[str]]:
    """(argument operands checked, mismatches): for each sdy.manual_computation of the
    lowered module, each operand that is an argument of @main must carry in the
    computation's in_shardings the sharding the argument already has."""
    sig = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
    arg_sharding = {m.group(1): m.group(2) for m in re.finditer(
        r"%(arg\d+): tensor<[^>]*> \{[^}]*?sdy\.sharding = #sdy\.sharding<@mesh, (\[[^>]*\])>", sig)}
    checked, bad = 0, []
    for m in re.finditer(r"sdy\.manual_computation\(([^)]*)\) in_shardings=\[(.*?)\] out_shardings",
                         text, re.S):
        operands = [o.strip().lstrip("%") for o in m.group(1).split(",")]
        shardings = [re.sub(r"^<@mesh, (.*)>$", r"\1", s) for s in _split_top(m.group(2))]
        for op, sh in zip(operands, shardings, strict=True):
            if op in arg_sharding:
                checked += 1
                if arg_sharding[op] != sh:
                    bad.append(f"{op}: argument {arg_sharding[op]} vs shard_map {sh}")
    return checked, bad


def summary(text: str, layers: int) -> dict:
    checked, bad = check_manual_inputs(text)
    return {"layers": layers, "args_checked": checked, "mismatched": bad,
            "all_gather": count_executed(text, "all_gather"),
            "all_reduce": count_executed(text, "all_reduce"),
            "collective_permute": count_executed(text, "collective_permute"),
            "triton": text.count("xla.gpu.triton")}


def main() -> None:
    base = load_config(ROOT / "configs" / "llama70b.py")
    rules = ShardingRules(make_mesh(base.parallel))
    out = {"cuda": {}, "cpu": {}, "vocab": base.model.vocab_size, "devices": len(jax.devices())}
    pallas = Kernels(attention="pallas", matmul="pallas", sampling="xla")
    for key in KEYS:
        out["cuda"][key.kind] = summary(lowered(base.model, rules, pallas, key, "cuda").as_text(),
                                        base.model.num_layers)
    pp_rules = ShardingRules(make_mesh(ParallelConfig(tensor_parallel_size=8,
                                                      pipeline_parallel_size=2)))
    out["cuda_pp"] = summary(lowered(base.model, pp_rules, pallas, KEYS[0], "cuda", 2).as_text(),
                             base.model.num_layers)
    # the check's own control: an argument split over `model` read whole by a shard_map
    split = jax.ShapeDtypeStruct((8, 4), jnp.float32,
                                 sharding=NamedSharding(rules.mesh, PartitionSpec("model")))
    gathered = jax.jit(jax.shard_map(lambda x: x * 2, mesh=rules.mesh, in_specs=PartitionSpec(),
                                     out_specs=PartitionSpec()))
    out["control_mismatched"] = check_manual_inputs(
        gathered.trace(split).lower(lowering_platforms=("cuda",)).as_text())[1]
    small = base.model.replace(num_layers=2)
    xla = Kernels(attention="xla", matmul="xla", sampling="xla")
    for key in KEYS:
        hlo = lowered(small, rules, xla, key, "cpu").compile().as_text()
        shapes = re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} all-gather\(", hlo)
        out["cpu"][key.kind] = {"all_gather_shapes": shapes}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
