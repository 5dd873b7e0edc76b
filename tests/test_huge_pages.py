"""jaxserve.worker.huge_pages: which ranges can become huge pages, and that advising a
buffer keeps what it holds (a zeros buffer reads zeros) while Linux backs it with
transparent huge pages."""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.worker.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages, huge_page_ranges

MIB = 1 << 20


def test_huge_page_ranges_keep_to_whole_aligned_pages_inside_each_buffer():
    page = HUGE_PAGE_BYTES
    assert huge_page_ranges([(0, 3 * page)]) == [(0, 3 * page)]
    # an unaligned start and end: only the aligned pages strictly inside
    assert huge_page_ranges([(page - 1, 3 * page + 2)]) == [(page, 3 * page)]
    assert huge_page_ranges([(page - 1, 3 * page)]) == [(page, 2 * page)]
    # no whole aligned page inside: nothing (the memory around belongs to others)
    assert huge_page_ranges([(1, page), (page + 4096, page - 4096)]) == []
    assert huge_page_ranges([(5 * page, page), (0, 0)], page) == [(5 * page, page)]


def _thp_enabled() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform.startswith("linux") and path.exists() and "[never]" not in path.read_text()


def _huge_bytes_at(address: int) -> int:
    """AnonHugePages (bytes) of this process's mapping that holds `address`."""
    inside, huge = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1]) * 1024
    return huge


@pytest.mark.skipif(not _thp_enabled(), reason="needs Linux with transparent huge pages")
def test_advised_buffers_keep_their_values_in_huge_pages():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(4 * MIB, dtype=np.float32)  # 16 MiB: >= 7 aligned huge pages
    data = jnp.asarray(values)
    zeros = jnp.zeros((4 * MIB,), jnp.float32)
    done = advise_huge_pages({"w": data}, zeros=[zeros])
    assert done >= 2 * 7 * HUGE_PAGE_BYTES
    np.testing.assert_array_equal(np.asarray(data), values)
    assert not np.asarray(zeros).any()  # dropped pages come back as zeros
    assert _huge_bytes_at(data.unsafe_buffer_pointer() + 8 * MIB) >= HUGE_PAGE_BYTES
    # arrays computed from both afterwards read what they held
    np.testing.assert_array_equal(np.asarray(data + zeros), values)


def test_nothing_to_advise_gives_zero():
    assert advise_huge_pages({"small": jnp.ones((16,), jnp.float32), "not an array": 3}) == 0
