"""Turning an implementation name into the backend object it stands for: one lookup that
the attention, matmul and sampler backends share, and the names of the Pallas backends."""

from __future__ import annotations

from typing import Any, Mapping


def lookup(table: Mapping[str, Any], impl: Any, base: type, what: str) -> Any:
    """`impl` itself if it is a `base` instance, else `table[impl]`. Raises ValueError
    naming `what` ("attention impl", ...) and the known names for anything else."""
    if isinstance(impl, base):
        return impl
    try:
        return table[impl]
    except (KeyError, TypeError):
        raise ValueError(f"{what} must be one of {tuple(table)}, got {impl!r}") from None


def pallas_impl(mosaic: bool, interpret: bool) -> str:
    """The impl name of a Pallas backend: "pallas" (Triton) or "pallas_mosaic" (Mosaic GPU),
    with "_interpret" for the backend's interpret mode."""
    return ("pallas_mosaic" if mosaic else "pallas") + ("_interpret" if interpret else "")
