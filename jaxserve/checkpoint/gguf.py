"""Read a GGUF file (llama.cpp's format) as HF-named, HF-layout float tensors.

Metadata -> ModelConfig (architectures `llama` and `qwen2`); tensors are dequantised one at a
time with `gguf.quants.dequantize` and renamed to HF names with gguf's own `TensorNameMap`,
so the family tables of `families.py` apply unchanged. llama.cpp's converter permutes the
rows of a `llama` model's attn_q / attn_k for its interleaved RoPE; `reverse_permute` undoes
it so the weights are in HF (rotate_half) layout. Qwen2 files are not permuted (llama.cpp
runs Qwen2 with NEOX RoPE, which is rotate_half).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import jax
import numpy as np

from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.checkpoint.families import LLAMA, QWEN2
from jaxserve.checkpoint.gguf_tokenizer import tokenizer_from_gguf_metadata
from jaxserve.config import ConfigError, ModelConfig, RopeScaling
from jaxserve.model.ggml_weight import GGUF_TYPES, GGMLWeight, from_gguf_bytes
from jaxserve.model.layers import rope_inv_freq

log = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {"llama": LLAMA, "qwen2": QWEN2}
_SUFFIXES = (".weight", ".bias")


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of attn_q / attn_k rows.

    w: [n_head * head_dim, ...] (weight [rows, embed] or bias [rows]), any dtype; n_head: the
    query heads for attn_q, the KV heads for attn_k. Within each head llama.cpp stores the
    rows as interleaved pairs; HF keeps the two rotary halves apart. Returns a new array of
    the same shape. Matches transformers' `_reverse_permute_weights` (modeling_gguf_pytorch_utils).
    """
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32(v: Any) -> float:
    """A GGUF float32 value as the shortest decimal that round-trips it (1e-05, not
    9.999999747378752e-06): the value HF's config.json had."""
    return float(str(np.float32(v)))


def _llama3_scaling(freqs: np.ndarray, head_dim: int, theta: float) -> RopeScaling:
    """The RopeScaling that llama.cpp's `rope_freqs` tensor encodes (it stores
    inv_freq / scaled_inv_freq per frequency, from Llama 3.1's `apply_scaling`).

    Llama 3.1/3.2 use low/high freq factors 1/4 over an original 8192 context; the factor is
    the largest ratio. Raises CheckpointError if those do not reproduce `freqs`.
    """
    cand = RopeScaling(factor=float(freqs.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)
    ratio = rope_inv_freq(head_dim, theta, None) / rope_inv_freq(head_dim, theta, cand)
    if freqs.shape != ratio.shape or not np.allclose(freqs, ratio, rtol=1e-4):
        raise CheckpointError("rope_freqs.weight is not Llama 3.1 RoPE scaling "
                              "(factor F, low/high freq factors 1/4, original context 8192)")
    return cand


class GGUFSource:
    """A GGUF file opened for conversion (the `TensorSource` of convert.py).

    Tensor names are HF's; `read` returns float32 (dequantised), in HF layout. Opening reads
    the metadata and memory-maps the tensors. Raises CheckpointError naming the file if it
    is not a readable GGUF, or naming the architecture if it is not supported.
    """

    kind = "gguf"

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        try:
            reader = gguf.GGUFReader(self.path)
        except FileNotFoundError:
            raise CheckpointError(f"{self.path} does not exist") from None
        except Exception as e:  # gguf raises ValueError, struct.error, IndexError, ...
            raise CheckpointError(f"{self.path}: unreadable GGUF file ({type(e).__name__}: {e})") from None
        # The reader itself is not kept: its fields (numpy views per vocabulary entry, ~85 MB
        # for a 49k vocab) would stay alive through the conversion; the tensors keep the map.
        self.metadata: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
        self.arch = self.metadata.get("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise CheckpointError(f"{self.path}: unsupported GGUF architecture {self.arch!r}; "
                                  f"supported: {sorted(GGUF_ARCHITECTURES)}")
        self._tensors = {t.name: t for t in reader.tensors}
        n_blocks = int(self._meta("block_count"))
        model_arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[self.arch]
        self._names = gguf.get_tensor_name_map(model_arch, n_blocks)

    def _meta(self, key: str, default: Any = ...) -> Any:
        """Metadata `{arch}.{key}`; raises CheckpointError naming it if absent and no default."""
        full = f"{self.arch}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is ...:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {full}")
        return default

    @property
    def native_dtype(self) -> str:
        """bfloat16 for a BF16 file, else float32 (what dequantisation yields)."""
        bf16 = self.metadata.get("general.file_type") == gguf.LlamaFileType.MOSTLY_BF16
        return "bfloat16" if bf16 else "float32"

    def model_config(self, dtype: str | None = None) -> ModelConfig:
        """ModelConfig from the `{arch}.*` and `tokenizer.ggml.*` metadata (llama.cpp's keys;
        the vocab size is the length of the token list). Tied embeddings when the file has
        no `output.weight`; q/k/v biases when it has `blk.0.attn_q.bias`. Raises
        CheckpointError for RoPE scaling other than Llama 3.1's or a partial rotary dim."""
        family = GGUF_ARCHITECTURES[self.arch]
        heads = int(self._meta("attention.head_count"))
        hidden = int(self._meta("embedding_length"))
        head_dim = int(self._meta("attention.key_length", hidden // heads))
        if int(self._meta("rope.dimension_count", head_dim)) != head_dim:
            raise CheckpointError(f"{self.path}: partial rotary embeddings are not supported")
        theta = _f32(self._meta("rope.freq_base", 10000.0))
        scaling_type = self._meta("rope.scaling.type", "none")
        if scaling_type != "none":
            raise CheckpointError(f"{self.path}: unsupported RoPE scaling {scaling_type!r}")
        scaling = None
        if "rope_freqs.weight" in self._tensors:
            t = self._tensors["rope_freqs.weight"]
            scaling = _llama3_scaling(gguf.quants.dequantize(t.data, t.tensor_type), head_dim, theta)
        bias = "blk.0.attn_q.bias" in self._tensors
        if bias != (family is QWEN2):
            raise CheckpointError(f"{self.path}: {self.arch} file with{'' if bias else 'out'} "
                                  f"q/k/v biases is not supported")
        md = self.metadata
        eos = [md[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
               if f"tokenizer.ggml.{k}_token_id" in md]
        try:
            return ModelConfig(
                vocab_size=len(md.get("tokenizer.ggml.tokens", ())),
                hidden_size=hidden, intermediate_size=int(self._meta("feed_forward_length")),
                num_layers=int(self._meta("block_count")), num_heads=heads,
                num_kv_heads=int(self._meta("attention.head_count_kv", heads)), head_dim=head_dim,
                rope_theta=theta, rope_scaling=scaling,
                rms_norm_eps=_f32(self._meta("attention.layer_norm_rms_epsilon", 1e-5)),
                max_position_embeddings=int(self._meta("context_length")),
                tie_word_embeddings="output.weight" not in self._tensors,
                attention_bias=bias, family=family.name,
                bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
                eos_token_ids=tuple(dict.fromkeys(eos)), dtype=dtype or self.native_dtype)
        except (ConfigError, TypeError) as e:
            raise CheckpointError(f"{self.path}: {e}") from None

    def _gguf_name(self, name: str) -> str | None:
        return self._names.get_name(name, try_suffixes=_SUFFIXES)

    def tensor_names(self) -> set[str]:
        """Every tensor name in the file (GGUF names)."""
        return set(self._tensors)

    def source_name(self, name: str) -> str | None:
        """The GGUF name of HF tensor `name` (None if it has no GGUF counterpart)."""
        return self._gguf_name(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """HF-order shape of tensor `name` (GGUF lists dims innermost first), or None if absent."""
        t = self._tensors.get(self._gguf_name(name) or "")
        return None if t is None else tuple(int(d) for d in reversed(t.shape.tolist()))

    def describe(self, name: str) -> str:
        """`name` with its GGUF name, for error messages."""
        return f"{name} (GGUF {self._gguf_name(name)})"

    def read(self, name: str) -> np.ndarray:
        """HF tensor `name` as float32 [out, in] (or [n]), dequantised, q/k un-permuted.
        Raises CheckpointError naming the tensor and file if its data cannot be decoded."""
        gname = self._gguf_name(name)
        t = self._tensors[gname]
        try:
            x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot decode tensor {gname} ({e})") from None
        if self.arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            key = "attention.head_count" if ".attn_q." in gname else "attention.head_count_kv"
            x = reverse_permute(x, int(self._meta(key)))
        return x

    def block_format(self, name: str) -> str | None:
        """The GGML block format (jaxserve.model.ggml_weight.GGUF_TYPES: "q4_0", "q4_1",
        "q8_0") HF tensor `name` is stored in, or None for any other type (F32, F16,
        BF16, K-quants: read as floats)."""
        t = self._tensors[self._gguf_name(name)]
        return GGUF_TYPES.get(gguf.GGMLQuantizationType(t.tensor_type).name)

    def read_blocks(self, name: str) -> GGMLWeight:
        """HF tensor `name` [out, in] in its own blocks (GGMLWeight of numpy arrays, rows
        output features as stored), q/k rows un-permuted as `read` does (whole rows move:
        the blocks are unchanged). Raises CheckpointError if it is not in a block format
        (block_format None) or its bytes do not split into blocks."""
        gname = self._gguf_name(name)
        t = self._tensors[gname]
        fmt = self.block_format(name)
        if fmt is None:
            raise CheckpointError(f"{self.path}: tensor {gname} is "
                                  f"{gguf.GGMLQuantizationType(t.tensor_type).name}, not one of "
                                  f"the block formats {sorted(GGUF_TYPES)}")
        try:
            w = from_gguf_bytes(np.asarray(t.data).reshape(int(t.shape[-1]), -1), fmt)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: cannot split tensor {gname} into blocks ({e})") from None
        if self.arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            key = "attention.head_count" if ".attn_q." in gname else "attention.head_count_kv"
            w = jax.tree.map(lambda a: reverse_permute(a, int(self._meta(key))), w)
        return w

    def tokenizer(self) -> tuple[str, dict[str, Any]]:
        """(tokenizer.json text, tokenizer_config dict) built from the GGUF vocabulary; see
        `gguf_tokenizer.tokenizer_from_gguf_metadata`."""
        return tokenizer_from_gguf_metadata(self.metadata, str(self.path))

    def source_info(self) -> dict[str, Any]:
        """Provenance for the checkpoint's config.json."""
        ft = self.metadata.get("general.file_type")
        names = {int(v): v.name for v in gguf.LlamaFileType}
        return {"kind": self.kind, "path": str(self.path), "architecture": self.arch,
                "name": self.metadata.get("general.name"), "file_type": names.get(ft, ft)}
