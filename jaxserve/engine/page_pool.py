"""Host-side allocator of KV pages: free list and reference counts. Plain Python.

Page 0 is the null page (padding writes land there) and is never handed out. Reference
counts let later features (prefix caching, beam/parallel sampling) share pages; a page
returns to the free list when its count drops to zero.

Source: PagedAttention's block manager (vLLM), nano-vllm's BlockManager.
"""

from __future__ import annotations

from collections import deque

NULL_PAGE = 0  # never allocated; padding tokens write here


class OutOfPages(RuntimeError):
    """Raised by `allocate` when fewer pages are free than asked for (nothing allocated)."""


class PagePool:
    """Free list + refcounts over page ids 1 .. num_pages - 1 (0 is the null page)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"PagePool needs >= 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (refcount 1 each). Raises OutOfPages, allocating nothing, if fewer
        than `n` are free."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to each page (for sequences sharing a prefix)."""
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages reaching zero return to the free list.
        Raises ValueError on the null page or a page that is not allocated (double free)."""
        for p in pages:
            if p == NULL_PAGE or self._refs[p] <= 0:
                raise ValueError(f"freeing page {p}, which is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]
