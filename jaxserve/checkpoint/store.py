"""The jaxserve checkpoint directory: what conversion writes and the engine loads.

    config.json            {"format": "jaxserve-checkpoint", "version": 2,
                            "model": ModelConfig.to_dict(), "source": {...provenance},
                            "param_groups": [[0, 4], [4, 8], ...]}
    tokenizer.json         a `tokenizers` tokenizer
    tokenizer_config.json  chat_template, bos/eos/pad/unk tokens, add_bos_token
    params/<group>/        one orbax StandardCheckpointer save per group of the `Params`
                           tree: params/top and params/layers_000-003, ... (see groups.py)

Version 1 saved the whole tree as one orbax item; it is refused with a message to convert
again. `write_checkpoint` asks for the groups one at a time and saves each as it comes,
so a streaming converter never holds the whole tree.

Writes are atomic: everything goes into a temp directory beside `out_dir` and is renamed
into place last, so an interrupted conversion never leaves a directory that
`is_checkpoint` accepts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import orbax.checkpoint as ocp

from jaxserve.checkpoint.errors import CheckpointError
from jaxserve.checkpoint.groups import (ParamGroup, assemble_params, decode_groups, encode_groups,
                                        param_groups)
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.model.params import Params, abstract_params
from jaxserve.distributed.sharding import ShardingRules

FORMAT = "jaxserve-checkpoint"
VERSION = 2
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"


def _load_header(ckpt_dir: Path) -> dict[str, Any]:
    """The parsed config.json of a jaxserve checkpoint of any version. Raises
    CheckpointError if it is unreadable or lacks the format marker."""
    try:
        header = json.loads((ckpt_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt_dir} is not a jaxserve checkpoint ({CONFIG_FILE}: {e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt_dir} is not a jaxserve checkpoint ({CONFIG_FILE} has no "
                              f"\"format\": \"{FORMAT}\")")
    return header


def _read_header(ckpt_dir: Path) -> dict[str, Any]:
    """The header of a checkpoint of this VERSION; CheckpointError (telling the user to
    convert again) for any other version."""
    header = _load_header(ckpt_dir)
    if header.get("version") != VERSION:
        raise CheckpointError(f"{ckpt_dir}: checkpoint version {header.get('version')!r} is not "
                              f"supported (expected {VERSION}); convert the model again "
                              f"(jaxserve convert SRC {ckpt_dir})")
    return header


def is_checkpoint(ckpt_dir: str | Path) -> bool:
    """True if `ckpt_dir` is a complete jaxserve checkpoint of this version (header,
    tokenizer, params)."""
    d = Path(ckpt_dir)
    try:
        _read_header(d)
    except CheckpointError:
        return False
    return (d / "tokenizer.json").is_file() and (d / PARAMS_DIR).is_dir()


def _replaceable(out: Path) -> bool:
    """True if `out` may be overwritten: absent, an empty directory, or a jaxserve
    checkpoint of any version."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return True
    try:
        _load_header(out)
    except CheckpointError:
        return False
    return True


def _check_tree(got: Any, want: Any, name: Callable[[tuple], str] = jax.tree_util.keystr) -> None:
    """Raise CheckpointError unless `got` has the structure of `want` (ShapeDtypeStructs)
    and each leaf its shape and dtype; `name(keypath)` names a leaf in the message."""
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    if want_def != got_def:
        raise CheckpointError(f"param tree structure does not match the ModelConfig: {got_def} vs {want_def}")
    for (path, w), (_, g) in zip(want_leaves, got_leaves, strict=True):
        if tuple(g.shape) != w.shape or g.dtype != w.dtype:
            raise CheckpointError(f"param {name(path)}: expected {w.shape} {w.dtype}, "
                                  f"got {tuple(g.shape)} {g.dtype}")


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, replacing an existing `out` (moved aside, then deleted)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(out_dir: str | Path, model_cfg: ModelConfig,
                     make_group: Callable[[ParamGroup], Any], tokenizer_json: str,
                     tokenizer_config: Mapping[str, Any], source_info: Mapping[str, Any]) -> Path:
    """Write a checkpoint to `out_dir` atomically, group by group; return its absolute path.

    make_group(group) is called once per group of `param_groups(model_cfg)`, in order (top
    first), and returns that group's subtree as `ParamGroup.subtree` lays it out: numpy
    (or jax) arrays of the shapes and dtype of `abstract_params(model_cfg)`. Each is saved
    as soon as it is returned and not kept, so a `make_group` that converts on demand
    keeps host memory near ~2 groups (one being written while the next is made).
    tokenizer_json: tokenizer.json text; tokenizer_config / source_info: JSON-serialisable.

    An existing checkpoint of any version (or an empty directory) at `out_dir` is
    replaced; anything else there is refused before `make_group` is called. Raises
    CheckpointError for a non-checkpoint `out_dir` or a subtree of the wrong structure,
    shape or dtype; whatever `make_group` raises; OSError. Nothing is left behind on error.
    """
    out = Path(out_dir).resolve()
    if not _replaceable(out):
        raise CheckpointError(f"{out} exists and is not a jaxserve checkpoint; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    (tmp / PARAMS_DIR).mkdir(parents=True)
    try:
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(dict(tokenizer_config), indent=2, ensure_ascii=False), encoding="utf-8")
        abstract, groups = abstract_params(model_cfg), param_groups(model_cfg)
        # The checkpointer saves asynchronously: writing group k overlaps making k+1.
        with ocp.StandardCheckpointer() as ckptr:
            for group in groups:
                tree = group.stored(make_group(group))
                _check_tree(tree, group.subtree(abstract), group.leaf_name)
                # jax Arrays (device_put of host numpy on CPU aliases it) cost orbax less
                # host memory than numpy leaves (PERFORMANCE.md, "Measurements behind the code").
                ckptr.save(tmp / PARAMS_DIR / group.name, jax.tree.map(jax.device_put, tree))
                del tree  # before the next group is made
        header = {"format": FORMAT, "version": VERSION, "model": model_cfg.to_dict(),
                  "source": dict(source_info), "param_groups": encode_groups(groups)}
        (tmp / CONFIG_FILE).write_text(json.dumps(header, indent=2), encoding="utf-8")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def save_checkpoint(out_dir: str | Path, model_cfg: ModelConfig, params: Params,
                    tokenizer_json: str, tokenizer_config: Mapping[str, Any],
                    source_info: Mapping[str, Any]) -> Path:
    """Write a whole in-memory Params tree as a checkpoint (`write_checkpoint` with each
    group taken from `params`); return its absolute path.

    params: numpy (or jax) arrays, every leaf of the shape and dtype
    `abstract_params(model_cfg)` gives. Raises CheckpointError for a mismatched tree
    (before anything is written) or a non-checkpoint `out_dir`; OSError.
    """
    _check_tree(params, abstract_params(model_cfg))
    return write_checkpoint(out_dir, model_cfg, lambda g: g.subtree(params), tokenizer_json,
                            tokenizer_config, source_info)


def load_model_config(ckpt_dir: str | Path) -> ModelConfig:
    """The ModelConfig a checkpoint was saved with. Raises CheckpointError naming the
    directory if it is not a (supported) jaxserve checkpoint."""
    d = Path(ckpt_dir)
    header = _read_header(d)
    try:
        return ModelConfig.from_dict(header["model"])
    except (KeyError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{d}/{CONFIG_FILE}: invalid model config ({e})") from None


def load_params(ckpt_dir: str | Path, model_cfg: ModelConfig,
                rules: ShardingRules | None = None) -> Params:
    """Restore the Params tree of a checkpoint as jax Arrays in `model_cfg.dtype` (cast on
    restore if the checkpoint was saved in another dtype), placed on the shardings of
    `abstract_params(model_cfg, rules)` (the default device when `rules` is None; with
    pipeline stages each layer on its stage's devices only). Each group is restored
    straight onto its target shardings (each device reads its shard).
    A `model_cfg` with fewer layers than the checkpoint (Config.num_layers) gets its
    first layers; the groups past them are not read.

    Raises CheckpointError if the directory is not a checkpoint of this version, its
    param_groups are invalid, or `model_cfg`'s shapes differ from the saved ones.
    """
    d = Path(ckpt_dir).resolve()
    header = _read_header(d)
    saved = load_model_config(d)
    n = model_cfg.num_layers
    if n > saved.num_layers or abstract_params(saved.replace(dtype=model_cfg.dtype, num_layers=n)) \
            != abstract_params(model_cfg):
        raise CheckpointError(f"{d}: the ModelConfig asked for has other param shapes than the "
                              f"checkpoint's ({model_cfg} vs {saved})")
    try:
        groups = decode_groups(header.get("param_groups"), saved.num_layers)
    except ValueError as e:
        raise CheckpointError(f"{d}/{CONFIG_FILE}: invalid param_groups ({e})") from None
    groups = [g for g in groups if g.layers is None or g.layers.start < n]
    # the last group read may hold layers past n: restore it whole, keep the first n
    target = abstract_params(model_cfg.replace(num_layers=groups[-1].layers.stop)
                             if len(groups) > 1 else model_cfg, rules, staged_layers=n)
    if rules is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), target)
    with ocp.StandardCheckpointer() as ckptr:
        params = assemble_params((g, ckptr.restore(d / PARAMS_DIR / g.name, g.subtree(target)))
                                 for g in groups)
    return dataclasses.replace(params, layers=params.layers[:n])


def truncate_checkpoint(src: str | Path, out: str | Path, num_layers: int) -> Path:
    """Write a copy of checkpoint `src` keeping its first `num_layers` decoder layers (and
    its embedding, final norm and LM head, config and tokenizer): a draft model for
    speculative decoding that shares the model's tokenizer when no smaller sibling is at
    hand (the layers' output is read through the full model's head, as in early-exit /
    self-speculative drafting: Elhoushi et al. 2024, "LayerSkip"). Returns its path.
    Raises CheckpointError for a `src` that is not a checkpoint; ValueError unless
    1 <= num_layers <= its layers."""
    src = Path(src)
    cfg = load_model_config(src)
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be in 1..{cfg.num_layers}, got {num_layers}")
    params = load_params(src, cfg)
    small = cfg.replace(num_layers=num_layers)
    params = dataclasses.replace(params, layers=tuple(params.layers[:num_layers]))
    tok_config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    header = _read_header(src)
    info = {"truncated_from": str(src.resolve()), "num_layers": num_layers,
            "of": cfg.num_layers, "source": header.get("source", {})}
    return save_checkpoint(out, small, jax.device_get(params),
                           (src / "tokenizer.json").read_text(encoding="utf-8"), tok_config, info)
