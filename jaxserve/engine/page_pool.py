"""Host-side allocator of KV pages: free list, reference counts, and the prefix cache of
full pages. Plain Python.

Page 0 is the null page (padding writes land there) and is never handed out. A page is
shared by reference count (prefix-cache hits, parallel sampling) and returns to the pool
when its count drops to zero.

Prefix caching: a full page whose K/V are computed can be registered under its chained
hash (`page_hashes`: the hash of the previous page and this page's tokens, so a page
matches only when its whole prefix matches). A registered page that no sequence holds
stays in the pool with its K/V, evictable: `lookup` finds it again for a later sequence
with the same prefix, and `allocate` takes it (least recently freed first, its hash
forgotten) only when no never-cached page is left. `num_free` counts both kinds.

Source: PagedAttention's block manager (vLLM), vLLM v1's KVCacheManager (chained block
hashes, free-block queue with LRU eviction), nano-vllm's BlockManager.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Sequence

from jaxserve.config import NULL_PAGE  # never allocated; padding tokens write here


class OutOfPages(RuntimeError):
    """Raised by `allocate` when fewer pages are free than asked for (nothing allocated)."""


def page_hashes(token_ids: Sequence[int], page_size: int, start: int = 0,
                parent: bytes | None = None) -> list[bytes]:
    """Chained hashes of the full pages of `token_ids` from page `start` on: page i's is
    blake2b-128(page i-1's hash, page i's token ids); `parent` is page start-1's (None for
    the first page). A partial last page has none."""
    hashes = []
    for i in range(start, len(token_ids) // page_size):
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(b"".join(t.to_bytes(4, "little", signed=True)
                          for t in token_ids[i * page_size:(i + 1) * page_size]))
        parent = h.digest()
        hashes.append(parent)
    return hashes


class PagePool:
    """Free list + refcounts + prefix cache over page ids 1 .. num_pages - 1 (0 is the null
    page). Counters: num_evictions (cached pages taken for new content)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"PagePool needs >= 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))  # hold nothing cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld, LRU first
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: never-cached ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Registered pages (held or evictable)."""
        return len(self._page_of)

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages (refcount 1 each): never-cached pages first, then evictable cached
        ones, least recently freed first (their hashes are forgotten). Raises OutOfPages,
        allocating nothing, if fewer than `n` are free."""
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
                self.num_evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to each page: allocated ones (a sequence forking), or cached
        evictable ones (a prefix-cache hit, which takes them off the evictable list).
        Raises ValueError for a page that is neither."""
        for p in pages:
            if self._refs[p] <= 0 and p not in self._evictable:
                raise ValueError(f"page {p} is not allocated")
        for p in pages:
            if self._refs[p] == 0:
                del self._evictable[p]
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page, in order; a page reaching zero becomes
        evictable (last in LRU order) if it is cached, else free. Raises ValueError on the
        null page or a page that is not allocated (double free)."""
        for p in pages:
            if p == NULL_PAGE or self._refs[p] <= 0:
                raise ValueError(f"freeing page {p}, which is not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._hash_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def register(self, page: int, page_hash: bytes) -> None:
        """Record that allocated `page` holds the full page whose chained hash is
        `page_hash` (its K/V computed). If another page already holds it, nothing changes
        (this one stays private and is freed as usual)."""
        if self._refs[page] <= 0:
            raise ValueError(f"registering page {page}, which is not allocated")
        if page_hash not in self._page_of and page not in self._hash_of:
            self._page_of[page_hash] = page
            self._hash_of[page] = page_hash

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `hashes` (a sequence's chained page
        hashes, in order); nothing is shared yet (`share` them to use them)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def clear_cache(self) -> None:
        """Forget every cached page (after the KV pool was made again: their K/V are gone);
        evictable pages become free."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._page_of.clear()
