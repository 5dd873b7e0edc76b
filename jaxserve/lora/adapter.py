"""LoRA adapters: one adapter's low-rank factors in jaxserve's layout, read from a PEFT
directory, and the base weights with an adapter merged into them (the reference the
batched multi-adapter path is checked against).

A LoRA adapter (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") adds
to a projection W [in, out] the product scaling * A @ B, A [in, r], B [r, out]: y = x W +
scaling * (x A) B. PEFT stores per adapted module `lora_A.weight` [r, in] and
`lora_B.weight` [out, r] (torch Linear layout) and scales by lora_alpha / r, or with
rsLoRA (Kalajdzievski, 2023) by lora_alpha / sqrt(r) (peft/tuners/lora/layer.py,
`update_layer`). jaxserve keeps A as [in, r] and B as [r, out] over the flattened input and
output axes of our projection layouts (jaxserve.model.params: wq [embed, heads, head_dim]
has out = heads * head_dim in q_proj's row order; wo [heads, head_dim, embed] has in =
heads * head_dim in o_proj's column order), f32, and the scaling folded into B.

Source: PEFT's LoRA layer (peft/tuners/lora/layer.py: `get_delta_weight`, `scaling`) and
its checkpoint names (peft/utils/save_and_load.py), vLLM's LoRA loading
(vllm/lora/models.py) for the validation a server does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig

# PEFT's target module names (Llama / Mistral / Qwen2 HF modules) -> our projection
PEFT_MODULES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
                "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """A LoRA adapter that cannot be served: the message names the adapter, the field and
    the limit."""


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter's factors, on the host: a, b: tuples (one per layer) of dicts
    {projection: A [in, r] f32, B [r, out] f32 (scaling folded in)} numpy arrays over
    `targets` (our projection names); rank: r; name: what requests call it. (Plain
    Python + numpy: the engine's host side keeps adapters without JAX.)"""

    a: tuple
    b: tuple
    name: str = "adapter"
    rank: int = 0
    targets: tuple = ()


def flat_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{projection: (in, out)} of `cfg`'s projections over their flattened axes."""
    H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    D, F = cfg.hidden_size, cfg.intermediate_size
    return {"wq": (D, H * Dh), "wk": (D, K * Dh), "wv": (D, K * Dh), "wo": (H * Dh, D),
            "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}


def read_adapter_config(path: Path) -> dict[str, Any]:
    """adapter_config.json of a PEFT directory. Raises AdapterError naming a missing or
    unreadable file."""
    f = Path(path) / ADAPTER_CONFIG
    if not f.is_file():
        raise AdapterError(f"LoRA adapter {path}: no {ADAPTER_CONFIG}")
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {path}: {ADAPTER_CONFIG} is not JSON ({e})") from None


def load_peft_adapter(path: str | Path, cfg: ModelConfig, max_rank: int,
                      name: str | None = None) -> LoraAdapter:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for a base
    model of shape `cfg`, as a LoraAdapter (host numpy arrays).

    Reads `r`, `lora_alpha`, `use_rslora`, `target_modules` (a list of q/k/v/o/gate/up/
    down_proj names, or module paths ending in them, "model.layers.3.mlp.up_proj", as
    PEFT saves "all-linear"; or "all-linear"), `layers_to_transform` (None: all); every
    adapted module's lora_A [r, in] and lora_B [out, r] (modules not adapted in a layer:
    zero factors). Raises AdapterError (one line, naming
    the adapter, the field and the limit) for: a missing file; a peft_type other than
    LORA; r above `max_rank`; a target module jaxserve does not adapt (embed_tokens,
    lm_head, anything else); DoRA, bias training, per-module ranks or alphas; a factor
    whose shape is not the base's (an adapter of another model) or a missing one."""
    from safetensors.numpy import load_file
    path = Path(path).expanduser()
    label = name or path.name
    conf = read_adapter_config(path)
    if conf.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {label}: peft_type {conf.get('peft_type')!r}, "
                           "only 'LORA' is served")
    r = conf.get("r")
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"LoRA adapter {label}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"LoRA adapter {label}: rank {r} is above --max-lora-rank {max_rank}")
    for field, ok in (("use_dora", False), ("bias", "none")):
        if conf.get(field, ok) != ok:
            raise AdapterError(f"LoRA adapter {label}: {field}={conf[field]!r} is not served "
                               f"(only {field}={ok!r})")
    for field in ("rank_pattern", "alpha_pattern"):
        if conf.get(field):
            raise AdapterError(f"LoRA adapter {label}: {field} (per-module ranks or alphas) "
                               "is not served")
    targets = conf.get("target_modules") or []
    if targets == "all-linear":
        targets = list(PEFT_MODULES)
    if isinstance(targets, str):  # PEFT also takes a regex; ours are names or module paths
        raise AdapterError(f"LoRA adapter {label}: target_modules as a pattern ({targets!r}) is "
                           f"not served: list of {sorted(PEFT_MODULES)}")
    unknown = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in PEFT_MODULES)
    if unknown or not targets:
        raise AdapterError(f"LoRA adapter {label}: target_modules {unknown or targets} not "
                           f"served; jaxserve adapts {sorted(PEFT_MODULES)}")
    alpha = float(conf.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    layers = conf.get("layers_to_transform")
    layers = range(cfg.num_layers) if layers is None else (
        [layers] if isinstance(layers, int) else layers)
    wanted = set()  # (layer, module) pairs the adapter adapts
    for t in targets:
        module, at = t.rsplit(".", 1)[-1], re.search(r"layers\.(\d+)\.", t)
        wanted |= {(int(at.group(1)), module)} if at else {(i, module) for i in layers}
    if any(i >= cfg.num_layers for i, _ in wanted):
        raise AdapterError(f"LoRA adapter {label}: adapts layer {max(i for i, _ in wanted)}; "
                           f"the base model has {cfg.num_layers} layers")
    targets = {module for _, module in wanted}
    f = path / ADAPTER_WEIGHTS
    if not f.is_file():
        raise AdapterError(f"LoRA adapter {label}: no {ADAPTER_WEIGHTS}")
    tensors = load_file(f)
    shapes = flat_shapes(cfg)
    ours = tuple(PEFT_MODULES[t] for t in PEFT_MODULES if t in targets)
    a_layers, b_layers = [], []
    for i in range(cfg.num_layers):
        a_i, b_i = {}, {}
        for module in (t for t in PEFT_MODULES if t in targets):
            proj = PEFT_MODULES[module]
            n_in, n_out = shapes[proj]
            if (i, module) not in wanted:  # not adapted there: zero factors
                a_i[proj] = np.zeros((n_in, r), np.float32)
                b_i[proj] = np.zeros((r, n_out), np.float32)
                continue
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{module}"
            a_t, b_t = tensors.get(f"{key}.lora_A.weight"), tensors.get(f"{key}.lora_B.weight")
            if a_t is None or b_t is None:
                raise AdapterError(f"LoRA adapter {label}: {key}.lora_"
                                   f"{'A' if a_t is None else 'B'}.weight is missing")
            if a_t.shape != (r, n_in) or b_t.shape != (n_out, r):
                raise AdapterError(
                    f"LoRA adapter {label}: {key} has lora_A {list(a_t.shape)} and lora_B "
                    f"{list(b_t.shape)}; the base model needs [{r}, {n_in}] and "
                    f"[{n_out}, {r}] (an adapter of another model?)")
            a_i[proj] = np.ascontiguousarray(a_t.astype(np.float32).T)
            b_i[proj] = np.ascontiguousarray(b_t.astype(np.float32).T * np.float32(scaling))
        a_layers.append(a_i)
        b_layers.append(b_i)
    return LoraAdapter(a=tuple(a_layers), b=tuple(b_layers), name=label, rank=r, targets=ours)


def merge_adapter(params, adapter: LoraAdapter):
    """`params` (float projections, jaxserve.model.params layout) with the adapter merged
    into its weights: W + A @ B (B scaled) reshaped to W's shape, in W's dtype. The
    reference of the batched path: served logits with the adapter equal this model's.
    Raises AdapterError for a quantised or packed projection (merge into float weights)."""
    import jax.numpy as jnp

    def merged(lp, a_i, b_i):
        updates = {}
        for proj in adapter.targets:
            w = getattr(lp, proj)
            if not hasattr(w, "dtype") or not jnp.issubdtype(w.dtype, jnp.floating):
                raise AdapterError(f"LoRA adapter {adapter.name}: {proj} is not a float array "
                                   f"({type(w).__name__}): merge into float weights")
            delta = jnp.asarray(a_i[proj]) @ jnp.asarray(b_i[proj])
            updates[proj] = (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)
        return dataclasses.replace(lp, **updates)

    return dataclasses.replace(params, layers=tuple(
        merged(lp, a_i, b_i) for lp, a_i, b_i in zip(params.layers, adapter.a, adapter.b)))


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "AdapterError", "LoraAdapter", "PEFT_MODULES",
           "load_peft_adapter", "merge_adapter", "read_adapter_config"]
