"""Host-side allocator of KV pages: free list, reference counts, and the prefix cache of
full pages. Plain Python.

Page 0 is the null page (padding writes land there) and is never handed out. A page is
shared by reference count (prefix-cache hits, parallel sampling) and returns to the pool
when its count drops to zero.

Prefix caching: a full page whose K/V are computed can be registered under its chained
hash (`page_hashes`: the hash of the previous page and this page's tokens, so a page
matches only when its whole prefix matches). A registered page that no sequence holds
stays in the pool with its K/V, evictable: `lookup` finds it again for a later sequence
with the same prefix, and `allocate` takes it (its hash forgotten) only when no
never-cached page is left. `num_free` counts both kinds.

Which free page is handed out keeps each sequence's pages together, in extents of
consecutive page ids (`PagePool`'s docstring says how and why).

Source: PagedAttention's block manager (vLLM), vLLM v1's KVCacheManager (chained block
hashes, free-block queue with LRU eviction), nano-vllm's BlockManager.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
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


EXTENT_PAGES = 8  # pages a sequence's block table keeps together: runs of 8 recovered most of
#                  contiguous tables' decode attention speed (see PagePool)


class PagePool:
    """Free list + refcounts + prefix cache over page ids 1 .. num_pages - 1 (0 is the null
    page). Counters: num_evictions (cached pages taken for new content).

    Which free page `allocate` hands out: a sequence's pages are kept together in extents
    of `extent_pages` consecutive page ids (pages 1 + k * extent_pages onwards). Given the
    caller's last page (`after`), the next page of its extent comes first; a sequence
    that needs a new extent takes the first page of a wholly free one, and no one else
    takes pages from an extent a sequence holds while wholly free ones are left. Without
    this, sequences decoding side by side each took the next page of one FIFO list, so a
    sequence's pages were interleaved with every other's, and the C++ CPU attention
    kernel's decode read such tables markedly slower than contiguous ones; runs of 8
    pages recovered most of the difference (PERFORMANCE.md, "Decode attention and the
    page pool's layout", and "A sequence's pages kept together" for the end-to-end gain).
    Eviction keeps its order: a cached page is taken only when no never-cached page is
    left, then, first, the next page of the caller's extent (if an allocation, not a
    prefix-cache hit, opened that extent: a hit's next page may be another conversation's
    cached turn) or a whole extent of unheld pages, least recently released first, and
    last the least recently freed page.
    `extent_pages=1` gives the order of before, vLLM's (never-cached pages in the order
    freed, then cached ones least recently freed first): a baseline to measure against."""

    def __init__(self, num_pages: int, page_size: int, extent_pages: int = EXTENT_PAGES):
        if num_pages < 2:
            raise ValueError(f"PagePool needs >= 2 pages (one is the null page), got {num_pages}")
        if extent_pages < 1:
            raise ValueError(f"PagePool extent_pages must be >= 1, got {extent_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.extent_pages = extent_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld, LRU first
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.num_evictions = 0
        # per extent: its size, its unheld pages (free or evictable), its free ones; the
        # extents whose pages are all unheld / all free, in the order they became so
        num_extents = -(-(num_pages - 1) // extent_pages)
        self._extent_size = [min(extent_pages, num_pages - 1 - e * extent_pages)
                             for e in range(num_extents)]
        self._unheld = list(self._extent_size)
        self._nfree = list(self._extent_size)
        self._whole: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_extents))
        self._whole_free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_extents))
        # whether an extent's first held page since it was last whole was allocated (not
        # a prefix hit): only then may its next cached page be evicted for contiguity
        self._claimed = [False] * num_extents

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

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take `n` pages (refcount 1 each) for a sequence whose last page is `after` (None
        if it holds none), each placed after the one before it where the class docstring's
        order allows: never-cached pages first, then evictable cached ones (their hashes
        are forgotten). Raises OutOfPages, allocating nothing, if fewer than `n` are free."""
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            page = self._choose(after)
            if page in self._evictable:
                del self._page_of[self._hash_of.pop(page)]
                self.num_evictions += 1
            self._hold(page, claim=True)
            self._refs[page] = 1
            pages.append(page)
            after = page
        return pages

    def _choose(self, after: int | None) -> int:
        """The unheld page to hand out next to a sequence whose last page is `after`."""
        nxt = None
        if after is not None and (after % self.extent_pages) and after + 1 < self.num_pages:
            nxt = after + 1  # `after` is not the last page of its extent
        if self._free:
            if nxt in self._free:
                return nxt
            if self._whole_free:
                return self._first_page(next(iter(self._whole_free)))
            return next(iter(self._free))
        if nxt in self._evictable and self._claimed[self._extent(nxt)]:
            return nxt  # out of LRU order only in an extent an allocation opened
        if self._whole:
            return self._first_page(next(iter(self._whole)))
        return next(iter(self._evictable))

    def _extent(self, page: int) -> int:
        return (page - 1) // self.extent_pages

    def _first_page(self, extent: int) -> int:
        return 1 + extent * self.extent_pages

    def _hold(self, page: int, claim: bool) -> None:
        """Bookkeeping of an unheld page becoming held: allocated (`claim`: a whole extent
        it opens is its sequence's to continue in) or shared (a prefix-cache hit)."""
        e = self._extent(page)
        if self._unheld[e] == self._extent_size[e]:
            del self._whole[e]
            self._claimed[e] = claim
        self._unheld[e] -= 1
        if page in self._free:
            if self._nfree[e] == self._extent_size[e]:
                del self._whole_free[e]
            self._nfree[e] -= 1
            del self._free[page]
        else:
            del self._evictable[page]

    def _release(self, page: int) -> None:
        """Bookkeeping of a held page whose last reference was dropped."""
        e = self._extent(page)
        self._unheld[e] += 1
        if self._unheld[e] == self._extent_size[e]:
            self._whole[e] = None
            self._claimed[e] = False
        if page in self._hash_of:
            self._evictable[page] = None
        else:
            self._add_free(page)

    def _add_free(self, page: int) -> None:
        e = self._extent(page)
        self._free[page] = None
        self._nfree[e] += 1
        if self._nfree[e] == self._extent_size[e]:
            self._whole_free[e] = None

    def share(self, pages: list[int]) -> None:
        """Add a reference to each page: allocated ones (a sequence forking), or cached
        evictable ones (a prefix-cache hit, which takes them off the evictable list).
        Raises ValueError for a page that is neither."""
        for p in pages:
            if self._refs[p] <= 0 and p not in self._evictable:
                raise ValueError(f"page {p} is not allocated")
        for p in pages:
            if self._refs[p] == 0:
                self._hold(p, claim=False)
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
                self._release(p)

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
        evictable, self._evictable = self._evictable, OrderedDict()
        for p in evictable:
            self._add_free(p)
        self._hash_of.clear()
        self._page_of.clear()
