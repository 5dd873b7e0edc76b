"""Run as a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4: LoRA
adapters served by the whole engine (jaxserve.LLM) on SmolLM2-135M (tests/configs/
smollm2_small.py, f32) under tensor parallel 1, 2 (the MLP split, the 9 query / 3 KV heads
replicated) and 3 (heads and MLP split), with XLA kernels ("xla-TP") and the default ones
at TP 3 ("auto-3": the C++ attention and the C++ matmul's f32 panels per device, the
lora deltas in the C++ LoRA kernel): four prompts over two random adapters and the base in
one batch, greedy. Prints JSON {"tokens": {run: [token ids per prompt]}, "logprobs":
{run: [...]}, "base_tokens" / "base_logprobs": {"xla-1": [...]} (the same prompts with no
adapter, at TP 1 only), "specs": {run: {pool: spec}} (layer 0's wq B and wo A and w_down A
pools' shardings), "devices": n}.

    python tests/lora_tp_check.py CACHE_DIR ADAPTER_DIR
"""

import json
import sys
from pathlib import Path

import jax

from jaxserve.api import LLM
from jaxserve.config import ParallelConfig, load_config
from jaxserve.engine.builder import resolve_model_config
from jaxserve.lora import LoRARequest
from jaxserve.lora.dummy import write_peft_adapter
from jaxserve.sampling_params import SamplingParams

CONFIG = Path(__file__).resolve().parent / "configs" / "smollm2_small.py"
PROMPTS = ["The capital of France is", "Write a haiku about rain.",
           "List three prime numbers.", "def fibonacci(n):"]


def main(cache_dir: str, adapter_dir: str) -> None:
    base = load_config(CONFIG)
    cfg, _ = resolve_model_config(base, Path(cache_dir))
    d = Path(adapter_dir)
    paths = {"a1": write_peft_adapter(d / "a1", cfg, r=8, alpha=16, seed=21, b_std=0.02),
             "a2": write_peft_adapter(d / "a2", cfg, r=4, alpha=8, seed=22, b_std=0.03,
                                      modules=["k_proj", "o_proj", "up_proj", "down_proj"])}
    lora = [LoRARequest("a1", 1, str(paths["a1"])), LoRARequest("a2", 2, str(paths["a2"])),
            None, LoRARequest("a1", 1, str(paths["a1"]))]
    xla = base.engine.override(attention_impl="xla", matmul_impl="xla")
    out = {"tokens": {}, "logprobs": {}, "base_tokens": {}, "base_logprobs": {}, "specs": {},
           "devices": len(jax.devices())}
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    for name, tp, engine in [("xla-1", 1, xla), ("xla-2", 2, xla), ("xla-3", 3, xla),
                             ("auto-3", 3, base.engine)]:
        c = base.replace(parallel=ParallelConfig(tensor_parallel_size=tp),
                         engine=engine.override(enable_lora=True, max_loras=2, max_lora_rank=8))
        llm = LLM(c, cache_dir=cache_dir, warmup=False)
        got = llm.generate(PROMPTS, sp, lora_request=lora)
        out["tokens"][name] = [g.token_ids for g in got]
        out["logprobs"][name] = [[lp.logprob for lp in g.logprobs] for g in got]
        if tp == 1:  # the base's own tokens, that the adapters are seen to change
            plain = llm.generate(PROMPTS, sp)
            out["base_tokens"][name] = [g.token_ids for g in plain]
            out["base_logprobs"][name] = [[lp.logprob for lp in g.logprobs] for g in plain]
        pools = llm.engine.runner.params.layers[0].lora
        out["specs"][name] = {f"{p}.{f}": str(getattr(getattr(pools[p], f).sharding, "spec", None))
                              for p, f in (("wq", "b"), ("wo", "a"), ("w_down", "a"), ("wq", "a"))}
        del llm
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
