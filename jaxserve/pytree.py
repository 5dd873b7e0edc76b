"""Dataclasses as JAX pytrees: array fields are children, the rest static metadata."""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls=None, *, meta: tuple[str, ...] = ()):
    """Decorator: a frozen dataclass registered as a pytree.

    Fields named in `meta` are static (hashed into the treedef); all others are children.
    """

    def wrap(c):
        c = dataclasses.dataclass(frozen=True)(c)
        fields = [f.name for f in dataclasses.fields(c)]
        data = [f for f in fields if f not in meta]
        return jax.tree_util.register_dataclass(c, data_fields=data, meta_fields=list(meta))

    return wrap if cls is None else wrap(cls)
