"""Logical axis names -> mesh axes.

Model code names the axes of every weight and activation with logical names (`batch`,
`sequence`, `embed`, `q_heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`, `layers`, `pages`);
one `ShardingRules` object maps them to mesh axes. Code never names mesh axes directly.
Tensor parallelism is the `model` mesh axis (Megatron-style: heads and MLP columns split,
the output projections reduce); pipeline parallelism the `stage` axis (the logical
`stages` axis of stage-stacked layers and KV pools, jaxserve.model.pipeline). A rule
naming an axis the mesh lacks (`stage` on a tensor-parallel-only mesh) maps to nothing.

A dimension whose size is not a multiple of its mesh axis is replicated instead (SmolLM2's
9 query / 3 KV heads on 2 or 4 devices, for instance): the layout stays correct, only less
of the work is split. `describe()` reports which dimensions fell back.

Source: the logical-axis rules of jax-llm-examples / MaxText.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ParallelConfig

DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", None),
    ("sequence", None),
    ("tokens", None),  # the flat token rows of a ragged step (sequences packed one after another)
    ("embed", None),
    ("q_heads", "model"),
    ("kv_heads", "model"),
    ("head_dim", None),
    ("mlp", "model"),
    ("vocab", "model"),
    ("layers", None),
    ("stages", "stage"),
    ("pages", None),
    ("page_slots", None),
)


def make_mesh(cfg: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(model,)` mesh over the first `cfg.num_devices` devices (default: jax.devices(),
    every process's devices in a multi-process run); `(stage, model)` with pipeline
    stages, each stage's tensor-parallel group on consecutive devices (one host's GPUs
    per stage when a host holds tensor_parallel_size of them).

    Raises ValueError when fewer devices exist than the config asks for.
    """
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < cfg.num_devices:
        raise ValueError(f"ParallelConfig asks for {cfg.num_devices} devices "
                         f"(tensor_parallel_size={cfg.tensor_parallel_size} x "
                         f"pipeline_parallel_size={cfg.pipeline_parallel_size}) but only "
                         f"{len(devices)} exist")
    shape, names = _mesh_shape(cfg)
    return Mesh(np.array(devices[:cfg.num_devices]).reshape(shape), names)


def make_abstract_mesh(cfg: ParallelConfig) -> AbstractMesh:
    """The same mesh without devices: for planning shardings and memory of a deployment
    (70B on 8 GPUs) on a machine that has none of them."""
    return AbstractMesh(*_mesh_shape(cfg))


def _mesh_shape(cfg: ParallelConfig) -> tuple[tuple[int, ...], tuple[str, ...]]:
    if cfg.pipeline_parallel_size > 1:
        return (cfg.pipeline_parallel_size, cfg.tensor_parallel_size), ("stage", "model")
    return (cfg.tensor_parallel_size,), ("model",)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Maps logical axis names to mesh axes of `mesh` (hashable: usable as a static arg)."""

    mesh: Mesh | AbstractMesh
    rules: tuple[tuple[str, str | None], ...] = DEFAULT_RULES

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        for name, axis in self.rules:
            if name == logical:
                return axis
        raise KeyError(f"no sharding rule for logical axis {logical!r}")

    def for_layer(self, layer: int, num_layers: int) -> "ShardingRules":
        """The rules decoder layer `layer` of `num_layers` is placed by: with pipeline
        stages, those of its stage's own devices (a `(model,)` mesh of the stage's row of
        the mesh: the layer lives only there until jaxserve.model.pipeline stacks it),
        else these. Layers past num_layers go with the last stage.

        Over several processes the layers are placed on the whole mesh instead (replicated
        over `stage`, stacked afterwards): orbax cannot restore an array that a process
        holds no shard of, and a stage is one host's devices."""
        stages = self.size("stages")
        if stages == 1 or (isinstance(self.mesh, Mesh) and jax.process_count() > 1):
            return self
        return self.stage(min(layer // layers_per_stage(num_layers, stages), stages - 1))

    def stage(self, s: int) -> "ShardingRules":
        """The rules of pipeline stage s's own devices: a `(model,)` mesh of the mesh's
        row s (the same rules); these rules when the mesh has no stages."""
        return self if self.size("stages") == 1 else _stage_rules(self, s)

    def size(self, logical: str) -> int:
        """Devices along the mesh axis `logical` maps to (1 when none, or the mesh lacks it)."""
        axis = self.mesh_axis(logical)
        return self.mesh.shape.get(axis, 1) if axis is not None else 1

    def spec(self, axes: Sequence[str | None], shape: Sequence[int] | None = None) -> PartitionSpec:
        """PartitionSpec for logical `axes`; with `shape`, dims not divisible are replicated."""
        out, used = [], set()
        for i, logical in enumerate(axes):
            axis = self.mesh_axis(logical)
            if axis is not None and axis not in self.mesh.shape:
                axis = None
            if axis is not None:
                size = self.mesh.shape[axis]
                if axis in used or size == 1 or (shape is not None and shape[i] % size):
                    axis = None
            if axis is not None:
                used.add(axis)
            out.append(axis)
        return PartitionSpec(*out)

    def sharding(self, axes: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    def constrain(self, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
        """`with_sharding_constraint` of an activation by its logical axes."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape))


def layers_per_stage(num_layers: int, stages: int) -> int:
    """Each pipeline stage's layer slots: ceil(num_layers / stages) (stage s holds layers
    s * that .. on; the last may hold fewer)."""
    return -(-num_layers // stages)


@functools.lru_cache(maxsize=64)
def _stage_rules(rules: ShardingRules, stage: int) -> ShardingRules:
    axis = rules.mesh_axis("stages")
    i = rules.mesh.axis_names.index(axis)
    names = tuple(n for n in rules.mesh.axis_names if n != axis)
    if isinstance(rules.mesh, AbstractMesh):
        shape = tuple(rules.mesh.shape[n] for n in names)
        return ShardingRules(AbstractMesh(shape, names), rules.rules)
    devices = np.take(rules.mesh.devices, stage, axis=i)
    return ShardingRules(Mesh(devices, names), rules.rules)


def constrain(rules: ShardingRules | None, x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Annotate activation `x` with logical `axes`; a no-op without rules (one device)."""
    if rules is None:
        return x
    return rules.constrain(x, axes)
