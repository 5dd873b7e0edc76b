"""Run as a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4: the whole
engine (scheduler, runner, sampler; jaxserve.LLM) on SmolLM2-135M (tests/configs/
smollm2_small.py) under tensor parallel 1 and 2 with XLA attention and matmuls
("xla-TP"; XLA at TP 3: tests/tp_check.py's logits), and 1 and 3 with the default
kernels ("auto-TP": the C++ attention kernel and the config's C++ matmul over f32 panels,
per device under TP), and pipeline stages
"TPxPP" (auto-1x4: 30 layers in 4 stages of 8 slots, the last 2 zero layers; TP 2 x PP
2 serves in tests/test_distributed.py's two processes, and with XLA kernels on the tiny
model in tests/tp_check.py), the same prompts batched, greedy; prints JSON {"tokens": {run: [token ids per prompt]},
"wq": {run: layer 0's wq sharding spec (the fused q | k | v panels' with the C++ matmul)}, "kv": {run: the KV pool's sharding spec},
"attention": {run: the attention kernel}, "device0_bytes": {run: bytes of the params'
shards on device 0}, "layer_bytes": one layer's bytes (XLA layout),
"loaded_on": [device ids of each layer as load_params places it at PP 4], "embeddings":
{run: LLM.embed of the prompts (mean pooling, on in every run)}, "devices": n}.

    python tests/tp_engine_check.py CACHE_DIR
"""

import json
import sys
from pathlib import Path

import jax

from jaxserve.model.layer_loop import StackedLayers
from jaxserve.api import LLM
from jaxserve.engine.builder import resolve_model_config
from jaxserve.checkpoint import load_params
from jaxserve.config import ParallelConfig, load_config
from jaxserve.sampling_params import SamplingParams
from jaxserve.distributed.sharding import ShardingRules, make_mesh

CONFIG = Path(__file__).resolve().parent / "configs" / "smollm2_small.py"
PROMPTS = ["The capital of France is", "Write a haiku about rain.",
           "List three prime numbers and explain why each is prime.",
           "def fibonacci(n):"]


def main(cache_dir: str) -> None:
    base = load_config(CONFIG)
    base = base.replace(engine=base.engine.override(pooling="mean"))
    xla = base.engine.override(attention_impl="xla", matmul_impl="xla")
    out = {"tokens": {}, "wq": {}, "kv": {}, "attention": {}, "device0_bytes": {},
           "embeddings": {}, "devices": len(jax.devices())}
    # TP 4 (heads replicated, as at TP 2) serves in tests/test_distributed.py's two processes
    runs = [(f"xla-{tp}", tp, 1, xla) for tp in (1, 2)] + [
        (f"auto-{tp}", tp, 1, base.engine) for tp in (1, 3)] + [
        ("auto-1x4", 1, 4, base.engine)]
    for name, tp, pp, engine in runs:
        cfg = base.replace(parallel=ParallelConfig(tensor_parallel_size=tp,
                                                   pipeline_parallel_size=pp), engine=engine)
        llm = LLM(cfg, cache_dir=cache_dir, warmup=False)
        got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
        runner = llm.engine.runner
        out["tokens"][name] = [c.token_ids for c in got]
        out["embeddings"][name] = llm.embed(PROMPTS)
        layers = runner.params.layers
        if isinstance(layers, StackedLayers):  # one device's layer loop: leaves [L, ...]
            layer0 = layers.layers
        else:
            layer0 = layers.layers[0] if pp > 1 else layers[0]  # a stage-stacked pipeline's
        # wq's array: the leaf itself (XLA), or the f32 panels of the fused q | k | v
        out["wq"][name] = str(getattr(jax.tree.leaves(layer0.wq)[0].sharding, "spec", None))
        out["kv"][name] = str(getattr(runner.cache.k[0].sharding, "spec", None))
        out["attention"][name] = runner.kernels.attention.name
        dev0 = jax.devices()[0]
        out["device0_bytes"][name] = sum(s.data.nbytes for x in jax.tree.leaves(runner.params)
                                         for s in x.addressable_shards if s.device == dev0)
        del llm, runner
    cfg, ckpt = resolve_model_config(base, Path(cache_dir))
    rules = ShardingRules(make_mesh(ParallelConfig(pipeline_parallel_size=4)))
    loaded = load_params(ckpt, cfg, rules)
    out["layer_bytes"] = sum(x.nbytes for x in jax.tree.leaves(loaded.layers[0]))
    out["loaded_on"] = [sorted({d.id for x in jax.tree.leaves(lp) for d in x.sharding.device_set})
                        for lp in loaded.layers]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
