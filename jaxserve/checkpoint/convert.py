"""Convert an HF model directory or a GGUF file into a jaxserve checkpoint.

    convert("path/to/hf_model", "ckpt/")          # or a .gguf file; dtype="bfloat16" to cast

The source is opened (headers and metadata only), every tensor the family table expects is
checked for presence and shape before any is read, then tensors are streamed one at a
time: read (dequantised for GGUF), transformed to our layout, cast, and the source copy
dropped, so host memory peaks near one copy of the converted weights.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.checkpoint.families import PlannedTensor, tensor_plan
from jaxserve.checkpoint.gguf import GGUFSource
from jaxserve.checkpoint.hf import HFSource
from jaxserve.checkpoint.store import save_checkpoint
from jaxserve.config import ModelConfig
from jaxserve.model.params import LayerParams, Params

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
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


def _assemble(cfg: ModelConfig, leaves: dict[tuple, np.ndarray]) -> Params:
    """Params from {path: array} as `tensor_plan` names the paths."""
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(cfg.num_layers)]
    top: dict[str, np.ndarray] = {}
    for path, x in leaves.items():
        if path[0] == "layers":
            layers[path[1]][path[2]] = x
        else:
            top[path[0]] = x
    return Params(layers=tuple(LayerParams(**d) for d in layers), **top)


def convert_params(source: TensorSource, cfg: ModelConfig, progress: bool = True) -> Params:
    """The Params tree of `source` for `cfg` as C-contiguous numpy arrays in `cfg.dtype`
    (bfloat16 = ml_dtypes.bfloat16), streamed tensor by tensor with a tqdm bar.
    Raises CheckpointError for a missing / mis-shaped / unreadable tensor."""
    plan = tensor_plan(cfg)
    validate(source, plan)
    dtype = jnp.dtype(cfg.dtype)
    leaves: dict[tuple, np.ndarray] = {}
    for t in tqdm(plan, desc="converting", unit="tensor", disable=not progress):
        x = source.read(t.hf_name)
        leaves[t.path] = np.ascontiguousarray(t.transform.apply(x, t.shape), dtype=dtype)
        del x
    used = {source.source_name(t.hf_name) for t in plan} | _NOT_WEIGHTS
    unused = sorted(source.tensor_names() - used)
    if unused:
        log.warning("ignored %d tensor(s) the model does not use: %s%s", len(unused),
                    ", ".join(unused[:5]), ", ..." if len(unused) > 5 else "")
    return _assemble(cfg, leaves)


def convert(src: str | Path, out: str | Path, dtype: str | None = None,
            progress: bool = True) -> Path:
    """Convert an HF model directory or GGUF file `src` into a checkpoint at `out`.

    dtype: "float32" / "bfloat16", or None for the source's own (bf16 HF stays bf16;
    quantised GGUF becomes float32). Returns the checkpoint path. Raises CheckpointError
    (one line naming the architecture / tensor / file) for anything wrong with the source;
    OSError if `out` cannot be written.
    """
    source = open_source(src)
    cfg = source.model_config(dtype)
    log.info("converting %s (%s, %d layers, %s) -> %s", source.path, cfg.family, cfg.num_layers,
             cfg.dtype, out)
    tokenizer_json, tokenizer_config = source.tokenizer()
    info = {**source.source_info(), "native_dtype": source.native_dtype}
    params = convert_params(source, cfg, progress)
    del source  # unmap the source file before the save
    return save_checkpoint(out, cfg, params, tokenizer_json, tokenizer_config, info)
