"""The LoRA manager: which adapters the engine serves, which are read on the host, and
which sit in the device's adapter slots. Plain Python (+ the adapters' numpy arrays).

Three tiers, as vLLM's LRUCacheWorkerLoRAManager and S-LoRA keep them:
- registered: every adapter a request may name (`--lora-modules`, POST
  /v1/load_lora_adapter), by name -> its directory;
- read on the host: the last `max_cpu_loras` used (LRU); one evicted is read from its
  directory again when next needed;
- in a device slot: at most `max_loras` (slots 1..max_loras of the pools,
  jaxserve.model.lora; slot 0 is no adapter). A sequence holds its adapter's slot while it
  runs (`acquire` at admission, `release` when it is preempted or finishes); a slot no
  running sequence holds is reused for another adapter, least recently used first. A
  waiting sequence whose adapter finds no slot waits (the scheduler admits the requests
  behind it meanwhile).
Slot writes are handed to the runner (`take_writes`) before the step that needs them is
dispatched; nothing is recompiled.

Prefix caching: a sequence's page hashes start from its adapter's `cache_salt` (its name
and when it was registered), so pages computed under one adapter are never reused by
another's requests, nor by the base's, nor by a later adapter registered under the same
name (vLLM keys blocks by lora_int_id alike).

Writes, of a Sequence: `lora_slot`. One thread uses it (the engine's).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from jaxserve.config import LoRAConfig, ModelConfig
from jaxserve.engine.sequence import Sequence
from jaxserve.lora.adapter import AdapterError, LoraAdapter, load_peft_adapter


class LoraManager:
    """See the module docstring. `read(path, name)` reads an adapter directory (default
    load_peft_adapter for the base shape `model` at max_lora_rank; `model` is unused when
    `read` is given: tests give their own)."""

    def __init__(self, lcfg: LoRAConfig, model: ModelConfig | None,
                 read: Callable[[Path, str], LoraAdapter] | None = None):
        self.cfg = lcfg
        self._read = read or (lambda path, name: load_peft_adapter(
            path, model, lcfg.max_lora_rank, name))
        self._paths: dict[str, Path] = {}
        self._salts: dict[str, bytes] = {}
        self._ids = itertools.count(1)
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU first
        self._slot_of: dict[str, int] = {}
        self._holders = [0] * lcfg.num_slots  # running sequences per slot
        self._free = OrderedDict((s, None) for s in range(1, lcfg.num_slots))  # LRU first
        self._writes: list[tuple[int, LoraAdapter | None]] = []
        self.names: frozenset[str] = frozenset()  # read by other threads (one assignment)
        self.num_reads = 0

    # --- which adapters are served -------------------------------------------------------

    def add(self, name: str, path: str | Path, adapter: LoraAdapter | None = None) -> None:
        """Serve the adapter in directory `path` as `name` (`adapter`: it, already read,
        e.g. on another thread; else read now). Raises AdapterError (one line) for a name
        already served or an adapter that cannot be served (jaxserve.lora.adapter)."""
        if not name or name in self._paths:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded" if name
                               else "a LoRA adapter needs a name")
        adapter = adapter if adapter is not None else self._read(Path(path), name)
        self._paths[name] = Path(path)
        self._salts[name] = f"lora:{next(self._ids)}:{name}".encode()
        self._cache(name, adapter)
        self.names = frozenset(self._paths)

    def remove(self, name: str) -> None:
        """Stop serving `name`: new requests for it are refused; running ones keep its slot
        until they finish (then it is cleared); waiting ones are the engine's to fail
        (`is_served` turns False). Raises KeyError for a name not served."""
        if name not in self._paths:
            raise KeyError(name)
        del self._paths[name], self._salts[name]
        self._host.pop(name, None)
        self.names = frozenset(self._paths)
        slot = self._slot_of.get(name)
        if slot is not None and self._holders[slot] == 0:
            self._clear(name, slot)
        elif slot is not None:  # held: cleared when its last sequence leaves; the name
            # is free at once (an adapter registered again under it gets a slot of its own)
            self._slot_of[("unloaded", name, next(self._ids))] = self._slot_of.pop(name)

    def is_served(self, name: str) -> bool:
        return name in self._paths

    def read(self, path: str | Path, name: str) -> LoraAdapter:
        """Read the adapter in directory `path` as `name`, checked against the base
        (nothing here changes: safe on another thread, e.g. the server's while the
        engine steps). Raises AdapterError (one line)."""
        return self._read(Path(path), name)

    def paths(self) -> dict[str, str]:
        """{name: directory} of the adapters served (a copy: any thread may read it)."""
        return {name: str(path) for name, path in list(self._paths.items())}

    def cache_salt(self, name: str | None) -> bytes | None:
        """The first page hash's parent for sequences of adapter `name` (None: the base)."""
        return None if name is None else self._salts[name]

    # --- slots -------------------------------------------------------------------------

    def acquire(self, seq: Sequence) -> bool:
        """Give `seq` (about to run) its adapter's slot: the one holding it, else a free
        slot (least recently used), written with the adapter (read from its directory if
        not on the host). Sets seq.lora_slot (0 for the base). False, slot unchanged, when
        every slot is held by running sequences of other adapters. Raises AdapterError if
        the adapter is no longer served or cannot be read again."""
        name = seq.lora_name
        if name is None:
            seq.lora_slot = 0
            return True
        if name not in self._paths:
            raise AdapterError(f"LoRA adapter {name!r} was unloaded")
        slot = self._slot_of.get(name)
        if slot is None:
            if not self._free:
                return False
            adapter = self._host.get(name)
            if adapter is None:
                adapter = self._read(self._paths[name], name)
                self.num_reads += 1
            self._cache(name, adapter)
            slot, _ = self._free.popitem(last=False)
            old = next((n for n, s in self._slot_of.items() if s == slot), None)
            if old is not None:
                del self._slot_of[old]
            self._slot_of[name] = slot
            self._writes.append((slot, adapter))
        else:
            self._free.pop(slot, None)
        self._holders[slot] += 1
        seq.lora_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        """`seq` (which held its slot) stopped running; its slot is free once no running
        sequence holds it (and cleared if its adapter was removed meanwhile)."""
        slot = seq.lora_slot
        if slot == 0:
            return
        seq.lora_slot = 0
        self._holders[slot] -= 1
        if self._holders[slot] == 0:
            name = next(n for n, s in self._slot_of.items() if s == slot)
            if name in self._paths:
                self._free[slot] = None  # most recently used last
            else:
                self._clear(name, slot)

    def take_writes(self) -> list[tuple[int, LoraAdapter | None]]:
        """The slot writes since the last call, in order: (slot, adapter) or (slot, None)
        to clear it; for the runner, before the next step is dispatched."""
        out, self._writes = self._writes, []
        return out

    def slots(self) -> dict[str, int]:
        """{adapter name: its slot} of the served adapters in device slots."""
        return {n: s for n, s in self._slot_of.items() if isinstance(n, str)}

    def _clear(self, name: str, slot: int) -> None:
        del self._slot_of[name]
        self._writes.append((slot, None))
        self._free[slot] = None
        self._free.move_to_end(slot, last=False)  # an empty slot is reused first

    def _cache(self, name: str, adapter: LoraAdapter) -> None:
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.cfg.cpu_loras:
            self._host.popitem(last=False)


__all__ = ["LoraManager"]
