"""Many LoRA adapters in one step: each token row of a flat ragged batch applies its own
adapter's factors, from pools of adapter slots that keep their shapes whatever is loaded
(so loading, swapping or unloading an adapter changes values, never a compiled shape).

Pools: a [S, in, R] and b [S, R, out] per projection and layer, S = max_loras + 1 slots of
rank R = max_lora_rank (an adapter of lower rank zero-padded: its extra columns of A and
rows of B are 0, which adds exact zeros), slot 0 all zeros = no adapter. A row's delta is
x A_s B_s for its slot s (the scaling already in B: jaxserve.lora.adapter).

The products (Punica's BGMV, Chen et al., 2023; S-LoRA, Sheng et al., 2023), in plain jnp
for XLA: the shrink x A for every slot at once ([T, S, R]: T x in x S x R multiply-adds),
the rows' own slot kept (the others zeroed), then one expand over the S * R stacked rows of
B ([T, out]): no [T, in, R] gather of each row's A, at S x the FLOPs of one adapter's
(small beside the base projection while S * R << out). A C++ or Pallas kernel replaces it
where it is measured faster.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.pytree import pytree_dataclass


@pytree_dataclass(meta=("logical_shape",))
class LoraSlots:
    """One projection's pools: a [S, in, R], b [S, R, out] (slot 0 zeros), in the
    adapter dtype; logical_shape: the base projection's logical shape (e.g. wq's
    (embed, heads, head_dim)), whose inputs / outputs `in` / `out` flatten (what tensor
    parallelism splits them by: jaxserve.model.tensor_parallel). layer: None, or inside a
    layer loop the int32 index of the layer to use of pools stacked [L, S, ...] (a kernel
    reads them there in place; `lora_delta` slices them)."""

    a: jax.Array
    b: jax.Array
    logical_shape: tuple = ()
    layer: Any = None


def empty_slots(num_slots: int, n_in: int, n_out: int, rank: int,
                dtype=jnp.float32, logical_shape: tuple = ()) -> LoraSlots:
    """Zeroed pools of `num_slots` slots (slot 0 = no adapter included) of rank `rank`."""
    return LoraSlots(a=jnp.zeros((num_slots, n_in, rank), dtype),
                     b=jnp.zeros((num_slots, rank, n_out), dtype), logical_shape=logical_shape)


def put_adapter(slots: LoraSlots, slot: int, a: jax.Array, b: jax.Array) -> LoraSlots:
    """`slots` with slot `slot` holding factors a [in, r] and b [r, out] (r <= the pools'
    rank; zero-padded). Raises ValueError for slot 0 (reserved: no adapter), a slot out
    of range, or factors of another shape or a larger rank."""
    S, n_in, R = slots.a.shape
    n_out = slots.b.shape[2]
    if not 0 < slot < S:
        raise ValueError(f"LoRA slot must be in 1..{S - 1} (0 is no adapter), got {slot}")
    r = a.shape[1]
    if a.shape != (n_in, r) or b.shape != (r, n_out) or r > R:
        raise ValueError(f"LoRA factors must be [{n_in}, r] and [r, {n_out}] with r <= {R}, "
                         f"got {list(a.shape)} and {list(b.shape)}")
    a_pad = jnp.zeros((n_in, R), slots.a.dtype).at[:, :r].set(a)
    b_pad = jnp.zeros((R, n_out), slots.b.dtype).at[:r].set(b)
    return dataclasses.replace(slots, a=slots.a.at[slot].set(a_pad),
                               b=slots.b.at[slot].set(b_pad))


def lora_delta(x: jax.Array, slots: LoraSlots, row_slot: jax.Array) -> jax.Array:
    """Each row's adapter delta: x [T, in] (any float), row_slot [T] int32 in [0, S) (0 =
    no adapter; a value outside gives 0) -> [T, out] f32, row t = x[t] A_s B_s with
    s = row_slot[t], summed in f32 (module docstring for the formulation)."""
    if slots.layer is not None:  # a layer loop's stacked pools: this layer's
        slots = LoraSlots(a=jax.lax.dynamic_index_in_dim(slots.a, slots.layer, keepdims=False),
                          b=jax.lax.dynamic_index_in_dim(slots.b, slots.layer, keepdims=False))
    S, _, R = slots.a.shape
    xa = jnp.einsum("ti,sir->tsr", x.astype(jnp.float32), slots.a.astype(jnp.float32))
    own = row_slot[:, None] == jnp.arange(S, dtype=row_slot.dtype)[None, :]  # [T, S]
    xa = jnp.where(own[..., None], xa, 0.0).reshape(x.shape[0], S * R)
    return xa @ slots.b.astype(jnp.float32).reshape(S * R, -1)


def add_lora(y: jax.Array, x: jax.Array, slots: LoraSlots | None,
             row_slot: jax.Array | None,
             delta: Callable[[jax.Array, LoraSlots, jax.Array], jax.Array] = lora_delta
             ) -> jax.Array:
    """A projection's output y [T, *out] plus each row's adapter delta of its input x
    [T, *in] (`delta`: `lora_delta`, or a kernel's with its signature, over the flattened
    axes), summed in f32 and rounded once to y's dtype; y itself when there are no pools
    or no row slots (LoRA off)."""
    if slots is None or row_slot is None:
        return y
    delta = delta(x.reshape(x.shape[0], -1), slots, row_slot)
    return (y.astype(jnp.float32) + delta.reshape(y.shape)).astype(y.dtype)


__all__ = ["LoraSlots", "add_lora", "empty_slots", "lora_delta", "put_adapter"]
