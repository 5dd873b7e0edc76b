"""Convert an HF model directory or a GGUF file into a jaxserve checkpoint.

    convert("path/to/hf_model", "ckpt/")          # or a .gguf file; dtype="bfloat16" to cast

The source is opened (headers and metadata only), every tensor the family table expects is
checked for presence and shape before any is read, then the params are converted one group
at a time (the non-layer leaves, then runs of layers, see `groups.py`): each tensor read
(dequantised for GGUF), transformed to our layout and cast, and each group saved as soon as
it is complete and then dropped, so host memory peaks near ~2 groups plus the source's own
mapping, not the whole tree (SmolLM2-135M f32: ~0.5 GB of weights, groups of <= 113 MB).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Protocol

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.checkpoint.families import PlannedTensor, tensor_plan
from jaxserve.checkpoint.groups import ParamGroup
from jaxserve.checkpoint.gguf import GGUFSource
from jaxserve.checkpoint.hf import HFSource
from jaxserve.checkpoint.store import write_checkpoint
from jaxserve.config import CONVERTED_QUANTIZATIONS, HF_QUANTIZATIONS, ModelConfig
from jaxserve.model.ggml_weight import GGMLWeight, from_gguf_bytes
from jaxserve.model.params import LayerParams, param_specs

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# what `convert(quantization=)` takes: None (floats; a quantised HF directory in its own
# method), "gguf" (a GGUF file's blocks kept), a quantised HF directory's method, or
# "int8" / "int4" (a float source quantised here); "fp8" is applied when loaded
CONVERT_QUANTIZATIONS = (None, "gguf") + HF_QUANTIZATIONS + CONVERTED_QUANTIZATIONS
# "int8" / "int4": each matrix's GGML format by the ModelConfig.weight_formats name it has
# (the embedding and LM head 8-bit under int4 too, as llama.cpp's Q4_1 files keep theirs:
# a 4-bit LM head costs the most accuracy for the fewest bytes)
_INT4_FORMATS = {"embed": "q8_0", "lm_head": "q8_0", "layers": "q4_1"}
QUANTIZE_FORMATS = {"int8": {"embed": "q8_0", "lm_head": "q8_0", "layers": "q8_0"},
                    "int4": _INT4_FORMATS, "int4_g64": _INT4_FORMATS,
                    "int4_g128": _INT4_FORMATS}
# The inputs the layers' 4-bit matrices share a scale and minimum over (GPTQ / AWQ's "group
# size"): 32 (one GGML block) unless named here. A group of 64 / 128 is written as 2 / 4
# Q4_1 blocks with the group's d and m repeated: the same bytes as group 32, which fits the
# weights more closely, so it is for matching a group-128 recipe, not for memory.
QUANTIZE_GROUPS = {"int4_g64": 64, "int4_g128": 128}
# GGML format -> gguf-py's quantisation type
_GGUF_QTYPES = {"q8_0": "Q8_0", "q4_1": "Q4_1", "q4_0": "Q4_0"}
# Tensors a source may hold that conversion consumes elsewhere or that carry nothing.
_NOT_WEIGHTS = {"rope_freqs.weight"}


class TensorSource(Protocol):
    """What conversion needs from a source (HFSource, GGUFSource). Names are HF tensor names."""

    native_dtype: str

    def model_config(self, dtype: str | None = None) -> ModelConfig: ...
    def tensor_names(self) -> set[str]: ...
    def source_name(self, name: str) -> str | None: ...
    def shape(self, name: str) -> tuple[int, ...] | None: ...
    def describe(self, name: str) -> str: ...
    def read(self, name: str) -> np.ndarray: ...
    def tokenizer(self) -> tuple[str, dict[str, Any]]: ...
    def source_info(self) -> dict[str, Any]: ...


def open_source(src: str | Path) -> HFSource | GGUFSource:
    """An HF directory -> HFSource; a file starting with the GGUF magic -> GGUFSource.
    Raises CheckpointError naming `src` if it is neither (or does not exist)."""
    p = Path(src)
    if p.is_dir():
        return HFSource(p)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{p} is neither an HF model directory nor a GGUF file "
                              f"(starts with {magic!r}, not {GGUF_MAGIC!r})")
    return GGUFSource(p)


def validate(source: TensorSource, plan: list[PlannedTensor]) -> None:
    """Check that every planned tensor exists with its expected HF shape, reading no data.
    Raises CheckpointError naming the first missing or mis-shaped tensor."""
    for t in plan:
        shape = source.shape(t.hf_name)
        if shape is None:
            raise CheckpointError(f"missing tensor {source.describe(t.hf_name)}")
        if tuple(shape) != t.hf_shape:
            raise CheckpointError(f"tensor {source.describe(t.hf_name)} has shape {tuple(shape)}, "
                                  f"expected {t.hf_shape}")


def convert_tensor(source: TensorSource, t: PlannedTensor, dtype: np.dtype) -> np.ndarray:
    """Planned tensor `t` read from `source` (dequantised for GGUF), transformed to our
    layout, as a C-contiguous array of `dtype` and shape `t.shape`. Raises CheckpointError
    if the source cannot read it."""
    x = source.read(t.hf_name)
    return np.ascontiguousarray(t.transform.apply(x, t.shape), dtype=dtype)


def _weight_name(t: PlannedTensor) -> tuple[str, int | None]:
    """(ModelConfig.weight_format's name, layer) of a planned tensor."""
    return (t.path[2], t.path[1]) if t.path[0] == "layers" else (t.path[0], None)


def block_weight_formats(source: GGUFSource | HFSource, plan: list[PlannedTensor]
                         ) -> tuple[tuple[str, str], ...]:
    """ModelConfig.weight_formats for serving a source's block-quantised weights in
    their blocks: every planned matrix (embedding, LM head, projections) whose tensor is
    Q4_0 / Q4_1 / Q8_0 (source.block_format: a GGUF tensor's type, or a quantised HF
    linear's blocks); a projection once for all layers when every layer's has the same
    format, else per layer. Other types (F32, F16, K-quants) stay floats."""
    layers = {t.path[1] for t in plan if t.path[0] == "layers"}
    found: dict[str, dict[int | None, str]] = {}
    for t in plan:
        name, layer = _weight_name(t)
        if len(t.shape) > 1 and (fmt := source.block_format(t.hf_name)) is not None:
            found.setdefault(name, {})[layer] = fmt
    out = []
    for name, per_layer in found.items():
        if None in per_layer:  # embed / lm_head
            out.append((name, per_layer[None]))
        elif set(per_layer) == layers and len(set(per_layer.values())) == 1:
            out.append((name, per_layer[min(layers)]))
        else:
            out += [(f"layers.{i}.{name}", f) for i, f in sorted(per_layer.items())]
    return tuple(out)


def checked_quantization(source: TensorSource, quantization: str | None) -> str | None:
    """The quantization `source` is converted with: `quantization`, or for None a quantised
    HF directory's own method (vLLM's detection from quantization_config). Raises
    CheckpointError when they disagree: "gguf" for a non-GGUF source, an HF method for a
    directory not quantised so, "int8" / "int4" for a directory already quantised."""
    own = getattr(source, "quantization", None)  # an HFSource's QuantScheme
    if quantization == "gguf" and not isinstance(source, GGUFSource):
        raise CheckpointError(f"quantization 'gguf' serves a GGUF file's own blocks; {source.path} "
                              "is a Hugging Face directory")
    if quantization in CONVERTED_QUANTIZATIONS and own is not None:
        raise CheckpointError(f"quantization {quantization!r} quantises float weights; "
                              f"{source.path} is already quantised ({own.method})")
    if quantization in HF_QUANTIZATIONS and (own is None or own.method != quantization):
        found = f"is {own.method}" if own is not None else "has no quantization_config"
        raise CheckpointError(f"quantization {quantization!r}: {source.path} {found}")
    if quantization is None and own is not None:
        return own.method
    return quantization


def quantized_weight_formats(plan: list[PlannedTensor], quantization: str
                             ) -> tuple[tuple[str, str], ...]:
    """ModelConfig.weight_formats for quantising a float source's matrices
    (QUANTIZE_FORMATS[quantization]): every projection, the embedding and the LM head.
    Raises CheckpointError naming the first matrix whose inputs are not whole blocks of
    32 (before any tensor is read)."""
    for t in plan:
        if len(t.hf_shape) > 1 and t.hf_shape[-1] % 32:
            raise CheckpointError(f"quantization {quantization!r}: tensor {t.hf_name} has "
                                  f"{t.hf_shape[-1]} inputs, not whole GGML blocks of 32")
    formats = QUANTIZE_FORMATS[quantization]
    names = dict.fromkeys(_weight_name(t)[0] for t in plan if len(t.shape) > 1)
    return tuple((n, formats[n if n in ("embed", "lm_head") else "layers"]) for n in names)


def quantize_blocks(x: np.ndarray, fmt: str, group: int = 32) -> GGMLWeight:
    """A float matrix x [out, in] (in a multiple of 32) as GGML blocks of `fmt` ("q8_0",
    "q4_1", "q4_0"), quantised by gguf-py (gguf.quants.quantize: llama.cpp's reference
    quantize_row_*: Q8_0 d = absmax / 127; Q4_1 d = (max - min) / 15, m = min; per block
    of 32). group (q4_1 only): 64 or 128 inputs share d and m, computed over the group
    exactly as quantize_row_q4_1_ref computes them over a block (q = min(15, trunc((x -
    min) / d + 0.5)), d and m stored f16), written as the group's blocks with d and m
    repeated; the last group may be shorter (whole blocks: SmolLM2's 576 inputs are 4.5
    groups of 128, as GPTQ groups them). Raises CheckpointError if `in` is not whole
    blocks, or for a group other than 32 with another format."""
    import gguf
    if x.ndim != 2 or x.shape[1] % 32 or group % 32:
        raise CheckpointError(f"a matrix of shape {x.shape} is not whole blocks of 32 inputs "
                              f"(groups of {group})")
    if group != 32:
        if fmt != "q4_1":
            raise CheckpointError(f"groups of {group} inputs are written as q4_1 blocks, not {fmt}")
        return _q4_1_groups(np.ascontiguousarray(x, np.float32), group)
    qtype = gguf.GGMLQuantizationType[_GGUF_QTYPES[fmt]]
    return from_gguf_bytes(gguf.quants.quantize(np.ascontiguousarray(x, np.float32), qtype), fmt)


def _q4_1_groups(x: np.ndarray, group: int) -> GGMLWeight:
    """x [out, in] f32 as Q4_1 blocks whose d and m are per `group` inputs (ggml's
    quantize_row_q4_1_ref over a group: d = (max - min) / 15, id = 1 / d (0 for d 0),
    q = min(15, (int)((x - min) * id + 0.5)), all in f32; d and m stored as f16)."""
    out, n = x.shape
    groups = -(-n // group)
    # a shorter last group: padded with its own last input (its min and max unchanged)
    g = np.pad(x, ((0, 0), (0, groups * group - n)), mode="edge").reshape(out, groups, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    d = (hi - lo) / np.float32(15)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.minimum(15, ((g - lo[..., None]) * inv[..., None] + np.float32(0.5)).astype(np.int32))
    q = q.astype(np.uint8).reshape(out, groups * group)[:, :n].reshape(out, n // 32, 32)
    reps = [group // 32] * (n // group) + ([n % group // 32] if n % group else [])
    return GGMLWeight(qs=(q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8),
                      d=np.repeat(d.astype(np.float16), reps, axis=1),
                      m=np.repeat(lo.astype(np.float16), reps, axis=1), fmt="q4_1")


def convert_group(source: TensorSource, group: ParamGroup, plan: list[PlannedTensor],
                  dtype: np.dtype, on_tensor: Callable[[], Any] = lambda: None,
                  cfg: ModelConfig | None = None, quantize: str | None = None) -> Any:
    """The subtree of `group` (as `ParamGroup.subtree` lays it out) converted from `source`
    tensor by tensor with `convert_tensor`, calling `on_tensor()` after each. plan: the
    validated `tensor_plan(cfg)`. cfg: the ModelConfig written, whose weight_formats name
    the weights kept in their GGML blocks (GGMLWeight leaves as param_specs(cfg) lays them
    out; `source` a GGUFSource or a quantised HFSource: its read_blocks, or with
    `quantize` any source's float matrices quantised by `quantize_blocks`); None: all
    floats. quantize: None, or the quantization (QUANTIZE_FORMATS' name; its layers'
    group size QUANTIZE_GROUPS'). Raises CheckpointError for an unreadable tensor."""
    specs = param_specs(cfg) if cfg is not None and cfg.weight_formats else None
    layers_group = QUANTIZE_GROUPS.get(quantize, 32)

    def one(t: PlannedTensor) -> Any:
        spec = specs
        for k in t.path if specs is not None else ():
            spec = spec[k] if isinstance(k, int) else getattr(spec, k)
        if isinstance(spec, GGMLWeight) and quantize:  # a float matrix [out, in] quantised
            group = layers_group if t.path[0] == "layers" else 32
            w = quantize_blocks(np.asarray(source.read(t.hf_name), np.float32), spec.fmt, group)
            x = dataclasses.replace(w, logical_shape=spec.logical_shape)
        elif isinstance(spec, GGMLWeight):  # stored as in the file: no transform, no cast
            w = source.read_blocks(t.hf_name)
            x = dataclasses.replace(w, logical_shape=spec.logical_shape)
        else:
            x = convert_tensor(source, t, dtype)
        on_tensor()
        return x

    if group.layers is None:
        return {t.path[0]: one(t) for t in plan if t.path[0] != "layers"}
    return tuple(LayerParams(**{t.path[2]: one(t) for t in plan if t.path[:2] == ("layers", i)})
                 for i in group.layers)


def _warn_unused(source: TensorSource, plan: list[PlannedTensor]) -> None:
    """Log a warning naming the source tensors (up to 5) that `plan` does not use."""
    used = {source.source_name(t.hf_name) for t in plan} | _NOT_WEIGHTS
    unused = sorted(source.tensor_names() - used)
    if unused:
        log.warning("ignored %d tensor(s) the model does not use: %s%s", len(unused),
                    ", ".join(unused[:5]), ", ..." if len(unused) > 5 else "")


def convert(src: str | Path, out: str | Path, dtype: str | None = None,
            progress: bool = True, quantization: str | None = None) -> Path:
    """Convert an HF model directory or GGUF file `src` into a checkpoint at `out`.

    dtype: "float32" / "bfloat16", or None for the source's own (bf16 HF stays bf16;
    quantised GGUF becomes float32). quantization: None (every weight dequantised to
    `dtype`; but a quantised HF directory is converted in its own method, as vLLM serves
    it); "gguf" (a GGUF file's Q4_0 / Q4_1 / Q8_0 matrices kept in their blocks:
    block_weight_formats; norms and other types in `dtype`; q / k rows un-permuted as
    whole rows); "gptq" / "awq" / "compressed-tensors" (an HF directory quantised so, its
    linear layers' codes kept as GGML blocks: jaxserve.checkpoint.hf_quantized); or
    "int8" / "int4" (any float source's matrices quantised here: QUANTIZE_FORMATS, by
    gguf-py's own Q8_0 / Q4_1 quantisers, llama.cpp's reference ones). Norms and other
    small tensors stay in `dtype`. Every tensor is validated first; then the params are
    converted and saved one group at a time (`write_checkpoint`), with a tqdm bar of
    tensors unless `progress` is False. Returns the checkpoint path. Raises CheckpointError
    (one line naming the architecture / tensor / file) for anything wrong with the source;
    OSError if `out` cannot be written.
    """
    if quantization not in CONVERT_QUANTIZATIONS:
        raise CheckpointError(f"quantization must be one of {CONVERT_QUANTIZATIONS}, got "
                              f"{quantization!r}")
    source = open_source(src)
    quantization = checked_quantization(source, quantization)
    cfg = source.model_config(dtype)
    plan = tensor_plan(cfg)
    validate(source, plan)
    quantize = quantization in CONVERTED_QUANTIZATIONS
    if quantize:
        cfg = cfg.replace(weight_formats=quantized_weight_formats(plan, quantization))
    elif quantization is not None:
        cfg = cfg.replace(weight_formats=block_weight_formats(source, plan))
    log.info("converting %s (%s, %d layers, %s%s) -> %s", source.path, cfg.family,
             cfg.num_layers, cfg.dtype,
             f", {quantization} blocks kept" if cfg.weight_formats else "", out)
    _warn_unused(source, plan)
    tokenizer_json, tokenizer_config = source.tokenizer()
    info = {**source.source_info(), "native_dtype": source.native_dtype}
    np_dtype = jnp.dtype(cfg.dtype)
    with tqdm(total=len(plan), desc="converting", unit="tensor", disable=not progress) as bar:
        return write_checkpoint(out, cfg, lambda g: convert_group(
            source, g, plan, np_dtype, bar.update, cfg, quantization if quantize else None),
                                tokenizer_json, tokenizer_config, info)
