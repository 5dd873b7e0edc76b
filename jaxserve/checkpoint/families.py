"""Model families: HF tensor names -> our Params leaves, and HF config.json -> ModelConfig.

One table per family maps each leaf of `jaxserve.model.params.Params` to the HF tensor it
comes from and the transform between the layouts (HF `nn.Linear.weight` is [out, in]; ours
are [in, out] split into heads, see `jaxserve.model.params`). Shapes are never written here:
they come from `param_specs(cfg)`, and each transform derives the HF shape from ours, so
validation and conversion share one description.

Families: Llama (Llama 2, Llama 3/3.1/3.2 with llama3 RoPE scaling, SmolLM2), Mistral,
Qwen2 (q/k/v biases). GGUF files name tensors differently; `jaxserve.checkpoint.gguf`
translates to these HF names with gguf's own `TensorNameMap`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping

import jax
import numpy as np

from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.config import ConfigError, ModelConfig, RopeScaling
from jaxserve.model.params import ParamSpec, param_specs

log = logging.getLogger(__name__)

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Transform:
    """HF tensor -> our leaf. `hf_shape(ours)` is the HF shape that yields a leaf of shape
    `ours`; `apply(x, ours)` converts (may return a view; the caller makes it contiguous)."""

    name: str
    hf_shape: Callable[[Shape], Shape]
    apply: Callable[[np.ndarray, Shape], np.ndarray]


COPY = Transform("copy", lambda s: s, lambda x, s: x)
# nn.Linear [out, in] -> [in, out]: gate/up/down projections and lm_head.
TRANSPOSE = Transform("transpose", lambda s: s[::-1], lambda x, s: x.T)
# q/k/v_proj [heads*head_dim, embed] -> [embed, heads, head_dim].
IN_HEADS = Transform("in_heads", lambda s: (s[1] * s[2], s[0]), lambda x, s: x.T.reshape(s))
# o_proj [embed, heads*head_dim] -> [heads, head_dim, embed].
OUT_HEADS = Transform("out_heads", lambda s: (s[2], s[0] * s[1]), lambda x, s: x.T.reshape(s))
# q/k/v_proj bias [heads*head_dim] -> [heads, head_dim].
BIAS_HEADS = Transform("bias_heads", lambda s: (s[0] * s[1],), lambda x, s: x.reshape(s))

_TOP_TENSORS: Mapping[str, tuple[str, Transform]] = {
    "embed": ("model.embed_tokens.weight", COPY),
    "final_norm": ("model.norm.weight", COPY),
    "lm_head": ("lm_head.weight", TRANSPOSE),
}

_L = "model.layers.{i}."
LLAMA_LAYER_TENSORS: Mapping[str, tuple[str, Transform]] = {
    "attn_norm": (_L + "input_layernorm.weight", COPY),
    "wq": (_L + "self_attn.q_proj.weight", IN_HEADS),
    "wk": (_L + "self_attn.k_proj.weight", IN_HEADS),
    "wv": (_L + "self_attn.v_proj.weight", IN_HEADS),
    "wo": (_L + "self_attn.o_proj.weight", OUT_HEADS),
    "mlp_norm": (_L + "post_attention_layernorm.weight", COPY),
    "w_gate": (_L + "mlp.gate_proj.weight", TRANSPOSE),
    "w_up": (_L + "mlp.up_proj.weight", TRANSPOSE),
    "w_down": (_L + "mlp.down_proj.weight", TRANSPOSE),
}
QWEN2_LAYER_TENSORS: Mapping[str, tuple[str, Transform]] = {
    **LLAMA_LAYER_TENSORS,
    "bq": (_L + "self_attn.q_proj.bias", BIAS_HEADS),
    "bk": (_L + "self_attn.k_proj.bias", BIAS_HEADS),
    "bv": (_L + "self_attn.v_proj.bias", BIAS_HEADS),
}


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: `ModelConfig.family` name and its per-layer tensor table."""

    name: str
    layer_tensors: Mapping[str, tuple[str, Transform]]


LLAMA = Family("llama", LLAMA_LAYER_TENSORS)
MISTRAL = Family("mistral", LLAMA_LAYER_TENSORS)
QWEN2 = Family("qwen2", QWEN2_LAYER_TENSORS)
FAMILIES = {f.name: f for f in (LLAMA, MISTRAL, QWEN2)}
HF_ARCHITECTURES = {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": MISTRAL,
                    "Qwen2ForCausalLM": QWEN2}


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One leaf to fill: its path in Params (e.g. ("layers", 3, "wq")), our shape, the HF
    tensor name it comes from and the transform."""

    path: tuple[str | int, ...]
    shape: Shape
    hf_name: str
    transform: Transform

    @property
    def hf_shape(self) -> Shape:
        """The shape the HF tensor must have."""
        return tuple(self.transform.hf_shape(self.shape))


def tensor_plan(cfg: ModelConfig) -> list[PlannedTensor]:
    """Every leaf of `param_specs(cfg)` (None leaves skipped, so a tied model has no
    lm_head) with the HF tensor it is converted from, in Params flattening order; a
    block-quantised weight (cfg.weight_formats) is one entry, planned as its float form.

    Raises CheckpointError for an unknown `cfg.family`.
    """
    family = FAMILIES.get(cfg.family)
    if family is None:
        raise CheckpointError(f"unsupported model family {cfg.family!r}; supported: {sorted(FAMILIES)}")
    plan = []
    for keypath, spec in jax.tree_util.tree_flatten_with_path(
            param_specs(cfg.replace(weight_formats=())),
            is_leaf=lambda x: isinstance(x, ParamSpec))[0]:
        path = tuple(getattr(k, "name", getattr(k, "idx", None)) for k in keypath)
        if path[0] == "layers":
            name, transform = family.layer_tensors[path[2]]
            name = name.format(i=path[1])
        else:
            name, transform = _TOP_TENSORS[path[0]]
        plan.append(PlannedTensor(path, tuple(spec.shape), name, transform))
    return plan


def token_ids(value: Any) -> tuple[int, ...]:
    """An HF `eos_token_id` (config.json / generation_config.json): None, an int, or a list
    of ints -> tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope(hf: Mapping[str, Any], arch: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, RopeScaling or None) from transformers 5's `rope_parameters` or 4.x's
    `rope_theta` + `rope_scaling`. Only rope_type "default" and "llama3" are supported."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"{arch}: unsupported rope_type {rope_type!r} in config.json; "
                              f"supported: 'default', 'llama3'")
    return theta, RopeScaling(
        factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))


def _sliding_window(hf: Mapping[str, Any], family: Family) -> int | None:
    """The attention window some layer uses, or None when all attention is full (Mistral:
    `sliding_window`; Qwen2: only with `use_sliding_window`)."""
    if family is QWEN2 and not hf.get("use_sliding_window", False):
        return None
    window = hf.get("sliding_window")
    return int(window) if window else None


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32", None: "float32"}


def source_dtype(hf: Mapping[str, Any]) -> str:
    """Our dtype for the checkpoint's own (`dtype` / `torch_dtype`): bfloat16 stays, float16
    widens to float32 (lossless; ModelConfig has no float16), absent means float32."""
    return _DTYPES.get(hf.get("dtype", hf.get("torch_dtype")), "float32")


def model_config_from_hf(hf: Mapping[str, Any], dtype: str | None = None,
                         extra_eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    """ModelConfig from a parsed HF `config.json` (transformers 4.x or 5.x).

    dtype: our param dtype; None = `source_dtype(hf)`. extra_eos_token_ids: from
    generation_config.json, appended to config.json's `eos_token_id` (int or list).
    Mistral/Qwen2 sliding window W < max_position_embeddings caps max_position_embeddings to
    W (full attention over at most W tokens equals sliding-window attention; logged).
    Matches the fields of transformers' LlamaConfig / MistralConfig / Qwen2Config.
    Raises CheckpointError naming the architecture when it is not supported, or naming the
    config field that is (o_proj/MLP biases, activation other than silu, rope_type).
    """
    archs = list(hf.get("architectures") or [])
    arch = archs[0] if archs else f"(no architectures; model_type={hf.get('model_type')!r})"
    family = HF_ARCHITECTURES.get(arch)
    if family is None:
        raise CheckpointError(f"unsupported architecture {arch}; supported: {sorted(HF_ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{arch}: unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{arch}: mlp_bias=true is not supported")
    if family is not QWEN2 and hf.get("attention_bias"):
        raise CheckpointError(f"{arch}: attention_bias=true (q/k/v/o biases) is not supported")
    theta, scaling = _rope(hf, arch)
    max_pos = int(hf.get("max_position_embeddings", 4096))
    window = _sliding_window(hf, family)
    if window is not None and window < max_pos:
        log.info("%s: sliding_window %d < max_position_embeddings %d: capping the context to %d "
                 "tokens (full attention within the window is exact)", arch, window, max_pos, window)
        max_pos = window
    heads = int(hf["num_attention_heads"])
    eos = token_ids(hf.get("eos_token_id"))
    try:
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=family is QWEN2, family=family.name,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos + tuple(e for e in extra_eos_token_ids if e not in eos),
            dtype=dtype or source_dtype(hf))
    except KeyError as e:
        raise CheckpointError(f"{arch}: config.json lacks {e.args[0]!r}") from None
    except ConfigError as e:
        raise CheckpointError(f"{arch}: {e}") from None
