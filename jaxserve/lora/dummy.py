"""Random LoRA adapters for benchmarks and tests (vLLM's dummy LoRA alike): PEFT
directories written with numpy + safetensors in the layout HF peft saves
(adapter_config.json + adapter_model.safetensors; lora_A [r, in], lora_B [out, r] per
adapted module), for any jaxserve ModelConfig's shape. Their outputs mean nothing; their
cost is a trained adapter's of the same rank and modules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}


def write_peft_adapter(out, cfg, r: int = 4, alpha: float = 8, modules=MODULES, seed: int = 0,
                       b_std: float = 0.05, use_rslora: bool = False, layers=None) -> Path:
    """A random LoRA adapter of base shape `cfg` (a ModelConfig) in PEFT's format at `out`
    (created; returned): rank r, lora_alpha alpha, over PEFT module names `modules`, with
    A ~ N(0, 1/in) (kaiming-like, as PEFT initialises it) and B ~ N(0, b_std) (PEFT
    starts B at zero; a trained adapter has moved it), seeded. layers:
    layers_to_transform (None: all). Raises OSError when `out` cannot be written."""
    from safetensors.numpy import save_file
    from jaxserve.lora.adapter import PEFT_MODULES, flat_shapes
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = flat_shapes(cfg)
    tensors = {}
    for i in (range(cfg.num_layers) if layers is None else layers):
        for m in modules:
            n_in, n_out = shapes[PEFT_MODULES[m]]
            key = (f"base_model.model.model.layers.{i}."
                   f"{'self_attn' if m in _ATTN else 'mlp'}.{m}")
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((r, n_in))
                                               / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (b_std * rng.standard_normal((n_out, r))
                                               ).astype(np.float32)
    save_file(tensors, out / "adapter_model.safetensors")
    conf = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules),
            "use_rslora": use_rslora, "bias": "none", "task_type": "CAUSAL_LM",
            "layers_to_transform": layers}
    (out / "adapter_config.json").write_text(json.dumps(conf))
    return out
