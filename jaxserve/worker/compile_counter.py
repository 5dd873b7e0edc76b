"""Counts XLA backend compilations in this process (all of them, not only the engine's).

JAX reports each backend compilation as the monitoring event
`/jax/core/compile/backend_compile_duration`; a listener registered once per process
counts them. Used to prove "no compilation after warm-up" and exported as a metric.
"""

from __future__ import annotations

import threading

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_seconds = 0.0
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count, _seconds
    if event == _EVENT:
        with _lock:
            _count += 1
            _seconds += duration


def install() -> None:
    """Register the listener (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def compilations() -> tuple[int, float]:
    """(number of backend compilations, total seconds spent) since `install()`."""
    install()
    with _lock:
        return _count, _seconds
