"""The KV cache manager: which pages each sequence holds, and the prefix cache. Plain Python.

Pages follow a sequence's computed tokens: `allocate` grows its block table to hold a
number of tokens, `free` gives all its pages back (last page first), `trim` gives back
those past what its tokens need (rejected draft tokens). With prefix caching on, every
full page whose K/V are computed is registered under the chained hash of its tokens and
all before them (`cache_full_pages`), and a sequence admitted from the queue first takes
the cached pages of its longest cached prefix (`take_cached_prefix`), by reference count.
The policy of who runs and who is preempted is the scheduler's; this class only answers
what fits and keeps the books.

Writes, of a Sequence: `block_table`, `page_hashes` and `num_cached_pages` (and nothing
else). Reads its tokens (`ids`, `num_tokens`, `num_known`) and `num_computed`.

Source: vLLM v1's KVCacheManager (allocate_slots / get_computed_blocks / free /
cache_full_blocks, chained block hashes); nano-vllm's BlockManager.
"""

from __future__ import annotations

from jaxserve.engine.page_pool import PagePool, page_hashes
from jaxserve.engine.sequence import Sequence


class KVCacheManager:
    """The pages of every live sequence over one PagePool.

    Counters (vLLM's names): prefix_cache_queries / prefix_cache_hits: prompt tokens looked
    up in the prefix cache at admission, and those found."""

    def __init__(self, pool: PagePool, enable_prefix_caching: bool):
        self.pool = pool
        self.page_size = pool.page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free(self) -> int:
        """Pages free now (cached but unheld pages count: they are taken when needed)."""
        return self.pool.num_free

    def pages_for(self, num_tokens: int) -> int:
        return self.pool.pages_for(num_tokens)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs for its block table to hold `num_tokens` tokens."""
        return max(0, self.pool.pages_for(num_tokens) - len(seq.block_table))

    def room(self, seq: Sequence, n: int, reserve: int) -> int:
        """The most of `n` next tokens of `seq` (after its computed ones) whose pages fit in
        its block table and the free pages, keeping `reserve` of them free."""
        have = len(seq.block_table) * self.page_size - seq.num_computed
        room = have + max(0, self.pool.num_free - reserve) * self.page_size
        return max(0, min(n, room))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens. Raises OutOfPages (from the
        pool) if the free pages do not hold them: callers check `room` first."""
        need = self.pages_needed(seq, num_tokens)
        if need:
            seq.block_table += self.pool.allocate(need, self._last_page(seq))

    def allocate_all(self, seqs: list[Sequence], num_tokens: list[int]) -> bool:
        """Give each of `seqs` the pages of its `num_tokens`, if the free pages hold them
        all; otherwise allocate nothing. Returns whether it allocated."""
        need = [self.pages_needed(s, n) for s, n in zip(seqs, num_tokens)]
        if sum(need) > self.pool.num_free:
            return False
        for seq, n in zip(seqs, need):
            if n:
                seq.block_table += self.pool.allocate(n, self._last_page(seq))
        return True

    @staticmethod
    def _last_page(seq: Sequence) -> int | None:
        """The page the pool should hand out the next of (its pages kept together)."""
        return seq.block_table[-1] if seq.block_table else None

    def trim(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Give back the pages of `seq` past those of its first `num_tokens` tokens (default:
        all its tokens; the pages of rejected draft tokens), last page first."""
        keep = self.pool.pages_for(seq.num_tokens if num_tokens is None else num_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:][::-1])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Give back every page of `seq`; its registered pages stay cached."""
        if seq.block_table:
            # last page first: a sequence's tail pages are evicted before its head, which
            # other prompts are likelier to share (vLLM does the same)
            self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_cached_pages = 0

    # --- prefix cache -------------------------------------------------------------------

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Give `seq` (waiting, no pages) the cached pages of the longest prefix of its full
        pages, leaving at least its last token to compute; returns the tokens they hold
        (the sequence then starts computing there). A sequence that computes its whole
        prompt (prompt logprobs, a mean-pooled embedding) takes none."""
        if not self.enable_prefix_caching or seq.computes_whole_prompt:
            return 0
        usable = (seq.num_tokens - 1) // self.page_size
        pages = self.pool.lookup(self._hashes(seq, usable))
        self.pool.share(pages)
        seq.block_table = pages
        seq.num_cached_pages = len(pages)
        return len(pages) * self.page_size

    def count_admission(self, seq: Sequence, hit_tokens: int) -> None:
        """Count an admitted sequence's prompt lookup: its tokens queried, `hit_tokens` found."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += hit_tokens

    def prefix_in_progress(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether one of `running` is computing, as a prompt chunk, the first page of
        waiting `seq`'s prefix that is not cached yet (their page hashes agree there)."""
        if not self.enable_prefix_caching or seq.computes_whole_prompt:
            return False
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.page_size)
        cached = len(self.pool.lookup(hashes))
        if cached == len(hashes):
            return False
        return any(len(r.page_hashes) > cached and r.page_hashes[cached] == hashes[cached]
                   and r.num_computed < r.num_known for r in running)

    def cache_full_pages(self, seq: Sequence) -> None:
        """Register `seq`'s full pages whose K/V are computed (and tokens known)."""
        full = min(seq.num_computed, seq.num_known) // self.page_size
        if self.enable_prefix_caching and full > seq.num_cached_pages:
            for i, h in enumerate(self._hashes(seq, full)[seq.num_cached_pages:],
                                  start=seq.num_cached_pages):
                self.pool.register(seq.block_table[i], h)
            seq.num_cached_pages = full

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (their K/V are gone: a fresh KV pool)."""
        self.pool.clear_cache()

    def _hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """`seq`'s chained hashes of its first `num_pages` full pages (of known tokens),
        computed once each; the first chained to its cache_salt (a LoRA adapter's: pages
        computed under another adapter, or none, never match)."""
        have = len(seq.page_hashes)
        if num_pages > have:
            ids = seq.ids(0, num_pages * self.page_size)
            seq.page_hashes += page_hashes(ids, self.page_size, have,
                                           seq.page_hashes[-1] if have else seq.cache_salt)
        return seq.page_hashes[:num_pages]
