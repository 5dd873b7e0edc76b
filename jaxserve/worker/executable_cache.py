"""Compiled step programs kept on disk for the processes JAX's persistent compilation cache
leaves out: the followers of a multi-process deployment (process index > 0).

JAX writes its persistent cache from process 0 only ("Not writing persistent cache entry
since process_id != 0"), and on CPU a follower's cache key differs from process 0's (the
key hashes the device topology as each process sees it), so a follower compiled every
step program at every start while process 0 read its programs back (PERFORMANCE.md, "The
test suite's time", session 28: ~58 s of the suite's two-process servers). A follower's
Runner compiles through an `ExecutableCache` instead: each program in a file of its own,
keyed by the lowered program, and read back with `jax.experimental.serialize_executable`
(the serialised executable JAX's own cache stores).

Only programs XLA compiled here are kept. An executable JAX read from its own cache
serialises incompletely on XLA:CPU (JAX 0.11.2: the copy loads, then fails at its first
run with "Function ... not found"), so a compilation during which JAX compiled nothing
(its in-memory executables) or read its cache (this process's `compile_events`) is not
written.

Like JAX's cache, a file here is an executable this user's processes wrote: loading one
runs native code, so the directory must not be writable by anyone else. As in JAX's cache
(by default) nothing is evicted: a program no longer asked for stays until the directory
is deleted (SmolLM2's two-process test servers: 23 programs, 15 MB).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jaxlib
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from jaxserve.worker import compile_events

log = logging.getLogger(__name__)


class ExecutableCache:
    """Executables in `directory`, one file per program, for a process running on
    `devices` (the programs' device assignment, in the mesh's order).

    `compile(lowered, compile_fn)` returns the program read back when its file exists and
    loads, else `compile_fn(lowered)`, written to its file (atomically: a file is whole or
    absent). A file that does not load (another JAX, a truncated write) is compiled again
    and replaced; a program JAX cannot serialise, or that XLA did not compile in that call
    (see above), is returned and not kept. `hits` and `misses` count both outcomes."""

    def __init__(self, directory: str | Path, devices: Sequence[jax.Device]):
        self.directory = Path(directory)
        self.devices = list(devices)
        self.hits = 0
        self.misses = 0

    def key(self, lowered: jax.stages.Lowered, options: dict | None) -> str:
        """sha256 of what decides the executable: the lowered program's StableHLO (its
        shardings included), the compiler options, the JAX and jaxlib versions, XLA_FLAGS,
        the platform, this process's index and the process count, and the devices' ids
        and kinds."""
        h = hashlib.sha256()
        for part in (lowered.as_text(), repr(sorted((options or {}).items())), jax.__version__,
                     jaxlib.__version__, os.environ.get("XLA_FLAGS", ""),
                     repr((jax.process_index(), jax.process_count())),
                     repr([(d.platform, d.device_kind, d.id) for d in self.devices])):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def compile(self, lowered: jax.stages.Lowered,
                compile_fn: Callable[[jax.stages.Lowered], jax.stages.Compiled],
                options: dict | None = None) -> jax.stages.Compiled:
        """`lowered`'s executable: read back from its file, or `compile_fn(lowered)` (with
        `options`, part of the key) and kept. Errors of `compile_fn` propagate."""
        path = self.directory / f"{self.key(lowered, options)}.bin"
        if path.exists():
            try:
                compiled = deserialize_and_load(path.read_bytes(), lowered.in_tree,
                                                lowered.out_tree,
                                                execution_devices=self.devices)
            except Exception as e:  # noqa: BLE001 - any unreadable file is compiled anew
                log.warning("executable cache: %s does not load (%s); compiling", path.name, e)
            else:
                self.hits += 1
                return compiled
        before = compile_events.snapshot()
        compiled = compile_fn(lowered)
        self.misses += 1
        made = (compile_events.snapshot() - before).counts
        if made["compilation"] == 0 or made["cache_fetch"] > 0:
            # JAX had it (in memory, or read back from its cache; or another thread's
            # program was): not known to be compiled here, so not kept
            return compiled
        try:
            blob, _, _ = serialize(compiled)
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, path)
        except (ValueError, NotImplementedError, OSError) as e:
            log.warning("executable cache: not keeping %s (%s)", path.name, e)
        return compiled
