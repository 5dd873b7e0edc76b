"""Read a Hugging Face model directory: config.json, safetensors shards, tokenizer files.

Tensors are streamed one at a time with `safetensors.safe_open` (memory-mapped; only the
tensor asked for is copied). Shards come from `model.safetensors.index.json` when present,
else every `*.safetensors` file in the directory. A weight-only quantised directory
(GPTQ, AWQ, compressed-tensors: jaxserve.checkpoint.hf_quantized) shows each quantised
linear layer as one `<layer>.weight` [out, in] in place of its stored parts, readable as
GGML blocks (`read_blocks`) or dequantised (`read`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxserve.checkpoint import hf_quantized
from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.checkpoint.families import model_config_from_hf, source_dtype, token_ids
from jaxserve.config import ModelConfig
from jaxserve.model.ggml_weight import GGMLWeight, dequantize

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtypes its numpy API cannot return (it asks numpy for a float8 type numpy
# lacks: safetensors issue #682): read from the file's bytes as ml_dtypes' types instead
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def read_raw_tensor(path: Path, name: str, dtype: str) -> np.ndarray:
    """Tensor `name` of safetensors file `path` as a numpy array of RAW_DTYPES[dtype], read
    from the file's bytes: an 8-byte little-endian header length, the JSON header (each
    tensor's dtype, shape and data_offsets into the data after the header), the data
    (the safetensors format). Raises CheckpointError naming the file if it does not hold
    the tensor as described."""
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            info = json.loads(fh.read(n))[name]
            begin, end = info["data_offsets"]
            fh.seek(8 + n + begin)
            data = fh.read(end - begin)
        out = np.frombuffer(data, np.uint8).view(RAW_DTYPES[dtype]).reshape(info["shape"])
    except (OSError, KeyError, ValueError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read tensor {name} ({e})") from None
    return out.copy()


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file. Raises CheckpointError naming the file if it is missing,
    unreadable or not a JSON object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _shard_files(path: Path) -> list[Path]:
    """The safetensors files of the model: those named by the index, else all in `path`."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f} is listed in {INDEX_FILE} but does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (only safetensors weights are supported)")
    return files


class HFSource:
    """An HF model directory opened for conversion (the `TensorSource` of convert.py).

    Tensor names are HF's (`model.layers.0.self_attn.q_proj.weight`). Opening reads only
    config.json and the safetensors headers. `quantization`: the checkpoint's
    hf_quantized.QuantScheme, None when unquantised. Raises CheckpointError naming the file
    when config.json is missing/invalid or a safetensors file is unreadable or truncated,
    and naming the field when its quantization_config is not served.
    """

    kind = "hf_dir"

    def __init__(self, path: str | Path):
        self.path = Path(path).resolve()
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory")
        self.hf_config = read_json(self.path / "config.json")
        gen = self.path / "generation_config.json"
        self._gen_eos = read_json(gen).get("eos_token_id") if gen.is_file() else None
        self._files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._raw: dict[str, str] = {}  # tensors read from their bytes: name -> dtype
        for f in _shard_files(self.path):
            try:
                with safe_open(f, framework="numpy") as st:
                    for name in st.keys():
                        self._files[name] = f
                        sl = st.get_slice(name)
                        self._shapes[name] = tuple(sl.get_shape())
                        if sl.get_dtype() in RAW_DTYPES:
                            self._raw[name] = sl.get_dtype()
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None
        self.quantization = hf_quantized.quant_scheme(self.hf_config, self.path)
        # quantised linear layers: their "<prefix>.weight" name -> (prefix, (out, in))
        self._linears: dict[str, tuple[str, tuple[int, int]]] = {}
        self._act_ordered: set[str] = set()  # of those, the ones read dequantised
        if self.quantization is not None:
            for prefix in hf_quantized.linear_prefixes(self.quantization, set(self._files)):
                shape = hf_quantized.check_parts(self.quantization, prefix, self._shapes.get)
                self._linears[f"{prefix}.weight"] = (prefix, shape)
                if hf_quantized.act_order(self.quantization, prefix, shape[1],
                                          self._read_stored, self._files.__contains__) is not None:
                    self._act_ordered.add(f"{prefix}.weight")
        if self._act_ordered:
            log.warning("%d of %d quantised linear layers have activation-ordered groups "
                        "(desc_act / actorder): served dequantised to the model's dtype, not "
                        "in blocks", len(self._act_ordered), len(self._linears))

    @property
    def native_dtype(self) -> str:
        """The dtype the weights are stored in, as our dtype name (see `source_dtype`)."""
        return source_dtype(self.hf_config)

    def model_config(self, dtype: str | None = None) -> ModelConfig:
        """ModelConfig of config.json (+ generation_config.json's eos ids); see
        `families.model_config_from_hf`."""
        return model_config_from_hf(self.hf_config, dtype, token_ids(self._gen_eos))

    def tensor_names(self) -> set[str]:
        """Every tensor name in the shards, a quantised linear's parts as its one weight."""
        if not self._linears:
            return set(self._files)
        parts = {n for prefix, _ in self._linears.values()
                 for n in hf_quantized.part_names(self.quantization, prefix)}
        return (set(self._files) - parts) | set(self._linears)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of tensor `name` as stored ([out, in] for a quantised linear's weight), or
        None if absent."""
        if name in self._linears:
            return self._linears[name][1]
        return self._shapes.get(name)

    def source_name(self, name: str) -> str | None:
        """The stored name of tensor `name` (the same for HF), None if absent."""
        return name if name in self._files or name in self._linears else None

    def block_format(self, name: str) -> str | None:
        """The GGML block format ("q4_0", "q4_1", "q8_0") quantised linear weight `name` is
        read in (hf_quantized.block_format: from its zero points), None for a float
        tensor or an act-ordered layer (read dequantised)."""
        if name not in self._linears or self._read_as_floats(name):
            return None
        return hf_quantized.block_format(self.quantization, self._linears[name][0],
                                         self._read_stored, self._files.__contains__)

    def read_blocks(self, name: str) -> GGMLWeight:
        """Quantised linear weight `name` [out, in] as GGML blocks (GGMLWeight of numpy
        arrays; hf_quantized.read_blocks). Raises CheckpointError if it is not quantised or
        its parts are missing or mis-shaped."""
        if name not in self._linears:
            raise CheckpointError(f"{self.path}: tensor {name} is not a quantised linear layer")
        return hf_quantized.read_blocks(self.quantization, self._linears[name][0],
                                        self._read_stored, self._files.__contains__)

    def describe(self, name: str) -> str:
        """`name` for error messages."""
        return name

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as a numpy array in its stored dtype (bf16 as ml_dtypes.bfloat16);
        a quantised linear's weight dequantised from its blocks (f32 [out, in]). Raises
        CheckpointError naming the file if its data cannot be read."""
        if self._read_as_floats(name):
            return hf_quantized.dequantize_linear(self.quantization, self._linears[name][0],
                                                  self._read_stored, self._files.__contains__)
        if name in self._linears:
            return np.asarray(dequantize(self.read_blocks(name)))
        return self._read_stored(name)

    def _read_as_floats(self, name: str) -> bool:
        """Whether quantised linear weight `name` is read dequantised, not as blocks: an
        act-ordered layer, or compressed-tensors fp8 weights."""
        return name in self._act_ordered or (name in self._linears
                                             and self.quantization.float_weights)

    def _read_stored(self, name: str) -> np.ndarray:
        """Stored tensor `name` as a numpy array in its stored dtype (fp8 as
        ml_dtypes.float8_e4m3fn / e5m2: read_raw_tensor)."""
        f = self._files[name]
        if name in self._raw:
            return read_raw_tensor(f, name, self._raw[name])
        try:
            with safe_open(f, framework="numpy") as st:
                return st.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: cannot read tensor {name} ({e})") from None

    def tokenizer(self) -> tuple[str, dict[str, Any]]:
        """(tokenizer.json text, tokenizer_config.json dict), copied through; a
        chat_template.jinja (transformers 5 writes the template there) is folded into the
        dict's `chat_template`. Raises CheckpointError if tokenizer.json is missing."""
        tok_file = self.path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(f"{tok_file} does not exist (a tokenizers-format tokenizer is required)")
        tok_cfg_file = self.path / "tokenizer_config.json"
        tok_cfg = read_json(tok_cfg_file) if tok_cfg_file.is_file() else {}
        jinja = self.path / "chat_template.jinja"
        if "chat_template" not in tok_cfg and jinja.is_file():
            tok_cfg["chat_template"] = jinja.read_text(encoding="utf-8")
        return tok_file.read_text(encoding="utf-8"), tok_cfg

    def source_info(self) -> dict[str, Any]:
        """Provenance for the checkpoint's config.json."""
        info = {"kind": self.kind, "path": str(self.path),
                "architecture": (self.hf_config.get("architectures") or [None])[0],
                "files": sorted({f.name for f in self._files.values()})}
        if self.quantization is not None:
            info["quantization"] = self.quantization.describe()
        return info
