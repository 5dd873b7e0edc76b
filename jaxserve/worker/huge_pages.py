"""Transparent huge pages for the engine's long-lived CPU buffers (the weights and the KV
page pool).

On CPU every step streams the weights and the running sequences' KV pages from DRAM: for
SmolLM2-135M at 32 streams ~270 MB of weights and ~190 MB of KV per decode step. XLA:CPU's
allocator gets that memory from glibc in 4 KiB pages, so the kernels' streams take a TLB
miss (and a page walk) every 4 KiB, and the hardware prefetchers stop at each page's end.
`advise_huge_pages` asks Linux to back the 2 MiB-aligned interior of each buffer with
transparent huge pages: madvise(MADV_HUGEPAGE) marks the range, and madvise(MADV_COLLAPSE)
(Linux >= 6.1) rebuilds the pages already there as huge ones now, in place: the contents
and the addresses stay the same (~2.5 ms per MiB on an AMD Zen 4 VM: it copies them). A
buffer known to hold only zeros (a KV pool just made) is dropped instead
(MADV_DONTNEED) after the mark: its pages come back as zero-filled huge pages when first
touched, with no copy. It is only a hint: where the kernel refuses (THP "never", an older
kernel, no free huge page), the buffers stay as they were.

Source: Linux's madvise(2) (MADV_HUGEPAGE, MADV_COLLAPSE); glibc's `glibc.malloc.hugetlb=1`
tunable does the MADV_HUGEPAGE part for all of a process's large allocations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Any

import jax

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20  # x86-64's and arm64's (4 KiB granule) transparent huge page
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


def huge_page_ranges(buffers: list[tuple[int, int]], page: int = HUGE_PAGE_BYTES
                     ) -> list[tuple[int, int]]:
    """The whole `page`-aligned ranges (start, length in bytes) inside each buffer (its
    address, its size in bytes): only those can become huge pages without touching the
    memory around the buffer. Buffers smaller than a page, or with no aligned page inside,
    give none."""
    out = []
    for address, size in buffers:
        start = -(-address // page) * page
        end = (address + size) // page * page
        if end > start:
            out.append((start, end - start))
    return out


def _cpu_buffers(tree: Any) -> list[tuple[int, int]]:
    """(address, bytes) of every CPU-resident buffer of the jax.Arrays in `tree` (each
    addressable shard of a sharded one)."""
    out = []
    for leaf in jax.tree_util.tree_leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            out.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return out


def advise_huge_pages(data: Any, zeros: Any = ()) -> int:
    """Back the CPU buffers of the jax.Arrays in the pytrees `data` (weights: collapsed in
    place) and `zeros` (arrays that hold only zeros now, e.g. a KV pool just made: dropped,
    to come back as zero-filled huge pages; the caller's promise, since their contents
    are discarded) with transparent huge pages where Linux agrees (see the module
    docstring). Returns the bytes now in huge pages or marked to become them (0 off Linux
    or where it refused: the call never raises for that; the buffers work either way)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    done, errors = 0, set()
    for tree, then in ((data, MADV_COLLAPSE), (zeros, MADV_DONTNEED)):
        for start, length in huge_page_ranges(_cpu_buffers(tree)):
            if libc.madvise(start, length, MADV_HUGEPAGE) != 0 \
                    or libc.madvise(start, length, then) != 0:
                errors.add(ctypes.get_errno())
                continue
            done += length
    if errors:
        log.info("huge pages: madvise refused some ranges (errno %s); those stay in 4 KiB "
                 "pages", sorted(errors))
    return done
