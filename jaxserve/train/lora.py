"""Supervised fine-tuning of a LoRA adapter on the served model's own forward pass.

The base weights stay frozen; the adapter's factors A [in, r] and B [r, out] of each
target projection of each layer are the trainable pytree (`init_adapter`), joined to the
base as one-slot LoRA pools (`with_adapter`, the engine's own jaxserve.lora.batched
formulation, so what is trained is exactly what is served) and scored by
`jaxserve.functional.score`. The loss is the mean negative log-likelihood of the assistant
tokens of chat examples (`chat_example`: the prompt tokens masked out), as TRL's
SFTTrainer with completion-only loss. `save_peft` writes the factors in PEFT's format
(adapter_config.json + adapter_model.safetensors: lora_A [r, in], lora_B [out, r]), which
jaxserve (--lora-modules, /v1/load_lora_adapter) and HF peft load.

Initialisation as PEFT's default: A uniform in +-1/sqrt(in) (kaiming-uniform with
a = sqrt(5)), B zeros, so training starts from the base model; scaling lora_alpha / r.

Source: Hu et al., 2021 (LoRA); PEFT's LoraLayer (initialisation, scaling, checkpoint
names); TRL's SFTTrainer (completion-only loss).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.functional import score
from jaxserve.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_MODULES, flat_shapes
from jaxserve.lora.batched import LoraSlots
from jaxserve.model.lora import projection_shapes
from jaxserve.model.params import PROJECTIONS, Params

OURS = {ours: peft for peft, ours in PEFT_MODULES.items()}  # wq -> q_proj
_ATTENTION = ("wq", "wk", "wv", "wo")


def init_adapter(cfg: ModelConfig, rank: int, targets: Sequence[str], key: jax.Array
                 ) -> dict[str, dict[str, jax.Array]]:
    """The trainable factors of a new adapter: {projection: {"a": [L, in, r] f32, "b":
    [L, r, out] f32 zeros}} for `targets` (our projection names, jaxserve.model.params:
    "wq", ..., "w_down"), A uniform in +-1/sqrt(in) (PEFT's default). Raises ValueError
    for an unknown target or rank < 1."""
    bad = [t for t in targets if t not in PROJECTIONS]
    if bad or rank < 1 or not targets:
        raise ValueError(f"targets must be some of {list(PROJECTIONS)} (got {list(targets)}) "
                         f"and rank >= 1 (got {rank})")
    out = {}
    flat = flat_shapes(cfg)
    for t, k in zip(targets, jax.random.split(key, len(targets))):
        n_in, n_out = flat[t]
        bound = 1.0 / np.sqrt(n_in)
        out[t] = {"a": jax.random.uniform(k, (cfg.num_layers, n_in, rank), jnp.float32,
                                          -bound, bound),
                  "b": jnp.zeros((cfg.num_layers, rank, n_out), jnp.float32)}
    return out


def with_adapter(params: Params, cfg: ModelConfig, factors: Mapping[str, Mapping[str, Any]],
                 scaling: float) -> Params:
    """`params` (float, a tuple of layers) with the adapter `factors` (init_adapter's form)
    as one-slot LoRA pools (slot 0 = the adapter: score with lora_slot zeros), B scaled
    by `scaling` (lora_alpha / r). Differentiable in `factors`."""
    shapes = projection_shapes(cfg)
    layers = []
    for i, lp in enumerate(params.layers):
        pools = {t: LoraSlots(a=f["a"][i][None], b=(f["b"][i] * scaling)[None],
                              logical_shape=shapes[t]) for t, f in factors.items()}
        layers.append(dataclasses.replace(lp, lora=pools))
    return dataclasses.replace(params, layers=tuple(layers))


def sft_loss(factors, params: Params, cfg: ModelConfig, tokens: jax.Array,
             lengths: jax.Array, mask: jax.Array, scaling: float) -> jax.Array:
    """Mean negative log-likelihood (nats per token) of the tokens where mask [B, L] is 1
    (the assistant's), under the base with the adapter: tokens [B, L] int32, lengths [B]
    int32 (jaxserve.functional.score's arguments)."""
    served = with_adapter(params, cfg, factors, scaling)
    logp = score(served, cfg, tokens, lengths, lora_slot=jnp.zeros(tokens.shape[0], jnp.int32))
    mask = mask.astype(jnp.float32)
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def chat_example(tokenizer, messages: Sequence[Mapping[str, str]], max_len: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """One training example of a chat whose last message is the assistant's answer:
    (token ids [n] int32, loss mask [n] int8: 1 on the answer's tokens, its end-of-turn
    included), the whole chat rendered by the model's chat template and cut to max_len.
    Raises ValueError when the last message is not the assistant's or the template does
    not render the answer after the prompt."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("a training chat ends with the assistant's message")
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template does not render the answer after the prompt")
    p = tokenizer.encode(prompt, add_special_tokens=False)
    ids = p + tokenizer.encode(full[len(prompt):].rstrip("\n"), add_special_tokens=False)
    mask = np.zeros(len(ids), np.int8)
    mask[len(p):] = 1
    return np.asarray(ids[:max_len], np.int32), mask[:max_len]


def read_chats(path: str | Path) -> list[list[dict]]:
    """The chats of a JSONL file: each line {"messages": [{"role", "content"}, ...]} (the
    OpenAI fine-tuning format) or {"prompt", "completion"} (one user turn and the answer).
    Raises ValueError naming the line of one that is neither."""
    chats = []
    # JSON lines end at "\n" only: splitlines() would also cut at a U+2028 or U+0085 that
    # a JSON string holds unescaped (ensure_ascii=False writers, ours among them)
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "messages" in rec:
            chats.append(list(rec["messages"]))
        elif "prompt" in rec and "completion" in rec:
            chats.append([{"role": "user", "content": rec["prompt"]},
                          {"role": "assistant", "content": rec["completion"]}])
        else:
            raise ValueError(f"{path}:{n}: a line must hold \"messages\" or \"prompt\" and "
                             "\"completion\"")
    return chats


def pad_batch(examples: Sequence[tuple[np.ndarray, np.ndarray]], width: int
              ) -> dict[str, np.ndarray]:
    """{"tokens" [B, width] int32, "lengths" [B] int32, "mask" [B, width] int8} of
    chat_example pairs (zero-padded)."""
    B = len(examples)
    tokens = np.zeros((B, width), np.int32)
    mask = np.zeros((B, width), np.int8)
    lengths = np.zeros(B, np.int32)
    for i, (ids, m) in enumerate(examples):
        n = min(len(ids), width)
        tokens[i, :n], mask[i, :n], lengths[i] = ids[:n], m[:n], n
    return {"tokens": tokens, "lengths": lengths, "mask": mask}


def save_peft(out: str | Path, factors: Mapping[str, Mapping[str, Any]], rank: int,
              alpha: float, base_model: str = "") -> Path:
    """Write the adapter (init_adapter's form; B unscaled) in PEFT's format at `out`
    (created): adapter_config.json (peft_type LORA, r, lora_alpha, target_modules,
    task_type CAUSAL_LM) and adapter_model.safetensors with each layer's
    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight [r, in] and
    lora_B.weight [out, r] f32. Returns the directory."""
    from safetensors.numpy import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for t, f in factors.items():
        a, b = np.asarray(f["a"], np.float32), np.asarray(f["b"], np.float32)
        part = "self_attn" if t in _ATTENTION else "mlp"
        for i in range(a.shape[0]):
            key = f"base_model.model.model.layers.{i}.{part}.{OURS[t]}"
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    save_file(tensors, out / ADAPTER_WEIGHTS)
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": sorted(OURS[t] for t in factors), "lora_dropout": 0.0,
            "bias": "none", "use_rslora": False, "use_dora": False,
            "base_model_name_or_path": base_model, "inference_mode": True}
    (out / ADAPTER_CONFIG).write_text(json.dumps(conf, indent=2))
    return out


__all__ = ["chat_example", "init_adapter", "pad_batch", "read_chats", "save_peft", "sft_loss",
           "with_adapter"]
