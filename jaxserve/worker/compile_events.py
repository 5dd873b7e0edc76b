"""Counts every JAX trace, lowering, backend compilation and persistent-cache fetch in
this process (all of them, not only the engine's step).

JAX reports each as a `jax.monitoring` duration event (jax/_src/dispatch.py,
jax/_src/compiler.py):

    trace        /jax/core/compile/jaxpr_trace_duration         a Python function traced
                                                                 to a jaxpr (jit, eager ops)
    lowering     /jax/core/compile/jaxpr_to_mlir_module_duration a jaxpr lowered to StableHLO
    compilation  /jax/core/compile/backend_compile_duration      an executable asked of XLA:
                                                                 compiled, or read from the
                                                                 persistent compilation cache
    cache_fetch  /jax/compilation_cache/cache_retrieval_time_sec  of those, the ones read from
                                                                 the cache (a hit)

A listener registered once per process (`install`) counts them and sums their seconds.
A served request should cause none of them after warm-up: each is host time in the
step loop (0.5-1.5 s per call on a GPU when something is traced per call), so the
engine reports them in /health and /metrics, and tests prove "nothing compiles after
warm-up" with them. Counts are process-wide: take differences (`CompileEvents.__sub__`).
"""

from __future__ import annotations

import dataclasses
import threading

KINDS = ("trace", "lowering", "compilation", "cache_fetch")
_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/core/compile/backend_compile_duration": "compilation",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_fetch",
}

_lock = threading.Lock()
_counts = dict.fromkeys(KINDS, 0)
_seconds = dict.fromkeys(KINDS, 0.0)
_installed = False


@dataclasses.dataclass(frozen=True)
class CompileEvents:
    """Counts of each kind of compile event, and the seconds they took, since `install()`
    (or, for a difference, between two snapshots). counts / seconds: {kind: value} over
    KINDS."""

    counts: dict[str, int]
    seconds: dict[str, float]

    @classmethod
    def zero(cls) -> "CompileEvents":
        """No events."""
        return cls(dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0.0))

    @property
    def total(self) -> int:
        """Events of every kind."""
        return sum(self.counts.values())

    def __sub__(self, other: "CompileEvents") -> "CompileEvents":
        return CompileEvents({k: self.counts[k] - other.counts[k] for k in KINDS},
                             {k: self.seconds[k] - other.seconds[k] for k in KINDS})


def _listener(event: str, duration: float, **kwargs) -> None:
    kind = _EVENTS.get(event)
    if kind is not None:
        with _lock:
            _counts[kind] += 1
            _seconds[kind] += duration


def install() -> None:
    """Register the listener (idempotent)."""
    global _installed
    import jax  # here: the stats that carry CompileEvents stay importable without JAX

    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def snapshot() -> CompileEvents:
    """The events counted since `install()` (installing it first if needed)."""
    install()
    with _lock:
        return CompileEvents(dict(_counts), dict(_seconds))
