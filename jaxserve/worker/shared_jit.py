"""One `jax.jit` per step function and static configuration in a process, shared by every
engine built with that configuration.

A Runner traces, lowers and compiles its step programs through jitted functions
(jaxserve.worker.runner). JAX keeps what it traced, lowered and compiled in caches keyed
by the jitted function's identity (weakly) and the arguments' types. A jitted function of
its own per Runner therefore meant that an engine built again in the same process, with
the same model and kernels, traced, lowered and read every program back from the
persistent cache again: the SmolLM2 preset's rebuild took 7.8 s, 3.5 s with its 44
programs shared (PERFORMANCE.md, "The test suite's time", session 33).
Here equal static configurations get the same jitted function, so such an engine's
programs come from JAX's memory: nothing is traced, lowered or compiled (a rebuilt
`jaxserve.LLM` in a notebook, a benchmark's engines of one model; the test suite builds
hundreds).

The jitted functions live while an engine holds them, and the last `KEEP` asked for stay
after their engines are gone, for the next engine of that configuration. What they keep
is compiled code (XLA:CPU maps each program's code into ~150-500 memory regions of its
own; the preset's 44 programs: ~6,800), so the count is bounded: an older one is freed
with the last engine using it. `jax.clear_caches()` frees every program at once.
"""

from __future__ import annotations

import collections
import functools
import threading
import weakref
from collections.abc import Callable

import jax

KEEP = 16
"""Jitted functions kept after their engines are gone (each engine holds five: the
forward, the sampler, the one-program step, the verify step, the prompt logprobs), so
about three configurations' programs."""

_lock = threading.Lock()
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_recent: collections.OrderedDict = collections.OrderedDict()


def shared_jit(fn: Callable, donate_argnums: tuple[int, ...],
               static_argnames: tuple[str, ...], **static) -> Callable:
    """`jax.jit(functools.partial(fn, **static), donate_argnums=..., static_argnames=...)`,
    the same object for every call with equal arguments while one is alive or among the
    last KEEP asked for. `static`: the step's static configuration (ModelConfig,
    Kernels, ShardingRules, ...), hashable and equal by value, as a jit's static
    arguments must be. Raises TypeError for an unhashable value."""
    key = (fn, donate_argnums, static_argnames, tuple(sorted(static.items())))
    with _lock:
        jitted = _live.get(key)
        if jitted is None:
            jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate_argnums,
                             static_argnames=static_argnames)
            _live[key] = jitted
        _recent[key] = jitted
        _recent.move_to_end(key)
        while len(_recent) > KEEP:
            _recent.popitem(last=False)
    return jitted
