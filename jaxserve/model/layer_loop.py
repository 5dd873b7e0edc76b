"""The decoder layers as one loop over stacked weights, instead of unrolled.

XLA:CPU compiles every fusion of an unrolled model into a kernel of its own and keeps each
one's code resident: SmolLM2's 30 unrolled layers are ~455 kernels per compiled step shape,
~17 MB an executable, ~0.75 GB over the engine's 44 warm-up shapes (PERFORMANCE.md, "The
layer loop"). Run as a `lax.fori_loop` over layers stacked [L, ...], a step holds one
layer's kernels, and compiles in a fraction of the time.

`StackedLayers` holds a model's layers with every leaf stacked [L, ...] (Params.layers holds
one in place of the tuple of LayerParams); `layer_view(stacked, i)` is layer i inside the
loop body: the weights the C++ CPU kernels multiply (packed GGML blocks, packed bf16
copies) stay stacked and carry the index, and the kernels read layer i's panels where they
lie (a slice handed to a custom call is copied first: +36% over 30 layers, PERFORMANCE.md,
"Against llama.cpp in its own formats"); any other leaf (norms, biases, unpacked weights) is
sliced. The KV pool is stacked alike (jaxserve.model.kv_cache, `stacked`), written and read
at the loop's layer.

Where it runs: one device (no tensor or pipeline parallel mesh), layers of one structure
(the same leaf types, shapes and dtypes), and no f32 copy beside a packed bf16 one (that
would be sliced, a copy per layer per step: `why_not_loop`). Where a projection is not a
packed kernel weight (XLA's f32 matmuls, int8 / fp8 QuantizedWeights), the loop slices it
every step (a copy of the layer's weights: +7-18% a step on the XLA path, PERFORMANCE.md):
"auto" leaves those models unrolled (`slices_projections`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.lora.batched import LoraSlots
from jaxserve.model.ggml_weight import GGMLWeight
from jaxserve.model.params import PROJECTIONS, LayerParams
from jaxserve.model.weight_layouts import DualPrecisionWeight, FusedWeight
from jaxserve.pytree import pytree_dataclass


@pytree_dataclass(meta=("fmt", "logical_shape"))
class StackedGGMLWeight(GGMLWeight):
    """Packed GGML blocks stacked [L, ...] over layers and the int32 `layer` to use (inside
    the loop body): the C++ kernel reads that layer's panels where they lie."""

    layer: Any = None


@pytree_dataclass(meta=("min_rows", "vocab_major", "logical_shape", "max_rows", "round_x_min_rows"))
class StackedDualPrecisionWeight(DualPrecisionWeight):
    """A packed bf16 copy stacked [L, ...] over layers (no f32 twin) and the int32 `layer`
    to use (inside the loop body), read by the C++ kernel in place."""

    layer: Any = None


@pytree_dataclass(meta=("num_layers",))
class StackedLayers:
    """A model's decoder layers as one LayerParams whose every leaf has a leading
    [num_layers] axis (module docstring)."""

    layers: LayerParams
    num_layers: int


def _indexed(x) -> bool:
    """Leaves the C++ kernels read at a layer index: packed GGML blocks, packed bf16
    copies without an f32 twin."""
    return (isinstance(x, GGMLWeight) and x.packed) or (
        isinstance(x, DualPrecisionWeight) and x.packed and x.w is None)


def why_not_loop(layers: tuple) -> str | None:
    """None when `layers` (a tuple of LayerParams) can run as a loop, else the reason: a
    layer of another structure, leaf shape or dtype than the first, or a weight kept with
    an f32 copy beside its packed bf16 one."""
    if not isinstance(layers, tuple) or not layers:
        return "the layers are not a tuple of LayerParams (pipeline stages?)"
    first = jax.tree.structure(layers[0])
    shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(layers[0])]
    for i, lp in enumerate(layers[1:], 1):
        if jax.tree.structure(lp) != first:
            return f"layer {i} has other weight types or formats than layer 0"
        if [(x.shape, x.dtype) for x in jax.tree.leaves(lp)] != shapes:
            return f"layer {i} has other weight shapes or dtypes than layer 0"
    dual = [x for x in jax.tree.leaves(layers[0], is_leaf=lambda x: isinstance(
        x, DualPrecisionWeight)) if isinstance(x, DualPrecisionWeight)]
    if any(x.w is not None for x in dual):
        return "bf16 weight copies are kept beside f32 ones (bf16_matmul_min_rows > 1)"
    return None


def slices_projections(layers: tuple) -> str | None:
    """None when every projection of `layers` (a tuple of LayerParams) is a weight the C++
    kernels read at a layer index in place (packed GGML blocks, a packed bf16 copy), else
    the name of one the loop would slice (copy) every step."""
    for name in PROJECTIONS:
        w = getattr(layers[0], name)
        w = w.w if isinstance(w, FusedWeight) else w
        if w is not None and not _indexed(w):
            return name
    return None


def stack_layers(layers: tuple, donate: bool = False) -> StackedLayers:
    """`layers` (a tuple of LayerParams of one structure: `why_not_loop` None) as
    StackedLayers, each leaf stacked [L, ...] (a copy), leaf after leaf. donate: delete the
    packed kernel weights' per-layer arrays once each is stacked (the engine's: it made
    them when it packed the weights, and keeps only the stack), so stacking holds the
    weights once plus one leaf, not twice. Raises ValueError with why_not_loop's reason
    otherwise."""
    reason = why_not_loop(layers)
    if reason is not None:
        raise ValueError(f"the layers cannot run as a loop: {reason}")

    def stack(*ws):  # one leaf of every layer, or one packed kernel weight of every layer
        free = donate and _indexed(ws[0])

        def field(*xs):
            out = jnp.stack(xs)
            if free:
                jax.block_until_ready(out)
                for x in xs:
                    x.delete()
            return out
        return jax.tree.map(field, *ws)

    stacked = jax.tree.map(stack, *layers, is_leaf=_indexed)
    return StackedLayers(layers=stacked, num_layers=len(layers))


def layer_view(stacked: StackedLayers, i: jax.Array) -> LayerParams:
    """Layer `i` (int32 scalar, traced) of `stacked`, for the loop body: packed kernel
    weights and LoRA pools stay stacked with `layer=i` (the C++ kernels index them in
    place; jaxserve.lora.batched.lora_delta slices the pools itself); every other leaf is
    sliced at i."""
    def view(x: Any):
        if isinstance(x, LoraSlots):
            return dataclasses.replace(x, layer=i)
        if _indexed(x):
            cls = StackedGGMLWeight if isinstance(x, GGMLWeight) else StackedDualPrecisionWeight
            fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
            return cls(**fields, layer=i)
        return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)

    return jax.tree.map(view, stacked.layers,
                        is_leaf=lambda x: _indexed(x) or isinstance(x, LoraSlots))


__all__ = ["StackedDualPrecisionWeight", "StackedGGMLWeight", "StackedLayers", "layer_view",
           "slices_projections", "stack_layers", "why_not_loop"]
