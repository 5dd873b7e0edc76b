"""Run as a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4: speculative
decoding with the shipped EAGLE head (configs/smollm2_135m_eagle.py's speculative config
on the small test engine) under tensor parallel 1 and 3: the head's layer, its KV pool
and its draft LM head run through the same shard_map path as the model's. Prints JSON
{"tokens": {tp: [token ids per prompt]}, "accepted": {tp: accepted draft tokens},
"devices": n}.

    python tests/tp_spec_check.py CACHE_DIR
"""

import json
import sys
from pathlib import Path

import jax

from jaxserve.api import LLM
from jaxserve.config import ParallelConfig, load_config
from jaxserve.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def main(cache_dir: str) -> None:
    eagle = load_config(ROOT / "configs" / "smollm2_135m_eagle.py")
    small = load_config(ROOT / "tests" / "configs" / "smollm2_small.py")
    out = {"tokens": {}, "accepted": {}, "devices": len(jax.devices())}
    for tp in (1, 3):
        cfg = eagle.replace(parallel=ParallelConfig(tensor_parallel_size=tp),
                            engine=small.engine.override(
                                speculative_config=eagle.engine.speculative))
        llm = LLM(cfg, cache_dir=cache_dir, warmup=False)
        got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
        out["tokens"][tp] = [c.token_ids for c in got]
        out["accepted"][tp] = llm.engine.stats().spec_decode.num_accepted_tokens
        del llm
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
