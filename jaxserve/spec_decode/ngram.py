"""N-gram prompt lookup: propose the tokens that followed the sequence's own latest n-gram
the last time it occurred (in its prompt or its output). Host side, plain numpy.

Copying a passage, editing code, answering with quotes: the output repeats spans of the
context, and the n tokens just generated find where. Free to propose (no model), so it
pays whenever it is right. Source: "Prompt lookup decoding" (Saxena 2023); vLLM's
NgramProposer (the longest n in [prompt_lookup_min, prompt_lookup_max] wins).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to k draft tokens per sequence from its own tokens.

    min_n / max_n: the shortest and longest suffix n-gram looked up (tokens). The longest
    n whose suffix occurs earlier in the context wins; among its occurrences the latest
    (the one nearest the text being written); the proposal is what followed it, at most k
    tokens (fewer when the context ends first). Raises ValueError for 1 > min_n or
    min_n > max_n.
    """

    needs_context = True  # propose() reads the sequence's tokens
    # the verify step also proposes on device (jaxserve.spec_decode.ngram_device, the same
    # rule) for a sequence whose last token the host has not read yet
    proposes_ahead = True

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, context: "list[int] | np.ndarray", k: int) -> list[int]:
        """Up to `k` draft tokens to follow `context` (token ids: prompt + output so far);
        [] when no suffix n-gram of min_n..max_n tokens occurs earlier, or k <= 0."""
        ctx = np.asarray(context, dtype=np.int64)
        L = len(ctx)
        if k <= 0 or L <= self.min_n:
            return []
        # candidate occurrences, by the index of their last token: earlier positions
        # holding the last token, latest first
        ends = np.flatnonzero(ctx[:-1] == ctx[-1])[::-1]
        match = np.ones(len(ends), bool)  # ends whose n tokens match the suffix so far
        best = None
        for n in range(2, min(self.max_n, L - 1) + 1):
            ok = ends >= n - 1
            match &= ok
            match[ok] &= ctx[ends[ok] - (n - 1)] == ctx[L - n]
            if not match.any():
                break
            best = (n, ends[np.argmax(match)])  # the latest end matching n tokens
        if self.min_n == 1 and best is None and len(ends):
            best = (1, ends[0])
        if best is None or best[0] < self.min_n:
            return []
        end = best[1]
        return ctx[end + 1:end + 1 + k].tolist()
