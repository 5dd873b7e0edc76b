"""What memory the devices really have, before anything is allocated: the number the memory
plan (jaxserve.worker.memory_plan) is checked against and sized from.

- GPU (and any device that reports it): `Device.memory_stats()`'s `bytes_limit` less
  `bytes_in_use`, the smallest over the devices.
- CPU: the host's available memory (Linux's MemAvailable, or a cgroup memory limit's
  headroom when that is smaller; elsewhere the free physical pages), shared by every CPU device
  the engine places arrays on in this process: simulated devices
  (`--xla_force_host_platform_device_count`) split one host's memory.

Processes started side by side on one host each see the memory before the others
allocate: give them explicit pool sizes (`--kv-cache-memory-bytes`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

CGROUP = Path("/sys/fs/cgroup")


def _meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom(root: Path = CGROUP, membership: Path = Path("/proc/self/cgroup")
                     ) -> int | None:
    """The memory limit less the usage of this process's cgroup, in bytes (cgroup v2
    memory.max - memory.current, or v1 memory.limit_in_bytes - memory.usage_in_bytes);
    None when unlimited or unreadable. A container sees its own cgroup at the
    hierarchy's root, so the root is read when the process's path is not there."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # v1
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for d in (base / rel.strip().lstrip("/"), base):
            try:
                limit = (d / files[0]).read_text().strip()
                usage = int((d / files[1]).read_text())
            except (OSError, ValueError):
                continue
            if limit == "max" or int(limit) >= 2**62:  # unlimited
                return None
            return max(0, int(limit) - usage)
    return None


def host_available_bytes() -> int:
    """Bytes of host memory this process can still allocate without swapping or being
    killed: min(MemAvailable, the cgroup limit's headroom); off Linux, free physical pages.
    Raises OSError if none of these can be read."""
    found = [b for b in (_meminfo_available(), _cgroup_headroom()) if b is not None]
    if found:
        return min(found)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_device_bytes(num_devices: int) -> int:
    """Bytes each of `num_devices` CPU devices (simulated ones share the host) can still
    hold: host_available_bytes() split evenly over them."""
    return host_available_bytes() // max(1, num_devices)


def device_available_bytes(devices: Sequence) -> int:
    """Bytes one of `devices` (jax Devices: the engine's local ones) can still hold: for
    devices with memory stats, min over them of bytes_limit - bytes_in_use; for CPU
    devices, cpu_device_bytes."""
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    return cpu_device_bytes(len(devices))


def memory_name(platform: str, num_devices: int) -> str:
    """How messages name the memory one device has (what device_available_bytes measured)."""
    if platform != "cpu":
        return f"the {platform} device"
    if num_devices > 1:
        return f"each of the {num_devices} CPU devices' share of the host"
    return "the host"
