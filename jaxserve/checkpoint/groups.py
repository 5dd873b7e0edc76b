"""How a checkpoint's Params tree is split into orbax items ("groups") under `params/`.

Conversion saves each group as soon as its tensors are converted and then drops it, so
host memory peaks near one group instead of the whole tree (plus orbax's own copy of it):

    params/top                {"embed", "final_norm"[, "lm_head"]}   the non-layer leaves
    params/layers_000-003     (LayerParams, ...) of layers 0..3      runs of consecutive
    params/layers_004-007     ...                                    layers, ~GROUP_BYTES each

The layer runs are recorded in the checkpoint header (`encode_groups` / `decode_groups`),
so a later change of GROUP_BYTES does not change how existing checkpoints load.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import jax

from jaxserve.config import ModelConfig
from jaxserve.model.params import LayerParams, Params, ParamSpec, param_specs, spec_dtype

# Target size of one layer group in bytes (in the checkpoint dtype). Large enough that
# orbax's per-item overhead (~10s of ms) is paid a few times, small enough that a group is
# a small fraction of the weights. A layer bigger than this is a group of its own.
GROUP_BYTES = 64 * 2**20
TOP_LEAVES = ("embed", "final_norm", "lm_head")


# A LayerParams as checkpoints hold it: the weights, without what the engine adds when it
# serves (LayerParams.lora, the LoRA slots), so that the stored tree's keys stay those of
# every checkpoint written before (orbax compares them by name).
_STORED = [f for f in dataclasses.fields(LayerParams) if f.name != "lora"]
StoredLayer = jax.tree_util.register_dataclass(
    dataclasses.make_dataclass("StoredLayer", [
        (f.name, Any) if f.default is dataclasses.MISSING else (f.name, Any, f.default)
        for f in _STORED], frozen=True),
    data_fields=[f.name for f in _STORED], meta_fields=[])


def stored_layer(lp: LayerParams):
    """`lp` as a StoredLayer. Raises ValueError for a layer with LoRA slots."""
    if lp.lora is not None:
        raise ValueError("a layer with LoRA slots is not stored (they are the engine's)")
    return StoredLayer(**{f.name: getattr(lp, f.name) for f in dataclasses.fields(StoredLayer)})


def served_layer(stored) -> LayerParams:
    """A StoredLayer as the LayerParams the model reads."""
    return LayerParams(**{f.name: getattr(stored, f.name) for f in dataclasses.fields(stored)})


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """One orbax item of the params: the non-layer leaves (`layers` None) or the
    consecutive layers `layers` (a range of layer indices)."""

    layers: range | None = None

    @property
    def name(self) -> str:
        """Its directory under params/: "top" or "layers_004-007" (first-last, inclusive)."""
        if self.layers is None:
            return "top"
        return f"layers_{self.layers.start:03d}-{self.layers.stop - 1:03d}"

    def subtree(self, params: Params) -> dict[str, Any] | tuple[StoredLayer, ...]:
        """This group's part of `params` (arrays, ShapeDtypeStructs, ...): a dict of the
        non-None top leaves, or the tuple of its layers (as StoredLayers)."""
        if self.layers is None:
            return {k: getattr(params, k) for k in TOP_LEAVES if getattr(params, k) is not None}
        return tuple(stored_layer(params.layers[i]) for i in self.layers)

    def stored(self, tree):
        """A subtree as `subtree` lays it out, from one whose layers may be LayerParams."""
        if self.layers is None:
            return tree
        return tuple(stored_layer(x) if isinstance(x, LayerParams) else x for x in tree)

    def leaf_name(self, keypath: tuple) -> str:
        """The Params name ("embed", "layers[5].wq") of a keypath into `subtree`."""
        if self.layers is None:
            return keypath[0].key + jax.tree_util.keystr(keypath[1:])
        return f"layers[{self.layers[keypath[0].idx]}]{jax.tree_util.keystr(keypath[1:])}"


def layer_bytes(cfg: ModelConfig) -> int:
    """Bytes of one layer's weights as stored (`cfg.dtype`, or their blocks)."""
    layer = param_specs(cfg).layers[0]
    leaves = jax.tree.leaves(layer, is_leaf=lambda x: isinstance(x, ParamSpec))
    return sum(math.prod(s.shape) * spec_dtype(s, cfg).itemsize for s in leaves)


def param_groups(cfg: ModelConfig, group_bytes: int | None = None) -> list[ParamGroup]:
    """The groups of `cfg`'s params in save order: top first, then the layers in runs of
    max(1, group_bytes // layer_bytes(cfg)) (group_bytes: default GROUP_BYTES)."""
    per = max(1, (group_bytes or GROUP_BYTES) // layer_bytes(cfg))
    n = cfg.num_layers
    return [ParamGroup()] + [ParamGroup(range(i, min(i + per, n))) for i in range(0, n, per)]


def encode_groups(groups: Iterable[ParamGroup]) -> list[list[int]]:
    """The header value of `groups`: [[start, stop), ...] of the layer groups."""
    return [[g.layers.start, g.layers.stop] for g in groups if g.layers is not None]


def decode_groups(value: Any, num_layers: int) -> list[ParamGroup]:
    """Groups (top first) from a header value of `encode_groups`. Raises ValueError unless
    it is a list of [start, stop) runs that cover 0..num_layers-1 in order."""
    groups, start = [ParamGroup()], 0
    for run in value if isinstance(value, list) else [None]:
        if not (isinstance(run, list) and len(run) == 2 and run[0] == start
                and isinstance(run[1], int) and run[1] > start):
            raise ValueError(f"expected consecutive [start, stop) layer runs from 0, got {value!r}")
        groups.append(ParamGroup(range(start, run[1])))
        start = run[1]
    if start != num_layers:
        raise ValueError(f"layer runs {value!r} do not cover the {num_layers} layers")
    return groups


def assemble_params(parts: Iterable[tuple[ParamGroup, Any]]) -> Params:
    """Params from (group, subtree) pairs of every group (top and the layer groups in
    order), as `ParamGroup.subtree` lays them out."""
    top: dict[str, Any] = {}
    layers: list[LayerParams] = []
    for group, tree in parts:
        if group.layers is None:
            top = tree
        else:
            layers.extend(served_layer(s) if isinstance(s, StoredLayer) else s for s in tree)
    return Params(layers=tuple(layers), **top)
